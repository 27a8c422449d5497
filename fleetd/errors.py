"""One error hierarchy for everything a user or a peer can get wrong.

The CLI catches :class:`FleetdError` once, prints ``fleetd: error: <message>``
and, when there is one, ``  hint: <hint>``, then exits with ``exit_code``.
Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations


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
