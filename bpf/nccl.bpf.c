/* fleetd: NCCL collectives and point-to-point (libnccl) uprobes. Every call is
 * emitted with its element count, byte count and peer/root, so ranks can be
 * compared later. x0 = datatype, x1 = communicator, x3 = stream. */
#include "common.bpf.c"



/* a1 = peer rank (send/recv) or root (broadcast/reduce), -1 when the op has none. */

/* ncclDataType_t -> bytes per element (int8, uint8, int32, uint32, int64, uint64,
 * float16, float32, float64, bfloat16, fp8 e4m3, fp8 e5m2). */
static __always_inline u64 fl_nccl_size(u64 dtype)
{
    switch (dtype) {
    case 0: case 1: case 10: case 11: return 1;
    case 6: case 9: return 2;
    case 2: case 3: case 7: return 4;
    case 4: case 5: case 8: return 8;
    default: return 0;
    }
}

static __always_inline u64 fl_nccl_stack(struct pt_regs *ctx, int slot)
{
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * slot));
    return v;
}

static __always_inline int fl_nccl(struct pt_regs *ctx, u32 op, u64 count, u64 dtype,
                                   s64 peer, u64 comm, u64 stream)
{
    return fl_call_enter(ctx, op, count * fl_nccl_size(dtype), (s64)count, peer, dtype, comm, 0,
                         stream);
}

/* ncclAllReduce(send, recv, count, dtype, redop, comm, stream) */
static __always_inline int fl_enter_NCCLALLREDUCE(struct pt_regs *ctx)
{
    return fl_nccl(ctx, OP_NCCLALLREDUCE, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), -1,
                   PT_REGS_PARM6(ctx), fl_nccl_stack(ctx, 1));
}

/* ncclBroadcast(send, recv, count, dtype, root, comm, stream) */
static __always_inline int fl_enter_NCCLBROADCAST(struct pt_regs *ctx)
{
    return fl_nccl(ctx, OP_NCCLBROADCAST, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx),
                   (s32)PT_REGS_PARM5(ctx), PT_REGS_PARM6(ctx), fl_nccl_stack(ctx, 1));
}

/* ncclReduce(send, recv, count, dtype, redop, root, comm, stream) */
static __always_inline int fl_enter_NCCLREDUCE(struct pt_regs *ctx)
{
    return fl_nccl(ctx, OP_NCCLREDUCE, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx),
                   (s32)PT_REGS_PARM6(ctx), fl_nccl_stack(ctx, 1), fl_nccl_stack(ctx, 2));
}

/* ncclAllGather(send, recv, sendcount, dtype, comm, stream) */
static __always_inline int fl_enter_NCCLALLGATHER(struct pt_regs *ctx)
{
    return fl_nccl(ctx, OP_NCCLALLGATHER, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), -1,
                   PT_REGS_PARM5(ctx), PT_REGS_PARM6(ctx));
}

/* ncclReduceScatter(send, recv, recvcount, dtype, redop, comm, stream) */
static __always_inline int fl_enter_NCCLREDUCESCATTER(struct pt_regs *ctx)
{
    return fl_nccl(ctx, OP_NCCLREDUCESCATTER, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), -1,
                   PT_REGS_PARM6(ctx), fl_nccl_stack(ctx, 1));
}

/* ncclSend(buf, count, dtype, peer, comm, stream) */
static __always_inline int fl_enter_NCCLSEND(struct pt_regs *ctx)
{
    return fl_nccl(ctx, OP_NCCLSEND, PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx),
                   (s32)PT_REGS_PARM4(ctx), PT_REGS_PARM5(ctx), PT_REGS_PARM6(ctx));
}

/* ncclRecv(buf, count, dtype, peer, comm, stream) */
static __always_inline int fl_enter_NCCLRECV(struct pt_regs *ctx)
{
    return fl_nccl(ctx, OP_NCCLRECV, PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx),
                   (s32)PT_REGS_PARM4(ctx), PT_REGS_PARM5(ctx), PT_REGS_PARM6(ctx));
}
