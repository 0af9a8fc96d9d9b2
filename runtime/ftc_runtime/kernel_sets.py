"""A packaged engine's CPU kernels for a machine of another ISA. `ftc package` puts the sources of
every other ISA its expert format has a kernel for into kernels/<isa>/ (`package.kernel_sets` in
engine.json, each file listed with its sha256); where this CPU lacks the ISA the engine's library
was built for and has one of those, that one is built (cmake and ninja, into the kernel cache:
once per machine) and used instead, and the user is told. Elsewhere the engine's own library."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from ftc_runtime.artifact import LIBRARY_FILE, EngineManifest
from ftc_runtime.cpu_info import missing_flags, supported_isas
from ftc_runtime.kernel_build import cached_library
from ftc_runtime.settings import settings


def kernel_library(manifest: EngineManifest) -> tuple[Path, str]:
    """The kernel library this CPU runs the engine with, and its ISA."""
    path, isa = manifest.path(LIBRARY_FILE), manifest.plan.isa
    lacking = missing_flags(isa)
    sets = manifest.raw.get("package", {}).get("kernel_sets", {})
    usable = [i for i in supported_isas() if i in sets]
    if not lacking or not usable:  # the engine's own (a CPU that lacks its ISA is refused when it loads)
        return path, isa
    other = usable[0]
    folder = sets[other]["folder"]
    with tempfile.TemporaryDirectory() as tmp:
        # The listed files only, each resolved inside the engine: what engine.json's sha256 covers.
        for rel in (r for r in manifest.files if r.startswith(f"{folder}/")):
            shutil.copyfile(manifest.path(rel), Path(tmp) / Path(rel).name)
        built, cached = cached_library(Path(tmp), settings().cache_dir)
    print(f"ftc: {path} was built for {isa}, which this CPU lacks ({', '.join(lacking)}): running the package's "
          f"{other} kernels, {'taken from' if cached else 'built from its sources into'} {built}", file=sys.stderr)
    return built, other
