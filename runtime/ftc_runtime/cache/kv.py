"""Per-sequence KV cache for full-attention layers: contiguous, grown by doubling."""

from __future__ import annotations

import itertools

import torch

_GENERATIONS = itertools.count()
INITIAL_CAPACITY = 256  # tokens per layer before the first doubling


def new_generation() -> int:
    """A number unique in the process, for a storage that was made or moved: what CUDA graphs
    that hold the storage's addresses are keyed on."""
    return next(_GENERATIONS)


class KVCache:
    """Keys [capacity, kv heads, head_dim] and values [capacity, kv heads, value_dim] per layer
    (value_dim: head_dim unless given; latent attention keeps its latent row as the key and the
    sparse-attention indexer's key as the value)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", capacity: int = INITIAL_CAPACITY, value_dim: int | None = None):
        self.length = 0  # tokens whose keys and values every layer holds
        self.generation = new_generation()  # renewed when the storage moves
        # Zeros, not empty: one-token decode graphs attend over the whole capacity with the tail
        # masked off, and a masked NaN would still poison the probabilities' product with values.
        v_shape = (capacity, num_kv_heads, head_dim if value_dim is None else value_dim)
        self._k = [torch.zeros(capacity, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self._v = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def num_layers(self) -> int:
        return len(self._k)

    @property
    def capacity(self) -> int:
        return self._k[0].shape[0] if self._k else 0

    def bytes_for(self, n: int) -> int:
        """Device bytes of this cache once it holds n tokens (growth doubles, as `reserve` does)."""
        cap = self.capacity if n <= self.capacity else max(n, 2 * self.capacity)
        if not self._k:
            return 0
        k, v = self._k[0], self._v[0]
        return len(self._k) * cap * (k[0].numel() + v[0].numel()) * k.element_size()

    def reserve(self, n: int) -> None:
        """Makes room for n tokens in every layer (storage moves when it grows)."""
        if n <= self.capacity:
            return
        cap = max(n, 2 * self.capacity)
        for store in (self._k, self._v):
            for layer, old in enumerate(store):
                grown = old.new_zeros(cap, *old.shape[1:])
                grown[: self.length] = old[: self.length]
                store[layer] = grown
        self.generation = new_generation()

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores k/v [T, kv_heads, head_dim] after `length`; returns all keys and values so far."""
        end = self.length + k.shape[0]
        self.reserve(end)
        self._k[layer][self.length:end] = k
        self._v[layer][self.length:end] = v
        return self._k[layer][:end], self._v[layer][:end]

    def storage(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's whole key and value storage [capacity, kv_heads, head_dim]."""
        return self._k[layer], self._v[layer]

    def keys(self, layer: int) -> torch.Tensor:
        return self._k[layer][: self.length]

    def values(self, layer: int) -> torch.Tensor:
        return self._v[layer][: self.length]
