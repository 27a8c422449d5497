"""The docs that can drift are checked against the code."""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_cli_reference_matches_the_parsers() -> None:
    proc = subprocess.run([sys.executable, "scripts/gen_cli_docs.py", "--check"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_readme_starts_with_the_two_setup_commands() -> None:
    lines = [x for x in (REPO / "README.md").read_text().splitlines() if x.strip()]
    assert lines[0] == "# fleetd"
    assert lines[1] == "```sh"
    assert lines[2].startswith("make demo") and lines[3].startswith("make test")
    assert lines[4] == "```"
    makefile = (REPO / "Makefile").read_text()
    assert "demo: setup" in makefile and "test: setup" in makefile
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_every_view_and_table_is_documented() -> None:
    import sqlite3

    from fleetd.store.schema import MIGRATIONS, _statements

    conn = sqlite3.connect(":memory:")
    for sql in MIGRATIONS:
        for stmt in _statements(sql):
            conn.execute(stmt)
    doc = (REPO / "docs" / "schema.md").read_text()
    names = [r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type IN ('table', 'view') "
        "AND name NOT LIKE 'sqlite_%'")]
    missing = [n for n in names if f"`{n}`" not in doc]
    assert not missing, f"docs/schema.md does not describe: {missing}"
    for view in ("events", "sessions", "chains", "aggregates", "processes", "threads"):
        cols = [r[1] for r in conn.execute(f"PRAGMA table_info({view})")]
        undocumented = [c for c in cols if f"`{c}`" not in doc]
        assert not undocumented, f"{view}: {undocumented}"


# ---- the node API, its metrics and the CLI flags, read from the code -------------------

def _agent_routes(tmp_path: Path) -> set[tuple[str, str]]:
    """(method, path) of every route the agent's application serves, as ``fleetd agent``
    builds it: the agent's own routes and the relay route the CLI plugs in."""
    from fleetd.node.agent import AgentSettings, build_app
    from fleetd.node.api import NodeState
    from fleetd.relay import RelaySettings, relay_routes

    settings = AgentSettings(node="n1", db=tmp_path / "n1.db",
                             extra_routes=relay_routes(RelaySettings(node="n1")))
    app = build_app(settings, NodeState(node="n1"))
    routes = {(r.method, r.resource.canonical) for r in app.router.routes()
              if r.resource is not None and r.method != "HEAD"}  # HEAD comes with each GET
    assert {("GET", "/api/v1/health"), ("GET", "/metrics"), ("POST", "/api/v1/query"),
            ("POST", "/api/v1/detail"), ("POST", "/api/v1/relay")} <= routes
    return routes


def _section(doc: str, heading: str) -> str:
    """The text under the first heading that starts with ``heading``, to the next heading."""
    m = re.search(rf"^#+ {re.escape(heading)}.*?$(.*?)(?=^#|\Z)", doc, re.M | re.S)
    assert m is not None, f"no heading {heading!r}"
    return m.group(1)


def documented_routes(doc: str) -> set[tuple[str, str]]:
    """(method, path) of each route heading: ### `GET /api/v1/chains?since=...` (query
    parameters may follow the path)."""
    return set(re.findall(r"^#+ `([A-Z]+) (/[^`?\s]*)", doc, re.M))


def test_every_agent_route_is_documented(tmp_path: Path) -> None:
    """docs/api.md has one heading per route the agent serves, method and path, and none
    for a route it does not serve."""
    documented = documented_routes((REPO / "docs" / "api.md").read_text())
    served = _agent_routes(tmp_path)
    missing = sorted(served - documented)
    assert not missing, ("docs/api.md has no heading (### `METHOD /path`) for the agent's "
                         f"routes: {missing}")
    stale = sorted(documented - served)
    assert not stale, f"docs/api.md documents routes the agent does not serve: {stale}"


def test_the_architecture_doc_names_every_agent_route(tmp_path: Path) -> None:
    """The agent's paragraph of docs/architecture.md names each route it serves: a
    question's route as "one `GET` route per question", any other by its name."""
    from fleetd.questions.catalog import QUESTIONS

    para = _paragraph((REPO / "docs" / "architecture.md").read_text(), "`fleetd.node`")
    questions = {("GET", q.route) for q in QUESTIONS}
    assert "one `GET` route per question" in para
    unnamed = [f"{method} {path}" for method, path in sorted(_agent_routes(tmp_path))
               if (method, path) not in questions and not _names_route(para, method, path)]
    assert not unnamed, ("docs/architecture.md's paragraph on fleetd.node does not name "
                         f"these routes: {unnamed}")


def _paragraph(doc: str, bold: str) -> str:
    """The paragraph that starts with **``bold``...**, its lines folded."""
    m = re.search(rf"^\*\*{re.escape(bold)}.*?(?=\n\n)", doc, re.M | re.S)
    assert m is not None, f"no paragraph starting **{bold}"
    return " ".join(m.group(0).split())


def _names_route(text: str, method: str, path: str) -> bool:
    """``text`` names the route by its last path part (`/metrics` for a path outside the
    API), and a route other than GET as a `POST` beside it."""
    api = path.startswith("/api/v1/")
    name = path.rsplit("/", 1)[-1] if api else path
    if f"`{name}`" not in text:
        return False
    return method == "GET" or f"`{name}` (a `{method}`" in text


def test_every_metric_series_is_documented() -> None:
    from fleetd.node.api import NodeState
    from fleetd.node.metrics import Sources, render

    text = render(NodeState(node="n1", tracing=True), Sources())
    families = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    samples = set(re.findall(r"^(fleetd_\w+)[{ ]", text, re.M))
    assert len(families) >= 5 and samples
    for name in samples:  # every sample belongs to a declared family (histogram parts too)
        assert name in families or any(
            name == f + suffix and families[f] == "histogram"
            for f in families for suffix in ("_bucket", "_sum", "_count")), name
    section = _section((REPO / "docs" / "api.md").read_text(), "`GET /metrics`")
    missing = [f for f in families if f"`{f}`" not in section]
    assert not missing, f"docs/api.md's GET /metrics section does not name: {missing}"


def _parsers(
    parser: argparse.ArgumentParser, path: str
) -> list[tuple[str, argparse.ArgumentParser]]:
    out = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _parsers(sub, f"{path} {name}")
    return out


def test_every_cli_flag_is_in_the_reference() -> None:
    from fleetd.cli.main import build_parser

    doc = (REPO / "docs" / "cli.md").read_text()
    missing: list[str] = []
    commands = _parsers(build_parser(), "fleetd")
    assert len(commands) > 10
    for command, parser in commands:
        # The command's own section: "## fleetd query", "### fleetd certs show".
        m = re.search(rf"^#+ {re.escape(command)}\n(.*?)(?=^#|\Z)", doc, re.M | re.S)
        if m is None:
            missing.append(f"section {command!r}")
            continue
        for action in parser._actions:
            if action.help == argparse.SUPPRESS:
                continue
            for flag in action.option_strings:
                # An entry of the options list: "  -v, --verbose  ..." or "  --db DB  ...".
                entry = rf"^  (?:-\S+(?: [^-\s]\S*)*, )*{re.escape(flag)}(?![\w-])"
                if not re.search(entry, m.group(1), re.M):
                    missing.append(f"{command} {flag}")
    assert not missing, (f"docs/cli.md does not list: {missing}; regenerate it with "
                         ".venv/bin/python scripts/gen_cli_docs.py")


# ---- the docstrings' cross-references name what exists --------------------------------

ROLE_REF = re.compile(r":(?:mod|func|class|meth|data|attr|exc|obj|const):`([^`]+)`")


class Names:
    """The names each fleetd module defines, read with ``ast`` (nothing is imported: the
    tracer's modules need BCC), to resolve a docstring's ``:role:`target``` statically."""

    def __init__(self) -> None:
        from test_architecture import tree_modules

        self.paths = tree_modules()
        self.trees = {m: ast.parse(p.read_text()) for m, p in self.paths.items()}

    def resolves(self, module: str, scope: list[ast.ClassDef], target: str) -> bool:
        parts = target.split(".")
        if parts[0] == "fleetd":
            return self._absolute(parts, 0)
        if any(self._member(c, module, parts, 0) for c in scope):
            return True  # a member of the class the docstring is in
        return self._in_module(module, parts, 0) or _importable(parts)

    def _absolute(self, parts: list[str], depth: int) -> bool:
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in self.paths:
                return self._in_module(".".join(parts[:i]), parts[i:], depth)
        return False

    def _in_module(self, module: str, parts: list[str], depth: int) -> bool:
        if not parts:
            return True
        if f"{module}.{parts[0]}" in self.paths:
            return self._in_module(f"{module}.{parts[0]}", parts[1:], depth)
        return self._bound(self.trees[module].body, module, parts, depth)

    def _bound(self, body: list[ast.stmt], module: str, parts: list[str], depth: int) -> bool:
        """``parts[0]`` is bound in ``body`` (and the rest in what it binds)."""
        for node in _statements(body):
            if isinstance(node, ast.ClassDef) and node.name == parts[0]:
                return len(parts) == 1 or self._member(node, module, parts[1:], depth)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and \
                    node.name == parts[0]:
                return len(parts) == 1
            if parts[0] in _assigned(node):
                return len(parts) == 1
            source = _imported(node, module, self.paths, parts[0])
            if source is not None and depth < 8:
                return self._absolute(source.split(".") + parts[1:], depth + 1) \
                    if source.startswith("fleetd") else _importable(source.split(".")
                                                                    + parts[1:])
        return False

    def _member(self, cls: ast.ClassDef, module: str, parts: list[str], depth: int) -> bool:
        if self._bound(cls.body, module, parts, depth):
            return True
        return len(parts) == 1 and f"self.{parts[0]}" in ast.unparse(cls)


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of ``body`` with those under ``if``/``try`` (imports, fallbacks)."""
    out: list[ast.stmt] = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If | ast.Try):
            out += _statements(node.body) + _statements(node.orelse)
            for handler in getattr(node, "handlers", []):
                out += _statements(handler.body)
    return out


def _assigned(node: ast.stmt) -> set[str]:
    if isinstance(node, ast.Assign):
        return {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def _imported(node: ast.stmt, module: str, paths: dict[str, Path], name: str) -> str | None:
    """The full dotted name ``name`` is bound to by the import ``node``, if it binds it."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if (alias.asname or alias.name.split(".")[0]) == name:
                return alias.name if alias.asname else name
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = module.split(".")[: None if paths[module].name == "__init__.py" else -1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        for alias in node.names:
            if (alias.asname or alias.name) == name:
                return f"{base}.{alias.name}"
    return None


def _importable(parts: list[str]) -> bool:
    """An outside name (``asyncio.Task``, ``ssl.SSLContext``): a module and attributes."""
    import importlib

    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return False
        return True
    return False


def data_packages() -> set[str]:
    """Packages of data files mapped from elsewhere in the tree (``fleetd.bpf`` is bpf/)."""
    import tomllib

    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name for name, where in setup["package-dir"].items()
            if name != "fleetd" and (REPO / where).is_dir()}


def docstring_refs(tree: ast.Module) -> list[tuple[list[ast.ClassDef], str]]:
    """(the classes around it, target) for each ``:role:`target``` in a docstring."""
    found: list[tuple[list[ast.ClassDef], str]] = []

    def visit(node: ast.AST, scope: list[ast.ClassDef]) -> None:
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef |
                      ast.AsyncFunctionDef):
            inner = [*scope, node] if isinstance(node, ast.ClassDef) else scope
            doc = ast.get_docstring(node, clean=False) or ""
            for ref in ROLE_REF.findall(doc):
                # "~x.y" shows only y, "a <x.y>" names x.y; a name may wrap a line.
                target = "".join(ref.split()).lstrip("~!").split("<")[-1].rstrip(">")
                found.append((inner, target.removesuffix("()")))
            # A dotted fleetd name outside a role (``fleetd.x.y`` or plain) counts too,
            # but for what is not Python: the config file, a package of data files.
            plain = ROLE_REF.sub("", doc)
            for name in re.findall(r"(?<![\w/.`~-])`{0,2}(fleetd(?:\.\w+)+)", plain):
                if not name.endswith(".yaml") and name not in data_packages():
                    found.append((inner, name))
            scope = inner
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, [])
    return found


