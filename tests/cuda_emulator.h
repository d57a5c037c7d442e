/* tests/cuda_emulator.h — runs litgpt_cuda.cuh's kernels on the CPU, for `make test`.

   TEST TOOLING, not part of the library. A C++17 translation unit compiled with g++ or clang++
   and -DLG_CUDA_EMULATE includes this header first, then litgpt.h (which includes
   litgpt_cuda.cuh without <cuda_runtime.h>, <nccl.h> or <cublasLt.h>). The header supplies, as
   plain host C++:

   1. the kernel language: __global__/__device__/__host__/__constant__ (nothing),
      __forceinline__ (inline), __shared__ (static: blocks run one at a time, so a function-static
      array is shared by exactly the threads of the running block), __align__(n),
      __launch_bounds__(...), LG_SHARED_DYNAMIC(type, name), dim3/uint3 and the vector types,
      threadIdx/blockIdx/blockDim/gridDim/warpSize, __syncthreads (and _count/_and/_or),
      __syncwarp, __shfl_sync/_up/_down/_xor, __ballot_sync/__any_sync/__all_sync, atomics,
      fast-math intrinsics, min/max, and LG_LAUNCH(kernel, grid, block, smem, stream, args...).
      (__restrict__ needs nothing: g++ and clang++ take it as a keyword.)
   2. a scheduler: blocks run one after another, blockIdx.x fastest; the threads of a block are
      cooperative fibers (their own stacks, made once and reused), each running until it meets a
      barrier or returns. Between barriers the threads run in ascending thread order, or
      descending after lg_emu_set_order(1) or with LG_EMU_ORDER=reverse in the environment: a
      kernel missing a __syncthreads usually gives different results in the two orders. A
      barrier that can never complete (threads that returned, or wait at another barrier) aborts
      naming the kernel, its LG_LAUNCH site, the block and the barriers' lines.
   3. the CUDA runtime subset the backend calls, on host memory. Devices: LG_EMU_DEVICES (default
      1) or lg_emu_set_devices(n); memory per device: LG_EMU_MEMORY bytes (suffix K/M/G allowed,
      default 16G) or lg_emu_set_memory(bytes); cudaMemGetInfo's free is that minus the live
      cudaMalloc/cudaMallocManaged bytes of the device. Architecture: LG_EMU_ARCH (sm_75,
      sm_80, sm_86, sm_89, sm_90 or sm_120; default sm_90) sets the compute capability and the limits
      reported and enforced: a launch over its opt-in shared memory, or over 48 KiB without
      the kernel's cudaFuncSetAttribute on that device, is refused. With LG_EMU_DEFER_COPIES=1
      cudaMemcpyAsync on a stream between emulator memory waits, as deferred collectives do
      (section 4), until a synchronization, an event waited on or later work on its stream
      orders it; lg_emu_launches_beside_copies() counts kernels launched while one was
      pending. Otherwise launches are synchronous, so every
      stream, event and copy is complete when its call returns. cudaMalloc memory is closed to
      the host (its pages are protected) except while a kernel, copy, memset or collective runs:
      host code that reads or writes it directly aborts naming the allocation, as a GPU's own
      memory would not let it (LG_EMU_HOST_VISITS=report lists every such visit instead).
   4. the NCCL subset, in process: grouped calls queue one per rank; a collective runs once every
      rank of its communicator clique has issued it (the k-th call of each rank match), reading
      all inputs before writing any output (so in place works); bf16 and fp16 sums are taken in
      float and rounded once to nearest even. A collective some rank never calls stalls as on
      GPUs: cudaEventQuery of an event recorded after it on its stream says cudaErrorNotReady
      while it waits; ncclCommAbort drops it. Communicators report no asynchronous error
      (ncclCommGetAsyncError) and take a ncclConfig_t (non-blocking ones enqueue at once). With LG_EMU_DEFER_COLLECTIVES=1 a complete
      collective does not run at once but waits until the host synchronises its stream or the
      device, or a stream waits on an event recorded on its stream after it: the latest a GPU
      could run it. An op that reads a collective's output without such a wait then reads the
      old values.
   5. the WMMA subset of <mma.h> (nvcuda::wmma, 16-bit inputs, float accumulators) with
      __nv_bfloat16 and __half; every lane's fragment holds the whole tile (see section 9).
   6. inline PTX's stand-ins (section 10): mma.sync.aligned.m16n8k16 (bf16/fp16 inputs, f32
      accumulators) with the PTX ISA's documented fragment layouts, as a warp-collective
      rendezvous like a shuffle; ldmatrix.m8n8 (.x1/.x2/.x4, .trans) the same way; cp.async (4, 8 or 16 bytes, zero-filled past src-size) with
      commit_group and wait_group. A copy lands only when a wait_group of its thread completes
      its group, the latest the hardware could land it: a kernel that reads a tile before
      waiting for it reads the old bytes (0xff in fresh dynamic shared memory).

   All emulator state is one struct reached through a function-static pointer (lg_emu_state());
   it is not thread safe: one host thread drives every emulated device, as in the trainer.
   Fibers switch with a few lines of x86-64 assembly (swapcontext costs a system call per
   switch); other machines, or -DLG_EMU_UCONTEXT, use ucontext. AddressSanitizer is told about
   every stack switch. cuBLASLt is not emulated.

   Not caught: host code reading managed memory (the host may); static __shared__ arrays
   keep the previous block's values (dynamic shared memory is refilled with 0xff per block, new
   allocations too, up to 1 GiB each); races between warps that the two
   thread orders do not expose; a shuffle whose source lane is outside the mask or the block
   (it returns the caller's own value; CUDA leaves it undefined). */
#ifndef LG_CUDA_EMULATOR_H
#define LG_CUDA_EMULATOR_H

#ifndef LG_CUDA_EMULATE
#define LG_CUDA_EMULATE 1
#endif

#include <math.h>
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>
#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#if !defined(__x86_64__) && !defined(LG_EMU_UCONTEXT)
#define LG_EMU_UCONTEXT 1
#endif
#ifdef LG_EMU_UCONTEXT
#include <ucontext.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#define LG_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LG_EMU_ASAN 1
#endif
#endif
#ifdef LG_EMU_ASAN
#include <sanitizer/common_interface_defs.h>
#endif

/* `#pragma unroll` in kernels: clang knows it, g++ -Wall would warn (an error under -Werror). */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wunknown-pragmas"
#endif

#define CUDART_VERSION 13000 /* the toolkit the real build uses */
#define NCCL_VERSION_CODE 22809

#ifndef LG_EMU_STACK_BYTES
#define LG_EMU_STACK_BYTES (256 * 1024) /* each thread's stack; a guard page lies below */
#endif
#define LG_EMU_MAX_THREADS 1024 /* per block */
#define LG_EMU_MAX_DEVICES 64
#define LG_EMU_STATIC_SHARED 49152 /* dynamic shared memory a block may have without opting in */

/* The architecture the emulated devices stand for (LG_EMU_ARCH, default sm_90): the limits a
   real card of it puts on a launch, from NVIDIA's table per compute capability: the opt-in
   shared memory a block may have, the shared memory and threads of an SM. */
struct lg_emu_arch {
    const char *name;
    int major, minor;
    size_t shared_optin, shared_per_sm;
    int threads_per_sm;
};
static const lg_emu_arch lg_emu_archs[] = {
    {"sm_75", 7, 5, 65536, 65536, 1024},    /* T4, RTX 20xx: no bf16 tensor cores */
    {"sm_80", 8, 0, 166912, 167936, 2048},  /* A100, A30 */
    {"sm_86", 8, 6, 101376, 102400, 1536},  /* RTX 30xx, A10, A40, A6000 */
    {"sm_89", 8, 9, 101376, 102400, 1536},  /* RTX 40xx, L4, L40S */
    {"sm_90", 9, 0, 232448, 233472, 2048},  /* H100, H200 */
    {"sm_120", 12, 0, 101376, 102400, 1536} /* RTX 50xx */
};

/* ============================================================================================
   1. Kernel language keywords and built-in types
   ============================================================================================ */

#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
#define LG_SHARED_DYNAMIC(type, name) type *name = (type *)lg_emu_dynamic_shared()

struct uint3 {
    unsigned x, y, z;
};

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

struct __align__(8) float2 { float x, y; };
struct __align__(16) float4 { float x, y, z, w; };
struct __align__(8) int2 { int x, y; };
struct __align__(16) int4 { int x, y, z, w; };
struct __align__(8) uint2 { unsigned x, y; };
struct __align__(16) uint4 { unsigned x, y, z, w; };
struct __align__(16) double2 { double x, y; };
inline float2 make_float2(float x, float y) { return float2{x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline int2 make_int2(int x, int y) { return int2{x, y}; }
inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
inline uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return uint3{x, y, z}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
inline double2 make_double2(double x, double y) { return double2{x, y}; }

static constexpr int warpSize = 32;

/* ============================================================================================
   2. CUDA runtime and NCCL types (the values are the real headers')
   ============================================================================================ */

enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInvalidMemcpyDirection = 21,
    cudaErrorInvalidDeviceFunction = 98,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
    cudaErrorPeerAccessAlreadyEnabled = 704,
    cudaErrorPeerAccessNotEnabled = 705,
    cudaErrorLaunchFailure = 719,
    cudaErrorNotSupported = 801,
};
typedef enum cudaError cudaError_t;

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4,
};

enum cudaMemoryType {
    cudaMemoryTypeUnregistered = 0,
    cudaMemoryTypeHost = 1,
    cudaMemoryTypeDevice = 2,
    cudaMemoryTypeManaged = 3,
};
struct cudaPointerAttributes {
    enum cudaMemoryType type;
    int device;
    void *devicePointer;
    void *hostPointer;
};

enum cudaMemoryAdvise {
    cudaMemAdviseSetReadMostly = 1,
    cudaMemAdviseUnsetReadMostly = 2,
    cudaMemAdviseSetPreferredLocation = 3,
    cudaMemAdviseUnsetPreferredLocation = 4,
    cudaMemAdviseSetAccessedBy = 5,
    cudaMemAdviseUnsetAccessedBy = 6,
};

enum cudaMemLocationType {
    cudaMemLocationTypeInvalid = 0,
    cudaMemLocationTypeDevice = 1,
    cudaMemLocationTypeHost = 2,
    cudaMemLocationTypeHostNuma = 3,
};
struct cudaMemLocation {
    enum cudaMemLocationType type;
    int id;
};

enum cudaLimit {
    cudaLimitStackSize = 0x00, /* the stack a GPU thread has (the only limit emulated) */
};

enum cudaDeviceAttr {
    cudaDevAttrMaxThreadsPerBlock = 1,
    cudaDevAttrMaxSharedMemoryPerBlock = 8,
    cudaDevAttrWarpSize = 10,
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrMaxThreadsPerMultiProcessor = 39,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
    cudaDevAttrMaxSharedMemoryPerMultiprocessor = 81,
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};

enum cudaDeviceP2PAttr {
    cudaDevP2PAttrPerformanceRank = 1,
    cudaDevP2PAttrAccessSupported = 2,
    cudaDevP2PAttrNativeAtomicSupported = 3,
};

enum cudaFuncAttribute {
    cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
    cudaFuncAttributePreferredSharedMemoryCarveout = 9,
};

#define cudaHostAllocDefault 0x00
#define cudaHostAllocPortable 0x01
#define cudaHostAllocMapped 0x02
#define cudaHostAllocWriteCombined 0x04
#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaEventDefault 0x00
#define cudaEventBlockingSync 0x01
#define cudaEventDisableTiming 0x02
#define cudaMemAttachGlobal 0x01
#define cudaMemAttachHost 0x02

/* The fields of cudaDeviceProp the backend may read (a subset of the real struct). */
struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    size_t sharedMemPerBlock;
    size_t sharedMemPerBlockOptin;
    size_t sharedMemPerMultiprocessor;
    int warpSize;
    int maxThreadsPerBlock;
    int maxThreadsPerMultiProcessor;
    int major;
    int minor;
    int multiProcessorCount;
};

struct lg_emu_stream {
    int device;
    unsigned flags;
};
struct lg_emu_event {
    int device;
    unsigned flags;
    int recorded;
    lg_emu_stream *stream; /* where it was last recorded, and the deferred collectives issued */
    uint64_t mark;         /* by then: waiting on it runs those of that stream */
    int stalled;           /* recorded after a collective that waits for other ranks */
};
typedef lg_emu_stream *cudaStream_t;
typedef lg_emu_event *cudaEvent_t;

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
    ncclNumResults = 8
} ncclResult_t;

typedef enum {
    ncclInt8 = 0, ncclChar = 0,
    ncclUint8 = 1,
    ncclInt32 = 2, ncclInt = 2,
    ncclUint32 = 3,
    ncclInt64 = 4,
    ncclUint64 = 5,
    ncclFloat16 = 6, ncclHalf = 6,
    ncclFloat32 = 7, ncclFloat = 7,
    ncclFloat64 = 8, ncclDouble = 8,
    ncclBfloat16 = 9,
} ncclDataType_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4, ncclNumOps = 5 } ncclRedOp_t;

/* One collective call of one rank, waiting for the other ranks' calls. */
enum lg_emu_nccl_kind {
    LG_EMU_ALL_REDUCE,
    LG_EMU_REDUCE_SCATTER,
    LG_EMU_ALL_GATHER,
    LG_EMU_BROADCAST,
    LG_EMU_REDUCE
};
struct lg_emu_nccl_call {
    lg_emu_nccl_kind kind;
    const void *send;
    void *recv;
    size_t count; /* elements: the per-rank output of reduce-scatter, the input of all-gather */
    ncclDataType_t type;
    ncclRedOp_t op;
    int root;
    cudaStream_t stream; /* the stream it was issued on */
};

/* The communicators made together by one ncclCommInitAll. */
struct lg_emu_nccl_clique {
    int ranks;
    int live;                                         /* communicators not yet destroyed */
    std::vector<std::deque<lg_emu_nccl_call>> queued; /* (ranks) calls waiting, oldest first */
};

struct lg_emu_nccl_comm {
    lg_emu_nccl_clique *clique;
    int rank;
    int device;
};
typedef lg_emu_nccl_comm *ncclComm_t;

/* ============================================================================================
   3. The emulator's state
   ============================================================================================ */

/* A saved execution context: a stack pointer (x86-64) or a ucontext. */
struct lg_emu_context {
#ifdef LG_EMU_UCONTEXT
    ucontext_t uc;
#else
    void *sp;
#endif
};

enum lg_emu_thread_state {
    LG_EMU_RUNNABLE,
    LG_EMU_AT_BLOCK_BARRIER,
    LG_EMU_AT_WARP_BARRIER,
    LG_EMU_EXITED
};

/* What a thread waiting at a barrier exchanges with the others (exchange_source). */
enum { LG_EMU_EXCHANGE_NONE = -3, LG_EMU_EXCHANGE_BALLOT = -2, LG_EMU_EXCHANGE_COUNT = -1 };

/* One cp.async: bytes at dst, the first src_bytes of them from src, the rest zeros. */
struct lg_emu_async_copy {
    void *dst;
    const void *src;
    unsigned bytes, src_bytes;
};

/* One emulated GPU thread: a fiber with its own stack, reused by every block and launch. */
struct lg_emu_fiber {
    lg_emu_context context;
    unsigned char *stack; /* usable stack [stack, stack + stack_bytes) */
    size_t stack_bytes;
    void *asan_fake_stack;
    uint3 thread_idx;
    int linear; /* thread index within the block, x fastest */
    lg_emu_thread_state state;
    const char *wait_file; /* the barrier it waits at */
    int wait_line;
    unsigned warp_mask; /* of the warp barrier it waits at */
    int exchange_source; /* lane whose value a shuffle reads, or LG_EMU_EXCHANGE_* */
    uint64_t exchange_in, exchange_out;
    std::vector<struct lg_emu_async_copy> async_open;               /* cp.async not yet committed */
    std::deque<std::vector<struct lg_emu_async_copy>> async_groups; /* committed, oldest first */
};

