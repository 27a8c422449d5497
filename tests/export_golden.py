"""The ``export_small`` scenario: two nodes, built by code with fixed timestamps, merged,
exported; its trace is the golden file ``tests/data/export_small/trace.json``.

The golden file changes only through this script:

    .venv/bin/python tests/export_golden.py --write    # regenerate after a deliberate change
    .venv/bin/python tests/export_golden.py            # compare, exit 1 on a difference

What the scenario holds (node gpu-a, rank 0, with a drifting clock; node gpu-b, rank 1):
CUDA launches with grid/block args, a runtime copy with its driver call nested inside, a
sync preempted by ``stress`` (off-CPU + run queue + IRQs inside it), a checkpoint
thread in D-state under two overlapping block requests, a sleep that straddles a call
(an overlap lane), a wakeup, an exec, a failing launch with a stack; stored chains
(HIGH cpu_contention with a culprit marker, MEDIUM block_io with I/O arrows, LOW
lock_wait in two versions), histograms, a session with clock samples and drop counters.
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fleetd.cli.main import main as fleetd_main  # noqa: E402
from fleetd.store.catalog import op_code  # noqa: E402
from fleetd.store.merge import merge  # noqa: E402
from fleetd.store.writer import BatchWriter  # noqa: E402

GOLDEN = ROOT / "tests" / "data" / "export_small" / "trace.json"
T0 = 1_750_000_000 * 10**9
MS, US = 1_000_000, 1_000
MONO0 = 10**12  # the monotonic clock reads this at T0 on gpu-a
LAUNCH_ARGS = {"grid": [256, 1, 1], "block": [256, 1, 1]}


def _ev(ts: int, dur: int, pid: int, tid: int, op: str, *, ret: int = 0, nbytes: int = 0,
        peer: int = 0, a0: int = 0, a1: int = 0, stack: int = 0) -> tuple[int, ...]:
    return (T0 + ts, dur, pid, tid, op_code(op), ret, nbytes, peer, a0, a1, stack)


# gpu-a's events in time order: their seq is their position + 1.
NODE_A: list[tuple[tuple[int, ...], dict[str, Any] | None]] = [
    (_ev(0, 8 * US, 100, 100, "cudaLaunchKernel", a0=65536, a1=256), LAUNCH_ARGS),   # 1
    (_ev(20 * US, 7 * US, 100, 100, "cudaLaunchKernel", a0=65536, a1=256), LAUNCH_ARGS),  # 2
    (_ev(50 * US, 200 * US, 100, 100, "cudaMemcpy", nbytes=1 << 20, a0=2), None),  # 3
    (_ev(60 * US, 150 * US, 100, 100, "cuMemcpyDtoH_v2", nbytes=1 << 20), None),  # 4
    (_ev(1 * MS, 5 * MS, 100, 100, "cudaStreamSynchronize"), None),  # 5
    (_ev(2 * MS, 3 * MS, 100, 100, "off_cpu", peer=200, a0=0), None),  # 6
    (_ev(2 * MS, 3 * MS, 100, 100, "runq_wait", peer=200), None),  # 7
    (_ev(2500 * US, 20 * US, 100, 100, "hardirq", a0=42), None),  # 8
    (_ev(2600 * US, 30 * US, 100, 100, "softirq", a0=3), None),  # 9
    (_ev(3 * MS, 10 * US, 100, 101, "cudaLaunchKernel", a0=1024, a1=128), None),  # 10
    (_ev(7 * MS, 2 * MS, 100, 100, "cudaLaunchKernel", a0=65536, a1=256), LAUNCH_ARGS),  # 11
    (_ev(7 * MS, 40 * MS, 100, 101, "syscall", a0=74), None),  # 12
    (_ev(7100 * US, 39 * MS, 100, 101, "off_cpu", a0=2), None),  # 13
    (_ev(7200 * US, 20 * MS, 55, 55, "block_io", nbytes=1 << 20, a0=8, a1=1000),
     {"rw": "W"}),  # 14
    (_ev(8 * MS, 12 * MS, 100, 100, "off_cpu", a0=1), None),  # 15
    (_ev(10 * MS, 20 * MS, 55, 55, "block_io", nbytes=1 << 20, a0=8, a1=3048), {"rw": "W"}),  # 16
    (_ev(20 * MS, 0, 100, 100, "wakeup", peer=301), None),  # 17
    (_ev(30 * MS, 0, 100, 100, "exec"), None),  # 18
    (_ev(31 * MS, 5 * US, 100, 100, "cudaLaunchKernel", ret=2, stack=0x1234), None),  # 19
    (_ev(46100 * US, 0, 100, 101, "wakeup", peer=55), None),  # 20
]
NODE_B: list[tuple[tuple[int, ...], dict[str, Any] | None]] = [
    (_ev(10 * US, 9 * US, 100, 100, "cudaLaunchKernel", a0=65536, a1=256), LAUNCH_ARGS),
    (_ev(30 * US, 9 * US, 100, 100, "cudaLaunchKernel", a0=65536, a1=256), LAUNCH_ARGS),
    (_ev(1 * MS, 2 * MS, 100, 100, "cudaStreamSynchronize"), None),
    (_ev(1500 * US, 300 * US, 100, 100, "off_cpu", peer=200, a0=0), None),
    (_ev(1500 * US, 300 * US, 100, 100, "runq_wait", peer=200), None),
]


def _item(seq: int, kind: str, text: str, node: str = "gpu-a", **extra: Any) -> dict[str, Any]:
    ts, dur = NODE_A[seq - 1][0][0], NODE_A[seq - 1][0][1]
    return {"ts_ns": ts, "dur_ns": dur, "kind": kind, "id": f"{node}:{seq}", "text": text,
            **extra}


STRESS = {"pid": 200, "tid": 200, "comm": "stress", "thread": "stress"}
KWORKER = {"pid": 55, "tid": 55, "comm": "kworker/u16:2", "thread": "kworker/u16:2"}
HALOLET = {"pid": 300, "tid": 301, "comm": "halolet", "thread": "halolet-poll"}
VICTIM = {"pid": 100, "tid": 100, "comm": "python3"}


def _chains() -> list[dict[str, Any]]:
    base = {"op": "cudaStreamSynchronize", "explained": 1.0, "impact": 0.1}
    cpu = {**base, "key": "cpu|100|stress", "ts_ns": T0 + 1 * MS, "dur_ns": 5 * MS,
           "severity": "HIGH", "root_cause": "cpu_contention",
           "summary": "cudaStreamSynchronize spiked to 5.0 ms while stress ran",
           "victim_pid": 100, "victim_tid": 100, "victim_comm": "python3",
           "culprit_pid": 200, "culprit_comm": "stress",
           "evidence": [_item(5, "spike", "cudaStreamSynchronize took 5.0 ms", tid=100),
                        _item(6, "off_cpu", "preempted; stress ran instead", state="R",
                              culprit=STRESS, spike="gpu-a:5", tid=100)],
           "fixes": ["pin python3 to dedicated cores", "renice stress"]}
    io = {**base, "key": "io|101|kworker", "ts_ns": T0 + 7100 * US, "dur_ns": 39 * MS,
          "severity": "MEDIUM", "root_cause": "block_io", "op": "cudaLaunchKernel",
          "summary": "pt_worker in D-state for 39 ms under checkpoint writes",
          "victim_pid": 100, "victim_tid": 101, "victim_comm": "python3",
          "culprit_pid": 55, "culprit_comm": "kworker/u16:2",
          "evidence": [_item(13, "stall", "thread 101 off CPU for 39.0 ms", tid=101),
                       _item(13, "off_cpu", "D-state wait during 2 block I/O request(s)",
                             state="D", culprit=KWORKER, spike="gpu-a:13", tid=101),
                       _item(14, "block_io", "block I/O by kworker", culprit=KWORKER,
                             spike="gpu-a:13", tid=55),
                       _item(16, "block_io", "block I/O by kworker", culprit=KWORKER,
                             spike="gpu-a:13", tid=55)],
          "fixes": ["move checkpoint writes off the training thread"]}
    lock = {**base, "key": "lock|100|halolet", "ts_ns": T0 + 8 * MS, "dur_ns": 12 * MS,
            "severity": "LOW", "root_cause": "lock_wait", "op": "cudaLaunchKernel",
            "summary": "python3 slept 12 ms until halolet woke it",
            "victim_pid": 100, "victim_tid": 100, "victim_comm": "python3",
            "culprit_pid": 300, "culprit_comm": "halolet",
            "evidence": [_item(15, "off_cpu", "sleep, woken by halolet (pid 300)", state="S",
                               culprit=HALOLET, spike="gpu-a:11", tid=100)],
            "fixes": ["look at what halolet holds"]}
    # The lock chain twice: history keeps both versions, the export shows the latest.
    return [cpu, io, {**lock, "summary": "first look"}, lock]


def _write_a(path: Path) -> None:
    off = T0 - MONO0
    with BatchWriter(path, "gpu-a", host="host-a") as w:
        # Two clock samples 1.05 s apart; the wall clock drifted 50 us between them.
        w.begin_session({
            "started_ns": T0 - 1_000 * MS, "ended_ns": T0 + 60 * MS, "mono_offset_ns": off,
            "clock_error_ns": 200 * US, "tool_version": "golden", "schema_version": 1,
            "clock_samples": [[MONO0 - 1_000 * MS, off, 200 * US],
                              [MONO0 + 50 * MS, off + 50 * US, 200 * US]],
            "rank": 0, "local_rank": 0, "world_size": 2, "lost_events": 3,
            "dropped_stacks": 1, "drops": {"cuda": 3}, "boot_id": "boot-a"})
        w.add_processes([{"pid": 100, "comm": "python3", "rank": 0, "world_size": 2},
                         {"pid": 200, "comm": "stress"}, {"pid": 55, "comm": "kworker/u16:2"},
                         {"pid": 300, "comm": "halolet"}])
        w.add_tasks([(100, 100, "python3"), (101, 100, "pt_worker"), (200, 200, "stress"),
                     (55, 55, "kworker/u16:2"), (301, 300, "halolet-poll")])
        w.add_stacks([(0x1234, ["cudaLaunchKernel", "train_step", "main"])])
        rows = [r for r, _ in NODE_A]
        w.add_events(rows, [(i, a) for i, (_, a) in enumerate(NODE_A) if a])  # type: ignore
        launch, sync = op_code("cudaLaunchKernel"), op_code("cudaStreamSynchronize")
        w.add_aggregates([(1, T0, 1_000 * MS, 100, launch, -1, 5000, 5000 * 8 * US),
                          (1, T0, 1_000 * MS, 100, launch, 13, 5000, 5000 * 8 * US),
                          (1, T0, 1_000 * MS, 100, sync, -1, 100, 100 * 2 * MS)])
        w.add_chains(_chains())


def _write_b(path: Path) -> None:
    with BatchWriter(path, "gpu-b", host="host-b") as w:
        w.add_processes([{"pid": 100, "comm": "python3", "rank": 1, "world_size": 2},
                         {"pid": 200, "comm": "stress"}])
        w.add_tasks([(100, 100, "python3"), (200, 200, "stress")])
        rows = [r for r, _ in NODE_B]
        w.add_events(rows, [(i, a) for i, (_, a) in enumerate(NODE_B) if a])  # type: ignore


def build(tmp: Path) -> Path:
    """The two node files, merged; returns the merged database."""
    a, b = tmp / "gpu-a.db", tmp / "gpu-b.db"
    _write_a(a)
    _write_b(b)
    out = tmp / "merged.db"
    merge([a, b], out)
    return out


def export(tmp: Path) -> bytes:
    db = build(tmp)
    trace = tmp / "trace.json"
    rc = fleetd_main(["export", "--db", str(db), "-o", str(trace), "--chains", "stored"])
    assert rc == 0
    return trace.read_bytes()


def main(argv: list[str]) -> int:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        data = export(Path(d))
    return write_or_compare(GOLDEN, data, "--write" in argv)


def write_or_compare(golden: Path, data: bytes, write: bool) -> int:
    """``--write``: store ``data`` as the golden file. Otherwise compare: 0 when equal,
    else the diff on stdout and 1."""
    if write:
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_bytes(data)
        print(f"wrote {golden} ({len(data)} bytes)")
        return 0
    old = golden.read_bytes() if golden.exists() else b""
    if old == data:
        print(f"{golden} is up to date")
        return 0
    sys.stdout.writelines(difflib.unified_diff(
        old.decode().splitlines(True), data.decode().splitlines(True), "golden", "now"))
    return 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
