"""Checkpoints whose routed experts are already MXFP4 or NVFP4: which format their settings declare,
and each expert's codes and scales as `QuantizedMatrix`es, which the format repacks bit for bit
(never dequantized and requantized).

Settings: `config.json` `quantization_config` (gpt-oss's `quant_method: mxfp4`; DeepSeek-V4's
`fmt: e2m1` with `scale_fmt: ue8m0`; ModelOpt's `quant_method: modelopt` with `quant_algo: NVFP4`;
compressed-tensors' `format: nvfp4-pack-quantized`) or ModelOpt's `hf_quant_config.json`. The
modules they exclude (`modules_to_not_convert`, `exclude_modules`, `ignore`) stay 16-bit and read
as usual; an NVFP4 linear weight outside the routed experts is dequantized to bf16
(`DequantizedDense`), since the engine holds dense weights in 16 bits. Block-scaled FP8
checkpoints (`quant_method: fp8`) declare no 4-bit experts: every weight is dequantized
(`fp8_checkpoint`).

DeepSeek-V4's release declares `quant_method: fp8` with `expert_dtype: fp4`: FP8 linears with
power-of-two block scales (`X.scale`, e8m0) and MXFP4 experts.

Expert layouts, found by their tensor names under a layer's experts prefix `P`:
- gpt-oss: `P gate_up_proj_blocks` u8 [E, 2I, H/32, 16] + `_scales` u8 [E, 2I, H/32], the gate and
  up rows interleaved (row 2i gate i, row 2i+1 up i); `P down_proj_blocks` / `_scales`.
- DeepSeek-V4: `P j.w1|w3|w2.weight` int8 [N, K/2] (gate, up, down) + `.scale` e8m0 [N, K/32].
- ModelOpt: `P j.{gate,up,down}_proj.weight` u8 [N, K/2], `.weight_scale` e4m3 [N, K/16],
  `.weight_scale_2` fp32 (the tensor scale); `.input_scale` is for 4-bit activations, unused.
- compressed-tensors: `.weight_packed`, `.weight_scale`, `.weight_global_scale` (1 / the tensor
  scale, inverted here in fp32).
Codes: two a byte, the low nibble the even column, in every layout.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ftc.compile.checkpoint import SafetensorsCheckpoint
from ftc.compile.fp8_checkpoint import DEFAULT_BLOCK, fp8_settings, read_fp8_codes, read_fp8_weight
from ftc_runtime.formats import expert_format
from ftc_runtime.formats.base import QuantizedMatrix
from ftc_runtime.models.base import CheckpointError

BYTE_TYPES = (torch.uint8, torch.int8)
E8M0_TYPES = (torch.uint8, torch.float8_e8m0fnu)
E4M3_TYPES = (torch.uint8, torch.float8_e4m3fn)


def declared_format(directory: Path, config: dict[str, Any]) -> str | None:
    """'mxfp4' or 'nvfp4' where the checkpoint's settings declare 4-bit experts, None where they
    declare none; CheckpointError for settings of another scheme or another block size."""
    where = directory / "hf_quant_config.json"
    if where.is_file():
        try:
            q = json.loads(where.read_text())["quantization"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{where}: not a ModelOpt quantization config ({e})") from None
        return _modelopt_settings(q, where)
    q = config.get("quantization_config", config.get("text_config", {}).get("quantization_config"))
    if q is None:
        return None
    where = directory / "config.json"
    if not isinstance(q, dict):
        raise CheckpointError(f"{where}: field 'quantization_config' is not an object")
    method = q.get("quant_method")
    if method == "mxfp4" or (q.get("fmt") == "e2m1" and q.get("scale_fmt") == "ue8m0"):
        return "mxfp4"
    if method == "modelopt":
        return _modelopt_settings(q, where)
    if method == "compressed-tensors":
        return _compressed_tensors_settings(q, where)
    if method == "fp8":  # block-scaled FP8 linears (`fp8_checkpoint`), the experts too unless they are
        fp8_settings(q, where)  # e2m1 (DeepSeek-V4: `expert_dtype` fp4, in the settings or beside them)
        return "mxfp4" if q.get("expert_dtype", config.get("expert_dtype")) == "fp4" else None
    raise CheckpointError(f"{where}: quantization_config.quant_method = {method!r}: ftc reads MXFP4 (gpt-oss, "
                          "DeepSeek-V4), NVFP4 (ModelOpt, compressed-tensors nvfp4-pack-quantized), block-scaled "
                          "FP8 (DeepSeek-V3, GLM-5) or 16/32-bit weights")


def _modelopt_settings(q: dict[str, Any], where: Path) -> str:
    if q.get("quant_algo") != "NVFP4":
        raise CheckpointError(f"{where}: quant_algo = {q.get('quant_algo')!r}: ftc reads NVFP4 ModelOpt checkpoints")
    if q.get("group_size", 16) != 16:
        raise CheckpointError(f"{where}: group_size = {q.get('group_size')!r}: NVFP4 scales blocks of 16")
    return "nvfp4"


def _compressed_tensors_settings(q: dict[str, Any], where: Path) -> str:
    if q.get("format") != "nvfp4-pack-quantized":
        raise CheckpointError(f"{where}: quantization_config.format = {q.get('format')!r}: ftc reads the "
                              "compressed-tensors format 'nvfp4-pack-quantized'")
    for name, group in (q.get("config_groups") or {}).items():
        w = (group or {}).get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("group_size")) != (4, "float", 16):
            raise CheckpointError(f"{where}: config_groups.{name}.weights = {w}: expected num_bits 4, type float, "
                                  "group_size 16 (NVFP4)")
    return "nvfp4"


@dataclass(frozen=True)
class QuantizedExperts:
    """Reads one layout's experts from a checkpoint; `shapes` are (hidden, intermediate, experts)."""

    ckpt: SafetensorsCheckpoint
    layout: str
    hidden: int
    intermediate: int
    num_experts: int
    context: str = ""  # what a shape error says the tensors are; default: the layout's experts and shapes

    def expert(self, prefix: str, j: int) -> dict[str, QuantizedMatrix]:
        """Expert j under the experts prefix: {"gate", "up", "down"}."""
        return READERS[self.layout](self, prefix, j)

    def shape(self, proj: str) -> tuple[int, int]:
        h, i = self.hidden, self.intermediate
        return (h, i) if proj == "down" else (i, h)

    def tensor(self, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...],
               index: int | None = None) -> torch.Tensor:
        """The stored tensor (or its index-th entry along dim 0), checked for shape and dtype."""
        got = self.ckpt.shape(name)
        if got != shape:
            context = self.context or (f"{self.layout} experts of hidden {self.hidden}, intermediate "
                                       f"{self.intermediate}")
            raise CheckpointError(f"{self.ckpt.directory}: tensor {name} has shape {list(got)}, expected "
                                  f"{list(shape)} ({context})")
        t = self.ckpt.raw(name, index)
        if t.dtype not in dtypes:
            raise CheckpointError(f"{self.ckpt.directory}: tensor {name} has dtype {t.dtype}, expected one of "
                                  f"{', '.join(str(d) for d in dtypes)}")
        return t.view(torch.uint8) if t.dtype != torch.float32 else t

    def scalar(self, name: str) -> float:
        t = self.ckpt.raw(name)
        if t.numel() != 1 or t.dtype != torch.float32:
            raise CheckpointError(f"{self.ckpt.directory}: tensor {name} is {t.dtype} {list(t.shape)}, expected "
                                  "one float32")
        return float(t.reshape(()))


