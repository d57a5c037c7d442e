/* Issue 25's levers for long context and large models: plans for the GPU a run will use, made
   from any machine, and the fit check's verdict for scripts. Included by tests/test.c. */

/* --plan for GPUs from a machine without one (the runtime's share estimated), --plan's exit
   codes and JSON verdict, --host-memory-limit, --lora-targets all. */
static void test_plan_for_gpus(results *r) {
    static char out[1 << 20];
    const char *llama8b = "-c Meta-Llama-3-8B -t 2048 -b 1 -p bf16-true";
    char args[512];
    snprintf(args, sizeof args, "--plan --backend cuda %s", llama8b);
    expect_cli(r, args, 0, "an estimate for the largest of the named cards (no GPU here");
    expect_cli(r, args, 0, "fits: not checked");
    snprintf(args, sizeof args, "--plan --backend cuda %s --memory-limit 80GiB", llama8b);
    expect_cli(r, args, 0, "fits: yes");
    snprintf(args, sizeof args, "--plan --backend cuda %s --memory-limit 24GiB", llama8b);
    expect_cli(r, args, 3, "cheapest change that fits");
    /* no card named: the largest card's estimate, then LG_NCCL_COMM_ESTIMATE for each
       communicator; -d 2 full-shard joins 2 (shards, weights gathered) */
    lg_cuda_runtime_parts parts[2];
    lg_cuda_runtime_estimate_parts(NULL, 0, &parts[0]);
    lg_cuda_runtime_estimate_parts(NULL, 2, &parts[1]);
    const size_t one = lg_cuda_runtime_parts_sum(&parts[0]), two = lg_cuda_runtime_parts_sum(&parts[1]);
    check(r, two == one + 2 * LG_NCCL_COMM_ESTIMATE, "2 communicators add 2 x %zu bytes",
          (size_t)LG_NCCL_COMM_ESTIMATE);
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


/* The number in a table row after its bar-th '|' (0 when there is none). */
static int table_cell(const char *line, int bar) {
    const char *at = line;
    for (int k = 0; k < bar && at; k++) at = strchr(at + 1, '|');
    return at ? atoi(at + 1) : 0;
}

/* The exit code of ./train --plan for a context table cell: Unsloth's setup at T tokens on the
   card, with the head in chunks and the MLP in slices (the planner's choice) and these parts
   offloaded. */
static int cell_plan_exit(const char *card, int T, const char *offload) {
    static char out[8192];
    char args[512];
    snprintf(args, sizeof args, "--plan --gpu %s -c Llama-3.1-8B -t %d -b 1 -p bf16-true "
             "--lora-r 32 --lora-targets all --quantize nf4 --recompute block --offload %s "
             "--host-memory-limit 64GiB > /dev/null 2>&1", card, T, offload);
    return run_stdout(args, out, sizeof out);
}

/* README's context table is make context-table's output, line for line. */
static void test_context_table_in_readme(results *r) {
    static char out[8192], readme[1 << 17];
    int code = run_command("./tools/context_table", out, sizeof out);
    FILE *f = fopen("README.md", "r");
    size_t n = f ? fread(readme, 1, sizeof readme - 1, f) : 0;
    readme[n] = '\0';
    if (f) fclose(f);
    int rows = 0, found = 0, rtx4090 = 0, rtx4060 = 0;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
        if (line[0] != '|') continue;
        rows++;
        found += strstr(readme, line) != NULL;
        if (strncmp(line, "| RTX 4090 ", 11) == 0) rtx4090 = table_cell(line, 6); /* --offload
                                                                         activations */
        if (strncmp(line, "| RTX 4060 (", 12) == 0) rtx4060 = table_cell(line, 8); /* + weights */
    }
    check(r, code == 0 && rows >= 10 && found == rows, "README's longest-context table is the "
          "planner's (tools/context_table): %d of %d lines", found, rows);
    /* a cell is what ./train --plan --gpu says: that length fits the card, one more does not */
    int verdict[2];
    for (int k = 0; k < 2; k++) verdict[k] = cell_plan_exit("rtx4090", rtx4090 + k, "activations");
    check(r, rtx4090 > 0 && verdict[0] == 0 && verdict[1] == 3, "the table's RTX 4090 cell with "
          "--offload activations, %d tokens: ./train --plan --gpu rtx4090 fits it (exit %d), not "
          "one token more (exit %d)", rtx4090, verdict[0], verdict[1]);
    for (int k = 0; k < 2; k++)
        verdict[k] = cell_plan_exit("rtx4060", rtx4060 + k, "activations,weights");
    check(r, rtx4060 > 2972 && verdict[0] == 0 && verdict[1] == 3, "the table's 8 GB row (RTX "
          "4060) with --offload weights, %d tokens, past Unsloth's 2,972: ./train --plan --gpu "
          "rtx4060 fits it (exit %d), not one token more (exit %d)", rtx4060, verdict[0], verdict[1]);
}

