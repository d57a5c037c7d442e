/* tests/test_cuda_emulator.cpp — self-test of tests/cuda_emulator.h (the CPU emulation of the
   CUDA backend's kernel language, runtime and NCCL subset). Includes only the emulator.

   g++ -std=c++17 -O1 -Wall -Wextra -Werror -DLG_CUDA_EMULATE tests/test_cuda_emulator.cpp \
       -o /tmp/emu_test && /tmp/emu_test */
#include "cuda_emulator.h"

#include <chrono>
#include <string>
#include <sys/wait.h>

static int passed, failed;

#define CHECK(cond)                                                                            \
    do {                                                                                       \
        if (cond) passed++;                                                                    \
        else {                                                                                 \
            failed++;                                                                          \
            fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond);                    \
        }                                                                                      \
    } while (0)

/* A device buffer of n values, filled from host values. */
template <typename T> static T *device_copy(const std::vector<T> &host) {
    T *d = nullptr;
    if (cudaMalloc(&d, host.size() * sizeof(T)) != cudaSuccess) abort();
    cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
    return d;
}
template <typename T> static std::vector<T> host_copy(const T *d, size_t n) {
    std::vector<T> host(n);
    cudaMemcpy(host.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost);
    return host;
}

/* ---------------------------------------------------------------------------------------------
   Kernels
   --------------------------------------------------------------------------------------------- */

/* Tree reduction in static shared memory; thread 0 adds the block's sum into *result. */
__global__ void block_sum_kernel(const float *x, int n, float *result) {
    __shared__ float partial[256];
    int t = (int)threadIdx.x, i = (int)(blockIdx.x * blockDim.x) + t;
    partial[t] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (int stride = (int)blockDim.x / 2; stride > 0; stride /= 2) {
        if (t < stride) partial[t] += partial[t + stride];
        __syncthreads();
    }
    if (t == 0) atomicAdd(result, partial[0]);
}

template <typename T> __device__ T warp_sum_xor(T v) {
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

/* Each warp reduces with shuffles; warp 0 alone then reduces the warps' sums. */
template <typename T> __global__ void warp_block_sum_kernel(const T *x, int n, T *result) {
    __shared__ T warp_sums[32];
    int t = (int)threadIdx.x, lane = t % 32, warp = t / 32, warps = (int)blockDim.x / 32;
    int i = (int)(blockIdx.x * blockDim.x) + t;
    T v = warp_sum_xor(i < n ? x[i] : T(0));
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? warp_sums[lane] : T(0);
        for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
        if (lane == 0) atomicAdd(result, v);
    }
}

/* out: [lane's broadcast of lane 5, inclusive scan with __shfl_up_sync, 16-wide xor sum, ballot] */
__global__ void warp_ops_kernel(int *out) {
    int lane = (int)threadIdx.x % 32;
    int from5 = __shfl_sync(0xffffffffu, lane * 10, 5);
    int scan = lane + 1;
    for (int d = 1; d < 32; d *= 2) {
        int up = __shfl_up_sync(0xffffffffu, scan, (unsigned)d);
        if (lane >= d) scan += up;
    }
    int half = lane;
    for (int offset = 8; offset > 0; offset /= 2) half += __shfl_xor_sync(0xffffffffu, half, offset, 16);
    unsigned ballot = __ballot_sync(0xffffffffu, lane % 3 == 0);
    int all = __all_sync(0xffffffffu, lane < 32), any = __any_sync(0xffffffffu, lane == 31);
    __syncwarp();
    int t = (int)threadIdx.x;
    out[t * 5 + 0] = from5;
    out[t * 5 + 1] = scan;
    out[t * 5 + 2] = half;
    out[t * 5 + 3] = (int)ballot;
    out[t * 5 + 4] = all * 2 + any;
}

/* Reverses each block's slice through dynamic shared memory. */
__global__ void reverse_kernel(const float *x, float *y, int *misaligned) {
    LG_SHARED_DYNAMIC(float, tile);
    int t = (int)threadIdx.x, n = (int)blockDim.x, base = (int)blockIdx.x * n;
    if (((uintptr_t)tile & 15) != 0) *misaligned = 1;
    tile[n - 1 - t] = x[base + t];
    __syncthreads();
    y[base + t] = tile[t];
}

/* Reads a neighbour's shared slot: correct only with the barrier. */
template <bool with_barrier> __global__ void neighbour_kernel(const int *x, int *y) {
    __shared__ int slot[64];
    int t = (int)threadIdx.x, n = (int)blockDim.x;
    slot[t] = x[t];
    if (with_barrier) __syncthreads();
    y[t] = slot[(t + 1) % n];
}

template <typename T, int scale> __global__ void scale_kernel(T *x, int n) {
    int i = (int)(blockIdx.x * blockDim.x + threadIdx.x);
    if (i < n) x[i] *= (T)scale;
}

/* Records each thread's global coordinates (3-D grid of 3-D blocks). */
__global__ void coordinates_kernel(int *out) {
    unsigned bx = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    unsigned tx = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    unsigned threads = blockDim.x * blockDim.y * blockDim.z;
    out[bx * threads + tx] += (int)(bx * 1000 + tx) + 1;
}

__global__ void atomics_kernel(int *max_value, unsigned *cas_winner, int *exchanged, int *count) {
    int t = (int)threadIdx.x;
    atomicMax(max_value, (t * 37) % 101);
    atomicCAS(cas_winner, 0xffffffffu, (unsigned)t);
    atomicExch(exchanged, t);
    int total = __syncthreads_count(t % 4 == 0);
    if (t == 0) *count = total;
}

/* Thread 0 leaves before the barrier the others wait at: a deadlock. */
__global__ void early_return_kernel(int *y) {
    if (threadIdx.x == 0) return;
    __syncthreads();
    y[threadIdx.x] = 1;
}

/* Even threads wait at one __syncthreads, odd threads at another. */
__global__ void divergent_barrier_kernel(int *y) {
    if (threadIdx.x % 2) __syncthreads();
    else __syncthreads();
    y[threadIdx.x] = 1;
}

__global__ void deep_stack_kernel(int *y) {
    int local[1024]; /* 4 KiB of locals on each thread's fiber stack */
    for (int i = 0; i < 1024; i++) local[i] = i * (int)threadIdx.x;
    __syncthreads();
    int sum = 0;
    for (int i = 0; i < 1024; i++) sum += local[i];
    y[threadIdx.x] = sum;
}

__global__ void no_args_kernel(void) {
    __shared__ int hits;
    if (threadIdx.x == 0) hits = 0;
    __syncthreads();
    atomicAdd(&hits, 1);
}

