"""The pod behind every process: placement from cgroup paths and the container
runtimes' own files (containerd, CRI-O, Docker; cgroupfs and systemd drivers), stored
once per process (schema 5, files of schema 4 still open and merge), shown with
explain's victims and culprits and selected by --pod / --namespace."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from fleetd.analyze.distributed.stragglers import chain_brief
from fleetd.analyze.reading import pods
from fleetd.store import schema
from fleetd.store.db import open_reader, open_writer
from fleetd.store.merge import merge
from fleetd.store.writer import BatchWriter
from fleetd.trace.host import cgroups as cg

REPO = Path(__file__).resolve().parents[2]
CID = "a1b2c3d4" * 8
UID = "5e6f7a8b-1c2d-4e3f-9a0b-c1d2e3f4a5b6"
U_ = UID.replace("-", "_")
# /proc/PID/cgroup as each runtime and cgroup driver leaves it (v1 controllers beside
# v2, as on hybrid nodes; v2 alone as on current ones).
PROC_CGROUP = {
    "containerd-systemd": (
        f"12:cpu,cpuacct:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        f"{U_}.slice/cri-containerd-{CID}.scope\n"
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U_}.slice/"
        f"cri-containerd-{CID}.scope\n", "containerd"),
    "containerd-cgroupfs-v2": (f"0::/kubepods/burstable/pod{UID}/{CID}\n", "kubernetes"),
    "cri-o-systemd-v2": (f"0::/kubepods.slice/kubepods-pod{U_}.slice/crio-{CID}.scope\n",
                         "cri-o"),
    "cri-o-cgroupfs": (f"4:cpu:/kubepods/besteffort/pod{UID}/crio-{CID}\n0::/\n", "cri-o"),
    "docker-systemd": (f"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-"
                       f"pod{U_}.slice/docker-{CID}.scope\n", "docker"),
    "docker-cgroupfs": (f"5:cpu:/kubepods/pod{UID}/{CID}\n0::/\n", "kubernetes"),
}
OCI_CONTAINERD = {"ociVersion": "1.1.0", "annotations": {
    "io.kubernetes.cri.container-type": "container",
    "io.kubernetes.cri.container-name": "trainer",
    "io.kubernetes.cri.sandbox-name": "trainer-0",
    "io.kubernetes.cri.sandbox-namespace": "ml",
    "io.kubernetes.cri.sandbox-uid": UID}}
OCI_CRIO = {"ociVersion": "1.0.2", "annotations": {
    "io.kubernetes.container.name": "trainer", "io.kubernetes.pod.name": "trainer-0",
    "io.kubernetes.pod.namespace": "ml", "io.kubernetes.pod.uid": UID}}
DOCKER = {"ID": CID, "Config": {"Hostname": "trainer-0", "Labels": {
    "io.kubernetes.container.name": "trainer", "io.kubernetes.pod.name": "trainer-0",
    "io.kubernetes.pod.namespace": "ml", "io.kubernetes.pod.uid": UID}}}


def _host(tmp_path: Path, runtime: str) -> Path:
    """A host root with the runtime's record of container CID, where it keeps it."""
    config = {"containerd": OCI_CONTAINERD, "cri-o": OCI_CRIO, "docker": DOCKER}[runtime]
    path = tmp_path / cg.RUNTIME_FILES[runtime][0].format(id=CID).lstrip("/")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("case", sorted(PROC_CGROUP))
