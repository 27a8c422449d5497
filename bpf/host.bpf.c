/* fleetd: host tracepoints for the traced processes and their threads.
 *
 * Sub-layers, each on unless its -D flag is 0: FL_SCHED (off-CPU intervals with the
 * state the task left in, wakeups with the waker, run-queue waits), FL_MEM (page
 * allocations, aggregated in the kernel; with FL_VMSCAN, FL_MEMCG_RECLAIM and
 * FL_COMPACTION, set where the kernel has those tracepoints, the thread's own direct
 * reclaim, memcg reclaim and direct compaction stalls), FL_BLOCK (block requests
 * with latency, bytes, the task that submitted them and their time queued before
 * issue), FL_IRQ (hard/soft interrupts that preempted a traced thread), FL_SYSCALL
 * (system calls slower than a threshold; FL_NR_URETPROBE, the syscall our own
 * uretprobes return through, is never counted). Everything goes into the in-kernel
 * histograms; individual records only above the thresholds below.
 * With FL_STACKS (and FL_WAKE_STACKS), a wakeup of a traced thread by a Python thread
 * fleetd follows carries the waker's stack, taken at the wakeup, at most once per
 * (waker, woken) thread pair every FL_WAKE_STACK_NS.
 * Must be included before proc.bpf.c (it provides FL_FORGET_THREAD).
 */
#include "common.bpf.c"

#ifndef FL_SCHED
#define FL_SCHED 1
#endif
#ifndef FL_MEM
#define FL_MEM 1
#endif
#ifndef FL_BLOCK
#define FL_BLOCK 1
#endif
#ifndef FL_VMSCAN
#define FL_VMSCAN 0
#endif
#ifndef FL_MEMCG_RECLAIM
#define FL_MEMCG_RECLAIM 0
#endif
#ifndef FL_COMPACTION
#define FL_COMPACTION 0
#endif
#ifndef FL_KWORK
#define FL_KWORK 0 /* kernel work queued by traced threads (workqueue_queue_work) */
#endif
#ifndef FL_IRQ
#define FL_IRQ 1
#endif
#ifndef FL_SYSCALL
#define FL_SYSCALL 1
#endif
#ifndef FL_OFFCPU_MIN_NS
#define FL_OFFCPU_MIN_NS 50000
#endif
#ifndef FL_RUNQ_MIN_NS
#define FL_RUNQ_MIN_NS 50000
#endif
#ifndef FL_IRQ_MIN_NS
#define FL_IRQ_MIN_NS 20000
#endif
#ifndef FL_NR_URETPROBE
#define FL_NR_URETPROBE -1
#endif
#ifndef FL_SYSCALL_MIN_NS
#define FL_SYSCALL_MIN_NS 1000000
#endif
#ifndef FL_SCHED_KSTACKS
#define FL_SCHED_KSTACKS 1 /* wait channels of D-state waits */
#endif
#ifndef FL_BLOCK_MIN_NS
#define FL_BLOCK_MIN_NS 10000000
#endif
#ifndef FL_WAKE_STACKS
#define FL_WAKE_STACKS 1 /* with FL_STACKS: wakers' stacks on wakeup records */
#endif
#ifndef FL_WAKE_STACK_NS
#define FL_WAKE_STACK_NS 20000000ull /* one stack per (waker, woken) pair per this */
#endif

#define FL_STATE_MASK 0xffll /* above it: TASK_REPORT_MAX, set when preempted */


/* A traced thread that is off CPU, keyed by tid. LRU: a lost switch-in cannot leak. */
struct fl_off {
    u64 ts;     /* switched out */
    u64 wake;   /* became runnable: woken, or at once when preempted */
    s64 state;  /* prev_state as the tracepoint reports it */
    u32 pid;
    u32 peer;   /* who ran instead */
    u32 waker;
    u32 waker_pid;
    s64 sys_nr;   /* the syscall it was blocked in, + 1; 0 = none (user space, or no
                   * syscall tracing): the wait reason (futex, read, poll, nanosleep...) */
    u64 sys_arg;  /* that syscall's first argument: the futex word, the fd */
    s64 kstack;   /* kernel stack id + 1 of a D-state switch-out (its wait channel) */
    char peer_comm[FL_COMM_LEN];
    char waker_comm[FL_COMM_LEN];
};
BPF_TABLE("lru_hash", u32, struct fl_off, fl_off, 16384);

