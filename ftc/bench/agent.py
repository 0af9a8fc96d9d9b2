"""`ftc bench agent ENGINE`: a scripted coding-agent session replayed through the engine, turn by
turn, as an agent resends its whole context: a system prompt, user turns, reasoning, tool calls and
tool outputs of thousands of tokens, then an edit that replaces an old tool output with a short
placeholder and goes on. Per turn: time to first token, prompt tokens restored from the prefix
cache and tokens prefilled; with the cache (KV and recurrent-state checkpoints), without
checkpoints (`--no-checkpoints`) and without any cache (`--no-prefix-cache`). The edit cuts the
second-to-last tool output (an agent pruning the output it has used), so most of the context
before it can be restored.

The session's text is random token ids between the spec's special tokens; the assistant's turns are
scripted too (the model's own answers are generated to time the first token, then dropped), so that
every mode sees the same prompts.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ftc.bench.memory import release_device_memory
from ftc.bench.plot import png_axes
from ftc_runtime import Engine, SamplingParams
from ftc_runtime.engine import OffloadConfig
from ftc_runtime.io.ftw import ExpertPool

MODES = {"cache": (True, True), "no-checkpoints": (True, False), "no-prefix-cache": (False, False)}


@dataclass(frozen=True)
class Turn:
    kind: str  # "user", "tool" or "edit"
    tokens: list[int]  # appended to the history (an edit replaces a tool output instead)


EDITED = -2  # the edit replaces this tool output (counted from the last)


@dataclass(frozen=True)
class Markers:
    """The special tokens of the spec's chat format that the session is scripted with: what opens a
    user turn, closes any turn, opens the assistant's and opens a tool result (lists: a format may
    have none), the reasoning's, a tool call's and a tool output's delimiters."""

    user: list[int]
    close: list[int]
    assistant: list[int]
    tool: list[int]
    think: int
    think_end: int
    call: int
    call_end: int
    resp: int
    resp_end: int


def markers(sp: dict[str, int]) -> Markers:
    """The session's markers in the spec's chat format: ChatML (<|im_start|> ... <|im_end|>), GLM's
    (<|user|>, <|assistant|>, <|observation|>, no closing token), or DeepSeek's (a tool call's tags
    each open with ｜DSML｜; tool outputs come back in a <｜User｜> turn, closed by <｜Assistant｜>)."""
    def tag(name: str) -> int:
        if name not in sp:
            raise ValueError(f"agent bench: the spec has no special token {name!r}")
        return sp[name]

    think = (tag("<think>"), tag("</think>"))
    if "｜DSML｜" in sp:
        return Markers([tag("<｜User｜>")], [tag("<｜end▁of▁sentence｜>")], [tag("<｜Assistant｜>")], [], *think,
                       tag("｜DSML｜"), tag("｜DSML｜"), tag("<｜User｜>"), tag("<｜Assistant｜>"))
    calls = (tag("<tool_call>"), tag("</tool_call>"), tag("<tool_response>"), tag("</tool_response>"))
    if "<|im_start|>" not in sp and "<|observation|>" in sp:
        return Markers([tag("<|user|>")], [], [tag("<|assistant|>")], [tag("<|observation|>")], *think, *calls)
    start = [tag("<|im_start|>")]
    return Markers(start, [tag("<|im_end|>")], start, start, *think, *calls)


def agent_session(engine: Engine, session_tokens: int, tool_tokens: int, seed: int) -> list[Turn]:
    """Turns of a session that grows to about `session_tokens` (at least two tool outputs), then
    one edit turn."""
    sp, rng = engine.spec.tokens.special, random.Random(seed)
    words = [i for i in range(engine.spec.vocab_size) if i not in set(sp.values())]

    def text(n: int) -> list[int]:
        return [rng.choice(words) for _ in range(n)]

    m = markers(sp)
    turns = [Turn("user", [*m.user, *text(400), *m.close, *m.user, *text(60), *m.close, *m.assistant])]
    size = len(turns[0].tokens)
    while size < session_tokens or sum(t.kind == "tool" for t in turns) < -EDITED:  # what the edit needs
        answer = [m.think, *text(80), m.think_end, m.call, *text(30), m.call_end, *m.close]
        output = [*m.tool, m.resp, *text(tool_tokens), m.resp_end, *m.close, *m.assistant]
        turns += [Turn("tool", answer + output)]
        size += len(answer) + len(output)
        if len(turns) % 3 == 0:
            turns.append(Turn("user", [*text(40), *m.close, *m.user, *text(50), *m.close, *m.assistant]))
            size += len(turns[-1].tokens)
    turns.append(Turn("edit", [m.resp, *text(8), m.resp_end]))  # a tool output cut to a placeholder
    return turns


