#!/usr/bin/env bash
# make bundle [PYTHON=3.12] [WITHOUT="pkg ..."]: the offline, relocatable node side of
# fleetd for x86_64 (docs/deploy.md, "Air-gapped nodes"), as one archive:
#   dist/fleetd-bundle-py<X.Y>-x86_64.tar.xz   (at most 44 MiB; the build fails above)
#   dist/fleetd-bundle-py<X.Y>-x86_64.json     what each layer weighs, packed and unpacked
#   dist/fleetd-bundle-py<X.Y>-x86_64.tar.xz.sha256   its SHA-256 (sha256sum -c reads it)
#   dist/fleetd-bundle-unpack.py                  verifies it, then unpacks it safely
#
# fleetd-bundle/
#   bin/fleetd, bin/fleetd-python   the launcher (scripts/bundle-launcher)
#   lib/                            libbcc, libclang-cpp 14, libLLVM 14 (Debian's packages,
#                                   downloaded and unpacked, never installed), stubs of
#                                   libz3 and libxml2 (linked by LLVM, never called by BCC)
#   lib/fallback/<soname>/          libelf, libbpf, libffi, libedit, libbsd, libmd, libtinfo,
#                                   libz: used only on a node that lacks them
#   lib/python/                     fleetd (its wheel, built here), bcc (python3-bpfcc), the
#                                   node side's dependencies as wheels for CPython X.Y
#   include/                        linux-libc-dev's uapi headers, for fleetd's "generated"
#                                   kernel-header route on a node without /usr/include/linux
#   check/                          scripts/gpu-check.sh, scripts/gpu_check.py and the two
#                                   reference workloads it runs when torch is missing
#
# FLEETD_BUNDLE_OUT (the archive's path), FLEETD_BUNDLE_WORK (the staging directory,
# default build/bundle, emptied at the end unless FLEETD_BUNDLE_KEEP=1) and
# FLEETD_BUNDLE_CACHE move the files; FLEETD_BUNDLE_LIMIT_MIB
# (44) and FLEETD_BUNDLE_XZ_PRESET (6) are the size limit and the compression.
#
# Needs: an x86_64 Debian/Ubuntu machine with apt-get (only `download`: nothing is
# installed), gcc and binutils, and a Python with pip (the project venv's if there is one).
# The .debs, the wheels and each compressed layer are cached in FLEETD_BUNDLE_CACHE
# (default build/bundle-cache): a rebuild with a warm cache is offline and takes seconds;
# a cold one downloads about 60 MB and compresses LLVM for a few minutes.
#
# WITHOUT leaves out packages the nodes are known to have (e.g. WITHOUT="aiohttp uvloop
# pyyaml prometheus-client" for an image that holds them); by default the bundle
# carries every dependency of the node side, so it needs nothing of the node's Python.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
T0=$(date +%s)
say() { printf "[bundle %3ss] %s\n" "$(( $(date +%s) - T0 ))" "$*"; }
die() { printf '[bundle] error: %s\n' "$*" >&2; exit 1; }

PYVER=${1:-${PYTHON:-3.12}}
[[ $PYVER =~ ^3\.[0-9]+$ ]] || die "PYTHON is the target's CPython version, e.g. PYTHON=3.12 (got '$PYVER')"
[ "${PYVER#3.}" -ge 11 ] || die "fleetd needs CPython 3.11 or newer (got $PYVER)"
CP=cp${PYVER/./}
WITHOUT=${WITHOUT:-}
LIMIT_MIB=${FLEETD_BUNDLE_LIMIT_MIB:-44}
CACHE=${FLEETD_BUNDLE_CACHE:-$ROOT/build/bundle-cache}
WORK=${FLEETD_BUNDLE_WORK:-$ROOT/build/bundle}
OUT=${FLEETD_BUNDLE_OUT:-$ROOT/dist/fleetd-bundle-py$PYVER-x86_64.tar.xz}
[ "$(uname -m)" = x86_64 ] || die "build the x86_64 bundle on an x86_64 machine (this is $(uname -m))"
for tool in apt-get dpkg-deb gcc readelf strip; do
  command -v "$tool" >/dev/null || die "needs $tool (Debian/Ubuntu: apt-get install apt dpkg gcc binutils)"
done
if [ -x .venv/bin/python ]; then BPY=.venv/bin/python; else BPY=$(command -v python3); fi
"$BPY" -m pip --version >/dev/null 2>&1 || die "$BPY has no pip (run scripts/setup.sh first)"
TOOL=("$BPY" scripts/bundle_tool.py)
mkdir -p "$CACHE/debs" "$CACHE/wheels/$CP" "$CACHE/layers"
rm -rf "$WORK"
mkdir -p "$WORK/debs" "$WORK/wheels" "$WORK/fleetd-wheel"
STAGE=$WORK/stage
B=$STAGE/fleetd-bundle
mkdir -p "$B/bin" "$B/lib/fallback" "$B/lib/python" "$B/include" "$B/check"

