"""Importers: profiler files recorded elsewhere (Nsight Systems, PyTorch/Kineto) into a
node database, as sessions like the ones fleetd records itself."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fleetd.ingest import kineto, nsys
from fleetd.ingest.session import ImportReport, Reader, import_files

READERS: dict[str, Reader] = {"nsys": nsys.read, "kineto": kineto.read}


def import_traces(paths: Sequence[Path], db: Path, node: str | None = None,
                  fmt: str = "auto") -> list[ImportReport]:
    """Import ``paths`` into ``db``; every file is checked before anything is written."""
    return import_files(paths, db, node, fmt, READERS)


__all__ = ["READERS", "ImportReport", "import_traces"]
