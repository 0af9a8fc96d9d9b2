"""`ftc package ENGINE -o OUT`: an engine as a folder ready to upload as a Hugging Face model
repository, or as one uncompressed tar (`--archive`).

The folder holds every file of the engine with the expert file cut into shards of at most the
shard size (the Hub takes files of up to 50 GB), every kernel source the library was built from,
and a README.md model card generated from the engine; its engine.json lists every file with its
sha256, the shards in order (`experts_shards`) and what the engine needs of the machine that runs
it (`package.requires`). The shards are experts.ftw's bytes cut at expert boundaries, so a shard's
experts start on 4096-byte boundaries of its file and load with O_DIRECT, all shards at once
(`ftc_runtime.io.ftw.FtwShards`). The source engine is checked first, and the bytes copied are
hashed on the way and held to the engine's recorded sha256: a damaged engine is not published.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from ftc import __version__
from ftc.codegen.render import CodegenError, render_cpu_kernels
from ftc.compile.pipeline import make_plan
from ftc.compile.targets import Target
from ftc_runtime.artifact import EXPERTS_FILE, MANIFEST, ArtifactError, EngineManifest, check_engine, describe_files
from ftc_runtime.experts.vram_plan import VramError, gib, plan_vram
from ftc_runtime.formats import expert_format
from ftc_runtime.io import ftw
from ftc_runtime.io.engine_archive import write_archive
from ftc_runtime.models.dense_layout import stored_bytes, stored_dense

SHARD_SIZE = 48 * 10**9  # below the Hub's 50 GB per file
CARD_BUDGETS_GIB = (8, 16, 24, 32, 48, 96)  # the model card's VRAM plan: common cards
CARD_CONTEXT = 32768  # tokens of KV the card's plan keeps room for
COPY_CHUNK = 64 << 20
CARD = "README.md"  # the Hub shows it as the repository's model card


def shard_name(i: int, n: int) -> str:
    return f"experts-{i + 1:05d}-of-{n:05d}.ftw"


def shard_cuts(header: ftw.FtwHeader, file_bytes: int, shard_size: int) -> list[int]:
    """Start offsets of the shards of an FTW file of `file_bytes` bytes: each shard at most
    `shard_size` bytes and at least one expert, every cut on an expert boundary, the header in
    the first shard, the checksum trailer in the last."""
    stride, trailer = header.expert_stride, file_bytes - header.trailer_offset
    cuts, row, extra = [0], 0, header.data_offset  # extra: the header's bytes, in the first shard only
    while (header.num_rows - row) * stride + extra + trailer > shard_size:
        take = min((shard_size - extra) // stride, header.num_rows - row - 1)
        if take < 1:
            raise ArtifactError(f"--shard-size {shard_size} bytes: too small for one expert ({stride} bytes) with "
                                f"the header ({header.data_offset}) or the checksum trailer ({trailer})")
        row, extra = row + take, 0
        cuts.append(header.data_offset + row * stride)
    return cuts


def package_engine(engine: Path, out: Path, shard_size: int = SHARD_SIZE, archive: bool = False,
                   repo_id: str | None = None, console: Console | None = None) -> Path:
    """Packages `engine` into the folder `out` (or, with `archive`, the tar file `out`); returns it.
    `repo_id` (ORG/NAME) goes into the model card's commands."""
    console = console or Console(stderr=True)
    checked = check_engine(engine)
    m = checked.manifest
    if m.experts_in_memory:
        raise ArtifactError(f"{engine}: compiled with its experts in memory (a benchmark engine): nothing to package")
    if "experts_shards" in m.raw:
        raise ArtifactError(f"{engine}: already a package (its experts are in shards); package the engine it came from")
    if out.exists():
        raise ArtifactError(f"{out}: already exists; choose another output or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    _check_room(m, out.parent, archive)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.packaging-"))
    try:
        files, shards = _copy_engine(m, checked.experts, staging, shard_size, console)
        raw = _package_manifest(m, files, shards, shard_size, _other_isa_sources(m, staging, files))
        (staging / CARD).write_text(model_card(dataclasses.replace(m, root=staging, files=files, raw=raw), repo_id))
        files |= describe_files(staging, [CARD])
        (staging / MANIFEST).write_text(json.dumps(raw, indent=1, allow_nan=False) + "\n")
        if archive:
            _archive(staging, out, console)
        else:
            staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _check_room(m: EngineManifest, folder: Path, archive: bool) -> None:
    """Refuses at once where `folder`'s disk cannot hold the package (twice over for an archive,
    whose folder is written first)."""
    need = sum(meta["bytes"] for meta in m.files.values()) * (2 if archive else 1)
    free = shutil.disk_usage(folder).free
    if free < need:
        raise ArtifactError(f"{folder}: {free / 1e9:.1f} GB free, the package needs {need / 1e9:.1f} GB")


