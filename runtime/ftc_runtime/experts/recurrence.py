"""`RecurrenceMeter`: whether the model's routing recurs, measured on the prompt, which decides
whether the adaptive split's recency rule runs while it decodes.

The rule fills every miss that the CPU computed within the last W tokens: a routed expert that
comes back soon is then a hit. That pays where routing recurs, as real models' does (the recorded
Qwen3-30B-A3B trace: 60% of a token's experts were routed within the 4 tokens before, in the same
layer). Where the experts are drawn at random (a benchmark's uniform routing) an expert recurs
only at the base rate 1 − (1 − k/E)^W, 23% for 8 of 128 experts, so a fill brings an expert no
likelier to be hit than the one it evicts, and each copy is pure cost: on an H100 that rule alone
put adaptive 23% behind the CPU alone (docs/performance.md).

So each prompt chunk's routed experts are counted, per layer: the (token, expert) pairs whose
expert one of the W tokens before it in the chunk routed to as well. At the prompt's end the rule
is kept where that share exceeds the base rate by EXCESS of what the base rate leaves (1 − base),
else turned off until another prompt says otherwise. The count runs on the routes' own device and
is read once, at the prompt's end."""

from __future__ import annotations

import numpy as np
import torch

# How far above the base rate, as a share of 1 − base, the recurring pairs keep the recency rule:
# uniform routing sits at the base rate; the trace replayed into qwen3-30b-a3b's top 8 (its 6, the
# router's 2 more) at about 0.51 against a base of 0.23, a threshold of 0.38.
EXCESS = 0.2
MIN_PAIRS = 512  # counted pairs a prompt needs before it decides; fewer leave the rule as it was
LAST_TOKENS = 512  # of each layer's prompt chunk, the tokens counted (the count is O(tokens × experts))


def recurring_pairs(ids: torch.Tensor, num_experts: int, window: int) -> torch.Tensor:
    """Of ids [T, k] (one layer's routed experts, T tokens in order), the pairs (t, j) with
    t ≥ window whose expert one of tokens t − window .. t − 1 routed to: an int64 scalar on ids'
    device."""
    t = ids.shape[0]
    if t <= window:
        return torch.zeros((), dtype=torch.int64, device=ids.device)
    routed = torch.zeros(t + 1, num_experts, dtype=torch.int32, device=ids.device)
    routed[1:].scatter_(1, ids.long(), 1)
    before = routed.cumsum(0)  # row i: how often tokens 0 .. i - 1 routed to each expert
    rows = torch.arange(window, t, device=ids.device)
    seen = (before[rows] - before[rows - window]).gather(1, ids[window:].long())
    return (seen > 0).sum()


def base_share(k: int, num_experts: int, window: int) -> float:
    """The share of pairs that recur within `window` tokens when each token draws its k experts
    at random."""
    return 1.0 - (1.0 - k / num_experts) ** window


class RecurrenceMeter:
    def __init__(self, num_experts: int, window: int):
        self.num_experts, self.window = num_experts, window
        self._recurring: torch.Tensor | None = None
        self._pairs, self._k = 0, 0

    def observe(self, ids: torch.Tensor | np.ndarray) -> None:
        """One layer's routed experts of a prompt chunk, [T, k], in token order."""
        ids = torch.from_numpy(np.ascontiguousarray(ids)) if isinstance(ids, np.ndarray) else ids
        ids = ids[-LAST_TOKENS:]
        if ids.shape[0] <= self.window:
            return
        counted = recurring_pairs(ids, self.num_experts, self.window)
        self._recurring = counted if self._recurring is None else self._recurring + counted.to(self._recurring.device)
        self._pairs += (ids.shape[0] - self.window) * ids.shape[1]
        self._k = ids.shape[1]

    def decide(self) -> bool | None:
        """Whether the prompt's routing recurred enough for the recency rule (None: too few pairs
        counted to tell); the counts start again."""
        recurring, pairs, k = self._recurring, self._pairs, self._k
        self._recurring, self._pairs = None, 0
        if pairs < MIN_PAIRS or recurring is None:
            return None
        base = base_share(k, self.num_experts, self.window)
        return int(recurring) / pairs >= base + EXCESS * (1.0 - base)
