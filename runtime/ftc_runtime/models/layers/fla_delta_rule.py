"""The Gated DeltaNet recurrence on a GPU with flash-linear-attention's Triton kernels (the
`fla-core` package, 0.6): the chunked kernel for prompts, the fused recurrent one for single tokens.

Optional: where the package is missing (CI, CPU-only installs) `fla_available()` is False and the
torch code of gated_deltanet.py runs, on any device. The package (and Triton under it) is imported
at the first GPU call, never by a CPU engine. The kernels take q and k before their L2 norm (they
normalize inside), grouped value heads as they are, and keep the state in fp32.

A prompt that captures states inside itself (recurrent-state checkpoints) still runs as one chunked
call: its stages are called one by one, as fla's `chunk_gated_delta_rule` calls them, so that the
state at the start of every block of `BLOCK` tokens (which its output stage reads) is kept, and a
captured state is the state of its token's block advanced over the block's tokens up to it by the
fused recurrent kernel, all captures of a call in one varlen call. A capture so costs a gather and
a share of one small kernel, not a chunked call of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

BLOCK = 64  # tokens per block of the chunked kernels; their per-block states lie this far apart


@dataclass(frozen=True)
class _Fla:
    chunked: Callable  # chunk_gated_delta_rule
    recurrent: Callable  # fused_recurrent_gated_delta_rule
    l2norm: Callable  # the stages of the chunked call
    cumsum: Callable
    intra: Callable
    block_states: Callable
    outputs: Callable
    rcp_ln2: float


@functools.cache
def _kernels() -> _Fla | None:
    """fla's kernels, or None where the package, or Triton under it, is not installed."""
    try:
        from fla.modules.norm.l2norm import l2norm_fwd
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2
    except ImportError:
        return None
    return _Fla(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, l2norm_fwd, chunk_local_cumsum,
                chunk_gated_delta_rule_fwd_intra, chunk_gated_delta_rule_fwd_h, chunk_fwd_o, RCP_LN2)


def fla_available() -> bool:
    return _kernels() is not None


def fla_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, capture: tuple[int, ...] = ()
                   ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """`gated_deltanet.delta_rule`'s contract: one kernel call over the whole sequence."""
    fla = _kernels()
    q, k, v, g = (x.contiguous()[None] for x in (q, k, v, g))
    beta, s0, scale = beta.to(v.dtype).contiguous()[None], state[None].float(), q.shape[-1] ** -0.5
    t = q.shape[1]
    if capture and t > 1:
        out, final, blocks = _chunked_keeping_block_states(fla, q, k, v, g, beta, s0, scale)
        return out[0], final[0], _captured(fla, q, k, v, g, beta, s0, scale, blocks, final, capture)
    kernel = fla.recurrent if t == 1 else fla.chunked
    out, final = kernel(q, k, v, g=g, beta=beta, scale=scale, initial_state=s0, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
    return out[0], final[0], [final[0].clone()] if capture else []  # one token: its state is the final one


def _chunked_keeping_block_states(fla: _Fla, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, s0: torch.Tensor, scale: float
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fla's chunked forward, stage by stage: (outputs [1, T, v heads, v dim], the final state
    [1, v heads, k dim, v dim] fp32, the state before each block [1, blocks, v heads, k dim, v dim]
    in the inputs' dtype)."""
    qn, _ = fla.l2norm(q)
    kn, _ = fla.l2norm(k)
    cum = fla.cumsum(g, chunk_size=BLOCK, scale=fla.rcp_ln2)  # the kernels' decays are powers of 2
    w, u, _ = fla.intra(k=kn, v=v, g=cum, beta=beta, chunk_size=BLOCK)
    blocks, v_new, final = fla.block_states(k=kn, w=w, u=u, g=cum, initial_state=s0, output_final_state=True,
                                            chunk_size=BLOCK)
    out = fla.outputs(q=qn, k=kn, v=v_new, h=blocks, g=cum, scale=scale, chunk_size=BLOCK)
    return out.to(q.dtype), final, blocks


def _captured(fla: _Fla, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              s0: torch.Tensor, scale: float, blocks: torch.Tensor, final: torch.Tensor,
              capture: tuple[int, ...]) -> list[torch.Tensor]:
    """The state after each token index in `capture`: the final state after the last token, the
    state of a block for the token before it, else the block's state advanced over the block's
    tokens up to the captured one (the first block from the fp32 initial state itself)."""
    t = q.shape[1]
    ends = [i + 1 for i in capture]
    partial = [e for e in ends if e < t and e % BLOCK]
    advanced = iter(_advanced(fla, q, k, v, g, beta, s0, scale, blocks, partial) if partial else ())
    taken = []
    for e in ends:
        if e == t:
            taken.append(final[0].clone())
        elif e % BLOCK:
            taken.append(next(advanced))
        else:
            taken.append(blocks[0, e // BLOCK].float())
    return taken


def _advanced(fla: _Fla, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              s0: torch.Tensor, scale: float, blocks: torch.Tensor, ends: list[int]) -> torch.Tensor:
    """The states after the first `e` tokens, for each e in `ends` (none a multiple of BLOCK):
    each block's start state run over its first e mod BLOCK tokens, as one sequence each of one
    varlen call of the fused recurrent kernel."""
    index, bounds = _pieces(tuple(ends), q.device)
    first = torch.cat([s0 if e < BLOCK else blocks[:, e // BLOCK].float() for e in ends])
    _, states = fla.recurrent(*(x[:, index] for x in (q, k, v)), g=g[:, index], beta=beta[:, index], scale=scale,
                              initial_state=first, output_final_state=True, use_qk_l2norm_in_kernel=True,
                              cu_seqlens=bounds)
    return states


@functools.lru_cache(maxsize=8)
def _pieces(ends: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens from each end's block start up to it, and the pieces' bounds (cumulative
    lengths), on `device`: built once for all the linear layers of a prompt chunk, by kernels
    alone (a host→device copy would wait behind the chunk's expert copies, the host with it)."""
    starts = [e - e % BLOCK for e in ends]
    index = torch.cat([torch.arange(a, e, device=device) for a, e in zip(starts, ends, strict=True)])
    lengths = [torch.full((1,), e - a, device=device) for a, e in zip(starts, ends, strict=True)]
    return index, torch.cat([torch.zeros(1, dtype=torch.long, device=device), *lengths]).cumsum(0)