/* A number after "key": in the JSON object that starts at from; 0 when absent. */
static size_t json_size_after(const char *from, const char *key) {
    char quoted[64];
    snprintf(quoted, sizeof quoted, "\"%s\":", key);
    const char *at = from ? strstr(from, quoted) : NULL;
    return at ? (size_t)strtoull(at + strlen(quoted), NULL, 10) : 0;
}

/* The CUDA runtime's estimate per card (lg_cuda_runtime_estimate_parts): --plan=json --gpu
   carries its parts; the context grows with the card's resident threads, our kernels' code is
   the image the card runs, the parts sum to the plan's cuda.runtime region; a plan with no card
   named takes the largest card's; the text plan names each part. */
static void test_runtime_estimate_per_card(results *r) {
    static char out[1 << 16];
    const char *names[3] = {"l4", "rtx4090", "h100"}; /* 58, 128, 132 SMs */
    const char *images[3] = {"\"own_image\":\"sm_80 SASS\"", "\"own_image\":\"sm_80 SASS\"",
                             "\"own_image\":\"sm_90 SASS\""};
    size_t context[3] = {0}, sums[3] = {0};
    for (int k = 0; k < 3; k++) {
        char args[256];
        const lg_gpu_card *card = lg_gpu_card_named(names[k]);
        snprintf(args, sizeof args, "--plan=json --gpu %s -c test-llama -t 16 2>/dev/null", names[k]);
        int code = run_stdout(args, out, sizeof out);
        const char *parts = strstr(out, "\"runtime_estimate\":{");
        const char *region = strstr(out, "\"name\":\"cuda.runtime\"");
        size_t threads = (size_t)card->sms * (size_t)card->threads_per_sm;
        size_t local = LG_CUDA_STACK_FRAME_MAX > LG_CUDA_DEFAULT_STACK_BYTES
                           ? threads * (LG_CUDA_STACK_FRAME_MAX - LG_CUDA_DEFAULT_STACK_BYTES) : 0;
        context[k] = json_size_after(parts, "context");
        sums[k] = context[k] + json_size_after(parts, "local") +
                  json_size_after(parts, "own_kernels") + json_size_after(parts, "cublaslt") +
                  json_size_after(parts, "nccl");
        check(r, code == 0 && parts && context[k] == threads * LG_CUDA_CONTEXT_BYTES_PER_THREAD &&
              strstr(parts, images[k]) &&
              json_size_after(parts, "cublaslt_eager") > json_size_after(parts, "cublaslt") &&
              json_size_after(parts, "local") == local &&
              json_size_after(parts, "own_kernels") > ((size_t)1 << 20) &&
              json_size_after(parts, "cublaslt") > LG_CUBLASLT_HANDLE_ESTIMATE &&
              json_size_after(region, "count") == sums[k],
              "--plan=json --gpu %s: the runtime estimate's parts (context %zu B for %d SMs x %d "
              "threads, local %zu B, %s, cuBLASLt's lazy share under its eager code), summed "
              "%zu B = the plan's cuda.runtime", names[k], context[k], card->sms,
              card->threads_per_sm, local, images[k], sums[k]);
    }
    check(r, context[0] < context[1] && context[1] < context[2], "the context estimate grows with "
          "the card's resident threads: L4 %zu < RTX 4090 %zu < H100 %zu bytes", context[0],
          context[1], context[2]);
    int code = run_stdout("--plan=json --backend cuda -c test-llama -t 16 2>/dev/null", out, sizeof out);
    size_t unnamed = json_size_after(strstr(out, "\"name\":\"cuda.runtime\""), "count");
    check(r, code == 0 && unnamed >= sums[0] && unnamed >= sums[1] && unnamed >= sums[2],
          "--plan --backend cuda with no card named: the largest card's estimate (%zu B)", unnamed);
    size_t sm80 = lg_cuda_lazy_code_bytes(8, 0), sm86 = lg_cuda_lazy_code_bytes(8, 6);
    size_t unmeasured = lg_cuda_lazy_code_bytes(7, 5);
    check(r, sm80 == sm86 && sm80 > 0 && unmeasured >= lg_cuda_lazy_code_bytes(9, 0) &&
          unmeasured >= lg_cuda_lazy_code_bytes(12, 0), "the code loaded lazily: sm_86 runs "
          "sm_80's image (%zu B each), an architecture not measured gets the largest figures (%zu B)",
          sm80, unmeasured);
    expect_cli(r, "--plan --gpu rtx4090 -c test-llama -t 16", 0, "an estimate for RTX 4090 (no "
               "GPU here to measure it): context 408.0 MiB, local memory beyond the default stack");
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
               "--memory-limit 2GiB", 0, "host <-> device:");
}

