# The fleetd node agent image, the one configs/daemonset.yaml runs (docs/deploy.md):
#   docker build -t registry.example.invalid/fleetd:0.1.0 .
# Debian's BCC (python3-bpfcc, libbpfcc) and a venv that sees it, with fleetd and its
# agent extra installed from this checkout. Kernel headers are not in the image: the
# DaemonSet mounts the node's /lib/modules and /usr/src.
FROM debian:bookworm-slim

LABEL org.opencontainers.image.title="fleetd" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.description="fleetd node agent: CUDA and host tracing with eBPF, TLS query API"

# tini: PID 1 that forwards SIGTERM to the agent (which drains and flushes) and reaps;
# curl: the DaemonSet's readiness probe (GET /api/v1/health over mTLS).
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-bpfcc libbpfcc tini curl ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# `pip install bcc` is an unrelated project: the venv must see the OS's bcc module.
RUN python3 -m venv --system-site-packages /opt/fleetd/.venv

WORKDIR /src
COPY pyproject.toml README.md MANIFEST.in ./
COPY fleetd ./fleetd
COPY bpf ./bpf
COPY configs ./configs
RUN /opt/fleetd/.venv/bin/pip install --no-cache-dir '.[agent]' \
    && /opt/fleetd/.venv/bin/python -c "import bcc, fleetd; print('fleetd', fleetd.__version__)" \
    && rm -rf /src
WORKDIR /

# The same paths as a systemd node: /etc/fleetd (config and tls/), /var/lib/fleetd.
VOLUME ["/var/lib/fleetd"]
EXPOSE 7600
ENTRYPOINT ["/usr/bin/tini", "--", "/opt/fleetd/.venv/bin/fleetd"]
CMD ["agent", "--config", "/etc/fleetd/fleetd.yaml", "--all"]
