"""Builds the generated kernel sources with the cmake and ninja Python packages: the compiler's
build of a new engine, and the runtime's rebuild of a packaged engine's library for a CPU of
another ISA from the sources the package carries.

Built libraries are cached under FTC_CACHE_DIR by the hash of their sources and compiler, so
engines that share shapes and ISA share one build.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

LIB_NAME = "libftc_kernels.so"


class BuildError(RuntimeError):
    """cmake or the C++ compiler failed; the message carries the end of their output."""


def _compiler_id() -> str:
    cxx = os.environ.get("CXX", "c++")
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        raise BuildError(f"no C++ compiler: `{cxx} --version` failed (install g++ or set CXX)") from None


def cache_key(kernels_dir: Path) -> str:
    h = hashlib.sha256(_compiler_id().encode())
    for path in sorted(p for p in kernels_dir.rglob("*") if p.is_file()):
        h.update(path.relative_to(kernels_dir).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:32]


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
        raise BuildError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def build_kernels(kernels_dir: Path, lib_dir: Path, cache_dir: Path) -> tuple[Path, bool]:
    """Builds (or takes from the cache) the kernel library into `lib_dir`; returns its path and
    whether the cache served it."""
    cached, hit = cached_library(kernels_dir, cache_dir)
    lib_dir.mkdir(parents=True, exist_ok=True)
    target = lib_dir / LIB_NAME
    shutil.copyfile(cached, target)
    return target, hit


def cached_library(kernels_dir: Path, cache_dir: Path) -> tuple[Path, bool]:
    """The library built from `kernels_dir` in the kernel cache (built first where it is not
    there); whether the cache served it."""
    cached = cache_dir / "kernels" / cache_key(kernels_dir) / LIB_NAME
    if cached.is_file():
        return cached, True
    cache_dir.mkdir(parents=True, exist_ok=True)
    try:
        import cmake
        import ninja
    except ImportError:
        raise BuildError("building kernels needs the cmake and ninja Python packages: pip install 'ftc[compile]'") \
            from None
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix="build-") as tmp:
        out = Path(tmp) / "out"
        cmake_bin = str(Path(cmake.CMAKE_BIN_DIR) / "cmake")
        _run([cmake_bin, "-S", str(kernels_dir), "-B", str(Path(tmp) / "b"), "-G", "Ninja",
              f"-DCMAKE_MAKE_PROGRAM={Path(ninja.BIN_DIR) / 'ninja'}", f"-DFTC_LIB_DIR={out}"], "cmake configure")
        _run([cmake_bin, "--build", str(Path(tmp) / "b")], "kernel build")
        cached.parent.mkdir(parents=True, exist_ok=True)
        staged = cached.with_suffix(".tmp")
        shutil.copyfile(out / LIB_NAME, staged)
        os.replace(staged, cached)
    return cached, False
