"""`DecodeGraphs`: one decode step (one token) with each layer's non-expert work replayed as one
CUDA graph, so that a layer costs one launch instead of ~60 kernel launches from Python. This is
the machinery; a family gives the body of one layer (its `decode.py`).

Per layer one graph, cut where the step must leave the GPU for the routed experts:
- the previous MoE layer's output (its device part plus the copy of its CPU part, plus a shared
  expert's where the family has one) joins x;
- the family's token mixing (attention writes k and v into the KV cache at the step's position, a
  device tensor, and attends over the cache's whole capacity with the positions after this token
  masked off, so the graph's shapes never change while the storage stays put);
- the router and the staging of the experts' input for the host (`OffloadedExperts.stage`), or a
  dense MLP;
then, outside the graph, the host round trip of the experts (`launch_staged`, `finish_staged`),
whose own device part is one more graph. One graph for the final norm and lm_head ends the step.
Where the expert backend can run a MoE layer on the device alone (`device_step_ready`: the
plan as data, `FTC_DEVICE_PLAN=1`), the whole step is one graph instead: the token's embedding
and the position's rotary table (the host writes only the token and the position), every layer's
body, each MoE layer's `run_staged_on_device` (plan kernels, the CPU's share through the doorbell,
gathered fills, joined on the device) and the head, with no host round trip.
Graphs are captured in the second step on a KV storage (the first runs the same code eagerly,
which warms up every kernel), and again whenever the storage moves (a new sequence, or growth by
doubling) or the expert backend's slots or mailbox do (its `generation`).
The family's functions are fused by torch.compile first, at load (FTC_TORCH_COMPILE=0 turns it
off; a compiler failure falls back to the same functions uncompiled); docs/performance.md has
what it gains.
"""

from __future__ import annotations

import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from ftc_runtime.cache.base import SequenceState
from ftc_runtime.cache.kv import KVCache
from ftc_runtime.decode.timeline import DeviceTimeline

EAGER_FUNCTIONS = ("decode_attention", "route")  # not given to torch.compile (see __init__)


