/* tests/test_cpu_ops.c — the AVX-512 loops of the memory-bound ops (included by tests/test.c).

   Norms (LayerNorm with bias, RMSNorm), SwiGLU, cross-entropy (with an ignored row, padded
   vocabulary, in place backward), attention's softmax rows, rotary embedding, the residual add
   and AdamW on the avx512 path against the portable loops
   (ex NULL; cross-entropy's fp32 results against double), with fp32 and bf16 storage, on the bench model's widths and on odd ones (a
   partial last vector). fp32 results may differ in the order of sums and exp's last bits;
   bf16 results by one rounding of the stored type. Reported as skipped where the processor
   lacks AVX-512 or the build lacks the x86 kernels. */

/* an exec on the CPU running `path` (the ops read only backend and gemm.path) */
static lg_exec cpu_exec(lg_gemm_path path) {
    lg_exec ex;
    memset(&ex, 0, sizeof ex);
    ex.backend = LG_BACKEND_CPU;
    ex.gemm.path = path;
    return ex;
}

/* n values of N(0, sd) stored as dtype (LG_MALLOC'd, room for fp32) */
static lg_buf ops_random(lg_dtype dtype, size_t n, float sd, lg_rng *rng) {
    lg_buf b = {lg_alloc_zeroed(n * sizeof(float) + 64), dtype};
    for (size_t i = 0; i < n; i++) lg_set(b, i, sd * lg_rng_normal(rng));
    return b;
}

static lg_buf ops_clone(lg_buf b, size_t n) {
    lg_buf c = {lg_alloc_zeroed(n * sizeof(float) + 64), b.dtype};
    memcpy(c.data, b.data, n * lg_dtype_size(b.dtype));
    return c;
}

/* error of a against b relative to b's scale, over n elements of their storage */
static double ops_error(lg_buf a, lg_buf b, size_t n) {
    double diff = 0, scale = 1e-30;
    for (size_t i = 0; i < n; i++) {
        diff = fmax(diff, fabs((double)lg_get(a, i) - (double)lg_get(b, i)));
        scale = fmax(scale, fabs((double)lg_get(b, i)));
    }
    return diff / scale;
}

/* the worst errors seen, fp32 and bf16 storage apart */
typedef struct {
    double fp32, bf16;
} ops_worst;

static void ops_note(ops_worst *w, lg_dtype dtype, double e) {
    if (dtype == LG_DTYPE_BF16) w->bf16 = fmax(w->bf16, e);
    else w->fp32 = fmax(w->fp32, e);
}

static void ops_norms(const lg_exec *ex, lg_dtype act, int N, int C, int layer_norm, ops_worst *w,
                      lg_rng *rng) {
    lg_buf x = ops_random(act, (size_t)N * C, 1.5f, rng), wt = ops_random(act, (size_t)C, 1, rng);
    lg_buf bias = layer_norm ? ops_random(act, (size_t)C, 1, rng) : lg_no_buf();
    lg_buf dy = ops_random(act, (size_t)N * C, 1, rng);
    lg_buf y[2], dx[2], dw[2], db[2];
    lg_real *mean[2], *rstd[2];
    const lg_rng dx_start = *rng; /* the same starting dinp both times (it accumulates) */
    for (int k = 0; k < 2; k++) { /* 0 portable, 1 avx512 */
        y[k] = ops_random(act, (size_t)N * C, 0, rng);
        dx[k] = ops_random(act, (size_t)N * C, 0, rng);
        lg_rng dx_rng = dx_start;
        for (size_t i = 0; i < (size_t)N * C; i++) lg_set(dx[k], i, lg_rng_normal(&dx_rng));
        dw[k] = ops_random(LG_DTYPE_F32, (size_t)C, 0, rng);
        db[k] = layer_norm ? ops_random(LG_DTYPE_F32, (size_t)C, 0, rng) : lg_no_buf();
        mean[k] = layer_norm ? new_reals((size_t)N) : NULL;
        rstd[k] = new_reals((size_t)N);
        const lg_exec *e = k ? ex : NULL;
        lg_norm_forward(e, y[k], mean[k], rstd[k], x, wt, bias, N, C, 1e-5f);
        lg_norm_backward(e, dx[k], dw[k], db[k], dy, x, wt, mean[k], rstd[k], N, C);
    }
    ops_note(w, act, ops_error(y[1], y[0], (size_t)N * C));
    ops_note(w, act, ops_error(dx[1], dx[0], (size_t)N * C));
    ops_note(w, LG_DTYPE_F32, ops_error(dw[1], dw[0], (size_t)C));
    if (layer_norm) ops_note(w, LG_DTYPE_F32, ops_error(db[1], db[0], (size_t)C));
    lg_buf r1 = {rstd[1], LG_DTYPE_F32}, r0 = {rstd[0], LG_DTYPE_F32};
    ops_note(w, LG_DTYPE_F32, ops_error(r1, r0, (size_t)N));
    LG_FREE(x.data); LG_FREE(wt.data); LG_FREE(bias.data); LG_FREE(dy.data);
    for (int k = 0; k < 2; k++) {
        LG_FREE(y[k].data); LG_FREE(dx[k].data); LG_FREE(dw[k].data); LG_FREE(db[k].data);
        LG_FREE(mean[k]); LG_FREE(rstd[k]);
    }
}

