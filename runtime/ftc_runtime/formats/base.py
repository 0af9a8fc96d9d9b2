"""`ExpertFormat`: how one format stores a routed SwiGLU expert in FTW banks, encodes float weights
into them, dequantizes them back (the torch reference), and which kernel templates compute on them.

A SwiGLU expert is two float tensors: `gate_up` [2I, H] (the gate rows first, then the up rows)
and `down` [H, I]. A format stores them as one or more banks (FTW: one row per expert in each
bank). The bank that holds a tensor's values (or their codes) carries the tensor's name; block
scales, where a format has them, are banks of their own.

An expert reaches a format either as float tensors, which it encodes (rounding), or, for the
block-scaled formats, as the three `QuantizedMatrix`es a checkpoint already stores in that
format, which it repacks bit for bit (`Expert`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import torch

EXPERT_TENSORS = ("gate_up", "down")


def expert_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, int]]:
    """The float tensors of one SwiGLU expert by name: gate_up [2I, H], down [H, I]."""
    return {"gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}


@dataclass(frozen=True)
class QuantizedMatrix:
    """A matrix [rows, cols] in a block-scaled 4-bit format as checkpoints store it: `codes` uint8
    [rows, cols/2], two e2m1 codes a byte, the low nibble the even column; `scales` uint8 [rows,
    cols/block], the format's scale bytes; `tensor_scale` the fp32 scale of the whole matrix
    (NVFP4's `weight_scale_2`), None where the format has none. `name` and `tensor_scale_name` say
    where the block scales and the tensor scale came from (checkpoint tensors), for errors."""

    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: float | None
    name: str
    tensor_scale_name: str = ""

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], 2 * self.codes.shape[1]


# An expert as a weight source gives it: float tensors {"gate_up", "down"}, or a checkpoint's
# quantized matrices {"gate", "up", "down"}.
Expert = Mapping[str, "torch.Tensor | QuantizedMatrix"]
QUANTIZED_TENSORS = ("gate", "up", "down")


@dataclass(frozen=True)
class BankLayout:
    """One bank of a format: the elements of a row in row-major order of `row_shape`, `bits` each,
    packed without gaps, so a row takes ceil(bits · elements / 8) bytes."""

    name: str
    dtype: str  # element type: "bf16"; block-scaled formats: "e2m1" codes, "ue8m0" or "e4m3" scales
    bits: int  # bits per element
    row_shape: tuple[int, ...]
    block: int  # weights along a matrix row that share one scale (codes and scales alike); 1: unscaled
    packing: str  # how elements sit in the bytes where that is not plain row-major order ("": plain)

    @property
    def elements(self) -> int:
        return math.prod(self.row_shape)

    @property
    def row_bytes(self) -> int:
        return (self.bits * self.elements + 7) // 8


@dataclass(frozen=True)
class CpuTemplate:
    """A CPU expert kernel of a format for one ISA: its primitives' template (which extends the
    skeleton `cpu/expert_ffn.cpp.j2`), the step that hidden and intermediate sizes must be
    multiples of (its vector width, or its scale block), and its measured tiling: matrix rows per
    work item and rows prefetched ahead (docs/history/performance-log.md has the sweeps). `tile_min_avx512`:
    experts of at least that many routed tokens run as 16 × 16 tile GEMMs on AVX-512 BF16
    (templates/ftc_templates/cpu/expert_tiles.cpp.j2), the kernel saying where its rows are as bf16; None: no
    tiles. `tile_min_amx`: the same on AMX, where the row buckets (each row read once per 8 tokens)
    lose to the tiles from 16 tokens for bf16."""

    path: str  # under templates/
    step: int
    work_rows: int = 16
    prefetch_rows: int = 2
    tile_min_avx512: int | None = None
    tile_min_amx: int = 16


@dataclass(frozen=True)
class ExpertFormat(ABC):
    """A format's banks, encoding, reference dequantization and kernel templates. One instance per
    format module (its `FORMAT`); shapes are arguments, so one instance serves every model."""

    name: str
    cpu_templates: Mapping[str, CpuTemplate]  # ISA → kernel
    triton_template: str  # under templates/: the GPU kernels over cache slots
    slot_dtype: torch.dtype  # what the Triton kernels view the slots' bytes as

    @property
    def size_multiple(self) -> int:
        """What hidden and expert intermediate sizes must be multiples of (the banks' packing)."""
        return 1

    @abstractmethod
    def banks(self, hidden: int, intermediate: int) -> tuple[BankLayout, ...]:
        """The banks of one expert of these shapes, in their order within an expert's row."""

    def expert_bytes(self, hidden: int, intermediate: int) -> int:
        """Bytes of one expert's rows (without FTW's padding)."""
        return sum(b.row_bytes for b in self.banks(hidden, intermediate))

    @abstractmethod
    def encode(self, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
        """One expert's float tensors (any float dtype, on the host) as its bank rows: {bank name:
        uint8 tensor of the bank's row_bytes}. The rows may share memory with the inputs."""

    def pack(self, gate: QuantizedMatrix, up: QuantizedMatrix, down: QuantizedMatrix) -> dict[str, torch.Tensor]:
        """One expert a checkpoint stores in this format, as its bank rows, bit for bit."""
        raise ValueError(f"the {self.name} expert format cannot take quantized checkpoint tensors ({gate.name}); "
                         "compile with the checkpoint's own format (--quant)")

    def rows_of(self, expert: Expert) -> dict[str, torch.Tensor]:
        """An expert as a weight source gives it (float or quantized) as its bank rows."""
        if "gate_up" in expert:
            return self.encode(expert["gate_up"], expert["down"])
        return self.pack(*(expert[name] for name in QUANTIZED_TENSORS))

    @abstractmethod
    def dequantize(self, rows: Mapping[str, torch.Tensor], hidden: int,
                   intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference: (gate_up [2I, H], down [H, I]) as float tensors from one expert's rows
        ({bank name: uint8 tensor of row_bytes}, on any device), in the dtype the kernels compute
        with; callers wanting another dtype convert."""


def check_expert_shapes(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[int, int]:
    """(hidden, intermediate) of a SwiGLU expert's float tensors; ValueError naming a tensor whose
    shape or dtype does not fit."""
    if down.dim() != 2:
        raise ValueError(f"expert tensor 'down': shape {tuple(down.shape)}, expected [hidden, intermediate]")
    hidden, intermediate = down.shape
    for name, t in (("gate_up", gate_up), ("down", down)):
        want = expert_shapes(hidden, intermediate)[name]
        if tuple(t.shape) != want or not t.is_floating_point():
            raise ValueError(f"expert tensor '{name}': got {t.dtype} {tuple(t.shape)}, expected a float tensor "
                             f"of shape {want}")
    return hidden, intermediate
