"""What every importer shares: reading an untrusted file within bounds, telling the
formats apart, naming strings once, and turning a parsed file into one stored session.

An imported file is untrusted input. It is read with a size limit, every value is
type-checked as it is taken, and any problem is one :class:`~fleetd.errors.UsageError`
line (exit 2) raised before the database is opened (but for an integer too large for
SQLite, refused while the one transaction of the import is written, which then rolls
back), so a bad file writes nothing.
"""

from __future__ import annotations

import gc
import hashlib
import re
import sqlite3
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from operator import add, itemgetter
from pathlib import Path
from typing import Any

from fleetd import __version__
from fleetd.errors import FleetdError, UsageError
from fleetd.store import foreign
from fleetd.store.catalog import BY_NAME, CUDA_SOURCES
from fleetd.store.db import connect_foreign, validate_node_name
from fleetd.store.imports import ImportBatch, ImportOutcome, ImportSource, write_imports

MAX_FILE_BYTES = 8 << 30  # an nsys export or a compressed Kineto file
# A Kineto file's JSON text, plain or once decompressed: read a piece at a time, so this
# bounds the time and the scratch space an import takes, not its memory.
MAX_JSON_BYTES = 8 << 30
READ_BYTES = 1 << 20  # JSON text read (or decompressed) at a time
GZIP_RATIO = 100  # the most a gzipped trace may expand (past GZIP_RATIO_FLOOR bytes)
GZIP_RATIO_FLOOR = 32 << 20
MAX_EVENTS = 50_000_000
MAX_NAME_CHARS = 4096  # kernel and annotation names (templated C++ names run long)
FORMATS = ("auto", "nsys", "kineto")
STAGES = ("parse", "convert", "insert", "index")  # ImportReport.timings
SQLITE_MAGIC = b"SQLite format 3\x00"
_HASH_MASK = (1 << 63) - 1
# The CUDA API sources whose calls keep their own op; others become ``cuda_api``.
_API_SOURCES = frozenset(CUDA_SOURCES)
_VERSION_SUFFIX = re.compile(r"_v\d+$")
_NCCL_KERNEL = re.compile(r"nccl(?:Dev)?Kernel_?([A-Za-z]+)")


class Names:
    """Strings stored once, by a 63-bit content hash (stable across files and nodes, so
    merged databases share one row per name)."""

    def __init__(self) -> None:
        self.by_hash: dict[int, str] = {}
        self._cache: dict[str, int] = {}

    def reset(self) -> None:
        """Forget every name (a reader that starts the file over)."""
        self.by_hash.clear()
        self._cache.clear()

    def __call__(self, name: str) -> int:
        if len(name) > MAX_NAME_CHARS:  # the cache's keys stay as short as what is stored
            name = name[:MAX_NAME_CHARS]
        got = self._cache.get(name)
        if got is not None:
            return got
        clean = clean_text(name)
        h = int.from_bytes(hashlib.blake2b(clean.encode(), digest_size=8).digest(),
                           "big") & _HASH_MASK
        self.by_hash[h] = clean
        self._cache[name] = h
        return h


def clean_text(value: str) -> str:
    """A name from a file, bounded and without control characters."""
    text = value[:MAX_NAME_CHARS]
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else "?" for c in text)


def api_op(name: str) -> tuple[int, str | None]:
    """The op code of a CUDA API call by name (nsys appends ``_v7000``-like versions);
    calls fleetd does not probe get ``cuda_api`` and keep their name."""
    base = _VERSION_SUFFIX.sub("", name)
    op = BY_NAME.get(base)
    if op is not None and op.source in _API_SOURCES:
        return op.code, None
    return BY_NAME["cuda_api"].code, clean_text(base)


def nccl_collective(kernel: str) -> str | None:
    """``AllReduce`` for ``ncclKernel_AllReduce_RING_LL_Sum_float``; None for other kernels."""
    if not kernel.startswith("nccl"):
        return None
    m = _NCCL_KERNEL.match(kernel)
    return m.group(1) if m else "nccl"


