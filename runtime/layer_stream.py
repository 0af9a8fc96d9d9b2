"""`LayerStream`: one prompt chunk's MoE layers streamed whole through full-layer buffers.

A long chunk routes to nearly every expert of every layer, so it moves each layer's uncached
experts over PCIe once and computes everything on the device. Two buffers of E slots each are
borrowed from the global slot cache (its least recently used slots): while the device computes MoE
layer j from one, a copy stream fills the other with layer j + 1; events order them (a buffer is
refilled only after the layer that read it is done). Experts the cache already holds elsewhere are
used where they are. The buffers' slots are ordinary cache entries: when the chunk ends, the last
layers streamed stay cached for decode. With one buffer (`overlap=False`) each layer is loaded,
then computed: the baseline that double buffering is measured against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .offload import OffloadedExperts


class LayerStream:
    def __init__(self, experts: OffloadedExperts, overlap: bool):
        self.experts, self.overlap = experts, overlap
        e, cache = experts.num_experts, experts.cache
        n_buffers = 2 if overlap else 1
        slots = cache.victims(n_buffers * e, in_use=np.empty(0, dtype=np.int64))
        if slots.size < n_buffers * e:
            raise ValueError(f"{n_buffers} layer buffers need {n_buffers * e} slots, the cache has {cache.n_slots}")
        cache.evict(slots)  # the buffers start empty: each holds only layers streamed by this chunk
        self.buffers = [np.sort(slots[i * e:(i + 1) * e]) for i in range(n_buffers)]
        self.on_gpu = experts.on_gpu
        self.copy_stream = torch.cuda.Stream(experts.device) if self.on_gpu else None
        if self.copy_stream is not None:  # kernels queued before this chunk may still read the buffers' slots
            self.copy_stream.wait_stream(torch.cuda.current_stream(experts.device))
        self.ready: dict[int, torch.cuda.Event] = {}  # MoE layer → its copies have landed
        self.released: list[torch.cuda.Event | None] = [None] * n_buffers  # a buffer's last reader is done
        self.loaded: set[int] = set()
        self.num_layers = experts.pool.header.num_moe_layers
        self.load(0)

    def load(self, j: int) -> None:
        """Queues the copies of MoE layer j's uncached experts into its buffer (at once, or after
        the layer that last read that buffer), evicting what the buffer held."""
        if j in self.loaded or j >= self.num_layers:
            return
        self.loaded.add(j)
        cache, e = self.experts.cache, self.experts.num_experts
        buffer = self.buffers[j % len(self.buffers)]
        cache.evict(buffer)
        ids = j * e + np.arange(e, dtype=np.int64)
        missing = ids[cache.slot_of[ids] < 0]
        dst = buffer[:missing.size]
        cache.install(dst, missing)
        self.experts.stats.streamed += missing.size
        if self.copy_stream is None:
            self.experts.copy_rows_now(dst, missing)
            return
        released = self.released[j % len(self.buffers)]
        with torch.cuda.stream(self.copy_stream):
            if released is not None:
                self.copy_stream.wait_event(released)
            self.experts.copy_rows_now(dst, missing)
            self.ready[j] = torch.cuda.Event()
            self.ready[j].record(self.copy_stream)

    def forward(self, j: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                first_position: int) -> torch.Tensor:
        """MoE layer j for the chunk's T tokens: x [T, hidden] fp32, ids/weights [T, k]."""
        experts, cache, e = self.experts, self.experts.cache, self.experts.num_experts
        self.load(j)
        if self.overlap:
            self.load(j + 1)  # the next layer crosses PCIe while this one computes
        t, k = ids.shape
        if experts.routing is not None:
            host_ids, host_w = experts.routed(j, first_position, ids.cpu().numpy().astype(np.int64),
                                              weights.float().cpu().numpy())
            ids, weights = torch.from_numpy(host_ids).to(x.device), torch.from_numpy(host_w).to(x.device)
        slot_table = torch.from_numpy(cache.slot_of[j * e:(j + 1) * e].astype(np.int32)).to(x.device)
        flat_slot = slot_table[ids.reshape(-1)]
        order = torch.argsort(flat_slot, stable=True)
        tokens = torch.arange(t, device=x.device, dtype=torch.int32).repeat_interleave(k)
        pairs = torch.stack([flat_slot[order], tokens[order], weights.reshape(-1).float()[order].view(torch.int32)])
        out = torch.zeros_like(x)
        if self.on_gpu and j in self.ready:
            torch.cuda.current_stream(x.device).wait_event(self.ready.pop(j))
        with experts.stats.compute.measure():
            experts.grouped_on_device(x.contiguous(), pairs, out)
        if self.on_gpu:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(x.device))
            self.released[j % len(self.buffers)] = done
        used = np.unique(cache.slot_of[j * e + ids.reshape(-1).cpu().numpy()])
        cache.touch(used)
        s = experts.stats
        s.stream_layers += 1
        return out
