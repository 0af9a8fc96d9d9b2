"""`CpuExperts`: the all-CPU expert backend: every routed expert computed in place in the host pool
by the engine's generated kernel."""

from __future__ import annotations

import numpy as np
import torch

from ftc_runtime.experts.base import ExpertBackend, Routing
from ftc_runtime.experts.cpu_kernel import CpuExpertKernel
from ftc_runtime.io.ftw import ExpertPool


class CpuExperts(ExpertBackend):
    """Every routed expert in place in the host pool, through the engine's generated kernel."""

    def __init__(self, pool: ExpertPool, kernel: CpuExpertKernel):
        self.pool, self.kernel = pool, kernel
        self.num_experts = pool.header.num_experts

    def forward(self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                first_position: int = 0) -> torch.Tensor:
        x = x.contiguous()
        out = torch.zeros_like(x)
        ids, w = self.routed(moe_layer, first_position, ids.numpy().astype(np.int64), weights.float().numpy())
        routing = Routing.build(moe_layer * self.num_experts, ids, w)
        self.kernel.run(self.pool.experts, x, out, *routing.tensors())
        return out