def test_pod_and_container_from_the_path_and_the_runtimes_files(
        case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text, runtime = PROC_CGROUP[case]
    monkeypatch.setattr(cg, "read_groups", lambda pid: cg.parse_proc_cgroup(text))
    # The runtime's files: for a cgroupfs path (runtime unknown) whichever one has it.
    files = {"kubernetes": "cri-o" if "crio" in text else "docker"}.get(runtime, runtime)
    place = cg.process_placement(4242, {}, _host(tmp_path, files))
    assert place["runtime"] == runtime and place["container"] == CID[:12], place
    assert (place["pod"], place["namespace"], place["container_name"], place["pod_uid"]) \
        == ("trainer-0", "ml", "trainer", UID), place
    assert place["cgroup"] == cg.cpu_path(cg.parse_proc_cgroup(text)) != "/"


def test_without_the_runtimes_files_the_pod_name_is_the_hostname(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text, _ = PROC_CGROUP["containerd-systemd"]
    monkeypatch.setattr(cg, "read_groups", lambda pid: cg.parse_proc_cgroup(text))
    place = cg.process_placement(4242, {"HOSTNAME": "trainer-0"}, tmp_path)
    assert (place["pod"], place["pod_uid"], place["container_name"]) == \
        ("trainer-0", UID, None)
    assert place["namespace"] is None  # no service-account file at /proc/4242/root


def test_a_host_process_has_its_cgroup_only(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    monkeypatch.setattr(cg, "read_groups",
                        lambda pid: cg.parse_proc_cgroup("0::/user.slice/session-1.scope\n"))
    place = cg.process_placement(1, {"HOSTNAME": "laptop"}, tmp_path)
    assert place["cgroup"] == "/user.slice/session-1.scope"
    assert {k for k, v in place.items() if v is not None} == {"cgroup"}


def test_hostile_runtime_files_are_ignored(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / cg.RUNTIME_FILES["containerd"][0].format(id=CID).lstrip("/")
    path.parent.mkdir(parents=True)
    (tmp_path / "elsewhere.json").write_text(json.dumps(OCI_CONTAINERD))
    path.symlink_to(tmp_path / "elsewhere.json")  # never followed
    assert cg.read_runtime_labels("containerd", CID, tmp_path) == {}
    path.unlink()
    path.write_text("{not json")
    assert cg.read_runtime_labels("containerd", CID, tmp_path) == {}
    monkeypatch.setattr(cg, "RUNTIME_FILE_MAX", 8)
    path.write_text(json.dumps(OCI_CONTAINERD))
    assert cg.read_runtime_labels("containerd", CID, tmp_path) == {}


# ---- stored once per process, shown, selected -----------------------------------------


def test_a_schema_4_recording_opens_merges_and_migrates(tmp_path: Path) -> None:
    old = tmp_path / "quiet.db"
    shutil.copy(REPO / "tests" / "data" / "scenarios" / "quiet.db", old)
    with sqlite3.connect(old) as c:
        assert c.execute("PRAGMA user_version").fetchone() == (4,)
    reader = open_reader(old)  # read as it is: no placement, nothing guessed
    assert pods.columns(reader) == [] and pods.placements(reader) == {}
    reader.close()
    merged = tmp_path / "merged.db"
    merge([old], merged)
    with sqlite3.connect(merged) as c:
        assert c.execute("SELECT count(*), count(pod), count(cgroup) FROM processes"
                         ).fetchone()[1:] == (0, 0)
    conn = open_writer(old)  # a writer migrates it forward, keeping the rows
    assert conn.execute("PRAGMA user_version").fetchone()[0] == schema.SCHEMA_VERSION
    before = conn.execute("SELECT count(*) FROM processes").fetchone()[0]
    conn.close()
    pid = 777_001
    with BatchWriter(old, "trace-host") as w:
        w.add_processes([{"pid": pid, "comm": "python", "cgroup": "/kubepods/x",
                          "runtime": "containerd", "container": CID[:12],
                          "container_name": "trainer", "pod": "trainer-0", "namespace": "ml",
                          "pod_uid": UID}])
        w.add_processes([{"pid": pid, "pod": None}])  # a later row never blanks it
    conn = open_reader(old)
    assert conn.execute("SELECT count(*) FROM processes").fetchone()[0] == before + 1
    assert pods.select(conn, "ml/trainer-0", None) == {pid}
    assert pods.select(conn, None, "ml") == {pid} and pods.select(conn, "x", None) == set()
    assert pods.known_pods(conn) == ["ml/trainer-0"]
    [(key, got)] = pods.placements(conn).items()
    assert key[1] == pid and got["pod"] == "trainer-0"
    conn.close()
    row = {"pid": pid, "comm": "python", **pods.fields(got)}
    assert pods.label(row) == " (pod ml/trainer-0, container trainer)"
    brief = chain_brief({"root_cause": "cpu_throttled", "severity": "HIGH", "victim": row,
                         "culprit": None})
    assert brief == f"cpu_throttled (HIGH) in pid {pid} (pod ml/trainer-0, container trainer)"


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups and namespaces need root")
def test_an_agent_in_a_cgroup_namespace_of_its_own_reads_the_hosts_paths() -> None:
    """As a containerized agent on cgroup v2 is: in a cgroup namespace rooted at its
    own cgroup, it sees a workload's cgroup as ``/../<name>``; read_groups joins the
    host's namespace first and gets the path the host's /sys/fs/cgroup has."""
    root = Path("/sys/fs/cgroup/cpu")
    if not (root / "cgroup.procs").exists():
        pytest.fail("no cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    tag = uuid.uuid4().hex[:8]
    work, agent = root / f"fleetd-test-work-{tag}", root / f"fleetd-test-agent-{tag}"
    work.mkdir()
    agent.mkdir()
    sleeper = None
    try:
        sleeper = subprocess.Popen(
            ["sleep", "60"], preexec_fn=lambda: (work / "cgroup.procs").write_text(
                str(os.getpid())))
        # This sandbox's pid 1 is not ours to open: the host's namespace is this
        # test's own (a DaemonSet agent's HOST_PID 1 is the node's init).
        code = ("import json, sys; from fleetd.trace.host import cgroups as cg; "
                "cg.HOST_PID = int(sys.argv[2]); "
                "raw = open(f'/proc/{sys.argv[1]}/cgroup').read(); "
                "print(json.dumps([raw, cg.read_groups(int(sys.argv[1]))]))")
        r = subprocess.run(
            ["unshare", "--cgroup", sys.executable, "-c", code, str(sleeper.pid),
             str(os.getpid())],
            capture_output=True, text=True, timeout=60,
            preexec_fn=lambda: (agent / "cgroup.procs").write_text(str(os.getpid())))
        assert r.returncode == 0, r.stderr
        raw, groups = json.loads(r.stdout)
        assert f":cpu:/../{work.name}\n" in raw, raw  # what the namespace shows
        assert groups["cpu"] == f"/{work.name}", groups  # what the host's files are named
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
        for d in (work, agent):
            for pid in (d / "cgroup.procs").read_text().split():
                (root / "cgroup.procs").write_text(pid)
            d.rmdir()


def test_the_daemonset_lets_the_agent_see_other_pods() -> None:
    """hostPID, --all, the host's cgroup tree read-only where the samplers read it, and
    the runtime's container records where process_placement looks for them."""
    yaml = pytest.importorskip("yaml")
    docs = list(yaml.safe_load_all((REPO / "configs" / "daemonset.yaml").read_text()))
    [ds] = [d for d in docs if d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert pod["hostPID"] is True and "--all" in c["args"]
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["mountPath"]: (host.get(m["name"]), m.get("readOnly", False))
              for m in c["volumeMounts"]}
    assert mounts[str(cg.CGROUP_ROOT)] == (str(cg.CGROUP_ROOT), True)
    record = cg.RUNTIME_FILES["containerd"][0]
    [(path, (source, ro))] = [(p, m) for p, m in mounts.items() if record.startswith(p + "/")]
    assert source == path and ro


def test_a_straggler_rank_is_named_with_its_pod() -> None:
    """The fleet view's straggler line names the rank's pod, from the process rows
    every node's report carries."""
    import io

    from fleetd.cli.explain_render import render_fleet

    proc = {"node": "gpu-3", "pid": 4242, "comm": "python", "pod": "trainer-2",
            "namespace": "ml", "container": "trainer", "threads": []}
    report = {"window": {"label": "whole recording"}, "nodes": ["gpu-1", "gpu-3"],
              "chains": [], "processes": [proc],
              "stragglers": [{"node": "gpu-3", "rank": 2, "pid": 4242, "comm": "python",
                              "flagged": True, "metric": "collective_arrival", "score": 0.1,
                              "share_last": 0.9, "judged": 100, "lateness_p50_ns": 5_000_000,
                              "reason": "rank 2 arrived last", "peers": []}]}
    out = io.StringIO()
    render_fleet(report, out)
    assert ("STRAGGLER rank 2 on gpu-3, pid 4242 (python) (pod ml/trainer-2, container "
            "trainer): last in 90%") in out.getvalue(), out.getvalue()


def test_check_says_when_pods_cannot_be_named(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    from fleetd.trace.host import podcheck

    # The records' directories, found where each runtime keeps them.
    d = tmp_path / "run/containerd/io.containerd.runtime.v2.task/k8s.io"
    d.mkdir(parents=True)
    assert podcheck.runtime_dirs(tmp_path) == {"containerd": str(d)}
    monkeypatch.setattr(podcheck, "_cgroup_namespace", lambda: (True, True))
    monkeypatch.setattr(podcheck, "_pods_here", lambda proc=None: 3)
    monkeypatch.setattr(podcheck, "runtime_dirs", lambda host=None: {})
    c = podcheck.containers_check()
    assert c.status == "warn" and "3 process(es) in Kubernetes pods" in c.detail
    assert "/run/containerd" in c.fix
    monkeypatch.setattr(podcheck, "runtime_dirs", lambda host=None: {"containerd": str(d)})
    assert podcheck.containers_check().status == "ok"
    monkeypatch.setattr(podcheck, "_cgroup_namespace", lambda: (False, False))
    c = podcheck.containers_check()
    assert c.status == "warn" and "hostPID" in c.fix
