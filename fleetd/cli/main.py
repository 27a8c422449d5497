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
    "fleetd.cli.collectives_cmd",
    "fleetd.cli.diff_cmd",
    "fleetd.cli.merge_cmd",
    "fleetd.cli.import_cmd",
    "fleetd.cli.export_cmd",
    "fleetd.cli.watch_cmd",
    "fleetd.cli.check_cmd",
    "fleetd.cli.agent_cmd",
    "fleetd.cli.certs_cmd",
    "fleetd.cli.mcp_cmd",
    "fleetd.cli.demo_cmd",
    "fleetd.cli.completion_cmd",
)

EXIT_CODES = """exit status:
  0  success (a fleet command: every node answered)
  1  nothing could be traced, or a node could not be reached
  2  a usage or input mistake (a bad flag, value, file or query)
  3  a fleet command got a partial answer (each missing node is named)
  4  a fleet command got no answer from any node
  5  explain --fail-on: a chain at or above that severity was found
  6  watch: a hung (or dead) distributed job was found
  130 interrupted (Ctrl-C)"""


class Parser(argparse.ArgumentParser):
    """Argument mistakes read like every other fleetd error: the message first, on one
    line, then where to look (argparse would print the whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"fleetd: error: {message}\n  hint: see '{self.prog} --help'\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="fleetd",
        description="Explain GPU latency from the host side, on one node or a whole fleet.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"fleetd {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for command in sub.choices.values():
        _verbose_anywhere(command)
    return parser


def _verbose_anywhere(p: argparse.ArgumentParser) -> None:
    """``fleetd query -v ...`` as well as ``fleetd -v query ...``: -v counts wherever it
    is typed (SUPPRESS keeps the top-level count when the command has none of its own)."""
    if "-v" not in p._option_string_actions:  # a parent parser shared by several
        p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                       help="more log output (-vv for debug)")
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for nested in action.choices.values():
                _verbose_anywhere(nested)


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
