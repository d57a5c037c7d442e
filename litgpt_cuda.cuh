/* litgpt_cuda.cuh — the CUDA backend of litgpt.h. litgpt.h includes it when nvcc compiles the
   translation unit (nvcc -x cu train.c), inside LITGPT_IMPLEMENTATION.

   Today: the device count, and the collectives of section 9 written against NCCL (one
   communicator and one stream a rank, from ncclCommInitAll; every collective one grouped call
   from the thread that drives all ranks, the shape of lg_all_reduce_sum and the others on the
   CPU). They compile in every CUDA build but no trainer calls them yet: the kernels
   (embedding, norms, rotary, flash attention, GELU/SwiGLU, fused classifier, optimizers) and
   cuBLASLt matmuls land with the CUDA backend issue, each dispatched from the op of the same
   name in litgpt.h, and with them the trainer's use of these collectives. */
#ifndef LITGPT_CUDA_CUH
#define LITGPT_CUDA_CUH

#include <cuda_runtime.h>
#include <nccl.h>

static int lg_fail(lg_error *err, const char *fmt, ...); /* 1. utilities */

/* GPUs visible to this process; 0 when there is no driver or no device. */
static int lg_cuda_device_count_impl(void) {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}
#define LG_CUDA_DEVICE_COUNT() lg_cuda_device_count_impl()

/* Every CUDA and NCCL call is checked; a failure names the call, the file and the line. */
#define LG_CUDA_CHECK(call, err)                                                               \
    do {                                                                                       \
        cudaError_t lg_status_ = (call);                                                       \
        if (lg_status_ != cudaSuccess)                                                         \
            return lg_fail(err, "%s failed at %s:%d: %s", #call, __FILE__, __LINE__,           \
                           cudaGetErrorString(lg_status_));                                    \
    } while (0)
#define LG_NCCL_CHECK(call, err)                                                               \
    do {                                                                                       \
        ncclResult_t lg_status_ = (call);                                                      \
        if (lg_status_ != ncclSuccess)                                                         \
            return lg_fail(err, "%s failed at %s:%d: %s", #call, __FILE__, __LINE__,           \
                           ncclGetErrorString(lg_status_));                                    \
    } while (0)

/* The ranks of one collective group: a communicator and a stream on each one's GPU. */
typedef struct {
    int n;                             /* members */
    int device[LG_MAX_RANKS];          /* (n) their GPUs */
    ncclComm_t comm[LG_MAX_RANKS];     /* (n) */
    cudaStream_t stream[LG_MAX_RANKS]; /* (n) the communication streams */
} lg_nccl_group;

static inline int lg_nccl_group_init(lg_nccl_group *g, int n, const int *devices, lg_error *err) {
    memset(g, 0, sizeof *g);
    if (n < 1 || n > LG_MAX_RANKS) return lg_fail(err, "NCCL group of %d ranks", n);
    g->n = n;
    memcpy(g->device, devices, sizeof(int) * (size_t)n);
    LG_NCCL_CHECK(ncclCommInitAll(g->comm, n, g->device), err);
    for (int i = 0; i < n; i++) {
        LG_CUDA_CHECK(cudaSetDevice(g->device[i]), err);
        LG_CUDA_CHECK(cudaStreamCreateWithFlags(&g->stream[i], cudaStreamNonBlocking), err);
    }
    return 0;
}

static inline void lg_nccl_group_free(lg_nccl_group *g) {
    for (int i = 0; i < g->n; i++) {
        cudaSetDevice(g->device[i]);
        if (g->stream[i]) cudaStreamDestroy(g->stream[i]);
        if (g->comm[i]) ncclCommDestroy(g->comm[i]);
    }
    memset(g, 0, sizeof *g);
}

static inline ncclDataType_t lg_nccl_type(lg_dtype dtype) {
    switch (dtype) {
    case LG_DTYPE_BF16: return ncclBfloat16;
    case LG_DTYPE_F16: return ncclFloat16;
    case LG_DTYPE_I32: return ncclInt32;
    case LG_DTYPE_U8: return ncclUint8;
    default: return sizeof(lg_real) == 8 ? ncclFloat64 : ncclFloat32;
    }
}

/* The collectives of section 9 on device buffers, one per member, issued as one group. */
static inline int lg_nccl_all_reduce_sum(const lg_nccl_group *g, lg_buf *bufs, size_t count,
                                         lg_error *err) {
    LG_NCCL_CHECK(ncclGroupStart(), err);
    for (int i = 0; i < g->n; i++)
        LG_NCCL_CHECK(ncclAllReduce(bufs[i].data, bufs[i].data, count, lg_nccl_type(bufs[i].dtype),
                                    ncclSum, g->comm[i], g->stream[i]), err);
    LG_NCCL_CHECK(ncclGroupEnd(), err);
    return 0;
}

static inline int lg_nccl_reduce_scatter_sum(const lg_nccl_group *g, const lg_buf *whole,
                                             lg_buf *piece, size_t piece_count, lg_error *err) {
    LG_NCCL_CHECK(ncclGroupStart(), err);
    for (int i = 0; i < g->n; i++)
        LG_NCCL_CHECK(ncclReduceScatter(whole[i].data, piece[i].data, piece_count,
                                        lg_nccl_type(piece[i].dtype), ncclSum, g->comm[i],
                                        g->stream[i]), err);
    LG_NCCL_CHECK(ncclGroupEnd(), err);
    return 0;
}

static inline int lg_nccl_all_gather(const lg_nccl_group *g, const lg_buf *piece, lg_buf *whole,
                                     size_t piece_count, lg_error *err) {
    LG_NCCL_CHECK(ncclGroupStart(), err);
    for (int i = 0; i < g->n; i++) /* in place when piece[i] lies at i piece_count of whole[i] */
        LG_NCCL_CHECK(ncclAllGather(piece[i].data, whole[i].data, piece_count,
                                    lg_nccl_type(piece[i].dtype), g->comm[i], g->stream[i]), err);
    LG_NCCL_CHECK(ncclGroupEnd(), err);
    return 0;
}

static inline int lg_nccl_broadcast(const lg_nccl_group *g, int root, lg_buf *bufs, size_t count,
                                    lg_error *err) {
    LG_NCCL_CHECK(ncclGroupStart(), err);
    for (int i = 0; i < g->n; i++)
        LG_NCCL_CHECK(ncclBroadcast(bufs[i].data, bufs[i].data, count, lg_nccl_type(bufs[i].dtype),
                                    root, g->comm[i], g->stream[i]), err);
    LG_NCCL_CHECK(ncclGroupEnd(), err);
    return 0;
}

#endif /* LITGPT_CUDA_CUH */
