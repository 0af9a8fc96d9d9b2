"""What a model family gives the runtime and the compiler: one `Family` record per family name,
built by the family's package (`<family>/__init__.py`) and found through the registry
(`ftc_runtime.models.family`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ftc_runtime.decode.graphs import DecodeGraphs
from ftc_runtime.models.hf_config import HfConfig
from ftc_runtime.spec import ModelSpec, Need

CHAT_TEMPLATES = Path(__file__).resolve().parents[1] / "chat" / "templates"


class CheckpointError(ValueError):
    """The checkpoint is incomplete or has a tensor of the wrong name, shape or dtype, or non-finite values."""


class CheckpointReader(Protocol):
    """Tensors of a checkpoint by their stored names (the compiler's safetensors reader)."""

    directory: Path

    def __contains__(self, name: str) -> bool: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str) -> torch.Tensor: ...

    def names(self) -> list[str]: ...


def mtp_layer(canonical: str, num_layers: int) -> tuple[int, str] | None:
    """(j, the rest of the name) for a canonical tensor of multi-token-prediction layer j
    (`model.layers.N+j.`, N = num_layers), None for any other tensor."""
    head, _, rest = canonical.partition(".layers.")
    if head != "model" or not rest:
        return None
    index, _, name = rest.partition(".")
    return (int(index) - num_layers, name) if index.isdigit() and int(index) >= num_layers else None


class CheckpointLayout:
    """The canonical tensor names of a model (`Family.dense_tensor_shapes`) in one checkpoint: here
    as they are, under `model.`; a family whose checkpoints store some tensors otherwise subclasses."""

    def __init__(self, ckpt: CheckpointReader, spec: ModelSpec):
        self.ckpt, self.spec = ckpt, spec

    def name(self, canonical: str) -> str:
        """Where the canonical tensor sits in this checkpoint."""
        return canonical

    def __contains__(self, canonical: str) -> bool:
        return self.name(canonical) in self.ckpt

    def shape(self, canonical: str) -> tuple[int, ...]:
        return self.ckpt.shape(self.name(canonical))

    def get(self, canonical: str) -> torch.Tensor:
        return self.ckpt.get(self.name(canonical))


@dataclass(frozen=True)
class Family:
    name: str
    model: type  # built as model(spec, dense weights, expert backend, device)
    check_spec: Callable[[ModelSpec, Need], None]  # the family's own rules on a spec
    dense_tensor_shapes: Callable[[ModelSpec], dict[str, tuple[int, ...]]]  # every non-expert tensor
    spec_from_hf: Callable[[HfConfig], dict[str, Any]]  # spec fields from an HF config.json
    checkpoint_layout: type[CheckpointLayout]
    decode_graphs: type[DecodeGraphs] | None  # one decode step as CUDA graphs (None: eager)
    chat_template: str  # in chat/templates/: for engines whose checkpoint brings none
    tool_parser: str  # name in chat.tool_parsers.TOOL_PARSERS: how the family writes tool calls
    # Device bytes of one sequence's attention and recurrent state after `tokens` tokens, its
    # caches of `element_size` bytes an element: the VRAM plan's "KV" share at max_context.
    state_bytes: Callable[[ModelSpec, int, int], int]
    # Name endings of the dense weights its model reads as FP8 blocks (`layers.fp8_linear`) where the
    # spec's dense_format is fp8; none: the family holds its dense weights in bf16 only.
    fp8_linears: tuple[str, ...] = ()
    # The one-graph decode step's device time per MoE layer beyond its bytes (launches and the
    # dependencies between its kernels), measured on the h200 (docs/history/performance-log.md): `ftc inspect`'s
    # prediction adds it per MoE layer. The default is the Qwen families' (their timelines: body,
    # plan and hits less their reads, 0.07-0.09 ms).
    decode_fixed_ms: float = 0.08
    # Name endings of the dense tensors an engine stores in fp32 (DeepSeek-V4's hyper-connections,
    # sinks, position terms and router bias: its checkpoints' fp32 tensors) and of its tables of
    # expert ids, stored int64 (a hash router's token id → experts); the rest bf16 or FP8.
    fp32_tensors: tuple[str, ...] = ()
    expert_index_tensors: tuple[str, ...] = ()
    # Its model runs the checkpoint's multi-token-prediction layers (`spec.mtp_layers`: `new_mtp_cache`,
    # `mtp_forward`, and `forward(hidden=...)` for their input)
    mtp: bool = False

    @property
    def chat_template_path(self) -> Path:
        return CHAT_TEMPLATES / self.chat_template


def kv_cache_bytes(spec: ModelSpec, tokens: int, row_elements: int, element_size: int) -> int:
    """Bytes of every full-attention layer's cache of `tokens` rows of `row_elements` elements."""
    return tokens * len(spec.full_attention_layers) * row_elements * element_size


def gqa_state_bytes(spec: ModelSpec, tokens: int, element_size: int) -> int:
    """A GQA model's state: keys and values per KV head in every full-attention layer."""
    return kv_cache_bytes(spec, tokens, 2 * spec.attention.num_kv_heads * spec.attention.head_dim, element_size)


def check_gqa_softmax_topk(s: ModelSpec, need: Need) -> None:
    """A family whose model computes GQA attention (`models/layers/attention`) and the softmax
    top-k router (`models/layers/router`): the spec must name those."""
    need(s.attention.kind == "gqa", "attention.kind", s.attention.kind, f"'gqa' for family {s.family}")
    need(s.moe.router == "softmax_topk", "moe.router", s.moe.router, f"'softmax_topk' for family {s.family}")
    check_plain_swiglu(s, need)


def check_plain_swiglu(s: ModelSpec, need: Need) -> None:
    """A family whose MLPs are plain SwiGLU routed by the router: no clamp, no hashed layers."""
    need(s.moe.swiglu_limit == 0, "moe.swiglu_limit", s.moe.swiglu_limit, f"0 for family {s.family}")
    need(not s.moe.hash_layers, "moe.hash_layers", list(s.moe.hash_layers), f"none for family {s.family}")
