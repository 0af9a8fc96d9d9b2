"""Damaged and hostile engine directories. Each kind of damage below is made to a fresh copy of one
compiled tiny engine; `Engine.load` and `ftc inspect --verify` must both refuse it with the same
one-line error, starting with the path of the file at fault, and must open, stat or list nothing
outside the engine directory on the way. Damage that the sha256 check would see is also made with
engine.json rewritten to match ("rematched"), so that the checks behind the hashes are reached.
Escapes point at bait: copies of the engine's own files beside it, which would pass every size and
hash check, so that only the confinement of paths can refuse them.

The random choices come from each test's seed (conftest's `seed`: shown when the test fails)."""

from __future__ import annotations

import ctypes
import json
import os
import random
import re
import shutil
import struct
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from typer.testing import CliRunner

from ftc.cli.main import app
from ftc.compile.ftw_writer import FtwWriter
from ftc.compile.pipeline import CompileOptions, compile_engine
from ftc_runtime import Engine
from ftc_runtime.artifact import ArtifactError, file_sha256
from ftc_runtime.formats.base import expert_shapes
from ftc_runtime.io.ftw import HEADER_ROOM, PREFIX, FtwError, FtwHeader, read_header
from ftc_runtime.spec import SpecError

from field_edits import DELETE, set_field

SPEC = Path(__file__).resolve().parents[1] / "model_specs" / "qwen3-moe-tiny.yaml"
USER_ERRORS = (ArtifactError, FtwError, SpecError)
M, EXPERTS, DENSE, TOKENIZER = "engine.json", "experts.ftw", "dense.safetensors", "tokenizer.json"
TEMPLATE, LIBRARY, TRITON = "chat_template.jinja", "lib/libftc_kernels.so", "kernels/expert_ffn_triton.py"
BAIT = (M, TOKENIZER, DENSE, TEMPLATE, LIBRARY)  # copied beside the engine, flat, under their base names


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    return compile_engine(CompileOptions(source=SPEC, target="cpu", random_weights=True, seed=5,
                                         output=tmp_path_factory.mktemp("damage") / "tiny"))


# -- watching for access outside the engine ---------------------------------------------------------------


class Inotify:
    """Opens and reads of the files in one directory (and listings of it) by any code of this
    process, the Rust and C libraries included, which Python's audit hook does not see."""

    EVENTS = 0x1 | 0x20  # IN_ACCESS | IN_OPEN

    def __init__(self, directory: Path):
        libc = ctypes.CDLL(None, use_errno=True)
        self.directory, self.fd = directory, libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, os.fsencode(directory), self.EVENTS) < 0:
            raise OSError(ctypes.get_errno(), f"inotify on {directory}")

    def close(self) -> list[str]:
        """What was touched since the watch began (struct inotify_event: wd, mask, cookie, len, name)."""
        touched = []
        try:
            while True:
                buf, at = os.read(self.fd, 1 << 16), 0
                while at < len(buf):
                    length = struct.unpack_from("iIII", buf, at)[3]
                    name = buf[at + 16:at + 16 + length].rstrip(b"\0").decode()
                    touched.append(f"{self.directory / name} (inotify)")
                    at += 16 + length
        except BlockingIOError:
            pass
        finally:
            os.close(self.fd)
        return touched


@dataclass
class Watch:
    """Paths under `watched` but not inside `inside` that were opened, listed, renamed, loaded
    (Python's audit events: open, os.*, shutil.*, ctypes.dlopen) or stat'ed (os.stat and os.lstat,
    which raise no audit event, are wrapped). A path is judged by where it leads: its real path, or
    for lstat, which does not follow a last symlink, its directory's real path and its name."""

    inside: str
    watched: tuple[str, ...]
    seen: list[str] = field(default_factory=list)

    def note(self, p: Any, follow: bool) -> None:
        if not isinstance(p, (str, bytes, os.PathLike)) or getattr(_local, "busy", False):
            return
        _local.busy = True  # realpath below stats too: not the code under watch
        try:
            path = os.path.abspath(os.fsdecode(p))
            real = os.path.realpath(path) if follow else os.path.join(os.path.realpath(os.path.dirname(path)),
                                                                      os.path.basename(path))
            if _under(real, self.watched) and not _under(real, (self.inside,)):
                self.seen.append(real)
        finally:
            _local.busy = False


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


