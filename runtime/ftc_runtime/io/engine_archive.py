"""An engine folder as one uncompressed tar file, and the safe unpacking of such a file.

Engines are shared as a single file: a POSIX (PAX) tar holding `engine.json` first, then every
file its `files` table lists, in the table's order. No compression: the weights do not compress,
and a plain tar streams at disk speed and can be verified while it is read.

The writer is reproducible (fixed mode, mtime, owner), so one engine always gives the same bytes.

The reader treats the archive as untrusted input. It never lets `tarfile` extract anything: it
streams the members itself and accepts only regular files whose safe relative path, size and
sha256 match the leading engine.json (directory members are skipped, every other kind is refused),
so nothing can land outside the unpacked folder or differ from what the manifest promises. The
folder is named after the sha256 of engine.json's bytes, is assembled in a temporary folder beside
it and renamed into place complete, with a `.unpacked` marker: a folder under that name is always
whole, and a second unpack of the same engine reuses it after reading only engine.json.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path, PurePosixPath
from typing import BinaryIO

MANIFEST = "engine.json"
MARKER = ".unpacked"  # written last into an unpacked folder: its presence means the folder is complete
MANIFEST_LIMIT = 16 << 20  # engine.json is read whole into memory: bound what an archive can make us hold
CHUNK = 1 << 20
FILE_MODE = 0o644
FOLDER_MODE = 0o755
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KINDS = {tarfile.DIRTYPE: "a directory", tarfile.SYMTYPE: "a symbolic link", tarfile.LNKTYPE: "a hard link",
          tarfile.CHRTYPE: "a character device", tarfile.BLKTYPE: "a block device", tarfile.FIFOTYPE: "a FIFO"}


class ArchiveError(ValueError):
    """An engine archive (or the engine being archived) is refused; the one-line message starts with
    the archive's path and names the member at fault."""


def write_archive(engine_dir: Path, out: Path, on_bytes: Callable[[int], None] | None = None) -> None:
    """Writes the uncompressed PAX tar `out` of `engine_dir`: engine.json first, then every file of
    its `files` table in the table's order, as regular members (mode 0o644, mtime 0, owner 0 with
    empty names) so that the archive is reproducible. Each file is streamed in chunks and held to the
    manifest's size and sha256, so a damaged engine is not archived. `out` appears only complete: the
    tar is written beside it and renamed. `on_bytes(n)` is called for every chunk copied; the calls
    add up to engine.json's size plus the sizes in its `files` table."""
    engine_dir, out = Path(engine_dir), Path(out)
    with open(engine_dir / MANIFEST, "rb") as f:
        raw = f.read(MANIFEST_LIMIT + 1)
    where = f"{out}: {engine_dir / MANIFEST}"
    if len(raw) > MANIFEST_LIMIT:
        raise ArchiveError(f"{where}: larger than the {MANIFEST_LIMIT} bytes an archive's engine.json may have")
    files = _parse_manifest(raw, where)
    fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".partial")
    tmp = Path(name)
    try:
        with open(fd, "wb") as f:
            with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT, copybufsize=CHUNK) as tar:
                tar.addfile(_tar_member(MANIFEST, len(raw)), _Tap(io.BytesIO(raw), on_bytes))
                for rel, (size, sha) in files.items():
                    _add_file(tar, engine_dir, rel, size, sha, on_bytes, str(out))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)  # mkstemp's 0o600 would keep a file that is meant to be shared private
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class _Tap:
    """A file as `tarfile` reads it, hashing its bytes and reporting their count on the way."""

    def __init__(self, src: BinaryIO, on_bytes: Callable[[int], None] | None) -> None:
        self.src, self.on_bytes, self.digest = src, on_bytes, hashlib.sha256()

    def read(self, n: int) -> bytes:
        chunk = self.src.read(n)
        self.digest.update(chunk)
        if self.on_bytes is not None:
            self.on_bytes(len(chunk))
        return chunk


def _tar_member(name: str, size: int) -> tarfile.TarInfo:
    """The header of a regular member, with nothing of the machine that wrote it."""
    # TarInfo's defaults today, set explicitly all the same: the archive's reproducibility rests on them.
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, FILE_MODE, 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _add_file(tar: tarfile.TarFile, engine_dir: Path, rel: str, size: int, sha: str,
              on_bytes: Callable[[int], None] | None, where: str) -> None:
    """Appends the file `rel` of `engine_dir`, refusing it unless it has the size and sha256 engine.json lists."""
    with open(engine_dir / rel, "rb") as src:
        actual = os.fstat(src.fileno()).st_size
        if actual != size:
            raise ArchiveError(f"{where}: file {rel!r} of {engine_dir} is {actual} bytes, engine.json says {size}")
        tap = _Tap(src, on_bytes)
        tar.addfile(_tar_member(rel, size), tap)
    if tap.digest.hexdigest() != sha:
        raise ArchiveError(f"{where}: file {rel!r} of {engine_dir}: sha256 differs from engine.json's")


