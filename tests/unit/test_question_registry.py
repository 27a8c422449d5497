"""The question registry (#32 item 1): every question declared once in
fleetd.questions, and what is derived from it: the node's routes and their parameter
checks, the local answer of ``fleetd NAME``, and the MCP tool. The new question ``pods``
(which pods ran on each node, with their processes) came in through the registry alone.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from test_mcp_server import call, error, server

from fleetd.errors import QueryError
from fleetd.questions.catalog import GPU, QUESTIONS, STACKS
from fleetd.questions.spec import Params
from fleetd.store.schema import migrate
from fleetd.wire import paths

from conftest import REPO

SCENARIO = REPO / "tests" / "data" / "scenarios" / "dataloader.db"


def _placed(tmp_path: Path) -> tuple[Path, int, int]:
    """dataloader.db with the trainer in pod ml/trainer-0 (container trainer) and one
    worker in a container outside any pod."""
    db = tmp_path / "placed.db"
    shutil.copyfile(SCENARIO, db)
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        migrate(conn, int(conn.execute("PRAGMA user_version").fetchone()[0]))
        trainer = int(conn.execute("SELECT pid FROM process_data WHERE comm = 'python'"
                                   ).fetchone()[0])
        worker = int(conn.execute("SELECT min(pid) FROM process_data WHERE comm = 'dl-worker'"
                                  ).fetchone()[0])
        conn.execute("UPDATE process_data SET container = 'c1', container_name = 'trainer', "
                     "pod = 'trainer-0', namespace = 'ml', pod_uid = 'u-1' WHERE pid = ?",
                     (trainer,))
        conn.execute("UPDATE process_data SET container = 'c2' WHERE pid = ?", (worker,))
    finally:
        conn.close()
    return db, trainer, worker


def fleetd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fleetd", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=120)


# ---- the registry itself --------------------------------------------------------------


def test_names_routes_and_tools_are_unique() -> None:
    for attr in ("name", "route"):
        values = [getattr(q, attr) for q in QUESTIONS]
        assert len(values) == len(set(values)), attr
    tools = [q.tool for q in QUESTIONS if q.tool]
    assert len(tools) == len(set(tools))


def test_every_question_is_a_route_of_the_agent(tmp_path: Path) -> None:
    from fleetd.node.agent import AgentSettings, build_app
    from fleetd.node.api import NodeState

    app = build_app(AgentSettings(node="n1", db=tmp_path / "n1.db"), NodeState(node="n1"))
    routes = {r.resource.canonical for r in app.router.routes() if r.method == "GET"}
    assert {q.route for q in QUESTIONS} <= routes
    declared = {v for k, v in vars(paths).items() if k.isupper() and isinstance(v, str)}
    assert {q.route for q in QUESTIONS} <= declared  # each named once, in fleetd.wire


@pytest.mark.parametrize("text", ["0", "-3", "ten", "1001", str(2**70)])
def test_a_bad_number_is_refused_with_its_value(text: str) -> None:
    with pytest.raises(QueryError) as info:
        STACKS.parse({"top_n": text})
    assert info.value.code == "bad_request"
    assert f"top_n={text[:40]!r} must be a positive integer no larger than 1000" \
        == info.value.message


def test_a_bad_op_or_threshold_is_a_bad_request_with_the_analyzers_words() -> None:
    with pytest.raises(QueryError) as op:
        STACKS.parse({"op": "cudaStreamSynchronise"})
    assert op.value.code == "bad_request" and "cudaStreamSynchronise" in op.value.message
    with pytest.raises(QueryError) as th:
        GPU.parse({"thresholds": "M9=1"})
    assert th.value.code == "bad_request" and "M9" in th.value.message


def test_what_the_client_sends_the_node_reads_back() -> None:
    given = STACKS.values({"op": "cudaMalloc", "pid": 7, "top_n": 3})
    assert given.get("frames_n") == 16 and given.get("min_dur_ns") == 0
    sent = STACKS.encode(given)
    assert sent == {"pid": "7", "top_n": "3", "frames_n": "16", "op": "cudaMalloc"}
    assert STACKS.parse(sent) == given
    limits = {"M1": 0.25, "ProfilerStep*:M4": 0.5}
    back = GPU.parse(GPU.encode(GPU.values({"steps": True, "thresholds": limits})))
    assert back.flag("steps") and back.get("thresholds")["ProfilerStep*:M4"] == 0.5
    assert GPU.encode(Params({})) == {}


# ---- pods, the question added through the registry --------------------------------------


def test_pods_of_a_local_database(tmp_path: Path) -> None:
    db, trainer, worker = _placed(tmp_path)
    proc = fleetd("pods", "--db", str(db), "--format", "json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["columns"] == ["node", "namespace", "pod", "container", "pid", "comm"]
    assert {(r[2], r[3], r[4]) for r in got["rows"]} == {("trainer-0", "trainer", trainer),
                                                         (None, "c2", worker)}
    mine = next(p for p in got["processes"] if p["pid"] == trainer)
    assert mine["namespace"] == "ml" and mine["pod_uid"] == "u-1" and mine["comm"] == "python"
    assert {(g["namespace"], g["pod"], tuple(g["pids"])) for g in got["pods"]} == {
        ("ml", "trainer-0", (trainer,)), (None, "c2", (worker,))}
    table = fleetd("pods", "--db", str(db))
    assert table.returncode == 0 and "trainer-0" in table.stdout, table.stderr


def test_a_file_without_pods_says_so(tmp_path: Path) -> None:
    db = tmp_path / "plain.db"
    shutil.copyfile(SCENARIO, db)
    proc = fleetd("pods", "--db", str(db))
    assert proc.returncode == 0, proc.stderr
    assert "note: no traced process ran in a container" in proc.stderr
    got = json.loads(fleetd("pods", "--db", str(db), "--format", "json").stdout)
    assert got["rows"] == [] and got["note"]


def test_pods_takes_no_window_and_no_fleet_flag_without_nodes(tmp_path: Path) -> None:
    db, _, _ = _placed(tmp_path)
    proc = fleetd("pods", "--db", str(db), "--since", "5m")
    assert proc.returncode == 2 and "--since" in proc.stderr
    proc = fleetd("pods", "--db", str(db), "--show-skew")
    assert proc.returncode == 2 and "only apply to a fleet query" in proc.stderr


def test_the_mcp_tool_gives_the_pods_marked_as_data(tmp_path: Path) -> None:
    db, trainer, _ = _placed(tmp_path)
    srv = server(db)
    got = call(srv, "get_pods", {})
    mine = next(p for p in got["processes"] if p["pid"] == trainer)
    assert mine["pod"] == {"untrusted": "trainer-0"} and mine["comm"] == {"untrusted": "python"}
    assert error(srv, "get_pods", {"node": "nope"})["code"] == "bad_request"


def test_a_parameter_the_question_lacks_is_a_programming_error() -> None:
    with pytest.raises(TypeError, match="no parameter buckets"):
        STACKS.values({"buckets": 3})


def test_every_question_answers_a_node_database_in_its_shape(tmp_path: Path) -> None:
    """Each question over a recorded node file, as the agent answers it: its ``expect``
    key there, the node named, and every key of its declared TypedDict."""
    from fleetd.analyze.facade import Analysis
    from fleetd.store.db import open_reader

    from conftest import build_db

    conn = open_reader(build_db(tmp_path / "node.db"))
    try:
        node = str(conn.execute("SELECT name FROM nodes").fetchone()[0])
        for q in QUESTIONS:
            got = q.on_node(Analysis.of(conn, node=node), node, q.parse({}))
            assert q.expect in got and got["node"] == node, q.name
            if q.shape is not None:
                assert q.shape.__required_keys__ <= set(got), q.name
    finally:
        conn.close()
