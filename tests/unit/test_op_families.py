"""Every family of ops is defined once: in the op catalogue (fleetd/store/catalog.py).

The walk parses every module of ``fleetd/`` and fails on a family defined again:
- a literal set, tuple or list (``frozenset({...})`` included) whose strings are all
  op names of the catalogue, two or more of them;
- an op code compared with a number: an ordering (``<``, ``<=``, ``>``, ``>=``) or an
  ``in range(...)`` between something that names an op (``op``, ``r.op``, ``op_code``)
  or a source (``NCCL_LO``) and an integer literal in the span of the codes, or a
  module constant bound to one;
- ops picked from the catalogue by a condition (``o.code for o in OPS if o.source ==
  "nccl"``): a family by source, kind or name, built again.
The C side tests a family with its generated ``FL_OPS_<FAMILY>(op)`` macro, never with
a chain of ``op == OP_X ||`` tests; the record flags (``FL_WHY_*``) come from Python.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from fleetd.store import catalog
from fleetd.trace.bpf import bpfsrc

from conftest import REPO

CATALOGUE = Path("fleetd/store/catalog.py")
# Literal lists of op names that are no family: (module, top-level name) -> why.
NOT_FAMILIES: dict[tuple[str, str], str] = {
    ("fleetd/trace/host/libs.py", "KIND_MARKERS"):
        "ELF symbols that say which CUDA library a file is (cuInit is no op)",
}
FIX = ("define the family once in fleetd/store/catalog.py (a Family, by name and code) "
       "and import it; for a code range use the family of those sources (CALLS, "
       "CUDA_CALLS, NCCL) and test membership")
_CODE_SPAN = range(min(catalog.BY_CODE), (max(catalog.BY_CODE) // 100 + 1) * 100 + 1)
_NAMES_AN_OP = re.compile(
    r"(?<![a-z])(op|ops|opcode|" + "|".join(catalog.SOURCES) + r")(?![a-z])",
    re.I)


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    owner: str  # the top-level name the finding sits under
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} ({self.owner}): {self.text}"


def _owner(stmt: ast.stmt) -> str:
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return stmt.name
    targets: list[ast.expr] = []
    if isinstance(stmt, ast.Assign):
        targets = list(stmt.targets)
    elif isinstance(stmt, ast.AnnAssign | ast.AugAssign):
        targets = [stmt.target]
    names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    return ",".join(names) or "<module>"


def _int_constants(tree: ast.Module) -> dict[str, int]:
    """Module-level names bound to an int literal (``NCCL_LO, NCCL_HI = 400, 499``)."""
    out: dict[str, int] = {}
    for stmt in tree.body:
        if not isinstance(stmt, ast.Assign):
            continue
        for target in stmt.targets:
            pairs: list[tuple[ast.expr, ast.expr]] = [(target, stmt.value)]
            if isinstance(target, ast.Tuple) and isinstance(stmt.value, ast.Tuple):
                pairs = list(zip(target.elts, stmt.value.elts, strict=False))
            for name, value in pairs:
                if (isinstance(name, ast.Name) and isinstance(value, ast.Constant)
                        and type(value.value) is int):
                    out[name.id] = value.value
    return out


def _number(node: ast.expr, consts: dict[str, int]) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.Name):
        return consts.get(node.id)
    return None


def _op_names(node: ast.AST) -> list[str] | None:
    """The op names of a literal collection that holds nothing but op names (besides
    non-literal elements), two or more; else None."""
    if not isinstance(node, ast.Set | ast.Tuple | ast.List):
        return None
    strings = [e.value for e in node.elts
               if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    if len(strings) >= 2 and all(s in catalog.BY_NAME for s in strings):
        return strings
    return None


# What iterating the whole catalogue looks like.
_CATALOGUE_ITERS = {"OPS", "catalog.OPS", "BY_NAME", "BY_NAME.values()", "BY_NAME.items()",
                    "BY_CODE", "BY_CODE.values()", "BY_CODE.items()"}


def _picked(node: ast.AST) -> str | None:
    """The text of a comprehension that picks ops from the catalogue, else None."""
    if (isinstance(node, ast.comprehension) and node.ifs
            and ast.unparse(node.iter) in _CATALOGUE_ITERS):
        return f"for {ast.unparse(node.target)} in {ast.unparse(node.iter)} if " + \
            " and ".join(map(ast.unparse, node.ifs))
    return None


def _code_range(node: ast.AST, consts: dict[str, int]) -> str | None:
    """The text of an op code compared with a number, else None."""
    if not isinstance(node, ast.Compare):
        return None
    operands = [node.left, *node.comparators]
    for i, op in enumerate(node.ops):
        a, b = operands[i], operands[i + 1]
        if isinstance(op, ast.Lt | ast.LtE | ast.Gt | ast.GtE):
            numbers = [n for n in (a, b) if _number(n, consts) in _CODE_SPAN]
        elif (isinstance(op, ast.In | ast.NotIn) and isinstance(b, ast.Call)
              and isinstance(b.func, ast.Name) and b.func.id == "range"):
            numbers = [b] if any(_number(x, consts) in _CODE_SPAN for x in b.args) else []
        else:
            continue
        if numbers and any(_NAMES_AN_OP.search(ast.unparse(x)) for x in (a, b)):
            return ast.unparse(node)
    return None


def findings(source: str, path: str) -> list[Finding]:
    """Every op family a module's source defines for itself."""
    tree = ast.parse(source)
    consts = _int_constants(tree)
    out = []
    for stmt in tree.body:
        owner = _owner(stmt)
        for node in ast.walk(stmt):
            names = _op_names(node)
            text = (f"op names {names}" if names
                    else _code_range(node, consts) or _picked(node))
            if text:
                out.append(Finding(path, getattr(node, "lineno", stmt.lineno), owner, text))
    return out


