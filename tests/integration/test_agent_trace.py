"""The agent tracing for real: queries, hostile SQL and floods while it writes; SIGTERM
drains; kill -9 loses at most the unflushed tail and leaves a sound database."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import pytest
from agents import Agent, Pki, agent, client_ssl, request
from hostile import HOSTILE_OVER_HTTP
from workload_run import running_workload

from fleetd.store.health import StoreStatus, TraceStats

pytestmark = [pytest.mark.bpf,
              pytest.mark.skipif(os.geteuid() != 0, reason="tracing needs root")]

DB_NAME = "gpu-01.db"


@pytest.fixture
def workload(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """The reference workload, a steady ~2k CUDA calls/s for up to a minute."""
    with running_workload(tmp_path / "go", "--duration", "60", "--launches", "8", "--memcpy",
                          "1", "--cpu-us", "50", "--gpu-ms", "2") as proc:
        yield proc


def _count(a: Agent, pki: Pki) -> int:
    status, res, _ = request(a.url, client_ssl(pki), "POST", "/api/v1/query",
                             json={"sql": "SELECT count(*) FROM event_data"})
    assert status == 200, res
    return int(res["rows"][0][0])


@contextmanager
def _tracing(tmp_path: Path, pki: Pki, workload: subprocess.Popen[str]) -> Iterator[Agent]:
    """An agent on DB_NAME in ``tmp_path`` tracing ``workload`` (every call sampled),
    yielded once it traces and the workload has been let go (its go file)."""
    with agent(tmp_path / DB_NAME, "gpu-01", pki, "--pid", str(workload.pid), "--sample", "1") as a:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status, health, _ = request(a.url, client_ssl(pki))
            if status == 200 and health["tracing"]:
                (tmp_path / "go").touch()
                yield a
                return
            time.sleep(0.1)
        raise AssertionError(a.log.read_text())


def _wait_events(a: Agent, pki: Pki, at_least: int, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        n = _count(a, pki)
        if n >= at_least:
            return n
        time.sleep(0.2)
    raise AssertionError(f"fewer than {at_least} events after {timeout}s: {a.log.read_text()}")


def test_hostile_queries_and_floods_do_not_interrupt_tracing(
    tmp_path: Path, pki: Pki, workload: subprocess.Popen[str]
) -> None:
    with _tracing(tmp_path, pki, workload) as a:
        before = _wait_events(a, pki, 200)
        ctx = client_ssl(pki)
        for body, status, code in HOSTILE_OVER_HTTP:
            got, err, _ = request(a.url, ctx, "POST", "/api/v1/query", data=body,
                                  headers={"Content-Type": "application/json"})
            assert (got, err["error"]["code"]) == (status, code), (body[:80], err)

        async def flood() -> list[int]:
            async with aiohttp.ClientSession() as s:
                async def one(i: int) -> int:
                    sql = "SELECT op, count(*), avg(dur_ns) FROM events GROUP BY op"
                    # A small answer says so: the agent holds room for each answer's
                    # max_bytes before running it (16 MiB by default, 4 at a time per
                    # client within its 64 MiB: docs/security.md).
                    async with s.post(a.url + "/api/v1/query", ssl=ctx,
                                      json={"sql": sql, "max_bytes": 65536}) as r:
                        await r.read()
                        return r.status
                return await asyncio.gather(*(one(i) for i in range(60)))

        statuses = asyncio.run(flood())
        assert set(statuses) <= {200, 429} and statuses.count(200) >= 8, statuses
        after = _wait_events(a, pki, before + 200)
        status, health, _ = request(a.url, ctx)
        assert health["tracing"] and not health["trace"].get("error"), health
        # A tracing agent's health carries its tracer's and its store's parts whole, in
        # the shapes the agent and the tracer are typed with (fleetd.store.health).
        assert set(health["trace"]) == set(TraceStats.__annotations__), health["trace"]
        assert set(health["store"]) == set(StoreStatus.__annotations__), health["store"]
        assert after > before
        assert a.stop(signal.SIGTERM, timeout=30) == 0
    db = tmp_path / DB_NAME
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        ended, lost = c.execute("SELECT ended_ns, lost_events FROM sessions").fetchone()
        assert ended is not None
        # What the kernel emitted and what the store holds agree: losses are counted.
        ops = dict(c.execute("SELECT op, count(*) FROM events GROUP BY op").fetchall())
    assert ops.get("cudaLaunchKernel", 0) > 0 and ops.get("cudaStreamSynchronize", 0) > 0
    m = re.search(r"(\d+) events written, (\d+) lost \(counted\), (-?\d+) unreported",
                  a.log.read_text())
    assert m and int(m.group(3)) == 0, a.log.read_text()


def test_kill_9_keeps_everything_flushed_and_a_sound_file(
    tmp_path: Path, pki: Pki, workload: subprocess.Popen[str]
) -> None:
    with _tracing(tmp_path, pki, workload) as a:
        seen = _wait_events(a, pki, 500)
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(10)
    db = tmp_path / DB_NAME
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        kept = c.execute("SELECT count(*) FROM event_data").fetchone()[0]
        seqs = [r[0] for r in c.execute("SELECT id & 1099511627775 FROM event_data ORDER BY id")]
    # Everything a query saw committed before the kill is still there, without gaps.
    assert kept >= seen
    assert seqs == list(range(1, len(seqs) + 1))
    # The node can be restarted on the same file: ids continue after the last one.
    with agent(db, "gpu-01", pki, "--no-trace") as a:
        status, res, _ = request(a.url, client_ssl(pki), "POST", "/api/v1/query",
                                 json={"sql": "SELECT count(*) FROM events"})
        assert status == 200 and res["rows"] == [[kept]]
    # A served copy is never modified: the killed session is still open.
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT ended_ns, end_reason FROM session_data").fetchall() == [
            (None, None)]
    # Tracing again closes it as crashed, with what the kernel had emitted by its last
    # commit and the file does not hold counted as lost.
    with _tracing(tmp_path, pki, workload) as a:
        a.stop()
    with sqlite3.connect(db) as c:
        rows = c.execute("SELECT seq, ended_ns, updated_ns, end_reason, lost_events, "
                         "emitted_events, accounted_events, json_extract(drops, '$.crash') "
                         "FROM session_data ORDER BY seq").fetchall()
    (s1, ended, updated, reason, lost, emitted, accounted, crash), second = rows
    print(f"killed session: {reason}, kept {kept} events, emitted {emitted}, accounted "
          f"{accounted}, lost_events {lost}, drops.crash {crash}")
    assert (s1, reason, ended) == (1, "crashed", updated) and updated is not None
    # Nothing was refused by the writer's queue, so what it accounted for is exactly
    # what the file holds of that session.
    assert accounted == kept and emitted >= accounted
    assert crash == emitted - accounted and lost >= crash
    assert second[3] == "stopped" and second[4] == 0
    out = subprocess.run([sys.executable, "-m", "fleetd", "overview", "--db", str(db),
                          "--format", "json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    [node] = json.loads(out.stdout)["nodes"]
    assert node["crashed_sessions"] == 1
    assert [x["end_reason"] for x in node["sessions"]] == ["crashed", "stopped"]


def test_tls_handshake_failures_are_counted(tmp_path: Path, pki: Pki) -> None:
    from fleetd.security import tls

    from conftest import build_db

    db = build_db(tmp_path / "gpu-01.db", "gpu-01", 10)
    with agent(db, "gpu-01", pki, "--no-trace") as a:
        anonymous = tls.client_context(pki.ca, None, None)
        for _ in range(3):
            with pytest.raises(aiohttp.ClientError):
                request(a.url, anonymous)
        _, _, text = request(a.url, client_ssl(pki), path="/metrics")
    line = next(x for x in text.decode().splitlines()
                if x.startswith("fleetd_tls_handshake_failures_total"))
    assert float(line.split()[-1]) >= 3, text.decode()
