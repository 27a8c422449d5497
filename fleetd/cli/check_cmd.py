"""``fleetd check``: can this machine trace? Kernel, BPF, tracefs, headers, libraries."""

from __future__ import annotations

import argparse
import json
import sys

from fleetd.errors import UsageError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check",
        help="check that this machine can trace (BPF, tracefs, headers, CUDA libraries)",
        description="Report the kernel version, BPF/BTF/tracefs availability, which kernel "
        "header route BCC compiles with, the bcc version, the CUDA libraries found and "
        "whether each probe attaches, with a fix for each failure. Exit status 1 when "
        "something required fails.",
    )
    p.add_argument("--format", default="table", help="table or json (default: table)")
    p.add_argument("--cuda-lib", action="append", default=[], metavar="PATH",
                   help="check this library instead of discovering (repeatable)")
    p.add_argument("--no-attach", action="store_true",
                   help="skip compiling the programs and attaching the probes")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fleetd.cli.output import table
    from fleetd.trace.check import FAIL, run_checks

    if args.format not in ("table", "json"):
        raise UsageError(f"--format {args.format!r} is not supported", "use table or json")
    checks = run_checks(args.cuda_lib, attach=not args.no_attach)
    if args.format == "json":
        print(json.dumps([c.as_dict() for c in checks], indent=2))
    else:
        rows = [(c.name, c.status, c.detail, c.fix) for c in checks]
        sys.stdout.write(table(["check", "status", "detail", "fix"], rows))
    return 1 if any(c.status == FAIL for c in checks) else 0
