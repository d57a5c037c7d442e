/* tests/test_gemm.c — the matmul's kernel paths (included by tests/test.c, float build).

   Every path the processor runs against the portable one, and the portable one against a
   double-precision loop, on the shapes the models use and on odd ones (edges of the register
   tile, K across blocks, odd K for bf16 pairs), all four transposes, beta 0 and 1, and the
   storage types the precisions give the operands. Paths the processor lacks are reported as
   skipped. */

/* One case: C (M, N) = beta C + op(A) op(B), operands stored as `in_a`, `in_b`, C as `out`. */
typedef struct {
    int M, N, K;
    lg_dtype in_a, in_b, out;
} gemm_case;

/* x rounded to dtype's storage and back (fp32 unchanged). */
static float stored_value(lg_dtype dtype, float x) {
    if (dtype == LG_DTYPE_BF16) return lg_bf16_to_f32(lg_f32_to_bf16(x));
    if (dtype == LG_DTYPE_F16) return lg_f16_to_f32(lg_f32_to_f16(x));
    return x;
}

/* n elements of N(0, 1) in dtype's storage (LG_MALLOC'd, bytes of the largest type). */
static lg_buf random_buf(lg_dtype dtype, size_t n, lg_rng *rng) {
    lg_buf b = {lg_alloc_zeroed(n * sizeof(float)), dtype};
    for (size_t i = 0; i < n; i++) lg_set(b, i, stored_value(dtype, lg_rng_normal(rng)));
    return b;
}

/* C's elements as floats. */
static void buf_to_floats(lg_buf b, size_t n, lg_real *out) {
    for (size_t i = 0; i < n; i++) out[i] = lg_get(b, i);
}

/* exact (M, N) = beta C0 + op(A) op(B) in double over the stored operands, read once each */
static void exact_gemm(const gemm_case *c, int trans_a, int trans_b, lg_real beta, lg_buf A,
                       lg_buf B, lg_buf C0, lg_real *exact) {
    const int M = c->M, N = c->N, K = c->K;
    double *a = (double *)lg_alloc_zeroed((size_t)M * K * sizeof(double)); /* (M, K) */
    double *b = (double *)lg_alloc_zeroed((size_t)N * K * sizeof(double)); /* (N, K): B^T */
    for (int i = 0; i < M; i++)
        for (int p = 0; p < K; p++)
            a[(size_t)i * K + p] = lg_get(A, trans_a ? (size_t)p * M + i : (size_t)i * K + p);
    for (int j = 0; j < N; j++)
        for (int p = 0; p < K; p++)
            b[(size_t)j * K + p] = lg_get(B, trans_b ? (size_t)j * K + p : (size_t)p * N + j);
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            double s = beta * (double)lg_get(C0, (size_t)i * N + j);
            for (int p = 0; p < K; p++) s += a[(size_t)i * K + p] * b[(size_t)j * K + p];
            exact[(size_t)i * N + j] = (lg_real)s;
        }
    LG_FREE(a); LG_FREE(b);
}

/* max relative error (to C's scale) of `path` against the portable path, and (when vs_double
   is not NULL) of the portable path against a double loop over the stored operands */
static void gemm_errors(const gemm_case *c, int trans_a, int trans_b, lg_real beta,
                        lg_gemm_path path, lg_gemm_workspace *ws, lg_rng *rng, double *vs_portable,
                        double *vs_double) {
    const int M = c->M, N = c->N, K = c->K;
    const int lda = trans_a ? M : K, ldb = trans_b ? K : N; /* A (M, K) or (K, M); B likewise */
    lg_buf A = random_buf(c->in_a, (size_t)M * K, rng), B = random_buf(c->in_b, (size_t)K * N, rng);
    lg_buf C0 = random_buf(c->out, (size_t)M * N, rng);
    lg_buf C_fast = {lg_alloc_zeroed((size_t)M * N * sizeof(float)), c->out};
    lg_buf C_port = {lg_alloc_zeroed((size_t)M * N * sizeof(float)), c->out};
    memcpy(C_fast.data, C0.data, (size_t)M * N * lg_dtype_size(c->out));
    memcpy(C_port.data, C0.data, (size_t)M * N * lg_dtype_size(c->out));
    ws->path = path;
    lg_gemm(ws, trans_a, trans_b, M, N, K, A, lda, B, ldb, beta, C_fast, N);
    ws->path = LG_GEMM_PORTABLE;
    lg_gemm(ws, trans_a, trans_b, M, N, K, A, lda, B, ldb, beta, C_port, N);
    lg_real *fast = new_reals((size_t)M * N), *port = new_reals((size_t)M * N);
    lg_real *exact = new_reals((size_t)M * N);
    buf_to_floats(C_fast, (size_t)M * N, fast);
    buf_to_floats(C_port, (size_t)M * N, port);
    if (vs_double) exact_gemm(c, trans_a, trans_b, beta, A, B, C0, exact);
    *vs_portable = rel_error(fast, port, (size_t)M * N, 1e-30);
    if (vs_double) *vs_double = rel_error(port, exact, (size_t)M * N, 1e-30);
    LG_FREE(A.data); LG_FREE(B.data); LG_FREE(C0.data); LG_FREE(C_fast.data);
    LG_FREE(C_port.data); LG_FREE(fast); LG_FREE(port); LG_FREE(exact);
}

