"""`StreamCpuPart`: the experts of a streamed prompt layer that the CPU computes in place, where
they lie in host memory, instead of copying them over PCIe (`PromptSplit` says how many).

In the layer's pair list (slot, token, weight bits; sorted by slot) the CPU's i-th expert stands
as the slot code `cpu_code(i)`, below every real slot, so its pairs lead the list. Those pairs and
the layer's input come down once, the generated CPU kernel runs them on its worker pool (in the
background beside a GPU, while the device computes the rest), and their weighted sum goes back up
once, added to the device's part by a kernel that reads it through the buffer's mapping and
leaves the buffer zeroed for the next part.

By default (`FTC_DEVICE_WAITS_CPU_PART=1`) the device waits for the CPU, not the host: the pool's
last thread raises a flag in pinned memory when the job ends, and the take polls it
(`io.host_take.take_when_signaled`), so the host goes on to queue the next layer's attention and
router while the CPU computes. The host joins the job at the next part's start (the device has
reached the next routing, so the job is long done). Where the CPU stands in for the device, it
waits for the flag itself, as the device would (the same bookkeeping, tested without a GPU).
With `FTC_DEVICE_WAITS_CPU_PART=0` (and with an engine's kernel library built before the flag)
the host waits for the kernel and adds the result itself. Either way the kernel's own time feeds
the split's estimate, and so does the stretch from its end to the next part's start, where the
CPU was the side the layer waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ftc_runtime.experts.cpu_kernel import CpuExpertKernel
from ftc_runtime.experts.prompt_split import PromptSplit
from ftc_runtime.experts.stats import OffloadStats
from ftc_runtime.settings import settings

FIRST_CPU_CODE = -2  # -1 stays "not resident"; the CPU's experts are -2, -3, ...
RESULT_DTYPE = torch.float32  # the CPU's result, accumulated by its kernel and read back whole by the take
HOST_WAIT_S = 60.0  # where the CPU stands in for the device, how long it waits for a part's end flag

# (name, rows, width, dtype, zeroed) → a reused host buffer [rows, width], pinned beside a GPU; all
# zeros when made where `zeroed`
HostBuffer = Callable[[str, int, int, torch.dtype, bool], torch.Tensor]


class CpuPartError(RuntimeError):
    """The CPU's part of a streamed layer never signalled its end: that chunk's output is wrong."""


def cpu_codes(n: int) -> np.ndarray:
    """The slot codes of the CPU's experts 0 .. n-1 (int32)."""
    return (FIRST_CPU_CODE - np.arange(n)).astype(np.int32)


@dataclass
class _Part:
    layer: int
    result: torch.Tensor  # the host buffer the kernel accumulates into
    experts: int
    pairs: int
    started: float  # the host's clock at the kernel's start
    seq: int  # the job's number on the end flag; 0: not signalled (the host waits)
    seconds: float = 0.0  # the job's own time, once it has ended
    cpu_last: bool = False  # the layer waited for the CPU: it ended after the device's side


