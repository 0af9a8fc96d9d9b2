"""A linear layer whose weight is FP8 e4m3 with one fp32 scale per block of the weight, as the dense
weights of block-scaled FP8 checkpoints (DeepSeek-V3's, GLM-5's: 128 × 128 blocks) store them.

    W[n, k] = codes[n, k] · scale_inv[n // bn, k // bk]

Keeping such weights in FP8 on the GPU halves the bytes a decode step reads for them, and frees
VRAM for expert slots. A decode step's rows (up to `GEMV_ROWS`) run Triton kernels that read the
codes and their scales directly and accumulate in fp32: one row a gemv, several rows one program
per tile of the weight that dequantizes it once for all of them and multiplies on the tensor
cores. A prompt's many rows (and the CPU) dequantize the weight per call, one weight's temporary,
and run the GEMM that `F.linear` is. `linear` is the dispatcher that model code calls in place of
`F.linear`, for plain weights and FP8 ones alike. The kernels (`fp8_gemv_kernel`) are imported
on a GPU only: an engine on the CPU loads no Triton.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Rows of x up to which the gemv runs (a decode step's tokens, not a prompt's): the kernel's
# MAX_ROWS, not imported here, since the kernel module loads Triton.
GEMV_ROWS = 16


@dataclass(frozen=True, eq=False)  # eq=False: compared and hashed by identity, as tensors are
class BlockFp8:
    """An [N, K] weight as e4m3 codes and one fp32 scale per (bn × bk) block; the blocks at the
    right and bottom edges may be partial."""

    codes: torch.Tensor  # float8_e4m3fn [N, K], contiguous
    scale_inv: torch.Tensor  # float32 [⌈N / bn⌉, ⌈K / bk⌉], contiguous
    block: tuple[int, int]  # (bn, bk)

    def __post_init__(self) -> None:
        codes, scale_inv = self.codes, self.scale_inv
        if codes.dtype != torch.float8_e4m3fn or codes.dim() != 2 or not codes.is_contiguous():
            raise ValueError(f"BlockFp8.codes is {codes.dtype} {list(codes.shape)} (contiguous: "
                             f"{codes.is_contiguous()}), expected a contiguous 2-D torch.float8_e4m3fn tensor")
        block = tuple(self.block)
        if len(block) != 2 or not all(isinstance(b, int) and b >= 1 for b in block):
            raise ValueError(f"BlockFp8.block is {self.block!r}, expected two positive ints (bn, bk)")
        object.__setattr__(self, "block", block)
        n, k = codes.shape
        shape = (-(-n // block[0]), -(-k // block[1]))
        if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != shape or not scale_inv.is_contiguous():
            raise ValueError(f"BlockFp8.scale_inv is {scale_inv.dtype} {list(scale_inv.shape)} (contiguous: "
                             f"{scale_inv.is_contiguous()}), expected contiguous torch.float32 {list(shape)}: one "
                             f"scale per {block[0]}×{block[1]} block of codes {[n, k]}")
        if scale_inv.device != codes.device:
            raise ValueError(f"BlockFp8.scale_inv is on {scale_inv.device}, codes on {codes.device}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale_inv.nbytes

    def to(self, device: torch.device | str) -> BlockFp8:
        return BlockFp8(self.codes.to(device), self.scale_inv.to(device), self.block)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """codes × their block's scale in fp32, rounded once to `dtype`: [N, K]."""
        if self.codes.is_cuda and has_fp8_conversion(self.device):
            from ftc_runtime.models.layers.fp8_gemv_kernel import fp8_dequantize_gpu

            return fp8_dequantize_gpu(self.codes, self.scale_inv, self.block, dtype)
        (n, k), (bn, bk) = self.shape, self.block
        w = self.codes.float()
        # each row's scales, then scaled in place by whole column blocks and the partial last one,
        # so that no [N, K] tensor of scales is made
        row_scales = self.scale_inv.repeat_interleave(bn, 0)[:n]  # [N, ⌈K / bk⌉]
        whole = k // bk
        w[:, :whole * bk].view(n, whole, bk).mul_(row_scales[:, :whole, None])
        if whole * bk < k:
            w[:, whole * bk:].mul_(row_scales[:, whole:])
        return w.to(dtype)


Weight = torch.Tensor | BlockFp8  # a linear layer's weight: plain, or FP8 blocks


@functools.cache
def has_fp8_conversion(device: torch.device) -> bool:
    """Whether Triton converts e4m3 on this GPU: compute capability 8.9 (Ada) and later."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, w, bias)` for a plain weight or a `BlockFp8` one, x [..., K] → [..., N]: a
    decode step's rows through the `ftc::fp8_linear` op (the FP8 gemv on a GPU), a prompt's with the
    weight dequantized to x's dtype."""
    if not isinstance(w, BlockFp8):
        return F.linear(x, w, bias)
    n, k = w.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"linear: x {list(x.shape)} does not end in the FP8 weight {[n, k]}'s K")
    rows = x.reshape(-1, k)
    if not 0 < rows.shape[0] <= GEMV_ROWS:
        return F.linear(x, w.dequantize(x.dtype), bias)
    y = fp8_rows(rows.contiguous(), w.codes, w.scale_inv, *w.block)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], n)


# An op of its own, opaque to torch.compile: a decode graph's compiled functions (GLM's attention
# input, its indexer, the MLPs) keep their element-wise work fused around the gemv instead of
# running uncompiled for the gemv's sake.
@torch.library.custom_op("ftc::fp8_linear", mutates_args=())
def fp8_rows(x: torch.Tensor, codes: torch.Tensor, scale_inv: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """x [T ≤ GEMV_ROWS, K] (contiguous) times the FP8 weight (codes, scale_inv, (bn, bk)): [T, N] in
    x's dtype. On the CPU (and GPUs without e4m3 conversion in Triton) the weight dequantized."""
    return F.linear(x, BlockFp8(codes, scale_inv, (bn, bk)).dequantize(x.dtype))


@fp8_rows.register_kernel("cuda")
def _fp8_rows_cuda(x: torch.Tensor, codes: torch.Tensor, scale_inv: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    if not has_fp8_conversion(x.device):
        return F.linear(x, BlockFp8(codes, scale_inv, (bn, bk)).dequantize(x.dtype))
    from ftc_runtime.models.layers.fp8_gemv_kernel import fp8_linear_gpu

    return fp8_linear_gpu(x, codes, scale_inv, (bn, bk))


@fp8_rows.register_fake
def _fp8_rows_shape(x: torch.Tensor, codes: torch.Tensor, scale_inv: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], codes.shape[0])