struct lg_emu_launch_site {
    const char *kernel; /* as written in LG_LAUNCH */
    const void *address; /* the kernel function's (cudaFuncSetAttribute's key) */
    const char *file;
    int line;
};

struct lg_emu_scheduler {
    lg_emu_context host_context; /* where the launching host code waits */
    const void *host_stack_bottom;
    size_t host_stack_bytes;
    void *host_fake_stack;
    std::vector<lg_emu_fiber *> fibers; /* made as launches need them, up to 1024 */
    lg_emu_fiber *current;              /* the running thread, or null in host code */
    void (*kernel_body)(void *);        /* the running launch: calls the kernel with its args */
    void *kernel_args;
    lg_emu_launch_site site;
    dim3 grid_dim, block_dim;
    uint3 block_idx;
    int threads; /* per block */
    int exited, at_block_barrier, at_warp_barrier;
    int warp_waiting[LG_EMU_MAX_THREADS / 32];
    unsigned char *dynamic_shared;
    size_t dynamic_shared_capacity, dynamic_shared_bytes;
    int reverse_order;
    unsigned long long launches;
};

enum lg_emu_memory_kind { LG_EMU_DEVICE_MEMORY, LG_EMU_MANAGED_MEMORY, LG_EMU_HOST_MEMORY };
struct lg_emu_allocation {
    size_t bytes;
    int device;
    lg_emu_memory_kind kind;
    void *map;        /* device memory: its own pages (map_bytes), the last one a guard page */
    size_t map_bytes;
};

struct lg_emu_runtime {
    int device_count;
    int current_device;
    size_t memory_per_device;
    size_t used[LG_EMU_MAX_DEVICES]; /* live cudaMalloc + cudaMallocManaged bytes */
    size_t stack_limit[LG_EMU_MAX_DEVICES]; /* cudaLimitStackSize set (0: CUDA's default) */
    unsigned char peer_enabled[LG_EMU_MAX_DEVICES][LG_EMU_MAX_DEVICES];
    std::map<uintptr_t, lg_emu_allocation> allocations; /* by base address */
    std::set<const void *> streams, events;             /* live handles */
    cudaError_t last_error;
    int device_access;      /* > 0 while the emulated GPU works on device memory (section 3) */
    bool host_visits_allowed; /* LG_EMU_HOST_VISITS=allow: device memory stays open to the host */
    bool host_visits_reported; /* LG_EMU_HOST_VISITS=report: each visit is reported, not fatal */
    const lg_emu_arch *arch;   /* LG_EMU_ARCH: the limits of a launch */
    /* the dynamic shared memory each kernel (by address) was let have on each device */
    std::map<std::pair<int, const void *>, size_t> shared_allowed;
};

/* Work left for later (deferred modes): a complete collective (every rank's call) or an
   asynchronous copy on a stream (calls empty: bytes from src to dst), and its place in the
   order of issue. A copy reads src when it runs, as a GPU's copy engine would. */
struct lg_emu_deferred_work {
    std::vector<lg_emu_nccl_call> calls;
    uint64_t seq;
    void *dst;
    const void *src;
    size_t bytes;
    cudaStream_t stream;
};

struct lg_emu_nccl_state {
    int group_depth;
    std::set<ncclComm_t> comms;                /* live communicators */
    std::vector<lg_emu_nccl_clique *> touched; /* cliques that may have queued calls */
    /* deferred mode (LG_EMU_DEFER_COLLECTIVES=1): complete collectives wait here, oldest first,
       until something orders them before the host or another stream (see section 4) */
    int defer;
    int defer_copies;                          /* LG_EMU_DEFER_COPIES=1: cudaMemcpyAsync on a
                                                  stream waits here too */
    uint64_t issued;                           /* collectives and copies deferred so far */
    uint64_t launches_beside_copies;           /* kernels launched while a copy on another
                                                  stream was still deferred */
    std::deque<lg_emu_deferred_work> deferred;
};

struct lg_emu_state_t {
    lg_emu_scheduler sched;
    lg_emu_runtime rt;
    lg_emu_nccl_state nccl;
};

/* A collective issued on `stream` waits for other ranks' calls (section 8). */
inline bool lg_emu_nccl_stalled(const lg_emu_stream *stream);

[[noreturn]] inline void lg_emu_die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "lg_emu: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    fflush(stderr);
    abort();
}

/* "16G", "512M", "4096": bytes. */
inline size_t lg_emu_parse_bytes(const char *text, size_t fallback) {
    if (!text || !*text) return fallback;
    char *end = nullptr;
    unsigned long long value = strtoull(text, &end, 10);
    switch (*end) {
    case 'k': case 'K': value <<= 10; break;
    case 'm': case 'M': value <<= 20; break;
    case 'g': case 'G': value <<= 30; break;
    case 't': case 'T': value <<= 40; break;
    case '\0': break;
    default: lg_emu_die("LG_EMU_MEMORY=%s is not a byte count", text);
    }
    return (size_t)value;
}

/* LG_EMU_ARCH's entry (null or empty: sm_90); an unknown name ends the program. */
inline const lg_emu_arch *lg_emu_arch_named(const char *name) {
    if (!name || !*name) name = "sm_90";
    for (const lg_emu_arch &a : lg_emu_archs)
        if (strcmp(a.name, name) == 0) return &a;
    lg_emu_die("LG_EMU_ARCH=%s: use sm_75, sm_80, sm_86, sm_89, sm_90 or sm_120", name);
}

inline lg_emu_state_t *lg_emu_state_create(void) {
    /* never freed: host code may still call cudaFree from static destructors at exit */
    lg_emu_state_t *s = new lg_emu_state_t();
    const char *devices = getenv("LG_EMU_DEVICES");
    s->rt.device_count = devices && *devices ? atoi(devices) : 1;
    if (s->rt.device_count < 0 || s->rt.device_count > LG_EMU_MAX_DEVICES)
        lg_emu_die("LG_EMU_DEVICES=%s is outside 0..%d", devices, LG_EMU_MAX_DEVICES);
    s->rt.memory_per_device = lg_emu_parse_bytes(getenv("LG_EMU_MEMORY"), (size_t)16 << 30);
    const char *defer = getenv("LG_EMU_DEFER_COLLECTIVES");
    s->nccl.defer = defer && strcmp(defer, "1") == 0;
    const char *defer_copies = getenv("LG_EMU_DEFER_COPIES");
    s->nccl.defer_copies = defer_copies && strcmp(defer_copies, "1") == 0;
    const char *visits = getenv("LG_EMU_HOST_VISITS");
    s->rt.host_visits_allowed = visits && strcmp(visits, "allow") == 0;
    s->rt.host_visits_reported = visits && strcmp(visits, "report") == 0;
    if (visits && *visits && !s->rt.host_visits_allowed && !s->rt.host_visits_reported &&
        strcmp(visits, "fail") != 0)
        lg_emu_die("LG_EMU_HOST_VISITS=%s: use fail, report or allow", visits);
    s->rt.arch = lg_emu_arch_named(getenv("LG_EMU_ARCH"));
    const char *order = getenv("LG_EMU_ORDER");
    if (order && strcmp(order, "reverse") == 0) s->sched.reverse_order = 1;
    else if (order && *order && strcmp(order, "forward") != 0)
        lg_emu_die("LG_EMU_ORDER=%s: use forward or reverse", order);
    return s;
}

inline lg_emu_state_t &lg_emu_state(void) {
    static lg_emu_state_t *state = lg_emu_state_create();
    return *state;
}

inline void lg_emu_device_memory_open(bool open); /* section 3 */
/* While one lives the emulated GPU touches device memory (nested ones share the opening). */
struct lg_emu_gpu_work {
    lg_emu_gpu_work() {
        if (lg_emu_state().rt.device_access++ == 0) lg_emu_device_memory_open(true);
    }
    ~lg_emu_gpu_work() {
        if (--lg_emu_state().rt.device_access == 0) lg_emu_device_memory_open(false);
    }
    lg_emu_gpu_work(const lg_emu_gpu_work &) = delete;
    lg_emu_gpu_work &operator=(const lg_emu_gpu_work &) = delete;
};

/* Test controls. */
inline void lg_emu_set_order(int reverse) { lg_emu_state().sched.reverse_order = reverse != 0; }
/* The architecture the devices stand for from now on, as LG_EMU_ARCH names it (tests). */
inline void lg_emu_set_arch(const char *name) { lg_emu_state().rt.arch = lg_emu_arch_named(name); }
inline void lg_emu_set_devices(int n) {
    lg_emu_runtime &rt = lg_emu_state().rt;
    if (n < 0 || n > LG_EMU_MAX_DEVICES) lg_emu_die("lg_emu_set_devices(%d): 0..%d", n, LG_EMU_MAX_DEVICES);
    rt.device_count = n;
    if (rt.current_device >= n) rt.current_device = 0;
}
inline void lg_emu_set_memory(size_t bytes_per_device) { lg_emu_state().rt.memory_per_device = bytes_per_device; }
inline unsigned long long lg_emu_launch_count(void) { return lg_emu_state().sched.launches; }

/* ============================================================================================
   4. Fibers: stacks and switching
   ============================================================================================ */

inline void lg_emu_asan_start(void **fake_stack_save, const void *bottom, size_t bytes) {
#ifdef LG_EMU_ASAN
    __sanitizer_start_switch_fiber(fake_stack_save, bottom, bytes);
#else
    (void)fake_stack_save, (void)bottom, (void)bytes;
#endif
}

inline void lg_emu_asan_finish(void *fake_stack_save, const void **bottom_old, size_t *bytes_old) {
#ifdef LG_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake_stack_save, bottom_old, bytes_old);
#else
    (void)fake_stack_save, (void)bottom_old, (void)bytes_old;
#endif
}

#ifdef LG_EMU_UCONTEXT
inline void lg_emu_context_switch(lg_emu_context *save, lg_emu_context *load) {
    if (swapcontext(&save->uc, &load->uc) != 0) lg_emu_die("swapcontext failed");
}
#else
/* Saves the callee-saved registers and the SSE/x87 control words on the current stack, stores
   the stack pointer in *save_sp (rdi), then loads load_sp (rsi) and restores the same from it. */
__attribute__((naked, noinline)) static void lg_emu_switch_stack(void ** /* save_sp */,
                                                                 void * /* load_sp */) {
    __asm__ volatile("pushq %rbp\n\t"
                     "pushq %rbx\n\t"
                     "pushq %r12\n\t"
                     "pushq %r13\n\t"
                     "pushq %r14\n\t"
                     "pushq %r15\n\t"
                     "subq $8, %rsp\n\t"
                     "stmxcsr (%rsp)\n\t"
                     "fnstcw 4(%rsp)\n\t"
                     "movq %rsp, (%rdi)\n\t"
                     "movq %rsi, %rsp\n\t"
                     "ldmxcsr (%rsp)\n\t"
                     "fldcw 4(%rsp)\n\t"
                     "addq $8, %rsp\n\t"
                     "popq %r15\n\t"
                     "popq %r14\n\t"
                     "popq %r13\n\t"
                     "popq %r12\n\t"
                     "popq %rbx\n\t"
                     "popq %rbp\n\t"
                     "ret\n\t");
}
inline void lg_emu_context_switch(lg_emu_context *save, lg_emu_context *load) {
    lg_emu_switch_stack(&save->sp, load->sp);
}
#endif

inline void lg_emu_fiber_entry(void);

/* A new fiber's context starts lg_emu_fiber_entry on its stack. */
inline void lg_emu_context_init(lg_emu_context *c, unsigned char *stack, size_t bytes) {
#ifdef LG_EMU_UCONTEXT
    if (getcontext(&c->uc) != 0) lg_emu_die("getcontext failed");
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = bytes;
    c->uc.uc_link = nullptr;
    makecontext(&c->uc, lg_emu_fiber_entry, 0);
#else
    /* the frame lg_emu_switch_stack pops: control words, r15..r12, rbx, rbp, return address;
       above it a null return address for the entry, which never returns (rsp = 8 mod 16) */
    uintptr_t top = ((uintptr_t)stack + bytes) & ~(uintptr_t)15;
    void **sp = (void **)top;
    *--sp = nullptr;
    *--sp = (void *)&lg_emu_fiber_entry;
    for (int i = 0; i < 6; i++) *--sp = nullptr;
    uint32_t mxcsr;
    uint16_t x87_control;
    __asm__ volatile("stmxcsr %0" : "=m"(mxcsr));
    __asm__ volatile("fnstcw %0" : "=m"(x87_control));
    --sp;
    memcpy((unsigned char *)sp, &mxcsr, 4);
    memcpy((unsigned char *)sp + 4, &x87_control, 2);
    c->sp = sp;
#endif
}

inline lg_emu_fiber *lg_emu_fiber_create(void) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t bytes = ((size_t)LG_EMU_STACK_BYTES + page - 1) / page * page;
    void *map = mmap(nullptr, bytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (map == MAP_FAILED) lg_emu_die("cannot map a %zu-byte fiber stack", bytes);
    if (mprotect(map, page, PROT_NONE) != 0) lg_emu_die("cannot protect a fiber stack's guard page");
    lg_emu_fiber *f = new lg_emu_fiber();
    f->stack = (unsigned char *)map + page;
    f->stack_bytes = bytes;
    lg_emu_context_init(&f->context, f->stack, f->stack_bytes);
    return f;
}

/* From host code: run fiber f until it waits at a barrier or returns. */
inline void lg_emu_resume(lg_emu_scheduler &s, lg_emu_fiber *f) {
    s.current = f;
    lg_emu_asan_start(&s.host_fake_stack, f->stack, f->stack_bytes);
    lg_emu_context_switch(&s.host_context, &f->context);
    lg_emu_asan_finish(s.host_fake_stack, nullptr, nullptr);
    s.current = nullptr;
}

/* From fiber f: hand control back to the scheduler; returns when it resumes f. */
inline void lg_emu_suspend(lg_emu_scheduler &s, lg_emu_fiber *f) {
    lg_emu_asan_start(&f->asan_fake_stack, s.host_stack_bottom, s.host_stack_bytes);
    lg_emu_context_switch(&f->context, &s.host_context);
    lg_emu_asan_finish(f->asan_fake_stack, &s.host_stack_bottom, &s.host_stack_bytes);
}

/* Every fiber runs this forever: one kernel thread per resume after it has exited. */
inline void lg_emu_fiber_entry(void) {
    lg_emu_scheduler &s = lg_emu_state().sched;
    lg_emu_asan_finish(nullptr, &s.host_stack_bottom, &s.host_stack_bytes);
    for (;;) {
        s.kernel_body(s.kernel_args);
        lg_emu_fiber *self = s.current;
        self->state = LG_EMU_EXITED;
        s.exited++;
        lg_emu_suspend(s, self);
    }
}

/* ============================================================================================
   5. The scheduler: a launch runs its blocks one at a time, each block's threads as fibers
   ============================================================================================ */

inline lg_emu_fiber *lg_emu_current_thread(const char *what) {
    lg_emu_fiber *f = lg_emu_state().sched.current;
    if (!f) lg_emu_die("%s used outside a kernel", what);
    return f;
}

inline const uint3 &lg_emu_thread_idx(void) { return lg_emu_current_thread("threadIdx")->thread_idx; }
inline const uint3 &lg_emu_block_idx(void) {
    lg_emu_current_thread("blockIdx");
    return lg_emu_state().sched.block_idx;
}
inline const dim3 &lg_emu_block_dim(void) {
    lg_emu_current_thread("blockDim");
    return lg_emu_state().sched.block_dim;
}
inline const dim3 &lg_emu_grid_dim(void) {
    lg_emu_current_thread("gridDim");
    return lg_emu_state().sched.grid_dim;
}
#define threadIdx (lg_emu_thread_idx())
#define blockIdx (lg_emu_block_idx())
#define blockDim (lg_emu_block_dim())
#define gridDim (lg_emu_grid_dim())

