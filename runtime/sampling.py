"""Next-token choice: greedy at temperature 0 (or below `MIN_TEMPERATURE`), else temperature and
nucleus (top-p) sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Below this temperature sampling is greedy: dividing logits by a temperature near 0 overflows to
# inf - inf = NaN probabilities, and what remains is the argmax anyway.
MIN_TEMPERATURE = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    top_k: int = 0  # sample among the k likeliest tokens only; 0: all

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature}: expected a number >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p}: expected a number in (0, 1]")
        if not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"seed = {self.seed}: expected an integer in [-2^63, 2^64 - 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k}: expected a number >= 0 (0: no limit)")


# The fields a checkpoint's generation_config.json gives ftc's sampling (engine.json "sampling").
DEFAULT_FIELDS = ("temperature", "top_p", "top_k")


def with_defaults(defaults: dict[str, float | int], seed: int, **given: float | int | None) -> SamplingParams:
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


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator().manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: [vocab] fp32."""
        if self.params.temperature < MIN_TEMPERATURE:
            return int(torch.argmax(logits))
        logits = logits.float()
        if 0 < self.params.top_k < logits.numel():
            kth = torch.topk(logits, self.params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits / self.params.temperature, dim=-1)
        if self.params.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < self.params.top_p  # always keeps the top one
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=self._generator(probs.device)))

    def _generator(self, device: torch.device) -> torch.Generator:
        """Seeded on the logits' device (a GPU samples where its logits are)."""
        if self.generator.device != device:
            self.generator = torch.Generator(device).manual_seed(self.params.seed)
        return self.generator
