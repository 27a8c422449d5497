"""What a node's trace sessions say about its clock, and when nodes cannot be aligned.

Every node stamps events with its own wall clock (monotonic + a sampled offset). What
the files hold is each clock's own error bound (sampling window + the kernel's
``maxerror``), the offset samples taken during each session (a jump between two is an
NTP step), the boot the sessions ran in, and the span of the events. From those:

- nodes that ran in **one boot of one machine** share its ``CLOCK_MONOTONIC``: the
  difference of their wall-minus-monotonic offsets places one against the other
  exactly (:func:`same_boot`, which collective arrival uses too), so they compare with
  no error at all, whatever either clock's bound says;
- an offset the fleet client **measured** (its error: half the best round trip) is the
  error between that node and this machine, whatever the node's kernel says;
- otherwise the recorded bound, except that a kernel whose clock is **not
  synchronised** (NTP never ran, or lost sync) reports its maximum, 16 s
  (:data:`UNSYNCED_ERROR_NS`): that is no measurement of anything, and is shown as
  "clock not synchronised", never as a misalignment between nodes.

:func:`clock_warnings` says when events of two nodes cannot be compared to better than
a threshold.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

from fleetd.errors import StoreError
from fleetd.store.timeparse import format_ns

log = logging.getLogger("fleetd.store.clockinfo")

# The session columns a clock correction needs, in this order: from a file's
# ``session_data``/``sessions``, or from a node's sessions view over the API.
SESSION_CLOCK_COLUMNS = (
    "seq, boot_id, started_ns, ended_ns, mono_offset_ns, clock_error_ns, clock_samples")
_SESSION_FIELDS = tuple(c.strip() for c in SESSION_CLOCK_COLUMNS.split(","))

# The kernel's maxerror of a clock that is not synchronised (NTP_PHASE_LIMIT, 16 s):
# adjtimex reports it from boot until NTP/chrony syncs the clock, and again once
# maxerror has grown to it (the kernel then sets STA_UNSYNC). A recorded error this
# large (the sampling window adds a few ns) means "not synchronised", not a bound.
UNSYNCED_ERROR_NS = 16_000_000_000


class BadClockRecord(StoreError, ValueError):
    """A clock value of the wrong type in a file or a peer's answer: a one-line error
    (``fleetd: error: ...``) for the CLI, a ValueError for readers that skip the row."""


@dataclass(frozen=True, slots=True)
class SessionClock:
    seq: int
    boot_id: str | None
    started_ns: int
    ended_ns: int | None
    mono_offset_ns: int  # wall = monotonic + offset, at the session's start
    error_ns: int | None  # the session's clock error bound
    samples: list[tuple[int, int, int]] = field(default_factory=list)  # (mono, offset, error)


def _int(value: Any, what: str, *, optional: bool = False) -> Any:
    """``value`` when it is an integer (None too when ``optional``); else
    :class:`BadClockRecord` naming the field and the value."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if value is None and optional:
        return None
    raise BadClockRecord(
        f"{what} is {str(value)[:40]!r} ({type(value).__name__}), not an integer",
        "the file was damaged or not written by fleetd: copy it off the node again")


def session_clock(row: Sequence[Any]) -> SessionClock:
    """One row of :data:`SESSION_CLOCK_COLUMNS`; :class:`BadClockRecord` (a StoreError
    and a ValueError) when a value has the wrong type: a row from a file or a peer is
    not trusted."""
    if len(row) != len(_SESSION_FIELDS):
        raise BadClockRecord(f"a session clock row has {len(row)} values, not "
                             f"{len(_SESSION_FIELDS)} ({SESSION_CLOCK_COLUMNS})")
    seq, boot, start, end, off, err, samples = row
    seq = _int(seq, "session seq")
    where = f"session {seq}: "
    if boot is not None and not isinstance(boot, str):
        raise BadClockRecord(f"{where}boot_id is {str(boot)[:40]!r} "
                             f"({type(boot).__name__}), not text")
    return SessionClock(seq, boot, _int(start, where + "started_ns"),
                        _int(end, where + "ended_ns", optional=True),
                        _int(off, where + "mono_offset_ns"),
                        _int(err, where + "clock_error_ns", optional=True),
                        clock_samples(samples))


