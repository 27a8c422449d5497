"""The README's laptop path, run as written: its code blocks are executed, not copied.

The first block after the two ``make`` commands installs the client into ``~/.fleetd``
and explains a shipped recording. It runs here in a copy of the checkout, with HOME in
a temporary directory and pip kept offline: the dependencies come from the project's
venv (PYTHONPATH), so the test proves the commands and the package, not the network.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

from conftest import REPO

README = (REPO / "README.md").read_text()


def _blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", README, flags=re.S)


def _checkout_copy(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\n")
    for rel in filter(None, files):
        src = REPO / rel
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():  # investigations/scenarios -> ../tests/data/scenarios
            os.symlink(os.readlink(src), dest / rel)
        elif src.is_file():
            shutil.copy2(src, dest / rel)
    return dest


def test_the_no_root_block_installs_the_client_and_explains(tmp_path: Path) -> None:
    block = _blocks()[1]
    assert "~/.fleetd/bin/pip install ." in block and "fleetd explain --db" in block
    checkout = _checkout_copy(tmp_path / "checkout")
    home = tmp_path / "home"
    home.mkdir()
    env = {**{k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "FLEETD_DB")},
           "HOME": str(home), "PYTHONPATH": sysconfig.get_paths()["purelib"],
           "PIP_NO_INDEX": "1",
           "PIP_NO_BUILD_ISOLATION": "0",  # pip reads this switch inverted: 0 = no isolation
           "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           # the README's python3 is whatever the user has; here the project's own
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=checkout, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[HIGH] cpu_contention" in r.stdout and "culprit: cpu-hog" in r.stdout
    assert (home / ".fleetd" / "bin" / "fleetd").exists()


def test_the_readme_lists_what_the_client_installs_and_which_commands_trace() -> None:
    from fleetd.trace.host.require import BCC_HINT, NODE_COMMANDS

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = sorted(re.split(r"[<>=;\[ ]", d)[0].lower() for d in deps)
    listed = re.search(r"only the client's dependencies \(([^;]*);", README)
    assert listed is not None
    assert sorted(n.strip().lower() for n in listed.group(1).replace("\n", " ").split(",")) \
        == names
    assert "every command but " + ", ".join(f"`{c}`" for c in NODE_COMMANDS[:-1]) + \
        f" and `{NODE_COMMANDS[-1]}`" in README
    assert BCC_HINT in README  # the error the README shows is the one users get
    assert "/opt/fleetd/bin/fleetd" in README and "/opt/fleetd/.venv" not in README
