"""GLM-MoE-DSA's attention layers (`layers/mla`, `layers/dsa_indexer`) against transformers'
GlmMoeDsaAttention, on a tiny fp32 layer with fresh random weights and inputs: the dense and the
sparse (indexer-selected) prompt, one decode step over the cached latents, and interleaved RoPE."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers import GlmMoeDsaConfig
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
    GlmMoeDsaAttention,
    GlmMoeDsaRotaryEmbedding,
    apply_rotary_pos_emb_interleave,
)

from ftc_runtime.models.layers.dsa_indexer import (
    IndexerShape,
    index_scores,
    indexer_keys,
    select_keys,
    top_k_indices,
    top_k_visible,
)
from ftc_runtime.models.layers.mla import MlaShape, interleaved_rope, mla_attention, mla_in
from ftc_runtime.models.layers.rope import rope_cos_sin

PROMPT = 24
THETA = 10000.0


def tiny_attention(top_k: int) -> GlmMoeDsaAttention:
    """A one-layer GLM-MoE-DSA attention in fp32, its weights drawn so that activations are O(1)
    (the config's 0.02 init makes every score tiny and the softmax flat)."""
    config = GlmMoeDsaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                             kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
                             index_n_heads=8, index_head_dim=16, index_topk=top_k, num_hidden_layers=1,
                             rope_parameters={"rope_type": "default", "rope_theta": THETA},
                             attn_implementation="eager", dtype=torch.float32)
    attn = GlmMoeDsaAttention(config, 0).eval()
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif "norm" in name:
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0.0, p.shape[1] ** -0.5)
    return attn


