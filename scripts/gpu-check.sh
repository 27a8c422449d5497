#!/usr/bin/env bash
# The one-command check of fleetd on a GPU machine, from the offline bundle (make bundle):
#
#   bash scripts/gpu-check.sh [ARCHIVE|BUNDLE-DIR] [-- gpu_check.py options]
#
# Verifies the bundle against its .sha256 and unpacks it (default: the newest
# dist/fleetd-bundle-py*-x86_64.tar.xz beside this script) into a fresh directory, then
# runs fleetd-bundle/check/gpu_check.py with the bundle's launcher (the node's python3,
# the bundle's BCC, LLVM and packages): fleetd check, a PyTorch training job and a
# torch.distributed NCCL job traced while the PyTorch profiler records, the profiler's
# trace imported beside the traced calls. Writes $OUT/gpu-check.json and
# $OUT/gpu-check.db (OUT defaults to ./gpu-check-out) and exits 1 naming each item that
# does not hold. Needs root (BPF), about 3 to 5 minutes.
#
# Without a GPU (or without torch) it is the dry run: the reference workloads shipped in
# the bundle stand in for PyTorch, over the CUDA libraries of FLEETD_CHECK_WORKLOAD_LIBS
# (a directory holding libcudart.so.12, libnccl.so.2 and optionally libcuda.so.1, from the
# nvidia-cuda-runtime-cu12 and nvidia-nccl-cu12 wheels and scripts/fetch-libcuda.sh), and
# what only a GPU can show is reported as "skipped: no GPU".
#
# Nothing of a checkout is used: the script, or the bundle's own copy of it
# (fleetd-bundle/check/gpu-check.sh), works from anywhere.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
say() { printf '[gpu-check] %s\n' "$*" >&2; }
die() { say "FAIL: $*"; exit 1; }

SRC=
if [ $# -gt 0 ] && [ "$1" != -- ]; then SRC=$1; shift; fi
[ "${1:-}" = -- ] && shift
if [ -z "$SRC" ]; then
  if [ -x "$HERE/../bin/fleetd" ] && [ -f "$HERE/../BUNDLE.json" ]; then
    SRC=$HERE/..  # the bundle's own copy of this script: already unpacked
  else
    SRC=$(ls -t "$HERE"/../dist/fleetd-bundle-py*-x86_64.tar.xz 2>/dev/null | head -n1 || true)
  fi
  [ -n "$SRC" ] || die "no bundle: give the archive (make bundle PYTHON=3.12 builds dist/fleetd-bundle-py3.12-x86_64.tar.xz)"
fi
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

extra=()
if [ -d "$SRC" ]; then
  B=$(cd "$SRC" && pwd)
else
  [ -f "$SRC" ] || die "no such bundle: $SRC"
  base=${TMPDIR:-/tmp}  # the libraries are loaded from there: not a noexec mount
  if command -v findmnt >/dev/null && findmnt -no OPTIONS --target "$base" 2>/dev/null | grep -qw noexec; then
    base=/var/tmp
  fi
  DEST=$(mktemp -d "$base/fleetd-bundle.XXXXXX")
  # The unpacked bundle goes when the check ends (GPU_CHECK_KEEP=1 keeps it).
  [ -n "${GPU_CHECK_KEEP:-}" ] || trap 'rm -rf "$DEST"' EXIT
  # The unpacker checks SRC.sha256 before a byte is unpacked and writes nothing outside
  # DEST (scripts/bundle_unpack.py; make bundle copies it beside the archive).
  UNPACK=
  for u in "$HERE/bundle_unpack.py" "$(dirname "$SRC")/fleetd-bundle-unpack.py"; do
    [ -f "$u" ] && { UNPACK=$u; break; }
  done
  [ -n "$UNPACK" ] || die "no fleetd-bundle-unpack.py beside $SRC: copy it with the archive and its .sha256"
  t0=$(date +%s.%N)
  python3 "$UNPACK" "$SRC" "$DEST" || die "$SRC was not unpacked (above: why)"
  unpack_s=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
  B=$DEST/fleetd-bundle
  say "unpacked $(basename "$SRC") ($(du -sh "$SRC" | cut -f1)) into $B in ${unpack_s} s"
  extra=(--unpack-s "$unpack_s" --archive "$(cd "$(dirname "$SRC")" && pwd)/$(basename "$SRC")")
fi
[ -x "$B/bin/fleetd" ] || die "$B is not an unpacked fleetd bundle (no bin/fleetd)"
[ "$(id -u)" -eq 0 ] || die "run as root: tracing needs BPF and uprobes"

# The launcher's python runs the check (nothing has run from the bundle before it: its
# first start-up is timed cold); a refusal of the launcher (no python3, wrong
# architecture...) is its one line, and this script's status.
rc=0
"$B/bin/fleetd-python" "$B/check/gpu_check.py" --out "$OUT" ${extra[@]+"${extra[@]}"} "$@" || rc=$?
exit $rc