_local = threading.local()
_active: list[Watch] = []


def _audit(event: str, args: tuple) -> None:
    if _active and (event in ("open", "ctypes.dlopen") or event.startswith(("os.", "shutil."))):
        for arg in args[:2] if event != "open" else args[:1]:  # paths come first (src, dst for renames)
            _active[-1].note(arg, follow=True)


sys.addaudithook(_audit)  # for the process's lifetime: hooks cannot be removed, this one idles when off


@contextmanager
def watching(inside: Path, watched: list[Path], bait: Path) -> Iterator[Watch]:
    watch = Watch(os.path.realpath(inside), tuple(os.path.realpath(w) for w in watched))
    inotify = Inotify(bait)
    stat, lstat = os.stat, os.lstat

    def watched_stat(p, *args, **kwargs):
        watch.note(p, kwargs.get("follow_symlinks", True))
        return stat(p, *args, **kwargs)

    def watched_lstat(p, *args, **kwargs):
        watch.note(p, False)
        return lstat(p, *args, **kwargs)

    os.stat, os.lstat = watched_stat, watched_lstat
    _active.append(watch)
    try:
        yield watch
    finally:
        _active.pop()
        os.stat, os.lstat = stat, lstat
        watch.seen += inotify.close()


# -- the damage ---------------------------------------------------------------------------------------------


@dataclass
class Damage:
    root: Path  # the engine copy to damage
    outside: Path  # the bait, beside it
    rng: random.Random
    watched: list[Path] = field(default_factory=list)  # beyond the case's directory (e.g. /etc/passwd)

    def manifest(self) -> dict:
        return json.loads((self.root / M).read_text())

    def save(self, m: dict) -> None:
        (self.root / M).write_text(json.dumps(m))

    def edit(self, change: Callable[[dict], Any]) -> str:
        m = self.manifest()
        change(m)
        self.save(m)
        return M

    def rematch(self, rel: str) -> None:
        """Records `rel`'s current size and sha256: damage that the hash check cannot see."""
        self.edit(lambda m: m["files"].__setitem__(rel, _meta(self.root / rel)))

    def rewrite(self, rel: str, data: bytes) -> str:
        (self.root / rel).write_bytes(data)
        self.rematch(rel)
        return rel

    def bait(self, rel: str) -> Path:
        return self.outside / Path(rel).name

    def add_entry(self, name: str, like: Path) -> str:
        """A `files` entry `name` whose size and sha256 are those of `like`."""
        return self.edit(lambda m: m["files"].__setitem__(name, _meta(like)))


def _meta(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}


DAMAGES: list[Callable[[Damage], str]] = []


def damage(make: Callable[[Damage], str]) -> Callable[[Damage], str]:
    """Registers a kind of damage: it damages `d.root` and returns the file (relative to the engine,
    '' for the directory itself) whose path must start the error message."""
    DAMAGES.append(make)
    return make


def _edit_field(keys: str | tuple[str, ...], value: Any) -> Callable[[Damage], str]:
    return lambda d: d.edit(lambda m: set_field(m, keys, value(d.rng) if callable(value) else value))


def _register_field_damage(name: str, keys: str | tuple[str, ...], value: Any) -> None:
    make = _edit_field(keys, value)
    make.__name__ = name
    damage(make)


# engine.json as a file
@damage
def json_truncated(d: Damage) -> str:
    text = (d.root / M).read_bytes()
    (d.root / M).write_bytes(text[:d.rng.randrange(1, len(text) - 1)])  # the closing brace is gone
    return M


@damage
def json_not_utf8(d: Damage) -> str:
    text = (d.root / M).read_bytes()
    at = d.rng.randrange(len(text))
    (d.root / M).write_bytes(text[:at] + b"\xff\xfe" + text[at:])
    return M


