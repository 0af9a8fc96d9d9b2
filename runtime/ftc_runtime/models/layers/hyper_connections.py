"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual is `hc` streams per token
([T, hc, hidden]). Before each block (attention, MoE) one linear map of the streams' unweighted
RMSNorm gives, per token, `pre` (how the streams collapse into the block's input), `post` (how
the block's output spreads back over them) and an hc × hc mixing matrix made doubly stochastic by
Sinkhorn steps, all in fp32; after the block the streams become post ⊗ out + combᵀ · streams. The
model's head collapses the streams once more (`hyper_head`). Functions of tensors only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftc_runtime.models.layers.norm import rms_norm_fp32_weight


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def hc_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
               hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, hc, hidden] → (pre [T, hc], post [T, hc], comb [T, hc, hc]), fp32; `fn`
    [(2 + hc) · hc, hc · hidden], `base` [(2 + hc) · hc] and `scale` [3] are the block's."""
    mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), eps), fn.float())
    return hc_mix(mixes, base.float(), scale.float(), hc_eps, sinkhorn_iters)


def mixed_streams(mixes: torch.Tensor) -> int:
    """The streams hc of a block's map to mixes [T, (2 + hc) · hc] (hc² + 2 · hc = (hc + 1)² - 1)."""
    return round((mixes.shape[1] + 1) ** 0.5) - 1


# An op of its own, opaque to torch.compile: on a GPU one Triton kernel (`hc_mix_kernel`) where
# torch would launch a reduction for every half-step of Sinkhorn.
@torch.library.custom_op("ftc::hc_mix", mutates_args=())
def hc_mix(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
           sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's mixing weights from its linear map of the streams, mixes [T, (2 + hc) · hc]
    fp32: pre and post by their sigmoids, comb by a row softmax made doubly stochastic by Sinkhorn
    steps (columns first, then rows and columns)."""
    hc = mixed_streams(mixes)
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre_s, post_s, comb_s = scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_s + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * post_s + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


@hc_mix.register_kernel("cuda")
def _hc_mix_cuda(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
                 sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from ftc_runtime.models.layers.hc_mix_kernel import hc_mix_gpu

    return hc_mix_gpu(mixes, mixed_streams(mixes), base, scale, hc_eps, sinkhorn_iters)


@hc_mix.register_fake
def _hc_mix_shape(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
                  sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hc = mixed_streams(mixes)
    return mixes.new_empty(mixes.shape[0], hc), mixes.new_empty(mixes.shape[0], hc), \
        mixes.new_empty(mixes.shape[0], hc, hc)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """The block's input [T, hidden]: the streams weighted by `pre`, summed in fp32."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def block_input(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                norm_w: torch.Tensor, eps: float, hc_eps: float, sinkhorn_iters: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's input [T, hidden]: the streams collapsed by the block's `pre`, RMSNorm'd with its
    fp32 norm weight `norm_w`; and the (post, comb) that spread its output back (`hc_expand`)."""
    pre, post, comb = hc_weights(streams, fn, base, scale, eps, hc_eps, sinkhorn_iters)
    return rms_norm_fp32_weight(hc_collapse(streams, pre), norm_w, eps), post, comb


def hc_expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a block whose output is `out` [T, hidden]: post ⊗ out + combᵀ · streams,
    in the streams' dtype (comb is applied transposed: stream k takes Σ_j comb[j, k] · stream j)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def hyper_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
               hc_eps: float) -> torch.Tensor:
    """The streams collapsed before the final norm: sigmoid weights from their unweighted RMSNorm."""
    mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), eps), fn.float())
    return hc_collapse(streams, torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps)
