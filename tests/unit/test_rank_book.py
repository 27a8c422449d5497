"""The agent's in-memory NCCL rank book (fleetd/node/ranks.py): what the tracer's batches
leave in it, the process states it reads from /proc, its bounds, its cost per row, and
the /metrics gauge built on it."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetd.node import ranks as ranksmod
from fleetd.node.api import NodeState
from fleetd.node.metrics import Sources, render
from fleetd.node.ranks import ObservedWriter, RankBook, local_waits
from fleetd.store.catalog import op_code

S = 1_000_000_000
ALLREDUCE, BCAST = op_code("ncclAllReduce"), op_code("ncclBroadcast")
SEND, RECV = op_code("ncclSend"), op_code("ncclRecv")
SYNC, LAUNCH, OFF_CPU = (op_code("cudaStreamSynchronize"), op_code("cudaLaunchKernel"),
                         op_code("off_cpu"))


def row(ts: int, pid: int, op: int, ret: int = 0, a0: int = 0, a1: int = 0,
        tid: int | None = None) -> tuple[int, ...]:
    return (ts, 1_000, pid, tid or pid, op, ret, 0, 0, a0, a1, 0)


@pytest.fixture
def sleepers() -> Any:
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    deadline = time.monotonic() + 10
    for p in procs:  # past exec and into its sleep: a process just started is running
        while Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "S":
            assert time.monotonic() < deadline, "sleep never slept"
            time.sleep(0.01)
    yield [p.pid for p in procs]
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait(10)


def feed_job(book: RankBook, pids: list[int], seqs: list[int], ages_s: list[float],
             now: int) -> None:
    book.observe_processes({"pid": p, "comm": "python", "rank": r, "world_size": len(pids),
                            "job": "job-9"} for r, p in enumerate(pids))
    rows, args = [], []
    for p, seq, age in zip(pids, seqs, ages_s, strict=True):
        ts = now - int(age * S)
        rows.append(row(ts, p, ALLREDUCE, ret=4, a0=1024, a1=-1))
        args.append((len(rows) - 1, {"dtype": "float32", "comm": "0x0", "seq": seq}))
        rows.append(row(ts + 10, p, SYNC, ret=35))
        rows.append(row(ts + 20, p, OFF_CPU))  # host events are not calls
    book.observe(rows, args)


def test_the_last_collective_call_and_identity_of_each_rank(sleepers: list[int]) -> None:
    book = RankBook()
    now = time.time_ns()
    feed_job(book, sleepers, [7, 6], [0.5, 2.0], now)
    got = {r["pid"]: r for r in book.snapshot("n1")}
    a, b = got[sleepers[0]], got[sleepers[1]]
    assert (a["rank"], a["world_size"], a["job"], a["comm"]) == (0, 2, "job-9", "python")
    [c] = a["collectives"]
    assert (c["op"], c["seq"], c["ret"], c["communicator"], c["calls"]) == (
        "ncclAllReduce", 7, 4, "0x0", 1)
    assert 0.4 * S < c["age_ns"] < 5 * S and c["comm_hash"] is None
    assert a["last_call"]["op"] == "cudaStreamSynchronize" and a["last_call"]["ret"] == 35
    assert b["collectives"][0]["seq"] == 6 and a["state"] == "sleeping"
    assert a["wchan"] is None or a["wchan"].isprintable()
    assert list(got) == [sleepers[0], sleepers[1]]  # most recently active first


def test_process_states_stopped_and_exited(sleepers: list[int]) -> None:
    book = RankBook()
    feed_job(book, sleepers, [3, 3], [0.1, 0.1], time.time_ns())
    subprocess.run(["kill", "-STOP", str(sleepers[0])], check=True)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        state = {r["pid"]: r for r in book.snapshot("n1")}[sleepers[0]]
        if state["state"] == "stopped":
            break
        time.sleep(0.02)
    assert state["state"] == "stopped" and state["state_code"] in ("T", "t")
    subprocess.run(["kill", "-KILL", str(sleepers[1])], check=True)
    subprocess.run(["sh", "-c", f"while kill -0 {sleepers[1]} 2>/dev/null && "
                    f"! grep -q '^State:.*Z' /proc/{sleepers[1]}/status; do sleep 0.01; done"],
                   timeout=10)
    book.observe_processes([{"pid": sleepers[1], "exit_ns": time.time_ns() - S,
                             "exit_code": None}])
    dead = {r["pid"]: r for r in book.snapshot("n1")}[sleepers[1]]
    assert dead["state"] == "exited" and dead["exit_code"] is None
    assert 0.9 * S < dead["exited_age_ns"] < 10 * S


def _fake_proc(root: Path, pid: int, state: str, start: int, wchan: str = "0") -> None:
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    rest = " ".join(["0"] * 17)  # fields 4..20, then starttime (field 22)
    (d / "stat").write_text(f"{pid} (py thon) {state} 1 {rest} {start} 0 0\n")
    (d / "wchan").write_text(wchan)
    (d / "environ").write_bytes(b"RANK=1\0WORLD_SIZE=2\0MASTER_ADDR=10.0.0.1\0"
                                b"MASTER_PORT=29500\0SECRET=x\0")


def test_d_state_with_its_wait_channel_and_a_reused_pid(tmp_path: Path) -> None:
    _fake_proc(tmp_path, 4242, "D", 777, "folio_wait_bit_common")
    book = RankBook(proc_root=tmp_path)
    book.observe([row(time.time_ns(), 4242, BCAST, a1=0)], [(0, {"comm": "0x0", "seq": 1})])
    [r] = book.snapshot("n1")
    assert (r["state"], r["state_code"], r["wchan"]) == ("d_state", "D",
                                                         "folio_wait_bit_common")
    # Identity read from the environment at first sight: only torchrun's variables.
    assert (r["rank"], r["world_size"], r["job"]) == (1, 2, "10.0.0.1:29500")
    _fake_proc(tmp_path, 4242, "S", 999)  # another process got the pid
    assert book.snapshot("n1")[0]["state"] == "exited"


def test_send_recv_per_peer_and_seq_counted_without_the_tracers(tmp_path: Path) -> None:
    _fake_proc(tmp_path, 10, "S", 1)
    book = RankBook(proc_root=tmp_path)
    t = time.time_ns()
    rows = [row(t + i, 10, op, a1=peer) for i, (op, peer) in
            enumerate([(SEND, 1), (RECV, 3), (SEND, 1), (ALLREDUCE, -1), (ALLREDUCE, -1)])]
    book.observe(rows, [(i, {"comm": "0xab"}) for i in range(len(rows))])
    [r] = book.snapshot("n1")
    assert {(e["op"], e["peer"], e["seq"]) for e in r["p2p"]} == {("ncclSend", 1, 2),
                                                                  ("ncclRecv", 3, 1)}
    assert r["collectives"][0]["seq"] == 2  # counted here: the records had no seq


def test_garbage_never_reaches_the_writer_as_an_error(tmp_path: Path) -> None:
    book = RankBook(proc_root=tmp_path)
    book.observe([row(1, 10, ALLREDUCE)], [(5, {"comm": 1})])  # an index beyond the rows
    book.observe([(1, 2)], [(0, {"comm": "0x0"})])  # a short row
    book.observe_processes([{"pid": "x"}, {"pid": 3, "exit_ns": 5}])
    assert book.failures >= 1 and book.count() == 0


def test_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ranksmod, "MAX_RANKS", 3)
    monkeypatch.setattr(ranksmod, "MAX_COMMS", 2)
    book = RankBook(proc_root=tmp_path)
    for pid in range(1, 6):
        book.observe([row(pid * S, pid, ALLREDUCE)], [(0, {"comm": "0x0", "seq": 1})])
    assert book.count() == 3 and book.dropped == 2
    assert {r["pid"] for r in book.snapshot("n1")} == {3, 4, 5}  # the least active went
    book.observe([row(9 * S + i, 5, ALLREDUCE) for i in range(4)],
                 [(i, {"comm": f"0x{i + 1}", "seq": 1}) for i in range(4)])
    assert len(next(r for r in book.snapshot("n1") if r["pid"] == 5)["collectives"]) == 2


def test_the_metrics_gauge_shows_how_long_local_ranks_wait(sleepers: list[int]) -> None:
    book = RankBook()
    feed_job(book, sleepers, [12, 11], [4.0, 4.5], time.time_ns())
    src = Sources(nccl_ranks=book.count, nccl_waits=local_waits(book, "n1"))
    text = render(NodeState(node="n1", tracing=True), src)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    # No node label: the scrape target names the node.
    assert [(s.labels, s.value) for s in families["fleetd_nccl_ranks"].samples] == [({}, 2)]
    (wait,) = families["fleetd_nccl_wait_seconds"].samples
    assert wait.labels == {"matching": "torchrun", "group": "job-9/2"}
    assert 3.9 < wait.value < 10
    empty = render(NodeState(node="n1"), Sources())
    assert "# TYPE fleetd_nccl_wait_seconds gauge" in empty
    assert "fleetd_nccl_wait_seconds{" not in empty


def test_the_observed_writer_stores_what_it_shows(tmp_path: Path, sleepers: list[int]
                                                  ) -> None:
    import sqlite3

    book = RankBook()
    w = ObservedWriter(tmp_path / "n.db", "n1", book)
    try:
        w.add_processes([{"pid": sleepers[0], "rank": 0, "world_size": 2}])
        w.add_events([row(time.time_ns(), sleepers[0], ALLREDUCE)],
                     [(0, {"comm": "0x0", "seq": 1})])
        assert w.flush()
    finally:
        w.close()
    conn = sqlite3.connect(tmp_path / "n.db")
    assert conn.execute("SELECT count(*) FROM event_data").fetchone()[0] == 1
    assert conn.execute("SELECT rank FROM process_data").fetchone()[0] == 0
    assert book.snapshot("n1")[0]["rank"] == 0


def test_the_cost_per_row_stays_small(tmp_path: Path) -> None:
    """Every batch passes through the book: the common rows (CUDA calls of ranks, host
    events) must cost well under a microsecond each."""
    book = RankBook(proc_root=tmp_path)
    now = time.time_ns()
    book.observe([row(now + p, p, ALLREDUCE) for p in range(1, 5)],
                 [(i, {"comm": "0x0", "seq": 1}) for i in range(4)])
    batch = [row(now + i, 1 + i % 8, LAUNCH if i % 3 else OFF_CPU) for i in range(50_000)]
    best = min(_timed(book, batch) for _ in range(5))
    assert best / len(batch) < 1e-6, f"{best / len(batch) * 1e9:.0f} ns per row"


def _timed(book: RankBook, batch: list[tuple[int, ...]]) -> float:
    t0 = time.perf_counter()
    book.observe(batch)
    return time.perf_counter() - t0
