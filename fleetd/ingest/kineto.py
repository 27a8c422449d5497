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

Bounded memory, whatever the file's size and compression. The text is read a MiB at a
time (:func:`fleetd.ingest.session.json_chunks`: one size limit for plain and gzipped
files, and a gzip stream that expands like a compression bomb is refused as soon as it
does). The ``traceEvents`` array is parsed about CHUNK_BYTES at a time (:func:`_pieces`);
each piece's events are checked and turned into flat row tuples, which go to a private
scratch SQLite file (:class:`_Stage`, in SQLite's temp directory: ``$SQLITE_TMPDIR`` or
``$TMPDIR``) every FLUSH_ROWS rows. When the file is read, SQLite puts the rows in time
order and links each kernel to its launch call by correlation (its sorter spills to disk
too), and the writer reads them back row by row (:class:`_Rows`) into the database. What
stays in memory: one piece, the names (one copy of each distinct one), the process and
thread names, SQLite's caches. The peak is checked against MAX_RSS_BYTES every few
pieces: a file that would need more (millions of distinct names) is refused in one line.
Peak RSS of ``fleetd import`` of a 334 MB trace (1M events): 740 MB when the file was
parsed in memory, 120 MB streamed; of a 1 GB trace (3M events): 125 MB (bench/import.py
prints ``peak_mb_per_gb``). The price is the rows' round trip through the scratch file:
about a quarter more CPU (1M events: 5.3 -> 6.6 s; 1 GB: 14.7 -> 18.7 s, its wall time
the same, 26.7 -> 25.1 s, as the old peak of 2.2 GB cost page faults).