@damage
def json_nan_or_infinity(d: Damage) -> str:
    return d.edit(lambda m: set_field(m, d.rng.choice(["spec.norm.eps", "spec.rope.theta", "target.b_p"]),
                                 d.rng.choice([float("nan"), float("inf"), -float("inf")])))


@damage
def json_nested_too_deeply(d: Damage) -> str:
    depth = d.rng.randrange(10**4, 10**5)
    (d.root / M).write_text('{"format": "ftc-engine", "format_version": 1, "spec": ' + "[" * depth + "]" * depth + "}")
    return M


@damage
def json_integer_of_thousands_of_digits(d: Damage) -> str:
    text = json.dumps(d.manifest()).replace('"num_layers": 4', '"num_layers": ' + "9" * d.rng.randrange(5000, 20000))
    (d.root / M).write_text(text)
    return M


@damage
def json_larger_than_any_manifest(d: Damage) -> str:
    (d.root / M).write_text(json.dumps(d.manifest()) + " " * ((16 << 20) + d.rng.randrange(1, 1 << 20)))
    return M


@damage
def json_top_level_not_a_mapping(d: Damage) -> str:
    (d.root / M).write_text(json.dumps(d.rng.choice([[], "ftc-engine", 1, None, [d.manifest()]])))
    return M


@damage
def manifest_missing(d: Damage) -> str:
    (d.root / M).unlink()
    return ""


# engine.json fields: missing, mistyped, out of range
for _name, _dotted, _value in [
    ("format_missing", "format", DELETE), ("format_other", "format", "gguf"),
    ("format_version_a_string", "format_version", "1"), ("format_version_true", "format_version", True),
    ("spec_missing", "spec", DELETE), ("spec_a_string", "spec", "qwen3-moe-tiny"), ("spec_a_list", "spec", [4, 256]),
    ("spec_name_escapes_build", "spec.name", lambda rng: rng.choice(["../../x", "a/b", "..", "", "x\\y"])),
    ("spec_layers_a_string", "spec.num_layers", "4"), ("spec_eps_a_string", "spec.norm.eps", "1e-6"),
    ("spec_qk_norm_an_integer", "spec.attention.qk_norm", 1), ("spec_special_tokens_a_list", "spec.tokens.special", []),
    ("spec_attention_missing", "spec.attention", DELETE), ("spec_unknown_field", "spec.hidden", 256),
    ("plan_missing", "plan", DELETE), ("plan_chunk_a_string", "plan.gate_up_chunk", "16"),
    ("plan_chunk_zero", "plan.prefill_chunk", lambda rng: rng.choice([0, -1, -8192])),
    ("plan_buckets_not_a_list", "plan.batch_buckets", 4), ("plan_buckets_empty", "plan.batch_buckets", []),
    ("plan_threads_negative", "plan.cpu_threads", -2), ("plan_isa_unknown", "plan.isa", "avx9000"),
    ("target_missing", "target", DELETE), ("target_a_string", "target", "cpu"),
    ("target_without_name", "target.name", DELETE),
    ("target_rate_not_positive", "target.b_p", lambda rng: rng.choice([-1.0, 0, "fast", True, [1]])),
    ("target_rate_implausible", "target.b_h",
     lambda rng: rng.choice([rng.choice([0.07, rng.uniform(1e-6, 0.099)]), rng.uniform(1e4 + 1, 1e9)])),
    ("weights_source_a_number", "weights_source", 42), ("experts_in_memory_a_string", "experts_in_memory", "yes"),
    ("kernel_check_garbage", "kernel_check", lambda rng: rng.choice(["ok", [{"tokens": "four"}], [7], {}])),
    ("files_missing", "files", DELETE), ("files_a_list", "files", ["experts.ftw"]),
    ("files_entry_a_string", ("files", DENSE), "abc"),
    ("files_bytes_mistyped", ("files", TOKENIZER, "bytes"), lambda rng: rng.choice(["14374", -1, 1.5, True, None])),
    ("files_sha256_malformed", ("files", TOKENIZER, "sha256"), lambda rng: rng.choice(["xyz", 5, "A" * 64, None])),
]:
    _register_field_damage(_name, _dotted, _value)

