"""GLM-5.x's checkpoint (transformers `model_type` glm_moe_dsa): its non-expert tensors by HF name,
its spec from an HF `config.json`, and the spec rules of the family."""

from __future__ import annotations

import json
from typing import Any

from ftc_runtime.models.base import (
    CheckpointLayout,
    CheckpointReader,
    check_plain_swiglu,
    kv_cache_bytes,
    mtp_layer,
)
from ftc_runtime.models.hf_config import HfConfig
from ftc_runtime.models.layers.tensor_shapes import end_tensor_shapes, mlp_tensor_shapes
from ftc_runtime.spec import ModelSpec, Need, SpecError

# The projections an FP8 release stores in FP8 and the model reads through `linear`. kv_b_proj stays
# bf16: decode reads it as per-head blocks of the absorbed attention, not as one linear layer.
FP8_LINEARS = ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight", "o_proj.weight",
               "indexer.wq_b.weight", "indexer.wk.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight")


# The next-n (multi-token-prediction) layer's own tensors beside a decoder layer's: the norms of the
# next token's embedding and of the model's final hidden state, their projection, the head's norm.
# Its `embed_tokens` and `shared_head.head`, where a release keeps them, copy the model's own.
MTP_TENSORS = ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")


def dense_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every non-expert tensor of the model, by checkpoint name, with its shape; the next-n layers
    are decoder layers N, N + 1, ... (N = num_layers)."""
    m, h = spec.moe, spec.hidden_size
    shapes = end_tensor_shapes(spec)
    moe_layers = set(spec.expert_layers)
    for i in spec.mtp_decoder_layers:
        p = f"model.layers.{i}."
        shapes |= {p + n: (h,) for n in MTP_TENSORS} | {p + "eh_proj.weight": (h, 2 * h)}
    for i in range(spec.num_layers + spec.mtp_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        shapes |= _attention_shapes(spec, i, p + "self_attn.")
        if i in moe_layers:
            shapes |= {p + "mlp.gate.weight": (m.num_experts, h),
                       p + "mlp.gate.e_score_correction_bias": (m.num_experts,)}
            if m.num_shared_experts:
                shapes |= mlp_tensor_shapes(p + "mlp.shared_experts.", m.shared_expert_intermediate_size, h)
        else:
            shapes |= mlp_tensor_shapes(p + "mlp.", m.dense_intermediate_size, h)
    return shapes


def _attention_shapes(spec: ModelSpec, i: int, p: str) -> dict[str, tuple[int, ...]]:
    """Latent attention's projections and norms, and the indexer's where layer i runs it."""
    a, ml, ix, h = spec.attention, spec.mla, spec.indexer, spec.hidden_size
    shapes = {p + "q_a_proj.weight": (ml.q_lora_rank, h), p + "q_a_layernorm.weight": (ml.q_lora_rank,),
              p + "q_b_proj.weight": (a.num_heads * a.head_dim, ml.q_lora_rank),
              p + "kv_a_proj_with_mqa.weight": (ml.kv_lora_rank + ml.rope_dim, h),
              p + "kv_a_layernorm.weight": (ml.kv_lora_rank,),
              p + "kv_b_proj.weight": (a.num_heads * (ml.nope_dim + ml.v_dim), ml.kv_lora_rank),
              p + "o_proj.weight": (h, a.num_heads * ml.v_dim)}
    if ix is not None and indexes(spec, i):
        q = p + "indexer."
        shapes |= {q + "wq_b.weight": (ix.num_heads * ix.head_dim, ml.q_lora_rank), q + "wk.weight": (ix.head_dim, h),
                   q + "k_norm.weight": (ix.head_dim,), q + "k_norm.bias": (ix.head_dim,),
                   q + "weights_proj.weight": (ix.num_heads, h)}
    return shapes


def indexes(spec: ModelSpec, i: int) -> bool:
    """Layer i runs its own indexer (a next-n layer always does)."""
    return i >= spec.num_layers or spec.indexer.layer_types[i] == "full"


class GlmCheckpointLayout(CheckpointLayout):
    """The next-n layers after the checkpoint's own layers (its config's `num_hidden_layers`), which
    a spec cut to its first layers (`--override num_layers=N`) still reads there."""

    def __init__(self, ckpt: CheckpointReader, spec: ModelSpec):
        super().__init__(ckpt, spec)
        self.layers = spec.num_layers
        config = ckpt.directory / "config.json"
        if spec.mtp_layers and config.is_file():
            self.layers = HfConfig(json.loads(config.read_text()), config).get("num_hidden_layers", spec.num_layers)

    def name(self, canonical: str) -> str:
        layer = mtp_layer(canonical, self.spec.num_layers)
        return canonical if layer is None else f"model.layers.{self.layers + layer[0]}.{layer[1]}"


def indexer_layer_types(cfg: HfConfig, n_layers: int) -> list[str]:
    """Which layers run the indexer ("full") and which reuse the previous full layer's choice
    ("shared"): `indexer_types`, else the `index_topk_pattern` string ("F"/"S" per layer), else
    every `index_topk_freq`-th layer from `index_skip_topk_offset` on (transformers' rule)."""
    given = cfg.get("indexer_types", None)
    if given is not None:
        return list(given)
    pattern = cfg.get("index_topk_pattern", None)
    if pattern is not None:
        kinds = {"F": "full", "S": "shared"}
        if isinstance(pattern, str) and set(pattern) <= set(kinds):
            return [kinds[c] for c in pattern]
        raise SpecError(f"{cfg.where}: field 'index_topk_pattern' = {pattern!r}: expected a string of F and S")
    freq, offset = max(cfg.get("index_topk_freq", 1), 1), cfg.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]


