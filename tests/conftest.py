"""Shared fixtures, and the rule that a BPF test may not skip in CI."""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

IN_CI = bool(os.environ.get("CI"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    outcome = yield
    report = outcome.get_result()
    # CI runs as root on a kernel with BPF: a skipped BPF or network-namespace test
    # there hides a broken tracer or test bed, so it counts as a failure.
    needs_root = any(item.get_closest_marker(m) is not None for m in ("bpf", "netns"))
    if IN_CI and report.skipped and needs_root:
        report.outcome = "failed"
        report.longrepr = (f"root-only test skipped in CI (CI={os.environ['CI']!r}): "
                           f"{report.longrepr}")


# ---- fixture databases built by code ------------------------------------------------

import time as _time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from fleetd.store.catalog import op_code  # noqa: E402
from fleetd.store.writer import BatchWriter  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FLEETD = str(REPO / ".venv" / "bin" / "fleetd")


@pytest.hookimpl
def pytest_configure(config: pytest.Config) -> None:
    """fleetd's bytecode, written once before any test runs. Where PYTHONDONTWRITEBYTECODE
    is set (as on the engineers' machines here), no process writes it, and every one of
    the suite's many ``fleetd`` processes (CLI calls, agents, tracers) compiled its 150-odd
    modules from source first: 0.3 s apiece on a loaded two-core machine (`fleetd
    explain` 1.10 s -> 0.77 s). A module edited later is still compiled afresh: bytecode
    is checked against its source's size and mtime."""
    import compileall

    compileall.compile_dir(REPO / "fleetd", quiet=2)


def synthetic_events(n: int, t0: int | None = None, pid: int = 4242) -> list[tuple[int, ...]]:
    """n plausible CUDA/sched events, 1 ms apart, ending about now."""
    t0 = t0 if t0 is not None else _time.time_ns() - n * 1_000_000
    ops = [op_code("cudaLaunchKernel"), op_code("cudaMemcpyAsync"),
           op_code("cudaStreamSynchronize"), op_code("off_cpu")]
    rows = []
    for i in range(n):
        op = ops[i % len(ops)]
        rows.append((t0 + i * 1_000_000, 5_000 + (i % 50) * 100, pid, pid + i % 2, op,
                     100 if op != ops[3] else 0, 4096 if op == ops[1] else 0, 0, 0, 0, 0))
    return rows


def build_db(path: Path, node: str = "node-a", n: int = 400) -> Path:
    with BatchWriter(path, node) as w:
        w.add_processes([{"pid": 4242, "comm": "train_loop", "rank": 0, "world_size": 1}])
        w.add_tasks([(4242, 4242, "train_loop"), (4243, 4242, "dataloader")])
        w.add_events(synthetic_events(n))
    return path


@pytest.fixture
def small_db(tmp_path: Path) -> Path:
    return build_db(tmp_path / "node-a.db")


# ---- the multi-host test bed (tests/netbed.py) -------------------------------------


@pytest.fixture
def netbed_factory(tmp_path: Path) -> Generator[Any, None, None]:
    """``make(hosts, **kw)`` starts a NetBed; every bed is torn down, pass or fail."""
    from netbed import NetBed

    beds: list[NetBed] = []

    def make(hosts: int, **kw: Any) -> NetBed:
        bed = NetBed(tmp_path / f"bed{len(beds)}", hosts, **kw)
        beds.append(bed)
        return bed.start()

    try:
        yield make
    finally:
        for bed in beds:
            bed.close()


# ---- helpers shared by the CLI and tracing tests -----------------------------------


def assert_one_line_error(proc: Any, *needles: str) -> None:
    """A user mistake: exit 2, no traceback, one ``fleetd: error:`` line naming it."""
    assert proc.returncode == 2, proc
    assert "Traceback" not in proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("fleetd: error: "), proc.stderr
    for n in needles:
        assert n in first, proc.stderr




import subprocess  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager as _contextmanager  # noqa: E402

from recorder import wait_for_libcudart  # noqa: E402,F401  (one copy: the recorder's)


@_contextmanager
def running_workload(go: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    """The reference workload (tests/workloads/train_loop.py ARGS), waiting for the
    ``go`` file, yielded once it has loaded libcudart (so probes can attach); killed on
    the way out."""
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "workloads" / "train_loop.py"),
                             *args, "--go-file", str(go)], stdout=subprocess.PIPE, text=True)
    try:
        wait_for_libcudart(proc.pid)
        yield proc
    finally:
        proc.kill()
        proc.wait(10)


def trace_in_process(wl: Any, db: Path, node: str, go: Path,
                     **cfg: Any) -> tuple[dict[str, Any], Any]:
    """Trace the workload process ``wl`` (a Popen waiting for ``go``, printing one JSON
    line of what it made) with an in-process Tracer of the CUDA layer, stacks on, until
    it exits: (what it made, the tracer's summary). Kills ``wl`` if anything fails."""
    import json

    from fleetd.trace.tracer import TraceConfig, Tracer

    try:
        wait_for_libcudart(wl.pid)
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
    finally:
        if wl.poll() is None:
            wl.kill()
            wl.wait()
    return made, summary
