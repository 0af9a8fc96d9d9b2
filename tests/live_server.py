"""A real ftc server on loopback for tests: uvicorn in a thread over an engine loaded in this process."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from ftc_runtime import Engine
from ftc_runtime.sampling import Sampler
from ftc_runtime.serve.app import ServerConfig, create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(engine: Engine, **config) -> Iterator[str]:
    """The base URL of a server of `engine` (ServerConfig fields as keywords), stopped on exit."""
    with serving_app(create_app(engine, ServerConfig(model_name=engine.spec.name, **config))) as base:
        yield base


@contextmanager
def serving_app(app, **options) -> Iterator[str]:
    """The base URL of the ASGI `app` served on a free loopback port (more uvicorn.Config options as
    keywords), stopped on exit."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def script_sampler(monkeypatch, script: list[int], method: str = "__call__") -> dict:
    """Every sampler's `method` (its whole choice, or `_pick`: sampling alone) returns the
    script's tokens in turn, the last one ever after. Returns the per-sampler positions."""
    position: dict[int, int] = {}

    def scripted(self, logits):
        i = position.setdefault(id(self), 0)
        position[id(self)] = i + 1
        return script[min(i, len(script) - 1)]

    monkeypatch.setattr(Sampler, method, scripted)
    return position
