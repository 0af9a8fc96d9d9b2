"""The engine directory and its manifest, `engine.json`: what was built, for which machine, and
the sha256 of every file, so that a mismatched or damaged engine is refused with a clear message."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .spec import ModelSpec, SpecError

FORMAT = "ftc-engine"
FORMAT_VERSION = 1
MANIFEST = "engine.json"
EXPERTS_FILE = "experts.ftw"
DENSE_FILE = "dense.safetensors"
TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
LIBRARY_FILE = "lib/libftc_kernels.so"
TRITON_EXPERT_FILE = "kernels/expert_ffn_triton.py"


class ArtifactError(ValueError):
    """The engine directory is incomplete, damaged or from an incompatible version."""


@dataclass(frozen=True)
class Plan:
    """How this engine runs on its target: the kernel ISA, CPU workers and kernel tiling."""

    isa: str
    cpu_threads: int | None  # None: every physical core of the machine that runs it
    batch_buckets: tuple[int, ...]  # token-tile sizes the kernels are specialized for, largest first
    gate_up_chunk: int  # intermediate rows per gate/up work item
    down_chunk: int  # hidden rows per down work item
    prefetch_rows: int  # rows prefetched ahead inside a work item
    # Prompts run in chunks of this many tokens; a chunk of at least `prefill_stream_min_tokens`
    # streams whole MoE layers through two layer buffers on a GPU (below it, the decode path).
    prefill_chunk: int = 8192
    prefill_stream_min_tokens: int = 64

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        defaults = cls.__dataclass_fields__  # engines compiled before a field existed get its default
        return cls(d["isa"], d["cpu_threads"], tuple(d["batch_buckets"]), d["gate_up_chunk"], d["down_chunk"],
                   d["prefetch_rows"], d.get("prefill_chunk", defaults["prefill_chunk"].default),
                   d.get("prefill_stream_min_tokens", defaults["prefill_stream_min_tokens"].default))


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class EngineManifest:
    root: Path
    spec: ModelSpec
    plan: Plan
    target: dict[str, Any]
    weights_source: str
    files: dict[str, dict[str, Any]]  # path relative to root → {"bytes", "sha256"}
    raw: dict[str, Any]

    @classmethod
    def read(cls, root: Path) -> EngineManifest:
        path = root / MANIFEST
        if not path.is_file():
            raise ArtifactError(f"{root}: not an ftc engine ({MANIFEST} not found)")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ArtifactError(f"{path}: corrupted ({e})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ArtifactError(f"{path}: not an ftc engine manifest (format {raw.get('format')!r})"
                                if isinstance(raw, dict) else f"{path}: not an ftc engine manifest")
        if raw.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(f"{path}: engine format version {raw.get('format_version')} is not supported "
                                f"by this runtime (version {FORMAT_VERSION}); recompile the engine")
        try:
            spec = ModelSpec.from_dict(raw["spec"], source=f"{path}: spec")
            plan = Plan.from_dict(raw["plan"])
            return cls(root, spec, plan, raw["target"], raw["weights_source"], raw["files"], raw)
        except SpecError as e:
            raise ArtifactError(str(e)) from None
        except (KeyError, TypeError) as e:
            raise ArtifactError(f"{path}: missing or malformed field {e}") from None

    def verify(self, skip_hash: tuple[str, ...] = (EXPERTS_FILE,)) -> None:
        """Every listed file exists with its recorded size; all but `skip_hash` match their sha256.

        The expert file is checked row by row against its own checksums when it is loaded, which
        is far cheaper than hashing tens of gigabytes at every start."""
        for rel, meta in self.files.items():
            path = self.root / rel
            if not path.is_file():
                raise ArtifactError(f"{path}: missing from the engine")
            size = path.stat().st_size
            if size != meta["bytes"]:
                what = "truncated" if size < meta["bytes"] else "larger than recorded"
                raise ArtifactError(f"{path}: {what}: {size} bytes, engine.json records {meta['bytes']}")
            if rel not in skip_hash and file_sha256(path) != meta["sha256"]:
                raise ArtifactError(f"{path}: corrupted: sha256 differs from the one in engine.json")


def describe_files(root: Path, rels: list[str], known_sha: dict[str, str] | None = None) -> dict[str, dict]:
    """The `files` table of engine.json; `known_sha` gives hashes computed while writing."""
    known_sha = known_sha or {}
    return {rel: {"bytes": (root / rel).stat().st_size,
                  "sha256": known_sha.get(rel) or file_sha256(root / rel)} for rel in rels}


def store_profile(root: Path, profile: dict[str, Any]) -> None:
    """Records a measured hardware profile in engine.json: the target's bandwidths follow it."""
    path = root / MANIFEST
    raw = json.loads(path.read_text())
    keys = {"gpu": "gpu", "vram_bytes": "vram_bytes", "b_p": "b_p", "b_h": "b_h",
            "b_p_during_cpu": "b_p_concurrent", "b_h_during_copy": "b_h_concurrent"}
    raw["target"] = raw["target"] | {t: profile[p] for p, t in keys.items() if profile.get(p) is not None}
    raw["profile"] = profile
    staged = path.with_suffix(".json.tmp")
    staged.write_text(json.dumps(raw, indent=1) + "\n")
    staged.replace(path)
