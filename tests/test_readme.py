"""The README's commands, run as written from a fresh clone of this repository (the issue: "a fresh
clone, then `make demo`, then the README's chat and serve commands, works as written").

What runs: `git clone` of this checkout's HEAD into a temporary folder, then, in the clone, the
commands of the Makefile's `demo` target (what the README's `make demo` does after the venv set-up),
every line of the README's "Using it" block for the tiny model on the CPU, and the agent section's
`ftc run ENGINE --serve ...` line on a free port, asked once through the OpenAI chat endpoint at the
README's base URL and stopped with SIGTERM. The command lines are parsed out of README.md and the
Makefile (comments and `[optional]` brackets dropped, placeholders filled in), so an edit that breaks
one of them, or drops one, fails here. Two lines get an option that shortens them (SHORTER).

What does not run: `make` itself (it creates .venv and pip-installs, which needs the network: the
current venv's `ftc` runs the recipe's lines instead), lines that need a GPU, the Hugging Face Hub
or a real checkpoint, the conversation at a terminal (`ftc run ENGINE` without a prompt), `ftc bench
experts` (NOT_RUN says why), and the agent clients (`pytest -m agents`). Uncommitted changes are not
in the clone: this tests HEAD.

The clone's sources run, not this checkout's: the venv's install is editable, a finder that maps
ftc, ftc_runtime and ftc_templates to this checkout and comes after Python's path search, so
PYTHONPATH points at links to the clone's packages (pyproject.toml's package-dir), which win.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from live_server import free_port

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
PACKAGE_DIRS = {"ftc": "ftc", "ftc_runtime": "runtime/ftc_runtime", "ftc_templates": "templates/ftc_templates"}
TINY_SPEC, TINY_ENGINE = "model_specs/qwen3-moe-tiny.yaml", "build/qwen3-moe-tiny"
# The "Using it" lines for the tiny model, each found by its pattern (from the line's start).
_SPEC, _ENGINE = re.escape(TINY_SPEC), re.escape(TINY_ENGINE)
USING_IT = {
    "compile": rf"ftc compile {_SPEC} --random-weights ",
    "inspect": rf"ftc inspect {_ENGINE}$",
    "conversation": rf"ftc run {_ENGINE}$",
    "chat": rf"ftc run {_ENGINE} --prompt .* --system ",
    "penalties": rf"ftc run {_ENGINE} --prompt .* --repeat-penalty ",
    "json_from_stdin": rf"echo .* \| ftc run {_ENGINE} --json",
    "raw": rf"ftc run {_ENGINE} --raw ",
    "prompt_ids": rf"ftc run {_ENGINE} --prompt-ids ",
    "bench_experts": rf"ftc bench experts {_ENGINE}$",
}
# Found but not run: the conversation needs a terminal; the benchmark takes 8 s on 2 cores even at
# --seconds 0.2, too much of this test's minute (test_cli.py runs it).
NOT_RUN = ("conversation", "bench_experts")
# Appended to lines whose default of 1024 new tokens would take most of the test's time: a
# random-weights model rarely ends its answer.
SHORTER = {"chat": "--max-new-tokens 16", "penalties": "--max-new-tokens 16", "json_from_stdin": "--max-new-tokens 16"}
COMMAND_TIMEOUT = 300  # the first compile builds the kernels (cached by source hash after that)


@dataclass(frozen=True)
class Clone:
    path: Path
    env: dict[str, str]

    def run(self, line: str) -> subprocess.CompletedProcess:
        """A README line through the shell (pipes, quotes), in the clone, stdin empty (not a terminal);
        it must succeed."""
        r = subprocess.run(["bash", "-c", line], cwd=self.path, env=self.env, input="", capture_output=True,
                           text=True, timeout=COMMAND_TIMEOUT)
        assert r.returncode == 0, f"{line}: exit status {r.returncode}\n{r.stderr}"
        assert "Traceback" not in r.stderr, f"{line}\n{r.stderr}"
        return r


# -- the README's text ------------------------------------------------------------------------------


def section(text: str, heading: str) -> str:
    """The text under a markdown heading, up to the next heading of the same or a higher level (a
    `# comment` inside a fenced block is no heading)."""
    level = len(heading) - len(heading.lstrip("#"))
    lines, start, fenced = text.splitlines(keepends=True), None, False
    for i, line in enumerate(lines):
        fenced ^= line.startswith("```")
        hashes = len(line) - len(line.lstrip("#"))
        if start is None and line.rstrip("\n") == heading:
            start = i + 1
        elif start is not None and not fenced and 0 < hashes <= level and line[hashes] == " ":
            return "".join(lines[start:i])
    assert start is not None, f"README.md has no section {heading!r}"
    return "".join(lines[start:])


def sh_blocks(text: str) -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M)


def without_comment(line: str) -> str:
    """The line up to a `#` that starts a shell comment (after whitespace, outside quotes)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def command_lines(block: str) -> list[str]:
    """A block's commands: continuations joined, comments dropped, `[--option VALUE]` kept as given
    (an optional part with alternatives, `[a | b]`, is refused: this test cannot choose)."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = [without_comment(line).strip() for line in joined.splitlines()]
    return [re.sub(r"\[([^\]|]*)\]", r"\1", line) for line in lines if line]


def tiny_lines(readme: str) -> dict[str, str]:
    """The "Using it" block's lines for the tiny model, by USING_IT key (with SHORTER's options); each
    key found once, and no line this test does not know."""
    block = sh_blocks(section(readme, "## Using it"))[0]
    found: dict[str, str] = {}
    for line in command_lines(block):
        if TINY_SPEC not in line and TINY_ENGINE not in line:
            continue
        keys = [key for key, pattern in USING_IT.items() if re.match(pattern, line)]
        assert len(keys) == 1, f"README line {line!r}: this test knows none of its kind (add it to USING_IT)"
        assert keys[0] not in found, f"two README lines of kind {keys[0]}: {found[keys[0]]!r}, {line!r}"
        found[keys[0]] = line
    assert set(found) == set(USING_IT), f"README's 'Using it' lacks {sorted(set(USING_IT) - set(found))}"
    assert not any("[" in line for line in found.values()), found
    return {key: f"{line} {SHORTER[key]}" if key in SHORTER else line for key, line in found.items()}


def demo_lines(clone: Path) -> list[str]:
    """`make demo`'s commands: the Makefile's demo recipe, with the venv's `ftc` for $(VENV)/bin/ftc."""
    assert "make demo" in sh_blocks(section((clone / "README.md").read_text(), "## Set-up: two commands"))[0]
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", (clone / "Makefile").read_text(), re.M)
    assert recipe, "the Makefile has no demo target"
    lines = [line.strip().replace("$(VENV)/bin/ftc", "ftc") for line in recipe.group(1).splitlines()]
    assert len(lines) == 3 and all(line.startswith("ftc ") and "$(" not in line for line in lines), lines
    return lines


