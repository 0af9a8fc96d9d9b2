"""The engine directory and its manifest, `engine.json`: what was built, for which machine, and
the sha256 of every file, so that a mismatched or damaged engine is refused with a clear message.

An engine directory is untrusted input: every field of engine.json is checked for its type and
range, every file it names must lie inside the directory (symlinks included), and every error is
an `ArtifactError` (or the FTW reader's `FtwError`) whose message starts with the file at fault.
`check_engine` holds every check made before the weights are read, for `Engine.load` and
`ftc inspect --verify` alike.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from ftc_runtime.chat.template import ChatTemplate, ChatTemplateError
from ftc_runtime.chat.tokenizer import Tokenizer
from ftc_runtime.cpu_info import ISA_FLAGS
from ftc_runtime.io import ftw
from ftc_runtime.models import checked_spec
from ftc_runtime.models.dense_layout import StoredTensors, stored_dense
from ftc_runtime.sampling import check_defaults
from ftc_runtime.spec import ModelSpec, SpecError, from_plain, short_repr

FORMAT = "ftc-engine"
FORMAT_VERSION = 5
MANIFEST = "engine.json"
EXPERTS_FILE = "experts.ftw"
DENSE_FILE = "dense.safetensors"
TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
LIBRARY_FILE = "lib/libftc_kernels.so"
TRITON_EXPERT_FILE = "kernels/expert_ffn_triton.py"
REQUIRED_FILES = (DENSE_FILE, TOKENIZER_FILE, LIBRARY_FILE)  # and EXPERTS_FILE unless experts are in memory
# A real engine.json is tens of kilobytes (the spec's special tokens are its largest part); a larger
# one is damage, not to be read into memory.
MANIFEST_MAX_BYTES = 16 << 20
MAX_NAME = 4096  # characters of a file name in `files` (Linux's PATH_MAX)
MAX_SYMLINKS = 40  # as Linux's own limit on symlinks followed in one path (ELOOP)
_TARGET_RATES = ("b_p", "b_h", "b_p_concurrent", "b_h_concurrent")
# GB/s a link or a CPU kernel can have: a tiny engine's kernel reads 20-27 GB/s on 2 idle cores
# (0.28 on a busy machine), HBM under 10,000; a figure outside is a unit slip (MB/s or TB/s
# written as GB/s), or a measurement on cores that other processes held (`ftc profile` says so).
PLAUSIBLE_GBPS = (0.1, 10_000.0)


def plausible_gbps(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and PLAUSIBLE_GBPS[0] <= v <= PLAUSIBLE_GBPS[1]


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
    def from_dict(cls, d: Any, source: str = "plan") -> Plan:
        """Every field checked by type and range (a SpecError names it); engines compiled before a
        field existed get its default."""
        plan = from_plain(cls, d, source)
        if plan.isa not in ISA_FLAGS:
            raise SpecError(f"{source}: field 'isa' = {short_repr(plan.isa)}: expected one of {', '.join(ISA_FLAGS)}")
        if not plan.batch_buckets:
            raise SpecError(f"{source}: field 'batch_buckets' = []: expected at least one token bucket")
        least = [("gate_up_chunk", plan.gate_up_chunk, 1), ("down_chunk", plan.down_chunk, 1),
                 ("prefetch_rows", plan.prefetch_rows, 0), ("prefill_chunk", plan.prefill_chunk, 1),
                 ("prefill_stream_min_tokens", plan.prefill_stream_min_tokens, 1),
                 ("cpu_threads", plan.cpu_threads or 1, 1)]  # None: every core
        least += [(f"batch_buckets[{i}]", b, 1) for i, b in enumerate(plan.batch_buckets)]
        for name, n, low in least:
            if n < low:
                raise SpecError(f"{source}: field '{name}' = {n}: expected an integer >= {low}")
        return plan


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
        raw = _read_manifest(root)
        try:
            spec = checked_spec(_field(raw, "spec", path), source=f"{path}: spec")
            plan = Plan.from_dict(_field(raw, "plan", path), source=f"{path}: plan")
        except SpecError as e:
            raise ArtifactError(str(e)) from None
        _check_target(_field(raw, "target", path), path)
        _expect(isinstance(_field(raw, "weights_source", path), str), path, "weights_source",
                raw["weights_source"], "a string")
        _expect(isinstance(raw.get("experts_in_memory", False), bool), path, "experts_in_memory",
                raw.get("experts_in_memory"), "true or false")
        _check_kernel_check(raw.get("kernel_check", []), path)
        try:
            check_defaults(raw.get("sampling", {}))
        except ValueError as e:
            raise ArtifactError(f"{path}: field 'sampling': {e}") from None
        files = _field(raw, "files", path)
        _check_files(files, path)
        _check_shards(raw.get("experts_shards"), files, path)
        return cls(root, spec, plan, raw["target"], raw["weights_source"], files, raw)

    @property
    def sampling(self) -> dict[str, float | int]:
        """The checkpoint's sampling defaults (generation_config.json): temperature, top_p, top_k."""
        return self.raw.get("sampling", {})

    @property
    def experts_in_memory(self) -> bool:
        """Compiled with its experts in memory (a benchmark engine): no experts.ftw."""
        return self.raw.get("experts_in_memory", False)

    @property
    def expert_files(self) -> tuple[str, ...]:
        """The files that hold the experts: experts.ftw, or a packaged engine's shards of it (none
        when the experts are in memory)."""
        if self.experts_in_memory:
            return ()
        shards = self.raw.get("experts_shards")
        return (EXPERTS_FILE,) if shards is None else tuple(shards)

    def experts_source(self) -> Path | ftw.FtwShards:
        """What the FTW readers take: experts.ftw's path, or its shards with their recorded sizes."""
        rels = self.expert_files
        if rels == (EXPERTS_FILE,):
            return self.path(EXPERTS_FILE)
        return ftw.FtwShards(tuple(self.path(r) for r in rels), tuple(self.files[r]["bytes"] for r in rels))

    def path(self, rel: str) -> Path:
        """The listed file `rel`, its symlinks resolved inside the engine directory (refused when
        one leads out); the path to open, stat or hand to a library."""
        if rel not in self.files:
            raise ArtifactError(f"{self.root / MANIFEST}: field 'files' has no entry for {rel}")
        resolved = _resolve(self.root, rel)
        if resolved is None:
            raise ArtifactError(f"{self.root / rel}: missing from the engine")
        return resolved

    def verify(self) -> None:
        """Every listed file exists with its recorded size; all but the experts' match their sha256.

        The expert file (or its shards) is checked row by row against its own checksums when it is
        loaded, which is far cheaper than hashing tens of gigabytes at every start."""
        skip_hash = self.expert_files
        for rel, meta in self.files.items():
            path = self.path(rel)
            size = _regular_file(path).st_size
            if size != meta["bytes"]:
                what = "truncated" if size < meta["bytes"] else "larger than recorded"
                raise ArtifactError(f"{path}: {what}: {size} bytes, engine.json records {meta['bytes']}")
            if rel not in skip_hash and file_sha256(path) != meta["sha256"]:
                raise ArtifactError(f"{path}: corrupted: sha256 differs from the one in engine.json")


