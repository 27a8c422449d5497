"""The layer order of fleetd's packages, checked over every import of every module.

The contract is the layer table in docs/architecture.md (one place: the doc shows it,
this test reads it). A module may import only from its own package or from a lower
layer; packages on one layer may not import each other. Every import counts, also the
ones inside functions and under ``if TYPE_CHECKING:``. Inside a package: no cycles, no
private imports, small modules, rooms on floors, a map in each ``__init__``. And the
doc's other sentences that code can prove (what a package never imports, imports,
builds or writes; the order of the rooms) are checked at the end.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from conftest import REPO

PACKAGE = REPO / "fleetd"
DOC = REPO / "docs" / "architecture.md"
ROOT = "fleetd"
MARKER = "tests/unit/test_architecture.py reads the next block"
FIX = (
    "A module may import only from its own package or from a lower layer of the table in "
    "docs/architecture.md; packages on one layer may not import each other (imports inside "
    "functions and under TYPE_CHECKING count too). Fix: move the shared piece down to the "
    "lowest package that needs it, or have the upper layer hand it in (a parameter, a "
    "callback, a factory, a route table). Change the table in docs/architecture.md only "
    "if the layering itself should change."
)


@dataclass(frozen=True)
class Contract:
    """Layers bottom to top: each a label and the names (packages or modules) on it."""

    layers: tuple[tuple[str, tuple[str, ...]], ...]

    def rank(self, name: str) -> int:
        for i, (_, names) in enumerate(self.layers):
            if name in names:
                return i
        raise KeyError(name)

    def label(self, name: str) -> str:
        return self.layers[self.rank(name)][0]

    @property
    def names(self) -> list[str]:
        return [n for _, names in self.layers for n in names]

    def owner(self, module: str) -> str | None:
        """The contract entry a module belongs to; the root package owns only itself."""
        best: str | None = None
        for name in self.names:
            inside = module == name or (name != ROOT and module.startswith(name + "."))
            if inside and (best is None or len(name) > len(best)):
                best = name
        return best


def parse_contract(text: str) -> Contract:
    """The table in the fenced block after MARKER: ``LABEL  fleetd.x  fleetd.y  role...``.

    Lines without a layer label (the header, rules) are skipped; the top line is the top.
    """
    after = text.split(MARKER, 1)
    assert len(after) == 2, f"docs/architecture.md lost the contract marker {MARKER!r}"
    block = re.search(r"```[a-z]*\n(.*?)```", after[1], re.S)
    assert block is not None, "docs/architecture.md: no fenced layer table after the marker"
    top_down: list[tuple[str, tuple[str, ...]]] = []
    for line in block.group(1).splitlines():
        m = re.match(r"\s*(\d+[a-z]?)\s+(.*)", line)
        if m is None:
            continue
        names: tuple[str, ...] = ()
        for word in m.group(2).split():  # the names, up to the role column
            if not re.fullmatch(r"fleetd(\.\w+)*", word):
                break
            names += (word,)
        assert names, f"layer {m.group(1)} of docs/architecture.md names no package"
        top_down.append((m.group(1), names))
    labels = [label for label, _ in top_down]
    assert len(set(labels)) == len(labels), f"layer labels repeat: {labels}"
    contract = Contract(tuple(reversed(top_down)))
    dup = {n for n in contract.names if contract.names.count(n) > 1}
    assert not dup, f"docs/architecture.md puts these on more than one layer: {sorted(dup)}"
    return contract


def load_contract() -> Contract:
    return parse_contract(DOC.read_text())


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def tree_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def fleetd_imports(
    source: str, module: str, is_package: bool, known: set[str]
) -> list[tuple[str, int]]:
    """Every fleetd module ``source`` imports, wherever the import sits, with its line.

    ``from fleetd.x import y`` counts as an import of ``fleetd.x.y`` when that is a module,
    so that ``from fleetd import cli`` is seen for what it is.
    """
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in known else base, node.lineno))
    mine = dict.fromkeys((m, line) for m, line in found if m == ROOT or m.startswith(ROOT + "."))
    return list(mine)  # one entry per module and line, in source order


def violations(
    contract: Contract, module: str, source: str, *, is_package: bool, known: set[str]
) -> list[str]:
    """``module -> imported (line N): why`` for each import against the layer order."""
    out: list[str] = []
    mine = contract.owner(module)
    if mine is None:
        return [f"{module}: on no layer of the contract"]
    for target, line in fleetd_imports(source, module, is_package, known):
        theirs = contract.owner(target)
        if theirs == mine:
            continue
        where = f"{module} -> {target} (line {line})"
        if theirs is None:
            out.append(f"{where}: {target} is on no layer of the contract")
        elif contract.rank(theirs) > contract.rank(mine):
            out.append(f"{where}: layer {contract.label(mine)} ({mine}) imports from the "
                       f"higher layer {contract.label(theirs)} ({theirs})")
        elif contract.rank(theirs) == contract.rank(mine):
            out.append(f"{where}: {mine} and {theirs} sit side by side on layer "
                       f"{contract.label(mine)} and may not import each other")
    return out


# ---- the contract over the real tree ---------------------------------------------------


def test_the_layer_table_names_real_packages() -> None:
    contract = load_contract()
    assert len(contract.layers) >= 2
    modules = tree_modules()
    stale = [n for n in contract.names if n not in modules]
    assert not stale, (f"docs/architecture.md's layer table names what fleetd/ does not have: "
                       f"{stale}; remove or rename them in the table")


def test_every_module_is_on_a_layer() -> None:
    contract = load_contract()
    unassigned = sorted({m for m in tree_modules() if contract.owner(m) is None})
    assert not unassigned, (
        f"modules on no layer: {unassigned}. Add the package to the layer table in "
        "docs/architecture.md (the contract this test reads), on the lowest layer whose "
        "imports it needs, and give it a paragraph there saying what it owns and hands on."
    )


def test_imports_follow_the_layers() -> None:
    contract = load_contract()
    modules = tree_modules()
    known = set(modules)
    found: list[str] = []
    for module, path in modules.items():
        found += violations(contract, module, path.read_text(),
                            is_package=path.name == "__init__.py", known=known)
    assert not found, "imports against the layer order:\n  " + "\n  ".join(found) + "\n" + FIX


def test_every_package_on_the_contract_is_described() -> None:
    contract = load_contract()
    prose = DOC.read_text().split("## The packages", 1)
    assert len(prose) == 2, "docs/architecture.md lost its '## The packages' section"
    missing = [n for n in contract.names if n != ROOT and f"`{n}`" not in prose[1]]
    assert not missing, f"docs/architecture.md describes no {missing} under '## The packages'"


# ---- the checker itself can fail -----------------------------------------------------


def _check(module: str, source: str, is_package: bool = False) -> list[str]:
    return violations(load_contract(), module, source, is_package=is_package,
                      known=set(tree_modules()))


def test_the_checker_reports_an_upward_import() -> None:
    found = _check("fleetd.store.x", "from fleetd.cli.main import main\n")
    assert len(found) == 1
    assert found[0].startswith("fleetd.store.x -> fleetd.cli.main (line 1): ")
    assert "higher layer" in found[0]


def test_the_checker_sees_lazy_typing_relative_and_sideways_imports() -> None:
    lazy = "import os\n\n\ndef f() -> None:\n    import fleetd.export.perfetto\n"
    assert [v.split(":")[0] for v in _check("fleetd.analyze.x", lazy)] == [
        "fleetd.analyze.x -> fleetd.export.perfetto (line 5)"]
    typing_only = ("from typing import TYPE_CHECKING\n"
                   "if TYPE_CHECKING:\n    from fleetd.node.api import NodeState\n")
    assert _check("fleetd.trace.x", typing_only)
    assert _check("fleetd.store.x", "from ..mcp import server\n")
    assert _check("fleetd.errors", "from fleetd import config\n")  # a module, not the root
    sideways = _check("fleetd.node.x", "from fleetd.fleet.client import FleetClient\n")
    assert sideways and "side by side" in sideways[0]
    assert _check("fleetd.config", "from fleetd.security import tls\n")


def test_the_checker_allows_downward_and_own_package_imports() -> None:
    ok = ("from fleetd import __version__\nfrom fleetd.errors import UsageError\n"
          "from fleetd.store.db import open_reader\nfrom fleetd.cli import output\n"
          "from . import main\n")
    assert _check("fleetd.cli.x", ok) == []
    assert _check("fleetd.cli", "from .main import main\n", is_package=True) == []


def test_a_module_on_no_layer_is_reported() -> None:
    assert _check("fleetd.newpkg.x", "import json\n") == [
        "fleetd.newpkg.x: on no layer of the contract"]
    found = _check("fleetd.cli.x", "from fleetd.newpkg import y\n")
    assert found and "on no layer" in found[0]


# ---- inside a package: no cycles, no private names, small modules ------------------------

MAX_LINES = 650
# Known exceptions, to be removed by the lead once their owners are done with them: each
# entry is a module that is over the limit, a cycle, or a private import that sits in
# code other engineers are editing right now (splitting or renaming it under them would
# collide with their changes). Do not add to these lists; shrink them.
ALLOWED_OVER_LIMIT = frozenset({
})
# Sets of modules allowed to import each other round a loop; empty: none left.
ALLOWED_CYCLES: frozenset[frozenset[str]] = frozenset()
# (importing module, imported module, name); empty: every private import is fixed.
ALLOWED_PRIVATE: frozenset[tuple[str, str, str]] = frozenset()


def package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rsplit(".", 1)[0]


def package_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of its own package it imports (its package's ``__init__``
    left out: a package imports its modules, not the other way round)."""
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        pkg = package_of(module, path)
        found = fleetd_imports(path.read_text(), module, path.name == "__init__.py", known)
        graph[module] = {t for t, _ in found if t in known and t not in (module, pkg)
                         and package_of(t, modules[t]) == pkg}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def private_imports(source: str, module: str, is_package: bool, known: set[str]
                    ) -> list[tuple[str, str, int]]:
    """(imported module, private name, line) for each ``from X import _name`` of another
    fleetd module; dunders and submodules (``from . import _x``) are not names."""
    out: list[tuple[str, str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:
            pkg = module.split(".") if is_package else module.split(".")[:-1]
            pkg = pkg[: len(pkg) - (node.level - 1)]
            base = ".".join(pkg + ([base] if base else []))
        if base != ROOT and not base.startswith(ROOT + "."):
            continue
        for alias in node.names:
            name = alias.name
            private = name.startswith("_") and not name.startswith("__")
            if private and base != module and f"{base}.{name}" not in known:
                out.append((base, name, node.lineno))
    return out


def test_no_import_cycles_inside_a_package() -> None:
    found = [c for c in cycles(package_graph(tree_modules()))
             if frozenset(c) not in ALLOWED_CYCLES]
    assert not found, (
        "modules of one package that import each other, directly or round a loop: "
        f"{found}. Fix: move what both need into a third module of the package, or "
        "hand it in (a parameter, a callback) instead of importing it back.")


def test_no_module_imports_another_modules_private_names() -> None:
    modules = tree_modules()
    known = set(modules)
    found = []
    for module, path in modules.items():
        for target, name, line in private_imports(path.read_text(), module,
                                                  path.name == "__init__.py", known):
            if (module, target, name) not in ALLOWED_PRIVATE:
                found.append(f"{module} (line {line}) imports {target}.{name}")
    assert not found, ("imports of another module's private (_underscore) names:\n  "
                       + "\n  ".join(found) + "\nFix: give the name a public spelling "
                       "where it is defined, or move it where both modules can share it.")


def test_no_module_is_over_the_line_limit() -> None:
    over = []
    for path in sorted(PACKAGE.rglob("*.py")):
        shown = path.relative_to(REPO).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES and shown not in ALLOWED_OVER_LIMIT:
            over.append(f"{shown}: {lines} lines")
    assert not over, (f"modules over {MAX_LINES} lines: {over}. Split each by what its "
                      "parts are about (a reader, a writer, a model), not by size.")


def test_the_exceptions_are_still_needed() -> None:
    """An exception that no longer applies is taken off its list, so the lists only
    shrink as the code is fixed."""
    stale = [p for p in ALLOWED_OVER_LIMIT if (REPO / p).exists() is False]
    modules = tree_modules()
    present = {frozenset(c) for c in cycles(package_graph(modules))}
    stale += [sorted(c) for c in ALLOWED_CYCLES if c not in present]
    known = set(modules)
    private = {(m, t, n) for m, p in modules.items()
               for t, n, _ in private_imports(p.read_text(), m, p.name == "__init__.py",
                                              known)}
    stale += [e for e in ALLOWED_PRIVATE if e not in private]
    assert not stale, f"exceptions that no longer apply; remove them: {stale}"


def test_the_cycle_and_private_checks_can_fail() -> None:
    assert cycles({"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": {"a.x"}}) == [
        ["a.x", "a.y", "a.z"]]
    assert cycles({"a.x": {"a.y"}, "a.y": set()}) == []
    known = set(tree_modules())
    source = ("from fleetd.fleet.fanout import _name_nodes, settle\n"
              "from fleetd.fleet import client\nfrom .fanout import __doc__\n")
    assert private_imports(source, "fleetd.fleet.relayed", False, known) == [
        ("fleetd.fleet.fanout", "_name_nodes", 1)]
    assert private_imports("from ._x import _y\n", "fleetd.fleet._x", False, known) == []


# ---- rooms: the sub-packages of one package ---------------------------------------------


def room_of(module: str, path: Path, top: str) -> str | None:
    """The room of ``top`` (a package with sub-packages) that ``module`` is in: the
    sub-package's name, or ``top`` itself for the modules directly in it."""
    if module != top and not module.startswith(top + "."):
        return None
    rest = module[len(top):].lstrip(".").split(".")
    if not rest[0]:  # the package's own __init__: its map, above its rooms
        return top
    inner = rest[:-1] if path.name != "__init__.py" else rest
    return f"{top}.{inner[0]}" if inner else top


def room_graph(modules: dict[str, Path], top: str) -> dict[str, set[str]]:
    known = set(modules)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        mine = room_of(module, path, top)
        if mine is None:
            continue
        graph.setdefault(mine, set())
        for target, _ in fleetd_imports(path.read_text(), module, path.name == "__init__.py",
                                        known):
            theirs = room_of(target, modules[target], top) if target in modules else None
            if theirs is not None and theirs != mine:
                graph[mine].add(theirs)
    return graph


def test_the_rooms_of_a_package_stand_on_floors() -> None:
    """Inside a package cut into sub-packages (docs/architecture.md, "Rooms"), the rooms
    import one another one way only: no two rooms (the package's own modules count as
    one, the top) import each other, directly or round a loop."""
    modules = tree_modules()
    tops = sorted({m.rsplit(".", 1)[0] for m, p in modules.items()
                   if p.name == "__init__.py" and m.count(".") == 2})
    assert "fleetd.analyze" in tops and "fleetd.trace" in tops
    found = {top: c for top in tops if (c := cycles(room_graph(modules, top)))}
    assert not found, (f"rooms that import each other: {found}. Fix: move the module "
                       "both need down into the lower room, or hand it in.")


def test_the_room_check_can_fail() -> None:
    here = Path("x.py")
    assert room_of("fleetd.analyze.causes.chains", here, "fleetd.analyze") == \
        "fleetd.analyze.causes"
    assert room_of("fleetd.analyze.explain", here, "fleetd.analyze") == "fleetd.analyze"
    assert room_of("fleetd.trace.tracer", here, "fleetd.analyze") is None
    assert cycles({"p": {"p.a"}, "p.a": {"p"}}) == [["p", "p.a"]]


def test_every_package_init_is_a_map_of_its_modules() -> None:
    """Each package's ``__init__`` docstring names every module and room in it (as
    ``name``, `name` or :mod:`...name`), so a newcomer's first read is a true map."""
    missing: list[str] = []
    for init in sorted(PACKAGE.rglob("__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        children = sorted({p.stem for p in init.parent.glob("*.py")} - {"__init__", "__main__"}
                          | {p.parent.name for p in init.parent.glob("*/__init__.py")})
        if init.parent == PACKAGE:
            continue  # the root's map is docs/architecture.md's layer table
        for child in children:
            if child.endswith("_cmd") and "``*_cmd``" in doc:  # one module per command
                continue
            if not re.search(rf"[`.~]{child}\b(?!\.py)", doc):
                missing.append(f"{init.parent.relative_to(REPO)}: {child}")
    assert not missing, ("package maps (the __init__ docstring) that do not name these "
                         f"modules or rooms: {missing}")


def command_imports(sources: dict[str, str]) -> list[str]:
    """``a -> b`` for each ``fleetd.cli.*_cmd`` module (name -> source) that imports
    another ``*_cmd`` module, wherever the import sits."""
    found = []
    for name, source in sorted(sources.items()):
        if not (name.startswith("fleetd.cli.") and name.endswith("_cmd")):
            continue
        for target, line in fleetd_imports(source, name, False, set(sources)):
            if target.startswith("fleetd.cli.") and target.endswith("_cmd") and target != name:
                found.append(f"{name}:{line} -> {target}")
    return found


def test_no_command_module_imports_another() -> None:
    """What two commands share (argument helpers, renderers) lives in a shared module of
    fleetd.cli (fleetd/cli/__init__.py names them), never in one of the commands."""
    found = command_imports({m: p.read_text() for m, p in tree_modules().items()})
    assert not found, f"command modules importing another command: {found}"


def test_the_command_import_check_can_fail() -> None:
    sources = {"fleetd.cli.a_cmd": "def f():\n    from fleetd.cli.b_cmd import g\n",
               "fleetd.cli.b_cmd": "from fleetd.cli.output import table\n",
               "fleetd.cli.output": "", "fleetd.cli.c_cmd": "from fleetd.cli import a_cmd\n"}
    assert command_imports(sources) == ["fleetd.cli.a_cmd:2 -> fleetd.cli.b_cmd",
                                        "fleetd.cli.c_cmd:1 -> fleetd.cli.a_cmd"]


# ---- the doc's other sentences that the code can prove ----------------------------------
# Each sentence of docs/architecture.md that says what a package imports, writes or
# builds is checked here. A check names the sentence it holds to: when the doc is
# reworded the check fails until it is pointed at the new words, so a claim cannot
# drift away from its test.


def doc_text() -> str:
    """docs/architecture.md with its line breaks folded, so a sentence is one string."""
    return " ".join(DOC.read_text().split())


def under(module: str, name: str) -> bool:
    return module == name or (name != ROOT and module.startswith(name + "."))


def import_edges(modules: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(module, imported fleetd module, line) for every fleetd import in the tree."""
    known = set(modules)
    return [(m, t, line) for m, p in modules.items()
            for t, line in fleetd_imports(p.read_text(), m, p.name == "__init__.py", known)]


def assert_said(sentence: str) -> None:
    assert sentence in doc_text(), (
        f"docs/architecture.md no longer says {sentence!r}: point the check that quotes it "
        "at the sentence as it reads now (or drop the check with the claim)")


NEVER_IMPORTS = re.compile(r"`(fleetd[\w.]*)` never imports `(fleetd[\w.]*)`")


def never_imports(claims: list[tuple[str, str]], edges: list[tuple[str, str, int]]
                  ) -> list[str]:
    return [f"{m} -> {t} (line {line})" for a, b in claims for m, t, line in edges
            if under(m, a) and under(t, b)]


def test_every_never_imports_sentence_holds() -> None:
    """Every "`fleetd.X` never imports `fleetd.Y`" of the doc, wherever it is written."""
    claims = NEVER_IMPORTS.findall(doc_text())
    assert ("fleetd.node", "fleetd.trace") in claims
    found = never_imports(claims, import_edges(tree_modules()))
    assert not found, (f"docs/architecture.md says these never happen: {found}. Hand the "
                       "piece in from above or move it down (see the fix above the claim)")
    assert_said("`fleetd.cli` passes the tracer in as a factory (`fleetd.trace.agent_hook`)")
    assert any(m.startswith("fleetd.cli.") and t == "fleetd.trace.agent_hook"
               for m, t, _ in import_edges(tree_modules()))


def base_names() -> set[str]:
    """What the doc calls the base: every name on a layer labelled 0a, 0b, 0c..."""
    return {n for label, names in load_contract().layers if label.startswith("0")
            for n in names}


def imports_outside(subjects: tuple[str, ...], allowed: set[str]) -> list[str]:
    """Imports of ``subjects`` (and modules in them) of anything but their own package
    and ``allowed`` (a package or module and what is in it; the root alone)."""
    owner = load_contract().owner
    return [f"{m} -> {t} (line {line})" for m, t, line in import_edges(tree_modules())
            if any(under(m, s) for s in subjects)
            and not any(under(t, a) for a in allowed | {owner(m) or m})]


def test_what_the_doc_says_a_package_imports_is_all_it_imports() -> None:
    base = base_names()
    assert {"fleetd", "fleetd.errors", "fleetd.config", "fleetd.security"} <= base
    claims: list[tuple[str, tuple[str, ...], set[str]]] = [
        ("`fleetd.__main__` only calls `fleetd.cli`'s `main`", ("fleetd.__main__",),
         {"fleetd.cli"}),
        ("`errors` depends on nothing", ("fleetd.errors",), set()),
        ("`config`, `checks` and `runner` use only `errors`",
         ("fleetd.config", "fleetd.checks", "fleetd.runner"), {"fleetd.errors"}),
        ("`security` builds on `config` and `checks`", ("fleetd.security",),
         {"fleetd.config", "fleetd.checks", "fleetd.errors"}),
        ("It depends on nothing, so every stage that writes text", ("fleetd.printable",),
         set()),
        ("it imports only the store and the base", ("fleetd.ingest",),
         base | {"fleetd.store"}),
        ("It imports only the base, the op catalogue's families (`fleetd.store.catalog`) "
         "and those types", ("fleetd.wire",), base | {"fleetd.analyze", "fleetd.store.catalog"}),
    ]
    found: list[str] = []
    for sentence, subjects, allowed in claims:
        assert_said(sentence)
        found += [f"{sentence!r}, yet {v}" for v in imports_outside(subjects, allowed)]
    assert not found, "docs/architecture.md says otherwise:\n  " + "\n  ".join(found)


def source_hits(pattern: str, modules: dict[str, Path]) -> set[str]:
    return {m for m, p in modules.items() if re.search(pattern, p.read_text())}


def test_the_mcp_server_uses_only_the_tracers_checks() -> None:
    assert_said("(and, for its `check` tool, `fleetd.trace.checks`: nothing else of the "
                "tracer)")
    found = {t for m, t, _ in import_edges(tree_modules())
             if under(m, "fleetd.mcp") and under(t, "fleetd.trace")}
    assert found == {"fleetd.trace.checks"}, sorted(found)


def test_the_top_of_analyze_is_what_the_doc_says() -> None:
    """"the questions (`explain`, `overview`, `stacks`) and the one door, `facade`, sit on
    top": the modules directly in fleetd.analyze, above its rooms."""
    para = doc_text().split("**`fleetd.analyze`.**", 1)[1]
    top = re.search(r"stragglers\) and `gpu`; the questions \((.*?)\) and the one door, "
                    r"`(\w+)`, sit on top", para)
    assert top is not None, "the fleetd.analyze paragraph no longer says what sits on top"
    said = set(re.findall(r"`(\w+)`", top.group(1))) | {top.group(2)}
    there = {p.stem for p in (PACKAGE / "analyze").glob("*.py")} - {"__init__"}
    assert said == there, f"said on top: {sorted(said)}; in fleetd/analyze: {sorted(there)}"


def test_only_security_builds_a_tls_context() -> None:
    assert_said("take their contexts from here and never build one of their own")
    found = source_hits(r"\bSSLContext\(|\bcreate_default_context\(", tree_modules())
    assert found and all(under(m, "fleetd.security") for m in found), sorted(found)


# SQL that changes a file, in a string of the source.
WRITES_SQL = r"\b(INSERT\s+(OR\s+\w+\s+)?INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM|CREATE\s+" \
             r"(TABLE|INDEX|VIEW)|ALTER\s+TABLE|DROP\s+(TABLE|INDEX|VIEW))\b"


def test_only_the_store_writes_a_node_file() -> None:
    """The store's writer is the one thread writing a node's file; the agent opens it
    for writing once, before; analyze writes only chains, through that writer; the one
    other SQL that writes is ingest's scratch file."""
    assert_said("the batch writer that is the only thread writing a node's file (before "
                "it starts, the agent creates or migrates the file with `open_writer`)")
    assert_said("the only write is storing chains, on request (`fleetd explain --store`)")
    assert_said("`kineto_stage` keeps the rows in a scratch SQLite file")
    modules = tree_modules()
    outside = {m: p for m, p in modules.items() if not under(m, "fleetd.store")}
    assert source_hits(WRITES_SQL, {m: modules[m] for m in ("fleetd.store.writer",)})
    assert source_hits(WRITES_SQL, outside) == {"fleetd.ingest.kineto_stage"}
    assert source_hits(r"\bopen_writer\b", outside) == {"fleetd.node.agent"}
    writers = {m for m, t, _ in import_edges(modules) if t == "fleetd.store.writer"}
    assert {m for m in writers if under(m, "fleetd.analyze")} == {"fleetd.analyze.explain"}


def test_only_the_cli_ends_the_process() -> None:
    """"the one place where a `FleetdError` becomes a message and an exit code": no other
    package exits with a code (the agent's second stop signal, ``os._exit``, is no
    error's exit)."""
    assert_said("the one place where a `FleetdError` becomes a message and an exit code")
    found = source_hits(r"\bsys\.exit\(|\bSystemExit\b", tree_modules())
    assert found and all(under(m, "fleetd.cli") or m == "fleetd.__main__"
                         for m in found), sorted(found)


def test_a_bad_answer_is_caught_where_the_doc_says() -> None:
    assert_said("one place turns a bad answer into a failed node")
    assert_said("Three operations read a part of an answer themselves")
    found = source_hits(r"except\s*\(?[\w., ]*\bBadReply\b", tree_modules())
    assert found == {"fleetd.fleet.fanout", "fleetd.fleet.collectives", "fleetd.fleet.hang",
                     "fleetd.fleet.chains"}


def test_the_line_limit_is_the_one_the_doc_gives() -> None:
    assert_said(f"no module over {MAX_LINES} lines")


def room_order(package: str) -> list[str]:
    """The rooms of ``package`` in the order its paragraph lists them, bottom to top."""
    para = doc_text().split(f"**`{package}`.**", 1)
    assert len(para) == 2, f"docs/architecture.md has no paragraph for {package}"
    listed = re.search(r"Its rooms, bottom to top: (.*?);", para[1])
    assert listed is not None, f"the {package} paragraph lost 'Its rooms, bottom to top:'"
    return [f"{package}.{r}" for r in re.findall(r"`(\w+)`", listed.group(1))]


def rooms_against_order(graph: dict[str, set[str]], top: str, order: list[str]) -> list[str]:
    """Imports that point up the listed order or from a room into the package's top."""
    out: list[str] = []
    for room, targets in sorted(graph.items()):
        if room == top:
            continue
        if room not in order:
            out.append(f"{room}: a room the doc does not list")
            continue
        out += [f"{room} -> {t}" for t in sorted(targets)
                if t == top or t not in order or order.index(t) > order.index(room)]
    return out


def test_the_rooms_stand_in_the_order_the_doc_lists() -> None:
    """"a room imports only rooms below it, and the package's own modules (the top)
    import the rooms, never the other way round", in the order each package's paragraph
    lists its rooms."""
    assert_said("a room imports only rooms below it, and the package's own modules (the "
                "top) import the rooms, never the other way round")
    modules = tree_modules()
    found: list[str] = []
    for top in ("fleetd.trace", "fleetd.analyze"):
        order = room_order(top)
        assert len(order) >= 3, order
        found += rooms_against_order(room_graph(modules, top), top, order)
    assert not found, f"rooms against the order docs/architecture.md lists: {found}"


def test_the_doc_checks_can_fail() -> None:
    edges = [("fleetd.node.ranks", "fleetd.trace.host.procinfo", 49),
             ("fleetd.node.api", "fleetd.store.db", 3)]
    assert never_imports([("fleetd.node", "fleetd.trace")], edges) == [
        "fleetd.node.ranks -> fleetd.trace.host.procinfo (line 49)"]
    graph = {"p": {"p.a", "p.b"}, "p.a": set(), "p.b": {"p.a"}, "p.c": {"p"}}
    assert rooms_against_order(graph, "p", ["p.a", "p.b", "p.c"]) == ["p.c -> p"]
    assert rooms_against_order(graph, "p", ["p.b", "p.a", "p.c"]) == ["p.b -> p.a", "p.c -> p"]
    assert not under("fleetd.errors", ROOT) and under("fleetd.node.x", "fleetd.node")
    assert re.search(WRITES_SQL, "conn.execute('INSERT OR REPLACE INTO t VALUES (1)')")
    assert not re.search(WRITES_SQL, "SELECT ts_ns FROM events -- no UPDATE here")
    try:
        assert_said("fleetd.node imports fleetd.trace freely")
    except AssertionError:
        return
    raise AssertionError("assert_said passed a sentence the doc does not have")
