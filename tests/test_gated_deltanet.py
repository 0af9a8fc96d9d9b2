"""The Gated DeltaNet layer against transformers' own (qwen3_5_moe), on fresh random weights:
whole sequences, and sequences cut anywhere with the state carried, taken and restored."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

from ftc_runtime.models.layers.gated_deltanet import (
    DeltaNetShape,
    DeltaNetState,
    DeltaNetWeights,
    _delta_rule,
    _delta_rule_chunked,
    delta_rule,
    gated_deltanet,
    project,
)

# transformers computes a whole sequence chunk-wise, this layer token by token: the same sums in
# another order. Measured over 1000 random layers and lengths: at most 6e-6 relative (the norm of
# the difference over the norm of the output); a wrong decay or a lost state is off by > 1e-2.
BOUND = 3e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _layer(seed: int) -> tuple[Qwen3_5MoeGatedDeltaNet, DeltaNetWeights, DeltaNetShape]:
    """A layer of random shape and weights; it seeds torch's generator, so the test's tensors that
    follow are the seed's too."""
    rng = random.Random(seed)
    k_heads = rng.choice([1, 2])
    cfg = Qwen3_5MoeTextConfig(hidden_size=48, linear_num_key_heads=k_heads,
                               linear_num_value_heads=k_heads * rng.choice([1, 2, 3]),
                               linear_key_head_dim=rng.choice([8, 16]), linear_value_head_dim=rng.choice([8, 12]),
                               linear_conv_kernel_dim=rng.choice([2, 4]), num_hidden_layers=1,
                               layer_types=["linear_attention"], rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    ref = Qwen3_5MoeGatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        for p in ref.parameters():  # every tensor random, the norm and decay parameters included
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0))
    w = DeltaNetWeights(ref.in_proj_qkv.weight, ref.in_proj_z.weight, ref.in_proj_b.weight, ref.in_proj_a.weight,
                        ref.conv1d.weight, ref.dt_bias, ref.A_log, ref.norm.weight, ref.out_proj.weight)
    shape = DeltaNetShape(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                          cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, cfg.rms_norm_eps)
    return ref, w, shape


@pytest.mark.parametrize("trial", range(6))  # six layers: each test id draws from its own seed
@torch.no_grad()
def test_whole_sequence_matches_transformers(trial, seed):
    rng = random.Random(seed)
    ref, w, shape = _layer(rng.randrange(2**31))
    x = torch.randn(rng.randrange(1, 150), 48)
    want = ref(x[None])[0]
    got, _, _ = gated_deltanet(x, w, shape, DeltaNetState.zeros(shape, x.dtype))
    assert _rel(got, want) < BOUND


@pytest.mark.parametrize("trial", range(6))
@torch.no_grad()
def test_cut_sequences_continue_from_their_state(trial, seed):
    """Chunks of any length (single tokens included) with the state carried equal the whole run;
    a state taken after a chunk and restored later continues identically."""
    rng = random.Random(seed)
    ref, w, shape = _layer(rng.randrange(2**31))
    x = torch.randn(rng.randrange(10, 90), 48)
    want = ref(x[None])[0]
    cuts = sorted(rng.sample(range(1, x.shape[0]), rng.randrange(1, 6)))
    state, outs, taken = DeltaNetState.zeros(shape, x.dtype), [], None
    for a, b in zip([0, *cuts], [*cuts, x.shape[0]], strict=True):
        out, state, _ = gated_deltanet(x[a:b], w, shape, state)
        outs.append(out)
        if taken is None:
            taken, taken_at = state.clone(), b
    assert _rel(torch.cat(outs), want) < BOUND
    resumed, _, _ = gated_deltanet(x[taken_at:], w, shape, taken)
    assert _rel(resumed, want[taken_at:]) < BOUND


@pytest.mark.parametrize("trial", range(6))
@torch.no_grad()
def test_the_chunked_recurrence_equals_the_token_by_token_one(trial, seed):
    """Blocks of any size (here 3-17, so that several blocks and a ragged last one occur), from a
    non-zero state, with decays from mild to strong: the outputs and final state of the
    token-by-token recurrence."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    t, h, dk, dv = rng.randrange(2, 120), rng.randrange(1, 4), rng.choice([4, 8, 16]), rng.choice([4, 12])
    q, k = F.normalize(torch.randn(t, h, dk), dim=-1) * dk ** -0.5, F.normalize(torch.randn(t, h, dk), dim=-1)
    v, beta = torch.randn(t, h, dv), torch.rand(t, h)
    g = -torch.rand(t, h) * rng.choice([0.05, 1.0, 6.0])
    state = torch.randn(h, dk, dv)
    want_out, want_state = _delta_rule(q, k, v, g, beta, state)
    got_out, got_state, _ = _delta_rule_chunked(q, k, v, g, beta, state, chunk=rng.randrange(3, 18))
    assert _rel(got_out, want_out) < 1e-5 and _rel(got_state, want_state) < 1e-5


@pytest.mark.parametrize("trial", range(4))
@torch.no_grad()
def test_states_captured_inside_a_chunk_equal_the_states_of_a_cut(trial, seed):
    """The state after token i, taken inside one chunk (any block, a ragged one included; one of
    the first tokens, whose convolution state holds inputs from before the chunk), equals the state
    after running only the first i + 1 tokens; the chunk's output does not change. The cut's
    recurrence runs on the chunk's own projections of those tokens: projecting fewer rows may round
    differently (a log-decay 1.9e-6 off, FTC_TEST_SEED=2101086326), which a strongly decaying state
    carries to 2e-5 relative, and that is the matmul's, not the capture's."""
    rng = random.Random(seed)
    _, w, shape = _layer(rng.randrange(2**31))
    x = torch.randn(rng.randrange(2, 200), 48)
    start = DeltaNetState.zeros(shape, x.dtype)
    start.recurrent.normal_()
    start.conv.normal_()  # a token among the first K − 1 keeps some of the inputs before the chunk
    picked = rng.sample(range(x.shape[0]), rng.randrange(1, min(6, x.shape[0]) + 1)) + [rng.randrange(2)]
    capture = tuple(sorted(set(picked)))
    out, _, taken = gated_deltanet(x, w, shape, start, capture)
    plain, _, _ = gated_deltanet(x, w, shape, start)
    assert torch.equal(out, plain) and len(taken) == len(capture)
    projected = project(x, *w.projections(), start.conv, shape.heads)[:5]  # q, k, v, g, beta
    for i, got in zip(capture, taken, strict=True):
        _, want, _ = gated_deltanet(x[:i + 1], w, shape, start)
        _, recurrent, _ = delta_rule(*(t[:i + 1] for t in projected), start.recurrent)
        assert _rel(got.conv, want.conv) < 1e-5 and _rel(got.recurrent, recurrent) < 1e-5, f"seed={seed} i={i}"
