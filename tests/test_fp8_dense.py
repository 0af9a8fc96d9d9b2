"""GLM-5.x with its dense projections kept in FP8 (`--dense-format fp8`): an FP8 release's codes and
scales are stored bit for bit, a 16-bit checkpoint's projections quantized to the nearest e4m3 of
their 128 × 128 block's scale; the engine's logits equal transformers' on the same FP8 weights; the
VRAM plan and `ftc inspect` count the bytes as stored; a family that reads no FP8, a format that
does not exist and an engine whose file disagrees with its spec are refused, naming what."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from fp8_reference import e4m3_values, quantize_fp8
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ftc.cli.main import app
from ftc.cli.options import DenseFormat
from ftc.compile.pipeline import CompileOptions, compile_engine
from ftc.compile.spec_loader import load_spec
from ftc_runtime import Engine
from ftc_runtime.artifact import ArtifactError, check_engine
from ftc_runtime.experts.vram_plan import plan_vram
from ftc_runtime.models.dense_layout import stored_bytes, stored_dense
from ftc_runtime.models.glm_moe_dsa.loader import FP8_LINEARS, dense_tensor_shapes
from ftc_runtime.spec import DENSE_FORMATS, SpecError

from families import reference_logits, rel
from hf_glm_models import VOCAB, build_glm, save_glm_checkpoint

SPECS = Path(__file__).resolve().parents[1] / "model_specs"
BLOCK = (128, 128)


def projections(spec) -> list[str]:
    return sorted(n for n, s in dense_tensor_shapes(spec).items() if len(s) == 2 and n.endswith(FP8_LINEARS))


def dequantized(codes: np.ndarray, scale_inv: np.ndarray) -> torch.Tensor:
    """e4m3 codes decoded from their bits, times their block's scale, in fp32 (no rounding after)."""
    n, k = codes.shape
    scales = np.repeat(np.repeat(scale_inv, BLOCK[0], 0)[:n], BLOCK[1], 1)[:, :k]
    return torch.from_numpy(e4m3_values()[codes] * scales)


def nearest_e4m3(x: np.ndarray) -> np.ndarray:
    """The code of the e4m3 value nearest each x (|x| ≤ 448), ties to the even code, with x's sign."""
    values = e4m3_values()[:127]  # the non-negative finite codes 0x00-0x7E, in order
    dist = np.abs(np.abs(x).reshape(-1, 1).astype(np.float64) - values.astype(np.float64))
    tied = dist == dist.min(axis=1, keepdims=True)
    even = tied & (np.arange(127) % 2 == 0)
    pick = np.where(even.any(axis=1), even.argmax(axis=1), tied.argmax(axis=1))
    return (pick | np.where(np.signbit(x.reshape(-1)), 0x80, 0)).reshape(x.shape).astype(np.uint8)


