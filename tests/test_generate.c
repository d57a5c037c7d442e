/* tests/test_generate.c — generation with the KV cache (section 16): cached logits against the
   model's full forward recomputed for every prefix, greedy tokens against lg_model_generate
   (which recomputes), the plan against the allocation and the published cache arithmetic,
   sampling against a reference written here, LoRA step directories against their merged model,
   and tools/generate's output and errors. Included by tests/test.c. */

/* Weights N(0, (2 / sqrt(columns))^2) (0.5 at 16 columns), vectors N(0, 0.5^2), norm scales
   1 + N(0, 0.1^2): attention far from uniform, activations of the same size in every block. */
static void gen_fill_random(lg_model *m, uint64_t seed) {
    lg_rng rng;
    lg_rng_seed(&rng, seed);
    for (int i = 0; i < m->param_table.n_tensors; i++) {
        const lg_tensor_info *t = &m->param_table.tensors[i];
        lg_real *w = reals(m->params) + t->offset;
        float std = t->rows > 1 ? 2.0f / sqrtf((float)t->cols) : 0.5f;
        for (size_t k = 0; k < t->count; k++)
            w[k] = t->kind == LG_TENSOR_NORM ? 1 + 0.1f * lg_rng_normal(&rng) : std * lg_rng_normal(&rng);
    }
}

/* A 32-true model of configs/NAME.yaml for its whole context, weights by gen_fill_random;
   "qwen2-like": test-llama with a bias on qkv only (Qwen2's layout). */
static int gen_random_model(results *r, lg_model *m, lg_config *cfg, const char *name, uint64_t seed) {
    lg_error err;
    int qwen2 = strcmp(name, "qwen2-like") == 0;
    if (load_config_or_fail(r, cfg, qwen2 ? "test-llama" : name)) return -1;
    cfg->attn_bias = qwen2 ? 1 : cfg->attn_bias;
    if (lg_model_create(m, cfg, 1, cfg->block_size, &err) != 0) {
        check(r, 0, "%s: %s", name, err.msg);
        return -1;
    }
    gen_fill_random(m, seed);
    return 0;
}

static int gen_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* A generator for m's config holding m's weights (an fp32 copy rounded to its precision). */
static int gen_from_model(results *r, lg_generator *g, const lg_model *m, int positions,
                          int prefill, lg_precision precision) {
    lg_error err;
    lg_gen_spec spec = {positions, prefill, precision, gen_threads(), 0};
    if (lg_generator_create(g, &m->cfg, &spec, &err) != 0) {
        check(r, 0, "%s: %s", m->cfg.name, err.msg);
        return -1;
    }
    lg_copy(NULL, g->params, m->params, m->n_params);
    return 0;
}

/* The error of the generator's logits against the model's full forward of seq (n): the logits
   of its last position, relative to their largest magnitude (at least 1). */
static double gen_uncached_error(lg_model *m, const lg_generator *g, const int *seq, int n) {
    lg_model_forward(m, seq, NULL, 1, n, NULL);
    const lg_real *row = reals(m->a.logits) + (size_t)(n - 1) * m->cfg.padded_vocab_size;
    return rel_error(g->logits, row, (size_t)m->cfg.vocab_size, 1.0);
}

typedef struct {
    lg_model *m;
    const lg_generator *g;
    int *seq, n;
    double worst;
} gen_compare;

/* lg_generate's callback: the logits that drew `token` against the recomputed ones. */
static int gen_compare_token(void *ctx, int token) {
    gen_compare *c = (gen_compare *)ctx;
    c->worst = fmax(c->worst, gen_uncached_error(c->m, c->g, c->seq, c->n));
    c->seq[c->n++] = token;
    return 0;
}

/* A prompt of P random ids, n_new greedy tokens with the cache (prefill at most `prefill` at a
   time): every step's logits within 1e-5 of the full recomputation, the tokens those of
   lg_model_generate. n_new 0: the prompt fills the cache; its last logits are compared. */
static void test_gen_cached_equals_uncached(results *r, const char *name, int P, int n_new,
                                            int prefill) {
    lg_model m;
    lg_config cfg;
    lg_generator g;
    lg_error err;
    if (gen_random_model(r, &m, &cfg, name, 7) != 0) return;
    if (gen_from_model(r, &g, &m, P + n_new, prefill, LG_PRECISION_32_TRUE) != 0) {
        lg_model_free(&m);
        return;
    }
    int seq[64], uncached[64], out[64], n_out = 0, ok = 1;
    lg_rng rng;
    lg_rng_seed(&rng, 11);
    for (int i = 0; i < P; i++) seq[i] = uncached[i] = (int)(lg_rng_u64(&rng) % (uint64_t)cfg.vocab_size);
    gen_compare c = {&m, &g, seq, P, 0.0};
    lg_sampling greedy = lg_sampling_default();
    greedy.temperature = 0;
    if (n_new == 0) {
        ok = lg_generator_forward(&g, seq, P, &err) == 0;
        c.worst = gen_uncached_error(&m, &g, seq, P);
    } else {
        ok = lg_generate(&g, seq, P, n_new, &greedy, &rng, out, &n_out, gen_compare_token, &c,
                         NULL, &err) == 0 && n_out == n_new;
        lg_model_generate(&m, uncached, P, n_new, 0.0f, &rng);
        for (int i = 0; i < n_new && ok; i++) ok = out[i] == uncached[P + i];
    }
    check(r, ok && c.worst < 1e-5, "%-12s prompt %2d + %2d new (prefill %2d at a time, cache %2d of "
          "block_size %d): logits within %.1e of the recomputed (< 1e-5), the same %d greedy tokens",
          name, P, n_new, prefill, P + n_new, cfg.block_size, c.worst, n_new);
    lg_generator_free(&g);
    lg_model_free(&m);
}

/* bf16-true storage of weights and cache against fp32 with the cache: bf16's rounding. */
static void test_gen_bf16(results *r) {
    lg_model m;
    lg_config cfg;
    lg_generator g32, g16;
    lg_error err;
    if (gen_random_model(r, &m, &cfg, "test-llama", 3) != 0) return;
    int seq[8] = {1, 5, 9, 2, 7, 3, 11, 4};
    int ok = gen_from_model(r, &g32, &m, 8, 4, LG_PRECISION_32_TRUE) == 0;
    if (ok && gen_from_model(r, &g16, &m, 8, 4, LG_PRECISION_BF16_TRUE) != 0) {
        lg_generator_free(&g32);
        ok = 0;
    }
    if (!ok) { lg_model_free(&m); return; }
    lg_copy(NULL, g32.params, g16.params, m.n_params); /* the same (bf16) weights: the storage of
                                                           activations and cache differs */
    ok = lg_generator_forward(&g32, seq, 8, &err) == 0 && lg_generator_forward(&g16, seq, 8, &err) == 0;
    double e = rel_error(g16.logits, g32.logits, (size_t)cfg.vocab_size, 1.0);
    check(r, ok && e < 3e-2 && e > 0 && g16.keys.dtype == LG_DTYPE_BF16,
          "test-llama   bf16-true: logits within %.1e of fp32 activations and cache on the same "
          "weights (bf16 rounding, < 3e-2)", e);
    lg_generator_free(&g16);
    lg_generator_free(&g32);
    lg_model_free(&m);
}

