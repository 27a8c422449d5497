"""A container's files are read inside the container, never blocking, never unbounded.

Each workload runs chrooted in a private mount namespace (``unshare -m`` + ``chroot``,
the host's /usr, /root, /work and /dev bound in so the reference workload and its CUDA
runtime load), in a cgroup laid out as the kubelet's systemd driver lays out a
containerd container (``kubepods-pod<uid>.slice/cri-containerd-<id>.scope``) with no
runtime record, so the agent takes the pod's namespace from the process's own
service-account file. That file is what the container controls: a link to a 0600 host
file (absolute, and ``../`` climbing out), a FIFO, a link to /dev/zero, a 10 MB file,
and, beside them, an honest ``ml``; each hostile pod's HOSTNAME (its pod name) is
100 kB. One real ``fleetd trace`` of all six must reach tracing and finish in bounded
time and memory, store the honest namespace and name, cut the long names to their cap,
and store the host secret nowhere.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from recorder import start_in, wait_for_libcudart

from fleetd.store import caps

from conftest import FLEETD, REPO

pytestmark = [pytest.mark.bpf,
              pytest.mark.skipif(os.geteuid() != 0, reason="namespaces, cgroups and BPF "
                                 "need root")]

PY = sys.executable
WORKLOAD = REPO / "tests" / "workloads" / "train_loop.py"
CPU_ROOT = Path("/sys/fs/cgroup/cpu")
SA_DIR = "var/run/secrets/kubernetes.io/serviceaccount"
STEP = ["--launches", "4", "--memcpy", "1", "--cpu-us", "200", "--gpu-ms", "2"]
# The host trees the workload needs inside its root (bound, read as they are): the
# system, the interpreter (pyenv under /root), this checkout and its virtual environment.
BINDS = tuple(sorted({"/usr", "/etc", "/root", "/dev", str(REPO),
                      os.path.realpath(sys.prefix)}))
HONEST_NAME = "trainer-0"
TRACE_LIMIT_S = 150.0  # start (BPF compile on a loaded machine) to exit, at most
RSS_LIMIT = 1 << 30  # a tracer past this is reading something without end: stopped


@contextmanager
def pod_cgroup(uid: str, cid: str) -> Iterator[Path]:
    """A Guaranteed pod's containerd cgroup on the v1 cpu controller, without the
    runtime's record of the container (so its namespace is the process's to tell);
    removed again after, its processes moved back to the root."""
    if not (CPU_ROOT / "cpu.cfs_quota_us").exists():
        pytest.fail("no cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    parts = ["kubepods.slice", f"kubepods-pod{uid.replace('-', '_')}.slice",
             f"cri-containerd-{cid}.scope"]
    made: list[Path] = []
    d = CPU_ROOT
    try:
        for p in parts:
            d = d / p
            if not d.exists():
                d.mkdir()
                made.append(d)
        yield d
    finally:
        if d.exists():
            for pid in (d / "cgroup.procs").read_text().split():
                (CPU_ROOT / "cgroup.procs").write_text(pid)
        for m in reversed(made):
            m.rmdir()


def container_root(root: Path, namespace: Callable[[Path], None]) -> Path:
    """A root tree with mount points for :data:`BINDS`, the host's top-level links
    (/bin -> usr/bin, ...) as they are, and a service-account file ``namespace`` makes."""
    for name in (*BINDS, "/tmp", "/proc"):
        (root / name.lstrip("/")).mkdir(parents=True, exist_ok=True)
    for top in Path("/").iterdir():
        if top.is_symlink() and str(top) not in BINDS:
            (root / top.name).symlink_to(os.readlink(top))
    (root / SA_DIR).mkdir(parents=True)
    namespace(root / SA_DIR / "namespace")
    return root


def chrooted(root: Path, hostname: str) -> list[str]:
    """The reference workload chrooted in ``root``, in a mount namespace of its own (the
    binds are its alone and go with it), its HOSTNAME (its pod's name) ``hostname``; it
    waits for ``/go`` inside its root."""
    binds = " && ".join(f"mount --rbind {b} {root}{b}" for b in BINDS)
    script = (f"mount --make-rprivate / && {binds} && HOSTNAME={hostname} exec chroot "
              f"{root} {PY} {WORKLOAD} --duration 60 --go-file /go {' '.join(STEP)}")
    return ["unshare", "-m", "--", "sh", "-c", script]


@dataclass
class Run:
    """What one bounded ``fleetd trace`` did."""

    tracing_after_s: float | None = None  # when it said "fleetd: tracing"; None: never
    exit_code: int | None = None  # None: it had to be killed (hung, or over RSS_LIMIT)
    seconds: float = 0.0
    peak_rss: int = 0  # bytes, the kernel's high-water mark (VmHWM), last seen
    stderr: list[str] = field(default_factory=list)


def _hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def trace_bounded(pids: list[int], db: Path, go: list[Path], duration: str) -> Run:
    """``fleetd trace`` of ``pids``, each ``go`` touched once it traces; killed when it
    passes TRACE_LIMIT_S or RSS_LIMIT, so a hang or a runaway read is a finding, not
    a stuck test or a machine out of memory."""
    argv = [FLEETD, "trace", "--db", str(db), "--duration", duration, "--sample", "1"]
    for p in pids:
        argv += ["--pid", str(p)]
    run, t0 = Run(), time.monotonic()
    tr = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    assert tr.stderr is not None
    stream = tr.stderr

    def read() -> None:
        for line in stream:
            run.stderr.append(line)
            if line.startswith("fleetd: tracing") and run.tracing_after_s is None:
                run.tracing_after_s = time.monotonic() - t0
                for g in go:
                    g.touch()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while tr.poll() is None:
        run.peak_rss = max(run.peak_rss, _hwm(tr.pid))
        if time.monotonic() - t0 > TRACE_LIMIT_S or run.peak_rss > RSS_LIMIT:
            tr.kill()
            tr.wait()
            break
        time.sleep(0.05)
    else:
        run.exit_code = tr.returncode
    run.seconds = time.monotonic() - t0
    reader.join(5)
    return run


def _secret_file(tmp: Path) -> tuple[Path, str]:
    value = "hostsecret-" + secrets.token_hex(12)
    path = tmp / "node-key"
    path.write_text(value + "\n")
    path.chmod(0o600)
    return path, value


def _cases(secret: Path) -> dict[str, Callable[[Path], None]]:
    """The service-account file each container holds, by what it is."""
    def absolute(p: Path) -> None:
        p.symlink_to(secret)

    def climbing(p: Path) -> None:
        p.symlink_to("../" * (len(p.parts) + 4) + str(secret).lstrip("/"))

    def fifo(p: Path) -> None:
        os.mkfifo(p)

    def zero(p: Path) -> None:
        p.symlink_to("/dev/zero")

    def huge(p: Path) -> None:
        p.write_bytes(b"a" * (10 << 20))

    def honest(p: Path) -> None:
        p.write_text("ml\n")

    return {"absolute-link": absolute, "climbing-link": climbing, "fifo": fifo,
            "dev-zero": zero, "10MB": huge, "honest": honest}


@dataclass
class Pod:
    case: str
    uid: str
    root: Path
    process: subprocess.Popen[str]


def start_pods(stack: ExitStack, tmp: Path, cases: dict[str, Callable[[Path], None]]
               ) -> list[Pod]:
    pods: list[Pod] = []
    for i, (case, make) in enumerate(cases.items()):
        uid, cid = str(uuid.uuid4()), secrets.token_hex(32)
        group = stack.enter_context(pod_cgroup(uid, cid))
        root = container_root(tmp / f"c{i}", make)
        # The honest pod is named as the kubelet names one; the others 100 kB long.
        name = HONEST_NAME if case == "honest" else "h" * 100_000
        wl = start_in([group], chrooted(root, name), cpu=i % (os.cpu_count() or 1))
        stack.callback(_stop, wl)
        pods.append(Pod(case, uid, root, wl))
    for pod in pods:
        wait_for_libcudart(pod.process.pid, timeout=60)
    return pods


def _stop(p: subprocess.Popen[str]) -> None:
    p.kill()
    p.wait(10)


def _query(db: Path, sql: str) -> list[list[object]]:
    r = subprocess.run([FLEETD, "query", "--db", str(db), "--format", "json", sql],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows: list[list[object]] = json.loads(r.stdout)["rows"]
    return rows


def _stored_bytes(db: Path) -> bytes:
    return b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*"))


def test_a_container_cannot_steer_the_agents_reads(tmp_path: Path) -> None:
    secret, value = _secret_file(tmp_path)
    db = tmp_path / "t.db"
    with ExitStack() as stack:
        pods = start_pods(stack, tmp_path, _cases(secret))
        run = trace_bounded([p.process.pid for p in pods], db, [p.root / "go" for p in pods],
                            "4s")
    said = "".join(run.stderr)[-3000:]
    assert run.tracing_after_s is not None, f"never reached tracing: {said}"
    assert run.exit_code == 0, (run, said)
    assert run.seconds < TRACE_LIMIT_S
    # Reading the service-account files costs nothing: the tracer's peak stays where
    # BPF compilation puts it, nowhere near the 10 MB file or /dev/zero's stream.
    assert run.peak_rss < 768 << 20, run.peak_rss
    got = {str(uid): (ns, name) for uid, ns, name in _query(
        db, "SELECT pod_uid, namespace, pod FROM processes WHERE pod_uid IS NOT NULL")}
    by_case = {p.case: got.get(p.uid, ("absent", ""))[0] for p in pods}
    assert by_case == {"absolute-link": None, "climbing-link": None, "fifo": None,
                       "dev-zero": None, "10MB": None, "honest": "ml"}, by_case
    # The pod's name (its HOSTNAME) is the process's too: stored cut to its cap.
    names = {p.case: got[p.uid][1] for p in pods}
    assert names.pop("honest") == HONEST_NAME
    assert {len(str(n)) for n in names.values()} == {caps.CAPS["pod"]}, names
    assert value.encode() not in _stored_bytes(db)
    # What the node serves of its pods (the answer of GET /api/v1/pods) and explain.
    answers = {}
    for cmd in ("pods", "explain"):
        r = subprocess.run([FLEETD, cmd, "--db", str(db), "--format", "json"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (cmd, r.stderr)
        answers[cmd] = r.stdout
    assert value not in "".join(answers.values()) and '"ml"' in answers["pods"]
    # The skipped files are named on stderr, once each, by what they were.
    assert "not a regular file (a FIFO)" in said and "a character device" in said, said