class StreamCpuPart:
    """The CPU parts of one streamed chunk of `n_tokens` tokens. `buffer` gives the reused host
    buffers (pinned beside a GPU); with `FTC_DEVICE_WAITS_CPU_PART=1` (the default) and a kernel
    that can signal, `device` waits for each part itself (the CPU standing in for a GPU waits as a
    GPU would)."""

    def __init__(self, kernel: CpuExpertKernel, host_rows: torch.Tensor, split: PromptSplit, buffer: HostBuffer,
                 stats: OffloadStats, n_tokens: int, device: torch.device):
        self.kernel, self.host_rows, self.split, self.buffer, self.stats = kernel, host_rows, split, buffer, stats
        self.n_tokens = n_tokens
        self._running: _Part | None = None  # started, not yet handed to its take
        self._taken: _Part | None = None  # handed to its take, not yet joined on the host
        self.signaled = kernel.can_signal and settings().device_waits_cpu_part
        if self.signaled:
            # The end flag counts jobs for the engine's life: each chunk goes on from the last.
            self.flag = buffer("stream_cpu_flag", 1, 8, torch.int64, True)[0]  # a cache line of its own
            self.status = torch.zeros(2, dtype=torch.int64, device=device)  # [gave up, the last take waited]

    def _result_buffer(self, t: int, hidden: int) -> torch.Tensor:
        """The buffer the kernel accumulates into: all zeros between parts, of this chunk and the
        next (made zeroed, then left zeroed by each part's take), so no part zeroes it on the host."""
        return self.buffer("stream_cpu_out", t, hidden, RESULT_DTYPE, True)

    @torch.profiler.record_function("ftc.stream_cpu.start")  # a profile's trace shows the host's parts
    def start(self, layer: int, x: torch.Tensor, pairs: torch.Tensor, rows: np.ndarray) -> None:
        """MoE layer `layer`'s part: x [T, hidden] fp32 and the CPU's pairs [3, P] int32 (slot
        code, token, weight bits; grouped by code) on the device; `rows[i]` the FTW row of the
        expert of code cpu_code(i). Copies them to the host (the one wait for the device: its
        routing), joins the part before and starts the kernel."""
        t, hidden = x.shape
        x_host = self.buffer("stream_cpu_x", t, hidden, torch.float32, False)
        pairs_host = self.buffer("stream_cpu_pairs", 3, pairs.shape[1], torch.int32, False)
        x_host.copy_(x, non_blocking=True)
        pairs_host.copy_(pairs, non_blocking=True)
        if x.is_cuda:
            torch.cuda.current_stream(x.device).synchronize()
        self._join(time.perf_counter(), layer)
        codes = pairs_host[0].numpy()  # sorted: each expert's pairs together, the experts in reverse
        starts = np.flatnonzero(np.diff(codes)) + 1
        offsets = np.concatenate([[0], starts, [codes.size]]).astype(np.int32)
        codes = codes[offsets[:-1]]
        args = (self.host_rows, x_host, self._result_buffer(t, hidden),
                torch.from_numpy(np.ascontiguousarray(rows[FIRST_CPU_CODE - codes])), torch.from_numpy(offsets),
                pairs_host[1], pairs_host[2].view(torch.float32))
        seq = int(self.flag[0]) + 1 if self.signaled else 0  # every job before has ended: joined
        started = time.perf_counter()
        if seq:
            self.kernel.start_signaled(*args, self.flag, seq)
        else:
            self.kernel.start(*args)
        self._running = _Part(layer, args[2], codes.size, pairs.shape[1], started, seq)

    @torch.profiler.record_function("ftc.stream_cpu.finish")
    def finish(self, out: torch.Tensor, copies_landed: Callable[[], bool]) -> None:
        """out (on the device) += the part's result, which leaves the buffer zeroed: queued behind
        the job's end flag where the part is signalled, else once the host has waited for the
        kernel (`copies_landed` then says whether the layer's copies had landed by the CPU's end)."""
        part, self._running = self._running, None
        if part.seq and out.is_cuda:
            from ftc_runtime.io.host_take import take_when_signaled  # Triton: only beside a GPU

            take_when_signaled(out, part.result, self.flag, part.seq, self.status)
        elif part.seq:
            self._take_on_host_when_signaled(out, part)
        else:
            self.kernel.wait()
            self._record(part)
            part.cpu_last = copies_landed()
            self._add(out, part.result)
        self._taken = part

    def join(self) -> None:
        """The chunk's last part, joined at its end (the host waits for the kernel)."""
        self._join(None, None)

    def abandon(self) -> None:
        """A chunk that failed: the running kernel is joined and a result no take will read is
        dropped (one handed to its take is zeroed by it, before the next part's routing)."""
        part, self._running, self._taken = self._running, None, None
        self.kernel.wait()
        if part is not None:
            part.result.zero_()

    def _join(self, now: float | None, layer: int | None) -> None:
        """Joins the part handed to its take (a signalled part's kernel time feeds the split here),
        and the stretch from its end to `now` (the next part's start, of `layer`) feeds the split
        where it was the layer before and the layer waited for the CPU."""
        part, self._taken = self._taken, None
        if part is None:
            return
        if part.seq:
            self.kernel.wait()
            self._record(part)
            gave_up, waited = self.status.tolist()  # the device is past the take: a short read
            if gave_up:
                raise CpuPartError(f"the CPU part of MoE layer {part.layer} (job {part.seq}) did not signal its end "
                                   "in time: that chunk's output is wrong")
            part.cpu_last = bool(waited)
        if now is not None and layer == part.layer + 1 and part.cpu_last:
            self.split.record_serial(self.n_tokens, now - (part.started + part.seconds))

    def _record(self, part: _Part) -> None:
        """The ended job's own time (the pool's clock), into the split's estimate."""
        part.seconds = self.kernel.job_seconds()
        self.split.record(part.experts, part.pairs, part.seconds)
        self.stats.cpu_s += part.seconds

    def _take_on_host_when_signaled(self, out: torch.Tensor, part: _Part) -> None:
        """`take_when_signaled` with the CPU as the device: it waits for the job's end flag (the
        status says whether it had to, or gave up), then adds the result and zeroes it."""
        deadline, waited = time.perf_counter() + HOST_WAIT_S, False
        while int(self.flag[0]) < part.seq and not self.status[0]:
            waited = True
            if time.perf_counter() > deadline:
                self.status[0] = 1
            time.sleep(0)
        self.status[1] = int(waited)
        if not self.status[0]:
            self._add(out, part.result)

    @staticmethod
    def _add(out: torch.Tensor, result: torch.Tensor) -> None:
        if out.is_cuda:
            from ftc_runtime.io.host_take import take_from_host  # Triton: only beside a GPU

            take_from_host(out, result)  # read over PCIe: not queued behind the next layers' copies
        else:
            out += result
            result.zero_()
