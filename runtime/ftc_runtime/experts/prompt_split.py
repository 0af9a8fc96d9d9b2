"""`PromptSplit`: how many of a streamed prompt chunk's uncached experts, per MoE layer, the CPU
computes in place instead of copying them over PCIe (FreeToken's miss split, applied to prompts).

A streamed layer with u uncached experts and no CPU part copies them all, t_a = S / B_P each (S
the expert's bytes, B_P the host→device rate alone). With a CPU part of c experts it copies u − c
of them at t_p = S / B_P' each (B_P' the rate while the CPU computes), and the CPU's result comes
back over the same link: r = T·R / B_P' for a chunk of T tokens (R the result's bytes per token,
read whole whatever c is: 64 MiB a layer at 8K tokens of hidden 2048, the copy of 7 experts). The
CPU computes c in place, t_c(n) each for n tokens per expert (n ≈ T·k / E). A CPU part also costs
the layer a serial stretch g that nothing hides: the next layer's input needs this layer's CPU
result, so from the CPU's end the device adds it, runs the next layer's attention and router, and
the CPU waits for that routing before it starts again (the copies run on meanwhile; without a CPU
part they are the whole layer). So the layer takes u·t_a with no CPU part and
max((u − c)·t_p + r, c·t_c + g) with one: both sides end together at
c = (u·t_p + r − g) / (t_p + t_c(n)); of the whole numbers beside it and none, the one whose layer
ends first. Where the CPU's share is small the result's read and the slower copies beside the CPU
outweigh it (8K tokens of `qwen3-30b-a3b` on 16 cores: docs/performance.md), and the CPU gets none.

t_c starts from the CPU kernel's own model: it reads an expert's rows once per token bucket (its
largest, `bucket` tokens, computed per row read) at B_H', its rate while copies run. From the
first CPU part on, it follows what the layers measure: the seconds per expert-token of the last
parts, kept per power of two of n (a chunk's experts see about the same n, the next chunk's may
not), so that the split tracks the machine it runs on and its kernel's real matrix speed; g
follows what the layers measure too (from the end of one CPU part to the start of the next, per
power of two of n; not where the layer's copies were still landing at the CPU's end, since the
next routing then waits for them), zero until then. Each estimate is the median of its latest
WINDOW measurements, and where the estimates give the CPU none before they rest on WINDOW of them,
a part measures again: one expert for the CPU's time; for the stretch, the count without it (a
part of one expert ends long before the copies, so its stretch is not counted). Otherwise a first
prompt's one-time cost (a 1.18 s stretch, seen on the device) gives the CPU none for the engine's
life.

The estimates leave out the device's own work; the chunk's layers cap the count where it shows
(`LayerStream`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

PREFILL_SPLIT_MODES = "off, auto, or a share in [0, 1]"
WINDOW = 5  # the latest measurements an estimate keeps, per power of two of tokens per expert


def parse_prefill_split(value: str) -> float | None | str:
    """`off` (None: every uncached expert streams), `auto` (the measured rates decide) or a fixed
    share in [0, 1] of each layer's uncached experts for the CPU (benchmarks and tests)."""
    text = str(value).strip().lower()
    if text in ("off", "auto"):
        return None if text == "off" else "auto"
    try:
        share = float(text)
    except ValueError:
        share = math.nan
    if not 0.0 <= share <= 1.0:  # NaN fails too
        raise ValueError(f"--prefill-split {value!r}: expected {PREFILL_SPLIT_MODES}")
    return share


