"""Checked readers for one value of a node's answer.

A node's answer is untrusted: a node of another version, a broken one or an impostor
with a valid certificate may send any JSON up to the client's byte limit. Each reader
returns the value when it has the documented type and range and raises
:class:`~fleetd.wire.failure.BadReply` naming where it is (``ranks[3].pid``) otherwise;
strings come back printable and cut, so a name can never forge a terminal line.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

from fleetd.wire.failure import BadReply
from fleetd.wire.limits import INT64_MAX, INT64_MIN

T = TypeVar("T")


def printable(value: object, limit: int = 1000) -> str:
    """A string from a node, safe to print: control characters (escape sequences,
    newlines that could forge a line) become '?', and it is cut to ``limit``."""
    text = value if isinstance(value, str) else str(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text if text.isprintable() else "".join(c if c.isprintable() else "?"
                                                   for c in text)


def valid_int(value: object, low: int = INT64_MIN, high: int = INT64_MAX) -> int | None:
    """``value`` when it is a JSON integer within [low, high], else None."""
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
        return value
    return None


def is_cell(value: object) -> bool:
    """A value SQLite can hold, as JSON carries it: null, text, a 64-bit integer, a
    finite float (a boolean stands for 0/1)."""
    if value is None or isinstance(value, str | bool):
        return True
    if isinstance(value, int):
        return INT64_MIN <= value <= INT64_MAX
    return isinstance(value, float) and math.isfinite(value)


def is_number(value: object) -> bool:
    """A JSON number that is not a boolean and is finite."""
    return isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value)


def shown(value: object) -> str:
    """A bad value as an error message shows it: its type and its start."""
    return f"{type(value).__name__} {printable(value, 40)!r}"


def need_dict(value: object, where: str) -> dict[str, object]:
    """An object of a node's answer: still untrusted (each value is ``object`` until its
    own reader reads it), so ``dict[str, object]`` is its honest type."""
    if not isinstance(value, dict):
        raise BadReply(f"{where}: expected an object, got {type(value).__name__}")
    return value


def need_list(value: Any, where: str, limit: int | None = None) -> list[Any]:
    if not isinstance(value, list):
        raise BadReply(f"{where}: expected a list, got {type(value).__name__}")
    if limit is not None and len(value) > limit:
        raise BadReply(f"{where}: {len(value)} entries, above the limit of {limit}")
    return value


def need_int(value: Any, where: str, low: int = INT64_MIN, high: int = INT64_MAX) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadReply(f"{where}: expected an integer, got {shown(value)}")
    if not low <= value <= high:
        raise BadReply(f"{where}: {printable(value, 40)} is outside [{low}, {high}]")
    return value


def need_number(value: Any, where: str) -> float | int:
    if not is_number(value) or abs(value) > INT64_MAX:
        raise BadReply(f"{where}: expected a finite number, got {shown(value)}")
    number: float | int = value
    return number


def need_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise BadReply(f"{where}: expected true or false, got {printable(value, 40)}")
    return value


def need_text(value: Any, where: str, limit: int) -> str:
    if not isinstance(value, str):
        raise BadReply(f"{where}: expected a string, got {shown(value)}")
    return printable(value, limit)


def need_choice(value: Any, allowed: tuple[str, ...], where: str) -> str:
    if value not in allowed:
        raise BadReply(f"{where}: expected one of {', '.join(allowed)}, got {shown(value)}")
    return str(value)


def optional(value: Any, where: str, read: Callable[[Any, str], T]) -> T | None:
    """``read(value, where)``, or None for a null."""
    return None if value is None else read(value, where)