def _modules() -> list[Path]:
    return sorted(p.relative_to(REPO) for p in (REPO / "fleetd").rglob("*.py"))


def test_no_module_but_the_catalogue_defines_an_op_family() -> None:
    found: list[Finding] = []
    for rel in _modules():
        if rel != CATALOGUE:
            found += findings((REPO / rel).read_text(), rel.as_posix())
    unexplained = [f for f in found if (f.path, f.owner) not in NOT_FAMILIES]
    assert not unexplained, (
        "op families defined outside the catalogue (fix: " + FIX + "):\n"
        + "\n".join(map(str, unexplained)))
    # An exemption that no longer matches anything goes.
    stale = set(NOT_FAMILIES) - {(f.path, f.owner) for f in found}
    assert not stale, f"exemptions in NOT_FAMILIES that match nothing: {sorted(stale)}"


def test_the_walk_finds_each_kind_of_copy() -> None:
    """The check itself can fail: the copies this issue removed, each found again."""
    copies = '''
NCCL_LO, NCCL_HI = 400, 499
SYNC_OPS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize"})
P2P_OPS = ("ncclSend", "ncclRecv")
def f(rows, op, r):
    nccl = [x for x in rows if NCCL_LO <= x[4] <= NCCL_HI]
    last = [x for x in rows if x[4] < NCCL_LO]
    slow = op < 500
    launches = {c for c in (r.op,) if r.op in range(100, 200)}
    fork, exit_ = (n for n in ["fork", "exit"])
NCCL_CODES = tuple(o.code for o in OPS if o.source == "nccl")
TIMED = [c for c, o in BY_CODE.items() if o.kind in ("call", "interval")]
'''
    got = {(f.line, f.owner) for f in findings(copies, "x.py")}
    assert got == {(3, "SYNC_OPS"), (4, "P2P_OPS"), (6, "f"), (7, "f"), (8, "f"), (9, "f"),
                   (10, "f"), (11, "NCCL_CODES"), (12, "TIMED")}, got


