"""DeepSeek-V4's attention of one layer over a sequence's state, one prompt chunk or decode step at a
time (the CPU path of the family's model). A layer's state is small and of fixed
size but for its compressed entries: the last `sliding_window - 1` raw key/value rows, and per
compressor (the layer's own, and for CSA its indexer's) the entries of the windows closed so far,
the source rows of the window still open and, for overlapping windows, the first series of the
last closed one, so that a prefix checkpoint can be that fixed part and the entries' count. The attention
functions are in `models/layers/` (`sink_attention`, `window_compressor`, `compressed_indexer`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ftc_runtime.models.layers.compressed_indexer import compressed_index_scores, select_entries
from ftc_runtime.models.layers.sink_attention import grouped_out, shared_kv_in, sink_attention
from ftc_runtime.models.layers.window_compressor import (
    compress_overlapping_windows,
    compress_windows,
    visible_entries,
)


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    head_dim: int
    window: int  # raw rows a query sees, its own included
    o_groups: int
    eps: float
    rate: int  # source tokens per compressed entry (0: a sliding-window layer)
    top_k: int  # CSA: the indexer's entries per query (0: every visible entry, HCA)


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
    def empty(cls, d: int, width: int, dtype: torch.dtype, device: torch.device) -> CompressorState:
        return cls(torch.zeros(0, d, dtype=dtype, device=device), torch.zeros(0, width, dtype=dtype, device=device),
                   torch.zeros(0, width, dtype=dtype, device=device))

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
                self.prior = (closed_kv[-rate:, :d], closed_gate[-rate:, :d] + position_bias[:, :d])
            self.entries = torch.cat([self.entries, new.to(self.entries.dtype)])
        self.open_kv, self.open_gate = kv[n * rate:], gate[n * rate:]


@dataclass
class LayerState:
    """One layer's state for one sequence (`compressor` and `indexer` where the layer has them)."""

    window: torch.Tensor  # the last window - 1 raw rows [≤ window - 1, head_dim]
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None
    length: int = 0  # tokens seen


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
