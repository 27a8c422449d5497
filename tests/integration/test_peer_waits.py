"""Blocked on a peer, recorded live (issue #42.2): a training loop printing every step
to stdout piped to a slow log shipper (tests/workloads/log_pipe.py, a real pipe and a
real reader process) is ``pipe_blocked``, naming the pipe by inode and the shipper by
pid; with a shipper that keeps up there is no such chain.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from workload_run import run_traced

from conftest import REPO

pytestmark = [pytest.mark.bpf, pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="records with eBPF: needs root")]

LOG_PIPE = REPO / "tests" / "workloads" / "log_pipe.py"
SECONDS = 4.0


def record_log_pipe(tmp: Path, *args: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """log_pipe.py with ``args`` under ``fleetd trace``: explain's report and the
    workload's own summary."""
    return run_traced(LOG_PIPE, tmp, SECONDS, *args)


def test_writes_to_a_full_log_pipe_name_the_pipe_and_its_reader(tmp_path: Path) -> None:
    # 4 KiB every 0.2 s against 1 KB lines: the loop outwrites the shipper even when it
    # gets a quarter of a CPU on a busy node.
    report, run = record_log_pipe(tmp_path, "--reader-delay", "0.2", "--line-bytes", "1000",
                                  "--pipe-size", "4096")
    chains = [c for c in report["chains"] if c["root_cause"] == "pipe_blocked"]
    assert len(chains) == 1, [c["summary"] for c in report["chains"]]
    c = chains[0]
    assert c["severity"] == "HIGH" and not report["quiet"], c["summary"]
    assert c["victim"]["pid"] == run["pid"]
    d = c["detail"]
    assert d["fd"] == 1 and d["kind"] == "pipe"
    assert d["object"] == run["stdout"]
    assert {"pid": run["shipper_pid"], "comm": "log-shipper"} in d["readers"]
    assert c["culprit"]["pid"] == run["shipper_pid"] and c["culprit"]["comm"] == "log-shipper"
    assert run["stdout"] in c["summary"] and "log-shipper" in c["summary"]
    # The chain's share is the thread's time asleep in those writes: about what the loop
    # measured around its prints (the prints also run and queue for the CPU).
    assert 0.05 < c["impact"] <= run["printing_s"] / SECONDS + 0.05, (c["impact"], run)
    assert any("F_SETPIPE_SZ" in f for f in c["fixes"])
    assert any("file" in f for f in c["fixes"])


def test_a_shipper_that_keeps_up_blocks_nothing(tmp_path: Path) -> None:
    report, run = record_log_pipe(tmp_path, "--reader-delay", "0")
    blocked = [c for c in report["chains"] if c["root_cause"] == "pipe_blocked"
               and c["severity"] != "LOW"]
    assert blocked == [], [c["summary"] for c in blocked]


@pytest.mark.parametrize("sink", ["socket", "pty"])
def test_a_slow_collector_socket_or_terminal_is_named(tmp_path: Path, sink: str) -> None:
    """The same rule for a remote collector's socket (its address) and an SSH-like
    terminal (the pseudo-terminal's path), with the fixes that fit each."""
    report, run = record_log_pipe(tmp_path, "--sink", sink, "--reader-delay", "0.2",
                                  "--line-bytes", "1000")
    chains = [c for c in report["chains"] if c["root_cause"] == "pipe_blocked"]
    assert len(chains) == 1, [c["summary"] for c in report["chains"]]
    c = chains[0]
    assert c["severity"] in ("HIGH", "MEDIUM") and c["detail"]["fd"] == 1, c["summary"]
    if sink == "socket":
        assert c["detail"]["kind"] == "socket"
        assert run["stdout"] == f"socket to {c['detail']['remote']}"
        assert c["detail"]["remote"] in c["summary"]
        assert any("collector" in f for f in c["fixes"])
    else:
        assert c["detail"]["kind"] == "tty" and c["detail"]["object"] == run["stdout"]
        assert "a terminal" in c["summary"]
        assert any("tmux" in f for f in c["fixes"])
