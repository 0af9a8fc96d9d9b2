"""Real agent harnesses against `ftc run --serve` (opt-in: `pytest -m agents`).

Claude Code (`@anthropic-ai/claude-code`, Anthropic API) and OpenCode (`opencode-ai`, OpenAI API
through `@ai-sdk/openai-compatible`) are installed from the npm registry into a temporary prefix
and run headless against a tiny engine whose model plays a scripted tool call and answer
(`agent_engine`). Between harness and server sits a recording proxy (`agent_proxy`), so that each
request's body and each answer's status and stream can be checked and kept.

What is checked is the protocol, not the answers: no 4xx/5xx, every streamed answer parses, the
harness ends cleanly, and a tool call goes round: the model calls the tool, the harness runs it,
and the next request carries its result and gets a 200. Everything a session sent and got is
written to `diagnostics.json` in the test's tmp_path (the path is in any failure message), and to
$FTC_AGENTS_DIAGNOSTICS/{claude-code,opencode}.json where that variable names a directory.

The model (`agent_engine`) calls the harness's shell tool on its first turn and answers one
sentence once the tool's result is in the conversation, so each session is two model turns.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.agents
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from ftc.compile.pipeline import CompileOptions, compile_engine  # noqa: E402
from ftc_runtime import Engine, SamplingParams  # noqa: E402

from agent_engine import PROMPT_ENDS, ToolScript, build_checkpoint, train_tokenizer  # noqa: E402
from agent_proxy import Exchange, recording_proxy, sse_events  # noqa: E402
from live_server import free_port  # noqa: E402

KEY = "agent-test-key"
# The tool each harness offers for shell commands, called the way Qwen3 calls tools.
CLAUDE_SCRIPT = ToolScript("Bash", {"command": "echo hi", "description": "say hi"})
OPENCODE_SCRIPT = ToolScript("bash", {"command": "echo hi", "description": "say hi"})
NPM_INSTALL_S = 300
SESSION_S = 240  # one harness session, start to end
# Serving options an agent user would pass: prompts resume after the unchanged prefix.
SERVE_ARGS = ("--prefix-cache", "256MiB")


# ---------------------------------------------------------------------------------------------
# npm packages


@pytest.fixture(scope="module")
def npm_binary(tmp_path_factory) -> Callable[[str, str], Path]:
    """`npm_binary(package, command)`: the package installed once per module into a prefix of its
    own, and the path of its command; skips the test where npm or the install fails."""
    npm = shutil.which("npm")
    root = tmp_path_factory.mktemp("npm")
    installed: dict[str, Path | str] = {}

    def get(package: str, command: str) -> Path:
        if npm is None:
            pytest.skip("npm is not installed")
        if package not in installed:
            installed[package] = _npm_install(npm, package, command, root / package.replace("/", "_"))
        result = installed[package]
        if isinstance(result, str):
            pytest.skip(result)
        return result

    return get


@pytest.fixture(scope="module")
def claude_code(npm_binary) -> Path:
    return npm_binary("@anthropic-ai/claude-code", "claude")


@pytest.fixture(scope="module")
def opencode(npm_binary) -> Path:
    return npm_binary("opencode-ai", "opencode")


def _npm_install(npm: str, package: str, command: str, prefix: Path) -> Path | str:
    """The installed command, or why there is none."""
    cmd = [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error", package]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=NPM_INSTALL_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"npm install {package}: no answer in {NPM_INSTALL_S} s"
    except OSError as e:
        return f"npm install {package}: {e}"
    binary = prefix / "node_modules" / ".bin" / command
    if r.returncode != 0 or not binary.exists():
        return f"npm install {package} failed (rc {r.returncode}): {_gist(r.stderr or r.stdout)}"
    try:
        v = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60,
                           stdin=subprocess.DEVNULL, env=_base_env(prefix))
    except subprocess.TimeoutExpired:
        return f"{package}: `{command} --version` did not answer in 60 s"
    if v.returncode != 0:
        return f"{package}: `{command} --version` failed: {_gist(v.stderr or v.stdout)}"
    return binary


def _gist(output: str) -> str:
    """npm's error lines in short, for a skip reason on one line."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("npm error") and "{" not in ln and "}" not in ln]
    return " | ".join(errors[:4] or lines[-3:])[:400]


