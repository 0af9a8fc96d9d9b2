"""A recording reverse proxy on loopback: every request an agent harness sends to the ftc server
passes through it, and its method, path, headers, body, status and (streamed) answer are kept.
The server runs unchanged in its own process (`ftc run --serve`); nothing is patched into it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from live_server import serving_app

# Per-hop headers, and Accept-Encoding so that answers are recorded as the plain text they are.
_HOP = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
        "proxy-connection", "accept-encoding"}
_KEEP_RESPONSE_BYTES = 4 << 20


@dataclass
class Exchange:
    method: str
    path: str  # with the query string
    request_headers: dict[str, str]
    request_body: bytes
    started: float = field(default_factory=time.time)
    status: int | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    response_body: bytearray = field(default_factory=bytearray)
    ended: float | None = None
    error: str | None = None  # the upstream failed, or the client left mid-answer

    def json(self) -> Any:
        """The request body as JSON (None when it is not)."""
        try:
            return json.loads(self.request_body) if self.request_body else None
        except ValueError:
            return None

    @property
    def text(self) -> str:
        return self.response_body.decode("utf-8", errors="replace")

    def to_dict(self, max_body: int = 200_000) -> dict[str, Any]:
        body = self.json()
        return {"method": self.method, "path": self.path, "status": self.status, "error": self.error,
                "seconds": round((self.ended or time.time()) - self.started, 3),
                "request_headers": self.request_headers,
                "request_body": body if body is not None else self.request_body[:max_body].decode(errors="replace"),
                "response_headers": self.response_headers, "response_body": self.text[:max_body]}


class RecordingProxy:
    """An ASGI app forwarding every HTTP request to `upstream` and recording it in `exchanges`."""

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        query = scope.get("query_string", b"").decode("latin-1")
        ex = Exchange(scope["method"], scope["path"] + (f"?{query}" if query else ""), headers, bytes(body))
        self.exchanges.append(ex)
        try:
            await self._forward(ex, send)
        finally:
            ex.ended = time.time()

    async def _forward(self, ex: Exchange, send) -> None:
        if self._client is None:  # made on the server's own event loop
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10))
        forwarded = {k: v for k, v in ex.request_headers.items() if k.lower() not in _HOP}
        request = self._client.build_request(ex.method, self.upstream + ex.path, headers=forwarded,
                                             content=ex.request_body)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as e:
            ex.status, ex.error = 502, f"upstream: {e!r}"
            await send({"type": "http.response.start", "status": 502, "headers": []})
            await send({"type": "http.response.body", "body": ex.error.encode()})
            return
        ex.status = response.status_code
        ex.response_headers = dict(response.headers)
        out = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.items()
               if k.lower() not in _HOP or k.lower() == "content-length"]
        try:
            await send({"type": "http.response.start", "status": response.status_code, "headers": out})
            async for chunk in response.aiter_raw():
                if len(ex.response_body) < _KEEP_RESPONSE_BYTES:
                    ex.response_body += chunk
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except (httpx.HTTPError, OSError) as e:  # the server broke the stream, or the client left
            ex.error = f"mid-answer: {e!r}"
        finally:
            await response.aclose()


@contextmanager
def recording_proxy(upstream: str) -> Iterator[tuple[str, RecordingProxy]]:
    """(base URL of the proxy, the proxy) in front of `upstream`, stopped on exit."""
    proxy = RecordingProxy(upstream)
    # The upstream's Date and Server headers pass through: uvicorn adds none of its own.
    with serving_app(proxy, lifespan="off", server_header=False, date_header=False) as base:
        yield base, proxy


def sse_events(text: str) -> list[tuple[str | None, Any]]:
    """Server-sent events as (event name, data parsed as JSON, or the raw string '[DONE]').
    Raises ValueError on data that is neither: what a client's stream parser would choke on."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith(":"):
                continue  # an SSE comment (keep-alive)
            key, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if key == "event":
                name = value
            elif key == "data":
                data.append(value)
        if not data:
            continue
        raw = "\n".join(data)
        events.append((name, raw if raw == "[DONE]" else json.loads(raw)))
    return events
