"""PyTorch profiler (Kineto) Chrome-trace JSON, one file per rank, into a node's store.

``ts``/``dur`` are microseconds, possibly fractional; with ``baseTimeNanoseconds`` at the
top level (before or after the events) they are relative to it, otherwise they already
count from the epoch. GPU events carry ``args.device``/``args.stream`` and
``args.correlation``, the id of the ``cuda_runtime`` call that launched them, whose pid is
the process the GPU work belongs to (the GPU rows' own pid is the device).
``distributedInfo`` names the rank; without it the node is named after the file.

Files of other PyTorch versions: categories are matched case-insensitively (early Kineto
wrote ``Kernel``, ``Runtime``, ``Memcpy``, ``Memset``, ``Operator``); a pid or tid written
as a decimal string (early Kineto wrote ``"tid": "1234"``) is that number, a GPU row's
``"tid": "stream 7"`` its stream, ``args.inDevice`` (peer copies) its device; a rank or
world size written as a string is read as its number; the bare-array form may lack its
closing ``]`` (early Kineto did not write it, and the Chrome format allows that). Fields
fleetd does not use are ignored, whatever their names. Bytes that are not UTF-8 are read
as U+FFFD, and an escaped lone surrogate (``"\\ud800"``, as Python's json writes bytes it
could not decode) as a name with '?', both counted in a warning. Events of other
categories (python functions, flows, overhead) are counted and skipped; malformed events
are skipped and reported, never guessed. Refused: a file that is no JSON, JSON without a
``traceEvents`` list, and a Chrome trace none of whose events has a profiler category
(another tool's trace).

Bounded memory, whatever the file's size and compression, in three stages, a module
each: the text is read a MiB at a time and the ``traceEvents`` array parsed about
CHUNK_BYTES at a time (:mod:`fleetd.ingest.kineto_text`); each piece's events are
checked and turned into flat row tuples (:mod:`fleetd.ingest.kineto_events`), which go
to a private scratch SQLite file every FLUSH_ROWS rows (:mod:`fleetd.ingest.kineto_stage`,
in SQLite's temp directory: ``$SQLITE_TMPDIR`` or ``$TMPDIR``). When the file is read,
SQLite puts the rows in time order and links each kernel to its launch call by
correlation (its sorter spills to disk too), and the writer reads them back row by row
(:class:`fleetd.ingest.kineto_stage.Rows`) into the database. This module runs the three
and turns what they found into the session's batch and warnings. What stays in memory:
one piece, the names (one copy of each distinct one, cut to MAX_NAME_CHARS before any
cache keeps it: a 1.21 GB file of 1,154 distinct 1 MiB kernel names peaked at 1,350 MB,
now 64 MB), the process and thread names, SQLite's caches. The peak is checked against
MAX_RSS_BYTES every few pieces: a file that would need more (millions of distinct names)
is refused in one line.
Peak RSS of ``fleetd import`` of a 334 MB trace (1M events): 740 MB when the file was
parsed in memory, 120 MB streamed; of a 1 GB trace (3M events): 125 MB (bench/import.py
prints ``peak_mb_per_gb``). The price is the rows' round trip through the scratch file:
about a quarter more CPU (1M events: 5.3 -> 6.6 s; 1 GB: 14.7 -> 18.7 s, its wall time
the same, 26.7 -> 25.1 s, as the old peak of 2.2 GB cost page faults).
"""

from __future__ import annotations

import re
from typing import Any, cast

from fleetd.ingest import kineto_text
from fleetd.ingest.kineto_events import Converter, opt_int
from fleetd.ingest.kineto_stage import GPU_ROWS, EventArgs, Facts, Rows, Stage
from fleetd.ingest.kineto_text import Clock, SplitFailed, Text
from fleetd.ingest.session import Names, Parsed, Source, check_node, new_batch
from fleetd.store.imports import GPU_KINDS, AnnotationRow, GpuRow, ImportArgs
from fleetd.store.schema import EventRow

_EPOCH_US = 1e14  # timestamps below this (1973) are relative, not epoch microseconds


def read(src: Source, names: Names, node: str | None) -> Parsed:
    """The trace file ``src`` as one session's rows; UsageError when it cannot be read."""
    clock = Clock(0.0)
    stage = Stage(src)
    try:
        conv = Converter(names, stage)
        try:  # streamed, else whole: looked up on the module, where tests swap them
            text = kineto_text.streamed(src, conv.add, clock)
        except SplitFailed as failed:
            names.reset()
            stage.close()
            stage = Stage(src)
            conv = Converter(names, stage)
            text = kineto_text.whole(src, conv.add, clock, failed)
        return _read(src, names, node, text, conv, stage, clock)
    except BaseException:
        stage.close()
        raise


