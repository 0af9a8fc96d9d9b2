"""DeepSeek-V4 (transformers' deepseek_v4) decoder in torch: a residual of `hyper_connections.streams`
streams mixed around each block, the compressed attention over each layer's state
(`deepseek_v4/attention.py`), the sqrt-softplus router (by token id in the hash layers) with the
routed experts on an `ExpertBackend` beside one shared expert, both SwiGLU clamped at
`moe.swiglu_limit`. The CPU path of the family: the engine's caches, decode graphs and registry
entry come next.

Tensor names follow transformers' model (`model.layers.L.self_attn.q_a_proj.weight`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ftc_runtime.experts.base import ExpertBackend
from ftc_runtime.models.deepseek_v4.attention import AttentionShape, CompressorState, LayerState, attend
from ftc_runtime.models.layers.hyper_connections import hc_collapse, hc_expand, hc_weights, hyper_head
from ftc_runtime.models.layers.mlp import dense_mlp
from ftc_runtime.models.layers.norm import rms_norm_fp32_weight
from ftc_runtime.models.layers.rope import yarn_inv_freq
from ftc_runtime.models.layers.softplus_router import route_biased, route_hashed
from ftc_runtime.spec import ModelSpec


@dataclass
class SequenceState:
    """One sequence's state: each layer's (`attention.LayerState`) and the tokens seen."""

    layers: list[LayerState]
    length: int = 0


class DeepseekV4Model:
    """One sequence at a time in fp32 on the CPU (its weights as given, in fp32)."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], experts: ExpertBackend):
        self.spec, self.experts = spec, experts
        self.w = {k: v if v.dtype == torch.int64 else v.float() for k, v in weights.items()}
        c, a = spec.compressed, spec.attention
        rates = {"sliding": 0, "csa": c.csa_rate, "hca": c.hca_rate}
        self.shapes = [AttentionShape(a.num_heads, a.head_dim, c.sliding_window, c.o_groups, spec.norm.eps,
                                      rates[kind], c.index_top_k if kind == "csa" else 0) for kind in c.layer_types]
        self.inv_freq = 1.0 / spec.rope.theta ** (torch.arange(0, c.rope_dim, 2, dtype=torch.float64) / c.rope_dim)
        y = c.compress_yarn
        self.compress_inv_freq = (
            1.0 / c.compress_theta ** (torch.arange(0, c.rope_dim, 2, dtype=torch.float64) / c.rope_dim) if y is None
            else yarn_inv_freq(c.compress_theta, c.rope_dim, y.factor, y.original_max_position, y.beta_fast,
                               y.beta_slow, attention_factor=1.0)[0])
        self.hash_layers = set(spec.moe.hash_layers)

    def new_state(self) -> SequenceState:
        c, d = self.spec.compressed, self.spec.attention.head_dim
        layers = []
        for kind in c.layer_types:
            state = LayerState(torch.zeros(0, d))
            if kind != "sliding":
                state.compressor = CompressorState.empty(d, 2 * d if kind == "csa" else d, torch.float32,
                                                         torch.device("cpu"))
            if kind == "csa":
                state.indexer = CompressorState.empty(c.index_head_dim, 2 * c.index_head_dim, torch.float32,
                                                      torch.device("cpu"))
            layers.append(state)
        return SequenceState(layers)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, state: SequenceState, all_logits: bool = False) -> torch.Tensor:
        """Runs `ids` (1-D) after the state's tokens; returns logits [T or 1, vocab] in fp32."""
        start, n = state.length, ids.numel()
        self.experts.begin_pass(n)
        positions = torch.arange(start, start + n)
        x = self.w["model.embed_tokens.weight"][ids]
        streams = x[:, None, :].expand(-1, self.spec.hyper_connections.streams, -1).contiguous()
        for i in range(self.spec.num_layers):
            p = f"model.layers.{i}."
            streams = self._block(streams, p + "attn_hc.", lambda h, i=i, p=p: attend(
                self._attention_weights(p), rms_norm_fp32_weight(h, self.w[p + "input_layernorm.weight"],
                                                                self.spec.norm.eps),
                positions, state.layers[i], self.shapes[i], self.inv_freq, self.compress_inv_freq))
            streams = self._block(streams, p + "ffn_hc.", lambda h, i=i, p=p: self._moe(
                i, rms_norm_fp32_weight(h, self.w[p + "post_attention_layernorm.weight"], self.spec.norm.eps),
                ids, start))
        state.length = start + n
        return self._head(streams if all_logits else streams[-1:])

    def _block(self, streams: torch.Tensor, hc: str, block) -> torch.Tensor:
        """The streams after one block (attention or MoE) between its hyper-connection's collapse
        and expansion."""
        h = self.spec.hyper_connections
        pre, post, comb = hc_weights(streams, self.w[hc + "fn"], self.w[hc + "base"], self.w[hc + "scale"],
                                     self.spec.norm.eps, h.eps, h.sinkhorn_iters)
        return hc_expand(streams, block(hc_collapse(streams, pre)), post, comb)

    def _attention_weights(self, p: str) -> dict[str, torch.Tensor]:
        q = p + "self_attn."
        return {k[len(q):]: v for k, v in self.w.items() if k.startswith(q)}

    def _moe(self, i: int, h: torch.Tensor, ids: torch.Tensor, first_position: int) -> torch.Tensor:
        """The routed experts (chosen by token id in a hash layer) and the shared expert."""
        m, p = self.spec.moe, f"model.layers.{i}.mlp."
        if i in self.hash_layers:
            chosen, weights = route_hashed(h, ids, self.w[p + "gate.weight"], self.w[p + "gate.tid2eid"],
                                           m.routed_scaling_factor)
        else:
            chosen, weights = route_biased(h, self.w[p + "gate.weight"], self.w[p + "gate.e_score_correction_bias"],
                                           m.top_k, m.routed_scaling_factor)
        routed = self.experts.forward(i, h.float(), chosen, weights, first_position)
        shared = dense_mlp(h, *(self.w[f"{p}shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down")),
                           limit=m.swiglu_limit)
        return routed.to(h.dtype) + shared

    def _head(self, streams: torch.Tensor) -> torch.Tensor:
        h = self.spec.hyper_connections
        x = hyper_head(streams, self.w["model.hc_head.hc_fn"], self.w["model.hc_head.hc_base"],
                       self.w["model.hc_head.hc_scale"], self.spec.norm.eps, h.eps)
        x = rms_norm_fp32_weight(x, self.w["model.norm.weight"], self.spec.norm.eps)
        return F.linear(x, self.w["lm_head.weight"]).float()
