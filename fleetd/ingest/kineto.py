"""PyTorch profiler (Kineto) Chrome-trace JSON, one file per rank, into a node's store.

``ts``/``dur`` are microseconds, possibly fractional; with ``baseTimeNanoseconds`` at the
top level they are relative to it, otherwise they already count from the epoch. GPU
events carry ``args.device``/``args.stream`` and ``args.correlation``, the id of the
``cuda_runtime`` call that launched them, whose pid is the process the GPU work belongs
to (the GPU rows' own pid is the device). ``distributedInfo`` names the rank.

Categories are matched case-insensitively (older profilers wrote ``Kernel``,
``Runtime``...). Events of other categories (python functions, flows, overhead) are
counted and skipped; malformed events are skipped and reported, never guessed.

Speed (``bench/import.py``): the ``traceEvents`` array is parsed 64 KiB at a time
(:func:`_pieces`) and each piece is turned into compact row tuples before the next is
parsed, so the file's millions of event dicts never exist at once: parsing a 1M-event
trace whole made 2.7 GB of dicts, and the page faults of that memory cost more than the
parsing. A piece is cut only where the bytes ``}``, ``,``, ``{`` meet (JSON whitespace
between them), and is accepted only when it parses as a JSON array by itself; as the
first piece starts right after the array's ``[``, each accepted piece then ends on a
real boundary between two events (a cut inside a string or a nested object leaves the
piece unparseable), so the pieces hold exactly the events a whole parse gives. When that
does not hold up (a cut that never parses, a document laid out otherwise) the whole
document is parsed at once instead, and its errors are the ones reported.
"""

from __future__ import annotations

import re
import secrets
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from itertools import compress, repeat
from operator import add, is_not, itemgetter
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
from fleetd.store.imports import ANNOTATION_KINDS, GPU_KIND, GPU_KINDS, GPU_PID, ImportBatch
from fleetd.store.schema import EventRow

_GPU = {"kernel": GPU_KINDS["kernel"], "gpu_memcpy": GPU_KINDS["memcpy"],
        "memcpy": GPU_KINDS["memcpy"], "gpu_memset": GPU_KINDS["memset"],
        "memset": GPU_KINDS["memset"]}
_API = frozenset({"cuda_runtime", "runtime", "cuda_driver", "driver"})
_RANGES = {"cpu_op": ANNOTATION_KINDS["cpu_op"], "operator": ANNOTATION_KINDS["cpu_op"],
           "user_annotation": ANNOTATION_KINDS["user_annotation"]}
_STEP = re.compile(r"ProfilerStep#\d+$")
_EPOCH_US = 1e14  # timestamps below this (1973) are relative, not epoch microseconds
_KERNEL = GPU_KINDS["kernel"]
_STEP_KIND = ANNOTATION_KINDS["step"]
# What an event's category is to the converter: 0 skipped, 1 a CUDA call, 10 + its
# gpu_data kind for GPU activity, 20 + its annotation kind for a range.
_CAT_API, _CAT_GPU, _CAT_RANGE = 1, 10, 20

# Bytes of traceEvents parsed at a time: a piece's objects then stay in the CPU caches
# while they are converted (64 KiB took a fifth less time than 2 MiB, 8 MiB a fifth more).
CHUNK_BYTES = 64 << 10
_WS = rb"[ \t\n\r]*"  # JSON's whitespace (regex \s has more: orjson refuses those)
_CUT = re.compile(rb"\}" + _WS + rb"," + _WS + rb"\{")  # where two events may meet
_EVENTS = re.compile(rb'"traceEvents"\s*:\s*\[')
_SPACE = re.compile(_WS)
_TRIES = 20  # cuts tried for a piece, each twice as far (a cut may fall inside an event)
_LAST_EVENTS = 1 << 20  # bytes before a ']' where the last events are looked for


class _SplitFailed(Exception):
    """The pieces did not hold up: the whole document is parsed instead."""


