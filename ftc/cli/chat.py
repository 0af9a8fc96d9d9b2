"""`ftc run` as a chat: one turn (a prompt given, or read from stdin that is not a terminal), or a
conversation at a terminal. The answer goes to stdout; reasoning, notes and timings to stderr."""

from __future__ import annotations

import signal
import sys
from typing import TYPE_CHECKING

from ftc.cli.options import err

if TYPE_CHECKING:
    from ftc_runtime import Engine, GenerationStats, SamplingParams
    from ftc_runtime.chat.session import ChatSession

REPL_HELP = "/exit or Ctrl-D leaves, /clear forgets the conversation, Ctrl-C stops an answer"


def print_turn(session: ChatSession, text: str, max_new_tokens: int, sampling: SamplingParams) -> None:
    """One answer streamed: reasoning dimmed on stderr, the answer on stdout."""
    in_reasoning = False
    for kind, piece in session.reply(text, max_new_tokens, sampling):
        if kind == "reasoning":
            err.print(piece, style="dim", end="", markup=False, highlight=False)
            in_reasoning = True
            continue
        if in_reasoning:
            err.print()
            in_reasoning = False
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    s = session.generation.stats
    err.print(f"[dim]{s.prompt_tokens} prompt tokens ({s.reused_tokens} reused), {s.new_tokens} generated; "
              f"prefill {s.prefill_tok_s:.1f} tok/s, decode {s.decode_tok_s:.2f} tok/s[/]", soft_wrap=True)


def turn_json(session: ChatSession, text: str, max_new_tokens: int, sampling: SamplingParams,
              load_s: float) -> dict:
    """One answer as `--json` prints it: the answer and the reasoning apart, no control tokens."""
    parts = {"reasoning": [], "content": []}
    for kind, piece in session.reply(text, max_new_tokens, sampling):
        parts[kind].append(piece)
    s = session.generation.stats
    return {"text": "".join(parts["content"]), "reasoning": "".join(parts["reasoning"]) or None,
            "tokens": session.tokens, "prompt_tokens": s.prompt_tokens, "timings": timings(load_s, s)}


def timings(load_s: float, s: GenerationStats) -> dict[str, float]:
    """`--json`'s timings of one answer, chat or raw; with drafts verified (`--speculate`), how
    many, how many were accepted and the tokens each decode pass gave out."""
    drafts = {"drafted": s.drafted, "accepted": s.accepted, "tokens_per_step": round(s.tokens_per_step, 3)}
    return {"load_s": round(load_s, 4), "prefill_s": round(s.prefill_s, 4), "decode_s": round(s.decode_s, 4),
            "prefill_tok_s": round(s.prefill_tok_s, 2), "decode_tok_s": round(s.decode_tok_s, 2)} \
        | (drafts if s.drafted else {})


def repl(eng: Engine, session: ChatSession, max_new_tokens: int, sampling: SamplingParams) -> None:
    """Turns read from the terminal until /exit or end of input."""
    import readline  # noqa: F401  (line editing and history for input())

    # Ctrl-C drops the line being typed, whatever this process inherited: a parent that ignores
    # SIGINT (or blocks it) passes that on, and Python then installs no KeyboardInterrupt for it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    err.print(f"chatting with {eng.spec.name}: {REPL_HELP}", markup=False)
    while True:
        try:
            line = input(">>> ").strip()
        except EOFError:
            sys.stdout.write("\n")
            return
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            continue
        if line in ("/exit", "/quit", "/bye"):
            return
        if line == "/clear":
            session.reset()
            err.print("[dim](conversation cleared)[/]")
            continue
        if not line:
            continue
        try:
            print_turn(session, line, max_new_tokens, sampling)
        except KeyboardInterrupt:
            err.print("\n[dim](stopped)[/]")


def note_random_weights(eng: Engine) -> None:
    if eng.manifest.weights_source.startswith("random"):
        err.print(f"note: {eng.spec.name} has {eng.manifest.weights_source}: its answers are gibberish",
                  markup=False, soft_wrap=True)
