"""The test bed itself: isolated addresses, CPU slices with quotas, and a teardown that
leaves nothing behind even when the test using it fails."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import build_db
from netbed import SUBNET, NetBed, netbed, why_unavailable

_WHY = why_unavailable()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_bed_is_isolated_sliced_and_fully_torn_down_on_failure(tmp_path: Path) -> None:
    seen: dict[str, object] = {}
    with pytest.raises(RuntimeError, match="the test failed"), netbed(tmp_path, 2) as bed:
        h0, h1 = bed.hosts
        seen["namespaces"] = set(bed.namespaces)
        seen["slices"] = [h.slice for h in bed.hosts]
        assert set(bed.namespaces) <= _namespaces()
        # The root namespace gets no address of the bed's range.
        root = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        assert f"{SUBNET}." not in root
        # Each slice has its quota.
        assert bed.slices is not None and h0.slice is not None
        if bed.slices.v2:
            assert (h0.slice / "cpu.max").read_text().split()[0] == str(int(0.25 * 100_000))
        else:
            assert (h0.slice / "cpu.cfs_quota_us").read_text().strip() == "25000"
        # Hosts reach one another and the client reaches them, over the bridge.
        bed.start_agent(h1, db=build_db(tmp_path / "h1.db", node=h1.name))
        bed.wait_agents([h1])
        probe = bed.spawn(h0, ["python3", "-c", f"import socket; socket.create_connection("
                               f"('{h1.address}', 7600), timeout=5).close()"])
        assert probe.wait(10) == 0
        proc = bed.client("query", "--nodes", h1.endpoint, *bed.client_tls_args(),
                          "SELECT count(*) AS n FROM events")
        assert proc.returncode == 0 and "400" in proc.stdout, proc.stderr
        # A workload-slice process runs in its cgroup, on the slice CPUs.
        hog = bed.start_hog(h0)
        time.sleep(0.3)
        assert str(hog.pid) in (h0.slice / "cgroup.procs").read_text()
        seen["procs"] = [hog, *h1.procs]
        raise RuntimeError("the test failed")
    assert not (seen["namespaces"] & _namespaces())  # type: ignore[operator]
    assert not any(p.exists() for p in seen["slices"])  # type: ignore[attr-defined]
    assert all(p.poll() is not None for p in seen["procs"])  # type: ignore[attr-defined]


def test_the_fixture_hands_out_beds_and_a_second_close_is_harmless(
        netbed_factory: Callable[..., NetBed]) -> None:
    bed = netbed_factory(1, quota=0.5)
    names = set(bed.namespaces)
    assert names <= _namespaces() and len(names) == 3  # hub, client, one host
    bed.close()
    bed.close()  # the fixture closes it once more at teardown
    assert not (names & _namespaces())
