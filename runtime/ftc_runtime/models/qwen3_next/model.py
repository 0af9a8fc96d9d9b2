"""The Qwen3-Next / Qwen3.5-MoE hybrid decoder in torch (families `qwen3_next`, `qwen3_5_moe`):
Gated DeltaNet layers and full-attention layers (three to one in the released models), (1 + w)
RMSNorms, partial RoPE, a sigmoid output gate on full attention, and a softmax top-k router over
the routed experts (an `ExpertBackend`) plus one shared expert behind a sigmoid gate, which is
dense and stays on the model's device.

Tensor names are the canonical HF ones under `model.layers.L.`, with the linear layers' split
projections (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`): the compiler maps Qwen3.5's
`model.language_model.` prefix and Qwen3-Next's grouped `in_proj_qkvz` / `in_proj_ba` onto them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ftc_runtime.cache.base import RecurrentCheckpoint
from ftc_runtime.cache.kv import KVCache
from ftc_runtime.cache.sequence import SequenceCache
from ftc_runtime.experts.base import ExpertBackend
from ftc_runtime.models.batch_decode import BatchDecode
from ftc_runtime.models.layers.attention import cached_attention
from ftc_runtime.models.layers.gated_attention import gated_attention_in, gated_attention_out
from ftc_runtime.models.layers.gated_deltanet import (
    DeltaNetShape,
    DeltaNetState,
    DeltaNetWeights,
    decode_step,
    gated_deltanet,
)
from ftc_runtime.models.layers.mlp import dense_mlp, shared_expert
from ftc_runtime.models.layers.norm import rms_norm
from ftc_runtime.models.layers.rope import rope_cos_sin, rope_inv_freq
from ftc_runtime.models.layers.router import route
from ftc_runtime.models.qwen3_next.loader import MTP_NORMS
from ftc_runtime.spec import ModelSpec

# (1 + w) norms: the stored weight is the offset from 1 (the linear layers' gated norm is plain w).
_ONE_PLUS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
             "self_attn.k_norm.weight", "model.norm.weight", *(f"mtp.{n}.weight" for n in MTP_NORMS))


# The projections that read one input, fused (`Qwen3NextModel._fuse_projections`): a linear layer's
# from its normalized input, full attention's q (with its gate), k and v, and from the post-attention
# norm the router's, then the shared expert's gate and its gate and up projections.
FUSED = (
    ("linear_attn.in_proj.weight", tuple(f"linear_attn.in_proj_{n}.weight" for n in ("qkv", "z", "b", "a"))),
    ("self_attn.qkv_proj.weight", tuple(f"self_attn.{n}_proj.weight" for n in "qkv")),
    ("mlp.in_proj.weight", ("mlp.gate.weight", "mlp.shared_expert_gate.weight", "mlp.shared_expert.gate_proj.weight",
                            "mlp.shared_expert.up_proj.weight")),
)


class Qwen3NextModel(BatchDecode):
    """Sequences on `device`: fp32 activations on the CPU, bf16 on a GPU; the Gated DeltaNet
    state stays fp32."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], experts: ExpertBackend,
                 device: torch.device | str = "cpu"):
        self.spec, self.experts = spec, experts
        self.device = torch.device(device)
        self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.embed = weights["model.embed_tokens.weight"].to(self.device)
        self.w = {}
        for name, t in weights.items():
            if name == "model.embed_tokens.weight":
                continue
            keep_fp32 = name.endswith(("A_log", "dt_bias"))  # the decay's parameters, as the reference
            t = t.to(self.device, torch.float32 if keep_fp32 else self.dtype)
            self.w[name] = 1.0 + t if name.endswith(_ONE_PLUS) else t
        self.lm_head = self.embed.to(self.dtype) if spec.tie_word_embeddings else self.w["lm_head.weight"]
        self.moe_index = {layer: i for i, layer in enumerate(spec.expert_layers)}  # its pool layer
        self.kv_index = {layer: i for i, layer in enumerate(spec.full_attention_layers)}
        self.linear_index = {layer: i for i, layer in enumerate(spec.linear_attention_layers)}
        self._fuse_projections()
        a = spec.attention
        self.heads = (a.num_heads, a.num_kv_heads, a.head_dim)
        self.inv_freq = rope_inv_freq(spec).to(self.device)
        la = spec.linear_attention
        self.delta_shape = None if la is None else DeltaNetShape(
            la.num_k_heads, la.num_v_heads, la.k_head_dim, la.v_head_dim, la.conv_kernel, spec.norm.eps)
        self.delta_weights = {i: self._delta_weights(i) for i in self.linear_index}
        self.decode_graphs = None  # HybridDecodeGraphs, set by the engine on a GPU

    def _fuse_projections(self) -> None:
        """Each group of projections of one input as one weight (`FUSED`), the parts kept as views
        of its rows: a decode step reads the group with one GEMV, the torch path the views."""
        for i in range(self.spec.num_layers + self.spec.mtp_layers):
            p = f"model.layers.{i}."
            for fused, parts in FUSED:
                names = [p + n for n in parts]
                if all(n in self.w for n in names):
                    self.w[p + fused] = torch.cat([self.w[n] for n in names])
                    rows = [self.w[n].shape[0] for n in names]
                    self.w.update(zip(names, self.w[p + fused].split(rows), strict=True))

    def fused_weight(self, i: int, name: str) -> torch.Tensor | None:
        """Layer i's fused projection `name` (a key of `FUSED`'s), None where the layer has none."""
        return self.w.get(f"model.layers.{i}.{name}")

    def _delta_weights(self, i: int) -> DeltaNetWeights:
        p = f"model.layers.{i}.linear_attn."
        return DeltaNetWeights(*(self.w[p + n] for n in (
            "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight",
            "dt_bias", "A_log", "norm.weight", "out_proj.weight")))

    def new_cache(self) -> SequenceCache:
        a = self.spec.attention
        kv = KVCache(len(self.kv_index), a.num_kv_heads, a.head_dim, self.dtype, self.device)
        return SequenceCache(kv, [DeltaNetState.zeros(self.delta_shape, self.dtype, self.device)
                                for _ in self.linear_index])

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: SequenceCache, all_logits: bool = False,
                checkpoint_at: tuple[int, ...] = (), between_layers: Callable[[], None] | None = None,
                hidden: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Runs `ids` (1-D) after the cache's tokens; returns logits [T or 1, vocab] in fp32.
        `checkpoint_at`: indices into ids (ascending) after which the linear layers' state goes
        into `cache.checkpoints`, taken within the chunk, which is not cut there. `between_layers`
        is called after each layer and may raise to abandon the pass (the linear layers' state is
        then part-way through the chunk: the sequence must end). `hidden`: every position's final
        hidden state (after the last norm, [T, hidden]) is appended to it (the MTP head's input)."""
        if self.decode_graphs is not None and ids.numel() == 1 and not checkpoint_at and hidden is None:
            return self.decode_graphs.step(ids, cache)
        start, n = cache.length, ids.numel()
        # Before the pass queues its expert copies: a host→device copy waits for those queued before it.
        x = self.embed[ids.to(self.device)].to(self.dtype)
        self.experts.begin_pass(n)
        cos, sin = self.rope_at(torch.arange(start, start + n, device=self.device))
        taken: list[list[DeltaNetState]] = []  # per linear layer, per checkpoint
        for i in range(self.spec.num_layers):
            h = rms_norm(x, self.w[f"model.layers.{i}.input_layernorm.weight"], self.spec.norm.eps)
            if i in self.linear_index:
                state = cache.linear[self.linear_index[i]]
                out, after, states = gated_deltanet(h, self.delta_weights[i], self.delta_shape, state, checkpoint_at)
                state.assign(after)
                taken.append(states)
                x = x + out
            else:
                x = x + self.full_attention(i, h, cos, sin, [cache])
            x = x + self.mlp(i, rms_norm(x, self.w[f"model.layers.{i}.post_attention_layernorm.weight"],
                                         self.spec.norm.eps), start)
            if between_layers is not None:
                between_layers()
        for c, at in enumerate(checkpoint_at):
            cache.checkpoints[start + at + 1] = RecurrentCheckpoint(start + at + 1, tuple(t[c] for t in taken))
        cache.length = start + n
        final = self.final_norm(x if all_logits or hidden is not None else x[-1:])
        if hidden is not None:
            hidden.append(final)
        return F.linear(final if all_logits else final[-1:], self.lm_head).float()

    @torch.inference_mode()
    def _eager_batch(self, tokens: list[int], caches: list[SequenceCache]) -> torch.Tensor:
        """Projections, router, experts and head run once over the batch; attention and the linear
        layers' recurrence run per sequence on its own state."""
        positions = [c.length for c in caches]
        self.experts.begin_pass(len(tokens), prompt=False)
        cos, sin = self.rope_at(torch.tensor(positions, device=self.device))
        x = self.embed[torch.tensor(tokens, device=self.device)].to(self.dtype)
        for i in range(self.spec.num_layers):
            h = rms_norm(x, self.w[f"model.layers.{i}.input_layernorm.weight"], self.spec.norm.eps)
            x = x + self.mix_batch(i, h, cos, sin, caches)
            x = x + self.mlp(i, rms_norm(x, self.w[f"model.layers.{i}.post_attention_layernorm.weight"],
                                         self.spec.norm.eps), positions[0])
        for c in caches:
            c.length += 1
        return self.head(x)

    def mix_batch(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  caches: list[SequenceCache]) -> torch.Tensor:
        """Layer i's token mixer over one token of each of T sequences (h [T, hidden], T caches)."""
        if i not in self.linear_index:
            return self.full_attention(i, h, cos, sin, caches)
        j = self.linear_index[i]
        return torch.cat([decode_step(row, self.delta_weights[i], self.delta_shape, cache.linear[j])
                          for row, cache in zip(h.split(1), caches, strict=True)])

    def full_attention(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       caches: list[SequenceCache]) -> torch.Tensor:
        q, k, v, gate = gated_attention_in(h, *self.attention_in_weights(i), cos, sin, self.spec.norm.eps,
                                           self.heads, self.spec.attention.output_gate)
        layer = self.kv_index.get(i, i - self.spec.num_layers)  # a multi-token-prediction layer: its own cache's
        if len(caches) == 1:
            attn = cached_attention(caches[0].kv, layer, q, k, v, self.heads)
        else:
            attn = torch.cat([cached_attention(c.kv, layer, q[j:j + 1], k[j:j + 1], v[j:j + 1], self.heads)
                              for j, c in enumerate(caches)])
        return gated_attention_out(attn, gate, self.w[f"model.layers.{i}.self_attn.o_proj.weight"])

    def attention_in_weights(self, i: int) -> tuple[torch.Tensor, ...]:
        p = f"model.layers.{i}.self_attn."
        return tuple(self.w[p + n] for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_norm.weight",
                                             "k_norm.weight"))

    def shared_expert_weights(self, i: int) -> tuple[torch.Tensor, ...]:
        p = f"model.layers.{i}.mlp.shared_expert"
        return tuple(self.w[p + n] for n in (".gate_proj.weight", ".up_proj.weight", ".down_proj.weight",
                                             "_gate.weight"))

    def is_moe(self, i: int) -> bool:
        return i in self.moe_index

    def router_args(self, i: int) -> tuple:
        """`route`'s arguments after h: gate weight, top-k, renormalize."""
        m = self.spec.moe
        return self.w[f"model.layers.{i}.mlp.gate.weight"], m.top_k, m.norm_topk_prob

    def dense_mlp_weights(self, i: int) -> tuple[torch.Tensor, ...]:
        p = f"model.layers.{i}.mlp."
        return self.w[p + "gate_proj.weight"], self.w[p + "up_proj.weight"], self.w[p + "down_proj.weight"]

    def mlp(self, i: int, h: torch.Tensor, first_position: int) -> torch.Tensor:
        if i not in self.moe_index:
            return dense_mlp(h, *self.dense_mlp_weights(i))
        ids, weights = route(h, *self.router_args(i))
        out = self.experts.forward(self.moe_index[i], h.float(), ids, weights, first_position).to(self.dtype)
        if self.spec.moe.num_shared_experts:
            out = out + shared_expert(h, *self.shared_expert_weights(i))
        return out

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.final_norm(x), self.lm_head).float()

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.w["model.norm.weight"], self.spec.norm.eps)

    def new_mtp_cache(self) -> SequenceCache:
        """The multi-token-prediction layer's own keys and values."""
        a = self.spec.attention
        return SequenceCache(KVCache(self.spec.mtp_layers, a.num_kv_heads, a.head_dim, self.dtype, self.device))

    @torch.inference_mode()
    def mtp_forward(self, hidden: torch.Tensor, ids: torch.Tensor, cache: SequenceCache,
                    start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The multi-token-prediction layer over T positions after `cache`'s, the first at
        sequence position `start`: row t joins the final hidden state at that position (`hidden`
        [T, hidden], `forward`'s) with the embedding of the token after it (`ids` [T]), and
        predicts the token after that. Returns (logits [T, vocab] fp32, its output [T, hidden],
        which drafts a further token as the hidden state of the position after)."""
        i, w, eps = self.spec.num_layers, self.w, self.spec.norm.eps
        embedded = rms_norm(self.embed[ids.to(self.device)].to(self.dtype), w["mtp.pre_fc_norm_embedding.weight"], eps)
        x = F.linear(torch.cat([embedded, rms_norm(hidden.to(self.dtype), w["mtp.pre_fc_norm_hidden.weight"], eps)],
                               dim=-1), w["mtp.fc.weight"])
        self.experts.begin_pass(ids.numel(), prompt=False)
        cos, sin = self.rope_at(torch.arange(start, start + ids.numel(), device=self.device))
        x = x + self.full_attention(i, rms_norm(x, w[f"model.layers.{i}.input_layernorm.weight"], eps), cos, sin,
                                    [cache])
        x = x + self.mlp(i, rms_norm(x, w[f"model.layers.{i}.post_attention_layernorm.weight"], eps), start)
        cache.length += ids.numel()
        out = rms_norm(x, w["mtp.norm.weight"], eps)
        return F.linear(out, self.lm_head).float(), out

    def rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.inv_freq, positions, self.dtype)
