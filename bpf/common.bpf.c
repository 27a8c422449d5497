/* fleetd: maps and helpers every layer shares. Compiled as one unit with the
 * layers (see fleetd/trace/bpf/bpfsrc.py), so the target set and histograms are shared.
 *
 * Parameters (all -D, with defaults here):
 *   FL_TRACER_PID      our own tgid, never traced
 *   FL_SYSTEM_WIDE     1: any process calling CUDA becomes a target
 *   FL_CGROUPS         1: a task in a cgroup listed in fl_cgroups becomes a target
 *   FL_SAMPLE_N        emit 1 in N ordinary calls (1 = all, 0 = none)
 *   FL_SLOW_K          a call slower than K x its running median is an anomaly
 *   FL_SLOW_MIN_NS     ... if it also took at least this long
 *   FL_ERR_BURST       errors emitted per (pid, op) per second before rate limiting
 *   FL_STACKS          1: user stacks (native, and Python where known) on CUDA records
 *   FL_STACK_SAMPLE_N  ... on 1 in N kept calls (0 = none by sampling)
 *   FL_STACK_SLOW_NS   ... and on every call at least this long (kept even if not sampled)
 *   FL_PY_FRAMES       Python frames read per stack (fleetd.h)
 *   FL_CALL_SLOTS      slots of the direct-mapped table of calls in flight
 *   FL_ONCPU           1: on-CPU sampling (oncpu.bpf.c), which reads Python frames too
 */
#ifndef FL_COMMON_BPF_C
#define FL_COMMON_BPF_C
#include <uapi/linux/ptrace.h>
#include "fleetd.h"

/* User-memory reads go through these, never through BCC's bpf_probe_read_user names:
 * BCC 0.26's rewriter looks /proc/kallsyms up (a scan of 100k+ symbols, ~60 ms of CPU)
 * at every call site of bpf_probe_read_user(_str), whose existence it checks for old
 * kernels; ours has both helpers (the tracer needs 5.8+ for ring buffers anyway). Same
 * helpers, same types as BCC's declarations: the instructions are identical, and a cold
 * compile is a second or more cheaper (bench/compile_cost.py). */
static int (*fl_read_user)(void *dst, __u32 size, const void *unsafe_ptr) =
    (void *)BPF_FUNC_probe_read_user;
static int (*fl_read_user_str)(void *dst, __u32 size, const void *unsafe_ptr) =
    (void *)BPF_FUNC_probe_read_user_str;

#ifndef FL_TRACER_PID
#define FL_TRACER_PID 0
#endif
#ifndef FL_SYSTEM_WIDE
#define FL_SYSTEM_WIDE 0
#endif
#ifndef FL_CGROUPS
#define FL_CGROUPS 0
#endif
#ifndef FL_SAMPLE_N
#define FL_SAMPLE_N 1
#endif
#ifndef FL_SLOW_K
#define FL_SLOW_K 8
#endif
#ifndef FL_SLOW_MIN_NS
#define FL_SLOW_MIN_NS 20000
#endif
#ifndef FL_ERR_BURST
#define FL_ERR_BURST 10
#endif
#ifndef FL_STACKS
#define FL_STACKS 0
#endif
#ifndef FL_STACK_SAMPLE_N
#define FL_STACK_SAMPLE_N 100
#endif
#ifndef FL_STACK_SLOW_NS
#define FL_STACK_SLOW_NS 1000000ull
#endif
#ifndef FL_RB_PAGES
#define FL_RB_PAGES 256
#endif
#ifndef FL_ONCPU
#define FL_ONCPU 0
#endif
/* The Python maps and walk serve the CUDA records' stacks and the on-CPU samples. */
#define FL_PYTHON (FL_STACKS || FL_ONCPU)
#define FL_MEDIAN_WARMUP 32

