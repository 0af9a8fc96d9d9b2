"""The softmax top-k router of the routed experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(h: torch.Tensor, gate_w: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k router: expert ids [T, k] and fp32 weights [T, k]."""
    probs = torch.softmax(F.linear(h, gate_w), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


