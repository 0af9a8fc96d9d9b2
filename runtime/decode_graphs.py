"""`DecodeGraphs`: one decode step (one token) with the model's non-expert work replayed as CUDA
graphs, so that a step costs a few launches per layer instead of ~60 kernel launches from Python.

Per layer two graphs, cut where the step must leave the GPU's stream of fixed-shape work:
- `in`:  x += previous MLP output; input norm, q/k/v, q/k norms, RoPE  → static q, k, v;
- (eager) the KV cache append and attention, whose shapes grow with the sequence;
- `out`: x += o_proj(attention); post-attention norm; the router (ids, weights) or a dense MLP;
- (eager) the routed experts: the `out` graph ends by staging their input and routing for the
  host (`OffloadedExperts.stage`); then the host round trip, cache, miss split and CPU part;
and one graph for the final norm and lm_head. Graphs are captured lazily in the second decode
step (the first runs the same functions eagerly, which also compiles them) and replayed after;
they read and write only the static buffers allocated here, never the KV cache, so they stay
valid for every sequence. With FTC_TORCH_COMPILE=1 the functions are fused by torch.compile
first (off by default: its speed on the device is not yet measured).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from .kv_cache import KVCache
from .models.qwen3_moe import Qwen3MoeModel, attention_in, attention_out, dense_mlp, route


class DecodeGraphs:
    def __init__(self, model: Qwen3MoeModel, compile_fns: bool):
        if model.device.type != "cuda":
            raise ValueError("DecodeGraphs needs a CUDA device")
        self.model = model
        spec, dev, dt = model.spec, model.device, model.dtype
        n_q, n_kv, d = model.heads
        hidden = spec.hidden_size
        self.x = torch.zeros(1, hidden, dtype=dt, device=dev)
        self.mlp = torch.zeros(1, hidden, dtype=dt, device=dev)
        self.cos = torch.zeros(1, 1, model.inv_freq.numel() * 2, dtype=dt, device=dev)
        self.sin = torch.zeros_like(self.cos)
        self.q = torch.zeros(1, n_q, d, dtype=dt, device=dev)
        self.k = torch.zeros(1, n_kv, d, dtype=dt, device=dev)
        self.v = torch.zeros(1, n_kv, d, dtype=dt, device=dev)
        self.attn = torch.zeros(1, n_q * d, dtype=dt, device=dev)
        self.logits = torch.zeros(1, spec.vocab_size, dtype=torch.float32, device=dev)
        self.fns = {f.__name__: f for f in (attention_in, attention_out, route, dense_mlp)}
        if compile_fns:
            eager, self.fns = self.fns, {name: torch.compile(f, dynamic=False, fullgraph=True)
                                         for name, f in self.fns.items()}
            try:
                self._warm_up()
            except Exception as e:  # noqa: BLE001 (any compiler failure: the same functions run uncompiled)
                print(f"ftc: torch.compile failed for decode, running uncompiled ({type(e).__name__}: {e})",
                      file=sys.stderr)
                self.fns = eager
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.steps = 0

    def step(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits [1, vocab] fp32 of the token `ids` (one) after the cache's tokens."""
        m, position = self.model, cache.length
        cos, sin = m.rope(position, 1)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self.x.copy_(m.embed[ids.to(m.device)].to(m.dtype))
        self.mlp.zero_()
        for i in range(m.spec.num_layers):
            self._run(("in", i), lambda i=i: self._attention_in(i))
            self.attn.copy_(m.attend(i, self.q, self.k, self.v, cache))
            self._run(("out", i), lambda i=i: self._attention_out(i))
            if m.is_moe(i):
                out = m.experts.forward_staged(m.moe_index[i], 1, m.spec.moe.top_k, position)
                self.mlp.copy_(out)
        cache.length += 1
        self._run(("head", 0), self._head)
        self.steps += 1
        return self.logits.clone()

    def _warm_up(self) -> None:
        """Compiles every function once, on the static buffers and the weights of the first layer
        of each kind (outputs are discarded)."""
        m, eps = self.model, self.model.spec.norm.eps
        self.fns["attention_in"](self.x, *m.attention_in_weights(0), self.cos, self.sin, eps, m.heads)
        _, h = self.fns["attention_out"](self.x, self.attn, *m.attention_out_weights(0), eps)
        kinds = {m.is_moe(i): i for i in reversed(range(m.spec.num_layers))}
        if True in kinds:
            self.fns["route"](h, *m.router_args(kinds[True]))
        if False in kinds:
            self.fns["dense_mlp"](h, *m.dense_mlp_weights(kinds[False]))

    def _run(self, key: tuple[str, int], fn: Callable[[], None]) -> None:
        graph = self.graphs.get(key)
        if graph is None and self.steps == 0:  # the first step runs eagerly (and compiles)
            fn()
            return
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                fn()
            self.graphs[key] = graph
        graph.replay()

    def _attention_in(self, i: int) -> None:
        m = self.model
        self.x.add_(self.mlp)
        q, k, v = self.fns["attention_in"](self.x, *m.attention_in_weights(i), self.cos, self.sin,
                                           m.spec.norm.eps, m.heads)
        self.q.copy_(q)
        self.k.copy_(k)
        self.v.copy_(v)

    def _attention_out(self, i: int) -> None:
        m = self.model
        x, h = self.fns["attention_out"](self.x, self.attn, *m.attention_out_weights(i), m.spec.norm.eps)
        self.x.copy_(x)
        if m.is_moe(i):
            ids, weights = self.fns["route"](h, *m.router_args(i))
            m.experts.stage(h.float(), ids, weights)
        else:
            self.mlp.copy_(self.fns["dense_mlp"](h, *m.dense_mlp_weights(i)))

    def _head(self) -> None:
        self.x.add_(self.mlp)
        self.logits.copy_(self.model.head(self.x))


def decode_graphs_for(model: Qwen3MoeModel, enabled: bool, compile_fns: bool) -> DecodeGraphs | None:
    """DecodeGraphs on a CUDA device with an expert backend that stages its input (`stage`,
    `forward_staged`) when enabled; None elsewhere (the eager path serves)."""
    if not enabled or model.device.type != "cuda" or not hasattr(model.experts, "forward_staged"):
        return None
    try:
        return DecodeGraphs(model, compile_fns)
    except RuntimeError as e:  # a torch without graph support for this device: eager decode still works
        print(f"ftc: CUDA graphs off for decode ({e})", file=sys.stderr)
        return None
