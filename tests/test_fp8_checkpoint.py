"""Block-scaled FP8 checkpoints (DeepSeek-V3's and GLM-5's FP8 releases: `X.weight` e4m3 with
`X.weight_scale_inv` per block of `weight_block_size`): every FP8 weight, dense and routed
experts alike, compiles to the bf16 that an independent numpy decoding of e4m3 times the block's
scale gives, rounded to nearest; modules the settings exclude stay as stored; malformed scales
and settings are refused naming the tensor or the field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from fp8_reference import quantize_fp8, reference_dequantize
from safetensors.torch import load_file, save_file

from ftc.compile.pipeline import CompileOptions, compile_engine
from ftc_runtime.artifact import EXPERTS_FILE
from ftc_runtime.io import ftw

from hf_models import TinyShape, build_model, save_checkpoint

NOT_CONVERTED = ("lm_head", "mlp.gate")  # the router and the head stay bf16, as in the releases


def fp8_checkpoint(tmp_path: Path, seed: int, block: tuple[int, int]) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny Qwen3-MoE checkpoint (per-expert layout) with every linear weight but the excluded
    ones in block-scaled FP8, and each such weight's reference bf16."""
    ckpt = save_checkpoint(build_model(TinyShape(), seed), tmp_path / "ckpt", "per_expert", 1)
    path = ckpt / "model.safetensors"
    state, refs = load_file(str(path)), {}
    rng = np.random.default_rng(seed)
    for name in [n for n, t in state.items() if n.endswith("proj.weight") and t.dim() == 2]:
        if any(x in name for x in NOT_CONVERTED):
            continue
        codes, scale_inv = quantize_fp8(state[name], block, rng)
        state[name] = torch.from_numpy(codes).view(torch.float8_e4m3fn)
        state[name.removesuffix(".weight") + ".weight_scale_inv"] = torch.from_numpy(scale_inv)
        refs[name] = reference_dequantize(codes, scale_inv, block)
    save_file(state, str(path), metadata={"format": "pt"})
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), "modules_to_not_convert": list(NOT_CONVERTED)}
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt, refs


def compile_cpu(ckpt: Path, out: Path) -> Path:
    return compile_engine(CompileOptions(source=ckpt, target="cpu", output=out))


@pytest.mark.parametrize("block", [(128, 128), (16, 8)])
def test_fp8_weights_compile_to_the_reference_dequantization(block, seed, tmp_path):
    """Dense weights in dense.safetensors and each expert's FTW rows (bf16 format) equal the
    reference's bf16 of e4m3 × scale, bit for bit; 128 × 128 blocks cover the tiny matrices
    partially, 16 × 8 blocks tile them."""
    ckpt, refs = fp8_checkpoint(tmp_path, seed, block)
    engine = compile_cpu(ckpt, tmp_path / "engine")
    dense = load_file(str(engine / "dense.safetensors"))
    pool = ftw.load(engine / EXPERTS_FILE, direct=False)
    shape = TinyShape()
    for name, ref in refs.items():
        if ".experts." not in name:
            assert torch.equal(dense[name], ref), name
    for layer in range(shape.layers):
        for e in range(shape.experts):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            rows = pool.header.rows(pool.experts[layer * shape.experts + e])
            want_gate_up = torch.cat([refs[p + "gate_proj.weight"], refs[p + "up_proj.weight"]])
            assert torch.equal(rows["gate_up"].view(torch.bfloat16).reshape(want_gate_up.shape), want_gate_up), p
            assert torch.equal(rows["down"].view(torch.bfloat16).reshape(shape.hidden, shape.intermediate),
                               refs[p + "down_proj.weight"]), p
    assert "model.layers.0.mlp.gate.weight" in dense  # excluded: read as stored


@pytest.mark.parametrize("case,message", [
    ("scale_shape", r"weight_scale_inv is torch.float32 \[1, 2\], expected float32 \[1, 1\]"),
    ("nan_scale", r"weight_scale_inv has NaN or Inf scales"),
    ("block", r"config.json: quantization_config.weight_block_size = \[128\]"),
    ("fmt", r"config.json: quantization_config.fmt = 'e5m2'"),
])
def test_malformed_fp8_checkpoints_are_refused_naming_the_tensor_or_field(case, message, seed, tmp_path):
    ckpt, _ = fp8_checkpoint(tmp_path, seed, (64, 128))
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    if case in ("scale_shape", "nan_scale"):
        path = ckpt / "model.safetensors"
        state = load_file(str(path))
        state[name] = torch.ones(1, 2) if case == "scale_shape" else torch.full_like(state[name], float("nan"))
        save_file(state, str(path), metadata={"format": "pt"})
    else:
        config = json.loads((ckpt / "config.json").read_text())
        config["quantization_config"]["weight_block_size" if case == "block" else "fmt"] = (
            [128] if case == "block" else "e5m2")
        (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        compile_cpu(ckpt, tmp_path / "engine")
