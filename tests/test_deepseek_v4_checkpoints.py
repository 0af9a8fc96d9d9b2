"""The tiny DeepSeek-V4 checkpoints of hf_deepseek_v4_models, read back with safetensors and checked
independently of the savers: 'fused' is the model's state_dict; 'pretrained' names what
`save_pretrained` names and loads into transformers with the same logits; 'released' maps through
ftc's `canonical_name` onto the model, its MXFP4 experts (fp4_reference's decoding) and its FP8
linears (torch's e4m3 decoding, power-of-two block scales) equal to the model's overwritten values."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import DeepseekV4ForCausalLM

from ftc_runtime.models.deepseek_v4.loader import canonical_name

from fp4_reference import dequantize_mxfp4
from hf_deepseek_v4_models import VOCAB, build_deepseek_v4, save_deepseek_v4_checkpoint

# The tensors the release keeps in fp32, by transformers' names and by the release's.
FP32_PARTS = ("attn_hc.", "ffn_hc.", "hc_head.", ".sinks", ".position_bias", ".e_score_correction_bias")
RELEASED_FP32 = re.compile(r"(^|\.)hc_|\.attn_sink$|\.ape$|\.gate\.bias$")
FP8_LINEARS = [f"self_attn.{p}_proj.weight" for p in ("q_a", "q_b", "kv", "o_a", "o_b")] + [
    f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")]
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(w1|w2|w3)\.weight")


def stored_dtype(fp32: bool, t: torch.Tensor) -> torch.dtype:
    """What a checkpoint stores a tensor of the model as: int64 `tid2eid` as it is, else fp32 or bf16."""
    return t.dtype if not t.dtype.is_floating_point else torch.float32 if fp32 else torch.bfloat16


def check_files(directory: Path, model: DeepseekV4ForCausalLM) -> dict:
    """config.json says the model's config; tokenizer.json fits the vocabulary. Returns the config."""
    config = json.loads((directory / "config.json").read_text())
    assert {k: v for k, v in config.items() if k not in ("quantization_config", "expert_dtype")} == json.loads(
        json.dumps(model.config.to_dict()))
    assert Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size() <= config["vocab_size"] == VOCAB
    return config


def test_fused_layout_is_the_state_dict_in_bf16(tmp_path, seed):
    model = build_deepseek_v4(seed)
    directory = save_deepseek_v4_checkpoint(model, tmp_path, "fused")
    check_files(directory, model)
    stored, want = load_file(directory / "model.safetensors"), model.state_dict()
    assert stored.keys() == want.keys()
    for name, t in stored.items():
        fp32 = any(part in name for part in FP32_PARTS)
        assert t.dtype == stored_dtype(fp32, want[name]), name
        assert torch.equal(t.to(want[name].dtype), want[name]), f"{name}: the model's values are not bf16's"
    for layer in model.model.layers[:2]:  # the hash layers: distinct experts for every token
        tid2eid = layer.mlp.gate.tid2eid
        assert tid2eid.shape == (VOCAB, 2) and (tid2eid[:, 0] != tid2eid[:, 1]).all()
    assert set(model.config.layer_types) == {"sliding_attention", "compressed_sparse_attention",
                                             "heavily_compressed_attention"}


