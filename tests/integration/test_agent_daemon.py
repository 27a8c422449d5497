"""The agent as systemd and Kubernetes run it: the notify protocol for real (READY=1 after
the listening line and the tracer's start, STOPPING=1 on SIGTERM, logged at INFO), the
unit through ``systemd-analyze verify``, and the DaemonSet, the Dockerfile and the
example config checked against each other."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from agents import LISTEN_RE, Pki, agent

from fleetd import __version__
from fleetd.config import load_config

from conftest import FLEETD, REPO, build_db

CONFIGS = REPO / "configs"
UNIT = CONFIGS / "fleetd-agent.service"
DAEMONSET = CONFIGS / "daemonset.yaml"
DOCKERFILE = REPO / "Dockerfile"


# ---- sd_notify --------------------------------------------------------------------------


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[
        tuple[socket.socket, str]]:
    """A unix datagram socket like systemd's, and the $NOTIFY_SOCKET that names it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        name = str(tmp_path / "notify")
        sock.bind(name)
    else:  # the abstract namespace, as systemd passes it: "@name"
        name = f"@fleetd-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name[1:])
    sock.settimeout(60)
    try:
        yield sock, name
    finally:
        sock.close()


def test_ready_after_listening_and_stopping_on_sigterm(
        tmp_path: Path, notify_socket: tuple[socket.socket, str]) -> None:
    sock, name = notify_socket
    db = build_db(tmp_path / "n1.db", "n1", 20)
    log = tmp_path / "agent.log"
    with log.open("w") as fh:
        proc = subprocess.Popen(
            [FLEETD, "agent", "--db", str(db), "--node", "n1", "--listen",
             "127.0.0.1:0", "--plain-http", "--no-trace"],
            stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "NOTIFY_SOCKET": name})
        try:
            ready = sock.recv(4096).decode()
            # The listening line was written before READY=1 was sent.
            listening = LISTEN_RE.search(log.read_text())
            assert listening is not None, log.read_text()
            fields = dict(line.split("=", 1) for line in ready.splitlines())
            assert fields["READY"] == "1", ready
            url = f"http://127.0.0.1:{listening.group(3)}"
            assert fields["STATUS"] == f"listening on {url}"
            with urllib.request.urlopen(url + "/api/v1/health", timeout=10) as r:
                assert r.status == 200  # ready means it answers
            proc.send_signal(signal.SIGTERM)
            stopping = sock.recv(4096).decode()
            assert "STOPPING=1" in stopping.splitlines(), stopping
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    text = log.read_text()
    # At the default verbosity: the stop is part of a daemon's life cycle.
    assert "INFO fleetd.node.agent: SIGTERM: draining and flushing" in text, text
    # An ordinary stop is no warning and no error (--plain-http's warning comes before).
    stop = text[LISTEN_RE.search(text).end():]  # type: ignore[union-attr]
    assert not [x for x in stop.splitlines() if x.startswith(("WARNING", "ERROR"))], text


SLOW_TRACER = """
import sys, time
from pathlib import Path
from fleetd.node.agent import AgentSettings, run

class SlowTracer:  # compiling and attaching takes a while
    def __init__(self, writer): pass
    def start(self):
        time.sleep(1.5)
        print("probes attached", flush=True)
    def stop(self): pass
    def stats(self): return {}
    def ask_detail(self, seconds): return False

sys.exit(run(AgentSettings(node="n1", db=Path(sys.argv[1]), listen="127.0.0.1:0",
                           plain_http=True, tracer=SlowTracer)))
"""


def test_ready_waits_for_the_probes(tmp_path: Path,
                                    notify_socket: tuple[socket.socket, str]) -> None:
    sock, name = notify_socket
    out = tmp_path / "out.log"
    with out.open("w") as fh:
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-c", SLOW_TRACER, str(tmp_path / "n1.db")],
                                stdout=fh, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "NOTIFY_SOCKET": name})
        try:
            ready = sock.recv(4096).decode()
            assert "READY=1" in ready.splitlines()
            assert time.monotonic() - started >= 1.5
            text = out.read_text()
            listening = LISTEN_RE.search(text)
            assert listening is not None and "probes attached" in text, text
            assert text.index("probes attached") < listening.start()
            proc.send_signal(signal.SIGTERM)
            assert "STOPPING=1" in sock.recv(4096).decode().splitlines()
            assert proc.wait(30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_without_notify_socket_nothing_is_sent(tmp_path: Path) -> None:
    from fleetd.node.agent import notify

    env = dict(os.environ)
    try:
        os.environ.pop("NOTIFY_SOCKET", None)
        assert notify("READY=1") is False
        os.environ["NOTIFY_SOCKET"] = str(tmp_path / "nobody-listens")
        assert notify("READY=1") is False  # a warning, never a failure of the agent
    finally:
        os.environ.clear()
        os.environ.update(env)


# ---- the systemd unit -------------------------------------------------------------------


def unit_settings() -> dict[str, list[str]]:
    """Key -> values (a key may repeat) of the unit file."""
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            out.setdefault(key, []).append(value)
    return out


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed")
def test_the_unit_verifies(tmp_path: Path) -> None:
    # verify also checks that ExecStart's program exists: point it at this checkout's.
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace("/opt/fleetd/.venv/bin/fleetd", FLEETD))
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                          text=True, timeout=60)
    said = [x for x in (proc.stdout + proc.stderr).splitlines() if UNIT.name in x]
    assert proc.returncode == 0 and not said, proc.stdout + proc.stderr


