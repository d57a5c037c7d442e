/* LoRA and QLoRA (included by tests/test.c, single precision): training starts from the base
   model, the base stays frozen, the adapters train with every optimizer and precision, the
   equivalences of the trainer hold with adapters, the merged model computes what the adapters
   do, the plan is what is allocated, and bad settings are refused. The adapters' gradients are
   checked against finite differences by the double-precision runner (test_lora_gradient). */

/* Every target: q, k, v, proj, mlp and head. */
#define LORA_ALL_TARGETS                                                                       \
    (LG_LORA_QUERY | LG_LORA_KEY | LG_LORA_VALUE | LG_LORA_PROJECTION | LG_LORA_MLP | LG_LORA_HEAD)

static const char *const lora_configs[3] = {"test-gpt2", "test-pythia", "test-llama"};

/* Small fp32 runs of the built-in task with adapters of rank 4 on every target. */
static lg_args lora_args(int r, float dropout) {
    lg_args a;
    lg_args_default(&a);
    a.precision = LG_PRECISION_32_TRUE;
    a.micro_batch_size = 2;
    a.global_batch_size = 8;
    a.lr = 1e-2f;
    a.min_lr = 1e-3f;
    a.warmup_steps = 0;
    a.max_steps = 4;
    a.lora.r = r;
    a.lora.dropout = dropout;
    a.lora.targets = LORA_ALL_TARGETS;
    return a;
}

/* Every target the config allows: not the head when it is tied to the embeddings. */
static unsigned lora_targets_of(const lg_config *cfg) {
    return cfg->tie_embeddings ? LORA_ALL_TARGETS & ~(unsigned)LG_LORA_HEAD : LORA_ALL_TARGETS;
}

/* Trains `steps` steps on the first `tokens` tokens of the built-in task (the same data
   whatever the micro-batch); the trainer is the caller's to free. */
static int lora_train(lg_trainer *tr, const lg_config *cfg, const lg_args *a, int T, int steps,
                      size_t tokens, double *losses) {
    lg_error err;
    if (lg_trainer_create(tr, cfg, a, T, &err) != 0) { printf("    %s\n", err.msg); return -1; }
    lg_loader ld;
    builtin_loader(&ld, cfg, T, 5, tokens, 1);
    int rc = run_step_range(tr, &ld, 0, steps, losses);
    lg_loader_close(&ld);
    return rc;
}

/* The validation loss of a trainer on the first micro-batches of the built-in task. */
static double lora_eval(lg_trainer *tr, const lg_config *cfg, int T) {
    lg_loader ld;
    lg_error err;
    double loss = -1;
    builtin_loader(&ld, cfg, T, 9, 4096, 1);
    if (lg_trainer_evaluate(tr, &ld, 2, &loss, &err) != 0) printf("    %s\n", err.msg);
    lg_loader_close(&ld);
    return loss;
}

/* Step 0: B = 0, so the adapted model computes exactly the base model (same seed, same base). */
static void test_lora_starts_from_base(results *r) {
    for (int c = 0; c < 3; c++) {
        lg_config cfg;
        if (load_config_or_fail(r, &cfg, lora_configs[c])) continue;
        lg_args full = lora_args(0, 0), lora = lora_args(4, 0.1f);
        lora.lora.targets = lora_targets_of(&cfg);
        lg_trainer a, b;
        lg_error err;
        if (lg_trainer_create(&a, &cfg, &full, 12, &err) || lg_trainer_create(&b, &cfg, &lora, 12, &err)) {
            check(r, 0, "%s: %s", lora_configs[c], err.msg);
            continue;
        }
        double base = lora_eval(&a, &cfg, 12), adapted = lora_eval(&b, &cfg, 12);
        check(r, base > 0 && base == adapted, "%-11s step 0 with adapters on every target: loss "
              "%.9f, the base model's %.9f (bitwise)", lora_configs[c], adapted, base);
        lg_trainer_free(&a);
        lg_trainer_free(&b);
    }
}

