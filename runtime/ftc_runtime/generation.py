"""`Sequence`: one request's steps, the only code that runs a request against the prefix cache.
`Engine.generate` drives one sequence to its end (the terminal chat rides on it); the server's
`Scheduler` drives many, their prompts a chunk at a time between decode steps of all of them:

    start → read_prompt (chunk by chunk) → accept → [decode_step → advance → accept]… → finish

A sequence alone (`Engine.generate`) takes `step` instead of decode_step and advance: with a
`Speculation` its next token and a few drafts run as one pass (`verify_drafts`), and each token
that the acceptance rule keeps is then given out through `accept`, as a plain step's would be.

`start` resumes the prompt after its longest cached prefix; `read_prompt` runs a chunk (a hybrid
model's state captured after each boundary token inside it, `Engine.prefill`) and samples the first
token after the last; `decode_step` runs one token of several sequences together; `advance` adds
the token a step ran (its state captured where it is a boundary) and samples the next; `accept`
counts a token given out and says whether the sequence ends there; `finish` inserts what the cache
holds into the prefix cache and releases the nodes the sequence resumed from. The server's
scheduler takes `step` for a sequence that decodes alone, decode_step and advance for several."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ftc_runtime.cache.base import RecurrentCheckpoint, SequenceState
from ftc_runtime.cache.prefix import PrefixCache, Resume
from ftc_runtime.sampling import Sampler, SamplingParams
from ftc_runtime.speculative.config import Drafter, Speculation
from ftc_runtime.speculative.controller import DraftController
from ftc_runtime.speculative.verify import verify


class Runner(Protocol):
    """What a sequence runs on: the `Engine` (which imports this module, so it is named here by
    what it offers)."""

    model: Any
    prefix_cache: PrefixCache | None
    boundary_ids: frozenset[int]

    def prefill(self, ids: torch.Tensor, cache: SequenceState, all_logits: bool = False, checkpoints: bool = False,
                between_layers: Callable[[], None] | None = None,
                hidden: list[torch.Tensor] | None = None) -> torch.Tensor: ...


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int] = frozenset()  # a token among these ends the answer (given out first)
    namespace: str = ""  # the prefix cache's tree it shares prefixes within (a server: one per API key)
    speculation: Speculation | None = None  # drafts verified per `step` (a family whose state cuts back)
    # While it runs: its KV cache and sampler, the prefix cache it resumed from and the nodes it
    # holds there, and whether it keeps recurrent-state checkpoints after boundary tokens.
    cache: SequenceState | None = field(default=None, init=False)
    sampler: Sampler | None = field(default=None, init=False)
    prefix: PrefixCache | None = field(default=None, init=False)
    resume: Resume | None = field(default=None, init=False)
    checkpoints: bool = field(default=False, init=False)
    # The prompt, then each answer token once a step has run it: the cache holds its first
    # `cache.length` tokens, which is what `finish` inserts.
    seq: list[int] = field(default_factory=list, init=False)
    prompt_done: int = field(default=0, init=False)  # prompt tokens run (or restored from the prefix cache)
    reused_tokens: int = field(default=0, init=False)  # prompt tokens restored from the prefix cache
    produced: int = field(default=0, init=False)  # answer tokens given out
    next_token: int | None = field(default=None, init=False)  # the input of the next decode step
    # With speculation: its drafter (told the prompt and every token given out), the draft tokens
    # verified and, of those, accepted.
    drafter: Drafter | None = field(default=None, init=False)
    controller: DraftController | None = field(default=None, init=False)  # `auto`: each pass's drafts
    drafter_behind: bool = field(default=False, init=False)  # it missed a position (`advance`)
    drafted: int = field(default=0, init=False)
    accepted: int = field(default=0, init=False)
    # The recurrent state after each token of the latest verification pass, by length (hybrid
    # models): where a draft is rejected, or the answer ends inside the pass, the state rewinds.
    pass_states: dict[int, RecurrentCheckpoint] = field(default_factory=dict, init=False)

    @property
    def reads_hidden(self) -> bool:
        """Its drafter reads the final hidden states of the positions each pass keeps (MTP)."""
        return self.drafter is not None and self.drafter.reads_hidden

    @property
    def reading(self) -> bool:
        """The prompt is not yet run through."""
        return self.prompt_done < len(self.prompt_ids)

    def start(self, runner: Runner) -> None:
        """A new cache and sampler (which penalizes repeats of the whole prompt, restored from the
        prefix cache or not; a draft oracle's follows its answer), resumed after the prompt's
        longest cached prefix."""
        oracle = self.speculation.oracle if self.speculation is not None else None
        self.cache = runner.model.new_cache()
        self.cache.pass_tokens = 1 + self.speculation.k if self.speculation is not None else 0
        self.sampler = Sampler(self.sampling, self.prompt_ids) if oracle is None else oracle.sampler(self.prompt_ids)
        self.seq = list(self.prompt_ids)
        self.prefix = runner.prefix_cache
        if self.prefix is not None:
            self.resume = self.prefix.resume(self.prompt_ids, self.cache, self.namespace)
            self.prompt_done = self.reused_tokens = self.resume.length
            self.checkpoints = self.prefix.takes_checkpoints
        if self.speculation is not None:
            self.drafter = self.speculation.new_drafter(self.prompt_ids, runner.model, self.prompt_done)
            self.controller = DraftController(self.speculation.k) if self.speculation.auto else None

    def kv_need(self) -> tuple[SequenceState, int]:
        """Its cache and the tokens that cache must hold by the next safe point (`Engine.rebalance`):
        the whole prompt while it is read, else one more (and the drafts of a speculative pass)."""
        ahead = 1 + (self.speculation.k if self.speculation is not None else 0)
        return self.cache, len(self.prompt_ids) if self.reading else self.cache.length + ahead

    def read_prompt(self, runner: Runner, chunk: int, between_layers: Callable[[], None] | None = None) -> int | None:
        """Runs the prompt's next `chunk` tokens (at most the engine's prefill chunk); after the
        last, returns the first answer token, else None. `between_layers` may raise to abandon
        the chunk (the sequence must then end)."""
        end = min(len(self.prompt_ids), self.prompt_done + chunk)
        ids = torch.tensor(self.prompt_ids[self.prompt_done:end], dtype=torch.long)
        hidden = [] if self.reads_hidden else None
        logits = runner.prefill(ids, self.cache, checkpoints=self.checkpoints, between_layers=between_layers,
                                hidden=hidden)
        if hidden is not None:
            self.drafter.observe(torch.cat(hidden))
        self.prompt_done = end
        if self.reading:
            return None
        runner.model.experts.end_of_prompt()
        return self.sampler(logits[-1])

    def accept(self, token: int) -> str | None:
        """Counts `token` as given out: the reason the sequence ends with it ("stop": a stop token,
        "length": max_new_tokens reached), else None, and it is the next step's input."""
        self.produced += 1
        self.next_token = token
        if self.drafter is not None:
            self.drafter.add(token)
        if token in self.stop_ids:
            return "stop"
        return "length" if self.produced >= self.max_new_tokens else None

    def advance(self, runner: Runner, logits: torch.Tensor) -> int:
        """After a decode step ran `next_token` (`logits` [vocab]: its row): the token joins the
        sequence, the recurrent state after it is kept where it is a boundary, and the next token
        is sampled. A drafter that reads hidden states missed this position's (a batched step
        hands none): it starts again after it (`_drafts`)."""
        self.drafter_behind = self.drafter_behind or self.reads_hidden
        self.seq.append(self.next_token)
        if self.checkpoints and self.next_token in runner.boundary_ids:
            self.cache.checkpoints[self.cache.length] = self.cache.take()
        return self.sampler(logits)

    def step(self, runner: Runner) -> list[int]:
        """One step of this sequence alone: its drafts verified in one pass where the drafter has
        any, else a plain decode step. Returns the tokens to give out, in order (`accept` each)."""
        drafts, t0, accepted = self._drafts(runner), time.perf_counter(), self.accepted
        if drafts or self.reads_hidden:  # a drafter that reads hidden states needs every position's
            tokens = self.verify_drafts(runner, drafts)
        else:
            tokens = [self.advance(runner, decode_step(runner, [self])[0])]
        if self.controller is not None:  # the step's time ends with its sampled tokens on the host
            self.controller.record(len(drafts), self.accepted - accepted, time.perf_counter() - t0)
        return tokens

    def _drafts(self, runner: Runner) -> list[int]:
        if self.drafter is None:
            return []
        if self.drafter_behind:  # its first pass from here hands it the hidden states it drafts from
            self.drafter = self.speculation.new_drafter([*self.seq, self.next_token], runner.model, self.cache.length)
            self.drafter_behind = False
        k = self.controller.choose() if self.controller is not None else self.speculation.k
        # A pass gives out at most one token more than its drafts: none past max_new_tokens.
        return self.drafter.propose(min(k, self.max_new_tokens - self.produced - 1))

    def verify_drafts(self, runner: Runner, drafts: list[int]) -> list[int]:
        """Runs `next_token` and `drafts` as one chunk (every position's logits; the experts of
        all of them one call per MoE layer), keeps the drafts that the acceptance rule accepts
        (`speculative.verify`) and cuts the cache back to `next_token` and those. Returns the
        tokens to give out: the accepted drafts, then the target's own token."""
        start, ids = self.cache.length, [self.next_token, *drafts]
        hidden = [] if self.reads_hidden else None
        before = self.cache.mark() if drafts and self.cache.rewinds_by_replay else None  # none to reject without
        logits = self._verification_pass(runner, ids, hidden)
        tokens = verify(self.sampler, logits, drafts)
        kept = len(tokens)  # next_token and the accepted drafts, len(tokens) - 1 of them
        if hidden is not None:
            self.drafter.observe(hidden[0][:kept])
        if kept < len(ids) and before is not None:  # the state before the pass, and the kept tokens again
            self.cache.rewind(before)
            self._verification_pass(runner, ids[:kept], None)
        elif kept < len(ids):
            self.cache.truncate(start + kept, self.pass_states.get(start + kept))
        if self.checkpoints:  # as `advance` keeps them: the state after each boundary token run
            self.cache.checkpoints.update({start + i + 1: self.pass_states[start + i + 1] for i in range(kept)
                                           if ids[i] in runner.boundary_ids})
        self.seq += ids[:kept]
        self.drafted += len(drafts)
        self.accepted += kept - 1
        return tokens

    def _verification_pass(self, runner: Runner, ids: list[int], hidden: list[torch.Tensor] | None) -> torch.Tensor:
        """Every position's logits of `ids` run after the cache's tokens (their final hidden states
        appended to `hidden` where given). A recurrent state (the hybrid models' linear layers) is
        taken after each of them, within the one pass, into `pass_states` by length: a rejected
        draft rewinds to one of those. A state rewound by replay (`rewinds_by_replay`) is taken
        only after boundary tokens, where the prefix cache keeps it (the pass is cut there)."""
        start = self.cache.length
        if not self.cache.recurrent:
            at = ()
        elif self.cache.rewinds_by_replay:
            at = tuple(i for i, t in enumerate(ids) if t in runner.boundary_ids) if self.checkpoints else ()
        else:
            at = tuple(range(len(ids)))
        logits = runner.model.verify_pass(ids, self.cache, at, hidden)
        self.pass_states = {n: self.cache.checkpoints.pop(n) for n in range(start + 1, start + len(ids) + 1)
                            if n in self.cache.checkpoints}
        return logits

    def finish(self, keep: bool = True) -> None:
        """Ends the sequence (at any step, or before `start`): with `keep`, the tokens its cache
        holds and their checkpoints go into the prefix cache; the nodes it resumed from are
        released, and its cache goes with it."""
        if self.resume is not None:
            if keep:
                self._hold_given_out()
                checkpoints = self.cache.checkpoints if self.checkpoints else {}
                self.prefix.insert(self.seq[:self.cache.length], self.cache, checkpoints, self.namespace)
            self.prefix.release(self.resume)
            self.resume = None
        self.cache = self.sampler = self.next_token = self.drafter = self.controller = None
        self.pass_states = {}

    def _hold_given_out(self) -> None:
        """A speculative pass may have run tokens that a stop token, or the consumer's leaving,
        kept from being given out: the cache is cut back to what a plain sequence holds at its
        end, the prompt and the answer but its last token (which no step ran)."""
        given = len(self.prompt_ids) + self.produced - 1
        if self.produced and self.cache.length > given:
            self.cache.truncate(given, self.pass_states.get(given))
            for n in [n for n in self.cache.checkpoints if n > given]:
                del self.cache.checkpoints[n]


def decode_step(runner: Runner, seqs: list[Sequence]) -> torch.Tensor:
    """One decode step of `seqs` together, each running its `next_token`: logits [len(seqs), vocab]
    (for one sequence the model's one-token forward, as `decode_batch` picks)."""
    return runner.model.decode_batch([s.next_token for s in seqs], [s.cache for s in seqs])