/* tgid -> how it became a target (1 = named, 2 = cgroup, 3 = CUDA user, 4 = child). */
BPF_HASH(fl_targets, u32, u32, 4096);
BPF_HASH(fl_cgroups, u64, u32, 64);
BPF_HASH(fl_hist, u64, struct fl_hist, 8192);
BPF_PERCPU_ARRAY(fl_hist_zero, struct fl_hist, 1);
BPF_PERCPU_ARRAY(fl_counters, u64, FL_NCOUNTERS);
/* [0] != 0: the tracer is stopping. Nothing changes after that, so the final drain,
 * histogram read and counters agree with each other. */
BPF_ARRAY(fl_ctl, u64, 1);
/* One ring buffer per layer; proc, block, irq and syscall share fl_rb_sys. All are
 * declared here because BCC does not allow map calls inside macros: fl_reserve()
 * picks one by a constant that the compiler folds at each call site. */
BPF_RINGBUF_OUTPUT(fl_rb_cuda, FL_RB_PAGES);
BPF_RINGBUF_OUTPUT(fl_rb_driver, FL_RB_PAGES);
BPF_RINGBUF_OUTPUT(fl_rb_nccl, FL_RB_PAGES);
BPF_RINGBUF_OUTPUT(fl_rb_sched, FL_RB_PAGES);
BPF_RINGBUF_OUTPUT(fl_rb_sys, FL_RB_PAGES);
#if FL_STACKS
BPF_STACK_TRACE(fl_stacks, 4096);
#endif
#if FL_PYTHON
/* tgid -> the frame layout of its CPython; tid -> its PyThreadState. Both filled by
 * user space, which reads the interpreter's thread list (a thread calling through
 * ctypes has released the GIL, so the interpreter's "current" thread is not it). */
BPF_HASH(fl_pyprocs, u32, struct fl_pyoffs, 1024);
BPF_HASH(fl_pythreads, u32, u64, 16384);
#endif

static __always_inline void fl_count(u32 idx)
{
    u64 *v = fl_counters.lookup(&idx);
    if (v)
        *v += 1; /* per-CPU slot: no atomics needed */
}

/* A direct-mapped front of fl_targets. The host tracepoints fire for every task on the
 * machine and nearly all are not targets: one array read (inlined by the JIT, one
 * cache line) answers them instead of a hash lookup (two or three lines). A slot holds
 * tgid + 1 when that target wrote it last (a sure yes), 0 when no target ever mapped
 * there (a sure no), anything else: ask fl_targets. A target is added to the hash
 * first, then its slot written; removing one writes 1 first, then deletes it, so no
 * slot ever reads as a sure answer the hash would contradict. User space follows the
 * same order (tracer.py). */
#ifndef FL_SLOTS
#define FL_SLOTS 65536 /* a power of two */
#endif
BPF_ARRAY(fl_target_slots, u64, FL_SLOTS);

static __always_inline u64 *fl_slot(u32 tgid)
{
    u32 i = tgid & (FL_SLOTS - 1);
    return fl_target_slots.lookup(&i);
}

static __always_inline void fl_target_add(u32 tgid, u32 origin)
{
    if (fl_targets.update(&tgid, &origin)) {
        fl_count(FL_C_STATE_FULL);
        return;
    }
    u64 *s = fl_slot(tgid);
    if (s)
        *s = (u64)tgid + 1;
}

static __always_inline void fl_target_remove(u32 tgid)
{
    u64 *s = fl_slot(tgid);
    if (s && *s)
        *s = 1;
    fl_targets.delete(&tgid);
}

/* A named, discovered or already adopted target (no cgroup test: for events that do
 * not run in the task's own context). */
static __always_inline int fl_known_target(u32 tgid)
{
    if (tgid == FL_TRACER_PID || tgid == 0)
        return 0;
    u64 *s = fl_slot(tgid);
    u64 v = s ? *s : 1;
    if (v == (u64)tgid + 1)
        return 1;
    return v != 0 && fl_targets.lookup(&tgid) != 0;
}