def _base_env(home: Path) -> dict[str, str]:
    """A clean environment: no ANTHROPIC_*/OPENAI_* keys or user config leak into a harness."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
            "TMPDIR": str(home), "TERM": "dumb", "NO_COLOR": "1", "CI": "1"}


# ---------------------------------------------------------------------------------------------
# engines


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([CLAUDE_SCRIPT, OPENCODE_SCRIPT])


def _scripted_engine(root: Path, tok, script: ToolScript, name: str) -> Path:
    """An engine named `name` that calls `script`'s tool, then answers; checked by generating
    (greedy and sampled, thinking on and off) before it is served."""
    ckpt = build_checkpoint(root / name, tok, script)
    engine_dir = compile_engine(CompileOptions(source=ckpt, target="cpu", output=root / "engines" / name))
    engine = Engine.load(engine_dir)
    tools = [{"type": "function", "function": {"name": script.tool, "parameters": {"type": "object"}}}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": script.tool, "arguments": script.arguments}}]}
    asked = [{"role": "user", "content": "hi"}]
    for messages, want in ((asked, script.text), (asked + [call, {"role": "tool", "content": "hi"}], script.answer)):
        for thinking in ({}, {"enable_thinking": False}):
            prompt = engine.chat_template.render(messages, tools, **thinking)
            assert prompt.endswith(PROMPT_ENDS[bool(thinking)])
            for sampling in (SamplingParams(0.0), SamplingParams(1.0, 1.0, 7)):
                said = engine.tokenizer.decode(list(engine.generate(engine.tokenizer.encode(prompt), 64, sampling)))
                assert said == want + "<|im_end|>", said
    return engine_dir


@pytest.fixture(scope="module")
def claude_engine(tmp_path_factory, tokenizer) -> Path:
    return _scripted_engine(tmp_path_factory.mktemp("claude-engine"), tokenizer, CLAUDE_SCRIPT, "ftc-tiny-claude")


@pytest.fixture(scope="module")
def opencode_engine(tmp_path_factory, tokenizer) -> Path:
    return _scripted_engine(tmp_path_factory.mktemp("opencode-engine"), tokenizer, OPENCODE_SCRIPT,
                            "ftc-tiny-opencode")


@contextmanager
def ftc_server(engine: Path, log: Path) -> Iterator[str]:
    """`ftc run ENGINE --serve --api-key KEY` on a free loopback port; its output goes to `log`."""
    port = free_port()
    ftc = Path(sys.executable).parent / "ftc"
    cmd = [str(ftc), "run", str(engine), "--serve", "--port", str(port), "--api-key", KEY, *SERVE_ARGS]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, f"ftc run --serve exited: {log.read_text()[-2000:]}"
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, f"ftc run --serve did not come up: {log.read_text()[-2000:]}"
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


# ---------------------------------------------------------------------------------------------
# sessions and their records


@dataclass
class Session:
    """One harness run: its command and output, the server's log, every HTTP exchange."""

    harness: str
    command: list[str]
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    exchanges: list[Exchange] = field(default_factory=list)
    server_log: str = ""

    def events(self) -> list[dict[str, Any]]:
        """The harness's JSON-lines output (stream-json / --format json); other lines are skipped."""
        out = []
        for line in self.stdout.splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
        return out

    def posts(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.method == "POST"]

    def write(self, path: Path) -> Path:
        record = {"harness": self.harness, "command": self.command, "returncode": self.returncode,
                  "seconds": round(self.seconds, 1), "requests": request_summary(self.exchanges),
                  "exchanges": [e.to_dict() for e in self.exchanges], "stdout": self.stdout[-200_000:],
                  "stderr": self.stderr[-200_000:], "server_log": self.server_log[-200_000:]}
        text = json.dumps(record, indent=1, ensure_ascii=False)
        path.write_text(text)
        if os.environ.get("FTC_AGENTS_DIAGNOSTICS"):  # a directory that outlives pytest's tmp dirs
            keep = Path(os.environ["FTC_AGENTS_DIAGNOSTICS"])
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"{self.harness}.json").write_text(text)
        return path