def kv_row_elements(spec: ModelSpec) -> int:
    """Elements one token keeps in one layer's cache: the latent row, its rotary key and the
    indexer's key."""
    ml, ix = spec.mla, spec.indexer
    return ml.kv_lora_rank + ml.rope_dim + (ix.head_dim if ix is not None else 1)


def state_bytes(spec: ModelSpec, tokens: int, element_size: int) -> int:
    return kv_cache_bytes(spec, tokens, kv_row_elements(spec), element_size)


def spec_from_hf(cfg: HfConfig) -> dict[str, Any]:
    """The spec fields of a GLM-MoE-DSA config; absent fields take transformers' defaults."""
    n_layers, n_experts = cfg.get("num_hidden_layers"), cfg.get("n_routed_experts", 256)
    nope, rope, v = cfg.get("qk_nope_head_dim", 192), cfg.get("qk_rope_head_dim", 64), cfg.get("v_head_dim", 256)
    mlp_types = cfg.get("mlp_layer_types", None)
    n_dense = cfg.get("first_k_dense_replace", 3)
    dense = ([i for i, kind in enumerate(mlp_types) if kind == "dense"] if mlp_types is not None
             else list(range(min(n_dense, n_layers) if isinstance(n_layers, int) else 0)))
    n_shared = cfg.get("n_shared_experts", 1)
    data = cfg.decoder_fields()
    data["attention"] |= {"kind": "mla", "num_kv_heads": data["attention"]["num_heads"], "head_dim": nope + rope,
                          "qk_norm": False, "bias": cfg.get("attention_bias", False)}
    return data | {
        "family": "glm_moe_dsa",
        "mtp_layers": cfg.get("num_nextn_predict_layers", 0),
        "norm": {"kind": "rms", "eps": float(cfg.get("rms_norm_eps", 1e-5))},
        "rope": {"theta": cfg.rope(1.0)["theta"], "partial_rotary_factor": rope / (nope + rope)},
        "mla": {"q_lora_rank": cfg.get("q_lora_rank", 2048), "kv_lora_rank": cfg.get("kv_lora_rank", 512),
                "nope_dim": nope, "rope_dim": rope, "v_dim": v},
        "indexer": {"num_heads": cfg.get("index_n_heads", 32), "head_dim": cfg.get("index_head_dim", 128),
                    "top_k": cfg.get("index_topk", 2048),
                    "layer_types": indexer_layer_types(cfg, n_layers) if isinstance(n_layers, int) else []},
        "moe": {"num_experts": n_experts, "top_k": cfg.get("num_experts_per_tok", 8),
                "expert_intermediate_size": cfg.get("moe_intermediate_size", 2048),
                "norm_topk_prob": cfg.get("norm_topk_prob", True), "router": "sigmoid_topk",
                "num_shared_experts": n_shared,
                "shared_expert_intermediate_size": cfg.get("moe_intermediate_size", 2048) * n_shared,
                "dense_layers": dense, "dense_intermediate_size": cfg.get("intermediate_size", 12288) if dense else 0,
                "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 2.5)),
                "n_group": cfg.get("n_group", 1), "topk_group": cfg.get("topk_group", 1)},
    }


def check_spec(s: ModelSpec, need: Need) -> None:
    """Latent attention (with or without the indexer), the sigmoid router, RMSNorm, at most one
    shared expert, no linear-attention layers."""
    need(s.attention.kind == "mla", "attention.kind", s.attention.kind, f"'mla' for family {s.family}")
    need(s.moe.router == "sigmoid_topk", "moe.router", s.moe.router, f"'sigmoid_topk' for family {s.family}")
    need(s.norm.kind == "rms", "norm.kind", s.norm.kind, f"'rms' for family {s.family}")
    need(s.moe.num_shared_experts <= 1, "moe.num_shared_experts", s.moe.num_shared_experts,
         f"0 or 1 for family {s.family} (its shared experts are one MLP)")
    need(not s.attention.bias, "attention.bias", s.attention.bias, f"false for family {s.family}")
    check_plain_swiglu(s, need)
    need(not s.linear_attention_layers, "layer_kinds", list(s.layer_kinds),
         f"only full_attention layers for family {s.family}")
    ml = s.mla
    need(ml is None or s.rope.partial_rotary_factor * s.attention.head_dim == ml.rope_dim, "rope.partial_rotary_factor",
         s.rope.partial_rotary_factor, f"mla.rope_dim / attention.head_dim for family {s.family}")