# sizes beyond the spec's bounds (a 10^9-layer spec once exhausted memory)
for _dotted, _limit in [("num_layers", 1024), ("hidden_size", 65536), ("vocab_size", 1 << 22),
                        ("attention.num_heads", 1024), ("attention.num_kv_heads", 1024), ("attention.head_dim", 4096),
                        ("moe.num_experts", 4096), ("moe.top_k", 256), ("moe.expert_intermediate_size", 1 << 17),
                        ("max_position_embeddings", 1 << 24)]:
    _register_field_damage(f"spec_huge_{_dotted.replace('.', '_')}", f"spec.{_dotted}",
                           lambda rng, limit=_limit: rng.choice([limit + 1, 10**9, 10**rng.randrange(10, 40)]))


@damage
def files_required_entry_missing(d: Damage) -> str:
    return d.edit(lambda m: m["files"].pop(d.rng.choice([EXPERTS, DENSE, TOKENIZER, LIBRARY])))


@damage
def spec_of_other_shapes(d: Damage) -> str:
    """Valid sizes, but not the ones the files were written for."""
    d.edit(lambda m: set_field(m, d.rng.choice(["spec.hidden_size", "spec.moe.expert_intermediate_size"]), 512))
    return EXPERTS


# paths in `files` that leave the directory (each with the size and sha256 of its bait)
@damage
def path_to_the_parent(d: Damage) -> str:
    return d.add_entry(f"../outside/{TOKENIZER}", d.bait(TOKENIZER))


@damage
def path_far_up_to_a_system_file(d: Damage) -> str:
    d.watched.append(Path("/etc/passwd"))
    return d.add_entry("../" * d.rng.randrange(3, 30) + "etc/passwd", d.bait(TOKENIZER))


@damage
def path_absolute_to_the_bait(d: Damage) -> str:
    return d.add_entry(str(d.bait(DENSE)), d.bait(DENSE))


@damage
def path_absolute_to_a_system_file(d: Damage) -> str:
    d.watched.append(Path("/etc/passwd"))
    return d.add_entry("/etc/passwd", d.bait(TOKENIZER))


@damage
def path_through_a_subdirectory_and_up(d: Damage) -> str:
    return d.add_entry(f"kernels/../../outside/{TOKENIZER}", d.bait(TOKENIZER))


@damage
def path_replacing_a_required_entry(d: Damage) -> str:
    def swap(m: dict) -> None:
        m["files"].pop(LIBRARY)
        m["files"][f"lib/../../outside/{Path(LIBRARY).name}"] = _meta(d.bait(LIBRARY))
    return d.edit(swap)


@damage
def path_with_a_dot(d: Damage) -> str:
    return d.add_entry(f"./{TOKENIZER}", d.root / TOKENIZER)


@damage
def path_with_an_empty_part(d: Damage) -> str:
    return d.add_entry("kernels//expert_ffn_avx2.cpp", d.root / "kernels/expert_ffn_avx2.cpp")


@damage
def path_empty(d: Damage) -> str:
    return d.add_entry("", d.root / TOKENIZER)


@damage
def path_with_nul(d: Damage) -> str:
    return d.add_entry(f"{TOKENIZER}\0.txt", d.root / TOKENIZER)


@damage
def path_with_backslashes(d: Damage) -> str:
    return d.add_entry(f"..\\outside\\{TOKENIZER}", d.bait(TOKENIZER))


@damage
def path_longer_than_path_max(d: Damage) -> str:
    return d.add_entry("a/" * 3000 + "b", d.root / TOKENIZER)


# symlinks that leave the directory (the files listed are unchanged)
def _symlink(d: Damage, rel: str, target: str) -> str:
    path = d.root / rel
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    path.symlink_to(target)
    return rel


@damage
def symlink_file_to_the_bait(d: Damage) -> str:
    rel = d.rng.choice([TOKENIZER, DENSE, TEMPLATE, LIBRARY])
    return _symlink(d, rel, "../" * rel.count("/") + f"../outside/{Path(rel).name}")


