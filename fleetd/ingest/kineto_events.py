"""Kineto trace events into flat row tuples: each event checked field by field, sorted
by category into CUDA calls, GPU activity (kernels, copies, sets) and ranges (operators,
annotations, profiler steps), its times made nanoseconds and its names stored once.

The events come a piece at a time (:mod:`fleetd.ingest.kineto_text`); the rows go to
the scratch file (:class:`fleetd.ingest.kineto_stage.Stage`) every FLUSH_ROWS rows.
Files of other PyTorch versions: categories are matched case-insensitively, a pid or tid
written as a decimal string is that number, a GPU row's ``"tid": "stream 7"`` its stream
and ``args.inDevice`` (peer copies) its device. Events of other categories are counted
and skipped; malformed ones are skipped and counted, never guessed.
"""

from __future__ import annotations

import re
from typing import Any

from fleetd.errors import UsageError
from fleetd.ingest.kineto_stage import Stage
from fleetd.ingest.session import (
    MAX_NAME_CHARS,
    Names,
    Source,
    api_op,
    clean_text,
    nccl_collective,
    us_to_ns,
)
from fleetd.store.imports import ANNOTATION_KINDS, GPU_KINDS

_GPU = {"kernel": GPU_KINDS["kernel"], "gpu_memcpy": GPU_KINDS["memcpy"],
        "memcpy": GPU_KINDS["memcpy"], "gpu_memset": GPU_KINDS["memset"],
        "memset": GPU_KINDS["memset"]}
_API = frozenset({"cuda_runtime", "runtime", "cuda_driver", "driver"})
_RANGES = {"cpu_op": ANNOTATION_KINDS["cpu_op"], "operator": ANNOTATION_KINDS["cpu_op"],
           "user_annotation": ANNOTATION_KINDS["user_annotation"]}
# Categories the PyTorch profiler writes that fleetd skips: seeing one (or one of the
# above) tells a profiler trace from another tool's Chrome trace.
_PROFILER_CATS = frozenset({
    "gpu_user_annotation", "external_correlation", "cpu_instant_event", "python_function",
    "overhead", "glow_runtime", "cuda_profiler_range", "cuda_sync", "trace", "ac2g",
    "fwdbwd", "async", "privateuse1_runtime", "privateuse1_driver", "mtia_runtime",
    "mtia_ccp_events", "xpu_runtime", "hpu_op", "collective_comm", "cuda_event"})
# Top-level keys only the PyTorch profiler writes.
_PROFILER_KEYS = ("schemaVersion", "deviceProperties", "distributedInfo",
                  "baseTimeNanoseconds")
_STEP = re.compile(r"ProfilerStep#\d+$")
_KERNEL = GPU_KINDS["kernel"]
_STEP_KIND = ANNOTATION_KINDS["step"]
# What an event's category is to the converter: 0 skipped, 1 a CUDA call, 10 + its
# gpu_data kind for GPU activity, 20 + its annotation kind for a range.
_CAT_API, _CAT_GPU, _CAT_RANGE = 1, 10, 20

FLUSH_ROWS = 16384  # rows converted before they go to the scratch file
_RSS_EVERY = 32  # pieces between two looks at the resident set
_CACHE_MAX = 1 << 16  # entries of a conversion cache before it starts over
_CAT_KEY_MAX = 64  # a category longer than this is not cached (no profiler writes one)
_META_MAX = 1 << 16  # process and thread names kept
_STREAM = re.compile(r"(?:stream)?\s*(\d{1,19})")
_NO_DIMS = (0, 0, 0)  # a GPU row's grid or block size when it has none


def opt_int(v: Any) -> int | None:
    """An integer, also one written as a decimal string (as some profilers write ids)."""
    if type(v) is int:
        return v
    if type(v) is str and 0 < len(v) <= 20:
        v = v.strip()
        if v.isascii() and (v.isdigit() or (v[:1] == "-" and v[1:].isdigit())):
            return int(v)
    return None


def _stream_of(tid: Any) -> int | None:
    """A GPU row's stream from its tid: 7, "7" or "stream 7" (early Kineto)."""
    if type(tid) is int:
        return tid
    if type(tid) is str:
        m = _STREAM.fullmatch(tid.strip())
        if m:
            return int(m.group(1))
    return None


