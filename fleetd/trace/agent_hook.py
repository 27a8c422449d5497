"""The tracer as the node agent runs it: started into the agent's writer, polled by a
background thread, observed through ``stats()``, stopped (flushed) on shutdown."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from fleetd.store.health import TraceStats
from fleetd.store.writer import BatchWriter
from fleetd.trace.bpf.modes import LAUNCH_RETURNS
from fleetd.trace.enrich.oncpu import DEFAULT_HZ
from fleetd.trace.tracer import GPU_LAYERS, TraceConfig, Tracer, TraceSummary

log = logging.getLogger("fleetd.trace.agent")


class AgentTracer:
    """TracerHandle for fleetd.node.agent: start(), stop(), stats()."""

    def __init__(self, cfg: TraceConfig, writer: BatchWriter) -> None:
        self.tracer = Tracer(cfg, writer=writer)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rate = 0.0
        self._last = (0.0, 0)
        self.summary: TraceSummary | None = None
        self.error: str | None = None

    def start(self) -> None:
        self.tracer.start(lambda msg: log.info("tracer starting: %s", msg))
        self._last = (time.monotonic(), 0)
        self._thread = threading.Thread(target=self._run, name="fleetd-trace", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.tracer.poll(100)
        except Exception as exc:  # keep serving the database; say why tracing ended
            self.error = str(exc)
            log.exception("tracing stopped: %s", exc)

    def ask_detail(self, seconds: float) -> bool:
        """fleetd.node.detail: trace launches whole for ``seconds`` from the next poll;
        False when there is no duty cycle (--mode full: they always are)."""
        return self.tracer.ask_launch_window(int(seconds * 1e9))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.tracer.bpf is not None:
            self.summary = sm = self.tracer.stop()
            # One line an operator (and bench/agent_load.py) can read: loss is either
            # counted in the session record, or it is a bug shown here. An ordinary stop
            # is information; a loss is a warning.
            level = logging.WARNING if sm.lost_total or sm.unreported_loss else logging.INFO
            log.log(level, "trace session %d ended: %d events written, %d lost (counted), "
                    "%d unreported", sm.session, sm.events_written, sm.lost_total,
                    sm.unreported_loss)

    def stats(self) -> TraceStats:
        if self.tracer.bpf is None:
            return {"events_per_s": 0.0, "lost": 0, "running": False, "error": self.error}
        st = self.tracer.status()
        now = time.monotonic()
        t0, n0 = self._last
        if now - t0 >= 1.0:
            self._rate = (st["records"] - n0) / (now - t0)
            self._last = (now, st["records"])
        return {**st, "events_per_s": self._rate, "running": self._thread is not None
                and self._thread.is_alive(), "error": self.error}


def tracer_factory(*, node: str, pids: list[int], all_processes: bool,
                   cuda_lib: Path | str | None, host: bool,
                   sample: int | None, cpu_sample_hz: int = DEFAULT_HZ,
                   launch_returns: bool = LAUNCH_RETURNS, mode: str = "full",
                   ) -> Callable[[BatchWriter], AgentTracer]:
    """What ``fleetd agent`` calls: a factory that builds the tracer on its writer."""
    layers = frozenset((*GPU_LAYERS, "host") if host else GPU_LAYERS)

    def make(writer: BatchWriter) -> AgentTracer:
        cfg = TraceConfig(
            db=writer.path, node=node, pids=[] if all_processes else list(pids),
            cuda_libs=[str(cuda_lib)] if cuda_lib else [], layers=layers,
            sample=100 if sample is None else sample, command="fleetd agent",
            cpu_sample_hz=cpu_sample_hz, launch_returns=launch_returns, mode=mode,
        )
        return AgentTracer(cfg, writer)

    return make