# ---- Debian packages, as files -----------------------------------------------------------
# BCC and what libbcc links; libz3-4 and libxml2 only for the symbols of their stubs;
# linux-libc-dev for the uapi headers.
PKGS=(libbpfcc python3-bpfcc libclang-cpp14 libllvm14 libelf1 libbpf1 libffi8 libedit2
      libbsd0 libmd0 libtinfo6 zlib1g linux-libc-dev libz3-4 libxml2)
FALLBACK=(libelf.so.1 libbpf.so.1 libffi.so.8 libedit.so.2 libbsd.so.0 libmd.so.0
          libtinfo.so.6 libz.so.1)
STUBS=(libz3.so.4:libz3-4 libxml2.so.2:libxml2)
want=()
for p in "${PKGS[@]}"; do
  compgen -G "$CACHE/debs/${p}_*_*.deb" >/dev/null || want+=("$p:amd64")
done
if [ ${#want[@]} -gt 0 ]; then
  say "downloading ${#want[@]} Debian packages: ${want[*]}"
  if ! (cd "$CACHE/debs" && apt-get download -qq "${want[@]}" >"$WORK/apt.log" 2>&1); then
    # No package lists on this machine (or stale ones): a private copy, nothing changed.
    say "apt-get download failed ($(tail -n1 "$WORK/apt.log")); retrying with private package lists"
    mkdir -p "$WORK/apt/lists/partial" "$WORK/apt/cache/archives/partial"
    APT=(apt-get -qq -o "Dir::State::Lists=$WORK/apt/lists" -o "Dir::Cache=$WORK/apt/cache"
         -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache=" -o "Debug::NoLocking=1")
    "${APT[@]}" update >"$WORK/apt.log" 2>&1 || die "apt-get update failed: $(tail -n2 "$WORK/apt.log")"
    (cd "$CACHE/debs" && "${APT[@]}" download "${want[@]}" >"$WORK/apt.log" 2>&1) \
      || die "apt-get download failed: $(tail -n2 "$WORK/apt.log")"
  fi
fi
for p in "${PKGS[@]}"; do
  deb=$(ls -t "$CACHE/debs/${p}"_*_*.deb | head -n1)
  dpkg-deb -x "$deb" "$WORK/debs/$p"
  printf '%s\n' "$(basename "$deb")" >> "$WORK/debs.txt"
done

find_lib() {  # find_lib PKG SONAME: the file (links followed) that package ships by that name
  local hit
  hit=$(find "$WORK/debs/$1" -name "$2" \( -type f -o -type l \) | head -n1)
  [ -n "$hit" ] || die "package $1 has no $2"
  hit=$(readlink -f "$hit")
  case $hit in "$WORK/debs/"*) ;; *) die "$2 of package $1 points outside it ($hit)" ;; esac
  echo "$hit"
}
say "native libraries"
cp "$(find_lib libbpfcc libbcc.so.0)" "$B/lib/libbcc.so.0"
cp "$(find_lib libclang-cpp14 libclang-cpp.so.14)" "$B/lib/libclang-cpp.so.14"
cp "$(find_lib libllvm14 libLLVM-14.so.1)" "$B/lib/libLLVM-14.so.1"
pkg_of() {
  case $1 in
    libelf.so.1) echo libelf1 ;; libbpf.so.1) echo libbpf1 ;; libffi.so.8) echo libffi8 ;;
    libedit.so.2) echo libedit2 ;; libbsd.so.0) echo libbsd0 ;; libmd.so.0) echo libmd0 ;;
    libtinfo.so.6) echo libtinfo6 ;; libz.so.1) echo zlib1g ;;
  esac
}
for so in "${FALLBACK[@]}"; do
  mkdir -p "$B/lib/fallback/$so"
  cp "$(find_lib "$(pkg_of "$so")" "$so")" "$B/lib/fallback/$so/$so"
