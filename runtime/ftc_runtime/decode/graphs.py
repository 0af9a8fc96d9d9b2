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
plan as data, the default on a GPU), the whole step is one graph instead: the token's embedding
and the position's rotary table (the host writes only the token and the position), every layer's
body, each MoE layer's `run_staged_on_device` (plan kernels, the CPU's share through the doorbell,
gathered fills, joined on the device) and the head, with no host round trip.
Several sequences decode together (`step_batch`, the server's batches) in the whole-step mode
only: one graph per width n (2 to the backend's largest planned call), the projections, router,
experts and head over the n rows, each sequence's attention (and recurrence) on its own state.
A speculative verification pass (`step_pass`: one sequence's next token and its drafts) is the
same whole-step graph of width n over n rows of the one sequence, at consecutive positions: each
row's attention writes its key and value and attends up to its own position, each row's recurrence
steps the state the row before it left (a hybrid family snapshots that state after each row into
the sequence's `row_states`, which a rejected draft rewinds to), so the rows run as a causal chunk.
Graphs are captured in the second step on a set of storages (the first runs the same code
eagerly, which warms up every kernel), and again whenever a storage moves (a new sequence, growth
by doubling, another set of sequences in a batch) or the expert backend's slots or mailbox do (its
`generation`); a pass's widths on one sequence keep their graphs beside each other. A whole step
replayed from its graph is timed, from its begin to its end on the device, for the expert backend
(`step_timed`: the adaptive split's trials against the CPU alone). Widths above
1 run the functions uncompiled: each width would compile them again.
The family's functions are fused by torch.compile first, at load (FTC_TORCH_COMPILE=0 turns it
off; a compiler failure falls back to the same functions uncompiled); docs/performance.md has
what it gains. A family may run a one-sequence layer as its own fused kernels instead
(`fused_body`; FTC_FUSED_BODY=0 keeps the functions).
"""

from __future__ import annotations

import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

import torch

from ftc_runtime.cache.base import RecurrentCheckpoint, SequenceState
from ftc_runtime.decode.step_buffers import Captures, StepBuffers

EAGER_FUNCTIONS = ("decode_attention", "route")  # not given to torch.compile (see __init__)


class StepTimeline(Protocol):
    """A whole step's device timeline as the step loop drives it (the expert path's
    `DeviceTimeline` is one; the expert backend marks its own phases). A protocol, so that this
    machinery imports nothing of the expert path."""

    def restart(self) -> None:
        """The step's code runs (eagerly or into a capture): its marks replace the last ones."""

    def mark(self, phase: str) -> None:
        """The end of `phase` on the current stream (here "head": the final norm and lm_head)."""

    def collect(self) -> None:
        """Adds the step that just ran to the sums."""


class DecodeGraphs(ABC):
    """The machinery shared by the model families: static buffers, one graph per layer and one
    for the head, captured on the second step of a KV storage, and the step loop with the host
    round trip of each MoE layer. A family's subclass gives its functions (`functions`, fused by
    torch.compile), their warm-up and the body of one layer (`_layer`)."""

    eager_functions: tuple[str, ...] = EAGER_FUNCTIONS  # a family's functions that torch.compile leaves alone
    streams = 0  # residual streams per row (hyper-connections); 0: one row of hidden_size

    def __init__(self, model, compile_fns: bool, fused_body: bool = True):
        # Made for a CUDA device (`decode_graphs_for`); a step's body also runs on the CPU, uncaptured,
        # where tests hold it to the model's forward.
        self.model = model
        self.fused_body = fused_body  # the family's fused kernels at width 1, where it has them
        self._buffers = {1: StepBuffers.make(model, 1, self.streams)}
        self.io = self._buffers[1]  # the buffers of the step being run or captured
        self.fns = self.eager_fns = self.functions()
        if compile_fns:
            # Compiled in this process, without a pool of compile workers: those workers, still
            # busy after compiling, would sit on the cores of the CPU expert workers.
            import torch._inductor.config as inductor_config

            inductor_config.compile_threads = 1
            # decode_attention stays eager: its key length changes with every doubling of the KV
            # storage, and each new length would compile it again until dynamo's recompile limit
            # fails the step (in a long agent session); on the GPU it is two Triton kernels. The
            # router is a matmul and a Triton kernel there, which nothing would fuse.
            eager, self.fns = self.fns, {name: f if name in self.eager_functions else
                                         torch.compile(f, dynamic=False, fullgraph=True)
                                         for name, f in self.fns.items()}
            try:
                with torch.inference_mode():  # as decode runs: compiled code is specialized to the grad mode
                    self._warm_up()
            except Exception as e:  # noqa: BLE001 (any compiler failure: the same functions run uncompiled)
                print(f"ftc: torch.compile failed for decode, running uncompiled ({type(e).__name__}: {e})",
                      file=sys.stderr)
                self.fns = eager
        self.f = self.fns  # the functions of the step being run (uncompiled above width 1)
        self.captures: dict[int, Captures] = {}  # by width
        self.row_states: list[tuple] | None = None  # the current pass's state after each row (`_row_states`)
        self._pass_rows: tuple[int, list[tuple]] = (-1, [])  # a sequence's generation, its passes' row states
        self.step_done: torch.cuda.Event | None = None  # a whole-step graph's end, waited for asleep
        self.timeline: StepTimeline | None = None  # a whole step's phases, where measured

    def set_timeline(self, timeline: StepTimeline | None) -> None:
        """Records (or stops recording) a whole step's device timeline from the next step on: the
        graphs are captured again, with the timeline's events or without them."""
        self.timeline = timeline
        self.captures.clear()

    @property
    def graphs(self) -> dict[tuple[str, int], torch.cuda.CUDAGraph]:
        """The one-sequence step's graphs, by (kind, index)."""
        captures = self.captures.get(1)
        return {} if captures is None else captures.graphs

    @abstractmethod
    def functions(self) -> dict[str, Callable]:
        """The pure tensor functions a layer runs, by name (each compiled once for all layers)."""

    @abstractmethod
    def _warm_up(self) -> None:
        """Runs every function once (compiling it, at load) on the static buffers and the weights
        of the first layer of each kind; the outputs are discarded."""

    @abstractmethod
    def _layer(self, i: int, caches: list[SequenceState]) -> None:
        """Layer i's non-expert work on the rows of x (one per cache): joins the previous MLP
        output, mixes tokens (each row on its own cache), and either stages the routed experts'
        input or writes a dense MLP's output to `mlp`."""

    def batch_ready(self, n: int) -> bool:
        """Whether `step_batch` can decode n sequences together: n ≥ 2 within the expert backend's
        whole-step calls."""
        return n >= 2 and self.model.experts.device_step_ready(n)

    def step(self, ids: torch.Tensor, cache: SequenceState) -> torch.Tensor:
        """Logits [1, vocab] fp32 of the token `ids` (one) after the cache's tokens."""
        m, position = self.model, cache.length
        cache.reserve(position + 1)
        token = int(ids.reshape(-1)[0])
        if m.experts.device_step_ready():
            return self._whole_step([token], [cache])
        captures = self._select([cache])
        self.io.set_inputs([token], [position])
        self._prologue(self.io.token)
        clock = m.experts.stats.host_s
        for i in range(m.spec.num_layers):
            t0 = time.perf_counter()
            self._run(captures, ("layer", i), lambda i=i: self._layer(i, [cache]))
            clock["layer_launch"] += time.perf_counter() - t0
            if m.is_moe(i):
                m.experts.launch_staged(m.moe_index[i], 1, m.spec.moe.top_k, position)
                m.experts.finish_staged()
        cache.stepped()
        self._run(captures, ("head", 0), self._head)
        captures.warm = True
        return self.io.logits.clone()

    def step_batch(self, tokens: list[int], caches: list[SequenceState]) -> torch.Tensor:
        """Logits [n, vocab] fp32 of one token of each of n sequences (`batch_ready(n)`), each
        after its own cache's tokens: the whole step as one graph."""
        for cache in caches:
            cache.reserve(cache.length + 1)
        return self._whole_step(tokens, caches)

    def pass_ready(self, n: int, cache: SequenceState, checkpoint_at: tuple[int, ...]) -> bool:
        """Whether `step_pass` can run n tokens of `cache`'s sequence as one graph: within the
        expert backend's whole-step calls, and (a state rewound by replay, which a pass cuts at
        each checkpoint) no checkpoint but after the last token."""
        cut = cache.rewinds_by_replay and any(at != n - 1 for at in checkpoint_at)
        return self.model.experts.device_step_ready(n) and not cut

    def step_pass(self, tokens: list[int], cache: SequenceState, checkpoint_at: tuple[int, ...] = (),
                  hidden: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [n, vocab] fp32 of `tokens` run after the cache's tokens, as the model's forward
        of a chunk gives them (`pass_ready`): one whole-step graph whose rows are the tokens at
        consecutive positions of the one sequence. The recurrent state after each token in
        `checkpoint_at` goes into `cache.checkpoints` (copies); the final hidden states [n, ...]
        are appended to `hidden` where given (`final_hidden`)."""
        start, n = cache.length, len(tokens)
        cache.reserve(start + n)
        logits = self._whole_step(tokens, [cache] * n, list(range(start, start + n)))
        for at in checkpoint_at:
            rows, length = self.row_states, start + at + 1
            cache.checkpoints[length] = (cache.take() if rows is None else
                                         RecurrentCheckpoint(length, tuple(s.clone() for s in rows[at])))
        if hidden is not None:
            hidden.append(self.final_hidden())
        return logits

    def final_hidden(self) -> torch.Tensor:
        """The last step's final hidden states (after the final norm, [n, hidden]): what a
        multi-token-prediction layer drafts from, as the model's forward hands it out."""
        return self.model.final_norm(self.io.x)

    def _whole_step(self, tokens: list[int], caches: list[SequenceState],
                    positions: list[int] | None = None) -> torch.Tensor:
        m, t0 = self.model, time.perf_counter()
        m.experts.begin_device_step(m.spec.moe.top_k)  # may renew the backend's generation: first
        try:
            captures = self._select(caches)
            replayed = ("step", 0) in captures.graphs  # an eager or capturing step is no measure of one
            self.io.set_inputs(tokens, [c.length for c in caches] if positions is None else positions)
            self._run(captures, ("step", 0), lambda: self._device_step(caches))
        finally:
            m.experts.end_device_step()
        for cache in caches:
            cache.stepped()
        captures.warm = True
        logits = self.io.logits.clone()
        # The thread sleeps until the step is done, rather than spinning in the caller's next
        # sync on a core that the CPU experts and the doorbell thread need meanwhile.
        if self.step_done is None:
            self.step_done = torch.cuda.Event(blocking=True)
        self.step_done.record()
        self.step_done.synchronize()
        if replayed:
            m.experts.step_timed(len(tokens), time.perf_counter() - t0)
        if self.timeline is not None:
            self.timeline.collect()
        return logits

    def _select(self, caches: list[SequenceState]) -> Captures:
        """Makes the buffers and functions of a step over `caches` current, and returns its width's
        graphs, renewed if a storage changed: new addresses (and new shapes, after growth), in a
        new memory pool (a pool whose graphs are all freed cannot take new ones). Their next step
        runs eagerly first, warming every kernel (and compiling it) outside a capture. One batch
        width keeps graphs besides the single sequence's."""
        n = len(caches)
        if n not in self._buffers:
            self._buffers[n] = StepBuffers.make(self.model, n, self.streams)
        self.io, self.f = self._buffers[n], self.fns if n == 1 else self.eager_fns
        storage = (*(c.generation for c in caches), self.model.experts.generation)
        captures = self.captures.get(n)
        if captures is None or captures.storage != storage:
            if n > 1:  # the graphs of other sequences go; a pass's other widths on these stay
                self.captures = {w: c for w, c in self.captures.items() if w == 1 or set(c.storage) == set(storage)}
            captures = self.captures[n] = Captures(storage)
        passing = n > 1 and all(c is caches[0] for c in caches)
        self.row_states = self._row_states(caches[0], n) if passing else None
        return captures

    def _row_states(self, cache: SequenceState, n: int) -> list[tuple] | None:
        """Buffers for the recurrent state after each row of a pass of n rows on `cache`, which
        the family's layer fills in its graph (None where it keeps none, `_row_state`): one list
        per sequence, grown to the widest pass, which the graphs of every width share."""
        if self._pass_rows[0] != cache.generation:
            self._pass_rows = (cache.generation, [])
        rows = self._pass_rows[1]
        while len(rows) < n:
            state = self._row_state(cache)
            if state is None:
                return None
            rows.append(state)
        return rows

    def _row_state(self, cache: SequenceState) -> tuple | None:
        """A buffer for the recurrent state of `cache` after one row of a pass, None where the
        family has no recurrent state to rewind to a row."""
        return None

    def _device_step(self, caches: list[SequenceState]) -> None:
        """The whole step with its MoE layers on the device (`run_staged_on_device`): one graph."""
        m, timeline = self.model, self.timeline
        if timeline is not None:
            timeline.restart()
        self._prologue(self.io.token)
        for i in range(m.spec.num_layers):
            self._layer(i, caches)
            if m.is_moe(i):
                m.experts.run_staged_on_device(m.moe_index[i], m.spec.moe.top_k, self.io.position, timeline)
        self._head()
        if timeline is not None:
            timeline.mark("head")

    def _prologue(self, tokens: torch.Tensor) -> None:
        """The step's input: the embeddings of `tokens` (int64 [n] on the device) and the rotary
        tables of the step's positions; no MLP output to join yet."""
        m, io = self.model, self.io
        cos, sin = m.rope_at(io.position)
        io.cos.copy_(cos)
        io.sin.copy_(sin)
        io.x.copy_(m.embed[tokens].to(m.dtype))
        io.mlp.zero_()

    @staticmethod
    def _run(captures: Captures, key: tuple[str, int], fn: Callable[[], None]) -> None:
        graph = captures.graphs.get(key)
        if graph is None and not captures.warm:
            fn()
            return
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=captures.pool):
                fn()
            captures.graphs[key] = graph
        graph.replay()

    def _joinable(self, i: int) -> torch.Tensor | None:
        """The previous layer's output where layer i's first kernel can join it into the residual
        stream itself: a one-graph device step's MoE output, with no CPU part or shared expert to
        add (else None: `_join_previous` joins it)."""
        m, io = self.model, self.io
        if i == 0 or not m.is_moe(i - 1) or io.shared is not None:
            return None
        on_device, on_host = m.experts.token_outputs(io.width)
        return on_device if on_host is None else None

    def _join_previous(self, i: int) -> None:
        """x += the previous layer's MLP output; a MoE layer's is its device part plus its CPU part
        (plus its shared expert's, where there is one)."""
        m, io = self.model, self.io
        if i > 0 and m.is_moe(i - 1):
            on_device, on_host = m.experts.token_outputs(io.width)
            if on_host is None:  # a device step: the CPU's part is in the device's already
                io.mlp.copy_(on_device)
            else:
                io.cpu_part.copy_(on_host, non_blocking=True)
                io.mlp.copy_(on_device + io.cpu_part)
            if io.shared is not None:
                io.mlp.add_(io.shared)
        io.x.add_(io.mlp)

    def _head(self) -> None:
        self._join_previous(self.model.spec.num_layers)
        self.io.logits.copy_(self.model.head(self.io.x))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               caches: list[SequenceState]) -> torch.Tensor:
        """Decode attention of each row's one token (q [n, heads, d], k and v [n, kv heads, d]) on
        its own cache's KV `layer`: k and v written at the row's position (a device tensor), the
        query over the cache's whole storage up to that position. [n, heads · d]."""
        def one(r: int, cache: SequenceState) -> torch.Tensor:
            keys, values = cache.kv.storage(layer)
            position = self.io.position[r:r + 1]
            keys.index_copy_(0, position, k[r:r + 1])
            values.index_copy_(0, position, v[r:r + 1])
            return self.f["decode_attention"](q[r:r + 1], keys, values, position, self.model.heads)

        return self.per_sequence(one, caches)

    def per_sequence(self, fn: Callable[[int, SequenceState], torch.Tensor], caches: list[SequenceState]
                     ) -> torch.Tensor:
        """fn(row, cache) of each of the step's sequences ([1, ...] each), as the rows of one tensor."""
        rows = [fn(r, cache) for r, cache in enumerate(caches)]
        return rows[0] if len(rows) == 1 else torch.cat(rows)


def decode_graphs_for(model, kind: type[DecodeGraphs] | None, enabled: bool, compile_fns: bool,
                      fused_body: bool = True) -> DecodeGraphs | None:
    """The family's DecodeGraphs (`kind`, None: the family has none) on a CUDA device with an
    expert backend that stages its input (`stage`, `launch_staged`, `finish_staged`,
    `token_outputs`) when enabled; None elsewhere (eager)."""
    if kind is None or not enabled or model.device.type != "cuda" or not hasattr(model.experts, "launch_staged"):
        return None
    try:
        return kind(model, compile_fns, fused_body)
    except RuntimeError as e:  # a torch without graph support for this device: eager decode still works
        print(f"ftc: CUDA graphs off for decode ({e})", file=sys.stderr)
        return None
