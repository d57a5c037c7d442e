/* Sample packing (lg_loader_next_packed, lg_model_set_spans): a packed micro-batch's loss and
   gradients against the same samples run one at a time, unpadded, in fp32. */

/* max |a - b| / max |b| over n */
static double packing_rel_err(const lg_real *a, const lg_real *b, size_t n) {
    double diff = 0, scale = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]), v = fabs((double)b[i]);
        diff = d > diff ? d : diff;
        scale = v > scale ? v : scale;
    }
    return scale > 0 ? diff / scale : diff;
}

/* One config (with LoRA when lora): rows of 24 from the built-in task's samples. */
static void test_packing_equivalence(results *r, const char *config_name, int lora) {
    lg_config cfg;
    enum { B = 2, T = 24, N = B * T };
    if (load_config_or_fail(r, &cfg, config_name)) return;
    cfg.block_size = T; /* the built-in task's samples reach 18 tokens */
    if (lora) {
        cfg.lora.r = 2;
        cfg.lora.alpha = 8.0f;
        cfg.lora.targets = LG_LORA_QUERY | LG_LORA_KEY | LG_LORA_VALUE | LG_LORA_PROJECTION | LG_LORA_MLP;
    }
    lg_model m;
    lg_loader ld;
    lg_error err;
    if (lg_model_create(&m, &cfg, B, T, &err)) { check(r, 0, "%s: %s", config_name, err.msg); return; }
    lg_rng rng;
    lg_rng_seed(&rng, 28);
    if (lora) fill_normal(reals(m.frozen), m.frozen_table.total, 0.3f, &rng);
    fill_normal(reals(m.params), m.n_params, 0.3f, &rng);
    int inputs[N], targets[N], span[N], packed = 0;
    if (lg_builtin_task_samples(&ld, 5, 40, 0, 1, 6, &err) != 0 ||
        lg_loader_next_packed(&ld, B, T, inputs, targets, span, &packed, &err) != 0) {
        check(r, 0, "%s packing: %s", config_name, err.msg);
        lg_model_free(&m);
        return;
    }
    lg_loader_close(&ld);
    int n_targets = 0, alone_targets = 0, spans = 0;
    for (int i = 0; i < N; i++) n_targets += targets[i] != LG_IGNORE_INDEX;
    float scale = 1.0f / (float)n_targets;
    /* each sample alone: B 1, T its length */
    double alone = 0;
    lg_model_zero_grad(&m);
    for (int i = 0; i < N; i++) { /* each run of one span start: a sample, or one padding token */
        int t = i % T, n = 1;
        if (span[i] != t) continue;
        while (t + n < T && span[i + n] == t) n++;
        int count = 0;
        alone += lg_model_forward(&m, inputs + i, targets + i, 1, n, &count);
        lg_model_backward(&m, inputs + i, targets + i, 1, n, scale);
        alone_targets += count;
        spans += count > 0; /* every built-in sample has trained targets; padding none */
    }
    lg_real *want = new_reals(m.n_local);
    memcpy(want, reals(m.grads), m.n_local * sizeof(lg_real));
    lg_model_zero_grad(&m);
    int count = 0;
    double together = 0;
    if (lg_model_set_spans(&m, span, &err) == 0) {
        together = lg_model_forward(&m, inputs, targets, B, T, &count);
        lg_model_backward(&m, inputs, targets, B, T, scale);
    }
    lg_model_set_spans(&m, NULL, &err);
    double loss_err = fabs(together - alone) / fabs(alone);
    double grad_err = packing_rel_err(reals(m.grads), want, m.n_local);
    check(r, packed >= 3 && spans == packed && count == alone_targets && loss_err < 1e-6 && grad_err < 1e-6,
          "%-12s%s %d samples packed into %d rows of %d: loss rel err %.1e, gradients (%zu) rel err "
          "%.1e against each sample alone, unpadded", config_name, lora ? " LoRA" : "     ", packed, B,
          T, loss_err, m.n_local, grad_err);
    LG_FREE(want);
    lg_model_free(&m);
}

/* --pack's refusals: token shards; rows shorter than the longest sample. */
static void test_packing_refusals(results *r) {
    lg_loader ld;
    lg_error err;
    int in[64], tg[64], sp[64], n = 0;
    size_t n_tokens = 0;
    uint32_t *tokens = lg_builtin_task_tokens(3, 200, &n_tokens);
    int rc = lg_loader_from_memory(&ld, tokens, n_tokens, 16, 256, 0, 0, &err);
    rc = rc == 0 && lg_loader_next_packed(&ld, 2, 16, in, tg, sp, &n, &err) != 0 && strstr(err.msg, "token shards");
    check(r, rc, "--pack with token shards refused: %s", err.msg);
    lg_loader_close(&ld);
    rc = lg_builtin_task_samples(&ld, 5, 20, 0, 0, 0, &err) == 0 &&
         lg_loader_next_packed(&ld, 2, 4, in, tg, sp, &n, &err) != 0 && strstr(err.msg, "hold no sample");
    check(r, rc, "--pack with rows shorter than a sample refused: %s", err.msg);
    lg_loader_close(&ld);
}

static void test_packing_all(results *r) {
    static const char *const configs[] = {"test-gpt2", "test-pythia", "test-llama", "test-falcon", "test-llama31"};
    for (int c = 0; c < 5; c++) test_packing_equivalence(r, configs[c], 0);
    test_packing_equivalence(r, "test-llama", 1);
    test_packing_equivalence(r, "test-pythia", 1);
    test_packing_refusals(r);
}
