"""``fleetd check``'s checks that need no root: the database path, the certificates and
the fleet nodes (a real agent over mTLS), the JSON shape and the usage errors."""

from __future__ import annotations

import json
import socket
import sqlite3
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, Pki, agent, make_pki

from fleetd.checks import FAIL, OK, SKIP, STATUSES, WARN, Check
from fleetd.security import certs
from fleetd.security.checks import TlsFiles, cert_checks
from fleetd.store.checks import db_check
from fleetd.store.schema import SCHEMA_VERSION

from conftest import FLEETD, assert_one_line_error, build_db

NOW = datetime.now(UTC)


def fleetd_check(*args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    proc = subprocess.run([FLEETD, "check", "--format", "json", *args], capture_output=True,
                          text=True, timeout=60)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc, json.loads(proc.stdout) if proc.stdout else {}


def by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in report["checks"]}


def assert_one_line(c: Check | dict[str, Any]) -> None:
    d = c.as_dict() if isinstance(c, Check) else c
    assert "\n" not in d["detail"] and "\n" not in d["fix"], d
    assert "Traceback" not in d["detail"]
    if d["status"] != OK:
        assert d["fix"], d


# ---- certificates -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def certdir(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the fleet CA's directory (conftest's pki) with, in other/, a second CA
    and its own gpu-01."""
    d = pki.copy_to(tmp_path_factory.mktemp("check") / "certs").dir
    other = d / "other"
    certs.init_ca(other)
    certs.issue_node(other, "gpu-01", ["127.0.0.1"])
    return d


def node_files(d: Path, name: str = "gpu-01", **kw: Any) -> TlsFiles:
    args: dict[str, Any] = {"node_cert": d / f"{name}.pem", "node_key": d / f"{name}.key",
                            "client_ca": d / "ca.pem", **kw}
    return TlsFiles(**args)


def checks_of(files: TlsFiles, **kw: Any) -> dict[str, Check]:
    found = cert_checks(files, **kw)
    for c in found:
        assert_one_line(c)
        assert c.group == "certs"
    return {c.name: c for c in found}


def test_valid_certificates_are_ok(certdir: Path) -> None:
    found = checks_of(node_files(certdir, fleet_ca=certdir / "ca.pem",
                                 client_cert=certdir / "laptop.pem",
                                 client_key=certdir / "laptop.key"))
    assert {n: c.status for n, c in found.items()} == {
        "tls-listen": OK, "cert client-ca": OK, "cert node": OK, "cert client": OK}
    node = found["cert node"]
    assert "issued by the CA in ca.pem" in node.detail and "names the listen host" in node.detail
    assert node.data["days_left"] > 800


def ca_copy(tmp_path: Path, certdir: Path) -> Path:
    """The module's CA in a directory of its own, to issue odd certificates from."""
    d = tmp_path / "ca"
    d.mkdir()
    for f in ("ca.pem", "ca.key"):
        (d / f).write_bytes((certdir / f).read_bytes())
    return d


def test_a_certificate_expiring_soon_warns(tmp_path: Path, certdir: Path) -> None:
    d = ca_copy(tmp_path, certdir)  # a short-lived certificate, signed for real
    certs.issue_node(d, "short", ["127.0.0.1"], not_after=NOW + timedelta(days=3))
    c = checks_of(node_files(d, "short"))["cert node"]
    assert c.status == WARN, c
    assert "expires in" in c.detail and "before then" in c.fix and "issue-node" in c.fix
    # ... and not with a threshold shorter than what is left
    assert checks_of(node_files(d, "short"), warn_within=timedelta(days=1))["cert node"
                                                                           ].status == OK


def test_an_expired_certificate_fails(tmp_path: Path, certdir: Path) -> None:
    d = ca_copy(tmp_path, certdir)
    certs.issue_node(d, "old", ["127.0.0.1"], not_before=NOW - timedelta(days=30),
                     not_after=NOW - timedelta(days=1))
    c = checks_of(node_files(d, "old"))["cert node"]
    assert c.status == FAIL and "expired on" in c.detail and "issue-node" in c.fix


def test_an_expired_ca_fails(tmp_path: Path) -> None:
    certs.init_ca(tmp_path, not_before=NOW - timedelta(days=30), not_after=NOW - timedelta(days=2))
    c = checks_of(TlsFiles(fleet_ca=tmp_path / "ca.pem"))["cert fleet-ca"]
    assert c.status == FAIL and "expired on" in c.detail and "init-ca --force" in c.fix


