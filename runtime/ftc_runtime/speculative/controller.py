"""`DraftController`: how many drafts each pass of `--speculate auto` verifies, 0 included, from what
the sequence's own passes measured. A pass of n tokens costs its measured seconds t(n) (the union
of n tokens' experts: each extra token's misses cost PCIe or CPU time), and with drafts accepted at
rate p (each draft kept only if every one before it was) k drafts give out on average
E(k) = 1 + p + ... + p^k tokens. The controller picks the k of the most tokens a second,
E(k) / t(k + 1), and drafts none unless that beats a plain step by more than run-to-run noise.

- p: the maximum-likelihood rate of the passes so far (a pass that kept a of k drafts: a accepted,
  one rejected if a < k), their counts decaying so that it follows the text (code copied from the
  prompt, then prose).
- t(n): a moving average per pass size, a plain step's measured first, from the third pass of
  that size on (on a GPU the first runs eagerly and the second captures the size's CUDA graph,
  each many times a replay's time: counted, they would stop the drafting); a size not yet timed is
  interpolated between the sizes that have run, flat past them (with only a plain step known,
  optimism tries the largest pass next, after which two sizes bound the rest).
- A sequence that drafts nothing measures no p: now and then one pass drafts a token again (a
  probe), the dearer a probe the rarer (`probe_every`).
"""

from __future__ import annotations

import numpy as np

MARGIN = 0.01  # drafts must beat a plain step by this much: a tie drafts nothing
DECAY = 0.95  # weight of the acceptance counts so far at each new pass (about 20 passes remembered)
AVERAGE = 0.2  # weight of a new pass's seconds in its size's moving average
# A sequence that drafts nothing probes: one pass drafts a token, p measured anew. Probes are spaced
# so that their time beyond plain steps' is PROBE_COST of the plain steps' between them.
PROBE_COST = 0.005
MIN_PROBE_EVERY, MAX_PROBE_EVERY = 16, 1024
WARM_PASSES = 2  # passes of each size not timed: a GPU's eager first run and its graph's capture


class DraftController:
    def __init__(self, k_max: int, prior_rate: float = 0.5):
        if k_max < 1:
            raise ValueError(f"draft controller: k_max = {k_max}, expected at least 1")
        self.k_max = k_max
        self.accepted, self.rejected = prior_rate, 1.0 - prior_rate  # a prior worth one draft
        self.seconds: dict[int, float] = {}  # pass size n (tokens) → moving average
        self.runs: dict[int, int] = {}  # pass size n → passes run
        self.plain_since_probe = 0

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def choose(self) -> int:
        """Drafts for the next pass: the k of the most tokens a second, 0 unless it beats a plain
        step by MARGIN. First a plain step (what drafts must beat); after PROBE_EVERY plain steps
        in a row, one draft (the cheapest pass that measures p again)."""
        if 1 not in self.seconds:
            return 0
        if self.plain_since_probe >= self.probe_every():
            return 1
        per_second = [self.tokens(k) / self.pass_seconds(k + 1) for k in range(self.k_max + 1)]
        best = int(np.argmax(per_second))
        return best if per_second[best] > per_second[0] * (1 + MARGIN) else 0

    def probe_every(self) -> int:
        """Plain steps between probes: a probe's time beyond that of the tokens it gives out at a
        plain step's pace is PROBE_COST of theirs (within MIN_PROBE_EVERY..MAX_PROBE_EVERY)."""
        plain = self.seconds[1]
        excess = max(self.pass_seconds(2) - plain * self.tokens(1), 0.0)
        return int(min(max(excess / (PROBE_COST * plain), MIN_PROBE_EVERY), MAX_PROBE_EVERY))

    def tokens(self, k: int) -> float:
        """E(k): tokens a pass with k drafts gives out, on average."""
        return sum(self.rate ** i for i in range(k + 1))

    def pass_seconds(self, n: int) -> float:
        """t(n): measured, else interpolated between the sizes measured (flat past their ends)."""
        if n in self.seconds:
            return self.seconds[n]
        sizes = sorted(self.seconds)
        return float(np.interp(n, sizes, [self.seconds[s] for s in sizes]))

    def record(self, drafts: int, kept: int, seconds: float) -> None:
        """A pass that verified `drafts` drafts (0: a plain step), kept `kept` of them, in `seconds`."""
        n = drafts + 1
        self.runs[n] = self.runs.get(n, 0) + 1
        if self.runs[n] > WARM_PASSES:
            old = self.seconds.get(n)
            self.seconds[n] = seconds if old is None else (1 - AVERAGE) * old + AVERAGE * seconds
        if drafts == 0:
            self.plain_since_probe += 1
            return
        self.plain_since_probe = 0
        self.accepted = DECAY * self.accepted + kept
        self.rejected = DECAY * self.rejected + (1 if kept < drafts else 0)
