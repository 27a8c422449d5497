"""The alerting rules shipped in configs/prometheus/ (issue 43.2), checked and unit-tested
by the real promtool (Debian's prometheus package, installed by scripts/setup.sh), and
held to what the agent exports and to the labels Alertmanager routes on."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from conftest import REPO

RULES = REPO / "configs" / "prometheus" / "fleetd-rules.yml"
TESTS = RULES.with_name("fleetd-rules.test.yml")
SEVERITIES = {"critical", "warning", "info"}


def _promtool() -> str:
    """scripts/setup.sh unpacks it into the venv; one on PATH does too."""
    venv = REPO / ".venv" / "bin" / "promtool"
    tool = str(venv) if venv.exists() else shutil.which("promtool")
    assert tool, "promtool is missing: scripts/setup.sh unpacks it into .venv/bin"
    return tool


def _rules() -> list[dict[str, object]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_promtool_checks_the_rules() -> None:
    r = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in r.stdout


def test_promtool_unit_tests_pass() -> None:
    r = subprocess.run([_promtool(), "test", "rules", TESTS.name], cwd=TESTS.parent,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_is_unit_tested_and_routable() -> None:
    tested = set(re.findall(r"alertname: (\w+)", TESTS.read_text()))
    for rule in _rules():
        name = rule["alert"]
        assert name in tested, f"{name} has no promtool test in {TESTS.name}"
        labels, notes = rule["labels"], rule["annotations"]
        assert isinstance(labels, dict) and labels["severity"] in SEVERITIES, name
        assert isinstance(notes, dict) and {"summary", "description"} <= set(notes), name
        assert "node" in str(notes["summary"]), f"{name}: its summary names no node"


def test_the_rules_use_only_series_the_agent_exports() -> None:
    exported = set(re.findall(r"^\| `(fleetd_\w+)`", (REPO / "docs" / "api.md").read_text(),
                              flags=re.M))
    assert len(exported) > 10
    for rule in _rules():
        for name in re.findall(r"\b(fleetd_\w+)", str(rule["expr"])):
            base = re.sub(r"_(bucket|count|sum)$", "", name)
            assert base in exported, f"{rule['alert']}: {name} is not in docs/api.md's table"


def test_a_broken_expectation_fails(tmp_path: Path) -> None:
    """The promtool run can fail: the same tests with one threshold moved do."""
    shutil.copy(TESTS, tmp_path / TESTS.name)
    (tmp_path / RULES.name).write_text(RULES.read_text().replace(">= 60", ">= 600"))
    r = subprocess.run([_promtool(), "test", "rules", TESTS.name], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "FleetdNcclHang" in r.stdout + r.stderr