/* C (32, 48) = A (32, 16) B (16, 48) + C, one warp: A bf16 or fp16, row-major (ld 16); B stored
   transposed, Bt (48, 16), read as col_major; C float, row-major (ld 48). 2 x 3 tiles of 16. */
template <typename T> __global__ void wmma_kernel(float *c, const T *a, const T *bt) {
    using namespace nvcuda;
    for (int ti = 0; ti < 2; ti++)
        for (int tj = 0; tj < 3; tj++) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::load_matrix_sync(acc, c + ti * 16 * 48 + tj * 16, 48, wmma::mem_row_major);
            wmma::load_matrix_sync(fa, a + ti * 16 * 16, 16);
            wmma::load_matrix_sync(fb, bt + tj * 16 * 16, 16);
            wmma::mma_sync(acc, fa, fb, acc);
            for (int i = 0; i < acc.num_elements; i++) acc.x[i] *= 2.0f; /* uniform: any layout */
            wmma::store_matrix_sync(c + ti * 16 * 48 + tj * 16, acc, 48, wmma::mem_row_major);
        }
}

/* One mma.sync.m16n8k16 of a warp: d (16 x 8) = a (16 x 16) b (16 x 8) + c, all row-major in
   memory, each lane loading and storing exactly the elements the PTX ISA assigns it (written out
   here from the ISA's tables, apart from the emulator's own helpers). */
__global__ void mma_kernel(float *d, const uint16_t *a, const uint16_t *b, const float *c,
                           lg_emu_mma_type type) {
    int lane = (int)threadIdx.x % 32, group = lane / 4, tig = lane % 4;
    uint32_t af[4] = {0, 0, 0, 0}, bf[2] = {0, 0};
    float cf[4], df[4];
    for (int i = 0; i < 8; i++) { /* a0, a1 (row g), a2, a3 (row g + 8), a4..a7 (columns + 8) */
        int row = i == 0 || i == 1 || i == 4 || i == 5 ? group : group + 8;
        int col = tig * 2 + i % 2 + (i >= 4 ? 8 : 0);
        af[i / 2] |= (uint32_t)a[row * 16 + col] << (i % 2 * 16);
    }
    for (int i = 0; i < 4; i++) { /* b0, b1 (rows 2 tig, 2 tig + 1), b2, b3 (+ 8); column g */
        int row = tig * 2 + i % 2 + (i >= 2 ? 8 : 0);
        bf[i / 2] |= (uint32_t)b[row * 8 + group] << (i % 2 * 16);
    }
    for (int i = 0; i < 4; i++) cf[i] = c[(i < 2 ? group : group + 8) * 8 + tig * 2 + i % 2];
    lg_emu_mma_m16n8k16(df, af, bf, cf, type);
    for (int i = 0; i < 4; i++) d[(i < 2 ? group : group + 8) * 8 + tig * 2 + i % 2] = df[i];
}

/* ldmatrix: a 16 x 16 tile of distinct values in shared memory; out gets, per lane, the four
   registers of an .x4 load of its 8 x 8 quarters (rows 0-7 | 8-15 x columns 0-7 | 8-15) and
   the two of an .x2.trans load of its first 8 columns. */
__global__ void ldmatrix_kernel(uint32_t *out, const uint16_t *tile) {
    __shared__ __align__(16) uint16_t s[16 * 16];
    int lane = (int)threadIdx.x;
    for (int i = lane; i < 256; i += 32) s[i] = tile[i];
    __syncthreads();
    uint32_t r[4], t[2];
    int quarter = lane / 8, row = lane % 8 + (quarter % 2) * 8, col = quarter / 2 * 8;
    lg_emu_ldmatrix(r, 4, false, s + row * 16 + col);
    lg_emu_ldmatrix(t, 2, true, s + (lane % 16) * 16);
    for (int i = 0; i < 4; i++) out[lane * 6 + i] = r[i];
    for (int i = 0; i < 2; i++) out[lane * 6 + 4 + i] = t[i];
}

/* cp.async: each of 32 threads copies 16 bytes into tile 0 (group 0), then 8 bytes zero-filled
   to 16 into tile 1 (group 1); out gets both tiles after wait_group 1, then after wait_group 0. */
__global__ void cp_async_kernel(uint32_t *out, const uint32_t *src) {
    LG_SHARED_DYNAMIC(uint32_t, tiles); /* 2 x (32 x 4) words */
    int t = (int)threadIdx.x;
    lg_emu_cp_async(tiles + 4 * t, src + 4 * t, 16, 16);
    lg_emu_cp_async_commit();
    lg_emu_cp_async(tiles + 128 + 4 * t, src + 128 + 4 * t, 16, 8);
    lg_emu_cp_async_commit();
    lg_emu_cp_async_wait(1);
    for (int k = 0; k < 4; k++) out[4 * t + k] = tiles[4 * t + k], out[128 + 4 * t + k] = tiles[128 + 4 * t + k];
    lg_emu_cp_async_wait(0);
    for (int k = 0; k < 4; k++) out[256 + 4 * t + k] = tiles[128 + 4 * t + k];
}

/* ---------------------------------------------------------------------------------------------
   Tests
   --------------------------------------------------------------------------------------------- */

static void test_block_reduction(void) {
    const int n = 1000;
    std::vector<float> x(n);
    for (int i = 0; i < n; i++) x[i] = (float)(i + 1);
    float *dx = device_copy(x), *dsum = device_copy(std::vector<float>{0.0f});
    for (int reverse = 0; reverse < 2; reverse++) {
        lg_emu_set_order(reverse);
        cudaMemset(dsum, 0, sizeof(float));
        LG_LAUNCH(block_sum_kernel, (n + 255) / 256, 256, 0, nullptr, dx, n, dsum);
        CHECK(host_copy(dsum, 1)[0] == 500500.0f);
    }
    lg_emu_set_order(0);
    CHECK(cudaGetLastError() == cudaSuccess);
    cudaFree(dx);
    cudaFree(dsum);
}

static void test_warp_reduction(void) {
    const int n = 3000; /* 12 blocks of 256 */
    std::vector<float> xf(n);
    std::vector<double> xd(n);
    std::vector<int> xi(n);
    for (int i = 0; i < n; i++) xf[i] = (float)(i % 7), xd[i] = 0.5 * i, xi[i] = i - 100;
    float *df = device_copy(xf), *sf = device_copy(std::vector<float>{0});
    double *dd = device_copy(xd), *sd = device_copy(std::vector<double>{0});
    int *di = device_copy(xi), *si = device_copy(std::vector<int>{0});
    LG_LAUNCH((warp_block_sum_kernel<float>), (n + 255) / 256, 256, 0, 0, df, n, sf);
    LG_LAUNCH((warp_block_sum_kernel<double>), (n + 255) / 256, 256, 0, 0, dd, n, sd);
    LG_LAUNCH(warp_block_sum_kernel<int>, (n + 255) / 256, 256, 0, 0, di, n, si);
    float want_f = 0;
    for (float v : xf) want_f += v;
    CHECK(host_copy(sf, 1)[0] == want_f);
    CHECK(host_copy(sd, 1)[0] == 0.5 * (n - 1) * n / 2);
    CHECK(host_copy(si, 1)[0] == (n - 1) * n / 2 - 100 * n);
    cudaFree(df), cudaFree(sf), cudaFree(dd), cudaFree(sd), cudaFree(di), cudaFree(si);
}

