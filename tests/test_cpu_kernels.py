"""Every generated CPU kernel variant (expert format × ISA) this machine can run, against a
float64 torch reference over the format's own dequantization, on fresh random experts and
routings, for every batch bucket and for token counts between them."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ftc.codegen.render import render_cpu_kernels
from ftc.compile.ftw_writer import FtwWriter
from ftc.compile.pipeline import make_plan
from ftc.compile.targets import Target
from ftc_runtime.cpu_info import physical_cpus, supported_isas
from ftc_runtime.experts.base import group_by_expert
from ftc_runtime.experts.cpu_kernel import CpuExpertKernel
from ftc_runtime.formats import FORMATS, expert_format
from ftc_runtime.io import ftw
from ftc_runtime.kernel_build import build_kernels
from ftc_runtime.settings import settings
from ftc_runtime.spec import ModelSpec

TOLERANCE = {"avx512_bf16": 1e-2, "avx2": 1e-5}
# hidden, expert intermediate, experts: each format runs those its kernels' step divides. 192
# intermediate rows end on a part of a 4-bit kernel's group of 16 scales; qwen3-30b-a3b's own shape last.
SHAPES = [(64, 32, 6), (256, 96, 5), (128, 64, 6), (256, 192, 5), (2048, 768, 3)]
VARIANTS = [pytest.param((fmt, isa, shape), id=f"{fmt}-{isa}-{shape[0]}x{shape[1]}",
                         marks=pytest.mark.skipif(isa not in supported_isas(), reason=f"this CPU lacks {isa}"))
            for fmt in FORMATS for isa, kernel in expert_format(fmt).cpu_templates.items() for shape in SHAPES
            if shape[0] % kernel.step == 0 and shape[1] % kernel.step == 0]


# One shape per (format, ISA) for the SwiGLU limit's test: the first its kernel's step divides.
LIMIT_VARIANTS = [pytest.param((fmt, isa, shape), id=f"{fmt}-{isa}",
                               marks=pytest.mark.skipif(isa not in supported_isas(), reason=f"this CPU lacks {isa}"))
                  for fmt in FORMATS for isa, kernel in expert_format(fmt).cpu_templates.items()
                  for shape in [next(s for s in SHAPES if s[0] % kernel.step == 0 and s[1] % kernel.step == 0)]]


def _spec(fmt: str, hidden: int, inter: int, experts: int, swiglu_limit: float = 0.0) -> ModelSpec:
    return ModelSpec.from_dict({
        "name": f"k{hidden}x{inter}", "family": "qwen3_moe", "num_layers": 2, "hidden_size": hidden,
        "vocab_size": 300, "attention": {"num_heads": 2, "num_kv_heads": 1, "head_dim": 16},
        "moe": {"num_experts": experts, "top_k": 2, "expert_intermediate_size": inter, "swiglu_limit": swiglu_limit},
        "expert_format": fmt})


@pytest.fixture(scope="module", params=VARIANTS)
def setup(request, tmp_path_factory):
    fmt, isa, shape = request.param
    return _build(fmt, isa, shape, tmp_path_factory.mktemp(f"kern-{fmt}-{isa}-{shape[0]}"))


def _build(fmt: str, isa: str, shape: tuple[int, int, int], tmp: Path, swiglu_limit: float = 0.0) -> tuple:
    """fp32 random experts written through the format; the reference takes them as the format's
    dequantization gives them back (the kernel computes on those, not on the fp32 originals)."""
    hidden, inter, experts = shape
    spec = _spec(fmt, hidden, inter, experts, swiglu_limit)
    header = ftw.FtwHeader.create(fmt, 2, experts, hidden, inter)
    writer = FtwWriter(tmp / "experts.ftw", header)
    g = torch.Generator().manual_seed(hidden + inter)  # fixed: the kernels and experts serve the whole module
    for _ in range(header.num_rows):
        writer.append({"gate_up": torch.randn(2 * inter, hidden, generator=g) * hidden ** -0.5,
                       "down": torch.randn(hidden, inter, generator=g) * inter ** -0.5})
    writer.close()
    pool = ftw.load(tmp / "experts.ftw")
    weights = [tuple(w.double() for w in header.dequantize(pool.experts[r])) for r in range(header.num_rows)]
    plan = make_plan(Target("test", isa, None), spec)
    render_cpu_kernels(spec, plan, tmp / "kernels")
    lib, _ = build_kernels(tmp / "kernels", tmp / "lib", settings().cache_dir)
    return isa, spec, pool, weights, plan, lib


def _reference(weights: list, x: torch.Tensor, rows: torch.Tensor, router_w: torch.Tensor,
               limit: float = 0.0) -> torch.Tensor:
    """Σ w · down(silu(gate) · up) in float64, gate and up clamped as DeepSeek-V4 does (gate from
    above, up both ways) where the limit is above 0, written out here apart from the runtime's."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(rows.shape[1]):
            gate_up, down = weights[int(rows[t, j])]
            inter = gate_up.shape[0] // 2
            h = gate_up @ x[t].double()
            gate, up = h[:inter], h[inter:]
            if limit > 0:
                gate, up = torch.minimum(gate, torch.tensor(limit)), torch.clamp(up, -limit, limit)
            out[t] += float(router_w[t, j]) * (down @ (gate * torch.sigmoid(gate) * up))
    return out


