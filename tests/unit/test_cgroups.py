"""Container and pod identity from cgroup paths as the runtimes write them, and CPU
limits from a real cgroup on this machine."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
from chroot_proc import chrooted

from fleetd.trace.host import cgroups as cg

CID = "3f2b8c9d" * 8
UID = "9d0a6a4e-5b1c-4f0e-8e2a-1c2d3e4f5a6b"


@pytest.mark.parametrize(("path", "runtime", "pod", "qos"), [
    # containerd, cgroupfs driver
    (f"/kubepods/burstable/pod{UID}/{CID}", "kubernetes", UID, "burstable"),
    # containerd, systemd driver
    (f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
     f"{UID.replace('-', '_')}.slice/cri-containerd-{CID}.scope", "containerd", UID,
     "burstable"),
    # CRI-O, systemd driver, a Guaranteed pod (no QoS level in the path)
    (f"/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope",
     "cri-o", UID, "guaranteed"),
    # BestEffort, cgroupfs
    (f"/kubepods/besteffort/pod{UID}/{CID}", "kubernetes", UID, "besteffort"),
    # Docker alone, cgroupfs and systemd drivers
    (f"/docker/{CID}", "docker", None, None),
    (f"/system.slice/docker-{CID}.scope", "docker", None, None),
])
def test_container_and_pod_from_the_path(path: str, runtime: str, pod: str | None,
                                         qos: str | None) -> None:
    p = cg.placement_of_path(path)
    assert (p.runtime, p.container_id, p.pod_uid, p.qos) == (runtime, CID, pod, qos)


def test_a_host_process_has_no_container() -> None:
    p = cg.placement_of_path("/user.slice/user-0.slice/session-1.scope")
    assert (p.runtime, p.container_id, p.pod_uid) == (None, None, None)


def test_proc_cgroup_v1_beside_v2() -> None:
    text = ("9:name=systemd:/\n4:memory:/process_api/x\n1:cpu:/fleetd/job\n"
            "2:cpu,cpuacct:/ignored\n0::/unified\n")
    groups = cg.parse_proc_cgroup(text)
    assert groups["memory"] == "/process_api/x" and groups[""] == "/unified"
    assert groups["systemd"] == "/"
    assert cg.cpu_path({"cpu": "/a", "": "/b"}) == "/a" and cg.cpu_path({"": "/b"}) == "/b"


def test_cpu_max_and_stat_parse() -> None:
    assert cg.parse_cpu_max("max 100000\n") == (None, 100000)
    assert cg.parse_cpu_max("25000 100000\n") == (25000, 100000)
    stat = cg.parse_cpu_stat("nr_periods 10\nnr_throttled 7\nthrottled_usec 1200\n")
    assert stat == {"nr_periods": 10, "nr_throttled": 7, "throttled_usec": 1200}


@pytest.mark.skipif(os.geteuid() != 0, reason="creates a cgroup: needs root")
def test_a_real_quota_is_read_from_the_cpu_controller() -> None:
    """A v1 cpu cgroup with a 25% quota (a Kubernetes 250m limit), made here."""
    root = cg.CGROUP_ROOT / "cpu"
    if not (root / "cpu.cfs_quota_us").exists():
        pytest.fail("no v1 cpu controller at /sys/fs/cgroup/cpu on this machine")
    name = f"fleetd-test-{uuid.uuid4().hex[:8]}"
    d = root / name
    d.mkdir()
    try:
        (d / "cpu.cfs_period_us").write_text("100000")
        (d / "cpu.cfs_quota_us").write_text("25000")
        limit = cg.cpu_limit({"cpu": f"/{name}"})
        assert limit is not None and limit.quota_us == 25000 and limit.period_us == 100000
        assert limit.cpus == 0.25
        unlimited = cg.cpu_limit({"cpu": "/"})
        assert unlimited is not None and unlimited.quota_us is None
    finally:
        Path(d).rmdir()


@pytest.mark.skipif(os.geteuid() != 0, reason="chroot needs root")
@pytest.mark.parametrize(("content", "namespace"), [
    (b"ml\n", "ml"),
    (b"team-a", "team-a"),
    (b"a" * 63, "a" * 63),
    (b"a" * 64, None),  # longer than a DNS label
    (b"a" * (10 << 20), None),  # a 10 MB file: 64 bytes read, not a namespace
    (b"Not_A_Namespace\n", None),
    (b"ml\n\x1b]0;owned\x07", None),
    (b"", None),
])
def test_the_namespace_file_is_a_namespace_or_nothing(tmp_path: Path, content: bytes,
                                                       namespace: str | None) -> None:
    """Read inside a real chrooted process's root: its service-account file is its pod's
    namespace only when it is one."""
    sa = tmp_path / cg.SA_NAMESPACE
    sa.parent.mkdir(parents=True)
    sa.write_bytes(content)
    with chrooted(tmp_path) as pid:
        assert cg.pod_name_and_namespace(pid, {"HOSTNAME": "trainer-0"}) == \
            ("trainer-0", namespace)


@pytest.mark.skipif(os.geteuid() != 0, reason="chroot needs root")
def test_a_namespace_link_to_a_host_file_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("hostsecret\n")
    root = tmp_path / "root"
    sa = root / cg.SA_NAMESPACE
    sa.parent.mkdir(parents=True)
    sa.symlink_to(secret)
    with chrooted(root) as pid:
        assert cg.pod_name_and_namespace(pid, {}) == (None, None)
