"""Gated DeltaNet, the linear-attention layer of the Qwen3.5/3.6 hybrid family, in torch (the CPU
path and the reference for GPU kernels), with its per-sequence state made explicit.

For each token t (per value head, state S of shape [key dim, value dim], kept in fp32):
    S ← exp(g_t) · S                       (decay; g_t = −exp(A_log) · softplus(a_t + dt_bias) ≤ 0)
    S ← S + k_t ⊗ β_t (v_t − Sᵀ k_t)       (delta rule; β_t = sigmoid(b_t))
    o_t = Sᵀ q_t
with q and k L2-normalized (q also scaled by 1/√key dim) after a causal depthwise convolution and
SiLU over the concatenated q/k/v projections, then a gated RMSNorm (norm(o) · SiLU(z)) and the
output projection. Query/key heads are shared by consecutive value heads (grouped value heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DeltaNetShape:
    num_k_heads: int
    num_v_heads: int
    k_dim: int  # per head
    v_dim: int  # per head
    conv_kernel: int
    eps: float

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_k_heads * self.k_dim + self.num_v_heads * self.v_dim


@dataclass(frozen=True)
class DeltaNetWeights:
    """One layer's tensors, as the checkpoint names them under `linear_attn.` (split projections)."""

    in_proj_qkv: torch.Tensor  # [conv channels, hidden]
    in_proj_z: torch.Tensor  # [v heads · v dim, hidden]
    in_proj_b: torch.Tensor  # [v heads, hidden]
    in_proj_a: torch.Tensor  # [v heads, hidden]
    conv1d: torch.Tensor  # [conv channels, 1, kernel]
    dt_bias: torch.Tensor  # [v heads]
    A_log: torch.Tensor  # [v heads]
    norm: torch.Tensor  # [v dim]
    out_proj: torch.Tensor  # [hidden, v heads · v dim]


@dataclass
class DeltaNetState:
    """A sequence's state in one layer after its tokens so far: the convolution's last inputs
    [conv channels, kernel − 1] and the recurrent state [v heads, k dim, v dim] (fp32). Taking a
    copy at a token position and restoring it later continues exactly (`clone`)."""

    conv: torch.Tensor
    recurrent: torch.Tensor

    @classmethod
    def zeros(cls, shape: DeltaNetShape, dtype: torch.dtype, device: torch.device | str = "cpu") -> DeltaNetState:
        return cls(torch.zeros(shape.conv_channels, shape.conv_kernel - 1, dtype=dtype, device=device),
                   torch.zeros(shape.num_v_heads, shape.k_dim, shape.v_dim, dtype=torch.float32, device=device))

    def clone(self) -> DeltaNetState:
        return DeltaNetState(self.conv.clone(), self.recurrent.clone())


def gated_deltanet(x: torch.Tensor, w: DeltaNetWeights, shape: DeltaNetShape, state: DeltaNetState,
                   capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, DeltaNetState, list[DeltaNetState]]:
    """x [T, hidden] after `state`'s tokens → (output [T, hidden], the state after x, the states
    after each token index in `capture` (ascending), without cutting x there)."""
    t = x.shape[0]
    s = shape
    inputs = F.linear(x, w.in_proj_qkv)
    mixed, conv_state = _causal_conv(inputs, w.conv1d, state.conv)
    kd, vd = s.num_k_heads * s.k_dim, s.num_v_heads * s.v_dim
    q, k, v = mixed.split((kd, kd, vd), dim=-1)
    group = s.num_v_heads // s.num_k_heads
    q = q.reshape(t, s.num_k_heads, s.k_dim).repeat_interleave(group, dim=1).float()
    k = k.reshape(t, s.num_k_heads, s.k_dim).repeat_interleave(group, dim=1).float()
    v = v.reshape(t, s.num_v_heads, s.v_dim).float()
    q = _l2norm(q) * s.k_dim ** -0.5
    k = _l2norm(k)
    beta = torch.sigmoid(F.linear(x, w.in_proj_b)).float()
    g = -w.A_log.float().exp() * F.softplus(F.linear(x, w.in_proj_a).float() + w.dt_bias.float())
    if t == 1:
        out, recurrent = _delta_rule(q, k, v, g, beta, state.recurrent)
        taken = [recurrent.clone()] if capture else []
    else:
        out, recurrent, taken = _delta_rule_chunked(q, k, v, g, beta, state.recurrent, capture=capture)
    z = F.linear(x, w.in_proj_z).reshape(t, s.num_v_heads, s.v_dim)
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + s.eps)
    gated = (w.norm * normed.to(x.dtype)) * F.silu(z.float()).to(x.dtype)
    # The convolution's state after token i: its last K − 1 inputs up to i.
    seq = torch.cat([state.conv.to(inputs.dtype), inputs.t()], dim=1)
    convs = [seq[:, i + 1:i + s.conv_kernel].clone() for i in capture]
    return (F.linear(gated.reshape(t, vd), w.out_proj), DeltaNetState(conv_state, recurrent),
            [DeltaNetState(c, r) for c, r in zip(convs, taken, strict=True)])


