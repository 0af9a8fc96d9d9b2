"""Programmatic dependent launch (PDL, Hopper and later) for the short kernels of a decode
layer's body: its projections, rotary embedding and KV write, attention, the router's selection,
the Gated DeltaNet step.

A decode step is a chain of short dependent kernels (a few µs each at batch 1), and every
boundary costs the time from one kernel's last program finishing to the next one's first program
running. Launched with PDL, a kernel may start while the one before it in its stream still runs:
its programs wait in `wait_for_previous` (PTX `griddepcontrol.wait`, which returns once the
kernels it depends on have finished and their writes are visible) and then let the kernel after
them launch at once. Every kernel launched with `launch_pdl=enabled(device)` must call
`wait_for_previous(PDL)` before it touches memory: its first statement.

A kernel launched without PDL after one launched with it starts as it always did, when that one
has finished; so kernels outside this scheme (torch's, cuBLAS's) keep their order. In a CUDA graph
the launches become programmatic edges of the graph. The MoE part of a one-graph step (the plan,
the fills, the CPU job's post, the experts, the join) launches plainly: with all of it launched
with PDL the adaptive split drifted towards the GPU and every adaptive row lost 12-51%
(docs/history/performance-log.md, the tenth session of issue 20), most likely because waiting programs hold
their SM slots, behind the fills (a tenth of a millisecond) too, while the CPU job's post and the
hits need SMs on other streams. Off by default until the body's gain is measured alone.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from ftc_runtime.settings import pdl_setting


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Where the kernel was launched with PDL: wait for the kernels before it, then release the
    next one's launch (its programs wait in turn). A kernel's first statement."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: with FTC_PDL=1, on a CUDA device of compute
    capability 9.0 or later (never Triton's interpreter, whose tensors are on the CPU). The
    setting is read at each launch, so that a benchmark's variants may change it in between."""
    return device.type == "cuda" and pdl_setting() and _has_pdl(device)


@cache
def _has_pdl(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0)
