"""The Gated DeltaNet recurrence on a GPU with flash-linear-attention's Triton kernels (the
`fla-core` package): the chunked kernel for prompts, the fused recurrent one for single tokens.

Optional: where the package is missing (CI, CPU-only installs) `fla_available()` is False and the
torch code of gated_deltanet.py runs, on any device. The package (and Triton under it) is imported
at the first GPU call, never by a CPU engine. The kernels take q and k before their L2 norm (they
normalize inside), grouped value heads as they are, and keep the state in fp32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


@functools.cache
def _kernels() -> tuple[Callable, Callable] | None:
    """(chunked, fused recurrent), or None where the package, or Triton under it, is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def fla_available() -> bool:
    return _kernels() is not None


def fla_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, capture: tuple[int, ...] = ()
                   ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """`gated_deltanet.delta_rule`'s contract. A state inside the sequence exists only at the end
    of a kernel call, so the sequence is run in pieces that end after each captured token (the
    state carried exactly from one to the next)."""
    chunked, recurrent = _kernels()
    t = q.shape[0]
    ends = sorted({i + 1 for i in capture} | {t})
    outs, taken, s, start = [], [], state[None].float(), 0
    for end in ends:
        kernel = recurrent if end - start == 1 else chunked
        o, s = kernel(q[None, start:end], k[None, start:end], v[None, start:end], g=g[None, start:end],
                      beta=beta[None, start:end].to(v.dtype), scale=q.shape[-1] ** -0.5, initial_state=s,
                      output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o[0])
        if end - 1 in capture:
            taken.append(s[0].clone())
        start = end
    return torch.cat(outs) if len(outs) > 1 else outs[0], s[0], taken