/* A task the host layer follows: a named/discovered tgid, or one in a traced cgroup. */
static __always_inline int fl_is_target(u32 tgid)
{
    if (fl_known_target(tgid))
        return 1;
#if FL_CGROUPS
    if (tgid == FL_TRACER_PID || tgid == 0)
        return 0;
    u64 cg = bpf_get_current_cgroup_id();
    if (fl_cgroups.lookup(&cg)) {
        fl_target_add(tgid, 2);
        return 1;
    }
#endif
    return 0;
}

/* For CUDA probes: system-wide mode makes every caller a target, so that the host
 * layer follows the GPU-feeding processes from their first CUDA call on. */
static __always_inline int fl_is_cuda_target(u32 tgid)
{
    if (fl_is_target(tgid))
        return 1;
#if FL_SYSTEM_WIDE
    if (tgid == FL_TRACER_PID || tgid == 0)
        return 0;
    fl_target_add(tgid, 3);
    return 1;
#else
    return 0;
#endif
}

/* floor(log2(v)) for v >= 1, clamped to the last bucket. */
static __always_inline u32 fl_bucket(u64 v)
{
    u32 b = 0;
    if (v == 0)
        return 0;
    b = bpf_log2l(v) - 1; /* bcc's bpf_log2l counts bits */
    if (b >= FL_NBUCKETS)
        b = FL_NBUCKETS - 1;
    return b;
}

static __always_inline int fl_stopped(void)
{
    int k = 0;
    u64 *v = fl_ctl.lookup(&k);
    return v && *v;
}

static __always_inline struct fl_hist *fl_hist_get(u32 tgid, u32 op)
{
    if (fl_stopped())
        return 0;
    u64 key = ((u64)tgid << 32) | op;
    struct fl_hist *h = fl_hist.lookup(&key);
    if (h)
        return h;
    int zero = 0;
    /* The zero value lives in a map: at 680 bytes it does not fit the BPF stack. */
    struct fl_hist *z = fl_hist_zero.lookup(&zero);
    if (!z)
        return 0;
    fl_hist.insert(&key, z);
    h = fl_hist.lookup(&key);
    if (!h)
        fl_count(FL_C_HIST_FULL);
    return h;
}

/* Add one sample to a histogram; bucket < 0 means log2 of the value. */
static __always_inline struct fl_hist *fl_hist_add(u32 tgid, u32 op, u64 value, int bucket)
{
    struct fl_hist *h = fl_hist_get(tgid, op);
    if (!h)
        return 0;
    u32 b = bucket < 0 ? fl_bucket(value) : (u32)bucket;
    if (b >= FL_NBUCKETS)
        b = FL_NBUCKETS - 1;
    __sync_fetch_and_add(&h->count, 1);
    __sync_fetch_and_add(&h->sum, value);
    __sync_fetch_and_add(&h->b[b].count, 1);
    __sync_fetch_and_add(&h->b[b].sum, value);
    return h;
}

/* The duration half of fl_hist_add, for a call already counted at its entry (an
 * entry-only launch whose return was sampled): its bucket and sum, not its count. So
 * count - sum(bucket counts) is the number of calls that ran without a return probe. */
static __always_inline void fl_hist_time(struct fl_hist *h, u64 value)
{
    u32 b = fl_bucket(value);
    if (b >= FL_NBUCKETS)
        b = FL_NBUCKETS - 1;
    __sync_fetch_and_add(&h->sum, value);
    __sync_fetch_and_add(&h->b[b].count, 1);
    __sync_fetch_and_add(&h->b[b].sum, value);
}

/* Running median by a multiplicative step (frugal streaming): constant memory, one
 * read-modify-write per call. Races between threads of one process only blur it.
 * Returns FL_WHY_SLOW when this call is an outlier against the estimate before it. */
static __always_inline u32 fl_median_check(struct fl_hist *h, u64 dur)
{
    u64 m = h->median;
    u32 why = 0;
    if (h->count > FL_MEDIAN_WARMUP && dur >= FL_SLOW_MIN_NS && m > 0 && dur > m * FL_SLOW_K)
        why = FL_WHY_SLOW;
    if (m == 0)
        m = dur;
    else if (dur > m)
        m += (m >> 4) + 1;
    else if (dur < m)
        m -= (m >> 4) + 1 > m ? m : (m >> 4) + 1;
    h->median = m;
    return why;
}

