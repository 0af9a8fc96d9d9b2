"""Environment settings, typed, in one place. Read once per process; each has a safe default."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


class SettingsError(ValueError):
    """An FTC_* environment variable has a value that cannot be used."""


def _int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return None
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r}: expected a positive integer") from None
    if value < 1:
        raise SettingsError(f"{name}={raw!r}: expected a positive integer")
    return value


@dataclass(frozen=True)
class Settings:
    num_threads: int | None  # FTC_NUM_THREADS: CPU expert workers (default: the physical cores)
    cache_dir: Path  # FTC_CACHE_DIR: built kernel libraries, keyed by the hash of their sources

    @classmethod
    def from_env(cls) -> Settings:
        cache = os.environ.get("FTC_CACHE_DIR") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ftc")
        return cls(num_threads=_int("FTC_NUM_THREADS"), cache_dir=Path(cache))


def settings() -> Settings:
    return Settings.from_env()
