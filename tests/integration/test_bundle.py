"""The offline bundle for air-gapped GPU nodes (issue 30): ``make bundle`` builds it under
its size limit, the dry run of ``scripts/gpu-check.sh`` passes from a copy of the archive
outside the checkout, and the launcher refuses clearly, in one line, where it cannot run.

The dry run is the GPU check on a machine without a GPU, as the GPU machine would see
it: the system's own python3 (not the venv's, which is nowhere on PATH), the bundle for
that Python version, and no kernel headers at all: /usr/include and /usr/src are hidden
in a mount namespace, so fleetd's "generated" header route must use the bundle's uapi
copy (the GPU machine has no header package). The reference workloads' CUDA libraries
(the nvidia-cuda-runtime-cu12 and nvidia-nccl-cu12 wheels' libraries, and Debian's
libcuda.so.1 when scripts/fetch-libcuda.sh fetched it) are copied next to the archive:
they stand in for the GPU machine's torch install, not for anything the bundle carries.

``make bundle`` keeps its downloads and compressed layers in build/bundle-cache: a cold
build downloads about 60 MB and compresses LLVM (two to four minutes on two cores); a
warm one takes well under a minute.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import REPO

SYS_PY = Path("/usr/bin/python3")
LIMIT = 44 * 2**20
SITE = Path(sys.prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / \
    "site-packages"


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (the dry run traces; the check hides /usr/include in a namespace)"
    if not SYS_PY.exists():
        return f"no system python3 at {SYS_PY}"
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux)"
    return None


_WHY = _why_not()
pytestmark = [pytest.mark.slow, pytest.mark.bpf, pytest.mark.timeout(1200),
              pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]


def _sys_version() -> str:
    return subprocess.run([str(SYS_PY), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                          capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``make bundle`` for the system python3's version (the dry run's interpreter)."""
    tmp = tmp_path_factory.mktemp("bundle")
    out = tmp / f"fleetd-bundle-py{_sys_version()}-x86_64.tar.xz"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "WITHOUT")}
    env.update(FLEETD_BUNDLE_OUT=str(out), FLEETD_BUNDLE_WORK=str(tmp / "work"))
    r = subprocess.run(["make", "bundle", f"PYTHON={_sys_version()}"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=1100)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    print(r.stdout[-2500:])  # the size table, in the test log
    shutil.rmtree(tmp / "work", ignore_errors=True)
    return out


@pytest.fixture(scope="module")
def unpacked(archive: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Unpacked as docs/deploy.md says, by the unpacker make bundle puts beside it."""
    dest = tmp_path_factory.mktemp("unpacked")
    r = subprocess.run([str(SYS_PY), str(archive.parent / "fleetd-bundle-unpack.py"),
                        str(archive), str(dest)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return dest / "fleetd-bundle"


def _copy_as_shipped(archive: Path, here: Path) -> None:
    """What travels to a node: the archive, its .sha256 and the unpacker."""
    for f in (archive, archive.with_name(archive.name + ".sha256"),
              archive.with_name("fleetd-bundle-unpack.py")):
        shutil.copy(f, here)


def workload_libs(dest: Path) -> Path:
    """The real CUDA runtime and libnccl of the wheels, and libcuda if it was fetched."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted = [SITE / "nvidia/cuda_runtime/lib/libcudart.so.12",
              SITE / "nvidia/nccl/lib/libnccl.so.2"]
    wanted += sorted((REPO / ".venv" / "libcuda").glob("usr/lib/*/nvidia/current/libcuda.so.1"))[:1]
    for lib in wanted:
        if lib.exists():
            os.symlink(lib.resolve(), dest / lib.name)  # the same inode: no 450 MB copy
    return dest


def test_the_archive_is_under_the_limit(archive: Path) -> None:
    size = archive.stat().st_size
    assert size <= LIMIT, f"{archive.name}: {size / 2**20:.2f} MiB > 44 MiB"
    sums = archive.with_name(archive.name + ".sha256").read_text()
    assert sums == f"{hashlib.sha256(archive.read_bytes()).hexdigest()}  {archive.name}\n"
    report = json.loads(archive.with_name(archive.name.replace(".tar.xz", ".json")).read_text())
    assert report["bytes"] == size
    layers = {row["layer"]: row for row in report["layers"]}
    assert {"llvm", "clang", "native", "python", "fleetd", "headers", "rest"} <= set(layers)
    with tarfile.open(archive) as tf:
        names = set(tf.getnames())
    for must in ("fleetd-bundle/bin/fleetd", "fleetd-bundle/bin/fleetd-python",
                 "fleetd-bundle/lib/libbcc.so.0", "fleetd-bundle/lib/libLLVM-14.so.1",
                 "fleetd-bundle/lib/python/fleetd/__init__.py",
                 "fleetd-bundle/lib/python/bcc/__init__.py",
                 "fleetd-bundle/include/linux/types.h", "fleetd-bundle/check/gpu_check.py",
                 "fleetd-bundle/check/train_loop.py", "fleetd-bundle/BUNDLE.json"):
        assert must in names, must


def test_dry_run_passes_from_a_copy_outside_the_checkout(archive: Path, tmp_path: Path) -> None:
    here = tmp_path / "elsewhere"
    here.mkdir()
    _copy_as_shipped(archive, here)
    shutil.copy(REPO / "scripts" / "gpu-check.sh", here)
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "OUT": str(out), "TMPDIR": str(tmp_path),
           "FLEETD_CHECK_WORKLOAD_LIBS": str(workload_libs(tmp_path / "libs")),
           "FLEETD_CACHE_DIR": str(tmp_path / "cache")}
    hide = ("mount -t tmpfs none /usr/include && mount -t tmpfs none /usr/src && "
            f"exec bash gpu-check.sh {archive.name}")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", hide],
                       cwd=here, env=env, capture_output=True, text=True, timeout=900)
    report_file = out / "gpu-check.json"
    assert report_file.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(report_file.read_text())
    items = report["items"]
    assert r.returncode == 0, (report["failed"], r.stderr[-3000:])
    assert report["mode"] == "dry-run" and report["status"] == "ok"
    assert "reference workloads" in report["dry_run_note"]
    assert (out / "gpu-check.db").stat().st_size > 0
    for name, item in items.items():
        assert item["status"] == "ok" or item["status"].startswith("skipped"), (name, item)
    for name in ("bundle", "check", "calls_vs_workload", "kernel_names", "graph_launches",
                 "python_frames", "profiler_import", "nccl", "verdicts", "overhead"):
        assert items[name]["status"] == "ok", (name, items[name])
    assert items["calls_vs_profiler"]["status"].startswith("skipped: no GPU")
    has_libcuda = (tmp_path / "libs" / "libcuda.so.1").exists()
    assert items["driver_launches"]["status"] == ("ok" if has_libcuda else
                                                  items["driver_launches"]["status"])
    # Everything from the bundle: the system's python3, the bundle's libraries and modules.
    bundle = items["bundle"]
    assert report["machine"]["python_path"] == str(SYS_PY)
    where = bundle["path"]
    assert where.startswith(str(tmp_path)) and not where.startswith(str(REPO))
    for lib in ("libbcc.so", "libclang-cpp.so", "libLLVM-14.so", "libz3.so", "libxml2.so"):
        assert bundle["native_libraries"][lib].startswith(where), bundle["native_libraries"]
    for mod in ("fleetd", "bcc", "orjson", "cryptography", "aiohttp", "yaml", "elftools"):
        assert bundle["python_modules"][mod].startswith(where), bundle["python_modules"]
    # No header package and no /usr/include: the generated route over the bundle's copy.
    assert "route generated" in items["check"]["headers"], items["check"]["headers"]
    assert f"{where}/include" in items["check"]["headers"]
    assert bundle["startup_s"]["warm_median"] < 10
    # The archive went with the check when it ended.
    assert not list(tmp_path.glob("fleetd-bundle.*"))


