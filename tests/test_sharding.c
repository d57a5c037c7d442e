/* Sharding over ranks (included by tests/test.c, single precision): every strategy equals one
   rank, the plan per rank is what each rank allocates, model state falls as 1/N. */

/* Devices and nodes of a run of `ranks` ranks with a strategy: hybrid-shard puts two ranks on
   each node when it can (2 nodes x 2 devices for 4). */
static void ranks_of(lg_strategy strategy, int ranks, lg_args *a) {
    a->strategy = strategy;
    a->nodes = strategy == LG_STRATEGY_HYBRID_SHARD && ranks % 2 == 0 ? 2 : 1;
    a->devices = ranks / a->nodes;
}

/* 5 AdamW or SGD steps of -b 1 -g 12 at fp32 on N ranks against one rank: same losses and
   weights within 1e-5 relative. The ranks add the same gradients in another order; AdamW
   divides each by its own running size, so elements whose contributions nearly cancel carry
   that rounding into a step of about lr, and the difference grows with lr: the AdamW runs use
   lr 3e-4 (at 1e-2 the worst element, in test-gpt2's mlp.proj, differs by 2.5e-5). */
static void test_sharding_equals_one_rank(results *r) {
    static const char *const configs[3] = {"test-gpt2", "test-pythia", "test-llama"};
    const int steps = 5, T = 12;
    for (int c = 0; c < 3; c++) {
        lg_config cfg;
        if (load_config_or_fail(r, &cfg, configs[c])) continue;
        for (int o = 0; o < 2; o++) {
            lg_args a;
            lg_args_default(&a);
            a.precision = LG_PRECISION_32_TRUE;
            a.micro_batch_size = 1;
            a.global_batch_size = 12; /* divides by 2, 3 and 4 ranks */
            a.optimizer = o ? LG_OPTIMIZER_SGD : LG_OPTIMIZER_ADAMW;
            a.lr = o ? 1e-2f : 3e-4f;
            a.min_lr = a.lr / 10;
            a.warmup_steps = 0;
            a.max_steps = steps;
            double one_losses[5];
            lg_trainer one;
            if (train_steps(&one, &cfg, &a, T, steps, one_losses) != 0) {
                check(r, 0, "%s: one rank trains", configs[c]);
                continue;
            }
            lg_real *expected = trained_weights(&one);
            size_t n = one.ranks[0].model.n_params;
            double worst_w = 0, worst_loss = 0;
            char worst_run[64] = "";
            int runs = 0, ok = 1;
            for (int s = 0; s < 4; s++)
                for (int ranks = 2; ranks <= 4; ranks++) {
                    lg_args b = a;
                    ranks_of((lg_strategy)s, ranks, &b);
                    double e = trained_apart(&cfg, &b, T, steps, expected, n, one_losses, &worst_loss);
                    if (e < 0) { ok = 0; continue; }
                    if (e >= worst_w) {
                        worst_w = e;
                        snprintf(worst_run, sizeof worst_run, "%s -d %d --nodes %d",
                                 lg_strategy_name(b.strategy), b.devices, b.nodes);
                    }
                    runs++;
                }
            check(r, ok && runs == 12 && worst_w < 1e-5 && worst_loss < 1e-5,
                  "%-11s %-5s 4 strategies x 2, 3, 4 ranks = 1 rank after %d steps: weights rel "
                  "err %.1e (worst %s), losses %.1e (< 1e-5)", configs[c], o ? "sgd" : "adamw",
                  steps, worst_w, worst_run, worst_loss);
            LG_FREE(expected);
            lg_trainer_free(&one);
        }
    }
}

