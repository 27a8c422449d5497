"""A real HTTP receiver on loopback for fleetd's webhook (fleetd.fleet.notify): it records
each POST (headers and body), checks its HMAC signature the way a user's receiver would,
and can be told to fail its first requests or to redirect elsewhere."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Post:
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.body)
        return out

    def signed_by(self, secret: bytes) -> bool:
        """The receiver's side: recompute sha256=HMAC(secret, timestamp '.' body)."""
        ts = self.headers.get("X-Fleetd-Timestamp", "")
        want = "sha256=" + hmac.new(secret, ts.encode() + b"." + self.body,
                                    hashlib.sha256).hexdigest()
        return hmac.compare_digest(want, self.headers.get("X-Fleetd-Signature", ""))


@dataclass
class Receiver:
    url: str = ""
    fail_first: int = 0  # answer 500 to this many requests first
    redirect_to: str | None = None  # answer 307 to this Location
    posts: list[Post] = field(default_factory=list)
    requests: int = 0

    def wait_for(self, n: int, timeout: float = 30.0) -> list[Post]:
        deadline = time.monotonic() + timeout
        while len(self.posts) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(self.posts) >= n, f"{len(self.posts)} of {n} post(s) within {timeout} s"
        return self.posts


@contextmanager
def receiver(**kw: Any) -> Iterator[Receiver]:
    rec = Receiver(**kw)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the http.server name)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            rec.requests += 1
            if rec.requests <= rec.fail_first:
                self.send_response(500)
            elif rec.redirect_to is not None:
                self.send_response(307)
                self.send_header("Location", rec.redirect_to)
            else:
                rec.posts.append(Post(dict(self.headers.items()), body))
                self.send_response(204)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    rec.url = f"http://127.0.0.1:{server.server_address[1]}/hook"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield rec
    finally:
        server.shutdown()
        server.server_close()
