"""`VramPlan`: how one VRAM budget is split between non-expert weights, KV cache, workspace and
expert slots. `--vram-budget` lets a large GPU stand in for an 8–32 GB card."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from ftc_runtime.spec import ModelSpec

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# cuBLAS/cuDNN workspaces and allocator slack; activations and logits are counted from the spec.
LIBRARY_WORKSPACE = 64 << 20


class VramError(ValueError):
    """The budget cannot hold what the engine must keep on the GPU; the message gives the split."""


def parse_size(text: str) -> int:
    """'32GiB', '8GB', '512MiB', '1e9' → bytes: at least 0, less than 2**63."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"size {text!r}: expected a number >= 0 with an optional unit (B, KB, MB, GB, KiB, MiB, "
                         "GiB, ...)")
    size = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not size < 2**63:  # '1e999' is inf; byte counts must fit the int64 that torch and the OS use
        raise ValueError(f"size {text!r}: too large (8 EiB or more)")
    return int(size)


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


def kv_row_elements(spec: ModelSpec) -> int:
    """Elements one token keeps in one attention layer's cache: keys and values per KV head, or
    with latent attention the latent row, its rotary key and the indexer's key."""
    a, ml, ix = spec.attention, spec.mla, spec.indexer
    if ml is None:
        return 2 * a.num_kv_heads * a.head_dim
    return ml.kv_lora_rank + ml.rope_dim + (ix.head_dim if ix is not None else 1)


def compressed_state_bytes(spec: ModelSpec, tokens: int, element_size: int) -> int:
    """Bytes of one sequence's state in compressed attention (DeepSeek-V4) after `tokens` tokens:
    per layer the ring of its last sliding_window raw rows, and per compressor (a layer's own, a
    CSA layer's indexer's) its entries so far, the source rows (keys and gates) of one window and,
    where windows overlap (CSA), the last closed one's first series with its gates in fp32."""
    c, d = spec.compressed, spec.attention.head_dim

    def compressor(rate: int, dim: int, overlap: bool) -> int:
        width = 2 * dim if overlap else dim
        own = (tokens // rate * dim + 2 * rate * width + (rate * dim if overlap else 0)) * element_size
        return own + (rate * dim * 4 if overlap else 0)

    total = 0
    for kind in c.layer_types:
        total += c.sliding_window * d * element_size
        if kind == "hca":
            total += compressor(c.hca_rate, d, False)
        elif kind == "csa":
            total += compressor(c.csa_rate, d, True) + compressor(c.csa_rate, c.index_head_dim, True)
    return total


def sequence_state_bytes(spec: ModelSpec, tokens: int, element_size: int = 2) -> int:
    """Device bytes of one sequence's attention and recurrent state at `tokens` tokens (16-bit
    caches; a Gated DeltaNet layer's recurrent part fp32)."""
    if spec.compressed is not None:
        return compressed_state_bytes(spec, tokens, element_size)
    kv = tokens * len(spec.full_attention_layers) * kv_row_elements(spec) * element_size
    la = spec.linear_attention
    if la is not None:
        conv = (2 * la.num_k_heads * la.k_head_dim + la.num_v_heads * la.v_head_dim) * (la.conv_kernel - 1) * 2
        kv += len(spec.linear_attention_layers) * (conv + la.num_v_heads * la.k_head_dim * la.v_head_dim * 4)
    return kv


def plan_vram(spec: ModelSpec, dense: int, budget: int, expert_stride: int, pool_experts: int,
              max_context: int) -> VramPlan:
    """The split of `budget` for an engine of `spec` whose dense tensors take `dense` bytes as it
    stores them (`models.dense_layout`: bf16, or projections in FP8 where its dense_format says so)."""
    # One sequence's state at max_context (keys and values, a compressed attention's entries, a
    # linear layer's recurrent state): the "KV" share of the budget.
    kv = sequence_state_bytes(spec, max_context)
    workspace = LIBRARY_WORKSPACE + 4 * spec.vocab_size * 4 + 16 * spec.hidden_size * 4 * 64
    free = budget - dense - kv - workspace
    if free < expert_stride:
        raise VramError(f"--vram-budget {gib(budget)}: non-expert weights {gib(dense)}, KV cache for "
                        f"{max_context} tokens {gib(kv)} and workspace {gib(workspace)} leave no room for "
                        f"one expert slot ({expert_stride / 2**20:.1f} MiB)")
    return VramPlan(budget, dense, kv, workspace, expert_stride, min(pool_experts, free // expert_stride),
                    pool_experts)