static void test_gemm_paths(results *r) {
    const lg_gemm_path best = lg_cpu_gemm_path();
    const lg_dtype F32 = LG_DTYPE_F32, BF16 = LG_DTYPE_BF16, F16 = LG_DTYPE_F16;
    const gemm_case cases[] = {
        /* bench model (n_embd 384, MLP 1024, vocab 8192) at B*T = 256: qkv, the MLP's input
           and output, attention's heads (T 64, head size 64) */
        {256, 1152, 384, F32, F32, F32},
        {256, 1024, 384, BF16, BF16, BF16},
        {384, 1024, 256, BF16, BF16, F32},  /* a weight gradient: (OC, IC) over N */
        {64, 64, 64, BF16, BF16, F32},
        {64, 64, 64, F32, BF16, F32},       /* probabilities times bf16 values */
        /* odd sizes: tile edges in M and N, K across KC blocks, odd K for bf16 pairs */
        {37, 45, 29, F32, F32, F32},
        {61, 97, 515, F32, F32, F32},
        {61, 97, 515, BF16, BF16, F32},
        {29, 33, 259, BF16, BF16, BF16},
        {17, 200, 131, F16, F16, F16},
        {3, 700, 77, BF16, BF16, F32},
        {100, 1, 300, BF16, BF16, F32},
    };
    const int n_cases = (int)(sizeof cases / sizeof cases[0]);
    lg_gemm_workspace ws;
    ws.threads = 1;
#ifdef _OPENMP
    ws.threads = omp_get_max_threads();
#endif
    ws.per_thread = lg_gemm_workspace_count();
    ws.base = new_reals(ws.per_thread * ws.threads);
    lg_rng rng;
    lg_rng_seed(&rng, 19);
    printf("  processor's best path: %s\n", lg_gemm_path_name(best));
    for (int path = LG_GEMM_PORTABLE; path <= LG_GEMM_AMX; path++) {
        if (path > (int)best) {
            printf("  skip  %s: this processor lacks it\n", lg_gemm_path_name((lg_gemm_path)path));
            continue;
        }
        double worst_fp32 = 0, worst_half = 0, worst_double = 0;
        for (int i = 0; i < n_cases; i++)
            for (int t = 0; t < 8; t++) { /* trans_a, trans_b, beta */
                double e_port;
                double e_double = 0; /* the double loop checks the portable path only */
                gemm_errors(&cases[i], t & 1, (t >> 1) & 1, (lg_real)((t >> 2) & 1),
                            (lg_gemm_path)path, &ws, &rng, &e_port,
                            path == LG_GEMM_PORTABLE ? &e_double : NULL);
                if (cases[i].out == F32) worst_fp32 = fmax(worst_fp32, e_port);
                else worst_half = fmax(worst_half, e_port);
                if (cases[i].out == F32) worst_double = fmax(worst_double, e_double);
            }
        if (path == LG_GEMM_PORTABLE) {
            check(r, worst_double < 1e-5, "matmul, portable path against a double loop: "
                  "%d shapes x 4 transposes x beta 0, 1 (max rel error %.1e)", n_cases, worst_double);
            continue;
        }
        /* fp32 results differ only in the order of the sums; half results by at most one
           rounding of the stored type (bf16: 2^-8 of the value) */
        check(r, worst_fp32 < 1e-5 && worst_half < 1e-2,
              "matmul, %s path against portable: %d shapes x 4 transposes x beta 0, 1 "
              "(max rel error %.1e fp32 out, %.1e half out)", lg_gemm_path_name((lg_gemm_path)path),
              n_cases, worst_fp32, worst_half);
    }
    LG_FREE(ws.base);
}
