"""Checks a built expert kernel against a float64 torch reference on fresh random inputs: the
weights as the expert format's own dequantization gives them, so only the kernel's arithmetic is
measured, not the format's rounding."""

from __future__ import annotations

import torch

from ftc_runtime.experts.base import group_by_expert, swiglu
from ftc_runtime.experts.cpu_kernel import CpuExpertKernel
from ftc_runtime.io.ftw import ExpertPool

# Relative error bounds: the AVX-512 kernels round activations to bf16 (8 significant bits; the
# 4-bit ones: two int8 parts per 32 columns, about 15 bits); the AVX2 kernels keep them fp32, so
# only fp32 summation order differs from the reference.
TOLERANCE = {"avx512_bf16": 1e-2, "avx2": 1e-4}


class KernelCheckError(RuntimeError):
    """A generated kernel disagrees with the torch reference."""


def reference_moe(pool: ExpertPool, x: torch.Tensor, row_ids: torch.Tensor, weights: torch.Tensor,
                  swiglu_limit: float = 0.0) -> torch.Tensor:
    """Σ_k w[t,k] · down(swiglu(gate x_t, up x_t)) in float64; row_ids [T, k] are FTW rows. Each
    expert is dequantized once and computes all its tokens together."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for row in row_ids.unique().tolist():
        t, k = (row_ids == row).nonzero(as_tuple=True)
        gate_up, down = (w.double() for w in pool.header.dequantize(pool.experts[row]))
        gate, up = (x[t].double() @ gate_up.T).chunk(2, dim=-1)
        out.index_add_(0, t, weights[t, k, None].double() * (swiglu(gate, up, swiglu_limit) @ down.T))
    return out


def check_expert_kernel(kernel: CpuExpertKernel, pool: ExpertPool, top_k: int, n_tokens: int,
                        seed: int, swiglu_limit: float = 0.0, shared_experts: bool = False) -> dict:
    """Routes n_tokens random tokens to top_k random experts of one random MoE layer (with
    `shared_experts`, the same top_k for every token: n_tokens each, as a prompt chunk gives
    them, so that a kernel with tiles runs them)."""
    g = torch.Generator().manual_seed(seed)
    e = pool.header.num_experts
    layer = int(torch.randint(pool.header.num_moe_layers, (1,), generator=g))
    if shared_experts:
        ids = torch.randperm(e, generator=g)[:top_k].repeat(n_tokens, 1)
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(n_tokens)])
    weights = torch.rand(n_tokens, top_k, generator=g)
    x = torch.randn(n_tokens, kernel.hidden, generator=g)
    out = torch.randn(n_tokens, kernel.hidden, generator=g)  # accumulated into: start from noise
    start = out.clone()
    kernel.run(pool.experts, x, out, *group_by_expert(layer * e, ids, weights))
    ref = reference_moe(pool, x, ids + layer * e, weights, swiglu_limit)
    got = out.double() - start.double()
    rel = float((got - ref).norm() / ref.norm())
    what = f"{n_tokens} tokens × top-{top_k}" + (" (each expert all of them)" if shared_experts else "")
    if not rel <= TOLERANCE[kernel.isa]:  # also catches NaN
        raise KernelCheckError(f"{kernel.isa} expert kernel ({kernel.tile_backend} tiles), {what}: relative "
                               f"error {rel:.3e} exceeds {TOLERANCE[kernel.isa]:.0e}")
    return {"tokens": n_tokens, "top_k": top_k, "shared_experts": shared_experts, "rel_error": rel}
