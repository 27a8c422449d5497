"""``fleetd check --only db``: can an agent create or open its database and keep writing?

No root or BPF needed. A finding is a value (a :class:`~fleetd.checks.Check`), never an
exception: the point of a check is to report every problem at once, each with its fix.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import tempfile
from pathlib import Path
from typing import NotRequired, TypedDict

from fleetd.checks import FAIL, OK, WARN, Check, Finding, Stop, row, stopped
from fleetd.errors import StoreError
from fleetd.store import foreign
from fleetd.store.db import DAMAGE_CHECK_S, check_identity, connect, find_damage
from fleetd.store.losses import SessionLosses, describe_crash, session_losses
from fleetd.store.schema import SCHEMA_VERSION

DISK_FAIL_BYTES = 100 * 2**20  # below this the writer fails within minutes of tracing
DISK_WARN_BYTES = 2**30


# ---- the database ---------------------------------------------------------------------


class DbFigures(TypedDict):
    """The db check's figures for scripts (``data`` of its JSON row), in the order they
    are found; a step that was not reached leaves its key out."""

    path: str
    schema_version: NotRequired[int]
    damage: NotRequired[list[str]]  # quick_check's complaints
    sessions: NotRequired[SessionLosses]
    free_bytes: NotRequired[int]


def db_check(path: Path, max_bytes: int | None = None) -> Check:
    """Can an agent create or open ``path`` and keep writing to it?"""
    data: DbFigures = {"path": str(path)}
    try:
        directory = _db_directory(path)
        if path.exists():
            findings = _db_file(path, data)
        else:
            also = f" and {path.parent}" if directory != path.parent else ""
            findings = [Finding(OK, f"does not exist yet; the agent creates it{also}")]
        findings.append(_disk_space(directory, path, max_bytes, data))
    except Stop as stop:
        return stopped("db", "db", str(path), stop.finding, data)
    summary = "; ".join(f.text for f in findings)
    return row("db", "db", str(path), findings, summary, data)


def _db_directory(path: Path) -> Path:
    """The nearest existing directory on the way to ``path``, proven writable by
    writing into it (as root, permission bits say nothing: a read-only mount does)."""
    if path.is_dir():
        raise Stop(Finding(FAIL, "is a directory, not a database file",
                            f"pass --db {path / 'fleetd.db'} (a file path)"))
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise Stop(Finding(FAIL, f"cannot create its directory: {existing} is a file, "
                            "not a directory",
                            "pass --db (or store.db) with a path in a writable directory"))
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".fleetd-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise Stop(Finding(FAIL, f"directory {existing} is not writable ({exc.strerror})",
                            "pass --db with a path in a directory this user can write (the "
                            "agent also writes the -wal and -shm files next to it)")) from None
    return existing


def _db_file(path: Path, data: DbFigures) -> list[Finding]:
    try:
        conn = connect(f"file:{foreign.uri_path(path)}?mode=ro", uri=True, path=path)
    except sqlite3.Error as exc:
        raise Stop(Finding(FAIL, f"cannot open: {exc}", "check the file's permissions")
                    ) from None
    try:
        version = check_identity(conn, path)
    except StoreError as exc:
        damaged = "malformed" in exc.message  # the header or the schema's page is torn
        raise Stop(Finding(FAIL, exc.message, _damage_fix(path) if damaged else exc.hint or "")
                   ) from None
    finally:
        conn.close()
    data["schema_version"] = version
    size = path.stat().st_size
    out = [_schema_finding(version, size), _damage_finding(path, data)]
    if version > 0 and not data.get("damage"):
        out.append(_losses_finding(path, data))
    if not os.access(path, os.W_OK):
        out.append(Finding(FAIL, "the file is read-only for this user",
                           f"chmod u+w {path}, or run the agent as its owner"))
    return out


def _damage_finding(path: Path, data: DbFigures) -> Finding:
    """PRAGMA quick_check under a deadline: a torn page, a file cut short."""
    found, finished = find_damage(path, DAMAGE_CHECK_S)
    data["damage"] = found
    if found:
        return Finding(FAIL, f"damaged: {'; '.join(found[:3])[:300]}", _damage_fix(path))
    if not finished:
        return Finding(WARN, f"integrity check did not finish within {DAMAGE_CHECK_S:g} s",
                       "a large file: run sqlite3 FILE 'PRAGMA quick_check' on it while "
                       "the agent is stopped, to be sure")
    return Finding(OK, "no damaged page (quick_check)")


def _losses_finding(path: Path, data: DbFigures) -> Finding:
    """Sessions ended by a kill (what they lost, from their last commit) and events the
    writer dropped on a full disk: a warning while the newest session is such a one."""
    try:
        conn = connect(f"file:{foreign.uri_path(path)}?mode=ro", uri=True, path=path)
        try:
            losses = session_losses(conn)
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return Finding(WARN, f"sessions not readable: {exc}", "run it again while the "
                       "agent is not pruning, or check the file's permissions")
    data["sessions"] = losses
    parts = []
    if losses["crashed"]:
        newest = losses["crashes"][-1]
        parts.append(f"{losses['crashed']} of {losses['sessions']} sessions ended by a "
                     f"kill or crash; the newest: {describe_crash(newest)}")
    if losses["write_failed"]:
        parts.append(f"{losses['write_failed']} events dropped because the disk was "
                     "full")
    if not parts:
        return Finding(OK, f"{losses['sessions']} sessions, none killed, no event dropped "
                       "on a full disk")
    status = WARN if losses["newest_crashed"] or losses["write_failed"] else OK
    return Finding(status, "; ".join(parts),
                   "see why the agent died in its log or the kernel's (dmesg: the OOM "
                   "killer), and keep free space beyond store.max_bytes on its file system")


def _damage_fix(path: Path) -> str:
    return (f"stop the agent, then either move the file aside (mv {path} {path}.damaged; "
            "the agent starts a new one) or set store.on_damaged_db: move-aside, which does "
            f"that at start; what is still readable can be saved with sqlite3 {path} "
            ".recover | sqlite3 recovered.db")


def _schema_finding(version: int, size: int) -> Finding:
    if version == 0:
        return Finding(OK, "an empty SQLite file; the agent initialises it")
    if version < SCHEMA_VERSION:
        return Finding(OK, f"fleetd database, schema v{version} ({_size(size)}); the agent "
                       f"migrates it to v{SCHEMA_VERSION}")
    return Finding(OK, f"fleetd database, schema v{version} ({_size(size)})")


def _disk_space(directory: Path, path: Path, max_bytes: int | None,
                data: DbFigures) -> Finding:
    free = shutil.disk_usage(directory).free
    data["free_bytes"] = free
    where = f"{_size(free)} free on {directory.absolute()}'s file system"
    fix = "free space there, or pass --db (store.db) on a larger file system"
    if free < DISK_FAIL_BYTES:
        return Finding(FAIL, f"only {where}", fix)
    used = path.stat().st_size if path.exists() else 0
    if max_bytes is not None and free + used < max_bytes:
        return Finding(WARN, f"store.max_bytes is {_size(max_bytes)} but only {where}",
                       "lower store.max_bytes (--max-db-bytes) below the free space, or " + fix)
    if free < DISK_WARN_BYTES:
        return Finding(WARN, f"only {where}", fix)
    return Finding(OK, where)


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
