"""Issue 29, item 4: a relay forwards only to the fleet. Real agents on loopback with
certificates from `fleetd certs`: a relay whose relay.peers lists one agent, a peer
agent, and plain listeners that count every connection they get.

A relay asked to reach an address its configuration does not list refuses that target
without opening a connection (the listener counts zero); a listed name is dialed at its
listed address, whatever address the request gives; a listed peer that is down, or is
not an agent, is reported as one kind ("unreachable") with one message, so that a
client learns nothing about ports.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, Pki, RawListener, agent, client_ssl, request

from conftest import FLEETD, build_db

INNER = {"method": "POST", "path": "/api/v1/query", "body": {"sql": "SELECT count(*) FROM events"}}


SSH_GREETING = b"SSH-2.0-OpenSSH_9.2\r\n"  # a listener that is not a node


def _free_address() -> str:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return f"127.0.0.1:{s.getsockname()[1]}"  # closed again: connections are refused


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[dict[str, Any]]:
    d = tmp_path_factory.mktemp("relay-peers")
    unlisted, listed_plain = RawListener(SSH_GREETING), RawListener(SSH_GREETING)
    dead = _free_address()
    (d / "peer.yaml").write_text("tls:\n  relay_nodes: [relay]\n")
    with agent(build_db(d / "peer.db", "peer", 120), "peer", pki, "--no-trace",
               "--config", str(d / "peer.yaml")) as peer:
        peer_address = peer.url.split("//")[1]
        (d / "relay.yaml").write_text(
            "tls:\n  relay_nodes: [relay]\nrelay:\n  enabled: true\n"
            f"  peers: [peer={peer_address}, dead={dead}, plain={listed_plain.address}]\n")
        with agent(build_db(d / "relay.db", "relay", 10), "relay", pki, "--no-trace",
                   "--config", str(d / "relay.yaml")) as relay:
            yield {"relay": relay, "peer": peer_address, "unlisted": unlisted,
                   "plain": listed_plain, "dead": dead}
    unlisted.close()
    listed_plain.close()


def _relay(relay: Agent, pki: Pki, targets: list[dict[str, str]]) -> list[dict[str, Any]]:
    status, body, raw = request(relay.url, client_ssl(pki), "POST", "/api/v1/relay",
                                json={"targets": targets, "requests": [INNER],
                                      "timeout_s": 2, "skew_samples": 0})
    assert status == 200, raw
    return list(body["nodes"])


def test_an_unlisted_address_is_refused_and_never_contacted(bed: dict[str, Any],
                                                             pki: Pki) -> None:
    unlisted: RawListener = bed["unlisted"]
    started = time.monotonic()
    (entry,) = _relay(bed["relay"], pki, [{"name": "x", "address": unlisted.address}])
    assert time.monotonic() - started < 5
    assert entry["address"] == unlisted.address and entry.get("replies") is None
    assert entry["failure"]["kind"] == "relay"
    assert "is not one of relay relay's peers" in entry["failure"]["message"]
    # A listed name is dialed at its listed address: the request's address is only a key.
    (named,) = _relay(bed["relay"], pki, [{"name": "peer", "address": unlisted.address}])
    assert named["failure"] is None and named["replies"][0]["rows"] == [[120]]
    time.sleep(0.2)  # a connection the relay made would have been accepted by now
    assert unlisted.connections == 0
    log = bed["relay"].log.read_text()
    assert "not forwarding to x: relay.peers does not list it" in log, log


def test_a_listed_peer_by_address_answers(bed: dict[str, Any], pki: Pki) -> None:
    (entry,) = _relay(bed["relay"], pki, [{"name": "laptop-label", "address": bed["peer"]}])
    assert entry["failure"] is None and entry["replies"][0]["rows"] == [[120]]


def test_failures_of_listed_peers_say_nothing_about_ports(bed: dict[str, Any],
                                                          pki: Pki) -> None:
    plain: RawListener = bed["plain"]
    entries = _relay(bed["relay"], pki, [{"name": "dead", "address": bed["dead"]},
                                         {"name": "plain", "address": plain.address}])
    assert plain.connections >= 1  # listed: the relay did try it
    failures = {e["name"]: e["failure"] for e in entries}
    # Refused and "does not speak TLS" before: now the same kind and the same words.
    assert {f["kind"] for f in failures.values()} == {"unreachable"}
    assert {f["message"].replace(n, "NODE") for n, f in failures.items()} == {
        "NODE could not be reached from relay relay (or did not answer in time)"}
    assert not any(w in str(failures) for w in ("refused", "TLS", "SSL", "SSH", "timeout"))
    log = bed["relay"].log.read_text()
    assert "refused" in log and "does not speak TLS" in log  # the operator still sees why


def test_relaying_without_peers_refuses_to_start(tmp_path: Path, pki: Pki) -> None:
    (tmp_path / "relay.yaml").write_text("relay:\n  enabled: true\n")
    cert, key = pki.pair("relay")
    proc = subprocess.run(
        [FLEETD, "agent", "--db", str(build_db(tmp_path / "r.db", "relay", 5)), "--node",
         "relay", "--listen", "127.0.0.1:0", "--no-trace", "--tls-cert", str(cert),
         "--tls-key", str(key), "--client-ca", str(pki.ca), "--config",
         str(tmp_path / "relay.yaml")], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "relay.enabled needs relay.peers" in proc.stderr, proc.stderr