def test_the_walk_leaves_what_is_no_op_family_alone() -> None:
    fine = '''
EVIDENCE = ("spike", "stall", "off_cpu", "runq_wait")  # evidence kinds, not only ops
LIMIT = 500
def f(status, op, n, rows):
    a = status < 500 or n >= 400  # an HTTP status, a count
    b = op == "ncclSend" and op in CALLS.code_set
    frees = {o for o in ALLOC_OPS if "Free" in o}  # within a family, not the catalogue
    codes = [o.code for o in OPS]  # every op: no pick
    c = [r for r in rows if len(r) > LIMIT]
    return ("cudaLaunchKernel",)
'''
    assert findings(fine, "x.py") == []


def test_the_c_side_tests_families_with_the_generated_macros() -> None:
    defines = catalog.c_defines()
    macros = {d.split("(", 1)[0] for d in defines if d.startswith("FL_OPS_")}
    assert macros == {catalog.family_macro(f) for f in catalog.FAMILIES}
    assert "FL_OPS_NCCL_P2P(op)=((op) == 405 || (op) == 406)" in defines
    for src in sorted((REPO / "bpf").glob("*.[ch]")):
        text = src.read_text()
        chains = re.findall(r"\bop\s*==\s*OP_\w+\s*\|\|\s*op\s*==\s*OP_\w+", text)
        assert not chains, f"{src.name}: a family spelled out in C ({chains}): {FIX}"
        unknown = set(re.findall(r"\bFL_OPS_\w+", text)) - macros
        assert not unknown, f"{src.name}: no such family macro {sorted(unknown)}"


def test_record_flags_have_one_source() -> None:
    """FL_WHY_* are defined from bpfsrc.WHY (the decoder reads with the same bits)."""
    header = (REPO / "bpf" / "fleetd.h").read_text()
    assert not re.search(r"#define FL_WHY_", header), "FL_WHY_* values belong in bpfsrc.WHY"
    flags = bpfsrc.cflags(bpfsrc.ProgramOptions(tracer_pid=1))
    assert [f for f in flags if f.startswith("-DFL_WHY_")] == [
        "-DFL_WHY_SAMPLE=1u", "-DFL_WHY_SLOW=2u", "-DFL_WHY_ERROR=4u", "-DFL_WHY_ALWAYS=8u"]
    used = set(re.findall(r"\bFL_WHY_(\w+)", "".join(
        p.read_text() for p in (REPO / "bpf").glob("*.[ch]"))))
    assert used <= set(bpfsrc.WHY), used - set(bpfsrc.WHY)


def test_families_and_code_ranges_agree() -> None:
    """The families stand for the code ranges the copies used: the calls are the codes
    below the host block (500), NCCL's the 400 block, the CUDA API's below it."""
    assert catalog.CALLS.code_set == {c for c in catalog.BY_CODE if c < 500}
    assert catalog.NCCL.code_set == {c for c in catalog.BY_CODE if 400 <= c <= 499}
    assert catalog.CUDA_CALLS.code_set == {c for c in catalog.BY_CODE if c < 400}
    for f in catalog.FAMILIES:
        assert f.codes == tuple(catalog.BY_NAME[n].code for n in f.names), f.name
        assert list(f.codes) == sorted(f.codes) and len(f.name_set) == len(f.names) >= 2
    assert catalog.KERNEL_LAUNCHES.name_set < catalog.LAUNCHES.name_set
    assert catalog.READBACKS.name_set < catalog.SYNCS.name_set
    assert catalog.RECLAIM_RUNS.name_set == set(catalog.RECLAIM_RUNS_BY_KIND)
    assert set(catalog.NCCL_P2P_MATCH) == catalog.NCCL_P2P.name_set


def test_the_schema_doc_lists_every_family_with_its_ops() -> None:
    """docs/schema.md's "Op families" table: a row per family; where a row names ops,
    they are exactly the family's."""
    doc = (REPO / "docs" / "schema.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| (.*) \|$", doc, re.M))
    for f in catalog.FAMILIES:
        assert f.name in rows, f"docs/schema.md has no row for the op family {f.name}"
        named = {w for w in re.findall(r"`(\w+)`", rows[f.name]) if w in catalog.BY_NAME}
        assert not named or named == f.name_set, (f.name, named ^ f.name_set)