def _gptoss(r: QuantizedExperts, prefix: str, j: int) -> dict[str, QuantizedMatrix]:
    e, h, i = r.num_experts, r.hidden, r.intermediate
    out = {}
    for name, rows, cols in (("gate_up", 2 * i, h), ("down", h, i)):
        blocks = r.tensor(f"{prefix}{name}_proj_blocks", (e, rows, cols // 32, 16), BYTE_TYPES, j)
        scales = r.tensor(f"{prefix}{name}_proj_scales", (e, rows, cols // 32), E8M0_TYPES, j)
        codes, where = blocks.reshape(rows, cols // 2), f"{prefix}{name}_proj_scales (expert {j})"
        if name == "down":
            out["down"] = QuantizedMatrix(codes, scales, None, where)
        else:  # gate and up rows interleaved
            out["gate"] = QuantizedMatrix(codes[0::2], scales[0::2], None, where + " gate rows")
            out["up"] = QuantizedMatrix(codes[1::2], scales[1::2], None, where + " up rows")
    return out


def _dsv4(r: QuantizedExperts, prefix: str, j: int) -> dict[str, QuantizedMatrix]:
    out = {}
    for proj, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
        n, k = r.shape(proj)
        p = f"{prefix}{j}.{w}"
        out[proj] = QuantizedMatrix(r.tensor(p + ".weight", (n, k // 2), BYTE_TYPES),
                                    r.tensor(p + ".scale", (n, k // 32), E8M0_TYPES), None, p + ".scale")
    return out


def _ct_tensor_scale(r: QuantizedExperts, p: str) -> float:
    """compressed-tensors' tensor scale: 1 / `weight_global_scale`, in fp32 as the format defines it."""
    inverse = torch.tensor(r.scalar(p + ".weight_global_scale"), dtype=torch.float32)
    return float(torch.tensor(1.0, dtype=torch.float32) / inverse)


# An NVFP4 layout → (its codes tensor, the tensor scale of a module p, the tensor that scale comes from).
NVFP4_LAYOUTS: dict[str, tuple[str, Callable[[QuantizedExperts, str], float], str]] = {
    "modelopt_nvfp4": ("weight", lambda r, p: r.scalar(p + ".weight_scale_2"), "weight_scale_2"),
    "compressed_tensors_nvfp4": ("weight_packed", _ct_tensor_scale, "weight_global_scale (inverted)"),
}


def _nvfp4_matrix(r: QuantizedExperts, p: str, rows: int, cols: int) -> QuantizedMatrix:
    """The NVFP4 linear weight [rows, cols] of module p, as the reader's layout stores it."""
    codes, tensor_scale, scale_name = NVFP4_LAYOUTS[r.layout]
    return QuantizedMatrix(r.tensor(f"{p}.{codes}", (rows, cols // 2), BYTE_TYPES),
                           r.tensor(p + ".weight_scale", (rows, cols // 16), E4M3_TYPES), tensor_scale(r, p),
                           p + ".weight_scale", f"{p}.{scale_name}")


def _nvfp4(r: QuantizedExperts, prefix: str, j: int) -> dict[str, QuantizedMatrix]:
    return {proj: _nvfp4_matrix(r, f"{prefix}{j}.{proj}_proj", *r.shape(proj)) for proj in ("gate", "up", "down")}


READERS = {"gptoss_mxfp4": _gptoss, "dsv4_mxfp4": _dsv4, "modelopt_nvfp4": _nvfp4, "compressed_tensors_nvfp4": _nvfp4}
LAYOUT_FORMAT = {"gptoss_mxfp4": "mxfp4", "dsv4_mxfp4": "mxfp4", "modelopt_nvfp4": "nvfp4",
                 "compressed_tensors_nvfp4": "nvfp4"}


def find_layout(ckpt: SafetensorsCheckpoint, prefix: str) -> str | None:
    """The quantized layout whose tensors sit under the experts prefix of a layer; None: float."""
    probes = (("gptoss_mxfp4", "gate_up_proj_blocks"), ("dsv4_mxfp4", "0.w1.scale"),
              ("compressed_tensors_nvfp4", "0.gate_proj.weight_packed"),
              ("modelopt_nvfp4", "0.gate_proj.weight_scale"))
    return next((layout for layout, suffix in probes if prefix + suffix in ckpt), None)


class DequantizedDense:
    """The checkpoint with every NVFP4 linear weight outside the routed experts (those its settings
    do not exclude: ModelOpt's `X.weight` u8 with `.weight_scale` and `.weight_scale_2`,
    compressed-tensors' `X.weight_packed`) and every block-scaled FP8 weight (`X.weight` e4m3 with
    `.weight_scale_inv`, blocks of `fp8_block`) read as `X.weight` in bf16, dequantized: the engine
    holds dense weights in 16 bits. Any other tensor reads as the checkpoint stores it."""

    def __init__(self, ckpt: SafetensorsCheckpoint, fp8_block: tuple[int, int] = DEFAULT_BLOCK):
        self.ckpt, self.directory, self.fp8_block = ckpt, ckpt.directory, fp8_block

    def _quantized(self, name: str) -> tuple[str, str] | None:
        """(codes tensor, its layout) of a quantized weight `X.weight`, else None."""
        base = name.removesuffix(".weight")
        if base == name:
            return None
        if f"{base}.weight_packed" in self.ckpt:
            return f"{base}.weight_packed", "compressed_tensors_nvfp4"
        if f"{base}.weight_scale_2" in self.ckpt and name in self.ckpt:
            return name, "modelopt_nvfp4"
        if f"{base}.weight_scale_inv" in self.ckpt and name in self.ckpt:
            return name, "fp8"
        if f"{base}.scale" in self.ckpt and name in self.ckpt and self.ckpt.dtype(name) == "F8_E4M3":
            return name, "fp8"  # DeepSeek-V4's release: power-of-two scales (e8m0) named `X.scale`
        return None

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt or self._quantized(name) is not None

    def names(self) -> list[str]:
        return self.ckpt.names()

    def shape(self, name: str) -> tuple[int, ...]:
        q = self._quantized(name)
        if q is None or q[1] == "fp8":
            return self.ckpt.shape(name)
        rows, half = self.ckpt.shape(q[0])
        return rows, 2 * half

    def fp8_codes(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The e4m3 codes and block scales of FP8 weight `name` as stored, None if it is not one."""
        q = self._quantized(name)
        return read_fp8_codes(self.ckpt, name, self.fp8_block) if q is not None and q[1] == "fp8" else None

    def get(self, name: str) -> torch.Tensor:
        q = self._quantized(name)
        if q is None:
            return self.ckpt.get(name)
        if q[1] == "fp8":
            return read_fp8_weight(self.ckpt, name, self.fp8_block)
        rows, cols = self.shape(name)
        reader = QuantizedExperts(self.ckpt, q[1], cols, rows, 1, f"an NVFP4 linear weight [{rows}, {cols}]")
        m = _nvfp4_matrix(reader, name.removesuffix(".weight"), rows, cols)
        try:
            return expert_format("nvfp4").dequantize_matrix(m).to(torch.bfloat16)
        except ValueError as e:
            raise CheckpointError(f"{self.directory}: {e}") from None