def _copy_engine(m: EngineManifest, header: ftw.FtwHeader, staging: Path, shard_size: int,
                 console: Console) -> tuple[dict[str, dict], list[str]]:
    """Every file into `staging`, the experts cut into shards; the `files` table of the copies and
    the shards' names, in order."""
    source = m.path(EXPERTS_FILE)
    size = m.files[EXPERTS_FILE]["bytes"]
    cuts = shard_cuts(header, size, shard_size)
    names = [shard_name(i, len(cuts)) for i in range(len(cuts))]
    whole = hashlib.sha256()
    files: dict[str, dict] = {}
    with _progress(console) as bar:
        task = bar.add_task("experts", total=size)
        for name, a, b in zip(names, cuts, [*cuts[1:], size], strict=True):
            files[name] = _copy_range(source, a, b - a, staging / name, whole, lambda n: bar.advance(task, n))
    if whole.hexdigest() != m.files[EXPERTS_FILE]["sha256"]:
        raise ArtifactError(f"{source}: corrupted: sha256 differs from the one in engine.json; not packaged")
    for rel in [r for r in m.files if r != EXPERTS_FILE] + _kernel_sources(m):
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(m.path(rel) if rel in m.files else m.root / rel, staging / rel)
        files |= describe_files(staging, [rel])
        if rel in m.files and files[rel] != {k: m.files[rel][k] for k in ("bytes", "sha256")}:
            raise ArtifactError(f"{m.path(rel)}: changed while it was packaged; not packaged")
    return files, names


def _kernel_sources(m: EngineManifest) -> list[str]:
    """The kernel library's sources beside the listed ones (CMakeLists.txt, the worker pool, ...),
    so that the package holds everything its library was built from."""
    kernels = m.root / "kernels"
    listed = set(m.files)
    return sorted(f"kernels/{p.name}" for p in kernels.iterdir()
                  if p.is_file() and not p.is_symlink() and f"kernels/{p.name}" not in listed) \
        if kernels.is_dir() else []


def _copy_range(source: Path, offset: int, n: int, dest: Path, whole: hashlib._Hash,
                on_bytes: Callable[[int], None]) -> dict:
    """Bytes [offset, offset + n) of `source` into `dest`, hashed for `dest`'s entry and into
    `whole` (the source's own sha256, in order)."""
    sha = hashlib.sha256()
    with open(source, "rb") as f, open(dest, "wb") as g:
        f.seek(offset)
        left = n
        while left:
            chunk = f.read(min(COPY_CHUNK, left))
            if not chunk:
                raise ArtifactError(f"{source}: ends at byte {offset + n - left}, before the {offset + n} "
                                    "engine.json records (truncated)")
            g.write(chunk)
            sha.update(chunk)
            whole.update(chunk)
            left -= len(chunk)
            on_bytes(len(chunk))
    return {"bytes": n, "sha256": sha.hexdigest()}


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description:<10}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    console=console, transient=True)


def _other_isa_sources(m: EngineManifest, staging: Path, files: dict[str, dict]) -> dict[str, dict]:
    """The CPU kernel sources for each other ISA the expert format has a kernel for, rendered
    into kernels/<isa>/ with that ISA's plan (added to `files`): on a CPU that lacks the engine's
    ISA the runtime builds one of them (`ftc_runtime.kernel_sets`). Their plans, by ISA."""
    fmt = expert_format(m.spec.expert_format)
    sets = {}
    for isa in (i for i in fmt.cpu_templates if i != m.plan.isa):
        target = Target(m.target["name"], isa, m.plan.cpu_threads)
        plan = dataclasses.replace(make_plan(target, m.spec), prefill_chunk=m.plan.prefill_chunk)
        folder = staging / "kernels" / isa
        try:
            render_cpu_kernels(m.spec, plan, folder)
        except CodegenError:  # the model's shapes do not fit that ISA's kernel
            continue
        files |= describe_files(staging, [p.relative_to(staging).as_posix() for p in sorted(folder.iterdir())])
        sets[isa] = {"folder": f"kernels/{isa}", "plan": plan.to_dict()}
    return sets