/* A stop id ends the generation right after it comes (it is the last token out). */
static void test_gen_stop(results *r) {
    lg_model m;
    lg_config cfg;
    lg_generator g;
    lg_error err;
    if (gen_random_model(r, &m, &cfg, "test-llama", 21) != 0) return;
    if (gen_from_model(r, &g, &m, 16, 4, LG_PRECISION_32_TRUE) != 0) { lg_model_free(&m); return; }
    int prompt[4] = {2, 7, 1, 8}, all[12], out[12], n_all = 0, n_out = 0, first = 0;
    lg_sampling s = lg_sampling_default();
    s.temperature = 0;
    lg_gen_stats st;
    int ok = lg_generate(&g, prompt, 4, 12, &s, NULL, all, &n_all, NULL, NULL, &st, &err) == 0 &&
             n_all == 12 && !st.stopped;
    while (first < 6 && all[first] != all[6]) first++; /* where all[6] first comes */
    s.stop = &all[6];
    s.n_stop = 1;
    ok = ok && lg_generate(&g, prompt, 4, 12, &s, NULL, out, &n_out, NULL, NULL, &st, &err) == 0 &&
         n_out == first + 1 && st.stopped && st.decode_tokens == first &&
         memcmp(out, all, sizeof(int) * (size_t)n_out) == 0;
    check(r, ok, "stop id %d: %d of 12 tokens, the last the stop id, %d decode steps", all[6], n_out,
          st.decode_tokens);
    lg_generator_free(&g);
    lg_model_free(&m);
}

/* A head whose vocab_size rows pass the tokenizer's (config.json's vocab_size counting padding):
   the generator draws only ids below spec.vocab, greedy or sampled, although the padded rows
   (scaled up 4x) hold the largest logit. */
static void test_gen_padded_vocab(results *r) {
    lg_model m;
    lg_config cfg;
    lg_generator g;
    lg_error err;
    if (gen_random_model(r, &m, &cfg, "test-llama", 31) != 0) return;
    enum { REAL = 20, NEW = 12 };
    int V = cfg.vocab_size, C = cfg.n_embd;
    lg_gen_spec spec = {16, 4, LG_PRECISION_32_TRUE, 1, REAL};
    if (lg_generator_create(&g, &m.cfg, &spec, &err) != 0) {
        check(r, 0, "padded vocab: %s", err.msg);
        lg_model_free(&m);
        return;
    }
    lg_copy(NULL, g.params, m.params, m.n_params);
    lg_real *head = reals(g.p.lm_head_w); /* (V, C) */
    for (size_t k = (size_t)REAL * C; k < (size_t)V * C; k++) head[k] *= 4;
    int prompt[4] = {2, 7, 1, 8}, out[NEW], n_out = 0, outside = 0, padded_won = 0, not_argmax = 0;
    lg_sampling s = lg_sampling_default();
    s.top_k = 0, s.temperature = 0;
    lg_rng rng;
    lg_rng_seed(&rng, 3);
    int ok = 1;
    for (int round = 0; round < 2 && ok; round++) { /* greedy, then temperature 1 over all ids */
        ok = lg_generate(&g, prompt, 4, NEW, &s, &rng, out, &n_out, NULL, NULL, NULL, &err) == 0 &&
             n_out == NEW;
        lg_generator_reset(&g);
        int seq[16];
        memcpy(seq, prompt, sizeof prompt);
        memcpy(seq + 4, out, sizeof(int) * NEW);
        for (int i = 0; i < NEW && ok; i++) { /* the logits each draw came from, step by step */
            ok = lg_generator_forward(&g, i ? &seq[3 + i] : seq, i ? 1 : 4, &err) == 0;
            int best_real = 0, best_all = 0;
            for (int v = 1; v < V; v++) {
                if (v < REAL && g.logits[v] > g.logits[best_real]) best_real = v;
                if (g.logits[v] > g.logits[best_all]) best_all = v;
            }
            outside += out[i] >= REAL;
            padded_won += best_all >= REAL;
            not_argmax += round == 0 && out[i] != best_real;
        }
        s.temperature = 1;
    }
    check(r, ok && outside == 0 && not_argmax == 0 && padded_won > NEW,
          "padded vocab (%d rows, the tokenizer's %d): %d of %d draws outside, %d greedy draws "
          "not the real ids' argmax, a padded id the largest logit at %d of %d steps (> %d) %s",
          V, REAL, outside, 2 * NEW, not_argmax, padded_won, 2 * NEW, NEW, ok ? "" : err.msg);
    lg_generator_free(&g);
    spec.vocab = V + 1;
    lg_plan plan;
    char named[32];
    snprintf(named, sizeof named, "vocab %d ", V + 1);
    check(r, lg_gen_plan(&plan, &m.cfg, &spec, &err) != 0 && strstr(err.msg, named),
          "a vocab past the model's refused: %s", err.msg);
    lg_model_free(&m);
}

/* The generator allocates its plan's one arena and small tables; its views are the regions. */
static void test_gen_plan_matches_allocation(results *r, const char *name, int positions) {
    lg_config cfg;
    lg_generator g;
    lg_error err;
    if (load_config_or_fail(r, &cfg, name)) return;
    lg_gen_spec spec = {positions, positions / 2, LG_PRECISION_32_TRUE, gen_threads(), 0};
    test_allocations.n = 0;
    test_allocations.counting = 1;
    int rc = lg_generator_create(&g, &cfg, &spec, &err);
    test_allocations.counting = 0;
    if (rc != 0) { check(r, 0, "%s: %s", name, err.msg); return; }
    const lg_rank_plan *plan = &g.plan.ranks[0];
    size_t other = 0;
    int arena = 0;
    for (int i = 0; i < test_allocations.n; i++) {
        if (test_allocations.blocks[i] == g.rank.arena[LG_POOL_DEVICE])
            arena += test_allocations.sizes[i] == plan->pool_bytes[LG_POOL_DEVICE] + LG_ALIGN;
        else other += test_allocations.sizes[i];
    }
    size_t cache = (size_t)cfg.n_layer * cfg.n_query_groups * positions * cfg.head_size * sizeof(lg_real);
    const lg_rank *rk = &g.rank;
    int ok = arena == 1 && other <= 32768 + (size_t)cfg.n_layer * 8192 && !g.rank.arena[LG_POOL_HOST] &&
             g.params.data == lg_rank_region(rk, "weights") && g.keys.data == lg_rank_region(rk, "kv_cache.keys") &&
             g.values.data == lg_rank_region(rk, "kv_cache.values") &&
             g.x.data == lg_rank_region(rk, "generation.working") &&
             (void *)g.logits == lg_rank_region(rk, "generation.logits") &&
             lg_plan_find(plan, "kv_cache.keys")->bytes == (cache + LG_ALIGN - 1) / LG_ALIGN * LG_ALIGN;
    check(r, ok, "%-12s generation plan = allocation: one arena of %zu bytes, %zu bytes of tables; "
          "cache (L %d, NQG %d, %d positions, HS %d) x 2", name, plan->pool_bytes[LG_POOL_DEVICE],
          other, cfg.n_layer, cfg.n_query_groups, positions, cfg.head_size);
    lg_generator_free(&g);
}

/* Meta-Llama-3-8B in bf16: 128 KiB of cache a token (32 layers x 8 kv heads x 128 x 2 bytes,
   keys and values), so 256 MiB for 2048 positions and 6.25 MiB for 50 (not block_size's 8192);
   the weights 8,030,261,248 parameters x 2 bytes. */