/* Errors are anomalies, but a call failing 20k times a second would flood the ring:
 * emit a new error code at once and at most FL_ERR_BURST per second per (pid, op). */
static __always_inline u32 fl_error_check(struct fl_hist *h, s32 ret, u64 now)
{
    if (ret == 0)
        return 0;
    __sync_fetch_and_add(&h->errors, 1);
    if (h->last_err != ret) {
        h->last_err = ret;
        h->err_window = now;
        h->err_in_window = 1;
        return FL_WHY_ERROR;
    }
    if (now - h->err_window > 1000000000ull) {
        h->err_window = now;
        h->err_in_window = 0;
    }
    if (h->err_in_window < FL_ERR_BURST) {
        h->err_in_window += 1;
        return FL_WHY_ERROR;
    }
    return 0;
}

static __always_inline u32 fl_sample_pick(void)
{
#if FL_SAMPLE_N == 0
    return 0;
#elif FL_SAMPLE_N == 1
    return FL_WHY_SAMPLE;
#else
    u32 idx = FL_C_SAMPLE_TICK;
    u64 *tick = fl_counters.lookup(&idx);
    if (!tick)
        return FL_WHY_SAMPLE;
    *tick += 1;
    return (*tick % FL_SAMPLE_N) == 0 ? FL_WHY_SAMPLE : 0;
#endif
}

/* Reserve a record in a ring (FL_C_LOST_* doubles as the ring number) or count
 * the loss under that ring's counter. */
static __always_inline struct fl_rec *fl_reserve(u32 ring)
{
    struct fl_rec *r = 0;
    if (fl_stopped())
        return 0;
    switch (ring) {
    case FL_C_LOST_CUDA:
        r = fl_rb_cuda.ringbuf_reserve(sizeof(struct fl_rec));
        break;
    case FL_C_LOST_DRIVER:
        r = fl_rb_driver.ringbuf_reserve(sizeof(struct fl_rec));
        break;
    case FL_C_LOST_NCCL:
        r = fl_rb_nccl.ringbuf_reserve(sizeof(struct fl_rec));
        break;
    case FL_C_LOST_SCHED:
        r = fl_rb_sched.ringbuf_reserve(sizeof(struct fl_rec));
        break;
    default:
        r = fl_rb_sys.ringbuf_reserve(sizeof(struct fl_rec));
        break;
    }
    if (!r)
        fl_count(ring);
    return r;
}

#if FL_STACKS
/* The same for a record with its Python stack appended (GPU layers, and the wakeups
 * that carry their waker's stack on the scheduler ring). */
static __always_inline struct fl_rec_py *fl_reserve_py(u32 ring)
{
    struct fl_rec_py *r = 0;
    if (fl_stopped())
        return 0;
    switch (ring) {
    case FL_C_LOST_CUDA:
        r = fl_rb_cuda.ringbuf_reserve(sizeof(struct fl_rec_py));
        break;
    case FL_C_LOST_DRIVER:
        r = fl_rb_driver.ringbuf_reserve(sizeof(struct fl_rec_py));
        break;
    case FL_C_LOST_SCHED:
        r = fl_rb_sched.ringbuf_reserve(sizeof(struct fl_rec_py));
        break;
    default:
        r = fl_rb_nccl.ringbuf_reserve(sizeof(struct fl_rec_py));
        break;
    }
    if (!r)
        fl_count(ring);
    return r;
}
#endif

#ifndef FL_WAKE_EVERY
#define FL_WAKE_EVERY 256
#endif

/* Wake the consumer only every FL_WAKE_EVERY records per CPU; it also polls on a
 * short timer. Waking it for each record costs the traced process CPU time on small
 * machines (the tracer's threads compete with it), for no gain in what is recorded. */