def clock_samples(text: Any) -> list[tuple[int, int, int]]:
    """The ``clock_samples`` JSON of a session: ``[(mono, offset, error), ...]``; an
    unreadable value is logged and read as no samples (the session's offset remains)."""
    if not text:
        return []
    try:
        out = [(m, o, e) for m, o, e in orjson.loads(text)]
    except (orjson.JSONDecodeError, TypeError, ValueError):
        out = None
    if out is None or not all(isinstance(v, int) and not isinstance(v, bool)
                              for t in out for v in t):
        log.warning("unreadable clock_samples %.60r ignored", text)
        return []
    return out


def synchronised(errors: Sequence[int]) -> bool | None:
    """Whether the clock that recorded these error bounds was synchronised: False when
    one of them is the kernel's unsynchronised maximum, None when there are none."""
    if not errors:
        return None
    return max(errors) < UNSYNCED_ERROR_NS


def session_errors(sessions: Sequence[SessionClock]) -> list[int]:
    """Every error bound the sessions recorded (their own, and each sample's)."""
    errs = [s.error_ns for s in sessions if s.error_ns is not None]
    return errs + [e for s in sessions for _, _, e in s.samples]


def node_boot(sessions: Sequence[SessionClock]) -> tuple[str | None, int | None]:
    """The one boot all the sessions ran in (None when they do not share one, or do not
    say) and, with it, the wall-minus-monotonic offset of the last session."""
    if not sessions:
        return None, None
    boots = {s.boot_id for s in sessions}
    boot = boots.pop() if len(boots) == 1 else None
    return boot, (max(sessions, key=lambda s: s.seq).mono_offset_ns if boot else None)


class Clock(NamedTuple):
    """A node's clock against the reference clock."""

    offset_ns: int  # node clock minus reference
    error_ns: int | None  # bound on that offset, None when unknown
    # Nodes in one domain read one clock (one machine, one boot: a local fleet, or
    # nodes recorded side by side), so their times compare with no error at all.
    domain: str | None = None


Boot = tuple[str | None, int | None]  # (boot id, wall minus monotonic), as node_boot


def same_boot(clocks: Mapping[str, Clock], boots: Mapping[str, Boot]) -> dict[str, Clock]:
    """Nodes that ran in one boot of one machine share its monotonic clock: each is
    placed against the one of them measured best (smallest error; any one when no error
    is known) by the difference of their wall-minus-monotonic offsets, which is exact
    (a node whose wall clock was set apart, or faked, is still placed right), and they
    compare with each other without error (one ``domain``)."""
    out = dict(clocks)
    best: dict[str, str] = {}
    for name, (boot, mono) in boots.items():
        c = clocks.get(name)
        if boot is None or mono is None or c is None:
            continue
        b = best.get(boot)
        if b is None or _better(c.error_ns, clocks[b].error_ns):
            best[boot] = name
    for name, (boot, mono) in boots.items():
        ref = best.get(boot or "")
        if ref is None or mono is None or name not in out:
            continue
        rc, ref_mono = clocks[ref], boots[ref][1]
        assert ref_mono is not None
        out[name] = Clock(rc.offset_ns + mono - ref_mono, rc.error_ns, boot)
    return out


def _better(a: int | None, b: int | None) -> bool:
    """Error bound ``a`` is a better measurement than ``b`` (unknown is worst)."""
    return a is not None and (b is None or a < b)


def combined_error(a: str, b: str, clocks: Mapping[str, Clock]) -> int | None:
    """The bound on the error of comparing a time of node ``a`` with one of node ``b``:
    0 on one node or one boot (one clock), else the sum of both bounds (None when one
    is unknown)."""
    if a == b:
        return 0
    ca, cb = Clock(*clocks.get(a, (0, None))), Clock(*clocks.get(b, (0, None)))
    if ca.domain is not None and ca.domain == cb.domain:
        return 0
    ea, eb = ca.error_ns, cb.error_ns
    return None if ea is None or eb is None else ea + eb


