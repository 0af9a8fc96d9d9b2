"""Model specs from YAML files or HF checkpoint directories, with `--override` edits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from ftc_runtime.spec import ModelSpec, SpecError


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
    """Derives spec fields from an HF `config.json` (family qwen3_moe). Absent fields take
    transformers' `Qwen3MoeConfig` defaults, so that the engine computes what transformers does."""
    model_type = config.get("model_type")
    if model_type != "qwen3_moe":
        raise SpecError(f"{directory / 'config.json'}: field 'model_type' = {model_type!r}: expected "
                        "'qwen3_moe' (other families arrive in later versions)")

    def get(key: str, default: Any = ...) -> Any:
        if key in config and config[key] is not None:
            return config[key]
        if default is ...:
            raise SpecError(f"{directory / 'config.json'}: missing required field '{key}'")
        return default

    if config.get("use_sliding_window"):
        raise SpecError(f"{directory / 'config.json'}: field 'use_sliding_window' = true: sliding-window "
                        "attention is not supported yet")
    n_layers = get("num_hidden_layers")
    step = get("decoder_sparse_step", 1)
    mlp_only = set(get("mlp_only_layers", []))
    # transformers writes `num_local_experts` for what Qwen's own configs call `num_experts`.
    n_experts = config.get("num_experts", config.get("num_local_experts"))
    if n_experts is None:
        raise SpecError(f"{directory / 'config.json'}: missing required field 'num_experts'")
    dense = [i for i in range(n_layers) if i in mlp_only or n_experts == 0 or (i + 1) % step != 0]
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None):
        raise SpecError(f"{directory / 'config.json'}: rope type {rope_type!r} is not supported yet "
                        "(only 'default')")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    heads = get("num_attention_heads")
    eos = get("eos_token_id", [])
    eos = [eos] if isinstance(eos, int) else list(eos)
    special = {f"<|special_{i}|>": i for i in eos}
    tok_json = directory / "tokenizer.json"
    if tok_json.is_file():
        added = json.loads(tok_json.read_text()).get("added_tokens", [])
        special = {t["content"]: t["id"] for t in added if t.get("special")}
        by_id = {v: k for k, v in special.items()}
        eos_names = [by_id[i] for i in eos if i in by_id]
    else:
        eos_names = [f"<|special_{i}|>" for i in eos]
    return {
        "name": directory.resolve().name,
        "family": "qwen3_moe",
        "num_layers": n_layers,
        "hidden_size": get("hidden_size"),
        "vocab_size": get("vocab_size"),
        "max_position_embeddings": get("max_position_embeddings", 32768),
        "tie_word_embeddings": get("tie_word_embeddings", False),
        "norm": {"kind": "rms", "eps": float(get("rms_norm_eps", 1e-6))},
        "attention": {"kind": "gqa", "num_heads": heads, "num_kv_heads": get("num_key_value_heads", 4),
                      "head_dim": get("head_dim", get("hidden_size") // heads), "qk_norm": True,
                      "bias": get("attention_bias", False)},
        "rope": {"theta": float(theta)},
        "moe": {"num_experts": n_experts, "top_k": get("num_experts_per_tok"),
                "expert_intermediate_size": get("moe_intermediate_size"),
                "norm_topk_prob": get("norm_topk_prob", False), "router": "softmax_topk",
                "dense_layers": dense,
                "dense_intermediate_size": get("intermediate_size", 0) if dense else 0},
        "tokens": {"special": special, "eos": eos_names},
        "dtype": "bf16",
        "checkpoint": str(directory.resolve()),
    }
