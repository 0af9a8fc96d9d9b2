"""Qwen3-MoE's checkpoint: its non-expert tensors by HF name, its spec from an HF `config.json`
(`model_type` qwen3_moe), and the spec rules of the family."""

from __future__ import annotations

from typing import Any

from ftc_runtime.models.base import check_gqa_softmax_topk
from ftc_runtime.models.hf_config import HfConfig
from ftc_runtime.models.layers.tensor_shapes import end_tensor_shapes, mlp_tensor_shapes
from ftc_runtime.spec import ModelSpec, Need, SpecError


def dense_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every non-expert tensor of the model, by checkpoint name, with its shape."""
    a, m, h = spec.attention, spec.moe, spec.hidden_size
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    shapes = end_tensor_shapes(spec)
    moe_layers = set(spec.moe_layers)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)}
        if a.bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (h,)}
        if a.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (a.head_dim,), p + "self_attn.k_norm.weight": (a.head_dim,)}
        if i in moe_layers:
            shapes[p + "mlp.gate.weight"] = (m.num_experts, h)
        else:
            shapes |= mlp_tensor_shapes(p + "mlp.", m.dense_intermediate_size, h)
    return shapes


def spec_from_hf(cfg: HfConfig) -> dict[str, Any]:
    """The spec fields of a Qwen3-MoE config; absent fields take transformers' defaults."""
    # transformers writes `num_local_experts` for what Qwen's own configs call `num_experts`.
    n_experts = cfg.config.get("num_experts", cfg.config.get("num_local_experts"))
    if n_experts is None:
        raise SpecError(f"{cfg.where}: missing required field 'num_experts'")
    dense = cfg.dense_layers(cfg.get("num_hidden_layers"), n_experts)
    data = cfg.decoder_fields()
    data["attention"] |= {"num_kv_heads": cfg.get("num_key_value_heads", 4), "bias": cfg.get("attention_bias", False),
                          "qk_norm": True}
    return data | {
        "family": "qwen3_moe",
        "norm": {"kind": "rms", "eps": float(cfg.get("rms_norm_eps", 1e-6))},
        "rope": cfg.rope(1.0),
        "moe": {"num_experts": n_experts, "top_k": cfg.get("num_experts_per_tok"),
                "expert_intermediate_size": cfg.get("moe_intermediate_size"),
                "norm_topk_prob": cfg.get("norm_topk_prob", False), "router": "softmax_topk",
                "dense_layers": dense, "dense_intermediate_size": cfg.get("intermediate_size", 0) if dense else 0},
    }


def check_spec(s: ModelSpec, need: Need) -> None:
    """GQA attention, a softmax top-k router, RMSNorm, no shared expert, no linear-attention layers."""
    check_gqa_softmax_topk(s, need)
    need(s.moe.num_shared_experts == 0, "moe.num_shared_experts", s.moe.num_shared_experts,
         f"0 for family {s.family} (it has no shared expert)")
    need(s.norm.kind == "rms", "norm.kind", s.norm.kind, f"'rms' for family {s.family}")
    need(not s.attention.output_gate, "attention.output_gate", s.attention.output_gate, f"false for family {s.family}")
    need(not s.linear_attention_layers, "layer_kinds", list(s.layer_kinds),
         f"only full_attention layers for family {s.family}")
