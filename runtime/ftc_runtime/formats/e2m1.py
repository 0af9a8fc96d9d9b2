"""What the block-scaled 4-bit formats (`mxfp4`, `nvfp4`) share: e2m1 codes, their FTW packing,
the rounding rule, and a format class that the two complete with their scale type.

e2m1 code c (4 bits: sign, 2 exponent bits, 1 mantissa bit) is the value `E2M1[c]`:
0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. A weight is `E2M1[code] · scale(block)`.

Packing in FTW (`PACKING`, `SCALE_PACKING`): a matrix's rows go in groups of 16 (`ROW_GROUP`),
and a group's codes in units of 8 columns, 64 bytes each, unit after unit along the row: bytes
4r..4r+3 of unit q of group g are row 16g + r's columns 8q..8q+7, byte i holding column 8q + i in
its low nibble and 8q + 4 + i in its high one. Its scales go 16 bytes per (group, block): byte r
of block b is row 16g + r's. One 64-byte load is then 16 rows × 8 columns, one row per 32-bit lane:
the AVX-512 kernel sums each lane (row) in integers over a whole block, broadcasts the activations
that all lanes share, and needs no horizontal sum; the Triton kernels read the same tiles by index.
Checkpoints store codes row by row, the low nibble the even column; compiling repacks by
permutation only.

Rounding (`round_to_e2m1`, used by `--quant`): the nearest value of the grid, |q| > 6 → 6, ties to
the code with an even mantissa bit (0.25 → 0, 0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4,
5 → 4); the sign bit is set for q < 0 (a negative that rounds to zero keeps it: -0).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ftc_runtime.formats.base import (
    BankLayout,
    ExpertFormat,
    QuantizedMatrix,
    check_expert_shapes,
    expert_shapes,
)

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
RMS_E2M1 = (sum(v * v for v in E2M1[:8]) / 8) ** 0.5  # of uniformly drawn codes: about 2.93
GROUP = 64  # what hidden and intermediate sizes must be multiples of (whole 64-byte loads of both kernels)
ROW_GROUP = 16  # rows interleaved in FTW
UNIT = 8  # columns of a row in one 64-byte unit
PACKING = "e2m1r16"  # the header's names for the packing above: codes, scales
# Tokens per expert from which the AVX-512 BF16 tiles beat the 4-bit row kernel (vpdpbusd on int8
# activations), their 16-row groups dequantized to bf16 once per work item
# (docs/history/performance-log.md, issue 24).
TILE_MIN_AVX512 = 256
# On AMX (Sapphire Rapids, 16 cores) the row kernel still leads at 32 tokens (1.51-1.54 against the
# tiles' 1.25-1.34 TFLOP/s), the tiles from 64 (1.96-2.05 against 1.48-1.68).
TILE_MIN_AMX = 64
SCALE_PACKING = "r16"


def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(E2M1, dtype=torch.float32, device=device)


def round_to_e2m1(q: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8) of fp32 values q by the rule above."""
    a = q.abs()
    # Each comparison passes one midpoint of the grid; `>` at a tie rounds down, `>=` up, as ties to even want.
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5))
    return mag | ((q < 0).to(torch.uint8) << 3)


