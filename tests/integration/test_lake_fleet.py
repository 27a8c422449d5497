"""`fleetd export --format parquet --nodes ...`: the 3-node set into a lake, straight from
three real agents (`fleetd agent --no-trace` on loopback, mTLS with certificates from
`fleetd certs`), paged through each node's query API; row counts per table and node
equal the nodes' own databases."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from agents import Agent, Pki, agent

from fleetd.store.db import open_reader
from fleetd.store.lakesql import LakeDB

from conftest import FLEETD, REPO

NODES = ["node-1", "node-2", "node-3"]
TABLES = ("events", "sessions", "processes", "threads")


@pytest.fixture(scope="module")
def fleet(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Agent]]:
    d = tmp_path_factory.mktemp("dbs")
    with ExitStack() as stack:
        agents = []
        for n in NODES:
            db = shutil.copy(REPO / "investigations" / "fleet" / f"{n}.db", d / f"{n}.db")
            agents.append(stack.enter_context(agent(Path(db), n, pki, "--no-trace")))
        yield agents


def _fleet_args(pki: Pki, agents: list[Agent]) -> list[str]:
    nodes = ",".join(f"{a.node}={a.url.split('://')[1]}" for a in agents)
    return ["--nodes", nodes, *pki.client_flags()]


def _want(table: str) -> dict[str, int]:
    out = {}
    for n in NODES:
        conn = open_reader(REPO / "investigations" / "fleet" / f"{n}.db")
        try:
            out[n] = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
        finally:
            conn.close()
    return {k: v for k, v in out.items() if v}


def _check(root: Path) -> None:
    with LakeDB(root) as db:
        assert db.warnings == []
        for t in TABLES:
            got = dict(db.query(f"SELECT node, count(*) FROM {t} GROUP BY node").rows)
            assert got == _want(t), t
        # The stamped times are the nodes' own; ts_ns moved by at most the measured skew
        # of agents on this very machine (plus the recorded interpolation).
        (worst,) = db.query("SELECT max(abs(ts_ns - ts_recorded_ns)) FROM events").rows[0]
        assert worst < 50_000_000


def test_export_from_live_nodes_pages_every_row(pki: Pki, fleet: list[Agent], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from fleetd.cli.fleet_args import fleet_options
    from fleetd.cli.main import build_parser
    from fleetd.export import parquet

    # Pages smaller than a node's events, so that every node is read in several.
    monkeypatch.setattr(parquet, "PAGE_ROWS", 2_000)
    args = build_parser().parse_args(["export", "--format", "parquet", "-o", str(tmp_path),
                                      "--timeout", "60s", *_fleet_args(pki, fleet)])
    done, answer = parquet.export_fleet_lake(fleet_options(args), tmp_path / "lake")
    assert answer.exit_code == 0 and done.warnings == []
    assert sorted(done.rows) == NODES
    _check(tmp_path / "lake")


def test_export_cli_from_live_nodes(pki: Pki, fleet: list[Agent], tmp_path: Path) -> None:
    proc = subprocess.run([FLEETD, "export", "--format", "parquet", "-o", str(tmp_path / "l"),
                           *_fleet_args(pki, fleet)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    events = 0
    for n in NODES:
        with sqlite3.connect(f"file:{REPO / 'investigations' / 'fleet' / n}.db?mode=ro",
                             uri=True) as c:
            events += c.execute("SELECT count(*) FROM event_data").fetchone()[0]
    assert "3 node(s)" in proc.stdout and f"events {events:,}" in proc.stdout
    _check(tmp_path / "l")
