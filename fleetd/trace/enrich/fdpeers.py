"""What a traced thread slept on when it slept in a read or a write: the file behind
the fd, and for a pipe, FIFO or socket the processes at its other end.

The kernel records the syscall a thread left the CPU in and its first argument (the
fd). While the process lives, ``/proc/PID/fd/FD`` names the object: ``pipe:[INODE]``,
``socket:[INODE]``, a tty (``/dev/pts/3``), a FIFO's or a regular file's path. The
other end of a pipe or FIFO is any other process holding the same object: found by
reading the fd links of the node's processes (bounded: the writer's family first,
then :data:`MAX_PROCS` processes, :data:`MAX_FDS` fds each, at most once per object
every :data:`HOLDERS_EVERY_NS`), with
each holder's access mode from its ``fdinfo`` (a reader holds it O_RDONLY). A TCP or
UDP socket's peer is its remote address (``/proc/PID/net/tcp``...). Every read is of
procfs (links and small text files, which never block on a device) and tolerates the
process being gone: a missing fact is left out.

The result goes on the off-CPU record as ``args.fd`` (the keys of
:class:`fleetd.store.schema.FdInfo`), on one wait per (process, fd) and
:data:`NAME_EVERY_NS`, like the lock names.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable

from fleetd.store.schema import FdHolder, FdInfo
from fleetd.trace.bpf.decoder import Batch
from fleetd.trace.host import procinfo

NAME_EVERY_NS = 1_000_000_000  # an fd named again at most this often
HOLDERS_EVERY_NS = 10_000_000_000  # an object's holders looked for again at most this often
MAX_PROCS = 2048  # processes whose fds one scan for a pipe's other end reads
MAX_FDS = 256  # fds per process that scan reads
MAX_NAMED = 4096  # (pid, fd) pairs remembered before the memory starts over
MAX_PEERS = 8  # holders of the other end kept per object
_ACCMODE = 3  # O_ACCMODE


def kind_of(path: str, pid: int, fd: int) -> str:
    """What an fd link names: pipe, socket, tty, fifo or file."""
    if path.startswith("pipe:"):
        return "pipe"
    if path.startswith("socket:"):
        return "socket"
    if path.startswith(("/dev/pts/", "/dev/tty", "/dev/console")):
        return "tty"
    try:
        if stat.S_ISFIFO(os.stat(f"/proc/{pid}/fd/{fd}").st_mode):
            return "fifo"
    except OSError:
        pass
    return "file"


def _mode(pid: int, fd: int) -> str:
    """r, w or rw, from /proc/PID/fdinfo/FD's flags (octal)."""
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", "rb") as f:
            text = f.read(4096).decode(errors="replace")
    except OSError:
        return "?"
    for line in text.splitlines():
        if line.startswith("flags:"):
            acc = int(line.split()[1], 8) & _ACCMODE
            return {0: "r", 1: "w"}.get(acc, "rw")
    return "?"


def holders(path: str, besides: int, wide: bool = True) -> list[FdHolder]:
    """Processes other than ``besides`` with an fd whose link reads ``path``: its
    parent and the parent's children first (a shell pipeline, a spawned shipper), the
    rest of the node only when none of them holds it and ``wide``."""
    family = _family(besides)
    out = _scan(path, [p for p in family if p != besides])
    if out or not wide:
        return out
    try:
        rest = sorted(int(e.name) for e in os.scandir("/proc") if e.name.isdigit())
    except OSError:
        return out
    seen = set(family)
    return _scan(path, [p for p in rest[:MAX_PROCS] if p not in seen and p != besides])


def _family(pid: int) -> list[int]:
    """The process's parent, the parent's children (its siblings) and its own."""
    parent = procinfo.ppid_of(pid)
    kin = [p for p in (parent,) if p and p > 1]
    for p in [*kin, pid]:
        try:
            with open(f"/proc/{p}/task/{p}/children", "rb") as f:
                kin += [int(c) for c in f.read(1 << 16).split()]
        except (OSError, ValueError):
            continue
    return list(dict.fromkeys(kin))


