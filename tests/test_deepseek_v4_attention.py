"""DeepSeek-V4's attention over a sequence's state (`models/deepseek_v4/attention.py`) against
transformers' `DeepseekV4Attention` with its cache, a prompt then decode steps then another chunk,
for each layer kind (sliding window, CSA with its indexer, HCA), on fresh random weights and
inputs: the same outputs at every call, so that the state (window, open windows, overlap, entries)
carries over as transformers' cache does."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DeepseekV4Config, DynamicCache
from transformers.masking_utils import create_sliding_window_causal_mask
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention, DeepseekV4RotaryEmbedding

from ftc_runtime.models.deepseek_v4.attention import AttentionShape, attend, new_state
from ftc_runtime.models.deepseek_v4.state import LayerState

KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


def _config(rng: random.Random) -> DeepseekV4Config:
    cfg = DeepseekV4Config(
        hidden_size=48, head_dim=32, num_attention_heads=4, q_lora_rank=24, o_groups=2, o_lora_rank=16,
        sliding_window=rng.choice([3, 8]), num_hidden_layers=3, layer_types=KINDS, index_n_heads=16,
        index_head_dim=16, index_topk=rng.choice([2, 64]),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": rng.choice([4, 8])},
        rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                         "compress": {"rope_type": "default", "rope_theta": 160000.0,
                                      "partial_rotary_factor": 0.25}})
    cfg._attn_implementation = "eager"
    return cfg


def _state(cfg: DeepseekV4Config, kind: str) -> tuple[LayerState, AttentionShape]:
    rate = 0 if kind == KINDS[0] else cfg.compress_rates[kind]
    shape = AttentionShape(cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window, cfg.o_groups, cfg.rms_norm_eps,
                           rate, cfg.index_topk if kind == KINDS[1] else 0)
    return new_state(shape, cfg.index_head_dim, torch.float32, "cpu"), shape


@pytest.mark.parametrize("trial", range(3))
def test_attention_over_its_state_equals_transformers_with_its_cache(trial, seed):
    """The three layers of one cache advance together, as a model's do (transformers sizes the mask
    from the cache's first layer), each on its own inputs."""
    rng, g = random.Random(seed + trial), torch.Generator().manual_seed(seed + trial)
    cfg = _config(rng)
    rotary, cache = DeepseekV4RotaryEmbedding(cfg), DynamicCache(config=cfg)
    modules, weights, states = [], [], []
    for layer, kind in enumerate(KINDS):
        module = DeepseekV4Attention(cfg, layer).float().eval()
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        modules.append(module)
        weights.append({name: p.detach() for name, p in module.named_parameters()})
        states.append(_state(cfg, kind))
    rope = cfg.rope_parameters
    inv_freq, compress_inv_freq = (1.0 / (rope[kind]["rope_theta"] ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
                                   for kind in ("main", "compress"))
    start = 0
    for n in [rng.randrange(1, 14)] + [1] * rng.randrange(3, 9) + [rng.randrange(2, 10)] + [1] * 3:
        positions = torch.arange(start, start + n)
        x = torch.randn(3, 1, n, cfg.hidden_size, generator=g)
        with torch.no_grad():
            embeddings = {kind: rotary(x[0], positions[None], layer_type=kind) for kind in ("main", "compress")}
            mask = create_sliding_window_causal_mask(config=cfg, inputs_embeds=x[0], attention_mask=None, cache=cache,
                                                     position_ids=positions[None])
            for layer, kind in enumerate(KINDS):
                want, _ = modules[layer](x[layer], embeddings, positions[None], mask, cache=cache)
                got = attend(weights[layer], x[layer, 0], positions, *states[layer], inv_freq, compress_inv_freq)
                what = f"{kind}, window {cfg.sliding_window}, top_k {cfg.index_topk}, tokens {start}..{start + n - 1}"
                torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-5, msg=what)
        start += n
