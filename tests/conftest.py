"""Shared fixtures, and the rule that a BPF test may not skip in CI."""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from agents import Pki

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

import sqlite3  # noqa: E402
import time as _time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from fleetd.store import schema  # noqa: E402
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


def old_schema_file(path: Path, version: int) -> sqlite3.Connection:
    """A file as fleetd wrote it at schema ``version`` (its tables, catalog and identity,
    node 1 named "old"), open in autocommit for a test to add the rows it needs."""
    conn = sqlite3.connect(path, isolation_level=None)
    for sql in schema.MIGRATIONS[:version]:
        for stmt in schema._statements(sql):
            conn.execute(stmt)
    schema.seed_catalog(conn)
    conn.execute(f"PRAGMA application_id = {schema.APPLICATION_ID}")
    conn.execute(f"PRAGMA user_version = {version}")
    conn.execute("INSERT INTO nodes(id, name, uid, created_ns) VALUES (1, 'old', 'u-old', 1)")
    return conn


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


# ---- the fleet's certificates (tests/agents.py's Pki) ------------------------------

# One CA for the whole session signs every node and client a test runs as (a test that
# needs a second CA, or a certificate of an odd kind, makes that itself).
FLEET_NODES = ("gpu-01", "gpu-02", "gpu-03", "gpu-04", "gpu-05", "relay", "hostile", "peer",
               "n1", "mcp", "liar", "pods-01", "plain-02", "old-03", "node-1", "node-2",
               "node-3", "node-a", "node-b", "rs-01", "rs-02", "oncpu-1")
FLEET_CLIENTS = ("laptop", "desk", "probe", "prometheus", "other")


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """The fleet CA with a node certificate (SANs 127.0.0.1, localhost) for each of
    FLEET_NODES and a client certificate for each of FLEET_CLIENTS. Read-only: a module
    that adds certificates works on ``pki.copy_to(...)``."""
    from agents import make_pki

    return make_pki(tmp_path_factory.mktemp("pki") / "certs", FLEET_NODES, FLEET_CLIENTS)


# ---- helpers shared by the CLI and tracing tests -----------------------------------


def assert_one_line_error(proc: Any, *needles: str) -> None:
    """A user mistake: exit 2, no traceback, one ``fleetd: error:`` line naming it."""
    assert proc.returncode == 2, proc
    assert "Traceback" not in proc.stderr
    first = proc.stderr.splitlines()[0]
    assert first.startswith("fleetd: error: "), proc.stderr
    for n in needles:
        assert n in first, proc.stderr


def cli_probe(runs: list[list[str]]) -> str:
    """Python source for ``python -c SOURCE DB WORK`` in a fresh interpreter: fleetd's
    CLI ``main`` run over each argv of ``runs`` (``{db}`` and ``{work}`` filled in),
    output swallowed, exit codes kept in ``codes``; then the MCP tools and their HTTPS
    transport imported. What it checks (loaded modules, say) the caller appends."""
    return f"""
import contextlib, io, json, sys
from fleetd.cli.main import main

db, work = sys.argv[1], sys.argv[2]
codes = []
for argv in {runs!r}:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            codes.append(main([a.format(db=db, work=work) for a in argv]))
        except SystemExit as exc:
            codes.append(exc.code)
import fleetd.mcp.server, fleetd.mcp.https
"""


from recorder import wait_for_libcudart  # noqa: E402,F401  (one copy: the recorder's)