@dataclass(slots=True)
class NodeClock:
    name: str
    where: str  # the file it comes from, for messages
    sessions: list[SessionClock]
    first_ns: int | None  # earliest event
    last_ns: int | None
    # An offset measured against this machine (a fleet client's), when there is one:
    # its error, not the kernel's bound, is then what the node's times are good to.
    measured: Clock | None = None

    def __post_init__(self) -> None:
        where = f"{self.where}: node {self.name!r}: "
        self.first_ns = _int(self.first_ns, where + "the earliest event's ts_ns", optional=True)
        self.last_ns = _int(self.last_ns, where + "the latest event's ts_ns", optional=True)

    @property
    def error_ns(self) -> int | None:
        """The largest error bound any session or sample recorded; None when unknown."""
        errs = session_errors(self.sessions)
        return max(errs) if errs else None

    @property
    def synchronised(self) -> bool | None:
        """False when the kernel said its clock was not synchronised (in any session)."""
        return synchronised(session_errors(self.sessions))

    @property
    def boot(self) -> Boot:
        return node_boot(self.sessions)

    @property
    def clock(self) -> Clock:
        """This node against the others, before :func:`same_boot`: the measured offset
        when there is one; else as recorded, with the recorded bound (unknown when the
        clock was not synchronised: the kernel's 16 s bounds nothing)."""
        if self.measured is not None:
            return self.measured
        return Clock(0, None if self.synchronised is False else self.error_ns)

    def describe_error(self) -> str:
        """The clock error for a table's ``clock`` column: ``±1.2 ms``, ``±300 us
        measured``, ``not synchronised`` or ``unknown``."""
        if self.measured is not None and self.measured.error_ns is not None:
            return f"±{fmt_ns(self.measured.error_ns)} measured"
        if self.synchronised is False:
            return "not synchronised"
        return "unknown" if self.error_ns is None else f"±{fmt_ns(self.error_ns)}"


def aligned(nodes: Sequence[NodeClock]) -> dict[str, Clock]:
    """Every node's :attr:`NodeClock.clock`, nodes of one boot placed by
    :func:`same_boot` (one domain each)."""
    return same_boot({n.name: n.clock for n in nodes}, {n.name: n.boot for n in nodes})


def boot_groups(nodes: Sequence[NodeClock]) -> dict[str, list[str]]:
    """Node name -> the other nodes of its boot (one clock), for nodes that share one."""
    clocks = aligned(nodes)
    by_domain: dict[str, list[str]] = {}
    for n in nodes:
        d = clocks[n.name].domain
        if d is not None:
            by_domain.setdefault(d, []).append(n.name)
    return {name: [m for m in group if m != name] for group in by_domain.values()
            if len(group) > 1 for name in group}


def fmt_ns(ns: int) -> str:
    """A duration for messages: 850 us, 12.3 ms, 4.20 s, 2.0 h."""
    a = abs(ns)
    if a >= 3_600_000_000_000:
        return f"{ns / 3.6e12:.1f} h"
    if a >= 1_000_000_000:
        return f"{ns / 1e9:.2f} s"
    if a >= 1_000_000:
        return f"{ns / 1e6:.1f} ms"
    return f"{ns / 1e3:.0f} us"


def clock_warnings(nodes: Sequence[NodeClock], threshold_ns: int) -> list[str]:
    """Reasons the nodes' timelines may be misaligned by more than ``threshold_ns``."""
    out: list[str] = []
    several = len(nodes) > 1
    for n in nodes:
        if several and not n.sessions and n.first_ns is not None:
            out.append(f"node {n.name!r} ({n.where}) has no trace sessions, so no clock "
                       "information: its times cannot be checked against the other nodes")
        out += _steps(n, threshold_ns)
    if several:
        out += _alignment(nodes, threshold_ns) + _overlap(nodes)
    return out


