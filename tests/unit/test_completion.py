"""`fleetd completion bash`, driven through bash's own completion machinery: the
generated function is called with COMP_WORDS as bash would set them on <TAB>."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import FLEETD


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("completion") / "fleetd.bash"
    out = subprocess.run([FLEETD, "completion", "bash"], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    path.write_text(out)
    return path


def complete(script: Path, words: list[str], cwd: Path) -> list[str]:
    """What bash offers for the last word of ``fleetd WORDS``."""
    line = " ".join(["fleetd", *words])
    argv = " ".join(f"'{w}'" for w in ["fleetd", *words])
    prog = (f"source '{script}'; COMP_WORDS=({argv}); COMP_CWORD={len(words)}; "
            f"COMP_LINE='{line}'; COMP_POINT=${{#COMP_LINE}}; "
            f"_shtab_fleetd fleetd '{words[-1]}' '{words[-2] if len(words) > 1 else 'fleetd'}'; "
            "printf '%s\\n' \"${COMPREPLY[@]}\"")
    out = subprocess.run(["bash", "-c", prog], capture_output=True, text=True, cwd=cwd,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    return [w for w in out.stdout.split("\n") if w]


def test_subcommands_options_and_choices_complete(script: Path, tmp_path: Path) -> None:
    assert complete(script, ["expl"], tmp_path) == ["explain"]
    assert "--format" in complete(script, ["explain", "--fo"], tmp_path)
    assert complete(script, ["explain", "--format", "j"], tmp_path) == ["json"]


def test_path_options_complete_file_names(script: Path, tmp_path: Path) -> None:
    (tmp_path / "inv" / "scenarios").mkdir(parents=True)
    for name in ("cpu_hog.db", "cpu2.db", "gil.db"):
        (tmp_path / "inv" / "scenarios" / name).touch()
    got = complete(script, ["explain", "--db", "inv/scenarios/cp"], tmp_path)
    assert sorted(got) == ["inv/scenarios/cpu2.db", "inv/scenarios/cpu_hog.db"]
    assert complete(script, ["merge", "inv/scenarios/g"], tmp_path) == ["inv/scenarios/gil.db"]
    assert complete(script, ["query", "--ca-cert", "inv/scenarios/g"], tmp_path) == \
        ["inv/scenarios/gil.db"]


def test_zsh_script_completes_files_for_path_options() -> None:
    out = subprocess.run([FLEETD, "completion", "zsh"], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    db = [line for line in out.splitlines() if "\"--db[" in line or "'--db[" in line]
    assert db and all(":_files" in line for line in db), db[:3]
