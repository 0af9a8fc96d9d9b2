"""Reads HF safetensors checkpoints: one file or shards listed in `model.safetensors.index.json`."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ftc_runtime.models.base import CheckpointError

ACCEPTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def nonfinite_count(t: torch.Tensor) -> int:
    """How many values of `t` are NaN or ±Inf. A sum is finite when every value is, and NaN or Inf
    when one is not, so one fast pass settles real weights (a bf16 sum runs ~30× faster than
    `isfinite` on the CPU); only a non-finite sum (or one that overflowed bf16) takes the exact count."""
    if t.numel() == 0 or torch.isfinite(t.sum()):
        return 0
    return int((~torch.isfinite(t)).sum())


class SafetensorsCheckpoint:
    """Lazy access to the tensors of a checkpoint directory, by name (nothing is read up front)."""

    def __init__(self, directory: Path):
        self.directory = directory
        index = directory / "model.safetensors.index.json"
        single = directory / "model.safetensors"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
        elif single.is_file():
            weight_map = None
        else:
            raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")
        files = sorted(set(weight_map.values())) if weight_map else [single.name]
        self._handles = {}
        for name in files:
            path = directory / name
            if not path.is_file():
                raise CheckpointError(f"{path}: shard listed in the index is missing")
            try:
                self._handles[name] = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types for damaged headers
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        self._where = {}
        for name, handle in self._handles.items():
            for key in handle.keys():
                self._where[key] = name
        if weight_map:
            for key, name in weight_map.items():
                if self._where.get(key) != name:
                    raise CheckpointError(f"{directory / name}: tensor {key} is listed in the index but absent")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        """Every tensor's name, in no particular order."""
        return list(self._where)

    def _slice(self, name: str):
        if name not in self._where:
            raise CheckpointError(f"{self.directory}: tensor {name} not found in the checkpoint")
        return self._handles[self._where[name]].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype's safetensors name ("BF16", "F8_E4M3", ...), read from the header."""
        return self._slice(name).get_dtype()

    def raw(self, name: str, index: int | None = None) -> torch.Tensor:
        """The tensor `name` (or its `index`-th entry along dim 0, read alone) as stored."""
        s = self._slice(name)
        if index is None:  # whole, 0-dim scalars included (a slice cannot index those)
            return self._handles[self._where[name]].get_tensor(name)
        return s[index]

    def get(self, name: str, index: int | None = None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The tensor `name` (or its `index`-th entry along dim 0, read alone) as `dtype` (bf16 or fp32)."""
        t = self.raw(name, index)
        where = self.directory / self._where[name]
        if t.dtype not in ACCEPTED_DTYPES:
            raise CheckpointError(f"{where}: tensor {name} has dtype {t.dtype}, expected bfloat16, float16 or float32")
        t = t.to(dtype)  # after the cast: a float32 beyond bf16's range is an Inf too
        bad = nonfinite_count(t)
        if bad:
            part = f" (entry {index} along dim 0)" if index is not None else ""
            raise CheckpointError(f"{where}: tensor {name}{part} has {bad} NaN or Inf values of {t.numel()}; "
                                  "an engine holds finite weights only")
        return t
