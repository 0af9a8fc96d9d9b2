"""YaRN's rotary frequencies (`yarn_inv_freq`) against transformers' own, with fresh random parameters:
`_compute_yarn_parameters` itself, run in float64 as well as in its float32, and DeepSeek-V4's rotary table of
its compressed branch (`DeepseekV4RotaryEmbedding`, rope type "compress")."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DeepseekV4Config, LlamaConfig, modeling_rope_utils
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

from ftc_runtime.models.layers.rope import rope_cos_sin, yarn_inv_freq


class _Float64Torch:
    """`torch` as transformers' YaRN code sees it, with its `torch.float` / `torch.float32` read as float64: the
    same arithmetic in double precision, so that ours can be held to 1e-12 rather than to float32's rounding."""

    float = float32 = torch.float64

    def __getattr__(self, name: str):
        return getattr(torch, name)


def _yarn_parameters(rng: random.Random) -> dict:
    """A `rope_parameters` dict of rope type yarn; keys left out take transformers' defaults."""
    params = {"rope_type": "yarn", "rope_theta": rng.choice([10000.0, 160000.0, rng.uniform(100.0, 1e7)]),
              "factor": rng.choice([1.0, 16.0, 40.0, rng.uniform(1.0, 40.0)]),
              "original_max_position_embeddings": rng.choice([4096, 65536, rng.randrange(1024, 65537)])}
    if rng.random() < 0.5:
        params["beta_fast"], params["beta_slow"] = rng.uniform(4.0, 64.0), rng.uniform(0.25, 3.0)
    if rng.random() < 0.5:
        params["truncate"] = rng.random() < 0.5
    attention = rng.choice(["derived", "mscale", "given"])
    if attention == "mscale":  # DeepSeek-V3 sets both to 1.0
        params["mscale"], params["mscale_all_dim"] = rng.choice([(1.0, 1.0),
                                                                 (rng.uniform(0.5, 2.0), rng.uniform(0.5, 2.0))])
    elif attention == "given":
        params["attention_factor"] = rng.uniform(0.5, 2.0)
    return params


def _ours(params: dict, rotary_dim: int) -> tuple[torch.Tensor, float]:
    keys = ("beta_fast", "beta_slow", "truncate", "attention_factor", "mscale", "mscale_all_dim")
    return yarn_inv_freq(params["rope_theta"], rotary_dim, params["factor"],
                         params["original_max_position_embeddings"], **{k: params[k] for k in keys if k in params})


@pytest.mark.parametrize("trial", range(12))
def test_yarn_inv_freq_equals_transformers(trial, seed, monkeypatch):
    """inverse frequencies and attention factor of a random theta, rotary dim, factor, original context, betas
    (given or transformers' 32 / 1), truncation and mscales, against `_compute_yarn_parameters` on a config with
    them: to 1e-12 of transformers' arithmetic in float64, and to float32's rounding of its own float32."""
    rng = random.Random(seed)
    params, rotary_dim = _yarn_parameters(rng), 2 * rng.randrange(8, 65)
    config = LlamaConfig(hidden_size=rotary_dim, num_attention_heads=1, head_dim=rotary_dim,
                         max_position_embeddings=int(params["original_max_position_embeddings"] * params["factor"]),
                         rope_parameters=dict(params))
    got, got_factor = _ours(params, rotary_dim)
    want32, want_factor = modeling_rope_utils._compute_yarn_parameters(config)
    with monkeypatch.context() as m:
        m.setattr(modeling_rope_utils, "torch", _Float64Torch())
        want64, _ = modeling_rope_utils._compute_yarn_parameters(config)
    assert want64.dtype == got.dtype == torch.float64
    msg = f"{params}, rotary dim {rotary_dim}"
    torch.testing.assert_close(got, want64, rtol=1e-12, atol=0, msg=msg)
    # float32's theta ** (i / dim) (its exponent's rounding times ln theta, < 17) and its ramp (a rounding of the
    # ramp moves a frequency by up to `factor` times it): up to 5e-6 relative over 2000 draws
    torch.testing.assert_close(got.float(), want32, rtol=2e-5, atol=0, msg=msg)
    assert got_factor == want_factor, msg


@pytest.mark.parametrize("layout", ["nested", "flat"])
def test_deepseek_v4_compress_rotary_equals_transformers(layout, seed):
    """cos and sin of V4's compressed branch at random positions, a yarn `compress` rope of random theta, factor,
    original context and betas over 16 (or 8, 32) of a 64-wide head, against `rope_cos_sin` of `yarn_inv_freq`
    times its attention factor. "nested": `rope_parameters` given per rope type, as `{"main": ..., "compress":
    ...}`; with no `attention_factor` transformers derives YaRN's and scales cos and sin by it. "flat": one yarn
    dict, as checkpoints give it, which V4's config moves under "compress" at `compress_rope_theta`, pinning the
    attention factor to 1 (V4's reference leaves cos and sin unscaled)."""
    rng = random.Random(seed)
    head_dim, partial = 64, rng.choice([0.125, 0.25, 0.5])
    rotary_dim, theta = int(head_dim * partial), rng.choice([160000.0, rng.uniform(1000.0, 1e6)])
    yarn = {"rope_type": "yarn", "factor": rng.choice([16.0, rng.uniform(1.0, 40.0)]),
            "original_max_position_embeddings": rng.choice([65536, rng.randrange(1024, 65537)])}
    if rng.random() < 0.5:
        yarn["beta_fast"], yarn["beta_slow"] = rng.uniform(4.0, 64.0), rng.uniform(0.25, 3.0)
    if layout == "nested":
        rope = {"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial},
                "compress": {**yarn, "rope_theta": theta, "partial_rotary_factor": partial}}
        config = DeepseekV4Config(hidden_size=48, head_dim=head_dim, partial_rotary_factor=partial,
                                  rope_parameters=rope)
    else:
        config = DeepseekV4Config(hidden_size=48, head_dim=head_dim, partial_rotary_factor=partial,
                                  compress_rope_theta=theta, rope_parameters=dict(yarn))
    compress = config.rope_parameters["compress"]
    assert compress["rope_type"] == "yarn" and compress["rope_theta"] == theta
    assert (compress.get("attention_factor") == 1.0) == (layout == "flat")

    inv_freq, factor = _ours(compress, rotary_dim)
    max_position = 8192
    positions = torch.tensor(rng.sample(range(max_position), 64))
    with torch.no_grad():
        want_cos, want_sin = DeepseekV4RotaryEmbedding(config)(torch.zeros(1), positions[None], layer_type="compress")
    # V4's table holds one angle per rotated pair; `rope_cos_sin` repeats them over the two halves
    want_cos, want_sin = (torch.cat((w[0], w[0]), dim=-1).double() for w in (want_cos, want_sin))
    cos, sin = rope_cos_sin(inv_freq, positions, torch.float64)
    # transformers' angles position * inv_freq are float32: their rounding (2^-24 of an angle of up to max_position
    # radians) and that of its float32 inverse frequencies (a few 1e-6 of the slow ones only) came to at most
    # 6.3e-8 per position over 600 draws; allowed 2^-20 per position
    atol = max_position * 2**-20 * factor
    msg = f"{compress}, rotary dim {rotary_dim}"
    torch.testing.assert_close(cos[:, 0] * factor, want_cos, rtol=0, atol=atol, msg=msg)
    torch.testing.assert_close(sin[:, 0] * factor, want_sin, rtol=0, atol=atol, msg=msg)
