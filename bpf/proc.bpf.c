/* fleetd: process lifecycle. Always loaded (even with --no-host): following a
 * target's children is how processes started after the tracer (torchrun workers)
 * are picked up. Children of targets become targets in the kernel, at fork. */
#include "common.bpf.c"

#define FL_CLONE_THREAD 0x00010000ull

/* tid -> clone flags of a clone in progress, to tell threads from processes at fork. */
BPF_TABLE("lru_hash", u32, u64, fl_clone, 4096);
/* tgid -> status passed to exit()/exit_group(); absent when killed by a signal. */
BPF_TABLE("lru_hash", u32, s32, fl_exitcode, 4096);

static __always_inline void fl_note_clone(u64 flags)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!fl_is_target(id >> 32))
        return;
    u32 tid = (u32)id;
    fl_clone.update(&tid, &flags);
}

TRACEPOINT_PROBE(syscalls, sys_enter_clone)
{
    fl_note_clone(args->clone_flags);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_clone3)
{
    u64 flags = 0; /* struct clone_args starts with u64 flags */
    bpf_probe_read_user(&flags, sizeof(flags), (void *)args->uargs);
    fl_note_clone(flags);
    return 0;
}

static __always_inline void fl_note_exit(s64 code)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!fl_is_target(tgid))
        return;
    s32 c = (s32)(code & 0xff);
    fl_exitcode.update(&tgid, &c);
}

TRACEPOINT_PROBE(syscalls, sys_enter_exit_group)
{
    fl_note_exit(args->error_code);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_exit)
{
    /* Only the status of the last thread matters; the leader's exit reads it. */
    fl_note_exit(args->error_code);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_fork)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    if (!fl_is_target(tgid))
        return 0;
    u64 *flags = fl_clone.lookup(&tid);
    u64 f = flags ? *flags : 0;
    if (flags)
        fl_clone.delete(&tid);
    if (f & FL_CLONE_THREAD)
        return 0; /* a new thread of a target: already covered by its tgid */
    u32 child = args->child_pid;
    fl_target_add(child, 4);
    struct fl_rec *r = fl_reserve(FL_C_LOST_SYS);
    if (!r)
        return 0;
    fl_fill(r, bpf_ktime_get_ns(), 0, tgid, tid, OP_FORK, 0);
    r->peer = child;
    r->peer_pid = child;
    r->a0 = (s64)f;
    r->flags = FL_WHY_ALWAYS;
    bpf_get_current_comm(r->comm, FL_COMM_LEN);
    fl_submit(r);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!fl_is_target(tgid))
        return 0;
    struct fl_rec *r = fl_reserve(FL_C_LOST_SYS);
    if (!r)
        return 0;
    fl_fill(r, bpf_ktime_get_ns(), 0, tgid, (u32)id, OP_EXEC, 0);
    r->a0 = args->old_pid;
    r->flags = FL_WHY_ALWAYS;
    bpf_get_current_comm(r->comm, FL_COMM_LEN);
    fl_submit(r);
    return 0;
}

/* Per-thread state of the host layer (when loaded, before this file) dies with the thread. */
#ifndef FL_FORGET_THREAD
#define FL_FORGET_THREAD(tid) do { } while (0)
#endif

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = (u32)id;
    FL_FORGET_THREAD(tid);
    if (tid != tgid || !fl_is_target(tgid))
        return 0;
    s32 *code = fl_exitcode.lookup(&tgid);
    struct fl_rec *r = fl_reserve(FL_C_LOST_SYS);
    if (r) {
        fl_fill(r, bpf_ktime_get_ns(), 0, tgid, tid, OP_EXIT, 0);
        r->a0 = code ? *code : 0;
        r->x[0] = code ? 1 : 0; /* 0: no exit() seen, e.g. killed by a signal */
        r->flags = FL_WHY_ALWAYS;
        bpf_get_current_comm(r->comm, FL_COMM_LEN);
        fl_submit(r);
    }
    fl_exitcode.delete(&tgid);
    /* A reused pid must not inherit target status. */
    fl_target_remove(tgid);
    return 0;
}
