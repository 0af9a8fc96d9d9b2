"""The errors `tests/test_gpu.py::test_gpu_hybrid_engine_matches_the_cpu_engine` bounds, printed
for several prompts (seeds) and both test formats, to set or check its bounds on the device:
prompt logits against the fp32 CPU engine, one-token steps against the prompt path, and the
steps after a restored checkpoint against the first steps (each step's error, sorted).

    python bench/dev/hybrid_gpu_errors.py [--seeds 1,2,3,4,5,6] [--device cuda]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch

from ftc.compile.pipeline import CompileOptions, compile_engine
from ftc_runtime import Engine
from ftc_runtime.engine import OffloadConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from slot_checks import near_best_share, rel  # noqa: E402

SPEC = Path(__file__).resolve().parents[2] / "model_specs" / "qwen3.6-moe-tiny.yaml"


def errors(engine: Path, device: str, seed: int) -> str:
    cpu = Engine.load(engine)
    dev = Engine.load(engine, offload=OffloadConfig(device=device, n_slots=24, b_p=25.0, b_h=50.0), prefill_chunk=37)
    rng = random.Random(seed)
    ids = [rng.randrange(500) for _ in range(100)]
    a, b = dev.logits(ids).cpu(), cpu.logits(ids)
    cache = dev.model.new_cache()
    dev.prefill(torch.tensor(ids[:60]), cache)
    checkpoint = cache.take()
    steps = torch.stack([dev.model.forward(torch.tensor([t]), cache)[-1].cpu() for t in ids[60:70]])
    cache.restore(checkpoint)
    again = torch.stack([dev.model.forward(torch.tensor([t]), cache)[-1].cpu() for t in ids[60:70]])
    per_step = sorted(rel(x, y) for x, y in zip(again, steps, strict=True))
    step_prompt = sorted(rel(x, y) for x, y in zip(steps, a[60:70], strict=True))
    return (f"prompt {rel(a, b):.4f} (share {near_best_share(a, b):.2f}), steps/prompt {rel(steps, a[60:70]):.4f} "
            f"per step {[round(e, 4) for e in step_prompt]}, "
            f"steps/fp32 {rel(steps, b[60:70]):.4f} vs prompt/fp32 {rel(a[60:70], b[60:70]):.4f}, "
            f"restored {rel(again, steps):.4f} per step {[round(e, 4) for e in per_step]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="1,2,3,4,5,6")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for quant in ("bf16", "nvfp4"):
            engine = compile_engine(CompileOptions(source=SPEC, random_weights=True, seed=5, quant=quant,
                                                   output=Path(tmp) / quant))
            for seed in a.seeds.split(","):
                print(f"{quant} seed {seed}: {errors(engine, a.device, int(seed))}", flush=True)


if __name__ == "__main__":
    main()
