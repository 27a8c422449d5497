"""Write docs/cli.md from the parsers themselves, so the reference cannot drift.

    .venv/bin/python scripts/gen_cli_docs.py          # rewrite docs/cli.md
    .venv/bin/python scripts/gen_cli_docs.py --check  # exit 1 if it is out of date

tests/unit/test_docs.py runs the check.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DOC = REPO / "docs" / "cli.md"

HEADER = """# CLI reference

Generated from `fleetd --help` by `scripts/gen_cli_docs.py`; a test fails when this file
and the parsers disagree. Every command takes `-v` (more logs) before its name.
Exit codes: 0 success; 1 nothing could be done (e.g. nothing traceable); 2 a usage,
input or configuration mistake (one `fleetd: error:` line and a hint); fleet commands
also use 3 (partial answer: some nodes missing) and 4 (no node answered).
"""


def _subparsers(p: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    out: list[tuple[str, argparse.ArgumentParser]] = []
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            out += list(action.choices.items())
    return out


def render() -> str:
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: fix the width
    from fleetd.cli.main import build_parser

    root = build_parser()
    root.prog = "fleetd"
    parts = [HEADER, "## fleetd\n\n```\n" + root.format_help() + "```\n"]
    for name, sub in _subparsers(root):
        parts.append(f"## fleetd {name}\n\n```\n{sub.format_help()}```\n")
        for child, leaf in _subparsers(sub):
            parts.append(f"### fleetd {name} {child}\n\n```\n{leaf.format_help()}```\n")
    return "\n".join(parts)


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is out of date: run .venv/bin/python scripts/gen_cli_docs.py",
                  file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
