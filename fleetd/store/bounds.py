"""A time window parsed once: :class:`Bounds`, what every command, tool and request
carries from the user's words to the rows.

The window is parsed where it enters, once: from the user's flags (``--since 5m``,
``--from/--to``; :meth:`Bounds.parse`) by the CLI and the MCP tools, or from a request's
query parameters (:meth:`Bounds.from_params`) by a node. It travels to a node as query
parameters (:meth:`Bounds.params`, the one encoding, which :meth:`Bounds.from_params`
reads back), is shifted into a node's clock for a fleet export (:meth:`Bounds.in_clock`),
selects a lake's day partitions and rows (:meth:`Bounds.inclusive`), and is resolved
against a database into the half-open span the analyzers read
(fleetd.analyze.reading.window.resolve).

``--to`` is inclusive, in every place it is written: on the command line, in the
``to`` query parameter and in :attr:`Bounds.last_ns` (the last nanosecond in the
window). :attr:`Bounds.end_ns` is the one place the half-open end is derived from it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from fleetd.errors import FleetdError, QueryError, UsageError
from fleetd.store.timeparse import format_ns, parse_duration, parse_timestamp

RELATIVE, ABSOLUTE, WHOLE = "relative", "absolute", "whole"
OPEN_END_NS = 2**62  # "no end", as the node API's events endpoint takes it
WHOLE_LABEL = "whole recording"


@dataclass(frozen=True, slots=True)
class Bounds:
    """A window parsed once, in our clock: its ``origin`` (``relative``: the last
    ``since`` before now; ``absolute``: ``--from``/``--to``; ``whole``: the whole
    recording), its first nanosecond ``start_ns`` and its last ``last_ns`` (both
    included, wall-clock UTC ns), None where open (the recording's first event; its
    last, or now for a relative window). ``given`` is an absolute window as the user
    wrote it, for its :meth:`label`."""

    origin: str = WHOLE
    start_ns: int | None = None
    last_ns: int | None = None
    since: str | None = None  # a relative window's duration, as given
    given: str | None = None

    @classmethod
    def parse(cls, since: str | None = None, from_: str | None = None,
              to: str | None = None, now_ns: int | None = None) -> Bounds:
        """The window from the user's words (a relative one counted back from
        ``now_ns``, default now): every error a window can have without the data is
        raised here, in one wording."""
        if since and (from_ or to):
            raise UsageError(f"give either --since {since!r} or --from/--to, not both",
                             "--since 5m means the last five minutes; --from/--to name "
                             "absolute times")
        if since:
            now = now_ns if now_ns is not None else time.time_ns()
            return cls(RELATIVE, now - parse_duration(since), None, since)
        if not (from_ or to):
            return cls()
        start = parse_timestamp(from_) if from_ else None
        last = parse_timestamp(to) if to else None
        if start is not None and last is not None and last < start:
            raise UsageError(f"--from {from_!r} is not before --to {to!r}",
                             "swap the two times, or widen the window")
        return cls(ABSOLUTE, start, last, None, f"{from_ or 'start'} .. {to or 'end'}")

    def params(self, offset_ns: int = 0) -> dict[str, str]:
        """The window as query parameters (``since``, or ``from``/``to`` in ns), for a
        node whose clock is ``offset_ns`` ahead of ours; :meth:`from_params` reads them
        back. ``since`` needs no shift: "the last 5 minutes" by the node's clock is the
        same span of real time."""
        if self.origin == RELATIVE:
            return {"since": str(self.since)}
        out: dict[str, str] = {}
        if self.start_ns is not None:
            out["from"] = str(self.start_ns + offset_ns)
        if self.last_ns is not None:
            out["to"] = str(self.last_ns + offset_ns)
        return out

    @classmethod
    def from_params(cls, query: Mapping[str, str], now_ns: int | None = None) -> Bounds:
        """The window of a request (what :meth:`params` wrote, or a person's ``since=5m``
        or ISO 8601 times): a bad value is the peer's mistake, a ``bad_request`` query
        error (HTTP 400) quoting it."""
        try:
            return cls.parse(query.get("since") or None, query.get("from") or None,
                             query.get("to") or None, now_ns)
        except FleetdError as exc:
            raise QueryError(exc.message, exc.hint, code="bad_request") from None

    @property
    def absolute(self) -> bool:
        """Its times are times of our clock (a node of another clock needs them shifted)."""
        return self.origin == ABSOLUTE

    @property
    def end_ns(self) -> int | None:
        """The half-open end: the first nanosecond after the window, None where open."""
        return None if self.last_ns is None else self.last_ns + 1

    def pinned(self) -> Bounds:
        """The window with a relative start fixed where it was parsed: a fleet export asks
        every node for the same span, not each "the last 5 minutes" of its own now."""
        if self.origin != RELATIVE:
            return self
        return Bounds(ABSOLUTE, self.start_ns, None, None, self.label())

    def in_clock(self, offset_ns: int) -> tuple[int, int]:
        """``[start, end)`` as a clock ``offset_ns`` ahead of ours reads it, the open
        ends as 0 and :data:`OPEN_END_NS` (a relative window's start is where it was
        parsed: a fleet export fixes "the last 5 minutes" once for every node)."""
        start = 0 if self.start_ns is None else self.start_ns + offset_ns
        end = OPEN_END_NS if self.end_ns is None else self.end_ns + offset_ns
        return start, end

    def inclusive(self) -> tuple[int | None, int | None]:
        """``[first, last]`` ns, None where open: what a lake's pruning and its
        readers take (store.lakesql.Pruning, store.lake's ``since_ns``/``until_ns``)."""
        return self.start_ns, self.last_ns

    def label(self) -> str:
        """The window in the user's words: ``last 5m``, ``FROM .. TO`` (``start`` or
        ``end`` for an open side) or ``whole recording``."""
        if self.origin == RELATIVE:
            return f"last {self.since}"
        if self.given is not None:
            return self.given
        if self.origin == ABSOLUTE:
            first = "start" if self.start_ns is None else format_ns(self.start_ns)
            return f"{first} .. {'end' if self.last_ns is None else format_ns(self.last_ns)}"
        return WHOLE_LABEL

    def to_json(self) -> dict[str, object]:
        """The window as an export's metadata states it (``end_ns`` half-open)."""
        end = self.end_ns
        return {"label": self.label(), "start_ns": self.start_ns, "end_ns": end,
                "start": format_ns(self.start_ns) if self.start_ns is not None else None,
                "end": format_ns(end) if end is not None else None}
