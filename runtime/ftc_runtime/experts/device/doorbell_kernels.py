"""The GPU's side of the CPU doorbell (cpu_doorbell.py), as two Triton kernels for a CUDA
graph to hold:

- `post_job`: writes the plan's CPU job and the layer's input into the pinned mailbox through its
  device mapping, then, after a barrier and a system-scope fence, rings with the next job number
  (kept on the device, so that replays of one graph number their jobs on); a call without CPU
  experts posts nothing, and costs no round trip to the CPU;
- `wait_and_join`: where a job was posted, spins until the CPU answers its number, then writes
  the layer's output: the CPU's result, read through the mapping, plus the rows the device's
  experts left per (token, expert) pair (the hits', computed beside the fills, and the fills'),
  summed per token, so that no kernel of its own sums them or zeroes an output first. Under the
  adaptive policy it also moves the split's bias (`PlanRule`) by whether it had to wait: the GPU
  reaches the wait when its fills and its own experts are done, so a wait means the CPU's share
  took longer (more fills next), an answer already there means the GPU's did (fewer). Layers
  without a choice are left out: fewer than two misses, or no CPU job because the recent misses
  took every fill.

`post_job` is one program (a decode call's job is at most 16 tokens and 16·k entries). The join
is one program per column block, each loading its pairs' rows before the wait, and the answer has
one poller: program 0 polls the mapped flag and relays the answer through device memory to the
others (docs/history/performance-log.md: a join whose every program polled the mapped flag slowed
each call with CPU experts). The mapped flags are read and written with `io.mapped_flags`' acquire loads
and release stores at system scope, the relay with their `gpu`-scope forms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ftc_runtime.experts.device.cpu_doorbell import DONE, RING, CpuDoorbell, DoorbellError
from ftc_runtime.experts.device.device_plan import LayerPlan, PlanRule
from ftc_runtime.experts.device.plan_kernel import padded_entries
from ftc_runtime.io.host_memory import MappedHost
from ftc_runtime.io.mapped_flags import load_acquire, store_release

XBLOCK = 4096  # elements of x a step of `post_job` moves
JOIN_ELEMENTS = 8192  # (pair entry, column) elements the join holds at once
SPINS = 1 << 24  # looks at the answer flag before a wait gives up (each crosses PCIe: seconds in all)


@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr):
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _post_job(counts, cpu_ids, cpu_offsets, cpu_tok, cpu_w, x, n_tokens, n, hidden, box_n_tokens, box_counts,
              box_ids, box_offsets, box_tok, box_w, box_x, counter, ring, NP: tl.constexpr, XBLOCK: tl.constexpr):
    if tl.load(counts + 2) > 0:  # a job for the CPU: a call whose experts are all on the GPU rings nothing
        e = tl.arange(0, NP)  # NP > n: the offsets' n + 1 entries too
        tl.store(box_ids + e, tl.load(cpu_ids + e, mask=e < n), mask=e < n)
        tl.store(box_tok + e, tl.load(cpu_tok + e, mask=e < n), mask=e < n)
        tl.store(box_w + e, tl.load(cpu_w + e, mask=e < n), mask=e < n)
        tl.store(box_offsets + e, tl.load(cpu_offsets + e, mask=e <= n), mask=e <= n)
        tl.store(box_counts + e, tl.load(counts + e, mask=e < 3), mask=e < 3)
        tl.store(box_n_tokens, n_tokens)
        _copy(x, box_x, n_tokens * hidden, XBLOCK)
        seq = tl.load(counter) + 1
        tl.debug_barrier()  # every thread's writes to the mailbox before the ring
        tl.store(counter, seq)
        store_release(ring, seq, "sys")


@triton.jit
def _tune(counts, bias, waited, step):
    """The split's bias moved by `step` towards the side that finished last, within [-1, 1]; only
    by a call the rule split (q_split ≥ 0: not one side alone)."""
    fills, cpu, q_split = tl.load(counts + 1), tl.load(counts + 2), tl.load(counts + 3)
    if (fills + cpu >= 2) & (q_split >= 0) & ((cpu > 0) | (q_split >= fills + cpu)):
        b = tl.load(bias) + tl.where(waited, step, -step)
        tl.store(bias, tl.minimum(tl.maximum(b, -1.0), 1.0))


@triton.jit
def _answered(done, relay, seq, status, counts, bias, step, SPINS: tl.constexpr, TUNE: tl.constexpr):
    """Whether the call has the CPU's answer to add: it posted job `seq` and the CPU answered it.
    Program 0 polls the mapped flag, tunes the split and relays the answer (relay[1]: answered,
    relay[0]: the job) in device memory; the others wait for the relay."""
    job = tl.load(counts + 2) > 0  # `post_job` rang for this call
    answered = seq >= 0  # true: a call without a job has nothing to wait for
    if tl.program_id(0) == 0:
        spins = 0
        if job:
            flag = load_acquire(done, "sys")
            while (flag < seq) & (spins < SPINS):
                flag = load_acquire(done, "sys")
                spins += 1
            answered = flag >= seq
            if flag < seq:  # no answer: the step's result is wrong, and the host is told
                tl.store(status, 1)
            tl.store(relay + 1, answered.to(tl.int64))
            tl.debug_barrier()  # the answer's store before the relay's release
            store_release(relay, seq, "gpu")
        if TUNE:
            if answered:
                _tune(counts, bias, spins > 0, step)
    elif job:
        relayed = load_acquire(relay, "gpu")
        spins = 0
        while (relayed < seq) & (spins < SPINS):
            relayed = load_acquire(relay, "gpu")
            spins += 1
        answered = (relayed >= seq) & (tl.load(relay + 1) != 0)
    return job & answered


@triton.jit
def _wait_and_join(done, relay, counter, box_out, out, hits, fills, phase_pairs, n, status, counts, bias, step,
                   SPINS: tl.constexpr, T: tl.constexpr, H: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr,
                   TUNE: tl.constexpr):
    """out[t] = the CPU's row t + Σ of the call's device pairs of token t (each entry's row of
    `hits` or `fills`, where its phase gave it a slot), BLOCK columns a program."""
    e = tl.arange(0, NP)
    emask = e < n
    on_hit = tl.load(phase_pairs + e, mask=emask, other=-1) >= 0
    on_fill = tl.load(phase_pairs + 3 * n + e, mask=emask, other=-1) >= 0
    tok = tl.load(phase_pairs + n + e, mask=emask, other=-1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < H
    rows = e[:, None] * H + cols[None, :]
    pair_rows = (tl.load(hits + rows, mask=on_hit[:, None] & cmask[None, :], other=0.0)
                 + tl.load(fills + rows, mask=on_fill[:, None] & cmask[None, :], other=0.0))
    with_cpu = _answered(done, relay, tl.load(counter), status, counts, bias, step, SPINS, TUNE)
    for t in tl.static_range(T):
        y = tl.load(box_out + t * H + cols, mask=cmask & with_cpu, other=0.0)
        y += tl.sum(tl.where((tok == t)[:, None], pair_rows, 0.0), axis=0)
        tl.store(out + t * H + cols, y, mask=cmask)


def join_relay(device: torch.device | str) -> torch.Tensor:
    """The join's relay of the CPU's answer between its programs: [the last job relayed, whether
    it was answered] (jobs are numbered from 1)."""
    return torch.zeros(2, dtype=torch.int64, device=device)


class DoorbellKernels:
    """`bell`'s mailbox as the device sees it, and the device's job counter (set from the last
    ring before the device rings, so that jobs rung from the host and from the device are
    numbered as one sequence)."""

    def __init__(self, bell: CpuDoorbell, device: torch.device):
        self.bell = bell
        self.counter = torch.tensor([int(bell.flags[RING])], dtype=torch.int64, device=device)
        self.status = torch.zeros(1, dtype=torch.int64, device=device)  # 1: a wait gave up
        self.relay = join_relay(device)
        self.ring, self.done = MappedHost.of(bell.flags, RING), MappedHost.of(bell.flags, DONE)
        self.box = {name: MappedHost.of(getattr(bell, name)) for name in
                    ("n_tokens", "counts", "cpu_ids", "cpu_offsets", "cpu_tok", "cpu_w", "x", "out")}

    def post_job(self, plan: LayerPlan, x: torch.Tensor) -> None:
        """Writes the plan's CPU job and `x` ([T, hidden] fp32) into the mailbox and rings."""
        n, b = plan.cpu_tok.numel(), self.box
        _post_job[(1,)](plan.counts, plan.cpu_ids, plan.cpu_offsets, plan.cpu_tok, plan.cpu_w, x.contiguous(),
                        x.shape[0], n, x.shape[1], b["n_tokens"], b["counts"], b["cpu_ids"], b["cpu_offsets"],
                        b["cpu_tok"], b["cpu_w"], b["x"], self.counter, self.ring,
                        NP=max(16, triton.next_power_of_2(n + 1)), XBLOCK=XBLOCK, num_warps=4)

    def wait_and_join(self, out: torch.Tensor, plan: LayerPlan, rule: PlanRule, hits: torch.Tensor,
                      fills: torch.Tensor) -> None:
        """out ([T, hidden] fp32) = the CPU's result, once the CPU has answered, plus the call's
        device experts: the rows of `hits` and `fills` ([T·k, hidden] fp32, each pair's output)
        that `plan.phase_pairs` gave a slot, summed per token in entry order. The rule's bias is
        tuned by the wait where it has a `tune_step`."""
        (t, hidden), n = out.shape, plan.pairs.shape[1]
        np2 = padded_entries(n)
        block = max(16, min(triton.next_power_of_2(hidden), JOIN_ELEMENTS // np2))
        _wait_and_join[(triton.cdiv(hidden, block),)](
            self.done, self.relay, self.counter, self.box["out"], out, hits, fills, plan.phase_pairs, n, self.status,
            plan.counts, rule.bias, rule.tune_step, SPINS=SPINS, T=t, H=hidden, NP=np2, BLOCK=block,
            TUNE=rule.tune_step > 0, num_warps=8)

    def check(self) -> None:
        """Raises if a wait gave up since the last check (reads a device flag: a safe point only)."""
        if int(self.status[0]):
            self.status.zero_()
            raise DoorbellError(f"the CPU doorbell did not answer job {int(self.counter[0])} in time: "
                                "that step's CPU experts are missing from its output")
