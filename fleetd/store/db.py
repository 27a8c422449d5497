"""Opening node databases: create and migrate for writers, check and refuse for readers.

Readers never create a file: a query against a path that does not exist is an error,
not an empty database.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from fleetd.errors import StoreError
from fleetd.store import files, foreign
from fleetd.store.schema import APPLICATION_ID, MIGRATIONS, SCHEMA_VERSION, migrate

BUSY_TIMEOUT_S = 5.0
# One write statement (an executemany of a whole batch included) may take this long.
# Generous for fleetd's own writes (a batch of 50,000 rows takes well under a second);
# what a file could make slow (an index or trigger that slipped past the schema check)
# ends here instead of stalling the writer for ever.
WRITE_DEADLINE_S = 120.0
# VM instructions between two checks: a few rows of an insert. Few enough that one row
# made slow (an index expression over a 16 MiB value takes tens of ms) cannot hold the
# check off for long; a 50,000-row batch pays about ten milliseconds for it.
_WRITE_PROGRESS_EVERY = 100


class Connection(sqlite3.Connection):
    """Every connection fleetd opens (:func:`connect`). It knows its file, so that a
    damaged page met by any later statement is told against the right file
    (:func:`damage_error`), and a writer's connection carries a deadline that each
    ``execute``/``executemany``/``executescript`` renews (:meth:`set_write_deadline`)."""

    path: Path | None = None
    write_limit_s: float | None = None
    _deadline = float("inf")
    _timed_out = False

    def set_write_deadline(self, seconds: float | None) -> None:
        """Stop any one statement after ``seconds`` (None: no deadline)."""
        self.write_limit_s = seconds
        if seconds is None:
            self.set_progress_handler(None, 0)
        else:
            self.set_progress_handler(self._progress, _WRITE_PROGRESS_EVERY)

    def _progress(self) -> int:
        if time.monotonic() > self._deadline:
            self._timed_out = True
            return 1
        return 0

    def _timed(self, run: Callable[..., sqlite3.Cursor], *args: Any) -> sqlite3.Cursor:
        if self.write_limit_s is None:  # readers: no deadline of this kind
            return run(*args)
        self._deadline, self._timed_out = time.monotonic() + self.write_limit_s, False
        try:
            return run(*args)
        except sqlite3.OperationalError as exc:
            if self._timed_out:
                raise WriteTimeout(self.path, self.write_limit_s) from exc
            raise

    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        return self._timed(super().execute, sql, parameters)

    def executemany(self, sql: str, parameters: Any, /) -> sqlite3.Cursor:
        return self._timed(super().executemany, sql, parameters)

    def executescript(self, sql_script: str, /) -> sqlite3.Cursor:
        return self._timed(super().executescript, sql_script)


class WriteTimeout(sqlite3.OperationalError):
    """A write statement ran past its deadline. An ``sqlite3.Error``, so that a writer
    that handles failed writes (the agent's drops the batch and counts it) handles this
    one too; its text names the file and the likely cause."""

    def __init__(self, path: Path | None, seconds: float) -> None:
        super().__init__(
            f"a write into {path or 'the database'} ran past its {seconds:g} s limit "
            "(SQL the file holds, an index or trigger, made it slow; fleetd never waits on "
            "a file for ever)")


Isolation = Literal["DEFERRED", "EXCLUSIVE", "IMMEDIATE"] | None


def connect(target: Path | str, *, uri: bool = False, timeout: float = BUSY_TIMEOUT_S,
            isolation_level: Isolation = "DEFERRED", check_same_thread: bool = True,
            path: Path | None = None) -> Connection:
    """The one place fleetd opens SQLite. Every connection gets ``trusted_schema=OFF``:
    SQL stored in a file (a view, a trigger, an index expression, a column default) may
    then call only the functions SQLite marks harmless, whoever wrote the file. ``path``
    is the file a URI ``target`` names, for error messages."""
    conn = sqlite3.connect(target, uri=uri, timeout=timeout, isolation_level=isolation_level,
                           check_same_thread=check_same_thread, factory=Connection)
    assert isinstance(conn, Connection)
    conn.path = path if path is not None else (
        None if uri or str(target) in ("", ":memory:") else Path(target))
    try:
        conn.execute("PRAGMA trusted_schema=OFF")
    except sqlite3.Error as exc:
        conn.close()
        raise _translate(conn.path or Path(str(target)), exc) from exc
    if conn.path is not None:
        _opened.pop(conn.path, None)
        _opened[conn.path] = None
        if len(_opened) > _OPENED_KEPT:
            del _opened[next(iter(_opened))]
    return conn


# The files this process opened, newest last: a damaged page can surface in any later
# statement, far from the open, and the CLI names the file from here (damage_error).
_opened: dict[Path, None] = {}
_OPENED_KEPT = 16


def damage_error(exc: BaseException, path: Path | None = None) -> StoreError | None:
    """A StoreError for a damaged database met after the open (``database disk image is
    malformed``, ``file is not a database``), naming ``path`` or else the file this process
    opened last; None for any other error."""
    if not isinstance(exc, sqlite3.DatabaseError) or isinstance(exc, WriteTimeout):
        return None
    text = str(exc).lower()
    if not any(w in text for w in foreign.DAMAGED):
        return None
    paths = [path] if path is not None else list(reversed(_opened))
    if len(paths) > 1:
        return StoreError(f"a database is damaged ({exc}); this command opened "
                          f"{', '.join(map(str, paths[:4]))}", damaged_hint("PATH"))
    where = str(paths[0]) if paths else "the database"
    return StoreError(f"{where} is damaged ({exc})", damaged_hint(where))


def damaged_hint(path: str) -> str:
    return (f"fleetd check --only db --db {path} says what to do; copy the file again if "
            "it came from another machine (with its -wal file, or after the agent stopped)")


def default_db_path() -> Path:
    """``$FLEETD_DB``, else /var/lib/fleetd/fleetd.db for root, else the user's data dir."""
    env = os.environ.get("FLEETD_DB")
    if env:
        return Path(env)
    if os.geteuid() == 0:
        return Path("/var/lib/fleetd/fleetd.db")
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "fleetd" / "fleetd.db"


def _translate(path: Path, exc: sqlite3.Error | UnicodeDecodeError) -> StoreError:
    text = str(exc)
    if "not a database" in text or "malformed" in text:
        return StoreError(
            f"{path} is not a readable SQLite database ({text})",
            "check the path; if the file was copied off a node, copy it again "
            "(with its -wal file, or after the agent stopped)",
        )
    if "locked" in text or "busy" in text:
        return StoreError(
            f"{path} is locked by another process ({text})",
            "wait for the writer to finish, or query a copy of the file",
        )
    if "unable to open" in text:
        return StoreError(
            f"cannot open {path} ({text})",
            "check that the file and its directory exist and are readable",
        )
    if isinstance(exc, UnicodeDecodeError) or "decode to UTF-8" in text:
        return StoreError(f"{path}: holds text that is not UTF-8 where fleetd reads names "
                          f"({text[:120]})", "the file is damaged: copy it again")
    return StoreError(f"{path}: {text}")


def check_identity(conn: sqlite3.Connection, path: Path) -> int:
    """Return the schema version after checking the file is ours and not too new."""
    try:
        app_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]
    except sqlite3.Error as exc:
        raise _translate(path, exc) from exc
    if app_id != APPLICATION_ID:
        if app_id == 0 and tables == 0:
            return 0  # an empty file: a writer may initialise it
        raise StoreError(
            f"{path} is an SQLite database but not a fleetd one (application_id={app_id:#x})",
            "point --db (or $FLEETD_DB) at a file written by fleetd trace, agent or merge",
        )
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{path} has schema version {version}, newer than this fleetd understands "
            f"({SCHEMA_VERSION})",
            "upgrade fleetd on this machine to read it",
        )
    return int(version)


