"""Run by test_interpreted_kernels.py in a process of its own with TRITON_INTERPRET=1 (Triton reads
it when the kernels are defined): the decode plan's, the fills', the host-result take's, the step
counters', the join's, decode attention's (GLM's sparse latent attention and DeepSeek-V4's with
sinks too), DeepSeek-V4's hyper-connection weights, the router's and the
engines' decode expert Triton kernels, interpreted on the CPU,
against the torch plan (`plan_layer`), a plain copy, sums of `MissPlanner.bound_s`, softmax
attention over the tokens, torch's softmax top-k and float64 experts, on random routings, batch
sizes, slot counts (up to several candidate blocks), rules, rates, head shapes, capacities,
positions and router shapes.

    TRITON_INTERPRET=1 python tests/interpreted_kernels.py SEED RUNS STEPS
"""

from __future__ import annotations

import importlib.util
import random
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

from ftc.codegen.render import render_triton_kernels
from ftc_runtime.experts.cache import ExpertCache
from ftc_runtime.experts.device.device_plan import TUNE_STEP, CacheTables, LayerPlan, PlanRule, plan_layer
from ftc_runtime.experts.device.doorbell_kernels import DoorbellKernels, join_relay
from ftc_runtime.experts.device.gather_fills import gather_fills
from ftc_runtime.experts.device.plan_kernel import candidates_buffer, lru_candidates, plan_layer_triton
from ftc_runtime.experts.device.step_counts import StepCounts
from ftc_runtime.experts.miss_planner import MISS_POLICIES, MissPlanner
from ftc_runtime.experts.replay_kernel import replay_route_gpu
from ftc_runtime.experts.routing_trace import RoutingTrace, TraceReplay
from ftc_runtime.formats import expert_format
from ftc_runtime.io import mapped_flags
from ftc_runtime.io.ftw import FtwHeader
from ftc_runtime.io.host_take import BLOCK, take_mapped, take_mapped_when_signaled
from ftc_runtime.models.layers.attention import attention_in
from ftc_runtime.models.layers.decode_attention_kernel import MAX_SPANS, MIN_SPAN, decode_attention_gpu
from ftc_runtime.models.layers.deltanet_step_kernel import deltanet_step_gpu
from ftc_runtime.models.layers.fp8_gemv_kernel import fp8_dequantize_gpu, fp8_linear_gpu
from ftc_runtime.models.layers.fp8_linear import BlockFp8
from ftc_runtime.models.layers.gated_attention import gated_attention_out
from ftc_runtime.models.layers.gated_deltanet import DeltaNetShape, delta_rule, finish, project
from ftc_runtime.models.layers.gemv_kernel import TopK, linear_gpu
from ftc_runtime.models.layers.hc_mix_kernel import hc_mix_gpu
from ftc_runtime.models.layers.hyper_connections import hc_mix
from ftc_runtime.models.layers.mla import MlaShape, _sparse_attention_gpu, mla_attention
from ftc_runtime.models.layers.mlp import shared_expert
from ftc_runtime.models.layers.norm import rms_norm
from ftc_runtime.models.layers.qk_rope_kernel import qk_norm_rope_store_gpu
from ftc_runtime.models.layers.rope import rope_cos_sin
from ftc_runtime.models.layers.router import softmax_top_k
from ftc_runtime.models.layers.router_kernel import softmax_top_k_gpu
from ftc_runtime.models.layers.sink_attention import sink_attention
from ftc_runtime.models.layers.sparse_mla_kernel import sparse_latent_attention_gpu
from ftc_runtime.spec import ModelSpec

PLAN_FIELDS = ("pair_slot", "fill_rows", "fill_slots", "cpu_ids", "cpu_offsets", "cpu_tok", "cpu_w", "counts",
               "pairs", "phase_pairs")


