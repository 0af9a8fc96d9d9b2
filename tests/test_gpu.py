"""The offloaded expert path on a real GPU, against the same path emulated on the CPU and against
the all-CPU engine. Marked `gpu`: skipped where CUDA is absent; run on the device machine."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ftc.pipeline import CompileOptions, compile_engine
from ftc_runtime import Engine
from ftc_runtime.engine import OffloadConfig
from ftc_runtime.miss_planner import MissPlanner
from ftc_runtime.offload import OffloadedExperts

pytestmark = pytest.mark.gpu
SPEC = Path(__file__).resolve().parents[1] / "model_specs" / "qwen3-moe-tiny.yaml"


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    return compile_engine(CompileOptions(source=SPEC, random_weights=True, seed=11,
                                         output=tmp_path_factory.mktemp("gpu") / "tiny"))


@pytest.mark.parametrize("policy", ["adaptive", "gpu", "half"])
def test_cuda_offload_equals_the_emulated_path(engine_dir, policy):
    cpu = Engine.load(engine_dir).model.experts
    spec_e, k = cpu.num_experts, 4
    planner = MissPlanner(policy, 25.0, 50.0)
    n_slots = random.randrange(4, 40)
    on_gpu = OffloadedExperts(cpu.pool, cpu.kernel, torch.device("cuda"), n_slots, planner)
    emulated = OffloadedExperts(cpu.pool, cpu.kernel, torch.device("cpu"), n_slots, planner)
    assert on_gpu.pinned
    for _ in range(30):
        t = random.choice([1, 1, 3, 9])
        layer = random.randrange(cpu.pool.header.num_moe_layers)
        ids = torch.stack([torch.tensor(random.sample(range(min(spec_e, 7)), k)) for _ in range(t)])
        w, x = torch.rand(t, k), torch.randn(t, 256)
        got = on_gpu.forward(layer, x.cuda(), ids.cuda(), w.cuda()).cpu()
        want = emulated.forward(layer, x, ids, w)
        assert float((got - want).norm() / want.norm()) < 1e-4
    torch.cuda.synchronize()
    for slot, row in enumerate(on_gpu.cache.id_of.tolist()):
        if row >= 0:
            assert torch.equal(on_gpu.slots[slot].cpu(), on_gpu.host_rows[row])
    counts = ("calls", "unique", "hits", "fills", "cpu")
    assert [on_gpu.stats.to_dict()[c] for c in counts] == [emulated.stats.to_dict()[c] for c in counts]


def test_gpu_engine_matches_the_cpu_engine(engine_dir):
    cpu = Engine.load(engine_dir)
    gpu = Engine.load(engine_dir, offload=OffloadConfig(device="cuda", n_slots=20, b_p=25.0, b_h=50.0))
    ids = [random.randrange(256) for _ in range(40)]
    a, b = gpu.logits(ids).cpu(), cpu.logits(ids)
    assert float((a - b).norm() / b.norm()) < 3e-2  # bf16 dense layers on the GPU
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    assert gpu.vram.total <= torch.cuda.get_device_properties(0).total_memory


def test_triton_expert_kernel_matches_the_torch_path(engine_dir):
    from ftc_runtime.engine import _gpu_expert_kernel

    cpu = Engine.load(engine_dir).model.experts
    planner = MissPlanner("gpu", 25.0, 50.0)
    n_slots = random.randrange(8, 64)
    fast = OffloadedExperts(cpu.pool, cpu.kernel, torch.device("cuda"), n_slots, planner,
                            device_kernel=_gpu_expert_kernel(engine_dir, "cuda"))
    ref = OffloadedExperts(cpu.pool, cpu.kernel, torch.device("cuda"), n_slots, planner)
    for t in (1, 1, 2, 3, 9, 33):
        layer = random.randrange(cpu.pool.header.num_moe_layers)
        ids = torch.stack([torch.randperm(cpu.num_experts)[:4] for _ in range(t)]).cuda()
        w, x = torch.rand(t, 4, device="cuda"), torch.randn(t, 256, device="cuda")
        got, want = fast.forward(layer, x, ids, w), ref.forward(layer, x, ids, w)
        assert float((got - want).norm() / want.norm()) < 1e-5, f"{t} tokens"
