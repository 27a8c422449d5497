"""The analyzers' answers (docs/json.md) as typed dictionaries, for the agent and client.

The analyzers build their answers as these types; the agent serves them and the fleet
client, the MCP server and the CLI read and render them, so mypy holds both ends to one
shape. The classes are defined in :mod:`fleetd.analyze.reading.answers` (the
collectives' in :mod:`fleetd.analyze.reading.answers_collectives`), beside their
producers (an analyzer may not import this layer, docs/architecture.md); this module
names them for the layers above. It imports nothing heavy: ``typing`` and those two.
"""

from __future__ import annotations

from fleetd.analyze.reading import answers_collectives as _collectives
from fleetd.analyze.reading import answers_diff as _diff
from fleetd.analyze.reading.answers import (
    ANSWERS,
    ChainDetail,
    ChainJson,
    CpuProfile,
    CpuStack,
    CpuStacksAnswer,
    Culprit,
    Delays,
    EvidenceItem,
    ExplainReport,
    ExposedPrep,
    FlameStack,
    FlameStacks,
    FrameShare,
    GpuAnswer,
    GpuBrief,
    GpuFigures,
    GpuRank,
    GpuStep,
    GraphEpisode,
    GraphPhase,
    GraphProcess,
    GraphRates,
    GraphsAnswer,
    GraphTimeline,
    Judgement,
    KernelFigures,
    KernelRow,
    MetricScore,
    NodeExplain,
    NodeProfile,
    NoProfile,
    OpRow,
    OverviewAnswer,
    OverviewSession,
    ProcessRow,
    RankedCulprit,
    RankSpan,
    RankStraggler,
    RankVerdict,
    StackGroup,
    StackProcess,
    StacksAnswer,
    StragglerEntry,
    Victim,
    WindowJson,
)

# The collectives' family, named here as the others are.
AlignmentSummary = _collectives.AlignmentSummary
ClockJson = _collectives.ClockJson
CollectiveRank = _collectives.CollectiveRank
CollectivesAnswer = _collectives.CollectivesAnswer
CollectiveStraggler = _collectives.CollectiveStraggler
Communicator = _collectives.Communicator
CommunicatorAlignment = _collectives.CommunicatorAlignment
Stretch = _collectives.Stretch
# fleetd diff's.
GpuDiff = _diff.GpuDiff
DiffSide = _diff.DiffSide
DiffRank = _diff.DiffRank
MetricDelta = _diff.MetricDelta
StepDelta = _diff.StepDelta
KernelDelta = _diff.KernelDelta

__all__ = [
    "ANSWERS", "AlignmentSummary", "DiffRank", "DiffSide", "GpuDiff", "KernelDelta",
    "MetricDelta", "StepDelta", "ChainDetail", "ChainJson", "ClockJson",
    "CollectiveRank", "CollectiveStraggler", "CollectivesAnswer", "Communicator",
    "CommunicatorAlignment", "CpuProfile", "CpuStack", "CpuStacksAnswer", "Culprit",
    "Delays", "EvidenceItem", "ExplainReport", "ExposedPrep", "FlameStack", "FlameStacks",
    "FrameShare", "GpuAnswer", "GpuBrief", "GpuFigures", "GpuRank", "GpuStep",
    "GraphEpisode", "GraphPhase", "GraphProcess", "GraphRates", "GraphTimeline",
    "GraphsAnswer", "Judgement", "KernelFigures", "KernelRow", "MetricScore", "NoProfile",
    "NodeExplain", "NodeProfile", "OpRow", "OverviewAnswer", "OverviewSession", "ProcessRow",
    "RankSpan", "RankStraggler", "RankVerdict", "RankedCulprit", "StackGroup", "StackProcess",
    "StacksAnswer", "StragglerEntry", "Stretch", "Victim", "WindowJson"
]