static __always_inline void fl_submit(struct fl_rec *r)
{
    u32 idx = FL_C_WAKE_TICK;
    u64 *tick = fl_counters.lookup(&idx);
    u64 flags = BPF_RB_NO_WAKEUP;
    if (!tick || ((*tick += 1) % FL_WAKE_EVERY) == 0)
        flags = 0;
    /* Counted before the submit: a handler preempted between the two (a busy node)
     * must not hand over a record the count does not yet hold, which the tracer's
     * stop would read as more stored than emitted. */
    fl_count(FL_C_EMITTED);
    bpf_ringbuf_submit(r, flags);
}

static __always_inline void fl_fill(struct fl_rec *r, u64 ts, u64 dur, u32 pid, u32 tid,
                                    u32 op, s32 ret)
{
    r->ts = ts;
    r->dur = dur;
    r->pid = pid;
    r->tid = tid;
    r->op = op;
    r->ret = ret;
    r->bytes = 0;
    r->peer = 0;
    r->peer_pid = 0;
    r->a0 = 0;
    r->a1 = 0;
    r->stack = -1;
    r->flags = 0;
    r->x[0] = 0;
    r->x[1] = 0;
    r->x[2] = 0;
    r->x[3] = 0;
    r->median = 0;
    r->func = 0;
    __builtin_memset(r->comm, 0, FL_COMM_LEN);
}

/* ---- calls (CUDA runtime, driver, NCCL): entry stores the start, return decides ---- */

/* Calls in flight, direct-mapped by tid << 32 | op (so a library call that internally
 * calls another probed symbol does not clobber the outer one): an array slot is one
 * inlined read where a hash lookup walked a bucket and, being LRU, dirtied shared
 * state on every call (entry probe 196 -> 145 ns, return 239 -> 229 ns in the kernel's
 * BPF stats, bench/tracer_overhead.py).
 * A slot holds its call's key; a call whose slot another live call took (two threads
 * hashed alike, or a nested call of the same op) loses its start, counted once as
 * calls_full by the entry that took it. ts = 0 marks a slot free. */
#ifndef FL_CALL_SLOTS
#define FL_CALL_SLOTS 16384 /* a power of two */
#endif
BPF_ARRAY(fl_calls, struct fl_call, FL_CALL_SLOTS);

static __always_inline struct fl_call *fl_call_slot(u64 key)
{
    u32 i = (u32)((key * 0x9E3779B97F4A7C15ull) >> 40) & (FL_CALL_SLOTS - 1);
    return fl_calls.lookup(&i);
}

/* Entry of a call already known to be a target's: keep its start and arguments. */
static __always_inline int fl_call_store(struct pt_regs *ctx, u64 id, u32 op, u64 func,
                                         u64 bytes, s64 a0, s64 a1, u64 x0, u64 x1, u64 x2,
                                         u64 x3)
{
    u64 key = (id << 32) | op;
    struct fl_call *p = fl_call_slot(key);
    if (!p)
        return 0;
    if (p->ts && p->key != key)
        fl_count(FL_C_CALLS_FULL);
    p->key = key;
    p->sp = PT_REGS_SP(ctx);
    p->func = func;
    p->bytes = bytes;
    p->a0 = a0;
    p->a1 = a1;
    p->x[0] = x0;
    p->x[1] = x1;
    p->x[2] = x2;
    p->x[3] = x3;
    p->ts = bpf_ktime_get_ns(); /* last, so map work is not billed to the call */
    return 0;
}

/* Entry: keep the start time and arguments of a target's call (func: a launch's
 * kernel, else 0). */
static __always_inline int fl_call_enter_f(struct pt_regs *ctx, u32 op, u64 func, u64 bytes,
                                           s64 a0, s64 a1, u64 x0, u64 x1, u64 x2, u64 x3)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!fl_is_cuda_target(id >> 32))
        return 0;
    return fl_call_store(ctx, id, op, func, bytes, a0, a1, x0, x1, x2, x3);
}