done
for s in "${STUBS[@]}"; do
  "${TOOL[@]}" stub --real "$(find_lib "${s#*:}" "${s%%:*}")" --soname "${s%%:*}" \
    --out "$B/lib/${s%%:*}" "$B/lib/libLLVM-14.so.1" "$B/lib/libclang-cpp.so.14" "$B/lib/libbcc.so.0"
done
chmod 0644 "$B"/lib/*.so* "$B"/lib/fallback/*/*
"${TOOL[@]}" closure "$B/lib"
# Loads for real (dlopen with every symbol bound now, as ctypes does) from the bundle's
# directories alone, the stubs included.
fb=$(printf ':%s' "$B"/lib/fallback/*)
env -i PATH=/usr/bin:/bin LD_LIBRARY_PATH="$B/lib$fb" "$BPY" -c \
  'import ctypes, sys; ctypes.CDLL("libbcc.so.0", mode=2); print("[bundle] libbcc.so.0 loads (RTLD_NOW) from the bundle")' \
  || die "libbcc.so.0 does not load from the bundle's libraries"

# ---- Python: bcc, fleetd's wheel, the node side's dependencies ------------------------
say "python packages for CPython $PYVER ($CP)"
cp -r "$WORK/debs/python3-bpfcc/usr/lib/python3/dist-packages/bcc" "$B/lib/python/bcc"
# bcc 0.26 has one non-raw regex that Python 3.12+ warns about whenever it compiles the
# module ("SyntaxWarning: invalid escape sequence"); the raw literal is the same bytes.
"$BPY" - "$B/lib/python/bcc/__init__.py" <<'PYEOF'
import sys
path = sys.argv[1]
text = open(path).read()
old = r"re.match(b'^.*\.cold(\.\d+)?$', fn)"
if old in text:
    open(path, "w").write(text.replace(old, "re.match(r" + old[len("re.match("):]))
PYEOF
# fleetd's wheel from a clean copy of what the wheel is made of (setuptools reuses a
# build/ directory, which could hold modules deleted since).
SRC=$WORK/src
mkdir -p "$SRC"
cp -r pyproject.toml README.md MANIFEST.in fleetd bpf configs "$SRC/"
find "$SRC" -name __pycache__ -prune -exec rm -rf {} +
iso=--no-build-isolation
"$BPY" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' \
  2>/dev/null || iso=
"$BPY" -m pip wheel -q --no-deps $iso -w "$WORK/fleetd-wheel" "$SRC" >/dev/null \
  || die "building fleetd's wheel failed"
WHEEL=$(ls "$WORK"/fleetd-wheel/fleetd-*.whl)
# Its requirements, less what only the laptop side uses (the MCP server, shell completion,
# the Parquet lake), plus the agent extra (pyelftools).
mapfile -t REQS < <("$BPY" - "$WHEEL" <<'EOF'
import re, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
skip = {"mcp", "uvicorn", "shtab", "pyarrow", "duckdb"}
for line in meta.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = line.split(":", 1)[1].strip()
    name = re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0].lower()
    extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)", req)
    if name in skip or (extra and extra.group(1) != "agent"):
        continue
    print(re.sub(r"\s*and\s*extra\s*==\s*['\"]agent['\"]|;\s*extra\s*==\s*['\"]agent['\"]", "", req))
EOF
)
PIPDL=("$BPY" -m pip download -q --only-binary=:all: --python-version "$PYVER" --implementation cp
       --abi "$CP" --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
       --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
       --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$WORK/wheels")
# Every wheel is pinned by its SHA-256 in scripts/bundle-lock/$CP.txt (pip refuses one that
# differs, from the cache or the index); FLEETD_BUNDLE_RELOCK=1, or a version with no lock
# yet, resolves the requirements again and writes the lock to commit.
LOCK=scripts/bundle-lock/$CP.txt
if [ -f "$LOCK" ] && [ -z "${FLEETD_BUNDLE_RELOCK:-}" ]; then
  "${TOOL[@]}" lock-check --lock "$LOCK" "${REQS[@]}" || die "the wheel lock $LOCK is out of date"
  # Offline from the cache when it holds the locked set; the package index otherwise.
  if ! "${PIPDL[@]}" --require-hashes --no-index --find-links "$CACHE/wheels/$CP" -r "$LOCK" \
      >/dev/null 2>&1; then
    say "fetching the wheels of $LOCK"
    rm -f "$WORK"/wheels/*.whl
    "${PIPDL[@]}" --require-hashes -r "$LOCK" || die "pip download of the locked wheels failed"
    cp -f "$WORK"/wheels/*.whl "$CACHE/wheels/$CP/"
  fi
else
  say "resolving wheels for $CP: ${REQS[*]} (no lock, or FLEETD_BUNDLE_RELOCK)"
  rm -f "$WORK"/wheels/*.whl
  "${PIPDL[@]}" "${REQS[@]}" || die "pip download failed"
  cp -n "$WORK"/wheels/*.whl "$CACHE/wheels/$CP/"
  mkdir -p scripts/bundle-lock
  "${TOOL[@]}" lock --cp "$CP" --out "$LOCK" "$WORK"/wheels/*.whl
  say "wrote $LOCK: commit it, so the next build takes exactly these wheels"
fi
"${TOOL[@]}" wheels --dest "$B/lib/python" --without "$WITHOUT" \
  --manifest "$WORK/wheels.json" "$WHEEL" "$WORK"/wheels/*.whl

# ---- kernel uapi headers, the launcher, the check ---------------------------------------
mkdir -p "$B/include/x86_64-linux-gnu"
cp -r "$WORK/debs/linux-libc-dev/usr/include/linux" "$WORK/debs/linux-libc-dev/usr/include/asm-generic" "$B/include/"
cp -r "$WORK/debs/linux-libc-dev/usr/include/x86_64-linux-gnu/asm" "$B/include/x86_64-linux-gnu/"
GLIBC=$(for f in "$B"/lib/*.so* "$B"/lib/fallback/*/*; do readelf -W --dyn-syms "$f"; done |
        grep -o 'GLIBC_2\.[0-9]*' | sort -t. -k2,2n | tail -n1 | sed 's/GLIBC_//')
sed "s/@PYVER@/$PYVER/g; s/@GLIBC@/$GLIBC/g" scripts/bundle-launcher > "$B/bin/fleetd"
chmod 0755 "$B/bin/fleetd"
ln -s fleetd "$B/bin/fleetd-python"
cp scripts/gpu-check.sh scripts/gpu_check.py tests/workloads/train_loop.py \
   tests/workloads/nccl_ranks.py "$B/check/"
chmod 0755 "$B/check/gpu-check.sh"
"$BPY" - "$B/BUNDLE.json" "$PYVER" "$WORK/debs.txt" "$WORK/wheels.json" "$WITHOUT" "$GLIBC" <<'EOF'
import json, subprocess, sys
out, pyver, debs, wheels, without, glibc = sys.argv[1:]
try:
    rev = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                         text=True).stdout.strip()
