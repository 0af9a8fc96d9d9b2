"""DeepSeek-V4's routers: scores sqrt(softplus(W h)) in fp32; the learned router picks the top-k of
scores + `e_score_correction_bias`, the hash router takes the token id's fixed row of `tid2eid`
[vocab, k] (the first layers), and both weight the chosen experts by their unbiased scores,
normalized, times `routed_scaling_factor`."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sqrt_softplus_scores(h: torch.Tensor, gate_w: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(F.softplus(F.linear(h.float(), gate_w.float())))


def _weights(scores: torch.Tensor, ids: torch.Tensor, scaling: float) -> torch.Tensor:
    w = scores.gather(1, ids)
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scaling


def route_biased(h: torch.Tensor, gate_w: torch.Tensor, bias: torch.Tensor, top_k: int,
                 scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] (by score + bias) and fp32 weights [T, k] of h [T, hidden]."""
    scores = sqrt_softplus_scores(h, gate_w)
    ids = torch.topk(scores + bias.float(), top_k, dim=-1).indices
    return ids, _weights(scores, ids, scaling)


def route_hashed(h: torch.Tensor, token_ids: torch.Tensor, gate_w: torch.Tensor, tid2eid: torch.Tensor,
                 scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts of each token id (`tid2eid` [vocab, k]) and their fp32 weights."""
    ids = tid2eid[token_ids.reshape(-1)].long()
    return ids, _weights(sqrt_softplus_scores(h, gate_w), ids, scaling)
