"""SwiGLU MLPs: a dense layer's, and a shared expert behind its sigmoid gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_mlp(h: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(h, gate_w)) * F.linear(h, up_w), down_w)


def shared_expert(h: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor,
                  router_w: torch.Tensor) -> torch.Tensor:
    """The shared expert behind its sigmoid gate."""
    return torch.sigmoid(F.linear(h, router_w)) * dense_mlp(h, gate_w, up_w, down_w)