def run_session(harness: str, cmd: list[str], setup: Callable[[str], dict[str, str]], cwd: Path, engine: Path,
                tmp: Path) -> Session:
    """Serves `engine` behind the recording proxy and runs the harness in `cwd` to its end or for
    SESSION_S at most; `setup(base_url)` writes its configuration and returns its environment."""
    session = Session(harness, cmd)
    log = tmp / "server.log"
    with ftc_server(engine, log) as upstream, recording_proxy(upstream) as (url, proxy):
        env = setup(url)
        t0 = time.time()
        # A session of its own, so that a timeout ends the harness's children (tool commands) too.
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            session.stdout, session.stderr = proc.communicate(timeout=SESSION_S)
            session.returncode = proc.returncode
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate(timeout=30)
            session.stdout, session.stderr = out, err + f"\n[killed after {SESSION_S} s]"
        finally:
            _kill_group(proc)  # whatever it left running
        session.seconds = time.time() - t0
        session.exchanges = list(proxy.exchanges)
    session.server_log = log.read_text(errors="replace")
    return session


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def request_summary(exchanges: list[Exchange]) -> list[dict[str, Any]]:
    """What each request carried, in short: the fields a server has to accept."""
    rows = []
    for e in exchanges:
        body = e.json()
        row: dict[str, Any] = {"request": f"{e.method} {e.path}", "status": e.status}
        headers = {k: v for k, v in e.request_headers.items()
                   if k.lower().startswith(("anthropic-", "x-")) and k.lower() not in ("x-api-key",)}
        row["headers"] = headers | {"user-agent": e.request_headers.get("user-agent", "")}
        if isinstance(body, dict):
            row["keys"] = sorted(body)
            row |= {k: body[k] for k in ("model", "max_tokens", "max_completion_tokens", "stream", "stream_options",
                                          "thinking", "tool_choice", "temperature", "top_p", "top_k",
                                          "context_management", "output_config", "reasoning_effort",
                                          "parallel_tool_calls") if k in body}
            if isinstance(body.get("metadata"), dict):
                row["metadata_keys"] = sorted(body["metadata"])
            if isinstance(body.get("system"), list):
                row["system_blocks"] = [_block_shape(b) for b in body["system"]]
            row["messages"] = [_message_shape(m) for m in body.get("messages", [])]
            row["tools"] = [_tool_name(t) for t in body.get("tools") or []]
        if e.status is not None and e.status >= 400:
            row["error"] = e.text[:1000]
        rows.append(row)
    return rows


def _block_shape(b: Any) -> str:
    if not isinstance(b, dict):
        return type(b).__name__
    extra = sorted(k for k in b if k not in ("type", "text", "content", "id", "name", "input", "tool_use_id"))
    return b.get("type", "?") + (f"+{','.join(extra)}" if extra else "")


def _message_shape(m: dict[str, Any]) -> str:
    content = m.get("content")
    parts = [_block_shape(b) for b in content] if isinstance(content, list) else [type(content).__name__]
    extra = sorted(k for k in m if k not in ("role", "content"))
    return f"{m.get('role')}[{' '.join(parts)}]" + (f"+{','.join(extra)}" if extra else "")


def _tool_name(t: dict[str, Any]) -> str:
    return t.get("name") or t.get("function", {}).get("name", "?")


# ---------------------------------------------------------------------------------------------
# checks shared by both harnesses


def http_failures(session: Session) -> list[str]:
    return [f"{e.method} {e.path} -> {e.status}{' (' + e.error + ')' if e.error else ''}: {e.text[:400]}"
            for e in session.exchanges if e.status is None or e.status >= 400 or e.error]


def stream_failures(session: Session) -> list[str]:
    """Streamed answers that a client would fail to parse, or that end without their final event."""
    out = []
    for e in session.posts():
        if e.status != 200 or "text/event-stream" not in e.response_headers.get("content-type", ""):
            continue
        try:
            events = sse_events(e.text)
        except ValueError as err:
            out.append(f"{e.path}: an event's data is not JSON ({err})")
            continue
        names = [n for n, _ in events]
        if e.path.startswith("/v1/messages"):
            if not names or names[0] != "message_start" or names[-1] != "message_stop" or "error" in names:
                out.append(f"{e.path}: events {names[:3]}...{names[-3:]}")
        elif not events or events[-1][1] != "[DONE]" or any("error" in d for _, d in events if isinstance(d, dict)):
            out.append(f"{e.path}: chunks end with {events[-1:]}")
    return out


