/* litgpt_cuda.cuh — the CUDA backend of litgpt.h.

   litgpt.h includes this file inside LITGPT_IMPLEMENTATION, just before its CPU kernels
   (section 7), when nvcc compiles the translation unit (`nvcc -x cu train.c`) or when a test
   compiles it on the CPU with -DLG_CUDA_EMULATE against tests/cuda_emulator.h. Every op of
   section 7 hands its arguments to the function of the same name here, lg_cuda_<op>, when the
   rank it runs for is a GPU. The per-element math (bf16 and fp16 rounding, GELU, the optimizer
   elements, stochastic rounding) is litgpt.h's LG_HD functions, the same code the CPU runs.

   Contents
     a. checks, launches and the rank's GPU state (lg_cuda_rank)
     b. element access and reductions shared by the kernels
     c. elementwise kernels: add, copy/cast, NF4 dequantization, GELU, SwiGLU, rotary
     d. embedding, LayerNorm/RMSNorm
     e. the fused classifier (softmax, loss and the logits' gradient)
     f. optimizers, sums of squares
     g. attention: flash-attention forward and backward
     h. matmuls: cuBLASLt, and a reference kernel (tests, emulation)
     i. ranks: memory, overheads, topology
     j. collectives over NCCL */
#ifndef LITGPT_CUDA_CUH
#define LITGPT_CUDA_CUH

#ifdef LG_REAL_DOUBLE
#error "the CUDA backend computes in float: build it without LG_REAL_DOUBLE"
#endif

#ifndef LG_CUDA_EMULATE
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>
#endif

/* a. checks, launches and the rank's GPU state ------------------------------------------------ */

static int lg_fail(lg_error *err, const char *fmt, ...); /* 1. utilities */

/* NCCL is not linked: lg_nccl_load opens libnccl.so.2 when a communicator is made (several
   GPUs), so that a run on one GPU, which makes none, needs no NCCL on the machine. Each
   communicator (lg_comm) keeps the functions it calls; the library stays loaded. On the
   emulator the functions are tests/cuda_emulator.h's. */
#define LG_NCCL_FUNCTIONS(X)                                                                   \
    X(CommInitAll) X(CommInitRankConfig) X(CommSplit) X(CommDestroy) X(CommAbort)              \
    X(CommGetAsyncError) X(CommCount) X(CommUserRank) X(GetUniqueId) X(GroupStart)             \
    X(GroupEnd) X(AllReduce) X(AllGather) X(ReduceScatter) X(Broadcast)
typedef struct {
#define LG_NCCL_POINTER(name) decltype(&nccl##name) name; /* ncclNAME */
    LG_NCCL_FUNCTIONS(LG_NCCL_POINTER)
#undef LG_NCCL_POINTER
} lg_nccl_api;

