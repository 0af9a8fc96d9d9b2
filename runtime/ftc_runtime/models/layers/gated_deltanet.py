"""Gated DeltaNet, the linear-attention layer of the Qwen3.5/3.6 hybrid family, in torch (the CPU
path, and the reference for flash-linear-attention's kernels that run the recurrence on a GPU:
fla_delta_rule.py), with its per-sequence state made explicit.

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

from ftc_runtime.models.layers.fla_delta_rule import fla_available, fla_delta_rule


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

    @property
    def heads(self) -> tuple[int, int, int, int]:
        return self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim


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

    def projections(self) -> tuple[torch.Tensor, ...]:
        """`project`'s weights, in its order."""
        return self.in_proj_qkv, self.in_proj_b, self.in_proj_a, self.conv1d, self.A_log, self.dt_bias

    def outputs(self) -> tuple[torch.Tensor, ...]:
        """`finish`'s weights, in its order."""
        return self.in_proj_z, self.norm, self.out_proj


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

    def to(self, device: torch.device | str) -> DeltaNetState:
        return DeltaNetState(self.conv.to(device), self.recurrent.to(device))

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * self.recurrent.element_size()

    def assign(self, other: DeltaNetState) -> None:
        """Copies `other` (any device) into this state's storage, which stays put: the CUDA graphs
        of decode hold its addresses."""
        self.conv.copy_(other.conv)
        self.recurrent.copy_(other.recurrent)


def gated_deltanet(x: torch.Tensor, w: DeltaNetWeights, shape: DeltaNetShape, state: DeltaNetState,
                   capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, DeltaNetState, list[DeltaNetState]]:
    """x [T, hidden] after `state`'s tokens → (output [T, hidden], the state after x, the states
    after each token index in `capture` (ascending), without cutting x there)."""
    q, k, v, g, beta, inputs, conv = project(x, *w.projections(), state.conv, shape.heads)
    out, recurrent, taken = delta_rule(q, k, v, g, beta, state.recurrent, capture)
    convs = [_conv_state(state.conv, inputs, i) for i in capture]
    return (finish(out, x, *w.outputs(), shape.eps), DeltaNetState(conv, recurrent),
            [DeltaNetState(c, r) for c, r in zip(convs, taken, strict=True)])


def _conv_state(prev: torch.Tensor, inputs: torch.Tensor, i: int) -> torch.Tensor:
    """The convolution's state after token i of `inputs` [T, C] (which follow the state `prev`
    [C, K − 1]): its last K − 1 inputs up to i, [C, K − 1], a copy."""
    back = prev.shape[1]
    if i + 1 >= back:
        return inputs[i + 1 - back:i + 1].t().contiguous()
    return torch.cat([prev[:, i + 1:].to(inputs.dtype), inputs[:i + 1].t()], dim=1)


def decode_step(x: torch.Tensor, w: DeltaNetWeights, shape: DeltaNetShape, state: DeltaNetState) -> torch.Tensor:
    """One token x [1, hidden]: its output, with `state` updated in place (its storage stays put,
    as the CUDA graphs of decode need)."""
    out, new, _ = gated_deltanet(x, w, shape, state)
    state.assign(new)
    return out


# The two halves of the layer around its recurrence, as functions of tensors only (no weights
# object), so that torch.compile sees one function for every layer.

def project(x: torch.Tensor, qkv_w: torch.Tensor, b_w: torch.Tensor, a_w: torch.Tensor, conv_w: torch.Tensor,
            A_log: torch.Tensor, dt_bias: torch.Tensor, conv_prev: torch.Tensor, heads: tuple[int, int, int, int]
            ) -> tuple[torch.Tensor, ...]:
    """x [T, hidden] → q, k [T, k heads, k dim] and v [T, v heads, v dim] in x's dtype (q and k not
    yet normalized), the log-decays g and the betas [T, v heads] in fp32, the convolution's input
    [T, channels] and its state after x."""
    nk, nv, dk, dv = heads
    t = x.shape[0]
    inputs = F.linear(x, qkv_w)
    mixed, conv_state = _causal_conv(inputs, conv_w, conv_prev)
    q, k, v = mixed.split((nk * dk, nk * dk, nv * dv), dim=-1)
    beta = torch.sigmoid(F.linear(x, b_w).float())
    g = -A_log.float().exp() * F.softplus(F.linear(x, a_w).float() + dt_bias.float())
    return q.reshape(t, nk, dk), k.reshape(t, nk, dk), v.reshape(t, nv, dv), g, beta, inputs, conv_state


def finish(out: torch.Tensor, x: torch.Tensor, z_w: torch.Tensor, norm_w: torch.Tensor, out_w: torch.Tensor,
           eps: float) -> torch.Tensor:
    """The recurrence's output [T, v heads, v dim] → gated RMSNorm (norm(o) · SiLU(z), z from the
    layer's input x) and the output projection: [T, hidden]."""
    t, nv, dv = out.shape
    out = out.float()
    z = F.linear(x, z_w).reshape(t, nv, dv)
    normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
    gated = (norm_w * normed.to(x.dtype)) * F.silu(z.float()).to(x.dtype)
    return F.linear(gated.reshape(t, nv * dv), out_w)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, capture: tuple[int, ...] = ()
               ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The recurrence over q, k [T, k heads, k dim] (not normalized), v [T, v heads, v dim], g and
    beta [T, v heads] from `state` [v heads, k dim, v dim] fp32: (outputs [T, v heads, v dim], the
    final state, the states after each token index in `capture`). On a GPU with
    flash-linear-attention installed its Triton kernels run it; elsewhere the torch code below."""
    if q.is_cuda and fla_available():
        return fla_delta_rule(q, k, v, g, beta, state, capture)
    group = v.shape[1] // q.shape[1]
    q = _l2norm(q.float()).repeat_interleave(group, dim=1) * q.shape[-1] ** -0.5
    k = _l2norm(k.float()).repeat_interleave(group, dim=1)
    if q.shape[0] == 1:
        out, final = _delta_rule(q, k, v.float(), g, beta, state)
        return out, final, [final.clone()] if capture else []
    return _delta_rule_chunked(q, k, v.float(), g, beta, state, capture=capture)


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
