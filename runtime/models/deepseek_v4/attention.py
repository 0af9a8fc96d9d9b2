"""DeepSeek-V4's attention of one layer over a sequence's state, one prompt chunk or decode step at a
time (the CPU path of the family's model). A layer's state is small and of fixed
size but for its compressed entries: the last `sliding_window - 1` raw key/value rows, and per
compressor (the layer's own, and for CSA its indexer's) the entries of the windows closed so far,
the source rows of the window still open and, for overlapping windows, the first series of the
last closed one, so that a prefix checkpoint can be that fixed part and the entries' count. The attention
functions are in `models/layers/` (`sink_attention`, `window_compressor`, `compressed_indexer`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from ftc_runtime.models.layers.compressed_indexer import compressed_index_scores, select_entries
from ftc_runtime.models.layers.sink_attention import grouped_out, shared_kv_in, sink_attention
from ftc_runtime.models.layers.window_compressor import (
    compress_overlapping_windows,
    compress_windows,
    visible_entries,
)
from ftc_runtime.spec import ModelSpec


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    head_dim: int
    window: int  # raw rows a query sees, its own included
    o_groups: int
    eps: float
    rate: int  # source tokens per compressed entry (0: a sliding-window layer)
    top_k: int  # CSA: the indexer's entries per query (0: every visible entry, HCA)

    @property
    def sparse(self) -> bool:
        """A CSA layer: overlapping windows, and the indexer's choice of entries."""
        return self.top_k > 0


def layer_shapes(spec: ModelSpec) -> list[AttentionShape]:
    """Each layer's attention shape, by its kind in `spec.compressed.layer_types`."""
    c, a = spec.compressed, spec.attention
    rates = {"sliding": 0, "csa": c.csa_rate, "hca": c.hca_rate}
    return [AttentionShape(a.num_heads, a.head_dim, c.sliding_window, c.o_groups, spec.norm.eps, rates[kind],
                           c.index_top_k if kind == "csa" else 0) for kind in c.layer_types]


def angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary / 2] at `positions`: one angle per interleaved pair, in fp32."""
    freqs = positions.double()[:, None] * inv_freq.double()[None, :]
    return freqs.cos().float(), freqs.sin().float()


@dataclass
class CompressorState:
    """A compressor's entries so far [n, d], the source rows (kv, gate) of its open window, and for
    overlapping windows the last closed window's first series with its biased gate."""

    entries: torch.Tensor
    open_kv: torch.Tensor
    open_gate: torch.Tensor
    prior: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def empty(cls, d: int, width: int, dtype: torch.dtype, device: torch.device | str) -> CompressorState:
        return cls(torch.zeros(0, d, dtype=dtype, device=device), torch.zeros(0, width, dtype=dtype, device=device),
                   torch.zeros(0, width, dtype=dtype, device=device))

    def tensors(self) -> list[torch.Tensor]:
        return [self.entries, self.open_kv, self.open_gate, *(self.prior or ())]

    def moved(self, move) -> CompressorState:
        """A copy whose tensors are `move(t)` (a clone, or a copy on another device)."""
        return CompressorState(move(self.entries), move(self.open_kv), move(self.open_gate),
                               None if self.prior is None else (move(self.prior[0]), move(self.prior[1])))

    def add(self, kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, norm_w: torch.Tensor,
            eps: float, inv_freq: torch.Tensor) -> None:
        """Takes the next tokens' source rows; every window they close becomes an entry, rotated at
        its first position."""
        rate, d = position_bias.shape[0], self.entries.shape[1]
        kv, gate = torch.cat([self.open_kv, kv]), torch.cat([self.open_gate, gate])
        n = kv.shape[0] // rate
        if n:
            cos, sin = angles((torch.arange(n, device=kv.device) + self.entries.shape[0]) * rate, inv_freq)
            closed_kv, closed_gate = kv[:n * rate], gate[:n * rate]
            if kv.shape[1] == d:
                new = compress_windows(closed_kv, closed_gate, position_bias, norm_w, eps, cos, sin)
            else:
                new = compress_overlapping_windows(closed_kv, closed_gate, position_bias, norm_w, eps, cos, sin,
                                                   self.prior)
                self.prior = (closed_kv[-rate:, :d].clone(), closed_gate[-rate:, :d] + position_bias[:, :d])
            self.entries = torch.cat([self.entries, new.to(self.entries.dtype)])
        # copies: views would keep the whole chunk's source rows alive
        self.open_kv, self.open_gate = kv[n * rate:].clone(), gate[n * rate:].clone()


