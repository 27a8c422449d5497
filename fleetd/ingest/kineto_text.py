"""The text of a Kineto (PyTorch profiler) Chrome-trace JSON file, read and checked: the
``traceEvents`` array parsed about CHUNK_BYTES at a time and handed on piece by piece,
and the rest of the document (``distributedInfo``, ``baseTimeNanoseconds``, ...) kept.

The text is read a MiB at a time (:func:`fleetd.ingest.session.json_chunks`: one size
limit for plain and gzipped files, and a gzip stream that expands like a compression
bomb is refused as soon as it does), so what is held is one piece, whatever the file's
size. Bytes that are not UTF-8 are read as U+FFFD, and an escaped lone surrogate
(``"\\ud800"``, as Python's json writes bytes it could not decode) as a name with '?',
both counted for a warning; the bare-array form may lack its closing ``]``. Refused: a
file that is no JSON, and JSON without a ``traceEvents`` list.

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
is read as one space, so a file of whitespace is read in bounded memory too. A piece
(or, every PROBE_AT bytes without a cut, the text held) that fails to parse before its
end is not JSON whatever follows: refused at once, so junk costs a MiB, not MAX_PIECE.
When the layout does not hold up (two ``traceEvents`` keys, a cut that never parses) a document
of up to WHOLE_MAX bytes is parsed whole instead, and its errors are the ones reported;
a larger one is refused with what did not hold.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import orjson

from fleetd.errors import UsageError
from fleetd.ingest.session import Source, json_chunks

# Where the events go, a piece at a time (the converter's ``add``).
AddEvents = Callable[[list[Any]], None]

# Bytes of traceEvents parsed at a time: a piece's objects then stay in the CPU caches
# while they are converted (64 KiB took a fifth less time than 2 MiB, 8 MiB a fifth more).
CHUNK_BYTES = 64 << 10
MAX_PIECE = 32 << 20  # the most text held for one piece (one event, or a cut not found)
MAX_HEAD = 32 << 20  # the most text before the traceEvents array
WHOLE_MAX = 16 << 20  # an odd layout is parsed whole up to this size, else refused
LONG_SPACE = 4096  # a run of more whitespace is read as one space
SQUEEZE_AT = 4 << 20  # held text from which long whitespace runs are squeezed out
PROBE_AT = 1 << 20  # held text without a cut that is checked for being JSON so far

_WS = rb"[ \t\n\r]*"  # JSON's whitespace (regex \s has more: orjson refuses those)
_CUT = re.compile(rb"\}" + _WS + rb"," + _WS + rb"\{")  # where two events may meet
# A string (to its closing quote, or to the end of the text held) or a cut.
_TOKEN = re.compile(rb'(?P<str>"[^"\\]*(?:\\[\s\S][^"\\]*)*(?:(?P<close>")|\\?\Z))|(?P<cut>'
                    + _CUT.pattern + rb")")
_PARTIAL_CUT = re.compile(_WS + rb"(?:," + _WS + rb")?")  # after the last '}' held
_EVENTS = re.compile(rb'"traceEvents"[ \t\n\r]*:[ \t\n\r]*\[')
_EVENTS_KEY = b'"traceEvents"'
_SPACE = re.compile(_WS)
_LONG = re.compile(rb"(?<![ \t\n\r])[ \t\n\r]{%d,}" % LONG_SPACE)
_HIGH = rb"\\u[dD][89abAB][0-9a-fA-F]{2}"
_LOW = rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}"
_LONE = re.compile(_HIGH + rb"(?!" + _LOW + rb")|(?<!" + _HIGH + rb")" + _LOW)
_TRIES = 20  # ']' tried, from the end, as the one that closes the events
_HINT_SAVE = "save profiles with prof.export_chrome_trace(path)"
_HINT_CUT = "is the file complete? a trace cut short cannot be read"


class SplitFailed(Exception):
    """The layout did not hold up: the whole document is parsed instead (if small)."""



class Clock:
    """Seconds spent reading and parsing JSON (the rest of a read is converting)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def parse(self, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.seconds += time.perf_counter() - t0



def _load(src: Source, text: bytes) -> dict[str, object]:
    """The whole document parsed at once (the fallback for odd layouts). Its values are
    the file's, unchecked: each reader checks the few it takes (kineto._read)."""
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


def whole(src: Source, add: AddEvents, clock: Clock, failed: SplitFailed) -> Text:
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
    text = Text(src, clock)
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
        add(events[i:i + 1024])
    return text


# ---- the document a piece at a time -----------------------------------------------------


class Text:
    """The document's text from the first byte not yet consumed, read as it is needed,
    and what was learned on the way."""

    def __init__(self, src: Source, clock: Clock) -> None:
        self.src = src
        self.clock = clock
        self._chunks = json_chunks(src.path)
        self.buf = b""
        self.dropped = 0  # bytes before buf (after squeezing: an estimate, for messages)
        self.eof = False
        self.bare = False  # the bare-array form
        self.head = b""  # the document up to its events array's '[' (excluded)
        self.marker = orjson.dumps(f"fleetd-events-{secrets.token_hex(16)}")
        # The document without its events: the file's JSON, checked key by key where read
        self.doc: dict[str, object] = {}
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
            # One space: a run this long is valid JSON only between tokens or inside a
            # string (where only spaces may stand raw), and one space keeps both valid.
            small = _LONG.sub(b" ", rest)
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

    def doc_with(self, tail: bytes, count: bool = False) -> dict[str, object] | None:
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


def streamed(src: Source, add: AddEvents, clock: Clock) -> Text:
    text = Text(src, clock)
    start = _split_document(text, clock)
    if start is None:
        raise SplitFailed(f"no top-level traceEvents list in its first {MAX_HEAD >> 20} MiB, "
                           "so not a PyTorch profiler trace")
    for events in _pieces(text, start, clock):
        add(events)
        del events  # the piece's dicts go before the next piece is parsed
    return text


def _split_document(text: Text, clock: Clock) -> int | None:
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


def _pieces(text: Text, start: int, clock: Clock) -> Iterator[list[Any]]:
    """The events of the traceEvents array whose items start at ``start``, parsed about
    CHUNK_BYTES at a time as the text is read; the last ones with what follows the array
    (text.doc). SplitFailed when the layout does not hold up."""
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
    careful = False  # the last cut of this piece lay inside an event: skip strings
    while True:
        buf = text.buf
        found = (_cut_outside_strings(buf, pos, pos + span) if careful
                 else _CUT.search(buf, max(look, pos + span)))
        if found is None:
            if text.eof:
                yield from _last(text, pos)
                return
            if len(buf) - pos > 2 * MAX_PIECE:  # (long whitespace runs squeezed out)
                raise SplitFailed(
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
                raise SplitFailed(_not_json(text, pos))
            span = 2 * (stop - pos)
            look = found.start() + 1
            careful = True
            continue
        yield items
        del items  # freed before the next piece is parsed, which reuses its memory
        pos, span, look, probe = found.end() - 1, CHUNK_BYTES, found.end() - 1, PROBE_AT
        careful = False


def _cut_outside_strings(buf: bytes, pos: int, lo: int) -> re.Match[bytes] | None:
    """The first cut at or after ``lo`` that is not inside a string, reading the text
    from ``pos`` (the start of an event, so outside any string); None when the text
    held ends first. Only after a piece failed to parse: names may hold ``}, {`` (a C++
    lambda's, or a hostile file's, a million times over), and each such cut, parsed,
    fails; doubling the piece for each of them reached MAX_PIECE and refused a valid
    file. Strings are skipped by one regular expression each, so a long name costs one
    match, not one per cut it holds."""
    for m in _TOKEN.finditer(buf, pos):
        if m.lastgroup == "cut":
            if m.start() >= lo:
                return m
        elif m.group("close") is None:
            return None  # a string the text held does not close yet
    return None


def _resume(buf: bytes, lo: int) -> int:
    """Where to look for a cut again once more text is read: at the last '}' held when
    only whitespace and a ',' follow it (a cut the end of the text held cuts in two)."""
    last = buf.rfind(b"}", lo)
    if last >= 0 and _PARTIAL_CUT.fullmatch(buf, last + 1):
        return last
    return max(lo, len(buf))


def _last(text: Text, pos: int) -> Iterator[list[Any]]:
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
            raise SplitFailed(_not_json(text, pos))
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
    raise SplitFailed("not valid JSON (the end of traceEvents, or what follows "
                       f"it, does not parse; the text ends at byte {text.where(len(text.buf))})")


def _probe(text: Text, pos: int) -> None:
    """SplitFailed when the text held from ``pos``, up to its last '}' or ',' (where a
    valid prefix fails only at its end, as for a piece), fails to parse early: junk, or
    items that are no JSON, are refused after PROBE_AT bytes, not MAX_PIECE."""
    buf = text.buf
    end = max(buf.rfind(b"}", pos), buf.rfind(b",", pos))
    if end < 0:
        first = buf[pos:pos + 1]
        if first and first not in b'{["-0123456789tfn':
            text.error, text.early = f"unexpected character {first!r}", True
            raise SplitFailed(_not_json(text, pos))
        return
    if text.events(pos, end + 1) is None and text.early:
        raise SplitFailed(_not_json(text, pos))


def _not_json(text: Text, pos: int) -> str:
    return f"not valid JSON in traceEvents after byte {text.where(pos)} ({text.error})"


