"""What an fd is and who holds its other end (fleetd.trace.enrich.fdpeers), on real pipes and
sockets of real processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from fleetd.trace.bpf.decoder import Batch
from fleetd.trace.enrich.fdpeers import FdNames, describe


def test_a_pipe_names_its_reader_process() -> None:
    r, w = os.pipe()
    reader = subprocess.Popen([sys.executable, "-c", "import sys,time; time.sleep(30)"],
                              stdin=r, pass_fds=())
    os.close(r)
    try:
        deadline = time.monotonic() + 10
        info = describe(os.getpid(), w)
        while time.monotonic() < deadline and not (info or {}).get("peers"):
            time.sleep(0.05)
            info = describe(os.getpid(), w)
        assert info is not None
        assert info["kind"] == "pipe" and info["path"] == f"pipe:[{os.fstat(w).st_ino}]"
        [mine] = [p for p in info["peers"] if p["pid"] == reader.pid]
        assert mine["mode"] == "r" and str(mine["comm"]).startswith("python")
        assert all(p["pid"] != os.getpid() for p in info["peers"])
    finally:
        reader.kill()
        reader.wait()
        os.close(w)


def test_a_tcp_socket_names_its_remote_address() -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as c:
            info = describe(os.getpid(), c.fileno())
            assert info is not None and info["kind"] == "socket"
            assert info["remote"] == f"127.0.0.1:{port}"
            assert info["local"] == f"127.0.0.1:{c.getsockname()[1]}"


def test_a_closed_fd_is_none() -> None:
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    assert describe(os.getpid(), w) is None


def test_waits_are_named_once_per_fd_a_second() -> None:
    """The tracer's side: the first wait on an fd gets ``args.fd``, the next ones in the
    same second do not (the analysis finds the name on any wait of that fd)."""
    r, w = os.pipe()
    try:
        names = FdNames()
        first = Batch(fd_waits=[(0, os.getpid(), w), (1, os.getpid(), w)])
        names.resolve(first)
        assert [row for row, _ in first.args] == [0]
        assert first.args[0][1]["fd"]["path"] == f"pipe:[{os.fstat(w).st_ino}]"
        again = Batch(fd_waits=[(0, os.getpid(), w)])
        names.resolve(again)
        assert again.args == []
    finally:
        os.close(r)
        os.close(w)
