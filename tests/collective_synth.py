"""Synthetic multi-rank NCCL recordings: ranks calling collectives in lockstep, one of them
late by a chosen delay, written through BatchWriter as the tracer writes them (the record
contract of docs/schema.md: ``ts_ns`` = the rank's arrival, args with ``comm``, ``seq``
and, for a communicator the tracer saw created, ``comm_hash``/``rank``/``nranks``).

Each collective instance k starts at ``T0 + k * step``; every rank arrives within a small
jitter of it, plus its own delay; every call returns when the last rank has arrived (the
wait a real collective has). A node's clock may be shifted (all its times + skew).

A rank may be traced from a later instance on (``attach``: rank -> the first instance
its agent saw): its calls before are not recorded and it numbers from 1 there, as an
agent attached to a running job does. ``nbytes`` gives each instance's bytes (the same
on every rank; sizes that change from step to step are what the ranks are aligned by).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from synth import MS, T0, US

from fleetd.store.catalog import op_code
from fleetd.store.writer import BatchWriter

COMM_HASH = "0123456789abcdef"
COMM_PTR = "0x55d0c0ffee00"
JITTER_NS = 200 * US


@dataclass
class Rank:
    node: str
    pid: int
    rank: int
    delay: Callable[[int], int] | int = 0  # extra lateness at instance k (ns)
    ret: int = 0  # what its calls return (4 = ncclInvalidArgument)
    proc_rank: int | None = -1  # RANK of the process (-1: the same as ``rank``)

    def late(self, k: int) -> int:
        return self.delay(k) if callable(self.delay) else self.delay


def write_job(directory: Path, ranks: Sequence[Rank], *, n: int = 40, step: int = 50 * MS,
              matching: str = "communicator", comm_hash: str = COMM_HASH,
              op: str = "ncclAllReduce", skew: dict[str, int] | None = None,
              clock_error: dict[str, int] | None = None, seed: int = 7,
              one_file: Path | None = None, with_seq: bool = True,
              comm_ptr: str = COMM_PTR, start: int = T0,
              attach: dict[int, int] | None = None,
              nbytes: Callable[[int], int] | None = None) -> dict[str, Path]:
    """One database per node (or every node in ``one_file``, as a merged file holds
    them); returns node -> path."""
    rng = random.Random(seed)
    world = len(ranks)
    arrivals: dict[tuple[int, int], int] = {}
    for k in range(n):
        base = start + k * step
        for r in ranks:
            arrivals[(r.rank, k)] = base + rng.randrange(JITTER_NS) + r.late(k)
    paths: dict[str, Path] = {}
    for node in dict.fromkeys(r.node for r in ranks):
        mine = [r for r in ranks if r.node == node]
        shift = (skew or {}).get(node, 0)
        rows: list[tuple[int, ...]] = []
        args: list[tuple[int, dict[str, Any]]] = []
        for k in range(n):
            done = max(arrivals[(r.rank, k)] for r in ranks) + 300 * US
            for r in mine:
                first = (attach or {}).get(r.rank, 0)
                if k < first:
                    continue  # not traced yet
                ts = arrivals[(r.rank, k)]
                extra: dict[str, Any] = {"dtype": "float32", "comm": comm_ptr,
                                         "redop": "sum"}
                if with_seq:
                    extra["seq"] = k - first + 1
                if matching == "communicator":
                    extra.update(comm_hash=comm_hash, rank=r.rank, nranks=world)
                args.append((len(rows), extra))
                size = nbytes(k) if nbytes is not None else 4096
                rows.append((ts + shift, done - ts, r.pid, r.pid, op_code(op), r.ret,
                             size, 0, size // 4, -1, 0))
        path = one_file or directory / f"{node}.db"
        with BatchWriter(path, node) as w:
            if clock_error and node in clock_error:
                w.begin_session({"started_ns": T0 - 10**9, "ended_ns": T0 + n * step,
                                 "mono_offset_ns": T0, "clock_error_ns": clock_error[node],
                                 "tool_version": "synthetic", "schema_version": 2})
            w.add_processes([{"pid": r.pid, "comm": "python3",
                              "rank": r.rank if r.proc_rank == -1 else r.proc_rank,
                              "world_size": world if r.proc_rank is not None else None}
                             for r in mine])
            w.add_tasks([(r.pid, r.pid, "python3") for r in mine])
            order = sorted(range(len(rows)), key=lambda i: rows[i][0])
            where = {old: new for new, old in enumerate(order)}
            w.add_events([rows[i] for i in order],  # type: ignore[arg-type]
                         [(where[i], a) for i, a in args])
        paths[node] = path
    return paths


def four_ranks(late_rank: int = 2, delay: Callable[[int], int] | int = 20 * MS,
               nodes: Sequence[str] = ("gpu-01",) * 4, ret: int = 0) -> list[Rank]:
    """Ranks 0-3 (pids 1000 + rank) on ``nodes``; ``late_rank`` arrives ``delay`` late."""
    return [Rank(nodes[i], 1000 + i, i, delay if i == late_rank else 0, ret)
            for i in range(4)]