def test_a_key_of_another_certificate_fails(certdir: Path) -> None:
    c = checks_of(node_files(certdir, node_key=certdir / "laptop.key"))["cert node"]
    assert c.status == FAIL
    assert "laptop.key does not belong to this certificate" in c.detail
    assert "issued together with it" in c.fix


def test_a_certificate_from_another_ca_fails(certdir: Path) -> None:
    c = checks_of(node_files(certdir / "other"))["cert node"]
    assert c.status == OK  # its own CA: fine
    c = checks_of(node_files(certdir / "other", client_ca=certdir / "ca.pem"))["cert node"]
    assert c.status == FAIL and f"not issued by the CA in {certdir / 'ca.pem'}" in c.detail
    assert "--client-ca" in c.fix


def test_a_leaf_given_as_the_ca_fails(certdir: Path) -> None:
    c = checks_of(TlsFiles(fleet_ca=certdir / "laptop.pem"))["cert fleet-ca"]
    assert c.status == FAIL and "is not a CA certificate" in c.detail


def test_a_client_certificate_cannot_serve(certdir: Path) -> None:
    c = checks_of(node_files(certdir, "laptop"))["cert node"]
    assert c.status == FAIL and "not for serverAuth" in c.detail


def test_a_listen_host_missing_from_the_sans_warns(certdir: Path) -> None:
    c = checks_of(node_files(certdir, listen="10.1.2.3:7600"))["cert node"]
    assert c.status == WARN and "does not name the listen host 10.1.2.3" in c.detail
    assert "--san 10.1.2.3" in c.fix
    assert checks_of(node_files(certdir, listen="0.0.0.0:7600"))["cert node"].status == OK


def test_the_listen_policy_is_the_agents(certdir: Path) -> None:
    found = checks_of(TlsFiles(listen="10.1.2.3:7600"))
    assert found["tls-listen"].status == FAIL and "needs a server certificate" in \
        found["tls-listen"].detail
    found = checks_of(TlsFiles())
    assert found["tls-listen"].status == OK and "self-signed" in found["tls-listen"].detail
    assert found["certs"].status == SKIP and "fleetd.yaml" in found["certs"].fix


def test_missing_and_swapped_files_fail_with_the_file_named(tmp_path: Path, certdir: Path) -> None:
    found = checks_of(node_files(certdir, node_cert=tmp_path / "nope.pem",
                                 client_ca=certdir / "gpu-01.key"))
    assert found["cert node"].status == FAIL
    assert found["cert node"].detail == f"certificate '{tmp_path / 'nope.pem'}' does not exist"
    assert found["cert client-ca"].status == FAIL
    assert "holds a private key, not a certificate" in found["cert client-ca"].detail
    c = checks_of(TlsFiles(node_cert=certdir / "gpu-01.pem"))["cert node"]
    assert c.status == FAIL and "a certificate without its key" in c.detail


# ---- the database path ------------------------------------------------------------------


def test_a_new_database_in_a_writable_directory_is_ok(tmp_path: Path) -> None:
    c = db_check(tmp_path / "sub" / "node.db")
    assert c.status == OK and "the agent creates it" in c.detail, c
    assert c.data["free_bytes"] > 0


def test_an_existing_fleetd_database_is_ok(tmp_path: Path) -> None:
    c = db_check(build_db(tmp_path / "node.db", n=10))
    assert c.status == OK and f"fleetd database, schema v{SCHEMA_VERSION}" in c.detail, c


def test_a_directory_that_cannot_be_created_fails(tmp_path: Path) -> None:
    # Root may write anywhere, but nothing can create a directory under a regular file.
    (tmp_path / "file").write_text("x")
    c = db_check(tmp_path / "file" / "sub" / "node.db")
    assert c.status == FAIL and "is a file, not a directory" in c.detail, c
    assert_one_line(c)


def test_a_foreign_sqlite_file_fails(tmp_path: Path) -> None:
    path = tmp_path / "other.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (x)")
    conn.close()
    c = db_check(path)
    assert c.status == FAIL and "is an SQLite database but not a fleetd one" in c.detail, c
    assert "--db" in c.fix
    assert_one_line(c)


