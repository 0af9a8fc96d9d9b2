"""GLM-5.x (transformers' glm_moe_dsa): latent attention made sparse by the DSA indexer, dense first
layers, sigmoid-routed experts beside a shared expert. A checkpoint brings its own chat template;
an engine without one writes GLM's format (`glm_tools.jinja`); tool calls are read in GLM's
`<arg_key>` / `<arg_value>` blocks either way."""

from ftc_runtime.models.base import CheckpointLayout, Family
from ftc_runtime.models.glm_moe_dsa.decode import LatentDecodeGraphs
from ftc_runtime.models.glm_moe_dsa.loader import FP8_LINEARS, check_spec, dense_tensor_shapes, spec_from_hf
from ftc_runtime.models.glm_moe_dsa.model import GlmMoeDsaModel

FAMILIES = {
    "glm_moe_dsa": Family("glm_moe_dsa", GlmMoeDsaModel, check_spec, dense_tensor_shapes, spec_from_hf,
                          CheckpointLayout, LatentDecodeGraphs, "glm_tools.jinja", "glm", FP8_LINEARS),
}
