/* tests/test_real_models.c — real models and real data without surprises (issue 23): special
   tokens at or past vocab_size, the Hub's layouts, configs found from anywhere, the errors a
   newcomer meets first. Included by tests/test.c. */

#define REAL_DIR "build/real"

/* configs/test-llama.yaml with another vocabulary (and block_size 64), at path. */
static int vocab_config(const char *path, int vocab_size, int padded) {
    char changes[256];
    snprintf(changes, sizeof changes, "vocab_size: %d\npadded_vocab_size: %d\nblock_size: 64\n",
             vocab_size, padded);
    return hostile_yaml(path, "test-llama", changes);
}

/* Token ids below padded_vocab_size are the model's, as LitGPT has it: Llama 3's BOS 128000
   under its configs' vocab_size 128000, and an end-of-text id equal to vocab_size (Qwen2's
   151643; here GPT-2's 50256 under a vocab_size of 50256), prepared by tools/prepare and
   trained, the loss over every padded row. */
static void test_special_token_ids(results *r) {
    struct { const char *tokenizer; int vocab, padded, special; } cases[] = {
        {"data/llama3", 128000, 128256, 128000},
        {"data/gpt2", 50256, 50304, 50256},
    };
    if (system("mkdir -p " REAL_DIR " && ./tools/prepare builtin --samples 40 > "
               REAL_DIR "/builtin.json") != 0) { check(r, 0, "tools/prepare builtin failed"); return; }
    for (int k = 0; k < 2; k++) {
        char cmd[512], cfg[128], want[160];
        snprintf(cmd, sizeof cmd, "./tools/prepare alpaca --tokenizer %s --out " REAL_DIR
                 "/special.bin " REAL_DIR "/builtin.json > /dev/null", cases[k].tokenizer);
        snprintf(cfg, sizeof cfg, REAL_DIR "/vocab-%d.yaml", k);
        if (system(cmd) != 0 || vocab_config(cfg, cases[k].vocab, cases[k].padded) != 0) {
            check(r, 0, "could not prepare %s", cmd);
            continue;
        }
        lg_loader ld;
        lg_error err;
        int rc = lg_loader_open(&ld, REAL_DIR "/special.bin", 0, cases[k].padded, 0, 0, &err);
        check(r, rc == 0 && ld.max_token >= (uint32_t)cases[k].special &&
                     ld.max_token < (uint32_t)cases[k].padded,
              "%s: samples hold tokens up to %u (special tokens from %d), below padded_vocab_size %d",
              cases[k].tokenizer, rc == 0 ? ld.max_token : 0, cases[k].special, cases[k].padded);
        if (rc == 0) lg_loader_close(&ld);
        snprintf(cmd, sizeof cmd, "-c %s --data " REAL_DIR "/special.bin -b 2 -t 64 --max-steps 2 "
                 "--eval-every 0 --sample-tokens 1", cfg);
        snprintf(want, sizeof want, "the loss covers all %d rows of padded_vocab_size",
                 cases[k].padded);
        expect_cli(r, cmd, 0, "step     2/2");
        expect_cli(r, cmd, 0, want);
    }
    expect_cli(r, "-c test-llama --data " REAL_DIR "/special.bin -t 8 --max-steps 1", 2,
               "is outside the model's vocabulary of 32");
    write_text(REAL_DIR "/alpaca.json", "[{\"instruction\": \"a\", \"output\": \"b\"}]");
    expect_cli(r, "-c test-llama --data " REAL_DIR "/alpaca.json -t 8 --max-steps 1", 2,
               "a JSON file, not prepared data: make fine-tuning samples with tools/prepare alpaca");
}

/* The validation loss at step 0 that ./train prints for `args`, or NAN. */
static double first_val_loss(const char *args) {
    static char out[16384];
    run_capture(args, out, sizeof out);
    const char *at = strstr(out, "step     0 | val loss ");
    return at ? atof(at + strlen("step     0 | val loss ")) : NAN;
}

/* Every .safetensors file of dir (one, or the shards of an index) renamed by
   st_rewrite_names; path gets the last one. */
static int strip_dir_prefixes(const char *dir, char *path, size_t cap) {
    DIR *d = opendir(dir);
    int rc = d ? 0 : -1, files = 0;
    for (struct dirent *e = d ? readdir(d) : NULL; e && rc == 0; e = readdir(d)) {
        size_t n = strlen(e->d_name);
        if (n < 12 || strcmp(e->d_name + n - 12, ".safetensors") != 0) continue;
        snprintf(path, cap, "%s/%s", dir, e->d_name);
        rc = st_rewrite_names(path, NULL, NULL, NULL, 0, (lg_st_dtype)0, 1);
        files++;
    }
    if (d) closedir(d);
    return rc == 0 && files > 0 ? 0 : -1;
}

/* Each family's Hugging Face directory with its tensors renamed as the base-model classes
   name them (openai-community/gpt2: wte.weight, h.0.attn.c_attn.weight, ...): the same loss. */
