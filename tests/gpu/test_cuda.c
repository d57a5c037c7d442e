/* tests/gpu/test_cuda.c — the CUDA backend against the CPU backend, in one binary.

   Built two ways from this one file:
   - by nvcc (`make build/test_cuda`), for a machine with GPUs: tests/gpu/run.sh runs it;
   - by g++ with -DLG_CUDA_EMULATE (`make build/test_cuda_emulated`, part of `make test`): the
     same kernels then run on the CPU through tests/cuda_emulator.h, NCCL too, with cuBLASLt
     replaced by the backend's reference matmul kernel.

   Every CUDA op is checked on fresh random inputs in each storage type against the CPU op of
   litgpt.h section 7, with the GPU's outputs poisoned (NaN) first, and twice for bitwise
   determinism; then whole training steps of each family and precision, -d 1 against -d N, and
   the plan against the memory the GPU reports. `test_cuda MODE...` runs only the modes named
   (ops, attention, steps, grads, features, resume, devices, memory, combinations; `--list` prints them), so
   that tests/gpu/run.sh runs each in its own process; `bench` times GPT-2 124M instead and
   `bench-attention` the attention kernels, `long-context` README's long-context setup at two
   lengths, and `--probe` prints the runtime's and the driver's
   CUDA versions and the devices it sees. stdout is line-buffered: what was printed survives an
   abort. The last line is "N passed, N failed". */
#ifdef LG_CUDA_EMULATE
#include "../cuda_emulator.h"
#endif
#define LITGPT_IMPLEMENTATION
#include "../../litgpt.h"

#include <math.h>
#include <string.h>
#include <sys/stat.h>

/* --- harness ---------------------------------------------------------------------------------- */

#include "../check.h"

static void die_cuda(const char *what, cudaError_t status) {
    fprintf(stderr, "test_cuda: %s: %s\n", what, cudaGetErrorString(status));
    exit(2);
}

/* GPU-visible memory, poisoned: every byte 0xFF, a NaN in every storage type. */
static void *gpu_alloc(size_t bytes) {
    void *p = NULL;
    cudaError_t status = cudaMallocManaged(&p, bytes ? bytes : 1, cudaMemAttachGlobal);
    if (status != cudaSuccess) die_cuda("cudaMallocManaged", status);
    memset(p, 0xFF, bytes);
    return p;
}

static void gpu_free(void *p) { cudaFree(p); }

/* A CUDA-backend exec on GPU 0 for ops of up to max_tokens tokens and C channels (the
   scratch a rank's plan would give it). */
static lg_exec gpu_exec(int max_tokens, int C) {
    lg_exec ex;
    memset(&ex, 0, sizeof ex);
    lg_cuda_rank *g = (lg_cuda_rank *)lg_alloc_zeroed(sizeof(lg_cuda_rank));
    cudaSetDevice(0);
    lg_error err;
    if (lg_cuda_rank_handles(g, &err) != 0) {
        fprintf(stderr, "test_cuda: %s\n", err.msg);
        exit(2);
    }
    g->token_capacity = (size_t)max_tokens;
    g->tokens = (int *)gpu_alloc(2 * sizeof(int) * (size_t)max_tokens);
    g->targets = g->tokens + max_tokens;
    g->C = C;
    g->row_sums = (float *)gpu_alloc(sizeof(float) * LG_CUDA_ROW_CHUNKS * 2 * (size_t)C);
    g->totals = (double *)gpu_alloc(sizeof(double) * LG_CUDA_REDUCE_SLOTS);
    g->matmul_workspace_bytes = LG_CUDA_MATMUL_WORKSPACE;
    g->matmul_workspace = gpu_alloc(g->matmul_workspace_bytes);
    g->staging_bytes = LG_CUDA_STAGING;
    cudaError_t status = cudaMallocHost((void **)&g->staging, g->staging_bytes);
    if (status != cudaSuccess) die_cuda("cudaMallocHost", status);
    ex.backend = LG_BACKEND_CUDA;
    ex.cuda = g;
    return ex;
}

static void gpu_sync(const lg_exec *ex) {
    cudaError_t status = cudaStreamSynchronize(ex->cuda->stream);
    if (status != cudaSuccess) die_cuda("cudaStreamSynchronize", status);
}

static void gpu_exec_free(lg_exec *ex) {
    lg_cuda_rank *g = ex->cuda;
    gpu_sync(ex);
    gpu_free(g->tokens);
    gpu_free(g->row_sums);
    gpu_free(g->totals);
    gpu_free(g->matmul_workspace);
    cudaFreeHost(g->staging);
    lg_cuda_rank_handles_free(g);
    LG_FREE(g);
    memset(ex, 0, sizeof *ex);
}

/* max |got - want| / max(max |want|, 1e-30), NaN anywhere -> infinity */
static double rel_error(lg_buf got, lg_buf want, size_t n) {
    double diff = 0, scale = 1e-30;
    for (size_t i = 0; i < n; i++) {
        double g = lg_get(got, i), w = lg_get(want, i);
        if (g != g || w != w) return INFINITY;
        diff = fmax(diff, fabs(g - w));
        scale = fmax(scale, fabs(w));
    }
    return diff / scale;
}

static const lg_dtype storage_types[3] = {LG_DTYPE_F32, LG_DTYPE_BF16, LG_DTYPE_F16};

/* The tolerance of a comparison in a storage type: fp32 1e-5 unless said, half types 1e-2. */
static double tolerance_of(lg_dtype dtype, double fp32) {
    return dtype == LG_DTYPE_F32 ? fp32 : 1e-2;
}

/* A buffer of n random normal values in a storage type (GPU-visible). */
static lg_buf random_buf(lg_dtype dtype, size_t n, float std, lg_rng *rng) {
    lg_buf b = {gpu_alloc(n * lg_elem_size(dtype)), dtype};
    for (size_t i = 0; i < n; i++) lg_set(b, i, std * lg_rng_normal(rng));
    return b;
}

/* A poisoned buffer of n elements. */
static lg_buf poisoned_buf(lg_dtype dtype, size_t n) {
    lg_buf b = {gpu_alloc(n * lg_elem_size(dtype)), dtype};
    return b;
}

/* A copy of b (GPU-visible). */
static lg_buf copy_buf(lg_buf b, size_t n) {
    lg_buf c = poisoned_buf(b.dtype, n);
    memcpy(c.data, b.data, n * lg_elem_size(b.dtype));
    return c;
}

static int bitwise_equal(lg_buf a, lg_buf b, size_t n) {
    return memcmp(a.data, b.data, n * lg_elem_size(a.dtype)) == 0;
}

#include "ops_kernels.inc"   /* test_kernels: elementwise, embedding, norms, classifier, optimizers */
#include "ops_attention.inc" /* test_attention: flash attention forward and backward */
#include "comm_deadline.inc"  /* test_comm_deadline: a stalled collective ends at --dist-timeout */
#include "../test_combinations.c" /* test_combinations_cuda: every pair of memory levers */

/* --- matmuls ------------------------------------------------------------------------------- */

/* C (M, N) = beta C + op(A) op(B) on the GPU (the rank's choice of cuBLASLt or the reference
   kernel, TF32 allowed or not) against lg_gemm, every transposition, every storage type, beta
   0 and 1. fp32 within 1e-5, or 1e-3 with TF32 (10-bit mantissas); halves 1e-2. */
static void test_matmul(results *r, int reference, int tf32) {
    const int M = 37, N = 29, K = 45;
    lg_rng rng;
    lg_rng_seed(&rng, 7);
    lg_exec ex = gpu_exec(64, 64);
    ex.cuda->reference_matmul = reference;
    ex.cuda->tf32 = tf32;
    for (int d = 0; d < 3; d++) {
        lg_dtype dtype = storage_types[d];
        double worst = 0;
        int deterministic = 1;
        for (int case_ = 0; case_ < 8; case_++) {
            int trans_a = case_ & 1, trans_b = (case_ >> 1) & 1, accumulate = case_ >> 2;
            lg_buf A = random_buf(dtype, (size_t)M * K, 1, &rng);
            lg_buf B = random_buf(dtype, (size_t)K * N, 1, &rng);
            lg_buf C0 = random_buf(dtype, (size_t)M * N, 1, &rng);
            lg_buf want = copy_buf(C0, (size_t)M * N), got = copy_buf(C0, (size_t)M * N);
            if (!accumulate) memset(got.data, 0xFF, (size_t)M * N * lg_elem_size(dtype));
            lg_buf none = {NULL, dtype};
            int lda = trans_a ? M : K, ldb = trans_b ? K : N;
            lg_gemm(NULL, trans_a, trans_b, M, N, K, A, lda, B, ldb, (lg_real)accumulate, want, N);
            lg_cuda_matmul(&ex, trans_a, trans_b, M, N, K, A, lda, B, ldb, (float)accumulate, got,
                           N, none);
            gpu_sync(&ex);
            worst = fmax(worst, rel_error(got, want, (size_t)M * N));
            lg_buf again = copy_buf(C0, (size_t)M * N);
            lg_cuda_matmul(&ex, trans_a, trans_b, M, N, K, A, lda, B, ldb, (float)accumulate,
                           again, N, none);
            gpu_sync(&ex);
            deterministic &= bitwise_equal(got, again, (size_t)M * N);
            gpu_free(A.data), gpu_free(B.data), gpu_free(C0.data);
            gpu_free(want.data), gpu_free(got.data), gpu_free(again.data);
        }
        /* half outputs round once, the CPU rounds once: a half ulp of the largest apart */
        check(r, worst < tolerance_of(dtype, tf32 ? 1e-3 : 1e-5) && deterministic,
              "matmul (%s%s) %s, 8 transpositions x beta: rel err %.1e, bitwise repeatable: %s",
              reference ? "reference kernel" : "cuBLASLt", tf32 ? ", TF32" : "",
              lg_dtype_name(dtype), worst, deterministic ? "yes" : "no");
    }
    gpu_exec_free(&ex);
}

/* lg_linear_forward and lg_linear_backward (bias included) on the GPU against the CPU, each
   storage type; gradients accumulate into random starting values on both sides. The bias
   gradient's chunks of rows: 300 rows in chunks of 2, 70 columns one a thread; 1000 rows in
   250 chunks of 4, 72 columns in 16-byte packs. */
