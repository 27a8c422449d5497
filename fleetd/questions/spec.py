"""What one question is: :class:`Param`, :class:`Params` and :class:`Question`.

A parameter is parsed in one place for every entry point: the node reads it from a
query string (:meth:`Question.parse`, refusing a bad value with ``bad_request`` and
the value quoted), the fleet client writes it into one (:meth:`Question.encode`), the
CLI and the MCP tools hand in typed values (:meth:`Question.values`). The window goes
the same way, as a :class:`fleetd.store.bounds.Bounds`: :meth:`Question.query` writes
it beside the parameters, :meth:`Question.window` reads it back on the node.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from fleetd.errors import FleetdError, QueryError
from fleetd.store.bounds import Bounds
from fleetd.wire import paths
from fleetd.wire.limits import INT64_MAX

if TYPE_CHECKING:
    from fleetd.analyze.facade import Analysis

Kind = Literal["int", "str", "bool"]
TRUE_WORDS = ("1", "true", "yes")
Answer = Mapping[str, Any]  # an analyzer's answer (a TypedDict of fleetd.analyze.reading.answers)


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter: ``int`` (positive, at most ``limit``), ``str`` or ``bool``.
    ``read`` turns a string's text into its value (raising FleetdError for a bad one),
    ``write`` the value back into text; both default to the kind's own."""

    name: str
    kind: Kind
    default: Any = None
    limit: int | None = None
    help: str = ""
    read: Callable[[str], Any] | None = None
    write: Callable[[Any], str] | None = None

    def parse(self, text: str | None) -> Any:
        """The value of a query parameter's text (absent or empty: the default)."""
        if not text:
            return self.default
        if self.kind == "bool":
            return text in TRUE_WORDS
        if self.kind == "int":
            return self._int(text)
        if self.read is None:
            return text
        try:
            return self.read(text)
        except FleetdError as exc:
            raise QueryError(exc.message, exc.hint, code="bad_request") from None

    def _int(self, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        top = INT64_MAX if self.limit is None else self.limit  # SQLite binds 64 bits
        if value <= 0 or value > top:
            raise QueryError(f"{self.name}={text[:40]!r} must be a positive integer no "
                             f"larger than {top}", None, code="bad_request")
        return value

    def text(self, value: Any) -> str | None:
        """The query text of ``value``; None (not sent) for an unset one."""
        if value is None or value is False or value == 0 or value == "" or value == {}:
            return None
        if self.write is not None:
            return self.write(value)
        return "1" if value is True else str(value)


@dataclass(frozen=True, slots=True)
class Params:
    """A question's parameter values by name, each of its parameter's kind."""

    values: Mapping[str, Any] = field(default_factory=dict)

    def maybe_int(self, name: str) -> int | None:
        got = self.values.get(name)
        return got if isinstance(got, int) and not isinstance(got, bool) else None

    def num(self, name: str) -> int:
        return self.maybe_int(name) or 0

    def text(self, name: str) -> str | None:
        got = self.values.get(name)
        return got if isinstance(got, str) and got else None

    def flag(self, name: str) -> bool:
        return self.values.get(name) is True

    def get(self, name: str) -> Any:
        return self.values.get(name)


NodeAnswer = Callable[["Analysis", str, Params], Answer]
LocalAnswer = Callable[["Analysis", Params], Answer]
# What a fleet answer gains from its nodes' answers (a TypedDict per question, beside its
# combine in fleetd.questions.catalog). Each node's answer comes as the fleet client holds
# it (fleet/fanout.NodeOutcome.replies): its reader's answer, or the parsed body whose
# numbers were checked, tagged with the node's name and in this machine's clock.
Combine = Callable[[list[dict[str, object]]], Mapping[str, object]]
# A question's reader: a node's answer as parsed (untrusted: its values are ``object``
# until read) to the checked answer, of the type the reader names (ChainsReply, ...).
Check = Callable[[dict[str, object]], Mapping[str, object]]


@dataclass(frozen=True, slots=True)
class Question:
    """One question, declared once (see the package's docstring).

    ``answer(analysis, node, params)`` is a node's answer (``{"node": ..., **it}`` when
    ``tag_node``); ``local(analysis, params)`` the answer of a local database (default:
    ``answer`` without the node); ``combine(nodes)`` the keys the fleet answer gains
    from the node answers (each tagged with its node, in this machine's clock);
    ``expect`` a key every node answer has, ``check`` its reader (:mod:`fleetd.wire`,
    given an answer whose numbers all fit: ``fleetd.fleet.fanout.check_numbers``);
    ``node_warnings``: the nodes' window warnings become the fleet's. ``columns`` and
    ``rows`` make a table of the answer (the generic command, :mod:`fleetd.cli.questions`),
    ``tool`` its MCP tool when it has one of its own; ``shape`` the TypedDict of a
    node's answer (docs/api.md)."""

    name: str
    summary: str
    params: tuple[Param, ...]
    answer: NodeAnswer
    expect: str
    path: str = ""  # a fleetd.wire.paths constant (tests/unit/test_wire.py); default /api/v1/NAME
    local: LocalAnswer | None = None
    combine: Combine | None = None
    check: Check | None = None
    windowed: bool = True
    tag_node: bool = True
    node_warnings: bool = True
    columns: tuple[str, ...] = ()
    rows: str = ""
    tool: str | None = None
    description: str = ""
    validate: Callable[[Params], None] | None = None  # across parameters; raises FleetdError
    shape: Any = None  # the TypedDict of a node's answer (fleetd.wire), when declared

    @property
    def route(self) -> str:
        """The node API path that answers it."""
        return self.path or paths.PREFIX + self.name

    def parse(self, query: Mapping[str, str]) -> Params:
        """A node request's parameters, in declared order (the first bad one refused),
        then checked together."""
        params = Params({p.name: p.parse(query.get(p.name)) for p in self.params})
        if self.validate is not None:
            try:
                self.validate(params)
            except FleetdError as exc:
                raise QueryError(exc.message, exc.hint, code="bad_request") from None
        return params

    def values(self, given: Mapping[str, Any]) -> Params:
        """Typed values from a caller (CLI flags, tool arguments), defaults filled in; a
        name the question does not have is a programming error, said at once."""
        unknown = sorted(set(given) - {p.name for p in self.params})
        if unknown:
            raise TypeError(f"question {self.name!r} has no parameter {', '.join(unknown)}")
        return Params({p.name: p.default if given.get(p.name) is None else given[p.name]
                       for p in self.params})

    def encode(self, params: Params) -> dict[str, str]:
        """The query parameters that ask a node this question with ``params``."""
        out: dict[str, str] = {}
        for p in self.params:
            text = p.text(params.get(p.name))
            if text is not None:
                out[p.name] = text
        return out

    def query(self, bounds: Bounds, params: Params, offset_ns: int = 0) -> dict[str, str]:
        """The query parameters that ask a node, whose clock is ``offset_ns`` ahead of
        ours, this question over ``bounds`` (when it takes a window) with ``params``."""
        return {**(bounds.params(offset_ns) if self.windowed else {}), **self.encode(params)}

    def window(self, query: Mapping[str, str]) -> Bounds:
        """A request's window as :meth:`query` wrote it (``bad_request`` for a bad one);
        the whole recording for a question that takes none."""
        return Bounds.from_params(query) if self.windowed else Bounds()

    def answer_locally(self, analysis: Analysis, params: Params) -> Answer:
        if self.local is not None:
            return self.local(analysis, params)
        return self.answer(analysis, "", params)

    def on_node(self, analysis: Analysis, node: str, params: Params) -> Answer:
        got = self.answer(analysis, node, params)
        return {"node": node, **got} if self.tag_node else dict(got)