/* The launch's dynamic shared memory (16-byte aligned; filled with 0xff bytes, NaN as floats,
   at the start of every block, since real shared memory starts with garbage). */
inline void *lg_emu_dynamic_shared(void) {
    lg_emu_current_thread("dynamic shared memory");
    return lg_emu_state().sched.dynamic_shared;
}

/* The lanes of thread `linear`'s warp that exist in a block of `threads` threads. */
inline unsigned lg_emu_warp_lanes(int threads, int linear) {
    int lanes = threads - linear / 32 * 32;
    return lanes >= 32 ? 0xffffffffu : (1u << lanes) - 1;
}

inline void lg_emu_start_thread(lg_emu_fiber *f, int linear, dim3 block) {
    if (!f->async_open.empty() || !f->async_groups.empty())
        lg_emu_die("a thread exited with cp.async copies it never waited for");
    f->linear = linear;
    f->thread_idx.x = (unsigned)linear % block.x;
    f->thread_idx.y = (unsigned)linear / block.x % block.y;
    f->thread_idx.z = (unsigned)linear / (block.x * block.y);
    f->state = LG_EMU_RUNNABLE;
}

/* Runs every runnable thread, in thread order or reversed, until it waits or exits. */
inline void lg_emu_run_pass(lg_emu_scheduler &s) {
    int n = s.threads;
    for (int k = 0; k < n; k++) {
        lg_emu_fiber *f = s.fibers[(size_t)(s.reverse_order ? n - 1 - k : k)];
        if (f->state == LG_EMU_RUNNABLE) lg_emu_resume(s, f);
    }
}

inline bool lg_emu_same_site(const lg_emu_fiber *a, const lg_emu_fiber *b) {
    return a->wait_line == b->wait_line &&
           (a->wait_file == b->wait_file || strcmp(a->wait_file, b->wait_file) == 0);
}

/* Every thread waits at a __syncthreads: check it is the same one, answer the _count/_and/_or
   variants, and let all run. */
inline void lg_emu_release_block_barrier(lg_emu_scheduler &s) {
    const lg_emu_fiber *first = s.fibers[0];
    uint64_t count = 0;
    for (int i = 0; i < s.threads; i++) {
        const lg_emu_fiber *f = s.fibers[(size_t)i];
        if (!lg_emu_same_site(f, first))
            lg_emu_die("kernel %s launched at %s:%d, block (%u,%u,%u): thread 0 waits at the "
                       "__syncthreads at %s:%d but thread %d at the one at %s:%d",
                       s.site.kernel, s.site.file, s.site.line, s.block_idx.x, s.block_idx.y,
                       s.block_idx.z, first->wait_file, first->wait_line, i, f->wait_file,
                       f->wait_line);
        count += f->exchange_in != 0;
    }
    for (int i = 0; i < s.threads; i++) {
        lg_emu_fiber *f = s.fibers[(size_t)i];
        f->exchange_out = count;
        f->state = LG_EMU_RUNNABLE;
    }
    s.at_block_barrier = 0;
}

/* The lanes of `group` (all waiting at the same warp barrier) exchange values and run on. */
inline void lg_emu_release_warp_group(lg_emu_scheduler &s, int warp, unsigned group) {
    lg_emu_fiber **lanes = &s.fibers[(size_t)warp * 32];
    unsigned ballot = 0;
    for (unsigned g = group; g; g &= g - 1) {
        int lane = __builtin_ctz(g);
        if (lanes[lane]->exchange_in != 0) ballot |= 1u << lane;
    }
    for (unsigned g = group; g; g &= g - 1) {
        lg_emu_fiber *f = lanes[__builtin_ctz(g)];
        int src = f->exchange_source;
        if (src == LG_EMU_EXCHANGE_BALLOT) f->exchange_out = ballot;
        else if (src >= 0 && src < 32 && (group >> src & 1)) f->exchange_out = lanes[src]->exchange_in;
        else f->exchange_out = f->exchange_in; /* a lane outside the group: its own value */
        f->state = LG_EMU_RUNNABLE;
        s.at_warp_barrier--;
        s.warp_waiting[warp]--;
    }
}

/* Releases every warp group whose lanes (those of the mask that exist) all wait at a warp
   barrier with that mask; returns whether any did. */
inline bool lg_emu_release_warp_groups(lg_emu_scheduler &s) {
    bool released = false;
    for (int warp = 0; warp * 32 < s.threads; warp++) {
        if (s.warp_waiting[warp] == 0) continue;
        lg_emu_fiber **lanes = &s.fibers[(size_t)warp * 32];
        unsigned exist = lg_emu_warp_lanes(s.threads, warp * 32), waiting = 0;
        for (unsigned e = exist; e; e &= e - 1)
            if (lanes[__builtin_ctz(e)]->state == LG_EMU_AT_WARP_BARRIER) waiting |= 1u << __builtin_ctz(e);
        for (unsigned pending = waiting; pending;) {
            int lane = __builtin_ctz(pending);
            unsigned group = lanes[lane]->warp_mask & exist;
            pending &= ~(group | 1u << lane);
            if (!(group >> lane & 1))
                lg_emu_die("kernel %s launched at %s:%d: lane %d of warp %d calls a warp function "
                           "at %s:%d with mask 0x%08x, which leaves it out",
                           s.site.kernel, s.site.file, s.site.line, lane, warp,
                           lanes[lane]->wait_file, lanes[lane]->wait_line, lanes[lane]->warp_mask);
            bool complete = (waiting & group) == group;
            for (unsigned g = group; complete && g; g &= g - 1)
                complete = (lanes[__builtin_ctz(g)]->warp_mask & exist) == group;
            if (!complete) continue;
            lg_emu_release_warp_group(s, warp, group);
            waiting &= ~group;
            released = true;
        }
    }
    return released;
}

/* First thread in state `state`, or -1. */
inline int lg_emu_first_in_state(const lg_emu_scheduler &s, lg_emu_thread_state state) {
    for (int i = 0; i < s.threads; i++)
        if (s.fibers[(size_t)i]->state == state) return i;
    return -1;
}

[[noreturn]] inline void lg_emu_report_deadlock(const lg_emu_scheduler &s) {
    char block_wait[200] = "", warp_wait[200] = "", exit_note[100] = "";
    int b = lg_emu_first_in_state(s, LG_EMU_AT_BLOCK_BARRIER);
    int w = lg_emu_first_in_state(s, LG_EMU_AT_WARP_BARRIER);
    int e = lg_emu_first_in_state(s, LG_EMU_EXITED);
    if (b >= 0)
        snprintf(block_wait, sizeof block_wait, " (thread %d at %s:%d)", b,
                 s.fibers[(size_t)b]->wait_file, s.fibers[(size_t)b]->wait_line);
    if (w >= 0)
        snprintf(warp_wait, sizeof warp_wait, " (thread %d at %s:%d)", w,
                 s.fibers[(size_t)w]->wait_file, s.fibers[(size_t)w]->wait_line);
    if (e >= 0) snprintf(exit_note, sizeof exit_note, " (thread %d first)", e);
    lg_emu_die("deadlock in kernel %s launched at %s:%d, block (%u,%u,%u) of %d threads: %d wait "
               "at __syncthreads%s, %d at a warp barrier%s, %d returned%s. A barrier in divergent "
               "code, or threads that return before a barrier the others reach?",
               s.site.kernel, s.site.file, s.site.line, s.block_idx.x, s.block_idx.y,
               s.block_idx.z, s.threads, s.at_block_barrier, block_wait, s.at_warp_barrier,
               warp_wait, s.exited, exit_note);
}

inline void lg_emu_run_block(lg_emu_scheduler &s) {
    s.exited = s.at_block_barrier = s.at_warp_barrier = 0;
    memset(s.warp_waiting, 0, sizeof s.warp_waiting);
    for (int i = 0; i < s.threads; i++) lg_emu_start_thread(s.fibers[(size_t)i], i, s.block_dim);
    if (s.dynamic_shared_bytes) memset(s.dynamic_shared, 0xff, s.dynamic_shared_bytes);
    for (;;) {
        lg_emu_run_pass(s);
        if (s.exited == s.threads) return;
        if (s.at_warp_barrier > 0 && lg_emu_release_warp_groups(s)) continue;
        if (s.at_block_barrier == s.threads) {
            lg_emu_release_block_barrier(s);
            continue;
        }
        lg_emu_report_deadlock(s);
    }
}

inline void lg_emu_reserve(lg_emu_scheduler &s, int threads, size_t shared_bytes) {
    while (s.fibers.size() < (size_t)threads) s.fibers.push_back(lg_emu_fiber_create());
    if (shared_bytes > s.dynamic_shared_capacity || !s.dynamic_shared) {
        free(s.dynamic_shared);
        size_t bytes = (shared_bytes + 63) / 64 * 64 + 64;
        s.dynamic_shared = (unsigned char *)aligned_alloc(64, bytes);
        if (!s.dynamic_shared) lg_emu_die("cannot allocate %zu bytes of shared memory", bytes);
        s.dynamic_shared_capacity = bytes;
    }
    s.dynamic_shared_bytes = shared_bytes;
}

inline cudaError_t lg_emu_error(cudaError_t e);

/* Why CUDA would refuse this launch, or null. */
inline const char *lg_emu_launch_refusal(const void *kernel, dim3 grid, dim3 block,
                                         size_t shared_bytes, cudaStream_t stream,
                                         cudaError_t *code) {
    lg_emu_state_t &st = lg_emu_state();
    *code = cudaErrorInvalidConfiguration;
    unsigned long long threads = (unsigned long long)block.x * block.y * block.z;
    if (!block.x || !block.y || !block.z || block.x > 1024 || block.y > 1024 || block.z > 64 ||
        threads > LG_EMU_MAX_THREADS)
        return "block dimensions out of range (at most 1024 threads, z at most 64)";
    if (!grid.x || !grid.y || !grid.z || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535)
        return "grid dimensions out of range";
    if (shared_bytes > st.rt.arch->shared_optin)
        return "more dynamic shared memory than a block can have on this architecture (LG_EMU_ARCH)";
    if (shared_bytes > LG_EMU_STATIC_SHARED &&
        st.rt.shared_allowed[{st.rt.current_device, kernel}] < shared_bytes)
        return "more than 48 KiB of dynamic shared memory, more than the kernel's "
               "cudaFuncSetAttribute allowed on this device";
    *code = cudaErrorInvalidResourceHandle;
    if (stream && !st.rt.streams.count(stream)) return "the stream was destroyed or never created";
    if (stream && stream->device != st.rt.current_device)
        return "the stream belongs to another device than the current one";
    if (st.rt.device_count == 0) {
        *code = cudaErrorNoDevice;
        return "no emulated devices";
    }
    return nullptr;
}

inline void lg_emu_before_launch(cudaStream_t stream); /* section 8 */

/* Runs `body(args)` as every thread of every block of the launch, synchronously. */
inline void lg_emu_run_kernel(const lg_emu_launch_site &site, dim3 grid, dim3 block,
                              size_t shared_bytes, cudaStream_t stream, void (*body)(void *),
                              void *args) {
    lg_emu_scheduler &s = lg_emu_state().sched;
    if (s.kernel_body)
        lg_emu_die("kernel %s launched at %s:%d from inside kernel %s (not emulated)", site.kernel,
                   site.file, site.line, s.site.kernel);
    cudaError_t code;
    if (const char *refusal = lg_emu_launch_refusal(site.address, grid, block, shared_bytes,
                                                    stream, &code)) {
        fprintf(stderr, "lg_emu: launch of %s at %s:%d refused: %s\n", site.kernel, site.file,
                site.line, refusal);
        lg_emu_error(code);
        return;
    }
    s.launches++;
    lg_emu_before_launch(stream);
    lg_emu_reserve(s, (int)(block.x * block.y * block.z), shared_bytes);
    s.site = site;
    s.grid_dim = grid;
    s.block_dim = block;
    s.threads = (int)(block.x * block.y * block.z);
    s.kernel_body = body;
    s.kernel_args = args;
    lg_emu_gpu_work work;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                s.block_idx = uint3{x, y, z};
                lg_emu_run_block(s);
            }
    s.kernel_body = nullptr;
    s.kernel_args = nullptr;
}

/* LG_LAUNCH's object: remembers the configuration; its call evaluates the kernel's arguments
   once, keeps them for the launch, and runs it. */
template <typename Body> struct lg_emu_launcher {
    lg_emu_launch_site site;
    dim3 grid, block;
    size_t shared_bytes;
    cudaStream_t stream;
    Body body;

    template <typename... Args> void operator()(Args &&...args) const {
        struct bound {
            Body body;
            std::tuple<typename std::decay<Args>::type...> args;
            static void call(void *p) {
                bound *b = (bound *)p;
                std::apply(b->body, b->args);
            }
        };
        bound b{body, std::tuple<typename std::decay<Args>::type...>(std::forward<Args>(args)...)};
        lg_emu_run_kernel(site, grid, block, shared_bytes, stream, &bound::call, &b);
    }
};

template <typename Body>
lg_emu_launcher<Body> lg_emu_make_launcher(const char *kernel, const void *address,
                                           const char *file, int line, dim3 grid, dim3 block,
                                           size_t shared_bytes, cudaStream_t stream, Body body) {
    return lg_emu_launcher<Body>{lg_emu_launch_site{kernel, address, file, line}, grid, block,
                                 shared_bytes, stream, body};
}

/* kernel<<<grid, block, smem_bytes, stream>>>(args...). A template kernel goes in parentheses:
   LG_LAUNCH((k<float, 64>), ...). */
#define LG_LAUNCH(kernel, grid, block, smem_bytes, stream, ...)                                \
    lg_emu_make_launcher(#kernel, (const void *)&kernel, __FILE__, __LINE__, dim3(grid),        \
                         dim3(block),                                                          \
                         (size_t)(smem_bytes), (stream),                                       \
                         [](auto &&...lg_emu_args_) { kernel(lg_emu_args_...); })(__VA_ARGS__)

/* ============================================================================================
   6. Device functions: barriers, warp exchanges, atomics, math
   ============================================================================================ */

inline uint64_t lg_emu_block_exchange(uint64_t value, const char *file, int line) {
    lg_emu_scheduler &s = lg_emu_state().sched;
    lg_emu_fiber *f = lg_emu_current_thread("__syncthreads");
    f->state = LG_EMU_AT_BLOCK_BARRIER;
    f->wait_file = file;
    f->wait_line = line;
    f->exchange_in = value;
    f->exchange_source = LG_EMU_EXCHANGE_COUNT;
    s.at_block_barrier++;
    lg_emu_suspend(s, f);
    return f->exchange_out;
}

inline void __syncthreads(const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    lg_emu_block_exchange(0, file, line);
}
inline int __syncthreads_count(int predicate, const char *file = __builtin_FILE(),
                               int line = __builtin_LINE()) {
    return (int)lg_emu_block_exchange(predicate != 0, file, line);
}
inline int __syncthreads_and(int predicate, const char *file = __builtin_FILE(),
                             int line = __builtin_LINE()) {
    return (int)lg_emu_block_exchange(predicate != 0, file, line) == lg_emu_state().sched.threads;
}
inline int __syncthreads_or(int predicate, const char *file = __builtin_FILE(),
                            int line = __builtin_LINE()) {
    return lg_emu_block_exchange(predicate != 0, file, line) != 0;
}

/* Waits until the lanes of `mask` (those that exist) reach a warp barrier with the same mask;
   returns the value of lane `source` (or the ballot, see LG_EMU_EXCHANGE_*). */
inline uint64_t lg_emu_warp_exchange(unsigned mask, uint64_t value, int source, const char *file,
                                     int line) {
    lg_emu_scheduler &s = lg_emu_state().sched;
    lg_emu_fiber *f = lg_emu_current_thread("a warp function");
    f->state = LG_EMU_AT_WARP_BARRIER;
    f->warp_mask = mask;
    f->exchange_in = value;
    f->exchange_source = source;
    f->wait_file = file;
    f->wait_line = line;
    s.at_warp_barrier++;
    s.warp_waiting[f->linear / 32]++;
    lg_emu_suspend(s, f);
    return f->exchange_out;
}

