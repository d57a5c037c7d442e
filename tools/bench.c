/* tools/bench.c — training throughput of litgpt.c on the CPU (make bench).

   ./tools/bench [--ops] [--recompute] [--offload] [--offload-modes] [-c configs/bench.yaml]
                 [-b 4] [-t 256]
                 [-s steps] [-p 32-true]
   ./tools/bench --generate [-c CONFIG] [-t PROMPT] [--new N] [-p 32-true]

   Trains the model of configs/bench.yaml (6 layers, 384 wide, Llama-style) in 32-true with
   AdamW on random tokens: 2 warm-up steps, then times the next steps (forward + backward +
   clipping + optimizer) and prints one line in the same form as tools/bench_torch.py.

   --ops first prints where a step's time goes: the processor and the matmul kernel path, then
   each op of the step at the model's shapes with its own buffers (every matmul of a linear,
   forward and both backward products; attention; norms; SwiGLU; cross-entropy; the optimizer;
   a copy of the weights), the median of repeated calls in ms, the times it runs in a step and
   its share, matmuls also in GFLOP/s on the portable path and on the processor's. The paths
   alternate call by call, so load from other processes falls on both alike.

   --generate times the KV-cache generator instead (prefill and decode tokens/s).

   --offload-modes trains the model plain and with each --offload part, in turns, and prints
   each one's tokens/s against plain. */
#define LITGPT_IMPLEMENTATION
#include "../litgpt.h"

#include <stdarg.h>
#include <string.h>

#define BENCH_REPS 7 /* calls timed per op; the median is reported */

/* The settings the library's messages may name that a flag of bench's sets; any other is
   named alone (lg_setting_flag). */
static const lg_setting_flag_row setting_flags[] = {
    {"micro_batch_size", "-b"}, {"max_seq_length", "-t"}, {"precision", "-p"}, {NULL, NULL}};

/* A line on stderr, its settings spelled as bench's flags. */
static void complain(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    lg_tool_vcomplain("bench", setting_flags, fmt, ap);
    va_end(ap);
}

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof(double), compare_doubles);
    return v[n / 2];
}

/* The processor's name from /proc/cpuinfo, or "unknown". */
static void processor_name(char *out, size_t size) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    snprintf(out, size, "unknown");
    while (f && fgets(line, sizeof line, f)) {
        char *colon = strchr(line, ':');
        if (strncmp(line, "model name", 10) != 0 || !colon) continue;
        snprintf(out, size, "%s", colon + 2);
        out[strcspn(out, "\n")] = 0;
        break;
    }
    if (f) fclose(f);
}

/* n elements of dtype, N(0, 0.5) (LG_MALLOC'd). */
static lg_buf random_buf(lg_dtype dtype, size_t n, lg_rng *rng) {
    lg_buf b = {lg_alloc_zeroed(n * sizeof(float)), dtype};
    for (size_t i = 0; i < n; i++) lg_set(b, i, 0.5f * lg_rng_normal(rng));
    return b;
}

/* One matmul of the step: C (M, N) = beta C + op(A) op(B) with A (M, K) or (K, M) as trans_a
   says, B (K, N) or (N, K). */
typedef struct {
    const char *name;
    int trans_a, trans_b, M, N, K, per_step; /* times a step runs it */
    float beta;
} bench_matmul;

/* ms of one call of the matmul on `path`, median of BENCH_REPS, both paths alternating:
   ms[0] portable, ms[1] path. */
