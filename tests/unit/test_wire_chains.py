"""fleetd/wire/chains.py: a node's chains and profile answers, checked before the fleet
client ranks and renders them. Real answers (a shipped scenario, answered as the agent
answers them) pass whole and unchanged; one bad value anywhere fails the node's answer
with the place it was found."""

from __future__ import annotations

import copy
import sqlite3
from typing import Any

import pytest

from fleetd.analyze.facade import Analysis
from fleetd.questions.catalog import CHAINS, PROFILE
from fleetd.wire.chains import check_chains_reply, check_profile_reply
from fleetd.wire.failure import BadReply

from conftest import REPO

SCENARIO = REPO / "investigations" / "scenarios" / "cpu_hog.db"


def _answers() -> tuple[dict[str, Any], dict[str, Any]]:
    with sqlite3.connect(f"file:{SCENARIO}?mode=ro", uri=True) as conn:
        a = Analysis.of(conn)
        node = a.node_names()[0]
        chains = CHAINS.on_node(a, node, CHAINS.parse({}))
        profile = PROFILE.on_node(a, node, PROFILE.parse({}))
    return dict(chains), dict(profile)


def test_real_answers_pass_whole() -> None:
    chains, profile = _answers()
    assert chains["chains"] and chains["chains"][0]["culprit"]
    before = copy.deepcopy(chains)
    assert check_chains_reply(chains) == before
    assert check_profile_reply(profile)["features"]
    assert check_profile_reply({"node": "n", "error": "no such node in this database"})


@pytest.mark.parametrize(("change", "where"), [
    (lambda c: c.update(severity="URGENT"), "chains[0].severity"),
    (lambda c: c["victim"].update(pid="12"), "chains[0].victim.pid"),
    (lambda c: c.update(culprit={"pid": 1, "comm": 7, "self": False}), "chains[0].culprit.comm"),
    (lambda c: c["culprits"][0].update(share="all"), "chains[0].culprits[0].share"),
    (lambda c: c.update(evidence=[{"text": "no kind"}]), "chains[0].evidence[0].kind"),
    (lambda c: c.update(fixes=[None]), "chains[0].fixes[0]"),
    (lambda c: c.pop("ts_ns"), "chains[0].ts_ns"),
])
def test_one_bad_value_fails_the_answer_where_it_is(change: Any, where: str) -> None:
    chains, _ = _answers()
    change(chains["chains"][0])
    with pytest.raises(BadReply, match=where.replace("[", r"\[").replace("]", r"\]")):
        check_chains_reply(chains)


def test_a_profile_feature_must_be_a_number_a_name_or_null() -> None:
    _, profile = _answers()
    profile["features"]["runq_share"] = [0.5]
    with pytest.raises(BadReply, match="features.runq_share"):
        check_profile_reply(profile)
