"""The CPU doorbell (`decode/cpu_doorbell.py`, csrc/cpu_doorbell.cpp): jobs written into its
mailbox from the host, as the GPU will write them, are computed by the native thread and
answered in order, with what the engine's CPU kernel computes for the same routing."""

from __future__ import annotations

import random

import pytest
import torch

from ftc_runtime.decode.cpu_doorbell import DONE, CpuDoorbell, DoorbellError
from ftc_runtime.experts.base import Routing


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
