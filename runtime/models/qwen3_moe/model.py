"""Qwen3-MoE decoder in torch: embedding, RMSNorm, GQA attention with q/k norm and RoPE,
softmax top-k router; the routed experts run on an `ExpertBackend` (the generated kernels).

Tensor names follow the HF checkpoint (`model.layers.L.self_attn.q_proj.weight`, ...), so that
`dense.safetensors` is the checkpoint minus its experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ftc_runtime.cache.kv import KVCache
from ftc_runtime.experts.base import ExpertBackend
from ftc_runtime.spec import ModelSpec


def end_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The embedding, the final norm and (untied) the LM head, by checkpoint name."""
    h = spec.hidden_size
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def mlp_tensor_shapes(prefix: str, intermediate: int, hidden: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP's gate, up and down projections under `prefix` (e.g. `model.layers.3.mlp.`)."""
    return {prefix + "gate_proj.weight": (intermediate, hidden), prefix + "up_proj.weight": (intermediate, hidden),
            prefix + "down_proj.weight": (hidden, intermediate)}


def dense_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every non-expert tensor of the model, by checkpoint name, with its shape."""
    a, m, h = spec.attention, spec.moe, spec.hidden_size
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    shapes = end_tensor_shapes(spec)
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
            shapes |= mlp_tensor_shapes(p + "mlp.", m.dense_intermediate_size, h)
    return shapes


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalized in fp32 whatever the activation dtype, as the reference does."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """float64 inverse frequencies of the rotated part of a head (`partial_rotary_factor`)."""
    rot = int(spec.attention.head_dim * spec.rope.partial_rotary_factor) // 2 * 2
    return 1.0 / (spec.rope.theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n, 1, rotary dim] of the given positions."""
    freqs = positions[:, None].double() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rotated = x[..., :r] * cos + rotate_half(x[..., :r]) * sin
    return torch.cat((rotated, x[..., r:]), dim=-1)


# The two halves of a layer around its KV cache, as functions of tensors only (no layer index),
# so that the eager path and the CUDA graphs of decode (`DecodeGraphs`) run the same code, and
# torch.compile sees one function for all layers.

def attention_in(x: torch.Tensor, norm_w: torch.Tensor, qkv_w: torch.Tensor, qkv_b: torch.Tensor | None,
                 q_norm_w: torch.Tensor | None, k_norm_w: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float, heads: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input norm, fused q/k/v projection, q/k norms and RoPE: q [T, heads, d], k and v [T, kv, d]."""
    n_q, n_kv, d = heads
    t = x.shape[0]
    qkv = F.linear(rms_norm(x, norm_w, eps), qkv_w, qkv_b)
    q, k, v = qkv.split((n_q * d, n_kv * d, n_kv * d), dim=-1)
    q, k, v = q.view(t, n_q, d), k.view(t, n_kv, d), v.view(t, n_kv, d)
    if q_norm_w is not None:
        q, k = rms_norm(q, q_norm_w, eps), rms_norm(k, k_norm_w, eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention_out(x: torch.Tensor, attn: torch.Tensor, o_w: torch.Tensor, o_b: torch.Tensor | None,
                  norm_w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Output projection and residual, then the post-attention norm: (x, normalized x)."""
    x = x + F.linear(attn, o_w, o_b)
    return x, rms_norm(x, norm_w, eps)


def route(h: torch.Tensor, gate_w: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k router: expert ids [T, k] and fp32 weights [T, k]."""
    probs = torch.softmax(F.linear(h, gate_w), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None,
                     heads: tuple[int, int, int]) -> torch.Tensor:
    """One query q [1, heads, d] over keys/values [C, kv, d] (`valid` bool [C] marks the keys it
    may see; None: all): [1, heads · d]. Decode passes the cache's whole storage with the tail
    masked off, so that the shapes stay fixed for CUDA graphs. The query heads of one KV head form its rows, so two
    batched matmuls do it: SDPA's backend choice costs more than the work here (its cuDNN backend
    built a graph per new key length, 1.6 ms of host time per layer and token on the device)."""
    n_q, n_kv, d = heads
    scores = torch.matmul(q.view(n_kv, n_q // n_kv, d), keys.permute(1, 2, 0)) * d ** -0.5
    if valid is not None:
        scores = scores.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    return torch.matmul(probs, values.transpose(0, 1)).reshape(1, n_q * d)


def cached_attention(cache: KVCache, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     heads: tuple[int, int, int]) -> torch.Tensor:
    """Appends k/v [T, kv, d] to the cache's `layer` and attends q [T, heads, d] causally over all
    its tokens: [T, heads · d]."""
    n_q, n_kv, d = heads
    t = q.shape[0]
    keys, values = cache.append(layer, k, v)
    if t == 1:  # over the whole storage, tail masked: the very kernels that decode graphs replay
        stored_k, stored_v = cache.storage(layer)
        valid = torch.arange(stored_k.shape[0], device=q.device) < keys.shape[0]
        return decode_attention(q, stored_k, stored_v, valid, heads)
    q, keys, values = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    # Queries after cached tokens need the lower-right causal mask (is_causal means top-left); the
    # library bias keeps the flash kernel on CUDA, where a boolean mask would fall back to the
    # math kernel and materialize [heads, T, S] scores.
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=causal_lower_right(t, keys.shape[2]),
                                         enable_gqa=n_q != n_kv)
    return out[0].transpose(0, 1).reshape(t, -1)


def dense_mlp(h: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(h, gate_w)) * F.linear(h, up_w), down_w)


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

    def new_cache(self) -> KVCache:
        a = self.spec.attention
        return KVCache(self.spec.num_layers, a.num_kv_heads, a.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, all_logits: bool = False,
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
        self.experts.begin_pass(ids.numel())
        cos, sin = self.rope(start, ids.numel())
        x = self.embed[ids.to(self.device)].to(self.dtype)
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
    def decode_batch(self, tokens: list[int], caches: list[KVCache]) -> torch.Tensor:
        """One new token for each of several sequences, each after its own cache's tokens: logits
        [B, vocab] fp32. The projections, router, experts and head run once over the batch (the
        experts of B tokens as one call); attention runs per sequence over its own cache."""
        if len(tokens) != len(caches) or not tokens:
            raise ValueError(f"decode_batch: {len(tokens)} tokens for {len(caches)} caches")
        if len(tokens) == 1:
            return self.forward(torch.tensor(tokens), caches[0])
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

    def attend(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return cached_attention(cache, i, q, k, v, self.heads)

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