static __always_inline int fl_call_enter(struct pt_regs *ctx, u32 op, u64 bytes, s64 a0,
                                         s64 a1, u64 x0, u64 x1, u64 x2, u64 x3)
{
    return fl_call_enter_f(ctx, op, 0, bytes, a0, a1, x0, x1, x2, x3);
}

/* Launch arguments passed on the stack, read only for records that are emitted: one
 * bpf_probe_read_user costs ~150 ns here, half of what a whole entry probe does.
 * They are read after the call, from the caller's outgoing-argument area (entry sp
 * + 8); a callee may in principle reuse those slots, the launch wrappers do not.
 *   cudaLaunchKernel(func, grid, block, args, sharedMem, stream)
 *   cuLaunchKernel(f, gx, gy, gz, bx, by, bz, sharedMem, stream, params, extra) */
struct fl_stack3 {
    u64 s[3];
};

static __always_inline void fl_stack_args(u32 op, struct fl_call *c, struct fl_rec *r)
{
    struct fl_stack3 st = {};
    if (op == OP_CUDALAUNCHKERNEL) {
        fl_read_user(&st, 16, (void *)(c->sp + 8));
        r->x[1] |= st.s[0] << 32;
        r->x[3] = st.s[1];
    } else if (op == OP_CULAUNCHKERNEL) {
        fl_read_user(&st, 24, (void *)(c->sp + 8));
        u64 bz = st.s[0] & 0xffff;
        r->a1 = r->a1 * bz;
        r->x[1] |= (bz << 16) | ((st.s[1] & 0xffffffff) << 32);
        r->x[3] = st.s[2];
    }
}

static __always_inline void fl_stack(struct pt_regs *ctx, struct fl_rec *r)
{
#if FL_STACKS
    int sid = fl_stacks.get_stackid(ctx, BPF_F_USER_STACK);
    if (sid < 0)
        fl_count(FL_C_STACK_LOST);
    r->stack = sid;
#endif
}

#if FL_STACKS
/* Whether a kept call carries a stack: every slow one, and 1 in FL_STACK_SAMPLE_N. */
static __always_inline int fl_stack_wanted(u64 dur)
{
    if (dur >= FL_STACK_SLOW_NS)
        return 1;
#if FL_STACK_SAMPLE_N == 0
    return 0;
#elif FL_STACK_SAMPLE_N == 1
    return 1;
#else
    u32 idx = FL_C_STACK_TICK;
    u64 *tick = fl_counters.lookup(&idx);
    if (!tick)
        return 0;
    *tick += 1;
    return (*tick % FL_STACK_SAMPLE_N) == 0;
#endif
}

#endif

#if FL_PYTHON
/* The calling thread's Python frames, innermost first, read from the interpreter's
 * frame chain while the call is still on it (this runs before the call returns to
 * the interpreter). Each frame costs three small reads. */
static __always_inline void fl_py_walk(u32 tgid, u32 tid, struct fl_pystack *py)
{
    py->n = 0;
    py->status = FL_PY_NONE;
    struct fl_pyoffs *o = fl_pyprocs.lookup(&tgid);
    if (!o)
        return;
    u64 *ts = fl_pythreads.lookup(&tid);
    if (!ts) {
        py->status = FL_PY_NO_THREAD;
        fl_count(FL_C_PY_LOST);
        return;
    }
    u64 frame = 0;
    fl_read_user(&frame, 8, (void *)(*ts + o->tstate_frame));
    if (o->cframe_frame != FL_PY_DIRECT && frame)
        fl_read_user(&frame, 8, (void *)(frame + o->cframe_frame));
    u32 n = 0;
#pragma unroll
    for (int i = 0; i < FL_PY_FRAMES + 4; i++) {
        if (!frame || n >= FL_PY_FRAMES)
            break;
        u8 owner = 0;
        fl_read_user(&owner, 1, (void *)(frame + o->owner));
        if (owner != o->owner_skip || o->owner_skip == 0xff) {
            u32 k = n & (FL_PY_FRAMES - 1);
            fl_read_user(&py->f[k].code, 8, (void *)(frame + o->code));
            fl_read_user(&py->f[k].instr, 8, (void *)(frame + o->instr));
            n++;
        }
        fl_read_user(&frame, 8, (void *)(frame + o->previous));
    }
    py->n = n;
    py->status = frame ? FL_PY_DEEPER : FL_PY_OK;
}
#endif

