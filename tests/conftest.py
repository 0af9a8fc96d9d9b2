import os
import random
import zlib
from pathlib import Path

import pytest
import torch

from ftc.compile.pipeline import CompileOptions, compile_engine
from ftc_runtime import Engine

# One base seed per run, from FTC_TEST_SEED or fresh; each test's seed is derived from it and the
# test's id, so a failure is reproduced by running it again with FTC_TEST_SEED set to the base.
BASE_SEED = int(os.environ.get("FTC_TEST_SEED", random.randrange(2**31)))


def pytest_report_header(config) -> str:
    return f"test seed: FTC_TEST_SEED={BASE_SEED}"


def seed_for(key: str) -> int:
    """The seed of `key` (a test id or a fixture's name) in this run."""
    return zlib.crc32(f"{BASE_SEED}:{key}".encode()) & 0x7FFFFFFF


@pytest.fixture
def seed(request) -> int:
    """The seed of a randomized test: printed in its report when it fails."""
    value = seed_for(request.node.nodeid)
    request.node.ftc_seed = value
    return value


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.failed and hasattr(item, "ftc_seed"):
        report.sections.append(("seed", f"seed {item.ftc_seed}: rerun with FTC_TEST_SEED={BASE_SEED} {item.nodeid}"))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    # The agent-harness tests install Claude Code and OpenCode from the npm registry: opt-in only.
    skip_agents = pytest.mark.skip(reason="opt-in: pytest -m agents")
    asked_for_agents = "agents" in (config.getoption("markexpr") or "")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "agents" in item.keywords and not asked_for_agents:
            item.add_marker(skip_agents)


@pytest.fixture(scope="session", autouse=True)
def kernel_cache(tmp_path_factory) -> Path:
    """One kernel build cache for the whole session: engines with the same shapes share a build."""
    path = tmp_path_factory.mktemp("ftc-cache")
    os.environ["FTC_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE engine of the offload and elastic-VRAM tests (modules that test another
    engine define their own). AVX2 kernels: fp32 activations, so the offloaded path and the
    all-CPU engine agree to fp32 rounding."""
    spec = Path(__file__).resolve().parents[1] / "model_specs" / "qwen3-moe-tiny.yaml"
    return compile_engine(CompileOptions(source=spec, target="cpu", random_weights=True, seed=7,
                                         output=tmp_path_factory.mktemp("tiny") / "tiny"))


@pytest.fixture(scope="module")
def cpu_engine(engine_dir) -> Engine:
    return Engine.load(engine_dir)