/* Each rank allocates exactly its plan (one arena per pool), and training allocates nothing. */
static void test_sharding_allocations(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-pythia")) return;
    for (int s = 0; s < 4; s++) {
        lg_args a;
        lg_args_default(&a);
        a.micro_batch_size = 2;
        a.global_batch_size = 24;
        ranks_of((lg_strategy)s, s == LG_STRATEGY_HYBRID_SHARD ? 4 : 3, &a);
        a.offload = s == LG_STRATEGY_SHARD_GRAD_OP; /* and the host pool */
        lg_trainer tr;
        lg_error err;
        int ok = create_counting(&tr, &cfg, &a, 8, &err) == 0;
        if (!ok) {
            check(r, 0, "%s: %s", lg_strategy_name(a.strategy), err.msg);
            continue;
        }
        int arenas = 0;
        for (int k = 0; ok && k < tr.n_ranks; k++)
            for (int pool = 0; pool < LG_N_POOLS; pool++) {
                size_t planned = tr.plan.ranks[k].pool_bytes[pool];
                for (int i = 0; i < test_allocations.n; i++)
                    if (test_allocations.blocks[i] == tr.ranks[k].rank.arena[pool]) {
                        ok = ok && test_allocations.sizes[i] == planned + LG_ALIGN;
                        arenas++;
                    }
            }
        lg_loader ld;
        builtin_loader(&ld, &cfg, 8, 5, 4096, 1);
        test_allocations.n = 0;
        test_allocations.counting = 1;
        lg_step_stats st;
        for (int step = 0; ok && step < 2; step++) ok = lg_trainer_step(&tr, &ld, step, &st, &err) == 0;
        test_allocations.counting = 0;
        ok = ok && test_allocations.n == 0;
        int expected_arenas = 2 * tr.n_ranks; /* device, and host (tokens; offload's state) */
        char size[32];
        check(r, ok && arenas == expected_arenas,
              "%-13s -d %d --nodes %d%s: %d arenas, each exactly its rank's plan (%s device), no "
              "allocation while training", lg_strategy_name(a.strategy), a.devices, a.nodes,
              a.offload ? " --offload" : "", arenas,
              lg_format_bytes(tr.plan.ranks[0].pool_bytes[LG_POOL_DEVICE], size, sizeof size));
        lg_loader_close(&ld);
        lg_trainer_free(&tr);
    }
}

/* Weights, master weights, gradients and optimizer state of one rank, from its plan. */
static size_t model_state_bytes(const lg_rank_plan *p) {
    size_t bytes = 0;
    for (int pool = 0; pool < LG_N_POOLS; pool++)
        bytes += lg_plan_group_bytes(p, LG_GROUP_WEIGHTS, (lg_pool)pool) +
                 lg_plan_group_bytes(p, LG_GROUP_MASTER, (lg_pool)pool) +
                 lg_plan_group_bytes(p, LG_GROUP_GRADIENTS, (lg_pool)pool) +
                 lg_plan_group_bytes(p, LG_GROUP_OPTIMIZER, (lg_pool)pool);
    return bytes;
}

/* Full-shard: each rank's model state is 1/N of one rank's (up to the padding of each unit);
   shard-grad-op keeps whole weights, no-shard everything. Meta-Llama-3-8B, bf16-mixed. */
static void test_sharding_memory(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "Meta-Llama-3-8B")) return;
    lg_plan_spec spec;
    memset(&spec, 0, sizeof spec);
    spec.B = 1; spec.T = 2048; spec.accumulation = 1; spec.threads = 1;
    spec.precision = LG_PRECISION_BF16_MIXED;
    spec.optimizer = LG_OPTIMIZER_ADAMW;
    spec.devices = spec.nodes = 1;
    lg_plan plan;
    lg_error err;
    if (lg_plan_make(&plan, &cfg, &spec, &err) != 0) { check(r, 0, "%s", err.msg); return; }
    size_t one = model_state_bytes(&plan.ranks[0]), n = 8030261248ull;
    lg_plan_free(&plan);
    int ok = one >= 18 * n && one < 18 * n + 5 * LG_ALIGN; /* bf16 2, master 4, grads 4, m v 8 */
    char line[256] = "", size[32];
    for (int devices = 2; devices <= 8; devices *= 2) {
        spec.devices = devices;
        spec.strategy = LG_STRATEGY_FULL_SHARD;
        if (lg_plan_make(&plan, &cfg, &spec, &err) != 0) { ok = 0; break; }
        size_t per_rank = model_state_bytes(&plan.ranks[devices - 1]);
        double ratio = (double)one / per_rank;
        ok = ok && ratio > devices * 0.9999 && ratio <= devices * 1.0001;
        size_t len = strlen(line);
        snprintf(line + len, sizeof line - len, " -d %d: %s (1/%.4f)", devices,
                 lg_format_bytes(per_rank, size, sizeof size), ratio);
        lg_plan_free(&plan);
    }
    spec.devices = 8;
    spec.strategy = LG_STRATEGY_SHARD_GRAD_OP;
    ok = ok && lg_plan_make(&plan, &cfg, &spec, &err) == 0;
    size_t grad_op = ok ? model_state_bytes(&plan.ranks[0]) : 0;
    if (ok) lg_plan_free(&plan);
    spec.strategy = LG_STRATEGY_NO_SHARD;
    ok = ok && lg_plan_make(&plan, &cfg, &spec, &err) == 0;
    size_t no_shard = ok ? model_state_bytes(&plan.ranks[0]) : 0;
    if (ok) lg_plan_free(&plan);
    /* shard-grad-op: whole bf16 weights + 16 / 8 bytes a parameter of sharded state */
    ok = ok && no_shard == one && grad_op > 2 * n && grad_op < 2 * n + 16 * n / 8 + 16 * n / 800;
    char grad_op_size[32], no_shard_size[32];
    check(r, ok, "Meta-Llama-3-8B model state per rank: -d 1 %s;%s; -d 8 shard-grad-op %s, "
          "no-shard %s", lg_format_bytes(one, size, sizeof size), line,
          lg_format_bytes(grad_op, grad_op_size, sizeof grad_op_size),
          lg_format_bytes(no_shard, no_shard_size, sizeof no_shard_size));
}