Pieces: a piece is cut only where the bytes ``}``, ``,``, ``{`` meet (JSON whitespace
between them), and is accepted only when it parses as a JSON array by itself; as the
first piece starts right after the array's ``[``, each accepted piece then ends on a
real boundary between two events (a cut inside a string or a nested object leaves the
piece unparseable: a valid document's prefix never fails to parse before its end), so
the pieces hold exactly the events a whole parse gives. The array's ``[`` is the one of
the top-level ``traceEvents`` key (the text before it, closed with a nonce string, must
parse as an object whose ``traceEvents`` is that nonce), and at the end of the file the
array's ``]`` is the one after which the rest of the document parses the same way. A run
of more than LONG_SPACE bytes of whitespace, which only a broken or hostile file holds,
is read as one newline, so a file of whitespace is read in bounded memory too. A piece
(or, every PROBE_AT bytes without a cut, the text held) that fails to parse before its
end is not JSON whatever follows: refused at once, so junk costs a MiB, not MAX_PIECE.
When the layout does not hold up (two ``traceEvents`` keys, a cut that never parses) a document
of up to WHOLE_MAX bytes is parsed whole instead, and its errors are the ones reported;
a larger one is refused with what did not hold.
"""

from __future__ import annotations

import json
import os
import re
import resource
import secrets
import sqlite3
import time
from collections.abc import Iterator
from itertools import chain, islice
from operator import itemgetter
from typing import Any, cast

import orjson

from fleetd.errors import UsageError
from fleetd.ingest.session import (
    MAX_EVENTS,
    Names,
    Parsed,
    Source,
    api_op,
    check_node,
    clean_text,
    json_chunks,
    nccl_collective,
    new_batch,
    us_to_ns,
)
from fleetd.store.imports import ANNOTATION_KINDS, GPU_KINDS, AnnotationRow, GpuRow
from fleetd.store.schema import EventRow

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
_EPOCH_US = 1e14  # timestamps below this (1973) are relative, not epoch microseconds
_KERNEL = GPU_KINDS["kernel"]
_STEP_KIND = ANNOTATION_KINDS["step"]
# What an event's category is to the converter: 0 skipped, 1 a CUDA call, 10 + its
# gpu_data kind for GPU activity, 20 + its annotation kind for a range.
_CAT_API, _CAT_GPU, _CAT_RANGE = 1, 10, 20

# Bytes of traceEvents parsed at a time: a piece's objects then stay in the CPU caches
# while they are converted (64 KiB took a fifth less time than 2 MiB, 8 MiB a fifth more).
CHUNK_BYTES = 64 << 10
MAX_PIECE = 32 << 20  # the most text held for one piece (one event, or a cut not found)
MAX_HEAD = 32 << 20  # the most text before the traceEvents array
WHOLE_MAX = 16 << 20  # an odd layout is parsed whole up to this size, else refused
LONG_SPACE = 4096  # a run of more whitespace is read as one newline
SQUEEZE_AT = 4 << 20  # held text from which long whitespace runs are squeezed out
PROBE_AT = 1 << 20  # held text without a cut that is checked for being JSON so far
FLUSH_ROWS = 16384  # rows converted before they go to the scratch file
MAX_RSS_BYTES = 2 << 30  # the memory ceiling of an import (resident set)
_RSS_EVERY = 32  # pieces between two looks at the resident set
_CACHE_MAX = 1 << 16  # entries of a conversion cache before it starts over
_META_MAX = 1 << 16  # process and thread names kept
_STAGE_CACHE_KIB = 32 << 10  # the scratch file's page cache (its sorter's memory too)

_WS = rb"[ \t\n\r]*"  # JSON's whitespace (regex \s has more: orjson refuses those)
_CUT = re.compile(rb"\}" + _WS + rb"," + _WS + rb"\{")  # where two events may meet
_PARTIAL_CUT = re.compile(_WS + rb"(?:," + _WS + rb")?")  # after the last '}' held
_EVENTS = re.compile(rb'"traceEvents"[ \t\n\r]*:[ \t\n\r]*\[')
_EVENTS_KEY = b'"traceEvents"'
_SPACE = re.compile(_WS)
_LONG = re.compile(rb"(?<![ \t\n\r])[ \t\n\r]{%d,}" % LONG_SPACE)
_HIGH = rb"\\u[dD][89abAB][0-9a-fA-F]{2}"
_LOW = rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}"
_LONE = re.compile(_HIGH + rb"(?!" + _LOW + rb")|(?<!" + _HIGH + rb")" + _LOW)
_TRIES = 20  # ']' tried, from the end, as the one that closes the events
_STREAM = re.compile(r"(?:stream)?\s*(\d{1,19})")
_HINT_SAVE = "save profiles with prof.export_chrome_trace(path)"
_HINT_CUT = "is the file complete? a trace cut short cannot be read"


class _SplitFailed(Exception):
    """The layout did not hold up: the whole document is parsed instead (if small)."""


def read(src: Source, names: Names, node: str | None) -> Parsed:
    clock = _Clock(0.0)
    stage = _Stage(src)
    try:
        conv = _Converter(names, stage)
        try:
            text = _streamed(src, conv, clock)
        except _SplitFailed as failed:
            names.reset()
            stage.close()
            stage = _Stage(src)
            conv = _Converter(names, stage)
            text = _whole(src, conv, clock, failed)
        return _read(src, names, node, text, conv, stage, clock)
    except BaseException:
        stage.close()
        raise


class _Clock:
    """Seconds spent reading and parsing JSON (the rest of a read is converting)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def parse(self, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0


def _read(src: Source, names: Names, node: str | None, text: _Text, conv: _Converter,
          stage: _Stage, clock: _Clock) -> Parsed:
    conv.flush()
    doc = text.doc
    conv.check_profiler(src, doc)
    dist = doc.get("distributedInfo")
    rank = _opt_int(dist.get("rank")) if isinstance(dist, dict) else None
    world = _opt_int(dist.get("world_size")) if isinstance(dist, dict) else None
    base = _opt_int(doc.get("baseTimeNanoseconds")) or 0
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", src.path.name.split(".")[0])[:64] or "kineto"
    default = f"rank-{rank}" if rank is not None else stem
    name = check_node(node or default)
    facts = stage.finish(src, base)
    # made now, as it waits for the file's hash (computed meanwhile on another thread)
    batch = new_batch(src, name, None, base, 1000, {"rank": rank, "world_size": world})
    batch.rank, batch.world_size = rank, world
    batch.started_ns, batch.ended_ns = facts.started, facts.ended
    # Rows read from the scratch file as the writer goes, not lists: the writer takes
    # their length, first and last row and one pass (store.imports._bulk), and that is
    # all these offer (the batch's fields are lists for the readers that build them).
    batch.events = cast("list[EventRow]", _Rows(
        stage, "SELECT * FROM api_s", "?1 + ts_rel, dur, pid, tid, op, 0, 0, 0, corrf, 0, 0",
        "idx", base, facts.events))
    batch.event_args = cast("list[tuple[int, dict[str, Any]]]", _EventArgs(stage))
    batch.gpu = cast("list[GpuRow]", _Rows(
        stage, _GPU_ROWS, "?1 + ts_rel, dur, dev, stream, kind, name, corr, bytes, coll, gx, gy, "
        "gz, bx, by, bz, pid, launch", "ts, rowid", base, facts.gpu, facts.ends["gpu"]))
    batch.annotations = cast("list[AnnotationRow]", _Rows(
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


def _warn(src: Source, parsed: Parsed, text: _Text, conv: _Converter, facts: _Facts,
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


def _load(src: Source, text: bytes) -> dict[str, Any]:
    """The whole document parsed at once (the fallback for odd layouts)."""
    try:
        doc = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        try:
            doc = _lenient(text)[0]
        except _NotJson:
            raise UsageError(f"{src.path}: not valid JSON ({str(exc)[:120]})",
                             _HINT_CUT) from exc
    if isinstance(doc, list):  # the bare-array form of the Chrome trace format
        return {"traceEvents": doc}
    if not isinstance(doc, dict):
        raise UsageError(f"{src.path}: JSON, but not a trace (a {type(doc).__name__})",
                         _HINT_SAVE)
    return doc


def _whole(src: Source, conv: _Converter, clock: _Clock, failed: _SplitFailed) -> _Text:
    """The document read and parsed at once, when it is at most WHOLE_MAX bytes."""
    t0 = time.perf_counter()
    parts: list[bytes] = []
    size = 0
    for chunk in json_chunks(src.path):
        size += len(chunk)
        if size > WHOLE_MAX:
            raise UsageError(f"{src.path}: {failed}", _HINT_CUT if "JSON" in str(failed)
                             else _HINT_SAVE)
        parts.append(chunk)
    data = b"".join(parts)
    del parts
    clock.seconds += time.perf_counter() - t0
    text = _Text(src, clock)
    fixed, text.replaced = _utf8(data)
    del data
    doc = clock.parse(_load, src, fixed)
    if b"\\u" in fixed and _LONE.search(fixed):  # were they read as lone surrogates?
        try:
            orjson.loads(fixed)
        except orjson.JSONDecodeError:
            text.surrogates = len(_LONE.findall(fixed))
    del fixed
    events = doc.pop("traceEvents", None)
    if not isinstance(events, list):
        raise UsageError(f"{src.path}: JSON without a traceEvents list, so not a PyTorch "
                         "profiler trace", _HINT_SAVE)
    text.doc = doc
    for i in range(0, len(events), 1024):
        conv.add(events[i:i + 1024])
    return text


# ---- reading the document a piece at a time --------------------------------------------


class _Text:
    """The document's text from the first byte not yet consumed, read as it is needed,
    and what was learned on the way."""

    def __init__(self, src: Source, clock: _Clock) -> None:
        self.src = src
        self.clock = clock
        self._chunks = json_chunks(src.path)
        self.buf = b""
        self.dropped = 0  # bytes before buf (after squeezing: an estimate, for messages)
        self.eof = False
        self.bare = False  # the bare-array form
        self.head = b""  # the document up to its events array's '[' (excluded)
        self.marker = orjson.dumps(f"fleetd-events-{secrets.token_hex(16)}")
        self.doc: dict[str, Any] = {}  # the document without its events
        self.replaced = 0  # invalid UTF-8 sequences read as U+FFFD
        self.surrogates = 0  # escaped lone surrogates read as '?'
        self.unclosed = False  # a bare array without its ']'
        self.error = ""  # why the last text that did not parse did not
        self.early = False  # ... and whether before its last character
        self._squeeze_at = SQUEEZE_AT

    def more(self, keep: int) -> bool | None:
        """Drop the text before ``keep`` and read on. True when the text kept was
        squeezed (its positions moved), False when not, None at the end of the file."""
        t0 = time.perf_counter()
        try:
            chunk = next(self._chunks, None)
        finally:
            self.clock.seconds += time.perf_counter() - t0
        rest = self.buf[keep:]
        self.dropped += keep
        squeezed = False
        if len(rest) >= self._squeeze_at:
            small = _LONG.sub(b"\n", rest)
            squeezed = len(small) != len(rest)
            self.dropped += len(rest) - len(small)
            rest = small
            self._squeeze_at = max(SQUEEZE_AT, 2 * len(rest))
        elif len(rest) < SQUEEZE_AT:
            self._squeeze_at = SQUEEZE_AT
        if chunk is None:
            self.buf, self.eof = rest, True
            return None
        self.buf = rest + chunk
        return squeezed

    def parse(self, data: bytes | memoryview, count: bool = True) -> Any:
        """``data`` parsed (bytes that are not UTF-8 as U+FFFD, counted unless not
        ``count``: text parsed again later); None when it is not JSON, and then
        ``self.error`` says why and ``self.early`` whether the error lies before the
        text's last character."""
        t0 = time.perf_counter()
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            try:
                value, replaced, lone = _lenient(data)
            except _NotJson as exc:
                self.error, self.early = str(exc)[:120], exc.early
                return None
            if count:
                self.replaced += replaced
                self.surrogates += lone
            return value
        finally:
            self.clock.seconds += time.perf_counter() - t0

    def events(self, start: int, stop: int, data: bytes | None = None) -> list[Any] | None:
        """The events between ``start`` and ``stop`` (of ``data``, else of the text held),
        or None when they do not parse as a JSON array's items by themselves."""
        view = memoryview(self.buf if data is None else data)
        return self.parse(b"".join((b"[", view[start:stop], b"]")))  # type: ignore[no-any-return]

    def doc_with(self, tail: bytes, count: bool = False) -> dict[str, Any] | None:
        """The document without its events when they end right before ``tail``."""
        doc = self.parse(b"".join((self.head, self.marker, tail)), count)
        if isinstance(doc, dict) and doc.get("traceEvents") == self.marker[1:-1].decode():
            del doc["traceEvents"]
            return doc
        return None

    def where(self, pos: int) -> int:
        return self.dropped + pos


class _NotJson(Exception):
    """Text that does not parse; ``early`` when the error lies before its last
    character. A piece ends with a '}' (a cut) and a ']': a prefix of valid JSON cut there
    fails only at that end (inside a string, or where the ']' stands for a ',' or '}'),
    so an earlier error is one no longer piece can mend."""

    def __init__(self, message: str, early: bool) -> None:
        super().__init__(message)
        self.early = early


def _lenient(data: bytes | memoryview) -> tuple[Any, int, int]:
    """``data`` parsed with bytes that are not UTF-8 as U+FFFD and escaped lone
    surrogates allowed: (value, sequences replaced, lone surrogates); _NotJson when it is
    not JSON for other reasons (the common case here: a piece cut inside an event)."""
    fixed, replaced = _utf8(bytes(data))
    try:
        return orjson.loads(fixed), replaced, 0
    except orjson.JSONDecodeError as exc:
        if "surrogate" not in str(exc):
            chars = len(fixed) if fixed.isascii() else len(fixed.decode())
            raise _NotJson(str(exc), exc.pos < chars - 1) from None
    try:  # Python's json reads lone surrogates (as str, made '?' by clean_text)
        value = json.loads(fixed, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, RecursionError) as exc:  # its positions mark where a token began
        raise _NotJson(str(exc), False) from None
    return value, replaced, len(_LONE.findall(fixed))


def _utf8(data: bytes) -> tuple[bytes, int]:
    """``data`` as valid UTF-8, and how many invalid sequences became U+FFFD."""
    try:
        data.decode()
        return data, 0
    except UnicodeDecodeError:
        text = data.decode(errors="replace")
        return text.encode(), text.count("\ufffd") - data.count("\ufffd".encode())


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError("number too large")
    return value


def _streamed(src: Source, conv: _Converter, clock: _Clock) -> _Text:
    text = _Text(src, clock)
    start = _split_document(text, clock)
    if start is None:
        raise _SplitFailed(f"no top-level traceEvents list in its first {MAX_HEAD >> 20} MiB, "
                           "so not a PyTorch profiler trace")
    for events in _pieces(text, start, clock):
        conv.add(events)
        del events  # the piece's dicts go before the next piece is parsed
    return text


def _split_document(text: _Text, clock: _Clock) -> int | None:
    """Where the items of the top-level ``traceEvents`` array start in ``text.buf``
    (text.head then holds the document before the array); None when that is not found
    within MAX_HEAD bytes and _TRIES keys, or the document is neither an object nor an
    array.

    A ``"traceEvents": [`` is the top-level one when the text before its ``[``, closed
    with a nonce string and a ``}``, parses as an object whose traceEvents is the nonce:
    one inside a string or a nested object leaves that text unparseable."""
    pos = 0
    while True:  # whitespace before the document, dropped as it comes
        pos = _SPACE.match(text.buf, pos).end()  # type: ignore[union-attr]
        if pos < len(text.buf):
            break
        if text.more(pos) is None:
            return None
        pos = 0
    first = text.buf[pos]
    if first == 0x5B:  # '[': the bare-array form
        text.bare = True
        return pos + 1
    if first != 0x7B:  # '{'
        return None
    look = pos
    tries = 0
    while True:
        buf = text.buf
        tried = set()
        for found in _EVENTS.finditer(buf, look):
            tries += 1
            if tries > _TRIES:  # each try parses the text before it: a few, not millions
                return None
            tried.add(found.start())
            head = buf[pos:found.end() - 1]
            doc = text.parse(b"".join((head, text.marker, b"}")), count=False)
            if isinstance(doc, dict) and doc.get("traceEvents") == text.marker[1:-1].decode():
                text.head = head
                return found.end()
        if len(buf) - pos > MAX_HEAD:
            return None
        # a key the end of the text held cuts in two is looked for again
        key = buf.rfind(_EVENTS_KEY, look)
        look = key if key >= 0 and key not in tried else max(look, len(buf) - len(_EVENTS_KEY))
        moved = text.more(pos)
        if moved is None:
            return None
        look, pos = (0 if moved else look - pos), 0


def _pieces(text: _Text, start: int, clock: _Clock) -> Iterator[list[Any]]:
    """The events of the traceEvents array whose items start at ``start``, parsed about
    CHUNK_BYTES at a time as the text is read; the last ones with what follows the array
    (text.doc). _SplitFailed when the layout does not hold up."""
    pos = start
    while True:  # whitespace before the first event, dropped as it comes
        pos = _SPACE.match(text.buf, pos).end()  # type: ignore[union-attr]
        if pos < len(text.buf):
            break
        if text.more(pos) is None:
            break
        pos = 0
    span = CHUNK_BYTES
    look = pos
    probe = PROBE_AT
    while True:
        buf = text.buf
        found = _CUT.search(buf, max(look, pos + span))
        if found is None:
            if text.eof:
                yield from _last(text, pos)
                return
            if len(buf) - pos > 2 * MAX_PIECE:  # (long whitespace runs squeezed out)
                raise _SplitFailed(
                    f"more than {2 * MAX_PIECE >> 20} MiB of traceEvents without a boundary "
                    f"between two events after byte {text.where(pos)} (an event that "
                    "large, or items that are not JSON objects)")
            if len(buf) - pos >= probe:  # text without a cut: is it JSON so far?
                probe = 2 * (len(buf) - pos)
                _probe(text, pos)
            look = _resume(buf, max(look, pos + span))
            moved = text.more(pos)
            look, pos = (0 if moved else look - pos), 0
            continue
        stop = found.start() + 1
        items = text.events(pos, stop)
        if items is None:  # cut inside an event (or not JSON): a cut twice as far
            if text.early or stop - pos > MAX_PIECE:
                raise _SplitFailed(_not_json(text, pos))
            span = 2 * (stop - pos)
            look = found.start() + 1
            continue
        yield items
        del items  # freed before the next piece is parsed, which reuses its memory
        pos, span, look, probe = found.end() - 1, CHUNK_BYTES, found.end() - 1, PROBE_AT


def _resume(buf: bytes, lo: int) -> int:
    """Where to look for a cut again once more text is read: at the last '}' held when
    only whitespace and a ',' follow it (a cut the end of the text held cuts in two)."""
    last = buf.rfind(b"}", lo)
    if last >= 0 and _PARTIAL_CUT.fullmatch(buf, last + 1):
        return last
    return max(lo, len(buf))


def _last(text: _Text, pos: int) -> Iterator[list[Any]]:
    """The events after the last cut, at the end of the file, and the document's rest."""
    pending = text.buf[pos:]
    if text.bare:
        body = pending.rstrip(b" \t\r\n")
        if body.endswith(b"]"):
            body = body[:-1]
        else:  # early Kineto did not close the array (the Chrome format allows it)
            body = body.rstrip(b" \t\r\n")
            body = body[:-1] if body.endswith(b",") else body
            text.unclosed = True
        items = text.events(0, len(body), body)
        if items is None:
            raise _SplitFailed(_not_json(text, pos))
        yield items
        return
    end = len(pending)
    for _ in range(_TRIES):  # the array's ']': one of the last ones of the file
        end = pending.rfind(b"]", 0, end)
        if end < 0:
            break
        if text.doc_with(pending[end + 1:]) is None:
            continue
        items = text.events(0, end, pending)
        if items is None:
            continue
        text.doc = text.doc_with(pending[end + 1:], count=True) or {}
        yield items
        return
    raise _SplitFailed("not valid JSON (the end of traceEvents, or what follows "
                       f"it, does not parse; the text ends at byte {text.where(len(text.buf))})")


def _probe(text: _Text, pos: int) -> None:
    """_SplitFailed when the text held from ``pos``, up to its last '}' or ',' (where a
    valid prefix fails only at its end, as for a piece), fails to parse early: junk, or
    items that are no JSON, are refused after PROBE_AT bytes, not MAX_PIECE."""
    buf = text.buf
    end = max(buf.rfind(b"}", pos), buf.rfind(b",", pos))
    if end < 0:
        first = buf[pos:pos + 1]
        if first and first not in b'{["-0123456789tfn':
            text.error, text.early = f"unexpected character {first!r}", True
            raise _SplitFailed(_not_json(text, pos))
        return
    if text.events(pos, end + 1) is None and text.early:
        raise _SplitFailed(_not_json(text, pos))


def _not_json(text: _Text, pos: int) -> str:
    return f"not valid JSON in traceEvents after byte {text.where(pos)} ({text.error})"


# ---- events into rows ------------------------------------------------------------------


def _opt_int(v: Any) -> int | None:
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


def _category(cat: str) -> int:
    low = cat.lower()
    if low in _API:
        return _CAT_API
    if low in _GPU:
        return _CAT_GPU + _GPU[low]
    return _CAT_RANGE + _RANGES[low] if low in _RANGES else 0


class _Converter:
    """The trace's events, checked field by field and turned into flat row tuples as
    they come (the JSON values are orjson's own types, so exact type tests are the
    checks: an int is ``type(v) is int``, which a bool is not), handed to the scratch
    file every FLUSH_ROWS rows. Times are kept as written (the sort key) and in ns
    without the file's base time, which may come after the events."""

    def __init__(self, names: Names, stage: _Stage) -> None:
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
                    what = cats[cat] = self._new_category(cat)
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
            if what >= _CAT_RANGE:
                pid, tid = ev.get("pid"), ev.get("tid")
                if type(pid) is not int or type(tid) is not int:
                    pid, tid = _opt_int(pid), _opt_int(tid)
                    if pid is None or tid is None:
                        bad += 1
                        continue
                seen = range_names[what]
                got = seen.get(name)
                if got is None:
                    got = seen[name] = (_STEP_KIND if _STEP.match(name) else what - _CAT_RANGE,
                                        names(name))
                range_add((ts, ts_ns, dur_ns, pid, tid, got[0], got[1]))
            elif what == _CAT_API:
                pid, tid = ev.get("pid"), ev.get("tid")
                if type(pid) is not int or type(tid) is not int:
                    pid, tid = _opt_int(pid), _opt_int(tid)
                    if pid is None or tid is None:
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
                        dev = _opt_int(ev.get("pid"))
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

    def _meta(self, ev: dict[str, Any]) -> None:
        args = ev.get("args")
        name = args.get("name") if isinstance(args, dict) else None
        if not isinstance(name, str):
            return
        if ev.get("name") == "process_name":
            pid = _opt_int(ev.get("pid"))
            if pid is not None and (pid in self.proc_names or len(self.proc_names) < _META_MAX):
                self.proc_names[pid] = clean_text(name[:64])
        elif ev.get("name") == "thread_name":
            tid = _opt_int(ev.get("tid"))
            if tid is not None and (tid in self.thread_names
                                    or len(self.thread_names) < _META_MAX):
                self.thread_names[tid] = clean_text(name[:64])

    def check_profiler(self, src: Source, doc: dict[str, Any]) -> None:
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


# ---- the scratch file: rows in time order, kernels linked to their launches -------------


_STAGE_TABLES = {
    "api": "ts, ts_rel, dur, pid, tid, op, corrf, corr, other",
    "gpu": "ts, ts_rel, dur, dev, stream, kind, name, corr, bytes, coll, gx, gy, gz, bx, "
           "by, bz",
    "rng": "ts, ts_rel, dur, pid, tid, kind, name",
}
_ROWS_PER_INSERT = 64
_PID, _TID = itemgetter(3), itemgetter(4)  # in the api and range rows
# The GPU rows with the pid and the index of their launch call (0 and -1: none).
_GPU_ROWS = ("SELECT g.rowid AS rowid, g.ts AS ts, g.ts_rel AS ts_rel, g.dur AS dur, g.dev AS dev, "
             "g.stream AS stream, g.kind AS kind, g.name AS name, g.corr AS corr, "
             "g.bytes AS bytes, g.coll AS coll, g.gx AS gx, g.gy AS gy, g.gz AS gz, g.bx AS bx, "
             "g.by AS by, g.bz AS bz, coalesce(l.pid, 0) AS pid, coalesce(l.idx - 1, -1) AS "
             "launch FROM gpu g LEFT JOIN link l ON l.corr = g.corr")


class _Facts:
    """What the sorted rows say, for the batch and the report."""

    def __init__(self) -> None:
        self.events = self.gpu = self.annotations = 0
        self.started = self.ended = 0
        self.first_ts: int | None = None
        self.pids: list[int] = []
        self.tasks: list[tuple[int, int]] = []
        self.kinds: dict[int, int] = {}
        self.gpu_pid = False  # a GPU row has a launching call with a pid
        self.ends: dict[str, tuple[int, int]] = {}  # table -> rowids of its first, last row


class _Stage:
    """The rows of one file in a private SQLite file (deleted when closed), in tables
    without type affinity (times keep the type they were written with: their order is
    the order of the numbers, as in Python, int or float)."""

    def __init__(self, src: Source) -> None:
        self.src = src
        self.rows = 0
        self.pids: set[int] = set()  # of the CUDA calls and ranges (GPU rows: their launch's)
        self.tasks: set[tuple[int, int]] = set()  # (tid, pid)
        self.db = sqlite3.connect("", isolation_level=None)
        for pragma in ("journal_mode=OFF", "synchronous=OFF", "temp_store=FILE",
                       f"cache_size=-{_STAGE_CACHE_KIB}"):
            self.db.execute(f"PRAGMA {pragma}")
        self.db.execute("BEGIN")
        self._sql: dict[str, tuple[str, str, int]] = {}
        for table, cols in _STAGE_TABLES.items():
            self.db.execute(f"CREATE TABLE {table} ({cols})")
            width = cols.count(",") + 1
            one = "(" + ", ".join("?" * width) + ")"
            self._sql[table] = (f"INSERT INTO {table} VALUES {one}",
                                f"INSERT INTO {table} VALUES " + ", ".join(
                                    [one] * _ROWS_PER_INSERT), width)

    def close(self) -> None:
        self.db.close()

    def add(self, api: list[tuple[Any, ...]], gpu: list[tuple[Any, ...]],
            ranges: list[tuple[Any, ...]]) -> None:
        self.rows += len(api) + len(gpu) + len(ranges)
        if self.rows > MAX_EVENTS:
            raise UsageError(f"{self.src.path}: more than {MAX_EVENTS} events, above the "
                             "limit", "import a shorter profiling window")
        try:
            for table, rows in (("api", api), ("gpu", gpu), ("rng", ranges)):
                if rows:
                    self._insert(table, rows)
        except OverflowError as exc:  # sqlite3: "Python int too large to convert to SQLite"
            raise _beyond(self.src) from exc
        # the processes and threads, in C-level passes (pid, tid at 3, 4)
        for rows in (api, ranges):
            if rows:
                self.pids.update(map(_PID, rows))
                self.tasks.update(zip(map(_TID, rows), map(_PID, rows), strict=True))

    def _insert(self, table: str, rows: list[tuple[Any, ...]]) -> None:
        one, many, width = self._sql[table]
        whole = len(rows) // _ROWS_PER_INSERT * _ROWS_PER_INSERT
        if whole:
            values = chain.from_iterable(islice(rows, whole))
            size = width * _ROWS_PER_INSERT
            self.db.executemany(many, iter(lambda: tuple(islice(values, size)), ()))
        if whole < len(rows):
            self.db.executemany(one, islice(rows, whole, None))

    def check_memory(self, names: int) -> None:
        rss = _rss()
        if rss > MAX_RSS_BYTES:
            raise UsageError(f"{self.src.path}: reading it would take more than "
                             f"{MAX_RSS_BYTES >> 20} MiB of memory ({rss >> 20} MiB so far, "
                             f"{names} distinct names)", "import a shorter profiling window")

    def finish(self, src: Source, base: int) -> _Facts:
        """The rows in time order (a stable sort on the times as written), kernels linked
        to the last launch call of their correlation id; the session's span."""
        db = self.db
        db.execute("CREATE TABLE api_s (idx INTEGER PRIMARY KEY, ts_rel, dur, pid, tid, op, "
                   "corrf, corr, other)")
        db.execute("INSERT INTO api_s (ts_rel, dur, pid, tid, op, corrf, corr, other) SELECT "
                   "ts_rel, dur, pid, tid, op, corrf, corr, other FROM api ORDER BY ts, rowid")
        db.execute("CREATE TABLE link (corr INTEGER PRIMARY KEY, idx, pid)")
        # in call order, so that the last call of a correlation id is the one kept (ids
        # mostly grow with time: the rows go to the end of the table, no sort)
        db.execute("INSERT OR REPLACE INTO link SELECT corr, idx, pid FROM api_s "
                   "WHERE corr IS NOT NULL AND corr != 0 ORDER BY idx")
        facts = _Facts()
        kinds = (GPU_KINDS["kernel"], GPU_KINDS["memcpy"], GPU_KINDS["memset"])
        spans = {t: db.execute(f"SELECT count(*), min(ts_rel), max(ts_rel + dur){more} FROM {t}"
                               ).fetchone() for t, more in (
            ("api_s", ""), ("rng", ""),
            ("gpu", "".join(f", total(kind = {k})" for k in kinds)))}
        facts.events, facts.annotations, facts.gpu = (spans[t][0] for t in ("api_s", "rng", "gpu"))
        facts.kinds = {k: int(n) for k, n in zip(kinds, spans["gpu"][3:], strict=True)}
        lo = [first for n, first, *_ in spans.values() if n]
        hi = [last for n, _, last, *_ in spans.values() if n]
        if any(type(last) is not int for last in hi):  # the sum left 64-bit integers
            raise _beyond(src)
        if lo:
            facts.started, facts.ended = base + min(lo), base + max(hi)
            if facts.started < -(1 << 63) or facts.ended >= 1 << 63:
                raise _beyond(src)
        if facts.events:
            facts.first_ts = base + db.execute(
                "SELECT ts_rel FROM api_s WHERE idx = 1").fetchone()[0]
        # a GPU row's pid is its launch call's (one of self.pids), or 0 without one
        linked, nonzero = db.execute(
            "SELECT count(*), total(l.pid != 0) FROM gpu g JOIN link l ON l.corr = g.corr"
            ).fetchone()
        facts.gpu_pid = nonzero > 0
        facts.pids = sorted(self.pids | ({0} if linked < facts.gpu else set()))
        facts.tasks = sorted(self.tasks)
        for table in ("gpu", "rng"):  # the rowids of their first and last rows in time order
            facts.ends[table] = tuple(db.execute(
                f"SELECT (SELECT rowid FROM {table} ORDER BY ts, rowid LIMIT 1), "
                f"(SELECT rowid FROM {table} ORDER BY ts DESC, rowid DESC LIMIT 1)").fetchone())
        db.execute("PRAGMA shrink_memory")  # the cache is read again only by the writer
        return facts


def _beyond(src: Source) -> UsageError:
    return UsageError(f"{src.path}: holds a value (a time, an id or a size) beyond the "
                      "64-bit integers fleetd stores, so the file is damaged or not a trace; "
                      "nothing was imported", "profile again, or export the report again")


def _rss() -> int:
    """The resident set of this process, in bytes (its peak where /proc is missing)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _Rows:
    """One table of the scratch file as the writer's rows, in time order: its length,
    its first and last row, and one pass over all of them, read as they are written
    (SQLite sorts them then, spilling to its temp files beyond its cache)."""

    def __init__(self, stage: _Stage, source: str, cols: str, order: str, base: int,
                 count: int, ends: tuple[int, int] | None = None) -> None:
        self._db = stage.db
        self._stage = stage  # kept open while the rows are
        self._sql = f"SELECT {cols} FROM ({source})"
        self._order = order
        self._base = base
        self._count = count
        self._ends = ends  # rowids of the first and the last row (else idx order)

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return iter(self._db.execute(f"{self._sql} ORDER BY {self._order}", (self._base,)))

    def __getitem__(self, i: int) -> tuple[int, ...]:
        """The first and the last row (what the writer asks for), read without a sort."""
        if i < 0:
            i += self._count
        if i not in (0, self._count - 1):
            raise IndexError(i)
        key = ("idx", i + 1) if self._ends is None else ("rowid", self._ends[i > 0])
        return tuple(self._db.execute(f"{self._sql} WHERE {key[0]} = ?2",
                                      (self._base, key[1])).fetchone())


class _EventArgs:
    """(index of the event, its args) for the CUDA calls whose name is kept in args."""

    def __init__(self, stage: _Stage) -> None:
        self._stage = stage

    def __iter__(self) -> Iterator[tuple[int, dict[str, Any]]]:
        for i, other, corr in self._stage.db.execute(
                "SELECT idx - 1, other, corr FROM api_s WHERE other IS NOT NULL ORDER BY idx"):
            yield i, {"name": other, "correlation": corr}
