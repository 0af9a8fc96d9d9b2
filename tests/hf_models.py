"""Tiny random Qwen3-MoE models built with transformers, saved as checkpoints in every layout ftc reads.

Random routers are near-uniform, so top-k choices sit on near-ties that bf16 rounding flips. The
router and the norm weights are scaled up, which makes the top-k choices and the greedy tokens stable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from hf_tokenizer import save_tokenizer


@dataclass(frozen=True)
class TinyShape:
    hidden: int = 64
    intermediate: int = 32
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    experts: int = 8
    top_k: int = 2
    vocab: int = 320
    norm_topk_prob: bool = True
    mlp_only_layers: tuple[int, ...] = ()
    dense_intermediate: int = 96
    tie_embeddings: bool = False


def build_model(shape: TinyShape, seed: int) -> Qwen3MoeForCausalLM:
    cfg = Qwen3MoeConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.dense_intermediate,
        moe_intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        num_experts=shape.experts, num_experts_per_tok=shape.top_k, norm_topk_prob=shape.norm_topk_prob,
        mlp_only_layers=list(shape.mlp_only_layers), max_position_embeddings=1024,
        tie_word_embeddings=shape.tie_embeddings, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.08, attn_implementation="eager")
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(12.0)  # decisive routing
            elif "norm" in name:
                p.copy_(1.0 + 0.5 * torch.rand_like(p))
            elif name == "lm_head.weight" or (shape.tie_embeddings and "embed_tokens" in name):
                p.mul_(4.0)  # decisive greedy tokens
        # The checkpoint is bf16; the reference runs those same bf16 values in fp32. Only the
        # parameters are rounded: `model.to(bf16)` would also round the RoPE frequency buffer.
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model.eval()


def save_checkpoint(model: Qwen3MoeForCausalLM, directory: Path, layout: str, shards: int,
                    dtype: torch.dtype = torch.bfloat16) -> Path:
    """layout 'fused' (experts.gate_up_proj [E, 2I, H]) or 'per_expert'; shards ≥ 1. With config.json and
    tokenizer.json (hf_tokenizer.py)."""
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = expert_layout(state, layout)
    names = sorted(state)
    if shards == 1:
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for s in range(shards):
            part = names[s::shards]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: state[k] for k in part}, str(directory / fname), metadata={"format": "pt"})
            weight_map |= {k: fname for k in part}
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model.config.save_pretrained(directory)
    save_tokenizer(directory)
    return directory


def expert_layout(state: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """transformers' fused experts (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`) as they
    are ('fused') or split into per-expert `experts.J.{gate,up,down}_proj.weight` ('per_expert')."""
    if layout == "fused":
        return state
    if layout != "per_expert":
        raise ValueError(layout)
    for name in [k for k in state if k.endswith("mlp.experts.gate_up_proj")]:
        prefix = name[: -len("gate_up_proj")]
        gate_up, down = state.pop(name), state.pop(prefix + "down_proj")
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            state[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :inter].clone()
            state[f"{prefix}{e}.up_proj.weight"] = gate_up[e, inter:].clone()
            state[f"{prefix}{e}.down_proj.weight"] = down[e].clone()
    return state