/* The frozen base is bitwise unchanged by training; only the adapters' state exists. */
static void test_lora_frozen(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    lg_args a = lora_args(4, 0.1f);
    a.precision = LG_PRECISION_BF16_MIXED;
    lg_trainer tr;
    lg_error err;
    if (lg_trainer_create(&tr, &cfg, &a, 12, &err)) { check(r, 0, "%s", err.msg); return; }
    const lg_model *m = &tr.ranks[0].model;
    size_t bytes = m->frozen_table.total * lg_elem_size(m->frozen.dtype);
    unsigned char *before = (unsigned char *)LG_MALLOC(bytes);
    memcpy(before, m->frozen.data, bytes);
    lg_real *adapters_before = trained_weights(&tr);
    lg_loader ld;
    builtin_loader(&ld, &cfg, 12, 5, 4096, 1);
    double losses[4];
    int ok = run_step_range(&tr, &ld, 0, 4, losses) == 0;
    lg_real *adapters_after = trained_weights(&tr);
    double moved = rel_error(adapters_after, adapters_before, m->n_params, 1e-6);
    size_t base_params = lg_params_layout(&cfg, lg_no_buf(), NULL, NULL);
    const lg_region *grads = lg_plan_find(&tr.plan.ranks[0], "gradients");
    const lg_region *master = lg_plan_find(&tr.plan.ranks[0], "master_weights");
    check(r, ok && memcmp(before, m->frozen.data, bytes) == 0 && moved > 1e-3,
          "test-llama  bf16-mixed LoRA: after 4 steps the frozen base (%zu values) is bitwise "
          "unchanged, the adapters moved (rel %.1e)", m->frozen_table.total, moved);
    check(r, grads && master && grads->count == m->n_params && master->count == m->n_params &&
          m->frozen_table.total == base_params,
          "test-llama  gradients and master weights: %zu elements each, the adapters' (the base "
          "has %zu)", grads ? grads->count : 0, base_params);
    LG_FREE(before);
    LG_FREE(adapters_before);
    LG_FREE(adapters_after);
    lg_loader_close(&ld);
    lg_trainer_free(&tr);
}

/* Every optimizer, precision and quantization trains the adapters: test-llama memorises one
   repeated batch through adapters of rank 4 (the loss falls by a quarter or more in 30 steps). */
static void test_lora_trains(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    static const lg_optimizer_kind kinds[4] = {LG_OPTIMIZER_ADAMW, LG_OPTIMIZER_SGD,
                                               LG_OPTIMIZER_LION, LG_OPTIMIZER_SOPHIA};
    static const float lrs[4] = {2e-2f, 0.03f, 3e-3f, 2e-2f};
    for (int k = 0; k < 4; k++)
        for (int q = 0; q < 3; q++) {
            if (q && kinds[k] != LG_OPTIMIZER_ADAMW) continue; /* QLoRA: AdamW, as LitGPT */
            const int steps = 30, T = 12;
            lg_args a = lora_args(4, 0.05f);
            a.optimizer = kinds[k];
            a.lr = lrs[k];
            a.min_lr = a.lr;
            a.global_batch_size = a.micro_batch_size;
            a.max_steps = steps;
            a.precision = q ? LG_PRECISION_BF16_MIXED : k % 2 ? LG_PRECISION_BF16_TRUE : LG_PRECISION_32_TRUE;
            a.lora.quantize = (lg_quantization)q;
            if (kinds[k] == LG_OPTIMIZER_LION) a.beta2 = 0.99f;
            double losses[30] = {0};
            lg_trainer tr;
            int ok = lora_train(&tr, &cfg, &a, T, steps, (size_t)a.micro_batch_size * T + 1, losses) == 0;
            double first = losses[0], last = losses[steps - 1];
            check(r, ok && last < 0.75 * first, "test-llama  %-6s %-10s %-6s r 4: one batch's loss "
                  "%.3f -> %.3f in %d steps", lg_optimizer_name(a.optimizer),
                  lg_precision_name(a.precision), q ? lg_quantization_name(a.lora.quantize) : "LoRA",
                  first, last, steps);
            lg_trainer_free(&tr);
        }
}

/* With adapters the trainer's equivalences hold: N ranks of every strategy = one rank (dropout
   on: the masks follow the global micro-batch), --recompute and --offload bitwise. */
