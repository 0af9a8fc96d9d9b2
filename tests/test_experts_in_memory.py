"""Benchmark engines whose expert pool is generated straight into memory hold the same experts as
the FTW file a normal compile writes, and refuse to load without that pool."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ftc.compile.pipeline import CompileOptions, compile_engine, compile_with_experts_in_memory
from ftc_runtime import Engine, SamplingParams
from ftc_runtime.artifact import ArtifactError
from ftc_runtime.engine import OffloadConfig
from ftc_runtime.spec import SpecError

SPEC = Path(__file__).resolve().parents[1] / "model_specs" / "qwen3-moe-tiny.yaml"


def test_in_memory_pool_equals_the_written_file(tmp_path, seed):
    rng = random.Random(seed)
    opts = dict(source=SPEC, target="cpu", random_weights=True, seed=rng.randrange(1000), overrides=("num_layers=2",))
    on_disk = Engine.load(compile_engine(CompileOptions(output=tmp_path / "disk", **opts)))
    root, pool = compile_with_experts_in_memory(CompileOptions(output=tmp_path / "mem", **opts))
    assert not (root / "experts.ftw").exists()
    h = pool.header
    for row in range(h.num_rows):
        for bank in h.banks:
            assert torch.equal(pool.bank(bank.name)[row], on_disk.pool.bank(bank.name)[row])
    in_memory = Engine.load(root, pool=pool)
    ids = [rng.randrange(256) for _ in range(10)]
    want = list(on_disk.generate(ids, 12, SamplingParams(0.0), stop_at_eos=False))
    assert list(in_memory.generate(ids, 12, SamplingParams(0.0), stop_at_eos=False)) == want
    offloaded = Engine.load(root, pool=pool, offload=OffloadConfig(device="cpu", n_slots=9, b_p=20, b_h=60))
    assert list(offloaded.generate(ids, 12, SamplingParams(0.0), stop_at_eos=False)) == want
    with pytest.raises(ArtifactError, match="experts in memory"):
        Engine.load(root)


def test_in_memory_is_only_for_random_weights(tmp_path):
    with pytest.raises(SpecError, match="random-weights"):
        compile_with_experts_in_memory(CompileOptions(source=SPEC, output=tmp_path / "x"))
