"""Kernel names and function names of a process that has exited (issue #41).

A loaded tracer drains a short job's launches after the job is gone: /proc/PID/maps and
/proc/PID/root are gone with it. The symbolizer keeps each process's executable mappings
as the tracer last read them and reads the mapped file by its path, only while that path
still holds the very file the process mapped. Real processes, real libraries.
"""

from __future__ import annotations

import ctypes.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fleetd.trace.enrich import symbols as symbols_mod
from fleetd.trace.enrich.stacks import OP_CUDA_LAUNCH, KernelNames
from fleetd.trace.enrich.symbols import FunctionSymbols

# Loads LIB (libc when "-"), prints the address of FUNC in it, and waits for stdin to close.
SHOW = r"""
import ctypes, sys
lib = ctypes.CDLL(None if sys.argv[1] == "-" else sys.argv[1])
print(ctypes.cast(getattr(lib, sys.argv[2]), ctypes.c_void_p).value, flush=True)
sys.stdin.read()
"""


class Child:
    """A process that has ``func`` of ``lib`` mapped, until :meth:`exit`."""

    def __init__(self, lib: str, func: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SHOW, lib, func],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.pid = self.proc.pid
        self.addr = int(self.proc.stdout.readline())

    def exit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0
        assert not Path(f"/proc/{self.pid}").exists()


@pytest.fixture
def libm_copy(tmp_path: Path) -> Path:
    """A fresh file (its symbols never read before) with functions in it."""
    found = ctypes.util.find_library("m")
    assert found, "no libm"
    src = next(p for d in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu",
                           "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/lib64")
               if (p := Path(d) / found).exists())
    out = tmp_path / "libm-copy.so.6"
    shutil.copy(src, out)
    return out


def test_a_launch_drained_after_its_process_exited_gets_its_kernel_name() -> None:
    """The GPU check's stand-in job launches libc's abs and exits before a loaded tracer
    names its launches: the mappings read at start still name them."""
    child = Child("-", "abs")
    syms = FunctionSymbols()
    kernels = KernelNames({}, syms)  # no fl_knames map: runtime launches only
    syms.remember(child.pid)  # what the tracer does at start and at each maps scan
    child.exit()
    assert kernels.name(child.pid, OP_CUDA_LAUNCH, child.addr) == "abs"


def test_a_library_of_an_exited_process_is_read_from_its_path(libm_copy: Path) -> None:
    child = Child(str(libm_copy), "cbrt")
    alive = FunctionSymbols().locate(child.pid, child.addr)
    assert alive[0] is not None and alive[1] == libm_copy.name, alive
    syms = FunctionSymbols()
    syms.remember(child.pid)
    child.exit()
    assert syms.locate(child.pid, child.addr) == alive


def test_a_file_replaced_after_the_exit_is_not_read(libm_copy: Path, tmp_path: Path) -> None:
    """The path now holds another file (a reinstalled library): its symbols would name
    the address wrongly, so it is named by its file only."""
    child = Child(str(libm_copy), "cbrt")
    syms = FunctionSymbols()
    syms.remember(child.pid)
    child.exit()
    other = tmp_path / "other"
    shutil.copy(libm_copy, other)
    other.replace(libm_copy)  # another inode at the same path
    sym, lib, _ = syms.locate(child.pid, child.addr)
    assert (sym, lib) == (None, libm_copy.name)


def test_an_exited_process_never_read_is_not_named() -> None:
    child = Child("-", "abs")
    child.exit()
    assert FunctionSymbols().locate(child.pid, child.addr) == (None, None, child.addr)


def test_the_processes_kept_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent lives for weeks: the oldest read process goes first, and a live one
    dropped is read again on its next address."""
    monkeypatch.setattr(symbols_mod, "MAX_PIDS", 2)
    children = [Child("-", "abs") for _ in range(3)]
    try:
        syms = FunctionSymbols()
        for c in children:
            syms.remember(c.pid)
        assert list(syms._maps) == [c.pid for c in children[1:]]
        assert syms.name(children[0].pid, children[0].addr) == ("abs", "libc.so.6")
        assert list(syms._maps) == [children[2].pid, children[0].pid]
    finally:
        for c in children:
            c.exit()
