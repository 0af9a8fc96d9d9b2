"""The hybrid families' checkpoints (qwen3_next, qwen3_5_moe): their non-expert tensors by canonical
HF name, their spec from an HF `config.json`, the family rules, and where their checkpoints keep
tensors otherwise:
- Qwen3.5's image-text checkpoints keep the language model under `model.language_model.`;
- Qwen3-Next's linear layers project q, k, v, z as one grouped `in_proj_qkvz` and b, a as one
  `in_proj_ba` (per key head: its q, k, then its value heads' v, then their z), where Qwen3.5 has
  the split `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` that the runtime runs.
"""

from __future__ import annotations

from typing import Any

import torch

from ftc_runtime.models.base import (
    CheckpointError,
    CheckpointLayout,
    CheckpointReader,
    check_gqa_softmax_topk,
    gqa_state_bytes,
    mtp_layer,
)
from ftc_runtime.models.hf_config import HfConfig
from ftc_runtime.models.layers.tensor_shapes import end_tensor_shapes, mlp_tensor_shapes
from ftc_runtime.spec import ModelSpec, Need, SpecError

# The head's (1 + w) norms: of the next token's embedding, of the model's hidden state, of its output.
MTP_NORMS = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
_SPLIT = {"in_proj_qkv.weight": "qkvz", "in_proj_z.weight": "qkvz", "in_proj_b.weight": "ba",
          "in_proj_a.weight": "ba"}


def dense_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every non-expert tensor of the model, by canonical checkpoint name, with its shape."""
    a, m, h = spec.attention, spec.moe, spec.hidden_size
    shapes = end_tensor_shapes(spec) | mtp_tensor_shapes(spec)
    moe_layers = set(spec.expert_layers)
    for i in range(spec.num_layers + spec.mtp_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        if spec.layer_kind(i) == "linear_attention":
            la = spec.linear_attention
            kd, vd = la.num_k_heads * la.k_head_dim, la.num_v_heads * la.v_head_dim
            q = p + "linear_attn."
            shapes |= {q + "in_proj_qkv.weight": (2 * kd + vd, h), q + "in_proj_z.weight": (vd, h),
                       q + "in_proj_b.weight": (la.num_v_heads, h), q + "in_proj_a.weight": (la.num_v_heads, h),
                       q + "conv1d.weight": (2 * kd + vd, 1, la.conv_kernel), q + "dt_bias": (la.num_v_heads,),
                       q + "A_log": (la.num_v_heads,), q + "norm.weight": (la.v_head_dim,),
                       q + "out_proj.weight": (h, vd)}
        else:
            qd, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            q = p + "self_attn."
            shapes |= {q + "q_proj.weight": ((2 if a.output_gate else 1) * qd, h), q + "k_proj.weight": (kv, h),
                       q + "v_proj.weight": (kv, h), q + "o_proj.weight": (h, qd),
                       q + "q_norm.weight": (a.head_dim,), q + "k_norm.weight": (a.head_dim,)}
        if i in moe_layers:
            shapes[p + "mlp.gate.weight"] = (m.num_experts, h)
            if m.num_shared_experts:
                shapes |= mlp_tensor_shapes(p + "mlp.shared_expert.", m.shared_expert_intermediate_size, h)
                shapes[p + "mlp.shared_expert_gate.weight"] = (1, h)
        else:
            shapes |= mlp_tensor_shapes(p + "mlp.", m.dense_intermediate_size, h)
    return shapes


def mtp_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The multi-token-prediction head's own tensors (its decoder layer is `model.layers.N`, N =
    num_layers): the normed embedding and hidden state, joined by `fc`, and its final norm."""
    if not spec.mtp_layers:
        return {}
    h = spec.hidden_size
    return {"mtp.fc.weight": (h, 2 * h)} | {f"mtp.{n}.weight": (h,) for n in MTP_NORMS}


