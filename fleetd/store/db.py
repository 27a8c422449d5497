"""Opening node databases: create and migrate for writers, check and refuse for readers.

Readers never create a file: a query against a path that does not exist is an error,
not an empty database.
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from fleetd.errors import StoreError
from fleetd.store.schema import APPLICATION_ID, SCHEMA_VERSION, migrate

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


def _translate(path: Path, exc: sqlite3.Error) -> StoreError:
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
    try:
        version = check_identity(conn, path)
        conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a power loss may lose the last transactions, never corrupts.
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA foreign_keys=OFF")
        if version < SCHEMA_VERSION:
            migrate(conn, version)
    except sqlite3.Error as exc:
        conn.close()
        raise _translate(path, exc) from exc
    except StoreError:
        conn.close()
        raise
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
    uri = f"file:{_quote_uri_path(path)}?mode=ro{extra}"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
    except sqlite3.Error as exc:
        raise _translate(path, exc) from exc
    try:
        conn.execute("PRAGMA query_only=1")
        return conn, check_identity(conn, path)
    except sqlite3.Error as exc:
        conn.close()
        raise _translate(path, exc) from exc
    except StoreError:
        conn.close()
        raise


def _quote_uri_path(path: Path) -> str:
    # '?' and '#' would end the path part of a URI; '%' starts an escape.
    s = str(path.absolute())
    return s.replace("%", "%25").replace("?", "%3f").replace("#", "%23")


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


def validate_node_name(name: str) -> None:
    if not name or ":" in name or len(name) > 253 or not name.isprintable():
        raise StoreError(
            f"invalid node name {name!r}",
            "use a non-empty printable name without ':' (ids are written node:seq)",
        )


def _machine_id() -> str | None:
    try:
        return Path("/etc/machine-id").read_text().strip() or None
    except OSError:
        return None
