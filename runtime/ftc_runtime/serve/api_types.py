"""What both HTTP APIs share: the strict request-body base, the UTF-8 JSON route, tool names, and
the error they answer with (`ApiError`, shaped per API by `error_response`)."""

from __future__ import annotations

import json
import re
from typing import Annotated

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import AfterValidator, BaseModel, ConfigDict

from ftc_runtime.serve.guard import NAMESPACE, error_body

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _tool_name(name: str) -> str:
    if not TOOL_NAME.match(name):
        raise ValueError(f"tool name {name!r}: expected 1-64 letters, digits, '_' or '-'")
    return name


# A tool's name as both APIs constrain it, for their request models.
ToolName = Annotated[str, AfterValidator(_tool_name)]
MAX_TOKENS = 2**31 - 1  # the largest max_tokens taken (and clamped to the server's limit)


class ApiBody(BaseModel):
    """A request body's part in both APIs: fields this server does not use are accepted; values are
    not converted (a string is not a number, true is not 1)."""

    model_config = ConfigDict(extra="allow", strict=True)


def unique_tool_names(names: list[str]) -> None:
    seen = set()
    for name in names:
        if name in seen:
            raise ValueError(f"tool {name!r} is defined twice")
        seen.add(name)


class StrictJsonRoute(APIRoute):
    """A route whose JSON body must be UTF-8 (json.loads guesses UTF-16 and -32 from bytes) and
    hold only valid Unicode: JSON can spell a lone surrogate (\\ud800), which no tokenizer takes."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            body = await request.body()
            if body:
                try:
                    text = body.decode("utf-8")
                    parsed = json.loads(text)
                    json.dumps(parsed, ensure_ascii=False).encode("utf-8")
                except UnicodeError as e:
                    return error_response(request, 400, f"the body is not valid UTF-8 text: {e.reason}", None)
                except (ValueError, RecursionError):
                    return await handler(request)  # not JSON: the route's own parser says why
                request._json = parsed  # Starlette's cache of the parsed body: parsed once
            return await handler(request)

        return checked


class ApiError(Exception):
    """An error answer (4xx for the request, 500 where the engine failed on it): `status`, a
    message naming the field or value, the field (`param`), the API's error type (`kind`)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def namespace_of(request: Request) -> str:
    """The prefix-cache namespace of the key that authorized the request ("" without keys)."""
    return request.scope.get(NAMESPACE, "")


def error_response(request: Request, status: int, message: str, param: str | None,
           kind: str = "invalid_request_error") -> Response:
    status, body = error_body(request.url.path, status, message, param, kind)
    return Response(body, status_code=status, media_type="application/json")
