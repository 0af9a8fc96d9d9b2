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


class GlmMtpHead(torch.nn.Module):
    """The published next-n (multi-token-prediction) layer of DeepSeek-V3 and GLM (as vLLM's
    deepseek_mtp / glm4_moe_mtp run it), the reference the engine's is held to: RMSNorms of the next
    token's embedding (zeros at position 0) and of the model's final hidden state, `eh_proj` of both
    (embedding first), one MoE decoder layer with its own indexer (transformers'), then
    `shared_head.norm` and the model's LM head. Saved as decoder layer `num_hidden_layers`."""

    def __init__(self, model: torch.nn.Module, seed: int):
        super().__init__()
        cfg, norm = model.config, type(model.model.norm)
        h = cfg.hidden_size
        torch.manual_seed(seed)
        self.enorm, self.hnorm = norm(h, cfg.rms_norm_eps), norm(h, cfg.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.shared_head = torch.nn.Module()
        self.shared_head.norm = norm(h, cfg.rms_norm_eps)
        # a layer of the model with experts and its own indexer, whose inputs it shares
        self.like = next(i for i, (mlp, ix) in enumerate(zip(cfg.mlp_layer_types, cfg.indexer_types, strict=True))
                         if mlp == "sparse" and ix == "full")
        self.layer = type(model.model.layers[self.like])(cfg, self.like)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.copy_(torch.randn_like(p) * 0.08 * 12.0)
                elif name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.5 * torch.rand_like(p))
                elif name.endswith("norm.bias"):
                    p.copy_(0.1 * torch.randn_like(p))
                else:
                    p.copy_(torch.randn_like(p) * 0.08)
                p.copy_(p.to(torch.bfloat16).float())
            for name, b in self.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_((0.1 * torch.randn_like(b)).to(torch.bfloat16).float())
        self.eval()

    def tensors(self, n_layers: int) -> dict[str, torch.Tensor]:
        """Its tensors by checkpoint name: decoder layer `n_layers` (the model's count)."""
        return {f"model.layers.{n_layers}.{k.removeprefix('layer.')}": v for k, v in self.state_dict().items()}

    def forward(self, model: torch.nn.Module, hidden: torch.Tensor, next_ids: torch.Tensor,
                layer_kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [T, vocab] of rows at positions 0 .. T - 1 (hidden [T, H]: the model's final hidden
        states there, next_ids [T]: the token after each), and the state a further draft takes as
        its hidden state: the layer's output before the head's norm."""
        e = model.model.embed_tokens(next_ids)
        e[0] = 0  # position 0
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))
        x = self.layer(x[None], **layer_kwargs)[0][0]
        return model.lm_head(self.shared_head.norm(x)).float(), x

    def layer_inputs(self, model: torch.nn.Module, ids: list[int]) -> tuple[torch.Tensor, dict]:
        """The model's final hidden states [T, H] over `ids` and the keyword arguments (mask,
        positions, position embeddings) its layer `like` took there (no cache)."""
        taken = {}

        def take(_module, _args, kwargs):
            taken.update({k: kwargs[k] for k in ("attention_mask", "position_ids", "position_embeddings")})

        hook = model.model.layers[self.like].register_forward_pre_hook(take, with_kwargs=True)
        try:
            hidden = model.model(torch.tensor([ids]), use_cache=False).last_hidden_state[0]
        finally:
            hook.remove()
        return hidden, taken


def save_glm_checkpoint(model: torch.nn.Module, directory: Path, layout: str, mtp: GlmMtpHead | None = None) -> Path:
    """layout 'fused' (experts.gate_up_proj [E, 2I, H]) or 'per_expert'; the router's gate and bias
    in fp32 as GLM's checkpoints keep them, the rest bf16; `mtp`: its next-n layer after the others
    (the config's `num_nextn_predict_layers` 1). With config.json and tokenizer.json."""
    directory.mkdir(parents=True, exist_ok=True)
    fp32 = ("mlp.gate.weight", "e_score_correction_bias")
    state = model.state_dict() | (mtp.tensors(model.config.num_hidden_layers) if mtp is not None else {})
    state = {k: v.detach().to(torch.float32 if k.endswith(fp32) else torch.bfloat16).contiguous()
             for k, v in state.items()}
    save_file(expert_layout(state, layout), str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict() | ({"num_nextn_predict_layers": 1} if mtp is not None else {})
    (directory / "config.json").write_text(json.dumps(config))
    save_tokenizer(directory)
    return directory
