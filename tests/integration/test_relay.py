"""Peer relays on a namespace fleet: the client (the laptop's namespace) talks to two
relays, which ask the other hosts with their own node certificates.

Six hosts: host-0 and host-1 relay (relay.enabled), host-2 does not, host-3 and host-4
only answer (host-4's clock runs 2.5 s ahead, libfaketime), host-5 has no agent (a dead
node). Every agent admits host-0 and host-1 as
relays (tls.relay_nodes); the relays list the six hosts as their peers (relay.peers).
One bed for the module; each test is one or two CLI runs.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import build_db
from netbed import FAKETIME_LIB, PY, Host, NetBed, why_unavailable

_WHY = why_unavailable()
pytestmark = [pytest.mark.netns, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

SQL = "SELECT node, count(*) AS n, sum(dur_ns) AS d, max(op) AS op FROM events GROUP BY node"
RELAY_MAX_ROWS = 7  # host-0's ceiling: what it forwards can be no higher
SHIFT_S = 2.5
FAKED = {"LD_PRELOAD": FAKETIME_LIB, "FAKETIME": f"+{SHIFT_S}s",
         "FAKETIME_DONT_FAKE_MONOTONIC": "1"} if Path(FAKETIME_LIB).exists() else None


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from netbed import netbed

    tmp = tmp_path_factory.mktemp("relay")
    with netbed(tmp / "bed", 6) as bed:
        relays = [h.name for h in bed.hosts[:2]]
        for h in bed.hosts[:5]:
            lines = ["tls:", f"  relay_nodes: {relays}"]
            if h.name in relays:
                # The relays forward to the six hosts (host-5 has no agent) and no other.
                peers = ", ".join(f"{p.name}={p.endpoint}" for p in bed.hosts)
                lines += ["relay:", "  enabled: true", "  max_targets: 8",
                          f"  peers: [{peers}]"]
            if h.index == 0:
                lines += ["limits:", f"  max_rows: {RELAY_MAX_ROWS}"]
            config = tmp / f"{h.name}.yaml"
            config.write_text("\n".join(lines) + "\n")
            db = build_db(tmp / f"{h.name}.db", node=h.name, n=100 + 10 * h.index)
            env = FAKED if h.index == 4 else None
            bed.start_agent(h, db=db, env=env, extra=["--config", str(config)])
        bed.wait_agents(bed.hosts[:5])
        yield bed


def _query(bed: NetBed, hosts: str, *extra: str, sql: str = SQL,
           tls: list[str] | None = None) -> tuple[subprocess.CompletedProcess[str], Any]:
    proc = bed.client("query", "--nodes", hosts, *(bed.client_tls_args() if tls is None
                                                   else tls),
                      "--timeout", "5s", *([sql] if sql else []), "--format", "json", *extra,
                      timeout=60)
    try:
        return proc, json.loads(proc.stdout)
    except json.JSONDecodeError:
        return proc, None


def _named(hosts: list[Host]) -> str:
    return ",".join(f"{h.name}={h.endpoint}" for h in hosts)


def _warned(obj: Any) -> dict[str, str]:
    """Nodes that failed, and why (host-4's clock warning is not a failure)."""
    return {w["node"]: w["error"] for w in obj["warnings"]
            if w["kind"] not in ("skew", "truncated")}


def test_relayed_rows_equal_the_direct_fan_out_per_node(fleet: NetBed) -> None:
    nodes = _named(fleet.hosts[:5])
    direct, want = _query(fleet, nodes)
    assert direct.returncode == 0, direct.stderr
    relayed, got = _query(fleet, nodes, "--relay-via", "10.231.0.10:7600,10.231.0.11:7600")
    assert relayed.returncode == 0, relayed.stderr
    assert got["rows"] == want["rows"] and len(got["rows"]) == 5
    assert [r[1] for r in got["rows"]] == [100, 110, 120, 130, 140]
    # Every relayed node has its own clock estimate: the relay's to it plus ours to the
    # relay, with the two error bounds added (so never below the direct one's floor).
    assert set(got["skew"]) == {h.name for h in fleet.hosts[:5]}
    ahead = {"host-4": SHIFT_S * 1000 if FAKED else 0.0}
    for name, s in got["skew"].items():
        assert abs(s["offset_ms"] - ahead.get(name, 0.0)) < 50 and s["error_ms"] >= 0, got
    # The same through an automatic tree: host-0 asks host-1..2, host-3 asks host-4 --
    # host-3 is no relay, so its share fails, each node named.
    tree, obj = _query(fleet, nodes, "--fanout-degree", "3")
    assert tree.returncode == 3, tree.stderr
    warned = _warned(obj)
    assert list(warned) == ["host-4"] and "via relay host-3" in warned["host-4"]
    assert "does not relay" in warned["host-4"]
    assert "host-3" not in warned and [r[0] for r in obj["rows"]] == [f"host-{i}"
                                                                      for i in range(4)]


def test_times_in_a_relayed_request_move_into_each_peers_clock(fleet: NetBed) -> None:
    if FAKED is None:
        pytest.skip(f"libfaketime is not installed ({FAKETIME_LIB})")
    with sqlite3.connect(fleet.dir.parent / "host-4.db") as conn:
        (first,) = conn.execute("SELECT min(ts_ns) FROM events").fetchone()
    # A window from 1 s before host-4's first event, in our clock: it holds all of
    # host-3's and host-4's events. Moved into host-4's clock (2.5 s ahead) it starts
    # 1.5 s after host-4's last: only a window the relay moved into each peer's clock
    # finds none there. Margins of a second: clock estimates on a busy machine are off
    # by milliseconds.
    since = ("--from", str(first - 1_000_000_000))
    nodes = _named(fleet.hosts[:5])
    _, want = _query(fleet, nodes, *since, sql="")
    proc, got = _query(fleet, nodes, *since, "--relay-via", "host-1", sql="")
    assert proc.returncode == 0, proc.stderr

    def per_node(obj: Any) -> dict[str, int]:
        i = obj["columns"].index("node")
        return {n: sum(1 for r in obj["rows"] if r[i] == n) for n in ("host-3", "host-4")}

    assert per_node(got) == per_node(want) == {"host-3": 130, "host-4": 0}


def test_dead_node_behind_a_relay_is_named_and_peers_log_the_client(fleet: NetBed) -> None:
    proc, obj = _query(fleet, _named(fleet.hosts), "--relay-via", "host-1")
    assert proc.returncode == 3, proc.stderr  # partial: host-5 has no agent
    warned = _warned(obj)
    assert list(warned) == ["host-5"]
    # Down, refused, not TLS or too slow: a relay says only "unreachable" (its log says
    # which), so that it tells a client nothing about ports.
    assert "via relay host-1" in warned["host-5"] and "unreachable" in warned["host-5"]
    assert "refused" not in warned["host-5"]
    assert len(obj["rows"]) == 5
    # The peers logged who the relay asked for, and the limits that came with it.
    log = (fleet.dir / "agent-host-3.log").read_text()
    assert "relayed by node host-1 for cert:laptop: POST /api/v1/query" in log, log
    assert "max_rows=" in log and "fanout_timeout_s=" in log


def test_a_relay_cannot_raise_a_limit(fleet: NetBed) -> None:
    # host-0's ceiling is 7 rows: the client asks for 50, host-2 would give 50 directly.
    sql = "SELECT node, id FROM events"
    direct, obj = _query(fleet, fleet.hosts[2].endpoint, "--limit", "50", sql=sql)
    assert direct.returncode == 0 and len(obj["rows"]) == 50, direct.stderr
    nodes = _named(fleet.hosts[:3])
    proc, obj = _query(fleet, nodes, "--relay-via", "host-0", "--limit", "50", sql=sql)
    assert proc.returncode == 0, proc.stderr
    per_node = {n: sum(1 for r in obj["rows"] if r[0] == n) for n in ("host-1", "host-2")}
    assert per_node == {"host-1": RELAY_MAX_ROWS, "host-2": RELAY_MAX_ROWS}
    assert obj["truncated"]


def test_a_relay_the_config_does_not_allow_is_refused(fleet: NetBed) -> None:
    nodes = _named(fleet.hosts[2:5])
    proc, obj = _query(fleet, nodes, "--relay-via", "host-2")
    assert proc.returncode == 3, proc.stderr
    warned = _warned(obj)
    assert set(warned) == {"host-3", "host-4"}
    assert all("HTTP 403" in w and "host-2" in w and "does not relay" in w
               for w in warned.values()), warned


def test_a_client_without_a_certificate_reaches_nothing_through_a_relay(
        fleet: NetBed) -> None:
    log = fleet.dir / "agent-host-0.log"
    before = log.read_text().count("relaying for")
    nodes = _named(fleet.hosts[:3])
    tls = ["--ca-cert", str(fleet.certs / "ca.pem")]
    proc, obj = _query(fleet, nodes, "--relay-via", "host-0", tls=tls)
    assert proc.returncode == 4, proc.stderr
    assert set(_warned(obj)) == {"host-0", "host-1", "host-2"} and not obj["rows"]
    assert "via relay host-0" in _warned(obj)["host-1"]
    assert log.read_text().count("relaying for") == before  # it never got to ask


# A relayed request that asks to relay again, three ways: the laptop sending the relay
# marker itself, a relay node (host-0's certificate) asking another relay, and an inner
# request whose path is the relay route. Each must be refused by the agent.
_AGAIN = r"""
import json, ssl, sys, urllib.request
certs, relay, peer = sys.argv[1], sys.argv[2], sys.argv[3]
def ask(cert, body, headers=None):
    ctx = ssl.create_default_context(cafile=f"{certs}/ca.pem")
    ctx.load_cert_chain(f"{certs}/{cert}.pem", f"{certs}/{cert}.key")
    req = urllib.request.Request(f"https://{relay}/api/v1/relay", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)
inner = {"method": "POST", "path": "/api/v1/query", "body": {"sql": "SELECT 1"}}
job = {"targets": [{"name": "p", "address": peer}], "requests": [inner]}
again = dict(job, requests=[{"method": "POST", "path": "/api/v1/relay", "body": job}])
out = [ask("laptop", job, {"X-Fleetd-Relayed-For": "cert:mallory"}),
       ask("host-0", job, {"X-Fleetd-Relayed-For": "cert:laptop"}),
       ask("host-0", job),
       ask("laptop", again)]
print(json.dumps(out))
"""


def test_a_relayed_request_cannot_be_relayed_again(fleet: NetBed) -> None:
    relay, peer = fleet.hosts[1].endpoint, fleet.hosts[3].endpoint
    proc = fleet.spawn(None, [PY, "-c", _AGAIN, str(fleet.certs), relay, peer],
                       stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    answers = json.loads(out)
    (s1, a1), (s2, a2), (s3, a3), (s4, a4) = answers
    assert s1 == 403 and "only a relay node may forward" in a1["error"]["message"], a1
    assert s2 == 403 and "cannot be relayed again" in a2["error"]["message"], a2
    assert s3 == 403 and "cannot be relayed again" in a3["error"]["message"], a3
    assert s4 == 400 and "cannot be relayed again" in a4["error"]["message"], a4
    assert "cert:mallory" not in (fleet.dir / "agent-host-3.log").read_text()