def unpack_archive(archive: Path, cache_root: Path) -> Path:
    """The engine folder of the uncompressed tar `archive` (as `write_archive` writes it), unpacked
    into `cache_root / <sha256 of the engine.json member's bytes>` and returned. A folder there that
    holds the `.unpacked` marker is returned as it is, after reading only engine.json. Refuses with
    ArchiveError anything but engine.json first and then exactly the files it lists, each a regular
    member with a safe relative path and the listed size and sha256; nothing is left behind then."""
    archive, cache_root = Path(archive), Path(cache_root)
    cache_root.mkdir(parents=True, exist_ok=True)
    with _open(archive) as tar:
        members = _members(tar, archive)
        raw = _manifest_member(tar, next(members, None), archive)
        files = _parse_manifest(raw, f"{archive}: member {MANIFEST!r}")
        final = cache_root / hashlib.sha256(raw).hexdigest()
        if (final / MARKER).is_file():
            return final
        tmp = Path(tempfile.mkdtemp(dir=cache_root, prefix=".unpacking-"))
        try:
            _write_file(tmp / MANIFEST, [raw])
            _unpack_members(tar, members, files, tmp, archive)
            _write_file(tmp / MARKER, [])
            return _publish(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _open(archive: Path) -> tarfile.TarFile:
    # "r|": a forward-only stream, no compression accepted (a compressed file has no valid tar header).
    try:
        return tarfile.open(archive, mode="r|", bufsize=CHUNK)
    except tarfile.ReadError as e:
        raise ArchiveError(f"{archive}: not an uncompressed tar archive, or truncated in its first header: {e}") \
            from None


def _members(tar: tarfile.TarFile, archive: Path) -> Iterator[tarfile.TarInfo]:
    """The archive's members in order; a header that cannot be read is reported after the last good member."""
    last = None
    members = iter(tar)
    while True:
        try:
            member = next(members)
        except StopIteration:
            return
        except tarfile.ReadError as e:
            raise ArchiveError(f"{archive}: truncated or damaged after member {last!r}: {e}") from None
        last = member.name
        yield member


def _manifest_member(tar: tarfile.TarFile, first: tarfile.TarInfo | None, archive: Path) -> bytes:
    """The bytes of the first member, which must be engine.json, a regular file of bounded size."""
    if first is None:
        raise ArchiveError(f"{archive}: no members, expected {MANIFEST!r} first")
    if first.name != MANIFEST or not _is_regular(first):
        raise ArchiveError(f"{archive}: first member is {first.name!r} ({_kind(first)}), "
                           f"expected the regular file {MANIFEST!r}")
    if first.size > MANIFEST_LIMIT:
        raise ArchiveError(f"{archive}: member {MANIFEST!r} is {first.size} bytes, more than the "
                           f"{MANIFEST_LIMIT} allowed")
    return b"".join(_chunks(tar, first, archive))


def _unpack_members(tar: tarfile.TarFile, members: Iterator[tarfile.TarInfo], files: dict[str, tuple[int, str]],
                    dest: Path, archive: Path) -> None:
    """Copies the members after engine.json into `dest`, each checked against `files` before and after."""
    seen = {MANIFEST}
    for member in members:
        if not _wanted(member, files, seen, archive):
            continue
        seen.add(member.name)
        path = dest / member.name
        path.parent.mkdir(parents=True, exist_ok=True)
        if _write_file(path, _chunks(tar, member, archive)) != files[member.name][1]:
            raise ArchiveError(f"{archive}: member {member.name!r}: sha256 differs from engine.json's")
    missing = [name for name in files if name not in seen]
    if missing:
        raise ArchiveError(f"{archive}: member {missing[0]!r}, listed in engine.json, is missing "
                           f"({len(missing)} missing in all)")


def _wanted(member: tarfile.TarInfo, files: dict[str, tuple[int, str]], seen: set[str], archive: Path) -> bool:
    """Whether `member` is a file to copy (False: a directory, implied by the files' paths anyway);
    refuses any member that is not a new, listed regular file of the listed size."""
    name = member.name
    fault = _name_fault(name)
    if fault:
        raise ArchiveError(f"{archive}: member {name!r} {fault}")
    if member.isdir():
        return False
    if not _is_regular(member):
        raise ArchiveError(f"{archive}: member {name!r} is {_kind(member)}; only regular files are allowed")
    if name in seen:
        raise ArchiveError(f"{archive}: member {name!r} appears twice")
    if name not in files:
        raise ArchiveError(f"{archive}: member {name!r} is not listed in engine.json")
    # Before any byte is copied: a member larger than promised must not fill the disk.
    if member.size != files[name][0]:
        raise ArchiveError(f"{archive}: member {name!r} is {member.size} bytes, engine.json says {files[name][0]}")
    return True


def _is_regular(member: tarfile.TarInfo) -> bool:
    # Only the two plain types: tarfile also counts contiguous and sparse members as regular, and a
    # sparse member's stored data is not the file's bytes.
    return member.type in (tarfile.REGTYPE, tarfile.AREGTYPE) and member.sparse is None


def _kind(member: tarfile.TarInfo) -> str:
    if _is_regular(member):
        return "a regular file"
    if member.sparse is not None:
        return "a sparse file"
    return _KINDS.get(member.type, f"of tar type {member.type!r}")


def _name_fault(name: str) -> str | None:
    """Why `name` is not a safe relative path inside the unpacked folder, or None."""
    if "\\" in name or "\x00" in name:
        return "has a backslash or NUL"
    if name.startswith("/"):
        return "is an absolute path"
    bad = next((part for part in name.split("/") if part in ("", ".", "..")), None)
    if bad is None:
        return None
    return f"has a {bad!r} path part" if bad else "has an empty path part"


def _chunks(tar: tarfile.TarFile, member: tarfile.TarInfo, archive: Path) -> Iterator[bytes]:
    """The data of `member`, in chunks; an archive that ends inside it is refused as truncated."""
    src = tar.extractfile(member)
    left = member.size
    while left:
        try:
            chunk = src.read(min(CHUNK, left))
        except tarfile.ReadError:
            chunk = b""
        if not chunk:
            raise ArchiveError(f"{archive}: truncated inside member {member.name!r} "
                               f"({member.size} bytes expected)")
        left -= len(chunk)
        yield chunk


def _write_file(path: Path, chunks: Iterable[bytes]) -> str:
    """Creates `path` (mode 0o644, whatever the archive or the umask say) from `chunks`; returns its sha256."""
    digest = hashlib.sha256()
    with open(path, "xb") as out:
        os.fchmod(out.fileno(), FILE_MODE)
        for chunk in chunks:
            digest.update(chunk)
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())  # the marker must not outlive a crash that loses the data it vouches for
    return digest.hexdigest()