def us_to_ns(value: float | int) -> int:
    """Microseconds (Kineto's unit, possibly fractional) to integer ns, without going
    through a float product that would round away nanoseconds at epoch magnitudes."""
    whole = int(value)
    return whole * 1000 + round((value - whole) * 1000)


# ---- reading files -------------------------------------------------------------------


class FileDigest:
    """The sha256 of a file, computed on a thread of its own while the file is parsed:
    file reads and hashlib release the GIL, so on a second core hashing a large trace
    costs no time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._hex: str | None = None
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._run, name="fleetd-sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        digest = hashlib.sha256()
        try:
            with self.path.open("rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
        except OSError as exc:
            self._error = exc
            return
        self._hex = digest.hexdigest()

    def hexdigest(self) -> str:
        self._thread.join()
        if self._hex is None:
            raise UsageError(f"{self.path}: cannot be read ({self._error})",
                             "check that the file is readable")
        return self._hex


@dataclass(frozen=True, slots=True)
class Source:
    path: Path
    fmt: str  # nsys | kineto
    digest: FileDigest
    size: int

    @property
    def sha256(self) -> str:
        return self.digest.hexdigest()


def identify(path: Path, fmt: str) -> Source:
    """Check the file exists and is small enough, name its format, and start hashing it."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown import format {fmt!r}", f"use one of {', '.join(FORMATS)}")
    if not path.exists():
        raise UsageError(f"{path}: no such file", "name an nsys .sqlite export or a Kineto "
                         ".json/.json.gz trace")
    if not path.is_file():
        raise UsageError(f"{path}: not a regular file", "name the trace file itself")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise UsageError(f"{path}: {size} bytes, above the {MAX_FILE_BYTES} byte limit",
                         "split the trace (a shorter profiling window) and import the parts")
    try:
        with path.open("rb") as f:
            head = f.read(64)
    except OSError as exc:
        raise UsageError(f"{path}: cannot be read ({exc})",
                         "check that the file is readable") from exc
    detected = _detect(head)
    if fmt == "auto":
        if detected is None:
            raise UsageError(f"{path}: not a trace fleetd can import (neither an SQLite "
                             "file nor JSON, gzipped or not)",
                             "export nsys reports with 'nsys export --type sqlite'; save "
                             "PyTorch profiles with export_chrome_trace()")
        fmt = detected
    elif detected is not None and detected != fmt:
        raise UsageError(f"{path}: looks like a {detected} file, not {fmt}",
                         "drop --format (auto detects it) or name the right file")
    return Source(path, fmt, FileDigest(path), size)


def _detect(head: bytes) -> str | None:
    if head.startswith(SQLITE_MAGIC):
        return "nsys"
    if head.startswith(b"\x1f\x8b") or head.lstrip()[:1] in (b"{", b"["):
        return "kineto"
    return None


def json_chunks(path: Path, limit: int = MAX_JSON_BYTES) -> Iterator[bytes]:
    """The file's JSON text READ_BYTES at a time, gunzipped when it is gzip (several
    members too), whatever the file's size: the caller holds what it keeps.

    One limit for plain and gzipped files alike: more than ``limit`` bytes of text (at
    most MAX_JSON_BYTES) is refused. A gzip stream that expands more than GZIP_RATIO
    times its compressed bytes read so far, past the first GZIP_RATIO_FLOOR bytes, is
    refused at that point: traces compress 10-30x, and a few MB of gzip that expand to
    gigabytes of whitespace or repeated junk (a compression bomb) then fail in well under
    a second instead of after minutes of decompressing."""
    limit = min(limit, MAX_JSON_BYTES)
    try:
        f = path.open("rb")
    except OSError as exc:
        raise UsageError(f"{path}: cannot be read ({exc})",
                         "check that the file is readable") from exc
    with f:
        data = _read(f, path)
        if not data.startswith(b"\x1f\x8b"):
            total = 0
            while data:
                total += len(data)
                if total > limit:
                    raise _too_big(path, limit, "")
                yield data
                data = _read(f, path)
            return
        yield from _gunzip(f, path, data, limit)


def _read(f: Any, path: Path) -> bytes:
    try:
        return bytes(f.read(READ_BYTES))
    except OSError as exc:
        raise UsageError(f"{path}: cannot be read ({exc})",
                         "check that the file is readable") from exc


