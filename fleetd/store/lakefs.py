"""The Parquet lake on disk: its marker, its directories, and reading only what is the
lake's own (docs/scale-out.md, "What a lake reader trusts").

A lake may sit on a mount that many agents write, or be a directory copied from
elsewhere: its files are input, not fleetd's own state. So:

* The marker ``_fleetd_lake.json`` is read only when it is a regular file (opened with
  ``O_NOFOLLOW | O_NONBLOCK``, then ``fstat``: a symlink, a FIFO or ``/dev/zero`` is
  refused at once), of at most :data:`MARKER_MAX_BYTES` and :data:`MARKER_MAX_DEPTH`
  levels of JSON; a refusal names the marker and what is wrong, never a value from it.
* Listing walks the partition directories by descriptor, never through a symlink:
  ``table=``, ``node=`` and ``date=`` must be real directories, a ``node=`` value must be
  a valid node name written as fleetd writes it, a ``date=`` value a calendar date, and
  a part file a regular file. Anything else is left out with a warning naming it, and
  the rest of the lake still answers. Nothing listed can resolve outside the lake.
* Writers create each directory level relative to the one above, never following a
  symlink, and write each file under a new temporary name (``O_EXCL | O_NOFOLLOW``),
  fsynced, then renamed: readers (and a crash) see a whole file or none.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import json
import logging
import os
import re
import stat
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from fleetd.errors import StoreError
from fleetd.security.private_dir import UnsafePathError, open_regular, read_regular
from fleetd.store.db import validate_node_name

log = logging.getLogger("fleetd.store.lake")

# 2: the processes table gains where each process ran (cgroup, runtime, container,
# container_name, pod, namespace, pod_uid); a version-1 lake's processes files lack
# them and read as NULL there (fleetd.store.lake.LakeTable.optional).
LAKE_VERSION = 2
MARKER = "_fleetd_lake.json"
LAKE_FORMAT = "fleetd-lake"
MARKER_MAX_BYTES = 64 * 1024  # the marker fleetd writes is under 100 bytes
MARKER_MAX_DEPTH = 8  # levels of JSON nesting; fleetd's marker has one
MAX_WARNINGS = 20  # bad entries named one by one; the rest are counted
TMP_PREFIX = ".tmp-"
_SAFE = re.compile(r"[A-Za-z0-9._-]")
_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_HINT_LAKE = ("pass --lake DIR, a directory written by fleetd export --format parquet or by "
              "fleetd agent --parquet-dir")


# --- layout -------------------------------------------------------------------------

def escape_value(value: str) -> str:
    """A partition value as Hive writes it: every other character %XX (UTF-8), which
    DuckDB, Spark and Trino all decode."""
    return "".join(c if _SAFE.fullmatch(c) else "".join(f"%{b:02X}" for b in c.encode())
                   for c in value)


def unescape_value(text: str) -> str:
    from urllib.parse import unquote

    return unquote(text)


def partition_parts(table: str, node: str, date: str | None) -> tuple[str, ...]:
    """The directory names, below the lake's root, of one partition."""
    parts = (f"table={table}", f"node={escape_value(node)}")
    return (*parts, f"date={date}") if date is not None else parts


def partition_dir(root: Path, table: str, node: str, date: str | None) -> Path:
    return root.joinpath(*partition_parts(table, node, date))


# --- the marker ---------------------------------------------------------------------

def init_lake(root: Path) -> None:
    """Create the lake directory and its marker, or check an existing one."""
    root.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(root / MARKER):
        read_marker(root)
        return
    if any(p for p in root.iterdir() if not p.name.startswith(".")):
        raise StoreError(f"{str(root)!r} is not empty and is not a fleetd lake (no {MARKER})",
                         "write the lake into a new or empty directory")
    write_bytes(root, (), MARKER, json.dumps({
        "format": LAKE_FORMAT, "version": LAKE_VERSION, "created_ns": time.time_ns()}).encode())


