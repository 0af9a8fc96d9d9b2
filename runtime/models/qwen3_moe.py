"""Qwen3-MoE decoder in torch: embedding, RMSNorm, GQA attention with q/k norm and RoPE,
softmax top-k router; the routed experts run on an `ExpertBackend` (the generated kernels).

Tensor names follow the HF checkpoint (`model.layers.L.self_attn.q_proj.weight`, ...), so that
`dense.safetensors` is the checkpoint minus its experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..experts import ExpertBackend
from ..kv_cache import KVCache
from ..spec import ModelSpec


def dense_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every non-expert tensor of the model, by checkpoint name, with its shape."""
    a, m, h = spec.attention, spec.moe, spec.hidden_size
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    moe_layers = set(spec.moe_layers)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)}
        if a.bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (h,)}
        if a.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (a.head_dim,), p + "self_attn.k_norm.weight": (a.head_dim,)}
        if i in moe_layers:
            shapes[p + "mlp.gate.weight"] = (m.num_experts, h)
        else:
            d = m.dense_intermediate_size
            shapes |= {p + "mlp.gate_proj.weight": (d, h), p + "mlp.up_proj.weight": (d, h),
                       p + "mlp.down_proj.weight": (h, d)}
    return shapes


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalized in fp32 whatever the activation dtype, as the reference does."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Qwen3MoeModel:
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
        self.lm_head = self.embed.to(self.dtype) if spec.tie_word_embeddings else self.w["lm_head.weight"]
        self.moe_index = {layer: i for i, layer in enumerate(spec.moe_layers)}
        # Benchmarks may observe or replace the router's choice (routing_trace.TraceReplay/Recorder).
        self.routing = None
        self._positions = torch.empty(0, dtype=torch.long)
        a = spec.attention
        rot = int(a.head_dim * spec.rope.partial_rotary_factor) // 2 * 2
        self.rot_dim = rot
        self.inv_freq = 1.0 / (spec.rope.theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
        self.inv_freq = self.inv_freq.to(self.device)

    def new_cache(self) -> KVCache:
        a = self.spec.attention
        return KVCache(self.spec.num_layers, a.num_kv_heads, a.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Runs `ids` (1-D) after the cache's tokens; returns logits [T or 1, vocab] in fp32."""
        start = cache.length
        ids = ids.to(self.device)
        positions = torch.arange(start, start + ids.numel(), device=self.device)
        self._positions = positions
        cos, sin = self._rope(positions)
        x = self.embed[ids].to(self.dtype)
        eps = self.spec.norm.eps
        for i in range(self.spec.num_layers):
            p = f"model.layers.{i}."
            x = x + self._attention(i, rms_norm(x, self.w[p + "input_layernorm.weight"], eps), cache, cos, sin)
            h = rms_norm(x, self.w[p + "post_attention_layernorm.weight"], eps)
            x = x + (self._moe(i, h) if i in self.moe_index else self._dense_mlp(i, h))
        cache.length = start + ids.numel()
        if not all_logits:
            x = x[-1:]
        x = rms_norm(x, self.w["model.norm.weight"], eps)
        return F.linear(x, self.lm_head).float()

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].double() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _attention(self, i: int, x: torch.Tensor, cache: KVCache, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
        a, p, t = self.spec.attention, f"model.layers.{i}.self_attn.", x.shape[0]
        q = self._linear(x, p + "q_proj").view(t, a.num_heads, a.head_dim)
        k = self._linear(x, p + "k_proj").view(t, a.num_kv_heads, a.head_dim)
        v = self._linear(x, p + "v_proj").view(t, a.num_kv_heads, a.head_dim)
        if a.qk_norm:
            q = rms_norm(q, self.w[p + "q_norm.weight"], self.spec.norm.eps)
            k = rms_norm(k, self.w[p + "k_norm.weight"], self.spec.norm.eps)
        q, k = self._apply_rope(q, cos, sin), self._apply_rope(k, cos, sin)
        keys, values = cache.append(i, k, v)
        start = keys.shape[0] - t
        mask = None
        if t > 1:
            mask = (torch.arange(keys.shape[0], device=self.device)[None, :]
                    <= (start + torch.arange(t, device=self.device))[:, None])
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
                                             attn_mask=mask, enable_gqa=a.num_heads != a.num_kv_heads)
        return self._linear(out.transpose(0, 1).reshape(t, -1), p + "o_proj")

    def _apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rot_dim
        if r == x.shape[-1]:
            return x * cos + rotate_half(x) * sin
        rotated = x[..., :r] * cos + rotate_half(x[..., :r]) * sin
        return torch.cat((rotated, x[..., r:]), dim=-1)

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        m = self.spec.moe
        logits = F.linear(x, self.w[f"model.layers.{i}.mlp.gate.weight"])
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, m.top_k, dim=-1)
        if m.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routing is not None:
            ids, weights = self.routing.route(self.moe_index[i], self._positions, ids, weights)
        return self.experts.forward(self.moe_index[i], x.float(), ids, weights).to(self.dtype)

    def _dense_mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.mlp."
        return self._linear(F.silu(self._linear(x, p + "gate_proj")) * self._linear(x, p + "up_proj"),
                            p + "down_proj")