struct fl_sysc {
    u64 ts;
    s64 nr;
    u64 arg0;
};
BPF_TABLE("lru_hash", u32, struct fl_sysc, fl_sysc, 16384);

static __always_inline void fl_forget_thread(u32 tid)
{
    fl_off.delete(&tid);
    fl_sysc.delete(&tid);
}
#define FL_FORGET_THREAD(tid) fl_forget_thread(tid)

#if FL_SCHED
#if FL_SCHED_KSTACKS
/* Kernel stacks of D-state switch-outs only: the first frame past the scheduler is the
 * wait channel (the lock or I/O wait the thread sleeps in). Identical stacks share an
 * id, so a few hundred entries cover a workload's distinct waits. */
BPF_STACK_TRACE(fl_kstacks, 1024);
#endif

/* Which syscall a thread left the CPU in, and its first argument: a futex wait names
 * its lock word, a read or poll its fd. One lookup in the map the syscall probes keep
 * anyway; without syscall tracing the reason stays unknown (0). */
static __always_inline void fl_blocked_in(u32 tid, struct fl_off *o)
{
#if FL_SYSCALL
    struct fl_sysc *s = fl_sysc.lookup(&tid);
    if (s && s->ts) {
        o->sys_nr = s->nr + 1;
        o->sys_arg = s->arg0;
    }
#endif
}

#if FL_STACKS && FL_WAKE_STACKS
#define FL_WSTACKS 1
/* The stack of the thread that woke a traced one, taken at the wakeup (the waker is
 * current in sched_waking) and kept per woken thread until its switch-in writes the
 * wakeup record, which then carries it. For lock waits the waker is the thread that
 * released the lock: its frames say what it did while holding it. */
struct fl_wstack {
    u64 wake;   /* the wakeup it belongs to (fl_off.wake); 0 = used */
    s64 native; /* user stack id, -1 = none */
    struct fl_pystack py;
};
BPF_TABLE("lru_hash", u32, struct fl_wstack, fl_wstack, 1024);
BPF_PERCPU_ARRAY(fl_wstack_init, struct fl_wstack, 1); /* too big for the BPF stack */
/* (waker tid << 32 | woken tid) -> when the pair last got a stack: the rate limit. */
BPF_TABLE("lru_hash", u64, u64, fl_wstack_last, 4096);

/* Costs a stack walk and up to FL_PY_FRAMES x 3 user reads, so only where it can pay:
 * a sleep long enough to be recorded (its wakeup record is the only carrier), a waker
 * that is a Python thread of a process fleetd reads frames of, and at most one per
 * thread pair every FL_WAKE_STACK_NS (the rest are counted as skipped). */
static __always_inline void fl_waker_stack(void *ctx, u64 id, u32 tid, u64 slept, u64 now)
{
    u32 tgid = id >> 32, wtid = (u32)id;
    if (slept < FL_OFFCPU_MIN_NS)
        return;
    if (!fl_pyprocs.lookup(&tgid) || !fl_pythreads.lookup(&wtid))
        return;
    u64 pair = ((u64)wtid << 32) | tid;
    u64 *last = fl_wstack_last.lookup(&pair);
    if (last) {
        if (now - *last < FL_WAKE_STACK_NS) {
            fl_count(FL_C_WAKE_STACK_SKIP);
            return;
        }
        *last = now;
    } else if (fl_wstack_last.update(&pair, &now)) {
        fl_count(FL_C_STATE_FULL);
    }
    struct fl_wstack *w = fl_wstack.lookup(&tid);
    if (!w) {
        int zero = 0;
        struct fl_wstack *init = fl_wstack_init.lookup(&zero);
        if (!init)
            return;
        fl_wstack.update(&tid, init);
        w = fl_wstack.lookup(&tid);
        if (!w) {
            fl_count(FL_C_STATE_FULL);
            return;
        }
    }
    w->native = fl_stacks.get_stackid(ctx, BPF_F_USER_STACK);
    if (w->native < 0)
        fl_count(FL_C_STACK_LOST);
    fl_py_walk(tgid, wtid, &w->py);
    w->wake = now;
    fl_count(FL_C_WAKE_STACK);
}
#else
#define FL_WSTACKS 0
#endif

