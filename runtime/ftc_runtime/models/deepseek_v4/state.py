"""One sequence's state in one DeepSeek-V4 layer: small and of fixed size but for its compressed
entries. A layer's `RowStore` holds a ring of its last `sliding_window` raw key/value rows (the row
of position p in slot p % window) and after it the entries its compressor has closed so far, so
that a decode step reads every row it attends to from one tensor, in place. A compressor (the
layer's own, and for CSA its indexer's, whose entries have a store of their own) keeps the source
rows of its open window (position p's in slot p % rate) and, for overlapping windows, the first
series of the last closed one. Every part but the entries has a fixed size and never moves, and
the entries' storage moves only when it grows (`RowStore.moves`), so that a CUDA graph of a decode
step holds its addresses with the position as data. A prefix checkpoint copies the rows in use
and the fixed parts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

INITIAL_ENTRIES = 64  # entries a store holds before its first doubling


class RowStore:
    """Rows [fixed + capacity, d]: `fixed` rows first (a ring of raw rows; none for an indexer),
    then `count` entries, appended; the entries' capacity doubles when they outgrow it."""

    def __init__(self, data: torch.Tensor, fixed: int, count: int = 0):
        self.data, self.fixed, self.count = data, fixed, count
        self.moves = 0  # times the storage moved (grew)

    @classmethod
    def empty(cls, fixed: int, d: int, dtype: torch.dtype, device: torch.device | str) -> RowStore:
        return cls(torch.zeros(fixed + INITIAL_ENTRIES, d, dtype=dtype, device=device), fixed)

    @property
    def capacity(self) -> int:
        """Entries the storage holds without growing."""
        return self.data.shape[0] - self.fixed

    @property
    def entries(self) -> torch.Tensor:
        return self.data[self.fixed:self.fixed + self.count]

    def reserve(self, entries: int) -> None:
        """Room for `entries` entries: the capacity doubled (or more) when it falls short."""
        if entries > self.capacity:
            grown = self.data.new_zeros(self.fixed + max(entries, 2 * self.capacity), self.data.shape[1])
            grown[:self.fixed + self.count] = self.data[:self.fixed + self.count]
            self.data = grown
            self.moves += 1

    def append(self, rows: torch.Tensor) -> None:
        end = self.fixed + self.count + rows.shape[0]
        self.reserve(self.count + rows.shape[0])
        self.data[end - rows.shape[0]:end] = rows
        self.count += rows.shape[0]

    def used(self) -> torch.Tensor:
        return self.data[:self.fixed + self.count]

    def moved(self, move) -> RowStore:
        """A copy of the rows in use, `move`d (cloned, or copied to another device)."""
        return RowStore(move(self.used()), self.fixed, self.count)

    def assign(self, other: RowStore) -> None:
        """Takes `other`'s rows into this storage (grown if they do not fit)."""
        self.reserve(other.count)
        self.count = other.count
        self.data[:self.fixed + self.count] = other.used().to(self.data.device)


@dataclass
class CompressorState:
    """A compressor's entries (in `store`, after its fixed rows), the source rows (kv, gate) of its
    window, position p's in row p % rate (the rows past the open window's last token are the
    previous window's, never read), and for overlapping windows `prior`: the last closed window's
    first series and its biased gate (fp32), before the first window zeros with gates of -inf
    (no weight)."""

    store: RowStore
    open_kv: torch.Tensor
    open_gate: torch.Tensor
    prior: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def empty(cls, store: RowStore, rate: int, overlap: bool) -> CompressorState:
        data, d = store.data, store.data.shape[1]
        width = 2 * d if overlap else d
        prior = (data.new_zeros(rate, d), torch.full((rate, d), float("-inf"), device=data.device)) if overlap else None
        return cls(store, data.new_zeros(rate, width), data.new_zeros(rate, width), prior)

    @property
    def rate(self) -> int:
        return self.open_kv.shape[0]

    @property
    def entries(self) -> torch.Tensor:
        return self.store.entries

    def fixed_parts(self) -> list[torch.Tensor]:
        return [self.open_kv, self.open_gate, *(self.prior or ())]

    def moved(self, move, store: RowStore) -> CompressorState:
        """A copy on `store` (the moved store), its fixed parts `move`d."""
        return CompressorState(store, move(self.open_kv), move(self.open_gate),
                               None if self.prior is None else (move(self.prior[0]), move(self.prior[1])))

    def assign(self, other: CompressorState) -> None:
        """Takes `other`'s fixed parts into this one's tensors (its store is assigned apart)."""
        for mine, theirs in zip(self.fixed_parts(), other.fixed_parts(), strict=True):
            mine.copy_(theirs)


