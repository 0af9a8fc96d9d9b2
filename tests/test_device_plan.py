"""The decode plan as device data (`ftc_runtime.experts.device.device_plan`) against the host planner
(`OffloadedExperts`' general path over `ExpertCache` and `MissPlanner`), step by step over random
routings, batch sizes, slot counts and policies: the same cache state, the same victims and fills
in the same order, the same split and CPU job, every routed expert served from the slot the host
gave it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ftc_runtime import Engine, SamplingParams
from ftc_runtime.engine import OffloadConfig
from ftc_runtime.experts.device.device_plan import PLANNED_TOKENS, TUNE_STEP, CacheTables, PlanRule, plan_layer
from ftc_runtime.experts.miss_planner import MISS_POLICIES, MissPlanner
from ftc_runtime.experts.offload import OffloadedExperts

from slot_checks import check_slots_hold_their_rows

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class RecordingKernel:
    """The CPU expert kernel, recording the job each `start` is given."""

    def __init__(self, kernel):
        self.kernel, self.jobs = kernel, []

    def start(self, experts, x, out, ids, offsets, tok, w) -> None:
        self.jobs.append((ids.clone(), offsets.clone(), tok.clone(), w.clone()))
        self.kernel.start(experts, x, out, ids, offsets, tok, w)

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def random_planner(rng: random.Random) -> MissPlanner:
    measured = rng.random() < 0.5
    return MissPlanner(rng.choice(MISS_POLICIES + ("adaptive",)), rng.uniform(5, 60), rng.uniform(5, 120),
                       rng.uniform(5, 50) if measured else None, rng.uniform(5, 90) if measured else None,
                       recent_tokens=rng.choice([0, 1, 4]))


def host_offload(cpu_engine, rng: random.Random, g: torch.Generator, background: bool = False) -> OffloadedExperts:
    """A host planner on random slots and policies; a static cache is pinned by a prompt first.
    `background`: the CPU kernel on a background pool (as beside a GPU)."""
    cpu = cpu_engine.model.experts
    kernel = cpu.kernel.on_cpus([0], background=True) if background else cpu.kernel
    e, k, layers = cpu_engine.spec.moe.num_experts, cpu_engine.spec.moe.top_k, len(cpu_engine.spec.moe_layers)
    n_slots = rng.choice([0, 1, k - 1, k, 2 * k + 1, 2 * k + 1, 3 * k, 3 * k, e * layers])
    off = OffloadedExperts(cpu.pool, RecordingKernel(kernel), torch.device("cpu"), n_slots,
                           random_planner(rng), rng.choice(["lru", "lru", "static"]))
    off.native_token_plan = False
    fills: list[tuple[np.ndarray, np.ndarray]] = []
    copy = off.store.copy_rows_now
    off.store.copy_rows_now = lambda slots, ids: (fills.append((slots.copy(), ids.copy())), copy(slots, ids))
    off.recorded_fills = fills
    if off.cache.policy == "static":
        for layer in range(layers):
            ids = torch.stack([torch.tensor(rng.sample(range(e), k)) for _ in range(5)])
            x = torch.randn(5, cpu_engine.spec.hidden_size, generator=g)
            off.forward(layer, x, ids, torch.rand(5, k, generator=g))
        off.end_of_prompt()
    return off


def check_step(plan, tables: CacheTables, host: OffloadedExperts, flat: torch.Tensor, before: dict,
               jobs: int, fills: int, what: str) -> None:
    assert tables.differences(host.cache) == [], what
    assert [int(x[-1]) for x in (tables.slot_of, tables.id_of, tables.last_used, tables.cpu_step)] == [-1] * 4, what
    # Hits stay and fills are installed; what the CPU computed is not resident.
    want_slot = torch.from_numpy(host.cache.slot_of)[flat]
    assert torch.equal(plan.pair_slot.cpu().reshape(-1), want_slot), what
    counts = plan.counts[:3].tolist()
    s = host.stats
    assert counts == [s.hits - before["hits"], s.fills - before["fills"], s.cpu - before["cpu"]], what
    n_fill, n_cpu = counts[1], counts[2]
    host_fills = host.recorded_fills[fills:]
    assert len(host_fills) == (1 if n_fill else 0), what
    if n_fill:
        slots, rows = host_fills[0]
        assert plan.fill_slots[:n_fill].tolist() == slots.tolist(), what
        assert plan.fill_rows[:n_fill].tolist() == rows.tolist(), what
    assert (plan.fill_rows[n_fill:] == -1).all() and (plan.fill_slots[n_fill:] == -1).all(), what
    host_jobs = host.kernel.jobs[jobs:]
    assert len(host_jobs) == (1 if n_cpu else 0), what
    assert (plan.cpu_ids[n_cpu:] == -1).all(), what
    if n_cpu:
        ids, offsets, tok, w = host_jobs[0]
        entries = int(offsets[-1])
        assert plan.cpu_ids[:n_cpu].tolist() == ids.tolist(), what
        assert plan.cpu_offsets[:n_cpu + 1].tolist() == offsets.tolist(), what
        assert plan.cpu_tok[:entries].tolist() == tok.tolist(), what
        assert torch.equal(plan.cpu_w[:entries].cpu(), w), what


def test_the_split_bias_moves_q_by_m_times_bias_rounded(seed):
    """`PlanRule.bias` (as the step's waits leave it): the fills of a call with m misses are the
    planner's q plus ⌊m · bias + ½⌋, within [0, m], with victims to spare and no recent misses,
    where the planner splits them (0 < q < m); the plan reports that q as the split's own
    (counts[3]). Where the planner sends them to one side alone, q is the planner's and counts[3]
    is -1 (the waits do not tune it). Planners with measured rates give q = 0 at some m."""
    import math

    from ftc_runtime.experts.cache import ExpertCache

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    e, k = 64, 8
    for trial in range(30):
        measured = (rng.uniform(5, 60), rng.uniform(5, 120)) if trial % 2 else (None, None)
        planner = MissPlanner("adaptive", rng.uniform(5, 60), rng.uniform(5, 120), *measured)
        rule = PlanRule.of(planner, PLANNED_TOKENS * k, 0, True, "cpu")
        bias = rng.randrange(-64, 65) * TUNE_STEP
        rule.bias.fill_(bias)
        cache = ExpertCache(e, 4 * PLANNED_TOKENS * k)
        resident = rng.sample(range(e), rng.randrange(0, e // 2))
        for slot, row in enumerate(resident):
            cache.slot_of[row], cache.id_of[slot] = slot, row
        tables = CacheTables.of(cache, "cpu")
        t = rng.choice([1, 2, 4])
        ids = torch.stack([torch.tensor(rng.sample(range(e), k)) for _ in range(t)])
        m = len(set(ids.reshape(-1).tolist()) - set(resident))
        splits = 0 < planner.fills(m) < m
        q = min(max(planner.fills(m) + math.floor(m * bias + 0.5), 0), m) if splits else planner.fills(m)
        counts = plan_layer(tables, rule, 0, ids, torch.rand(t, k, generator=g)).counts.tolist()
        want = [q, m - q, q if splits else -1]
        assert counts[1:] == want, f"trial {trial}: m {m}, bias {bias}, planner q {planner.fills(m)}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("run", range(16))
def test_device_plan_equals_the_host_planner(cpu_engine, device, run, seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    e, k, layers = cpu_engine.spec.moe.num_experts, cpu_engine.spec.moe.top_k, len(cpu_engine.spec.moe_layers)
    host = host_offload(cpu_engine, rng, g)
    tables = CacheTables.of(host.cache, device)
    rule = PlanRule.of(host.planner, 16 * k, host.recent_steps, host.cache.policy == "lru", device)
    assert tables.differences(host.cache) == []
    for step in range(60):
        t = rng.choice([1, 1, 1, 2, 4, 8, 16])
        layer = rng.randrange(layers)
        hot = range(min(e, k + 4))  # skewed routing: hits, evictions and recent misses recur
        ids = torch.stack([torch.tensor(rng.sample(hot if rng.random() < 0.7 else range(e), k)) for _ in range(t)])
        w, x = torch.rand(t, k, generator=g), torch.randn(t, cpu_engine.spec.hidden_size, generator=g)
        before = {name: getattr(host.stats, name) for name in ("hits", "fills", "cpu")}
        jobs, fills = len(host.kernel.jobs), len(host.recorded_fills)
        host.forward(layer, x, ids, w)
        plan = plan_layer(tables, rule, layer * e, ids.to(device), w.to(device))
        what = (f"step {step}: {t} tokens, {host.cache.n_slots} slots, {host.planner.policy}/{host.cache.policy}, "
                f"recent {host.recent_steps}")
        check_step(plan, tables, host, ids.reshape(-1) + layer * e, before, jobs, fills, what)


def test_tables_round_trip_through_the_host_cache(cpu_engine, seed):
    """A device copy written back to a fresh cache of the same size gives the same state; a
    cache of another size is refused."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    host = host_offload(cpu_engine, rng, g)
    e, k = cpu_engine.spec.moe.num_experts, cpu_engine.spec.moe.top_k
    for _ in range(6):
        host.forward(0, torch.randn(1, cpu_engine.spec.hidden_size, generator=g),
                     torch.tensor([rng.sample(range(e), k)]), torch.rand(1, k, generator=g))
    tables = CacheTables.of(host.cache, "cpu")
    other = type(host.cache)(host.cache.slot_of.size, host.cache.n_slots, host.cache.policy)
    tables.write_to(other)
    assert tables.differences(other) == []
    with pytest.raises(ValueError, match=f"{host.cache.n_slots + 1} slots"):
        tables.write_to(type(host.cache)(host.cache.slot_of.size, host.cache.n_slots + 1))
    # Loaded in place from another state: the same tensors, that state.
    fresh = type(host.cache)(host.cache.slot_of.size, host.cache.n_slots, host.cache.policy)
    addresses = [t.data_ptr() for t in (tables.slot_of, tables.id_of, tables.last_used, tables.cpu_step)]
    tables.load(fresh)
    assert tables.differences(fresh) == [] and (host.cache.step == 0 or tables.differences(host.cache))
    assert addresses == [t.data_ptr() for t in (tables.slot_of, tables.id_of, tables.last_used, tables.cpu_step)]


@pytest.mark.gpu
def test_device_plan_replays_in_a_cuda_graph(cpu_engine, seed):
    """Captured once, the plan replays on new routings with no host sync and the same results
    (plans and tables) as eager calls on a copy of the tables."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    e, k = cpu_engine.spec.moe.num_experts, cpu_engine.spec.moe.top_k
    host = host_offload(cpu_engine, rng, g)
    eager = CacheTables.of(host.cache, "cuda")
    graphed = CacheTables.of(host.cache, "cuda")
    rule = PlanRule.of(host.planner, 4 * k, host.recent_steps, host.cache.policy == "lru", "cuda")
    ids, w = torch.zeros(4, k, dtype=torch.long, device="cuda"), torch.zeros(4, k, device="cuda")
    plan_layer(CacheTables.of(host.cache, "cuda"), rule, 0, ids, w)  # warm-up on a throwaway copy
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = plan_layer(graphed, rule, 0, ids, w)
    for step in range(12):
        new_ids = torch.stack([torch.tensor(rng.sample(range(min(e, k + 4)), k)) for _ in range(4)])
        new_w = torch.rand(4, k, generator=g)
        ids.copy_(new_ids)
        w.copy_(new_w)
        graph.replay()
        want = plan_layer(eager, rule, 0, new_ids.cuda(), new_w.cuda())
        for name in ("pair_slot", "fill_rows", "fill_slots", "cpu_ids", "cpu_offsets", "cpu_tok", "cpu_w", "counts",
                     "pairs", "phase_pairs"):
            assert torch.equal(getattr(captured, name), getattr(want, name)), f"step {step}: {name}"
        for name in ("slot_of", "id_of", "last_used", "cpu_step", "step"):
            assert torch.equal(getattr(graphed, name), getattr(eager, name)), f"step {step}: {name}"


@pytest.mark.parametrize("doorbell", [False, True])
@pytest.mark.parametrize("run", range(6))
def test_planned_calls_equal_the_host_path(cpu_engine, run, doorbell, seed):
    """`OffloadedExperts` with the plan on the (emulated) device computes what the host path
    computes and leaves the same cache, whether the host cache is read back after every call or
    only now and then (the device's tables stay ahead in between); prompt-sized calls in between
    take the host path on the written-back state. With a background CPU pool (`doorbell`) the CPU
    job goes through the CPU doorbell, which gives the pool back whenever the host path runs.
    Calls in and out of inference mode: the device's tables, made in either, are loaded in place."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    e, k, layers = cpu_engine.spec.moe.num_experts, cpu_engine.spec.moe.top_k, len(cpu_engine.spec.moe_layers)
    host = host_offload(cpu_engine, random.Random(seed), g)
    planned = host_offload(cpu_engine, random.Random(seed), torch.Generator().manual_seed(seed), doorbell)
    planned.device_plan = True
    read_every = rng.choice([1, 3, 7])
    rung = 0  # planned calls with CPU experts: through the doorbell, they start no kernel job
    for step in range(50):
        t = rng.choice([1, 1, 1, 2, 4, PLANNED_TOKENS, PLANNED_TOKENS + 1])
        layer = rng.randrange(layers)
        hot = range(min(e, k + 4))
        ids = torch.stack([torch.tensor(rng.sample(hot if rng.random() < 0.7 else range(e), k)) for _ in range(t)])
        w, x = torch.rand(t, k, generator=g), torch.randn(t, cpu_engine.spec.hidden_size, generator=g)
        jobs = len(host.kernel.jobs)
        with torch.inference_mode(rng.random() < 0.5):  # an engine's calls run in it, a test's may not
            got = planned.forward(layer, x, ids, w)
        want = host.forward(layer, x, ids, w)
        rung += t <= PLANNED_TOKENS and len(host.kernel.jobs) > jobs
        assert (got - want).norm() <= 1e-5 * want.norm(), f"step {step}, {t} tokens"
        if step % read_every == 0:
            cache = planned.cache
            for name in ("slot_of", "id_of", "last_used", "cpu_step"):
                assert np.array_equal(getattr(cache, name), getattr(host.cache, name)), f"step {step}: {name}"
            assert cache.step == host.cache.step
    counts = ("calls", "unique", "hits", "fills", "cpu")
    assert [planned.stats.to_dict()[c] for c in counts] == [host.stats.to_dict()[c] for c in counts]
    check_slots_hold_their_rows(planned)
    assert len(planned.kernel.jobs) == len(host.kernel.jobs) - (rung if doorbell else 0)


@pytest.mark.parametrize("miss_policy,cache_policy,slots", [("adaptive", "lru", 5), ("gpu", "lru", 20),
                                                          ("cpu", "lru", 8), ("half", "lru", 12),
                                                          ("adaptive", "static", 3)])
def test_engine_with_the_device_plan_equals_the_cpu_engine(engine_dir, cpu_engine, miss_policy, cache_policy,
                                                           slots, seed):
    """Greedy tokens and logits of the emulated device with every decode call planned as data,
    against the all-CPU engine; sequences decoded as one batch get what each gets alone."""
    rng = random.Random(seed)
    ids = [rng.randrange(256) for _ in range(rng.randrange(4, 30))]
    want = list(cpu_engine.generate(ids, 24, SamplingParams(0.0), stop_at_eos=False))
    cfg = OffloadConfig(device="cpu", n_slots=slots, miss_policy=miss_policy, cache_policy=cache_policy,
                        b_p=rng.uniform(5, 50), b_h=rng.uniform(20, 100), device_plan=True)
    off = Engine.load(engine_dir, offload=cfg)
    assert list(off.generate(ids, 24, SamplingParams(0.0), stop_at_eos=False)) == want
    assert off.model.experts.stats.calls > 0 and off.model.experts.cache.resident <= slots
    model = off.model
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(1, 20))] for _ in range(rng.randrange(2, 5))]
    caches = [model.new_cache() for _ in prompts]
    for p, cache in zip(prompts, caches, strict=True):
        model.forward(torch.tensor(p), cache)
    tokens = [rng.randrange(256) for _ in prompts]
    batched = model.decode_batch(tokens, caches)
    for j, (p, tok) in enumerate(zip(prompts, tokens, strict=True)):
        alone = cpu_engine.model.new_cache()
        cpu_engine.model.forward(torch.tensor(p), alone)
        assert torch.allclose(batched[j], cpu_engine.model.forward(torch.tensor([tok]), alone)[-1],
                              rtol=1e-4, atol=1e-4), j


