"""The questions fleetd answers over a node's analysis, each declared once.

A :class:`~fleetd.questions.spec.Question` names its API path, its parameters (types,
defaults, limits, help), whether it takes a window, the function that answers it over
the analyzer facade, how the answers of several nodes combine, the reader that checks a
node's answer, and its MCP tool. The node's routes (``fleetd.node.analysis``), the fleet
client's call (``fleetd.fleet.queries.ask``), the MCP tools and the CLI's local/fleet
choice (``fleetd.cli.questions``) are derived from :data:`~fleetd.questions.catalog.QUESTIONS`.
"""