@damage
def symlink_file_absolute(d: Damage) -> str:
    return _symlink(d, DENSE, str(d.bait(DENSE)))


@damage
def symlink_directory_out(d: Damage) -> str:
    _symlink(d, "lib", "../outside")
    return LIBRARY


@damage
def symlink_chain_inside_then_out(d: Damage) -> str:
    (d.root / "kernels" / "tok").symlink_to(f"../../outside/{TOKENIZER}")
    return _symlink(d, TOKENIZER, "kernels/tok")


@damage
def symlink_loop(d: Damage) -> str:
    return _symlink(d, TOKENIZER, d.rng.choice([TOKENIZER, f"./{TOKENIZER}", f"kernels/../{TOKENIZER}"]))


@damage
def symlink_manifest_out(d: Damage) -> str:
    _symlink(d, M, f"../outside/{M}")
    return M


# files that are not regular files, or are not there
@damage
def fifo_in_place_of_a_file(d: Damage) -> str:  # opened, it would block forever
    rel = d.rng.choice([TOKENIZER, DENSE, EXPERTS, M])
    (d.root / rel).unlink()
    os.mkfifo(d.root / rel)
    return rel


@damage
def directory_in_place_of_a_file(d: Damage) -> str:
    rel = d.rng.choice([TOKENIZER, DENSE, EXPERTS])
    (d.root / rel).unlink()
    (d.root / rel).mkdir()
    return rel


@damage
def listed_file_missing(d: Damage) -> str:
    rel = d.rng.choice(list(d.manifest()["files"]))
    (d.root / rel).unlink()
    return rel


# garbage behind matching hashes
@damage
def tokenizer_random_bytes(d: Damage) -> str:
    return d.rewrite(TOKENIZER, d.rng.randbytes(d.rng.randrange(0, 5000)))


@damage
def tokenizer_not_a_tokenizer(d: Damage) -> str:
    return d.rewrite(TOKENIZER, json.dumps(d.rng.choice([{"a": 1}, [], "tok", {"model": None}])).encode())


@damage
def tokenizer_truncated(d: Damage) -> str:
    data = (d.root / TOKENIZER).read_bytes()
    return d.rewrite(TOKENIZER, data[:d.rng.randrange(len(data) - 2)])


@damage
def tokenizer_not_utf8(d: Damage) -> str:
    data = (d.root / TOKENIZER).read_bytes()
    at = d.rng.randrange(len(data))
    return d.rewrite(TOKENIZER, data[:at] + b"\xc3\x28" + data[at:])


@damage
def dense_random_bytes(d: Damage) -> str:
    return d.rewrite(DENSE, d.rng.randbytes(d.rng.randrange(0, 5000)))


@damage
def dense_truncated(d: Damage) -> str:
    data = (d.root / DENSE).read_bytes()
    return d.rewrite(DENSE, data[:d.rng.randrange(len(data) - 1)])


def _resave_dense(d: Damage, change: Callable[[dict[str, torch.Tensor], str], None]) -> str:
    tensors = load_file(str(d.root / DENSE))
    change(tensors, d.rng.choice(sorted(tensors)))
    save_file(tensors, str(d.root / DENSE), metadata={"format": "pt"})
    d.rematch(DENSE)
    return DENSE


@damage
def dense_tensor_missing(d: Damage) -> str:
    return _resave_dense(d, lambda t, name: t.pop(name))


@damage
def dense_tensor_of_another_shape(d: Damage) -> str:
    return _resave_dense(d, lambda t, name: t.__setitem__(name, t[name][:-1].contiguous()))


@damage
def dense_tensor_of_another_dtype(d: Damage) -> str:
    dtype = d.rng.choice([torch.float32, torch.float16, torch.int16])
    return _resave_dense(d, lambda t, name: t.__setitem__(name, t[name].to(dtype)))


@damage
def chat_template_not_utf8(d: Damage) -> str:
    return d.rewrite(TEMPLATE, b"{{ messages }}\xff\xfe")


@damage
def chat_template_syntax_error(d: Damage) -> str:
    return d.rewrite(TEMPLATE, d.rng.choice([b"{% for m in %}", b"{{ messages ", b"{% if x %}no end"]))


