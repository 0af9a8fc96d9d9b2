"""Model sources as users write them: a spec YAML or a checkpoint folder on disk, or a Hugging Face
repository id (`ORG/NAME`), fetched through huggingface_hub into its cache (its token, its offline
mode: HF_TOKEN, HF_HUB_OFFLINE, HF_HUB_CACHE)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ftc_runtime.hub import HubError, names_a_repository, snapshot
from ftc_runtime.spec import SpecError

# What an engine needs from a repository: config and quantization settings, weights, tokenizer,
# chat template, generation defaults. Not other formats of the same weights (GGUF, .bin, .pt).
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja"]


@dataclass(frozen=True)
class Source:
    path: Path
    repo_id: str | None = None  # the Hub repository it came from

    @property
    def repo_name(self) -> str | None:
        return self.repo_id.split("/")[1] if self.repo_id else None


def hub_repo_name(source: Path) -> str | None:
    """The repository's NAME where `source` is fetched from the Hub (ORG/NAME, no such path here)."""
    if not names_a_repository(source):
        return None
    return str(source).split("/")[1]


def resolve_source(source: Path) -> Source:
    """`source` itself where it exists; else, written as ORG/NAME, that repository's snapshot."""
    if hub_repo_name(source) is None:
        return Source(source)
    return Source(Path(_download(str(source))), str(source))


def _download(repo_id: str) -> str:
    try:
        return str(snapshot(repo_id, CHECKPOINT_FILES))
    except HubError as e:
        raise SpecError(str(e)) from None
