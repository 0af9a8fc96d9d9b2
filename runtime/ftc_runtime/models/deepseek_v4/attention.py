"""DeepSeek-V4's attention of one layer over a sequence's state (`deepseek_v4/state.py`), one prompt
chunk or decode step at a time. A prompt chunk attends over the window's raw rows and its own, and
the compressed entries each of its tokens may see; a decode step writes its raw row into the
window's ring first and attends over the rows it sees where they lie in the layer's store
(`sink_attention_at`: on a GPU one Triton kernel, the rows never gathered). The attention functions
are in `models/layers/` (`sink_attention`, `window_compressor`, `compressed_indexer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ftc_runtime.models.deepseek_v4.state import CompressorState, LayerState
from ftc_runtime.models.layers.compressed_indexer import compressed_index_scores, select_entries
from ftc_runtime.models.layers.dsa_indexer import top_k_indices
from ftc_runtime.models.layers.sink_attention import grouped_out, shared_kv_in, sink_attention, sink_attention_at
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


def layer_shapes(spec: ModelSpec, kinds: Sequence[str] | None = None) -> list[AttentionShape]:
    """Each layer's attention shape, by its kind in `spec.compressed.layer_types` (or in `kinds`)."""
    c, a = spec.compressed, spec.attention
    rates = {"sliding": 0, "csa": c.csa_rate, "hca": c.hca_rate}
    return [AttentionShape(a.num_heads, a.head_dim, c.sliding_window, c.o_groups, spec.norm.eps, rates[kind],
                           c.index_top_k if kind == "csa" else 0) for kind in (kinds or c.layer_types)]


def new_state(shape: AttentionShape, index_head_dim: int, dtype: torch.dtype, device: torch.device | str) -> LayerState:
    return LayerState.empty(shape.window, shape.head_dim, shape.rate, shape.sparse, index_head_dim, dtype, device)


def angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary / 2] at `positions`: one angle per interleaved pair, in fp32."""
    freqs = positions.double()[:, None] * inv_freq.double()[None, :]
    return freqs.cos().float(), freqs.sin().float()


def compress(c: CompressorState, start: int, kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor,
             norm_w: torch.Tensor, eps: float, inv_freq: torch.Tensor) -> None:
    """The compressor takes the source rows of the tokens from position `start` on; every window
    they close becomes an entry, rotated at its first position."""
    rate, d = c.rate, c.store.data.shape[1]
    kv, gate = torch.cat([c.open_kv[:start % rate], kv]), torch.cat([c.open_gate[:start % rate], gate])
    n = kv.shape[0] // rate
    if n:
        cos, sin = angles((torch.arange(n, device=kv.device) + c.store.count) * rate, inv_freq)
        closed_kv, closed_gate = kv[:n * rate], gate[:n * rate]
        if c.prior is None:
            new = compress_windows(closed_kv, closed_gate, position_bias, norm_w, eps, cos, sin)
        else:
            new = compress_overlapping_windows(closed_kv, closed_gate, position_bias, norm_w, eps, cos, sin, c.prior)
            c.prior[0].copy_(closed_kv[-rate:, :d])
            c.prior[1].copy_(closed_gate[-rate:, :d] + position_bias[:, :d])
        c.store.append(new.to(c.store.data.dtype))
    rest = kv.shape[0] - n * rate
    c.open_kv[:rest], c.open_gate[:rest] = kv[n * rate:], gate[n * rate:]


def window_entry(open_kv: torch.Tensor, open_gate: torch.Tensor, prior: tuple[torch.Tensor, torch.Tensor] | None,
                 position: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor,
                 norm_w: torch.Tensor, eps: float, inv_freq: torch.Tensor) -> torch.Tensor:
    """One token's source rows (kv, gate [1, width]) at `position` (int64 [1], on the device) into
    their row of the window's (open_kv, open_gate [rate, width], in place), and the entry [1, d]
    of the window the token is in, closed or not; where the token closes an overlapping window,
    that window's first series becomes `prior` (in place). Shapes do not depend on the position."""
    rate = open_kv.shape[0]
    open_kv.index_copy_(0, position % rate, kv.to(open_kv.dtype))
    open_gate.index_copy_(0, position % rate, gate.to(open_gate.dtype))
    cos, sin = angles(position // rate * rate, inv_freq)
    if prior is None:
        return compress_windows(open_kv, open_gate, position_bias, norm_w, eps, cos, sin)
    d = prior[0].shape[1]
    entry = compress_overlapping_windows(open_kv, open_gate, position_bias, norm_w, eps, cos, sin, prior)
    closes = (position + 1) % rate == 0
    prior[0].copy_(torch.where(closes, open_kv[:, :d], prior[0]))
    prior[1].copy_(torch.where(closes, open_gate[:, :d] + position_bias[:, :d], prior[1]))
    return entry


@dataclass(frozen=True)
class StepFunctions:
    """The pure functions of a decode step's attention, which a decode graph replaces by their
    torch.compile'd versions (`deepseek_v4/decode.py`)."""

    kv_in: Callable = shared_kv_in
    out: Callable = grouped_out
    entry: Callable = window_entry


EAGER_STEP = StepFunctions()


def compress_step(c: CompressorState, position: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor,
                  position_bias: torch.Tensor, norm_w: torch.Tensor, eps: float, inv_freq: torch.Tensor,
                  entry: Callable = window_entry) -> None:
    """`window_entry` on the compressor's state, its entry written at the window's index in the
    store (an open window's entry is seen by no query until its last token writes it again)."""
    new = entry(c.open_kv, c.open_gate, c.prior, position, kv, gate, position_bias, norm_w, eps, inv_freq)
    c.store.data.index_copy_(0, position // c.rate + c.store.fixed, new.to(c.store.data.dtype))


def attend(w: dict[str, torch.Tensor], h: torch.Tensor, positions: torch.Tensor, state: LayerState,
           shape: AttentionShape, inv_freq: torch.Tensor, compress_inv_freq: torch.Tensor) -> torch.Tensor:
    """The layer's attention output [T, hidden] for h [T, hidden] at `positions` (the state's next
    tokens), its weights in `w` by their names under `self_attn.`; the state moves on past them.
    One token goes through `attend_step`."""
    if h.shape[0] == 1:
        state.reserve(state.length + 1)
        out = attend_step(w, h, positions, state, shape, inv_freq, compress_inv_freq)
        state.stepped()
        return out
    s = shape
    cos, sin = angles(positions, compress_inv_freq if s.rate else inv_freq)
    q, kv, q_residual = shared_kv_in(h, w["q_a_proj.weight"], w["q_a_norm.weight"], w["q_b_proj.weight"],
                                     w["kv_proj.weight"], w["kv_norm.weight"], cos, sin, s.eps, s.heads)
    attn = _chunk_rows(w, h, q, kv, q_residual, positions, state, shape, compress_inv_freq)
    state.length += h.shape[0]
    return grouped_out(attn, cos, sin, w["o_a_proj.weight"], w["o_b_proj.weight"], s.o_groups)


def attend_step(w: dict[str, torch.Tensor], h: torch.Tensor, position: torch.Tensor, state: LayerState,
                shape: AttentionShape, inv_freq: torch.Tensor, compress_inv_freq: torch.Tensor,
                fns: StepFunctions = EAGER_STEP) -> torch.Tensor:
    """`attend` of one token h [1, hidden] at `position` (int64 [1] on the device: the state's
    next token, whose room `state.reserve` made), as a CUDA graph can hold it: its raw row written
    into the ring, every compressor stepped, then attention over the ring's rows of its window and
    the compressed entries it sees (for CSA the indexer's choice), where they lie in the store.
    Shapes follow the store's capacity, not the position; the caller counts the token
    (`state.stepped`)."""
    s = shape
    cos, sin = angles(position, compress_inv_freq if s.rate else inv_freq)
    q, kv, q_residual = fns.kv_in(h, w["q_a_proj.weight"], w["q_a_norm.weight"], w["q_b_proj.weight"],
                                  w["kv_proj.weight"], w["kv_norm.weight"], cos, sin, s.eps, s.heads)
    state.rows.data.index_copy_(0, position % state.window, kv.to(state.rows.data.dtype))
    columns = torch.arange(state.window, device=h.device)
    seen = columns <= position  # the ring's slots past the position are unwritten before it wraps
    if s.rate:
        picked, chosen = _step_entries(w, h, q_residual, position, state, shape, compress_inv_freq, fns.entry)
        columns, seen = torch.cat([columns, picked + state.window]), torch.cat([seen, chosen])
    attn = sink_attention_at(q, state.rows.data, columns, seen, w["sinks"], s.head_dim ** -0.5)
    return fns.out(attn, cos, sin, w["o_a_proj.weight"], w["o_b_proj.weight"], s.o_groups)


def _window_slots(state: LayerState, first: int, end: int) -> torch.Tensor:
    """The ring's slots of positions [first, end)."""
    return torch.arange(max(first, 0), end, device=state.rows.data.device) % state.window


def _chunk_rows(w: dict[str, torch.Tensor], h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                q_residual: torch.Tensor, positions: torch.Tensor, state: LayerState, shape: AttentionShape,
                inv_freq: torch.Tensor) -> torch.Tensor:
    """A prompt chunk: the window's rows before it and its own, masked to each query's window,
    beside the compressed entries each query sees; its last rows go into the ring."""
    start = state.length
    rows = torch.cat([state.rows.data[_window_slots(state, start - shape.window + 1, start)], kv])
    first = start - (rows.shape[0] - kv.shape[0])
    near = positions[:, None] - (torch.arange(rows.shape[0], device=h.device) + first)
    entries, visible = rows, (near >= 0) & (near < shape.window)
    if shape.rate:
        compressed = _compressed(w, h, q_residual, positions, state, shape, inv_freq)
        entries, visible = torch.cat([rows, state.compressor.entries]), torch.cat([visible, compressed], dim=1)
    attn = sink_attention(q, entries, visible, w["sinks"], shape.head_dim ** -0.5)
    kept = kv[-shape.window:]  # into the store as it is now: the entries may have grown it
    state.rows.data[_window_slots(state, start + kv.shape[0] - kept.shape[0], start + kv.shape[0])] = kept
    return attn


def _compressor_inputs(w: dict[str, torch.Tensor], h: torch.Tensor,
                       p: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The compressor under `p`'s source rows of h (kv, gate), its position terms and norm weight."""
    return (F.linear(h, w[p + "kv_proj.weight"]), F.linear(h, w[p + "gate_proj.weight"]), w[p + "position_bias"],
            w[p + "kv_norm.weight"])


def _compressed(w: dict[str, torch.Tensor], h: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
                state: LayerState, shape: AttentionShape, inv_freq: torch.Tensor) -> torch.Tensor:
    """The compressed entries' state advanced past a chunk's tokens, and which entries each token
    sees (bool [T, entries]): the causally closed ones, or for CSA the indexer's top_k of those."""
    p, i, start = "compressor.", "compressor.indexer.", state.length
    compress(state.compressor, start, *_compressor_inputs(w, h, p), shape.eps, inv_freq)
    n = state.compressor.store.count
    if not shape.sparse:
        return visible_entries(positions, n, shape.rate)
    compress(state.indexer, start, *_compressor_inputs(w, h, i), shape.eps, inv_freq)
    cos, sin = angles(positions, inv_freq)
    scores = compressed_index_scores(h, q_residual, w[i + "q_b_proj.weight"], w[i + "scorer.weights_proj.weight"],
                                     state.indexer.entries, cos, sin)
    return select_entries(scores, positions, shape.rate, shape.top_k)


def _step_entries(w: dict[str, torch.Tensor], h: torch.Tensor, q_residual: torch.Tensor, position: torch.Tensor,
                  state: LayerState, shape: AttentionShape, inv_freq: torch.Tensor,
                  entry: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressors stepped past one token, and the entries it sees as (columns of the entries,
    seen): every closed one over the store's capacity, or for CSA the indexer's top_k of those."""
    p, i = "compressor.", "compressor.indexer."
    compress_step(state.compressor, position, *_compressor_inputs(w, h, p), shape.eps, inv_freq, entry)
    if not shape.sparse:
        columns = torch.arange(state.compressor.store.capacity, device=h.device)
        return columns, visible_entries(position, columns.numel(), shape.rate)[0]
    compress_step(state.indexer, position, *_compressor_inputs(w, h, i), shape.eps, inv_freq, entry)
    cos, sin = angles(position, inv_freq)
    keys = state.indexer.store.data[:state.compressor.store.capacity]  # both stores grow alike; never beyond
    scores = compressed_index_scores(h, q_residual, w[i + "q_b_proj.weight"], w[i + "scorer.weights_proj.weight"],
                                     keys, cos, sin)
    columns, chosen = top_k_indices(scores, visible_entries(position, keys.shape[0], shape.rate), shape.top_k)
    return columns[0], chosen[0]
