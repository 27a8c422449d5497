"""CUDA code told by the symbols a file defines (fleetd.trace.host.libs, issue #41 point 3),
checked against pyelftools reading the same files the slow, general way: the real CUDA
runtime of the wheel, a program linked with its libcudart_static.a, the same program
stripped, a vendored copy under another name, a file with no CUDA in it, a truncated one.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from fleetd.trace.bpf.probes import PROBE_SYMBOLS, library_symbols
from fleetd.trace.host import libs

from conftest import REPO

LIB = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / \
    "site-packages" / "nvidia" / "cuda_runtime" / "lib"
pytestmark = pytest.mark.skipif(not (LIB / "libcudart_static.a").exists(),
                                reason="needs the nvidia-cuda-runtime-cu12 wheel")


def _reference(path: Path) -> dict[str, int]:
    """Defined function symbols among PROBE_SYMBOLS and their file offsets, by pyelftools."""
    out: dict[str, int] = {}
    with open(path, "rb") as f:
        elf = ELFFile(f)
        loads = [s for s in elf.iter_segments() if s["p_type"] == "PT_LOAD"]
        for sec in elf.iter_sections():
            if not isinstance(sec, SymbolTableSection):
                continue
            for sym in sec.iter_symbols():
                if (sym.name in PROBE_SYMBOLS and sym.name not in out
                        and sym["st_shndx"] != "SHN_UNDEF"
                        and sym["st_info"]["type"] in ("STT_FUNC", "STT_LOOS")
                        and sym["st_value"]):
                    v = sym["st_value"]
                    seg = next(s for s in loads
                               if s["p_vaddr"] <= v < s["p_vaddr"] + s["p_memsz"])
                    out[sym.name] = v - seg["p_vaddr"] + seg["p_offset"]
    return out


@pytest.fixture(scope="module")
def static_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler")
    exe = tmp_path_factory.mktemp("elf") / "static_cudart"
    subprocess.run(["cc", "-O1", "-o", str(exe), str(REPO / "tests/workloads/static_cudart.c"),
                    str(LIB / "libcudart_static.a"), "-lpthread", "-ldl", "-lrt"],
                   check=True, timeout=120)
    return exe


def test_the_shared_runtime_by_its_dynamic_symbols() -> None:
    path = LIB / "libcudart.so.12"
    assert libs.file_kinds(str(path)) == (["cudart"], False)
    got = library_symbols(str(path)).offsets
    assert got == _reference(path) and "cudaLaunchKernel" in got


def test_a_program_with_the_static_runtime(static_exe: Path) -> None:
    assert libs.file_kinds(str(static_exe)) == (["cudart"], False)
    got = library_symbols(str(static_exe)).offsets
    assert got == _reference(static_exe)
    assert {"cudaLaunchKernel", "cudaMemcpy", "cudaDeviceSynchronize"} <= got.keys()


def test_stripped_it_is_recognised_but_has_nothing_to_probe(static_exe: Path,
                                                            tmp_path: Path) -> None:
    stripped = tmp_path / "stripped"
    shutil.copy(static_exe, stripped)
    subprocess.run(["strip", str(stripped)], check=True, timeout=60)
    assert libs.file_kinds(str(stripped)) == ([], True)
    assert library_symbols(str(stripped)).offsets == {}


def test_a_vendored_copy_by_name_and_by_symbols(tmp_path: Path) -> None:
    copy = tmp_path / "libcudart-1a2b3c4d.so.12"
    shutil.copy(LIB / "libcudart.so.12", copy)
    assert libs.kind_of(copy) == "cudart"
    assert libs.file_kinds(str(copy)) == (["cudart"], False)


def test_no_cuda_and_a_broken_file(tmp_path: Path) -> None:
    assert libs.file_kinds(sys.executable) == ([], False)
    cut = tmp_path / "cut.so"
    cut.write_bytes((LIB / "libcudart.so.12").read_bytes()[:4096])
    with pytest.raises(ValueError):
        libs.file_kinds(str(cut))
