"""docs/architecture.md says which questions of the registry declare what (#46 item 6):
a local answer, a combine, the wire's reader, a TypedDict, a table and an MCP tool. The
lists there must name exactly the questions of fleetd.questions.catalog that do."""

from __future__ import annotations

import re

from fleetd.questions.catalog import QUESTIONS
from fleetd.questions.spec import Question

from conftest import REPO

DOC = REPO / "docs" / "architecture.md"
# The Question field each list is about, and what makes a question declare it.
DECLARES = {
    "local": lambda q: q.local is not None,
    "combine": lambda q: q.combine is not None,
    "check": lambda q: q.check is not None,
    "shape": lambda q: q.shape is not None,
    "columns": lambda q: bool(q.columns),
    "tool": lambda q: q.tool is not None,
}


def listed(text: str) -> dict[str, list[str]]:
    """Field -> the question names the registry section lists after ``(`field`: ``."""
    section = text.split("**`fleetd.questions`.**", 1)[1].split("```text", 1)[0]
    section = " ".join(section.split())
    out = {}
    for field in DECLARES:
        found = re.search(rf"`{field}`: ([a-z_, ]+?)[;)]", section)
        assert found, f"docs/architecture.md's registry section lists no `{field}`"
        out[field] = [n.strip() for n in found.group(1).split(",")]
    return out


def declaring(field: str) -> list[str]:
    test = DECLARES[field]
    return [q.name for q in QUESTIONS if test(q)]


def test_the_registry_section_names_what_each_question_declares() -> None:
    doc = listed(DOC.read_text())
    for field, names in doc.items():
        assert sorted(names) == sorted(declaring(field)), (
            f"docs/architecture.md lists {names} as declaring `{field}`, the registry "
            f"{declaring(field)}")


def test_a_question_that_gains_a_reader_breaks_the_list() -> None:
    import dataclasses

    more = dataclasses.replace(QUESTIONS[1], check=lambda r: r)
    assert isinstance(more, Question)
    names = [q.name for q in (*QUESTIONS[:1], more, *QUESTIONS[2:]) if q.check is not None]
    assert sorted(names) != sorted(listed(DOC.read_text())["check"])
