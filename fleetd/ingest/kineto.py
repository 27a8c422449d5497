"""PyTorch profiler (Kineto) Chrome-trace JSON, one file per rank, into a node's store.

``ts``/``dur`` are microseconds, possibly fractional; with ``baseTimeNanoseconds`` at the
top level they are relative to it, otherwise they already count from the epoch. GPU
events carry ``args.device``/``args.stream`` and ``args.correlation``, the id of the
``cuda_runtime`` call that launched them, whose pid is the process the GPU work belongs
to (the GPU rows' own pid is the device). ``distributedInfo`` names the rank.

Categories are matched case-insensitively (older profilers wrote ``Kernel``,
``Runtime``...). Events of other categories (python functions, flows, overhead) are
counted and skipped; malformed events are skipped and reported, never guessed.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from fleetd.errors import UsageError
from fleetd.ingest.session import (
    Names,
    Parsed,
    Source,
    api_op,
    check_node,
    finish,
    nccl_collective,
    new_batch,
    read_json_bytes,
    us_to_ns,
)
from fleetd.store.imports import ANNOTATION_KINDS, GPU_KINDS, ImportBatch

_GPU = {"kernel": GPU_KINDS["kernel"], "gpu_memcpy": GPU_KINDS["memcpy"],
        "memcpy": GPU_KINDS["memcpy"], "gpu_memset": GPU_KINDS["memset"],
        "memset": GPU_KINDS["memset"]}
_API = frozenset({"cuda_runtime", "runtime", "cuda_driver", "driver"})
_RANGES = {"cpu_op": ANNOTATION_KINDS["cpu_op"], "operator": ANNOTATION_KINDS["cpu_op"],
           "user_annotation": ANNOTATION_KINDS["user_annotation"]}
_STEP = re.compile(r"ProfilerStep#\d+$")
_EPOCH_US = 1e14  # timestamps below this (1973) are relative, not epoch microseconds


def read(src: Source, names: Names, node: str | None) -> Parsed:
    doc = _load(src)
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        raise UsageError(f"{src.path}: JSON without a traceEvents list, so not a PyTorch "
                         "profiler trace", "save profiles with prof.export_chrome_trace(path)")
    dist = doc.get("distributedInfo")
    rank = _opt_int(dist.get("rank")) if isinstance(dist, dict) else None
    world = _opt_int(dist.get("world_size")) if isinstance(dist, dict) else None
    base = _opt_int(doc.get("baseTimeNanoseconds")) or 0
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", src.path.name.split(".")[0])[:64] or "kineto"
    default = f"rank-{rank}" if rank is not None else stem
    batch = new_batch(src, check_node(node or default), None, base, 1000,
                      {"rank": rank, "world_size": world})
    batch.rank, batch.world_size = rank, world
    parsed = Parsed(batch)
    _convert(events, batch, names, base, parsed)
    if base == 0 and batch.events and batch.events[0][0] < _EPOCH_US * 1000:
        parsed.warnings.append(f"{src.path}: timestamps are relative and the file has no "
                               "baseTimeNanoseconds: placed at the epoch, so they line up "
                               "with no other recording")
    finish(batch, names)
    return parsed


def _load(src: Source) -> dict[str, Any]:
    text = read_json_bytes(src.path)
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise UsageError(f"{src.path}: not valid JSON ({str(exc)[:120]})",
                         "is the file complete? a trace cut short cannot be read") from exc
    if isinstance(doc, list):  # the bare-array form of the Chrome trace format
        return {"traceEvents": doc}
    if not isinstance(doc, dict):
        raise UsageError(f"{src.path}: JSON, but not a trace (a {type(doc).__name__})",
                         "save profiles with prof.export_chrome_trace(path)")
    return doc


def _opt_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class _Sorter:
    """The trace's events split by category, checked field by field."""

    def __init__(self) -> None:
        self.api: list[dict[str, Any]] = []
        self.gpu: list[tuple[int, dict[str, Any]]] = []
        self.ranges: list[tuple[int, dict[str, Any]]] = []
        self.proc_names: dict[int, str] = {}
        self.thread_names: dict[int, str] = {}
        self.skipped = 0
        self.bad = 0

    def add(self, ev: Any) -> None:
        if not isinstance(ev, dict):
            self.bad += 1
            return
        ph = ev.get("ph")
        if ph == "M":
            self._meta(ev)
            return
        if ph != "X":
            self.skipped += 1
            return
        cat = ev.get("cat")
        cat = cat.lower() if isinstance(cat, str) else ""
        if not (_num(ev.get("ts")) and _num(ev.get("dur")) and isinstance(ev.get("name"), str)):
            self.bad += int(cat in _API or cat in _GPU or cat in _RANGES)
            self.skipped += int(not (cat in _API or cat in _GPU or cat in _RANGES))
            return
        if cat in _API:
            self.api.append(ev)
        elif cat in _GPU:
            self.gpu.append((_GPU[cat], ev))
        elif cat in _RANGES:
            self.ranges.append((_RANGES[cat], ev))
        else:
            self.skipped += 1

    def _meta(self, ev: dict[str, Any]) -> None:
        args = ev.get("args")
        name = args.get("name") if isinstance(args, dict) else None
        if not isinstance(name, str):
            return
        if ev.get("name") == "process_name" and _opt_int(ev.get("pid")) is not None:
            self.proc_names[ev["pid"]] = name[:64]
        elif ev.get("name") == "thread_name" and _opt_int(ev.get("tid")) is not None:
            self.thread_names[ev["tid"]] = name[:64]