def test_every_docstring_reference_names_something_real() -> None:
    """A ``:mod:``/``:func:``/``:class:``/... reference in a fleetd docstring names a
    module, function, class or value that exists: a renamed or moved one is not left
    behind in the prose that explains it."""
    names = Names()
    bad: list[str] = []
    count = 0
    for module, tree in names.trees.items():
        for scope, target in docstring_refs(tree):
            count += 1
            if not names.resolves(module, scope, target):
                bad.append(f"{module}: {target}")
    assert count > 300
    assert not bad, ("docstring references to nothing (fix the name, or write it in "
                     f"``double backticks`` if it is not a Python object): {bad}")


def test_the_reference_check_can_fail() -> None:
    names = Names()
    assert names.resolves("fleetd.node.api", [], "fleetd.node.api.NodeState.tracing")
    assert names.resolves("fleetd.node.api", [], "ReaderPool")  # imported there
    assert names.resolves("fleetd.node.api", [], "asyncio.Task")
    assert not names.resolves("fleetd.node.api", [], "fleetd.node.api.NoSuchThing")
    assert not names.resolves("fleetd.node.api", [], "fleetd.analyze.profile")
    assert not names.resolves("fleetd.node.api", [], "WindowSpecs")
    tree = ast.parse('"""See :func:`fleetd.x.\n y`, :class:`~a.B`, ``fleetd.p.q`` and '
                     'fleetd.yaml."""\n')
    assert [t for _, t in docstring_refs(tree)] == ["fleetd.x.y", "a.B", "fleetd.p.q"]


def test_every_name_the_design_docs_give_exists() -> None:
    """Each `fleetd.x.y` (a module, or a name in one) and each `dir/file.py` path that
    docs/architecture.md and docs/api.md give in backticks is in the tree."""
    names = Names()
    bad: list[str] = []
    for doc in ("architecture.md", "api.md"):
        text = (REPO / "docs" / doc).read_text()
        for name in set(re.findall(r"`(fleetd(?:\.\w+)+)`", " ".join(text.split()))):
            if not name.endswith(".yaml") and not names.resolves("fleetd", [], name):
                bad.append(f"{doc}: {name}")  # fleetd.yaml is the config file
        for path in set(re.findall(r"`((?:[\w-]+/)+[\w-]+\.(?:py|md|h|c))`", text)):
            if not any((REPO / top / path).exists() for top in ("", "fleetd")):
                bad.append(f"{doc}: {path}")
    assert not bad, f"names and paths in the docs that the tree does not have: {sorted(bad)}"