def staged(ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and weights as a decode step stages them: fp32 columns of one buffer after x."""
    t, k = ids.shape
    packed = torch.randn(t, 7 + 2 * k)
    packed[:, 7:7 + k] = ids.float()
    packed[:, 7 + k:] = w
    return packed[:, 7:7 + k], packed[:, 7 + k:]


def check_plans(rng: random.Random, g: torch.Generator, runs: int, steps: int) -> None:
    e, layers, k = 16, 3, 4
    for run in range(runs):
        n_slots = rng.choice([0, 1, 5, 9, 20, 1100])
        planner = MissPlanner(rng.choice(MISS_POLICIES), rng.uniform(5, 60), rng.uniform(5, 120))
        rule = PlanRule.of(planner, 16 * k, rng.choice([0, 3, 12]), rng.random() < 0.8, "cpu")
        rule.bias.fill_(rng.randrange(-64, 65) * TUNE_STEP)  # as the step's waits leave it
        cache = ExpertCache(e * layers, n_slots)
        want_t, got_t = CacheTables.of(cache, "cpu"), CacheTables.of(cache, "cpu")
        for step in range(steps):
            t = rng.choice([1, 1, 2, 4, 16])
            hot = range(k + 3)
            ids = torch.stack([torch.tensor(rng.sample(hot if rng.random() < 0.7 else range(e), k)) for _ in range(t)])
            w = torch.rand(t, k, generator=g)
            base = rng.randrange(layers) * e
            staged_ids, staged_w = staged(ids, w) if rng.random() < 0.5 else (ids, w)
            want = plan_layer(want_t, rule, base, ids, w)
            cands = None
            if rng.random() < 0.5:  # computed ahead, as a decode step's next call takes them
                lru_candidates(got_t, t * k, cands := candidates_buffer(got_t, t * k, "cpu"))
            got = plan_layer_triton(got_t, rule, base, staged_ids, staged_w, cands)
            what = (f"run {run} step {step}: {t} tokens, {n_slots} slots, {planner.policy}, bias {float(rule.bias)}, "
                    f"ids {staged_ids.dtype}")
            for name in PLAN_FIELDS:
                assert torch.equal(getattr(got, name), getattr(want, name)), f"{what}: {name}"
            for name in ("slot_of", "id_of", "last_used", "cpu_step"):
                assert torch.equal(getattr(got_t, name)[:-1], getattr(want_t, name)[:-1]), f"{what}: {name}"
            assert torch.equal(got_t.step, want_t.step), what


def check_fills(rng: random.Random, g: torch.Generator) -> None:
    rows, n_slots, n = 30, 10, 16
    for stride in (256, 4 * 70001):
        host = torch.randint(0, 256, (rows, stride), dtype=torch.uint8, generator=g)
        slots = torch.randint(0, 256, (n_slots, stride), dtype=torch.uint8, generator=g)
        n_fill = rng.randrange(0, 9)
        fill_rows, fill_slots = torch.full((n,), -1), torch.full((n,), -1)
        fill_rows[:n_fill] = torch.tensor(rng.sample(range(rows), n_fill), dtype=torch.long)
        fill_slots[:n_fill] = torch.tensor(rng.sample(range(n_slots), n_fill), dtype=torch.long)
        unused = torch.zeros(n, dtype=torch.long)
        plan = LayerPlan(unused.view(2, 8), fill_rows, fill_slots, unused, unused, unused, unused.float(),
                         torch.tensor([0, n_fill, 0, n_fill]), unused.int().expand(3, n),
                         unused.int().expand(2, 3, n))
        want = slots.clone()
        want[fill_slots[:n_fill]] = host[fill_rows[:n_fill]]
        gather_fills(host.view(torch.int32), slots, plan)
        assert torch.equal(slots, want), f"fills: stride {stride}, {n_fill} fills"


def check_host_take(seed: int) -> None:
    """out += a host buffer, left zeroed, over sizes around the kernel's block (a tail program
    masked: the values past out's end are neither read into it nor zeroed). Its own generators:
    the other checks' draws stay what they were."""
    rng, g = random.Random(seed + 1), torch.Generator().manual_seed(seed + 1)
    for n in (1, BLOCK - 1, BLOCK, BLOCK + 1, rng.randrange(2, 5 * BLOCK)):
        out, src = torch.randn(n, generator=g), torch.randn(n + 3, generator=g)
        want, rest = out + src[:n], src[n:].clone()
        take_mapped(out, src)
        assert torch.equal(out, want), f"host take: {n} values"
        assert not src[:n].any() and torch.equal(src[n:], rest), f"host take: {n} values"


@triton.jit
def _plain_load(ptr, SCOPE: tl.constexpr):
    return tl.load(ptr)


def check_signaled_take(seed: int) -> None:
    """The take that waits for a host flag, its flag loads plain (the interpreter runs no inline
    PTX: the GPU tests hold the waiting): a raised flag takes the buffer and says it did not wait;
    a flag short of the job gives up after its looks, says so and leaves both buffers alone, and
    so does every take after it until the host clears the status."""
    ptx = mapped_flags.load_acquire
    mapped_flags.load_acquire = _plain_load
    try:
        _check_signaled_take(random.Random(seed + 2), torch.Generator().manual_seed(seed + 2))
    finally:
        mapped_flags.load_acquire = ptx


def _check_signaled_take(rng: random.Random, g: torch.Generator) -> None:
    status, seq = torch.zeros(2, dtype=torch.int64), 0
    for n in (1, BLOCK + 1, rng.randrange(2, 5 * BLOCK)):
        seq += 1
        out, src = torch.randn(n, generator=g), torch.randn(n + 3, generator=g)
        want, rest = out + src[:n], src[n:].clone()
        take_mapped_when_signaled(out, src, torch.tensor([seq + rng.randrange(2)]), seq, status)
        assert torch.equal(out, want), f"signaled take: {n} values"
        assert not src[:n].any() and torch.equal(src[n:], rest), f"signaled take: {n} values"
        assert status.tolist() == [0, 0], f"signaled take: status {status}"
        src, before = torch.randn(n, generator=g), out.clone()
        kept = src.clone()
        for short in (True, False):
            seq += 1
            take_mapped_when_signaled(out, src, torch.tensor([seq - short]), seq, status, spins=3)
            assert torch.equal(out, before) and torch.equal(src, kept), f"a take after a flag short of its job: {n}"
            assert status[0] == 1, f"gave up: {status}"
        status.zero_()


def check_counts(rng: random.Random) -> None:
    for trial in range(20):
        measured = rng.random() < 0.5
        planner = MissPlanner(rng.choice(MISS_POLICIES), rng.uniform(5, 60), rng.uniform(5, 120),
                              rng.uniform(5, 50) if measured else None, rng.uniform(5, 90) if measured else None)
        size = rng.randrange(1, 10 << 20)
        counts, want, bound = StepCounts(planner, size, "cpu"), [0, 0, 0, 0], 0.0
        for _ in range(rng.randrange(1, 12)):
            m = rng.randrange(0, 17)
            q = rng.randrange(0, m + 1)
            hits = rng.randrange(0, 17 - m)
            counts.add(torch.tensor([hits, q, m - q, q]))
            want = [want[0] + 1, want[1] + hits, want[2] + q, want[3] + m - q]
            bound += planner.bound_s(m, q, size)
        got, got_bound = counts.take()
        assert got == want, f"counts, trial {trial}: {got} != {want}"
        assert abs(got_bound - bound) <= 1e-12 * max(bound, 1e-9), f"bound, trial {trial}: {got_bound} != {bound}"
        assert counts.take() == ([0, 0, 0, 0], 0.0), "take resets the counters"


def check_join(rng: random.Random, g: torch.Generator) -> None:
    """The step's join without a CPU job (its wait is the device's inline PTX, which the
    interpreter cannot run: the GPU tests hold that part): every token's row is the sum of the
    pairs' rows that their phase gave a slot, whatever the other rows hold; the bias tuned."""
    for trial in range(12):
        t, k = rng.choice([1, 1, 2, 5, 16]), rng.choice([1, 4, 8])
        n, hidden = t * k, rng.choice([64, 100, 2048])
        where = torch.tensor([rng.choice([0, 1, 2]) for _ in range(n)])  # hit, fill, CPU
        phase_pairs = torch.full((2, 3, n), -1, dtype=torch.int32)
        for phase in range(2):
            phase_pairs[phase, 0] = torch.where(where == phase, torch.randint(0, 50, (n,), generator=g), -1)
            phase_pairs[phase, 1] = torch.arange(n, dtype=torch.int32) // k
        hits, fills = torch.randn(n, hidden, generator=g), torch.randn(n, hidden, generator=g)
        rows = torch.where((where == 0)[:, None], hits, torch.where((where == 1)[:, None], fills, 0.0))
        want = torch.zeros(t, hidden, dtype=torch.float64).index_add_(0, phase_pairs[0, 1].long(), rows.double())
        fills_n = int((where == 1).sum())
        counts = torch.tensor([int((where == 0).sum()), fills_n, 0, fills_n])
        plan = LayerPlan(*(None,) * 7, counts, phase_pairs[0], phase_pairs)
        rule = PlanRule.of(MissPlanner("adaptive", 25.0, 50.0), n, 0, True, "cpu")
        kernels = DoorbellKernels.__new__(DoorbellKernels)  # its device side alone: no mailbox
        kernels.done = kernels.counter = torch.zeros(1, dtype=torch.int64)
        kernels.status, kernels.box = torch.zeros(1, dtype=torch.int64), {"out": torch.full((t, hidden), float("nan"))}
        kernels.relay = join_relay("cpu")
        out = torch.full((t, hidden), float("nan"))
        kernels.wait_and_join(out, plan, rule, hits, fills)
        what = f"join, trial {trial}: {t} tokens of {k}, hidden {hidden}"
        assert torch.allclose(out.double(), want, rtol=1e-6, atol=1e-5), what
        assert float(rule.bias) == (-TUNE_STEP if fills_n >= 2 else 0.0), f"{what}: bias {float(rule.bias)}"


def check_decode_attention(rng: random.Random, g: torch.Generator) -> None:
    for trial in range(6):
        n_kv, group, d = rng.choice([1, 2, 4]), rng.choice([1, 3, 8]), rng.choice([16, 24, 64, 256])
        capacity = rng.choice([1, 40, MIN_SPAN, 2 * MIN_SPAN + 8, MIN_SPAN * MAX_SPANS + 8])
        position = rng.randrange(capacity)
        dtype = rng.choice([torch.float32, torch.bfloat16])
        keys = torch.randn(capacity, n_kv, d, generator=g).to(dtype)
        values = torch.randn(capacity, n_kv, d, generator=g).to(dtype)
        q = torch.randn(1, n_kv * group, d, generator=g).to(dtype)
        heads, pos = (n_kv * group, n_kv, d), torch.tensor([position])
        got = decode_attention_gpu(q, keys, values, pos, heads)
        # one kernel (the last program of a KV head combines its spans): the same, the counts left at
        # zero; after a call on another query, whose spans a combine too early would find
        decode_attention_gpu(-q, keys, values, pos, heads)
        done = torch.zeros(n_kv + 3, dtype=torch.int32)
        one_kernel = decode_attention_gpu(q, keys, values, pos, heads, done)
        # softmax over the keys up to the position, per query head and its KV head, in fp64
        k = keys[:position + 1].double().repeat_interleave(group, dim=1)
        v = values[:position + 1].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[0].double(), k) / d ** 0.5
        want = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), v).reshape(1, -1)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        err = float((got.double() - want).abs().max() / want.abs().max())
        what = f"attention, trial {trial}: {n_kv} kv × {group}, d {d}, capacity {capacity}, position {position}"
        assert got.dtype == dtype and got.shape == want.shape and err < tol, f"{what}, {dtype}: {err:.2e}"
        assert torch.equal(one_kernel, got) and not done.any(), f"{what}, {dtype}: one kernel, counts {done}"


