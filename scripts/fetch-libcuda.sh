#!/usr/bin/env bash
# Optional: fetch Debian's non-free libcuda1 (the CUDA driver library, libcuda.so.1)
# and unpack it into .venv/libcuda/, so the driver-layer uprobes (cuInit,
# cuLaunchKernel, cuMemAlloc_v2, ...) can be tested on machines without a GPU.
#
# Nothing is installed system-wide: apt-get runs with a private copy of the machine's
# own apt sources (whatever mirror, proxy or corporate repository it is configured
# with; no host is named here) with the non-free component added, private list and
# cache directories, and only `download`s the package; dpkg -x unpacks it.
# Idempotent: a second run with the library present returns at once.
# FLEETD_APT_DIR (default /etc/apt) and FLEETD_LIBCUDA_DIR (default .venv/libcuda)
# exist for tests.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${FLEETD_LIBCUDA_DIR:-.venv/libcuda}
APT_DIR=${FLEETD_APT_DIR:-/etc/apt}
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

WORK=$(mktemp -d /tmp/fleetd-libcuda.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/lists/partial" "$WORK/cache/archives/partial" "$WORK/pkgs" "$WORK/parts"
: > "$WORK/empty.list"
# The machine's sources, each with non-free enabled where main is (libcuda1 lives
# there). One-line files (sources.list, *.list) and deb822 files (*.sources) alike.
n=0
for f in "$APT_DIR/sources.list" "$APT_DIR"/sources.list.d/*.list; do
  [ -f "$f" ] || continue
  n=$((n + 1))
  sed -E '/^[[:space:]]*deb[[:space:]]/{/[[:space:]]non-free([[:space:]]|$)/!s/[[:space:]]main([[:space:]]|$)/ main non-free\1/}' \
    "$f" > "$WORK/parts/$n-$(basename "$f" .list).list"
done
for f in "$APT_DIR"/sources.list.d/*.sources; do
  [ -f "$f" ] || continue
  n=$((n + 1))
  sed -E '/^Components:.*[[:space:]]main([[:space:]]|$)/{/[[:space:]]non-free([[:space:]]|$)/!s/$/ non-free/}' \
    "$f" > "$WORK/parts/$n-$(basename "$f")"
done
if [ "$n" -eq 0 ]; then
  say "skipped: no apt sources configured in $APT_DIR"
  exit 0
fi
APT=(apt-get -qq
     -o "Dir::Etc::SourceList=$WORK/empty.list" -o "Dir::Etc::SourceParts=$WORK/parts"
     -o "Dir::State::Lists=$WORK/lists" -o "Dir::Cache=$WORK/cache"
     -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache=" -o "Debug::NoLocking=1")
say "downloading libcuda1 through the configured apt sources (non-free added)"
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