def state_bytes(spec: ModelSpec, tokens: int, element_size: int) -> int:
    """The full-attention layers' keys and values, and each Gated DeltaNet layer's convolution
    window (16-bit) and recurrent state (fp32), whatever the tokens."""
    la = spec.linear_attention
    if la is None:
        return gqa_state_bytes(spec, tokens, element_size)
    conv = (2 * la.num_k_heads * la.k_head_dim + la.num_v_heads * la.v_head_dim) * (la.conv_kernel - 1) * 2
    recurrent = la.num_v_heads * la.k_head_dim * la.v_head_dim * 4
    return gqa_state_bytes(spec, tokens, element_size) + len(spec.linear_attention_layers) * (conv + recurrent)


def spec_from_hf(cfg: HfConfig) -> dict[str, Any]:
    """Qwen3-Next and Qwen3.5-MoE (the image-text config's `text_config`, or the text model's own):
    layer types (or every `full_attention_interval`-th layer full), Gated DeltaNet shapes, (1 + w)
    norms, gated attention, a shared expert. Absent fields take transformers' defaults."""
    if cfg.model_type == "qwen3_5_moe":  # the image-text model: the language model's config is nested
        text = cfg.config.get("text_config")
        if not isinstance(text, dict):
            raise SpecError(f"{cfg.where}: model_type 'qwen3_5_moe' needs a 'text_config' mapping")
        cfg = HfConfig({"tie_word_embeddings": cfg.config.get("tie_word_embeddings")} | text
                       | {"model_type": "qwen3_5_moe_text"}, cfg.where)
    if cfg.get("attention_bias", False):
        raise SpecError(f"{cfg.where}: field 'attention_bias' = true: attention biases are not supported "
                        f"for {cfg.model_type}")
    qwen35 = cfg.model_type == "qwen3_5_moe_text"
    data = cfg.decoder_fields()
    data["attention"] |= {"num_kv_heads": cfg.get("num_key_value_heads", 2), "output_gate": True, "qk_norm": True}
    return data | {
        "family": "qwen3_5_moe" if qwen35 else "qwen3_next",
        "layer_kinds": _layer_kinds(cfg),
        "linear_attention": {"num_k_heads": cfg.get("linear_num_key_heads", 16),
                             "num_v_heads": cfg.get("linear_num_value_heads", 32),
                             "k_head_dim": cfg.get("linear_key_head_dim", 128),
                             "v_head_dim": cfg.get("linear_value_head_dim", 128),
                             "conv_kernel": cfg.get("linear_conv_kernel_dim", 4)},
        "norm": {"kind": "rms_one_plus", "eps": float(cfg.get("rms_norm_eps", 1e-6))},
        "rope": cfg.rope(0.25),
        "moe": _moe(cfg, qwen35),
        # the released configs name it (Qwen3-Next as DeepSeek does); a checkpoint without its tensors
        # compiles without it (`ftc compile` says so)
        "mtp_layers": cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers", 0)),
    }


def _layer_kinds(cfg: HfConfig) -> list[str]:
    return cfg.config.get("layer_types") or [
        "linear_attention" if (i + 1) % cfg.get("full_attention_interval", 4) else "full_attention"
        for i in range(cfg.get("num_hidden_layers"))]


def _moe(cfg: HfConfig, qwen35: bool) -> dict[str, Any]:
    # Qwen3.5's config has no mlp_only_layers, and its router always renormalizes the top-k.
    dense = [] if qwen35 else cfg.dense_layers(cfg.get("num_hidden_layers"), cfg.get("num_experts", 512))
    shared = cfg.get("shared_expert_intermediate_size", 512)
    return {"num_experts": cfg.get("num_experts", 512 if not qwen35 else 256),
            "top_k": cfg.get("num_experts_per_tok", 10 if not qwen35 else 8),
            "expert_intermediate_size": cfg.get("moe_intermediate_size", 512),
            "norm_topk_prob": True if qwen35 else cfg.get("norm_topk_prob", True), "router": "softmax_topk",
            "num_shared_experts": 1 if shared else 0, "shared_expert_intermediate_size": shared,
            "dense_layers": dense, "dense_intermediate_size": cfg.get("intermediate_size", 0) if dense else 0}