def _dim3(value: Any) -> tuple[int, int, int]:
    """A kernel's grid or block size: ``[x, y, z]`` of ints, else 0, 0, 0 (copies and sets
    have none). One check for both, so that the two cannot drift apart."""
    if type(value) is list and len(value) == 3:
        x, y, z = value
        if type(x) is int and type(y) is int and type(z) is int:
            return x, y, z
    return _NO_DIMS


def _category(cat: str) -> int:
    low = cat.lower()
    if low in _API:
        return _CAT_API
    if low in _GPU:
        return _CAT_GPU + _GPU[low]
    return _CAT_RANGE + _RANGES[low] if low in _RANGES else 0


class Converter:
    """The trace's events, checked field by field and turned into flat row tuples as
    they come (the JSON values are orjson's own types, so exact type tests are the
    checks: an int is ``type(v) is int``, which a bool is not), handed to the scratch
    file every FLUSH_ROWS rows. Times are kept as written (the sort key) and in ns
    without the file's base time, which may come after the events."""

    def __init__(self, names: Names, stage: Stage) -> None:
        self.names = names
        self.stage = stage
        # (ts as written, ts ns, dur ns, pid, tid, op, a0, correlation, name kept in args)
        self.api: list[tuple[Any, ...]] = []
        # (ts as written, ts ns, dur ns, device, stream, kind, name, correlation, bytes,
        #  collective, grid x y z, block x y z)
        self.gpu: list[tuple[Any, ...]] = []
        # (ts as written, ts ns, dur ns, pid, tid, kind, name)
        self.ranges: list[tuple[Any, ...]] = []
        self.proc_names: dict[int, str] = {}
        self.thread_names: dict[int, str] = {}
        self.skipped = 0
        self.bad = 0
        self.foreign = 0  # complete events of a category no PyTorch profiler writes
        self.profiler = False  # an event of a profiler category was seen
        self.foreign_cats: dict[str, None] = {}
        self.pieces = 0
        self._cats: dict[str, int] = {}
        self._ops: dict[str, tuple[int, str | None]] = {}
        self._durations: dict[float, int] = {}  # microseconds -> ns (at least 0)
        self._kernels: dict[str, tuple[int, int]] = {}  # name -> (name, collective)
        self._ranges: dict[int, dict[str, tuple[int, int]]] = {
            _CAT_RANGE + k: {} for k in set(_RANGES.values())}  # name -> (kind, name)

    def add(self, events: list[Any]) -> None:  # noqa: C901 - one loop, kept flat for speed
        self._bound()
        cats, names = self._cats, self.names
        api, gpu, ranges = self.api, self.gpu, self.ranges
        ops, kernels, range_names = self._ops, self._kernels, self._ranges
        durations = self._durations
        api_add, gpu_add, range_add = api.append, gpu.append, ranges.append
        skipped = bad = foreign = 0
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
                    what = self._new_category(cat)
                    if len(cat) <= _CAT_KEY_MAX:  # a cache of a few short words
                        cats[cat] = what
            else:
                what = -1
            ts: Any = ev.get("ts")
            dur: Any = ev.get("dur")
            name: Any = ev.get("name")
            tt, td = type(ts), type(dur)
            if not ((tt is int or tt is float) and (td is int or td is float)
                    and type(name) is str):
                if what > 0:
                    bad += 1
                else:
                    skipped += 1
                    if what:
                        foreign += 1
                continue
            if what <= 0:
                skipped += 1
                if what:
                    foreign += 1
                continue
            if len(name) > MAX_NAME_CHARS:
                # Stored cut there anyway (session.clean_text): cut first, so that the
                # caches below, keyed by name, hold at most that much per name (a file
                # of 1 MiB kernel names held every one of them whole: 1.35 GB).
                name = name[:MAX_NAME_CHARS]
            # us_to_ns, inline: whole microseconds times 1000 plus the rounded fraction
            if tt is int:
                ts_ns = ts * 1000
            else:
                whole = int(ts)
                ts_ns = whole * 1000 + round((ts - whole) * 1000)
            if td is int:
                dur_ns = dur * 1000 if dur > 0 else 0
            else:  # durations repeat: each distinct one is converted once
                dur_ns = durations.get(dur)
                if dur_ns is None:
                    dur_ns = durations[dur] = max(0, us_to_ns(dur))
            if what == _CAT_API or what >= _CAT_RANGE:  # a host thread's: its pid and tid
                pid, tid = ev.get("pid"), ev.get("tid")
                if type(pid) is not int or type(tid) is not int:
                    pid, tid = opt_int(pid), opt_int(tid)
                    if pid is None or tid is None:
                        bad += 1
                        continue
            if what >= _CAT_RANGE:
                seen = range_names[what]
                got = seen.get(name)
                if got is None:
                    got = seen[name] = (_STEP_KIND if _STEP.match(name) else what - _CAT_RANGE,
                                        names(name))
                range_add((ts, ts_ns, dur_ns, pid, tid, got[0], got[1]))
            elif what == _CAT_API:
                args = ev.get("args")
                corr = args.get("correlation") if type(args) is dict else None
                if type(corr) is not int:
                    corr = None
                op = ops.get(name)
                if op is None:
                    op = ops[name] = api_op(name)
                code, other = op
                api_add((ts, ts_ns, dur_ns, pid, tid, code,
                         (corr or 0) if other is not None else 0, corr, other))
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
                    dev = args.get("inDevice")  # a peer copy (early Kineto)
                    if type(dev) is not int:
                        dev = opt_int(ev.get("pid"))
                        if dev is None:
                            dev = 0
                if type(stream) is not int:
                    stream = _stream_of(ev.get("tid"))
                    if stream is None:
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
                gx, gy, gz = _dim3(args.get("grid"))
                bx, by, bz = _dim3(args.get("block"))
                gpu_add((ts, ts_ns, dur_ns, dev, stream, kind, name_h, corr, nbytes,
                         coll_h, gx, gy, gz, bx, by, bz))
        self.skipped += skipped
        self.bad += bad
        self.foreign += foreign
        if len(api) + len(gpu) + len(ranges) >= FLUSH_ROWS:
            self.flush()

    def _new_category(self, cat: str) -> int:
        """0 for a profiler category fleetd skips, -1 for another tool's (counted)."""
        what = _category(cat)
        if what or cat.lower() in _PROFILER_CATS:
            self.profiler = True
            return what
        if len(self.foreign_cats) < 5:
            self.foreign_cats[clean_text(cat[:40])] = None
        return -1

    def _bound(self) -> None:
        """Caches start over when a file makes them large; the resident set is checked."""
        caches: list[dict[Any, Any]] = [self._cats, self._ops, self._durations,
                                         self._kernels, *self._ranges.values()]
        for cache in caches:
            if len(cache) > _CACHE_MAX:
                cache.clear()
        self.pieces += 1
        if self.pieces % _RSS_EVERY == 0:
            self.stage.check_memory(len(self.names.by_hash))

    def flush(self) -> None:
        self.stage.add(self.api, self.gpu, self.ranges)
        self.api.clear()
        self.gpu.clear()
        self.ranges.clear()

    def _meta(self, ev: dict[str, object]) -> None:
        # A metadata event of the file, unchecked: each value is tested before use.
        args = ev.get("args")
        name = args.get("name") if isinstance(args, dict) else None
        if not isinstance(name, str):
            return
        if ev.get("name") == "process_name":
            pid = opt_int(ev.get("pid"))
            if pid is not None and (pid in self.proc_names or len(self.proc_names) < _META_MAX):
                self.proc_names[pid] = clean_text(name[:64])
        elif ev.get("name") == "thread_name":
            tid = opt_int(ev.get("tid"))
            if tid is not None and (tid in self.thread_names
                                    or len(self.thread_names) < _META_MAX):
                self.thread_names[tid] = clean_text(name[:64])

    def check_profiler(self, src: Source, doc: dict[str, object]) -> None:
        """Refuse another tool's Chrome trace: complete events, none of a category the
        PyTorch profiler writes, and none of the profiler's top-level keys."""
        if self.profiler or not self.foreign or any(k in doc for k in _PROFILER_KEYS):
            return
        cats = ", ".join(self.foreign_cats) or "none"
        raise UsageError(
            f"{src.path}: a Chrome trace, but not one the PyTorch profiler wrote: none of "
            f"its {self.foreign} complete events has a profiler category (categories: "
            f"{cats})", "import torch.profiler traces (prof.export_chrome_trace(path)) or "
            "nsys SQLite exports; a trace fleetd exported came from a database already")
