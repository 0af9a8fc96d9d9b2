"""`ftc inspect`: what an engine holds and how it will run (from engine.json and the FTW header), or
for a spec with no engine yet, its memory split and predicted speeds on a target (`ftc.predict`)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from rich.table import Table

from ftc_runtime.artifact import EngineManifest, check_engine
from ftc_runtime.experts.vram_plan import gib, plan_vram
from ftc_runtime.formats import expert_format
from ftc_runtime.io.ftw import read_header
from ftc_runtime.models import family
from ftc_runtime.models.dense_layout import stored_bytes, stored_dense
from ftc_runtime.spec import ModelSpec


def inspect_engine(engine: Path, verify: bool = False, vram_budget: int | None = None,
                   max_context: int = 4096) -> list:
    """The tables `ftc inspect` prints. --verify: every check that `ftc run` makes at load, and the
    expert file's sha256 and row checksums."""
    m = check_engine(engine, hash_experts=True).manifest if verify else EngineManifest.read(engine)
    files = Table("file", "bytes", "sha256", title="files" + (" (verified)" if verify else ""))
    for rel, meta in m.files.items():
        files.add_row(rel, f"{meta['bytes']:,}", meta["sha256"][:16] + "…")
    tables = [_model_table(m.spec, m.weights_source), _memory_table(m.spec), _plan_table(m), files]
    if vram_budget is not None:
        tables.insert(2, _vram_table(m, vram_budget, max_context))
    return tables


def inspect_spec(source: Path, target: str, vram_budget: int | None, max_context: int = 4096,
                 quant: str | None = None, overrides: list[str] = ()) -> list:
    """The tables of `ftc inspect SPEC --target T --vram-budget B`: the model, its memory, the GPU
    split of the budget (the target's memory when none is given) and the predicted speeds; `quant`:
    the experts in that format instead of the spec's; `overrides`: the spec's fields edited."""
    from ftc.compile.spec_loader import load_spec
    from ftc.compile.targets import resolve_target
    from ftc.predict import predict

    spec, _ = load_spec(source, list(overrides), quant=quant)
    t = resolve_target(target)
    budget = vram_budget if vram_budget is not None else t.vram_bytes
    if budget is None:
        raise ValueError(f"--target {t.name} names no GPU memory: give --vram-budget")
    p = predict(spec, t, budget, max_context)
    prefill = (f"{p.prefill_tok_s:,.0f} tok/s (chunks of {p.prefill_chunk} tokens, whole MoE layers streamed at "
               f"B_P {t.b_p:g} GB/s)" if p.prefill_tok_s is not None else
               f"not predicted: {p.vram.n_slots} slots hold all the experts or fewer than two layers' "
               f"({2 * spec.moe.num_experts})")
    v = p.vram
    rows = [
        (f"non-expert weights ({spec.dense_format}) / KV / workspace",
         f"{gib(v.dense)} / {gib(v.kv)} / {gib(v.workspace)}"),
        ("expert slots", f"{v.n_slots} × {v.expert_stride / 2**20:.2f} MiB = {gib(v.slots)}, "
                         f"{100 * v.pool_share:.1f}% of {v.pool_experts} experts"),
        ("decode (one sequence, no routing locality)", f"{p.decode_tok_s:.2f} tok/s: {p.decode_ms:.2f} ms per "
         f"token, of which misses {p.miss_ms:.2f} ({p.misses_per_layer:.2f} per MoE layer at B_P {t.b_p:g} / "
         f"B_H {t.b_h:g} GB/s), GPU reads {p.device_ms:.2f}, fixed step work {p.fixed_ms:.2f}"),
        ("prefill", prefill),
    ]
    if family(spec.family).fp8_linears:  # the other dense format, for the choice at compile
        other = "bf16" if spec.dense_format == "fp8" else "fp8"
        o = predict(dataclasses.replace(spec, dense_format=other), t, budget, max_context)
        rows.insert(2, (f"with --dense-format {other}", f"non-expert weights {gib(o.vram.dense)}: "
                        f"{o.vram.n_slots} slots, {100 * o.vram.pool_share:.1f}%; decode {o.decode_tok_s:.2f} tok/s"))
    title = f"on {t.name} ({t.gpu}) within {gib(budget)}, KV for {max_context} tokens"
    return [_model_table(spec, f"spec {source}"), _memory_table(spec), _rows(title, tuple(rows))]


def _rows(title: str, rows: tuple[tuple[str, str], ...]) -> Table:
    table = Table(title=title, show_header=False)
    for k, v in rows:
        table.add_row(k, v)
    return table


