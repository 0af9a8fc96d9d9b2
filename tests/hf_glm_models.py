"""Tiny random GLM-MoE-DSA models (GLM-5.x: latent attention with the DSA indexer, a dense first
layer, sigmoid-routed experts in groups beside a shared expert) built with transformers, saved as
checkpoints in the layouts ftc reads: transformers' fused experts or GLM's own per-expert tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

from hf_models import expert_layout
from hf_tokenizer import save_tokenizer

VOCAB = 320
# The parity tests' prompts are at most this long: the indexer then selects every causal key, as
# exact parity needs (ReLU scores of exactly 0 tie, and transformers breaks ties differently at
# different lengths); the indexer's sparse choice is tested on its own (test_glm_layers.py).
INDEX_TOP_K = 128


def build_glm(seed: int, intermediate: int = 32, index_top_k: int = INDEX_TOP_K) -> torch.nn.Module:
    """Four layers (the first dense; the indexer in layers 0 and 2, shared in 1 and 3), 16 experts
    in 4 groups of which 2 are eligible, 4 experts per token, each expert (and the shared one) of
    `intermediate` (the 4-bit formats need a multiple of 64); each query attends to at most
    `index_top_k` keys."""
    cfg = GlmMoeDsaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=intermediate,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                          n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                          routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                          v_head_dim=12, qk_nope_head_dim=16, index_topk=index_top_k, index_head_dim=16,
                          index_n_heads=4, first_k_dense_replace=1, indexer_types=["full", "shared", "full", "shared"],
                          max_position_embeddings=1024, initializer_range=0.08, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = GlmMoeDsaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(12.0)  # decisive routing
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.rand_like(p))
            elif name == "lm_head.weight":
                p.mul_(4.0)  # decisive greedy tokens
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))  # the bias steers the choice, not the weights
        # The checkpoint is bf16 (a 4-bit one stores the gate and bias in bf16 too); the reference
        # runs its values in fp32.
        for p in [*model.parameters(), *(b for n, b in model.named_buffers() if n.endswith("correction_bias"))]:
            p.copy_(p.to(torch.bfloat16).float())
    return model.eval()


def save_glm_checkpoint(model: torch.nn.Module, directory: Path, layout: str) -> Path:
    """layout 'fused' (experts.gate_up_proj [E, 2I, H]) or 'per_expert'; the router's gate and bias
    in fp32 as GLM's checkpoints keep them, the rest bf16. With config.json and tokenizer.json."""
    directory.mkdir(parents=True, exist_ok=True)
    fp32 = ("mlp.gate.weight", "e_score_correction_bias")
    state = {k: v.detach().to(torch.float32 if k.endswith(fp32) else torch.bfloat16).contiguous()
             for k, v in model.state_dict().items()}
    save_file(expert_layout(state, layout), str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(model.config.to_dict()))
    save_tokenizer(directory)
    return directory
