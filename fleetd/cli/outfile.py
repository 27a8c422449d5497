"""``-o FILE`` for every command with output to write: the file checked before any work
(refused when it exists unless ``--force``, a link at it refused), then written whole or
not at all: a temporary file beside it, renamed when complete (fleetd.export.output)."""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from fleetd.errors import UsageError


def add_output_args(p: argparse.ArgumentParser, what: str = "the output") -> None:
    p.add_argument("-o", "--output", metavar="FILE",
                   help=f"write {what} to FILE instead of stdout (refused when FILE "
                   "exists, unless --force)")
    p.add_argument("--force", action="store_true", help="let -o overwrite an existing file")


def output_path(args: argparse.Namespace) -> Path | None:
    """The file ``-o`` names (None: stdout), checked the way ``fleetd export -o`` checks
    its output, and refused when it exists unless ``--force``."""
    from fleetd.export.output import check_output

    if args.output is None or args.output == "-":
        return None
    path = Path(args.output)
    check_output(path)
    if path.exists() and not args.force:
        raise UsageError(f"{str(path)!r} exists",
                         "pass --force to overwrite it, or write elsewhere with -o")
    return path


@contextmanager
def writing(path: Path | None) -> Iterator[TextIO]:
    """Standard output, or a buffer written to ``path`` whole when the block ends (and
    nothing when it raises); says on stderr what was written."""
    if path is None:
        yield sys.stdout
        return
    from fleetd.export.output import open_output

    buf = io.StringIO()
    yield buf
    data = buf.getvalue().encode()
    with open_output(path) as sink:
        sink.write(data)
    print(f"wrote {path} ({len(data) / 1e3:.1f} kB)", file=sys.stderr)
