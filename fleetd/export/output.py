"""Where an export goes: a file that appears only when complete (gzip for ``.gz``)."""

from __future__ import annotations

import gzip
import os
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from fleetd.errors import UsageError
from fleetd.export.model import ByteSink
from fleetd.security.private_dir import create_file
from fleetd.store.files import refuse_link

GZIP_LEVEL = 6  # most of the size gain of 9 at a fraction of the time


def check_output(path: Path) -> None:
    """Refuse an output that cannot be written, before any work is done for it, and a
    symbolic link at its path (never replaced or written through)."""
    refuse_link(path, "output")
    if path.is_dir():
        raise UsageError(f"output {str(path)!r} is a directory", "name a file: -o trace.json")
    if not path.parent.exists():
        raise UsageError(f"directory {str(path.parent)!r} does not exist",
                         "create it first, or write somewhere else with -o")


@contextmanager
def open_output(path: Path | None) -> Iterator[ByteSink]:
    """Write to a temporary file beside ``path`` and rename it at the end, so an
    interrupted export never leaves a truncated trace; ``None`` means stdout."""
    if path is None:
        yield sys.stdout.buffer
        sys.stdout.flush()
        return
    check_output(path)
    # A new name, created here and never through a link (O_EXCL | O_NOFOLLOW): a
    # directory shared with other users cannot redirect the write.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # Root's outputs hold every traced process's names: its own only (docs/security.md).
    fd = create_file(tmp, 0o600 if os.geteuid() == 0 else 0o666)
    try:
        with open(fd, "wb") as raw:
            if path.name.endswith(".gz"):
                # mtime=0 and no file name inside: the same trace gives the same bytes.
                with gzip.GzipFile(filename="", mode="wb", fileobj=raw,
                                   compresslevel=GZIP_LEVEL, mtime=0) as gz:
                    yield gz
            else:
                yield raw
        os.replace(tmp, path)
    finally:
        with suppress(FileNotFoundError):
            tmp.unlink()