/* ---- NCCL state the return side needs (the probes are in nccl.bpf.c) ----
 *
 * Sequence numbers, counted at the call's entry so that a record lost later does not
 * shift the numbers after it: collectives per (tgid, communicator) with op = peer = 0,
 * send/recv per (tgid, communicator, op, peer). LRU, so the keys of processes that are
 * gone make room for new ones on a long-running agent; a key in use is looked up on
 * every call and stays. A communicator handle is used by one thread at a time (NCCL
 * requires it), so a plain increment is enough. */
struct fl_nccl_key {
    u64 comm;
    u32 tgid;
    u32 op;
    s64 peer;
};
BPF_TABLE("lru_hash", struct fl_nccl_key, u64, fl_nccl_seq, 16384);

/* The created communicator of a successful (or, non-blocking, in-progress) init or
 * split: read through the out pointer kept at entry in x1, which becomes the handle.
 * A fresh handle starts its collective count again (the address may be a destroyed
 * communicator's). */
static __always_inline void fl_nccl_created(u32 tgid, struct fl_call *c, s32 ret)
{
    u64 comm = 0;
    if ((ret == 0 || ret == 7 /* ncclInProgress */) && c->x[1])
        fl_read_user(&comm, sizeof(comm), (void *)c->x[1]);
    c->x[1] = comm;
    if (comm) {
        struct fl_nccl_key k = {.comm = comm, .tgid = tgid};
        fl_nccl_seq.delete(&k);
    }
}

/* Return: histogram always; a record when the call is an anomaly, belongs to an
 * always-emitted class, or is in the sample. counted: the call's entry already counted
 * it (fl_launch_entry), so only its duration goes into the histogram. */
static __always_inline int fl_call_exit(struct pt_regs *ctx, u32 op, u32 always, u32 ring,
                                        u32 counted)
{
    u64 now = bpf_ktime_get_ns();
    u64 id = bpf_get_current_pid_tgid();
    u64 key = (id << 32) | op;
    struct fl_call *c = fl_call_slot(key);
    if (!c || c->ts == 0 || c->key != key)
        return 0; /* not a target, or its start was lost (counted at entry) */
    u32 tgid = id >> 32;
    u64 start = c->ts;
    u64 dur = now - start;
    c->ts = 0; /* done: a return without a fresh entry is ignored */
    s32 ret = (s32)PT_REGS_RC(ctx);
    if (FL_OPS_NCCL_COMM_RETURNS(op))
        fl_nccl_created(tgid, c, ret);
    /* Always-emitted classes (NCCL among them) are never dropped by the error budget:
     * FL_WHY_ALWAYS alone keeps the record, errors only add a flag. */
    u32 why = always ? FL_WHY_ALWAYS : 0;
    struct fl_hist *h = counted ? fl_hist_get(tgid, op) : fl_hist_add(tgid, op, dur, -1);
    if (h && counted)
        fl_hist_time(h, dur);
    if (h) {
        why |= fl_median_check(h, dur);
        why |= fl_error_check(h, ret, now);
    }
#if FL_STACKS
    /* With stacks on, a call past the stack threshold is kept whatever its median. */
    if (!why && dur >= FL_STACK_SLOW_NS)
        why = FL_WHY_SLOW;
#endif
    /* An entry-only launch drew its sample at entry (that is why its return ran). */
    if (!why)
        why = counted ? (c->sampled ? FL_WHY_SAMPLE : 0) : fl_sample_pick();
    if (!why) {
        fl_count(FL_C_SAMPLED_OUT);
        return 0;
    }
    struct fl_rec *r = 0;
#if FL_STACKS
    struct fl_rec_py *rp = 0;
    if (fl_stack_wanted(dur)) {
        rp = fl_reserve_py(ring);
        if (!rp)
            return 0;
        r = &rp->r;
    } else {
        r = fl_reserve(ring);
    }
#else
    r = fl_reserve(ring);
#endif
    if (!r)
        return 0;
    fl_fill(r, start, dur, tgid, (u32)id, op, ret);
    r->bytes = c->bytes;
    r->a0 = c->a0;
    r->a1 = c->a1;
    r->x[0] = c->x[0];
    r->x[1] = c->x[1];
    r->x[2] = c->x[2];
    r->x[3] = c->x[3];
    r->flags = why;
    fl_stack_args(op, c, r);
    if (h)
        r->median = h->median;
    r->func = c->func;
#if FL_STACKS
    if (rp) {
        fl_stack(ctx, r);
        fl_py_walk(tgid, (u32)id, &rp->py);
    }
#endif
    fl_submit(r);
    return 0;
}

