"""Model specs from YAML files or HF checkpoint directories, with `--override` edits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from ftc.compile.quantized_checkpoint import declared_format
from ftc_runtime.models import FAMILIES, checked_spec, family, family_of_hf
from ftc_runtime.models.hf_config import HfConfig
from ftc_runtime.spec import ModelSpec, SpecError


def load_spec(source: Path, overrides: list[str] = (), quant: str | None = None,
              name: str | None = None) -> tuple[ModelSpec, Path | None]:
    """A spec and, for an HF directory, that directory (the checkpoint). Overrides are
    `dotted.field=yaml_value` (e.g. `num_layers=4`: the spec's first 4 layers) applied before
    validation. The expert format
    is `quant`, else an HF checkpoint's own (4-bit experts stay in their format), else the spec's;
    an FP8 release's dense projections stay FP8 where the family reads them so (an override of
    `dense_format` decides otherwise);
    the name is `name`, else the spec's (an HF directory's: its folder's)."""
    if source.is_dir():
        cfg_path = source / "config.json"
        if not cfg_path.is_file():
            raise SpecError(f"{source}: a checkpoint directory needs a config.json")
        try:
            config = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise SpecError(f"{cfg_path}: not valid JSON ({e})") from None
        data, origin, checkpoint = spec_dict_from_hf(config, source), str(cfg_path), source
        data["expert_format"] = _checkpoint_format(source, config, quant)
        data["dense_format"] = _checkpoint_dense_format(config, data.get("family"))
    elif source.is_file():
        _refuse_weights_file(source)
        try:
            data = yaml.safe_load(source.read_text())
        except yaml.YAMLError as e:
            raise SpecError(f"{source}: not valid YAML ({e})") from None
        origin, checkpoint = str(source), None
    else:
        raise SpecError(f"{source}: no such spec file or checkpoint directory")
    if quant is not None and isinstance(data, dict):
        data["expert_format"] = quant
    if name is not None and isinstance(data, dict):
        data["name"] = name
    for item in overrides:
        _apply_override(data, item, origin)
    if any(item.partition("=")[0] == "num_layers" for item in overrides):
        _cut_to_layers(data)
    if checkpoint is None and isinstance(data, dict) and data.get("checkpoint"):
        # A spec's own (or an override's) checkpoint, relative to the spec's folder
        checkpoint = (source.parent / str(data["checkpoint"])).resolve()
    return checked_spec(data, source=origin), checkpoint


def _refuse_weights_file(source: Path) -> None:
    """A file of weights given where a spec or a checkpoint folder is expected."""
    with source.open("rb") as f:
        magic = f.read(4)
    if magic == b"GGUF" or source.suffix.lower() == ".gguf":
        raise SpecError(f"{source}: a GGUF file; ftc compiles a Hugging Face checkpoint (a folder with config.json "
                        "and *.safetensors) or a spec YAML: give the checkpoint the GGUF was made from")
    if source.suffix.lower() == ".safetensors":
        raise SpecError(f"{source}: a safetensors file; give the checkpoint folder that holds it and its config.json")


def _checkpoint_format(directory: Path, config: dict[str, Any], quant: str | None) -> str:
    """The expert format of an engine of this checkpoint: its declared 4-bit format (which --quant
    may only repeat: another would round its weights a second time), else --quant, else bf16."""
    declared = declared_format(directory, config)
    if declared is not None and quant not in (None, declared):
        raise SpecError(f"{directory}: the checkpoint's routed experts are {declared}; --quant {quant} would "
                        f"dequantize and round them again: leave --quant out or give --quant {declared}")
    return declared or quant or "bf16"


def _checkpoint_dense_format(config: dict[str, Any], family_name: Any) -> str:
    """fp8 for an FP8 release (`quant_method: fp8`) of a family that reads FP8 projections, whose
    codes the engine then keeps as they are (`--dense-format bf16` dequantizes them); else bf16."""
    q = config.get("quantization_config")
    fp8 = isinstance(q, dict) and q.get("quant_method") == "fp8"
    return "fp8" if fp8 and family_name in FAMILIES and family(family_name).fp8_linears else "bf16"


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


def _cut_to_layers(data: Any) -> None:
    """A spec whose `num_layers` was overridden below its per-layer lists is its first layers: the
    lists of one entry per layer (`layer_kinds`, `indexer.layer_types`, `compressed.layer_types`)
    keep their first entries, `moe.dense_layers` and `moe.hash_layers` the layers below the count.
    A count above a list's length is left for the spec's check to name."""
    n = data.get("num_layers") if isinstance(data, dict) else None
    if not isinstance(n, int) or n < 1:
        return
    for path in (("layer_kinds",), ("indexer", "layer_types"), ("compressed", "layer_types")):
        node = data
        for p in path[:-1]:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(path[-1]), list) and len(node[path[-1]]) > n:
            node[path[-1]] = node[path[-1]][:n]
    moe = data.get("moe")
    for field in ("dense_layers", "hash_layers"):
        if isinstance(moe, dict) and isinstance(moe.get(field), list):
            moe[field] = [i for i in moe[field] if not isinstance(i, int) or i < n]


def spec_dict_from_hf(config: dict[str, Any], directory: Path) -> dict[str, Any]:
    """Spec fields from an HF `config.json`, by the family that reads its `model_type`."""
    where = directory / "config.json"
    name = family_of_hf(config.get("model_type"))
    if name is None:
        known = ", ".join(repr(t) for e in FAMILIES.values() for t in e.hf_model_types)
        raise SpecError(f"{where}: field 'model_type' = {config.get('model_type')!r}: expected one of {known}")
    return family(name).spec_from_hf(HfConfig(config, where))
