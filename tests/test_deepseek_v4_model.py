"""DeepSeek-V4's decoder (`models/deepseek_v4/model.py`) against transformers' DeepseekV4ForCausalLM on
tiny random models (every layer kind, hash layers with a random `tid2eid`, hyper-connections of 4
streams, YaRN on the compressed base, a SwiGLU limit that clamps): the logits of a prompt, then of
decode steps over each one's state, then of another chunk, against transformers with its cache, in
fp32. The routed experts run on a torch backend over transformers' own expert weights, so that
the family's model is what is compared."""

from __future__ import annotations

import random

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, DynamicCache

from ftc_runtime.experts.base import ExpertBackend
from ftc_runtime.models.deepseek_v4.loader import check_spec, spec_from_hf
from ftc_runtime.models.deepseek_v4.model import DeepseekV4Model
from ftc_runtime.models.hf_config import HfConfig
from ftc_runtime.spec import ModelSpec, checker


class TorchExperts(ExpertBackend):
    """Each layer's routed experts from transformers' stacked weights, clamped as it clamps them."""

    def __init__(self, model: DeepseekV4ForCausalLM):
        self.experts = [layer.mlp.experts for layer in model.model.layers]

    def forward(self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                first_position: int = 0) -> torch.Tensor:
        e, out = self.experts[moe_layer], torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(ids.shape[1]):
                gate, up = (e.gate_up_proj[ids[t, j]] @ x[t]).chunk(2)
                gate, up = gate.clamp(max=e.limit), up.clamp(-e.limit, e.limit)
                out[t] += weights[t, j] * (e.down_proj[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
        return out


def tiny(rng: random.Random, g: torch.Generator) -> tuple[DeepseekV4ForCausalLM, dict]:
    fields = {"vocab_size": 97, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
              "num_attention_heads": 4, "head_dim": 32, "q_lora_rank": 24, "n_routed_experts": 8,
              "num_experts_per_tok": 2, "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 8, "index_head_dim": 16,
              "index_topk": rng.choice([2, 64]), "sliding_window": rng.choice([3, 8]),
              "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                              "compressed_sparse_attention"],
              "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
              "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe"], "swiglu_limit": 0.8,
              "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0,
                                           "partial_rotary_factor": 0.25},
                                  "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 4.0,
                                               "original_max_position_embeddings": 16, "attention_factor": 1.0,
                                               "partial_rotary_factor": 0.25}}}
    cfg = DeepseekV4Config(**fields)
    cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype.is_floating_point:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() < 2 else p.shape[-1] ** -0.5))
        for layer in model.model.layers:
            if hasattr(layer.mlp.gate, "tid2eid"):
                layer.mlp.gate.tid2eid.copy_(torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(97)]))
    return model, fields


def test_logits_over_the_state_equal_transformers_with_its_cache(tmp_path, seed):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    model, fields = tiny(rng, g)
    where = tmp_path / "config.json"
    spec = ModelSpec.from_dict(spec_from_hf(HfConfig({"model_type": "deepseek_v4"} | fields, where)), str(where))
    check_spec(spec, checker(str(where)))
    ours = DeepseekV4Model(spec, {k: v.detach() for k, v in model.state_dict().items()}, TorchExperts(model))
    state, cache = ours.new_state(), DynamicCache(config=model.config)
    start = 0
    for n in [rng.randrange(5, 20)] + [1] * rng.randrange(3, 9) + [rng.randrange(2, 12)] + [1] * 3:
        ids = torch.randint(97, (n,), generator=g)
        with torch.no_grad():
            want = model(ids[None], cache=cache, use_cache=True).logits[0]
        got = ours.forward(ids, state, all_logits=True)
        what = f"tokens {start}..{start + n - 1}, window {fields['sliding_window']}, top_k {fields['index_topk']}"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=what)
        start += n
