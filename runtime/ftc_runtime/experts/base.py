"""Routed-expert execution: the interface every backend serves, and the CPU backend."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import torch


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """silu(gate) · up; with a limit above 0 (DeepSeek-V4) the gate is first clamped from above and
    up both ways to it, as the generated kernels do."""
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return torch.nn.functional.silu(gate) * up


class RoutingHook(Protocol):
    """Sees, and may replace, the router's choice on the host: benchmarks replay a trace
    (`routing_trace.TraceReplay`), `ftc trace` records one. Never set while serving."""

    def route(self, moe_layer: int, positions: np.ndarray, ids: np.ndarray,
              weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """positions int64 [T]; ids int64 [T, k]; weights fp32 [T, k] → (ids, weights)."""


@runtime_checkable
class DeviceRoutingHook(RoutingHook, Protocol):
    """A hook that can also replace the choice on the device, as fixed-shape work with no host
    step, so that decode steps run as one CUDA graph with it (`TraceReplay`)."""

    def route_on_device(self, moe_layer: int, positions: torch.Tensor, ids: torch.Tensor,
                        weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`route` on device tensors: positions int64 [T], ids int64 [T, k], weights fp32 [T, k]."""


class ExpertBackend(ABC):
    """Computes the routed experts of one MoE layer, exactly (nothing dropped or approximated)."""

    routing: RoutingHook | None = None

    @abstractmethod
    def forward(self, moe_layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                first_position: int = 0) -> torch.Tensor:
        """x [T, hidden] fp32; ids [T, top_k] expert indices in the layer; weights [T, top_k] fp32;
        the tokens sit at positions first_position, first_position + 1, ... of their sequence.
        Returns Σ_k weights[t, k] · expert_{ids[t, k]}(x[t]) as [T, hidden] fp32."""

    def begin_pass(self, n_tokens: int, prompt: bool = True,  # noqa: B027 (optional, empty by default)
                   known_routes: Mapping[int, np.ndarray] | None = None) -> None:
        """A forward pass over n_tokens tokens begins (a prompt chunk, or with prompt=False one
        decode token of each of n_tokens sequences); its MoE layers follow in order. Backends that
        stream whole layers for long prompt chunks start loading the first one here.
        `known_routes`: MoE layer → every expert its tokens route to, where the family knows that
        before the router runs (by token id): those layers' experts can be loaded early."""

    def end_of_prompt(self) -> None:  # noqa: B027 (an optional hook, empty by default)
        """Called once the prompt of a request has been processed (the static cache pins then)."""

    def routed(self, moe_layer: int, first_position: int, ids: np.ndarray,
               weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The routing hook's choice (the router's when there is no hook), on the host."""
        if self.routing is None:
            return ids, weights
        positions = np.arange(first_position, first_position + ids.shape[0])
        ids, weights = self.routing.route(moe_layer, positions, ids, weights)
        return np.asarray(ids, dtype=np.int64), np.asarray(weights, dtype=np.float32)


@dataclass(frozen=True)
class Routing:
    """One layer's (token, expert) pairs grouped by expert, on the host. A token appears at most
    once per expert (top-k ids are distinct)."""

    ids: np.ndarray  # [u] FTW rows of the routed experts, ascending
    offsets: np.ndarray  # int32 [u + 1]: expert j serves pairs offsets[j] .. offsets[j+1]-1
    tok_idx: np.ndarray  # int32 [pairs] token row
    tok_w: np.ndarray  # float32 [pairs] router weight

    @classmethod
    def build(cls, base: int, ids: np.ndarray, weights: np.ndarray) -> Routing:
        """ids int [T, k] expert indices in the layer, weights [T, k], on the host."""
        k = ids.shape[1]
        flat = ids.reshape(-1).astype(np.int64) + base
        order = np.argsort(flat, kind="stable")
        w = weights.reshape(-1).astype(np.float32)[order]
        if ids.shape[0] == 1:  # one token: its k ids are distinct already (decode's common case)
            return cls(flat[order], np.arange(k + 1, dtype=np.int32), np.zeros(k, dtype=np.int32), w)
        uniq, counts = np.unique(flat[order], return_counts=True)
        offsets = np.zeros(uniq.size + 1, dtype=np.int32)
        np.cumsum(counts, out=offsets[1:])
        return cls(uniq, offsets, (order // k).astype(np.int32), w)

    def counts(self) -> np.ndarray:
        return np.diff(self.offsets)

    def subset(self, which: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """ids, offsets, tok_idx, tok_w of the experts at positions `which`."""
        starts, ends = self.offsets[which], self.offsets[which + 1]
        pairs = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)]) \
            if which.size else np.empty(0, dtype=np.int64)
        offsets = np.zeros(which.size + 1, dtype=np.int32)
        np.cumsum(ends - starts, out=offsets[1:])
        return self.ids[which], offsets, self.tok_idx[pairs], self.tok_w[pairs]

    def tensors(self, which: np.ndarray | None = None) -> tuple[torch.Tensor, ...]:
        """The kernel's arguments (expert ids, offsets, token rows, weights) for `which` (all: None)."""
        parts = self.subset(which) if which is not None else (self.ids, self.offsets, self.tok_idx, self.tok_w)
        return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in parts)


def group_by_expert(base_id: int, ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The CPU kernel's arguments for routed `ids` [T, k] of the MoE layer whose first FTW row is
    `base_id`: expert ids int64 [m], offsets int32 [m+1], token rows int32, router weights fp32."""
    return Routing.build(base_id, ids.cpu().numpy(), weights.float().cpu().numpy()).tensors()


