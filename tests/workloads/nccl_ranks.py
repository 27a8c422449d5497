"""A multi-rank NCCL workload over the REAL libnccl, via ctypes: one process per rank.

Each rank reads its identity from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID), so it runs under torchrun, one rank per
namespace host of the test bed, or as N local ranks started by ``--spawn N`` (which sets
that environment itself, on 127.0.0.1).

Rank 0 calls ncclGetUniqueId and hosts a tiny TCP coordinator at MASTER_ADDR:MASTER_PORT
that hands the id to the other ranks; every rank then calls ncclCommInitRank (or
ncclCommInitRankConfig, ``--init``), optionally ncclCommSplit (``--split``), and per step:
``--compute-ms`` of busy Python (plus ``--extra-ms-rank R:MS`` on rank R), one
collective (AllReduce, Broadcast, Reduce, AllGather, ReduceScatter in turn, or
``--ops``), a barrier over TCP, then cudaStreamSynchronize through the CUDA runtime
wheel when it loads. ``--mode ring`` replaces the collective by a send to the next rank
and a receive from the previous one inside ncclGroupStart/End. At the end
ncclCommDestroy.

Without a GPU no communicator is ever created: ncclCommInitRank returns 1 and leaves
the handle NULL, and every collective on the NULL handle returns 4 (invalid argument)
at once; the probes fire all the same. Since nothing on a GPU makes a rank wait for the
slowest one, the barrier after each collective keeps the ranks in lockstep (with a GPU,
that wait happens inside the stream sync that follows, which the workload also calls).

Each rank prints one JSON line at the end: its identity, the unique id it used (hex),
the init's result, and every NCCL call it made (op, count, dtype, redop, peer/root,
return code) with per-op counts, so a test can compare what was recorded. The
coordinator going away ends the other ranks (exit code 3), and every wait has a
deadline (``--barrier-timeout``, 120 s by default): no rank hangs forever.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import sysconfig
import threading
import time
from collections import Counter
from typing import Any

DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
          "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
SIZES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}
REDOPS = ("sum", "prod", "max", "min", "avg")
COLLECTIVES = ("ncclAllReduce", "ncclBroadcast", "ncclReduce", "ncclAllGather",
               "ncclReduceScatter")
SHORT = {"allreduce": "ncclAllReduce", "broadcast": "ncclBroadcast", "reduce": "ncclReduce",
         "allgather": "ncclAllGather", "reducescatter": "ncclReduceScatter"}
EXIT_PEER_GONE = 3


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def _site_roots() -> list[str]:
    roots = {sysconfig.get_paths()["purelib"], *[p for p in sys.path if "site-packages" in p]}
    return sorted(roots)


def find_nccl() -> str:
    """libnccl.so.2 from $FLEETD_NCCL, else the nvidia-nccl-cu12 wheel of this interpreter."""
    env = os.environ.get("FLEETD_NCCL")
    if env:
        return os.path.realpath(env)
    for root in _site_roots():
        hits = sorted(glob.glob(os.path.join(root, "nvidia/nccl/lib/libnccl.so*")))
        if hits:
            return os.path.realpath(hits[0])
    raise FileNotFoundError("libnccl.so.2 not found; pip install nvidia-nccl-cu12")


def find_cudart() -> str | None:
    """libcudart.so.12 from the nvidia-cuda-runtime-cu12 wheel, if installed."""
    for root in _site_roots():
        hits = sorted(glob.glob(os.path.join(root, "nvidia/cuda_runtime/lib/libcudart.so*")))
        if hits:
            return os.path.realpath(hits[0])
    return None


# ---- identity -----------------------------------------------------------------------------

class Identity:
    """torchrun's environment for this process."""

    def __init__(self, env: dict[str, str]) -> None:
        self.rank = int(env.get("RANK", "0"))
        self.world = int(env.get("WORLD_SIZE", "1"))
        self.local_rank = int(env.get("LOCAL_RANK", str(self.rank)))
        self.addr = env.get("MASTER_ADDR", "127.0.0.1")
        self.port = int(env.get("MASTER_PORT", "29500"))
        run_id = env.get("TORCHELASTIC_RUN_ID")
        self.job = run_id or f"{self.addr}:{self.port}"
        if not 0 <= self.rank < self.world:
            raise SystemExit(f"RANK {self.rank} is outside WORLD_SIZE {self.world}")


