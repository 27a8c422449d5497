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
        self.polls = 0  # poll() calls completed by the thread
        self._paused = threading.Event()

    def __enter__(self) -> Traced:
        self.tracer.start()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._paused.is_set():
                time.sleep(0.005)
                continue
            self.tracer.poll(20)
            self.polls += 1

    def pause(self) -> None:
        """Leave records in the rings (until resume()): a backlog to drain at full speed."""
        self._paused.set()
        p = self.polls
        while self.polls == p and not self._stop.is_set():  # the poll under way ends
            time.sleep(0.002)

    def resume(self) -> None:
        self._paused.clear()

    def drain(self) -> None:
        """Wait until what the rings held when called is committed: a whole poll that
        began after the call has found them empty (a few ms late at most, so a
        throughput measured up to here is not diluted by idle waiting)."""
        while True:
            p = self.polls
            while self.polls < p + 2:  # the one running now, then one begun after
                time.sleep(0.002)
            if not self.tracer.backlog():
                break
        self.writer.flush()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.summary = self.tracer.stop()
        self.writer.close()
