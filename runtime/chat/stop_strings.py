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
        """What of `delta` can be passed on; once a stop string is found (`hit`), the text before it."""
        window = self.held + delta
        found = [(i, s) for i, s in ((window.find(s), s) for s in self.stops) if i >= 0]
        if found:
            cut, self.hit = min(found)
            self.held = ""
            return window[:cut]
        keep = max((partial_suffix(window, s) for s in self.stops), default=0)
        self.held = window[len(window) - keep:]
        return window[:len(window) - keep]

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


def partial_suffix(text: str, stop: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `stop` (text held back
    while the next piece may complete it: a stop string, a tag)."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
