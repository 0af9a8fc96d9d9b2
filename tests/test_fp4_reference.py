"""Self-checks of the test-side MXFP4 / NVFP4 reference (fp4_reference) and of the quantized
checkpoints written with it (fp4_checkpoints): e4m3 against torch's float8_e4m3fn, E2M1 rounding
ties, nibble packing, quantization error, and experts read back from every layout bit for bit."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fp4_checkpoints import (
    FORMAT_OF,
    FP4_INTERMEDIATE,
    LAYOUTS,
    reference_experts,
    save_quantized_checkpoint,
    widen_experts,
)
from fp4_reference import (
    E2M1,
    dequantize_mxfp4,
    dequantize_nvfp4,
    e4m3_to_float,
    float_to_e4m3,
    pack_nibbles,
    quantize_mxfp4,
    quantize_nvfp4,
    round_e2m1,
    unpack_nibbles,
)
from hf_hybrid_models import build_hybrid
from hf_models import TinyShape, build_model

FINITE_E4M3 = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)


def torch_e4m3(x: np.ndarray) -> np.ndarray:
    """torch's float32 → float8_e4m3fn bytes."""
    return torch.from_numpy(np.asarray(x, np.float32)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def test_e4m3_decode_and_round_trip_all_codes():
    assert len(FINITE_E4M3) == 254
    ours = e4m3_to_float(np.arange(256, dtype=np.uint8))
    theirs = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(ours, theirs)  # NaN at 0x7F and 0xFF in both
    assert np.isnan(ours[[0x7F, 0xFF]]).all() and ours[0x7E] == 448 and ours[1] == 2.0 ** -9
    np.testing.assert_array_equal(float_to_e4m3(e4m3_to_float(FINITE_E4M3)), FINITE_E4M3)


def test_e4m3_encode_matches_torch(seed):
    rng = np.random.default_rng(seed)
    grid = e4m3_to_float(np.arange(127, dtype=np.uint8)).astype(np.float64)
    mids = (grid[:-1] + grid[1:]) / 2  # every tie
    logs = rng.uniform(-14, np.log2(448), 4000)
    x = np.concatenate([mids, 2.0 ** logs, grid, [0.0, 448.0, 2.0 ** -11, 3 * 2.0 ** -11]]).astype(np.float32)
    x = np.concatenate([x, -x])
    np.testing.assert_array_equal(float_to_e4m3(x), torch_e4m3(x))
    with pytest.raises(ValueError):
        float_to_e4m3(np.float32([449.0]))


def test_round_e2m1_ties_and_signs():
    q = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, 0.3, 2.6, 7, 100])
    np.testing.assert_array_equal(E2M1[round_e2m1(q)], [0, 1, 1, 2, 2, 4, 4, .5, 3, 6, 6])
    np.testing.assert_array_equal(round_e2m1(-q), round_e2m1(q) | 8)
    np.testing.assert_array_equal(round_e2m1(np.float32([-0.1, -0.0, 0.0])), [8, 0, 0])
    np.testing.assert_array_equal(round_e2m1(E2M1), np.r_[np.arange(8), 0, np.arange(9, 16)])  # -0.0 → 0


def test_pack_unpack_inverse(seed):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, (5, 12), dtype=np.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (5, 6) and packed[0, 0] == codes[0, 0] | (codes[0, 1] << 4)
    np.testing.assert_array_equal(unpack_nibbles(packed), codes)
    np.testing.assert_array_equal(pack_nibbles(unpack_nibbles(packed)), packed)


def test_mxfp4_scales_and_exact_values():
    w = np.zeros((2, 64), np.float32)
    w[0, :32] = E2M1[:8].repeat(4) * 2.0 ** -3  # amax 6 · 2^-3: scale 2^-3, every value on the grid
    w[1, :32] = 1.0  # amax 1 = 0.5 · 2^1: byte 1 - 1 - 2 + 127
    packed, scales = quantize_mxfp4(w)
    np.testing.assert_array_equal(scales, [[124, 0], [125, 0]])
    np.testing.assert_array_equal(dequantize_mxfp4(packed, scales), w)
    assert dequantize_mxfp4(np.zeros((1, 16), np.uint8), np.zeros((1, 1), np.uint8)).dtype == np.float32