/* The plan's step FLOPs for args a (T tokens a row) on cfg; -1 when it does not plan. */
static double step_flops_of(const lg_config *cfg, const lg_args *a, int T) {
    lg_plan_spec spec;
    lg_plan plan;
    lg_error err;
    lg_plan_spec_from_args(&spec, a, T);
    if (lg_plan_make(&plan, cfg, &spec, &err) != 0) return -1;
    double flops = lg_plan_step_flops(&plan);
    lg_plan_free(&plan);
    return flops;
}

/* The step's FLOPs (lg_plan_step_flops) from the model's tensor table: test-llama, 2
   micro-batches of 2 x 16 tokens. Every weight trained: 6 x tokens x the block linears' and the
   head's matrices (forward, input and weight gradients), plus causal attention's 2 x 2 x B x
   heads x head_size x T (T + 1) / 2 a block, 3 times (forward, backward twice);
   --recompute block adds the blocks' forward once more; LoRA on q and v (r 2): the frozen
   matrices lose their weight gradients and the adapters (r x (in + out)) add 6 x tokens;
   --head-rows 5 adds the head's forward again. */
static void test_step_flops(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    const int T = 16, B = 2, micro = 2;
    lg_tensor_table table;
    if (lg_table_alloc(&table, &cfg) != 0) return;
    lg_params_layout(&cfg, lg_no_buf(), NULL, &table);
    double blocks = 0, head = (double)cfg.padded_vocab_size * cfg.n_embd, tokens = (double)B * T;
    for (int i = 0; i < table.n_tensors; i++) {
        const lg_tensor_info *t = &table.tensors[i];
        if (t->block >= 0 && (t->kind == LG_TENSOR_WEIGHT || t->kind == LG_TENSOR_RESIDUAL))
            blocks += (double)t->count;
    }
    lg_tensor_table_free(&table);
    double attention = 2.0 * 2 * B * cfg.n_head * cfg.head_size * T * (T + 1) / 2 * cfg.n_layer;
    double adapters = 2.0 * cfg.n_layer * (cfg.n_embd + cfg.n_head * cfg.head_size) +
                      2.0 * cfg.n_layer * (cfg.n_embd + cfg.n_query_groups * cfg.head_size);
    lg_args a;
    lg_args_default(&a);
    a.backend = LG_BACKEND_CUDA;
    a.micro_batch_size = B;
    a.global_batch_size = B * micro;
    double full = step_flops_of(&cfg, &a, T);
    double want_full = micro * (6 * tokens * (blocks + head) + 3 * attention);
    a.recompute = 1;
    double recompute = step_flops_of(&cfg, &a, T);
    double want_recompute = want_full + micro * (2 * tokens * blocks + attention);
    a.recompute = 0;
    a.lora.r = 2;
    a.lora.targets = LG_LORA_QUERY | LG_LORA_VALUE;
    double lora = step_flops_of(&cfg, &a, T);
    double want_lora = micro * (4 * tokens * (blocks + head) + 6 * tokens * adapters + 3 * attention);
    a.head_rows = 5;
    double chunked = step_flops_of(&cfg, &a, T);
    double want_chunked = want_lora + micro * 2 * tokens * head;
    check(r, fabs(full - want_full) <= 1e-12 * want_full &&
          fabs(recompute - want_recompute) <= 1e-12 * want_recompute &&
          fabs(lora - want_lora) <= 1e-12 * want_lora && fabs(chunked - want_chunked) <= 1e-12 * want_chunked,
          "the step's FLOPs from the tensor table: every weight %.6g (want %.6g), + recompute "
          "%.6g (%.6g), LoRA q,v r 2 %.6g (%.6g), + head chunks %.6g (%.6g)", full, want_full,
          recompute, want_recompute, lora, want_lora, chunked, want_chunked);
    expect_cli(r, "--plan --backend cuda -c test-llama -t 16 -b 2 -g 4 -p 32-true --offload "
               "--memory-limit 2GiB", 0, "hidden behind the compute at best, on a card that "
               "sustains at most");
}

/* A GPU's matmul workspace holds one sequence's attention statistic D (n_head, T) fp32,
   which the backward keeps there: 32 MiB up to 2,097,152 tokens at 4 heads (262,144 at 32),
   past that D's own size, so that no length aborts in the backward. */