def bench_agent(engine_dir: Path, offload: OffloadConfig | None, modes: list[str], session_tokens: int,
                tool_tokens: int, kv_budget: int, checkpoint_budget: int, new_tokens: int = 4, seed: int = 0,
                pool: ExpertPool | None = None, prefill_chunk: int | None = None) -> dict:
    runs = {}
    for mode in modes:
        engine = Engine.load(engine_dir, offload=offload, pool=pool, prefill_chunk=prefill_chunk)
        use_cache, use_checkpoints = MODES[mode]
        if use_cache:
            engine.enable_prefix_cache(kv_budget, checkpoint_budget if use_checkpoints else 0)
        runs[mode] = _replay(engine, agent_session(engine, session_tokens, tool_tokens, seed), new_tokens)
        del engine
        release_device_memory()
    first = next(iter(runs.values()))
    result = {"engine": first["engine"], "device": str(offload.device) if offload else "cpu",
              "stream_min_tokens": offload.stream_min_tokens if offload else None, "runs": runs}
    if "no-prefix-cache" in runs:  # the edit turn's time to first token against a full re-prefill
        full = runs["no-prefix-cache"]["turns"][-1]["ttft_s"]
        result["edit_speedup"] = {m: round(full / r["turns"][-1]["ttft_s"], 2) for m, r in runs.items()
                                  if r["turns"][-1]["ttft_s"] > 0}
    return result


def prompts(turns: list[Turn], m: Markers) -> Iterator[tuple[Turn, list[int]]]:
    """Each turn with the whole prompt the agent sends for it: the history so far, the turn
    appended (an edit replaces a tool output instead)."""
    history: list[int] = []
    outputs: list[tuple[int, int]] = []  # where each tool output sits (its opening marker to its end)
    for turn in turns:
        if turn.kind == "edit":
            a, b = outputs[EDITED]
            history = history[:a] + turn.tokens + history[b:]
        else:
            if m.resp in turn.tokens:
                outputs.append((len(history) + turn.tokens.index(m.resp),
                                len(history) + turn.tokens.index(m.resp_end) + 1))
            history = history + turn.tokens
        yield turn, history


def _replay(engine: Engine, turns: list[Turn], new_tokens: int) -> dict:
    rows = []
    stats = getattr(engine.model.experts, "stats", None)  # offloaded experts: what prompts streamed
    for n, (turn, history) in enumerate(prompts(turns, markers(engine.spec.tokens.special))):
        streamed = stats.streamed if stats else 0
        t0 = time.perf_counter()
        gen = engine.generate(history, new_tokens, SamplingParams(0.0), stop_at_eos=False)
        next(iter(gen))
        ttft = time.perf_counter() - t0
        list(gen)  # the rest of the answer, dropped: the next turn resends the scripted one
        rows.append({"turn": n, "kind": turn.kind, "prompt_tokens": len(history),
                     "reused_tokens": gen.stats.reused_tokens,
                     "prefilled_tokens": len(history) - gen.stats.reused_tokens, "ttft_s": round(ttft, 4),
                     "streamed_experts": stats.streamed - streamed if stats else None})
    prefix = engine.prefix_cache
    return {"engine": engine.spec.name, "turns": rows, "cache": prefix.stats.to_dict() if prefix else None,
            "checkpoints": prefix.checkpoints if prefix else 0}


def plot_agent(result: dict, path: Path) -> None:
    """Time to first token per turn, one line per mode, as a PNG."""
    with png_axes(path) as ax:
        for mode, run in result["runs"].items():
            ax.plot([r["turn"] for r in run["turns"]], [r["ttft_s"] for r in run["turns"]], marker="o", label=mode)
        ax.set_xlabel("turn (the last: the edit)")
        ax.set_ylabel("time to first token (s)")
        ax.set_yscale("log")
        ax.set_title(f"{result['engine']} agent session ({result['device']})")
