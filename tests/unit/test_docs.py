"""The docs that can drift are checked against the code."""

from __future__ import annotations

import subprocess
import sys

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
