"""Routing traces: the experts a router chose, per token and MoE layer, recorded or synthetic.

A replayed trace replaces the router's choice in benchmarks, so that a random-weight engine sees a
real model's expert locality. It never changes served output: engines use it only when a benchmark
asks. Format (`.npz`, the same keys as the traces in ../shared/traces): `experts` int16
[tokens, layers, k] with -1 where a row is absent, `weights` float32 [tokens, layers, k],
`is_decode` bool [tokens].
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


class TraceError(ValueError):
    """A trace file is unreadable or does not fit the engine."""


@dataclass(frozen=True)
class RoutingTrace:
    experts: np.ndarray  # int16 [T, L, k], -1 = absent
    weights: np.ndarray  # float32 [T, L, k]
    is_decode: np.ndarray  # bool [T]

    @property
    def shape(self) -> tuple[int, int, int]:
        t, layers, k = self.experts.shape
        return t, layers, k

    @classmethod
    def load(cls, path: Path) -> RoutingTrace:
        try:
            z = np.load(path)
            trace = cls(z["experts"].astype(np.int16), z["weights"].astype(np.float32), z["is_decode"].astype(bool))
        except (OSError, KeyError, ValueError) as e:
            raise TraceError(f"{path}: not a routing trace (.npz with experts, weights, is_decode): {e}") from None
        if trace.experts.ndim != 3 or trace.weights.shape != trace.experts.shape or \
                trace.is_decode.shape != trace.experts.shape[:1]:
            raise TraceError(f"{path}: arrays disagree in shape ({trace.experts.shape}, {trace.weights.shape}, "
                             f"{trace.is_decode.shape})")
        return trace

    def save(self, path: Path) -> None:
        np.savez_compressed(path, experts=self.experts, weights=self.weights, is_decode=self.is_decode)

    def check_fits(self, num_layers: int, num_experts: int, source: str) -> None:
        """An engine with fewer MoE layers than the trace (a truncated benchmark engine) replays
        the trace's first layers."""
        t, layers, _ = self.shape
        if layers < num_layers:
            raise TraceError(f"{source}: {layers} MoE layers, the engine has {num_layers}")
        if self.experts.max() >= num_experts:
            raise TraceError(f"{source}: expert id {int(self.experts.max())} ≥ the engine's {num_experts} experts")
        if t == 0:
            raise TraceError(f"{source}: no tokens")


def synthetic_trace(tokens: int, layers: int, experts: int, k: int, locality: float, skew: float = 1.0,
                    seed: int = 0) -> RoutingTrace:
    """Each token keeps each of the previous token's experts (same layer) with probability
    `locality` and draws the rest from a Zipf(`skew`) popularity over a per-layer random ranking."""
    if not 0 <= locality <= 1 or k > experts:
        raise TraceError(f"synthetic trace: locality {locality} must be in [0, 1] and k {k} ≤ experts {experts}")
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, experts + 1) ** skew
    ranking = np.stack([rng.permutation(experts) for _ in range(layers)])
    out = np.empty((tokens, layers, k), dtype=np.int16)
    for layer in range(layers):
        p = np.empty(experts)
        p[ranking[layer]] = popularity / popularity.sum()
        prev: list[int] = []
        for t in range(tokens):
            chosen = [e for e in prev if rng.random() < locality]
            while len(chosen) < k:
                e = int(rng.choice(experts, p=p))
                if e not in chosen:
                    chosen.append(e)
            out[t, layer] = chosen
            prev = chosen
    return RoutingTrace(out, np.full(out.shape, 1.0 / k, dtype=np.float32), np.ones(tokens, dtype=bool))


