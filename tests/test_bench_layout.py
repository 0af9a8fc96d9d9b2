"""bench/ holds the device script, the traces and the lab, each file named in a README: no
session-named device_*.sh beside device.sh, and no file that bench/README.md or bench/dev/README.md
does not name (bench/README.md by its path under bench/, bench/dev/README.md by its path under
bench/dev/)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
READMES = (BENCH / "README.md", BENCH / "dev" / "README.md")


def bench_files() -> set[str]:
    """Paths under bench/ (relative to it) of every file git tracks or would (untracked but not
    ignored), or of every file on disk outside a git checkout; __pycache__ left out."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "bench"],
                                cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
        paths = {ROOT / p for p in listed if p}
    except (OSError, subprocess.CalledProcessError):
        paths = {p for p in BENCH.rglob("*") if p.is_file()}
    return {p.relative_to(BENCH).as_posix() for p in paths
            if p.is_file() and "__pycache__" not in p.relative_to(BENCH).parts}


def names(text: str, name: str) -> bool:
    """Whether `text` names `name` as a whole path (not as part of a longer one)."""
    return re.search(rf"(?<![\w./-]){re.escape(name)}(?![\w-]|\.\w)", text) is not None


def test_bench_has_no_session_scripts_beside_device_sh():
    assert (BENCH / "device.sh").is_file()
    assert sorted(p.name for p in BENCH.glob("device_*.sh")) == []


def test_every_file_under_bench_is_named_in_a_readme():
    top, dev = (p.read_text() for p in READMES)
    files = bench_files()
    assert {"device.sh", "README.md", "dev/README.md"} <= files
    unnamed = [f for f in sorted(files - {"README.md", "dev/README.md"})
               if not (names(top, f) or f.startswith("dev/") and names(dev, f.removeprefix("dev/")))]
    assert not unnamed, f"name these in bench/README.md or bench/dev/README.md: {unnamed}"