def check_router(rng: random.Random, g: torch.Generator) -> None:
    for trial in range(8):
        t, e, k = rng.choice([1, 3, 17]), rng.choice([8, 60, 128, 256]), rng.choice([1, 2, 6, 8])
        renormalize = rng.random() < 0.5
        logits = (3 * torch.randn(t, e, generator=g)).to(rng.choice([torch.float32, torch.bfloat16]))
        got_ids, got_w = softmax_top_k_gpu(logits, k, renormalize)
        want_ids, want_w = softmax_top_k(logits, k, renormalize)
        what = f"router, trial {trial}: {t} tokens, {e} experts, top {k}, renormalize {renormalize}, {logits.dtype}"
        # bf16 logits can tie: then any of the tied experts is right, at the same weight
        same = got_ids == want_ids
        tied = torch.gather(logits, 1, got_ids) == torch.gather(logits, 1, want_ids)
        assert bool((same | tied).all()) and got_ids.dtype == torch.int64, what
        assert torch.allclose(got_w, want_w, rtol=1e-5, atol=1e-7), what


def check_router_projection(rng: random.Random, g: torch.Generator) -> None:
    """The router's projection with its selection as the epilogue (`TopK`) against the projection,
    then the selection kernel: the same ids and weights, and the programs' count left at zero."""
    for trial in range(6):
        e, k, hidden = rng.choice([8, 60, 128, 256]), rng.choice([1, 2, 6, 8]), rng.choice([64, 200])
        more = rng.choice([0, 0, 1, 33])  # rows after the router's in a fused weight (a shared expert's)
        dtype = rng.choice([torch.float32, torch.bfloat16])
        x, w = torch.randn(1, hidden, generator=g).to(dtype), torch.randn(e + more, hidden, generator=g).to(dtype)
        norm_w, renormalize = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype), rng.random() < 0.5
        want_ids, want_w = softmax_top_k_gpu(linear_gpu(x, w, norm_w=norm_w, eps=1e-6)[:, :e], k, renormalize)
        ids, weights = torch.full((1, k), -1), torch.full((1, k), float("nan"))
        done = torch.zeros(1, dtype=torch.int32)
        logits = linear_gpu(x, w, norm_w=norm_w, eps=1e-6,
                            top_k=TopK(k, renormalize, ids, weights, done, among=e if more else 0))
        what = f"router projection, trial {trial}: {e} experts (+{more} rows), top {k}, hidden {hidden}, {dtype}"
        assert torch.equal(logits, linear_gpu(x, w, norm_w=norm_w, eps=1e-6)), f"{what}: logits"
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_w), what
        assert int(done) == 0, f"{what}: the count is {int(done)} after the call"


