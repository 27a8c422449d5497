"""Checked readers for one value of a node's answer.

A node's answer is untrusted: a node of another version, a broken one or an impostor
with a valid certificate may send any JSON up to the client's byte limit. Each reader
returns the value when it has the documented type and range and raises
:class:`~fleetd.wire.failure.BadReply` naming where it is (``ranks[3].pid``) otherwise;
strings come back printable and cut, so a name can never forge a terminal line.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any, TypeVar

from fleetd.errors import UsageError
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


def integer(value: object, what: str, low: int = INT64_MIN, high: int = INT64_MAX, *,
            text: bool = False) -> int:
    """``value`` as the integer a user or a client documented as one must send: a JSON
    integer, or with ``text`` decimal digits (a query parameter, a flag; in JSON a
    string is not a number). A float is refused even
    when it holds a whole number (``1e23``, ``1000.0``): the exponent or fraction is a
    mistake somewhere, and a float past 2**53 is not the integer it looks like. Raises
    :class:`~fleetd.errors.UsageError` naming ``what`` and the value."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif text and isinstance(value, str) and _DIGITS.fullmatch(value.strip()):
        number = int(value.strip())
    if number is None:
        kind = _kind(value)
        raise UsageError(f"{what} must be an integer, got {printable(value, 40)!r} ({kind})",
                         f"write {what} as whole digits, e.g. 1000 (not 1e3 or 1000.0)")
    if not low <= number <= high:
        raise UsageError(f"{what} is {printable(number, 40)}, outside {low} .. {high}",
                         f"pass {what} between {low} and {high}")
    return number


def _kind(value: object) -> str:
    """What a value that is not an integer is, for the message."""
    if isinstance(value, str):
        if _DIGITS.fullmatch(value.strip()):
            return "a string, not a number"
        if _FLOATISH.fullmatch(value.strip()):
            return "a number with an exponent or a fraction"
    if isinstance(value, float):
        return "a number with an exponent or a fraction"
    return type(value).__name__


_DIGITS = re.compile(r"[+-]?[0-9]{1,30}")
_FLOATISH = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


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


def need_dict(value: Any, where: str) -> dict[str, Any]:
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
