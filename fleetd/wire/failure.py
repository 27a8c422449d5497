"""Why one node gave no usable answer, and the one error a bad answer becomes.

A failed node is an expected outcome of a fan-out, so a :class:`Failure` is a value
(kept in the node's outcome, sent per peer in a relay's answer); :class:`NodeFailed`
carries one up to the fan-out, which records it as that node's failure in one place.
:class:`BadReply` is the :class:`NodeFailed` of an answer that arrived but does not fit
its documented shape: the wire's checked readers raise it wherever an answer is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetd.wire.shapes import FailureJson

# Statuses an idempotent read may be retried after.
RETRYABLE_STATUS = frozenset({429, 502, 503, 504})
BAD_REPLY_HINT = "is this a fleetd agent, and an unmodified one?"
# Every kind a Failure may have; a relay's report of another kind is its own (relay).
FAILURE_KINDS = frozenset({"refused", "unreachable", "tls", "timeout", "disconnected", "http",
                           "bad_json", "too_large", "relay", "skew"})


@dataclass(frozen=True, slots=True)
class Failure:
    """Why one node gave no usable answer."""

    kind: str  # refused | unreachable | tls | timeout | disconnected | http | bad_json
    # | too_large | relay | skew
    message: str
    hint: str | None = None
    status: int | None = None  # HTTP status, for kind == "http"
    code: str | None = None  # the node's error code, for kind == "http"

    @property
    def retryable(self) -> bool:
        # Refused and disconnected cover an agent that is restarting; TLS, 4xx and bad
        # JSON will not change on a second try.
        if self.kind in ("refused", "disconnected"):
            return True
        return self.kind == "http" and self.status in RETRYABLE_STATUS

    def text(self) -> str:
        out = f"{self.kind}: {self.message}"
        return f"{out} (hint: {self.hint})" if self.hint else out

    def to_json(self) -> FailureJson:
        return {"kind": self.kind, "message": self.message, "hint": self.hint,
                "status": self.status, "code": self.code}


class NodeFailed(Exception):
    """One node's request failed; the fan-out turns it into that node's failure."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.text())
        self.failure = failure


class BadReply(NodeFailed, ValueError):
    """A node's answer breaks its documented shape; the message says where. A
    ``ValueError`` too: a checker's caller may treat it as one bad value."""

    def __init__(self, message: str, hint: str | None = BAD_REPLY_HINT, *,
                 kind: str = "bad_json", code: str | None = None) -> None:
        super().__init__(Failure(kind, message, hint, code=code))
        self.message = message

    def __str__(self) -> str:
        return self.message