static void ops_swiglu(const lg_exec *ex, lg_dtype act, size_t n, ops_worst *w, lg_rng *rng) {
    lg_buf g = ops_random(act, n, 3, rng), u = ops_random(act, n, 1, rng), d = ops_random(act, n, 1, rng);
    lg_set(g, 0, 100.0f); /* exp's clamps: sigmoid 1 and 0 */
    lg_set(g, 1, -100.0f);
    lg_buf out[2], dg[2], du[2];
    for (int k = 0; k < 2; k++) {
        const lg_exec *e = k ? ex : NULL;
        out[k] = ops_random(act, n, 0, rng);
        lg_swiglu_forward(e, out[k], g, u, n);
        dg[k] = ops_random(act, n, 0, rng);
        du[k] = ops_random(act, n, 0, rng);
        lg_swiglu_backward(e, dg[k], du[k], d, g, u, n);
    }
    ops_note(w, act, ops_error(out[1], out[0], n));
    ops_note(w, act, ops_error(dg[1], dg[0], n));
    ops_note(w, act, ops_error(du[1], du[0], n));
    LG_FREE(g.data); LG_FREE(u.data); LG_FREE(d.data);
    for (int k = 0; k < 2; k++) { LG_FREE(out[k].data); LG_FREE(dg[k].data); LG_FREE(du[k].data); }
}

