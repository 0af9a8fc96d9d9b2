"""The engine's generated CPU kernel library, loaded with ctypes (no torch headers needed to build it)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from ftc_runtime.cpu_info import ISA_FLAGS, missing_flags

_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


class KernelError(RuntimeError):
    """The kernel library is missing, built for other shapes, or needs an ISA this CPU lacks."""


class CpuExpertKernel:
    """Routed-expert FFN over FTW rows in host memory, run on a pinned worker pool.

    `run` accumulates  out[t] += Σ w · down(silu(gate x_t) · up x_t)  for pairs grouped by expert.
    Calls are serialized: the pool runs one job at a time. With `background`, every one of the
    pool's threads is its own pinned worker and `start` returns at once (the caller drives a GPU
    meanwhile, then `wait`s); without it the caller works as thread 0 and `start` is `run`.
    """

    def __init__(self, lib_path: Path, isa: str, hidden: int, intermediate: int, cpus: list[int],
                 background: bool = False):
        if not lib_path.is_file():
            raise KernelError(f"{lib_path}: kernel library not found (run `ftc compile` again)")
        if isa not in ISA_FLAGS:
            raise KernelError(f"{lib_path}: unknown kernel ISA {isa!r}")
        lacking = missing_flags(isa)
        if lacking:
            raise KernelError(f"{lib_path}: built for {isa}, but this CPU lacks {', '.join(lacking)}; "
                              "compile the engine for this machine (`ftc compile ... --target auto`)")
        self.lib_path = lib_path
        self.lib = ctypes.CDLL(str(lib_path))
        self.lib.ftc_kernel_isa.restype = ctypes.c_char_p
        got = (self.lib.ftc_kernel_isa().decode(), self.lib.ftc_kernel_hidden(),
               self.lib.ftc_kernel_intermediate())
        if got != (isa, hidden, intermediate):
            raise KernelError(f"{lib_path}: library was built for (isa, hidden, intermediate) = {got}, "
                              f"the engine expects {(isa, hidden, intermediate)}")
        self.lib.ftc_pool_create.restype = _p
        self.lib.ftc_pool_create.argtypes = [_i32, ctypes.POINTER(ctypes.c_int), _i32]
        self.lib.ftc_pool_destroy.argtypes = [_p]
        self.lib.ftc_pool_wait.argtypes = [_p]
        self.lib.ftc_pool_job_seconds.restype = ctypes.c_double
        self.lib.ftc_pool_job_seconds.argtypes = [_p]
        if hasattr(self.lib, "ftc_tile_backend"):  # kernels with tiles (expert_tiles.cpp.j2)
            self.lib.ftc_tile_backend.restype = ctypes.c_char_p
        self.lib.ftc_expert_ffn_workspace_bytes.restype = _i64
        self.lib.ftc_expert_ffn_workspace_bytes.argtypes = [_i32, _i32]
        for fn in (self.lib.ftc_expert_ffn, self.lib.ftc_expert_ffn_start):
            fn.restype = _i32
            fn.argtypes = [_p, _p, _i64, _i32, _p, _p, _i32, _p, _p, _p, _p, _p]
        self.can_signal = hasattr(self.lib, "ftc_expert_ffn_start_signaled")  # engines built before it lack it
        if self.can_signal:
            self.lib.ftc_expert_ffn_start_signaled.restype = _i32
            self.lib.ftc_expert_ffn_start_signaled.argtypes = [_p, _p, _i64, _i32, _p, _p, _i32, _p, _p, _p, _p, _p,
                                                               _p, ctypes.c_uint64]
        self.hidden, self.intermediate, self.isa = hidden, intermediate, isa
        self.n_threads, self.background = len(cpus), background
        self._pool = self.lib.ftc_pool_create(len(cpus), (ctypes.c_int * len(cpus))(*cpus), int(not background))
        self._workspace = torch.empty(0, dtype=torch.uint8)
        self._lock = threading.Lock()
        self._in_flight: tuple | None = None  # a background job's tensors, kept alive until wait()
        self._end_job: Callable[[], None] | None = None  # ends a held native job (`hold`)

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool:
            if getattr(self, "_in_flight", None) is not None:
                self.wait()  # a native job (a doorbell's thread) ends before its pool is freed
            self.lib.ftc_pool_destroy(pool)
            self._pool = None

    def run(self, experts: torch.Tensor, x: torch.Tensor, out: torch.Tensor, expert_ids: torch.Tensor,
            offsets: torch.Tensor, tok_idx: torch.Tensor, tok_w: torch.Tensor) -> None:
        """experts: the pool's rows [rows, expert_stride] uint8 (`ExpertPool.experts`); x, out:
        [T, hidden] fp32 contiguous; expert_ids int64 [m]; offsets int32 [m+1]; tok_idx int32 and
        tok_w fp32 [pairs]."""
        with self._lock:
            self._call(self.lib.ftc_expert_ffn, experts, x, out, expert_ids, offsets, tok_idx, tok_w)

    def start(self, experts: torch.Tensor, x: torch.Tensor, out: torch.Tensor, expert_ids: torch.Tensor,
              offsets: torch.Tensor, tok_idx: torch.Tensor, tok_w: torch.Tensor) -> None:
        """`run` in the background (with `background`; else the pool runs it now, the caller taking
        part). Every tensor is kept alive, and must not be touched, until `wait()`."""
        self._lock.acquire()  # released by wait()
        self._in_flight = (experts, x, out, expert_ids, offsets, tok_idx, tok_w)
        self._call(self.lib.ftc_expert_ffn_start, *self._in_flight)

    def start_signaled(self, experts: torch.Tensor, x: torch.Tensor, out: torch.Tensor, expert_ids: torch.Tensor,
                       offsets: torch.Tensor, tok_idx: torch.Tensor, tok_w: torch.Tensor, flag: torch.Tensor,
                       value: int) -> None:
        """`start`, and once the job has ended flag[0] (int64, pinned beside a GPU) = value, before
        `wait()` can return: the device can wait for the result itself (`io.host_take`) while the
        caller queues more work (`can_signal`: the library has it)."""
        if flag.dtype != torch.int64 or not flag.is_contiguous() or flag.numel() < 1:
            raise ValueError(f"CpuExpertKernel: the end flag must be a contiguous int64 tensor, got {flag.dtype}")
        self._lock.acquire()  # released by wait()
        self._in_flight = (experts, x, out, expert_ids, offsets, tok_idx, tok_w, flag)
        self._call(self.lib.ftc_expert_ffn_start_signaled, experts, x, out, expert_ids, offsets, tok_idx, tok_w,
                   flag.data_ptr(), value)

    def on_cpus(self, cpus: list[int], background: bool) -> CpuExpertKernel:
        """The same kernel library on another worker pool."""
        return CpuExpertKernel(self.lib_path, self.isa, self.hidden, self.intermediate, cpus, background)

    @property
    def pool_handle(self) -> int:
        """The native worker pool, for other functions of this library that start jobs on it."""
        return self._pool

    def workspace_bytes(self, n_tokens: int, n_pairs: int) -> int:
        return self.lib.ftc_expert_ffn_workspace_bytes(n_tokens, n_pairs)

    def hold(self, keep: tuple, end_job: Callable[[], None] | None = None) -> None:
        """Takes the pool for a job that a native function of this library starts itself (as
        `start` does; the CPU doorbell's thread), keeping `keep` alive; `wait()` calls `end_job`,
        if any (it stops a job that would not end by itself), joins the pool and frees it. The
        kernel does so itself before its pool is freed, so the two can be collected in any order."""
        self._lock.acquire()  # released by wait()
        self._in_flight, self._end_job = keep, end_job

    def wait(self) -> None:
        """Returns when the job that `start` began, or `hold` took the pool for, has finished (at
        once when there is none)."""
        if self._in_flight is None:
            return
        if self._end_job is not None:
            end_job, self._end_job = self._end_job, None
            end_job()
        self.lib.ftc_pool_wait(self._pool)
        self._in_flight = None
        self._lock.release()

    @property
    def tile_backend(self) -> str:
        """Where experts of many tokens run: "amx", "avx512" (tile GEMMs), or "none" (the row
        buckets only: a kernel without tiles, as the AVX2 ones)."""
        return self.lib.ftc_tile_backend().decode() if hasattr(self.lib, "ftc_tile_backend") else "none"

    @property
    def tile_min(self) -> int | None:
        """Routed tokens from which an expert runs as tiles on this machine (None: no tiles)."""
        return self.lib.ftc_tile_min() if hasattr(self.lib, "ftc_tile_min") else None

    def job_seconds(self) -> float:
        """The last finished job's own time on the pool, from its start to its last thread's end
        (not to the `wait` that joined it)."""
        return self.lib.ftc_pool_job_seconds(self._pool)

    def _call(self, fn, experts: torch.Tensor, x: torch.Tensor, out: torch.Tensor, expert_ids: torch.Tensor,
              offsets: torch.Tensor, tok_idx: torch.Tensor, tok_w: torch.Tensor, *extra: int) -> None:
        n_tokens, n_pairs = x.shape[0], tok_idx.numel()
        for name, t, dt in (("x", x, torch.float32), ("out", out, torch.float32),
                            ("expert_ids", expert_ids, torch.int64), ("offsets", offsets, torch.int32),
                            ("tok_idx", tok_idx, torch.int32), ("tok_w", tok_w, torch.float32)):
            if t.dtype != dt or not t.is_contiguous():
                raise ValueError(f"CpuExpertKernel: {name} must be contiguous {dt}, got {t.dtype}")
        if x.shape[1] != self.hidden or out.shape != x.shape:
            raise ValueError(f"CpuExpertKernel: x/out must be [T, {self.hidden}], got {tuple(x.shape)}")
        if experts.dtype != torch.uint8 or experts.dim() != 2 or experts.stride(1) != 1:
            raise ValueError(f"CpuExpertKernel: experts must be the pool's [rows, stride] uint8 rows, got "
                             f"{experts.dtype} {tuple(experts.shape)}")
        need = self.workspace_bytes(n_tokens, n_pairs)
        if self._workspace.numel() < need:
            self._workspace = torch.empty(need, dtype=torch.uint8)
        fn(self._pool, experts.data_ptr(), experts.stride(0), n_tokens, x.data_ptr(), out.data_ptr(),
           expert_ids.numel(), expert_ids.data_ptr(), offsets.data_ptr(), tok_idx.data_ptr(), tok_w.data_ptr(),
           self._workspace.data_ptr(), *extra)