def _read(src: Source, names: Names, node: str | None, text: Text, conv: Converter,
          stage: Stage, clock: Clock) -> Parsed:
    conv.flush()
    doc = text.doc
    conv.check_profiler(src, doc)
    dist = doc.get("distributedInfo")
    rank = opt_int(dist.get("rank")) if isinstance(dist, dict) else None
    world = opt_int(dist.get("world_size")) if isinstance(dist, dict) else None
    base = opt_int(doc.get("baseTimeNanoseconds")) or 0
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", src.path.name.split(".")[0])[:64] or "kineto"
    default = f"rank-{rank}" if rank is not None else stem
    name = check_node(node or default)
    facts = stage.finish(src, base)
    # made now, as it waits for the file's hash (computed meanwhile on another thread)
    batch = new_batch(src, name, None, base, 1000)
    batch.source["rank"], batch.source["world_size"] = rank, world
    batch.rank, batch.world_size = rank, world
    batch.started_ns, batch.ended_ns = facts.started, facts.ended
    # Rows read from the scratch file as the writer goes, not lists: the writer takes
    # their length, first and last row and one pass (store.imports._bulk), and that is
    # all these offer (the batch's fields are lists for the readers that build them).
    batch.events = cast("list[EventRow]", Rows(
        stage, "SELECT * FROM api_s", "?1 + ts_rel, dur, pid, tid, op, 0, 0, 0, corrf, 0, 0",
        "idx", base, facts.events))
    batch.event_args = cast("list[tuple[int, ImportArgs]]", EventArgs(stage))
    batch.gpu = cast("list[GpuRow]", Rows(
        stage, GPU_ROWS, "?1 + ts_rel, dur, dev, stream, kind, name, corr, bytes, coll, gx, gy, "
        "gz, bx, by, bz, pid, launch", "ts, rowid", base, facts.gpu, facts.ends["gpu"]))
    batch.annotations = cast("list[AnnotationRow]", Rows(
        stage, "SELECT rowid AS rowid, * FROM rng", "?1 + ts_rel, dur, pid, tid, kind, name",
        "ts, rowid", base, facts.annotations, facts.ends["rng"]))
    batch.names = names.by_hash
    batch.processes = [{"pid": p, "comm": conv.proc_names.get(p), "rank": rank,
                        "world_size": world} for p in facts.pids]
    batch.tasks = [(t, p, conv.thread_names.get(t)) for t, p in facts.tasks]
    parsed = Parsed(batch)
    kinds = facts.kinds
    parsed.counts.update(runtime=facts.events, kernels=kinds.get(GPU_KINDS["kernel"], 0),
                         memcpy=kinds.get(GPU_KINDS["memcpy"], 0),
                         memset=kinds.get(GPU_KINDS["memset"], 0),
                         annotations=facts.annotations, skipped=conv.skipped)
    _warn(src, parsed, text, conv, facts, base, dist)
    parsed.timings["parse"] = clock.seconds
    return parsed


def _warn(src: Source, parsed: Parsed, text: Text, conv: Converter, facts: Facts,
          base: int, dist: Any) -> None:
    warn = parsed.warnings.append
    if text.replaced:
        warn(f"{text.replaced} byte sequence(s) that are not UTF-8 read as U+FFFD (names "
             "or values written with another encoding, or a damaged file)")
    if text.surrogates:
        warn(f"{text.surrogates} escaped lone surrogate(s) (\\ud800-\\udfff, text that was "
             "not UTF-8 when the trace was written) read as '?'")
    if text.unclosed:
        warn("the trace ends without the closing ']' of its events, as early PyTorch "
             "profilers wrote it: read up to its last complete event")
    if base == 0 and facts.first_ts is not None and facts.first_ts < _EPOCH_US * 1000:
        warn(f"{src.path}: timestamps are relative and the file has no "
             "baseTimeNanoseconds: placed at the epoch, so they line up "
             "with no other recording")
    if not isinstance(dist, dict) and facts.events + facts.gpu + facts.annotations:
        warn("no distributedInfo (rank, world size): the node is named after the file "
             "unless --node names it, and the rank is unknown")
    if conv.bad:
        warn(f"{conv.bad} malformed event(s) (missing or non-numeric ts/dur, no name) "
             "skipped")
    if not facts.gpu:
        warn("no GPU events (kernels, copies, sets) in this trace: GPU metrics are "
             "unavailable for it; the host side was imported")
    elif not facts.gpu_pid:
        warn("GPU events without a launching CUDA call: their process is unknown (pid 0)")

