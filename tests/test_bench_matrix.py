"""`ftc bench matrix` on the tiny engine, the CPU standing in for the GPU: one `bench decode` run
per (routing, miss policy), in order, each what `bench decode` prints for it, and the table."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ftc.cli.main import app
from ftc.compile.pipeline import CompileOptions, compile_engine

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "model_specs" / "qwen3-moe-tiny.yaml"
SHORT = ["--device", "cpu", "--slots", "12", "--prompt-tokens", "4", "--new-tokens", "4"]
UNIFORM = "synthetic (locality 0, Zipf 0, seed 0)"  # `bench decode --synthetic-locality 0 --zipf 0`


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    return compile_engine(CompileOptions(TINY, "auto", tmp_path_factory.mktemp("matrix") / "tiny", random_weights=True,
                                         seed=5))


def ftc(*args) -> str:
    r = CliRunner().invoke(app, list(map(str, args)))
    assert r.exit_code == 0, r.output
    return r.stdout


def test_bench_matrix_runs_bench_decode_per_policy_and_routing(engine, tmp_path):
    policies = random.sample(["adaptive", "gpu", "cpu", "half"], 2)
    out = tmp_path / "matrix.json"
    table = ftc("bench", "matrix", engine, *SHORT, "--miss-policy", ",".join(policies), "--uniform", "-o", out)
    x = json.loads(out.read_text())
    runs = x["runs"]
    assert [(r["routing"], r["miss_policy"]) for r in runs] == [(UNIFORM, p) for p in policies]
    assert x["routings"] == [{"name": "uniform", "routing": UNIFORM}] and x["miss_policies"] == policies
    for r in runs:
        e = r["experts"]
        assert e["hits"] + e["fills"] + e["cpu"] == e["unique"] > 0 and r["decode_tok_s"] > 0, r
        assert r["decode_tokens"] == 3 and r["slots"] == 12 and r["device"] == "cpu"
        if r["miss_policy"] == "gpu":
            assert e["cpu"] == 0 and e["fills"] > 0, e
        if r["miss_policy"] == "cpu":
            assert e["fills"] == 0 and e["cpu"] > 0, e
    # a run is the JSON `bench decode` prints with the same options: the same fields and, the
    # routing replayed, the same split of the same experts
    policy = random.choice(policies)
    alone = json.loads(ftc("bench", "decode", engine, *SHORT, "--miss-policy", policy, "--synthetic-locality", "0",
                           "--zipf", "0"))
    run = runs[policies.index(policy)]
    assert run.keys() == alone.keys() | {"repeat"} and run["repeat"] == 0
    split = ("calls", "unique", "hits", "fills", "cpu")
    assert {k: run["experts"][k] for k in split} == {k: alone["experts"][k] for k in split}
    # the table: a row per run, in order, with its tok/s
    rows = [line for line in table.splitlines() if "uniform" in line]
    assert len(rows) == len(runs), table
    for row, r in zip(rows, runs, strict=True):
        assert r["miss_policy"] in row and f"{r['decode_tok_s']:.2f}" in row, (row, r)


def test_bench_matrix_repeats_the_policies_in_turn_and_gives_each_ones_median(engine, tmp_path):
    """--repeats 3: the policies run in order, then reversed, then in order again; the table's row
    of each policy has the tok/s of its median run, then every run's."""
    policies = random.sample(["adaptive", "gpu", "cpu", "half"], 2)
    out = tmp_path / "matrix.json"
    table = ftc("bench", "matrix", engine, *SHORT, "--miss-policy", ",".join(policies), "--uniform", "--repeats", "3",
                "-o", out)
    runs = json.loads(out.read_text())["runs"]
    order = policies + policies[::-1] + policies
    assert [(r["miss_policy"], r["repeat"]) for r in runs] == [(p, i // 2) for i, p in enumerate(order)]
    rows = [line for line in table.splitlines() if "uniform" in line]
    assert len(rows) == len(policies), table
    for row, policy in zip(rows, policies, strict=True):
        each = [r["decode_tok_s"] for r in runs if r["miss_policy"] == policy]
        assert policy in row and f"{sorted(each)[1]:.2f} ({', '.join(f'{x:.2f}' for x in each)})" in row, (row, each)


def test_bench_matrix_refuses_bad_policies_and_routings_before_it_runs(engine):
    for args, said in ((["--miss-policy", "gpu,fast"], "--miss-policy"), (["--miss-policy", "gpu,gpu"], "each once"),
                       (["--zipf", "0"], "--synthetic-locality"), (["--synthetic-locality", "0.5,2"], "[0, 1]"),
                       (["--routing-trace", engine / "none.npz"], "none.npz")):
        r = CliRunner().invoke(app, list(map(str, ["bench", "matrix", engine, "--device", "cpu", *args])))
        lines = r.stderr.strip().splitlines()
        assert r.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: ") and said in lines[0], r.output


def test_bench_matrix_drafts_each_run_as_asked(engine, tmp_path):
    """With --speculate and --draft-oracle, each (routing, policy) runs without drafts, then with
    the oracle's at each P: at P = 1 every draft is accepted, at P = 0 none."""
    k = random.randrange(1, 4)
    out = tmp_path / "matrix.json"
    table = ftc("bench", "matrix", engine, *SHORT[:-1], "8", "--miss-policy", "adaptive", "--uniform",
                "--speculate", f"ngram:{k}", "--draft-oracle", "1,0", "-o", out)
    runs = json.loads(out.read_text())["runs"]
    assert [r["speculate"] for r in runs] == ["off", f"oracle (P = 1):{k}", f"oracle (P = 0):{k}"]
    assert "speculation" not in runs[0]
    assert runs[1]["speculation"]["acceptance"] == 1.0 and runs[2]["speculation"]["accepted"] == 0
    assert "tokens/pass" in table and "oracle (P = 1)" in table