/* The wakeup that ended a recorded sleep: the waker, with its stack when one was taken
 * for this very wakeup (appended as in a stacked CUDA record). */
static __always_inline void fl_wakeup_rec(u32 tid, u32 pid, struct fl_off *o)
{
    struct fl_rec *r = 0;
    s32 native = -1;
#if FL_WSTACKS
    struct fl_wstack *w = fl_wstack.lookup(&tid);
    if (w && w->wake && w->wake == o->wake) {
        w->wake = 0;
        struct fl_rec_py *rp = fl_reserve_py(FL_C_LOST_SCHED);
        if (!rp)
            return;
        bpf_probe_read_kernel(&rp->py, sizeof(rp->py), &w->py);
        native = (s32)w->native;
        r = &rp->r;
    } else {
        r = fl_reserve(FL_C_LOST_SCHED);
    }
#else
    r = fl_reserve(FL_C_LOST_SCHED);
#endif
    if (!r)
        return;
    fl_fill(r, o->wake, 0, pid, tid, OP_WAKEUP, 0);
    r->peer = o->waker;
    r->peer_pid = o->waker_pid;
    __builtin_memcpy(r->comm, o->waker_comm, FL_COMM_LEN);
    r->stack = native;
    r->flags = FL_WHY_SLOW;
    fl_submit(r);
}

/* The task that gave the CPU back to a waiting thread (prev at its switch-in) held it
 * at the end of the wait: the culprit of run-queue time. Its tid goes in a1 and its
 * comm in x[0..1] of the off-CPU and run-queue records. */
static __always_inline void fl_ran_before(struct fl_rec *r, u32 prev, const char *comm)
{
    r->a1 = prev;
    bpf_probe_read_kernel(&r->x[0], FL_COMM_LEN, comm);
}

static __always_inline void fl_switch_in(u32 tid, u64 now, u32 prev, const char *prev_comm)
{
    struct fl_off *o = fl_off.lookup(&tid);
    if (!o)
        return;
    u64 dur = now - o->ts;
    u32 pid = o->pid;
    fl_hist_add(pid, OP_OFF_CPU, dur, -1);
    int emitted = 0;
    if (dur >= FL_OFFCPU_MIN_NS) {
        struct fl_rec *r = fl_reserve(FL_C_LOST_SCHED);
        if (r) {
            fl_fill(r, o->ts, dur, pid, tid, OP_OFF_CPU, (s32)o->sys_nr);
            r->bytes = o->sys_arg;
            r->a0 = o->state;
            r->peer = o->peer;
            __builtin_memcpy(r->comm, o->peer_comm, FL_COMM_LEN);
            fl_ran_before(r, prev, prev_comm);
            r->x[2] = o->kstack;
            r->flags = FL_WHY_SLOW;
            fl_submit(r);
            emitted = 1;
        }
        if (o->waker)
            fl_wakeup_rec(tid, pid, o);
    }
    if (o->wake && now >= o->wake) {
        u64 rq = now - o->wake;
        fl_hist_add(pid, OP_RUNQ_WAIT, rq, -1);
        if (rq >= FL_RUNQ_MIN_NS) {
            struct fl_rec *r = fl_reserve(FL_C_LOST_SCHED);
            if (r) {
                /* The run-queue tail of a sleep carries the sleep's syscall too, so
                 * the wait by reason can be told without its tail. */
                fl_fill(r, o->wake, rq, pid, tid, OP_RUNQ_WAIT, (s32)o->sys_nr);
                /* Woken: the waker; preempted: the task that took the CPU. */
                r->peer = o->waker ? o->waker : o->peer;
                r->peer_pid = o->waker ? o->waker_pid : 0;
                __builtin_memcpy(r->comm, o->waker ? o->waker_comm : o->peer_comm,
                                 FL_COMM_LEN);
                r->a0 = o->state;
                fl_ran_before(r, prev, prev_comm);
                r->flags = FL_WHY_SLOW;
                fl_submit(r);
            }
        }
    }
    (void)emitted;
    fl_off.delete(&tid);
}

TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 now = bpf_ktime_get_ns();
    u64 id = bpf_get_current_pid_tgid(); /* current is still prev here */
    u32 tgid = id >> 32, prev = args->prev_pid;
    if (prev != 0 && fl_is_target(tgid)) {
        struct fl_off o = {};
        o.ts = now;
        o.state = args->prev_state;
        o.pid = tgid;
        o.peer = args->next_pid;
        bpf_probe_read_kernel(o.peer_comm, FL_COMM_LEN, args->next_comm);
        fl_blocked_in(prev, &o);
#if FL_SCHED_KSTACKS
        if ((o.state & FL_STATE_MASK) & 2) { /* TASK_UNINTERRUPTIBLE */
            int kid = fl_kstacks.get_stackid(args, 0);
            if (kid >= 0)
                o.kstack = kid + 1;
            else
                fl_count(FL_C_STACK_LOST);
        }
#endif
        /* Left runnable (preempted or yielded): it waits in the run queue from now. */
        if ((o.state & FL_STATE_MASK) == 0)
            o.wake = now;
        if (fl_off.update(&prev, &o))
            fl_count(FL_C_STATE_FULL);
    }
    fl_switch_in(args->next_pid, now, prev, args->prev_comm);
    return 0;
}

static __always_inline int fl_wakeup(void *ctx, u32 tid)
{
    struct fl_off *o = fl_off.lookup(&tid);
    if (!o || o->wake)
        return 0;
    u64 id = bpf_get_current_pid_tgid(); /* current is the waker */
    u64 now = bpf_ktime_get_ns();
    o->wake = now;
    o->waker = (u32)id;
    o->waker_pid = id >> 32;
    bpf_get_current_comm(o->waker_comm, FL_COMM_LEN);
#if FL_WSTACKS
    fl_waker_stack(ctx, id, tid, now - o->ts, now);
#endif
    return 0;
}

/* sched_waking, not sched_wakeup: waking fires in the waker's own context, while a
 * wakeup of a task on another (idle) CPU is queued to that CPU and sched_wakeup then
 * fires from its interrupt, with the idle task as "current". Measured on the lock-wait
 * scenario: sched_wakeup named the waker for 16 of 96 D-state waits. */
TRACEPOINT_PROBE(sched, sched_waking)
{
    return fl_wakeup(args, args->pid);
}
#endif /* FL_SCHED */

#if FL_MEM
TRACEPOINT_PROBE(kmem, mm_page_alloc)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!fl_is_target(tgid))
        return 0;
    u32 order = args->order;
    /* Aggregated only: bucket = order, count = allocations, sum = pages. */
    fl_hist_add(tgid, OP_PAGE_ALLOC, 1ull << (order & 31), order & 31);
    return 0;
}
#endif

#if FL_VMSCAN || FL_MEMCG_RECLAIM || FL_COMPACTION
/* Memory stalls of a traced thread: direct reclaim (the whole machine short of free
 * pages), memcg reclaim (its cgroup at its memory limit: every charge over the limit
 * reclaims first) and direct compaction (a high-order allocation, e.g. a huge page).
 * The allocating thread does this work itself, on its own CPU time, before its
 * allocation returns. A thread at its cgroup's limit reclaims thousands of times a
 * second for tens of microseconds each, so stalls are summed per thread in the kernel
 * and one record carries a run of them, its op the kind (OP_DIRECT_RECLAIM,
 * OP_MEMCG_RECLAIM, OP_DIRECT_COMPACTION): ts = the first stall's start, dur = to the
 * last one's end, bytes = ns actually stalled, a0 = stalls, a1 = pages reclaimed. A run is sent once it spans FL_RECLAIM_SPAN_NS, when the
 * kind changes, or at once for a stall of FL_RECLAIM_SLOW_NS; what is left when
 * tracing stops the tracer reads from fl_reclaim itself (trace/host/memory.py). */
#ifndef FL_RECLAIM_SPAN_NS
#define FL_RECLAIM_SPAN_NS 10000000ull
#endif
#ifndef FL_RECLAIM_SLOW_NS
#define FL_RECLAIM_SLOW_NS 1000000ull
#endif
#define FL_RECLAIM_KINDS 3 /* 0 direct reclaim, 1 memcg reclaim, 2 direct compaction */

static __always_inline u32 fl_reclaim_op(s32 kind)
{
    return kind == 0 ? OP_DIRECT_RECLAIM : kind == 1 ? OP_MEMCG_RECLAIM : OP_DIRECT_COMPACTION;
}

struct fl_reclaim_run {
    u64 begin[FL_RECLAIM_KINDS]; /* start of the stall in progress, per kind (0 = none) */
    u64 first;    /* the run: first stall's start */
    u64 last;     /* ... last stall's end */
    u64 stall_ns;
    u64 stalls;
    u64 pages;
    u32 pid;
    s32 kind;     /* the run's kind */
};
BPF_TABLE("lru_hash", u32, struct fl_reclaim_run, fl_reclaim, 4096);

static __always_inline void fl_reclaim_begin(int kind)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!fl_is_target(tgid) || kind < 0 || kind >= FL_RECLAIM_KINDS)
        return;
    struct fl_reclaim_run *r = fl_reclaim.lookup(&tid);
    if (!r) {
        struct fl_reclaim_run z = {};
        z.pid = tgid;
        z.kind = kind;
        if (fl_reclaim.update(&tid, &z)) {
            fl_count(FL_C_STATE_FULL);
            return;
        }
        r = fl_reclaim.lookup(&tid);
        if (!r)
            return;
    }
    r->begin[kind] = bpf_ktime_get_ns();
}

/* Send the run as one record; it restarts only when the record was reserved (else the
 * stop-time read of the map still finds it). */
static __always_inline void fl_reclaim_flush(u32 tid, struct fl_reclaim_run *r)
{
    if (!r->stalls)
        return;
    struct fl_rec *rec = fl_reserve(FL_C_LOST_SYS);
    if (!rec)
        return;
    fl_fill(rec, r->first, r->last - r->first, r->pid, tid, fl_reclaim_op(r->kind), 0);
    rec->bytes = r->stall_ns;
    rec->a0 = r->stalls;
    rec->a1 = r->pages;
    rec->flags = FL_WHY_ALWAYS;
    fl_submit(rec);
    r->stalls = 0;
    r->stall_ns = 0;
    r->pages = 0;
}

static __always_inline void fl_reclaim_end(int kind, u64 pages)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    if (!fl_known_target(id >> 32) || kind < 0 || kind >= FL_RECLAIM_KINDS)
        return;
    struct fl_reclaim_run *r = fl_reclaim.lookup(&tid);
    if (!r || !r->begin[kind])
        return;
    if (fl_stopped()) /* frozen: the histograms stop here, and so do the runs */
        return;
    u64 now = bpf_ktime_get_ns();
    u64 start = r->begin[kind];
    u64 dur = now - start;
    r->begin[kind] = 0;
    fl_hist_add(r->pid, fl_reclaim_op(kind), dur, -1);
    if (r->stalls && r->kind != kind)
        fl_reclaim_flush(tid, r);
    if (!r->stalls) {
        r->first = start;
        r->kind = kind;
    }
    r->last = now;
    r->stall_ns += dur;
    r->stalls += 1;
    r->pages += pages;
    if (now - r->first >= FL_RECLAIM_SPAN_NS || dur >= FL_RECLAIM_SLOW_NS)
        fl_reclaim_flush(tid, r);
}
#endif

#if FL_VMSCAN
TRACEPOINT_PROBE(vmscan, mm_vmscan_direct_reclaim_begin)
{
    fl_reclaim_begin(0);
    return 0;
}

TRACEPOINT_PROBE(vmscan, mm_vmscan_direct_reclaim_end)
{
    fl_reclaim_end(0, args->nr_reclaimed);
    return 0;
}
#endif

#if FL_MEMCG_RECLAIM
TRACEPOINT_PROBE(vmscan, mm_vmscan_memcg_reclaim_begin)
{
    fl_reclaim_begin(1);
    return 0;
}

TRACEPOINT_PROBE(vmscan, mm_vmscan_memcg_reclaim_end)
{
    fl_reclaim_end(1, args->nr_reclaimed);
    return 0;
}
#endif

#if FL_COMPACTION
/* compact_zone in the allocating task (kcompactd is never a target): direct compaction. */
TRACEPOINT_PROBE(compaction, mm_compaction_begin)
{
    fl_reclaim_begin(2);
    return 0;
}

TRACEPOINT_PROBE(compaction, mm_compaction_end)
{
    fl_reclaim_end(2, 0);
    return 0;
}
#endif

#if FL_KWORK
/* Work a traced thread queues for the kernel's workers, counted per (thread, work
 * function): a kworker that then preempts the thread runs the thread's own work (its
 * reclaim's vmpressure notifications, say), not a neighbour's. User space reads the
 * counts with the histograms (trace/host/memory.py) and names the functions. */
struct fl_kwork_key {
    u32 tid;
    u32 pid;
    u64 func;
};
BPF_TABLE("lru_hash", struct fl_kwork_key, u64, fl_kwork, 4096);

TRACEPOINT_PROBE(workqueue, workqueue_queue_work)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!fl_known_target(id >> 32) || fl_stopped())
        return 0;
    struct fl_kwork_key k = {};
    k.tid = (u32)id;
    k.pid = id >> 32;
    k.func = (u64)args->function;
    u64 zero = 0;
    u64 *n = fl_kwork.lookup_or_try_init(&k, &zero);
    if (n)
        __sync_fetch_and_add(n, 1);
    else
        fl_count(FL_C_STATE_FULL);
    return 0;
}
#endif

#if FL_BLOCK
struct fl_bkey {
    u64 dev;
    u64 sector;
};
struct fl_bio {
    u64 ts;
    u64 queued;  /* ns from the bio's submission (block_bio_queue) to its issue */
    u32 pid;
    u32 tid;
    u64 bytes;
    char comm[FL_COMM_LEN];
    char rwbs[8];
};
BPF_TABLE("lru_hash", struct fl_bkey, struct fl_bio, fl_bio, 8192);

/* Whose request it is. block_rq_issue often runs in a kernel worker (kworker/N:MH
 * dispatching a scheduler's queue, mq-deadline or bfq), so the task current there is
 * no owner: a victim's own page-fault reads were recorded as the worker's, unseen
 * below FL_BLOCK_MIN_NS, and its D-state waits read as lock waits. block_bio_queue
 * fires as the submitting task hands its bio to the block layer, in that task, before
 * it may wait for a request slot behind others: its pid, tid and comm, kept by the
 * bio's first sector (the request's, unless merged in front) until the issue. */
struct fl_bowner {
    u64 ts;
    u32 pid;
    u32 tid;
    char comm[FL_COMM_LEN];
};
BPF_TABLE("lru_hash", struct fl_bkey, struct fl_bowner, fl_bowner, 8192);

