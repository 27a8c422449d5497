"""Kernel headers for BCC: use the real ones when present, fall back otherwise.

BCC compiles BPF C against kernel headers and cannot use BTF alone. Our programs only
use tracepoints (whose layouts BCC reads from tracefs) and uprobes, so headers of
another kernel version are good enough. Routes, tried in order:

``env``            BCC_KERNEL_SOURCE set by the user: used as it is.
``system``         /lib/modules/$(uname -r)/build: what a distribution kernel ships.
``debian-merged``  Debian's linux-headers-<ver>-common overlaid by -<arch>, merged into
                   one tree of symlinks in the cache (BCC takes one directory).
``generated``      a tiny tree generated here: kconfig.h from /proc/config.gz, uapi
                   from /usr/include (or ``$FLEETD_UAPI_INCLUDE``: the offline bundle's
                   copy on a node without linux-libc-dev), stubs for the few kernel-only
                   headers BCC needs.

``FLEETD_HEADERS=<route>`` forces one route (tests and ``fleetd check`` use it).
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import logging
import os
import platform
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fleetd.security.private_dir import private_dir, user_cache_base

log = logging.getLogger("fleetd.trace.host.headers")

ROUTES = ("env", "system", "debian-merged", "generated")
_SRC_ROOT = Path("/usr/src")


@dataclass(frozen=True, slots=True)
class HeaderRoute:
    name: str
    source: str | None  # value for BCC_KERNEL_SOURCE; None = BCC's own lookup
    detail: str

    def describe(self) -> str:
        return f"{self.name} ({self.detail})"


def cache_dir() -> Path:
    """Where generated trees live: $FLEETD_CACHE_DIR, /var/cache/fleetd, ~/.cache/fleetd.

    Made private to this user (0700) or refused when it exists with another owner, as a
    symlink or writable by others: BCC compiles whatever headers are found there into
    programs loaded as root."""
    env = os.environ.get("FLEETD_CACHE_DIR")
    if env:
        return _private(Path(env), Path(env).parent)
    if os.geteuid() == 0:
        return _private(Path("/var/cache/fleetd"), Path("/var/cache"))
    base = user_cache_base()
    return _private(base / "fleetd", base)


def _private(path: Path, base: Path) -> Path:
    return private_dir(path, base=base, what="header cache",
                       hint="remove it, or set FLEETD_CACHE_DIR to a directory of your own")


def candidate_routes() -> Iterator[HeaderRoute]:
    """Routes that look usable here, best first; each is prepared only when reached."""
    forced = os.environ.get("FLEETD_HEADERS")
    names = (forced,) if forced else ROUTES
    for name in names:
        route = prepare_route(name)
        if route is not None:
            yield route
        elif forced:
            log.warning("FLEETD_HEADERS=%s: that route is not available here", forced)


def prepare_route(name: str) -> HeaderRoute | None:
    try:
        if name == "env":
            src = os.environ.get("BCC_KERNEL_SOURCE")
            return HeaderRoute("env", src, f"BCC_KERNEL_SOURCE={src}") if src else None
        if name == "system":
            build = Path("/lib/modules") / platform.release() / "build"
            if (build / "include").is_dir():
                return HeaderRoute("system", None, str(build.resolve()))
            return None
        if name == "debian-merged":
            return _debian_merged()
        if name == "generated":
            return _generated()
    except OSError as exc:
        log.warning("header route %s could not be prepared: %s", name, exc)
        return None
    raise ValueError(f"unknown header route {name!r}; known: {', '.join(ROUTES)}")


@contextmanager
def applied(route: HeaderRoute) -> Iterator[None]:
    """Set BCC_KERNEL_SOURCE for the duration of a compile."""
    old = os.environ.get("BCC_KERNEL_SOURCE")
    if route.source is not None:
        os.environ["BCC_KERNEL_SOURCE"] = route.source
    else:
        os.environ.pop("BCC_KERNEL_SOURCE", None)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("BCC_KERNEL_SOURCE", None)
        else:
            os.environ["BCC_KERNEL_SOURCE"] = old


# ---- debian-merged ------------------------------------------------------------------

def find_debian_pair(root: Path = _SRC_ROOT) -> tuple[Path, Path] | None:
    """The newest (common, arch) pair of Debian header trees under /usr/src."""
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    best: tuple[tuple[int, ...], Path, Path] | None = None
    for common in root.glob("linux-headers-*-common"):
        stem = common.name[: -len("-common")]
        flavour = root / f"{stem}-{arch}"
        if not (flavour / "include").is_dir() or not (common / "include").is_dir():
            continue
        key = tuple(int(n) for n in re.findall(r"\d+", stem))
        if best is None or key > best[0]:
            best = (key, common, flavour)
    return (best[1], best[2]) if best else None


def _debian_merged() -> HeaderRoute | None:
    pair = find_debian_pair()
    if pair is None:
        return None
    common, flavour = pair
    target = cache_dir() / "kheaders" / f"merged-{flavour.name}"
    if not (target / ".complete").exists():
        _build_once(target, lambda tmp: _overlay(tmp, [common, flavour]))
    return HeaderRoute("debian-merged", str(target), f"{common.name} + {flavour.name}")


def _overlay(dest: Path, layers: list[Path]) -> None:
    """Merge directory trees into ``dest`` with symlinks; later layers win on files.

    Only directories present in several layers are recreated; everything else is one
    symlink, so the merge of a 100k-file tree takes milliseconds.
    """
    dest.mkdir(parents=True, exist_ok=True)
    names: dict[str, list[Path]] = {}
    for layer in layers:
        for entry in os.scandir(layer):
            names.setdefault(entry.name, []).append(Path(entry.path))
    for name, paths in names.items():
        dirs = [p for p in paths if p.is_dir()]
        if len(dirs) > 1:
            _overlay(dest / name, dirs)
        else:
            (dest / name).symlink_to(paths[-1].resolve())


def _build_once(target: Path, build: Callable[[Path], None]) -> None:
    """Build ``target`` unless it is complete, safely against concurrent tracers.

    Several agents start at once (the demo starts three) and each finds no tree. An
    exclusive lock beside the tree lets one build it while the others wait; they then
    find it complete. A complete tree is never removed or replaced: another process may
    be compiling against it, and BCC crashes (SIGSEGV) when headers vanish mid-compile.
    """
    # target is cache_dir()/kheaders/NAME: the cache itself was checked when it was named.
    private_dir(target.parent, base=target.parent.parent, what="header cache")
    with _locked(target.parent / f".{target.name}.lock"):
        if (target / ".complete").exists():
            return
        if target.exists():  # left incomplete by a crash: nobody can be using it
            stale = tempfile.mkdtemp(prefix=target.name + ".stale.", dir=target.parent)
            target.rename(Path(stale) / "tree")
        tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        try:
            build(tmp)
            (tmp / ".complete").write_text("ok\n")
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    for old in target.parent.glob(target.name + ".stale.*"):
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


# ---- generated ----------------------------------------------------------------------

_STUBS: dict[str, str] = {
    "include/linux/types.h": """#ifndef _FL_LINUX_TYPES_H