inline void __syncwarp(unsigned mask = 0xffffffffu, const char *file = __builtin_FILE(),
                       int line = __builtin_LINE()) {
    lg_emu_warp_exchange(mask, 0, LG_EMU_EXCHANGE_NONE, file, line);
}

inline unsigned __ballot_sync(unsigned mask, int predicate, const char *file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
    return (unsigned)lg_emu_warp_exchange(mask, predicate != 0, LG_EMU_EXCHANGE_BALLOT, file, line);
}
inline int __any_sync(unsigned mask, int predicate, const char *file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
    return __ballot_sync(mask, predicate, file, line) != 0;
}
inline int __all_sync(unsigned mask, int predicate, const char *file = __builtin_FILE(),
                      int line = __builtin_LINE()) {
    const lg_emu_scheduler &s = lg_emu_state().sched;
    unsigned group = mask & lg_emu_warp_lanes(s.threads, lg_emu_current_thread("__all_sync")->linear);
    return __ballot_sync(mask, predicate, file, line) == group;
}

template <typename T> inline uint64_t lg_emu_bits(T value) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                  "warp shuffles move values of at most 8 bytes");
    uint64_t bits = 0;
    memcpy(&bits, &value, sizeof value);
    return bits;
}
template <typename T> inline T lg_emu_from_bits(uint64_t bits) {
    T value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* The caller's lane and the first lane of its width-wide segment. */
inline int lg_emu_lane(int width, int *segment) {
    if (width < 1 || width > 32 || (width & (width - 1)))
        lg_emu_die("warp shuffle width %d is not a power of two up to 32", width);
    int lane = lg_emu_current_thread("a warp shuffle")->linear % 32;
    *segment = lane & ~(width - 1);
    return lane;
}

template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32,
                     const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    int segment;
    lg_emu_lane(width, &segment);
    int src = segment + (src_lane & (width - 1));
    return lg_emu_from_bits<T>(lg_emu_warp_exchange(mask, lg_emu_bits(var), src, file, line));
}

template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32,
                        const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    int segment, lane = lg_emu_lane(width, &segment);
    int src = lane - (int)delta < segment ? lane : lane - (int)delta;
    return lg_emu_from_bits<T>(lg_emu_warp_exchange(mask, lg_emu_bits(var), src, file, line));
}

template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32,
                          const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    int segment, lane = lg_emu_lane(width, &segment);
    int src = lane + (int)delta >= segment + width ? lane : lane + (int)delta;
    return lg_emu_from_bits<T>(lg_emu_warp_exchange(mask, lg_emu_bits(var), src, file, line));
}

/* As CUDA: a lane may read from earlier segments, but reading a later one gives its own value. */
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32,
                         const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    int segment, lane = lg_emu_lane(width, &segment);
    int src = lane ^ (lane_mask & 31);
    if (src >= segment + width) src = lane;
    return lg_emu_from_bits<T>(lg_emu_warp_exchange(mask, lg_emu_bits(var), src, file, line));
}

/* Atomics: one OS thread runs every emulated thread, so a plain read-modify-write is atomic. */
template <typename T, typename F> inline T lg_emu_atomic(T *address, F update) {
    T old = *address;
    *address = update(old);
    return old;
}
inline float atomicAdd(float *a, float v) { return lg_emu_atomic(a, [v](float o) { return o + v; }); }
inline double atomicAdd(double *a, double v) { return lg_emu_atomic(a, [v](double o) { return o + v; }); }
inline unsigned atomicAdd(unsigned *a, unsigned v) { return lg_emu_atomic(a, [v](unsigned o) { return o + v; }); }
inline unsigned long long atomicAdd(unsigned long long *a, unsigned long long v) {
    return lg_emu_atomic(a, [v](unsigned long long o) { return o + v; });
}
inline int atomicAdd(int *a, int v) {
    return lg_emu_atomic(a, [v](int o) { return (int)((unsigned)o + (unsigned)v); });
}
inline int atomicSub(int *a, int v) {
    return lg_emu_atomic(a, [v](int o) { return (int)((unsigned)o - (unsigned)v); });
}
inline unsigned atomicSub(unsigned *a, unsigned v) { return lg_emu_atomic(a, [v](unsigned o) { return o - v; }); }
inline int atomicMax(int *a, int v) { return lg_emu_atomic(a, [v](int o) { return o > v ? o : v; }); }
inline unsigned atomicMax(unsigned *a, unsigned v) { return lg_emu_atomic(a, [v](unsigned o) { return o > v ? o : v; }); }
inline long long atomicMax(long long *a, long long v) {
    return lg_emu_atomic(a, [v](long long o) { return o > v ? o : v; });
}
inline unsigned long long atomicMax(unsigned long long *a, unsigned long long v) {
    return lg_emu_atomic(a, [v](unsigned long long o) { return o > v ? o : v; });
}
inline int atomicMin(int *a, int v) { return lg_emu_atomic(a, [v](int o) { return o < v ? o : v; }); }
inline unsigned atomicMin(unsigned *a, unsigned v) { return lg_emu_atomic(a, [v](unsigned o) { return o < v ? o : v; }); }
inline long long atomicMin(long long *a, long long v) {
    return lg_emu_atomic(a, [v](long long o) { return o < v ? o : v; });
}
inline unsigned long long atomicMin(unsigned long long *a, unsigned long long v) {
    return lg_emu_atomic(a, [v](unsigned long long o) { return o < v ? o : v; });
}
inline int atomicExch(int *a, int v) { return lg_emu_atomic(a, [v](int) { return v; }); }
inline unsigned atomicExch(unsigned *a, unsigned v) { return lg_emu_atomic(a, [v](unsigned) { return v; }); }
inline unsigned long long atomicExch(unsigned long long *a, unsigned long long v) {
    return lg_emu_atomic(a, [v](unsigned long long) { return v; });
}
inline float atomicExch(float *a, float v) { return lg_emu_atomic(a, [v](float) { return v; }); }
inline int atomicCAS(int *a, int compare, int v) {
    return lg_emu_atomic(a, [=](int o) { return o == compare ? v : o; });
}
inline unsigned atomicCAS(unsigned *a, unsigned compare, unsigned v) {
    return lg_emu_atomic(a, [=](unsigned o) { return o == compare ? v : o; });
}
inline unsigned long long atomicCAS(unsigned long long *a, unsigned long long compare,
                                    unsigned long long v) {
    return lg_emu_atomic(a, [=](unsigned long long o) { return o == compare ? v : o; });
}
inline unsigned short atomicCAS(unsigned short *a, unsigned short compare, unsigned short v) {
    return lg_emu_atomic(a, [=](unsigned short o) { return o == compare ? v : o; });
}
inline int atomicAnd(int *a, int v) { return lg_emu_atomic(a, [v](int o) { return o & v; }); }
inline unsigned atomicAnd(unsigned *a, unsigned v) { return lg_emu_atomic(a, [v](unsigned o) { return o & v; }); }
inline int atomicOr(int *a, int v) { return lg_emu_atomic(a, [v](int o) { return o | v; }); }
inline unsigned atomicOr(unsigned *a, unsigned v) { return lg_emu_atomic(a, [v](unsigned o) { return o | v; }); }
inline int atomicXor(int *a, int v) { return lg_emu_atomic(a, [v](int o) { return o ^ v; }); }
inline unsigned atomicXor(unsigned *a, unsigned v) { return lg_emu_atomic(a, [v](unsigned o) { return o ^ v; }); }

/* Memory fences order nothing here: the threads of the emulation run one at a time. */
inline void __threadfence(void) {}
inline void __threadfence_block(void) {}
inline void __threadfence_system(void) {}
[[noreturn]] inline void __trap(void) { lg_emu_die("__trap() in a kernel"); }

/* Math intrinsics: the fast variants compute the accurate function. */
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __powf(float x, float y) { return powf(x, y); }
inline float __sinf(float x) { return sinf(x); }
inline float __cosf(float x) { return cosf(x); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return sqrtf(x); }
inline float __fadd_rn(float x, float y) { return x + y; }
inline float __fmul_rn(float x, float y) { return x * y; }
inline float __fmaf_rn(float x, float y, float z) { return fmaf(x, y, z); }
inline float __saturatef(float x) { return x > 0.0f ? (x < 1.0f ? x : 1.0f) : 0.0f; } /* NaN: 0 */
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
inline int __float2int_rz(float x) { return (int)x; }
inline float __int2float_rn(int x) { return (float)x; }
inline unsigned __float_as_uint(float x) { return lg_emu_from_bits<unsigned>(lg_emu_bits(x)); }
inline int __float_as_int(float x) { return lg_emu_from_bits<int>(lg_emu_bits(x)); }
inline float __uint_as_float(unsigned x) { return lg_emu_from_bits<float>(lg_emu_bits(x)); }
inline float __int_as_float(int x) { return lg_emu_from_bits<float>(lg_emu_bits(x)); }
inline long long __double_as_longlong(double x) { return lg_emu_from_bits<long long>(lg_emu_bits(x)); }
inline double __longlong_as_double(long long x) { return lg_emu_from_bits<double>(lg_emu_bits(x)); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
inline int __ffs(int x) { return __builtin_ffs(x); }
template <typename T> inline T __ldg(const T *p) { return *p; }

/* CUDA's min and max, for any pair of arithmetic types (the usual conversions apply, as in
   CUDA's overloads; floating point takes fmin/fmax). */
template <typename A, typename B>
inline typename std::common_type<A, B>::type min(A a, B b) {
    typedef typename std::common_type<A, B>::type C;
    if constexpr (std::is_floating_point<C>::value) return std::fmin((C)a, (C)b);
    else return (C)a < (C)b ? (C)a : (C)b;
}
template <typename A, typename B>
inline typename std::common_type<A, B>::type max(A a, B b) {
    typedef typename std::common_type<A, B>::type C;
    if constexpr (std::is_floating_point<C>::value) return std::fmax((C)a, (C)b);
    else return (C)a > (C)b ? (C)a : (C)b;
}

/* ============================================================================================
   7. CUDA runtime API
   ============================================================================================ */

/* Records a failure for cudaGetLastError, as the runtime does; returns it. */
inline cudaError_t lg_emu_error(cudaError_t e) {
    if (e != cudaSuccess) lg_emu_state().rt.last_error = e;
    return e;
}

inline const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorPeerAccessAlreadyEnabled: return "cudaErrorPeerAccessAlreadyEnabled";
    case cudaErrorPeerAccessNotEnabled: return "cudaErrorPeerAccessNotEnabled";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    }
    return "cudaErrorUnknown";
}

inline const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorPeerAccessAlreadyEnabled: return "peer access is already enabled";
    case cudaErrorPeerAccessNotEnabled: return "peer access has not been enabled";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorNotSupported: return "operation not supported";
    }
    return "unrecognized error code";
}

inline cudaError_t cudaGetLastError(void) {
    lg_emu_runtime &rt = lg_emu_state().rt;
    cudaError_t e = rt.last_error;
    rt.last_error = cudaSuccess;
    return e;
}
inline cudaError_t cudaPeekAtLastError(void) { return lg_emu_state().rt.last_error; }

inline bool lg_emu_valid_device(int device) {
    return device >= 0 && device < lg_emu_state().rt.device_count;
}

inline cudaError_t cudaGetDeviceCount(int *count) {
    if (!count) return lg_emu_error(cudaErrorInvalidValue);
    *count = lg_emu_state().rt.device_count;
    return *count ? cudaSuccess : lg_emu_error(cudaErrorNoDevice);
}
inline cudaError_t cudaSetDevice(int device) {
    if (!lg_emu_valid_device(device)) return lg_emu_error(cudaErrorInvalidDevice);
    lg_emu_state().rt.current_device = device;
    return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int *device) {
    if (!device) return lg_emu_error(cudaErrorInvalidValue);
    if (lg_emu_state().rt.device_count == 0) return lg_emu_error(cudaErrorNoDevice);
    *device = lg_emu_state().rt.current_device;
    return cudaSuccess;
}
inline void lg_emu_run_deferred(cudaStream_t stream, uint64_t mark); /* section 4 */
inline cudaError_t cudaDeviceSynchronize(void) {
    lg_emu_run_deferred(nullptr, UINT64_MAX);
    return cudaSuccess;
}

/* --- memory --- */

/* The live allocation holding p, or null. */
inline const lg_emu_allocation *lg_emu_find_allocation(const void *p, uintptr_t *base) {
    const std::map<uintptr_t, lg_emu_allocation> &all = lg_emu_state().rt.allocations;
    auto it = all.upper_bound((uintptr_t)p);
    if (it == all.begin()) return nullptr;
    --it;
    if ((uintptr_t)p >= it->first + it->second.bytes) return nullptr;
    *base = it->first;
    return &it->second;
}

/* False when [p, p + bytes) starts inside an allocation of this emulator and runs past its end
   (memory the emulator did not allocate cannot be judged). */
inline bool lg_emu_range_fits(const void *p, size_t bytes) {
    uintptr_t base;
    const lg_emu_allocation *a = lg_emu_find_allocation(p, &base);
    return !a || (uintptr_t)p - base + bytes <= a->bytes;
}

/* Device memory (cudaMalloc) lives in pages of its own that are open only while the emulated
   GPU works on it: a kernel, a copy, a memset, a collective (lg_emu_gpu_work). Host code that
   reads or writes it directly, which a GPU's own memory does not allow, stops at once with a
   message naming the allocation (lg_emu_host_visit). Its data ends, 256-byte aligned, just
   before a guard page that stays closed, so a kernel that runs past the end faults too.
   LG_EMU_HOST_VISITS=allow in the environment leaves it open; =report reports every visit (the
   first access after each piece of GPU work) and goes on. */
inline size_t lg_emu_page_bytes(void) { return (size_t)sysconf(_SC_PAGESIZE); }

inline void lg_emu_protect(const lg_emu_allocation &a, int protection) {
    if (mprotect(a.map, a.map_bytes - lg_emu_page_bytes(), protection) != 0)
        lg_emu_die("cannot change the protection of device memory");
}

/* Opens every device allocation to the host (open) or closes it. */
inline void lg_emu_device_memory_open(bool open) {
    lg_emu_runtime &rt = lg_emu_state().rt;
    if (rt.host_visits_allowed) return;
    for (const auto &entry : rt.allocations)
        if (entry.second.kind == LG_EMU_DEVICE_MEMORY)
            lg_emu_protect(entry.second, open ? PROT_READ | PROT_WRITE : PROT_NONE);
}

/* SIGSEGV: a fault in closed device memory is the host visiting it; anything else faults again
   with the default action. */
inline void lg_emu_host_visit(int signal_number, siginfo_t *info, void * /* context */) {
    lg_emu_runtime &rt = lg_emu_state().rt;
    uintptr_t base = 0;
    const lg_emu_allocation *a = lg_emu_find_allocation(info->si_addr, &base);
    if (a && a->kind == LG_EMU_DEVICE_MEMORY && rt.device_access == 0) {
        fprintf(stderr, "lg_emu: host code touched device memory at %p, byte %zu of a cudaMalloc "
                "of %zu bytes on GPU %d: the host reaches a GPU's memory only through copies "
                "(cudaMemcpy); the host's call stack:\n", info->si_addr,
                (size_t)((uintptr_t)info->si_addr - base), a->bytes, a->device);
        void *frames[64];
        backtrace_symbols_fd(frames, backtrace(frames, 64), 2);
        if (!rt.host_visits_reported) abort();
        lg_emu_device_memory_open(true); /* until the next GPU work ends */
        return;
    }
    signal(signal_number, SIG_DFL);
}

inline void lg_emu_catch_host_visits(void) {
    static bool installed = false;
    if (installed) return;
    installed = true;
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = lg_emu_host_visit;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    sigaction(SIGSEGV, &action, nullptr);
}

/* The huge page of transparent huge pages on x86-64: device memory starts on one, so that
   opening and closing it (an mprotect of every allocation around each piece of GPU work) walks
   one page-table entry per 2 MiB instead of 512. */
