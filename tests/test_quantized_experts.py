"""Engines with 4-bit routed experts (mxfp4, nvfp4), held to the independent numpy reference
(fp4_reference, fp4_checkpoints) bit for bit: a 4-bit checkpoint of each producer's layout is
repacked, never requantized; `--quant` rounds 16-bit weights as the reference does; every
malformed checkpoint is refused with a message naming the tensor; the CLI compiles and inspects
such an engine."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from ftc.cli.main import app
from ftc.cli.options import ExpertQuant
from ftc.compile.pipeline import CompileOptions, compile_engine
from ftc.compile.spec_loader import load_spec
from ftc_runtime import Engine
from ftc_runtime.artifact import EXPERTS_FILE, MANIFEST
from ftc_runtime.formats import FORMATS, expert_format
from ftc_runtime.io import ftw
from ftc_runtime.spec import ModelSpec

from fp4_checkpoints import FORMAT_OF, FP4_INTERMEDIATE, LAYOUTS, quantize, reference_experts, save_quantized_checkpoint
from fp4_reference import (
    E2M1,
    checkpoint_packing,
    checkpoint_scale_packing,
    dequantize_mxfp4,
    dequantize_nvfp4,
    ftw_packing,
    ftw_scale_packing,
)
from hf_models import TinyShape, build_model, save_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TINY_SPEC = ROOT / "model_specs" / "qwen3-moe-tiny.yaml"
SHAPE = TinyShape(intermediate=FP4_INTERMEDIATE)  # hidden 64: both multiples of 64
FP4 = ("mxfp4", "nvfp4")
BLOCK = {"mxfp4": 32, "nvfp4": 16}
SCALE_DTYPE = {"mxfp4": "ue8m0", "nvfp4": "e4m3"}


# -- helpers -------------------------------------------------------------------------------------------


def compile_cpu(source: Path, out: Path, **options) -> Path:
    """The AVX2 engine of a checkpoint or spec."""
    return compile_engine(CompileOptions(source=source, target="cpu", output=out, **options))


def spec_of(engine: Path) -> dict:
    return json.loads((engine / MANIFEST).read_text())["spec"]


def assert_bits_equal(ours: torch.Tensor, ref: np.ndarray, what: str) -> None:
    """fp32 bit patterns equal (-0.0 and NaN count)."""
    assert tuple(ours.shape) == ref.shape, (what, tuple(ours.shape), ref.shape)
    got = ours.float().contiguous().view(torch.int32).numpy()
    want = np.ascontiguousarray(ref, np.float32).view(np.int32)
    bad = np.argwhere(got != want)
    assert not len(bad), f"{what}: {len(bad)} values differ, first at {bad[0].tolist()}"


def reference_rows(fmt: str, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> dict[str, np.ndarray]:
    """An expert's FTW bank rows as fp4_reference quantizes its float32 matrices."""
    q = {name: quantize(fmt, w) for name, w in (("gate", gate), ("up", up), ("down", down))}
    rows = {"gate_up": np.concatenate([ftw_packing(q["gate"][0]), ftw_packing(q["up"][0])]),
            "down": ftw_packing(q["down"][0]),
            "gate_up_scales": np.concatenate([ftw_scale_packing(q["gate"][1]), ftw_scale_packing(q["up"][1])]),
            "down_scales": ftw_scale_packing(q["down"][1])}
    if fmt == "nvfp4":
        rows["tensor_scales"] = np.array([q[p][2] for p in ("gate", "up", "down")], np.float32).view(np.uint8)
    return {name: r.reshape(-1) for name, r in rows.items()}


def expert_rows(pool: ftw.ExpertPool, row: int) -> dict[str, np.ndarray]:
    return {name: r.numpy() for name, r in pool.header.rows(pool.experts[row]).items()}


def moe_layer_experts(engine: Path) -> list[tuple[int, int]]:
    """(decoder layer, expert) of every FTW row, in row order."""
    spec = ModelSpec.from_dict(spec_of(engine))
    return [(layer, j) for layer in spec.moe_layers for j in range(spec.moe.num_experts)]


