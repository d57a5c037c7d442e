/* The linear layers' gradients written (beta 0) on a step's first micro-batch, instead of
   zeroed and added to (included by tests/test.c): the step's gradients are bitwise those of
   the zero-then-add path (grads_add_only), and the written path's gradient buffers start each
   step poisoned with NaN, so a gradient that is neither written nor zeroed shows. */

/* Every gradient buffer of tr's ranks (their shards, and with sharded gradients the unit
   buffers) filled with NaN bits. */
static void poison_grads(lg_trainer *tr) {
    for (int r = 0; r < tr->local_ranks; r++) {
        lg_model *m = &tr->ranks[r].model;
        memset(m->grads.data, 0xff, m->n_local * lg_dtype_size(m->grads.dtype));
        if (!tr->plan.sharding.grads_sharded) continue;
        for (int u = 0; u < tr->plan.shards.n_units; u++) {
            lg_buf g = lg_unit_grads(tr, r, u);
            memset(g.data, 0xff, lg_padded_unit(&tr->plan.shards, u) * lg_dtype_size(g.dtype));
        }
    }
}

/* Two steps of a (T 8) with gradients written and added: every rank's gradients after each
   step bitwise equal. Returns 1 when equal, -1 when a trainer cannot be made. */
static int grads_written_equal_added(const lg_config *cfg, const lg_args *a) {
    lg_trainer tr[2];
    lg_loader ld[2];
    lg_error err;
    const int T = 8;
    if (lg_trainer_create(&tr[0], cfg, a, T, &err) != 0) { printf("    %s\n", err.msg); return -1; }
    if (lg_trainer_create(&tr[1], cfg, a, T, &err) != 0) {
        printf("    %s\n", err.msg);
        lg_trainer_free(&tr[0]);
        return -1;
    }
    for (int r = 0; r < tr[1].local_ranks; r++) tr[1].ranks[r].model.grads_add_only = 1;
    for (int k = 0; k < 2; k++) builtin_loader(&ld[k], cfg, T, 5, 4096, a->seed);
    int equal = 1;
    for (int step = 0; step < 2 && equal; step++) {
        lg_step_stats st[2];
        poison_grads(&tr[0]);
        for (int k = 0; k < 2; k++)
            if (lg_trainer_step(&tr[k], &ld[k], step, &st[k], &err) != 0) equal = 0;
        for (int r = 0; r < tr[0].local_ranks && equal; r++) {
            const lg_model *w = &tr[0].ranks[r].model, *z = &tr[1].ranks[r].model;
            equal = memcmp(w->grads.data, z->grads.data,
                           w->n_local * lg_dtype_size(w->grads.dtype)) == 0 &&
                    st[0].loss == st[1].loss;
        }
    }
    for (int k = 0; k < 2; k++) {
        lg_loader_close(&ld[k]);
        lg_trainer_free(&tr[k]);
    }
    return equal;
}

static void test_grads_written(results *r) {
    struct {
        const char *config;
        int micro_batch, global_batch, lora, devices;
        lg_strategy strategy;
        lg_precision precision;
    } cases[] = {
        {"test-gpt2", 2, 2, 0, 1, LG_STRATEGY_NO_SHARD, LG_PRECISION_32_TRUE},
        {"test-gpt2", 2, 6, 0, 1, LG_STRATEGY_NO_SHARD, LG_PRECISION_BF16_MIXED},
        {"test-llama", 2, 2, 0, 1, LG_STRATEGY_NO_SHARD, LG_PRECISION_32_TRUE},
        {"test-pythia", 2, 6, 0, 1, LG_STRATEGY_NO_SHARD, LG_PRECISION_32_TRUE},
        {"test-llama", 2, 6, 1, 1, LG_STRATEGY_NO_SHARD, LG_PRECISION_32_TRUE},
        {"test-pythia", 1, 6, 0, 2, LG_STRATEGY_FULL_SHARD, LG_PRECISION_32_TRUE},
        {"test-gpt2", 1, 6, 0, 2, LG_STRATEGY_FULL_SHARD, LG_PRECISION_BF16_MIXED},
        {"test-gpt2", 1, 4, 0, 2, LG_STRATEGY_NO_SHARD, LG_PRECISION_32_TRUE},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        lg_config cfg;
        if (load_config_or_fail(r, &cfg, cases[c].config)) return;
        lg_args a;
        lg_args_default(&a);
        a.micro_batch_size = cases[c].micro_batch;
        a.global_batch_size = cases[c].global_batch;
        a.devices = cases[c].devices;
        a.strategy = cases[c].strategy;
        a.precision = cases[c].precision;
        a.warmup_steps = 0;
        if (cases[c].lora) {
            a.lora.r = 4;
            a.lora.targets = LORA_ALL_TARGETS;
        }
        int equal = grads_written_equal_added(&cfg, &a);
        int accumulation = a.global_batch_size / (a.micro_batch_size * a.devices);
        check(r, equal == 1,
              "%s (%s embeddings) -g %d%s -d %d %s %s: 2 steps' gradients written on the first "
              "micro-batch (over NaN) = zeroed and added, bitwise", cases[c].config,
              cfg.tie_embeddings ? "tied" : "untied", accumulation, cases[c].lora ? " LoRA" : "",
              a.devices, lg_strategy_name(a.strategy), lg_precision_name(a.precision));
    }
}