def test_the_unit_is_notify_and_its_hardening_leaves_tracing_working() -> None:
    u = unit_settings()
    assert u["Type"] == ["notify"] and u["NotifyAccess"] == ["main"]
    assert u["ProtectSystem"] == ["strict"]
    writable = " ".join(u["ReadWritePaths"]).split()
    cfg = load_config(CONFIGS / "fleetd.yaml")
    assert cfg.store.db is not None
    db_dir = str(cfg.store.db.parent)
    assert db_dir in writable and u["StateDirectory"] == [Path(db_dir).name]
    assert "-/sys/kernel/tracing" in writable
    # The kernel header cache (fleetd.trace.host.headers.cache_dir, as root).
    assert u["CacheDirectory"] == ["fleetd"]
    caps = set(u["CapabilityBoundingSet"][0].split())
    assert {"CAP_BPF", "CAP_PERFMON", "CAP_SYS_ADMIN", "CAP_SYS_PTRACE"} <= caps
    # What would break tracing: headers under /lib/modules, a writable tracefs, the
    # traced processes' /proc entries.
    for key in ("ProtectKernelModules", "ProtectKernelTunables", "PrivateDevices",
                "MemoryDenyWriteExecute", "ProtectProc", "RestrictNamespaces"):
        assert key not in u, key
    start = shlex.split(u["ExecStart"][0])
    assert start[:2] == ["/opt/fleetd/.venv/bin/fleetd", "agent"]
    assert start[start.index("--config") + 1] == "/etc/fleetd/fleetd.yaml"


