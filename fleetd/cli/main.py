"""The ``fleetd`` command: one parser, one place where errors become messages.

Each command lives in its own module exposing ``register(subparsers)``; the module
sets ``func`` on its sub-parser. Heavy imports (bcc, aiohttp) happen inside the
handlers so that ``fleetd --help`` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import logging
import re
import sys
from collections.abc import Iterator, Sequence
from typing import NoReturn

from fleetd import __version__
from fleetd.errors import FleetdError, UsageError

# Order here is the order in --help.
COMMAND_MODULES: tuple[str, ...] = (
    "fleetd.cli.query_cmd",
    "fleetd.cli.trace_cmd",
    "fleetd.cli.explain_cmd",
    "fleetd.cli.ops_cmd",
    "fleetd.cli.overview_cmd",
    "fleetd.cli.stacks_cmd",
    "fleetd.cli.profile_cmd",
    "fleetd.cli.graphs_cmd",
    "fleetd.cli.gpu_cmd",
    "fleetd.cli.collectives_cmd",
    "fleetd.cli.questions",  # fleetd NAME for the registry's other questions (pods)
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
        self.exit(2, f"fleetd: error: {message}{_did_you_mean(message)}\n"
                     f"  hint: see '{self.prog} --help'\n")

    def unknown(self, extras: Sequence[str]) -> NoReturn:
        """Arguments this (sub)command does not take, with the closest options it has."""
        options = [o for o in self._option_string_actions if o.startswith("--")]
        close = [m for e in extras if e.startswith("-")
                 for m in difflib.get_close_matches(e.split("=")[0], options, n=1)]
        tip = f" (did you mean {', '.join(close)}?)" if close else ""
        self.exit(2, f"fleetd: error: unrecognized arguments: {' '.join(extras)}{tip}\n"
                     f"  hint: see '{self.prog} --help'\n")


def _did_you_mean(message: str) -> str:
    """argparse's "invalid choice: 'explian' (choose from ...)" gets the nearest name."""
    m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if m is None:
        return ""
    choices = re.findall(r"'([^']*)'", m.group(2)) or [c.strip() for c in m.group(2).split(",")]
    close = difflib.get_close_matches(m.group(1), choices, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def _deepest(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Parser:
    """The sub-command parser that ``args`` was parsed by (``certs issue-node`` too)."""
    found = parser
    while True:
        subs = [a for a in found._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if not subs or name not in subs[0].choices:
            return found if isinstance(found, Parser) else Parser()
        found = subs[0].choices[name]


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
    parser.add_argument("-q", "--quiet", action="store_true", default=False,
                        help="no progress lines on stderr (warnings and errors still shown)")
    parser.add_argument("--wide", action="store_true", default=False,
                        help="tables and text at full width (no column left out, no cell "
                        "shortened, no line wrapped)")
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
    if "--quiet" not in p._option_string_actions:
        p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS,
                       help="no progress lines on stderr (warnings and errors still shown)")
    if "--wide" not in p._option_string_actions:
        p.add_argument("--wide", action="store_true", default=argparse.SUPPRESS,
                       help="tables and text at full width: no column left out, no cell "
                       "shortened, no line wrapped")
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for nested in action.choices.values():
                _verbose_anywhere(nested)


def _setup_logging(verbosity: int) -> None:
    from fleetd.printable import PrintableFormatter

    level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    # One line per record, whatever a message quotes (a comm, a path): fleetd.printable.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(PrintableFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])


@contextlib.contextmanager
def _fitted_stdout(args: argparse.Namespace) -> Iterator[None]:
    """Text output (``--format table``) wrapped to the output's width; JSON, CSV,
    scripts (completion) and files pass as written."""
    from fleetd.cli import output

    output.set_wide(bool(getattr(args, "wide", False)))
    width = output.output_width(sys.stdout)
    if width is None or getattr(args, "format", None) != "table":
        yield
        return
    real = sys.stdout
    wrapped = output.Wrapped(real, width)
    sys.stdout = wrapped
    try:
        yield
    finally:
        sys.stdout = real
        wrapped.flush()


def _report(exc: FleetdError) -> int:
    from fleetd.printable import printable_lines

    # An error quotes the bad value, which a node or a file may have chosen: no
    # escape sequence reaches the terminal (its own line breaks are kept).
    print(f"fleetd: error: {printable_lines(exc.message)}", file=sys.stderr)
    if exc.hint:
        print(f"  hint: {printable_lines(exc.hint)}", file=sys.stderr)
    return exc.exit_code


def _not_permitted(exc: PermissionError) -> FleetdError:
    """A file this user may not read or write (a root-owned database, tracefs): the
    user's situation, not a bug; one line naming the file."""
    what = exc.filename if exc.filename is not None else "a file"
    return UsageError(f"permission denied: {what}",
                      "run as a user who may read it (tracing and the agent's files need "
                      "root: sudo), or copy the file somewhere readable")


def _damaged_database(exc: Exception) -> FleetdError | None:
    """A damaged database surfaces wherever a statement first reads the bad page, in any
    reader (explain, ops, overview...): told here once, as one line naming the file."""
    if "sqlite3" not in sys.modules:
        return None
    from fleetd.store.db import damage_error

    return damage_error(exc)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        _deepest(parser, args).unknown(extras)
    _setup_logging(args.verbose)
    from fleetd.cli.progress import set_quiet

    set_quiet(bool(getattr(args, "quiet", False)))
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        with _fitted_stdout(args):
            return int(args.func(args) or 0)
    except FleetdError as exc:
        return _report(exc)
    except BrokenPipeError:
        # `fleetd query ... | head`: the reader left; that is not an error.
        sys.stderr.close()
        return 0
    except PermissionError as exc:
        return _report(_not_permitted(exc))
    except Exception as exc:
        known = _damaged_database(exc)
        if known is None:
            raise  # a bug: it keeps its traceback
        return _report(known)
    except KeyboardInterrupt:
        print("fleetd: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
