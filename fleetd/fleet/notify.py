"""Telling someone: each finding of ``fleetd watch``, and its recovery, as one JSON message
posted to a webhook (signed with HMAC-SHA256 over a shared secret) and/or given on stdin
to a command.

A finding is keyed (kind, group, culprit ranks): the same hang seen on every poll is one
``firing`` message; when that key is no longer found, one ``resolved`` message follows.
Delivery is at least once with bounded effort: each message is tried ``attempts`` times
with a doubling pause, each try under ``timeout_s``; a receiver that never takes it costs
a warning, never the watch. Redirects are not followed (the message and its signature go
only to the address the user gave: docs/security.md).

The signature header is ``X-Fleetd-Signature: sha256=<hex>``, the HMAC-SHA256 of
``<X-Fleetd-Timestamp>.<body>`` under the secret, so a receiver can refuse a replayed or
altered message (docs/fleet.md, "Telling someone").
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import shlex
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TypedDict

import orjson

from fleetd.errors import UsageError
from fleetd.wire import headers

log = logging.getLogger("fleetd.notify")

SIGNATURE_HEADER = headers.WEBHOOK_SIGNATURE
TIMESTAMP_HEADER = headers.WEBHOOK_TIMESTAMP
SCHEMA = "fleetd.finding/1"
SECRET_MAX = 4096


class Finding(TypedDict):
    """One message: a finding as it starts (``firing``) or as it ends (``resolved``)."""

    schema: str
    status: Literal["firing", "resolved"]
    id: str
    kind: str  # hang kind: collective, stalled, exited, p2p; or straggler
    severity: str
    node: str | None
    rank: int | None
    pid: int | None
    job: str | None
    cause: str
    culprit: str | None
    summary: str
    first_seen: str
    resolved_at: str | None
    evidence: str | None


def signature(secret: bytes, timestamp: str, body: bytes) -> str:
    """The header value a receiver recomputes: sha256=HMAC(secret, timestamp '.' body)."""
    mac = hmac.new(secret, timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def read_secret(path: Path) -> bytes:
    """The shared secret from a file (never a flag: a command line is visible to all)."""
    try:
        data = path.read_bytes()[: SECRET_MAX + 1]
    except OSError as exc:
        raise UsageError(f"cannot read the webhook secret {str(path)!r}: {exc.strerror}",
                         "give a readable file holding the shared secret") from exc
    secret = data.strip()
    if not secret or len(data) > SECRET_MAX:
        raise UsageError(f"the webhook secret file {str(path)!r} is empty or over "
                         f"{SECRET_MAX} bytes",
                         "put the secret on one line (e.g. head -c 32 /dev/urandom | base64)")
    return secret


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")


def _hang_key(h: Mapping[str, Any]) -> str:
    ranks = ",".join(str(c.get("rank")) for c in h.get("culprits") or [])
    return f"{h.get('kind')}:{h.get('key') or h.get('group')}:{ranks}"


def _cause(h: Mapping[str, Any]) -> tuple[str, str | None]:
    """The hang's cause: its top host chain's root cause when the node gave one."""
    for c in h.get("culprits") or []:
        chain = c.get("top_chain") or {}
        if chain.get("root_cause"):
            return f"hang: {chain['root_cause']}", _process(chain.get("culprit"))
    return f"hang: {h.get('kind')}", None


def _process(culprit: Any) -> str | None:
    """A chain's culprit process ({pid, comm}, as fleetd.wire.ranks.top_chain gives it)
    as text: "comm pid N"."""
    if isinstance(culprit, str):
        return culprit or None
    if not isinstance(culprit, Mapping) or not (culprit.get("pid") or culprit.get("comm")):
        return None
    return f"{culprit.get('comm') or 'pid'} pid {culprit.get('pid')}"


def finding_of_hang(h: Mapping[str, Any], first_seen: float, evidence: str | None) -> Finding:
    """A firing message from one hang of the watch's verdict (fleetd.fleet.hang JSON)."""
    first = (h.get("culprits") or [{}])[0]
    cause, chain_culprit = _cause(h)
    who = f"{first.get('comm') or 'pid'} pid {first.get('pid')} on {first.get('node')}"
    return Finding(
        schema=SCHEMA, status="firing", id=_hang_key(h), kind=str(h.get("kind")),
        severity="critical", node=first.get("node"), rank=first.get("rank"),
        pid=first.get("pid"), job=h.get("group"), cause=cause,
        culprit=chain_culprit or who, summary=str(h.get("summary", "")),
        first_seen=_iso(first_seen), resolved_at=None, evidence=evidence)


def finding_of_straggler(s: Mapping[str, Any], first_seen: float,
                         evidence: str | None) -> Finding:
    """A firing message from one flagged rank of the watch (fleetd.fleet.straggle JSON):
    its cause is its top host chain's root cause once its node named one."""
    chain = s.get("top_chain") or {}
    who = f"{s.get('comm') or 'pid'} pid {s.get('pid')} on {s.get('node')}"
    cause = f"straggler: {chain['root_cause']}" if chain.get("root_cause") else "straggler"
    named = _process(chain.get("culprit"))
    summary = str(s.get("summary", ""))
    if chain.get("summary"):
        summary += f"; top chain: {chain['summary']}"
    return Finding(
        schema=SCHEMA, status="firing", id=str(s.get("key")), kind="straggler",
        severity="warning", node=s.get("node"), rank=s.get("rank"), pid=s.get("pid"),
        job=s.get("group"), cause=cause, culprit=named or who, summary=summary,
        first_seen=_iso(first_seen), resolved_at=None, evidence=s.get("evidence") or evidence)


