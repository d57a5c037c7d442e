/* Every combination of memory levers trains the same model (issue 40): one step's update of
   every trainable tensor, for each lever alone, every pair of levers, and the sets the planner
   picks together, against the plain run, in fp32 with dropout 0, over the five families and
   five fine-tuning modes. Each lever was tested alone against one pass; a pair (LoRA on the
   MLP, slices and block recompute) trained another model unnoticed. Included by tests/test.c
   (the CPU backend, float and double) and tests/gpu/test_cuda.c (the CUDA backend, on GPUs and
   on the emulator: every lever but --pack, which runs on the CPU only). */

/* The levers: each leaves the gradients as they are, or it is a defect. */
typedef enum {
    LEVER_RECOMPUTE,        /* --recompute block */
    LEVER_HEAD_ROWS,        /* --head-rows COMBO_HEAD_ROWS */
    LEVER_SLICE_ROWS,       /* --slice-rows COMBO_SLICE_ROWS */
    LEVER_OFFLOAD_ACTS,     /* --offload activations (with --recompute block, which it needs) */
    LEVER_OFFLOAD_STATE,    /* --offload state */
    LEVER_OFFLOAD_STREAMS,  /* --offload gradients,weights (with the state they need): each
                               unit's weights copied in and its gradients out as they finish */
    LEVER_FULL_SHARD,       /* -d 2 --strategy full-shard */
    LEVER_ACCUMULATE,       /* half the micro-batch, two micro-batches a step */
    LEVER_PACK,             /* --pack: two samples a row, half the rows */
    LEVER_OFFLOAD_EMBEDDING, /* --offload embedding (an untied table: elsewhere left out;
                                trained, with the streams it needs, on one rank) */
    LEVER_COUNT
} combo_lever;

static const char *const combo_lever_names[LEVER_COUNT] = {
    "recompute", "head-rows", "slice-rows", "offload-acts", "offload-state", "offload-streams",
    "d2-full-shard", "accumulate", "pack", "offload-embedding"};

/* What trains: every weight, or LoRA adapters on these linears (QLoRA: the base in nf4). */
typedef enum { MODE_FULL, MODE_LORA_ALL, MODE_LORA_MLP, MODE_LORA_QV, MODE_QLORA_ALL, MODE_COUNT } combo_mode;

static const char *const combo_mode_names[MODE_COUNT] = {"full", "lora all", "lora mlp",
                                                         "lora qv", "qlora nf4 all"};

enum {
    COMBO_LEN = 8,          /* every sample's tokens: a row of -t 8, or half a packed row */
    COMBO_PROMPT = 3,       /* masked prompt tokens of each sample */
    COMBO_SAMPLES = 64,
    COMBO_ROWS = 8,         /* rows of a step without --pack (one sample each) */
    COMBO_LAYERS = 4,       /* blocks: --offload activations' two slots both turn over */
    COMBO_HEAD_ROWS = 5,    /* neither divides a micro-batch's rows */
    COMBO_SLICE_ROWS = 3
};

/* How far a lever set's update may be from the plain one, each tensor to its own scale. In
   tests/test64 (lg_real double) a different order of the same sums moves the last bits only:
   4.4e-15 measured, so 1e-12. In fp32 the same reorderings (chunks, slices, micro-batches,
   ranks' partial sums) reach 2.6e-6 of a tensor's scale (measured on the five families); the
   wrong model this test was written for was 1e0 apart. */
#ifdef LG_REAL_DOUBLE
#define COMBO_TOL 1e-12
#else
#define COMBO_TOL 1e-5
#endif

/* The lever sets the planner (lg_plan_auto_rows, the remedies) picks together beyond pairs,
   and all of them at once. */
static const unsigned combo_planner_sets[] = {
    1u << LEVER_RECOMPUTE | 1u << LEVER_HEAD_ROWS | 1u << LEVER_SLICE_ROWS,
    1u << LEVER_RECOMPUTE | 1u << LEVER_HEAD_ROWS | 1u << LEVER_SLICE_ROWS | 1u << LEVER_OFFLOAD_ACTS,
    1u << LEVER_RECOMPUTE | 1u << LEVER_HEAD_ROWS | 1u << LEVER_SLICE_ROWS | 1u << LEVER_OFFLOAD_ACTS |
        1u << LEVER_OFFLOAD_STATE,
    1u << LEVER_RECOMPUTE | 1u << LEVER_HEAD_ROWS | 1u << LEVER_SLICE_ROWS | 1u << LEVER_OFFLOAD_ACTS |
        1u << LEVER_OFFLOAD_STREAMS,
    (1u << LEVER_COUNT) - 1};

