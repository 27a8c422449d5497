"""Asking a question of the registry (:mod:`fleetd.questions`) from the command line.

:func:`ask` is the one place a command chooses between a local file (``--db``,
``--lake``) and the fleet (``--nodes``, ``--config``); :func:`register` adds ``fleetd
NAME`` for every question with a table of its own and no hand-written command: its
flags from the question's parameters, its rows from the answer's ``rows`` list.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from fleetd.cli.argtypes import positive
from fleetd.cli.fleet_args import add_fleet_args, fleet_mode, fleet_options, report
from fleetd.cli.output import FORMATS, check_format, print_notes, write_rows
from fleetd.cli.window_args import add_window, open_analysis, window_of
from fleetd.questions.catalog import QUESTIONS

if TYPE_CHECKING:
    from fleetd.analyze.facade import Analysis
    from fleetd.fleet.fanout import FleetOptions
    from fleetd.fleet.queries import AskedJson
    from fleetd.fleet.result import FleetResult
    from fleetd.questions.spec import Answer, Question
    from fleetd.store.bounds import Bounds

HANDWRITTEN = ("stacks", "cpu_stacks", "graphs", "gpu", "overview", "profile")

L = TypeVar("L", bound=Mapping[str, object])  # the local file's answer
F = TypeVar("F", bound=Mapping[str, object])  # the fleet's (FleetResult's)


@dataclass(frozen=True, slots=True)
class Asked(Generic[L, F]):
    """A question's answer: the local file's (``local``), or the fleet's ``result``."""

    local: L | None = None
    result: FleetResult[F] | None = None

    @property
    def obj(self) -> L | F:
        """The answer --format json prints."""
        if self.result is not None:
            return self.result.obj
        assert self.local is not None  # either() sets one of the two
        return self.local

    def done(self, args: argparse.Namespace, quiet: bool) -> int:
        """The exit code; a fleet answer's warnings on stderr first (unless ``quiet``,
        a machine format, and no --show-skew)."""
        if self.result is None:
            return 0
        if not quiet or args.show_skew:
            report(self.result.answer, args.show_skew)
        return self.result.exit_code

    def body(self) -> dict[str, object]:
        """The answer without the fleet's per-node answers (its merged rows say it all)."""
        return {k: v for k, v in self.obj.items() if k != "nodes"}


def ask(args: argparse.Namespace, question: Question, **given: Any
        ) -> Asked[Answer, Answer]:
    """Ask ``question`` with ``given`` parameter values of the fleet (--nodes, --config,
    a config found) or of the local file (--db, --lake) in the command's window: on both
    sides the question's answer as the registry types it (``Answer``: the Question is
    not typed by its answer); the fleet's is a fleetd.fleet.queries.AskedJson."""
    params = question.values(given)

    def fleet(opts: FleetOptions, bounds: Bounds) -> FleetResult[AskedJson]:
        from fleetd.fleet.queries import AskedJson
        from fleetd.fleet.queries import ask as ask_fleet

        return ask_fleet(opts, question, bounds, params, AskedJson)

    def local(analysis: Analysis) -> Answer:
        return dict(question.answer_locally(analysis, params))

    return either(args, local, fleet)


def either(args: argparse.Namespace, local: Callable[[Analysis], L],
           fleet: Callable[[FleetOptions, Bounds], FleetResult[F]],
           fleet_check: Callable[[], None] | None = None) -> Asked[L, F]:
    """The one choice between the fleet and a local file: ``fleet(options, window)``
    with --nodes/--config (or a config found), else ``local(analysis)`` of --db/--lake
    in the command's window. ``fleet_check`` refuses values only the fleet refuses,
    before any certificate is read (a typo first)."""
    if fleet_mode(args):
        if fleet_check is not None:
            fleet_check()
        bounds = window_of(args)  # before any certificate is read: a typo first
        return Asked(result=fleet(fleet_options(args), bounds))
    with open_analysis(args) as (_, analysis):
        return Asked(local=local(analysis))


# ---- fleetd NAME for a question with a table --------------------------------------------


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for q in QUESTIONS:
        if q.columns and q.name not in HANDWRITTEN:
            _register(sub, q)


def _register(sub: argparse._SubParsersAction[argparse.ArgumentParser], q: Question) -> None:
    where = " in the window" if q.windowed else ""
    p = sub.add_parser(q.name, help=q.summary, description=(
        f"{q.summary[:1].upper()}{q.summary[1:]}{where}, of one database or (--nodes) of "
        f"every node; the same answer as GET {q.route} and the MCP tool {q.tool}."))
    if q.windowed:
        add_window(p)
    else:
        p.add_argument("--db", type=Path, help="database file (default: $FLEETD_DB, "
                       "else a per-user path)")
        p.add_argument("--lake", type=Path, metavar="DIR",
                       help="a Parquet lake (copied into a temporary database first)")
        p.set_defaults(since=None, from_=None, to=None)
    for param in q.params:
        flag = "--" + param.name.replace("_", "-")
        if param.kind == "bool":
            p.add_argument(flag, dest=param.name, action="store_true", help=param.help)
        elif param.kind == "int":
            p.add_argument(flag, dest=param.name, type=positive(flag), metavar="N",
                           help=param.help)
        else:
            p.add_argument(flag, dest=param.name, help=param.help)
    p.add_argument("--format", default="table", help=f"output format: {'|'.join(FORMATS)}")
    add_fleet_args(p)
    p.set_defaults(func=lambda args: _run(args, q))


def _run(args: argparse.Namespace, q: Question) -> int:
    fmt = check_format(args.format)
    asked = ask(args, q, **{p.name: getattr(args, p.name) for p in q.params})
    body = asked.body()
    got = body.get(q.rows)
    found = [r for r in got if isinstance(r, dict)] if isinstance(got, list) else []
    rows = [[r.get(c) for c in q.columns] for r in found]
    write_rows(q.columns, rows, fmt, sys.stdout, {k: v for k, v in body.items()
                                                   if k != q.rows} | {q.rows: found})
    print_notes(body, bool(found), fmt)
    return asked.done(args, fmt == "json")
