"""`Scheduler`: one engine thread serving many requests. Each loop admits waiting requests, runs
one chunk of the oldest prompt still being read (the engine's prefill chunk when nothing else is
decoding, else at most `prompt_chunk` tokens, so that a long prompt does not stall the others'
decoding for its whole length), then one decode step for every running request together
(`decode_batch`), and hands each request its new token through its callback. With the engine's
speculation, a request that decodes alone drafts and verifies its drafts a pass at a time
(`Sequence.step`), each token it gives out handed over in turn. A cancelled request (its client
gone) leaves before the next step, or within one layer of the prompt chunk it is in, and its KV
cache is freed with it. A request that fails ends alone, with the reason "error" and a message;
the others go on, and no request can end the engine thread. `stop` ends every request within a
layer, then the thread.
Each request is a `generation.Sequence`, the steps `Engine.generate` drives one sequence through
(with the engine's prefix cache: resumed after its longest cached prefix, the hybrid models' state
kept after each boundary token, its tokens inserted when it ends, unless it failed)."""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Protocol

from ftc_runtime.engine import Engine
from ftc_runtime.experts.vram_plan import VramError
from ftc_runtime.generation import Sequence, decode_step
from ftc_runtime.sampling import SamplingParams

# What a request's callback receives, on the engine thread: (token id, None) for each new token,
# then (None, finish reason) once: "stop" (a stop token), "length" (max_new_tokens), "cancelled"
# or "error".
TokenCallback = Callable[[int | None, str | None], None]
_IDS = itertools.count()


class Request(Sequence):
    """A served sequence: its steps run on the engine thread, which hands it each token through
    `on_token`; any thread may cancel it."""

    def __init__(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams, on_token: TokenCallback,
                 stop_ids: frozenset[int] = frozenset(), namespace: str = ""):
        super().__init__(prompt_ids, max_new_tokens, sampling, stop_ids, namespace)
        self.on_token = on_token
        self.id = next(_IDS)
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.error: str | None = None  # why it ended with "error", for the client
        # For the metrics and the request's log line (engine thread).
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None

    def cancel(self) -> None:
        """Asks the engine thread to drop the request before its next step (any thread may call)."""
        self.cancelled.set()


class RequestObserver(Protocol):
    """Told of each token and each finished request, on the engine thread (`metrics.RequestMetrics`)."""

    def token(self, r: Request) -> None: ...

    def finished(self, r: Request, reason: str) -> None: ...


