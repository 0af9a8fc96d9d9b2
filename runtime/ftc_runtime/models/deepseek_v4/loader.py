"""DeepSeek-V4's checkpoint (transformers `model_type` deepseek_v4): its non-expert tensors by the
transformers-converted name, its spec from an HF `config.json` (the current fields and the
released checkpoints' older ones, as transformers' config reads them), and the family's spec rules."""

from __future__ import annotations

import re
from typing import Any

from ftc_runtime.models.base import CheckpointLayout, CheckpointReader
from ftc_runtime.models.hf_config import HfConfig
from ftc_runtime.models.layers.tensor_shapes import end_tensor_shapes, mlp_tensor_shapes
from ftc_runtime.spec import MAX_LAYERS, ModelSpec, Need, SpecError

# transformers' names of the attention kinds and of the compression rates that stand for them
HF_LAYER_TYPES = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
                  "heavily_compressed_attention": "hca"}
RATE_LAYER_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
# The released checkpoint's names as transformers renames them (its conversion mapping for
# deepseek_v4), in that order, each applied once where it matches; "model." then prefixes all but
# the head.
RELEASED_RENAMES = tuple((re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"), (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"), (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"), (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"), (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."), (r"\.shared_experts\.w3\.", ".shared_experts.up_proj.")))
# The linears the release stores as block-scaled FP8 (the attention's own, not its compressors'
# or indexer's, and the shared expert's): an engine whose dense_format is fp8 keeps them so.
FP8_LINEARS = tuple(f"self_attn.{n}_proj.weight" for n in ("q_a", "q_b", "kv", "o_a", "o_b")) + tuple(
    f"shared_experts.{n}_proj.weight" for n in ("gate", "up", "down"))
DEFAULT_HASH_LAYERS = 3
DEFAULT_ROTARY = 64 / 512
# The release's multi-token-prediction layer J: `mtp.J.` holds a decoder layer (a sliding-window one,
# named as `layers.L.`'s are) and its own tensors, which the engine names under its decoder layer
# num_layers + J: the norms of the next token's embedding and of the model's streams, their
# projections, the head's stream collapse and norm.
MTP_NAME = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.*)$")
MTP_OWN = {"e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight", "enorm.weight": "enorm.weight",
           "hnorm.weight": "hnorm.weight", "norm.weight": "mtp_norm.weight", "hc_head_fn": "hc_head.hc_fn",
           "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}


def dense_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every non-expert tensor of the model, by checkpoint name, with its shape; the
    multi-token-prediction layers are decoder layers N, N + 1, ... (N = num_layers), each a
    sliding-window layer with a learned router, and their own tensors (`MTP_OWN`)."""
    h, hc = spec.hidden_size, spec.hyper_connections.streams
    shapes = end_tensor_shapes(spec) | _hyper_head_shapes("model.hc_head.", hc, h)
    hash_layers = set(spec.moe.hash_layers)
    for i in range(spec.num_layers):
        shapes |= _decoder_shapes(spec, f"model.layers.{i}.", spec.compressed.layer_types[i], i in hash_layers)
    for i in spec.mtp_decoder_layers:
        p = f"model.layers.{i}."
        shapes |= _decoder_shapes(spec, p, "sliding", False) | _hyper_head_shapes(p + "hc_head.", hc, h)
        shapes |= {p + "e_proj.weight": (h, h), p + "h_proj.weight": (h, h)}
        shapes |= {p + n: (h,) for n in ("enorm.weight", "hnorm.weight", "mtp_norm.weight")}
    return shapes


def _decoder_shapes(spec: ModelSpec, p: str, kind: str, hashed: bool) -> dict[str, tuple[int, ...]]:
    """A decoder layer's: its norms, its blocks' hyper-connections, its attention of `kind`, its
    router (by token id where `hashed`) and shared expert."""
    m, h, hc = spec.moe, spec.hidden_size, spec.hyper_connections.streams
    shapes = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    for block in ("attn_hc.", "ffn_hc."):
        shapes |= {p + block + "fn": ((2 + hc) * hc, hc * h), p + block + "base": ((2 + hc) * hc,),
                   p + block + "scale": (3,)}
    shapes |= _attention_shapes(spec, kind, p + "self_attn.")
    shapes[p + "mlp.gate.weight"] = (m.num_experts, h)
    if hashed:
        shapes[p + "mlp.gate.tid2eid"] = (spec.vocab_size, m.top_k)
    else:
        shapes[p + "mlp.gate.e_score_correction_bias"] = (m.num_experts,)
    return shapes | mlp_tensor_shapes(p + "mlp.shared_experts.", m.shared_expert_intermediate_size, h)


def _hyper_head_shapes(p: str, streams: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """The final collapse of the streams into one (`hyper_head`)."""
    return {p + "hc_fn": (streams, streams * hidden), p + "hc_base": (streams,), p + "hc_scale": (1,)}


def _attention_shapes(spec: ModelSpec, kind: str, p: str) -> dict[str, tuple[int, ...]]:
    """The shared key/value attention's projections, and its compressor's (and indexer's) by kind."""
    a, c, h = spec.attention, spec.compressed, spec.hidden_size
    d = a.head_dim
    shapes = {p + "sinks": (a.num_heads,), p + "q_a_proj.weight": (c.q_lora_rank, h),
              p + "q_a_norm.weight": (c.q_lora_rank,), p + "q_b_proj.weight": (a.num_heads * d, c.q_lora_rank),
              p + "kv_proj.weight": (d, h), p + "kv_norm.weight": (d,),
              p + "o_a_proj.weight": (c.o_groups * c.o_lora_rank, a.num_heads * d // c.o_groups),
              p + "o_b_proj.weight": (h, c.o_groups * c.o_lora_rank)}
    if kind == "hca":
        shapes |= _compressor_shapes(p + "compressor.", c.hca_rate, d, d, h)
    elif kind == "csa":
        # two overlapping series per token: twice the width of the entries they pool into
        shapes |= _compressor_shapes(p + "compressor.", c.csa_rate, 2 * d, d, h)
        q = p + "compressor.indexer."
        shapes |= _compressor_shapes(q, c.csa_rate, 2 * c.index_head_dim, c.index_head_dim, h)
        shapes |= {q + "q_b_proj.weight": (c.index_heads * c.index_head_dim, c.q_lora_rank),
                   q + "scorer.weights_proj.weight": (c.index_heads, h)}
    return shapes


def _compressor_shapes(p: str, rate: int, width: int, d: int, hidden: int) -> dict[str, tuple[int, ...]]:
    return {p + "position_bias": (rate, width), p + "kv_proj.weight": (width, hidden),
            p + "gate_proj.weight": (width, hidden), p + "kv_norm.weight": (d,)}


def canonical_name(released: str) -> str:
    """A released checkpoint's tensor name (with or without "model.") as transformers' model names it."""
    name = released.removeprefix("model.")
    for pattern, target in RELEASED_RENAMES:
        name = pattern.sub(target, name, count=1)
    return name if name == "lm_head.weight" else "model." + name


def mtp_canonical(released: str, num_layers: int) -> str | None:
    """A tensor of the release's multi-token-prediction layer J (`mtp.J.`) as the engine names it,
    under decoder layer num_layers + J; None for any other tensor."""
    match = MTP_NAME.match(released)
    if match is None:
        return None
    layer, rest = num_layers + int(match.group(1)), match.group(2)
    return f"model.layers.{layer}.{MTP_OWN[rest]}" if rest in MTP_OWN else canonical_name(f"layers.{layer}.{rest}")


class DeepseekV4Layout(CheckpointLayout):
    """A checkpoint whose tensors are named as DeepSeek released them, as transformers names them, or
    both (transformers' `save_pretrained` writes the released names under "model." but the head's
    and the embedding's): every stored name is mapped through `canonical_name`, which leaves
    transformers' own names as they are. The release's `mtp.J.` tensors are decoder layer
    num_layers + J (`mtp_canonical`), in place of any real layer there (a spec cut to its first
    layers still reads its MTP layer)."""

    def __init__(self, ckpt: CheckpointReader, spec: ModelSpec):
        super().__init__(ckpt, spec)
        names = ckpt.names()
        self.stored = {canonical_name(n): n for n in names if MTP_NAME.match(n) is None}
        self.prefixes: dict[str, str] = {}
        for n in names:
            canonical = mtp_canonical(n, spec.num_layers)
            if canonical is not None:
                self.stored[canonical] = n
                match = MTP_NAME.match(n)
                self.prefixes[f"model.layers.{spec.num_layers + int(match.group(1))}."] = n[:match.start(2)]

    def name(self, canonical: str) -> str:
        """Where the canonical tensor sits; for a prefix (ending in "."), the stored prefix of the
        tensors under it (a layer's experts: `layers.L.ffn.experts.` as released)."""
        if canonical.endswith(".") and canonical not in self.prefixes:
            under = next((c for c in self.stored if c.startswith(canonical)), None)
            self.prefixes[canonical] = canonical if under is None else \
                self.stored[under].removesuffix(under[len(canonical):])
        return self.prefixes[canonical] if canonical.endswith(".") else self.stored.get(canonical, canonical)


def layer_types(cfg: HfConfig, n_layers: int) -> list[str]:
    """Each layer's attention: `layer_types`, else the older per-layer `compress_ratios`, else
    transformers' default (two HCA layers, then HCA and CSA alternating)."""
    given = cfg.get("layer_types", None)
    if given is None and cfg.get("compress_ratios", None) is not None:
        ratios = cfg.get("compress_ratios")
        bad = [r for r in ratios if r not in RATE_LAYER_TYPES]
        if bad:
            raise SpecError(f"{cfg.where}: field 'compress_ratios' has {bad[0]!r}: expected one of "
                            + ", ".join(map(str, RATE_LAYER_TYPES)))
        given = [RATE_LAYER_TYPES[r] for r in ratios]
    if given is None:
        given = (["heavily_compressed_attention"] * min(n_layers, 2)
                 + ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
                    for i in range(max(n_layers - 2, 0))])
    bad = [t for t in given if t not in HF_LAYER_TYPES]
    if bad:
        raise SpecError(f"{cfg.where}: field 'layer_types' has {bad[0]!r}: expected one of "
                        + ", ".join(HF_LAYER_TYPES))
    return [HF_LAYER_TYPES[t] for t in given[:n_layers]]


def hash_layers(cfg: HfConfig, n_layers: int) -> list[int]:
    """The layers routed by token id: `mlp_layer_types`' "hash_moe" entries, else the first
    `num_hash_layers` (3)."""
    kinds = cfg.get("mlp_layer_types", None)
    if kinds is not None:
        bad = [k for k in kinds if k not in ("hash_moe", "moe")]
        if bad:
            raise SpecError(f"{cfg.where}: field 'mlp_layer_types' has {bad[0]!r}: expected 'hash_moe' or 'moe'")
        return [i for i, kind in enumerate(kinds[:n_layers]) if kind == "hash_moe"]
    return list(range(min(cfg.get("num_hash_layers", DEFAULT_HASH_LAYERS), n_layers)))


def rope_fields(cfg: HfConfig, head_dim: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the spec's `rope`, the compressed entries' base and YaRN) from `rope_parameters` {main,
    compress}, or from the older `rope_theta`, `compress_rope_theta` and `rope_scaling` (whose YaRN
    stretches the compressed entries' base only)."""
    rp = cfg.get("rope_parameters", None) or cfg.get("rope_scaling", None) or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = rp["main"], rp["compress"]
    else:
        main = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
        compress = {**rp, "rope_theta": cfg.get("compress_rope_theta", 160000.0), "attention_factor": 1.0}
    # the rotated share of a head: the ropes' own, else the config's, else the older qk_rope_head_dim,
    # else transformers' default of 64 of 512 dims
    rotary = main.get("partial_rotary_factor", cfg.get("partial_rotary_factor", None))
    if rotary is None:
        rope_dim = cfg.get("qk_rope_head_dim", None)
        rotary = rope_dim / head_dim if isinstance(rope_dim, int) and isinstance(head_dim, int) else DEFAULT_ROTARY
    if compress.get("partial_rotary_factor", rotary) != rotary:
        raise SpecError(f"{cfg.where}: the compress rope's partial_rotary_factor "
                        f"{compress['partial_rotary_factor']!r} differs from the main rope's {rotary!r}")
    for name, params in (("main", main), ("compress", compress)):
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ("default", "yarn") or (name == "main" and kind != "default"):
            raise SpecError(f"{cfg.where}: the {name} rope's type {kind!r} is not supported "
                            f"({'default' if name == 'main' else 'default or yarn'})")
    yarn = None
    if compress.get("rope_type", compress.get("type")) == "yarn":
        if compress.get("attention_factor", None) != 1.0:  # as released: cos and sin not scaled
            raise SpecError(f"{cfg.where}: the compress rope's YaRN attention_factor "
                            f"{compress.get('attention_factor')!r} is not supported (only 1.0)")
        yarn = {"factor": float(compress["factor"]),
                "original_max_position": int(compress["original_max_position_embeddings"]),
                "beta_fast": float(compress.get("beta_fast", 32.0)), "beta_slow": float(compress.get("beta_slow", 1.0))}
    rope = {"theta": float(main.get("rope_theta", 10000.0)), "partial_rotary_factor": float(rotary)}
    return rope, {"compress_theta": float(compress.get("rope_theta", 160000.0)), "compress_yarn": yarn}


def spec_from_hf(cfg: HfConfig) -> dict[str, Any]:
    """The spec fields of a DeepSeek-V4 config; absent fields take transformers' defaults."""
    n_layers = cfg.get("num_hidden_layers")
    counted = isinstance(n_layers, int) and 0 < n_layers <= MAX_LAYERS  # else from_dict names the field
    data = cfg.decoder_fields()
    head_dim = data["attention"]["head_dim"]
    rope, compress_rope = rope_fields(cfg, head_dim)
    rates = {"compressed_sparse_attention": cfg.get("compress_rate_csa", 4),
             "heavily_compressed_attention": cfg.get("compress_rate_hca", 128)} | cfg.get("compress_rates", {})
    inter, n_shared = cfg.get("moe_intermediate_size", 2048), cfg.get("n_shared_experts", 1)
    data["attention"] |= {"kind": "compressed", "num_kv_heads": 1, "qk_norm": False,
                          "bias": cfg.get("attention_bias", False)}
    return data | {
        "family": "deepseek_v4",
        "mtp_layers": cfg.get("num_nextn_predict_layers", 0),
        "norm": {"kind": "rms", "eps": float(cfg.get("rms_norm_eps", 1e-6))},
        "rope": rope,
        "compressed": {"q_lora_rank": cfg.get("q_lora_rank", 1024),
                       "rope_dim": round(rope["partial_rotary_factor"] * head_dim) if isinstance(head_dim, int) else 0,
                       "sliding_window": cfg.get("sliding_window", 128), "o_groups": cfg.get("o_groups", 8),
                       "o_lora_rank": cfg.get("o_lora_rank", 1024),
                       "layer_types": layer_types(cfg, n_layers) if counted else [],
                       "csa_rate": rates["compressed_sparse_attention"],
                       "hca_rate": rates["heavily_compressed_attention"],
                       "index_heads": cfg.get("index_n_heads", 64), "index_head_dim": cfg.get("index_head_dim", 128),
                       "index_top_k": cfg.get("index_topk", 512)} | compress_rope,
        "hyper_connections": {"streams": cfg.get("hc_mult", 4), "sinkhorn_iters": cfg.get("hc_sinkhorn_iters", 20),
                              "eps": float(cfg.get("hc_eps", 1e-6))},
        "moe": {"num_experts": cfg.get("n_routed_experts", 256), "top_k": cfg.get("num_experts_per_tok", 6),
                "expert_intermediate_size": inter, "norm_topk_prob": cfg.get("norm_topk_prob", True),
                "router": "sqrt_softplus_topk", "num_shared_experts": n_shared,
                "shared_expert_intermediate_size": inter * n_shared,
                "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.5)),
                "hash_layers": hash_layers(cfg, n_layers) if counted else [],
                "swiglu_limit": float(cfg.get("swiglu_limit", 10.0))},
    }


def check_spec(s: ModelSpec, need: Need) -> None:
    """Compressed attention with its sliding window, the sqrt-softplus router, hyper-connections,
    RMSNorm, exactly one shared expert, no dense or linear-attention layers."""
    need(s.attention.kind == "compressed", "attention.kind", s.attention.kind, f"'compressed' for family {s.family}")
    need(s.moe.router == "sqrt_softplus_topk", "moe.router", s.moe.router,
         f"'sqrt_softplus_topk' for family {s.family}")
    need(s.norm.kind == "rms", "norm.kind", s.norm.kind, f"'rms' for family {s.family}")
    need(s.hyper_connections is not None, "hyper_connections", s.hyper_connections,
         f"the residual's streams for family {s.family}")
    need(s.moe.num_shared_experts == 1, "moe.num_shared_experts", s.moe.num_shared_experts,
         f"1 for family {s.family}")
    need(not s.moe.dense_layers, "moe.dense_layers", list(s.moe.dense_layers), f"none for family {s.family}")
    need(not s.linear_attention_layers, "layer_kinds", list(s.layer_kinds),
         f"only full_attention layers for family {s.family}")
    need(not s.attention.bias, "attention.bias", s.attention.bias, f"false for family {s.family}")
    c = s.compressed
    need(round(s.rope.partial_rotary_factor * s.attention.head_dim) == c.rope_dim, "rope.partial_rotary_factor",
         s.rope.partial_rotary_factor, f"compressed.rope_dim / attention.head_dim for family {s.family}")