static void test_warp_ops(void) {
    const int threads = 64;
    int *d = device_copy(std::vector<int>(threads * 5, 0));
    LG_LAUNCH(warp_ops_kernel, 1, threads, 0, nullptr, d);
    std::vector<int> out = host_copy(d, threads * 5);
    bool ok = true;
    unsigned ballot = 0;
    for (int lane = 0; lane < 32; lane += 3) ballot |= 1u << lane;
    for (int t = 0; t < threads; t++) {
        int lane = t % 32, segment = lane / 16 * 16;
        ok = ok && out[t * 5 + 0] == 50;
        ok = ok && out[t * 5 + 1] == (lane + 1) * (lane + 2) / 2;
        ok = ok && out[t * 5 + 2] == 16 * segment + 120; /* sum of the 16 lanes of the segment */
        ok = ok && (unsigned)out[t * 5 + 3] == ballot;
        ok = ok && out[t * 5 + 4] == 3;
    }
    CHECK(ok);
    cudaFree(d);
}

static void test_dynamic_shared(void) {
    const int block = 128, blocks = 5;
    std::vector<float> x(block * blocks);
    for (size_t i = 0; i < x.size(); i++) x[i] = (float)i;
    float *dx = device_copy(x), *dy = device_copy(std::vector<float>(x.size(), 0));
    int *misaligned = device_copy(std::vector<int>{0});
    LG_LAUNCH(reverse_kernel, blocks, block, block * sizeof(float), nullptr, dx, dy, misaligned);
    std::vector<float> y = host_copy(dy, x.size());
    bool ok = true;
    for (int b = 0; b < blocks; b++)
        for (int t = 0; t < block; t++) ok = ok && y[(size_t)(b * block + t)] == x[(size_t)(b * block + block - 1 - t)];
    CHECK(ok);
    CHECK(host_copy(misaligned, 1)[0] == 0);
    cudaFree(dx), cudaFree(dy), cudaFree(misaligned);
}

/* The missing barrier shows as different results in the two thread orders. */
static std::vector<int> run_neighbour(bool with_barrier, int reverse) {
    const int n = 64;
    std::vector<int> zeros(n, 0), values(n);
    for (int i = 0; i < n; i++) values[(size_t)i] = i + 1;
    int *dz = device_copy(zeros), *dx = device_copy(values), *dy = device_copy(zeros);
    lg_emu_set_order(reverse);
    /* first clear the shared slots, so stale values are zeros */
    if (with_barrier) LG_LAUNCH(neighbour_kernel<true>, 1, n, 0, nullptr, dz, dy);
    else LG_LAUNCH(neighbour_kernel<false>, 1, n, 0, nullptr, dz, dy);
    if (with_barrier) LG_LAUNCH(neighbour_kernel<true>, 1, n, 0, nullptr, dx, dy);
    else LG_LAUNCH(neighbour_kernel<false>, 1, n, 0, nullptr, dx, dy);
    lg_emu_set_order(0);
    std::vector<int> y = host_copy(dy, n);
    cudaFree(dz), cudaFree(dx), cudaFree(dy);
    return y;
}

static void test_missing_barrier_detection(void) {
    std::vector<int> want(64);
    for (int t = 0; t < 64; t++) want[(size_t)t] = (t + 1) % 64 + 1;
    CHECK(run_neighbour(true, 0) == want);
    CHECK(run_neighbour(true, 1) == want);
    std::vector<int> forward = run_neighbour(false, 0), reverse = run_neighbour(false, 1);
    CHECK(forward != reverse);
    CHECK(forward != want || reverse != want);
}

static void test_template_launch(void) {
    const int n = 300;
    std::vector<float> x(n, 1.5f);
    float *d = device_copy(x);
    LG_LAUNCH((scale_kernel<float, 4>), (n + 127) / 128, 128, 0, nullptr, d, n);
    std::vector<float> y = host_copy(d, n);
    bool ok = true;
    for (float v : y) ok = ok && v == 6.0f;
    CHECK(ok);
    cudaFree(d);
}

static void test_grid_coordinates(void) {
    dim3 grid(3, 2, 2), block(4, 2, 3);
    size_t total = 12 * 24;
    int *d = device_copy(std::vector<int>(total, 0));
    unsigned long long before = lg_emu_launch_count();
    LG_LAUNCH(coordinates_kernel, grid, block, 0, nullptr, d);
    CHECK(lg_emu_launch_count() == before + 1);
    std::vector<int> out = host_copy(d, total);
    bool ok = true;
    for (size_t i = 0; i < total; i++) ok = ok && out[i] == (int)((i / 24) * 1000 + i % 24) + 1;
    CHECK(ok);
    cudaFree(d);
}

static void test_atomics_and_misc(void) {
    int *max_value = device_copy(std::vector<int>{-1}), *exchanged = device_copy(std::vector<int>{-1});
    int *count = device_copy(std::vector<int>{0});
    unsigned *cas = device_copy(std::vector<unsigned>{0xffffffffu});
    LG_LAUNCH(atomics_kernel, 1, 96, 0, nullptr, max_value, cas, exchanged, count);
    CHECK(host_copy(max_value, 1)[0] == 100);
    CHECK(host_copy(cas, 1)[0] == 0u);         /* thread 0 runs first */
    CHECK(host_copy(exchanged, 1)[0] == 95);   /* the last to run */
    CHECK(host_copy(count, 1)[0] == 24);
    lg_emu_set_order(1);
    cudaMemset(cas, 0xff, sizeof(unsigned));
    LG_LAUNCH(atomics_kernel, 1, 96, 0, nullptr, max_value, cas, exchanged, count);
    lg_emu_set_order(0);
    CHECK(host_copy(cas, 1)[0] == 95u);
    int *deep = device_copy(std::vector<int>(64, 0));
    LG_LAUNCH(deep_stack_kernel, 2, 64, 0, nullptr, deep);
    CHECK(host_copy(deep, 64)[5] == 5 * 1023 * 1024 / 2);
    LG_LAUNCH(no_args_kernel, 2, 32, 0, nullptr);
    CHECK(min(3, 4u) == 3u && max(2.5f, -1.0f) == 2.5f && min((size_t)7, 9) == 7);
    CHECK(__float_as_uint(1.0f) == 0x3f800000u && __uint_as_float(0x40000000u) == 2.0f);
    CHECK(rsqrtf(4.0f) == 0.5f && __saturatef(1.5f) == 1.0f && __saturatef(NAN) == 0.0f);
    cudaFree(max_value), cudaFree(exchanged), cudaFree(count), cudaFree(cas), cudaFree(deep);
}