/* ---- entry-only launches (uprobe sessions, Linux 6.13+) ----
 *
 * Launch-type calls (kernel launches, async copies) only enqueue work: their duration
 * and return code rarely matter, and the return probe (uretprobe trampoline plus, on
 * 6.11+, the return syscall) is about 40% of what tracing one costs. A session link
 * runs one program at entry and, only if that entry returns 0, again at the return.
 * fl_launch_pick counts the call at entry; its start and arguments are stored
 * (fl_enter_<OP>, as for any call) and its return is taken only when
 *   - it is in the 1-in-FL_SAMPLE_N sample: every stored launch record still comes from
 *     a return, so it has a measured duration and return code (none is a fake 0), and
 *     the histogram's buckets hold the durations of this uniform sample;
 *   - or its (process, op) failed recently: after a failure seen on a sampled return,
 *     returns are taken until this second's error budget (FL_ERR_BURST records) is
 *     spent, so a failing launch streak gives the same error records as with every
 *     return probed. What is missed: a failure before the first sampled one of its
 *     streak, and an isolated failure among successes, unless it is in the sample.
 * Otherwise the call ends here (counted as sampled_out) and its return is skipped. */
#ifndef FL_ERR_WINDOW_NS
#define FL_ERR_WINDOW_NS 1000000000ull /* fl_error_check's budget window */
#endif

static __always_inline int fl_err_open(struct fl_hist *h, u64 now)
{
    return h->last_err != 0 && now - h->err_window <= FL_ERR_WINDOW_NS &&
           h->err_in_window < FL_ERR_BURST;
}

/* Before anything is stored: count the call, and say whether its return is taken.
 * -1: not a target, or no histogram (counted as hist_full): skip it whole; 0: counted,
 * and its return skipped (counted as sampled_out): nothing else runs, so the common
 * launch pays one target check, one histogram lookup and two counters; 1: sampled;
 * 2: taken for the error budget. The entry's arguments are stored only for 1 and 2. */
static __always_inline int fl_launch_pick(u32 op)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!fl_is_cuda_target(tgid))
        return -1;
    struct fl_hist *h = fl_hist_get(tgid, op);
    if (!h)
        return -1;
    __sync_fetch_and_add(&h->count, 1);
    if (fl_sample_pick())
        return 1;
    if (h->last_err != 0 && fl_err_open(h, bpf_ktime_get_ns()))
        return 2;
    fl_count(FL_C_SAMPLED_OUT);
    return 0;
}

/* After fl_enter_<OP> stored a picked call: mark it as sampled or not, for its return
 * (fl_call_exit with counted = 1). 0: run the return half; 1: skip it (the entry stored
 * nothing after all, e.g. its slot was unavailable). */
static __always_inline int fl_launch_entry(u32 op, int pick)
{
    u64 key = (bpf_get_current_pid_tgid() << 32) | op;
    struct fl_call *c = fl_call_slot(key);
    if (!c || c->ts == 0 || c->key != key)
        return 1;
    c->sampled = pick == 1;
    return 0;
}

#endif /* FL_COMMON_BPF_C */