def check_spec(s: ModelSpec, need: Need) -> None:
    """GQA attention, a softmax top-k router, at most one shared expert."""
    check_gqa_softmax_topk(s, need)
    m = s.moe
    need(m.num_shared_experts in (0, 1), "moe.num_shared_experts", m.num_shared_experts,
         f"0 or 1 for family {s.family}")
    if m.num_shared_experts:
        need(m.shared_expert_intermediate_size > 0, "moe.shared_expert_intermediate_size",
             m.shared_expert_intermediate_size, "a positive integer when moe.num_shared_experts is 1")


class HybridCheckpointLayout(CheckpointLayout):
    def __init__(self, ckpt: CheckpointReader, spec: ModelSpec):
        super().__init__(ckpt, spec)
        self.prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in ckpt else "model."

    def name(self, canonical: str) -> str:
        """The multi-token-prediction layer (`model.layers.N`, N = num_layers) under `mtp.layers.0.`
        beside the language model, the rest under its prefix."""
        layer = mtp_layer(canonical, self.spec.num_layers)
        if layer is not None:
            return f"mtp.layers.{layer[0]}.{layer[1]}"
        return self.prefix + canonical[len("model."):] if canonical.startswith("model.") else canonical

    def _grouped(self, canonical: str) -> tuple[str, str] | None:
        """(grouped tensor name, which split part) when the checkpoint has the grouped form instead."""
        for suffix, group in _SPLIT.items():
            if canonical.endswith("linear_attn." + suffix) and self.name(canonical) not in self.ckpt:
                return self.name(canonical)[: -len(suffix)] + f"in_proj_{group}.weight", suffix.split(".")[0][8:]
        return None

    def __contains__(self, canonical: str) -> bool:
        grouped = self._grouped(canonical)
        return (grouped[0] if grouped else self.name(canonical)) in self.ckpt

    def shape(self, canonical: str) -> tuple[int, ...]:
        grouped = self._grouped(canonical)
        if grouped is None:
            return self.ckpt.shape(self.name(canonical))
        return tuple(self._split(grouped, meta=True).shape)

    def get(self, canonical: str) -> torch.Tensor:
        grouped = self._grouped(canonical)
        return self.ckpt.get(self.name(canonical)) if grouped is None else self._split(grouped)

    def _split(self, grouped: tuple[str, str], meta: bool = False) -> torch.Tensor:
        """The part ("qkv", "z", "b" or "a") of a grouped projection, rows in the split order."""
        name, part = grouped
        la = self.spec.linear_attention
        nk, r = la.num_k_heads, la.num_v_heads // la.num_k_heads
        dk, dv = la.k_head_dim, la.v_head_dim
        widths = {"qkvz": (dk, dk, r * dv, r * dv), "ba": (r, r)}["qkvz" if part in ("qkv", "z") else "ba"]
        shape = self.ckpt.shape(name)
        if len(shape) != 2 or shape[0] != nk * sum(widths):
            raise CheckpointError(f"{self.ckpt.directory}: tensor {name} has shape {shape}, expected "
                                  f"({nk * sum(widths)}, {self.spec.hidden_size})")
        w = torch.empty(shape, dtype=torch.bfloat16, device="meta") if meta else self.ckpt.get(name)
        pieces = w.view(nk, sum(widths), shape[1]).split(widths, dim=1)  # per key head
        flat = [p.reshape(-1, shape[1]) for p in pieces]
        if part == "qkv":
            return torch.cat(flat[:3])
        return flat[{"z": 3, "b": 0, "a": 1}[part]].contiguous()