static void test_gen_plan_llama3(results *r) {
    lg_config cfg;
    lg_plan plan;
    lg_error err;
    if (load_config_or_fail(r, &cfg, "Meta-Llama-3-8B")) return;
    size_t n = 32 * (2 * 4096ull * 4096 + 2 * 1024ull * 4096 + 3 * 4096ull * 14336 + 2 * 4096) +
               2 * 128256ull * 4096 + 4096;
    int positions[2] = {2048, 50};
    for (int k = 0; k < 2; k++) {
        lg_gen_spec spec = {positions[k], positions[k], LG_PRECISION_BF16_TRUE, 1, 0};
        if (lg_gen_plan(&plan, &cfg, &spec, &err) != 0) { check(r, 0, "%s", err.msg); return; }
        const lg_rank_plan *rp = &plan.ranks[0];
        size_t cache = lg_plan_find(rp, "kv_cache.keys")->bytes + lg_plan_find(rp, "kv_cache.values")->bytes;
        check(r, cache == (size_t)positions[k] * 128 * 1024 && lg_plan_find(rp, "weights")->bytes == 2 * n,
              "Meta-Llama-3-8B bf16, %4d positions: cache %zu bytes = 128 KiB a token, weights %zu "
              "bytes", positions[k], cache, 2 * n);
        lg_plan_free(&plan);
    }
}

/* --- sampling against a reference ------------------------------------------------------------ */

/* LitGPT's rule written out: keep logits >= the k-th largest (top_k > 0), softmax at
   temperature, then in descending order keep each token whose predecessors hold < top_p. */
static void gen_reference_probs(const lg_real *logits, int V, float temperature, int top_k,
                                float top_p, double *probs) {
    double sorted[16], kth = -INFINITY, max = -INFINITY, sum = 0;
    for (int v = 0; v < V; v++) sorted[v] = logits[v];
    for (int i = 0; i < V; i++) /* selection sort, descending */
        for (int j = i + 1; j < V; j++)
            if (sorted[j] > sorted[i]) { double t = sorted[i]; sorted[i] = sorted[j]; sorted[j] = t; }
    if (top_k > 0 && top_k < V) kth = sorted[top_k - 1];
    for (int v = 0; v < V; v++) max = logits[v] >= kth && logits[v] > max ? logits[v] : max;
    for (int v = 0; v < V; v++) probs[v] = logits[v] >= kth ? exp((logits[v] - max) / temperature) : 0;
    for (int v = 0; v < V; v++) sum += probs[v];
    for (int v = 0; v < V; v++) probs[v] /= sum;
    if (top_p >= 1) return;
    int kept[16] = {0};
    double before = 0;
    for (int step = 0; step < V && before < top_p; step++) { /* the next most likely */
        int best = -1;
        for (int v = 0; v < V; v++)
            if (!kept[v] && (best < 0 || probs[v] > probs[best])) best = v;
        kept[best] = 1;
        before += probs[best];
    }
    for (int v = 0; v < V; v++) probs[v] = kept[v] ? probs[v] / before : 0;
}

static void test_gen_sampling(results *r) {
    const lg_real logits[6] = {2.0f, 1.0f, 0.5f, 3.0f, -1.0f, 1.0f};
    const struct { float temperature; int top_k; float top_p; } cases[4] = {
        {0.7f, 3, 1.0f}, /* the 3rd largest is a tie: both 1.0s stay */
        {1.0f, 0, 0.8f}, {1.5f, 4, 0.9f}, {1.0f, 1, 1.0f}};
    lg_real probs[6];
    int order[6];
    for (int k = 0; k < 4; k++) {
        lg_sampling s = lg_sampling_default();
        s.temperature = cases[k].temperature, s.top_k = cases[k].top_k, s.top_p = cases[k].top_p;
        double want[6], seen[6] = {0}, worst = 0;
        gen_reference_probs(logits, 6, s.temperature, s.top_k, s.top_p, want);
        lg_rng rng;
        lg_rng_seed(&rng, 5 + (uint64_t)k);
        const int draws = 40000;
        for (int i = 0; i < draws; i++) seen[lg_sample(logits, 6, &s, &rng, probs, order)] += 1.0 / draws;
        for (int v = 0; v < 6; v++) worst = fmax(worst, fabs(seen[v] - want[v]));
        int impossible = 0; /* a token outside the kept set never comes */
        for (int v = 0; v < 6; v++) impossible |= want[v] == 0 && seen[v] > 0;
        check(r, worst < 0.01 && !impossible, "sampling temperature %.1f, top_k %d, top_p %.1f: "
              "%d draws within %.4f of the reference's probabilities (< 0.01, 4 sigma), none outside "
              "the kept set", s.temperature, s.top_k, s.top_p, draws, worst);
    }
    lg_sampling greedy = lg_sampling_default();
    greedy.temperature = 0;
    lg_rng a, b;
    lg_rng_seed(&a, 9);
    lg_rng_seed(&b, 9);
    int same = 1;
    lg_sampling s = lg_sampling_default();
    for (int i = 0; i < 200; i++)
        same &= lg_sample(logits, 6, &s, &a, probs, order) == lg_sample(logits, 6, &s, &b, probs, order);
    check(r, lg_sample(logits, 6, &greedy, &a, probs, order) == 3 && same,
          "sampling: temperature 0 is the argmax; one seed, one sequence of draws");
}

/* Logits that are not finite (a NaN weight, an overflow): lg_sample draws nothing (-1) from
   all-NaN, all-inf or one-NaN logits, greedy or sampled; lg_generate fails naming the
   position: a NaN in ln_f's scale makes every logit NaN at the prompt's last position (3), a
   NaN in the embedding row of the first greedy token at the next one (4). */
static void test_gen_not_finite(results *r) {
    lg_real nan6[6], inf6[6], one6[6] = {1, 2, 3, 4, 5, 6}, probs[6];
    int order[6], drawn[6], k = 0;
    for (int v = 0; v < 6; v++) nan6[v] = (lg_real)NAN, inf6[v] = (lg_real)INFINITY;
    one6[4] = (lg_real)NAN;
    lg_sampling s = lg_sampling_default(), greedy = s;
    greedy.temperature = 0;
    lg_rng rng;
    lg_rng_seed(&rng, 1);
    const lg_real *cases[3] = {nan6, inf6, one6};
    for (int c = 0; c < 3; c++) {
        drawn[k++] = lg_sample(cases[c], 6, &s, &rng, probs, order);
        drawn[k++] = lg_sample(cases[c], 6, &greedy, &rng, probs, order);
    }
    int none = 1;
    for (int i = 0; i < 6; i++) none &= drawn[i] == -1;
    check(r, none, "lg_sample on all-NaN, all-inf and one-NaN logits, sampled and greedy: "
          "%d %d %d %d %d %d (-1: nothing drawn)", drawn[0], drawn[1], drawn[2], drawn[3],
          drawn[4], drawn[5]);
    lg_model m;
    lg_config cfg;
    lg_generator g;
    lg_error err;
    if (gen_random_model(r, &m, &cfg, "test-llama", 41) != 0) return;
    if (gen_from_model(r, &g, &m, 16, 4, LG_PRECISION_32_TRUE) != 0) { lg_model_free(&m); return; }
    int prompt[4] = {2, 7, 1, 8}, out[8], n_out = 0;
    int first = lg_generate(&g, prompt, 4, 8, &greedy, &rng, out, &n_out, NULL, NULL, NULL, &err) == 0
                ? out[0] : -1;
    char want[2][96];
    snprintf(want[0], sizeof want[0], "the logits at position 3 are not finite (%d of %d NaN",
             cfg.vocab_size, cfg.vocab_size);
    snprintf(want[1], sizeof want[1], "the logits at position 4 are not finite (%d of %d NaN",
             cfg.vocab_size, cfg.vocab_size);
    for (int at = 0; at < 2 && first >= 0; at++) {
        lg_copy(NULL, g.params, m.params, m.n_params);
        if (at == 0) reals(g.p.ln_f_w)[5] = (lg_real)NAN;
        else reals(g.p.wte)[(size_t)first * cfg.n_embd] = (lg_real)NAN;
        int rc = lg_generate(&g, prompt, 4, 8, &greedy, &rng, out, &n_out, NULL, NULL, NULL, &err);
        check(r, rc == -1 && strstr(err.msg, want[at]) && n_out == at,
              "a NaN in %s: lg_generate fails after %d tokens: %s", at ? "the first token's "
              "embedding" : "ln_f's scale", n_out, rc ? err.msg : "(no error)");
    }
    if (first < 0) check(r, 0, "greedy generation: %s", err.msg);
    lg_generator_free(&g);
    /* tools/generate on a model directory whose ln_f holds a NaN: exit 1, the position named */
    reals(m.p.ln_f_w)[3] = (lg_real)NAN;
    int rc = lg_hf_save(&m, "build/test-gen-nan", &err);
    lg_model_free(&m);
    if (rc != 0) { check(r, 0, "%s", err.msg); return; }
    expect_program(r, "OMP_NUM_THREADS=1 ./tools/generate", "--load build/test-gen-nan "
                   "--prompt-ids '1 2 3' --temperature 0", 1,
                   "generate: generation: the logits at position 2 are not finite");
    expect_program(r, "OMP_NUM_THREADS=1 ./tools/generate", "--load build/test-gen-nan "
                   "--prompt-ids '1 2 3 4 5'", 1, "the logits at position 4 are not finite");
}