@pytest.mark.gpu
@pytest.mark.parametrize("run", range(6))
def test_triton_plan_equals_the_torch_plan(run, seed):
    """The plan's Triton kernels (`experts/device/plan_kernel.py`) against `plan_layer` on random tables,
    slot counts (up to several candidate blocks), rules and batch sizes: the same plans and the
    same tables, step by step; and the kernels replay in a CUDA graph."""
    from ftc_runtime.experts.cache import ExpertCache
    from ftc_runtime.experts.device.plan_kernel import plan_layer_triton

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    e, layers, k = 64, 4, 8
    cache = ExpertCache(e * layers, rng.choice([0, 1, 7, 40, 130, 2500]))
    rule = PlanRule.of(random_planner(rng), PLANNED_TOKENS * k, rng.choice([0, 8, 32]), rng.random() < 0.8, "cuda")
    rule.bias.fill_(rng.randrange(-64, 65) * TUNE_STEP)  # as the step's waits leave it
    torch_tables, triton_tables = CacheTables.of(cache, "cuda"), CacheTables.of(cache, "cuda")
    for step in range(40):
        t = rng.choice([1, 1, 2, 4, 8, 16])
        layer = rng.randrange(layers)
        ids = torch.stack([torch.tensor(rng.sample(range(12) if rng.random() < 0.7 else range(e), k))
                           for _ in range(t)]).cuda()
        w = torch.rand(t, k, generator=g).cuda()
        want = plan_layer(torch_tables, rule, layer * e, ids, w)
        if rng.random() < 0.5:  # as a decode step stages them: fp32 columns of one buffer after x
            packed = torch.randn(t, 5 + 2 * k, device="cuda")
            packed[:, 5:5 + k], packed[:, 5 + k:] = ids.float(), w
            ids, w = packed[:, 5:5 + k], packed[:, 5 + k:]
        got = plan_layer_triton(triton_tables, rule, layer * e, ids, w)
        for name in ("pair_slot", "fill_rows", "fill_slots", "cpu_ids", "cpu_offsets", "cpu_tok", "cpu_w", "counts",
                     "pairs", "phase_pairs"):
            assert torch.equal(getattr(got, name), getattr(want, name)), f"step {step} ({t} tokens): {name}"
        for name in ("slot_of", "id_of", "last_used", "cpu_step", "step"):
            assert torch.equal(getattr(triton_tables, name)[:-1] if name != "step" else triton_tables.step,
                               getattr(torch_tables, name)[:-1] if name != "step" else torch_tables.step), name
    ids, w = torch.zeros(4, k, dtype=torch.long, device="cuda"), torch.zeros(4, k, device="cuda")
    plan_layer_triton(CacheTables.of(cache, "cuda"), rule, 0, ids, w)  # compiles the kernels for 4 tokens
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = plan_layer_triton(triton_tables, rule, 0, ids, w)
    for step in range(8):
        new_ids = torch.stack([torch.tensor(rng.sample(range(12), k)) for _ in range(4)]).cuda()
        ids.copy_(new_ids)
        w.copy_(torch.rand(4, k, generator=g))
        graph.replay()
        want = plan_layer(torch_tables, rule, 0, new_ids, w.clone())
        assert torch.equal(captured.pair_slot, want.pair_slot) and torch.equal(captured.counts, want.counts), step
        assert torch.equal(triton_tables.slot_of[:-1], torch_tables.slot_of[:-1]), step


