"""SwiGLU MLPs: a dense layer's, and a shared expert behind its sigmoid gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftc_runtime.experts.base import swiglu
from ftc_runtime.models.layers.fp8_linear import Weight, linear


def dense_mlp(h: torch.Tensor, gate_w: Weight, up_w: Weight, down_w: Weight, limit: float = 0.0) -> torch.Tensor:
    """A SwiGLU MLP; `limit` above 0 clamps its pre-activations (`swiglu`)."""
    return linear(swiglu(linear(h, gate_w), linear(h, up_w), limit), down_w)


def shared_expert(h: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor,
                  router_w: torch.Tensor) -> torch.Tensor:
    """The shared expert behind its sigmoid gate."""
    return torch.sigmoid(F.linear(h, router_w)) * dense_mlp(h, gate_w, up_w, down_w)


