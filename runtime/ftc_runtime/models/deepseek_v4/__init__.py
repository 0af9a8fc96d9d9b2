"""DeepSeek-V4 (transformers' deepseek_v4): compressed sparse and heavily compressed attention beside
a sliding window, hyper-connections, hash-routed first layers. The spec mapping, the checkpoint's
tensors and its released layout's names (`loader`), the decoder (`model`) over each sequence's
compressed state (`attention`, `cache`), its decode step as CUDA graphs (`decode`); the layers
are in `models/layers/`. A checkpoint brings its own chat template; an engine without one writes
DeepSeek's format (`deepseek_v4_tools.jinja`); tool calls are read in DeepSeek's DSML blocks
either way."""

from ftc_runtime.models.base import Family
from ftc_runtime.models.deepseek_v4.cache import state_bytes
from ftc_runtime.models.deepseek_v4.decode import HyperDecodeGraphs
from ftc_runtime.models.deepseek_v4.loader import (
    FP8_LINEARS,
    DeepseekV4Layout,
    check_spec,
    dense_tensor_shapes,
    spec_from_hf,
)
from ftc_runtime.models.deepseek_v4.model import DeepseekV4Model

# The tensors DeepSeek's checkpoints keep in fp32: the hyper-connections' maps (per block, and the
# head's), the attention sinks, the compressors' position terms, the router's selection bias.
FP32_TENSORS = ("hc.fn", "hc.base", "hc.scale", "hc_fn", "hc_base", "hc_scale", "sinks", "position_bias",
                "e_score_correction_bias")

# The hyper-connections, the compressors, the indexer and the sparse attention as a decode graph's
# many small kernels: DeepSeek-V4-Flash cut to 20 layers with FP8 projections on the h200 (body
# 0.3365, plan 0.011, hits 0.0781 ms per MoE layer less 0.073 of reads;
# docs/history/performance-log.md).
DECODE_FIXED_MS = 0.35

FAMILIES = {
    "deepseek_v4": Family("deepseek_v4", DeepseekV4Model, check_spec, dense_tensor_shapes, spec_from_hf,
                          DeepseekV4Layout, HyperDecodeGraphs, "deepseek_v4_tools.jinja", "deepseek", state_bytes,
                          fp8_linears=FP8_LINEARS, decode_fixed_ms=DECODE_FIXED_MS, fp32_tensors=FP32_TENSORS,
                          expert_index_tensors=("tid2eid",), mtp=True),
}