def test_a_file_that_is_not_sqlite_fails(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("hello\n" * 200)
    c = db_check(path)
    assert c.status == FAIL and "not a readable SQLite database" in c.detail, c
    assert_one_line(c)


def test_a_directory_given_as_the_database_fails(tmp_path: Path) -> None:
    c = db_check(tmp_path)
    assert c.status == FAIL and "is a directory" in c.detail and "fleetd.db" in c.fix


def test_max_bytes_beyond_the_free_space_warns(tmp_path: Path) -> None:
    c = db_check(tmp_path / "node.db", max_bytes=2**62)
    assert c.status == WARN and "store.max_bytes" in c.detail, c


# ---- fleet nodes, against a real agent --------------------------------------------------


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[Agent]:
    d = tmp_path_factory.mktemp("agent")
    with agent(build_db(d / "gpu-01.db", "gpu-01", 50), "gpu-01", pki, "--no-trace") as a:
        yield a


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_running_agent_is_reachable_over_mtls(running: Agent, pki: Pki) -> None:
    address = running.url.removeprefix("https://")
    proc, report = fleetd_check("--only", "nodes", "--nodes", f"gpu-01={address}",
                                *pki.client_flags())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (c,) = report["checks"]
    assert c["name"] == "node gpu-01" and c["status"] == OK and c["group"] == "nodes"
    assert "gpu-01 (fleetd " in c["detail"] and "round trip" in c["detail"]
    assert c["data"]["rtt_ms"] >= 0 and c["data"]["connect_ms"] > 0
    assert c["data"]["schema_version"] == SCHEMA_VERSION


def test_a_closed_port_fails_with_the_clients_hint(pki: Pki) -> None:
    port = free_port()
    proc, report = fleetd_check("--only", "nodes", "--nodes", f"127.0.0.1:{port}",
                                *pki.client_flags())
    assert proc.returncode == 1
    (c,) = report["checks"]
    assert c["status"] == FAIL and c["data"]["failure"] == "refused"
    assert f"refused: connection to 127.0.0.1:{port} refused" in c["detail"]
    assert c["fix"] == "is the agent running and listening on that address and port?"
    assert_one_line(c)


def test_an_agent_with_an_untrusted_certificate_fails(running: Agent, tmp_path: Path) -> None:
    stranger = make_pki(tmp_path / "stranger", [], ["laptop"])
    proc, report = fleetd_check("--only", "nodes", "--nodes", running.url.removeprefix(
        "https://"), *stranger.client_flags())
    assert proc.returncode == 1
    (c,) = report["checks"]
    assert c["status"] == FAIL and c["data"]["failure"] == "tls"
    assert "certificate was not accepted" in c["detail"]
    assert "not from the CA in --ca-cert" in c["fix"]
    assert_one_line(c)


def test_missing_client_files_are_a_failed_check_not_an_abort(tmp_path: Path) -> None:
    proc, report = fleetd_check("--only", "nodes", "--nodes", "127.0.0.1:7600",
                                "--ca-cert", str(tmp_path / "ca.pem"))
    assert proc.returncode == 1
    (c,) = report["checks"]
    assert c["name"] == "nodes" and c["status"] == FAIL and "does not exist" in c["detail"]


# ---- the command: JSON shape, config, exit codes, usage errors ----------------------------


def test_json_shape_and_table(tmp_path: Path, certdir: Path) -> None:
    flags = ["--only", "db,certs", "--db", str(tmp_path / "x.db"), "--tls-cert",
             str(certdir / "gpu-01.pem"), "--tls-key", str(certdir / "laptop.key"),
             "--client-ca", str(certdir / "ca.pem")]
    proc, report = fleetd_check(*flags)
    assert proc.returncode == 1  # the mismatched key
    assert set(report) == {"status", "counts", "checks"} and report["status"] == FAIL
    assert set(report["counts"]) == set(STATUSES)
    assert sum(report["counts"].values()) == len(report["checks"])
    for c in report["checks"]:
        assert set(c) == {"name", "status", "detail", "fix", "group", "data"}, c
        assert c["status"] in STATUSES and c["group"] in ("db", "certs")
        assert_one_line(c)
    assert [c["name"] for c in report["checks"]] == ["db", "tls-listen", "cert client-ca",
                                                     "cert node"]
    table = subprocess.run([FLEETD, "check", *flags], capture_output=True, text=True,
                           timeout=60)
    assert table.returncode == 1
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["check", "status", "detail"]
    assert any(x.strip().startswith("fix: use the .key file") for x in lines)
    assert lines[-1] == "4 checks: 3 ok, 0 warn, 1 fail, 0 skip"


def test_a_config_gives_every_setting(tmp_path: Path, pki: Pki, running: Agent) -> None:
    cert, key = pki.pair("gpu-01")
    client, client_key = pki.pair("laptop")
    cfg = tmp_path / "fleetd.yaml"
    cfg.write_text(f"""
node: gpu-01
listen: 127.0.0.1:7600
tls: {{cert: {cert}, key: {key}, client_ca: {pki.ca}}}
store: {{db: {tmp_path / 'data' / 'fleetd.db'}}}
fleet:
  nodes: [{{name: gpu-01, address: "{running.url.removeprefix('https://')}"}}]
  ca: {pki.ca}
  client_cert: {client}
  client_key: {client_key}
""")
    proc, report = fleetd_check("--only", "db,certs,nodes", "--config", str(cfg))
    assert proc.returncode == 0, proc.stdout
    found = by_name(report)
    assert list(found) == ["config", "db", "tls-listen", "cert client-ca", "cert node",
                           "cert client", "node gpu-01"]
    assert all(c["status"] == OK for c in found.values()), found
    assert found["db"]["data"]["path"] == str(tmp_path / "data" / "fleetd.db")


def test_a_broken_config_is_a_failed_check(tmp_path: Path) -> None:
    cfg = tmp_path / "fleetd.yaml"
    cfg.write_text("listen: 127.0.0.1:7600\nstorage: {}\n")
    proc, report = fleetd_check("--only", "db,certs", "--config", str(cfg))
    assert proc.returncode == 1
    found = by_name(report)
    assert found["config"]["status"] == FAIL and "unknown key 'storage'" in \
        found["config"]["detail"]
    assert found["db"]["status"] == SKIP and found["certs"]["status"] == SKIP


def test_no_nodes_is_a_skip_with_a_fix_unless_asked_for() -> None:
    from fleetd.cli import check_cmd
    from fleetd.cli.main import build_parser
    from fleetd.errors import UsageError

    args = build_parser().parse_args(["check"])
    (nodes,) = check_cmd._nodes(args, None, explicit=False)
    assert nodes.status == SKIP and "--nodes" in nodes.fix
    assert check_cmd.summary([nodes])["status"] == OK  # a skip is not a problem
    with pytest.raises(UsageError, match="--only nodes needs the nodes"):
        check_cmd._nodes(args, None, explicit=True)


@pytest.mark.parametrize(("args", "needle"), [
    (["--only", "db,bogus"], "--only 'db,bogus': unknown check group bogus"),
    (["--only", "nodes"], "--only nodes needs the nodes to check"),
    (["--only", "db", "--nodes", "127.0.0.1:7600"], "--nodes is only used by the nodes checks"),
    (["--only", "db", "--show-skew"], "unrecognized arguments: --show-skew"),
    (["--only", "nodes", "--nodes", "127.0.0.1:"], "invalid node address '127.0.0.1:'"),
    (["--only", "certs", "--listen", "nowhere"], "invalid --listen address 'nowhere'"),
    (["--only", "certs", "--cert-warn-within", "2 weeks"], "invalid duration '2 weeks'"),
    (["--format", "csv"], "--format 'csv' is not supported"),
])
def test_usage_mistakes_are_one_line_errors(args: list[str], needle: str) -> None:
    proc = subprocess.run([FLEETD, "check", *args], capture_output=True, text=True, timeout=60)
    assert_one_line_error(proc, needle)


def test_capabilities_are_read_from_capeff(monkeypatch: pytest.MonkeyPatch) -> None:
    from fleetd.trace import checks as check

    monkeypatch.setattr(check, "_effective_caps", lambda: 1 << 39)  # CAP_BPF only
    c = check._capabilities()
    assert c.status == FAIL and "CAP_BPF" in c.detail and "--cap-add PERFMON" in c.fix
    monkeypatch.setattr(check, "_effective_caps", lambda: (1 << 39) | (1 << 38))
    assert check._capabilities().status == OK
    monkeypatch.setattr(check, "_effective_caps", lambda: 1 << 21)
    assert check._capabilities().status == OK


def test_a_libbcc_that_cannot_load_is_a_failed_check_not_a_traceback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A test double of the import only (a libbcc built for another glibc raises OSError
    from ctypes when BCC's module loads it); the check's handling is the real code."""
    import builtins
    import sys

    from fleetd.trace import checks as tc

    real = builtins.__import__

    def failing(name: str, *args: object, **kwargs: object) -> object:
        if name == "bcc":
            raise OSError("libbcc.so.0: version `GLIBC_2.38' not found")
        return real(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.delitem(sys.modules, "bcc", raising=False)
    monkeypatch.setattr(builtins, "__import__", failing)
    c = tc._bcc()
    assert c.status == "fail" and "GLIBC_2.38" in c.detail and "libbpfcc" in c.fix
