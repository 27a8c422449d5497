"""The tracer options ``fleetd trace`` and ``fleetd agent`` share: on-CPU sampling
(``--cpu-sample-hz``) and how kernel launches are probed (``--mode``,
``--launch-returns``)."""

from __future__ import annotations

import argparse

from fleetd.errors import UsageError

CPU_SAMPLE_HZ = 49  # fleetd.trace.enrich.oncpu.DEFAULT_HZ (not imported: client installs)


def add_cpu_sample_arg(p: argparse.ArgumentParser) -> None:
    """--cpu-sample-hz, shared by trace and agent."""
    p.add_argument("--cpu-sample-hz", type=int, default=CPU_SAMPLE_HZ, metavar="N",
                   help="on-CPU samples of the traced threads per second per CPU, with "
                   "native and Python stacks and garbage-collection state (fleetd "
                   f"profile; default {CPU_SAMPLE_HZ}, 0: off)")


def add_launch_returns_arg(p: argparse.ArgumentParser) -> None:
    """--launch-returns / --no-launch-returns and --mode, shared by trace and agent."""
    from fleetd.trace.bpf.modes import LAUNCH_RETURNS

    p.add_argument("--mode", choices=("full", "always-on"), default="full",
                   help="full (default): every probe all the time; always-on: kernel "
                   "launches and async copies traced at entry 1 s of every 10 s, their "
                   "statistics scaled (marked duty_cycle), everything else continuous "
                   "(docs/performance.md)")

    p.add_argument("--launch-returns", action=argparse.BooleanOptionalAction,
                   default=LAUNCH_RETURNS,
                   help="a return probe on every kernel launch and async copy: every "
                   "launch's duration and return code (default: "
                   f"{'on' if LAUNCH_RETURNS else 'off'}). Off: launches are traced at "
                   "entry (Linux 6.13+), counted exactly, with the durations of the 1-in-N "
                   "sample and failures from the first sampled one on, at about half the "
                   "cost per launch (docs/performance.md)")


def cpu_sample_hz(n: int) -> int:
    """The sampling rate, checked: 0 (off) to 1000 per second."""
    if not 0 <= n <= 1000:
        raise UsageError(f"--cpu-sample-hz {n} is out of range",
                         f"use 0 (off) to 1000; {CPU_SAMPLE_HZ} costs well under 1% of a CPU")
    return n
