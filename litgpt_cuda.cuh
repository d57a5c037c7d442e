/* litgpt_cuda.cuh — the CUDA backend of litgpt.h.

   litgpt.h includes this file inside LITGPT_IMPLEMENTATION, just before its CPU kernels
   (section 6), when nvcc compiles the translation unit (`nvcc -x cu train.c`) or when a test
   compiles it on the CPU with -DLG_CUDA_EMULATE against tests/cuda_emulator.h. Every op of
   section 6 hands its arguments to the function of the same name here, lg_cuda_<op>, when the
   rank it runs for is a GPU. The per-element math (bf16 and fp16 rounding, GELU, the optimizer
   elements, stochastic rounding) is litgpt.h's LG_HD functions, the same code the CPU runs.

   Contents
     a. checks, launches and the rank's GPU state (lg_cuda_rank)
     b. element access and reductions shared by the kernels
     c. elementwise kernels: add, copy/cast, GELU, SwiGLU, rotary
     d. embedding, LayerNorm/RMSNorm
     e. the fused classifier (softmax, loss and the logits' gradient)
     f. attention: flash-attention forward and backward
     g. matmuls: cuBLASLt, and a reference kernel (tests, emulation)
     h. optimizers, sums of squares
     i. ranks: memory, overheads, topology
     j. collectives over NCCL */
#ifndef LITGPT_CUDA_CUH
#define LITGPT_CUDA_CUH

#ifdef LG_REAL_DOUBLE
#error "the CUDA backend computes in float: build it without LG_REAL_DOUBLE"
#endif

#ifndef LG_CUDA_EMULATE
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <nccl.h>
#endif

/* a. checks, launches and the rank's GPU state ------------------------------------------------ */

static int lg_fail(lg_error *err, const char *fmt, ...); /* 1. utilities */

/* Every CUDA, cuBLAS and NCCL call is checked; a failure names the call, the file and the
   line. LG_CUDA_CHECK returns it as an error; the ops (which return nothing) stop the program
   with LG_CUDA_TRY, as an error on a GPU stream leaves the context unusable anyway. */
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

static void lg_cuda_die(const char *call, const char *file, int line, const char *what) {
    fprintf(stderr, "CUDA error: %s failed at %s:%d: %s\n", call, file, line, what);
    abort();
}
#define LG_CUDA_TRY(call)                                                                      \
    do {                                                                                       \
        cudaError_t lg_status_ = (call);                                                       \
        if (lg_status_ != cudaSuccess)                                                         \
            lg_cuda_die(#call, __FILE__, __LINE__, cudaGetErrorString(lg_status_));            \
    } while (0)
#define LG_NCCL_TRY(call)                                                                      \
    do {                                                                                       \
        ncclResult_t lg_status_ = (call);                                                      \
        if (lg_status_ != ncclSuccess)                                                         \
            lg_cuda_die(#call, __FILE__, __LINE__, ncclGetErrorString(lg_status_));            \
    } while (0)

/* Kernel launches go through LG_LAUNCH(kernel, grid, block, shared_bytes, stream, args...), so
   that tests/cuda_emulator.h can run the same kernels on the CPU; a template kernel is written
   in parentheses. Dynamic shared memory is declared with LG_SHARED_DYNAMIC(type, name). */
#ifndef LG_CUDA_EMULATE
#define LG_LAUNCH(kernel, grid, block, shared_bytes, stream, ...)                              \
    do {                                                                                       \
        kernel<<<(grid), (block), (shared_bytes), (stream)>>>(__VA_ARGS__);                    \
        LG_CUDA_TRY(cudaGetLastError());                                                       \
    } while (0)
#define LG_SHARED_DYNAMIC(type, name)                                                          \
    extern __shared__ __align__(16) unsigned char lg_shared_bytes_[];                          \
    type *name = (type *)lg_shared_bytes_
#endif

/* One GPU of a run: the rank's device, its streams, and its scratch in the plan's cuda.*
   regions of the rank's device arena (see LG_CUDA_MATMUL_WORKSPACE in litgpt.h). */
struct lg_cuda_rank {
    int device;
    cudaStream_t stream;        /* the ops, in order */
    cudaStream_t comm;          /* the collectives */
    cudaEvent_t compute_done;   /* fences between the two streams */
    cudaEvent_t comm_done;
#ifndef LG_CUDA_EMULATE
    cublasLtHandle_t lt;
#endif
    void *matmul_workspace;     /* (matmul_workspace_bytes): cuBLASLt's */
    size_t matmul_workspace_bytes;
    int *tokens, *targets;      /* (token_capacity): the micro-batch's ids, copied for the ops */
    size_t token_capacity;      /* B T */
    float *row_sums;            /* (LG_CUDA_ROW_CHUNKS, 2 C): per-chunk partial sums (norms) */
    int C;                      /* n_embd: the width row_sums was planned for */
    double *totals;             /* (LG_CUDA_REDUCE_SLOTS): partial sums of whole reductions */
    int tf32;                   /* fp32 matmuls may use TF32 (--tf32) */
    int reference_matmul;       /* matmuls by the reference kernel instead of cuBLASLt (tests) */
};

/* 1 when the GPU can read p (device, managed or pinned memory), 0 for pageable host memory. */
static int lg_cuda_device_accessible(const void *p);

/* The rank's stream, with its GPU made current: every op of a rank starts here, so one thread
   can drive the ranks of all GPUs in turn. */
static cudaStream_t lg_cuda_stream(const lg_exec *ex) {
    LG_CUDA_TRY(cudaSetDevice(ex->cuda->device));
    return ex->cuda->stream;
}

/* Copies n ids from the host (or anywhere) into one of the rank's id buffers, in stream order. */
static const int *lg_cuda_ids(const lg_exec *ex, int *device_ids, const int *ids, size_t n) {
    if (n > ex->cuda->token_capacity) {
        fprintf(stderr, "CUDA backend: %zu ids for a buffer of %zu\n", n, ex->cuda->token_capacity);
        abort();
    }
    LG_CUDA_TRY(cudaMemcpyAsync(device_ids, ids, n * sizeof(int), cudaMemcpyDefault,
                                lg_cuda_stream(ex)));
    return device_ids;
}

/* Blocks of `threads` covering n items. */
static unsigned lg_cuda_blocks(size_t n, unsigned threads) {
    return (unsigned)((n + threads - 1) / threads);
}

/* The parts below are being written; until each lands, its ops stop with a message. */
#if __has_include("/work/scratch/parts/kernels.cuh")
#include "/work/scratch/parts/kernels.cuh"
#endif
#if __has_include("/work/scratch/parts/attention.cuh")
#include "/work/scratch/parts/attention.cuh"
#endif
#if __has_include("/work/scratch/parts/host.cuh")
#include "/work/scratch/parts/host.cuh"
#endif

#endif /* LITGPT_CUDA_CUH */
