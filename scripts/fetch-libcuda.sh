#!/usr/bin/env bash
# Optional: fetch Debian's non-free libcuda1 (the CUDA driver library, libcuda.so.1)
# and unpack it into .venv/libcuda/, so the driver-layer uprobes (cuInit,
# cuLaunchKernel, cuMemAlloc_v2, ...) can be tested on machines without a GPU.
#
# Nothing is installed system-wide: apt-get runs with a private sources list (the
# system's Debian mirror plus the non-free component), private list and cache
# directories, and only `download`s the package; dpkg -x unpacks it.
# Idempotent: a second run with the library present returns at once.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.venv/libcuda
say() { printf '[fetch-libcuda] %s\n' "$*"; }

found=$(find "$DEST" -name 'libcuda.so.1' 2>/dev/null | head -n1 || true)
if [ -n "$found" ]; then
  say "present: $found"
  exit 0
fi
if ! command -v apt-get >/dev/null || ! command -v dpkg >/dev/null; then
  say "skipped: needs apt-get and dpkg (Debian/Ubuntu)"
  exit 0
fi
. /etc/os-release
CODENAME=${VERSION_CODENAME:-bookworm}
MIRROR=${DEBIAN_MIRROR:-}
if [ -z "$MIRROR" ]; then
  # Reuse the mirror the system already trusts (deb822 or one-line format).
  MIRROR=$(grep -hoE '^(URIs:[[:space:]]*|deb[[:space:]]+)https?://[^[:space:]]+' \
             /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
           | grep -v security | head -n1 | awk '{print $NF}' || true)
  MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi

WORK=$(mktemp -d /tmp/fleetd-libcuda.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/lists/partial" "$WORK/cache/archives/partial" "$WORK/pkgs"
echo "deb $MIRROR $CODENAME main contrib non-free non-free-firmware" > "$WORK/sources.list"
APT=(apt-get -qq
     -o "Dir::Etc::SourceList=$WORK/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
     -o "Dir::State::Lists=$WORK/lists" -o "Dir::Cache=$WORK/cache"
     -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache=" -o "Debug::NoLocking=1")
say "downloading libcuda1 from $MIRROR ($CODENAME non-free)"
if ! "${APT[@]}" update >"$WORK/update.log" 2>&1; then
  say "skipped: apt-get update failed (offline?):"; tail -n3 "$WORK/update.log" >&2
  exit 0
fi
if ! (cd "$WORK/pkgs" && "${APT[@]}" download libcuda1 >"$WORK/download.log" 2>&1); then
  say "skipped: download failed:"; tail -n3 "$WORK/download.log" >&2
  exit 0
fi
rm -rf "$DEST.tmp"
for deb in "$WORK"/pkgs/*.deb; do
  dpkg -x "$deb" "$DEST.tmp"
done
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
found=$(find "$DEST" -name 'libcuda.so.1' | head -n1)
if [ -z "$found" ]; then
  say "warning: the package held no libcuda.so.1"; exit 0
fi
say "unpacked: $found"
