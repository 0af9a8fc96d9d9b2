"""Speculative decoding (`ftc_runtime.speculative`, `--speculate ngram:K`): the prompt-lookup drafter
against a brute-force search; greedy output token for token the same as without speculation, for
every family, on the CPU engine, the offload path and with the prefix cache; the sampling rule's
tokens distributed as the plain sampler's (first token, and whole answers of a fake target with
penalties); a rolled-back cache (cut back, or DeepSeek-V4's rewound and run again) decoding as if
the rejected drafts had never run."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from itertools import product
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ftc.cli.main import app
from ftc.compile.pipeline import CompileOptions, compile_engine
from ftc.compile.spec_loader import load_spec
from ftc_runtime import Engine, GenerationStats, SamplingParams
from ftc_runtime.cache.kv import KVCache
from ftc_runtime.cache.sequence import SequenceCache
from ftc_runtime.engine import OffloadConfig
from ftc_runtime.generation import Sequence
from ftc_runtime.sampling import Sampler
from ftc_runtime.speculative.config import Speculation, parse_speculation
from ftc_runtime.speculative.controller import DraftController
from ftc_runtime.speculative.ngram import NgramDrafter
from ftc_runtime.speculative.oracle import DraftOracle
from ftc_runtime.speculative.verify import judge, verify

SPECS = Path(__file__).resolve().parents[1] / "model_specs"
# Every family's state rolls back: a KV cache alone (cut back), the hybrid's linear layers beside it
# (to the state its pass kept), DeepSeek-V4's compressed state (rewound, the kept tokens run again)
ROLLS_BACK = ("qwen3-moe-tiny", "glm-5-tiny", "qwen3.6-moe-tiny", "deepseek-v4-tiny")
TEXT_IDS = 400  # prompt tokens below every tiny spec's special tokens
SE_BOUND = 5  # frequencies within 5 standard errors of the exact probability (each: 6e-7 false alarm)


# -- the drafter ------------------------------------------------------------------------------------


def reference_draft(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """What `NgramDrafter.propose` must return, by scanning: for n from hi down to lo, the latest
    earlier occurrence of the last n tokens, the k tokens after it, the copy continued with its
    period where the sequence ends first."""
    end_of = len(tokens)
    for n in range(min(hi, end_of), lo - 1, -1):
        for after in range(end_of - 1, n - 1, -1):  # the occurrence tokens[after - n:after], a token after it
            if tokens[after - n:after] == tokens[end_of - n:]:
                draft: list[int] = []
                for i in range(k):
                    draft.append(tokens[after + i] if after + i < end_of else draft[i - (end_of - after)])
                return draft
    return []


def planted(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Random tokens with copies of earlier stretches planted in them (and loops, from short copies)."""
    tokens: list[int] = []
    while len(tokens) < length:
        if tokens and rng.random() < 0.4:
            a = rng.randrange(len(tokens))
            tokens += tokens[a:a + rng.randrange(1, 12)]
        else:
            tokens += [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
    return tokens[:length]


def test_ngram_drafts_equal_a_brute_force_search(seed):
    rng = random.Random(seed)
    for _ in range(30):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        tokens = planted(rng, rng.randrange(1, 120), rng.choice([2, 5, 50]))
        drafter = NgramDrafter(tokens[:1], lo, hi)
        for i in range(1, len(tokens) + 1):
            k = rng.randrange(0, 10)
            assert drafter.propose(k) == reference_draft(tokens[:i], k, lo, hi), (tokens[:i], k, lo, hi)
            if i < len(tokens):
                drafter.add(tokens[i])
        assert len(drafter) == len(tokens)


def test_ngram_drafts_follow_the_latest_longest_match():
    drafter = NgramDrafter([9, 1, 2, 3, 7, 5, 2, 3, 8, 1, 2, 3])
    assert drafter.propose(3) == [7, 5, 2]  # (1, 2, 3) last occurred before 7, not (2, 3) before 8
    drafter.add(4)
    assert drafter.propose(2) == []  # 4 never occurred before
    assert NgramDrafter([6, 6, 6]).propose(4) == [6, 6, 6, 6]  # a loop drafts k tokens
    with pytest.raises(ValueError, match="n-gram"):
        NgramDrafter(min_ngram=3, max_ngram=2)


# -- the option, the families ----------------------------------------------------------------------


def test_speculate_values_and_the_families_that_take_them():
    assert parse_speculation("off") is None and parse_speculation(" NGRAM:3 ") == Speculation("ngram", 3)
    assert parse_speculation("mtp:2") == Speculation("mtp", 2)
    for bad in ("ngram:0", "ngram:9", "ngram", "ngram:", "mtp:0", "mtp:9", "mtp", "on", "off:1", "ngram:-1", "ngram:x"):
        with pytest.raises(ValueError, match=f"--speculate '{bad}'"):
            parse_speculation(bad)
    for name in ROLLS_BACK:
        spec = load_spec(SPECS / f"{name}.yaml")[0]
        with pytest.raises(ValueError, match="no multi-token-prediction layer"):  # the tiny specs have none
            Speculation("mtp", 2).check_family(spec)
        Speculation("ngram", 2).check_family(spec)


class _Recurrent:
    """A stand-in recurrent layer state: all `truncate` looks at is that there is one."""


def test_truncate_cuts_a_kv_cache_and_refuses_recurrent_state():
    cache = SequenceCache(KVCache(2, 1, 4, torch.float32))
    for layer in range(2):
        cache.kv.append(layer, torch.ones(5, 1, 4), torch.ones(5, 1, 4))
    cache.length = 5
    cache.truncate(3)
    assert cache.length == 3 and cache.kv.keys(0).shape[0] == 3
    for n in (-1, 4):
        with pytest.raises(ValueError, match=f"truncate to token {n}"):
            cache.truncate(n)
    with pytest.raises(ValueError, match="recurrent"):
        SequenceCache(KVCache(1, 1, 4, torch.float32), [_Recurrent()]).truncate(0)


# -- greedy: the same tokens -----------------------------------------------------------------------


@pytest.fixture(scope="module", params=ROLLS_BACK)
def family_dir(request, tmp_path_factory) -> Path:
    return compile_engine(CompileOptions(source=SPECS / f"{request.param}.yaml", target="cpu", random_weights=True,
                                         seed=5, output=tmp_path_factory.mktemp("spec") / request.param))


def repeating_prompt(rng: random.Random) -> list[int]:
    """Random text in which one span comes back twice, the prompt ending inside its last copy."""
    def text(n: int) -> list[int]:
        return [rng.randrange(TEXT_IDS) for _ in range(n)]

    span = text(rng.randrange(4, 12))
    return text(rng.randrange(2, 10)) + span + text(rng.randrange(2, 8)) + span + text(2) \
        + span[:rng.randrange(1, len(span))]


def load(engine_dir: Path, mode: str, speculation: Speculation | None) -> Engine:
    """The engine as `mode` runs it: all on the CPU ("cpu", "prefix": with a prefix cache), or
    offloaded to the CPU standing in for a GPU, few slots so that misses split ("offload")."""
    offload = OffloadConfig(device="cpu", n_slots=6, b_p=20.0, b_h=40.0) if mode == "offload" else None
    engine = Engine.load(engine_dir, offload=offload)
    if mode == "prefix":
        engine.enable_prefix_cache(kv_budget=1 << 30, checkpoint_budget=1 << 30)
    engine.enable_speculation(speculation)
    return engine


def session(engine: Engine, parts: list[list[int]], news: list[int]) -> tuple[list[list[int]], list[GenerationStats]]:
    """Turns of one conversation, each prompt the history so far and the next part (a prefix cache
    resumes each after the last): each turn's greedy tokens and statistics, stopping at EOS."""
    history, outs, stats = [], [], []
    for part, new in zip(parts, news, strict=True):
        history += part
        gen = engine.generate(history, new, SamplingParams(0.0))
        outs.append(list(gen))
        stats.append(gen.stats)
        history += outs[-1]
    return outs, stats


def a_draft_would_hit(parts: list[list[int]], outs: list[list[int]]) -> bool:
    """Whether the drafter's first draft, at some position of an answer that a step drafts (not its
    first token, which the prompt's pass gives, nor its last), is the token there: then ngram:1
    accepts a draft (that position is a draft's, or one already accepted put it past one)."""
    history = []
    for part, out in zip(parts, outs, strict=True):
        history += part
        drafter = NgramDrafter(history + out[:1])
        for token in out[1:-1]:
            if drafter.propose(1) == [token]:
                return True
            drafter.add(token)
        history += out
    return False


@pytest.mark.parametrize("mode", ["cpu", "offload", "prefix"])
def test_greedy_speculation_gives_the_tokens_of_plain_decoding(family_dir, mode, seed):
    rng = random.Random(seed)
    for _ in range(20):  # a conversation in which speculation accepts drafts, else the test tests little
        parts = [repeating_prompt(rng) for _ in range(3)]
        news = [rng.randrange(8, 48) for _ in parts]
        want, plain = session(load(family_dir, mode, None), parts, news)
        if a_draft_would_hit(parts, want):
            break
    accepted = 0
    for k in range(1, 5):
        engine = load(family_dir, mode, Speculation("ngram", k))
        got, stats = session(engine, parts, news)
        assert got == want, f"ngram:{k}"
        # The prefix cache holds what it holds without speculation: drafts run past the end dropped.
        assert [s.reused_tokens for s in stats] == [s.reused_tokens for s in plain], f"ngram:{k}"
        if engine.prefix_cache is not None:
            assert engine.prefix_cache.stats.inserted_tokens == sum(len(p) for p in parts) + sum(map(len, got)) - 1
        assert all(s.decode_steps <= s.new_tokens - 1 for s in stats)
        accepted += sum(s.accepted for s in stats)
    assert accepted > 0, "no draft was accepted: the test checked no speculative run"


def test_cli_run_speculates_to_the_same_tokens(engine_dir, seed):
    ids = ",".join(map(str, repeating_prompt(random.Random(seed))))
    runner = CliRunner()

    def tokens(*more: str) -> list[int]:
        r = runner.invoke(app, ["run", str(engine_dir), "--prompt-ids", ids, "--max-new-tokens", "24", "--json", *more])
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["tokens"]

    assert tokens("--speculate", "ngram:3") == tokens() == tokens("--speculate", "off")


# -- rollback --------------------------------------------------------------------------------------


def test_a_speculative_sequence_counts_its_pass_states_in_its_vram_need(family_dir, seed):
    """A speculative pass of k + 1 tokens leaves two copies of the recurrent state per token (its
    row buffers and the copies a rejection rewinds to): the bytes a speculative sequence asks the
    VRAM split for (`kv_need`, `bytes_for`) exceed a plain one's by that, counted here from the
    state's own tensors; a family without recurrent state, or that rewinds by replay (DeepSeek-V4),
    asks for nothing more."""
    engine = load(family_dir, "cpu", None)
    k = random.Random(seed).randrange(1, 5)
    prompt = repeating_prompt(random.Random(seed))
    plain, drafted = (Sequence(prompt, 8, SamplingParams(0.0), frozenset(), speculation=s)
                      for s in (None, Speculation("ngram", k)))
    for seq in (plain, drafted):
        seq.start(engine)
    (cache, n), (plain_cache, plain_n) = drafted.kv_need(), plain.kv_need()
    assert n == plain_n == len(prompt), f"seed={seed}"  # the prompt is read first
    hybrid = "qwen3.6" in family_dir.name  # Gated DeltaNet layers: a convolution's inputs and a recurrent state
    state = sum(t.numel() * t.element_size() for s in cache.linear for t in (s.conv, s.recurrent)) if hybrid else 0
    assert (state > 0) == hybrid, f"seed={seed}: {family_dir.name}"
    want = 2 * (k + 1) * state
    assert cache.bytes_for(n) - plain_cache.bytes_for(n) == want, f"seed={seed}: {family_dir.name}, k={k}"


def test_a_truncated_cache_decodes_as_if_the_drafts_never_ran(family_dir, seed):
    """After a pass of a token and 4 drafts, the cache cut back to the token and j drafts (each j)
    gives the next token the logits of a cache that ran those alone; a recurrent state rewinds to
    the state the pass took after that token."""
    rng = random.Random(seed)
    engine = Engine.load(family_dir)
    prompt, run, after = repeating_prompt(rng), [rng.randrange(TEXT_IDS) for _ in range(5)], rng.randrange(TEXT_IDS)
    for j in range(5):
        cut = engine.model.new_cache()
        engine.prefill(torch.tensor(prompt), cut)
        engine.model.forward(torch.tensor(run), cut, True, checkpoint_at=tuple(range(5)) if cut.recurrent else ())
        cut.truncate(len(prompt) + 1 + j, cut.checkpoints.get(len(prompt) + 1 + j))
        fresh = engine.model.new_cache()
        engine.prefill(torch.tensor(prompt), fresh)
        engine.prefill(torch.tensor(run[:1 + j]), fresh, all_logits=True)
        got, want = engine.prefill(torch.tensor([after]), cut), engine.prefill(torch.tensor([after]), fresh)
        assert cut.length == fresh.length == len(prompt) + 2 + j
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"cut after {j} drafts")


