"""The plan kernel's registers and spills for sm_90 at each batch size, compiled ahead of time by
Triton's own ptxas (no GPU needed): the figures that set its warps (experts/device/plan_kernel.py).

    python bench/dev/decode_kernel_resources.py [--warps 4,8,16,32]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from ftc_runtime.experts.device import plan_kernel

_I64, _F32 = "*i64", "*fp32"
SIGNATURE = dict(zip(
    ["ids", "weights", "base_id", "n", "k", "slot_of", "id_of", "last_used", "cpu_step", "step_ptr", "q_for_m",
     "recent_steps", "allow_fills", "cands", "n_cands", "n_slots", "pair_slot", "fill_rows", "fill_slots", "cpu_ids",
     "cpu_offsets", "cpu_tok", "cpu_w", "counts", "NP", "CANDS"],
    [_I64, _F32, "i32", "i32", "i32", _I64, _I64, _I64, _I64, _I64, _I64, "i32", "i32", _I64, "i32", "i32",
     _I64, _I64, _I64, _I64, _I64, _I64, _F32, _I64, "constexpr", "constexpr"], strict=True))


def report(np2: int, cands: int, warps: int) -> str:
    kernel = triton.compile(ASTSource(plan_kernel._plan, SIGNATURE, {"NP": np2, "CANDS": cands}),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                           capture_output=True, text=True, check=True)
    return "; ".join(line.split(":", 1)[-1].strip() for line in r.stderr.splitlines()
                     if "registers" in line or "spill" in line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warps", default="4,8,16,32")
    a = ap.parse_args()
    for tokens in (1, 2, 4, 8, 16):
        np2 = max(16, triton.next_power_of_2(tokens * 8))  # top-8
        for warps in (int(w) for w in a.warps.split(",")):
            print(f"{tokens} tokens (n {np2}), {warps} warps: {report(np2, 64 * np2, warps)}", flush=True)


if __name__ == "__main__":
    main()
