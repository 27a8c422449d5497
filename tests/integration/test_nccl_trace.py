"""NCCL tracing end to end: real BPF programs, the real libnccl, the real CLI.

The multi-rank workload (tests/workloads/nccl_ranks.py) starts three local ranks with
torchrun's environment; each loads the nvidia-nccl-cu12 wheel's libnccl, gets the
unique id from rank 0 over TCP and creates its communicator, then calls collectives (or
send/recv in a ring) in lockstep. Without a GPU the init fails (1) and every collective
fails at once (4), and the probes fire all the same. ``fleetd trace --pid`` follows the
launcher and its ranks; every call each rank says it made must be recorded once, with
its op, count, datatype, reduction, root or peer, return code, sequence number, rank
and job, and the init records of all ranks must carry the same communicator hash: the
hash of the unique id the ranks were handed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import test_trace
from recorder import StderrLog
from test_trace import _bpf_ready  # the same requirements as the tracer's own tests

from fleetd.trace.bpf.decoder import nccl_id_hash

from conftest import FLEETD, REPO

WORKLOAD = REPO / "tests" / "workloads" / "nccl_ranks.py"
PY = sys.executable
RANKS = 3

_WHY = _bpf_ready()
pytestmark = [pytest.mark.bpf, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

COLLECTIVES = ("ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather",
               "ncclReduceScatter")
NCCL_INVALID_ARGUMENT = 4


class Traced(test_trace.Traced):
    """test_trace's recording, its workload's summary each rank's (rank -> summary)."""

    @property
    def ranks(self) -> dict[int, dict[str, Any]]:
        return self.workload

    def nccl(self, pid: int) -> list[dict[str, Any]]:
        """The process's NCCL events in call order, args decoded."""
        rows = self.q("SELECT op, ret, bytes, a0, a1, tid, args FROM events "
                      "WHERE pid = ? AND source = 'nccl' ORDER BY ts_ns, rowkey", pid)
        return [{"op": op, "ret": ret, "bytes": b, "a0": a0, "a1": a1, "tid": tid,
                 "args": json.loads(args) if args else {}}
                for op, ret, b, a0, a1, tid, args in rows]