def test_a_rewound_compressed_state_decodes_as_if_the_drafts_never_ran(tmp_path, seed):
    """DeepSeek-V4's pass cannot keep its compressed state after each token: after a pass of a
    token and 4 drafts over the prompt, the state rewound to its mark from before the pass and the
    token with j drafts run again holds, at every j, what a cache that ran those alone holds (every
    layer's rows, windows and entries), and gives the next token the same logits. Prompts of random
    length put the drafts across the ends of the ring and of the compressors' windows (4 and 16)."""
    engine = Engine.load(compile_engine(CompileOptions(source=SPECS / "deepseek-v4-tiny.yaml", target="cpu",
                                                       random_weights=True, seed=seed % 1000, output=tmp_path / "e")))
    rng = random.Random(seed)
    for j in range(5):
        prompt = [rng.randrange(TEXT_IDS) for _ in range(rng.randrange(12, 48))]
        run, after = [rng.randrange(TEXT_IDS) for _ in range(5)], rng.randrange(TEXT_IDS)
        rewound, fresh = engine.model.new_cache(), engine.model.new_cache()
        for cache in (rewound, fresh):
            engine.prefill(torch.tensor(prompt), cache)
        mark = rewound.mark()
        engine.model.forward(torch.tensor(run), rewound, True)
        rewound.rewind(mark)
        for cache in (rewound, fresh):
            engine.prefill(torch.tensor(run[:1 + j]), cache, all_logits=True)
        assert rewound.length == fresh.length == len(prompt) + 1 + j
        for i, (a, b) in enumerate(zip(rewound.layers, fresh.layers, strict=True)):
            assert all(torch.equal(x, y) for x, y in zip(a.parts(), b.parts(), strict=True)), \
                f"seed={seed}: layer {i}, {j} drafts kept of a prompt of {len(prompt)}"
        got, want = engine.prefill(torch.tensor([after]), rewound), engine.prefill(torch.tensor([after]), fresh)
        assert torch.equal(got, want), f"seed={seed}: {j} drafts kept of a prompt of {len(prompt)}"