/* 16-mixed on 2 full-shard ranks: an overflow is seen through the global norm, so every rank
   skips the step (no weight changes anywhere) and the one scale halves. */
static void test_sharding_loss_scaler(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    lg_args a;
    lg_args_default(&a);
    a.precision = LG_PRECISION_16_MIXED;
    a.micro_batch_size = 2;
    a.global_batch_size = 4;
    ranks_of(LG_STRATEGY_FULL_SHARD, 2, &a);
    lg_error err;
    lg_trainer tr;
    if (lg_trainer_create(&tr, &cfg, &a, 8, &err) != 0) { check(r, 0, "%s", err.msg); return; }
    lg_loader ld;
    builtin_loader(&ld, &cfg, 8, 3, 400, 1);
    lg_step_stats st;
    int ok = lg_trainer_step(&tr, &ld, 0, &st, &err) == 0 && !st.skipped;
    tr.loss_scale = 1073741824.0f; /* 2^30: fp16 activation gradients overflow */
    lg_real *before = trained_weights(&tr);
    ok = ok && lg_trainer_step(&tr, &ld, 1, &st, &err) == 0 && st.skipped &&
         tr.loss_scale == 536870912.0f;
    lg_real *after = trained_weights(&tr);
    int unchanged = memcmp(before, after, tr.ranks[0].model.n_params * sizeof(lg_real)) == 0;
    check(r, ok && unchanged, "16-mixed on 2 full-shard ranks: an overflow skips the step on "
          "every rank (weights unchanged) and halves the scale");
    LG_FREE(before);
    LG_FREE(after);
    lg_loader_close(&ld);
    lg_trainer_free(&tr);
}

static void test_sharding_cli(results *r) {
    static char out[65536];
    int code = run_capture("-d 2 --nodes 2 --strategy hybrid-shard -b 2 -g 8 --max-steps 2 "
                           "--eval-iters 2", out, sizeof out);
    check(r, code == 0 && strstr(out, "ranks: 2 devices x 2 nodes, hybrid-shard") &&
          strstr(out, "step     2/2") && strstr(out, "sample:"),
          "./train -d 2 --nodes 2 --strategy hybrid-shard trains, evaluates and samples (exit %d)",
          code);
    code = run_capture("--plan -d 8 --strategy full-shard -c Meta-Llama-3-8B -t 2048 -b 1 "
                       "--memory-limit 1TiB", out, sizeof out);
    check(r, code == 0 && strstr(out, "8 devices, full-shard") && strstr(out, "communication") &&
          strstr(out, "weights bf16 x 1003782656"),
          "--plan -d 8 --strategy full-shard -c Meta-Llama-3-8B shows what each device holds");
}

static void test_sharding(results *r) {
    test_sharding_equals_one_rank(r);
    test_sharding_allocations(r);
    test_sharding_memory(r);
    test_sharding_loss_scaler(r);
    test_sharding_cli(r);
}