def run_ranks(tmp: Path, workload_args: list[str]) -> Traced:
    go, db = tmp / "go", tmp / "trace.db"
    wl = subprocess.Popen([PY, str(WORKLOAD), "--spawn", str(RANKS), "--go-file", str(go),
                           "--barrier-timeout", "60", *workload_args],
                          stdout=subprocess.PIPE, text=True, start_new_session=True)
    tr = None
    try:
        assert wl.stdout is not None
        ready = json.loads(wl.stdout.readline())  # every rank has loaded libnccl
        assert ready["event"] == "ready" and len(ready["pids"]) == RANKS, ready
        tr = subprocess.Popen(
            [FLEETD, "trace", "--pid", str(wl.pid), "--db", str(db), "--node", "nccl-node",
             "--no-host", "--summary-json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        log = StderrLog(tr)
        assert log.tracing(60), log.text(1)
        go.touch()
        out, _ = wl.communicate(timeout=90)
        assert wl.returncode == 0, out
        assert tr.stdout is not None
        tr_out = tr.stdout.read()
        tr.wait(60)
        err = log.text()
        assert tr.returncode == 0, err
        ranks = {}
        for line in out.splitlines():
            d = json.loads(line)
            ranks[d["rank"]] = d
        assert sorted(ranks) == list(range(RANKS)), out
        return Traced(ranks, json.loads(tr_out), db, err)
    finally:
        for p in (wl, tr):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def collectives(tmp_path_factory: pytest.TempPathFactory) -> Traced:
    """60 steps: each collective 12 times per rank, more failures per op and second than
    the error budget (10) lets through for sampled ops; ranks 1 uses InitRankConfig."""
    return run_ranks(tmp_path_factory.mktemp("coll"),
                     ["--steps", "60", "--redop", "cycle", "--init", "mixed", "--split",
                      "--count", "1000", "--dtype", "float32"])


@pytest.fixture(scope="module")
def ring(tmp_path_factory: pytest.TempPathFactory) -> Traced:
    return run_ranks(tmp_path_factory.mktemp("ring"),
                     ["--steps", "15", "--mode", "ring", "--count", "64", "--dtype", "bfloat16"])


def _expected(call: dict[str, Any]) -> tuple[Any, ...]:
    """What the record of a collective or send/recv call must say."""
    op = call["op"]
    peer = call.get("peer", call.get("root", -1))
    return (op, call["count"], peer, call["dtype"], call.get("redop"), call["ret"])


def _recorded(e: dict[str, Any]) -> tuple[Any, ...]:
    return (e["op"], e["a0"], e["a1"], e["args"]["dtype"], e["args"].get("redop"), e["ret"])


def _calls(t: Traced, ops: tuple[str, ...]) -> dict[int, list[dict[str, Any]]]:
    return {r: [c for c in s["calls"] if c["op"] in ops] for r, s in t.ranks.items()}


def test_every_collective_is_recorded_once_with_its_arguments(collectives: Traced) -> None:
    t = collectives
    assert t.summary["lost_total"] == 0 and t.summary["unreported_loss"] == 0, t.summary
    for rank, calls in _calls(t, COLLECTIVES).items():
        s = t.ranks[rank]
        assert len(calls) == 60 and s["steps"] == 60
        got = [e for e in t.nccl(s["pid"]) if e["op"] in COLLECTIVES]
        # Every failed call is there: 12 per op, beyond the per-second error budget.
        assert [_recorded(e) for e in got] == [_expected(c) for c in calls]
        assert {e["ret"] for e in got} == {NCCL_INVALID_ARGUMENT}
        assert all(e["bytes"] == e["a0"] * 4 for e in got)  # float32
        assert all(e["tid"] == s["tid"] and e["args"]["comm"] == "0x0" for e in got)
        # One counter per (process, communicator) over all five collectives.
        assert [e["args"]["seq"] for e in got] == list(range(1, 61))
        # No communicator was created, so nothing carries a communicator hash.
        assert not any("comm_hash" in e["args"] for e in got)
        assert s["counts"] == {op: n for op, n in _op_counts(t, s["pid"]).items()}


def _op_counts(t: Traced, pid: int) -> dict[str, int]:
    return dict(t.q("SELECT op, count(*) FROM events WHERE pid = ? AND source = 'nccl' "
                    "GROUP BY op", pid))


def test_ranks_match_by_their_sequence_numbers(collectives: Traced) -> None:
    by_seq: dict[int, set[tuple[Any, ...]]] = defaultdict(set)
    rows = collectives.q(
        "SELECT e.op, e.a0, e.a1, json_extract(e.args, '$.seq'), p.rank FROM events e "
        "JOIN processes p ON p.pid = e.pid WHERE e.source = 'nccl' AND e.op IN "
        f"({', '.join('?' * len(COLLECTIVES))})", *COLLECTIVES)
    ranks_at: dict[int, set[int]] = defaultdict(set)
    for op, count, root, seq, rank in rows:
        by_seq[seq].add((op, count, root))
        ranks_at[seq].add(rank)
    assert sorted(by_seq) == list(range(1, 61))
    assert all(len(v) == 1 for v in by_seq.values())  # the same call on every rank
    assert all(v == set(range(RANKS)) for v in ranks_at.values())


def test_ranks_and_job_come_from_the_torchrun_environment(collectives: Traced) -> None:
    t = collectives
    jobs = set()
    for rank, s in t.ranks.items():
        row = t.q("SELECT rank, local_rank, world_size, job FROM processes WHERE pid = ?",
                  s["pid"])
        assert row == [(rank, rank, RANKS, s["job"])]
        jobs.add(s["job"])
    assert len(jobs) == 1 and jobs.pop().startswith("nccl-ranks-")  # TORCHELASTIC_RUN_ID


def test_init_records_carry_rank_and_the_unique_id_hash(collectives: Traced) -> None:
    t = collectives
    hashes = set()
    for rank, s in t.ranks.items():
        ev = t.nccl(s["pid"])
        inits = [e for e in ev if e["op"].startswith("ncclCommInitRank")]
        assert len(inits) == 1
        init = inits[0]
        # --init mixed: odd ranks use ncclCommInitRankConfig (rank in the same register)
        assert init["op"] == s["init"]["op"] == ("ncclCommInitRankConfig" if rank % 2
                                                  else "ncclCommInitRank")
        assert (init["a0"], init["a1"], init["ret"]) == (RANKS, rank, s["init"]["ret"])
        assert init["ret"] != 0 and init["args"]["comm"] == "0x0"  # no GPU, no communicator
        # Read from the caller's stack at entry: the id passed by value.
        assert init["args"]["comm_hash"] == f"{nccl_id_hash(bytes.fromhex(s['unique_id'])):016x}"
        hashes.add(init["args"]["comm_hash"])
        split = [e for e in ev if e["op"] == "ncclCommSplit"]
        assert [(e["a0"], e["a1"], e["args"]) for e in split] == [
            (rank % 2, rank, {"parent": "0x0", "color": rank % 2, "key": rank, "comm": "0x0"})]
        assert [e["args"] for e in ev if e["op"] == "ncclCommDestroy"] == [{"comm": "0x0"}]
        assert ev[0]["op"] == init["op"] and ev[-1]["op"] == "ncclCommDestroy"
    assert len(hashes) == 1


def test_send_recv_carry_peers_and_per_peer_sequences(ring: Traced) -> None:
    t = ring
    assert t.summary["lost_total"] == 0 and t.summary["unreported_loss"] == 0, t.summary
    sent: dict[tuple[int, int, int], int] = {}  # (from, to, seq) -> count
    received: dict[tuple[int, int, int], int] = {}
    for rank, calls in _calls(t, ("ncclSend", "ncclRecv")).items():
        s = t.ranks[rank]
        ev = t.nccl(s["pid"])
        got = [e for e in ev if e["op"] in ("ncclSend", "ncclRecv")]
        assert len(calls) == 30
        assert [_recorded(e) for e in got] == [_expected(c) for c in calls]
        assert all(e["bytes"] == e["a0"] * 2 for e in got)  # bfloat16
        for op in ("ncclSend", "ncclRecv"):
            mine = [e for e in got if e["op"] == op]
            assert len({e["a1"] for e in mine}) == 1  # one peer each way in a ring
            assert [e["args"]["seq"] for e in mine] == list(range(1, 16))
        for e in got:
            key = ((rank, e["a1"]) if e["op"] == "ncclSend" else (e["a1"], rank))
            (sent if e["op"] == "ncclSend" else received)[(*key, e["args"]["seq"])] = e["a0"]
        groups = [e["op"] for e in ev if e["op"].startswith("ncclGroup")]
        assert groups == ["ncclGroupStart", "ncclGroupEnd"] * 15
        assert s["counts"] == _op_counts(t, s["pid"])
    # The k-th send from a to b meets the k-th receive at b from a, with the same count.
    assert sent == received and len(sent) == RANKS * 15
