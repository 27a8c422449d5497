"""Files a traced process controls, read so that they cannot steer, block or flood us.

The agent runs as root and reads files on behalf of the processes it traces: their
``/proc/PID/{environ,cmdline,cgroup,comm,stat,status}``, and files inside their
containers through ``/proc/PID/root`` (the service-account namespace). What those
processes put there is theirs to choose, so every such read goes through here:

* A file **inside the process's root** is resolved by the kernel with ``openat2`` and
  ``RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS`` from a directory descriptor of
  ``/proc/PID/root``: an absolute link and every ``..`` stay inside that root (a link to
  ``/etc/shadow`` names the container's, never the host's), and a ``/proc/*/root``-style
  magic link is refused. Where ``openat2`` is missing (kernels before 5.6, seccomp
  filters that deny it) the same walk is done one component at a time with
  ``O_PATH | O_NOFOLLOW``, each link read as text and resolved again inside the root.
* The file is first opened ``O_PATH`` (which opens nothing: a device's driver is never
  called, a FIFO never waited on) and must be a **regular file**; only then is it
  reopened for reading, ``O_NONBLOCK | O_NOCTTY | O_CLOEXEC``. A FIFO, device, socket
  or directory is skipped with one logged note.
* At most ``limit`` bytes are read (each caller names its cap), so /dev/zero's
  stream or a 10 MB file costs nothing.

Every function returns None where the file cannot be read (the process exited, the file
is missing, refused or not regular); none raises.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from fleetd.security.private_dir import file_kind, read_at_most

log = logging.getLogger(__name__)

PROC = "/proc"
# Caps of the /proc files read per process: what fleetd uses sits at their start.
COMM_MAX = 64  # the kernel's comm is 16 bytes
STAT_MAX = 4096  # one line of numbers after the (comm)
STATUS_MAX = 16 << 10
CMDLINE_MAX = 64 << 10
ENVIRON_MAX = 256 << 10  # torchrun's variables; a longer environment is cut
CGROUP_MAX = 64 << 10  # one line per hierarchy

_SYS_OPENAT2 = 437  # the same number on every architecture (the unified syscall table)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10
_PATH_FLAGS = os.O_PATH | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_MAX_LINKS = 40  # the kernel's own limit on links in one resolution
_NOTED_MAX = 4096  # (pid, path) pairs already logged: one note each, bounded


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_have_openat2: bool | None = None  # None: not tried yet
_noted: set[tuple[int, str]] = set()


def _openat2(dirfd: int, path: str) -> int | None:
    """An O_PATH descriptor of ``path`` resolved inside ``dirfd``; None when the kernel
    has no openat2 (the caller walks instead). Raises OSError as openat2 fails."""
    global _have_openat2
    if _have_openat2 is False:
        return None
    how = _OpenHow(_PATH_FLAGS, 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
    fd = int(_libc.syscall(_SYS_OPENAT2, dirfd, os.fsencode(path), ctypes.byref(how),
                           ctypes.sizeof(how)))
    if fd >= 0:
        _have_openat2 = True
        return fd
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM) and not _have_openat2:
        _have_openat2 = False  # absent, or denied by a seccomp filter: walk from now on
        return None
    raise OSError(err, os.strerror(err), path)


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p and p != "."]


def walk_in_root(root_fd: int, path: str) -> int:
    """An O_PATH descriptor of ``path`` resolved inside ``root_fd`` without openat2:
    one component at a time, never following a link in the kernel (``O_NOFOLLOW``);
    a link's text is resolved again here, an absolute one from the root, and ``..``
    never climbs above the root. Raises OSError (ELOOP past 40 links)."""
    todo = deque(_parts(path))
    dirs = [os.dup(root_fd)]  # the directories walked through, the root first
    links = 0
    try:
        while todo:
            name = todo.popleft()
            if name == "..":
                if len(dirs) > 1:
                    os.close(dirs.pop())
                continue
            fd = os.open(name, _PATH_FLAGS | os.O_NOFOLLOW, dir_fd=dirs[-1])
            mode = os.fstat(fd).st_mode
            if stat.S_ISLNK(mode):
                os.close(fd)
                links += 1
                if links > _MAX_LINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
                target = os.readlink(name, dir_fd=dirs[-1])
                if target.startswith("/"):
                    while len(dirs) > 1:
                        os.close(dirs.pop())
                todo.extendleft(reversed(_parts(target)))
            elif not todo:
                return fd
            elif not stat.S_ISDIR(mode):
                os.close(fd)
                raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
            else:
                dirs.append(fd)
        return os.dup(dirs[-1])  # the path named the root itself (or a dir above it)
    finally:
        for d in dirs:
            os.close(d)


def _note(pid: int, path: str, why: str) -> None:
    """One log line per (pid, path): a hostile container forking many processes with
    the same FIFO is told once each, and the set of told ones stays bounded."""
    if (pid, path) in _noted:
        return
    if len(_noted) >= _NOTED_MAX:
        _noted.clear()
    _noted.add((pid, path))
    log.warning("pid %d: not reading %s: %s", pid, path, why)


def _reopen_regular(pid: int, path_fd: int, shown: str) -> int | None:
    """A descriptor open for reading (O_NONBLOCK, O_NOCTTY) of the file behind the
    O_PATH descriptor ``path_fd`` (which is closed), when it is a regular file: the same
    file, reopened through it. Anything else gets a note and None."""
    try:
        mode = os.fstat(path_fd).st_mode
        if not stat.S_ISREG(mode):
            _note(pid, shown, f"not a regular file ({file_kind(mode)})")
            return None
        fd = os.open(f"{PROC}/self/fd/{path_fd}", _READ_FLAGS)
    except OSError:
        return None
    finally:
        os.close(path_fd)
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    os.close(fd)
    return None


def _read_regular(pid: int, path_fd: int, shown: str, limit: int) -> bytes | None:
    """At most ``limit`` bytes of :func:`_reopen_regular`'s file; None where it has none."""
    fd = _reopen_regular(pid, path_fd, shown)
    if fd is None:
        return None
    try:
        return read_at_most(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def open_in_root(root_fd: int, path: str, *, walk: bool = False) -> int:
    """An O_PATH descriptor of ``path`` resolved inside the directory ``root_fd`` (by
    openat2, else :func:`walk_in_root`; ``walk`` forces the walk). Raises OSError."""
    for _ in range(3):  # EAGAIN: a rename raced the resolution; the kernel asks to retry
        try:
            fd = None if walk else _openat2(root_fd, path)
            return walk_in_root(root_fd, path) if fd is None else fd
        except BlockingIOError:
            continue
    raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN), path)


