"""DeepSeek-V4's decoder (`models/deepseek_v4/model.py`) against transformers' DeepseekV4ForCausalLM on
tiny random models (every layer kind, hash layers with a random `tid2eid`, hyper-connections of 4
streams, YaRN on the compressed base, a SwiGLU limit that clamps): the logits of a prompt, then of
decode steps over each one's state, then of another chunk, against transformers with its cache, in
fp32. The routed experts run on a torch backend over transformers' own expert weights, so that
the family's model is what is compared."""

from __future__ import annotations

import random

import torch
from transformers import DeepseekV4ForCausalLM, DynamicCache

from ftc_runtime.experts.base import ExpertBackend
from ftc_runtime.models.deepseek_v4.loader import check_spec, spec_from_hf
from ftc_runtime.models.deepseek_v4.model import DeepseekV4Model
from ftc_runtime.models.hf_config import HfConfig
from ftc_runtime.spec import ModelSpec, checker

from hf_deepseek_v4_models import tiny


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


def test_logits_over_the_state_equal_transformers_with_its_cache(tmp_path, seed):
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    model, fields = tiny(rng, g)
    where = tmp_path / "config.json"
    spec = ModelSpec.from_dict(spec_from_hf(HfConfig({"model_type": "deepseek_v4"} | fields, where)), str(where))
    check_spec(spec, checker(str(where)))
    ours = DeepseekV4Model(spec, {k: v.detach() for k, v in model.state_dict().items()}, TorchExperts(model))
    state, cache = ours.new_cache(), DynamicCache(config=model.config)
    start = 0
    for n in [rng.randrange(5, 20)] + [1] * rng.randrange(3, 9) + [rng.randrange(2, 12)] + [1] * 3:
        ids = torch.randint(97, (n,), generator=g)
        with torch.no_grad():
            want = model(ids[None], cache=cache, use_cache=True).logits[0]
        got = ours.forward(ids, state, all_logits=True)
        what = f"tokens {start}..{start + n - 1}, window {fields['sliding_window']}, top_k {fields['index_topk']}"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=what)
        start += n
