"""The fixed tensors of a decode step over n sequences (`StepBuffers`), which its CUDA graphs read
and write in place, and the graphs captured for one width on one set of storages (`Captures`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

DONE_COUNTS = 256  # counts in `StepBuffers.done`: one per KV head of a layer at the most


@dataclass
class StepBuffers:
    """One row per sequence: the residual stream `x` ([n, streams, hidden] where the family mixes
    several), the previous layer's MLP output `mlp`, the residual stream with it joined where a
    layer's first kernel joins it (`joined`), the rotary tables of the step's positions, the input
    tokens and positions (written by the host before each step through `staging`), the logits, a
    CPU part copied in (the host path), a shared expert's output where the family has one, and
    counts of finished programs for the kernels whose last program finishes their work (a
    router's selection, `gemv_kernel.TopK`; an attention head's combine), zero between kernels."""

    x: torch.Tensor
    mlp: torch.Tensor
    joined: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    position: torch.Tensor
    token: torch.Tensor
    logits: torch.Tensor
    cpu_part: torch.Tensor
    shared: torch.Tensor | None
    staging: torch.Tensor  # [2, n] int64 on the host (pinned): tokens, positions
    done: torch.Tensor

    @classmethod
    def make(cls, model, n: int, streams: int = 0) -> StepBuffers:
        spec, dev, dt = model.spec, model.device, model.dtype
        rows = torch.zeros(n, spec.hidden_size, dtype=dt, device=dev)
        x = torch.zeros(n, streams, spec.hidden_size, dtype=dt, device=dev) if streams else torch.zeros_like(rows)
        rotary = torch.zeros(n, 1, model.inv_freq.numel() * 2, dtype=dt, device=dev)
        shared = torch.zeros_like(rows) if spec.moe is not None and spec.moe.num_shared_experts else None
        index = torch.zeros(n, dtype=torch.long, device=dev)
        return cls(x=x, mlp=rows, joined=torch.zeros_like(rows), cos=rotary, sin=torch.zeros_like(rotary),
                   position=index, token=torch.zeros_like(index),
                   logits=torch.zeros(n, spec.vocab_size, dtype=torch.float32, device=dev),
                   cpu_part=torch.zeros(n, spec.hidden_size, dtype=torch.float32, device=dev), shared=shared,
                   staging=torch.zeros(2, n, dtype=torch.long, pin_memory=dev.type == "cuda"),
                   done=torch.zeros(DONE_COUNTS, dtype=torch.int32, device=dev))

    @property
    def width(self) -> int:
        return self.x.shape[0]

    def set_inputs(self, tokens: list[int], positions: list[int]) -> None:
        """Queues the step's tokens and positions to the device (the host's one write per step;
        the staging buffer is free again once the previous step was waited for)."""
        self.staging[0] = torch.tensor(tokens)
        self.staging[1] = torch.tensor(positions)
        self.token.copy_(self.staging[0], non_blocking=True)
        self.position.copy_(self.staging[1], non_blocking=True)


@dataclass
class Captures:
    """The graphs of one step width, captured on `storage` (the sequences' KV generations and the
    expert backend's generation, whose addresses they hold), in their own memory pool; `warm`: a
    step ran eagerly on this storage, so the next one captures."""

    storage: tuple[int, ...]
    pool: tuple = field(default_factory=torch.cuda.graph_pool_handle)
    graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = field(default_factory=dict)
    warm: bool = False