static void test_cuda_workspace_sized(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    lg_args a;
    lg_args_default(&a);
    a.backend = LG_BACKEND_CUDA;
    a.micro_batch_size = 1;
    cfg.block_size = 1 << 22;
    const int lengths[3] = {16, 2097152, 3000000};
    size_t got[3] = {0, 0, 0}, want[3];
    for (int k = 0; k < 3; k++) {
        size_t d = (size_t)4 * cfg.n_head * lengths[k];
        want[k] = d > ((size_t)32 << 20) ? (d + 63) / 64 * 64 : (size_t)32 << 20;
        lg_plan_spec spec;
        lg_plan plan;
        lg_error err;
        lg_plan_spec_from_args(&spec, &a, lengths[k]);
        if (lg_plan_make(&plan, &cfg, &spec, &err) != 0) { check(r, 0, "%s", err.msg); return; }
        got[k] = lg_plan_find(&plan.ranks[0], "cuda.matmul_workspace")->bytes;
        lg_plan_free(&plan);
    }
    check(r, got[0] == want[0] && got[1] == want[1] && got[2] == want[2] && got[2] > got[1],
          "the GPU's matmul workspace holds attention's D of one sequence (%d heads): %zu, %zu, "
          "%zu bytes at T %d, %d, %d (from the sizes: %zu, %zu, %zu)", cfg.n_head, got[0], got[1],
          got[2], lengths[0], lengths[1], lengths[2], want[0], want[1], want[2]);
}

/* --gpu NAME plans for a card from any machine: the memory it reports as the limit, its
   compute capability and shared memory in the JSON, the runtime estimated; --gpu list names
   every card; a card older than sm_80, an unknown name and --gpu without --plan are refused.
   The margin: a GPU plan fits when what it counts plus the margin (1% of the limit or 256 MiB,
   or --memory-margin) is within the limit, to the byte. */
static void test_gpu_cards_and_margin(results *r) {
    static char out[1 << 20];
    char args[512], want[256];
    int listed = 0;
    run_stdout("--gpu list", out, sizeof out);
    for (int i = 0; i < lg_gpu_card_count(); i++) {
        snprintf(want, sizeof want, "\n%-10s ", lg_gpu_card_at(i)->name);
        listed += strstr(out, want) != NULL;
    }
    check(r, listed == lg_gpu_card_count() && listed >= 13, "--gpu list names each of the %d "
          "cards (%d found)", lg_gpu_card_count(), listed);
    /* all rows at once and the token embedding in host memory (else the planner would chunk
       the head, or move the table, to fit a byte short) */
    const char *run = "-c Llama-3.1-8B -t 2048 -b 1 -p bf16-true --lora-r 32 --lora-targets all "
                      "--quantize nf4 --recompute block --head-rows 2048 --slice-rows 2048 "
                      "--offload embedding";
    const struct { const char *name, *arch; size_t mib; } cards[3] = {
        {"rtx4090", "sm_89", 24564}, {"a10", "sm_86", 23028}, {"h100", "sm_90", 81559}};
    for (int k = 0; k < 3; k++) {
        snprintf(args, sizeof args, "--plan=json --gpu %s %s 2>/dev/null", cards[k].name, run);
        int code = run_stdout(args, out, sizeof out);
        size_t limit = cards[k].mib << 20, margin = limit / 100 > ((size_t)256 << 20)
                                                        ? limit / 100 : (size_t)256 << 20;
        snprintf(want, sizeof want, "\"limit_bytes\":%zu,\"host_limit_bytes\":", limit);
        char gpu[128];
        snprintf(gpu, sizeof gpu, "\"gpu\":\"%s\",\"arch\":\"%s\",", cards[k].name, cards[k].arch);
        char margin_text[64];
        snprintf(margin_text, sizeof margin_text, "\"margin_bytes\":%zu,", margin);
        check(r, code == 0 && one_json_document(out) && strstr(out, want) && strstr(out, gpu) &&
              strstr(out, margin_text) && strstr(out, "\"fits\":true"),
              "--plan=json --gpu %s: limit %zu MiB (what the card reports), %s, margin %zu bytes",
              cards[k].name, cards[k].mib, cards[k].arch, margin);
    }
    expect_cli(r, "--plan --gpu t4", 2, "--gpu t4: the T4 has compute capability 7.5, and the "
               "CUDA kernels need 8.0 or newer");
    expect_cli(r, "--plan --gpu gtx480", 2, "--gpu: 'gtx480' is not a card this planner knows");
    expect_cli(r, "--gpu rtx4090 --max-steps 1", 2, "--gpu rtx4090 plans for that card (with --plan)");
    /* the margin to the byte, from a plan's own checked bytes */
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "Llama-3.1-8B")) return;
    lg_args a;
    lg_args_default(&a);
    a.backend = LG_BACKEND_CUDA;
    a.micro_batch_size = 1;
    a.precision = LG_PRECISION_BF16_TRUE;
    a.recompute = 1;
    a.head_rows = a.slice_rows = 2048;
    a.offload_embedding = 1;
    a.lora.r = 32;
    a.lora.quantize = LG_QUANTIZE_NF4;
    lg_error err;
    lg_lora_targets_parse("all", &a.lora.targets, &err);
    lg_cuda_estimate_runtime(&a);
    size_t checked = lg_plan_checked_bytes_for(&cfg, &a, 2048), floor = (size_t)256 << 20;
    int verdicts[4];
    size_t limits[4] = {checked + floor, checked + floor - 1, checked, checked - 1};
    for (int k = 0; k < 4; k++) {
        char flags[400];
        snprintf(flags, sizeof flags, "--plan --backend cuda %s --memory-limit %zuB%s 2>&1", run,
                 limits[k], k >= 2 ? " --memory-margin 0B" : "");
        verdicts[k] = run_stdout(flags, out, sizeof out);
    }
    check(r, verdicts[0] == 0 && verdicts[1] == 3 && verdicts[2] == 0 && verdicts[3] == 3,
          "the margin: %zu bytes counted fit a limit of them + 256 MiB (exit %d), not one byte "
          "less (%d); with --memory-margin 0B the counted bytes alone (%d), not one less (%d)",
          checked, verdicts[0], verdicts[1], verdicts[2], verdicts[3]);
    expect_cli(r, "--plan --backend cuda -c test-llama -t 16 --memory-limit 2GiB", 0,
               "256.0 MiB kept free (the default margin)");
    expect_cli(r, "--plan --backend cuda -c test-llama -t 16 --memory-limit 2GiB --memory-margin "
               "1GiB", 0, "1.00 GiB kept free (--memory-margin)");
    expect_cli(r, "--plan --memory-margin lots", 2, "--memory-margin: 'lots' is not a size");
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

