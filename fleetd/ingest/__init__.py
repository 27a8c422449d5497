"""Importers: profiler files recorded elsewhere (Nsight Systems, PyTorch/Kineto) into a
node database, as sessions like the ones fleetd records itself.

* :mod:`~fleetd.ingest.session`: what every importer shares (an untrusted file read
  within bounds, the import report, all or nothing);
* :mod:`~fleetd.ingest.nsys`: Nsight Systems SQLite exports;
* :mod:`~fleetd.ingest.kineto`: PyTorch profiler traces, read by ``kineto_text`` (the
  JSON, checked), turned into rows by ``kineto_events`` and staged by ``kineto_stage``.

:func:`import_traces` is the entry ``fleetd import`` calls.
"""

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