class Scheduler:
    def __init__(self, engine: Engine, max_batch: int = 16, metrics: RequestObserver | None = None,
                 prompt_chunk: int = 512):
        if max_batch < 1 or prompt_chunk < 1:
            raise ValueError(f"max_batch = {max_batch}, prompt_chunk = {prompt_chunk}: expected at least 1")
        self.engine, self.max_batch, self.prompt_chunk = engine, max_batch, prompt_chunk
        self.metrics = metrics
        self.waiting: queue.Queue[Request | None] = queue.Queue()
        self.reading: list[Request] = []  # admitted, prompt not yet run through
        self.running: list[Request] = []
        # For /metrics (written by the engine thread only): requests, time to first token, prompt
        # tokens and their time, decode steps with the tokens they made together and their time.
        self.requests = 0
        self.ttft_s = 0.0
        self.first_tokens = 0
        self.prefill_tokens = 0
        self.prefill_s = 0.0
        self.decode_steps = 0
        self.decode_tokens = 0
        self.decode_s = 0.0
        self.drafted = 0  # draft tokens verified, and accepted of those (speculation)
        self.accepted = 0
        self._stopped = threading.Event()
        self._admission = threading.Lock()  # a request submitted as the thread ends is failed, not lost
        self._thread = threading.Thread(target=self._loop, name="ftc-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """The engine thread runs and takes requests (what /health reports)."""
        return self._thread.is_alive() and not self._stopped.is_set()

    def submit(self, request: Request) -> None:
        with self._admission:
            if self.alive:
                self.waiting.put(request)
                return
        request.error = "the server is shutting down"
        _notify(request, None, "error")

    def stop(self) -> None:
        """Ends every request (reason "error") within a layer of the work in flight, then the
        engine thread; returns at once (any thread)."""
        self._stopped.set()
        self.waiting.put(None)

    def close(self, timeout: float = 5.0) -> None:
        self.stop()
        self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        while not self._stopped.is_set():
            try:
                self._iteration()
            except Exception:  # noqa: BLE001 (a bug outside any one request: its requests end, the thread goes on)
                traceback.print_exc()
                for r in self.running + self.reading:
                    self._fail(r, "internal error in the engine loop (see the server log)")
        with self._admission:
            left = self._drain()
        for r in self.running + self.reading + left:
            self._fail(r, "the server is shutting down")

    def _iteration(self) -> None:
        self._admit(block=not self.running and not self.reading)
        for r in [r for r in self.running + self.reading if r.cancelled.is_set()]:
            self._finish(r, "cancelled")
        self._safe_point()
        if self.reading:
            self._read_prompt(self.reading[0])
        if self.running:
            self._step()

    def _drain(self) -> list[Request]:
        out = []
        while True:
            try:
                r = self.waiting.get_nowait()
            except queue.Empty:
                return out
            if r is not None:
                out.append(r)

    def _safe_point(self) -> None:
        """Between steps nothing holds an expert slot: the slots are fitted to the KV that the next
        prompt chunk and decode step need. When even no slots leave room, the prompt being read
        (else the newest running request) ends with an error; the others go on."""
        while self.running or self.reading:
            needs = [r.kv_need() for r in self.running + self.reading[:1]]
            try:
                self.engine.rebalance(needs)
                return
            except VramError as e:
                victim = self.reading[0] if self.reading else self.running[-1]
                print(f"ftc: request {victim.id} ends: {e}", file=sys.stderr)
                self._fail(victim, str(e))

    def _admit(self, block: bool) -> None:
        while len(self.running) + len(self.reading) < self.max_batch:
            try:
                r = self.waiting.get(block=block)
            except queue.Empty:
                return
            if r is None:  # stop()
                return
            block = False
            if r.cancelled.is_set():
                self._finish(r, "cancelled")
                continue
            self.requests += 1
            try:
                self._start(r)
            except Exception as e:  # noqa: BLE001 (reported to this request alone)
                traceback.print_exc()
                self._fail(r, f"the request could not start: {e}")

    def _start(self, r: Request) -> None:
        r.speculation = self.engine.speculation
        r.start(self.engine)
        self.reading.append(r)

    def _read_prompt(self, r: Request) -> None:
        """One chunk of r's prompt; after the last, its first token."""
        t0, done = time.perf_counter(), r.prompt_done
        try:
            # Alone, a prompt runs in the engine's own chunks (a GPU streams whole layers per chunk:
            # bigger is faster); beside requests that are decoding, in short ones between their steps.
            chunk = self.engine.prefill_chunk if not self.running else min(self.prompt_chunk, self.engine.prefill_chunk)
            token = r.read_prompt(self.engine, chunk, between_layers=lambda: self._check_in(r))
            if token is None:
                return
            self.reading.remove(r)
        except _Abandoned:
            self._finish(r, "cancelled")
            return
        except Exception as e:  # noqa: BLE001 (reported to this request alone)
            traceback.print_exc()
            self._fail(r, f"the prompt failed: {e}")
            return
        finally:
            self.prefill_tokens += r.prompt_done - done
            self.prefill_s += time.perf_counter() - t0
        self.ttft_s += time.perf_counter() - r.submitted
        self.first_tokens += 1
        self._accept(r, token)

    def _check_in(self, r: Request) -> None:
        """Between two layers of r's prompt chunk: abandons it if its client left or the server stops."""
        if r.cancelled.is_set() or self._stopped.is_set():
            raise _Abandoned

    def _step(self) -> None:
        batch = list(self.running)
        if len(batch) == 1 and not self.reading and batch[0].speculation is not None:
            self._speculative_step(batch[0])
            return
        t0 = time.perf_counter()
        try:
            logits = decode_step(self.engine, batch)
        except Exception as e:  # noqa: BLE001 (a failed step ends its requests, not the server)
            traceback.print_exc()
            for r in batch:
                self._fail(r, f"the decode step failed: {e}")
            return
        self.decode_steps += 1
        self.decode_tokens += len(batch)
        self.decode_s += time.perf_counter() - t0
        for r, row in zip(batch, logits, strict=True):
            try:  # one request's sampling cannot fail its batch mates
                token = r.advance(self.engine, row)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                self._fail(r, f"sampling failed: {e}")
                continue
            self._accept(r, token)

    def _speculative_step(self, r: Request) -> None:
        """r alone: its next token and its drafts in one pass, each token it gives out handed over
        until one ends it."""
        t0, drafted, accepted = time.perf_counter(), r.drafted, r.accepted
        try:
            tokens = r.step(self.engine)
        except Exception as e:  # noqa: BLE001 (a failed step ends its request, not the server)
            traceback.print_exc()
            self._fail(r, f"the decode step failed: {e}")
            return
        self.decode_steps += 1
        self.decode_tokens += len(tokens)
        self.decode_s += time.perf_counter() - t0
        self.drafted, self.accepted = self.drafted + r.drafted - drafted, self.accepted + r.accepted - accepted
        for token in tokens:
            self._accept(r, token)
            if r not in self.running:  # ended
                return

    def _accept(self, r: Request, token: int) -> None:
        end = r.accept(token)
        if self.metrics is not None:
            self.metrics.token(r)
        _notify(r, token, None)
        if end is not None:
            self._finish(r, end)
        elif r not in self.running:
            self.running.append(r)

    def _finish(self, r: Request, reason: str) -> None:
        for group in (self.running, self.reading):
            if r in group:
                group.remove(r)
        r.finish(keep=reason != "error")  # a failed step may have left the cache half-written
        if self.metrics is not None:
            self.metrics.finished(r, reason)
        _notify(r, None, reason)

    def _fail(self, r: Request, message: str) -> None:
        r.error = message
        self._finish(r, "error")


class _Abandoned(Exception):
    """Raised between layers of a prompt chunk whose request was cancelled or whose server stops."""


def _notify(r: Request, token: int | None, reason: str | None) -> None:
    try:
        r.on_token(token, reason)
    except Exception:  # noqa: BLE001 (a callback whose client is gone must not stop the engine)
        r.cancel()
