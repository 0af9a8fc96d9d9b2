"""Model sources as users write them: a spec YAML or a checkpoint folder on disk, or a Hugging Face
repository id (`ORG/NAME`), fetched through huggingface_hub into its cache (its token, its offline
mode: HF_TOKEN, HF_HUB_OFFLINE, HF_HUB_CACHE)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ftc_runtime.spec import SpecError

# What an engine needs from a repository: config and quantization settings, weights, tokenizer,
# chat template, generation defaults. Not other formats of the same weights (GGUF, .bin, .pt).
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja"]
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class Source:
    path: Path
    repo_id: str | None = None  # the Hub repository it came from

    @property
    def repo_name(self) -> str | None:
        return self.repo_id.split("/")[1] if self.repo_id else None


def hub_repo_name(source: Path) -> str | None:
    """The repository's NAME where `source` is fetched from the Hub (ORG/NAME, no such path here)."""
    if source.exists() or not REPO_ID.fullmatch(str(source)):
        return None
    return str(source).split("/")[1]


def resolve_source(source: Path) -> Source:
    """`source` itself where it exists; else, written as ORG/NAME, that repository's snapshot."""
    if hub_repo_name(source) is None:
        return Source(source)
    return Source(Path(_download(str(source))), str(source))


def _download(repo_id: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return snapshot_download(repo_id, allow_patterns=CHECKPOINT_FILES)
    except GatedRepoError:
        raise SpecError(f"{repo_id}: a gated repository: accept its terms on huggingface.co, then log in "
                        "(`hf auth login`, or HF_TOKEN)") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise SpecError(f"{repo_id}: no such file, folder or Hugging Face repository (a private one needs "
                        "HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        raise SpecError(f"{repo_id}: not in the Hugging Face cache, and offline (HF_HUB_OFFLINE) or the Hub "
                        "cannot be reached") from None
    except HfHubHTTPError as e:
        raise SpecError(f"{repo_id}: the Hugging Face Hub answered {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
