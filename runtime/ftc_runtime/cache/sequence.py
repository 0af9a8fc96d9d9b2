"""`SequenceCache`: one sequence's state, for every family: the keys and values of its attention
layers, and the recurrent state of its linear layers (none in a pure-attention model).

Recurrent state replaces a layer's whole past, so it cannot be cut back to an earlier token the way
a KV cache can. `take` copies it at the current token (on the device, no host round trip) and
`restore` rewinds the sequence there, from a copy on any device (the prefix cache keeps them in
host memory): the attention layers keep their keys and values before that token (later appends
overwrite the rest), the recurrent layers get the copy, in their own storage (which never moves:
CUDA graphs hold it).
"""

from __future__ import annotations

from ftc_runtime.cache.base import RecurrentCheckpoint, RecurrentState
from ftc_runtime.cache.kv import KVCache


class SequenceCache:
    # A rejected draft is cut off by `truncate` (a cache whose pass cannot keep each token's state
    # instead rewinds to a `mark` taken before the pass and runs the kept tokens again).
    rewinds_by_replay = False

    def __init__(self, kv: KVCache, linear: list[RecurrentState] | None = None):
        self.kv = kv  # indexed by attention layer (the i-th such layer is KV layer i)
        self.linear = linear or []  # indexed by recurrent layer
        # Checkpoints taken inside prompt chunks (`forward(checkpoint_at=...)`), by length.
        self.checkpoints: dict[int, RecurrentCheckpoint] = {}
        # The most tokens of one speculative pass (0: none): each leaves a copy of the recurrent
        # state behind it, in the pass's row buffers and in the copies a rejection rewinds to.
        self.pass_tokens = 0

    @property
    def length(self) -> int:
        return self.kv.length

    @length.setter
    def length(self, n: int) -> None:
        self.kv.length = n

    @property
    def generation(self) -> int:
        """Renewed when the KV storage moves; the recurrent layers' storage never does."""
        return self.kv.generation

    @property
    def recurrent(self) -> bool:
        """The sequence has recurrent layers: it resumes only where a checkpoint holds their state."""
        return bool(self.linear)

    def reserve(self, n: int) -> None:
        self.kv.reserve(n)

    def stepped(self) -> None:
        """Counts a decode step's token, which a CUDA graph wrote into the state (its position as
        data, the host's counts left to the host)."""
        self.length += 1

    def bytes_for(self, n: int) -> int:
        """Device bytes once the sequence holds n tokens: its KV cache and its recurrent state,
        and two copies of that state per token of a speculative pass (`pass_tokens`)."""
        state = sum(s.nbytes for s in self.linear)
        return self.kv.bytes_for(n) + state * (1 + (0 if self.rewinds_by_replay else 2 * self.pass_tokens))

    def take(self) -> RecurrentCheckpoint:
        """The recurrent layers' state at the current token, copied on its device."""
        return RecurrentCheckpoint(self.length, tuple(s.clone() for s in self.linear))

    def restore(self, checkpoint: RecurrentCheckpoint) -> None:
        """Rewinds the sequence to `checkpoint.length` tokens (at most its current length: the
        keys and values before that token must still be here)."""
        if checkpoint.length > self.length:
            raise ValueError(f"restore to token {checkpoint.length}: the sequence holds only {self.length}")
        if len(checkpoint.states) != len(self.linear):
            raise ValueError(f"restore: the checkpoint has {len(checkpoint.states)} recurrent layers, "
                             f"the model {len(self.linear)}")
        for state, saved in zip(self.linear, checkpoint.states, strict=True):
            state.assign(saved)
        self.length = checkpoint.length

    def truncate(self, n: int, checkpoint: RecurrentCheckpoint | None = None) -> None:
        """Cuts the sequence back to its first n tokens (a speculative pass's rejected drafts): the
        attention layers' keys and values past n are overwritten by later appends. A recurrent
        layer's state has no earlier token to cut back to: a sequence with any takes the state
        after token n from `checkpoint` (taken in the pass, `forward`'s checkpoint_at)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate to token {n}: the sequence holds {self.length}")
        if not self.recurrent:
            self.length = n
        elif checkpoint is None or checkpoint.length != n:
            raise ValueError(f"truncate to token {n}: this sequence's state includes recurrent layers, which "
                             "rewind only to a checkpoint taken after that token")
        else:
            self.restore(checkpoint)
