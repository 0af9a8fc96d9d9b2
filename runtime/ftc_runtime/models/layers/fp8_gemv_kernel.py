"""The Triton kernels of `fp8_linear`'s FP8 weights (e4m3 codes, one fp32 scale per bn × bk block):
a decode step's gemv (one row, a read of the codes and their scales), the same product for up to
`MAX_ROWS` rows (each tile of the weight dequantized once for all rows, on the tensor cores), and
the whole weight dequantized for a prompt's GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # rows of x one call multiplies: a tensor-core tile's


@triton.jit
def _dequantized_tile(row_codes, row_scales, n_ok, k0, K: tl.constexpr, BK: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP: tl.constexpr):
    """Columns k0 … k0 + BLOCK_K of a program's rows of the weight in fp32, [rows, BLOCK_K / GROUP,
    GROUP], and their columns [BLOCK_K / GROUP, GROUP]. GROUP (a power of 2 that divides BK) columns
    from a multiple of GROUP lie in one block: their scale is loaded once, not once per element."""
    g = k0 + tl.arange(0, BLOCK_K // GROUP) * GROUP
    kk = g[:, None] + tl.arange(0, GROUP)[None, :]
    c = tl.load(row_codes[:, None, None] + kk[None, :, :], mask=n_ok[:, None, None] & (kk < K)[None, :, :],
                other=0.0).to(tl.float32)
    s = tl.load(row_scales[:, None] + (g // BK)[None, :], mask=n_ok[:, None] & (g < K)[None, :], other=0.0)
    return c * s[:, :, None], kk


@triton.jit
def _fp8_gemv(x, codes, scale_inv, out, T, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              KB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """out[t, n] = Σ_k codes[n, k] · scale_inv[n // BN, k // BK] · x[t, k] for one row t and
    BLOCK_N rows n, in fp32 (the interpreter may make NaN of 16-bit products), rounded once to
    out's dtype."""
    # the rows of x vary fastest: the programs that read a block of the weight run together, so
    # that a weight larger than L2 is read from memory once, not once per row
    pid = tl.program_id(0)
    t = pid % T
    n = (pid // T) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    row_codes = codes + n.to(tl.int64) * K  # int64: a large weight's N · K passes 2³¹
    row_scales = scale_inv + (n // BN) * KB
    acc = tl.zeros([BLOCK_N, BLOCK_K // GROUP, GROUP], dtype=tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        w, kk = _dequantized_tile(row_codes, row_scales, n_ok, k0, K, BK, BLOCK_K, GROUP)
        acc += w * tl.load(x + t * K + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :, :]
    y = tl.sum(tl.sum(acc, 2), 1)
    tl.store(out + t * N + n, y.to(out.dtype.element_ty), mask=n_ok)


@triton.jit
def _fp8_gemm_rows(x, codes, scale_inv, out, T, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   KB: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP: tl.constexpr, PRECISION: tl.constexpr):
    """The same product for up to ROWS rows of x at once, each tile of the weight dequantized once
    for all of them and multiplied on the tensor cores (fp32 products where x is fp32)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, ROWS)
    n_ok = n < N
    row_codes = codes + n.to(tl.int64) * K
    row_scales = scale_inv + (n // BN) * KB
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K):
        w, _ = _dequantized_tile(row_codes, row_scales, n_ok, k0, K, BK, BLOCK_K, GROUP)
        kk = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x + t[:, None] * K + kk[None, :], mask=(t < T)[:, None] & (kk < K)[None, :], other=0.0)
        acc = tl.dot(xt.to(tl.float32), tl.trans(tl.reshape(w, [BLOCK_N, BLOCK_K])), acc,
                     input_precision=PRECISION)
    tl.store(out + t[:, None] * N + n[None, :], acc.to(out.dtype.element_ty), mask=(t < T)[:, None] & n_ok[None, :])


@triton.jit
def _fp8_dequantize(codes, scale_inv, out, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    KB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr):
    """BLOCK_N rows × BLOCK_K columns of the weight, dequantized into out."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w, kk = _dequantized_tile(codes + n.to(tl.int64) * K, scale_inv + (n // BN) * KB, n_ok,
                              tl.program_id(1) * BLOCK_K, K, BK, BLOCK_K, GROUP)
    tl.store(out + n.to(tl.int64)[:, None, None] * K + kk[None, :, :], w.to(out.dtype.element_ty),
             mask=n_ok[:, None, None] & (kk < K)[None, :, :])


def fp8_dequantize_gpu(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                       dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`BlockFp8.dequantize` as one kernel: each code read once and its product written once,
    where torch's formula makes and rereads [N, K] fp32 temporaries (about 10× the time on an H200)."""
    (n, k), (bn, bk) = codes.shape, block
    out = torch.empty(n, k, dtype=dtype, device=codes.device)
    block_n, block_k = 16, min(triton.next_power_of_2(k), 256)
    _fp8_dequantize[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        codes, scale_inv, out, n, K=k, BN=bn, BK=bk, KB=scale_inv.shape[1], BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP=min(bk & -bk, block_k), num_warps=4)
    return out


def fp8_gemv_blocks(n: int, k: int, t: int) -> tuple[int, int, int, int]:
    """(rows of x per program, weight rows per program, K per step, warps) for t rows of x times an
    [n, k] FP8 weight. One row: `gemv_blocks`' two weight rows per program, in steps of up to 2048
    columns (its 4 KB of a bf16 step). More rows: all of them in one program, which dequantizes a
    tile of the weight once for all rows and multiplies on the tensor cores (whose shapes start at
    16 × 16)."""
    if t == 1:
        return 1, 2, min(triton.next_power_of_2(k), 2048), 4
    return 16, 32, min(max(triton.next_power_of_2(k), 16), 128), 4


def fp8_linear_gpu(x: torch.Tensor, codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] (contiguous, T ≤ 16: a decode step's few rows) times the FP8 weight [N, K]ᵀ: [T, N]
    in x's dtype, into `out` where given."""
    n, k = codes.shape
    if x.dim() != 2 or x.shape[1] != k or not x.is_contiguous() or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"fp8_linear_gpu: x must be contiguous [1 ≤ T ≤ {MAX_ROWS}, {k}] for the weight {[n, k]}, "
                         f"not {list(x.shape)} with strides {list(x.stride())}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_linear_gpu: x is {x.dtype}, expected float32, bfloat16 or float16")
    t = x.shape[0]
    if out is None:
        out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    elif out.shape != (t, n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"fp8_linear_gpu: out must be contiguous {x.dtype} {[t, n]}, "
                         f"not {out.dtype} {list(out.shape)}")
    rows, block_n, block_k, warps = fp8_gemv_blocks(n, k, t)
    bn, bk = block
    group = min(bk & -bk, block_k)  # the largest power of 2 that divides bk: a group never straddles blocks
    shape = dict(K=k, BN=bn, BK=bk, KB=scale_inv.shape[1], BLOCK_N=block_n, BLOCK_K=block_k, GROUP=group)
    if rows == 1:
        _fp8_gemv[(t * triton.cdiv(n, block_n),)](x, codes, scale_inv, out, t, n, **shape, num_warps=warps)
    else:
        _fp8_gemm_rows[(triton.cdiv(n, block_n),)](
            x, codes, scale_inv, out, t, n, **shape, ROWS=rows,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps)
    return out