/* --- LoRA step directories ------------------------------------------------------------------- */

static int gen_copy_file(const char *from, const char *to) {
    FILE *in = fopen(from, "rb"), *out = in ? fopen(to, "wb") : NULL;
    char buf[65536];
    size_t n;
    int rc = in && out ? 0 : -1;
    while (rc == 0 && (n = fread(buf, 1, sizeof buf, in)) > 0) rc = fwrite(buf, 1, n, out) == n ? 0 : -1;
    if (in) fclose(in);
    if (out && fclose(out) != 0) rc = -1;
    return rc;
}

/* The logits of a fixed prompt (8 tokens) from a model directory, into logits (V). */
static int gen_dir_logits(results *r, const char *dir, lg_real *logits, int V) {
    lg_gen_source src;
    lg_generator g;
    lg_error err;
    int prompt[8] = {3, 1, 4, 1, 5, 9, 2, 6};
    lg_gen_spec spec = {8, 8, LG_PRECISION_32_TRUE, gen_threads(), 0};
    int rc = lg_gen_source_find(&src, dir, &err);
    if (rc == 0) rc = lg_generator_create(&g, &src.cfg, &spec, &err);
    if (rc == 0) {
        rc = lg_generator_load(&g, &src, &err);
        if (rc == 0) rc = lg_generator_forward(&g, prompt, 8, &err);
        if (rc == 0) memcpy(logits, g.logits, sizeof(lg_real) * (size_t)V);
        lg_generator_free(&g);
    }
    if (rc != 0) check(r, 0, "%s: %s", dir, err.msg);
    return rc;
}

/* A LoRA run's last step-N holds the merged model and the adapters; the adapters alone (a
   directory with config.json and the PEFT files, the base model named inside) give the same
   logits, and not the base model's. */
static void test_gen_lora_dir(results *r, const char *family) {
    char args[512], out[128], step[160], only[160], from[256], to[256];
    static const char *const files[3] = {"config.json", "adapter_config.json", "adapter_model.safetensors"};
    snprintf(out, sizeof out, "build/test-gen-lora-%s", family);
    snprintf(step, sizeof step, "%s/step-2", out);
    snprintf(only, sizeof only, "%s-adapters", out);
    snprintf(args, sizeof args, "OMP_NUM_THREADS=1 ./train --load tests/hf/%s --lora-r 2 --lora-alpha 5 --lora-targets "
             "q,v,proj,mlp%s -p 32-true --max-steps 2 -b 2 -t 8 --lr 0.05 --eval-every 0 "
             "--sample-tokens 1 --save-every 1 --out %s > /dev/null 2>&1", family,
             strcmp(family, "gpt2") ? ",head" : "" /* GPT-2: tied */, out);
    mkdir("build", 0755);
    mkdir(only, 0755);
    int ok = system(args) == 0;
    for (int k = 0; k < 3 && ok; k++) {
        snprintf(from, sizeof from, "%s/%s", step, files[k]);
        snprintf(to, sizeof to, "%s/%s", only, files[k]);
        ok = gen_copy_file(from, to) == 0;
    }
    if (!ok) { check(r, 0, "%s: LoRA training run or copying its files failed", args); return; }
    lg_real merged[64], adapters[64], base[64];
    char base_dir[64];
    snprintf(base_dir, sizeof base_dir, "tests/hf/%s", family);
    if (gen_dir_logits(r, step, merged, 32) || gen_dir_logits(r, only, adapters, 32) ||
        gen_dir_logits(r, base_dir, base, 32))
        return;
    double e = rel_error(adapters, merged, 32, 1.0), moved = rel_error(base, merged, 32, 1.0);
    lg_real first[64]; /* step-1 as written: adapters only, its COMPLETE marker verified */
    snprintf(step, sizeof step, "%s/step-1", out);
    int step1 = gen_dir_logits(r, step, first, 32) == 0;
    double early = step1 ? rel_error(first, merged, 32, 1.0) : 0;
    check(r, e < 1e-5 && moved > 1e-4 && step1 && early > 0, "LoRA %-6s step-2's adapters alone: "
          "logits within %.1e of its merged model's (< 1e-5), %.1e from the base model's; step-1 "
          "(adapters only) loads, %.1e from step-2", family, e, moved, early);
}

/* --- tools/generate ---------------------------------------------------------------------------- */

/* The last line of a command's standard output into line (cap); its exit code. */
static int gen_run(const char *cmd, char *line, size_t cap, char *all, size_t all_cap) {
    char out[16384];
    FILE *p = popen(cmd, "r");
    size_t n = p ? fread(out, 1, sizeof out - 1, p) : 0;
    out[n] = '\0';
    int status = p ? pclose(p) : -1;
    while (n > 0 && out[n - 1] == '\n') out[--n] = '\0';
    char *last = strrchr(out, '\n');
    snprintf(line, cap, "%s", last ? last + 1 : out);
    if (all) snprintf(all, all_cap, "%s", out);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* A random model of tests/hf/llama's config (seed) saved as a Hugging Face directory. */
static int gen_save_llama(results *r, const char *dir, uint64_t seed) {
    lg_config cfg;
    lg_model m;
    lg_error err;
    int rc = lg_hf_config_read(&cfg, "tests/hf/llama", &err);
    if (rc == 0) rc = lg_model_create(&m, &cfg, 1, 8, &err);
    if (rc == 0) {
        lg_model_init_weights(&m, seed, NULL);
        rc = lg_hf_save(&m, dir, &err);
        lg_model_free(&m);
    }
    if (rc != 0) check(r, 0, "%s: %s", dir, err.msg);
    return rc;
}

/* tools/generate --load a LoRA run's step-1 (adapters only) checks the base adapter_config.json
   names by the base_hash resume checks: for 32-true, bf16-true and QLoRA (nf4, bf16-mixed)
   runs the base as trained loads (the hash computed from the files equals the trainer's);
   with the base's weights replaced by another model of the same shapes it is refused in one
   line naming both (exit 1), as ./train --resume refuses it. */
static void test_gen_lora_base_check(results *r) {
    static const char *const modes[3] = {"-p 32-true", "-p bf16-true", "--quantize nf4"};
    char cmd[768], base[64], run[64], want[256], line[512];
    for (int k = 0; k < 3; k++) {
        snprintf(base, sizeof base, "build/test-gen-base-%d", k);
        snprintf(run, sizeof run, "build/test-gen-base-run-%d", k);
        if (gen_save_llama(r, base, 3) != 0) return;
        snprintf(cmd, sizeof cmd, "rm -rf %s && OMP_NUM_THREADS=1 ./train --load %s --lora-r 2 "
                 "--lora-targets q,v,mlp %s --max-steps 2 -b 2 -t 8 --lr 0.05 --eval-every 0 "
                 "--sample-tokens 1 --save-every 1 --out %s > /dev/null 2>&1", run, base,
                 modes[k], run);
        if (system(cmd) != 0) { check(r, 0, "%s: failed", cmd); return; }
        /* generating in bf16 reads the base again in fp32 to hash it; in fp32 hashes its own */
        const char *precision = k ? "bf16-true" : "32-true";
        snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=1 ./tools/generate --load %s/step-1 -p %s "
                 "--prompt-ids '3 1 4' --max-new-tokens 4 --temperature 0 --ids 2>/dev/null", run,
                 precision);
        int same = gen_run(cmd, line, sizeof line, NULL, 0);
        check(r, same == 0 && strlen(line) > 0, "tools/generate -p %s --load %s/step-1 (%s) over "
              "its own base %s: exit %d, ids \"%s\"", precision, run, modes[k], base, same, line);
        if (gen_save_llama(r, base, 4) != 0) return; /* the same shapes, other weights */
        snprintf(want, sizeof want, "generate: checkpoint %s/step-1: its adapters were trained "
                 "over base %s (hash ", run, base);
        snprintf(cmd, sizeof cmd, "--load %s/step-1 --prompt-ids '3 1 4' --max-new-tokens 4", run);
        expect_program(r, "OMP_NUM_THREADS=1 ./tools/generate", cmd, 1, want);
        snprintf(want, sizeof want, "), the base %s that adapter_config.json names has hash ", base);
        expect_program(r, "OMP_NUM_THREADS=1 ./tools/generate", cmd, 1, want);
    }
}