static void time_matmul(const bench_matmul *mm, lg_gemm_workspace ws, lg_gemm_path path,
                        lg_dtype in, lg_dtype out, lg_rng *rng, double ms[2]) {
    lg_buf A = random_buf(in, (size_t)mm->M * mm->K, rng), B = random_buf(in, (size_t)mm->K * mm->N, rng);
    lg_buf C = random_buf(out, (size_t)mm->M * mm->N, rng);
    int lda = mm->trans_a ? mm->M : mm->K, ldb = mm->trans_b ? mm->K : mm->N;
    double t[2][BENCH_REPS];
    for (int r = -1; r < BENCH_REPS; r++) /* one warm-up call each */
        for (int p = 0; p < 2; p++) {
            ws.path = p ? path : LG_GEMM_PORTABLE;
            double t0 = lg_time_ms();
            lg_gemm(&ws, mm->trans_a, mm->trans_b, mm->M, mm->N, mm->K, A, lda, B, ldb, mm->beta, C, mm->N);
            if (r >= 0) t[p][r] = lg_time_ms() - t0;
        }
    ms[0] = median(t[0], BENCH_REPS);
    ms[1] = median(t[1], BENCH_REPS);
    LG_FREE(A.data); LG_FREE(B.data); LG_FREE(C.data);
}

/* The step's matmuls: each linear's forward (out = inp W^T), input gradient (dout W) and weight
   gradient (dout^T inp); attention's per (batch, head) products. */
static int step_matmuls(const lg_config *c, int B, int T, bench_matmul *mm) {
    const int N = B * T, C = c->n_embd, HS = c->head_size, NH = c->n_head, L = c->n_layer;
    const int QKV = (NH + 2 * c->n_query_groups) * HS, I = c->intermediate_size;
    const int n_fc = c->mlp_class_name == LG_MLP_LLAMA ? 2 : 1;
    struct { const char *fwd, *dinp, *dw; int ic, oc, per_step; } lin[] = {
        {"qkv", "qkv dinp", "qkv dweight", C, QKV, L},
        {"attn.proj", "attn.proj dinp", "attn.proj dweight", NH * HS, C, L},
        {"mlp.fc", "mlp.fc dinp", "mlp.fc dweight", C, I, n_fc * L},
        {"mlp.proj", "mlp.proj dinp", "mlp.proj dweight", I, C, L},
        {"lm_head", "lm_head dinp", "lm_head dweight", C, c->padded_vocab_size, 1},
    };
    int n = 0;
    for (int i = 0; i < 5; i++) {
        mm[n++] = (bench_matmul){lin[i].fwd, 0, 1, N, lin[i].oc, lin[i].ic, lin[i].per_step, 0};
        mm[n++] = (bench_matmul){lin[i].dinp, 0, 0, N, lin[i].ic, lin[i].oc, lin[i].per_step, 1};
        mm[n++] = (bench_matmul){lin[i].dw, 1, 0, lin[i].oc, lin[i].ic, N, lin[i].per_step, 1};
    }
    return n;
}

/* The median ms of BENCH_REPS runs of `statement`. */
#define TIME_OP(ms, statement)                                                                 \
    do {                                                                                       \
        double t_[BENCH_REPS];                                                                 \
        statement;                                                                             \
        for (int r_ = 0; r_ < BENCH_REPS; r_++) {                                              \
            double t0_ = lg_time_ms();                                                          \
            statement;                                                                         \
            t_[r_] = lg_time_ms() - t0_;                                                        \
        }                                                                                      \
        (ms) = median(t_, BENCH_REPS);                                                         \
    } while (0)

static void print_row(const char *name, const char *shape, double ms, int per_step,
                      double step_ms) {
    printf("  %-22s %-18s %9.3f %5d %6.1f%%\n", name, shape, ms, per_step,
           100 * ms * per_step / step_ms);
}

