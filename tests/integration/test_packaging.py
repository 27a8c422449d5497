"""The release artifacts: an sdist and a wheel built from the checkout, offline, and the
wheel installed into a fresh venv where fleetd runs from a directory that is not the
checkout, finding its BPF sources and example configs through importlib.resources.

Offline: ``python -m build --no-isolation`` uses the venv's setuptools (a test extra),
the wheel is built from the sdist (so a file the sdist forgets is missing from the
wheel too), and the fresh venv gets the wheel alone (``--no-deps --no-index``); its
dependencies come from the project venv through a .pth file, appended after the fresh
venv's own site-packages so that the installed fleetd, not the checkout, is imported.

The fresh venv is also the laptop install of issue #19 (item 11): no system site
packages and no BCC (the project venv links bcc in through a .pth file of its own, which
a path in another .pth never runs). The client commands run there, load nothing
outside the wheel's own dependencies (the ``agent`` extra and the test extra not
included), and the agent says in one line how to get BCC.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, cli_probe

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
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
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
        "from fleetd.trace.bpf.bpfsrc import source_text\n"
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


# ---- the laptop install: the client without bcc, root or the agent extra --------------

# Runs client commands in one interpreter of the fresh venv, then names every module
# they loaded that belongs to no distribution the wheel requires (its dependencies
# without extras, and theirs): what a `pip install fleetd` would lack.
CLIENT_PROBE = cli_probe([
    ["--help"], ["explain", "--db", "{db}", "--format", "json"],
    ["explain", "--db", "{db}", "--format", "html", "-o", "{work}/r.html"],
    ["ops", "--db", "{db}"], ["query", "--db", "{db}", "SELECT count(*) FROM events"],
    ["merge", "{db}", "-o", "{work}/m.db"], ["export", "--db", "{db}", "-o", "{work}/t.json"],
    ["certs", "--dir", "{work}/pki", "init-ca"], ["certs", "--help"]]) + """
loaded = {m.split(".")[0] for m in list(sys.modules)}

import importlib.metadata as md, re
from packaging.requirements import Requirement

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

need, todo = set(), [("fleetd", frozenset())]
while todo:
    name, extras = todo.pop()
    for text in md.requires(name) or []:
        req = Requirement(text)
        if req.marker and not any(req.marker.evaluate({"extra": e})
                                  for e in {"", *extras}):
            continue
        if norm(req.name) not in need:
            need.add(norm(req.name))
            todo.append((req.name, frozenset(req.extras)))
owners = md.packages_distributions()
outside, unknown = set(), set()
for top in loaded - set(sys.stdlib_module_names) - {"fleetd", "__main__", "packaging"}:
    dists = {norm(d) for d in owners.get(top, [])}
    # Unowned private names are the runtime's own: multiprocessing's __mp_main__,
    # Cython's shared runtime modules, an extension's registered submodule.
    if not dists:
        if not top.startswith("_") and top != "cython_runtime":
            unknown.add(top)
    elif not dists & need:
        outside.add(top + " (" + ", ".join(sorted(dists)) + ")")
print(json.dumps({"codes": codes, "outside": sorted(outside), "unknown": sorted(unknown),
                  "bcc": "bcc" in loaded, "elftools": "elftools" in loaded,
                  "need": sorted(need)}))
"""


def test_the_client_runs_without_bcc_root_or_the_agent_extra(fresh: Path,
                                                             tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    import synth

    bin_ = fresh / "bin"
    no_bcc = in_fresh(tmp_path, bin_ / "python", "-c",
                      "import importlib.util as u; print(u.find_spec('bcc') is None)")
    assert no_bcc.stdout.strip() == "True"  # what a laptop has
    db = synth.cpu_hog(tmp_path / "node.db")
    assert "explain" in in_fresh(tmp_path, bin_ / "fleetd", "--help").stdout
    assert "init-ca" in in_fresh(tmp_path, bin_ / "fleetd", "certs", "--help").stdout
    report = json.loads(in_fresh(tmp_path, bin_ / "fleetd", "explain", "--db", db,
                                 "--format", "json").stdout)
    assert [(c["severity"], c["root_cause"]) for c in report["chains"]][0] == \
        ("HIGH", "cpu_contention")
    work = tmp_path / "work"
    work.mkdir()
    got = json.loads(in_fresh(tmp_path, bin_ / "python", "-c", CLIENT_PROBE, db,
                              work).stdout)
    assert got["codes"] == [0] * 9, got
    assert {"aiohttp", "cryptography", "mcp", "orjson"} <= set(got["need"])
    assert "rich" not in got["need"]  # nothing imports it
    assert "pyelftools" not in got["need"]  # the agent extra
    assert not got["bcc"] and not got["elftools"], got
    assert got["outside"] == [] and got["unknown"] == [], got


def test_the_agent_without_bcc_says_how_to_install_it(fresh: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FLEETD_DB")}
    for cmd in (["agent"], ["agent", "--all", "--db", str(tmp_path / "a.db")],
                ["trace", "--pid", "1", "--db", str(tmp_path / "t.db")],
                *([["demo", "-o", str(tmp_path / "demo")]] if os.geteuid() == 0 else [])):
        proc = subprocess.run([fresh / "bin" / "fleetd", *cmd], capture_output=True,
                              text=True, timeout=60, cwd=tmp_path, env=env)
        assert proc.returncode == 1, proc
        assert "Traceback" not in proc.stderr
        first, hint = proc.stderr.splitlines()
        assert first.startswith(f"fleetd: error: fleetd {cmd[0]} needs BCC's Python "
                                "module, which is not installed here"), proc.stderr
        assert "apt-get install python3-bpfcc" in hint and "pip install bcc" in hint
        # A pip install has no scripts/: the hint offers it only for a checkout (#44.6).
        assert "run bash scripts/setup.sh" not in hint
    # Checked before anything starts: no database file, no port.
    assert not list(tmp_path.glob("*.db"))


def test_check_on_a_client_install_says_the_node_side_is_not_installed(
        fresh: Path, tmp_path: Path) -> None:
    """The laptop install the README describes: `fleetd check` reports the node-side
    groups as not installed here, with the install hint, never a traceback."""
    proc = subprocess.run([fresh / "bin" / "fleetd", "check", "--format", "json",
                           "--db", str(tmp_path / "c.db")],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert "Traceback" not in proc.stderr, proc.stderr
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    for group in ("host", "cuda"):
        assert checks[group]["status"] == "skip", checks
        assert "node side not installed here" in checks[group]["detail"]
        assert "python3-bpfcc" in checks[group]["fix"]
    assert all(c["status"] != "fail" for c in checks.values() if c["group"] in
               ("host", "cuda")), checks
