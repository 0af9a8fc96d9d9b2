"""`ftc profile`: measured figures, the YAML it writes, a profile as a compile target, and
`ftc run --reprofile` recording it in engine.json."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ftc.compile.pipeline import CompileOptions, compile_engine
from ftc.compile.targets import TargetError, resolve_target
from ftc_runtime import Engine
from ftc_runtime.profile import HardwareProfile, measure_profile

SPEC = Path(__file__).resolve().parents[1] / "model_specs" / "qwen3-moe-tiny.yaml"
FTC = Path(sys.executable).parent / "ftc"


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    return compile_engine(CompileOptions(source=SPEC, random_weights=True, output=tmp_path_factory.mktemp("p") / "e"))


def test_profile_yaml_becomes_a_target(engine_dir, tmp_path):
    r = subprocess.run([str(FTC), "profile", str(engine_dir), "-o", str(tmp_path / "hw.yaml"), "--seconds", "0.2",
                        "--device", "cpu"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    prof = HardwareProfile.from_yaml(tmp_path / "hw.yaml")
    assert prof.b_h > 0 and prof.host_read_gbps > 0 and prof.physical_cores >= 1 and prof.b_p is None
    assert json.loads(r.stdout)["b_h"] == prof.b_h
    target = resolve_target(str(tmp_path / "hw.yaml"))
    assert (target.isa, target.b_h, target.cpu_threads) == (prof.isa, prof.b_h, prof.physical_cores)
    (tmp_path / "bad.yaml").write_text("isa: avx2\nunknown_field: 3\n")
    with pytest.raises(TargetError, match="bad.yaml"):
        resolve_target(str(tmp_path / "bad.yaml"))
    # a rate in the wrong unit (MB/s or TB/s read as GB/s) is refused, naming the field
    field = random.choice(["b_h", "host_read_gbps"])
    wrong = random.choice([random.choice([0.07, random.uniform(1e-6, 0.099)]), random.uniform(1e4 + 1, 1e9)])
    text = (tmp_path / "hw.yaml").read_text()
    (tmp_path / "slip.yaml").write_text(yaml.safe_dump(yaml.safe_load(text) | {field: wrong}))
    with pytest.raises(TargetError, match=f"slip.yaml: field '{field}'"):
        resolve_target(str(tmp_path / "slip.yaml"))


def test_a_measured_rate_no_machine_has_is_refused(engine_dir, monkeypatch, seed):
    """Cores that other processes hold slow the kernel's spinning workers a hundredfold: a B_H
    measured below any machine's is an error that says so, not a profile (nor a target)."""
    import ftc_runtime.profile as profile

    rate = random.Random(seed).uniform(1e-4, 0.099)
    monkeypatch.setattr(profile, "expert_kernel_gbps", lambda *a, **k: {"gbps": rate})
    eng = Engine.load(engine_dir)
    with pytest.raises(ValueError, match=r"measured b_h = .* GB/s.*busy"):
        profile.measure_profile(eng.spec, eng.pool, eng.model.experts.kernel, None, 0.1)


def test_reprofile_records_the_profile_in_the_engine(engine_dir):
    r = subprocess.run([str(FTC), "run", str(engine_dir), "--prompt-ids", "1,2", "--max-new-tokens", "2",
                        "--reprofile", "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((engine_dir / "engine.json").read_text())
    assert manifest["profile"]["b_h"] > 0 and manifest["target"]["b_h"] == manifest["profile"]["b_h"]
    Engine.load(engine_dir)  # still a valid engine


@pytest.mark.gpu
def test_gpu_profile_measures_pcie_and_both_at_once(engine_dir):
    eng = Engine.load(engine_dir)
    prof = measure_profile(eng.spec, eng.pool, eng.model.experts.kernel, "cuda", seconds=0.3)
    assert prof.b_p > 1 and prof.b_p_during_cpu > 1 and prof.b_h_during_copy > 0
    assert prof.gpu == torch.cuda.get_device_properties(0).name


def test_an_engine_measures_the_rates_it_lacks_for_this_gpu(monkeypatch, capsys, seed):
    """The miss split prices with rates of this machine: where the engine's were measured for
    another GPU (a preset's), or it has none (`--target auto`), those measured where it loads, and
    it says so; rates for this GPU, or given as options, are kept, and a failed measurement falls
    back to the engine's with a message."""
    import ftc_runtime.engine as engine_module
    from ftc.compile.targets import PRESETS
    from ftc_runtime.engine import OffloadConfig

    rng = random.Random(seed)
    names = ("b_p", "b_h", "b_p_during_cpu", "b_h_during_copy")
    measured = {name: round(rng.uniform(5, 200), 2) for name in names}

    class Probe:
        calls, fails = 0, False

        def measure(self) -> dict[str, float]:
            self.calls += 1
            if self.fails:
                raise ValueError("ftc profile measured b_h = 0.01 GB/s")
            return measured

    def planner(target: dict, gpu: str, slots: int = 64, **offload) -> tuple:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
        manifest = type("Manifest", (), {"target": target})()
        p = engine_module._miss_planner(manifest, OffloadConfig(device="cuda", **offload), probe, slots)
        return p.b_p, p.b_h, p.b_p_concurrent, p.b_h_concurrent

    probe, h200 = Probe(), PRESETS["h200"].to_dict()
    own = (h200["b_p"], h200["b_h"], h200["b_p_concurrent"], h200["b_h_concurrent"])
    assert planner(h200, "NVIDIA H100 80GB HBM3") == tuple(measured[n] for n in names), f"seed {seed}"
    said = capsys.readouterr().err
    assert "target h200's (NVIDIA H200), not this NVIDIA H100 80GB HBM3's" in said and f"B_P {measured['b_p']}" in said
    auto = PRESETS["cpu"].to_dict() | {"name": "auto"}
    assert planner(auto, "NVIDIA RTX PRO 6000") == tuple(measured[n] for n in names)
    assert "records no bandwidths (target auto)" in capsys.readouterr().err
    assert probe.calls == 2
    assert planner(h200, "NVIDIA H200") == own  # measured for this GPU: kept
    assert planner(h200, "NVIDIA H100 80GB HBM3", slots=0) == own  # no slots: nothing to split
    assert planner(h200, "NVIDIA H100 80GB HBM3", b_p=20.5, b_h=70.25) == (20.5, 70.25, None, None)
    assert probe.calls == 2
    probe.fails = True
    assert planner(h200, "NVIDIA H100 80GB HBM3") == own
    assert "measuring them here failed (ftc profile measured b_h" in capsys.readouterr().err


@pytest.mark.gpu
def test_a_gpu_engine_without_rates_measures_them_where_it_loads(engine_dir, capfd):
    """The engine compiled for `--target auto` records no rates: on a GPU it measures them as it
    loads (its fills through the pool's mapping, the CPU kernel, both at once) and splits by them."""
    from ftc_runtime.engine import OffloadConfig

    eng = Engine.load(engine_dir, offload=OffloadConfig(device="cuda", vram_budget=2 << 30, n_slots=8))
    planner = eng.model.experts.planner
    assert planner.measured_concurrency and planner.b_p > 1 and planner.b_h > 0
    assert planner.b_p_concurrent > 1 and planner.b_h_concurrent > 0
    assert "records no bandwidths (target auto)" in capfd.readouterr().err
