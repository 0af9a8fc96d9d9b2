"""The decode plan's Triton kernels run by Triton's interpreter on the CPU (where Triton is
installed: the Makefile installs it beside the CPU build of torch), against the torch plan; on a
GPU the same kernels are compiled and tested by the GPU tests."""

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