/* The fit check of the run a describes at T (a GPU plan: device pool and host pools). */
static lg_fit fit_at(const lg_config *cfg, const lg_args *a, int T) {
    lg_plan_spec spec;
    lg_plan plan;
    lg_fit fit;
    memset(&fit, 0, sizeof fit);
    lg_plan_spec_from_args(&spec, a, T);
    if (lg_plan_make(&plan, cfg, &spec, NULL) != 0) return fit;
    lg_plan_check_fit(&plan, a, 80ull << 30, &fit);
    lg_plan_free(&plan);
    return fit;
}

/* -t auto with --offload activations on a GPU and no --host-memory-limit: the choice and the
   fit check hold the one reading of available memory (args.host_available), with one test. It
   chose against one reading and checked against another: on a busy machine, a length the
   check refused. */
static void test_auto_seq_length_host(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "pythia-14m")) return;
    lg_args a;
    lg_args_default(&a);
    a.backend = LG_BACKEND_CUDA;
    a.micro_batch_size = 8;
    a.recompute = 1;
    a.offload_activations = 1;
    a.host_available = 1; /* first: the host pools at T 300, the reading to hold */
    a.host_available = fit_at(&cfg, &a, 300).host_bytes;
    int want = 300; /* the longest T whose host pools fit, by a scan of the plans */
    while (want < cfg.block_size && fit_at(&cfg, &a, want + 1).host_bytes <= a.host_available)
        want++;
    int t = lg_plan_auto_seq_length(&cfg, &a, cfg.block_size, 80ull << 30);
    lg_fit chosen = fit_at(&cfg, &a, t), longer = fit_at(&cfg, &a, t + 1);
    check(r, t == want && want < cfg.block_size && chosen.fits == 1 && longer.fits == 0 &&
          !longer.host_fits && chosen.host_limit == a.host_available,
          "-t auto against %zu bytes of host memory read once: %d tokens (want %d), the check "
          "passes it (host %zu) and refuses %d (host %zu)", a.host_available, t, want,
          chosen.host_bytes, t + 1, longer.host_bytes);
    char args[256], expect[256], host[32];
    snprintf(args, sizeof args, "--plan --backend cuda -c pythia-14m -b 8 -t auto --recompute "
             "block --offload activations --memory-limit 80GiB --host-memory-limit %zuB",
             a.host_available);
    snprintf(expect, sizeof expect, "-t auto: %d tokens, the longest up to block_size 512 that "
             "fits in 80.00 GiB (--memory-limit) and %s of host memory (--host-memory-limit)",
             want, lg_format_bytes(a.host_available, host, sizeof host));
    expect_cli(r, args, 0, expect);
}

