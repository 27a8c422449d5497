"""Files fleetd creates: never through a symlink, and readable by their owner only.

The agent runs as root, and its database, a merge's output or an import's target may
sit in a directory others can write (a shared scratch space, a mounted volume). A
symlink planted at such a path would make root write wherever it points, so a path
fleetd writes is refused when it is a symlink (``lstat``, and ``O_NOFOLLOW`` on the
open that creates it), never followed. What fleetd creates is mode 0600: node
databases hold the command lines, environments and names of every traced process.
SQLite makes a database's ``-wal``, ``-shm`` and ``-journal`` files with the mode of
the database itself, so they are 0600 too.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from fleetd.errors import StoreError

FILE_MODE = 0o600
SIDECARS = ("-wal", "-shm", "-journal")


def refuse_link(path: Path, what: str = "output") -> None:
    """Raise when ``path`` exists as a symbolic link (whatever it points to, or nothing)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StoreError(f"cannot check the {what} path {str(path)!r}: {exc.strerror}",
                         "check the path and its directory's permissions") from None
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        raise StoreError(
            f"the {what} path {str(path)!r} is a symbolic link (to {target!r}); fleetd "
            "does not write through links",
            "remove the link, or pass the path of the file itself (or a new path)")


def create_private(path: Path) -> int:
    """A new, empty file at ``path``, mode 0600, opened for writing: never through a
    symlink, never over an existing file. Returns the descriptor."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                   FILE_MODE)


def prepare_db(path: Path, what: str = "database") -> None:
    """Make ``path`` safe for SQLite to open for writing: refuse a symlink at it or at one
    of its side files, and create it (0600, empty: SQLite initialises an empty file) when
    it does not exist yet, so that SQLite never creates it with the umask's mode."""
    for p in (path, *(Path(f"{path}{s}") for s in SIDECARS)):
        refuse_link(p, what)
    try:
        os.close(create_private(path))
    except FileExistsError:
        refuse_link(path, what)  # created meanwhile: the open that follows must not follow
    except OSError:
        pass  # a directory, a read-only place: SQLite's open tells it in its own words
