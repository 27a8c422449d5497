/* fleetd: NCCL uprobes (libnccl): collectives, point-to-point, communicator creation
 * and teardown, groups. Every call is emitted (always-class), so ranks can be compared
 * call by call later, failed calls included.
 *
 * Record extras (decoded by fleetd/trace/bpf/decoder.py):
 *   collectives, send/recv:
 *     a0 = element count, a1 = peer (send/recv) or root (broadcast/reduce), else -1
 *     bytes = count x sizeof(dtype) (AllGather: sendcount, ReduceScatter: recvcount)
 *     x0 = dtype | redop << 32, x1 = communicator, x2 = sequence number, x3 = stream
 *   ncclCommInitRank / ncclCommInitRankConfig:
 *     a0 = nranks, a1 = rank, x0 = hash of the ncclUniqueId, x1 = created communicator
 *   ncclCommSplit: a0 = color, a1 = key, x0 = parent, x1 = created communicator
 *   ncclCommInitAll: a0 = ndev
 *   ncclCommDestroy / ncclCommAbort: x1 = communicator
 * Integer parameters (int, enums) are read as 32 bits: the upper half of a register
 * carrying an int is not defined by the x86-64 ABI.
 */
#include "common.bpf.c"

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

/* The slot-th 8-byte stack argument (slot 1 = the first one past the return address). */
static __always_inline u64 fl_nccl_stack(struct pt_regs *ctx, int slot)
{
    u64 v = 0;
    fl_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * slot));
    return v;
}

/* The next sequence number under key k (1, 2, ...); 0 when no entry could be made. */
static __always_inline u64 fl_nccl_next_seq(struct fl_nccl_key *k)
{
    u64 *v = fl_nccl_seq.lookup(k);
    if (v) {
        *v += 1;
        return *v;
    }
    u64 one = 1;
    if (fl_nccl_seq.insert(k, &one) == 0)
        return 1;
    v = fl_nccl_seq.lookup(k); /* another thread inserted it first */
    if (v) {
        *v += 1;
        return *v;
    }
    fl_count(FL_C_STATE_FULL);
    return 0;
}

/* A collective (peer = root or -1) or a send/recv (peer = the other rank). */
static __always_inline int fl_nccl(struct pt_regs *ctx, u32 op, u64 count, u64 dtype,
                                   u64 redop, s64 peer, u64 comm, u64 stream)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!fl_is_cuda_target(tgid))
        return 0;
    dtype &= 0xffffffffull;
    struct fl_nccl_key k = {.comm = comm, .tgid = tgid};
    if (FL_OPS_NCCL_P2P(op)) {
        k.op = op;
        k.peer = peer;
    }
    u64 seq = fl_nccl_next_seq(&k);
    return fl_call_store(ctx, id, op, 0, count * fl_nccl_size(dtype), (s64)count, peer,
                         dtype | ((redop & 0xffffffffull) << 32), comm, seq, stream);
}

/* ncclAllReduce(send, recv, count, dtype, redop, comm, stream) */
static __always_inline int fl_enter_NCCLALLREDUCE(struct pt_regs *ctx)
{
    return fl_nccl(ctx, OP_NCCLALLREDUCE, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx),
                   PT_REGS_PARM5(ctx), -1, PT_REGS_PARM6(ctx), fl_nccl_stack(ctx, 1));
}

/* ncclBroadcast(send, recv, count, dtype, root, comm, stream) */
static __always_inline int fl_enter_NCCLBROADCAST(struct pt_regs *ctx)
{
    return fl_nccl(ctx, OP_NCCLBROADCAST, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), 0,
                   (s32)PT_REGS_PARM5(ctx), PT_REGS_PARM6(ctx), fl_nccl_stack(ctx, 1));
}

/* ncclReduce(send, recv, count, dtype, redop, root, comm, stream) */
static __always_inline int fl_enter_NCCLREDUCE(struct pt_regs *ctx)
{
    return fl_nccl(ctx, OP_NCCLREDUCE, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx),
                   PT_REGS_PARM5(ctx), (s32)PT_REGS_PARM6(ctx), fl_nccl_stack(ctx, 1),
                   fl_nccl_stack(ctx, 2));
}

/* ncclAllGather(send, recv, sendcount, dtype, comm, stream) */
static __always_inline int fl_enter_NCCLALLGATHER(struct pt_regs *ctx)
{
    return fl_nccl(ctx, OP_NCCLALLGATHER, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), 0, -1,
                   PT_REGS_PARM5(ctx), PT_REGS_PARM6(ctx));
}

