"""`RequestGuard`: what every request passes before a route sees it, as plain ASGI middleware:
the Host header (DNS rebinding), the API key, and the body's size, counted as it arrives so that
a body over the cap is refused before it is parsed. Plain ASGI rather than Starlette's
`BaseHTTPMiddleware`, which hides a client's disconnect from the route (a non-streamed answer
then runs on for nobody). Errors take the shape of the API the path belongs to."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Where a route finds the namespace of the key that authorized it (its prefix-cache namespace).
NAMESPACE = "ftc.namespace"
# Answered without a key: liveness probes, and the root that clients probe before their first
# request (Claude Code sends HEAD / unauthenticated); neither tells anything about the model.
OPEN_PATHS = ("/", "/health")


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than this server takes ({limit} bytes; --max-body-bytes)")


def error_body(path: str, status: int, message: str, param: str | None = None,
               kind: str = "invalid_request_error") -> tuple[int, bytes]:
    """The error in the shape of the API that `path` belongs to (Anthropic's for /v1/messages),
    as UTF-8 JSON: text that is not valid Unicode (a lone surrogate echoed from the request) is
    escaped rather than failing the answer."""
    if path.startswith("/v1/messages"):
        body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return status, json.dumps(body, ensure_ascii=False).encode("utf-8", "backslashreplace")


class RequestGuard:
    def __init__(self, app: ASGIApp, api_keys: tuple[str, ...], allowed_hosts: tuple[str, ...] | None,
                 max_body_bytes: int, open_paths: tuple[str, ...] = OPEN_PATHS):
        self.app, self.max_body_bytes, self.open_paths = app, max_body_bytes, open_paths
        self.keys = [k.encode("utf-8") for k in api_keys]
        self.hosts = None if allowed_hosts is None or "*" in allowed_hosts else {h.lower() for h in allowed_hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope["headers"]}
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await _respond(send, *error_body(scope["path"], *refusal))
            return
        length = headers.get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await _respond(send, *error_body(scope["path"], 413, BodyTooLarge(self.max_body_bytes).detail))
            return
        await self.app(scope, self._counted(receive), send)

    def _refusal(self, scope: Scope, headers: dict[bytes, bytes]) -> tuple[int, str, None, str] | None:
        host = _host_name(headers.get(b"host", b""))
        if self.hosts is not None and host not in self.hosts:
            return (403, f"Host {host!r} is not one this server answers to (--allowed-hosts)", None,
                    "permission_error")
        if self.keys and scope["path"] not in self.open_paths:
            key = self._key(headers)
            if key is None:
                return (401, "missing or wrong API key (send Authorization: Bearer KEY or x-api-key: KEY)", None,
                        "authentication_error")
            scope[NAMESPACE] = hashlib.sha256(key).hexdigest()[:16]
        return None

    def _key(self, headers: dict[bytes, bytes]) -> bytes | None:
        """The configured key the request sent, compared as UTF-8 bytes in constant time."""
        given = headers.get(b"x-api-key", b"")
        bearer = headers.get(b"authorization", b"")
        if not given and bearer[:7].lower() == b"bearer ":
            given = bearer[7:].strip()
        found = None
        for key in self.keys:  # every key compared, so the time tells nothing about which one
            if hmac.compare_digest(given, key):
                found = key
        return found

    def _counted(self, receive: Receive) -> Receive:
        """`receive` that refuses a body growing past the cap (chunked bodies have no length)."""
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        return counted


def _host_name(host: bytes) -> str:
    """The Host header's name without its port ('[::1]:8000' → '::1')."""
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


async def _respond(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
