"""Python frames on every CPython the machine has (3.10 on: pyenv's, Debian's 3.11),
end to end: real BPF programs, the real CUDA runtime, the interpreter under test.

The traced script calls cudaStreamSynchronize from ``inner``, called from ``outer``,
on the main thread and on a second thread at once; every stacked call must carry
``inner`` and ``outer`` with this script's file and lines, read by the kernel's walk
with the offsets of that interpreter. A version the machine lacks is a skip with its
reason (``pytest -rs`` lists it), never a silent pass.
"""

from __future__ import annotations

import glob
import json
import os
import sqlite3
import sys
from pathlib import Path
from typing import Any

import pytest
from recorder import running
from test_trace import _bpf_ready
from workload_run import trace_in_process

from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "workloads"))
from train_loop import find_cudart  # noqa: E402

VERSIONS = ["3.10", "3.11", "3.12", "3.13"]
DEBIAN_311 = "/usr/bin/python3.11"
CALLS = 6  # per thread

SCRIPT = """\
import ctypes, json, os, sys, threading, time
rt = ctypes.CDLL(sys.argv[1])
go = sys.argv[2]

def inner():
    return rt.cudaStreamSynchronize(None)  # SYNC

def outer():
    for _ in range(CALLS):
        inner()  # CALL
        time.sleep(0.05)

def side():
    while not os.path.exists(go):
        time.sleep(0.02)
    outer()

t = threading.Thread(target=side)
t.start()
while not os.path.exists(go):
    time.sleep(0.02)
outer()
t.join()
print(json.dumps({"pid": os.getpid(), "main": threading.get_native_id(), "side": t.native_id}))
""".replace("CALLS", str(CALLS))

_WHY = _bpf_ready()
# The bpf mark is per interpreter (interpreters()): a version not installed is no
# BPF test.
pytestmark = [pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]


def pyenv_python(version: str) -> str | None:
    """pyenv's newest build of a minor version, if the machine has one."""
    root = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    hits = glob.glob(f"{root}/versions/{version}.*/bin/python{version}")
    hits = [h for h in hits if os.access(h, os.X_OK)]
    return max(hits, key=lambda h: [int(x) for x in h.split("/")[-3].split(".")]) if hits else None


def interpreters() -> list[Any]:
    """One param per interpreter the tests want. An installed one is a BPF test (in CI
    a skip of it fails: tests/conftest.py); one the machine lacks is a plain skip with
    its reason, so CI reports it instead of failing on an image without it."""
    out = []
    for v in VERSIONS:
        exe = pyenv_python(v)
        out.append(pytest.param(exe or v, id=f"pyenv-{v}", marks=pytest.mark.bpf if exe else
                                pytest.mark.skip(reason=f"CPython {v}: no pyenv build here")))
    have = os.access(DEBIAN_311, os.X_OK)
    out.append(pytest.param(DEBIAN_311, id="debian-3.11", marks=pytest.mark.bpf if have else
                            pytest.mark.skip(reason=f"{DEBIAN_311} is not installed here")))
    return out


def _line(fragment: str) -> int:
    hits = [i for i, line in enumerate(SCRIPT.splitlines(), 1) if fragment in line]
    assert len(hits) == 1
    return hits[0]


def _trace(exe: str, tmp: Path) -> tuple[Path, dict[str, Any], Any, str]:
    from fleetd.trace.enrich import pyframes

    script, go, db = tmp / "nested.py", tmp / "go", tmp / "py.db"
    script.write_text(SCRIPT)
    with running([exe, str(script), find_cudart(), str(go)]) as wl:
        interp = pyframes.find_interpreter(wl.pid)
        assert interp is not None and interp.layout is not None, interp
        made, summary = trace_in_process(wl, db, "py-node", go, sample=1, stack_sample=1)
    return db, made, summary, interp.layout.source


@pytest.mark.parametrize("exe", interpreters())
def test_frames_name_both_functions_on_both_threads(exe: str, tmp_path: Path) -> None:
    db, made, summary, source = _trace(exe, tmp_path)
    version = tuple(int(x) for x in exe.rsplit("python", 1)[1].split(".")[:2])
    # 3.13 on: the offsets come from the interpreter itself, not fleetd's table.
    assert source == ("_Py_DebugOffsets" if version >= (3, 13) else "table")
    assert summary.lost_total == 0
    script = tmp_path / "nested.py"
    with sqlite3.connect(db) as c:
        rows = c.execute("SELECT e.tid, s.frames FROM events e JOIN stacks s ON "
                         "s.hash = e.stack WHERE e.op = 'cudaStreamSynchronize'").fetchall()
        targets = json.loads(c.execute("SELECT targets FROM sessions").fetchone()[0])
    assert targets["python"] == {str(made["pid"]): f"CPython {version[0]}.{version[1]}"}
    inner = f"inner ({script}:{_line('# SYNC')})"
    outer = f"outer ({script}:{_line('# CALL')})"
    by_tid: dict[int, int] = {}
    for tid, frames in rows:
        py = [f for f in json.loads(frames) if f.endswith(")") and ".py:" in f]
        assert py[:2] == [inner, outer], (tid, py)
        # Below outer: side (a Thread's target) on the second thread, the module on main.
        want = "<module> (" if tid == made["main"] else f"side ({script}:"
        assert py[2].startswith(want), (tid, py)
        by_tid[tid] = by_tid.get(tid, 0) + 1
    assert by_tid == {made["main"]: CALLS, made["side"]: CALLS}
