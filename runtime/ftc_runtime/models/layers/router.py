"""The softmax top-k router of the routed experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(h: torch.Tensor, gate_w: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k router: expert ids [T, k] and fp32 weights [T, k]. On a GPU the selection is
    one Triton kernel (`router_kernel`), for prompt chunks and decode steps alike."""
    logits = F.linear(h, gate_w)
    if logits.is_cuda:
        from ftc_runtime.models.layers.router_kernel import softmax_top_k_gpu  # Triton: beside a GPU

        return softmax_top_k_gpu(logits, top_k, renormalize)
    return softmax_top_k(logits, top_k, renormalize)


def softmax_top_k(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most probable experts of each row of router logits [T, E] and their probabilities."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights
