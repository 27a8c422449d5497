/* fleetd: on-CPU sampling of traced threads (user space: fleetd/trace/enrich/oncpu.py).
 *
 * A software CPU-clock perf event fires FL_CPU_HZ times a second on every CPU; when
 * the task it interrupts belongs to a traced process, one sample goes to fl_rb_cpu:
 * the thread, its native user stack (a stack-map id), the kernel address it was
 * interrupted at when it was in the kernel, its Python frames (the same
 * walk as the CUDA records' stacks, fl_py_walk) and whether its interpreter was
 * collecting garbage at that moment (the "collecting" flag of the interpreter's GC
 * state, at an address user space puts in fl_cpu_gc per process). User space counts
 * the samples per (thread, stack) per interval: what is stored grows with distinct
 * stacks, not with samples. A sample the ring has no room for is counted
 * (FL_C_LOST_CPU), never silently dropped.
 *
 * Compiled into the same module as the layers (after common.bpf.c), so the target set,
 * the Python maps and the counters are shared. The consumer is not woken per sample:
 * it drains the ring on its own poll, which a few dozen samples a second never fill.
 */
/* A perf-event program's context (struct bpf_perf_event_data): the interrupted
 * registers first, which is all that is read here (the verifier checks each access
 * against the kernel's own layout at load). Declared, not included: in a kernel header
 * tree uapi/linux/bpf_perf_event.h brings linux/ptrace.h and with it linux/sched.h,
 * some 400 headers that BCC parses three times per compile (over a second of a cold
 * start's CPU) for this one field. */
struct fl_perf_event_data {
    struct pt_regs regs;
};

#ifndef FL_CPU_RB_PAGES
#define FL_CPU_RB_PAGES 64
#endif
#define FL_CPU_GC 1u /* the interpreter was collecting garbage */

struct fl_cpu_sample {
    u64 ts;      /* CLOCK_MONOTONIC ns */
    u32 pid;     /* tgid */
    u32 tid;
    s32 stack;   /* fl_cpu_stacks id, < 0: not walked (map full) */
    u32 flags;   /* FL_CPU_* */
    u32 cpu;
    u32 pad;
    u64 kip;     /* where in the kernel the thread was interrupted; 0: in user space */
    struct fl_pystack py;
};

#ifdef FL_CPU_SAMPLE_SIZE
_Static_assert(sizeof(struct fl_cpu_sample) == FL_CPU_SAMPLE_SIZE,
               "fl_cpu_sample layout differs from oncpu.py");
#endif

BPF_RINGBUF_OUTPUT(fl_rb_cpu, FL_CPU_RB_PAGES);
BPF_STACK_TRACE(fl_cpu_stacks, 4096);
/* tgid -> address of its interpreter's GC "collecting" int (0: not a known CPython). */
BPF_HASH(fl_cpu_gc, u32, u64, 1024);

int fl_cpu_sample(struct fl_perf_event_data *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!fl_is_target(tgid) || fl_stopped())
        return 0;
    struct fl_cpu_sample *s = fl_rb_cpu.ringbuf_reserve(sizeof(struct fl_cpu_sample));
    if (!s) {
        fl_count(FL_C_LOST_CPU);
        return 0;
    }
    s->ts = bpf_ktime_get_ns();
    s->pid = tgid;
    s->tid = (u32)id;
    s->flags = 0;
    s->cpu = bpf_get_smp_processor_id();
    s->pad = 0;
    /* A kernel address (top bit set on x86_64 and arm64): the thread was in a system
     * call or a fault. Its function tells work the thread asked for (a copy) from a
     * wait that happens to burn CPU (spinning for a lock another task holds). */
    u64 ip = PT_REGS_IP(&ctx->regs);
    s->kip = (s64)ip < 0 ? ip : 0;
    s->stack = fl_cpu_stacks.get_stackid(ctx, BPF_F_USER_STACK);
    u64 *gc = fl_cpu_gc.lookup(&tgid);
    if (gc && *gc) {
        s32 collecting = 0;
        fl_read_user(&collecting, sizeof(collecting), (void *)*gc);
        if (collecting)
            s->flags |= FL_CPU_GC;
    }
    fl_py_walk(tgid, (u32)id, &s->py);
    bpf_ringbuf_submit(s, BPF_RB_NO_WAKEUP);
    return 0;
}

/* ---- exact collections: CPython's USDT probes python:gc__start / gc__done ----
 * (user space: fleetd/trace/enrich/pyusdt.py attaches both where the interpreter has them and
 * raises their semaphores). Start keeps (time, generation) per thread; done makes a
 * record of collections at least FL_GC_MIN_NS long, so the many sub-millisecond young
 * collections cost no ring space. */
#ifndef FL_GC_MIN_NS
#define FL_GC_MIN_NS 1000000ull
#endif
struct fl_gc_arg {
    u32 reg;   /* byte offset of the register in struct pt_regs */
    s32 off;   /* with deref: the argument is at reg + off in user memory */
    u32 deref;
    u32 size;
};
struct fl_gc_begin {
    u64 ts;
    s64 gen;
};
struct fl_gc_event {
    u64 ts;
    u64 dur;
    u32 pid;
    u32 tid;
    s32 gen;
    u32 kind; /* FL_GC_EVENT: tells it from a sample in the shared ring */
};
#define FL_GC_EVENT 0x6763u
BPF_HASH(fl_gc_usdt, u32, struct fl_gc_arg, 1024);
BPF_HASH(fl_gc_begin, u32, struct fl_gc_begin, 4096);

int fl_gc_start(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!fl_is_target(tgid))
        return 0;
    struct fl_gc_begin b = {.ts = bpf_ktime_get_ns(), .gen = -1};
    struct fl_gc_arg *a = fl_gc_usdt.lookup(&tgid);
    if (a) {
        u64 r = 0;
        bpf_probe_read_kernel(&r, sizeof(r), (char *)ctx + (a->reg & 0xf8));
        if (a->deref) {
            s32 g = -1;
            fl_read_user(&g, sizeof(g), (void *)(r + a->off));
            b.gen = g;
        } else {
            b.gen = (s32)r;
        }
    }
    fl_gc_begin.update(&tid, &b);
    return 0;
}

int fl_gc_done(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct fl_gc_begin *b = fl_gc_begin.lookup(&tid);
    if (!b)
        return 0;
    u64 now = bpf_ktime_get_ns();
    u64 start = b->ts;
    s64 gen = b->gen;
    fl_gc_begin.delete(&tid);
    if (now - start < FL_GC_MIN_NS || fl_stopped())
        return 0;
    struct fl_gc_event *e = fl_rb_cpu.ringbuf_reserve(sizeof(struct fl_gc_event));
    if (!e) {
        fl_count(FL_C_LOST_CPU);
        return 0;
    }
    e->ts = start;
    e->dur = now - start;
    e->pid = id >> 32;
    e->tid = tid;
    e->gen = (s32)gen;
    e->kind = FL_GC_EVENT;
    bpf_ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    return 0;
}