def anthropic_tool_uses(e: Exchange) -> list[tuple[str, str]]:
    """(id, name) of the tool_use blocks of an Anthropic answer, streamed or not."""
    if "text/event-stream" in e.response_headers.get("content-type", ""):
        return [(d["content_block"]["id"], d["content_block"]["name"]) for n, d in sse_events(e.text)
                if n == "content_block_start" and d["content_block"]["type"] == "tool_use"]
    try:
        return [(b["id"], b["name"]) for b in json.loads(e.text).get("content", []) if b.get("type") == "tool_use"]
    except (ValueError, AttributeError):
        return []


def anthropic_tool_results(e: Exchange) -> set[str]:
    body = e.json() or {}
    return {b.get("tool_use_id") for m in body.get("messages", []) if isinstance(m.get("content"), list)
            for b in m["content"] if b.get("type") == "tool_result"}


def openai_tool_calls(e: Exchange) -> list[tuple[str, str]]:
    """(id, name) of the tool calls of a chat completion, streamed or not."""
    if "text/event-stream" in e.response_headers.get("content-type", ""):
        chunks = [d for _, d in sse_events(e.text) if isinstance(d, dict)]
        calls = [c for d in chunks for ch in d.get("choices", []) for c in ch.get("delta", {}).get("tool_calls") or []]
        return [(c.get("id"), c.get("function", {}).get("name")) for c in calls]
    try:
        return [(c["id"], c["function"]["name"]) for ch in json.loads(e.text)["choices"]
                for c in ch["message"].get("tool_calls") or []]
    except (ValueError, KeyError):
        return []


def openai_tool_results(e: Exchange) -> set[str]:
    body = e.json() or {}
    return {m.get("tool_call_id") for m in body.get("messages", []) if m.get("role") == "tool"}


def round_trip(session: Session, calls: Callable[[Exchange], list], results: Callable[[Exchange], set],
               tool: str) -> Exchange | None:
    """The first request that carries the result of a `tool` call an earlier answer made, if any."""
    called: set[str] = set()
    for e in session.posts():
        if called & results(e):
            return e
        if e.status == 200:
            called |= {i for i, name in calls(e) if name == tool}
    return None


def offered(session: Session, tool: str) -> list[str]:
    """A problem where the harness's first request with tools does not offer `tool` (renamed?)."""
    first = next((e.json() for e in session.posts() if (e.json() or {}).get("tools")), None)
    names = [_tool_name(t) for t in first["tools"]] if first else []
    return [] if tool in names else [f"the harness does not offer the tool {tool!r} the model calls (offers: {names})"]


def protocol_problems(session: Session, tool: str, calls: Callable[[Exchange], list],
                      results: Callable[[Exchange], set]) -> list[str]:
    """Every 4xx/5xx and unparsable stream, the tool not offered, and no round trip of its call."""
    problems = [f"HTTP: {p}" for p in http_failures(session)] + [f"stream: {p}" for p in stream_failures(session)]
    problems += offered(session, tool)
    follow = round_trip(session, calls, results, tool)
    if follow is None or follow.status != 200:
        problems.append(f"no request carried the {tool} result back with a 200 ({follow and follow.status})")
    return problems


def assert_clean_session(session: Session, script: ToolScript, calls: Callable[[Exchange], list],
                         results: Callable[[Exchange], set], harness: Callable[[Session], list[str]],
                         path: Path) -> None:
    """The protocol's problems and the harness's own, each a line, with the diagnostics written to `path`."""
    problems = protocol_problems(session, script.tool, calls, results) + harness(session)
    session.write(path)
    assert not problems, "\n".join(problems + [f"(diagnostics: {path})"])


# ---------------------------------------------------------------------------------------------
# the sessions