def read(src: Source, names: Names, node: str | None) -> Parsed:
    t0 = time.perf_counter()
    text = read_json_bytes(src.path)
    clock = _Clock(time.perf_counter() - t0)
    split = _split_document(text, clock)
    if split is not None:
        doc, start, end = split
        try:
            return _read(src, names, node, doc, _pieces(text, start, end, clock), clock)
        except _SplitFailed:
            names.reset()
    doc = clock.parse(_load, src, text)
    del text
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        raise UsageError(f"{src.path}: JSON without a traceEvents list, so not a PyTorch "
                         "profiler trace", "save profiles with prof.export_chrome_trace(path)")
    return _read(src, names, node, doc, iter([events]), clock)


class _Clock:
    """Seconds spent parsing JSON (the rest of a read is converting)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def parse(self, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0


def _read(src: Source, names: Names, node: str | None, doc: dict[str, Any],
          pieces: Iterable[list[Any]], clock: _Clock) -> Parsed:
    dist = doc.get("distributedInfo")
    rank = _opt_int(dist.get("rank")) if isinstance(dist, dict) else None
    world = _opt_int(dist.get("world_size")) if isinstance(dist, dict) else None
    base = _opt_int(doc.get("baseTimeNanoseconds")) or 0
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", src.path.name.split(".")[0])[:64] or "kineto"
    default = f"rank-{rank}" if rank is not None else stem
    name = check_node(node or default)
    conv = _Converter(names, base)
    for events in pieces:
        conv.add(events)
        del events  # the piece's dicts go before the next piece is parsed
    # made now, as it waits for the file's hash (computed meanwhile on another thread)
    batch = new_batch(src, name, None, base, 1000, {"rank": rank, "world_size": world})
    batch.rank, batch.world_size = rank, world
    parsed = Parsed(batch)
    _convert(conv, batch, parsed)
    if base == 0 and batch.events and batch.events[0][0] < _EPOCH_US * 1000:
        parsed.warnings.append(f"{src.path}: timestamps are relative and the file has no "
                               "baseTimeNanoseconds: placed at the epoch, so they line up "
                               "with no other recording")
    finish(batch, names)
    parsed.timings["parse"] = clock.seconds
    return parsed


def _load(src: Source, text: bytes) -> dict[str, Any]:
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


# ---- parsing a large document in pieces ----------------------------------------------


def _split_document(text: bytes, clock: _Clock) -> tuple[dict[str, Any], int, int] | None:
    """The document without its events, and where the bytes of its ``traceEvents`` array
    start and end (its brackets excluded); None when it is not laid out as expected.

    The document is parsed with the array replaced by a string no file can hold (a
    random nonce): when that string comes out as the top-level ``traceEvents``, the bytes
    before it end exactly where the top-level array begins in the real document, and
    everything around the array is what the whole parse would give."""
    lead = _SPACE.match(text)
    first = lead.end() if lead else 0
    if text[first:first + 1] == b"[":  # the bare-array form
        last = len(text) - 1
        while last > first and text[last] in b" \t\r\n":
            last -= 1
        return ({}, first + 1, last) if last > first and text[last] == 0x5D else None
    found = _EVENTS.search(text)
    if found is None:
        return None
    start = found.end()
    marker = f"fleetd-events-{secrets.token_hex(16)}"
    head = text[:start - 1] + orjson.dumps(marker)
    end = len(text)
    for _ in range(_TRIES):  # the array's ']': one of the last ones of the file
        end = text.rfind(b"]", start, end)
        if end < 0 or not _closes_events(text, start, end, clock):
            continue
        try:
            doc = clock.parse(orjson.loads, head + text[end + 1:])
        except orjson.JSONDecodeError:
            continue
        if isinstance(doc, dict) and doc.get("traceEvents") == marker:
            return doc, start, end
        return None
    return None


def _closes_events(text: bytes, start: int, end: int, clock: _Clock) -> bool:
    """Whether the ']' at ``end`` looks like the one that closes the events: the array
    is empty, or the bytes before it, from one of the last cuts on, parse as events
    (their last one a dict with a "ph"). This only picks which ']' to try (a later key
    may hold arrays too); the pieces check every byte of the array again."""
    prev = end - 1
    while prev >= start and text[prev] in b" \t\r\n":
        prev -= 1
    if prev < start:
        return True
    if text[prev] != 0x7D:  # '}'
        return False
    low = max(start, end - _LAST_EVENTS)
    firsts = [m.end() - 1 for m in _CUT.finditer(text, low, end)][-_TRIES:][::-1]
    view = memoryview(text)
    for first in firsts + ([start] if low == start else []):
        try:
            items = clock.parse(orjson.loads, b"".join((b"[", view[first:end], b"]")))
        except orjson.JSONDecodeError:
            continue
        return bool(items) and isinstance(items[-1], dict) and "ph" in items[-1]
    return False


def _pieces(text: bytes, start: int, end: int, clock: _Clock) -> Iterator[list[Any]]:
    """The events of ``text[start:end]`` (the inside of the traceEvents array), parsed
    about CHUNK_BYTES at a time; _SplitFailed when a piece never parses by itself."""
    view = memoryview(text)
    pos = start
    while pos < end:
        span = CHUNK_BYTES
        for _ in range(_TRIES):
            cut = pos + span
            found = _CUT.search(text, cut, end) if cut < end else None
            stop, nxt = (found.start() + 1, found.end() - 1) if found else (end, end)
            try:
                items = clock.parse(orjson.loads, b"".join((b"[", view[pos:stop], b"]")))
                break
            except orjson.JSONDecodeError:
                if found is None:
                    raise _SplitFailed from None
                span *= 2  # the cut fell inside an event (or the text is not JSON)
        else:
            raise _SplitFailed
        yield items
        del items  # freed before the next piece is parsed, which reuses its memory
        pos = nxt


# ---- events into rows ------------------------------------------------------------------


def _opt_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _category(cat: str) -> int:
    low = cat.lower()
    if low in _API:
        return _CAT_API
    if low in _GPU:
        return _CAT_GPU + _GPU[low]
    return _CAT_RANGE + _RANGES[low] if low in _RANGES else 0


class _Converter:
    """The trace's events, checked field by field and turned into row tuples as they come
    (the JSON values are orjson's own types, so exact type tests are the checks: an int
    is ``type(v) is int``, which a bool is not). Rows are put in time order and linked
    at the end, by :func:`_convert`."""

    def __init__(self, names: Names, base: int) -> None:
        self.names = names
        self.base = base
        # (ts as written, row, correlation, name kept in args): sorted by ts, then indexed
        self.api: list[tuple[Any, EventRow, int | None, str | None]] = []
        # (ts as written, correlation, GpuRow without its pid and launch)
        self.gpu: list[tuple[Any, int, tuple[int, ...]]] = []
        self.ranges: list[tuple[Any, tuple[int, int, int, int, int, int]]] = []
        self.proc_names: dict[int, str] = {}
        self.thread_names: dict[int, str] = {}
        self.skipped = 0
        self.bad = 0
        self._cats: dict[str, int] = {}
        self._ops: dict[str, tuple[int, str | None]] = {}
        self._durations: dict[float, int] = {}  # microseconds -> ns (at least 0)
        self._kernels: dict[str, tuple[int, int]] = {}  # name -> (name, collective)
        self._ranges: dict[int, dict[str, tuple[int, int]]] = {
            _CAT_RANGE + k: {} for k in set(_RANGES.values())}  # name -> (kind, name)

    def add(self, events: list[Any]) -> None:  # noqa: C901 - one loop, kept flat for speed
        base, cats, names = self.base, self._cats, self.names
        api, gpu, ranges = self.api, self.gpu, self.ranges
        ops, kernels, range_names = self._ops, self._kernels, self._ranges
        durations = self._durations
        api_add, gpu_add, range_add = api.append, gpu.append, ranges.append
        skipped = bad = 0
        for ev in events:
            if type(ev) is not dict:
                bad += 1
                continue
            ph = ev.get("ph")
            if ph != "X":
                if ph == "M":
                    self._meta(ev)
                else:
                    skipped += 1
                continue
            cat = ev.get("cat")
            if type(cat) is str:
                what = cats.get(cat)
                if what is None:
                    what = cats[cat] = _category(cat)
            else:
                what = 0
            ts: Any = ev.get("ts")
            dur: Any = ev.get("dur")
            name: Any = ev.get("name")
            tt, td = type(ts), type(dur)
            if not ((tt is int or tt is float) and (td is int or td is float)
                    and type(name) is str):
                if what:
                    bad += 1
                else:
                    skipped += 1
                continue
            if not what:
                skipped += 1
                continue
            # us_to_ns, inline: whole microseconds times 1000 plus the rounded fraction
            if tt is int:
                ts_ns = base + ts * 1000
            else:
                whole = int(ts)
                ts_ns = base + whole * 1000 + round((ts - whole) * 1000)
            if td is int:
                dur_ns = dur * 1000 if dur > 0 else 0
            else:  # durations repeat: each distinct one is converted once
                dur_ns = durations.get(dur)
                if dur_ns is None:
                    dur_ns = durations[dur] = max(0, us_to_ns(dur))
            if what >= _CAT_RANGE:
                pid, tid = ev.get("pid"), ev.get("tid")
                if type(pid) is not int or type(tid) is not int:
                    bad += 1
                    continue
                seen = range_names[what]
                got = seen.get(name)
                if got is None:
                    got = seen[name] = (_STEP_KIND if _STEP.match(name) else what - _CAT_RANGE,
                                        names(name))
                range_add((ts, (ts_ns, dur_ns, pid, tid, got[0], got[1])))
            elif what == _CAT_API:
                pid, tid = ev.get("pid"), ev.get("tid")
                if type(pid) is not int or type(tid) is not int:
                    bad += 1
                    continue
                args = ev.get("args")
                corr = args.get("correlation") if type(args) is dict else None
                if type(corr) is not int:
                    corr = None
                op = ops.get(name)
                if op is None:
                    op = ops[name] = api_op(name)
                code, other = op
                api_add((ts, (ts_ns, dur_ns, pid, tid, code, 0, 0, 0,
                              (corr or 0) if other is not None else 0, 0, 0), corr, other))
            else:
                kind = what - _CAT_GPU
                args = ev.get("args")
                if type(args) is not dict:
                    args = {}
                corr = args.get("correlation")
                if type(corr) is not int:
                    corr = 0
                dev, stream = args.get("device"), args.get("stream")
                if type(dev) is not int:
                    dev = ev.get("pid")
                    if type(dev) is not int:
                        dev = 0
                if type(stream) is not int:
                    stream = ev.get("tid")
                    if type(stream) is not int:
                        stream = 0
                nbytes = args.get("bytes")
                if type(nbytes) is not int:
                    nbytes = 0
                if kind == _KERNEL:
                    got = kernels.get(name)
                    if got is None:
                        coll = nccl_collective(name)
                        got = kernels[name] = (names(name), names(coll) if coll else 0)
                    name_h, coll_h = got
                else:
                    name_h, coll_h = names(name), 0
                dims = args.get("grid")  # [x, y, z] of ints, else 0, 0, 0 (as _dims)
                if type(dims) is list and len(dims) == 3:
                    gx, gy, gz = dims
                    if not (type(gx) is int and type(gy) is int and type(gz) is int):
                        gx = gy = gz = 0
                else:
                    gx = gy = gz = 0
                dims = args.get("block")
                if type(dims) is list and len(dims) == 3:
                    bx, by, bz = dims
                    if not (type(bx) is int and type(by) is int and type(bz) is int):
                        bx = by = bz = 0
                else:
                    bx = by = bz = 0
                gpu_add((ts, corr, (ts_ns, dur_ns, dev, stream, kind, name_h, corr, nbytes,
                                    coll_h, gx, gy, gz, bx, by, bz)))
        self.skipped += skipped
        self.bad += bad

    def _meta(self, ev: dict[str, Any]) -> None:
        args = ev.get("args")
        name = args.get("name") if isinstance(args, dict) else None
        if not isinstance(name, str):
            return
        if ev.get("name") == "process_name" and _opt_int(ev.get("pid")) is not None:
            self.proc_names[ev["pid"]] = name[:64]
        elif ev.get("name") == "thread_name" and _opt_int(ev.get("tid")) is not None:
            self.thread_names[ev["tid"]] = name[:64]


_BY_TS = itemgetter(0)
_SECOND = itemgetter(1)


def _convert(conv: _Converter, batch: ImportBatch, parsed: Parsed) -> None:
    """Rows in time order (a stable sort on the timestamps as written), launches linked to
    their kernels by correlation id, processes and threads named. Column at a time, with
    C-level iterators: no Python code runs per row here."""
    api = conv.api
    api.sort(key=_BY_TS)
    events = batch.events = list(map(_SECOND, api))
    # correlation -> index of the last call that has it (0 and None are no correlation)
    launches = dict(zip(map(itemgetter(2), api), range(len(api)), strict=True))
    launches.pop(None, None)
    launches.pop(0, None)
    batch.event_args = [(i, {"name": api[i][3], "correlation": api[i][2]}) for i in compress(
        range(len(api)), map(is_not, map(itemgetter(3), api), repeat(None)))]
    api.clear()
    gpu = conv.gpu
    gpu.sort(key=_BY_TS)
    # each row + (pid, launch): the launching call's pid (0 for none, at index -1)
    at = list(map(launches.get, map(_SECOND, gpu), repeat(-1)))
    pid_at = [*map(itemgetter(2), events), 0]
    batch.gpu = list(map(add, map(itemgetter(2), gpu), zip(map(pid_at.__getitem__, at), at,
                                                            strict=True)))
    gpu.clear()
    conv.ranges.sort(key=_BY_TS)
    batch.annotations = list(map(_SECOND, conv.ranges))
    conv.ranges.clear()

    pid_of, gpu_pid = itemgetter(2), itemgetter(GPU_PID)
    pids = set(map(pid_of, events)) | set(map(gpu_pid, batch.gpu)) | set(
        map(pid_of, batch.annotations))
    batch.processes = [{"pid": p, "comm": conv.proc_names.get(p), "rank": batch.rank,
                        "world_size": batch.world_size} for p in sorted(pids)]
    tid_pid = itemgetter(3, 2)
    tids = set(map(tid_pid, events)) | set(map(tid_pid, batch.annotations))
    batch.tasks = [(t, p, conv.thread_names.get(t)) for t, p in sorted(tids)]
    kinds = Counter(map(itemgetter(GPU_KIND), batch.gpu))
    parsed.counts.update(runtime=len(events), kernels=kinds[GPU_KINDS["kernel"]],
                         memcpy=kinds[GPU_KINDS["memcpy"]],
                         memset=kinds[GPU_KINDS["memset"]],
                         annotations=len(batch.annotations), skipped=conv.skipped)
    if conv.bad:
        parsed.warnings.append(f"{conv.bad} malformed event(s) (missing or non-numeric "
                               "ts/dur, no name) skipped")
    if not batch.gpu:
        parsed.warnings.append("no GPU events (kernels, copies, sets) in this trace: GPU "
                               "metrics are unavailable for it; the host side was imported")
    elif not any(map(gpu_pid, batch.gpu)):
        parsed.warnings.append("GPU events without a launching CUDA call: their process is "
                               "unknown (pid 0)")