/* Where the time of a step (step_ms) goes, op by op. */
static void print_ops(lg_trainer *tr, const lg_config *c, int B, int T, double step_ms) {
    lg_model *m = &tr->ranks[0].model;
    lg_exec *ex = &m->exec;
    const lg_gemm_path path = ex->gemm.path;
    const lg_dtype act = m->a.residual[0].dtype; /* activations' (and inputs') storage type */
    const int N = B * T, C = c->n_embd, HS = c->head_size, NH = c->n_head, NQG = c->n_query_groups;
    const int QKV = (NH + 2 * NQG) * HS, I = c->intermediate_size, V = c->vocab_size;
    const int Vp = c->padded_vocab_size, L = c->n_layer;
    char cpu[256], shape[64];
    lg_rng rng;
    lg_rng_seed(&rng, 1);
    processor_name(cpu, sizeof cpu);
    printf("processor: %s\nmatmul kernels: %s (best this processor runs: %s); storage %s\n", cpu,
           lg_gemm_path_name(path), lg_gemm_path_name(lg_cpu_gemm_path()),
           lg_dtype_name(act));
    bench_matmul mm[16];
    int n_mm = step_matmuls(c, B, T, mm);
    double flops = 0, ms_path = 0, ms_port = 0;
    printf("  %-22s %-18s %9s %9s %7s %7s %5s %6s\n", "matmul", "M x N x K", "portable",
           lg_gemm_path_name(path), "GFLOP/s", "GFLOP/s", "/step", "share");
    for (int i = 0; i < n_mm; i++) {
        double ms[2], f = 2.0 * mm[i].M * mm[i].N * mm[i].K;
        time_matmul(&mm[i], ex->gemm, path, act, mm[i].beta != 0 && act != LG_DTYPE_F32 &&
                    strstr(mm[i].name, "dweight") ? LG_DTYPE_F32 : act, &rng, ms);
        snprintf(shape, sizeof shape, "%dx%dx%d%s", mm[i].M, mm[i].N, mm[i].K,
                 mm[i].trans_a ? " tn" : mm[i].trans_b ? " nt" : " nn");
        printf("  %-22s %-18s %9.3f %9.3f %7.1f %7.1f %5d %5.1f%%\n", mm[i].name, shape, ms[0],
               ms[1], f / ms[0] / 1e6, f / ms[1] / 1e6, mm[i].per_step,
               100 * ms[1] * mm[i].per_step / step_ms);
        flops += f * mm[i].per_step;
        ms_path += ms[1] * mm[i].per_step;
        ms_port += ms[0] * mm[i].per_step;
    }
    printf("  %-22s %-18s %9.3f %9.3f %7.1f %7.1f %5s %5.1f%%\n", "all linears", "", ms_port,
           ms_path, flops / ms_port / 1e6, flops / ms_path / 1e6, "", 100 * ms_path / step_ms);

    /* the other ops, on the processor's path */
    lg_buf qkv = random_buf(act, (size_t)N * QKV, &rng), dqkv = random_buf(act, (size_t)N * QKV, &rng);
    lg_buf y = random_buf(act, (size_t)N * C, &rng), dy = random_buf(act, (size_t)N * C, &rng);
    lg_buf x = random_buf(act, (size_t)N * C, &rng), w = random_buf(m->params.dtype, (size_t)C, &rng);
    lg_buf dw = random_buf(LG_DTYPE_F32, (size_t)C, &rng);
    lg_buf g = random_buf(act, (size_t)N * I, &rng), u = random_buf(act, (size_t)N * I, &rng);
    lg_buf h = random_buf(act, (size_t)N * I, &rng), dh = random_buf(act, (size_t)N * I, &rng);
    lg_buf logits = random_buf(act, (size_t)N * Vp, &rng);
    lg_real *lse = (lg_real *)lg_alloc_zeroed(sizeof(lg_real) * (size_t)B * NH * T);
    lg_real *mean = (lg_real *)lg_alloc_zeroed(sizeof(lg_real) * N);
    lg_real *rstd = (lg_real *)lg_alloc_zeroed(sizeof(lg_real) * N);
    lg_real *losses = (lg_real *)lg_alloc_zeroed(sizeof(lg_real) * N);
    int *targets = (int *)lg_alloc_zeroed(sizeof(int) * N);
    for (int i = 0; i < N; i++) targets[i] = (int)(lg_rng_u64(&rng) % (uint64_t)V);
    lg_buf empty = {NULL, LG_DTYPE_F32};
    lg_buf weights_copy = {lg_alloc_zeroed(m->n_params * 4), m->params.dtype};
    double t;
    printf("  %-22s %-18s %9s %5s %6s\n", "op", "shape", "ms", "/step", "share");
    snprintf(shape, sizeof shape, "B%d T%d NH%d HS%d", B, T, NH, HS);
    TIME_OP(t, lg_attention_forward(ex, y, lse, qkv, B, T, NH, NQG, HS, NULL));
    print_row("attention", shape, t, L, step_ms);
    TIME_OP(t, lg_attention_backward(ex, dqkv, dy, y, qkv, lse, B, T, NH, NQG, HS, NULL));
    print_row("attention backward", shape, t, L, step_ms);
    snprintf(shape, sizeof shape, "%dx%d", N, C);
    TIME_OP(t, lg_norm_forward(ex, y, mean, rstd, x, w, empty, N, C, 1e-5f));
    print_row("norm", shape, t, 2 * L + 1, step_ms);
    TIME_OP(t, lg_norm_backward(ex, dy, dw, empty, y, x, w, mean, rstd, N, C));
    print_row("norm backward", shape, t, 2 * L + 1, step_ms);
    snprintf(shape, sizeof shape, "%dx%d", N, I);
    TIME_OP(t, lg_swiglu_forward(ex, h, g, u, (size_t)N * I));
    print_row("swiglu", shape, t, L, step_ms);
    TIME_OP(t, lg_swiglu_backward(ex, g, u, dh, g, u, (size_t)N * I));
    print_row("swiglu backward", shape, t, L, step_ms);
    snprintf(shape, sizeof shape, "%dx%d", N, Vp);
    TIME_OP(t, lg_crossentropy_forward(ex, losses, logits, targets, N, V, Vp));
    print_row("cross-entropy", shape, t, 1, step_ms);
    TIME_OP(t, lg_crossentropy_backward(ex, logits, logits, targets, N, V, Vp, 1.0f));
    print_row("cross-entropy backward", shape, t, 1, step_ms);
    snprintf(shape, sizeof shape, "%zu params", m->n_params);
    TIME_OP(t, lg_optimizer_step(&tr->ranks[0].opt, m, 1e-9f, 1.0f));
    print_row("optimizer", shape, t, 1, step_ms);
    TIME_OP(t, lg_copy(ex, weights_copy, m->params, m->n_params));
    print_row("copy of the weights", shape, t, 1, step_ms);
    /* attention's matmuls: q k^T and p v forward, 4 products backward, each T x T x HS */
    double att = 4.0 * B * NH * (double)T * T * HS * 3; /* forward 2 products, backward 4 */
    printf("step: %.1f ms, matmuls %.1f GFLOP/s of it (linears and attention: %.2f GFLOP a step)\n",
           step_ms, (flops + att * L) / step_ms / 1e6, (flops + att * L) / 1e9);
    LG_FREE(qkv.data); LG_FREE(dqkv.data); LG_FREE(y.data); LG_FREE(dy.data); LG_FREE(x.data);
    LG_FREE(w.data); LG_FREE(dw.data); LG_FREE(g.data); LG_FREE(u.data); LG_FREE(h.data);
    LG_FREE(dh.data); LG_FREE(logits.data); LG_FREE(lse); LG_FREE(mean); LG_FREE(rstd);
    LG_FREE(losses); LG_FREE(targets); LG_FREE(weights_copy.data);
}

