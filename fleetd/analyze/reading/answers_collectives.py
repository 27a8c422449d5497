"""The NCCL collectives' answer (``fleetd collectives``, ``Analysis.collectives``; the
fleet client compares the nodes'), as typed dictionaries: a family of
:mod:`fleetd.analyze.reading.answers`, which names them with the others (docs/json.md
lists their keys there). Only ``typing`` is imported.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

# ---- NCCL collective arrival (fleetd collectives; the fleet client compares) -----------


class AlignmentSummary(TypedDict):
    """How the ranks' collective numbers were matched (the weakest, over the report)."""

    method: str
    confidence: str
    by: str
    text: str


class Stretch(TypedDict):
    """A stretch of a process's calls (numbered again after a restart): the offset added
    to its numbers and, aligned from the calls, how it was found."""

    rank: int
    node: str
    pid: int
    offset: int
    confidence: str
    by: NotRequired[str]
    pairs: NotRequired[int]
    residual_ns: NotRequired[int | None]
    runner_up_ns: NotRequired[int | None]
    reason: NotRequired[str | None]


class CommunicatorAlignment(AlignmentSummary):
    renumbered: int
    stretches: list[Stretch]


class CollectiveRank(TypedDict):
    rank: int
    node: str
    pid: int
    comm: str | None
    count: int
    bytes: int
    failures: int
    judged: int
    last: int
    last_ambiguous: int
    last_share: float | None
    lateness_p50_ns: int | None
    lateness_p99_ns: int | None


class CollectiveStraggler(TypedDict):
    communicator: str
    matching: str
    rank: int
    node: str
    pid: int
    comm: str | None
    share_last: float
    last: int
    judged: int
    lateness_p50_ns: int | None
    lateness_p99_ns: int | None
    reason: str


class Communicator(TypedDict):
    key: str
    matching: str  # communicator | torchrun
    job: str | None
    nranks: int | None
    alignment: CommunicatorAlignment
    ranks_seen: int
    instances: int
    judged: int
    ambiguous: int
    incomplete: int
    partial: bool
    op_mismatch: int
    first_ts_ns: int | None
    last_ts_ns: int | None
    ops: dict[str, int]
    straggler: CollectiveStraggler | None
    verdict: str
    ranks: list[CollectiveRank]


class ClockJson(TypedDict):
    offset_ns: int
    error_ns: int | None
    domain: NotRequired[str]


class CollectivesAnswer(TypedDict):
    """Collective arrival per communicator and rank (``Analysis.collectives``)."""

    matching: str | None  # communicator | torchrun | mixed
    alignment: AlignmentSummary | None
    verdict: str
    communicators: list[Communicator]
    stragglers: list[CollectiveStraggler]
    events: int
    unmatched: int
    truncated: bool
    clocks: dict[str, ClockJson]
    notes: list[str]


# In the order docs/json.md lists them (fleetd.analyze.reading.answers.ANSWERS takes them).
COLLECTIVE_SHAPES: tuple[type, ...] = (
    CollectivesAnswer, AlignmentSummary, CommunicatorAlignment, Stretch, Communicator,
    CollectiveRank, CollectiveStraggler, ClockJson)
