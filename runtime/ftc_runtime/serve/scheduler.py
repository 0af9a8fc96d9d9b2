"""`Scheduler`: one engine thread serving many requests. Each loop admits waiting requests, runs
one chunk of the oldest prompt still being read (the engine's prefill chunk when nothing else is
decoding, else at most `prompt_chunk` tokens, so that a long prompt does not stall the others'
decoding for its whole length), then one decode step for every
running request together (`decode_batch`), and hands each request its new token through its
callback. A cancelled request (its client gone) leaves before the next step, or within one layer
of the prompt chunk it is in, and its KV cache is freed with it. A request that fails ends alone,
with the reason "error" and a message; the others go on, and no request can end the engine
thread. `stop` ends every request within a layer, then the thread.
With the engine's prefix cache, a prompt resumes after its longest cached prefix, the hybrid
models' state is kept after each boundary token (taken inside prompt chunks), and a finished
request's tokens go into the cache."""

from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ftc_runtime.cache.base import SequenceState
from ftc_runtime.cache.prefix import Resume
from ftc_runtime.engine import Engine
from ftc_runtime.experts.vram_plan import VramError
from ftc_runtime.sampling import Sampler, SamplingParams

# What a request's callback receives, on the engine thread: (token id, None) for each new token,
# then (None, finish reason) once: "stop" (a stop token), "length" (max_new_tokens), "cancelled"
# or "error".
TokenCallback = Callable[[int | None, str | None], None]
_IDS = itertools.count()


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    on_token: TokenCallback
    stop_ids: frozenset[int] = frozenset()
    id: int = field(default_factory=lambda: next(_IDS))
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    # Engine-thread state: the sequence's KV cache and sampler while it runs.
    cache: SequenceState | None = None
    sampler: Sampler | None = None
    produced: int = 0
    next_token: int | None = None
    prompt_done: int = 0  # prompt tokens run so far (or restored from the prefix cache)
    # With the prefix cache: the namespace it shares cached prefixes within (one per API key), the
    # nodes it resumed from, the tokens the cache holds, and whether to keep recurrent-state
    # checkpoints after boundary tokens (in the cache's `checkpoints`).
    namespace: str = ""
    resume: Resume | None = None
    seq: list[int] = field(default_factory=list)
    checkpoints: bool = False
    error: str | None = None  # why it ended with "error", for the client
    # For the metrics and the request's log line (engine thread).
    reused_tokens: int = 0  # prompt tokens restored from the prefix cache
    first_token_at: float | None = None
    last_token_at: float | None = None

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
            needs = [(r.cache, r.cache.length + 1) for r in self.running]
            needs += [(r.cache, len(r.prompt_ids)) for r in self.reading[:1]]
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
        """A new sequence for r: its cache and sampler (which penalizes repeats of the whole prompt,
        restored from the prefix cache or not), resumed after its longest cached prefix."""
        r.cache, r.sampler = self.engine.model.new_cache(), Sampler(r.sampling, r.prompt_ids)
        prefix = self.engine.prefix_cache
        if prefix is not None:
            r.resume = prefix.resume(r.prompt_ids, r.cache, r.namespace)
            r.prompt_done, r.seq = r.resume.length, list(r.prompt_ids[:r.resume.length])
            r.reused_tokens = r.resume.length
            r.checkpoints = prefix.takes_checkpoints
        self.reading.append(r)

    def _read_prompt(self, r: Request) -> None:
        """One chunk of r's prompt; after the last, its first token."""
        t0 = time.perf_counter()
        try:
            # Alone, a prompt runs in the engine's own chunks (a GPU streams whole layers per chunk:
            # bigger is faster); beside requests that are decoding, in short ones between their steps.
            chunk = self.engine.prefill_chunk if not self.running else min(self.prompt_chunk, self.engine.prefill_chunk)
            end = min(len(r.prompt_ids), r.prompt_done + chunk)
            ids = r.prompt_ids[r.prompt_done:end]
            at = self.engine.boundaries_in(ids) if r.checkpoints else ()
            logits = self.engine.model.forward(torch.tensor(ids), r.cache, checkpoint_at=at,
                                               between_layers=lambda: self._check_in(r))
            self.prefill_tokens += end - r.prompt_done
            r.seq += ids
            r.prompt_done = end
            if end < len(r.prompt_ids):
                return
            self.reading.remove(r)
            self.engine.model.experts.end_of_prompt()
            token = r.sampler(logits[-1])
        except _Abandoned:
            self._finish(r, "cancelled")
            return
        except Exception as e:  # noqa: BLE001 (reported to this request alone)
            traceback.print_exc()
            self._fail(r, f"the prompt failed: {e}")
            return
        finally:
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
        t0 = time.perf_counter()
        try:
            logits = self.engine.model.decode_batch([r.next_token for r in batch], [r.cache for r in batch])
        except Exception as e:  # noqa: BLE001 (a failed step ends its requests, not the server)
            traceback.print_exc()
            for r in batch:
                self._fail(r, f"the decode step failed: {e}")
            return
        self.decode_steps += 1
        self.decode_tokens += len(batch)
        self.decode_s += time.perf_counter() - t0
        for r, row in zip(batch, logits, strict=True):
            r.seq.append(r.next_token)
            self._checkpoint(r)
            try:  # one request's sampling cannot fail its batch mates
                token = r.sampler(row)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                self._fail(r, f"sampling failed: {e}")
                continue
            self._accept(r, token)

    def _checkpoint(self, r: Request) -> None:
        """Keeps the linear layers' state when the token just decoded is a boundary."""
        if r.checkpoints and r.seq[-1] in self.engine.boundary_ids:
            r.cache.checkpoints[len(r.seq)] = r.cache.take()

    def _accept(self, r: Request, token: int) -> None:
        r.produced += 1
        if self.metrics is not None:
            self.metrics.token(r)
        _notify(r, token, None)
        if token in r.stop_ids:
            self._finish(r, "stop")
        elif r.produced >= r.max_new_tokens:
            self._finish(r, "length")
        else:
            r.next_token = token
            if r not in self.running:
                self.running.append(r)

    def _finish(self, r: Request, reason: str) -> None:
        for group in (self.running, self.reading):
            if r in group:
                group.remove(r)
        prefix = self.engine.prefix_cache
        if r.resume is not None:
            if reason != "error":  # a failed step may have left the cache half-written
                prefix.insert(r.seq, r.cache, r.cache.checkpoints if r.checkpoints else {}, r.namespace)
            prefix.release(r.resume)
            r.resume = None
        r.cache = r.sampler = r.next_token = None  # the KV cache goes with the request
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