static int lg_nccl_load(lg_nccl_api *api, lg_error *err) {
#ifdef LG_CUDA_EMULATE
#define LG_NCCL_BIND(name) api->name = nccl##name;
    LG_NCCL_FUNCTIONS(LG_NCCL_BIND)
#undef LG_NCCL_BIND
    (void)err;
#else
    void *library = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
    if (!library)
        return lg_fail(err, "several GPUs need NCCL, and libnccl.so.2 did not load: %s (install NCCL, "
                            "or add the folder that holds it, such as a Python environment's "
                            "site-packages/nvidia/nccl/lib, to LD_LIBRARY_PATH)", dlerror());
#define LG_NCCL_BIND(name)                                                                     \
    if (!(api->name = (decltype(api->name))dlsym(library, "nccl" #name)))                      \
        return lg_fail(err, "libnccl.so.2 has no nccl" #name " (NCCL 2.18 or later is needed)");
    LG_NCCL_FUNCTIONS(LG_NCCL_BIND)
#undef LG_NCCL_BIND
#endif
    return 0;
}

/* NCCL's result codes in words (ncclGetErrorString's, without the library). */
static const char *lg_nccl_result_text(ncclResult_t status) {
    switch (status) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
    }
}

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
                           lg_nccl_result_text(lg_status_));                                   \
    } while (0)

static void lg_cuda_die(const char *call, const char *file, int line, const char *what) {
    fflush(stdout); /* what the program said before the error, ahead of the abort */
    fprintf(stderr, "CUDA error: %s failed at %s:%d: %s\n", call, file, line, what);
    abort();
}
#define LG_CUDA_TRY(call)                                                                      \
    do {                                                                                       \
        cudaError_t lg_status_ = (call);                                                       \
        if (lg_status_ != cudaSuccess)                                                         \
            lg_cuda_die(#call, __FILE__, __LINE__, cudaGetErrorString(lg_status_));            \
    } while (0)
#define LG_NCCL_TRY(call) /* (ncclInProgress: a non-blocking communicator enqueues; see     \
                             lg_nccl_settle) */                                                \
    do {                                                                                       \
        ncclResult_t lg_status_ = (call);                                                      \
        if (lg_status_ != ncclSuccess && lg_status_ != ncclInProgress)                         \
            lg_cuda_die(#call, __FILE__, __LINE__, lg_nccl_result_text(lg_status_));           \
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

#ifndef LG_CUDA_EMULATE
#define LG_LT_CACHE 32 /* matmul shapes a rank keeps cuBLASLt plans for */
#define LG_LT_KEY 15   /* ints of a shape's key (lg_lt_key) */
/* One matmul shape's cuBLASLt descriptor, layouts and chosen algorithm (lg_cuda_matmul_lt):
   made at the shape's first call, reused by every later one. */
typedef struct {
    int key[LG_LT_KEY];
    int usable;                           /* 0: cuBLASLt had no algorithm that ran */
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t first, second, out;
    cublasLtMatmulAlgo_t algo;
} lg_lt_plan;
#endif

/* One GPU of a run: the rank's device, its streams, and its scratch in the plan's cuda.*
   regions of the rank's device arena (see LG_CUDA_MATMUL_WORKSPACE in litgpt.h). */
struct lg_cuda_rank {
    int device;
    cudaStream_t stream;        /* the ops, in order */
    cudaStream_t comm;          /* the collectives */
    cudaEvent_t compute_done;   /* fences between the two streams */
    cudaEvent_t comm_done;
    cudaEvent_t signals[LG_COMM_SIGNALS]; /* an _async collective raising that signal is done */
    cudaEvent_t beside_done[LG_BESIDE_MARKS]; /* the last copy beside the compute into or out
                                                 of each offload slot is done (--offload
                                                 activations' slots, then gradients') */
#ifndef LG_CUDA_EMULATE
    cublasLtHandle_t lt;
    lg_lt_plan lt_plans[LG_LT_CACHE]; /* a cache of matmul plans by shape */
    int lt_plan_count;                /* plans made so far (slot count % LG_LT_CACHE is next) */
#endif
    void *matmul_workspace;     /* (matmul_workspace_bytes): cuBLASLt's */
    size_t matmul_workspace_bytes;
    int *tokens, *targets;      /* (token_capacity): the micro-batch's ids, copied for the ops */
    size_t token_capacity;      /* B T */
    float *row_sums;            /* (LG_CUDA_ROW_CHUNKS, 2 C): per-chunk partial sums (norms) */
    int C;                      /* n_embd: the width row_sums was planned for */
    double *totals;             /* (LG_CUDA_REDUCE_SLOTS): partial sums of whole reductions */
    unsigned char *staging;     /* (staging_bytes): pinned host memory, the host's window onto
                                   the GPU's memory (lg_visit) */
    size_t staging_bytes;
    int tf32;                   /* fp32 matmuls may use TF32 (--tf32) */
    int reference_matmul;       /* matmuls by the reference kernel instead of cuBLASLt (tests) */
    int matmul_fallbacks;       /* matmuls cuBLASLt had no algorithm for (the reference ran) */
    int cuda_core_attention;    /* attention on CUDA cores even where tensor cores apply (tests) */
    char stopped[1024];         /* why the rank stopped computing (its first failure an op could
                                   not return: lg_cuda_stop); "" while it computes */
};

/* 1 when the GPU can read p (device, managed or pinned memory), 0 for pageable host memory. */
static int lg_cuda_device_accessible(const void *p);

/* The rank's stream, with its GPU made current: every op of a rank starts here, so one thread
   can drive the ranks of all GPUs in turn. */
static cudaStream_t lg_cuda_stream(const lg_exec *ex) {
    LG_CUDA_TRY(cudaSetDevice(ex->cuda->device));
    return ex->cuda->stream;
}

/* lg_visit's piece on a GPU: as many whole units as the staging region holds, in it. */
static void lg_cuda_visit_piece(lg_visit *v) {
    const lg_cuda_rank *g = v->ex->cuda;
    size_t units = g->staging_bytes / lg_elem_size(v->x.dtype) / v->unit;
    if (units == 0) {
        fprintf(stderr, "CUDA backend: a visit's unit of %zu elements exceeds the staging region "
                "(%zu bytes)\n", v->unit, g->staging_bytes);
        abort();
    }
    if (v->n > units * v->unit) v->n = units * v->unit;
    v->piece.data = g->staging;
}

/* Copies lg_visit's piece from the GPU (back = 0) or back to it, after the rank's queued work. */
static void lg_cuda_visit_copy(lg_visit *v, int back) {
    cudaStream_t stream = lg_cuda_stream(v->ex);
    size_t bytes = v->n * lg_elem_size(v->x.dtype);
    void *there = lg_at(v->x, v->first).data;
    LG_CUDA_TRY(cudaMemcpyAsync(back ? there : v->piece.data, back ? v->piece.data : there, bytes,
                                cudaMemcpyDefault, stream));
    LG_CUDA_TRY(cudaStreamSynchronize(stream)); /* the staging region is free again */
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

/* b-f. the kernels of section 7's ops, and the optimizers' and sums of squares' ------------- */

/* Every kernel reads and writes elements through lg_get / lg_set (the CPU's conversions) and
   computes in float, element by element in the same order of operations as the CPU loop it
   mirrors, so a GPU op differs from the CPU op only by float rounding (FMA contraction, the
   order of long sums). Reductions have a fixed shape (warp butterflies, then warps in order,
   then blocks or chunks in order): two runs give the same bits. */

/* Launch shapes */
#define LG_CUDA_WARP 32
#define LG_CUDA_FULL_MASK 0xffffffffu
#define LG_CUDA_MAX_WARPS 32           /* warps of a block (1024 threads) */
#define LG_CUDA_ELEMENT_THREADS 256    /* elementwise kernels */
#define LG_CUDA_ELEMENT_GRID_MAX 8192  /* grid-stride loops: blocks at most */
#define LG_CUDA_ROW_WARPS 8            /* norms: one warp a row, 8 rows a block */
#define LG_CUDA_CHANNEL_THREADS 256    /* norm weight gradients: channel runs a block at most */
#define LG_CUDA_LOADS_IN_FLIGHT 4      /* column reductions: rows a thread loads before adding */
#define LG_CUDA_CLASSIFIER_THREADS 256 /* cross-entropy: threads of a row's block */
#define LG_CUDA_SUM_THREADS 256        /* sums of squares and of losses */
#define LG_CUDA_TOTAL_SLOT (LG_CUDA_REDUCE_SLOTS - 1) /* totals[]: where a final sum lands; the
                                                         slots before it hold block partials */
#define LG_CUDA_EMBED_THREADS 128      /* embedding backward: channels of a block */
#define LG_CUDA_EMBED_CLASSES 64       /* ... and token-id classes (id % classes) of the grid */
#define LG_CUDA_TOKEN_TILE 1024        /* ids staged in shared memory at a time */

/* Threads of a block of a column reduction over `runs` column runs: as many as there are runs,
   in whole warps, up to `most` (no block mostly idle on a narrow matrix). */
static unsigned lg_cuda_run_threads(int runs, unsigned most) {
    unsigned warps = (unsigned)(runs + LG_CUDA_WARP - 1) / LG_CUDA_WARP;
    return warps * LG_CUDA_WARP < most ? warps * LG_CUDA_WARP : most;
}

/* b. element access and reductions shared by the kernels --------------------------------------- */

/* The first element of this thread in a grid-stride loop, and the stride. */
__device__ __forceinline__ size_t lg_k_first(void) {
    return (size_t)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ size_t lg_k_stride(void) { return (size_t)gridDim.x * blockDim.x; }

/* Blocks of a grid-stride loop over n elements. */
static unsigned lg_cuda_element_grid(size_t n) {
    unsigned blocks = lg_cuda_blocks(n, LG_CUDA_ELEMENT_THREADS);
    return blocks < LG_CUDA_ELEMENT_GRID_MAX ? blocks : LG_CUDA_ELEMENT_GRID_MAX;
}

/* v as its storage type holds it (what lg_set then lg_get leave). */
__device__ __forceinline__ float lg_k_round_to(lg_dtype dtype, float v) {
    if (dtype == LG_DTYPE_BF16) return lg_bf16_to_f32(lg_f32_to_bf16(v));
    if (dtype == LG_DTYPE_F16) return lg_f16_to_f32(lg_f32_to_f16(v));
    return v;
}

/* Sum over a warp by a butterfly: every lane gets the same bits. */
template <typename T> __device__ __forceinline__ T lg_k_warp_sum(T v) {
    for (int o = LG_CUDA_WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(LG_CUDA_FULL_MASK, v, o);
    return v;
}

/* Sum over the block (blockDim.x a multiple of 32): warps, then the warps' sums in order;
   every thread gets the total. scratch: LG_CUDA_MAX_WARPS shared slots, free again on return. */
template <typename T> __device__ T lg_k_block_sum(T v, T *scratch) {
    int warp = threadIdx.x / LG_CUDA_WARP, warps = blockDim.x / LG_CUDA_WARP;
    v = lg_k_warp_sum(v);
    if (threadIdx.x % LG_CUDA_WARP == 0) scratch[warp] = v;
    __syncthreads();
    T total = 0;
    for (int w = 0; w < warps; w++) total += scratch[w];
    __syncthreads();
    return total;
}

/* Online softmax statistics: the running maximum m of a set of logits and s = sum exp(x - m).
   An empty set is (-inf, 0). Merging is symmetric, so butterflies give every lane the same. */
__device__ __forceinline__ void lg_k_softmax_add(float *m, float *s, float x) {
    if (x > *m) {
        *s = *s * expf(*m - x) + 1.0f;
        *m = x;
    } else {
        *s += expf(x - *m);
    }
}

__device__ __forceinline__ void lg_k_softmax_merge(float *m, float *s, float m2, float s2) {
    float top = fmaxf(*m, m2);
    if (top == -INFINITY) return; /* both empty */
    float a = *s == 0.0f ? 0.0f : *s * expf(*m - top), b = s2 == 0.0f ? 0.0f : s2 * expf(m2 - top);
    *s = a + b;
    *m = top;
}

/* The block's (m, s) from each thread's; scratch_m, scratch_s: LG_CUDA_MAX_WARPS shared. */
static __device__ void lg_k_block_softmax_stats(float *m, float *s, float *scratch_m, float *scratch_s) {
    int warp = threadIdx.x / LG_CUDA_WARP, warps = blockDim.x / LG_CUDA_WARP;
    for (int o = LG_CUDA_WARP / 2; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(LG_CUDA_FULL_MASK, *m, o);
        float s2 = __shfl_xor_sync(LG_CUDA_FULL_MASK, *s, o);
        lg_k_softmax_merge(m, s, m2, s2);
    }
    if (threadIdx.x % LG_CUDA_WARP == 0) {
        scratch_m[warp] = *m;
        scratch_s[warp] = *s;
    }
    __syncthreads();
    *m = -INFINITY;
    *s = 0.0f;
    for (int w = 0; w < warps; w++) lg_k_softmax_merge(m, s, scratch_m[w], scratch_s[w]);
    __syncthreads();
}

/* c. elementwise kernels: add, copy/cast, GELU, SwiGLU, rotary -------------------------------- */
/* Elementwise kernels: a grid-stride loop (lg_k_map). When every buffer starts on a 16-byte
   boundary, which the plan's 256-byte regions give the model's views, a thread moves LG_PACK
   consecutive elements a turn with 16-byte loads and stores (several in flight: the bandwidth
   of memory-bound kernels); otherwise, and for the last n % LG_PACK elements, one element a
   turn. Each element is read before it is written and rounds as lg_set rounds, so the results
   are those of the CPU loop and the same in-place uses are allowed. */

#define LG_PACK 8 /* elements a thread moves a turn: one 16-byte access of halves, two of floats */

/* Whether b can be read and written LG_PACK elements at a time from element 0. */
__host__ __device__ __forceinline__ bool lg_k_packable(lg_buf b) {
    return (b.dtype == LG_DTYPE_F32 || b.dtype == LG_DTYPE_BF16 || b.dtype == LG_DTYPE_F16) &&
           (uintptr_t)b.data % 16 == 0;
}

/* v (LG_PACK) = b (i .. i + LG_PACK - 1), i a multiple of LG_PACK, as lg_get reads them. */
__device__ __forceinline__ void lg_k_load_pack(lg_buf b, size_t i, float *v) {
    if (b.dtype == LG_DTYPE_F32) {
        const float4 *p = (const float4 *)((const float *)b.data + i);
#pragma unroll
        for (int h = 0; h < LG_PACK / 4; h++) {
            float4 q = p[h];
            v[4 * h] = q.x, v[4 * h + 1] = q.y, v[4 * h + 2] = q.z, v[4 * h + 3] = q.w;
        }
        return;
    }
    uint4 q = *(const uint4 *)((const uint16_t *)b.data + i);
    uint32_t words[4] = {q.x, q.y, q.z, q.w}; /* element k: the low half of word k / 2 first */
#pragma unroll
    for (int k = 0; k < LG_PACK; k++) {
        uint16_t bits = (uint16_t)(words[k / 2] >> (16 * (k % 2)));
        v[k] = b.dtype == LG_DTYPE_BF16 ? lg_bf16_to_f32(bits) : lg_f16_to_f32(bits);
    }
}

/* b (i .. i + LG_PACK - 1) = v (LG_PACK), rounded as lg_set rounds. */
__device__ __forceinline__ void lg_k_store_pack(lg_buf b, size_t i, const float *v) {
    if (b.dtype == LG_DTYPE_F32) {
        float4 *p = (float4 *)((float *)b.data + i);
#pragma unroll
        for (int h = 0; h < LG_PACK / 4; h++)
            p[h] = make_float4(v[4 * h], v[4 * h + 1], v[4 * h + 2], v[4 * h + 3]);
        return;
    }
    uint32_t words[4] = {0, 0, 0, 0};
#pragma unroll
    for (int k = 0; k < LG_PACK; k++) {
        uint16_t bits = b.dtype == LG_DTYPE_BF16 ? lg_f32_to_bf16(v[k]) : lg_f32_to_f16(v[k]);
        words[k / 2] |= (uint32_t)bits << (16 * (k % 2));
    }
    *(uint4 *)((uint16_t *)b.data + i) = make_uint4(words[0], words[1], words[2], words[3]);
}

/* Kernels over rows of C channels (embeddings, norm weight gradients) move runs of `width`
   channels a thread: LG_PACK when C is a multiple of it and every buffer (NULL: absent) starts
   on a 16-byte boundary, so that every row does; else 1. */
static int lg_cuda_run_width(int C, const lg_buf *bufs, int count) {
    if (C % LG_PACK != 0) return 1;
    for (int k = 0; k < count; k++)
        if (bufs[k].data && !lg_k_packable(bufs[k])) return 1;
    return LG_PACK;
}

/* v (width) = b (i .. i + width - 1): a pack (width LG_PACK, i a multiple of it) or one element. */
__device__ __forceinline__ void lg_k_load_run(lg_buf b, size_t i, int width, float *v) {
    if (width == LG_PACK) lg_k_load_pack(b, i, v);
    else v[0] = lg_get(b, i);
}

/* b (i .. i + width - 1) = v (width), rounded as lg_set rounds. */
__device__ __forceinline__ void lg_k_store_run(lg_buf b, size_t i, int width, const float *v) {
    if (width == LG_PACK) lg_k_store_pack(b, i, v);
    else lg_set(b, i, v[0]);
}

/* Whether every buffer of bufs can move LG_PACK elements at a time from element 0. */
template <int N> __device__ __forceinline__ bool lg_k_all_packable(const lg_buf (&bufs)[N]) {
    bool packed = true;
    for (int k = 0; k < N; k++) packed = packed && lg_k_packable(bufs[k]);
    return packed;
}

/* out[k] (n) = the k-th result of f on the elements of in (n each), element by element, for
   the elements of the loop that starts at `first` and steps `stride` (packs when every buffer
   allows, then single elements): f(i, x, y) maps element i's NIN inputs x to its NOUT
   outputs y. */
template <int NIN, int NOUT, typename F>
__device__ __forceinline__ void lg_k_map_strided(const lg_buf (&in)[NIN], const lg_buf (&out)[NOUT],
                                                 size_t n, size_t first, size_t stride, F f) {
    size_t packs = lg_k_all_packable(in) && lg_k_all_packable(out) ? n / LG_PACK : 0;
    for (size_t p = first; p < packs; p += stride) {
        float x[NIN][LG_PACK], y[NOUT][LG_PACK], xj[NIN], yj[NOUT];
        for (int k = 0; k < NIN; k++) lg_k_load_pack(in[k], p * LG_PACK, x[k]);
#pragma unroll
        for (int j = 0; j < LG_PACK; j++) {
            for (int k = 0; k < NIN; k++) xj[k] = x[k][j];
            f(p * LG_PACK + j, xj, yj);
            for (int k = 0; k < NOUT; k++) y[k][j] = yj[k];
        }
        for (int k = 0; k < NOUT; k++) lg_k_store_pack(out[k], p * LG_PACK, y[k]);
    }
    for (size_t i = packs * LG_PACK + first; i < n; i += stride) {
        float xj[NIN], yj[NOUT];
        for (int k = 0; k < NIN; k++) xj[k] = lg_get(in[k], i);
        f(i, xj, yj);
        for (int k = 0; k < NOUT; k++) lg_set(out[k], i, yj[k]);
    }
}

/* f(x) on the elements of in (n each) of the loop from `first` by `stride`, as
   lg_k_map_strided reads them (nothing written): the reductions' first passes. */
template <int NIN, typename F>
__device__ __forceinline__ void lg_k_read_strided(const lg_buf (&in)[NIN], size_t n, size_t first,
                                                  size_t stride, F f) {
    size_t packs = lg_k_all_packable(in) ? n / LG_PACK : 0;
    for (size_t p = first; p < packs; p += stride) {
        float x[NIN][LG_PACK], xj[NIN];
        for (int k = 0; k < NIN; k++) lg_k_load_pack(in[k], p * LG_PACK, x[k]);
#pragma unroll
        for (int j = 0; j < LG_PACK; j++) {
            for (int k = 0; k < NIN; k++) xj[k] = x[k][j];
            f(xj);
        }
    }
    for (size_t i = packs * LG_PACK + first; i < n; i += stride) {
        float xj[NIN];
        for (int k = 0; k < NIN; k++) xj[k] = lg_get(in[k], i);
        f(xj);
    }
}

/* out[k] (n) = the k-th result of f on the elements of in (n each), element by element, over
   the whole grid: f(x, y) maps one element's NIN inputs x to its NOUT outputs y. */
template <int NIN, int NOUT, typename F>
__device__ __forceinline__ void lg_k_map(const lg_buf (&in)[NIN], const lg_buf (&out)[NOUT],
                                         size_t n, F f) {
    lg_k_map_strided(in, out, n, lg_k_first(), lg_k_stride(),
                     [&f](size_t, const float *x, float *y) { f(x, y); });
}

/* Blocks of an elementwise kernel over n elements: one thread a pack. */
static unsigned lg_cuda_map_grid(size_t n) { return lg_cuda_element_grid((n + LG_PACK - 1) / LG_PACK); }

__global__ void lg_k_add(lg_buf out, lg_buf a, lg_buf b, size_t n) {
    const lg_buf in[2] = {a, b}, to[1] = {out};
    lg_k_map(in, to, n, [](const float *x, float *y) { y[0] = x[0] + x[1]; });
}

__global__ void lg_k_cast(lg_buf dst, lg_buf src, size_t n) {
    const lg_buf in[1] = {src}, to[1] = {dst};
    lg_k_map(in, to, n, [](const float *x, float *y) { y[0] = x[0]; });
}

__global__ void lg_k_gelu_forward(lg_buf out, lg_buf inp, size_t n, int tanh_approx) {
    const lg_buf in[1] = {inp}, to[1] = {out};
    lg_k_map(in, to, n, [tanh_approx](const float *x, float *y) {
        y[0] = tanh_approx ? lg_gelu_tanh(x[0]) : lg_gelu_erf(x[0]);
    });
}

__global__ void lg_k_gelu_backward(lg_buf dinp, lg_buf dout, lg_buf inp, size_t n, int tanh_approx) {
    const lg_buf in[2] = {inp, dout}, to[1] = {dinp};
    lg_k_map(in, to, n, [tanh_approx](const float *x, float *y) {
        y[0] = x[1] * (tanh_approx ? lg_gelu_tanh_grad(x[0]) : lg_gelu_erf_grad(x[0]));
    });
}

__global__ void lg_k_swiglu_forward(lg_buf out, lg_buf gate, lg_buf up, size_t n) {
    const lg_buf in[2] = {gate, up}, to[1] = {out};
    lg_k_map(in, to, n, [](const float *x, float *y) { y[0] = x[0] * lg_sigmoid(x[0]) * x[1]; });
}

__global__ void lg_k_swiglu_backward(lg_buf dgate, lg_buf dup, lg_buf dout, lg_buf gate, lg_buf up,
                                     size_t n) {
    const lg_buf in[3] = {gate, up, dout}, to[2] = {dup, dgate};
    lg_k_map(in, to, n, [](const float *x, float *y) {
        float g = x[0], d = x[2], sig = lg_sigmoid(g), silu = g * sig;
        y[0] = d * silu;
        y[1] = d * x[1] * (sig + silu * (1.0f - sig));
    });
}

/* One thread a run of `width` rotated pairs (j .. j + width - 1, and the same + R) of one head
   of one token: pairs = B T heads R; width LG_PACK (16-byte accesses) when R and HS are
   multiples of it and qkv and the tables start on 16 bytes, else 1. */
__global__ void lg_k_rope_rotate(lg_buf qkv, lg_buf cos_table, lg_buf sin_table, int T, int heads,
                                 int QKV, int HS, int R, size_t pairs, int width, int direction) {
    for (size_t u = lg_k_first(); u < pairs / width; u += lg_k_stride()) {
        size_t p = u * width;
        int j = (int)(p % R), h = (int)(p / R % heads);
        size_t n = p / ((size_t)R * heads), at = n % T * R + j;
        lg_buf x = lg_at(qkv, n * QKV + (size_t)h * HS);
        float a[LG_PACK], b[LG_PACK], c[LG_PACK], sn[LG_PACK];
        lg_k_load_run(x, j, width, a);
        lg_k_load_run(x, j + R, width, b);
        lg_k_load_run(cos_table, at, width, c);
        lg_k_load_run(sin_table, at, width, sn);
        for (int k = 0; k < width; k++) {
            float s = direction * sn[k], first = a[k] * c[k] - b[k] * s;
            b[k] = b[k] * c[k] + a[k] * s;
            a[k] = first;
        }
        lg_k_store_run(x, j, width, a);
        lg_k_store_run(x, j + R, width, b);
    }
}

static void lg_cuda_add(const lg_exec *ex, lg_buf out, lg_buf a, lg_buf b, size_t n) {
    if (n == 0) return;
    LG_LAUNCH(lg_k_add, lg_cuda_map_grid(n), LG_CUDA_ELEMENT_THREADS, 0, lg_cuda_stream(ex),
              out, a, b, n);
}

/* dst (n) = src (n): a copy when the types agree, else a cast on the GPU, or on the host when
   either side is pageable host memory (after the queued work). */
static void lg_cuda_copy(const lg_exec *ex, lg_buf dst, lg_buf src, size_t n) {
    if (n == 0) return;
    int to_host = !lg_cuda_device_accessible(dst.data), from_host = !lg_cuda_device_accessible(src.data);
    if (to_host || from_host) { /* pageable host memory: through the staging region, at once */
        lg_visit v = lg_visit_start(ex, to_host ? src : dst, n, 1, to_host ? LG_VISIT_READ : LG_VISIT_WRITE);
        while (lg_visit_next(&v)) {
            lg_buf host = to_host ? lg_at(dst, v.first) : lg_at(src, v.first);
            if (dst.dtype == src.dtype)
                memcpy(to_host ? host.data : v.piece.data, to_host ? v.piece.data : host.data,
                       v.n * lg_elem_size(dst.dtype));
            else
                for (size_t i = 0; i < v.n; i++) {
                    if (to_host) lg_set(host, i, lg_get(v.piece, i));
                    else lg_set(v.piece, i, lg_get(host, i));
                }
        }
        return;
    }
    if (dst.dtype == src.dtype)
        LG_CUDA_TRY(cudaMemcpyAsync(dst.data, src.data, n * lg_elem_size(dst.dtype),
                                    cudaMemcpyDefault, lg_cuda_stream(ex)));
    else
        LG_LAUNCH(lg_k_cast, lg_cuda_map_grid(n), LG_CUDA_ELEMENT_THREADS, 0,
                  lg_cuda_stream(ex), dst, src, n);
}

/* dst (n) = src (n), same storage type, on the rank's communication stream after the ops queued
   so far on its compute stream: the copy runs beside the compute that follows (lg_rank_sync
   waits for it). */
static void lg_cuda_copy_beside(const lg_exec *ex, lg_buf dst, lg_buf src, size_t n) {
    lg_cuda_rank *g = ex->cuda;
    if (n == 0) return;
    if (dst.dtype != src.dtype) {
        lg_cuda_copy(ex, dst, src, n);
        return;
    }
    LG_CUDA_TRY(cudaEventRecord(g->compute_done, lg_cuda_stream(ex)));
    LG_CUDA_TRY(cudaStreamWaitEvent(g->comm, g->compute_done, 0));
    LG_CUDA_TRY(cudaMemcpyAsync(dst.data, src.data, n * lg_elem_size(src.dtype), cudaMemcpyDefault,
                                g->comm));
}

/* Marks the copies beside queued so far as slot k's (lg_mark_beside), and makes the compute
   stream wait for that mark alone (lg_wait_beside): the host does not wait. */
static void lg_cuda_mark_beside(const lg_exec *ex, int slot) {
    LG_CUDA_TRY(cudaEventRecord(ex->cuda->beside_done[slot], ex->cuda->comm));
}
static void lg_cuda_wait_beside(const lg_exec *ex, int slot) {
    LG_CUDA_TRY(cudaStreamWaitEvent(lg_cuda_stream(ex), ex->cuda->beside_done[slot], 0));
}
/* The host waits for slot k's copies (lg_finish_beside). */
static void lg_cuda_finish_beside(const lg_exec *ex, int slot) {
    LG_CUDA_TRY(cudaEventSynchronize(ex->cuda->beside_done[slot]));
}

static void lg_cuda_zero(const lg_exec *ex, lg_buf x, size_t n) {
    if (n == 0) return;
    LG_CUDA_TRY(cudaMemsetAsync(x.data, 0, n * lg_elem_size(x.dtype), lg_cuda_stream(ex)));
}

/* NF4 weights back (lg_nf4_dequantize_range): out (n) = elements first .. first + n of the
   stored tensor (first even), one thread a byte of codes, its two elements. */
__global__ void lg_k_nf4_dequantize(lg_nf4_codebook book, lg_nf4_layout layout, lg_quantization q,
                                    const uint8_t *src, size_t first, size_t n, lg_buf out) {
    size_t pairs = (n + 1) / 2;
    for (size_t p = lg_k_first(); p < pairs; p += lg_k_stride()) {
        size_t i = first + 2 * p;
        float absmax = lg_nf4_block_absmax(&book, src, &layout, q, i / LG_NF4_BLOCK);
        lg_set(out, 2 * p, book.nf4[lg_nf4_code_at(src, i)] * absmax);
        if (2 * p + 1 < n) lg_set(out, 2 * p + 1, book.nf4[lg_nf4_code_at(src, i + 1)] * absmax);
    }
}

static void lg_cuda_nf4_dequantize(const lg_exec *ex, const uint8_t *src, size_t count,
                                   lg_quantization q, size_t first, size_t n, lg_buf out) {
    if (n == 0) return;
    lg_nf4_codebook book;
    lg_nf4_codebook_make(&book);
    size_t pairs = (n + 1) / 2;
    LG_LAUNCH(lg_k_nf4_dequantize, lg_cuda_element_grid(pairs), LG_CUDA_ELEMENT_THREADS, 0,
              lg_cuda_stream(ex), book, lg_nf4_layout_of(count, q), q, src, first, n, out);
}

/* out (n) = gelu(inp (n)) */
static void lg_cuda_gelu_forward(const lg_exec *ex, lg_buf out, lg_buf inp, size_t n,
                                 int tanh_approx) {
    if (n == 0) return;
    LG_LAUNCH(lg_k_gelu_forward, lg_cuda_map_grid(n), LG_CUDA_ELEMENT_THREADS, 0,
              lg_cuda_stream(ex), out, inp, n, tanh_approx);
}

/* dinp (n) = dout (n) gelu'(inp (n)) */
static void lg_cuda_gelu_backward(const lg_exec *ex, lg_buf dinp, lg_buf dout, lg_buf inp,
                                  size_t n, int tanh_approx) {
    if (n == 0) return;
    LG_LAUNCH(lg_k_gelu_backward, lg_cuda_map_grid(n), LG_CUDA_ELEMENT_THREADS, 0,
              lg_cuda_stream(ex), dinp, dout, inp, n, tanh_approx);
}

/* out (n) = silu(gate (n)) up (n) */
static void lg_cuda_swiglu_forward(const lg_exec *ex, lg_buf out, lg_buf gate, lg_buf up,
                                   size_t n) {
    if (n == 0) return;
    LG_LAUNCH(lg_k_swiglu_forward, lg_cuda_map_grid(n), LG_CUDA_ELEMENT_THREADS, 0,
              lg_cuda_stream(ex), out, gate, up, n);
}

/* dgate, dup (n) from dout (n), gate (n), up (n) */
static void lg_cuda_swiglu_backward(const lg_exec *ex, lg_buf dgate, lg_buf dup, lg_buf dout,
                                    lg_buf gate, lg_buf up, size_t n) {
    if (n == 0) return;
    LG_LAUNCH(lg_k_swiglu_backward, lg_cuda_map_grid(n), LG_CUDA_ELEMENT_THREADS, 0,
              lg_cuda_stream(ex), dgate, dup, dout, gate, up, n);
}

/* qkv (B, T, (NH + 2 NQG) HS): rotates the first rope_dims of each query and key head in place;
   cos_table, sin_table (T, rope_dims / 2). */
static void lg_cuda_rope_rotate(const lg_exec *ex, lg_buf qkv, const lg_real *cos_table,
                                const lg_real *sin_table, int B, int T, int NH, int NQG, int HS,
                                int rope_dims, int direction) {
    int R = rope_dims / 2, heads = NH + NQG, QKV = (NH + 2 * NQG) * HS;
    size_t pairs = (size_t)B * T * heads * R;
    if (pairs == 0) return;
    lg_buf cos_buf = {(void *)cos_table, LG_DTYPE_F32}, sin_buf = {(void *)sin_table, LG_DTYPE_F32};
    const lg_buf bufs[3] = {qkv, cos_buf, sin_buf};
    int width = HS % LG_PACK == 0 ? lg_cuda_run_width(R, bufs, 3) : 1;
    LG_LAUNCH(lg_k_rope_rotate, lg_cuda_element_grid(pairs / width), LG_CUDA_ELEMENT_THREADS, 0,
              lg_cuda_stream(ex), qkv, cos_buf, sin_buf, T, heads, QKV, HS, R, pairs, width,
              direction);
}

/* d. embedding, LayerNorm/RMSNorm -------------------------------------------------------------- */

/* One thread a run of `width` channels of out (N, C) (lg_cuda_run_width): a grid-stride loop
   over N C / width. */
__global__ void lg_k_embedding_forward(lg_buf out, const int *tokens, lg_buf wte, lg_buf wpe,
                                       int T, int C, size_t count, int width) {
    for (size_t u = lg_k_first(); u < count / width; u += lg_k_stride()) {
        size_t e = u * width, n = e / C, i = e % C;
        float x[LG_PACK], p[LG_PACK];
        lg_k_load_run(wte, (size_t)tokens[n] * C + i, width, x);
        if (wpe.data) {
            lg_k_load_run(wpe, (n % T) * C + i, width, p);
            for (int j = 0; j < width; j++) x[j] += p[j];
        }
        lg_k_store_run(out, e, width, x);
    }
}

/* dwte (Vp, C) += dout (N, C) by token. A block owns LG_CUDA_EMBED_THREADS runs of `width`
   channels (a thread each) for the token ids of one class (id % LG_CUDA_EMBED_CLASSES): it
   walks all N ids in order, staged in shared memory, and adds the rows of its class. So each
   element of dwte has one owner that adds in token order, rounding after each add, exactly as
   the CPU loop. */
__global__ void lg_k_embedding_backward_wte(lg_buf dwte, lg_buf dout, const int *tokens, int N,
                                            int C, int width) {
    __shared__ int ids[LG_CUDA_TOKEN_TILE];
    int runs = C / width, channel_blocks = (runs + LG_CUDA_EMBED_THREADS - 1) / LG_CUDA_EMBED_THREADS;
    int cls = blockIdx.x / channel_blocks;
    int i = ((blockIdx.x % channel_blocks) * LG_CUDA_EMBED_THREADS + threadIdx.x) * width;
    for (int n0 = 0; n0 < N; n0 += LG_CUDA_TOKEN_TILE) {
        int len = N - n0 < LG_CUDA_TOKEN_TILE ? N - n0 : LG_CUDA_TOKEN_TILE;
        for (int k = threadIdx.x; k < len; k += blockDim.x) ids[k] = tokens[n0 + k];
        __syncthreads();
        if (i < C)
            for (int k = 0; k < len; k++) {
                int token = ids[k];
                if (token % LG_CUDA_EMBED_CLASSES != cls) continue;
                size_t at = (size_t)token * C + i;
                float acc[LG_PACK], d[LG_PACK];
                lg_k_load_run(dwte, at, width, acc);
                lg_k_load_run(dout, (size_t)(n0 + k) * C + i, width, d);
                for (int j = 0; j < width; j++) acc[j] += d[j];
                lg_k_store_run(dwte, at, width, acc);
            }
        __syncthreads();
    }
}

/* dwpe (T, C) += dout summed over the batch: one thread a run of `width` elements of dwpe,
   adding the B rows of its position in order, rounding after each add as the CPU does. */
__global__ void lg_k_embedding_backward_wpe(lg_buf dwpe, lg_buf dout, int B, int T, int C,
                                            int width) {
    size_t count = (size_t)T * C;
    for (size_t u = lg_k_first(); u < count / width; u += lg_k_stride()) {
        size_t e = u * width;
        float acc[LG_PACK], d[LG_PACK];
        lg_k_load_run(dwpe, e, width, acc);
        for (int b = 0; b < B; b++) {
            lg_k_load_run(dout, (size_t)b * count + e, width, d);
            for (int j = 0; j < width; j++) acc[j] = lg_k_round_to(dwpe.dtype, acc[j] + d[j]);
        }
        lg_k_store_run(dwpe, e, width, acc);
    }
}

/* out (N, C) = wte (Vp, C)[tokens (B, T)] + wpe (block_size, C)[t]; tokens on the host */
static void lg_cuda_embedding_forward(const lg_exec *ex, lg_buf out, const int *tokens,
                                      lg_buf wte, lg_buf wpe, int B, int T, int C) {
    size_t count = (size_t)B * T * C;
    if (count == 0) return;
    const lg_buf bufs[3] = {out, wte, wpe};
    int width = lg_cuda_run_width(C, bufs, 3);
    const int *ids = lg_cuda_ids(ex, ex->cuda->tokens, tokens, (size_t)B * T);
    LG_LAUNCH(lg_k_embedding_forward, lg_cuda_element_grid(count / width), LG_CUDA_ELEMENT_THREADS,
              0, lg_cuda_stream(ex), out, ids, wte, wpe, T, C, count, width);
}

/* dwte (Vp, C), dwpe (block_size, C) += dout (B T, C) scattered back; tokens on the host */
static void lg_cuda_embedding_backward(const lg_exec *ex, lg_buf dwte, lg_buf dwpe, lg_buf dout,
                                       const int *tokens, int B, int T, int C) {
    int N = B * T;
    if (N == 0 || C == 0) return;
    const lg_buf bufs[3] = {dwte, dwpe, dout};
    int width = lg_cuda_run_width(C, bufs, 3);
    const int *ids = lg_cuda_ids(ex, ex->cuda->tokens, tokens, (size_t)N);
    unsigned blocks = lg_cuda_blocks((size_t)(C / width), LG_CUDA_EMBED_THREADS) * LG_CUDA_EMBED_CLASSES;
    LG_LAUNCH(lg_k_embedding_backward_wte, blocks, LG_CUDA_EMBED_THREADS, 0, lg_cuda_stream(ex),
              dwte, dout, ids, N, C, width);
    if (dwpe.data)
        LG_LAUNCH(lg_k_embedding_backward_wpe, lg_cuda_element_grid((size_t)T * C / width),
                  LG_CUDA_ELEMENT_THREADS, 0, lg_cuda_stream(ex), dwpe, dout, B, T, C, width);
}

/* One warp a row (LG_CUDA_ROW_WARPS rows a block): lanes stride the row's packs of LG_PACK
   channels (16-byte accesses, when the row and the weights start on 16-byte boundaries; then
   single channels); the mean, then the variance about it (two passes, as the CPU), by warp
   butterflies. One row x (C) normalised into y (C) by the calling warp; its mean (LayerNorm,
   when mean) and rstd stored by lane 0. */
static __device__ void lg_k_norm_row(lg_buf y, lg_buf x, lg_real *mean, lg_real *rstd, int row,
                                     lg_buf weight, lg_buf bias, int C, float eps, int lane) {
    float mu = 0.0f, var = 0.0f;
    const lg_buf xs[1] = {x};
    if (mean) {
        lg_k_read_strided(xs, C, lane, LG_CUDA_WARP, [&mu](const float *v) { mu += v[0]; });
        mu = lg_k_warp_sum(mu) / C;
    }
    lg_k_read_strided(xs, C, lane, LG_CUDA_WARP,
                      [&var, mu](const float *v) { var += (v[0] - mu) * (v[0] - mu); });
    var = lg_k_warp_sum(var);
    float r = 1.0f / sqrtf(var / C + eps);
    const lg_buf to[1] = {y};
    if (bias.data) {
        const lg_buf in[3] = {x, weight, bias};
        lg_k_map_strided(in, to, C, lane, LG_CUDA_WARP, [mu, r](size_t, const float *v, float *o) {
            o[0] = (v[0] - mu) * r * v[1] + v[2];
        });
    } else {
        const lg_buf in[2] = {x, weight};
        lg_k_map_strided(in, to, C, lane, LG_CUDA_WARP, [mu, r](size_t, const float *v, float *o) {
            o[0] = (v[0] - mu) * r * v[1] + 0.0f;
        });
    }
    if (lane == 0) {
        if (mean) mean[row] = mu;
        rstd[row] = r;
    }
}

__global__ void lg_k_norm_forward(lg_buf out, lg_real *mean, lg_real *rstd, lg_buf inp,
                                  lg_buf weight, lg_buf bias, int N, int C, float eps) {
    int row = blockIdx.x * LG_CUDA_ROW_WARPS + threadIdx.x / LG_CUDA_WARP;
    int lane = threadIdx.x % LG_CUDA_WARP;
    if (row >= N) return; /* the whole warp: no block barriers here */
    lg_k_norm_row(lg_at(out, (size_t)row * C), lg_at(inp, (size_t)row * C), mean, rstd, row,
                  weight, bias, C, eps, lane);
}

/* The residual add fused with the norm after it: a warp a row writes sum = a + b, then
   normalises the row it wrote (read back rounded to its storage, as the CPU's lg_add leaves
   it). */
__global__ void lg_k_residual_norm_forward(lg_buf sum, lg_buf out, lg_real *mean, lg_real *rstd,
                                           lg_buf a, lg_buf b, lg_buf weight, lg_buf bias, int N,
                                           int C, float eps) {
    int row = blockIdx.x * LG_CUDA_ROW_WARPS + threadIdx.x / LG_CUDA_WARP;
    int lane = threadIdx.x % LG_CUDA_WARP;
    if (row >= N) return;
    size_t first = (size_t)row * C;
    lg_buf s = lg_at(sum, first), x = lg_at(a, first), y = lg_at(b, first);
    const lg_buf in[2] = {x, y}, to[1] = {s};
    lg_k_map_strided(in, to, C, lane, LG_CUDA_WARP,
                     [](size_t, const float *v, float *o) { o[0] = v[0] + v[1]; });
    __syncwarp(); /* the norm's lanes may own other elements of s (other packing) */
    lg_k_norm_row(lg_at(out, first), s, mean, rstd, row, weight, bias, C, eps, lane);
}

/* dinp (N, C) += the gradient through the norm: one warp a row, as the forward. */
__global__ void lg_k_norm_backward_input(lg_buf dinp, lg_buf dout, lg_buf inp, lg_buf weight,
                                         const lg_real *mean, const lg_real *rstd, int N, int C) {
    int row = blockIdx.x * LG_CUDA_ROW_WARPS + threadIdx.x / LG_CUDA_WARP;
    int lane = threadIdx.x % LG_CUDA_WARP;
    if (row >= N) return;
    lg_buf x = lg_at(inp, (size_t)row * C), dy = lg_at(dout, (size_t)row * C);
    lg_buf dx = lg_at(dinp, (size_t)row * C);
    float mu = mean ? mean[row] : 0.0f, r = rstd[row];
    float dxhat_mean = 0.0f, dxhat_xhat_mean = 0.0f;
    const lg_buf reads[3] = {dy, weight, x};
    lg_k_read_strided(reads, C, lane, LG_CUDA_WARP,
                      [&dxhat_mean, &dxhat_xhat_mean, mu, r](const float *v) {
                          float dxhat = v[0] * v[1];
                          dxhat_mean += dxhat;
                          dxhat_xhat_mean += dxhat * (v[2] - mu) * r;
                      });
    dxhat_mean = mean ? lg_k_warp_sum(dxhat_mean) / C : 0.0f;
    dxhat_xhat_mean = lg_k_warp_sum(dxhat_xhat_mean) / C;
    const lg_buf in[4] = {dy, weight, x, dx}, to[1] = {dx};
    lg_k_map_strided(in, to, C, lane, LG_CUDA_WARP,
                     [dxhat_mean, dxhat_xhat_mean, mu, r](size_t, const float *v, float *o) {
                         float xhat = (v[2] - mu) * r;
                         o[0] = v[3] + r * (v[0] * v[1] - dxhat_mean - xhat * dxhat_xhat_mean);
                     });
}

/* Partial weight and bias gradients: block (channel block, chunk) sums the rows of its chunk
   (LG_CUDA_ROW_CHUNKS chunks of ceil(N / chunks) rows) in order, a thread a run of `width`
   channels (lg_cuda_run_width), into row_sums (chunks, 2 C): [chunk][0, C) dweight,
   [chunk][C, 2 C) dbias. */
__global__ void lg_k_norm_backward_chunks(float *row_sums, lg_buf dout, lg_buf inp,
                                          const lg_real *mean, const lg_real *rstd, int N, int C,
                                          int width) {
    constexpr int L = LG_CUDA_LOADS_IN_FLIGHT;
    int runs = C / width, channel_blocks = (runs + (int)blockDim.x - 1) / (int)blockDim.x;
    int chunk = blockIdx.x / channel_blocks;
    int i = ((blockIdx.x % channel_blocks) * (int)blockDim.x + threadIdx.x) * width;
    if (i >= C) return;
    int rows = (N + LG_CUDA_ROW_CHUNKS - 1) / LG_CUDA_ROW_CHUNKS;
    int first = chunk * rows, last = first + rows < N ? first + rows : N;
    float dw[LG_PACK] = {0}, db[LG_PACK] = {0};
    for (int n = first; n < last; n += L) { /* L rows' loads issued, then added in row order */
        float dy[L][LG_PACK], x[L][LG_PACK], mu[L], r[L];
        int count = last - n < L ? last - n : L;
        for (int k = 0; k < count; k++) {
            mu[k] = mean ? mean[n + k] : 0.0f, r[k] = rstd[n + k];
            lg_k_load_run(dout, (size_t)(n + k) * C + i, width, dy[k]);
            lg_k_load_run(inp, (size_t)(n + k) * C + i, width, x[k]);
        }
        for (int k = 0; k < count; k++)
            for (int j = 0; j < width; j++) {
                dw[j] += dy[k][j] * (x[k][j] - mu[k]) * r[k];
                db[j] += dy[k][j];
            }
    }
    for (int j = 0; j < width; j++) {
        row_sums[(size_t)chunk * 2 * C + i + j] = dw[j];
        row_sums[(size_t)chunk * 2 * C + C + i + j] = db[j];
    }
}

/* dweight, dbias (C) += the chunks' partial sums, in chunk order: a thread a channel. */
__global__ void lg_k_norm_backward_weights(lg_buf dweight, lg_buf dbias, const float *row_sums,
                                           int C) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= C) return;
    float dw = 0.0f, db = 0.0f;
    for (int chunk = 0; chunk < LG_CUDA_ROW_CHUNKS; chunk++) {
        dw += row_sums[(size_t)chunk * 2 * C + i];
        db += row_sums[(size_t)chunk * 2 * C + C + i];
    }
    lg_set(dweight, i, lg_get(dweight, i) + dw);
    if (dbias.data) lg_set(dbias, i, lg_get(dbias, i) + db);
}

/* LayerNorm (mean non-NULL) or RMSNorm (mean NULL) of inp (N, C): out (N, C), mean, rstd (N) */
static void lg_cuda_norm_forward(const lg_exec *ex, lg_buf out, lg_real *mean, lg_real *rstd,
                                 lg_buf inp, lg_buf weight, lg_buf bias, int N, int C, float eps) {
    if (N == 0) return;
    LG_LAUNCH(lg_k_norm_forward, lg_cuda_blocks((size_t)N, LG_CUDA_ROW_WARPS),
              LG_CUDA_ROW_WARPS * LG_CUDA_WARP, 0, lg_cuda_stream(ex), out, mean, rstd, inp,
              weight, bias, N, C, eps);
}

/* sum (N, C) = a + b (sum may be a or b); out (N, C), mean, rstd (N): the norm of sum */
static void lg_cuda_residual_norm_forward(const lg_exec *ex, lg_buf sum, lg_buf out,
                                          lg_real *mean, lg_real *rstd, lg_buf a, lg_buf b,
                                          lg_buf weight, lg_buf bias, int N, int C, float eps) {
    if (N == 0) return;
    LG_LAUNCH(lg_k_residual_norm_forward, lg_cuda_blocks((size_t)N, LG_CUDA_ROW_WARPS),
              LG_CUDA_ROW_WARPS * LG_CUDA_WARP, 0, lg_cuda_stream(ex), sum, out, mean, rstd, a,
              b, weight, bias, N, C, eps);
}

/* dinp (N, C) += ..., dweight, dbias (C) += ... from dout (N, C), inp (N, C), weight (C),
   mean, rstd (N); the weight gradients through the rank's row_sums (LG_CUDA_ROW_CHUNKS, 2 C) */
static void lg_cuda_norm_backward(const lg_exec *ex, lg_buf dinp, lg_buf dweight, lg_buf dbias,
                                  lg_buf dout, lg_buf inp, lg_buf weight, const lg_real *mean,
                                  const lg_real *rstd, int N, int C) {
    if (N == 0 || C == 0) return;
    if (C > ex->cuda->C) {
        fprintf(stderr, "CUDA backend: a norm of %d channels, row_sums planned for %d\n", C,
                ex->cuda->C);
        abort();
    }
    cudaStream_t stream = lg_cuda_stream(ex);
    LG_LAUNCH(lg_k_norm_backward_input, lg_cuda_blocks((size_t)N, LG_CUDA_ROW_WARPS),
              LG_CUDA_ROW_WARPS * LG_CUDA_WARP, 0, stream, dinp, dout, inp, weight, mean, rstd,
              N, C);
    if (!dweight.data) return; /* frozen (LoRA) */
    const lg_buf bufs[2] = {dout, inp};
    int width = lg_cuda_run_width(C, bufs, 2);
    unsigned threads = lg_cuda_run_threads(C / width, LG_CUDA_CHANNEL_THREADS);
    unsigned run_blocks = lg_cuda_blocks((size_t)(C / width), threads);
    LG_LAUNCH(lg_k_norm_backward_chunks, run_blocks * LG_CUDA_ROW_CHUNKS, threads, 0, stream,
              ex->cuda->row_sums, dout, inp, mean, rstd, N, C, width);
    LG_LAUNCH(lg_k_norm_backward_weights, lg_cuda_blocks((size_t)C, LG_CUDA_CHANNEL_THREADS),
              LG_CUDA_CHANNEL_THREADS, 0, stream, dweight, dbias, ex->cuda->row_sums, C);
}

/* e. the fused classifier (softmax, loss and the logits' gradient) ---------------------------- */

/* One block a row of logits (N, Vp). The row's softmax statistics in one read: threads stride
   the V real columns (packs of LG_PACK with 16-byte loads where the row allows, then single
   columns) keeping online statistics (m, s), merged over the block in a fixed order; every
   thread gets them. The probabilities are never stored. */
static __device__ void lg_k_row_softmax_stats(lg_buf z, int V, float *m, float *s) {
    __shared__ float scratch_m[LG_CUDA_MAX_WARPS], scratch_s[LG_CUDA_MAX_WARPS];
    *m = -INFINITY;
    *s = 0.0f;
    const lg_buf in[1] = {z};
    lg_k_read_strided(in, V, threadIdx.x, blockDim.x, [m, s](const float *x) { lg_k_softmax_add(m, s, x[0]); });
    lg_k_block_softmax_stats(m, s, scratch_m, scratch_s);
}

/* dz (Vp) = (softmax(z) - onehot(target)) scale over the V real columns from the row's
   statistics, 0 on the padded ones; dz may be z (each element read before it is written). */
static __device__ void lg_k_row_softmax_grad(lg_buf dz, lg_buf z, int V, int Vp, int target,
                                             float m, float s, float scale) {
    const lg_buf in[1] = {z}, to[1] = {dz};
    lg_k_map_strided(in, to, V, threadIdx.x, blockDim.x,
                     [m, s, scale, target](size_t v, const float *x, float *y) {
                         y[0] = (expf(x[0] - m) / s - (float)((int)v == target)) * scale;
                     });
    for (int v = V + threadIdx.x; v < Vp; v += blockDim.x) lg_set(dz, v, 0.0f);
}

/* losses[n] = log s + m - z[target] of row n, 0 on ignored rows. */
__global__ void lg_k_crossentropy_forward(lg_real *losses, lg_buf logits, const int *targets, int V,
                                          int Vp) {
    int n = blockIdx.x, target = targets[n];
    if (target == LG_IGNORE_INDEX) { /* the whole block */
        if (threadIdx.x == 0) losses[n] = 0.0f;
        return;
    }
    lg_buf z = lg_at(logits, (size_t)n * Vp);
    float m, s;
    lg_k_row_softmax_stats(z, V, &m, &s);
    if (threadIdx.x == 0) losses[n] = logf(s) + m - lg_get(z, target);
}

/* totals[slot] = the sum of losses (N) in double: one block, threads stride the rows, then the
   block's fixed reduction. */
__global__ void lg_k_sum_losses(double *totals, int slot, const lg_real *losses, int N) {
    __shared__ double scratch[LG_CUDA_MAX_WARPS];
    double sum = 0.0;
    for (int n = threadIdx.x; n < N; n += blockDim.x) sum += (double)losses[n];
    sum = lg_k_block_sum(sum, scratch);
    if (threadIdx.x == 0) totals[slot] = sum;
}

/* Row n's gradient (lg_k_row_softmax_grad); ignored rows get 0. */
__global__ void lg_k_crossentropy_backward(lg_buf dlogits, lg_buf logits, const int *targets, int V,
                                           int Vp, float scale) {
    int n = blockIdx.x, target = targets[n];
    lg_buf z = lg_at(logits, (size_t)n * Vp), dz = lg_at(dlogits, (size_t)n * Vp);
    if (target == LG_IGNORE_INDEX) {
        for (int v = threadIdx.x; v < Vp; v += blockDim.x) lg_set(dz, v, 0.0f);
        return;
    }
    float m, s;
    lg_k_row_softmax_stats(z, V, &m, &s);
    lg_k_row_softmax_grad(dz, z, V, Vp, target, m, s, scale);
}

/* The forward and the backward of row n in one read of its statistics: the loss, then the
   gradient written over the logits (the target's logit is read before the statistics' block
   barriers, so before any write). */
__global__ void lg_k_crossentropy_fused(lg_real *losses, lg_buf logits, const int *targets, int V,
                                        int Vp, float scale) {
    int n = blockIdx.x, target = targets[n];
    lg_buf z = lg_at(logits, (size_t)n * Vp);
    if (target == LG_IGNORE_INDEX) {
        if (threadIdx.x == 0) losses[n] = 0.0f;
        for (int v = threadIdx.x; v < Vp; v += blockDim.x) lg_set(z, v, 0.0f);
        return;
    }
    float target_logit = threadIdx.x == 0 ? lg_get(z, target) : 0.0f, m, s;
    lg_k_row_softmax_stats(z, V, &m, &s);
    if (threadIdx.x == 0) losses[n] = logf(s) + m - target_logit;
    lg_k_row_softmax_grad(z, z, V, Vp, target, m, s, scale);
}

/* The double at totals[slot], once the stream gets there. */
static double lg_cuda_read_total(const lg_exec *ex, int slot) {
    double total = 0;
    LG_CUDA_TRY(cudaMemcpyAsync(&total, ex->cuda->totals + slot, sizeof total, cudaMemcpyDefault,
                                lg_cuda_stream(ex)));
    LG_CUDA_TRY(cudaStreamSynchronize(lg_cuda_stream(ex)));
    return total;
}

/* losses (N) from logits (N, Vp) and targets (N, on the host); returns their sum (synchronises) */
static double lg_cuda_crossentropy_forward(const lg_exec *ex, lg_real *losses, lg_buf logits,
                                           const int *targets, int N, int V, int Vp) {
    if (N == 0) return 0.0;
    cudaStream_t stream = lg_cuda_stream(ex);
    const int *ids = lg_cuda_ids(ex, ex->cuda->targets, targets, (size_t)N);
    LG_LAUNCH(lg_k_crossentropy_forward, (unsigned)N, LG_CUDA_CLASSIFIER_THREADS, 0, stream,
              losses, logits, ids, V, Vp);
    LG_LAUNCH(lg_k_sum_losses, 1, LG_CUDA_SUM_THREADS, 0, stream, ex->cuda->totals,
              LG_CUDA_TOTAL_SLOT, (const lg_real *)losses, N);
    return lg_cuda_read_total(ex, LG_CUDA_TOTAL_SLOT);
}

/* losses (N) and their sum (returned; synchronises) as lg_cuda_crossentropy_forward, and the
   logits (N, Vp) replaced by their gradient as lg_cuda_crossentropy_backward in place: one
   kernel, the statistics of each row read once. */
static double lg_cuda_crossentropy_fused(const lg_exec *ex, lg_real *losses, lg_buf logits,
                                         const int *targets, int N, int V, int Vp, lg_real scale) {
    if (N == 0) return 0.0;
    cudaStream_t stream = lg_cuda_stream(ex);
    const int *ids = lg_cuda_ids(ex, ex->cuda->targets, targets, (size_t)N);
    LG_LAUNCH(lg_k_crossentropy_fused, (unsigned)N, LG_CUDA_CLASSIFIER_THREADS, 0, stream,
              losses, logits, ids, V, Vp, (float)scale);
    LG_LAUNCH(lg_k_sum_losses, 1, LG_CUDA_SUM_THREADS, 0, stream, ex->cuda->totals,
              LG_CUDA_TOTAL_SLOT, (const lg_real *)losses, N);
    return lg_cuda_read_total(ex, LG_CUDA_TOTAL_SLOT);
}

/* dlogits (N, Vp) = (softmax(logits) - onehot(target)) scale; may be logits */
static void lg_cuda_crossentropy_backward(const lg_exec *ex, lg_buf dlogits, lg_buf logits,
                                          const int *targets, int N, int V, int Vp, lg_real scale) {
    if (N == 0) return;
    const int *ids = lg_cuda_ids(ex, ex->cuda->targets, targets, (size_t)N);
    LG_LAUNCH(lg_k_crossentropy_backward, (unsigned)N, LG_CUDA_CLASSIFIER_THREADS, 0,
              lg_cuda_stream(ex), dlogits, logits, ids, V, Vp, (float)scale);
}

/* f. optimizers, sums of squares ------------------------------------------------------------- */

/* Block partials of sum x^2 in double: a grid-stride loop (packs of LG_PACK where x allows),
   then the block's reduction, into totals[blockIdx.x]. */
__global__ void lg_k_sum_squares_partial(double *totals, lg_buf x, size_t n) {
    __shared__ double scratch[LG_CUDA_MAX_WARPS];
    double sum = 0.0;
    const lg_buf in[1] = {x};
    lg_k_read_strided(in, n, lg_k_first(), lg_k_stride(), [&sum](const float *v) {
        double g = v[0];
        sum += g * g;
    });
    sum = lg_k_block_sum(sum, scratch);
    if (threadIdx.x == 0) totals[blockIdx.x] = sum;
}

/* totals[slot] = totals[0] + ... + totals[parts - 1]: one block, a fixed order. */
__global__ void lg_k_sum_partials(double *totals, int parts, int slot) {
    __shared__ double scratch[LG_CUDA_MAX_WARPS];
    double sum = 0.0;
    for (int k = threadIdx.x; k < parts; k += blockDim.x) sum += totals[k];
    sum = lg_k_block_sum(sum, scratch);
    if (threadIdx.x == 0) totals[slot] = sum;
}

/* sum of x (n)^2 in double; synchronises */
static double lg_cuda_sum_squares(const lg_exec *ex, lg_buf x, size_t n) {
    if (n == 0) return 0.0;
    cudaStream_t stream = lg_cuda_stream(ex);
    unsigned parts = lg_cuda_blocks((n + LG_PACK - 1) / LG_PACK, LG_CUDA_SUM_THREADS);
    if (parts > LG_CUDA_TOTAL_SLOT) parts = LG_CUDA_TOTAL_SLOT;
    LG_LAUNCH(lg_k_sum_squares_partial, parts, LG_CUDA_SUM_THREADS, 0, stream, ex->cuda->totals,
              x, n);
    LG_LAUNCH(lg_k_sum_partials, 1, LG_CUDA_SUM_THREADS, 0, stream, ex->cuda->totals, (int)parts,
              LG_CUDA_TOTAL_SLOT);
    return lg_cuda_read_total(ex, LG_CUDA_TOTAL_SLOT);
}

/* Where one table entry's elements live for the update kernels. */
typedef struct {
    size_t count;        /* elements */
    size_t offset;       /* k of its first element: grads, master */
    size_t origin;       /* its first element in the whole layout: the rounding draws */
    size_t weight_first; /* its first element in params: origin when params_whole, else offset */
    float decay;         /* weight decay, 0 for norms and biases */
} lg_cuda_update_span;

/* The updated weight to the master copy and/or the weights (lg_store_weight's rule). */
static __device__ void lg_k_store_weight(const lg_update_rule *rule, lg_buf params,
                                         lg_real *master, int stochastic, size_t k, size_t kw,
                                         size_t origin, float w) {
    if (master) master[k] = w;
    if (stochastic) ((uint16_t *)params.data)[kw] = lg_round_update(rule, w, params.dtype, origin);
    else lg_set(params, kw, w);
}

/* One element's update (lg_update_tensor's loop body): w the weight (master or params), g the
   gradient before the multiplier, m and v the state as stored (v as sqrt(v) with sqrt_v), all
   in and out. */
static __device__ __forceinline__ void lg_k_update_one(const lg_update_rule *rule, float *w,
                                                       float g, float *m, float *v, int sqrt_v,
                                                       float grad_multiplier, float decay) {
    float vk = sqrt_v ? *v * *v : *v;
    *w = lg_update_element(rule, *w, g * grad_multiplier, m, &vk, decay);
    *v = sqrt_v ? sqrtf(vk) : vk;
}

/* Grid-stride over a tensor for state stored as views (fp32, the precision's half type, or
   bf16; m and v indexed from the tensor's first element): a thread updates LG_PACK elements
   a turn with 16-byte loads and stores when every view allows (the weights rounded
   stochastically pack by pack when asked), then single elements; each element as
   lg_update_tensor computes it. */
__global__ void lg_k_optimizer_update(lg_update_rule rule, lg_cuda_update_span span, lg_buf params,
                                      lg_buf grads, lg_real *master, lg_buf m, lg_buf v,
                                      int sqrt_v, int stochastic, float grad_multiplier) {
    lg_buf weights = lg_at(params, span.weight_first), grad = lg_at(grads, span.offset);
    lg_buf masters = {master ? (void *)(master + span.offset) : NULL, LG_DTYPE_F32};
    bool packed = lg_k_packable(weights) && lg_k_packable(grad) &&
                  (!master || lg_k_packable(masters)) && (!m.data || lg_k_packable(m)) &&
                  (!v.data || lg_k_packable(v));
    size_t packs = packed ? span.count / LG_PACK : 0;
    for (size_t p = lg_k_first(); p < packs; p += lg_k_stride()) {
        size_t j0 = p * LG_PACK;
        float w[LG_PACK], g[LG_PACK], mk[LG_PACK] = {0}, vk[LG_PACK] = {0};
        lg_k_load_pack(master ? masters : weights, j0, w);
        lg_k_load_pack(grad, j0, g);
        if (m.data) lg_k_load_pack(m, j0, mk);
        if (v.data) lg_k_load_pack(v, j0, vk);
#pragma unroll
        for (int j = 0; j < LG_PACK; j++)
            lg_k_update_one(&rule, &w[j], g[j], &mk[j], &vk[j], sqrt_v, grad_multiplier, span.decay);
        if (m.data) lg_k_store_pack(m, j0, mk);
        if (v.data) lg_k_store_pack(v, j0, vk);
        if (master) lg_k_store_pack(masters, j0, w);
        if (!stochastic) {
            lg_k_store_pack(weights, j0, w);
            continue;
        }
        uint32_t words[4] = {0, 0, 0, 0}; /* as lg_k_store_pack lays out halves */
#pragma unroll
        for (int j = 0; j < LG_PACK; j++)
            words[j / 2] |= (uint32_t)lg_round_update(&rule, w[j], params.dtype, span.origin + j0 + j)
                            << (16 * (j % 2));
        *(uint4 *)((uint16_t *)weights.data + j0) = make_uint4(words[0], words[1], words[2], words[3]);
    }
    for (size_t j = packs * LG_PACK + lg_k_first(); j < span.count; j += lg_k_stride()) {
        size_t k = span.offset + j, kw = span.weight_first + j, origin = span.origin + j;
        float w = master ? master[k] : lg_get(params, kw);
        float mk = m.data ? lg_get(m, j) : 0.0f, vk = v.data ? lg_get(v, j) : 0.0f;
        lg_k_update_one(&rule, &w, lg_get(grads, k), &mk, &vk, sqrt_v, grad_multiplier, span.decay);
        if (m.data) lg_set(m, j, mk);
        if (v.data) lg_set(v, j, vk);
        lg_k_store_weight(&rule, params, master, stochastic, k, kw, origin, w);
    }
}

/* The 8-bit codes' maps, by value into the kernel (2 KiB of its parameters). */
typedef struct {
    float signed_map[256];   /* m's codes: ascending values in [-1, 1] */
    float unsigned_map[256]; /* v's */
} lg_cuda_quant_maps;

/* The largest |x| of the block's threads (every thread gets it; order-free, so exact). */
static __device__ float lg_k_block_absmax(float x, float *scratch) {
    float a = fabsf(x);
    for (int offset = LG_CUDA_WARP / 2; offset > 0; offset /= 2)
        a = fmaxf(a, __shfl_xor_sync(LG_CUDA_FULL_MASK, a, offset));
    int warp = (int)threadIdx.x / LG_CUDA_WARP, warps = (int)blockDim.x / LG_CUDA_WARP;
    __syncthreads(); /* scratch's last use is over */
    if (threadIdx.x % LG_CUDA_WARP == 0) scratch[warp] = a;
    __syncthreads();
    a = 0.0f;
    for (int w = 0; w < warps; w++) a = fmaxf(a, scratch[w]);
    return a;
}

/* 8-bit state: a block a quantization block (LG_QUANT_BLOCK elements, a thread each): decode
   m and v with the block's scales, update, then the new scales (the largest magnitude) and
   codes (the nearest map entry), as lg_update_tensor's 8-bit path. */
__global__ void lg_k_optimizer_update_8bit(lg_update_rule rule, lg_cuda_update_span span,
                                           lg_buf params, lg_buf grads, lg_real *master,
                                           uint8_t *m_codes, uint8_t *v_codes, float *m_scales,
                                           float *v_scales, lg_cuda_quant_maps maps,
                                           int stochastic, float grad_multiplier) {
    __shared__ float scratch[LG_CUDA_MAX_WARPS];
    size_t b = blockIdx.x, j = b * LG_QUANT_BLOCK + threadIdx.x;
    int active = j < span.count;
    float mk = 0.0f, vk = 0.0f;
    if (active) {
        size_t k = span.offset + j, kw = span.weight_first + j, origin = span.origin + j;
        float w = master ? master[k] : lg_get(params, kw);
        float g = lg_get(grads, k) * grad_multiplier;
        mk = maps.signed_map[m_codes[j]] * m_scales[b];
        vk = v_codes ? maps.unsigned_map[v_codes[j]] * v_scales[b] : 0.0f;
        w = lg_update_element(&rule, w, g, &mk, &vk, span.decay);
        lg_k_store_weight(&rule, params, master, stochastic, k, kw, origin, w);
    }
    float m_max = lg_k_block_absmax(active ? mk : 0.0f, scratch);
    float v_max = v_codes ? lg_k_block_absmax(active ? vk : 0.0f, scratch) : 0.0f;
    if (threadIdx.x == 0) {
        m_scales[b] = m_max;
        if (v_codes) v_scales[b] = v_max;
    }
    if (!active) return;
    m_codes[j] = lg_quantize(maps.signed_map, m_max > 0 ? mk / m_max : 0.0f);
    if (v_codes) v_codes[j] = lg_quantize(maps.unsigned_map, v_max > 0 ? vk / v_max : 0.0f);
}

/* lg_update_tensor on the GPU: one table entry, its state as `state` says (views, or 8-bit
   codes with a scale a block). */
static void lg_cuda_update_tensor(const lg_exec *ex, const lg_optimizer *opt,
                                  const lg_update_rule *rule, const lg_tensor_info *t,
                                  const lg_tensor_state *state, lg_buf params, int params_whole,
                                  lg_buf grads, float grad_multiplier, lg_real decay) {
    if (t->count == 0) return;
    lg_cuda_update_span span;
    span.count = t->count;
    span.offset = t->offset;
    span.origin = t->origin;
    span.weight_first = params_whole ? t->origin : t->offset;
    span.decay = decay;
    cudaStream_t stream = lg_cuda_stream(ex);
    if (state->m.dtype != LG_DTYPE_U8) {
        LG_LAUNCH(lg_k_optimizer_update, lg_cuda_map_grid(t->count), LG_CUDA_ELEMENT_THREADS,
                  0, stream, *rule, span, params, grads, opt->master, state->m, state->v,
                  opt->sqrt_v, opt->stochastic, grad_multiplier);
        return;
    }
    lg_cuda_quant_maps maps;
    memcpy(maps.signed_map, opt->signed_map, sizeof maps.signed_map);
    memcpy(maps.unsigned_map, opt->unsigned_map, sizeof maps.unsigned_map);
    LG_LAUNCH(lg_k_optimizer_update_8bit, lg_cuda_blocks(t->count, LG_QUANT_BLOCK), LG_QUANT_BLOCK,
              0, stream, *rule, span, params, grads, opt->master, (uint8_t *)state->m.data,
              (uint8_t *)state->v.data, state->m_scales, state->v_scales, maps, opt->stochastic,
              grad_multiplier);
}

/* Sophia's h = beta2 h + (1 - beta2) n_tokens (g grad_multiplier)^2, elementwise (lg_k_map). */
__global__ void lg_k_hessian_update(lg_buf h, lg_buf sampled_grads, size_t n, float beta2,
                                    float n_tokens, float grad_multiplier) {
    const lg_buf in[2] = {sampled_grads, h}, to[1] = {h};
    lg_k_map(in, to, n, [beta2, n_tokens, grad_multiplier](const float *x, float *y) {
        float g = x[0] * grad_multiplier;
        y[0] = beta2 * x[1] + (1.0f - beta2) * n_tokens * g * g;
    });
}

/* opt->v (n_params) from sampled_grads (n_params) */
static void lg_cuda_hessian_update(const lg_exec *ex, lg_optimizer *opt, lg_buf sampled_grads,
                                   size_t n_params, double n_tokens, float grad_multiplier) {
    if (n_params == 0) return;
    LG_LAUNCH(lg_k_hessian_update, lg_cuda_map_grid(n_params), LG_CUDA_ELEMENT_THREADS, 0,
              lg_cuda_stream(ex), opt->v, sampled_grads, n_params, opt->beta2, (float)n_tokens,
              grad_multiplier);
}

/* g. attention: flash-attention forward and backward ------------------------------------------

   Causal (grouped-query) attention in tiles, as lg_attention_forward/backward compute it on the
   CPU: qkv (B, T, (NH + 2 NQG) HS) holds per token the NH query heads, the NQG key heads and the
   NQG value heads; query head h reads group g = h / (NH / NQG). Nothing of size T x T is ever
   stored: the forward keeps each query row's log-sum-exp (lse, B NH T floats), from which the
   backward rebuilds the probabilities tile by tile.

   Every kernel works on tiles in shared memory (fp32, whatever the storage type): a tile of
   rows of a head, (rows, HSP + 4), where HSP is the head size padded to 32, 64, 128 or 256 with
   zeros; and a tile of probabilities or their gradients, (rows, cols + 4). The +4 keeps float4
   rows aligned and makes consecutive rows start 4 banks apart. A block's threads form a grid
   of TR x TC (TC lanes of one warp share a row). Two register-tiled products do the work:
     lg_att_dot:   acc (RM, CN) = A B^T over the head dims, A's and B's rows contiguous in d:
                   thread (ty, tx) owns rows ty RM + i and columns tx + TC j;
     lg_att_outer: acc (RM, DN) += P X over the tile's columns, X (cols, HSP): thread (ty, tx)
                   owns rows ty RM + i and head dims tx 4 + 4 TC k + e.
   The backward writes its three gradients from blocks that own them whole (no atomics), so
   results are bitwise reproducible. bf16 and fp16 heads of 16, 32, ..., 128 take the
   tensor-core kernels of g2 instead (lg_att_tc_applies). */

/* Shapes of the kernels' tiles: ROWS x COLS scores per block, TR x TC threads, head size padded
   to HSP, and BLOCKS, the blocks an SM should hold at once, for which __launch_bounds__ sizes
   the registers: as many as the shared memory allows, or fewer where a thread would get too few
   registers (under 128, or under 168 where the dk/dv kernel spilled). The forward and the dq
   kernel take query rows and key columns; the dk/dv kernel takes key rows and query columns. */
template <int HSP_, int ROWS_, int COLS_, int TR_, int TC_, int BLOCKS_> struct lg_att_tiles {
    static constexpr int HSP = HSP_, ROWS = ROWS_, COLS = COLS_, TR = TR_, TC = TC_;
    static constexpr int THREADS = TR * TC, BLOCKS = BLOCKS_;
    static constexpr int RM = ROWS / TR;  /* rows a thread owns */
    static constexpr int CN = COLS / TC;  /* score columns a thread owns */
    static constexpr int DN = HSP / TC;   /* head dims a thread owns in an output row */
    static constexpr int LDH = HSP + 4;   /* row stride of a head tile */
    static constexpr int LDS = COLS + 4;  /* row stride of a score tile */
    static_assert(ROWS % TR == 0 && COLS % TC == 0, "tiles split evenly among the threads");
    static_assert(32 % TC == 0 && THREADS % 32 == 0, "a row's TC lanes lie in one warp");
    static_assert(DN % 4 == 0 && COLS % 4 == 0, "outputs and scores go in float4 steps");
};

#define LG_ATT_STATIC_SHARED 49152 /* bytes a block may have without opting in */
#define LG_ATT_MAX_HEAD 256        /* the largest head size with a tile shape */

/* Loop unrolling for nvcc; g++ (the emulator) would warn about the unknown pragma. */
#ifdef __CUDACC__
#define LG_ATT_PRAGMA(x) _Pragma(#x)
#define LG_ATT_UNROLL LG_ATT_PRAGMA(unroll)
#define LG_ATT_UNROLL_BY(n) LG_ATT_PRAGMA(unroll n)
#else
#define LG_ATT_UNROLL
#define LG_ATT_UNROLL_BY(n)
#endif

/* The least dynamic shared memory a block may opt into on the architectures the kernels serve:
   compute capability 8.6, 8.9 and 12.0 (RTX 30xx/40xx/50xx, A10, L4, A40, L40S) allow 99 KiB,
   8.0 163 KiB, 9.0 and 10.0 227 KiB. Every attention kernel's tiles fit it (static_asserts at
   the launchers), so that one set of tiles runs on every card. */
#define LG_CUDA_SHARED_OPTIN_MIN 101376

/* Tile shapes per padded head size: forward, dq (both query x key), dk/dv (key x query). Shared
   memory per block (KiB) in the comments, each within LG_CUDA_SHARED_OPTIN_MIN (99 KiB): the
   dq kernel at 128 and every kernel at 256 take fewer rows or keys than they could on an H100,
   whose SM has 228 KiB. */
template <int HSP> struct lg_att_config;
template <> struct lg_att_config<32> {
    typedef lg_att_tiles<32, 64, 64, 16, 8, 4> forward; /* 44 */
    typedef lg_att_tiles<32, 64, 64, 16, 8, 4> dq;      /* 53.5 */
    typedef lg_att_tiles<32, 64, 64, 16, 8, 3> dkv;     /* 53.5 */
};
template <> struct lg_att_config<64> {
    typedef lg_att_tiles<64, 64, 64, 16, 16, 2> forward; /* 68 */
    typedef lg_att_tiles<64, 64, 64, 16, 16, 2> dq;      /* 85.5 */
    typedef lg_att_tiles<64, 32, 64, 8, 16, 3> dkv;      /* 60 */
};
template <> struct lg_att_config<128> {
    typedef lg_att_tiles<128, 64, 32, 8, 16, 3> forward; /* 75 */
    typedef lg_att_tiles<128, 32, 32, 8, 16, 3> dq;      /* 70.75 */
    typedef lg_att_tiles<128, 32, 32, 8, 16, 3> dkv;     /* 70.75 */
};
template <> struct lg_att_config<256> {
    typedef lg_att_tiles<256, 16, 32, 8, 16, 2> forward; /* 83.5 */
    typedef lg_att_tiles<256, 16, 16, 8, 16, 2> dq;      /* 66.4 */
    typedef lg_att_tiles<256, 16, 16, 8, 16, 2> dkv;     /* 66.4 */
};

/* Element access by storage type, 1 or 4 consecutive elements (4: aligned to 4 elements). */
template <lg_dtype DT> struct lg_att_io;
template <> struct lg_att_io<LG_DTYPE_F32> {
    typedef float storage;
    static __device__ __forceinline__ float get(const float *p) { return *p; }
    static __device__ __forceinline__ void put(float *p, float v) { *p = v; }
    static __device__ __forceinline__ float4 get4(const float *p) { return *(const float4 *)p; }
    static __device__ __forceinline__ void put4(float *p, float4 v) { *(float4 *)p = v; }
};
/* bf16 and fp16: four 16-bit elements move as one 8-byte word. */
template <lg_dtype DT> struct lg_att_io_half {
    typedef uint16_t storage;
    static __device__ __forceinline__ float to_f32(uint16_t h) {
        return DT == LG_DTYPE_BF16 ? lg_bf16_to_f32(h) : lg_f16_to_f32(h);
    }
    static __device__ __forceinline__ uint16_t from_f32(float v) {
        return DT == LG_DTYPE_BF16 ? lg_f32_to_bf16(v) : lg_f32_to_f16(v);
    }
    static __device__ __forceinline__ float get(const uint16_t *p) { return to_f32(*p); }
    static __device__ __forceinline__ void put(uint16_t *p, float v) { *p = from_f32(v); }
    static __device__ __forceinline__ float4 get4(const uint16_t *p) {
        uint2 w = *(const uint2 *)p;
        return make_float4(to_f32((uint16_t)(w.x & 0xFFFFu)), to_f32((uint16_t)(w.x >> 16)),
                           to_f32((uint16_t)(w.y & 0xFFFFu)), to_f32((uint16_t)(w.y >> 16)));
    }
    static __device__ __forceinline__ void put4(uint16_t *p, float4 v) {
        uint2 w;
        w.x = (unsigned)from_f32(v.x) | (unsigned)from_f32(v.y) << 16;
        w.y = (unsigned)from_f32(v.z) | (unsigned)from_f32(v.w) << 16;
        *(uint2 *)p = w;
    }
};
template <> struct lg_att_io<LG_DTYPE_BF16> : lg_att_io_half<LG_DTYPE_BF16> {};
template <> struct lg_att_io<LG_DTYPE_F16> : lg_att_io_half<LG_DTYPE_F16> {};

/* Elements [d, d + 4) of a row of HS (0 beyond HS); vec: the row is 4-element aligned. */
template <lg_dtype DT>
__device__ __forceinline__ float4 lg_att_get4(const typename lg_att_io<DT>::storage *row, int d,
                                              int HS, int vec) {
    typedef lg_att_io<DT> io;
    if (vec) return io::get4(row + d); /* HS % 4 == 0: all four are in the row */
    float4 v;
    v.x = d < HS ? io::get(row + d) : 0.0f;
    v.y = d + 1 < HS ? io::get(row + d + 1) : 0.0f;
    v.z = d + 2 < HS ? io::get(row + d + 2) : 0.0f;
    v.w = d + 3 < HS ? io::get(row + d + 3) : 0.0f;
    return v;
}

/* Stores elements [d, d + 4) of a row of HS (those below HS), adding what is there when
   `accumulate`. */
template <lg_dtype DT>
__device__ __forceinline__ void lg_att_put4(typename lg_att_io<DT>::storage *row, int d, int HS,
                                            int vec, float4 v, int accumulate) {
    typedef lg_att_io<DT> io;
    if (vec) {
        if (accumulate) {
            float4 old = io::get4(row + d);
            v.x += old.x, v.y += old.y, v.z += old.z, v.w += old.w;
        }
        io::put4(row + d, v);
        return;
    }
    float e[4] = {v.x, v.y, v.z, v.w};
    for (int k = 0; k < 4 && d + k < HS; k++)
        io::put(row + d + k, accumulate ? io::get(row + d + k) + e[k] : e[k]);
}

/* dst (NROWS, HSP + 4) = rows [row0, row0 + NROWS) of a head: src (T, HS) with row stride ld;
   rows from T on and dims from HS on are 0. The block's threads take float4 steps in turn. */
template <lg_dtype DT, int HSP, int NROWS, int THREADS>
__device__ __forceinline__ void lg_att_load(float *dst, const typename lg_att_io<DT>::storage *src,
                                            size_t ld, int row0, int T, int HS, int vec) {
    constexpr int STEPS = HSP / 4, LDH = HSP + 4;
    for (int q = threadIdx.x; q < NROWS * STEPS; q += THREADS) {
        int r = q / STEPS, d = (q % STEPS) * 4, t = row0 + r;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (t < T && d < HS) v = lg_att_get4<DT>(src + (size_t)t * ld, d, HS, vec);
        *(float4 *)(dst + r * LDH + d) = v;
    }
}

/* The sum and the maximum over the TC lanes that share a row; every lane gets the same bits. */
template <int TC> __device__ __forceinline__ float lg_att_row_sum(float v) {
    for (int o = TC / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}
template <int TC> __device__ __forceinline__ float lg_att_row_max(float v) {
    for (int o = TC / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    return v;
}

/* lses, ds (NROWS) = the saved log-sum-exp and D = dy . y of query rows [row0, row0 + NROWS)
   of one head (0 from T on). A row's TC lanes split its dims, then sum their parts. dy, y: the
   head's (T, HS), row stride ld; lse_row: the head's (T). */
template <lg_dtype DT, int NROWS, int TR, int TC>
__device__ __forceinline__ void lg_att_load_rows(float *lses, float *ds, const float *lse_row,
                                                 const typename lg_att_io<DT>::storage *dy,
                                                 const typename lg_att_io<DT>::storage *y,
                                                 size_t ld, int row0, int T, int HS, int vec) {
    int tx = threadIdx.x % TC, ty = threadIdx.x / TC;
    for (int pass = 0; pass < (NROWS + TR - 1) / TR; pass++) { /* the same count in every lane */
        int r = ty + pass * TR, t = row0 + r;
        float part = 0.0f;
        if (r < NROWS && t < T)
            for (int d = tx * 4; d < HS; d += 4 * TC) {
                float4 a = lg_att_get4<DT>(dy + (size_t)t * ld, d, HS, vec);
                float4 b = lg_att_get4<DT>(y + (size_t)t * ld, d, HS, vec);
                part += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
            }
        part = lg_att_row_sum<TC>(part);
        if (tx == 0 && r < NROWS) {
            ds[r] = t < T ? part : 0.0f;
            lses[r] = t < T ? lse_row[t] : 0.0f;
        }
    }
}

/* acc (RM, CN) = A B^T over dims [0, hs4): a points at the thread's first row (RM rows, stride
   LDH), b at its first column (CN rows TC apart, stride LDH); both contiguous in the dims. */
template <int RM, int CN, int TC, int LDH>
__device__ __forceinline__ void lg_att_dot(float (&acc)[RM][CN], const float *a, const float *b,
                                           int hs4) {
    LG_ATT_UNROLL
    for (int i = 0; i < RM; i++)
        LG_ATT_UNROLL
        for (int j = 0; j < CN; j++) acc[i][j] = 0.0f;
    LG_ATT_UNROLL_BY(1) /* unrolled, the backward kernels spill registers */
    for (int d = 0; d < hs4; d += 4) {
        float4 av[RM], bv[CN];
        LG_ATT_UNROLL
        for (int i = 0; i < RM; i++) av[i] = *(const float4 *)(a + i * LDH + d);
        LG_ATT_UNROLL
        for (int j = 0; j < CN; j++) bv[j] = *(const float4 *)(b + j * TC * LDH + d);
        LG_ATT_UNROLL
        for (int i = 0; i < RM; i++)
            LG_ATT_UNROLL
            for (int j = 0; j < CN; j++) {
                float s = acc[i][j];
                s = fmaf(av[i].x, bv[j].x, s);
                s = fmaf(av[i].y, bv[j].y, s);
                s = fmaf(av[i].z, bv[j].z, s);
                acc[i][j] = fmaf(av[i].w, bv[j].w, s);
            }
    }
}

/* acc (RM, DN) += P X over the K columns of P: p points at the thread's first row of P (RM
   rows, stride LDP), x at the thread's first dims of row 0 of X (K rows, stride LDH; the
   thread's dims are float4 groups 4 TC apart). */
template <int RM, int DN, int TC, int K, int LDP, int LDH>
__device__ __forceinline__ void lg_att_outer(float (&acc)[RM][DN], const float *p, const float *x) {
    constexpr int G = DN / 4;
    LG_ATT_UNROLL_BY(2)
    for (int k = 0; k < K; k += 4) {
        float pv[RM][4];
        LG_ATT_UNROLL
        for (int i = 0; i < RM; i++) {
            float4 v = *(const float4 *)(p + i * LDP + k);
            pv[i][0] = v.x, pv[i][1] = v.y, pv[i][2] = v.z, pv[i][3] = v.w;
        }
        LG_ATT_UNROLL
        for (int kk = 0; kk < 4; kk++) {
            float4 xv[G];
            LG_ATT_UNROLL
            for (int g = 0; g < G; g++) xv[g] = *(const float4 *)(x + (k + kk) * LDH + g * 4 * TC);
            LG_ATT_UNROLL
            for (int i = 0; i < RM; i++)
                LG_ATT_UNROLL
                for (int g = 0; g < G; g++) {
                    acc[i][4 * g + 0] = fmaf(pv[i][kk], xv[g].x, acc[i][4 * g + 0]);
                    acc[i][4 * g + 1] = fmaf(pv[i][kk], xv[g].y, acc[i][4 * g + 1]);
                    acc[i][4 * g + 2] = fmaf(pv[i][kk], xv[g].z, acc[i][4 * g + 2]);
                    acc[i][4 * g + 3] = fmaf(pv[i][kk], xv[g].w, acc[i][4 * g + 3]);
                }
        }
    }
}

/* Writes (or adds, when accumulate) acc (RM, DN) into rows row0 + i of a head's (T, HS), row
   stride ld, at the thread's dims (float4 groups tx 4 + 4 TC g). */
template <lg_dtype DT, int RM, int DN, int TC>
__device__ __forceinline__ void lg_att_store(typename lg_att_io<DT>::storage *dst, size_t ld,
                                             const float (&acc)[RM][DN], int row0, int T, int HS,
                                             int vec, int accumulate) {
    int tx = threadIdx.x % TC;
    LG_ATT_UNROLL
    for (int i = 0; i < RM; i++) {
        int t = row0 + i;
        LG_ATT_UNROLL
        for (int g = 0; g < DN / 4; g++) {
            int d = tx * 4 + g * 4 * TC;
            float4 v = make_float4(acc[i][4 * g], acc[i][4 * g + 1], acc[i][4 * g + 2],
                                   acc[i][4 * g + 3]);
            if (t < T && d < HS) lg_att_put4<DT>(dst + (size_t)t * ld, d, HS, vec, v, accumulate);
        }
    }
}

/* Bytes of dynamic shared memory of each kernel. */
template <class TL> static constexpr size_t lg_att_forward_shared(void) {
    return sizeof(float) *
           ((size_t)(TL::ROWS + 2 * TL::COLS) * TL::LDH + (size_t)TL::ROWS * TL::LDS);
}
template <class TL> static constexpr size_t lg_att_dq_shared(void) {
    return sizeof(float) * ((size_t)(2 * TL::ROWS + 2 * TL::COLS) * TL::LDH +
                            (size_t)TL::ROWS * TL::LDS + 2 * TL::ROWS);
}
template <class TL> static constexpr size_t lg_att_dkv_shared(void) {
    return sizeof(float) * ((size_t)(2 * TL::ROWS + 2 * TL::COLS) * TL::LDH +
                            (size_t)TL::ROWS * TL::LDS + 2 * TL::COLS);
}

/* Forward. A block owns one query tile (ROWS queries) of one (batch, head), heaviest tiles
   first, and sweeps the key tiles (COLS keys) up to its diagonal: scores = Q K^T in registers,
   the online softmax (running max m and sum l per row, over the TC lanes of the row),
   probabilities through shared memory, O += P V in registers; y = O / l, lse = m + log l.
   grid: query tiles x B NH, the (batch, head) fastest; TR TC threads. */
template <lg_dtype DT, class TL>
__global__ void __launch_bounds__(TL::THREADS, TL::BLOCKS)
lg_k_attention_forward(typename lg_att_io<DT>::storage *y, float *lse,
                       const typename lg_att_io<DT>::storage *qkv, int T, int NH, int NQG, int HS,
                       float scale, int vec) {
    constexpr int BR = TL::ROWS, BC = TL::COLS, RM = TL::RM, CN = TL::CN, DN = TL::DN,
                  TC = TL::TC, LDH = TL::LDH, LDS = TL::LDS;
    LG_SHARED_DYNAMIC(float, smem);
    float *qs = smem;           /* (BR, LDH) */
    float *ks = qs + BR * LDH;  /* (BC, LDH) */
    float *vs = ks + BC * LDH;  /* (BC, LDH) */
    float *ps = vs + BC * LDH;  /* (BR, LDS) */
    int tiles = (T + BR - 1) / BR, heads = (int)(gridDim.x / tiles);
    int q0 = (tiles - 1 - (int)blockIdx.x / heads) * BR, bh = (int)blockIdx.x % heads;
    int b = bh / NH, h = bh % NH, g = h / (NH / NQG);
    int tx = (int)threadIdx.x % TC, ty = (int)threadIdx.x / TC, hs4 = (HS + 3) & ~3;
    size_t QKV = (size_t)(NH + 2 * NQG) * HS;
    const typename lg_att_io<DT>::storage *base = qkv + (size_t)b * T * QKV;
    const typename lg_att_io<DT>::storage *kbase = base + (size_t)(NH + g) * HS;
    const typename lg_att_io<DT>::storage *vbase = base + (size_t)(NH + NQG + g) * HS;
    lg_att_load<DT, TL::HSP, BR, TL::THREADS>(qs, base + (size_t)h * HS, QKV, q0, T, HS, vec);

    float o[RM][DN], m[RM], l[RM];
    LG_ATT_UNROLL
    for (int i = 0; i < RM; i++) {
        m[i] = -INFINITY, l[i] = 0.0f;
        LG_ATT_UNROLL
        for (int d = 0; d < DN; d++) o[i][d] = 0.0f;
    }
    int kend = min(T, q0 + BR);
    for (int k0 = 0; k0 < kend; k0 += BC) {
        __syncthreads(); /* the previous tile's ks, vs and ps are used up */
        lg_att_load<DT, TL::HSP, BC, TL::THREADS>(ks, kbase, QKV, k0, T, HS, vec);
        lg_att_load<DT, TL::HSP, BC, TL::THREADS>(vs, vbase, QKV, k0, T, HS, vec);
        __syncthreads();
        float s[RM][CN];
        lg_att_dot<RM, CN, TC, LDH>(s, qs + ty * RM * LDH, ks + tx * LDH, hs4);
        LG_ATT_UNROLL
        for (int i = 0; i < RM; i++) {
            int r = q0 + ty * RM + i;
            float mx = -INFINITY;
            LG_ATT_UNROLL
            for (int j = 0; j < CN; j++) {
                int c = k0 + tx + TC * j;
                s[i][j] = c <= r && c < T ? s[i][j] * scale : -INFINITY;
                mx = fmaxf(mx, s[i][j]);
            }
            /* key 0 is in every row's first tile, so m is finite from the first tile on */
            float m_new = fmaxf(m[i], lg_att_row_max<TC>(mx));
            float alpha = __expf(m[i] - m_new), sum = 0.0f;
            LG_ATT_UNROLL
            for (int j = 0; j < CN; j++) {
                float p = __expf(s[i][j] - m_new);
                ps[(ty * RM + i) * LDS + tx + TC * j] = p;
                sum += p;
            }
            l[i] = l[i] * alpha + lg_att_row_sum<TC>(sum);
            m[i] = m_new;
            LG_ATT_UNROLL
            for (int d = 0; d < DN; d++) o[i][d] *= alpha;
        }
        __syncwarp(); /* a warp reads back only the rows of P its own lanes wrote */
        lg_att_outer<RM, DN, TC, BC, LDS, LDH>(o, ps + ty * RM * LDS, vs + tx * 4);
    }

    int row0 = q0 + ty * RM;
    LG_ATT_UNROLL
    for (int i = 0; i < RM; i++) {
        float inv = 1.0f / l[i];
        LG_ATT_UNROLL
        for (int d = 0; d < DN; d++) o[i][d] *= inv;
        if (tx == 0 && row0 + i < T) lse[((size_t)b * NH + h) * T + row0 + i] = m[i] + logf(l[i]);
    }
    lg_att_store<DT, RM, DN, TC>(y + (size_t)b * T * NH * HS + (size_t)h * HS, (size_t)NH * HS, o,
                                 row0, T, HS, vec, 0);
}

/* Backward, dq. A block owns one query tile (ROWS queries) of one (batch, head), heaviest first,
   and sweeps the key tiles (COLS keys) up to its diagonal: S = Q K^T and dP = dY V^T in
   registers, P = exp(S scale - lse), dS = P (dP - D) scale through shared memory, dQ += dS K in
   registers, added to dqkv once at the end. grid: query tiles x B NH, the (batch, head)
   fastest; TR TC threads. */
template <lg_dtype DT, class TL>
__global__ void __launch_bounds__(TL::THREADS, TL::BLOCKS)
lg_k_attention_backward_dq(typename lg_att_io<DT>::storage *dqkv,
                           const typename lg_att_io<DT>::storage *dy,
                           const typename lg_att_io<DT>::storage *y,
                           const typename lg_att_io<DT>::storage *qkv, const float *lse, int T,
                           int NH, int NQG, int HS, float scale, int vec) {
    constexpr int BR = TL::ROWS, BC = TL::COLS, RM = TL::RM, CN = TL::CN, DN = TL::DN,
                  TC = TL::TC, LDH = TL::LDH, LDS = TL::LDS;
    LG_SHARED_DYNAMIC(float, smem);
    float *qs = smem;            /* (BR, LDH) */
    float *dys = qs + BR * LDH;  /* (BR, LDH) */
    float *ks = dys + BR * LDH;  /* (BC, LDH) */
    float *vs = ks + BC * LDH;   /* (BC, LDH) */
    float *dss = vs + BC * LDH;  /* (BR, LDS) */
    float *lses = dss + BR * LDS; /* (BR) */
    float *ds = lses + BR;       /* (BR): D = dy . y */
    int tiles = (T + BR - 1) / BR, heads = (int)(gridDim.x / tiles);
    int q0 = (tiles - 1 - (int)blockIdx.x / heads) * BR, bh = (int)blockIdx.x % heads;
    int b = bh / NH, h = bh % NH, g = h / (NH / NQG);
    int tx = (int)threadIdx.x % TC, ty = (int)threadIdx.x / TC, hs4 = (HS + 3) & ~3;
    size_t QKV = (size_t)(NH + 2 * NQG) * HS, ldy = (size_t)NH * HS;
    size_t at = (size_t)b * T * QKV, aty = (size_t)b * T * ldy + (size_t)h * HS;
    const typename lg_att_io<DT>::storage *base = qkv + at;
    const typename lg_att_io<DT>::storage *kbase = base + (size_t)(NH + g) * HS;
    const typename lg_att_io<DT>::storage *vbase = base + (size_t)(NH + NQG + g) * HS;
    lg_att_load<DT, TL::HSP, BR, TL::THREADS>(qs, base + (size_t)h * HS, QKV, q0, T, HS, vec);
    lg_att_load<DT, TL::HSP, BR, TL::THREADS>(dys, dy + aty, ldy, q0, T, HS, vec);
    lg_att_load_rows<DT, BR, TL::TR, TC>(lses, ds, lse + ((size_t)b * NH + h) * T, dy + aty,
                                         y + aty, ldy, q0, T, HS, vec);

    float dq[RM][DN];
    LG_ATT_UNROLL
    for (int i = 0; i < RM; i++)
        LG_ATT_UNROLL
        for (int d = 0; d < DN; d++) dq[i][d] = 0.0f;
    int kend = min(T, q0 + BR);
    for (int k0 = 0; k0 < kend; k0 += BC) {
        __syncthreads(); /* the previous tile's ks, vs and dss are used up */
        lg_att_load<DT, TL::HSP, BC, TL::THREADS>(ks, kbase, QKV, k0, T, HS, vec);
        lg_att_load<DT, TL::HSP, BC, TL::THREADS>(vs, vbase, QKV, k0, T, HS, vec);
        __syncthreads();
        float s[RM][CN], dp[RM][CN];
        lg_att_dot<RM, CN, TC, LDH>(s, qs + ty * RM * LDH, ks + tx * LDH, hs4);
        lg_att_dot<RM, CN, TC, LDH>(dp, dys + ty * RM * LDH, vs + tx * LDH, hs4);
        LG_ATT_UNROLL
        for (int i = 0; i < RM; i++) {
            int rr = ty * RM + i, r = q0 + rr;
            float L = lses[rr], D = ds[rr];
            LG_ATT_UNROLL
            for (int j = 0; j < CN; j++) {
                int c = k0 + tx + TC * j;
                float p = c <= r && r < T ? __expf(s[i][j] * scale - L) : 0.0f;
                dss[rr * LDS + tx + TC * j] = p * (dp[i][j] - D) * scale;
            }
        }
        __syncwarp(); /* a warp reads back only the rows of dS its own lanes wrote */
        lg_att_outer<RM, DN, TC, BC, LDS, LDH>(dq, dss + ty * RM * LDS, ks + tx * 4);
    }
    lg_att_store<DT, RM, DN, TC>(dqkv + at + (size_t)h * HS, QKV, dq, q0 + ty * RM, T, HS, vec, 1);
}

/* Backward, dk and dv. A block owns one key tile (ROWS keys) of one (batch, group), heaviest
   (earliest) first, and sweeps, for each query head of the group, the query tiles (COLS queries)
   from its diagonal to T: S^T = K Q^T and dP^T = V dY^T in registers, P^T then
   dS^T = P^T (dP^T - D) scale through one shared tile, dV += P^T dY and dK += dS^T Q in
   registers, added to dqkv once at the end. grid: key tiles x B NQG, the (batch, group)
   fastest; TR TC threads. */
template <lg_dtype DT, class TL>
__global__ void __launch_bounds__(TL::THREADS, TL::BLOCKS)
lg_k_attention_backward_dkv(typename lg_att_io<DT>::storage *dqkv,
                            const typename lg_att_io<DT>::storage *dy,
                            const typename lg_att_io<DT>::storage *y,
                            const typename lg_att_io<DT>::storage *qkv, const float *lse, int T,
                            int NH, int NQG, int HS, float scale, int vec) {
    constexpr int BC = TL::ROWS, BR = TL::COLS, RM = TL::RM, CN = TL::CN, DN = TL::DN,
                  TC = TL::TC, LDH = TL::LDH, LDS = TL::LDS;
    LG_SHARED_DYNAMIC(float, smem);
    float *ks = smem;             /* (BC, LDH) */
    float *vs = ks + BC * LDH;    /* (BC, LDH) */
    float *qs = vs + BC * LDH;    /* (BR, LDH) */
    float *dys = qs + BR * LDH;   /* (BR, LDH) */
    float *ps = dys + BR * LDH;   /* (BC, LDS): P^T, then dS^T */
    float *lses = ps + BC * LDS;  /* (BR) */
    float *ds = lses + BR;        /* (BR): D = dy . y */
    int tiles = (T + BC - 1) / BC, groups = (int)(gridDim.x / tiles);
    int k0 = (int)blockIdx.x / groups * BC, bg = (int)blockIdx.x % groups;
    int b = bg / NQG, g = bg % NQG, heads_per_group = NH / NQG;
    int tx = (int)threadIdx.x % TC, ty = (int)threadIdx.x / TC, hs4 = (HS + 3) & ~3;
    size_t QKV = (size_t)(NH + 2 * NQG) * HS, ldy = (size_t)NH * HS;
    size_t at = (size_t)b * T * QKV;
    const typename lg_att_io<DT>::storage *base = qkv + at;
    const typename lg_att_io<DT>::storage *kbase = base + (size_t)(NH + g) * HS;
    const typename lg_att_io<DT>::storage *vbase = base + (size_t)(NH + NQG + g) * HS;
    lg_att_load<DT, TL::HSP, BC, TL::THREADS>(ks, kbase, QKV, k0, T, HS, vec);
    lg_att_load<DT, TL::HSP, BC, TL::THREADS>(vs, vbase, QKV, k0, T, HS, vec);

    float dk[RM][DN], dv[RM][DN];
    LG_ATT_UNROLL
    for (int i = 0; i < RM; i++)
        LG_ATT_UNROLL
        for (int d = 0; d < DN; d++) dk[i][d] = dv[i][d] = 0.0f;
    for (int h = g * heads_per_group; h < (g + 1) * heads_per_group; h++) {
        size_t aty = (size_t)b * T * ldy + (size_t)h * HS;
        for (int q0 = k0 / BR * BR; q0 < T; q0 += BR) {
            __syncthreads(); /* the previous tile's qs, dys, ps and rows are used up */
            lg_att_load<DT, TL::HSP, BR, TL::THREADS>(qs, base + h * HS, QKV, q0, T, HS, vec);
            lg_att_load<DT, TL::HSP, BR, TL::THREADS>(dys, dy + aty, ldy, q0, T, HS, vec);
            lg_att_load_rows<DT, BR, TL::TR, TC>(lses, ds, lse + ((size_t)b * NH + h) * T, dy + aty,
                                                 y + aty, ldy, q0, T, HS, vec);
            __syncthreads();
            float s[RM][CN], dp[RM][CN];
            lg_att_dot<RM, CN, TC, LDH>(s, ks + ty * RM * LDH, qs + tx * LDH, hs4);
            lg_att_dot<RM, CN, TC, LDH>(dp, vs + ty * RM * LDH, dys + tx * LDH, hs4);
            LG_ATT_UNROLL
            for (int i = 0; i < RM; i++) {
                int cc = ty * RM + i, c = k0 + cc;
                LG_ATT_UNROLL
                for (int j = 0; j < CN; j++) {
                    int rr = tx + TC * j, r = q0 + rr;
                    float p = r >= c && r < T ? __expf(s[i][j] * scale - lses[rr]) : 0.0f;
                    ps[cc * LDS + rr] = p;
                    dp[i][j] = p * (dp[i][j] - ds[rr]) * scale; /* dS^T */
                }
            }
            /* a warp reads back only the rows of P^T (then dS^T) its own lanes wrote */
            __syncwarp();
            lg_att_outer<RM, DN, TC, BR, LDS, LDH>(dv, ps + ty * RM * LDS, dys + tx * 4);
            __syncwarp();
            LG_ATT_UNROLL
            for (int i = 0; i < RM; i++)
                LG_ATT_UNROLL
                for (int j = 0; j < CN; j++) ps[(ty * RM + i) * LDS + tx + TC * j] = dp[i][j];
            __syncwarp();
            lg_att_outer<RM, DN, TC, BR, LDS, LDH>(dk, ps + ty * RM * LDS, qs + tx * 4);
        }
    }
    int row0 = k0 + ty * RM;
    lg_att_store<DT, RM, DN, TC>(dqkv + at + (size_t)(NH + g) * HS, QKV, dk, row0, T, HS, vec, 1);
    lg_att_store<DT, RM, DN, TC>(dqkv + at + (size_t)(NH + NQG + g) * HS, QKV, dv, row0, T, HS, vec,
                                 1);
}

/* Lets a kernel have `bytes` of dynamic shared memory on the rank's GPU (beyond 48 KiB it must
   opt in, on each device). */
template <typename K> static void lg_att_allow_shared(const lg_exec *ex, K *kernel, size_t bytes) {
    lg_cuda_stream(ex); /* makes the rank's GPU current */
    if (bytes > LG_ATT_STATIC_SHARED)
        LG_CUDA_TRY(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)bytes));
}

/* Checks what the kernels assume of a call; a violation is a bug in the caller. */
static void lg_att_check(const char *op, const lg_buf *bufs, int nbufs, int B, int T, int NH,
                         int NQG, int HS) {
    const char *why = NULL;
    if (NQG < 1 || NH % NQG) why = "NH must be a multiple of NQG";
    else if (HS < 1 || HS > LG_ATT_MAX_HEAD) why = "head sizes 1 to 256 are supported";
    else if ((double)B * NH * T > 2147483647.0) why = "B NH T must fit a grid of 2^31 blocks";
    for (int i = 1; i < nbufs && !why; i++)
        if (bufs[i].dtype != bufs[0].dtype) why = "all tensors must have the same storage type";
    if (!why && bufs[0].dtype != LG_DTYPE_F32 && bufs[0].dtype != LG_DTYPE_BF16 &&
        bufs[0].dtype != LG_DTYPE_F16)
        why = "storage must be F32, BF16 or F16";
    if (why) {
        fprintf(stderr, "%s: %s (B %d T %d NH %d NQG %d HS %d)\n", op, why, B, T, NH, NQG, HS);
        abort();
    }
}

/* 1 when every buffer's rows can move in aligned groups of 4 elements. */
static int lg_att_vectorizable(const lg_buf *bufs, int nbufs, int HS) {
    if (HS % 4) return 0;
    for (int i = 0; i < nbufs; i++)
        if ((uintptr_t)bufs[i].data % (4 * lg_elem_size(bufs[i].dtype))) return 0;
    return 1;
}

template <lg_dtype DT, int HSP>
static void lg_att_forward_launch(const lg_exec *ex, lg_buf y, lg_real *lse, lg_buf qkv, int B,
                                  int T, int NH, int NQG, int HS, int vec) {
    typedef typename lg_att_config<HSP>::forward TL;
    typedef typename lg_att_io<DT>::storage S;
    static_assert(lg_att_forward_shared<TL>() <= LG_CUDA_SHARED_OPTIN_MIN, "the forward's tiles "
                  "exceed the shared memory a block has on compute capability 8.6, 8.9, 12.0");
    size_t bytes = lg_att_forward_shared<TL>();
    lg_att_allow_shared(ex, lg_k_attention_forward<DT, TL>, bytes);
    unsigned grid = (unsigned)((T + TL::ROWS - 1) / TL::ROWS) * (unsigned)(B * NH);
    LG_LAUNCH((lg_k_attention_forward<DT, TL>), grid, TL::THREADS, bytes, lg_cuda_stream(ex),
              (S *)y.data, (float *)lse, (const S *)qkv.data, T, NH, NQG, HS,
              1.0f / sqrtf((float)HS), vec);
}

template <lg_dtype DT, int HSP>
static void lg_att_backward_launch(const lg_exec *ex, lg_buf dqkv, lg_buf dy, lg_buf y,
                                   lg_buf qkv, const lg_real *lse, int B, int T, int NH, int NQG,
                                   int HS, int vec) {
    typedef typename lg_att_config<HSP>::dq TQ;
    typedef typename lg_att_config<HSP>::dkv TK;
    typedef typename lg_att_io<DT>::storage S;
    static_assert(lg_att_dq_shared<TQ>() <= LG_CUDA_SHARED_OPTIN_MIN &&
                      lg_att_dkv_shared<TK>() <= LG_CUDA_SHARED_OPTIN_MIN,
                  "the backward's tiles exceed the shared memory a block has on compute "
                  "capability 8.6, 8.9, 12.0");
    float scale = 1.0f / sqrtf((float)HS);
    size_t bytes = lg_att_dq_shared<TQ>();
    lg_att_allow_shared(ex, lg_k_attention_backward_dq<DT, TQ>, bytes);
    unsigned grid = (unsigned)((T + TQ::ROWS - 1) / TQ::ROWS) * (unsigned)(B * NH);
    LG_LAUNCH((lg_k_attention_backward_dq<DT, TQ>), grid, TQ::THREADS, bytes, lg_cuda_stream(ex),
              (S *)dqkv.data, (const S *)dy.data, (const S *)y.data, (const S *)qkv.data,
              (const float *)lse, T, NH, NQG, HS, scale, vec);
    /* the two kernels write disjoint parts of dqkv (queries; keys and values) */
    bytes = lg_att_dkv_shared<TK>();
    lg_att_allow_shared(ex, lg_k_attention_backward_dkv<DT, TK>, bytes);
    unsigned grid_kv = (unsigned)((T + TK::ROWS - 1) / TK::ROWS) * (unsigned)(B * NQG);
    LG_LAUNCH((lg_k_attention_backward_dkv<DT, TK>), grid_kv, TK::THREADS, bytes,
              lg_cuda_stream(ex), (S *)dqkv.data, (const S *)dy.data, (const S *)y.data,
              (const S *)qkv.data, (const float *)lse, T, NH, NQG, HS, scale, vec);
}

/* The launchers' signature, for dispatching on the storage type and the padded head size. */
typedef void (*lg_att_forward_fn)(const lg_exec *ex, lg_buf y, lg_real *lse, lg_buf qkv, int B,
                                  int T, int NH, int NQG, int HS, int vec);
typedef void (*lg_att_backward_fn)(const lg_exec *ex, lg_buf dqkv, lg_buf dy, lg_buf y,
                                   lg_buf qkv, const lg_real *lse, int B, int T, int NH, int NQG,
                                   int HS, int vec);

/* The padded head size HSP: the smallest of 32, 64, 128, 256 that holds HS. */
template <lg_dtype DT>
static void lg_att_forward_typed(const lg_exec *ex, lg_buf y, lg_real *lse, lg_buf qkv, int B,
                                 int T, int NH, int NQG, int HS, int vec) {
    lg_att_forward_fn launch =
        HS <= 32    ? lg_att_forward_launch<DT, 32>
        : HS <= 64  ? lg_att_forward_launch<DT, 64>
        : HS <= 128 ? lg_att_forward_launch<DT, 128>
                    : lg_att_forward_launch<DT, 256>;
    launch(ex, y, lse, qkv, B, T, NH, NQG, HS, vec);
}

template <lg_dtype DT>
static void lg_att_backward_typed(const lg_exec *ex, lg_buf dqkv, lg_buf dy, lg_buf y,
                                  lg_buf qkv, const lg_real *lse, int B, int T, int NH, int NQG,
                                  int HS, int vec) {
    lg_att_backward_fn launch =
        HS <= 32    ? lg_att_backward_launch<DT, 32>
        : HS <= 64  ? lg_att_backward_launch<DT, 64>
        : HS <= 128 ? lg_att_backward_launch<DT, 128>
                    : lg_att_backward_launch<DT, 256>;
    launch(ex, dqkv, dy, y, qkv, lse, B, T, NH, NQG, HS, vec);
}

/* g2. attention on tensor cores: mma.sync (bf16, fp16; head sizes 16, 32, ..., 128) -------------

   FlashAttention-2 on the tensor cores' own instruction, mma.sync.m16n8k16 (16-bit A and B,
   float C and D, inline PTX; the emulator runs the same fragments), for 16-bit storage and head
   sizes that are multiples of 16 up to 128 (lg_att_tc_applies); the kernels of g take every
   other call. The same three kernels as g (forward; backward dq; backward dk and dv), 4 warps a
   block, each warp owning 16 rows of the block's 64-row tile. The fragments' layouts are
   documented (PTX ISA, "Matrix fragments for mma.m16n8k16"), so a thread knows which scores it
   holds and every row-wise step runs in registers: with group = lane / 4 and tig = lane % 4, a
   16 x 8 accumulator gives each thread rows group and group + 8, columns 2 tig and 2 tig + 1;
   the four lanes of a group share its rows. Scores (and their gradients) rounded to 16 bits are
   already the A fragments of the next product (a k step of 16 is two 16 x 8 tiles), and the
   outputs (O, dQ, dK, dV) stay in accumulators from the first tile to the last: only the tiles
   of heads pass through shared memory, (rows, HSP + 8) 16-bit, the head padded to HSP (32, 64
   or 128) with zeros, read into fragments by ldmatrix (16 bytes after each row: the 8 rows of
   one 8 x 8 matrix fall in distinct banks). Those come with cp.async, two buffers each, the next tile's copies in flight
   while the current one is used. P and dS are rounded to the storage type before their
   products (about 2^-9 relative in bf16, which the float accumulation does not grow). Same
   results twice: no atomics, fixed orders. */

#define LG_ATT_TC_WARPS 4    /* warps of a block */
#define LG_ATT_TC_THREADS (LG_ATT_TC_WARPS * LG_CUDA_WARP)
#define LG_ATT_TC_ROWS (LG_ATT_TC_WARPS * LG_ATT_MMA_M) /* rows a block owns: 16 a warp */
#define LG_ATT_TC_HPAD 8     /* 16-bit elements after each row of a 16-bit tile (16 bytes) */
#define LG_ATT_TC_VEC 8      /* elements of one 16-byte load or store */
#define LG_ATT_TC_MAX_HEAD 128
#define LG_ATT_MMA_M 16     /* mma.m16n8k16: rows of A, C and D */
#define LG_ATT_MMA_N 8      /* columns of B, C and D */
#define LG_ATT_MMA_K 16     /* columns of A, rows of B */
#define LG_ATT_MMA_KEYS 64  /* keys of a forward or dq tile */
#define LG_ATT_MMA_STAGES 2 /* buffers of a streamed tile: one in use, one being copied */

/* lses, ds (NROWS) = the saved log-sum-exp and D = dy . y (lg_k_attention_rowdot's) of query
   rows [row0, row0 + NROWS) of a head (0 from T on), a thread a row. lse_row, d_row: the
   head's (T). */
template <int NROWS>
__device__ __forceinline__ void lg_att_tc_rows(float *lses, float *ds, const float *lse_row,
                                               const float *d_row, int row0, int T) {
    static_assert(NROWS <= LG_ATT_TC_THREADS, "a thread a row");
    int r = (int)threadIdx.x, t = row0 + r;
    if (r < NROWS) {
        ds[r] = t < T ? d_row[t] : 0.0f;
        lses[r] = t < T ? lse_row[t] : 0.0f;
    }
}

/* d (16 x 8) = a (16 x 16) b (16 x 8) + c over the warp, in the documented fragments (above); d
   may be c. Every lane of a whole warp calls it at once. */
template <lg_dtype DT>
__device__ __forceinline__ void lg_mma_m16n8k16(float d[4], const uint32_t a[4],
                                                const uint32_t b[2], const float c[4]) {
#ifdef LG_CUDA_EMULATE
    lg_emu_mma_m16n8k16(d, a, b, c, DT == LG_DTYPE_BF16 ? LG_EMU_MMA_BF16 : LG_EMU_MMA_F16);
#else
    if constexpr (DT == LG_DTYPE_BF16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                       "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
                     : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                       "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#endif
}

/* COUNT 8 x 8 matrices of 16-bit elements from shared memory to the fragments mma.sync takes:
   lanes 8 i .. 8 i + 7 give the addresses of matrix i's rows (16 bytes each, 16-byte aligned);
   r[i] gets row lane / 4, elements 2 (lane % 4) and + 1 of matrix i, or with TRANS those of its
   transpose. Every lane of a whole warp calls it at once. */
template <int COUNT, bool TRANS>
__device__ __forceinline__ void lg_ldmatrix(uint32_t r[COUNT], const uint16_t *row) {
    static_assert(COUNT == 2 || COUNT == 4, "the attention kernels load 2 or 4 matrices");
#ifdef LG_CUDA_EMULATE
    lg_emu_ldmatrix(r, COUNT, TRANS, row);
#else
    unsigned shared = (unsigned)__cvta_generic_to_shared(row);
    if constexpr (COUNT == 4 && !TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(shared));
    else if constexpr (COUNT == 4)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(shared));
    else if constexpr (!TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                     : "=r"(r[0]), "=r"(r[1])
                     : "r"(shared));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                     : "=r"(r[0]), "=r"(r[1])
                     : "r"(shared));
#endif
}

/* 16 bytes from global src to shared dst without passing through registers; valid == 0 fills
   dst with zeros and reads nothing. Complete after lg_cp_async_commit and lg_cp_async_wait. */
__device__ __forceinline__ void lg_cp_async16(void *dst, const void *src, int valid) {
#ifdef LG_CUDA_EMULATE
    lg_emu_cp_async(dst, src, 16, valid ? 16 : 0);
#else
    unsigned shared = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
#endif
}
/* The thread's copies since the last commit become one group. */
__device__ __forceinline__ void lg_cp_async_commit(void) {
#ifdef LG_CUDA_EMULATE
    lg_emu_cp_async_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
/* Waits until at most PENDING of the thread's groups (the newest) are still in flight. */
template <int PENDING> __device__ __forceinline__ void lg_cp_async_wait(void) {
#ifdef LG_CUDA_EMULATE
    lg_emu_cp_async_wait(PENDING);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
#endif
}

/* Two floats rounded to the storage type, a (lower half) and b, as one 32-bit register. */
/* The hardware's paired conversion (cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32), which rounds to
   nearest even as io::from_f32 does, bit for bit (the GPU test's paired-conversion check). */
template <lg_dtype DT> __device__ __forceinline__ uint32_t lg_att_mma_pack(float a, float b) {
    uint32_t bits;
    if constexpr (DT == LG_DTYPE_BF16) {
        __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
        memcpy(&bits, &v, sizeof bits);
    } else {
        __half2 v = __floats2half2_rn(a, b);
        memcpy(&bits, &v, sizeof bits);
    }
    return bits;
}
/* The A fragment of the 16 x 16 tile at p (row-major, row stride ld): its quarters (rows 0-7,
   8-15 by columns 0-7, 8-15) are a0 a1, a2 a3, a4 a5, a6 a7. */
__device__ __forceinline__ void lg_att_mma_a(uint32_t a[4], const uint16_t *p, int ld, int lane) {
    int quarter = lane / 8;
    lg_ldmatrix<4, false>(a, p + (lane % 8 + quarter % 2 * 8) * ld + quarter / 2 * 8);
}
/* The B fragment (16 x 8) whose column n is row n of the 8 x 16 tile at p (row-major, row stride
   ld): the transposed operand of a product with a head's rows, as K in Q K^T. */
__device__ __forceinline__ void lg_att_mma_b_rows(uint32_t b[2], const uint16_t *p, int ld,
                                                  int lane) {
    lg_ldmatrix<2, false>(b, p + lane % 8 * ld + lane / 8 % 2 * 8);
}
/* The warp's 16 rows at p (16 x HSP, row stride ld) as QK A fragments, the head's first hs16
   slices of 16: loaded once, kept in registers across every tile they multiply. */
template <int QK>
__device__ __forceinline__ void lg_att_mma_a_rows(uint32_t (*f)[4], const uint16_t *p, int ld,
                                                  int hs16, int lane) {
    LG_ATT_UNROLL
    for (int kk = 0; kk < QK; kk++)
        if (kk < hs16) lg_att_mma_a(f[kk], p + kk * LG_ATT_MMA_K, ld, lane);
}
/* The backward's pair of 16 x 8 tiles for a warp: s = A1 B1^T (scores) and dp = A2 B2^T
   (dY V^T), each over the head's first hs16 slices of 16 (of QK). HELD: A1, A2 are QK A
   fragments in registers (lg_att_mma_a_rows), a1/a2; else they are read from A's rows in
   shared memory, a1s/a2s, at every call. B's rows at b1/b2; row stride ld. */
template <lg_dtype DT, int QK, bool HELD>
__device__ __forceinline__ void lg_att_mma_pair(float s[4], float dp[4], const uint32_t (*a1)[4],
                                                const uint32_t (*a2)[4], const uint16_t *a1s,
                                                const uint16_t *a2s, const uint16_t *b1,
                                                const uint16_t *b2, int ld, int hs16, int lane) {
    constexpr int K = LG_ATT_MMA_K;
    s[0] = s[1] = s[2] = s[3] = 0.0f;
    dp[0] = dp[1] = dp[2] = dp[3] = 0.0f;
    LG_ATT_UNROLL
    for (int kk = 0; kk < QK; kk++)
        if (kk < hs16) {
            uint32_t bf[2], af[4];
            const uint32_t *f = af;
            lg_att_mma_b_rows(bf, b1 + kk * K, ld, lane);
            if constexpr (HELD) f = a1[kk];
            else lg_att_mma_a(af, a1s + kk * K, ld, lane);
            lg_mma_m16n8k16<DT>(s, f, bf, s);
            lg_att_mma_b_rows(bf, b2 + kk * K, ld, lane);
            if constexpr (HELD) f = a2[kk];
            else lg_att_mma_a(af, a2s + kk * K, ld, lane);
            lg_mma_m16n8k16<DT>(dp, f, bf, dp);
        }
}
/* The B fragment of the 16 x 8 tile at p (row-major, row stride ld), as V in P V. */
__device__ __forceinline__ void lg_att_mma_b_cols(uint32_t b[2], const uint16_t *p, int ld,
                                                  int lane) {
    lg_ldmatrix<2, true>(b, p + lane % 16 * ld);
}
/* The A fragment of a 16 x 16 tile held as two accumulators (its columns 0..7 and 8..15),
   rounded to the storage type: the scores of one product become an operand of the next. */
template <lg_dtype DT>
__device__ __forceinline__ void lg_att_mma_a_from(uint32_t a[4], const float lo[4],
                                                  const float hi[4]) {
    a[0] = lg_att_mma_pack<DT>(lo[0], lo[1]);
    a[1] = lg_att_mma_pack<DT>(lo[2], lo[3]);
    a[2] = lg_att_mma_pack<DT>(hi[0], hi[1]);
    a[3] = lg_att_mma_pack<DT>(hi[2], hi[3]);
}

/* dst rows row0 + group and row0 + group + 8 (those below T), dims [0, HS) += acc, the OT
   accumulators of a 16 x HSP tile (a thread's part); dst: a head's (T, HS), row stride ld. */
template <lg_dtype DT, int OT>
__device__ __forceinline__ void lg_att_mma_add(uint16_t *dst, size_t ld, const float (*acc)[4],
                                               int row0, int T, int HS, int group, int tig) {
    typedef lg_att_io<DT> io;
    LG_ATT_UNROLL
    for (int i = 0; i < 2; i++) {
        int t = row0 + group + 8 * i;
        if (t >= T) continue;
        LG_ATT_UNROLL
        for (int ot = 0; ot < OT; ot++)
            if (ot < HS / LG_ATT_MMA_N) {
                uint16_t *p = dst + (size_t)t * ld + ot * LG_ATT_MMA_N + 2 * tig;
                *(uint32_t *)p = lg_att_mma_pack<DT>(io::get(p) + acc[ot][2 * i],
                                                     io::get(p + 1) + acc[ot][2 * i + 1]);
            }
    }
}

/* Issues the cp.async copies of rows [row0, row0 + NROWS) of a head into dst (NROWS, HSP + 8):
   src (T, HS), row stride ld; rows from T on and dims from HS on are zero-filled. The block's
   threads take 16-byte steps in turn. */
template <int HSP, int NROWS>
__device__ __forceinline__ void lg_att_mma_load(uint16_t *dst, const uint16_t *src, size_t ld,
                                                int row0, int T, int HS) {
    constexpr int STEPS = HSP / LG_ATT_TC_VEC, LDH = HSP + LG_ATT_TC_HPAD;
    for (int q = (int)threadIdx.x; q < NROWS * STEPS; q += LG_ATT_TC_THREADS) {
        int r = q / STEPS, d = q % STEPS * LG_ATT_TC_VEC, t = row0 + r;
        int valid = t < T && d < HS;
        lg_cp_async16(dst + r * LDH + d, valid ? src + (size_t)t * ld + d : src, valid);
    }
}

/* Bytes of dynamic shared memory of the forward: Q, and two buffers each of K and V (85 KiB at
   HSP 128, 45 KiB at 64). */
template <int HSP> static constexpr size_t lg_att_mma_forward_shared(void) {
    return sizeof(uint16_t) * (LG_ATT_TC_ROWS + 2 * LG_ATT_MMA_STAGES * LG_ATT_MMA_KEYS) *
           (HSP + LG_ATT_TC_HPAD);
}

/* acc (16 x HSP) += S B over one key tile: the scores s rounded to 16 bits as A fragments, a
   k step of 16 keys taking score tiles 2 pk and 2 pk + 1 (those below `live`); B: the tile's
   rows bt (BC, ld) in shared memory. The forward's O += P V and the dq kernel's dQ += dS K. */
template <lg_dtype DT, int PK, int OT>
__device__ __forceinline__ void lg_att_scores_times(float (*acc)[4], const float (*s)[4], int live,
                                                    const uint16_t *bt, int ld, int hs8,
                                                    int lane) {
    constexpr int N = LG_ATT_MMA_N, K = LG_ATT_MMA_K;
    LG_ATT_UNROLL
    for (int pk = 0; pk < PK; pk++) {
        if (2 * pk >= live) continue;
        uint32_t af[4];
        lg_att_mma_a_from<DT>(af, s[2 * pk], s[2 * pk + 1]);
        LG_ATT_UNROLL
        for (int ot = 0; ot < OT; ot++)
            if (ot < hs8) {
                uint32_t bf[2];
                lg_att_mma_b_cols(bf, bt + pk * K * ld + ot * N, ld, lane);
                lg_mma_m16n8k16<DT>(acc[ot], af, bf, acc[ot]);
            }
    }
}

/* The online softmax of one key tile for a thread's rows t0 (i = 0) and t0 + 8 (i = 1), in the
   mma forward: the scores s (ST score tiles of 16 x 8, this thread's 4 values each) are scaled
   and masked (causal, past T, tiles from `live` on), the rows' running max m moves to the tile's
   max (over the group's four lanes), the output accumulators o and the thread's part of the
   running sum l are rescaled, and s becomes P = exp(s - m), added into l. */
template <int ST, int OT>
__device__ __forceinline__ void lg_att_online_softmax(float (&s)[ST][4], float (&o)[OT][4],
                                                      float m[2], float l[2], int live, int k0,
                                                      int t0, int tig, int T, float scale) {
    constexpr int N = LG_ATT_MMA_N;
    LG_ATT_UNROLL
    for (int i = 0; i < 2; i++) {
        int t = t0 + 8 * i;
        float mx = -INFINITY;
        LG_ATT_UNROLL
        for (int st = 0; st < ST; st++) {
            LG_ATT_UNROLL
            for (int e = 0; e < 2; e++) {
                int c = k0 + st * N + 2 * tig + e;
                float x = st < live && c <= t && c < T ? s[st][2 * i + e] * scale : -INFINITY;
                s[st][2 * i + e] = x;
                mx = fmaxf(mx, x);
            }
        }
        mx = fmaxf(mx, __shfl_xor_sync(LG_CUDA_FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(LG_CUDA_FULL_MASK, mx, 2));
        float m_new = fmaxf(m[i], mx); /* finite: key 0 lies in every row's first tile */
        float alpha = __expf(m[i] - m_new);
        m[i] = m_new;
        l[i] *= alpha;
        LG_ATT_UNROLL
        for (int ot = 0; ot < OT; ot++) o[ot][2 * i] *= alpha, o[ot][2 * i + 1] *= alpha;
        LG_ATT_UNROLL
        for (int st = 0; st < ST; st++) {
            LG_ATT_UNROLL
            for (int e = 0; e < 2; e++) {
                float p = __expf(s[st][2 * i + e] - m_new);
                s[st][2 * i + e] = p;
                l[i] += p;
            }
        }
    }
}

/* Forward. A block owns one query tile (64 queries) of one (batch, head), heaviest first, and
   sweeps the key tiles (64 keys) up to its diagonal; warp w owns queries 16 w .. 16 w + 15, a
   thread the rows group and group + 8 of them. Per key tile: S (16 x 64, 8 accumulators of
   16 x 8) = Q K^T; the rows' running max m (over the group's four lanes) and the thread's part
   of the running sum l; P = exp(S scale - m) rounded to 16 bits as A fragments; O (16 x HSP,
   HSP / 8 accumulators) rescaled, then O += P V. Score tiles wholly past the warp's last query
   are skipped. At the end l is summed over the group, y = O / l, lse = m + log l.
   grid: query tiles x B NH, the (batch, head) fastest; 4 warps. */
template <lg_dtype DT, int HSP>
__global__ void __launch_bounds__(LG_ATT_TC_THREADS)
lg_k_attention_forward_mma(uint16_t *y, float *lse, const uint16_t *qkv, int T, int NH, int NQG,
                           int HS, float scale) {
    constexpr int M = LG_ATT_MMA_M, N = LG_ATT_MMA_N, K = LG_ATT_MMA_K, BR = LG_ATT_TC_ROWS,
                  BC = LG_ATT_MMA_KEYS, LDH = HSP + LG_ATT_TC_HPAD;
    constexpr int QK = HSP / K;  /* k steps of Q K^T over the head */
    constexpr int ST = BC / N;   /* score tiles (16 x 8) of a key tile */
    constexpr int PK = BC / K;   /* k steps of P V over the keys */
    constexpr int OT = HSP / N;  /* output tiles (16 x 8) */
    LG_SHARED_DYNAMIC(unsigned char, smem);
    uint16_t *qs = (uint16_t *)smem;                   /* (BR, LDH): Q */
    uint16_t *ks = qs + BR * LDH;                      /* (STAGES, BC, LDH): K */
    uint16_t *vs = ks + LG_ATT_MMA_STAGES * BC * LDH;  /* (STAGES, BC, LDH): V */
    int tiles = (T + BR - 1) / BR, heads = (int)(gridDim.x / tiles);
    int q0 = (tiles - 1 - (int)blockIdx.x / heads) * BR, bh = (int)blockIdx.x % heads;
    int b = bh / NH, h = bh % NH, g = h / (NH / NQG), hs16 = HS / K, hs8 = HS / N;
    int warp = (int)threadIdx.x / LG_CUDA_WARP, lane = (int)threadIdx.x % LG_CUDA_WARP;
    int group = lane / 4, tig = lane % 4, w0 = warp * M;
    int wlast = min(T - 1, q0 + w0 + M - 1); /* the last key the warp's queries see */
    int key_tiles = (min(T, q0 + BR) + BC - 1) / BC;
    size_t QKV = (size_t)(NH + 2 * NQG) * HS;
    const uint16_t *base = qkv + (size_t)b * T * QKV;
    const uint16_t *kbase = base + (size_t)(NH + g) * HS;
    const uint16_t *vbase = base + (size_t)(NH + NQG + g) * HS;

    lg_att_mma_load<HSP, BR>(qs, base + (size_t)h * HS, QKV, q0, T, HS);
    lg_att_mma_load<HSP, BC>(ks, kbase, QKV, 0, T, HS);
    lg_att_mma_load<HSP, BC>(vs, vbase, QKV, 0, T, HS);
    lg_cp_async_commit();

    uint32_t qf[QK][4]; /* the warp's Q (16 x HSP) as A fragments */
    float o[OT][4];     /* O (16 x HSP) */
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}; /* rows group, group + 8 */
    LG_ATT_UNROLL
    for (int ot = 0; ot < OT; ot++) o[ot][0] = o[ot][1] = o[ot][2] = o[ot][3] = 0.0f;
    for (int j = 0; j < key_tiles; j++) {
        int k0 = j * BC;
        const uint16_t *kt = ks + (j % LG_ATT_MMA_STAGES) * BC * LDH;
        const uint16_t *vt = vs + (j % LG_ATT_MMA_STAGES) * BC * LDH;
        if (j + 1 < key_tiles) { /* the next tile's copies, into the other buffers */
            int next = (j + 1) % LG_ATT_MMA_STAGES;
            lg_att_mma_load<HSP, BC>(ks + next * BC * LDH, kbase, QKV, k0 + BC, T, HS);
            lg_att_mma_load<HSP, BC>(vs + next * BC * LDH, vbase, QKV, k0 + BC, T, HS);
            lg_cp_async_commit();
            lg_cp_async_wait<1>();
        } else {
            lg_cp_async_wait<0>();
        }
        __syncthreads(); /* every thread's copies of this tile have landed */
        if (j == 0) {
            LG_ATT_UNROLL
            for (int kk = 0; kk < QK; kk++)
                if (kk < hs16) lg_att_mma_a(qf[kk], qs + w0 * LDH + kk * K, LDH, lane);
        }
        /* score tiles with a key the warp sees (warp-uniform: the mma takes the whole warp) */
        int live = wlast < k0 ? 0 : min(ST, (wlast - k0) / N + 1);
        float s[ST][4];
        LG_ATT_UNROLL
        for (int st = 0; st < ST; st++) {
            s[st][0] = s[st][1] = s[st][2] = s[st][3] = 0.0f;
            if (st >= live) continue;
            LG_ATT_UNROLL
            for (int kk = 0; kk < QK; kk++)
                if (kk < hs16) {
                    uint32_t kf[2];
                    lg_att_mma_b_rows(kf, kt + st * N * LDH + kk * K, LDH, lane);
                    lg_mma_m16n8k16<DT>(s[st], qf[kk], kf, s[st]);
                }
        }
        lg_att_online_softmax<ST, OT>(s, o, m, l, live, k0, q0 + w0 + group, tig, T, scale);
        lg_att_scores_times<DT, PK, OT>(o, s, live, vt, LDH, hs8, lane); /* O += P V */
        __syncthreads(); /* this tile's buffers are used up before the copies into them */
    }
    /* y = O / l, lse = m + log l, for the rows below T */
    LG_ATT_UNROLL
    for (int i = 0; i < 2; i++) {
        l[i] += __shfl_xor_sync(LG_CUDA_FULL_MASK, l[i], 1);
        l[i] += __shfl_xor_sync(LG_CUDA_FULL_MASK, l[i], 2);
        int t = q0 + w0 + group + 8 * i;
        if (t >= T) continue;
        float inv = 1.0f / l[i];
        uint16_t *yrow = y + ((size_t)b * T + t) * NH * HS + (size_t)h * HS;
        LG_ATT_UNROLL
        for (int ot = 0; ot < OT; ot++)
            if (ot < hs8)
                *(uint32_t *)(yrow + ot * N + 2 * tig) =
                    lg_att_mma_pack<DT>(o[ot][2 * i] * inv, o[ot][2 * i + 1] * inv);
        if (tig == 0) lse[((size_t)b * NH + h) * T + t] = m[i] + logf(l[i]);
    }
}

template <lg_dtype DT, int HSP>
static void lg_att_mma_forward_launch(const lg_exec *ex, lg_buf y, lg_real *lse, lg_buf qkv,
                                      int B, int T, int NH, int NQG, int HS, int /* vec */) {
    static_assert(lg_att_mma_forward_shared<HSP>() <= LG_CUDA_SHARED_OPTIN_MIN, "the forward's "
                  "tiles exceed the shared memory a block has on compute capability 8.6, 8.9, 12.0");
    size_t bytes = lg_att_mma_forward_shared<HSP>();
    lg_att_allow_shared(ex, lg_k_attention_forward_mma<DT, HSP>, bytes);
    unsigned grid = (unsigned)((T + LG_ATT_TC_ROWS - 1) / LG_ATT_TC_ROWS) * (unsigned)(B * NH);
    LG_LAUNCH((lg_k_attention_forward_mma<DT, HSP>), grid, LG_ATT_TC_THREADS, bytes,
              lg_cuda_stream(ex), (uint16_t *)y.data, (float *)lse, (const uint16_t *)qkv.data, T,
              NH, NQG, HS, 1.0f / sqrtf((float)HS));
}

/* D (B, NH, T) = dy . y over each head's HS dims, once per row before the two backward kernels
   (as FlashAttention-2 does): LG_ATT_D_LANES consecutive lanes a row of dy, y (B, T, NH, HS),
   16-byte loads (HS a multiple of 8, rows 16-byte aligned: lg_att_tc_applies), the lanes' parts
   summed by shuffles. rows = B T NH; grid: rows LG_ATT_D_LANES / LG_ATT_TC_THREADS blocks. */
#define LG_ATT_D_LANES 8
template <lg_dtype DT>
__global__ void __launch_bounds__(LG_ATT_TC_THREADS)
lg_k_attention_rowdot(float *D, const uint16_t *dy, const uint16_t *y, int T, int NH, int HS,
                      size_t rows) {
    typedef lg_att_io<DT> io;
    constexpr int V = LG_ATT_TC_VEC;
    size_t r = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / LG_ATT_D_LANES;
    int part = (int)threadIdx.x % LG_ATT_D_LANES;
    float sum = 0.0f;
    if (r < rows)
        for (int d = part * V; d < HS; d += LG_ATT_D_LANES * V) {
            uint4 a = *(const uint4 *)(dy + r * HS + d), c = *(const uint4 *)(y + r * HS + d);
            const unsigned wa[4] = {a.x, a.y, a.z, a.w}, wc[4] = {c.x, c.y, c.z, c.w};
            LG_ATT_UNROLL
            for (int e = 0; e < V; e++) /* element e: half e % 2 of 32-bit word e / 2 */
                sum += io::to_f32((uint16_t)(wa[e / 2] >> 16 * (e % 2))) *
                       io::to_f32((uint16_t)(wc[e / 2] >> 16 * (e % 2)));
        }
    for (int o = LG_ATT_D_LANES / 2; o > 0; o /= 2)
        sum += __shfl_xor_sync(LG_CUDA_FULL_MASK, sum, o);
    if (part == 0 && r < rows) {
        size_t bt = r / NH, b = bt / T, t = bt % T, h = r % NH;
        D[(b * NH + h) * T + t] = sum;
    }
}

/* The dq kernel's dS = P (dP - D) scale, P = exp(S scale - lse), in place of s (ST 16 x 8
   tiles; the thread's rows t0 and t0 + 8 with lse L and D, its columns c0 + 8 st and + 1).
   MASKED (the diagonal and last key tiles only): keys after the row's query, from T on or in
   score tiles from `live` on give 0. */
template <bool MASKED, int ST>
__device__ __forceinline__ void lg_att_dq_ds(float (*s)[4], const float (*dp)[4], const float L[2],
                                             const float D[2], float scale, int t0, int c0,
                                             int live, int T) {
    LG_ATT_UNROLL
    for (int st = 0; st < ST; st++) {
        LG_ATT_UNROLL
        for (int e = 0; e < 4; e++) { /* e / 2: row t0 + 8 (e / 2); e % 2: the column */
            int t = t0 + 8 * (e / 2), c = c0 + st * LG_ATT_MMA_N + e % 2;
            bool keep = !MASKED || (st < live && c <= t && c < T);
            float p = keep ? __expf(s[st][e] * scale - L[e / 2]) : 0.0f;
            s[st][e] = p * (dp[st][e] - D[e / 2]) * scale;
        }
    }
}

/* Keys of a dq tile: 32 at HSP 128, so that its shared memory (Q, dY and two buffers each of K
   and V) fits LG_CUDA_SHARED_OPTIN_MIN; 64 below. */
template <int HSP> struct lg_att_mma_dq {
    static constexpr int KEYS = HSP >= 128 ? 32 : LG_ATT_MMA_KEYS;
};

/* Backward, dq. A block owns one query tile (64 queries) of one (batch, head), heaviest first,
   and sweeps the key tiles (BC = lg_att_mma_dq's keys, cp.async into two buffers) up to its
   diagonal; warp w owns queries 16 w .. 16 w + 15, whose Q and dY A fragments stay in
   registers from the first key tile to the last. A thread first takes its two rows' lse and D
   (lg_k_attention_rowdot's). Per key tile: S = Q K^T and dP = dY V^T (16 x BC each, in
   accumulators), P = exp(S scale -
   lse), dS = P (dP - D) scale (masked on the diagonal and last tiles only), rounded to 16 bits
   as A fragments, and dQ += dS K. At the end dQ (in accumulators all along) is added to dqkv.
   grid: query tiles x B NH, the (batch, head) fastest; 4 warps. */
template <lg_dtype DT, int HSP>
__global__ void __launch_bounds__(LG_ATT_TC_THREADS)
lg_k_attention_backward_dq_mma(uint16_t *dqkv, const uint16_t *dy, const float *Drows,
                               const uint16_t *qkv, const float *lse, int T, int NH, int NQG,
                               int HS, float scale) {
    constexpr int M = LG_ATT_MMA_M, N = LG_ATT_MMA_N, K = LG_ATT_MMA_K, BR = LG_ATT_TC_ROWS,
                  BC = lg_att_mma_dq<HSP>::KEYS, LDH = HSP + LG_ATT_TC_HPAD;
    constexpr int QK = HSP / K, ST = BC / N, PK = BC / K, OT = HSP / N;
    LG_SHARED_DYNAMIC(unsigned char, smem);
    uint16_t *qs = (uint16_t *)smem;                  /* (BR, LDH): Q */
    uint16_t *dys = qs + BR * LDH;                    /* (BR, LDH): dY */
    uint16_t *ks = dys + BR * LDH;                    /* (STAGES, BC, LDH): K */
    uint16_t *vs = ks + LG_ATT_MMA_STAGES * BC * LDH; /* (STAGES, BC, LDH): V */
    int tiles = (T + BR - 1) / BR, heads = (int)(gridDim.x / tiles);
    int q0 = (tiles - 1 - (int)blockIdx.x / heads) * BR, bh = (int)blockIdx.x % heads;
    int b = bh / NH, h = bh % NH, g = h / (NH / NQG), hs16 = HS / K, hs8 = HS / N;
    int warp = (int)threadIdx.x / LG_CUDA_WARP, lane = (int)threadIdx.x % LG_CUDA_WARP;
    int group = lane / 4, tig = lane % 4, w0 = warp * M;
    int wlast = min(T - 1, q0 + w0 + M - 1);
    int key_tiles = (min(T, q0 + BR) + BC - 1) / BC;
    size_t QKV = (size_t)(NH + 2 * NQG) * HS, ldy = (size_t)NH * HS;
    size_t at = (size_t)b * T * QKV, aty = (size_t)b * T * ldy + (size_t)h * HS;
    const uint16_t *kbase = qkv + at + (size_t)(NH + g) * HS;
    const uint16_t *vbase = qkv + at + (size_t)(NH + NQG + g) * HS;

    lg_att_mma_load<HSP, BR>(qs, qkv + at + (size_t)h * HS, QKV, q0, T, HS);
    lg_att_mma_load<HSP, BR>(dys, dy + aty, ldy, q0, T, HS);
    lg_att_mma_load<HSP, BC>(ks, kbase, QKV, 0, T, HS);
    lg_att_mma_load<HSP, BC>(vs, vbase, QKV, 0, T, HS);
    lg_cp_async_commit();

    float L[2], D[2]; /* rows group and group + 8: lse and dy . y */
    LG_ATT_UNROLL
    for (int i = 0; i < 2; i++) {
        int t = q0 + w0 + group + 8 * i;
        D[i] = t < T ? Drows[((size_t)b * NH + h) * T + t] : 0.0f;
        L[i] = t < T ? lse[((size_t)b * NH + h) * T + t] : 0.0f;
    }
    uint32_t qf[QK][4], dyf[QK][4]; /* the warp's Q and dY (16 x HSP) as A fragments */
    float dq[OT][4];
    LG_ATT_UNROLL
    for (int ot = 0; ot < OT; ot++) dq[ot][0] = dq[ot][1] = dq[ot][2] = dq[ot][3] = 0.0f;
    for (int j = 0; j < key_tiles; j++) {
        int k0 = j * BC;
        const uint16_t *kt = ks + (j % LG_ATT_MMA_STAGES) * BC * LDH;
        const uint16_t *vt = vs + (j % LG_ATT_MMA_STAGES) * BC * LDH;
        if (j + 1 < key_tiles) {
            int next = (j + 1) % LG_ATT_MMA_STAGES;
            lg_att_mma_load<HSP, BC>(ks + next * BC * LDH, kbase, QKV, k0 + BC, T, HS);
            lg_att_mma_load<HSP, BC>(vs + next * BC * LDH, vbase, QKV, k0 + BC, T, HS);
            lg_cp_async_commit();
            lg_cp_async_wait<1>();
        } else {
            lg_cp_async_wait<0>();
        }
        __syncthreads();
        if (j == 0) lg_att_mma_a_rows<QK>(qf, qs + w0 * LDH, LDH, hs16, lane);
        if (j == 0) lg_att_mma_a_rows<QK>(dyf, dys + w0 * LDH, LDH, hs16, lane);
        int live = wlast < k0 ? 0 : min(ST, (wlast - k0) / N + 1);
        float s[ST][4], dp[ST][4];
        LG_ATT_UNROLL
        for (int st = 0; st < ST; st++) {
            if (st < live)
                lg_att_mma_pair<DT, QK, true>(s[st], dp[st], qf, dyf, qs + w0 * LDH,
                                              dys + w0 * LDH, kt + st * N * LDH,
                                              vt + st * N * LDH, LDH, hs16, lane);
            else
                s[st][0] = s[st][1] = s[st][2] = s[st][3] = dp[st][0] = dp[st][1] = dp[st][2] =
                    dp[st][3] = 0.0f;
        }
        /* a key tile wholly at or before the warp's first query, below T, needs no mask */
        int t0 = q0 + w0 + group, c0 = k0 + 2 * tig;
        if (k0 + BC - 1 <= q0 + w0 && k0 + BC <= T)
            lg_att_dq_ds<false, ST>(s, dp, L, D, scale, t0, c0, live, T);
        else
            lg_att_dq_ds<true, ST>(s, dp, L, D, scale, t0, c0, live, T);
        lg_att_scores_times<DT, PK, OT>(dq, s, live, kt, LDH, hs8, lane);
        __syncthreads();
    }
    lg_att_mma_add<DT, OT>(dqkv + at + (size_t)h * HS, QKV, dq, q0 + w0, T, HS, group, tig);
}

/* Query columns of a dk/dv tile: fewer at HSP 128, where dK and dV take 128 registers. */
template <int HSP> struct lg_att_mma_dkv {
    static constexpr int QUERIES = HSP >= 128 ? 32 : 64;
};

/* The dk/dv kernel's P^T = exp(S^T scale - lse) (in place of s) and dS^T = P^T (dP^T - D)
   scale (in place of dp), ST 16 x 8 tiles: the thread's key rows c and c + 8, its columns
   (queries q0 + 8 st + 2 tig and + 1) with lse and D from lses, ds (BQ). MASKED (tiles that
   cross the diagonal or T only): queries before the key, from T on, keys from T on or tiles
   not live give 0. */
template <bool MASKED, int ST>
__device__ __forceinline__ void lg_att_dkv_ps(float (*s)[4], float (*dp)[4], const bool *live,
                                              const float *lses, const float *ds, float scale,
                                              int c, int q0, int tig, int T) {
    LG_ATT_UNROLL
    for (int st = 0; st < ST; st++) {
        LG_ATT_UNROLL
        for (int e = 0; e < 4; e++) { /* e / 2: key row c + 8 (e / 2); e % 2: the column */
            int k = c + 8 * (e / 2), col = st * LG_ATT_MMA_N + 2 * tig + e % 2, q = q0 + col;
            float p = !MASKED || (live[st] && q >= k && q < T && k < T)
                          ? __expf(s[st][e] * scale - lses[col])
                          : 0.0f;
            s[st][e] = p;
            dp[st][e] = p * (dp[st][e] - ds[col]) * scale;
        }
    }
}

/* The dk/dv kernel's S^T = K Q^T and dP^T = V dY^T over one query tile: ST 16 x 8 tiles each
   (K and V: the warp's A fragments kf, vf when HOLD, else its rows ksw, vsw; Q and dY: the
   tile's rows qt, dyt (BQ, ld)); live[st]: the score tile has a query at or after the warp's
   first key c0 and below T (else its tiles are zeros). */
template <lg_dtype DT, int QK, int ST, bool HOLD>
__device__ __forceinline__ void lg_att_dkv_scores(float (*s)[4], float (*dp)[4], bool *live,
                                                  const uint32_t (*kf)[4], const uint32_t (*vf)[4],
                                                  const uint16_t *ksw, const uint16_t *vsw,
                                                  const uint16_t *qt, const uint16_t *dyt, int ld,
                                                  int q0, int c0, int T, int hs16, int lane) {
    constexpr int N = LG_ATT_MMA_N;
    LG_ATT_UNROLL
    for (int st = 0; st < ST; st++) {
        live[st] = q0 + st * N + N - 1 >= c0 && q0 + st * N < T;
        if (live[st])
            lg_att_mma_pair<DT, QK, HOLD>(s[st], dp[st], kf, vf, ksw, vsw, qt + st * N * ld,
                                          dyt + st * N * ld, ld, hs16, lane);
        else
            s[st][0] = s[st][1] = s[st][2] = s[st][3] = dp[st][0] = dp[st][1] = dp[st][2] =
                dp[st][3] = 0.0f;
    }
}

/* The dk/dv kernel's dV += P^T dY and dK += dS^T Q over one query tile: P^T (s) and dS^T (dp)
   rounded to 16 bits as A fragments, a k step of 16 queries taking score tiles 2 pk and
   2 pk + 1; dY and Q: the tile's rows dyt, qt (BQ, ld) in shared memory. */
template <lg_dtype DT, int PK, int OT>
__device__ __forceinline__ void lg_att_dkv_accumulate(float (*dv)[4], float (*dk)[4],
                                                      const float (*s)[4], const float (*dp)[4],
                                                      const bool *live, const uint16_t *dyt,
                                                      const uint16_t *qt, int ld, int hs8,
                                                      int lane) {
    constexpr int N = LG_ATT_MMA_N, K = LG_ATT_MMA_K;
    LG_ATT_UNROLL
    for (int pk = 0; pk < PK; pk++) {
        if (!live[2 * pk] && !live[2 * pk + 1]) continue;
        uint32_t pf[4], dsf[4];
        lg_att_mma_a_from<DT>(pf, s[2 * pk], s[2 * pk + 1]);
        lg_att_mma_a_from<DT>(dsf, dp[2 * pk], dp[2 * pk + 1]);
        LG_ATT_UNROLL
        for (int ot = 0; ot < OT; ot++)
            if (ot < hs8) {
                uint32_t bf[2];
                lg_att_mma_b_cols(bf, dyt + pk * K * ld + ot * N, ld, lane);
                lg_mma_m16n8k16<DT>(dv[ot], pf, bf, dv[ot]);
                lg_att_mma_b_cols(bf, qt + pk * K * ld + ot * N, ld, lane);
                lg_mma_m16n8k16<DT>(dk[ot], dsf, bf, dk[ot]);
            }
    }
}

/* Backward, dk and dv. A block owns one key tile (64 keys) of one (batch, group), heaviest
   (earliest) first, and sweeps, for each query head of the group, the query tiles from its
   diagonal to T (Q and dY by cp.async into two buffers, the next tile's in flight); warp w owns
   keys 16 w .. 16 w + 15, whose K and V A fragments stay in registers throughout. Per query
   tile: the queries' lse and D (lg_k_attention_rowdot's) into shared memory; S^T = K Q^T and
   dP^T = V dY^T (in accumulators), P^T = exp(S^T scale - lse), dS^T = P^T (dP^T - D) scale
   (masked on tiles that cross the diagonal or T only); dV += P^T dY and dK += dS^T Q with P^T
   and dS^T as A fragments. Query score tiles wholly before the warp's first key or past T are
   skipped. At the end dK and dV (in accumulators all along) are added to dqkv.
   grid: key tiles x B NQG, the (batch, group) fastest; 4 warps. */
template <lg_dtype DT, int HSP>
__global__ void __launch_bounds__(LG_ATT_TC_THREADS)
lg_k_attention_backward_dkv_mma(uint16_t *dqkv, const uint16_t *dy, const float *Drows,
                                const uint16_t *qkv, const float *lse, int T, int NH, int NQG,
                                int HS, float scale) {
    constexpr int M = LG_ATT_MMA_M, N = LG_ATT_MMA_N, K = LG_ATT_MMA_K, BK = LG_ATT_TC_ROWS,
                  BQ = lg_att_mma_dkv<HSP>::QUERIES, LDH = HSP + LG_ATT_TC_HPAD;
    constexpr int QK = HSP / K, ST = BQ / N, PK = BQ / K, OT = HSP / N;
    LG_SHARED_DYNAMIC(unsigned char, smem);
    uint16_t *ks = (uint16_t *)smem;                    /* (BK, LDH): K */
    uint16_t *vs = ks + BK * LDH;                       /* (BK, LDH): V */
    uint16_t *qs = vs + BK * LDH;                       /* (STAGES, BQ, LDH): Q */
    uint16_t *dys = qs + LG_ATT_MMA_STAGES * BQ * LDH;  /* (STAGES, BQ, LDH): dY */
    float *lses = (float *)(dys + LG_ATT_MMA_STAGES * BQ * LDH); /* (BQ) */
    float *ds = lses + BQ;                                       /* (BQ): D = dy . y */
    int tiles = (T + BK - 1) / BK, groups = (int)(gridDim.x / tiles);
    int k0 = (int)blockIdx.x / groups * BK, bg = (int)blockIdx.x % groups;
    int b = bg / NQG, g = bg % NQG, heads_per_group = NH / NQG, hs16 = HS / K, hs8 = HS / N;
    int warp = (int)threadIdx.x / LG_CUDA_WARP, lane = (int)threadIdx.x % LG_CUDA_WARP;
    int group = lane / 4, tig = lane % 4, w0 = warp * M, c0 = k0 + w0;
    size_t QKV = (size_t)(NH + 2 * NQG) * HS, ldy = (size_t)NH * HS;
    size_t at = (size_t)b * T * QKV, aty = (size_t)b * T * ldy;
    /* the work: query tiles [qstart, T) of each head of the group, one after another */
    int qstart = k0 / BQ * BQ, per_head = (T - qstart + BQ - 1) / BQ;
    int items = heads_per_group * per_head;

    lg_att_mma_load<HSP, BK>(ks, qkv + at + (size_t)(NH + g) * HS, QKV, k0, T, HS);
    lg_att_mma_load<HSP, BK>(vs, qkv + at + (size_t)(NH + NQG + g) * HS, QKV, k0, T, HS);
    size_t h0 = (size_t)g * heads_per_group * HS; /* the group's first head */
    lg_att_mma_load<HSP, BQ>(qs, qkv + at + h0, QKV, qstart, T, HS);
    lg_att_mma_load<HSP, BQ>(dys, dy + aty + h0, ldy, qstart, T, HS);
    lg_cp_async_commit();

    /* the warp's K and V (16 x HSP) as A fragments, held from the first query tile to the last;
       at HSP 128 (where dK and dV take 128 registers, and held fragments spill) read from shared
       memory at each product instead */
    constexpr bool HOLD = HSP < LG_ATT_TC_MAX_HEAD;
    uint32_t kf[HOLD ? QK : 1][4], vf[HOLD ? QK : 1][4];
    float dk[OT][4], dv[OT][4];
    LG_ATT_UNROLL
    for (int ot = 0; ot < OT; ot++)
        LG_ATT_UNROLL
        for (int e = 0; e < 4; e++) dk[ot][e] = dv[ot][e] = 0.0f;
    for (int n = 0; n < items; n++) {
        int h = g * heads_per_group + n / per_head, q0 = qstart + n % per_head * BQ;
        const uint16_t *qt = qs + (n % LG_ATT_MMA_STAGES) * BQ * LDH;
        const uint16_t *dyt = dys + (n % LG_ATT_MMA_STAGES) * BQ * LDH;
        if (n + 1 < items) {
            int hn = g * heads_per_group + (n + 1) / per_head;
            int qn = qstart + (n + 1) % per_head * BQ, next = (n + 1) % LG_ATT_MMA_STAGES;
            lg_att_mma_load<HSP, BQ>(qs + next * BQ * LDH, qkv + at + (size_t)hn * HS, QKV, qn, T,
                                     HS);
            lg_att_mma_load<HSP, BQ>(dys + next * BQ * LDH, dy + aty + (size_t)hn * HS, ldy, qn, T,
                                     HS);
            lg_cp_async_commit();
            lg_cp_async_wait<1>();
        } else {
            lg_cp_async_wait<0>();
        }
        lg_att_tc_rows<BQ>(lses, ds, lse + ((size_t)b * NH + h) * T,
                           Drows + ((size_t)b * NH + h) * T, q0, T);
        __syncthreads();
        if (HOLD && n == 0) {
            lg_att_mma_a_rows<HOLD ? QK : 1>(kf, ks + w0 * LDH, LDH, hs16, lane);
            lg_att_mma_a_rows<HOLD ? QK : 1>(vf, vs + w0 * LDH, LDH, hs16, lane);
        }
        bool live[ST];
        float s[ST][4], dp[ST][4]; /* S^T and dP^T (16 x BQ), then P^T and dS^T */
        lg_att_dkv_scores<DT, QK, ST, HOLD>(s, dp, live, kf, vf, ks + w0 * LDH, vs + w0 * LDH, qt,
                                            dyt, LDH, q0, c0, T, hs16, lane);
        /* a query tile wholly at or after the warp's last key, with it below T, needs no mask */
        if (q0 >= c0 + M - 1 && q0 + BQ <= T && c0 + M <= T)
            lg_att_dkv_ps<false, ST>(s, dp, live, lses, ds, scale, c0 + group, q0, tig, T);
        else
            lg_att_dkv_ps<true, ST>(s, dp, live, lses, ds, scale, c0 + group, q0, tig, T);
        lg_att_dkv_accumulate<DT, PK, OT>(dv, dk, s, dp, live, dyt, qt, LDH, hs8, lane);
        __syncthreads(); /* this tile's buffers and rows are used up before they are refilled */
    }
    lg_att_mma_add<DT, OT>(dqkv + at + (size_t)(NH + g) * HS, QKV, dk, c0, T, HS, group, tig);
    lg_att_mma_add<DT, OT>(dqkv + at + (size_t)(NH + NQG + g) * HS, QKV, dv, c0, T, HS, group,
                           tig);
}

/* Bytes of dynamic shared memory of the dq kernel (Q, dY, two buffers each of K and V: 68 KiB
   at HSP 128, with its 32 keys a tile) and of the dk/dv kernel (K, V, two buffers each of Q and
   dY, lse and D). */
template <int HSP> static constexpr size_t lg_att_mma_dq_shared(void) {
    return sizeof(uint16_t) * (2 * LG_ATT_TC_ROWS + 2 * LG_ATT_MMA_STAGES * lg_att_mma_dq<HSP>::KEYS) *
           (HSP + LG_ATT_TC_HPAD);
}
template <int HSP> static constexpr size_t lg_att_mma_dkv_shared(void) {
    const size_t BQ = lg_att_mma_dkv<HSP>::QUERIES;
    return sizeof(uint16_t) * (2 * LG_ATT_TC_ROWS + 2 * LG_ATT_MMA_STAGES * BQ) *
               (HSP + LG_ATT_TC_HPAD) +
           sizeof(float) * 2 * BQ;
}

/* The two backward kernels of batches [b0, b0 + B) (pointers to batch b0), after the D
   pre-kernel into Drows (B, NH, T). */
template <lg_dtype DT, int HSP>
static void lg_att_mma_backward_slice(const lg_exec *ex, uint16_t *dqkv, const uint16_t *dy,
                                      const uint16_t *y, const uint16_t *qkv, const float *lse,
                                      float *Drows, int B, int T, int NH, int NQG, int HS) {
    float scale = 1.0f / sqrtf((float)HS);
    cudaStream_t stream = lg_cuda_stream(ex);
    size_t rows = (size_t)B * T * NH;
    LG_LAUNCH((lg_k_attention_rowdot<DT>),
              (unsigned)((rows * LG_ATT_D_LANES + LG_ATT_TC_THREADS - 1) / LG_ATT_TC_THREADS),
              LG_ATT_TC_THREADS, 0, stream, Drows, dy, y, T, NH, HS, rows);
    unsigned tiles = (unsigned)((T + LG_ATT_TC_ROWS - 1) / LG_ATT_TC_ROWS);
    static_assert(lg_att_mma_dq_shared<HSP>() <= LG_CUDA_SHARED_OPTIN_MIN &&
                      lg_att_mma_dkv_shared<HSP>() <= LG_CUDA_SHARED_OPTIN_MIN,
                  "the backward's tiles exceed the shared memory a block has on compute "
                  "capability 8.6, 8.9, 12.0");
    size_t bytes = lg_att_mma_dq_shared<HSP>();
    lg_att_allow_shared(ex, lg_k_attention_backward_dq_mma<DT, HSP>, bytes);
    LG_LAUNCH((lg_k_attention_backward_dq_mma<DT, HSP>), tiles * (unsigned)(B * NH),
              LG_ATT_TC_THREADS, bytes, stream, dqkv, dy, (const float *)Drows, qkv, lse, T, NH,
              NQG, HS, scale);
    /* the two kernels write disjoint parts of dqkv (queries; keys and values) */
    bytes = lg_att_mma_dkv_shared<HSP>();
    lg_att_allow_shared(ex, lg_k_attention_backward_dkv_mma<DT, HSP>, bytes);
    LG_LAUNCH((lg_k_attention_backward_dkv_mma<DT, HSP>), tiles * (unsigned)(B * NQG),
              LG_ATT_TC_THREADS, bytes, stream, dqkv, dy, (const float *)Drows, qkv, lse, T, NH,
              NQG, HS, scale);
}

/* The backward in slices of as many batches as the matmul workspace (free between matmuls in
   stream order) holds D (NH, T) floats for. */
template <lg_dtype DT, int HSP>
static void lg_att_mma_backward_launch(const lg_exec *ex, lg_buf dqkv, lg_buf dy, lg_buf y,
                                       lg_buf qkv, const lg_real *lse, int B, int T, int NH,
                                       int NQG, int HS, int /* vec */) {
    size_t per_batch = (size_t)NH * T, fit = ex->cuda->matmul_workspace_bytes / sizeof(float);
    if (fit < per_batch) { /* a bug: the plan sizes the workspace for one batch's D */
        fprintf(stderr, "CUDA backend: attention's D of %d heads x %d rows exceeds the matmul "
                "workspace (lg_cuda_workspace_bytes)\n", NH, T);
        abort();
    }
    int slice = fit / per_batch < (size_t)B ? (int)(fit / per_batch) : B;
    size_t QKV = (size_t)(NH + 2 * NQG) * HS * T, Y = (size_t)NH * HS * T;
    for (int b0 = 0; b0 < B; b0 += slice)
        lg_att_mma_backward_slice<DT, HSP>(
            ex, (uint16_t *)dqkv.data + b0 * QKV, (const uint16_t *)dy.data + b0 * Y,
            (const uint16_t *)y.data + b0 * Y, (const uint16_t *)qkv.data + b0 * QKV,
            (const float *)lse + b0 * per_batch, (float *)ex->cuda->matmul_workspace,
            B - b0 < slice ? B - b0 : slice, T, NH, NQG, HS);
}

/* 1 when the tensor-core kernels take the call: bf16 or fp16 storage, HS a multiple of 16 up to
   128, every buffer 16-byte aligned (the tiles move in 16-byte steps), and the rank has not
   asked for the CUDA-core kernels (tests). */
static int lg_att_tc_applies(const lg_exec *ex, const lg_buf *bufs, int nbufs, int HS) {
    if (ex->cuda->cuda_core_attention || HS % LG_ATT_MMA_K || HS > LG_ATT_TC_MAX_HEAD) return 0;
    if (bufs[0].dtype != LG_DTYPE_BF16 && bufs[0].dtype != LG_DTYPE_F16) return 0;
    for (int i = 0; i < nbufs; i++)
        if ((uintptr_t)bufs[i].data % (LG_ATT_TC_VEC * sizeof(uint16_t))) return 0;
    return 1;
}

/* The tensor-core launcher for a storage type (bf16, fp16) and HS: HSP the smallest of 32, 64,
   128 that holds it. */
template <lg_dtype DT> static lg_att_forward_fn lg_att_tc_forward_for(int HS) {
    return HS <= 32   ? lg_att_mma_forward_launch<DT, 32>
           : HS <= 64 ? lg_att_mma_forward_launch<DT, 64>
                      : lg_att_mma_forward_launch<DT, 128>;
}
template <lg_dtype DT> static lg_att_backward_fn lg_att_tc_backward_for(int HS) {
    return HS <= 32   ? lg_att_mma_backward_launch<DT, 32>
           : HS <= 64 ? lg_att_mma_backward_launch<DT, 64>
                      : lg_att_mma_backward_launch<DT, 128>;
}

/* y (B, T, NH HS), lse (B, NH, T) = causal attention of qkv (B, T, (NH + 2 NQG) HS). */
static void lg_cuda_attention_forward(const lg_exec *ex, lg_buf y, lg_real *lse, lg_buf qkv,
                                      int B, int T, int NH, int NQG, int HS) {
    lg_buf bufs[2] = {y, qkv};
    lg_att_check("lg_cuda_attention_forward", bufs, 2, B, T, NH, NQG, HS);
    if (B <= 0 || T <= 0 || NH <= 0) return;
    int vec = lg_att_vectorizable(bufs, 2, HS);
    lg_att_forward_fn typed =
        y.dtype == LG_DTYPE_BF16  ? lg_att_forward_typed<LG_DTYPE_BF16>
        : y.dtype == LG_DTYPE_F16 ? lg_att_forward_typed<LG_DTYPE_F16>
                                  : lg_att_forward_typed<LG_DTYPE_F32>;
    if (lg_att_tc_applies(ex, bufs, 2, HS))
        typed = y.dtype == LG_DTYPE_BF16 ? lg_att_tc_forward_for<LG_DTYPE_BF16>(HS)
                                         : lg_att_tc_forward_for<LG_DTYPE_F16>(HS);
    typed(ex, y, lse, qkv, B, T, NH, NQG, HS, vec);
}

/* dqkv (B, T, (NH + 2 NQG) HS) += the attention's gradient, given dy (B, T, NH HS), the
   forward's y (B, T, NH HS) and lse (B, NH, T), and qkv. */
static void lg_cuda_attention_backward(const lg_exec *ex, lg_buf dqkv, lg_buf dy, lg_buf y,
                                       lg_buf qkv, const lg_real *lse, int B, int T, int NH,
                                       int NQG, int HS) {
    lg_buf bufs[4] = {dqkv, dy, y, qkv};
    lg_att_check("lg_cuda_attention_backward", bufs, 4, B, T, NH, NQG, HS);
    if (B <= 0 || T <= 0 || NH <= 0) return;
    int vec = lg_att_vectorizable(bufs, 4, HS);
    lg_att_backward_fn typed =
        dqkv.dtype == LG_DTYPE_BF16  ? lg_att_backward_typed<LG_DTYPE_BF16>
        : dqkv.dtype == LG_DTYPE_F16 ? lg_att_backward_typed<LG_DTYPE_F16>
                                     : lg_att_backward_typed<LG_DTYPE_F32>;
    if (lg_att_tc_applies(ex, bufs, 4, HS))
        typed = dqkv.dtype == LG_DTYPE_BF16 ? lg_att_tc_backward_for<LG_DTYPE_BF16>(HS)
                                            : lg_att_tc_backward_for<LG_DTYPE_F16>(HS);
    typed(ex, dqkv, dy, y, qkv, lse, B, T, NH, NQG, HS, vec);
}

/* h. matmuls: cuBLASLt, and a reference kernel (tests, emulation) ----------------------------- */

#ifndef LG_CUDA_EMULATE
#define LG_CUBLAS_TRY(call)                                                                    \
    do {                                                                                       \
        cublasStatus_t lg_status_ = (call);                                                    \
        if (lg_status_ != CUBLAS_STATUS_SUCCESS)                                               \
            lg_cuda_die(#call, __FILE__, __LINE__, cublasLtGetStatusString(lg_status_));         \
    } while (0)
#endif

#define LG_MATMUL_TILE 16 /* the reference kernel's square tile */

/* C (M, N) = beta C + op(A) op(B), row-major as lg_gemm: a block computes one tile of C from
   tiles of op(A) and op(B) staged in shared memory, one element a thread, fp32 accumulation.
   beta == 0 overwrites C whatever it held. The test of cuBLASLt and the emulator's matmul. */
__global__ void lg_k_matmul_reference(int trans_a, int trans_b, int M, int N, int K, lg_buf A,
                                      int lda, lg_buf B, int ldb, float beta, lg_buf C, int ldc) {
    __shared__ float a_tile[LG_MATMUL_TILE][LG_MATMUL_TILE];
    __shared__ float b_tile[LG_MATMUL_TILE][LG_MATMUL_TILE];
    int row = blockIdx.y * LG_MATMUL_TILE + threadIdx.y;
    int col = blockIdx.x * LG_MATMUL_TILE + threadIdx.x;
    float sum = 0;
    for (int k0 = 0; k0 < K; k0 += LG_MATMUL_TILE) {
        int ka = k0 + threadIdx.x, kb = k0 + threadIdx.y;
        size_t at_a = trans_a ? (size_t)ka * lda + row : (size_t)row * lda + ka;
        size_t at_b = trans_b ? (size_t)col * ldb + kb : (size_t)kb * ldb + col;
        a_tile[threadIdx.y][threadIdx.x] = row < M && ka < K ? lg_get(A, at_a) : 0.0f;
        b_tile[threadIdx.y][threadIdx.x] = col < N && kb < K ? lg_get(B, at_b) : 0.0f;
        __syncthreads();
        for (int k = 0; k < LG_MATMUL_TILE; k++) sum += a_tile[threadIdx.y][k] * b_tile[k][threadIdx.x];
        __syncthreads();
    }
    if (row >= M || col >= N) return;
    size_t at = (size_t)row * ldc + col;
    lg_set(C, at, beta == 0.0f ? sum : beta * lg_get(C, at) + sum);
}

static void lg_cuda_matmul_reference(const lg_exec *ex, int trans_a, int trans_b, int M, int N,
                                     int K, lg_buf A, int lda, lg_buf B, int ldb, float beta,
                                     lg_buf C, int ldc) {
    dim3 block(LG_MATMUL_TILE, LG_MATMUL_TILE);
    dim3 grid(lg_cuda_blocks((size_t)N, LG_MATMUL_TILE), lg_cuda_blocks((size_t)M, LG_MATMUL_TILE));
    LG_LAUNCH(lg_k_matmul_reference, grid, block, 0, lg_cuda_stream(ex), trans_a, trans_b, M, N,
              K, A, lda, B, ldb, beta, C, ldc);
}

/* The line of a rank stopped by cuBLASLt running out of memory inside an (M x N x K) matmul,
   in out (cap bytes): the step's error (lg_cuda_stop), its setting named as the library names
   them (a driver spells it as its flag). Outside the cuBLASLt code so that the emulator's tests
   read it. */
static inline const char *lg_lt_out_of_memory_line(const lg_cuda_rank *g, int M, int N, int K,
                                                   char *out, size_t cap) {
    snprintf(out, cap, "GPU %d: out of memory inside cuBLASLt (a %d x %d x %d matmul): the "
             "device had less free than the plan kept (its margin); a larger `memory_margin` "
             "keeps more free", g->device, M, N, K);
    return out;
}

/* Stops the rank's computing on a failure an op cannot return (it returns nothing): the first
   one's line is kept for the trainer, which discards the step and returns it as its error
   (lg_rank_failure); the rank's later matmuls do nothing. (inline: the emulator's driver has
   no cuBLASLt to call it; its tests do.) */
static inline void lg_cuda_stop(lg_cuda_rank *g, const char *line) {
    if (!g->stopped[0]) snprintf(g->stopped, sizeof g->stopped, "%s", line);
}

#ifndef LG_CUDA_EMULATE
static cudaDataType_t lg_cuda_data_type(lg_dtype dtype) {
    return dtype == LG_DTYPE_BF16 ? CUDA_R_16BF : dtype == LG_DTYPE_F16 ? CUDA_R_16F : CUDA_R_32F;
}

/* A (rows, cols) column-major layout of a matrix of the given storage type. */
static cublasLtMatrixLayout_t lg_cuda_layout(lg_dtype dtype, int rows, int cols, int ld) {
    cublasLtMatrixLayout_t layout;
    LG_CUBLAS_TRY(cublasLtMatrixLayoutCreate(&layout, lg_cuda_data_type(dtype), (uint64_t)rows,
                                             (uint64_t)cols, ld));
    return layout;
}

/* The largest power of two up to 256 that divides p: cuBLASLt picks its kernels by the
   operands' alignment, which it is told rather than assuming the worst. */
static uint32_t lg_cuda_alignment(const void *p) {
    uint32_t a = 256;
    while (a > 1 && (uintptr_t)p % a) a /= 2;
    return a;
}

#define LG_LT_CANDIDATES 4 /* algorithms asked of the heuristic, tried in its order */

/* What a cuBLASLt plan depends on: transpositions, sizes, leading dimensions, storage types,
   the bias's type (-1: none), the operands' alignments and the compute type. */
static void lg_lt_key(int key[LG_LT_KEY], int trans_a, int trans_b, int M, int N, int K,
                      lg_buf A, int lda, lg_buf B, int ldb, lg_buf C, int ldc, lg_buf bias,
                      int tf32) {
    const int k[LG_LT_KEY] = {trans_a, trans_b, M, N, K, lda, ldb, ldc, (int)A.dtype,
                              (int)B.dtype, (int)C.dtype, bias.data ? (int)bias.dtype : -1,
                              (int)lg_cuda_alignment(A.data), (int)lg_cuda_alignment(B.data),
                              (int)(lg_cuda_alignment(C.data) * 2 + (tf32 != 0))};
    memcpy(key, k, sizeof k);
}

static void lg_lt_plan_free(lg_lt_plan *p) {
    cublasLtMatrixLayoutDestroy(p->first);
    cublasLtMatrixLayoutDestroy(p->second);
    cublasLtMatrixLayoutDestroy(p->out);
    cublasLtMatmulDescDestroy(p->desc);
}

/* p's descriptor and layouts. cuBLASLt is column-major: row-major C (M, N) is column-major
   C^T (N, M) = op(B)^T op(A)^T, so B's buffer is its first operand and A's its second, each
   with its own transposition; the bias epilogue (its pointer set at each call) when given. */
static void lg_lt_plan_describe(lg_lt_plan *p, int all_tf32, int trans_a, int trans_b, int M,
                                int N, int K, lg_dtype a, int lda, lg_dtype b, int ldb,
                                lg_dtype c, int ldc, const lg_buf *bias) {
    cublasComputeType_t compute = all_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    LG_CUBLAS_TRY(cublasLtMatmulDescCreate(&p->desc, compute, CUDA_R_32F));
    cublasOperation_t op_first = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t op_second = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    LG_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first,
                                                 sizeof op_first));
    LG_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second,
                                                 sizeof op_second));
    if (bias->data) {
        cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
        cudaDataType_t bias_type = lg_cuda_data_type(bias->dtype);
        LG_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                     &epilogue, sizeof epilogue));
        LG_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                     &bias_type, sizeof bias_type));
    }
    p->first = trans_b ? lg_cuda_layout(b, K, N, ldb) : lg_cuda_layout(b, N, K, ldb);
    p->second = trans_a ? lg_cuda_layout(a, M, K, lda) : lg_cuda_layout(a, K, M, lda);
    p->out = lg_cuda_layout(c, N, M, ldc);
}