static void test_lora_equivalences(results *r) {
    const int steps = 4, T = 12;
    for (int c = 0; c < 3; c++) {
        lg_config cfg;
        if (load_config_or_fail(r, &cfg, lora_configs[c])) continue;
        for (int q = 0; q < 2; q++) {
            if (q && c != 2) continue; /* QLoRA: test-llama */
            lg_args a = lora_args(4, 0.1f);
            a.lora.targets = lora_targets_of(&cfg);
            a.micro_batch_size = 1;
            a.global_batch_size = 12;
            a.lr = 3e-3f;
            a.lora.quantize = q ? LG_QUANTIZE_NF4 : LG_QUANTIZE_NONE;
            double one_losses[4];
            lg_trainer one;
            if (train_steps(&one, &cfg, &a, T, steps, one_losses) != 0) {
                check(r, 0, "%s: one rank trains", lora_configs[c]);
                continue;
            }
            lg_real *expected = trained_weights(&one);
            size_t n = one.ranks[0].model.n_params;
            double worst_w = 0, worst_loss = 0;
            int runs = 0, ok = 1, bitwise = 1;
            for (int s = 0; s < 4; s++)
                for (int ranks = 2; ranks <= 4; ranks += 2) {
                    if (ranks == 4 && s != LG_STRATEGY_FULL_SHARD && s != LG_STRATEGY_HYBRID_SHARD) continue;
                    lg_args b = a;
                    ranks_of((lg_strategy)s, ranks, &b);
                    double e = trained_apart(&cfg, &b, T, steps, expected, n, one_losses, &worst_loss);
                    if (e < 0) { ok = 0; continue; }
                    worst_w = fmax(worst_w, e);
                    runs++;
                }
            for (int v = 0; v < 3; v++) { /* --recompute block, --offload, both activations */
                lg_args b = a;
                if (v == 1) b.offload = 1;
                else b.recompute = 1;
                b.offload_activations = v == 2;
                double losses[4];
                lg_trainer tr;
                if (train_steps(&tr, &cfg, &b, T, steps, losses) != 0) { ok = 0; continue; }
                lg_real *got = trained_weights(&tr);
                bitwise = bitwise && memcmp(got, expected, n * sizeof(lg_real)) == 0 &&
                          memcmp(losses, one_losses, sizeof losses) == 0;
                LG_FREE(got);
                lg_trainer_free(&tr);
            }
            check(r, ok && runs == 6 && worst_w < 1e-5 && worst_loss < 1e-5,
                  "%-11s %s dropout 0.1: 4 strategies on 2 ranks, full- and hybrid-shard on 4 = "
                  "1 rank after %d steps: "
                  "adapters rel err %.1e, losses %.1e (< 1e-5)", lora_configs[c],
                  q ? "QLoRA nf4" : "LoRA", steps, worst_w, worst_loss);
            check(r, ok && bitwise, "%-11s %s: --recompute block, --offload and --offload "
                  "activations give bitwise the same adapters and losses", lora_configs[c], q ? "QLoRA nf4" : "LoRA");
            LG_FREE(expected);
            lg_trainer_free(&one);
        }
    }
}

/* -b 1 x 4 accumulation = -b 4 (without dropout: its masks follow the micro-batch). */
static void test_lora_accumulation(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-pythia")) return;
    lg_args a = lora_args(4, 0.0f), b = a;
    a.micro_batch_size = 4;
    a.global_batch_size = 4;
    b.micro_batch_size = 1;
    b.global_batch_size = 4;
    double la[4], lb[4];
    lg_trainer ta, tb;
    int ok = lora_train(&ta, &cfg, &a, 12, 4, 4096, la) == 0 && lora_train(&tb, &cfg, &b, 12, 4, 4096, lb) == 0;
    lg_real *wa = ok ? trained_weights(&ta) : NULL, *wb = ok ? trained_weights(&tb) : NULL;
    double e = ok ? rel_error(wb, wa, ta.ranks[0].model.n_params, 1e-6) : 1;
    check(r, ok && e < 1e-5, "test-pythia LoRA: -b 1 x 4 accumulation = -b 4 after 4 steps "
          "(adapters rel err %.1e)", e);
    LG_FREE(wa);
    LG_FREE(wb);
    if (ok) {
        lg_trainer_free(&ta);
        lg_trainer_free(&tb);
    }
}

/* The last checkpoint's merged model, loaded without adapters, gives the adapted model's loss;
   the run resumed from a checkpoint gives the uninterrupted run's losses. */