static void test_linear(results *r, int reference) {
    const int shapes[2][3] = {{300, 40, 70}, {1000, 40, 72}}; /* (N, IC, OC) */
    lg_rng rng;
    lg_rng_seed(&rng, 11);
    lg_exec ex = gpu_exec(64, 64);
    ex.cuda->reference_matmul = reference;
    for (int s = 0; s < 2; s++)
        for (int d = 0; d < 3; d++) {
            const int N = shapes[s][0], IC = shapes[s][1], OC = shapes[s][2];
            lg_dtype dtype = storage_types[d];
            size_t n_in = (size_t)N * IC, n_out = (size_t)N * OC, n_w = (size_t)OC * IC;
            lg_buf inp = random_buf(dtype, n_in, 1, &rng), w = random_buf(dtype, n_w, 0.2f, &rng);
            lg_buf bias = random_buf(dtype, OC, 1, &rng), dout = random_buf(dtype, n_out, 1, &rng);
            lg_buf dinp0 = random_buf(dtype, n_in, 1, &rng), dw0 = random_buf(dtype, n_w, 1, &rng);
            lg_buf db0 = random_buf(dtype, OC, 1, &rng);
            lg_buf out_want = poisoned_buf(dtype, n_out), out_got = poisoned_buf(dtype, n_out);
            lg_buf dinp_want = copy_buf(dinp0, n_in), dinp_got = copy_buf(dinp0, n_in);
            lg_buf dw_want = copy_buf(dw0, n_w), dw_got = copy_buf(dw0, n_w);
            lg_buf db_want = copy_buf(db0, OC), db_got = copy_buf(db0, OC);
            lg_linear_forward(NULL, out_want, inp, w, bias, N, IC, OC);
            lg_linear_backward(NULL, dinp_want, dw_want, db_want, dout, inp, w, N, IC, OC, 1.0f, 1.0f);
            lg_cuda_linear_forward_into(&ex, out_got, OC, inp, w, bias, N, IC, OC);
            lg_cuda_linear_backward(&ex, dinp_got, dw_got, db_got, dout, inp, w, N, IC, OC, 1.0f, 1.0f);
            lg_buf db_again = copy_buf(db0, OC), dinp_again = copy_buf(dinp0, n_in);
            lg_buf no_weight = {NULL, dtype};
            lg_cuda_linear_backward(&ex, dinp_again, no_weight, db_again, dout, inp, w, N, IC, OC, 1.0f, 1.0f);
            /* beta 0 (the first contribution; a step's first micro-batch): written over poison */
            lg_buf dw_new_want = poisoned_buf(dtype, n_w), dw_new_got = poisoned_buf(dtype, n_w);
            lg_buf db_new_want = poisoned_buf(dtype, OC), db_new_got = poisoned_buf(dtype, OC);
            lg_buf dinp_new_want = poisoned_buf(dtype, n_in), dinp_new_got = poisoned_buf(dtype, n_in);
            lg_linear_backward(NULL, dinp_new_want, dw_new_want, db_new_want, dout, inp, w, N, IC, OC, 0.0f, 0.0f);
            lg_cuda_linear_backward(&ex, dinp_new_got, dw_new_got, db_new_got, dout, inp, w, N, IC, OC, 0.0f, 0.0f);
            gpu_sync(&ex);
            double worst = fmax(fmax(rel_error(out_got, out_want, n_out), rel_error(dinp_got, dinp_want, n_in)),
                                fmax(rel_error(dw_got, dw_want, n_w), rel_error(db_got, db_want, OC)));
            worst = fmax(worst, fmax(rel_error(dw_new_got, dw_new_want, n_w), rel_error(db_new_got, db_new_want, OC)));
            worst = fmax(worst, rel_error(dinp_new_got, dinp_new_want, n_in));
            lg_buf written[6] = {dw_new_want, dw_new_got, db_new_want, db_new_got, dinp_new_want, dinp_new_got};
            for (int k = 0; k < 6; k++) gpu_free(written[k].data);
            int repeatable = bitwise_equal(db_got, db_again, OC);
            /* 300- and 1000-term sums in another order: fp32 1e-5 */
            check(r, worst < tolerance_of(dtype, 1e-5) && repeatable,
                  "linear forward + backward with bias (%s) %s, %d rows, %d outputs, gradients added and "
                  "written (beta 0): rel err %.1e, "
                  "bias gradient bitwise repeatable: %s", reference ? "reference kernel" : "cuBLASLt",
                  lg_dtype_name(dtype), N, OC, worst, repeatable ? "yes" : "no");
            gpu_free(db_again.data);
            gpu_free(dinp_again.data);
            lg_buf all[13] = {inp, w, bias, dout, dinp0, dw0, db0, out_want, out_got, dinp_want,
                              dinp_got, dw_want, dw_got};
            for (int k = 0; k < 13; k++) gpu_free(all[k].data);
            gpu_free(db_want.data);
            gpu_free(db_got.data);
        }
    gpu_exec_free(&ex);
}

/* The residual add fused with the norm after it, in place (sum = a) as the model uses it,
   LayerNorm and RMSNorm, each storage type, against the CPU's add then norm. */
static void test_residual_norm(results *r) {
    const int N = 37, widths[2] = {100, 136}; /* 136: every row in 16-byte packs */
    lg_rng rng;
    lg_rng_seed(&rng, 13);
    lg_exec ex = gpu_exec(64, widths[1]);
    for (int c = 0; c < 2; c++)
        for (int d = 0; d < 3; d++)
            for (int layer_norm = 0; layer_norm < 2; layer_norm++) {
                const int C = widths[c];
                const size_t n = (size_t)N * C;
                lg_dtype dtype = storage_types[d];
                lg_buf a = random_buf(dtype, n, 1, &rng), b = random_buf(dtype, n, 1, &rng);
                lg_buf w = random_buf(dtype, C, 1, &rng), bias = random_buf(dtype, C, 1, &rng);
                lg_buf sum_want = copy_buf(a, n), sum_got = copy_buf(a, n);
                lg_buf out_want = poisoned_buf(dtype, n), out_got = poisoned_buf(dtype, n);
                lg_buf stats_want = poisoned_buf(LG_DTYPE_F32, 2 * (size_t)N);
                lg_buf stats_got = poisoned_buf(LG_DTYPE_F32, 2 * (size_t)N);
                lg_real *mean_want = (lg_real *)stats_want.data, *mean_got = (lg_real *)stats_got.data;
                lg_buf no_bias = {NULL, dtype};
                lg_residual_norm_forward(NULL, sum_want, out_want, layer_norm ? mean_want : NULL,
                                         mean_want + N, sum_want, b, w, layer_norm ? bias : no_bias,
                                         N, C, 1e-5f);
                lg_cuda_residual_norm_forward(&ex, sum_got, out_got, layer_norm ? mean_got : NULL,
                                              mean_got + N, sum_got, b, w,
                                              layer_norm ? bias : no_bias, N, C, 1e-5f);
                gpu_sync(&ex);
                lg_buf rstd_want = lg_at(stats_want, N), rstd_got = lg_at(stats_got, N);
                double worst = fmax(fmax(rel_error(sum_got, sum_want, n), rel_error(out_got, out_want, n)),
                                    rel_error(rstd_got, rstd_want, N));
                if (layer_norm) worst = fmax(worst, rel_error(stats_got, stats_want, N));
                check(r, worst < tolerance_of(dtype, 1e-5),
                      "residual add + %s (%s), C %d, in place: rel err %.1e",
                      layer_norm ? "LayerNorm" : "RMSNorm", lg_dtype_name(dtype), C, worst);
                lg_buf all[10] = {a, b, w, bias, sum_want, sum_got, out_want, out_got, stats_want, stats_got};
                for (int k = 0; k < 10; k++) gpu_free(all[k].data);
            }
    gpu_exec_free(&ex);
}

/* --- whole training steps ------------------------------------------------------------------ */

/* Windows of T tokens of the built-in task, enough for `steps` steps of the run. */
static int builtin_loader(lg_loader *ld, const lg_config *cfg, const lg_args *a, int T, int steps) {
    lg_error err;
    size_t n = 0;
    uint32_t *tokens = lg_builtin_task_tokens(5, (size_t)(steps + 1) * a->global_batch_size * T + 1, &n);
    if (lg_loader_from_memory(ld, tokens, n, T, cfg->vocab_size, 1, a->seed, &err) == 0) return 0;
    printf("    %s\n", err.msg);
    return -1;
}

/* Trains `steps` steps of the built-in task; the trainer stays alive for the caller. */
static int train_steps(lg_trainer *tr, const lg_config *cfg, const lg_args *a, int T, int steps,
                       double *losses) {
    lg_error err;
    if (lg_trainer_create(tr, cfg, a, T, &err) != 0) {
        printf("    %s\n", err.msg);
        return -1;
    }
    lg_loader ld;
    if (builtin_loader(&ld, cfg, a, T, steps) != 0) return -1;
    int rc = run_step_range(tr, &ld, 0, steps, losses);
    lg_loader_close(&ld);
    return rc;
}

/* One run's args for the step comparisons: AdamW, -b 2 -g 4, 3 steps. */
static lg_args step_args(lg_precision precision, lg_backend backend) {
    lg_args a;
    lg_args_default(&a);
    a.precision = precision;
    a.micro_batch_size = 2;
    a.global_batch_size = 4;
    a.lr = 1e-3f;
    a.warmup_steps = 0;
    a.max_steps = 3;
    a.backend = backend;
    return a;
}

/* Each family and precision: the CUDA backend's losses and weights after 3 steps against the
   CPU backend's. fp32: the two sum in other orders, 1e-4 (AdamW's first steps move every
   weight by about lr whatever the gradient's size, so rounding in a tiny gradient shows at
   the scale of lr); half precisions: their rounding, 1e-2. */
static void test_training_steps(results *r) {
    static const char *const configs[] = {"test-gpt2", "test-pythia", "test-llama", "test-falcon",
                                          "test-llama31"};
    const int T = 16, steps = 3;
    for (size_t c = 0; c < sizeof configs / sizeof configs[0]; c++) {
        lg_config cfg;
        if (load_config_or_fail(r, &cfg, configs[c])) continue;
        for (int p = 0; p < 5; p++) {
            lg_precision precision = (lg_precision)p;
            double cpu_losses[3], gpu_losses[3];
            lg_trainer cpu, gpu;
            lg_args a = step_args(precision, LG_BACKEND_CPU), b = step_args(precision, LG_BACKEND_CUDA);
            if (train_steps(&cpu, &cfg, &a, T, steps, cpu_losses) != 0 ||
                train_steps(&gpu, &cfg, &b, T, steps, gpu_losses) != 0) {
                check(r, 0, "%s %s: both backends train", configs[c], lg_precision_name(precision));
                continue;
            }
            lg_real *want = trained_weights(&cpu), *got = trained_weights(&gpu);
            double weights = rel_error(lg_buf_of(got), lg_buf_of(want), cpu.ranks[0].model.n_params), losses = 0;
            for (int s = 0; s < steps; s++)
                losses = fmax(losses, fabs(gpu_losses[s] - cpu_losses[s]) / fabs(cpu_losses[s]));
            double tolerance = precision == LG_PRECISION_32_TRUE ? 1e-4 : 1e-2;
            check(r, weights < tolerance && losses < tolerance,
                  "%-12s %-10s 3 steps, CUDA vs CPU: losses %.1e, weights %.1e (< %.0e)",
                  configs[c], lg_precision_name(precision), losses, weights, tolerance);
            LG_FREE(want);
            LG_FREE(got);
            lg_trainer_free(&cpu);
            lg_trainer_free(&gpu);
        }
    }
}

/* Rank r's gradients (x, n elements) in host memory (malloc'd): read through lg_visit. */
static unsigned char *grads_on_host(const lg_model *m) {
    size_t size = lg_elem_size(m->grads.dtype);
    unsigned char *host = (unsigned char *)malloc(m->n_local * size);
    lg_visit v = lg_visit_start(&m->exec, m->grads, m->n_local, 1, LG_VISIT_READ);
    while (lg_visit_next(&v)) memcpy(host + v.first * size, v.piece.data, v.n * size);
    return host;
}