/* The heuristic's candidates for p (LG_LT_CANDIDATES at most, its order) given the operands'
   alignments, which cuBLASLt is told rather than assuming the worst; returns how many. */
static int lg_lt_candidates(const lg_cuda_rank *g, const lg_lt_plan *p, const void *a,
                            const void *b, const void *c,
                            cublasLtMatmulHeuristicResult_t heuristics[LG_LT_CANDIDATES]) {
    cublasLtMatmulPreference_t preference;
    LG_CUBLAS_TRY(cublasLtMatmulPreferenceCreate(&preference));
    size_t workspace = g->matmul_workspace_bytes;
    LG_CUBLAS_TRY(cublasLtMatmulPreferenceSetAttribute(
        preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof workspace));
    const struct { cublasLtMatmulPreferenceAttributes_t attribute; const void *p; } aligned[4] = {
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, c},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, c}};
    for (int k = 0; k < 4; k++) {
        uint32_t bytes = lg_cuda_alignment(aligned[k].p);
        LG_CUBLAS_TRY(cublasLtMatmulPreferenceSetAttribute(preference, aligned[k].attribute,
                                                           &bytes, sizeof bytes));
    }
    int found = 0;
    if (cublasLtMatmulAlgoGetHeuristic(g->lt, p->desc, p->first, p->second, p->out, p->out,
                                       preference, LG_LT_CANDIDATES, heuristics,
                                       &found) != CUBLAS_STATUS_SUCCESS)
        found = 0;
    cublasLtMatmulPreferenceDestroy(preference);
    return found;
}

