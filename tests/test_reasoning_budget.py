"""A reasoning budget (Anthropic's thinking.budget_tokens): the sampler closes `<think>` once the
reasoning holds that many tokens, counting from the prompt's open tag or the model's own, and
leaves every other choice to sampling; served, the thinking block holds exactly the budget."""

from __future__ import annotations

import random

import pytest
import torch

from ftc_runtime.sampling import ReasoningBudget, Sampler, SamplingParams

OPEN, CLOSE, VOCAB = 7, 8, 32


def run(sampler: Sampler, choices: list[int]) -> list[int]:
    """The tokens the sampler returns when sampling alone would give `choices`, one per call
    (greedy over one-hot logits), until `choices` runs out."""
    out, pending = [], list(choices)
    while pending:
        logits = torch.full((VOCAB,), -10.0)
        logits[pending[0]] = 10.0
        token = sampler(logits)
        out.append(token)
        if token == pending[0]:
            pending.pop(0)
    return out


def reference(budget: int, prompt_open: bool, choices: list[int]) -> list[int]:
    """The same, written out: a reasoning token past the budget is replaced by the closing tag
    (and sampling's choice comes on the next call); where sampling chose the closing tag itself,
    that is the one closing tag."""
    out, inside, used, i = [], prompt_open, 0, 0
    while i < len(choices):
        if inside and used >= budget and choices[i] != CLOSE:
            out.append(CLOSE)
            inside = False
            continue
        c = choices[i]
        out.append(c)
        i += 1
        if c == OPEN:
            inside, used = True, 0
        elif c == CLOSE:
            inside = False
        elif inside:
            used += 1
    return out


@pytest.mark.parametrize("trial", range(6))
def test_the_sampler_closes_the_reasoning_at_its_budget(trial, seed):
    rng = random.Random(seed)
    budget = rng.randint(1, 6)
    prompt_open = rng.random() < 0.5
    prompt = [rng.randrange(10, VOCAB) for _ in range(rng.randrange(0, 5))] + ([OPEN] if prompt_open else [CLOSE])
    choices = [rng.choice([OPEN, CLOSE] + list(range(10, VOCAB))) if rng.random() < 0.15 else rng.randrange(10, VOCAB)
               for _ in range(rng.randrange(5, 40))]
    penalty = rng.choice([0.0, 0.5])  # penalties see the forced tokens as generated ones
    params = SamplingParams(reasoning_budget=ReasoningBudget(budget, OPEN, CLOSE), presence_penalty=penalty)
    got = run(Sampler(params, prompt), choices)
    assert got == reference(budget, prompt_open, choices), (budget, prompt, choices)


def test_without_reasoning_nothing_is_forced(seed):
    rng = random.Random(seed)
    choices = [rng.randrange(10, VOCAB) for _ in range(30)]
    params = SamplingParams(reasoning_budget=ReasoningBudget(1, OPEN, CLOSE))
    assert run(Sampler(params, [11, 12]), choices) == choices
    with pytest.raises(ValueError, match="reasoning budget"):
        ReasoningBudget(0, OPEN, CLOSE)
