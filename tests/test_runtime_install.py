"""The runtime install: ftc's own dependencies (pyproject's `dependencies`, and what they need) without
the `compile` extra (cmake, ninja) run a packaged engine. The test builds a venv that holds exactly
that closure, linked from this environment's site-packages (no download), with this checkout's
packages on its path, and runs `ftc run` there on a package of the tiny engine: the tokens of the
full install, and the toolchain not importable."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from ftc.package import package_engine
from ftc_runtime.artifact import EngineManifest

tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
ROOT = Path(__file__).resolve().parents[1]
FTC = Path(sys.executable).parent / "ftc"
TOOLCHAIN = {"cmake", "ninja"}  # the compile extra's


def runtime_distributions() -> set[str]:
    """The distributions the runtime install pulls: pyproject's dependencies, recursively, each
    one's requirements without extras (markers evaluated for this machine)."""
    todo = [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = md.distribution(req.name).metadata["Name"].lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        todo += [Requirement(r) for r in md.distribution(name).requires or []]
    return seen


def link_site(dists: set[str], site: Path) -> None:
    """Links each distribution's top-level files and folders (and its metadata) into `site`."""
    site.mkdir(parents=True)
    for name in dists:
        dist = md.distribution(name)
        tops = {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] != ".."}
        for top in tops:
            if not (site / top).exists():
                (site / top).symlink_to(dist.locate_file(top))


@pytest.fixture(scope="module")
def runtime_venv(tmp_path_factory) -> Path:
    dists = runtime_distributions()
    assert not dists & TOOLCHAIN, f"the runtime install pulls {sorted(dists & TOOLCHAIN)}"
    root = tmp_path_factory.mktemp("runtime-venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    link_site(dists, root / "site")
    src = root / "src"  # this checkout's packages, as pyproject's package search finds them
    src.mkdir()
    for name, folder in (("ftc", "ftc"), ("ftc_runtime", "runtime/ftc_runtime"),
                         ("ftc_templates", "templates/ftc_templates")):
        (src / name).symlink_to(ROOT / folder)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    (root / "venv" / "lib" / version / "site-packages" / "runtime.pth").write_text(f"{root / 'site'}\n{src}\n")
    return root / "venv" / "bin" / "python"


def test_a_venv_without_the_compile_extra_runs_a_packaged_engine(runtime_venv, engine_dir, tmp_path, seed):
    rng = random.Random(seed)
    package = package_engine(engine_dir, tmp_path / "pkg", shard_size=4 << 20)
    vocab = EngineManifest.read(engine_dir).spec.vocab_size
    args = ["run", str(package), "--prompt-ids", ",".join(str(rng.randrange(vocab)) for _ in range(5)),
            "--max-new-tokens", "6", "--ignore-eos", "--json"]
    env = os.environ | {"PYTHONNOUSERSITE": "1"}
    r = subprocess.run([str(runtime_venv), "-c", "import sys; from ftc.cli.main import app; sys.argv[0] = 'ftc'; app()",
                        *args], capture_output=True, text=True, env=env, timeout=300, input="")
    assert r.returncode == 0, r.stderr
    full = subprocess.run([str(FTC), *args], capture_output=True, text=True, timeout=300, input="")
    assert full.returncode == 0, full.stderr
    assert json.loads(r.stdout)["tokens"] == json.loads(full.stdout)["tokens"]
    for module in TOOLCHAIN:
        probe = subprocess.run([str(runtime_venv), "-c", f"import {module}"], capture_output=True, env=env)
        assert probe.returncode != 0, f"{module} importable in the runtime venv"
