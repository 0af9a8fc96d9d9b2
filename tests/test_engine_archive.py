"""An engine as one tar file: the writer is reproducible, and the unpacker takes only what engine.json
promises, refusing every unsafe or unexpected member with a one-line error and leaving nothing behind."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import shutil
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ftc_runtime.io.engine_archive import (
    CHUNK,
    MANIFEST,
    MANIFEST_LIMIT,
    MARKER,
    ArchiveError,
    unpack_archive,
    write_archive,
)


@dataclass
class FakeEngine:
    root: Path
    files: dict[str, bytes]  # relative path → contents, in the manifest's order
    manifest: bytes  # engine.json's bytes


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _manifest(files: dict[str, bytes]) -> bytes:
    table = {name: {"bytes": len(data), "sha256": _sha256(data)} for name, data in files.items()}
    return json.dumps({"format_version": 1, "files": table}, indent=1).encode()


@pytest.fixture
def engine(tmp_path: Path, seed: int) -> FakeEngine:
    rng = random.Random(seed)
    files = {
        "dense.safetensors": rng.randbytes(rng.randrange(1, 5000) | 1),  # odd: its data ends inside a block
        "lib/libftc_kernels.so": rng.randbytes(rng.randrange(1, 5000)),
        "experts-00001-of-00002.ftw": rng.randbytes(rng.randrange(CHUNK + 1, 3 * CHUNK)),  # several chunks
        "experts-00002-of-00002.ftw": rng.randbytes(rng.randrange(1, 5000)),
        "kernels/empty.txt": b"",
    }
    root = tmp_path / "engine"
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    manifest = _manifest(files)
    (root / MANIFEST).write_bytes(manifest)
    return FakeEngine(root, files, manifest)


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def private_umask() -> Iterator[None]:
    """A umask under which files would be created 0o600 unless their mode is set."""
    previous = os.umask(0o077)
    yield
    os.umask(previous)


def _assert_unpacked(folder: Path, engine: FakeEngine) -> None:
    assert folder.name == _sha256(engine.manifest)
    assert folder.stat().st_mode & 0o7777 == 0o755
    assert (folder / MANIFEST).read_bytes() == engine.manifest
    assert (folder / MARKER).is_file()
    found = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert found == {*engine.files, MANIFEST, MARKER}
    for name, data in engine.files.items():
        assert (folder / name).read_bytes() == data, name
        assert (folder / name).stat().st_mode & 0o7777 == 0o644, name


# Archives built by hand, header by header, so that any member can be malformed.

def _member(info: tarfile.TarInfo, data: bytes = b"") -> bytes:
    block = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape") + data
    return block + bytes(-len(block) % tarfile.BLOCKSIZE)


def _regular(name: str, data: bytes, size: int | None = None) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = len(data) if size is None else size
    return _member(info, data)


def _special(name: str, kind: bytes, linkname: str = "") -> bytes:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    return _member(info)


def _good_members(engine: FakeEngine, skip: str | None = None) -> list[bytes]:
    return [_regular(MANIFEST, engine.manifest),
            *(_regular(name, data) for name, data in engine.files.items() if name != skip)]


def _archive(path: Path, members: list[bytes]) -> Path:
    path.write_bytes(b"".join(members) + bytes(2 * tarfile.BLOCKSIZE))
    return path


def _refused(archive: Path, cache: Path, *expected: str) -> str:
    """unpack_archive's one-line refusal, which must hold `expected`; nothing may be left in `cache`."""
    with pytest.raises(ArchiveError) as refusal:
        unpack_archive(archive, cache)
    message = str(refusal.value)
    assert message.startswith(f"{archive}: ") and "\n" not in message
    for text in expected:
        assert text in message
    assert not cache.exists() or list(cache.iterdir()) == []
    return message


def test_round_trip(engine: FakeEngine, tmp_path: Path, cache: Path):
    archive = tmp_path / "engine.tar"
    copied: list[int] = []
    write_archive(engine.root, archive, on_bytes=copied.append)
    assert sum(copied) == len(engine.manifest) + sum(map(len, engine.files.values()))
    assert len(copied) > len(engine.files) and max(copied) <= CHUNK  # streamed in chunks
    with tarfile.open(archive) as tar:
        assert tar.getnames() == [MANIFEST, *engine.files]
    folder = unpack_archive(archive, cache)
    assert folder.parent == cache
    _assert_unpacked(folder, engine)