static void test_launch_refusals(void) {
    int *d = device_copy(std::vector<int>(64, 0));
    fprintf(stderr, "(two refused launches expected:)\n");
    LG_LAUNCH(deep_stack_kernel, 1, 2048, 0, nullptr, d);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
    CHECK(cudaGetLastError() == cudaSuccess);
    cudaStream_t s;
    cudaStreamCreate(&s);
    cudaStreamDestroy(s);
    LG_LAUNCH(deep_stack_kernel, 1, 64, 0, s, d);
    CHECK(cudaPeekAtLastError() == cudaErrorInvalidResourceHandle);
    cudaGetLastError();
    cudaFree(d);
}

/* A copy of reverse_kernel: a kernel that has not opted into more shared memory. */
__global__ void reverse_kernel_unset(const float *x, float *y, int *misaligned) {
    reverse_kernel(x, y, misaligned);
}

/* The architecture's shared memory a block (LG_EMU_ARCH): sm_86 (RTX 30xx, A10) refuses more
   than 101,376 bytes at cudaFuncSetAttribute and at launch, sm_90 takes 232,448; a launch
   over 48 KiB needs the kernel's own cudaFuncSetAttribute on the device. */
static void test_shared_limits(void) {
    const int block = 64;
    std::vector<float> x(block, 1.0f);
    float *dx = device_copy(x), *dy = device_copy(std::vector<float>(x.size(), 0));
    int *misaligned = device_copy(std::vector<int>{0}), optin = 0, major = 0, minor = 0;
    lg_emu_set_arch("sm_86");
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
    CHECK(optin == 101376 && major == 8 && minor == 6);
    CHECK(cudaFuncSetAttribute(reverse_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 101377) ==
          cudaErrorInvalidValue);
    cudaGetLastError();
    CHECK(cudaFuncSetAttribute(reverse_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 101376) ==
          cudaSuccess);
    LG_LAUNCH(reverse_kernel, 1, block, 101376, nullptr, dx, dy, misaligned);
    CHECK(cudaGetLastError() == cudaSuccess && host_copy(dy, 1)[0] == 1.0f);
    fprintf(stderr, "(three refused launches expected:)\n");
    LG_LAUNCH(reverse_kernel, 1, block, 101377, nullptr, dx, dy, misaligned);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
    LG_LAUNCH(reverse_kernel_unset, 1, block, 49153, nullptr, dx, dy, misaligned);
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
    lg_emu_set_arch("sm_90");
    LG_LAUNCH(reverse_kernel, 1, block, 200000, nullptr, dx, dy, misaligned); /* 101,376 allowed */
    CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
    CHECK(cudaFuncSetAttribute(reverse_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 232448) ==
          cudaSuccess);
    LG_LAUNCH(reverse_kernel, 1, block, 232448, nullptr, dx, dy, misaligned);
    CHECK(cudaGetLastError() == cudaSuccess);
    LG_LAUNCH(reverse_kernel_unset, 1, block, 49152, nullptr, dx, dy, misaligned); /* no opt-in needed */
    CHECK(cudaGetLastError() == cudaSuccess);
    lg_emu_set_arch(getenv("LG_EMU_ARCH"));
    cudaFree(dx), cudaFree(dy), cudaFree(misaligned);
}

/* Runs `body` in a child process; returns its exit status and what it wrote to stderr. */
template <typename F> static int run_in_child(F body, std::string *stderr_text) {
    int pipe_fds[2];
    if (pipe(pipe_fds) != 0) abort();
    fflush(stdout), fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(pipe_fds[1], 2);
        close(pipe_fds[0]);
        body();
        _exit(0);
    }
    close(pipe_fds[1]);
    char buf[512];
    ssize_t got;
    while ((got = read(pipe_fds[0], buf, sizeof buf)) > 0) stderr_text->append(buf, (size_t)got);
    close(pipe_fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    return status;
}

static void test_deadlock_detection(void) {
    std::string text;
    int status = run_in_child([] {
        int *d = nullptr;
        cudaMalloc(&d, 64 * sizeof(int));
        LG_LAUNCH(early_return_kernel, 1, 64, 0, nullptr, d);
    }, &text);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT);
    CHECK(text.find("deadlock in kernel early_return_kernel") != std::string::npos);
    CHECK(text.find("test_cuda_emulator.cpp") != std::string::npos);
    text.clear();
    status = run_in_child([] {
        int *d = nullptr;
        cudaMalloc(&d, 64 * sizeof(int));
        LG_LAUNCH(divergent_barrier_kernel, 1, 64, 0, nullptr, d);
    }, &text);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT);
    CHECK(text.find("thread 1 at the one at") != std::string::npos);
}