def check_gemv(rng: random.Random, g: torch.Generator) -> None:
    for trial in range(8):
        n, k = rng.choice([1, 7, 128, 600]), rng.choice([16, 200, 2048])
        dtype = rng.choice([torch.float32, torch.bfloat16])
        norm, bias, residual, plus = (rng.random() < 0.5 for _ in range(4))
        x, w = torch.randn(1, k, generator=g).to(dtype), (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
        norm_w = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype) if norm else None
        b = torch.randn(n, generator=g).to(dtype) if bias else None
        res = torch.randn(1, n, generator=g).to(dtype) if residual else None
        normed = torch.zeros(1, k) if norm else None
        # the previous layer's fp32 output joined first, as a copy into x's dtype and an add
        part, joined = torch.randn(1, k, generator=g), torch.full((1, k), float("nan"), dtype=dtype)
        row = x + part.to(dtype) if plus else x
        want_normed = rms_norm(row, norm_w, 1e-6) if norm else row
        # in fp64, rounded to the activation dtype where torch's functions round: after the
        # projection (and bias), after the residual add; the error relative to the sum's size
        # (its rounding) and the terms' (their root-sum-square: what roundings of the inputs move
        # the sum by, also where the sum cancels, as one output of a short row can)
        want = torch.nn.functional.linear(want_normed.double(), w.double(), None if b is None else b.double())
        terms = torch.nn.functional.linear(want_normed.double() ** 2, w.double() ** 2).sqrt()
        scale = want.abs() + terms + (0 if b is None else b.double().abs())
        want = want.to(dtype).double()
        if residual:
            want, scale = (want + res.double()).to(dtype).double(), scale + res.double().abs()
        got = linear_gpu(x, w, b, norm_w=norm_w, eps=1e-6, residual=res, normed_out=normed,
                         plus=(part, joined) if plus else None)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        what = f"gemv, trial {trial}: [{n}, {k}] {dtype}, norm {norm}, bias {bias}, residual {residual}, plus {plus}"
        err = float((got.double() - want).abs().max() / scale.max())
        assert got.dtype == dtype and got.shape == (1, n) and err < tol, f"{what}: {err:.2e}"
        if plus:  # exact in fp32; the interpreter truncates where the GPU rounds bf16 conversions
            err = float((joined.double() - row.double()).abs().max() / row.double().abs().max())
            assert err <= (0.0 if dtype == torch.float32 else tol), f"{what}: the joined row, {err:.2e}"
        if norm:
            assert torch.allclose(normed, want_normed.float(), rtol=tol, atol=tol), f"{what}: the normalized row"