def _too_big(path: Path, limit: int, how: str) -> UsageError:
    return UsageError(f"{path}: more than {limit} bytes{how}, above the limit for one trace",
                      "import a shorter profiling window (or split the trace)")


def _gunzip(f: Any, path: Path, data: bytes, limit: int) -> Iterator[bytes]:
    d = zlib.decompressobj(wbits=31)
    read_in = len(data)  # compressed bytes read from the file
    total = 0
    while True:
        if not data and not d.eof:
            # what zlib still holds of the input given (output was cut at READ_BYTES)
            data = b""
            out = _inflate(d, path, b"")
            if not out:
                data = _read(f, path)
                if not data:
                    raise UsageError(f"{path}: truncated gzip file (the compressed stream "
                                     "ends early)", "copy the file again in full; it was "
                                     "cut short")
                read_in += len(data)
                out = _inflate(d, path, data)
                data = d.unconsumed_tail
        else:
            out = _inflate(d, path, data)
            data = d.unconsumed_tail
        total += len(out)
        if total > limit:
            raise _too_big(path, limit, " once decompressed")
        if total > max(GZIP_RATIO_FLOOR, GZIP_RATIO * (read_in - len(data))):
            raise UsageError(f"{path}: expands more than {GZIP_RATIO}x when decompressed "
                             f"({total} bytes from {read_in - len(data)} compressed), which "
                             "no profiler trace does: a compression bomb or a damaged file",
                             "import the trace as the profiler wrote it")
        if out:
            yield out
        if d.eof:  # the end of a gzip member: another may follow (as gzip -c a b > c)
            data = d.unused_data
            if not data:
                data = _read(f, path)
                read_in += len(data)
            if data[:2] != b"\x1f\x8b":
                return  # no further member: trailing bytes are ignored, as before
            d = zlib.decompressobj(wbits=31)


def _inflate(d: Any, path: Path, data: bytes) -> bytes:
    try:
        return bytes(d.decompress(data, READ_BYTES))
    except zlib.error as exc:
        raise UsageError(f"{path}: corrupt gzip data ({exc})",
                         "copy the file again; it was damaged") from exc


def read_json_bytes(path: Path, limit: int = MAX_JSON_BYTES) -> bytes:
    """The file's whole JSON text, gunzipped when needed, refused above ``limit``."""
    return b"".join(json_chunks(path, limit))


def open_sqlite(path: Path, text: Callable[[bytes], str] | None = None) -> sqlite3.Connection:
    """An imported SQLite file: read-only and never modified (``immutable``: no -wal/-shm
    made), its schema untrusted and its values capped (:mod:`fleetd.store.foreign`, whose
    :class:`~fleetd.store.foreign.Watch` the reader runs its statements under). ``text``
    is the text factory (:class:`~fleetd.store.foreign.LenientText` for exports, whose
    strings are not always UTF-8)."""
    def unreadable(exc: FleetdError) -> UsageError:
        return UsageError(f"{path}: not a readable SQLite file "
                          f"({exc.message.removeprefix(f'{path}: ')})",
                          "export the report again with 'nsys export --type sqlite'")

    try:
        conn = connect_foreign(path, immutable=True)
    except FleetdError as exc:
        raise unreadable(exc) from None
    if text is not None:
        conn.text_factory = text
    try:
        with foreign.Watch(path).guard(conn):
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except FleetdError as exc:
        conn.close()
        raise unreadable(exc) from None
    except BaseException:
        conn.close()
        raise
    return conn


# ---- one import ----------------------------------------------------------------------


@dataclass(slots=True)
class Parsed:
    """What a reader found, before it is given a node and written."""

    batch: ImportBatch
    warnings: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # source rows by kind
    timings: dict[str, float] = field(default_factory=dict)  # stage -> seconds


Reader = Callable[[Source, "Names", str | None], Parsed]


