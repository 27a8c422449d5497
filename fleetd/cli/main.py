"""The ``fleetd`` command: one parser, one place where errors become messages.

Each command lives in its own module exposing ``register(subparsers)``; the module
sets ``func`` on its sub-parser. Heavy imports (bcc, aiohttp) happen inside the
handlers so that ``fleetd --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from fleetd import __version__
from fleetd.errors import FleetdError

# Order here is the order in --help.
COMMAND_MODULES: tuple[str, ...] = (
    "fleetd.cli.query_cmd",
    "fleetd.cli.trace_cmd",
    "fleetd.cli.explain_cmd",
    "fleetd.cli.ops_cmd",
    "fleetd.cli.overview_cmd",
    "fleetd.cli.stacks_cmd",
    "fleetd.cli.graphs_cmd",
    "fleetd.cli.gpu_cmd",
    "fleetd.cli.diff_cmd",
    "fleetd.cli.merge_cmd",
    "fleetd.cli.import_cmd",
    "fleetd.cli.export_cmd",
    "fleetd.cli.check_cmd",
    "fleetd.cli.agent_cmd",
    "fleetd.cli.certs_cmd",
    "fleetd.cli.mcp_cmd",
    "fleetd.cli.demo_cmd",
)


class Parser(argparse.ArgumentParser):
    """Argument mistakes read like every other fleetd error: the message first, on one
    line, then where to look (argparse would print the whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"fleetd: error: {message}\n  hint: see '{self.prog} --help'\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="fleetd",
        description="Explain GPU latency from the host side, on one node or a whole fleet.",
    )
    parser.add_argument("--version", action="version", version=f"fleetd {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def _setup_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(
        level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except FleetdError as exc:
        print(f"fleetd: error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"  hint: {exc.hint}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("fleetd: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `fleetd query ... | head`: the reader left; that is not an error.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