@dataclass
class LayerState:
    """One layer's state for one sequence (`compressor` and `indexer` where the layer has them): a
    `cache.base.RecurrentState`, which a prefix checkpoint copies whole. Its tensors grow by
    concatenation, so no CUDA graph may hold them."""

    window: torch.Tensor  # the last window - 1 raw rows [≤ window - 1, head_dim]
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None
    length: int = 0  # tokens seen

    @classmethod
    def empty(cls, shape: AttentionShape, index_head_dim: int, dtype: torch.dtype,
              device: torch.device | str) -> LayerState:
        """The state before the first token; a CSA compressor's source rows hold two series each."""
        d = shape.head_dim
        state = cls(torch.zeros(0, d, dtype=dtype, device=device))
        if shape.rate:
            state.compressor = CompressorState.empty(d, 2 * d if shape.sparse else d, dtype, device)
        if shape.sparse:
            state.indexer = CompressorState.empty(index_head_dim, 2 * index_head_dim, dtype, device)
        return state

    def _moved(self, move) -> LayerState:
        return replace(self, window=move(self.window),
                       compressor=None if self.compressor is None else self.compressor.moved(move),
                       indexer=None if self.indexer is None else self.indexer.moved(move))

    def clone(self) -> LayerState:
        return self._moved(torch.clone)

    def to(self, device: torch.device | str) -> LayerState:
        return self._moved(lambda t: t.to(device))

    def assign(self, other: LayerState) -> None:
        """Takes `other`'s state (copied onto this state's device)."""
        moved = other._moved(lambda t: t.to(self.window.device, copy=True))
        for f in fields(self):
            setattr(self, f.name, getattr(moved, f.name))

    @property
    def nbytes(self) -> int:
        parts = [self.window, *(t for c in (self.compressor, self.indexer) if c is not None for t in c.tensors())]
        return sum(t.numel() * t.element_size() for t in parts)


def attend(w: dict[str, torch.Tensor], h: torch.Tensor, positions: torch.Tensor, state: LayerState,
           shape: AttentionShape, inv_freq: torch.Tensor, compress_inv_freq: torch.Tensor) -> torch.Tensor:
    """The layer's attention output [T, hidden] for h [T, hidden] at `positions` (the state's next
    tokens), its weights in `w` by their names under `self_attn.`; the state moves on past them.
    Compressed layers rotate their queries and raw rows at the compressed base, sliding ones at
    the main one."""
    s = shape
    rope = compress_inv_freq if s.rate else inv_freq
    cos, sin = angles(positions, rope)
    q, kv, q_residual = shared_kv_in(h, w["q_a_proj.weight"], w["q_a_norm.weight"], w["q_b_proj.weight"],
                                     w["kv_proj.weight"], w["kv_norm.weight"], cos, sin, s.eps, s.heads)
    rows = torch.cat([state.window, kv])
    near = positions[:, None] - (torch.arange(rows.shape[0], device=h.device) + state.length - state.window.shape[0])
    entries, visible = rows, (near >= 0) & (near < s.window)
    if s.rate:
        compressed = _compressed(w, h, q_residual, positions, state, shape, compress_inv_freq)
        entries, visible = torch.cat([rows, state.compressor.entries]), torch.cat([visible, compressed], dim=1)
    attn = sink_attention(q, entries, visible, w["sinks"], s.head_dim ** -0.5)
    state.window, state.length = rows[max(rows.shape[0] - (s.window - 1), 0):], state.length + h.shape[0]
    return grouped_out(attn, cos, sin, w["o_a_proj.weight"], w["o_b_proj.weight"], s.o_groups)


def _compressed(w: dict[str, torch.Tensor], h: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
                state: LayerState, shape: AttentionShape, inv_freq: torch.Tensor) -> torch.Tensor:
    """The compressed entries' state advanced past h's tokens, and which entries each token sees
    (bool [T, entries]): the causally closed ones, or for CSA the indexer's top_k of those."""
    p = "compressor."
    state.compressor.add(F.linear(h, w[p + "kv_proj.weight"]), F.linear(h, w[p + "gate_proj.weight"]),
                         w[p + "position_bias"], w[p + "kv_norm.weight"], shape.eps, inv_freq)
    n = state.compressor.entries.shape[0]
    if not shape.top_k:
        return visible_entries(positions, n, shape.rate)
    i = p + "indexer."
    state.indexer.add(F.linear(h, w[i + "kv_proj.weight"]), F.linear(h, w[i + "gate_proj.weight"]),
                      w[i + "position_bias"], w[i + "kv_norm.weight"], shape.eps, inv_freq)
    cos, sin = angles(positions, inv_freq)
    scores = compressed_index_scores(h, q_residual, w[i + "q_b_proj.weight"], w[i + "scorer.weights_proj.weight"],
                                     state.indexer.entries, cos, sin)
    return select_entries(scores, positions, shape.rate, shape.top_k)
