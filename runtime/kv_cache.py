"""Per-sequence KV cache for full-attention layers: contiguous, grown by doubling."""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", capacity: int = 256):
        self.length = 0  # tokens whose keys and values every layer holds
        shape = (capacity, num_kv_heads, head_dim)
        self._k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores k/v [T, kv_heads, head_dim] after `length`; returns all keys and values so far."""
        end = self.length + k.shape[0]
        if end > self._k[layer].shape[0]:
            cap = max(end, 2 * self._k[layer].shape[0])
            for store in (self._k, self._v):
                grown = store[layer].new_empty(cap, *store[layer].shape[1:])
                grown[: self.length] = store[layer][: self.length]
                store[layer] = grown
        self._k[layer][self.length:end] = k
        self._v[layer][self.length:end] = v
        return self._k[layer][:end], self._v[layer][:end]

    def keys(self, layer: int) -> torch.Tensor:
        return self._k[layer][: self.length]

    def values(self, layer: int) -> torch.Tensor:
        return self._v[layer][: self.length]
