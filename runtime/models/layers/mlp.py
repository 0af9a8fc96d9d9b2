"""SwiGLU MLPs: a dense layer's, and a shared expert behind its sigmoid gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftc_runtime.models.layers.fp8_linear import Weight, linear


def dense_mlp(h: torch.Tensor, gate_w: Weight, up_w: Weight, down_w: Weight) -> torch.Tensor:
    return linear(F.silu(linear(h, gate_w)) * linear(h, up_w), down_w)


def shared_expert(h: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor,
                  router_w: torch.Tensor) -> torch.Tensor:
    """The shared expert behind its sigmoid gate."""
    return torch.sigmoid(F.linear(h, router_w)) * dense_mlp(h, gate_w, up_w, down_w)