# -- the acceptance rule ---------------------------------------------------------------------------


def test_greedy_verification_keeps_the_drafts_up_to_the_first_miss(seed):
    rng = random.Random(seed)
    for _ in range(50):
        k, vocab = rng.randint(1, 6), 8
        logits = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        best = logits.argmax(-1).tolist()
        miss = rng.randint(0, k)  # the first draft that is not the argmax (k: none)
        drafts = best[:miss] + [(best[miss] + rng.randint(1, vocab - 1)) % vocab for _ in range(miss < k)]
        drafts += [rng.randrange(vocab) for _ in range(k - len(drafts))]
        assert verify(Sampler(SamplingParams(0.0)), logits, drafts) == best[:miss + 1]


def within_standard_errors(counts: Counter, n: int, probs: dict, what: str) -> None:
    """Each outcome's frequency within SE_BOUND standard errors of its exact probability (a
    probability of 0: never drawn)."""
    for outcome in set(probs) | set(counts):
        p, f = probs.get(outcome, 0.0), counts[outcome] / n
        assert abs(f - p) <= SE_BOUND * math.sqrt(p * (1 - p) / n) + 1e-12, \
            f"{what}: {outcome} drawn at {f:.5f}, probability {p:.5f} ({n} draws)"


def test_the_first_token_of_a_sampled_verification_is_distributed_as_the_plain_samplers(seed):
    """Drafts the target finds likely, unlikely and impossible (outside top-k): 70,000 judged
    tokens each, their frequencies against the distribution the plain sampler draws from."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    logits = torch.randn(6) * 1.5
    params = SamplingParams(temperature=rng.uniform(0.5, 1.5), top_k=5, top_p=rng.uniform(0.9, 1.0), seed=seed)
    plain = Sampler(params)
    p = plain.distribution(logits)
    probs = {t: float(p[t]) for t in range(6)}
    order = sorted(probs, key=probs.get)
    assert probs[order[0]] == 0  # top-k cut it
    n = 70_000
    for draft in (order[-1], order[2], order[0]):
        sampler = Sampler(params)
        counts = Counter(judge(sampler, logits, draft) for _ in range(n))
        within_standard_errors(counts, n, probs, f"draft {draft}")


class MarkovModel:
    """A fake target whose next-token logits depend on the token run and its position mod 3 (so a
    cache left too long or too short changes them). Its cache is the list of tokens run."""

    def __init__(self, table: torch.Tensor):
        self.table = table  # [3, vocab, vocab]
        self.experts = self

    def end_of_prompt(self) -> None:
        pass

    def new_cache(self) -> FakeCache:
        return FakeCache()

    def run(self, ids: list[int], cache: FakeCache) -> torch.Tensor:
        start = cache.length
        cache.tokens += ids
        return torch.stack([self.table[(start + i) % 3, t] for i, t in enumerate(ids)])

    def decode_batch(self, tokens: list[int], caches: list[FakeCache]) -> torch.Tensor:
        return torch.cat([self.run([t], c) for t, c in zip(tokens, caches, strict=True)])

    def forward(self, ids: torch.Tensor, cache: FakeCache, all_logits: bool = False) -> torch.Tensor:
        logits = self.run(ids.tolist(), cache)
        return logits if all_logits else logits[-1:]

    def verify_pass(self, tokens: list[int], cache: FakeCache, checkpoint_at: tuple[int, ...] = (),
                    hidden: list[torch.Tensor] | None = None) -> torch.Tensor:
        assert not checkpoint_at and hidden is None, "a cache without recurrent state needs no states inside a pass"
        return self.run(tokens, cache)


class FakeCache:
    recurrent = False
    rewinds_by_replay = False  # cut back by `truncate`

    def __init__(self):
        self.tokens: list[int] = []
        self.checkpoints: dict = {}

    @property
    def length(self) -> int:
        return len(self.tokens)

    def truncate(self, n: int, checkpoint: None = None) -> None:
        del self.tokens[n:]


class MarkovEngine:
    """What `Engine._run` (the loop `Engine.generate` drives a sequence with) needs of an engine."""

    prefill_chunk = 64
    prefix_cache = None
    boundary_ids = frozenset()
    _run = Engine._run

    def __init__(self, table: torch.Tensor):
        self.model = MarkovModel(table)

    def rebalance(self, needs: list) -> None:
        pass

    def prefill(self, ids: torch.Tensor, cache: FakeCache, all_logits: bool = False, **_) -> torch.Tensor:
        return self.model.forward(ids, cache, all_logits)

    def generate(self, prompt: list[int], new: int, params: SamplingParams, stop: frozenset[int] = frozenset(),
                 speculation: Speculation | None = None) -> tuple[list[int], GenerationStats]:
        seq, stats = Sequence(list(prompt), new, params, stop, speculation=speculation), GenerationStats()
        out = list(self._run(seq, stats))
        assert seq.cache is None  # finished
        return out, stats


def exact_answers(engine: MarkovEngine, prompt: list[int], params: SamplingParams, new: int) -> dict:
    """The probability of each answer of `new` tokens under the plain sampler, step by step: its
    distribution after the prompt and each earlier answer token (penalties included)."""
    vocab, probs = engine.model.table.shape[-1], {}
    for answer in product(range(vocab), repeat=new):
        sampler, p, ids = Sampler(params, prompt), 1.0, list(prompt)
        for token in answer:
            p *= float(sampler.distribution(engine.model.run(ids, FakeCache())[-1])[token])
            sampler.record(token)
            ids.append(token)
        probs[answer] = p
    return probs


def test_sampled_answers_with_speculation_are_distributed_as_without(seed):
    """Whole answers of 3 tokens from a fake target, with every sampling transform and penalties
    (which depend on each token given out), each answer's frequency over 12,000 speculative runs
    within bounds of its exact probability under the plain sampler."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    vocab = 3
    engine = MarkovEngine(torch.randn(3, vocab, vocab, generator=gen) * 2)
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]  # drafts are proposed from the first token on
    params = dict(temperature=rng.uniform(0.7, 1.3), top_p=rng.uniform(0.9, 1.0), repetition_penalty=1.3,
                  presence_penalty=0.4, frequency_penalty=0.2)
    probs = exact_answers(engine, prompt, SamplingParams(**params), 3)
    n, counts, drafted = 12_000, Counter(), 0
    for i in range(n):
        out, stats = engine.generate(prompt, 3, SamplingParams(**params, seed=i), speculation=Speculation("ngram", 2))
        counts[tuple(out)] += 1
        drafted += stats.drafted
    assert drafted >= n
    within_standard_errors(counts, n, probs, "answer")


