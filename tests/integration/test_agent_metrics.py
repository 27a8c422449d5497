"""``GET /metrics`` of a real agent, read the way Prometheus reads it: over mTLS with a
bearer token, parsed by prometheus_client's own parser."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from agents import Agent, Pki, agent, client_ssl, request
from prometheus_client.parser import text_string_to_metric_families

from fleetd import __version__
from fleetd.store.catalog import op_code
from fleetd.store.writer import BatchWriter

from conftest import REPO, build_db, wait_for_libcudart

TOKEN = "s3cret-metrics-token"
LAUNCH, SYNC, ALLREDUCE = (op_code(n) for n in ("cudaLaunchKernel", "cudaStreamSynchronize",
                                                 "ncclAllReduce"))
PAGE_ALLOC, OFF_CPU = op_code("page_alloc"), op_code("off_cpu")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[Agent]:
    d = tmp_path_factory.mktemp("metrics")
    db = build_db(d / "gpu-01.db", "gpu-01", 50)
    # Written before the agent started: not counted (counters start with the process).
    with BatchWriter(db, "gpu-01") as w:
        w.add_aggregates([(None, time.time_ns() - 60 * 10**9, 10**9, 7, LAUNCH, 11, 1000,
                           1000 * 3000)])
    token = d / "token"
    fd = os.open(token, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, TOKEN.encode())
    os.close(fd)
    with agent(db, "gpu-01", pki, "--no-trace", "--token-file", str(token)) as a:
        yield a


def scrape(a: Agent, pki: Pki, accept: str | None = None) -> tuple[str, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    if accept:
        headers["Accept"] = accept
    status, _, body = request(a.url, client_ssl(pki, "prometheus"), path="/metrics",
                              headers=headers)
    assert status == 200, body
    text = body.decode()
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def add_latencies(db: Path, rows: list[tuple[int, int, int, int]]) -> None:
    """(op, bucket, count, sum ns) rows of one window that starts now, as the tracer
    writes them (a -1 total row per op too)."""
    now = time.time_ns()
    agg: list[tuple[Any, ...]] = [(1, now, 10**9, 4242, op, b, c, s) for op, b, c, s in rows]
    for op in {r[0] for r in rows}:
        agg.append((1, now, 10**9, 4242, op, -1, sum(r[2] for r in rows if r[0] == op),
                    sum(r[3] for r in rows if r[0] == op)))
    with BatchWriter(db, "gpu-01") as w:
        w.add_aggregates(agg)


def histogram(fam: Any, op: str) -> tuple[list[tuple[float, float]], float, float]:
    """(cumulative buckets by le in seconds, count, sum) of one op's series."""
    mine = [s for s in fam.samples if s.labels.get("op") == op]
    buckets = sorted((float(s.labels["le"]), s.value) for s in mine
                     if s.name.endswith("_bucket"))
    count = next(s.value for s in mine if s.name.endswith("_count"))
    total = next(s.value for s in mine if s.name.endswith("_sum"))
    return buckets, count, total


def test_the_conventions_prometheus_users_expect(served: Agent, pki: Pki) -> None:
    text, fams = scrape(served, pki)
    anonymous_before = fams["fleetd_tls_handshake_failures"].samples[0].value
    # Every series parses; none carries a node label (the target says which node).
    assert all("node" not in s.labels for f in fams.values() for s in f.samples)
    assert 'node="' not in text
    (info,) = fams["fleetd_build_info"].samples
    assert fams["fleetd_build_info"].type == "gauge" and info.value == 1
    assert info.labels["version"] == __version__
    for name in ("process_cpu_seconds", "process_resident_memory_bytes",
                 "process_start_time_seconds", "process_open_fds"):
        assert name in fams, name
    assert fams["process_resident_memory_bytes"].samples[0].value > 1e6
    # Counters, never precomputed rates.
    assert not [n for n in fams if "per_second" in n or n.endswith("_per_s")]
    for name in ("fleetd_events_written", "fleetd_events_lost", "fleetd_trace_records",
                 "fleetd_tls_handshake_failures", "fleetd_connections_refused",
                 "fleetd_queries_failed", "fleetd_client_cert_refusals"):
        assert fams[name].type == "counter", name
        assert fams[name].samples[0].name == f"{name}_total"
    assert fams["fleetd_tracing"].samples[0].value == 0  # --no-trace
    assert fams["fleetd_nccl_ranks"].type == "gauge"
    assert fams["fleetd_nccl_wait_seconds"].type == "gauge"
    # A failed handshake still counts, as a counter.
    from fleetd.security import tls

    for _ in range(2):
        with pytest.raises(aiohttp.ClientError):
            request(served.url, tls.client_context(pki.ca, None, None))
    _, fams = scrape(served, pki)
    assert fams["fleetd_tls_handshake_failures"].type == "counter"
    assert fams["fleetd_tls_handshake_failures"].samples[0].value >= anonymous_before + 2


