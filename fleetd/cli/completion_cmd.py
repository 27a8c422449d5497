"""``fleetd completion bash|zsh``: a shell completion script generated from the parsers.

The script is written by ``shtab`` from the same argparse tree ``fleetd --help`` shows,
so a new flag completes without anyone editing a script. Options that take a path
(``--db``, ``-o``, certificates, positional input files) complete file names, options
that take a directory complete directories, and options with choices complete those;
which is which is read from each option's ``type`` and metavar, so a new path option is
covered as well.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

SHELLS = ("bash", "zsh")
# Metavars that name a directory or a file, whatever the option's type.
_DIR_METAVARS = {"DIR"}
_FILE_METAVARS = {"FILE", "PATH", "PEM", "CONFIG", "IN.db", "OUT.db", "trace.json[.gz]"}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "completion",
        help="print a shell completion script (bash or zsh)",
        description="Print a completion script for the shell. bash: "
        "fleetd completion bash > /etc/bash_completion.d/fleetd (or source it from "
        "~/.bashrc); zsh: fleetd completion zsh > \"${fpath[1]}/_fleetd\".",
    )
    p.add_argument("shell", choices=SHELLS, help="the shell to complete for")
    p.set_defaults(func=run)


def mark_paths(parser: argparse.ArgumentParser) -> None:
    """Tell shtab which actions take paths (its ``complete`` attribute), recursively."""
    import shtab

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                mark_paths(child)
        elif action.nargs != 0 and action.choices is None:
            formats = _formats(action)
            if formats:
                # This parser only writes the script: choices here change no validation.
                action.choices = formats
                continue
            kind = _path_kind(action)
            if kind == "dir":
                action.complete = shtab.DIRECTORY  # type: ignore[attr-defined]
            elif kind == "file":
                action.complete = shtab.FILE  # type: ignore[attr-defined]


def _formats(action: argparse.Action) -> list[str] | None:
    """A ``--format`` validated by its command (for a better message than argparse's)
    lists its values in its help: ``output format: table|json``, ``table or json``."""
    if "--format" not in action.option_strings or not action.help:
        return None
    m = re.search(r"(?:output format: )?([a-z]+(?:(?:\|| or )[a-z]+)+)", action.help)
    return re.split(r"\|| or ", m.group(1)) if m else None


def _path_kind(action: argparse.Action) -> str | None:
    metavar = action.metavar if isinstance(action.metavar, str) else None
    if metavar in _DIR_METAVARS or action.dest in ("dir", "out", "lake", "parquet_dir"):
        return "dir"
    if action.type is Path or metavar in _FILE_METAVARS or action.dest in ("file", "output"):
        return "file"
    return None


def run(args: argparse.Namespace) -> int:
    import shtab

    from fleetd.cli.main import build_parser

    parser = build_parser()
    mark_paths(parser)
    sys.stdout.write(shtab.complete(parser, shell=args.shell))
    return 0