# ---- the coordinator: id distribution and barriers over TCP ---------------------------------

class PeerGone(Exception):
    """The coordinator (or a rank it waits for) closed its connection."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except ConnectionError as exc:
            raise PeerGone(str(exc)) from exc
        if not chunk:
            raise PeerGone("connection closed")
        buf += chunk
    return buf


class Coordinator:
    """Rank 0's side: accepts every other rank, sends each the unique id, and releases a
    barrier once all ranks have reached it (a star: N - 1 connections)."""

    def __init__(self, me: Identity, timeout: float) -> None:
        self.me, self.timeout = me, timeout
        self.server = socket.create_server((me.addr, me.port), reuse_port=False)
        self.server.settimeout(timeout)
        self.peers: dict[int, socket.socket] = {}

    def gather(self, unique_id: bytes) -> None:
        while len(self.peers) < self.me.world - 1:
            try:
                conn, _ = self.server.accept()
            except TimeoutError as exc:
                raise PeerGone(f"only {len(self.peers) + 1} of {self.me.world} ranks joined "
                               f"within {self.timeout:.0f} s") from exc
            conn.settimeout(self.timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            (rank,) = struct.unpack("<i", _recv_exact(conn, 4))
            self.peers[rank] = conn
        for conn in self.peers.values():
            conn.sendall(unique_id)

    def barrier(self) -> None:
        for conn in self.peers.values():
            try:
                _recv_exact(conn, 1)
            except TimeoutError as exc:
                raise PeerGone(f"a rank did not reach the barrier within {self.timeout:.0f} s"
                               ) from exc
        for conn in self.peers.values():
            conn.sendall(b"g")

    def close(self) -> None:
        for conn in self.peers.values():
            conn.close()
        self.server.close()


class Member:
    """Every other rank's side: one connection to rank 0."""

    def __init__(self, me: Identity, timeout: float) -> None:
        self.me, self.timeout = me, timeout
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.create_connection((me.addr, me.port), timeout=2.0)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise PeerGone(f"no coordinator at {me.addr}:{me.port}: {exc}") from exc
                time.sleep(0.05)
        self.sock.settimeout(timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(struct.pack("<i", me.rank))

    def unique_id(self) -> bytes:
        try:
            return _recv_exact(self.sock, 128)
        except TimeoutError as exc:
            raise PeerGone("the coordinator sent no unique id") from exc

    def barrier(self) -> None:
        try:
            self.sock.sendall(b"b")
            _recv_exact(self.sock, 1)
        except TimeoutError as exc:
            raise PeerGone(f"barrier not released within {self.timeout:.0f} s") from exc
        except (BrokenPipeError, ConnectionError) as exc:
            raise PeerGone(str(exc)) from exc

    def close(self) -> None:
        self.sock.close()


# ---- one rank -----------------------------------------------------------------------------

def _busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1000.0
    x = 0
    while time.perf_counter() < end:
        x += 1


class Rank:
    def __init__(self, a: argparse.Namespace, me: Identity) -> None:
        self.a, self.me = a, me
        self.nccl_path = a.nccl or find_nccl()
        self.nccl = ctypes.CDLL(self.nccl_path)
        self._prototypes()
        self.cudart_path = a.cudart or find_cudart()
        self.cudart = ctypes.CDLL(self.cudart_path) if self.cudart_path else None
        self.dtype = DTYPES[a.dtype]
        self.ops = [SHORT[o.strip().lower()] for o in a.ops.split(",") if o.strip()]
        self.calls: list[dict[str, Any]] = []
        self.counts: Counter[str] = Counter()
        self.syncs = 0
        self.extra_ms = 0.0
        if a.extra_ms_rank:
            r, ms = a.extra_ms_rank.split(":")
            if int(r) == me.rank:
                self.extra_ms = float(ms)
        self.buf: int | None = None

    def _prototypes(self) -> None:
        n = self.nccl
        vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        n.ncclGetUniqueId.argtypes = [ctypes.POINTER(UniqueId)]
        n.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), i, UniqueId, i]
        n.ncclCommInitRankConfig.argtypes = [ctypes.POINTER(vp), i, UniqueId, i, vp]
        n.ncclCommSplit.argtypes = [vp, i, i, ctypes.POINTER(vp), vp]
        n.ncclAllReduce.argtypes = [vp, vp, sz, i, i, vp, vp]
        n.ncclBroadcast.argtypes = [vp, vp, sz, i, i, vp, vp]
        n.ncclReduce.argtypes = [vp, vp, sz, i, i, i, vp, vp]
        n.ncclAllGather.argtypes = [vp, vp, sz, i, vp, vp]
        n.ncclReduceScatter.argtypes = [vp, vp, sz, i, i, vp, vp]
        n.ncclSend.argtypes = [vp, sz, i, i, vp, vp]
        n.ncclRecv.argtypes = [vp, sz, i, i, vp, vp]
        n.ncclCommDestroy.argtypes = [vp]
        for f in (n.ncclGetUniqueId, n.ncclCommInitRank, n.ncclCommInitRankConfig,
                  n.ncclCommSplit, n.ncclAllReduce, n.ncclBroadcast, n.ncclReduce,
                  n.ncclAllGather, n.ncclReduceScatter, n.ncclSend, n.ncclRecv,
                  n.ncclCommDestroy, n.ncclGroupStart, n.ncclGroupEnd):
            f.restype = ctypes.c_int

    def _note(self, op: str, ret: int, **kw: Any) -> None:
        self.counts[op] += 1
        self.calls.append({"op": op, "ret": ret, **kw})

    # -- set-up --

    def init(self, link: Coordinator | Member) -> dict[str, Any]:
        uid = UniqueId()
        if isinstance(link, Coordinator):
            ret = self.nccl.ncclGetUniqueId(ctypes.byref(uid))
            if ret != 0:
                raise SystemExit(f"ncclGetUniqueId failed: {ret}")
            link.gather(bytes(uid))  # all 128 bytes (.internal would stop at a NUL)
        else:
            ctypes.memmove(ctypes.byref(uid), link.unique_id(), 128)
        self.uid = bytes(uid)
        self.comm = ctypes.c_void_p(0)
        use_config = self.a.init == "config" or (self.a.init == "mixed" and self.me.rank % 2)
        op = "ncclCommInitRankConfig" if use_config else "ncclCommInitRank"
        if use_config:
            ret = self.nccl.ncclCommInitRankConfig(ctypes.byref(self.comm), self.me.world, uid,
                                                   self.me.rank, None)
        else:
            ret = self.nccl.ncclCommInitRank(ctypes.byref(self.comm), self.me.world, uid,
                                             self.me.rank)
        comm = self.comm.value or 0
        self._note(op, ret, nranks=self.me.world, rank=self.me.rank, comm=hex(comm))
        if comm and self.cudart is not None:  # a real communicator: real device buffers
            p = ctypes.c_void_p(0)
            nbytes = (self.a.count + self.a.steps + 1) * SIZES[self.dtype] * self.me.world
            if self.cudart.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(nbytes)) == 0:
                self.buf = p.value
        if self.a.split:
            new = ctypes.c_void_p(0)
            color, key = self.me.rank % 2, self.me.rank
            ret = self.nccl.ncclCommSplit(self.comm, color, key, ctypes.byref(new), None)
            self._note("ncclCommSplit", ret, color=color, key=key, parent=hex(comm),
                       comm=hex(new.value or 0))
        return {"op": op, "ret": ret, "comm": hex(comm)}

    # -- one step --

    def collective(self, step: int) -> None:
        op = self.ops[step % len(self.ops)]
        n, comm, dt = self.nccl, self.comm, self.dtype
        count = self.a.count + step  # differs per step: a record matches its call
        buf = self.buf
        root = step % self.me.world
        redop = REDOPS[step % len(REDOPS)] if self.a.redop == "cycle" else self.a.redop
        rop = REDOPS.index(redop)
        kw: dict[str, Any] = {"count": count, "dtype": self.a.dtype, "step": step}
        if op == "ncclAllReduce":
            ret = n.ncclAllReduce(buf, buf, count, dt, rop, comm, None)
            kw["redop"] = redop
        elif op == "ncclBroadcast":
            ret = n.ncclBroadcast(buf, buf, count, dt, root, comm, None)
            kw["root"] = root
        elif op == "ncclReduce":
            ret = n.ncclReduce(buf, buf, count, dt, rop, root, comm, None)
            kw.update(redop=redop, root=root)
        elif op == "ncclAllGather":
            ret = n.ncclAllGather(buf, buf, count, dt, comm, None)
        else:
            ret = n.ncclReduceScatter(buf, buf, count, dt, rop, comm, None)
            kw["redop"] = redop
        self._note(op, ret, **kw)

    def ring(self, step: int) -> None:
        n, comm, dt = self.nccl, self.comm, self.dtype
        count = self.a.count + step
        nxt, prev = (self.me.rank + 1) % self.me.world, (self.me.rank - 1) % self.me.world
        self._note("ncclGroupStart", n.ncclGroupStart())
        self._note("ncclSend", n.ncclSend(self.buf, count, dt, nxt, comm, None),
                   count=count, dtype=self.a.dtype, peer=nxt, step=step)
        self._note("ncclRecv", n.ncclRecv(self.buf, count, dt, prev, comm, None),
                   count=count, dtype=self.a.dtype, peer=prev, step=step)
        self._note("ncclGroupEnd", n.ncclGroupEnd())

    def sync(self) -> None:
        if self.cudart is not None:
            self.cudart.cudaStreamSynchronize(None)
            self.syncs += 1

    def run(self) -> int:
        a, me = self.a, self.me
        if a.go_file:
            print(json.dumps({"event": "ready", "rank": me.rank, "pid": os.getpid()}),
                  flush=True)
            deadline = time.monotonic() + a.barrier_timeout
            while not os.path.exists(a.go_file):
                if time.monotonic() > deadline:
                    print(f"rank {me.rank}: no go-file within {a.barrier_timeout} s",
                          file=sys.stderr)
                    return 2
                time.sleep(0.01)
        started = time.monotonic()
        step = 0
        status = 0
        error = ""
        link: Coordinator | Member | None = None
        init: dict[str, Any] = {}
        try:
            link = (Coordinator(me, a.barrier_timeout) if me.rank == 0
                    else Member(me, a.barrier_timeout))
            init = self.init(link)
            link.barrier()
            while True:
                if a.seconds > 0:
                    if time.monotonic() - started >= a.seconds:
                        break
                elif step >= a.steps:
                    break
                if a.compute_ms or self.extra_ms:
                    _busy(a.compute_ms + self.extra_ms)
                if a.mode == "ring":
                    self.ring(step)
                else:
                    self.collective(step)
                link.barrier()
                self.sync()
                if a.sleep_ms:  # the GPU's share of a step: the host waits, off CPU
                    time.sleep(a.sleep_ms / 1000)
                step += 1
            ret = self.nccl.ncclCommDestroy(self.comm)
            self._note("ncclCommDestroy", ret, comm=hex(self.comm.value or 0))
        except (PeerGone, OSError) as exc:  # OSError: timeouts and resets included
            status, error = EXIT_PEER_GONE, f"{type(exc).__name__}: {exc}"
        finally:
            if link is not None:
                link.close()
        elapsed = time.monotonic() - started
        summary = {
            "rank": me.rank, "world_size": me.world, "local_rank": me.local_rank,
            "job": me.job, "pid": os.getpid(), "tid": threading.get_native_id(),
            "nccl": self.nccl_path, "cudart": self.cudart_path, "unique_id": self.uid.hex()
            if hasattr(self, "uid") else None, "init": init, "steps": step,
            "elapsed_s": round(elapsed, 3), "syncs": self.syncs, "counts": dict(self.counts),
            "calls": self.calls if len(self.calls) <= a.max_listed else None,
            "error": error or None,
        }
        print(json.dumps(summary), flush=True)
        return status


