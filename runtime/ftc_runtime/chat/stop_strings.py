"""Stop strings: a streamed text cut before the first of them, matched on the text's tail only."""

from __future__ import annotations


class StopMatcher:
    """Text deltas in, the text to pass on out, until a stop string appears; matching looks at the
    held-back tail and the new delta only, so its cost does not grow with the answer."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""  # the end of the text so far that may begin a stop string
        self.hit: str | None = None

    def feed(self, delta: str) -> str:
        """What of `delta` can be passed on; once a stop string is found (`hit`), the text before it.
        A stop string found is taken only when no other can still begin before it: with "a" and
        "baa", a text "cba" waits for what follows, since "baa" would stop it after "c"."""
        window = self.held + delta
        pending = len(window) - max((partial_suffix(window, s) for s in self.stops), default=0)
        found = self._first(window)
        if found is not None and found[0] <= pending:
            return self._stop(window, *found)
        self.held = window[pending:]
        return window[:pending]

    def flush(self) -> str:
        """The text held back, at the end of the stream: up to a stop string it holds, if any."""
        held, self.held = self.held, ""
        found = self._first(held)
        return held if found is None else self._stop(held, *found)

    def _first(self, text: str) -> tuple[int, str] | None:
        """The earliest stop string in `text` (the shorter of two at one place) and where it begins."""
        return min(((i, s) for i, s in ((text.find(s), s) for s in self.stops) if i >= 0), default=None)

    def _stop(self, text: str, cut: int, stop: str) -> str:
        self.hit, self.held = stop, ""
        return text[:cut]


def partial_suffix(text: str, stop: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `stop` (text held back
    while the next piece may complete it: a stop string, a tag)."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
