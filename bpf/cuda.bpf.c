/* fleetd: CUDA runtime (libcudart) and CUDA graph uprobes.
 *
 * fl_enter_<OP> keeps the start and the arguments that matter; the return side is
 * fl_call_exit (common.bpf.c): histogram, then a record for anomalies, always-emitted
 * classes and the sample. The attachable programs are generated from
 * fleetd/trace/bpf/probes.py (bpfsrc.probe_wrappers): one entry/return pair per op for
 * per-symbol uprobes, and one dispatcher pair for uprobe_multi links, where the
 * attach cookie carries the op, its ring and whether it is always emitted.
 *
 * Record extras, shared with the driver layer so one decoder reads both:
 *   launches: x0 = grid.x | grid.y << 32, x1 = grid.z | block.z << 16 | shmem << 32,
 *             x2 = block.x | block.y << 32, x3 = stream
 *   others:   x0 = pointer / event / graph exec, x1 = source / graph, x3 = stream
 * A launch's func (fl_rec.func) is its kernel: the host stub cudaLaunchKernel is
 * given, named from the process's symbols in user space.
 */
#include "common.bpf.c"



/* dim3 is 12 bytes passed by value: x|y in one register, z in the next. */
static __always_inline u64 fl_threads(u64 xy, u64 z)
{
    return (xy & 0xffffffffull) * (xy >> 32) * (z & 0xffffffffull);
}

/* cudaLaunchKernel(func, dim3 grid, dim3 block, void **args, size_t shmem, stream) */
static __always_inline int fl_enter_CUDALAUNCHKERNEL(struct pt_regs *ctx)
{
    u64 gxy = PT_REGS_PARM2(ctx), gz = PT_REGS_PARM3(ctx);
    u64 bxy = PT_REGS_PARM4(ctx), bz = PT_REGS_PARM5(ctx);
    /* sharedMem and stream are on the stack: fl_stack_args() reads them if emitted */
    return fl_call_enter_f(ctx, OP_CUDALAUNCHKERNEL, PT_REGS_PARM1(ctx), 0, fl_threads(gxy, gz),
                         fl_threads(bxy, bz), gxy, (gz & 0xffff) | ((bz & 0xffff) << 16),
                         bxy, 0);
}

/* cudaMemcpy(dst, src, count, kind) */
static __always_inline int fl_enter_CUDAMEMCPY(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUDAMEMCPY, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), 0,
                         PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), 0, 0);
}

/* cudaMemcpyAsync(dst, src, count, kind, stream) */
static __always_inline int fl_enter_CUDAMEMCPYASYNC(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUDAMEMCPYASYNC, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), 0,
                         PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), 0, PT_REGS_PARM5(ctx));
}

/* cudaMalloc(void **ptr, size) */
static __always_inline int fl_enter_CUDAMALLOC(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUDAMALLOC, PT_REGS_PARM2(ctx), 0, 0, 0, 0, 0, 0);
}

/* cudaFree(ptr) */
static __always_inline int fl_enter_CUDAFREE(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUDAFREE, 0, 0, 0, PT_REGS_PARM1(ctx), 0, 0, 0);
}

/* cudaMallocManaged(void **ptr, size, flags) */
static __always_inline int fl_enter_CUDAMALLOCMANAGED(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUDAMALLOCMANAGED, PT_REGS_PARM2(ctx), 0, 0, 0,
                         PT_REGS_PARM3(ctx), 0, 0);
}

/* cudaStreamSynchronize(stream) */
static __always_inline int fl_enter_CUDASTREAMSYNCHRONIZE(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUDASTREAMSYNCHRONIZE, 0, 0, 0, 0, 0, 0, PT_REGS_PARM1(ctx));
}

/* cudaDeviceSynchronize(void) */
static __always_inline int fl_enter_CUDADEVICESYNCHRONIZE(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUDADEVICESYNCHRONIZE, 0, 0, 0, 0, 0, 0, 0);
}

/* cudaEventSynchronize(event) */
static __always_inline int fl_enter_CUDAEVENTSYNCHRONIZE(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUDAEVENTSYNCHRONIZE, 0, 0, 0, PT_REGS_PARM1(ctx), 0, 0, 0);
}

/* cudaStreamWaitEvent(stream, event, flags) */
static __always_inline int fl_enter_CUDASTREAMWAITEVENT(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUDASTREAMWAITEVENT, 0, 0, 0, PT_REGS_PARM2(ctx),
                         PT_REGS_PARM3(ctx), 0, PT_REGS_PARM1(ctx));
}

/* cudaMallocAsync(void **ptr, size, stream) */
static __always_inline int fl_enter_CUDAMALLOCASYNC(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUDAMALLOCASYNC, PT_REGS_PARM2(ctx), 0, 0, 0, 0, 0,
                         PT_REGS_PARM3(ctx));
}

/* cudaFreeAsync(ptr, stream) */
static __always_inline int fl_enter_CUDAFREEASYNC(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUDAFREEASYNC, 0, 0, 0, PT_REGS_PARM1(ctx), 0, 0,
                         PT_REGS_PARM2(ctx));
}

/* ---- CUDA graphs: every lifecycle call is emitted ---- */

/* cudaStreamBeginCapture(stream, mode) */
static __always_inline int fl_enter_CUDASTREAMBEGINCAPTURE(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUDASTREAMBEGINCAPTURE, 0, 0, 0, PT_REGS_PARM2(ctx), 0, 0,
                         PT_REGS_PARM1(ctx));
}

/* cudaStreamEndCapture(stream, cudaGraph_t *graph) */
static __always_inline int fl_enter_CUDASTREAMENDCAPTURE(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUDASTREAMENDCAPTURE, 0, 0, 0, 0, 0, 0, PT_REGS_PARM1(ctx));
}

/* cudaGraphInstantiate(cudaGraphExec_t *exec, graph, flags) */
static __always_inline int fl_enter_CUDAGRAPHINSTANTIATE(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUDAGRAPHINSTANTIATE, 0, 0, 0, 0, PT_REGS_PARM2(ctx), 0, 0);
}

/* cudaGraphLaunch(exec, stream) */
static __always_inline int fl_enter_CUDAGRAPHLAUNCH(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUDAGRAPHLAUNCH, 0, 0, 0, PT_REGS_PARM1(ctx), 0, 0,
                         PT_REGS_PARM2(ctx));
}

/* cudaGraphExecUpdate(exec, graph, resultInfo) */
static __always_inline int fl_enter_CUDAGRAPHEXECUPDATE(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUDAGRAPHEXECUPDATE, 0, 0, 0, PT_REGS_PARM1(ctx),
                         PT_REGS_PARM2(ctx), 0, 0);
}

/* cudaGraphExecDestroy(exec) */
static __always_inline int fl_enter_CUDAGRAPHEXECDESTROY(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_CUDAGRAPHEXECDESTROY, 0, 0, 0, PT_REGS_PARM1(ctx), 0, 0, 0);
}