def new_batch(src: Source, node: str, host: str | None, offset_ns: int,
              error_ns: int | None) -> ImportBatch:
    """The batch of one file; a reader adds what its format says of the file to
    ``source`` (after these keys)."""
    info: ImportSource = {"format": src.fmt, "path": str(src.path.absolute()),
                          "sha256": src.sha256, "bytes": src.size}
    return ImportBatch(node=node, host=host, started_ns=0, ended_ns=0, offset_ns=offset_ns,
                       clock_error_ns=error_ns, source=info, tool_version=__version__,
                       command=f"fleetd import --format {src.fmt} {src.path.name}")


def finish(batch: ImportBatch, names: Names) -> None:
    """Fill the session span from the rows and hand over the names they use."""
    tables = [rows for rows in (batch.events, batch.gpu, batch.annotations) if rows]
    first, second = itemgetter(0), itemgetter(1)
    if tables:  # every row starts with (ts_ns, dur_ns); C-level passes, no row tuples made
        batch.started_ns = min(min(map(first, rows)) for rows in tables)
        batch.ended_ns = max(max(map(add, map(first, rows), map(second, rows)))
                             for rows in tables)
    batch.names = names.by_hash
    total = len(batch.events) + len(batch.gpu) + len(batch.annotations)
    if total > MAX_EVENTS:
        raise UsageError(f"{batch.source['path']}: {total} events, above the {MAX_EVENTS} "
                         "limit", "import a shorter profiling window")


def check_node(name: str) -> str:
    try:
        validate_node_name(name)
    except Exception as exc:
        raise UsageError(f"invalid --node {name!r}",
                         "use a non-empty printable name without ':'") from exc
    return name


@dataclass(frozen=True, slots=True)
class ImportReport:
    path: Path
    fmt: str
    outcome: ImportOutcome
    counts: dict[str, int]
    warnings: list[str]
    # Seconds per stage (STAGES): parse (reading, gunzip, JSON decoding; an nsys export is
    # read as it is converted), convert (checks, rows, links, names), insert (the rows into
    # the tables; of several files, the first counts opening the database, the last the
    # commit), index (built after a bulk load into a new file, counted with the last file).
    timings: dict[str, float] = field(default_factory=dict)


@contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """The cyclic garbage collector paused while a file is read and written.

    A parsed trace is millions of small containers that hold no cycles: the collector
    frees none of them, yet each of its passes walks them all again, and passes come
    more often the more objects are made (it tripled the JSON parse time of a 1M-event
    trace). Reference counting still frees everything as soon as it is dropped."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def import_files(paths: Sequence[Path], db: Path, node: str | None, fmt: str,
                 readers: dict[str, Reader]) -> list[ImportReport]:
    """Parse every file first (any bad one stops all, before a write), then write each
    as its own session, all in one transaction."""
    if node is not None:
        check_node(node)
    parsed: list[tuple[Source, Parsed]] = []
    with no_cyclic_gc():
        for path in paths:
            src = identify(path, fmt)
            t0 = time.perf_counter()
            p = readers[src.fmt](src, Names(), node)
            rest = time.perf_counter() - t0 - sum(p.timings.values())
            p.timings["convert"] = p.timings.get("convert", 0.0) + max(0.0, rest)
            parsed.append((src, p))
        _check_pids(parsed)
        outcomes = write_imports(db, [p.batch for _, p in parsed])
        out = [ImportReport(src.path, src.fmt, outcome, p.counts, p.warnings,
                            dict.fromkeys(STAGES, 0.0) | p.timings | outcome.timings)
               for (src, p), outcome in zip(parsed, outcomes, strict=True)]
        parsed.clear()  # the rows go while the collector still sleeps: it would walk them
    return out


def _check_pids(parsed: Sequence[tuple[Source, Parsed]]) -> None:
    """Two ranks in one node must be two processes; the same pid twice would mix them."""
    seen: dict[tuple[str, int], Path] = {}
    for src, p in parsed:
        for proc in p.batch.processes:
            key = (p.batch.node, int(proc["pid"]))
            other = seen.get(key)
            if other is not None and other != src.path and proc.get("rank") is not None:
                raise UsageError(
                    f"{src.path} and {other} both hold pid {key[1]} for node {key[0]!r}",
                    "import them into different nodes: one --node per file, or leave "
                    "--node out (each rank is then its own node)")
            seen[key] = src.path
