"""`TokenStream`: one request's text as the engine thread produces it, which every route reads,
cut at its stop strings (`StopMatcher`); `with_keepalive` (SSE lines while a stream has nothing to
say, so that no client's idle watchdog fires during a long prefill)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from ftc_runtime.chat.stop_strings import StopMatcher
from ftc_runtime.chat.tokenizer import StreamDecoder
from ftc_runtime.chat.tool_parsers import ReasoningSplitter, ToolCallStream, ToolParser
from ftc_runtime.engine import Engine
from ftc_runtime.sampling import SamplingParams
from ftc_runtime.serve.scheduler import Request as EngineRequest
from ftc_runtime.serve.scheduler import Scheduler

MAX_STOPS = 16  # stop strings per request
MAX_STOP_CHARS = 512  # characters of one stop string


class TokenStream:
    """`deltas()` yields text pieces, then ends; `finish_reason` ("stop", "length", "error"),
    `error` (its message) and `completion_tokens` are set by then. Stop strings end it early (the
    text is cut before them). Leaving the iteration early cancels the request. `opening` is text
    the prompt already ends with on the answer's behalf (a forced tool call's tag): it leads the
    deltas. Tokens become text on the engine thread, as they come, so that detokenizing never
    holds the event loop that serves every other request."""

    def __init__(self, engine: Engine, scheduler: Scheduler, prompt_ids: list[int], max_new_tokens: int,
                 sampling: SamplingParams, stop: list[str], namespace: str = "", opening: str = ""):
        self.engine, self.stops, self.opening = engine, StopMatcher(stop), opening
        self.loop = asyncio.get_running_loop()
        # (token or None at the end, its text, the end's reason), put by the engine thread
        self.queue: asyncio.Queue[tuple[int | None, str, str | None]] = asyncio.Queue()
        self.decoder = StreamDecoder(engine.tokenizer)
        self.finish_reason: str | None = None
        self.stop_sequence: str | None = None  # the stop string that ended the text, if one did
        self.error: str | None = None
        self.completion_tokens = 0
        self.prompt_tokens = len(prompt_ids)
        self.request = EngineRequest(prompt_ids, max_new_tokens, sampling, self._on_token,
                                     frozenset(engine.spec.eos_token_ids), namespace=namespace)
        scheduler.submit(self.request)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache restored (set when the engine admitted the request)."""
        return self.request.reused_tokens

    def _on_token(self, token: int | None, reason: str | None) -> None:  # the engine thread
        if token is None:
            delta = self.decoder.flush()
        elif token in self.request.stop_ids or token in self.engine.hidden_token_ids:
            delta = ""  # end-of-sequence and control tokens count, but show no text
        else:
            delta = self.decoder.push(token)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (token, delta, reason))

    async def deltas(self) -> AsyncIterator[str]:
        engine_done = False
        try:
            if self.opening:
                yield self.opening
            while True:
                token, delta, reason = await self.queue.get()
                if token is None:
                    engine_done = True
                    self._ended(reason)
                else:
                    self.completion_tokens += 1
                    if not delta:
                        continue
                text = self.stops.feed(delta)
                if self.stops.hit is not None:
                    self.stop_sequence, self.finish_reason = self.stops.hit, "stop"
                if text:
                    yield text
                if self.stops.hit is not None:
                    return
                if token is None:
                    if rest := self.stops.flush():
                        yield rest
                    if self.stops.hit is not None:  # the end held a stop string back
                        self.stop_sequence, self.finish_reason = self.stops.hit, "stop"
                    return
        finally:
            if not engine_done:  # a stop string, or the client gone: the engine drops the request
                self.request.cancel()

    def _ended(self, reason: str | None) -> None:
        self.finish_reason = reason if reason in ("length", "error") else "stop"
        if reason == "error":
            self.error = self.request.error or "the engine failed on this request"

    async def text(self, http: Request | None = None) -> str:
        """The whole text; with `http`, a client that leaves first cancels the request (a streamed
        answer is cancelled by its response instead)."""
        watch = asyncio.create_task(self._watch(http)) if http is not None else None
        try:
            return "".join([d async for d in self.deltas()])
        finally:
            if watch is not None:
                watch.cancel()

    async def _watch(self, http: Request) -> None:
        while not await http.is_disconnected():
            await asyncio.sleep(0.25)
        self.request.cancel()
        self.queue.put_nowait((None, "", "cancelled"))


async def message_parts(stream: TokenStream, parser: ToolParser, tools: list[dict[str, Any]],
                        one_call: bool = False) -> AsyncIterator[tuple[str, Any]]:
    """The answer as it streams: ("reasoning", text), ("content", text), and where tools were
    offered ("tool_call", ToolCall) as soon as each call's block closes; with `one_call`, the
    first call only (parallel calls turned off)."""
    reasoning = ReasoningSplitter()
    calls = ToolCallStream(parser, tools) if tools else None
    n_calls = 0

    def route(pieces: list[tuple[str, str]]) -> list[tuple[str, Any]]:
        nonlocal n_calls
        out: list[tuple[str, Any]] = []
        for kind, text in pieces:
            for part in [(kind, text)] if kind == "reasoning" or calls is None else calls.feed(text):
                if part[0] == "tool_call":
                    n_calls += 1
                    if one_call and n_calls > 1:
                        continue
                out.append(part)
        return out

    async for delta in stream.deltas():
        for part in route(reasoning.feed(delta)):
            yield part
    for part in route(reasoning.flush()) + (calls.flush() if calls is not None else []):
        yield part


async def with_keepalive(items: AsyncIterator[str], ping: str, every: float) -> AsyncIterator[str]:
    """`items`, with `ping` sent whenever `every` seconds pass without one (prefill can take
    minutes before the first token). Closing this closes `items` (a client that leaves cancels)."""
    source = aiter(items)
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield ping
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await source.aclose()
