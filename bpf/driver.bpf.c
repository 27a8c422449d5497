/* fleetd: CUDA driver API (libcuda) uprobes. Same scheme and record extras as
 * cuda.bpf.c; CUresult is the return code. */
#include "common.bpf.c"



/* cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shmem, stream, params, extra):
 * six register arguments, then bz, shmem, stream on the stack. */
static __always_inline int fl_enter_CULAUNCHKERNEL(struct pt_regs *ctx)
{
    u64 gx = PT_REGS_PARM2(ctx) & 0xffffffff, gy = PT_REGS_PARM3(ctx) & 0xffffffff;
    u64 gz = PT_REGS_PARM4(ctx) & 0xffffffff, bx = PT_REGS_PARM5(ctx) & 0xffffffff;
    u64 by = PT_REGS_PARM6(ctx) & 0xffffffff;
    return fl_call_enter_f(ctx, OP_CULAUNCHKERNEL, PT_REGS_PARM1(ctx), 0, gx * gy * gz, bx * by, gx | (gy << 32),
                         gz & 0xffff, bx | (by << 32), 0);
}

/* CUlaunchConfig: grid xyz, block xyz, sharedMemBytes (u32 each), then hStream. */
struct fl_launch_config {
    u32 g[3];
    u32 b[3];
    u32 shmem;
    u32 pad;
    u64 stream;
};

/* cuLaunchKernelEx(const CUlaunchConfig *config, f, params, extra) */
static __always_inline int fl_enter_CULAUNCHKERNELEX(struct pt_regs *ctx)
{
    struct fl_launch_config c = {};
    fl_read_user(&c, sizeof(c), (void *)PT_REGS_PARM1(ctx));
    return fl_call_enter_f(ctx, OP_CULAUNCHKERNELEX, PT_REGS_PARM2(ctx), 0, 0, 0, c.g[0] | ((u64)c.g[1] << 32),
                         (c.g[2] & 0xffff) | ((u64)(c.b[2] & 0xffff) << 16) |
                             ((u64)c.shmem << 32),
                         c.b[0] | ((u64)c.b[1] << 32), c.stream);
}

/* cuMemAlloc_v2(CUdeviceptr *dptr, bytesize) */
static __always_inline int fl_enter_CUMEMALLOC_V2(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUMEMALLOC_V2, PT_REGS_PARM2(ctx), 0, 0, 0, 0, 0, 0);
}

/* cuMemcpyHtoD_v2(dst, src, bytes) and DtoH: synchronous copies */
static __always_inline int fl_enter_CUMEMCPYHTOD_V2(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUMEMCPYHTOD_V2, PT_REGS_PARM3(ctx), 0, 0, PT_REGS_PARM1(ctx),
                         PT_REGS_PARM2(ctx), 0, 0);
}

static __always_inline int fl_enter_CUMEMCPYDTOH_V2(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUMEMCPYDTOH_V2, PT_REGS_PARM3(ctx), 0, 0, PT_REGS_PARM1(ctx),
                         PT_REGS_PARM2(ctx), 0, 0);
}

/* cuMemcpy{HtoD,DtoH}Async_v2(dst, src, bytes, stream) */
static __always_inline int fl_enter_CUMEMCPYHTODASYNC_V2(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUMEMCPYHTODASYNC_V2, PT_REGS_PARM3(ctx), 0, 0,
                         PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), 0, PT_REGS_PARM4(ctx));
}

static __always_inline int fl_enter_CUMEMCPYDTOHASYNC_V2(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUMEMCPYDTOHASYNC_V2, PT_REGS_PARM3(ctx), 0, 0,
                         PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), 0, PT_REGS_PARM4(ctx));
}

/* cuCtxSynchronize(void) */
static __always_inline int fl_enter_CUCTXSYNCHRONIZE(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUCTXSYNCHRONIZE, 0, 0, 0, 0, 0, 0, 0);
}

/* cuStreamSynchronize(stream) */
static __always_inline int fl_enter_CUSTREAMSYNCHRONIZE(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUSTREAMSYNCHRONIZE, 0, 0, 0, 0, 0, 0, PT_REGS_PARM1(ctx));
}

/* cuGraphLaunch(exec, stream) */
static __always_inline int fl_enter_CUGRAPHLAUNCH(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUGRAPHLAUNCH, 0, 0, 0, PT_REGS_PARM1(ctx), 0, 0,
                         PT_REGS_PARM2(ctx));
}

/* ---- kernel names: what cuLaunchKernel's CUfunction is called ----
 * cuModuleGetFunction(CUfunction *out, CUmodule, const char *name) and
 * cuLibraryGetKernel(CUkernel *out, CUlibrary, const char *name) hand out a handle for
 * a name; cuKernelGetFunction(CUfunction *out, CUkernel) turns a library kernel into
 * a function. Entry keeps where the handle will be written, return reads it and files
 * the name under (process, handle); user space looks a launch's function up there.
 * These calls happen once per kernel, so their cost does not matter. */
#define FL_KNAME_LEN 128
struct fl_kname {
    char name[FL_KNAME_LEN];
};
struct fl_kkey {
    u64 handle;
    u32 tgid;
    u32 pad;
};
struct fl_kget {
    u64 out;  /* CUfunction * / CUkernel * */
    u64 src;  /* the name, or the CUkernel of cuKernelGetFunction */
    u32 kind; /* 0: src is a name, 1: src is a kernel handle */
    u32 pad;
};
BPF_HASH(fl_kget_pending, u32, struct fl_kget, 4096);
BPF_HASH(fl_knames, struct fl_kkey, struct fl_kname, 16384);
BPF_PERCPU_ARRAY(fl_kname_buf, struct fl_kname, 1);

static __always_inline int fl_kname_enter(u64 out, u64 src, u32 kind)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!fl_is_cuda_target(id >> 32))
        return 0;
    u32 tid = (u32)id;
    struct fl_kget g = {.out = out, .src = src, .kind = kind};
    fl_kget_pending.update(&tid, &g);
    return 0;
}

int fl_kn_in_module(struct pt_regs *ctx)
{
    return fl_kname_enter(PT_REGS_PARM1(ctx), PT_REGS_PARM3(ctx), 0);
}

int fl_kn_in_kernel(struct pt_regs *ctx)
{
    return fl_kname_enter(PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), 1);
}

int fl_kn_out(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct fl_kget *g = fl_kget_pending.lookup(&tid);
    if (!g)
        return 0;
    struct fl_kget got = *g;
    fl_kget_pending.delete(&tid);
    if (PT_REGS_RC(ctx) != 0)
        return 0; /* CUDA_SUCCESS only: on failure *out is not a handle */
    struct fl_kkey key = {.tgid = id >> 32};
    if (fl_read_user(&key.handle, 8, (void *)got.out) || !key.handle)
        return 0;
    if (got.kind == 1) {
        struct fl_kkey from = {.handle = got.src, .tgid = id >> 32};
        struct fl_kname *n = fl_knames.lookup(&from);
        if (n)
            fl_knames.update(&key, n);
        return 0;
    }
    int zero = 0;
    struct fl_kname *buf = fl_kname_buf.lookup(&zero);
    if (!buf)
        return 0;
    if (fl_read_user_str(buf->name, FL_KNAME_LEN, (void *)got.src) <= 0)
        return 0;
    fl_knames.update(&key, buf);
    return 0;
}