@damage
def library_random_bytes(d: Damage) -> str:
    return d.rewrite(LIBRARY, d.rng.choice([b"", b"\x7fELF", d.rng.randbytes(4096)]))


@damage
def library_truncated(d: Damage) -> str:  # loaded, it would die of SIGBUS
    data = (d.root / LIBRARY).read_bytes()
    return d.rewrite(LIBRARY, data[:d.rng.randrange(64, len(data) - 1)])


@damage
def triton_source_not_python(d: Damage) -> str:
    return d.rewrite(TRITON, d.rng.choice([b"def (:\n", b"\xff\xfe\x00", b"x = (" * 200]))


# the expert file
def _ftw(d: Damage) -> bytes:
    return (d.root / EXPERTS).read_bytes()


def _with_header_body(d: Damage, body: bytes) -> bytes:
    data, room = _ftw(d), HEADER_ROOM - PREFIX.size
    return data[:PREFIX.size] + body + b" " * (room - len(body)) + data[HEADER_ROOM:]


@damage
def experts_truncated(d: Damage) -> str:
    data = _ftw(d)
    (d.root / EXPERTS).write_bytes(data[:d.rng.randrange(1, len(data))])
    return EXPERTS


@damage
def experts_truncated_rematched(d: Damage) -> str:
    data = _ftw(d)
    return d.rewrite(EXPERTS, data[:d.rng.randrange(1, len(data))])


@damage
def experts_magic_rematched(d: Damage) -> str:
    return d.rewrite(EXPERTS, d.rng.choice([b"GGUF", b"FTW2", b"\0\0\0\0"]) + _ftw(d)[4:])


@damage
def experts_header_garbage_rematched(d: Damage) -> str:
    data = bytearray(_ftw(d))
    at = d.rng.randrange(PREFIX.size, 200)
    data[at:at + 8] = b"\xff" + d.rng.randbytes(7)
    return d.rewrite(EXPERTS, bytes(data))


@damage
def experts_header_of_huge_counts_rematched(d: Damage) -> str:
    header, _ = read_header(d.root / EXPERTS)
    huge = FtwHeader.create(header.expert_format, header.num_moe_layers * 10**d.rng.randrange(3, 12),
                            header.num_experts, header.hidden, header.intermediate)
    return d.rewrite(EXPERTS, huge.encode() + _ftw(d)[HEADER_ROOM:])


@damage
def experts_header_of_negative_counts_rematched(d: Damage) -> str:
    body = _ftw(d)[PREFIX.size:HEADER_ROOM].rstrip()
    key = d.rng.choice([b'"num_moe_layers":', b'"num_experts":'])
    return d.rewrite(EXPERTS, _with_header_body(d, body.replace(key, key + b"-", 1)))


@damage
def experts_header_nested_too_deeply_rematched(d: Damage) -> str:
    return d.rewrite(EXPERTS, _with_header_body(d, b"[" * d.rng.randrange(2000, 4000)))


@damage
def experts_row_flipped_rematched(d: Damage) -> str:
    header, _ = read_header(d.root / EXPERTS)
    bank = d.rng.choice(header.banks)
    at = (header.data_offset + d.rng.randrange(header.num_rows) * header.expert_stride + bank.offset
          + d.rng.randrange(bank.row_bytes))
    data = bytearray(_ftw(d))
    data[at] ^= 1 << d.rng.randrange(8)
    return d.rewrite(EXPERTS, bytes(data))


@damage
def experts_trailer_garbage_rematched(d: Damage) -> str:
    header, _ = read_header(d.root / EXPERTS)
    return d.rewrite(EXPERTS, _ftw(d)[:header.trailer_offset] + d.rng.choice([b"{}", b"[", b'{"down": 5}',
                                                                              d.rng.randbytes(900)]))


@damage
def experts_trailer_oversized_rematched(d: Damage) -> str:
    return d.rewrite(EXPERTS, _ftw(d) + b" " * d.rng.randrange(1 << 16, 1 << 20))


