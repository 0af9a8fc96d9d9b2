"""GLM-5.x (transformers' glm_moe_dsa): latent attention made sparse by the DSA indexer, dense first
layers, sigmoid-routed experts beside a shared expert. A checkpoint brings its own chat template;
an engine without one writes GLM's format (`glm_tools.jinja`); tool calls are read in GLM's
`<arg_key>` / `<arg_value>` blocks either way."""

from ftc_runtime.models.base import Family
from ftc_runtime.models.glm_moe_dsa.decode import LatentDecodeGraphs
from ftc_runtime.models.glm_moe_dsa.loader import (
    FP8_LINEARS,
    GlmCheckpointLayout,
    check_spec,
    dense_tensor_shapes,
    spec_from_hf,
    state_bytes,
)
from ftc_runtime.models.glm_moe_dsa.model import GlmMoeDsaModel

# Latent attention's and the indexer's many small kernels, and the NVFP4 experts' hits: GLM-5.2's
# cut on the h200 with FP8 projections (body 0.2725, plan 0.0215, hits 0.1542 ms per MoE layer
# less 0.136 of reads); the bf16 cut's timeline gives 0.32
# (docs/history/performance-log.md).
DECODE_FIXED_MS = 0.31

FAMILIES = {
    "glm_moe_dsa": Family("glm_moe_dsa", GlmMoeDsaModel, check_spec, dense_tensor_shapes, spec_from_hf,
                          GlmCheckpointLayout, LatentDecodeGraphs, "glm_tools.jinja", "glm", state_bytes, FP8_LINEARS,
                          DECODE_FIXED_MS, mtp=True),
}