static void test_lora_merged_and_resume(results *r) {
    mkdir("out", 0755);
    for (int c = 0; c < 3; c++) {
        lg_config cfg;
        if (load_config_or_fail(r, &cfg, lora_configs[c])) continue;
        for (int q = 0; q < 2; q++) {
            lg_args a = lora_args(4, 0.1f);
            a.lora.targets = lora_targets_of(&cfg);
            a.lora.quantize = q ? LG_QUANTIZE_NF4 : LG_QUANTIZE_NONE;
            a.max_steps = 4;
            lg_trainer tr, plain;
            lg_error err;
            lg_loader ld;
            char out[256], dir[300];
            snprintf(out, sizeof out, "out/test-lora-%s-%d", lora_configs[c], q);
            snprintf(dir, sizeof dir, "%s/step-4", out);
            double losses[4], resumed[4];
            if (lg_trainer_create(&tr, &cfg, &a, 12, &err)) { check(r, 0, "%s", err.msg); continue; }
            builtin_loader(&ld, &cfg, 12, 5, 4096, 1);
            int ok = run_step_range(&tr, &ld, 0, 2, losses) == 0;
            char mid[300];
            snprintf(mid, sizeof mid, "%s/step-2", out);
            ok = ok && lg_checkpoint_save(&tr, &ld, 2, out, &err) == 0;
            ok = ok && run_step_range(&tr, &ld, 2, 4, losses) == 0;
            ok = ok && lg_checkpoint_save(&tr, &ld, 4, out, &err) == 0;
            double adapted = lora_eval(&tr, &cfg, 12);
            lg_args base_args = a;
            base_args.lora.r = 0;
            base_args.lora.quantize = LG_QUANTIZE_NONE;
            double merged = -1;
            if (ok && lg_trainer_create(&plain, &cfg, &base_args, 12, &err) == 0) {
                if (lg_trainer_load_hf(&plain, dir, &err) == 0) merged = lora_eval(&plain, &cfg, 12);
                else printf("    %s\n", err.msg);
                lg_trainer_free(&plain);
            }
            check(r, ok && fabs(merged - adapted) < 1e-5 * adapted,
                  "%-11s %s: the merged model (W + alpha/r B A%s) loads without adapters: loss "
                  "%.7f, adapted %.7f", lora_configs[c], q ? "QLoRA" : "LoRA",
                  q ? ", NF4 dequantized" : "", merged, adapted);
            lg_loader_close(&ld);
            lg_trainer_free(&tr);
            /* resume from step-2 */
            int step = 0;
            ok = ok && lg_trainer_create(&tr, &cfg, &a, 12, &err) == 0;
            builtin_loader(&ld, &cfg, 12, 5, 4096, 1);
            ok = ok && lg_checkpoint_resume(&tr, &ld, mid, &step, &err) == 0 && step == 2 &&
                 run_step_range(&tr, &ld, 2, 4, resumed) == 0;
            if (!ok) printf("    %s\n", err.msg);
            check(r, ok && resumed[2] == losses[2] && resumed[3] == losses[3],
                  "%-11s %s: resumed from step-2 (adapters from the PEFT file, state from the "
                  "training state): losses %.7f %.7f, uninterrupted %.7f %.7f", lora_configs[c],
                  q ? "QLoRA" : "LoRA", resumed[2], resumed[3], losses[2], losses[3]);
            lg_loader_close(&ld);
            lg_trainer_free(&tr);
        }
    }
}

/* A LoRA and a QLoRA trainer allocate exactly their plan; the plan has the frozen regions, the
   packed NF4 weights and their dequantization workspace. */
static void test_lora_plan(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    for (int q = 0; q < 3; q++) {
        lg_args a = lora_args(4, 0.05f);
        a.precision = LG_PRECISION_BF16_MIXED;
        a.lora.quantize = (lg_quantization)q;
        a.devices = q == 2 ? 2 : 1;
        a.global_batch_size = a.micro_batch_size * a.devices;
        lg_trainer tr;
        lg_error err;
        if (create_counting(&tr, &cfg, &a, 12, &err) != 0) { check(r, 0, "%s", err.msg); continue; }
        int arenas = 0, ok = 1;
        for (int k = 0; k < tr.n_ranks; k++) /* (an address may be reused after a free) */
            for (int pool = 0; pool < LG_N_POOLS; pool++) {
                int found = 0;
                for (int i = 0; i < test_allocations.n; i++)
                    found |= test_allocations.blocks[i] == tr.ranks[k].rank.arena[pool] &&
                             test_allocations.sizes[i] == tr.plan.ranks[k].pool_bytes[pool] + LG_ALIGN;
                arenas += found;
            }
        const lg_rank_plan *rp = &tr.plan.ranks[0];
        int sharded = lg_frozen_sharded(&tr.plan.cfg, &tr.plan.sharding);
        int regions = (lg_plan_find(rp, sharded ? "frozen_weights.shard" : "frozen_weights") != NULL) &&
                      (q == 0 || sharded) == (lg_plan_find(rp, "frozen_weights.nf4") == NULL) &&
                      (q == 0) == (lg_plan_find(rp, "nf4.dequantized") == NULL);
        if (sharded) { /* each rank's shard: 1/N of the whole frozen units, plus padding */
            const lg_shard_layout *sl = &tr.plan.frozen_shards;
            size_t whole = sl->unit_offset[sl->n_units], pad = (size_t)sl->n_units * 2 * LG_ALIGN;
            for (int k = 0; k < tr.n_ranks; k++) {
                const lg_region *g = lg_plan_find(&tr.plan.ranks[k], "frozen_weights.shard");
                regions = regions && g && g->count * tr.n_ranks >= whole &&
                          g->count * tr.n_ranks <= whole + pad * tr.n_ranks;
            }
        }
        char size[32];
        check(r, ok && regions && arenas == 2 * tr.n_ranks,
              "test-llama  %s -d %d: %d arenas of exactly the plan (%s a device), frozen regions "
              "as planned%s", q ? lg_quantization_name(a.lora.quantize) : "LoRA", a.devices, arenas,
              lg_format_bytes(rp->pool_bytes[LG_POOL_DEVICE], size, sizeof size),
              sharded ? " (full-shard: each rank 1/N of the frozen units)" : "");
        lg_trainer_free(&tr);
    }
}