def check_banks(engine: Path, fmt: str) -> None:
    """The FTW header on disk names the format's banks: e2m1 codes packed 'e2m1r16', scales of the
    format's type and block packed 'r16', nvfp4's fp32 tensor scales (plain, '')."""
    raw = (engine / EXPERTS_FILE).read_bytes()[ftw.PREFIX.size:ftw.HEADER_ROOM]
    header = json.loads(raw)
    assert header["expert_format"] == fmt
    banks = {b["name"]: b for b in header["banks"]}
    h, i, block = header["hidden"], header["intermediate"], BLOCK[fmt]
    names = ["gate_up", "down", "gate_up_scales", "down_scales"] + (["tensor_scales"] if fmt == "nvfp4" else [])
    assert list(banks) == names
    for name, (rows, cols) in (("gate_up", (2 * i, h)), ("down", (h, i))):
        codes, scales = banks[name], banks[f"{name}_scales"]
        assert (codes["dtype"], codes["bits"], codes["packing"], codes["block"]) == ("e2m1", 4, "e2m1r16", block)
        assert codes["row_shape"] == [rows, cols] and codes["row_bytes"] == rows * cols // 2
        want = (SCALE_DTYPE[fmt], 8, "r16", block)
        assert (scales["dtype"], scales["bits"], scales["packing"], scales["block"]) == want
        assert scales["row_shape"] == [rows, cols // block] and scales["row_bytes"] == rows * cols // block
    if fmt == "nvfp4":
        tensor_scales = banks["tensor_scales"]
        assert (tensor_scales["dtype"], tensor_scales["packing"], tensor_scales["row_bytes"]) == ("f32", "", 12)


# -- (a) a 4-bit checkpoint is repacked bit for bit ---------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_checkpoint_experts_dequantize_to_the_reference_bit_for_bit(layout, seed, tmp_path):
    """Without --quant the engine takes the checkpoint's own format, and every FTW row dequantizes
    to exactly the values fp4_reference reads from the checkpoint's files for that expert."""
    fmt = FORMAT_OF[layout]
    ckpt = save_quantized_checkpoint(build_model(SHAPE, seed), tmp_path / "ckpt", layout)
    engine = compile_cpu(ckpt, tmp_path / "engine")
    assert spec_of(engine)["expert_format"] == fmt and load_spec(ckpt)[0].expert_format == fmt
    check_banks(engine, fmt)
    pool, ref = ftw.load(engine / EXPERTS_FILE), reference_experts(ckpt, layout)
    where = moe_layer_experts(engine)
    assert pool.header.num_rows == len(where) == len(ref)
    for row, (layer, j) in enumerate(where):
        gate, up, down = ref[f"model.layers.{layer}.mlp.experts.{j}"]
        gate_up_t, down_t = pool.header.dequantize(pool.experts[row])
        assert_bits_equal(gate_up_t, np.concatenate([gate, up]), f"{layout} row {row} gate_up")
        assert_bits_equal(down_t, down, f"{layout} row {row} down")


# -- (b) --quant rounds as the reference ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FP4)
def test_quant_of_a_16bit_checkpoint_is_the_references_rounding(fmt, seed, tmp_path):
    """`--quant` on a bf16 checkpoint: every bank row (codes, scales, nvfp4's tensor scales) holds
    exactly the bytes of fp4_reference's quantizer of that expert's weights."""
    model = build_model(SHAPE, seed)
    ckpt = save_checkpoint(model, tmp_path / "ckpt", "fused", 1)
    engine = compile_cpu(ckpt, tmp_path / "engine", quant=fmt)
    assert spec_of(engine)["expert_format"] == fmt
    check_banks(engine, fmt)
    pool, state = ftw.load(engine / EXPERTS_FILE), model.state_dict()
    for row, (layer, j) in enumerate(moe_layer_experts(engine)):
        prefix = f"model.layers.{layer}.mlp.experts."
        gate_up, down = state[prefix + "gate_up_proj"][j].numpy(), state[prefix + "down_proj"][j].numpy()
        want = reference_rows(fmt, gate_up[:FP4_INTERMEDIATE], gate_up[FP4_INTERMEDIATE:], down)
        got = expert_rows(pool, row)
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"row {row} ({prefix}{j}) bank {name}")


