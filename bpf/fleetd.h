/* fleetd: record layouts and constants shared by every BPF layer.
 *
 * The Python side (fleetd/trace/bpf/decoder.py) reads these records with a struct
 * format of the same layout; it passes the size it expects as -DFL_REC_SIZE and
 * the asserts below refuse to compile if C and Python ever drift apart.
 * Op codes arrive as -DOP_<NAME>=<code> generated from fleetd/store/catalog.py, with
 * its op families as tests: FL_OPS_<FAMILY>(op) is true when op is in the family (e.g.
 * FL_OPS_NCCL_P2P(op) for ncclSend/ncclRecv; the list is catalog.FAMILIES). Test a
 * family with its macro, never with a list of OP_ codes or a code range of its own.
 */
#ifndef FLEETD_H
#define FLEETD_H

#define FL_COMM_LEN 16
#define FL_NBUCKETS 40 /* log2(ns) buckets 0..39: the last one holds everything >= 9 min */

/* Why a record reached user space (fl_rec.flags): FL_WHY_SAMPLE (the 1-in-N sample of
 * ordinary calls), FL_WHY_SLOW (latency above k x the running median), FL_WHY_ERROR (a
 * call that returned an error, rate-limited per pid+op), FL_WHY_ALWAYS (sync, graph,
 * allocation, NCCL and lifecycle events). Their bits arrive as -D flags from
 * fleetd/trace/bpf/bpfsrc.py (WHY), which the decoder reads the records with. */
#ifndef FL_WHY_SLOW
#error "FL_WHY_* and the op codes come from fleetd.trace.bpf.bpfsrc.cflags()"
#endif

/* Indices into the per-CPU fl_counters array; names in fleetd/trace/bpf/bpfsrc.py. */
#define FL_C_LOST_CUDA 0     /* ring buffer full: runtime + graph records lost */
#define FL_C_LOST_DRIVER 1
#define FL_C_LOST_NCCL 2
#define FL_C_LOST_SCHED 3
#define FL_C_LOST_SYS 4      /* proc, block, irq, syscall */
#define FL_C_CALLS_FULL 5    /* call start lost: its in-flight slot taken by another */
#define FL_C_HIST_FULL 6     /* histogram map full: the call is missing from aggregates */
#define FL_C_SAMPLED_OUT 7   /* kept only in histograms, by design */
#define FL_C_STACK_LOST 8
#define FL_C_EMITTED 9
#define FL_C_SAMPLE_TICK 10  /* the sampling counter itself */
#define FL_C_STATE_FULL 11   /* host state maps full (off-CPU, syscall, block, targets) */
#define FL_C_WAKE_TICK 12    /* records since the consumer was last woken, per CPU */
#define FL_C_STACK_TICK 13   /* the stack sampling counter (1 in FL_STACK_SAMPLE_N kept calls) */
#define FL_C_PY_LOST 14      /* a Python process's call whose frames could not be read */
#define FL_C_WAKE_STACK 15   /* wakeups whose waker's stack was taken (host.bpf.c) */
#define FL_C_WAKE_STACK_SKIP 16 /* ... and those left without one by the rate limit */
#define FL_C_LOST_CPU 17     /* on-CPU samples the ring had no room for (oncpu.bpf.c) */
#define FL_NCOUNTERS 18

/* One record per emitted event, for every layer: fixed size keeps decoding cheap. */
struct fl_rec {
    u64 ts;        /* CLOCK_MONOTONIC ns of the start */
    u64 dur;       /* ns; 0 for instants */
    u32 pid;       /* tgid */
    u32 tid;
    u32 op;        /* catalog code */
    s32 ret;       /* return code / error */
    u64 bytes;
    u32 peer;      /* the other task's tid */
    u32 peer_pid;  /* its tgid when known in the kernel, else 0 */
    s64 a0;
    s64 a1;
    s32 stack;     /* stack map id, -1 = none */
    u32 flags;     /* FL_WHY_* */
    u64 x[4];      /* op-specific extras (dims, stream, handles) */
    u64 median;    /* the op's running median (ns) at emit time, 0 = unknown */
    u64 func;      /* launches: the kernel (host stub address, or the CUfunction) */
    char comm[FL_COMM_LEN]; /* the peer's comm (sched), or our own (exec) */
};