static void test_memory_accounting(void) {
    lg_emu_set_devices(2);
    size_t free0, total0, free1, total1, f, t;
    cudaSetDevice(0);
    cudaMemGetInfo(&free0, &total0);
    cudaSetDevice(1);
    cudaMemGetInfo(&free1, &total1);
    CHECK(total0 == ((size_t)16 << 30) && free0 == total0 && free1 == total1);
    void *a = nullptr, *b = nullptr, *h = nullptr;
    cudaSetDevice(0);
    CHECK(cudaMalloc(&a, 1 << 20) == cudaSuccess);
    cudaSetDevice(1);
    CHECK(cudaMallocManaged(&b, 3000, cudaMemAttachGlobal) == cudaSuccess);
    CHECK(cudaMallocHost(&h, 5000) == cudaSuccess);
    cudaMemGetInfo(&f, &t);
    CHECK(f == free1 - 3000);
    cudaSetDevice(0);
    cudaMemGetInfo(&f, &t);
    CHECK(f == free0 - (1 << 20));
    CHECK(lg_emu_device_bytes_in_use(0) == (1 << 20) && lg_emu_device_bytes_in_use(1) == 3000);
    cudaPointerAttributes pa, pb, ph, pu;
    int stack_value = 0;
    cudaPointerGetAttributes(&pa, (char *)a + 10);
    cudaPointerGetAttributes(&pb, b);
    cudaPointerGetAttributes(&ph, h);
    cudaPointerGetAttributes(&pu, &stack_value);
    CHECK(pa.type == cudaMemoryTypeDevice && pa.device == 0 && pb.type == cudaMemoryTypeManaged &&
          pb.device == 1 && ph.type == cudaMemoryTypeHost && pu.type == cudaMemoryTypeUnregistered);
    CHECK(cudaMemset(a, 0, (1 << 20) + 1) == cudaErrorInvalidValue); /* past the allocation */
    CHECK(cudaFreeHost(a) == cudaErrorInvalidValue);                 /* not a host allocation */
    cudaGetLastError();
    CHECK(cudaFree(a) == cudaSuccess && cudaFree(b) == cudaSuccess && cudaFreeHost(h) == cudaSuccess);
    cudaMemGetInfo(&f, &t);
    CHECK(f == free0);
    void *huge = nullptr;
    CHECK(cudaMalloc(&huge, total0 + 1) == cudaErrorMemoryAllocation && huge == nullptr);
    CHECK(cudaGetLastError() == cudaErrorMemoryAllocation && cudaGetLastError() == cudaSuccess);
    CHECK(cudaSetDevice(2) == cudaErrorInvalidDevice);
    cudaGetLastError();
    int can = 0, rank = -1, major = 0;
    cudaDeviceCanAccessPeer(&can, 0, 1);
    cudaDeviceGetP2PAttribute(&rank, cudaDevP2PAttrPerformanceRank, 0, 1);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 1);
    CHECK(can == 1 && rank == 0 && major == 9);
    CHECK(cudaDeviceEnablePeerAccess(1, 0) == cudaSuccess);
    CHECK(cudaDeviceEnablePeerAccess(1, 0) == cudaErrorPeerAccessAlreadyEnabled);
    cudaGetLastError();
    cudaEvent_t e0, e1;
    cudaStream_t s1;
    cudaSetDevice(1);
    cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking);
    cudaEventCreateWithFlags(&e1, cudaEventDisableTiming);
    cudaSetDevice(0);
    cudaEventCreate(&e0);
    CHECK(cudaEventRecord(e1, s1) == cudaSuccess && cudaStreamWaitEvent(nullptr, e1, 0) == cudaSuccess);
    CHECK(cudaEventRecord(e0, s1) == cudaErrorInvalidResourceHandle); /* event of another device */
    cudaGetLastError();
    cudaEventDestroy(e0), cudaEventDestroy(e1), cudaStreamDestroy(s1);
    lg_emu_set_devices(1);
}

__global__ void overrun_kernel(int *d, int n) { d[n + threadIdx.x] = 1; }

/* Device memory is the GPU's: the host touching it stops the program naming the allocation,
   kernels and copies reach it, managed memory stays the host's too, and a kernel that runs
   past an allocation's 256-byte rounding faults. */
static void test_host_visits(void) {
    std::string text;
    int status = run_in_child([] {
        int *d = nullptr;
        cudaMalloc(&d, 100 * sizeof(int));
        d[7] = 1;
    }, &text);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT);
    CHECK(text.find("host code touched device memory") != std::string::npos);
    CHECK(text.find("byte 28 of a cudaMalloc of 400 bytes on GPU 0") != std::string::npos);
    text.clear();
    status = run_in_child([] { /* a read after a kernel: closed again */
        int *d = device_copy(std::vector<int>(64, 3));
        LG_LAUNCH(early_return_kernel, 1, 1, 0, nullptr, d);
        volatile int x = d[0];
        (void)x;
    }, &text);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT);
    CHECK(text.find("host code touched device memory") != std::string::npos);
    status = run_in_child([] {
        int *d = nullptr;
        cudaMalloc(&d, 64 * sizeof(int)); /* 256 bytes: a thread past them hits the guard page */
        LG_LAUNCH(overrun_kernel, 1, 1, 0, nullptr, d, 64);
    }, &text);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV);
    std::vector<int> values(300, 5);
    int *d = device_copy(values), *m = nullptr;
    CHECK((uintptr_t)d % 256 == 0);
    CHECK(host_copy(d, 300) == values);
    CHECK(cudaMallocManaged(&m, 8 * sizeof(int), cudaMemAttachGlobal) == cudaSuccess);
    m[3] = 4; /* managed memory: the host may */
    CHECK(m[3] == 4);
    cudaFree(d), cudaFree(m);
}

static void test_half_conversions(void) {
    CHECK(lg_emu_float_to_bf16(1.0f) == 0x3f80 && lg_emu_bf16_to_float(0xc000) == -2.0f);
    CHECK(lg_emu_float_to_bf16(1.0f + 1.0f / 256) == 0x3f80);     /* tie: to even */
    CHECK(lg_emu_float_to_bf16(1.0f + 3.0f / 256) == 0x3f82);     /* tie: to even, up */
    CHECK(lg_emu_float_to_fp16(1.0f) == 0x3c00 && lg_emu_fp16_to_float(0xc000) == -2.0f);
    CHECK(lg_emu_float_to_fp16(65504.0f) == 0x7bff && lg_emu_float_to_fp16(65520.0f) == 0x7c00);
    CHECK(lg_emu_float_to_fp16(1.0f + 1.0f / 2048) == 0x3c00);    /* tie: to even */
    CHECK(lg_emu_float_to_fp16(5.960464477539063e-8f) == 0x0001); /* smallest subnormal */
    CHECK(lg_emu_fp16_to_float(0x0001) == 5.960464477539063e-8f);
    CHECK(lg_emu_float_to_fp16(2.9802322387695312e-8f) == 0x0000); /* half of it: to even */
    bool round_trip = true;
    for (uint32_t h = 0; h < 0x7c00; h++) round_trip = round_trip && lg_emu_float_to_fp16(lg_emu_fp16_to_float((uint16_t)h)) == h;
    CHECK(round_trip);
}

/* wmma_kernel against a CPU loop (the same order of sums: bitwise equal), both 16-bit types. */
template <typename T> static void test_wmma_type(T (*from_float)(float), float (*to_float)(T)) {
    const int M = 32, N = 48, K = 16;
    std::vector<T> a(M * K), bt(N * K);
    std::vector<float> c(M * N), want(M * N);
    for (int i = 0; i < M * K; i++) a[i] = from_float((float)((i * 7) % 23 - 11) / 8.0f);
    for (int i = 0; i < N * K; i++) bt[i] = from_float((float)((i * 5) % 19 - 9) / 16.0f + 0.001f * i);
    for (int i = 0; i < M * N; i++) c[i] = (float)(i % 13) / 4.0f - 1.5f;
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float s = c[i * N + j];
            for (int k = 0; k < K; k++) s += to_float(a[i * K + k]) * to_float(bt[j * K + k]);
            want[i * N + j] = 2.0f * s;
        }
    T *da = device_copy(a), *db = device_copy(bt);
    for (int reverse = 0; reverse < 2; reverse++) {
        lg_emu_set_order(reverse);
        float *dc = device_copy(c);
        LG_LAUNCH((wmma_kernel<T>), 1, 32, 0, nullptr, dc, da, db);
        CHECK(host_copy(dc, M * N) == want);
        cudaFree(dc);
    }
    lg_emu_set_order(0);
    cudaFree(da), cudaFree(db);
}

