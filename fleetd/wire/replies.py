"""Checked readers for the small answers: ``GET /api/v1/time``.

Like every answer, untrusted: what a reader returns holds only values of the documented
type and range (a name made printable, times as 64-bit integers in order), and an
answer that is not the documented object raises :class:`~fleetd.wire.failure.BadReply`.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from fleetd.wire import paths
from fleetd.wire.failure import BadReply
from fleetd.wire.limits import NAME_CHARS
from fleetd.wire.values import printable, valid_int


@dataclass(frozen=True, slots=True)
class TimeAnswer:
    """A node's ``/api/v1/time`` answer: its name, and its receive and send times when
    both are there, positive and in order (else None: no clock reading)."""

    node: str | None
    t1_ns: int | None
    t2_ns: int | None


def read_time(body: bytes) -> TimeAnswer:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadReply(f"bad {paths.TIME} answer: {printable(exc, 200)}", None) from None
    if not isinstance(obj, dict):
        raise BadReply(f"bad {paths.TIME} answer: a JSON {type(obj).__name__}, "
                       "not an object", None)
    node = obj.get("node")
    t1, t2 = valid_int(obj.get("t1_ns"), 1), valid_int(obj.get("t2_ns"), 1)
    ordered = t1 is not None and t2 is not None and t1 <= t2
    return TimeAnswer(printable(node, NAME_CHARS) if isinstance(node, str) and node else None,
                      t1 if ordered else None, t2 if ordered else None)