/* "recompute+slice-rows" (or "plain") into out. */
static const char *combo_levers_name(unsigned levers, char *out, size_t size) {
    size_t n = 0;
    out[0] = '\0';
    for (int k = 0; k < LEVER_COUNT; k++)
        if (levers & 1u << k)
            n += (size_t)snprintf(out + n, n < size ? size - n : 0, "%s%s", n ? "+" : "",
                                  combo_lever_names[k]);
    if (!levers) snprintf(out, size, "plain");
    return out;
}

/* The run's settings: one SGD step without momentum, decay or clipping, so that the update
   is -lr times the gradient; lr large, so that the update, not the weights' rounding, sets
   the last bits compared. */
static lg_args combo_args(lg_backend backend, combo_mode mode, unsigned levers) {
    lg_args a;
    lg_args_default(&a);
    a.backend = backend;
    int pack = levers & 1u << LEVER_PACK, ranks = levers & 1u << LEVER_FULL_SHARD ? 2 : 1;
    int rows = pack ? COMBO_ROWS / 2 : COMBO_ROWS;
    a.precision = LG_PRECISION_32_TRUE;
    a.optimizer = LG_OPTIMIZER_SGD;
    a.momentum = 0.0f;
    a.weight_decay = 0.0f;
    a.max_norm = 0.0f;
    a.lr = a.min_lr = 1000.0f;
    a.warmup_steps = 0;
    a.max_steps = 1;
    a.devices = ranks;
    a.strategy = LG_STRATEGY_FULL_SHARD;
    a.global_batch_size = rows;
    a.micro_batch_size = rows / ranks / (levers & 1u << LEVER_ACCUMULATE ? 2 : 1);
    a.pack = pack != 0;
    a.finetuning = 1;
    a.recompute = (levers & (1u << LEVER_RECOMPUTE | 1u << LEVER_OFFLOAD_ACTS)) != 0;
    a.offload_activations = (levers & 1u << LEVER_OFFLOAD_ACTS) != 0;
    a.offload = (levers & (1u << LEVER_OFFLOAD_STATE | 1u << LEVER_OFFLOAD_STREAMS)) != 0;
    a.offload_gradients = a.offload_weights = (levers & 1u << LEVER_OFFLOAD_STREAMS) != 0;
    a.offload_embedding = (levers & 1u << LEVER_OFFLOAD_EMBEDDING) != 0;
    if (a.offload_embedding && mode == MODE_FULL) /* a trained table: in the streamed weights */
        a.offload = a.offload_gradients = a.offload_weights = 1;
    a.head_rows = levers & 1u << LEVER_HEAD_ROWS ? COMBO_HEAD_ROWS : 0;
    a.slice_rows = levers & 1u << LEVER_SLICE_ROWS ? COMBO_SLICE_ROWS : 0;
    if (mode != MODE_FULL) {
        a.lora.r = 2;
        a.lora.alpha = 8.0f;
        a.lora.dropout = 0.0f;
        a.lora.targets = mode == MODE_LORA_MLP  ? (unsigned)LG_LORA_MLP
                         : mode == MODE_LORA_QV ? (unsigned)(LG_LORA_QUERY | LG_LORA_VALUE)
                                                : (unsigned)(LG_LORA_QUERY | LG_LORA_KEY |
                                                             LG_LORA_VALUE | LG_LORA_PROJECTION |
                                                             LG_LORA_MLP);
        a.lora.quantize = mode == MODE_QLORA_ALL ? LG_QUANTIZE_NF4 : LG_QUANTIZE_NONE;
    }
    return a;
}

/* Starting weights for every run of a mode: the plain run's initial trainable weights (n)
   moved by noise, so that LoRA's B is not zero and every adapter has a gradient. */
static lg_real *combo_start_weights(lg_trainer *plain, uint64_t seed) {
    size_t n = plain->ranks[0].model.n_params;
    lg_real *w = trained_weights(plain);
    lg_rng rng;
    lg_rng_seed(&rng, seed);
    for (size_t i = 0; i < n; i++) w[i] += 0.05f * (float)lg_rng_normal(&rng);
    return w;
}

/* One step of these levers from weights w0 (n, the whole layout); its update w1 - w0 into
   update (n) and its loss into *loss; -1 with the message in err when it cannot run. */
