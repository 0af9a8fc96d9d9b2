"""`ftc compile ORG/NAME`: a Hugging Face repository fetched through huggingface_hub's cache, here a
local folder laid out as that cache with the Hub offline; the engine named after the repository,
not its snapshot folder; --name and -o name it otherwise; a missing repository is one error line."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from hf_models import TinyShape, build_model, save_checkpoint

FTC = Path(sys.executable).parent / "ftc"


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> tuple[Path, str]:
    """A Hub cache holding one repository's snapshot: (cache folder, repo id)."""
    cache = tmp_path_factory.mktemp("hub")
    repo = f"test-org/tiny-moe-{random.randrange(10**6)}"
    commit = f"{random.randrange(16**40):040x}"
    folder = cache / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    save_checkpoint(build_model(TinyShape(), seed=1), folder / "snapshots" / commit, "per_expert", shards=1)
    return cache, repo


def compile_from_hub(hub: tuple[Path, str], cwd: Path, *args) -> subprocess.CompletedProcess:
    cache, _ = hub
    env = os.environ | {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(FTC), "compile", *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=600, input="")


def engine_name(engine: Path) -> str:
    return json.loads((engine / "engine.json").read_text())["spec"]["name"]


def test_a_repository_id_compiles_from_the_hub_cache(hub, tmp_path):
    _, repo = hub
    r = compile_from_hub(hub, tmp_path, repo)
    assert r.returncode == 0, r.stderr
    engine = tmp_path / "build" / repo.split("/")[1]
    assert engine_name(engine) == repo.split("/")[1]


def test_name_and_output_name_the_engine(hub, tmp_path):
    _, repo = hub
    name = f"mine-{random.randrange(1000)}"
    r = compile_from_hub(hub, tmp_path, repo, "--name", name)
    assert r.returncode == 0, r.stderr
    assert engine_name(tmp_path / "build" / name) == name
    out = tmp_path / f"served-{random.randrange(1000)}"
    r = compile_from_hub(hub, tmp_path, repo, "-o", out)
    assert r.returncode == 0, r.stderr
    assert engine_name(out) == out.name


def test_a_repository_not_in_the_cache_is_one_error_line(hub, tmp_path):
    missing = f"test-org/absent-{random.randrange(10**6)}"
    r = compile_from_hub(hub, tmp_path, missing)
    assert r.returncode == 1 and r.stderr.startswith(f"error: {missing}: not in the Hugging Face cache"), r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "build").exists()


def test_an_engine_in_the_way_is_refused_before_the_download(hub, tmp_path):
    """Replacing an engine needs --force, and a repository to download says so before it is
    fetched (offline and not in the cache: the download would be what failed otherwise)."""
    _, repo = hub
    assert compile_from_hub(hub, tmp_path, repo).returncode == 0
    missing = f"test-org/{repo.split('/')[1]}"  # the same engine name, a repository the cache lacks
    before = (tmp_path / "build" / repo.split("/")[1] / "engine.json").read_bytes()
    r = compile_from_hub(hub, tmp_path, missing)
    assert r.returncode == 1 and "holds an engine: pass --force to replace it" in r.stderr, r.stderr
    assert (tmp_path / "build" / repo.split("/")[1] / "engine.json").read_bytes() == before

