"""fla_delta_rule (flash-linear-attention's kernels, here under Triton's interpreter) against the
torch recurrence of gated_deltanet.py, with states captured inside the prompt at and beside the
64-token blocks' edges (and its outputs against those of the same prompt without captures); fp16
inputs, grouped value heads. Run by bench/dev/fla_interpreted.sh.

    python bench/dev/fla_interpreted_check.py FIRST_SEED LAST_SEED
"""

from __future__ import annotations

import random
import sys

import fla_interp_patch  # noqa: F401  (autotuners without a benchmarker)
import torch

from ftc_runtime.models.layers import gated_deltanet as gd
from ftc_runtime.models.layers.fla_delta_rule import fla_delta_rule


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(seed: int) -> bool:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    t = rng.choice([1, rng.randrange(2, 64), rng.randrange(64, 200), 128])
    nk, group, d = rng.choice([1, 2]), rng.choice([1, 2]), 32
    q, k = (torch.randn(t, nk, d, dtype=torch.float16) for _ in range(2))
    v = torch.randn(t, nk * group, d, dtype=torch.float16)
    g = -torch.rand(t, nk * group) * rng.choice([0.05, 1.0])
    beta = torch.rand(t, nk * group).half().float()
    state = torch.randn(nk * group, d, d)
    edges = {i for i in (0, 62, 63, 64, 65, 127, t - 2, t - 1) if 0 <= i < t}
    candidates = sorted(edges | set(rng.sample(range(t), min(t, 3))))
    capture = tuple(sorted(rng.sample(candidates, min(len(candidates), rng.randrange(0, 6)))))
    got = fla_delta_rule(q, k, v, g, beta, state, capture)
    want = gd.delta_rule(q, k, v, g, beta, state, capture)  # CPU tensors: the torch code
    errors = [rel(got[0], want[0]), rel(got[1], want[1])]
    errors += [rel(a, b) for a, b in zip(got[2], want[2], strict=True)]
    plain = fla_delta_rule(q, k, v, g, beta, state)  # the same kernels, captures or not
    ok = len(got[2]) == len(capture) and max(errors) < 1e-2
    ok = ok and rel(got[0], plain[0]) < 1e-3 and rel(got[1], plain[1]) < 1e-3
    print(f"seed {seed}: T={t} capture={capture} max rel {max(errors):.3g} {'ok' if ok else 'FAILED'}", flush=True)
    return ok


if __name__ == "__main__":
    first, last = int(sys.argv[1]), int(sys.argv[2])
    failed = [s for s in range(first, last) if not check(s)]
    sys.exit(f"failed seeds: {failed}" if failed else 0)
