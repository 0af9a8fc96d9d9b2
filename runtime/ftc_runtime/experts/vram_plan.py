"""`VramPlan`: how one VRAM budget is split between non-expert weights, KV cache, workspace and
expert slots. `--vram-budget` lets a large GPU stand in for an 8–32 GB card."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ftc_runtime.models import family
from ftc_runtime.spec import ModelSpec

# cuBLAS/cuDNN workspaces and allocator slack; activations and logits are counted from the spec.
LIBRARY_WORKSPACE = 64 << 20


class VramError(ValueError):
    """The budget cannot hold what the engine must keep on the GPU; the message gives the split."""


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class VramPlan:
    budget: int
    dense: int  # non-expert weights as the engine stores them (bf16, or projections in FP8)
    kv: int  # KV cache for max_context tokens, bf16
    workspace: int
    expert_stride: int  # bytes of one slot
    n_slots: int
    pool_experts: int

    @property
    def slots(self) -> int:
        return self.n_slots * self.expert_stride

    @property
    def total(self) -> int:
        return self.dense + self.kv + self.workspace + self.slots

    @property
    def pool_share(self) -> float:
        return self.n_slots / self.pool_experts

    def to_dict(self) -> dict:
        return asdict(self) | {"slots_bytes": self.slots, "total": self.total, "pool_share": self.pool_share}


def plan_vram(spec: ModelSpec, dense: int, budget: int, expert_stride: int, pool_experts: int,
              max_context: int) -> VramPlan:
    """The split of `budget` for an engine of `spec` whose dense tensors take `dense` bytes as it
    stores them (`models.dense_layout`: bf16, or projections in FP8 where its dense_format says so)."""
    # One sequence's state at max_context, as its family counts it (keys and values, a compressed
    # attention's entries, a linear layer's recurrent state): the "KV" share of the budget.
    kv = family(spec.family).state_bytes(spec, max_context, 2)
    workspace = LIBRARY_WORKSPACE + 4 * spec.vocab_size * 4 + 16 * spec.hidden_size * 4 * 64
    free = budget - dense - kv - workspace
    if free < expert_stride:
        raise VramError(f"--vram-budget {gib(budget)}: non-expert weights {gib(dense)}, KV cache for "
                        f"{max_context} tokens {gib(kv)} and workspace {gib(workspace)} leave no room for "
                        f"one expert slot ({expert_stride / 2**20:.1f} MiB)")
    return VramPlan(budget, dense, kv, workspace, expert_stride, min(pool_experts, free // expert_stride),
                    pool_experts)
