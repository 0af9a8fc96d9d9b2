"""One sequence's state in one DeepSeek-V4 layer: small and of fixed size but for its compressed
entries. A layer's `RowStore` holds a ring of its last `sliding_window` raw key/value rows (the row
of position p in slot p % window) and after it the entries its compressor has closed so far, so
that a decode step reads every row it attends to from one tensor, in place. A compressor (the
layer's own, and for CSA its indexer's, whose entries have a store of their own) keeps the source
rows of the window still open and, for overlapping windows, the first series of the last closed
one. A prefix checkpoint copies the rows in use and the small parts."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

INITIAL_ENTRIES = 64  # entries a store holds before its first doubling


class RowStore:
    """Rows [fixed + capacity, d]: `fixed` rows first (a ring of raw rows; none for an indexer),
    then `count` entries, appended; the storage doubles when they outgrow it."""

    def __init__(self, data: torch.Tensor, fixed: int, count: int = 0):
        self.data, self.fixed, self.count = data, fixed, count

    @classmethod
    def empty(cls, fixed: int, d: int, dtype: torch.dtype, device: torch.device | str) -> RowStore:
        return cls(torch.zeros(fixed + INITIAL_ENTRIES, d, dtype=dtype, device=device), fixed)

    @property
    def entries(self) -> torch.Tensor:
        return self.data[self.fixed:self.fixed + self.count]

    def _room(self, rows: int) -> None:
        if rows > self.data.shape[0]:
            grown = self.data.new_zeros(max(rows, 2 * self.data.shape[0]), self.data.shape[1])
            grown[:self.fixed + self.count] = self.data[:self.fixed + self.count]
            self.data = grown

    def append(self, rows: torch.Tensor) -> None:
        end = self.fixed + self.count + rows.shape[0]
        self._room(end)
        self.data[end - rows.shape[0]:end] = rows
        self.count += rows.shape[0]

    def used(self) -> torch.Tensor:
        return self.data[:self.fixed + self.count]

    def moved(self, move) -> RowStore:
        """A copy of the rows in use, `move`d (cloned, or copied to another device)."""
        return RowStore(move(self.used()), self.fixed, self.count)

    def assign(self, other: RowStore) -> None:
        """Takes `other`'s rows into this storage (grown if they do not fit)."""
        self._room(other.fixed + other.count)
        self.count = other.count
        self.data[:self.fixed + self.count] = other.used().to(self.data.device)


@dataclass
class CompressorState:
    """A compressor's entries (in `store`, after its fixed rows), the source rows (kv, gate) of its
    open window, and for overlapping windows the last closed window's first series with its biased
    gate."""

    store: RowStore
    open_kv: torch.Tensor
    open_gate: torch.Tensor
    prior: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def empty(cls, store: RowStore, width: int) -> CompressorState:
        data = store.data
        return cls(store, data.new_zeros(0, width), data.new_zeros(0, width))

    @property
    def entries(self) -> torch.Tensor:
        return self.store.entries

    def small(self) -> list[torch.Tensor]:
        return [self.open_kv, self.open_gate, *(self.prior or ())]

    def moved(self, move, store: RowStore) -> CompressorState:
        """A copy on `store` (the moved store), its small parts `move`d."""
        return CompressorState(store, move(self.open_kv), move(self.open_gate),
                               None if self.prior is None else (move(self.prior[0]), move(self.prior[1])))


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
            state.compressor = CompressorState.empty(state.rows, 2 * d if sparse else d)
        if sparse:
            state.indexer = CompressorState.empty(RowStore.empty(0, index_head_dim, dtype, device),
                                                  2 * index_head_dim)
        return state

    @property
    def window(self) -> int:
        return self.rows.fixed

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
        for mine, theirs in ((self.compressor, other.compressor), (self.indexer, other.indexer)):
            if mine is not None:
                if mine.store is not self.rows:
                    mine.store.assign(theirs.store)
                moved = theirs.moved(lambda t: t.to(self.rows.data.device, copy=True), mine.store)
                mine.open_kv, mine.open_gate, mine.prior = moved.open_kv, moved.open_gate, moved.prior
        self.length = other.length

    @property
    def nbytes(self) -> int:
        parts = [self.rows.used(), *(t for c in (self.compressor, self.indexer) if c is not None for t in c.small())]
        if self.indexer is not None:
            parts.append(self.indexer.store.used())
        return sum(t.numel() * t.element_size() for t in parts)
