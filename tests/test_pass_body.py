"""A speculative verification pass as the decode graphs run it (`DecodeGraphs.step_pass`: one
whole-step graph over n rows of one sequence at consecutive positions), its body run uncaptured on
the CPU and held to the family's forward of the same chunk: every row's logits, the state it leaves
(keys and values, a hybrid's linear layers, DeepSeek-V4's compressed state), and for the hybrid the
linear state after each row (`row_states`, which a rejected draft rewinds to). On the GPU the same
body is captured and replayed: its passes are held to the eager chunk forward within bf16's rounding,
and test_mtp's GPU test holds the drafted answers there."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ftc.compile.pipeline import CompileOptions, compile_engine
from ftc_runtime import Engine
from ftc_runtime.decode.step_buffers import StepBuffers
from ftc_runtime.engine import OffloadConfig
from ftc_runtime.models import family

SPECS = ["qwen3-moe-tiny.yaml", "qwen3.6-moe-tiny.yaml", "glm-5-tiny.yaml", "deepseek-v4-tiny.yaml"]


@pytest.fixture(scope="module", params=SPECS)
def pass_engine_dir(request, tmp_path_factory) -> Path:
    spec = Path(__file__).resolve().parents[1] / "model_specs" / request.param
    return compile_engine(CompileOptions(source=spec, target="cpu", random_weights=True, seed=5,
                                         output=tmp_path_factory.mktemp("pass") / "e"))


@pytest.fixture(scope="module")
def engine(pass_engine_dir) -> Engine:
    return Engine.load(pass_engine_dir, offload=OffloadConfig(device="cpu", n_slots=12))


class _StagedOnHost:
    """The expert backend's device-step calls (`run_staged_on_device`, `token_outputs`) carried out
    by its host path on the call `stage` queued (`forward_staged`): what the body asks of the
    experts, uncaptured."""

    def __init__(self, experts, hidden: int, t: int):
        self.experts, self.t = experts, t
        self.out = torch.zeros(t, hidden)

    def run_staged_on_device(self, moe_layer, k, position, timeline=None) -> None:
        self.out.copy_(self.experts.forward_staged(moe_layer, self.t, k, int(position[0])))

    def token_outputs(self, t: int = 1):
        return self.out[:t], None


def _run_body(engine: Engine, tokens: list[int], cache, monkeypatch) -> tuple[torch.Tensor, list | None]:
    """The body of a pass of `tokens` on `cache`, as `step_pass` captures it: logits, row states."""
    m, n = engine.model, len(tokens)
    graphs = family(engine.spec.family).decode_graphs(m, compile_fns=False, fused_body=False)
    staged = _StagedOnHost(m.experts, engine.spec.hidden_size, n)
    for name in ("run_staged_on_device", "token_outputs"):
        monkeypatch.setattr(m.experts, name, getattr(staged, name))
    start = cache.length
    cache.reserve(start + n)
    graphs.io = StepBuffers.make(m, n, graphs.streams)
    graphs.f, graphs.row_states = graphs.eager_fns, graphs._row_states(cache, n)
    graphs.io.set_inputs(tokens, list(range(start, start + n)))
    graphs._device_step([cache] * n)
    for _ in range(n):
        cache.stepped()
    monkeypatch.undo()
    return graphs.io.logits.clone(), graphs.row_states


def test_a_pass_body_runs_its_rows_as_the_forward_runs_the_chunk(engine, monkeypatch, seed):
    rng = random.Random(seed)
    m, vocab = engine.model, engine.spec.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(3, 60))]  # past a GLM indexer's top_k too
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(2, 6))]
    want_cache, got_cache = m.new_cache(), m.new_cache()
    with torch.inference_mode():
        for cache in (want_cache, got_cache):
            m.forward(torch.tensor(prompt), cache)
        start = want_cache.length
        hybrid = getattr(want_cache, "linear", None) and not want_cache.rewinds_by_replay
        at = tuple(range(len(tokens))) if hybrid else ()
        want = m.forward(torch.tensor(tokens), want_cache, True, checkpoint_at=at)
        got, rows = _run_body(engine, tokens, got_cache, monkeypatch)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=lambda s: f"seed={seed}: {s}")
        assert got_cache.length == want_cache.length == start + len(tokens)
        after = torch.tensor([rng.randrange(vocab)])  # the state each left: the next token's logits
        torch.testing.assert_close(m.forward(after, got_cache), m.forward(after, want_cache), rtol=1e-4, atol=1e-4,
                                   msg=lambda s: f"seed={seed}: {s}")
    assert (rows is not None) == bool(hybrid), f"seed={seed}"
    for r in range(len(tokens) if hybrid else 0):
        for row, kept in zip(rows[r], want_cache.checkpoints[start + r + 1].states, strict=True):
            torch.testing.assert_close(row.recurrent, kept.recurrent, rtol=1e-4, atol=1e-4,
                                       msg=lambda s, r=r: f"seed={seed}: row {r}: {s}")
            torch.testing.assert_close(row.conv, kept.conv, rtol=1e-4, atol=1e-4,
                                       msg=lambda s, r=r: f"seed={seed}: row {r}: {s}")


# The most the passes' median row may be from the eager chunk's, relative: bf16 rounding of a graph's
# one-row kernels against a chunk's (test_gpu_parity holds decode steps to the same bound; a row
# where bf16 flipped a router's near tie stands out alone, a wrong state moves most rows)
STEADY_BF16 = 3e-2


@pytest.mark.gpu
def test_gpu_pass_graphs_give_the_chunk_forwards_logits(pass_engine_dir, seed):
    """On the GPU, passes of 2 to 5 tokens, each width three times in a row (an eager run, its
    capture, then a replay), give the eager chunk forward's logits on a twin sequence (their median
    row within STEADY_BF16), pass after pass: each pass leaves the state the forward leaves."""
    from families import rel_rows

    engine = Engine.load(pass_engine_dir, offload=OffloadConfig(device="cuda", n_slots=12))
    m, rng = engine.model, random.Random(seed)
    vocab = engine.spec.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(3, 40))]
    want_cache, got_cache = m.new_cache(), m.new_cache()
    for cache in (want_cache, got_cache):
        engine.prefill(torch.tensor(prompt), cache)
    passes = [[rng.randrange(vocab) for _ in range(n)] for n in rng.sample(range(2, 6), 2) for _ in range(3)]
    # The chunks first: their experts' host path would make the device step, and its graphs, anew
    wants = [m.forward(torch.tensor(tokens), want_cache, True) for tokens in passes]
    errors = torch.cat([rel_rows(m.verify_pass(tokens, got_cache).float().cpu(), want.float().cpu())
                        for tokens, want in zip(passes, wants, strict=True)])
    assert got_cache.length == want_cache.length, f"seed={seed}"
    replayed = [n for n, c in m.decode_graphs.captures.items() if c.graphs and n > 1]
    assert replayed, f"seed={seed}: no pass replayed"
    assert float(errors.median()) < STEADY_BF16, f"seed={seed}: rows {errors.tolist()}"