/* ---- the head and loss in chunks ------------------------------------------------------------ */

/* One forward and backward of m on tokens and targets (B, T) with the head's chunks of
   head_rows rows and the MLP's slices of slice_rows; the loss, the gradients in m->grads. */
static double head_chunk_step(lg_model *m, const int *tokens, const int *targets, int B, int T,
                              int head_rows, int slice_rows) {
    int n_targets;
    m->head_rows = head_rows;
    m->slice_rows = slice_rows;
    lg_model_zero_grad(m);
    double loss = lg_model_forward(m, tokens, targets, B, T, &n_targets);
    lg_model_backward(m, tokens, targets, B, T, 1.0f / (float)n_targets);
    return loss;
}

/* The head in chunks and each block's MLP in slices of 1, 5 and 7 of 24 rows (none dividing it
   but 1), each alone and both, against one pass, fp32, with ignored targets: every family
   (GPT-2's head tied to its embedding), and LoRA on every linear with dropout (its mask the
   whole input's in every chunk and slice); block recompute on and off. */
static void test_head_chunks_model(results *r) {
    const char *names[] = {"test-gpt2", "test-pythia", "test-llama", "test-falcon", "test-llama31"};
    const int B = 2, T = 12, N = B * T, chunks[3] = {1, 5, 7};
    for (int i = 0; i < 6; i++) {
        int lora = i == 5; /* LoRA on test-llama, head included */
        lg_config cfg;
        if (load_config_or_fail(r, &cfg, lora ? "test-llama" : names[i])) return;
        if (lora) {
            cfg.lora.r = 2;
            cfg.lora.alpha = 8.0f;
            cfg.lora.dropout = 0.25f;
            cfg.lora.targets = LG_LORA_QUERY | LG_LORA_VALUE | LG_LORA_PROJECTION | LG_LORA_MLP |
                               LG_LORA_HEAD;
        }
        lg_model m;
        lg_error err;
        if (lg_model_create(&m, &cfg, B, T, &err)) { check(r, 0, "%s: %s", names[i], err.msg); return; }
        lg_rng rng;
        lg_rng_seed(&rng, 25);
        if (lora) fill_normal(reals(m.frozen), m.frozen_table.total, 0.3f, &rng);
        fill_normal(reals(m.params), m.n_params, 0.3f, &rng);
        m.dropout_key = lora ? 0x2545F4914F6CDD1Dull : 0;
        int tokens[24], targets[24];
        for (int k = 0; k < N; k++) {
            tokens[k] = (int)(lg_rng_u64(&rng) % cfg.vocab_size);
            targets[k] = k % 9 == 4 ? LG_IGNORE_INDEX : (int)(lg_rng_u64(&rng) % cfg.vocab_size);
        }
        double want_loss = head_chunk_step(&m, tokens, targets, B, T, N, N);
        lg_real *want = new_reals(m.n_params);
        memcpy(want, reals(m.grads), m.n_params * sizeof(lg_real));
        double loss_err = 0, grad_err = 0;
        for (int k = 0; k < 2 * 3 * 3; k++) { /* recompute x (head, MLP, both) x 3 sizes */
            int rows = chunks[k % 3], which = k / 3 % 3;
            m.recompute = k >= 9;
            double loss = head_chunk_step(&m, tokens, targets, B, T, which == 1 ? N : rows,
                                          which == 0 ? N : rows);
            loss_err = fmax(loss_err, fabs(loss - want_loss) / fabs(want_loss));
            grad_err = fmax(grad_err, rel_error(reals(m.grads), want, m.n_params, 1e-6));
        }
        m.recompute = 0;
        check(r, loss_err < 1e-6 && grad_err < 1e-6, "%-12s%s head in chunks, MLP in slices, "
              "both, of 1, 5, 7 of %d rows, recompute on and off (3 targets ignored) against "
              "one pass, fp32: loss rel err %.1e, gradients (%zu) %.1e",
              lora ? "test-llama" : names[i], lora ? " LoRA (all, dropout 0.25)"
              : cfg.tie_embeddings ? " (tied head)" : "", N, loss_err, m.n_params, grad_err);
        LG_FREE(want);
        lg_model_free(&m);
    }
}

/* The trainer with --head-rows 7 and --slice-rows 5 of 24 against one pass (where a training
   step's forward writes the logits' gradient in its one pass), with --recompute block: 3 steps
   of every family in fp32 and in 16-mixed (its loss scale through the chunks); the arena is the
   plan's, logits (7, Vp) and the MLP's buffers (5, I). */
