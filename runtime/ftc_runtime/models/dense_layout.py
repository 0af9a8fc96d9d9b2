"""The non-expert tensors an engine stores, by checkpoint name, with their safetensors dtypes: bf16,
or where the spec's `dense_format` is fp8, the family's linear projections (`Family.fp8_linears`)
as e4m3 codes of the same shape beside `<name>_scale_inv`, one fp32 scale per 128 × 128 block, the
layout of the FP8 releases (DeepSeek-V3, GLM-5), whose codes an engine then keeps bit for bit; the
family's fp32 tensors in fp32 and its tables of expert ids in int64. The compiler writes this
layout, the engine checks and loads it, and the VRAM plan counts its bytes.
"""

from __future__ import annotations

import math

from ftc_runtime.models import family
from ftc_runtime.spec import ModelSpec

FP8_BLOCK = (128, 128)  # rows and columns of one scale's block
DTYPE_BYTES = {"BF16": 2, "F8_E4M3": 1, "F32": 4, "I64": 8}
# name → (shape, safetensors dtype)
StoredTensors = dict[str, tuple[tuple[int, ...], str]]


def scale_name(name: str) -> str:
    """The scale tensor beside FP8 weight `name` (`X.weight` → `X.weight_scale_inv`)."""
    return name.removesuffix(".weight") + ".weight_scale_inv"


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """Blocks of an [N, K] weight: one scale each."""
    return math.ceil(shape[0] / FP8_BLOCK[0]), math.ceil(shape[1] / FP8_BLOCK[1])


def fp8_names(spec: ModelSpec) -> frozenset[str]:
    """The dense weights that an engine of `spec` stores in FP8 (none unless its dense_format is fp8)."""
    if spec.dense_format != "fp8":
        return frozenset()
    fam = family(spec.family)
    return frozenset(n for n, s in fam.dense_tensor_shapes(spec).items() if len(s) == 2 and n.endswith(fam.fp8_linears))


def stored_dense(spec: ModelSpec) -> StoredTensors:
    """Every dense tensor an engine of `spec` stores, FP8 scales included."""
    fp8, fam = fp8_names(spec), family(spec.family)
    stored: StoredTensors = {}
    for name, shape in fam.dense_tensor_shapes(spec).items():
        if name in fp8:
            stored |= {name: (shape, "F8_E4M3"), scale_name(name): (scale_shape(shape), "F32")}
        elif name.endswith(fam.expert_index_tensors):
            stored[name] = (shape, "I64")
        else:
            stored[name] = (shape, "F32" if name.endswith(fam.fp32_tensors) else "BF16")
    return stored


def stored_bytes(stored: StoredTensors) -> int:
    return sum(math.prod(shape) * DTYPE_BYTES[dtype] for shape, dtype in stored.values())
