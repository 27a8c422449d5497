"""``fleetd completion bash|zsh``: a shell completion script generated from the parsers.

The script is written by ``shtab`` from the same argparse tree ``fleetd --help`` shows,
so a new flag completes without anyone editing a script. Files complete for paths
(``--db``, ``-o``, certificates); everything else completes from the parsers.
"""

from __future__ import annotations

import argparse
import sys

SHELLS = ("bash", "zsh")


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


def run(args: argparse.Namespace) -> int:
    import shtab

    from fleetd.cli.main import build_parser

    sys.stdout.write(shtab.complete(build_parser(), shell=args.shell))
    return 0