def read_marker(root: Path) -> int:
    """The lake's schema version, after checking that ``root`` is a lake we can read."""
    if not root.is_dir():
        raise StoreError(f"lake {str(root)!r} does not exist or is not a directory",
                         _HINT_LAKE)
    marker = root / MARKER
    damaged = "the lake's marker file is damaged or not fleetd's; re-export the lake"
    try:
        raw = read_regular(marker, MARKER_MAX_BYTES)
    except FileNotFoundError:
        raise StoreError(f"{str(root)!r} is not a fleetd lake (it has no {MARKER})",
                         _HINT_LAKE) from None
    except UnsafePathError as exc:
        raise StoreError(f"lake marker {exc.message}", damaged) from None
    except OSError as exc:
        raise StoreError(f"{str(marker)!r} is unreadable ({exc.strerror or 'I/O error'})",
                         damaged) from None
    meta = _marker_json(raw)
    if meta is None:
        raise StoreError(f"{str(marker)!r} is not a JSON object of at most "
                         f"{MARKER_MAX_DEPTH} levels in UTF-8", damaged)
    fmt, version = meta.get("format"), meta.get("version")
    if fmt != LAKE_FORMAT or not isinstance(version, int) or isinstance(version, bool):
        # Never the values: the file may be anyone's (a link to a secret, say).
        raise StoreError(f"{str(marker)!r} does not describe a fleetd lake (its format "
                         f"is not {LAKE_FORMAT!r}, or its version is not a whole number)",
                         damaged)
    if version > LAKE_VERSION:
        raise StoreError(f"lake {str(root)!r} has a schema version newer than this fleetd "
                         f"understands ({LAKE_VERSION})",
                         "upgrade fleetd on this machine to read it")
    return version


def _marker_json(raw: bytes) -> dict[str, object] | None:
    """The marker file's JSON object, unchecked (the file may be anyone's): its reader
    tests the two values it takes."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if _depth(text) > MARKER_MAX_DEPTH:
        return None  # before the parser recurses into it
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return meta if isinstance(meta, dict) else None


def _depth(text: str) -> int:
    """The deepest nesting of brackets outside JSON strings."""
    deepest = depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


# --- directories, never through a link -----------------------------------------------

def open_dirs(root: Path, parts: Sequence[str], create: bool) -> int:
    """A descriptor of ``root/parts...``: each level opened (``create``: made first)
    relative to the one above, never through a symlink. StoreError naming the level
    that is a link or not a directory."""
    fd = os.open(root, _DIR)
    here = root
    try:
        for part in parts:
            here = here / part
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, dir_fd=fd)
            try:
                nfd = os.open(part, _DIR | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise StoreError(f"{str(here)!r} in the lake is a symbolic link or not a "
                                     "directory; fleetd writes only into the lake's own "
                                     "directories", "remove it") from None
                raise
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_file(root: Path, parts: Sequence[str], name: str,
               write: Any) -> int:
    """Write ``root/parts.../name`` atomically: ``write(binary file)`` fills a new
    temporary file (``O_EXCL | O_NOFOLLOW``), which is fsynced and renamed into place;
    the file's size."""
    dfd = open_dirs(root, parts, create=True)
    try:
        tmp = f"{TMP_PREFIX}{uuid.uuid4().hex}-{name}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o666, dir_fd=dfd)
        try:
            with open(fd, "wb") as fh:
                write(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dfd)
            raise
        with contextlib.suppress(OSError):
            os.fsync(dfd)  # some shared filesystems refuse fsync on a directory
        return os.stat(name, dir_fd=dfd, follow_symlinks=False).st_size
    finally:
        os.close(dfd)


def write_bytes(root: Path, parts: Sequence[str], name: str, data: bytes) -> int:
    return write_file(root, parts, name, lambda fh: fh.write(data))


def read_small(root: Path, parts: Sequence[str], name: str, limit: int) -> bytes:
    """A small regular file of the lake (a state file): never through a link, at most
    ``limit`` bytes. OSError (or StoreError, UnsafePathError) when it cannot be."""
    dfd = open_dirs(root, parts, create=False)
    try:
        fd, st = open_regular(Path(name), dir_fd=dfd)
    finally:
        os.close(dfd)
    with open(fd, "rb") as fh:
        if st.st_size > limit:
            raise UnsafePathError(f"{name!r} is over {limit} bytes")
        return fh.read(limit + 1)[:limit]


# --- listing ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LakeFile:
    table: str
    node: str
    date: str | None
    path: Path
    size: int
    mtime: float


class _Skipped:
    """Bad entries of a listing: named up to MAX_WARNINGS, then counted."""

    def __init__(self, out: list[str] | None) -> None:
        self.out, self.n = out, 0

    def __call__(self, path: Path, why: str) -> None:
        self.n += 1
        text = (f"{path} {why} and was left out (a lake reads only its own regular files "
                "and directories); remove it")
        if self.out is None:
            log.warning("lake: %s", text)
        elif self.n <= MAX_WARNINGS:
            self.out.append(text)

    def close(self) -> None:
        if self.out is not None and self.n > MAX_WARNINGS:
            self.out.append(f"{self.n - MAX_WARNINGS} more bad lake entries were left out")


def _sorted(fd: int) -> list[os.DirEntry[str]]:
    with os.scandir(fd) as it:
        return sorted(it, key=lambda e: e.name)


def _why_not_dir(e: os.DirEntry[str]) -> str | None:
    if e.is_symlink():
        return "is a symbolic link"
    return None if e.is_dir(follow_symlinks=False) else "is not a directory"