def _package_manifest(m: EngineManifest, files: dict[str, dict], shards: list[str], shard_size: int,
                      kernel_sets: dict[str, dict]) -> dict:
    """The package's engine.json: the engine's, listing `files` (the same dict: what is added to
    it later is listed too), the shards and what the package needs."""
    raw = dict(m.raw)
    raw["files"] = files
    raw["experts_shards"] = shards
    raw["package"] = {
        "ftc_version": __version__, "shard_size": shard_size,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "experts_sha256": m.files[EXPERTS_FILE]["sha256"],
        "requires": requirements(m),
        "kernel_sets": kernel_sets,
    }
    return raw


def requirements(m: EngineManifest) -> dict:
    """What the engine needs of the machine that runs it: this engine format, the CPU ISA its
    prebuilt kernel library was built for, no prebuilt GPU code (the Triton kernels compile where
    they run), and the ftc, torch and Triton it was built with."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"format_version": m.raw["format_version"], "cpu_isa": m.plan.isa, "gpu_arch": None,
            "built_with": {"ftc": m.raw.get("ftc_version"), "torch": torch.__version__.split("+")[0],
                           "triton": triton_version}}


def _archive(staging: Path, out: Path, console: Console) -> None:
    total = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file())
    with _progress(console) as bar:
        task = bar.add_task("archive", total=total)
        write_archive(staging, out, on_bytes=lambda n: bar.advance(task, n))


def model_card(m: EngineManifest, repo_id: str | None = None) -> str:
    """README.md for the Hub: what the engine is, the VRAM plan at common budgets, the figures
    measured on its machine (where `ftc profile` recorded them) and how to run it."""
    spec = m.spec
    repo = repo_id or f"ORG/{spec.name}"
    other_isas = ", ".join(m.raw.get("package", {}).get("kernel_sets", {}))
    shard_bytes = sum(m.files[r]["bytes"] for r in m.expert_files)
    lines = ["---", "library_name: ftc", "tags: [ftc, moe, mixture-of-experts]", "---", "",
             f"# {spec.name}: an ftc engine", "",
             f"An engine compiled by [ftc](https://github.com/freetoken/ftc) {m.raw.get('ftc_version')} from "
             f"{m.weights_source}: {spec.family}, {spec.num_layers} layers, {spec.moe.num_experts} routed experts "
             f"(top {spec.moe.top_k}) in {spec.expert_format} ({gib(shard_bytes)} in "
             f"{len(m.expert_files)} shard(s)), non-expert weights in {spec.dense_format}.", "",
             "| | |", "| --- | --- |", f"| target | {m.target['name']} |",
             f"| CPU kernels | {m.plan.isa}, built; the sources of {other_isas or 'no other ISA'} beside it (built "
             "where the CPU lacks the first) |",
             f"| engine format | {m.raw['format_version']} |", ""]
    lines += _vram_lines(m) + _measured_lines(m)
    lines += ["## Run it", "", "With ftc installed:", "", "```bash",
              f"ftc run {repo} --device cuda --vram-budget 24GiB",
              f"ftc run {repo} --serve --device cuda   # OpenAI and Anthropic APIs on port 8000", "```", "",
              f"or download it first: `hf download {repo} --local-dir {spec.name}`, then `ftc run {spec.name}`.", ""]
    return "\n".join(lines)


def _vram_lines(m: EngineManifest) -> list[str]:
    header, _ = ftw.read_header(m.experts_source())
    dense = stored_bytes(stored_dense(m.spec))
    lines = [f"## GPU memory (a {CARD_CONTEXT}-token context)", "",
             "| `--vram-budget` | expert slots | share of the experts |", "| --- | --- | --- |"]
    for budget in CARD_BUDGETS_GIB:
        try:
            plan = plan_vram(m.spec, dense, budget << 30, header.expert_stride, header.num_rows, CARD_CONTEXT)
        except VramError:
            lines.append(f"| {budget} GiB | too small (non-expert weights {gib(dense)}) | |")
            continue
        lines.append(f"| {budget} GiB | {plan.n_slots} | {100 * plan.pool_share:.1f}% |")
    return [*lines, ""]


def _measured_lines(m: EngineManifest) -> list[str]:
    profile = m.raw.get("profile")
    if not isinstance(profile, dict):
        return []
    rows = [(k, profile.get(k)) for k in ("gpu", "b_p", "b_h", "b_p_during_cpu", "b_h_during_copy")]
    return ["## Measured on the machine it was built for (`ftc profile`)", "", "| | |", "| --- | --- |",
            *(f"| {k} | {v} |" for k, v in rows if v is not None), ""]

