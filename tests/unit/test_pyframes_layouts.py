"""fleetd's CPython layouts against the interpreters installed here.

- The table (fleetd.trace.enrich.pyframes.LAYOUTS) against offsetof from each version's own
  headers: tests/unit/pylayout_probe.c compiled with gcc per interpreter.
- 3.13's _Py_DebugOffsets, read from the file, against the same measurement.
- The line-table readers against the interpreter's own answer (co_lines on 3.10,
  co_positions from 3.11) for every code object of a few stdlib modules.
- The interpreter lock of a live process: where fleetd says it is, the symbol names it
  ``_PyRuntime+...``, which is what lock_contention recognises as the GIL.

A version the machine lacks is a skip with its reason.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fleetd.trace.enrich import pydebug, pyframes, symbols

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "integration"))
from test_pyversions import DEBIAN_311, VERSIONS, pyenv_python  # noqa: E402


def _interpreters() -> list[Any]:
    out = []
    for v in VERSIONS:
        exe = pyenv_python(v)
        out.append(pytest.param(exe or v, id=f"pyenv-{v}", marks=pytest.mark.skipif(
            exe is None, reason=f"CPython {v}: no pyenv build here")))
    out.append(pytest.param(DEBIAN_311, id="debian-3.11", marks=pytest.mark.skipif(
        not os.access(DEBIAN_311, os.X_OK), reason=f"{DEBIAN_311} is not installed here")))
    return out


def _version(exe: str) -> tuple[int, int]:
    a, b = exe.rsplit("python", 1)[1].split(".")[:2]
    return int(a), int(b)


def _include(exe: str) -> str:
    out = subprocess.run([exe, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize("exe", _interpreters())
def test_table_matches_offsetof_of_the_headers(exe: str, tmp_path: Path) -> None:
    inc = _include(exe)
    if not Path(inc, "internal", "pycore_runtime.h").exists():
        pytest.skip(f"{exe}: no internal headers at {inc} (python3-dev lacks them?)")
    probe = tmp_path / "probe"
    subprocess.run(["gcc", "-o", str(probe), f"-I{inc}", f"-I{inc}/internal",
                    str(HERE / "pylayout_probe.c")], check=True)
    got = dict(line.split("=") for line in subprocess.run(
        [str(probe)], capture_output=True, text=True, check=True).stdout.split())
    lay = pyframes.LAYOUTS[_version(exe)]
    for name, value in got.items():
        assert getattr(lay, name) == int(value), (exe, name, getattr(lay, name), value)
    # What the probe cannot print for this version has its "none" value.
    if "cframe_frame" not in got:
        assert lay.cframe_frame == pyframes.FL_PY_DIRECT
    if "owner_skip" not in got:
        assert lay.owner_skip == pyframes.NO_OWNER_SKIP


def test_debug_offsets_of_313_match_the_measured_table() -> None:
    exe = pyenv_python("3.13")
    if exe is None:
        pytest.skip("CPython 3.13: no pyenv build here")
    lib = next(Path(exe).resolve().parent.parent.glob("lib/libpython3.13.so*"), None)
    path = str(lib or exe)
    image = symbols.load_image(path, ("STT_OBJECT",))
    assert image is not None
    runtime = pyframes._symbol(image, "_PyRuntime")
    assert runtime is not None
    hexv, free, off = pydebug.parse(lambda n: pyframes._file_bytes(path, runtime, n))
    assert pydebug.version_of(hexv) == (3, 13) and not free
    read = pyframes.layout_from_debug(off, free)
    assert read.source == "_Py_DebugOffsets"
    table = pyframes.LAYOUTS[(3, 13)]
    assert dataclasses.replace(read, source="table") == table
    assert pyframes.support_of(exe) is None


def test_debug_offsets_of_an_unknown_layout_are_refused() -> None:
    # A 3.14 table: the cookie and version are where every version keeps them; what
    # follows is laid out otherwise, so it must be refused, not read.
    head = pydebug.COOKIE + (0x030E00F0).to_bytes(8, "little") + bytes(8)
    with pytest.raises(pydebug.DebugOffsetsError, match="CPython 3.14"):
        pydebug.parse(lambda n: (head + bytes(4096))[:n])
    with pytest.raises(pydebug.DebugOffsetsError, match="no _Py_DebugOffsets cookie"):
        pydebug.parse(lambda n: bytes(n))


LINES_SCRIPT = """\
import json, sys, inspect, threading, json.decoder, argparse
out = []
def codes(c):
    yield c
    for k in c.co_consts:
        if inspect.iscode(k):
            yield from codes(k)
for mod in (threading, json.decoder, argparse):
    for c in codes(compile(inspect.getsource(mod), mod.__file__, "exec")):
        if sys.version_info >= (3, 11):
            lines = [p[0] for p in c.co_positions()]
        else:
            lines = [[s, e, l] for s, e, l in c.co_lines()]
        out.append([c.co_linetable.hex(), c.co_firstlineno, lines])