/* Every rank's gradients filled with NaN bits (written through lg_visit). */
static void poison_grads(lg_trainer *tr) {
    for (int r = 0; r < tr->local_ranks; r++) {
        const lg_model *m = &tr->ranks[r].model;
        lg_visit v = lg_visit_start(&m->exec, m->grads, m->n_local, 1, LG_VISIT_WRITE);
        while (lg_visit_next(&v)) memset(v.piece.data, 0xff, v.n * lg_elem_size(m->grads.dtype));
    }
}

/* On GPUs, test-gpt2 (tied embeddings) -b 2 -g 3 bf16-mixed and fp32, 1 and 2 devices: the
   gradients of 2 steps written (beta 0: cuBLASLt's and the bias gradient's) on the first
   micro-batch over NaN, bitwise those zeroed and added to (grads_add_only). */
static void test_grads_written(results *r, int gpus) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-gpt2")) return;
    const int T = 16, steps = 2;
    for (int devices = 1; devices <= 2 && devices <= gpus; devices++)
        for (int p = 0; p < 2; p++) {
            lg_args a = step_args(p ? LG_PRECISION_BF16_MIXED : LG_PRECISION_32_TRUE, LG_BACKEND_CUDA);
            a.devices = devices;
            a.global_batch_size = 6 * devices;
            lg_trainer tr[2];
            lg_loader ld[2];
            lg_error err;
            int made = 0, equal = 1;
            for (int k = 0; k < 2; k++) {
                if (lg_trainer_create(&tr[k], &cfg, &a, T, &err) != 0) {
                    printf("    %s\n", err.msg);
                    break;
                }
                made++;
                if (builtin_loader(&ld[k], &cfg, &a, T, steps) != 0) {
                    lg_trainer_free(&tr[k]);
                    made--;
                    break;
                }
            }
            equal = made == 2;
            for (int i = 0; equal && i < tr[1].local_ranks; i++) tr[1].ranks[i].model.grads_add_only = 1;
            for (int s = 0; s < steps && equal; s++) {
                lg_step_stats st[2];
                poison_grads(&tr[0]);
                for (int k = 0; k < 2; k++) equal = equal && lg_trainer_step(&tr[k], &ld[k], s, &st[k], &err) == 0;
                for (int i = 0; equal && i < tr[0].local_ranks; i++) {
                    const lg_model *w = &tr[0].ranks[i].model;
                    unsigned char *gw = grads_on_host(w), *gz = grads_on_host(&tr[1].ranks[i].model);
                    equal = memcmp(gw, gz, w->n_local * lg_elem_size(w->grads.dtype)) == 0 &&
                            st[0].loss == st[1].loss;
                    free(gw);
                    free(gz);
                }
            }
            for (int k = 0; k < made; k++) {
                lg_loader_close(&ld[k]);
                lg_trainer_free(&tr[k]);
            }
            check(r, equal, "test-gpt2 (tied) %s -g 3 -d %d: 2 steps' gradients written on the first "
                  "micro-batch (over NaN) = zeroed and added, bitwise", lg_precision_name(a.precision),
                  devices);
        }
}

/* test-llama, or a wider one (n_embd 64, MLP 128) whose matrices have the 4096 elements and more
   that compact optimizer states apply to. */
static int llama_config(lg_config *cfg, int wide) {
    lg_error err;
    if (lg_config_load(cfg, "configs/test-llama.yaml", &err) != 0) return -1;
    if (wide) {
        cfg->n_embd = 64;
        cfg->head_size = 16;
        cfg->intermediate_size = 128;
    }
    return 0;
}

/* Trains a and b 3 steps on test-llama (wide or not); the largest relative difference of their
   weights and of their losses (INFINITY when a run fails). */
/* How far tb's weights land from ta's (relative) and, into *losses_apart, the largest relative
   difference of their losses la, lb over steps; frees both trainers. */
static double trainers_apart(lg_trainer *ta, lg_trainer *tb, const double *la, const double *lb,
                             int steps, double *losses_apart) {
    lg_real *wa = trained_weights(ta), *wb = trained_weights(tb);
    double apart = rel_error(lg_buf_of(wb), lg_buf_of(wa), ta->ranks[0].model.n_params);
    *losses_apart = 0;
    for (int s = 0; s < steps; s++) *losses_apart = fmax(*losses_apart, fabs(lb[s] - la[s]) / la[s]);
    LG_FREE(wa);
    LG_FREE(wb);
    lg_trainer_free(ta);
    lg_trainer_free(tb);
    return apart;
}

/* Trains a and b 3 steps on cfg: the largest relative difference of their weights and of
   their losses (INFINITY when a run fails). */
static double runs_differ_on(const lg_config *cfg, const lg_args *a, const lg_args *b,
                             double *losses_apart) {
    const int T = 16, steps = 3;
    double la[3], lb[3];
    lg_trainer ta, tb;
    *losses_apart = INFINITY;
    if (train_steps(&ta, cfg, a, T, steps, la) != 0) return INFINITY;
    if (train_steps(&tb, cfg, b, T, steps, lb) != 0) {
        lg_trainer_free(&ta);
        return INFINITY;
    }
    return trainers_apart(&ta, &tb, la, lb, steps, losses_apart);
}

static double runs_differ(const lg_args *a, const lg_args *b, int wide, double *losses_apart) {
    lg_config cfg;
    *losses_apart = INFINITY;
    if (llama_config(&cfg, wide) != 0) return INFINITY;
    return runs_differ_on(&cfg, a, b, losses_apart);
}

/* On GPUs: --recompute block gives the same bits as none; --offload (the optimizer on the
   host) the same weights within 1e-6 (the GPU may contract multiply-adds the host does not);
   SGD, Lion and Sophia (its Hessian pass samples labels on the host) as on the CPU within
   1e-4 at fp32. */
static void test_gpu_features(results *r) {
    lg_args plain = step_args(LG_PRECISION_BF16_MIXED, LG_BACKEND_CUDA), other = plain;
    double losses;
    other.recompute = 1;
    double weights = runs_differ(&plain, &other, 0, &losses);
    check(r, weights == 0 && losses == 0, "--recompute block = none on a GPU, bf16-mixed: weights "
          "%.1e, losses %.1e apart (bitwise)", weights, losses);
    for (int p = 0; p < 2; p++) { /* the head in chunks of 5 of 32 rows, the MLP in slices of
                                     3: logits and hidden layers computed again */
        lg_precision precision = p ? LG_PRECISION_BF16_MIXED : LG_PRECISION_32_TRUE;
        plain = step_args(precision, LG_BACKEND_CUDA);
        plain.recompute = 1;
        other = plain;
        other.head_rows = 5;
        other.slice_rows = 3;
        weights = runs_differ(&plain, &other, 0, &losses);
        double bound = p ? 1e-3 : 1e-6; /* bf16: cuBLASLt may choose other algorithms for 5 rows */
        check(r, weights < bound && losses < bound, "--head-rows 5 --slice-rows 3 = one pass on a "
              "GPU, --recompute block, %s: weights %.1e, losses %.1e apart (< %.0e)",
              lg_precision_name(precision), weights, losses, bound);
    }
    for (int p = 0; p < 2; p++) {
        lg_precision precision = p ? LG_PRECISION_BF16_TRUE : LG_PRECISION_BF16_MIXED;
        plain = step_args(precision, LG_BACKEND_CUDA);
        other = plain;
        other.offload = 1;
        weights = runs_differ(&plain, &other, 0, &losses);
        check(r, weights < 1e-6 && losses < 1e-6, "--offload = on the GPU, %s: weights %.1e, "
              "losses %.1e apart (< 1e-6)", lg_precision_name(precision), weights, losses);
    }
    if (lg_cuda_device_count() >= 2) { /* each rank's pieces go to the host as they finish */
        plain = step_args(LG_PRECISION_BF16_MIXED, LG_BACKEND_CUDA);
        plain.devices = 2;
        other = plain;
        other.offload = 1;
        weights = runs_differ(&plain, &other, 0, &losses);
        check(r, weights < 1e-6 && losses < 1e-6, "-d 2 full-shard --offload = on the GPUs, "
              "bf16-mixed: weights %.1e, losses %.1e apart (< 1e-6)", weights, losses);
    }
    static const lg_optimizer_kind kinds[3] = {LG_OPTIMIZER_SGD, LG_OPTIMIZER_LION,
                                               LG_OPTIMIZER_SOPHIA};
    for (int k = 0; k < 3; k++) {
        lg_args cpu = step_args(LG_PRECISION_32_TRUE, LG_BACKEND_CPU);
        cpu.optimizer = kinds[k];
        cpu.hessian_interval = 2; /* Sophia's Hessian pass at steps 0 and 2 */
        lg_args gpu = cpu;
        gpu.backend = LG_BACKEND_CUDA;
        weights = runs_differ(&cpu, &gpu, 0, &losses);
        check(r, weights < 1e-4 && losses < 1e-4, "-o %-6s 3 steps, CUDA vs CPU, 32-true: weights "
              "%.1e, losses %.1e (< 1e-4)", lg_optimizer_name(kinds[k]), weights, losses);
    }
    /* AdamW's compact states: the same code decodes, updates and re-encodes on both sides; a
       rounding difference that moves an 8-bit code moves that state by a code's step, so the
       bound is 1e-3 there */
    static const lg_state_format formats[2] = {LG_STATE_BF16, LG_STATE_8BIT};
    for (int f = 0; f < 2; f++) {
        lg_args cpu = step_args(LG_PRECISION_32_TRUE, LG_BACKEND_CPU);
        cpu.optimizer_state = formats[f];
        lg_args gpu = cpu;
        gpu.backend = LG_BACKEND_CUDA;
        weights = runs_differ(&cpu, &gpu, 1, &losses);
        double bound = formats[f] == LG_STATE_8BIT ? 1e-3 : 1e-4;
        check(r, weights < bound && losses < bound, "--optimizer-state %-4s 3 steps (n_embd 64), "
              "CUDA vs CPU: weights %.1e, losses %.1e (< %.0e)", formats[f] == LG_STATE_8BIT ? "8bit" : "bf16",
              weights, losses, bound);
    }
}

#ifdef LG_CUDA_EMULATE
/* Whether the emulator defers copies on other streams (LG_EMU_DEFER_COPIES=1, which make test
   sets): only then does a missing wait for a copy show. */
static int copies_deferred(void) {
    const char *defer = getenv("LG_EMU_DEFER_COPIES");
    return defer && strcmp(defer, "1") == 0;
}
#endif

/* Runs a and b (the same with more parts offloaded, or on another backend) 3 steps on
   test-llama with `layers` blocks; skip: b's compute does not wait for its slots' copies. How
   far b's weights land from a's, the losses' into *losses_apart, and the kernels launched
   beside a pending copy in b into *beside (the emulator's count). */
