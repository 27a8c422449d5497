"""Reading SQLite files fleetd did not write, within bounds.

An nsys export, a node database copied off a machine nobody here controls, an existing
merge output: each is as untrusted as network input, and SQLite runs whatever SQL its
schema holds (a view is a query, a trigger runs on writes, a generated column is
computed on every read, a virtual table is code). Every reader of such a file goes
through this module, so the rules are one:

- the file is opened read-only (``mode=ro``; ``immutable=1`` where no writer can be
  present; :func:`fleetd.store.db.connect_foreign`) with ``PRAGMA trusted_schema=OFF``,
  so its schema may call only functions SQLite marks harmless;
- the tables fleetd reads must be plain tables (:func:`check_tables`): a view, a virtual
  table, a computed column or a trigger in their place is refused, by name, before
  anything is read from them;
- every statement runs under a :class:`Watch` (SQLite's progress handler): a deadline
  that grows with the file's size, and Ctrl-C/SIGTERM, which end a statement at once
  instead of waiting for SQLite to return (a Python signal handler alone runs only
  between two SQLite calls);
- SQLite's heap is capped process-wide while the file is read (:func:`heap_ceiling`),
  one value is capped at :data:`MAX_VALUE_BYTES`, and callers cap row counts;
- a damaged file, a value too large, a deadline or the memory cap each become one
  :class:`~fleetd.errors.StoreError` line (:func:`explain`), never a traceback.

Text that is not UTF-8 is the caller's choice: :class:`LenientText` reads it with
U+FFFD in place of the bad bytes and counts the values it had to repair (nsys exports
carry such bytes in paths and environments); without it, Python's sqlite3 refuses it
and :func:`explain` says so in one line.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from fleetd.errors import StoreError

MAX_VALUE_BYTES = 16 << 20  # one string or blob (SQLITE_LIMIT_LENGTH)
HEAP_LIMIT_BYTES = 512 << 20  # SQLite's own memory while a foreign file is read
PROGRESS_EVERY = 1_000  # VM instructions between two checks of the deadline and signals
# A statement may take this long, plus a second per SLOW_BYTES_PER_S of file: generous
# for a real file on a slow disk (a scan reads far faster), finite for SQL that never ends.
BASE_DEADLINE_S = 60.0
SLOW_BYTES_PER_S = 10_000_000
DAMAGED = ("malformed", "not a database", "file is encrypted", "disk i/o error",
            "database corruption")


def deadline_for(path: Path) -> float:
    """Seconds one statement over ``path`` may take."""
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    return BASE_DEADLINE_S + size / SLOW_BYTES_PER_S


def uri_path(path: Path) -> str:
    """``path`` for a ``file:`` URI: '?' and '#' would end the path part, '%' escapes."""
    s = str(path.absolute())
    return s.replace("%", "%25").replace("?", "%3f").replace("#", "%23")


def harden(conn: sqlite3.Connection, *, attach: int = 0) -> None:
    """The settings every connection that reads a foreign file gets."""
    conn.execute("PRAGMA trusted_schema=OFF")
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, attach)
    conn.setlimit(sqlite3.SQLITE_LIMIT_TRIGGER_DEPTH, 1)


# ---- the shape of the file ---------------------------------------------------------------


def check_tables(conn: sqlite3.Connection, path: Path, tables: Iterable[str], *,
                 schema: str = "main", all_triggers: bool = False,
                 known: Mapping[str, str] | None = None) -> set[str]:
    """Refuse ``path`` when one of ``tables`` (those it has) is not a plain table.

    SQLite names are case-insensitive, so a view ``stringids`` stands in for
    ``StringIds``: names are compared folded. A trigger on one of them is refused too,
    and with ``all_triggers`` any trigger (fleetd never writes one, and merges and
    imports write into node databases). ``known`` maps a table to the SQL fleetd itself
    creates it with: a table whose SQL is exactly that has no computed column, and is not
    looked at again. Returns the names of ``tables`` that are present, as the file spells
    them (a missing one is the caller's business)."""
    wanted = {t.lower(): t for t in tables}
    rows = conn.execute(f"SELECT type, name, tbl_name, sql FROM {schema}.sqlite_master "
                        "WHERE type IN ('table', 'view', 'trigger')").fetchall()
    present: set[str] = set()
    plain: set[str] = set()
    for kind, name, on, sql in rows:
        key = str(name).lower()
        if kind == "trigger" and (all_triggers or str(on).lower() in wanted):
            raise _refuse(path, f"holds a trigger, {name!r} on {on!r}: SQL that would run "
                          "inside fleetd")
        if key not in wanted:
            continue
        if kind == "view":
            raise _refuse(path, f"{name!r} is a view, not a table: its rows would be "
                          "computed by SQL the file carries")
        if str(sql or "").lstrip()[:14].upper().startswith("CREATE VIRTUAL"):
            raise _refuse(path, f"{name!r} is a virtual table, not a table: its rows would "
                          "come from code, not from the file")
        present.add(str(name))
        if known is not None and known.get(str(name)) == sql:
            plain.add(str(name))
    for name in sorted(present - plain):
        computed = [str(r[1]) for r in conn.execute(
            f"PRAGMA {schema}.table_xinfo({quote(name)})") if r[6] in (2, 3)]
        if computed:
            raise _refuse(path, f"table {name!r} has computed (generated) column(s) "
                          f"{', '.join(computed)}: values SQL would make on every read")
    return present


def quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _refuse(path: Path, what: str) -> StoreError:
    return StoreError(f"{path}: refused: {what}",
                      "fleetd reads only files whose tables hold plain rows; export or copy "
                      "the file again from its source")


# ---- deadlines, signals, memory ------------------------------------------------------


class Watch:
    """The progress handler of a connection: stops the running statement when its
    deadline passes, or at once when SIGINT/SIGTERM arrive (while :meth:`guard` is
    active). Each statement gets its own deadline: SQLite's trace callback, called as a
    statement starts, restarts the clock."""

    def __init__(self, path: Path, seconds: float | None = None) -> None:
        self.path = path
        self.seconds = deadline_for(path) if seconds is None else seconds
        self.deadline = time.monotonic() + self.seconds
        self.signalled: int | None = None
        self.timed_out = False

    def restart(self) -> None:
        self.deadline = time.monotonic() + self.seconds

    def progress(self) -> int:
        if self.signalled is not None:
            return 1
        if time.monotonic() > self.deadline:
            self.timed_out = True
            return 1
        return 0

    def _started(self, sql: str) -> None:
        self.restart()

    def attach(self, conn: sqlite3.Connection) -> None:
        conn.set_progress_handler(self.progress, PROGRESS_EVERY)
        conn.set_trace_callback(self._started)

    @staticmethod
    def detach(conn: sqlite3.Connection) -> None:
        with contextlib.suppress(sqlite3.Error):
            conn.set_progress_handler(None, 0)
            conn.set_trace_callback(None)

    @contextlib.contextmanager
    def guard(self, *conns: sqlite3.Connection, explain_all: bool = True) -> Iterator[Watch]:
        """Deadline, signals and the heap cap around reading. A signal comes out as
        KeyboardInterrupt, a deadline or the heap cap as one StoreError line; other
        errors of SQLite too with ``explain_all`` (every statement reads the file), else
        they pass unchanged (the caller also writes, and knows what failed)."""
        for c in conns:
            self.attach(c)
        try:
            with _signals(self), heap_ceiling():
                yield self
        except (sqlite3.Error, MemoryError, UnicodeDecodeError) as exc:
            if explain_all or self.signalled is not None or self.timed_out or isinstance(
                    exc, MemoryError):
                raise explain(exc, self.path, self) from None
            raise
        finally:
            for c in conns:
                self.detach(c)


@contextlib.contextmanager
def _signals(watch: Watch) -> Iterator[None]:
    """SIGINT and SIGTERM mark the watch (so the progress handler ends the statement on
    its next check) and raise KeyboardInterrupt; raised inside the progress handler it is
    swallowed by sqlite3, which aborts the statement, and :func:`explain` raises it again.
    Only the main thread receives signals; elsewhere nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        watch.signalled = signum
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@functools.cache
def _heap_limit_fn() -> Callable[[int], int] | None:
    """``sqlite3_hard_heap_limit64`` of the SQLite Python's sqlite3 uses, or None. The
    pragma can only lower the limit, so restoring it afterwards needs the C call. Looked
    up on first use: a command that reads no foreign file never loads ctypes."""
    try:
        import _sqlite3  # noqa: PLC0415 - the extension module that links SQLite
        import ctypes  # noqa: PLC0415

        lib = ctypes.CDLL(_sqlite3.__file__)
        fn = lib.sqlite3_hard_heap_limit64
    except (ImportError, OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int64]
    return fn


_HEAP_LOCK = threading.Lock()
_heap_users = 0
_heap_before = 0


@contextlib.contextmanager
def heap_ceiling(limit: int = HEAP_LIMIT_BYTES) -> Iterator[None]:
    """SQLite's hard heap limit at ``limit`` (or lower, if already lower) for the block,
    then as it was. Process-wide: nested and concurrent blocks share one ceiling. An
    allocation above it fails and the statement ends with SQLITE_NOMEM (MemoryError)."""
    global _heap_users, _heap_before
    fn = _heap_limit_fn()
    if fn is None:
        yield
        return
    with _HEAP_LOCK:
        if _heap_users == 0:
            _heap_before = fn(-1)
            if _heap_before == 0 or _heap_before > limit:
                fn(limit)
        _heap_users += 1
    try:
        yield
    finally:
        with _HEAP_LOCK:
            _heap_users -= 1
            if _heap_users == 0:
                fn(_heap_before)


def heap_limit_now() -> int | None:
    """The hard heap limit in force (0: none), or None when it cannot be read."""
    fn = _heap_limit_fn()
    return None if fn is None else int(fn(-1))


# ---- errors ----------------------------------------------------------------------------


def explain(exc: BaseException, path: Path, watch: Watch | None = None) -> BaseException:
    """One line for what went wrong reading ``path``; KeyboardInterrupt for a signal."""
    text = str(exc)
    if watch is not None and watch.signalled is not None:
        return KeyboardInterrupt()
    if watch is not None and (watch.timed_out or "interrupted" in text):
        return StoreError(
            f"{path}: a statement reading it ran past its {watch.seconds:.3g} s limit "
            "(SQL in the file that does not end, or a damaged file)",
            "copy the file again from its source; fleetd never waits on a file for ever")
    if isinstance(exc, MemoryError):
        return StoreError(
            f"{path}: reading it needed more than {HEAP_LIMIT_BYTES >> 20} MiB of SQLite "
            "memory, the cap for a file fleetd did not write",
            "split the recording into smaller files, or copy it again if it was damaged")
    if isinstance(exc, UnicodeDecodeError) or "decode to UTF-8" in text:
        return StoreError(
            f"{path}: holds text that is not UTF-8 where fleetd reads names "
            f"({text[:120]})", "the file is damaged: copy it again from its source")
    if "too big" in text:
        return StoreError(
            f"{path}: holds a value larger than {MAX_VALUE_BYTES >> 20} MiB, the limit for "
            "one string or blob", "the file is damaged or not what it claims to be")
    if "unsafe use of" in text:
        return StoreError(f"{path}: its schema calls a function fleetd does not run from a "
                          f"file ({text})", "copy the file again from its source")
    low = text.lower()
    if any(w in low for w in DAMAGED):
        return StoreError(f"{path}: damaged SQLite file ({text})",
                          "copy it again from its source; it was damaged on the way")
    if "unable to open" in low:
        return StoreError(f"cannot open {path} ({text})",
                          "check that the file and its directory exist and are readable")
    return StoreError(f"{path}: cannot be read ({text})", "copy it again from its source")


# ---- text ------------------------------------------------------------------------------


class Repaired(str):
    """A string that was not valid UTF-8 in the file, read with U+FFFD in its place."""

    __slots__ = ()


class LenientText:
    """A ``text_factory``: UTF-8, or U+FFFD for bytes that are not, counted in
    :attr:`repaired` (a reader compares it before and after a row to find which of the
    row's values were repaired: they are :class:`Repaired`)."""

    def __init__(self) -> None:
        self.repaired = 0

    def __call__(self, raw: bytes) -> str:
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            self.repaired += 1
            return Repaired(str(raw, "utf-8", "replace"))


def repaired_columns(row: tuple[Any, ...], names: list[str]) -> list[str]:
    return [n for n, v in zip(names, row, strict=False) if type(v) is Repaired]
