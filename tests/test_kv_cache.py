"""The KV cache's growth and the one-token attention over its storage that decode graphs replay (in
torch on the CPU; on a GPU, marked `gpu`, its Triton kernels)."""

from __future__ import annotations

import random

import pytest
import torch

from ftc_runtime.cache.kv import KVCache
from ftc_runtime.models.layers.attention import decode_attention


def test_growth_keeps_the_tokens_and_renews_the_generation(seed):
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(2, 2, 8, torch.float32, capacity=4)
    keys = [torch.randn(3, 2, 8, generator=g) for _ in range(3)]
    values = [torch.randn(3, 2, 8, generator=g) for _ in range(3)]
    generations = [cache.generation]
    for k, v in zip(keys, values, strict=True):
        for layer in range(2):
            cache.append(layer, k, v)
        cache.length += 3
        generations.append(cache.generation)
    assert cache.capacity == 16 and cache.length == 9
    assert torch.equal(cache.keys(1), torch.cat(keys)) and torch.equal(cache.values(0), torch.cat(values))
    assert torch.count_nonzero(cache.storage(0)[0][9:]) == 0  # the tail is zeros, never garbage
    # 4 → 8 at the second append, 8 → 16 at the third: a new generation each time storage moved.
    assert generations[0] == generations[1] != generations[2] != generations[3]
    assert len(set(generations)) == 3 and KVCache(1, 1, 1, torch.float32).generation not in generations


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_attention_over_the_storage_equals_attention_over_the_tokens(device, seed):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    for _ in range(10):
        n_kv, group, d = rng.choice([1, 2, 4]), rng.choice([1, 3, 8]), rng.choice([16, 64, 128])
        heads = (n_kv * group, n_kv, d)
        capacity = rng.choice([8, 32, 64, 1100])
        length = rng.randrange(1, capacity + 1)
        keys, values = torch.randn(capacity, n_kv, d, generator=g), torch.randn(capacity, n_kv, d, generator=g)
        q = torch.randn(1, n_kv * group, d, generator=g)
        position = torch.tensor([length - 1], device=device)
        got = decode_attention(q.to(device), keys.to(device), values.to(device), position, heads).cpu()
        # Reference: softmax over the first `length` keys, per query head and its KV head.
        k, v = keys[:length].repeat_interleave(group, dim=1), values[:length].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[0], k) / d ** 0.5
        want = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), v).reshape(1, -1)
        assert torch.allclose(got, want, atol=1e-5), (heads, capacity, length)
