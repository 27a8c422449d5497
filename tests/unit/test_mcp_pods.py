"""MCP tools select processes by pod as the CLI does (issue 35): get_causal_chains and
get_latency_breakdown take pod / namespace, answer only that pod's processes, and refuse
with the pods the file names when the pod ran nowhere, or when pid is given too.

A copy of the shipped dataloader.db (python feeding the GPU, dl-worker processes) with
the trainer placed in pod ml/trainer-0 and one worker in ml/loader-0.
"""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from test_mcp_server import call, error, server

from fleetd.store.schema import migrate

from conftest import REPO

SCENARIO = REPO / "tests" / "data" / "scenarios" / "dataloader.db"


def _placed(tmp_path: Path) -> tuple[Path, int, int]:
    """The copy, the trainer's pid and the placed worker's."""
    db = tmp_path / "pods.db"
    shutil.copyfile(SCENARIO, db)
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        migrate(conn, int(conn.execute("PRAGMA user_version").fetchone()[0]))
        trainer = conn.execute("SELECT pid FROM process_data WHERE comm = 'python'").fetchone()[0]
        worker = conn.execute("SELECT min(pid) FROM process_data WHERE comm = 'dl-worker'"
                              ).fetchone()[0]
        for pid, pod in ((trainer, "trainer-0"), (worker, "loader-0")):
            conn.execute("UPDATE process_data SET pod = ?, namespace = 'ml' WHERE pid = ?",
                         (pod, pid))
    finally:
        conn.close()
    return db, int(trainer), int(worker)


@pytest.fixture
def placed(tmp_path: Path) -> tuple[Any, int, int]:
    db, trainer, worker = _placed(tmp_path)
    return server(db), trainer, worker


def test_chains_of_a_pod_are_its_processes_chains(placed: tuple[Any, int, int]) -> None:
    srv, trainer, _ = placed
    every = call(srv, "get_causal_chains", {})
    assert {c["victim"]["pid"] for c in every["chains"]} == {trainer}
    mine = call(srv, "get_causal_chains", {"pod": "ml/trainer-0"})
    assert mine["chains"] and {c["victim"]["pid"] for c in mine["chains"]} == {trainer}
    # The worker's pod holds no victim: no chain, and the verdict says quiet.
    theirs = call(srv, "get_causal_chains", {"pod": "loader-0", "namespace": "ml"})
    assert theirs["chains"] == [] and theirs["quiet"] is True


def test_the_breakdown_of_a_namespace_and_of_a_pod(placed: tuple[Any, int, int]) -> None:
    srv, trainer, worker = placed
    ns = call(srv, "get_latency_breakdown", {"namespace": "ml", "top_n": 20})
    assert {p["pid"] for p in ns["processes"]} == {trainer, worker}
    one = call(srv, "get_latency_breakdown", {"pod": "ml/loader-0"})
    assert [p["pid"] for p in one["processes"]] == [worker]


def test_a_pod_that_ran_nowhere_and_pid_with_pod_are_refused(
        placed: tuple[Any, int, int]) -> None:
    srv, trainer, _ = placed
    e = error(srv, "get_causal_chains", {"pod": "ml/nope"})
    assert "no process of pod ml/nope" in e["message"]
    assert "ml/trainer-0" in str(e) and "ml/loader-0" in str(e)  # the pods it does name
    e = error(srv, "get_latency_breakdown", {"pod": "trainer-0", "pid": trainer})
    assert "pid and pod/namespace both select processes" in e["message"]