class DecodeGraphs(ABC):
    """The machinery shared by the model families: static buffers, one graph per layer and one
    for the head, captured on the second step of a KV storage, and the step loop with the host
    round trip of each MoE layer. A family's subclass gives its functions (`functions`, fused by
    torch.compile), their warm-up and the body of one layer (`_layer`)."""

    def __init__(self, model, compile_fns: bool):
        if model.device.type != "cuda":
            raise ValueError("DecodeGraphs needs a CUDA device")
        self.model = model
        spec, dev, dt = model.spec, model.device, model.dtype
        hidden = spec.hidden_size
        self.x = torch.zeros(1, hidden, dtype=dt, device=dev)
        self.mlp = torch.zeros(1, hidden, dtype=dt, device=dev)
        self.cos = torch.zeros(1, 1, model.inv_freq.numel() * 2, dtype=dt, device=dev)
        self.sin = torch.zeros_like(self.cos)
        self.position = torch.zeros(1, dtype=torch.long, device=dev)
        self.token = torch.zeros(1, dtype=torch.long, device=dev)  # a whole step's input token
        self.logits = torch.zeros(1, spec.vocab_size, dtype=torch.float32, device=dev)
        self.cpu_part = torch.zeros(1, hidden, dtype=torch.float32, device=dev)  # a CPU part, copied in
        self.shared: torch.Tensor | None = None  # a shared expert's output, where the family has one
        self.fns = self.functions()
        if compile_fns:
            # Compiled in this process, without a pool of compile workers: those workers, still
            # busy after compiling, would sit on the cores of the CPU expert workers.
            import torch._inductor.config as inductor_config

            inductor_config.compile_threads = 1
            # decode_attention stays eager: its key length changes with every doubling of the KV
            # storage, and each new length would compile it again until dynamo's recompile limit
            # fails the step (in a long agent session); on the GPU it is two Triton kernels. The
            # router is a matmul and a Triton kernel there, which nothing would fuse.
            eager, self.fns = self.fns, {name: f if name in EAGER_FUNCTIONS else
                                         torch.compile(f, dynamic=False, fullgraph=True)
                                         for name, f in self.fns.items()}
            try:
                with torch.inference_mode():  # as decode runs: compiled code is specialized to the grad mode
                    self._warm_up()
            except Exception as e:  # noqa: BLE001 (any compiler failure: the same functions run uncompiled)
                print(f"ftc: torch.compile failed for decode, running uncompiled ({type(e).__name__}: {e})",
                      file=sys.stderr)
                self.fns = eager
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        # (KVCache.generation, OffloadedExperts.generation) the graphs were captured on
        self.graph_storage: tuple[int, int] | None = None
        self.pool = torch.cuda.graph_pool_handle()
        self.warm = False  # a step ran eagerly on the current storage
        self.step_done = torch.cuda.Event(blocking=True)  # a whole-step graph's end, waited for asleep
        self.timeline: DeviceTimeline | None = None  # a whole step's phases, where measured

    def set_timeline(self, timeline: DeviceTimeline | None) -> None:
        """Records (or stops recording) a whole step's device timeline from the next step on: the
        graphs are captured again, with the timeline's events or without them."""
        self.timeline = timeline
        self.graph_storage = None

    @abstractmethod
    def functions(self) -> dict[str, Callable]:
        """The pure tensor functions a layer runs, by name (each compiled once for all layers)."""

    @abstractmethod
    def _warm_up(self) -> None:
        """Runs every function once (compiling it, at load) on the static buffers and the weights
        of the first layer of each kind; the outputs are discarded."""

    @abstractmethod
    def _layer(self, i: int, cache: SequenceState) -> None:
        """Layer i's non-expert work on x: joins the previous MLP output, mixes tokens, and either
        stages the routed experts' input for the host or writes a dense MLP's output to `mlp`."""

    def step(self, ids: torch.Tensor, cache: SequenceState) -> torch.Tensor:
        """Logits [1, vocab] fp32 of the token `ids` (one) after the cache's tokens."""
        m, position = self.model, cache.length
        cache.reserve(position + 1)
        whole = m.experts.device_step_ready()
        if whole:
            m.experts.begin_device_step(m.spec.moe.top_k)
        if (cache.generation, m.experts.generation) != self.graph_storage:
            # New storage: the next graphs capture new addresses (and new shapes, after growth),
            # into a new memory pool (a pool whose graphs are all freed cannot take new ones).
            # This step runs eagerly first, so that every kernel is warmed up (and compiled) for
            # the new shapes outside a capture.
            self.graphs.clear()
            self.pool = torch.cuda.graph_pool_handle()
            self.graph_storage = (cache.generation, m.experts.generation)
            self.warm = False
        self.position.fill_(position)
        if whole:  # the step's input is made inside its graph
            self.token.fill_(int(ids.reshape(-1)[0]))
            try:
                self._run(("step", 0), lambda: self._device_step(cache))
            finally:
                m.experts.end_device_step()
            cache.length += 1
            self.warm = True
            logits = self.logits.clone()
            # The thread sleeps until the step is done, rather than spinning in the caller's next
            # sync on a core that the CPU experts and the doorbell thread need meanwhile.
            self.step_done.record()
            self.step_done.synchronize()
            if self.timeline is not None:
                self.timeline.collect()
            return logits
        self._prologue(ids.to(m.device))
        clock = m.experts.stats.host_s
        for i in range(m.spec.num_layers):
            t0 = time.perf_counter()
            self._run(("layer", i), lambda i=i: self._layer(i, cache))
            clock["layer_launch"] += time.perf_counter() - t0
            if m.is_moe(i):
                m.experts.launch_staged(m.moe_index[i], 1, m.spec.moe.top_k, position)
                m.experts.finish_staged()
        cache.length += 1
        self._run(("head", 0), self._head)
        self.warm = True
        return self.logits.clone()

    def _device_step(self, cache: SequenceState) -> None:
        """The whole step with its MoE layers on the device (`run_staged_on_device`): one graph."""
        m, timeline = self.model, self.timeline
        if timeline is not None:
            timeline.restart()
        self._prologue(self.token)
        for i in range(m.spec.num_layers):
            self._layer(i, cache)
            if m.is_moe(i):
                m.experts.run_staged_on_device(m.moe_index[i], m.spec.moe.top_k, self.position, timeline)
        self._head()
        if timeline is not None:
            timeline.mark("head")

    def _prologue(self, token: torch.Tensor) -> None:
        """The step's input: the embedding of `token` (int64 [1] on the device) and the rotary
        table of the step's position; no MLP output to join yet."""
        m = self.model
        cos, sin = m.rope_at(self.position)
        self.cos.copy_(cos)
        self.sin.copy_(sin)
        self.x.copy_(m.embed[token].to(m.dtype))
        self.mlp.zero_()

    def _run(self, key: tuple[str, int], fn: Callable[[], None]) -> None:
        graph = self.graphs.get(key)
        if graph is None and not self.warm:
            fn()
            return
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                fn()
            self.graphs[key] = graph
        graph.replay()

    def _join_previous(self, i: int) -> None:
        """x += the previous layer's MLP output; a MoE layer's is its device part plus its CPU part
        (plus its shared expert's, where there is one)."""
        m = self.model
        if i > 0 and m.is_moe(i - 1):
            on_device, on_host = m.experts.token_outputs()
            if on_host is None:  # a device step: the CPU's part is in the device's already
                self.mlp.copy_(on_device)
            else:
                self.cpu_part.copy_(on_host, non_blocking=True)
                self.mlp.copy_(on_device + self.cpu_part)
            if self.shared is not None:
                self.mlp.add_(self.shared)
        self.x.add_(self.mlp)

    def _head(self) -> None:
        self._join_previous(self.model.spec.num_layers)
        self.logits.copy_(self.model.head(self.x))

    def store_kv(self, cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Writes k, v at the step's position (a device tensor) of the cache's `layer`: its whole
        key and value storage and that position, up to which this token sees them."""
        keys, values = cache.storage(layer)
        keys.index_copy_(0, self.position, k)
        values.index_copy_(0, self.position, v)
        return keys, values, self.position


def decode_graphs_for(model, kind: type[DecodeGraphs] | None, enabled: bool,
                      compile_fns: bool) -> DecodeGraphs | None:
    """The family's DecodeGraphs (`kind`, None: the family has none) on a CUDA device with an
    expert backend that stages its input (`stage`, `launch_staged`, `finish_staged`,
    `token_outputs`) when enabled; None elsewhere (eager)."""
    if kind is None or not enabled or model.device.type != "cuda" or not hasattr(model.experts, "launch_staged"):
        return None
    try:
        return kind(model, compile_fns)
    except RuntimeError as e:  # a torch without graph support for this device: eager decode still works
        print(f"ftc: CUDA graphs off for decode ({e})", file=sys.stderr)
        return None
