"""Routed-expert execution: the interface every backend serves, and the CPU backend."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .ftw import ExpertPool
from .kernels import CpuExpertKernel


class ExpertBackend(ABC):
    """Computes the routed experts of one MoE layer, exactly (nothing dropped or approximated)."""

    @abstractmethod
    def forward(self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] fp32; ids [T, top_k] expert indices in the layer; weights [T, top_k] fp32.
        Returns Σ_k weights[t, k] · expert_{ids[t, k]}(x[t]) as [T, hidden] fp32."""

    def end_of_prompt(self) -> None:  # noqa: B027 (an optional hook, empty by default)
        """Called once the prompt of a request has been processed (the static cache pins then)."""


def group_by_expert(base_id: int, ids: torch.Tensor, weights: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, expert) pairs grouped by expert: FTW row ids [m], offsets [m+1], token rows and
    router weights per pair. A token appears at most once per expert (top-k ids are distinct)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    offsets = torch.zeros(experts.numel() + 1, dtype=torch.int32)
    torch.cumsum(counts, 0, out=offsets[1:])
    tok_idx = (order // k).to(torch.int32)
    tok_w = weights.reshape(-1)[order].to(torch.float32).contiguous()
    return (experts + base_id).to(torch.int64), offsets, tok_idx, tok_w


class CpuExperts(ExpertBackend):
    """Every routed expert in place in the host pool, through the engine's generated kernel."""

    def __init__(self, pool: ExpertPool, kernel: CpuExpertKernel):
        self.pool, self.kernel = pool, kernel
        self.num_experts = pool.header.num_experts
        self.gate_up, self.down = pool.bank("gate_up"), pool.bank("down")

    def forward(self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.zeros_like(x)
        expert_ids, offsets, tok_idx, tok_w = group_by_expert(moe_layer * self.num_experts, ids, weights)
        self.kernel.run(self.gate_up, self.down, x, out, expert_ids, offsets, tok_idx, tok_w)
        return out
