"""Partial failure on a namespace fleet: one host stopped (SIGSTOP), one agent killed.

The answer must come from the others within the timeout, with one warning naming each
missing node and why, and the partial exit code; with no node left, the "no answer"
exit code.
"""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import pytest

from conftest import build_db
from netbed import NetBed, why_unavailable

_WHY = why_unavailable()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

TIMEOUT_S = 3.0
SQL = "SELECT node, count(*) AS n FROM events GROUP BY node"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Four hosts serving their databases; host-1 stopped, host-3's agent killed."""
    from netbed import netbed

    tmp = tmp_path_factory.mktemp("partial")
    with netbed(tmp / "bed", 4) as bed:
        for h in bed.hosts:
            bed.start_agent(h, db=build_db(tmp / f"{h.name}.db", node=h.name, n=200))
        bed.wait_agents()
        config = bed.write_config(tmp / "fleetd.yaml", timeout_s=TIMEOUT_S)
        # A healthy run first: the baseline for how long the CLI itself takes here.
        started = time.monotonic()
        proc = bed.client("query", "--config", str(config), SQL, "--format", "json")
        baseline = time.monotonic() - started
        assert proc.returncode == 0, proc.stderr
        assert len(json.loads(proc.stdout)["rows"]) == 4
        stopped, killed = bed.hosts[1], bed.hosts[3]
        assert stopped.agent is not None and killed.agent is not None
        stopped.agent.send_signal(signal.SIGSTOP)
        killed.agent.kill()
        killed.agent.wait(10)
        yield bed, config, baseline, stopped, killed


def _timed(bed: NetBed, *args: str) -> tuple[Any, float]:
    started = time.monotonic()
    proc = bed.client(*args)
    return proc, time.monotonic() - started


def test_query_answers_from_the_others_within_the_timeout(fleet: Any) -> None:
    bed, config, baseline, stopped, killed = fleet
    proc, took = _timed(bed, "query", "--config", str(config), SQL, "--format", "json")
    assert proc.returncode == 3, proc.stderr  # partial
    # A hung node costs at most the timeout, never more.
    assert took < TIMEOUT_S + baseline + 1.0, (took, baseline)
    obj = json.loads(proc.stdout)
    assert obj["columns"] == ["node", "n"]
    assert sorted(r[0] for r in obj["rows"]) == ["host-0", "host-2"]
    assert all(r[1] == 200 for r in obj["rows"])
    by_node = {w["node"]: w for w in obj["warnings"]}
    assert set(by_node) == {stopped.name, killed.name}, obj["warnings"]
    assert by_node[stopped.name]["kind"] == "timeout"
    assert by_node[killed.name]["kind"] == "refused"
    assert killed.endpoint in by_node[killed.name]["error"]
    assert set(obj["skew"]) == {"host-0", "host-2"}


def test_table_output_warns_per_missing_node_on_stderr(fleet: Any) -> None:
    bed, config, _, stopped, killed = fleet
    proc, _ = _timed(bed, "query", "--config", str(config), SQL)
    assert proc.returncode == 3
    assert "host-0" in proc.stdout and "host-2" in proc.stdout
    assert stopped.name not in proc.stdout and killed.name not in proc.stdout
    err = proc.stderr
    assert f"fleetd: warning: node {stopped.name}: timeout:" in err, err
    assert f"fleetd: warning: node {killed.name}: refused:" in err, err
    assert "partial answer: 2 of 4 node(s) answered" in err
    assert "Traceback" not in err


def test_explain_reports_missing_nodes_as_unreachable_not_healthy(fleet: Any) -> None:
    bed, config, baseline, stopped, killed = fleet
    proc, took = _timed(bed, "explain", "--config", str(config), "--format", "json")
    assert proc.returncode == 3, proc.stderr
    assert took < TIMEOUT_S + baseline + 1.5, (took, baseline)
    obj = json.loads(proc.stdout)
    ranked = {s["node"]: s for s in obj["stragglers"]}
    for gone in (stopped.name, killed.name):
        assert ranked[gone]["flagged"] is None and ranked[gone]["score"] is None
        assert ranked[gone]["reason"].startswith("unreachable: ")
    assert {w["node"] for w in obj["warnings"]} == {stopped.name, killed.name}
    assert [s["node"] for s in obj["stragglers"]][-2:] == sorted([stopped.name, killed.name])


def test_no_node_answering_is_its_own_exit_code(fleet: Any) -> None:
    bed, _, baseline, stopped, killed = fleet
    nodes = bed.nodes_arg([stopped, killed])
    proc, took = _timed(bed, "query", "--nodes", nodes, *bed.client_tls_args(), SQL,
                        "--timeout", "2s", "--format", "json")
    assert proc.returncode == 4, proc.stderr
    assert took < 2.0 + baseline + 1.0
    obj = json.loads(proc.stdout)
    assert obj["rows"] == [] and len(obj["warnings"]) == 2
    # Without names in a config, a node is named by the address it was given as.
    assert {w["node"] for w in obj["warnings"]} == {stopped.endpoint, killed.endpoint}