@dataclass(frozen=True)
class LayerMark:
    """What a pass may change in a layer's state, copied before it (`LayerState.mark`): the ring of
    raw rows, the compressors' fixed parts, the entry counts and the length. The entries before
    the mark stay as they are (a pass appends after them), so that they are not copied."""

    ring: torch.Tensor
    fixed: tuple[tuple[torch.Tensor, ...], ...]
    counts: tuple[int, ...]
    length: int


@dataclass
class LayerState:
    """One layer's state for one sequence: a `cache.base.RecurrentState`, which a prefix
    checkpoint copies whole. `compressor` and `indexer` where the layer has them; the compressor's
    entries share the layer's store."""

    rows: RowStore
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None
    length: int = 0  # tokens seen

    @classmethod
    def empty(cls, window: int, d: int, rate: int, sparse: bool, index_head_dim: int, dtype: torch.dtype,
              device: torch.device | str) -> LayerState:
        """The state before the first token; a CSA compressor's source rows hold two series each."""
        state = cls(RowStore.empty(window, d, dtype, device))
        if rate:
            state.compressor = CompressorState.empty(state.rows, rate, sparse)
        if sparse:
            state.indexer = CompressorState.empty(RowStore.empty(0, index_head_dim, dtype, device), rate, True)
        return state

    @property
    def window(self) -> int:
        return self.rows.fixed

    @property
    def compressors(self) -> list[CompressorState]:
        return [c for c in (self.compressor, self.indexer) if c is not None]

    @property
    def moves(self) -> int:
        """Times the layer's storage moved: a graph that holds its addresses is stale after one."""
        return self.rows.moves + (self.indexer.store.moves if self.indexer is not None else 0)

    def reserve(self, tokens: int) -> None:
        """Room for a decode step at token `tokens - 1`, which writes the entry of the window that
        token is in (closed or still open) in place."""
        for c in self.compressors:
            c.store.reserve((tokens - 1) // c.rate + 1)

    def stepped(self) -> None:
        """Counts a decode step's token, whose rows a `step` wrote (position as data)."""
        self.length += 1
        for c in self.compressors:
            c.store.count = self.length // c.rate

    def _moved(self, move) -> LayerState:
        rows, c, i = self.rows.moved(move), self.compressor, self.indexer
        return replace(self, rows=rows, compressor=None if c is None else c.moved(move, rows),
                       indexer=None if i is None else i.moved(move, i.store.moved(move)))

    def clone(self) -> LayerState:
        return self._moved(torch.clone)

    def to(self, device: torch.device | str) -> LayerState:
        return self._moved(lambda t: t.to(device))

    def assign(self, other: LayerState) -> None:
        """Takes `other`'s state into this one's storage (copied onto its device)."""
        self.rows.assign(other.rows)
        if self.indexer is not None:
            self.indexer.store.assign(other.indexer.store)
        for mine, theirs in zip(self.compressors, other.compressors, strict=True):
            mine.assign(theirs)
        self.length = other.length

    def mark(self) -> LayerMark:
        """The state now, to `rewind` to after a pass: its fixed-size parts alone."""
        return LayerMark(self.rows.data[:self.rows.fixed].clone(),
                         tuple(tuple(t.clone() for t in c.fixed_parts()) for c in self.compressors),
                         tuple(store.count for store in self._stores()), self.length)

    def rewind(self, mark: LayerMark) -> None:
        """Back to the state at `mark`, taken by this state before the passes since."""
        self.rows.data[:self.rows.fixed].copy_(mark.ring)
        for c, saved in zip(self.compressors, mark.fixed, strict=True):
            for mine, theirs in zip(c.fixed_parts(), saved, strict=True):
                mine.copy_(theirs)
        for store, count in zip(self._stores(), mark.counts, strict=True):
            store.count = count
        self.length = mark.length

    def _stores(self) -> list[RowStore]:
        return [self.rows] + ([self.indexer.store] if self.indexer is not None else [])

    def parts(self) -> list[torch.Tensor]:
        """Every tensor of the state in use: the rows (ring and entries), the compressors' fixed
        parts, the indexer's entries."""
        parts = [self.rows.used(), *(t for c in self.compressors for t in c.fixed_parts())]
        return parts + ([self.indexer.store.used()] if self.indexer is not None else [])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts())