TRACEPOINT_PROBE(block, block_bio_queue)
{
    struct fl_bkey k = {};
    k.dev = args->dev;
    k.sector = args->sector;
    u64 id = bpf_get_current_pid_tgid();
    struct fl_bowner o = {};
    o.ts = bpf_ktime_get_ns();
    o.pid = id >> 32;
    o.tid = (u32)id;
    bpf_get_current_comm(o.comm, FL_COMM_LEN);
    if (fl_bowner.update(&k, &o))
        fl_count(FL_C_STATE_FULL);
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_issue)
{
    struct fl_bkey k = {};
    k.dev = args->dev;
    k.sector = args->sector;
    u64 id = bpf_get_current_pid_tgid();
    struct fl_bio b = {};
    b.ts = bpf_ktime_get_ns();
    b.bytes = args->bytes;
    bpf_probe_read_kernel(b.rwbs, sizeof(b.rwbs), args->rwbs);
    struct fl_bowner *o = fl_bowner.lookup(&k);
    if (o && o->ts && o->ts <= b.ts) {
        b.pid = o->pid;
        b.tid = o->tid;
        b.queued = b.ts - o->ts;
        __builtin_memcpy(b.comm, o->comm, FL_COMM_LEN);
        fl_bowner.delete(&k);
    } else { /* issued without a recorded submission: the task that issued it */
        b.pid = id >> 32;
        b.tid = (u32)id;
        bpf_probe_read_kernel(b.comm, FL_COMM_LEN, args->comm);
    }
    if (fl_bio.update(&k, &b))
        fl_count(FL_C_STATE_FULL);
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_complete)
{
    struct fl_bkey k = {};
    k.dev = args->dev;
    k.sector = args->sector;
    struct fl_bio *b = fl_bio.lookup(&k);
    if (!b)
        return 0;
    u64 now = bpf_ktime_get_ns();
    u64 dur = now - b->ts;
    int target = fl_known_target(b->pid);
    /* Requests of other processes count too (pid 0 = the rest of the system): a
     * checkpoint writer or a noisy neighbour saturating the disk is a cause. */
    fl_hist_add(target ? b->pid : 0, OP_BLOCK_IO, dur, -1);
    if (target || dur >= FL_BLOCK_MIN_NS) {
        struct fl_rec *r = fl_reserve(FL_C_LOST_SYS);
        if (r) {
            fl_fill(r, b->ts, dur, b->pid, b->tid, OP_BLOCK_IO, args->error);
            r->bytes = b->bytes ? b->bytes : (u64)args->nr_sector * 512;
            r->a0 = k.dev;
            r->a1 = k.sector;
            __builtin_memcpy(&r->x[0], b->rwbs, 8);
            r->x[1] = b->queued;
            __builtin_memcpy(r->comm, b->comm, FL_COMM_LEN);
            r->flags = target ? FL_WHY_ALWAYS : FL_WHY_SLOW;
            fl_submit(r);
        }
    }
    fl_bio.delete(&k);
    return 0;
}
#endif

#if FL_IRQ
struct fl_irq {
    u64 ts;
    u32 pid;
    u32 tid;
    s64 num;
};
BPF_PERCPU_ARRAY(fl_irq_start, struct fl_irq, 2); /* 0: hard, 1: soft */

static __always_inline void fl_irq_enter(u32 slot, s64 num)
{
    struct fl_irq *s = fl_irq_start.lookup(&slot);
    if (!s)
        return;
    u64 id = bpf_get_current_pid_tgid(); /* the interrupted task */
    u32 tgid = id >> 32;
    if (!fl_is_target(tgid)) {
        s->ts = 0;
        return;
    }
    s->ts = bpf_ktime_get_ns();
    s->pid = tgid;
    s->tid = (u32)id;
    s->num = num;
}

