"""A weeks-long trace meets every task on the node that wakes a target (a peer): the
decoder's and the intake's memos of threads and processes must drop the ones that have
exited, or they grow with every short-lived process the node ever ran. Real processes:
one alive (this one), one started and reaped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_bulk_decode import rec

from fleetd.store.writer import BatchWriter
from fleetd.trace.bpf.decoder import Decoder
from fleetd.trace.config import TraceConfig
from fleetd.trace.intake import Intake, task_gone
from fleetd.trace.targets import Targets


def _reaped_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _records(live: int, dead: int) -> list[bytes]:
    """A call on a thread of each, and a wakeup of each by the other (peers)."""
    return [rec("cudaLaunchKernel", tid=live, pid=live), rec("cudaMalloc", tid=dead, pid=dead),
            rec("wakeup", tid=live, pid=live, peer=dead, peer_pid=dead, comm=b"gone"),
            rec("wakeup", tid=dead, pid=dead, peer=live, peer_pid=live, comm=b"here")]


def test_the_decoder_forgets_exited_tasks_and_reports_a_reused_id_again() -> None:
    live, dead = os.getpid(), _reaped_pid()
    assert task_gone(dead) and not task_gone(live)
    d = Decoder(lambda mono: mono)
    first = d.decode(_records(live, dead))
    assert {t for t, _ in first.new_tids} == {live, dead}
    assert d.forget_gone(task_gone) == 1  # the dead thread, a peer too: one id
    again = d.decode(_records(live, dead))
    # The dead id (as if the kernel gave it to a new thread) is written afresh; the
    # live one is still known.
    assert [t for t, _ in again.new_tids] == [dead]
    assert [t for t, _, _ in again.tasks] == [dead]


def test_the_intake_forgets_the_names_it_gave_exited_processes(tmp_path: Path) -> None:
    live, dead = os.getpid(), _reaped_pid()
    targets = Targets(TraceConfig(tmp_path / "n.db", "n1"), lambda _: None)
    intake = Intake(Decoder(lambda mono: mono), targets)
    with BatchWriter(tmp_path / "n.db", "n1") as w:
        intake.store(intake.decoder.decode(_records(live, dead)), w)
        named = set(intake._proc_comm)
        assert {live, dead} <= named
        assert intake.forget_gone(task_gone) == 2  # its process name and its thread
        assert live in intake._proc_comm and dead not in intake._proc_comm
