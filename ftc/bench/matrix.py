"""`ftc bench matrix ENGINE`: `ftc bench decode` over several miss policies and routings of one
engine, its expert pool read (or, for a spec, drawn) once and shared by every run: one
`bench_decode` run per (routing, miss policy), each the JSON object `ftc bench decode` prints, and
a table of them (tok/s, ms/token against the bandwidth bound, the miss split). With repeats, each
routing's policies run again in the reverse order each time (a drift of the machine, and the
process's first run, fall on each policy in turn), and the table gives each one's median run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import median_low

from rich.table import Table

from ftc.bench.decode import bench_decode
from ftc.bench.memory import release_device_memory
from ftc_runtime.artifact import EngineManifest
from ftc_runtime.engine import OffloadConfig
from ftc_runtime.experts.routing_trace import RoutingTrace
from ftc_runtime.io import ftw
from ftc_runtime.speculative.config import Speculation


@dataclass(frozen=True)
class Routing:
    """One row set of the matrix: `name` in the table, `label` as `ftc bench decode` names it
    (its JSON's `routing`), `trace` the router choices replayed (None: the model's own router)."""

    name: str
    label: str
    trace: RoutingTrace | None


@dataclass(frozen=True)
class Drafts:
    """How a run drafts: not at all (`speculation` None), with its drafter, or (`oracle` P) from
    the greedy answer at acceptance P (`ftc bench decode --draft-oracle`)."""

    speculation: Speculation | None = None
    oracle: float | None = None


def bench_matrix(engine_dir: Path, offloads: list[OffloadConfig], routings: list[Routing], prompt_tokens: int = 128,
                 new_tokens: int = 64, pool: ftw.ExpertPool | None = None,
                 on_run: Callable[[int, int, Routing, dict], None] | None = None,
                 drafts: list[Drafts] | None = None, repeats: int = 1) -> dict:
    """Every routing under every offload (one per miss policy) and every way of drafting (default:
    none), routing by routing, `repeats` times (the offloads in reverse order every other time).
    `pool`: the experts of an engine compiled with them in memory; else the engine's file, read
    once here. `on_run(i, n, routing, run)` after each of the n runs."""
    if repeats < 1:
        raise ValueError(f"repeats = {repeats}: expected at least 1")
    drafts = drafts or [Drafts()]
    manifest = EngineManifest.read(engine_dir)
    spec = manifest.spec
    for r in routings:  # a trace that does not fit is refused before any run, not after some
        if r.trace is not None:
            r.trace.check_fits(len(spec.moe_layers), spec.moe.num_experts, r.label)
    if pool is None and not manifest.experts_in_memory:  # (else Engine.load says why it needs the pool)
        pool = ftw.load(manifest.experts_source())
    runs, n = [], len(routings) * len(offloads) * len(drafts) * repeats
    for r in routings:
        for repeat in range(repeats):
            for offload in offloads if repeat % 2 == 0 else offloads[::-1]:
                for d in drafts:
                    run = bench_decode(engine_dir, offload, r.trace, r.label, prompt_tokens, new_tokens, pool=pool,
                                       speculation=d.speculation, draft_oracle=d.oracle) | {"repeat": repeat}
                    runs.append(run)
                    release_device_memory()  # the engine's slots must be free before the next one allocates its own
                    if on_run is not None:
                        on_run(len(runs), n, r, run)
    return {"engine": spec.name, "miss_policies": [o.miss_policy for o in offloads], "repeats": repeats,
            "routings": [{"name": r.name, "routing": r.label} for r in routings], "runs": runs}


def median_runs(result: dict) -> list[tuple[dict, list[float]]]:
    """Each (routing, miss policy, drafts)'s run of median tok/s (the lower of the middle two) and
    every repeat's tok/s, in the order they first ran."""
    groups: dict[tuple, list[dict]] = {}
    for run in result["runs"]:
        groups.setdefault((run["routing"], run["miss_policy"], run["speculate"]), []).append(run)
    picked = []
    for runs in groups.values():
        middle = median_low(run["decode_tok_s"] for run in runs)
        picked.append((next(run for run in runs if run["decode_tok_s"] == middle), [r["decode_tok_s"] for r in runs]))
    return picked


def matrix_table(result: dict) -> Table:
    """The runs as a table: a row per (routing, miss policy), routing by routing; with repeats, the
    median run's, and every repeat's tok/s."""
    names = {r["routing"]: r["name"] for r in result["routings"]}
    first = result["runs"][0]
    table = Table(title=f"{result['engine']}: decode on {first['device']}, {first['slots']} expert slots, "
                        f"{first['prompt_tokens']} prompt tokens, {first['decode_tokens']} timed steps",
                  caption="bound: the bandwidth bound in ms/token; m: misses per MoE call; q: of them filled "
                          "into the device cache, the rest computed on the CPU; (cpu alone): the adaptive split's "
                          "trials found the CPU alone faster than its split" +
                          ("; tok/s: the median run's (each run's after it)" if result.get("repeats", 1) > 1 else ""))
    drafting = any("speculation" in run for run in result["runs"])
    for column in ("routing", "policy", *(("drafts",) if drafting else ())):
        table.add_column(column, no_wrap=True)
    for column in ("tok/s", "ms/token", "bound", "×bound", "miss rate", "m", "q",
                   *(("tokens/pass", "accepted") if drafting else ())):
        table.add_column(column, justify="right", no_wrap=True)
    for run, each in median_runs(result):
        table.add_row(*_row(run, names, drafting, each))
    return table


def _row(run: dict, names: dict[str, str], drafting: bool, each: list[float]) -> list[str]:
    e, over = run["experts"], run["measured_over_bound"]
    s = run.get("speculation")
    trials = run.get("split_trials")
    policy = run["miss_policy"] + (" (cpu alone)" if trials and trials["arm"] == "cpu" else "")
    row = [names.get(run["routing"], run["routing"]), policy, *((run["speculate"],) if drafting else ()),
           f"{run['decode_tok_s']:.2f}" + (f" ({', '.join(f'{x:.2f}' for x in each)})" if len(each) > 1 else ""),
           f"{run['ms_per_token']:.2f}", f"{run['bound_ms_per_token']:.2f}",
           "-" if over is None else f"{over:.2f}", f"{e['miss_rate']:.3f}", f"{e['mean_m']:.2f}", f"{e['mean_q']:.2f}"]
    if drafting:
        row += [f"{s['tokens_per_step']:.2f}", f"{s['acceptance']:.2f}"] if s else ["1.00", "-"]
    return row