static __always_inline void fl_irq_exit(u32 slot, u32 op)
{
    struct fl_irq *s = fl_irq_start.lookup(&slot);
    if (!s || s->ts == 0)
        return;
    u64 dur = bpf_ktime_get_ns() - s->ts;
    fl_hist_add(s->pid, op, dur, -1);
    if (dur >= FL_IRQ_MIN_NS) {
        struct fl_rec *r = fl_reserve(FL_C_LOST_SYS);
        if (r) {
            fl_fill(r, s->ts, dur, s->pid, s->tid, op, 0);
            r->a0 = s->num;
            r->flags = FL_WHY_SLOW;
            fl_submit(r);
        }
    }
    s->ts = 0;
}

TRACEPOINT_PROBE(irq, irq_handler_entry)
{
    fl_irq_enter(0, args->irq);
    return 0;
}

TRACEPOINT_PROBE(irq, irq_handler_exit)
{
    fl_irq_exit(0, OP_HARDIRQ);
    return 0;
}

TRACEPOINT_PROBE(irq, softirq_entry)
{
    fl_irq_enter(1, args->vec);
    return 0;
}

TRACEPOINT_PROBE(irq, softirq_exit)
{
    fl_irq_exit(1, OP_SOFTIRQ);
    return 0;
}
#endif

#if FL_SYSCALL
/* Raw tracepoints, not the raw_syscalls ones: a tracepoint program gets a record the
 * kernel first builds (copying the arguments out of the registers) for every syscall
 * of every task, where a raw one is called with the registers as they are. Every
 * traced CUDA call pays for syscall probes too, since its uretprobe returns through a
 * syscall (FL_NR_URETPROBE): the tracer with and without them cost +2,185 and +1,826 ns
 * per call (bench/tracer_overhead.py's rounds). Raw tracepoints took ~50 ns of that
 * back; the rest is the kernel's syscall slow path, which any syscall probe turns on.
 *   sys_enter: TP_PROTO(struct pt_regs *regs, long id)
 *   sys_exit:  TP_PROTO(struct pt_regs *regs, long ret) */
RAW_TRACEPOINT_PROBE(sys_enter)
{
    long nr = (long)ctx->args[1];
    /* Our own uretprobes return through this syscall: one per traced call, never the
     * program's latency. */
    if (nr == FL_NR_URETPROBE)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    if (!fl_is_target(id >> 32))
        return 0;
    struct pt_regs *regs = (struct pt_regs *)ctx->args[0];
    u64 arg0 = 0;
    bpf_probe_read_kernel(&arg0, sizeof(arg0), &PT_REGS_PARM1(regs));
    u32 tid = (u32)id;
    /* The thread's entry is reused in place (a hash update allocates and frees an
     * element each time; a lookup does not) and marked done with ts = 0. */
    struct fl_sysc *p = fl_sysc.lookup(&tid);
    if (p) {
        p->nr = nr;
        p->arg0 = arg0;
        p->ts = bpf_ktime_get_ns();
        return 0;
    }
    struct fl_sysc s = {};
    s.nr = nr;
    s.arg0 = arg0;
    s.ts = bpf_ktime_get_ns();
    if (fl_sysc.update(&tid, &s))
        fl_count(FL_C_STATE_FULL);
    return 0;
}

RAW_TRACEPOINT_PROBE(sys_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!fl_known_target(id >> 32))
        return 0; /* every task's syscalls come here: the cheap test first */
    u32 tid = (u32)id;
    /* The uretprobe syscall's entry stored nothing, so its exit finds ts = 0. */
    struct fl_sysc *s = fl_sysc.lookup(&tid);
    if (!s || !s->ts)
        return 0;
    u64 now = bpf_ktime_get_ns();
    u64 dur = now - s->ts;
    u32 tgid = id >> 32;
    fl_hist_add(tgid, OP_SYSCALL, dur, -1);
    if (dur >= FL_SYSCALL_MIN_NS) {
        struct fl_rec *r = fl_reserve(FL_C_LOST_SYS);
        if (r) {
            fl_fill(r, s->ts, dur, tgid, tid, OP_SYSCALL, (s32)ctx->args[1]);
            r->a0 = s->nr;
            r->flags = FL_WHY_SLOW;
            fl_submit(r);
        }
    }
    s->ts = 0;
    return 0;
}
#endif
