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


class QwenMtpHead(torch.nn.Module):
    """The published Qwen3-Next / Qwen3.5 multi-token-prediction head (as vLLM's qwen3_next_mtp runs
    it), the reference the engine's is held to: (1 + w) norms of the next token's embedding and of
    the model's final hidden state, joined by `fc` (embedding first), one full-attention decoder
    layer of the model's own kind (transformers'), a (1 + w) norm, then the model's LM head. Its
    tensors are named as the releases name them, under `mtp.`."""

    def __init__(self, model: torch.nn.Module, seed: int):
        super().__init__()
        cfg, norm = model.config, type(model.model.norm)
        h = cfg.hidden_size
        torch.manual_seed(seed)
        self.pre_fc_norm_embedding = norm(h, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = norm(h, eps=cfg.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.full = cfg.layer_types.index("full_attention")  # a layer of the model whose inputs it shares
        self.layers = torch.nn.ModuleList([type(model.model.layers[self.full])(cfg, self.full)])
        self.norm = norm(h, eps=cfg.rms_norm_eps)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.copy_(torch.randn_like(p) * 0.08 * 12.0)  # decisive routing
                elif "norm" in name:
                    p.copy_(0.5 * torch.rand_like(p))
                else:
                    p.copy_(torch.randn_like(p) * 0.08)
                p.copy_(p.to(torch.bfloat16).float())
        self.eval()

    def forward(self, model: torch.nn.Module, hidden: torch.Tensor, next_ids: torch.Tensor,
                layer_kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [T, vocab] of rows (hidden [T, H]: the model's final hidden states, next_ids [T]:
        the token after each), the decoder layer run with `layer_kwargs` (the model's own position
        embeddings and mask for those positions, `layer_inputs`), and the state a further draft
        takes as its hidden state: the normed output, as the model's own."""
        e = self.pre_fc_norm_embedding(model.model.embed_tokens(next_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        out = self.norm(self.layers[0](x[None], **layer_kwargs)[0])
        return model.lm_head(out).float(), out

    def layer_inputs(self, model: torch.nn.Module, ids: list[int]) -> tuple[torch.Tensor, dict]:
        """The model's final hidden states [T, H] over `ids` and the keyword arguments (position
        embeddings, attention mask) that its full-attention layer took there."""
        taken = {}

        def take(_module, _args, kwargs):
            taken.update({k: kwargs[k] for k in ("position_embeddings", "attention_mask") if k in kwargs})

        hook = model.model.layers[self.full].register_forward_pre_hook(take, with_kwargs=True)
        try:
            hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
        finally:
            hook.remove()
        return hidden, taken


def save_hybrid_checkpoint(model: torch.nn.Module, directory: Path, layout: str, nested: bool = False,
                           mtp: QwenMtpHead | None = None) -> Path:
    """layout 'fused' (experts.gate_up_proj [E, 2I, H]) or 'per_expert'; `nested`: Qwen3.5 as the
    image-text model's language model; `mtp`: its multi-token-prediction head under `mtp.` (the
    config's `mtp_num_hidden_layers` 1). With config.json and tokenizer.json (hf_tokenizer.py)."""
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if mtp is not None:
        state |= {f"mtp.{k}": v.detach().to(torch.bfloat16).contiguous() for k, v in mtp.state_dict().items()}
    state = expert_layout(state, layout)
    config = model.config.to_dict() | ({"mtp_num_hidden_layers": 1} if mtp is not None else {})
    if nested:
        state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                 for k, v in state.items()}
        config = {"model_type": "qwen3_5_moe", "tie_word_embeddings": False, "text_config": config}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    save_tokenizer(directory)
    return directory