def _grouped_reference(weights: list, x: torch.Tensor, rows: torch.Tensor, router_w: torch.Tensor,
                       limit: float = 0.0) -> torch.Tensor:
    """`_reference` with each expert computed once over all its tokens (matrices, not vectors): the
    same float64 sums for calls of thousands of tokens."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for row in rows.unique().tolist():
        t, j = (rows == row).nonzero(as_tuple=True)
        gate_up, down = weights[row]
        h = x[t].double() @ gate_up.T
        gate, up = h[:, :gate_up.shape[0] // 2], h[:, gate_up.shape[0] // 2:]
        if limit > 0:
            gate, up = torch.clamp(gate, max=limit), torch.clamp(up, -limit, limit)
        out.index_add_(0, t, router_w[t, j, None].double() * ((gate * torch.sigmoid(gate) * up) @ down.T))
    return out


def _routing(rng: random.Random, e: int, n: int, same: bool = False) -> torch.Tensor:
    """ids [n, 2] of distinct experts per token (the same two for every token with `same`)."""
    first = rng.sample(range(e), 2)
    return torch.tensor([first if same else rng.sample(range(e), 2) for _ in range(n)])


def _check(setup, rng: random.Random, ids: torch.Tensor, threads: int, background: bool = False,
           signaled: bool = False) -> None:
    isa, spec, pool, expert_weights, _, lib = setup
    cpus = (physical_cpus() * threads)[:threads]
    kernel = CpuExpertKernel(lib, isa, spec.hidden_size, spec.moe.expert_intermediate_size, cpus, background)
    n, e = ids.shape[0], spec.moe.num_experts
    layer = rng.randrange(2)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    weights = torch.rand(n, ids.shape[1], generator=g)
    x = torch.randn(n, spec.hidden_size, generator=g)
    out = torch.randn(n, spec.hidden_size, generator=g)  # the kernel accumulates: start from noise, not zeros
    start = out.clone()
    args = (pool.experts, x, out, *group_by_expert(layer * e, ids, weights))
    if signaled:  # the end flag, in a cache line of other values the pool must leave alone
        flag, value = torch.randint(-2**40, 0, (8,), generator=g), rng.randrange(1, 2**40)
        before = flag.clone()
        kernel.start_signaled(*args, flag, value)
        kernel.wait()  # never before the flag is raised
        assert int(flag[0]) == value and torch.equal(flag[1:], before[1:]), f"flag {flag.tolist()}, value {value}"
    elif background:
        kernel.start(*args)
        kernel.wait()
    else:
        kernel.run(*args)
    reference = _grouped_reference if n > 64 else _reference
    ref = reference(expert_weights, x, ids + layer * e, weights, spec.moe.swiglu_limit)
    got = out.double() - start.double()
    # Each expert's share is added into the fp32 `out` once, rounding it by up to half an ulp of
    # |out|: that much is the output's storage, not the kernel (it dominates when the router's
    # weights are small against the starting noise).
    rounding = ids.shape[1] * torch.finfo(torch.float32).eps / 2 * out.double().norm()
    rel = float(((got - ref).norm() - rounding).clamp(min=0) / ref.norm())
    assert rel < TOLERANCE[isa], f"{isa} tokens={n} ids={ids.tolist()}: relative error {rel:.2e} beyond fp32 rounding"
    return x, ids + layer * e, weights, ref


def test_each_bucket_alone(setup, seed):
    """All tokens to the same experts: every expert runs exactly one tile of bucket size b."""
    _, spec, _, _, plan, _ = setup
    rng = random.Random(seed)
    for b in plan.batch_buckets:
        _check(setup, rng, _routing(rng, spec.moe.num_experts, b, same=True), threads=len(physical_cpus()))


@pytest.mark.parametrize("threads", [1, 2])
def test_random_routing_between_buckets(setup, threads, seed):
    """Token counts that are not bucket sizes split into several tiles per expert."""
    _, spec, *_ = setup
    rng = random.Random(seed)
    for n in (1, 3, 5, 7, 11, 19):
        _check(setup, rng, _routing(rng, spec.moe.num_experts, n), threads=threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_background_job_equals_the_reference(setup, threads, seed):
    """start() returns before the job is done; wait() joins it; a pool without the caller's
    thread still does the whole job."""
    _, spec, *_ = setup
    rng = random.Random(seed)
    for n in (1, 4, 9):
        _check(setup, rng, _routing(rng, spec.moe.num_experts, n), threads=threads, background=True)


@pytest.mark.parametrize("background", [True, False])
def test_a_signaled_job_raises_its_flag_once_done(setup, background, seed):
    """start_signaled: the job equals the reference and its end flag holds the value by the time
    wait() returns (a pool with the caller's thread runs it there, then signals); a job with no
    pairs signals at once."""
    isa, spec, pool, *_, lib = setup
    rng = random.Random(seed)
    for n in (1, 6, 70):
        _check(setup, rng, _routing(rng, spec.moe.num_experts, n), threads=2, background=background, signaled=True)
    kernel = CpuExpertKernel(lib, isa, spec.hidden_size, spec.moe.expert_intermediate_size, physical_cpus()[:2],
                             background)
    flag, value = torch.zeros(8, dtype=torch.int64), rng.randrange(1, 2**40)
    x = torch.zeros(1, spec.hidden_size)
    none = torch.zeros(0, dtype=torch.int64)
    kernel.start_signaled(pool.experts, x, x.clone(), none, torch.zeros(1, dtype=torch.int32),
                          none.to(torch.int32), none.float(), flag, value)
    assert int(flag[0]) == value, f"seed={seed}: a job with nothing to run did not signal"
    kernel.wait()


def test_experts_of_many_tokens(setup, seed):
    """From the kernel's `tile_min` routed tokens on an expert runs as tile GEMMs where its kernel
    has them (AMX, else AVX-512 BF16): either side of it, blocks of 16 tokens, a partial last one,
    tiled experts beside bucketed ones in one call (a skewed routing), one thread and all; up to
    4096 tokens on qwen3-30b-a3b's shape."""
    isa, spec, *_, lib = setup
    rng = random.Random(seed)
    e = spec.moe.num_experts
    least = CpuExpertKernel(lib, isa, spec.hidden_size, spec.moe.expert_intermediate_size, [0]).tile_min or 16
    counts = (15, least - 1, least, least + 1, least + 17, 100) + ((4096,) if spec.hidden_size == 2048 else (300,))
    for n in counts:
        _check(setup, rng, _routing(rng, e, n, same=True), threads=rng.choice([1, len(physical_cpus())]))
    hot = rng.sample(range(e), 2)  # most tokens go to two experts, the rest anywhere
    skewed = torch.tensor([hot if rng.random() < 0.7 else rng.sample(range(e), 2) for _ in range(least + 40)])
    _check(setup, rng, skewed, threads=len(physical_cpus()))


def test_tiles_run_on_amx_where_the_cpu_has_it(setup, tmp_path: Path, monkeypatch):
    """The tile backend is AMX where the CPU has AMX-TILE and AMX-BF16 (and the OS grants them),
    else AVX-512 BF16; FTC_AMX=0, read when the library loads, takes AVX-512 BF16 either way. The
    other tests compare whichever runs here with the reference."""
    from ftc_runtime.cpu_info import cpu_flags

    isa, spec, *_, lib = setup
    kernel = CpuExpertKernel(lib, isa, spec.hidden_size, spec.moe.expert_intermediate_size, [0])
    if isa != "avx512_bf16":
        assert kernel.tile_backend == "none" and kernel.tile_min is None
        return
    copy = tmp_path / "lib.so"  # another path: loaded anew, its FTC_AMX read again
    copy.write_bytes(lib.read_bytes())
    monkeypatch.setenv("FTC_AMX", "0")
    soft = CpuExpertKernel(copy, isa, spec.hidden_size, spec.moe.expert_intermediate_size, [0])
    assert soft.tile_backend == "avx512"
    template = expert_format(spec.expert_format).cpu_templates[isa]
    assert soft.tile_min == template.tile_min_avx512
    if not {"amx_bf16", "amx_tile"} <= cpu_flags():
        pytest.skip("this CPU has no AMX (amx_bf16, amx_tile): its tiles ran on AVX-512 BF16")
    assert kernel.tile_backend == "amx" and kernel.tile_min == template.tile_min_amx


def test_library_reports_its_isa_and_shapes(setup, tmp_path: Path):
    isa, spec, *_, lib = setup
    other = "avx2" if isa == "avx512_bf16" else "avx512_bf16"
    with pytest.raises(Exception, match="built for"):
        CpuExpertKernel(lib, isa, spec.hidden_size + 32, spec.moe.expert_intermediate_size, [0])
    if other in supported_isas():
        with pytest.raises(Exception, match="built for"):
            CpuExpertKernel(lib, other, spec.hidden_size, spec.moe.expert_intermediate_size, [0])


def test_mxfp4_subnormal_scales(setup, seed):
    """e8m0 bytes 0 and 1 (legal, never in a real checkpoint): 0 is the subnormal 2^-127, which an
    exponent-field decode gets wrong unless it is taken apart; both beside ordinary blocks."""
    isa, spec, pool, _, plan, lib = setup
    if pool.header.expert_format != "mxfp4":
        pytest.skip("mxfp4's e8m0 scales only")
    rng = random.Random(seed)
    changed = ftw.ExpertPool(pool.header, pool.buffer.clone())
    for bank in ("gate_up_scales", "down_scales"):
        scales = changed.bank(bank)
        for row in range(scales.shape[0]):
            for _ in range(3):
                scales[row, rng.randrange(scales.shape[1])] = rng.choice((0, 1))
    weights = [tuple(w.double() for w in changed.header.dequantize(changed.experts[r]))
               for r in range(changed.header.num_rows)]
    for n in (1, 2, 5):
        _check((isa, spec, changed, weights, plan, lib), rng, _routing(rng, spec.moe.num_experts, n),
               threads=len(physical_cpus()))


@pytest.mark.parametrize("variant", LIMIT_VARIANTS)
def test_a_swiglu_limit_clamps_as_the_reference(variant, tmp_path, seed):
    """DeepSeek-V4's clamp of the experts' pre-activations, rendered into the kernel: at a limit of
    0.5 (the pre-activations are O(1), so that most are clamped) the kernel equals the clamped
    reference, which differs from the unclamped one far beyond the tolerance."""
    fmt, isa, shape = variant
    setup = _build(fmt, isa, shape, tmp_path, swiglu_limit=0.5)
    rng = random.Random(seed)
    for n in (1, 3, 6):
        x, rows, weights, ref = _check(setup, rng, _routing(rng, shape[2], n), threads=2)
        unclamped = _reference(setup[3], x, rows, weights)
        assert float((unclamped - ref).norm() / ref.norm()) > 20 * TOLERANCE[isa], "the clamp changed nothing"
