"""`LayerStream`: one prompt chunk's MoE layers streamed whole through full-layer buffers.

A long chunk routes to nearly every expert of every layer, so it moves each layer's uncached
experts over PCIe once and computes everything on the device. While the device computes MoE layer
j, a copy stream fills the slots of the next layer that has uncached experts (layers the cache
holds whole in between cost nothing); events order them (a slot is refilled only after the
layers that read it are done). Copies go to the slots whose next use is farthest
(`ExpertCache.scan_victims`: the layers just computed, then the farthest ahead), never to those
of the layers in flight. So the cache keeps a fixed set of layers, as many as it holds beside two
layers' worth of slots (E each) that cycle: the next chunk or prompt finds them cached, streams
only the rest, and starts on that while it computes the cached ones; decode starts warm. With
one buffer (`overlap=False`) each layer is loaded, then computed: the baseline that double
buffering is measured against.

Layers whose routing is known before their router runs (DeepSeek-V4's hash layers route by token
id) load only the experts their tokens route to, and do not stop the loading ahead: their copies
are queued as soon as the slots allow, from the chunk's start, behind the copies before them.

With a CPU part (`StreamCpuPart`, FreeToken's split applied to prompts), each layer's copies
leave out some of its uncached experts, as many as `PromptSplit` says the CPU computes in the
time the copies take: those stay in host memory (not filled: the cache keeps its set) and the
CPU computes them in place while the device computes the rest (beside a GPU the device waits for
the CPU's result, and the host queues on). The stretch from one layer's CPU end to the next one's
start (the next layer's input needs this one's result) tells the split what a CPU part costs
beyond its own work (`StreamCpuPart`). Where a layer's copies had landed by its routing, the CPU
got too many: the chunk's next layers give it fewer.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ftc_runtime.experts.slots import SlotStore
from ftc_runtime.experts.stats import OffloadStats
from ftc_runtime.experts.stream_cpu import FIRST_CPU_CODE, StreamCpuPart, cpu_codes


def stream_slots(num_experts: int, overlap: bool) -> int:
    """Slots that streaming a prompt chunk's layers borrows: one or two full layers."""
    return num_experts * (2 if overlap else 1)