def test_the_gpu_path_runs_with_a_stand_in_for_torch(archive: Path, tmp_path: Path) -> None:
    """FLEETD_GPU_CHECK_SIMULATE=1: the GPU mode's phases, detaching and attaching again,
    the profiler's trace imported and compared in its window, with the reference workload
    standing in for torch and a Kineto file of exactly the calls it made: what the GPU run
    will do, short of the GPU (which only the GPU machine can check)."""
    out = tmp_path / "out"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8", "OUT": str(out),
           "TMPDIR": str(tmp_path), "FLEETD_GPU_CHECK_SIMULATE": "1",
           "FLEETD_CHECK_WORKLOAD_LIBS": str(workload_libs(tmp_path / "libs")),
           "FLEETD_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh"), str(archive), "--",
                        "--steps", "100", "--profiled-steps", "50", "--stack-slow", "1us"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    report = json.loads((out / "gpu-check.json").read_text())
    assert r.returncode == 0, (report["failed"], r.stderr[-3000:])
    assert report["mode"] == "gpu-simulated"
    items = report["items"]
    calls = items["calls_vs_profiler"]
    assert calls["status"] == "ok" and calls["groups"]["launches/runtime"]["fleetd"] > 0, calls
    for group in calls["groups"].values():
        assert group["fleetd"] == group["profiler"], calls
    assert items["kernel_names"]["examples_matched"] == ["abs"], items["kernel_names"]
    assert items["graph_launches"]["fleetd"] == items["graph_launches"]["profiler"]
    runs = items["overhead"]["runs"]
    assert {"eager_steps_per_s", "graph_steps_per_s"} <= set(runs), runs
    assert (out / "profiler-trace.json.gz").exists()


def test_the_carried_fallback_libraries_load_and_compile(unpacked: Path, tmp_path: Path) -> None:
    """FLEETD_BUNDLE_LIBS=all: libelf, libbpf, libffi... from the bundle even here, where
    the system has its own (a node without them gets exactly these), and BCC compiles."""
    code = ("import json, os\n"
            "from fleetd.trace.host.headers import prepare_route, applied\n"
            "import bcc\n"
            "route = prepare_route('generated')\n"
            "with applied(route):\n"
            "    b = bcc.BPF(text=b'int fl_probe(void *ctx) { return 0; }')\n"
            "    b.cleanup()\n"
            "maps = open('/proc/self/maps').read().split('\\n')\n"
            "print(json.dumps(sorted({l.split()[-1] for l in maps if '.so' in l})))\n")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "FLEETD_BUNDLE_LIBS": "all",
           "FLEETD_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([str(unpacked / "bin" / "fleetd-python"), "-c", code], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = json.loads(r.stdout.strip().splitlines()[-1])
    fallback = unpacked / "lib" / "fallback"
    for so in sorted(p.name for p in fallback.iterdir()):
        hits = [p for p in loaded if p.endswith("/" + so) or f"/{so}." in p]
        assert hits and all(h.startswith(str(fallback)) for h in hits), (so, hits)


def _one_line_refusal(r: subprocess.CompletedProcess[str], words: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fleetd-bundle: "), r.stderr
    assert words in lines[0], lines[0]
    assert not r.stdout


def test_the_launcher_refuses_without_python3(unpacked: Path, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"  # the tools the launcher uses, and no python
    bin_dir.mkdir()
    for tool in ("uname", "readlink", "dirname", "grep"):
        os.symlink(shutil.which(tool) or f"/bin/{tool}", bin_dir / tool)
    r = subprocess.run(["/bin/sh", str(unpacked / "bin" / "fleetd"), "--version"],
                       env={"PATH": str(bin_dir)}, capture_output=True, text=True, timeout=30)
    _one_line_refusal(r, "no python3 on PATH")


def test_the_launcher_refuses_a_wrong_architecture(unpacked: Path) -> None:
    r = subprocess.run([str(unpacked / "bin" / "fleetd"), "--version"], capture_output=True,
                       text=True, timeout=30, env={"PATH": "/usr/bin:/bin",
                                                   "FLEETD_BUNDLE_TEST_ARCH": "aarch64"})
    _one_line_refusal(r, "wrong architecture: this bundle is for x86_64 and this machine is "
                         "aarch64")


def test_the_launcher_refuses_to_trace_on_a_kernel_without_bpf(unpacked: Path,
                                                                tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "FLEETD_BUNDLE_TEST_BPF_FILE": str(tmp_path / "absent")}
    r = subprocess.run([str(unpacked / "bin" / "fleetd"), "trace", "--pid", "1"], env=env,
                       capture_output=True, text=True, timeout=30)
    _one_line_refusal(r, "kernel without BPF")
    # The analysis commands still run there.
    r = subprocess.run([str(unpacked / "bin" / "fleetd"), "--version"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("fleetd "), r.stderr


def test_the_launcher_refuses_to_trace_with_an_old_glibc(unpacked: Path) -> None:
    need = json.loads((unpacked / "BUNDLE.json").read_text())["glibc_needed"]
    assert need.startswith("2.") and int(need.split(".")[1]) >= 34, need
    r = subprocess.run([str(unpacked / "bin" / "fleetd"), "agent"], capture_output=True,
                       text=True, timeout=30, env={"PATH": "/usr/bin:/bin",
                                                   "FLEETD_BUNDLE_TEST_GLIBC": "2.31"})
    _one_line_refusal(r, f"glibc 2.31 is too old: the bundle's LLVM and BCC need glibc {need}")


def test_the_launcher_refuses_another_python_version(unpacked: Path, tmp_path: Path) -> None:
    other = tmp_path / "python3"  # a python3 of another version, first on PATH
    other.write_text("#!/bin/sh\n[ \"$1\" = -c ] && { echo 3.99; exit 0; }\nexit 1\n")
    other.chmod(0o755)
    r = subprocess.run([str(unpacked / "bin" / "fleetd"), "--version"], capture_output=True,
                       text=True, timeout=30, env={"PATH": f"{tmp_path}:/usr/bin:/bin"})
    # python3 is 3.99: the launcher takes python3.X of the bundle's version if there is one.
    version = _sys_version()
    if shutil.which(f"python{version}", path="/usr/bin:/bin"):
        assert r.returncode == 0, r.stderr
    else:
        _one_line_refusal(r, f"python3 is Python 3.99 and this bundle was built for {version}")
