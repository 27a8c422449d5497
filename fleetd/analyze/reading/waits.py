"""Why a thread was off the CPU: the wait reason of each sleep, from the syscall it was in.

The tracer stamps every off-CPU and run-queue record with the syscall the thread was
blocked in (``ret`` = number + 1, 0 for none) and that syscall's first argument
(``bytes``: the futex word's address, the fd of a read or poll). A sleep is then:

- ``lock``: a futex wait (a mutex, a condition variable, the interpreter lock);
- ``data``: waiting for input: read/recv on a pipe or socket, poll/select/epoll (a
  DataLoader queue, the network);
- ``timer``: a sleep the program asked for (nanosleep, clock_nanosleep);
- ``gpu_sync``: any sleep inside a CUDA synchronization call (waiting for the device);
- ``other``: any other syscall, or a sleep outside a syscall, or no syscall tracing.

Syscall numbers are x86_64's; on another architecture every sleep is ``other``.
"""

from __future__ import annotations

import platform

from fleetd.store.syscalls import NR

REASONS = ("lock", "data", "timer", "gpu_sync", "other")
_BY_NAME = {
    "futex": "lock", "futex_waitv": "lock",
    "read": "data", "pread64": "data", "readv": "data", "recvfrom": "data",
    "recvmsg": "data", "recvmmsg": "data", "poll": "data", "select": "data",
    "epoll_wait": "data", "pselect6": "data", "ppoll": "data", "epoll_pwait": "data",
    "epoll_pwait2": "data", "accept": "data", "accept4": "data",
    "nanosleep": "timer", "clock_nanosleep": "timer",
}
_BY_NR = ({NR[name]: why for name, why in _BY_NAME.items()}
          if platform.machine() in ("x86_64", "AMD64") else {})


# Syscalls that write to an fd: a sleep in one of them waits for room at the other end.
OUTPUT_RETS = frozenset(NR[n] + 1 for n in (
    "write", "writev", "pwrite64", "sendto", "sendmsg", "sendmmsg")
    if n in NR and platform.machine() in ("x86_64", "AMD64"))


def rets_of(*reasons: str) -> frozenset[int]:
    """The ``ret`` values (syscall nr + 1) whose sleeps have one of ``reasons``."""
    return frozenset(nr + 1 for nr, why in _BY_NR.items() if why in reasons)


def reason(ret: int | None) -> str:
    """The wait reason of an off-CPU (or run-queue) record's ``ret`` (syscall nr + 1)."""
    if not ret or ret <= 0:
        return "other"
    return _BY_NR.get(int(ret) - 1, "other")


def sql_reason(column: str = "ret") -> str:
    """The same mapping as an SQL expression over ``column``, so totals group in SQLite."""
    cases = " ".join(f"WHEN {nr + 1} THEN '{r}'" for nr, r in sorted(_BY_NR.items()))
    return f"(CASE {column} {cases} ELSE 'other' END)" if cases else "'other'"