/* Greedy ids from lg_model_generate (recomputing) for a Hugging Face directory, as text. */
static int gen_library_ids(results *r, const char *dir, const int *prompt, int P, int n_new,
                           char *text, size_t cap) {
    lg_config cfg;
    lg_model m;
    lg_error err;
    int tokens[64];
    if (lg_hf_config_read(&cfg, dir, &err) != 0 || lg_model_create(&m, &cfg, 1, P + n_new, &err) != 0) {
        check(r, 0, "%s: %s", dir, err.msg);
        return -1;
    }
    int rc = lg_hf_load_weights(&cfg, m.params, dir, &err);
    if (rc != 0) check(r, 0, "%s: %s", dir, err.msg);
    memcpy(tokens, prompt, sizeof(int) * (size_t)P);
    if (rc == 0) lg_model_generate(&m, tokens, P, n_new, 0.0f, NULL);
    size_t at = 0;
    text[0] = '\0';
    for (int i = 0; i < n_new && rc == 0; i++)
        at += (size_t)snprintf(text + at, cap - at, "%s%d", i ? " " : "", tokens[P + i]);
    lg_model_free(&m);
    return rc;
}

static void test_gen_tool_ids(results *r, const char *dir) {
    int prompt[3] = {1, 2, 3};
    char want[512], got[512], cmd[512];
    if (gen_library_ids(r, dir, prompt, 3, 12, want, sizeof want) != 0) return;
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=1 ./tools/generate --load %s --prompt-ids \"1 2 3\" --max-new-tokens 12 "
             "--temperature 0 --ids 2>/dev/null", dir);
    int code = gen_run(cmd, got, sizeof got, NULL, 0);
    check(r, code == 0 && strcmp(got, want) == 0, "tools/generate --load %s --temperature 0 --ids: "
          "\"%s\", lg_model_generate's (recomputing) \"%s\"", dir, got, want);
}

/* The tool on a LoRA step's adapters alone and on its merged model: the same greedy ids. */
static void test_gen_tool_lora(results *r) {
    char a[512], b[512];
    const char *cmd = "OMP_NUM_THREADS=1 ./tools/generate --load %s --prompt-ids '3 1 4 1 5' --max-new-tokens 8 "
                      "--temperature 0 --ids 2>/dev/null";
    char run[512];
    snprintf(run, sizeof run, cmd, "build/test-gen-lora-llama-adapters");
    int ca = gen_run(run, a, sizeof a, NULL, 0);
    snprintf(run, sizeof run, cmd, "build/test-gen-lora-llama");
    int cb = gen_run(run, b, sizeof b, NULL, 0);
    check(r, ca == 0 && cb == 0 && strcmp(a, b) == 0 && strlen(a) > 0, "tools/generate --load "
          "a LoRA step's adapters: \"%s\"; --load its run's directory (the latest step, merged): "
          "\"%s\"", a, b);
}

/* A text prompt through GPT-2's tokenizer on a model of GPT-2's vocabulary (random weights). */
static void test_gen_tool_text(results *r) {
    lg_config cfg;
    lg_model m;
    lg_error err;
    if (load_config_or_fail(r, &cfg, "test-gpt2")) return;
    cfg.vocab_size = cfg.padded_vocab_size = 50257;
    cfg.block_size = 32;
    if (lg_model_create(&m, &cfg, 1, 8, &err) != 0) { check(r, 0, "%s", err.msg); return; }
    lg_model_init_weights(&m, 3, NULL);
    int rc = lg_hf_save(&m, "build/test-gen-gpt2-vocab", &err);
    lg_model_free(&m);
    if (rc != 0) { check(r, 0, "%s", err.msg); return; }
    int prompt[2] = {15496, 995}; /* "Hello world" */
    char want[256], got[256], all[16384];
    if (gen_library_ids(r, "build/test-gen-gpt2-vocab", prompt, 2, 5, want, sizeof want) != 0) return;
    int code = gen_run("OMP_NUM_THREADS=1 ./tools/generate --load build/test-gen-gpt2-vocab --tokenizer data/gpt2 "
                       "--prompt 'Hello world' --max-new-tokens 5 --temperature 0 --ids 2>/dev/null",
                       got, sizeof got, all, sizeof all);
    check(r, code == 0 && strncmp(all, "Hello world", 11) == 0 && strcmp(got, want) == 0,
          "tools/generate --prompt 'Hello world' --tokenizer data/gpt2: the text, then ids \"%s\" "
          "(lg_model_generate from 15496 995: \"%s\")", got, want);
}

/* A conversation's next turn on the cache (lg_generate_continue), with and without keeping
   only a prefix (lg_generator_truncate), against generating from the whole sequence anew:
   the same greedy tokens and the same logits. */
static void test_gen_continue(results *r) {
    lg_model m;
    lg_config cfg;
    lg_generator g;
    lg_error err;
    if (gen_random_model(r, &m, &cfg, "test-llama", 33) != 0) return;
    if (gen_from_model(r, &g, &m, 16, 4, LG_PRECISION_32_TRUE) != 0) { lg_model_free(&m); return; }
    lg_sampling s = lg_sampling_default();
    s.temperature = 0;
    int first[3] = {2, 7, 1}, next[3] = {9, 4, 6}, out1[3], out2[3], fresh[3], seq[12];
    int n1 = 0, n2 = 0, nf = 0, ok = 1;
    double worst = 0;
    for (int keep = 0; keep < 2; keep++) { /* 0: all of the cache; 1: truncated after 4 */
        ok = ok && lg_generate(&g, first, 3, 3, &s, NULL, out1, &n1, NULL, NULL, NULL, &err) == 0;
        int n = 0; /* the whole conversation: first, the reply, then next */
        for (int i = 0; i < 3; i++) seq[n++] = first[i];
        for (int i = 0; i < n1; i++) seq[n++] = out1[i];
        for (int i = 0; i < 3; i++) seq[n++] = next[i];
        int cached = 3 + n1 - 1, from = keep ? 4 : cached; /* the reply's last is not cached */
        lg_generator_truncate(&g, from);
        ok = ok && lg_generate_continue(&g, seq + from, n - from, 3, &s, NULL, out2, &n2, NULL,
                                        NULL, NULL, &err) == 0;
        lg_real *continued = (lg_real *)malloc(sizeof(lg_real) * (size_t)cfg.vocab_size);
        memcpy(continued, g.logits, sizeof(lg_real) * (size_t)cfg.vocab_size);
        ok = ok && lg_generate(&g, seq, n, 3, &s, NULL, fresh, &nf, NULL, NULL, NULL, &err) == 0 &&
             n2 == nf && memcmp(out2, fresh, sizeof(int) * (size_t)nf) == 0;
        for (int v = 0; v < cfg.vocab_size; v++) worst = fmax(worst, fabs(continued[v] - g.logits[v]));
        free(continued);
    }
    check(r, ok && worst < 1e-5, "a next turn on the cache (whole, and truncated to 4 positions) "
          "draws the tokens of a fresh generation over the whole conversation; logits within %.1e",
          worst);
    lg_generator_free(&g);
    lg_model_free(&m);
}

