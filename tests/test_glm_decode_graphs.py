"""GLM-5.x's decode-graph layer (`LatentDecodeGraphs`) on the CPU: the step a CUDA graph replays
(latent attention over the cache's whole storage with the position as data, the indexer's choice
over every stored key, kept for the layers that share it) run eagerly in fp32, against the
model's own one-token forward, which the family's parity tests hold to transformers. The graphs
themselves (capture, replay) are tested on the GPU (test_gpu.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ftc.compile.pipeline import CompileOptions, compile_engine
from ftc_runtime import Engine
from ftc_runtime.models.glm_moe_dsa.decode import LatentDecodeGraphs

from families import rel

TINY_SPEC = Path(__file__).resolve().parents[1] / "model_specs" / "glm-5-tiny.yaml"


@pytest.fixture(scope="module")
def glm_engine_dir(tmp_path_factory) -> Path:
    return compile_engine(CompileOptions(source=TINY_SPEC, target="cpu", random_weights=True, seed=11,
                                         output=tmp_path_factory.mktemp("glm") / "glm"))


class EmulatedStep:
    """`DecodeGraphs`' step as its graphs run it, without a GPU: the family's layers on fixed
    buffers, each MoE layer's staged call computed at once by the CPU experts (the device part of
    a step holds the whole output, as in a device step)."""

    def __init__(self, engine: Engine):
        m = self.model = engine.model
        self.graphs = LatentDecodeGraphs(m, compile_fns=False, fused_body=False)
        self.out = torch.zeros(1, m.spec.hidden_size)
        self.layer = 0
        forward = m.experts.forward
        m.experts.stage = lambda h, ids, w: self.out.copy_(forward(m.moe_index[self.layer], h, ids, w))
        m.experts.token_outputs = lambda t=1: (self.out, None)

    def step(self, token: int, cache) -> torch.Tensor:
        g, io = self.graphs, self.graphs.io
        cache.reserve(cache.length + 1)
        io.position.fill_(cache.length)
        io.token.fill_(token)
        g._prologue(io.token)
        for i in range(self.model.spec.num_layers):
            self.layer = i
            g._layer(i, [cache])
        g._head()
        cache.length += 1
        return io.logits.clone()


def test_the_graph_layer_equals_the_one_token_forward(glm_engine_dir, seed):
    """After a prompt longer than the indexer's top_k (32), one-token steps through the graph's
    layer give the forward's logits and leave the same cache (latent rows, rotary keys, indexer
    keys, zeros in the layers that share a choice), with the storage larger than the tokens."""
    rng = random.Random(seed)
    ref, emulated = Engine.load(glm_engine_dir), EmulatedStep(Engine.load(glm_engine_dir))
    vocab = ref.spec.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(20, 60))]
    caches = [ref.model.new_cache(), emulated.model.new_cache()]
    for model, cache in zip((ref.model, emulated.model), caches, strict=True):
        model.forward(torch.tensor(prompt), cache)
    for step in range(rng.randrange(12, 30)):
        token = rng.randrange(vocab)
        want = ref.model.forward(torch.tensor([token]), caches[0])
        got = emulated.step(token, caches[1])
        assert rel(got, want) < 1e-5, f"step {step} at position {caches[0].length - 1}: {rel(got, want):.2e}"
    n = caches[0].length
    assert caches[1].length == n and caches[1].kv.storage(0)[0].shape[0] > n
    for layer in range(ref.spec.num_layers):
        for a, b in zip(caches[0].kv.storage(layer), caches[1].kv.storage(layer), strict=True):
            assert torch.allclose(a[:n], b[:n], rtol=1e-5, atol=1e-6), f"layer {layer}"
