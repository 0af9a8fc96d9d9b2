"""The CPU doorbell (`experts/device/cpu_doorbell.py`, csrc/cpu_doorbell.cpp): jobs written into its
mailbox from the host, as the GPU will write them, are computed by the native thread and
answered in order, with what the engine's CPU kernel computes for the same routing."""

from __future__ import annotations

import random

import pytest
import torch

from ftc_runtime.experts.base import Routing
from ftc_runtime.experts.device.cpu_doorbell import DONE, CpuDoorbell, DoorbellError


@pytest.fixture
def doorbell(cpu_engine):
    experts = cpu_engine.model.experts
    kernel = experts.kernel.on_cpus([0], background=True)
    bell = CpuDoorbell(kernel, experts.pool.experts, max_tokens=4, max_entries=4 * cpu_engine.spec.moe.top_k,
                       pinned=False, spin_ms=1.0)
    yield bell
    bell.close()


def write_job(bell: CpuDoorbell, r: Routing, x: torch.Tensor, which) -> None:
    ids, offsets, tok, w = r.subset(which)
    n, entries = ids.size, int(offsets[-1])
    bell.n_tokens[0] = x.shape[0]
    bell.counts[2] = n
    bell.cpu_ids[:n] = torch.from_numpy(ids)
    bell.cpu_offsets[:n + 1] = torch.from_numpy(offsets).long()
    bell.cpu_tok[:entries] = torch.from_numpy(tok).long()
    bell.cpu_w[:entries] = torch.from_numpy(w)
    bell.x[:x.shape[0]] = x


