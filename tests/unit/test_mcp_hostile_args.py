"""Issue 29 on the MCP server: numbers past 64 bits are tool errors (never an
OverflowError traceback on the server's stderr), read-only pragma functions work as
PRAGMA does, and the export directory is fleetd's own private one (items 5 and 6).

Through the SDK's in-memory client, as tests/unit/test_mcp_server.py drives the tools.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.types import CallToolResult
from mcp_data import build

from fleetd.mcp import local
from fleetd.mcp.local import LocalBackend
from fleetd.mcp.server import build_server

from conftest import FLEETD

HUGE = 2**70
PID_TOOLS = ("get_trace_stats", "get_causal_chains", "get_latency_breakdown", "get_stacks",
             "graph_lifecycle", "get_gpu_breakdown", "export_timeline")


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("cpu_hog", tmp_path_factory.mktemp("mcp") / "cpu_hog.db")


def call(srv: Any, tool: str, args: dict[str, Any]) -> CallToolResult:
    async def go() -> CallToolResult:
        async with Client(srv, mode="legacy") as client:
            return await client.call_tool(tool, args)

    return asyncio.run(go())


def error_of(r: CallToolResult) -> str:
    assert r.is_error, r.content
    return str(r.content[0].text)  # type: ignore[union-attr]


def test_numbers_past_64_bits_are_tool_errors(db: Path, tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    srv = build_server(LocalBackend(db, tmp_path / "exports"))
    caplog.set_level(logging.INFO)
    for tool in PID_TOOLS:
        text = error_of(call(srv, tool, {"pid": HUGE}))
        assert "less than or equal to 9223372036854775807" in text, (tool, text)
    assert "less than or equal" in error_of(call(srv, "export_timeline",
                                                 {"limit_per_node": HUGE}))
    sql = json.loads(error_of(call(srv, "run_sql", {"sql": "SELECT * FROM events WHERE pid = ?",
                                                    "params": [HUGE]})))
    assert sql["error"]["code"] == "bad_request" and "64-bit" in sql["error"]["message"]
    # The largest 64-bit pid is a valid (empty) filter.
    assert not call(srv, "get_trace_stats", {"pid": 2**63 - 1}).is_error
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert not any("Traceback" in r.getMessage() or "OverflowError" in r.getMessage()
                   for r in caplog.records)


def test_an_overflow_inside_a_tool_is_a_tool_error(db: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def overflow(*_: Any) -> dict[str, Any]:
        raise OverflowError("Python int too large to convert to SQLite INTEGER")

    backend = LocalBackend(db, tmp_path / "exports")
    monkeypatch.setattr(LocalBackend, "trace_stats", overflow)
    err = json.loads(error_of(call(build_server(backend), "get_trace_stats", {})))["error"]
    assert err["code"] == "bad_request" and "out of range" in err["message"]


@pytest.mark.parametrize("sql", [
    "SELECT name FROM pragma_table_info('events') ORDER BY cid",
    "SELECT p.name FROM pragma_table_info('events') p JOIN pragma_table_info('events') q "
    "USING (name) ORDER BY p.cid",
])
def test_read_only_pragma_functions_are_allowed(db: Path, tmp_path: Path, sql: str) -> None:
    srv = build_server(LocalBackend(db, tmp_path / "exports"))
    r = call(srv, "run_sql", {"sql": sql})
    assert not r.is_error, r.content
    names = [row[0] for row in json.loads(r.content[0].text)["rows"]["untrusted"]]  # type: ignore[union-attr]
    assert names[:4] == ["id", "node", "ts_ns", "dur_ns"]
    # As on the CLI, through the same guard.
    proc = subprocess.run([FLEETD, "query", "--db", str(db), "--format", "json", sql],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert [r[0] for r in json.loads(proc.stdout)["rows"]][:2] == ["id", "node"]


@pytest.mark.parametrize(("sql", "needle"), [
    ("SELECT * FROM pragma_writable_schema(1)", "refused"),
    ("SELECT * FROM pragma_table_info('events') WHERE (SELECT load_extension('x'))",
     "load_extension"),
])
def test_pragma_functions_that_write_stay_refused(db: Path, tmp_path: Path, sql: str,
                                                  needle: str) -> None:
    srv = build_server(LocalBackend(db, tmp_path / "exports"))
    err = json.loads(error_of(call(srv, "run_sql", {"sql": sql})))["error"]
    assert err["code"] == "forbidden" and needle in err["message"], err


# ---- the export directory (item 5) -------------------------------------------------------


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    base = tmp_path / "cache"
    base.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_CACHE_HOME", str(base))
    return base


def _export(db: Path, export_dir: Path | None = None) -> CallToolResult:
    backend = LocalBackend(db) if export_dir is None else LocalBackend(db, export_dir)
    return call(build_server(backend), "export_timeline", {"name": "t.json", "limit_per_node": 50})


def test_the_default_export_directory_is_private_and_per_user(db: Path, cache: Path) -> None:
    assert local.default_export_dir() == cache / "fleetd" / "mcp-exports"
    r = _export(db)
    assert not r.is_error, r.content
    made = cache / "fleetd" / "mcp-exports"
    assert stat.S_IMODE(made.stat().st_mode) == 0o700 and (made / "t.json").is_file()
    assert made.stat().st_uid == os.geteuid()


def _refusal(r: CallToolResult) -> dict[str, Any]:
    err = json.loads(error_of(r))["error"]
    assert err["code"] == "unsafe_path" and "\n" not in err["message"], err
    assert err["message"].startswith("refusing MCP export directory"), err
    return dict(err)


def test_a_planted_symlink_is_refused_and_nothing_is_written_through_it(
        db: Path, cache: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (cache / "fleetd").mkdir()
    (cache / "fleetd" / "mcp-exports").symlink_to(victim)
    assert "is a symbolic link" in _refusal(_export(db))["message"]
    assert list(victim.iterdir()) == []
    # The same for a directory given with --export-dir.
    (tmp_path / "given").symlink_to(victim)
    assert "is a symbolic link" in _refusal(_export(db, tmp_path / "given"))["message"]
    assert list(victim.iterdir()) == []


def test_a_directory_others_may_write_is_refused(db: Path, cache: Path) -> None:
    made = cache / "fleetd" / "mcp-exports"
    made.mkdir(parents=True, mode=0o700)
    made.chmod(0o770)
    assert "group or others may write it (mode 0770)" in _refusal(_export(db))["message"]
    assert list(made.iterdir()) == []
    made.chmod(0o700)
    (cache / "fleetd").chmod(0o777)  # a level above it, writable by all: refused too
    assert "'" + str(cache / "fleetd") + "' above it" in _refusal(_export(db))["message"]


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user's needs root")
def test_a_directory_another_user_owns_is_refused(db: Path, cache: Path) -> None:
    made = cache / "fleetd" / "mcp-exports"
    made.mkdir(parents=True, mode=0o700)
    os.chown(made, 54321, 54321)
    assert "owned by uid 54321" in _refusal(_export(db))["message"]
    assert list(made.iterdir()) == []
