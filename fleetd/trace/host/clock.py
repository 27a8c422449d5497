"""Monotonic-to-wall-clock mapping for one trace session.

BPF timestamps are CLOCK_MONOTONIC (``bpf_ktime_get_ns``). Events are stored in
wall-clock UTC, so each session samples ``offset = realtime - monotonic`` tightly:
read realtime, monotonic, realtime again, many times, and keep the read with the
narrowest realtime window. The error estimate is half that window plus the kernel's
own ``maxerror`` from adjtimex (how far the system clock may be from true time).
The offset drifts when NTP slews the clock, so the tracer re-samples periodically.

A step (the wall clock set by NTP, an operator or a VM migration: the offset moving by
more than :data:`STEP_NS` between two samples) is not applied: within a session the
mapping stays continuous, so stored times never run backwards and a timeline keeps
its order, and the step is recorded (``steps``; the session's ``drops`` carry
``clock_steps`` and ``clock_step_ns``). Durations come from the monotonic clock either
way. The next session maps with the clock as it then reads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger("fleetd.trace.host.clock")

_TRIES = 25
# Between two samples 10 s apart NTP slews at most 5 ms (500 ppm); a move this large
# is a step.
STEP_NS = 500_000_000
_STA_UNSYNC = 0x0040
_TIME_ERROR = 5


class _Timex(ctypes.Structure):
    # struct timex on 64-bit Linux: only the leading fields are read; the padding
    # covers the rest of the 208-byte structure (and any future growth).
    _fields_ = [
        ("modes", ctypes.c_uint),
        ("offset", ctypes.c_long),
        ("freq", ctypes.c_long),
        ("maxerror", ctypes.c_long),
        ("esterror", ctypes.c_long),
        ("status", ctypes.c_int),
        ("_rest", ctypes.c_byte * 256),
    ]


@dataclass(frozen=True, slots=True)
class ClockSample:
    mono_ns: int
    offset_ns: int  # wall = mono + offset
    error_ns: int  # window/2 + adjtimex maxerror (when known)
    window_ns: int
    synced: bool | None  # None: adjtimex unavailable


def kernel_max_error_ns() -> tuple[int | None, bool | None]:
    """(maxerror in ns, clock synchronized?) from adjtimex, or (None, None)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6", use_errno=True)
        tx = _Timex()  # modes = 0: read only, needs no privilege
        state = libc.adjtimex(ctypes.byref(tx))
    except (OSError, AttributeError):
        return None, None
    if state < 0:
        return None, None
    synced = state != _TIME_ERROR and not (tx.status & _STA_UNSYNC)
    return int(tx.maxerror) * 1000, synced


def sample(tries: int = _TRIES) -> ClockSample:
    """One tight offset sample: the narrowest of ``tries`` realtime/mono/realtime reads."""
    best: tuple[int, int, int] | None = None  # (window, offset, mono)
    rt, mono = time.clock_gettime_ns, time.CLOCK_MONOTONIC
    real = time.CLOCK_REALTIME
    for _ in range(tries):
        r1 = rt(real)
        m = rt(mono)
        r2 = rt(real)
        window = r2 - r1
        if best is None or window < best[0]:
            best = (window, (r1 + r2) // 2 - m, m)
    assert best is not None
    window, offset, m = best
    max_err, synced = kernel_max_error_ns()
    error = window // 2 + 1 + (max_err or 0)
    return ClockSample(m, offset, error, window, synced)


@dataclass(frozen=True, slots=True)
class ClockStep:
    mono_ns: int  # when it was seen (the sample after it)
    step_ns: int  # how far the wall clock moved against monotonic


@dataclass
class ClockMap:
    """The offsets of one session; converts BPF monotonic times to wall-clock ns."""

    resample_every_ns: int = 10_000_000_000
    samples: list[ClockSample] = field(default_factory=list)
    steps: list[ClockStep] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.samples:
            self.samples.append(sample())
        self.offset_ns = self.samples[-1].offset_ns
        self._read_ns = self.offset_ns  # the offset as last read, steps included

    def maybe_resample(self, now_mono_ns: int | None = None) -> bool:
        now = time.clock_gettime_ns(time.CLOCK_MONOTONIC) if now_mono_ns is None else now_mono_ns
        if now - self.samples[-1].mono_ns < self.resample_every_ns:
            return False
        self.take(sample())
        return True

    def take(self, s: ClockSample) -> None:
        """Follow a new sample: a slew moves the mapping, a step is recorded instead."""
        drift = s.offset_ns - self._read_ns
        self._read_ns = s.offset_ns
        if abs(drift) > STEP_NS:
            self.steps.append(ClockStep(s.mono_ns, drift))
            log.warning("the wall clock was stepped %+.3f s; this session's times stay "
                        "continuous with its start (the step is recorded in the session)",
                        drift / 1e9)
        elif abs(drift) > 1_000_000:
            log.info("wall clock moved %.3f ms against monotonic since the last sample",
                     drift / 1e6)
        self.offset_ns += 0 if abs(drift) > STEP_NS else drift
        # Kept as applied, so that what reads clock_samples (fleetd.export.clockfix)
        # interpolates between the offsets the events were really stamped with.
        self.samples.append(ClockSample(s.mono_ns, self.offset_ns, s.error_ns, s.window_ns,
                                        s.synced))

    @property
    def stepped_ns(self) -> int:
        """The steps' sum: how far the wall clock now reads from this session's times."""
        return sum(st.step_ns for st in self.steps)

    def to_wall(self, mono_ns: int) -> int:
        return mono_ns + self.offset_ns

    @property
    def first(self) -> ClockSample:
        return self.samples[0]

    @property
    def error_ns(self) -> int:
        return max(s.error_ns for s in self.samples)

    def as_json(self) -> list[list[int]]:
        """[[mono_ns, offset_ns, error_ns], ...] for session_data.clock_samples."""
        return [[s.mono_ns, s.offset_ns, s.error_ns] for s in self.samples]