@contextlib.contextmanager
def _closed_on_failure(conn: sqlite3.Connection, path: Path) -> Iterator[None]:
    """Close ``conn`` when setting it up fails, and tell SQLite's errors (and text that is
    not UTF-8, in a foreign file) as a StoreError: the writer and the reader set up their
    connections under this one rule, so that neither leaks a connection."""
    try:
        yield
    except (sqlite3.Error, UnicodeDecodeError) as exc:
        conn.close()
        raise _translate(path, exc) from exc
    except StoreError:
        conn.close()
        raise


def open_writer(path: Path, *, deadline_s: float | None = WRITE_DEADLINE_S) -> Connection:
    """Open (creating if needed) a database for writing, migrated to the current schema.

    A new file is created 0600 and never through a symlink (:mod:`fleetd.store.files`).
    An existing file must hold only fleetd's own schema (:func:`check_own_schema`):
    whatever else it holds would run inside every write. Each statement then runs under
    ``deadline_s`` (:class:`WriteTimeout`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    files.prepare_db(path)
    try:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, one per batch.
        conn = connect(path, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as exc:
        raise _translate(path, exc) from exc
    with _closed_on_failure(conn, path):
        version = check_identity(conn, path)
        if version:
            check_own_schema(conn, path, version)
        conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a power loss may lose the last transactions, never corrupts.
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=OFF")
        if version < SCHEMA_VERSION:
            migrate(conn, version)
        _shadow_views(conn, SCHEMA_VERSION)
        # No value fleetd writes comes near it; an expression in the file cannot build
        # a larger one (SQLite's default allows a gigabyte).
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, foreign.MAX_VALUE_BYTES)
        conn.set_write_deadline(deadline_s)
    return conn


def open_reader(path: Path) -> sqlite3.Connection:
    """Open an existing database read-only; refuse missing, foreign or newer files."""
    if not path.exists():
        raise StoreError(
            f"database {str(path)!r} does not exist",
            "pass --db PATH or set $FLEETD_DB to a database written by fleetd "
            "(fleetd trace --db PATH records one)",
        )
    if path.is_dir():
        raise StoreError(f"database {str(path)!r} is a directory", "pass the .db file inside it")
    try:
        conn, version = _connect_ro(path, "")
    except StoreError:
        # A WAL file in a directory we cannot write (a copy on read-only media) cannot get
        # its -shm; immutable=1 reads it without one. Nobody writes such a copy.
        if os.access(path.parent, os.W_OK):
            raise
        conn, version = _connect_ro(path, "&immutable=1")
    if version == 0:
        conn.close()
        raise StoreError(
            f"{path} is an empty database with no fleetd data",
            "record into it first with fleetd trace --db PATH",
        )
    return conn


def _connect_ro(path: Path, extra: str) -> tuple[sqlite3.Connection, int]:
    """A reader of a file that may come from anywhere (a copy off another machine is
    opened the same way as the agent's own file): its schema is untrusted
    (``trusted_schema=OFF``), its tables must be tables, and fleetd's views are read as
    this fleetd defines them (:func:`check_store_shape`)."""
    uri = f"file:{foreign.uri_path(path)}?mode=ro{extra}"
    try:
        conn = connect(uri, uri=True, check_same_thread=False, path=path)
    except sqlite3.Error as exc:
        raise _translate(path, exc) from exc
    with _closed_on_failure(conn, path):
        version = check_identity(conn, path)
        if version:
            check_store_shape(conn, path, version, shadow_views=True)
        conn.execute("PRAGMA query_only=1")
    return conn, version


def connect_foreign(path: Path, *, immutable: bool, attach: int = 0) -> Connection:
    """``path``, a file fleetd did not write, opened read-only under
    :func:`foreign.harden`. ``immutable`` for a file no process writes (an export); a
    node database may still have a writer, whose WAL must then be read. ``attach`` is how
    many databases it may attach later."""
    uri = f"file:{foreign.uri_path(path)}?mode=ro" + ("&immutable=1" if immutable else "")
    try:
        conn = connect(uri, uri=True, check_same_thread=False, path=path)
    except sqlite3.Error as exc:
        raise foreign.explain(exc, path) from None
    foreign.harden(conn, attach=attach)
    return conn


@functools.cache
def _schema_rows(version: int) -> tuple[tuple[str, str, str, str | None], ...]:
    """(type, name, table, sql) of every object of a version-``version`` node database
    as this fleetd makes it: the migrations replayed, as :func:`migrate` applies them to
    an older file (SQLite keeps the text each ALTER leaves, so a migrated file and a new
    one of the same version hold the same SQL)."""
    conn = connect(":memory:")
    try:
        for script in MIGRATIONS[:version]:
            conn.executescript(script)
        rows = conn.execute("SELECT type, name, tbl_name, sql FROM sqlite_master "
                            "ORDER BY rowid").fetchall()
    finally:
        conn.close()
    return tuple((str(t), str(n), str(on), None if q is None else str(q))
                 for t, n, on, q in rows)


def store_schema(version: int) -> tuple[dict[str, str], dict[str, str]]:
    """(tables, views) of a version-``version`` node database as this fleetd creates it:
    name -> the SQL SQLite keeps for it."""
    rows = _schema_rows(version)
    return ({n: q or "" for t, n, _, q in rows if t == "table"},
            {n: q or "" for t, n, _, q in rows if t == "view"})


@functools.cache
def own_objects(version: int) -> dict[tuple[str, str], tuple[str, str]]:
    """(type, name folded) -> (table folded, normalised SQL) of what fleetd creates."""
    return {(t, n.lower()): (on.lower(), normalise_sql(q)) for t, n, on, q in
            _schema_rows(version)}


def normalise_sql(sql: str | None) -> str:
    """``sql`` without comments and with each run of white space outside quotes made one
    space: what an older fleetd wrote differs from this one's text at most there."""
    out: list[str] = []
    text, i, n = sql or "", 0, len(sql or "")
    while i < n:
        c = text[i]
        if c in "'\"`[":
            close = "]" if c == "[" else c
            j = i + 1
            while j < n and not (text[j] == close and text[j + 1:j + 2] != close):
                j += 2 if text[j] == close else 1  # a doubled quote stays inside
            out.append(text[i:j + 1])
            i = j + 1
            continue
        if text.startswith("--", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = n if end < 0 else end + 2
        elif not c.isspace():
            out.append(c)
            i += 1
            continue
        else:
            i += 1
        if out and out[-1] != " ":  # white space or a comment: one space
            out.append(" ")
    return "".join(out).strip()


def check_own_schema(conn: sqlite3.Connection, path: Path, version: int, *,
                     schema: str = "main") -> None:
    """Refuse a node database that holds any table, index, trigger or view that fleetd
    does not create at ``version``, by name and SQL: fleetd is about to write into it, and
    SQLite runs a file's index expressions and triggers inside every write (a planted
    expression index made a 5,000-row import take 115 s instead of 1.4 s)."""
    own = own_objects(min(version, SCHEMA_VERSION))
    rows = conn.execute(
        f"SELECT type, name, tbl_name, sql FROM {schema}.sqlite_master ORDER BY rowid"
    ).fetchall()
    strange = [f"{t} {n!r}" + (f" on {on!r}" if t in ("index", "trigger") else "")
               for t, n, on, q in rows
               if own.get((str(t), str(n).lower())) != (str(on).lower(), normalise_sql(q))]
    if strange:
        shown = ", ".join(strange[:8]) + (f" and {len(strange) - 8} more"
                                          if len(strange) > 8 else "")
        raise StoreError(
            f"{path}: refused to write into it: it holds schema fleetd did not create "
            f"(or changed): {shown}; SQLite would run that SQL inside every write",
            "write to a new file (a new --db or -o path); to keep the data, merge this file "
            "as an input: fleetd merge -o NEW.db THIS.db ...")


def _shadow_views(conn: sqlite3.Connection, version: int) -> None:
    """fleetd's views as TEMP views with this fleetd's definitions, which SQLite resolves
    before the file's: with ``trusted_schema=OFF`` a file's own views may not call
    json_extract, and a file's ``events`` could be any query."""
    for sql in store_schema(version)[1].values():
        conn.execute(sql.replace("CREATE VIEW", "CREATE TEMP VIEW", 1))


def check_store_shape(conn: sqlite3.Connection, path: Path, version: int, *,
                      schema: str = "main", shadow_views: bool = False) -> None:
    """Refuse a node database whose tables are not plain tables, or that holds a trigger
    (fleetd writes none). With ``shadow_views``, fleetd's own views are created on the
    connection as TEMP views with this fleetd's definitions, which SQLite resolves before
    the file's: a file's own ``events`` may be any query (one that never ends), and with
    ``trusted_schema=OFF`` the file's views could not call json_extract anyway."""
    tables, views = store_schema(min(version, SCHEMA_VERSION))
    foreign.check_tables(conn, path, tables, schema=schema, all_triggers=True, known=tables)
    if shadow_views:
        _shadow_views(conn, min(version, SCHEMA_VERSION))


def present_tables(conn: sqlite3.Connection, names: Iterable[str]) -> list[str]:
    """Those of ``names`` this file has as tables, sorted: a file of an older schema
    lacks the newer tables (the GPU tables of imports came with schema 2)."""
    wanted = sorted(set(names))
    return [str(t) for (t,) in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name IN "
        f"({', '.join('?' * len(wanted))}) ORDER BY name", wanted)]


def ensure_node(conn: sqlite3.Connection, name: str, host: str | None = None) -> int:
    """Return the key of node ``name`` in this file, registering it on first use."""
    validate_node_name(name)
    row = conn.execute("SELECT id FROM nodes WHERE name = ?", (name,)).fetchone()
    if row:
        return int(row[0])
    machine_id = _machine_id()
    cur = conn.execute(
        "INSERT INTO nodes(name, uid, machine_id, host, created_ns) VALUES (?,?,?,?,?)",
        (name, uuid.uuid4().hex, machine_id, host, time.time_ns()),
    )
    return int(cur.lastrowid or 0)


NODE_NAME_RULE = ("a node name is 1 to 253 printable characters without ':' (ids are "
                  "written node:seq)")


def node_name_ok(name: object) -> bool:
    return (isinstance(name, str) and 0 < len(name) <= 253 and ":" not in name
            and name.isprintable())


def validate_node_name(name: str) -> None:
    if not node_name_ok(name):
        raise StoreError(
            f"invalid node name {name!r}: {NODE_NAME_RULE}",
            "use a non-empty printable name without ':' (ids are written node:seq)",
        )


def _machine_id() -> str | None:
    try:
        return Path("/etc/machine-id").read_text().strip() or None
    except OSError:
        return None


# ---- damage ------------------------------------------------------------------------------

DAMAGE_CHECK_S = 30.0  # PRAGMA quick_check at an agent's start, at most
DAMAGED_CHOICES = ("refuse", "move-aside")  # store.on_damaged_db


def find_damage(path: Path, seconds: float = DAMAGE_CHECK_S) -> tuple[list[str], bool]:
    """``PRAGMA quick_check`` of ``path`` under a deadline: (what it found wrong, at most
    ten lines, empty when nothing; whether it finished). A torn or overwritten page, a
    file cut short mid-page, a header that is not SQLite's all show here; quick_check
    reads every page but skips the index-to-table cross-check, so it is linear in the
    file's size (about a second per GB on a local disk)."""
    uri = f"file:{foreign.uri_path(path)}?mode=ro"
    try:
        conn = connect(uri, uri=True, path=path)
    except (sqlite3.Error, StoreError) as exc:
        return [str(exc)], True
    deadline = time.monotonic() + seconds
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 10_000)
    try:
        rows = conn.execute("PRAGMA quick_check(10)").fetchall()
    except sqlite3.OperationalError as exc:
        if "interrupted" in str(exc):
            return [], False
        return [str(exc)], True
    except sqlite3.DatabaseError as exc:
        return [str(exc)], True
    finally:
        conn.close()
    found = [str(r[0]) for r in rows]
    return ([] if found == ["ok"] else found), True


def damaged_db_error(path: Path, found: Sequence[str]) -> StoreError:
    return StoreError(
        f"database {path} is damaged ({'; '.join(found[:2])[:300]}); the agent does not "
        "write into a damaged file",
        f"move it aside (mv {path} {path}.damaged) and start again for a new one, or set "
        "store.on_damaged_db: move-aside to do so at each start; fleetd check --only db "
        f"--db {path} describes it")


def move_aside(path: Path, now: float | None = None) -> Path:
    """Rename a damaged ``path`` (and its -wal/-shm/-journal) to
    ``<name>.damaged-<UTC time>``; returns the new name. The data stays for whoever wants
    to recover it (``sqlite3 OLD .recover``); the next writer starts a new file."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    aside = path.with_name(f"{path.name}.damaged-{stamp}")
    os.rename(path, aside)
    for side in files.SIDECARS:
        with contextlib.suppress(FileNotFoundError):
            os.rename(f"{path}{side}", f"{aside}{side}")
    return aside