/* tools/generate --chat: two turns from standard input, rendered with Llama 3's template on a
   small model with Llama 3's vocabulary; each reply printed, then its ids (--ids). */
static void test_gen_tool_chat(results *r) {
    lg_config cfg;
    lg_model m;
    lg_error err;
    if (load_config_or_fail(r, &cfg, "test-llama31")) return;
    cfg.vocab_size = cfg.padded_vocab_size = 128256;
    cfg.block_size = 128;
    if (lg_model_create(&m, &cfg, 1, 8, &err) != 0) { check(r, 0, "%s", err.msg); return; }
    lg_model_init_weights(&m, 5, NULL);
    int rc = lg_hf_save(&m, "build/test-gen-chat", &err);
    lg_model_free(&m);
    if (rc != 0) { check(r, 0, "%s", err.msg); return; }
    char last[512], all[16384];
    int code = gen_run("printf 'Hello there\\nAnd again\\n' | OMP_NUM_THREADS=1 ./tools/generate "
                       "--load build/test-gen-chat --tokenizer data/llama3 --chat --template llama3 "
                       "--system 'Be brief.' --max-new-tokens 4 --temperature 0 --ids 2>&1",
                       last, sizeof last, all, sizeof all);
    int lines = 0;
    for (const char *p = all; (p = strstr(p, "decode:")) != NULL; p++) lines++;
    check(r, code == 0 && strstr(all, "chat: template llama3") && lines == 2,
          "tools/generate --chat --template llama3: 2 turns from standard input, 2 replies "
          "(exit %d): \"%s\"", code, last);
    /* the library's message names the setting; generate spells it as its flag */
    expect_program(r, "./tools/generate", "--load build/test-gen-chat --chat --template nosuch "
                   "--tokenizer data/llama3 < /dev/null", 2,
                   "generate: --chat: --template nosuch: no such template");
    expect_program(r, "./tools/generate", "--load build/test-gen-chat --chat --template chatml "
                   "--tokenizer data/gpt2 < /dev/null", 2, "--chat: template chatml: markers "
                   "<|im_start|>, <|im_end|> are not special tokens of tokenizer data/gpt2");
    expect_program(r, "./tools/generate", "--load build/test-gen-chat --chat --prompt hi", 2,
                   "--chat reads its turns from standard input");
    expect_program(r, "printf 'hi\\n' | ./tools/generate", "--load tests/hf/llama --chat "
                   "--template llama3 --tokenizer data/llama3", 2, "outside the model's vocabulary");
}

/* tools/generate --chat's input: a line of 66,000 bytes (past the 64 KiB a line once had) is
   one turn with one reply; a NUL byte is refused naming the line; --max-new-tokens 0 is
   refused. */
static void test_gen_tool_chat_input(results *r) {
    lg_config cfg;
    lg_model m;
    lg_error err;
    if (load_config_or_fail(r, &cfg, "test-llama31")) return;
    cfg.vocab_size = cfg.padded_vocab_size = 128256;
    cfg.block_size = 2048;
    if (lg_model_create(&m, &cfg, 1, 8, &err) != 0) { check(r, 0, "%s", err.msg); return; }
    lg_model_init_weights(&m, 5, NULL);
    int rc = lg_hf_save(&m, "build/test-gen-chat-long", &err);
    lg_model_free(&m);
    if (rc != 0) { check(r, 0, "%s", err.msg); return; }
    FILE *f = fopen("build/test-gen-chat-long.txt", "wb");
    for (int i = 0; f && i < 66000; i++) fputc('=', f); /* 1,032 tokens of 64 '=' and less */
    if (f) fputs("\nshort one\n", f);
    if (!f || fclose(f) != 0) { check(r, 0, "build/test-gen-chat-long.txt: not written"); return; }
    char last[512], all[16384];
    int code = gen_run("OMP_NUM_THREADS=1 ./tools/generate --load build/test-gen-chat-long "
                       "--tokenizer data/llama3 --chat --template llama3 --context 1100 "
                       "--max-new-tokens 2 --temperature 0 < build/test-gen-chat-long.txt 2>&1",
                       last, sizeof last, all, sizeof all);
    int replies = 0, prefills[2] = {0, 0};
    for (const char *p = all; (p = strstr(p, "prefill: ")) != NULL; p++)
        if (replies < 2) prefills[replies++] = atoi(p + 9);
        else replies++;
    /* the first turn: the line's 1,032 tokens (tools/prepare encode) and the template's few */
    check(r, code == 0 && replies == 2 && prefills[0] > 1032 && prefills[0] < 1080 && prefills[1] < 40,
          "tools/generate --chat: a line of 66,000 bytes and a short one are 2 turns, 2 replies "
          "(exit %d, %d replies, prefills of %d and %d tokens)", code, replies, prefills[0], prefills[1]);
    expect_program(r, "printf 'fine\\nhi\\0there\\n' | OMP_NUM_THREADS=1 ./tools/generate",
                   "--load build/test-gen-chat --tokenizer data/llama3 --chat --template llama3 "
                   "--max-new-tokens 1", 2, "generate: --chat: standard input line 2 holds a NUL "
                   "byte (after 2 bytes): a turn is text");
    expect_program(r, "printf 'hi\\n' | OMP_NUM_THREADS=1 ./tools/generate",
                   "--load build/test-gen-chat --tokenizer data/llama3 --chat --max-new-tokens 0",
                   2, "generate: --chat --max-new-tokens 0: a reply needs a token at least");
    expect_program(r, "OMP_NUM_THREADS=1 ./tools/generate", "--load tests/hf/llama --prompt-ids "
                   "'1 2 3' --max-new-tokens 0 --ids", 0, "decode: 0 tokens");
}

/* The ids after "sample: " (prompt and new) in text, into ids (cap); how many. */
static int gen_sample_ids(const char *text, int *ids, int cap) {
    const char *at = strstr(text, "sample: ");
    int n = 0;
    for (at = at ? at + 8 : NULL; at && n < cap;) {
        char *end;
        long id = strtol(at, &end, 10);
        if (end == at) break;
        ids[n++] = (int)id;
        at = end;
    }
    return n;
}

/* A model whose config.json has 128,512 rows (padding past Llama 3's tokenizer's 128,256),
   the padding's head rows scaled 8x so that a padded id holds the largest logit: ./train's
   samples and tools/generate draw the same greedy ids, none past the tokenizer's
   (lg_gen_vocab, one rule), while lg_model_generate over all rows picks a padded one. */
