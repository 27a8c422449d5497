"""fleetd.wire: one definition of what the agent and the fleet client agree on, and the
readers that check a node's answer once, where it is read (issue #32, "one wire")."""

from __future__ import annotations

import ast
from typing import Any

import pytest

from fleetd.fleet.fanout import Request, checked
from fleetd.wire import paths
from fleetd.wire.failure import BadReply, Failure, NodeFailed
from fleetd.wire.query import check_rows
from fleetd.wire.replies import read_time
from fleetd.wire.values import need_int, need_list, need_text, optional

from conftest import REPO

PACKAGE = REPO / "fleetd"
WIRE = PACKAGE / "wire"


def _literals(path: Any) -> list[tuple[int, str]]:
    """(line, text) of every string constant in the module but its docstrings."""
    tree = ast.parse(path.read_text())
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef
                      | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_paths_and_headers_are_spelled_only_in_the_wire() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.is_relative_to(WIRE):
            continue
        for line, text in _literals(path):
            if paths.PREFIX in text or "X-Fleetd-" in text:
                found.append(f"{path.relative_to(REPO)}:{line}: {text!r}")
    assert not found, ("API paths or X-Fleetd-* headers spelled outside fleetd/wire "
                       "(use fleetd.wire.paths / fleetd.wire.headers):\n  " + "\n  ".join(found))


def test_every_route_the_agent_serves_is_a_wire_path() -> None:
    from fleetd.node import analysis, detail, ranks
    from fleetd.relay import RelaySettings, relay_routes

    served = {r.path for r in [*analysis.ROUTES, *ranks.ROUTES, *detail.ROUTES,
                               *relay_routes(RelaySettings(node="n1"))]}
    served |= {paths.HEALTH, paths.TIME, paths.QUERY, paths.EVENTS}  # node.api.make_app
    declared = {v for k, v in vars(paths).items()
                if k.isupper() and v.startswith(paths.PREFIX) and v != paths.PREFIX}
    assert served == declared


def test_a_bad_reply_is_a_failed_node_with_its_reason() -> None:
    exc = BadReply("ranks[0].pid: expected an integer, got str '1'")
    assert isinstance(exc, NodeFailed) and isinstance(exc, ValueError)
    assert str(exc) == "ranks[0].pid: expected an integer, got str '1'"
    assert exc.failure == Failure("bad_json", str(exc),
                                  "is this a fleetd agent, and an unmodified one?")
    assert not exc.failure.retryable
    cut = BadReply("cut", "see its log", kind="disconnected")
    assert cut.failure.kind == "disconnected" and cut.failure.retryable


def test_value_readers_name_where_and_clean_strings() -> None:
    with pytest.raises(BadReply, match=r"rows\[2\]\.ts_ns: expected an integer, got bool"):
        need_int(True, "rows[2].ts_ns")
    with pytest.raises(BadReply, match=r"outside \[0, 9\]"):
        need_int(10, "x", 0, 9)
    with pytest.raises(BadReply, match="above the limit of 2"):
        need_list([1, 2, 3], "ranks", 2)
    assert need_text("a\x1b[2Jb", "name", 100) == "a?[2Jb"
    assert optional(None, "x", need_int) is None and optional(5, "x", need_int) == 5


def test_a_query_answer_is_checked_cut_and_typed_once() -> None:
    reply: dict[str, Any] = {"node": "n1", "columns": ["a", "b\n"], "rows": [[1, "x"]] * 5,
                             "truncated": False, "truncated_reason": None, "elapsed_ms": 2}
    got = check_rows(reply, 3)
    assert len(got["rows"]) == 3 and got["truncated"] and got["truncated_reason"] == "rows"
    assert got["columns"] == ["a", "b?"] and reply["truncated"] is True  # in place too
    for bad, said in (({"columns": "a", "rows": []}, "columns"),
                      ({"columns": ["a"], "rows": [[1, 2]]}, "list of 1 values"),
                      ({"columns": ["a"], "rows": [[2**64]]}, "SQLite cannot hold")):
        with pytest.raises(BadReply, match=said):
            check_rows(bad, None)


def test_the_fan_out_checks_an_answer_once_and_names_where() -> None:
    def refuse(reply: dict[str, Any]) -> dict[str, Any]:
        raise BadReply("ranks: expected a list, got str")

    r = Request("GET", paths.RANKS, expect=("ranks",), check=refuse)
    with pytest.raises(BadReply) as err:
        checked(r, {"ranks": "all"}, "10.0.0.1:7600" + paths.RANKS)
    assert err.value.failure.kind == "bad_json"
    assert err.value.failure.message == ("10.0.0.1:7600/api/v1/ranks answered a malformed "
                                         "reply (ranks: expected a list, got str)")
    with pytest.raises(BadReply, match="answered without ranks"):
        checked(r, {}, "n")
    plain = Request("GET", paths.OPS)
    with pytest.raises(BadReply, match="beyond 64 bits"):
        checked(plain, {"ops": [{"n": 2**70}]}, "n")
    assert checked(plain, {"ops": []}, "n") == {"ops": []}


def test_a_time_answer_is_read_once() -> None:
    got = read_time(b'{"node": "gpu\\u001b-1", "t1_ns": 10, "t2_ns": 12}')
    assert (got.node, got.t1_ns, got.t2_ns) == ("gpu?-1", 10, 12)
    backwards = read_time(b'{"node": "n", "t1_ns": 12, "t2_ns": 10}')
    assert backwards.t1_ns is None and backwards.t2_ns is None
    for body in (b"[]", b"not json"):
        with pytest.raises(BadReply, match="bad /api/v1/time answer"):
            read_time(body)


def test_the_literal_scan_skips_docstrings_only(tmp_path: Any) -> None:
    module = tmp_path / "m.py"
    module.write_text('"""GET /api/v1/ops"""\n\ndef f():\n    """/api/v1/x"""\n'
                      '    return "/api/v1/ops", f"{1}X-Fleetd-Send-Ns"\n')
    assert [t for _, t in _literals(module)] == ["/api/v1/ops", "X-Fleetd-Send-Ns"]
