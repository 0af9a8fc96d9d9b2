"""Tiny quantized Hugging Face checkpoints: a transformers Qwen3-MoE or Qwen3.5-MoE model's routed
experts quantized to MXFP4 or NVFP4 (with fp4_reference, independent of ftc) and saved in the
storage layouts of four producers; every other tensor bf16.

- 'mxfp4_gptoss': gpt-oss's fused `experts.gate_up_proj_blocks` / `_scales` (gate and up rows
  interleaved) and `experts.down_proj_blocks` / `_scales`.
- 'mxfp4_dsv4': DeepSeek-V4's per-expert `experts.J.w1|w3|w2.weight` (int8) and `.scale` (e8m0).
- 'nvfp4_modelopt': NVIDIA ModelOpt's per-expert `experts.J.{gate,up,down}_proj.weight`,
  `.weight_scale` (e4m3), `.weight_scale_2` (the tensor scale) and `.input_scale`.
- 'nvfp4_ct': compressed-tensors' `nvfp4-pack-quantized`: `.weight_packed`, `.weight_scale`,
  `.weight_global_scale` (1 / the tensor scale).

Saving overwrites the model's expert parameters with their dequantized values, so the model is the
quantized checkpoint's reference; `reference_experts` reads those values back from the files.
ftc's 4-bit formats need hidden and expert intermediate sizes that are multiples of 64:
`widen_experts` redraws a built model's experts at such a size.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp4_reference import dequantize_mxfp4, dequantize_nvfp4, quantize_mxfp4, quantize_nvfp4
from hf_tokenizer import save_tokenizer

LAYOUTS = ("mxfp4_gptoss", "mxfp4_dsv4", "nvfp4_modelopt", "nvfp4_ct")
# The 4-bit formats pack the codes of 64 columns together: hidden and expert intermediate sizes must
# be multiples of 64. The tiny test models' hidden size is 64; their experts' intermediate size is 32.
FP4_INTERMEDIATE = 64
FORMAT_OF = {"mxfp4_gptoss": "mxfp4", "mxfp4_dsv4": "mxfp4", "nvfp4_modelopt": "nvfp4", "nvfp4_ct": "nvfp4"}

FUSED = "gate_up_proj"
PROJS = ("gate", "up", "down")
DSV4_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}
# One quantized matrix: packed codes, scale bytes, and the tensor scale (NVFP4) or None (MXFP4).
Quantized = tuple[np.ndarray, np.ndarray, np.float32 | None]


def quantize(fmt: str, w: np.ndarray) -> Quantized:
    """A float32 matrix [N, K] quantized along K in format 'mxfp4' or 'nvfp4'."""
    if fmt == "mxfp4":
        return (*quantize_mxfp4(w), None)
    if fmt == "nvfp4":
        return quantize_nvfp4(w)
    raise ValueError(fmt)


def dequantize(packed: np.ndarray, scales: np.ndarray, ts: np.float32 | None) -> np.ndarray:
    """float32 [N, K] of a quantized matrix: NVFP4 where it has a tensor scale, else MXFP4."""
    return dequantize_mxfp4(packed, scales) if ts is None else dequantize_nvfp4(packed, scales, ts)


def widen_experts(model: torch.nn.Module, seed: int, intermediate: int = FP4_INTERMEDIATE) -> torch.nn.Module:
    """The model with its routed experts drawn anew at expert intermediate size `intermediate`, for
    the builders that fix it (the hybrid models): N(0, initializer_range) values of bf16, as the rest
    of the model; the config says the new size."""
    g = torch.Generator().manual_seed(seed)
    std = model.config.initializer_range

    def draw(*shape: int) -> torch.nn.Parameter:
        return torch.nn.Parameter((torch.randn(shape, generator=g) * std).to(torch.bfloat16).float())

    for module in model.modules():
        if type(module).__name__.endswith("Experts") and hasattr(module, FUSED):
            e, _, h = module.gate_up_proj.shape
            module.intermediate_dim = intermediate
            module.gate_up_proj, module.down_proj = draw(e, 2 * intermediate, h), draw(e, h, intermediate)
    model.config.moe_intermediate_size = intermediate
    return model


def _stored(layout: str, q: Quantized) -> Quantized:
    """The matrix as the layout stores it. compressed-tensors stores 1/ts, so its reader's tensor
    scale is 1 / (1 / ts) in float32, which may differ from ts by rounding."""
    packed, scales, ts = q
    if layout == "nvfp4_ct":
        ts = np.float32(1) / (np.float32(1) / ts)
    return packed, scales, ts


def _u8(t: torch.Tensor) -> np.ndarray:
    """The bytes of a one-byte tensor (uint8, int8, float8) as a uint8 array."""
    return t.contiguous().view(torch.uint8).numpy()


def _bytes(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A uint8 array as a tensor of a one-byte dtype, the same bytes."""
    return torch.from_numpy(np.ascontiguousarray(a, np.uint8)).view(dtype)


def _scalar(ts: np.float32, shape: tuple[int, ...] = ()) -> torch.Tensor:
    """A float32 tensor of the given shape holding ts."""
    return torch.from_numpy(np.full(shape, ts, np.float32))