def _publish(tmp: Path, final: Path) -> Path:
    """Renames the complete `tmp` to `final`; if another process published `final` first, keeps theirs."""
    os.chmod(tmp, FOLDER_MODE)  # mkdtemp's 0o700 would hide a shared cache from its other users
    try:
        os.rename(tmp, final)
    except OSError:
        if not (final / MARKER).is_file():
            raise
        shutil.rmtree(tmp)
    return final


def _parse_manifest(raw: bytes, where: str) -> dict[str, tuple[int, str]]:
    """The `files` table of engine.json: relative path → (bytes, sha256), in the manifest's order."""
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep for the parser
        raise ArchiveError(f"{where}: not valid JSON: {e}") from None
    table = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(table, dict):
        raise ArchiveError(f"{where}: no 'files' table (a mapping of path to bytes and sha256)")
    files = {name: _manifest_entry(name, meta, where) for name, meta in table.items()}
    # A path that is also another file's folder could not be created; refuse it before unpacking anything.
    folders = {str(parent) for name in files for parent in PurePosixPath(name).parents}
    clash = next((name for name in files if name in folders), None)
    if clash is not None:
        raise ArchiveError(f"{where}: files entry {clash!r} is also the folder of another entry")
    return files


def _manifest_entry(name: str, meta: object, where: str) -> tuple[int, str]:
    fault = _name_fault(name) or ("is reserved" if name in (MANIFEST, MARKER) else None)
    if fault:
        raise ArchiveError(f"{where}: files entry {name!r} {fault}")
    size = meta.get("bytes") if isinstance(meta, dict) else None
    sha = meta.get("sha256") if isinstance(meta, dict) else None
    if not (isinstance(size, int) and not isinstance(size, bool) and size >= 0):
        raise ArchiveError(f"{where}: files entry {name!r}: 'bytes' is {size!r}, expected an integer >= 0")
    if not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
        raise ArchiveError(f"{where}: files entry {name!r}: 'sha256' is {sha!r}, expected 64 lowercase hex digits")
    return size, sha
