"""`SplitTrials`: the adaptive split held to the CPU alone by measured step times.

The adaptive rule (`MissPlanner`, tuned by the device's waits, `PlanRule.bias`) splits a layer's
misses where its model of the copies' and the CPU's rates says both end together. A split has
costs the model does not price (a fill's expert then runs on the device after the copy, a CPU job
has a latency), and where every miss is unlikely to come back (routing that does not recur: the
recency rule is off) the CPU alone can be the faster of the two: then the model's choice loses to
the fixed `cpu` policy. So the rule runs against the CPU alone in short alternating blocks of
decode steps (a round), and the faster by the steps' measured times runs until the next round;
a round that confirms the choice doubles the time until the next one.

The two compete only where their steps cost what they measure: without recurring routing a fill
serves its own call only (`MissPlanner.keeps_fills`), so the cache holds the same experts whichever
arm ran before, and a block's time does not depend on the blocks before it. Where routing recurs,
fills made now are hits later, which a block cannot measure, and the model's rule with its recency
fills runs alone.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

ARMS = ("split", "cpu")  # the model's split (with its bias), and every miss on the CPU
BLOCK_STEPS = 4  # steps of one arm in a row within a round
ROUND = (0, 1, 0, 1)  # the arms' blocks in a round: each twice, interleaved against drift
FIRST_EXPLOIT = 64  # steps after the first round before the next
MAX_EXPLOIT = 1024  # the longest time between rounds, reached by doubling
MARGIN = 0.01  # the CPU alone must be this much faster to replace the model's split


class SplitTrials:
    """The arm each decode step runs (`arm`) and its schedule; `timed` takes each step's
    measured seconds by its width (tokens in the step) and moves the schedule on."""

    def __init__(self) -> None:
        self.arm = 0  # the arm of the step about to run
        self.choice = 0  # the arm the last round chose
        self.rounds = 0
        self.cpu_over_split: float | None = None  # the last round's time ratio
        self._exploit = FIRST_EXPLOIT
        self._queue: list[tuple[int, bool]] = []  # (arm, recorded) of the coming steps
        self._times: tuple[dict[int, list[float]], ...] = (defaultdict(list), defaultdict(list))
        self._start_round()

    def timed(self, width: int, seconds: float) -> int:
        """Takes the time of the step that just ran `arm`; returns the arm of the next step."""
        arm, recorded = self._queue.pop(0)
        if recorded:
            self._times[arm][width].append(seconds)
        if not self._queue:
            if recorded:
                self._end_round()
            else:
                self._start_round()
        self.arm = self._queue[0][0]
        return self.arm

    def summary(self) -> dict:
        return {"arm": ARMS[self.choice], "rounds": self.rounds,
                "cpu_over_split": None if self.cpu_over_split is None else round(self.cpu_over_split, 4)}

    def _start_round(self) -> None:
        for times in self._times:
            times.clear()
        self._queue = [(arm, True) for arm in ROUND for _ in range(BLOCK_STEPS)]

    def _end_round(self) -> None:
        """Chooses the faster arm, then runs it until the next round."""
        ratio = time_ratio(self._times[1], self._times[0])
        self.rounds += 1
        if ratio is not None:
            self.cpu_over_split = ratio
            choice = 1 if ratio < 1 - MARGIN else 0
            confirmed = self.rounds > 1 and choice == self.choice
            self._exploit = min(2 * self._exploit, MAX_EXPLOIT) if confirmed else FIRST_EXPLOIT
            self.choice = choice
        self._queue = [(self.choice, False)] * self._exploit


def time_ratio(a: dict[int, list[float]], b: dict[int, list[float]]) -> float | None:
    """a's step time over b's: the median ratio of each width that both ran (a verification pass
    of n tokens costs more than a one-token step whichever arm runs it), their logarithms averaged
    by the fewer samples of the two; None where they share no width."""
    weights = {w: min(len(a[w]), len(b[w])) for w in a if a[w] and b.get(w)}
    if not weights:
        return None
    logs = sum(n * math.log(statistics.median(a[w]) / statistics.median(b[w])) for w, n in weights.items())
    return math.exp(logs / sum(weights.values()))