def test_a_stop_token_inside_an_accepted_run_ends_the_answer_there():
    """A target that loops 1 2 3 4 and a prompt of that loop: every draft is accepted; a stop
    token, or max_new_tokens, inside a run ends the answer there, the rest of the run dropped."""
    table = torch.full((3, 6, 6), -10.0)
    for t in range(1, 5):
        table[:, t, t % 4 + 1] = 10.0
    engine, greedy = MarkovEngine(table), SamplingParams(0.0)
    prompt = [1, 2, 3, 4, 1, 2, 3]
    out, stats = engine.generate(prompt, 20, greedy, speculation=Speculation("ngram", 4))
    assert out == [4, 1, 2, 3] * 5 and stats.decode_steps == 4 and stats.accepted == stats.drafted == 15
    for stop, new in ((2, 20), (4, 20), (5, 3), (5, 7)):
        want, _ = engine.generate(prompt, new, greedy, frozenset({stop}))
        got, stats = engine.generate(prompt, new, greedy, frozenset({stop}), Speculation("ngram", 4))
        assert got == want and stats.decode_steps <= 2, (stop, new)


# -- the draft oracle (benchmarks) -----------------------------------------------------------------


def test_the_draft_oracle_drafts_the_answer_right_with_probability_p(seed):
    """Each draft is the answer's token with probability P (within 5 standard errors over 20,000
    drafts), else another token of the vocabulary; the drafts follow the tokens given out."""
    rng = random.Random(seed)
    vocab, p = rng.randrange(2, 50), rng.uniform(0.1, 0.9)
    answer = tuple(rng.randrange(vocab) for _ in range(40))
    drafter = Speculation("ngram", 4, DraftOracle(answer, p, vocab, seed)).new_drafter([1, 2, 3], None, 0)
    right = total = 0
    for given in range(1, 40):
        drafter.add(answer[given - 1])
        for _ in range(128):
            for i, d in enumerate(drafter.propose(4)):
                assert 0 <= d < vocab, f"seed={seed}"
                right, total = right + (d == answer[given + i]), total + 1
    assert total == sum(min(4, 40 - g) for g in range(1, 40)) * 128
    assert abs(right / total - p) < 5 * math.sqrt(p * (1 - p) / total), f"seed={seed}: {right / total} for P = {p}"
    with pytest.raises(ValueError, match="--draft-oracle 1.5"):
        DraftOracle(answer, 1.5, vocab)