/* The rank's plan for key, or NULL. */
static lg_lt_plan *lg_lt_find(lg_cuda_rank *g, const int key[LG_LT_KEY]) {
    int n = g->lt_plan_count < LG_LT_CACHE ? g->lt_plan_count : LG_LT_CACHE;
    for (int i = 0; i < n; i++)
        if (!memcmp(g->lt_plans[i].key, key, sizeof g->lt_plans[i].key)) return &g->lt_plans[i];
    return NULL;
}

/* The same product through cuBLASLt, with bias (N) added to every row when given, by the
   rank's plan for the shape: at the shape's first call its descriptor and layouts are made
   and the heuristic's candidates run in order until one is accepted, which the plan keeps
   (the oldest plan makes room when the cache is full). Returns -1 (nothing queued) when
   cuBLASLt has no algorithm for it or rejects every one it offered: the caller then runs the
   reference kernel. */
static int lg_cuda_matmul_lt(const lg_exec *ex, int trans_a, int trans_b, int M, int N, int K,
                             lg_buf A, int lda, lg_buf B, int ldb, float beta, lg_buf C, int ldc,
                             lg_buf bias) {
    lg_cuda_rank *g = ex->cuda;
    cudaStream_t stream = lg_cuda_stream(ex); /* the rank's GPU current for the heuristics too */
    int all_tf32 = A.dtype == LG_DTYPE_F32 && B.dtype == LG_DTYPE_F32 && g->tf32;
    int key[LG_LT_KEY];
    lg_lt_key(key, trans_a, trans_b, M, N, K, A, lda, B, ldb, C, ldc, bias, all_tf32);
    lg_lt_plan *p = lg_lt_find(g, key);
    const float one = 1.0f;
    int fresh = !p, done = 0;
    if (fresh) {
        p = &g->lt_plans[g->lt_plan_count % LG_LT_CACHE];
        if (g->lt_plan_count++ >= LG_LT_CACHE) lg_lt_plan_free(p);
        memcpy(p->key, key, sizeof p->key);
        lg_lt_plan_describe(p, all_tf32, trans_a, trans_b, M, N, K, A.dtype, lda, B.dtype, ldb,
                            C.dtype, ldc, &bias);
    }
    if (bias.data)
        LG_CUBLAS_TRY(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                     &bias.data, sizeof bias.data));
    cublasStatus_t status = CUBLAS_STATUS_NOT_SUPPORTED;
    if (fresh) {
        cublasLtMatmulHeuristicResult_t heuristics[LG_LT_CANDIDATES];
        int found = lg_lt_candidates(g, p, A.data, B.data, C.data, heuristics);
        p->usable = 0;
        for (int k = 0; k < found && !done; k++) {
            status = cublasLtMatmul(g->lt, p->desc, &one, B.data, p->first, A.data, p->second,
                                    &beta, C.data, p->out, C.data, p->out, &heuristics[k].algo,
                                    g->matmul_workspace, g->matmul_workspace_bytes, stream);
            done = status == CUBLAS_STATUS_SUCCESS;
            if (done) p->algo = heuristics[k].algo, p->usable = 1;
        }
    } else if (p->usable) {
        status = cublasLtMatmul(g->lt, p->desc, &one, B.data, p->first, A.data, p->second, &beta,
                                C.data, p->out, C.data, p->out, &p->algo, g->matmul_workspace,
                                g->matmul_workspace_bytes, stream);
        done = status == CUBLAS_STATUS_SUCCESS;
    }
    if (status == CUBLAS_STATUS_ALLOC_FAILED) { /* a plan that left too little free: stop */
        char line[1024];
        lg_cuda_stop(g, lg_lt_out_of_memory_line(g, M, N, K, line, sizeof line));
        return 0; /* (nothing queued, and nothing to run instead) */
    }
    if (!done && !g->matmul_fallbacks++)
        fprintf(stderr, "GPU %d: cuBLASLt has no algorithm for a (%d x %d x %d) matmul of %s x %s "
                "-> %s: the backend's own kernel runs it (and any other such)\n", g->device, M, N,
                K, lg_dtype_name(A.dtype), lg_dtype_name(B.dtype), lg_dtype_name(C.dtype));
    return done ? 0 : -1;
}
#endif