static double streamed_run_apart(results *r, const lg_args *a, const lg_args *b, int layers,
                                 int skip, double *losses_apart, unsigned long long *beside) {
    const int T = 16, steps = 3;
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return INFINITY;
    cfg.n_layer = layers;
    double la[3], lb[3];
    lg_trainer ta, tb;
    lg_loader ld;
    lg_error err;
    *losses_apart = INFINITY;
    if (train_steps(&ta, &cfg, a, T, steps, la) != 0) return INFINITY;
    if (lg_trainer_create(&tb, &cfg, b, T, &err) != 0 || builtin_loader(&ld, &cfg, b, T, steps) != 0) {
        lg_trainer_free(&ta);
        return INFINITY;
    }
    for (int k = 0; k < tb.local_ranks; k++) tb.ranks[k].model.skip_kept_waits = skip;
#ifdef LG_CUDA_EMULATE
    unsigned long long before = lg_emu_launches_beside_copies();
#endif
    int rc = run_step_range(&tb, &ld, 0, steps, lb);
#ifdef LG_CUDA_EMULATE
    *beside = lg_emu_launches_beside_copies() - before;
#else
    *beside = 0;
#endif
    lg_loader_close(&ld);
    if (rc == 0) return trainers_apart(&ta, &tb, la, lb, steps, losses_apart);
    lg_trainer_free(&ta);
    lg_trainer_free(&tb);
    return INFINITY;
}

/* A QLoRA run of 3 steps with the head in chunks of 5, the MLP in slices of 3 and --offload
   activations over 6 blocks (both slots turn over, fetched again in the backward), fp32: its
   losses and adapters on the CUDA backend against the CPU's within 1e-4. skip: the compute
   does not wait for the slots' copies; *beside: kernels launched while a copy was still
   pending (the emulator's count). */
static double offload_run_apart(results *r, int skip, double *losses_apart,
                                unsigned long long *beside) {
    lg_args a = step_args(LG_PRECISION_32_TRUE, LG_BACKEND_CPU);
    a.lora.r = 2;
    a.lora.dropout = 0.0f;
    a.lora.quantize = LG_QUANTIZE_NF4;
    a.lora.targets = LG_LORA_QUERY | LG_LORA_KEY | LG_LORA_VALUE | LG_LORA_PROJECTION | LG_LORA_MLP;
    a.lr = 1e-2f;
    a.recompute = a.offload_activations = 1;
    a.head_rows = 5;
    a.slice_rows = 3;
    lg_args b = a;
    b.backend = LG_BACKEND_CUDA;
    return streamed_run_apart(r, &a, &b, 6, skip, losses_apart, beside);
}

/* --offload activations on the GPU: the QLoRA run above equals the CPU's; on the emulator
   with deferred copies (LG_EMU_DEFER_COPIES=1, which make test sets) the forward launches
   blocks while the copies of earlier ones are pending (the copies overlap compute), and with
   the waits for the slots' copies removed the run reads slots before their data lands and
   trains another model. */
static void test_offload_overlap(results *r) {
    double losses;
    unsigned long long beside = 0;
    double apart = offload_run_apart(r, 0, &losses, &beside);
    check(r, apart < 1e-4 && losses < 1e-4, "QLoRA nf4, 6 blocks, --head-rows 5 --slice-rows 3 "
          "--offload activations, 3 steps, CUDA vs CPU, 32-true: adapters %.1e, losses %.1e "
          "(< 1e-4); %llu kernels launched beside a pending copy", apart, losses, beside);
#ifdef LG_CUDA_EMULATE
    if (copies_deferred()) {
        double losses_skipped;
        unsigned long long beside_skipped = 0;
        double skipped = offload_run_apart(r, 1, &losses_skipped, &beside_skipped);
        check(r, beside > 0 && (skipped > 1e-2 || losses_skipped > 1e-2), "the same with the "
              "slots' waits removed, copies deferred: adapters %.1e, losses %.1e apart (a missing "
              "wait shows); with them, %llu kernels ran beside a pending copy", skipped,
              losses_skipped, beside);
    }
#endif
}

/* The part of --offload a streaming run adds to --offload state alone. */
typedef enum { STREAM_GRADIENTS, STREAM_WEIGHTS } stream_part;

/* --offload gradients or weights on the CUDA backend against --offload state alone:
   test-llama with 5 blocks (both block buffers and slots turn over), 3 micro-batches a step
   (the host's gradient sums come back twice), no clipping (the host and the GPU sum the
   norm's squares in other orders), bf16-mixed, or QLoRA nf4 (every target, the head's too) in
   fp32, with `devices` ranks (full-shard: each rank's pieces stream); skip: the compute does
   not wait for the copies. Returns how far the weights land apart, the losses' into
   *losses_apart, and the kernels launched beside a pending copy into *beside (the emulator's
   count). */
static double stream_run_apart(results *r, stream_part part, int qlora, int devices, int skip,
                               double *losses_apart, unsigned long long *beside) {
    lg_args a = step_args(qlora ? LG_PRECISION_32_TRUE : LG_PRECISION_BF16_MIXED, LG_BACKEND_CUDA);
    a.devices = devices;
    a.global_batch_size = 3 * a.micro_batch_size * devices;
    a.max_norm = 0.0f;
    a.offload = 1;
    if (qlora) {
        a.lora.r = 2;
        a.lora.dropout = 0.0f;
        a.lora.quantize = LG_QUANTIZE_NF4;
        a.lora.targets = LG_LORA_QUERY | LG_LORA_KEY | LG_LORA_VALUE | LG_LORA_PROJECTION |
                         LG_LORA_MLP | LG_LORA_HEAD;
    }
    lg_args b = a;
    b.offload_gradients = part == STREAM_GRADIENTS;
    b.offload_weights = part == STREAM_WEIGHTS;
    return streamed_run_apart(r, &a, &b, 5, skip, losses_apart, beside);
}

/* On the emulator with deferred copies: `part` streamed on one rank, bf16-mixed, with the
   compute's waits for its copies (`waits`) removed, lands apart from --offload state (`shows`:
   what that reveals); beside, the kernels the run with its waits launched beside a pending
   copy, must be some. Elsewhere nothing. */
static void check_stream_waits_matter(results *r, stream_part part, unsigned long long beside,
                                      const char *waits, const char *shows) {
#ifdef LG_CUDA_EMULATE
    if (!copies_deferred()) return;
    double losses_skipped;
    unsigned long long beside_skipped = 0;
    double skipped = stream_run_apart(r, part, 0, 1, 1, &losses_skipped, &beside_skipped);
    check(r, beside > 0 && (skipped > 1e-3 || losses_skipped > 1e-3), "the same with the %s "
          "waits removed, copies deferred: weights %.1e, losses %.1e apart (%s)", waits, skipped,
          losses_skipped, shows);
#else
    (void)r, (void)part, (void)beside, (void)waits, (void)shows;
#endif
}

/* --offload gradients on the GPU: bitwise the weights and losses of --offload state (the same
   sums in the same order, only where they wait differs); on the emulator with deferred copies
   the backward runs while earlier units' gradients are still on their way, and without the
   waits for those copies a buffer is reopened under its copy and another model trains. */
static void test_offload_gradients(results *r) {
    double losses;
    unsigned long long beside = 0;
    double apart = stream_run_apart(r, STREAM_GRADIENTS, 0, 1, 0, &losses, &beside);
    check(r, apart == 0 && losses == 0, "--offload gradients = --offload state on the GPU, "
          "bf16-mixed, 5 blocks, 3 micro-batches a step, 3 steps: weights %.1e, losses %.1e apart "
          "(bitwise); %llu kernels launched beside a pending copy", apart, losses, beside);
    if (lg_cuda_device_count() >= 2) {
        unsigned long long beside_sharded = 0;
        apart = stream_run_apart(r, STREAM_GRADIENTS, 0, 2, 0, &losses, &beside_sharded);
        check(r, apart == 0 && losses == 0, "the same with -d 2 full-shard (each rank's pieces "
              "to the host): weights %.1e, losses %.1e apart (bitwise); %llu kernels launched "
              "beside a pending copy", apart, losses, beside_sharded);
    }
    check_stream_waits_matter(r, STREAM_GRADIENTS, beside, "gradient buffers'",
                              "a missing wait shows");
}

/* --offload weights on the GPU: the weights (QLoRA: the NF4 base as stored) copied from the
   host a unit at a time give bitwise the weights and losses of --offload state, on one rank
   and (2 GPUs visible) -d 2 full-shard; on the emulator with deferred copies the forward
   computes while the next unit's copy is pending, and without the waits for those copies a
   block computes with the slot's old weights. */
static void test_offload_weights(results *r) {
    int most = lg_cuda_device_count() >= 2 ? 2 : 1;
    unsigned long long beside_plain = 0; /* bf16-mixed on one rank (the emulator's count) */
    for (int qlora = 0; qlora < 2; qlora++)
        for (int devices = 1; devices <= most; devices++) {
            double losses;
            unsigned long long beside = 0;
            double apart = stream_run_apart(r, STREAM_WEIGHTS, qlora, devices, 0, &losses, &beside);
            check(r, apart == 0 && losses == 0, "--offload weights = --offload state on the GPU, "
                  "%s, -d %d%s, 5 blocks, 3 micro-batches a step, 3 steps: weights %.1e, losses "
                  "%.1e apart (bitwise); %llu kernels launched beside a pending copy",
                  qlora ? "QLoRA nf4 32-true" : "bf16-mixed", devices,
                  devices > 1 ? " full-shard (each rank's piece streamed, then gathered)" : "",
                  apart, losses, beside);
            beside_plain += !qlora && devices == 1 ? beside : 0;
        }
    check_stream_waits_matter(r, STREAM_WEIGHTS, beside_plain, "weight slots'",
                              "a block computed before its weights landed shows");
}

/* --offload embedding on the GPU: the token embedding in host memory, each micro-batch's rows
   gathered there and copied in beside the compute, give bitwise the weights and losses of the
   table on the device: LoRA bf16-mixed alone, QLoRA nf4 32-true with --offload
   state,activations,weights (recompute), and every weight trained (bf16-mixed, --offload
   state,gradients,weights), the table's gradient copied out and scattered on the host; on the
   emulator with deferred copies, without the compute's wait for the rows' copy block 0 reads
   the rows before they land. */
static void test_offload_embedding(results *r) {
    enum { LORA, QLORA, TRAINED, N_KINDS };
    static const char *const kinds[N_KINDS] = {
        "LoRA bf16-mixed", "QLoRA nf4 32-true with --offload state,activations,weights",
        "every weight trained, bf16-mixed with --offload state,gradients,weights"};
    for (int kind = 0; kind < N_KINDS; kind++) {
        lg_args a = step_args(kind == QLORA ? LG_PRECISION_32_TRUE : LG_PRECISION_BF16_MIXED,
                              LG_BACKEND_CUDA);
        a.global_batch_size = 3 * a.micro_batch_size;
        a.max_norm = 0.0f;
        if (kind != TRAINED) {
            a.lora.r = 2;
            a.lora.dropout = 0.0f;
            a.lora.quantize = kind == QLORA ? LG_QUANTIZE_NF4 : LG_QUANTIZE_NONE;
            a.lora.targets = LG_LORA_QUERY | LG_LORA_VALUE | LG_LORA_MLP | LG_LORA_HEAD;
        }
        if (kind == QLORA) a.offload = a.offload_activations = a.offload_weights = a.recompute = 1;
        if (kind == TRAINED) a.offload = a.offload_gradients = a.offload_weights = 1;
        lg_args b = a;
        b.offload_embedding = 1;
        double losses;
        unsigned long long beside = 0;
        double apart = streamed_run_apart(r, &a, &b, 5, 0, &losses, &beside);
        check(r, apart == 0 && losses == 0, "--offload embedding = the table on the device, on "
              "the GPU, %s, 5 blocks, 3 micro-batches a step, 3 steps: weights %.1e, losses "
              "%.1e apart (bitwise); %llu kernels launched beside a pending copy", kinds[kind],
              apart, losses, beside);
#ifdef LG_CUDA_EMULATE
        if (kind == LORA && copies_deferred()) {
            double losses_skipped;
            unsigned long long beside_skipped = 0;
            double skipped = streamed_run_apart(r, &a, &b, 5, 1, &losses_skipped, &beside_skipped);
            check(r, skipped > 1e-3 || losses_skipped > 1e-3, "the same with the wait for the "
                  "rows' copy removed, copies deferred: adapters %.1e, losses %.1e apart (block 0 "
                  "computed before its rows landed shows)", skipped, losses_skipped);
        }
#endif
    }
}