def test_an_oracle_run_gives_its_answer_whatever_the_logits(seed):
    """An oracle run's sampler picks the answer's tokens (random weights' near ties, which a pass's
    rounding breaks its own way, do not move it off the answer): a draft equal to the answer's
    token is kept, another is replaced by it; past the answer's end, the argmax."""
    rng = random.Random(seed)
    vocab = rng.randrange(3, 40)
    answer = tuple(rng.randrange(vocab) for _ in range(12))
    sampler = DraftOracle(answer, 0.5, vocab, seed).sampler([1, 2])
    given = [sampler(torch.randn(vocab))]
    while len(given) < len(answer):
        ahead = answer[len(given):min(len(given) + 3, len(answer) - 1)]
        drafts = [t if rng.random() < 0.5 else (t + 1) % vocab for t in ahead]
        tokens = verify(sampler, torch.randn(len(drafts) + 1, vocab), drafts)
        kept = next((i for i, (d, t) in enumerate(zip(drafts, answer[len(given):], strict=False)) if d != t),
                    len(drafts))
        assert tokens == list(answer[len(given):len(given) + kept + 1]), f"seed={seed}: {drafts}"
        given += tokens
    logits = torch.randn(vocab)
    assert given[:len(answer)] == list(answer) and sampler(logits) == int(logits.argmax()), f"seed={seed}"


