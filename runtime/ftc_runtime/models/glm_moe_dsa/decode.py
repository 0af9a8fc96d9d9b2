"""GLM-5.x's layer in a decode graph (`ftc_runtime.decode.graphs`): the token's latent row (and its
indexer key) written at the step's position, a device tensor; the indexer's top_k over every
stored key up to that position (kept for the layers that share it), and latent attention over
those top_k rows gathered from the storage, so that a step reads top_k rows per layer however
long the context; then the sigmoid router (the experts' input staged) beside the
shared expert, or a dense MLP. Shapes depend on the storage only, so a graph stays valid until the
storage moves, as the other families' do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ftc_runtime.cache.kv import INITIAL_CAPACITY
from ftc_runtime.cache.sequence import SequenceCache
from ftc_runtime.decode.graphs import EAGER_FUNCTIONS, DecodeGraphs
from ftc_runtime.models.layers.dsa_indexer import index_scores, indexer_keys, select_key_indices
from ftc_runtime.models.layers.fp8_linear import linear
from ftc_runtime.models.layers.mla import attend_cached, mla_in
from ftc_runtime.models.layers.mlp import dense_mlp
from ftc_runtime.models.layers.norm import rms_norm
from ftc_runtime.models.layers.sigmoid_router import route_sigmoid


class LatentDecodeGraphs(DecodeGraphs):
    """GLM-5.x's layers. The indexer's choice of a `full` layer (the chosen keys' columns in the
    storage) is kept per (layer, sequence) for the `shared` layers after it, in tensors that live
    as long as the graphs that read them."""

    # Their shapes follow the storage (attention and selection over its capacity): compiled, each
    # doubling would compile them again.
    eager_functions = (*EAGER_FUNCTIONS, "index_scores", "select_key_indices", "attend_cached")

    def __init__(self, model, compile_fns: bool, fused_body: bool = True):
        # The keys each (layer, row) attended to in the step being run or captured: a mask over the
        # storage, or the indexer's chosen columns and which of them it sees (`attend_cached`).
        self._seen: dict[tuple[int, int], torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = {}
        super().__init__(model, compile_fns, fused_body)

    def functions(self) -> dict[str, Callable]:
        return {f.__name__: f for f in (rms_norm, mla_in, indexer_keys, index_scores, select_key_indices,
                                        attend_cached, route_sigmoid, dense_mlp)}

    def _warm_up(self) -> None:
        m, f, io, eps = self.model, self.fns, self.io, self.model.spec.norm.eps
        h = f["rms_norm"](io.x, m.w["model.layers.0.input_layernorm.weight"], eps)
        _, _, _, _, q_resid = f["mla_in"](h, *self._mla_weights(0), io.cos, io.sin, m.mla)
        full = [i for i in range(m.spec.num_layers) if self._index_source(i) == i][:1]
        for i in full:
            keys = f["indexer_keys"](h, *self._indexer_key_weights(i), io.cos, io.sin, m.indexer)
            cached = keys.new_zeros(INITIAL_CAPACITY, keys.shape[-1])
            f["index_scores"](h, q_resid, *self._indexer_query_weights(i), cached, io.cos, io.sin, m.indexer)
        for i in [i for i in range(m.spec.num_layers) if m.is_moe(i)][:1]:
            f["route_sigmoid"](h, *self._router_args(i))
        for i in [i for i in range(m.spec.num_layers) if not m.is_moe(i)][:1]:
            f["dense_mlp"](h, *m.mlp_weights(f"model.layers.{i}.mlp."))

    def _layer(self, i: int, caches: list[SequenceCache]) -> None:
        m, f, io, eps = self.model, self.f, self.io, self.model.spec.norm.eps
        p = f"model.layers.{i}."
        self._join_previous(i)
        h = f["rms_norm"](io.x, m.w[p + "input_layernorm.weight"], eps)
        attn = self.per_sequence(lambda r, cache: self._attend(i, r, h[r:r + 1], cache), caches)
        io.x.add_(linear(attn, m.w[p + "self_attn.o_proj.weight"]))
        h = f["rms_norm"](io.x, m.w[p + "post_attention_layernorm.weight"], eps)
        if m.is_moe(i):
            ids, weights = f["route_sigmoid"](h, *self._router_args(i))
            m.experts.stage(h.float(), ids, weights)
            if io.shared is not None:
                io.shared.copy_(f["dense_mlp"](h, *m.mlp_weights(p + "mlp.shared_experts.")))
        else:
            io.mlp.copy_(f["dense_mlp"](h, *m.mlp_weights(p + "mlp.")))

    def _attend(self, i: int, r: int, h: torch.Tensor, cache: SequenceCache) -> torch.Tensor:
        """Row r's latent attention in layer i (h [1, hidden] its normalized input): the latent row,
        the rotary key and the indexer's key written at its position, the keys it sees chosen (or
        taken from the layer it shares them with) and gathered, top_k rows of the storage rather
        than all of it: [1, heads · v]."""
        m, f, io = self.model, self.f, self.io
        cos, sin, position = io.cos[r:r + 1], io.sin[r:r + 1], io.position[r:r + 1]
        q_nope, q_rope, latent, k_rope, q_resid = f["mla_in"](h, *self._mla_weights(i), cos, sin, m.mla)
        rows, index_keys = cache.kv.storage(i)
        rows.index_copy_(0, position, torch.cat([latent, k_rope], dim=-1)[:, None])
        source = self._index_source(i)
        if source == i:
            key = f["indexer_keys"](h, *self._indexer_key_weights(i), cos, sin, m.indexer)
            index_keys.index_copy_(0, position, key[:, None])
            scores = f["index_scores"](h, q_resid, *self._indexer_query_weights(i), index_keys[:, 0], cos, sin,
                                       m.indexer)
            self._seen[i, r] = f["select_key_indices"](scores, position, m.indexer.top_k)
        elif source is None:  # every key up to the position, read in place
            self._seen[i, r] = torch.arange(rows.shape[0], device=h.device)[None, :] <= position[:, None]
        else:  # a shared layer: its indexer keys are zeros in the cache, as the prompt path leaves them
            index_keys.index_fill_(0, position, 0.0)
            self._seen[i, r] = self._seen[source, r]
        return f["attend_cached"](q_nope, q_rope, rows[:, 0], m.w[f"model.layers.{i}.self_attn.kv_b_proj.weight"],
                                  self._seen[i, r], m.mla)

    def _index_source(self, i: int) -> int | None:
        """The layer whose indexer chooses layer i's keys (i itself for a `full` layer), None
        without an indexer (every causal key)."""
        m = self.model
        if m.indexer is None:
            return None
        types = m.spec.indexer.layer_types
        return max(j for j in range(i + 1) if types[j] == "full")

    def _mla_weights(self, i: int) -> tuple[torch.Tensor, ...]:
        p, w = f"model.layers.{i}.self_attn.", self.model.w
        return tuple(w[p + n] for n in ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight",
                                        "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"))

    def _indexer_key_weights(self, i: int) -> tuple[torch.Tensor, ...]:
        p, w = f"model.layers.{i}.self_attn.indexer.", self.model.w
        return w[p + "wk.weight"], w[p + "k_norm.weight"], w[p + "k_norm.bias"]

    def _indexer_query_weights(self, i: int) -> tuple[torch.Tensor, ...]:
        p, w = f"model.layers.{i}.self_attn.indexer.", self.model.w
        return w[p + "wq_b.weight"], w[p + "weights_proj.weight"]

    def _router_args(self, i: int) -> tuple:
        m, w, p = self.model.spec.moe, self.model.w, f"model.layers.{i}.mlp.gate."
        return (w[p + "weight"], w[p + "e_score_correction_bias"], m.top_k, m.n_group, m.topk_group,
                m.norm_topk_prob, m.routed_scaling_factor)