@dataclass
class PromptSplit:
    """`share` None: the rates decide (auto); else that share of each layer's uncached experts,
    rounded to nearest, goes to the CPU. Rates in GB/s; `expert_bytes` one expert's FTW stretch."""

    expert_bytes: int
    top_k: int
    num_experts: int
    copy_gbps: float  # B_P': host→device while the CPU kernel runs
    cpu_gbps: float  # B_H': the CPU kernel's weight reads while copies run (one token per expert)
    bucket: int  # the CPU kernel's largest token bucket: rows are read once per bucket of tokens
    share: float | None = None
    copy_alone_gbps: float | None = None  # B_P: host→device with no CPU part (None: B_P')
    token_bytes: int = 0  # R: the CPU result's bytes per token of the chunk, read back over PCIe
    # power of two of n → seconds per expert-token measured at about that many tokens per expert
    measured: dict[int, list[float]] = field(default_factory=dict)
    # power of two of n → seconds from one layer's CPU end to the next layer's CPU start
    serial: dict[int, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        alone = self.copy_gbps if self.copy_alone_gbps is None else self.copy_alone_gbps
        if min(self.copy_gbps, self.cpu_gbps, alone) <= 0 or self.bucket < 1:
            raise ValueError(f"prompt split: rates must be positive (B_P' {self.copy_gbps}, B_H' {self.cpu_gbps}, "
                             f"B_P {self.copy_alone_gbps} GB/s) and the kernel's bucket at least 1 ({self.bucket})")

    def tokens_per_expert(self, n_tokens: int) -> float:
        """Tokens each expert of a layer sees, on average, in a chunk of n_tokens."""
        return n_tokens * self.top_k / self.num_experts

    def cpu_seconds(self, n: float) -> float:
        """The CPU kernel's time for one expert of n tokens: measured near n, else its model."""
        rates = self.measured.get(_octave(n))
        if rates:
            return statistics.median(rates) * max(n, 1.0)
        return math.ceil(max(n, 1.0) / self.bucket) * self.expert_bytes / (self.cpu_gbps * 1e9)

    def serial_seconds(self, n: float) -> float:
        """The stretch a CPU part adds for experts of n tokens: measured near n, else none."""
        stretches = self.serial.get(_octave(n))
        return statistics.median(stretches) if stretches else 0.0

    def copy_seconds(self) -> float:
        """t_p: one expert's copy while the CPU computes."""
        return self.expert_bytes / (self.copy_gbps * 1e9)

    def alone_copy_seconds(self) -> float:
        """t_a: one expert's copy in a layer without a CPU part."""
        return self.expert_bytes / ((self.copy_alone_gbps or self.copy_gbps) * 1e9)

    def result_seconds(self, n_tokens: int) -> float:
        """r: the CPU result's read over PCIe, for a chunk of n_tokens."""
        return n_tokens * self.token_bytes / (self.copy_gbps * 1e9)

    def cpu_count(self, uncached: int, n_tokens: int, cap: int | None = None) -> int:
        """How many of a layer's `uncached` experts the CPU computes, for a chunk of n_tokens; at
        most `cap` where the chunk's layers set one (`LayerStream`)."""
        if uncached <= 0:
            return 0
        if self.share is not None:
            return min(uncached, math.floor(uncached * self.share + 0.5))
        n = self.tokens_per_expert(n_tokens)
        layer = _Layer(uncached, self.alone_copy_seconds(), self.copy_seconds(), self.result_seconds(n_tokens),
                       self.cpu_seconds(n), self.serial_seconds(n))
        c = layer.balanced()
        if cap is not None:
            return min(c, cap)
        if c == 0 and uncached >= 2:  # none, maybe on too few measurements: a part measures again
            octave = _octave(n)
            if len(self.measured.get(octave, ())) < WINDOW:
                return 1  # one expert times the CPU
            if len(self.serial.get(octave, ())) < WINDOW:
                # the count without the stretch: a part that ends with the copies, whose stretch counts
                return replace(layer, g=0.0).balanced()
        return c

    def record(self, experts: int, pairs: int, seconds: float) -> None:
        """A CPU part took `seconds` for `experts` experts of `pairs` (token, expert) pairs in all."""
        if experts <= 0 or pairs <= 0 or seconds <= 0:
            return
        n = pairs / experts
        rate = seconds / pairs
        _keep(self.measured, _octave(n), rate)

    def record_serial(self, n_tokens: int, seconds: float) -> None:
        """From one layer's CPU part's end to the next's start took `seconds`, in a chunk of n_tokens."""
        if seconds >= 0:
            _keep(self.serial, _octave(self.tokens_per_expert(n_tokens)), seconds)


@dataclass(frozen=True)
class _Layer:
    """A streamed layer's sides, in seconds: u uncached experts, each copied in t_a with no CPU
    part and t_p beside one; with a CPU part, its result's read r on the copies' side, and t_c an
    expert and the stretch g on the CPU's."""

    u: int
    t_a: float
    t_p: float
    r: float
    t_c: float
    g: float

    def seconds(self, c: int) -> float:
        """The layer's time with c experts on the CPU."""
        if c == 0:
            return self.u * self.t_a
        return max((self.u - c) * self.t_p + self.r, c * self.t_c + self.g)

    def balanced(self) -> int:
        """The CPU's count where the layer ends first, in whole experts: none, or a neighbour of
        the count where both sides end together."""
        balance = max(0.0, (self.u * self.t_p + self.r - self.g) / (self.t_p + self.t_c))
        near = (min(math.floor(balance), self.u), min(math.ceil(balance), self.u))
        return min((0, *near), key=lambda c: (self.seconds(c), c))


def _keep(table: dict[int, list[float]], key: int, value: float) -> None:
    """Keeps `value` among the latest WINDOW measurements at `key`."""
    table[key] = [*table.get(key, [])[-(WINDOW - 1):], value]


def _octave(n: float) -> int:
    """The power of two nearest n (in log scale): the key of the CPU's measured rates."""
    return round(math.log2(max(n, 1.0)))