def check_fp8_gemv(rng: random.Random, g: torch.Generator) -> None:
    """`fp8_linear_gpu` against the fp64 product of its weight's fp32 dequantization and the rows,
    on blocks that tile the weight, cover it partially and are a row or narrower than a step; one
    row (the gemv) in even trials, several (the tensor-core kernel) in odd ones. The dequantization
    kernel equals torch's in fp32, bit for bit (in bf16 the interpreter truncates)."""
    for trial in range(6):
        n, k = rng.choice([1, 7, 130, 600]), rng.choice([16, 200, 2048])
        t = 1 if trial % 2 == 0 else rng.choice([3, 16])
        block = rng.choice([(128, 128), (64, 32), (1, 16), (3, 96), (5, 7)])
        dtype = rng.choice([torch.float32, torch.bfloat16])
        codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
        codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
        scales = torch.exp2(torch.empty(-(-n // block[0]), -(-k // block[1])).uniform_(-12, -4, generator=g))
        w = BlockFp8(codes.view(torch.float8_e4m3fn), scales, block)
        x = torch.randn(t, k, generator=g).to(dtype)
        w32 = w.dequantize(torch.float32)
        dequantized = fp8_dequantize_gpu(w.codes, w.scale_inv, w.block, torch.float32)
        assert torch.equal(dequantized, w32), f"fp8 dequantize, trial {trial}: {block}"
        w64 = w32.double()
        want, scale = x.double() @ w64.T, x.double().abs() @ w64.abs().T
        got = fp8_linear_gpu(x, w.codes, w.scale_inv, w.block)
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the interpreter truncates (check_gemv_gates)
        err = float((got.double() - want).abs().max() / scale.max())
        what = f"fp8 gemv, trial {trial}: [{n}, {k}] blocks {block}, {t} rows {dtype}: {err:.2e}"
        assert got.dtype == dtype and got.shape == (t, n) and err < tol, what


def check_sparse_latent_attention(rng: random.Random, g: torch.Generator) -> None:
    """GLM's sparse latent attention on the chosen rows, read in place, against `mla_attention` on
    those rows gathered (fp32): head counts that fill part of a block of heads, latent and rotary
    widths below and above a tile, chosen columns with repeats, in one span or several, a random
    part of them seen (at least one)."""
    for trial in range(4):
        heads, kv, rope = rng.choice([(4, 16, 8), (20, 64, 16), (3, 32, 24)])
        nope, v, capacity = rng.choice([8, 16]), rng.choice([12, 16]), rng.choice([40, 300])
        k = rng.choice([5, 32, 200])
        shape = MlaShape(heads, 32, kv, nope, rope, v, 1e-6, (nope + rope) ** -0.5)
        rows = torch.randn(capacity, kv + rope, generator=g)
        columns = torch.randint(0, capacity, (1, k), generator=g)
        seen = torch.rand(1, k, generator=g) < rng.choice([0.3, 1.0])
        seen[0, rng.randrange(k)] = True
        q_nope, q_rope = torch.randn(1, heads, nope, generator=g), torch.randn(1, heads, rope, generator=g)
        kv_b = torch.randn(heads * (nope + v), kv, generator=g) / kv ** 0.5
        want = mla_attention(q_nope, q_rope, rows[columns[0], :kv], rows[columns[0], kv:], kv_b, seen, shape)
        got = _sparse_attention_gpu(q_nope, q_rope, rows, kv_b, columns[0], seen[0], shape)
        what = f"sparse latent attention, trial {trial}: {heads} heads, {kv} + {rope}, {k} columns"
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4), what


def check_sink_attention(rng: random.Random, g: torch.Generator) -> None:
    """DeepSeek-V4's decode attention (the sparse kernel with no rotary part and a sink logit per
    head) over rows read in place, against `sink_attention` on those rows gathered (fp32): head
    counts that fill part of a block of heads, widths below and above a tile, one span or several,
    sinks that dominate the softmax or hardly count."""
    for trial in range(4):
        heads, d, capacity = rng.choice([3, 16, 20]), rng.choice([32, 48, 128]), rng.choice([40, 300])
        k = rng.choice([5, 32, 200])
        rows = torch.randn(capacity, d, generator=g)
        columns = torch.randint(0, capacity, (k,), generator=g)
        seen = torch.rand(k, generator=g) < rng.choice([0.3, 1.0])
        seen[rng.randrange(k)] = True
        q = torch.randn(1, heads, d, generator=g)
        sinks = torch.randn(heads, generator=g) * rng.choice([1.0, 10.0])
        want = sink_attention(q, rows[columns], seen[None], sinks, d ** -0.5)
        got = sparse_latent_attention_gpu(q[0], rows, columns, seen, d, d ** -0.5, sinks)[None]
        what = f"sink attention, trial {trial}: {heads} heads of {d}, {k} columns"
        assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4), what


def check_hc_mix(rng: random.Random, g: torch.Generator) -> None:
    """DeepSeek-V4's hyper-connection weights (sigmoids, row softmax and Sinkhorn steps in one
    program per token) against the torch op in float64: stream counts that fill a power of two
    and that leave padding, one Sinkhorn step or many, mixes mild and large."""
    for trial in range(4):
        hc, tokens, iters = rng.choice([2, 3, 4, 5]), rng.randrange(1, 9), rng.choice([1, 3, 20])
        mixes = torch.randn(tokens, (2 + hc) * hc, generator=g) * rng.choice([0.5, 8.0])
        base, scale = torch.randn((2 + hc) * hc, generator=g), torch.rand(3, generator=g) * 2
        want = hc_mix(mixes.double(), base.double(), scale.double(), 1e-6, iters)
        got = hc_mix_gpu(mixes, hc, base, scale, 1e-6, iters)
        for name, a, b in zip(("pre", "post", "comb"), got, want, strict=True):
            what = f"hc_mix, trial {trial}: {hc} streams, {tokens} tokens, {iters} steps: {name}"
            assert a.shape == b.shape and torch.allclose(a.double(), b, rtol=1e-5, atol=1e-6), what


def check_qk_rope(rng: random.Random, g: torch.Generator) -> None:
    for trial in range(6):
        n_kv, group, d = rng.choice([1, 2, 4]), rng.choice([1, 3, 8]), rng.choice([16, 24, 64, 128])
        heads, capacity = (n_kv * group, n_kv, d), rng.choice([1, 40, 300])
        rotary = rng.choice([d, d // 2 // 2 * 2])
        dtype, qk_norm = rng.choice([torch.float32, torch.bfloat16]), rng.random() < 0.7
        qkv = torch.randn(1, (n_kv * group + 2 * n_kv) * d, generator=g).to(dtype)
        norms = [(1 + 0.1 * torch.randn(d, generator=g)).to(dtype) if qk_norm else None for _ in range(2)]
        inv_freq = 1.0 / (1e4 ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary))
        position = rng.randrange(capacity)
        cos, sin = rope_cos_sin(inv_freq, torch.tensor([position]), dtype)
        keys, values = (torch.randn(capacity, n_kv, d, generator=g).to(dtype) for _ in range(2))
        want_keys, want_values = keys.clone(), values.clone()
        # attention_in on an identity projection of the row: its tail is what the kernel does
        eye = torch.eye(qkv.shape[1], dtype=dtype)
        want_q, k, v = attention_in(qkv, torch.ones(qkv.shape[1], dtype=dtype), eye, None, *norms, cos, sin,
                                    1e-6, heads)
        want_keys[position], want_values[position] = k[0], v[0]
        qkv_in = rms_norm(qkv, torch.ones(qkv.shape[1], dtype=dtype), 1e-6)
        got_q = qk_norm_rope_store_gpu(qkv_in, *norms, cos, sin, 1e-6, heads, keys, values,
                                       torch.tensor([position]))
        tol = 1e-5 if dtype == torch.float32 else 4e-2  # bf16: the interpreter truncates (check_gemv_gates)
        what = f"qk rope, trial {trial}: {heads}, rotary {rotary}, {dtype}, qk norm {qk_norm}, position {position}"
        for name, got, want in (("q", got_q, want_q), ("keys", keys, want_keys), ("values", values, want_values)):
            err = float((got.double() - want.double()).abs().max() / want.double().abs().max())
            assert got.dtype == dtype and got.shape == want.shape and err < tol, f"{what}: {name} {err:.2e}"


def check_expert_kernels(rng: random.Random, g: torch.Generator) -> None:
    """The engines' generated decode expert kernel (`expert_ffn`) of each format, rendered with and
    without DeepSeek-V4's SwiGLU clamp, against float64 experts over the format's dequantization,
    the clamp written out here (gate from above, up both ways)."""
    h, i, e = 128, 64, 4
    for fmt, limit in ((f, lim) for f in ("bf16", "mxfp4", "nvfp4") for lim in (0.0, 0.5)):
        spec = ModelSpec.from_dict({"name": "t", "family": "qwen3_moe", "num_layers": 1, "hidden_size": h,
                                    "vocab_size": 10, "attention": {"num_heads": 2, "num_kv_heads": 1, "head_dim": 16},
                                    "moe": {"num_experts": e, "top_k": 2, "expert_intermediate_size": i,
                                            "swiglu_limit": limit}, "expert_format": fmt})
        header = FtwHeader.create(fmt, 1, e, h, i)
        slots = torch.zeros(e, header.expert_stride, dtype=torch.uint8)
        for s in range(e):
            rows = expert_format(fmt).rows_of({"gate_up": torch.randn(2 * i, h, generator=g) * h ** -0.5,
                                               "down": torch.randn(h, i, generator=g) * i ** -0.5})
            for name, dst in header.rows(slots[s]).items():
                dst.copy_(rows[name])
        with tempfile.TemporaryDirectory() as d:
            render_triton_kernels(spec, Path(d))
            path = next(Path(d).glob("*.py"))
            loaded = importlib.util.spec_from_file_location(f"expert_ffn_{fmt}", path)
            module = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(module)
        x = torch.randn(1, h, generator=g)
        slot = torch.tensor(rng.sample(range(e), 2), dtype=torch.int32)
        w = torch.rand(2, generator=g)
        out = torch.zeros(1, h)
        module.expert_ffn(x, slots, slot, torch.zeros(2, dtype=torch.int32), w, out)
        want = torch.zeros(h, dtype=torch.float64)
        for s, weight in zip(slot.tolist(), w.tolist(), strict=True):
            gate_up, down = (t.double() for t in header.dequantize(slots[s]))
            gate, up = (gate_up @ x[0].double()).chunk(2)
            if limit > 0:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            want += weight * (down @ (gate * torch.sigmoid(gate) * up))
        err = float((out[0].double() - want).norm() / want.norm())
        assert err < 1e-5, f"expert kernel {fmt}, swiglu limit {limit}: relative error {err:.2e}"


def check_gemv_gates(rng: random.Random, g: torch.Generator) -> None:
    """`linear_gpu`'s SwiGLU input with its sigmoid output gate (a shared expert's down projection)
    against `shared_expert`, and its gated input (gated attention's o_proj) against
    `gated_attention_out`, each on identity projections of the same rows. In bf16 the tolerance
    is wider than the device needs: Triton's interpreter converts to bf16 by truncation, not by
    rounding to nearest as the device (and torch) do, a ~1% error where four roundings stack."""
    for trial in range(6):
        dtype = rng.choice([torch.float32, torch.bfloat16])
        tol = 1e-5 if dtype == torch.float32 else 4e-2
        n, inter = rng.choice([1, 9, 256]), rng.choice([16, 100, 512])
        h = torch.randn(1, 2 * inter + 1, generator=g).to(dtype)  # [shared gate | gate | up], as the fused GEMV
        down = (torch.randn(n, inter, generator=g) / inter ** 0.5).to(dtype)
        eye = torch.eye(2 * inter + 1, dtype=dtype)
        want = shared_expert(h, eye[1:1 + inter], eye[1 + inter:], down, eye[:1])
        got = linear_gpu(h[:, 1:], down, swiglu=True, out_gate=h[:, 0])
        act = torch.nn.functional.silu(h[:, 1:1 + inter].double()) * h[:, 1 + inter:].double()
        scale = float((act.abs() @ down.double().abs().T).max() * torch.sigmoid(h[0, 0].double()))  # the terms' size
        err = float((got.double() - want.double()).abs().max()) / scale
        assert got.dtype == dtype and err < tol, f"swiglu, trial {trial}: [{n}, {inter}] {dtype}: {err:.2e}"
        heads, d = rng.choice([1, 4, 16]), rng.choice([16, 64, 256])
        q = torch.randn(1, heads * 2 * d, generator=g).to(dtype)  # each head's query, then its gate
        attn = torch.randn(1, heads * d, generator=g).to(dtype)
        o_w = (torch.randn(n, heads * d, generator=g) / (heads * d) ** 0.5).to(dtype)
        gate = q.view(1, heads, 2, d)[:, :, 1].reshape(1, heads * d)
        want = gated_attention_out(attn, gate, o_w)
        got = linear_gpu(attn, o_w, in_gate=(q, d))
        scale = float(((attn.double() * torch.sigmoid(gate.double())).abs() @ o_w.double().abs().T).max())
        err = float((got.double() - want.double()).abs().max()) / scale
        assert got.dtype == dtype and err < tol, f"gated input, trial {trial}: {heads} × {d} → {n}, {dtype}: {err:.2e}"


def check_deltanet_step(rng: random.Random, g: torch.Generator) -> None:
    """`deltanet_step_gpu` against the torch layer's halves (`project`, `delta_rule`, `finish`) on
    identity projections of the same fused row, from random states (updated in place), at
    qwen3.6's shapes and smaller ones, grouped value heads included."""
    for trial in range(4):
        nk, group, dk, dv = rng.choice([(16, 2, 128, 128), (2, 2, 32, 32), (1, 3, 16, 24), (4, 1, 64, 32)])
        shape = DeltaNetShape(nk, nk * group, dk, dv, rng.choice([2, 4]), 1e-6)
        dtype = rng.choice([torch.float32, torch.bfloat16])
        c, nv = shape.conv_channels, shape.num_v_heads
        width = c + nv * dv + 2 * nv
        proj = torch.randn(1, width, generator=g).to(dtype)
        eye = torch.eye(width, dtype=dtype)
        qkv_w, z_w, b_w, a_w = eye.split((c, nv * dv, nv, nv))
        conv_w = (torch.randn(c, 1, shape.conv_kernel, generator=g) * 0.5).to(dtype)
        A_log, dt_bias = torch.randn(nv, generator=g), torch.randn(nv, generator=g)
        norm_w = (1 + 0.1 * torch.randn(dv, generator=g)).to(dtype)
        conv = torch.randn(c, shape.conv_kernel - 1, generator=g).to(dtype)
        recurrent = torch.randn(nv, dk, dv, generator=g) * 0.1
        q, k, v, gk, beta, _, want_conv = project(proj, qkv_w, b_w, a_w, conv_w, A_log, dt_bias, conv, shape.heads)
        out, want_recurrent, _ = delta_rule(q, k, v, gk, beta, recurrent.clone())
        want = finish(out.to(dtype), proj, z_w, norm_w, torch.eye(nv * dv, dtype=dtype), shape.eps)
        got = deltanet_step_gpu(proj, conv_w, conv, recurrent, A_log, dt_bias, norm_w, shape)
        tol = 1e-4 if dtype == torch.float32 else 4e-2  # bf16: the interpreter truncates (check_gemv_gates)
        what = f"deltanet step, trial {trial}: {shape.heads}, kernel {shape.conv_kernel}, {dtype}"
        for name, a, b in (("output", got, want), ("conv state", conv, want_conv),
                           ("recurrent state", recurrent, want_recurrent)):
            err = float((a.double() - b.double()).abs().max() / b.double().abs().max())
            assert a.shape == b.shape and err < tol, f"{what}: {name} {err:.2e}"


def check_replay(rng: random.Random, g: torch.Generator) -> None:
    """The replay kernel against the host's `TraceReplay.route` on traces of fewer, as many and
    more experts per row than the model routes."""
    for trial in range(6):
        e, layers, k, rows = rng.choice([8, 64]), 3, rng.choice([1, 4, 6, 8]), rng.choice([1, 5])
        trace_k = rng.choice([1, k, k + 2])
        experts = torch.full((rows, layers, trace_k), -1, dtype=torch.int16)
        for r in range(rows):
            for layer in range(layers):
                n = rng.randrange(0, min(trace_k, e) + 1)  # a row names distinct experts
                experts[r, layer, :n] = torch.tensor(rng.sample(range(e), n), dtype=torch.int16)
        replay = TraceReplay(RoutingTrace(experts.numpy(), torch.full(experts.shape, 1.0).numpy(),
                                          torch.ones(rows, dtype=torch.bool).numpy()))
        n_tok = rng.choice([1, 3])
        own = torch.stack([torch.tensor(rng.sample(range(e), k)) for _ in range(n_tok)])
        positions = torch.tensor([rng.randrange(100) for _ in range(n_tok)])
        layer = rng.randrange(layers)
        want_ids, want_w = replay.route(layer, positions.numpy(), own.numpy(), torch.zeros(n_tok, k).numpy())
        got_ids, got_w = replay_route_gpu(replay._table(own.device, k), layer, positions, own)
        what = f"replay, trial {trial}: {e} experts, top {k}, trace rows of {trace_k}, {rows} rows"
        assert torch.equal(got_ids, torch.from_numpy(want_ids)), f"{what}: {got_ids} != {want_ids}"
        assert torch.equal(got_w, torch.from_numpy(want_w)), what


def main() -> None:
    seed, runs, steps = (int(a) for a in sys.argv[1:4])
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    check_plans(rng, g, runs, steps)
    check_fills(rng, g)
    check_host_take(seed)
    check_signaled_take(seed)
    check_counts(rng)
    check_join(rng, g)
    check_decode_attention(rng, g)
    check_router(rng, g)
    check_router_projection(rng, g)
    check_gemv(rng, g)
    check_fp8_gemv(rng, g)
    check_gemv_gates(rng, g)
    check_expert_kernels(rng, g)
    check_qk_rope(rng, g)
    check_sparse_latent_attention(rng, g)
    check_sink_attention(rng, g)
    check_hc_mix(rng, g)
    check_deltanet_step(rng, g)
    check_replay(rng, g)
    print("ok")


if __name__ == "__main__":
    main()
