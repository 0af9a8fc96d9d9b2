"""`CompressedCache`: one sequence's state in DeepSeek-V4, as the engine, the scheduler and the prefix
cache see a sequence (`cache.base.SequenceState`). Each layer's state (`state.LayerState`)
replaces the layer's past as a recurrent state does: a sliding window of raw rows, the open windows
of its compressors, their entries so far. So the sequence resumes only where a checkpoint holds
that state: the prefix cache takes the model as recurrent, and its nodes hold no keys or values
(the KV cache has no layers); a checkpoint is every layer's state, copied.
"""

from __future__ import annotations

import torch

from ftc_runtime.cache.base import RecurrentCheckpoint
from ftc_runtime.cache.kv import KVCache
from ftc_runtime.experts.vram_plan import sequence_state_bytes
from ftc_runtime.models.deepseek_v4.state import LayerState
from ftc_runtime.spec import ModelSpec


class CompressedCache:
    def __init__(self, spec: ModelSpec, layers: list[LayerState], dtype: torch.dtype, device: torch.device):
        self.spec, self.layers, self.dtype = spec, layers, dtype
        # No layer keeps per-token keys: the empty KV cache carries the length the prefix cache sets.
        self.kv = KVCache(0, 1, 1, dtype, device)
        self.checkpoints: dict[int, RecurrentCheckpoint] = {}

    @property
    def length(self) -> int:
        return self.kv.length

    @length.setter
    def length(self, n: int) -> None:
        self.kv.length = n

    @property
    def generation(self) -> int:
        return self.kv.generation

    @property
    def recurrent(self) -> bool:
        return True

    def reserve(self, n: int) -> None:
        """Nothing to reserve: the state grows by its compressed entries as tokens come."""

    def bytes_for(self, n: int) -> int:
        return sequence_state_bytes(self.spec, n, self.dtype.itemsize)

    def take(self) -> RecurrentCheckpoint:
        return RecurrentCheckpoint(self.length, tuple(layer.clone() for layer in self.layers))

    def restore(self, checkpoint: RecurrentCheckpoint) -> None:
        """Rewinds the sequence to `checkpoint.length` tokens."""
        if checkpoint.length > self.length:
            raise ValueError(f"restore to token {checkpoint.length}: the sequence holds only {self.length}")
        if len(checkpoint.states) != len(self.layers):
            raise ValueError(f"restore: the checkpoint has {len(checkpoint.states)} layers, the model "
                             f"{len(self.layers)}")
        for layer, saved in zip(self.layers, checkpoint.states, strict=True):
            layer.assign(saved)
        self.length = checkpoint.length
