"""`CompressedCache`: one sequence's state in DeepSeek-V4, as the engine, the scheduler and the prefix
cache see a sequence (`cache.base.SequenceState`). Each layer's state (`state.LayerState`)
replaces the layer's past as a recurrent state does: a sliding window of raw rows, the open windows
of its compressors, their entries so far. So it is a `SequenceCache` whose every layer is
recurrent: the sequence resumes only where a checkpoint holds that state, the prefix cache takes
the model as recurrent, and its nodes hold no keys or values (the KV cache has no layers). A
layer's entries move when their storage grows: the sequence's `generation` is renewed then.
"""

from __future__ import annotations

import torch

from ftc_runtime.cache.kv import KVCache, new_generation
from ftc_runtime.cache.sequence import SequenceCache
from ftc_runtime.experts.vram_plan import sequence_state_bytes
from ftc_runtime.models.deepseek_v4.state import LayerState
from ftc_runtime.spec import ModelSpec


class CompressedCache(SequenceCache):
    def __init__(self, spec: ModelSpec, layers: list[LayerState], dtype: torch.dtype, device: torch.device):
        # No layer keeps per-token keys: the empty KV cache carries the length the prefix cache sets.
        super().__init__(KVCache(0, 1, 1, dtype, device), layers)
        self.spec, self.layers, self.dtype = spec, layers, dtype
        self._moves, self._generation = 0, new_generation()

    @property
    def generation(self) -> int:
        moves = sum(layer.moves for layer in self.layers)
        if moves != self._moves:
            self._moves, self._generation = moves, new_generation()
        return self._generation

    def reserve(self, n: int) -> None:
        """Room in every layer for a decode step at token n - 1 (`LayerState.reserve`)."""
        for layer in self.layers:
            layer.reserve(n)

    def stepped(self) -> None:
        for layer in self.layers:
            layer.stepped()
        self.length += 1

    def bytes_for(self, n: int) -> int:
        return sequence_state_bytes(self.spec, n, self.dtype.itemsize)