def test_second_unpack_reuses_the_folder_reading_only_engine_json(engine: FakeEngine, tmp_path: Path, cache: Path):
    archive = tmp_path / "engine.tar"
    write_archive(engine.root, archive)
    folder = unpack_archive(archive, cache)
    with tarfile.open(archive) as tar:
        second = tar.getmembers()[1].offset
    archive.write_bytes(archive.read_bytes()[:second])  # only engine.json is left
    assert unpack_archive(archive, cache) == folder
    _assert_unpacked(folder, engine)


def test_write_archive_is_reproducible(engine: FakeEngine, tmp_path: Path, seed: int):
    rng = random.Random(seed)
    other = Path(shutil.copytree(engine.root, tmp_path / "elsewhere" / "engine"))
    for path in other.rglob("*"):
        if path.is_file():
            path.chmod(rng.choice([0o600, 0o755, 0o640]))
            os.utime(path, (rng.randrange(2**31), rng.randrange(2**31)))
    write_archive(engine.root, tmp_path / "a.tar")
    write_archive(other, tmp_path / "b.tar")
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()
    assert (tmp_path / "a.tar").stat().st_mode & 0o777 == 0o644
    with tarfile.open(tmp_path / "b.tar") as tar:
        for m in tar.getmembers():
            header = (m.type, m.mode, m.mtime, m.uid, m.gid, m.uname, m.gname)
            assert header == (tarfile.REGTYPE, 0o644, 0, 0, 0, "", ""), m.name


@pytest.mark.parametrize("damage", ["content", "size"])
def test_write_archive_refuses_a_file_that_differs_from_engine_json(engine: FakeEngine, tmp_path: Path, seed: int,
                                                                      damage: str):
    rng = random.Random(seed)
    name = rng.choice([n for n, data in engine.files.items() if data])
    data = bytearray(engine.files[name])
    if damage == "content":
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    else:
        data += b"\0"
    (engine.root / name).write_bytes(bytes(data))
    out = tmp_path / "out" / "engine.tar"
    out.parent.mkdir()
    with pytest.raises(ArchiveError, match="sha256 differs" if damage == "content" else "bytes, engine.json says") as e:
        write_archive(engine.root, out)
    assert str(e.value).startswith(f"{out}: ") and repr(name) in str(e.value)
    assert list(out.parent.iterdir()) == []  # neither the archive nor its temporary file


def test_write_archive_refuses_an_engine_json_too_large_to_unpack(engine: FakeEngine, tmp_path: Path):
    (engine.root / MANIFEST).write_bytes(engine.manifest[:-1] + b" " * MANIFEST_LIMIT + b"}")  # still valid JSON
    out = tmp_path / "engine.tar"
    with pytest.raises(ArchiveError, match="larger than") as e:
        write_archive(engine.root, out)
    assert str(e.value).startswith(f"{out}: ") and MANIFEST in str(e.value)
    assert not out.exists()


@pytest.mark.usefixtures("private_umask")
def test_hand_built_archive_with_directories_and_odd_modes_unpacks(engine: FakeEngine, tmp_path: Path, cache: Path):
    members = _good_members(engine, skip="lib/libftc_kernels.so")
    folder_entry = tarfile.TarInfo("lib")
    folder_entry.type = tarfile.DIRTYPE
    odd = tarfile.TarInfo("lib/libftc_kernels.so")
    odd.size, odd.mode, odd.uid, odd.uname = len(engine.files[odd.name]), 0o6777, 4321, "someone"
    members += [_member(folder_entry), _member(odd, engine.files[odd.name])]
    _assert_unpacked(unpack_archive(_archive(tmp_path / "a.tar", members), cache), engine)


@pytest.mark.parametrize(("name", "fault"), [
    ("/etc/evil", "absolute path"),
    ("/dense.safetensors", "absolute path"),
    ("../evil", "has a '..' path part"),
    ("lib/../../evil", "has a '..' path part"),
    ("./dense.safetensors", "has a '.' path part"),
    ("lib//libftc_kernels.so", "has an empty path part"),
    ("lib\\libftc_kernels.so", "backslash"),
], ids=["absolute", "absolute-listed", "dotdot", "dotdot-inside", "dot", "empty-part", "backslash"])
def test_unsafe_member_path_is_refused(engine: FakeEngine, tmp_path: Path, cache: Path, name: str, fault: str):
    archive = _archive(tmp_path / "a.tar", [*_good_members(engine), _regular(name, b"evil")])
    _refused(archive, cache, repr(name), fault)


