"""`StreamCpuPart`: the experts of a streamed prompt layer that the CPU computes in place, where
they lie in host memory, instead of copying them over PCIe (`PromptSplit` says how many).

In the layer's pair list (slot, token, weight bits; sorted by slot) the CPU's i-th expert stands
as the slot code `cpu_code(i)`, below every real slot, so its pairs lead the list. Those pairs and
the layer's input come down once, the generated CPU kernel runs them on its worker pool (in the
background beside a GPU, while the device computes the rest), and their weighted sum goes back up
once, added to the device's part by a kernel that reads it through the buffer's mapping and
leaves the buffer zeroed for the next part. The kernel's own time feeds the split's estimate.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ftc_runtime.experts.cpu_kernel import CpuExpertKernel
from ftc_runtime.experts.prompt_split import PromptSplit
from ftc_runtime.experts.stats import OffloadStats

FIRST_CPU_CODE = -2  # -1 stays "not resident"; the CPU's experts are -2, -3, ...

# (name, rows, width, dtype, zeroed) → a reused host buffer [rows, width], pinned beside a GPU; all
# zeros when made where `zeroed`
HostBuffer = Callable[[str, int, int, torch.dtype, bool], torch.Tensor]


def cpu_codes(n: int) -> np.ndarray:
    """The slot codes of the CPU's experts 0 .. n-1 (int32)."""
    return (FIRST_CPU_CODE - np.arange(n)).astype(np.int32)


class StreamCpuPart:
    def __init__(self, kernel: CpuExpertKernel, host_rows: torch.Tensor, split: PromptSplit, buffer: HostBuffer,
                 stats: OffloadStats):
        self.kernel, self.host_rows, self.split, self.buffer, self.stats = kernel, host_rows, split, buffer, stats
        self._running: tuple[torch.Tensor, int, int] | None = None  # the result buffer, experts, pairs

    def _result_buffer(self, t: int, hidden: int) -> torch.Tensor:
        """The buffer the kernel accumulates into: all zeros between parts, of this chunk and the
        next (made zeroed, then left zeroed by each part's take), so no part zeroes it on the host."""
        return self.buffer("stream_cpu_out", t, hidden, torch.float32, True)

    @torch.profiler.record_function("ftc.stream_cpu.start")  # a profile's trace shows the host's parts
    def start(self, x: torch.Tensor, pairs: torch.Tensor, rows: np.ndarray) -> None:
        """x [T, hidden] fp32 and the CPU's pairs [3, P] int32 (slot code, token, weight bits;
        grouped by code) on the device; `rows[i]` the FTW row of the expert of code cpu_code(i).
        Copies them to the host (the one wait for the device) and starts the kernel."""
        t, hidden = x.shape
        x_host = self.buffer("stream_cpu_x", t, hidden, torch.float32, False)
        pairs_host = self.buffer("stream_cpu_pairs", 3, pairs.shape[1], torch.int32, False)
        x_host.copy_(x, non_blocking=True)
        pairs_host.copy_(pairs, non_blocking=True)
        if x.is_cuda:
            torch.cuda.current_stream(x.device).synchronize()
        codes = pairs_host[0].numpy()  # sorted: each expert's pairs together, the experts in reverse
        starts = np.flatnonzero(np.diff(codes)) + 1
        offsets = np.concatenate([[0], starts, [codes.size]]).astype(np.int32)
        codes = codes[offsets[:-1]]
        expert_ids = torch.from_numpy(np.ascontiguousarray(rows[FIRST_CPU_CODE - codes]))
        out = self._result_buffer(t, hidden)  # the last part's take is done: the device is past it
        self.kernel.start(self.host_rows, x_host, out, expert_ids, torch.from_numpy(offsets), pairs_host[1],
                          pairs_host[2].view(torch.float32))
        self._running = (out, codes.size, pairs.shape[1])

    def abandon(self) -> None:
        """A chunk that failed between `start` and `finish`: the kernel is joined, its result dropped."""
        if self._running is not None:
            result = self._running[0]
            self._running = None
            self.kernel.wait()
            result.zero_()  # its partial sums: the next part finds the buffer zeroed

    @torch.profiler.record_function("ftc.stream_cpu.finish")
    def finish(self, out: torch.Tensor) -> None:
        """Waits for the kernel, then out (on the device) += its result, which leaves the buffer
        zeroed (until then the part counts as running: `abandon` zeroes what it left)."""
        result, experts, pairs = self._running
        self.kernel.wait()
        seconds = self.kernel.job_seconds()
        self.split.record(experts, pairs, seconds)
        self.stats.cpu_s += seconds
        if out.is_cuda:
            from ftc_runtime.io.host_take import take_from_host  # Triton: only beside a GPU

            take_from_host(out, result)  # read over PCIe: not queued behind the next layers' copies
        else:
            out += result
            result.zero_()
        self._running = None
