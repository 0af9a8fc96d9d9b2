"""`HybridCache`: one sequence's state in a hybrid model (Gated DeltaNet and full attention): the
keys and values of its full-attention layers and the Gated DeltaNet state of its linear layers.

The linear layers' state replaces their whole past, so it cannot be cut back to an earlier token
the way a KV cache can. `take` copies it at the current token (on the device, no host round trip)
and `restore` rewinds the sequence there, from a copy on any device (the prefix cache keeps them
in host memory): the full-attention layers keep their keys and values before that token (later
appends overwrite the rest), the linear layers get the copy, in their own storage (which never
moves: CUDA graphs hold it).
"""

from __future__ import annotations

from dataclasses import dataclass

from ftc_runtime.cache.kv import KVCache
from ftc_runtime.models.layers.gated_deltanet import DeltaNetState


@dataclass(frozen=True)
class RecurrentCheckpoint:
    """The linear layers' state after the sequence's first `length` tokens (copies, owned)."""

    length: int
    states: tuple[DeltaNetState, ...]


class HybridCache:
    def __init__(self, kv: KVCache, linear: list[DeltaNetState]):
        self.kv = kv  # indexed by full-attention layer (the i-th such layer is KV layer i)
        self.linear = linear  # indexed by linear layer
        # Checkpoints taken inside prompt chunks (`Qwen3NextModel.forward(checkpoint_at=...)`), by length.
        self.checkpoints: dict[int, RecurrentCheckpoint] = {}

    @property
    def length(self) -> int:
        return self.kv.length

    @length.setter
    def length(self, n: int) -> None:
        self.kv.length = n

    @property
    def generation(self) -> int:
        """Renewed when the KV storage moves; the linear layers' storage never does."""
        return self.kv.generation

    def reserve(self, n: int) -> None:
        self.kv.reserve(n)

    def bytes_for(self, n: int) -> int:
        """Device bytes once the sequence holds n tokens: its KV cache and its linear layers' state."""
        return self.kv.bytes_for(n) + sum(s.conv.numel() * s.conv.element_size()
                                          + s.recurrent.numel() * s.recurrent.element_size() for s in self.linear)

    def take(self) -> RecurrentCheckpoint:
        """The linear layers' state at the current token, copied on its device."""
        return RecurrentCheckpoint(self.length, tuple(s.clone() for s in self.linear))

    def restore(self, checkpoint: RecurrentCheckpoint) -> None:
        """Rewinds the sequence to `checkpoint.length` tokens (at most its current length: the
        keys and values before that token must still be here)."""
        if checkpoint.length > self.length:
            raise ValueError(f"restore to token {checkpoint.length}: the sequence holds only {self.length}")
        if len(checkpoint.states) != len(self.linear):
            raise ValueError(f"restore: the checkpoint has {len(checkpoint.states)} linear layers, "
                             f"the model {len(self.linear)}")
        for state, saved in zip(self.linear, checkpoint.states, strict=True):
            state.assign(saved)
        self.length = checkpoint.length