static int combo_step(const lg_config *cfg, lg_backend backend, combo_mode mode, unsigned levers,
                      const char *data, const lg_real *w0, lg_real *update, double *loss,
                      lg_error *err) {
    lg_args a = combo_args(backend, mode, levers);
    int T = a.pack ? 2 * COMBO_LEN : COMBO_LEN;
    lg_trainer tr;
    lg_loader ld;
    lg_step_stats st;
    if (lg_trainer_create(&tr, cfg, &a, T, err) != 0) return -1;
    int rc = lg_loader_open(&ld, data, T, cfg->vocab_size, 1, a.seed, err);
    if (rc == 0) {
        size_t n = tr.ranks[0].model.n_params;
        lg_trainer_set_weights(&tr, lg_buf_of((lg_real *)w0));
        rc = lg_trainer_step(&tr, &ld, 0, &st, err);
        lg_loader_close(&ld);
        if (rc == 0) {
            lg_real *w1 = trained_weights(&tr);
            for (size_t i = 0; i < n; i++) update[i] = w1[i] - w0[i];
            *loss = st.loss;
            LG_FREE(w1);
        }
    }
    lg_trainer_free(&tr);
    return rc;
}

/* max |got - want| / max(max |want|, floor) over n, NaN anywhere -> infinity. */
static double combo_rel_error(const lg_real *got, const lg_real *want, size_t n, double floor) {
    double diff = 0, scale = floor;
    for (size_t i = 0; i < n; i++) {
        if (got[i] != got[i] || want[i] != want[i]) return INFINITY;
        diff = fmax(diff, fabs((double)got[i] - (double)want[i]));
        scale = fmax(scale, fabs((double)want[i]));
    }
    return diff / scale;
}

/* The worst over the trainable tensors of max |got - want| / max |want|, each tensor against
   its own scale (floored at 1e-6 of the largest, so that a tensor whose update is zero in
   both counts as equal), so that a small tensor's wrong gradient is not hidden by a larger. */
static double combo_tensor_error(const lg_tensor_table *table, const lg_real *got,
                                 const lg_real *want, size_t n) {
    double largest = 0, worst = 0;
    for (size_t i = 0; i < n; i++) largest = fmax(largest, fabs((double)want[i]));
    for (int t = 0; t < table->n_tensors; t++) {
        const lg_tensor_info *x = &table->tensors[t];
        worst = fmax(worst, combo_rel_error(got + x->origin, want + x->origin, x->count,
                                            1e-6 * largest));
    }
    return worst;
}

/* A sample file of COMBO_SAMPLES samples of COMBO_LEN tokens (the prompt masked): two fill a
   packed row of 2 x COMBO_LEN exactly, so --pack's rows carry what twice as many unpacked
   rows do, with no padding either way. */
static int combo_write_samples(const char *path, int vocab, lg_error *err) {
    uint32_t tokens[COMBO_SAMPLES * COMBO_LEN], lengths[COMBO_SAMPLES], prompts[COMBO_SAMPLES];
    lg_rng rng;
    lg_rng_seed(&rng, 40);
    for (int i = 0; i < COMBO_SAMPLES * COMBO_LEN; i++) tokens[i] = (uint32_t)(lg_rng_u64(&rng) % (uint64_t)vocab);
    for (int i = 0; i < COMBO_SAMPLES; i++) lengths[i] = COMBO_LEN, prompts[i] = COMBO_PROMPT;
    return lg_samples_write(path, tokens, lengths, prompts, COMBO_SAMPLES, 2, 1, err);
}

/* Every lever set to run of those in `levers`: each lever alone, every pair, the planner's
   sets (without the levers missing); returns how many. */
static int combo_lever_sets(unsigned levers, unsigned *sets, int cap) {
    int n = 0;
    for (int i = 0; i < LEVER_COUNT; i++)
        for (int j = i; j < LEVER_COUNT && n < cap; j++)
            if (levers & 1u << i && levers & 1u << j) sets[n++] = 1u << i | 1u << j;
    for (size_t k = 0; k < sizeof combo_planner_sets / sizeof *combo_planner_sets && n < cap; k++)
        sets[n++] = combo_planner_sets[k] & levers;
    return n;
}

/* Training every weight, a table on the host runs on one rank: the sets with -d 2 leave it
   out (those that then repeat an earlier set go). Returns how many sets remain. */
static int combo_runnable_sets(combo_mode mode, unsigned *sets, int n) {
    const unsigned apart = 1u << LEVER_OFFLOAD_EMBEDDING, two_ranks = 1u << LEVER_FULL_SHARD;
    int kept = 0;
    for (int s = 0; s < n; s++) {
        unsigned set = sets[s];
        if (mode == MODE_FULL && set & two_ranks) set &= ~apart;
        int seen = 0;
        for (int k = 0; k < kept; k++) seen |= sets[k] == set;
        if (!seen) sets[kept++] = set;
    }
    return kept;
}

/* One family in one mode on a backend: the plain step, then every set of these levers
   against it. */
