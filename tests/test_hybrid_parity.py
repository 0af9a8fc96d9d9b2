"""Engines compiled from tiny random Qwen3.5-MoE and Qwen3-Next checkpoints (Gated DeltaNet, gated
full attention, a shared expert) reproduce transformers' fp32 eager reference: logits, 32 greedy
tokens, prompts in several chunks, batched decode, and a sequence rewound to a recurrent-state
checkpoint. The engines use the AVX2 kernel (fp32 activations), so agreement is tight."""

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

from hf_hybrid_models import VOCAB, build_hybrid, save_hybrid_checkpoint
from hf_models import reference_logits

CASES = [  # (family, expert layout, Qwen3.5 as the image-text model's language model)
    ("qwen3_5_moe", "fused", True),
    ("qwen3_5_moe", "per_expert", False),
    ("qwen3_next", "fused", False),
    ("qwen3_next", "per_expert", False),
]
# transformers runs the Gated DeltaNet chunk-wise, the engine token by token (the same sums in
# another order), and the engine's kernels sum the experts in their own order: ~1e-6 apart.
BOUND = 1e-4
# Decode runs the linear layers token by token, transformers' full forward chunk-wise; where the
# router's k-th and (k+1)-th experts nearly tie, that ~1e-6 difference can swap them, moving the
# output by their small weight gap: up to 2.7e-4 at one position over 1809 batched sequences.
# A lost state or a wrong position is off by more than 1e-2.
DECODE_BOUND = 1e-3
MIN_GREEDY_MARGIN = 1e-3


@pytest.fixture(scope="module", params=range(len(CASES)),
                ids=[f"{f}-{lay}{'-nested' if n else ''}" for f, lay, n in CASES])
def engine_and_model(request, tmp_path_factory):
    fam, layout, nested = CASES[request.param]
    model = build_hybrid(fam, seed=2000 + request.param)
    root = tmp_path_factory.mktemp(f"hybrid{request.param}")
    ckpt = save_hybrid_checkpoint(model, root / "ckpt", layout, nested)
    engine = compile_engine(CompileOptions(source=ckpt, target="cpu", output=root / "engine"))
    return Engine.load(engine), model


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _ids(n: int) -> list[int]:
    return [random.randrange(VOCAB) for _ in range(n)]


def test_the_spec_is_the_family(engine_and_model):
    engine, model = engine_and_model
    spec = engine.spec
    assert spec.family == model.config.model_type.removesuffix("_text")
    assert spec.layer_kinds == tuple(model.config.layer_types)
    assert spec.moe.num_shared_experts == 1 and spec.attention.output_gate and spec.norm.kind == "rms_one_plus"


def test_logits_match_transformers(engine_and_model):
    engine, model = engine_and_model
    ids = _ids(random.randrange(2, 60))
    ours, ref = engine.logits(ids), reference_logits(model, ids)
    assert _rel(ours, ref) < BOUND
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_32_tokens_match_transformers(engine_and_model):
    engine, model = engine_and_model
    for _ in range(100):
        ids = _ids(random.randrange(3, 12))
        seq, margin = list(ids), float("inf")
        with torch.no_grad():
            for _ in range(32):
                top2 = model(torch.tensor([seq])).logits[0, -1].topk(2)
                margin = min(margin, float(top2.values[0] - top2.values[1]))
                seq.append(int(top2.indices[0]))
        if margin > MIN_GREEDY_MARGIN:
            break
    else:
        pytest.fail("no prompt in 100 draws without a near-tie in its 32 greedy steps")
    ours = list(engine.generate(ids, 32, SamplingParams(temperature=0.0), stop_at_eos=False))
    assert ours == seq[len(ids):], f"ids={ids}"


@pytest.mark.parametrize("offloaded", [False, True])
def test_prompt_in_uneven_chunks_matches_transformers(engine_and_model, offloaded):
    """Chunks of 5-13 tokens carry the linear layers' state and the KV cache from one to the next;
    offloaded, the experts come from a slot cache on the emulated device (the CPU)."""
    engine, model = engine_and_model
    chunk = random.randrange(5, 14)
    ids = _ids(chunk * random.randrange(2, 5) + random.randrange(1, chunk))
    offload = OffloadConfig(device="cpu", n_slots=random.randrange(3, 20), b_p=20.0, b_h=40.0) if offloaded else None
    chunked = Engine.load(engine.manifest.root, offload=offload, prefill_chunk=chunk)
    assert _rel(chunked.logits(ids), reference_logits(model, ids)) < BOUND


def test_batched_decode_matches_transformers(engine_and_model):
    """Sequences of different lengths decoded together, one call per step: each gets the logits
    transformers gives its own tokens."""
    engine, model = engine_and_model
    prompts = [_ids(random.randrange(1, 20)) for _ in range(random.randrange(2, 5))]
    steps = [_ids(5) for _ in prompts]
    caches = [engine.model.new_cache() for _ in prompts]
    for ids, cache in zip(prompts, caches, strict=True):
        engine.prefill(torch.tensor(ids), cache)
    batched = [engine.model.decode_batch([s[t] for s in steps], caches) for t in range(5)]
    for j, ids in enumerate(prompts):
        ref = reference_logits(model, ids + steps[j])[len(ids):]
        ours = torch.stack([batched[t][j] for t in range(5)])
        assert _rel(ours, ref) < DECODE_BOUND, j


def test_a_restored_checkpoint_continues_as_an_uninterrupted_run(engine_and_model):
    """The state taken at token p, restored after the sequence went elsewhere, continues with the
    logits of a run that never left: the engine's own and transformers'."""
    engine, model = engine_and_model
    prefix, detour, after = _ids(random.randrange(1, 15)), _ids(random.randrange(1, 10)), _ids(random.randrange(1, 10))
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
    assert _rel(ours, reference_logits(model, prefix + after)[len(prefix):]) < BOUND
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


def test_a_random_tiny_hybrid_runs_offloaded_as_on_the_cpu(tmp_path):
    """The tiny spec compiles from random weights; with its experts behind a slot cache on the
    emulated device (every miss policy's share of fills and CPU experts) it decodes the all-CPU
    engine's greedy tokens."""
    engine = compile_engine(CompileOptions(source=SPECS / "qwen3.6-moe-tiny.yaml", target="cpu",
                                           output=tmp_path / "engine", random_weights=True))
    cpu = Engine.load(engine)
    ids = [random.randrange(500) for _ in range(random.randrange(5, 40))]
    want = list(cpu.generate(ids, 16, SamplingParams(0.0), stop_at_eos=False))
    for policy in ("adaptive", "gpu", "cpu"):
        cfg = OffloadConfig(device="cpu", n_slots=random.randrange(4, 40), miss_policy=policy, b_p=20.0, b_h=40.0)
        off = Engine.load(engine, offload=cfg)
        assert list(off.generate(ids, 16, SamplingParams(0.0), stop_at_eos=False)) == want, policy
        assert _rel(off.logits(ids), cpu.logits(ids)) < 1e-5
