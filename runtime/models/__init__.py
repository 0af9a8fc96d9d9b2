"""Model families the runtime can run, registered by the spec's `family` name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ftc_runtime.models.qwen3_moe.model import Qwen3MoeModel
from ftc_runtime.models.qwen3_moe.model import dense_tensor_shapes as qwen3_moe_dense_shapes
from ftc_runtime.models.qwen3_next.model import Qwen3NextModel
from ftc_runtime.models.qwen3_next.model import dense_tensor_shapes as qwen3_next_dense_shapes
from ftc_runtime.spec import ModelSpec


@dataclass(frozen=True)
class Family:
    name: str
    model: type
    dense_tensor_shapes: Callable[[ModelSpec], dict[str, tuple[int, ...]]]
    chat_template: str  # in chat_templates/: for engines whose checkpoint brings none
    tool_parser: str  # name in tool_parsers.TOOL_PARSERS: how the family writes tool calls

    @property
    def chat_template_path(self) -> Path:
        return Path(__file__).parent / "chat_templates" / self.chat_template


FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family("qwen3_moe", Qwen3MoeModel, qwen3_moe_dense_shapes, "chatml_tools.jinja", "qwen"),
    # The hybrid families: until their own tool-call format is parsed, the Qwen3 one.
    "qwen3_5_moe": Family("qwen3_5_moe", Qwen3NextModel, qwen3_next_dense_shapes, "chatml_tools.jinja", "qwen"),
    "qwen3_next": Family("qwen3_next", Qwen3NextModel, qwen3_next_dense_shapes, "chatml_tools.jinja", "qwen"),
}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"model family {name!r} has no runtime model; known: {', '.join(FAMILIES)}") from None