def test_claude_code_runs_a_tool_against_the_served_engine(claude_code, claude_engine, tmp_path):
    name = claude_engine.name
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()

    def setup(url: str) -> dict[str, str]:
        return _base_env(home) | {
            "ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": KEY, "ANTHROPIC_MODEL": name,
            "ANTHROPIC_SMALL_FAST_MODEL": name, "ANTHROPIC_DEFAULT_HAIKU_MODEL": name,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": name, "ANTHROPIC_DEFAULT_OPUS_MODEL": name,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1"}

    # As root Claude Code refuses --dangerously-skip-permissions; --allowedTools lets Bash run in -p mode.
    # The model calls the tool, then answers: two turns; --max-turns bounds a model gone wrong.
    cmd = [str(claude_code), "-p", "Run `echo hi` with the Bash tool.", "--model", name,
           "--output-format", "stream-json", "--verbose", "--max-turns", "4", "--allowedTools", "Bash"]
    session = run_session("claude-code", cmd, setup, work, claude_engine, tmp_path)
    assert_clean_session(session, CLAUDE_SCRIPT, anthropic_tool_uses, anthropic_tool_results, claude_code_problems,
                         tmp_path / "diagnostics.json")


def claude_code_problems(session: Session) -> list[str]:
    """What its stream-json output says went wrong: no clean result, the tool not run."""
    events, problems = session.events(), []
    result = next((ev for ev in reversed(events) if ev.get("type") == "result"), None)
    if result is None or session.returncode != 0:
        problems.append(f"no clean end (rc {session.returncode}): {session.stderr[-1000:]}")
    if result is not None and (result.get("subtype") != "success" or result.get("is_error")
                               or result.get("result") != CLAUDE_SCRIPT.answer):
        problems.append(f"result: {json.dumps(result)[:1000]}")
    ran = [b for ev in events if ev.get("type") == "user" for b in ev.get("message", {}).get("content", [])
           if isinstance(b, dict) and b.get("type") == "tool_result" and not b.get("is_error") and "hi" in str(b)]
    return problems + ([] if ran else ["Claude Code did not run the Bash tool"])


def test_opencode_runs_a_tool_against_the_served_engine(opencode, opencode_engine, tmp_path):
    name = opencode_engine.name
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()

    def setup(url: str) -> dict[str, str]:
        # OpenCode's OpenAI-compatible provider, as a user would configure it for `ftc run --serve`.
        config = {
            "$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
            "provider": {"ftc": {"npm": "@ai-sdk/openai-compatible", "name": "ftc",
                                 "options": {"baseURL": f"{url}/v1", "apiKey": KEY},
                                 "models": {name: {"name": name, "tool_call": True}}}},
            "model": f"ftc/{name}", "small_model": f"ftc/{name}", "permission": {"bash": "allow"}}
        (work / "opencode.json").write_text(json.dumps(config, indent=1))
        return _base_env(home) | {
            "OPENCODE_CONFIG": str(work / "opencode.json"), "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_CLAUDE_CODE": "1", "OPENCODE_DISABLE_SHARE": "1"}

    cmd = [str(opencode), "run", "Run `echo hi` with the bash tool.", "--model", f"ftc/{name}", "--format", "json",
           "--print-logs", "--log-level", "INFO"]
    session = run_session("opencode", cmd, setup, work, opencode_engine, tmp_path)
    assert_clean_session(session, OPENCODE_SCRIPT, openai_tool_calls, openai_tool_results, opencode_problems,
                         tmp_path / "diagnostics.json")


def opencode_problems(session: Session) -> list[str]:
    """What its JSON events say went wrong: an error, no clean exit, the tool not run, no answer."""
    events, problems = session.events(), []
    if session.returncode != 0:
        problems.append(f"no clean end (rc {session.returncode}): {session.stderr[-1500:]}")
    problems += [f"event: {json.dumps(ev)[:600]}" for ev in events if ev.get("type") == "error"]
    parts = [ev.get("part", {}) for ev in events]
    if not any(p.get("tool") == "bash" and p.get("state", {}).get("status") == "completed"
               and "hi" in str(p["state"].get("output")) for p in parts):
        problems.append("OpenCode did not run the bash tool")
    if not any(p.get("type") == "text" and p.get("text") == OPENCODE_SCRIPT.answer for p in parts):
        problems.append("OpenCode did not show the model's answer after the tool ran")
    return problems
