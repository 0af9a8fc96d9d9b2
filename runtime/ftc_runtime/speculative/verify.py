"""The acceptance rule of speculative decoding: which drafts a verification pass keeps, and the
token that follows them. The target's distribution at each position is the plain sampler's
(`Sampler.distribution`: penalties, top-k, temperature, top-p), so the tokens given out are
distributed as without speculation; at temperature 0 they are the same tokens.

Every draft is deterministic (prompt lookup, or the MTP layer's greedy token): its distribution q
is a point mass on the drafted token d.
The standard rule (Leviathan et al. 2023; Chen et al. 2023) accepts d with probability
min(1, p(d) / q(d)) = p(d), and on rejection draws from max(p - q, 0) normalized, which is p with d
removed. A token x ≠ d then comes out with probability (1 - p(d)) · p(x) / (1 - p(d)) = p(x), and d
with p(d): the distribution p exactly."""

from __future__ import annotations

import torch

from ftc_runtime.sampling import Sampler


def verify(sampler: Sampler, logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """The tokens a verification pass gives out: `logits` [len(drafts) + 1, vocab], row i the
    target's after the pass's i-th token (the sequence's next token, then the drafts). Each draft
    is judged in turn; the first one rejected is replaced by the target's own token and the rest
    are dropped (their rows followed a token that is not the sequence's); when all are accepted,
    the target's token after the last follows. So 1 to len(drafts) + 1 tokens, the sampler having
    recorded each as a plain step would have."""
    tokens = []
    for row, draft in zip(logits, drafts, strict=False):
        tokens.append(judge(sampler, row, draft))
        if tokens[-1] != draft:
            return tokens
    tokens.append(sampler(logits[len(drafts)]))
    return tokens


def judge(sampler: Sampler, logits: torch.Tensor, draft: int) -> int:
    """The token at a draft's position: `draft` where accepted, else the target's replacement.
    Greedy (or a token the reasoning budget forces): the target's own token, which accepts the
    draft where they are equal. Sampling: the rule above, from the sampler's seeded stream."""
    if sampler.greedy or sampler.forced() is not None:
        return sampler(logits)
    p = sampler.distribution(logits)
    rest = p.clone()
    rest[draft] = 0
    # multinomial normalizes `rest` itself; rest is all zeros only where p(draft) = 1, which u < 1 accepts anyway
    token = draft if sampler.uniform(p.device) < p[draft] or not rest.any() else sampler.draw(rest)
    sampler.record(token)
    return token