def test_the_device_plan_is_on_wherever_a_gpu_runs_the_engine(engine_dir, monkeypatch):
    """The default: on a GPU, off where the CPU stands in for one; FTC_DEVICE_PLAN=0 or 1 decides
    instead, and OffloadConfig.device_plan over both."""
    from ftc_runtime.engine import _device_plan
    from ftc_runtime.settings import SettingsError

    cfg = OffloadConfig(device="cpu", n_slots=4)
    assert not Engine.load(engine_dir, offload=cfg).model.experts.device_plan
    on_gpu, cuda_off = OffloadConfig(device="cuda"), OffloadConfig(device="cuda", device_plan=False)
    assert _device_plan(on_gpu) and not _device_plan(cuda_off)
    monkeypatch.setenv("FTC_DEVICE_PLAN", "1")
    assert Engine.load(engine_dir, offload=cfg).model.experts.device_plan
    monkeypatch.setenv("FTC_DEVICE_PLAN", "0")
    assert not _device_plan(on_gpu) and _device_plan(OffloadConfig(device="cpu", device_plan=True))
    monkeypatch.setenv("FTC_DEVICE_PLAN", "maybe")
    with pytest.raises(SettingsError, match="FTC_DEVICE_PLAN='maybe'"):
        Engine.load(engine_dir, offload=cfg)