static void test_combinations_of(results *r, lg_backend backend, unsigned levers,
                                 const char *family, combo_mode mode, const char *data) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, family)) return;
    cfg.n_layer = COMBO_LAYERS;
    if (cfg.tie_embeddings) /* a tied table stays on the device */
        levers &= ~(1u << LEVER_OFFLOAD_EMBEDDING);
    lg_args a = combo_args(backend, mode, 0);
    lg_trainer plain;
    lg_error err;
    if (lg_trainer_create(&plain, &cfg, &a, COMBO_LEN, &err) != 0) {
        check(r, 0, "%s %s: %s", family, combo_mode_names[mode], err.msg);
        return;
    }
    size_t n = plain.ranks[0].model.n_params;
    lg_real *w0 = combo_start_weights(&plain, 4000 + (uint64_t)mode);
    lg_real *want = (lg_real *)lg_alloc_zeroed(n * sizeof(lg_real));
    lg_real *got = (lg_real *)lg_alloc_zeroed(n * sizeof(lg_real));
    const lg_tensor_table *table = &plain.ranks[0].model.param_table;
    double want_loss = 0, loss = 0, worst = 0, worst_loss = 0;
    unsigned sets[64], worst_set = 0;
    int n_sets = combo_runnable_sets(mode, sets, combo_lever_sets(levers, sets, 64));
    int ran = 0, failed = 0;
    char name[160];
    if (combo_step(&cfg, backend, mode, 0, data, w0, want, &want_loss, &err) != 0) {
        check(r, 0, "%s %s plain: %s", family, combo_mode_names[mode], err.msg);
        n_sets = 0;
    }
    for (int s = 0; s < n_sets; s++) {
        if (combo_step(&cfg, backend, mode, sets[s], data, w0, got, &loss, &err) != 0) {
            check(r, 0, "%s %s %s: %s", family, combo_mode_names[mode],
                  combo_levers_name(sets[s], name, sizeof name), err.msg);
            failed++;
            continue;
        }
        double e = combo_tensor_error(table, got, want, n);
        double le = fabs(loss - want_loss) / fabs(want_loss);
        if (e > worst || !(e == e)) worst = e == e ? e : INFINITY, worst_set = sets[s];
        worst_loss = fmax(worst_loss, le);
        ran++;
    }
    check(r, failed == 0 && ran == n_sets && n_sets > 0 && worst < COMBO_TOL && worst_loss < COMBO_TOL,
          "%-12s %-13s %d lever sets against the plain step: updates (%zu, each tensor to its "
          "own scale) rel err %.1e (worst: %s), loss %.1e (bound %.0e)", family, combo_mode_names[mode], ran,
          n, worst, combo_levers_name(worst_set, name, sizeof name), worst_loss, COMBO_TOL);
    LG_FREE(w0);
    LG_FREE(want);
    LG_FREE(got);
    lg_trainer_free(&plain);
}

static const char *const combo_families[] = {"test-gpt2", "test-pythia", "test-llama",
                                             "test-falcon", "test-llama31"};
static const char *const combo_data = "build/combinations.bin";

#ifndef LG_CUDA
/* The CPU backend: every lever, every family, every mode. */
static void test_combinations_all(results *r) {
    lg_error err;
    if (combo_write_samples(combo_data, 30, &err) != 0) {
        check(r, 0, "%s: %s", combo_data, err.msg);
        return;
    }
    for (int f = 0; f < 5; f++)
        for (int mode = 0; mode < MODE_COUNT; mode++)
            test_combinations_of(r, LG_BACKEND_CPU, (1u << LEVER_COUNT) - 1, combo_families[f],
                                 (combo_mode)mode, combo_data);
}

#else
/* The CUDA backend: every lever it runs (-d 2 with 2 GPUs visible), every family in every mode
   on GPUs; on the emulator, whose kernels run 25 times slower than the CPU backend's, each
   family in one mode (every mode once, every lever set in each mode and in each family). */
static void test_combinations_cuda(results *r, int gpus) {
    unsigned levers = ((1u << LEVER_COUNT) - 1) & ~(1u << LEVER_PACK);
    if (gpus < 2) levers &= ~(1u << LEVER_FULL_SHARD);
    lg_error err;
    if (combo_write_samples(combo_data, 30, &err) != 0) {
        check(r, 0, "%s: %s", combo_data, err.msg);
        return;
    }
    for (int f = 0; f < 5; f++)
        for (int mode = 0; mode < MODE_COUNT; mode++) {
#ifdef LG_CUDA_EMULATE
            if (mode != f % MODE_COUNT) continue;
#endif
            test_combinations_of(r, LG_BACKEND_CUDA, levers, combo_families[f], (combo_mode)mode,
                                 combo_data);
        }
}
#endif