/* Text of `bytes` pseudo-random lowercase letters; with spaces every few letters (words of
   1-10 letters) or none (one word). */
static char *bench_text(size_t bytes, int spaces, uint64_t seed) {
    char *text = (char *)malloc(bytes + 1);
    lg_rng rng;
    lg_rng_seed(&rng, seed);
    size_t word = 0, next_space = 1 + lg_rng_u64(&rng) % 10;
    for (size_t i = 0; text && i < bytes; i++) {
        if (spaces && ++word > next_space) {
            text[i] = ' ';
            word = 0;
            next_space = 1 + lg_rng_u64(&rng) % 10;
        } else {
            text[i] = (char)('a' + lg_rng_u64(&rng) % 26);
        }
    }
    if (text) text[bytes] = '\0';
    return text;
}

/* Encoding speed of a tokenizer: one 1 MiB word (no pre-tokenizer split inside it: the worst
   case of BPE) and 50 MB of words. */
static int bench_tokenizer(const char *dir) {
    lg_tokenizer tok;
    lg_error err;
    if (lg_tokenizer_load(&tok, dir, &err) != 0) { complain("%s", err.msg); return 2; }
    const struct { const char *what; size_t bytes; int spaces; } cases[] = {
        {"one word of 1 MiB", 1 << 20, 0}, {"50 MB of words", 50000000, 1}};
    for (int k = 0; k < 2; k++) {
        char *text = bench_text(cases[k].bytes, cases[k].spaces, 7);
        lg_tokens ids = {NULL, 0, 0};
        double t0 = lg_time_ms();
        int rc = text ? lg_tokenizer_encode(&tok, text, cases[k].bytes, &ids, &err) : -1;
        double ms = lg_time_ms() - t0;
        if (rc != 0) { complain("%s", text ? err.msg : "out of memory"); return 1; }
        printf("tokenizer %s: %s: %.0f ms, %.1f MB/s, %zu tokens\n", dir, cases[k].what, ms,
               cases[k].bytes / (ms * 1e3), ids.n);
        LG_FREE(ids.ids);
        free(text);
    }
    lg_tokenizer_free(&tok);
    return 0;
}

