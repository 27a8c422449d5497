"""One test workload of tests/workloads/ recorded under ``fleetd trace``, for the live
tests that check a diagnosis against what the workload itself reports: it runs pinned
to the last CPU, waits for a go file that is touched once the tracer traces, prints one
JSON summary as its last line of stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from recorder import FLEETD, compact, explain, wait_for_libcudart


def run_traced(script: Path, tmp: Path, seconds: float, *args: str,
               start_s: float = 20.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """``script --duration SECONDS --go-file GO ARGS`` traced for its run: explain's
    report on the compacted recording, and the workload's own summary. ``start_s``:
    how long it may take to map libcudart (a workload that first writes its files)."""
    go, db = tmp / "go", tmp / f"{script.stem}.db"
    cpu = max(os.sched_getaffinity(0))
    wl = subprocess.Popen([sys.executable, str(script), "--duration", f"{seconds:g}",
                           "--go-file", str(go), *args], stdout=subprocess.PIPE, text=True,
                          preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        wait_for_libcudart(wl.pid, start_s)
        _trace(wl.pid, db, go, f"{seconds + 1:g}s")
        out, _ = wl.communicate(timeout=seconds + 60)
    finally:
        if wl.poll() is None:
            wl.kill()
            wl.wait(10)
    assert wl.returncode == 0, out
    compact(db)
    return explain(db), json.loads(out.strip().splitlines()[-1])


def _trace(pid: int, db: Path, go: Path, duration: str) -> None:
    """``fleetd trace --pid`` for ``duration``, ``go`` touched once it traces; a
    failure says everything the tracer wrote, before and after it started."""
    tr = subprocess.Popen([FLEETD, "trace", "--pid", str(pid), "--db", str(db),
                           "--duration", duration], stderr=subprocess.PIPE, text=True)
    assert tr.stderr is not None
    said = []
    for line in tr.stderr:
        said.append(line)
        if line.startswith("fleetd: tracing"):
            go.touch()
            break
    _, err = tr.communicate(timeout=120)
    if tr.returncode != 0:
        raise RuntimeError(f"fleetd trace exited {tr.returncode}: {''.join(said)}{err}")