/* The Python call stack of a stacked CUDA record, appended to it in the ring (the
 * record is then longer than struct fl_rec): per frame the code object and the
 * instruction pointer, innermost first; user space turns them into file:line. */
#ifndef FL_PY_FRAMES
#define FL_PY_FRAMES 32
#endif
#define FL_PY_NONE 0      /* not a Python process fleetd knows the layout of */
#define FL_PY_OK 1
#define FL_PY_NO_THREAD 2 /* a thread the last scan of the interpreter did not list */
#define FL_PY_DEEPER 3    /* the stack was cut at FL_PY_FRAMES */
struct fl_pyframe {
    u64 code;
    u64 instr;
};
struct fl_pystack {
    u32 n;
    u32 status;  /* FL_PY_* */
    struct fl_pyframe f[FL_PY_FRAMES];
};
struct fl_rec_py {
    struct fl_rec r;
    struct fl_pystack py;
};

/* Where one CPython version keeps the current frame and the frame's fields, filled
 * per process by user space (fleetd/trace/enrich/pyframes.py: a measured table for 3.10-3.12,
 * the process's own _Py_DebugOffsets from 3.13). */
#define FL_PY_DIRECT 0xffffffffu /* tstate_frame already is the current frame (3.10, 3.13+) */
struct fl_pyoffs {
    u32 tstate_frame;  /* PyThreadState: frame (3.10), cframe (3.11, 3.12), current_frame (3.13) */
    u32 cframe_frame;  /* _PyCFrame.current_frame, or FL_PY_DIRECT */
    u32 code;          /* _PyInterpreterFrame: f_code (f_executable in 3.13); 3.10's PyFrameObject */
    u32 previous;      /* previous (f_back in 3.10) */
    u32 instr;         /* prev_instr (3.11, 3.12), instr_ptr (3.13); 3.10: f_lasti, an int
                        * index (the 8-byte read takes f_lineno too: user space keeps the
                        * low half) */
    u32 owner;         /* the owner byte */
    u32 owner_skip;    /* owner value of frames that are no Python code (C-stack shims) */
    u32 pad;
};

/* A call in flight, keyed by tid << 32 | op. */
struct fl_call {
    u64 ts;     /* 0: no call in flight in this slot */
    u64 key;    /* tid << 32 | op of the call that holds the slot */
    u64 sp;     /* stack pointer at entry: stack arguments are read only if emitted */
    u64 func;   /* launches: the kernel function */
    u64 bytes;
    s64 a0;
    s64 a1;
    u64 x[4];
    u32 sampled; /* entry-only launches: 1 if the entry drew this call for the sample */
    u32 pad;
};

struct fl_bucket {
    u64 count;
    u64 sum;
};

/* Per (tgid, op): latency histogram plus the state behind emit decisions. */
struct fl_hist {
    u64 count;
    u64 sum;
    u64 errors;
    u64 median;      /* running median estimate, ns */
    u64 err_window;  /* start of the current error-budget window, ns */
    u32 err_in_window;
    s32 last_err;
    /* A bucket's count beside its sum: one cache line per call, not two. */
    struct fl_bucket b[FL_NBUCKETS];
};

#ifdef FL_REC_SIZE
_Static_assert(sizeof(struct fl_rec) == FL_REC_SIZE, "fl_rec layout differs from decoder.py");
#endif
#ifdef FL_HIST_SIZE
_Static_assert(sizeof(struct fl_hist) == FL_HIST_SIZE, "fl_hist layout differs from bpfsrc.py");
#endif

#endif /* FLEETD_H */
