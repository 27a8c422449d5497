"""Fast synthetic node databases for the merge and export benchmarks.

Rows are generated inside SQLite with recursive CTEs (a million events in a couple of
seconds), through the real schema and node registration, shaped like a training loop:
four threads issuing non-overlapping CUDA calls, off-CPU and run-queue intervals, block
I/O from a kworker, IRQs, launch args for a handful of kernels, shared stacks, one
session with clock samples, per-second histograms.
"""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetd.store.db import ensure_node, open_writer  # noqa: E402
from fleetd.store.schema import SEQ_BITS  # noqa: E402

T0 = 1_750_000_000 * 10**9
STEP_NS = 10_000  # one event every 10 us per node; calls on a thread never overlap
MAIN = 4242


def make_node_db(path: Path, node: str, n: int, rank: int = 0, stacks: int = 1000) -> Path:
    """A database of ``n`` events for ``node``; stacks overlap between nodes by design."""
    conn = open_writer(path)
    conn.execute("PRAGMA synchronous=OFF")
    key = ensure_node(conn, node)
    base = key << SEQ_BITS
    conn.execute("BEGIN")
    _events(conn, base, n)
    _args(conn, base, n)
    _small_tables(conn, key, rank, n, stacks)
    conn.execute("COMMIT")
    conn.close()
    return path


def _events(conn: sqlite3.Connection, base: int, n: int) -> None:
    # op by i % 10: 0-4 cudaLaunchKernel, 5 cudaMemcpyAsync, 6 cudaStreamSynchronize,
    # 7 off_cpu (preempted), 8 block_io by a kworker, 9 hardirq.
    conn.execute(
        f"""
        WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c WHERE i < {n})
        INSERT INTO event_data(id, ts_ns, dur_ns, pid, tid, op, ret, bytes, peer, a0, a1, stack)
        SELECT {base} + i, {T0} + i * {STEP_NS},
               CASE i % 10 WHEN 8 THEN 40000 ELSE 1000 + (i * 7919) % 8000 END,
               CASE i % 10 WHEN 8 THEN 55 ELSE {MAIN} END,
               CASE i % 10 WHEN 8 THEN 55 ELSE {MAIN} + i % 4 END,
               CASE i % 10 WHEN 5 THEN 102 WHEN 6 THEN 106 WHEN 7 THEN 500 WHEN 8 THEN 700
                           WHEN 9 THEN 900 ELSE 100 END,
               CASE WHEN i % 997 = 0 THEN 2 ELSE 0 END,
               CASE i % 10 WHEN 5 THEN 4096 WHEN 8 THEN 1048576 ELSE 0 END,
               CASE i % 10 WHEN 7 THEN 2000 ELSE 0 END,
               CASE i % 10 WHEN 0 THEN 65536 WHEN 8 THEN 8 WHEN 9 THEN 42 ELSE 0 END,
               CASE i % 10 WHEN 0 THEN 256 WHEN 8 THEN i ELSE 0 END,
               CASE WHEN i % 50 = 0 THEN (i / 50) % 1000 + 1 ELSE 0 END
        FROM c
        """
    )


def _args(conn: sqlite3.Connection, base: int, n: int) -> None:
    conn.execute(
        f"""
        WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c WHERE i < {n})
        INSERT INTO event_args(id, args)
        SELECT {base} + i, '{{"grid":[' || (i % 16 + 1) || ',1,1],"block":[256,1,1]}}'
        FROM c WHERE i % 10 < 5
        """
    )


def _small_tables(conn: sqlite3.Connection, key: int, rank: int, n: int, stacks: int) -> None:
    # Half the stacks are shared by every node (same hash), half are this node's own.
    conn.execute(
        f"""
        WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c WHERE i < {stacks})
        INSERT OR IGNORE INTO stacks(hash, frames)
        SELECT CASE WHEN i % 2 = 0 THEN i ELSE i + {rank + 1} * 1000003 END,
               '["libcudart.so+0x' || i || '", "train_step", "main"]' FROM c
        """
    )
    seconds = max(1, n * STEP_NS // 10**9)
    conn.execute(
        f"""
        WITH RECURSIVE w(s) AS (SELECT 0 UNION ALL SELECT s + 1 FROM w WHERE s < {seconds}),
             b(k) AS (SELECT -1 UNION ALL SELECT k + 1 FROM b WHERE k < 20)
        INSERT INTO aggregate_data(node, session, ts_ns, dur_ns, pid, op, bucket, count, sum)
        SELECT {key}, 1, {T0} + s * 1000000000, 1000000000, {MAIN}, op.code, k, 100, 100 << 12
        FROM w, b, (SELECT 100 AS code UNION ALL SELECT 102 UNION ALL SELECT 106) op
        """
    )
    conn.execute(
        "INSERT INTO session_data(node, seq, host, started_ns, ended_ns, mono_offset_ns, "
        "clock_error_ns, clock_samples, rank, tool_version, schema_version, lost_events) "
        "VALUES (?, 1, ?, ?, ?, ?, 500000, ?, ?, 'bench', 1, 0)",
        (key, f"host-{key}", T0, T0 + n * STEP_NS, T0 - 10**12,
         f"[[{10**12}, {T0 - 10**12}, 500000]]", rank),
    )
    conn.execute("INSERT INTO process_data(node, pid, comm, rank, world_size) VALUES "
                  "(?, ?, 'python3', ?, 8), (?, 55, 'kworker/u16:2', NULL, NULL)",
                  (key, MAIN, rank, key))
    conn.executemany("INSERT INTO task_data(node, tid, pid, comm) VALUES (?, ?, ?, ?)",
                     [(key, MAIN + t, MAIN, "python3" if t == 0 else f"worker{t}")
                      for t in range(4)] + [(key, 55, 55, "kworker/u16:2")])