/* out (N, C), rows ld apart, += bias (C) on every row: the reference path's bias. */
__global__ void lg_k_add_bias(lg_buf out, lg_buf bias, int N, int C, int ld) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)N * C) return;
    size_t at = i / (size_t)C * (size_t)ld + i % (size_t)C;
    lg_set(out, at, lg_get(out, at) + lg_get(bias, i % C));
}

#define LG_CUDA_THREADS 256 /* threads of a block of the simple kernels */
#define LG_CUDA_BIAS_THREADS 128 /* bias gradient: column runs of a block at most */
#define LG_CUDA_BIAS_CHUNKS 256  /* ... and chunks of rows at most (the blocks of a GPU's SMs,
                                    several times over, for the widths of a model's biases) */

/* Stage one of dbias (C) += column sums of dout (N, C): block (column block, chunk) sums the
   `rows` rows of its chunk in order, a thread a run of `width` columns (lg_cuda_run_width),
   into partials (chunks, C) in the matmul workspace. A thread issues the loads of
   LG_CUDA_LOADS_IN_FLIGHT rows before it adds them (in row order: the same bits as one by one). */
__global__ void lg_k_bias_grad_chunks(float *partials, lg_buf dout, int N, int C, int rows,
                                      int width) {
    int runs = C / width, column_blocks = (runs + (int)blockDim.x - 1) / (int)blockDim.x;
    int chunk = blockIdx.x / column_blocks;
    int c = ((blockIdx.x % column_blocks) * (int)blockDim.x + threadIdx.x) * width;
    if (c >= C) return;
    int first = chunk * rows, last = first + rows < N ? first + rows : N, n = first;
    float sum[LG_PACK] = {0}, d[LG_CUDA_LOADS_IN_FLIGHT][LG_PACK];
    for (; n + LG_CUDA_LOADS_IN_FLIGHT <= last; n += LG_CUDA_LOADS_IN_FLIGHT) {
        for (int k = 0; k < LG_CUDA_LOADS_IN_FLIGHT; k++)
            lg_k_load_run(dout, (size_t)(n + k) * C + c, width, d[k]);
        for (int k = 0; k < LG_CUDA_LOADS_IN_FLIGHT; k++)
            for (int j = 0; j < width; j++) sum[j] += d[k][j];
    }
    for (; n < last; n++) {
        lg_k_load_run(dout, (size_t)n * C + c, width, d[0]);
        for (int j = 0; j < width; j++) sum[j] += d[0][j];
    }
    for (int j = 0; j < width; j++) partials[(size_t)chunk * C + c + j] = sum[j];
}

