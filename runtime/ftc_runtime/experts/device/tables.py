"""`DeviceTables`: the device plan's copy of a slot cache's tables (`CacheTables`) and its split rule,
beside the host's `ExpertCache`, and which of the two is current. Planned calls update the device's
copy on the device, so between safe points it is ahead of the host's; the host cache is brought up
to date when read, and the device's copy takes the host's state again at the next planned call
after a read (whoever read it may have changed it). Where the adaptive rule competes with the CPU
alone (`SplitTrials`), the rule's q table holds the arm that runs."""

from __future__ import annotations

import torch

from ftc_runtime.experts.cache import ExpertCache
from ftc_runtime.experts.device.device_plan import CacheTables, PlanRule
from ftc_runtime.experts.device.split_trials import SplitTrials
from ftc_runtime.experts.miss_planner import MissPlanner
from ftc_runtime.experts.slots import SlotStore


class DeviceTables:
    """Over `store`'s cache; made at the first planned call, then kept at fixed addresses (CUDA
    graphs hold them) until the slots are rebuilt."""

    def __init__(self, store: SlotStore):
        self.store = store
        self.current: tuple[CacheTables, PlanRule] | None = None
        self._newer = False  # the device's tables hold state that the host cache lacks
        self._host_touched = True  # the host cache may have changed since they took its state
        self.trials = SplitTrials()  # kept across rules: the machine's rates do not change with them
        self._arm_tables: tuple[torch.Tensor, ...] | None = None  # the rule's q table of each arm, where they compete

    @property
    def split_bias(self) -> float:
        """Where the device steps' waits have moved the split (`PlanRule.bias`; reads the device)."""
        return float(self.current[1].bias) if self.current is not None else 0.0

    def host_cache(self) -> ExpertCache:
        """The host cache, up to date: a safe point, where the device's tables, if ahead, are
        written back."""
        if self._newer:
            self.current[0].write_to(self.store.cache)
            self._newer = False
        self._host_touched = True  # whoever reads it may change it
        return self.store.cache

    def for_call(self, planner: MissPlanner, max_unique: int) -> tuple[CacheTables, PlanRule]:
        """The tables and rule of planned calls of up to `max_unique` routed experts, taking the
        host cache's state where it may have changed (the first planned call after a safe point),
        in place; from here they are ahead of it."""
        cache, device = self.store.cache, self.store.device
        if self.current is None:
            with torch.inference_mode(False):  # loaded in place at safe points, in any mode
                recent = planner.recent_steps(self.store.header.num_moe_layers)
                rule = PlanRule.of(planner, max_unique, recent, cache.policy == "lru", device)
                self.current = (CacheTables.of(cache, device), rule)
                self._arm_tables = _competing(rule)
                if self._arm_tables is not None:
                    rule.q_for_m.copy_(self._arm_tables[self.trials.arm])
        elif self._host_touched:
            self.current[0].load(cache)
        self._host_touched, self._newer = False, True
        return self.current

    def step_timed(self, width: int, seconds: float) -> None:
        """A decode step of `width` tokens took `seconds` (replayed from its graph, nothing else
        in flight): the trials take it, and the rule's q table the arm of the next step."""
        if self._arm_tables is None:
            return
        arm = self.trials.arm
        if self.trials.timed(width, seconds) != arm:
            self.current[1].q_for_m.copy_(self._arm_tables[self.trials.arm])

    def forget(self) -> None:
        """The slots were rebuilt (after `host_cache`): the next planned call makes new tables."""
        self.current, self._newer, self._arm_tables = None, False, None


def _competing(rule: PlanRule) -> tuple[torch.Tensor, ...] | None:
    """The q tables of `SplitTrials`' arms (the rule's own, none filled), where they compete: an
    adaptive rule without recency fills that splits some m; else None."""
    if rule.tune_step == 0 or rule.recent_steps or not bool(rule.q_for_m.any()):
        return None
    return rule.q_for_m.clone(), torch.zeros_like(rule.q_for_m)