static void ops_crossentropy(const lg_exec *ex, lg_dtype act, int N, int V, int Vp, ops_worst *w,
                             lg_rng *rng) {
    lg_buf z = ops_random(act, (size_t)N * Vp, 4, rng);
    int *targets = (int *)lg_alloc_zeroed(sizeof(int) * (size_t)N);
    for (int i = 0; i < N; i++) targets[i] = (int)(lg_rng_u64(rng) % (uint64_t)V);
    targets[N / 2] = LG_IGNORE_INDEX;
    targets[0] = V - 1; /* the last column, in the partial vector when V is odd */
    lg_buf dz[2], loss[2];
    double total[2];
    for (int k = 0; k < 2; k++) {
        const lg_exec *e = k ? ex : NULL;
        loss[k] = ops_random(LG_DTYPE_F32, (size_t)N, 0, rng);
        total[k] = lg_crossentropy_forward(e, (lg_real *)loss[k].data, z, targets, N, V, Vp);
        dz[k] = ops_clone(z, (size_t)N * Vp); /* in place */
        lg_crossentropy_backward(e, dz[k], dz[k], targets, N, V, Vp, 1.0f / N);
    }
    /* against double: the portable loop's own fp32 sums over V are off by about 1e-5 */
    lg_buf exact_loss = ops_random(LG_DTYPE_F32, (size_t)N, 0, rng);
    lg_buf exact_dz = ops_random(LG_DTYPE_F32, (size_t)N * Vp, 0, rng);
    double exact_total = 0;
    for (int n = 0; n < N; n++) {
        if (targets[n] == LG_IGNORE_INDEX) continue;
        double max = -INFINITY, sum = 0;
        for (int v = 0; v < V; v++) max = fmax(max, lg_get(z, (size_t)n * Vp + v));
        for (int v = 0; v < V; v++) sum += exp(lg_get(z, (size_t)n * Vp + v) - max);
        lg_set(exact_loss, (size_t)n, (float)(log(sum) + max - lg_get(z, (size_t)n * Vp + targets[n])));
        exact_total += lg_get(exact_loss, (size_t)n);
        for (int v = 0; v < V; v++)
            lg_set(exact_dz, (size_t)n * Vp + v,
                   (float)((exp(lg_get(z, (size_t)n * Vp + v) - max) / sum - (v == targets[n])) / N));
    }
    ops_note(w, LG_DTYPE_F32, ops_error(loss[1], exact_loss, (size_t)N));
    ops_note(w, LG_DTYPE_F32, fabs(total[1] - exact_total) / fabs(exact_total));
    ops_note(w, act, ops_error(dz[1], act == LG_DTYPE_F32 ? exact_dz : dz[0], (size_t)N * Vp));
    LG_FREE(exact_loss.data); LG_FREE(exact_dz.data);
    LG_FREE(z.data); LG_FREE(targets);
    for (int k = 0; k < 2; k++) { LG_FREE(dz[k].data); LG_FREE(loss[k].data); }
}

/* AdamW, 3 steps, on two tensors (one decayed, one not; odd counts) or on the same weights cut
   into pieces at odd places, as a shard table does (`pieces`); weights fp32 or bf16 with an
   fp32 master. out_w, out_m: the weights and first moments after. */
static void ops_adamw_run(const lg_exec *ex, lg_dtype weights, int pieces, size_t n,
                          lg_buf out_w, lg_real *out_m, lg_rng *rng) {
    lg_optimizer opt;
    memset(&opt, 0, sizeof opt);
    opt.kind = LG_OPTIMIZER_ADAMW;
    opt.weight_decay = 0.1f; opt.beta1 = 0.9f; opt.beta2 = 0.95f; opt.eps = 1e-8f;
    opt.format = LG_STATE_AS_PRECISION;
    opt.m = (lg_buf){out_m, LG_DTYPE_F32};
    opt.v = ops_random(LG_DTYPE_F32, n, 0, rng);
    lg_real *master = weights == LG_DTYPE_F32 ? NULL : new_reals(n);
    for (size_t i = 0; master && i < n; i++) master[i] = lg_get(out_w, i);
    opt.master = master;
    lg_tensor_info t[3];
    memset(t, 0, sizeof t);
    const size_t cut[4] = {0, pieces ? 13 : n - 37, pieces ? n - 40 : n, n};
    const int count = pieces ? 3 : 2;
    for (int i = 0; i < count; i++) {
        t[i].offset = t[i].origin = cut[i];
        t[i].count = cut[i + 1] - cut[i];
        t[i].kind = pieces || i == 0 ? LG_TENSOR_WEIGHT : LG_TENSOR_NORM;
    }
    lg_tensor_table table = {t, count, n};
    for (int step = 0; step < 3; step++) {
        lg_buf g = ops_random(LG_DTYPE_F32, n, 0.01f, rng);
        lg_optimizer_update(&opt, ex, &table, out_w, 0, g, 1e-2f, 0.5f);
        LG_FREE(g.data);
    }
    LG_FREE(opt.v.data);
    LG_FREE(master);
}