/* Stage two: dbias (C) = beta dbias + the chunks' partials in chunk order (beta 0 writes, 1
   adds), a thread a column: the same bits every run. */
__global__ void lg_k_bias_grad_add(lg_buf dbias, const float *partials, int chunks, int C,
                                   float beta) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float sum = 0.0f;
    for (int k = 0; k < chunks; k++) sum += partials[(size_t)k * C + c];
    lg_set(dbias, c, beta == 0.0f ? sum : lg_get(dbias, c) + sum);
}

/* dbias (C) = beta dbias + column sums of dout (N, C) in two stages, with up to
   LG_CUDA_BIAS_CHUNKS chunks of rows (as many as the matmul workspace holds partials for; it
   is free between matmuls in stream order). */
static void lg_cuda_bias_grad(const lg_exec *ex, lg_buf dbias, lg_buf dout, int N, int C,
                              float beta) {
    if (N == 0 || C == 0) return;
    size_t fit = ex->cuda->matmul_workspace_bytes / ((size_t)C * sizeof(float));
    int chunks = LG_CUDA_BIAS_CHUNKS < N ? LG_CUDA_BIAS_CHUNKS : N;
    if ((size_t)chunks > fit) chunks = (int)fit;
    if (chunks < 1) {
        fprintf(stderr, "CUDA backend: a bias of %d columns exceeds the matmul workspace\n", C);
        abort();
    }
    int rows = (N + chunks - 1) / chunks;
    chunks = (N + rows - 1) / rows; /* none empty */
    const lg_buf bufs[1] = {dout};
    int width = lg_cuda_run_width(C, bufs, 1);
    float *partials = (float *)ex->cuda->matmul_workspace;
    cudaStream_t stream = lg_cuda_stream(ex);
    unsigned threads = lg_cuda_run_threads(C / width, LG_CUDA_BIAS_THREADS);
    unsigned column_blocks = lg_cuda_blocks((size_t)(C / width), threads);
    LG_LAUNCH(lg_k_bias_grad_chunks, column_blocks * chunks, threads, 0, stream, partials, dout, N,
              C, rows, width);
    LG_LAUNCH(lg_k_bias_grad_add, lg_cuda_blocks((size_t)C, LG_CUDA_THREADS), LG_CUDA_THREADS, 0,
              stream, dbias, (const float *)partials, chunks, C, beta);
}

