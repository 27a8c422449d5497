"""What one ``fleetd check`` finding is, and the groups they come in.

Every check says ok / warn / fail / skip, one line of what it found and, for anything
short of ok, one line of how to fix it. One module named ``checks`` per layer builds on
this one: the host and CUDA checks in :mod:`fleetd.trace.checks`, the database in
:mod:`fleetd.store.checks`, the certificates in :mod:`fleetd.security.checks`, the fleet
reachability in :mod:`fleetd.fleet.checks`.
This module has no heavy imports, so every one of them can use it.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.resources.abc import Traversable
from typing import TypedDict

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
STATUSES = (OK, WARN, FAIL, SKIP)
# Order of the groups is the order of the report.
GROUPS = ("host", "cuda", "db", "certs", "nodes")
_RANK = {OK: 0, SKIP: 1, WARN: 2, FAIL: 3}


# A check's figures for scripts (JSON only). Each check types its own where it builds
# them (store.checks.DbFigures, ...); this base layer cannot name the layers above it,
# and only ever hands the figures to a JSON encoder, so it holds them as a mapping.
CheckFigures = Mapping[str, object]


class CheckJson(TypedDict):
    """One check in ``fleetd check --format json`` and MCP's get_check."""

    name: str
    status: str
    detail: str
    fix: str
    group: str
    data: CheckFigures


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""
    group: str = "host"
    data: CheckFigures = field(default_factory=dict)

    def __post_init__(self) -> None:
        # One line each, whatever a library's error text looked like: the table and
        # log scrapers rely on it.
        self.detail = " ".join(self.detail.split())
        self.fix = " ".join(self.fix.split())

    def as_dict(self) -> CheckJson:
        return {"name": self.name, "status": self.status, "detail": self.detail,
                "fix": self.fix, "group": self.group, "data": self.data}


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing a check looked at; a check is the worst of its findings."""

    status: str
    text: str
    fix: str = ""


def row(name: str, group: str, subject: str, findings: list[Finding], summary: str,
        data: CheckFigures | None = None, *, always_summary: bool = False) -> Check:
    """One check from its findings: the worst status; after ``subject``, the problems
    (failures first), or ``summary`` when there are none (and after the problems too
    with ``always_summary``); the problems' fixes."""
    bad = sorted((f for f in findings if f.status != OK), key=lambda f: f.status != FAIL)
    texts = [f.text for f in bad]
    if not bad or always_summary:
        texts.append(summary)
    fixes = dict.fromkeys(f.fix for f in bad if f.fix)
    return Check(name, worst([f.status for f in findings]), f"{subject}: " + "; ".join(texts),
                 "; ".join(fixes), group=group, data=data or {})


def worst(statuses: list[str]) -> str:
    """fail > warn > skip > ok; ok for nothing at all."""
    return max(statuses, key=_RANK.__getitem__, default=OK)


def counts(checks: list[Check]) -> dict[str, int]:
    return {s: sum(1 for c in checks if c.status == s) for s in STATUSES}


def example_file(name: str) -> Traversable:
    """An example deployment file shipped with fleetd (``fleetd.yaml``,
    ``fleetd-agent.service``, ``daemonset.yaml``), wherever fleetd is installed."""
    return importlib.resources.files("fleetd.configs").joinpath(name)


class Stop(Exception):
    """A finding that ends a check: nothing after it can be looked at."""

    def __init__(self, finding: Finding) -> None:
        super().__init__(finding.text)
        self.finding = finding


def stopped(name: str, group: str, subject: str, finding: Finding,
             data: CheckFigures) -> Check:
    # Messages from fleetd's file readers already name the file; say it once.
    text = finding.text if subject in finding.text else f"{subject}: {finding.text}"
    return Check(name, finding.status, text, finding.fix, group=group, data=data)
