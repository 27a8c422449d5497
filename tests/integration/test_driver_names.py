"""Kernel names of driver-API launches (cuLaunchKernel), through the real BPF probes.

Without a GPU the real driver (libcuda.so.1) cannot load a module, so nothing would
ever hand out a CUfunction to name. The driver here is a TEST DOUBLE: a libcuda.so.1
built with gcc in the test, exporting cuModuleGetFunction, cuLibraryGetKernel,
cuKernelGetFunction and cuLaunchKernel with the driver's signatures; it hands out
handles and returns CUDA_SUCCESS. What is real and measured is fleetd's side: the
tracer discovers the library in the process, attaches its uprobes, the name probes
file each handle's name as the driver returns it, and every recorded cuLaunchKernel
carries the name of the kernel it launched.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_trace import _bpf_ready

_WHY = _bpf_ready()
pytestmark = [pytest.mark.bpf, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

FAKE_DRIVER = r"""
/* Test double of the CUDA driver: handles out, CUDA_SUCCESS back. */
typedef int CUresult;
typedef struct CUfunc_st *CUfunction;
typedef struct CUmod_st *CUmodule;
typedef struct CUlib_st *CUlibrary;
typedef struct CUkern_st *CUkernel;
typedef struct CUstream_st *CUstream;
static char functions[64], kernels[64];
static int nf, nk;
CUresult cuInit(unsigned int flags) { (void)flags; return 0; }
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name)
{ (void)m; (void)name; *f = (CUfunction)&functions[nf++ % 32]; return 0; }
CUresult cuLibraryGetKernel(CUkernel *k, CUlibrary l, const char *name)
{ (void)l; (void)name; *k = (CUkernel)&kernels[nk++ % 64]; return 0; }
CUresult cuKernelGetFunction(CUfunction *f, CUkernel k)
{ *f = (CUfunction)&functions[32 + ((char *)k - kernels) % 32]; return 0; }
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shm, CUstream s, void **p,
                        void **e)
{ (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shm;
  (void)s; (void)p; (void)e; return 0; }
"""

CALLER = r"""
import ctypes, json, os, sys, time
lib = ctypes.CDLL(sys.argv[1])
go = sys.argv[2]
print(json.dumps({"pid": os.getpid()}), flush=True)
while not os.path.exists(go):
    time.sleep(0.01)
u = ctypes.c_uint
def launch(f, n):
    for _ in range(n):
        assert lib.cuLaunchKernel(f, u(4), u(1), u(1), u(128), u(1), u(1), u(0), None,
                                  None, None) == 0
gemm, kern, attn = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
assert lib.cuModuleGetFunction(ctypes.byref(gemm), None, b"gemm_kernel") == 0
launch(gemm, 5)
assert lib.cuLibraryGetKernel(ctypes.byref(kern), None, b"attn_kernel") == 0
assert lib.cuKernelGetFunction(ctypes.byref(attn), kern) == 0
launch(attn, 3)
launch(gemm, 2)
time.sleep(0.5)
"""


def test_driver_launches_carry_the_kernel_name(tmp_path: Path) -> None:
    from fleetd.store.writer import BatchWriter
    from fleetd.trace.tracer import TraceConfig, Tracer

    src = tmp_path / "fake_cuda.c"
    src.write_text(FAKE_DRIVER)
    lib = tmp_path / "libcuda.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True)
    go, db = tmp_path / "go", tmp_path / "drv.db"
    caller = subprocess.Popen([sys.executable, "-c", CALLER, str(lib), str(go)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout is not None
        pid = json.loads(caller.stdout.readline())["pid"]
        writer = BatchWriter(db, "drv-node")
        tracer = Tracer(TraceConfig(db=db, node="drv-node", pids=[pid], sample=1,
                                    layers=frozenset({"driver"})), writer=writer)
        tracer.start()
        try:
            go.touch()
            deadline = time.monotonic() + 30
            while not tracer.targets_gone() and time.monotonic() < deadline:
                tracer.poll(50)
        finally:
            summary = tracer.stop()
            writer.close()
        assert caller.wait(30) == 0
    finally:
        if caller.poll() is None:
            caller.kill()
    assert summary.lost_total == 0
    with sqlite3.connect(db) as c:
        names = c.execute("SELECT json_extract(args, '$.kernel'), count(*) FROM events "
                          "WHERE op = 'cuLaunchKernel' GROUP BY 1 ORDER BY 1").fetchall()
    assert names == [("attn_kernel", 3), ("gemm_kernel", 7)]