print(json.dumps(out))
"""


@pytest.mark.parametrize("exe", _interpreters())
def test_line_tables_read_as_the_interpreter_reads_them(exe: str) -> None:
    got = json.loads(subprocess.run([exe, "-c", LINES_SCRIPT], capture_output=True,
                                    text=True, check=True).stdout)
    checked = 0
    for table_hex, first, lines in got:
        table = bytes.fromhex(table_hex)
        if _version(exe) >= (3, 11):
            for index, line in enumerate(lines):
                assert pyframes.line_at(table, first, index) == line, (first, index)
                checked += 1
        else:
            for start, end, line in lines:
                for offset in range(start, end, 2):
                    assert pyframes.line_at_310(table, first, offset) == line, (first, offset)
                    checked += 1
    assert checked > 10_000


@pytest.mark.skipif(os.geteuid() != 0, reason="reads another process's memory: needs root")
@pytest.mark.parametrize("exe", _interpreters())
def test_interpreter_lock_is_named_inside_pyruntime(exe: str) -> None:
    from fleetd.trace.enrich.symbols import DataSymbols

    p = subprocess.Popen([exe, "-c", "import time; time.sleep(30)"])
    try:
        deadline, interp = time.monotonic() + 10, None
        while time.monotonic() < deadline and (interp is None or not interp.runtime):
            time.sleep(0.1)
            interp = pyframes.find_interpreter(p.pid)
        assert interp is not None and interp.layout is not None, exe
        mem = pyframes.Memory(p.pid)
        try:
            gil = pyframes.gil_address(interp, mem)
            assert gil is not None
            # The lock's first field is its switch interval in microseconds: 5000 unless
            # the script set sys.setswitchinterval (this one does not).
            assert int.from_bytes(mem.read(gil, 8), "little") == 5000
        finally:
            mem.close()
        name = DataSymbols().name(p.pid, gil)
        # fleetd.analyze.causes.contention.PY_RUNTIME: a futex there is the interpreter lock. The
        # waits sit on the lock's mutex and condition variables, all inside the struct.
        assert name is not None and name.startswith("_PyRuntime+"), (exe, name)
        end = DataSymbols().name(p.pid, gil + interp.layout.gil_size - 1)
        assert end is not None and end.startswith("_PyRuntime+")
    finally:
        p.kill()
        p.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="lists other processes' interpreters: needs root")
def test_check_lists_running_python_processes() -> None:
    from fleetd.trace.checks import _python_check

    want = {"3.12": "CPython 3.12: Python frames read (offsets from fleetd's table)",
            "3.13": "CPython 3.13: Python frames read (offsets from its _Py_DebugOffsets)",
            "3.9": "CPython 3.9: no Python frames (CPython 3.9 is not supported"}
    procs = {}
    try:
        for v in want:
            exe = pyenv_python(v)
            if exe is not None:
                procs[v] = subprocess.Popen([exe, "-c", "import time; time.sleep(30)"])
        if not procs:
            pytest.skip("none of pyenv's 3.9, 3.12, 3.13 here")
        time.sleep(1.0)  # mapped libpython
        check = _python_check()
        for v, p in procs.items():
            assert check.data["processes"][str(p.pid)].startswith(want[v]), check.data
            assert f"pid {p.pid} CPython {v} (" in check.detail
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_313_layout_choice_falls_back_to_the_file_and_refuses_unknown_tables() -> None:
    exe = pyenv_python("3.13")
    if exe is None:
        pytest.skip("CPython 3.13: no pyenv build here")
    path = str(next(Path(exe).resolve().parent.parent.glob("lib/libpython3.13.so*"), exe))
    image = symbols.load_image(path, ("STT_OBJECT",))
    assert image is not None
    runtime = pyframes._symbol(image, "_PyRuntime")
    assert runtime is not None

    def unreadable(n: int) -> bytes:
        raise OSError("process gone")

    interp = pyframes.Interpreter(0, (3, 13), path)
    pyframes._choose_layout(interp, unreadable,
                            lambda n: pyframes._file_bytes(path, runtime, n))
    assert interp.layout is not None and interp.layout.source == "_Py_DebugOffsets"
    assert interp.hexversion >> 16 == 0x030D and interp.problem is None
    # A 3.14 process: its table is refused with the reason, not read with 3.13's layout.
    newer = pydebug.COOKIE + (0x030E00F0).to_bytes(8, "little") + bytes(1024)
    interp = pyframes.Interpreter(0, (3, 14), path)
    pyframes._choose_layout(interp, lambda n: newer[:n], lambda n: newer[:n])
    assert interp.layout is None
    assert "laid out differently" in (interp.problem or ""), interp.problem


@pytest.mark.skipif(os.geteuid() != 0, reason="reads another process's memory: needs root")
def test_a_torn_pointer_past_2_63_is_unreadable_not_a_crash() -> None:
    """A frame the target rewrites mid-read can hand over any 64-bit value; pread's
    offset is signed, and one past 2^63 raised OverflowError, which ended the tracer
    (make bench: the data_starvation scenario's trace exited 1)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline, interp = time.monotonic() + 10, None
        while time.monotonic() < deadline and (interp is None or interp.layout is None):
            time.sleep(0.1)
            interp = pyframes.find_interpreter(p.pid)
        assert interp is not None and interp.layout is not None
        mem = pyframes.Memory(p.pid)
        try:
            for addr in (1 << 63, (1 << 64) - 8, -8):
                with pytest.raises(OSError):
                    mem.read(addr, 8)
            # A code object whose pointers are garbage is named as unreadable.
            assert pyframes.frame_name(interp, mem, (1 << 64) - 64, 0) is None
        finally:
            mem.close()
    finally:
        p.kill()
        p.wait()
