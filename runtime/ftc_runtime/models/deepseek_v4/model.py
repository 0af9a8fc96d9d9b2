"""DeepSeek-V4 (transformers' deepseek_v4) decoder in torch: a residual of `hyper_connections.streams`
streams mixed around each block, the compressed attention over each layer's state
(`deepseek_v4/attention.py`, the state in a `CompressedCache`), the sqrt-softplus router (by
token id in the hash layers) with the routed experts on an `ExpertBackend` beside one shared
expert, both SwiGLU clamped at `moe.swiglu_limit`. Its multi-token-prediction layer (`mtp_forward`)
drafts the token after next from the streams before the head's collapse.

Tensor names follow transformers' model (`model.layers.L.self_attn.q_a_proj.weight`, ...).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ftc_runtime.experts.base import ExpertBackend
from ftc_runtime.models.batch_decode import BatchDecode
from ftc_runtime.models.deepseek_v4.attention import attend, layer_shapes, new_state
from ftc_runtime.models.deepseek_v4.cache import CompressedCache
from ftc_runtime.models.layers.fp8_linear import BlockFp8
from ftc_runtime.models.layers.hyper_connections import block_input, hc_expand, hyper_head
from ftc_runtime.models.layers.mlp import dense_mlp
from ftc_runtime.models.layers.norm import rms_norm_fp32_weight
from ftc_runtime.models.layers.rope import plain_inv_freq, yarn_inv_freq
from ftc_runtime.models.layers.softplus_router import route_biased, route_hashed
from ftc_runtime.spec import ModelSpec

# A run of tokens of one sequence within a pass: its cache and its rows of the pass's activations.
Run = tuple[CompressedCache, slice]


class DeepseekV4Model(BatchDecode):
    """One sequence at a time (or several decoding together), on `device`: fp32 activations on the
    CPU, bf16 on a GPU; the tensors the checkpoint keeps in fp32 (hyper-connections, sinks,
    position terms, router bias) stay fp32, `tid2eid` int64."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], experts: ExpertBackend,
                 device: torch.device | str = "cpu"):
        self.spec, self.experts, self.device = spec, experts, torch.device(device)
        self.dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.w = {k: self._placed(v) for k, v in weights.items()}
        self.shapes = layer_shapes(spec)
        self.mtp_shape = layer_shapes(spec, ("sliding",))[0]  # a multi-token-prediction layer's attention
        every_layer = range(spec.num_layers + spec.mtp_layers)
        self.attention_w = [{k.removeprefix(f"model.layers.{i}.self_attn."): v for k, v in self.w.items()
                             if k.startswith(f"model.layers.{i}.self_attn.")} for i in every_layer]
        c = spec.compressed
        self.inv_freq = plain_inv_freq(spec.rope.theta, c.rope_dim).to(self.device)
        y = c.compress_yarn
        self.compress_inv_freq = (
            plain_inv_freq(c.compress_theta, c.rope_dim) if y is None
            else yarn_inv_freq(c.compress_theta, c.rope_dim, y.factor, y.original_max_position, y.beta_fast,
                               y.beta_slow, attention_factor=1.0)[0]).to(self.device)
        self.hash_layers = set(spec.moe.hash_layers)
        # The hash layers' token → experts tables on the host: a prompt chunk's routing there is
        # known before it runs (`hash_routes`).
        self.hash_tables = {i: weights[f"model.layers.{i}.mlp.gate.tid2eid"].cpu().numpy() for i in self.hash_layers}
        self.moe_index = {layer: layer for layer in every_layer}  # every layer has experts, the MTP's too
        self.decode_graphs = None  # HyperDecodeGraphs, set by the engine on a GPU

    def _placed(self, w: torch.Tensor | BlockFp8) -> torch.Tensor | BlockFp8:
        """On the model's device; FP8 blocks and 32- and 64-bit tensors as stored, 16-bit weights in
        the activations' dtype."""
        if isinstance(w, BlockFp8):
            return w.to(self.device)
        return w.to(self.device, self.dtype if w.dtype in (torch.bfloat16, torch.float16) else w.dtype)

    def new_cache(self) -> CompressedCache:
        layers = [new_state(s, self.spec.compressed.index_head_dim, self.dtype, self.device) for s in self.shapes]
        return CompressedCache(self.spec, layers, self.dtype, self.device)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: CompressedCache, all_logits: bool = False,
                checkpoint_at: tuple[int, ...] = (), between_layers: Callable[[], None] | None = None,
                hidden: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Runs `ids` (1-D) after the cache's tokens; returns logits [T or 1, vocab] in fp32.
        `checkpoint_at`: indices into ids (ascending) after which the state goes into
        `cache.checkpoints` (the chunk runs in parts cut there). `between_layers` is called after
        each layer and may raise to abandon the pass (the state is then part-way: the sequence
        must end). `hidden`: the streams before the head's collapse [T, streams · hidden] are
        appended to it (what the multi-token-prediction layer drafts from)."""
        if self.decode_graphs is not None and ids.numel() == 1 and not checkpoint_at and hidden is None:
            return self.decode_graphs.step(ids, cache)
        ends = [a + 1 for a in checkpoint_at if a + 1 < ids.numel()] + [ids.numel()]
        outs, begin, streams = [], 0, [] if hidden is not None else None
        for end in ends:
            outs.append(self._pass(ids[begin:end], [(cache, slice(0, end - begin))], between_layers, kept=streams))
            begin = end
            if end - 1 in checkpoint_at:
                cache.checkpoints[cache.length] = cache.take()
        if hidden is not None:
            hidden.append(torch.cat(streams))
        logits = torch.cat(outs)
        return logits if all_logits else logits[-1:]

    @torch.inference_mode()
    def _eager_batch(self, tokens: list[int], caches: list[CompressedCache]) -> torch.Tensor:
        """Hyper-connections, router, experts and head run once over the batch; attention runs per
        sequence on its own state."""
        return self._pass(torch.tensor(tokens), [(c, slice(j, j + 1)) for j, c in enumerate(caches)], None,
                          prompt=False)

    def _pass(self, ids: torch.Tensor, runs: list[Run], between_layers: Callable[[], None] | None,
              prompt: bool = True, kept: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Every layer over the pass's tokens `ids` (each run's rows after its cache's tokens):
        logits [T, vocab] fp32 (and the streams before the head's collapse appended to `kept`)."""
        n, first = ids.numel(), runs[0][0].length
        known = self.hash_routes(ids) if prompt else None
        # Before the pass queues its expert copies: a host→device copy waits for those queued before it.
        ids = ids.to(self.device)
        self.experts.begin_pass(n, prompt=prompt, known_routes=known)
        positions = [torch.arange(c.length, c.length + rows.stop - rows.start, device=self.device) for c, rows in runs]
        x = self.w["model.embed_tokens.weight"][ids]
        streams = x[:, None, :].expand(-1, self.spec.hyper_connections.streams, -1).contiguous()
        for i in range(self.spec.num_layers):
            streams = self._block(streams, i, "attn_hc.", "input_layernorm.weight",
                                  lambda h, i=i: self._attention(i, h, runs, positions))
            streams = self._block(streams, i, "ffn_hc.", "post_attention_layernorm.weight",
                                  lambda h, i=i: self._moe(i, h, ids, first))
            if between_layers is not None:
                between_layers()
        for cache, rows in runs:
            cache.length += rows.stop - rows.start
        if kept is not None:
            kept.append(streams.flatten(1))
        return self.head(streams)

    def hash_routes(self, ids: torch.Tensor) -> dict[int, np.ndarray]:
        """MoE layer → the experts that the tokens `ids` route to in each hash layer."""
        tokens = ids.cpu().numpy()
        return {self.moe_index[i]: np.unique(table[tokens]) for i, table in self.hash_tables.items()}

    def _attention(self, i: int, h: torch.Tensor, runs: list[Run], positions: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([attend(self.attention_w[i], h[rows], at, cache.layers[i], self.shapes[i], self.inv_freq,
                                 self.compress_inv_freq) for (cache, rows), at in zip(runs, positions, strict=True)])

    def _block(self, streams: torch.Tensor, i: int, hc: str, norm: str,
               block: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The streams after layer i's block (attention or MoE) on its normalized input, between its
        hyper-connection's collapse and expansion."""
        h, p = self.spec.hyper_connections, f"model.layers.{i}."
        x, post, comb = block_input(streams, self.w[p + hc + "fn"], self.w[p + hc + "base"], self.w[p + hc + "scale"],
                                    self.w[p + norm], self.spec.norm.eps, h.eps, h.sinkhorn_iters)
        return hc_expand(streams, block(x), post, comb)

    def _moe(self, i: int, h: torch.Tensor, ids: torch.Tensor, first_position: int) -> torch.Tensor:
        """The routed experts (chosen by token id in a hash layer) and the shared expert."""
        m, p = self.spec.moe, f"model.layers.{i}.mlp."
        if i in self.hash_layers:
            chosen, weights = route_hashed(h, ids, self.w[p + "gate.weight"], self.w[p + "gate.tid2eid"],
                                           m.routed_scaling_factor)
        else:
            chosen, weights = route_biased(h, self.w[p + "gate.weight"], self.w[p + "gate.e_score_correction_bias"],
                                           m.top_k, m.routed_scaling_factor)
        routed = self.experts.forward(i, h.float(), chosen, weights, first_position)
        shared = dense_mlp(h, *(self.w[f"{p}shared_experts.{n}_proj.weight"] for n in ("gate", "up", "down")),
                           limit=m.swiglu_limit)
        return routed.to(h.dtype) + shared

    def is_moe(self, i: int) -> bool:
        return True

    def head(self, streams: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] fp32 of the streams [T, streams, hidden]."""
        h = self.spec.hyper_connections
        x = hyper_head(streams, self.w["model.hc_head.hc_fn"], self.w["model.hc_head.hc_base"],
                       self.w["model.hc_head.hc_scale"], self.spec.norm.eps, h.eps)
        x = rms_norm_fp32_weight(x, self.w["model.norm.weight"], self.spec.norm.eps)
        return F.linear(x, self.w["lm_head.weight"]).float()

    def new_mtp_cache(self) -> CompressedCache:
        """The multi-token-prediction layers' own state: a sliding-window layer's ring of raw rows each."""
        layers = [new_state(self.mtp_shape, self.spec.compressed.index_head_dim, self.dtype, self.device)
                  for _ in range(self.spec.mtp_layers)]
        return CompressedCache(self.spec, layers, self.dtype, self.device)

    @torch.inference_mode()
    def mtp_forward(self, hidden: torch.Tensor, ids: torch.Tensor, cache: CompressedCache,
                    start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The multi-token-prediction layer over T positions after `cache`'s, the first at sequence
        position `start`: row t joins the streams before the head's collapse at that position
        (`hidden` [T, streams · hidden], `forward`'s), each RMS-normed and projected (h_proj), with
        the embedding of the token after it (`ids` [T]; none at position 0), normed and projected
        (e_proj) into every stream; a sliding-window decoder layer with its own experts; its own
        collapse and norm, then the model's LM head. Returns (logits [T, vocab] fp32, its streams
        [T, streams · hidden], which draft a further token as the hidden state of the position after)."""
        i, w, eps, hc = self.spec.num_layers, self.w, self.spec.norm.eps, self.spec.hyper_connections
        p, n, ids = f"model.layers.{i}.", ids.numel(), ids.to(self.device)
        positions = torch.arange(start, start + n, device=self.device)
        embedded = w["model.embed_tokens.weight"][ids] * (positions != 0)[:, None].to(self.dtype)
        e = F.linear(rms_norm_fp32_weight(embedded, w[p + "enorm.weight"], eps), w[p + "e_proj.weight"])
        h = hidden.to(self.device, self.dtype).view(n, hc.streams, self.spec.hidden_size)
        streams = F.linear(rms_norm_fp32_weight(h, w[p + "hnorm.weight"], eps), w[p + "h_proj.weight"]) + e[:, None]
        self.experts.begin_pass(n, prompt=False)
        streams = self._block(streams, i, "attn_hc.", "input_layernorm.weight",
                              lambda x: attend(self.attention_w[i], x, positions, cache.layers[0], self.mtp_shape,
                                               self.inv_freq, self.compress_inv_freq))
        streams = self._block(streams, i, "ffn_hc.", "post_attention_layernorm.weight",
                              lambda x: self._moe(i, x, ids, start))
        cache.length += n
        x = hyper_head(streams, w[p + "hc_head.hc_fn"], w[p + "hc_head.hc_base"], w[p + "hc_head.hc_scale"], eps,
                       hc.eps)
        x = rms_norm_fp32_weight(x, w[p + "mtp_norm.weight"], eps)
        return F.linear(x, w["lm_head.weight"]).float(), streams.flatten(1)
