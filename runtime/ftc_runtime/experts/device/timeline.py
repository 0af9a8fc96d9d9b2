"""`DeviceTimeline`: where a one-graph decode step's time goes on the GPU, per MoE layer, from CUDA
events recorded inside the step's graph. The events are external (`cudaEventRecordExternal`), so
the graph holds event-record nodes that every replay records again; their gaps are the phases:

- `body`: up to the MoE layer's call, the layer's own work (attention, router, staging) and any
  dense layer before it;
- `plan`: the plan kernels, the CPU job's posting and the step's counters;
- `fills`: the gathered fills from the mapped host pool into their victim slots (the hits run
  beside them, on a side stream);
- `hits`: the filled experts, and what is left of the hits;
- `cpu_wait`: the wait for the CPU's share and its join into the layer's output;
- `head`: after the last MoE layer, the final norm and lm_head.

A timeline is for measuring (`ftc bench decode`): its nodes cost a little, so the step runs
without it otherwise.
"""

from __future__ import annotations

import torch

MOE_PHASES = ("body", "plan", "fills", "hits", "cpu_wait")
PHASES = (*MOE_PHASES, "head")


class DeviceTimeline:
    """Marks recorded by the step's code while it runs (eagerly or into a capture), and the
    milliseconds between them summed over the steps `collect` reads."""

    def __init__(self) -> None:
        self._marks: list[tuple[str, torch.cuda.Event]] = []
        self.reset()

    def reset(self) -> None:
        """Forgets the steps collected so far (the marks stay: a captured graph records them)."""
        self.steps = 0
        self._ms: dict[str, list[float]] = {p: [] for p in PHASES}

    def restart(self) -> None:
        """A step's code runs (eagerly, or into a new capture): its marks replace the last ones."""
        self._marks = []
        self.mark("start")

    def mark(self, phase: str) -> None:
        """The end of `phase` (the start of the step for "start"), on the current stream."""
        if phase != "start" and phase not in PHASES:
            raise ValueError(f"timeline phase {phase!r}: expected one of {', '.join(PHASES)}")
        event = torch.cuda.Event(enable_timing=True, external=True)
        event.record()
        self._marks.append((phase, event))

    def collect(self) -> None:
        """Adds the step that just ran (its events complete) to the sums: the k-th gap of a
        phase is MoE layer k's."""
        seen = {p: 0 for p in PHASES}
        for (_, before), (phase, after) in zip(self._marks, self._marks[1:], strict=False):
            _add_at(self._ms[phase], seen[phase], before.elapsed_time(after))
            seen[phase] += 1
        self.steps += 1

    def summary(self) -> dict:
        """Per token and per MoE layer, in ms, averaged over the collected steps; `per_layer`
        lists each MoE phase layer by layer."""
        n = max(self.steps, 1)
        per_token = {p: round(sum(v) / n, 4) for p, v in self._ms.items()}
        layers = max((len(self._ms[p]) for p in MOE_PHASES), default=0)
        return {
            "steps": self.steps, "moe_layers": layers,
            "ms_per_token": per_token | {"total": round(sum(per_token.values()), 4)},
            "ms_per_moe_layer": {p: round(sum(self._ms[p]) / n / max(layers, 1), 4) for p in MOE_PHASES},
            "per_layer": {p: [round(v / n, 4) for v in self._ms[p]] for p in MOE_PHASES},
        }


def _add_at(sums: list[float], i: int, value: float) -> None:
    """sums[i] += value, growing the list to reach i."""
    if i == len(sums):
        sums.append(0.0)
    sums[i] += value
