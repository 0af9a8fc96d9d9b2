"""The hyper-connections' mixing weights on the GPU as one Triton kernel, one program per token:
from the block's linear map of the streams (`mixes`, fp32), `pre` and `post` by their sigmoids and
the hc × hc mixing matrix by a softmax over each row and then the Sinkhorn steps (columns first,
then rows and columns), all in registers. In torch (and in torch.compile's kernels) every
half-step of Sinkhorn is a reduction of its own: some forty launches per block, the larger part
of a DeepSeek-V4 decode step's kernels, where this is one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _hc_mix(mixes, base, scale, pre_out, post_out, comb_out, hc_eps, HC: tl.constexpr, HP: tl.constexpr,
            ITERS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = mixes + t * (2 + HC) * HC
    i = tl.arange(0, HP)
    ok = i < HC
    pre = tl.sigmoid(tl.load(row + i, mask=ok, other=0.0) * tl.load(scale)
                     + tl.load(base + i, mask=ok, other=0.0)) + hc_eps
    post = 2 * tl.sigmoid(tl.load(row + HC + i, mask=ok, other=0.0) * tl.load(scale + 1)
                          + tl.load(base + HC + i, mask=ok, other=0.0))
    r, c = i[:, None], i[None, :]
    inside = (r < HC) & (c < HC)
    at = 2 * HC + r * HC + c
    logits = tl.load(row + at, mask=inside, other=0.0) * tl.load(scale + 2) + tl.load(base + at, mask=inside, other=0.0)
    logits = tl.where(inside, logits, float("-inf"))
    e = tl.where(inside, tl.exp(logits - tl.max(logits, 1)[:, None]), 0.0)
    # the padding (rows and columns past HC) held at zero through every normalization
    comb = tl.where(inside, e / tl.sum(e, 1)[:, None] + hc_eps, 0.0)
    comb = comb / (tl.sum(comb, 0)[None, :] + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        comb = comb / (tl.sum(comb, 1)[:, None] + hc_eps)
        comb = comb / (tl.sum(comb, 0)[None, :] + hc_eps)
    tl.store(pre_out + t * HC + i, pre, mask=ok)
    tl.store(post_out + t * HC + i, post, mask=ok)
    tl.store(comb_out + t * HC * HC + r * HC + c, comb, mask=inside)


def hc_mix_gpu(mixes: torch.Tensor, hc: int, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
               sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [T, (2 + hc) · hc] fp32 of `hc` streams, base [(2 + hc) · hc] and scale [3] → (pre
    [T, hc], post [T, hc], comb [T, hc, hc]) fp32, as `hyper_connections.hc_mix`."""
    t, width = mixes.shape
    if (2 + hc) * hc != width or sinkhorn_iters < 1:
        raise ValueError(f"hc_mix: mixes of width {width} (not hc² + 2 · hc), {sinkhorn_iters} Sinkhorn steps")
    pre = torch.empty(t, hc, dtype=torch.float32, device=mixes.device)
    post = torch.empty_like(pre)
    comb = torch.empty(t, hc, hc, dtype=torch.float32, device=mixes.device)
    if t:
        _hc_mix[(t,)](mixes.float().contiguous(), base.float().contiguous(), scale.float().contiguous(), pre, post,
                      comb, hc_eps, HC=hc, HP=triton.next_power_of_2(hc), ITERS=sinkhorn_iters)
    return pre, post, comb
