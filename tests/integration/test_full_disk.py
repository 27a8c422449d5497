"""A real `fleetd agent` whose database's file system fills up while it traces (issue 45
point 3): an 8 MiB tmpfs, filled by another file, then the file removed. Meanwhile the
agent answers queries from what it has, counts every row it drops (/metrics, its health
answer, the session record that `fleetd check` reads), prunes its oldest events to write
on inside the file, and writes as before once space returns, by itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import stamped
from agents import agent, metric_value, request

from conftest import FLEETD

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs and traces")


@contextmanager
def small_tmpfs(where: Path, size: str = "8m") -> Iterator[Path]:
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                   check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(path: Path) -> int:
    """Write into ``path`` until the file system refuses (ENOSPC); its size."""
    n = 0
    with path.open("wb", buffering=0) as f:
        chunk = b"\0" * 65536
        while True:
            try:
                n += f.write(chunk)
            except OSError:
                break
        for size in (4096, 512, 1):  # the last partial blocks too
            try:
                while True:
                    n += f.write(b"\0" * size)
            except OSError:
                continue
    return n


def metrics(url: str) -> dict[str, float]:
    text = request(url, None, path="/metrics")[2].decode()
    return {k: metric_value(text, k) for k in (
        "disk_full", "events_dropped_disk_full_total", "events_written_total",
        "events_pruned_total", "events_lost_total")}


def count(url: str) -> int:
    status, body, raw = request(url, None, "POST", "/api/v1/query",
                                json={"sql": "SELECT count(*) FROM event_data"})
    assert status == 200, raw
    return int(body["rows"][0][0])


def wait_for(what: str, cond: object, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(cond) and cond():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def test_full_disk_drops_counted_queries_answered_writing_resumes(tmp_path: Path) -> None:
    with stamped.running(tmp_path / "stamps.bin", 2000, 300) as wl, \
            small_tmpfs(tmp_path / "small") as mnt:
        db = mnt / "node.db"
        with agent(db, "gpu-01", None, "--plain-http", "--pid", str(wl.pid), "--sample",
                   "1", "--no-host", "--cpu-sample-hz", "0") as a:
            wait_for("events stored", lambda: count(a.url) > 1000)
            filler = mnt / "filler"
            filled = fill(filler)
            wait_for("the disk-full gauge", lambda: metrics(a.url)["disk_full"] == 1)
            during = []
            for _ in range(8):  # queries answered while full, from what it has
                during.append(count(a.url))
                time.sleep(0.5)
            full = metrics(a.url)
            health = request(a.url, None)[1]
            filler.unlink()
            wait_for("writing to resume", lambda: metrics(a.url)["disk_full"] == 0)
            resumed = metrics(a.url)
            wait_for("new events written", lambda: metrics(a.url)["events_written_total"]
                     > resumed["events_written_total"] + 2000)
            after = metrics(a.url)
            a.proc.send_signal(signal.SIGTERM)
            assert a.proc.wait(60) == 0
            text = a.log.read_text()
        check = subprocess.run([FLEETD, "check", "--only", "db", "--db", str(db),
                                "--format", "json"], capture_output=True, text=True,
                               timeout=120)
    print("\n".join(ln for ln in text.splitlines() if "prun" in ln or "disk" in ln))
    print(f"\nfiller {filled} bytes; while full: counts {during}, metrics {full}; "
          f"after: {after}")
    assert full["events_dropped_disk_full_total"] > 0
    assert full["events_lost_total"] >= full["events_dropped_disk_full_total"]
    assert full["events_pruned_total"] > 0  # the oldest made room inside the file
    assert health["store"]["disk_full"] and health["store"]["disk_full_dropped"] > 0
    assert after["events_dropped_disk_full_total"] >= full["events_dropped_disk_full_total"]
    assert "Traceback" not in text
    assert "the disk holding" in text and "is full" in text and "has space again" in text
    # Every event the kernel emitted is stored or counted: nothing unreported.
    assert " 0 unreported" in text, text[-2000:]
    report = json.loads(check.stdout)
    sessions = report["checks"][0]["data"]["sessions"]
    assert sessions["write_failed"] >= full["events_dropped_disk_full_total"], sessions
