"""Repetition, presence and frequency penalties: the penalized logits equal Hugging Face's
RepetitionPenaltyLogitsProcessor followed by OpenAI's formula over the history the sampler recorded;
neutral values leave sampling exactly as it was; the engine penalizes its prompt and its own tokens."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from ftc_runtime import Engine
from ftc_runtime.sampling import MIN_TEMPERATURE, Sampler, SamplingParams


def reference(logits: torch.Tensor, prompt: list[int], generated: list[int], p: SamplingParams) -> torch.Tensor:
    """HF's repetition penalty over prompt and answer, then OpenAI's presence and frequency
    penalties over the answer alone (vLLM's order), one token at a time."""
    ids = torch.tensor([prompt + generated], dtype=torch.long)
    out = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, logits[None].clone())[0].tolist()
    for token, count in Counter(generated).items():
        out[token] -= p.presence_penalty + p.frequency_penalty * count
    return torch.tensor(out, dtype=torch.float32)


def random_params(rng: random.Random) -> SamplingParams:
    """Each penalty on or off, sampled or greedy."""
    return SamplingParams(
        temperature=rng.choice([0.0, rng.uniform(0.3, 1.5)]), top_p=rng.choice([1.0, rng.uniform(0.5, 1)]),
        top_k=rng.choice([0, rng.randrange(1, 20)]), seed=rng.randrange(2**31),
        presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]), frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 3), rng.uniform(1, 10)]))


def test_penalized_logits_equal_hf_and_openai_over_the_recorded_history(seed):
    """Fresh logits each step; the history is the prompt and whatever the sampler returned, kept by
    the sampler itself (small vocabularies: tokens repeat, counts go past 1)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(40):
        vocab, params = rng.randrange(4, 64), random_params(rng)
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        sampler, generated = Sampler(params, prompt), []
        for _ in range(rng.randrange(1, 30)):
            logits = torch.randn(vocab, generator=g) * rng.uniform(0.5, 5)
            want = reference(logits, prompt, generated, params)
            if sampler.penalties is not None:
                torch.testing.assert_close(sampler.penalties.apply(logits), want, msg=lambda m, p=params: f"{p}: {m}")
            token = sampler(logits)
            if params.temperature < MIN_TEMPERATURE:
                assert token == int(want.argmax()), params
            else:
                assert want[token] > float("-inf") and 0 <= token < vocab
            generated.append(token)


def test_penalties_leave_the_logits_they_are_given_unchanged(seed):
    """The scheduler hands each request a row of its batch's logits: penalizing it must copy."""
    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(seed))
    before = logits.clone()
    sampler = Sampler(SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=1.0),
                      list(range(16)))
    for _ in range(5):
        sampler(logits[0])
    assert torch.equal(logits, before)


def old_sampler(params: SamplingParams):
    """The sampler as it was before penalties (a copy of its code): the neutral path must equal it."""
    generator = torch.Generator().manual_seed(params.seed)

    def sample(logits: torch.Tensor) -> int:
        if params.temperature < MIN_TEMPERATURE:
            return int(torch.argmax(logits))
        logits = logits.float()
        if 0 < params.top_k < logits.numel():
            logits = logits.masked_fill(logits < torch.topk(logits, params.top_k).values[-1], float("-inf"))
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=generator))

    return sample


def test_neutral_penalties_sample_as_before_and_keep_no_history(seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(20):
        params = SamplingParams(**{**random_params(rng).__dict__, "presence_penalty": 0, "frequency_penalty": 0.0,
                                   "repetition_penalty": 1})
        sampler, old = Sampler(params, [rng.randrange(100) for _ in range(8)]), old_sampler(params)
        assert sampler.penalties is None and not params.penalized
        for _ in range(20):
            logits = torch.randn(100, generator=g) * 3
            assert sampler(logits) == old(logits), params


def test_penalty_ranges_are_checked():
    for ok in ({"presence_penalty": -2}, {"presence_penalty": 2.0}, {"frequency_penalty": -2.0},
               {"repetition_penalty": 10}, {"repetition_penalty": 1e-3}):
        assert SamplingParams(**ok).penalized
    for name, values in (("presence_penalty", [2.01, -3, float("nan"), float("inf")]),
                         ("frequency_penalty", [-2.5, 3, float("nan")]),
                         ("repetition_penalty", [0, -1, 10.5, float("nan"), float("inf")])):
        for v in values:
            with pytest.raises(ValueError, match=name):
                SamplingParams(**{name: v})


def _penalized_greedy(engine: Engine, ids: list[int], n: int, params: SamplingParams) -> list[int]:
    """Greedy decoding with the reference penalties, step by step through the model (the same
    prefill and decode calls as Engine.generate, so the same logits bit for bit)."""
    cache, out = engine.model.new_cache(), []
    logits = engine.prefill(torch.tensor(ids), cache)[-1]
    for _ in range(n):
        out.append(int(reference(logits, ids, out, params).argmax()))
        logits = engine.model.forward(torch.tensor([out[-1]]), cache)[-1]
    return out


def test_engine_penalizes_the_prompt_and_its_own_tokens(cpu_engine, seed):
    """The tiny engine's greedy answers fall into loops of one token; a strong repetition penalty
    says that token at most once, and every penalty decodes as the reference does."""
    rng, n = random.Random(seed), 24
    for _ in range(200):
        ids = [rng.randrange(256) for _ in range(rng.randrange(3, 12))]
        greedy = list(cpu_engine.generate(ids, n, SamplingParams(0.0), stop_at_eos=False))
        if len(set(greedy[-4:])) == 1:
            break
    else:
        pytest.skip("no greedy answer of the tiny engine loops on one token")
    strong = SamplingParams(0.0, repetition_penalty=10.0)
    penalized = list(cpu_engine.generate(ids, n, strong, stop_at_eos=False))
    assert penalized.count(greedy[-1]) <= 1, (ids, greedy, penalized)
    for params in (strong, SamplingParams(0.0, presence_penalty=rng.uniform(0.5, 2), frequency_penalty=0.3),
                   SamplingParams(0.0, repetition_penalty=rng.uniform(1.1, 2), frequency_penalty=-0.5)):
        want = _penalized_greedy(cpu_engine, ids, n, params)
        assert list(cpu_engine.generate(ids, n, params, stop_at_eos=False)) == want, params
        assert list(cpu_engine.generate(ids, n, params, stop_at_eos=False)) == want  # no history left over
