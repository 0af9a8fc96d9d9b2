"""Renders the engine's kernel sources from the Jinja templates, with the spec's exact shapes."""

from __future__ import annotations

import shutil
from importlib.resources import files
from pathlib import Path
from typing import Any

import jinja2

from ftc_runtime.artifact import TRITON_EXPERT_FILE, Plan
from ftc_runtime.formats import expert_format
from ftc_runtime.io.ftw import FtwHeader
from ftc_runtime.spec import ModelSpec

TEMPLATE_DIR = Path(str(files("ftc_templates")))
CSRC_DIR = Path(str(files("ftc_runtime") / "csrc"))
RUNTIME_SOURCES = ("worker_pool.h", "worker_pool.cpp", "token_plan.cpp", "cpu_doorbell.cpp")
# The compiler flags of each ISA; which template a kernel comes from is its expert format's choice.
ISA_COMPILE_FLAGS = {
    "avx512_bf16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mavx512vbmi", "-mfma"],
    "avx2": ["-mavx2", "-mfma"],
}


class CodegenError(ValueError):
    """The spec's shapes or format do not fit the chosen kernel; the message names the field."""


def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATE_DIR), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True)


def render_cpu_kernels(spec: ModelSpec, plan: Plan, kernels_dir: Path) -> list[dict[str, Any]]:
    """Writes the expert kernel of the spec's expert format for the plan's ISA, the runtime's fixed
    C++ core and a CMakeLists.txt into `kernels_dir`; returns the kernel table for engine.json."""
    fmt = expert_format(spec.expert_format)
    if plan.isa not in fmt.cpu_templates:
        raise CodegenError(f"spec field 'expert_format' = {fmt.name!r}: no CPU kernel for {plan.isa} (it has "
                           f"{', '.join(fmt.cpu_templates) or 'none'})")
    kernel = fmt.cpu_templates[plan.isa]
    h, i = spec.hidden_size, spec.moe.expert_intermediate_size
    for field, value in (("hidden_size", h), ("moe.expert_intermediate_size", i)):
        if value % kernel.step:
            raise CodegenError(f"spec field '{field}' = {value}: the {fmt.name} {plan.isa} kernel needs a multiple "
                               f"of {kernel.step}")
    kernels_dir.mkdir(parents=True, exist_ok=True)
    env = _env()
    source = f"expert_ffn_{plan.isa}.cpp"
    header = FtwHeader.create(fmt.name, 1, 1, h, i)
    (kernels_dir / source).write_text(env.get_template(kernel.path).render(
        template=kernel.path, expert_format=fmt.name, isa=plan.isa, hidden=h, intermediate=i,
        bank_offsets={b.name: b.offset for b in header.banks}, block=header.banks[0].block,
        buckets=list(plan.batch_buckets), gate_up_chunk=plan.gate_up_chunk, down_chunk=plan.down_chunk,
        prefetch_rows=plan.prefetch_rows, swiglu_limit=float(spec.moe.swiglu_limit),
        tiles=kernel.tile_min_avx512 is not None, tile_min_amx=kernel.tile_min_amx,
        tile_min_avx512=kernel.tile_min_avx512))
    for name in RUNTIME_SOURCES:
        shutil.copyfile(CSRC_DIR / name, kernels_dir / name)
    sources = [source, *(name for name in RUNTIME_SOURCES if name.endswith(".cpp"))]
    (kernels_dir / "CMakeLists.txt").write_text(env.get_template("CMakeLists.txt.j2").render(
        isa=plan.isa, sources=sources, isa_flags=ISA_COMPILE_FLAGS[plan.isa]))
    return [{"name": "expert_ffn", "symbol": "ftc_expert_ffn", "source": f"kernels/{source}",
             "isa": plan.isa, "expert_format": fmt.name, "shapes": {"hidden": h, "intermediate": i},
             "batch_buckets": list(plan.batch_buckets)}]


# The grouped GEMM's tiling (rows of tokens, rows of weights, warps, pipeline stages): the best for
# every expert format in bench/dev/tune_grouped_gemm.py's sweep on an H200
# (docs/history/performance-log.md).
GROUPED_TILES = (128, 128, 8, 3)
# The decode kernel's tiling (gate/up rows per program and K per step, down rows per program and K per
# step, warps): bench/dev/tune_decode_experts.py sweeps it.
DECODE_TILES = (16, 256, 32, 128, 4)


def render_triton_kernels(spec: ModelSpec, kernels_dir: Path, grouped_tiles: tuple[int, int, int, int] | None = None,
                          decode_tiles: tuple[int, int, int, int, int] | None = None) -> list[dict[str, Any]]:
    """The GPU expert kernels of the spec's expert format over cache slots, for the slots' FTW row
    layout: one for decode (a few tokens per expert), one grouped GEMM for prompt chunks (many
    tokens per expert). Rendered on every machine; the runtime imports it only where a GPU runs
    the engine."""
    h, i = spec.hidden_size, spec.moe.expert_intermediate_size
    fmt = expert_format(spec.expert_format)
    header = FtwHeader.create(fmt.name, 1, 1, h, i)
    block_m, block_n, warps, stages = grouped_tiles or GROUPED_TILES
    block_i, block_h, block_out, block_in, decode_warps = decode_tiles or DECODE_TILES
    unit = fmt.slot_dtype.itemsize  # offsets and strides in the elements the kernels view the slots as
    kernels_dir.mkdir(parents=True, exist_ok=True)
    path = kernels_dir / Path(TRITON_EXPERT_FILE).name
    path.write_text(_env().get_template(fmt.triton_template).render(
        template=fmt.triton_template, expert_format=fmt.name, slot_dtype=str(fmt.slot_dtype), hidden=h,
        intermediate=i, slot_stride=header.expert_stride // unit, gate_up_offset=header.bank("gate_up").offset // unit,
        down_offset=header.bank("down").offset // unit, bank_offsets={b.name: b.offset for b in header.banks},
        block=header.banks[0].block, block_i=block_i, block_h=block_h, block_out=block_out, block_in=block_in,
        decode_warps=decode_warps, swiglu_limit=float(spec.moe.swiglu_limit), group_block_m=block_m,
        group_block_n=block_n, group_block_k=64, group_warps=warps, group_stages=stages))
    shapes = {"hidden": h, "intermediate": i}
    return [{"name": "expert_ffn_gpu", "symbol": "expert_ffn", "source": TRITON_EXPERT_FILE, "isa": "triton",
             "expert_format": fmt.name, "shapes": shapes},
            {"name": "grouped_expert_ffn_gpu", "symbol": "grouped_expert_ffn", "source": TRITON_EXPERT_FILE,
             "isa": "triton", "expert_format": fmt.name, "shapes": shapes}]
