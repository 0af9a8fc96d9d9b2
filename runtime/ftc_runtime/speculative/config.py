"""`Speculation`: the drafter and the most draft tokens a verification pass checks (`ftc run
--speculate mtp:K`, `ngram:K`), and the families whose state can take it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ftc_runtime.speculative.mtp import MtpDrafter
from ftc_runtime.speculative.ngram import NgramDrafter
from ftc_runtime.speculative.oracle import DraftOracle, OracleDrafter

if TYPE_CHECKING:
    from ftc_runtime.spec import ModelSpec

# The model's own multi-token-prediction layer, or prompt lookup. `auto` picks the first the engine has.
DRAFTERS = ("mtp", "ngram")
# Past a few tokens a pass mostly checks drafts that a rejection earlier in the run has voided
# already, and each one adds its experts' misses to the pass.
MAX_DRAFT_TOKENS = 8
# `auto`'s most drafts a pass: a pass of more tokens reads more experts, and its first try costs that
AUTO_DRAFT_TOKENS = 4
EXPECTED = f"off, auto, mtp:K or ngram:K with K in 1..{MAX_DRAFT_TOKENS}"


class Drafter(Protocol):
    """What a sequence drafts with: told each token given out, asked for up to k drafts; where it
    `reads_hidden`, also told the final hidden states of the positions each pass keeps."""

    reads_hidden: bool

    def add(self, token: int) -> None: ...

    def observe(self, hidden: torch.Tensor) -> None:
        """Only where `reads_hidden`: the final hidden states [T, hidden] of the next T positions."""

    def propose(self, k: int) -> list[int]: ...


@dataclass(frozen=True)
class Speculation:
    drafter: str = "ngram"  # one of DRAFTERS; "" (`auto` before an engine's spec resolves it): the best it has
    k: int = 4  # draft tokens per verification pass, at most
    # A benchmark's drafts of a set acceptance in place of the drafter's (`--draft-oracle`)
    oracle: DraftOracle | None = None
    # `auto`: each pass's drafts chosen in 0..k by what the sequence's passes measured
    # (`DraftController`), none where drafting does not pay
    auto: bool = False

    def __post_init__(self) -> None:
        if self.drafter not in (*DRAFTERS, "") or not 1 <= self.k <= MAX_DRAFT_TOKENS:
            raise ValueError(f"--speculate {self}: expected {EXPECTED}")

    def __str__(self) -> str:
        drafter = (self.drafter or "the engine's best drafter") if self.oracle is None else str(self.oracle)
        return f"auto ({drafter}, up to {self.k})" if self.auto else f"{drafter}:{self.k}"

    def new_drafter(self, context: list[int], model: Any, start: int) -> Drafter:
        """The drafter of a sequence whose context (its prompt) is `context`, run by `model`, its
        first pass starting at position `start` (where it resumed)."""
        mtp = MtpDrafter(model, context, start) if self.drafter == "mtp" else None
        if self.oracle is not None:  # the MTP layer still runs (its cost is the system's), its drafts replaced
            return OracleDrafter(self.oracle, context, mtp)
        return mtp or NgramDrafter(context)

    def for_spec(self, spec: ModelSpec) -> Speculation:
        """Checked against the engine's spec (`check_family`), `auto`'s drafter chosen: the model's
        multi-token-prediction layer where the engine has one, else prompt lookup."""
        self.check_family(spec)
        if self.drafter:
            return self
        return dataclasses.replace(self, drafter="mtp" if spec.mtp_layers else "ngram")

    def check_family(self, spec: ModelSpec) -> None:
        """A rejected draft is dropped by cutting the sequence's state back to the accepted tokens
        (`SequenceState.truncate`: a KV cache by its length, a Gated DeltaNet layer to the state
        its pass kept after each token), or where a pass keeps no such states (DeepSeek-V4's
        compressed attention) by rewinding to the state before the pass and running the accepted
        tokens again. Every family takes `ngram`; `mtp` needs the engine's MTP layer."""
        if self.drafter == "mtp" and not spec.mtp_layers:
            raise ValueError(f"--speculate {self}: engine {spec.name} has no multi-token-prediction layer "
                             "(mtp_layers 0: its checkpoint has none, or it was compiled without); use ngram:K")


def parse_speculation(text: str) -> Speculation | None:
    """`off` (None), `auto` (the engine's best drafter, each pass's drafts 0..AUTO_DRAFT_TOKENS as
    measured: `for_spec` picks the drafter), `mtp:K` or `ngram:K`, K in 1..MAX_DRAFT_TOKENS."""
    drafter, colon, k = text.strip().lower().partition(":")
    if drafter == "off" and not colon:
        return None
    if drafter == "auto" and not colon:
        return Speculation("", AUTO_DRAFT_TOKENS, auto=True)
    if drafter in DRAFTERS and k.isdigit() and 1 <= int(k) <= MAX_DRAFT_TOKENS:
        return Speculation(drafter, int(k))
    raise ValueError(f"--speculate {text!r}: expected {EXPECTED}")
