"""The interpreter lock on every CPython the machine has (3.10 on: pyenv's, Debian's
3.11), live: the reference workload under the interpreter under test feeds the CUDA
runtime from its main thread while a pure-Python thread (``py-busy``) computes beside
it; ``fleetd trace --stacks`` records it and ``fleetd explain`` must find
lock_contention on the interpreter lock (its futex named inside ``_PyRuntime``: the
3.10/3.11 runtime's own lock, 3.12+'s main interpreter's), held by the busy thread, in
the busy loop's own function and file. A version the machine lacks is a skip with its
reason.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from recorder import BASE, WORKLOAD, explain, trace_one
from test_pyversions import interpreters

from conftest import REPO

# The bpf mark is per interpreter (test_pyversions.interpreters).
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="records with eBPF: needs root")]

SECONDS = 4.0


def _cudart() -> str:
    import sys

    sys.path.insert(0, str(REPO / "tests" / "workloads"))
    from train_loop import find_cudart

    return find_cudart()


def _loop_line() -> int:
    """The busy loop's body: the interpreter lets the lock go at the loop's backward
    jump, filed under that line on every version (3.10's f_lasti and 3.11+'s
    location table alike)."""
    lines = WORKLOAD.read_text().splitlines()
    body = [i for i, t in enumerate(lines, 1) if "x = (x + i * i) % 1_000_003" in t]
    assert len(body) == 1
    return body[0]


def _record(exe: str, tmp: Path) -> dict[str, Any]:
    go, db = tmp / "go", tmp / "lock.db"
    trace_one([exe, str(WORKLOAD), "--cudart", _cudart(), "--duration", f"{SECONDS:g}",
               "--go-file", str(go), *BASE, "--gil-thread"], db, "py-lock", go, SECONDS,
              "--stacks")
    return explain(db)


@pytest.mark.parametrize("exe", interpreters())
def test_lock_contention_names_the_interpreter_lock(exe: str, tmp_path: Path) -> None:
    report = _record(exe, tmp_path)
    chains = [c for c in report["chains"] if c["root_cause"] == "lock_contention"]
    assert chains, [c["root_cause"] for c in report["chains"]]
    c = max(chains, key=lambda c: c["detail"].get("lock_ns", 0))
    assert c["detail"]["gil"] is True, c["detail"]
    assert (c["detail"].get("lock_symbol") or "").startswith("_PyRuntime+"), c["detail"]
    culprit = c["culprit"]
    assert culprit["thread"] == "py-busy", culprit
    # The holder's own Python frame, read at its wake-ups with this version's offsets.
    assert culprit.get("where") == f"_gil_hog (train_loop.py:{_loop_line()})", culprit
