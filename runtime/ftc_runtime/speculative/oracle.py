"""`DraftOracle`: drafts of a set quality, to measure what verification costs the engine at a given
acceptance (`ftc bench decode --draft-oracle P`). With random weights no drafter's acceptance means
anything: the oracle knows the greedy answer and drafts its next tokens, each replaced by another
token with probability 1 - P. The figures it gives are the system's cost at acceptance P, not a
drafter's: they are labelled so wherever they are reported."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class DraftOracle:
    answer: tuple[int, ...]  # the greedy answer after the prompt, its first token included
    accuracy: float  # P: the chance that a draft is the answer's token
    vocab_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.accuracy <= 1.0:
            raise ValueError(f"--draft-oracle {self.accuracy}: expected a probability in [0, 1]")
        if self.vocab_size < 2:
            raise ValueError(f"draft oracle: a vocabulary of {self.vocab_size} has no wrong token")

    def __str__(self) -> str:
        return f"oracle (P = {self.accuracy:g})"


class OracleDrafter:
    """Follows the answer by how many of its tokens were given out (`add`); `propose(k)` drafts the
    next k, each wrong with probability 1 - P (a uniformly drawn other token)."""

    reads_hidden = False

    def __init__(self, oracle: DraftOracle, context: Iterable[int] = ()):
        del context  # the answer is known: the context only tells where it starts, which `add` counts
        self.oracle, self.given = oracle, 0
        self.rng = random.Random(oracle.seed)

    def add(self, token: int) -> None:
        self.given += 1

    def propose(self, k: int) -> list[int]:
        o = self.oracle
        return [t if self.rng.random() < o.accuracy else (t + 1 + self.rng.randrange(o.vocab_size - 1)) % o.vocab_size
                for t in o.answer[self.given:self.given + max(k, 0)]]