def test_the_bearer_token_is_required_on_top_of_mtls(served: Agent, pki: Pki) -> None:
    status, _, _ = request(served.url, client_ssl(pki, "prometheus"), path="/metrics")
    assert status == 401
    status, _, _ = request(served.url, client_ssl(pki, "prometheus"), path="/metrics",
                           headers={"Authorization": "Bearer wrong"})
    assert status == 401


def test_query_latency_is_a_histogram(served: Agent, pki: Pki) -> None:
    status, _, _ = request(served.url, client_ssl(pki, "prometheus"), "POST",
                           "/api/v1/query", json={"sql": "SELECT count(*) FROM events"},
                           headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200
    _, fams = scrape(served, pki)
    fam = fams["fleetd_query_seconds"]
    assert fam.type == "histogram"
    count = next(s.value for s in fam.samples if s.name == "fleetd_query_seconds_count")
    inf = next(s.value for s in fam.samples if s.labels.get("le") == "+Inf")
    assert count >= 1 and inf == count


def test_cuda_latency_histograms_from_the_kernel_aggregates(served: Agent, pki: Pki,
                                                            tmp_path: Path) -> None:
    db = Path(served.log.parent / "gpu-01.db")
    _, fams = scrape(served, pki)
    fam = fams["fleetd_cuda_call_duration_seconds"]
    assert fam.type == "histogram"
    # The rows written before the agent started are not counted.
    assert not [s for s in fam.samples if s.labels.get("op") == "cudaLaunchKernel"]
    # One window: 5 launches in [2, 4) us, 1 in [1, 2) ms; 2 syncs of ~3 ms; 1 all-reduce
    # of ~40 ms; host ops (page_alloc's buckets are orders, off-CPU is no call) too.
    add_latencies(db, [(LAUNCH, 11, 5, 5 * 3_000), (LAUNCH, 20, 1, 1_500_000),
                       (SYNC, 21, 2, 2 * 3_000_000), (ALLREDUCE, 25, 1, 40_000_000),
                       (PAGE_ALLOC, 3, 9, 72), (OFF_CPU, 22, 4, 4 * 5_000_000)])
    _, fams = scrape(served, pki)
    fam = fams["fleetd_cuda_call_duration_seconds"]
    ops = {s.labels["op"]: s.labels["source"] for s in fam.samples}
    assert ops == {"cudaLaunchKernel": "cuda", "cudaStreamSynchronize": "cuda",
                   "ncclAllReduce": "nccl"}
    buckets, count, total = histogram(fam, "cudaLaunchKernel")
    assert count == 6 and total == pytest.approx(0.001515)
    assert buckets[-1] == (float("inf"), 6)
    values = [v for _, v in buckets]
    assert values == sorted(values)  # cumulative
    edges = dict(buckets)
    assert edges[2**11 / 1e9] == 0 and edges[2**12 / 1e9] == 5  # [2, 4) us: le 4.096 us
    assert edges[2**20 / 1e9] == 5 and edges[2**21 / 1e9] == 6  # [1, 2) ms: le 2.1 ms
    # The next scrape adds only what was written since: no row counts twice.
    add_latencies(db, [(LAUNCH, 11, 2, 2 * 3_500)])
    _, fams = scrape(served, pki)
    buckets, count, total = histogram(fams["fleetd_cuda_call_duration_seconds"],
                                      "cudaLaunchKernel")
    assert count == 8 and total == pytest.approx(0.001522)
    _, fams = scrape(served, pki)
    assert histogram(fams["fleetd_cuda_call_duration_seconds"], "cudaLaunchKernel")[1] == 8


def test_openmetrics_when_the_scraper_asks_for_it(served: Agent, pki: Pki) -> None:
    from prometheus_client.openmetrics.parser import (
        text_string_to_metric_families as openmetrics_families,
    )

    text, _ = scrape(served, pki, accept="application/openmetrics-text; version=1.0.0")
    assert text.rstrip().endswith("# EOF")
    names = {f.name for f in openmetrics_families(text)}
    assert {"fleetd_build_info", "fleetd_query_seconds", "process_cpu_seconds"} <= names


# ---- a tracing agent: ready once its probes are attached, histograms from the kernel ----

WORKLOAD = REPO / "tests" / "workloads" / "train_loop.py"


def _sql(a: Agent, pki: Pki, sql: str) -> Any:
    status, res, _ = request(a.url, client_ssl(pki, "prometheus"), "POST", "/api/v1/query",
                             json={"sql": sql}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200, res
    return res["rows"][0][0]


@pytest.mark.bpf
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="tracing needs root")
def test_a_tracing_agent_is_ready_with_its_probes_and_exports_the_kernel_histograms(
        tmp_path: Path, pki: Pki) -> None:
    go = tmp_path / "go"
    work = subprocess.Popen(
        [sys.executable, str(WORKLOAD), "--duration", "90", "--launches", "8", "--memcpy", "1",
         "--cpu-us", "50", "--gpu-ms", "2", "--go-file", str(go)],
        stdout=subprocess.DEVNULL, text=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(240)
    token = tmp_path / "token"
    fd = os.open(token, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, TOKEN.encode())
    os.close(fd)
    try:
        wait_for_libcudart(work.pid)
        with agent(tmp_path / "gpu-01.db", "gpu-01", pki, "--pid", str(work.pid),
                   "--token-file", str(token),
                   env={"NOTIFY_SOCKET": str(tmp_path / "notify")}) as a:
            assert "READY=1" in sock.recv(4096).decode().splitlines()
            # READY=1 came after the probes were attached: the tracer runs already.
            status, health, _ = request(a.url, client_ssl(pki, "prometheus"))
            assert status == 200 and health["tracing"] and health["trace"]["probes"] > 0
            go.touch()
            _, fams = scrape(a, pki)
            assert fams["fleetd_tracing"].samples[0].value == 1
            assert fams["fleetd_trace_probes"].samples[0].value > 0
            # The kernel's histograms reach the file once per 10 s window.
            launches = ("SELECT coalesce(sum(count), 0) FROM aggregates "
                        "WHERE op = 'cudaLaunchKernel' AND bucket >= 0")
            deadline = time.monotonic() + 60
            while _sql(a, pki, launches) == 0 and time.monotonic() < deadline:
                time.sleep(1)
            before = _sql(a, pki, launches)
            _, fams = scrape(a, pki)
            after = _sql(a, pki, launches)
            fam = fams["fleetd_cuda_call_duration_seconds"]
            buckets, count, total = histogram(fam, "cudaLaunchKernel")
            assert 0 < before <= count <= after, (before, count, after)
            assert buckets[-1][1] == count and total > 0
            assert [v for _, v in buckets] == sorted(v for _, v in buckets)
            assert fams["fleetd_trace_records"].samples[0].value > 0
            assert fams["fleetd_events_written"].samples[0].value > 0
            a.proc.send_signal(signal.SIGTERM)
            assert "STOPPING=1" in sock.recv(4096).decode().splitlines()
            assert a.proc.wait(60) == 0
    finally:
        sock.close()
        work.kill()
        work.wait(10)
