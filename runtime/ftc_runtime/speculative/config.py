"""`Speculation`: the drafter and the most draft tokens a verification pass checks (`ftc run
--speculate ngram:K`), and the families whose state can take it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ftc_runtime.speculative.ngram import NgramDrafter
from ftc_runtime.speculative.oracle import DraftOracle, OracleDrafter

if TYPE_CHECKING:
    from ftc_runtime.spec import ModelSpec

DRAFTERS = ("ngram",)
# Past a few tokens a pass mostly checks drafts that a rejection earlier in the run has voided
# already, and each one adds its experts' misses to the pass.
MAX_DRAFT_TOKENS = 8
# `auto`'s most drafts a pass: a pass of more tokens reads more experts, and its first try costs that
AUTO_DRAFT_TOKENS = 4


class Drafter(Protocol):
    """What a sequence drafts with: told each token given out, asked for up to k drafts."""

    def add(self, token: int) -> None: ...

    def propose(self, k: int) -> list[int]: ...


@dataclass(frozen=True)
class Speculation:
    drafter: str = "ngram"
    k: int = 4  # draft tokens per verification pass, at most
    # A benchmark's drafts of a set acceptance in place of the drafter's (`--draft-oracle`)
    oracle: DraftOracle | None = None
    # `auto`: each pass's drafts chosen in 0..k by what the sequence's passes measured
    # (`DraftController`), none where drafting does not pay
    auto: bool = False

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS or not 1 <= self.k <= MAX_DRAFT_TOKENS:
            raise ValueError(f"--speculate {self}: expected off, auto or ngram:K with K in 1..{MAX_DRAFT_TOKENS}")

    def __str__(self) -> str:
        drafter = self.drafter if self.oracle is None else str(self.oracle)
        return f"auto ({drafter}, up to {self.k})" if self.auto else f"{drafter}:{self.k}"

    def new_drafter(self, context: list[int]) -> Drafter:
        """The drafter of a sequence whose context (its prompt) is `context`."""
        return OracleDrafter(self.oracle, context) if self.oracle is not None else NgramDrafter(context)

    def check_family(self, spec: ModelSpec) -> None:
        """A rejected draft is dropped by cutting the sequence's state back to the accepted tokens
        (`SequenceState.truncate`): a KV cache is cut by its length, and a Gated DeltaNet layer's
        state rewinds to the state its pass kept after each token. DeepSeek-V4's compressed state
        keeps one only by cutting its pass at that token, which would run the drafts one by one;
        its rollback is not built yet."""
        if spec.attention.kind == "compressed":
            raise ValueError(f"--speculate {self}: family {spec.family} keeps compressed attention state, "
                             "which cannot roll back a rejected draft yet; use --speculate off")


def parse_speculation(text: str) -> Speculation | None:
    """`off` (None), `auto` (prompt lookup, each pass's drafts 0..AUTO_DRAFT_TOKENS as measured) or
    `ngram:K`, K in 1..MAX_DRAFT_TOKENS."""
    drafter, colon, k = text.strip().lower().partition(":")
    if drafter == "off" and not colon:
        return None
    if drafter == "auto" and not colon:
        return Speculation("ngram", AUTO_DRAFT_TOKENS, auto=True)
    if drafter in DRAFTERS and k.isdigit() and 1 <= int(k) <= MAX_DRAFT_TOKENS:
        return Speculation(drafter, int(k))
    raise ValueError(f"--speculate {text!r}: expected off, auto or ngram:K with K in 1..{MAX_DRAFT_TOKENS}")