/* --generate: decode and prefill speed of the KV-cache generator (section 16) on random
   weights: a prompt of P random tokens, then `n_new` tokens sampled as tools/generate does; a
   warm-up generation first. The decode's weight reads a second give how near it runs to the
   memory's bandwidth (each token reads every weight once). */
static int bench_generate(const lg_config *cfg, int P, int n_new, lg_precision precision) {
    lg_error err;
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    lg_gen_spec spec = {P + n_new, P, precision, threads, 0};
    lg_generator g;
    if (lg_generator_create(&g, cfg, &spec, &err) != 0) { complain("%s", err.msg); return 1; }
    size_t n = lg_params_layout(&g.cfg, lg_no_buf(), NULL, NULL);
    for (size_t i = 0; i < n; i++) /* uniform in +-0.035, about N(0, 0.02): cheap for 1B weights */
        lg_set(g.params, i, 0.07f * ((float)((i * 2654435761u) % 1024) / 1024.0f - 0.5f));
    int *prompt = (int *)malloc(sizeof(int) * (size_t)P), *out = (int *)malloc(sizeof(int) * (size_t)n_new);
    lg_rng rng;
    lg_rng_seed(&rng, 0);
    for (int i = 0; i < P; i++) prompt[i] = (int)(lg_rng_u64(&rng) % (uint64_t)cfg->vocab_size);
    lg_sampling s = lg_sampling_default();
    lg_gen_stats st;
    int n_out, rc = lg_generate(&g, prompt, P < 8 ? P : 8, 4, &s, &rng, out, &n_out, NULL, NULL, &st, &err);
    if (rc == 0) rc = lg_generate(&g, prompt, P, n_new, &s, &rng, out, &n_out, NULL, NULL, &st, &err);
    if (rc != 0) complain("%s", err.msg);
    double weights = (double)lg_plan_find(&g.plan.ranks[0], "weights")->bytes;
    double decode_s = st.decode_ms / 1e3 / (st.decode_tokens ? st.decode_tokens : 1);
    if (rc == 0)
        printf("litgpt.c generate %s %s threads=%d prompt=%d new=%d prefill tokens/s=%.1f decode "
               "tokens/s=%.2f weights=%.0fMB weight reads=%.1fGB/s\n", cfg->name,
               lg_precision_name(precision), threads, P, n_out, 1000.0 * P / st.prefill_ms,
               1.0 / decode_s, weights / 1e6, weights / decode_s / 1e9);
    free(prompt);
    free(out);
    lg_generator_free(&g);
    return rc ? 1 : 0;
}

