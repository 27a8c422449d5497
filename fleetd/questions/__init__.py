"""The questions fleetd answers over a node's analysis, each declared once.

A :class:`~fleetd.questions.spec.Question` names its API path, its parameters (types,
defaults, limits, help), whether it takes a window and the function that answers it over
the analyzer facade; where a question has them, its local answer, how the answers of
several nodes combine, the wire's reader of a node's answer (``check``), the answer's
``TypedDict`` (``shape``), a table (``columns``) and an MCP tool of its own (``tool``).
docs/architecture.md ("fleetd.questions") names the questions that declare each, and
tests/unit/test_registry_doc.py holds those lists to the registry. The node's routes
(``fleetd.node.analysis``), the fleet client's call (``fleetd.fleet.queries.ask``), the
MCP tools and the CLI's local/fleet choice (``fleetd.cli.questions``) are derived from
:data:`~fleetd.questions.catalog.QUESTIONS`.
"""