def _scan(path: str, pids: list[int]) -> list[FdHolder]:
    out: list[FdHolder] = []
    for pid in pids:
        fd = _fd_holding(pid, path)
        if fd is not None:
            out.append({"pid": pid, "comm": procinfo.comm(pid), "mode": _mode(pid, fd)})
            if len(out) >= MAX_PEERS:
                break
    return out


def _fd_holding(pid: int, path: str) -> int | None:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or not ours to read
        return None
    for fd in fds[:MAX_FDS]:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == path:
                return int(fd)
        except (OSError, ValueError):
            continue
    return None


def _hex_addr(text: str) -> str:
    """/proc/net/tcp's ADDR:PORT (little-endian hex) as host:port."""
    addr, port = text.split(":")
    raw = bytes.fromhex(addr)
    if len(raw) == 4:
        host = ".".join(str(b) for b in raw[::-1])
    else:  # IPv6: four little-endian 32-bit words
        words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
        flat = b"".join(words)
        host = "[" + ":".join(flat[i:i + 2].hex() for i in range(0, 16, 2)) + "]"
    return f"{host}:{int(port, 16)}"


def socket_ends(pid: int, inode: str) -> tuple[str, str] | None:
    """(local, remote) of a TCP or UDP socket by inode, from the process's net tables."""
    for table in ("tcp", "tcp6", "udp", "udp6"):
        try:
            with open(f"/proc/{pid}/net/{table}", "rb") as f:
                lines = f.read(1 << 20).decode(errors="replace").splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 9 and cols[9] == inode:
                try:
                    return _hex_addr(cols[1]), _hex_addr(cols[2])
                except ValueError:
                    return None
    return None


HoldersOf = Callable[[str, int, bool], list[FdHolder]]


def describe(pid: int, fd: int, holders_of: HoldersOf | None = None) -> FdInfo | None:
    """What fd ``fd`` of ``pid`` is, and who holds its other end (``holders_of``,
    default :func:`holders`); None when gone."""
    try:
        path = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None
    info: FdInfo = {"path": path, "kind": kind_of(path, pid, fd)}
    if info["kind"] in ("pipe", "fifo", "socket"):
        # A socket's other end is another socket (its address says where): only a
        # process it was forked into shares this one, so the node is not scanned.
        peers = (holders_of or holders)(path, pid, info["kind"] != "socket")
        if peers:
            info["peers"] = peers
    if info["kind"] == "socket":
        ends = socket_ends(pid, path[len("socket:["):-1])
        if ends:
            info["local"], info["remote"] = ends
    return info


class FdNames:
    """Puts :func:`describe` on waits in reads and writes (``args.fd``), once per
    (process, fd) and :data:`NAME_EVERY_NS`; an object's holders found once per
    :data:`HOLDERS_EVERY_NS`, whichever process asks (a scan of the node is the costly
    part)."""

    def __init__(self) -> None:
        self._named: dict[tuple[int, int], int] = {}
        self._holders: dict[str, tuple[int, list[FdHolder]]] = {}

    def _holders_of(self, path: str, pid: int, wide: bool) -> list[FdHolder]:
        now = time.monotonic_ns()
        seen = self._holders.get(path)
        if seen is not None and now - seen[0] < HOLDERS_EVERY_NS:
            return [h for h in seen[1] if h["pid"] != pid]
        if len(self._holders) > MAX_NAMED:
            self._holders.clear()
        found = holders(path, pid, wide)
        self._holders[path] = (now, found)
        return found

    def resolve(self, batch: Batch) -> None:
        if not batch.fd_waits:
            return
        now = time.monotonic_ns()
        if len(self._named) > MAX_NAMED:
            self._named.clear()
        have = {row: a for row, a in batch.args if isinstance(a, dict)}
        for row, pid, fd in batch.fd_waits:
            last = self._named.get((pid, fd))
            if last is not None and now - last < NAME_EVERY_NS:
                continue
            self._named[(pid, fd)] = now
            info = describe(pid, fd, self._holders_of)
            if info is None:
                continue
            if row in have:
                have[row]["fd"] = info
            else:
                batch.args.append((row, {"fd": info}))
