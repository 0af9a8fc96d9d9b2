"""GLM-5.x (transformers' glm_moe_dsa): latent attention made sparse by the DSA indexer, dense first
layers, sigmoid-routed experts beside a shared expert. A checkpoint brings its own chat template;
until GLM's template and tool-call format (`<arg_key>` / `<arg_value>`) are written here, an engine
without one uses ChatML and Qwen3's tool calls."""

from ftc_runtime.models.base import CheckpointLayout, Family
from ftc_runtime.models.glm_moe_dsa.loader import check_spec, dense_tensor_shapes, spec_from_hf
from ftc_runtime.models.glm_moe_dsa.model import GlmMoeDsaModel

FAMILIES = {
    "glm_moe_dsa": Family("glm_moe_dsa", GlmMoeDsaModel, check_spec, dense_tensor_shapes, spec_from_hf,
                          CheckpointLayout, None, "chatml_tools.jinja", "qwen"),
}
