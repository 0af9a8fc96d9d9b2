"""Model specs from YAML files or HF checkpoint directories, with `--override` edits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from ftc_runtime.spec import MAX_LAYERS, ModelSpec, SpecError


def load_spec(source: Path, overrides: list[str] = ()) -> tuple[ModelSpec, Path | None]:
    """A spec and, for an HF directory, that directory (the checkpoint). Overrides are
    `dotted.field=yaml_value` (e.g. `num_layers=4`) applied before validation."""
    if source.is_dir():
        cfg_path = source / "config.json"
        if not cfg_path.is_file():
            raise SpecError(f"{source}: a checkpoint directory needs a config.json")
        try:
            config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise SpecError(f"{cfg_path}: not valid JSON ({e})") from None
        data, origin, checkpoint = spec_dict_from_hf(config, source), str(cfg_path), source
    elif source.is_file():
        try:
            data = yaml.safe_load(source.read_text())
        except yaml.YAMLError as e:
            raise SpecError(f"{source}: not valid YAML ({e})") from None
        origin = str(source)
        checkpoint = None
        if isinstance(data, dict) and data.get("checkpoint"):
            checkpoint = (source.parent / data["checkpoint"]).resolve()
    else:
        raise SpecError(f"{source}: no such spec file or checkpoint directory")
    for item in overrides:
        _apply_override(data, item, origin)
    return ModelSpec.from_dict(data, source=origin), checkpoint


def _apply_override(data: Any, item: str, origin: str) -> None:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise SpecError(f"--override {item!r}: expected FIELD=VALUE (e.g. num_layers=4)")
    parts = key.split(".")
    node = data
    for depth, p in enumerate(parts):
        if not isinstance(node, dict):
            raise SpecError(f"--override {item!r}: '{'.'.join(parts[:depth])}' is not a mapping in {origin}")
        if depth < len(parts) - 1:
            node = node.setdefault(p, {})
    try:
        node[parts[-1]] = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise SpecError(f"--override {item!r}: the value is not valid YAML ({e})") from None


def spec_dict_from_hf(config: dict[str, Any], directory: Path) -> dict[str, Any]:
    """Derives spec fields from an HF `config.json`: families qwen3_moe, qwen3_next and qwen3_5_moe
    (the multimodal config's `text_config`, or the text model's own). Absent fields take
    transformers' defaults for that config class, so that the engine computes what transformers does."""
    model_type = config.get("model_type")
    where = directory / "config.json"
    if model_type == "qwen3_5_moe":  # the image-text model: the language model's config is nested
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise SpecError(f"{where}: model_type 'qwen3_5_moe' needs a 'text_config' mapping")
        config = {"tie_word_embeddings": config.get("tie_word_embeddings")} | text | {"model_type": "qwen3_5_moe_text"}
        model_type = "qwen3_5_moe_text"
    builders = {"qwen3_moe": _qwen3_moe, "qwen3_next": _hybrid, "qwen3_5_moe_text": _hybrid}
    if model_type not in builders:
        raise SpecError(f"{where}: field 'model_type' = {model_type!r}: expected one of "
                        "'qwen3_moe', 'qwen3_next', 'qwen3_5_moe', 'qwen3_5_moe_text'")
    get = _getter(config, where)
    if config.get("use_sliding_window"):
        raise SpecError(f"{where}: field 'use_sliding_window' = true: sliding-window attention is not supported yet")
    if model_type != "qwen3_moe" and get("attention_bias", False):
        raise SpecError(f"{where}: field 'attention_bias' = true: attention biases are not supported for {model_type}")
    data = builders[model_type](config, get, where)
    heads = get("num_attention_heads")
    data |= {
        "name": directory.resolve().name,
        "num_layers": get("num_hidden_layers"),
        "hidden_size": get("hidden_size"),
        "vocab_size": get("vocab_size"),
        "max_position_embeddings": get("max_position_embeddings", 32768),
        "tie_word_embeddings": get("tie_word_embeddings", False),
        "tokens": _tokens(get("eos_token_id", []), directory),
        "expert_format": "bf16",
        "checkpoint": str(directory.resolve()),
    }
    data["attention"] |= {"kind": "gqa", "num_heads": heads, "head_dim": get("head_dim", get("hidden_size") // heads),
                          "qk_norm": True}
    return data


def _getter(config: dict[str, Any], where: Path):
    def get(key: str, default: Any = ...) -> Any:
        if key in config and config[key] is not None:
            return config[key]
        if default is ...:
            raise SpecError(f"{where}: missing required field '{key}'")
        return default
    return get


def _rope(config: dict[str, Any], where: Path, partial_default: float) -> dict[str, float]:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise SpecError(f"{where}: rope type {rope_type!r} is not supported yet (only 'default')")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", partial_default))
    return {"theta": float(theta), "partial_rotary_factor": float(partial)}


def _dense_layers(get, n_layers: int, n_experts: int) -> list[int]:
    if not isinstance(n_layers, int) or not 0 < n_layers <= MAX_LAYERS:
        return []  # ModelSpec.from_dict then names num_layers and its value, without looping over it
    step, mlp_only = get("decoder_sparse_step", 1), set(get("mlp_only_layers", []))
    return [i for i in range(n_layers) if i in mlp_only or n_experts == 0 or (i + 1) % step != 0]


def _qwen3_moe(config: dict[str, Any], get, where: Path) -> dict[str, Any]:
    # transformers writes `num_local_experts` for what Qwen's own configs call `num_experts`.
    n_experts = config.get("num_experts", config.get("num_local_experts"))
    if n_experts is None:
        raise SpecError(f"{where}: missing required field 'num_experts'")
    dense = _dense_layers(get, get("num_hidden_layers"), n_experts)
    return {
        "family": "qwen3_moe",
        "norm": {"kind": "rms", "eps": float(get("rms_norm_eps", 1e-6))},
        "attention": {"num_kv_heads": get("num_key_value_heads", 4), "bias": get("attention_bias", False)},
        "rope": _rope(config, where, 1.0),
        "moe": {"num_experts": n_experts, "top_k": get("num_experts_per_tok"),
                "expert_intermediate_size": get("moe_intermediate_size"),
                "norm_topk_prob": get("norm_topk_prob", False), "router": "softmax_topk",
                "dense_layers": dense, "dense_intermediate_size": get("intermediate_size", 0) if dense else 0},
    }


def _hybrid(config: dict[str, Any], get, where: Path) -> dict[str, Any]:
    """Qwen3-Next and Qwen3.5-MoE: layer types (or every `full_attention_interval`-th layer full),
    Gated DeltaNet shapes, (1 + w) norms, gated attention, a shared expert."""
    n_layers = get("num_hidden_layers")
    kinds = config.get("layer_types") or [
        "linear_attention" if (i + 1) % get("full_attention_interval", 4) else "full_attention"
        for i in range(n_layers)]
    qwen35 = config["model_type"] == "qwen3_5_moe_text"
    # Qwen3.5's config has no mlp_only_layers, and its router always renormalizes the top-k.
    dense = [] if qwen35 else _dense_layers(get, n_layers, get("num_experts", 512))
    shared = get("shared_expert_intermediate_size", 512)
    return {
        "family": "qwen3_5_moe" if qwen35 else "qwen3_next",
        "layer_kinds": kinds,
        "linear_attention": {"num_k_heads": get("linear_num_key_heads", 16),
                             "num_v_heads": get("linear_num_value_heads", 32),
                             "k_head_dim": get("linear_key_head_dim", 128),
                             "v_head_dim": get("linear_value_head_dim", 128),
                             "conv_kernel": get("linear_conv_kernel_dim", 4)},
        "norm": {"kind": "rms_one_plus", "eps": float(get("rms_norm_eps", 1e-6))},
        "attention": {"num_kv_heads": get("num_key_value_heads", 2), "output_gate": True},
        "rope": _rope(config, where, 0.25),
        "moe": {"num_experts": get("num_experts", 512 if not qwen35 else 256),
                "top_k": get("num_experts_per_tok", 10 if not qwen35 else 8),
                "expert_intermediate_size": get("moe_intermediate_size", 512),
                "norm_topk_prob": True if qwen35 else get("norm_topk_prob", True), "router": "softmax_topk",
                "num_shared_experts": 1 if shared else 0, "shared_expert_intermediate_size": shared,
                "dense_layers": dense, "dense_intermediate_size": get("intermediate_size", 0) if dense else 0},
    }


def _tokens(eos: Any, directory: Path) -> dict[str, Any]:
    """Special tokens from tokenizer.json when there is one; the eos ids by name."""
    eos = [eos] if isinstance(eos, int) else list(eos)
    special = {f"<|special_{i}|>": i for i in eos}
    tok_json = directory / "tokenizer.json"
    if tok_json.is_file():
        added = json.loads(tok_json.read_text()).get("added_tokens", [])
        special = {t["content"]: t["id"] for t in added if t.get("special")}
        by_id = {v: k for k, v in special.items()}
        return {"special": special, "eos": [by_id[i] for i in eos if i in by_id]}
    return {"special": special, "eos": [f"<|special_{i}|>" for i in eos]}