/* LoRA (every target of test-llama, dropout 0.1) and QLoRA (nf4, nf4-dq: the frozen linears
   dequantized on the GPU): the CUDA backend's adapters and losses after 3 steps against the
   CPU's, fp32 with AdamW (1e-4) and bf16-mixed with SGD (1e-2); with 2 GPUs when visible,
   full-shard. */
static void test_gpu_lora(results *r, int gpus) {
    for (int q = 0; q < 3; q++)
        for (int p = 0; p < 2; p++) {
            lg_precision precision = p ? LG_PRECISION_BF16_MIXED : LG_PRECISION_32_TRUE;
            lg_args cpu = step_args(precision, LG_BACKEND_CPU);
            cpu.lora.r = 4;
            cpu.lora.dropout = 0.1f;
            cpu.lora.targets = LG_LORA_QUERY | LG_LORA_KEY | LG_LORA_VALUE | LG_LORA_PROJECTION |
                               LG_LORA_MLP | LG_LORA_HEAD;
            cpu.lora.quantize = (lg_quantization)q;
            cpu.lr = 1e-2f;
            /* B starts at 0, so the adapters' scale is what the steps moved them; AdamW moves
               an element by about lr whatever its gradient, and a bf16 rounding that flips a
               tiny gradient's sign moves it the other way: SGD keeps the updates proportional */
            if (p) cpu.optimizer = LG_OPTIMIZER_SGD;
            lg_args gpu = cpu;
            gpu.backend = LG_BACKEND_CUDA;
            gpu.devices = gpus >= 2 ? 2 : 1;
            double losses, weights = runs_differ(&cpu, &gpu, 0, &losses);
            double tolerance = p ? 1e-2 : 1e-4;
            check(r, weights < tolerance && losses < tolerance,
                  "%-6s %-10s 3 steps on %d GPU%s, CUDA vs CPU: adapters %.1e, losses %.1e (< %.0e)",
                  q ? lg_quantization_name(cpu.lora.quantize) : "LoRA", lg_precision_name(precision),
                  gpu.devices, gpu.devices > 1 ? "s" : "", weights, losses, tolerance);
        }
}

/* QLoRA's NF4 lm_head a vocabulary tile at a time on the GPU: test-llama with a vocabulary
   of 1250 (padded 1280) in tiles of 512 rows (512, 512, 256), the head in chunks of 5 rows,
   adapters on every linear and the head, dropout 0.1: the CUDA backend's adapters and losses
   after 3 steps against the CPU's tiles and against its own whole head (one tile; the tiles
   split the sum of d_x over the vocabulary, the same order on the CPU only), within
   test_gpu_lora's tolerances. */
static void test_gpu_head_tiles(results *r) {
    lg_config cfg;
    if (llama_config(&cfg, 0) != 0) { check(r, 0, "configs/test-llama.yaml loads"); return; }
    cfg.vocab_size = 1250;
    cfg.padded_vocab_size = 1280;
    for (int q = LG_QUANTIZE_NF4; q <= LG_QUANTIZE_NF4_DQ; q++)
        for (int p = 0; p < 2; p++) {
            lg_precision precision = p ? LG_PRECISION_BF16_MIXED : LG_PRECISION_32_TRUE;
            lg_args cpu = step_args(precision, LG_BACKEND_CPU);
            cpu.lora.r = 4;
            cpu.lora.dropout = 0.1f;
            cpu.lora.targets = LG_LORA_QUERY | LG_LORA_KEY | LG_LORA_VALUE | LG_LORA_PROJECTION |
                               LG_LORA_MLP | LG_LORA_HEAD;
            cpu.lora.quantize = (lg_quantization)q;
            cpu.lora.head_tile_rows = LG_HEAD_TILE_ALIGN;
            cpu.head_rows = 5;
            cpu.lr = 1e-2f;
            if (p) cpu.optimizer = LG_OPTIMIZER_SGD; /* as test_gpu_lora */
            lg_args gpu = cpu, whole = cpu;
            gpu.backend = whole.backend = LG_BACKEND_CUDA;
            whole.lora.head_tile_rows = 3 * LG_HEAD_TILE_ALIGN;
            double losses, losses_whole, weights = runs_differ_on(&cfg, &cpu, &gpu, &losses);
            double weights_whole = runs_differ_on(&cfg, &whole, &gpu, &losses_whole);
            double tolerance = p ? 1e-2 : 1e-4;
            check(r, weights < tolerance && losses < tolerance && weights_whole < tolerance &&
                  losses_whole < tolerance, "%-6s %-10s vocab 1280, head tiles of 512, chunks of "
                  "5, 3 steps: CUDA vs CPU adapters %.1e, losses %.1e; vs the GPU's whole head "
                  "%.1e, %.1e (< %.0e)", lg_quantization_name(cpu.lora.quantize),
                  lg_precision_name(precision), weights, losses, weights_whole, losses_whole,
                  tolerance);
        }
}

/* Trains `steps` steps uninterrupted and, in two other trainers, `half` steps, a checkpoint,
   a resume, the rest and the final checkpoint (a->max_steps = steps): 1 when both give bitwise the same losses after the checkpoint and the
   same weights, 0 (with err) when they differ or a part fails. */
/* Removes a folder the test made, with what it holds (a path of our own, no quoting needed). */
static void remove_folder(const char *path) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    if (system(cmd) != 0) fprintf(stderr, "  (could not remove %s)\n", path);
}

static int resumed_equals_uninterrupted(const lg_config *cfg, const lg_args *a, const char *out,
                                        lg_error *err) {
    const int T = 16, steps = 4, half = 2;
    double full[4], resumed[4];
    lg_trainer one, first, second;
    lg_loader l2, l3;
    char dir[256];
    int step = -1;
    snprintf(dir, sizeof dir, "%s/step-%d", out, half);
    err->msg[0] = '\0';
    int rc = train_steps(&one, cfg, a, T, steps, full);
    rc = rc || lg_trainer_create(&first, cfg, a, T, err) || builtin_loader(&l2, cfg, a, T, steps) ||
         run_step_range(&first, &l2, 0, half, resumed) || lg_checkpoint_save(&first, &l2, half, out, err);
    rc = rc || lg_trainer_create(&second, cfg, a, T, err) || builtin_loader(&l3, cfg, a, T, steps) ||
         lg_checkpoint_resume(&second, &l3, dir, &step, err) || step != half ||
         run_step_range(&second, &l3, half, steps, resumed) ||
         lg_checkpoint_save(&second, &l3, steps, out, err); /* the last step's (LoRA: merged) */
    if (rc != 0) return 0; /* (what was made stays: the test has failed) */
    lg_real *w_full = trained_weights(&one), *w_resumed = trained_weights(&second);
    int same = memcmp(w_full, w_resumed, one.ranks[0].model.n_params * sizeof(lg_real)) == 0 &&
               memcmp(full + half, resumed + half, (steps - half) * sizeof(double)) == 0;
    LG_FREE(w_full);
    LG_FREE(w_resumed);
    lg_trainer_free(&one);
    lg_trainer_free(&first);
    lg_trainer_free(&second);
    lg_loader_close(&l2);
    lg_loader_close(&l3);
    return same;
}

/* A checkpoint of a GPU run resumed by a fresh trainer: 2 + 2 steps give bitwise the 4
   uninterrupted steps. Sharded (2 GPUs, full-shard, bf16-mixed; the state goes through host
   buffers) and unsharded, where the host reads and writes rank 0's state in
   GPU memory only through visits and the replicas copy it GPU to GPU: 1 GPU and 2 GPUs
   no-shard, fp32 and bf16-mixed, AdamW's 8-bit state (n_embd 64, so that matrices have it)
   with its block scales, and LoRA (its PEFT adapter files). Those of 2 GPUs need 2 visible. */
static void test_gpu_resume(results *r, int gpus) {
    static const struct {
        int devices, bf16, eight_bit, lora;
    } cases[] = {{2, 1, 0, 0}, {1, 0, 0, 0}, {1, 1, 0, 0}, {1, 0, 1, 0}, {1, 1, 0, 1},
                 {-2, 0, 0, 0}, {-2, 1, 1, 0}, {-2, 0, 0, 1}}; /* -2: 2 GPUs no-shard */
    mkdir("build", 0755); /* the checkpoints' parent (it exists after make) */
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int devices = cases[c].devices < 0 ? -cases[c].devices : cases[c].devices;
        if (devices > gpus) continue;
        lg_config cfg;
        if (llama_config(&cfg, cases[c].eight_bit) != 0) {
            check(r, 0, "test-llama's config loads");
            continue;
        }
        lg_args a = step_args(cases[c].bf16 ? LG_PRECISION_BF16_MIXED : LG_PRECISION_32_TRUE,
                              LG_BACKEND_CUDA);
        a.devices = devices;
        a.max_steps = 4; /* the steps of resumed_equals_uninterrupted */
        if (cases[c].devices < 0) a.strategy = LG_STRATEGY_NO_SHARD;
        if (cases[c].eight_bit) a.optimizer_state = LG_STATE_8BIT;
        if (cases[c].lora) {
            a.lora.r = 4;
            a.lora.targets = LG_LORA_QUERY | LG_LORA_VALUE | LG_LORA_MLP;
            a.lr = 1e-2f;
        }
        char out[64]; /* one folder a process: the emulated suite runs two side by side */
        snprintf(out, sizeof out, "build/gpu_resume_%ld_%zu", (long)getpid(), c);
        lg_error err;
        int same = resumed_equals_uninterrupted(&cfg, &a, out, &err);
        check(r, same, "checkpoint of %d GPU%s%s %-10s%s%s, resumed: bitwise the uninterrupted run%s%s",
              devices, devices > 1 ? "s" : "", devices > 1 ? (cases[c].devices < 0 ? " no-shard" : " full-shard") : "",
              lg_precision_name(a.precision), cases[c].eight_bit ? " 8-bit state" : "",
              cases[c].lora ? " LoRA" : "", err.msg[0] ? ": " : "", err.msg);
        if (same) remove_folder(out); /* a failed case's checkpoints stay, to look at */
    }
}

