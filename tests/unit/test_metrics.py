"""The /metrics text as prometheus_client's parser reads it: escaping, no node label, the
kernel's log2 buckets as a Prometheus histogram."""

from __future__ import annotations

import math
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fleetd.node.api import NodeState
from fleetd.node.metrics import OpLatency, Sources, render
from fleetd.store.catalog import op_code
from fleetd.store.writer import WriterStats


def families(src: Sources, state: NodeState | None = None) -> dict[str, Any]:
    text = render(state or NodeState(node="n1", tracing=True), src)
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_label_values_are_escaped_and_read_back() -> None:
    awkward = 'job "a"\\b\nc/2'
    src = Sources(nccl_waits=lambda: [("torchrun", awkward, 2_500_000_000)])
    (wait,) = families(src)["fleetd_nccl_wait_seconds"].samples
    assert wait.labels == {"matching": "torchrun", "group": awkward}
    assert wait.value == 2.5


def test_no_series_carries_the_node_label() -> None:
    src = Sources(nccl_ranks=lambda: 3, nccl_waits=lambda: [("communicator", "0xab", 0)],
                  writer=lambda: WriterStats(events_written=10))
    src.latency.add([(op_code("cudaMalloc"), 14, 2, 40_000)])
    fams = families(src)
    assert all(set(s.labels) <= {"le", "op", "source", "matching", "group", "version",
                                 "python", "schema_version"}
               for f in fams.values() for s in f.samples)
    assert fams["fleetd_events_written"].samples[0].value == 10


def test_the_kernel_buckets_become_cumulative_le_buckets_in_seconds() -> None:
    lat = OpLatency()
    sync = op_code("cudaDeviceSynchronize")
    # bucket b holds [2**b, 2**(b+1)) ns; 0 holds 0 and 1 ns; 39 everything beyond 2**39.
    lat.add([(sync, 0, 1, 1), (sync, 9, 2, 1_200), (sync, 9, 1, 600), (sync, 30, 1, 2**30),
             (sync, 39, 1, 2**40)])
    src = Sources(latency=lat)
    fam = families(src)["fleetd_cuda_call_duration_seconds"]
    assert fam.type == "histogram"
    buckets = {float(s.labels["le"]): s.value for s in fam.samples
               if s.name.endswith("_bucket")}
    count = next(s.value for s in fam.samples if s.name.endswith("_count"))
    total = next(s.value for s in fam.samples if s.name.endswith("_sum"))
    assert count == 6 and buckets[math.inf] == 6
    assert total == pytest.approx((1 + 1_800 + 2**30 + 2**40) / 1e9)
    assert buckets[2**8 / 1e9] == 1  # bucket 0 is below the first edge
    assert buckets[2**9 / 1e9] == 1 and buckets[2**10 / 1e9] == 4  # [512, 1024) ns
    assert buckets[2**30 / 1e9] == 4 and buckets[2**31 / 1e9] == 5
    assert max(b for b in buckets if b != math.inf) == pytest.approx(2**35 / 1e9)
    assert buckets[2**35 / 1e9] == 5  # beyond the last edge: +Inf only
    values = [buckets[k] for k in sorted(buckets)]
    assert values == sorted(values)
    assert {s.labels["op"] for s in fam.samples} == {"cudaDeviceSynchronize"}
    assert {s.labels["source"] for s in fam.samples} == {"cuda"}


def test_lost_events_are_not_counted_twice() -> None:
    # The tracer's count already includes the writer's drops.
    src = Sources(writer=lambda: WriterStats(queue_dropped=5, failed_rows=1),
                  tracer=lambda: {"lost": 9, "running": True})
    assert families(src)["fleetd_events_lost"].samples[0].value == 9
    src = Sources(writer=lambda: WriterStats(queue_dropped=5, failed_rows=1))
    assert families(src)["fleetd_events_lost"].samples[0].value == 6