/* C (M, N) = beta C + op(A) op(B) (+ bias (N) on every row): cuBLASLt, or the reference kernel
   in the emulator and when the rank asks for it (tests). */
static void lg_cuda_matmul(const lg_exec *ex, int trans_a, int trans_b, int M, int N, int K,
                           lg_buf A, int lda, lg_buf B, int ldb, float beta, lg_buf C, int ldc,
                           lg_buf bias) {
    if (M <= 0 || N <= 0 || ex->cuda->stopped[0]) return; /* (a stopped rank's results are
                                                               discarded) */
#ifndef LG_CUDA_EMULATE
    if (!ex->cuda->reference_matmul &&
        lg_cuda_matmul_lt(ex, trans_a, trans_b, M, N, K, A, lda, B, ldb, beta, C, ldc, bias) == 0)
        return;
#endif
    lg_cuda_matmul_reference(ex, trans_a, trans_b, M, N, K, A, lda, B, ldb, beta, C, ldc);
    if (bias.data)
        LG_LAUNCH(lg_k_add_bias, lg_cuda_blocks((size_t)M * N, LG_CUDA_THREADS), LG_CUDA_THREADS,
                  0, lg_cuda_stream(ex), C, bias, M, N, ldc);
}

/* out (N, OC), rows ldo apart (a column range of a wider output when ldo > OC) = inp (N, IC)
   weight (OC, IC)^T + bias (OC) */
static void lg_cuda_linear_forward_into(const lg_exec *ex, lg_buf out, int ldo, lg_buf inp,
                                        lg_buf weight, lg_buf bias, int N, int IC, int OC) {
    lg_cuda_matmul(ex, 0, 1, N, OC, IC, inp, IC, weight, IC, 0.0f, out, ldo, bias);
}

/* dinp (N, IC) = inp_beta dinp + dout (N, OC) weight; dweight (OC, IC) = grad_beta dweight +
   dout^T inp; dbias (OC) = grad_beta dbias + column sums of dout (a beta of 0 writes, 1
   adds). */
static void lg_cuda_linear_backward(const lg_exec *ex, lg_buf dinp, lg_buf dweight, lg_buf dbias,
                                    lg_buf dout, lg_buf inp, lg_buf weight, int N, int IC,
                                    int OC, float inp_beta, float grad_beta) {
    lg_buf none = {NULL, LG_DTYPE_F32};
    lg_cuda_matmul(ex, 0, 0, N, IC, OC, dout, OC, weight, IC, inp_beta, dinp, IC, none);
    if (dweight.data) /* frozen (LoRA): no weight gradient */
        lg_cuda_matmul(ex, 1, 0, OC, IC, N, dout, OC, inp, IC, grad_beta, dweight, IC, none);
    if (dbias.data) lg_cuda_bias_grad(ex, dbias, dout, N, OC, grad_beta);
}

/* LoRA: the adapters' input, scaled and dropped out (lg_lora_input) ------------------------------ */

/* Elementwise (lg_k_map_strided: first + the element's index draws its mask bit). */
__global__ void lg_k_lora_input(lg_buf out, lg_buf in, size_t n, size_t first, float scale,
                                float p, uint64_t key, int accumulate) {
    const lg_buf plain[1] = {in}, summed[2] = {in, out}, to[1] = {out};
    auto keep = [=](size_t i, const float *x, float *y) { /* x[1]: out, when accumulating */
        float v = x[0] * lg_lora_keep(key, first + i, p, scale);
        y[0] = accumulate ? x[1] + v : v;
    };
    if (accumulate) lg_k_map_strided(summed, to, n, lg_k_first(), lg_k_stride(), keep);
    else lg_k_map_strided(plain, to, n, lg_k_first(), lg_k_stride(), keep);
}

static void lg_cuda_lora_input(const lg_exec *ex, lg_buf out, lg_buf in, size_t n, size_t first,
                               float scale, float p, uint64_t key, int accumulate) {
    if (n == 0) return;
    LG_LAUNCH(lg_k_lora_input, lg_cuda_map_grid(n), LG_CUDA_ELEMENT_THREADS, 0,
              lg_cuda_stream(ex), out, in, n, first, scale, p, key, accumulate);
}

/* i. ranks: memory, overheads, topology -------------------------------------------------------- */

static int lg_cuda_device_count_impl(void) {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

static int lg_cuda_device_accessible(const void *p) {
    cudaPointerAttributes attributes;
    if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
        cudaGetLastError(); /* clear it: pageable memory is not an error */
        return 0;
    }
    return attributes.type != cudaMemoryTypeUnregistered;
}

/* A failed allocation: what was asked, what the GPU has, and the plan. */
static int lg_cuda_alloc_failure(const lg_rank *rank, const char *what, size_t bytes,
                                 cudaError_t status, lg_error *err) {
    size_t free_bytes = 0, total_bytes = 0;
    char asked[32], free_text[32], total_text[32];
    cudaGetLastError();
    cudaMemGetInfo(&free_bytes, &total_bytes);
    fprintf(stderr, "the plan of this run:\n");
    lg_plan_print(rank->plan, stderr);
    return lg_fail(err, "GPU %d: %s of %s failed (%s): %s free of %s (the plan is above; see "
                   "`plan_only` and the remedies it lists)", rank->cuda->device, what,
                   lg_format_bytes(bytes, asked, sizeof asked), cudaGetErrorString(status),
                   lg_format_bytes(free_bytes, free_text, sizeof free_text),
                   lg_format_bytes(total_bytes, total_text, sizeof total_text));
}

/* A rank's device arena: its device pool up to the runtime's region (the last one), which the
   CUDA context, cuBLASLt and NCCL hold themselves. */
static size_t lg_cuda_arena_bytes(const lg_rank_plan *r) {
    const lg_region *runtime = lg_plan_find(r, LG_CUDA_RUNTIME_REGION);
    return r->pool_bytes[LG_POOL_DEVICE] - (runtime ? runtime->bytes : 0);
}

/* The arenas, exactly the plan: the device pool up to the runtime's region (which the CUDA
   context, cuBLASLt and NCCL hold themselves) in one cudaMalloc, and the host pool in pinned
   memory, so offload's and the staging region's copies run at full speed, asynchronously.
   Plain device memory, not managed: the host reaches it only through copies (lg_cuda_download,
   lg_cuda_upload). Both start on 256-byte boundaries, as the plan's regions do. */
static int lg_cuda_alloc_arenas(lg_rank *rank, lg_error *err) {
    const lg_rank_plan *r = &rank->plan->ranks[rank->index];
    size_t device_bytes = lg_cuda_arena_bytes(r), host_bytes = r->pool_bytes[LG_POOL_HOST];
    cudaError_t status;
    size_t free_bytes = 0, total_bytes = 0;
    LG_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes), err);
    if (device_bytes > free_bytes) /* refused before asking, as on the CPU */
        return lg_cuda_alloc_failure(rank, "the device arena (refused before asking)",
                                     device_bytes, cudaErrorMemoryAllocation, err);
    if (device_bytes) {
        status = cudaMalloc((void **)&rank->arena[LG_POOL_DEVICE], device_bytes);
        if (status != cudaSuccess)
            return lg_cuda_alloc_failure(rank, "the device arena", device_bytes, status, err);
        LG_CUDA_CHECK(cudaMemsetAsync(rank->arena[LG_POOL_DEVICE], 0, device_bytes,
                                      rank->cuda->stream), err);
    }
    if (host_bytes) {
        status = cudaMallocHost((void **)&rank->arena[LG_POOL_HOST], host_bytes);
        if (status != cudaSuccess)
            return lg_cuda_alloc_failure(rank, "the pinned host arena", host_bytes, status, err);
        memset(rank->arena[LG_POOL_HOST], 0, host_bytes);
    }
    return 0;
}

/* Points the rank's scratch at its cuda.* regions. */
static void lg_cuda_bind_regions(lg_rank *rank) {
    lg_cuda_rank *g = rank->cuda;
    const lg_plan_spec *s = &rank->plan->spec;
    g->matmul_workspace = lg_rank_region(rank, LG_REGION_CUDA_MATMUL_WORKSPACE);
    g->matmul_workspace_bytes =
        lg_plan_find(&rank->plan->ranks[rank->index], LG_REGION_CUDA_MATMUL_WORKSPACE)->bytes;
    g->row_sums = (float *)lg_rank_region(rank, LG_REGION_CUDA_ROW_SUMS);
    g->C = rank->plan->cfg.n_embd;
    g->totals = (double *)lg_rank_region(rank, LG_REGION_CUDA_TOTALS);
    g->token_capacity = (size_t)s->B * s->T;
    g->tokens = (int *)lg_rank_region(rank, LG_REGION_CUDA_IDS);
    g->targets = g->tokens + g->token_capacity;
    g->tf32 = s->tf32;
    g->staging = (unsigned char *)lg_rank_region(rank, LG_REGION_CUDA_STAGING);
    g->staging_bytes = lg_plan_find(&rank->plan->ranks[rank->index], LG_REGION_CUDA_STAGING)->bytes;
}

/* A GPU's streams, events and cuBLASLt handle (device already current). */
static int lg_cuda_rank_handles(lg_cuda_rank *g, lg_error *err) {
    LG_CUDA_CHECK(cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking), err);
    LG_CUDA_CHECK(cudaStreamCreateWithFlags(&g->comm, cudaStreamNonBlocking), err);
    LG_CUDA_CHECK(cudaEventCreateWithFlags(&g->compute_done, cudaEventDisableTiming), err);
    LG_CUDA_CHECK(cudaEventCreateWithFlags(&g->comm_done, cudaEventDisableTiming), err);
    for (int k = 0; k < LG_COMM_SIGNALS; k++)
        LG_CUDA_CHECK(cudaEventCreateWithFlags(&g->signals[k], cudaEventDisableTiming), err);
    for (int k = 0; k < LG_BESIDE_MARKS; k++)
        LG_CUDA_CHECK(cudaEventCreateWithFlags(&g->beside_done[k], cudaEventDisableTiming), err);
#ifndef LG_CUDA_EMULATE
    cublasStatus_t status = cublasLtCreate(&g->lt);
    if (status != CUBLAS_STATUS_SUCCESS)
        return lg_fail(err, "cublasLtCreate failed: %s", cublasLtGetStatusString(status));
#endif
    return 0;
}

static void lg_cuda_rank_handles_free(lg_cuda_rank *g) {
#ifndef LG_CUDA_EMULATE
    int plans = g->lt_plan_count < LG_LT_CACHE ? g->lt_plan_count : LG_LT_CACHE;
    for (int i = 0; i < plans; i++) lg_lt_plan_free(&g->lt_plans[i]);
    g->lt_plan_count = 0;
    if (g->lt) cublasLtDestroy(g->lt);
#endif
    if (g->compute_done) cudaEventDestroy(g->compute_done);
    if (g->comm_done) cudaEventDestroy(g->comm_done);
    for (int k = 0; k < LG_COMM_SIGNALS; k++)
        if (g->signals[k]) cudaEventDestroy(g->signals[k]);
    for (int k = 0; k < LG_BESIDE_MARKS; k++)
        if (g->beside_done[k]) cudaEventDestroy(g->beside_done[k]);
    if (g->stream) cudaStreamDestroy(g->stream);
    if (g->comm) cudaStreamDestroy(g->comm);
}

/* The kernels need compute capability 8.0 or newer (bf16 mma.sync, cp.async) and the shared
   memory a block their tiles take (LG_CUDA_SHARED_OPTIN_MIN): an older GPU is refused by name
   before anything is allocated on it. */
static int lg_cuda_check_arch(int device, lg_error *err) {
    cudaDeviceProp prop;
    LG_CUDA_CHECK(cudaGetDeviceProperties(&prop, device), err);
    if (prop.major < 8)
        return lg_fail(err, "GPU %d (%s) has compute capability %d.%d: the CUDA kernels need 8.0 "
                       "or newer (bf16 tensor cores: A100, RTX 30xx and later); `backend cpu` runs "
                       "on the processor", device, prop.name, prop.major, prop.minor);
    if (prop.sharedMemPerBlockOptin < LG_CUDA_SHARED_OPTIN_MIN)
        return lg_fail(err, "GPU %d (%s) lets a block have %zu bytes of shared memory: the "
                       "attention kernels take up to %d", device, prop.name,
                       (size_t)prop.sharedMemPerBlockOptin, LG_CUDA_SHARED_OPTIN_MIN);
    return 0;
}

/* Rank i runs on GPU i: its handles, then arenas of exactly its plan. */
static int lg_cuda_rank_create(lg_rank *rank, lg_error *err) {
    int count = lg_cuda_device_count_impl();
    if (rank->device >= count)
        return lg_fail(err, "rank %d needs GPU %d, but %d GPU%s visible: `devices` x `nodes` ranks run "
                       "one a GPU", rank->index, rank->device, count, count == 1 ? " is" : "s are");
    if (lg_cuda_check_arch(rank->device, err) != 0) return -1;
    lg_cuda_rank *g = (lg_cuda_rank *)lg_alloc_zeroed(sizeof(lg_cuda_rank));
    if (!g) return lg_fail(err, "out of host memory");
    rank->cuda = g;
    g->device = rank->device;
    LG_CUDA_CHECK(cudaSetDevice(g->device), err);
    if (lg_cuda_rank_handles(g, err) != 0 || lg_cuda_alloc_arenas(rank, err) != 0) return -1;
    lg_cuda_bind_regions(rank);
    LG_CUDA_CHECK(cudaStreamSynchronize(g->stream), err); /* the arena is zero from here */
    return 0;
}

/* lg_rank_failure on a GPU: the line of the failure that stopped the rank, or NULL. */
static const char *lg_cuda_rank_failure(const lg_rank *rank) {
    return rank->cuda->stopped[0] ? rank->cuda->stopped : NULL;
}