/* ncclReduceScatter(send, recv, recvcount, dtype, redop, comm, stream) */
static __always_inline int fl_enter_NCCLREDUCESCATTER(struct pt_regs *ctx)
{
    return fl_nccl(ctx, OP_NCCLREDUCESCATTER, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx),
                   PT_REGS_PARM5(ctx), -1, PT_REGS_PARM6(ctx), fl_nccl_stack(ctx, 1));
}

/* ncclSend(buf, count, dtype, peer, comm, stream) */
static __always_inline int fl_enter_NCCLSEND(struct pt_regs *ctx)
{
    return fl_nccl(ctx, OP_NCCLSEND, PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx), 0,
                   (s32)PT_REGS_PARM4(ctx), PT_REGS_PARM5(ctx), PT_REGS_PARM6(ctx));
}

/* ncclRecv(buf, count, dtype, peer, comm, stream) */
static __always_inline int fl_enter_NCCLRECV(struct pt_regs *ctx)
{
    return fl_nccl(ctx, OP_NCCLRECV, PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx), 0,
                   (s32)PT_REGS_PARM4(ctx), PT_REGS_PARM5(ctx), PT_REGS_PARM6(ctx));
}

/* ---- communicators ---- */

/* A 64-bit hash of the 128-byte ncclUniqueId, equal on every rank given the same id:
 * FNV-1a over its sixteen little-endian 64-bit words, then the splitmix64 finalizer
 * (fleetd.trace.bpf.decoder.nccl_id_hash computes the same in Python). 0 = unreadable. */
static __always_inline u64 fl_nccl_id_hash(u64 addr)
{
    u64 w[16] = {};
    if (fl_read_user(w, sizeof(w), (void *)addr))
        return 0;
    u64 h = 0xcbf29ce484222325ull;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        h ^= w[i];
        h *= 0x100000001b3ull;
    }
    h ^= h >> 30;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 27;
    h *= 0x94d049bb133111ebull;
    h ^= h >> 31;
    return h;
}

/* ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank): the
 * 128-byte id is passed by value, in memory: at entry it is the first stack argument
 * (sp + 8), and rank takes the third integer register. The created communicator is
 * read through the out pointer at return (fl_nccl_created). */
static __always_inline int fl_enter_NCCLCOMMINITRANK(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_NCCLCOMMINITRANK, 0, (s32)PT_REGS_PARM2(ctx),
                         (s32)PT_REGS_PARM3(ctx), fl_nccl_id_hash(PT_REGS_SP(ctx) + 8),
                         PT_REGS_PARM1(ctx), 0, 0);
}

/* ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
 * ncclConfig_t *config): the same layout, config in the fourth register. */
static __always_inline int fl_enter_NCCLCOMMINITRANKCONFIG(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_NCCLCOMMINITRANKCONFIG, 0, (s32)PT_REGS_PARM2(ctx),
                         (s32)PT_REGS_PARM3(ctx), fl_nccl_id_hash(PT_REGS_SP(ctx) + 8),
                         PT_REGS_PARM1(ctx), 0, 0);
}

/* ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) */
static __always_inline int fl_enter_NCCLCOMMINITALL(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_NCCLCOMMINITALL, 0, (s32)PT_REGS_PARM2(ctx), 0, 0, 0, 0, 0);
}

/* ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, config) */
static __always_inline int fl_enter_NCCLCOMMSPLIT(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_NCCLCOMMSPLIT, 0, (s32)PT_REGS_PARM2(ctx),
                         (s32)PT_REGS_PARM3(ctx), PT_REGS_PARM1(ctx), PT_REGS_PARM4(ctx), 0, 0);
}

/* ncclGroupStart(void), ncclGroupEnd(void) */
static __always_inline int fl_enter_NCCLGROUPSTART(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_NCCLGROUPSTART, 0, 0, 0, 0, 0, 0, 0);
}

static __always_inline int fl_enter_NCCLGROUPEND(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_NCCLGROUPEND, 0, 0, 0, 0, 0, 0, 0);
}

/* ncclCommDestroy(comm), ncclCommAbort(comm) */
static __always_inline int fl_enter_NCCLCOMMDESTROY(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_NCCLCOMMDESTROY, 0, 0, 0, 0, PT_REGS_PARM1(ctx), 0, 0);
}

static __always_inline int fl_enter_NCCLCOMMABORT(struct pt_regs *ctx)
{
    return fl_call_enter(ctx, OP_NCCLCOMMABORT, 0, 0, 0, 0, PT_REGS_PARM1(ctx), 0, 0);
}