@pytest.mark.parametrize("p", [1.0, 0.0])
def test_bench_decode_with_a_draft_oracle_verifies_the_answer_it_drafts(engine_dir, p, seed):
    """`--draft-oracle 1` drafts the answer the timed run then gives: every draft is accepted, and
    a pass gives out K + 1 tokens but where the answer ends; `--draft-oracle 0` none. So the oracle's
    answer is the timed run's, from the same start."""
    from ftc.bench.decode import bench_decode

    k, new = random.Random(seed).randrange(1, 5), 24
    run = bench_decode(engine_dir, OffloadConfig(device="cpu", n_slots=12), None, "own router", 16, new,
                       seed=seed, speculation=Speculation("ngram", k), draft_oracle=p)
    s = run["speculation"]
    assert s["drafts"].startswith("a draft oracle") and run["speculate"] == f"oracle (P = {p:g}):{k}"
    assert s["accepted"] == (s["drafted"] if p else 0), f"seed={seed}: {s}"
    assert s["steps"] == (math.ceil((new - 1) / (k + 1)) if p else new - 1), f"seed={seed}: {s}"


# -- the controller (`--speculate auto`) -------------------------------------------------------------


def _simulate(controller: DraftController, p: float, cost, steps: int, rng: random.Random) -> tuple[float, list[int]]:
    """Passes of a sequence whose drafts are each right with probability p (kept up to the first
    wrong one) and whose pass of n tokens takes cost(n) seconds: tokens a second, and each k."""
    tokens = seconds = 0.0
    ks = []
    for _ in range(steps):
        k = controller.choose()
        kept = 0
        while kept < k and rng.random() < p:
            kept += 1
        took = cost(k + 1)
        controller.record(k, kept, took)
        tokens, seconds = tokens + kept + 1, seconds + took
        ks.append(k)
    return tokens / seconds, ks