class HostRouting:
    """A routing hook with no device form (as `ftc trace`'s recorder): decode cannot be one graph."""

    def route(self, moe_layer: int, positions: np.ndarray, ids: np.ndarray,
              weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return ids, weights


def test_a_device_step_that_cannot_run_says_why_once(engine_dir, capsys):
    """Where the device plan is on beside a GPU but the one-graph step lacks something, decode takes
    the host path and says why, once for each reason. On the CPU the flag `on_gpu` stands in for
    the GPU, and each lack is mended in turn to reach the next."""
    experts = Engine.load(engine_dir, offload=OffloadConfig(device="cpu", n_slots=4, device_plan=True)).model.experts
    assert not experts.device_step_ready()  # the CPU: no device step, nothing to say
    assert capsys.readouterr().err == ""
    experts.on_gpu = True
    experts.routing = HostRouting()
    mends = [("not mapped into the device", lambda: setattr(experts.device_path, "gather", lambda plan: None)),
             ("no background worker pool", lambda: setattr(experts.kernel, "background", True)),
             ("no generated device expert kernels", lambda: setattr(experts.store, "kernels", object())),
             ("HostRouting", lambda: setattr(experts, "routing", None))]
    for reason, mend in mends:
        assert not any(experts.device_step_ready() for _ in range(3))
        said = capsys.readouterr().err
        assert said.count("decode steps take the host path") == 1 and reason in said, (reason, said)
        mend()
    assert experts.device_step_ready() and capsys.readouterr().err == ""


@pytest.mark.gpu
def test_gather_fills_copy_the_plans_rows_from_the_mapped_pool(seed):
    """The fill kernel reads the pinned host rows through their device mapping and writes exactly
    the plan's fills (up to its count) into their slots; every other slot keeps its bytes."""
    from ftc_runtime.experts.device.device_plan import LayerPlan
    from ftc_runtime.experts.device.gather_fills import gather_fills
    from ftc_runtime.io.host_memory import MappedHost, mapped_address, pin_in_place

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    rows, n_slots, stride, n = 50, 20, 4 * rng.choice([1000, 70001, 640000]), 16
    pool = torch.randint(0, 256, (rows, stride), dtype=torch.uint8, generator=g)
    assert pin_in_place(pool)
    address = mapped_address(pool, pool.data_ptr())
    assert address is not None
    slots = torch.randint(0, 256, (n_slots, stride), dtype=torch.uint8, device="cuda")
    for _ in range(4):
        n_fill = rng.randrange(0, 9)
        fill_rows, fill_slots = torch.full((n,), -1), torch.full((n,), -1)
        fill_rows[:n_fill] = torch.tensor(rng.sample(range(rows), n_fill), dtype=torch.long)
        fill_slots[:n_fill] = torch.tensor(rng.sample(range(n_slots), n_fill), dtype=torch.long)
        unused = torch.zeros(n, dtype=torch.long)
        plan = LayerPlan(unused.view(2, 8), fill_rows.cuda(), fill_slots.cuda(), unused, unused, unused,
                         unused.float(), torch.tensor([0, n_fill, 0, n_fill]).cuda(), unused.int().expand(3, n),
                         unused.int().expand(2, 3, n))
        want = slots.cpu()
        want[fill_slots[:n_fill]] = pool[fill_rows[:n_fill]]
        gather_fills(MappedHost(address), slots, plan)
        assert torch.equal(slots.cpu(), want), (n_fill, stride)


@pytest.mark.parametrize("path", ["native", "general", "device"])
def test_fills_without_recurring_routing_leave_the_cache_as_it_was(cpu_engine, path, seed):
    """Adaptive without the recency rule: a fill serves its call only. Over many calls of random
    routing, whatever the split fills, the slots whose expert changed are never more than one
    call's fills: each call's victims are the last call's fill slots (and empty slots), so the
    experts that were resident before stay resident. With the recency rule the same calls replace
    more of them. Each path (the native one-token plan, the general host path, the device plan in
    torch) on its own cache."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    e, k, layers = cpu_engine.spec.moe.num_experts, cpu_engine.spec.moe.top_k, len(cpu_engine.spec.moe_layers)
    changed = {}
    for recent in (0, 4):
        planner = MissPlanner("adaptive", 20.0, 40.0, 18.0, 30.0, recent_tokens=recent)
        off = OffloadedExperts(cpu_engine.model.experts.pool, cpu_engine.model.experts.kernel, torch.device("cpu"),
                               e * layers // 2, planner, device_plan=path == "device")
        off.native_token_plan = path == "native"
        held = rng.sample(range(e * layers), off.n_slots)
        off.cache.install(np.arange(off.n_slots), np.array(held))
        off.cache.last_used[:] = np.arange(off.n_slots)
        before = off.cache.id_of.copy()
        fills = 0
        for _ in range(200):
            layer = rng.randrange(layers)
            ids = torch.tensor([rng.sample(range(e), k)])
            hidden = torch.randn(1, cpu_engine.spec.hidden_size, generator=g)
            was = off.stats.fills
            off.forward(layer, hidden, ids, torch.rand(1, k, generator=g))
            fills += off.stats.fills - was
        changed[recent] = int((off.cache.id_of != before).sum())
        assert fills > k, f"seed={seed}: {path}, recent {recent}: {fills} fills"
    assert changed[0] <= k < changed[4], f"seed={seed}: {path}: {changed}"