def _quantize_experts(gate_up: torch.Tensor, down: torch.Tensor, layout: str) -> list[dict[str, Quantized]]:
    """Each expert's gate, up and down quantized separately, as the layout stores them; the fused
    parameters are overwritten in place with the stored matrices' dequantized values."""
    fmt, inter = FORMAT_OF[layout], gate_up.shape[1] // 2
    experts = []
    for e in range(gate_up.shape[0]):
        mats = {"gate": gate_up[e, :inter], "up": gate_up[e, inter:], "down": down[e]}
        quant = {p: _stored(layout, quantize(fmt, m.detach().float().cpu().numpy())) for p, m in mats.items()}
        with torch.no_grad():
            for p, m in mats.items():
                m.copy_(torch.from_numpy(dequantize(*quant[p])))
        experts.append(quant)
    return experts


def _expert_tensors(prefix: str, experts: list[dict[str, Quantized]], layout: str) -> dict[str, torch.Tensor]:
    """One layer's quantized experts as the layout's tensors under `prefix` (`...mlp.experts.`)."""
    if layout == "mxfp4_gptoss":
        return _gptoss_tensors(prefix, experts)
    out = {}
    for j, quant in enumerate(experts):
        for p, (packed, scales, ts) in quant.items():
            if layout == "mxfp4_dsv4":
                name = f"{prefix}{j}.{DSV4_NAMES[p]}."
                out |= {name + "weight": _bytes(packed, torch.int8), name + "scale": _e8m0(scales)}
                continue
            name = f"{prefix}{j}.{p}_proj."
            out[name + "weight_scale"] = _bytes(scales, torch.float8_e4m3fn)
            if layout == "nvfp4_modelopt":
                out |= {name + "weight": _bytes(packed, torch.uint8), name + "weight_scale_2": _scalar(ts),
                        name + "input_scale": _scalar(np.float32(1))}
            else:
                out |= {name + "weight_packed": _bytes(packed, torch.uint8),
                        name + "weight_global_scale": _scalar(np.float32(1) / ts, (1,))}
    return out


def _gptoss_tensors(prefix: str, experts: list[dict[str, Quantized]]) -> dict[str, torch.Tensor]:
    """gpt-oss's fused MXFP4 experts: blocks [E, N, K/32, 16], scales [E, N, K/32]; gate_up's rows
    interleaved (row 2i gate row i, row 2i + 1 up row i)."""
    def interleave(i: int) -> np.ndarray:
        gate, up = (np.stack([q[p][i] for q in experts]) for p in ("gate", "up"))
        return np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, gate.shape[2])

    gate_up_packed, gate_up_scales = interleave(0), interleave(1)
    down_packed, down_scales = (np.stack([q["down"][i] for q in experts]) for i in (0, 1))

    def blocks(packed: np.ndarray) -> torch.Tensor:
        return _bytes(packed.reshape(*packed.shape[:2], -1, 16), torch.uint8)

    return {f"{prefix}gate_up_proj_blocks": blocks(gate_up_packed),
            f"{prefix}gate_up_proj_scales": _bytes(gate_up_scales, torch.uint8),
            f"{prefix}down_proj_blocks": blocks(down_packed),
            f"{prefix}down_proj_scales": _bytes(down_scales, torch.uint8)}


def _e8m0(scales: np.ndarray) -> torch.Tensor:
    """e8m0 scale bytes as torch.float8_e8m0fnu (safetensors 0.8 saves it)."""
    return _bytes(scales, torch.float8_e8m0fnu)


def _excluded(model_prefix: str) -> list[str]:
    """The unquantized modules as ModelOpt lists them, under the model's prefix."""
    return ["lm_head", f"{model_prefix}layers.*.self_attn*", f"{model_prefix}layers.*.linear_attn*",
            f"{model_prefix}layers.*.mlp.gate", f"{model_prefix}layers.*.mlp.shared_expert*",
            f"{model_prefix}embed_tokens"]


def quantization_config(layout: str, nested: bool = False) -> dict:
    """config.json's `quantization_config` of the layout."""
    prefix = "model.language_model." if nested else "model."
    if layout == "mxfp4_gptoss":
        return {"quant_method": "mxfp4", "modules_to_not_convert": [
            f"{prefix}layers.*.self_attn", f"{prefix}layers.*.linear_attn", f"{prefix}layers.*.mlp.gate",
            f"{prefix}layers.*.mlp.shared_expert", f"{prefix}layers.*.mlp.shared_expert_gate",
            f"{prefix}embed_tokens", "lm_head"]}
    if layout == "mxfp4_dsv4":
        return {"quant_method": "mxfp4", "fmt": "e2m1", "scale_fmt": "ue8m0", "weight_block_size": [1, 32]}
    if layout == "nvfp4_modelopt":
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                "exclude_modules": _excluded(prefix)}
    if layout == "nvfp4_ct":
        weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
                   "dynamic": False}
        return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
                "ignore": ["lm_head", "re:.*self_attn.*", "re:.*linear_attn.*", "re:.*mlp.gate$",
                           "re:.*shared_expert.*"]}
    raise ValueError(layout)


