"""Where an engine is, as a user names it: an engine folder; one tar file from `ftc package
--archive`, unpacked once into the user cache (`FTC_CACHE_DIR`/engines, keyed by the sha256 of its
engine.json, so a second run starts at once); or a Hugging Face repository `ORG/NAME` that `ftc
package` wrote, fetched through huggingface_hub (its cache, token and offline mode)."""

from __future__ import annotations

import tarfile
from pathlib import Path

from ftc_runtime.artifact import ArtifactError
from ftc_runtime.hub import names_a_repository, snapshot
from ftc_runtime.io.engine_archive import unpack_archive
from ftc_runtime.settings import settings


def resolve_engine(where: str | Path) -> Path:
    """The engine folder that `where` names."""
    path = Path(where)
    if path.is_dir():
        return path
    if path.is_file():
        if not tarfile.is_tarfile(path):
            raise ArtifactError(f"{path}: neither an engine folder nor an engine archive (a tar from "
                                "`ftc package --archive`)")
        cache = settings().cache_dir / "engines"
        cache.mkdir(parents=True, exist_ok=True)
        return unpack_archive(path, cache)
    if names_a_repository(where):
        return snapshot(str(where))
    raise ArtifactError(f"{where}: no such engine folder, archive or Hugging Face repository (ORG/NAME)")