except OSError:
    rev = ""
json.dump({"format": "fleetd-bundle", "version": 1, "python": pyver, "arch": "x86_64",
           "glibc_needed": glibc,
           "fleetd_revision": rev, "debs": open(debs).read().split(),
           "wheels": json.load(open(wheels)), "without": without.split()},
          open(out, "w"), indent=1)
EOF

# ---- what each part weighs, then the archive -------------------------------------------
say "unpacked sizes (du):"
du -sh "$B"/lib/libLLVM-14.so.1 "$B"/lib/libclang-cpp.so.14 "$B"/lib/libbcc.so.0 \
  "$B"/lib/libz3.so.4 "$B"/lib/libxml2.so.2 "$B"/lib/fallback "$B"/lib/python "$B"/include \
  "$B"/bin "$B"/check | sed "s|$B/||; s/^/[bundle]   /"
say "python packages (unpacked, and xz -6 each on its own):"
"${TOOL[@]}" sizes "$B/lib/python" --json "$WORK/python-sizes.json" --cache "$CACHE/layers"
L=fleetd-bundle
say "packing $(basename "$OUT") (xz; LLVM and clang with the x86 filter)"
REPORT=${OUT%.tar.xz}.json
# The dependencies apart from fleetd itself, which changes from one build to the next.
PYDEPS=$(cd "$STAGE" && for p in $L/lib/python/*; do
  case ${p##*/} in fleetd|fleetd-*.dist-info) ;; *) printf '%s,' "$p" ;; esac
done)
PYDEPS=${PYDEPS%,}
# xz -6: -9 saves about a megabyte on LLVM for twice the time of a cold build.
"${TOOL[@]}" pack --root "$STAGE" --cache "$CACHE/layers" --out "$OUT" --limit-mib "$LIMIT_MIB" \
  --preset "${FLEETD_BUNDLE_XZ_PRESET:-6}" --report "$REPORT" \
  "llvm=x86:$L/lib/libLLVM-14.so.1" \
  "clang=x86:$L/lib/libclang-cpp.so.14" \
  "native=x86:$L/lib/libbcc.so.0,$L/lib/libz3.so.4,$L/lib/libxml2.so.2,$L/lib/fallback" \
  "python=plain:$PYDEPS" \
  "fleetd=plain:$L/lib/python/fleetd,$(cd "$STAGE" && echo $L/lib/python/fleetd-*.dist-info)" \
  "headers=plain:$L/include" \
  "rest=plain:$L/bin,$L/check,$L/BUNDLE.json"
# The staging tree (about 400 MB unpacked) goes; FLEETD_BUNDLE_KEEP=1 keeps it.
[ -n "${FLEETD_BUNDLE_KEEP:-}" ] || rm -rf "$WORK/debs" "$STAGE"
# The unpacker goes beside the archive: on the node it verifies OUT.sha256 and unpacks
# inside its destination only (docs/deploy.md, "Air-gapped nodes").
cp scripts/bundle_unpack.py "$(dirname "$OUT")/fleetd-bundle-unpack.py"
say "done in $(( $(date +%s) - T0 )) s: $OUT ($(du -h "$OUT" | cut -f1))"