/* QLoRA nf4-dq under full-shard (the frozen base sharded, gathered unit by unit) writes the
   same adapters, training state and merged model, byte for byte, as under shard-grad-op
   (the frozen base whole on each rank; = one rank within 1e-5, test_lora_equivalences), and
   resumes from its checkpoint (the base hash taken unit by unit as the base was set). */
static void test_lora_sharded_frozen_files(results *r) {
    static const char *const files[4] = {"adapter_model.safetensors", "training_state.safetensors",
                                          "model.safetensors", "config.json"};
    static const char *const strategies[2] = {"full-shard", "shard-grad-op"};
    char args[512], cmd[512];
    mkdir("out", 0755);
    for (int s = 0; s < 2; s++) {
        snprintf(args, sizeof args, "-c test-llama --lora-r 2 --quantize nf4-dq -p bf16-mixed -d 2 "
                 "--strategy %s -b 1 -t 12 --max-steps 2 --eval-every 0 --sample-tokens 1 --out "
                 "out/test-lora-frozen-%s", strategies[s], strategies[s]);
        expect_cli(r, args, 0, "saved out/test-lora-frozen-");
    }
    int same = 0;
    for (int k = 0; k < 4; k++) {
        snprintf(cmd, sizeof cmd, "cmp -s out/test-lora-frozen-full-shard/step-2/%s "
                 "out/test-lora-frozen-shard-grad-op/step-2/%s", files[k], files[k]);
        same += system(cmd) == 0;
    }
    check(r, same == 4, "test-llama nf4-dq -d 2: full-shard's step-2 (frozen base sharded) has "
          "shard-grad-op's adapters, training state, merged model and config, byte for byte "
          "(%d of 4 files)", same);
    expect_cli(r, "-c test-llama --lora-r 2 --quantize nf4-dq -p bf16-mixed -d 2 --strategy "
                  "full-shard -b 1 -t 12 --max-steps 3 --eval-every 0 --sample-tokens 1 --resume "
                  "out/test-lora-frozen-full-shard/step-2", 0, "saved out/test-lora-frozen-full-shard/step-3");
}

/* --offload embedding over a --load'ed base (the table set in host memory from the files),
   QLoRA nf4, one rank and -d 2 full-shard (the frozen ends unit gathered without the table),
   a sample each step (generation's forward through the host rows): step-2 holds the same
   adapters, training state, merged model (the table read back from the host) and config, byte
   for byte, as the run with the table on the device. */
static void test_lora_host_embedding_files(results *r) {
    static const char *const files[4] = {"adapter_model.safetensors", "training_state.safetensors",
                                          "model.safetensors", "config.json"};
    char args[512], cmd[512];
    mkdir("out", 0755);
    for (int d = 1; d <= 2; d++) {
        for (int host = 0; host < 2; host++) {
            snprintf(args, sizeof args, "--load tests/hf/llama --lora-r 2 --lora-targets all "
                     "--quantize nf4 -p bf16-mixed -d %d -b 1 -t 8 --max-steps 2 --eval-every 0 "
                     "--sample-every 1 --sample-tokens 2 --out out/test-lora-embedding-%d-%d%s", d,
                     d, host, host ? " --offload embedding" : "");
            expect_cli(r, args, 0, "saved out/test-lora-embedding-");
        }
        int same = 0;
        for (int k = 0; k < 4; k++) {
            snprintf(cmd, sizeof cmd, "cmp -s out/test-lora-embedding-%d-0/step-2/%s "
                     "out/test-lora-embedding-%d-1/step-2/%s", d, files[k], d, files[k]);
            same += system(cmd) == 0;
        }
        check(r, same == 4, "tests/hf/llama nf4 -d %d: --offload embedding's step-2 has the "
              "adapters, training state, merged model and config of the table on the device, "
              "byte for byte (%d of 4 files)", d, same);
    }
}