def shapes(attn: GlmMoeDsaAttention) -> tuple[MlaShape, IndexerShape]:
    c = attn.config
    mla = MlaShape(num_heads=c.num_attention_heads, q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
                   nope_dim=c.qk_nope_head_dim, rope_dim=c.qk_rope_head_dim, v_dim=c.v_head_dim,
                   eps=attn.q_a_layernorm.variance_epsilon, scale=(c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5)
    return mla, IndexerShape(c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim, c.index_topk)


def cos_sin(attn: GlmMoeDsaAttention, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rope = attn.config.qk_rope_head_dim
    inv_freq = 1.0 / (THETA ** (torch.arange(0, rope, 2, dtype=torch.float64) / rope))
    return rope_cos_sin(inv_freq, positions, torch.float32)


def reference(attn: GlmMoeDsaAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transformers on the causal prompt x [T, hidden]: its output [T, hidden], which keys each query
    attended (bool [T, T]) and its cos [T, rope]."""
    t = x.shape[0]
    positions = torch.arange(t)[None]
    cos, sin = GlmMoeDsaRotaryEmbedding(attn.config)(x[None], positions)
    mask = torch.zeros(t, t).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    with torch.no_grad():
        out, _, top = attn(x[None], (cos, sin), mask[None, None], position_ids=positions)
    attended = torch.zeros(t, t, dtype=torch.bool).scatter_(-1, top[0].long(), True)
    return out[0], attended & torch.ones(t, t, dtype=torch.bool).tril(), cos[0]


def project(attn: GlmMoeDsaAttention, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Ours, the per-token half: q_nope, q_rope, latent, k_rope, q_resid and the indexer key."""
    mla, idx = shapes(attn)
    cos, sin = cos_sin(attn, positions)
    q_nope, q_rope, latent, k_rope, q_resid = mla_in(
        x, attn.q_a_proj.weight, attn.q_a_layernorm.weight, attn.q_b_proj.weight, attn.kv_a_proj_with_mqa.weight,
        attn.kv_a_layernorm.weight, cos, sin, mla)
    ix = attn.indexer
    keys = indexer_keys(x, ix.wk.weight, ix.k_norm.weight, ix.k_norm.bias, cos, sin, idx)
    return q_nope, q_rope, latent, k_rope, q_resid, keys


def ours(attn: GlmMoeDsaAttention, x: torch.Tensor, positions: torch.Tensor, latents: torch.Tensor,
         rope_keys: torch.Tensor, index_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ours for the queries x [T, hidden] at `positions` over the cache (every token up to the last
    position, these included): the output after o_proj [T, hidden] and the visible mask [T, C]."""
    mla, idx = shapes(attn)
    cos, sin = cos_sin(attn, positions)
    q_nope, q_rope, _, _, q_resid, _ = project(attn, x, positions)
    ix = attn.indexer
    scores = index_scores(x, q_resid, ix.wq_b.weight, ix.weights_proj.weight, index_keys, cos, sin, idx)
    visible = select_keys(scores, positions, idx.top_k)
    out = mla_attention(q_nope, q_rope, latents, rope_keys, attn.kv_b_proj.weight, visible, mla)
    return F.linear(out, attn.o_proj.weight), visible


def untied_prompt(attn: GlmMoeDsaAttention, t: int) -> torch.Tensor:
    """A prompt x [t, hidden] on which the indexer's top-k is unambiguous. Scores tie when every head's
    ReLU is 0 (score exactly 0), and transformers' topk and ours may break a tie differently; so the
    prompt is redrawn until, for every query with more than top_k causal keys, its k-th and (k+1)-th
    largest scores are well apart (with 8 indexer heads that is nearly always the first draw)."""
    k, positions, ix, (_, idx) = attn.config.index_topk, torch.arange(t), attn.indexer, shapes(attn)
    cos, sin = cos_sin(attn, positions)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for _ in range(50):
        x = torch.randn(t, attn.config.hidden_size)
        *_, q_resid, keys = project(attn, x, positions)
        scores = index_scores(x, q_resid, ix.wq_b.weight, ix.weights_proj.weight, keys, cos, sin, idx)
        ranked = scores.masked_fill(~causal, float("-inf")).sort(dim=-1, descending=True).values
        rows = causal.sum(-1) > k
        if k >= t or (ranked[rows, k - 1] - ranked[rows, k]).min() > 1e-4 * scores.abs().max():
            return x
    raise AssertionError("no untied prompt in 50 draws")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("top_k", [64, 5], ids=["dense", "sparse"])
def test_prompt_matches_transformers(seed, top_k):
    torch.manual_seed(seed)
    attn = tiny_attention(top_k)
    x = untied_prompt(attn, PROMPT)
    positions = torch.arange(PROMPT)
    want, attended, hf_cos = reference(attn, x)
    cos, sin = cos_sin(attn, positions)
    assert torch.allclose(cos[:, 0], hf_cos[:, : cos.shape[-1]], atol=1e-6)  # our rope_cos_sin is transformers'
    with torch.no_grad():
        _, _, latents, rope_keys, _, keys = project(attn, x, positions)
        got, visible = ours(attn, x, positions, latents, rope_keys, keys)
    assert torch.equal(visible, attended)
    causal = torch.ones(PROMPT, PROMPT, dtype=torch.bool).tril()
    if top_k >= PROMPT:
        assert torch.equal(visible, causal)
    else:  # the selection matters: later queries see top_k keys, not all theirs
        assert torch.equal(visible.sum(-1), causal.sum(-1).clamp(max=top_k))
    assert relative_error(got, want) < 1e-4


@pytest.mark.parametrize("top_k", [64, 5], ids=["dense", "sparse"])
def test_decode_step_over_the_cache_matches_transformers(seed, top_k):
    """The prompt's latents, rotary keys and indexer keys are cached; the next token at position
    PROMPT attends over them and its own: transformers' last row on the PROMPT + 1 tokens."""
    torch.manual_seed(seed)
    attn = tiny_attention(top_k)
    x = untied_prompt(attn, PROMPT + 1)
    want, attended, _ = reference(attn, x)
    with torch.no_grad():
        cached = project(attn, x[:PROMPT], torch.arange(PROMPT))
        step = torch.tensor([PROMPT])
        new = project(attn, x[PROMPT:], step)
        latents, rope_keys, keys = (torch.cat((cached[i], new[i])) for i in (2, 3, 5))
        got, visible = ours(attn, x[PROMPT:], step, latents, rope_keys, keys)
    assert torch.equal(visible, attended[PROMPT:])
    assert relative_error(got, want[PROMPT:]) < 1e-4


def test_interleaved_rope_matches_transformers(seed):
    torch.manual_seed(seed)
    t, heads, rope = 7, 3, 8
    q, k = torch.randn(t, heads, rope), torch.randn(t, 1, rope)
    positions = torch.randint(0, 5000, (t,))
    cos, sin = rope_cos_sin(1.0 / (THETA ** (torch.arange(0, rope, 2, dtype=torch.float64) / rope)), positions,
                            torch.float32)
    # transformers' layout: [batch, heads, T, rope], cos/sin [batch, T, rope]
    want_q, want_k = apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                     cos[None, :, 0], sin[None, :, 0])
    torch.testing.assert_close(interleaved_rope(q, cos, sin), want_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(interleaved_rope(k, cos, sin), want_k[0].transpose(0, 1), rtol=0, atol=1e-6)


def test_top_k_selection_breaks_ties_for_the_latest_key(seed):
    """The indexer's selection against a plain sort of each row's visible (score, column) pairs,
    highest first, the later column first among equal scores, on scores full of exact ties (small
    integers, +0 and −0 alike, ±inf) and random visibility: the mask, and the columns with their
    chosen flags, whatever the row's count of visible columns against top_k."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    for _ in range(20):
        t, c, top_k = rng.randrange(1, 6), rng.randrange(1, 90), rng.randrange(1, 40)
        scores = torch.randint(-3, 4, (t, c), generator=g).float() * rng.choice([1.0, 0.25, 1e-30])
        scores[torch.rand(t, c, generator=g) < 0.2] = -0.0
        scores[torch.rand(t, c, generator=g) < 0.05] = float("inf")
        scores[torch.rand(t, c, generator=g) < 0.05] = float("-inf")
        visible = torch.rand(t, c, generator=g) < rng.random()
        mask = top_k_visible(scores, visible, top_k)
        columns, chosen = top_k_indices(scores, visible, top_k)
        assert columns.shape == (t, min(top_k, c))
        for r in range(t):
            ranked = sorted((j for j in range(c) if visible[r, j]), key=lambda j: (float(scores[r, j]), j),
                            reverse=True)[:top_k]
            assert set(torch.nonzero(mask[r]).flatten().tolist()) == set(ranked), f"row {r} of {t}: mask"
            assert columns[r][chosen[r]].tolist() == ranked, f"row {r} of {t}: columns in rank order"


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv,rope,nope,v,k,capacity,dtype", [
    (64, 512, 64, 192, 256, 2048, 5000, torch.bfloat16),  # GLM-5.2's decode step past its top_k
    (20, 64, 16, 16, 12, 200, 300, torch.float32),  # heads filling part of a block; k not a multiple of a span
    (3, 32, 24, 8, 16, 5, 40, torch.float32)])
def test_sparse_latent_attention_kernel_matches_torch(seed, heads, kv, rope, nope, v, k, capacity, dtype):
    """The Triton sparse latent attention (one query over the indexer's chosen rows, read in place in
    the storage) against `mla_attention` in fp64 on those rows gathered on the CPU: chosen columns
    with repeats, part of them seen."""
    from ftc_runtime.models.layers.mla import _sparse_attention_gpu

    g = torch.Generator().manual_seed(seed)
    shape = MlaShape(heads, 32, kv, nope, rope, v, 1e-6, (nope + rope) ** -0.5)
    rows = torch.randn(capacity, kv + rope, generator=g).to(dtype)
    columns = torch.randint(0, capacity, (k,), generator=g)
    seen = torch.rand(k, generator=g) < 0.7
    seen[k // 2] = True
    q_nope, q_rope = (torch.randn(1, heads, d, generator=g).to(dtype) for d in (nope, rope))
    kv_b = (torch.randn(heads * (nope + v), kv, generator=g) / kv ** 0.5).to(dtype)
    gathered = rows[columns].double()
    want = mla_attention(q_nope.double(), q_rope.double(), gathered[:, :kv], gathered[:, kv:], kv_b.double(),
                         seen[None], shape)
    got = _sparse_attention_gpu(q_nope.cuda(), q_rope.cuda(), rows.cuda(), kv_b.cuda(), columns.cuda(),
                                seen.cuda(), shape).cpu()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    err = relative_error(got.double(), want)
    assert got.dtype == dtype and got.shape == want.shape and err < tol, f"{heads} heads, {k} columns: {err:.2e}"
