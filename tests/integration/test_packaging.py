"""The release artifacts: an sdist and a wheel built from the checkout, offline, and the
wheel installed into a fresh venv where fleetd runs from a directory that is not the
checkout, finding its BPF sources and example configs through importlib.resources.

Offline: ``python -m build --no-isolation`` uses the venv's setuptools (a test extra),
the wheel is built from the sdist (so a file the sdist forgets is missing from the
wheel too), and the fresh venv gets the wheel alone (``--no-deps --no-index``); its
dependencies come from the project venv through a .pth file, appended after the fresh
venv's own site-packages so that the installed fleetd, not the checkout, is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sysconfig
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

VENV_PY = REPO / ".venv" / "bin" / "python"
CONFIGS = ("fleetd.yaml", "fleetd-agent.service", "daemonset.yaml")


@dataclass
class Built:
    sdist: Path
    wheel: Path


def run(*cmd: str | Path, cwd: Path = REPO, env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    out = tmp_path_factory.mktemp("dist")
    run(VENV_PY, "-m", "build", "--no-isolation", "--outdir", out, REPO)
    (sdist,) = out.glob("fleetd-*.tar.gz")
    (wheel,) = out.glob("fleetd-*.whl")
    return Built(sdist, wheel)


def test_the_wheel_carries_every_package_and_the_package_data(built: Built) -> None:
    names = set(zipfile.ZipFile(built.wheel).namelist())
    bpf = sorted(p.name for p in (REPO / "bpf").glob("*.bpf.c"))
    assert len(bpf) >= 6
    wanted = {f"fleetd/bpf/{n}" for n in [*bpf, "fleetd.h"]}
    wanted |= {f"fleetd/configs/{n}" for n in CONFIGS} | {"fleetd/py.typed"}
    # Every package of the checkout: pyproject lists them by hand, so a new one is
    # easy to forget.
    wanted |= {f"{p.parent.relative_to(REPO).as_posix()}/__init__.py"
               for p in (REPO / "fleetd").rglob("__init__.py")}
    assert wanted - names == set()
    assert not [n for n in names if n.endswith((".key", ".pem", ".pyc"))]
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "fleetd = fleetd.cli.main:main" in zipfile.ZipFile(built.wheel).read(entry).decode()


def test_the_sdist_carries_the_sources_docs_and_setup(built: Built) -> None:
    with tarfile.open(built.sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = {"README.md", "pyproject.toml", "scripts/setup.sh", "bpf/fleetd.h",
              "certs/README.md"}
    wanted |= {f"bpf/{p.name}" for p in (REPO / "bpf").glob("*.bpf.c")}
    wanted |= {f"configs/{n}" for n in CONFIGS}
    wanted |= {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")}
    assert wanted - names == set()
    assert not [n for n in names if n.endswith((".key", ".pem"))]


@pytest.fixture(scope="module")
def fresh(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    run(VENV_PY, "-m", "venv", "--without-pip", venv)
    run(VENV_PY, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-deps",
        "--no-index", "--quiet", built.wheel)
    deps = sysconfig.get_paths()["purelib"]  # this interpreter is the project venv's
    site = run(venv / "bin" / "python", "-c",
               "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    Path(site, "project-venv-deps.pth").write_text(deps + "\n")
    yield venv


def in_fresh(tmp_path: Path, *cmd: str | Path) -> subprocess.CompletedProcess[str]:
    """Run from an empty directory with a clean environment: nothing of the checkout
    can be found by accident."""
    cwd = tmp_path / "elsewhere"
    cwd.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FLEETD_DB")}
    return run(*cmd, cwd=cwd, env=env, timeout=60)


def test_the_installed_wheel_runs_from_anywhere(fresh: Path, tmp_path: Path) -> None:
    bin_ = fresh / "bin"
    from fleetd import __version__

    assert in_fresh(tmp_path, bin_ / "fleetd", "--version").stdout.strip() == \
        f"fleetd {__version__}"
    assert "check" in in_fresh(tmp_path, bin_ / "fleetd", "--help").stdout
    db = tmp_path / "data" / "node.db"
    out = in_fresh(tmp_path, bin_ / "fleetd", "check", "--only", "db", "--format",
                   "json", "--db", db).stdout
    report = json.loads(out)
    assert report["status"] == "ok" and report["checks"][0]["data"]["path"] == str(db)


def test_the_installed_wheel_loads_its_own_bpf_sources_and_configs(fresh: Path,
                                                                  tmp_path: Path) -> None:
    probe = (
        "import json, fleetd\n"
        "from fleetd.checks import example_file\n"
        "from fleetd.trace.bpfsrc import source_text\n"
        "text = source_text(['cuda', 'driver', 'nccl', 'host'])\n"
        "print(json.dumps({'fleetd': fleetd.__file__, 'program': text,\n"
        "                  'config': str(example_file('fleetd.yaml')),\n"
        "                  'config_text': example_file('fleetd.yaml').read_text()}))\n"
    )
    got = json.loads(in_fresh(tmp_path, fresh / "bin" / "python", "-c", probe).stdout)
    assert got["fleetd"].startswith(str(fresh)), got["fleetd"]
    assert got["config"].startswith(str(fresh)), got["config"]
    assert got["config_text"] == (REPO / "configs" / "fleetd.yaml").read_text()
    program = got["program"]
    for name in ("fleetd.h", "common.bpf.c", "cuda.bpf.c", "host.bpf.c", "proc.bpf.c"):
        assert f"/* ---- {name} ---- */" in program
    assert '#include "' not in program  # every local include was inlined
