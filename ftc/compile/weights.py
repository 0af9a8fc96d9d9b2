"""Where an engine's weights come from: an HF checkpoint, or deterministic random weights.

Both give the dense tensors by checkpoint name and the routed experts one at a time, so that the
compiler streams experts into FTW and never holds the model in memory twice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

from ftc.compile.checkpoint import CheckpointError, SafetensorsCheckpoint
from ftc.compile.fp8_checkpoint import checkpoint_fp8_block
from ftc.compile.quantized_checkpoint import LAYOUT_FORMAT, DequantizedDense, QuantizedExperts, find_layout
from ftc_runtime.formats import expert_format
from ftc_runtime.formats.base import Expert
from ftc_runtime.formats.e2m1 import BlockFp4Format
from ftc_runtime.models import family
from ftc_runtime.models.dense_layout import FP8_BLOCK, stored_dense
from ftc_runtime.spec import ModelSpec


class WeightSource(Protocol):
    description: str
    extra_layers: dict[str, int]  # layers past the spec's that the source holds and the engine skips
    # The spec the engine is built to: the one asked for, without its multi-token-prediction layers
    # where a checkpoint has none of their tensors (a release stripped of them)
    spec: ModelSpec

    def dense(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every non-expert tensor by checkpoint name: bf16, or fp32 and int64 where the engine
        stores it so (`dense_layout.stored_dense`)."""

    def dense_fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Dense weight `name` as e4m3 codes and fp32 scales per `FP8_BLOCK` where the source stores
        it so (an FP8 release), None where it holds it in 16 or 32 bits."""

    def expert(self, layer: int, expert: int) -> Expert:
        """Expert `expert` of decoder layer `layer`: float tensors gate_up [2I, H] (gate rows first)
        and down [H, I], which the expert format encodes into its FTW banks, or the quantized
        matrices gate, up and down that a checkpoint stores in the format, which it repacks."""


def extra_layers(names: list[str], spec: ModelSpec, mtp_prefixes: set[str]) -> dict[str, int]:
    """Layers a checkpoint holds that the engine does not read: decoder layers past the spec's but
    those it reads as its multi-token-prediction layers (`mtp_prefixes`: GLM-5's and DeepSeek-V3's
    next-n layers, DeepSeek-V4's `mtp.N.`), DeepSeek-V4's other `mtp.N.` and, where the spec has no
    MTP layer, Qwen's under `mtp.`: tensors by prefix."""
    counts: dict[str, int] = {}
    for name in names:
        match = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        if not (match and int(match.group(1)) >= spec.num_layers and name[:match.end() - 1] not in mtp_prefixes):
            match = re.match(r"(?:model\.)?mtp\.\d+\.", name) or (re.match(r"mtp\.", name) if not spec.mtp_layers
                                                                   else None)
            if match and name[:match.end() - 1] in mtp_prefixes:  # DeepSeek-V4's, read as its MTP layer
                match = None
        if match:
            prefix = name[:match.end()].rstrip(".")
            counts[prefix] = counts.get(prefix, 0) + 1
    return counts


# 16/32-bit experts one by one: the names of their gate, up and down projections (HF's, DeepSeek's).
PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


class CheckpointWeights:
    """An HF checkpoint with 16/32-bit experts in any layout (per-expert
    `experts.J.{gate,up,down}_proj.weight` or DeepSeek's `experts.J.{w1,w3,w2}.weight`, or fused
    `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I], or transposed) or 4-bit
    ones (`quantized_checkpoint`); dense tensors by canonical name wherever the checkpoint's layout
    keeps them (the family's `CheckpointLayout`)."""

    def __init__(self, spec: ModelSpec, directory: Path):
        self.ckpt = SafetensorsCheckpoint(directory)
        self.reader = DequantizedDense(self.ckpt, checkpoint_fp8_block(directory))
        self.spec = spec = self._without_absent_mtp(spec)
        self.layout = family(spec.family).checkpoint_layout(self.reader, spec)
        self.description = f"checkpoint {directory}"
        mtp_prefixes = {self.layout.name(f"model.layers.{i}.").rstrip(".") for i in spec.mtp_decoder_layers}
        self.extra_layers = extra_layers(self.ckpt.names(), spec, mtp_prefixes)
        self.shapes = family(spec.family).dense_tensor_shapes(spec)
        for name, shape in self.shapes.items():
            if name not in self.layout:
                raise CheckpointError(f"{directory}: tensor {self.layout.name(name)} not found in the checkpoint")
            if self.layout.shape(name) != shape:
                raise CheckpointError(f"{directory}: tensor {self.layout.name(name)} has shape "
                                      f"{self.layout.shape(name)}, the spec implies {shape}")
        first = self._experts_prefix(spec.moe_layers[0])
        self.quantized = self._quantized_experts(first)
        self.fused = f"{first}gate_up_proj" in self.ckpt
        self.per_expert = next((n for n in PER_EXPERT_NAMES if f"{first}0.{n[0]}.weight" in self.ckpt), None)
        if self.quantized is None and not self.fused and self.per_expert is None:
            raise CheckpointError(f"{directory}: no experts for layer {spec.moe_layers[0]}: expected "
                                  f"{first}gate_up_proj, {first}0.gate_proj.weight or {first}0.w1.weight")

    def _without_absent_mtp(self, spec: ModelSpec) -> ModelSpec:
        """`spec`, without its multi-token-prediction layers where the checkpoint holds none of
        their tensors (some releases strip them); one of them present, the rest must be too."""
        if not spec.mtp_layers:
            return spec
        fam = family(spec.family)
        bare = dataclasses.replace(spec, mtp_layers=0)
        layout = fam.checkpoint_layout(self.reader, spec)
        head = set(fam.dense_tensor_shapes(spec)) - set(fam.dense_tensor_shapes(bare))
        return spec if any(name in layout for name in head) else bare

    def _quantized_experts(self, prefix: str) -> QuantizedExperts | None:
        """The reader of the checkpoint's 4-bit experts; None where they are 16/32-bit. Either way
        the spec's expert format must take them as they are."""
        layout = find_layout(self.ckpt, prefix)
        if layout is None:
            return None
        stored = LAYOUT_FORMAT[layout]
        if self.spec.expert_format != stored:
            raise CheckpointError(f"{self.ckpt.directory}: the routed experts are {stored} ({layout} layout); an "
                                  f"engine of expert_format {self.spec.expert_format!r} would dequantize and "
                                  f"requantize them: compile with --quant {stored}")
        m = self.spec.moe
        return QuantizedExperts(self.ckpt, layout, self.spec.hidden_size, m.expert_intermediate_size, m.num_experts)

    def _experts_prefix(self, layer: int) -> str:
        return self.layout.name(f"model.layers.{layer}.mlp.experts.")

    def dense(self) -> Iterator[tuple[str, torch.Tensor]]:
        stored = stored_dense(self.spec)
        for name in self.shapes:
            dtype = stored[name][1]
            if dtype == "I64":
                yield name, self._expert_ids(self.layout.name(name))
            elif dtype == "F32":
                yield name, self.ckpt.get(self.layout.name(name), dtype=torch.float32)
            else:
                yield name, self.layout.get(name)

    def _expert_ids(self, name: str) -> torch.Tensor:
        """A table of expert ids (a hash router's), int64, each within the layer's experts."""
        t, e = self.ckpt.raw(name), self.spec.moe.num_experts
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise CheckpointError(f"{self.ckpt.directory}: tensor {name} has dtype {t.dtype}, expected integer "
                                  "expert ids")
        bad = (t < 0) | (t >= e)
        if bool(bad.any()):
            raise CheckpointError(f"{self.ckpt.directory}: tensor {name} holds expert id {int(t[bad][0])}, outside "
                                  f"[0, {e}) (moe.num_experts)")
        return t.long()

    def dense_fp8(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        # Another block size is dequantized and quantized again: the engine reads 128 × 128 blocks.
        return self.reader.fp8_codes(self.layout.name(name)) if self.reader.fp8_block == FP8_BLOCK else None

    def expert(self, layer: int, expert: int) -> Expert:
        h, i, e = self.spec.hidden_size, self.spec.moe.expert_intermediate_size, self.spec.moe.num_experts
        p = self._experts_prefix(layer)
        if self.quantized is not None:
            return self.quantized.expert(p, expert)
        if self.fused:
            down, transposed = self._fused(p + "down_proj", (e, h, i), expert, None)
            gate_up, _ = self._fused(p + "gate_up_proj", (e, 2 * i, h), expert, transposed)
        else:
            gate_name, up_name, down_name = self.per_expert
            gate = self._checked(f"{p}{expert}.{gate_name}.weight", (i, h))
            up = self._checked(f"{p}{expert}.{up_name}.weight", (i, h))
            gate_up = torch.cat([gate, up], dim=0)
            down = self._checked(f"{p}{expert}.{down_name}.weight", (h, i))
        return {"gate_up": gate_up, "down": down}

    def _checked(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        got = self.reader.shape(name)
        if got != shape:
            raise CheckpointError(f"{self.ckpt.directory}: tensor {name} has shape {got}, expected {shape}")
        return self.reader.get(name)

    def _fused(self, name: str, shape: tuple[int, int, int], expert: int,
               transposed: bool | None) -> tuple[torch.Tensor, bool]:
        """One expert of a fused tensor as [out, in], and whether the file stores it as [in, out].
        A square tensor cannot tell by its shape; it follows `transposed` (the down projection's
        orientation), else the transformers layout."""
        got = self.ckpt.shape(name)
        flipped = (shape[0], shape[2], shape[1])
        if got not in (shape, flipped):
            raise CheckpointError(f"{self.ckpt.directory}: tensor {name} has shape {got}, expected {shape}")
        is_t = (transposed or False) if shape == flipped else got == flipped
        t = self.ckpt.get(name, expert)
        return (t.t().contiguous() if is_t else t), is_t


class RandomWeights:
    """Deterministic random weights of the spec's shapes: each tensor draws from its own generator,
    seeded by (seed, tensor name), so any tensor can be made alone and in any order. Linear weights
    are N(0, 1/fan_in), norms are 1, so activations keep a sane scale through all layers."""

    def __init__(self, spec: ModelSpec, seed: int = 0):
        self.spec, self.seed = spec, seed
        self.description = f"random weights (seed {seed})"
        self.extra_layers: dict[str, int] = {}
        self.shapes = family(spec.family).dense_tensor_shapes(spec)

    def _generator(self, name: str) -> torch.Generator:
        digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))

    def _randn(self, name: str, shape: tuple[int, ...], std: float) -> torch.Tensor:
        return (torch.randn(shape, generator=self._generator(name)) * std).to(torch.bfloat16)

    def dense(self) -> Iterator[tuple[str, torch.Tensor]]:
        stored = stored_dense(self.spec)
        for name, shape in self.shapes.items():
            dtype = stored[name][1]
            if dtype == "I64":  # each token id's distinct experts
                g, e = self._generator(name), self.spec.moe.num_experts
                yield name, torch.rand(shape[0], e, generator=g).argsort(dim=1)[:, :shape[1]].contiguous()
            else:
                t = self._float(name, shape)
                yield name, t.float() if dtype == "F32" else t

    def _float(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        # (1 + w) norms store the offset from 1; the linear layers' gated norm is plain w.
        one_plus = self.spec.norm.kind == "rms_one_plus"
        if len(shape) == 1:
            zero = name.endswith((".bias", "sinks")) or (one_plus and name.endswith("norm.weight")
                                                         and not name.endswith("linear_attn.norm.weight"))
            return (torch.zeros if zero else torch.ones)(shape, dtype=torch.bfloat16)
        if name == "model.embed_tokens.weight":
            return self._randn(name, shape, 1.0)
        # N(0, 1/fan_in); a depthwise convolution [C, 1, K] takes K inputs
        return self._randn(name, shape, (shape[1] if len(shape) == 2 else shape[-1]) ** -0.5)

    def dense_fp8(self, name: str) -> None:
        return None

    def expert(self, layer: int, expert: int) -> Expert:
        """bf16 draws; a 4-bit format's codes and scales drawn directly (as fast as the bytes)."""
        h, i = self.spec.hidden_size, self.spec.moe.expert_intermediate_size
        p = f"model.layers.{layer}.mlp.experts.{expert}."
        fmt = expert_format(self.spec.expert_format)
        if isinstance(fmt, BlockFp4Format):
            return {proj: fmt.random(rows, cols, cols ** -0.5, self._generator(p + proj), p + proj)
                    for proj, (rows, cols) in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i)))}
        return {"gate_up": self._randn(p + "gate_up", (2 * i, h), h ** -0.5),
                "down": self._randn(p + "down", (h, i), i ** -0.5)}
