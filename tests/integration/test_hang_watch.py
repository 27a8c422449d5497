"""Hangs caught in seconds (issue #15, item 4): one real agent on loopback with
certificates from `fleetd certs`, tracing four ranks of tests/workloads/nccl_ranks.py
(the real libnccl, in lockstep over a TCP barrier), and `fleetd watch` against it.

- one job, four states: first quiet (no hang, bounded with --for); then one rank
  SIGSTOPped: `fleetd watch --hang-after 10s` exits 6 within 20 s of the stop, naming the
  rank, its node and pid, state `stopped`, and the collective number; a watch with
  --webhook and --exec posts that finding, then its recovery once the rank is continued
  (issue 43.2); then that rank stopped again and killed: named `exited`;
- without tracing (no root needed): the endpoint answers empty, is not held up by a
  flood of slow queries, and `watch` treats a dead node as a warning.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
from agents import Agent, Pki, agent, client_ssl, request
from webhook_receiver import receiver

from conftest import FLEETD, REPO, build_db

WORKLOAD = REPO / "tests" / "workloads" / "nccl_ranks.py"
RANKS = 4

F = TypeVar("F", bound=Callable[..., Any])


def tracing(test: F) -> F:
    """Real BPF on real ranks: root, and never skipped in CI (conftest)."""
    marked = pytest.mark.skipif(os.geteuid() != 0, reason="tracing needs root")(test)
    return pytest.mark.bpf(pytest.mark.slow(marked))  # type: ignore[no-any-return]


def watch(pki: Pki, nodes: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([FLEETD, "watch", "--nodes", nodes, *pki.client_flags(), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def address(a: Agent) -> str:
    return f"{a.node}={a.url.removeprefix('https://')}"


@dataclass
class Job:
    launcher: subprocess.Popen[str]
    pids: list[int]  # by rank
    agent: Agent


@contextmanager
def traced_job(tmp_path: Path, pki: Pki) -> Iterator[Job]:
    """Four ranks under one agent; yields once every rank has made a few collectives."""
    go, said = tmp_path / "go", tmp_path / "ranks.out"
    with said.open("w") as out:  # a file: the ranks' summaries never block on a pipe
        launcher = subprocess.Popen(
            [sys.executable, str(WORKLOAD), "--spawn", str(RANKS), "--seconds", "120",
             "--compute-ms", "2", "--go-file", str(go), "--barrier-timeout", "150"],
            stdout=out, text=True, start_new_session=True)
    try:
        _wait(lambda: '"pids"' in said.read_text(), "the ranks ready", 30)
        ready = json.loads(said.read_text().splitlines()[0])
        assert ready["event"] == "ready", ready
        pids = _by_rank(ready["pids"])
        with agent(tmp_path / "n1.db", "n1", pki,
                   *(a for p in pids for a in ("--pid", str(p)))) as a:
            _wait(lambda: request(a.url, client_ssl(pki))[1]["tracing"], "tracing")
            go.touch()
            _wait(lambda: _all_ranks_past(a, pki, 5), "four ranks past collective 5")
            yield Job(launcher, pids, a)
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with suppress(ProcessLookupError):
                os.killpg(launcher.pid, sig)
        launcher.wait(20)


def _by_rank(pids: list[int]) -> list[int]:
    out = {}
    for pid in pids:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = next(int(e[5:]) for e in env if e.startswith(b"RANK="))
        out[rank] = pid
    return [out[r] for r in range(RANKS)]


def _wait(cond: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"not reached within {timeout} s: {what}")


def _all_ranks_past(a: Agent, pki: Pki, seq: int) -> bool:
    status, body, _ = request(a.url, client_ssl(pki), path="/api/v1/ranks")
    assert status == 200, body
    seqs = [max((c["seq"] for c in r["collectives"]), default=0) for r in body["ranks"]]
    return len(seqs) == RANKS and min(seqs) >= seq


def _finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"watch still running after {timeout} s: {err}") from None
    return proc.returncode, out, err


# ---- with real ranks ----------------------------------------------------------------------


@tracing
def test_quiet_then_a_stopped_rank_then_the_same_rank_killed(tmp_path: Path, pki: Pki) -> None:
    """One traced job for the three states a watcher must tell apart (each job costs an
    agent start and a BPF compile): quiet, a stopped rank, then that rank exited."""
    with traced_job(tmp_path, pki) as job:
        _quiet(job, pki)
        _stopped(job, pki)
        verdict = _notified_then_recovered(job, pki, tmp_path)
        _exited(job, pki, verdict)


def _quiet(job: Job, pki: Pki) -> None:
    w = watch(pki, address(job.agent), "--hang-after", "3s", "--interval", "0.5s",
              "--for", "6s", "--format", "json")
    code, out, err = _finish(w, 40)
    assert code == 0, out + err
    v = json.loads(out.strip().splitlines()[-1])  # the verdict: the last line
    assert v["status"] == "ok" and v["hangs"] == [] and v["ranks"] == RANKS
    [g] = v["groups"]
    assert (g["matching"], g["ranks"], g["size"]) == ("torchrun", [0, 1, 2, 3], RANKS)
    assert g["seq"] > 5 and g["progress_s"] < 3
    assert v["verdict"].startswith("no hang: job ")


def _stopped(job: Job, pki: Pki) -> dict[str, Any]:
    # The endpoint, as a user reads it: four ranks of one torchrun job.
    _, body, _ = request(job.agent.url, client_ssl(pki), path="/api/v1/ranks")
    got = {r["pid"]: r for r in body["ranks"]}
    assert set(got) == set(job.pids) and body["tracing"] is True
    r2 = got[job.pids[2]]
    assert (r2["rank"], r2["world_size"]) == (2, RANKS) and r2["job"]
    assert r2["collectives"][0]["op"].startswith("nccl") and r2["last_call"] is not None
    assert r2["state"] in ("running", "sleeping")

    w = watch(pki, address(job.agent), "--hang-after", "10s", "--format", "json",
              "--for", "60s")
    time.sleep(2)  # the watch is polling a healthy job
    os.kill(job.pids[2], signal.SIGSTOP)
    stopped = time.monotonic()
    code, out, err = _finish(w, 40)
    took = time.monotonic() - stopped
    print(f"SIGSTOP to verdict: {took:.1f} s")
    assert code == 6, err
    assert took < 20
    v: dict[str, Any] = json.loads(out.strip().splitlines()[-1])  # after any events
    assert v["status"] == "hang"
    h = v["hangs"][0]
    [c] = h["culprits"]
    assert (c["node"], c["pid"], c["rank"], c["state"]) == ("n1", job.pids[2], 2, "stopped")
    assert h["kind"] in ("collective", "stalled") and h["waited_s"] >= 10
    # The collective the others wait in (or, all having finished N, wait after).
    assert h["seq"] == c["seq"] + 1
    assert {x["pid"] for x in h["waiting"]} == {job.pids[r] for r in (0, 1, 3)}
    if h["kind"] == "collective":
        assert all(x["seq"] == h["seq"] for x in h["waiting"])
    else:
        assert all(x["seq"] == c["seq"] for x in h["waiting"])
    assert f"rank 2 (n1 pid {job.pids[2]}, stopped" in h["summary"]
    # The table names the same, and the gauge of /metrics shows the wait.
    once = subprocess.run([FLEETD, "watch", "--nodes", address(job.agent),
                           *pki.client_flags(), "--hang-after", "10s", "--once"],
                          capture_output=True, text=True, timeout=60)
    assert once.returncode == 6 and "stopped" in once.stdout
    assert str(job.pids[2]) in once.stdout and f"collective {h['seq']}" in once.stdout
    _, _, metrics = request(job.agent.url, client_ssl(pki), path="/metrics")
    gauge = [x for x in metrics.decode().splitlines()
             if x.startswith("fleetd_nccl_wait_seconds{")]
    assert gauge and float(gauge[0].rsplit(" ", 1)[1]) >= 10
    return v


def _notified_then_recovered(job: Job, pki: Pki, tmp: Path) -> dict[str, Any]:
    """Rank 2 still stopped: a watch with --webhook (a real receiver checking the HMAC,
    failing its first request so the retry is exercised) and --exec posts the finding;
    SIGCONT: it posts the recovery, once each. Then rank 2 is stopped again: the verdict
    the next step kills it in."""
    secret = tmp / "secret"
    secret.write_text("shared-secret\n")
    execd = tmp / "exec.ndjson"
    with receiver(fail_first=1) as rec:
        w = watch(pki, address(job.agent), "--hang-after", "10s", "--interval", "0.5s",
                  "--for", "90s", "--webhook", rec.url, "--webhook-secret-file", str(secret),
                  "--exec", f"sh -c 'cat >> {execd}'", "--format", "json")
        try:
            [fire] = rec.wait_for(1, 30)
            os.kill(job.pids[2], signal.SIGCONT)
            resumed = time.monotonic()
            [_, done] = rec.wait_for(2, 30)
            print(f"SIGCONT to recovery posted: {time.monotonic() - resumed:.1f} s")
        finally:
            w.terminate()
            w.communicate(timeout=20)
    assert fire.signed_by(b"shared-secret") and done.signed_by(b"shared-secret")
    f, d = fire.json(), done.json()
    assert (f["status"], d["status"]) == ("firing", "resolved") and f["id"] == d["id"]
    assert (f["node"], f["rank"], f["pid"]) == ("n1", 2, job.pids[2])
    assert f["evidence"] == f"{job.agent.url}/api/v1/ranks"
    assert rec.requests == 3  # the failed first try, then each message once
    lines = [json.loads(x) for x in execd.read_text().splitlines()]
    assert [x["status"] for x in lines] == ["firing", "resolved"]
    os.kill(job.pids[2], signal.SIGSTOP)
    verdict: dict[str, Any] = {}

    def hung() -> bool:
        nonlocal verdict
        r = subprocess.run([FLEETD, "watch", "--nodes", address(job.agent), *pki.client_flags(),
                            "--hang-after", "3s", "--once", "--format", "json"],
                           capture_output=True, text=True, timeout=60)
        verdict = json.loads(r.stdout)
        return r.returncode == 6
    _wait(hung, "rank 2 stopped again, a hang", 30)
    return verdict


def _exited(job: Job, pki: Pki, before: dict[str, Any]) -> None:
    """The stopped rank killed: the same hang, its culprit now named exited."""
    os.kill(job.pids[2], signal.SIGKILL)
    _wait(lambda: _state_of(job, pki, job.pids[2]) == "exited", "rank 2 seen exited", 20)
    once = subprocess.run([FLEETD, "watch", "--nodes", address(job.agent), *pki.client_flags(),
                           "--hang-after", "10s", "--once", "--format", "json"],
                          capture_output=True, text=True, timeout=60)
    assert once.returncode == 6, once.stderr
    h = json.loads(once.stdout)["hangs"][0]
    [c] = h["culprits"]
    assert (c["pid"], c["rank"], c["state"]) == (job.pids[2], 2, "exited")
    assert c["exit_code"] is None  # killed by a signal
    assert "exited, killed by a signal" in h["summary"]
    assert h["seq"] == before["hangs"][0]["seq"]


def _state_of(job: Job, pki: Pki, pid: int) -> str | None:
    _, body, _ = request(job.agent.url, client_ssl(pki), path="/api/v1/ranks")
    return next((r["state"] for r in body["ranks"] if r["pid"] == pid), None)


# ---- without tracing -------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[Agent]:
    d = tmp_path_factory.mktemp("served")
    with ExitStack() as stack:
        yield stack.enter_context(agent(build_db(d / "n1.db", "n1", 400), "n1", pki,
                                        "--no-trace"))


def test_no_ranks_and_a_dead_node_is_a_warning_and_a_partial_answer(served: Agent,
                                                                     pki: Pki) -> None:
    status, body, _ = request(served.url, client_ssl(pki), path="/api/v1/ranks")
    assert status == 200 and body["ranks"] == [] and body["tracing"] is False
    assert body["node"] == "n1" and isinstance(body["now_ns"], int)
    w = watch(pki, f"{address(served)},dead=127.0.0.1:9", "--once")
    code, out, err = _finish(w, 60)
    assert code == 3, err  # a partial answer, as every fleet command says it (#44.4)
    assert out.startswith("no hang: no traced process has made NCCL calls")
    assert "fleetd: warning: node dead: refused" in err
    w = watch(pki, "dead=127.0.0.1:9", "--once", "--format", "json")
    code, out, _ = _finish(w, 60)
    assert code == 4 and json.loads(out)["status"] == "ok"


def test_the_ranks_endpoint_does_not_wait_behind_slow_queries(served: Agent,
                                                              pki: Pki) -> None:
    runaway = {"sql": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
                      "SELECT count(*) FROM c", "timeout_s": 3}
    clients = [client_ssl(pki, "laptop"), client_ssl(pki, "desk")]

    async def go() -> float:
        async with aiohttp.ClientSession() as s:
            async def ask(ctx: Any) -> int:
                async with s.post(served.url + "/api/v1/query", ssl=ctx, json=runaway) as r:
                    await r.read()
                    return r.status
            flood = [asyncio.create_task(ask(ctx)) for ctx in clients for _ in range(4)]
            await asyncio.sleep(0.5)  # every reader slot is taken now
            t0 = time.monotonic()
            async with s.get(served.url + "/api/v1/ranks", ssl=clients[0]) as r:
                assert r.status == 200
            took = time.monotonic() - t0
            await asyncio.gather(*flood)
            return took

    assert asyncio.run(go()) < 0.5
