"""The pod behind every process, live: the reference workload in a cgroup laid out as
the kubelet's systemd driver lays out a containerd container
(``kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope``, on this machine's v1
``cpu`` controller, with a 250m CPU limit), and containerd's record of that container
(its OCI ``config.json`` with the CRI annotations) where containerd keeps it. Traced
with real BPF: the process row carries the pod, namespace, container and its name;
explain names the victim with its pod, the breakdown has a pod column, ``--pod`` and
``--namespace`` select it, and the timeline names the process with its pod.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from recorder import running, trace_for

from conftest import FLEETD, REPO

pytestmark = [pytest.mark.bpf,
              pytest.mark.skipif(os.geteuid() != 0, reason="cgroups and BPF need root")]

PY = sys.executable
WORKLOAD = REPO / "tests" / "workloads" / "train_loop.py"
CPU_ROOT = Path("/sys/fs/cgroup/cpu")
CONTAINERD = Path("/run/containerd/io.containerd.runtime.v2.task/k8s.io")
STEP = ["--launches", "8", "--memcpy", "1", "--cpu-us", "400", "--gpu-ms", "4"]


@contextmanager
def fake_pod(uid: str, cid: str) -> Iterator[Path]:
    """A cgroup and a containerd record as a pod ml/trainer-0 would have them; every
    directory this made is removed again."""
    if not (CPU_ROOT / "cpu.cfs_quota_us").exists():
        pytest.fail("no cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    parts = ["kubepods.slice", "kubepods-burstable.slice",
             f"kubepods-burstable-pod{uid.replace('-', '_')}.slice",
             f"cri-containerd-{cid}.scope"]
    made: list[Path] = []
    try:
        d = CPU_ROOT
        for p in parts:
            d = d / p
            if not d.exists():
                d.mkdir()
                made.append(d)
        (d / "cpu.cfs_period_us").write_text("100000")
        (d / "cpu.cfs_quota_us").write_text("25000")  # resources.limits.cpu: 250m
        bundle = CONTAINERD / cid
        for p in (*reversed(bundle.parents[:4]), bundle):
            if not p.exists():
                p.mkdir()
                made.append(p)
        (bundle / "config.json").write_text(json.dumps({"ociVersion": "1.1.0", "annotations": {
            "io.kubernetes.cri.container-type": "container",
            "io.kubernetes.cri.container-name": "trainer",
            "io.kubernetes.cri.sandbox-name": "trainer-0",
            "io.kubernetes.cri.sandbox-namespace": "ml",
            "io.kubernetes.cri.sandbox-uid": uid}}))
        yield d
    finally:
        cgroup = next((m for m in made if m.name.endswith(".scope")), None)
        if cgroup is not None:
            for pid in (cgroup / "cgroup.procs").read_text().split():
                (CPU_ROOT / "cgroup.procs").write_text(pid)
        (CONTAINERD / cid / "config.json").unlink(missing_ok=True)
        for m in reversed(made):
            m.rmdir()


def _fleetd(*argv: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([FLEETD, *argv], capture_output=True, text=True, timeout=120)
    assert (r.returncode == 0) == ok, (r.returncode, r.stdout[-2000:], r.stderr)
    return r


def test_the_pod_behind_the_process(tmp_path: Path) -> None:
    uid, cid = str(uuid.uuid4()), uuid.uuid4().hex + uuid.uuid4().hex
    go, db = tmp_path / "go", tmp_path / "t.db"
    with fake_pod(uid, cid) as group, running(
            [PY, str(WORKLOAD), "--duration", "30", "--go-file", str(go), *STEP], cpu=0,
            groups=[group]) as wl:
        trace_for(wl.pid, db, go, "4s")
    pid = wl.pid
    # Stored once per process: the query columns.
    got = json.loads(_fleetd("query", "--db", str(db), "--format", "json",
                             "SELECT pid, runtime, container, container_name, pod, namespace, "
                             f"pod_uid, cgroup FROM processes WHERE pid = {pid}").stdout)
    assert got["rows"] == [[pid, "containerd", cid[:12], "trainer", "trainer-0", "ml", uid,
                            "/" + group.relative_to(CPU_ROOT).as_posix()]]
    # explain: the victim with its pod, the quota's chain naming the pod, a pod column.
    report = json.loads(_fleetd("explain", "--db", str(db), "--format", "json").stdout)
    [ch] = [c for c in report["chains"] if c["root_cause"] == "cpu_throttled"]
    assert {k: ch["victim"].get(k) for k in ("pid", "pod", "namespace", "container")} == \
        {"pid": pid, "pod": "trainer-0", "namespace": "ml", "container": "trainer"}
    # The quota is the pod's: its sample names the pod, and so does the summary.
    assert (ch["detail"]["pod"], ch["detail"]["namespace"], ch["detail"]["container_name"]) \
        == ("trainer-0", "ml", "trainer")
    assert "quota: pod ml/trainer-0 (container trainer) allows 0.25 CPU" in ch["summary"]
    [proc] = [p for p in report["processes"] if p["pid"] == pid]
    assert (proc["pod"], proc["namespace"], proc["pod_uid"]) == ("trainer-0", "ml", uid)
    text = _fleetd("explain", "--db", str(db)).stdout
    assert f"victim:  python pid {pid} tid {pid} (pod ml/trainer-0, container trainer)" \
        in text, text
    assert " pod " in text.split("per-process breakdown", 1)[1] and "ml/trainer-0" in text
    # --pod / --namespace select it; a pod that is not there is a one-line error.
    only = json.loads(_fleetd("explain", "--db", str(db), "--pod", "ml/trainer-0",
                              "--format", "json").stdout)
    assert {p["pid"] for p in only["processes"]} == {pid} and only["chains"]
    assert all(c["victim"]["pid"] == pid for c in only["chains"])
    ops = json.loads(_fleetd("ops", "--db", str(db), "--namespace", "ml", "--format",
                             "json").stdout)
    assert ops["rows"] and {r[ops["columns"].index("pid")] for r in ops["rows"]} == {pid}
    miss = _fleetd("explain", "--db", str(db), "--namespace", "prod", ok=False)
    assert miss.returncode == 2 and "pods recorded here: ml/trainer-0" in miss.stderr
    assert "Traceback" not in miss.stderr
    page = tmp_path / "r.html"
    _fleetd("explain", "--db", str(db), "--format", "html", "-o", str(page))
    assert f"python pid {pid} tid {pid} (pod ml/trainer-0, container trainer)" in \
        page.read_text()
    # The timeline names the process with its pod.
    out = tmp_path / "t.json"
    _fleetd("export", "--db", str(db), "--format", "perfetto", "-o", str(out))
    assert "python (pod ml/trainer-0, container trainer)" in out.read_text()