/* -d N on N GPUs (NCCL) equals -d 1, for every strategy, at fp32 (N = 2, or all when fewer). */
static void test_devices(results *r, int gpus) {
    static const lg_strategy strategies[4] = {LG_STRATEGY_NO_SHARD, LG_STRATEGY_SHARD_GRAD_OP,
                                              LG_STRATEGY_FULL_SHARD, LG_STRATEGY_HYBRID_SHARD};
    const int T = 16, steps = 3;
    if (gpus < 2) {
        printf("  (one GPU: -d 1 vs -d N not checked)\n");
        return;
    }
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    lg_args one = step_args(LG_PRECISION_32_TRUE, LG_BACKEND_CUDA);
    one.global_batch_size = 8; /* divides over 2 and 4 ranks of -b 2 */
    double one_losses[3], losses[3];
    lg_trainer tr1;
    if (train_steps(&tr1, &cfg, &one, T, steps, one_losses) != 0) {
        check(r, 0, "-d 1 trains on a GPU");
        return;
    }
    lg_real *want = trained_weights(&tr1);
    size_t n = tr1.ranks[0].model.n_params;
    lg_trainer_free(&tr1);
    for (int s = 0; s < 4; s++) {
        lg_args a = one;
        a.strategy = strategies[s];
        a.devices = 2;
        if (strategies[s] == LG_STRATEGY_HYBRID_SHARD) {
            if (gpus < 4) continue;
            a.nodes = 2;
        }
        lg_trainer tr;
        if (train_steps(&tr, &cfg, &a, T, steps, losses) != 0) {
            check(r, 0, "-d %d --strategy %s trains", a.devices * a.nodes, lg_strategy_name(a.strategy));
            continue;
        }
        lg_real *got = trained_weights(&tr);
        double weights = rel_error(lg_buf_of(got), lg_buf_of(want), n), loss = 0;
        for (int k = 0; k < steps; k++) loss = fmax(loss, fabs(losses[k] - one_losses[k]) / one_losses[k]);
        check(r, weights < 1e-5 && loss < 1e-5,
              "-d %d x --nodes %d --strategy %-13s = -d 1 on GPUs: weights %.1e, losses %.1e",
              a.devices, a.nodes, lg_strategy_name(a.strategy), weights, loss);
        LG_FREE(got);
        lg_trainer_free(&tr);
    }
    LG_FREE(want);
}

/* The host numbers of runs over processes (the step's loss, the gradient norm's squares) go
   through the GPUs: copied to each member's buffer on its communication stream, summed or
   gathered by NCCL, copied back. Here over the ranks of one process (2 GPUs): member 0 brings
   the values, the others zeros, so the sum is the values; a gather of one value a member gives
   each member's. A copy out of order with the collective gives zeros or stale numbers. */
static void test_host_numbers(results *r, int gpus) {
    if (gpus < 2) return;
    lg_config cfg;
    lg_error err;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    lg_args a = step_args(LG_PRECISION_32_TRUE, LG_BACKEND_CUDA);
    a.devices = 2;
    lg_trainer tr;
    if (lg_trainer_create(&tr, &cfg, &a, 16, &err) != 0) {
        check(r, 0, "host numbers: a trainer of 2 GPUs: %s", err.msg);
        return;
    }
    lg_rank *members[2] = {&tr.ranks[0].rank, &tr.ranks[1].rank};
    lg_comm *c = lg_comm_create(2, members, &err);
    if (!c) {
        check(r, 0, "host numbers: a communicator of 2 GPUs: %s", err.msg);
        lg_trainer_free(&tr);
        return;
    }
    int same = 1;
    for (int round = 0; round < 3; round++) { /* new numbers each time: none stale */
        double sums[3] = {1.5 + round, -2e-7 * (round + 1), 3e10 + round}, want[3];
        memcpy(want, sums, sizeof want);
        lg_comm_sum_doubles(c, sums, 3);
        double gathered[2] = {7.0 + round, -9.25 * (round + 1)};
        double gather_want[2] = {gathered[0], gathered[1]};
        lg_comm_gather_doubles(c, gathered, 2);
        same &= memcmp(sums, want, sizeof want) == 0 && memcmp(gathered, gather_want, sizeof gathered) == 0;
    }
    check(r, same, "host numbers over 2 GPUs (sum and gather through the communication streams, 3 "
                   "rounds): each round's own numbers");
    lg_comm_free(c);
    lg_trainer_free(&tr);
}

/* --- memory: the plan against what the GPU reports ------------------------------------------ */

/* During a step of a run, the memory in use on GPU 0 (cudaMemGetInfo) against the plan's
   device total. On a GPU the plan holds the runtime's measured share, so the two should be
   within 3%; in the emulator there is no runtime, and the arena is exactly the plan. */
static void test_plan_memory(results *r, const char *config, int T, int B) {
    lg_config cfg;
    lg_error err;
    if (load_config_or_fail(r, &cfg, config)) return;
    lg_args a = step_args(LG_PRECISION_BF16_MIXED, LG_BACKEND_CUDA);
    a.micro_batch_size = a.global_batch_size = B;
    size_t before_free, total;
    if (lg_cuda_memory(0, &before_free, &total, &err) != 0 ||
        lg_cuda_measure_runtime(1, 0, &a.runtime_bytes, &a.device_bytes, &err) != 0) {
        check(r, 0, "plan vs memory: %s", err.msg);
        return;
    }
    lg_trainer tr;
    double losses[2];
    if (train_steps(&tr, &cfg, &a, T, 2, losses) != 0) {
        check(r, 0, "plan vs memory: %s trains", config);
        return;
    }
    size_t free_bytes;
    lg_cuda_memory(0, &free_bytes, &total, &err);
    size_t used = total - free_bytes, planned = lg_plan_bytes(&tr.plan, LG_POOL_DEVICE);
    double off = fabs((double)used - (double)planned);
    char used_text[32], plan_text[32];
    check(r, off < 64.0 * (1 << 20), "%s -b %d -t %d bf16-mixed: GPU memory in use %s, plan %s "
          "(%.1f MiB apart, < 64 MiB)", config, B, T, lg_format_bytes(used, used_text, sizeof used_text),
          lg_format_bytes(planned, plan_text, sizeof plan_text), off / (1 << 20));
    lg_trainer_free(&tr);
}

/* The device arena of a's plan of cfg at T tokens on rank 0 (0 when there is no plan). */
static size_t planned_arena(const lg_config *cfg, const lg_args *a, int T) {
    lg_plan_spec spec;
    lg_plan plan;
    lg_error err;
    lg_plan_spec_from_args(&spec, a, T);
    if (lg_plan_make(&plan, cfg, &spec, &err) != 0) return 0;
    size_t arena = lg_cuda_arena_bytes(&plan.ranks[0]);
    lg_plan_free(&plan);
    return arena;
}

/* A plan whose device arena exceeds the GPU's free memory is refused before the arena is asked
   for: Meta-Llama-3-8B bf16-mixed (about 145 GB of model state), with the micro-batch doubled
   until the arena is over the free memory, so that no memory needs to be taken first (taking
   nearly all of it left too little for the trainer's own streams and handles). lg_trainer_create
   fails saying what is free, and the memory in use grows by under 1 GiB (nothing of the
   arena's size: the trainer's streams and handles at most). */
static void test_plan_refused(results *r) {
    lg_config cfg;
    lg_error err;
    if (load_config_or_fail(r, &cfg, "Meta-Llama-3-8B")) return;
    lg_args a = step_args(LG_PRECISION_BF16_MIXED, LG_BACKEND_CUDA);
    const int T = 1024;
    size_t free_before, free_after, total, arena = 0;
    if (lg_cuda_memory(0, &free_before, &total, &err) != 0) {
        check(r, 0, "plan refused: %s", err.msg);
        return;
    }
    for (int b = 1; b <= 4096; b *= 2) {
        a.micro_batch_size = a.global_batch_size = b;
        arena = planned_arena(&cfg, &a, T);
        if (arena == 0 || arena > free_before + free_before / 16) break;
    }
    if (arena <= free_before) {
        check(r, 0, "plan refused: no plan of Meta-Llama-3-8B above %zu free bytes", free_before);
        return;
    }
    lg_trainer tr;
    int rc = lg_trainer_create(&tr, &cfg, &a, T, &err);
    lg_cuda_memory(0, &free_after, &total, &err);
    size_t grew = free_before > free_after ? free_before - free_after : 0;
    check(r, rc != 0 && strstr(err.msg, "free of") && grew < ((size_t)1 << 30),
          "a %zu-byte arena (-b %d) with %zu bytes free: refused, %zu bytes more in use (< 1 GiB) (%s)", arena,
          a.micro_batch_size, free_before, grew, rc ? err.msg : "created");
    if (rc == 0) lg_trainer_free(&tr);
}

/* A driver's speller for the test: `memory_margin` is --memory-margin, nothing else a flag. */
static const char *margin_flag(const char *key, int with_value, void *unused, char *name,
                               size_t size) {
    (void)with_value, (void)unused;
    if (strcmp(key, "memory_margin") != 0) return NULL;
    snprintf(name, size, "--memory-margin");
    return name;
}

/* The line of a rank that cuBLASLt stopped names the margin by its setting, as the library's
   messages do, and a driver's speller makes it the driver's flag (lg_spell_settings, as
   train.c does with the step's error). */
static void test_out_of_memory_line(results *r) {
    lg_config cfg;
    lg_error err;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    lg_args a = step_args(LG_PRECISION_32_TRUE, LG_BACKEND_CUDA);
    lg_trainer tr;
    if (lg_trainer_create(&tr, &cfg, &a, 16, &err) != 0) {
        check(r, 0, "out-of-memory line: %s", err.msg);
        return;
    }
    char line[1024], spelled[1024];
    lg_lt_out_of_memory_line(tr.ranks[0].rank.cuda, 64, 32, 16, line, sizeof line);
    check(r, strstr(line, "a 64 x 32 x 16 matmul") &&
                 strstr(line, "a larger `memory_margin` keeps more free"),
          "cuBLASLt's out-of-memory line names the setting: %s", line);
    lg_spell_settings(line, margin_flag, NULL, spelled, sizeof spelled);
    check(r, strstr(spelled, "a larger --memory-margin keeps more free") && !strchr(spelled, '`'),
          "cuBLASLt's out-of-memory line spelled by a driver: %s", spelled);
    lg_trainer_free(&tr);
}

/* A GPU that stops on a failure its op cannot return: cuBLASLt out of memory, which only a
   real GPU runs into, so here the rank is stopped with its line as that branch does
   (lg_cuda_stop). The next step returns the line with out_of_memory set and updates no weight,
   and evaluation returns it too. Without the trainer's check the step would succeed. */