/* Sample lengths like Alpaca's: log-normal with median 110 tokens and sigma 1 (about 1.4% past
   1,000), cut to [8, T]. Writes path (no prompt masking) and returns the samples' tokens. */
static size_t bench_pack_samples(const char *path, int n, int T, int vocab, lg_rng *rng) {
    uint32_t *lengths = (uint32_t *)malloc(sizeof(uint32_t) * n), *prompts = (uint32_t *)calloc(n, 4);
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        double u1 = (lg_rng_u64(rng) >> 11) * 0x1.0p-53 + 1e-300, u2 = (lg_rng_u64(rng) >> 11) * 0x1.0p-53;
        double z = sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2); /* Box-Muller */
        double len = 110.0 * exp(z);
        lengths[i] = (uint32_t)(len < 8 ? 8 : len > T ? T : len);
        total += lengths[i];
    }
    uint32_t *tokens = (uint32_t *)calloc(total, sizeof(uint32_t));
    for (size_t i = 0; i < total; i++) tokens[i] = (uint32_t)(lg_rng_u64(rng) % (uint64_t)vocab);
    lg_error err;
    if (lg_samples_write(path, tokens, lengths, prompts, (size_t)n, 2, 0, &err) != 0) total = 0;
    free(tokens);
    free(lengths);
    free(prompts);
    return total;
}

/* Trained tokens a second of steps [warmup, warmup + steps) on ld: real tokens, padding not. */
static double bench_real_tokens_per_s(lg_trainer *tr, lg_loader *ld, int warmup, int steps) {
    lg_step_stats st;
    lg_error err;
    double ms = 0;
    long targets = 0;
    for (int s = 0; s < warmup + steps; s++) {
        if (lg_trainer_step(tr, ld, s, &st, &err) != 0) { complain("%s", err.msg); return 0; }
        if (s < warmup) continue;
        ms += st.ms;
        targets += st.n_targets;
    }
    return targets / (ms / 1e3);
}

/* --pack: the same model on the same Alpaca-like samples, rows of T packed (-b 1) against one
   sample a row padded to the longest of its micro-batch of B, taking turns step by step so
   that both see the same machine. */
static int bench_pack(lg_config *cfg, int B, int T, int steps) {
    lg_rng rng;
    lg_rng_seed(&rng, 110);
    cfg->block_size = T;
    const char *path = "build/bench_pack_samples.bin";
    if (!bench_pack_samples(path, 4000, T, cfg->vocab_size, &rng)) return 1;
    lg_trainer tr[2];
    lg_loader ld[2];
    lg_error err;
    double rate[2] = {0, 0};
    for (int packed = 0; packed < 2; packed++) {
        lg_args a;
        lg_args_default(&a);
        a.micro_batch_size = packed ? 1 : B;
        a.pack = packed;
        a.precision = LG_PRECISION_BF16_MIXED;
        if (lg_loader_open(&ld[packed], path, T, cfg->vocab_size, 1, 7, &err) != 0 ||
            lg_trainer_create(&tr[packed], cfg, &a, T, &err) != 0) {
            complain("%s", err.msg);
            return 1;
        }
    }
    lg_packing_stats st, unpacked;
    lg_loader_packing_stats(&ld[1], 1, T, &st);
    lg_loader_packing_stats(&ld[0], B, T, &unpacked);
    for (int round = 0; round < steps; round++) /* turns: one step each, after one warm-up */
        for (int packed = 0; packed < 2; packed++)
            rate[packed] += bench_real_tokens_per_s(&tr[packed], &ld[packed], round == 0, 1) / steps;
    printf("--pack: %s, samples median 110 tokens (log-normal), rows of %d: unpacked -b %d %.0f "
           "real tokens/s, packed -b 1 %.0f (%.2fx); padding %.1f%% unpacked, %.1f%% packed, "
           "%.1f samples a row\n", cfg->name, T, B, rate[0], rate[1], rate[1] / rate[0],
           100 * unpacked.padding_unpacked, 100 * st.padding_packed, st.samples_per_row);
    for (int k = 0; k < 2; k++) {
        lg_trainer_free(&tr[k]);
        lg_loader_close(&ld[k]);
    }
    return 0;
}

