"""Integers are checked as integers (issue 40 point 8): where an integer is documented (a
query's max_rows and max_bytes, every integer argument of an MCP tool), ``1e23`` and
``1000.0`` are refused with a message that says an integer was expected, never taken as
the whole number a float happens to hold."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import hostile_files as H
import pytest
from mcp import Client
from mcp.types import CallToolResult

from fleetd.errors import UsageError, integer
from fleetd.mcp.local import LocalBackend
from fleetd.mcp.server import build_server
from fleetd.store.guard import Limits, SafeDB


@pytest.mark.parametrize(("value", "expected"), [(5, 5), ("5", 5), (" 12 ", 12), ("-3", -3),
                                                 (2**63 - 1, 2**63 - 1)])
def test_integers_are_taken(value: object, expected: int) -> None:
    assert integer(value, "n", text=True) == expected
    if isinstance(value, str):  # in JSON, a string is not a number
        with pytest.raises(UsageError, match="a string, not a number"):
            integer(value, "n")


@pytest.mark.parametrize(("value", "says"), [
    (1e23, "got 1e+23 (a number with an exponent or a fraction)"),
    (1000.0, "got 1000.0 (a number with an exponent or a fraction)"),
    ("1e23", "'1e23' (a number with an exponent or a fraction)"),
    ("1.5", "'1.5' (a number with an exponent or a fraction)"),
    (True, "(bool)"),
    ("ten", "'ten' (str)"),
    (None, "(NoneType)"),
])
def test_anything_else_is_refused_naming_it(value: object, says: str) -> None:
    with pytest.raises(UsageError, match="max_rows must be an integer") as err:
        integer(value, "max_rows", 1, text=True)
    assert says in err.value.message, err.value.message
    assert err.value.hint and "not 1e3" in err.value.hint


def test_range_is_checked_after_the_type() -> None:
    with pytest.raises(UsageError, match=r"max_rows is 0, outside 1 \.\. 10"):
        integer(0, "max_rows", 1, 10)
    with pytest.raises(UsageError, match="outside"):
        integer(2**64, "n")


def test_a_query_limit_must_be_an_integer() -> None:
    """The node API and fleetd query --nodes send a request's max_rows and max_bytes
    through Limits.lowered."""
    assert Limits().lowered(max_rows=10, max_bytes=2048).max_bytes == 2048
    for field in ("max_rows", "max_bytes"):
        with pytest.raises(UsageError, match=f"{field} must be an integer, got 1e"):
            Limits().lowered(**{field: 1e23})
        with pytest.raises(UsageError, match=f"{field} must be an integer"):
            Limits().lowered(**{field: 100.0})


def call(srv: Any, tool: str, args: dict[str, Any]) -> CallToolResult:
    async def go() -> CallToolResult:
        async with Client(srv, mode="legacy") as client:
            return await client.call_tool(tool, args)

    return asyncio.run(go())


@pytest.mark.parametrize("bad", [1e3, 1000.0, 1e23])
def test_mcp_integer_arguments_refuse_floats(tmp_path: Path, bad: float) -> None:
    db = H.node_db(tmp_path / "n.db")
    srv = build_server(LocalBackend(db, tmp_path / "exports"))
    for tool, args in (("get_trace_stats", {"pid": bad}),
                       ("get_causal_chains", {"top_n": bad}),
                       ("run_sql", {"sql": "SELECT 1", "max_rows": bad})):
        r = call(srv, tool, args)
        assert r.is_error, (tool, r.content)
        text = str(r.content[0].text)  # type: ignore[union-attr]
        assert "valid integer" in text, (tool, text)
    ok = call(srv, "get_trace_stats", {"pid": 4242})
    assert not ok.is_error, ok.content


def test_safedb_limits_through_the_same_parser(tmp_path: Path) -> None:
    db = H.node_db(tmp_path / "n.db")
    with SafeDB(db) as safe:
        assert safe.query("SELECT 1", limits=safe.limits.lowered(max_rows=1)).rows == [(1,)]
