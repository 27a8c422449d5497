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
    fl_read_user(&flags, sizeof(flags), (void *)args->uargs);
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

/* ---- Probes before the first call: the mapping hook ------------------------------
 * A uprobe on a file is installed by the kernel when a process maps the file, so a CUDA
 * library fleetd attached before it is mapped is covered from its first call. A file
 * it has never seen (a dlopen from an unknown directory, an executable that carries
 * the runtime inside) is caught where it is mapped executable: a candidate's mmap with
 * PROT_EXEC of a file, or its exec. Unless user space has already classified that file
 * (fl_known_files, keyed by a hash of the name the process opened it by), the process
 * is stopped (SIGSTOP, delivered before it returns to user space) and user space told
 * (fl_rb_hold); it attaches whatever CUDA code the file carries, marks it known and
 * sends SIGCONT. So no call can run before its probes, and each file costs one stop,
 * once per node, not one per process. */
#define FL_SIGSTOP 19
#define FL_PROT_EXEC 0x4
#define FL_NAME_MAX 256

struct fl_hold {
    u64 ts;
    u32 pid;
    u32 tid;
    u64 hash;     /* of the file's name as opened (0: not known) */
    u32 how;      /* 0: mmap of an executable file, 1: exec */
    u32 held;     /* 1: the process was sent SIGSTOP */
};
BPF_RINGBUF_OUTPUT(fl_rb_hold, 16);
/* Every executable mapping of a file by a candidate, held or not (the file's name as
 * opened, where it was mapped): the symbolizer keeps it, so a short process that exits
 * before user space reads its maps still has its kernels named. Its own ring: a flood
 * of these must never leave a hold record without room. */
struct fl_mapped {
    u64 ts;
    u32 pid;
    u32 tid;
    u64 start;
    u64 len;
    u64 off;
    char name[FL_NAME_MAX];
};
BPF_RINGBUF_OUTPUT(fl_rb_maps, 64);
BPF_ARRAY(fl_maps_lost, u64, 1); /* fl_mapped records the ring had no room for */
/* [0]: 1 while user space reads fl_rb_hold and may hold processes (the tracer's watcher
 * thread runs; FLEETD_NO_HOLD unset). Without it the events still come, unheld, and
 * their window is measured. */
BPF_ARRAY(fl_hold_ctl, u32, 1);
/* tgid -> when it was stopped, until user space resumes it: what a tracer killed
 * before it could resume them leaves behind, for its releaser (fleetd.trace.bpf.mapwatch). */
BPF_HASH(fl_held, u32, u64, 4096);
BPF_TABLE("lru_hash", u32, u64, fl_open_name, 4096);   /* tid -> name pointer (openat) */
/* An executable mmap in progress: its fd, length and file offset, until it returns. */
struct fl_mmap_req { u32 fd; u32 pad; u64 len; u64 off; };
BPF_TABLE("lru_hash", u32, struct fl_mmap_req, fl_mmap_fd, 4096); /* tid -> its request */
BPF_TABLE("lru_hash", u64, u8, fl_known_files, 65536); /* name hash -> classified */
struct fl_name_buf { char s[FL_NAME_MAX]; };
BPF_PERCPU_ARRAY(fl_name_scratch, struct fl_name_buf, 1);
/* tgid << 32 | fd -> the name it was opened by, copied when openat returns: the loader
 * builds a library's name in a stack buffer that later calls overwrite before the mmap,
 * so a pointer read at the mmap gave another name each time (a stop per process, not
 * per file) and no name to report. */
BPF_TABLE("lru_hash", u64, struct fl_name_buf, fl_fd_name, 8192);

/* Whose mappings are hooked: the targets, or every process when tracing system-wide
 * (a process there becomes a target at its first CUDA call: its probes must be in
 * place before it). */
static __always_inline int fl_hook_candidate(u32 tgid)
{
    if (tgid == FL_TRACER_PID || tgid == 0)
        return 0;
#if FL_SYSTEM_WIDE
    return 1;
#else
    return fl_is_target(tgid);
#endif
}

/* FNV-1a over a NUL-terminated name; user space never computes it, it only stores the
 * hash an event carried. */
static __always_inline u64 fl_name_hash(struct fl_name_buf *b, int len)
{
    u64 h = 0xcbf29ce484222325ull;
    if (b->s[0] != '/')
        return 0; /* a relative name says too little: such a file is held every time */
    for (int i = 0; i < FL_NAME_MAX; i++) {
        if (i >= len)
            break;
        char c = b->s[i];
        if (!c)
            break;
        h ^= (u8)c;
        h *= 0x100000001b3ull;
    }
    return h ? h : 1;
}