def _read_manifest(root: Path) -> dict[str, Any]:
    """engine.json parsed (bounded in size, inside `root`), its format and version checked."""
    path = root / MANIFEST
    real = _resolve(root, MANIFEST)
    st = os.lstat(real) if real is not None else None
    if st is None:
        raise ArtifactError(f"{root}: not an ftc engine ({MANIFEST} not found)")
    if not stat.S_ISREG(st.st_mode):
        raise ArtifactError(f"{path}: not a regular file")
    if st.st_size > MANIFEST_MAX_BYTES:
        raise ArtifactError(f"{path}: corrupted: {st.st_size} bytes, more than the {MANIFEST_MAX_BYTES} "
                            "an engine.json may have")
    try:
        raw = json.loads(real.read_bytes().decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSON, UTF-8 and too-long-integer errors are ValueErrors
        raise ArtifactError(f"{path}: corrupted: not valid JSON ({_one_line(e)})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ArtifactError(f"{path}: not an ftc engine manifest (format {short_repr(raw.get('format'))})"
                            if isinstance(raw, dict) else f"{path}: not an ftc engine manifest")
    version = raw.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:
        built = raw.get("ftc_version")
        by = f" (written by ftc {short_repr(built)})" if isinstance(built, str) else ""
        fix = "upgrade ftc to run it" if type(version) is int and version > FORMAT_VERSION else \
            "recompile the engine (a packaged one: ask for a package of this format)"
        raise ArtifactError(f"{path}: engine format version {short_repr(version)}{by} is not supported "
                            f"by this runtime (version {FORMAT_VERSION}): {fix}")
    return raw


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows")


def _field(raw: dict[str, Any], key: str, path: Path) -> Any:
    if key not in raw:
        raise ArtifactError(f"{path}: missing required field '{key}'")
    return raw[key]


def _expect(ok: bool, path: Path, field: str, value: Any, expected: str) -> None:
    if not ok:
        raise ArtifactError(f"{path}: field '{field}' = {short_repr(value)}: expected {expected}")


def _check_target(target: Any, path: Path) -> None:
    """The fields the runtime reads: the name (inspect) and the measured bandwidths (the miss split)."""
    _expect(isinstance(target, dict), path, "target", target, "a mapping")
    _expect(isinstance(target.get("name"), str), path, "target.name", target.get("name"), "a string")
    for key in _TARGET_RATES:
        v = target.get(key)
        _expect(v is None or plausible_gbps(v), path, f"target.{key}", v,
                f"null or a number of GB/s in [{PLAUSIBLE_GBPS[0]}, {PLAUSIBLE_GBPS[1]:g}]")


def _check_kernel_check(checks: Any, path: Path) -> None:
    """`ftc inspect` prints these: each is {"not_run": why} or {"tokens": n, "rel_error": x}."""
    _expect(isinstance(checks, list), path, "kernel_check", checks, "a list")
    for i, c in enumerate(checks):
        ok = isinstance(c, dict) and (isinstance(c.get("not_run"), str) or (
            type(c.get("tokens")) is int and type(c.get("rel_error")) in (int, float)))
        _expect(ok, path, f"kernel_check[{i}]", c, "a mapping of 'not_run', or of 'tokens' and 'rel_error'")


def _check_shards(shards: Any, files: dict[str, Any], path: Path) -> None:
    """A packaged engine's `experts_shards`: the names of the files that hold experts.ftw's bytes
    in order, each one listed in `files`."""
    if shards is None:
        return
    _expect(isinstance(shards, list) and shards and all(isinstance(r, str) for r in shards), path, "experts_shards",
            shards, "a list of the files that hold the experts, in order")
    for rel in shards:
        if rel not in files or shards.count(rel) > 1:
            raise ArtifactError(f"{path}: field 'experts_shards' entry {short_repr(rel)}: "
                                + ("listed twice" if rel in files else "has no entry in 'files'"))


def _check_files(files: Any, path: Path) -> None:
    _expect(isinstance(files, dict), path, "files", files, "a mapping of file name to bytes and sha256")
    for rel, meta in files.items():
        why = _bad_name(rel)
        if why:
            raise ArtifactError(f"{path}: field 'files' entry {short_repr(rel)}: {why}; engine files lie inside "
                                "the engine directory")
        _expect(isinstance(meta, dict), path, f"files.{rel}", meta, "a mapping of 'bytes' and 'sha256'")
        n, sha = meta.get("bytes"), meta.get("sha256")
        _expect(type(n) is int and n >= 0, path, f"files.{rel}.bytes", n, "a size in bytes")
        _expect(isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef" for c in sha),
                path, f"files.{rel}.sha256", sha, "64 lowercase hex digits")


def _bad_name(rel: Any) -> str | None:
    """Why `rel` is not a relative path of plain names ('a/b.bin'), or None when it is."""
    if not isinstance(rel, str) or not rel or len(rel) > MAX_NAME:
        return f"not a file name of 1 to {MAX_NAME} characters"
    if "\0" in rel or "\\" in rel:
        return "a NUL or backslash in the name"
    if rel.startswith("/"):
        return "an absolute path"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "'.', '..' or an empty part in the path"
    return None


def _resolve(root: Path, rel: str) -> Path | None:
    """`root/rel` with every symlink on the way resolved without leaving `root`: each step is an
    lstat of a path inside `root`, so nothing outside is ever touched, not even stat'ed. None when
    a part is missing; an ArtifactError naming `root/rel` when a symlink leads out or loops."""
    parts: list[str] = []  # resolved names below root: real directories, then the file
    todo = rel.split("/")[::-1]  # names still to walk, the next one last
    links = 0
    while todo:
        name = todo.pop()
        if name in ("", "."):
            continue
        if name == "..":
            if not parts:
                raise ArtifactError(f"{root / rel}: a symlink on its path leads out of the engine directory")
            parts.pop()
            continue
        path = root.joinpath(*parts, name)
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise ArtifactError(f"{root / rel}: cannot be read ({e.strerror or e})") from None
        if not stat.S_ISLNK(mode):
            parts.append(name)
            continue
        links += 1
        target = os.readlink(path)
        if links > MAX_SYMLINKS or target.startswith("/"):
            why = "too many levels of symlinks" if links > MAX_SYMLINKS else f"{path} links to {target}"
            raise ArtifactError(f"{root / rel}: {why}: engine files must lie inside the engine directory")
        todo.extend(target.split("/")[::-1])
    return root.joinpath(*parts)


def _regular_file(path: Path) -> os.stat_result:
    # lstat: `path` comes from _resolve, so it has no symlink left; a FIFO or device would block or
    # never end when read.
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ArtifactError(f"{path}: not a regular file")
    return st


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


@dataclass(frozen=True)
class CheckedEngine:
    """What `check_engine` read on the way, for the loader to use."""

    manifest: EngineManifest
    experts: ftw.FtwHeader | None  # None: the experts are in memory (no experts.ftw)
    dense: StoredTensors  # the dense tensors' shapes and dtypes
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None  # None: compiled before templates were stored


def check_engine(root: Path, hash_experts: bool = False) -> CheckedEngine:
    """Every check made before the weights are read, by `Engine.load` and `ftc inspect --verify`
    alike: the manifest's fields, every file inside the directory with its size and sha256, the
    FTW header against the spec, the dense tensors' names, shapes and dtypes, and that the tokenizer,
    chat template, kernel library and Triton source can be read. With `hash_experts` the expert
    file is read once whole: its sha256 and every row's CRC-32 (the loader checks rows as it reads)."""
    m = EngineManifest.read(root)
    for rel in (*m.expert_files, *REQUIRED_FILES):
        m.path(rel)
    m.verify()
    experts = None if m.experts_in_memory else _check_experts(m, hash_experts)
    dense = _check_dense(m)
    tokenizer = _check_tokenizer(m)
    template = _check_chat_template(m)
    _check_library(m)
    _check_triton_source(m)
    return CheckedEngine(m, experts, dense, tokenizer, template)


def _check_experts(m: EngineManifest, hash_experts: bool) -> ftw.FtwHeader:
    source = m.experts_source()
    header, checksums = ftw.read_header(source)
    path = m.path(m.expert_files[0])
    spec = m.spec
    needed = ftw.FtwHeader.create(spec.expert_format, len(spec.expert_layers), spec.moe.num_experts, spec.hidden_size,
                                  spec.moe.expert_intermediate_size)
    if header != needed:
        raise ftw.FtwError(f"{path}: holds {header.num_moe_layers} MoE layers × {header.num_experts} experts of "
                           f"{_banks(header)}, the spec needs {needed.num_moe_layers} × {needed.num_experts} of "
                           f"{_banks(needed)}")
    if hash_experts:
        for rel, sha in zip(m.expert_files, ftw.verify_file(source, header, checksums), strict=True):
            if sha != m.files[rel]["sha256"]:
                raise ArtifactError(f"{m.path(rel)}: corrupted: sha256 differs from the one in engine.json")
    return header


def _banks(h: ftw.FtwHeader) -> str:
    return ", ".join(f"{b.name} {b.dtype} {list(b.row_shape)}" + (f" packed {b.packing}" if b.packing else "")
                     for b in h.banks)


def _check_dense(m: EngineManifest) -> StoredTensors:
    """The dense tensors' names, shapes and dtypes from the safetensors header (no data is read)."""
    path = m.path(DENSE_FILE)
    expected = stored_dense(m.spec)
    try:
        with safe_open(str(path), framework="pt") as f:
            names = set(f.keys())
            found = {n: (tuple(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype()) for n in expected if n in names}
    except (SafetensorError, OSError) as e:
        raise ArtifactError(f"{path}: not a readable safetensors file ({_one_line(e)})") from None
    for name, (shape, dtype) in expected.items():
        got = found.get(name)
        if got != (shape, dtype):
            what = "missing" if got is None else f"{got[1]} {got[0]}"
            raise ArtifactError(f"{path}: tensor {name}: {what}, expected {dtype} {shape} (dense_format "
                                f"{m.spec.dense_format})")
    return expected


def _check_tokenizer(m: EngineManifest) -> Tokenizer:
    path = m.path(TOKENIZER_FILE)
    try:
        return Tokenizer(path)
    except Exception as e:  # the tokenizers library raises plain Exception for every parse error
        raise ArtifactError(f"{path}: not a readable tokenizer ({_one_line(e)})") from None


def _check_chat_template(m: EngineManifest) -> ChatTemplate | None:
    if CHAT_TEMPLATE_FILE not in m.files:  # engines compiled before templates were stored
        return None
    path = m.path(CHAT_TEMPLATE_FILE)
    try:
        return ChatTemplate(path.read_bytes().decode("utf-8"), str(path))
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{path}: not UTF-8 text ({e})") from None
    except ChatTemplateError as e:
        raise ArtifactError(_one_line(e)) from None


def _check_library(m: EngineManifest) -> None:
    """A complete 64-bit ELF shared object: its header tables and every segment lie within the file.
    Not loaded here (that runs its code); a truncated library loads, then kills the process with
    SIGBUS at the first touch of a page past the end of the file."""
    path = m.path(LIBRARY_FILE)
    data = path.read_bytes()  # tens to hundreds of KiB
    try:
        if data[:6] != b"\x7fELF\x02\x01":
            raise ValueError("no 64-bit little-endian ELF header")
        fields = struct.unpack_from("<HHIQQQIHHHHHH", data, 16)  # Elf64_Ehdr after e_ident
        kind, phoff, shoff, phentsize, phnum, shentsize, shnum = (fields[i] for i in (0, 4, 5, 8, 9, 10, 11))
        if kind != 3:  # ET_DYN
            raise ValueError(f"ELF type {kind}, not a shared object")
        if max(phoff + phnum * phentsize, shoff + shnum * shentsize) > len(data):
            raise ValueError(f"truncated: its header tables end past its {len(data)} bytes")
        for i in range(phnum):
            _, _, offset, _, _, size = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)  # Elf64_Phdr
            if offset + size > len(data):
                raise ValueError(f"truncated: segment {i} ends at byte {offset + size}, the file at {len(data)}")
    except (ValueError, struct.error) as e:
        raise ArtifactError(f"{path}: not a complete shared library ({e})") from None


def _check_triton_source(m: EngineManifest) -> None:
    """The GPU expert kernels' source compiles (the loader runs it on a CUDA device only)."""
    if TRITON_EXPERT_FILE not in m.files:
        return
    path = m.path(TRITON_EXPERT_FILE)
    try:
        compile(path.read_bytes(), str(path), "exec")
    except (SyntaxError, ValueError, RecursionError) as e:
        raise ArtifactError(f"{path}: not valid Python ({_one_line(e)})") from None


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