static void test_gen_sample_vocab(results *r) {
    enum { TOKENS = 128256, ROWS = 128512 };
    lg_config cfg;
    lg_model m;
    lg_error err;
    if (load_config_or_fail(r, &cfg, "test-llama31")) return;
    cfg.vocab_size = cfg.padded_vocab_size = ROWS;
    cfg.block_size = 64;
    if (lg_model_create(&m, &cfg, 1, 16, &err) != 0) { check(r, 0, "%s", err.msg); return; }
    lg_model_init_weights(&m, 7, NULL);
    lg_real *head = reals(m.p.lm_head_w); /* (ROWS, C) */
    for (size_t k = (size_t)TOKENS * cfg.n_embd; k < (size_t)ROWS * cfg.n_embd; k++) head[k] *= 8;
    int all_rows[16] = {1, 2, 3};
    lg_model_generate(&m, all_rows, 3, 1, 0.0f, NULL);
    int rc = lg_hf_save(&m, "build/test-gen-padded", &err);
    lg_model_free(&m);
    if (rc != 0) { check(r, 0, "%s", err.msg); return; }
    gen_copy_file("data/llama3/tokenizer.json", "build/test-gen-padded/tokenizer.json");
    remove("build/test-gen-padded/" LG_CHECKPOINT_MARKER); /* a Hugging Face directory: no marker */
    FILE *f = fopen("build/test-gen-padded.txt", "w");
    if (f) fputs("Hello world, and hello again to everyone here.\n", f);
    if (f) fclose(f);
    char train_out[16384], generated[512], line[512];
    int code = system("./tools/prepare text --tokenizer data/llama3 --out build/test-gen-padded.bin "
                      "build/test-gen-padded.txt > /dev/null 2>&1");
    int tcode = gen_run("OMP_NUM_THREADS=1 ./train --load build/test-gen-padded --val-data "
                        "build/test-gen-padded.bin -t 8 --max-steps 0 --eval-iters 1 -p 32-true "
                        "--prompt '1 2 3' --sample-tokens 6 2>&1", line, sizeof line, train_out,
                        sizeof train_out);
    int gcode = gen_run("OMP_NUM_THREADS=1 ./tools/generate --load build/test-gen-padded "
                        "--prompt-ids '1 2 3' --max-new-tokens 6 --temperature 0 --ids 2>/dev/null",
                        generated, sizeof generated, NULL, 0);
    int sample[16], n = gen_sample_ids(train_out, sample, 16), outside = 0;
    char train_ids[256] = "";
    for (int i = 3; i < n; i++) {
        outside += sample[i] >= TOKENS;
        snprintf(train_ids + strlen(train_ids), sizeof train_ids - strlen(train_ids), "%s%d",
                 i > 3 ? " " : "", sample[i]);
    }
    check(r, code == 0 && tcode == 0 && gcode == 0 && n == 9 && outside == 0 &&
          strcmp(train_ids, generated) == 0 && all_rows[3] >= TOKENS,
          "%d rows, %d tokens: ./train --sample-tokens 6 draws \"%s\", tools/generate \"%s\" "
          "(%d past the tokenizer's); over all rows the first greedy id would be %d",
          ROWS, TOKENS, train_ids, generated, outside, all_rows[3]);
}

/* README's prompt path and the training data start alike (lg_tokenizer_start_id): tools/prepare
   encode --bos puts Llama 3's BOS 128000 and Llama 2's 1 first, GPT-2 none (its BOS is its
   EOS), the rest the plain encoding; tools/generate --prompt prefills the same 9 tokens. */
static void test_gen_prompt_bos(results *r) {
    static const struct { const char *tokenizer, *want; } cases[3] = {
        {"data/llama3", "128000 39314 374 459 7754 382 14711 6075 512"},
        {"data/llama2", "1 13866 338 385 15278 29889 13 13 2277 29937 13291 29901 13"},
        {"data/gpt2", "21106 318 281 12064 13 198 198 21017 18261 25 198"}};
    char cmd[512], with[512], without[512];
    for (int k = 0; k < 3; k++) {
        snprintf(cmd, sizeof cmd, "printf 'Below is an instruction.\\n\\n### Response:\\n' | "
                 "./tools/prepare encode --tokenizer %s --bos", cases[k].tokenizer);
        int a = gen_run(cmd, with, sizeof with, NULL, 0);
        cmd[strlen(cmd) - 6] = '\0'; /* without --bos */
        int b = gen_run(cmd, without, sizeof without, NULL, 0);
        const char *rest = k < 2 ? strchr(with, ' ') + 1 : with;
        check(r, a == 0 && b == 0 && strcmp(with, cases[k].want) == 0 && strcmp(rest, without) == 0,
              "tools/prepare encode --tokenizer %s --bos: \"%s\" (without: \"%s\")",
              cases[k].tokenizer, with, without);
    }
    char all[16384], last[512];
    int code = gen_run("OMP_NUM_THREADS=1 ./tools/generate --load build/test-gen-chat --tokenizer "
                       "data/llama3 --prompt \"$(printf 'Below is an instruction.\\n\\n### "
                       "Response:\\n')\" --max-new-tokens 1 --temperature 0 2>&1", last,
                       sizeof last, all, sizeof all);
    check(r, code == 0 && strstr(all, "prefill: 9 tokens") && strstr(all, "\nBelow is an instruction.\n"),
          "tools/generate --prompt (Llama 3's tokenizer): the 9 tokens of encode --bos prefilled, "
          "the text shown without the BOS (exit %d): \"%s\"", code, last);
}

static void test_gen_tool_errors(results *r) {
    const char *g = "OMP_NUM_THREADS=1 ./tools/generate";
    mkdir("build/test-gen-noweights", 0755); /* config.json alone */
    gen_copy_file("tests/hf/llama/config.json", "build/test-gen-noweights/config.json");
    expect_program(r, g, "--load build/test-gen-noweights --prompt-ids 1", 2,
                   "no model.safetensors (or its shards) and no adapter_model.safetensors");
    mkdir("build/test-gen-nobase", 0755); /* adapters whose base model is not there */
    gen_copy_file("tests/hf/llama/config.json", "build/test-gen-nobase/config.json");
    gen_copy_file("build/test-gen-lora-llama-adapters/adapter_model.safetensors",
                  "build/test-gen-nobase/adapter_model.safetensors");
    FILE *f = fopen("build/test-gen-nobase/adapter_config.json", "w");
    if (f) fputs("{\"base_model_name_or_path\": \"build/no-such-base\", \"r\": 2, \"lora_alpha\": 5}\n", f);
    if (f) fclose(f);
    expect_program(r, g, "--load build/test-gen-nobase --prompt-ids 1", 2,
                   "the base model build/no-such-base has no model.safetensors");
    expect_program(r, g, "--load tests/hf/llama --prompt hello", 2, "--prompt needs a tokenizer");
    expect_program(r, g, "--load tests/hf/llama --prompt-ids '1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17'",
                   2, "longer than the model's context (block_size 16)");
    expect_program(r, g, "--load build/no-such-model --prompt-ids 1", 2,
                   "build/no-such-model: no config.json");
    expect_program(r, g, "--load tests/hf/llama", 2, "one of --prompt TEXT, --prompt-ids");
    expect_program(r, g, "--load tests/hf/llama --prompt-ids 40", 2,
                   "token 0 (id 40) is outside the model's vocabulary of 32");
    expect_program(r, g, "--load tests/hf/llama --prompt-ids 1 --top-p 2", 2, "--top-p: 2 is outside");
    expect_program(r, g, "--load tests/hf/llama --prompt-ids 1 --memory-limit 8KiB", 3,
                   "does not fit: the plan needs");
    expect_program(r, g, "--load tests/hf/llama --prompt-ids '1 2' --max-new-tokens 4 --plan", 0,
                   "cache of 6 positions");
}