# ---- the local launcher (--spawn N) -----------------------------------------------------

def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """A rank gets SIGTERM when its launcher dies (prctl PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)


def spawn(n: int, argv: list[str], addr: str) -> int:
    """Start n ranks on this host with torchrun's environment; relay their stdout;
    print one ``{"event": "ready", "pids": [...]}`` line once every rank reported ready
    (with --go-file). Returns non-zero if any rank failed."""
    env = dict(os.environ)
    env.setdefault("TORCHELASTIC_RUN_ID", f"nccl-ranks-{os.getpid()}")
    env.update(MASTER_ADDR=addr, MASTER_PORT=str(_free_port(addr)), WORLD_SIZE=str(n))
    procs = []
    for r in range(n):
        env_r = {**env, "RANK": str(r), "LOCAL_RANK": str(r)}
        procs.append(subprocess.Popen([sys.executable, __file__, *argv], env=env_r,
                                      stdout=subprocess.PIPE, text=True,
                                      preexec_fn=_die_with_parent))
    lock = threading.Lock()
    ready: list[int] = []

    def relay(p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            with lock:
                if line.startswith('{"event": "ready"'):
                    ready.append(json.loads(line)["pid"])
                    if len(ready) == n:
                        print(json.dumps({"event": "ready", "pids": ready}), flush=True)
                    continue
                sys.stdout.write(line)
                sys.stdout.flush()

    def stop(signum: int, _frame: Any) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    threads = [threading.Thread(target=relay, args=(p,), daemon=True) for p in procs]
    for t in threads:
        t.start()
    codes = [p.wait() for p in procs]
    for t in threads:
        t.join(5)
    return max((abs(c) for c in codes), default=0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spawn", type=int, default=0, metavar="N",
                   help="start N local ranks on --addr (sets RANK, WORLD_SIZE, ...)")
    p.add_argument("--addr", default="127.0.0.1", help="MASTER_ADDR for --spawn")
    p.add_argument("--nccl", default="", help="libnccl path (default: $FLEETD_NCCL, the wheel)")
    p.add_argument("--cudart", default="", help="libcudart path (default: the wheel's, if any)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seconds", type=float, default=0.0, help="run this long instead of --steps")
    p.add_argument("--compute-ms", type=float, default=0.0, help="busy Python per step")
    p.add_argument("--sleep-ms", type=float, default=0.0,
                   help="sleep per step after the sync (the GPU's share of the step)")
    p.add_argument("--extra-ms-rank", default="", metavar="R:MS",
                   help="rank R computes MS more per step")
    p.add_argument("--ops", default="allreduce,broadcast,reduce,allgather,reducescatter",
                   help="collectives to cycle through")
    p.add_argument("--mode", choices=("collectives", "ring"), default="collectives",
                   help="ring: send to the next rank, receive from the previous, per step")
    p.add_argument("--count", type=int, default=1024, help="elements (plus the step number)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--redop", choices=(*REDOPS, "cycle"), default="sum")
    p.add_argument("--init", choices=("rank", "config", "mixed"), default="rank",
                   help="ncclCommInitRank, ncclCommInitRankConfig, or config on odd ranks")
    p.add_argument("--split", action="store_true", help="also call ncclCommSplit after init")
    p.add_argument("--barrier-timeout", type=float, default=120.0,
                   help="seconds any wait for another rank may take")
    p.add_argument("--go-file", default="", help="wait for this file before the first call")
    p.add_argument("--max-listed", type=int, default=20000,
                   help="list every call in the summary up to this many")
    a = p.parse_args(argv)
    if a.spawn:
        rest: list[str] = []
        skip = False
        for i, arg in enumerate(argv):  # the ranks get every option but --spawn/--addr
            if skip:
                skip = False
                continue
            if arg in ("--spawn", "--addr"):
                skip = True
                continue
            if arg.startswith(("--spawn=", "--addr=")):
                continue
            rest.append(argv[i])
        return spawn(a.spawn, rest, a.addr)
    return Rank(a, Identity(dict(os.environ))).run()


if __name__ == "__main__":
    sys.exit(main())
