/* Issue 25's levers for long context and large models: plans for the GPU a run will use, made
   from any machine, and the fit check's verdict for scripts. Included by tests/test.c. */

/* --plan for GPUs from a machine without one (the runtime's share estimated), --plan's exit
   codes and JSON verdict, --host-memory-limit, --lora-targets all. */
static void test_plan_for_gpus(results *r) {
    static char out[1 << 20];
    const char *llama8b = "-c Meta-Llama-3-8B -t 2048 -b 1 -p bf16-true";
    char args[512];
    snprintf(args, sizeof args, "--plan --backend cuda %s", llama8b);
    expect_cli(r, args, 0, "cuda.runtime: 856.0 MiB, an estimate (no GPU here");
    expect_cli(r, args, 0, "fits: not checked");
    snprintf(args, sizeof args, "--plan --backend cuda %s --memory-limit 80GiB", llama8b);
    expect_cli(r, args, 0, "fits: yes");
    snprintf(args, sizeof args, "--plan --backend cuda %s --memory-limit 24GiB", llama8b);
    expect_cli(r, args, 3, "cheapest change that fits");
    /* the estimate's figures (LG_CUDA_*_ESTIMATE): context 600 MiB and cuBLASLt 256 MiB, then
       512 MiB for each communicator; -d 2 full-shard joins 2 (shards, weights gathered) */
    const size_t one = (size_t)(600 + 256) << 20, two = one + ((size_t)2 * 512 << 20);
    char want[160];
    snprintf(args, sizeof args, "--plan=json --backend cuda %s --memory-limit 24GiB 2>/dev/null",
             llama8b);
    int code = run_stdout(args, out, sizeof out);
    snprintf(want, sizeof want, "\"name\":\"cuda.runtime\",\"group\":\"workspace\",\"pool\":\"device\","
             "\"dtype\":\"u8\",\"count\":%zu", one);
    const char *runtime = strstr(out, want);
    check(r, code == 3 && one_json_document(out) && strstr(out, "\"micro_batch_size\":1,"
          "\"max_seq_length\":2048,") && strstr(out, "\"limit_bytes\":25769803776,") &&
          strstr(out, "\"fits\":false") && runtime, "--plan=json --backend cuda, 8B in 24 GiB: "
          "exit 3 (%d), limit_bytes, fits false, the chosen -b and -t, cuda.runtime %zu bytes",
          code, one);
    snprintf(args, sizeof args, "--plan=json --backend cuda %s -d 2 --memory-limit 80GiB "
             "2>/dev/null", llama8b);
    code = run_stdout(args, out, sizeof out);
    snprintf(want, sizeof want, "\"name\":\"cuda.runtime\",\"group\":\"workspace\",\"pool\":\"device\","
             "\"dtype\":\"u8\",\"count\":%zu", two);
    check(r, code == 0 && strstr(out, "\"fits\":true") && strstr(out, want),
          "--plan=json --backend cuda -d 2 full-shard: fits true, cuda.runtime %zu bytes (2 "
          "communicators' estimate)", two);
    expect_cli(r, "--backend cuda --max-steps 1", 2, "--backend cuda: this build has no CUDA "
               "backend");
    expect_cli(r, "--plan --backend tpu", 2, "--backend: 'tpu' is not cpu or cuda");
    /* host memory: on a GPU its own limit; on the CPU backend a cap on the one memory too */
    expect_cli(r, "--plan --backend cuda -c pythia-160m --offload --memory-limit 80GiB "
               "--host-memory-limit 100MiB", 3, "host pools need");
    expect_cli(r, "--plan --backend cuda -c pythia-160m --offload --memory-limit 80GiB "
               "--host-memory-limit 100MiB", 3, "but 100.0 MiB is available (--host-memory-limit)");
    expect_cli(r, "--plan -c pythia-160m --memory-limit 64GiB --host-memory-limit 100MiB", 3,
               "but 100.0 MiB is available (--host-memory-limit)");
    expect_cli(r, "--plan -c pythia-160m --memory-limit 100MiB --host-memory-limit 64GiB", 3,
               "but 100.0 MiB is available (--memory-limit)");
    expect_cli(r, "--plan --host-memory-limit 1", 2, "--host-memory-limit: '1' is not a size");
    /* --lora-targets all: every linear but the head */
    unsigned all, listed;
    lg_error err;
    char name[64];
    int rc = lg_lora_targets_parse("all", &all, &err) | lg_lora_targets_parse("q,k,v,proj,mlp", &listed, &err);
    check(r, rc == 0 && all == listed && !(all & LG_LORA_HEAD) &&
          strcmp(lg_lora_targets_name(all, name, sizeof name), "q,k,v,proj,mlp") == 0,
          "--lora-targets all is q,k,v,proj,mlp (%s)", name);
    expect_cli(r, "--plan -c test-llama -t 16 --lora-r 4 --lora-targets all", 0, "q,k,v,proj,mlp");
}