def glm_fp8_checkpoint(tmp_path: Path, seed: int):
    """A tiny GLM checkpoint whose dense projections are an FP8 release's (codes and 128 × 128 block
    scales) and the transformers model carrying the same weights decoded in fp32."""
    model = build_glm(seed)
    ckpt = save_glm_checkpoint(model, tmp_path / "ckpt", "fused")
    spec, _ = load_spec(ckpt)
    state, params, rng = load_file(str(ckpt / "model.safetensors")), dict(model.named_parameters()), \
        np.random.default_rng(seed)
    codes = {}
    for name in projections(spec):
        c, scale_inv = quantize_fp8(state[name], BLOCK, rng)
        state[name] = torch.from_numpy(c).view(torch.float8_e4m3fn)
        state[name.removesuffix(".weight") + ".weight_scale_inv"] = torch.from_numpy(scale_inv)
        codes[name] = (c, scale_inv)
        with torch.no_grad():
            params[name].copy_(dequantized(c, scale_inv))
    save_file(state, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt, model, codes


def test_an_fp8_release_keeps_its_codes_and_matches_transformers(tmp_path, seed):
    """The engine stores the checkpoint's codes and scales as they are (an FP8 release's default;
    `dense_format` bf16 dequantizes them); on the CPU its logits over a prompt, whole and as
    one-token steps, equal transformers' with the FP8 weights decoded."""
    ckpt, model, codes = glm_fp8_checkpoint(tmp_path, seed)
    assert load_spec(ckpt)[0].dense_format == "fp8"
    assert load_spec(ckpt, ["dense_format=bf16"])[0].dense_format == "bf16"
    engine_dir = compile_engine(CompileOptions(source=ckpt, target="cpu", output=tmp_path / "engine"))
    dense = load_file(str(engine_dir / "dense.safetensors"))
    for name, (c, scale_inv) in codes.items():
        assert dense[name].dtype == torch.float8_e4m3fn and np.array_equal(dense[name].view(torch.uint8).numpy(), c)
        assert torch.equal(dense[name.removesuffix(".weight") + ".weight_scale_inv"], torch.from_numpy(scale_inv))
    assert dense["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16  # the router is no projection
    assert dense["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16
    rng = random.Random(seed)
    ids = [rng.randrange(VOCAB) for _ in range(rng.randrange(20, 60))]
    want = reference_logits(model, ids)
    engine = Engine.load(engine_dir)
    assert rel(engine.logits(ids), want) < 1e-4, f"seed {seed}"
    cache = engine.model.new_cache()
    engine.model.forward(torch.tensor(ids[:-3]), cache)
    got = torch.cat([engine.model.forward(torch.tensor([t]), cache) for t in ids[-3:]])
    assert rel(got, want[-3:]) < 1e-4, f"seed {seed}"


def test_a_16_bit_checkpoint_is_quantized_to_the_nearest_e4m3_of_its_block(tmp_path, seed):
    """From bf16 weights: each block's scale is its largest magnitude over 448, each code the e4m3
    nearest weight / scale (an independent search over the 256 codes' values)."""
    ckpt = save_glm_checkpoint(build_glm(seed), tmp_path / "ckpt", "fused")
    engine_dir = compile_engine(CompileOptions(source=ckpt, target="cpu", output=tmp_path / "engine",
                                               overrides=("dense_format=fp8",)))
    dense, source = load_file(str(engine_dir / "dense.safetensors")), load_file(str(ckpt / "model.safetensors"))
    spec, _ = load_spec(ckpt)
    for name in projections(spec):
        w = source[name].float().numpy()
        assert w.shape[0] <= BLOCK[0] and w.shape[1] <= BLOCK[1], "the tiny model's matrices are one block each"
        scale = np.float32(np.abs(w).max()) / np.float32(448)
        got_scale = dense[name.removesuffix(".weight") + ".weight_scale_inv"]
        assert got_scale.shape == (1, 1) and np.float32(got_scale.item()) == scale, name
        want = nearest_e4m3(w / scale)
        assert np.array_equal(dense[name].view(torch.uint8).numpy(), want), f"{name}, seed {seed}"


def test_the_plan_and_inspect_count_fp8_projections_as_stored(tmp_path, seed):
    """An engine's dense tensors take the bytes `stored_dense` counts, fewer than bf16's by the
    projections' halves less their scales, and a budget gives the difference to expert slots; `ftc
    inspect` of the engine and of the spec says which format and shows the other."""
    engine_dir = compile_engine(CompileOptions(source=SPECS / "glm-5-tiny.yaml", target="cpu", random_weights=True,
                                               seed=seed, output=tmp_path / "engine",
                                               overrides=("dense_format=fp8",)))
    spec = check_engine(engine_dir).manifest.spec
    dense = load_file(str(engine_dir / "dense.safetensors"))
    stored = stored_dense(spec)
    assert stored_bytes(stored) == sum(t.numel() * t.element_size() for t in dense.values())
    bf16 = stored_dense(load_spec(SPECS / "glm-5-tiny.yaml")[0])
    saved = sum(n * k - 4 * -(-n // 128) * -(-k // 128) for n, k in (stored[p][0] for p in projections(spec)))
    assert stored_bytes(bf16) - stored_bytes(stored) == saved > 0
    stride = spec.expert_bytes
    pool = len(spec.moe_layers) * spec.moe.num_experts
    rest = plan_vram(spec, stored_bytes(bf16), 1 << 40, stride, pool, 64)
    budget = stored_bytes(bf16) + rest.kv + rest.workspace + 10 * stride
    a, b = (plan_vram(spec, stored_bytes(s), budget, stride, pool, 64) for s in (bf16, stored))
    assert b.dense == stored_bytes(stored) and b.n_slots == min(pool, a.n_slots + saved // stride)
    r = CliRunner().invoke(app, ["inspect", str(engine_dir), "--vram-budget", "1GiB"], terminal_width=200)
    assert r.exit_code == 0 and "non-expert weights (fp8)" in r.output, r.output
    r = CliRunner().invoke(app, ["inspect", str(SPECS / "glm-5.2.yaml"), "--target", "rtx-pro-6000", "--vram-budget",
                                 "96GiB", "--dense-format", "fp8"], terminal_width=200)
    assert r.exit_code == 0 and "non-expert weights (fp8)" in r.output and "with --dense-format bf16" in r.output


def test_a_dense_file_that_disagrees_with_its_format_is_refused(tmp_path, seed):
    """A projection stored in bf16 where the spec says fp8 names the tensor and both layouts."""
    engine_dir = compile_engine(CompileOptions(source=SPECS / "glm-5-tiny.yaml", target="cpu", random_weights=True,
                                               seed=seed, output=tmp_path / "engine",
                                               overrides=("dense_format=fp8",)))
    path = engine_dir / "dense.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors[name] = tensors[name].float().to(torch.bfloat16)
    save_file(tensors, str(path), metadata={"format": "pt"})
    manifest = json.loads((engine_dir / "engine.json").read_text())
    manifest["files"]["dense.safetensors"] |= _described(path)
    (engine_dir / "engine.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=rf"tensor {name}: BF16 .* expected F8_E4M3 .*dense_format fp8"):
        Engine.load(engine_dir)


def _described(path: Path) -> dict:
    import hashlib

    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("spec_name,value,message", [
    ("qwen3-30b-a3b.yaml", "fp8", "dense_format.*'fp8'.*bf16 for family qwen3_moe"),
    ("glm-5-tiny.yaml", "int8", "dense_format.*'int8'.*one of bf16, fp8"),
])
def test_a_dense_format_the_family_cannot_read_is_refused(spec_name, value, message):
    with pytest.raises(SpecError, match=message):
        load_spec(SPECS / spec_name, [f"dense_format={value}"])


def test_the_cli_dense_formats_are_the_specs():
    assert [f.value for f in DenseFormat] == list(DENSE_FORMATS)


def test_a_gpu_without_fp8_conversion_is_refused_naming_the_way_out(monkeypatch):
    """Before Ada (compute capability 8.9) Triton has no e4m3 conversion: an engine of FP8
    projections is refused there, saying to compile with --dense-format bf16; bf16 loads."""
    from ftc_runtime import engine as engine_module

    monkeypatch.setattr(engine_module, "has_fp8_conversion", lambda device: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    fp8 = load_spec(SPECS / "glm-5-tiny.yaml", ["dense_format=fp8"])[0]
    with pytest.raises(ValueError, match=r"compute capability 8.6.*--dense-format bf16"):
        engine_module._check_fp8_device(fp8, torch.device("cuda"))
    engine_module._check_fp8_device(load_spec(SPECS / "glm-5-tiny.yaml")[0], torch.device("cuda"))
    engine_module._check_fp8_device(fp8, torch.device("cpu"))


def test_compile_takes_the_dense_format_from_its_option(tmp_path, seed):
    """`ftc compile --dense-format fp8` on a spec: the engine's spec says fp8, and inspect shows it."""
    out = tmp_path / "engine"
    r = CliRunner().invoke(app, ["compile", str(SPECS / "glm-5-tiny.yaml"), "--random-weights", "--seed", str(seed),
                                 "--target", "cpu", "--dense-format", "fp8", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert check_engine(out).manifest.spec.dense_format == "fp8"
    r = CliRunner().invoke(app, ["compile", str(SPECS / "glm-5-tiny.yaml"), "--random-weights", "--dense-format",
                                 "fp4", "-o", str(tmp_path / "other")])
    assert r.exit_code == 2 and "--dense-format" in r.output