static void test_head_chunks_trainer(results *r) {
    const char *names[] = {"test-gpt2", "test-pythia", "test-llama", "test-falcon", "test-llama31"};
    const lg_precision modes[2] = {LG_PRECISION_32_TRUE, LG_PRECISION_16_MIXED};
    double worst[2] = {0, 0}, moved[2] = {1, 1}; /* moved: the least the steps moved a run */
    int ok = 1;
    for (int i = 0; i < 5; i++)
        for (int k = 0; k < 2; k++) {
            lg_config cfg;
            if (load_config_or_fail(r, &cfg, names[i])) return;
            lg_args a;
            lg_args_default(&a);
            a.precision = modes[k];
            a.micro_batch_size = 2;
            a.global_batch_size = 4;
            a.recompute = 1;
            double whole_losses[3], chunked_losses[3];
            lg_trainer start, whole, chunked;
            int rc = train_steps(&start, &cfg, &a, 12, 0, whole_losses);
            lg_real *w0 = rc == 0 ? trained_weights(&start) : NULL;
            if (rc == 0) lg_trainer_free(&start);
            rc |= train_steps(&whole, &cfg, &a, 12, 3, whole_losses);
            a.head_rows = 7;
            a.slice_rows = 5;
            rc |= train_steps(&chunked, &cfg, &a, 12, 3, chunked_losses);
            ok = ok && rc == 0 && chunked.ranks[0].model.head_rows == 7 &&
                 chunked.ranks[0].model.slice_rows == 5;
            if (rc == 0) {
                lg_real *w = trained_weights(&whole), *c = trained_weights(&chunked);
                double e = rel_error(c, w, whole.ranks[0].model.n_params, 1e-6);
                for (int s = 0; s < 3; s++)
                    e = fmax(e, fabs(chunked_losses[s] - whole_losses[s]) / whole_losses[s]);
                worst[k] = fmax(worst[k], e);
                moved[k] = fmin(moved[k], rel_error(w, w0, whole.ranks[0].model.n_params, 1e-6));
                LG_FREE(w);
                LG_FREE(w0);
                LG_FREE(c);
                lg_trainer_free(&whole);
                lg_trainer_free(&chunked);
            }
        }
    check(r, ok && worst[0] < 1e-6 && worst[1] < 1e-6 && moved[0] > 1e-4 && moved[1] > 1e-4,
          "--head-rows 7 --slice-rows 5 of 24, --recompute block: 3 steps of 5 families (each moving the weights %.1e or more) "
          "against one pass: losses and weights rel err %.1e (fp32), %.1e (16-mixed)",
          fmin(moved[0], moved[1]), worst[0], worst[1]);
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    lg_args a;
    lg_args_default(&a);
    a.micro_batch_size = 2;
    a.head_rows = 7;
    a.slice_rows = 5;
    lg_trainer tr;
    lg_error err;
    int made = create_counting(&tr, &cfg, &a, 12, &err) == 0;
    const lg_region *head = made ? lg_plan_find(&tr.plan.ranks[0], "head") : NULL;
    size_t ln_f = (size_t)24 * cfg.n_embd, logits = (size_t)7 * cfg.padded_vocab_size;
    /* against the plan of all rows: fc, fc_2 and act, and their gradients, 19 rows shorter */
    lg_args whole = a;
    whole.slice_rows = 0;
    lg_plan_spec spec;
    lg_plan all;
    lg_plan_spec_from_args(&spec, &whole, 12);
    int planned = lg_plan_make(&all, &cfg, &spec, NULL) == 0;
    size_t shorter = (size_t)3 * (24 - 5) * cfg.intermediate_size;
    int slices_sized = made && planned &&
        lg_plan_find(&all.ranks[0], "activations.h.0")->count -
                lg_plan_find(&tr.plan.ranks[0], "activations.h.0")->count == shorter &&
        lg_plan_find(&all.ranks[0], "backward")->count -
                lg_plan_find(&tr.plan.ranks[0], "backward")->count == shorter;
    if (planned) lg_plan_free(&all);
    check(r, made && arenas_equal_plan(&tr) && head && head->count == ln_f + logits && slices_sized,
          "--head-rows 7 --slice-rows 5: the arenas are the plan's; the head region holds ln_f "
          "(24 x %d) and logits (7 x %d) only; fc and d_fc are (5 x %d)", cfg.n_embd,
          cfg.padded_vocab_size, cfg.intermediate_size);
    if (made) lg_trainer_free(&tr);
}