# -- the clone --------------------------------------------------------------------------------------


def _git_checkout() -> bool:
    try:
        r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-inside-work-tree"], capture_output=True,
                           text=True, timeout=30)
    except FileNotFoundError:
        return False
    return r.returncode == 0 and r.stdout.strip() == "true"


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Clone:
    if not _git_checkout():
        pytest.skip(f"{ROOT} is not a git checkout (or git is missing): there is nothing to clone")
    tmp = tmp_path_factory.mktemp("readme")
    path = tmp / "ftc"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(path)], check=True, timeout=120)
    links = tmp / "pythonpath"
    links.mkdir()
    for package, folder in PACKAGE_DIRS.items():
        (links / package).symlink_to(path / folder, target_is_directory=True)
    env = os.environ | {"PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(links),
                        "NO_COLOR": "1"}
    return Clone(path, env)


@pytest.fixture(scope="module")
def demo(clone) -> list[subprocess.CompletedProcess]:
    """`make demo`'s steps, run once: they leave the tiny engine at build/qwen3-moe-tiny."""
    return [clone.run(line) for line in demo_lines(clone.path)]


def test_the_clone_runs_its_own_sources(clone):
    probe = f"import importlib.util as u; print(*(u.find_spec(p).origin for p in {tuple(PACKAGE_DIRS)}))"
    r = clone.run(f"python -c {shlex.quote(probe)}")  # found, not imported: no torch to wait for
    for package, file in zip(PACKAGE_DIRS, r.stdout.split(), strict=True):
        assert Path(file).resolve().is_relative_to(clone.path.resolve()), (package, file)


def test_make_demo_compiles_inspects_and_answers(clone, demo):
    compiled, inspected, answered = demo
    assert "engine ready" in compiled.stderr and (clone.path / TINY_ENGINE / "engine.json").is_file()
    assert "qwen3-moe-tiny" in inspected.stdout
    assert "random weights" in answered.stderr, answered.stderr  # the demo says its answer is gibberish


def test_using_it_lines_for_the_tiny_model(clone, demo):
    lines = tiny_lines((clone.path / "README.md").read_text())
    assert "--force" in lines["compile"]  # make demo's engine is there: the README's optional part is needed
    assert "engine ready" in clone.run(lines["compile"]).stderr
    said = {key: clone.run(line) for key, line in lines.items() if key not in (*NOT_RUN, "compile")}
    assert "qwen3-moe-tiny" in said["inspect"].stdout
    assert all("random weights" in said[key].stderr for key in ("chat", "penalties"))
    answer = json.loads(said["json_from_stdin"].stdout)
    assert {"text", "reasoning", "tokens", "prompt_tokens", "timings"} <= set(answer), answer
    stop = shlex.split(lines["raw"])[shlex.split(lines["raw"]).index("--stop") + 1]
    assert stop not in said["raw"].stdout  # the completion ends before the stop string
    ids = json.loads(said["prompt_ids"].stdout)
    assert ids["prompt_tokens"] == 3 and 0 < len(ids["tokens"]) <= 8, ids


# -- serving ----------------------------------------------------------------------------------------


def _request(url: str, key: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=60) as r:
        return json.loads(r.read())


def _wait_until_healthy(base: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert server.poll() is None, f"the server ended (exit status {server.returncode}):\n{log.read_text()}"
        assert time.monotonic() < deadline, f"the server did not answer /health:\n{log.read_text()}"
        try:
            with urllib.request.urlopen(base.removesuffix("/v1") + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.25)


def test_served_engine_answers_the_openai_chat_endpoint(clone, demo, tmp_path):
    agents = section((clone.path / "README.md").read_text(), "### Agent clients")
    [line] = [c for block in sh_blocks(agents) for c in command_lines(block) if "--serve" in c]
    [base] = set(re.findall(r"http://127\.0\.0\.1:8000/v1", agents))  # where the README points clients
    port, key = free_port(), secrets.token_hex(8)
    line = line.replace("ENGINE", TINY_ENGINE).replace("--port 8000", f"--port {port}").replace("KEY", key)
    base = base.replace(":8000", f":{port}")
    log = tmp_path / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=clone.path, env=clone.env,
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_until_healthy(base, server, log)
        [model] = [m["id"] for m in _request(f"{base}/models", key)["data"]]
        answer = _request(f"{base}/chat/completions", key, {
            "model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
        assert answer["choices"][0]["message"]["role"] == "assistant", answer
        assert 0 < answer["usage"]["completion_tokens"] <= 8, answer
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
            pytest.fail(f"the server did not end within 30 s of SIGTERM:\n{log.read_text()}")
