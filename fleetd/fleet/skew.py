"""Clock skew: how far each node's wall clock is from ours, and correcting for it.

Each sample is one exchange with a node, NTP-style: t0 (we send, our clock), t1 (the
node received it, its clock, header ``X-Fleetd-Recv-Ns``), t2 (the node answered, its
clock, ``X-Fleetd-Send-Ns``), t3 (we received the answer's headers, our clock). Every
answer carries the two stamps, so the query itself is a sample; ``GET /api/v1/time`` is
asked only when the offset is needed before the query. Then::

    offset = ((t1 - t0) + (t2 - t3)) / 2      # node clock minus our clock
    rtt    = (t3 - t0) - (t2 - t1)            # time on the wire and in both stacks

The true offset lies within ``rtt / 2`` of a sample's estimate whatever the path's
asymmetry, so samples with the lowest RTT are the trustworthy ones: we keep those (at
most :data:`KEEP`, and only those within :data:`KEEP_RTT_FACTOR` of the best RTT), take
the median of their offsets (so one sample whose two legs were unevenly delayed cannot
decide alone) and report the best sample's ``rtt / 2`` as the error bound.

Correction: a node's timestamps are in its clock; ``ts - offset`` is the same instant in
ours. Every integer field whose name ends in ``ts_ns`` (query columns, chain and
evidence fields) is corrected that way; see docs/fleet.md.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fleetd.fleet.client import ClockLog, FleetClient, current_clock
from fleetd.fleet.targets import Target
from fleetd.store.timeparse import format_ns
from fleetd.wire import paths
from fleetd.wire.failure import Failure, NodeFailed
from fleetd.wire.replies import TimeAnswer, read_time

log = logging.getLogger("fleetd.fleet.skew")

# Estimate skew (1) or not (0). The samples are the stamps on a node's answers (see
# fleetd.fleet.client), plus at most one /api/v1/time request per node.
SAMPLES = 1
KEEP = 3
KEEP_RTT_FACTOR = 1.5
# Beyond the round trips: what two samples of one clock may still disagree by (the two
# stamps are taken microseconds from the socket, and NTP slews meanwhile).
STEP_SLACK_NS = 50_000_000


@dataclass(frozen=True, slots=True)
class Sample:
    t0: int
    t1: int
    t2: int
    t3: int

    @property
    def rtt_ns(self) -> int:
        return (self.t3 - self.t0) - (self.t2 - self.t1)

    @property
    def offset_ns(self) -> float:
        return ((self.t1 - self.t0) + (self.t2 - self.t3)) / 2


@dataclass(frozen=True, slots=True)
class Skew:
    offset_ns: float  # node clock minus ours
    error_ns: float  # half the best sample's round trip
    samples: int  # taken
    used: int  # kept for the median

    @property
    def offset_ms(self) -> float:
        return self.offset_ns / 1e6

    @property
    def error_ms(self) -> float:
        return self.error_ns / 1e6

    @property
    def correction_ns(self) -> int:
        return round(self.offset_ns)

    def to_json(self) -> dict[str, float]:
        return {"offset_ms": round(self.offset_ms, 3), "error_ms": round(self.error_ms, 3)}

    def describe(self) -> str:
        ahead = "ahead of" if self.offset_ns >= 0 else "behind"
        return (f"clock {abs(self.offset_ms):.3f} ms {ahead} this machine "
                f"(+/- {self.error_ms:.3f} ms, {self.used} of {self.samples} samples)")


def since_last_step(samples: Sequence[Sample]) -> list[Sample]:
    """The samples (in the order taken) from the node's last clock step on. Two honest
    samples of one clock agree within half their round trips summed; a later sample
    outside that of an earlier one means the node's clock was set in between, and
    everything before it describes a clock that no longer exists."""
    kept: list[Sample] = []
    for s in samples:
        if s.rtt_ns < 0:
            continue
        if any(abs(s.offset_ns - k.offset_ns) > (s.rtt_ns + k.rtt_ns) / 2 + STEP_SLACK_NS
               for k in kept):
            kept = []
        kept.append(s)
    return kept


def estimate(samples: Sequence[Sample]) -> Skew | None:
    """The offset from the lowest-RTT samples since the node's clock last stepped;
    None without a usable sample."""
    usable = sorted(since_last_step(samples), key=lambda s: s.rtt_ns)
    if not usable:
        return None
    best = usable[0]
    limit = max(best.rtt_ns * KEEP_RTT_FACTOR, best.rtt_ns + 1)
    kept = [s for s in usable[:KEEP] if s.rtt_ns <= limit]
    offset = statistics.median(s.offset_ns for s in kept)
    return Skew(offset_ns=offset, error_ns=best.rtt_ns / 2, samples=len(samples),
                used=len(kept))


async def sample(client: FleetClient, target: Target, n: int = 1
                 ) -> tuple[str | None, Failure | None]:
    """Up to n ``GET /api/v1/time``, one after another on the node's connection:
    (node name, failure). The samples themselves are the answers' stamps, which the
    client collects (:func:`fleetd.fleet.client.clock_samples`).

    A failed sample ends the series (the node is probably down, and the query to it
    reports why); the samples taken so far still count.
    """
    name: str | None = None
    clock = current_clock()
    for _ in range(n):
        try:
            stamped = len(clock.stamps) if clock is not None else 0
            t0 = time.time_ns()
            _, _, body = await client.get_raw(target, paths.TIME)
            t3 = time.time_ns()
            answer = read_time(body)
            name = answer.node or name
            if clock is not None and len(clock.stamps) == stamped:
                _body_stamp(clock, answer, t0, t3)
        except NodeFailed as exc:  # a BadReply among them
            return name, exc.failure
    return name, None


def _body_stamp(clock: ClockLog, answer: TimeAnswer, t0: int, t3: int) -> None:
    """An agent older than the header stamps (or a proxy that drops them) still puts its
    receive and send times in the /time body: the sample is taken from there."""
    if answer.t1_ns is not None and answer.t2_ns is not None:
        clock.stamps.append((t0, answer.t1_ns, answer.t2_ns, t3))


# ---- correction -----------------------------------------------------------------------


def is_ts_column(name: str) -> bool:
    return name.endswith("ts_ns")


def correct_rows(columns: Sequence[str], rows: list[list[Any]], offset_ns: int) -> None:
    """Shift every ``*ts_ns`` integer cell into our clock, in place."""
    idx = [i for i, c in enumerate(columns) if is_ts_column(c)]
    if not idx or not offset_ns:
        return
    for row in rows:
        for i in idx:
            v = row[i]
            if isinstance(v, int) and not isinstance(v, bool):
                row[i] = v - offset_ns


def correct_obj(obj: Any, offset_ns: int) -> Any:
    """The same rule for nested JSON (chains, evidence): ``*ts_ns`` keys, in place.

    A ``time`` string beside a corrected ``ts_ns`` is rewritten from the new value so
    the two never disagree.
    """
    if not offset_ns:
        return obj
    if isinstance(obj, list):
        for item in obj:
            correct_obj(item, offset_ns)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            if is_ts_column(str(key)) and isinstance(value, int) and not isinstance(value, bool):
                obj[key] = value - offset_ns
            elif isinstance(value, list | dict):
                correct_obj(value, offset_ns)
        ts = obj.get("ts_ns")
        if isinstance(obj.get("time"), str) and isinstance(ts, int) and ts > 0:
            obj["time"] = format_ns(ts)
    return obj