def test_jobs_are_answered_in_order_with_the_kernels_result(cpu_engine, doorbell, seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    experts = cpu_engine.model.experts
    e, k, hidden = cpu_engine.spec.moe.num_experts, cpu_engine.spec.moe.top_k, cpu_engine.spec.hidden_size
    for job in range(12):
        t = rng.choice([1, 1, 2, 4])
        layer = rng.randrange(len(cpu_engine.spec.moe_layers))
        ids = torch.stack([torch.tensor(rng.sample(range(e), k)) for _ in range(t)])
        r = Routing.build(layer * e, ids.numpy(), torch.rand(t, k, generator=g).numpy())
        which = torch.randperm(r.ids.size, generator=g)[:rng.randrange(0, r.ids.size + 1)].sort().values.numpy()
        x = torch.randn(t, hidden, generator=g)
        write_job(doorbell, r, x, which)
        doorbell.out[:t] = float("nan")  # a job with no CPU expert answers zeros, not what was there
        doorbell.wait(doorbell.ring())
        want = torch.zeros(t, hidden)
        if which.size:
            experts.kernel.run(experts.pool.experts, x, want, *r.tensors(which))
        assert torch.equal(doorbell.out[:t], want), f"job {job}: {t} tokens, {which.size} CPU experts"
    assert int(doorbell.flags[DONE]) == 12


def test_a_job_beyond_the_buffers_is_refused_and_the_next_runs(cpu_engine, doorbell, seed):
    g = torch.Generator().manual_seed(seed)
    k, hidden = cpu_engine.spec.moe.top_k, cpu_engine.spec.hidden_size
    r = Routing.build(0, torch.arange(k).view(1, k).numpy(), torch.rand(1, k, generator=g).numpy())
    write_job(doorbell, r, torch.randn(1, hidden, generator=g), torch.arange(k).numpy())
    doorbell.n_tokens[0] = 5
    with pytest.raises(DoorbellError, match="5 tokens and .* exceed the doorbell's buffers"):
        doorbell.wait(doorbell.ring())
    doorbell.n_tokens[0] = 1
    doorbell.wait(doorbell.ring())
    want = torch.zeros(1, hidden)
    experts = cpu_engine.model.experts
    experts.kernel.run(experts.pool.experts, doorbell.x[:1].clone(), want, *r.tensors())
    assert torch.equal(doorbell.out[:1], want)


def test_the_pool_is_the_doorbells_until_it_closes(cpu_engine):
    """A kernel on a caller-joined pool cannot host a doorbell; a closed doorbell gives its pool back."""
    experts = cpu_engine.model.experts
    with pytest.raises(ValueError, match="background worker pool"):
        CpuDoorbell(experts.kernel.on_cpus([0], background=False), experts.pool.experts, 1, 8, pinned=False)
    kernel = experts.kernel.on_cpus([0], background=True)
    bell = CpuDoorbell(kernel, experts.pool.experts, 1, 8, pinned=False)
    assert kernel._lock.locked()
    bell.close()
    assert not kernel._lock.locked()


@pytest.mark.parametrize("kernel_first", [True, False])
def test_a_doorbell_and_its_kernel_are_freed_in_either_order(cpu_engine, kernel_first):
    """The garbage collector finalizes a cycle's objects in any order (a failed test's frame holds
    both): the kernel stops the doorbell's thread before it frees the pool the thread runs on, and
    a doorbell closed after its kernel has nothing left to do."""
    experts = cpu_engine.model.experts
    kernel = experts.kernel.on_cpus([0], background=True)
    bell = CpuDoorbell(kernel, experts.pool.experts, 1, 8, pinned=False)
    first, second = (kernel, bell) if kernel_first else (bell, kernel)
    first.__del__()
    second.__del__()
    assert not kernel._lock.locked() and kernel._pool is None


@pytest.mark.gpu
def test_the_gpu_rings_and_joins_the_cpu_job_also_in_a_graph(cpu_engine, seed):
    """The device posts the plan's CPU job into the pinned mailbox and rings, the doorbell thread
    computes it, the device waits and adds it: eagerly, then as one captured graph replayed on new
    inputs (the job numbers go on on the device), each time the CPU kernel's own result."""
    from ftc_runtime.experts.cache import ExpertCache
    from ftc_runtime.experts.device.device_plan import CacheTables, PlanRule
    from ftc_runtime.experts.device.doorbell_kernels import DoorbellKernels
    from ftc_runtime.experts.device.plan_kernel import plan_layer_triton
    from ftc_runtime.experts.miss_planner import MissPlanner

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    experts = cpu_engine.model.experts
    e, k, hidden = cpu_engine.spec.moe.num_experts, cpu_engine.spec.moe.top_k, cpu_engine.spec.hidden_size
    bell = CpuDoorbell(experts.kernel.on_cpus([0], background=True), experts.pool.experts, 4, 4 * k, pinned=True)
    device = DoorbellKernels(bell, torch.device("cuda"))
    tables = CacheTables.of(ExpertCache(experts.pool.header.num_rows, 0), "cuda")  # no slots: all on the CPU
    rule = PlanRule.of(MissPlanner("cpu"), 4 * k, 0, True, "cuda")
    ids, w = torch.zeros(4, k, dtype=torch.long, device="cuda"), torch.zeros(4, k, device="cuda")
    x, out = torch.zeros(4, hidden, device="cuda"), torch.zeros(4, hidden, device="cuda")
    # no slots, so no pair has a device row: the join must not read these
    hits, fills = (torch.full((4 * k, hidden), float("nan"), device="cuda") for _ in range(2))

    def step() -> None:
        out.fill_(float("nan"))  # the join writes every row
        plan = plan_layer_triton(tables, rule, 0, ids, w)
        device.post_job(plan, x)
        device.wait_and_join(out, plan, rule, hits, fills)

    def check(what: str) -> None:
        torch.cuda.synchronize()
        device.check()
        want = torch.zeros(4, hidden)
        r = Routing.build(0, ids.cpu().numpy(), w.cpu().numpy())
        experts.kernel.run(experts.pool.experts, x.cpu(), want, *r.tensors())
        assert (out.cpu() - want).norm() <= 1e-5 * want.norm(), what

    def new_inputs() -> None:
        ids.copy_(torch.stack([torch.tensor(rng.sample(range(e), k)) for _ in range(4)]))
        w.copy_(torch.rand(4, k, generator=g))
        x.copy_(torch.randn(4, hidden, generator=g))

    try:
        for job in range(3):
            new_inputs()
            step()
            check(f"eager job {job}")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for job in range(5):
            new_inputs()
            graph.replay()
            check(f"replay {job}")
        assert int(bell.flags[DONE]) == 8
    finally:
        bell.close()


@pytest.mark.gpu
def test_the_wait_tunes_the_split_towards_the_side_that_finished_last(seed):
    """The join on a mailbox answered by this thread: an answer already there moves the
    adaptive split's bias down one step (the GPU's share took longer), an answer that comes while
    the device spins moves it up; a layer without a choice (under two misses, or no CPU job while
    the split itself chose fewer fills than misses, or a rule that sent its misses to one side
    alone) and an untuned rule leave it. The output is
    the pairs' rows that have a slot plus the CPU's result where the call had CPU experts (a call
    without them posted no job: no wait, and the split chose every fill, the bias moves down as
    for an answer already there)."""
    import threading
    import time

    from ftc_runtime.experts.device.device_plan import TUNE_STEP, LayerPlan, PlanRule
    from ftc_runtime.experts.device.doorbell_kernels import DoorbellKernels, join_relay
    from ftc_runtime.experts.miss_planner import MissPlanner
    from ftc_runtime.io.host_memory import MappedHost

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    # one column block, or three programs (the answer relayed from the first)
    hidden, seq, k = rng.choice([64, 1100]), rng.randrange(2, 1000), 8
    done = torch.zeros(1, dtype=torch.int64).pin_memory()
    box_out = torch.randn(1, hidden, generator=g).pin_memory()
    kernels = DoorbellKernels.__new__(DoorbellKernels)  # its device side over this test's mailbox
    kernels.done, kernels.box = MappedHost.of(done), {"out": MappedHost.of(box_out)}
    kernels.counter = torch.tensor([seq], device="cuda")
    kernels.status, kernels.relay = torch.zeros(1, dtype=torch.int64, device="cuda"), join_relay("cuda")

    def wait(counts: list[int], answer_after_s: float | None, tune: bool) -> float:
        """The bias after one wait from `start`; answer_after_s None: answered before it."""
        rule = PlanRule.of(MissPlanner("adaptive" if tune else "gpu", 25.0, 50.0), k, 0, True, "cuda")
        start = rng.randrange(-32, 33) * TUNE_STEP
        rule.bias.fill_(start)
        # each entry a hit, a fill or the CPU's; the pairs' rows as the experts left them
        where = torch.tensor([rng.choice([0, 1, 2]) for _ in range(k)])
        phase_pairs = torch.stack([torch.stack([torch.where(where == phase, 3, -1), torch.zeros(k, dtype=torch.long),
                                                torch.zeros(k, dtype=torch.long)]) for phase in range(2)])
        plan = LayerPlan(*(None,) * 7, torch.tensor(counts, device="cuda"), phase_pairs[0].int().cuda(),
                         phase_pairs.int().cuda())
        hits, fills = torch.randn(k, hidden, generator=g), torch.randn(k, hidden, generator=g)
        rows = torch.where((where == 0)[:, None], hits, torch.where((where == 1)[:, None], fills, 0.0))
        # a call without CPU experts posted no job, so none is added
        want = rows.sum(0, keepdim=True) + (box_out if counts[2] else 0)
        out = torch.full((1, hidden), float("nan"), device="cuda")
        done[0] = seq if answer_after_s is None else seq - 1
        answer = threading.Timer(answer_after_s or 0.0, lambda: done.fill_(seq))
        if answer_after_s is not None:
            answer.start()
        kernels.wait_and_join(out, plan, rule, hits.cuda(), fills.cuda())
        torch.cuda.synchronize()
        if answer_after_s is not None:
            answer.join()
        assert int(kernels.status[0]) == 0
        assert torch.allclose(out.cpu(), want, atol=1e-5), "the CPU's result (where it had a job) and the pairs'"
        return float(rule.bias[0]) - start

    m = rng.randrange(2, 9)
    q = rng.randrange(0, m)  # a CPU job of m - q experts
    assert wait([1, q, m - q, q], None, True) == -TUNE_STEP
    t0 = time.perf_counter()
    assert wait([1, q, m - q, q], 0.05, True) == TUNE_STEP
    assert time.perf_counter() - t0 >= 0.05
    assert wait([0, m, 0, m], None, True) == -TUNE_STEP  # the split chose every fill: the GPU's side
    assert wait([0, m, 0, m], 0.05, True) == -TUNE_STEP  # no CPU job: no wait for an answer
    assert wait([0, m, 0, m - 1], None, True) == 0.0  # the recent misses took every fill
    assert wait([3, 1, 0, 1], None, True) == 0.0  # one miss: no choice
    assert wait([1, q, m - q, -1], 0.02, True) == 0.0  # the rule sent the misses to one side alone
    assert wait([1, q, m - q, q], 0.02, False) == 0.0
