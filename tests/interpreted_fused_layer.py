"""Run by test_interpreted_kernels.py in a process of its own with TRITON_INTERPRET=1: a decode
layer of one sequence as the fused kernels run it (the family's `DecodeGraphs` with its fused
body: Qwen3-MoE's attention and router, the hybrid family's Gated DeltaNet step and its MoE block
with the shared expert) against the same layer as the torch functions, on the CPU (fp32): the
residual stream (the previous MoE layer's output joined in: a random row, as a device step leaves
it), the router's ids and weights and its normalized input, a dense layer's and the shared
expert's output, and the layer's state after the token (the KV row written, or the convolution's
and the recurrence's state), at random positions and inputs of every layer of the engine given.

    TRITON_INTERPRET=1 python tests/interpreted_fused_layer.py ENGINE_DIR SEED
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

from ftc_runtime.decode.graphs import DecodeGraphs
from ftc_runtime.engine import Engine
from ftc_runtime.models import family


def layer_graphs(engine: Engine) -> tuple[DecodeGraphs, list, torch.Tensor]:
    """The family's decode layer on the CPU, uncaptured (its functions uncompiled). The experts'
    staging is recorded instead of run; their output, as a device step leaves it (no host part),
    is the row returned."""
    model = engine.model
    graphs = family(engine.spec.family).decode_graphs(model, compile_fns=False)
    staged: list = []
    model.experts.stage = lambda h, ids, w: staged.append((h.clone(), ids.clone(), w.clone()))
    moe_out = torch.zeros(1, model.spec.hidden_size)
    model.experts.token_outputs = lambda t=1: (moe_out, None)
    return graphs, staged, moe_out


def main() -> None:
    engine_dir, seed = Path(sys.argv[1]), int(sys.argv[2])
    rng, engine = random.Random(seed), Engine.load(engine_dir)
    model = engine.model
    torch.manual_seed(seed)
    graphs, staged, moe_out = layer_graphs(engine)
    cache = model.new_cache()
    model.forward(torch.tensor([rng.randrange(model.spec.vocab_size) for _ in range(rng.randrange(1, 40))]), cache)
    cache.reserve(cache.length + 1)
    graphs.io.position.fill_(cache.length)
    cos, sin = model.rope_at(graphs.io.position)
    graphs.io.cos.copy_(cos)
    graphs.io.sin.copy_(sin)
    for i in range(model.spec.num_layers):
        x = torch.randn(1, model.spec.hidden_size)
        moe_out.copy_(torch.randn(1, model.spec.hidden_size))
        before = [s.clone() for s in layer_state(model, cache, i)]
        got = run_layer(graphs, staged, cache, i, x, True)
        for s, b in zip(layer_state(model, cache, i), before, strict=True):
            s.copy_(b)  # the torch layer starts from the same state
        want = run_layer(graphs, staged, cache, i, x, False)
        assert len(got) == len(want), f"layer {i}"
        for j, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), \
                f"layer {i}, position {cache.length}: output {j} off by {float((a - b).abs().max())}"
    print("ok")


def layer_state(model, cache, i: int) -> list[torch.Tensor]:
    """Layer i's state in the cache: its KV storage, or its linear layer's two states."""
    linear = getattr(model, "linear_index", {})
    if i in linear:
        state = cache.linear[linear[i]]
        return [state.conv, state.recurrent]
    return list(cache.kv.storage(getattr(model, "kv_index", {}).get(i, i)))


def run_layer(graphs: DecodeGraphs, staged: list, cache, i: int, x: torch.Tensor,
              fused: bool) -> list[torch.Tensor]:
    """x after layer i, then what it staged (h, ids, weights) or a dense layer's output, the
    shared expert's output, and the layer's state after the token (the KV rows at the position)."""
    graphs.fused_body = fused
    io = graphs.io
    io.x.copy_(x)
    io.mlp.zero_()
    if io.shared is not None:
        io.shared.zero_()
    staged.clear()
    graphs._layer(i, [cache])
    state = layer_state(graphs.model, cache, i)
    if i not in getattr(graphs.model, "linear_index", {}):
        state = [t[cache.length] for t in state]
    mlp = [] if graphs.model.is_moe(i) else [io.mlp]  # a MoE layer's output is what it staged
    out = [io.x, *(staged[0] if staged else ()), *mlp, *([] if io.shared is None else [io.shared]), *state]
    return [t.clone() for t in out]


if __name__ == "__main__":
    main()
