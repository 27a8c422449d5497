"""A time window parsed once: :class:`Bounds`, absolute nanoseconds in our clock with
the window's origin.

The one window type every stage below the analyzers shares: the CLI, the MCP tools and
the node API parse what the user gave (``--since 5m``, ``--from/--to``; analyze.window's
``WindowSpec.bounds``) into a Bounds; it travels to a node as query parameters
(:meth:`Bounds.params`), is shifted into a node's clock for a fleet export
(:meth:`Bounds.in_clock`), and selects a lake's day partitions and rows
(:meth:`Bounds.inclusive`, for store.lakesql.Pruning and store.lake's readers).
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetd.store.timeparse import format_ns

RELATIVE, ABSOLUTE, WHOLE = "relative", "absolute", "whole"
OPEN_END_NS = 2**62  # "no end", as the node API's events endpoint takes it


@dataclass(frozen=True, slots=True)
class Bounds:
    """A window parsed once, in our clock: its ``origin`` (``relative``: the last
    ``since`` before now; ``absolute``: ``--from``/``--to``; ``whole``: the whole
    recording) and ``[start_ns, end_ns)`` in wall-clock UTC ns, None where it is open
    (the recording's first event; its last, or now for a relative window)."""

    origin: str
    start_ns: int | None = None
    end_ns: int | None = None
    since: str | None = None  # a relative window's duration, as given

    def params(self, offset_ns: int = 0) -> dict[str, str]:
        """Query parameters for a node whose clock is ``offset_ns`` ahead of ours.
        ``since`` needs no shift: "the last 5 minutes" by the node's clock is the same
        span of real time."""
        if self.origin == RELATIVE:
            return {"since": str(self.since)}
        out: dict[str, str] = {}
        if self.start_ns is not None:
            out["from"] = str(self.start_ns + offset_ns)
        if self.end_ns is not None:
            out["to"] = str(self.end_ns - 1 + offset_ns)  # --to is inclusive
        return out

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
        return self.start_ns, None if self.end_ns is None else self.end_ns - 1

    def to_json(self, label: str) -> dict[str, object]:
        """The window as an export's metadata states it."""
        return {"label": label, "start_ns": self.start_ns, "end_ns": self.end_ns,
                "start": format_ns(self.start_ns) if self.start_ns is not None else None,
                "end": format_ns(self.end_ns) if self.end_ns is not None else None}