@damage
def experts_of_other_shapes_rematched(d: Damage) -> str:
    """A complete, self-consistent FTW file for experts of another intermediate size."""
    header, _ = read_header(d.root / EXPERTS)
    other = FtwHeader.create(header.expert_format, header.num_moe_layers, header.num_experts, 256, 64)
    writer = FtwWriter(d.root / EXPERTS, other)
    for _ in range(other.num_rows):
        writer.append({name: torch.zeros(shape) for name, shape in expert_shapes(256, 64).items()})
    writer.close()
    d.rematch(EXPERTS)
    return EXPERTS


# -- the tests --------------------------------------------------------------------------------------------


def _copy(engine: Path, tmp_path: Path, rng: random.Random) -> Damage:
    root = Path(shutil.copytree(engine, tmp_path / "engine", symlinks=True))
    outside = tmp_path / "outside"
    outside.mkdir()
    for rel in BAIT:
        shutil.copyfile(engine / rel, outside / Path(rel).name)
    return Damage(root, outside, rng)


def _watch(d: Damage, tmp_path: Path):
    return watching(d.root, [tmp_path, *d.watched], d.outside)


def _inspect(d: Damage, tmp_path: Path, *flags: str) -> tuple[Any, list[str]]:
    with _watch(d, tmp_path) as watch:
        result = CliRunner().invoke(app, ["inspect", str(d.root), *flags])
    return result, watch.seen


def test_damage_kinds_are_many():
    assert len(DAMAGES) >= 40 and len({f.__name__ for f in DAMAGES}) == len(DAMAGES)


@pytest.mark.parametrize("make", DAMAGES, ids=lambda f: f.__name__)
def test_damage_is_refused_in_one_line_naming_the_file(make, engine, tmp_path, seed):
    d = _copy(engine, tmp_path, random.Random(seed))
    expected = str(d.root / make(d)).rstrip("/")
    with _watch(d, tmp_path) as watch, pytest.raises(USER_ERRORS) as info:
        Engine.load(d.root)
    message = str(info.value)
    assert message.startswith(expected + ": ") and "\n" not in message, message
    assert not watch.seen, f"touched outside the engine: {watch.seen}"

    result, seen = _inspect(d, tmp_path, "--verify")
    assert not seen, f"inspect --verify touched outside the engine: {seen}"
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, result.output
    assert result.stderr == f"error: {message}\n"  # the same checks, the same first fault

    result, seen = _inspect(d, tmp_path)  # without --verify it reads engine.json (and no more)
    assert not seen, f"inspect touched outside the engine: {seen}"
    assert result.exit_code in (0, 1) and "Traceback" not in result.output
    assert result.exit_code == 0 or result.stderr.startswith(f"error: {d.root}")


def test_an_undamaged_copy_loads_and_verifies_touching_nothing_outside(engine, tmp_path, seed):
    d = _copy(engine, tmp_path, random.Random(seed))
    with _watch(d, tmp_path) as watch:
        assert Engine.load(d.root).logits([1, 2, 3]).shape == (3, 512)
    assert not watch.seen, watch.seen
    result, seen = _inspect(d, tmp_path, "--verify")
    assert result.exit_code == 0 and not seen, (result.output, seen)


def test_symlinks_that_stay_inside_are_followed(engine, tmp_path, seed):
    d = _copy(engine, tmp_path, random.Random(seed))
    (d.root / TOKENIZER).rename(d.root / "kernels" / "tok.json")
    (d.root / "kernels" / "link").symlink_to("tok.json")
    (d.root / TOKENIZER).symlink_to("kernels/../kernels/link")
    assert Engine.load(d.root).tokenizer.vocab_size > 0
    assert _inspect(d, tmp_path, "--verify")[0].exit_code == 0


def _read(path: Path) -> None:
    path.read_bytes()