@pytest.mark.parametrize("fmt", FP4)
def test_quant_of_random_weights_dequantizes_as_the_reference(fmt, seed, tmp_path):
    """`--random-weights --quant`: codes and scales are drawn directly in the format (no rounding to
    compare with); every row, its codes and scales read back in checkpoint packing, dequantizes with
    fp4_reference to the engine's own reference bit for bit, its scales are numbers, and the weights
    have about the standard deviation 1/sqrt(fan_in) of the 16-bit draws."""
    engine = compile_cpu(TINY_SPEC, tmp_path / "engine", random_weights=True, seed=seed % 1000, quant=fmt)
    assert spec_of(engine)["expert_format"] == fmt
    check_banks(engine, fmt)
    pool = ftw.load(engine / EXPERTS_FILE)
    h, i = pool.header.hidden, pool.header.intermediate
    stds = {"gate_up": [], "down": []}
    for row in range(pool.header.num_rows):
        ours = dict(zip(("gate_up", "down"), pool.header.dequantize(pool.experts[row]), strict=True))
        rows = expert_rows(pool, row)
        for name, (n, k) in (("gate_up", (2 * i, h)), ("down", (h, i))):
            ref = reference_dequantize(fmt, rows, name, n, k)
            assert np.isfinite(ref).all(), (row, name)
            assert_bits_equal(ours[name], ref, f"row {row} {name}")
            stds[name].append(float(ref.std() * k ** 0.5))
    for name, s in stds.items():
        assert 0.6 < np.mean(s) < 1.6, (name, np.mean(s))


@pytest.mark.parametrize("fmt", FP4)
def test_an_engine_of_the_earlier_packing_is_refused_asking_for_a_recompile(fmt, seed, tmp_path):
    """An engine compiled before the 16-row packing (codes "e2m1x64", scales row-major) holds the
    same bytes in another order: loading it names the packing and asks for a new compile, before
    any kernel reads a row."""
    engine = compile_cpu(TINY_SPEC, tmp_path / "engine", random_weights=True, seed=seed % 1000, quant=fmt)
    path = engine / EXPERTS_FILE
    data = path.read_bytes()
    header_end = data.index(b'"checksums"')  # the header's JSON, before the data: same-length edits only
    old = data[:header_end].replace(b'"packing":"e2m1r16"', b'"packing":"e2m1x64"').replace(
        b'"packing":"r16"', b'"packing":""')
    path.write_bytes(old.ljust(header_end) + data[header_end:])
    with pytest.raises(ftw.FtwError, match=r"experts\.ftw: bank 'gate_up' is packed 'e2m1x64', this runtime reads "
                       r"'e2m1r16': the engine was compiled by another version of ftc; compile it again"):
        Engine.load(engine)