static void test_wmma(void) {
    test_wmma_type<__nv_bfloat16>(__float2bfloat16, __bfloat162float);
    test_wmma_type<__half>(__float2half, __half2float);
    CHECK(__bfloat162float(__float2bfloat16(1.0f + 1.0f / 256)) == 1.0f); /* to nearest even */
    CHECK(__half2float(__float2half(1.0f + 3.0f / 2048)) == 1.0f + 4.0f / 2048);
}

/* mma_kernel against a plain loop, element by element, both 16-bit types: small integers and
   halves, so every product and sum is exact and the two must agree bit for bit; each element of
   a, b and c distinct, so a lane holding another element than the ISA says shows. */
static void test_mma_type(lg_emu_mma_type type, uint16_t (*from_float)(float)) {
    const int M = 16, N = 8, K = 16;
    std::vector<uint16_t> a(M * K), b(K * N);
    std::vector<float> af(M * K), bf(K * N), c(M * N);
    for (int i = 0; i < M * K; i++) af[i] = (float)(i % 37 - 18) / 2.0f, a[i] = from_float(af[i]);
    for (int i = 0; i < K * N; i++) bf[i] = (float)(i % 29 - 14), b[i] = from_float(bf[i]);
    for (int i = 0; i < M * N; i++) c[i] = (float)(i * 3 % 41) - 20.0f;
    uint16_t *da = device_copy(a), *db = device_copy(b);
    float *dc = device_copy(c), *dd = nullptr;
    cudaMalloc(&dd, sizeof(float) * M * N);
    for (int reverse = 0; reverse < 2; reverse++) {
        lg_emu_set_order(reverse);
        LG_LAUNCH(mma_kernel, 1, 64, 0, nullptr, dd, da, db, dc, type); /* two warps, same work */
        std::vector<float> d = host_copy(dd, M * N);
        int wrong = 0;
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) {
                float want = c[i * N + j];
                for (int k = 0; k < K; k++) want += af[i * K + k] * bf[k * N + j];
                wrong += d[i * N + j] != want;
            }
        CHECK(wrong == 0);
    }
    lg_emu_set_order(0);
    cudaFree(da), cudaFree(db), cudaFree(dc), cudaFree(dd);
}

static void test_mma(void) {
    test_mma_type(LG_EMU_MMA_BF16, lg_emu_float_to_bf16);
    test_mma_type(LG_EMU_MMA_F16, lg_emu_float_to_fp16);
    /* the documented layouts: each of a's 256, b's 128 and c's 128 elements held by one lane */
    std::set<int> as, bs, cs;
    for (int lane = 0; lane < 32; lane++) {
        for (int i = 0; i < 8; i++) as.insert(lg_emu_mma_a_row(lane, i) * 16 + lg_emu_mma_a_col(lane, i));
        for (int i = 0; i < 4; i++) bs.insert(lg_emu_mma_b_row(lane, i) * 8 + lg_emu_mma_b_col(lane, i));
        for (int i = 0; i < 4; i++) cs.insert(lg_emu_mma_c_row(lane, i) * 8 + lg_emu_mma_c_col(lane, i));
    }
    CHECK(as.size() == 256 && bs.size() == 128 && cs.size() == 128);
    CHECK(lg_emu_mma_a_row(5, 2) == 9 && lg_emu_mma_a_col(5, 5) == 11 && lg_emu_mma_b_row(7, 3) == 15);
}

/* Each lane's registers against the ISA's assignment, written out: .x4 register i of lane L
   holds row L / 4, columns 2 (L % 4) and + 1 of quarter i; .x2.trans register i holds rows
   8 i + 2 (L % 4) and + 1 of column L / 4. */
static void test_ldmatrix(void) {
    std::vector<uint16_t> tile(256);
    for (int i = 0; i < 256; i++) tile[i] = (uint16_t)(1000 + i);
    uint16_t *dtile = device_copy(tile);
    uint32_t *dout = nullptr;
    cudaMalloc(&dout, sizeof(uint32_t) * 32 * 6);
    LG_LAUNCH(ldmatrix_kernel, 1, 32, 0, nullptr, dout, dtile);
    std::vector<uint32_t> out = host_copy(dout, 32 * 6);
    int wrong = 0;
    for (int lane = 0; lane < 32; lane++) {
        for (int i = 0; i < 4; i++) {
            int row = lane / 4 + (i % 2) * 8, col = 2 * (lane % 4) + i / 2 * 8;
            wrong += out[lane * 6 + i] != ((uint32_t)tile[row * 16 + col] | (uint32_t)tile[row * 16 + col + 1] << 16);
        }
        for (int i = 0; i < 2; i++) {
            int row = 8 * i + 2 * (lane % 4), col = lane / 4;
            wrong += out[lane * 6 + 4 + i] != ((uint32_t)tile[row * 16 + col] | (uint32_t)tile[(row + 1) * 16 + col] << 16);
        }
    }
    CHECK(wrong == 0);
    cudaFree(dtile), cudaFree(dout);
}

/* Copies land at their wait_group: group 1 (newest) is still pending after wait_group 1. */
static void test_cp_async(void) {
    std::vector<uint32_t> src(256);
    for (int i = 0; i < 256; i++) src[i] = 1000u + (uint32_t)i;
    uint32_t *dsrc = device_copy(src), *dout = nullptr;
    cudaMalloc(&dout, sizeof(uint32_t) * 384);
    LG_LAUNCH(cp_async_kernel, 1, 32, sizeof(uint32_t) * 256, nullptr, dout, dsrc);
    std::vector<uint32_t> out = host_copy(dout, 384);
    int wrong = 0;
    for (int i = 0; i < 128; i++) {
        wrong += out[i] != src[i];                                    /* group 0 landed */
        wrong += out[128 + i] != 0xffffffffu;                         /* group 1 not yet */
        wrong += out[256 + i] != (i % 4 < 2 ? src[128 + i] : 0u);     /* 8 bytes, then zeros */
    }
    CHECK(wrong == 0);
    cudaFree(dsrc), cudaFree(dout);
}