@pytest.mark.parametrize("access", [
    lambda d: _read(d.bait(TOKENIZER)),
    lambda d: _read(d.root / ".." / "outside" / TOKENIZER),
    lambda d: file_sha256(d.root / TOKENIZER),  # a symlink to the bait: where it leads counts
    lambda d: os.stat(d.bait(DENSE)),
    lambda d: d.bait(DENSE).is_file(),
    lambda d: os.listdir(d.outside),
    lambda d: HFTokenizer.from_file(str(d.bait(TOKENIZER))),  # Rust: only inotify sees it
    lambda d: ctypes.CDLL(str(d.bait(LIBRARY))),
], ids=["read", "read_dotdot", "read_through_symlink", "stat", "is_file", "listdir", "rust_open", "dlopen"])
def test_the_watch_sees_access_outside(access, engine, tmp_path, seed):
    """The check above can fail: each of these touches the bait and is seen."""
    d = _copy(engine, tmp_path, random.Random(seed))
    _symlink(d, TOKENIZER, f"../outside/{TOKENIZER}")
    with _watch(d, tmp_path) as watch:
        access(d)
    assert watch.seen


def test_the_watch_ignores_what_does_not_leave(engine, tmp_path, seed):
    d = _copy(engine, tmp_path, random.Random(seed))
    _symlink(d, TOKENIZER, f"../outside/{TOKENIZER}")
    with _watch(d, tmp_path) as watch:
        os.lstat(d.root / TOKENIZER), os.readlink(d.root / TOKENIZER), _read(d.root / DENSE)
    assert not watch.seen, watch.seen


def test_ftc_run_prints_one_error_line(engine, tmp_path, seed):
    """`ftc run` on a damaged engine (one kind, at random): one error line, exit status 1."""
    rng = random.Random(seed)
    make = rng.choice(DAMAGES)
    d = _copy(engine, tmp_path, rng)
    expected = str(d.root / make(d)).rstrip("/")
    result = CliRunner().invoke(app, ["run", str(d.root), "--prompt-ids", "1,2"])
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, (make.__name__, result.output)
    assert result.stderr.startswith(f"error: {expected}: ") and result.stderr.count("\n") == 1, result.stderr


# -- ftc compile -o ---------------------------------------------------------------------------------------------


def _compile(out: Path, force: bool = False) -> Path:
    return compile_engine(CompileOptions(source=SPEC, target="cpu", random_weights=True, seed=6, output=out,
                                         force=force))


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("kind", ["directory", "file", "symlink", "damaged_engine"])
def test_compile_never_deletes_what_is_not_an_engine(kind, force, engine, tmp_path):
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("notes")
    elif kind == "symlink":
        shutil.copytree(engine, tmp_path / "elsewhere")
        out.symlink_to(tmp_path / "elsewhere")
    else:
        (out / "src").mkdir(parents=True)
        (out / "src" / "main.py").write_text("print('mine')")
        (out / M).write_text('{"format": "ftc-engin' if kind == "damaged_engine" else "{}")
    before = _tree(tmp_path)
    with pytest.raises(FileExistsError, match=f"{re.escape(str(out))} exists and is not an ftc engine.*another -o"):
        _compile(out, force)
    assert _tree(tmp_path) == before and out.is_symlink() == (kind == "symlink")


def test_compile_replaces_an_engine_only_with_force(engine, tmp_path):
    out = Path(shutil.copytree(engine, tmp_path / "out"))
    before = _tree(out)
    with pytest.raises(FileExistsError, match=f"{re.escape(str(out))} holds an engine: pass --force to replace"):
        _compile(out)
    assert _tree(out) == before
    # What a user keeps at the names the compiler once used for its staging and old directories stays.
    for kept in (".out.partial", ".out.old"):
        (tmp_path / kept).mkdir()
        (tmp_path / kept / "keep.txt").write_text(kept)
    _compile(out, force=True)
    assert "random weights (seed 6)" in json.loads((out / M).read_text())["weights_source"]
    assert Engine.load(out).logits([1]).shape == (1, 512)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.old", ".out.partial", "out"]
    assert all((tmp_path / kept / "keep.txt").read_text() == kept for kept in (".out.partial", ".out.old"))


def test_compile_into_an_empty_directory(tmp_path):
    (tmp_path / "out").mkdir()
    assert (_compile(tmp_path / "out") / M).is_file()