def _steps(n: NodeClock, threshold_ns: int) -> list[str]:
    """Jumps of the wall clock against monotonic: inside a session, or between sessions
    of one boot (monotonic time continues across them, so the offset should too)."""
    out: list[str] = []
    for s in n.sessions:
        for (_, o0, _), (m1, o1, _) in zip(s.samples, s.samples[1:], strict=False):
            if abs(o1 - o0) > threshold_ns:
                out.append(
                    f"node {n.name!r}: the wall clock moved {fmt_ns(o1 - o0)} against "
                    f"monotonic during session {s.seq} (around {format_ns(m1 + o1)}), an NTP "
                    "step: events near it may be misplaced by up to that much")
                break
    by_boot: dict[str, list[SessionClock]] = {}
    for s in n.sessions:
        if s.boot_id:
            by_boot.setdefault(s.boot_id, []).append(s)
    for group in by_boot.values():
        offsets = [s.mono_offset_ns for s in group]
        if max(offsets) - min(offsets) > threshold_ns:
            out.append(
                f"node {n.name!r}: sessions {', '.join(str(s.seq) for s in group)} of one boot "
                f"disagree on the clock offset by {fmt_ns(max(offsets) - min(offsets))} (the "
                "clock was stepped between them)")
    return out


def _alignment(nodes: Sequence[NodeClock], threshold_ns: int) -> list[str]:
    """What keeps the nodes' times from lining up: nodes of one boot whose recorded
    offsets differ (their times are apart by exactly that), clocks that were not
    synchronised (compared with another machine's, no bound), and the two largest
    bounds when their sum is above the threshold. Nodes of one boot need no bound."""
    clocks = aligned(nodes)
    out: list[str] = []
    # One boot: the files' times are each node's wall clock as recorded; the monotonic
    # offsets say by how much two of them disagree (a clock stepped between sessions).
    for boot in sorted({c.domain for c in clocks.values() if c.domain is not None}):
        group = sorted((mono, n.name) for n in nodes if clocks[n.name].domain == boot
                       and (mono := n.boot[1]) is not None)
        (lo, a), (hi, b) = group[0], group[-1]
        if hi - lo > threshold_ns:
            out.append(f"nodes {a!r} and {b!r} ran in one boot of one machine, but their "
                       f"recorded times are {fmt_ns(hi - lo)} apart (the wall clock was "
                       "stepped between their sessions): compare their events with that "
                       "in mind")
    # One entry per clock: a boot's nodes read one, each other node its own. A node
    # without events has nothing to align.
    reps: dict[str, NodeClock] = {}
    for n in nodes:
        if n.first_ns is None:
            continue
        key = clocks[n.name].domain or f"node:{n.name}"
        if key not in reps or _better(clocks[n.name].error_ns, clocks[reps[key].name].error_ns):
            reps[key] = n
    if len(reps) < 2:
        return out
    unsynced = [n for n in reps.values() if n.measured is None and n.synchronised is False]
    if unsynced:
        names = ", ".join(repr(n.name) for n in unsynced)
        out.append(f"the clock of {names} was not synchronised (the kernel reports its "
                   f"maximum error, ±{fmt_ns(UNSYNCED_ERROR_NS)}, which bounds nothing): "
                   "times compare across machines only as well as the clocks were set; "
                   "check NTP/chrony on those nodes")
    known: list[tuple[int, str]] = []
    for n in reps.values():
        err = clocks[n.name].error_ns
        if err is not None:
            known.append((err, n.name))
    known.sort(reverse=True)
    if len(known) < 2:
        return out
    (ea, a), (eb, b) = known[0], known[1]
    if ea + eb > threshold_ns:
        out.append(f"nodes {a!r} (clock error ±{fmt_ns(ea)}) and {b!r} (±{fmt_ns(eb)}) can "
                   f"only be aligned to within ±{fmt_ns(ea + eb)}, above the "
                   f"{fmt_ns(threshold_ns)} threshold: treat smaller cross-node gaps as "
                   "noise, and check NTP/chrony on those nodes")
    return out


def _overlap(nodes: Sequence[NodeClock]) -> list[str]:
    spans = [(n.first_ns, n.last_ns, n.name) for n in nodes
             if n.first_ns is not None and n.last_ns is not None]
    if len(spans) < 2:
        return []
    late = max(spans, key=lambda s: s[0])
    early = min(spans, key=lambda s: s[1])
    if late[0] <= early[1]:
        return []
    return [f"the recordings do not overlap in time: {early[2]!r} ends at {format_ns(early[1])}, "
            f"{late[2]!r} starts at {format_ns(late[0])} ({fmt_ns(late[0] - early[1])} later); "
            "they are different runs, or a clock is off by about that much"]
