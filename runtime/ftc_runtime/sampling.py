"""Next-token choice: greedy at temperature 0 (or below `MIN_TEMPERATURE`), else temperature and
nucleus (top-p) sampling; before either, the repetition, presence and frequency penalties of the
tokens the sequence holds (`Penalties`); a reasoning budget closes `<think>` once it is spent."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Below this temperature sampling is greedy: dividing logits by a temperature near 0 overflows to
# inf - inf = NaN probabilities, and what remains is the argmax anyway.
MIN_TEMPERATURE = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's presence_penalty and frequency_penalty
# The repetition penalty's upper limit: past a few it bans every token the text holds (1.1-1.3 are
# the usual values), and an upper limit keeps infinity out.
MAX_REPETITION_PENALTY = 10.0


@dataclass(frozen=True)
class ReasoningBudget:
    """At most `tokens` tokens of reasoning (Anthropic's thinking.budget_tokens): once an answer
    has that many inside `<think>` (token `open_id`; the prompt may have opened it), the next token
    is the closing tag (`close_id`), and the answer goes on after it."""

    tokens: int
    open_id: int
    close_id: int

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"reasoning budget = {self.tokens}: expected at least 1 token")


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0  # sample among the k likeliest tokens only; 0: all
    # OpenAI's: subtracted from the logit of every token the answer has produced so far, once
    # (presence) or once per time it was produced (frequency); negative values favour repeats.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Hugging Face's (llama.cpp's repeat penalty): the logit of every token in the prompt or the
    # answer is divided by it where positive, multiplied by it where negative; 1: off.
    repetition_penalty: float = 1.0
    reasoning_budget: ReasoningBudget | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature}: expected a number >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p}: expected a number in (0, 1]")
        if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed = {self.seed}: expected an integer in [-2^63, 2^64 - 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k}: expected a number >= 0 (0: no limit)")
        self._check_penalties()

    def _check_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:  # NaN fails too
                raise ValueError(f"{name} = {value}: expected a number in [-2, 2] (0: off)")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty = {self.repetition_penalty}: expected a number in "
                             f"(0, {MAX_REPETITION_PENALTY:g}] (1: off)")

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (else the sampler keeps no history)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


# The fields a checkpoint's generation_config.json gives ftc's sampling (engine.json "sampling").
PENALTY_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty")
DEFAULT_FIELDS = ("temperature", "top_p", "top_k", *PENALTY_FIELDS)


def with_defaults(defaults: dict[str, float | int], seed: int, **given: float | int | ReasoningBudget | None
                  ) -> SamplingParams:
    """Sampling as asked (`given`, None: not asked), else the engine's defaults (its checkpoint's
    generation_config.json), else SamplingParams'."""
    chosen = {k: v for k, v in defaults.items() if k in DEFAULT_FIELDS}
    chosen |= {k: v for k, v in given.items() if v is not None}
    return SamplingParams(seed=seed, **chosen)


def check_defaults(d: object) -> dict[str, float | int]:
    """engine.json's "sampling": a mapping of DEFAULT_FIELDS that SamplingParams takes."""
    if not isinstance(d, dict) or not set(d) <= set(DEFAULT_FIELDS):
        raise ValueError(f"expected a mapping of {', '.join(DEFAULT_FIELDS)}")
    for k, v in d.items():
        if isinstance(v, bool) or not isinstance(v, int if k == "top_k" else (int, float)):
            raise ValueError(f"{k} = {v!r}: expected a number")
    SamplingParams(**d)  # the ranges
    return d


class Penalties:
    """One sequence's history as per-vocab tensors on its logits' device, each updated in O(1) per
    token (no re-count of the history): `seen`, the tokens of the prompt and the answer (the
    repetition penalty's set, as in HF and vLLM), and `counts`, the answer's tokens alone (OpenAI's
    presence and frequency penalties count what the model said, not what it was told)."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int]):
        self.params = params
        # Kept as ids until the first logits say the vocabulary size and the device.
        self.prompt = list(prompt_ids) if params.repetition_penalty != 1 else []
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The penalized logits [vocab] fp32, a new tensor (`logits` may be a row of a batch)."""
        logits = logits.float()
        if self.counts is None:
            self._start(logits)
        p = self.params
        if p.repetition_penalty != 1:
            scaled = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = torch.where(self.seen, scaled, logits)
        if p.presence_penalty != 0 or p.frequency_penalty != 0:
            logits = logits - p.frequency_penalty * self.counts - p.presence_penalty * (self.counts > 0)
        return logits

    def add(self, token: int) -> None:
        """Records a generated token."""
        self.counts[token] += 1
        self.seen[token] = True

    def _start(self, logits: torch.Tensor) -> None:
        self.counts = torch.zeros_like(logits)
        self.seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        self.seen[torch.tensor(self.prompt, dtype=torch.long, device=logits.device)] = True
        self.prompt = []


