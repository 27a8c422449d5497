"""I/O by ownership, recorded live (issue #42.1): a feeding thread reading its own
mmapped dataset through page faults (tests/workloads/own_faults.py: a real file on this
machine's disk, dropped from the page cache, every read a major fault) while a
neighbour process (``disk-reader``) reads another file of the same disk with O_DIRECT,
16 MiB at a time (one read keeps the disk busy however little CPU it gets: the
waits stay long enough to be stalls on a busy node too).

The victim's waits are its own I/O: ``block_io`` charged to itself first, the neighbour
only for the time the victim's requests sat queued behind its requests; the kernel's
block workers (``kworker/N:MH``) that dispatch and complete requests are never
culprits, and no ``lock_wait`` chain blames them.
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

OWN_FAULTS = REPO / "tests" / "workloads" / "own_faults.py"
SECONDS = 4.0
DISK = Path("/var/tmp")  # a disk, never tmpfs: the files stay between runs (256 MiB each)


def record_own_faults(tmp: Path, *args: str) -> tuple[dict[str, Any], dict[str, Any]]:
    # The first run writes the two files: up to two minutes before it maps libcudart.
    return run_traced(OWN_FAULTS, tmp, SECONDS, "--dir", str(DISK), *args, start_s=120)


def _io_chains(report: dict[str, Any], pid: int) -> list[dict[str, Any]]:
    return [c for c in report["chains"] if c["victim"]["pid"] == pid
            and c["root_cause"] in ("block_io", "lock_wait")]


def _completes_io(comm: str) -> bool:
    """The block layer's high-priority workers (kworker/1:1H), IRQ threads, softirqs:
    they dispatch and complete everyone's requests. (A writeback worker, kworker/u8:4-
    flush-254:0, issues requests of its own and may be charged for queueing.)"""
    return comm.startswith(("irq/", "ksoftirqd/")) or (
        comm.startswith("kworker/") and comm.endswith("H"))


def _no_kernel_worker_culprit(report: dict[str, Any]) -> None:
    """Of an I/O wait (a kernel worker that took the CPU is cpu_contention's, rightly)."""
    for c in report["chains"]:
        if c["root_cause"] not in ("block_io", "lock_wait"):
            continue
        for k in c["culprits"]:
            assert not _completes_io(str(k["comm"])), (c["root_cause"], c["summary"])


def test_own_page_faults_beside_a_disk_neighbour_are_the_victims_io(tmp_path: Path) -> None:
    report, run = record_own_faults(tmp_path, "--neighbour", "read", "--random",
                                    "--chunk-mb", "16")
    chains = _io_chains(report, run["pid"])
    assert [c["root_cause"] for c in chains] == ["block_io"], [c["summary"] for c in chains]
    [c] = chains
    assert c["severity"] in ("HIGH", "MEDIUM"), c["summary"]
    top = c["culprits"][0]
    assert top["pid"] == run["pid"] and top["self"] is True, c["culprits"]
    # The neighbour is charged only the time the victim's requests queued behind its
    # own: a minority of the wait, never the first culprit.
    for k in c["culprits"][1:]:
        if k["pid"] == run["neighbour_pid"]:
            assert k["share"] < top["share"]
    _no_kernel_worker_culprit(report)
    assert any("of its own" in e["text"] for e in c["evidence"] if e["kind"] == "off_cpu")


def test_own_page_faults_alone_are_the_victims_io(tmp_path: Path) -> None:
    report, run = record_own_faults(tmp_path, "--neighbour", "none", "--random")
    chains = _io_chains(report, run["pid"])
    assert all(c["root_cause"] == "block_io" for c in chains), [c["summary"] for c in chains]
    for c in chains:
        assert c["culprits"][0]["pid"] == run["pid"], c["culprits"]
    _no_kernel_worker_culprit(report)


def test_a_read_wait_names_its_file(tmp_path: Path) -> None:
    """Reads through an fd: the evidence names the file the thread waited on."""
    report, run = record_own_faults(tmp_path, "--access", "read", "--random",
                                    "--neighbour", "read", "--chunk-mb", "16")
    [c] = [c for c in _io_chains(report, run["pid"]) if c["root_cause"] == "block_io"]
    assert c["culprits"][0]["pid"] == run["pid"]
    files = {e.get("file") for e in c["evidence"] if e["kind"] == "off_cpu"}
    assert run["dataset"] in files, [e["text"] for e in c["evidence"]]
    assert any(f"on {run['dataset']} for" in e["text"] for e in c["evidence"])