/* Bad settings: one line naming them, exit 2. */
static void test_lora_cli(results *r) {
    mkdir("out", 0755);
    expect_cli(r, "--lora-r 4 --lora-targets q,x --max-steps 1", 2, "unknown target 'x'");
    expect_cli(r, "--quantize nf4 --max-steps 1", 2, "--quantize nf4 needs --lora-r");
    expect_cli(r, "--quantize nf3 --lora-r 2 --max-steps 1", 2, "'nf3' is not nf4 or nf4-dq");
    expect_cli(r, "--lora-r 200 --max-steps 1", 2, "--lora-r 200 exceeds attn.q's smaller dimension 96");
    expect_cli(r, "--lora-r -1 --max-steps 1", 2, "--lora-r must be >= 0");
    expect_cli(r, "-c test-gpt2 -t 16 --lora-r 2 --lora-targets q,head --max-steps 1", 2,
               "--lora-targets head: this model ties lm_head to the token embeddings");
    expect_cli(r, "--lora-r 4 --lora-dropout 1 --max-steps 1", 2, "--lora-dropout must be within [0, 1)");
    /* other adapters than the checkpoint's: resume refuses naming the flag */
    expect_cli(r, "--lora-r 2 --max-steps 2 --eval-every 0 --sample-tokens 1 --out out/test-lora-cli",
               0, "saved out/test-lora-cli/step-2");
    expect_cli(r, "--lora-r 4 --max-steps 3 --eval-every 0 --resume out/test-lora-cli", 2,
               "--lora-r differs from the run's");
    expect_cli(r, "--lora-r 2 --lora-targets q,k,v --max-steps 3 --eval-every 0 --resume out/test-lora-cli",
               2, "--lora-targets differs from the run's");
    FILE *f = fopen("out/test-lora-cli/step-2/adapter_config.json", "r");
    char text[4096] = "";
    size_t n = f ? fread(text, 1, sizeof text - 1, f) : 0;
    text[n] = '\0';
    if (f) fclose(f);
    check(r, strstr(text, "\"base_model_name_or_path\": \"(drawn at random: builtin-sort, seed 1337)") != NULL,
          "adapter_config.json of a LoRA run over a random base says so: %.70s",
          strstr(text, "base_model_name") ? strstr(text, "base_model_name") : text);
}

/* A LoRA run over a --load'ed base, interrupted after step 2 and resumed with --resume alone:
   the base comes back from the directory the checkpoint names and steps 3-4 log the
   uninterrupted run's; over another base of the same architecture (or without a recorded
   base) the resume is refused naming both. */
static void test_lora_resume_loaded_base(results *r) {
    static const char *const run = "--load tests/hf/llama --lora-r 2 -b 2 -t 8 --max-steps 4 "
                                   "--eval-every 0 --sample-tokens 1 --lr 0.05";
    char args[512], out[8192], shown[512];
    system("rm -rf build/lora-base build/lora-other-base");
    snprintf(args, sizeof args, "%s --log build/lora-base-a.jsonl", run);
    int a = run_capture(args, out, sizeof out);
    snprintf(args, sizeof args, "%s --save-every 2 --out build/lora-base --max-steps 4", run);
    int saved = run_capture(args, out, sizeof out);
    int b = run_capture("--resume build/lora-base/step-2 --log build/lora-base-b.jsonl", out, sizeof out);
    int same = a == 0 && saved == 0 && b == 0 &&
               strstr(out, "loaded the weights of tests/hf/llama") &&
               logs_agree("build/lora-base-a.jsonl", "build/lora-base-b.jsonl", shown, sizeof shown);
    check(r, same, "LoRA over --load tests/hf/llama, resumed with --resume alone: the base from the "
          "checkpoint's record, steps 3-4 log the uninterrupted run's (%s)", shown);
    /* another base: the same model trained one step at a large learning rate */
    int other = run_capture("--load tests/hf/llama -b 2 -t 8 --max-steps 1 --eval-every 0 "
                            "--sample-tokens 1 --lr 0.5 --warmup-steps 0 --out build/lora-other-base",
                            out, sizeof out);
    if (other != 0) check(r, 0, "could not write another base: %.200s", out);
    else expect_cli(r, "--resume build/lora-base/step-2 --load build/lora-other-base/step-1", 2,
                    "its adapters were trained over base tests/hf/llama (hash ");
}

/* Forward and backward of a model with adapters on every target (r 2, alpha 3), dropout off and
   with a fixed mask, against PyTorch (tests/make_lora_reference.py, float64 written as float32). */
static void test_lora_reference(results *r, const char *config_name, int percent) {
    char path[256];
    snprintf(path, sizeof path, "tests/reference/lora-%s-p%d.bin", config_name, percent);
    ref_file rf = {NULL, 0};
    lg_config cfg;
    if (ref_load(&rf, path) != 0) { check(r, 0, "%s: cannot read", path); return; }
    if (load_config_or_fail(r, &cfg, config_name)) return;
    cfg.lora.r = 2;
    cfg.lora.alpha = 3.0f;
    cfg.lora.dropout = percent / 100.0f;
    cfg.lora.targets = lora_targets_of(&cfg);
    int B = 2, T = (int)(ref_find(&rf, "idx")->count / 2);
    lg_model m;
    lg_error err;
    if (lg_model_create(&m, &cfg, B, T, &err)) { check(r, 0, "%s", err.msg); ref_free(&rf); return; }
    int found = ref_fill(&rf, &m.frozen_table, m.frozen) + ref_fill(&rf, &m.param_table, m.params);
    int wanted = m.frozen_table.n_tensors + m.param_table.n_tensors;
    m.dropout_key = 0x1234567ull; /* the mask tests/make_lora_reference.py reproduces */
    ref_errors e = reference_errors(&m, &rf, B, T);
    check(r, found == wanted && e.loss_err < 1e-4 && e.logits_err < 1e-4 && e.grads_err < 1e-3,
          "%-12s LoRA dropout %.2f vs PyTorch: %d tensors by name, loss %.6f (rel err %.1e), "
          "logits %.1e, adapter gradients worst %.1e in %s", config_name, cfg.lora.dropout, found,
          e.loss, e.loss_err, e.logits_err, e.grads_err, e.worst);
    lg_model_free(&m);
    ref_free(&rf);
}

