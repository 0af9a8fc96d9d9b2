"""The model families, by the spec's `family` name: each entry names the package that builds its
`Family` record, imported on first use, so that an engine never imports the code (Triton,
flash-linear-attention) of a family it does not run. Adding a family is one package and one entry
here (and one entry in tests/families.py)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ftc_runtime.models.base import Family
    from ftc_runtime.spec import ModelSpec


@dataclass(frozen=True)
class Entry:
    package: str  # under ftc_runtime.models
    hf_model_types: tuple[str, ...]  # the HF config.json `model_type`s this family reads


FAMILIES: dict[str, Entry] = {
    "qwen3_moe": Entry("qwen3_moe", ("qwen3_moe",)),
    "qwen3_next": Entry("qwen3_next", ("qwen3_next",)),
    "qwen3_5_moe": Entry("qwen3_next", ("qwen3_5_moe", "qwen3_5_moe_text")),
    "glm_moe_dsa": Entry("glm_moe_dsa", ("glm_moe_dsa",)),
    "deepseek_v4": Entry("deepseek_v4", ("deepseek_v4",)),
}


def family(name: str) -> Family:
    """The family `name`'s record (its package imported now)."""
    if name not in FAMILIES:
        raise ValueError(f"model family {name!r} has no runtime model; known: {', '.join(FAMILIES)}")
    return import_module(f"ftc_runtime.models.{FAMILIES[name].package}").FAMILIES[name]


def family_of_hf(model_type: Any) -> str | None:
    """The family that reads HF checkpoints of `model_type`, if any."""
    return next((name for name, e in FAMILIES.items() if model_type in e.hf_model_types), None)


def checked_spec(data: Any, source: str = "spec") -> ModelSpec:
    """`ModelSpec.from_dict`, then the family's own rules; every error names the field and value."""
    from ftc_runtime.spec import ModelSpec, checker

    spec, need = ModelSpec.from_dict(data, source), checker(source)
    need(spec.family in FAMILIES, "family", spec.family, "one of " + ", ".join(FAMILIES))
    fam = family(spec.family)
    fam.check_spec(spec, need)
    need(spec.dense_format == "bf16" or fam.fp8_linears, "dense_format", spec.dense_format,
         f"bf16 for family {spec.family} (its model reads no FP8 weights)")
    need(spec.mtp_layers == 0 or fam.mtp, "mtp_layers", spec.mtp_layers,
         f"0 for family {spec.family} (its model runs no multi-token-prediction layer)")
    return spec
