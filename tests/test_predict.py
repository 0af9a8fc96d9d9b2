"""`ftc inspect SPEC --target`'s prediction (ftc/predict.py) against a simulation: uniform routing
through the engine's own LRU slot cache (`ExpertCache`) with the planner's split, layer by layer,
and the arithmetic of the GPU's reads; and the command itself."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ftc.cli.main import app
from ftc.compile.spec_loader import load_spec
from ftc.compile.targets import PRESETS
from ftc.predict import PredictionError, predict
from ftc_runtime.experts.cache import ExpertCache
from ftc_runtime.experts.miss_planner import MissPlanner
from ftc_runtime.models import family

SPECS = Path(__file__).resolve().parents[1] / "model_specs"


def _simulated_miss_ms(spec, target, n_slots: int, stride: int, tokens: int, rng: np.random.Generator) -> float:
    """Mean miss time per token: every MoE layer's k experts drawn uniformly, looked up in an LRU
    cache of n_slots over the whole pool (warmed with random experts first), q of the m misses
    filled into the LRU victims, the rest left to the CPU, as the engine's host path does."""
    layers, e, k = len(spec.moe_layers), spec.moe.num_experts, spec.moe.top_k
    cache = ExpertCache(layers * e, n_slots)
    cache.install(np.arange(n_slots), rng.permutation(layers * e)[:n_slots])
    planner = MissPlanner("adaptive", target.b_p, target.b_h, target.b_p_concurrent, target.b_h_concurrent)
    total = 0.0
    for _ in range(tokens):
        for layer in range(layers):
            ids = layer * e + rng.choice(e, k, replace=False)
            slots = cache.lookup(ids)
            hit, miss = slots[slots >= 0], ids[slots < 0]
            q = planner.fills(miss.size)
            total += planner.bound_s(miss.size, q, stride)
            victims = cache.victims(q, in_use=hit)
            cache.install(victims, miss[:q])
            cache.touch(np.concatenate([hit, victims]))
    return 1e3 * total / tokens


# Budgets that cache part of each pool (the tiny model's: about half of its 48 experts).
@pytest.mark.parametrize("name,quant,budget_mib", [("qwen3-30b-a3b", None, 16 << 10),
                                                   ("qwen3-30b-a3b", "mxfp4", 8 << 10), ("glm-5-tiny", None, 76)])
def test_the_decode_prediction_matches_a_simulation_of_the_cache(name, quant, budget_mib, seed):
    spec, _ = load_spec(SPECS / f"{name}.yaml", quant=quant)
    target = PRESETS["rtx-5090"]
    p = predict(spec, target, budget_mib * 2**20, 4096)
    assert 0 < p.vram.pool_share < 1
    # About 2,000 draws of a layer's misses: a few percent of noise
    simulated = _simulated_miss_ms(spec, target, p.vram.n_slots, p.vram.expert_stride, 2000 // len(spec.moe_layers),
                                   np.random.default_rng(seed))
    assert simulated == pytest.approx(p.miss_ms, rel=0.1), (simulated, p.miss_ms)
    fixed = len(spec.moe_layers) * family(spec.family).decode_fixed_ms
    assert p.decode_tok_s == pytest.approx(1e3 / (p.miss_ms + p.device_ms + fixed))


def test_the_gpu_reads_are_the_dense_weights_and_the_device_experts():
    """With every expert resident (a budget beyond the pool), no misses: the GPU reads the
    non-expert weights but the embedding table, one embedding row and every layer's k experts."""
    spec, _ = load_spec(SPECS / "qwen3-30b-a3b.yaml")
    target = PRESETS["h200"]
    p = predict(spec, target, 140 * 2**30, 4096)
    assert p.vram.pool_share == 1 and p.miss_ms == 0 and p.prefill_tok_s is None
    h, v, layers = spec.hidden_size, spec.vocab_size, len(spec.moe_layers)
    attention = (2048 * 4096 * 2 + 2048 * 512 * 2 + 128 * 2) * 2 + (2 * h + 128 * h) * 2  # q, o, k, v, norms, router
    dense = layers * attention + (v * h + h) * 2 + h * 2  # lm_head and final norm, one embedding row
    experts = layers * spec.moe.top_k * p.vram.expert_stride
    assert p.device_ms == pytest.approx(1e3 * (dense + experts) / (target.gpu_read_gbps * 1e9), rel=1e-9)