static void test_stripped_prefixes(results *r) {
    const char *families[] = {"gpt2", "pythia", "llama", "llama31", "falcon"};
    for (size_t k = 0; k < sizeof families / sizeof families[0]; k++) {
        char dir[256], args[512], path[300];
        if (hostile_hf_dir(dir, sizeof dir, families[k], "stripped", "{", "{") != 0) {
            check(r, 0, "could not copy tests/hf/%s", families[k]);
            continue;
        }
        int made = strip_dir_prefixes(dir, path, sizeof path) == 0;
        const char *run = "-b 2 -t 8 --max-steps 1 --eval-iters 2 --sample-tokens 1";
        snprintf(args, sizeof args, "--load tests/hf/%s %s", families[k], run);
        double whole = first_val_loss(args);
        snprintf(args, sizeof args, "--load %s %s", dir, run);
        double stripped = first_val_loss(args);
        lg_st_file f;
        lg_error err;
        int prefixed = 0;
        if (made && lg_st_open(&f, path, &err) == 0) {
            for (int i = 0; i < f.n_tensors; i++)
                for (size_t p = 0; p < sizeof lg_hf_model_prefixes / sizeof *lg_hf_model_prefixes; p++)
                    prefixed += strncmp(f.tensors[i].name, lg_hf_model_prefixes[p],
                                        strlen(lg_hf_model_prefixes[p])) == 0;
            lg_st_close(&f);
        }
        check(r, made && prefixed == 0 && isfinite(whole) && whole == stripped,
              "%s without the model prefix in its tensor names: val loss %.4f, %.4f with it",
              families[k], stripped, whole);
    }
}

/* The small frictions of a first run: sizes need a unit, in any case. */
static void test_first_run_frictions(results *r) {
    expect_cli(r, "--plan --memory-limit 24", 2, "--memory-limit: '24' is not a size with a unit");
    expect_cli(r, "--plan --memory-limit 24gib", 0, "plan: builtin-sort");
    expect_cli(r, "--plan --memory-limit 1.5Gb", 0, "plan: builtin-sort");
}

/* -c NAME from another directory (beside the executable, or LITGPT_CONFIGS), and an unknown
   name's close ones. */
static void test_config_places(results *r) {
    char out[8192];
    int code = run_command("cd tests && ../train --plan -c test-gpt2 -t 8 2>&1", out, sizeof out);
    check(r, code == 0 && strstr(out, "model test-gpt2: n_layer"),
          "-c test-gpt2 from tests/: configs/ beside the executable (exit %d)", code);
    mkdir("build/more-configs", 0755);
    code = run_command("cp configs/test-llama.yaml build/more-configs/my-llama.yaml && cd tests && "
                       "LITGPT_CONFIGS=/nonexistent:../build/more-configs ../train --plan -c my-llama -t 8 "
                       "2>&1", out, sizeof out);
    check(r, code == 0 && strstr(out, "model test-llama: n_layer"),
          "-c my-llama from tests/ with LITGPT_CONFIGS=/nonexistent:../build/more-configs (exit %d)",
          code);
    expect_cli(r, "--plan -c Llama-3.2-1b", 2, "did you mean Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B");
    expect_cli(r, "--plan -c gpt-2", 2, "no gpt-2.yaml in ./configs");
    expect_cli(r, "--plan -c zzzzzzzzzzzz", 2, "the configs there: Llama-2-70b-hf, Llama-2-7b-hf, Llama-3.1-70B");
}

/* The run header names LoRA or QLoRA and both counts, labelled: tests/hf/gpt2 has 2 layers of
   n_embd 16; r 2 on q and v is 2 x 2 x (2 x 16 + 16 x 2) = 256 parameters. */
static void test_run_header(results *r) {
    expect_cli(r, "--load tests/hf/gpt2 --lora-r 2 --quantize nf4-dq --max-steps 0 -b 2 -t 8 "
               "--eval-iters 1", 0, "parameters: 256 trainable (LoRA r 2 on q,v), ");
    expect_cli(r, "--load tests/hf/gpt2 --lora-r 2 --quantize nf4-dq --max-steps 0 -b 2 -t 8 "
               "--eval-iters 1", 0, "frozen (QLoRA: linear weights in nf4-dq)");
    expect_cli(r, "--load tests/hf/gpt2 --max-steps 0 -b 2 -t 8 --eval-iters 1", 0,
               "parameters, all trainable |");
}

static int begins(const char *text, const char *prefix) {
    return strncmp(text, prefix, strlen(prefix)) == 0;
}

/* A plan of a model without --data or -t is of windows of block_size tokens, and its first
   line says what it planned for; the built-in task's lengths are for the built-in task alone. */