#define LG_EMU_HUGE_PAGE ((size_t)2 << 20)

/* `bytes` (a multiple of the page) of fresh memory starting on a huge page, or nullptr. */
inline void *lg_emu_map_huge_aligned(size_t bytes) {
    size_t span = bytes + LG_EMU_HUGE_PAGE;
    void *raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS |
                     MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    uintptr_t start = ((uintptr_t)raw + LG_EMU_HUGE_PAGE - 1) / LG_EMU_HUGE_PAGE * LG_EMU_HUGE_PAGE;
    size_t head = start - (uintptr_t)raw, tail = span - head - bytes;
    if (head) munmap(raw, head);
    if (tail) munmap((unsigned char *)start + bytes, tail);
    madvise((void *)start, bytes, MADV_HUGEPAGE); /* a hint: without it, only slower */
    return (void *)start;
}

/* Pages for `bytes` of device memory and a guard page: *data is where the bytes start. */
inline bool lg_emu_map_device(size_t bytes, lg_emu_allocation *a, void **data) {
    size_t page = lg_emu_page_bytes(), rounded = (bytes + 255) / 256 * 256;
    a->map_bytes = (rounded + page - 1) / page * page + page;
    void *map = lg_emu_map_huge_aligned(a->map_bytes);
    if (!map) return false;
    a->map = map;
    unsigned char *guard = (unsigned char *)map + a->map_bytes - page;
    if (mprotect(guard, page, PROT_NONE) != 0) lg_emu_die("cannot protect a guard page");
    *data = guard - rounded;
    lg_emu_catch_host_visits();
    return true;
}

inline cudaError_t lg_emu_allocate(void **ptr, size_t bytes, lg_emu_memory_kind kind) {
    lg_emu_runtime &rt = lg_emu_state().rt;
    if (!ptr) return lg_emu_error(cudaErrorInvalidValue);
    *ptr = nullptr;
    if (kind != LG_EMU_HOST_MEMORY) {
        if (rt.device_count == 0) return lg_emu_error(cudaErrorNoDevice);
        size_t used = rt.used[rt.current_device];
        if (used > rt.memory_per_device || bytes > rt.memory_per_device - used)
            return lg_emu_error(cudaErrorMemoryAllocation);
    }
    if (bytes == 0) return cudaSuccess; /* as CUDA: a null pointer */
    lg_emu_allocation a{bytes, rt.current_device, kind, nullptr, 0};
    void *p = nullptr; /* else exactly `bytes`, so AddressSanitizer sees a kernel's overrun */
    if (kind == LG_EMU_DEVICE_MEMORY ? !lg_emu_map_device(bytes, &a, &p)
                                     : posix_memalign(&p, 256, bytes) != 0)
        return lg_emu_error(cudaErrorMemoryAllocation);
    /* uninitialized memory reads as NaN (up to 1 GiB: beyond, pages stay untouched) */
    memset(p, 0xff, bytes < ((size_t)1 << 30) ? bytes : ((size_t)1 << 30));
    rt.allocations[(uintptr_t)p] = a;
    if (kind == LG_EMU_DEVICE_MEMORY && rt.device_access == 0 && !rt.host_visits_allowed)
        lg_emu_protect(a, PROT_NONE);
    if (kind != LG_EMU_HOST_MEMORY) rt.used[rt.current_device] += bytes;
    *ptr = p;
    return cudaSuccess;
}

/* Frees p if it is an allocation of one of `kinds` (a bit per lg_emu_memory_kind). */
inline cudaError_t lg_emu_release(void *p, unsigned kinds) {
    if (!p) return cudaSuccess;
    lg_emu_runtime &rt = lg_emu_state().rt;
    auto it = rt.allocations.find((uintptr_t)p);
    if (it == rt.allocations.end() || !(kinds >> it->second.kind & 1))
        return lg_emu_error(cudaErrorInvalidValue);
    lg_emu_allocation a = it->second;
    if (a.kind != LG_EMU_HOST_MEMORY) rt.used[a.device] -= a.bytes;
    rt.allocations.erase(it);
    if (a.kind == LG_EMU_DEVICE_MEMORY) munmap(a.map, a.map_bytes);
    else free(p);
    return cudaSuccess;
}

inline cudaError_t cudaMalloc(void **ptr, size_t bytes) { return lg_emu_allocate(ptr, bytes, LG_EMU_DEVICE_MEMORY); }
inline cudaError_t cudaMallocManaged(void **ptr, size_t bytes, unsigned flags = cudaMemAttachGlobal) {
    if (flags != cudaMemAttachGlobal && flags != cudaMemAttachHost) return lg_emu_error(cudaErrorInvalidValue);
    return lg_emu_allocate(ptr, bytes, LG_EMU_MANAGED_MEMORY);
}
inline cudaError_t cudaMallocHost(void **ptr, size_t bytes) { return lg_emu_allocate(ptr, bytes, LG_EMU_HOST_MEMORY); }
inline cudaError_t cudaHostAlloc(void **ptr, size_t bytes, unsigned /* flags */) {
    return lg_emu_allocate(ptr, bytes, LG_EMU_HOST_MEMORY);
}
inline cudaError_t cudaMallocAsync(void **ptr, size_t bytes, cudaStream_t /* stream */) {
    return lg_emu_allocate(ptr, bytes, LG_EMU_DEVICE_MEMORY);
}
template <typename T> inline cudaError_t cudaMalloc(T **ptr, size_t bytes) { return cudaMalloc((void **)ptr, bytes); }
template <typename T>
inline cudaError_t cudaMallocManaged(T **ptr, size_t bytes, unsigned flags = cudaMemAttachGlobal) {
    return cudaMallocManaged((void **)ptr, bytes, flags);
}
template <typename T> inline cudaError_t cudaMallocHost(T **ptr, size_t bytes) { return cudaMallocHost((void **)ptr, bytes); }
template <typename T> inline cudaError_t cudaHostAlloc(T **ptr, size_t bytes, unsigned flags) {
    return cudaHostAlloc((void **)ptr, bytes, flags);
}
inline cudaError_t cudaFree(void *p) {
    return lg_emu_release(p, 1u << LG_EMU_DEVICE_MEMORY | 1u << LG_EMU_MANAGED_MEMORY);
}
inline cudaError_t cudaFreeAsync(void *p, cudaStream_t /* stream */) { return cudaFree(p); }
inline cudaError_t cudaFreeHost(void *p) { return lg_emu_release(p, 1u << LG_EMU_HOST_MEMORY); }

inline cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    lg_emu_runtime &rt = lg_emu_state().rt;
    if (!free_bytes || !total_bytes) return lg_emu_error(cudaErrorInvalidValue);
    if (rt.device_count == 0) return lg_emu_error(cudaErrorNoDevice);
    *total_bytes = rt.memory_per_device;
    size_t used = rt.used[rt.current_device];
    *free_bytes = used < rt.memory_per_device ? rt.memory_per_device - used : 0;
    return cudaSuccess;
}

/* Bytes the live cudaMalloc/cudaMallocManaged allocations hold on `device` (for tests). */
inline size_t lg_emu_device_bytes_in_use(int device) {
    return lg_emu_valid_device(device) ? lg_emu_state().rt.used[device] : 0;
}

inline cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind) {
    if ((unsigned)kind > cudaMemcpyDefault) return lg_emu_error(cudaErrorInvalidMemcpyDirection);
    if (bytes == 0) return cudaSuccess;
    if (!dst || !src || !lg_emu_range_fits(dst, bytes) || !lg_emu_range_fits(src, bytes))
        return lg_emu_error(cudaErrorInvalidValue);
    lg_emu_gpu_work work;
    memmove(dst, src, bytes);
    return cudaSuccess;
}
inline void lg_emu_run_deferred(cudaStream_t stream, uint64_t mark); /* section 4 */
inline bool lg_emu_deferred_copy(void *dst, const void *src, size_t bytes, cudaStream_t stream);
/* With LG_EMU_DEFER_COPIES=1 a copy on a stream between memory the emulator allocated waits
   until something orders it (a synchronization, an event waited on, later work on its stream):
   the latest a GPU could land it, so a read that does not wait reads the old bytes. Else, and
   for pageable host memory (where CUDA copies before returning), at once. */
inline cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                                   cudaStream_t stream = nullptr) {
    if ((unsigned)kind <= cudaMemcpyDefault && bytes && dst && src && lg_emu_range_fits(dst, bytes) &&
        lg_emu_range_fits(src, bytes) && lg_emu_deferred_copy(dst, src, bytes, stream))
        return cudaSuccess; /* queued behind what the stream holds */
    if (stream) lg_emu_run_deferred(stream, UINT64_MAX); /* what the stream holds comes first */
    return cudaMemcpy(dst, src, bytes, kind);
}
inline cudaError_t cudaMemcpyPeer(void *dst, int dst_device, const void *src, int src_device, size_t bytes) {
    if (!lg_emu_valid_device(dst_device) || !lg_emu_valid_device(src_device))
        return lg_emu_error(cudaErrorInvalidDevice);
    return cudaMemcpy(dst, src, bytes, cudaMemcpyDefault);
}
inline cudaError_t cudaMemcpyPeerAsync(void *dst, int dst_device, const void *src, int src_device,
                                       size_t bytes, cudaStream_t /* stream */ = nullptr) {
    return cudaMemcpyPeer(dst, dst_device, src, src_device, bytes);
}
inline cudaError_t cudaMemset(void *dst, int value, size_t bytes) {
    if (bytes == 0) return cudaSuccess;
    if (!dst || !lg_emu_range_fits(dst, bytes)) return lg_emu_error(cudaErrorInvalidValue);
    lg_emu_gpu_work work;
    memset(dst, value, bytes);
    return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void *dst, int value, size_t bytes, cudaStream_t stream = nullptr) {
    if (stream) lg_emu_run_deferred(stream, UINT64_MAX);
    return cudaMemset(dst, value, bytes);
}

/* What kind of memory p points into; host memory the emulator did not allocate is
   unregistered (not an error, as in CUDA 11 and later). */
inline cudaError_t cudaPointerGetAttributes(cudaPointerAttributes *attributes, const void *p) {
    if (!attributes) return lg_emu_error(cudaErrorInvalidValue);
    uintptr_t base;
    const lg_emu_allocation *a = lg_emu_find_allocation(p, &base);
    void *q = const_cast<void *>(p);
    if (!a) *attributes = cudaPointerAttributes{cudaMemoryTypeUnregistered, -2, nullptr, q};
    else if (a->kind == LG_EMU_DEVICE_MEMORY) *attributes = cudaPointerAttributes{cudaMemoryTypeDevice, a->device, q, nullptr};
    else if (a->kind == LG_EMU_MANAGED_MEMORY) *attributes = cudaPointerAttributes{cudaMemoryTypeManaged, a->device, q, q};
    else *attributes = cudaPointerAttributes{cudaMemoryTypeHost, a->device, q, q};
    return cudaSuccess;
}

/* Placement hints: nothing to do on host memory. CUDA 13's signatures (a cudaMemLocation). */
inline cudaError_t cudaMemPrefetchAsync(const void * /* ptr */, size_t /* bytes */,
                                        cudaMemLocation location, unsigned /* flags */,
                                        cudaStream_t /* stream */ = nullptr) {
    if (location.type == cudaMemLocationTypeDevice && !lg_emu_valid_device(location.id))
        return lg_emu_error(cudaErrorInvalidDevice);
    return cudaSuccess;
}
inline cudaError_t cudaMemAdvise(const void * /* ptr */, size_t /* bytes */,
                                 cudaMemoryAdvise /* advice */, cudaMemLocation location) {
    if (location.type == cudaMemLocationTypeDevice && !lg_emu_valid_device(location.id))
        return lg_emu_error(cudaErrorInvalidDevice);
    return cudaSuccess;
}

/* --- streams and events: every operation is complete when its call returns --- */

inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned flags) {
    lg_emu_runtime &rt = lg_emu_state().rt;
    if (!stream) return lg_emu_error(cudaErrorInvalidValue);
    if (rt.device_count == 0) return lg_emu_error(cudaErrorNoDevice);
    *stream = new lg_emu_stream{rt.current_device, flags};
    rt.streams.insert(*stream);
    return cudaSuccess;
}
inline cudaError_t cudaStreamCreate(cudaStream_t *stream) {
    return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}
inline bool lg_emu_valid_stream(cudaStream_t stream) {
    return !stream || lg_emu_state().rt.streams.count(stream);
}
inline cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    if (!stream || !lg_emu_state().rt.streams.erase(stream)) return lg_emu_error(cudaErrorInvalidResourceHandle);
    delete stream;
    return cudaSuccess;
}
inline void lg_emu_run_deferred(cudaStream_t stream, uint64_t mark); /* section 4 */
inline cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    if (!lg_emu_valid_stream(stream)) return lg_emu_error(cudaErrorInvalidResourceHandle);
    lg_emu_run_deferred(stream, UINT64_MAX);
    return cudaSuccess;
}
inline cudaError_t cudaStreamQuery(cudaStream_t stream) { return cudaStreamSynchronize(stream); }

inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned flags) {
    lg_emu_runtime &rt = lg_emu_state().rt;
    if (!event) return lg_emu_error(cudaErrorInvalidValue);
    if (rt.device_count == 0) return lg_emu_error(cudaErrorNoDevice);
    *event = new lg_emu_event{rt.current_device, flags, 0, nullptr, 0, 0};
    rt.events.insert(*event);
    return cudaSuccess;
}
inline cudaError_t cudaEventCreate(cudaEvent_t *event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }
inline bool lg_emu_valid_event(cudaEvent_t event) { return event && lg_emu_state().rt.events.count(event); }
inline cudaError_t cudaEventDestroy(cudaEvent_t event) {
    if (!lg_emu_valid_event(event)) return lg_emu_error(cudaErrorInvalidResourceHandle);
    lg_emu_state().rt.events.erase(event);
    delete event;
    return cudaSuccess;
}
/* As CUDA: the event and the stream must belong to the same device. */
inline cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr) {
    if (!lg_emu_valid_event(event) || !lg_emu_valid_stream(stream))
        return lg_emu_error(cudaErrorInvalidResourceHandle);
    int stream_device = stream ? stream->device : lg_emu_state().rt.current_device;
    if (event->device != stream_device) return lg_emu_error(cudaErrorInvalidResourceHandle);
    event->recorded = 1;
    event->stream = stream;
    event->mark = lg_emu_state().nccl.issued;
    event->stalled = lg_emu_nccl_stalled(stream);
    return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    if (!lg_emu_valid_event(event)) return lg_emu_error(cudaErrorInvalidResourceHandle);
    if (event->recorded) lg_emu_run_deferred(event->stream, event->mark);
    return cudaSuccess;
}
inline cudaError_t cudaEventQuery(cudaEvent_t event) {
    if (lg_emu_valid_event(event) && event->recorded && event->stalled && lg_emu_nccl_stalled(event->stream))
        return cudaErrorNotReady; /* (not an error: cudaGetLastError stays clean) */
    return cudaEventSynchronize(event);
}
inline cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned /* flags */ = 0) {
    if (!lg_emu_valid_event(event) || !lg_emu_valid_stream(stream))
        return lg_emu_error(cudaErrorInvalidResourceHandle);
    if (event->recorded) lg_emu_run_deferred(event->stream, event->mark);
    return cudaSuccess;
}
/* No clock: 0 ms between any two recorded timing events. */
inline cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    if (!ms) return lg_emu_error(cudaErrorInvalidValue);
    if (!lg_emu_valid_event(start) || !lg_emu_valid_event(end) ||
        ((start->flags | end->flags) & cudaEventDisableTiming))
        return lg_emu_error(cudaErrorInvalidResourceHandle);
    if (!start->recorded || !end->recorded) return lg_emu_error(cudaErrorInvalidResourceHandle);
    *ms = 0.0f;
    return cudaSuccess;
}