static void lg_cuda_rank_sync(const lg_rank *rank) {
    LG_CUDA_TRY(cudaSetDevice(rank->cuda->device));
    LG_CUDA_TRY(cudaStreamSynchronize(rank->cuda->comm));
    LG_CUDA_TRY(cudaStreamSynchronize(rank->cuda->stream));
}

static void lg_cuda_rank_free(lg_rank *rank) {
    lg_cuda_rank *g = rank->cuda;
    if (!g) return;
    cudaSetDevice(g->device);
    cudaDeviceSynchronize();
    if (rank->arena[LG_POOL_DEVICE]) cudaFree(rank->arena[LG_POOL_DEVICE]);
    if (rank->arena[LG_POOL_HOST]) cudaFreeHost(rank->arena[LG_POOL_HOST]);
    lg_cuda_rank_handles_free(g);
    LG_FREE(g);
    rank->cuda = NULL;
}

/* Free and total memory of a GPU. */
int lg_cuda_memory(int device, size_t *free_bytes, size_t *total_bytes, lg_error *err) {
    LG_CUDA_CHECK(cudaSetDevice(device), err);
    LG_CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes), err);
    return 0;
}

/* Memory in use on a GPU now (everything: this process's and others'), and its total. */
static int lg_cuda_used_bytes(int device, size_t *used, size_t *total, lg_error *err) {
    size_t free_bytes = 0;
    if (lg_cuda_memory(device, &free_bytes, total, err) != 0) return -1;
    *used = *total - free_bytes;
    return 0;
}

#ifndef LG_CUDA_EMULATE
/* One small bf16 product through lt (64 x 64 x 64, zeros), so that what cuBLASLt sets up at its
   first matmul is in the measure below; on any failure nothing more (the measure is then the
   handle's alone, as before). */
static void lg_cuda_lt_first_matmul(cublasLtHandle_t lt) {
    const int n = 64;
    const size_t bytes = (size_t)n * n * 2; /* one bf16 matrix */
    char *buf = NULL;
    if (cudaMalloc((void **)&buf, 3 * bytes) != cudaSuccess) {
        cudaGetLastError();
        return;
    }
    cudaMemset(buf, 0, 3 * bytes);
    cublasLtMatmulDesc_t desc = NULL;
    cublasLtMatrixLayout_t layout = NULL;
    if (cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
        cublasLtMatrixLayoutCreate(&layout, CUDA_R_16BF, n, n, n) == CUBLAS_STATUS_SUCCESS) {
        const float one = 1.0f, zero = 0.0f; /* (algo NULL: cuBLASLt's own heuristic) */
        cublasLtMatmul(lt, desc, &one, buf, layout, buf + bytes, layout, &zero, buf + 2 * bytes,
                       layout, buf + 2 * bytes, layout, NULL, NULL, 0, 0);
        cudaDeviceSynchronize();
    }
    if (layout) cublasLtMatrixLayoutDestroy(layout);
    if (desc) cublasLtMatmulDescDestroy(desc);
    cudaFree(buf);
    cudaGetLastError();
}
#endif

/* Local memory for our largest stack frame, reserved now (before the runtime is measured and
   the arenas taken) rather than grown by the driver at the first launch that needs it: the
   stack limit a thread is raised to LG_CUDA_STACK_FRAME_MAX when below (it takes effect at
   once; CUDA's default, 1 KiB, already holds it). */
static int lg_cuda_reserve_local(lg_error *err) {
    size_t stack = 0;
    LG_CUDA_CHECK(cudaDeviceGetLimit(&stack, cudaLimitStackSize), err);
    if (stack < LG_CUDA_STACK_FRAME_MAX)
        LG_CUDA_CHECK(cudaDeviceSetLimit(cudaLimitStackSize, LG_CUDA_STACK_FRAME_MAX), err);
    return 0;
}

/* The code device d loads after the measure (lazy loading, lg_cuda_lazy_code_bytes for its
   compute capability); 0 where CUDA_MODULE_LOADING=EAGER (all of it came with the context, in
   the measure) and on the emulator, which loads no modules. */
static int lg_cuda_lazy_code(int d, size_t *bytes, lg_error *err) {
    const char *loading = getenv("CUDA_MODULE_LOADING");
    *bytes = 0;
    if (loading && strcmp(loading, "EAGER") == 0) return 0;
#ifndef LG_CUDA_EMULATE
    int major = 0, minor = 0;
    LG_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d), err);
    LG_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, d), err);
    *bytes = lg_cuda_lazy_code_bytes(major, minor);
#else
    (void)d;
    (void)err;
#endif
    return 0;
}

/* Measures, on GPU 0..devices-1, what the runtime takes before the plan's arenas: the CUDA
   context (with anything other processes hold) and local memory for our stack frames
   (lg_cuda_reserve_local), a cuBLASLt handle after its first matmul, and one NCCL
   communicator after its first collective (times the communicators a rank joins,
   `communicators`); plus the code loaded lazily later (lg_cuda_lazy_code), which no measure at
   start holds. The most of any GPU goes to *runtime_bytes; *total_bytes gets the smallest
   GPU's memory. */
int lg_cuda_measure_runtime(int devices, int communicators, size_t *runtime_bytes,
                            size_t *total_bytes, lg_error *err) {
    size_t context[LG_MAX_RANKS], cublas[LG_MAX_RANKS], nccl[LG_MAX_RANKS], lazy[LG_MAX_RANKS];
    size_t total, used;
    int device_ids[LG_MAX_RANKS];
    *runtime_bytes = 0;
    *total_bytes = (size_t)-1;
    for (int d = 0; d < devices; d++) {
        device_ids[d] = d;
        LG_CUDA_CHECK(cudaSetDevice(d), err);
        LG_CUDA_CHECK(cudaFree(0), err); /* creates the context */
        if (lg_cuda_reserve_local(err) != 0 || lg_cuda_lazy_code(d, &lazy[d], err) != 0) return -1;
        if (lg_cuda_used_bytes(d, &context[d], &total, err) != 0) return -1;
        if (total < *total_bytes) *total_bytes = total;
        nccl[d] = 0;
#ifndef LG_CUDA_EMULATE
        cublasLtHandle_t lt;
        if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) return lg_fail(err, "cublasLtCreate failed");
        lg_cuda_lt_first_matmul(lt);
        LG_CUDA_CHECK(cudaDeviceSynchronize(), err);
        if (lg_cuda_used_bytes(d, &used, &total, err) != 0) return -1;
        cublas[d] = used - context[d];
        cublasLtDestroy(lt);
#else
        cublas[d] = 0;
#endif
    }
    if (devices > 1 && communicators > 0) {
        /* NCCL connects its peers and sizes its buffers at the first collective: one all-reduce
           of a float a GPU, whose own allocation is counted before the communicators */
        ncclComm_t comms[LG_MAX_RANKS];
        float *probe[LG_MAX_RANKS];
        lg_nccl_api api;
        if (lg_nccl_load(&api, err) != 0) return -1;
        size_t before[LG_MAX_RANKS];
        for (int d = 0; d < devices; d++) {
            LG_CUDA_CHECK(cudaSetDevice(d), err);
            LG_CUDA_CHECK(cudaMalloc((void **)&probe[d], sizeof(float)), err);
            LG_CUDA_CHECK(cudaMemset(probe[d], 0, sizeof(float)), err);
            if (lg_cuda_used_bytes(d, &before[d], &total, err) != 0) return -1;
        }
        LG_NCCL_CHECK(api.CommInitAll(comms, devices, device_ids), err);
        LG_NCCL_CHECK(api.GroupStart(), err);
        for (int d = 0; d < devices; d++)
            LG_NCCL_CHECK(api.AllReduce(probe[d], probe[d], 1, ncclFloat32, ncclSum, comms[d], 0), err);
        LG_NCCL_CHECK(api.GroupEnd(), err);
        for (int d = 0; d < devices; d++) {
            LG_CUDA_CHECK(cudaSetDevice(d), err);
            LG_CUDA_CHECK(cudaDeviceSynchronize(), err);
            if (lg_cuda_used_bytes(d, &used, &total, err) != 0) return -1;
            nccl[d] = (used > before[d] ? used - before[d] : 0) * (size_t)communicators;
        }
        for (int d = 0; d < devices; d++) {
            api.CommDestroy(comms[d]);
            cudaSetDevice(d);
            cudaFree(probe[d]);
        }
    }
    for (int d = 0; d < devices; d++) {
        size_t bytes = context[d] + cublas[d] + nccl[d] + lazy[d];
        if (bytes > *runtime_bytes) *runtime_bytes = bytes;
    }
    return 0;
}

/* How the GPUs reach each other: a table of peer access and its performance rank (lower is
   faster; the runtime's ranking) for every ordered pair. Returns 1 when every pair has direct
   peer access. */
int lg_cuda_report_topology(int devices, FILE *out) {
    int all_direct = 1;
    fprintf(out, "GPU peer access (rank: the runtime's performance rank, lower is faster):\n     ");
    for (int j = 0; j < devices; j++) fprintf(out, "  GPU%-3d", j);
    fprintf(out, "\n");
    for (int i = 0; i < devices; i++) {
        fprintf(out, "GPU%-2d", i);
        for (int j = 0; j < devices; j++) {
            int access = 0, performance = 0;
            if (i == j) { fprintf(out, "  %-6s", "-"); continue; }
            if (cudaDeviceCanAccessPeer(&access, i, j) != cudaSuccess) access = 0;
            if (access && cudaDeviceGetP2PAttribute(&performance, cudaDevP2PAttrPerformanceRank,
                                                    i, j) != cudaSuccess)
                performance = -1;
            if (access) fprintf(out, "  rank %-1d", performance);
            else fprintf(out, "  %-6s", "none");
            all_direct &= access != 0;
        }
        fprintf(out, "\n");
    }
    cudaGetLastError();
    return all_direct;
}

/* j. collectives over NCCL -------------------------------------------------------------------- */

/* A group of ranks that run collectives together: one NCCL communicator a member, from
   ncclCommInitAll over their GPUs, and the members' ranks (for their streams). */
struct lg_comm {
    int n;                          /* members (in several processes: this process's) */
    ncclComm_t comm[LG_MAX_RANKS];  /* (n) */
    lg_cuda_rank *member[LG_MAX_RANKS]; /* (n) */
    double *numbers[LG_MAX_RANKS];  /* (n): each member's (2 LG_MAX_RANKS) on its GPU for host
                                       numbers (lg_comm_sum_doubles), made on first use */
    /* the deadline (lg_comm_watch): no host wait on the group lasts longer than timeout_s */
    char name[48];                  /* "shard group 0", ...: what its errors name */
    double timeout_s;
    const lg_launch *launch;        /* the speller of the time-out's line (NULL: none) */
    int rank_of[LG_MAX_RANKS];      /* (n): each member's global rank */
    lg_nccl_api nccl;               /* the NCCL functions (lg_nccl_load) */
};

/* No collective has a deadline in NCCL (reference/DISTRIBUTED.md): the host polls. Across
   processes the communicators are non-blocking (config.blocking = 0), so that enqueueing
   never blocks either; every host wait below polls ncclCommGetAsyncError and the members'
   events until done, an NCCL error, or the deadline. Then the group's communicators are
   aborted (ncclCommAbort stops their kernels) and the process ends with a line naming its
   rank and the collective: a rank that hangs or died prints nothing, the ranks that waited
   for it each print the line (NCCL does not say which rank did not arrive). */
static void lg_nccl_give_up(lg_comm *c, const char *what, ncclResult_t status) {
    if (status == ncclSuccess || status == ncclInProgress)
        lg_print_settings(stderr, c->launch, "rank %d: the %s of %s did not complete within "
                          "`dist_timeout` %g s: a rank of the group did not arrive (hung or "
                          "stopped; it is one that does not print this line); aborting the "
                          "communicators\n", c->rank_of[0], what, c->name, c->timeout_s);
    else
        fprintf(stderr, "rank %d: the %s of %s failed in NCCL: %s (NCCL_DEBUG=WARN says more); "
                        "aborting the communicators\n", c->rank_of[0], what, c->name,
                lg_nccl_result_text(status));
    fflush(stderr);
    for (int i = 0; i < c->n; i++) {
        if (c->comm[i]) c->nccl.CommAbort(c->comm[i]);
        c->comm[i] = NULL;
    }
    lg_launch_abort(1);
}

/* The first error of the members' communicators (ncclInProgress while one still enqueues). */
static ncclResult_t lg_nccl_state(const lg_comm *c) {
    ncclResult_t worst = ncclSuccess;
    for (int i = 0; i < c->n; i++) {
        ncclResult_t state = ncclSuccess;
        ncclResult_t asked = c->nccl.CommGetAsyncError(c->comm[i], &state);
        if (asked != ncclSuccess) state = asked;
        if (state != ncclSuccess && (worst == ncclSuccess || worst == ncclInProgress)) worst = state;
    }
    return worst;
}

/* Waits until the members' communicators have enqueued everything (non-blocking ones return
   ncclInProgress meanwhile) and, with `done`, until the members' communication streams reach
   this point; gives up at the deadline or on an NCCL error. */
static void lg_nccl_wait(lg_comm *c, const char *what, int done) {
    double deadline = lg_time_ms() + c->timeout_s * 1e3;
    for (int i = 0; done && i < c->n; i++) {
        LG_CUDA_TRY(cudaSetDevice(c->member[i]->device));
        LG_CUDA_TRY(cudaEventRecord(c->member[i]->comm_done, c->member[i]->comm));
    }
    for (long polls = 0;; polls++) {
        ncclResult_t state = lg_nccl_state(c);
        int finished = state == ncclSuccess;
        for (int i = 0; finished && done && i < c->n; i++) {
            LG_CUDA_TRY(cudaSetDevice(c->member[i]->device));
            cudaError_t q = cudaEventQuery(c->member[i]->comm_done);
            if (q != cudaSuccess && q != cudaErrorNotReady) LG_CUDA_TRY(q);
            finished = q == cudaSuccess;
        }
        if (finished) return;
        if (state != ncclSuccess && state != ncclInProgress) lg_nccl_give_up(c, what, state);
        if (lg_time_ms() > deadline) lg_nccl_give_up(c, what, state);
        if (polls > 100) poll(NULL, 0, 1); /* a long wait leaves the core to the others */
    }
}

static ncclDataType_t lg_nccl_type(lg_dtype dtype) {
    switch (dtype) {
    case LG_DTYPE_BF16: return ncclBfloat16;
    case LG_DTYPE_F16: return ncclFloat16;
    case LG_DTYPE_I32: return ncclInt32;
    case LG_DTYPE_U8: return ncclUint8;
    default: return ncclFloat32;
    }
}

lg_comm *lg_comm_create(int n, lg_rank *const *members, lg_error *err) {
    int devices[LG_MAX_RANKS];
    lg_comm *c = (lg_comm *)lg_alloc_zeroed(sizeof(lg_comm));
    if (!c) {
        lg_fail(err, "out of host memory");
        return NULL;
    }
    if (lg_nccl_load(&c->nccl, err) != 0) {
        LG_FREE(c);
        return NULL;
    }
    c->n = n;
    lg_comm_watch(c, "the ranks of this process", NULL);
    for (int i = 0; i < n; i++) {
        c->member[i] = members[i]->cuda;
        c->rank_of[i] = members[i]->index;
        devices[i] = members[i]->cuda->device;
    }
    ncclResult_t status = c->nccl.CommInitAll(c->comm, n, devices);
    if (status != ncclSuccess) {
        lg_fail(err, "ncclCommInitAll over %d GPUs failed: %s", n, lg_nccl_result_text(status));
        LG_FREE(c);
        return NULL;
    }
    return c;
}

void lg_comm_watch(lg_comm *c, const char *name, const lg_launch *launch) {
    if (!c) return;
    snprintf(c->name, sizeof c->name, "%s", name);
    c->timeout_s = launch && launch->dist_timeout > 0 ? launch->dist_timeout : LG_DIST_TIMEOUT;
    c->launch = launch;
}

void lg_comm_free(lg_comm *c) {
    if (!c) return;
    for (int i = 0; i < c->n; i++) {
        c->nccl.CommDestroy(c->comm[i]);
        if (c->numbers[i]) cudaFree(c->numbers[i]);
    }
    LG_FREE(c);
}

/* GPU ranks in several processes ---------------------------------------------------------------
   ncclCommInitRank with process 0's id, ncclCommSplit for the groups; host numbers (the
   step's loss, the squares of the gradient norm) over the communicator of all ranks. */

static_assert(NCCL_UNIQUE_ID_BYTES == LG_NCCL_ID_BYTES, "NCCL's unique id has another size");

int lg_nccl_unique_id(unsigned char *id, lg_error *err) {
    ncclUniqueId unique;
    lg_nccl_api nccl;
    if (lg_nccl_load(&nccl, err) != 0) return -1;
    LG_NCCL_CHECK(nccl.GetUniqueId(&unique), err);
    memcpy(id, unique.internal, LG_NCCL_ID_BYTES);
    return 0;
}

lg_comm *lg_comm_create_global(int world, int first_rank, int n, lg_rank *const *members,
                               const unsigned char *id, const lg_launch *launch, lg_error *err) {
    lg_comm *c = (lg_comm *)lg_alloc_zeroed(sizeof(lg_comm));
    ncclUniqueId unique;
    if (!c) {
        lg_fail(err, "out of host memory");
        return NULL;
    }
    if (lg_nccl_load(&c->nccl, err) != 0) {
        LG_FREE(c);
        return NULL;
    }
    memcpy(unique.internal, id, LG_NCCL_ID_BYTES);
    c->n = n;
    lg_comm_watch(c, "all ranks", launch);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0; /* enqueueing returns at once; lg_nccl_wait polls against the deadline */
    ncclResult_t status = c->nccl.GroupStart();
    for (int i = 0; i < n && (status == ncclSuccess || status == ncclInProgress); i++) {
        c->member[i] = members[i]->cuda;
        c->rank_of[i] = first_rank + i;
        LG_CUDA_TRY(cudaSetDevice(c->member[i]->device));
        status = c->nccl.CommInitRankConfig(&c->comm[i], world, unique, first_rank + i, &config);
    }
    ncclResult_t ended = c->nccl.GroupEnd();
    if (status == ncclSuccess || status == ncclInProgress) status = ended;
    if (status == ncclInProgress) lg_nccl_wait(c, "start (ncclCommInitRankConfig)", 0);
    else if (status != ncclSuccess) {
        lg_fail(err, "ncclCommInitRank of ranks %d..%d of %d failed: %s (NCCL_DEBUG=WARN says why; "
                     "NCCL_SOCKET_IFNAME picks the network)", first_rank, first_rank + n - 1, world,
                lg_nccl_result_text(status));
        LG_FREE(c);
        return NULL;
    }
    return c;
}

int lg_comm_split(lg_comm *parent, const int *color, const int *key, lg_comm **by_color,
                  lg_error *err) {
    ncclComm_t made[LG_MAX_RANKS];
    ncclResult_t status = parent->nccl.GroupStart();
    for (int i = 0; i < parent->n && status == ncclSuccess; i++) {
        LG_CUDA_TRY(cudaSetDevice(parent->member[i]->device));
        made[i] = NULL;
        ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
        config.blocking = 0; /* as the parent's (lg_comm_create_global) */
        status = parent->nccl.CommSplit(parent->comm[i], color[i] < 0 ? NCCL_SPLIT_NOCOLOR : color[i],
                                        key[i], &made[i], &config);
        if (status == ncclInProgress) status = ncclSuccess;
    }
    ncclResult_t ended = parent->nccl.GroupEnd();
    if (status == ncclSuccess && ended != ncclInProgress) status = ended;
    if (status != ncclSuccess)
        return lg_fail(err, "ncclCommSplit failed: %s", lg_nccl_result_text(status));
    lg_nccl_wait(parent, "split (ncclCommSplit)", 0); /* (the new ones: below, on first use) */
    for (int i = 0; i < parent->n; i++) { /* members in order: the group's in key order */
        if (color[i] < 0) continue;
        lg_comm **group = &by_color[color[i]];
        if (!*group && !(*group = (lg_comm *)lg_alloc_zeroed(sizeof(lg_comm))))
            return lg_fail(err, "out of host memory");
        lg_comm_watch(*group, "a group of ranks", parent->launch);
        (*group)->nccl = parent->nccl;
        (*group)->comm[(*group)->n] = made[i];
        (*group)->rank_of[(*group)->n] = parent->rank_of[i];
        (*group)->member[(*group)->n++] = parent->member[i];
    }
    return 0;
}

/* Each member's device buffer for host numbers. */
static double *lg_comm_numbers(lg_comm *c, int i) {
    if (!c->numbers[i]) {
        LG_CUDA_TRY(cudaSetDevice(c->member[i]->device));
        LG_CUDA_TRY(cudaMalloc((void **)&c->numbers[i], 2 * LG_MAX_RANKS * sizeof(double)));
    }
    return c->numbers[i];
}

/* The members' host numbers through their GPUs: in (count each: member i's at in + i
   in_stride) -> the collective -> out from member 0's buffer (out_count). The copies run on
   the members' communication streams, in order with the collective: a copy on the legacy
   stream would not be (the communication streams do not wait for it), and from pageable
   memory cudaMemcpy may return before its data has reached the GPU. */
static void lg_comm_host_numbers(lg_comm *c, const double *in, int in_stride, int count,
                                 double *out, int out_count, int gather) {
    for (int i = 0; i < c->n; i++) {
        double *numbers = lg_comm_numbers(c, i);
        LG_CUDA_TRY(cudaSetDevice(c->member[i]->device));
        LG_CUDA_TRY(cudaMemcpyAsync(numbers, in + (size_t)i * in_stride, sizeof(double) * (size_t)count,
                                    cudaMemcpyHostToDevice, c->member[i]->comm));
    }
    LG_NCCL_TRY(c->nccl.GroupStart());
    for (int i = 0; i < c->n; i++) {
        double *numbers = lg_comm_numbers(c, i);
        if (gather)
            LG_NCCL_TRY(c->nccl.AllGather(numbers, numbers + LG_MAX_RANKS, (size_t)count,
                                          ncclFloat64, c->comm[i], c->member[i]->comm));
        else
            LG_NCCL_TRY(c->nccl.AllReduce(numbers, numbers + LG_MAX_RANKS, (size_t)count,
                                          ncclFloat64, ncclSum, c->comm[i], c->member[i]->comm));
    }
    LG_NCCL_TRY(c->nccl.GroupEnd());
    lg_nccl_wait(c, gather ? "gather of host numbers" : "sum of host numbers", 1);
    LG_CUDA_TRY(cudaSetDevice(c->member[0]->device));
    LG_CUDA_TRY(cudaMemcpyAsync(out, lg_comm_numbers(c, 0) + LG_MAX_RANKS,
                                sizeof(double) * (size_t)out_count, cudaMemcpyDeviceToHost,
                                c->member[0]->comm));
    LG_CUDA_TRY(cudaStreamSynchronize(c->member[0]->comm));
}

/* Sums over processes: the process's first member brings the values, the others zeros. */
void lg_comm_sum_doubles(lg_comm *c, double *values, int count) {
    double in[LG_MAX_RANKS * LG_MAX_RANKS] = {0}; /* (n, count) */
    if (!c || count > LG_MAX_RANKS) return;
    memcpy(in, values, sizeof(double) * (size_t)count);
    lg_comm_host_numbers(c, in, count, count, values, count, 0);
}

/* values (processes, per_process): member i of this process brings its own value (the
   communicator's rank of it), the gather returns every rank's. */
void lg_comm_gather_doubles(lg_comm *c, double *values, int per_process) {
    double in[LG_MAX_RANKS];
    int world = 0, first = 0;
    if (!c || per_process != c->n) return;
    LG_NCCL_TRY(c->nccl.CommCount(c->comm[0], &world));
    LG_NCCL_TRY(c->nccl.CommUserRank(c->comm[0], &first));
    for (int i = 0; i < c->n; i++) in[i] = values[first + i];
    lg_comm_host_numbers(c, in, 1, 1, values, world, 1);
}

/* The collectives run on each member's communication stream. They start after the ops queued
   before them on the compute stream (lg_comm_begin), and the ops queued after them wait for
   them (lg_comm_end), except the _async ones, which the ops wait for only where the trainer
   says (lg_cuda_await): the next block's weights arrive, and the last block's gradients
   reduce, while a block computes. */
static void lg_comm_begin(lg_comm *c) {
    for (int i = 0; i < c->n; i++) {
        lg_cuda_rank *g = c->member[i];
        LG_CUDA_TRY(cudaSetDevice(g->device));
        LG_CUDA_TRY(cudaEventRecord(g->compute_done, g->stream));
        LG_CUDA_TRY(cudaStreamWaitEvent(g->comm, g->compute_done, 0));
    }
    LG_NCCL_TRY(c->nccl.GroupStart());
}

static void lg_comm_end(lg_comm *c) {
    LG_NCCL_TRY(c->nccl.GroupEnd());
    lg_nccl_wait(c, "collective (enqueueing)", 0);
    for (int i = 0; i < c->n; i++) {
        lg_cuda_rank *g = c->member[i];
        LG_CUDA_TRY(cudaSetDevice(g->device));
        LG_CUDA_TRY(cudaEventRecord(g->comm_done, g->comm));
        LG_CUDA_TRY(cudaStreamWaitEvent(g->stream, g->comm_done, 0));
    }
}

/* An _async collective's end: each member's signals[signal] marks it done; the compute goes on
   meanwhile and waits in lg_cuda_await. */
static void lg_comm_end_signal(lg_comm *c, int signal) {
    LG_NCCL_TRY(c->nccl.GroupEnd());
    lg_nccl_wait(c, "collective (enqueueing)", 0);
    for (int i = 0; i < c->n; i++) {
        LG_CUDA_TRY(cudaSetDevice(c->member[i]->device));
        LG_CUDA_TRY(cudaEventRecord(c->member[i]->signals[signal], c->member[i]->comm));
    }
}

static void lg_cuda_await(lg_cuda_rank *g, int signal) {
    LG_CUDA_TRY(cudaSetDevice(g->device));
    LG_CUDA_TRY(cudaStreamWaitEvent(g->stream, g->signals[signal], 0));
}

/* The reduce-scatter and all-gather calls of a group, on the members' communication streams. */
static void lg_nccl_reduce_scatter_calls(lg_comm *c, const lg_buf *whole, lg_buf *piece,
                                         size_t piece_count) {
    for (int i = 0; i < c->n; i++)
        LG_NCCL_TRY(c->nccl.ReduceScatter(whole[i].data, piece[i].data, piece_count,
                                          lg_nccl_type(piece[i].dtype), ncclSum, c->comm[i],
                                          c->member[i]->comm));
}

static void lg_nccl_all_gather_calls(lg_comm *c, const lg_buf *piece, lg_buf *whole,
                                     size_t piece_count) {
    for (int i = 0; i < c->n; i++) /* in place when piece[i] lies at i piece_count of whole[i] */
        LG_NCCL_TRY(c->nccl.AllGather(piece[i].data, whole[i].data, piece_count,
                                      lg_nccl_type(piece[i].dtype), c->comm[i], c->member[i]->comm));
}

static void lg_cuda_all_reduce_sum(lg_comm *c, lg_buf *bufs, size_t count) {
    lg_comm_begin(c);
    for (int i = 0; i < c->n; i++)
        LG_NCCL_TRY(c->nccl.AllReduce(bufs[i].data, bufs[i].data, count,
                                      lg_nccl_type(bufs[i].dtype), ncclSum, c->comm[i],
                                      c->member[i]->comm));
    lg_comm_end(c);
}

static void lg_cuda_reduce_scatter_sum(lg_comm *c, const lg_buf *whole, lg_buf *piece,
                                       size_t piece_count) {
    lg_comm_begin(c);
    lg_nccl_reduce_scatter_calls(c, whole, piece, piece_count);
    lg_comm_end(c);
}

static void lg_cuda_reduce_scatter_sum_async(lg_comm *c, const lg_buf *whole, lg_buf *piece,
                                             size_t piece_count, int signal) {
    lg_comm_begin(c);
    lg_nccl_reduce_scatter_calls(c, whole, piece, piece_count);
    lg_comm_end_signal(c, signal);
}

static void lg_cuda_all_gather(lg_comm *c, const lg_buf *piece, lg_buf *whole,
                               size_t piece_count) {
    lg_comm_begin(c);
    lg_nccl_all_gather_calls(c, piece, whole, piece_count);
    lg_comm_end(c);
}

static void lg_cuda_all_gather_async(lg_comm *c, const lg_buf *piece, lg_buf *whole,
                                     size_t piece_count, int signal) {
    lg_comm_begin(c);
    lg_nccl_all_gather_calls(c, piece, whole, piece_count);
    lg_comm_end_signal(c, signal);
}

static void lg_cuda_broadcast(lg_comm *c, int root, lg_buf *bufs, size_t count) {
    lg_comm_begin(c);
    for (int i = 0; i < c->n; i++)
        LG_NCCL_TRY(c->nccl.Broadcast(bufs[i].data, bufs[i].data, count,
                                      lg_nccl_type(bufs[i].dtype), root, c->comm[i],
                                      c->member[i]->comm));
    lg_comm_end(c);
}

#endif /* LITGPT_CUDA_CUH */