def pack_pairs(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [N, K] as checkpoints pack them: [N, K/2], the low nibble the even column."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_pairs(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def to_ftw_packing(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint-packed codes [N, K/2] in FTW's packing (same shape): a permutation of nibbles."""
    n, k = packed.shape[0], 2 * packed.shape[1]
    # column 8q + 4h + i of row 16g + r -> [g, q, r, i, h]
    units = unpack_pairs(packed).view(n // ROW_GROUP, ROW_GROUP, k // UNIT, 2, UNIT // 2).permute(0, 2, 1, 4, 3)
    return (units[..., 0] | (units[..., 1] << 4)).reshape(n, k // 2)


def ftw_codes(packed: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The codes (uint8 [rows, cols], one a byte) of an FTW-packed bank row (uint8, any device)."""
    units = packed.view(rows // ROW_GROUP, cols // UNIT, ROW_GROUP, UNIT // 2)
    both = torch.stack([units & 15, units >> 4], dim=-1)  # [g, q, r, i, h]
    return both.permute(0, 2, 1, 4, 3).reshape(rows, cols)


def to_ftw_scales(scales: torch.Tensor) -> torch.Tensor:
    """Block scales [N, K/block] in FTW's order (same shape): 16 rows' scales of a block together."""
    n, blocks = scales.shape
    return scales.view(n // ROW_GROUP, ROW_GROUP, blocks).transpose(1, 2).reshape(n, blocks)


def ftw_scales(packed: torch.Tensor, rows: int, blocks: int) -> torch.Tensor:
    """The block scales [rows, blocks] of an FTW scale bank row."""
    return packed.view(rows // ROW_GROUP, blocks, ROW_GROUP).transpose(1, 2).reshape(rows, blocks)


@dataclass(frozen=True)
class BlockFp4Format(ExpertFormat):
    """e2m1 codes with one scale per `block` weights along a row. Banks: `gate_up` and `down`
    codes, then their scales (`gate_up_scales` [2I, H/block], `down_scales` [H, I/block]), then
    whatever `extra_banks` the format adds."""

    block: int = 32
    scale_dtype: str = ""  # the scale bank's element type, as FTW names it

    def banks(self, hidden: int, intermediate: int) -> tuple[BankLayout, ...]:
        shapes = expert_shapes(hidden, intermediate)
        self.check_shapes(hidden, intermediate)
        codes = tuple(BankLayout(name, "e2m1", 4, shape, self.block, PACKING) for name, shape in shapes.items())
        scales = tuple(BankLayout(f"{name}_scales", self.scale_dtype, 8, (rows, cols // self.block), self.block,
                                  SCALE_PACKING) for name, (rows, cols) in shapes.items())
        return codes + scales + self.extra_banks()

    def extra_banks(self) -> tuple[BankLayout, ...]:
        return ()

    @property
    def size_multiple(self) -> int:
        return GROUP

    def check_shapes(self, hidden: int, intermediate: int) -> None:
        for what, n in (("hidden", hidden), ("expert intermediate", intermediate)):
            if n % GROUP:
                raise ValueError(f"{self.name} experts: {what} size {n} is not a multiple of {GROUP} (FTW packs the "
                                 f"4-bit codes of {GROUP} columns together)")

    # The scale type: bytes ↔ fp32, and the rounding rule that picks a block's scale.
    @abstractmethod
    def scale_values(self, scales: torch.Tensor) -> torch.Tensor:
        """fp32 values of scale bytes (uint8, any shape and device)."""

    @abstractmethod
    def quantize(self, w: torch.Tensor, name: str) -> QuantizedMatrix:
        """A float matrix [N, K] rounded into this format (the rule in the format's docstring)."""

    @abstractmethod
    def check_scales(self, m: QuantizedMatrix) -> None:
        """ValueError naming the tensor, row and block of the first scale that is not a number."""

    @abstractmethod
    def random(self, rows: int, cols: int, std: float, generator: torch.Generator, name: str) -> QuantizedMatrix:
        """A random matrix drawn in this format directly (`--random-weights`): codes uniform, scales
        such that the weights' standard deviation is about `std`."""

    def encode(self, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
        _, intermediate = check_expert_shapes(gate_up, down)
        w = gate_up.float()
        return self.pack(self.quantize(w[:intermediate], "gate"), self.quantize(w[intermediate:], "up"),
                         self.quantize(down.float(), "down"))

    def pack(self, gate: QuantizedMatrix, up: QuantizedMatrix, down: QuantizedMatrix) -> dict[str, torch.Tensor]:
        hidden, intermediate = down.shape
        self.check_shapes(hidden, intermediate)
        for m, want in ((gate, (intermediate, hidden)), (up, (intermediate, hidden)), (down, (hidden, intermediate))):
            self.check_matrix(m, want)
        rows = {"gate_up": torch.cat([to_ftw_packing(gate.codes), to_ftw_packing(up.codes)]),
                "down": to_ftw_packing(down.codes),
                "gate_up_scales": torch.cat([to_ftw_scales(gate.scales), to_ftw_scales(up.scales)]),
                "down_scales": to_ftw_scales(down.scales)}
        return {name: t.contiguous().reshape(-1) for name, t in (rows | self.extra_rows(gate, up, down)).items()}

    def extra_rows(self, gate: QuantizedMatrix, up: QuantizedMatrix,
                   down: QuantizedMatrix) -> dict[str, torch.Tensor]:
        return {}

    def check_matrix(self, m: QuantizedMatrix, shape: tuple[int, int]) -> None:
        """ValueError naming the tensor whose codes or scales do not fit `shape` [rows, cols]."""
        rows, cols = shape
        for part, t, want in (("codes", m.codes, (rows, cols // 2)), ("scales", m.scales, (rows, cols // self.block))):
            if t.dtype != torch.uint8 or tuple(t.shape) != want:
                raise ValueError(f"{m.name}: {self.name} {part} are {t.dtype} {list(t.shape)}, expected uint8 "
                                 f"{list(want)} for a [{rows}, {cols}] matrix")
        self.check_scales(m)

    def dequantize(self, rows: Mapping[str, torch.Tensor], hidden: int,
                   intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (gate_up [2I, H], down [H, I]): `E2M1[code] · scale` of each weight."""
        out = []
        for name, (r, c) in expert_shapes(hidden, intermediate).items():
            out.append(self._scaled(ftw_codes(rows[name], r, c), self.block_scales(rows, name, r, c // self.block)))
        return out[0], out[1]

    def dequantize_matrix(self, m: QuantizedMatrix) -> torch.Tensor:
        """fp32 [rows, cols] of a matrix as checkpoints store it: `E2M1[code] · scale · tensor scale`."""
        self.check_scales(m)
        scale = self.scale_values(m.scales) * (m.tensor_scale if m.tensor_scale is not None else 1.0)
        return self._scaled(unpack_pairs(m.codes), scale)

    def _scaled(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """fp32 [r, c]: `E2M1[code] · scale` of codes [r, c] (one a byte) and block scales [r, c/block]."""
        r, c = codes.shape
        values = e2m1_table(codes.device)[codes.long()].view(r, c // self.block, self.block)
        return (values * scale[:, :, None]).view(r, c)

    def block_scales(self, rows: Mapping[str, torch.Tensor], name: str, r: int, blocks: int) -> torch.Tensor:
        """fp32 [r, blocks]: the scale of every block of the bank's matrix."""
        return self.scale_values(ftw_scales(rows[f"{name}_scales"], r, blocks))