/* NCCL on 3 ranks, grouped as the backend issues it (on managed memory, which the host reads). */
static void test_nccl(void) {
    const int n = 3;
    lg_emu_set_devices(n);
    ncclComm_t comms[n];
    int devices[n] = {0, 1, 2};
    CHECK(ncclCommInitAll(comms, n, devices) == ncclSuccess);
    int count = 0, rank = -1;
    ncclCommCount(comms[2], &count);
    ncclCommUserRank(comms[2], &rank);
    CHECK(count == 3 && rank == 2);
    const size_t m = 4; /* elements a rank's piece */
    float *buf[n], *out[n];
    uint16_t *hb[n];
    for (int r = 0; r < n; r++) {
        cudaSetDevice(r);
        cudaMallocManaged(&buf[r], m * n * sizeof(float), cudaMemAttachGlobal);
        cudaMallocManaged(&out[r], m * n * sizeof(float), cudaMemAttachGlobal);
        cudaMallocManaged(&hb[r], m * n * sizeof(uint16_t), cudaMemAttachGlobal);
    }
    auto fill = [&]() {
        for (int r = 0; r < n; r++)
            for (size_t i = 0; i < m * n; i++) buf[r][i] = (float)(100 * r + (int)i);
    };
    /* all-reduce, in place */
    fill();
    ncclGroupStart();
    for (int r = 0; r < n; r++) ncclAllReduce(buf[r], buf[r], m * n, ncclFloat32, ncclSum, comms[r], nullptr);
    CHECK(lg_emu_nccl_pending() == 3);
    CHECK(ncclGroupEnd() == ncclSuccess && lg_emu_nccl_pending() == 0);
    bool ok = true;
    for (int r = 0; r < n; r++)
        for (size_t i = 0; i < m * n; i++) ok = ok && buf[r][i] == (float)(300 + 3 * (int)i);
    CHECK(ok);
    /* reduce-scatter: out of place, then in place (each rank's piece at rank * m) */
    for (int in_place = 0; in_place < 2; in_place++) {
        fill();
        ncclGroupStart();
        for (int r = 0; r < n; r++)
            ncclReduceScatter(buf[r], in_place ? buf[r] + r * m : out[r], m, ncclFloat, ncclSum, comms[r], nullptr);
        CHECK(ncclGroupEnd() == ncclSuccess);
        ok = true;
        for (int r = 0; r < n; r++)
            for (size_t i = 0; i < m; i++)
                ok = ok && (in_place ? buf[r][r * m + i] : out[r][i]) == (float)(300 + 3 * (int)(r * m + i));
        CHECK(ok);
    }
    /* all-gather in place: rank r's piece is already at r * m */
    for (int r = 0; r < n; r++)
        for (size_t i = 0; i < m; i++) buf[r][r * m + i] = (float)(10 * r + (int)i);
    ncclGroupStart();
    for (int r = 0; r < n; r++) ncclAllGather(buf[r] + r * m, buf[r], m, ncclFloat32, comms[r], nullptr);
    CHECK(ncclGroupEnd() == ncclSuccess);
    ok = true;
    for (int r = 0; r < n; r++)
        for (size_t i = 0; i < m * n; i++) ok = ok && buf[r][i] == (float)(10 * (int)(i / m) + (int)(i % m));
    CHECK(ok);
    /* broadcast from rank 1, in place */
    fill();
    ncclGroupStart();
    for (int r = 0; r < n; r++) ncclBroadcast(buf[r], buf[r], m * n, ncclFloat32, 1, comms[r], nullptr);
    CHECK(ncclGroupEnd() == ncclSuccess);
    ok = true;
    for (int r = 0; r < n; r++)
        for (size_t i = 0; i < m * n; i++) ok = ok && buf[r][i] == (float)(100 + (int)i);
    CHECK(ok);
    /* bf16 all-reduce: 1 + 2^-8 + 2^-8 summed in float is 1 + 2^-7, exact in bf16 (rounding after
       each add would give 1) */
    const float parts[n] = {1.0f, 1.0f / 256, 1.0f / 256};
    for (int r = 0; r < n; r++)
        for (size_t i = 0; i < m * n; i++) hb[r][i] = lg_emu_float_to_bf16(parts[r] * (float)(i + 1));
    ncclGroupStart();
    for (int r = 0; r < n; r++) ncclAllReduce(hb[r], hb[r], m * n, ncclBfloat16, ncclSum, comms[r], nullptr);
    CHECK(ncclGroupEnd() == ncclSuccess);
    CHECK(lg_emu_bf16_to_float(hb[0][0]) == 1.0f + 1.0f / 128 && hb[1][0] == hb[0][0] && hb[2][0] == hb[0][0]);
    /* bf16 reduce-scatter in place, all-gather in place, broadcast */
    for (int r = 0; r < n; r++)
        for (size_t i = 0; i < m * n; i++) hb[r][i] = lg_emu_float_to_bf16((float)(r + (int)i));
    ncclGroupStart();
    for (int r = 0; r < n; r++) ncclReduceScatter(hb[r], hb[r] + r * m, m, ncclBfloat16, ncclSum, comms[r], nullptr);
    CHECK(ncclGroupEnd() == ncclSuccess);
    ncclGroupStart();
    for (int r = 0; r < n; r++) ncclAllGather(hb[r] + r * m, hb[r], m, ncclBfloat16, comms[r], nullptr);
    CHECK(ncclGroupEnd() == ncclSuccess);
    ok = true;
    for (int r = 0; r < n; r++)
        for (size_t i = 0; i < m * n; i++) ok = ok && lg_emu_bf16_to_float(hb[r][i]) == (float)(3 + 3 * (int)i);
    CHECK(ok);
    hb[2][5] = lg_emu_float_to_bf16(-7.5f);
    ncclGroupStart();
    for (int r = 0; r < n; r++) ncclBroadcast(hb[r], hb[r], m * n, ncclBfloat16, 2, comms[r], nullptr);
    CHECK(ncclGroupEnd() == ncclSuccess);
    CHECK(lg_emu_bf16_to_float(hb[0][5]) == -7.5f && lg_emu_bf16_to_float(hb[1][5]) == -7.5f);
    /* ungrouped calls wait for the last rank */
    for (int r = 0; r < n; r++) buf[r][0] = 1.0f;
    for (int r = 0; r < n; r++) {
        CHECK(ncclAllReduce(buf[r], buf[r], 1, ncclFloat32, ncclSum, comms[r], nullptr) == ncclSuccess);
        CHECK(buf[0][0] == (r < n - 1 ? 1.0f : 3.0f));
    }
    /* mismatched calls and overrunning buffers are refused */
    fprintf(stderr, "(two refused NCCL calls expected:)\n");
    ncclGroupStart();
    ncclAllReduce(buf[0], buf[0], 2, ncclFloat32, ncclSum, comms[0], nullptr);
    ncclAllReduce(buf[1], buf[1], 3, ncclFloat32, ncclSum, comms[1], nullptr);
    ncclAllReduce(buf[2], buf[2], 2, ncclFloat32, ncclSum, comms[2], nullptr);
    CHECK(ncclGroupEnd() == ncclInvalidUsage);
    CHECK(ncclAllReduce(buf[0], buf[0], m * n + 1, ncclFloat32, ncclSum, comms[0], nullptr) == ncclInvalidArgument);
    int duplicate[2] = {1, 1};
    ncclComm_t bad[2];
    fprintf(stderr, "(and a duplicate device:)\n");
    CHECK(ncclCommInitAll(bad, 2, duplicate) == ncclInvalidUsage);
    for (int r = 0; r < n; r++) {
        cudaFree(buf[r]), cudaFree(out[r]), cudaFree(hb[r]);
        CHECK(ncclCommDestroy(comms[r]) == ncclSuccess);
    }
    cudaSetDevice(0);
    lg_emu_set_devices(1);
}

