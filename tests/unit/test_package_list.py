"""Every package of fleetd is in pyproject.toml's explicit package list: a new one left
out installs from a checkout (the tests run from it) and is missing from the wheel and
the bundle, which fail only where they are built (it happened with fleetd.wire and
fleetd.questions)."""

from __future__ import annotations

import tomllib

from conftest import REPO


def test_every_package_is_in_the_wheel() -> None:
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())
                 ["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts)
             for p in (REPO / "fleetd").rglob("__init__.py")}
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - found - {"fleetd.bpf", "fleetd.configs"} == set()