def _best_fixed(p: float, cost, k_max: int) -> float:
    return max(sum(p ** i for i in range(k + 1)) / cost(k + 1) for k in range(k_max + 1))


@pytest.mark.parametrize("trial", range(12))
def test_the_controller_decodes_near_the_best_fixed_number_of_drafts(trial, seed):
    """Against passes of a random cost per token and drafts of a random acceptance, the
    controller's tokens a second over 3,000 passes are within 8% of the best fixed choice of drafts
    (its estimate of the acceptance follows about 20 passes: a choice near a tie wavers), and
    within 3% of plain decoding where drafts do not pay: it never costs more than noise."""
    rng = random.Random(seed * 100 + trial)
    p, base, per_token = rng.uniform(0.0, 0.95), rng.uniform(5e-3, 2e-2), rng.uniform(0.0, 1.5)

    def cost(n: int) -> float:
        return base * (1 + per_token * (n - 1))

    rate, ks = _simulate(DraftController(4), p, cost, 3000, rng)
    best = _best_fixed(p, cost, 4)
    assert rate >= 0.92 * best, f"seed={seed} trial {trial}: {rate} tok/s against {best} (p {p}, per token {per_token})"
    assert rate >= 0.97 * _best_fixed(p, cost, 0), f"seed={seed} trial {trial}: slower than plain decoding"


