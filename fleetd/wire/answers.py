"""The analyzers' answers (docs/json.md) as typed dictionaries, for the agent and client.

The analyzers build their answers as these types; the agent serves them and the fleet
client, the MCP server and the CLI read and render them, so mypy holds both ends to one
shape. The classes are defined in :mod:`fleetd.analyze.reading.answers`, beside their producers
(an analyzer may not import this layer, docs/architecture.md); this module names them
for the layers above. It imports nothing heavy: ``typing`` and that one module.
"""

from __future__ import annotations

from fleetd.analyze.reading.answers import (
    ANSWERS,
    AlignmentSummary,
    ClockJson,
    CollectiveRank,
    CollectivesAnswer,
    CollectiveStraggler,
    Communicator,
    CommunicatorAlignment,
    CpuProfile,
    CpuStack,
    CpuStacksAnswer,
    Delays,
    ExposedPrep,
    FlameStack,
    FlameStacks,
    FrameShare,
    GpuAnswer,
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
    KernelRow,
    OverviewAnswer,
    OverviewSession,
    RankSpan,
    RankStraggler,
    RankVerdict,
    StackGroup,
    StackProcess,
    StacksAnswer,
)

__all__ = [
    "ANSWERS", "AlignmentSummary", "ClockJson", "CollectiveRank", "CollectiveStraggler",
    "CollectivesAnswer", "Communicator", "CommunicatorAlignment", "CpuProfile", "CpuStack",
    "CpuStacksAnswer", "Delays", "ExposedPrep", "FlameStack", "FlameStacks", "FrameShare",
    "GpuAnswer", "GpuFigures", "GpuRank", "GpuStep", "GraphEpisode", "GraphPhase", "GraphProcess",
    "GraphRates", "GraphTimeline", "GraphsAnswer", "Judgement", "KernelRow",
    "OverviewAnswer", "OverviewSession", "RankSpan", "RankStraggler", "RankVerdict", "StackGroup",
    "StackProcess", "StacksAnswer",
]
