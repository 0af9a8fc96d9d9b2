"""Hugging Face repositories as users name them (`ORG/NAME`), fetched through huggingface_hub into
its cache: its token, its offline mode and its cache folder (HF_TOKEN, HF_HUB_OFFLINE,
HF_HUB_CACHE) as the Hub's own client handles them. Each failure is one line naming the
repository (`HubError`)."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class HubError(ValueError):
    """A repository could not be fetched; the message says why in one line."""


def names_a_repository(text: str | Path) -> bool:
    """Whether `text` is read as a Hub repository: written ORG/NAME, and no such path here."""
    return not Path(text).exists() and REPO_ID.fullmatch(str(text)) is not None


def snapshot(repo_id: str, allow_patterns: list[str] | None = None) -> Path:
    """The folder of `repo_id`'s latest snapshot in the Hub cache (downloaded where missing)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(repo_id, allow_patterns=allow_patterns))
    except GatedRepoError:
        raise HubError(f"{repo_id}: a gated repository: accept its terms on huggingface.co, then log in "
                       "(`hf auth login`, or HF_TOKEN)") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise HubError(f"{repo_id}: no such file, folder or Hugging Face repository (a private one needs "
                       "HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        raise HubError(f"{repo_id}: not in the Hugging Face cache, and offline (HF_HUB_OFFLINE) or the Hub "
                       "cannot be reached") from None
    except HfHubHTTPError as e:
        raise HubError(f"{repo_id}: the Hugging Face Hub answered {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