/* n random tokens below vocab_size, the same every call (LG_MALLOC: a loader takes them). */
static uint32_t *random_tokens(size_t n, int vocab_size) {
    uint32_t *tokens = (uint32_t *)LG_MALLOC(sizeof(uint32_t) * n);
    lg_rng rng;
    lg_rng_seed(&rng, 0);
    for (size_t i = 0; tokens && i < n; i++) tokens[i] = (uint32_t)(lg_rng_u64(&rng) % vocab_size);
    return tokens;
}

/* --offload-modes: what each --offload part costs on this machine, where host and device
   memory are one: the same model and tokens trained plain and with each mode, taking turns
   step by step so that all see the same machine. Two micro-batches a step, so that streamed
   gradients also make their trip back. */
typedef struct {
    const char *name;
    int recompute, state, activations, gradients, weights, embedding;
} bench_offload_mode;

static int bench_offload(const lg_config *cfg, int B, int T, int steps, lg_precision precision) {
    static const bench_offload_mode modes[] = {
        {"none", 0, 0, 0, 0, 0, 0},
        {"state", 0, 1, 0, 0, 0, 0},
        {"state,gradients", 0, 1, 0, 1, 0, 0},
        {"state,weights", 0, 1, 0, 0, 1, 0},
        {"state,gradients,weights", 0, 1, 0, 1, 1, 0},
        {"state,gradients,weights,embedding", 0, 1, 0, 1, 1, 1},
        {"activations (recompute block)", 1, 0, 1, 0, 0, 0},
        {"recompute block, no offload", 1, 0, 0, 0, 0, 0},
    };
    enum { N_MODES = (int)(sizeof modes / sizeof modes[0]) };
    lg_trainer tr[N_MODES];
    lg_loader ld[N_MODES];
    lg_error err;
    double rate[N_MODES] = {0};
    size_t n = (size_t)(steps + 1) * 2 * B * T + 1; /* every step's windows */
    for (int k = 0; k < N_MODES; k++) {
        lg_args a;
        lg_args_default(&a);
        a.micro_batch_size = B;
        a.global_batch_size = 2 * B;
        a.precision = precision;
        a.recompute = modes[k].recompute;
        a.offload = modes[k].state;
        a.offload_activations = modes[k].activations;
        a.offload_gradients = modes[k].gradients;
        a.offload_weights = modes[k].weights;
        a.offload_embedding = modes[k].embedding; /* the table trained on the host */
        uint32_t *tokens = random_tokens(n, cfg->vocab_size); /* (the loader owns them) */
        if (!tokens || lg_loader_from_memory(&ld[k], tokens, n, T, cfg->vocab_size, 0, 0, &err) != 0 ||
            lg_trainer_create(&tr[k], cfg, &a, T, &err) != 0) {
            complain("--offload %s: %s", modes[k].name, tokens ? err.msg : "no memory");
            return 1;
        }
    }
    for (int round = 0; round < steps; round++) /* turns: one step each, after one warm-up */
        for (int k = 0; k < N_MODES; k++)
            rate[k] += bench_real_tokens_per_s(&tr[k], &ld[k], round == 0, 1) / steps;
    printf("--offload on this CPU: %s, %s, -b %d -g %d -t %d, tokens/s (against none):\n", cfg->name,
           lg_precision_name(precision), B, 2 * B, T);
    for (int k = 0; k < N_MODES; k++) {
        printf("  %-34s %8.0f  %.2fx\n", modes[k].name, rate[k], rate[k] / rate[0]);
        lg_trainer_free(&tr[k]);
        lg_loader_close(&ld[k]);
    }
    return 0;
}

