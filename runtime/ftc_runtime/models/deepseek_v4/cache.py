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
from ftc_runtime.models.deepseek_v4.state import LayerMark, LayerState
from ftc_runtime.spec import ModelSpec


def state_bytes(spec: ModelSpec, tokens: int, element_size: int) -> int:
    """Bytes of one sequence's state after `tokens` tokens: per layer the ring of its last
    sliding_window raw rows, and per compressor (a layer's own, a CSA layer's indexer's) its
    entries so far, the source rows (keys and gates) of one window and, where windows overlap
    (CSA), the last closed one's first series with its gates in fp32."""
    c, d = spec.compressed, spec.attention.head_dim

    def compressor(rate: int, dim: int, overlap: bool) -> int:
        width = 2 * dim if overlap else dim
        own = (tokens // rate * dim + 2 * rate * width + (rate * dim if overlap else 0)) * element_size
        return own + (rate * dim * 4 if overlap else 0)

    total = 0
    for kind in c.layer_types:
        total += c.sliding_window * d * element_size
        if kind == "hca":
            total += compressor(c.hca_rate, d, False)
        elif kind == "csa":
            total += compressor(c.csa_rate, d, True) + compressor(c.csa_rate, c.index_head_dim, True)
    return total


class CompressedCache(SequenceCache):
    # A pass cannot keep the state after each of its tokens (it would have to stop at each): a
    # rejected draft is undone by rewinding to the state before the pass and running the kept
    # tokens again (`Sequence.verify_drafts`).
    rewinds_by_replay = True

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

    def mark(self) -> tuple[int, tuple[LayerMark, ...]]:
        """The state now, to `rewind` to: each layer's fixed-size parts (`LayerState.mark`)."""
        return self.length, tuple(layer.mark() for layer in self.layers)

    def rewind(self, mark: tuple[int, tuple[LayerMark, ...]]) -> None:
        """Back to the state at `mark` (taken by this cache before the passes since)."""
        length, layers = mark
        for layer, saved in zip(self.layers, layers, strict=True):
            layer.rewind(saved)
        self.length = length

    def reserve(self, n: int) -> None:
        """Room in every layer for a decode step at token n - 1 (`LayerState.reserve`)."""
        for layer in self.layers:
            layer.reserve(n)

    def stepped(self) -> None:
        for layer in self.layers:
            layer.stepped()
        self.length += 1

    def bytes_for(self, n: int) -> int:
        return state_bytes(self.spec, n, self.dtype.itemsize)
