"""Qwen3-MoE decoder in torch: embedding, RMSNorm, GQA attention with q/k norm and RoPE,
softmax top-k router; the routed experts run on an `ExpertBackend` (the generated kernels).

Tensor names follow the HF checkpoint (`model.layers.L.self_attn.q_proj.weight`, ...), so that
`dense.safetensors` is the checkpoint minus its experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ftc_runtime.cache.kv import KVCache
from ftc_runtime.cache.sequence import SequenceCache
from ftc_runtime.experts.base import ExpertBackend
from ftc_runtime.models.batch_decode import BatchDecode
from ftc_runtime.models.layers.attention import attention_in, attention_out, cached_attention
from ftc_runtime.models.layers.mlp import dense_mlp
from ftc_runtime.models.layers.norm import rms_norm
from ftc_runtime.models.layers.rope import rope_cos_sin, rope_inv_freq
from ftc_runtime.models.layers.router import route
from ftc_runtime.spec import ModelSpec


class Qwen3MoeModel(BatchDecode):
    """One sequence at a time, on `device`: fp32 activations on the CPU, bf16 on a GPU."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], experts: ExpertBackend,
                 device: torch.device | str = "cpu"):
        self.spec = spec
        self.experts = experts
        self.device = torch.device(device)
        self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        # The embedding stays in its stored dtype: only the looked-up rows are converted.
        self.embed = weights["model.embed_tokens.weight"].to(self.device)
        self.w = {k: v.to(self.device, self.dtype) for k, v in weights.items() if k != "model.embed_tokens.weight"}
        self._fuse_qkv()
        self.lm_head = self.embed.to(self.dtype) if spec.tie_word_embeddings else self.w["lm_head.weight"]
        self.moe_index = {layer: i for i, layer in enumerate(spec.moe_layers)}
        a = spec.attention
        self.heads = (a.num_heads, a.num_kv_heads, a.head_dim)
        self.inv_freq = rope_inv_freq(spec).to(self.device)
        self.decode_graphs = None  # DecodeGraphs, set by the engine on a GPU

    def _fuse_qkv(self) -> None:
        """One q/k/v projection per layer instead of three (one GEMV per decode step)."""
        for i in range(self.spec.num_layers):
            p = f"model.layers.{i}.self_attn."
            for kind in ("weight", "bias"):
                parts = [self.w.pop(f"{p}{n}_proj.{kind}", None) for n in "qkv"]
                if parts[0] is not None:
                    self.w[f"{p}qkv_proj.{kind}"] = torch.cat(parts)

    def new_cache(self) -> SequenceCache:
        a = self.spec.attention
        return SequenceCache(KVCache(self.spec.num_layers, a.num_kv_heads, a.head_dim, self.dtype, self.device))

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: SequenceCache, all_logits: bool = False,
                checkpoint_at: tuple[int, ...] = (), between_layers: Callable[[], None] | None = None) -> torch.Tensor:
        """Runs `ids` (1-D) after the cache's tokens; returns logits [T or 1, vocab] in fp32.
        `checkpoint_at` is the hybrid models' (`Qwen3NextModel.forward`): this one keeps no
        recurrent state, so there is nothing to take. `between_layers` is called after each layer
        and may raise to abandon the pass (the cache's length then stays where it was)."""
        if checkpoint_at:
            raise ValueError(f"{self.spec.family} has no recurrent state to checkpoint")
        if self.decode_graphs is not None and ids.numel() == 1:
            return self.decode_graphs.step(ids, cache)
        start = cache.length
        # Before the pass queues its expert copies: a host→device copy waits for those queued before it.
        x = self.embed[ids.to(self.device)].to(self.dtype)
        self.experts.begin_pass(ids.numel())
        cos, sin = self.rope(start, ids.numel())
        for i in range(self.spec.num_layers):
            q, k, v = attention_in(x, *self.attention_in_weights(i), cos, sin, self.spec.norm.eps, self.heads)
            x, h = attention_out(x, self.attend(i, q, k, v, cache), *self.attention_out_weights(i),
                                 self.spec.norm.eps)
            x = x + self.mlp(i, h, start)
            if between_layers is not None:
                between_layers()
        cache.length = start + ids.numel()
        if not all_logits:
            x = x[-1:]
        return self.head(x)

    @torch.inference_mode()
    def _eager_batch(self, tokens: list[int], caches: list[SequenceCache]) -> torch.Tensor:
        """The projections, router, experts and head run once over the batch (the experts of B
        tokens as one call); attention runs per sequence over its own cache."""
        positions = [c.length for c in caches]
        self.experts.begin_pass(len(tokens), prompt=False)
        cos, sin = self.rope_at(torch.tensor(positions, device=self.device))
        x = self.embed[torch.tensor(tokens, device=self.device)].to(self.dtype)
        eps = self.spec.norm.eps
        for i in range(self.spec.num_layers):
            q, k, v = attention_in(x, *self.attention_in_weights(i), cos, sin, eps, self.heads)
            attn = torch.cat([self.attend(i, q[j:j + 1], k[j:j + 1], v[j:j + 1], c) for j, c in enumerate(caches)])
            x, h = attention_out(x, attn, *self.attention_out_weights(i), eps)
            x = x + self.mlp(i, h, positions[0])  # routing hooks see one position per call: not for batches
        for c in caches:
            c.length += 1
        return self.head(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(rms_norm(x, self.w["model.norm.weight"], self.spec.norm.eps), self.lm_head).float()

    def rope(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n, 1, rotary dim] of positions start .. start+n-1."""
        return self.rope_at(torch.arange(start, start + n, device=self.device))

    def rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.inv_freq, positions, self.dtype)

    def attention_in_weights(self, i: int) -> tuple:
        p = f"model.layers.{i}."
        return (self.w[p + "input_layernorm.weight"], self.w[p + "self_attn.qkv_proj.weight"],
                self.w.get(p + "self_attn.qkv_proj.bias"), self.w.get(p + "self_attn.q_norm.weight"),
                self.w.get(p + "self_attn.k_norm.weight"))

    def attention_out_weights(self, i: int) -> tuple:
        p = f"model.layers.{i}."
        return (self.w[p + "self_attn.o_proj.weight"], self.w.get(p + "self_attn.o_proj.bias"),
                self.w[p + "post_attention_layernorm.weight"])

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: SequenceCache) -> torch.Tensor:
        return cached_attention(cache.kv, i, q, k, v, self.heads)

    def is_moe(self, i: int) -> bool:
        return i in self.moe_index

    def router_args(self, i: int) -> tuple:
        """`route`'s arguments after h: gate weight, top-k, renormalize."""
        m = self.spec.moe
        return self.w[f"model.layers.{i}.mlp.gate.weight"], m.top_k, m.norm_topk_prob

    def router(self, i: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(h, *self.router_args(i))

    def routed_experts(self, i: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       first_position: int) -> torch.Tensor:
        return self.experts.forward(self.moe_index[i], h.float(), ids, weights, first_position).to(self.dtype)

    def dense_mlp_weights(self, i: int) -> tuple:
        p = f"model.layers.{i}.mlp."
        return self.w[p + "gate_proj.weight"], self.w[p + "up_proj.weight"], self.w[p + "down_proj.weight"]

    def mlp(self, i: int, h: torch.Tensor, first_position: int) -> torch.Tensor:
        if self.is_moe(i):
            return self.routed_experts(i, h, *self.router(i, h), first_position)
        return dense_mlp(h, *self.dense_mlp_weights(i))
