"""Directories fleetd makes in a shared place, and the files it reads or writes there.

One rule for every directory fleetd creates where another user could have been first
(``/tmp``, a cache, a shared mount): MCP's export directory, the TLS ticket cache, the
kernel-header cache.

* The **base** (the directory the new ones go under: ``$XDG_CACHE_HOME``, ``~/.cache``,
  ``$XDG_RUNTIME_DIR``) must be a directory owned by this user or by root, and writable
  by nobody else unless it has the sticky bit (``/tmp``: then nobody else can rename or
  remove what we create in it). Symlinks above and at the base are the user's own
  layout and are followed.
* Every directory **below** the base is created with mode 0700, or, when it exists, is
  used only if it is a real directory (not a symlink: opened with ``O_NOFOLLOW``),
  owned by this user (the effective uid), and writable by neither group nor others
  (``deny``; the ticket cache also refuses group/other read). Each is opened relative to
  the one above it, so a swap between the check and the use finds nothing to follow.
* Files go in with :func:`create_file` (``O_CREAT | O_EXCL | O_NOFOLLOW``: never through
  a link, never over an existing file) and are read with :func:`read_regular`
  (``O_NOFOLLOW | O_NONBLOCK``, then ``fstat``: only a regular file, a FIFO or a device
  never blocks or streams forever, and at most ``limit`` bytes).

A refusal is one :class:`UnsafePathError` line naming the path and what is wrong with it,
never the file's content.

Use it (the kernel-header cache, for example)::

    from fleetd.security.private_dir import private_dir
    tree = private_dir(base / "fleetd" / "kheaders", base=base)  # base: the cache root

``private_dir`` returns the path once every level checks out, and raises
:class:`UnsafePathError` (a :class:`~fleetd.errors.FleetdError`, so the CLI prints it
as one line with a hint) otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from fleetd.errors import FleetdError

DENY_WRITE = 0o022  # group or other may write: refused
DENY_ALL = 0o077  # group or other may read or write: refused (secrets, such as tickets)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW_DIR = _DIR_FLAGS | os.O_NOFOLLOW


class UnsafePathError(FleetdError):
    """A directory or file that another user could control: refused, named in one line."""


def _why_not(st: os.stat_result, deny: int, euid: int) -> str | None:
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != euid:
        return f"it is owned by uid {st.st_uid}, not by this user (uid {euid})"
    if stat.S_IMODE(st.st_mode) & deny:
        verb = "write" if deny == DENY_WRITE else "read or write"
        return f"group or others may {verb} it (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _base_why_not(st: os.stat_result, euid: int) -> str | None:
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid not in (euid, 0):
        return f"it is owned by uid {st.st_uid}, neither this user (uid {euid}) nor root"
    mode = stat.S_IMODE(st.st_mode)
    if mode & DENY_WRITE and not mode & stat.S_ISVTX:
        return f"others may write it and it has no sticky bit (mode {mode:04o})"
    return None


def private_dir(path: Path, *, base: Path | None = None, deny: int = DENY_WRITE,
                what: str = "directory", hint: str | None = None) -> Path:
    """Make sure ``path`` is a directory private to this user, creating it (and every
    missing level between ``base`` and it) with mode 0700; ``path`` is returned.

    ``base`` (default: ``path``'s parent) is the directory the user owns that the new
    ones go under; it is created (0700, with its parents) when missing. A level between
    the two may not be writable by group or others; ``path`` itself may not have the
    ``deny`` bits (:data:`DENY_WRITE`, or :data:`DENY_ALL` for secrets). ``what`` names
    the directory in a refusal (``"MCP export directory"``), ``hint`` says how to fix
    it. Raises :class:`UnsafePathError`.
    """
    path = Path(os.path.abspath(path))
    base = Path(os.path.abspath(base)) if base is not None else path.parent
    fix = hint or "remove it (or fix its owner and mode), or choose another directory"
    if path == base or not path.is_relative_to(base):
        raise UnsafePathError(f"{what} {str(path)!r} is not below {str(base)!r}", fix)
    euid = os.geteuid()

    def refuse(where: Path, why: str) -> UnsafePathError:
        at = "" if where == path else f" ({str(where)!r} above it)"
        return UnsafePathError(f"refusing {what} {str(path)!r}{at}: {why}", fix)

    try:
        os.makedirs(base, mode=0o700, exist_ok=True)
        fd = os.open(base, _DIR_FLAGS)  # the user's own layout: links followed here
    except OSError as exc:
        raise refuse(base, exc.strerror or str(exc)) from None
    try:
        why = _base_why_not(os.fstat(fd), euid)
        if why:
            raise refuse(base, why)
        here = base
        for part in path.relative_to(base).parts:
            here = here / part
            created = False
            try:
                os.mkdir(part, 0o700, dir_fd=fd)
                created = True
            except FileExistsError:
                pass
            except OSError as exc:
                raise refuse(here, exc.strerror or str(exc)) from None
            try:
                nfd = os.open(part, _NOFOLLOW_DIR, dir_fd=fd)
            except OSError as exc:
                raise refuse(here, _open_failure(part, fd, exc)) from None
            os.close(fd)
            fd = nfd
            if created:
                os.fchmod(fd, 0o700)  # whatever the umask left
            why = _why_not(os.fstat(fd), deny if here == path else DENY_WRITE, euid)
            if why:
                raise refuse(here, why)
    finally:
        os.close(fd)
    return path


def _open_failure(name: str, dir_fd: int, exc: OSError) -> str:
    with contextlib.suppress(OSError):
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            return "it is a symbolic link"
        if not stat.S_ISDIR(st.st_mode):
            return "it is not a directory"
    if exc.errno == errno.ELOOP:
        return "it is a symbolic link"
    return exc.strerror or str(exc)


def create_file(path: Path, mode: int = 0o600) -> int:
    """A new file at ``path``, opened for writing: never through a symlink, never over
    an existing file (``O_CREAT | O_EXCL | O_NOFOLLOW``). Returns the descriptor."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                   mode)


def open_regular(path: Path, dir_fd: int | None = None) -> tuple[int, os.stat_result]:
    """A read-only descriptor of ``path`` and its stat, only when it is a regular file:
    a symlink fails to open (``O_NOFOLLOW``), a FIFO or device opens without blocking
    (``O_NONBLOCK``) and is then refused. Raises :class:`UnsafePathError` (what it is)
    or OSError (it cannot be opened)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                 dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{str(path)!r} is {file_kind(st.st_mode)}, not a regular file",
                                  "replace it with a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_regular(path: Path, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (see :func:`open_regular`), refused when
    it holds more than ``limit`` bytes. Raises :class:`UnsafePathError` or OSError; a
    symlink comes back as UnsafePathError too."""
    try:
        fd, st = open_regular(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(f"{str(path)!r} is a symbolic link, not a regular file",
                                  "replace it with a regular file") from None
        raise
    try:
        if st.st_size > limit:
            raise UnsafePathError(f"{str(path)!r} is {st.st_size} bytes, over the limit of "
                                  f"{limit}", "replace it with the file fleetd wrote")
        data = read_at_most(fd, limit + 1)
        if len(data) > limit:  # it grew while we read
            raise UnsafePathError(f"{str(path)!r} is over the limit of {limit} bytes",
                                  "replace it with the file fleetd wrote")
        return data
    finally:
        os.close(fd)


def read_at_most(fd: int, limit: int) -> bytes:
    """At most ``limit`` bytes of the open file ``fd``, read to its end or the limit."""
    chunks: list[bytes] = []
    left = limit
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def user_cache_base(env: dict[str, str] | None = None) -> Path:
    """This user's cache directory: ``$XDG_CACHE_HOME``, else ``~/.cache``."""
    env = dict(os.environ) if env is None else env
    given = env.get("XDG_CACHE_HOME")
    if given and os.path.isabs(given):
        return Path(given)
    return Path(env.get("HOME") or Path.home()) / ".cache"
