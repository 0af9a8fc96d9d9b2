"""`CpuDoorbell`: the CPU's share of a decode step that runs as device data (csrc/cpu_doorbell.cpp).

A native thread waits on a doorbell flag in pinned host memory. Whoever produced the layer's plan
(the GPU through its mapping of that memory, inside the step's graph; the emulated device and
tests from the host) writes the CPU job and the layer's input into the mailbox tensors below,
then rings; the thread runs the job on the engine's worker pool with the generated kernel, writes
the result into `out` and answers on `done`. While the doorbell is open the worker pool is its
own: the kernel's other calls wait until `close`.
"""

from __future__ import annotations

import ctypes
import time

import torch

from ftc_runtime.experts.cpu_kernel import CpuExpertKernel, KernelError

_p, _i64 = ctypes.c_void_p, ctypes.c_int64
RING, DONE = 0, 8  # int64 indices of the two flags in `flags`: 64 bytes apart, one cache line each


class DoorbellArgs(ctypes.Structure):
    """Mirrors `DoorbellArgs` in csrc/cpu_doorbell.cpp (every field 8 bytes)."""

    _fields_ = [(name, kind) for name, kind in (
        ("pool", _p), ("workspace", _p), ("experts", _p), ("expert_stride", _i64), ("hidden", _i64),
        ("max_tokens", _i64), ("max_entries", _i64), ("ring", _p), ("done", _p), ("n_tokens", _p), ("counts", _p),
        ("cpu_ids", _p), ("cpu_offsets", _p), ("cpu_tok", _p), ("cpu_w", _p), ("x", _p), ("out", _p),
        ("offsets32", _p), ("tok32", _p), ("spin_ns", _i64), ("status", _p))]


class DoorbellError(RuntimeError):
    """A job the doorbell thread could not run (sizes beyond its buffers), or no answer in time."""


class CpuDoorbell:
    """A mailbox of fixed buffers for calls of up to `max_tokens` tokens and `max_entries` CPU
    (token, expert) entries, in the layout of `device_plan.LayerPlan`'s CPU job: `n_tokens`,
    `counts` (hits, fills, CPU experts), `cpu_ids`, `cpu_offsets`, `cpu_tok` (int64), `cpu_w`
    (fp32), `x` and `out` ([max_tokens, hidden] fp32). `pinned`: page-locked, so that a GPU can
    read and write it through its mapping. Idle for `spin_ms`, the thread naps between looks."""

    def __init__(self, kernel: CpuExpertKernel, experts: torch.Tensor, max_tokens: int, max_entries: int,
                 pinned: bool, spin_ms: float = 5.0):
        if not kernel.background:
            raise ValueError("CpuDoorbell needs a kernel on a background worker pool (no caller thread)")
        if not hasattr(kernel.lib, "ftc_doorbell_start"):
            raise KernelError(f"{kernel.lib_path}: built without the CPU doorbell (csrc/cpu_doorbell.cpp): "
                              "compile the engine again")
        self.kernel, self.hidden = kernel, kernel.hidden

        def buffer(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, pin_memory=pinned)

        self.flags = buffer(16)
        self.n_tokens, self.counts, self.status = buffer(1), buffer(3), buffer(1)
        self.cpu_ids, self.cpu_offsets, self.cpu_tok = buffer(max_entries), buffer(max_entries + 1), buffer(max_entries)
        self.cpu_w = buffer(max_entries, dtype=torch.float32)
        self.x, self.out = (buffer(max_tokens, self.hidden, dtype=torch.float32) for _ in range(2))
        int32 = (torch.zeros(max_entries + 1, dtype=torch.int32), torch.zeros(max_entries, dtype=torch.int32))
        workspace = torch.empty(kernel.workspace_bytes(max_tokens, max_entries), dtype=torch.uint8)
        keep = (experts, self.flags, self.n_tokens, self.counts, self.status, self.cpu_ids, self.cpu_offsets,
                self.cpu_tok, self.cpu_w, self.x, self.out, int32, workspace)
        args = DoorbellArgs(
            kernel.pool_handle, workspace.data_ptr(), experts.data_ptr(), experts.stride(0), self.hidden, max_tokens,
            max_entries, self.flags.data_ptr() + 8 * RING, self.flags.data_ptr() + 8 * DONE, self.n_tokens.data_ptr(),
            self.counts.data_ptr(), self.cpu_ids.data_ptr(), self.cpu_offsets.data_ptr(), self.cpu_tok.data_ptr(),
            self.cpu_w.data_ptr(), self.x.data_ptr(), self.out.data_ptr(), int32[0].data_ptr(), int32[1].data_ptr(),
            int(spin_ms * 1e6), self.status.data_ptr())
        start = kernel.lib.ftc_doorbell_start
        start.restype, start.argtypes = _p, [ctypes.POINTER(DoorbellArgs)]
        stop = kernel.lib.ftc_doorbell_stop
        stop.argtypes = [_p]
        handle = start(ctypes.byref(args))
        # The pool is the doorbell's until close(); the kernel stops the thread (a closure that
        # holds no reference to this object) before it frees the pool, whichever goes first.
        kernel.hold(keep, end_job=lambda: stop(handle))
        self.open = True
        self.rung_by_host = False  # since the device's job counter was last set (`DoorbellKernels`)

    def ring(self) -> int:
        """Rings for the job written into the mailbox (from the host); returns its number: the
        next after the last ring, whoever rang it (the device rings too)."""
        seq = int(self.flags[RING]) + 1
        self.flags[RING] = seq
        self.rung_by_host = True
        return seq

    def wait(self, seq: int, timeout_s: float = 30.0) -> None:
        """Returns once job `seq` is answered; `out` then holds its result."""
        deadline = time.perf_counter() + timeout_s
        while int(self.flags[DONE]) < seq:
            if time.perf_counter() > deadline:
                raise DoorbellError(f"the CPU doorbell did not answer job {seq} within {timeout_s} s")
            time.sleep(0)
        if int(self.status[0]):
            self.status[0] = 0
            raise DoorbellError(f"job {seq}: {int(self.n_tokens[0])} tokens and {int(self.counts[2])} CPU experts "
                                f"exceed the doorbell's buffers ({self.x.shape[0]} tokens, {self.cpu_tok.numel()} "
                                "entries); it was not run")

    def close(self) -> None:
        """Stops the thread (after the job it is computing) and gives the worker pool back."""
        if self.open:
            self.open = False
            self.kernel.wait()

    def __del__(self) -> None:
        if getattr(self, "open", False):
            self.close()
