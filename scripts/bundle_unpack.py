#!/usr/bin/env python3
"""Verify and unpack fleetd's offline bundle, safely, with nothing but the node's python3.

    python3 fleetd-bundle-unpack.py ARCHIVE DEST     verify ARCHIVE, then unpack it into DEST
    python3 fleetd-bundle-unpack.py --check ARCHIVE  verify only

``make bundle`` writes ``ARCHIVE.sha256`` (the ``sha256sum`` format) beside the archive and
copies this script there as ``fleetd-bundle-unpack.py``. The archive is refused before a
single byte is written when that file is missing or does not match (so ``sha256sum -c
ARCHIVE.sha256`` says the same thing). Unpacking writes nothing outside DEST, whatever the
archive holds: a member named absolutely or with ``..``, a link whose target leaves DEST,
a member written through a link, a hard link to a file outside, a device or a FIFO are
each refused with the member's name, and the partial tree is removed. Modes lose their
setuid, setgid and sticky bits. Python's own ``lzma`` reads the .xz stream; where the
interpreter was built without it, the ``xz`` program does, through a pipe.

Standard library only, Python 3.8 or newer (the node's python3 runs it before the bundle
is there). Exit 0 when done, 1 with one line on stderr when refused.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import PurePosixPath

CHUNK = 1 << 20


class Refused(Exception):
    """The archive, its checksum or a member is not acceptable; the message says which."""


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def expected_digest(archive: str) -> str:
    """The digest ARCHIVE.sha256 states for ARCHIVE's file name."""
    sums = archive + ".sha256"
    try:
        with open(sums, encoding="ascii") as f:
            text = f.read(4096)
    except FileNotFoundError:
        raise Refused(f"no checksum file {sums!r} beside the archive: copy the .sha256 "
                      "that `make bundle` wrote with the archive (never unpack an unverified "
                      "one)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise Refused(f"cannot read {sums!r}: {exc}") from exc
    name = os.path.basename(archive)
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == name:
            digest = parts[0].lower()
            if len(digest) == 64 and all(c in "0123456789abcdef" for c in digest):
                return digest
    raise Refused(f"{sums!r} has no SHA-256 line for {name!r} (expected '<64 hex>  {name}')")


def verify(archive: str) -> str:
    """The archive's digest when it matches its .sha256 file; Refused otherwise."""
    if not os.path.isfile(archive):
        raise Refused(f"no such archive: {archive!r}")
    want = expected_digest(archive)
    got = sha256_of(archive)
    if got != want:
        raise Refused(f"{archive!r} does not match its checksum (sha256 {got}, expected "
                      f"{want}): the copy is damaged or altered; copy it again")
    return got


def _inside(dest: str, path: str) -> bool:
    return path == dest or path.startswith(dest + os.sep)


def _check_name(name: str) -> PurePosixPath:
    p = PurePosixPath(name)
    if not name or p.is_absolute() or ".." in p.parts or "\0" in name:
        raise Refused(f"member {name!r} would be written outside the destination "
                      "(absolute or '..'); this archive is not a fleetd bundle")
    return p


def _no_link_on_the_way(dest: str, rel: PurePosixPath) -> str:
    """The member's path in DEST, once no directory on the way is a symbolic link (so a
    link unpacked earlier cannot carry a later member elsewhere)."""
    cur = dest
    for part in rel.parts[:-1]:
        cur = os.path.join(cur, part)
        if os.path.islink(cur):
            raise Refused(f"member {rel.as_posix()!r} would be written through the link "
                          f"{os.path.relpath(cur, dest)!r}")
    return os.path.join(dest, *rel.parts)


def _check_link(dest: str, rel: PurePosixPath, target: str) -> None:
    """A symbolic link must point inside DEST, relative to where it stands."""
    if not target or target.startswith("/"):
        raise Refused(f"link {rel.as_posix()!r} points to {target!r}: absolute, outside "
                      "the destination")
    where = os.path.normpath(os.path.join(dest, *rel.parts[:-1], target))
    if not _inside(dest, where):
        raise Refused(f"link {rel.as_posix()!r} points to {target!r}, outside the destination")


def _open_stream(archive: str) -> tuple[tarfile.TarFile, subprocess.Popen[bytes] | None]:
    """A streaming reader of the .tar.xz: Python's lzma, else the xz program."""
    try:
        import lzma  # noqa: F401  (a CPython built without liblzma has no module)
        # "r:xz" (LZMAFile) and not the "r|xz" stream: the bundle is one xz stream per
        # layer, one after the other, and only LZMAFile reads past the first.
        return tarfile.open(archive, mode="r:xz"), None
    except ImportError:
        pass
    xz = shutil.which("xz")
    if xz is None:
        raise Refused("this python3 has no lzma module and there is no xz program: install "
                      "xz-utils, or unpack with a python3 built with lzma")
    proc = subprocess.Popen([xz, "-dc", archive], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    return tarfile.open(fileobj=proc.stdout, mode="r|"), proc


def _write_file(tf: tarfile.TarFile, member: tarfile.TarInfo, path: str) -> None:
    src = tf.extractfile(member)
    if src is None:
        raise Refused(f"member {member.name!r} has no data")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    with os.fdopen(fd, "wb") as out:
        shutil.copyfileobj(src, out, CHUNK)
    os.chmod(path, member.mode & 0o777)


def _unpack_member(tf: tarfile.TarFile, m: tarfile.TarInfo, dest: str,
                   written: set[str], dirs: list[tuple[str, int]]) -> None:
    rel = _check_name(m.name)
    path = _no_link_on_the_way(dest, rel)
    if m.isdir():
        if os.path.islink(path):
            raise Refused(f"directory {m.name!r} is already a link")
        os.makedirs(path, 0o700, exist_ok=True)
        dirs.append((path, m.mode & 0o777))
        return
    os.makedirs(os.path.dirname(path), 0o755, exist_ok=True)
    if os.path.lexists(path):
        raise Refused(f"member {m.name!r} appears twice (or DEST was not empty)")
    if m.issym():
        _check_link(dest, rel, m.linkname)
        os.symlink(m.linkname, path)
    elif m.islnk():
        target = _check_name(m.linkname).as_posix()
        if target not in written:
            raise Refused(f"hard link {m.name!r} to {m.linkname!r}, which is no earlier "
                          "file of the archive")
        os.link(os.path.join(dest, target), path, follow_symlinks=False)
    elif m.isreg():
        _write_file(tf, m, path)
    else:
        raise Refused(f"member {m.name!r} is a device, FIFO or other special file")
    written.add(rel.as_posix())


def unpack(archive: str, dest: str) -> int:
    """Unpack the (verified) archive into DEST; the number of members written."""
    os.makedirs(dest, 0o755, exist_ok=True)
    dest = os.path.realpath(dest)
    written: set[str] = set()
    dirs: list[tuple[str, int]] = []
    tf, proc = _open_stream(archive)
    try:
        with tf:
            for m in tf:
                _unpack_member(tf, m, dest, written, dirs)
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise Refused(f"cannot unpack {archive!r}: {exc}") from exc
    finally:
        if proc is not None:
            proc.stdout.close()  # type: ignore[union-attr]
            if proc.wait() != 0:
                raise Refused(f"xz could not read {archive!r} (exit {proc.returncode})")
    for path, mode in reversed(dirs):  # modes last: a read-only directory holds its files
        os.chmod(path, mode)
    return len(written) + len(dirs)


def main(argv: list[str]) -> int:
    usage = "usage: fleetd-bundle-unpack.py ARCHIVE DEST | --check ARCHIVE"
    if len(argv) == 2 and argv[0] == "--check":
        archive, dest = argv[1], None
    elif len(argv) == 2 and not argv[0].startswith("-"):
        archive, dest = argv
    else:
        print(usage, file=sys.stderr)
        return 2
    try:
        digest = verify(archive)
        print(f"fleetd-bundle: {os.path.basename(archive)}: sha256 {digest} matches",
              file=sys.stderr)
        if dest is None:
            return 0
        fresh = not os.path.exists(dest) or not os.listdir(dest)
        try:
            n = unpack(archive, dest)
        except Refused:
            if fresh:  # nothing of a refused archive stays behind
                shutil.rmtree(dest, ignore_errors=True)
            raise
        print(f"fleetd-bundle: unpacked {n} entries into {os.path.realpath(dest)}",
              file=sys.stderr)
        return 0
    except Refused as exc:
        print(f"fleetd-bundle: refused: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
