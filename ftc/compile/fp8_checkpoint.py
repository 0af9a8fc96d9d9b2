"""Checkpoints whose linear weights are FP8 with block scales (DeepSeek-V3's and GLM-5's FP8
releases): `X.weight` float8_e4m3fn [N, K] and `X.weight_scale_inv` fp32 [⌈N/bn⌉, ⌈K/bk⌉], one
scale per block of bn × bk weights (the config's `quantization_config.weight_block_size`, 128 ×
128 in those releases), the weight being `X.weight · X.weight_scale_inv` of its block;
DeepSeek-V4's release names them `X.scale` and stores powers of two (e8m0). Modules
the settings exclude (`modules_to_not_convert`) are 16-bit and carry no scale. The compiler
dequantizes them to bf16 (the product in fp32, rounded once to nearest), the routed experts too,
which the engine's expert format then stores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ftc_runtime.models.base import CheckpointError

DEFAULT_BLOCK = (128, 128)
FP8_TYPES = (torch.float8_e4m3fn, torch.uint8)
SCALE_TYPES = (torch.float32, torch.bfloat16)
FP8_MAX = 448.0  # e4m3fn's largest finite value


def checkpoint_fp8_block(directory: Path) -> tuple[int, int]:
    """The FP8 block size that the checkpoint's config.json declares (`quant_method: fp8`), else
    128 × 128 (what a scale tensor's shape is then checked against)."""
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return DEFAULT_BLOCK
    q = config.get("quantization_config") if isinstance(config, dict) else None
    if isinstance(q, dict) and q.get("quant_method") == "fp8":
        return fp8_settings(q, directory / "config.json")
    return DEFAULT_BLOCK


def fp8_settings(q: dict[str, Any], where: Path) -> tuple[int, int]:
    """The block size of `quantization_config` q with quant_method 'fp8'; CheckpointError for
    another float format or a block that is no pair of positive integers."""
    if q.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{where}: quantization_config.fmt = {q.get('fmt')!r}: ftc reads FP8 e4m3 weights")
    block = q.get("weight_block_size", list(DEFAULT_BLOCK))
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"{where}: quantization_config.weight_block_size = {block!r}: expected two positive "
                              "integers (rows, columns of one scale's block)")
    return block[0], block[1]


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight e4m3 [N, K] times its block's scale ([⌈N/bn⌉, ⌈K/bk⌉]) in fp32, rounded to bf16."""
    n, k = weight.shape
    scales = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return (weight.view(torch.float8_e4m3fn).float() * scales).to(torch.bfloat16)


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes of a 16/32-bit weight [N, K] and one fp32 scale per block ([⌈N/bn⌉, ⌈K/bk⌉]):
    the block's largest magnitude maps to e4m3's largest, 448, each weight rounded to nearest."""
    n, k = weight.shape
    rows, cols = -(-n // block[0]), -(-k // block[1])
    padded = torch.zeros(rows * block[0], cols * block[1], dtype=torch.float32)
    padded[:n, :k] = weight.float()
    tiles = padded.view(rows, block[0], cols, block[1])
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(rows * block[0], cols * block[1])[:n, :k].contiguous(), scale_inv


def _scale_of(ckpt, name: str) -> tuple[str, torch.Tensor]:
    """The block scales beside FP8 weight `X.weight`, by name and as fp32: `X.weight_scale_inv`
    (fp32 or bf16), or DeepSeek-V4's `X.scale` (e8m0: powers of two, as torch's float8_e8m0fnu or
    as their bytes, 2^(b - 127))."""
    base = name.removesuffix(".weight")
    if f"{base}.weight_scale_inv" in ckpt or f"{base}.scale" not in ckpt:
        return f"{base}.weight_scale_inv", ckpt.raw(f"{base}.weight_scale_inv")
    scale = ckpt.raw(f"{base}.scale")
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    return f"{base}.scale", scale.float() if scale.dtype == torch.float8_e8m0fnu else scale


def read_fp8_codes(ckpt, name: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 weight `name` of a `SafetensorsCheckpoint` as stored: its e4m3 codes [N, K] and its
    fp32 scales (one per block, `_scale_of`), checked; CheckpointError naming the tensor that is
    malformed."""
    weight = ckpt.raw(name)
    scale_name, scale_inv = _scale_of(ckpt, name)
    where = ckpt.directory
    if weight.dtype not in FP8_TYPES or weight.dim() != 2:
        raise CheckpointError(f"{where}: tensor {name} is {weight.dtype} {list(weight.shape)}, expected a 2-D "
                              f"float8_e4m3fn weight beside {scale_name}")
    n, k = weight.shape
    shape = (-(-n // block[0]), -(-k // block[1]))
    if tuple(scale_inv.shape) != shape or scale_inv.dtype not in SCALE_TYPES:
        raise CheckpointError(f"{where}: tensor {scale_name} is {scale_inv.dtype} {list(scale_inv.shape)}, expected "
                              f"float32 {list(shape)} (one scale per {block[0]}×{block[1]} block of {name})")
    if not bool(torch.isfinite(scale_inv.float()).all()):
        raise CheckpointError(f"{where}: tensor {scale_name} has NaN or Inf scales")
    return weight.view(torch.float8_e4m3fn), scale_inv.float()


def read_fp8_weight(ckpt, name: str, block: tuple[int, int]) -> torch.Tensor:
    """The FP8 weight `name` (with `name`_scale_inv) of a `SafetensorsCheckpoint`, checked and
    dequantized to bf16; CheckpointError naming the tensor that is malformed."""
    out = dequantize_fp8_blocks(*read_fp8_codes(ckpt, name, block), block)
    if not bool(torch.isfinite(out).all()):
        raise CheckpointError(f"{ckpt.directory}: tensor {name} holds NaN codes or dequantizes beyond bf16's range")
    return out
