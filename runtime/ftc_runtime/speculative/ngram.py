"""`NgramDrafter`: prompt-lookup drafts. The sequence's last n tokens (n from `max_ngram` down to
`min_ngram`) are looked up among its earlier tokens, the latest occurrence first, and the tokens
that followed it are the draft: text that an answer copies from its context (file contents, diffs,
names a coding agent repeats) then comes out several tokens per verification pass.

The index maps each n-gram to the end of its latest occurrence that a token follows, updated as
each token arrives, never rescanned: adding a token or proposing a draft costs O(max_ngram²)
(max_ngram - min_ngram + 1 tuples of at most max_ngram tokens hashed) whatever the context's
length, and the index holds at most (max_ngram - min_ngram + 1) entries per token of context."""

from __future__ import annotations

from collections.abc import Iterable

MIN_NGRAM, MAX_NGRAM = 1, 3


class NgramDrafter:
    reads_hidden = False

    def __init__(self, tokens: Iterable[int] = (), min_ngram: int = MIN_NGRAM, max_ngram: int = MAX_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram lengths {min_ngram}..{max_ngram}: expected 1 <= min <= max")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        # n-gram → the index of the token after its latest occurrence that has one. The sequence's
        # own last n-grams have no token after them yet, so a lookup finds only earlier ones.
        self._after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, token: int) -> None:
        """Appends `token`: the n-grams that end just before it are indexed as followed by it (a
        later occurrence replaces an earlier one)."""
        t, end = self.tokens, len(self.tokens)
        for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
            self._after[tuple(t[end - n:end])] = end
        t.append(token)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.add(token)

    def propose(self, k: int) -> list[int]:
        """k tokens: those after the latest earlier occurrence of the longest suffix of the
        sequence (max_ngram tokens down to min_ngram) that occurred before; [] where none did.
        Where the sequence ends before k tokens follow that occurrence, the copy goes on as it
        went (the draft repeats with the distance from there to the end as its period): a loop,
        or a line repeated, drafts k tokens, not the few before the sequence's end."""
        t = self.tokens
        if k < 1:
            return []
        for n in range(min(self.max_ngram, len(t)), self.min_ngram - 1, -1):
            after = self._after.get(tuple(t[len(t) - n:]))
            if after is not None:
                draft, period = t[after:after + k], len(t) - after
                while len(draft) < k:
                    draft.append(draft[len(draft) - period])
                return draft
        return []
