#!/usr/bin/env bash
# Installs everything fleetd needs on a fresh Debian machine, idempotently:
# Debian packages (bcc, iproute2, libfaketime, kernel headers fallback), tracefs,
# a venv at .venv with fleetd and its test extras, and bcc linked into the venv.
# Re-running is cheap: each step checks before it acts.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
say() { printf '[setup] %s\n' "$*"; }

# --- Debian packages ---------------------------------------------------------------
# gcc and libc6-dev build the native two-thread mutex workload of the wait-reason tests;
# chromium loads `fleetd explain --format html` pages headless in the tests;
# default-jre-headless is the Java runtime of the test extra's pyspark
# (tests/integration/test_lake_spark.py reads a fleetd lake with Spark in local mode).
APT_PKGS=(python3-bpfcc libbpfcc iproute2 libfaketime procps gcc libc6-dev chromium
          default-jre-headless)
# BCC compiles against kernel headers; a distribution kernel ships them, ours may not.
# Debian's linux-headers-amd64 is the fallback that fleetd's header route can use.
if [ ! -e "/lib/modules/$(uname -r)/build/include" ] && [ "$(uname -m)" = x86_64 ]; then
  APT_PKGS+=(linux-headers-amd64)
fi
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    say "missing Debian packages: ${missing[*]}"
    say "run as root, or: sudo apt-get install -y --no-install-recommends ${missing[*]}"
    exit 1
  fi
  say "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- tracefs (BCC's TRACEPOINT_PROBE and uprobe detach need it) ----------------------
if [ "$(id -u)" -eq 0 ] && [ ! -e /sys/kernel/tracing/events ]; then
  mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null && say "mounted tracefs" \
    || say "warning: could not mount tracefs at /sys/kernel/tracing"
fi

# --- venv ----------------------------------------------------------------------------
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  say "fleetd needs Python 3.11 or newer; $PY is $("$PY" --version 2>&1)"; exit 1
fi
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
fi
SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# bcc is pure Python over ctypes: link only its package dir, not all of dist-packages,
# so Debian's old copies of other packages never shadow the venv's.
if [ -d /usr/lib/python3/dist-packages/bcc ]; then
  mkdir -p .venv/bcc-link
  ln -sfn /usr/lib/python3/dist-packages/bcc .venv/bcc-link/bcc
  echo "$ROOT/.venv/bcc-link" > "$SITE/fleetd-bcc.pth"
fi
STAMP=.venv/.fleetd-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  say "installing fleetd and its test extras into .venv"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[test]"
  echo "$want" > "$STAMP"
fi
# The CUDA driver library (Debian non-free libcuda1), unpacked into .venv/libcuda only,
# so driver-layer uprobes can be tested on machines without a GPU driver.
bash scripts/fetch-libcuda.sh
# promtool (Debian's prometheus package, unpacked, never installed: installing it would
# start a Prometheus server where systemd runs) checks and unit-tests configs/prometheus/.
if [ ! -x .venv/bin/promtool ]; then
  say "unpacking promtool from Debian's prometheus package into .venv/bin"
  tmp=$(mktemp -d)
  if (cd "$tmp" && apt-get download -qq prometheus >/dev/null 2>&1) ||
     { apt-get update -qq && (cd "$tmp" && apt-get download -qq prometheus >/dev/null); }; then
    dpkg-deb -x "$tmp"/prometheus_*.deb "$tmp/x"
    install -m 0755 "$tmp/x/usr/bin/promtool" .venv/bin/promtool
  else
    say "could not download Debian's prometheus package: the alerting-rule tests will fail"
  fi
  rm -rf "$tmp"
fi
say "ready: .venv/bin/fleetd"