def _token_mixers(spec: ModelSpec) -> str:
    la, ml, ix = spec.linear_attention, spec.mla, spec.indexer
    mixers = f"{len(spec.full_attention_layers)} full attention" + (" (gated)" if spec.attention.output_gate else "")
    if ml is not None:
        mixers = (f"{len(spec.full_attention_layers)} latent attention (a {ml.kv_lora_rank} + {ml.rope_dim} cache row "
                  f"per token)")
        if ix is not None:
            mixers += (f", sparse: each query on the top {ix.top_k} tokens of its indexer, run in "
                       f"{ix.layer_types.count('full')} layers")
    if spec.linear_attention_layers:
        mixers = (f"{len(spec.linear_attention_layers)} Gated DeltaNet ({la.num_k_heads} k / {la.num_v_heads} v "
                  f"heads of {la.k_head_dim} / {la.v_head_dim}), " + mixers)
    return mixers


def _model_table(spec: ModelSpec, weights_source: str) -> Table:
    moe = spec.moe
    shared = (f", {moe.num_shared_experts} shared ({moe.shared_expert_intermediate_size})"
              if moe.num_shared_experts else "")
    return _rows(f"{spec.name} ({spec.family})", (
        ("layers", f"{spec.num_layers} ({len(spec.moe_layers)} with experts)"),
        ("token mixers", _token_mixers(spec)),
        ("hidden / heads / kv heads / head dim", f"{spec.hidden_size} / {spec.attention.num_heads} / "
         f"{spec.attention.num_kv_heads} / {spec.attention.head_dim}"),
        ("experts", f"{moe.num_experts} routed ({spec.expert_format}), top-{moe.top_k}, intermediate "
         f"{moe.expert_intermediate_size}, {moe.router}{shared}"),
        ("vocabulary", str(spec.vocab_size)),
        ("multi-token prediction", f"{spec.mtp_layers} layer (experts in the pool; drafts for --speculate mtp:K)"
         if spec.mtp_layers else "none"),
        ("weights", weights_source),
    ))


def _memory_table(spec: ModelSpec) -> Table:
    dense = stored_bytes(stored_dense(spec))
    params = sum(math.prod(s) for s in family(spec.family).dense_tensor_shapes(spec).values())
    pool = len(spec.expert_layers) * spec.moe.num_experts * spec.expert_bytes
    per_token = len(spec.moe_layers) * spec.moe.top_k * spec.expert_bytes
    bf16 = expert_format("bf16").expert_bytes(spec.hidden_size, spec.moe.expert_intermediate_size)
    return _rows("memory", (
        ("non-expert weights", f"{gib(dense)} {spec.dense_format} ({params / 1e9:.3f} B params)"),
        ("expert format", f"{spec.expert_format}: {spec.expert_bytes:,} bytes per expert "
                          f"({bf16 / spec.expert_bytes:.2f}× fewer than bf16)"),
        ("routed-expert pool (host)", f"{gib(pool)} ({spec.expert_bytes / 2**20:.2f} MiB per expert)"),
        ("expert bytes read per token", gib(per_token)),
    ))


def _plan_table(m: EngineManifest) -> Table:
    plan = m.plan
    return _rows("plan", (
        ("target", f"{m.target['name']} ({plan.isa})"),
        ("CPU expert workers", str(plan.cpu_threads or "all physical cores")),
        ("kernel token buckets", ", ".join(map(str, plan.batch_buckets))),
        ("kernel work items", f"gate/up {plan.gate_up_chunk} rows, down {plan.down_chunk} rows, "
         f"prefetch {plan.prefetch_rows} rows ahead"),
        ("kernel check (rel. error)", ", ".join(c["not_run"] if "not_run" in c else
                                                f"{c['tokens']} tok: {c['rel_error']:.1e}"
                                                for c in m.raw.get("kernel_check", []))),
    ))


def _vram_table(m: EngineManifest, budget: int, max_context: int) -> Table:
    header, _ = read_header(m.experts_source())
    plan = plan_vram(m.spec, stored_bytes(stored_dense(m.spec)), budget, header.expert_stride, header.num_rows,
                     max_context)
    t = Table(title=f"GPU memory within --vram-budget {gib(budget)}", show_header=False)
    for k, v in ((f"non-expert weights ({m.spec.dense_format})", gib(plan.dense)),
                 (f"KV cache ({max_context} tokens)", gib(plan.kv)), ("workspace", gib(plan.workspace)),
                 ("expert slots", f"{plan.n_slots} × {plan.expert_stride / 2**20:.2f} MiB = {gib(plan.slots)}"),
                 ("share of the expert pool", f"{100 * plan.pool_share:.1f}% of {plan.pool_experts} experts"),
                 ("prompt chunks", _prefill_mode(m, plan.n_slots)),
                 ("total", gib(plan.total))):
        t.add_row(k, v)
    return t


def _prefill_mode(m: EngineManifest, n_slots: int) -> str:
    """How prompt chunks load their experts within these slots (`OffloadedExperts.begin_pass`)."""
    e, p = m.spec.moe.num_experts, m.plan
    head = f"{p.prefill_chunk} tokens; "
    if n_slots >= 2 * e:
        return head + f"from {p.prefill_stream_min_tokens} tokens whole MoE layers stream through 2 × {e} slots"
    return head + (f"routed experts load on demand: streaming whole layers needs {2 * e} slots "
                   f"(one buffer, --no-overlap: {e})")