/* --- devices and peers --- */

inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device) {
    if (!prop) return lg_emu_error(cudaErrorInvalidValue);
    if (!lg_emu_valid_device(device)) return lg_emu_error(cudaErrorInvalidDevice);
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "litgpt.c emulated GPU %d", device);
    prop->totalGlobalMem = lg_emu_state().rt.memory_per_device;
    prop->sharedMemPerBlock = 49152;
    const lg_emu_arch *arch = lg_emu_state().rt.arch;
    prop->sharedMemPerBlockOptin = arch->shared_optin;
    prop->sharedMemPerMultiprocessor = arch->shared_per_sm;
    prop->warpSize = 32;
    prop->maxThreadsPerBlock = LG_EMU_MAX_THREADS;
    prop->maxThreadsPerMultiProcessor = arch->threads_per_sm;
    prop->major = arch->major;
    prop->minor = arch->minor;
    prop->multiProcessorCount = 132;
    return cudaSuccess;
}

inline cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device) {
    cudaDeviceProp p;
    if (!value) return lg_emu_error(cudaErrorInvalidValue);
    cudaError_t e = cudaGetDeviceProperties(&p, device);
    if (e != cudaSuccess) return e;
    switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = p.maxThreadsPerBlock; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = (int)p.sharedMemPerBlock; break;
    case cudaDevAttrWarpSize: *value = p.warpSize; break;
    case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = p.maxThreadsPerMultiProcessor; break;
    case cudaDevAttrComputeCapabilityMajor: *value = p.major; break;
    case cudaDevAttrComputeCapabilityMinor: *value = p.minor; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = (int)p.sharedMemPerMultiprocessor; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = (int)p.sharedMemPerBlockOptin; break;
    default: return lg_emu_error(cudaErrorInvalidValue);
    }
    return cudaSuccess;
}

inline cudaError_t cudaDeviceCanAccessPeer(int *can, int device, int peer) {
    if (!can) return lg_emu_error(cudaErrorInvalidValue);
    if (!lg_emu_valid_device(device) || !lg_emu_valid_device(peer)) return lg_emu_error(cudaErrorInvalidDevice);
    *can = device != peer;
    return cudaSuccess;
}
/* As CUDA: enabling twice answers cudaErrorPeerAccessAlreadyEnabled. */
inline cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned flags) {
    lg_emu_runtime &rt = lg_emu_state().rt;
    if (flags != 0) return lg_emu_error(cudaErrorInvalidValue);
    if (!lg_emu_valid_device(peer) || peer == rt.current_device) return lg_emu_error(cudaErrorInvalidDevice);
    if (rt.peer_enabled[rt.current_device][peer]) return lg_emu_error(cudaErrorPeerAccessAlreadyEnabled);
    rt.peer_enabled[rt.current_device][peer] = 1;
    return cudaSuccess;
}
inline cudaError_t cudaDeviceGetP2PAttribute(int *value, cudaDeviceP2PAttr attr, int src, int dst) {
    if (!value) return lg_emu_error(cudaErrorInvalidValue);
    if (!lg_emu_valid_device(src) || !lg_emu_valid_device(dst) || src == dst)
        return lg_emu_error(cudaErrorInvalidDevice);
    switch (attr) {
    case cudaDevP2PAttrPerformanceRank: *value = 0; break;
    case cudaDevP2PAttrAccessSupported: *value = 1; break;
    case cudaDevP2PAttrNativeAtomicSupported: *value = 1; break;
    default: return lg_emu_error(cudaErrorInvalidValue);
    }
    return cudaSuccess;
}

/* The stack a thread of the current device may have: recorded, nothing allocated (emulated
   kernels run on the host's stack); CUDA's default is 1 KiB. */
#define LG_EMU_DEFAULT_STACK_BYTES 1024
inline cudaError_t cudaDeviceGetLimit(size_t *value, cudaLimit limit) {
    lg_emu_runtime &rt = lg_emu_state().rt;
    if (!value || limit != cudaLimitStackSize) return lg_emu_error(cudaErrorInvalidValue);
    size_t set = rt.stack_limit[rt.current_device];
    *value = set ? set : LG_EMU_DEFAULT_STACK_BYTES;
    return cudaSuccess;
}
inline cudaError_t cudaDeviceSetLimit(cudaLimit limit, size_t value) {
    lg_emu_runtime &rt = lg_emu_state().rt;
    if (limit != cudaLimitStackSize || value == 0) return lg_emu_error(cudaErrorInvalidValue);
    rt.stack_limit[rt.current_device] = value;
    return cudaSuccess;
}

/* Kernel attributes: the dynamic shared memory a kernel may have on the current device, up to
   the architecture's opt-in maximum (a launch over 48 KiB needs it). */
template <typename T>
inline cudaError_t cudaFuncSetAttribute(T *kernel, cudaFuncAttribute attr, int value) {
    lg_emu_runtime &rt = lg_emu_state().rt;
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaSuccess;
    if (value < 0 || (size_t)value > rt.arch->shared_optin) return lg_emu_error(cudaErrorInvalidValue);
    rt.shared_allowed[{rt.current_device, (const void *)kernel}] = (size_t)value;
    return cudaSuccess;
}
template <typename T>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int *blocks, T /* kernel */,
                                                                 int /* block_size */,
                                                                 size_t /* shared_bytes */) {
    if (!blocks) return lg_emu_error(cudaErrorInvalidValue);
    *blocks = 1;
    return cudaSuccess;
}

/* ============================================================================================
   8. NCCL, in process
   ============================================================================================ */

/* bf16 and fp16 <-> float, rounding to nearest even. */
inline float lg_emu_bf16_to_float(uint16_t h) { return lg_emu_from_bits<float>(lg_emu_bits((uint32_t)h << 16)); }
inline uint16_t lg_emu_float_to_bf16(float f) {
    uint32_t x = lg_emu_from_bits<uint32_t>(lg_emu_bits(f));
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x0040u); /* quiet NaN */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline float lg_emu_fp16_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24 */
        float v = ldexpf((float)mantissa, -24);
        return sign ? -v : v;
    }
    if (exponent == 31) return lg_emu_from_bits<float>(lg_emu_bits(sign | 0x7f800000u | mantissa << 13));
    return lg_emu_from_bits<float>(lg_emu_bits(sign | (exponent + 112) << 23 | mantissa << 13));
}
inline uint16_t lg_emu_float_to_fp16(float f) {
    uint32_t x = lg_emu_from_bits<uint32_t>(lg_emu_bits(f));
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);           /* NaN */
    if (x >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);          /* rounds to infinity */
    if (x < 0x38800000u) {                                            /* subnormal half */
        float scaled = lg_emu_from_bits<float>(lg_emu_bits(x)) * 16777216.0f; /* exact: * 2^24 */
        return (uint16_t)(sign | (uint16_t)nearbyintf(scaled));       /* default mode: even */
    }
    uint32_t h = (x >> 13) - (112u << 10), rest = x & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

inline const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    case ncclNumResults: break;
    }
    return "unknown result code";
}

inline ncclResult_t ncclGetVersion(int *version) {
    if (!version) return ncclInvalidArgument;
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

inline size_t lg_emu_nccl_type_bytes(ncclDataType_t type) {
    switch (type) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    }
    return 0; /* not emulated */
}

/* How each type loads into its accumulator and stores back. */
template <typename S> struct lg_emu_plain_element {
    typedef S storage;
    typedef S accumulator;
    static S load(S v) { return v; }
    static S store(S a) { return a; }
};
struct lg_emu_bf16_element {
    typedef uint16_t storage;
    typedef float accumulator;
    static float load(uint16_t v) { return lg_emu_bf16_to_float(v); }
    static uint16_t store(float a) { return lg_emu_float_to_bf16(a); }
};
struct lg_emu_fp16_element {
    typedef uint16_t storage;
    typedef float accumulator;
    static float load(uint16_t v) { return lg_emu_fp16_to_float(v); }
    static uint16_t store(float a) { return lg_emu_float_to_fp16(a); }
};

/* a op b; integers wrap as NCCL's do. */
template <typename A> inline A lg_emu_nccl_combine(ncclRedOp_t op, A a, A b) {
    typedef typename std::conditional<std::is_integral<A>::value, std::make_unsigned<A>,
                                      std::common_type<A>>::type::type W;
    switch (op) {
    case ncclProd: return (A)((W)a * (W)b);
    case ncclMax: return a > b ? a : b;
    case ncclMin: return a < b ? a : b;
    default: return (A)((W)a + (W)b); /* ncclSum, ncclAvg */
    }
}

/* out[i] = inputs[0][i] op ... op inputs[n - 1][i], in rank order, one rounding at the end. */
template <typename E>
inline void lg_emu_nccl_reduce_typed(ncclRedOp_t op, const void *const *inputs, int n,
                                     size_t count, void *out) {
    typedef typename E::storage S;
    typedef typename E::accumulator A;
    for (size_t i = 0; i < count; i++) {
        S v;
        memcpy(&v, (const S *)inputs[0] + i, sizeof v);
        A acc = E::load(v);
        for (int r = 1; r < n; r++) {
            memcpy(&v, (const S *)inputs[r] + i, sizeof v);
            acc = lg_emu_nccl_combine(op, acc, E::load(v));
        }
        if (op == ncclAvg) acc = (A)(acc / (A)n);
        S result = E::store(acc);
        memcpy((S *)out + i, &result, sizeof result);
    }
}

inline void lg_emu_nccl_reduce(ncclDataType_t type, ncclRedOp_t op, const void *const *inputs,
                               int n, size_t count, void *out) {
    switch (type) {
    case ncclInt8: lg_emu_nccl_reduce_typed<lg_emu_plain_element<int8_t>>(op, inputs, n, count, out); break;
    case ncclUint8: lg_emu_nccl_reduce_typed<lg_emu_plain_element<uint8_t>>(op, inputs, n, count, out); break;
    case ncclInt32: lg_emu_nccl_reduce_typed<lg_emu_plain_element<int32_t>>(op, inputs, n, count, out); break;
    case ncclUint32: lg_emu_nccl_reduce_typed<lg_emu_plain_element<uint32_t>>(op, inputs, n, count, out); break;
    case ncclInt64: lg_emu_nccl_reduce_typed<lg_emu_plain_element<int64_t>>(op, inputs, n, count, out); break;
    case ncclUint64: lg_emu_nccl_reduce_typed<lg_emu_plain_element<uint64_t>>(op, inputs, n, count, out); break;
    case ncclFloat16: lg_emu_nccl_reduce_typed<lg_emu_fp16_element>(op, inputs, n, count, out); break;
    case ncclFloat32: lg_emu_nccl_reduce_typed<lg_emu_plain_element<float>>(op, inputs, n, count, out); break;
    case ncclFloat64: lg_emu_nccl_reduce_typed<lg_emu_plain_element<double>>(op, inputs, n, count, out); break;
    case ncclBfloat16: lg_emu_nccl_reduce_typed<lg_emu_bf16_element>(op, inputs, n, count, out); break;
    }
}

inline const char *lg_emu_nccl_kind_name(lg_emu_nccl_kind kind) {
    switch (kind) {
    case LG_EMU_ALL_REDUCE: return "ncclAllReduce";
    case LG_EMU_REDUCE_SCATTER: return "ncclReduceScatter";
    case LG_EMU_ALL_GATHER: return "ncclAllGather";
    case LG_EMU_BROADCAST: return "ncclBroadcast";
    case LG_EMU_REDUCE: return "ncclReduce";
    }
    return "?";
}

/* Runs one collective given every rank's call; every input is read before any output is
   written, so buffers may alias. */
inline void lg_emu_nccl_execute(const std::vector<lg_emu_nccl_call> &calls) {
    const lg_emu_nccl_call &c = calls[0];
    int n = (int)calls.size();
    lg_emu_gpu_work work;
    size_t bytes = c.count * lg_emu_nccl_type_bytes(c.type);
    std::vector<const void *> inputs((size_t)n);
    for (int r = 0; r < n; r++) inputs[(size_t)r] = calls[(size_t)r].send;
    std::vector<unsigned char> result(c.kind == LG_EMU_REDUCE_SCATTER || c.kind == LG_EMU_ALL_GATHER
                                          ? bytes * (size_t)n : bytes);
    switch (c.kind) {
    case LG_EMU_ALL_REDUCE:
    case LG_EMU_REDUCE:
        lg_emu_nccl_reduce(c.type, c.op, inputs.data(), n, c.count, result.data());
        break;
    case LG_EMU_REDUCE_SCATTER:
        lg_emu_nccl_reduce(c.type, c.op, inputs.data(), n, c.count * (size_t)n, result.data());
        break;
    case LG_EMU_ALL_GATHER:
        for (int r = 0; r < n; r++) memcpy(result.data() + (size_t)r * bytes, inputs[(size_t)r], bytes);
        break;
    case LG_EMU_BROADCAST: memcpy(result.data(), inputs[(size_t)c.root], bytes); break;
    }
    for (int r = 0; r < n; r++) {
        void *recv = calls[(size_t)r].recv;
        switch (c.kind) {
        case LG_EMU_ALL_REDUCE:
        case LG_EMU_BROADCAST: memmove(recv, result.data(), bytes); break;
        case LG_EMU_REDUCE: if (r == c.root) memmove(recv, result.data(), bytes); break;
        case LG_EMU_REDUCE_SCATTER: memmove(recv, result.data() + (size_t)r * bytes, bytes); break;
        case LG_EMU_ALL_GATHER: memmove(recv, result.data(), bytes * (size_t)n); break;
        }
    }
}

/* Deferred mode: a complete collective waits until a stream that depends on it, or the host,
   needs it: the latest moment a GPU could run it. A compute stream that reads a collective's
   output without waiting for it then reads the old values, and the tests see the difference. */
inline void lg_emu_nccl_defer_or_execute(const std::vector<lg_emu_nccl_call> &calls) {
    lg_emu_nccl_state &nc = lg_emu_state().nccl;
    if (!nc.defer) {
        lg_emu_nccl_execute(calls);
        return;
    }
    nc.deferred.push_back(lg_emu_deferred_work{calls, ++nc.issued, nullptr, nullptr, 0, nullptr});
}

inline bool lg_emu_deferred_on(const lg_emu_deferred_work &d, cudaStream_t stream) {
    if (d.calls.empty()) return d.stream == stream;
    for (const lg_emu_nccl_call &c : d.calls)
        if (c.stream == stream) return true;
    return false;
}

/* The streams whose deferred work up to `mark` on `stream` must run: the stream, and every
   stream of a deferred collective among that work (its other ranks' streams wait for it too),
   to a fixed point; *last gets the newest such work's number. */
inline std::set<cudaStream_t> lg_emu_streams_held(cudaStream_t stream, uint64_t mark, uint64_t *last) {
    const lg_emu_nccl_state &nc = lg_emu_state().nccl;
    std::set<cudaStream_t> held = {stream};
    *last = 0;
    for (bool grew = true; grew;) {
        grew = false;
        for (const lg_emu_deferred_work &d : nc.deferred) {
            bool touches = false;
            for (cudaStream_t s : held) touches = touches || lg_emu_deferred_on(d, s);
            if (d.seq > mark || !touches) continue;
            if (d.seq > *last) *last = d.seq;
            for (const lg_emu_nccl_call &c : d.calls) grew = held.insert(c.stream).second || grew;
        }
    }
    return held;
}

/* Runs the deferred work issued up to `mark` on `stream` (NULL: on any stream, and every piece
   issued before it), in order: on a stream, what it holds and what the collectives among that
   hold on other streams (what runs earlier than needed is still a valid order); a copy on
   another stream stays deferred, as on a GPU, where nothing orders it yet. */
