"""The sigmoid top-k router with a selection bias and expert groups (GLM-5, DeepSeek-V3): experts
are chosen by their sigmoid scores plus a learned per-expert bias (which balances the load and
only steers the choice), within the best groups, and weighted by their unbiased scores."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route_sigmoid(h: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                  topk_group: int, renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, hidden] → expert ids [T, top_k] and fp32 weights [T, top_k]. The logits are fp32
    (the gate and bias are kept in fp32: sigmoid scores of 256 experts differ in their last bits).
    With n_group > 1 only the `topk_group` groups whose two best biased scores sum highest are
    eligible. The weights are the chosen experts' scores, normalized to sum 1 where
    `renormalize`, times `scale`."""
    scores = F.linear(h.float(), gate_w.float()).sigmoid()
    choice = scores + bias.float()
    if n_group > 1:
        t, e = choice.shape
        groups = choice.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, groups.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scale