def _convert(events: list[Any], batch: ImportBatch, names: Names, base: int,
             parsed: Parsed) -> None:
    s = _Sorter()
    for ev in events:
        s.add(ev)
    launches = _api(s, batch, base)
    _gpu(s, batch, names, base, launches)
    _ranges(s, batch, names, base)
    main_pid = _main_pid(batch)
    pids = {r[2] for r in batch.events} | {r[2] for r in batch.gpu} | {
        r[2] for r in batch.annotations}
    batch.processes = [{"pid": p, "comm": s.proc_names.get(p), "rank": batch.rank,
                        "world_size": batch.world_size} for p in sorted(pids)]
    tids = {(r[3], r[2]) for r in batch.events} | {(r[3], r[2]) for r in batch.annotations}
    batch.tasks = [(t, p, s.thread_names.get(t)) for t, p in sorted(tids)]
    kinds = [r[5] for r in batch.gpu]
    parsed.counts.update(runtime=len(batch.events), kernels=kinds.count(GPU_KINDS["kernel"]),
                         memcpy=kinds.count(GPU_KINDS["memcpy"]),
                         memset=kinds.count(GPU_KINDS["memset"]),
                         annotations=len(batch.annotations), skipped=s.skipped)
    if s.bad:
        parsed.warnings.append(f"{s.bad} malformed event(s) (missing or non-numeric ts/dur, "
                               "no name) skipped")
    if not batch.gpu:
        parsed.warnings.append("no GPU events (kernels, copies, sets) in this trace: GPU "
                               "metrics are unavailable for it; the host side was imported")
    if main_pid is None and batch.gpu:
        parsed.warnings.append("GPU events without a launching CUDA call: their process is "
                               "unknown (pid 0)")


def _api(s: _Sorter, batch: ImportBatch, base: int) -> dict[int, int]:
    """CUDA runtime/driver calls, in time order; correlation id -> event index."""
    launches: dict[int, int] = {}
    s.api.sort(key=lambda e: e["ts"])
    for ev in s.api:
        pid, tid = _opt_int(ev.get("pid")), _opt_int(ev.get("tid"))
        if pid is None or tid is None:
            s.bad += 1
            continue
        args = ev.get("args")
        corr = _opt_int(args.get("correlation")) if isinstance(args, dict) else None
        code, other = api_op(ev["name"])
        idx = len(batch.events)
        batch.events.append((base + us_to_ns(ev["ts"]), max(0, us_to_ns(ev["dur"])), pid, tid,
                             code, 0, 0, 0, (corr or 0) if other is not None else 0, 0, 0))
        if other is not None:
            batch.event_args.append((idx, {"name": other, "correlation": corr}))
        if corr:
            launches[corr] = idx
    return launches


def _dims(v: Any) -> tuple[int, int, int]:
    if isinstance(v, list) and len(v) == 3 and all(_opt_int(x) is not None for x in v):
        return int(v[0]), int(v[1]), int(v[2])
    return 0, 0, 0


def _gpu(s: _Sorter, batch: ImportBatch, names: Names, base: int,
         launches: dict[int, int]) -> None:
    s.gpu.sort(key=lambda ke: ke[1]["ts"])
    events = batch.events
    for kind, ev in s.gpu:
        args = ev.get("args")
        if not isinstance(args, dict):
            args = {}
        corr = _opt_int(args.get("correlation")) or 0
        launch = launches.get(corr, -1) if corr else -1
        pid = events[launch][2] if launch >= 0 else 0
        dev = _opt_int(args.get("device"))
        stream = _opt_int(args.get("stream"))
        name = ev["name"]
        coll = nccl_collective(name) if kind == GPU_KINDS["kernel"] else None
        nbytes = _opt_int(args.get("bytes")) or 0
        batch.gpu.append((base + us_to_ns(ev["ts"]), max(0, us_to_ns(ev["dur"])), pid,
                          dev if dev is not None else _opt_int(ev.get("pid")) or 0,
                          stream if stream is not None else _opt_int(ev.get("tid")) or 0,
                          kind, names(name), corr, launch, nbytes,
                          names(coll) if coll else 0, *_dims(args.get("grid")),
                          *_dims(args.get("block"))))


def _ranges(s: _Sorter, batch: ImportBatch, names: Names, base: int) -> None:
    s.ranges.sort(key=lambda ke: ke[1]["ts"])
    for kind, ev in s.ranges:
        pid, tid = _opt_int(ev.get("pid")), _opt_int(ev.get("tid"))
        if pid is None or tid is None:
            s.bad += 1
            continue
        name = ev["name"]
        k = ANNOTATION_KINDS["step"] if _STEP.match(name) else kind
        batch.annotations.append((base + us_to_ns(ev["ts"]), max(0, us_to_ns(ev["dur"])),
                                  pid, tid, k, names(name)))


def _main_pid(batch: ImportBatch) -> int | None:
    pids = [r[2] for r in batch.gpu if r[2]]
    return max(set(pids), key=pids.count) if pids else None