def test_pretrained_layout_is_what_save_pretrained_writes_and_loads_back(tmp_path, seed):
    """transformers' own reading of the names proves them: the same logits as the model in memory."""
    model = build_deepseek_v4(seed)
    directory = save_deepseek_v4_checkpoint(model, tmp_path / "ckpt", "pretrained")
    check_files(directory, model)
    model.save_pretrained(tmp_path / "plain")
    stored = load_file(directory / "model.safetensors")
    assert stored.keys() == load_file(tmp_path / "plain" / "model.safetensors").keys()
    assert {"head.weight", "model.layers.0.attn.wq_a.weight", "model.layers.0.ffn.experts.7.w2.weight"} <= stored.keys()
    for name, t in stored.items():
        assert t.dtype in (torch.int64, torch.float32 if RELEASED_FP32.search(name) else torch.bfloat16), name
    loaded = DeepseekV4ForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.randint(VOCAB, (1, 40), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def fp8_dequantized(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 (torch's decoding) · 2^(e8m0 byte - 127), one scale per 128 × 128 block."""
    n, k = codes.shape
    exps = scale.view(torch.uint8).long() - 127
    assert exps.shape == (-(-n // 128), -(-k // 128))
    per_value = exps.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return torch.ldexp(codes.float(), per_value.float())


def check_power_of_two_scales(w: torch.Tensor, scale: torch.Tensor) -> None:
    """Each block's scale 2^e is the least power of two with amax / 2^e ≤ 448 (w: the weight before
    quantizing)."""
    for (i, j), byte in np.ndenumerate(scale.view(torch.uint8).numpy()):
        amax, bound = float(w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max()), 448 * 2.0 ** (int(byte) - 127)
        assert bound / 2 < amax <= bound, (amax, bound)


def expert_rows(want: dict[str, torch.Tensor], canonical: str) -> torch.Tensor:
    """The rows of the fused experts that a per-expert tensor (`...mlp.experts.J.w1.weight`) holds."""
    layer, expert, w = EXPERT.fullmatch(canonical).groups()
    prefix = f"model.layers.{layer}.mlp.experts."
    if w == "w2":
        return want[prefix + "down_proj"][int(expert)]
    gate_up = want[prefix + "gate_up_proj"][int(expert)]
    return gate_up.chunk(2)[0 if w == "w1" else 1]


def test_released_layout_maps_onto_the_model_and_dequantizes_to_it(tmp_path, seed):
    model = build_deepseek_v4(seed, intermediate=64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    directory = save_deepseek_v4_checkpoint(model, tmp_path, "released")
    config = check_files(directory, model)
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                             "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    assert config["expert_dtype"] == "fp4"
    stored, want = load_file(directory / "model.safetensors"), model.state_dict()
    assert not any(name.startswith("model.") for name in stored) and "head.weight" in stored
    canonical = {name: canonical_name(name) for name in stored if not name.endswith(".scale")}
    experts = {c for c in canonical.values() if EXPERT.fullmatch(c)}
    layers, n_experts = range(len(model.model.layers)), model.config.n_routed_experts
    assert experts == {f"model.layers.{i}.mlp.experts.{j}.{w}.weight" for i in layers for j in range(n_experts)
                       for w in ("w1", "w2", "w3")}
    fused = {f"model.layers.{i}.mlp.experts.{p}" for i in layers for p in ("gate_up_proj", "down_proj")}
    assert sorted(canonical.values()) == sorted(experts | (want.keys() - fused)), "not every tensor once"
    fp8 = set()
    for name, c in canonical.items():
        t, scale = stored[name], stored.get(name.removesuffix("weight") + "scale")
        if c in experts:
            rows = expert_rows(want, c)
            assert t.dtype == torch.int8 and t.shape == (rows.shape[0], rows.shape[1] // 2), name
            assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (rows.shape[0], rows.shape[1] // 32), name
            got = dequantize_mxfp4(t.view(torch.uint8).numpy(), scale.view(torch.uint8).numpy())
            assert np.array_equal(got, rows.numpy()), name
        elif t.dtype == torch.float8_e4m3fn:
            assert scale.dtype == torch.float8_e8m0fnu, name
            check_power_of_two_scales(before[c], scale)
            assert torch.equal(fp8_dequantized(t, scale), want[c]), name
            fp8.add(c)
        else:
            fp32 = any(part in c for part in FP32_PARTS)
            assert scale is None and t.dtype == stored_dtype(fp32, want[c]), name
            assert torch.equal(t.to(want[c].dtype), want[c]), name
    assert len(stored) == len(canonical) + len(experts) + len(fp8), "a scale without its weight"
    assert fp8 == {f"model.layers.{i}.{w}" for i in layers for w in FP8_LINEARS}
    for name, value in want.items():  # the quantized tensors are overwritten, the others are not
        assert torch.equal(value, before[name]) != (name in fp8 or name in fused), name
