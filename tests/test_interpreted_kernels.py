"""The decode step's Triton kernels run by Triton's interpreter on the CPU (where Triton is
installed: the Makefile installs it beside the CPU build of torch) against their torch
references, and each family's decode layer as the fused kernels run it against the torch layer; on
a GPU the same kernels are compiled and tested by the GPU tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_plan_and_fill_kernels_equal_the_torch_plan_when_interpreted(seed):
    pytest.importorskip("triton")
    script = Path(__file__).with_name("interpreted_kernels.py")
    r = subprocess.run([sys.executable, str(script), str(seed), "3", "12"], capture_output=True, text=True,
                       env=os.environ | {"TRITON_INTERPRET": "1"}, timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-4000:]


@pytest.fixture(scope="module")
def hybrid_engine_dir(tmp_path_factory) -> Path:
    from ftc.compile.pipeline import CompileOptions, compile_engine

    spec = Path(__file__).resolve().parents[1] / "model_specs" / "qwen3.6-moe-tiny.yaml"
    return compile_engine(CompileOptions(source=spec, target="cpu", random_weights=True, seed=3,
                                         output=tmp_path_factory.mktemp("hybrid") / "hybrid"))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe"])
def test_fused_decode_layer_equals_the_torch_layer_when_interpreted(family, request, seed):
    pytest.importorskip("triton")
    engine = request.getfixturevalue("engine_dir" if family == "qwen3_moe" else "hybrid_engine_dir")
    script = Path(__file__).with_name("interpreted_fused_layer.py")
    r = subprocess.run([sys.executable, str(script), str(engine), str(seed)], capture_output=True, text=True,
                       env=os.environ | {"TRITON_INTERPRET": "1"}, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-4000:]
