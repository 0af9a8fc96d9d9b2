"""Routing traces: recording, saving, replaying (with a k that differs from the model's), synthetic
locality, and the shared real traces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ftc.compile.pipeline import CompileOptions, compile_engine
from ftc_runtime import Engine, SamplingParams
from ftc_runtime.experts.cache import ExpertCache
from ftc_runtime.experts.routing_trace import RoutingTrace, TraceError, TraceReplay, synthetic_trace

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "model_specs" / "qwen3-moe-tiny.yaml"
QWEN_TRACE = ROOT.parent / "shared" / "traces" / "bigmoeonedge-qwen3-gemma4-gptoss" / "qwen.npz"


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    return compile_engine(CompileOptions(source=SPEC, target="cpu", random_weights=True, seed=5,
                                         output=tmp_path_factory.mktemp("trace") / "tiny"))


def test_recorded_trace_replays_the_same_tokens(engine_dir, tmp_path, seed):
    ftc = Path(sys.executable).parent / "ftc"
    ids = ",".join(str(i) for i in np.random.default_rng(seed).integers(0, 256, size=9))
    r = subprocess.run([str(ftc), "trace", str(engine_dir), "--prompt-ids", ids, "--max-new-tokens", "12",
                        "-o", str(tmp_path / "t.npz")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    trace = RoutingTrace.load(tmp_path / "t.npz")
    assert trace.shape == (9 + 11, 4, 4) and trace.is_decode.sum() == 11 and (trace.experts >= 0).all()
    # Replaying the router's own choices with their own weights reproduces the run exactly.
    engine = Engine.load(engine_dir)
    want = list(engine.generate([int(i) for i in ids.split(",")], 12, SamplingParams(0.0), stop_at_eos=False))

    class Exact(TraceReplay):
        def route(self, moe_layer, positions, ids_, weights):
            return self.trace.experts[positions, moe_layer].astype(np.int64), self.trace.weights[positions, moe_layer]

    engine.model.experts.routing = Exact(trace)
    got = list(engine.generate([int(i) for i in ids.split(",")], 12, SamplingParams(0.0), stop_at_eos=False))
    assert got == want


def test_replay_fills_a_smaller_k_from_the_model_and_truncates_a_larger_one(seed):
    rng = np.random.default_rng(seed)
    trace = RoutingTrace(np.array([[[3, 5, -1]]], dtype=np.int16), np.ones((1, 1, 3), np.float32), np.ones(1, bool))
    replay = TraceReplay(trace)
    own = np.array([[5, 9, 1, 2]])
    ids, w = replay.route(0, np.array([7]), own, rng.random((1, 4), dtype=np.float32))
    assert ids.tolist() == [[3, 5, 9, 1]] and np.allclose(w, 0.25)
    ids, _ = replay.route(0, np.array([0]), np.array([[8]]), rng.random((1, 1), dtype=np.float32))
    assert ids.tolist() == [[3]]


@pytest.mark.parametrize("k", [1, 4, 6, 8])
def test_replay_on_the_device_routes_as_on_the_host(k, seed):
    """`route_on_device` (the decode step's graph holds it) against the host's `route`: random
    traces with absent entries and rows shorter or longer than k, random positions past the end."""
    rng = np.random.default_rng(seed)
    e, layers, trace_k = 16, 3, int(rng.integers(1, 9))
    experts = np.stack([np.stack([rng.permutation(e)[:trace_k] for _ in range(layers)]) for _ in range(11)])
    experts[rng.random(experts.shape) < 0.3] = -1
    trace = RoutingTrace(experts.astype(np.int16), np.ones(experts.shape, np.float32), np.ones(11, bool))
    replay = TraceReplay(trace)
    for _ in range(20):
        t, layer = int(rng.integers(1, 5)), int(rng.integers(layers))
        positions = rng.integers(0, 40, size=t)
        own = np.stack([rng.permutation(e)[:k] for _ in range(t)])
        weights = rng.random((t, k), dtype=np.float32)
        want_ids, want_w = replay.route(layer, positions, own, weights)
        ids, w = replay.route_on_device(layer, torch.from_numpy(positions), torch.from_numpy(own),
                                        torch.from_numpy(weights))
        assert ids.tolist() == want_ids.tolist(), (positions, own)
        assert np.array_equal(w.numpy(), want_w)


def test_synthetic_locality_raises_lru_hit_rate(seed):
    def hit_rate(locality: float) -> float:
        t = synthetic_trace(300, 2, 64, 4, locality, seed=seed)
        cache, hits, total = ExpertCache(2 * 64, 24), 0, 0
        for tok in range(300):
            for layer in range(2):
                ids = t.experts[tok, layer].astype(np.int64) + layer * 64
                slots = cache.lookup(ids)
                hits += int((slots >= 0).sum())
                total += ids.size
                v = cache.victims(int((slots < 0).sum()), slots[slots >= 0])
                cache.install(v, ids[slots < 0][: v.size])
                cache.touch(np.concatenate([slots[slots >= 0], v]))
        return hits / total

    t = synthetic_trace(50, 3, 32, 6, 0.5, seed=seed + 1)
    assert t.shape == (50, 3, 6)
    assert all(len(set(row.tolist())) == 6 for row in t.experts.reshape(-1, 6))
    assert hit_rate(0.9) > hit_rate(0.5) > hit_rate(0.0)  # over 200 seeds, each step was at least 0.19
    with pytest.raises(TraceError, match="locality"):
        synthetic_trace(5, 1, 8, 2, 1.5)


@pytest.mark.skipif(not QWEN_TRACE.is_file(), reason="../shared/traces is not beside this checkout")
def test_the_shared_qwen3_trace_loads_and_fits_a_truncated_engine():
    trace = RoutingTrace.load(QWEN_TRACE)
    assert trace.shape == (156, 48, 6)
    trace.check_fits(4, 128, "qwen.npz")  # a 4-layer benchmark engine replays the first layers
    with pytest.raises(TraceError, match="49"):
        trace.check_fits(49, 128, "qwen.npz")


def test_bench_decode_replays_a_synthetic_trace(engine_dir):
    ftc = Path(sys.executable).parent / "ftc"
    r = subprocess.run([str(ftc), "bench", "decode", str(engine_dir), "--device", "cpu", "--slots", "12",
                        "--synthetic-locality", "0.7", "--new-tokens", "8", "--prompt-tokens", "5"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["routing"].startswith("synthetic") and out["decode_tokens"] == 7
    e = out["experts"]
    assert e["hits"] + e["fills"] + e["cpu"] == e["unique"] and e["calls"] == 7 * 4
    assert out["vram"]["n_slots"] == 12 and out["measured_over_bound"] is not None
    # The driving thread's CPU time: some, and no more than the wall time (one thread)
    assert 0 < out["host_cpu_ms_per_token"] <= 1.05 * out["ms_per_token"]
