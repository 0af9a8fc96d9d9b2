"""bf16 experts: the weights themselves, rounded to bfloat16 (round to nearest, ties to even).

Banks: `gate_up` [2I, H] (gate rows first) and `down` [H, I], 16 bits per weight, no scales. The
CPU kernels dot bf16 rows directly (AVX-512 BF16) or widen them to fp32 (AVX2); the Triton kernels
view the slots as bfloat16.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ftc_runtime.formats.base import (
    EXPERT_TENSORS,
    BankLayout,
    CpuTemplate,
    ExpertFormat,
    check_expert_shapes,
    expert_shapes,
)


class Bf16Format(ExpertFormat):
    def banks(self, hidden: int, intermediate: int) -> tuple[BankLayout, ...]:
        return tuple(BankLayout(name, "bf16", 16, shape, 1, "")
                     for name, shape in expert_shapes(hidden, intermediate).items())

    def encode(self, gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
        check_expert_shapes(gate_up, down)
        # torch's conversion to bfloat16 rounds to nearest even (from fp32; wider inputs pass through fp32).
        return {name: t.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(-1)
                for name, t in zip(EXPERT_TENSORS, (gate_up, down), strict=True)}

    def dequantize(self, rows: Mapping[str, torch.Tensor], hidden: int,
                   intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the rows as bfloat16 (no copy)."""
        shapes = expert_shapes(hidden, intermediate)
        gate_up, down = (rows[name].view(torch.bfloat16).view(shapes[name]) for name in EXPERT_TENSORS)
        return gate_up, down


FORMAT = Bf16Format(
    name="bf16",
    cpu_templates={"avx512_bf16": CpuTemplate("cpu/expert_ffn_bf16_avx512.cpp.j2", 32, tile_min_avx512=16),
                   "avx2": CpuTemplate("cpu/expert_ffn_bf16_avx2.cpp.j2", 8)},
    triton_template="triton/expert_ffn_bf16.py.j2", slot_dtype=torch.bfloat16)