def test_the_header_cache_is_where_the_unit_lets_it_write(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    from fleetd.trace.host import headers

    monkeypatch.delenv("FLEETD_CACHE_DIR", raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert headers.cache_dir() == Path("/var/cache") / unit_settings()["CacheDirectory"][0]


# ---- the example config in both layouts -------------------------------------------------


def test_the_example_config_resolves_in_the_systemd_layout(tmp_path: Path) -> None:
    etc = tmp_path / "etc" / "fleetd"
    (etc / "tls").mkdir(parents=True)
    shutil.copy(CONFIGS / "fleetd.yaml", etc / "fleetd.yaml")
    cfg = load_config(etc / "fleetd.yaml")
    assert cfg.tls.cert == etc / "tls" / "node.pem"
    assert cfg.tls.key == etc / "tls" / "node.key"
    assert cfg.tls.client_ca == etc / "tls" / "ca.pem"
    assert cfg.store.db == Path("/var/lib/fleetd/fleetd.db")


# ---- the DaemonSet and the image --------------------------------------------------------


def daemonset() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = list(yaml.safe_load_all(DAEMONSET.read_text()))
    kinds = {d["kind"]: d for d in docs}
    return kinds["DaemonSet"], kinds


def files_in(volume: dict[str, Any]) -> set[str]:
    """The relative paths a projected, secret or configMap volume with items holds."""
    sources = volume["projected"]["sources"] if "projected" in volume else [volume]
    out = set()
    for src in sources:
        for kind in ("secret", "configMap"):
            if kind in src:
                out |= {item["path"] for item in src[kind]["items"]}
    return out


def container_files(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, bool]:
    """Absolute path -> read-only, for every file the mounted projected/secret/configMap
    volumes put in the container, and for each hostPath mount point itself."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    out: dict[str, bool] = {}
    for m in container["volumeMounts"]:
        v = volumes[m["name"]]
        ro = bool(m.get("readOnly"))
        if "hostPath" in v:
            out[m["mountPath"]] = ro
        for rel in files_in(v):
            out[str(PurePosixPath(m["mountPath"]) / rel)] = ro
    return out


def test_the_daemonset_mounts_what_the_config_and_the_probe_name() -> None:
    ds, kinds = daemonset()
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["hostPID"] is True
    assert pod["priorityClassName"] in {"system-node-critical", "system-cluster-critical"} or (
        kinds["PriorityClass"]["metadata"]["name"] == pod["priorityClassName"])
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["resources"]["limits"]["memory"]
    files = container_files(pod, c)
    # The config the agent is started with, and the files it names, relative to it.
    config_path = c["args"][c["args"].index("--config") + 1]
    assert config_path in files
    cfg = load_config(CONFIGS / "fleetd.yaml")
    where = PurePosixPath(config_path).parent
    for p in (cfg.tls.cert, cfg.tls.key, cfg.tls.client_ca):
        assert p is not None
        rel = Path(p).relative_to(CONFIGS)
        assert str(where / rel) in files, (p, sorted(files))
    # The database's directory is a writable host directory (it outlives the pod).
    assert cfg.store.db is not None
    assert files.get(str(cfg.store.db.parent)) is False
    # BPF: tracefs writable, kernel headers from the host.
    assert files.get("/sys/kernel/tracing") is False
    assert "/lib/modules" in files and "/usr/src" in files
    assert c["securityContext"]["privileged"] is True
    # The readiness probe: GET /api/v1/health over mTLS, with files the pod has.
    probe = c["readinessProbe"]["exec"]["command"]
    script = probe[-1]
    assert re.search(r"https://\$NODE_IP:7600/api/v1/health", script)
    assert c["args"][c["args"].index("--listen") + 1] == "$(NODE_IP):7600"
    for flag in ("--cacert", "--cert", "--key"):
        path = shlex.split(script)[shlex.split(script).index(flag) + 1]
        assert path in files, (flag, path)
    assert {e["name"] for e in c["env"]} >= {"NODE_IP", "NODE_NAME"}


def test_the_dockerfile_builds_the_image_the_daemonset_names() -> None:
    ds, _ = daemonset()
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    image = c["image"]
    repo, tag = image.rsplit(":", 1)
    assert tag == __version__
    text = DOCKERFILE.read_text()
    assert f"docker build -t {image} ." in text
    assert re.search(rf'org\.opencontainers\.image\.version="{re.escape(__version__)}"', text)
    assert f'org.opencontainers.image.title="{repo.rsplit("/", 1)[1]}"' in text
    assert re.search(r"^FROM debian:\S+", text, re.M)
    apt = re.search(r"apt-get install[^\n]*\n(?:[^\n]*\\\n)*[^\n]*", text)
    assert apt and "python3-bpfcc" in apt.group(0) and "curl" in apt.group(0)
    assert "--system-site-packages" in text and "'.[agent]'" in text
    # The entrypoint is fleetd, so the DaemonSet's args start with the subcommand; the
    # venv is where the systemd unit expects it too.
    entry = re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M)
    assert entry and yaml.safe_load(entry.group(1))[-1] == "/opt/fleetd/.venv/bin/fleetd"
    assert c["args"][0] == "agent"
    assert "/opt/fleetd/.venv/bin/fleetd" in unit_settings()["ExecStart"][0]
    # Everything the Dockerfile copies from the checkout exists there.
    for src in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for name in src.split():
            assert (REPO / name).exists(), name


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_the_readiness_probe_command_works(tmp_path: Path, pki: Pki) -> None:
    ds, _ = daemonset()
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    script = c["readinessProbe"]["exec"]["command"][-1]
    db = build_db(tmp_path / "gpu-01.db", "gpu-01", 10)
    with agent(db, "gpu-01", pki, "--no-trace") as a:
        port = a.url.rsplit(":", 1)[1]
        # The pod's paths, here: the certificates from `fleetd certs`, this agent's port.
        curl = shutil.which("curl")
        here = (script.replace("/etc/fleetd/tls/", f"{pki.dir}/")
                .replace(":7600/", f":{port}/").replace("exec curl", f"exec {curl}"))
        ok = subprocess.run(["/bin/sh", "-c", here], env={**os.environ, "NODE_IP": "127.0.0.1"},
                            capture_output=True, text=True, timeout=30)
        assert ok.returncode == 0, ok.stderr
        # A node certificate is no client certificate: refused (so the probe has its own).
        as_node = here.replace(f"{pki.dir}/probe.", f"{pki.dir}/gpu-01.")
        refused = subprocess.run(["/bin/sh", "-c", as_node],
                                 env={**os.environ, "NODE_IP": "127.0.0.1"},
                                 capture_output=True, text=True, timeout=30)
        assert refused.returncode != 0 and "403" in refused.stderr