class LayerStream:
    """`known`: MoE layer → the experts (ids within the layer) its tokens route to, for the layers
    whose routing is known before the chunk runs; the chunk's routing there must be within it.
    `cpu`: the CPU's part of each layer (None: every uncached expert is copied), for a chunk of
    `n_tokens` tokens. `num_layers`: the MoE layers a chunk runs, the pool's first (a
    multi-token-prediction layer after them is never streamed)."""

    def __init__(self, store: SlotStore, stats: OffloadStats, overlap: bool, num_layers: int,
                 known: Mapping[int, np.ndarray] | None = None, cpu: StreamCpuPart | None = None,
                 n_tokens: int = 0):
        self.store, self.stats, self.overlap, self.cpu, self.n_tokens = store, stats, overlap, cpu, n_tokens
        self.on_cpu: dict[int, np.ndarray] = {}  # MoE layer → FTW rows of the experts the CPU computes
        self.cpu_cap: int | None = None  # at most this many CPU experts a layer from now on (None: the split's)
        self.known = {j: np.unique(np.asarray(experts, dtype=np.int64)) for j, experts in (known or {}).items()}
        need = stream_slots(store.num_experts, overlap)
        if store.cache.n_slots < need:
            raise ValueError(f"streaming layers needs {need} slots, the cache has {store.cache.n_slots}")
        self.on_gpu = store.on_gpu
        self.copy_stream = torch.cuda.Stream(store.device) if self.on_gpu else None
        if self.copy_stream is not None:  # kernels queued before this chunk may still read any slot
            self.copy_stream.wait_stream(torch.cuda.current_stream(store.device))
        self.ready: dict[int, torch.cuda.Event] = {}  # MoE layer → its copies have landed
        self.last_done: torch.cuda.Event | None = None  # the device is done with the last layer computed
        self.loaded: dict[int, int] = {}  # MoE layer → experts it copied (0: all were cached)
        self.loaded_during: dict[int, int] = {}  # MoE layer → the layer computing when its copies were queued
        self.num_layers = num_layers  # the chunk's MoE layers: the pool's first
        self.load(0, np.empty(0, dtype=np.int64), 0)
        if overlap and 0 in self.known:
            self.load_ahead(0)  # the known layers after the first need no router: queue them now

    def load(self, j: int, held: np.ndarray, now: int) -> bool:
        """While layer `now` computes, queues the copies of MoE layer j's uncached experts into the
        scan's victims, never a slot in `held` (the layers from `now` to j), after the device is
        done with every layer computed so far (any of them may have read those slots). False,
        loading nothing, when the cache has too few other slots."""
        cache, e = self.store.cache, self.store.num_experts
        ids = j * e + self.known.get(j, np.arange(e, dtype=np.int64))
        slots = cache.slot_of[ids]
        missing = ids[slots < 0]
        on_cpu = self.cpu.split.cpu_count(missing.size, self.n_tokens, self.cpu_cap) if self.cpu is not None else 0
        missing, computed_in_place = missing[:missing.size - on_cpu], missing[missing.size - on_cpu:]
        dst = cache.scan_victims(missing.size, np.concatenate([slots[slots >= 0], held]), now,
                                 self.num_layers)
        if dst.size < missing.size:
            return False
        if on_cpu:
            self.on_cpu[j] = computed_in_place
            self.stats.stream_cpu += on_cpu
        self.loaded[j], self.loaded_during[j] = missing.size, now
        cache.install(dst, missing)
        cache.touch(dst)
        self.stats.streamed += missing.size
        if self.copy_stream is None:
            self.store.copy_rows_now(dst, missing)
            return True
        with torch.cuda.stream(self.copy_stream):
            if self.last_done is not None:
                self.copy_stream.wait_event(self.last_done)
            self.store.copy_rows_now(dst, missing)
            self.ready[j] = torch.cuda.Event()
            self.ready[j].record(self.copy_stream)
        return True

    def load_ahead(self, j: int) -> None:
        """Loads the layers after j in order until one of them has copies in flight and an unknown
        routing: layers the cache holds cost nothing, so the copies of the next uncached layer run
        beside the compute of every cached layer before it (a chunk after the first finds its
        first layers cached); a layer of known routing loads only its routed experts, and the
        loading goes on past it."""
        for p in range(j + 1, self.num_layers):
            if p not in self.loaded and not self.load(p, self._slots_of(range(j, p)), j):
                return  # the layers before p hold too much of the cache: try again after layer j
            if self.loaded[p] and p not in self.known:
                return

    def abandon(self) -> None:
        """The chunk ended before its last MoE layer: later work on the device waits for the copies
        queued so far, since the cache already lists their slots as filled."""
        if self.cpu is not None:
            self.cpu.abandon()
        if self.copy_stream is not None:
            torch.cuda.current_stream(self.store.device).wait_stream(self.copy_stream)

    def _slots_of(self, layers: range) -> np.ndarray:
        e = self.store.num_experts
        slots = self.store.cache.slot_of[layers.start * e:layers.stop * e]
        return slots[slots >= 0]

    def _cap_cpu(self, cpu_experts: int, landed: bool) -> None:
        """A layer with `cpu_experts` on the CPU, whose copies were queued while the layer before it
        computed, reached its routing with those copies `landed` or not. Landed, the device will
        not wait for them: the CPU's part, and the serial stretch it costs, held the layer up, or
        the device's own work did (4-bit experts' layers at thousands of tokens copy in less time
        than they compute): the chunk's next layers give the CPU one expert fewer each time. Still
        landing, the copies bound the layer, and the split's balance decides again. Kept for one
        chunk: the next starts from the balance."""
        if not landed:
            self.cpu_cap = None
            return
        cap = cpu_experts if self.cpu_cap is None else min(self.cpu_cap, cpu_experts)
        self.cpu_cap = max(0, cap - 1)

    def _slot_table(self, layer_slots: np.ndarray, on_cpu: np.ndarray | None, first: int,
                    device: torch.device) -> torch.Tensor:
        """The layer's slot per expert (int32, the CPU's experts as their codes) on the device.
        Queued before the next layer's copies: host→device copies wait their turn behind those
        queued before them, whatever the stream, and this one gates the layer's routing."""
        table = layer_slots.astype(np.int32)
        if on_cpu is not None:
            table[on_cpu - first] = cpu_codes(on_cpu.size)
        slot_table = torch.from_numpy(table)
        if self.on_gpu:  # pinned, so that the copy does not wait for the device's queue
            slot_table = slot_table.pin_memory()
        return slot_table.to(device, non_blocking=True)

    def forward(self, j: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """MoE layer j for the chunk's T tokens: x [T, hidden] fp32, ids/weights [T, k] on the
        device. The host never waits for the routing: every expert the layer's tokens can route to
        is resident, so its slot table is known here, and the host queues copies and kernels ahead
        of the device."""
        cache, e = self.store.cache, self.store.num_experts
        t, k = ids.shape
        if j not in self.loaded:
            self.load(j, np.empty(0, dtype=np.int64), j)
        # The layer's slots count as used now (a streamed chunk is long enough to route to nearly
        # every expert): decode's LRU after the chunk sees them. A layer of known routing may
        # leave experts its tokens do not route to uncached.
        layer_slots = cache.slot_of[j * e:(j + 1) * e]
        cache.touch(layer_slots[layer_slots >= 0])
        on_cpu = self.on_cpu.pop(j, None)
        slot_table = self._slot_table(layer_slots, on_cpu, j * e, x.device)
        if self.overlap:
            self.load_ahead(j)  # the next uncached layer crosses PCIe while this one computes
        flat_slot = slot_table[ids.reshape(-1)]
        order = torch.argsort(flat_slot, stable=True)
        tokens = torch.arange(t * k, device=x.device, dtype=torch.int32) // k
        pairs = torch.stack([flat_slot[order], tokens[order], weights.reshape(-1).float()[order].view(torch.int32)])
        out = torch.zeros_like(x)
        n_cpu = 0
        landed = self.ready.pop(j, None) if self.on_gpu else None
        if on_cpu is not None:
            n_cpu = int((flat_slot <= FIRST_CPU_CODE).sum())  # waits for the routing
            if landed is not None and self.loaded_during.get(j) == j - 1:  # did the device find them done?
                self._cap_cpu(on_cpu.size, landed.query())
        if n_cpu:  # the CPU's pairs lead the list; it starts on them before this layer's copies land
            self.cpu.start(j, x, pairs[:, :n_cpu], on_cpu)
            pairs = pairs[:, n_cpu:]
        if landed is not None:
            torch.cuda.current_stream(x.device).wait_event(landed)
        if pairs.shape[1]:
            with self.stats.compute.measure():
                self.store.grouped_on_device(x.contiguous(), pairs, out)
        if n_cpu:
            self.cpu.finish(out, lambda: landed is None or landed.query())
        if self.cpu is not None and j == self.num_layers - 1:
            self.cpu.join()  # the chunk's last part: its pool is free for the next chunk or decode
        if self.on_gpu:
            self.last_done = torch.cuda.Event()
            self.last_done.record(torch.cuda.current_stream(x.device))
        self.stats.stream_layers += 1
        return out
