"""Qwen3-MoE: GQA attention with q/k norms, a softmax top-k router, routed experts only."""

from ftc_runtime.models.base import CheckpointLayout, Family, gqa_state_bytes
from ftc_runtime.models.qwen3_moe.decode import AttentionDecodeGraphs
from ftc_runtime.models.qwen3_moe.loader import check_spec, dense_tensor_shapes, spec_from_hf
from ftc_runtime.models.qwen3_moe.model import Qwen3MoeModel

FAMILIES = {
    "qwen3_moe": Family("qwen3_moe", Qwen3MoeModel, check_spec, dense_tensor_shapes, spec_from_hf,
                        CheckpointLayout, AttentionDecodeGraphs, "chatml_tools.jinja", "qwen",
                        gqa_state_bytes),
}
