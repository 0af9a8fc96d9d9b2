"""What a spec would do on a target before any engine exists (`ftc inspect SPEC --target T
--vram-budget B`): the GPU memory split and the decode and prefill speeds that the
bandwidth model (docs/structures.md, "The performance model") predicts.

Decode, one sequence, routing with no locality: LRU slots hold a share s of the expert pool, so
each of a layer's k routed experts misses with probability 1 − s, and its misses m follow the
binomial distribution B(k, 1 − s). A layer's misses take the planner's time for m (`MissPlanner`:
q fills beside m − q CPU experts, at the rates both keep while both run), averaged over that
distribution; the GPU reads the non-expert weights as the engine stores them (all but the
embedding, of which one row is read) and every layer's hit and filled experts at its memory
bandwidth. Real routing has locality, so the model is a floor on speed for such routing, not a
ceiling.

A decode step also has fixed device work per MoE layer beyond its bytes (the family's
`decode_fixed_ms`): the launches of the one-graph step's kernels and the dependencies between them
(norms, projections, attention, router, the plan, the hits, the join), which the bandwidth terms
do not see. It is measured on the h200 and taken as the same on the other GPUs.

Prefill of a long prompt streams whole MoE layers through two layer buffers at B_P (where the
budget holds 2·E slots): a chunk of C tokens costs the layers' expert bytes over PCIe, the bound
that the GPU's compute hides behind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ftc.compile.pipeline import make_plan
from ftc.compile.targets import Target
from ftc_runtime.experts.miss_planner import MissPlanner
from ftc_runtime.experts.vram_plan import VramPlan, plan_vram
from ftc_runtime.io.ftw import round_up
from ftc_runtime.models import family
from ftc_runtime.models.dense_layout import stored_bytes, stored_dense
from ftc_runtime.spec import ModelSpec


class PredictionError(ValueError):
    """The target lacks a figure the prediction needs (a GPU, its bandwidths)."""


@dataclass(frozen=True)
class Prediction:
    vram: VramPlan
    misses_per_layer: float  # expected misses of one token in one MoE layer
    miss_ms: float  # per token: every MoE layer's misses
    device_ms: float  # per token: the GPU's own reads
    fixed_ms: float  # per token: the step's fixed work (the family's decode_fixed_ms per MoE layer)
    prefill_chunk: int
    prefill_tok_s: float | None  # None: too few slots to stream whole layers, or every expert resident

    @property
    def decode_ms(self) -> float:
        return self.miss_ms + self.device_ms + self.fixed_ms

    @property
    def decode_tok_s(self) -> float:
        return 1e3 / self.decode_ms


def predict(spec: ModelSpec, target: Target, budget: int, max_context: int) -> Prediction:
    """The prediction for `spec` on `target` within `budget` bytes of GPU memory, the KV cache
    reserved for `max_context` tokens."""
    if target.gpu is None or target.b_p is None or target.b_h is None or target.gpu_read_gbps is None:
        raise PredictionError(f"--target {target.name}: a prediction needs the target's GPU, its memory bandwidth "
                              "and its B_P and B_H: use a preset with a GPU (rtx-pro-6000, rtx-5090, h200, ...)")
    stored = stored_dense(spec)
    stride, moe_layers, m = round_up(spec.expert_bytes), len(spec.moe_layers), spec.moe
    vram = plan_vram(spec, stored_bytes(stored), budget, stride, len(spec.expert_layers) * m.num_experts, max_context)
    planner = MissPlanner("adaptive", target.b_p, target.b_h, target.b_p_concurrent, target.b_h_concurrent)
    p_miss = 1.0 - vram.pool_share
    chance = [math.comb(m.top_k, n) * p_miss ** n * (1 - p_miss) ** (m.top_k - n) for n in range(m.top_k + 1)]
    layer_s = sum(c * planner.bound_s(n, planner.fills(n), stride) for n, c in enumerate(chance) if n)
    on_cpu = sum(c * (n - planner.fills(n)) for n, c in enumerate(chance))  # experts the GPU never reads
    embed = math.prod(stored["model.embed_tokens.weight"][0])
    device_bytes = (stored_bytes(stored) - 2 * embed + 2 * spec.hidden_size
                    + moe_layers * (m.top_k - on_cpu) * stride)
    chunk = make_plan(target, spec).prefill_chunk
    streams = 2 * m.num_experts <= vram.n_slots < vram.pool_experts  # all resident: no transfers to bound it
    prefill = chunk / (moe_layers * m.num_experts * stride / (target.b_p * 1e9)) if streams else None
    return Prediction(vram, m.top_k * p_miss, 1e3 * moe_layers * layer_s,
                      1e3 * device_bytes / (target.gpu_read_gbps * 1e9),
                      moe_layers * family(spec.family).decode_fixed_ms, chunk, prefill)
