"""`DeviceTimeline`: the phases of a one-graph decode step from its events. On the CPU the events
are stand-ins whose clock the test drives, so the sums are checked against the durations it drew;
on a GPU (marked `gpu`) the timeline of a real device step is checked against the step's time."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ftc_runtime.experts.device import timeline as timeline_module
from ftc_runtime.experts.device.timeline import MOE_PHASES, DeviceTimeline


class _ClockEvent:
    """A CUDA event's stand-in: `record` reads the test's clock (ms)."""

    clock = 0.0

    def __init__(self, enable_timing: bool = False, external: bool = False):
        assert enable_timing and external, "a timeline's events time and are recorded by graph nodes"
        self.at: float | None = None

    def record(self) -> None:
        self.at = _ClockEvent.clock

    def elapsed_time(self, other: _ClockEvent) -> float:
        return other.at - self.at


def _record_step(tl: DeviceTimeline, rng: random.Random, layers: int) -> dict[str, list[float]]:
    """One step's marks with random gaps; the gaps by phase, layer by layer."""
    drawn: dict[str, list[float]] = {p: [] for p in (*MOE_PHASES, "head")}
    tl.restart()
    for phase in [*MOE_PHASES * layers, "head"]:
        gap = rng.uniform(0.001, 0.5)
        _ClockEvent.clock += gap
        drawn[phase].append(gap)
        tl.mark(phase)
    return drawn


def test_timeline_sums_each_phase_layer_by_layer(monkeypatch, seed):
    monkeypatch.setattr(timeline_module.torch.cuda, "Event", _ClockEvent)
    rng = random.Random(seed)
    layers, steps = rng.randrange(1, 9), rng.randrange(1, 6)
    tl = DeviceTimeline()
    _record_step(tl, rng, layers)
    tl.collect()
    tl.reset()  # the warm-up step is dropped
    want = {p: [0.0] * (1 if p == "head" else layers) for p in (*MOE_PHASES, "head")}
    for _ in range(steps):
        for phase, gaps in _record_step(tl, rng, layers).items():
            want[phase] = [a + b for a, b in zip(want[phase], gaps, strict=True)]
        tl.collect()
    got = tl.summary()
    assert got["steps"] == steps and got["moe_layers"] == layers
    for phase in MOE_PHASES:
        assert got["per_layer"][phase] == pytest.approx([v / steps for v in want[phase]], abs=1e-4)
        assert got["ms_per_moe_layer"][phase] == pytest.approx(sum(want[phase]) / steps / layers, abs=1e-4)
    assert got["ms_per_token"]["head"] == pytest.approx(want["head"][0] / steps, abs=1e-4)
    total = sum(sum(v) for v in want.values()) / steps
    assert got["ms_per_token"]["total"] == pytest.approx(total, abs=1e-3)


def test_timeline_refuses_an_unknown_phase(monkeypatch):
    monkeypatch.setattr(timeline_module.torch.cuda, "Event", _ClockEvent)
    with pytest.raises(ValueError, match="'fill'.*body, plan, fills, hits, cpu_wait, head"):
        DeviceTimeline().mark("fill")


SPEC = Path(__file__).resolve().parents[1] / "model_specs" / "qwen3-moe-tiny.yaml"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_step_timeline_accounts_for_the_step(tmp_path, monkeypatch, seed):
    """`ftc bench decode` on the one-graph device step: a timeline for every MoE layer, each phase
    non-negative, the phases summing to a step's time on the device (within the gaps between
    steps, which the timeline does not see), and the timed statistics untouched by its steps."""
    from ftc.bench.decode import TIMELINE_STEPS, bench_decode
    from ftc.compile.pipeline import CompileOptions, compile_engine
    from ftc_runtime.artifact import EngineManifest
    from ftc_runtime.engine import OffloadConfig

    rng = random.Random(seed)
    monkeypatch.setenv("FTC_DEVICE_PLAN", "1")
    monkeypatch.setenv("FTC_DECODE_GRAPHS", "1")
    engine = compile_engine(CompileOptions(source=SPEC, random_weights=True, seed=seed % 1000,
                                           output=tmp_path / "tiny"))
    cfg = OffloadConfig(device="cuda", n_slots=rng.randrange(4, 40), b_p=25.0, b_h=50.0)
    r = bench_decode(engine, cfg, None, "own", prompt_tokens=16, new_tokens=14, temperature=1.0, seed=seed)
    tl = r["device_timeline"]
    layers = len(EngineManifest.read(engine).spec.moe_layers)
    assert r["experts"]["calls"] == r["decode_tokens"] * layers
    assert tl["steps"] == TIMELINE_STEPS and tl["moe_layers"] == layers > 0
    for phase, values in tl["per_layer"].items():
        assert len(values) == layers and min(values) >= 0, phase
    assert 0.2 * r["ms_per_token"] < tl["ms_per_token"]["total"] < 1.5 * r["ms_per_token"], (tl, r["ms_per_token"])
