"""`OffloadedExperts`: routed experts served from a device-side slot cache, with the misses of each
layer split between fills (host→device copies into LRU victims) and in-place CPU computation.

The device is any `torch.device`. On a machine without a GPU it is the CPU, and every part of the
path (cache, split, fills as plain copies, merge) runs and is tested; only speed needs a GPU.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ftc_runtime.experts.base import ExpertBackend, Routing
from ftc_runtime.experts.cache import ExpertCache
from ftc_runtime.experts.cpu_kernel import CpuExpertKernel
from ftc_runtime.experts.layer_stream import LayerStream
from ftc_runtime.experts.miss_planner import MissPlanner
from ftc_runtime.experts.stats import OffloadStats
from ftc_runtime.experts.token_plan import TokenPlanner
from ftc_runtime.io.ftw import ExpertPool
from ftc_runtime.io.host_memory import pin_in_place


@dataclass(frozen=True)
class _TokenPath:
    """The fixed buffers of one-token calls (CUDA graphs hold their addresses) and their planner."""

    planner: TokenPlanner
    staged: torch.Tensor  # [1, hidden + 2k] fp32 on the host: x, ids, weights
    x: torch.Tensor  # [1, hidden] fp32 on the device
    device_out: torch.Tensor  # [1, hidden] fp32 on the device: the hits and fills
    cpu_out: torch.Tensor  # [1, hidden] fp32 on the host: the CPU experts
    pairs: torch.Tensor  # [3, k] int32 on the device: the planner's pairs, copied


class OffloadedExperts(ExpertBackend):
    """Per MoE layer call: `stage` queues one device→host copy of the layer's input and routing
    (CUDA graphs capture it); `launch_staged` waits for it (the one sync: the device's queue is
    then empty, so fills need no stream of their own), looks the experts up, splits the misses,
    starts the CPU experts in the background at once, and queues the fills and then the hits +
    fills on the device; `finish_staged` waits for the CPU part. One token (decode) is planned by
    one native call (`TokenPlanner`) and its device part is one CUDA graph; several tokens take
    the general path here. Buffers for one token are sized once and never move (graphs hold their
    addresses); a buffer is reused by the next call only after that call's sync, which orders it
    after every copy of this one."""

    def __init__(self, pool: ExpertPool, kernel: CpuExpertKernel, device: torch.device, n_slots: int,
                 planner: MissPlanner, cache_policy: str = "lru", device_kernel: Callable | None = None,
                 stream_min_tokens: int | None = None, stream_overlap: bool = True,
                 grouped_kernel: Callable | None = None):
        h = pool.header
        self.pool, self.kernel, self.device, self.planner = pool, kernel, torch.device(device), planner
        self.num_experts = h.num_experts
        self.on_gpu = self.device.type == "cuda"
        self.pinned = self.on_gpu and pin_in_place(pool.buffer)
        if self.on_gpu and not self.pinned and n_slots:
            # Copies from pageable memory would run at a fraction of PCIe speed, synchronously.
            print("ftc: the expert pool could not be pinned (page-locked) for DMA: every routed expert runs "
                  "on the CPU; only activations cross PCIe", file=sys.stderr)
            n_slots = 0
        self.cache = ExpertCache(h.num_rows, n_slots, cache_policy)
        self.host_rows = pool.buffer.view(h.num_rows, h.expert_stride)
        self.gate_up, self.down = pool.bank("gate_up"), pool.bank("down")
        # The slots keep FTW's expert-major row layout, so a fill is one contiguous copy.
        self.slots = torch.empty(n_slots, h.expert_stride, dtype=torch.uint8, device=self.device)
        self.banks = {b.name: (b.offset, b.row_bytes, b.row_shape) for b in h.banks}
        self.hidden = self.banks["gate_up"][2][1]  # gate_up rows are [2I, hidden]
        self.stats = OffloadStats(self.device)
        # The engine's generated GPU kernels (x, slots, pair_slot, pair_tok, pair_w, out): for a few
        # tokens per expert (pairs with a negative slot skipped), and the grouped GEMM for many
        # (pairs sorted by slot); None: torch.
        self.device_kernel, self.grouped_kernel = device_kernel, grouped_kernel
        self.prompt_counts = np.zeros(h.num_rows, dtype=np.int64)  # static policy: routed ids of the prompt
        self._token: _TokenPath | None = None  # built at the first one-token call
        self.native_token_plan = True  # False: one-token calls take the general path (tests compare both)
        self._token_graph: torch.cuda.CUDAGraph | None = None
        self._token_device_calls = 0
        self._buffers: dict[tuple[str, bool], torch.Tensor] = {}
        self._outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        # Prompt chunks of at least stream_min_tokens (None: never) stream whole layers when the
        # cache can lend the layer buffers; else their routed experts load on demand.
        self.stream_min_tokens, self.stream_overlap = stream_min_tokens, stream_overlap
        self._stream: LayerStream | None = None
        self._said_no_stream = False
        self._plan_s = self._fills_s = 0.0  # host time of the current call's planning and fills

    def resize(self, n_slots: int) -> None:
        """Rebuilds the slot cache with n_slots slots, at a safe point (no CPU job, copy or kernel
        in flight): the most recently used experts that fit are copied back from the host pool
        (never from disk), the rest dropped; misses refill it as usual. The old slots are freed
        before the new ones are allocated, so the two never need memory together."""
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
        old = self.cache
        held = np.flatnonzero(old.id_of >= 0)
        keep = held[np.argsort(-old.last_used[held], kind="stable")][:n_slots]
        keep = keep[np.argsort(old.last_used[keep], kind="stable")]  # oldest first: LRU order survives
        ids = old.id_of[keep]
        self.slots = None
        if self.on_gpu:
            torch.cuda.empty_cache()
        self.slots = torch.empty(n_slots, self.host_rows.shape[1], dtype=torch.uint8, device=self.device)
        self.cache = ExpertCache(old.slot_of.size, n_slots, old.policy)
        self.cache.step, self.cache.frozen, self.cache.cpu_step[:] = old.step, old.frozen, old.cpu_step
        slots = np.arange(ids.size, dtype=np.int64)
        self.cache.install(slots, ids)
        self.cache.last_used[slots] = old.last_used[keep]
        self.copy_rows_now(slots, ids)
        # The token planner and its graph hold the old arrays' and slots' addresses.
        self._token, self._token_graph, self._token_device_calls, self._stream = None, None, 0, None

    @property
    def recent_steps(self) -> int:
        """The planner's recent window in cache steps (a token takes one per MoE layer); 0 but
        for the adaptive split."""
        if self.planner.policy != "adaptive":
            return 0
        return self.planner.recent_tokens * self.pool.header.num_moe_layers

    @property
    def stream_slots(self) -> int:
        """Slots that streaming a prompt chunk's layers borrows: one or two full layers."""
        return self.num_experts * (2 if self.stream_overlap else 1)

    def begin_pass(self, n_tokens: int, prompt: bool = True) -> None:
        """A prompt chunk of n_tokens is streamed layer by layer when it is long enough and the
        cache can lend the buffers (LRU policy only: the static set is never replaced); a decode
        batch never is. Either way a pass left unfinished (a failed or abandoned chunk) is dropped
        here, once the device's queue waits for its copies still in flight (their slots count as
        filled)."""
        if self._stream is not None:
            self._stream.abandon()
        self._stream = None
        if not prompt or self.stream_min_tokens is None or n_tokens < self.stream_min_tokens \
                or self.cache.policy != "lru":
            return
        if self.cache.n_slots < self.stream_slots:
            if not self._said_no_stream:
                print(f"ftc: prefill loads routed experts on demand: streaming whole layers needs "
                      f"{self.stream_slots} expert slots, the VRAM budget gives {self.cache.n_slots}",
                      file=sys.stderr)
                self._said_no_stream = True
            return
        self._stream = LayerStream(self, self.stream_overlap)

    def forward(self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                first_position: int = 0) -> torch.Tensor:
        if self._stream is not None and ids.shape[0] > 1:
            out = self._stream.forward(moe_layer, x, ids, weights, first_position)
            if moe_layer == self.pool.header.num_moe_layers - 1:
                self._stream = None  # the chunk's last MoE layer
            return out
        self.stage(x, ids, weights)
        return self.forward_staged(moe_layer, ids.shape[0], ids.shape[1], first_position)

    def stage(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Queues x (fp32), ids and weights into one device buffer [T, hidden + 2k] and its copy to
        the host (ids are exact in fp32 below 2^24). Capturable in a CUDA graph."""
        (t, hidden), k = x.shape, ids.shape[1]
        packed = self._buffer("in", t, hidden + 2 * k, self.device)
        packed[:, :hidden].copy_(x)
        packed[:, hidden:hidden + k].copy_(ids)
        packed[:, hidden + k:].copy_(weights)
        if self.on_gpu:
            self._buffer("in_host", t, hidden + 2 * k).copy_(packed, non_blocking=True)

    def forward_staged(self, moe_layer: int, t: int, k: int, first_position: int = 0) -> torch.Tensor:
        """The routed experts of the call that `stage` queued: T tokens, k experts each."""
        self.launch_staged(moe_layer, t, k, first_position)
        on_device, on_cpu = self.finish_staged()
        return on_device + on_cpu.to(self.device, non_blocking=True)

    def token_outputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where one-token calls leave their two parts ([1, hidden] fp32, on the device and on the
        host): their sum is the layer's output. Fixed buffers, for CUDA graphs to read."""
        return self._buffer("device_out", 1, self.hidden, self.device), self._buffer("cpu_out", 1, self.hidden)

    def launch_staged(self, moe_layer: int, t: int, k: int, first_position: int = 0) -> None:
        """Plans the staged call and starts both parts; `finish_staged` returns them."""
        clock = self.stats.host_s
        t0 = time.perf_counter()
        if self.on_gpu:
            torch.cuda.current_stream(self.device).synchronize()
        t1 = time.perf_counter()
        clock["sync"] += t1 - t0
        static_counting = self.cache.policy == "static" and not self.cache.frozen
        if t == 1 and self.native_token_plan and not static_counting:
            self._launch_token(moe_layer, k, first_position)
        else:
            self._launch_general(moe_layer, t, k, first_position)
        clock["launch"] += time.perf_counter() - t1 - self._plan_s - self._fills_s

    def finish_staged(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(device part, CPU part) of the launched call, once the CPU part is done."""
        t0 = time.perf_counter()
        self.kernel.wait()
        t1 = time.perf_counter()
        self.stats.host_s["cpu_wait"] += t1 - t0
        self.stats.cpu_s += t1 - self._cpu_t0
        return self._outputs

    def end_of_prompt(self) -> None:
        """Static policy: pins the experts the prompt routed to most, once."""
        if self.cache.policy != "static" or self.cache.frozen:
            return
        order = np.argsort(-self.prompt_counts, kind="stable")
        chosen = order[: self.cache.n_slots]
        chosen = chosen[self.prompt_counts[chosen] > 0]
        slots = self.cache.pin(chosen)
        self._copy_rows(slots, chosen)

    def _launch_token(self, moe_layer: int, k: int, first_position: int) -> None:
        t0 = time.perf_counter()
        tok = self._token or self._make_token_path(k)
        if self.routing is not None:
            arr, h = tok.staged.numpy(), self.hidden
            ids, w = self.routed(moe_layer, first_position, arr[:, h:h + k].astype(np.int64), arr[:, h + k:])
            arr[:, h:h + k], arr[:, h + k:] = ids, w
        self._cpu_t0 = time.perf_counter()
        n_fill = tok.planner.plan(moe_layer * self.num_experts, allow_fills=self.cache.policy == "lru")
        hits, fills, cpu = tok.planner.counts.tolist()
        self._count(hits + fills + cpu, hits, fills, cpu)
        self._plan_s = time.perf_counter() - t0
        self.stats.host_s["plan"] += self._plan_s
        self._copy_rows(tok.planner.fills[1, :n_fill], tok.planner.fills[0, :n_fill])
        self._outputs = (tok.device_out, tok.cpu_out)
        with self.stats.compute.measure():
            self._token_device_part(tok, hits + fills)

    def _make_token_path(self, k: int) -> _TokenPath:
        staged = self._staged_host(1, k)
        device_out, cpu_out = self.token_outputs()
        planner = TokenPlanner(self.kernel, self.gate_up, self.down, self.cache, self.planner, k, staged, cpu_out,
                               self.on_gpu, self.recent_steps)
        x = self._buffer("in", 1, self.hidden + 2 * k, self.device)[:, :self.hidden]
        pairs = torch.zeros(3, k, dtype=torch.int32, device=self.device)
        self._token = _TokenPath(planner, staged, x, device_out, cpu_out, pairs)
        return self._token

    def _token_device_part(self, tok: _TokenPath, n_pairs: int) -> None:
        """One token's hits and fills from the slots into `device_out`: on a GPU with the engine's
        kernel, one CUDA graph over all k pair entries (unused ones skipped), captured at the
        second call (the first compiles the kernel); elsewhere torch over the n_pairs used."""
        if not self.on_gpu or self.device_kernel is None:
            tok.device_out.zero_()
            if n_pairs:
                self._experts_on_device(tok.x, tok.planner.pairs[:, :n_pairs].to(self.device), tok.device_out)
            return
        if self._token_graph is not None:
            self._token_graph.replay()
            return

        def work() -> None:
            tok.pairs.copy_(tok.planner.pairs, non_blocking=True)
            tok.device_out.zero_()
            self.device_kernel(tok.x, self.slots, tok.pairs[0], tok.pairs[1], tok.pairs[2].view(torch.float32),
                               tok.device_out)

        self._token_device_calls += 1
        if self._token_device_calls == 1:
            work()
            return
        self._token_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._token_graph):
            work()
        self._token_graph.replay()

    def _launch_general(self, moe_layer: int, t: int, k: int, first_position: int) -> None:
        t0 = time.perf_counter()
        hidden = self.hidden
        packed = self._buffer("in", t, hidden + 2 * k, self.device)
        host = self._staged_host(t, k)
        arr = host.numpy()
        ids, w = self.routed(moe_layer, first_position, arr[:, hidden:hidden + k].astype(np.int64),
                             arr[:, hidden + k:])
        r = Routing.build(moe_layer * self.num_experts, ids, w)
        slots = self.cache.lookup(r.ids)
        hit, miss = np.flatnonzero(slots >= 0), np.flatnonzero(slots < 0)
        if self.cache.policy == "static" and not self.cache.frozen:
            self.prompt_counts[r.ids] += r.counts()
        # Misses the CPU computed lately are filled first (they recur), then the busiest: they
        # carry the most tokens.
        recent = self.cache.computed_on_cpu_within(r.ids[miss], self.recent_steps)
        busy = -r.counts()[miss] if t > 1 else np.zeros(miss.size, dtype=np.int64)
        miss = miss[np.lexsort((busy, ~recent))]
        victims = self.cache.victims(self.planner.fills_for(miss.size, int(recent.sum())), in_use=slots[hit])
        fill, cpu = miss[: victims.size], miss[victims.size:]
        self.cache.cpu_step[r.ids[cpu]] = self.cache.step
        cpu_out = self._buffer("cpu_out", t, hidden).zero_()
        self._cpu_t0 = time.perf_counter()
        if cpu.size:
            self.kernel.start(self.gate_up, self.down, host[:, :hidden].contiguous(), cpu_out, *r.tensors(cpu))
        self.cache.install(victims, r.ids[fill])
        on_device, device_slots = np.concatenate([hit, fill]), np.concatenate([slots[hit], victims])
        self.cache.touch(device_slots)
        self._count(r.ids.size, hit.size, fill.size, cpu.size)
        self._plan_s = time.perf_counter() - t0
        self.stats.host_s["plan"] += self._plan_s
        self._copy_rows(victims, r.ids[fill])
        out = self._buffer("device_out", t, hidden, self.device).zero_()
        self._outputs = (out, cpu_out)
        if on_device.size:
            pairs = self._pairs(r, on_device, device_slots)
            # Many tokens per expert (a prompt): GEMM tiles; a few (decode batches): one pass per pair.
            run = self.grouped_on_device if pairs.shape[1] >= 4 * on_device.size else self._experts_on_device
            with self.stats.compute.measure():
                run(packed[:, :hidden].contiguous(), pairs, out)

    def _staged_host(self, t: int, k: int) -> torch.Tensor:
        """The staged call on the host: its pinned copy beside a GPU, else the buffer itself."""
        return self._buffer("in_host" if self.on_gpu else "in", t, self.hidden + 2 * k,
                            None if self.on_gpu else self.device)

    def _buffer(self, name: str, t: int, width: int, device: torch.device | None = None,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A reused buffer [t, width] on `device` (None: the host, pinned beside a GPU). One-token
        buffers are sized once; others grow when a call needs more."""
        key = (name, t == 1)
        n = t * width
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            on_host = device is None or device.type == "cpu"
            buf = torch.empty(n, dtype=dtype, device=device or "cpu", pin_memory=on_host and self.on_gpu)
            self._buffers[key] = buf
        return buf[:n].view(t, width)

    def _count(self, unique: int, hits: int, fills: int, cpu: int) -> None:
        s = self.stats
        s.calls += 1
        s.unique += unique
        s.hits += hits
        s.fills += fills
        s.cpu += cpu
        s.miss_bound_s += self.planner.bound_s(fills + cpu, fills, self.host_rows.shape[1])

    def _copy_rows(self, slots: np.ndarray, ids: np.ndarray) -> None:
        """Copies FTW rows `ids` into `slots` on the current stream, which is idle here (every call
        begins with a sync), so no earlier kernel can still read a victim."""
        self._fills_s = 0.0
        if not slots.size:
            return
        t0 = time.perf_counter()
        with self.stats.copy.measure():
            self.copy_rows_now(slots, ids)
        self._fills_s = time.perf_counter() - t0
        self.stats.host_s["fills"] += self._fills_s

    def copy_rows_now(self, slots: np.ndarray, ids: np.ndarray) -> None:
        """Queues the copies of FTW rows `ids` into `slots` on the current stream."""
        if not slots.size:
            return
        if not self.on_gpu:
            self.slots[torch.from_numpy(slots)] = self.host_rows[torch.from_numpy(ids)]
            return
        for s, i in zip(slots.tolist(), ids.tolist(), strict=True):
            self.slots[s].copy_(self.host_rows[i], non_blocking=True)

    def _pairs(self, r: Routing, which: np.ndarray, slots: np.ndarray) -> torch.Tensor:
        """int32 [3, pairs] on the device: slot, token row, router weight (its bits)."""
        _, offsets, tok_idx, tok_w = r.subset(which)
        host = self._buffer("pair_list", 3, tok_idx.size, dtype=torch.int32)
        arr = host.numpy()
        arr[0] = np.repeat(slots, np.diff(offsets))
        arr[1] = tok_idx
        arr[2] = tok_w.view(np.int32)
        return host.to(self.device, non_blocking=True)

    def _experts_on_device(self, x: torch.Tensor, pairs: torch.Tensor, out: torch.Tensor) -> None:
        """out += the pairs' experts with the decode kernel (a few tokens per expert), else torch."""
        if self.device_kernel is None:
            self._torch_experts(x, pairs, out)
            return
        self.device_kernel(x, self.slots, pairs[0], pairs[1], pairs[2].view(torch.float32), out)

    def grouped_on_device(self, x: torch.Tensor, pairs: torch.Tensor, out: torch.Tensor) -> None:
        """out += the pairs' experts with the grouped GEMM kernel (many tokens per expert), else torch."""
        if self.grouped_kernel is None:
            self._torch_experts(x, pairs, out)
            return
        self.grouped_kernel(x, self.slots, pairs[0], pairs[1], pairs[2].view(torch.float32), out)

    def _torch_experts(self, x: torch.Tensor, pairs: torch.Tensor, out: torch.Tensor) -> None:
        """out += the pairs' experts ([3, P] int32: slot, token, weight bits; the pairs of a slot
        adjacent) with torch, one expert at a time over all its tokens, fp32 arithmetic."""
        pair_slot, pair_tok, pair_w = pairs[0], pairs[1], pairs[2].view(torch.float32)
        slots = pair_slot.tolist()
        starts = [0] + [j for j in range(1, len(slots)) if slots[j] != slots[j - 1]] + [len(slots)]
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            t = pair_tok[a:b].long()
            gate, up = F.linear(x[t], self._weight(slots[a], "gate_up").float()).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self._weight(slots[a], "down").float())
            out.index_add_(0, t, y * pair_w[a:b, None])

    def _weight(self, slot: int, bank: str) -> torch.Tensor:
        offset, nbytes, shape = self.banks[bank]
        return self.slots[slot, offset:offset + nbytes].view(torch.bfloat16).view(shape)