static void test_plan_lengths(results *r) {
    static char out[65536];
    int code = run_command("./train --plan -c pythia-14m 2>&1", out, sizeof out);
    check(r, code == 0 && begins(out, "plan for pythia-14m: -b 16, T 512 tokens (block_size; "
          "neither --data nor -t) | bf16-mixed | 1 device on the CPU backend\n") &&
          strstr(out, "-t 512 (1 accumulation)") && !strstr(out, "built-in"),
          "--plan -c pythia-14m (block_size 512): the first line %.*s",
          (int)strcspn(out, "\n"), out);
    code = run_command("./train --plan=json -c pythia-14m -d 2 2>/dev/null", out, sizeof out);
    check(r, code == 0 && strstr(out, "\"max_seq_length\":512,") && out[0] == '{',
          "--plan=json -c pythia-14m -d 2 plans 512 tokens, the JSON alone on stdout");
    code = run_command("./train --plan -c pythia-14m -t 64 -p bf16-true -d 2 2>&1", out, sizeof out);
    check(r, code == 0 && begins(out, "plan for pythia-14m: -b 16, T 64 tokens (-t; no --data) | "
          "bf16-true | 2 simulated ranks on the CPU backend\n"),
          "--plan -t 64: %.*s", (int)strcspn(out, "\n"), out);
    code = run_command("./train --plan 2>&1", out, sizeof out);
    check(r, code == 0 && begins(out, "plan for the built-in task on builtin-sort: -b 16, T 18 "
          "tokens (the built-in task's longest sample)"),
          "--plan of the built-in task says so: %.*s", (int)strcspn(out, "\n"), out);
    code = run_command("./train -c test-gpt2 -t 12 --max-steps 1 -b 2 --eval-iters 1 2>&1", out, sizeof out);
    check(r, code == 0 && begins(out, "the built-in task (sort the letters), fine-tuning samples: "
          "20000"), "a run of a model on the built-in task says so first: %.*s",
          (int)strcspn(out, "\n"), out);
}

/* Cuts the trailing spaces of text, then its last word. */
static void drop_last_word(char *text) {
    size_t n = strlen(text);
    while (n > 0 && text[n - 1] == ' ') n--;
    while (n > 0 && text[n - 1] != ' ') n--;
    while (n > 0 && text[n - 1] == ' ') n--;
    text[n] = '\0';
}

/* The flags of a remedy line of the diagnosis ("  what  FLAGS  5.0 MiB  fits") into flags;
   returns 1 fits, 0 does not, -1 not a remedy line. */
static int remedy_line(const char *line, char *flags, size_t cap) {
    size_t len = strlen(line);
    int fits = len > 13 && strcmp(line + len - 13, " does not fit") == 0 ? 0
               : len > 6 && strcmp(line + len - 6, "  fits") == 0 ? 1 : -1;
    if (fits < 0 || len < 33 || line[0] != ' ') return -1;
    snprintf(flags, cap, "%.*s", (int)(len - 32 - (fits ? 6 : 13)), line + 32); /* after the
                                                                    29-wide name, before it */
    drop_last_word(flags); /* the size: "5.0 MiB" */
    drop_last_word(flags);
    return fits;
}

/* On the CPU backend the device and host pools and the simulated ranks share one memory: every
   remedy the diagnosis calls fitting starts and trains (its flags after the command's, the
   last of a flag counts), and every one it says does not fit stops with exit 3. */
static void test_every_remedy_runs(results *r) {
    static char out[16384], again[8192];
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    lg_args a;
    lg_args_default(&a);
    a.micro_batch_size = 8;
    size_t needs = lg_plan_checked_bytes_for(&cfg, &a, 16);
    a.micro_batch_size = 1;
    size_t least = lg_plan_checked_bytes_for(&cfg, &a, 16);
    char run[256], cmd[1024];
    snprintf(run, sizeof run, "./train -c test-llama -b 8 -g 8 -t 16 --memory-limit %zuB "
             "--max-steps 1 --eval-iters 1 --sample-tokens 1", (needs + least) / 2);
    snprintf(cmd, sizeof cmd, "%s 2>&1", run);
    int code = run_command(cmd, out, sizeof out), fitting = 0, not_fitting = 0, honest = 0;
    for (char *line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
        char flags[256];
        int fits = remedy_line(line, flags, sizeof flags);
        if (fits < 0) continue;
        snprintf(cmd, sizeof cmd, "%s %s 2>&1", run, flags);
        int got = run_command(cmd, again, sizeof again);
        int ok = fits ? got == 0 && strstr(again, "step     1/1") != NULL : got == 3;
        fitting += fits;
        not_fitting += !fits;
        honest += ok;
        if (!ok) printf("        %s: said %s, exit %d\n", flags, fits ? "fits" : "does not fit", got);
    }
    check(r, code == 3 && fitting > 0 && not_fitting > 0 && honest == fitting + not_fitting,
          "every remedy of the diagnosis of %s: %d said to fit and trained, %d said not to and "
          "stopped with exit 3 (%d of %d as said)", run, fitting, not_fitting, honest,
          fitting + not_fitting);
}

static void test_real_models_all(results *r) {
    test_every_remedy_runs(r);
    test_plan_lengths(r);
    test_first_run_frictions(r);
    test_config_places(r);
    test_run_header(r);
    test_stripped_prefixes(r);
    test_special_token_ids(r);
}
