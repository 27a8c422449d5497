"""``--pod`` / ``--namespace`` with ``--nodes``: the selection travels to every agent as
query parameters, each selects its own processes as ``--db`` does, a node where the pod
never ran answers no rows, and the client's table names the pod.

Real agents on loopback with real TLS, serving copies of a shipped recording
(dataloader.db: python pid 28924 feeding the GPU, dl-worker 28930-28933) with the
placement columns written in: the trainer in pod ml/trainer-0, one worker in ml/loader-0.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from agents import Agent, Pki, agent, client_ssl, request

from fleetd.store.schema import migrate
from fleetd.wire import paths

from conftest import FLEETD, REPO

SCENARIO = REPO / "tests" / "data" / "scenarios" / "dataloader.db"
# Placed pods; schema 5 without pods; a schema-4 file (before pods were recorded).
NODES = ["pods-01", "plain-02", "old-03"]
TRAINER, LOADER = 28924, 28930


def _copy(dst: Path, node: str) -> Path:
    shutil.copyfile(SCENARIO, dst)
    conn = sqlite3.connect(dst, isolation_level=None)
    try:
        if node != NODES[2]:
            migrate(conn, int(conn.execute("PRAGMA user_version").fetchone()[0]))
        conn.execute("UPDATE nodes SET name = ?", (node,))
        if node == NODES[0]:
            for pid, pod, container in ((TRAINER, "trainer-0", "trainer"),
                                        (LOADER, "loader-0", "loader")):
                conn.execute("UPDATE process_data SET cgroup = ?, runtime = 'containerd', "
                             "container = ?, container_name = ?, pod = ?, namespace = 'ml', "
                             "pod_uid = ? WHERE pid = ?",
                             (f"/kubepods/pod-{pod}/cri-{pid}", f"{pid:064x}", container,
                              pod, f"uid-{pod}", pid))
    finally:
        conn.close()
    return dst


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[list[Agent]]:
    tmp = tmp_path_factory.mktemp("fleet")
    with ExitStack() as stack:
        yield [stack.enter_context(agent(_copy(tmp / f"{n}.db", n), n, pki, "--no-trace"))
               for n in NODES]


def ask(pki: Pki, agents: list[Agent], *args: str) -> subprocess.CompletedProcess[str]:
    nodes = ",".join(a.url.removeprefix("https://") for a in agents)
    return subprocess.run([FLEETD, *args, "--nodes", nodes, *pki.client_flags()],
                          capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "COLUMNS": "250"})


def test_explain_pod_selects_its_processes_on_every_node(pki: Pki,
                                                         fleet: list[Agent]) -> None:
    proc = ask(pki, fleet, "explain", "--pod", "ml/trainer-0", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    assert sorted(found["nodes"]) == sorted(NODES)  # the plain node answered, no error
    assert found["selected"] == {"pod": "ml/trainer-0"}
    assert {(p["node"], p["pid"]) for p in found["processes"]} == {(NODES[0], TRAINER)}
    trainer = found["processes"][0]
    assert (trainer["pod"], trainer["namespace"], trainer["container"]) == \
        ("trainer-0", "ml", "trainer")
    # The recording's HIGH chain (its victim is the trainer) stays; none of another pid.
    assert found["chains"] and {c["node"] for c in found["chains"]} == {NODES[0]}
    assert {c["victim"]["pid"] for c in found["chains"]} == {TRAINER}
    assert any(c["root_cause"] == "dataloader_oversubscription" for c in found["chains"])

    loader = json.loads(ask(pki, fleet, "explain", "--pod", "loader-0", "--format",
                            "json").stdout)
    assert {(p["node"], p["pid"]) for p in loader["processes"]} == {(NODES[0], LOADER)}
    assert not [c for c in loader["chains"] if c["victim"]["pid"] != LOADER]


def test_explain_table_shows_the_pod(pki: Pki, fleet: list[Agent]) -> None:
    proc = ask(pki, fleet, "explain", "--namespace", "ml")
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout[proc.stdout.index("per-process breakdown"):]
    header = next(ln for ln in table.splitlines() if ln.startswith("node ")).split()
    assert header[:6] == ["node", "pid", "comm", "tid", "thread", "pod"], header
    rows = [ln.split() for ln in table.splitlines() if ln.split()[:1] == [NODES[0]]]
    assert {(r[1], r[5]) for r in rows} == {(str(TRAINER), "ml/trainer-0"),
                                            (str(LOADER), "ml/loader-0")}, table
    assert NODES[1] not in table


def test_ops_pod_per_process_with_a_pod_column(pki: Pki, fleet: list[Agent]) -> None:
    proc = ask(pki, fleet, "ops", "--pod", "ml/trainer-0", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    ops = json.loads(proc.stdout)
    cols = ops["columns"]
    assert cols[:5] == ["node", "pid", "comm", "pod", "op"], cols
    assert ops["rows"] and {(r[0], r[1], r[3]) for r in ops["rows"]} == \
        {(NODES[0], TRAINER, "ml/trainer-0")}
    # The same selection from the local file: the same ops and counts.
    local = json.loads(subprocess.run(
        [FLEETD, "ops", "--db", str(fleet[0].log.parent / f"{NODES[0]}.db"), "--pod",
         "ml/trainer-0", "--format", "json"], capture_output=True, text=True, cwd=REPO,
        timeout=120).stdout)
    lcols = local["columns"]
    assert sorted((r[lcols.index("op")], r[lcols.index("count")]) for r in local["rows"]) \
        == sorted((r[cols.index("op")], r[cols.index("count")]) for r in ops["rows"])
    table = ask(pki, fleet, "ops", "--namespace", "ml")
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0].split()[:5] == ["node", "pid", "comm", "pod", "op"]
    assert "ml/loader-0" in table.stdout and "ml/trainer-0" in table.stdout


def test_a_pod_no_node_ran_is_no_rows_not_an_error(pki: Pki, fleet: list[Agent]) -> None:
    proc = ask(pki, fleet, "ops", "--pod", "prod/nowhere", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    ops = json.loads(proc.stdout)
    assert ops["rows"] == [] and not ops["warnings"]
    exp = ask(pki, fleet, "explain", "--pod", "prod/nowhere")
    assert exp.returncode == 0, exp.stderr
    assert "no process of pod prod/nowhere on any node" in exp.stdout


@pytest.mark.parametrize(("args", "needle"), [
    (["explain", "--pid", "5", "--pod", "a"], "--pid and --pod/--namespace"),
    (["ops", "--pod", "x" * 600], "--pod"),
])
def test_selection_mistakes_are_one_usage_error(pki: Pki, fleet: list[Agent],
                                                args: list[str], needle: str) -> None:
    proc = ask(pki, fleet, *args)
    assert proc.returncode == 2, proc
    assert proc.stderr.startswith("fleetd: error: ") and "Traceback" not in proc.stderr
    assert needle in proc.stderr


def test_the_node_reads_the_parameters_as_untrusted(pki: Pki, fleet: list[Agent]) -> None:
    ctx = client_ssl(pki)
    status, body, _ = request(fleet[0].url, ctx, path=f"{paths.OPS}?pod=ml/trainer-0&pid=5")
    assert status == 400 and "pid and pod" in json.dumps(body)
    status, body, _ = request(fleet[0].url, ctx, path=f"{paths.CHAINS}?namespace=" + "n" * 300)
    assert status == 400 and "namespace=" in json.dumps(body)
    status, body, _ = request(fleet[0].url, ctx, path=f"{paths.CHAINS}?pod=ml/loader-0")
    assert status == 200 and {p["pid"] for p in body["processes"]} == {LOADER}


def _pod_tracks(path: Path) -> set[tuple[int, str]]:
    """(tid, name) of the timeline's tracks named with a pod (a process's tracks carry
    its name: ``python (pod ml/trainer-0, container trainer)[28924]``)."""
    trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return {(int(e["tid"]), str(e["args"]["name"])) for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"
            and "(pod " in str(e["args"]["name"])}


def test_the_fleet_timeline_names_processes_with_their_pods(pki: Pki, fleet: list[Agent],
                                                           tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    proc = ask(pki, fleet, "export", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "pod names left out" not in proc.stderr  # the schema-4 node: no pods, no note
    tracks = _pod_tracks(out)
    assert (TRAINER, f"python (pod ml/trainer-0, container trainer)[{TRAINER}]") in tracks
    assert (LOADER, f"dl-worker (pod ml/loader-0, container loader)[{LOADER}]") in tracks
    # The local export of the same file names them alike.
    local = tmp_path / "local.json"
    done = subprocess.run([FLEETD, "export", "--db", str(fleet[0].log.parent /
                                                         f"{NODES[0]}.db"), "-o", str(local)],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert _pod_tracks(local) == tracks


def test_the_html_report_of_a_pod(pki: Pki, fleet: list[Agent], tmp_path: Path) -> None:
    out = tmp_path / "pod.html"
    proc = ask(pki, fleet, "explain", "--pod", "ml/trainer-0", "--format", "html", "-o",
               str(out))
    assert proc.returncode == 0, proc.stderr
    page = out.read_text()
    assert "trainer-0" in page and "dataloader_oversubscription" in page
    assert "loader-0" not in page  # the other pod's process is not selected


def test_a_lake_from_the_fleet_keeps_the_pods(pki: Pki, fleet: list[Agent],
                                              tmp_path: Path) -> None:
    lake = tmp_path / "lake"
    proc = ask(pki, fleet, "export", "--format", "parquet", "-o", str(lake))
    assert proc.returncode == 0, proc.stderr
    done = subprocess.run([FLEETD, "query", "--lake", str(lake), "--format", "json",
                           "SELECT node, pid, pod, namespace FROM processes WHERE pod IS NOT "
                           "NULL ORDER BY pid"], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rows"] == [[NODES[0], TRAINER, "trainer-0", "ml"],
                                               [NODES[0], LOADER, "loader-0", "ml"]]


def test_the_mcp_fleet_tool_selects_a_pod_on_every_node(pki: Pki, fleet: list[Agent]) -> None:
    """query_fleet's chains and ops take pod / namespace as fleetd explain/ops do."""
    from test_mcp_fleet import call, fleet_server

    srv = fleet_server(pki, ",".join(a.url.removeprefix("https://") for a in fleet))
    chains = call(srv, "query_fleet", {"action": "chains", "pod": "ml/trainer-0"})
    assert chains["status"] == "complete"
    assert chains["chains"] and {(c["node"], c["victim"]["pid"]) for c in chains["chains"]} \
        == {(NODES[0], TRAINER)}
    ops = call(srv, "query_fleet", {"action": "ops", "namespace": "ml", "top_n": 500})
    pid_i, pod_i = ops["columns"].index("pid"), ops["columns"].index("pod")
    assert {(r[pid_i], str(r[pod_i])) for r in ops["rows"]} >= {(TRAINER, "ml/trainer-0")}
    assert {r[pid_i] for r in ops["rows"]} <= {TRAINER, LOADER}
    e = call(srv, "query_fleet", {"action": "sql", "sql": "SELECT 1", "pod": "x"}, ok=False)
    assert "pod/namespace select processes" in str(e)
