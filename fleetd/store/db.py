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
from collections.abc import Iterable, Iterator
from pathlib import Path

from fleetd.errors import StoreError
from fleetd.store import foreign
from fleetd.store.schema import APPLICATION_ID, MIGRATIONS, SCHEMA_VERSION, migrate

BUSY_TIMEOUT_S = 5.0


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


def open_writer(path: Path) -> sqlite3.Connection:
    """Open (creating if needed) a database for writing, migrated to the current schema."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, one per batch.
        conn = sqlite3.connect(
            path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
    except sqlite3.Error as exc:
        raise _translate(path, exc) from exc
    with _closed_on_failure(conn, path):
        version = check_identity(conn, path)
        if version:
            check_store_shape(conn, path, version)
        conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a power loss may lose the last transactions, never corrupts.
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=OFF")
        if version < SCHEMA_VERSION:
            migrate(conn, version)
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
        conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
    except sqlite3.Error as exc:
        raise _translate(path, exc) from exc
    with _closed_on_failure(conn, path):
        conn.execute("PRAGMA trusted_schema=OFF")
        version = check_identity(conn, path)
        if version:
            check_store_shape(conn, path, version, shadow_views=True)
        conn.execute("PRAGMA query_only=1")
    return conn, version


@functools.cache
def store_schema(version: int) -> tuple[dict[str, str], dict[str, str]]:
    """(tables, views) of a version-``version`` node database as this fleetd creates it:
    name -> the SQL SQLite keeps for it."""
    conn = sqlite3.connect(":memory:")
    try:
        for script in MIGRATIONS[:version]:
            conn.executescript(script)
        rows = conn.execute("SELECT type, name, sql FROM sqlite_master "
                            "WHERE type IN ('table', 'view') ORDER BY rowid").fetchall()
    finally:
        conn.close()
    return ({str(n): str(q) for t, n, q in rows if t == "table"},
            {str(n): str(q) for t, n, q in rows if t == "view"})


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
        for sql in views.values():
            conn.execute(sql.replace("CREATE VIEW", "CREATE TEMP VIEW", 1))


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
