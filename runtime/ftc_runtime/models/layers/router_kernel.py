"""The softmax top-k router's selection on the GPU as one Triton kernel, one program per token:
the softmax of the token's router logits in fp32, its k largest probabilities by k passes of
max-and-remove (the lowest expert id first among equals), renormalized where the model says so.
In torch the same is a softmax, a sort-based top-k (two kernels) and a division: four launches
per MoE layer of a decode step, about 12 µs on the device against a few for this one. The
selection is also the epilogue of the router's projection (`gemv_kernel.linear_top_k_gpu`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftc_runtime import dependent_launch
from ftc_runtime.dependent_launch import wait_for_previous


@triton.jit
def store_softmax_top_k(x, ids_out, weights_out, EP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                        RENORMALIZE: tl.constexpr):
    """The selection of one token's logits x ([EP] fp32, -inf past the experts) stored at
    ids_out and weights_out (k entries each)."""
    e = tl.arange(0, EP)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    j = tl.arange(0, KP)
    ids = tl.zeros([KP], dtype=tl.int64)
    weights = tl.zeros([KP], dtype=tl.float32)
    for i in tl.static_range(K):
        best = tl.max(p, 0)
        pick = tl.min(tl.where(p == best, e, EP), 0)
        ids = tl.where(j == i, pick, ids)
        weights = tl.where(j == i, best, weights)
        p = tl.where(e == pick, -1.0, p)  # below every probability: not picked again
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    tl.store(ids_out + j, ids, mask=j < K)
    tl.store(weights_out + j, weights, mask=j < K)


@triton.jit
def _softmax_top_k(logits, ids_out, weights_out, E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr,
                   KP: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    x = tl.load(logits + t * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
    store_softmax_top_k(x, ids_out + t * K, weights_out + t * K, EP, K, KP, RENORMALIZE)


def softmax_top_k_gpu(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → expert ids [T, k] int64 and fp32 weights [T, k], as `router.route`."""
    t, e = logits.shape
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t:
        pdl = dependent_launch.enabled(logits.device)
        _softmax_top_k[(t,)](logits.contiguous(), ids, weights, E=e, EP=triton.next_power_of_2(e), K=top_k,
                             KP=triton.next_power_of_2(top_k), RENORMALIZE=renormalize, PDL=pdl, launch_pdl=pdl)
    return ids, weights