#define _FL_LINUX_TYPES_H
#include <uapi/linux/types.h>
typedef __u8 u8; typedef __s8 s8; typedef __u16 u16; typedef __s16 s16;
typedef __u32 u32; typedef __s32 s32; typedef __u64 u64; typedef __s64 s64;
typedef _Bool bool;
enum { false = 0, true = 1 };
typedef unsigned long size_t; typedef long ssize_t;
typedef int pid_t; typedef unsigned int dev_t; typedef unsigned long sector_t;
typedef u32 gfp_t;
typedef unsigned long uintptr_t;
#endif
""",
    "include/linux/log2.h": """#ifndef _FL_LOG2_H
#define _FL_LOG2_H
/* BCC sizes stack maps with it; clang folds the builtin for constants */
#define roundup_pow_of_two(n) ((n) <= 1 ? 1ul : 1ul << (64 - __builtin_clzl((n) - 1)))
#endif
""",
    "include/asm/page.h": "#define PAGE_SIZE 4096\n",
    "arch/x86/include/asm/page.h": "#define PAGE_SIZE 4096\n",
    "arch/x86/include/asm/ptrace.h": """#ifndef _FL_ASM_PTRACE_H
#define _FL_ASM_PTRACE_H
struct pt_regs {
    unsigned long r15, r14, r13, r12, bp, bx, r11, r10, r9, r8;
    unsigned long ax, cx, dx, si, di, orig_ax, ip, cs, flags, sp, ss;
};
#endif
""",
}


def uapi_include() -> Path:
    """Where the uapi headers are: /usr/include, or $FLEETD_UAPI_INCLUDE (a directory of
    the same layout: linux/, asm-generic/, x86_64-linux-gnu/asm/)."""
    return Path(os.environ.get("FLEETD_UAPI_INCLUDE") or "/usr/include")


def _generated() -> HeaderRoute | None:
    usr = uapi_include()
    if platform.machine() != "x86_64" or not (usr / "linux").is_dir():
        return None
    config = Path("/proc/config.gz")
    if not config.exists():
        return None
    release = platform.release()
    name = f"generated-{release}"
    if usr != Path("/usr/include"):  # the tree links into it: one tree per directory
        name += "-" + hashlib.sha256(str(usr.resolve()).encode()).hexdigest()[:8]
    target = cache_dir() / "kheaders" / name
    if not (target / ".complete").exists():
        _build_once(target, lambda tmp: _write_tiny_tree(tmp, config, release, usr))
    return HeaderRoute("generated", str(target), f"tiny tree from {config} + {usr}")


def _write_tiny_tree(root: Path, config: Path, release: str,
                     usr: Path = Path("/usr/include")) -> None:
    inc = root / "include"
    (inc / "linux").mkdir(parents=True)
    (inc / "generated").mkdir()
    lines = ["#ifndef _FL_KCONFIG_H", "#define _FL_KCONFIG_H"]
    for raw in gzip.decompress(config.read_bytes()).decode(errors="replace").splitlines():
        m = re.match(r"^(CONFIG_\w+)=(.*)$", raw)
        if not m:
            continue
        key, value = m.groups()
        lines.append(f"#define {key} {'1' if value in ('y', 'm') else value}")
        if value == "m":
            lines.append(f"#define {key}_MODULE 1")
    lines.append("#endif")
    kconfig = "\n".join(lines) + "\n"
    (inc / "linux" / "kconfig.h").write_text(kconfig)
    (inc / "generated" / "autoconf.h").write_text(kconfig)
    major, minor, patch = (int(x) for x in (re.findall(r"\d+", release) + ["0", "0"])[:3])
    code = (major << 16) + (minor << 8) + min(patch, 255)
    version = f"#define LINUX_VERSION_CODE {code}\n#define KERNEL_VERSION(a,b,c) " \
        "(((a) << 16) + ((b) << 8) + ((c) > 255 ? 255 : (c)))\n"
    (inc / "linux" / "version.h").write_text(version)
    (inc / "generated" / "uapi" / "linux").mkdir(parents=True)
    (inc / "generated" / "uapi" / "linux" / "version.h").write_text(version)
    for rel, text in _STUBS.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    uapi = inc / "uapi"
    uapi.mkdir()
    if (usr / "asm-generic").is_dir():
        (uapi / "asm-generic").symlink_to(usr / "asm-generic")
    # Installed uapi headers drop the _UAPI guard prefix, so /usr/include/linux/bpf.h
    # would redefine everything BCC's own copy (bcc/bpf.h, included first) defines.
    (uapi / "linux").mkdir()
    for entry in os.scandir(usr / "linux"):
        if entry.name != "bpf.h":
            (uapi / "linux" / entry.name).symlink_to(entry.path)
    (uapi / "linux" / "bpf.h").write_text("#include <bcc/bpf.h>\n")
    arch_asm = usr / "x86_64-linux-gnu" / "asm"
    if arch_asm.is_dir():
        (uapi / "asm").symlink_to(arch_asm)
        (root / "arch/x86/include/uapi").mkdir(parents=True)
        (root / "arch/x86/include/uapi/asm").symlink_to(arch_asm)