static void test_stopped_rank(results *r) {
    const int T = 16;
    lg_config cfg;
    lg_error err, eval_err;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    lg_args a = step_args(LG_PRECISION_32_TRUE, LG_BACKEND_CUDA);
    lg_trainer tr;
    lg_loader ld;
    double first_loss;
    if (train_steps(&tr, &cfg, &a, T, 1, &first_loss) != 0 || builtin_loader(&ld, &cfg, &a, T, 2)) {
        check(r, 0, "a stopped GPU: test-llama trains a step");
        return;
    }
    lg_cuda_rank *g = tr.ranks[0].rank.cuda;
    char line[1024];
    lg_cuda_stop(g, lg_lt_out_of_memory_line(g, 64, 32, 16, line, sizeof line));
    lg_real *before = trained_weights(&tr);
    lg_step_stats st;
    memset(&st, 0, sizeof st);
    int rc = lg_trainer_step(&tr, &ld, 1, &st, &err);
    lg_real *after = trained_weights(&tr);
    int unchanged = memcmp(before, after, tr.ranks[0].model.n_params * sizeof(lg_real)) == 0;
    double mean = 0;
    int eval_rc = lg_trainer_evaluate(&tr, &ld, 1, &mean, &eval_err);
    check(r, rc != 0 && st.out_of_memory && !strcmp(err.msg, line) && unchanged && eval_rc != 0 &&
                 !strcmp(eval_err.msg, line),
          "a GPU stopped by cuBLASLt's out-of-memory: the step returns %d (out_of_memory %d), "
          "weights %s, evaluation returns %d, with the line: %s", rc, st.out_of_memory,
          unchanged ? "unchanged" : "CHANGED", eval_rc, err.msg);
    LG_FREE(before);
    LG_FREE(after);
    lg_loader_close(&ld);
    lg_trainer_free(&tr);
}

/* --- benchmark --------------------------------------------------------------------------------- */

/* Dense bf16 peaks (FLOP/s) of the GPUs the table knows, by name. */
static double bf16_peak(const char *name) {
    static const struct { const char *part; double flops; } peaks[] = {
        {"H200", 989e12}, {"H100 SXM", 989e12}, {"H100 PCIe", 756e12}, {"H100", 989e12},
        {"A100", 312e12}, {"L40S", 362e12}, {"A10", 125e12},
    };
    for (size_t i = 0; i < sizeof peaks / sizeof peaks[0]; i++)
        if (strstr(name, peaks[i].part)) return peaks[i].flops;
    return 0;
}

/* ld over n random tokens below vocab_size drawn from seed (the loader owns them); 0, or -1
   with the message in err. */
static int random_loader(lg_loader *ld, size_t n, int T, int vocab_size, uint64_t seed,
                         lg_error *err) {
    uint32_t *tokens = (uint32_t *)malloc(n * sizeof(uint32_t));
    if (!tokens) return lg_fail(err, "random tokens: out of memory");
    lg_rng rng;
    lg_rng_seed(&rng, seed);
    for (size_t k = 0; k < n; k++) tokens[k] = (uint32_t)(lg_rng_u64(&rng) % vocab_size);
    return lg_loader_from_memory(ld, tokens, n, T, vocab_size, 0, 1, err);
}

/* GPT-2 124M, bf16-mixed, T 1024, B 16..64: tokens/s and MFU (6N + 12 L C T FLOPs a token). */
static void bench(void) {
    lg_config cfg;
    lg_error err;
    if (lg_config_load(&cfg, "configs/gpt2.yaml", &err) != 0) {
        fprintf(stderr, "%s\n", err.msg);
        return;
    }
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    double peak = bf16_peak(prop.name);
    const int T = 1024, batches[3] = {16, 32, 64}, warmup = 3, timed = 10;
    printf("%-28s %5s %6s %12s %8s\n", "GPT-2 124M bf16-mixed", "B", "T", "tokens/s", "MFU");
    for (int i = 0; i < 3; i++) {
        lg_args a = step_args(LG_PRECISION_BF16_MIXED, LG_BACKEND_CUDA);
        a.micro_batch_size = a.global_batch_size = batches[i];
        lg_cuda_measure_runtime(1, 0, &a.runtime_bytes, &a.device_bytes, &err);
        lg_trainer tr;
        if (lg_trainer_create(&tr, &cfg, &a, T, &err) != 0) {
            printf("%-28s %5d %6d   %s\n", prop.name, batches[i], T, err.msg);
            continue;
        }
        lg_loader ld;
        random_loader(&ld, (size_t)(warmup + timed + 1) * batches[i] * T + 1, T, cfg.vocab_size, 1, &err);
        double start = 0;
        for (int s = 0; s < warmup + timed; s++) {
            if (s == warmup) start = lg_time_ms();
            lg_step_stats st;
            lg_trainer_step(&tr, &ld, s, &st, &err);
        }
        double seconds = (lg_time_ms() - start) / 1e3;
        double tokens_per_s = (double)timed * batches[i] * T / seconds;
        double flops = 6.0 * tr.ranks[0].model.n_params + 12.0 * cfg.n_layer * cfg.n_embd * T;
        printf("%-28s %5d %6d %12.0f %7.1f%%\n", prop.name, batches[i], T, tokens_per_s,
               peak > 0 ? 100 * tokens_per_s * flops / peak : 0.0);
        lg_loader_close(&ld);
        lg_trainer_free(&tr);
    }
}

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* What the --offload parts cost on this GPU, and how much of their copies the compute hides:
   `config` (configs/tiny-llama-1.1b.yaml on a GPU, whose token table is its own; any config
   on the emulator) in bf16-true with AdamW, -b 1 -t T, two micro-batches a step, --offload
   state alone and with gradients, weights and both streamed, and with the table trained on
   the host (refused for a tied table). Each line: ms a step (the median of the timed steps),
   the plan's host traffic and its time at LG_PCIE_BYTES_PER_S_ESTIMATE, the step's time
   beyond state's against that estimate (0%: the copies hidden behind the compute; 100%: none
   of them), and the rate the step sustained by the plan's FLOPs (lg_plan_step_flops). */
static void bench_offload(const char *config, int T) {
    static const struct { const char *name; int gradients, weights, embedding; } modes[] = {
        {"state", 0, 0, 0}, {"state,gradients", 1, 0, 0}, {"state,weights", 0, 1, 0},
        {"state,gradients,weights", 1, 1, 0}, {"state,gradients,weights,embedding", 1, 1, 1}};
    const int warmup = 2, timed = 5;
    lg_config cfg;
    lg_error err;
    if (lg_config_load(&cfg, config, &err) != 0) {
        printf("bench-offload: %s\n", err.msg);
        return;
    }
    printf("%s, bf16-true, -b 1 -t %d -g 2, AdamW:\n", cfg.name, T);
    printf("  %-34s %9s %10s %9s %9s %9s\n", "--offload", "ms/step", "host GiB", "plan ms", "exposed",
           "TFLOP/s");
    double state_ms = 0;
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
        lg_args a = step_args(LG_PRECISION_BF16_TRUE, LG_BACKEND_CUDA);
        a.micro_batch_size = 1;
        a.global_batch_size = 2;
        a.max_norm = 0.0f;
        a.offload = 1;
        a.offload_gradients = modes[i].gradients;
        a.offload_weights = modes[i].weights;
        a.offload_embedding = modes[i].embedding; /* (refused for a tied table: said below) */
        lg_trainer tr;
        if (lg_trainer_create(&tr, &cfg, &a, T, &err) != 0) {
            printf("  %-34s %s\n", modes[i].name, err.msg);
            continue;
        }
        lg_loader ld;
        double ms[16];
        int loaded = random_loader(&ld, (size_t)(warmup + timed + 1) * 2 * T + 1, T, cfg.vocab_size, 1, &err) == 0;
        int rc = !loaded;
        for (int s = 0; rc == 0 && s < warmup + timed; s++) {
            lg_step_stats st;
            rc = lg_trainer_step(&tr, &ld, s, &st, &err);
            if (s >= warmup) ms[s - warmup] = st.ms;
        }
        if (rc == 0) {
            qsort(ms, timed, sizeof ms[0], compare_doubles);
            double step = ms[timed / 2], bytes = (double)lg_plan_host_traffic_bytes(&tr.plan);
            double plan_ms = bytes / LG_PCIE_BYTES_PER_S_ESTIMATE * 1e3;
            if (i == 0) state_ms = step;
            printf("  %-34s %9.1f %10.3f %9.1f %8.0f%% %9.1f\n", modes[i].name, step,
                   bytes / 1073741824.0, plan_ms, plan_ms > 0 ? 100 * (step - state_ms) / plan_ms : 0.0,
                   lg_plan_step_flops(&tr.plan) / (step / 1e3) / 1e12);
        } else {
            printf("  %-34s %s\n", modes[i].name, err.msg);
        }
        if (loaded) lg_loader_close(&ld);
        lg_trainer_free(&tr);
    }
}

/* The runtime measured on GPU 0 (lg_cuda_measure_runtime, the stack limit raised first and the
   code loaded lazily later counted) against litgpt.h's estimate for a card like it (its SMs,
   threads a SM and compute capability): the reading that replaces the estimate's figures
   (LG_CUDA_CONTEXT_BYTES_PER_THREAD, lg_cuda_arch_codes) and README's table with them. */
static void runtime_against_estimate(void) {
    cudaDeviceProp prop;
    lg_error err;
    size_t runtime = 0, total = 0;
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess ||
        lg_cuda_measure_runtime(1, 0, &runtime, &total, &err) != 0) {
        printf("cuda.runtime: not measured\n");
        return;
    }
    lg_gpu_card card = {"this", prop.name, total >> 20, 0, prop.major, prop.minor,
                        (int)prop.sharedMemPerBlockOptin, prop.multiProcessorCount,
                        prop.maxThreadsPerMultiProcessor};
    lg_cuda_runtime_parts parts;
    lg_cuda_runtime_estimate_parts(&card, 0, &parts);
    char measured[32], lazy[32], estimate[32], described[320];
    printf("cuda.runtime on %s (%d SMs x %d threads, sm_%d%d): measured %s (%s of it the code "
           "loaded lazily later, counted not measured); estimated %s (%s)\n", prop.name,
           card.sms, card.threads_per_sm, card.major, card.minor,
           lg_format_bytes(runtime, measured, sizeof measured),
           lg_format_bytes(lg_cuda_lazy_code_bytes(card.major, card.minor), lazy, sizeof lazy),
           lg_format_bytes(lg_cuda_runtime_parts_sum(&parts), estimate, sizeof estimate),
           lg_cuda_runtime_parts_describe(&parts, described, sizeof described));
}

/* `long-context` (a GPU machine's tests/gpu/run.sh, early): README's long-context setup on
   this GPU at two lengths: Llama 3.1 8B's shapes (random weights), QLoRA nf4 on every linear,
   r 32, bf16-true, --recompute block, the head in chunks of 1024, the MLP in slices of 2048,
   --offload activations; 2 steps each, printing the plan's device bytes against the memory in
   use after them (cudaMemGetInfo; the arena is taken once, so that is the peak) and the second
   step's time. The lengths fit an H200 in a minute or two. */