def test_nvfp4_zero_blocks_and_scales():
    w = np.zeros((2, 32), np.float32)
    packed, scales, ts = quantize_nvfp4(w)
    assert ts == 1 and not packed.any() and not scales.any()
    w[0, :16] = -3.0
    w[1, 16] = -1e-6  # its block's scale rounds to 0 in e4m3: codes 0, no sign
    packed, scales, ts = quantize_nvfp4(w)
    assert ts == np.float32(np.float32(3) / np.float32(2688)) and e4m3_to_float(scales[0, 0]) == 448
    assert scales[1, 1] == 0 and not unpack_nibbles(packed)[1].any()
    np.testing.assert_array_equal(dequantize_nvfp4(packed, scales, ts)[0], w[0])


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_quantization_error_bounded(seed, fmt):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((24, 128)) * 2.0 ** rng.uniform(-8, 4, (24, 1))).astype(np.float32)
    if fmt == "mxfp4":
        deq, block = dequantize_mxfp4(*quantize_mxfp4(w)), 32
    else:
        deq, block = dequantize_nvfp4(*quantize_nvfp4(w)), 16
    assert deq.dtype == np.float32 and deq.shape == w.shape
    err = np.abs(deq - w).reshape(24, -1, block).max(-1)
    amax = np.abs(w).reshape(24, -1, block).max(-1)
    assert (err <= 0.25 * amax).all(), float((err / amax).max())


def _check_read_back(model: torch.nn.Module, directory, layout: str, nested: bool) -> None:
    """The experts read back from the files equal the model's overwritten parameters bit for bit."""
    state = model.state_dict()
    experts = reference_experts(directory, layout)
    fused = [k for k in state if k.endswith("mlp.experts.gate_up_proj")]
    assert len(experts) == sum(state[k].shape[0] for k in fused)
    for name, (gate, up, down) in experts.items():
        prefix, j = name.rsplit(".", 1)
        if nested:
            prefix = prefix.replace("model.language_model.", "model.", 1)
        gate_up = state[prefix + ".gate_up_proj"][int(j)].numpy()
        down_ref = state[prefix + ".down_proj"][int(j)].numpy()
        np.testing.assert_array_equal(np.concatenate([gate, up]).view(np.uint32), gate_up.view(np.uint32))
        np.testing.assert_array_equal(down.view(np.uint32), down_ref.view(np.uint32))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantized_checkpoint_reads_back(seed, layout, tmp_path):
    model = build_model(TinyShape(), seed)
    original = model.model.layers[0].mlp.experts.down_proj.detach().clone()
    directory = save_quantized_checkpoint(model, tmp_path / "ckpt", layout)
    quantized = model.model.layers[0].mlp.experts.down_proj.detach()
    assert not torch.equal(original, quantized) and (quantized - original).abs().max() < 0.25 * original.abs().max()
    _check_read_back(model, directory, layout, nested=False)
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["quantization_config"]["quant_method"]
    assert FORMAT_OF[layout] in ("mxfp4", "nvfp4")
    assert (directory / "hf_quant_config.json").exists() == (layout == "nvfp4_modelopt")
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.parametrize("layout", ["mxfp4_gptoss", "nvfp4_ct"])
def test_quantized_hybrid_nested_reads_back(seed, layout, tmp_path):
    model = build_hybrid("qwen3_5_moe", seed)
    directory = save_quantized_checkpoint(model, tmp_path / "ckpt", layout, nested=True)
    _check_read_back(model, directory, layout, nested=True)
    config = json.loads((directory / "config.json").read_text())
    assert config["text_config"]["num_experts"] == 8 and "quantization_config" in config


def test_widened_hybrid_experts_run_and_read_back(seed, tmp_path):
    """widen_experts redraws the hybrid's routed experts at the intermediate size the 4-bit formats
    need (bf16 values, the config saying the size): the model runs, and its quantized checkpoint
    reads back bit for bit."""
    model = widen_experts(build_hybrid("qwen3_5_moe", seed), seed)
    experts = model.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (8, 2 * FP4_INTERMEDIATE, 64)
    assert tuple(experts.down_proj.shape) == (8, 64, FP4_INTERMEDIATE)
    assert torch.equal(experts.down_proj, experts.down_proj.to(torch.bfloat16).float())
    directory = save_quantized_checkpoint(model, tmp_path / "ckpt", "nvfp4_modelopt")
    _check_read_back(model, directory, "nvfp4_modelopt", nested=False)
    assert json.loads((directory / "config.json").read_text())["moe_intermediate_size"] == FP4_INTERMEDIATE
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
