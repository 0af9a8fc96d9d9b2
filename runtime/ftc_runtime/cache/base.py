"""What the prefix cache, the scheduler and the VRAM plan know of one sequence's state, whatever the
family: a KV cache for its attention layers, and the recurrent state of any layers whose state
replaces their past (Gated DeltaNet), which can only be rewound to a copy taken earlier."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ftc_runtime.cache.kv import KVCache


class RecurrentState(Protocol):
    """One layer's recurrent state. Its storage moves only where the sequence's `generation` says
    so (CUDA graphs hold it): `assign` copies into it."""

    def clone(self) -> RecurrentState: ...

    def to(self, device: torch.device | str) -> RecurrentState: ...

    def assign(self, other: RecurrentState) -> None: ...

    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class RecurrentCheckpoint:
    """The recurrent layers' state after the sequence's first `length` tokens (copies, owned)."""

    length: int
    states: tuple[RecurrentState, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.states)

    def to(self, device: torch.device | str) -> RecurrentCheckpoint:
        return RecurrentCheckpoint(self.length, tuple(s.to(device) for s in self.states))


class SequenceState(Protocol):
    """One sequence's state on the model's device (`SequenceCache` is the one implementation;
    models build it with `new_cache`)."""

    kv: KVCache
    checkpoints: dict[int, RecurrentCheckpoint]  # taken inside prompt chunks, by length
    # False: a speculative pass's rejected drafts are cut off by `truncate`; True: the state offers
    # `mark()` and `rewind(mark)` instead, and the kept tokens run again after the rewind.
    rewinds_by_replay: bool
    pass_tokens: int  # the most tokens of one speculative pass, whose state copies `bytes_for` counts

    @property
    def length(self) -> int: ...

    @property
    def generation(self) -> int: ...

    @property
    def recurrent(self) -> bool: ...

    def reserve(self, n: int) -> None: ...

    def stepped(self) -> None: ...

    def bytes_for(self, n: int) -> int: ...

    def take(self) -> RecurrentCheckpoint: ...

    def restore(self, checkpoint: RecurrentCheckpoint) -> None: ...

    def truncate(self, n: int, checkpoint: RecurrentCheckpoint | None = None) -> None: ...
