"""The adaptive split against the CPU alone by measured step times (`SplitTrials`), and the device
tables that run the chosen arm's rule (`DeviceTables.step_timed`)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from ftc_runtime import Engine, SamplingParams
from ftc_runtime.engine import OffloadConfig
from ftc_runtime.experts.device.device_plan import PLANNED_TOKENS, CacheTables, plan_layer
from ftc_runtime.experts.device.split_trials import (
    BLOCK_STEPS,
    FIRST_EXPLOIT,
    MARGIN,
    MAX_EXPLOIT,
    ROUND,
    SplitTrials,
    time_ratio,
)
from ftc_runtime.experts.miss_planner import MissPlanner
from ftc_runtime.experts.offload import OffloadedExperts

ROUND_STEPS = len(ROUND) * BLOCK_STEPS


def run_steps(trials: SplitTrials, n: int, cost, rng: random.Random, noise: float = 0.01) -> list[tuple[int, int]]:
    """n steps, each of a random width, timed by cost(arm, width) within ±noise: each step's arm
    and the rounds done before it."""
    ran = []
    for _ in range(n):
        width = rng.choice([1, 1, 1, 2, 4])
        ran.append((trials.arm, trials.rounds))
        trials.timed(width, cost(trials.arm, width) * rng.uniform(1 - noise, 1 + noise))
    return ran


def round_starts(ran: list[tuple[int, int]]) -> list[int]:
    """The steps at which a round's count went up (the step after each round's last)."""
    return [i for i in range(1, len(ran)) if ran[i][1] > ran[i - 1][1]]


def test_the_faster_arm_runs_and_the_slower_only_in_rounds(seed):
    """Over random per-arm costs, whichever arm is at least 3% faster runs every step between
    rounds; the slower runs only in rounds (half of each), which come FIRST_EXPLOIT steps after the
    first, then twice as far apart each time they confirm the choice, up to MAX_EXPLOIT."""
    rng = random.Random(seed)
    for trial in range(40):
        split, cpu = rng.uniform(5, 20), rng.uniform(5, 20)
        if abs(cpu / split - 1) < 0.03:
            continue
        trials = SplitTrials()
        costs = (split, cpu)
        ran = run_steps(trials, 4000, lambda arm, width, costs=costs: costs[arm] * (1 + 0.6 * (width - 1)), rng)
        faster = 1 if cpu < split else 0
        what = f"seed={seed}, trial {trial}: split {split:.3f}, cpu {cpu:.3f}: {trials.summary()}"
        assert trials.choice == faster and abs(trials.cpu_over_split - cpu / split) < 0.03, what
        ends = round_starts(ran)
        gaps = [b - a - ROUND_STEPS for a, b in itertools.pairwise(ends)]
        assert ends[0] == ROUND_STEPS and gaps == [min(FIRST_EXPLOIT << i, MAX_EXPLOIT) for i in range(len(gaps))], what
        slower = [i for i, (arm, _) in enumerate(ran) if arm != faster]
        assert len(slower) <= ROUND_STEPS // 2 * (len(ends) + 1), what
        assert all(any(end - ROUND_STEPS <= i < end for end in ends) or i >= ends[-1] for i in slower), what


def test_ties_keep_the_models_split(seed):
    """Within the margin the model's split runs: its recency fills and bias stay in use."""
    rng = random.Random(seed)
    trials = SplitTrials()
    ratio = rng.uniform(1 - MARGIN / 2, 1.05)
    run_steps(trials, 600, lambda arm, width: (10.0, 10.0 * ratio)[arm], rng, noise=0.001)
    assert trials.choice == 0 and trials.rounds >= 3, f"seed={seed}: ratio {ratio}, {trials.summary()}"


def test_a_changed_choice_starts_the_spacing_again(seed):
    """When the faster arm changes, the next round comes FIRST_EXPLOIT steps after, not the long
    spacing the old choice had reached."""
    rng = random.Random(seed)
    trials, costs = SplitTrials(), [10.0, 8.0]
    run_steps(trials, 2000, lambda arm, width: costs[arm], rng)
    assert trials.choice == 1, f"seed={seed}: {trials.summary()}"
    costs[1] = 12.0
    ran = run_steps(trials, MAX_EXPLOIT + FIRST_EXPLOIT + 3 * ROUND_STEPS, lambda arm, width: costs[arm], rng)
    ends = round_starts(ran)
    assert trials.choice == 0 and len(ends) >= 2, f"seed={seed}: {trials.summary()}"
    assert ends[1] - ends[0] == FIRST_EXPLOIT + ROUND_STEPS, f"seed={seed}: {ends}"


