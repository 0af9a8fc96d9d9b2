"""GLM-5.x (transformers' glm_moe_dsa) decoder in torch: multi-head latent attention whose cache is
one latent row per token, made sparse by the DSA indexer (each query attends to the `top_k`
cached tokens it scores highest; "shared" layers reuse the previous full layer's choice); dense
SwiGLU MLPs in the first layers, then the sigmoid-routed experts on an `ExpertBackend` beside one
shared expert.

Tensor names follow the HF checkpoint (`model.layers.L.self_attn.q_a_proj.weight`, ...).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ftc_runtime.cache.kv import KVCache
from ftc_runtime.cache.sequence import SequenceCache
from ftc_runtime.experts.base import ExpertBackend
from ftc_runtime.models.batch_decode import BatchDecode
from ftc_runtime.models.glm_moe_dsa.loader import indexes
from ftc_runtime.models.layers.dsa_indexer import (
    IndexerShape,
    index_scores,
    indexer_keys,
    select_key_indices,
    select_keys,
)
from ftc_runtime.models.layers.fp8_linear import BlockFp8, linear
from ftc_runtime.models.layers.mla import MlaShape, attend_cached, mla_in
from ftc_runtime.models.layers.mlp import dense_mlp
from ftc_runtime.models.layers.norm import rms_norm
from ftc_runtime.models.layers.rope import rope_cos_sin, rope_inv_freq
from ftc_runtime.models.layers.sigmoid_router import route_sigmoid
from ftc_runtime.spec import ModelSpec

# Kept in fp32 on every device, as transformers keeps them: sigmoid scores of many experts differ in
# their last bits, and the indexer's head weights scale fp32 scores.
FP32_TENSORS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")
QUERY_BLOCK = 256  # queries of a prompt chunk whose attention scores are held at once
# The keys the queries of a layer saw: a mask [T, tokens], or one token's chosen columns and flags.
Visible = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class GlmMoeDsaModel(BatchDecode):
    """One sequence at a time (or several decoding together), on `device`: fp32 activations on the
    CPU, bf16 on a GPU."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], experts: ExpertBackend,
                 device: torch.device | str = "cpu"):
        self.spec, self.experts, self.device = spec, experts, torch.device(device)
        self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.embed = weights["model.embed_tokens.weight"].to(self.device)
        self.w = {k: self._placed(k, v) for k, v in weights.items() if k != "model.embed_tokens.weight"}
        self.lm_head = self.embed.to(self.dtype) if spec.tie_word_embeddings else self.w["lm_head.weight"]
        self.moe_index = {layer: i for i, layer in enumerate(spec.expert_layers)}  # its pool layer
        a, ml, ix = spec.attention, spec.mla, spec.indexer
        scale = ml.softmax_scale or a.head_dim ** -0.5
        self.mla = MlaShape(a.num_heads, ml.q_lora_rank, ml.kv_lora_rank, ml.nope_dim, ml.rope_dim, ml.v_dim,
                            1e-6, scale)
        self.indexer = None if ix is None else IndexerShape(ix.num_heads, ix.head_dim, ml.rope_dim, ix.top_k)
        self.inv_freq = rope_inv_freq(spec).to(self.device)
        self.decode_graphs = None  # LatentDecodeGraphs, set by the engine on a GPU

    def _placed(self, name: str, w: torch.Tensor | BlockFp8) -> torch.Tensor | BlockFp8:
        """Weight `name` on the model's device: FP8 blocks as stored, the rest in the activations'
        dtype (fp32 where transformers keeps fp32)."""
        if isinstance(w, BlockFp8):
            return w.to(self.device)
        return w.to(self.device, torch.float32 if name.endswith(FP32_TENSORS) else self.dtype)

    def new_cache(self, layers: int | None = None) -> SequenceCache:
        """Per layer and token the latent row and the shared rotary key (as the cache's keys) and
        the indexer's key (as its values; zeros in layers that reuse another layer's choice).
        `layers`: that many (the next-n layers' own cache), else the model's."""
        ml = self.spec.mla
        index_dim = self.indexer.head_dim if self.indexer is not None else 1
        return SequenceCache(KVCache(layers or self.spec.num_layers, 1, ml.kv_lora_rank + ml.rope_dim, self.dtype,
                                     self.device, value_dim=index_dim))

    def new_mtp_cache(self) -> SequenceCache:
        return self.new_cache(self.spec.mtp_layers)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: SequenceCache, all_logits: bool = False,
                checkpoint_at: tuple[int, ...] = (), between_layers: Callable[[], None] | None = None,
                hidden: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Runs `ids` (1-D) after the cache's tokens; returns logits [T or 1, vocab] in fp32.
        `between_layers` is called after each layer and may raise to abandon the pass (the
        cache's length then stays where it was). `hidden`: every position's final hidden state
        (after the last norm, [T, hidden]) is appended to it (the next-n layer's input)."""
        if checkpoint_at:
            raise ValueError(f"{self.spec.family} has no recurrent state to checkpoint")
        if self.decode_graphs is not None and ids.numel() == 1 and hidden is None:
            return self.decode_graphs.step(ids, cache)
        start, n = cache.length, ids.numel()
        # Before the pass queues its expert copies: a host→device copy waits for those queued before it.
        x = self.embed[ids.to(self.device)].to(self.dtype)
        self.experts.begin_pass(n)
        positions = torch.arange(start, start + n, device=self.device)
        cos, sin = self.rope_at(positions)
        visible = None
        for i in range(self.spec.num_layers):
            h = rms_norm(x, self.w[f"model.layers.{i}.input_layernorm.weight"], self.spec.norm.eps)
            out, visible = self.attention(i, h, cos, sin, positions, cache, visible)
            x = x + out
            x = x + self.mlp(i, rms_norm(x, self.w[f"model.layers.{i}.post_attention_layernorm.weight"],
                                         self.spec.norm.eps), start)
            if between_layers is not None:
                between_layers()
        cache.length = start + n
        final = self.final_norm(x if all_logits or hidden is not None else x[-1:])
        if hidden is not None:
            hidden.append(final)
        return F.linear(final if all_logits else final[-1:], self.lm_head).float()

    @torch.inference_mode()
    def mtp_forward(self, hidden: torch.Tensor, ids: torch.Tensor, cache: SequenceCache,
                    start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next-n layer over T positions after `cache`'s, the first at sequence position
        `start`: row t joins the final hidden state there (`hidden` [T, hidden]) with the embedding
        of the token after it (`ids` [T]; zeros at position 0, as the layer was trained) and
        predicts the token after that. Returns (logits [T, vocab] fp32, its output [T, hidden]
        before the head's norm, the hidden state a further draft starts from). Its keys and values
        are rows of its own cache, positions counted from its first (RoPE sees only differences)."""
        i, w, eps, t = self.spec.num_layers, self.w, self.spec.norm.eps, ids.numel()
        p = f"model.layers.{i}."
        embedded = self.embed[ids.to(self.device)].to(self.dtype)
        embedded[torch.arange(start, start + t, device=self.device) == 0] = 0
        x = F.linear(torch.cat([rms_norm(embedded, w[p + "enorm.weight"], eps),
                                rms_norm(hidden.to(self.dtype), w[p + "hnorm.weight"], eps)], dim=-1),
                     w[p + "eh_proj.weight"])
        self.experts.begin_pass(t, prompt=False)
        positions = torch.arange(cache.length, cache.length + t, device=self.device)
        cos, sin = self.rope_at(positions)
        out, _ = self.attention(i, rms_norm(x, w[p + "input_layernorm.weight"], eps), cos, sin, positions, cache, None)
        x = x + out
        x = x + self.mlp(i, rms_norm(x, w[p + "post_attention_layernorm.weight"], eps), start)
        cache.length += t
        return F.linear(rms_norm(x, w[p + "shared_head.norm.weight"], eps), self.lm_head).float(), x

    @torch.inference_mode()
    def _eager_batch(self, tokens: list[int], caches: list[SequenceCache]) -> torch.Tensor:
        """Projections, router, experts and head run once over the batch; attention runs per
        sequence over its own cache."""
        positions = torch.tensor([c.length for c in caches], device=self.device)
        self.experts.begin_pass(len(tokens), prompt=False)
        cos, sin = self.rope_at(positions)
        x = self.embed[torch.tensor(tokens, device=self.device)].to(self.dtype)
        chosen: list[Visible | None] = [None] * len(caches)
        for i in range(self.spec.num_layers):
            h = rms_norm(x, self.w[f"model.layers.{i}.input_layernorm.weight"], self.spec.norm.eps)
            rows = []
            for j, cache in enumerate(caches):
                row, chosen[j] = self.attention(i, h[j:j + 1], cos[j:j + 1], sin[j:j + 1], positions[j:j + 1],
                                                cache, chosen[j])
                rows.append(row)
            x = x + torch.cat(rows)
            x = x + self.mlp(i, rms_norm(x, self.w[f"model.layers.{i}.post_attention_layernorm.weight"],
                                         self.spec.norm.eps), int(positions[0]))
        for c in caches:
            c.length += 1
        return self.head(x)

    def attention(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  cache: SequenceCache, visible: Visible | None) -> tuple[torch.Tensor, Visible]:
        """Layer i's latent attention of h [T, hidden] at `positions`, its latent rows appended to
        the cache: (output [T, hidden], the keys each query saw, which the next "shared" layer
        reuses: bool [T, tokens so far], or for one token with an indexer the chosen keys'
        columns and which of them it sees, [1, top_k] each, its attention reading those rows
        alone however long the context)."""
        p = f"model.layers.{i}.self_attn."
        w = self.w
        q_nope, q_rope, latent, k_rope, q_resid = mla_in(
            h, w[p + "q_a_proj.weight"], w[p + "q_a_layernorm.weight"], w[p + "q_b_proj.weight"],
            w[p + "kv_a_proj_with_mqa.weight"], w[p + "kv_a_layernorm.weight"], cos, sin, self.mla)
        full = self.indexer is not None and indexes(self.spec, i)
        layer = i if i < self.spec.num_layers else i - self.spec.num_layers  # a next-n layer: its own cache's
        index_key = (indexer_keys(h, w[p + "indexer.wk.weight"], w[p + "indexer.k_norm.weight"],
                                  w[p + "indexer.k_norm.bias"], cos, sin, self.indexer) if full
                     else h.new_zeros(h.shape[0], cache.kv.storage(layer)[1].shape[-1]))
        rows, index_keys = cache.kv.append(layer, torch.cat([latent, k_rope], dim=-1)[:, None], index_key[:, None])
        if h.shape[0] == 1 and self.indexer is not None:
            if full:
                scores = index_scores(h, q_resid, w[p + "indexer.wq_b.weight"], w[p + "indexer.weights_proj.weight"],
                                      index_keys[:, 0], cos, sin, self.indexer)
                visible = select_key_indices(scores, positions, self.indexer.top_k)
            out = attend_cached(q_nope, q_rope, rows[:, 0], w[p + "kv_b_proj.weight"], visible, self.mla)
            return linear(out, w[p + "o_proj.weight"]), visible
        outs, seen = [], []
        # In blocks of queries: the scores of a block are [heads, block, tokens so far], not of the whole prompt.
        for b in range(0, h.shape[0], QUERY_BLOCK):
            q = slice(b, b + QUERY_BLOCK)
            if full:
                scores = index_scores(h[q], q_resid[q], w[p + "indexer.wq_b.weight"],
                                      w[p + "indexer.weights_proj.weight"], index_keys[:, 0], cos[q], sin[q],
                                      self.indexer)
                seen.append(select_keys(scores, positions[q], self.indexer.top_k))
            elif self.indexer is None:
                seen.append(torch.arange(rows.shape[0], device=h.device)[None, :] <= positions[q, None])
            else:
                seen.append(visible[q])
            outs.append(attend_cached(q_nope[q], q_rope[q], rows[:, 0], w[p + "kv_b_proj.weight"], seen[-1],
                                      self.mla))
        out, visible = torch.cat(outs), torch.cat(seen)
        return linear(out, w[p + "o_proj.weight"]), visible

    def mlp(self, i: int, h: torch.Tensor, first_position: int) -> torch.Tensor:
        p = f"model.layers.{i}.mlp."
        if i not in self.moe_index:
            return dense_mlp(h, *self.mlp_weights(p))
        m = self.spec.moe
        ids, weights = route_sigmoid(h, self.w[p + "gate.weight"], self.w[p + "gate.e_score_correction_bias"],
                                     m.top_k, m.n_group, m.topk_group, m.norm_topk_prob, m.routed_scaling_factor)
        out = self.experts.forward(self.moe_index[i], h.float(), ids, weights, first_position).to(self.dtype)
        if m.num_shared_experts:
            out = out + dense_mlp(h, *self.mlp_weights(p + "shared_experts."))
        return out

    def mlp_weights(self, prefix: str) -> tuple[torch.Tensor, ...]:
        """A SwiGLU MLP's gate, up and down weights under `prefix` (a dense layer's or the shared expert's)."""
        return tuple(self.w[f"{prefix}{n}_proj.weight"] for n in ("gate", "up", "down"))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.final_norm(x), self.lm_head).float()

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.w["model.norm.weight"], self.spec.norm.eps)

    def rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.inv_freq, positions, self.dtype)

    def is_moe(self, i: int) -> bool:
        return i in self.moe_index