def reference_dequantize(fmt: str, rows: dict[str, np.ndarray], name: str, n: int, k: int) -> np.ndarray:
    """fp4_reference's float32 [n, k] of one bank (codes and scales) of an FTW expert row; nvfp4's
    gate_up with the gate's tensor scale on its first half of the rows, the up's on the rest."""
    packed = checkpoint_packing(rows[name], n, k)
    scales = checkpoint_scale_packing(rows[f"{name}_scales"], n, k // BLOCK[fmt])
    if fmt == "mxfp4":
        return dequantize_mxfp4(packed, scales)
    ts = rows["tensor_scales"].view(np.float32)
    if name == "down":
        return dequantize_nvfp4(packed, scales, ts[2])
    half = n // 2
    return np.concatenate([dequantize_nvfp4(packed[:half], scales[:half], ts[0]),
                           dequantize_nvfp4(packed[half:], scales[half:], ts[1])])


def tie_block(rng: np.random.Generator, block: int, scale: float) -> np.ndarray:
    """A block at the e2m1 grid's midpoints (0.25, 0.75, ..., 5: each a tie), both signs, times
    `scale`, with one ±6 · scale that makes `scale` the block's scale."""
    mids = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    v = rng.choice(mids, block) * rng.choice([-1, 1], block)
    v[rng.integers(block)] = 6.0 * rng.choice([-1, 1])
    return (v * np.float32(scale)).astype(np.float32)


def special_matrix(rng: np.random.Generator, fmt: str, rows: int = 8, cols: int = 256) -> np.ndarray:
    """Random weights over many binades, with all-zero blocks, ties at the e2m1 midpoints times the
    block's scale, blocks just above a grid value, huge and subnormal magnitudes (mxfp4: its scales
    clamp at both ends; nvfp4: blocks whose scale rounds to zero or to e4m3's subnormals)."""
    block = BLOCK[fmt]
    w = (rng.standard_normal((rows, cols)) * 2.0 ** rng.uniform(-12, 12, (rows, cols // block)).repeat(block, 1))
    b = w.astype(np.float32).reshape(rows, cols // block, block)
    b[0, 0] = 0.0
    b[0, 1] = -0.0
    b[3, 0] = E2M1[rng.integers(0, 16, block)] * np.float32(2.0 ** 3)  # on the grid
    if fmt == "mxfp4":  # the block's scale is a power of two: ties are exact
        b[1, :4] = [tie_block(rng, block, 2.0 ** int(rng.integers(-20, 20))) for _ in range(4)]
        b[2, 0], b[2, 1] = rng.uniform(1e37, 3e38, block), rng.uniform(-1e-40, 1e-40, block)
        b[2, 2] = np.float32(7.99) * 2.0 ** 100  # saturates to 6
    else:  # a matrix amax of 6 · 448 · 2^k makes the tensor scale 2^k, and e4m3 block scales exact ties
        k = int(rng.integers(-10, 10))
        b *= np.float32(6 * 448 * 2.0 ** k / 2 / np.abs(b).max())
        b[1, 0, 0] = 6 * 448 * 2.0 ** k
        b[1, 1:4] = [tie_block(rng, block, float(s) * 2.0 ** k) for s in rng.choice([0.75, 1.5, 3.25, 0.0625], 3)]
        b[2, 0] = b[1, 0, 0] * 1e-9 * rng.uniform(-1, 1, block)  # scale below e4m3's least: codes all 0
        b[2, 1] = b[1, 0, 0] * 2e-5 * rng.uniform(-1, 1, block)  # e4m3 subnormal scales
    return b.reshape(rows, cols)


@pytest.mark.parametrize("fmt", FP4)
def test_format_quantize_is_the_references_on_special_values(fmt, seed):
    """The format's own `quantize` (the `--quant` rounding) on matrices with zeros, ties, saturating,
    huge and tiny values: codes, scale bytes and tensor scale equal fp4_reference's."""
    rng = np.random.default_rng(seed)
    fmt_ = expert_format(fmt)
    for draw in range(4):
        w = special_matrix(rng, fmt)
        m = fmt_.quantize(torch.from_numpy(w), "w")
        packed, scales, ts = quantize(fmt, w)
        np.testing.assert_array_equal(m.codes.numpy(), packed, err_msg=f"draw {draw}: codes")
        np.testing.assert_array_equal(m.scales.numpy(), scales, err_msg=f"draw {draw}: scales")
        if fmt == "nvfp4":
            assert np.float32(m.tensor_scale) == m.tensor_scale and np.float32(m.tensor_scale) == ts, draw
            assert np.frexp(ts)[0] == 0.5, "the ties need a tensor scale of a power of two"
        else:
            assert m.tensor_scale is None


# -- dense linear weights stored in NVFP4 ----------------------------------------------------------------


def quantize_dense(layout: str, name: str) -> Callable[[dict[str, torch.Tensor]], np.ndarray]:
    """An edit that stores the bf16 linear weight `name` as the layout stores an NVFP4 weight
    (ModelOpt: .weight u8 + .weight_scale + .weight_scale_2; compressed-tensors: .weight_packed +
    .weight_scale + .weight_global_scale) and returns fp4_reference's dequantization of it."""
    def edit(state: dict[str, torch.Tensor]) -> np.ndarray:
        p = name.removesuffix(".weight")
        packed, scales, ts = quantize("nvfp4", state.pop(name).float().numpy())
        state[p + ".weight_scale"] = torch.from_numpy(scales).view(torch.float8_e4m3fn)
        if layout == "nvfp4_modelopt":
            state[name] = torch.from_numpy(packed)
            state[p + ".weight_scale_2"] = torch.tensor(ts, dtype=torch.float32)
        else:
            state[p + ".weight_packed"] = torch.from_numpy(packed)
            state[p + ".weight_global_scale"] = torch.tensor([np.float32(1) / ts], dtype=torch.float32)
            ts = np.float32(1) / (np.float32(1) / ts)
        return dequantize_nvfp4(packed, scales, ts)
    return edit


@pytest.mark.parametrize("layout", ["nvfp4_modelopt", "nvfp4_ct"])
def test_nvfp4_dense_weights_are_dequantized_to_bf16(layout, seed, tmp_path):
    """Linear layers that the checkpoint's settings do not exclude are NVFP4 too (attention, here):
    the engine holds them in bf16, the reference's dequantization rounded to nearest."""
    ckpt = quantized_checkpoint(tmp_path, layout, seed)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight"]
    refs = {}
    for name in names:
        edit_tensors(ckpt, lambda state, name=name: refs.__setitem__(name, quantize_dense(layout, name)(state)))
    engine = compile_cpu(ckpt, tmp_path / "engine")
    dense = load_file(str(engine / "dense.safetensors"))
    for name in names:
        assert torch.equal(dense[name], torch.from_numpy(refs[name]).to(torch.bfloat16)), name


# -- (c) (d) refusals -----------------------------------------------------------------------------------------


def edit_tensors(ckpt: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = ckpt / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path), metadata={"format": "pt"})


def set_byte(name: str, index: tuple[int, ...], value: int) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(state: dict[str, torch.Tensor]) -> None:
        state[name].view(torch.uint8)[index] = value
    return edit


def set_tensor(name: str, make: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(state: dict[str, torch.Tensor]) -> None:
        state[name] = make(state[name]).contiguous()
    return edit


P = "model.layers.1.mlp.experts."
BAD_TENSORS = {  # case → (layout, edit, message)
    "e8m0-nan": ("mxfp4_dsv4", set_byte(P + "3.w2.scale", (5, 1), 255),
                 rf"{P}3\.w2\.scale: e8m0 scale of row 5, block 1 is 255"),
    "e8m0-nan-interleaved": ("mxfp4_gptoss", set_byte(P + "gate_up_proj_scales", (2, 7, 1), 255),
                             r"gate_up_proj_scales \(expert 2\) up rows: e8m0 scale of row 3, block 1 is 255"),
    "e4m3-nan": ("nvfp4_ct", set_byte(P + "6.up_proj.weight_scale", (9, 2), 0x7F),
                 rf"{P}6\.up_proj\.weight_scale: e4m3 scale of row 9, block 2 is NaN \(byte 0x7f\)"),
    "e4m3-negative-nan": ("nvfp4_modelopt", set_byte(P + "0.down_proj.weight_scale", (1, 3), 0xFF),
                          rf"{P}0\.down_proj\.weight_scale: e4m3 scale of row 1, block 3 is NaN \(byte 0xff\)"),
    "global-scale-zero": ("nvfp4_ct", set_tensor(P + "2.gate_proj.weight_global_scale", torch.zeros_like),
                          rf"{P}2\.gate_proj\.weight_global_scale \(inverted\): nvfp4 tensor scale is inf"),
    "global-scale-nan": ("nvfp4_ct", set_tensor(P + "2.gate_proj.weight_global_scale",
                                                lambda t: torch.full_like(t, float("nan"))),
                         rf"{P}2\.gate_proj\.weight_global_scale \(inverted\): nvfp4 tensor scale is nan"),
    "codes-one-column-short": ("mxfp4_dsv4", set_tensor(P + "4.w1.weight", lambda t: t[:, :-1]),
                               rf"tensor {P}4\.w1\.weight has shape \[64, 31\], expected \[64, 32\]"),
    "fused-codes-short": ("mxfp4_gptoss", set_tensor(P + "down_proj_blocks", lambda t: t[..., :15]),
                          rf"tensor {P}down_proj_blocks has shape \[8, 64, 2, 15\], expected \[8, 64, 2, 16\]"),
    "scales-one-block-more": ("nvfp4_ct", set_tensor(P + "5.down_proj.weight_scale",
                                                     lambda t: torch.cat([t, t[:, :1]], 1)),
                              rf"tensor {P}5\.down_proj\.weight_scale has shape \[64, 5\], expected \[64, 4\]"),
    "float16-codes": ("mxfp4_dsv4", set_tensor(P + "1.w3.weight", lambda t: t.to(torch.float16)),
                      rf"tensor {P}1\.w3\.weight has dtype torch\.float16"),
    "mxfp4-overflows-fp32": ("mxfp4_dsv4", lambda s: (set_byte(P + "7.w1.scale", (0, 0), 254)(s),
                                                      set_byte(P + "7.w1.weight", (0, 0), 0x77)(s)),
                             r"NaN or Inf values"),
}
TENSOR_SCALE_2 = {  # ModelOpt's weight_scale_2 that is no finite positive number
    "zero": 0.0, "inf": float("inf"), "nan": float("nan"), "negative": -1.0}


def quantized_checkpoint(tmp_path: Path, layout: str, seed: int) -> Path:
    return save_quantized_checkpoint(build_model(SHAPE, seed), tmp_path / "ckpt", layout)


@pytest.mark.parametrize("case", BAD_TENSORS)
def test_a_malformed_quantized_tensor_is_refused_naming_it(case, seed, tmp_path):
    """A NaN scale byte (naming tensor, row and block), a tensor scale that is no number, a codes or
    scales tensor of another shape, codes of another dtype, or weights beyond fp32: refused."""
    layout, edit, message = BAD_TENSORS[case]
    ckpt = quantized_checkpoint(tmp_path, layout, seed)
    edit_tensors(ckpt, edit)
    with pytest.raises(ValueError, match=message):
        compile_cpu(ckpt, tmp_path / "engine")
    assert not (tmp_path / "engine").exists()


@pytest.mark.parametrize("value", TENSOR_SCALE_2.values(), ids=list(TENSOR_SCALE_2))
def test_a_modelopt_tensor_scale_that_is_no_positive_number_is_refused(value, seed, tmp_path):
    """weight_scale_2 (ModelOpt stores it as a 0-dim float32) of 0, Inf, NaN or below 0: refused, the
    message naming the projection."""
    ckpt = quantized_checkpoint(tmp_path, "nvfp4_modelopt", seed)
    edit_tensors(ckpt, set_tensor(P + "3.up_proj.weight_scale_2", lambda t: torch.full_like(t, value)))
    with pytest.raises(ValueError, match=rf"{P}3\.up_proj.*weight_scale_2.* is {value}"):
        compile_cpu(ckpt, tmp_path / "engine")


def test_quant_of_another_4bit_format_is_refused(seed, tmp_path):
    """--quant nvfp4 on an MXFP4 checkpoint would dequantize and round again: refused."""
    ckpt = quantized_checkpoint(tmp_path, "mxfp4_gptoss", seed)
    with pytest.raises(ValueError, match=r"experts are mxfp4; --quant nvfp4"):
        compile_cpu(ckpt, tmp_path / "engine", quant="nvfp4")
    assert compile_cpu(ckpt, tmp_path / "engine", quant="mxfp4").is_dir()  # repeating its own is fine


def test_4bit_experts_without_their_settings_are_refused(seed, tmp_path):
    """MXFP4 tensors under a config that declares no quantization: refused, saying --quant mxfp4."""
    ckpt = quantized_checkpoint(tmp_path, "mxfp4_dsv4", seed)
    config = json.loads((ckpt / "config.json").read_text())
    del config["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"experts are mxfp4 \(dsv4_mxfp4 layout\).*--quant mxfp4"):
        compile_cpu(ckpt, tmp_path / "engine")


@pytest.mark.parametrize("file,field,value", [
    ("config.json", "quant_method", "gptq"),
    ("config.json", "format", "float-quantized"),
    ("hf_quant_config.json", "quant_algo", "FP8"),
    ("hf_quant_config.json", "group_size", 32),
])
def test_an_unsupported_quantization_config_is_refused_naming_its_file(file, field, value, seed, tmp_path):
    """Settings of another scheme (GPTQ, compressed-tensors' FP8, ModelOpt's FP8) or another block
    size: refused, naming the settings file and the field."""
    layout = {"quant_method": "mxfp4_gptoss", "format": "nvfp4_ct"}.get(field, "nvfp4_modelopt")
    ckpt = quantized_checkpoint(tmp_path, layout, seed)
    settings = json.loads((ckpt / file).read_text())
    (settings.get("quantization_config") or settings["quantization"])[field] = value
    (ckpt / file).write_text(json.dumps(settings))
    with pytest.raises(ValueError, match=rf"{file}: .*{field} = {value!r}"):
        compile_cpu(ckpt, tmp_path / "engine")


# -- (e) the CLI ------------------------------------------------------------------------------------------------


def test_cli_compiles_with_quant_and_inspect_shows_the_format(seed, tmp_path):
    """`ftc compile --quant nvfp4` of a bf16 checkpoint, then `ftc inspect` names the format; an
    unknown --quant is a usage error."""
    ckpt = save_checkpoint(build_model(SHAPE, seed), tmp_path / "ckpt", "per_expert", 1)
    runner, out = CliRunner(), tmp_path / "engine"
    r = runner.invoke(app, ["compile", str(ckpt), "--quant", "nvfp4", "--target", "cpu", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert spec_of(out)["expert_format"] == "nvfp4"
    r = runner.invoke(app, ["inspect", str(out)])
    assert r.exit_code == 0 and "routed (nvfp4)" in r.stdout, r.output
    r = runner.invoke(app, ["compile", str(ckpt), "--quant", "fp3", "-o", str(tmp_path / "other")])
    assert r.exit_code == 2 and "--quant" in r.output


def test_the_cli_quant_choices_are_the_runtime_formats():
    assert [q.value for q in ExpertQuant] == list(FORMATS)