def test_the_time_ratio_compares_steps_of_one_width(seed):
    """Different mixes of widths (a pass of n tokens costs more) give the ratio of the arms' costs
    at each width, not of the mixes; widths that only one arm ran do not count."""
    rng = random.Random(seed)
    factor = rng.uniform(0.5, 2)
    per_width = {w: rng.uniform(5, 30) for w in range(1, 6)}
    a: dict[int, list[float]] = {w: [] for w in per_width}
    b: dict[int, list[float]] = {w: [] for w in per_width}
    for _ in range(40):
        w = rng.choice([1, 2])
        a[w].append(factor * per_width[w])
        w = rng.choice([1, 2, 2, 2, 5])
        b[w].append(per_width[w])
    a[4].append(1e6)  # b ran no step of 4 tokens
    assert abs(time_ratio(a, b) - factor) < 1e-9, f"seed={seed}"
    assert time_ratio({3: [1.0]}, {1: [1.0]}) is None


def adaptive_offload(cpu_engine, planner: MissPlanner) -> OffloadedExperts:
    cpu = cpu_engine.model.experts
    e, layers = cpu_engine.spec.moe.num_experts, len(cpu_engine.spec.moe_layers)
    return OffloadedExperts(cpu.pool, cpu.kernel, torch.device("cpu"), e * layers // 4, planner, device_plan=True)


def test_the_device_rule_runs_the_arm_the_trials_choose(cpu_engine, seed):
    """Steps timed slower on the model's split turn the device rule's q table to none filled (a
    call's misses all on the CPU, in place, so that graphs holding the table see it); a rule made
    again after a resize takes the chosen arm; and the split comes back when it is faster."""
    rng = random.Random(seed)
    e, k = cpu_engine.spec.moe.num_experts, cpu_engine.spec.moe.top_k
    off = adaptive_offload(cpu_engine, MissPlanner("adaptive", 20.0, 40.0, 18.0, 30.0, recent_tokens=0))
    tables = off.device_path.tables
    table, rule = tables.for_call(off.planner, PLANNED_TOKENS * k)
    split = rule.q_for_m.clone()
    assert split.any(), "the planner splits no m: nothing to compare"
    costs = [10.0, 9.0]
    for _ in range(ROUND_STEPS):
        off.step_timed(1, costs[tables.trials.arm] * rng.uniform(0.99, 1.01))
    assert tables.trials.choice == 1 and not rule.q_for_m.any(), f"seed={seed}: {tables.trials.summary()}"
    ids = torch.tensor([rng.sample(range(e), k)])
    counts = plan_layer(CacheTables.of(off.store.cache, "cpu"), rule, 0, ids, torch.rand(1, k)).counts.tolist()
    assert counts[1] == 0 and counts[2] == k - counts[0], f"seed={seed}: {counts}"
    off.resize(off.n_slots - 1)
    _, remade = tables.for_call(off.planner, PLANNED_TOKENS * k)
    assert remade is not rule and not remade.q_for_m.any(), f"seed={seed}"
    costs[1] = 11.0
    for _ in range(FIRST_EXPLOIT + ROUND_STEPS):
        off.step_timed(1, costs[tables.trials.arm])
    assert tables.trials.choice == 0 and torch.equal(remade.q_for_m, split), f"seed={seed}"


def test_no_trials_where_routing_recurs_or_the_policy_is_fixed(cpu_engine, seed):
    """With the recency rule on (fills now are hits later, which a block of steps cannot measure)
    or under a fixed policy, the rule's q table is the planner's whatever the steps' times."""
    rng = random.Random(seed)
    k = cpu_engine.spec.moe.top_k
    for planner in (MissPlanner("adaptive", 20.0, 40.0, 18.0, 30.0, recent_tokens=4),
                    MissPlanner("gpu", 20.0, 40.0), MissPlanner("half", 20.0, 40.0)):
        off = adaptive_offload(cpu_engine, planner)
        _, rule = off.device_path.tables.for_call(off.planner, PLANNED_TOKENS * k)
        want = torch.tensor([planner.fills(m) for m in range(PLANNED_TOKENS * k + 1)])
        for _ in range(3 * ROUND_STEPS):
            off.step_timed(1, rng.uniform(1, 2) * (1 + 100 * (off.device_path.tables.trials.arm == 0)))
        assert torch.equal(rule.q_for_m, want) and off.split_trials is None, f"seed={seed}: {planner.policy}"


@pytest.mark.gpu
def test_gpu_decode_steps_feed_the_trials(engine_dir, seed):
    """On the GPU each whole step replayed from its graph is timed into the trials: over a few
    rounds' steps both arms run, a round ends, and the answer is the same length as asked."""
    engine = Engine.load(engine_dir, offload=OffloadConfig(device="cuda", n_slots=8))
    experts = engine.model.experts
    experts.planner = MissPlanner("adaptive", 20.0, 40.0, 18.0, 30.0, recent_tokens=0)
    experts.device_path.tables.forget()
    prompt = [random.Random(seed).randrange(engine.spec.vocab_size) for _ in range(8)]
    answer = list(engine.generate(prompt, 2 * ROUND_STEPS + 4, SamplingParams(0.8, seed=seed), stop_at_eos=False))
    assert len(answer) == 2 * ROUND_STEPS + 4
    assert experts.split_trials is not None and experts.split_trials["rounds"] >= 1, f"seed={seed}"