/* README's context table is make context-table's output, line for line. */
static void test_context_table_in_readme(results *r) {
    static char out[8192], readme[1 << 17];
    int code = run_command("./tools/context_table", out, sizeof out);
    FILE *f = fopen("README.md", "r");
    size_t n = f ? fread(readme, 1, sizeof readme - 1, f) : 0;
    readme[n] = '\0';
    if (f) fclose(f);
    int rows = 0, found = 0;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
        if (line[0] != '|') continue;
        rows++;
        found += strstr(readme, line) != NULL;
    }
    check(r, code == 0 && rows == 9 && found == rows, "README's longest-context table is the "
          "planner's (tools/context_table): %d of %d lines", found, rows);
}

/* The host traffic of a step (lg_plan_host_traffic_bytes) from the model's sizes: --offload
   moves the gradients down and the weights up (fp32: 4 bytes a parameter each way);
   --offload activations moves each kept block output (B, T, C), all blocks but the last, down
   and up in every micro-batch. */
static void test_host_traffic(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    lg_args a;
    lg_args_default(&a);
    a.backend = LG_BACKEND_CUDA;
    a.precision = LG_PRECISION_32_TRUE;
    a.micro_batch_size = 2;
    a.global_batch_size = 4; /* 2 micro-batches */
    a.offload = a.recompute = a.offload_activations = 1;
    const int T = 16;
    size_t n = lg_params_layout(&cfg, lg_no_buf(), NULL, NULL);
    size_t want = 2 * 4 * n + (size_t)2 * 2 * (cfg.n_layer - 1) * 2 * T * cfg.n_embd * 4;
    lg_plan_spec spec;
    lg_plan plan;
    lg_error err;
    lg_plan_spec_from_args(&spec, &a, T);
    if (lg_plan_make(&plan, &cfg, &spec, &err) != 0) { check(r, 0, "%s", err.msg); return; }
    size_t got = lg_plan_host_traffic_bytes(&plan);
    lg_plan_free(&plan);
    a.offload = a.offload_activations = 0;
    lg_plan_spec_from_args(&spec, &a, T);
    size_t none = 1;
    if (lg_plan_make(&plan, &cfg, &spec, &err) == 0) {
        none = lg_plan_host_traffic_bytes(&plan);
        lg_plan_free(&plan);
    }
    check(r, got == want && none == 0, "host traffic of a step with --offload and --offload "
          "activations: %zu bytes (from the sizes: %zu); none without (%zu)", got, want, none);
    expect_cli(r, "--plan --backend cuda -c test-llama -t 16 -b 2 -g 4 -p 32-true --offload "
               "--memory-limit 1GiB", 0, "host <-> device:");
}

/* -t auto against a limit made from the planner: the longest T whose plan fits, found here by
   a walk up from T = 300 (the library searches by halves), for a model without data (capped at
   block_size), for the built-in task's samples (capped at their longest), and with no limit
   to fit (--plan --backend cuda here: the cap). */
static void test_auto_seq_length(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "pythia-14m")) return;
    lg_args a;
    lg_args_default(&a);
    a.micro_batch_size = 1;
    a.precision = LG_PRECISION_BF16_TRUE;
    size_t limit = lg_plan_checked_bytes_for(&cfg, &a, 300);
    int want = 300;
    while (want < cfg.block_size && lg_plan_checked_bytes_for(&cfg, &a, want + 1) <= limit) want++;
    char args[256], expect[128];
    snprintf(args, sizeof args, "--plan -c pythia-14m -b 1 -p bf16-true -t auto --memory-limit %zuB",
             limit);
    snprintf(expect, sizeof expect, "-t auto: %d tokens, the longest up to block_size 512 that "
             "fits", want);
    expect_cli(r, args, 0, expect);
    snprintf(expect, sizeof expect, "T %d tokens", want);
    expect_cli(r, args, 0, expect);
    expect_cli(r, "--plan -t auto", 0, "-t auto: 18 tokens, the longest sample, which limits it");
    expect_cli(r, "--plan -c pythia-14m -t auto --backend cuda", 0,
               "-t auto: 512 tokens, block_size (no GPU here to measure");
    expect_cli(r, "--plan -c pythia-14m -t auto --memory-limit 1MiB", 3,
               "-t auto: not even 1 token fits in 1.0 MiB");
    expect_cli(r, "--plan -t autox", 2, "-t/--max-seq-length: 'autox' is not an integer");
}
