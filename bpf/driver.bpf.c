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
    return fl_call_enter(ctx, OP_CULAUNCHKERNEL, 0, gx * gy * gz, bx * by, gx | (gy << 32),
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
    bpf_probe_read_user(&c, sizeof(c), (void *)PT_REGS_PARM1(ctx));
    return fl_call_enter(ctx, OP_CULAUNCHKERNELEX, 0, 0, 0, c.g[0] | ((u64)c.g[1] << 32),
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
