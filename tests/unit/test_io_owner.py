"""I/O by ownership (fleetd/analyze/causes/io_owner.py) over synthetic recordings whose
numbers are known: a feeding thread's D-state stalls for its own requests beside a
neighbour's, the same without any request recorded, and a kernel lock for contrast."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from synth import MAIN, MAIN_TID, MS, Timeline, base, training_loop

from fleetd.analyze.explain import explain
from fleetd.store.catalog import op_code
from fleetd.store.writer import BatchWriter

READER, COMPLETER, HOLDER = 3500, 44, 3600


class ArgsTimeline(Timeline):
    """A timeline whose events may carry args (a request's queued_ns, a wait's wchan)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra: dict[tuple[int, ...], dict[str, Any]] = {}

    def with_args(self, args: dict[str, Any]) -> None:
        self.extra[self.events[-1]] = args  # the event just added

    def write(self, path: Path, node: str = "gpu-01") -> Path:
        self.events.sort()
        with BatchWriter(path, node) as w:
            w.add_processes(self.procs)
            w.add_tasks(self.task_rows)
            w.add_events(self.events,  # type: ignore[arg-type]
                         [(i, self.extra[e]) for i, e in enumerate(self.events)
                          if e in self.extra])
            w.add_aggregates([(1, 1_750_000_000 * 10**9 + win * 10**9, 10**9, pid, op, b, c, s)
                              for (win, pid, op, b), (c, s) in sorted(self.hist.items())])
        return path


def _stall(tl: ArgsTimeline, t: int, wchan: str, waker: int) -> None:
    """A 20 ms D-state wait of the feeding thread between two calls."""
    tl.off_cpu(t, 20 * MS, 2, 0, waker=waker, runq=60_000)
    tl.extra[next(e for e in reversed(tl.events) if e[4] == op_code("off_cpu"))] = {
        "wchan": wchan, "kstack": [wchan, "filemap_read_folio", "filemap_fault"]}


def _recording(path: Path, own: bool, wchan: str = "folio_wait_bit_common",
               waker: int = COMPLETER, neighbour: bool = True) -> Path:
    tl = ArgsTimeline()
    base(tl)
    tl.process(READER, "disk-reader", 1)
    tl.process(COMPLETER, "kworker/1:1H", 2)
    tl.process(HOLDER, "stats-sidecar", 1)

    def hook(tl: Timeline, step: int, t: int) -> int:
        assert isinstance(tl, ArgsTimeline)
        if step % 20 != 10:
            return t
        _stall(tl, t, wchan, waker)
        if neighbour:  # its request is in service from the start of the wait, 13 ms
            tl.host("block_io", t, 13 * MS, pid=READER, tid=READER, nbytes=16 << 20)
            tl.with_args({"queued_ns": 0})
        if own:
            # The victim's own read: submitted 8 ms in, queued 4 ms behind the
            # neighbour's, then served for 8 ms: the wait ends as it completes.
            tl.host("block_io", t + 12 * MS, 8 * MS, pid=MAIN, tid=MAIN_TID, nbytes=4096)
            tl.with_args({"queued_ns": 4 * MS})
        return t + 20 * MS + 100_000

    training_loop(tl, hook=hook, step_ns=30 * MS)
    return tl.write(path)


def _chain(report: dict[str, Any], cause: str) -> dict[str, Any]:
    [c] = [c for c in report["chains"] if c["root_cause"] == cause]
    return c


def test_own_request_is_the_victims_the_neighbour_gets_the_queueing(tmp_path: Path) -> None:
    report = explain(_recording(tmp_path / "own.db", own=True))
    c = _chain(report, "block_io")
    assert not [x for x in report["chains"] if x["root_cause"] == "lock_wait"]
    shares = {k["comm"]: k["share"] for k in c["culprits"]}
    # 20 ms waits: 4 ms queued behind disk-reader's request, the rest its own.
    assert set(shares) == {"python3", "disk-reader"}, shares
    assert abs(shares["disk-reader"] - 0.2) < 0.01 and abs(shares["python3"] - 0.8) < 0.01
    assert c["culprits"][0]["self"] is True
    text = next(e["text"] for e in c["evidence"] if e["kind"] == "off_cpu")
    assert "1 request(s) of its own" in text and "4.0 ms of it queued behind" in text
    assert "a page fault on a mapped file" in text


def test_no_request_recorded_woken_by_the_block_worker_is_its_own_io(tmp_path: Path) -> None:
    report = explain(_recording(tmp_path / "none.db", own=False, waker=COMPLETER))
    # Only the neighbour's request overlaps: its owner shares the wait, the worker that
    # completed it never does, and it is not a lock wait.
    c = _chain(report, "block_io")
    assert [k["comm"] for k in c["culprits"]] == ["disk-reader"]
    assert not [x for x in report["chains"] if x["root_cause"] == "lock_wait"]


def test_a_page_wait_woken_by_the_block_worker_is_io_not_a_lock(tmp_path: Path) -> None:
    """No request recorded at all (the tracer keeps other tasks' requests only when
    slow): a wait for a page, ended by the block layer's completion worker, is the
    thread's own read, not a lock wait woken by kworker/1:1H."""
    report = explain(_recording(tmp_path / "page.db", own=False, neighbour=False))
    c = _chain(report, "block_io")
    assert [(k["comm"], k["self"]) for k in c["culprits"]] == [("python3", True)]
    assert not [x for x in report["chains"] if x["root_cause"] == "lock_wait"]


def test_a_kernel_lock_stays_lock_wait(tmp_path: Path) -> None:
    tl = ArgsTimeline()
    base(tl)
    tl.process(HOLDER, "stats-sidecar", 1)

    def hook(tl: Timeline, step: int, t: int) -> int:
        assert isinstance(tl, ArgsTimeline)
        if step % 20 != 10:
            return t
        _stall(tl, t, "rwsem_down_write_slowpath", HOLDER)
        return t + 20 * MS + 100_000

    training_loop(tl, hook=hook, step_ns=30 * MS)
    report = explain(tl.write(tmp_path / "lock.db"))
    c = _chain(report, "lock_wait")
    assert c["culprits"][0]["comm"] == "stats-sidecar"
    assert not [x for x in report["chains"] if x["root_cause"] == "block_io"]
