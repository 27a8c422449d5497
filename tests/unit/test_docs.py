"""The docs that can drift are checked against the code."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_cli_reference_matches_the_parsers() -> None:
    proc = subprocess.run([sys.executable, "scripts/gen_cli_docs.py", "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_readme_starts_with_the_two_setup_commands() -> None:
    lines = [x for x in (REPO / "README.md").read_text().splitlines() if x.strip()]
    assert lines[0] == "# fleetd"
    assert lines[1] == "```sh"
    assert lines[2].startswith("make demo") and lines[3].startswith("make test")
    assert lines[4] == "```"
    makefile = (REPO / "Makefile").read_text()
    assert "demo: setup" in makefile and "test: setup" in makefile
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_every_view_and_table_is_documented() -> None:
    import sqlite3

    from fleetd.store.schema import MIGRATIONS, _statements

    conn = sqlite3.connect(":memory:")
    for sql in MIGRATIONS:
        for stmt in _statements(sql):
            conn.execute(stmt)
    doc = (REPO / "docs" / "schema.md").read_text()
    names = [r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type IN ('table', 'view') "
        "AND name NOT LIKE 'sqlite_%'")]
    missing = [n for n in names if f"`{n}`" not in doc]
    assert not missing, f"docs/schema.md does not describe: {missing}"
    for view in ("events", "sessions", "chains", "aggregates", "processes", "threads"):
        cols = [r[1] for r in conn.execute(f"PRAGMA table_info({view})")]
        undocumented = [c for c in cols if f"`{c}`" not in doc]
        assert not undocumented, f"{view}: {undocumented}"


# ---- the node API, its metrics and the CLI flags, read from the code -------------------

def _agent_routes(tmp_path: Path) -> set[tuple[str, str]]:
    """(method, path) of every route the agent's application serves, as ``fleetd agent``
    builds it: the agent's own routes and the relay route the CLI plugs in."""
    from fleetd.node.agent import AgentSettings, build_app
    from fleetd.node.api import NodeState
    from fleetd.relay import RelaySettings, relay_routes

    settings = AgentSettings(node="n1", db=tmp_path / "n1.db",
                             extra_routes=relay_routes(RelaySettings(node="n1")))
    app = build_app(settings, NodeState(node="n1"))
    routes = {(r.method, r.resource.canonical) for r in app.router.routes()
              if r.resource is not None and r.method != "HEAD"}  # HEAD comes with each GET
    assert {("GET", "/api/v1/health"), ("GET", "/metrics"), ("POST", "/api/v1/query"),
            ("POST", "/api/v1/detail"), ("POST", "/api/v1/relay")} <= routes
    return routes


def _section(doc: str, heading: str) -> str:
    """The text under the first heading that starts with ``heading``, to the next heading."""
    m = re.search(rf"^#+ {re.escape(heading)}.*?$(.*?)(?=^#|\Z)", doc, re.M | re.S)
    assert m is not None, f"no heading {heading!r}"
    return m.group(1)


def documented_routes(doc: str) -> set[tuple[str, str]]:
    """(method, path) of each route heading: ### `GET /api/v1/chains?since=...` (query
    parameters may follow the path)."""
    return set(re.findall(r"^#+ `([A-Z]+) (/[^`?\s]*)", doc, re.M))


def test_every_agent_route_is_documented(tmp_path: Path) -> None:
    """docs/api.md has one heading per route the agent serves, method and path, and none
    for a route it does not serve."""
    documented = documented_routes((REPO / "docs" / "api.md").read_text())
    served = _agent_routes(tmp_path)
    missing = sorted(served - documented)
    assert not missing, ("docs/api.md has no heading (### `METHOD /path`) for the agent's "
                         f"routes: {missing}")
    stale = sorted(documented - served)
    assert not stale, f"docs/api.md documents routes the agent does not serve: {stale}"


def test_the_architecture_doc_names_every_agent_route(tmp_path: Path) -> None:
    """The agent's paragraph of docs/architecture.md names each route it serves: a
    question's route as "one `GET` route per question", any other by its name."""
    from fleetd.questions.catalog import QUESTIONS

    para = _paragraph((REPO / "docs" / "architecture.md").read_text(), "`fleetd.node`")
    questions = {("GET", q.route) for q in QUESTIONS}
    assert "one `GET` route per question" in para
    unnamed = [f"{method} {path}" for method, path in sorted(_agent_routes(tmp_path))
               if (method, path) not in questions and not _names_route(para, method, path)]
    assert not unnamed, ("docs/architecture.md's paragraph on fleetd.node does not name "
                         f"these routes: {unnamed}")


def _paragraph(doc: str, bold: str) -> str:
    """The paragraph that starts with **``bold``...**, its lines folded."""
    m = re.search(rf"^\*\*{re.escape(bold)}.*?(?=\n\n)", doc, re.M | re.S)
    assert m is not None, f"no paragraph starting **{bold}"
    return " ".join(m.group(0).split())


def _names_route(text: str, method: str, path: str) -> bool:
    """``text`` names the route by its last path part (`/metrics` for a path outside the
    API), and a route other than GET as a `POST` beside it."""
    api = path.startswith("/api/v1/")
    name = path.rsplit("/", 1)[-1] if api else path
    if f"`{name}`" not in text:
        return False
    return method == "GET" or f"`{name}` (a `{method}`" in text


def test_every_metric_series_is_documented() -> None:
    from fleetd.node.api import NodeState
    from fleetd.node.metrics import Sources, render

    text = render(NodeState(node="n1", tracing=True), Sources())
    families = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    samples = set(re.findall(r"^(fleetd_\w+)[{ ]", text, re.M))
    assert len(families) >= 5 and samples
    for name in samples:  # every sample belongs to a declared family (histogram parts too)
        assert name in families or any(
            name == f + suffix and families[f] == "histogram"
            for f in families for suffix in ("_bucket", "_sum", "_count")), name
    section = _section((REPO / "docs" / "api.md").read_text(), "`GET /metrics`")
    missing = [f for f in families if f"`{f}`" not in section]
    assert not missing, f"docs/api.md's GET /metrics section does not name: {missing}"


def _parsers(
    parser: argparse.ArgumentParser, path: str
) -> list[tuple[str, argparse.ArgumentParser]]:
    out = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _parsers(sub, f"{path} {name}")
    return out


def test_every_cli_flag_is_in_the_reference() -> None:
    from fleetd.cli.main import build_parser

    doc = (REPO / "docs" / "cli.md").read_text()
    missing: list[str] = []
    commands = _parsers(build_parser(), "fleetd")
    assert len(commands) > 10
    for command, parser in commands:
        # The command's own section: "## fleetd query", "### fleetd certs show".
        m = re.search(rf"^#+ {re.escape(command)}\n(.*?)(?=^#|\Z)", doc, re.M | re.S)
        if m is None:
            missing.append(f"section {command!r}")
            continue
        for action in parser._actions:
            if action.help == argparse.SUPPRESS:
                continue
            for flag in action.option_strings:
                # An entry of the options list: "  -v, --verbose  ..." or "  --db DB  ...".
                entry = rf"^  (?:-\S+(?: [^-\s]\S*)*, )*{re.escape(flag)}(?![\w-])"
                if not re.search(entry, m.group(1), re.M):
                    missing.append(f"{command} {flag}")
    assert not missing, (f"docs/cli.md does not list: {missing}; regenerate it with "
                         ".venv/bin/python scripts/gen_cli_docs.py")