def _causal_conv(x: torch.Tensor, weight: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over time, then SiLU: x [T, C] after the previous inputs
    prev [C, K − 1]; returns the output [T, C] and the new previous inputs."""
    kernel = weight.shape[-1]
    seq = torch.cat([prev.to(x.dtype), x.t()], dim=1)  # [C, K − 1 + T]
    out = F.conv1d(seq[None], weight, groups=seq.shape[0])[0]  # [C, T]: tap K−1 on the current input
    return F.silu(out).t(), seq[:, seq.shape[1] - (kernel - 1):].clone()


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence, token by token, in fp32: q, k [T, H, Dk]; v [T, H, Dv]; g, beta [T, H];
    state [H, Dk, Dv] → (outputs [T, H, Dv], final state)."""
    s = state.float().clone()
    out = torch.empty_like(v)
    for i in range(q.shape[0]):
        s = s * g[i].exp()[:, None, None]
        remembered = torch.einsum("hk,hkv->hv", k[i], s)
        s = s + k[i][:, :, None] * ((v[i] - remembered) * beta[i][:, None])[:, None, :]
        out[i] = torch.einsum("hk,hkv->hv", q[i], s)
    return out, s


CHUNK = 64  # tokens per block of the chunked form: matmuls of 64×64 per head, T/64 sequential steps


def _delta_rule_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, chunk: int = CHUNK,
                        capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The same recurrence, a block of tokens at a time (what prefill needs: T/chunk steps of
    matmuls instead of T steps of vector products). Within a block, with G the cumulative sum of
    the log-decays g and S0 the state before it, the state after token i is
        S_i = exp(G_i) · S0 + Σ_{j ≤ i} exp(G_i − G_j) · k_j u_jᵀ
    where the "pseudo-values" u solve the unit lower-triangular system
        u_i + β_i Σ_{j < i} exp(G_i − G_j) (k_i · k_j) u_j = β_i (v_i − exp(G_i) S0ᵀ k_i),
    so o_i = exp(G_i) S0ᵀ q_i + Σ_{j ≤ i} exp(G_i − G_j) (q_i · k_j) u_j. Shapes as `_delta_rule`;
    also returns S_i for each token index i in `capture` (ascending)."""
    s = state.float().clone()
    out = torch.empty_like(v)
    taken: list[torch.Tensor] = []
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D]
    g, beta = g.transpose(0, 1), beta.transpose(0, 1)  # [H, T]
    for a in range(0, q.shape[1], chunk):
        qc, kc, vc, bc = q[:, a:a + chunk], k[:, a:a + chunk], v[:, a:a + chunk], beta[:, a:a + chunk]
        c = qc.shape[1]
        cum = g[:, a:a + chunk].cumsum(-1)  # G [H, C]
        lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        # exp(G_i − G_j) for j ≤ i; the upper triangle masked before exp (its exponents are > 0)
        decay = torch.exp((cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")))
        strict = ((kc @ kc.transpose(1, 2)) * decay).tril(-1)
        system = torch.eye(c, device=q.device) + bc[:, :, None] * strict
        rhs = bc[:, :, None] * (vc - torch.exp(cum)[:, :, None] * (kc @ s))
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out[a:a + c] = (torch.exp(cum)[:, :, None] * (qc @ s) + ((qc @ kc.transpose(1, 2)) * decay) @ u).transpose(0, 1)
        for i in (i - a for i in capture if a <= i < a + c):
            at = cum[:, i:i + 1]
            taken.append(torch.exp(at)[:, :, None] * s
                         + (kc[:, :i + 1] * torch.exp(at - cum[:, :i + 1])[:, :, None]).transpose(1, 2) @ u[:, :i + 1])
        last = cum[:, -1:]
        s = torch.exp(last)[:, :, None] * s + (kc * torch.exp(last - cum)[:, :, None]).transpose(1, 2) @ u
    return out, s, taken
