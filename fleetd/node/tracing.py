"""The tracer inside the agent: started into the agent's writer, polled on its own thread.

BCC's ring-buffer poll blocks, so it never runs on the event loop; the loop only
reads the tracer's counters (cheap map lookups) for /health and /metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleetd.store.writer import BatchWriter
from fleetd.trace.tracer import TraceConfig, Tracer

log = logging.getLogger("fleetd.node.tracing")


class TracerThread:
    def __init__(self, cfg: TraceConfig, writer: BatchWriter) -> None:
        self.tracer = Tracer(cfg, writer=writer)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fleetd-tracer", daemon=True)
        self._rate = (time.monotonic(), 0)
        self.events_per_s = 0.0
        self.error: str | None = None

    def start(self) -> None:
        self.tracer.start()  # raises TraceError when nothing can be traced
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self.tracer.poll(100)
        except Exception as exc:  # keep serving the data already recorded
            self.error = f"tracer stopped: {exc}"
            log.exception("tracer loop failed; the agent keeps serving what was recorded")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        summary = self.tracer.stop()
        log.info("trace session %d: %d events, %d lost", summary.session,
                 summary.events_written, summary.lost_total)

    def stats(self) -> dict[str, Any]:
        status = self.tracer.status()
        t0, n0 = self._rate
        now, n = time.monotonic(), int(status.get("records", 0))
        if now - t0 >= 1.0:
            self.events_per_s = (n - n0) / (now - t0)
            self._rate = (now, n)
        status["events_per_s"] = round(self.events_per_s, 1)
        if self.error:
            status["error"] = self.error
        return status


def tracer_factory(
    *, node: str, db: Path, pids: list[int], cuda_lib: Path | None, host: bool, sample: int,
    max_db_bytes: int | None,
) -> Callable[[BatchWriter], TracerThread]:
    layers = {"cuda", "driver", "nccl"} | ({"host"} if host else set())
    cfg = TraceConfig(
        db=db, node=node, pids=list(pids), cuda_libs=[str(cuda_lib)] if cuda_lib else [],
        layers=frozenset(layers), sample=sample, max_db_bytes=max_db_bytes,
        command="fleetd agent",
    )
    return lambda writer: TracerThread(cfg, writer)