/* DIR: tests/hf/llama (its two shards) with "eos_token_id": value put first in FILE (config.json or
   generation_config.json, the latter made with just it). */
static int gen_llama_with_eos(const char *dir, const char *file, const char *value) {
    static const char *const weights[3] = {"model-00001-of-00002.safetensors",
                                           "model-00002-of-00002.safetensors",
                                           "model.safetensors.index.json"};
    char path[256], from[256], text[8192];
    mkdir(dir, 0755);
    for (int k = 0; k < 3; k++) {
        snprintf(from, sizeof from, "tests/hf/llama/%s", weights[k]);
        snprintf(path, sizeof path, "%s/%s", dir, weights[k]);
        if (gen_copy_file(from, path) != 0) return -1;
    }
    FILE *in = fopen("tests/hf/llama/config.json", "rb");
    size_t n = in ? fread(text, 1, sizeof text - 1, in) : 0;
    if (in) fclose(in);
    text[n] = '\0';
    char *brace = strchr(text, '{');
    if (!brace) return -1;
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *out = fopen(path, "wb");
    if (!out) return -1;
    int config = strcmp(file, "config.json") == 0;
    fprintf(out, "{%s%s%s%s", config ? "\"eos_token_id\": " : "", config ? value : "",
            config ? ", " : "", brace + 1);
    fclose(out);
    snprintf(path, sizeof path, "%s/generation_config.json", dir);
    remove(path);
    if (config) return 0;
    out = fopen(path, "wb");
    if (!out) return -1;
    fprintf(out, "{\"eos_token_id\": %s}\n", value);
    return fclose(out);
}

/* eos_token_id past what an int holds (4294967298 wrapped to 2), negative, not a number, or
   past the vocabulary: refused naming the file and the field; ids in range stop generation. */
static void test_gen_tool_eos(results *r) {
    static const struct { const char *file, *value, *want; } cases[5] = {
        {"config.json", "4294967298", "build/test-gen-eos/config.json: eos_token_id 4294967298 is not a token id of the model (0 .. 31)"},
        {"generation_config.json", "[2, -1]", "build/test-gen-eos/generation_config.json: eos_token_id -1 is not a token id of the model (0 .. 31)"},
        {"config.json", "32", "build/test-gen-eos/config.json: eos_token_id 32 is not a token id"},
        {"config.json", "\"2\"", "config.json: eos_token_id \"2\" is not a token id"},
        {"generation_config.json", "1.5", "generation_config.json: eos_token_id 1.5 is not a token id"}};
    for (int k = 0; k < 5; k++) {
        if (gen_llama_with_eos("build/test-gen-eos", cases[k].file, cases[k].value) != 0) {
            check(r, 0, "build/test-gen-eos: could not be written");
            return;
        }
        expect_program(r, "OMP_NUM_THREADS=1 ./tools/generate", "--load build/test-gen-eos "
                       "--prompt-ids '1 2 3' --temperature 0", 2, cases[k].want);
    }
    /* in range: the greedy continuation's first token as the stop id ends it after one token */
    char first[256], cmd[512], got[256];
    int code = gen_run("OMP_NUM_THREADS=1 ./tools/generate --load tests/hf/llama --prompt-ids '1 2 3' "
                       "--max-new-tokens 6 --temperature 0 --ids 2>/dev/null", first, sizeof first, NULL, 0);
    char id[16];
    snprintf(id, sizeof id, "[%d]", atoi(first));
    int ok = code == 0 && gen_llama_with_eos("build/test-gen-eos", "generation_config.json", id) == 0;
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=1 ./tools/generate --load build/test-gen-eos "
             "--prompt-ids '1 2 3' --max-new-tokens 6 --temperature 0 --ids 2>/dev/null");
    ok = ok && gen_run(cmd, got, sizeof got, NULL, 0) == 0 && atoi(got) == atoi(first) &&
         !strchr(got, ' ') && strchr(first, ' ');
    check(r, ok, "eos_token_id %s (the first greedy token of \"%s\"): generation stops after it: "
          "\"%s\"", id, first, got);
}

/* test-llama widened (C 128, I 512, 8 heads in 2 groups) on every thread: the dot products and
   attention's heads split over threads. */
static void test_gen_threads(results *r) {
    lg_config cfg;
    lg_model m;
    lg_generator g;
    lg_error err;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    cfg.n_embd = 128, cfg.intermediate_size = 512, cfg.n_head = 8, cfg.head_size = 16;
    if (lg_model_create(&m, &cfg, 1, cfg.block_size, &err) != 0) { check(r, 0, "%s", err.msg); return; }
    gen_fill_random(&m, 5);
    if (gen_from_model(r, &g, &m, 12, 4, LG_PRECISION_32_TRUE) != 0) { lg_model_free(&m); return; }
    int seq[16] = {3, 1, 4, 1}, uncached[16] = {3, 1, 4, 1}, out[8], n_out = 0;
    gen_compare c = {&m, &g, seq, 4, 0.0};
    lg_sampling greedy = lg_sampling_default();
    greedy.temperature = 0;
    int ok = lg_generate(&g, seq, 4, 8, &greedy, NULL, out, &n_out, gen_compare_token, &c, NULL, &err) == 0;
    lg_model_generate(&m, uncached, 4, 8, 0.0f, NULL);
    for (int i = 0; i < 8 && ok; i++) ok = out[i] == uncached[4 + i];
    check(r, ok && c.worst < 1e-5, "test-llama widened, %d threads: logits within %.1e of the "
          "recomputed (< 1e-5), the same 8 greedy tokens", g.spec.threads, c.worst);
    lg_generator_free(&g);
    lg_model_free(&m);
}

static void test_generate_all(results *r) {
    test_gen_threads(r);
#ifdef _OPENMP
    int threads = omp_get_max_threads();
    omp_set_num_threads(1); /* tiny models: a team of threads would only wait for each other */
#endif
    static const char *const configs[5] = {"test-gpt2", "test-pythia", "test-llama", "test-llama31",
                                           "test-falcon"};
    for (int k = 0; k < 5; k++) {
        test_gen_cached_equals_uncached(r, configs[k], 1, 15, 1);   /* a 1-token prompt */
        test_gen_cached_equals_uncached(r, configs[k], 5, 11, 5);
        test_gen_cached_equals_uncached(r, configs[k], 16, 0, 16);  /* the prompt fills it */
    }
    test_gen_cached_equals_uncached(r, "test-llama", 10, 6, 3);     /* prefill in pieces */
    test_gen_cached_equals_uncached(r, "qwen2-like", 4, 12, 4);     /* qkv's bias */
    test_gen_bf16(r);
    test_gen_stop(r);
    test_gen_padded_vocab(r);
    test_gen_plan_matches_allocation(r, "test-gpt2", 16);
    test_gen_plan_matches_allocation(r, "test-llama", 12);
    test_gen_plan_llama3(r);
    test_gen_sampling(r);
    test_gen_not_finite(r);
    static const char *const families[4] = {"gpt2", "pythia", "llama", "falcon"};
    for (int k = 0; k < 4; k++) test_gen_lora_dir(r, families[k]);
    test_gen_tool_ids(r, "tests/hf/gpt2");
    test_gen_tool_ids(r, "tests/hf/llama31");
    test_gen_continue(r);
    test_gen_tool_chat(r);
    test_gen_tool_chat_input(r);
    test_gen_tool_ids(r, "tests/hf/falcon");
    test_gen_tool_lora(r);
    test_gen_lora_base_check(r);
    test_gen_tool_text(r);
    test_gen_tool_errors(r);
    test_gen_tool_eos(r);
    test_gen_sample_vocab(r);
    test_gen_prompt_bos(r);
#ifdef _OPENMP
    omp_set_num_threads(threads);
#endif
}