def _why_not_file(st: os.stat_result) -> str | None:
    if stat.S_ISREG(st.st_mode):
        return None
    return "is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a regular file"


def _valid_node(value: str) -> str | None:
    node = unescape_value(value)
    try:
        validate_node_name(node)
    except StoreError:
        return None
    return node if escape_value(node) == value else None


def _valid_date(value: str) -> bool:
    if not _DATE.fullmatch(value):
        return False
    try:
        dt.date.fromisoformat(value)
    except ValueError:
        return False
    return True


def walk(root: Path, dated: Mapping[str, bool], tables: Sequence[str] | None,
         skipped: _Skipped) -> Iterator[tuple[str, str, str | None, Path, int]]:
    """Every partition directory of the lake that is really the lake's: (table, node,
    date, path, descriptor); the descriptor is closed when the next one is yielded."""
    try:
        root_fd = os.open(root, _DIR)
    except OSError:
        return
    try:
        for te in _sorted(root_fd):
            table = te.name.partition("=")[2]
            if not te.name.startswith("table=") or table not in dated or (
                    tables is not None and table not in tables):
                continue
            tpath = root / te.name
            if (why := _why_not_dir(te)) is not None:
                skipped(tpath, why)
                continue
            yield from _nodes(root_fd, te.name, tpath, table, dated[table], skipped)
    finally:
        os.close(root_fd)


def _nodes(parent: int, name: str, tpath: Path, table: str, dated: bool,
           skipped: _Skipped) -> Iterator[tuple[str, str, str | None, Path, int]]:
    with _subdir(parent, name) as tfd:
        if tfd is None:
            return
        for ne in _sorted(tfd):
            if not ne.name.startswith("node="):
                continue
            npath = tpath / ne.name
            node = _valid_node(ne.name[5:])
            why = _why_not_dir(ne) or (None if node is not None else
                                       "does not name a valid node as fleetd writes it")
            if why is not None or node is None:
                skipped(npath, why or "")
                continue
            with _subdir(tfd, ne.name) as nfd:
                if nfd is None:
                    continue
                if not dated:
                    yield table, node, None, npath, nfd
                    continue
                for de in _sorted(nfd):
                    if not de.name.startswith("date="):
                        continue
                    dpath = npath / de.name
                    date = de.name[5:]
                    why = _why_not_dir(de) or (None if _valid_date(date) else
                                               "is not a date partition (date=YYYY-MM-DD)")
                    if why is not None:
                        skipped(dpath, why)
                        continue
                    with _subdir(nfd, de.name) as dfd:
                        if dfd is not None:
                            yield table, node, date, dpath, dfd


@contextlib.contextmanager
def _subdir(parent: int, name: str) -> Iterator[int | None]:
    try:
        fd: int | None = os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=parent)
    except OSError:
        fd = None  # removed (retention) or swapped for a link since it was listed
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def list_files(root: Path, dated: Mapping[str, bool], tables: Sequence[str] | None = None,
               warnings: list[str] | None = None) -> list[LakeFile]:
    """Every closed part file of the lake (``part-*.parquet``, regular, reached without
    a link): ``dated`` says which tables have date partitions. Bad entries are named
    in ``warnings`` (logged when None) and left out."""
    out: list[LakeFile] = []
    skipped = _Skipped(warnings)
    for table, node, date, dpath, dfd in walk(root, dated, tables, skipped):
        for e in _sorted(dfd):
            if not fnmatchcase(e.name, "part-*.parquet"):
                continue
            try:
                st = os.stat(e.name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed by retention while we listed
            if (why := _why_not_file(st)) is not None:
                skipped(dpath / e.name, why)
                continue
            out.append(LakeFile(table, node, date, dpath / e.name, st.st_size, st.st_mtime))
    skipped.close()
    return out


def clean_temporaries(root: Path, dated: Mapping[str, bool], node: str | None = None,
                      older_than_s: float = 3600.0) -> int:
    """Remove temporary files a crashed writer left (of one node, or all); readers never
    list them anyway. Only inside the lake's own directories: a link is never followed."""
    n = 0
    now = time.time()
    for _, owner, _, _, dfd in walk(root, dated, None, _Skipped([])):
        if node is not None and owner != node:
            continue
        for e in _sorted(dfd):
            if not e.name.startswith(TMP_PREFIX):
                continue
            try:
                st = os.stat(e.name, dir_fd=dfd, follow_symlinks=False)
                if now - st.st_mtime > older_than_s:
                    os.unlink(e.name, dir_fd=dfd)  # a link itself, never its target
                    n += 1
            except FileNotFoundError:
                pass
    return n
