"""One error hierarchy for everything a user or a peer can get wrong.

The CLI catches :class:`FleetdError` once, prints ``fleetd: error: <message>``
and, when there is one, ``  hint: <hint>``, then exits with ``exit_code``.
Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

import re


class FleetdError(Exception):
    """Base class: a message that quotes the bad value, and a hint that says how to fix it."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(FleetdError):
    """A bad command-line value (a duration, a format, a path)."""


class ConfigError(FleetdError):
    """A bad configuration file or setting."""


class StoreError(FleetdError):
    """The database is missing, corrupt, locked, not ours, or from a newer fleetd."""


class QueryError(FleetdError):
    """An untrusted SQL statement was refused, failed, or ran out of time."""

    def __init__(self, message: str, hint: str | None = None, code: str = "bad_query") -> None:
        super().__init__(message, hint)
        self.code = code


class TraceError(FleetdError):
    """Nothing could be traced: no root, no BPF, no tracefs, no headers, no library."""

    exit_code = 1


class NetworkError(FleetdError):
    """A node could not be reached or answered badly."""

    exit_code = 1


# ---- one check for an integer a user or a peer sent -------------------------------------

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def integer(value: object, what: str, low: int = INT64_MIN, high: int = INT64_MAX, *,
            text: bool = False) -> int:
    """``value`` as the integer a user or a client must send where one is documented: a
    JSON integer, or with ``text`` decimal digits (a query parameter, a flag; in JSON a
    string is not a number). A float is refused even when it holds a whole number
    (``1e23``, ``1000.0``): the exponent or fraction is a mistake somewhere, and a float
    past 2**53 is not the integer it looks like. Raises :class:`UsageError` naming
    ``what`` and the value (``ascii``: no escape sequence reaches a terminal)."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif text and isinstance(value, str) and _DIGITS.fullmatch(value.strip()):
        number = int(value.strip())
    if number is None:
        kind = _kind(value)
        raise UsageError(f"{what} must be an integer, got {ascii(value)[:40]} ({kind})",
                         f"write {what} as whole digits, e.g. 1000 (not 1e3 or 1000.0)")
    if not low <= number <= high:
        raise UsageError(f"{what} is {number}, outside {low} .. {high}",
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