int main(int argc, char **argv) {
    const char *config = "configs/bench.yaml";
    if (argc == 3 && strcmp(argv[1], "--tokenizer") == 0) return bench_tokenizer(argv[2]);
    int B = 4, T = 256, steps = 5, warmup = 2;
    lg_precision precision = LG_PRECISION_32_TRUE; /* as the PyTorch side */
    int recompute = 0, offload = 0, ops = 0, generate = 0, n_new = 64, pack = 0, modes = 0;
    for (int i = 1; i < argc; i++) {
        const char *value = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(argv[i], "--recompute") == 0) recompute = 1;
        else if (strcmp(argv[i], "--offload") == 0) offload = 1;
        else if (strcmp(argv[i], "--ops") == 0) ops = 1;
        else if (strcmp(argv[i], "--generate") == 0) generate = 1;
        else if (strcmp(argv[i], "--pack") == 0) pack = 1;
        else if (strcmp(argv[i], "--offload-modes") == 0) modes = 1;
        else if (value && strcmp(argv[i], "--new") == 0) n_new = atoi(argv[++i]);
        else if (value && strcmp(argv[i], "-c") == 0) config = argv[++i];
        else if (value && strcmp(argv[i], "-b") == 0) B = atoi(argv[++i]);
        else if (value && strcmp(argv[i], "-t") == 0) T = atoi(argv[++i]);
        else if (value && strcmp(argv[i], "-s") == 0) steps = atoi(argv[++i]);
        else if (value && strcmp(argv[i], "-p") == 0 && lg_precision_parse(value, &precision) == 0) i++;
        else { complain("unknown or incomplete option %s", argv[i]); return 2; }
    }
    lg_error err;
    lg_config cfg;
    if (lg_config_load(&cfg, config, &err) != 0) { complain("%s", err.msg); return 2; }
    if (generate) return bench_generate(&cfg, T, n_new, precision);
    if (pack) return bench_pack(&cfg, B, T, steps);
    if (modes) return bench_offload(&cfg, B, T, steps, precision);
    lg_args args;
    lg_args_default(&args);
    args.micro_batch_size = B;
    args.precision = precision;
    args.recompute = recompute;
    args.offload = offload;
    args.lr = 3e-4f;
    args.warmup_steps = 0;
    lg_trainer tr;
    if (lg_trainer_create(&tr, &cfg, &args, T, &err) != 0) { complain("%s", err.msg); return 1; }
    /* random tokens, enough windows for every step */
    size_t n = (size_t)(warmup + steps) * B * T + 1;
    uint32_t *tokens = random_tokens(n, cfg.vocab_size);
    lg_loader ld;
    if (!tokens || lg_loader_from_memory(&ld, tokens, n, T, cfg.vocab_size, 0, 0, &err) != 0) return 1;
    lg_step_stats st;
    double step_ms[64];
    if (steps > 64) steps = 64;
    for (int s = 0; s < warmup + steps; s++) {
        if (lg_trainer_step(&tr, &ld, s, &st, &err) != 0) { complain("%s", err.msg); return 1; }
        if (s >= warmup) step_ms[s - warmup] = st.ms;
    }
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    double ms = median(step_ms, steps);
    if (ops) print_ops(&tr, &cfg, B, T, ms);
    printf("litgpt.c %s%s%s threads=%d B=%d T=%d params=%zu tokens/s=%.0f ms/step=%.1f "
           "kernels=%s attention=exact(gemm per head)\n", lg_precision_name(precision),
           recompute ? " recompute" : "", offload ? " offload" : "", threads, B, T,
           tr.ranks[0].model.n_params, B * T / (ms / 1e3), ms,
           lg_gemm_path_name(tr.ranks[0].model.exec.gemm.path));
    lg_loader_close(&ld);
    lg_trainer_free(&tr);
    return 0;
}