def test_the_controller_drafts_most_where_passes_are_cheap_and_none_where_they_are_dear(seed):
    rng = random.Random(seed)
    _, cheap = _simulate(DraftController(4), 0.9, lambda n: 0.01, 400, rng)
    assert Counter(cheap[40:]).most_common(1)[0][0] == 4, f"seed={seed}"
    _, dear = _simulate(DraftController(4), 0.3, lambda n: 0.01 * n, 400, rng)
    plain = sum(k == 0 for k in dear[40:]) / len(dear[40:])
    assert plain > 0.9, f"seed={seed}: drafted in {1 - plain:.2%} of the passes where no draft pays"
    assert any(k == 1 for k in dear[40:]), "no probe: a sequence that stopped drafting never measures again"


def test_the_controller_drafts_past_the_dear_first_passes_of_each_size(seed):
    """The first two passes of each size cost far more (a GPU's eager run, then its graph's
    capture): within a short answer the controller still drafts the most where replayed passes
    are cheap."""
    rng, runs = random.Random(seed), Counter()

    def cost(n: int) -> float:
        runs[n] += 1
        return 0.01 * (1 + 0.05 * (n - 1)) * (50 if runs[n] <= 2 and n > 1 else 1)  # plain steps' graph: warm

    _, ks = _simulate(DraftController(4), 0.8, cost, 60, rng)  # a short answer's passes
    assert Counter(ks[12:]).most_common(1)[0][0] == 4, f"seed={seed}: {Counter(ks[12:])}"


def test_auto_speculation_gives_the_tokens_of_plain_decoding(engine_dir, seed):
    prompt = repeating_prompt(random.Random(seed))
    plain = list(Engine.load(engine_dir).generate(prompt, 32, SamplingParams(0.0)))
    engine = Engine.load(engine_dir)
    engine.enable_speculation(parse_speculation("auto"))
    gen = engine.generate(prompt, 32, SamplingParams(0.0))
    assert list(gen) == plain, f"seed={seed}"
    assert str(engine.speculation) == "auto (ngram, up to 4)"