/* The PEFT files, read by an independent reader (tests/check_peft.py, Python's standard library)
   that applies them to the base Hugging Face directory by PEFT's rules, give the trainer's
   merged model: GPT-2's Conv1D and fused c_attn, GPT-NeoX's interleaved query_key_value, Llama's
   separate projections, Falcon's multi-query query_key_value. */
static void test_lora_peft_files(results *r) {
    static const char *const dirs[4] = {"gpt2", "pythia", "llama", "falcon"};
    mkdir("out", 0755);
    for (int k = 0; k < 4; k++) {
        char args[512], out[128];
        snprintf(out, sizeof out, "out/test-lora-peft-%s", dirs[k]);
        snprintf(args, sizeof args, "--load tests/hf/%s --lora-r 2 --lora-alpha 5 --lora-targets "
                 "q,v,proj,mlp%s -p 32-true --max-steps 2 -b 2 -t 8 --lr 0.05 --eval-every 0 "
                 "--sample-tokens 1 --out %s", dirs[k], k ? ",head" : "" /* GPT-2: tied */, out);
        expect_cli(r, args, 0, "saved");
        snprintf(args, sizeof args, "tests/check_peft.py tests/hf/%s %s/step-2", dirs[k], out);
        expect_program(r, "python3", args, 0, "ok: ");
    }
    /* the default bf16-mixed: the reader's tolerance is bf16's, and the adapters (no warmup,
       4 steps) move the weights past it, so a merge without them would fail */
    expect_cli(r, "--load tests/hf/pythia --lora-r 2 --lora-alpha 16 --lora-targets "
               "q,v,proj,mlp,head --max-steps 4 --warmup-steps 0 -b 2 -t 8 --lr 0.05 "
               "--eval-every 0 --sample-tokens 1 --out out/test-lora-peft-bf16", 0, "saved");
    expect_program(r, "python3", "tests/check_peft.py tests/hf/pythia out/test-lora-peft-bf16/step-4",
                   0, "for bf16-mixed; the adapters moved");
}

/* Trainable parameters of q+v adapters equal LitGPT's published counts (LORA.md). */
static void test_lora_trainable_counts(results *r) {
    static const struct { const char *config; int rank; size_t published; } rows[] = {
        {"Llama-2-7b-hf", 8, 4194304}, {"falcon-7b", 8, 3506176}, {"falcon-7b", 32, 14024704}};
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        lg_config cfg;
        if (load_config_or_fail(r, &cfg, rows[i].config)) continue;
        cfg.lora.r = rows[i].rank;
        cfg.lora.alpha = 16;
        cfg.lora.targets = LG_LORA_QUERY | LG_LORA_VALUE;
        size_t n = lg_params_layout(&cfg, lg_no_buf(), NULL, NULL);
        check(r, n == rows[i].published, "%-13s LoRA r %d on q, v: %zu trainable parameters "
              "(LitGPT: %zu)", rows[i].config, rows[i].rank, n, rows[i].published);
    }
}

/* LitGPT's published LoRA and QLoRA peaks (LORA.md) against the plan of the same runs: make
   lora-memory's table, every row planned below LitGPT's measurement. */
static void test_lora_published_memory(results *r) {
    expect_program(r, "./tools/lora_memory", "", 0, "9 of 9 rows planned below LitGPT's measured peak");
}

/* One QLoRA run of test_lora_head_tiles: its losses (steps), its adapters (n, LG_MALLOC'd,
   the caller frees; NULL when it did not train), the elements of its nf4.dequantized scratch,
   and whether its arenas are exactly its plan. */