/* The planner's choice: all rows when they fit, the head in chunks of LG_HEAD_CHUNK_ROWS when
   not (or when nothing fits), then with --recompute block the MLP in slices of LG_SLICE_ROWS;
   all rows at or under those and for Sophia's head; --plan says it. */
static void test_head_rows_auto(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "pythia-14m")) return;
    lg_args a;
    lg_args_default(&a);
    a.micro_batch_size = 8;
    a.precision = LG_PRECISION_BF16_TRUE;
    a.recompute = 1;
    const int T = 512, N = 8 * T;
    a.head_rows = a.slice_rows = N;
    size_t all = lg_plan_checked_bytes_for(&cfg, &a, T);
    a.head_rows = LG_HEAD_CHUNK_ROWS;
    size_t chunked = lg_plan_checked_bytes_for(&cfg, &a, T);
    a.slice_rows = LG_SLICE_ROWS;
    size_t sliced = lg_plan_checked_bytes_for(&cfg, &a, T);
    size_t saved = (size_t)(N - LG_HEAD_CHUNK_ROWS) * cfg.padded_vocab_size * 2; /* bf16 logits */
    /* fc and act in the recomputed block, d_fc and d_act in the backward (GPTNeoX's MLP) */
    size_t slice_saved = (size_t)4 * (N - LG_SLICE_ROWS) * cfg.intermediate_size * 2;
    a.head_rows = a.slice_rows = 0;
    int head[5], slice[5];
    lg_plan_auto_rows(&cfg, &a, T, all, &head[0], &slice[0]);
    lg_plan_auto_rows(&cfg, &a, T, all - 1, &head[1], &slice[1]);
    lg_plan_auto_rows(&cfg, &a, T, chunked - 1, &head[2], &slice[2]);
    lg_plan_auto_rows(&cfg, &a, T, sliced / 2, &head[3], &slice[3]);
    lg_plan_auto_rows(&cfg, &a, 128, 1, &head[4], &slice[4]); /* 1024 rows: no chunks */
    lg_args sophia = a;
    sophia.optimizer = LG_OPTIMIZER_SOPHIA;
    int sophia_head, sophia_slice;
    lg_plan_auto_rows(&cfg, &sophia, T, chunked - 1, &sophia_head, &sophia_slice);
    lg_args plain = a; /* without --recompute block: no slices */
    plain.recompute = 0;
    int plain_head, plain_slice;
    lg_plan_auto_rows(&cfg, &plain, T, 1, &plain_head, &plain_slice);
    const int C = LG_HEAD_CHUNK_ROWS, S = LG_SLICE_ROWS;
    check(r, all - chunked >= saved && all - chunked < saved + 4096 &&
          chunked - sliced >= slice_saved && chunked - sliced < slice_saved + 8192 &&
          head[0] == N && slice[0] == N && head[1] == C && slice[1] == N && head[2] == C &&
          slice[2] == S && head[3] == C && slice[3] == S && head[4] == 1024 && slice[4] == 1024 &&
          sophia_head == N && sophia_slice == S && plain_head == C && plain_slice == N,
          "rows at a time, -b 8 -t %d: chunks of %d save %zu bytes of logits, slices of %d %zu of "
          "the MLP's; chosen (head, MLP) (%d, %d) where all fit, (%d, %d) a byte short, (%d, %d) "
          "where chunks do not fit, (%d, %d) where nothing fits; all at -t 128; Sophia's head "
          "whole; no slices without --recompute block", T, C, all - chunked, S, chunked - sliced,
          head[0], slice[0], head[1], slice[1], head[2], slice[2], head[3], slice[3]);
    char args[256];
    snprintf(args, sizeof args, "--plan -c pythia-14m -b 8 -t 512 -p bf16-true --recompute block "
             "--memory-limit %zuB", chunked - 1);
    expect_cli(r, args, 0, "with all 4096 rows at once; the head and loss in chunks of 1024 rows; "
               "each block's MLP in slices of 2048 rows");
    expect_cli(r, args, 0, "| head in chunks of 1024 rows | MLP in slices of 2048 rows");
    snprintf(args, sizeof args, "--plan -c pythia-14m -b 8 -t 512 -p bf16-true --recompute block "
             "--memory-limit %zuB", all);
    expect_cli(r, args, 0, "| recompute block | adamw\n");
    expect_cli(r, "--plan -c pythia-14m --head-rows 0", 2, "--head-rows must be at least 1");
    expect_cli(r, "--plan -c pythia-14m --slice-rows -3", 2, "--slice-rows must be at least 1");
    expect_cli(r, "--plan=json -c pythia-14m -b 2 -t 64 --head-rows 100 --slice-rows 9 2>/dev/null",
               0, "\"head_rows\":100,\"slice_rows\":9,");
}
