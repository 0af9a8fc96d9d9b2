"""Engines compiled from the tiny random transformers checkpoints of every model family
(families.py: each family's layouts and targets) reproduce transformers' fp32 eager reference, within
the family's bounds for the engine's kernel: a prompt's logits, whole, in uneven chunks and streamed;
32 greedy tokens; one-token decode steps, alone and batched."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from ftc_runtime import Engine, SamplingParams
from ftc_runtime.engine import OffloadConfig

from conftest import seed_for
from families import (
    CASES,
    MAX_REFERENCE_ERROR,
    MIN_GREEDY_MARGIN,
    MIN_ROUTER_MARGIN,
    Bounds,
    Case,
    fp64_reference,
    reference_greedy,
    reference_logits,
    rel,
    well_conditioned,
)


@dataclass(frozen=True)
class Parity:
    case: Case
    engine: Engine
    model: torch.nn.Module  # the reference
    model64: torch.nn.Module  # the reference in fp64: how well conditioned a prompt is
    bounds: Bounds  # the family's, for the engine's kernel

    @property
    def vocab(self) -> int:
        return self.engine.spec.vocab_size

    def ids(self, rng: random.Random, n: int) -> list[int]:
        """n random tokens on which the reference's router has no near tie and its fp32 logits come
        close to its fp64 logits (redrawn where either fails)."""
        for _ in range(100):
            ids = [rng.randrange(self.vocab) for _ in range(n)]
            if well_conditioned(self.model, self.model64, ids, self.bounds.prompt.rel):
                return ids
        raise AssertionError(f"100 prompts of {n} tokens each had a router near tie (< {MIN_ROUTER_MARGIN}) "
                             f"or an fp32 reference over {MAX_REFERENCE_ERROR} of the bound from fp64")


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.id)
def parity(request, tmp_path_factory) -> Parity:
    """The case's engine and reference model. Its weights are fresh each run (the same for both
    targets): they follow the run's FTC_TEST_SEED, which a failing test's report names."""
    case: Case = request.param
    engine, model = case.compile(tmp_path_factory.mktemp(case.id), seed_for(case.model_id))
    return Parity(case, engine, model, fp64_reference(model), case.family.bounds[engine.manifest.plan.isa])


def test_the_engine_is_of_its_family(parity):
    assert parity.engine.spec.family == parity.case.family.name


def test_logits_match_transformers(parity, seed):
    rng = random.Random(seed)
    # bf16's per-position share needs five positions to leave room for one outlier
    ids = parity.ids(rng, rng.randrange(2 if parity.bounds.prompt.per_position is None else 5, 60))
    ours = parity.engine.logits(ids)
    assert ours.shape == (len(ids), parity.vocab)
    parity.bounds.prompt.check(ours, reference_logits(parity.model, ids), f"ids={ids}")


def test_greedy_32_tokens_match_transformers(parity, seed):
    engine, model = parity.engine, parity.model
    rng = random.Random(seed)
    for _ in range(100):
        ids = parity.ids(rng, rng.randrange(3, 12))
        ref, margin = reference_greedy(model, ids, 32)
        if margin > MIN_GREEDY_MARGIN:
            break
    else:
        pytest.fail("no prompt in 100 draws without a near-tie in its 32 greedy steps")
    if parity.bounds.greedy_agreement is None:
        ours = list(engine.generate(ids, 32, SamplingParams(temperature=0.0), stop_at_eos=False))
        assert ours == ref, f"ids={ids}"
    else:
        picks = engine.logits(ids + ref)[len(ids) - 1:-1].argmax(-1)
        agreement = float((picks == torch.tensor(ref)).float().mean())
        assert agreement >= parity.bounds.greedy_agreement, f"ids={ids}: {agreement:.2f} of 32 greedy steps agree"


@pytest.mark.parametrize("offloaded", [False, True])
def test_prompt_in_uneven_chunks_matches_transformers(parity, offloaded, seed):
    """Chunks of 5-13 tokens carry the caches (keys and values, a linear layer's state) from one to
    the next; offloaded, the experts come from a slot cache on the emulated device (the CPU)."""
    rng = random.Random(seed)
    chunk = rng.randrange(5, 14)
    ids = parity.ids(rng, chunk * rng.randrange(2, 5) + rng.randrange(1, chunk))
    pool = len(parity.engine.spec.moe_layers) * parity.engine.spec.moe.num_experts
    offload = OffloadConfig(device="cpu", n_slots=min(pool, rng.randrange(3, 20)), b_p=20.0, b_h=40.0) \
        if offloaded else None
    chunked = Engine.load(parity.engine.manifest.root, offload=offload, prefill_chunk=chunk)
    parity.bounds.prompt.check(chunked.logits(ids), reference_logits(parity.model, ids), f"ids={ids}")


@pytest.mark.parametrize("split", ["off", "auto", "share"])
def test_chunked_streamed_prefill_matches_transformers(parity, split, seed):
    """A prompt in uneven chunks, each long enough to stream its MoE layers whole through two layer
    buffers (the CPU standing in for the GPU); every uncached expert copied (`off`), or part of
    them computed by the CPU kernel in place, as the rates say (`auto`) or a random share."""
    engine, spec = parity.engine, parity.engine.spec
    rng = random.Random(seed)
    mode = f"{rng.uniform(0.2, 1.0):.3f}" if split == "share" else split
    min_tokens = engine.manifest.plan.prefill_stream_min_tokens
    chunk = min_tokens + rng.randrange(0, 5)
    ids = parity.ids(rng, 2 * chunk + rng.randrange(min_tokens, chunk + 1))
    n_moe, experts = len(spec.moe_layers), spec.moe.num_experts
    slots = min(n_moe * experts, 2 * experts + rng.randrange(0, 8))  # at most the whole pool
    cfg = OffloadConfig(device="cpu", n_slots=slots, b_p=20.0, b_h=40.0, prefill_split=mode)
    streamed = Engine.load(engine.manifest.root, offload=cfg, prefill_chunk=chunk)
    ours = streamed.logits(ids)
    stats = streamed.model.experts.stats
    assert stats.stream_layers == 3 * n_moe  # every chunk streamed
    assert (stats.stream_cpu > 0) == (split == "share") or split == "auto", stats.stream_cpu
    parity.bounds.prompt.check(ours, reference_logits(parity.model, ids), f"ids={ids}")


def test_incremental_decode_equals_full_prefill(parity, seed):
    """The caches' path (one token at a time after a prompt) gives the logits of one forward over
    the whole sequence."""
    engine = parity.engine
    rng = random.Random(seed)
    ids = parity.ids(rng, 20)
    full = engine.logits(ids)
    cache = engine.model.new_cache()
    engine.model.forward(torch.tensor(ids[:7]), cache)
    steps = [engine.model.forward(torch.tensor([t]), cache)[-1] for t in ids[7:]]
    err = rel(torch.stack(steps), full[7:])
    assert err < parity.bounds.own_steps, f"ids={ids}: {err:.3g}"


def test_batched_decode_matches_transformers(parity, seed):
    """Sequences of different lengths decoded together, one call per step: each gets the logits the
    engine gives its own tokens in one forward and, where the kernel is fp32, those transformers gives."""
    engine, bounds = parity.engine, parity.bounds
    rng = random.Random(seed)
    prompts = [parity.ids(rng, rng.randrange(1, 20)) for _ in range(rng.randrange(2, 5))]
    steps = [parity.ids(rng, 5) for _ in prompts]
    caches = [engine.model.new_cache() for _ in prompts]
    for ids, cache in zip(prompts, caches, strict=True):
        engine.prefill(torch.tensor(ids), cache)
    batched = [engine.model.decode_batch([s[t] for s in steps], caches) for t in range(5)]
    for j, ids in enumerate(prompts):
        ours, what = torch.stack([batched[t][j] for t in range(5)]), f"sequence {j}: {ids} then {steps[j]}"
        err = rel(ours, engine.logits(ids + steps[j])[len(ids):])
        assert err < bounds.own_steps, f"{what}: {err:.3g} from the engine's own"
        if bounds.steps is not None:
            err = rel(ours, reference_logits(parity.model, ids + steps[j])[len(ids):])
            assert err < bounds.steps, f"{what}: {err:.3g} from transformers'"
