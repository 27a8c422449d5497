"""Batch writer throughput vs a bare executemany of the same rows into the same schema.

Both runs are pinned to one CPU, write the same pre-built rows into a fresh file with
the full schema (indexes included), and are timed until the last row is committed. The
per-second summaries the writer makes in its idle time (here all at close: the rows span
one second) are timed apart, as a ratio to the bare insert.
The writer is fed the way the tracer feeds it: many small lists from another thread.

Last line: BENCH store_writer events_per_s=N ratio=R summary_ratio=S
(target N >= 300000, R >= 0.8; S is the summaries' CPU over the bare insert's)
"""

from __future__ import annotations

import contextlib
import os
import random
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetd.store.db import ensure_node, open_writer  # noqa: E402
from fleetd.store.schema import EVENT_FIELDS, SEQ_BITS, EventRow  # noqa: E402
from fleetd.store.writer import BatchWriter  # noqa: E402

N = int(os.environ.get("BENCH_EVENTS", "1000000"))
CHUNK = 4096  # rows per add_events call, about one ring-buffer poll's worth
BATCH = 50_000


def make_rows(n: int) -> list[EventRow]:
    rng = random.Random(7)
    t0 = time.time_ns()
    ops = [100, 101, 102, 106, 500, 501]
    rows: list[EventRow] = []
    for i in range(n):
        op = ops[i % len(ops)]
        rows.append((t0 + i * 1000, rng.randint(1000, 90000), 4242, 4243 + i % 4, op,
                     0 if i % 97 else 100, 4096 if op in (101, 102) else 0, 0, i % 1024, 7, 0))
    return rows


def bare(path: Path, rows: list[EventRow]) -> float:
    conn = open_writer(path)
    key = ensure_node(conn, "bench")
    sql = (f"INSERT INTO event_data(id, {', '.join(EVENT_FIELDS)}) "
           f"VALUES ({', '.join('?' * (len(EVENT_FIELDS) + 1))})")
    base = key << SEQ_BITS
    t = time.perf_counter()
    for start in range(0, len(rows), BATCH):
        conn.execute("BEGIN")
        conn.executemany(sql, [(base + start + i + 1, *r)
                               for i, r in enumerate(rows[start:start + BATCH])])
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - t
    conn.close()
    return elapsed


def writer(path: Path, rows: list[EventRow]) -> tuple[float, float]:
    """Seconds until the last row is committed, and the writer's CPU seconds summing
    seconds (fleetd.store.summaries: in its idle time, here at close)."""
    w = BatchWriter(path, "bench", batch_rows=BATCH)
    t = time.perf_counter()
    for start in range(0, len(rows), CHUNK):
        w.add_events(rows[start:start + CHUNK])
    assert w.flush(timeout=600)
    elapsed = time.perf_counter() - t
    stats = w.close()
    assert stats.events_written == len(rows), stats
    assert stats.queue_dropped == 0 and stats.failed_rows == 0, stats
    return elapsed, stats.summary_cpu_ns / 1e9


def main() -> None:
    with contextlib.suppress(OSError):  # "on one core": pin producer and writer together
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    rows = make_rows(N)
    with tempfile.TemporaryDirectory() as d:
        # Alternate the two, best of 3 each, so neither gets a warmer cache.
        bare_t, writer_t, sum_t = [], [], []
        for i in range(3):
            bare_t.append(bare(Path(d) / f"bare{i}.db", rows))
            took, summing = writer(Path(d) / f"writer{i}.db", rows)
            writer_t.append(took)
            sum_t.append(summing)
        with sqlite3.connect(Path(d) / "writer0.db") as c:
            assert c.execute("SELECT count(*) FROM event_data").fetchone()[0] == N
    b, w = min(bare_t), min(writer_t)
    print(f"rows={N} sqlite={sqlite3.sqlite_version} cpu=1")
    print(f"bare executemany : {N / b:>12,.0f} events/s  ({b:.3f} s)")
    print(f"BatchWriter      : {N / w:>12,.0f} events/s  ({w:.3f} s)")
    print(f"per-second summaries: {min(sum_t):.3f} CPU s for the {N} rows, "
          f"{min(sum_t) / b:.2f} x the bare insert (idle time, not in the figures above)")
    print(f"BENCH store_writer events_per_s={N / w:.0f} ratio={b / w:.2f} "
          f"summary_ratio={min(sum_t) / b:.2f}")


if __name__ == "__main__":
    main()
