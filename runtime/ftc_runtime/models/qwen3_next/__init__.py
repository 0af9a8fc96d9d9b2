"""The Qwen3-Next / Qwen3.5-MoE hybrid families: Gated DeltaNet and gated full attention, (1 + w)
norms, a shared expert. Until their own tool-call format is parsed, they write Qwen3's."""

from ftc_runtime.models.base import Family
from ftc_runtime.models.qwen3_next.decode import HybridDecodeGraphs
from ftc_runtime.models.qwen3_next.loader import (
    HybridCheckpointLayout,
    check_spec,
    dense_tensor_shapes,
    spec_from_hf,
    state_bytes,
)
from ftc_runtime.models.qwen3_next.model import Qwen3NextModel

FAMILIES = {
    name: Family(name, Qwen3NextModel, check_spec, dense_tensor_shapes, spec_from_hf, HybridCheckpointLayout,
                 HybridDecodeGraphs, "chatml_tools.jinja", "qwen", state_bytes, mtp=True)
    for name in ("qwen3_next", "qwen3_5_moe")
}
