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

/* The "loss" of each step line of a --log file, into losses (cap); returns how many. */
static int packing_log_losses(const char *path, double *losses, int cap) {
    FILE *f = fopen(path, "r");
    char line[4096];
    int n = 0;
    while (f && n < cap && fgets(line, sizeof line, f)) {
        const char *at = strstr(line, "\"loss\":");
        if (at && strstr(line, "\"step\"")) losses[n++] = atof(at + 7);
    }
    if (f) fclose(f);
    return n;
}

/* ./train --pack end to end: samples of exactly half a row pack two to a row, so -b 2 packed
   rows carry the same 4 samples as -b 4 unpacked ones (no padding either way): the same
   losses, step by step, in fp32. Then -d 2 full-shard packs as one rank does. */
static void test_packing_train(results *r) {
    enum { N = 64, LEN = 8, PROMPT = 3 };
    uint32_t tokens[N * LEN], lengths[N], prompts[N];
    lg_rng rng;
    lg_error err;
    lg_rng_seed(&rng, 128);
    for (int i = 0; i < N * LEN; i++) tokens[i] = (uint32_t)(lg_rng_u64(&rng) % 30);
    for (int i = 0; i < N; i++) lengths[i] = LEN, prompts[i] = PROMPT;
    if (lg_samples_write("build/pack_half_rows.bin", tokens, lengths, prompts, N, 2, 1, &err)) {
        check(r, 0, "--pack: %s", err.msg);
        return;
    }
    const char *common = "-c test-llama --data build/pack_half_rows.bin -p 32-true --max-steps 6 "
                         "--eval-every 0 --lr 1e-2 --warmup-steps 0";
    char args[512], out[16384];
    double plain[8], packed[8], sharded[8];
    snprintf(args, sizeof args, "%s -b 4 -g 4 --log build/pack_plain.jsonl", common);
    int rc = run_capture(args, out, sizeof out);
    snprintf(args, sizeof args, "%s --pack -t 16 -b 2 -g 2 --log build/pack_packed.jsonl", common);
    rc |= run_capture(args, out, sizeof out);
    int stats = strstr(out, "--pack: rows of 16 tokens hold 2.00 samples on average; padding 0.0%") != NULL;
    snprintf(args, sizeof args, "%s --pack -t 16 -b 1 -g 2 -d 2 --log build/pack_d2.jsonl", common);
    rc |= run_capture(args, out, sizeof out);
    int n = packing_log_losses("build/pack_plain.jsonl", plain, 8);
    int m = packing_log_losses("build/pack_packed.jsonl", packed, 8);
    int k = packing_log_losses("build/pack_d2.jsonl", sharded, 8);
    double worst = 0, worst_d2 = 0;
    for (int i = 0; i < n && i < m && i < k; i++) {
        worst = fmax(worst, fabs(plain[i] - packed[i]));
        worst_d2 = fmax(worst_d2, fabs(sharded[i] - packed[i]));
    }
    check(r, rc == 0 && n == 6 && m == 6 && k == 6 && stats && worst <= 2e-6 && worst_d2 <= 2e-6,
          "./train --pack: 2 samples a row (the plan note says so), 6 steps' losses equal -b 4 "
          "unpacked within %.0e (the log's 6 decimals), -d 2 within %.0e; first %.6f last %.6f",
          worst, worst_d2, n ? plain[0] : 0.0, n ? plain[n - 1] : 0.0);
    /* resumed from step 3 of the packed run: steps 4 to 6 as without the stop */
    double resumed[8];
    run_command("rm -rf build/pack_out", out, sizeof out);
    snprintf(args, sizeof args, "%s --pack -t 16 -b 2 -g 2 --out build/pack_out --save-every 3",
             common);
    rc = run_capture(args, out, sizeof out);
    rc |= run_capture("--resume build/pack_out/step-3 --log build/pack_resumed.jsonl", out, sizeof out);
    int j = packing_log_losses("build/pack_resumed.jsonl", resumed, 8);
    int same = j == 3 && m == 6;
    for (int i = 0; same && i < 3; i++) same = resumed[i] == packed[3 + i];
    check(r, rc == 0 && same, "./train --pack resumed from step 3: steps 4-6's losses equal the "
          "uninterrupted run's (%d steps)", j);
    if (lg_shard_write("build/pack_shard.bin", tokens, N * LEN, 2, &err) == 0)
        expect_cli(r, "-c test-llama --data build/pack_shard.bin --pack -t 16 --max-steps 1", 2,
                   "--pack packs fine-tuning samples (tools/prepare alpaca or chat); "
                   "build/pack_shard.bin is a token shard");
}

/* --pack's plan: a tokens.spans region as large as tokens.inputs, and the arenas as planned. */
static void test_packing_plan(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    lg_args a;
    lg_args_default(&a);
    a.micro_batch_size = 2;
    a.pack = 1;
    lg_error err;
    lg_trainer tr;
    if (create_counting(&tr, &cfg, &a, 16, &err) != 0) { check(r, 0, "--pack plan: %s", err.msg); return; }
    const lg_region *spans = lg_plan_find(&tr.plan.ranks[0], "tokens.spans");
    const lg_region *inputs = lg_plan_find(&tr.plan.ranks[0], "tokens.inputs");
    check(r, spans && inputs && spans->bytes == inputs->bytes && spans->pool == LG_POOL_HOST &&
          tr.ranks[0].spans == lg_rank_region(&tr.ranks[0].rank, "tokens.spans") &&
          arenas_equal_plan(&tr), "--pack plans tokens.spans (%zu bytes, as tokens.inputs) and "
          "the arenas equal the plan", spans ? spans->bytes : 0);
    lg_trainer_free(&tr);
}

static void test_packing_all(results *r) {
    static const char *const configs[] = {"test-gpt2", "test-pythia", "test-llama", "test-falcon", "test-llama31"};
    for (int c = 0; c < 5; c++) test_packing_equivalence(r, configs[c], 0);
    test_packing_equivalence(r, "test-llama", 1);
    test_packing_equivalence(r, "test-pythia", 1);
    test_packing_refusals(r);
    test_packing_train(r);
    test_packing_plan(r);
}
