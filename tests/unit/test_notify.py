"""Telling someone (issue 43.2): fleetd watch's notifier against a real HTTP receiver on
loopback and a real command; the live watch that fires and recovers is in
tests/integration/test_hang_watch.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from webhook_receiver import receiver

from fleetd.errors import UsageError
from fleetd.fleet.notify import Delivery, Notifier, finding_of_hang, signature

from conftest import FLEETD

if TYPE_CHECKING:
    from agents import Pki

SECRET = b"s3cret-shared-with-the-receiver"


def _hang(rank: int = 2, group: str = "torchrun job-a/4") -> dict[str, Any]:
    return {"kind": "collective", "key": "job-a", "group": group, "seq": 41,
            "summary": f"rank {rank} (n1 pid 99, stopped) never arrived at collective 41",
            "culprits": [{"node": "n1", "pid": 99, "comm": "python", "rank": rank,
                          "top_chain": {"root_cause": "cpu_contention",
                                        "culprit": "hog pid 7"}}]}


def _notifier(**kw: Any) -> Notifier:
    d = Delivery(timeout_s=2.0, attempts=3, backoff_s=0.05, **kw)
    return Notifier(d)


def test_a_finding_is_posted_once_signed_and_its_recovery_once(tmp_path: Path) -> None:
    with receiver() as rec:
        n = _notifier(webhook=rec.url, secret=SECRET)
        first = asyncio.run(n.update([_hang()], "https://n1:7443/api/v1/ranks", now=1000.0))
        again = asyncio.run(n.update([_hang()], None, now=1001.0))
        gone = asyncio.run(n.update([], None, now=1010.0))
        posts = rec.wait_for(2)
    assert [f["status"] for f in first] == ["firing"] and again == []
    assert [f["status"] for f in gone] == ["resolved"]
    assert len(posts) == 2 and all(p.signed_by(SECRET) for p in posts)
    assert not posts[0].signed_by(b"another secret")
    fire, done = posts[0].json(), posts[1].json()
    assert fire["id"] == done["id"]
    assert (fire["node"], fire["rank"], fire["pid"], fire["job"]) == \
        ("n1", 2, 99, "torchrun job-a/4")
    assert fire["cause"] == "hang: cpu_contention" and fire["culprit"] == "hog pid 7"
    assert fire["severity"] == "critical" and fire["evidence"].endswith("/api/v1/ranks")
    assert fire["first_seen"] == done["first_seen"] == "1970-01-01T00:16:40+00:00"
    assert done["resolved_at"] == "1970-01-01T00:16:50+00:00"
    assert n.sent == 2 and n.failed == 0


def test_a_failing_receiver_is_retried_then_takes_it() -> None:
    with receiver(fail_first=2) as rec:
        n = _notifier(webhook=rec.url, secret=SECRET)
        asyncio.run(n.update([_hang()], None))
        [post] = rec.wait_for(1)
    assert rec.requests == 3 and post.signed_by(SECRET) and n.sent == 1


def test_a_receiver_that_never_takes_it_costs_a_warning(caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    with receiver(fail_first=99) as rec:
        n = _notifier(webhook=rec.url)
        asyncio.run(n.update([_hang()], None))
    assert rec.requests == 3 and n.failed == 1 and n.sent == 0
    assert "did not take the finding after 3 attempt(s): HTTP 500" in caplog.text


def test_a_redirect_is_not_followed() -> None:
    with receiver() as elsewhere, receiver(redirect_to="") as rec:
        rec.redirect_to = elsewhere.url
        n = _notifier(webhook=rec.url, secret=SECRET)
        asyncio.run(n.update([_hang()], None))
    assert elsewhere.requests == 0 and n.failed == 1


def test_exec_gets_the_finding_on_stdin(tmp_path: Path) -> None:
    out = tmp_path / "findings.ndjson"
    cmd = [sys.executable, "-c", f"import sys; open({str(out)!r}, 'a').write(sys.stdin.read())"]
    n = _notifier(command=cmd)
    asyncio.run(n.update([_hang(1), _hang(3, "torchrun job-b/2")], None))
    asyncio.run(n.update([_hang(3, "torchrun job-b/2")], None))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["rank"], x["status"]) for x in lines] == \
        [(1, "firing"), (3, "firing"), (1, "resolved")]


def test_exec_that_hangs_is_killed_after_the_timeout(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    n = Notifier(Delivery(command=["sleep", "30"], timeout_s=0.5))
    assert asyncio.run(n.send(finding_of_hang(_hang(), 0.0, None))) is False
    assert "ran over" in caplog.text


@pytest.mark.parametrize(("args", "says"), [
    (["--webhook", "ftp://x/y"], "is not an http(s) URL"),
    (["--webhook-secret-file", "/nonexistent"], "without --webhook"),
    (["--webhook", "http://127.0.0.1:9/h", "--webhook-secret-file", "/nonexistent/s"],
     "cannot read the webhook secret"),
    (["--exec", "'unbalanced"], "cannot be split"),
    (["--exec", "true", "--notify-attempts", "0"], "is below 1"),
])
def test_notification_flags_refused_in_one_line(args: list[str], says: str) -> None:
    r = subprocess.run([FLEETD, "watch", "--nodes", "127.0.0.1:9", "--once", *args],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr


def test_an_empty_secret_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "s").write_text("\n")
    with pytest.raises(UsageError, match="empty"):
        Delivery.parse("http://127.0.0.1:9/h", tmp_path / "s", None, 1.0, 1)


def test_the_signature_is_over_timestamp_and_body() -> None:
    a = signature(SECRET, "100", b"{}")
    assert a.startswith("sha256=") and a != signature(SECRET, "101", b"{}")
    assert a != signature(SECRET, "100", b"{ }")


def test_exec_does_not_wait_out_the_webhooks_retries(tmp_path: Path) -> None:
    """A webhook nobody listens on is retried; the command runs meanwhile, not after."""
    out = tmp_path / "findings.ndjson"
    started = tmp_path / "exec-started"
    cmd = [sys.executable, "-c",
           f"import sys, time; open({str(started)!r}, 'w').write(str(time.monotonic())); "
           f"open({str(out)!r}, 'a').write(sys.stdin.read())"]
    d = Delivery(webhook="http://127.0.0.1:9/hook", timeout_s=2.0, attempts=3,
                 backoff_s=0.5, command=cmd)
    import time

    t0 = time.monotonic()
    [f] = asyncio.run(Notifier(d).update([_hang()], None))
    took = time.monotonic() - t0
    assert f["status"] == "firing" and json.loads(out.read_text())["status"] == "firing"
    # The two retries wait 0.5 s and 1 s; the command did not wait for them.
    assert took >= 1.5 and float(started.read_text()) - t0 < 1.4


def test_sigterm_ends_a_watch_after_its_poll_without_a_traceback(pki: Pki) -> None:
    """A supervisor's SIGTERM ends watch as --for would (here: no node ever answered, 4);
    no traceback, and well before --for."""
    import signal
    import time

    w = subprocess.Popen([FLEETD, "watch", "--nodes", "127.0.0.1:9", "--for", "120s",
                          "--interval", "1s", "--timeout", "1s", *pki.client_flags()],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert w.stderr is not None
    # The first poll's warning (the node does not answer) says the watch is running,
    # however long its start took on a busy machine.
    first = w.stderr.readline()
    assert "fleetd: warning:" in first, first
    t0 = time.monotonic()
    w.send_signal(signal.SIGTERM)
    out, err = w.communicate(timeout=30)
    err = first + err
    assert w.returncode == 4, err
    assert "Traceback" not in err and time.monotonic() - t0 < 10