inline void lg_emu_run_deferred(cudaStream_t stream, uint64_t mark) {
    lg_emu_nccl_state &nc = lg_emu_state().nccl;
    uint64_t last = 0;
    std::set<cudaStream_t> held;
    if (stream) held = lg_emu_streams_held(stream, mark, &last);
    else
        for (const lg_emu_deferred_work &d : nc.deferred)
            if (d.seq <= mark) last = d.seq;
    for (auto it = nc.deferred.begin(); it != nc.deferred.end() && it->seq <= last;) {
        bool runs = !stream;
        for (cudaStream_t s : held) runs = runs || lg_emu_deferred_on(*it, s);
        if (!runs) {
            ++it;
            continue;
        }
        if (it->calls.empty()) {
            lg_emu_gpu_work work;
            memmove(it->dst, it->src, it->bytes);
        } else {
            lg_emu_nccl_execute(it->calls);
        }
        it = nc.deferred.erase(it);
    }
}

/* Queues an asynchronous copy in LG_EMU_DEFER_COPIES mode; false: copy it now. */
inline bool lg_emu_deferred_copy(void *dst, const void *src, size_t bytes, cudaStream_t stream) {
    lg_emu_nccl_state &nc = lg_emu_state().nccl;
    uintptr_t base;
    if (!nc.defer_copies || !stream || !lg_emu_find_allocation(dst, &base) ||
        !lg_emu_find_allocation(src, &base))
        return false;
    nc.deferred.push_back(lg_emu_deferred_work{{}, ++nc.issued, dst, src, bytes, stream});
    return true;
}

/* Before a kernel on `stream`: what that stream holds lands first; one left on another
   stream is counted (the copy runs beside the kernel). */
inline void lg_emu_before_launch(cudaStream_t stream) {
    lg_emu_nccl_state &nc = lg_emu_state().nccl;
    if (stream) lg_emu_run_deferred(stream, UINT64_MAX);
    for (const lg_emu_deferred_work &d : nc.deferred)
        if (d.calls.empty() && d.stream != stream) {
            nc.launches_beside_copies++;
            break;
        }
}

/* Kernels launched so far while a copy on another stream was still deferred (tests). */
inline uint64_t lg_emu_launches_beside_copies(void) { return lg_emu_state().nccl.launches_beside_copies; }

/* Whether rank r's call matches rank 0's (a mismatch is a bug in the caller). */
inline bool lg_emu_nccl_calls_match(const lg_emu_nccl_call &a, const lg_emu_nccl_call &b) {
    bool rooted = a.kind == LG_EMU_BROADCAST || a.kind == LG_EMU_REDUCE;
    bool reduces = a.kind == LG_EMU_ALL_REDUCE || a.kind == LG_EMU_REDUCE_SCATTER || a.kind == LG_EMU_REDUCE;
    return a.kind == b.kind && a.count == b.count && a.type == b.type &&
           (!rooted || a.root == b.root) && (!reduces || a.op == b.op);
}

/* Runs every collective all of whose ranks have called it. */
inline ncclResult_t lg_emu_nccl_progress(lg_emu_nccl_clique *q) {
    for (;;) {
        for (int r = 0; r < q->ranks; r++)
            if (q->queued[(size_t)r].empty()) return ncclSuccess;
        std::vector<lg_emu_nccl_call> calls;
        for (int r = 0; r < q->ranks; r++) {
            calls.push_back(q->queued[(size_t)r].front());
            q->queued[(size_t)r].pop_front();
        }
        for (int r = 1; r < q->ranks; r++)
            if (!lg_emu_nccl_calls_match(calls[0], calls[(size_t)r])) {
                fprintf(stderr, "lg_emu: NCCL ranks disagree: rank 0 calls %s (count %zu, type %d, "
                        "op %d, root %d), rank %d %s (count %zu, type %d, op %d, root %d)\n",
                        lg_emu_nccl_kind_name(calls[0].kind), calls[0].count, (int)calls[0].type,
                        (int)calls[0].op, calls[0].root, r, lg_emu_nccl_kind_name(calls[(size_t)r].kind),
                        calls[(size_t)r].count, (int)calls[(size_t)r].type, (int)calls[(size_t)r].op,
                        calls[(size_t)r].root);
                return ncclInvalidUsage;
            }
        lg_emu_nccl_defer_or_execute(calls);
    }
}

inline ncclResult_t lg_emu_nccl_progress_all(void) {
    lg_emu_nccl_state &nc = lg_emu_state().nccl;
    ncclResult_t result = ncclSuccess;
    for (lg_emu_nccl_clique *q : nc.touched) {
        ncclResult_t r = lg_emu_nccl_progress(q);
        if (r != ncclSuccess) result = r;
    }
    nc.touched.clear();
    return result;
}

/* Checks one rank's call and queues it; outside a group it runs what is complete. */
inline ncclResult_t lg_emu_nccl_enqueue(ncclComm_t comm, const lg_emu_nccl_call &call,
                                        size_t send_bytes, size_t recv_bytes) {
    lg_emu_nccl_state &nc = lg_emu_state().nccl;
    const char *name = lg_emu_nccl_kind_name(call.kind);
    if (!comm || !nc.comms.count(comm)) return ncclInvalidArgument;
    if (!lg_emu_nccl_type_bytes(call.type) || (unsigned)call.op >= (unsigned)ncclNumOps) return ncclInvalidArgument;
    bool rooted = call.kind == LG_EMU_BROADCAST || call.kind == LG_EMU_REDUCE;
    if (rooted && (call.root < 0 || call.root >= comm->clique->ranks)) return ncclInvalidArgument;
    bool needs_send = !rooted || call.kind == LG_EMU_REDUCE || comm->rank == call.root;
    bool needs_recv = call.kind != LG_EMU_REDUCE || comm->rank == call.root;
    if (send_bytes && needs_send && (!call.send || !lg_emu_range_fits(call.send, send_bytes))) {
        fprintf(stderr, "lg_emu: %s on rank %d: the send buffer is null or shorter than %zu bytes\n",
                name, comm->rank, send_bytes);
        return ncclInvalidArgument;
    }
    if (recv_bytes && needs_recv && (!call.recv || !lg_emu_range_fits(call.recv, recv_bytes))) {
        fprintf(stderr, "lg_emu: %s on rank %d: the receive buffer is null or shorter than %zu bytes\n",
                name, comm->rank, recv_bytes);
        return ncclInvalidArgument;
    }
    lg_emu_nccl_clique *q = comm->clique;
    q->queued[(size_t)comm->rank].push_back(call);
    bool known = false;
    for (lg_emu_nccl_clique *t : nc.touched) known = known || t == q;
    if (!known) nc.touched.push_back(q);
    return nc.group_depth == 0 ? lg_emu_nccl_progress_all() : ncclSuccess;
}

inline ncclResult_t ncclGroupStart(void) {
    lg_emu_state().nccl.group_depth++;
    return ncclSuccess;
}
inline ncclResult_t ncclGroupEnd(void) {
    lg_emu_nccl_state &nc = lg_emu_state().nccl;
    if (nc.group_depth == 0) return ncclInvalidUsage;
    return --nc.group_depth == 0 ? lg_emu_nccl_progress_all() : ncclSuccess;
}

/* Calls still waiting for other ranks (0 after every complete group). */
inline size_t lg_emu_nccl_pending(void) {
    size_t n = 0;
    for (ncclComm_t c : lg_emu_state().nccl.comms) n += c->clique->queued[(size_t)c->rank].size();
    return n;
}

inline ncclResult_t ncclCommInitAll(ncclComm_t *comms, int n, const int *devices) {
    lg_emu_state_t &st = lg_emu_state();
    if (!comms || n < 1) return ncclInvalidArgument;
    for (int i = 0; i < n; i++) {
        int d = devices ? devices[i] : i;
        if (!lg_emu_valid_device(d)) return ncclInvalidArgument;
        for (int j = 0; j < i; j++)
            if ((devices ? devices[j] : j) == d) {
                fprintf(stderr, "lg_emu: ncclCommInitAll: ranks %d and %d both on device %d\n", j, i, d);
                return ncclInvalidUsage; /* as NCCL: "Duplicate GPU detected" */
            }
    }
    lg_emu_nccl_clique *q = new lg_emu_nccl_clique();
    q->ranks = q->live = n;
    q->queued.resize((size_t)n);
    for (int i = 0; i < n; i++) {
        comms[i] = new lg_emu_nccl_comm{q, i, devices ? devices[i] : i};
        st.nccl.comms.insert(comms[i]);
    }
    return ncclSuccess;
}

inline ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    lg_emu_nccl_state &nc = lg_emu_state().nccl;
    if (!comm || !nc.comms.erase(comm)) return ncclInvalidArgument;
    lg_emu_nccl_clique *q = comm->clique;
    if (!q->queued[(size_t)comm->rank].empty())
        fprintf(stderr, "lg_emu: ncclCommDestroy: rank %d still has %zu collectives waiting for "
                "the other ranks\n", comm->rank, q->queued[(size_t)comm->rank].size());
    delete comm;
    if (--q->live == 0) {
        nc.touched.erase(std::remove(nc.touched.begin(), nc.touched.end(), q), nc.touched.end());
        delete q;
    }
    return ncclSuccess;
}
/* Drops the calls still waiting for the other ranks (a GPU's aborted kernels), then destroys. */
inline ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (comm && lg_emu_state().nccl.comms.count(comm)) comm->clique->queued[(size_t)comm->rank].clear();
    return ncclCommDestroy(comm);
}

inline bool lg_emu_nccl_stalled(const lg_emu_stream *stream) {
    for (ncclComm_t c : lg_emu_state().nccl.comms)
        for (const lg_emu_nccl_call &call : c->clique->queued[(size_t)c->rank])
            if (call.stream == stream) return true;
    return false;
}

/* Nothing fails asynchronously here: a stalled collective shows in its stream's events. */
inline ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *state) {
    if (!comm || !state || !lg_emu_state().nccl.comms.count(comm)) return ncclInvalidArgument;
    *state = ncclSuccess;
    return ncclSuccess;
}

/* Communicators across processes: one process has no other processes to meet, so these say so
   (the trainer uses them only when a launcher started several). */
#define NCCL_UNIQUE_ID_BYTES 128
#define NCCL_SPLIT_NOCOLOR -1
typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;
/* The fields of NCCL 2.18's ncclConfig_t that the trainer sets; the others keep NCCL's
   "undefined" value (INT_MIN). */
#define NCCL_CONFIG_UNDEF_INT INT_MIN
struct ncclConfig_t {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;
    int cgaClusterSize, minCTAs, maxCTAs;
    const char *netName;
    int splitShare;
};
#define NCCL_CONFIG_INITIALIZER                                                                   \
    {sizeof(ncclConfig_t), 0xcafebeef, NCCL_VERSION_CODE, NCCL_CONFIG_UNDEF_INT,                 \
     NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, nullptr,               \
     NCCL_CONFIG_UNDEF_INT}
inline ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    if (!id) return ncclInvalidArgument;
    memset(id->internal, 0, sizeof id->internal);
    return ncclSuccess;
}
inline ncclResult_t ncclCommInitRank(ncclComm_t *comm, int n, ncclUniqueId id, int rank) {
    (void)comm; (void)n; (void)id; (void)rank;
    fprintf(stderr, "lg_emu: ncclCommInitRank: communicators across processes are not emulated\n");
    return ncclInvalidUsage;
}
inline ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int n, ncclUniqueId id, int rank,
                                          ncclConfig_t *config) {
    (void)config;
    return ncclCommInitRank(comm, n, id, rank);
}
inline ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                                  ncclConfig_t *config) {
    (void)comm; (void)color; (void)key; (void)newcomm; (void)config;
    fprintf(stderr, "lg_emu: ncclCommSplit: not emulated\n");
    return ncclInvalidUsage;
}

inline ncclResult_t ncclCommCount(const ncclComm_t comm, int *count) {
    if (!comm || !count || !lg_emu_state().nccl.comms.count(comm)) return ncclInvalidArgument;
    *count = comm->clique->ranks;
    return ncclSuccess;
}
inline ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank) {
    if (!comm || !rank || !lg_emu_state().nccl.comms.count(comm)) return ncclInvalidArgument;
    *rank = comm->rank;
    return ncclSuccess;
}
inline ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device) {
    if (!comm || !device || !lg_emu_state().nccl.comms.count(comm)) return ncclInvalidArgument;
    *device = comm->device;
    return ncclSuccess;
}

inline ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t type,
                                  ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    size_t bytes = count * lg_emu_nccl_type_bytes(type);
    return lg_emu_nccl_enqueue(comm, lg_emu_nccl_call{LG_EMU_ALL_REDUCE, send, recv, count, type, op, 0, stream},
                               bytes, bytes);
}
inline ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t recv_count,
                                      ncclDataType_t type, ncclRedOp_t op, ncclComm_t comm,
                                      cudaStream_t stream) {
    size_t bytes = recv_count * lg_emu_nccl_type_bytes(type);
    int ranks = comm && lg_emu_state().nccl.comms.count(comm) ? comm->clique->ranks : 1;
    return lg_emu_nccl_enqueue(comm, lg_emu_nccl_call{LG_EMU_REDUCE_SCATTER, send, recv, recv_count, type, op, 0, stream},
                               bytes * (size_t)ranks, bytes);
}
inline ncclResult_t ncclAllGather(const void *send, void *recv, size_t send_count,
                                  ncclDataType_t type, ncclComm_t comm, cudaStream_t stream) {
    size_t bytes = send_count * lg_emu_nccl_type_bytes(type);
    int ranks = comm && lg_emu_state().nccl.comms.count(comm) ? comm->clique->ranks : 1;
    return lg_emu_nccl_enqueue(comm, lg_emu_nccl_call{LG_EMU_ALL_GATHER, send, recv, send_count, type, ncclSum, 0, stream},
                               bytes, bytes * (size_t)ranks);
}
inline ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t type,
                                  int root, ncclComm_t comm, cudaStream_t stream) {
    size_t bytes = count * lg_emu_nccl_type_bytes(type);
    return lg_emu_nccl_enqueue(comm, lg_emu_nccl_call{LG_EMU_BROADCAST, send, recv, count, type, ncclSum, root, stream},
                               bytes, bytes);
}
inline ncclResult_t ncclBcast(void *buffer, size_t count, ncclDataType_t type, int root,
                              ncclComm_t comm, cudaStream_t stream) {
    return ncclBroadcast(buffer, buffer, count, type, root, comm, stream);
}
inline ncclResult_t ncclReduce(const void *send, void *recv, size_t count, ncclDataType_t type,
                               ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
    size_t bytes = count * lg_emu_nccl_type_bytes(type);
    return lg_emu_nccl_enqueue(comm, lg_emu_nccl_call{LG_EMU_REDUCE, send, recv, count, type, op, root, stream},
                               bytes, bytes);
}

/* ============================================================================================
   9. Warp matrix functions: the <mma.h> (WMMA), <cuda_bf16.h> and <cuda_fp16.h> subsets
   ============================================================================================ */

/* Each lane's fragment holds the WHOLE tile, row-major: element (i, j) of a rows x cols tile is
   x[i * cols + j], so num_elements = rows cols (on a GPU a lane holds a few elements in an
   unspecified order). Code that treats fragments opaquely, or applies the same operation to
   every x[i], behaves the same; code that relies on which element a lane holds does not. Every
   WMMA call is a warp-synchronous point (a __syncwarp on entry): the lanes' shared-memory writes
   before it are visible to it. mma_sync multiplies the exact 16-bit values (their products are
   exact in float) and adds them to the accumulator in k order, rounding each sum to float; the
   tensor cores' internal order and rounding differ in the last bits. The pointers must be
   32-byte aligned and the leading dimensions multiples of 16 bytes, as CUDA requires. */

/* The 16-bit floating-point types: bits only; conversions round to nearest even. */
struct __nv_bfloat16 {
    uint16_t bits;
};
struct __half {
    uint16_t bits;
};
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16{lg_emu_float_to_bf16(f)}; }
inline float __bfloat162float(__nv_bfloat16 h) { return lg_emu_bf16_to_float(h.bits); }
inline __half __float2half(float f) { return __half{lg_emu_float_to_fp16(f)}; }
inline float __half2float(__half h) { return lg_emu_fp16_to_float(h.bits); }
/* The paired conversions (cvt.rn.bf16x2.f32, cvt.rn.f16x2.f32): a in x (the low 16 bits of the
   32-bit pair), b in y, each rounded to nearest even as above. */
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};
struct __half2 {
    __half x, y;
};
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return __nv_bfloat162{__float2bfloat16(a), __float2bfloat16(b)};
}
inline __half2 __floats2half2_rn(float a, float b) { return __half2{__float2half(a), __float2half(b)}; }

