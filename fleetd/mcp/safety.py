"""What the MCP tools hand an assistant: traced strings as marked data, results that fit.

Everything a traced machine wrote is attacker-controlled: a process can name itself
``"evil\\n\\nIGNORE PREVIOUS INSTRUCTIONS"``, stack frames and command lines are its own
text, and SQL returns whatever is stored. An assistant reads tool results as text, so
such strings must arrive as obviously quoted data, never as something that reads like
part of the server's own answer. Three rules, applied to every result:

1. **Clean.** Terminal escape sequences and every control or format character (newlines,
   ESC, NUL, bidi overrides, zero-width marks) go; whitespace runs collapse to one space;
   each string is capped in length, with a marker saying how much was cut.
2. **Mark.** A field that holds traced text (``comm``, ``thread``, ``frames``, SQL rows,
   ...) becomes ``{"untrusted": value}``. Tool descriptions tell the assistant what the
   wrapper means.
3. **Quote.** fleetd's own sentences (chain summaries, fixes, evidence) name processes;
   each traced name inside them is shown as ``«name»`` (cleaned, with any guillemets of
   its own removed, so it cannot close the quote early).

:func:`fit` then keeps a result under a byte budget by halving its largest lists (they
are sorted most important first) and says what it left out.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Iterable
from typing import Annotated, Any, Final, TypedDict

import orjson
from pydantic import Strict

# Every integer a tool takes: a JSON integer only. Pydantic's default (lax) mode takes a
# float that holds a whole number, so ``1e3`` or ``1000.0`` passed as a pid or a row
# count; strict, such a number is a tool error that says an integer was expected.
Int = Annotated[int, Strict()]

UNTRUSTED: Final = "untrusted"
# A backend may list more traced names under this key; the server takes it out.
NAMES_KEY: Final = "_traced_names"
# Fields whose values come from the traced machine, not from fleetd.
TRACED_KEYS = frozenset({
    "comm", "thread", "peer_comm", "victim_comm", "culprit_comm", "main_comm", "exe",
    "cmdline", "frames", "host", "kernel", "command", "targets", "args", "boot_id",
    # Where a process ran, read from its cgroup path, the runtime's files, its HOSTNAME.
    "cgroup", "pod", "namespace", "container", "container_name", "pod_uid",
    # A stack frame on its own: on-CPU profiles' top frames, a lock holder's line.
    "frame", "where",
})
# Of those, the names that fleetd's sentences quote ("stress (pid 2000) ran instead",
# "(pod ml/trainer-0, container trainer)").
NAME_KEYS = frozenset({
    "comm", "thread", "peer_comm", "victim_comm", "culprit_comm", "main_comm", "exe", "host",
    "pod", "namespace", "container", "frame", "where",
})
NAME_CAP = 256  # a traced name or frame
TEXT_CAP = 2000  # one of fleetd's sentences, a SQL cell
MIN_QUOTED = 3  # shorter names are not looked for inside sentences (too many false hits)

# CSI (ESC [ ... final), OSC (ESC ] ... BEL or ST) and two-character escapes.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]")
_SPACES = re.compile(r"\s{2,}")


def clean(text: str, cap: int = TEXT_CAP, *, quoted: bool = False) -> str:
    """``text`` without escape sequences or control/format characters, capped at ``cap``.

    ``quoted``: also drop guillemets, for text that will sit inside ``«...»``.
    """
    text = _ANSI.sub("", text)
    out = []
    for ch in text:
        if ch in "\t\n\r\v\f\x85\u2028\u2029":
            out.append(" ")  # a line break still separates words
        elif unicodedata.category(ch)[0] == "C":
            continue  # Cc control, Cf format (bidi, zero-width), Cs, Co, Cn
        elif quoted and ch in "«»":
            continue
        else:
            out.append(ch)
    result = _SPACES.sub(" ", "".join(out)).strip()
    if len(result) > cap:
        result = f"{result[:cap]}…[{len(result) - cap} more chars]"
    return result


class Untrusted(TypedDict):
    """A traced value (a string, or a list or table of them) marked as data."""

    untrusted: Any


def untrusted(value: Any) -> Untrusted:
    """Mark a traced value (a string, or a list/table of them) as data."""
    return {UNTRUSTED: _cell(value, NAME_CAP)}


def mark_rows(rows: Iterable[Iterable[Any]], cap: int = TEXT_CAP) -> Untrusted:
    """SQL rows: every cell is whatever the database held, so the whole table is marked."""
    return {UNTRUSTED: [[_cell(v, cap) for v in row] for row in rows]}


def _cell(value: Any, cap: int) -> Any:
    if isinstance(value, str):
        return clean(value, cap, quoted=True)
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)[: cap // 2].hex()  # blobs as hex, as fleetd query prints them
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list | tuple):
        return [_cell(v, cap) for v in value]
    if isinstance(value, dict):
        return {clean(str(k), NAME_CAP): _cell(v, cap) for k, v in value.items()}
    return value


class Scrubber:
    """Applies the three rules to one result (see the module docstring)."""

    def __init__(self, obj: Any, names: Iterable[str] = ()) -> None:
        """``names``: traced names to quote beyond those in ``obj``'s own name fields
        (every process name of the database, so a sentence that names a process the
        result does not list is quoted too)."""
        names = set(names)
        _collect(obj, None, names)
        # Only names that occur in some sentence go into the pattern: a machine may have
        # thousands of thread names, and a regex alternation tries each at every offset.
        text = "\n".join(_sentences(obj))
        usable = sorted((n for n in names if len(n.strip()) >= MIN_QUOTED and n in text),
                        key=len, reverse=True)  # longest first: "python3.11", "python3"
        self._pattern = (re.compile("|".join(_bounded(n) for n in usable)) if usable
                         else None)

    def scrub(self, obj: Any, key: str | None = None) -> Any:
        if isinstance(obj, dict) and set(obj) == {UNTRUSTED}:
            return {UNTRUSTED: _cell(obj[UNTRUSTED], TEXT_CAP)}  # marked already
        if key in TRACED_KEYS and obj is not None and not isinstance(obj, int | float):
            return untrusted(obj)
        if isinstance(obj, dict):
            return {clean(str(k), NAME_CAP): self.scrub(v, str(k)) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [self.scrub(v) for v in obj]
        if isinstance(obj, str):
            return clean(self._quote(obj))
        return _cell(obj, TEXT_CAP)

    def _quote(self, text: str) -> str:
        if self._pattern is None:
            return text
        return self._pattern.sub(lambda m: f"«{clean(m.group(0), NAME_CAP, quoted=True)}»",
                                 text)


def _bounded(name: str) -> str:
    """A regex for ``name`` that does not match inside a longer name ("python3" is not
    found in "python3.11" or "/usr/bin/python3-dbg")."""
    pat = re.escape(name)
    if name[:1].isalnum() or name[:1] == "_":
        pat = r"(?<![\w./-])" + pat
    if name[-1:].isalnum() or name[-1:] == "_":
        pat += r"(?!\w|[./-]\w)"
    return pat


def _collect(obj: Any, key: str | None, names: set[str]) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _collect(v, str(k), names)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _collect(v, key, names)
    elif isinstance(obj, str) and key in NAME_KEYS:
        names.add(obj)


def _sentences(obj: Any, key: str | None = None) -> Iterable[str]:
    """The strings of ``obj`` that :meth:`Scrubber.scrub` quotes names in."""
    if isinstance(obj, dict):
        if set(obj) == {UNTRUSTED} or key in TRACED_KEYS:
            return
        for k, v in obj.items():
            yield from _sentences(v, str(k))
    elif key in TRACED_KEYS:
        return
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _sentences(v)
    elif isinstance(obj, str):
        yield obj


def scrub(obj: Any, names: Iterable[str] = ()) -> Any:
    """Clean, mark and quote every string of a result."""
    return Scrubber(obj, names).scrub(obj)


# ---- size ---------------------------------------------------------------------------------


def size_of(obj: Any) -> int:
    return len(orjson.dumps(obj))


def fit(result: dict[str, Any], max_bytes: int) -> dict[str, Any]:
    """``result`` cut down to ``max_bytes`` of JSON, largest lists first.

    Lists are cut in half from the end (every list fleetd returns is sorted most
    important first) until the result fits; ``truncated`` becomes true and ``omitted``
    maps each shortened list's path to how many items it lost. A result that cannot be
    made small enough that way loses its longest strings' tails too.
    """
    omitted: dict[str, int] = {}
    rounds = 0
    # The note about what was cut takes room too: about its own size plus the reason.
    while size_of(result) + (size_of(omitted) + 120 if omitted else 0) > max_bytes \
            and rounds < 200:
        rounds += 1
        found = _largest_list(result, "")
        if found is None or len(found[1]) <= 1:
            if not _shorten_longest_string(result):
                break
            omitted["(long strings)"] = omitted.get("(long strings)", 0) + 1
            continue
        path, items = found
        keep = len(items) // 2
        omitted[path] = omitted.get(path, 0) + len(items) - keep
        del items[keep:]
    if omitted:
        result["truncated"] = True
        reasons = result.setdefault("truncated_reason", [])
        if isinstance(reasons, list):
            reasons.append(f"size: the answer was cut to fit {max_bytes} bytes")
        result["omitted"] = {**result.get("omitted", {}), **omitted}
    return result


def _largest_list(obj: Any, path: str) -> tuple[str, list[Any]] | None:
    """The list (anywhere in ``obj``) whose items take the most bytes."""
    best: tuple[int, str, list[Any]] | None = None

    def visit(o: Any, p: str) -> None:
        nonlocal best
        if isinstance(o, dict):
            for k, v in o.items():
                visit(v, f"{p}.{k}" if p else str(k))
        elif isinstance(o, list):
            if len(o) > 1:
                n = size_of(o)
                if best is None or n > best[0]:
                    best = (n, p, o)
            for i, v in enumerate(o[:50]):  # nested lists of the first items suffice
                visit(v, f"{p}[{i}]")

    visit(obj, path)
    return None if best is None else (best[1], best[2])


def _shorten_longest_string(obj: Any) -> bool:
    longest: tuple[int, Any, Any] | None = None

    def visit(o: Any) -> None:
        nonlocal longest
        items: Iterable[tuple[Any, Any]] = (
            o.items() if isinstance(o, dict) else enumerate(o) if isinstance(o, list) else ())
        for k, v in items:
            if isinstance(v, str) and (longest is None or len(v) > longest[0]):
                longest = (len(v), o, k)
            elif isinstance(v, dict | list):
                visit(v)

    visit(obj)
    if longest is None or longest[0] <= 64:
        return False
    n, parent, k = longest
    parent[k] = f"{parent[k][: n // 2]}…[{n - n // 2} more chars]"
    return True
