"""`DraftOracle`: drafts of a set quality, to measure what verification costs the engine at a given
acceptance (`ftc bench decode --draft-oracle P`). With random weights no drafter's acceptance means
anything: the oracle knows the greedy answer and drafts its next tokens, each replaced by another
token with probability 1 - P. The figures it gives are the system's cost at acceptance P, not a
drafter's: they are labelled so wherever they are reported.

The sequence then follows the known answer itself (`AnswerSampler`): with random weights the top
logits are near ties, which the bf16 rounding of a pass of several tokens, unlike that of a
one-token step, would often break the other way; past the first such token the answer's drafts
would be wrong whatever P. Every pass still runs and verifies its drafts as it would, and with P
the chance that a draft is the next token, the acceptance is P's."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ftc_runtime.sampling import Sampler, SamplingParams


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

    def sampler(self, prompt_ids: Iterable[int]) -> AnswerSampler:
        return AnswerSampler(self.answer, prompt_ids)


class AnswerSampler(Sampler):
    """Greedy along the known answer: the token it picks at each position is the answer's, the
    logits' argmax past its end (`forced`, which the acceptance rule takes as the target's own)."""

    def __init__(self, answer: tuple[int, ...], prompt_ids: Iterable[int] = ()):
        super().__init__(SamplingParams(0.0), list(prompt_ids))
        self.answer, self.picked = answer, 0

    def forced(self) -> int | None:
        return self.answer[self.picked] if self.picked < len(self.answer) else None

    def record(self, token: int) -> None:
        self.picked += 1
        super().record(token)


class OracleDrafter:
    """Follows the answer by how many of its tokens were given out (`add`); `propose(k)` drafts the
    next k, each wrong with probability 1 - P (a uniformly drawn other token). With a `drafter`
    that costs time to run (the MTP layer's), that one runs as it would and its drafts are
    replaced: the figures then include drafting's cost, not only verification's."""

    def __init__(self, oracle: DraftOracle, context: Iterable[int] = (), drafter: Any = None):
        del context  # the answer is known: the context only tells where it starts, which `add` counts
        self.oracle, self.given, self.drafter = oracle, 0, drafter
        self.rng = random.Random(oracle.seed)
        self.reads_hidden = drafter is not None and drafter.reads_hidden

    def add(self, token: int) -> None:
        self.given += 1
        if self.drafter is not None:
            self.drafter.add(token)

    def observe(self, hidden: torch.Tensor) -> None:
        self.drafter.observe(hidden)

    def propose(self, k: int) -> list[int]:
        if self.drafter is not None and k > 0:
            self.drafter.propose(k)
        o = self.oracle
        return [t if self.rng.random() < o.accuracy else (t + 1 + self.rng.randrange(o.vocab_size - 1)) % o.vocab_size
                for t in o.answer[self.given:self.given + max(k, 0)]]