inline float lg_emu_wmma_float(float v) { return v; }
inline float lg_emu_wmma_float(__nv_bfloat16 v) { return __bfloat162float(v); }
inline float lg_emu_wmma_float(__half v) { return __half2float(v); }

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

/* The tile of a fragment: matrix_a M x K, matrix_b K x N, accumulator M x N. */
template <typename Use, int M, int N, int K> struct lg_emu_tile;
template <int M, int N, int K> struct lg_emu_tile<matrix_a, M, N, K> {
    static constexpr int rows = M, cols = K;
};
template <int M, int N, int K> struct lg_emu_tile<matrix_b, M, N, K> {
    static constexpr int rows = K, cols = N;
};
template <int M, int N, int K> struct lg_emu_tile<accumulator, M, N, K> {
    static constexpr int rows = M, cols = N;
};

template <typename Use, int M, int N, int K, typename T, typename Layout = void> class fragment {
    static_assert((M == 16 && N == 16 && K == 16) || (M == 32 && N == 8 && K == 16) ||
                      (M == 8 && N == 32 && K == 16),
                  "the 16-bit WMMA shapes: m16n16k16, m32n8k16, m8n32k16");
    static_assert(std::is_same<Use, accumulator>::value
                      ? std::is_same<T, float>::value && std::is_same<Layout, void>::value
                      : (std::is_same<T, __nv_bfloat16>::value || std::is_same<T, __half>::value) &&
                            (std::is_same<Layout, row_major>::value ||
                             std::is_same<Layout, col_major>::value),
                  "emulated: bf16/fp16 matrix_a/b with a layout, float accumulators without");

public:
    typedef T element_type;
    typedef T storage_element_type;
    static constexpr int rows = lg_emu_tile<Use, M, N, K>::rows;
    static constexpr int cols = lg_emu_tile<Use, M, N, K>::cols;
    enum { num_elements = rows * cols };
    T x[num_elements];
};

/* Checks CUDA's requirements on a tile in memory. */
inline void lg_emu_wmma_check(const void *p, unsigned ldm, size_t element_bytes, const char *what) {
    if ((uintptr_t)p % 32) lg_emu_die("%s: pointer %p is not 32-byte aligned", what, p);
    if ((ldm * element_bytes) % 16)
        lg_emu_die("%s: leading dimension %u is not a multiple of 16 bytes", what, ldm);
}

/* Element (i, j) of a tile at p, leading dimension ldm. */
inline size_t lg_emu_wmma_at(int i, int j, unsigned ldm, bool row_major_) {
    return row_major_ ? (size_t)i * ldm + (size_t)j : (size_t)i + (size_t)j * ldm;
}

template <typename Use, int M, int N, int K, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, T, Layout> &a, const T *p, unsigned ldm) {
    static_assert(!std::is_same<Use, accumulator>::value, "accumulators load with a layout_t");
    __syncwarp();
    lg_emu_wmma_check(p, ldm, sizeof(T), "load_matrix_sync");
    typedef fragment<Use, M, N, K, T, Layout> F;
    for (int i = 0; i < F::rows; i++)
        for (int j = 0; j < F::cols; j++)
            a.x[i * F::cols + j] = p[lg_emu_wmma_at(i, j, ldm, std::is_same<Layout, row_major>::value)];
}

template <int M, int N, int K>
inline void load_matrix_sync(fragment<accumulator, M, N, K, float> &c, const float *p, unsigned ldm,
                             layout_t layout) {
    __syncwarp();
    lg_emu_wmma_check(p, ldm, sizeof(float), "load_matrix_sync");
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) c.x[i * N + j] = p[lg_emu_wmma_at(i, j, ldm, layout == mem_row_major)];
}

template <int M, int N, int K>
inline void store_matrix_sync(float *p, const fragment<accumulator, M, N, K, float> &c, unsigned ldm,
                              layout_t layout) {
    __syncwarp();
    lg_emu_wmma_check(p, ldm, sizeof(float), "store_matrix_sync");
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) p[lg_emu_wmma_at(i, j, ldm, layout == mem_row_major)] = c.x[i * N + j];
}

template <typename Use, int M, int N, int K, typename T, typename Layout>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout> &a, const T &v) {
    __syncwarp();
    for (int i = 0; i < fragment<Use, M, N, K, T, Layout>::num_elements; i++) a.x[i] = v;
}

/* mma_sync is a pure function of its operands' bits, and the lanes of a warp normally pass
   the same operands: each warp keeps its last call's operands and result, which a lane with
   equal operands copies instead of multiplying again (a lane with others computes its own). */
struct lg_emu_wmma_memo {
    std::vector<unsigned char> operands, result;
};
inline lg_emu_wmma_memo &lg_emu_wmma_memo_of_warp(int warp) {
    static lg_emu_wmma_memo memo[LG_EMU_MAX_THREADS / 32];
    return memo[warp];
}

/* d = a b + c (d may be c). */
template <int M, int N, int K, typename T, typename LA, typename LB>
inline void mma_sync(fragment<accumulator, M, N, K, float> &d, const fragment<matrix_a, M, N, K, T, LA> &a,
                     const fragment<matrix_b, M, N, K, T, LB> &b,
                     const fragment<accumulator, M, N, K, float> &c) {
    __syncwarp();
    const int shape[4] = {M, N, K, std::is_same<T, __half>::value};
    unsigned char operands[sizeof shape + sizeof a.x + sizeof b.x + sizeof c.x];
    memcpy(operands, shape, sizeof shape);
    memcpy(operands + sizeof shape, a.x, sizeof a.x);
    memcpy(operands + sizeof shape + sizeof a.x, b.x, sizeof b.x);
    memcpy(operands + sizeof shape + sizeof a.x + sizeof b.x, c.x, sizeof c.x);
    lg_emu_wmma_memo &memo = lg_emu_wmma_memo_of_warp(lg_emu_current_thread("mma_sync")->linear / 32);
    if (memo.operands.size() == sizeof operands && !memcmp(memo.operands.data(), operands, sizeof operands)) {
        memcpy(d.x, memo.result.data(), sizeof d.x);
        return;
    }
    float af[M * K], bf[K * N], out[M * N];
    for (int i = 0; i < M * K; i++) af[i] = lg_emu_wmma_float(a.x[i]);
    for (int i = 0; i < K * N; i++) bf[i] = lg_emu_wmma_float(b.x[i]);
    memcpy(out, c.x, sizeof out);
    for (int i = 0; i < M; i++) /* each out (i, j) sums its exact products in k order */
        for (int k = 0; k < K; k++)
            for (int j = 0; j < N; j++) out[i * N + j] += af[i * K + k] * bf[k * N + j];
    memo.operands.assign(operands, operands + sizeof operands);
    memo.result.assign((const unsigned char *)out, (const unsigned char *)out + sizeof out);
    memcpy(d.x, out, sizeof out);
}

} /* namespace wmma */
} /* namespace nvcuda */

/* ============================================================================================
   10. Inline PTX's stand-ins: mma.sync.aligned.m16n8k16 and cp.async
   ============================================================================================ */

/* mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32: D (16 x 8) = A (16 x 16) B
   (16 x 8) + C, float C and D. Which lane holds which element, as the PTX ISA documents ("Matrix
   fragments for mma.m16n8k16 with floating point type"), with groupID = lane >> 2 and
   tig = lane % 4 (threadID_in_group); 16-bit elements go two to a 32-bit register, the lower
   index in the lower half:
     A: a0..a7 in 4 registers: row groupID for a0, a1, a4, a5 and groupID + 8 for a2, a3, a6, a7;
        column tig 2 + (i & 1), plus 8 for a4..a7;
     B: b0..b3 in 2 registers: row tig 2 + (i & 1), plus 8 for b2, b3; column groupID;
     C, D: c0..c3 (floats): row groupID for c0, c1 and groupID + 8 for c2, c3; column
        tig 2 + (i & 1).
   The 16-bit products are exact in float; each output adds them to c in k order, rounding each
   sum to float (the tensor cores' internal order and rounding differ in the last bits). */
enum lg_emu_mma_type { LG_EMU_MMA_BF16, LG_EMU_MMA_F16 };
#define LG_EMU_MMA_M 16
#define LG_EMU_MMA_N 8
#define LG_EMU_MMA_K 16
inline int lg_emu_mma_a_row(int lane, int i) { return (lane >> 2) + ((i >> 1) & 1) * 8; }
inline int lg_emu_mma_a_col(int lane, int i) { return (lane & 3) * 2 + (i & 1) + (i >> 2) * 8; }
inline int lg_emu_mma_b_row(int lane, int i) { return (lane & 3) * 2 + (i & 1) + (i >> 1) * 8; }
inline int lg_emu_mma_b_col(int lane, int /* i */) { return lane >> 2; }
inline int lg_emu_mma_c_row(int lane, int i) { return (lane >> 2) + (i >> 1) * 8; }
inline int lg_emu_mma_c_col(int lane, int i) { return (lane & 3) * 2 + (i & 1); }

/* A warp's operands, gathered from its lanes for one mma. */
struct lg_emu_mma_operands {
    uint16_t a[LG_EMU_MMA_M][LG_EMU_MMA_K], b[LG_EMU_MMA_K][LG_EMU_MMA_N];
};
inline lg_emu_mma_operands &lg_emu_mma_operands_of_warp(int warp) {
    static lg_emu_mma_operands operands[LG_EMU_MAX_THREADS / 32];
    return operands[warp];
}
inline float lg_emu_mma_value(uint16_t bits, lg_emu_mma_type type) {
    return type == LG_EMU_MMA_BF16 ? lg_emu_bf16_to_float(bits) : lg_emu_fp16_to_float(bits);
}

/* One lane's part of the warp's mma: every lane of a whole warp calls it together (.aligned);
   d may be c. The lanes leave their elements in the warp's operands, meet, each computes its
   four outputs, and meet again before the operands can be overwritten. */
inline void lg_emu_mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2],
                                const float c[4], lg_emu_mma_type type,
                                const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    const lg_emu_scheduler &s = lg_emu_state().sched;
    const lg_emu_fiber *f = lg_emu_current_thread("mma.sync");
    int lane = f->linear % 32, warp = f->linear / 32;
    if (lg_emu_warp_lanes(s.threads, f->linear) != 0xffffffffu)
        lg_emu_die("mma.sync at %s:%d in a warp of fewer than 32 threads", file, line);
    lg_emu_mma_operands &w = lg_emu_mma_operands_of_warp(warp);
    for (int i = 0; i < 8; i++)
        w.a[lg_emu_mma_a_row(lane, i)][lg_emu_mma_a_col(lane, i)] =
            (uint16_t)(a[i / 2] >> (16 * (i & 1)));
    for (int i = 0; i < 4; i++)
        w.b[lg_emu_mma_b_row(lane, i)][lg_emu_mma_b_col(lane, i)] =
            (uint16_t)(b[i / 2] >> (16 * (i & 1)));
    __syncwarp(0xffffffffu, file, line);
    float out[4];
    for (int i = 0; i < 4; i++) {
        int row = lg_emu_mma_c_row(lane, i), col = lg_emu_mma_c_col(lane, i);
        float acc = c[i];
        for (int k = 0; k < LG_EMU_MMA_K; k++)
            acc += lg_emu_mma_value(w.a[row][k], type) * lg_emu_mma_value(w.b[k][col], type);
        out[i] = acc;
    }
    __syncwarp(0xffffffffu, file, line);
    memcpy(d, out, sizeof out);
}

/* ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.shared.b16: COUNT 8 x 8 matrices of 16-bit
   elements; lanes 8 i .. 8 i + 7 give the addresses of matrix i's rows (16 bytes each, 16-byte
   aligned), and register r[i] of lane L receives, as the PTX ISA documents, row L / 4, elements
   2 (L % 4) and 2 (L % 4) + 1 of matrix i (lower half first); with .trans, elements
   (2 (L % 4), L / 4) and (2 (L % 4) + 1, L / 4), i.e. those of the transposed matrix. */
struct lg_emu_ldmatrix_rows {
    const uint16_t *rows[32];
};
inline lg_emu_ldmatrix_rows &lg_emu_ldmatrix_of_warp(int warp) {
    static lg_emu_ldmatrix_rows rows[LG_EMU_MAX_THREADS / 32];
    return rows[warp];
}
inline void lg_emu_ldmatrix(uint32_t *r, int count, bool trans, const void *row,
                            const char *file = __builtin_FILE(), int line = __builtin_LINE()) {
    const lg_emu_scheduler &s = lg_emu_state().sched;
    const lg_emu_fiber *f = lg_emu_current_thread("ldmatrix");
    int lane = f->linear % 32, warp = f->linear / 32;
    if (lg_emu_warp_lanes(s.threads, f->linear) != 0xffffffffu)
        lg_emu_die("ldmatrix at %s:%d in a warp of fewer than 32 threads", file, line);
    if (count != 1 && count != 2 && count != 4) lg_emu_die("ldmatrix of %d matrices", count);
    if (lane < 8 * count && (uintptr_t)row % 16)
        lg_emu_die("ldmatrix at %s:%d: lane %d's row %p is not 16-byte aligned", file, line, lane, row);
    lg_emu_ldmatrix_rows &w = lg_emu_ldmatrix_of_warp(warp);
    w.rows[lane] = (const uint16_t *)row;
    __syncwarp(0xffffffffu, file, line);
    uint32_t out[4];
    for (int i = 0; i < count; i++) {
        const uint16_t *const *m = w.rows + 8 * i; /* matrix i's rows */
        int a = lane / 4, b = 2 * (lane % 4);
        out[i] = trans ? (uint32_t)m[b][a] | (uint32_t)m[b + 1][a] << 16
                       : (uint32_t)m[a][b] | (uint32_t)m[a][b + 1] << 16;
    }
    __syncwarp(0xffffffffu, file, line);
    memcpy(r, out, sizeof(uint32_t) * (size_t)count);
}

/* cp.async.{ca,cg}.shared.global [dst], [src], bytes, src_bytes: queued until a wait_group. */
inline void lg_emu_cp_async(void *dst, const void *src, unsigned bytes, unsigned src_bytes) {
    lg_emu_fiber *f = lg_emu_current_thread("cp.async");
    if ((bytes != 4 && bytes != 8 && bytes != 16) || src_bytes > bytes)
        lg_emu_die("cp.async of %u bytes (%u from the source)", bytes, src_bytes);
    if ((uintptr_t)dst % bytes || (uintptr_t)src % bytes)
        lg_emu_die("cp.async of %u bytes: %p or %p is not aligned to them", bytes, dst, src);
    f->async_open.push_back(lg_emu_async_copy{dst, src, bytes, src_bytes});
}

/* cp.async.commit_group: the thread's uncommitted copies become its newest group. */
inline void lg_emu_cp_async_commit(void) {
    lg_emu_fiber *f = lg_emu_current_thread("cp.async.commit_group");
    f->async_groups.push_back(std::move(f->async_open));
    f->async_open.clear();
}

/* cp.async.wait_group n: lands every group of the thread's but the newest n. */
inline void lg_emu_cp_async_wait(int n) {
    lg_emu_fiber *f = lg_emu_current_thread("cp.async.wait_group");
    while ((int)f->async_groups.size() > n) {
        for (const lg_emu_async_copy &c : f->async_groups.front()) {
            memcpy(c.dst, c.src, c.src_bytes);
            memset((unsigned char *)c.dst + c.src_bytes, 0, c.bytes - c.src_bytes);
        }
        f->async_groups.pop_front();
    }
}

#endif /* LG_CUDA_EMULATOR_H */
