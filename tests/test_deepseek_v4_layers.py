"""DeepSeek-V4's hyper-connections (mHC) and routers as ftc's layer functions, against
transformers' own modules (`modeling_deepseek_v4`) with fresh random parameters and inputs: the
block weights (pre, post, the Sinkhorn-projected mixing), the collapse and the expansion of a
decoder layer's streams, the head's collapse, and the learned and hashed routers' experts and
weights, the compressed attentions' window entries (HCA's, CSA's overlapping ones and its
indexer's) and their causal rule, the indexer's choice, and the attention around them (shared
key/value head, sinks, grouped output projection)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4Attention,
    DeepseekV4CSACompressor,
    DeepseekV4HashRouter,
    DeepseekV4HCACompressor,
    DeepseekV4HyperConnection,
    DeepseekV4HyperHead,
    DeepseekV4TopKRouter,
)

from ftc_runtime.models.layers.compressed_indexer import compressed_index_scores, select_entries
from ftc_runtime.models.layers.hyper_connections import hc_collapse, hc_expand, hc_weights, hyper_head
from ftc_runtime.models.layers.sink_attention import grouped_out, shared_kv_in, sink_attention
from ftc_runtime.models.layers.softplus_router import route_biased, route_hashed
from ftc_runtime.models.layers.window_compressor import (
    compress_overlapping_windows,
    compress_windows,
    visible_entries,
)


def _config(rng: random.Random) -> DeepseekV4Config:
    return DeepseekV4Config(hidden_size=rng.choice([32, 64]), hc_mult=rng.choice([2, 4]),
                            hc_sinkhorn_iters=rng.choice([1, 3, 20]), num_local_experts=rng.choice([8, 16]),
                            num_experts_per_tok=rng.choice([2, 4]), vocab_size=50, routed_scaling_factor=1.5)


def _randomize(module: torch.nn.Module, g: torch.Generator) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


@pytest.mark.parametrize("trial", range(4))
def test_hyper_connections_equal_transformers(trial, seed):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    cfg = _config(rng)
    hc = DeepseekV4HyperConnection(cfg).float()
    _randomize(hc, g)
    t = rng.randrange(1, 6)
    streams = torch.randn(1, t, cfg.hc_mult, cfg.hidden_size, generator=g)
    out = torch.randn(1, t, cfg.hidden_size, generator=g)
    with torch.no_grad():
        want_post, want_comb, want_collapsed = hc(streams)
        want_next = want_post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(want_comb.transpose(-1, -2), streams)
    pre, post, comb = hc_weights(streams[0], hc.fn, hc.base, hc.scale, cfg.rms_norm_eps, cfg.hc_eps,
                                 cfg.hc_sinkhorn_iters)
    what = f"hc {cfg.hc_mult}, hidden {cfg.hidden_size}, {cfg.hc_sinkhorn_iters} Sinkhorn steps, {t} tokens"
    torch.testing.assert_close(post, want_post[0], rtol=1e-5, atol=1e-6, msg=what)
    torch.testing.assert_close(comb, want_comb[0], rtol=1e-5, atol=1e-6, msg=what)
    torch.testing.assert_close(hc_collapse(streams[0], pre), want_collapsed[0], rtol=1e-5, atol=1e-5, msg=what)
    torch.testing.assert_close(hc_expand(streams[0], out[0], post, comb), want_next[0], rtol=1e-5, atol=1e-5,
                               msg=what)
    # Sinkhorn's last step normalizes the columns: each sums to s / (s + hc_eps) for its sum s before
    # that step, never above 1, and visibly below where a saturated softmax left a column almost
    # empty (s of 3e-4: 0.997); rows converge only as the steps go on
    assert bool((comb.sum(-2) <= 1 + 1e-6).all()), f"{what}: column sums {comb.sum(-2).tolist()}"
    head = DeepseekV4HyperHead(cfg).float()
    _randomize(head, g)
    with torch.no_grad():
        want_head = head(streams)
    torch.testing.assert_close(hyper_head(streams[0], head.hc_fn, head.hc_base, head.hc_scale, cfg.rms_norm_eps,
                                          cfg.hc_eps), want_head[0], rtol=1e-5, atol=1e-5, msg=what)


@pytest.mark.parametrize("trial", range(4))
def test_routers_equal_transformers(trial, seed):
    """The learned router on scores + bias (the bias large enough to change the choice), the hash
    router on the token ids: the same experts (as sets: transformers' top-k is unsorted) with the
    same weights."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    cfg = _config(rng)
    t = rng.randrange(1, 9)
    h = torch.randn(t, cfg.hidden_size, generator=g)
    learned, hashed = DeepseekV4TopKRouter(cfg), DeepseekV4HashRouter(cfg)
    with torch.no_grad():
        for r in (learned, hashed):
            r.weight.copy_(torch.randn(r.weight.shape, generator=g) / cfg.hidden_size ** 0.5)
        learned.e_score_correction_bias.copy_(torch.randn(cfg.num_local_experts, generator=g))
        table = torch.stack([torch.randperm(cfg.num_local_experts, generator=g)[:cfg.num_experts_per_tok]
                             for _ in range(cfg.vocab_size)])
        hashed.tid2eid.copy_(table)
        token_ids = torch.randint(cfg.vocab_size, (t,), generator=g)
        _, want_w, want_ids = learned(h)
        _, hash_w, hash_ids = hashed(h, token_ids)
    ids, w = route_biased(h, learned.weight, learned.e_score_correction_bias, cfg.num_experts_per_tok,
                          cfg.routed_scaling_factor)
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(w.gather(1, order), want_w.gather(1, want_order), rtol=1e-5, atol=1e-6)
    ids, w = route_hashed(h, token_ids, hashed.weight, hashed.tid2eid, cfg.routed_scaling_factor)
    assert torch.equal(ids, hash_ids)
    torch.testing.assert_close(w, hash_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("trial", range(4))
def test_compressed_windows_equal_transformers(trial, seed):
    """HCA's entries of a prompt (every complete window; the rest waits for more tokens) and which
    of them each query sees, against `DeepseekV4HCACompressor` without a cache; the rotary table
    at the windows' first positions from the config's `compress` base, computed here."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    rate, head_dim, rotary = rng.choice([2, 4, 8]), rng.choice([16, 32]), rng.choice([0.25, 0.5])
    cfg = DeepseekV4Config(hidden_size=48, head_dim=head_dim, compress_rates={
        "compressed_sparse_attention": 4, "heavily_compressed_attention": rate}, rope_parameters={
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": rotary},
        "compress": {"rope_type": "default", "rope_theta": 160000.0, "partial_rotary_factor": rotary}})
    module = DeepseekV4HCACompressor(cfg).float()
    _randomize(module, g)
    t = rng.randrange(rate, 5 * rate + 3)
    hidden = torch.randn(1, t, cfg.hidden_size, generator=g)
    positions = torch.arange(t)
    with torch.no_grad():
        want, bias = module(hidden, None, positions[None], None, 0)
        kv, gate = module.kv_proj(hidden[0]), module.gate_proj(hidden[0])
    n, dim = t // rate, int(head_dim * rotary)
    inv_freq = 1.0 / (160000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    freqs = (torch.arange(n) * rate).float()[:, None] * inv_freq
    got = compress_windows(kv, gate, module.position_bias, module.kv_norm.weight, cfg.rms_norm_eps, freqs.cos(),
                           freqs.sin())
    torch.testing.assert_close(got, want[0, 0], rtol=1e-5, atol=1e-5, msg=f"rate {rate}, {t} tokens")
    assert torch.equal(visible_entries(positions, n, rate), bias[0, 0] == 0)


def _rotary(positions: torch.Tensor, base: float, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, dim / 2] of interleaved RoPE at `positions` (one angle per rotated pair)."""
    freqs = positions.float()[:, None] * (1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)))
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("layer_type", ["sliding_attention", "heavily_compressed_attention"])
def test_sliding_and_compressed_attention_equal_transformers(layer_type, seed):
    """A prompt through `DeepseekV4Attention` (no cache, eager) of a sliding-window layer and of an
    HCA layer, against ftc's functions: the window's rows visible under the same sliding causal
    rule, the HCA layer's entries (`compress_windows`) under theirs, sinks, the output's conjugate
    rotation, the grouped projection."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    rate, window, heads, head_dim = 4, rng.choice([3, 8, 64]), 4, 32
    cfg = DeepseekV4Config(
        hidden_size=48, head_dim=head_dim, num_attention_heads=heads, q_lora_rank=24, o_groups=2, o_lora_rank=16,
        sliding_window=window, num_hidden_layers=2, layer_types=["sliding_attention", layer_type],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": rate},
        rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                         "compress": {"rope_type": "default", "rope_theta": 160000.0, "partial_rotary_factor": 0.25}})
    cfg._attn_implementation = "eager"
    module = DeepseekV4Attention(cfg, 1).float()
    _randomize(module, g)
    t = rng.randrange(rate, 6 * rate + 2)
    hidden, positions = torch.randn(1, t, cfg.hidden_size, generator=g), torch.arange(t)
    compressed = layer_type != "sliding_attention"
    cos, sin = _rotary(positions, 160000.0 if compressed else 10000.0, head_dim // 4)
    near = positions[:, None] - positions[None, :]
    sliding = (near >= 0) & (near < window)
    with torch.no_grad():
        mask = torch.zeros(1, 1, t, t).masked_fill(~sliding, float("-inf"))
        want, _ = module(hidden, {"main": (cos[None], sin[None]), "compress": (cos[None], sin[None])},
                         positions[None], mask)
    a = module
    q, kv, _ = shared_kv_in(hidden[0], a.q_a_proj.weight, a.q_a_norm.weight, a.q_b_proj.weight, a.kv_proj.weight,
                            a.kv_norm.weight, cos, sin, cfg.rms_norm_eps, heads)
    entries, visible = kv, sliding
    if compressed:
        c = a.compressor
        n = t // rate
        c_cos, c_sin = _rotary(torch.arange(n) * rate, 160000.0, head_dim // 4)
        windows = compress_windows(c.kv_proj(hidden[0]), c.gate_proj(hidden[0]), c.position_bias, c.kv_norm.weight,
                                   cfg.rms_norm_eps, c_cos, c_sin)
        entries = torch.cat([kv, windows])
        visible = torch.cat([sliding, visible_entries(positions, n, rate)], dim=1)
    attn = sink_attention(q, entries, visible, a.sinks, head_dim ** -0.5)
    got = grouped_out(attn, cos, sin, a.o_a_proj.weight, a.o_b_proj.weight, cfg.o_groups)
    torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-5, msg=f"{layer_type}, window {window}, {t} tokens")


@pytest.mark.parametrize("top_k", ["all", "some"])
def test_overlapping_windows_and_the_indexer_equal_transformers(top_k, seed):
    """CSA on a prompt against `DeepseekV4CSACompressor` without a cache: its entries (windows of
    width 2 · rate, stride rate) and which of them each query attends to, the indexer's own
    entries and scores deciding; `top_k` all: every visible entry, some: the indexer's best (16
    indexer heads, so that an entry scores exactly 0, a tie, almost never)."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    rate, head_dim, index_dim = 4, 32, 16
    n_max = 6
    k = n_max if top_k == "all" else rng.choice([1, 2, 3])
    cfg = DeepseekV4Config(
        hidden_size=48, head_dim=head_dim, q_lora_rank=24, index_n_heads=16, index_head_dim=index_dim, index_topk=k,
        compress_rates={"compressed_sparse_attention": rate, "heavily_compressed_attention": 8},
        rope_parameters={"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                         "compress": {"rope_type": "default", "rope_theta": 160000.0, "partial_rotary_factor": 0.5}})
    module = DeepseekV4CSACompressor(cfg).float()
    _randomize(module, g)
    t = rng.randrange(rate, n_max * rate + rate)
    hidden, q_residual = torch.randn(1, t, cfg.hidden_size, generator=g), torch.randn(1, t, 24, generator=g)
    positions = torch.arange(t)
    with torch.no_grad():
        want, bias = module(hidden, q_residual, positions[None], None, 0)
        n, ix = t // rate, module.indexer
        cos, sin = _rotary(torch.arange(n) * rate, 160000.0, head_dim // 2)
        got = compress_overlapping_windows(module.kv_proj(hidden[0]), module.gate_proj(hidden[0]),
                                           module.position_bias, module.kv_norm.weight, cfg.rms_norm_eps, cos, sin)
        torch.testing.assert_close(got, want[0, 0], rtol=1e-5, atol=1e-5, msg=f"{t} tokens")
        # the rotary slice is the model's (head_dim · partial_rotary_factor) in the indexer's heads too
        i_cos, i_sin = _rotary(torch.arange(n) * rate, 160000.0, head_dim // 2)
        keys = compress_overlapping_windows(ix.kv_proj(hidden[0]), ix.gate_proj(hidden[0]), ix.position_bias,
                                            ix.kv_norm.weight, cfg.rms_norm_eps, i_cos, i_sin)
        q_cos, q_sin = _rotary(positions, 160000.0, head_dim // 2)
        scores = compressed_index_scores(hidden[0], q_residual[0], ix.q_b_proj.weight, ix.scorer.weights_proj.weight,
                                         keys, q_cos, q_sin)
    assert torch.equal(select_entries(scores, positions, rate, k), bias[0, 0] == 0)