def _path_under(root_fd: int, path: str, pid: int, walk: bool = False) -> int | None:
    """:func:`open_in_root`, None (and a note, unless the file is simply not there)
    where it fails."""
    try:
        return open_in_root(root_fd, path, walk=walk)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ESRCH, errno.ENOTDIR):
            _note(pid, path, f"{exc.strerror} (resolved inside its root)")
        return None


def read_under(root_fd: int, path: str, limit: int, pid: int = 0, *,
               walk: bool = False) -> bytes | None:
    """At most ``limit`` bytes of the regular file ``path`` inside the directory
    ``root_fd`` (notes name ``pid``); None when it cannot be read."""
    fd = _path_under(root_fd, path, pid, walk)
    return None if fd is None else _read_regular(pid, fd, path, limit)


def _open_root(pid: int) -> int | None:
    try:
        return os.open(f"{PROC}/{pid}/root", _PATH_FLAGS | os.O_DIRECTORY)
    except OSError:
        return None


def read_in_root(pid: int, path: str, limit: int) -> bytes | None:
    """At most ``limit`` bytes of the regular file ``path`` as process ``pid`` sees it,
    resolved inside its root (module docstring); None when it cannot be read."""
    root = _open_root(pid)
    if root is None:
        return None
    try:
        return read_under(root, path, limit, pid)
    finally:
        os.close(root)


@contextmanager
def regular_in_root(pid: int, path: str) -> Iterator[str | None]:
    """A path for the whole regular file ``path`` as process ``pid`` sees it (resolved
    inside its root, never a FIFO or device): ``/proc/self/fd/N`` of a descriptor open
    for the ``with`` block, for readers that take a path (an ELF parser: a mapped
    library is read whole, however large). None when there is no such file."""
    root = _open_root(pid)
    fd = None
    if root is not None:
        try:
            found = _path_under(root, path, pid)
            fd = None if found is None else _reopen_regular(pid, found, path)
        finally:
            os.close(root)
    try:
        yield None if fd is None else f"{PROC}/self/fd/{fd}"
    finally:
        if fd is not None:
            os.close(fd)


def read_bounded(path: str, limit: int, pid: int = 0) -> bytes | None:
    """At most ``limit`` bytes of the regular file ``path``, never through a link at its
    last component, never blocking; None when it cannot be read (notes name ``pid``)."""
    try:
        fd = os.open(path, _PATH_FLAGS | os.O_NOFOLLOW)
    except OSError:
        return None
    return _read_regular(pid, fd, path, limit)


def read_proc(pid: int, name: str, limit: int, tid: int | None = None) -> bytes | None:
    """At most ``limit`` bytes of ``/proc/PID/<name>`` (``/proc/PID/task/TID/<name>``
    with ``tid``): the kernel's files about the process, whose content it controls
    (its environment, arguments, name); None when the process is gone."""
    where = f"{PROC}/{pid}/task/{tid}/{name}" if tid else f"{PROC}/{pid}/{name}"
    return read_bounded(where, limit, pid)


def read_proc_text(pid: int, name: str, limit: int, tid: int | None = None) -> str | None:
    """:func:`read_proc` decoded (bytes that are not UTF-8 replaced)."""
    raw = read_proc(pid, name, limit, tid)
    return None if raw is None else raw.decode(errors="replace")
