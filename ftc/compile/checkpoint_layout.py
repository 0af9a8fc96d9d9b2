"""`CheckpointLayout`: the canonical tensor names of a model (`dense_tensor_shapes`) found in one
checkpoint, whatever layout it was written in:
- Qwen3.5's image-text checkpoints keep the language model under `model.language_model.`;
- Qwen3-Next's linear layers project q, k, v, z as one grouped `in_proj_qkvz` and b, a as one
  `in_proj_ba` (per key head: its q, k, then its value heads' v, then their z), where Qwen3.5 has
  the split `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` that the runtime runs.
"""

from __future__ import annotations

import torch

from ftc.compile.checkpoint import CheckpointError, SafetensorsCheckpoint
from ftc_runtime.spec import ModelSpec

_SPLIT = {"in_proj_qkv.weight": "qkvz", "in_proj_z.weight": "qkvz", "in_proj_b.weight": "ba",
          "in_proj_a.weight": "ba"}


class CheckpointLayout:
    def __init__(self, ckpt: SafetensorsCheckpoint, spec: ModelSpec):
        self.ckpt, self.spec = ckpt, spec
        self.prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in ckpt else "model."

    def name(self, canonical: str) -> str:
        """Where the canonical `model.…` tensor sits in this checkpoint."""
        return self.prefix + canonical[len("model."):] if canonical.startswith("model.") else canonical

    def _grouped(self, canonical: str) -> tuple[str, str] | None:
        """(grouped tensor name, which split part) when the checkpoint has the grouped form instead."""
        for suffix, group in _SPLIT.items():
            if canonical.endswith("linear_attn." + suffix) and self.name(canonical) not in self.ckpt:
                return self.name(canonical)[: -len(suffix)] + f"in_proj_{group}.weight", suffix.split(".")[0][8:]
        return None

    def __contains__(self, canonical: str) -> bool:
        grouped = self._grouped(canonical)
        return (grouped[0] if grouped else self.name(canonical)) in self.ckpt

    def shape(self, canonical: str) -> tuple[int, ...]:
        grouped = self._grouped(canonical)
        if grouped is None:
            return self.ckpt.shape(self.name(canonical))
        return tuple(self._split(grouped, meta=True).shape)

    def get(self, canonical: str) -> torch.Tensor:
        grouped = self._grouped(canonical)
        return self.ckpt.get(self.name(canonical)) if grouped is None else self._split(grouped)

    def _split(self, grouped: tuple[str, str], meta: bool = False) -> torch.Tensor:
        """The part ("qkv", "z", "b" or "a") of a grouped projection, rows in the split order."""
        name, part = grouped
        la = self.spec.linear_attention
        nk, r = la.num_k_heads, la.num_v_heads // la.num_k_heads
        dk, dv = la.k_head_dim, la.v_head_dim
        widths = {"qkvz": (dk, dk, r * dv, r * dv), "ba": (r, r)}["qkvz" if part in ("qkv", "z") else "ba"]
        shape = self.ckpt.shape(name)
        if len(shape) != 2 or shape[0] != nk * sum(widths):
            raise CheckpointError(f"{self.ckpt.directory}: tensor {name} has shape {shape}, expected "
                                  f"({nk * sum(widths)}, {self.spec.hidden_size})")
        w = torch.empty(shape, dtype=torch.bfloat16, device="meta") if meta else self.ckpt.get(name)
        pieces = w.view(nk, sum(widths), shape[1]).split(widths, dim=1)  # per key head
        flat = [p.reshape(-1, shape[1]) for p in pieces]
        if part == "qkv":
            return torch.cat(flat[:3])
        return flat[{"z": 3, "b": 0, "a": 1}[part]].contiguous()
