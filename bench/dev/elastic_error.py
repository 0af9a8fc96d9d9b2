"""The elastic-VRAM GPU test's error measure (teacher-forced logits of the GPU engine against the fp32
CPU engine) for twelve fixed seeded prompts, with 64 slots and then 25: how far bf16 alone strays.
  python3 bench/dev/elastic_error.py OUT_ENGINE_DIR    (on the device)"""
import random
import sys
from pathlib import Path

import torch

from ftc.compile.pipeline import CompileOptions, compile_engine
from ftc_runtime import Engine
from ftc_runtime.engine import OffloadConfig

SPEC = Path("model_specs/qwen3-moe-tiny.yaml")


def forced(engine, ids, prompt):
    cache = engine.model.new_cache()
    out = [engine.model.forward(torch.tensor(ids[:prompt]), cache)[-1].cpu()]
    out += [engine.model.forward(torch.tensor([t]), cache)[-1].cpu() for t in ids[prompt:]]
    return out


out = Path(sys.argv[1])
engine = compile_engine(CompileOptions(source=SPEC, random_weights=True, seed=3, output=out,
                                       overrides=("moe.expert_intermediate_size=16384",)))
cpu = Engine.load(engine)
gpu = Engine.load(engine, offload=OffloadConfig(device="cuda", b_p=25.0, b_h=50.0, n_slots=64))
for resize in (None, 25):
    if resize:
        gpu.model.experts.resize(resize)
    errs = []
    for seed in range(12):
        rng = random.Random(seed)
        ids = [rng.randrange(500) for _ in range(24)]
        want, got = forced(cpu, ids, 16), forced(gpu, ids, 16)
        errs.append(max(float((a - b).norm() / b.norm()) for a, b in zip(got, want, strict=True)))
    print("slots", resize or 64, " ".join(f"{e:.4f}" for e in errs), flush=True)
