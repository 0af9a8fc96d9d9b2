"""Tiny random Qwen3.5-MoE and Qwen3-Next models (Gated DeltaNet and gated full attention, a shared
expert) built with transformers, saved as checkpoints in the layouts ftc reads: Qwen3.5 with its
split linear projections, as the text model (`model.layers.`) or as the image-text model's
language model (`model.language_model.`, the config nested under `text_config`); Qwen3-Next with
its grouped `in_proj_qkvz` / `in_proj_ba`; experts fused or per expert.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3NextConfig, Qwen3NextForCausalLM

from hf_models import expert_layout
from hf_tokenizer import save_tokenizer

VOCAB = 320


def build_hybrid(family: str, seed: int) -> torch.nn.Module:
    """Four layers (three Gated DeltaNet, one full attention), 8 experts of which 2 per token."""
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                  linear_value_head_dim=12, linear_conv_kernel_dim=4, moe_intermediate_size=32,
                  shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                  max_position_embeddings=1024, initializer_range=0.08, rms_norm_eps=1e-6)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    if family == "qwen3_5_moe":
        cfg = Qwen3_5MoeTextConfig(**common, rope_parameters=rope | {"mrope_section": [2, 1, 1]})
        cls = Qwen3_5MoeForCausalLM
    else:
        cfg = Qwen3NextConfig(**common, rope_parameters=rope, norm_topk_prob=True, intermediate_size=96)
        cls = Qwen3NextForCausalLM
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(12.0)  # decisive routing
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.5 * torch.rand_like(p))  # a plain w · x̂ norm
            elif "norm" in name:
                p.copy_(0.5 * torch.rand_like(p))  # (1 + w) · x̂ norms
            elif name == "lm_head.weight":
                p.mul_(4.0)  # decisive greedy tokens
        for p in model.parameters():  # the checkpoint is bf16; the reference runs its values in fp32
            p.copy_(p.to(torch.bfloat16).float())
    return model.eval()


def save_hybrid_checkpoint(model: torch.nn.Module, directory: Path, layout: str, nested: bool = False) -> Path:
    """layout 'fused' (experts.gate_up_proj [E, 2I, H]) or 'per_expert'; `nested`: Qwen3.5 as the
    image-text model's language model. With config.json and tokenizer.json (hf_tokenizer.py)."""
    directory.mkdir(parents=True, exist_ok=True)
    state = expert_layout({k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()},
                          layout)
    config = model.config.to_dict()
    if nested:
        state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                 for k, v in state.items()}
        config = {"model_type": "qwen3_5_moe", "tie_word_embeddings": False, "text_config": config}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    save_tokenizer(directory)
    return directory

