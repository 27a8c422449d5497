"""The JSON shapes of the node API's answers (docs/api.md), as typed dictionaries.

The agent builds its answers as these types and the client's checked readers return
them, so mypy holds both ends to one shape. A shape here is what the wire carries;
checking that an untrusted answer really has it is :mod:`fleetd.wire.values`' and
:mod:`fleetd.wire.query`'s work.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NotRequired, TypedDict

from fleetd.analyze.distributed.hangs import RankEntry
from fleetd.analyze.reading.answers import ChainJson, OpRow, ProcessRow, WindowJson


class ErrorDetail(TypedDict):
    """``{"error": {...}}``: every failure's body, and a failed stream's trailer."""

    code: str
    message: str
    hint: NotRequired[str | None]


class ErrorReply(TypedDict):
    error: ErrorDetail


class HealthReply(TypedDict):
    """``GET /api/v1/health``; ``trace`` and the tracer's figures while tracing."""

    status: str
    node: str
    version: str
    schema_version: int
    tracing: bool
    uptime_s: float
    trace: NotRequired[dict[str, Any]]


class TimeReply(TypedDict):
    """``GET /api/v1/time``: the agent's wall clock when the request came and left."""

    node: str
    t1_ns: int
    t2_ns: int


class QueryLimits(TypedDict):
    max_rows: int
    max_bytes: int
    timeout_s: float


class QueryReply(TypedDict):
    """``POST /api/v1/query`` as one JSON document, and a streamed answer once read."""

    node: str | None
    columns: list[str]
    rows: Sequence[Sequence[Any]]  # arrays on the wire; the agent hands SQLite's tuples
    truncated: bool
    truncated_reason: str | None  # rows | bytes
    elapsed_ms: float | None


class StreamHeader(TypedDict):
    """The first line of a streamed query answer."""

    node: str
    columns: list[str]
    limits: QueryLimits


class StreamTrailer(TypedDict):
    """The last line of a streamed query answer; ``error`` when it failed mid-way."""

    end: bool
    rows: int
    truncated: bool
    truncated_reason: str | None
    elapsed_ms: NotRequired[float]
    error: NotRequired[ErrorDetail]


class ChainsReply(TypedDict):
    """``GET /api/v1/chains``: causal chains, most severe first (docs/explain.md); read
    back by :func:`fleetd.wire.chains.check_chains_reply`."""

    node: str
    window: WindowJson
    verdict: str
    chains: list[ChainJson]
    processes: list[ProcessRow]
    warnings: list[str]


class OpsReply(TypedDict):
    """``GET /api/v1/ops``: op (or kernel) statistics, rows as ``fleetd ops`` prints."""

    node: str
    window: WindowJson
    warnings: list[str]
    ops: list[OpRow]


class QueryBody(TypedDict):
    """``POST /api/v1/query``'s body, as the fleet client sends it."""

    sql: str
    params: list[Any]  # SQL parameters: any value SQLite binds (text, numbers, null)
    max_rows: NotRequired[int]
    max_bytes: NotRequired[int]
    timeout_s: NotRequired[float]


class RelayedRequest(TypedDict):
    """One request a relay sends each of its peers, as the client writes it (fleetd.relay
    reads it back, checked, into its own ``_Relayed``)."""

    method: str
    path: str
    params: NotRequired[dict[str, str]]
    body: NotRequired[QueryBody | dict[str, object]]  # as fleet.fanout.Request.body
    # Where the body or params hold times in the node's clock: each peer's gets the
    # relay's offset to that peer added (fleet/relayed.py time_paths).
    shift: NotRequired[list[list[str | int]]]


class RelayTarget(TypedDict):
    name: str
    address: str


class RelayBody(TypedDict):
    """``POST /api/v1/relay``'s body: the peers to ask, what to ask them, the bounds."""

    targets: list[RelayTarget]
    requests: list[RelayedRequest]
    timeout_s: float
    skew_samples: int
    max_answer_bytes: int


class FailureJson(TypedDict):
    """Why a node gave no usable answer, as a relay reports it per peer."""

    kind: str
    message: str
    hint: str | None
    status: int | None
    code: str | None


class SkewJson(TypedDict):
    """A peer's clock minus the asker's, as a relay reports it per peer."""

    offset_ns: int
    error_ns: int
    samples: int
    used: int


class RelayNode(TypedDict):
    """One target's entry of a relay's answer; a target the relay did not ask (not one
    of its peers, or an answer past the size limit) has its failure only."""

    address: str
    name: str
    failure: FailureJson | None
    # Each peer's reply as the relay checked it; untrusted again once it crosses to the
    # client, which reads each one as it reads a direct answer (fleet/relayed.py).
    replies: NotRequired[list[dict[str, object]] | None]
    skew: NotRequired[SkewJson | None]
    skew_failure: NotRequired[FailureJson | None]


# ``for`` is a keyword: the functional form. The relay writes it piece by piece (each
# node's entry once, to keep the answer under its byte limit), so this is the shape the
# client reads back.
RelayReply = TypedDict("RelayReply", {"relay": str, "for": str, "nodes": list[RelayNode]})


# A rank (RankEntry and its calls) is the hang analyzer's model, defined once beside
# RankView in fleetd.analyze.distributed.hangs.


class RanksReply(TypedDict):
    """``GET /api/v1/ranks``, most recently active rank first."""

    node: str
    now_ns: int
    tracing: bool
    ranks: list[RankEntry]
    dropped: int