def test_a_target_without_a_gpu_cannot_be_predicted():
    spec, _ = load_spec(SPECS / "qwen3-moe-tiny.yaml")
    with pytest.raises(PredictionError, match="--target cpu"):
        predict(spec, PRESETS["cpu"], 2**30, 4096)


def test_ftc_inspect_predicts_glm_5_2_on_the_rtx_pro_6000(seed):
    rng = random.Random(seed)
    budget = rng.choice([64, 96])
    r = CliRunner().invoke(app, ["inspect", str(SPECS / "glm-5.2.yaml"), "--target", "rtx-pro-6000",
                                 "--vram-budget", f"{budget}GiB", "--quant", "nvfp4"], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert f"within {budget}.00 GiB" in r.output and "tok/s" in r.output and "nvfp4" in r.output, r.output


def test_ftc_inspect_predicts_a_spec_cut_to_its_first_layers(seed):
    """`--override num_layers=N` (a device run's engine: the spec cut to the layers host memory
    holds) is predicted as those N layers; on an engine, where the spec is fixed, it is refused."""
    n = random.Random(seed).randrange(4, 40)
    r = CliRunner().invoke(app, ["inspect", str(SPECS / "glm-5.2.yaml"), "--target", "h200", "--vram-budget", "24GiB",
                                 "--override", f"num_layers={n}"], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert f"{n} ({n - 3} with experts)" in r.output and "tok/s" in r.output, r.output
    r = CliRunner().invoke(app, ["inspect", str(SPECS / "glm-5.2.yaml"), "--override", "num_layers=8"])
    assert r.exit_code != 0 and "--override edits a spec" in r.output, r.output


def test_fp8_dense_plan_counts_projections_as_an_fp8_release_stores_them():
    """GLM-5.2 with dense_format fp8: each attention and MLP projection (and the indexer's wq_b and
    wk) a byte a weight plus an fp32 scale per 128 × 128 block; the embedding, head, norms, router,
    the indexer's weights_proj and kv_b_proj stay bf16; the plan gives the saving to expert slots."""
    from ftc_runtime.experts.vram_plan import plan_vram
    from ftc_runtime.models import family
    from ftc_runtime.models.dense_layout import stored_bytes, stored_dense

    bf16_spec, _ = load_spec(SPECS / "glm-5.2.yaml")
    fp8_spec, _ = load_spec(SPECS / "glm-5.2.yaml", ["dense_format=fp8"])
    shapes = family(bf16_spec.family).dense_tensor_shapes(bf16_spec)
    projections = {name: s for name, s in shapes.items() if len(s) == 2 and not any(
        part in name for part in ("embed_tokens", "lm_head", "norm", "mlp.gate.", "weights_proj", "kv_b_proj",
                                  "eh_proj"))}  # the next-n layer's joining projection: bf16 in the FP8 releases
    assert projections and all(name.endswith(".weight") for name in projections)
    saved = sum(n * k - 4 * -(-n // 128) * -(-k // 128) for n, k in projections.values())
    bf16, fp8 = stored_dense(bf16_spec), stored_dense(fp8_spec)
    assert stored_bytes(bf16) == 2 * sum(int(np.prod(s)) for s in shapes.values())
    assert stored_bytes(bf16) - stored_bytes(fp8) == saved
    budget = stored_bytes(bf16) + (4 << 30)
    stride, pool = fp8_spec.expert_bytes, len(fp8_spec.moe_layers) * fp8_spec.moe.num_experts
    a, b = (plan_vram(fp8_spec, stored_bytes(s), budget, stride, pool, 4096) for s in (bf16, fp8))
    assert b.dense == a.dense - saved and b.n_slots > a.n_slots