/* Deferred collectives: an all-reduce on two ranks' streams changes nothing until a stream
   waits on an event recorded after it on rank 0's stream; then both ranks' results are in. */
static void test_deferred_collectives(void) {
    const int n = 2;
    lg_emu_set_devices(n);
    lg_emu_state().nccl.defer = 1;
    ncclComm_t comms[n];
    int devices[n] = {0, 1};
    CHECK(ncclCommInitAll(comms, n, devices) == ncclSuccess);
    float *buf[n];
    cudaStream_t streams[n], other;
    cudaEvent_t done;
    for (int r = 0; r < n; r++) {
        cudaSetDevice(r);
        cudaMallocManaged(&buf[r], sizeof(float), cudaMemAttachGlobal);
        buf[r][0] = (float)(r + 1);
        cudaStreamCreate(&streams[r]);
    }
    cudaSetDevice(0);
    cudaStreamCreate(&other);
    cudaEventCreate(&done);
    ncclGroupStart();
    for (int r = 0; r < n; r++) ncclAllReduce(buf[r], buf[r], 1, ncclFloat32, ncclSum, comms[r], streams[r]);
    CHECK(ncclGroupEnd() == ncclSuccess);
    CHECK(buf[0][0] == 1.0f && buf[1][0] == 2.0f); /* not yet */
    cudaEventRecord(done, streams[0]);
    CHECK(buf[0][0] == 1.0f);
    cudaStreamWaitEvent(other, done, 0);
    CHECK(buf[0][0] == 3.0f && buf[1][0] == 3.0f);
    ncclGroupStart(); /* and the host's synchronisation runs one too */
    for (int r = 0; r < n; r++) ncclAllReduce(buf[r], buf[r], 1, ncclFloat32, ncclSum, comms[r], streams[r]);
    ncclGroupEnd();
    CHECK(buf[1][0] == 3.0f);
    cudaStreamSynchronize(streams[1]);
    CHECK(buf[0][0] == 6.0f && buf[1][0] == 6.0f);
    lg_emu_state().nccl.defer = 0;
    cudaEventDestroy(done);
    cudaStreamDestroy(other);
    for (int r = 0; r < n; r++) {
        cudaSetDevice(r);
        cudaStreamDestroy(streams[r]);
        cudaFree(buf[r]);
        CHECK(ncclCommDestroy(comms[r]) == ncclSuccess);
    }
    cudaSetDevice(0);
    lg_emu_set_devices(1);
}

/* Deferred copies: a copy on a second stream stays pending while the first stream's own
   copies and kernels run (nothing orders it yet, as on a GPU), and lands once an event
   recorded after it is waited on. */
static void test_deferred_copies(void) {
    lg_emu_state().nccl.defer_copies = 1;
    float *a, *b, *c, *d;
    cudaMalloc((void **)&a, sizeof(float)), cudaMalloc((void **)&b, sizeof(float));
    cudaMalloc((void **)&c, sizeof(float)), cudaMalloc((void **)&d, sizeof(float));
    const float one = 1.0f, two = 2.0f, zero = 0.0f;
    cudaMemcpy(a, &one, sizeof one, cudaMemcpyDefault);
    cudaMemcpy(b, &zero, sizeof zero, cudaMemcpyDefault);
    cudaMemcpy(c, &two, sizeof two, cudaMemcpyDefault);
    cudaStream_t compute, beside;
    cudaEvent_t landed;
    cudaStreamCreate(&compute), cudaStreamCreate(&beside);
    cudaEventCreate(&landed);
    cudaMemcpyAsync(b, a, sizeof(float), cudaMemcpyDefault, beside);  /* pending */
    cudaMemcpyAsync(d, c, sizeof(float), cudaMemcpyDefault, compute); /* issued after it */
    uint64_t before = lg_emu_launches_beside_copies();
    std::vector<float> x(32, 1.0f);
    float *dx = device_copy(x), *dsum = device_copy(std::vector<float>{0});
    LG_LAUNCH(block_sum_kernel, 1, 32, 0, compute, dx, 32, dsum); /* runs the compute stream's */
    CHECK(host_copy(d, 1)[0] == 2.0f && lg_emu_launches_beside_copies() == before + 1);
    CHECK(host_copy(b, 1)[0] == 0.0f); /* still on its way (cudaMemcpy orders nothing here) */
    cudaEventRecord(landed, beside);
    cudaStreamWaitEvent(compute, landed, 0);
    CHECK(host_copy(b, 1)[0] == 1.0f);
    lg_emu_state().nccl.defer_copies = 0;
    cudaEventDestroy(landed);
    cudaStreamDestroy(compute), cudaStreamDestroy(beside);
    cudaFree(a), cudaFree(b), cudaFree(c), cudaFree(d), cudaFree(dx), cudaFree(dsum);
}

/* 64 blocks x 256 threads with 9 barriers each: the scale of the backend's tests. */
static void report_speed(void) {
    const int n = 64 * 256, launches = 20;
    std::vector<float> x(n, 1.0f);
    float *dx = device_copy(x), *dsum = device_copy(std::vector<float>{0});
    auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < launches; i++) LG_LAUNCH(block_sum_kernel, 64, 256, 0, nullptr, dx, n, dsum);
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    CHECK(host_copy(dsum, 1)[0] == (float)(n * launches));
    printf("speed: %.2f ms per launch of 64 x 256 threads, 9 barriers\n", ms / launches);
    cudaFree(dx), cudaFree(dsum);
}

int main(void) {
    test_block_reduction();
    test_warp_reduction();
    test_warp_ops();
    test_dynamic_shared();
    test_missing_barrier_detection();
    test_template_launch();
    test_grid_coordinates();
    test_atomics_and_misc();
    test_launch_refusals();
    test_shared_limits();
    test_deadlock_detection();
    test_memory_accounting();
    test_host_visits();
    test_half_conversions();
    test_wmma();
    test_mma();
    test_ldmatrix();
    test_cp_async();
    test_nccl();
    test_deferred_collectives();
    test_deferred_copies();
    report_speed();
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
