"""Test workloads of tests/workloads/ run and traced, for the live tests: the reference
workload running (``running_workload``), one workload recorded under ``fleetd trace``
and explained (``run_traced``), or traced by an in-process Tracer (``trace_in_process``).
Every one waits for a go file that is touched once the tracer traces; starting,
waiting for libcudart and killing are recorder.running's."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from subprocess import Popen
from typing import Any

from recorder import WORKLOAD, compact, explain, running, trace_for


@contextmanager
def running_workload(go: Path, *args: str) -> Iterator[Popen[str]]:
    """The reference workload (tests/workloads/train_loop.py ARGS), waiting for the
    ``go`` file, yielded once it has loaded libcudart (so probes can attach); killed on
    the way out."""
    with running([sys.executable, str(WORKLOAD), *args, "--go-file", str(go)]) as wl:
        yield wl


def run_traced(script: Path, tmp: Path, seconds: float, *args: str,
               start_s: float = 20.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """``script --duration SECONDS --go-file GO ARGS``, pinned to the last CPU, traced
    for its run: explain's report on the compacted recording, and the workload's own
    summary (its last line of stdout, JSON). ``start_s``: how long it may take to map
    libcudart (a workload that first writes its files)."""
    go, db = tmp / "go", tmp / f"{script.stem}.db"
    argv = [sys.executable, str(script), "--duration", f"{seconds:g}", "--go-file", str(go),
            *args]
    with running(argv, max(os.sched_getaffinity(0)), start_s) as wl:
        trace_for(wl.pid, db, go, f"{seconds + 1:g}s")
        out, _ = wl.communicate(timeout=seconds + 60)
    assert wl.returncode == 0, out
    compact(db)
    return explain(db), json.loads(out.strip().splitlines()[-1])


def trace_in_process(wl: Popen[str], db: Path, node: str, go: Path,
                     **cfg: Any) -> tuple[dict[str, Any], Any]:
    """Trace the workload process ``wl`` (from :func:`recorder.running`: waiting for
    ``go``, printing one JSON line of what it made) with an in-process Tracer of the CUDA
    layer, stacks on, until it exits: (what it made, the tracer's summary)."""
    from fleetd.store.writer import BatchWriter
    from fleetd.trace.tracer import TraceConfig, Tracer

    writer = BatchWriter(db, node)
    tracer = Tracer(TraceConfig(db=db, node=node, pids=[wl.pid], stacks=True,
                                layers=frozenset({"cuda"}), **cfg), writer=writer)
    tracer.start()
    try:
        go.touch()
        while not tracer.targets_gone():
            tracer.poll(50)
    finally:
        summary = tracer.stop()
        writer.close()
    made: dict[str, Any] = json.loads(wl.communicate(timeout=60)[0])
    return made, summary
