"""The `ftc` console script end to end, in subprocesses: compile, inspect, run, bench, and the error
paths, which must end in one 'error:' line and exit status 1, never a traceback."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pty
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from unittest.mock import patch

import httpx
import pytest
import torch
import yaml
from rich.progress import Progress
from safetensors.torch import save_file
from typer.testing import CliRunner

from ftc.cli.main import app
from ftc.cli.options import server_config
from ftc.compile.pipeline import _write_dense
from ftc.compile.spec_loader import load_spec
from ftc.compile.weights import RandomWeights
from ftc_runtime import Engine, Generation, SamplingParams
from ftc_runtime.artifact import file_sha256
from ftc_runtime.chat.session import ChatSession
from ftc_runtime.chat.tokenizer import StreamDecoder
from ftc_runtime.chat.tool_parsers import hidden_token_ids, tool_parser
from ftc_runtime.cpu_info import supported_isas

from live_server import free_port, serving

FTC = Path(sys.executable).parent / "ftc"
ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "model_specs" / "qwen3-moe-tiny.yaml"
VOCAB = 512


def ftc(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    """The CLI with `stdin` as its input (none: an empty one, never the test runner's terminal)."""
    return subprocess.run([str(FTC), *map(str, args)], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          input=stdin if stdin is not None else "")


def check_ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, f"{r.args}: rc {r.returncode}\n{r.stderr}"
    assert "Traceback" not in r.stderr
    return r


def ok(*args) -> subprocess.CompletedProcess:
    return check_ok(ftc(*args))


def compile_args(out: Path, seed: int) -> list:
    return ["compile", TINY, "--random-weights", "--seed", seed, "-o", out]


def manifest_sha(engine: Path, rel: str) -> str:
    return json.loads((engine / "engine.json").read_text())["files"][rel]["sha256"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, kernel_cache) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("cli") / "e"
    return out, ok(*compile_args(out, 3))


@pytest.fixture(scope="module")
def engine(compiled) -> Path:
    return compiled[0]


@pytest.fixture(scope="module")
def loaded(engine) -> Engine:
    return Engine.load(engine)


def random_ids(n: int) -> list[int]:
    return [random.randrange(VOCAB) for _ in range(n)]


def run_json_args(engine: Path, ids: list[int], n: int, *extra) -> list:
    return ["run", engine, "--prompt-ids", ",".join(map(str, ids)), "--max-new-tokens", n, "--json", *extra]


def parse_json(r: subprocess.CompletedProcess) -> dict:
    check_ok(r)
    assert len(r.stdout.strip().splitlines()) == 1, r.stdout
    return json.loads(r.stdout)


# -- compile / inspect -----------------------------------------------------------------------------------


def test_compile_writes_an_engine_and_reports_progress_on_stderr(compiled):
    engine, r = compiled
    assert (engine / "engine.json").is_file() and (engine / "experts.ftw").is_file()
    assert "dense weights" in r.stderr and "experts → FTW" in r.stderr and "kernel check" in r.stderr
    assert "engine ready" in r.stderr
    assert r.stdout == ""
    # --target auto (the default) takes this CPU's ISA, not its core count: a 2-core build runs
    # every core of a 16-core machine
    plan = json.loads((engine / "engine.json").read_text())["plan"]
    assert plan["cpu_threads"] is None and plan["isa"] in supported_isas()


@pytest.mark.parametrize("verify", [False, True])
def test_inspect_names_the_model(engine, verify):
    r = ok("inspect", engine, *(["--verify"] if verify else []))
    assert "qwen3-moe-tiny" in r.stdout
    assert "random weights (seed 3)" in r.stdout
    assert ("(verified)" in r.stdout) == verify


def test_inspect_verify_catches_a_corrupted_file(engine, tmp_path):
    damaged = shutil.copytree(engine, tmp_path / "e")
    data = bytearray((damaged / "experts.ftw").read_bytes())
    data[random.randrange(len(data) // 2, len(data))] ^= 0xFF
    (damaged / "experts.ftw").write_bytes(bytes(data))
    r = ftc("inspect", damaged, "--verify")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "corrupted" in " ".join(r.stderr.split())


@pytest.fixture(scope="module")
def recompiled(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny engine compiled again with --seed 3, and with --seed 4."""
    root = tmp_path_factory.mktemp("reseeded")
    ok(*compile_args(root / "same", 3))
    ok(*compile_args(root / "other", 4))
    return root / "same", root / "other"


def test_random_weights_are_deterministic_by_seed(engine, recompiled):
    same, other = recompiled
    for rel in ("experts.ftw", "dense.safetensors"):
        assert manifest_sha(same, rel) == manifest_sha(engine, rel), rel
        assert manifest_sha(other, rel) != manifest_sha(engine, rel), rel


def test_dense_file_bytes_are_deterministic(tmp_path):
    """dense.safetensors as `ftc compile --seed 3` writes it, 24 times: the bytes never vary. (Its
    `__metadata__` map is written in a random order per call when it has two keys or more; all 24
    would agree by chance with probability 2**-23.)"""
    spec, _ = load_spec(TINY)
    digests = set()
    for i in range(24):
        (tmp_path / str(i)).mkdir()
        _write_dense(RandomWeights(spec, seed=3), tmp_path / str(i), Progress(disable=True), spec)
        digests.add(file_sha256(tmp_path / str(i) / "dense.safetensors"))
    assert len(digests) == 1


# -- run ----------------------------------------------------------------------------------------------------


def test_run_json_greedy_matches_the_engine_in_process(engine, loaded):
    ids = random_ids(random.randint(1, 6))
    out = parse_json(ftc(*run_json_args(engine, ids, 8, "--temperature", "0", "--ignore-eos")))
    assert out["tokens"] == list(loaded.generate(ids, 8, SamplingParams(0.0), stop_at_eos=False))
    assert len(out["tokens"]) == 8 and all(isinstance(t, int) for t in out["tokens"])
    assert out["prompt_tokens"] == len(ids)
    assert out["text"] == loaded.tokenizer.decode([t for t in out["tokens"] if t not in unshown(loaded)])
    assert {"load_s", "prefill_s", "decode_s", "prefill_tok_s", "decode_tok_s"} <= set(out["timings"])


def unshown(loaded) -> set[int]:
    """The tokens a completion's text never shows: end-of-sequence and control tokens."""
    return set(hidden_token_ids(loaded.tokenizer.special_tokens, tool_parser(loaded.tool_parser))) | set(
        loaded.spec.eos_token_ids)


def test_run_raw_prompt_streams_the_decoded_text(engine, loaded):
    r = ok("run", engine, "--raw", "--prompt", "hello world", "--max-new-tokens", 4, "--ignore-eos")
    ids = loaded.tokenizer.encode("hello world")
    decoder = StreamDecoder(loaded.tokenizer)
    expected = "".join(decoder.push(t) for t in loaded.generate(ids, 4, stop_at_eos=False) if t not in unshown(loaded))
    # Engine.load's transient progress bar leaves a blank line on stdout when it is not a terminal.
    assert r.stdout.lstrip("\n") == expected + "\n"
    assert f"{len(ids)} prompt tokens, 4 generated" in r.stderr


def chat_text() -> str:
    return " ".join(random.choice(["hello", "what", "is", "the", "tool", "run", "a", "fox", "?"])
                    for _ in range(random.randint(1, 8)))


def test_chat_turn_equals_the_servers_answer(engine, loaded, seed):
    """`ftc run --prompt` is one chat turn: the template's prompt, the answer the API gives (its
    non-streamed message trims the whitespace around the answer and the reasoning; `--json` keeps
    the text as streamed, so that a stop string cuts it exactly)."""
    random.seed(seed)
    text, n = chat_text(), random.randint(4, 16)
    out = parse_json(ftc("run", engine, "--prompt", text, "--max-new-tokens", n, "--json"))
    ids = loaded.chat_template.render_ids(loaded.tokenizer, [{"role": "user", "content": text}])
    assert out["prompt_tokens"] == len(ids)
    assert out["tokens"] == list(loaded.generate(ids, n, SamplingParams(0.0)))
    with serving(loaded) as base:
        r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": loaded.spec.name, "messages": [{"role": "user", "content": text}], "max_tokens": n,
            "temperature": 0})
    message = r.json()["choices"][0]["message"]
    content = message["content"] or ""
    assert out["text"].strip() == content
    assert (out["reasoning"] or "").strip() == (message.get("reasoning_content") or "")


def test_a_chat_turn_loads_no_server(engine):
    """`ftc run --prompt` answers without importing the server stack (fastapi, uvicorn: most of a
    second of start-up)."""
    probe = ("import sys; from typer.testing import CliRunner; from ftc.cli.main import app; "
             f"r = CliRunner().invoke(app, ['run', {str(engine)!r}, '--prompt', 'hi', '--max-new-tokens', '2']); "
             "assert r.exit_code == 0, r.output; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'uvicorn', 'starlette')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out


def test_system_prompt_leads_the_conversation(engine, loaded):
    """--system is the conversation's first turn: the prompt is the template's rendering of the
    system and the user turn, and the answer the engine's for it."""
    system, text, n = chat_text(), chat_text(), random.randint(2, 8)
    out = parse_json(ftc("run", engine, "--system", system, "--prompt", text, "--max-new-tokens", n, "--json"))
    ids = loaded.chat_template.render_ids(loaded.tokenizer, [{"role": "system", "content": system},
                                                             {"role": "user", "content": text}])
    assert out["prompt_tokens"] == len(ids)
    assert out["tokens"] == list(loaded.generate(ids, n, SamplingParams(0.0)))


def stop_from(text: str) -> str | None:
    """Two printable characters from the middle of `text` (a command-line argument holds no NUL)."""
    spots = [i for i in range(len(text) // 4, len(text) - 2)
             if text[i:i + 2].isprintable() and text[i:i + 2].isascii() and not text[i].isspace() and text[i] != "-"]
    return text[spots[len(spots) // 2]:][:2] if spots else None


@pytest.mark.parametrize("mode", [["--raw", "--prompt", "the fox"], ["--prompt", "the fox"]])
def test_stop_strings_end_the_answer_before_them(engine, mode):
    common = [*mode, "--max-new-tokens", 48, "--ignore-eos", "--temperature", 0, "--json"]
    full = parse_json(ftc("run", engine, *common))
    stop = stop_from(full["text"])
    if stop is None:
        pytest.skip(f"no printable stretch in {full['text']!r}")
    out = parse_json(ftc("run", engine, *common, "--stop", stop, "--stop", "\u2603 never"))
    assert out["text"] == full["text"][:full["text"].index(stop)]
    assert out["tokens"] == full["tokens"][:len(out["tokens"])] and len(out["tokens"]) < 48


def test_chat_prompt_from_stdin_or_a_file_is_the_same_turn(engine, tmp_path):
    text, n = chat_text(), random.randint(2, 8)
    (tmp_path / "prompt.txt").write_text(text)
    common = ["--max-new-tokens", n, "--json", "--ignore-eos"]
    outs = [parse_json(r) for r in (ftc("run", engine, "--prompt", text, *common),
                                    ftc("run", engine, *common, stdin=text),
                                    ftc("run", engine, "--prompt-file", tmp_path / "prompt.txt", *common))]
    for out in outs:
        del out["timings"]
    assert outs[0] == outs[1] == outs[2]
    assert len(outs[0]["tokens"]) == n  # --ignore-eos: the answer runs past its end of turn


def test_chat_answer_shows_no_control_token_and_splits_reasoning(loaded):
    """A scripted answer: control tokens (<|im_start|> ...) anywhere in it never reach the text;
    <think>...</think> (special tokens of this tokenizer too) comes out as reasoning, the rest as
    the answer."""
    tok = loaded.tokenizer
    reasoning, answer = chat_text(), chat_text()
    ids = tok.encode(f"<think>{reasoning}</think>{answer}")
    control = [i for t, i in tok.special_tokens.items() if t.startswith("<|")]
    for _ in range(random.randint(1, 5)):
        ids.insert(random.randrange(len(ids) + 1), random.choice(control))
    session = ChatSession(loaded)
    with patch.object(loaded, "generate", lambda *a, **k: Generation(iter(ids))):
        parts = list(session.reply("hi", 100))
    text = {kind: "".join(p for k, p in parts if k == kind) for kind in ("reasoning", "content")}
    assert text == {"reasoning": reasoning, "content": answer}
    assert session.messages[-1] == {"role": "assistant", "content": answer}


def test_raw_completion_shows_no_control_token(engine, loaded):
    """--raw and --prompt-ids continue a prompt as it is, yet a control token the model emits
    (<|im_start|> ...) is listed in --json's tokens and never shown in the text."""
    tok = loaded.tokenizer
    words = chat_text()
    ids = tok.encode(words)
    control = [i for t, i in tok.special_tokens.items() if t.startswith("<|")]
    for _ in range(random.randint(1, 5)):
        ids.insert(random.randrange(len(ids) + 1), random.choice(control))
    with patch.object(Engine, "generate", lambda *a, **k: Generation(iter(ids))):
        streamed = CliRunner().invoke(app, ["run", str(engine), "--raw", "--prompt", "x", "--max-new-tokens", "99"])
        as_json = CliRunner().invoke(app, ["run", str(engine), "--prompt-ids", "1,2", "--json"])
    assert streamed.exit_code == 0 and words in streamed.stdout and "<|" not in streamed.stdout, streamed.output
    out = json.loads(as_json.stdout.strip().splitlines()[-1])
    assert out["tokens"] == ids and out["text"] == words


def test_conversation_at_a_terminal(engine):
    """stdin a terminal: turns read at a prompt, each answered with the conversation so far (as
    an in-process session with the same prefix cache answers them); Ctrl-C at the prompt drops
    the line being typed and asks again; /clear, /exit."""
    turns, n = [chat_text(), chat_text()], random.randint(3, 8)
    reference = Engine.load(engine)
    kv = reference.default_prefix_cache_bytes()
    reference.enable_prefix_cache(kv, kv)
    session = ChatSession(reference)
    answers = ["".join(p for k, p in session.reply(t, n) if k == "content") for t in turns]
    master, slave = pty.openpty()
    proc = subprocess.Popen([str(FTC), "run", str(engine), "--max-new-tokens", str(n)], stdin=slave, stdout=slave,
                            stderr=slave, cwd=ROOT, env=os.environ | {"TERM": "dumb"})
    os.close(slave)
    try:
        screen = read_until(master, ">>> ")
        assert "random weights" in screen and "/exit" in screen
        for i, (turn, answer) in enumerate(zip(turns, answers, strict=True)):
            if i:  # half a line typed, then Ctrl-C: dropped, and the conversation goes on as before
                os.write(master, b"never sent")
                time.sleep(0.3)
                proc.send_signal(signal.SIGINT)
                # Again if no prompt comes: on a loaded machine the prompt once never came back
                # (a signal landing just before readline waits for a key is not seen until one)
                read_until(master, ">>> ", nudge=lambda: proc.send_signal(signal.SIGINT))
            os.write(master, turn.encode() + b"\n")
            screen = read_until(master, ">>> ")
            assert answer.replace("\r", "") in screen.replace("\r", ""), (answer, screen)
        os.write(master, b"/clear\n")
        assert "cleared" in read_until(master, ">>> ")
        os.write(master, b"/exit\n")
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        os.close(master)


def read_until(fd: int, marker: str, timeout: float = 120.0, nudge=None) -> str:
    """What the terminal shows until `marker` appears (its last occurrence ends the read);
    `nudge()` is called after every 5 s without output."""
    out, deadline, quiet_since = b"", time.time() + timeout, time.time()
    while marker.encode() not in out:
        assert time.time() < deadline, f"no {marker!r} on the terminal: {out[-2000:]!r}"
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            out += os.read(fd, 65536)
            quiet_since = time.time()
        elif nudge is not None and time.time() - quiet_since > 5.0:
            nudge()
            quiet_since = time.time()
    return out.decode("utf-8", "replace")


def test_run_prompt_errors_before_the_engine_loads(engine, tmp_path):
    for args, says in [(["--prompt", "a", "--prompt-file", tmp_path / "x"], "--prompt and --prompt-file"),
                       (["--raw", "--system", "be brief", "--prompt", "a"], "--system"),
                       (["--raw"], "stdin is empty"),
                       (["--prompt-file", tmp_path / "missing.txt"], "missing.txt")]:
        r = ftc("run", engine, *args)
        assert r.returncode == 1 and r.stderr.startswith("error: ") and says in r.stderr, (args, r.stderr)


def with_sampling_defaults(engine: Path, tmp_path: Path, defaults: dict) -> Path:
    """A copy of `engine` whose engine.json carries `defaults` as its checkpoint's sampling."""
    copy = shutil.copytree(engine, tmp_path / "with-defaults")
    manifest = json.loads((copy / "engine.json").read_text())
    (copy / "engine.json").write_text(json.dumps(manifest | {"sampling": defaults}))
    return copy


def test_run_samples_by_the_checkpoints_defaults_unless_told(engine, loaded, tmp_path):
    """Options left out take the engine's sampling (its generation_config.json); given, they win."""
    defaults = {"temperature": round(random.uniform(0.5, 1.5), 2), "top_p": 0.9, "top_k": random.randint(5, 50)}
    copy = with_sampling_defaults(engine, tmp_path, defaults)
    ids, seed = random_ids(4), random.randrange(1000)
    sampled = parse_json(ftc(*run_json_args(copy, ids, 12, "--ignore-eos", "--seed", seed)))["tokens"]
    assert sampled == list(loaded.generate(ids, 12, SamplingParams(seed=seed, **defaults), stop_at_eos=False))
    greedy = parse_json(ftc(*run_json_args(copy, ids, 12, "--ignore-eos", "--temperature", 0)))["tokens"]
    assert greedy == list(loaded.generate(ids, 12, SamplingParams(0.0), stop_at_eos=False))
    top_k = parse_json(ftc(*run_json_args(copy, ids, 12, "--ignore-eos", "--seed", seed, "--top-k", 1)))["tokens"]
    assert top_k == greedy  # one candidate left: the likeliest, whatever the temperature


def test_sampling_is_reproducible_by_seed_and_varies_across_seeds(engine, loaded):
    ids = random_ids(4)
    sample = ["--temperature", "0.8", "--ignore-eos"]
    seeds = random.sample(range(1000), 4)
    *outs, again = [parse_json(ftc(*run_json_args(engine, ids, 16, *sample, "--seed", s)))["tokens"]
                    for s in seeds + seeds[:1]]
    assert again == outs[0]
    assert outs[1] == list(loaded.generate(ids, 16, SamplingParams(0.8, 1.0, seeds[1]), stop_at_eos=False))
    assert all(len(o) == 16 for o in outs)
    assert len({tuple(o) for o in outs}) >= 2


def test_run_penalty_options_reach_the_sampler(engine, loaded, tmp_path, seed):
    """--repeat-penalty, --presence-penalty and --frequency-penalty decode as SamplingParams'
    penalties, raw and in a chat turn; left out, they take the engine's defaults (its checkpoint's
    generation_config.json)."""
    rng, n = random.Random(seed), 12
    ids, text = [rng.randrange(VOCAB) for _ in range(4)], " ".join(rng.choice(["a", "fox", "runs"]) for _ in range(4))
    asked = {"repetition_penalty": round(rng.uniform(1.5, 10), 2), "presence_penalty": round(rng.uniform(-2, 2), 2),
             "frequency_penalty": round(rng.uniform(-2, 2), 2)}
    flags = ["--repeat-penalty", asked["repetition_penalty"], "--presence-penalty", asked["presence_penalty"],
             "--frequency-penalty", asked["frequency_penalty"], "--temperature", 0, "--ignore-eos"]
    penalized = SamplingParams(0.0, **asked)
    raw = parse_json(ftc(*run_json_args(engine, ids, n, *flags)))["tokens"]
    assert raw == list(loaded.generate(ids, n, penalized, stop_at_eos=False))
    chat = parse_json(ftc("run", engine, "--prompt", text, "--max-new-tokens", n, "--json", *flags))["tokens"]
    prompt = loaded.chat_template.render_ids(loaded.tokenizer, [{"role": "user", "content": text}])
    assert chat == list(loaded.generate(prompt, n, penalized, stop_at_eos=False))
    copy = with_sampling_defaults(engine, tmp_path, {"temperature": 0.0, "repetition_penalty": 4.0})
    default = parse_json(ftc(*run_json_args(copy, ids, n, "--ignore-eos")))["tokens"]
    assert default == list(loaded.generate(ids, n, SamplingParams(0.0, repetition_penalty=4.0), stop_at_eos=False))
    off = parse_json(ftc(*run_json_args(copy, ids, n, "--ignore-eos", "--repeat-penalty", 1)))["tokens"]
    assert off == list(loaded.generate(ids, n, SamplingParams(0.0), stop_at_eos=False))


def test_each_chat_turn_penalizes_the_conversation_so_far(engine, loaded, seed):
    """Turns of a conversation resumed from the prefix cache, as at the terminal: each turn's sampler
    penalizes the whole rendered conversation and that turn's answer, nothing older (each turn gets
    what Engine.generate gives its prompt alone)."""
    rng, n = random.Random(seed), 10
    sampling = SamplingParams(0.0, repetition_penalty=rng.uniform(1.5, 5), frequency_penalty=rng.uniform(0, 2))
    cached = Engine.load(engine)
    kv = cached.default_prefix_cache_bytes()
    cached.enable_prefix_cache(kv, kv)
    session = ChatSession(cached)
    for _ in range(3):
        list(session.reply(" ".join(rng.choice(["what", "is", "the", "fox", "?"]) for _ in range(5)), n, sampling))
        prompt = loaded.chat_template.render_ids(loaded.tokenizer, session.messages[:-1])
        assert session.tokens == list(loaded.generate(prompt, n, sampling))
    assert session.generation.stats.reused_tokens > 0 or not kv


# -- bench ----------------------------------------------------------------------------------------------------


def test_bench_experts_prints_positive_throughputs(engine):
    r = ok("bench", "experts", engine, "--seconds", "0.2")
    result = json.loads(r.stdout)
    assert result["engine"] == "qwen3-moe-tiny"
    for key in ("kernel_gbps", "torch_bf16_gbps", "torch_read_gbps"):
        assert result[key] > 0, key
    # a pool the L3 mostly holds is named as such, on stdout and on stderr
    cached = 0 < result["l3_bytes"] and result["pool_bytes"] <= 4 * result["l3_bytes"]
    assert ("note" in result) == cached == ("not memory bandwidth" in r.stderr), (result, r.stderr)


def test_bench_prefill_reports_both_modes_and_plots(engine, tmp_path, monkeypatch):
    """The CPU standing in for the GPU: both modes stream the layers of every long enough chunk
    (16 experts per layer, 40 slots: two buffers fit), each with every expert copied and with half
    of them computed by the CPU in place; the plot is a PNG."""
    lengths = sorted(random.sample(range(12, 90), 2))
    args = ["bench", "prefill", engine, "--device", "cpu", "--slots", "40", "--lengths", ",".join(map(str, lengths)),
            "--compare", "--prefill-chunk", "32", "--prefill-split", "off,0.5"]
    plot = tmp_path / "prefill.png"
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    r = ok(*args, *(["--plot", plot] if has_matplotlib else []))
    runs = json.loads(r.stdout)["runs"]
    assert [(x["tokens"], x["overlap"], x["prefill_split"]) for x in runs] == \
        [(n, o, s) for s in ("off", "0.5") for o in (True, False) for n in lengths]
    for x in runs:
        assert x["chunks"] == -(-x["tokens"] // 32) and x["tok_s"] > 0 and x["streaming"]
        assert x["stream_layers"] > 0 and x["pcie_ceiling_s"] is None  # no PCIe link to compare with
        assert (x["stream_cpu_experts"] > 0) == (x["prefill_split"] == "0.5"), x
        assert x["uncached_bytes"] > x["pcie_bytes"] if x["prefill_split"] == "0.5" else \
            x["uncached_bytes"] == x["pcie_bytes"]
    if has_matplotlib:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # without matplotlib, refused before the benchmark runs in one line naming what to install
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else
                        find_spec(name, *a))
    for bench in (["bench", "prefill", "/nonexistent/engine"], ["bench", "agent", "/nonexistent/engine"]):
        r = CliRunner().invoke(app, list(map(str, [*bench, "--device", "cpu", "--plot", tmp_path / "x.png"])))
        lines = r.output.strip().splitlines()
        assert r.exit_code == 1 and len(lines) == 1 and "needs matplotlib: pip install 'ftc[plot]'" in lines[0], \
            r.output
    # chunks shorter than --stream-min-tokens take decode's path: nothing streams
    r = ok("bench", "prefill", engine, "--device", "cpu", "--slots", "40", "--lengths", str(lengths[0]),
           "--prefill-chunk", "32", "--stream-min-tokens", "33")
    assert json.loads(r.stdout)["runs"][0]["stream_layers"] == 0


def test_bench_load_reports_the_loader_against_the_disk(engine):
    """The loader's read of the expert file, the disk's own direct read of the same bytes, and
    the engine around them; every figure positive and the byte count the file's data region."""
    from ftc_runtime.io import ftw

    r = ok("bench", "load", engine, "--device", "cpu")
    x = json.loads(r.stdout)
    header, _ = ftw.read_header(Path(engine) / "experts.ftw")
    assert x["bytes"] == header.data_bytes
    assert min(x["disk_s"], x["read_s"], x["total_s"], x["disk_gbps"], x["read_gbps"]) > 0
    assert isinstance(x["read_direct"], bool) and x["total_s"] >= x["read_s"]


def test_bench_agent_passes_its_options_and_writes_the_printed_json(engine, tmp_path):
    """One mode of the agent session, its sizes and seed as given; -o holds what was printed."""
    tool, seed = random.randint(40, 80), random.randrange(1000)
    out = tmp_path / "agent.json"
    r = ok("bench", "agent", engine, "--device", "cpu", "--session-tokens", 400, "--tool-output-tokens", tool,
           "--no-checkpoints", "--seed", seed, "-o", out)
    x = json.loads(r.stdout)
    assert json.loads(out.read_text()) == x
    assert list(x["runs"]) == ["no-checkpoints"] and x["device"] == "cpu"
    turns = x["runs"]["no-checkpoints"]["turns"]
    assert turns[-1]["kind"] == "edit" and turns[-2]["prompt_tokens"] >= 400
    assert turns[1]["prompt_tokens"] - turns[0]["prompt_tokens"] > tool  # a tool turn carries a whole output


def test_bench_decode_sequences_reports_each_count_decoding_together(engine, loaded):
    """--sequences: a row per count of concurrent sequences, every step one MoE call per layer
    over the batch (its unique experts at most count × top-k), aggregate = count × per sequence."""
    counts = sorted(random.sample(range(1, 6), 2))
    r = ok("bench", "decode", engine, "--device", "cpu", "--slots", "12", "--sequences", ",".join(map(str, counts)),
           "--new-tokens", "6", "--prompt-tokens", "4")
    x = json.loads(r.stdout)
    assert x["decode_steps"] == 4 and [row["sequences"] for row in x["rows"]] == counts
    moe_layers, k = len(loaded.spec.moe_layers), loaded.spec.moe.top_k
    for row in x["rows"]:
        e = row["experts"]
        assert e["calls"] == 4 * moe_layers and e["hits"] + e["fills"] + e["cpu"] == e["unique"], row
        assert 0 < row["mean_unique_per_call"] <= row["sequences"] * k, row
        assert row["aggregate_tok_s"] == pytest.approx(row["sequences"] * row["per_sequence_tok_s"], rel=1e-3)
    r = CliRunner().invoke(app, ["bench", "decode", str(engine), "--device", "cpu", "--sequences", "2",
                                 "--synthetic-locality", "0.5"])
    assert r.exit_code == 1 and "--sequences" in _said(r) and "--synthetic-locality" in _said(r), r.output


def test_bench_decode_replays_uniform_routing(engine, loaded):
    """--synthetic-locality 0 --zipf 0: every step draws its experts uniformly (the decode table's
    uniform rows); --zipf alone is refused, it shapes a synthetic trace only."""
    r = ok("bench", "decode", engine, "--device", "cpu", "--slots", "12", "--synthetic-locality", "0", "--zipf", "0",
           "--new-tokens", "4", "--prompt-tokens", "4")
    assert json.loads(r.stdout)["routing"] == "synthetic (locality 0, Zipf 0, seed 0)"
    r = CliRunner().invoke(app, ["bench", "decode", str(engine), "--device", "cpu", "--zipf", "0"])
    assert r.exit_code == 1 and "--synthetic-locality" in _said(r), r.output


def test_bench_builds_a_spec_with_random_weights_in_memory():
    r = ok("bench", "experts", TINY, "--random-weights", "--seed", random.randrange(1000), "--seconds", "0.1")
    assert json.loads(r.stdout)["engine"] == "qwen3-moe-tiny"


def test_bench_has_one_command_per_benchmark_and_each_only_its_options(engine):
    runner = CliRunner()
    r = runner.invoke(app, ["bench", "--help"])
    assert r.exit_code == 0 and all(k in r.output for k in ("experts", "decode", "prefill", "agent", "load"))
    for kind, option in (("experts", "--device"), ("experts", "--plot"), ("decode", "--compare"),
                         ("decode", "--lengths"), ("prefill", "--session-tokens"), ("agent", "--routing-trace"),
                         ("load", "--random-weights"), ("load", "--lengths")):
        r = runner.invoke(app, ["bench", kind, str(engine), option, "1"])
        assert r.exit_code == 2 and "No such option" in _said(r) and option in _said(r), f"{kind} {option}: {r.output}"


# -- errors ------------------------------------------------------------------------------------------------


def bad_spec(tmp_path: Path) -> tuple[Path, str]:
    data = yaml.safe_load(TINY.read_text())
    data["moe"]["top_k"] = random.randint(17, 99)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, f"'moe.top_k' = {data['moe']['top_k']}"


def error_cases(engine: Path, tmp_path: Path) -> dict[str, tuple[list, list[str]]]:
    """Per case: the arguments, and what the error message must say."""
    spec, named = bad_spec(tmp_path)
    big = random.randint(VOCAB, 10**6)
    gguf = tmp_path / "model.bin"  # found by its magic bytes, whatever its name
    gguf.write_bytes(b"GGUF" + random.randbytes(64))
    weights = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(4, 4)}, str(weights))
    return {
        "missing_spec": (["compile", tmp_path / "nope.yaml", "--random-weights", "-o", tmp_path / "o"],
                         ["no such spec file"]),
        "bad_field": (["compile", spec, "--random-weights", "-o", tmp_path / "o"], [named]),
        "bad_target": (["compile", TINY, "--random-weights", "--target", "bogus", "-o", tmp_path / "o"],
                       ["'bogus'", "unknown"]),
        "not_an_engine": (["run", tmp_path, "--prompt-ids", "1"], ["not an ftc engine", "engine.json"]),
        "both_prompts": (["run", engine, "--prompt", "hi", "--prompt-ids", "1,2"], ["give one prompt"]),
        "bad_ids": (["run", engine, "--prompt-ids", "a,b"], ["--prompt-ids 'a,b'", "integers"]),
        "id_too_large": (["run", engine, "--prompt-ids", f"1,{big}"], [f"token id {big}", f"[0, {VOCAB})"]),
        "bench_spec_needs_random_weights": (["bench", "decode", TINY, "--device", "cpu"], ["--random-weights"]),
        "bench_load_of_a_spec": (["bench", "load", TINY, "--device", "cpu"], ["compiled engine directory"]),
        "gguf_file": (["compile", gguf, "-o", tmp_path / "o"], [f"{gguf}: a GGUF file", "Hugging Face checkpoint"]),
        "bare_safetensors": (["compile", weights, "-o", tmp_path / "o"],
                             [f"{weights}: a safetensors file", "checkpoint folder"]),
        "stop_with_serve": (["run", engine, "--serve", "--stop", "x"], ["--stop does not go with --serve"]),
        "host_without_serve": (["run", engine, "--prompt-ids", "1", "--host", "0.0.0.0"], ["--host needs --serve"]),
    }


@pytest.mark.parametrize("case", ["missing_spec", "bad_field", "bad_target", "not_an_engine", "both_prompts",
                                  "bad_ids", "id_too_large", "bench_spec_needs_random_weights",
                                  "bench_load_of_a_spec", "gguf_file", "bare_safetensors", "stop_with_serve",
                                  "host_without_serve"])
def test_error_paths_exit_1_with_an_error_line(case, engine, tmp_path):
    args, says = error_cases(engine, tmp_path)[case]
    r = ftc(*args)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    flat = " ".join(r.stderr.split())
    for text in says:
        assert text in flat, r.stderr
    assert not (tmp_path / "o").exists()


def test_every_run_option_belongs_to_a_mode_or_both():
    """An option of `ftc run` that one mode ignores must be refused in it: each option is listed
    as serve-only, generate-only or shared, so that a new one cannot be silently ignored."""
    from typer.main import get_command

    from ftc.cli.options import GENERATE_ONLY, RUN_SHARED, SERVE_ONLY

    run = get_command(app).commands["run"]
    names = [p.name for p in run.params]
    listed = [*SERVE_ONLY, *GENERATE_ONLY, *RUN_SHARED]
    assert sorted(names) == sorted(listed) and len(set(listed)) == len(listed)


def test_compile_help_lists_the_targets_and_the_cli_starts_without_torch():
    from ftc.compile.targets import PRESETS

    said = _said(CliRunner().invoke(app, ["compile", "--help"]))
    assert all(name in said for name in PRESETS), said
    probe = "import sys, ftc.cli.main; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"  # --help and argument errors come at once


def test_version_is_printed():
    from ftc import __version__

    r = ftc("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"ftc {__version__}", r


def test_long_error_message_stays_on_one_line(tmp_path):
    path = tmp_path / ("x" * 60 + ".yaml")
    r = ftc("compile", path, "--random-weights", "-o", tmp_path / "o")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_bad_override_is_an_error_line(tmp_path):
    r = ftc("compile", TINY, "--random-weights", "--override", "num_layers.x=1", "-o", tmp_path / "o")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and r.stderr.startswith("error: ")


def test_error_message_text_is_not_read_as_markup(engine):
    ids = random.choice(["[b]1,2", "[/x]1,2"])
    r = ftc("run", engine, "--prompt-ids", ids)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"'{ids}'" in r.stderr


# -- option values ---------------------------------------------------------------------------------------

SIZES = ("1e999", "-5GiB", "abc", "nanGiB", "infGiB")


def bad_option_cases(engine: Path, tmp: Path) -> list[tuple[str, list, str]]:
    """(case id, arguments, the option the message must name): each value is refused, by typer's own
    check (exit status 2) or with one 'error:' line (1)."""
    gen, serve = ["run", engine, "--prompt-ids", "1,2"], ["run", engine, "--serve"]
    exp, dec, pre = ["bench", "experts", engine], ["bench", "decode", engine, "--device", "cpu"], \
        ["bench", "prefill", engine, "--device", "cpu", "--lengths", "8"]
    agent, prof, trace = ["bench", "agent", engine, "--device", "cpu"], ["profile", engine], \
        ["trace", engine, "--prompt-ids", "1", "-o", tmp / "t.npz"]
    missing = tmp / "no-such-folder" / "out"
    cases = [(f"{cmd}-{opt}-{v}", [*base, opt, v], opt) for v in SIZES
             for cmd, base, opt in (("inspect", ["inspect", engine], "--vram-budget"),
                                    ("run", [*gen, "--device", "cpu"], "--vram-budget"),
                                    ("serve", serve, "--prefix-cache"), ("serve", serve, "--max-body-bytes"),
                                    ("agent", agent, "--prefix-cache"), ("agent", agent, "--checkpoint-cache"))]
    cases += [(f"{args[1]}-{opt}-{v}", [*args, opt, v], opt) for args, opt, vs in (
        (gen, "--device", ["cuda:99", "bogus", "mps"]), (dec, "--device", ["cuda:99"]), (prof, "--device", ["cuda:99"]),
        (["inspect", engine], "--vram-budget", ["0"]), (["inspect", engine], "--max-context", ["0", "-1"]),
        (serve, "--port", ["0", "65536", "-1"]), (serve, "--max-batch", ["0"]), (serve, "--max-prompt-tokens", ["0"]),
        (serve, "--max-tokens", ["0"]), (serve, "--max-body-bytes", ["0"]), (serve, "--api-key", [""]),
        (serve, "--allowed-hosts", ["", ","]), (serve, "--prompt", ["hi"]), (serve, "--slots", ["4"]),
        (["run", engine, "--prompt", "hi"], "--port", ["9000"]),
        (gen, "--max-new-tokens", ["-1"]), (gen, "--seed", ["-1", str(2**64)]), (gen, "--temperature", ["-1", "nan"]),
        (gen, "--temperature", ["inf"]), (gen, "--top-p", ["0", "1.5", "nan"]), (gen, "--slots", ["-1"]),
        (gen, "--repeat-penalty", ["0", "-1", "10.5", "nan", "inf"]), (gen, "--presence-penalty", ["2.5", "-3", "nan"]),
        (gen, "--frequency-penalty", ["3", "-inf"]), (serve, "--repeat-penalty", ["1.1"]),
        (gen, "--prefill-chunk", ["0"]), (["run", engine], "--prompt-ids", ["1,-2", f"1,{VOCAB}", "1," + "9" * 30,
                                                                         ",", "a,b"]),
        (["compile", TINY, "--random-weights", "-o", tmp / "e"], "--seed", ["-1"]),
        (exp, "--seconds", ["0", "-1", "nan", "inf"]), (exp, "--threads", ["0", "-1"]), (exp, "--tokens", ["0"]),
        (exp, "-o", [missing, tmp]), (pre, "--lengths", ["0,-1", ","]), (pre, "--prefill-chunk", ["0"]),
        (pre, "--plot", [missing]), (pre, "--stream-min-tokens", ["0"]), (pre, "--seed", ["-1"]),
        (dec, "--synthetic-locality", ["2", "-0.1", "nan"]), (dec, "--zipf", ["-1", "inf"]), (dec, "--slots", ["-1"]),
        (dec, "--prompt-tokens", ["0"]),
        (dec, "--new-tokens", ["1"]), (dec, "--sequences", ["0", "1,-2", ","]), (agent, "--session-tokens", ["0"]),
        (agent, "--tool-output-tokens", ["0"]), (gen, "--prefill-split", ["off"]),
        ([*gen, "--device", "cpu"], "--prefill-split", ["half", "1.5", "nan"]),
        (pre, "--prefill-split", ["off,2", ","]), (dec, "--prefill-split", ["-0.5"]),
        (agent, "--prefill-split", ["sometimes"]),
        (gen, "--speculate", ["ngram:0", "ngram:9", "mtp:2", "on"]), (dec, "--speculate", ["ngram"]),
        (serve, "--speculate", ["mtp:2"]), ([*dec, "--sequences", "1,2"], "--speculate", ["ngram:2"]),
        (prof, "--seconds", ["0", "nan"]), (prof, "-o", [missing]), (trace, "--max-new-tokens", ["0"]),
        (["trace", engine, "--prompt-ids", "1"], "-o", [missing])) for v in vs]
    if not torch.cuda.is_available():  # without a GPU, the default --device of `bench decode` and cuda itself
        cases += [(f"{a[1]}-cuda", [*a, "--device", "cuda"], "--device") for a in (gen, ["bench", "decode", engine],
                                                                                   prof, pre)]
        cases += [(f"{bench}-default-device", ["bench", bench, engine], "--device")
                  for bench in ("decode", "prefill", "agent", "load")]
    return cases


def _said(r) -> str:
    """The output with rich's error panel taken apart: its words on one line."""
    return " ".join(r.output.translate(str.maketrans("", "", "│╭╮╰╯─")).split())


def test_every_bad_option_value_is_refused_without_a_traceback(engine, tmp_path):
    runner = CliRunner()
    for name, args, option in bad_option_cases(engine, tmp_path):
        r = runner.invoke(app, list(map(str, args)))
        assert r.exit_code in (1, 2), f"{name}: exit {r.exit_code}\n{r.output}"
        assert r.exception is None or isinstance(r.exception, SystemExit), f"{name}: {r.exception!r}"
        assert "Traceback" not in r.output, name
        assert option in _said(r), f"{name}: the message does not name {option}\n{r.output}"
        if r.exit_code == 1:
            assert r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, f"{name}: {r.stderr}"
    assert not (tmp_path / "e").exists()


def test_an_empty_api_key_variable_is_refused(engine):
    r = CliRunner().invoke(app, ["run", str(engine), "--serve"], env={"FTC_API_KEY": ""})
    assert r.exit_code == 1 and r.stderr.startswith("error: --api-key (or FTC_API_KEY) is empty"), r.output


def test_zero_new_tokens_print_nothing(engine):
    r = ok("run", engine, "--prompt-ids", "1,2", "--max-new-tokens", 0)
    assert r.stdout.strip() == "" and "2 prompt tokens, 0 generated" in r.stderr
    assert parse_json(ftc(*run_json_args(engine, [1, 2], 0)))["tokens"] == []


def test_compile_replaces_an_engine_only_with_force(engine, tmp_path):
    out = shutil.copytree(engine, tmp_path / "e")
    runner = CliRunner()
    r = runner.invoke(app, list(map(str, compile_args(out, 4))))
    assert r.exit_code == 1 and "--force" in r.stderr, r.output
    assert manifest_sha(out, "experts.ftw") == manifest_sha(engine, "experts.ftw")
    r = runner.invoke(app, list(map(str, [*compile_args(out, 4), "--force"])))
    assert r.exit_code == 0, r.output
    assert manifest_sha(out, "experts.ftw") != manifest_sha(engine, "experts.ftw")


LOOPBACK = ("localhost", "127.0.0.1", "::1")  # the names a loopback-bound server answers to


@pytest.mark.parametrize("bind, hosts, expected", [
    ("127.0.0.1", None, LOOPBACK), ("localhost", None, LOOPBACK), ("0.0.0.0", None, None),
    ("127.0.0.1", "*", None), ("0.0.0.0", "a.example, B.example,", ("a.example", "B.example")),
])
def test_allowed_hosts_default_by_bind_address(bind, hosts, expected):
    assert server_config(bind, None, None, hosts)["allowed_hosts"] == expected


def test_serve_wires_its_options_into_the_server(engine, monkeypatch):
    """`ftc run --serve` up to the point where it would listen: the port is bound, the server gets
    the options, the engine the prefix cache, and the start line says its size."""
    started = {}
    monkeypatch.setattr("ftc_runtime.serve.app.run_server", lambda app, sock: started.update(
        app=app, address=sock.getsockname()[:2]) or sock.close())
    host = "::1" if loopback_v6() else "127.0.0.1"
    port = free_port()
    names = random.sample(["gpt-4o", "claude-sonnet", "local", "qwen3"], 2)
    level = random.choice(["debug", "warning", "error"])
    args = ["run", engine, "--serve", "--host", host, "--port", port, "--api-key", "k", "--prefix-cache", "3MiB",
            "--max-body-bytes", "1KiB", "--allowed-hosts", "a.example,b.example", "--max-batch", "3",
            "--max-prompt-tokens", "300", "--max-tokens", "40", "--served-model-name", ",".join(names),
            "--metrics-public", "--log-level", level]
    monkeypatch.setattr(logging.root, "handlers", [])  # basicConfig configures a root without handlers
    monkeypatch.setattr(logging.root, "level", logging.root.level)
    r = CliRunner().invoke(app, list(map(str, args)))
    assert r.exit_code == 0, r.output
    assert started["address"] == (host, port)
    server = started["app"].state.server
    c = server.config
    assert (c.api_key, c.max_body_bytes, c.allowed_hosts, c.max_batch) == ("k", 1024, ("a.example", "b.example"), 3)
    assert (c.max_prompt_tokens, c.max_new_tokens, c.served_model_names, c.metrics_public) == (300, 40, tuple(names),
                                                                                              True)
    assert logging.getLogger().level == getattr(logging, level.upper())
    assert server.engine.prefix_cache.kv_budget == 3 << 20
    url = f"http://[::1]:{port}/v1" if host == "::1" else f"http://127.0.0.1:{port}/v1"
    assert f"{url} (prefix cache 3.0 MiB, API key required)" in r.stderr


def loopback_v6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_serve_refuses_a_port_in_use_before_loading(tmp_path):
    """The port is taken before the engine loads: with one in use, the error says so at once (the
    directory given is no engine, which loading would have named first)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = ftc("run", tmp_path, "--serve", "--port", port)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"127.0.0.1:{port}: in use" in r.stderr and "--port" in r.stderr


def test_serve_prefix_cache_auto_and_off(engine, monkeypatch):
    monkeypatch.setattr("ftc_runtime.serve.app.run_server", lambda app, sock: sock.close())
    captured = []
    monkeypatch.setattr(Engine, "default_prefix_cache_bytes", lambda eng: captured.append(eng) or 5 << 20)
    runner = CliRunner()
    r = runner.invoke(app, ["run", str(engine), "--serve"])
    assert r.exit_code == 0 and captured and captured[0].prefix_cache.kv_budget == 5 << 20, r.output
    assert "(prefix cache 5.0 MiB)" in r.stderr
    r = runner.invoke(app, ["run", str(engine), "--serve", "--prefix-cache", "0"])
    assert r.exit_code == 0 and "(no prefix cache)" in r.stderr, r.output


def test_api_keys_file_gives_each_key_its_own_namespace(tmp_path):
    from ftc.cli.options import server_config

    keys = tmp_path / "keys.txt"
    keys.write_text("# team\nkey-a\n\n  key-b  \n")
    assert server_config("127.0.0.1", None, keys, None)["api_keys"] == ("key-a", "key-b")
    keys.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        server_config("127.0.0.1", None, keys, None)
    with pytest.raises(ValueError, match="api-keys-file"):
        server_config("127.0.0.1", None, tmp_path / "missing.txt", None)