static lg_real *lora_tiles_run(const lg_config *cfg, const lg_args *a, int T, int steps,
                               double *losses, size_t *n, size_t *scratch, int *as_planned) {
    lg_trainer tr;
    lg_error err;
    if (create_counting(&tr, cfg, a, T, &err) != 0) { printf("    %s\n", err.msg); return NULL; }
    const lg_region *d = lg_plan_find(&tr.plan.ranks[0], "nf4.dequantized");
    *scratch = d ? d->count : 0;
    *as_planned = arenas_equal_plan(&tr);
    lg_loader ld;
    builtin_loader(&ld, cfg, T, 5, (size_t)(steps + 1) * a->micro_batch_size * T + 1, a->seed);
    int rc = run_step_range(&tr, &ld, 0, steps, losses);
    lg_loader_close(&ld);
    lg_real *w = rc == 0 ? trained_weights(&tr) : NULL;
    *n = tr.ranks[0].model.n_params;
    lg_trainer_free(&tr);
    return w;
}

/* QLoRA's NF4 lm_head a vocabulary tile at a time (lg_lora.head_tile_rows) gives bitwise the
   losses and adapters of the whole head dequantized at once: test-llama with a vocabulary of
   1250 (padded 1280), tiles of 512 rows (two whole, a last one of 256) against one tile that
   holds the head, nf4 and nf4-dq, bf16-mixed and fp32, the head in one pass and in chunks of 5
   rows (their logits computed again in the backward), adapters on every linear and the head,
   dropout on. The scratch is a tile (512 x 16) rather than the head (1280 x 16), as planned
   and allocated; a tile that splits the gemm's K blocks is refused, naming the setting. */
static void test_lora_head_tiles(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    cfg.vocab_size = 1250;
    cfg.padded_vocab_size = 1280;
    const int steps = 3, T = 12, tiles[2] = {3 * LG_HEAD_TILE_ALIGN, LG_HEAD_TILE_ALIGN};
    for (int q = LG_QUANTIZE_NF4; q <= LG_QUANTIZE_NF4_DQ; q++)
        for (int v = 0; v < 3; v++) { /* bf16-mixed whole, bf16-mixed in chunks, fp32 in chunks */
            double losses[2][3] = {{0}};
            lg_real *w[2];
            size_t scratch[2], n = 0;
            int planned[2];
            lg_args a = lora_args(4, 0.1f);
            a.precision = v == 2 ? LG_PRECISION_32_TRUE : LG_PRECISION_BF16_MIXED;
            a.lora.quantize = (lg_quantization)q;
            a.head_rows = v ? 5 : 0;
            for (int k = 0; k < 2; k++) {
                a.lora.head_tile_rows = tiles[k];
                w[k] = lora_tiles_run(&cfg, &a, T, steps, losses[k], &n, &scratch[k], &planned[k]);
            }
            int same = w[0] && w[1] && memcmp(w[0], w[1], n * sizeof(lg_real)) == 0 &&
                       memcmp(losses[0], losses[1], sizeof losses[0]) == 0;
            check(r, same && scratch[0] == 1280 * 16 && scratch[1] == 512 * 16 && planned[0] &&
                  planned[1], "test-llama vocab 1280 %-6s %-10s head %s: tiles of 512 rows = "
                  "the whole head, bitwise (losses %.6f .. %.6f, %zu adapter values); scratch "
                  "%zu elements, not %zu, arenas as planned", lg_quantization_name(a.lora.quantize),
                  lg_precision_name(a.precision), v ? "in chunks of 5" : "whole", losses[1][0],
                  losses[1][steps - 1], n, scratch[1], scratch[0]);
            LG_FREE(w[0]);
            LG_FREE(w[1]);
        }
    lg_args a = lora_args(4, 0.1f);
    a.lora.quantize = LG_QUANTIZE_NF4;
    a.lora.head_tile_rows = 100;
    lg_trainer tr;
    lg_error err;
    int refused = lg_trainer_create(&tr, &cfg, &a, T, &err) != 0;
    if (!refused) lg_trainer_free(&tr);
    check(r, refused && strstr(err.msg, "head_tile_rows 100 is not a multiple of 512"),
          "a head tile of 100 rows is refused: %s", refused ? err.msg : "(created)");
}

static void test_lora_all(results *r) {
    printf("LoRA and QLoRA\n");
    for (int c = 0; c < 3; c++) {
        test_lora_reference(r, lora_configs[c], 0);
        test_lora_reference(r, lora_configs[c], 25);
    }
    test_lora_reference(r, "test-falcon", 0); /* one norm for both branches, multi-query */
    test_lora_reference(r, "test-falcon", 25);
    test_lora_starts_from_base(r);
    test_lora_frozen(r);
    test_lora_trains(r);
    test_lora_equivalences(r);
    test_lora_accumulation(r);
    test_lora_merged_and_resume(r);
    test_lora_host_embedding_files(r);
    test_lora_plan(r);
    test_lora_sharded_frozen_files(r);
    test_lora_cli(r);
    test_lora_resume_loaded_base(r);
    test_lora_peft_files(r);
    test_lora_trainable_counts(r);
    test_lora_published_memory(r);
}
