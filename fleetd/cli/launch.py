"""``fleetd trace [options] -- CMD ARGS``: the program started under the tracer.

The command is forked first and held before its ``exec`` (blocked on a pipe), so the
tracer knows its pid and has its probes in place before the program's first instruction;
then it is released. Its exit status is fleetd's (128 + N when signal N ended it, as a
shell says), and the signals a supervisor sends fleetd (SIGTERM, SIGHUP) go on to it:
tracing ends when the program does, as with ``py-spy record --`` and ``nsys profile``. A
Ctrl-C at the terminal reaches the program directly (it stays in fleetd's process group),
so the first SIGINT is not sent again; a second one is (a program that ignored it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
from dataclasses import dataclass, field

from fleetd.errors import UsageError

EXEC_FAILED = 127  # the shell's "command not found / not executable"


def command_of(words: list[str]) -> list[str]:
    """The words after ``--`` (argparse keeps the separator in a remainder)."""
    return words[1:] if words[:1] == ["--"] else words


def resolve(cmd: list[str]) -> str:
    """The program's path, or a one-line error before anything is started."""
    exe = shutil.which(cmd[0])
    if exe is None:
        raise UsageError(f"command {cmd[0]!r} not found or not executable",
                         "give the program's path or a name on $PATH after --, e.g. "
                         "fleetd trace -- python3 train.py")
    return exe


@dataclass
class Child:
    """A forked program held before its exec until :meth:`release`."""

    pid: int
    _go: int
    code: int | None = None
    received: list[int] = field(default_factory=list)

    @classmethod
    def spawn(cls, cmd: list[str]) -> Child:
        exe = resolve(cmd)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: wait for the tracer, then become the program
            try:
                os.close(w)
                if os.read(r, 1) != b"1":  # fleetd gave up: never run untraced
                    os._exit(EXEC_FAILED)
                os.close(r)
                os.execv(exe, cmd)
            except OSError as exc:
                sys.stderr.write(f"fleetd: cannot run {cmd[0]!r}: {exc.strerror}\n")
            finally:
                os._exit(EXEC_FAILED)
        os.close(r)
        return cls(pid, w)

    def release(self) -> None:
        os.write(self._go, b"1")
        os.close(self._go)

    def abandon(self) -> None:
        """The tracer did not start: the program never runs."""
        os.close(self._go)  # its read gets EOF and it exits 127 before exec
        os.waitpid(self.pid, 0)

    def poll(self) -> int | None:
        """Its exit status once it has exited (128 + N for signal N), else None."""
        if self.code is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.code = (os.WEXITSTATUS(status) if os.WIFEXITED(status)
                             else 128 + os.WTERMSIG(status))
        return self.code

    def forward(self, signum: int) -> None:
        """A signal sent to fleetd goes on to the program (the first SIGINT excepted:
        the terminal gave the program its own)."""
        first_int = signum == signal.SIGINT and signal.SIGINT not in self.received
        self.received.append(signum)
        if first_int or self.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signum)


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