static void long_context(void) {
    lg_config cfg;
    lg_error err;
    if (lg_config_load(&cfg, "configs/Llama-3.1-8B.yaml", &err) != 0) {
        fprintf(stderr, "%s\n", err.msg);
        return;
    }
    const int lengths[2] = {8192, 32768};
    runtime_against_estimate();
    printf("%-44s %6s %12s %12s %10s\n", "Llama 3.1 8B QLoRA r 32, every lever", "T", "plan",
           "in use", "step s");
    for (int i = 0; i < 2; i++) {
        int T = lengths[i];
        lg_args a = step_args(LG_PRECISION_BF16_TRUE, LG_BACKEND_CUDA);
        a.micro_batch_size = a.global_batch_size = 1;
        a.lora.r = 32;
        a.lora.quantize = LG_QUANTIZE_NF4;
        lg_lora_targets_parse("all", &a.lora.targets, &err);
        a.recompute = a.offload_activations = 1;
        a.head_rows = LG_HEAD_CHUNK_ROWS;
        a.slice_rows = LG_SLICE_ROWS;
        size_t free_before, total, free_after;
        lg_cuda_measure_runtime(1, 0, &a.runtime_bytes, &a.device_bytes, &err);
        lg_cuda_memory(0, &free_before, &total, &err);
        lg_trainer tr;
        if (lg_trainer_create(&tr, &cfg, &a, T, &err) != 0) {
            printf("%-44s %6d   %s\n", "", T, err.msg);
            continue;
        }
        lg_loader ld;
        random_loader(&ld, (size_t)3 * T + 1, T, cfg.vocab_size, 7, &err);
        double start = 0;
        int rc = 0;
        for (int s = 0; s < 2 && rc == 0; s++) {
            lg_step_stats st;
            if (s == 1) start = lg_time_ms();
            rc = lg_trainer_step(&tr, &ld, s, &st, &err);
        }
        double seconds = (lg_time_ms() - start) / 1e3;
        lg_cuda_memory(0, &free_after, &total, &err);
        char plan_text[32], used_text[32];
        lg_format_bytes(lg_plan_bytes(&tr.plan, LG_POOL_DEVICE), plan_text, sizeof plan_text);
        lg_format_bytes(total - free_after, used_text, sizeof used_text);
        if (rc == 0)
            printf("%-44s %6d %12s %12s %10.2f\n", "", T, plan_text, used_text, seconds);
        else
            printf("%-44s %6d   step failed: %s\n", "", T, err.msg);
        lg_loader_close(&ld);
        lg_trainer_free(&tr);
    }
}

/* lg_cuda_linear_forward_into with bias writes its columns of a wider output (the NF4 head's
   tiles): columns 6 .. 6 + OC of rows 80 apart equal the CPU's (N, OC), the others untouched;
   each storage type, the reference kernel (its bias add honours the leading dimension) or
   cuBLASLt (its bias epilogue). */
static void test_linear_columns(results *r, int reference) {
    const int N = 37, IC = 40, OC = 70, ld = OC + 10, column = 6;
    lg_rng rng;
    lg_rng_seed(&rng, 12);
    lg_exec ex = gpu_exec(64, 64);
    ex.cuda->reference_matmul = reference;
    for (int d = 0; d < 3; d++) {
        lg_dtype dtype = storage_types[d];
        lg_buf inp = random_buf(dtype, (size_t)N * IC, 1, &rng);
        lg_buf w = random_buf(dtype, (size_t)OC * IC, 0.2f, &rng), bias = random_buf(dtype, OC, 1, &rng);
        lg_buf want = poisoned_buf(dtype, (size_t)N * OC), wide = poisoned_buf(dtype, (size_t)N * ld);
        lg_buf got = poisoned_buf(dtype, (size_t)N * OC);
        for (size_t i = 0; i < (size_t)N * ld; i++) lg_set(wide, i, 7.0f);
        lg_linear_forward(NULL, want, inp, w, bias, N, IC, OC);
        lg_cuda_linear_forward_into(&ex, lg_at(wide, column), ld, inp, w, bias, N, IC, OC);
        gpu_sync(&ex);
        int untouched = 1;
        for (int n = 0; n < N; n++)
            for (int o = 0; o < ld; o++) {
                float x = lg_get(wide, (size_t)n * ld + o);
                if (o >= column && o < column + OC) lg_set(got, (size_t)n * OC + o - column, x);
                else untouched = untouched && x == 7.0f;
            }
        double worst = rel_error(got, want, (size_t)N * OC);
        check(r, worst < tolerance_of(dtype, 1e-5) && untouched, "linear forward with bias (%s) "
              "%s into columns %d .. %d of rows %d apart: rel err %.1e, the other columns "
              "untouched: %s", reference ? "reference kernel" : "cuBLASLt", lg_dtype_name(dtype),
              column, column + OC, ld, worst, untouched ? "yes" : "no");
        lg_buf all[6] = {inp, w, bias, want, wide, got};
        for (int k = 0; k < 6; k++) gpu_free(all[k].data);
    }
    gpu_exec_free(&ex);
}

/* --- modes: one group of checks a process (tests/gpu/run.sh) ---------------------------------- */

static void mode_ops(results *r, int gpus) {
    (void)gpus;
    printf("ops\n");
    test_kernels(r);
    test_residual_norm(r);
    test_matmul(r, 1, 0);
    test_linear(r, 1);
    test_linear_columns(r, 1);
#ifndef LG_CUDA_EMULATE
    test_matmul(r, 0, 0);
    test_matmul(r, 0, 1);
    test_linear(r, 0);
    test_linear_columns(r, 0);
#endif
}

static void mode_attention(results *r, int gpus) {
    (void)gpus;
    test_attention(r);
}

static void mode_steps(results *r, int gpus) {
    (void)gpus;
    printf("training steps\n");
    test_training_steps(r);
}

static void mode_grads(results *r, int gpus) {
    printf("gradients written on the first micro-batch\n");
    test_grads_written(r, gpus);
}

static void mode_features(results *r, int gpus) {
    printf("features: optimizers, compact state, LoRA\n");
    test_gpu_features(r);
    test_gpu_lora(r, gpus);
    test_gpu_head_tiles(r);
    test_offload_overlap(r);
    test_offload_gradients(r);
    test_offload_weights(r);
    test_offload_embedding(r);
}

static void mode_combinations(results *r, int gpus) {
    printf("lever combinations: every pair trains the same model\n");
    test_combinations_cuda(r, gpus);
}

static void mode_resume(results *r, int gpus) {
    printf("checkpoints resumed\n");
    test_gpu_resume(r, gpus);
}

static void mode_devices(results *r, int gpus) {
    printf("devices: -d N against -d 1, the collectives' deadline\n");
    test_devices(r, gpus);
    test_host_numbers(r, gpus);
    test_comm_deadline(r, gpus);
}

static void mode_memory(results *r, int gpus) {
    (void)gpus;
    printf("memory\n");
    test_plan_memory(r, "test-llama", 16, 2);
    test_plan_refused(r);
    test_out_of_memory_line(r);
    test_stopped_rank(r);
#ifndef LG_CUDA_EMULATE
    test_plan_memory(r, "Llama-3.2-1B", 2048, 4);
#endif
}

/* The modes, in the order a whole run takes them: `test_cuda MODE...` runs those named. */
typedef struct {
    const char *name;
    void (*run)(results *r, int gpus);
} test_mode;

static const test_mode modes[] = {
    {"ops", mode_ops},           {"attention", mode_attention}, {"steps", mode_steps},
    {"grads", mode_grads},       {"features", mode_features},   {"resume", mode_resume},
    {"devices", mode_devices},   {"memory", mode_memory},       {"combinations", mode_combinations},
};
enum { N_MODES = sizeof modes / sizeof modes[0] };

static const test_mode *find_mode(const char *name) {
    for (int i = 0; i < N_MODES; i++)
        if (strcmp(modes[i].name, name) == 0) return &modes[i];
    return NULL;
}

static void usage(FILE *to) {
    fprintf(to, "usage: test_cuda [MODE...] | test_cuda bench | test_cuda bench-attention | "
                "test_cuda long-context | test_cuda --list"
                " | test_cuda --probe\n"
                "  no MODE: every mode in this order:");
    for (int i = 0; i < N_MODES; i++) fprintf(to, " %s", modes[i].name);
    fprintf(to, "\n");
}

/* The GPUs' description line ("CUDA backend on 2 x NVIDIA H200"). */
static void print_devices(int gpus) {
#ifdef LG_CUDA_EMULATE
    printf("CUDA backend on the emulator (%d device%s)\n", gpus, gpus > 1 ? "s" : "");
#else
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, 0);
    printf("CUDA backend on %d x %s\n", gpus, prop.name);
#endif
}

/* --probe: what the CUDA runtime sees, for run.sh to tell "no GPU" from "a driver older than
   the runtime these binaries carry". */
static int probe(void) {
#ifdef LG_CUDA_EMULATE
    printf("runtime: the emulator, %d device(s)\n", lg_cuda_device_count());
    return lg_cuda_device_count() > 0 ? 0 : 2;
#else
    int runtime = 0, driver = 0, n = 0;
    cudaRuntimeGetVersion(&runtime);
    cudaDriverGetVersion(&driver);
    cudaError_t status = cudaGetDeviceCount(&n);
    printf("runtime: CUDA %d.%d (built in), driver: CUDA %d.%d, devices: %d (%s)\n", runtime / 1000,
           runtime % 1000 / 10, driver / 1000, driver % 1000 / 10, status == cudaSuccess ? n : 0,
           cudaGetErrorString(status));
    if (status == cudaSuccess && n > 0) print_devices(n);
    return status == cudaSuccess && n > 0 ? 0 : 2;
#endif
}

int main(int argc, char **argv) {
    results r = {0, 0};
    /* a line reaches the log as it is printed, so that an abort (lg_cuda_die) or a kill by
       run.sh's timeout loses nothing that was said */
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 2 && strcmp(argv[1], "--probe") == 0) return probe();
    if (argc > 1 && strcmp(argv[1], "--list") == 0) {
        for (int i = 0; i < N_MODES; i++) printf("%s\n", modes[i].name);
        return 0;
    }
    int bench_mode = argc == 2 && (strcmp(argv[1], "bench") == 0 || strcmp(argv[1], "--bench") == 0);
    int bench_attention_mode = argc == 2 && (strcmp(argv[1], "bench-attention") == 0 ||
                                             strcmp(argv[1], "--bench-attention") == 0);
    int long_context_mode = argc == 2 && strcmp(argv[1], "long-context") == 0;
    /* bench-offload [CONFIG [T]] */
    int bench_offload_mode = argc >= 2 && argc <= 4 && strcmp(argv[1], "bench-offload") == 0;
    for (int i = 1; i < argc && !bench_mode && !bench_attention_mode && !long_context_mode &&
                    !bench_offload_mode; i++)
        /* before any GPU work */
        if (!find_mode(argv[i])) {
            fprintf(stderr, "test_cuda: unknown mode '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
    setenv("CUDA_MODULE_LOADING", "LAZY", 0); /* as train.c: kernels load when launched */
    int gpus = lg_cuda_device_count();
    if (gpus == 0) {
        printf("test_cuda: no GPU visible\n");
        return 2;
    }
    if (bench_mode) bench();
    if (bench_attention_mode) bench_attention();
    if (long_context_mode) long_context();
    if (bench_offload_mode)
        bench_offload(argc > 2 ? argv[2] : "configs/tiny-llama-1.1b.yaml", argc > 3 ? atoi(argv[3]) : 2048);
    if (bench_mode || bench_attention_mode || long_context_mode || bench_offload_mode) return 0;
    print_devices(gpus);
    for (int i = 0; i < N_MODES; i++)
        if (argc == 1) modes[i].run(&r, gpus);
    for (int i = 1; i < argc; i++) find_mode(argv[i])->run(&r, gpus);
    printf("%d passed, %d failed\n", r.passed, r.failed);
    return r.failed ? 1 : 0;
}