class ReasoningCount:
    """Where a sequence stands against its `ReasoningBudget`: inside `<think>` or not (from the
    prompt's last tag on), and the reasoning tokens produced since it opened."""

    def __init__(self, budget: ReasoningBudget, prompt_ids: Sequence[int]):
        self.budget, self.used = budget, 0
        tags = [t for t in prompt_ids if t in (budget.open_id, budget.close_id)]
        self.inside = bool(tags) and tags[-1] == budget.open_id

    def forced(self) -> int | None:
        """The closing tag once the budget is spent, else None (the sampler chooses)."""
        return self.budget.close_id if self.inside and self.used >= self.budget.tokens else None

    def add(self, token: int) -> None:
        if token == self.budget.open_id:
            self.inside, self.used = True, 0
        elif token == self.budget.close_id:
            self.inside = False
        elif self.inside:
            self.used += 1


class Sampler:
    """The next-token choice of one sequence. With a penalty on it keeps that sequence's history,
    the prompt given here and then every token it returns, so each request (each chat turn) has
    a Sampler of its own; without one it keeps nothing. With a reasoning budget it counts the
    reasoning tokens and closes the reasoning once they are spent."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = ()):
        self.params = params
        self.generator = torch.Generator().manual_seed(params.seed)
        self.penalties = Penalties(params, prompt_ids) if params.penalized else None
        budget = params.reasoning_budget
        self.reasoning = ReasoningCount(budget, prompt_ids) if budget is not None else None

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [vocab] fp32. The token chosen is recorded as generated."""
        token = self.forced()
        if token is None:
            token = self._pick(logits)
        self.record(token)
        return token

    def _pick(self, logits: torch.Tensor) -> int:
        """The sampler's own choice, the reasoning budget aside: the penalized argmax, or a draw."""
        return int(torch.argmax(self.penalized(logits))) if self.greedy else self.draw(self.distribution(logits))

    @property
    def greedy(self) -> bool:
        return self.params.temperature < MIN_TEMPERATURE

    def forced(self) -> int | None:
        """The token the reasoning budget imposes now (its closing tag), else None."""
        return self.reasoning.forced() if self.reasoning is not None else None

    def penalized(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.penalties is None else self.penalties.apply(logits)

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The probabilities [vocab] fp32, summing to 1, that a sampled token is drawn from (not
        greedy): the penalties, top-k, temperature and top-p applied to `logits`. The speculative
        acceptance rule (`speculative.verify`) judges drafts against this same distribution."""
        logits = self.penalized(logits).float()
        if 0 < self.params.top_k < logits.numel():
            kth = torch.topk(logits, self.params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits / self.params.temperature, dim=-1)
        if self.params.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < self.params.top_p  # always keeps the top one
            kept = sorted_p[keep]
            probs = torch.zeros_like(probs).scatter_(0, order[keep], kept / kept.sum())
        return probs

    def draw(self, weights: torch.Tensor) -> int:
        """A token drawn in proportion to `weights` [vocab] (need not sum to 1), from the seeded stream."""
        return int(torch.multinomial(weights, 1, generator=self._generator(weights.device)))

    def uniform(self, device: torch.device) -> torch.Tensor:
        """A number uniform in [0, 1) from the seeded stream, on `device`."""
        return torch.rand((), generator=self._generator(device), device=device)

    def record(self, token: int) -> None:
        """Counts `token` as generated: the penalties' history and the reasoning budget."""
        if self.penalties is not None:
            self.penalties.add(token)
        if self.reasoning is not None:
            self.reasoning.add(token)

    def _generator(self, device: torch.device) -> torch.Generator:
        """Seeded on the logits' device (a GPU samples where its logits are)."""
        if self.generator.device != device:
            self.generator = torch.Generator(device).manual_seed(self.params.seed)
        return self.generator
