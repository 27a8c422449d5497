"""The root-cause registry (fleetd/analyze/causes/causes.py) against the analyzers and the docs.

Every cause the analyzers can produce is registered, every registered cause is documented
in docs/explain.md with its meaning and evidence kinds, every chain over the recorded and
synthetic scenarios is worded by the registry, and the lock_wait fix says what the
culprit really did.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
from synth import SCENARIOS, build

from fleetd.analyze.causes.causes import CAUSES, SPIKE_HOST_KINDS, fixes, is_driver_poller, summary
from fleetd.analyze.causes.chains import _ROLES, Chain
from fleetd.analyze.explain import explain

from conftest import REPO

DOC = REPO / "docs" / "explain.md"
RECORDED = sorted((REPO / "tests" / "data" / "scenarios").glob("*.db"))
CLUSTER = REPO / "investigations" / "fleet" / "cluster.db"
ANALYZERS = ("causes/chains", "causes/spikes", "causes/rules", "causes/contention",
             "causes/gpu_chains", "distributed/collectives", "distributed/nccl_failures",
             "causes/throttle", "causes/memory", "causes/oncpu", "causes/pipes")


# ---- docs ---------------------------------------------------------------------------


def _section(text: str, title: str) -> str:
    m = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#+ |\Z)", text, re.S | re.M)
    assert m is not None, f"docs/explain.md has no '{title}' section"
    return m.group(1)


def _rows(section: str) -> dict[str, str]:
    """Table rows by their first cell's `name`."""
    out: dict[str, str] = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*`([a-z_/` ]+)`\s*\|", line)
        if m:
            for name in re.split(r"`\s*/\s*`", m.group(1)):
                out[name] = line
    return out


def test_every_cause_is_documented() -> None:
    rows = _rows(_section(DOC.read_text(), "Root causes"))
    missing = [name for name in CAUSES if name not in rows]
    assert not missing, f"docs/explain.md '## Root causes' does not list: {missing}"
    stale = [name for name in rows if name not in CAUSES]
    assert not stale, f"docs/explain.md lists causes the registry does not have: {stale}"
    for name, cause in CAUSES.items():
        assert cause.description in rows[name], f"{name}: the doc's meaning differs"
        kinds = [k for k in cause.evidence if f"`{k}`" not in rows[name]]
        assert not kinds, f"{name}: evidence kinds not in its doc row: {kinds}"


def test_every_evidence_kind_is_documented() -> None:
    rows = _rows(_section(DOC.read_text(), "Evidence items"))
    kinds = {k for c in CAUSES.values() for k in c.evidence} | set(SPIKE_HOST_KINDS)
    assert not kinds - set(rows), f"undocumented evidence kinds: {sorted(kinds - set(rows))}"


# ---- the analyzers produce registered causes only -----------------------------------


def _is_root_cause(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "root_cause") or (
        isinstance(node, ast.Name) and node.id == "root_cause")


def _literal(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _causes_in_code() -> dict[str, set[str]]:
    """Cause names the analyzers write, by module: assigned to ``root_cause``, passed to
    ``rule_chain``, or keys of the spike classification (``classes``, ``_ROLES``)."""
    out: dict[str, set[str]] = {}
    for mod in ANALYZERS:
        found: set[str] = set()
        tree = ast.parse((REPO / "fleetd" / "analyze" / f"{mod}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                if any(_is_root_cause(t) for t in node.targets):
                    found.add(_literal(node.value) or "")
                names = {t.id for t in node.targets if isinstance(t, ast.Name)}
                if names & {"classes", "_ROLES"} and isinstance(node.value, ast.Dict):
                    found |= {_literal(k) or "" for k in node.value.keys if k is not None}
            elif isinstance(node, ast.AnnAssign) and _is_root_cause(node.target):
                found.add(_literal(node.value) or "")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id == "rule_chain" and len(node.args) > 1):
                found.add(_literal(node.args[1]) or "")
        out[mod] = found - {""}
    return out


def test_the_analyzers_write_exactly_the_registered_causes() -> None:
    found = _causes_in_code()
    assert found["causes/chains"] and found["causes/rules"], found
    produced = set().union(*found.values())
    assert not produced - set(CAUSES), f"not in the registry: {produced - set(CAUSES)}"
    assert not set(CAUSES) - produced, f"registered, never produced: {set(CAUSES) - produced}"
    assert set(_ROLES) <= set(CAUSES)


def _check_worded(report: dict[str, Any]) -> None:
    for c in report["chains"]:
        cause = CAUSES.get(c["root_cause"])
        assert cause is not None, c["root_cause"]
        assert c["summary"] and c["fixes"] and all(isinstance(f, str) and f for f in c["fixes"])
        kinds = {e["kind"] for e in c["evidence"]}
        allowed = set(cause.evidence) | (set(SPIKE_HOST_KINDS) if c["detail"].get("kind")
                                         else set())
        assert kinds & set(cause.evidence), (c["root_cause"], kinds)
        assert kinds <= allowed, (c["root_cause"], kinds - allowed)


@pytest.mark.parametrize("db", [*RECORDED, CLUSTER], ids=lambda p: p.name)
def test_recorded_chains_are_worded_by_the_registry(db: Path) -> None:
    report = explain(db)
    # The quiet recording may have no chain at all; every other one has its answer.
    assert report["chains"] or db.name == "quiet.db"
    _check_worded(report)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_synthetic_chains_are_worded_by_the_registry(name: str, tmp_path: Path) -> None:
    _check_worded(explain(build(name, tmp_path)))


# ---- lock_wait fixes ----------------------------------------------------------------


def test_lock_wait_fix_names_the_sidecar_and_its_file() -> None:
    report = explain(REPO / "tests" / "data" / "scenarios" / "lock_wait.db")
    c = next(c for c in report["chains"] if c["root_cause"] == "lock_wait")
    culprit, victim = c["culprit"], c["victim"]
    assert culprit["comm"] == "stats-sidecar"
    text = " ".join(c["fixes"])
    assert f"stats-sidecar (pid {culprit['pid']})" in text
    assert "D state" in text and "file" in text and "rewriting" in text
    assert f"/proc/{culprit['pid']}/fd" in text and f"/proc/{victim['pid']}/fd" in text
    assert "driver" not in text and "polling" not in text


def _chain(culprit: dict[str, Any] | None, host_ns: dict[str, int]) -> Chain:
    victim = {"pid": 1000, "tid": 1001, "comm": "python", "thread": "python"}
    return Chain("node-a", "lock_wait", victim, "cudaLaunchKernel", [], 10**9,
                 culprits=[culprit] if culprit else [], detail={"host_ns": host_ns})


@pytest.mark.parametrize("comm", ["nvidia-smi", "nvidia-persiste", "nv-hostengine",
                                  "dcgm-exporter"])
def test_a_driver_poller_still_gets_the_driver_advice(comm: str) -> None:
    assert is_driver_poller(comm)
    got = fixes(_chain({"pid": 4242, "comm": comm, "self": False}, {"d_state": 5_000_000}))
    assert got[0] == (f"{comm} (pid 4242) held what python waited for: see what it does (cat "
                      "/proc/4242/stack, perf trace -p ...) and stop or slow its polling of "
                      "the driver on GPU nodes")
    assert got[1] == "if it must run, renice -n 19 -p 4242 and schedule it outside training"


def test_a_lock_wait_ended_by_a_wakeup_from_sleep_names_the_ipc() -> None:
    got = " ".join(fixes(_chain({"pid": 77, "comm": "metrics-agent", "self": False},
                                {"sleep": 9_000_000, "d_state": 1_000})))
    assert "metrics-agent (pid 77)" in got and "futex" in got and "pipe or socket" in got
    assert "perf trace -p 1000,77" not in got and "perf trace -p 77,1000" in got
    assert "driver" not in got


def test_a_lock_wait_without_a_culprit_keeps_placeholders() -> None:
    got = " ".join(fixes(_chain(None, {"d_state": 5_000_000})))
    assert "another task" in got and "/proc/<pid>/fd /proc/1000/fd" in got
    assert "driver" not in got
    assert summary(_chain(None, {})) == "lock_wait in python (pid 1000, tid 1001)"


def test_a_cause_outside_the_registry_falls_back() -> None:
    ch = _chain(None, {})
    ch.root_cause = "made_up"
    assert fixes(ch) == fixes(Chain("n", "unexplained", ch.victim, None, [], 1))
    assert summary(ch) == "made_up in python (pid 1000, tid 1001)"