def _write_configs(model: torch.nn.Module, directory: Path, layout: str, nested: bool) -> None:
    """config.json (nested under `text_config` as save_hybrid_checkpoint does) with the layout's
    quantization_config, and ModelOpt's hf_quant_config.json."""
    config = model.config.to_dict()
    if nested:
        config = {"model_type": "qwen3_5_moe", "tie_word_embeddings": False,
                  "text_config": config}
    config["quantization_config"] = quantization_config(layout, nested)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    if layout == "nvfp4_modelopt":
        quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                 "exclude_modules": config["quantization_config"]["exclude_modules"]}
        (directory / "hf_quant_config.json").write_text(
            json.dumps({"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": quant}, indent=1))


def _rename(key: str, nested: bool) -> str:
    """`model.` → `model.language_model.` for the image-text model's language model."""
    return "model.language_model." + key[len("model."):] if nested and key.startswith("model.") else key


def save_quantized_checkpoint(model: torch.nn.Module, directory: Path, layout: str, nested: bool = False) -> Path:
    """Quantizes the model's routed experts (gate, up and down of each separately) in the layout's
    format, overwrites them in the model with their dequantized values, and writes the checkpoint:
    model.safetensors (other tensors bf16, experts in the layout), config.json and tokenizer.json. `nested`: Qwen3.5
    as the image-text model's language model (`model.language_model.`, config under `text_config`)."""
    if layout not in LAYOUTS:
        raise ValueError(layout)
    directory.mkdir(parents=True, exist_ok=True)
    params = dict(model.named_parameters())
    experts = {}
    for name in [k for k in model.state_dict() if k.endswith("mlp.experts." + FUSED)]:
        prefix = name[: -len(FUSED)]
        experts[prefix] = _quantize_experts(params[name], params[prefix + "down_proj"], layout)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if not any(k in (p + FUSED, p + "down_proj") for p in experts)}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    for prefix, quant in experts.items():
        state |= _expert_tensors(prefix, quant, layout)
    state = {_rename(k, nested): v for k, v in state.items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _write_configs(model, directory, layout, nested)
    save_tokenizer(directory)
    return directory


def _read_gptoss(f: Any, prefix: str) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """One layer's experts of an open gpt-oss file (a safe_open handle), dequantized: gate and up from
    the interleaved rows."""
    def mats(proj: str) -> np.ndarray:
        blocks, scales = _u8(f.get_tensor(f"{prefix}{proj}_blocks")), _u8(f.get_tensor(f"{prefix}{proj}_scales"))
        return np.stack([dequantize_mxfp4(b.reshape(b.shape[0], -1), s) for b, s in zip(blocks, scales, strict=True)])

    gate_up, down = mats("gate_up_proj"), mats("down_proj")
    return {f"{prefix}{j}": (gate_up[j, 0::2], gate_up[j, 1::2], down[j]) for j in range(len(down))}


def _read_expert(f: Any, name: str, layout: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One expert (`...experts.J.`) of a per-expert file, dequantized: gate, up, down."""
    def mat(proj: str) -> np.ndarray:
        if layout == "mxfp4_dsv4":
            base = f"{name}{DSV4_NAMES[proj]}."
            return dequantize_mxfp4(_u8(f.get_tensor(base + "weight")), _u8(f.get_tensor(base + "scale")))
        base = f"{name}{proj}_proj."
        scales = _u8(f.get_tensor(base + "weight_scale"))
        if layout == "nvfp4_modelopt":
            packed, ts = f.get_tensor(base + "weight"), f.get_tensor(base + "weight_scale_2").numpy()
        else:
            packed, gs = f.get_tensor(base + "weight_packed"), f.get_tensor(base + "weight_global_scale").numpy()
            ts = np.float32(1) / gs.astype(np.float32)
        return dequantize_nvfp4(_u8(packed), scales, np.float32(ts.reshape(-1)[0]))

    gate, up, down = (mat(p) for p in PROJS)
    return gate, up, down


def reference_experts(directory: Path, layout: str) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every routed expert of a saved checkpoint, read back from model.safetensors and dequantized
    with fp4_reference: `f"{prefix}{j}"` (prefix as stored, `...mlp.experts.`) → float32 (gate [I, H],
    up [I, H], down [H, I])."""
    out = {}
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        if layout == "mxfp4_gptoss":
            for key in keys:
                if key.endswith("experts.gate_up_proj_blocks"):
                    out |= _read_gptoss(f, key[: -len("gate_up_proj_blocks")])
            return out
        first = {"mxfp4_dsv4": "w1.weight", "nvfp4_modelopt": "gate_proj.weight", "nvfp4_ct": "gate_proj.weight_packed"}
        pattern = re.compile(rf"(.*\.experts\.\d+\.){re.escape(first[layout])}")
        for key in keys:
            if m := pattern.fullmatch(key):
                out[m.group(1)[:-1]] = _read_expert(f, m.group(1), layout)
    return out