static __always_inline void fl_hold_now(u64 hash, u32 how)
{
    u64 id = bpf_get_current_pid_tgid();
    if (hash && fl_known_files.lookup(&hash))
        return;
    /* The record first: a process must never be stopped without user space told. */
    struct fl_hold *h = fl_rb_hold.ringbuf_reserve(sizeof(struct fl_hold));
    if (!h) {
        fl_count(FL_C_LOST_SYS);
        return;
    }
    u32 held = 0;
    int zero = 0;
    u32 *on = fl_hold_ctl.lookup(&zero);
    u32 tgid = id >> 32;
    u64 now = bpf_ktime_get_ns();
    /* Listed before the signal: a process is never stopped without its entry. */
    if (on && *on && !fl_stopped() && fl_held.update(&tgid, &now) == 0) {
        if (bpf_send_signal(FL_SIGSTOP) == 0)
            held = 1;
        else
            fl_held.delete(&tgid);
    }
    h->ts = now;
    h->pid = tgid;
    h->tid = (u32)id;
    h->hash = hash;
    h->how = how;
    h->held = held;
    fl_rb_hold.ringbuf_submit(h, 0);
}

/* sys_enter_openat's record has a umode_t field; the generated header route has no
 * such type (a typedef cannot be tested for, a macro can). */
#ifndef umode_t
#define umode_t unsigned short
#endif
TRACEPOINT_PROBE(syscalls, sys_enter_openat)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!fl_hook_candidate(id >> 32))
        return 0;
    u32 tid = (u32)id;
    u64 name = (u64)args->filename;
    fl_open_name.update(&tid, &name);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_openat)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    u64 *name = fl_open_name.lookup(&tid);
    if (!name)
        return 0;
    u64 n = *name;
    fl_open_name.delete(&tid);
    if (args->ret < 0)
        return 0;
    u64 key = (id & 0xffffffff00000000ull) | (u32)args->ret;
    int zero = 0;
    struct fl_name_buf *b = fl_name_scratch.lookup(&zero);
    if (!b)
        return 0;
    if (fl_read_user_str(b->s, sizeof(b->s), (void *)n) <= 0)
        return 0;
    fl_fd_name.update(&key, b);
    return 0;
}

/* A closed fd's name goes with it: a later fd of that number (a memfd, a socket) is
 * another file. */
TRACEPOINT_PROBE(syscalls, sys_enter_close)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!fl_hook_candidate(id >> 32))
        return 0;
    u64 key = (id & 0xffffffff00000000ull) | (u32)args->fd;
    fl_fd_name.delete(&key);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_mmap)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!(args->prot & FL_PROT_EXEC) || (s64)args->fd < 0 || !fl_hook_candidate(id >> 32))
        return 0;
    u32 tid = (u32)id;
    struct fl_mmap_req req = {.fd = (u32)args->fd, .len = args->len, .off = args->off};
    fl_mmap_fd.update(&tid, &req);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_exit_mmap)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct fl_mmap_req *rq = fl_mmap_fd.lookup(&tid);
    if (!rq)
        return 0;
    struct fl_mmap_req req = *rq;
    u64 key = (id & 0xffffffff00000000ull) | req.fd;
    fl_mmap_fd.delete(&tid);
    if ((u64)args->ret >= (u64)-4095)
        return 0; /* the mapping failed: nothing to probe */
    struct fl_name_buf *name = fl_fd_name.lookup(&key);
    u64 hash = name ? fl_name_hash(name, FL_NAME_MAX) : 0;
    fl_hold_now(hash, 0);
    int zero = 0;
    struct fl_mapped *m = fl_rb_maps.ringbuf_reserve(sizeof(struct fl_mapped));
    if (!m) {
        u64 *lost = fl_maps_lost.lookup(&zero);
        if (lost)
            __sync_fetch_and_add(lost, 1);
        return 0;
    }
    m->ts = bpf_ktime_get_ns();
    m->pid = id >> 32;
    m->tid = tid;
    m->start = (u64)args->ret;
    m->len = req.len;
    m->off = req.off;
    m->name[0] = 0;
    if (name)
        bpf_probe_read_kernel(m->name, sizeof(m->name), name->s);
    fl_rb_maps.ringbuf_submit(m, 0);
    return 0;
}

/* The exec'd file: a program linked with the static runtime maps no library. ``args``
 * is the tracepoint's record, whose __data_loc field says where the name is. */
static __always_inline void fl_exec_hook(void *args, u32 data_loc)
{
    if (!fl_hook_candidate(bpf_get_current_pid_tgid() >> 32))
        return;
    int zero = 0;
    struct fl_name_buf *b = fl_name_scratch.lookup(&zero);
    if (!b)
        return;
    int len = bpf_probe_read_kernel_str(b->s, sizeof(b->s), args + (data_loc & 0xFFFF));
    fl_hold_now(len > 0 ? fl_name_hash(b, len) : 0, 1);
}

TRACEPOINT_PROBE(sched, sched_process_exec)
{
    fl_exec_hook((void *)args, args->data_loc_filename);
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
