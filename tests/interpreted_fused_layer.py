"""Run by test_interpreted_kernels.py in a process of its own with TRITON_INTERPRET=1: a Qwen3-MoE
decode layer of one sequence as the fused kernels run it (`AttentionDecodeGraphs`, fused body)
against the same layer as the torch functions, on the CPU (fp32): the residual stream after
attention, the router's ids and weights and its normalized input, and the KV row written, at
random positions and inputs of every MoE layer of the engine given.

    TRITON_INTERPRET=1 python tests/interpreted_fused_layer.py ENGINE_DIR SEED
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

from ftc_runtime.decode.step_buffers import StepBuffers
from ftc_runtime.engine import Engine
from ftc_runtime.models.qwen3_moe.decode import AttentionDecodeGraphs


def layer_graphs(model) -> tuple[AttentionDecodeGraphs, list]:
    """The family's decode layer on the CPU: DecodeGraphs' machinery wants a GPU, its layer does
    not. The experts' staging is recorded instead of run."""
    graphs = object.__new__(AttentionDecodeGraphs)
    graphs.model, graphs.io = model, StepBuffers.make(model, 1)
    graphs.f = graphs.fns = graphs.functions()
    staged: list = []
    model.experts.stage = lambda h, ids, w: staged.append((h.clone(), ids.clone(), w.clone()))
    model.experts.token_outputs = lambda t=1: (torch.zeros(1, model.spec.hidden_size), None)
    return graphs, staged


def main() -> None:
    engine_dir, seed = Path(sys.argv[1]), int(sys.argv[2])
    rng, model = random.Random(seed), Engine.load(engine_dir).model
    torch.manual_seed(seed)
    graphs, staged = layer_graphs(model)
    cache = model.new_cache()
    model.forward(torch.tensor([rng.randrange(model.spec.vocab_size) for _ in range(rng.randrange(1, 40))]), cache)
    cache.reserve(cache.length + 1)
    graphs.io.position.fill_(cache.length)
    cos, sin = model.rope_at(graphs.io.position)
    graphs.io.cos.copy_(cos)
    graphs.io.sin.copy_(sin)
    for i in (i for i in range(model.spec.num_layers) if model.is_moe(i)):
        x = torch.randn(1, model.spec.hidden_size)
        got, want = (run_layer(graphs, staged, cache, i, x, fused) for fused in (True, False))
        for name, a, b in zip(("x", "h", "ids", "weights", "key", "value"), got, want, strict=True):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), f"layer {i}, position {cache.length}: {name}"
    print("ok")


def run_layer(graphs: AttentionDecodeGraphs, staged: list, cache, i: int, x: torch.Tensor,
              fused: bool) -> tuple[torch.Tensor, ...]:
    graphs.fused_body = fused
    graphs.io.x.copy_(x)
    graphs.io.mlp.zero_()
    staged.clear()
    graphs._layer(i, [cache])
    key, value = (t[cache.length].clone() for t in cache.kv.storage(i))
    return (graphs.io.x.clone(), *staged[0], key, value)


if __name__ == "__main__":
    main()