@pytest.mark.parametrize(("kind", "linkname", "word"), [
    (tarfile.SYMTYPE, "/etc/passwd", "symbolic link"),
    (tarfile.LNKTYPE, "dense.safetensors", "hard link"),
    (tarfile.CHRTYPE, "", "character device"),
    (tarfile.BLKTYPE, "", "block device"),
    (tarfile.FIFOTYPE, "", "FIFO"),
    (tarfile.CONTTYPE, "", "of tar type b'7'"),
    (tarfile.GNUTYPE_SPARSE, "", "sparse file"),
], ids=["symlink", "hardlink", "chardev", "blockdev", "fifo", "contiguous", "gnu-sparse"])
def test_non_regular_member_is_refused(engine: FakeEngine, tmp_path: Path, cache: Path, kind: bytes, linkname: str,
                                       word: str):
    # Named as a listed file, standing in for it: only its type is wrong.
    name = "lib/libftc_kernels.so"
    archive = _archive(tmp_path / "a.tar", [*_good_members(engine, skip=name), _special(name, kind, linkname)])
    _refused(archive, cache, repr(name), word)


def test_pax_sparse_member_is_refused(engine: FakeEngine, tmp_path: Path, cache: Path):
    name, data = "dense.safetensors", engine.files["dense.safetensors"]
    info = tarfile.TarInfo(name)
    info.size, info.pax_headers = len(data), {"GNU.sparse.map": f"0,{len(data)}", "GNU.sparse.size": str(len(data))}
    archive = _archive(tmp_path / "a.tar", [*_good_members(engine, skip=name), _member(info, data)])
    _refused(archive, cache, repr(name), "sparse file")


@pytest.mark.parametrize("name", ["dense.safetensors", MANIFEST])
def test_duplicate_member_is_refused(engine: FakeEngine, tmp_path: Path, cache: Path, name: str):
    data = engine.manifest if name == MANIFEST else engine.files[name]
    archive = _archive(tmp_path / "a.tar", [*_good_members(engine), _regular(name, data)])
    _refused(archive, cache, repr(name), "appears twice")


def test_member_not_in_engine_json_is_refused(engine: FakeEngine, tmp_path: Path, cache: Path):
    archive = _archive(tmp_path / "a.tar", [*_good_members(engine), _regular("extra.bin", b"extra")])
    _refused(archive, cache, "'extra.bin'", "not listed in engine.json")


def test_member_larger_than_engine_json_says_is_refused_before_copying(engine: FakeEngine, tmp_path: Path,
                                                                        cache: Path):
    # The header claims a terabyte more than the manifest; copying first would end in "truncated" instead.
    name, data = "dense.safetensors", engine.files["dense.safetensors"]
    claimed = len(data) + 10**12
    archive = _archive(tmp_path / "a.tar", [*_good_members(engine, skip=name), _regular(name, data, claimed)])
    _refused(archive, cache, repr(name), f"is {claimed} bytes, engine.json says {len(data)}")


def test_member_with_other_content_is_refused(engine: FakeEngine, tmp_path: Path, cache: Path, seed: int):
    rng = random.Random(seed)
    name = rng.choice([n for n, data in engine.files.items() if data])
    data = bytearray(engine.files[name])
    data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    archive = _archive(tmp_path / "a.tar", [*_good_members(engine, skip=name), _regular(name, bytes(data))])
    _refused(archive, cache, repr(name), "sha256 differs from engine.json's")


def test_missing_member_is_refused(engine: FakeEngine, tmp_path: Path, cache: Path, seed: int):
    name = random.Random(seed).choice(list(engine.files))
    archive = _archive(tmp_path / "a.tar", _good_members(engine, skip=name))
    _refused(archive, cache, repr(name), "is missing")


@pytest.mark.parametrize("first", ["other-file", "symlink", "directory", "nothing"])
def test_first_member_must_be_engine_json(engine: FakeEngine, tmp_path: Path, cache: Path, first: str):
    members, named = {
        "other-file": (_good_members(engine)[1:2] + _good_members(engine), "'dense.safetensors' (a regular file)"),
        "symlink": ([_special(MANIFEST, tarfile.SYMTYPE, "/etc/passwd"), *_good_members(engine)[1:]],
                    f"{MANIFEST!r} (a symbolic link)"),
        "directory": ([_special("lib", tarfile.DIRTYPE), *_good_members(engine)], "'lib' (a directory)"),
        "nothing": ([], "no members"),
    }[first]
    _refused(_archive(tmp_path / "a.tar", members), cache, named, repr(MANIFEST))


def test_engine_json_larger_than_the_limit_is_refused(tmp_path: Path, cache: Path):
    manifest = b'{"files": {}, "padding": "' + b"x" * MANIFEST_LIMIT + b'"}'
    _refused(_archive(tmp_path / "a.tar", [_regular(MANIFEST, manifest)]), cache, repr(MANIFEST), "more than")