static void ops_adamw(const lg_exec *ex, lg_dtype weights, ops_worst *w, int *same_in_pieces,
                      lg_rng *rng) {
    const size_t n = 1000 + 7;
    lg_buf w0 = ops_random(weights, n, 1, rng);
    lg_buf wk[3];
    lg_real *mk[3];
    for (int k = 0; k < 3; k++) { /* portable, avx512, avx512 in pieces */
        lg_rng same = *rng; /* the same gradients each run */
        wk[k] = ops_clone(w0, n);
        mk[k] = new_reals(n);
        ops_adamw_run(k ? ex : NULL, weights, k == 2, n, wk[k], mk[k], &same);
    }
    ops_note(w, weights, ops_error(wk[1], wk[0], n));
    lg_buf m1 = {mk[1], LG_DTYPE_F32}, m0 = {mk[0], LG_DTYPE_F32};
    ops_note(w, LG_DTYPE_F32, ops_error(m1, m0, n));
    /* pieces differ from whole tensors only by decay on the norm's 37: compare the first ones */
    if (memcmp(wk[2].data, wk[1].data, (n - 40) * lg_dtype_size(weights)) != 0) *same_in_pieces = 0;
    LG_FREE(w0.data);
    for (int k = 0; k < 3; k++) { LG_FREE(wk[k].data); LG_FREE(mk[k]); }
}

/* an exec with the matmul workspace and attention's rows for T */
static lg_exec attention_exec(lg_gemm_path path, int T) {
    lg_exec ex = cpu_exec(path);
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    ex.gemm.threads = ex.attention.threads = threads;
    ex.gemm.per_thread = lg_gemm_workspace_count();
    ex.gemm.base = new_reals(ex.gemm.per_thread * threads);
    ex.attention.per_thread = (size_t)2 * T * T;
    ex.attention.base = new_reals(ex.attention.per_thread * threads);
    return ex;
}

/* attention forward and backward (softmax rows, the softmax's backward) and the residual add,
   avx512 against portable */
static void ops_attention(lg_dtype act, int B, int T, int NH, int NQG, int HS, ops_worst *w,
                          lg_rng *rng) {
    const int QKV = (NH + 2 * NQG) * HS;
    const size_t n_qkv = (size_t)B * T * QKV, n_y = (size_t)B * T * NH * HS;
    lg_buf qkv = ops_random(act, n_qkv, 1.5f, rng), dy = ops_random(act, n_y, 1, rng);
    lg_buf y[2], dqkv[2], sum[2];
    lg_real *lse[2];
    for (int k = 0; k < 2; k++) {
        lg_exec ex = attention_exec(k ? LG_GEMM_AVX512 : LG_GEMM_PORTABLE, T);
        y[k] = ops_random(act, n_y, 0, rng);
        dqkv[k] = ops_random(act, n_qkv, 0, rng);
        sum[k] = ops_random(act, n_y, 0, rng);
        lse[k] = new_reals((size_t)B * NH * T);
        lg_attention_forward(&ex, y[k], lse[k], qkv, B, T, NH, NQG, HS, NULL);
        lg_attention_backward(&ex, dqkv[k], dy, y[k], qkv, lse[k], B, T, NH, NQG, HS, NULL);
        lg_add(&ex, sum[k], y[k], dy, n_y);
        LG_FREE(ex.gemm.base); LG_FREE(ex.attention.base);
    }
    ops_note(w, act, ops_error(y[1], y[0], n_y));
    ops_note(w, act, ops_error(dqkv[1], dqkv[0], n_qkv));
    ops_note(w, act, ops_error(sum[1], sum[0], n_y));
    lg_buf l1 = {lse[1], LG_DTYPE_F32}, l0 = {lse[0], LG_DTYPE_F32};
    ops_note(w, LG_DTYPE_F32, ops_error(l1, l0, (size_t)B * NH * T));
    LG_FREE(qkv.data); LG_FREE(dy.data);
    for (int k = 0; k < 2; k++) { LG_FREE(y[k].data); LG_FREE(dqkv[k].data); LG_FREE(sum[k].data); LG_FREE(lse[k]); }
}

