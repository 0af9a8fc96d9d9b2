"""Model families the runtime can run, registered by the spec's `family` name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..spec import ModelSpec
from .qwen3_moe import Qwen3MoeModel
from .qwen3_moe import dense_tensor_shapes as qwen3_moe_dense_shapes


@dataclass(frozen=True)
class Family:
    name: str
    model: type
    dense_tensor_shapes: Callable[[ModelSpec], dict[str, tuple[int, ...]]]


FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family("qwen3_moe", Qwen3MoeModel, qwen3_moe_dense_shapes),
}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"model family {name!r} has no runtime model; known: {', '.join(FAMILIES)}") from None