@dataclass
class Delivery:
    """Where messages go, and how hard to try."""

    webhook: str | None = None
    secret: bytes | None = None
    command: list[str] | None = None
    timeout_s: float = 5.0
    attempts: int = 3
    backoff_s: float = 0.5

    @classmethod
    def parse(cls, webhook: str | None, secret_file: Path | None, command: str | None,
              timeout_s: float, attempts: int) -> Delivery:
        if webhook is not None and not webhook.startswith(("https://", "http://")):
            raise UsageError(f"--webhook {webhook!r} is not an http(s) URL",
                             "give the receiver's full URL, e.g. https://alerts.example/hook")
        if secret_file is not None and webhook is None:
            raise UsageError("--webhook-secret-file without --webhook",
                             "add --webhook URL, or drop the secret")
        argv = None
        if command is not None:
            try:
                argv = shlex.split(command)
            except ValueError as exc:
                raise UsageError(f"--exec {command!r} cannot be split: {exc}",
                                 "quote it as a shell would") from exc
            if not argv:
                raise UsageError("--exec is empty", "give the command to run")
        if attempts < 1:
            raise UsageError(f"--notify-attempts {attempts} is below 1", "give 1 or more")
        return cls(webhook=webhook, secret=read_secret(secret_file) if secret_file else None,
                   command=argv, timeout_s=timeout_s, attempts=attempts)

    @property
    def wanted(self) -> bool:
        return bool(self.webhook or self.command)


@dataclass
class Notifier:
    """Sends each new finding once and each recovery once; counts what was delivered."""

    delivery: Delivery
    open: dict[str, Finding] = field(default_factory=dict)
    sent: int = 0
    failed: int = 0

    async def update(self, hangs: Sequence[Mapping[str, Any]], evidence: str | None,
                     now: float | None = None,
                     stragglers: Sequence[Mapping[str, Any]] = ()) -> list[Finding]:
        """Compare this poll's hangs and flagged stragglers with the open findings; send
        what changed: a new finding, a straggler whose cause was named since (sent again,
        firing, with it), a finding no longer there (resolved)."""
        now = time.time() if now is None else now
        seen: dict[str, Finding] = {}
        for h in hangs:
            key = _hang_key(h)
            old = self.open.get(key)
            seen[key] = old or finding_of_hang(h, now, evidence)
        for s in stragglers:
            key = str(s.get("key"))
            old = self.open.get(key)
            first = datetime.fromisoformat(old["first_seen"]).timestamp() if old else now
            seen[key] = finding_of_straggler(s, first, old["evidence"] if old else evidence)
        out: list[Finding] = []
        for key, f in seen.items():
            old = self.open.get(key)
            if old is None or old["cause"] != f["cause"]:
                self.open[key] = f
                out.append(f)
        for key in [k for k in self.open if k not in seen]:
            done = self.open.pop(key)
            out.append(Finding(**{**done, "status": "resolved",
                                  "resolved_at": _iso(now)}))
        for f in out:
            await self.send(f)
        return out

    async def send(self, finding: Finding) -> bool:
        body = orjson.dumps(finding)
        # Both at once: the command does not wait out the webhook's retries.
        ways = [self._post(body)] if self.delivery.webhook else []
        if self.delivery.command:
            ways.append(self._exec(body))
        ok = all(await asyncio.gather(*ways))
        self.sent += ok
        self.failed += not ok
        return ok

    async def _post(self, body: bytes) -> bool:
        import aiohttp

        d = self.delivery
        assert d.webhook is not None
        timeout = aiohttp.ClientTimeout(total=d.timeout_s)
        why = ""
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for attempt in range(d.attempts):
                if attempt:
                    await asyncio.sleep(d.backoff_s * 2 ** (attempt - 1))
                ts = str(int(time.time()))
                headers = {"Content-Type": "application/json", TIMESTAMP_HEADER: ts,
                           "User-Agent": "fleetd-watch"}
                if d.secret is not None:
                    headers[SIGNATURE_HEADER] = signature(d.secret, ts, body)
                try:
                    async with session.post(d.webhook, data=body, headers=headers,
                                            allow_redirects=False) as resp:
                        if 200 <= resp.status < 300:
                            return True
                        why = f"HTTP {resp.status}"
                        if 300 <= resp.status < 400:
                            why += (f" redirect to {resp.headers.get('Location', '?')!r}; "
                                    "not followed")
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    why = str(exc) or type(exc).__name__
        log.warning("webhook %s did not take the finding after %d attempt(s): %s",
                    d.webhook, d.attempts, why)
        return False

    async def _exec(self, body: bytes) -> bool:
        d = self.delivery
        assert d.command is not None
        try:
            proc = await asyncio.create_subprocess_exec(
                *d.command, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        except OSError as exc:
            log.warning("--exec %s could not start: %s", d.command[0], exc.strerror)
            return False
        try:
            await asyncio.wait_for(proc.communicate(body + b"\n"), d.timeout_s)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            log.warning("--exec %s ran over %.0f s and was killed", d.command[0], d.timeout_s)
            return False
        if proc.returncode != 0:
            log.warning("--exec %s exited with status %s", d.command[0], proc.returncode)
            return False
        return True
