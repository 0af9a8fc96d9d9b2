"""The block-scaled FP8 linear layer (`ftc_runtime.models.layers.fp8_linear`) against an
independent reference: e4m3 codes decoded from their bits in numpy, times their block's scale,
in fp32 (rounded once, as the layer's dequantization) or fp64 (a product's reference). Shapes
that the blocks cover partially, 128 × 128 blocks as the FP8 releases store them, narrow and
single-row blocks; malformed weights are refused naming the field. The gemv kernel itself runs
in tests/interpreted_kernels.py (check_fp8_gemv) and, on a GPU, in the `gpu` test here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fp8_reference import e4m3_values

from ftc_runtime.models.layers.fp8_gemv_kernel import MAX_ROWS, fp8_linear_gpu
from ftc_runtime.models.layers.fp8_linear import GEMV_ROWS, BlockFp8, linear

BLOCKS = [(128, 128), (64, 32), (1, 16), (3, 96), (5, 7)]
SHAPES = [(1, 16), (7, 200), (130, 300), (257, 129)]


def random_weight(n: int, k: int, block: tuple[int, int], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random e4m3 codes [n, k] (every code but the two NaNs) and fp32 block scales spanning a
    few octaves, as uint8 and float32 arrays."""
    codes = rng.integers(0, 256, (n, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    scales = (2.0 ** rng.uniform(-12, -4, (-(-n // block[0]), -(-k // block[1])))).astype(np.float32)
    return codes, scales


def as_block_fp8(codes: np.ndarray, scales: np.ndarray, block: tuple[int, int]) -> BlockFp8:
    return BlockFp8(torch.from_numpy(codes).view(torch.float8_e4m3fn), torch.from_numpy(scales), block)


def reference(codes: np.ndarray, scales: np.ndarray, block: tuple[int, int], dtype: type) -> np.ndarray:
    """codes' values × their block's scale in `dtype` (np.float32 or np.float64)."""
    n, k = codes.shape
    expanded = np.repeat(np.repeat(scales, block[0], 0)[:n], block[1], 1)[:, :k]
    return e4m3_values().astype(dtype)[codes] * expanded.astype(dtype)


@pytest.mark.parametrize("block", BLOCKS)
def test_dequantize_equals_the_reference_bit_for_bit(block, seed):
    rng = np.random.default_rng(seed)
    for n, k in SHAPES:
        codes, scales = random_weight(n, k, block, rng)
        w = as_block_fp8(codes, scales, block)
        want = torch.from_numpy(reference(codes, scales, block, np.float32))
        assert torch.equal(w.dequantize(torch.float32), want), (n, k)
        assert torch.equal(w.dequantize(torch.bfloat16), want.to(torch.bfloat16)), (n, k)
        assert w.shape == (n, k) and w.nbytes == n * k + 4 * scales.size and w.device == torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", BLOCKS)
def test_linear_on_the_cpu_equals_the_fp64_product(block, dtype, seed):
    """Any leading shape of x, with and without bias, within the activation dtype's rounding of
    the terms' size (|x| · |W|ᵀ + |b|)."""
    rng, g = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for n, k in SHAPES:
        codes, scales = random_weight(n, k, block, rng)
        w = as_block_fp8(codes, scales, block)
        w64 = torch.from_numpy(reference(codes, scales, block, np.float64))
        for lead in ((), (3,), (2, 3)):
            x = torch.randn(*lead, k, generator=g).to(dtype)
            for bias in (None, torch.randn(n, generator=g).to(dtype)):
                got = linear(x, w, bias)
                want = x.double() @ w64.T + (0 if bias is None else bias.double())
                size = x.double().abs() @ w64.abs().T + (0 if bias is None else bias.double().abs())
                err = float((got.double() - want).abs().max() / size.max())
                what = f"[{n}, {k}] {block}, x {list(x.shape)} {dtype}, bias {bias is not None}: {err:.2e}"
                assert got.dtype == dtype and got.shape == (*lead, n) and err < tol, what


def test_linear_compiles_whole_and_once_for_every_weight(seed):
    """A decode function of FP8 projections (norm, linear, activation, linear with bias) traced by
    torch.compile as one graph with the gemv as the opaque `ftc::fp8_linear` op between the
    element-wise work, once for weights of the same shapes (a model's layers): no graph break, no
    recompile, and the eager result."""
    rng, g = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    graphs = []

    def record(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
        graphs.append([node.target for node in gm.graph.nodes if node.op == "call_function"])
        return gm

    def block(x: torch.Tensor, up: BlockFp8, down: BlockFp8, bias: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],))
        return linear(torch.relu(linear(h, up)), down, bias) * 2

    compiled = torch.compile(block, dynamic=False, fullgraph=True, backend=record)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for layer in range(3):
            up, down = (as_block_fp8(*random_weight(n, k, (128, 128), rng), (128, 128))
                        for n, k in ((96, 200), (200, 96)))
            x, bias = torch.randn(2, 200, generator=g), torch.randn(200, generator=g)
            assert torch.equal(compiled(x, up, down, bias), block(x, up, down, bias)), f"layer {layer}"
    assert len(graphs) == 1 and graphs[0].count(torch.ops.ftc.fp8_linear.default) == 2, graphs


def test_linear_of_a_plain_weight_is_f_linear(seed):
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(2, 3, 24, generator=g), torch.randn(5, 24, generator=g), torch.randn(5, generator=g)
    assert torch.equal(linear(x, w, b), torch.nn.functional.linear(x, w, b))
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))


def test_to_moves_codes_and_scales(seed):
    codes, scales = random_weight(9, 40, (4, 16), np.random.default_rng(seed))
    w = as_block_fp8(codes, scales, (4, 16))
    moved = w.to("cpu")
    assert moved is not w and moved.block == (4, 16)
    assert torch.equal(moved.codes.view(torch.uint8), w.codes.view(torch.uint8))
    assert torch.equal(moved.scale_inv, w.scale_inv)


@pytest.mark.parametrize("case,message", [
    ("codes_dtype", r"BlockFp8.codes is torch.bfloat16 \[8, 32\]"),
    ("codes_dim", r"BlockFp8.codes is torch.float8_e4m3fn \[256\]"),
    ("codes_strided", r"BlockFp8.codes .* \(contiguous: False\)"),
    ("scale_dtype", r"BlockFp8.scale_inv is torch.bfloat16 \[2, 2\] .* expected contiguous torch.float32 \[2, 2\]"),
    ("scale_shape", r"BlockFp8.scale_inv is torch.float32 \[2, 3\] .* expected contiguous torch.float32 \[2, 2\]"),
    ("block", r"BlockFp8.block is \(4, 0\)"),
])
def test_malformed_weights_are_refused_naming_the_field(case, message, seed):
    codes, scales = random_weight(8, 32, (4, 16), np.random.default_rng(seed))
    fp8, scale_inv, block = torch.from_numpy(codes).view(torch.float8_e4m3fn), torch.from_numpy(scales), (4, 16)
    if case == "codes_dtype":
        fp8 = fp8.float().bfloat16()
    elif case == "codes_dim":
        fp8 = fp8.reshape(-1)
    elif case == "codes_strided":
        fp8 = fp8.view(torch.uint8).T.contiguous().T.view(torch.float8_e4m3fn)
    elif case == "scale_dtype":
        scale_inv = scale_inv.bfloat16()
    elif case == "scale_shape":
        scale_inv = torch.ones(2, 3)
    else:
        block = (4, 0)
    with pytest.raises(ValueError, match=message):
        BlockFp8(fp8, scale_inv, block)


def test_wrong_shapes_of_x_are_refused_with_the_shapes(seed):
    codes, scales = random_weight(8, 32, (4, 16), np.random.default_rng(seed))
    w = as_block_fp8(codes, scales, (4, 16))
    with pytest.raises(ValueError, match=r"x \[3, 31\] does not end in the FP8 weight \[8, 32\]"):
        linear(torch.zeros(3, 31), w)
    with pytest.raises(ValueError, match=r"fp8_linear_gpu: x must be contiguous \[1 ≤ T ≤ 16, 32\] .* not \[32\]"):
        fp8_linear_gpu(torch.zeros(32), w.codes, w.scale_inv, w.block)
    with pytest.raises(ValueError, match=r"not \[2, 32\] with strides \[1, 2\]"):
        fp8_linear_gpu(torch.zeros(32, 2).T, w.codes, w.scale_inv, w.block)
    with pytest.raises(ValueError, match=r"not \[17, 32\]"):
        fp8_linear_gpu(torch.zeros(GEMV_ROWS + 1, 32), w.codes, w.scale_inv, w.block)


@pytest.mark.gpu
@pytest.mark.parametrize("block", BLOCKS)
def test_dequantize_on_the_gpu_equals_the_reference_bit_for_bit(block, seed):
    rng = np.random.default_rng(seed)
    for n, k in [*SHAPES, (1536, 7168)]:
        codes, scales = random_weight(n, k, block, rng)
        w = as_block_fp8(codes, scales, block).to("cuda")
        want = torch.from_numpy(reference(codes, scales, block, np.float32))
        assert torch.equal(w.dequantize(torch.float32).cpu(), want), (n, k)
        assert torch.equal(w.dequantize(torch.bfloat16).cpu(), want.to(torch.bfloat16)), (n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_on_the_gpu_equals_the_fp64_product(dtype, seed):
    """The gemv (decode rows) and the dequantized GEMM (a prompt's rows) on the device."""
    rng, g = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for block in BLOCKS:
        for n, k in [*SHAPES, (1536, 7168)]:
            codes, scales = random_weight(n, k, block, rng)
            w = as_block_fp8(codes, scales, block).to("cuda")
            w64 = torch.from_numpy(reference(codes, scales, block, np.float64))
            for lead in ((k,), (3, k), (2, GEMV_ROWS // 2, k), (GEMV_ROWS + 1, k)):
                x = torch.randn(*lead, generator=g).to(dtype)
                bias = torch.randn(n, generator=g).to(dtype)
                got = linear(x.cuda(), w, bias.cuda()).cpu()
                want = x.double() @ w64.T + bias.double()
                size = x.double().abs() @ w64.abs().T + bias.double().abs()
                err = float((got.double() - want).abs().max() / size.max())
                what = f"[{n}, {k}] {block}, x {list(x.shape)} {dtype}: {err:.2e}"
                assert got.dtype == dtype and got.shape == (*lead[:-1], n) and err < tol, what


def test_linear_sends_the_kernel_only_the_rows_it_takes():
    assert GEMV_ROWS == MAX_ROWS
