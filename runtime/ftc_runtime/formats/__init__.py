"""Expert formats: how routed experts are stored (FTW banks), encoded and dequantized, and which
kernel templates compute with them. One module per format; imported on first use."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ftc_runtime.formats.base import ExpertFormat

# name → its module
FORMATS: dict[str, str] = {name: f"ftc_runtime.formats.{name}" for name in ("bf16", "mxfp4", "nvfp4")}


def expert_format(name: str) -> ExpertFormat:
    """The format `name` (its module imported now)."""
    if name not in FORMATS:
        raise ValueError(f"expert format {name!r} is not known; known: {', '.join(FORMATS)}")
    return import_module(FORMATS[name]).FORMAT
