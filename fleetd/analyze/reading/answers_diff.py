"""``fleetd diff``'s answer (two GPU timelines compared, :func:`fleetd.analyze.gpu.diff.gpu_diff`)
as typed dictionaries: a family of :mod:`fleetd.analyze.reading.answers`, which lists
them with the others (docs/json.md gives their keys there). Only ``typing`` is imported.
"""

from __future__ import annotations

from typing import TypedDict

Figures = dict[str, float | None]  # a side's headline figures, by metric name


class DiffRank(TypedDict):
    node: str
    pid: int
    rank: int | None
    device: int


class DiffSide(TypedDict):
    """One timeline of the two: where it came from, its ranks, its headline figures."""

    source: str
    ranks: list[DiffRank]
    figures: Figures


class MetricDelta(TypedDict):
    """A headline figure on both sides; ``worse``: None where neither way is worse."""

    metric: str
    baseline: float | None
    target: float | None
    delta: float | None
    delta_pct: float | None
    worse: bool | None


class StepDelta(TypedDict):
    """The n-th profiler step of each side (its time averaged over the side's ranks)."""

    index: int
    baseline_name: str | None
    target_name: str | None
    baseline_ns: float | None
    target_ns: float | None
    delta_ns: float | None
    delta_pct: float | None


class KernelDelta(TypedDict):
    """A kernel by name on both sides; ``only_in``: the one side that ran it."""

    name: str
    baseline_count: int
    target_count: int
    baseline_ns: int
    target_ns: int
    delta_ns: int
    delta_pct: float | None
    baseline_mean_ns: float | None
    target_mean_ns: float | None
    only_in: str | None


class GpuDiff(TypedDict):
    """``fleetd diff --format json``."""

    baseline: DiffSide
    target: DiffSide
    metrics: list[MetricDelta]
    regressions: list[str]  # the metrics that got worse, largest change first
    steps: list[StepDelta]
    kernels: list[KernelDelta]
    warnings: list[str]


# In the order docs/json.md lists them (fleetd.analyze.reading.answers.ANSWERS takes them).
DIFF_SHAPES: tuple[type, ...] = (GpuDiff, DiffSide, DiffRank, MetricDelta, StepDelta,
                                 KernelDelta)
