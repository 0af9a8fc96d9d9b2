"""What only the hybrid families (qwen3_5_moe, qwen3_next: Gated DeltaNet, gated full attention, a
shared expert) have, beyond the parity tests that every family's engines pass
(test_transformers_parity.py): their specs' structure, a sequence rewound to a recurrent-state
checkpoint, the released Qwen3.6 spec's shapes, and the tiny Qwen3.6 spec offloaded as on the CPU."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ftc.compile.pipeline import CompileOptions, compile_engine
from ftc.compile.spec_loader import load_spec
from ftc_runtime import Engine, SamplingParams
from ftc_runtime.engine import OffloadConfig
from ftc_runtime.models import family

from conftest import seed_for
from families import CASES, fp64_reference, reference_logits, rel, well_conditioned

HYBRID = ("qwen3_5_moe", "qwen3_next")


@pytest.fixture(scope="module", params=[c for c in CASES if c.family.name in HYBRID], ids=lambda c: c.id)
def engine_and_model(request, tmp_path_factory) -> tuple[Engine, torch.nn.Module, torch.nn.Module, float]:
    """The parity tests' engines of the hybrid families (the same weights), the reference model, its
    fp64 copy and the prompt bound."""
    case = request.param
    engine, model = case.compile(tmp_path_factory.mktemp(case.id), seed_for(case.model_id))
    return engine, model, fp64_reference(model), case.family.bounds[engine.manifest.plan.isa].prompt.rel


def test_the_spec_is_the_family(engine_and_model):
    engine, model, _, _ = engine_and_model
    spec = engine.spec
    assert spec.family == model.config.model_type.removesuffix("_text")
    assert spec.layer_kinds == tuple(model.config.layer_types)
    assert spec.moe.num_shared_experts == 1 and spec.attention.output_gate and spec.norm.kind == "rms_one_plus"


def test_a_restored_checkpoint_continues_as_an_uninterrupted_run(engine_and_model, seed):
    """The state taken at token p, restored after the sequence went elsewhere, continues with the
    logits of a run that never left: the engine's own and transformers'."""
    engine, model, model64, bound = engine_and_model
    rng = random.Random(seed)

    def ids(most: int) -> list[int]:
        return [rng.randrange(engine.spec.vocab_size) for _ in range(rng.randrange(1, most))]

    for _ in range(100):  # redrawn where transformers' fp32 logits can't be held to the bound
        prefix, detour, after = ids(15), ids(10), ids(10)
        if well_conditioned(model, model64, prefix + after, bound):
            break
    else:
        pytest.fail("100 draws, each with a router near tie or an fp32 reference far from fp64")
    cache = engine.model.new_cache()
    engine.prefill(torch.tensor(prefix), cache)
    checkpoint = cache.take()
    engine.prefill(torch.tensor(detour), cache)
    engine.model.forward(torch.tensor([detour[0]]), cache)  # and a decode step
    cache.restore(checkpoint)
    ours = engine.prefill(torch.tensor(after), cache, all_logits=True)
    straight = engine.model.new_cache()
    engine.prefill(torch.tensor(prefix), straight)
    assert torch.equal(ours, engine.prefill(torch.tensor(after), straight, all_logits=True))
    assert rel(ours, reference_logits(model, prefix + after)[len(prefix):]) < bound
    with pytest.raises(ValueError, match="holds only"):
        engine.model.new_cache().restore(checkpoint)


SPECS = Path(__file__).resolve().parents[1] / "model_specs"


def test_the_qwen36_spec_has_the_released_shapes():
    spec, _ = load_spec(SPECS / "qwen3.6-35b-a3b.yaml")
    assert (spec.num_layers, len(spec.linear_attention_layers), len(spec.full_attention_layers)) == (40, 30, 10)
    assert spec.full_attention_layers == tuple(range(3, 40, 4))
    assert (spec.moe.num_experts, spec.moe.top_k, spec.moe.num_shared_experts) == (256, 8, 1)
    assert spec.expert_bytes == 3 * 2048 * 512 * 2
    shapes = family(spec.family).dense_tensor_shapes(spec)
    assert shapes["model.layers.0.linear_attn.in_proj_qkv.weight"] == (2 * 16 * 128 + 32 * 128, 2048)
    assert shapes["model.layers.3.self_attn.q_proj.weight"] == (2 * 16 * 256, 2048)


def test_a_random_tiny_hybrid_runs_offloaded_as_on_the_cpu(tmp_path, seed):
    """The tiny spec compiles from random weights; with its experts behind a slot cache on the
    emulated device (every miss policy's share of fills and CPU experts) it decodes the all-CPU
    engine's greedy tokens."""
    engine = compile_engine(CompileOptions(source=SPECS / "qwen3.6-moe-tiny.yaml", target="cpu",
                                           output=tmp_path / "engine", random_weights=True))
    cpu = Engine.load(engine)
    rng = random.Random(seed)
    ids = [rng.randrange(500) for _ in range(rng.randrange(5, 40))]
    want = list(cpu.generate(ids, 16, SamplingParams(0.0), stop_at_eos=False))
    for policy in ("adaptive", "gpu", "cpu"):
        cfg = OffloadConfig(device="cpu", n_slots=rng.randrange(4, 40), miss_policy=policy, b_p=20.0, b_h=40.0)
        off = Engine.load(engine, offload=cfg)
        assert list(off.generate(ids, 16, SamplingParams(0.0), stop_at_eos=False)) == want, policy
        assert rel(off.logits(ids), cpu.logits(ids)) < 1e-5