class TraceReplay:
    """Routes token position p of MoE layer l as trace row p mod T. When the trace's k is smaller
    than the model's, the trace's experts take the top ranks and the model's own ranking fills the
    remaining ones (skipping duplicates); when it is larger, its first k ranks are used. A pool layer
    past the trace's (a multi-token-prediction layer's) replays trace layer l mod L. Weights
    are uniform: a replay measures speed, its output means nothing. `route` runs on the host
    (`ExpertBackend.routing`), where the routed ids already are; `route_on_device` is the same as
    fixed-shape device work, for decode steps that run as one CUDA graph."""

    def __init__(self, trace: RoutingTrace):
        self.trace = trace
        # Each row's experts as Python lists, padding dropped: a decode step replays one row per
        # MoE layer, and numpy element access per call cost ~10 µs of host time per layer.
        self.rows = [[[int(e) for e in layer if e >= 0] for layer in row] for row in trace.experts]
        self._tables: dict[tuple[torch.device, int], torch.Tensor] = {}

    def route(self, moe_layer: int, positions: np.ndarray, ids: np.ndarray,
              weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k, moe_layer = ids.shape[1], moe_layer % self.trace.shape[1]
        chosen = np.empty_like(ids)
        for t, p in enumerate(positions.tolist()):
            picks = self.rows[p % len(self.rows)][moe_layer][:k]
            if len(picks) < k:
                taken = set(picks)
                picks = picks + [e for e in ids[t].tolist() if e not in taken][: k - len(picks)]
            chosen[t] = picks
        return chosen, np.full(weights.shape, 1.0 / k, dtype=np.float32)

    def route_on_device(self, moe_layer: int, positions: torch.Tensor, ids: torch.Tensor,
                        weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`route` on device tensors, with no host work: positions int64 [T], ids int64 [T, k]. On
        a GPU one Triton kernel (`replay_kernel`)."""
        k, moe_layer = ids.shape[1], moe_layer % self.trace.shape[1]
        table = self._table(ids.device, k)
        if ids.is_cuda:
            from ftc_runtime.experts.replay_kernel import replay_route_gpu  # Triton: beside a GPU

            return replay_route_gpu(table, moe_layer, positions, ids)
        picks = table[positions % table.shape[0], moe_layer]
        return fill_missing(picks, ids), torch.full_like(weights, 1.0 / k)

    def _table(self, device: torch.device, k: int) -> torch.Tensor:
        """The trace's experts [T, L, k] int64 on `device`, each row's first k left-aligned, -1 after."""
        key = (device, k)
        if key not in self._tables:
            t, layers, _ = self.trace.shape
            table = np.full((t, layers, k), -1, dtype=np.int64)
            for p, row in enumerate(self.rows):
                for layer, picks in enumerate(row):
                    table[p, layer, :min(k, len(picks))] = picks[:k]
            self._tables[key] = torch.from_numpy(table).to(device)
        return self._tables[key]


def fill_missing(picks: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """picks [T, k] with -1 after its valid entries; each -1 takes the next of `own` [T, k] (the
    model's ranking) not already picked, in order. Fixed shapes, no host work."""
    t, k = picks.shape
    taken = (own.unsqueeze(2) == picks.unsqueeze(1)).any(2)
    target = (picks >= 0).sum(1, keepdim=True) + torch.cumsum(~taken, 1) - 1
    usable = ~taken & (target < k)
    out = torch.cat([picks, picks.new_full((t, 1), -1)], 1)  # column k takes what is not used
    out.scatter_(1, torch.where(usable, target, k), own)
    return out[:, :k]


class TraceRecorder:
    """Records the router's own choices by token position (for `ftc trace`)."""

    def __init__(self, layers: int):
        self.layers = layers
        self.rows: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}

    def route(self, moe_layer: int, positions: np.ndarray, ids: np.ndarray,
              weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        for p, i, w in zip(positions.tolist(), ids, weights, strict=True):
            self.rows.setdefault(p, {})[moe_layer] = (i.copy(), w.copy())
        return ids, weights

    def trace(self, prompt_tokens: int) -> RoutingTrace:
        positions = sorted(self.rows)
        k = next(iter(self.rows[positions[0]].values()))[0].size
        experts = np.full((len(positions), self.layers, k), -1, dtype=np.int16)
        weights = np.zeros(experts.shape, dtype=np.float32)
        for t, p in enumerate(positions):
            for layer, (i, w) in self.rows[p].items():
                experts[t, layer], weights[t, layer] = i, w
        return RoutingTrace(experts, weights, np.array([p >= prompt_tokens for p in positions]))
