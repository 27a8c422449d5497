"""The real Tracer on worker processes, polled by a background thread: shared by the
benchmarks that compare traced and untraced runs (tracer_overhead, nccl)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleetd.store.writer import BatchWriter  # noqa: E402
from fleetd.trace.tracer import TraceConfig, Tracer  # noqa: E402


class Traced:
    """Trace ``pids`` (default settings unless ``overrides``) for the ``with`` block;
    ``summary`` holds the tracer's summary afterwards."""

    def __init__(self, db: Path, pids: list[int], **overrides: Any) -> None:
        cfg = TraceConfig(db=db, node="bench", pids=pids, **overrides)
        self.writer = BatchWriter(db, "bench")
        self.tracer = Tracer(cfg, writer=self.writer)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.summary: Any = None

    def __enter__(self) -> Traced:
        self.tracer.start()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.tracer.poll(50)

    def drain(self) -> None:
        """Wait until the rings are empty and everything read is committed."""
        last = -1
        while last != self.tracer.decoder.records:
            last = self.tracer.decoder.records
            time.sleep(0.15)
        self.writer.flush()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.summary = self.tracer.stop()
        self.writer.close()
