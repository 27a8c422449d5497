"""`fleetd export --nodes`: one Perfetto timeline straight from live agents.

Three real `fleetd agent --no-trace` processes on loopback, over mTLS with certificates
from `fleetd certs`: gpu-01 serves the cpu_hog scenario (chains, arrows, histograms),
gpu-02 a plain recording, gpu-03 a plain recording from an agent whose wall clock runs
2.5 s ahead (libfaketime), so its skew must be measured, corrected and recorded. Every
file is checked with tests/perfetto_check.py and its counts against the databases.
"""

from __future__ import annotations

import gzip
import os
import signal
import socket
import sqlite3
import subprocess
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import perfetto_check
import pytest
from agents import Agent, Pki, agent
from synth import MAIN, cpu_hog

from fleetd.export.fleet import LINE_WARNINGS, _events
from fleetd.store.catalog import op_code

from conftest import FLEETD, REPO, assert_one_line_error, build_db

NODES = ["gpu-01", "gpu-02", "gpu-03"]
ROWS = {"gpu-02": 300, "gpu-03": 200}
STACK = 0x5EED
FRAMES = ["cudaLaunchKernel", "train_step (train_loop.py:42)", "main (train_loop.py:90)"]
FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
SHIFT_NS = 2_500_000_000
FAKED = {"LD_PRELOAD": FAKETIME_LIB, "FAKETIME": "+2.5s", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


def fleetd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FLEETD_DB"}
    return subprocess.run([FLEETD, *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def dbs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("dbs")
    out = {"gpu-01": cpu_hog(d / "gpu-01.db")}
    with sqlite3.connect(out["gpu-01"]) as c:  # a few launches with a recorded stack
        c.execute("INSERT INTO stacks VALUES (?, ?)", (STACK, orjson.dumps(FRAMES).decode()))
        c.execute("UPDATE event_data SET stack = ? WHERE op = ? AND id % 40 = 0",
                  (STACK, op_code("cudaLaunchKernel")))
    # cpu_hog writes node "gpu-01" itself; the others are named as served.
    out.update({n: build_db(d / f"{n}.db", node=n, n=k) for n, k in ROWS.items()})
    return out


@pytest.fixture(scope="module")
def fleet(pki: Pki, dbs: dict[str, Path]) -> Iterator[list[Agent]]:
    if not Path(FAKETIME_LIB).exists():
        pytest.skip(f"libfaketime is not installed ({FAKETIME_LIB})")
    with ExitStack() as stack:
        yield [stack.enter_context(agent(db, node, pki, "--no-trace",
                                         env=FAKED if node == "gpu-03" else None))
               for node, db in dbs.items()]


def nodes_arg(agents: list[Agent], *extra: str) -> str:
    return ",".join([*(a.url.removeprefix("https://") for a in agents), *extra])


def dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def export(pki: Pki, nodes: str, out: Path, *extra: str,
           code: int = 0) -> tuple[dict[str, Any], perfetto_check.TraceSummary, str]:
    proc = fleetd("export", "--nodes", nodes, *pki.client_flags(), "-o", str(out), *extra)
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr
    trace = perfetto_check.load(out)
    return trace, perfetto_check.validate(trace), proc.stderr


def by_node(trace: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n["name"]: n for n in trace["otherData"]["nodes"]}


def db_count(db: Path, start: int = 0, end: int = 2**62, pid: int | None = None) -> int:
    sql = "SELECT count(*) FROM event_data WHERE ts_ns >= ? AND ts_ns < ?"
    params: list[int] = [start, end]
    if pid is not None:
        sql += " AND pid = ?"
        params.append(pid)
    with sqlite3.connect(db) as c:
        return int(c.execute(sql, params).fetchone()[0])


def db_first(db: Path) -> int:
    with sqlite3.connect(db) as c:
        return int(c.execute("SELECT min(ts_ns) FROM event_data").fetchone()[0])


def rows_per_pid(trace: dict[str, Any]) -> Counter[int]:
    """Trace items that carry an event id (slices and instants of stored rows)."""
    return Counter(e["pid"] for e in trace["traceEvents"]
                   if isinstance(e.get("args"), dict) and "event" in e["args"]
                   and e.get("cat") != "chain")


# ---- the whole fleet --------------------------------------------------------------------


def test_every_node_is_one_process_with_all_its_events(
        pki: Pki, fleet: list[Agent], dbs: dict[str, Path], tmp_path: Path) -> None:
    trace, s, _ = export(pki, nodes_arg(fleet), tmp_path / "fleet.json", "--show-skew")
    nodes = by_node(trace)
    assert sorted(nodes) == NODES
    # One process track per node, named after it, and nothing outside them.
    assert sorted(s.processes.values(), key=str) == sorted(n["label"] for n in nodes.values())
    assert {p for p, _ in s.threads} == set(s.processes)
    per_pid = rows_per_pid(trace)
    for name, n in nodes.items():
        assert n["label"].startswith(name)
        assert n["events"] == db_count(dbs[name]), name
        assert per_pid[n["pid"]] == n["events"] - n["skipped"], name
    other = trace["otherData"]
    assert other["source"] == "fleet" and other["fleet"]["status"] == "complete"
    assert other["fleet"]["answered"] == "3 of 3 node(s)" and other["warnings"] == []


def test_the_skew_is_corrected_and_recorded(pki: Pki, fleet: list[Agent],
                                            dbs: dict[str, Path], tmp_path: Path) -> None:
    trace, _, stderr = export(pki, nodes_arg(fleet), tmp_path / "skew.json", "--show-skew")
    other = trace["otherData"]
    nodes = by_node(trace)
    skew = other["fleet"]["skew"]
    assert set(skew) == set(NODES) and all(v["corrected"] for v in skew.values())
    # gpu-03's clock is 2.5 s ahead: measured within a few ms, and taken back.
    assert abs(skew["gpu-03"]["skew_ns"] - SHIFT_NS) < 50_000_000, skew
    assert "above the 10 ms threshold" in stderr and "gpu-03" in stderr
    for name in NODES:
        clock = nodes[name]["clock"]
        assert clock["offset_ns"] == -skew[name]["skew_ns"]
        assert clock["source"].split("+")[0] == "fleet"
        # The measured offset's error, not the kernel's bound of the node's clock.
        assert clock["error_ns"] == skew[name]["error_ns"]
    fixed = nodes["gpu-03"]
    assert fixed["first_ns"] == db_first(dbs["gpu-03"]) + fixed["clock"]["offset_ns"]
    assert "clock: fleet" in str(trace["traceEvents"])
    # The first slice of gpu-03 sits at its corrected time on the trace's axis.
    first = min(Decimal(e["ts"]) for e in trace["traceEvents"]
                if e["ph"] == "X" and e["pid"] == fixed["pid"])
    assert first == Decimal(fixed["first_ns"] - other["origin_ns"]) / 1000
    # --no-skew-correct: recorded as each node stamped it, the skew still reported.
    raw, _, _ = export(pki, nodes_arg(fleet), tmp_path / "raw.json", "--no-skew-correct")
    node3 = by_node(raw)["gpu-03"]
    assert node3["clock"]["offset_ns"] == 0 and "fleet" not in node3["clock"]["source"]
    assert node3["first_ns"] == db_first(dbs["gpu-03"])
    assert raw["otherData"]["fleet"]["skew"]["gpu-03"]["corrected"] is False


def test_chains_arrows_names_and_counters_come_through_as_from_the_file(
        pki: Pki, fleet: list[Agent], dbs: dict[str, Path], tmp_path: Path) -> None:
    live, s, _ = export(pki, nodes_arg(fleet[:1]), tmp_path / "live.json")
    local = tmp_path / "local.json"
    proc = fleetd("export", "--db", str(dbs["gpu-01"]), "-o", str(local))
    assert proc.returncode == 0, proc.stderr
    file_trace = perfetto_check.load(local)
    keys = ("events", "slices", "instants", "skipped", "overlap_lanes", "chains", "flows")
    got, want = by_node(live)["gpu-01"], by_node(file_trace)["gpu-01"]
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
    assert got["chains"] >= 1 and got["flows"] >= 1 and s.flows == got["flows"]
    assert s.markers and s.markers[0]["name"].startswith("HIGH cpu_contention (gpu-01)")
    names = set(s.threads.values())
    assert "python3[1000] python3" not in names and "python3[1000]" in names
    counters = {e["name"] for e in live["traceEvents"] if e["ph"] == "C"}
    assert counters == {"CUDA calls/s (stored events)", "CUDA calls/s (all, from histograms)"}
    assert by_node(live)["gpu-01"]["label"] == by_node(file_trace)["gpu-01"]["label"]
    # Slices with a stack carry its frames, from the node as from the file.
    framed = [[e["args"]["frames"] for e in t["traceEvents"] if "frames" in e.get("args", {})]
              for t in (live, file_trace)]
    assert framed[0] and framed[0] == framed[1] and framed[0][0] == FRAMES
    # Chain modes: none, and stored (this node stores none).
    for mode in ("none", "stored"):
        t, _, _ = export(pki, nodes_arg(fleet[:1]), tmp_path / f"{mode}.json", "--chains", mode)
        assert by_node(t)["gpu-01"]["chains"] == 0


def test_window_pid_and_limit(pki: Pki, fleet: list[Agent], dbs: dict[str, Path],
                              tmp_path: Path) -> None:
    first = db_first(dbs["gpu-02"])
    # Bounds half-way between events (1 ms apart): no event sits on an edge.
    lo, hi = first + 50_500_000, first + 150_500_000
    trace, _, _ = export(pki, nodes_arg(fleet[1:]), tmp_path / "win.json",
                         "--from", str(lo), "--to", str(hi))
    skew = trace["otherData"]["fleet"]["skew"]
    for name, n in by_node(trace).items():
        # The window is this machine's time, moved into each node's clock.
        off = skew[name]["skew_ns"]
        assert n["events"] == db_count(dbs[name], lo + off, hi + 1 + off) > 0, name
    assert by_node(trace)["gpu-02"]["events"] == 100
    hog, _, _ = export(pki, nodes_arg(fleet[:1]), tmp_path / "pid.json", "--pid", str(MAIN))
    assert by_node(hog)["gpu-01"]["events"] == db_count(dbs["gpu-01"], pid=MAIN)
    cut, _, _ = export(pki, nodes_arg(fleet), tmp_path / "cut.json", "--limit-per-node", "40")
    assert {n["events"] for n in by_node(cut).values()} == {40}


def test_since_on_an_old_recording_says_so(pki: Pki, fleet: list[Agent],
                                           tmp_path: Path) -> None:
    trace, _, stderr = export(pki, nodes_arg(fleet[:2]), tmp_path / "since.json",
                              "--since", "1h")
    # gpu-01 holds a recording from 2025: nothing in the last hour; gpu-02's is recent.
    assert sorted(by_node(trace)) == ["gpu-02"]
    assert "node gpu-01: no events in the window" in stderr


def test_gzip_output(pki: Pki, fleet: list[Agent], tmp_path: Path) -> None:
    out = tmp_path / "fleet.json.gz"
    trace, _, _ = export(pki, nodes_arg(fleet), out)
    assert out.read_bytes()[:2] == b"\x1f\x8b" and sorted(by_node(trace)) == NODES
    gzip.decompress(out.read_bytes())  # a complete gzip stream
    assert [p.name for p in tmp_path.iterdir()] == ["fleet.json.gz"]  # no spool left


# ---- nodes that fail --------------------------------------------------------------------


def test_a_dead_node_is_a_warning_and_the_others_are_written(
        pki: Pki, fleet: list[Agent], tmp_path: Path) -> None:
    dead = dead_address()
    trace, s, stderr = export(pki, nodes_arg(fleet, dead), tmp_path / "partial.json", code=3)
    assert sorted(by_node(trace)) == NODES and len(s.processes) == 3
    [line] = [ln for ln in stderr.splitlines() if dead in ln]
    assert line.startswith("fleetd: warning: node") and "refused" in line
    assert "partial answer: 3 of 4 node(s) answered" in stderr
    assert trace["otherData"]["fleet"]["status"] == "partial"


def test_a_hung_node_costs_the_timeout_not_the_export(pki: Pki, fleet: list[Agent],
                                                      dbs: dict[str, Path],
                                                      tmp_path: Path) -> None:
    db = build_db(tmp_path / "gpu-04.db", node="gpu-04", n=50)
    with agent(db, "gpu-04", pki, "--no-trace") as hung:
        hung.proc.send_signal(signal.SIGSTOP)
        try:
            trace, _, stderr = export(pki, nodes_arg([*fleet[1:], hung]),
                                      tmp_path / "hung.json", "--timeout", "2s", code=3)
        finally:
            hung.proc.send_signal(signal.SIGCONT)
    assert sorted(by_node(trace)) == ["gpu-02", "gpu-03"]
    [line] = [ln for ln in stderr.splitlines() if hung.url.removeprefix("https://") in ln]
    assert "timeout" in line


def test_bad_rows_from_a_node_are_warnings_naming_node_and_line(
        pki: Pki, tmp_path: Path) -> None:
    db = build_db(tmp_path / "gpu-05.db", node="gpu-05", n=60)
    with sqlite3.connect(db) as c:  # a damaged file: a duration stored as text
        c.execute("UPDATE event_data SET dur_ns = 'oops' WHERE id = "
                  "(SELECT id FROM event_data ORDER BY ts_ns LIMIT 1 OFFSET 9)")
    with agent(db, "gpu-05", pki, "--no-trace") as bad:
        trace, _, stderr = export(pki, nodes_arg([bad]), tmp_path / "bad.json")
    assert by_node(trace)["gpu-05"]["events"] == 59
    assert ("fleetd: warning: node gpu-05: events line 10 skipped: a field of the wrong "
            "type") in stderr
    [line] = [ln.removeprefix("fleetd: warning: ") for ln in stderr.splitlines()
              if "events line" in ln]
    assert line in trace["otherData"]["warnings"]  # the file says so too


def test_the_spool_reader_skips_what_is_not_an_event(tmp_path: Path) -> None:
    good = ('{"rowkey":1,"ts_ns":100,"dur_ns":5,"pid":1,"tid":1,"op":"cudaLaunchKernel"}',
            '{"rowkey":2,"ts_ns":200,"dur_ns":5,"pid":1,"tid":1,"op":"cudaLaunchKernel"}')
    lines = [good[0], "not json", "[1, 2]", '{"ts_ns": 5, "op": "cudaLaunchKernel"}', "",
             '{"rowkey":3,"ts_ns":50,"dur_ns":5,"pid":1,"tid":1,"op":"cudaLaunchKernel"}',
             '{"rowkey":4,"ts_ns":150,"dur_ns":5,"pid":1,"tid":1,"op":"from_the_future"}',
             good[1], *["{"] * LINE_WARNINGS]
    path = tmp_path / "spool.ndjson"
    path.write_text("\n".join(lines))
    notes: list[str] = []
    rows = list(_events(path, notes.append))
    assert [r[1] for r in rows] == [100, 200]
    assert notes[0].startswith("events line 2 skipped: not JSON")
    assert notes[1] == "events line 3 skipped: a JSON list, not an object"
    assert notes[2] == "events line 4 skipped: no field 'rowkey'"
    assert notes[3].startswith("events line 6 skipped: earlier than the line before")
    assert notes[4].startswith("events line 9 skipped: not JSON")
    assert notes[5:] == [f"{LINE_WARNINGS - 1} more bad events line(s) skipped",
                         "1 event(s) of ops this fleetd does not know skipped (is the agent "
                         "newer?)"]


def test_no_node_answering_is_an_error_and_no_file(pki: Pki, tmp_path: Path) -> None:
    out = tmp_path / "none.json"
    proc = fleetd("export", "--nodes", f"{dead_address()},{dead_address()}", *pki.client_flags(),
                  "-o", str(out))
    assert proc.returncode == 4 and "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("fleetd: error:")]
    assert len(errors) == 1 and "no node sent its timeline" in errors[0]
    assert "nothing was written" in errors[0]
    assert list(tmp_path.iterdir()) == []  # no file, no half-written one, no spool


@pytest.mark.parametrize(("args", "needle"), [
    (["--limit-per-node", "0"], "--limit-per-node 0"),
    (["--offset", "gpu-01"], "'gpu-01'"),
    (["--offset", "gpu-01=soon"], "'soon'"),
    (["--since", "5x"], "'5x'"),
    (["--since", "5m", "--from", "now-1h"], "--since '5m'"),
    (["--from", "now", "--to", "now-1h"], "--from 'now'"),
    (["--timeout", "nope"], "'nope'"),
    (["--format", "json"], "'json'"),
])
def test_bad_flags_are_one_line_errors(pki: Pki, tmp_path: Path, args: list[str],
                                       needle: str) -> None:
    proc = fleetd("export", "--nodes", dead_address(), *pki.client_flags(), "-o",
                  str(tmp_path / "x.json"), *args)
    assert_one_line_error(proc, needle)
    assert list(tmp_path.iterdir()) == []


def test_mixed_sources_and_bad_addresses_are_one_line_errors(pki: Pki, tmp_path: Path) -> None:
    out = str(tmp_path / "x.json")
    assert_one_line_error(fleetd("export", "--db", "x.db", "--nodes", "127.0.0.1:1",
                                 *pki.client_flags(), "-o", out), "--db")
    assert_one_line_error(fleetd("export", "--nodes", "nohost", *pki.client_flags(), "-o", out),
                          "'nohost'")
    assert_one_line_error(fleetd("export", "--db", "x.db", "--ca-cert", str(pki.ca), "-o",
                                 out), "--ca-cert")
    assert_one_line_error(fleetd("export", "--nodes", "127.0.0.1:1", "-o", out),
                          "fleet CA")
    assert_one_line_error(fleetd("export", "--nodes", "127.0.0.1:1", *pki.client_flags(), "-o",
                                 str(tmp_path / "no" / "x.json")), "does not exist")


def test_memory_stays_flat_whatever_a_node_sends(pki: Pki, tmp_path: Path) -> None:
    """In process, under tracemalloc: eight times the events, about the same peak."""
    from agents import client_ssl

    from fleetd.export.fleet import FleetExportOptions, export_fleet
    from fleetd.fleet.client import ClientOptions
    from fleetd.fleet.fanout import FleetOptions
    from fleetd.fleet.targets import parse_nodes

    def peak(n: int) -> int:
        db = build_db(tmp_path / f"mem{n}.db", node="gpu-04", n=n)
        with agent(db, "gpu-04", pki, "--no-trace") as a:
            opts = FleetOptions(tuple(parse_nodes(a.url.removeprefix("https://"))),
                                ClientOptions(ssl=client_ssl(pki), timeout_s=30))
            tracemalloc.start()
            done = export_fleet(opts, FleetExportOptions(chains="none"),
                                tmp_path / f"mem{n}.json")
            _, top = tracemalloc.get_traced_memory()
            tracemalloc.stop()
        assert done.stats[0].events == n
        return top

    small, large = peak(5_000), peak(40_000)
    assert large < small * 1.5 + 500_000, (small, large)
