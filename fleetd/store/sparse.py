"""The sparse ops' partial index: reading a rare op without walking every event.

event_data has one index, by time (an index on op, pid or tid doubled the writer's cost
per row: docs/performance.md). A read of one op over a window therefore walks every
event in it (~0.75 CPU s on a 10-minute, 7 M-event file), and explain makes about twenty
such reads of ops that are rare (NCCL calls, cgroup and on-CPU samples, block I/O,
reclaim stalls...), most of which find a handful of rows or none.

``event_sparse`` indexes (op, ts_ns) of the rows of the sparse sources only (each
source owns a block of 100 codes, fleetd.store.catalog): the dense ones (CUDA runtime
and driver calls, the scheduler, interrupts, syscalls), which make nearly every row, stay
out of it, so the writer only tests the condition for them. SQLite uses a partial index
only for a query whose WHERE holds the index's condition as written, so a reader adds
:func:`sparse_only` to a read of sparse ops; a file without the index (written before
schema version 8, opened read-only) answers the same query by the walk, as before.

The ranges below are part of the schema (version 8's SQL): never change them; a new
sparse source would need an index of its own.
"""

from __future__ import annotations

from collections.abc import Iterable

# [lo, hi] code ranges whose rows event_sparse holds: graph (200s), nccl (400s), mem
# (600s), block (700s), proc (800s), cgroup (1100s), cpu samples and GC pauses (1200s).
SPARSE_RANGES: tuple[tuple[int, int], ...] = ((200, 299), (400, 499), (600, 899),
                                              (1100, 1299))
SPARSE_TERM = "(" + " OR ".join(f"op BETWEEN {lo} AND {hi}" for lo, hi in SPARSE_RANGES) + ")"
SPARSE_INDEX_SQL = f"CREATE INDEX event_sparse ON event_data(op, ts_ns) WHERE {SPARSE_TERM};"


def is_sparse(code: int) -> bool:
    """Whether event_sparse holds ``code``'s rows."""
    return any(lo <= code <= hi for lo, hi in SPARSE_RANGES)


def sparse_only(codes: Iterable[int]) -> str:
    """`` AND <the index's condition>`` for a read of ``codes`` when every one of them is
    sparse (the condition is then true of every row the read wants, so the answer is the
    same and SQLite may use the index); "" otherwise."""
    wanted = list(codes)
    return f" AND {SPARSE_TERM}" if wanted and all(map(is_sparse, wanted)) else ""