/* rotary embedding of the query and key heads, both directions */
static void ops_rope(const lg_exec *ex, lg_dtype act, int B, int T, int NH, int NQG, int HS,
                     int rope_dims, ops_worst *w, lg_rng *rng) {
    const size_t n_qkv = (size_t)B * T * (NH + 2 * NQG) * HS, n_table = (size_t)T * rope_dims / 2;
    lg_buf qkv = ops_random(act, n_qkv, 1, rng);
    lg_buf cos_table = ops_random(LG_DTYPE_F32, n_table, 1, rng), sin_table = ops_random(LG_DTYPE_F32, n_table, 1, rng);
    lg_buf out[2];
    for (int k = 0; k < 2; k++) {
        out[k] = ops_clone(qkv, n_qkv);
        for (int direction = 1; direction >= -1; direction -= 2)
            lg_rope_rotate(k ? ex : NULL, out[k], (lg_real *)cos_table.data, (lg_real *)sin_table.data,
                           B, T, NH, NQG, HS, rope_dims, direction, NULL);
    }
    ops_note(w, act, ops_error(out[1], out[0], n_qkv));
    LG_FREE(qkv.data); LG_FREE(cos_table.data); LG_FREE(sin_table.data);
    LG_FREE(out[0].data); LG_FREE(out[1].data);
}

static void test_cpu_ops_paths(results *r) {
    const lg_gemm_path best = lg_cpu_gemm_path();
    if (!LG_X86_KERNELS || best < LG_GEMM_AVX512) {
        printf("  skip  AVX-512 loops of norms, SwiGLU, cross-entropy, AdamW: %s\n",
               LG_X86_KERNELS ? "this processor lacks AVX-512" : "a build without the x86 kernels");
        return;
    }
    const lg_exec ex = cpu_exec(LG_GEMM_AVX512);
    const lg_dtype types[2] = {LG_DTYPE_F32, LG_DTYPE_BF16};
    ops_worst norm = {0, 0}, swiglu = {0, 0}, ce = {0, 0}, adamw = {0, 0}, attention = {0, 0};
    int same_in_pieces = 1;
    lg_rng rng;
    lg_rng_seed(&rng, 190);
    for (int i = 0; i < 2; i++) {
        const lg_dtype act = types[i];
        /* the bench model's width (384), an odd one */
        for (int layer_norm = 0; layer_norm < 2; layer_norm++) {
            ops_norms(&ex, act, 64, 384, layer_norm, &norm, &rng);
            ops_norms(&ex, act, 37, 45, layer_norm, &norm, &rng);
        }
        ops_swiglu(&ex, act, (size_t)64 * 1024, &swiglu, &rng);
        ops_swiglu(&ex, act, 1000 + 5, &swiglu, &rng);
        ops_crossentropy(&ex, act, 16, 8192, 8192, &ce, &rng);
        ops_crossentropy(&ex, act, 9, 1000 + 3, 1024, &ce, &rng);
        ops_adamw(&ex, act, &adamw, &same_in_pieces, &rng);
        ops_attention(act, 2, 64, 4, 2, 32, &attention, &rng); /* T, head size: whole vectors */
        ops_attention(act, 1, 37, 3, 1, 20, &attention, &rng); /* and partial ones */
        ops_rope(&ex, act, 2, 64, 4, 2, 64, 64, &attention, &rng);
        ops_rope(&ex, act, 1, 37, 3, 1, 20, 10, &attention, &rng);
    }
    /* fp32: the order of sums and exp's last bits (1e-5 of the scale); bf16: one rounding */
    const struct { const char *name; ops_worst w; } ops[] = {
        {"LayerNorm and RMSNorm, forward and backward", norm}, {"SwiGLU, forward and backward", swiglu},
        {"cross-entropy, forward and backward (its fp32 results against double)", ce}, {"AdamW, 3 steps", adamw},
        {"attention forward and backward, rotary embedding, residual add", attention}};
    for (int i = 0; i < 5; i++)
        check(r, ops[i].w.fp32 < 1e-5 && ops[i].w.bf16 < 1e-2,
              "%s: avx512 loops against portable (max rel error %.1e fp32, %.1e bf16 storage)",
              ops[i].name, ops[i].w.fp32, ops[i].w.bf16);
    check(r, same_in_pieces, "AdamW on the avx512 path: weights cut into pieces at odd places "
          "update bit for bit as whole tensors");
}
