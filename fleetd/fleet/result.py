"""What a fleet operation hands to the CLI, the MCP tools and the exporter: the fan-out's
answer, the JSON object ``--format json`` prints (docs/json.md) and the rows the table
formats need; and the one rule that turns every node's refusal into a usage error."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypedDict, TypeVar

from fleetd.errors import QueryError
from fleetd.fleet.combine import NodeWarning
from fleetd.fleet.fanout import FleetAnswer

# Refusals that mean the request itself is wrong: if every node says so, it is the
# user's mistake (exit 2 with the node's message), not an outage.
USER_ERROR_CODES = frozenset({"bad_query", "bad_request", "forbidden", "too_large"})

# The JSON type of an operation's answer: the TypedDict beside its producer
# (fleetd.fleet.queries, fleetd.fleet.collectives).
J = TypeVar("J", bound=Mapping[str, object], covariant=True)


@dataclass(slots=True)
class FleetResult(Generic[J]):
    answer: FleetAnswer
    obj: J  # what --format json prints
    columns: list[str] = field(default_factory=list)  # the row formats
    rows: list[list[Any]] = field(default_factory=list)

    @property
    def warnings(self) -> list[NodeWarning]:
        return self.answer.warnings

    @property
    def exit_code(self) -> int:
        return self.answer.exit_code


def raise_if_user_error(answer: FleetAnswer) -> None:
    """Every node refused the request as malformed: say so once, as a usage error."""
    if answer.answered or not answer.outcomes:
        return
    fails = [o.failure for o in answer.outcomes if o.failure is not None]
    if fails and all(f.kind == "http" and f.code in USER_ERROR_CODES for f in fails):
        f = fails[0]
        message = f.message.split(": ", 1)[-1]
        raise QueryError(f"every node refused the request: {message}", f.hint,
                         code=f.code or "bad_request")


class BaseJson(TypedDict):
    """What every fleet answer's JSON carries: the nodes' warnings and clock offsets."""

    warnings: list[dict[str, str]]  # NodeWarning.to_json: node, error, kind
    skew: dict[str, dict[str, float]]  # node -> its offset (FleetAnswer.skew_json)


def base_json(answer: FleetAnswer) -> BaseJson:
    return {"warnings": [w.to_json() for w in answer.warnings], "skew": answer.skew_json()}


class WindowLabel(TypedDict):
    """A fleet answer's window: how the user gave it (each node sends its own)."""

    label: str