@pytest.mark.parametrize("fault", ["cut", "not-text", "too-deep"])
def test_engine_json_that_is_not_json_is_refused(engine: FakeEngine, tmp_path: Path, cache: Path, fault: str):
    manifest = {"cut": engine.manifest[:-1], "not-text": b"\xff\xfe{", "too-deep": b"[" * 10**6}[fault]
    members = [_regular(MANIFEST, manifest), *_good_members(engine)[1:]]
    _refused(_archive(tmp_path / "a.tar", members), cache, repr(MANIFEST), "not valid JSON")


@pytest.mark.parametrize(("files", "expected"), [
    (None, "no 'files' table"),
    ([], "no 'files' table"),
    ({"a.bin": {"bytes": -1, "sha256": "0" * 64}}, "'bytes' is -1"),
    ({"a.bin": {"bytes": True, "sha256": "0" * 64}}, "'bytes' is True"),
    ({"a.bin": {"bytes": 1, "sha256": "A" * 64}}, "'sha256' is"),
    ({"a.bin": {"bytes": 1}}, "'sha256' is None"),
    ({"../a.bin": {"bytes": 1, "sha256": "0" * 64}}, "'../a.bin' has a '..' path part"),
    ({MANIFEST: {"bytes": 1, "sha256": "0" * 64}}, f"{MANIFEST!r} is reserved"),
    ({MARKER: {"bytes": 1, "sha256": "0" * 64}}, f"{MARKER!r} is reserved"),
    ({"lib": {"bytes": 1, "sha256": "0" * 64}, "lib/a.so": {"bytes": 1, "sha256": "0" * 64}},
     "'lib' is also the folder of another entry"),
], ids=["no-files", "files-not-mapping", "negative", "bool", "uppercase-sha", "no-sha", "unsafe-name", "manifest",
        "marker", "file-and-folder"])
def test_bad_files_table_is_refused(tmp_path: Path, cache: Path, files: object, expected: str):
    manifest = json.dumps({} if files is None else {"files": files}).encode()
    _refused(_archive(tmp_path / "a.tar", [_regular(MANIFEST, manifest)]), cache, repr(MANIFEST), expected)


def test_truncated_archive_is_refused(engine: FakeEngine, tmp_path: Path, cache: Path, seed: int):
    rng = random.Random(seed)
    archive = tmp_path / "engine.tar"
    write_archive(engine.root, archive)
    with tarfile.open(archive) as tar:
        member = rng.choice([m for m in tar.getmembers() if m.name != MANIFEST and m.size])
    archive.write_bytes(archive.read_bytes()[:member.offset_data + rng.randrange(1, member.size)])
    _refused(archive, cache, repr(member.name), "truncated")


def test_archive_cut_between_members_is_refused(engine: FakeEngine, tmp_path: Path, cache: Path, seed: int):
    # All of a member's data is there but not the rest of its last block: tarfile fails reading the next header.
    archive = tmp_path / "engine.tar"
    write_archive(engine.root, archive)
    with tarfile.open(archive) as tar:
        member = tar.getmember("dense.safetensors")
    end = member.offset_data + member.size
    archive.write_bytes(archive.read_bytes()[:end + random.Random(seed).randrange(-end % tarfile.BLOCKSIZE)])
    _refused(archive, cache, f"after member {member.name!r}", "truncated")


def test_compressed_archive_is_refused(engine: FakeEngine, tmp_path: Path, cache: Path):
    archive = tmp_path / "engine.tar"
    write_archive(engine.root, archive)
    compressed = tmp_path / "engine.tar.gz"
    compressed.write_bytes(gzip.compress(archive.read_bytes()))
    _refused(compressed, cache, "not an uncompressed tar archive")


def test_folder_published_meanwhile_by_another_unpack_is_used(engine: FakeEngine, tmp_path: Path, cache: Path,
                                                             monkeypatch: pytest.MonkeyPatch):
    archive = tmp_path / "engine.tar"
    write_archive(engine.root, archive)
    real_mkdtemp, theirs = tempfile.mkdtemp, []

    def mkdtemp_while_another_finishes(*args, **kwargs) -> str:
        ours = real_mkdtemp(*args, **kwargs)
        monkeypatch.setattr(tempfile, "mkdtemp", real_mkdtemp)
        theirs.append(unpack_archive(archive, cache))  # completes before ours gets to rename
        return ours

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp_while_another_finishes)
    folder = unpack_archive(archive, cache)
    assert theirs == [folder]
    assert [p.name for p in cache.iterdir()] == [folder.name]  # our temporary folder is gone
    _assert_unpacked(folder, engine)
