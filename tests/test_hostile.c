/* tests/test_hostile.c — crafted and broken inputs (issue 30's probe, as regression tests): each
   is refused with one line naming the file and field, with exit 2, and nothing crashes. The
   inputs are made here from the repository's own configs and Hugging Face directories. Included
   by tests/test.c. */

#include <sys/stat.h>

#define HOSTILE_DIR "build/hostile"

/* The line of `changes` ("key: value\n" lines) that sets the key of `line`, or NULL. */
static const char *hostile_change_for(const char *changes, const char *line) {
    const char *colon = strchr(line, ':');
    if (!colon || line[0] == '#') return NULL;
    size_t key = (size_t)(colon - line) + 1;
    for (const char *at = changes; at && *at; at = strchr(at, '\n') ? strchr(at, '\n') + 1 : NULL)
        if (strncmp(at, line, key) == 0) return at;
    return NULL;
}

/* configs/BASE.yaml with the lines of `changes` in place of the base's lines of their keys,
   written to path. */
static int hostile_yaml(const char *path, const char *base, const char *changes) {
    char src[256], line[256], text[8192] = "";
    snprintf(src, sizeof src, "configs/%s.yaml", base);
    FILE *in = fopen(src, "r");
    if (!in) return -1;
    while (fgets(line, sizeof line, in)) {
        const char *change = hostile_change_for(changes, line);
        if (change) strncat(text, change, strcspn(change, "\n") + 1);
        else strncat(text, line, sizeof text - strlen(text) - 1);
    }
    fclose(in);
    return write_text(path, text);
}

/* A copy of tests/hf/FAMILY in HOSTILE_DIR/NAME whose config.json has `from` replaced by `to`. */
static int hostile_hf_dir(char *dir, size_t cap, const char *family, const char *name,
                          const char *from, const char *to) {
    char cmd[512], path[512];
    snprintf(dir, cap, HOSTILE_DIR "/%s", name);
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p " HOSTILE_DIR " && cp -r tests/hf/%s %s", dir,
             family, dir);
    if (system(cmd) != 0) return -1;
    snprintf(path, sizeof path, "%s/config.json", dir);
    size_t len;
    lg_error err;
    char *json = lg_read_file(path, &len, "test", &err);
    char *at = json ? strstr(json, from) : NULL;
    if (!at) { free(json); return -1; }
    char text[8192];
    snprintf(text, sizeof text, "%.*s%s%s", (int)(at - json), json, to, at + strlen(from));
    free(json);
    return write_text(path, text);
}

static void test_hostile_configs(results *r) {
    const char *yaml = HOSTILE_DIR "/config.yaml";
    char args[512];
    if (system("mkdir -p " HOSTILE_DIR) != 0) return;
    struct { const char *changes, *want; } cases[] = {
        /* the probe's heap overflow in the rotary tables */
        {"n_head: 65536\nhead_size: 65536\nn_query_groups: 1\n", "n_head 65536 exceeds the limit 4096"},
        {"n_embd: 300000\n", "n_embd 300000 exceeds the limit 262144"},
        {"n_embd: 262144\npadded_vocab_size: 16384\n", "over the limit 2147483647 of one matrix"},
        {"rope_base: 1e40\n", "rope_base is '1e40', expected a finite number"},
        {"norm_eps: nan\n", "norm_eps is 'nan', expected a finite number"},
        {"rope_base: 0.5\n", "rope_base must be above 1"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        if (hostile_yaml(yaml, "test-llama", cases[k].changes) != 0) {
            check(r, 0, "could not write %s", yaml);
            continue;
        }
        snprintf(args, sizeof args, "--plan -c %s", yaml);
        expect_cli(r, args, 2, cases[k].want);
    }
    /* sizes within every bound whose activations add up past 2^60 bytes: refused, not wrapped */
    hostile_yaml(yaml, "test-llama", "n_layer: 4096\nn_head: 1\nn_query_groups: 1\nhead_size: 16\n"
                 "block_size: 16777216\nn_embd: 131072\nintermediate_size: 16\n");
    snprintf(args, sizeof args, "--plan -c %s -b 127 -t 16777216", yaml);
    expect_cli(r, args, 2, "too large to lay out");
}

static void test_hostile_hf_configs(results *r) {
    char dir[256], args[512];
    struct { const char *family, *from, *to, *want; } cases[] = {
        /* the probe's stack smash in the plan's bars */
        {"falcon", "\"hidden_size\": 24", "\"hidden_size\": 2000000000", "exceeds the limit"},
        {"llama31", "\"factor\": 8.0", "\"factor\": 0", "rope_scaling.factor is 0"},
        {"llama31", "\"factor\": 8.0", "\"factor\": 1e39", "factor is not a finite number"},
        {"llama31", "\"rope_type\": \"llama3\"", "\"rope_type\": 3", "rope_type is not a string"},
        {"llama31", "\"rope_type\": \"llama3\"", "\"rope_type\": \"yarn\"", "'yarn' is not supported"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        if (hostile_hf_dir(dir, sizeof dir, cases[k].family, "hf", cases[k].from, cases[k].to) != 0) {
            check(r, 0, "tests/hf/%s/config.json has no '%s'", cases[k].family, cases[k].from);
            continue;
        }
        snprintf(args, sizeof args, "--plan --load %s", dir);
        expect_cli(r, args, 2, cases[k].want);
    }
    /* a FIFO named config.json blocked --load: refused without opening it */
    if (hostile_hf_dir(dir, sizeof dir, "llama", "fifo", "{", "{") == 0) {
        char path[300];
        snprintf(path, sizeof path, "%s/config.json", dir);
        remove(path);
        int made = mkfifo(path, 0644) == 0;
        snprintf(args, sizeof args, "10 ./train --plan --load %s", dir);
        if (made) expect_program(r, "timeout", args, 2, "config.json: not a regular file");
        else check(r, 0, "mkfifo %s failed", path);
    }
}


/* ---- crafted checkpoints: a file rewritten, then COMPLETE sealed again so that only the
   reader's own checks stand between the crafted value and the run ---------------------------- */

/* A safetensors file rewritten: meta entry `key` set to `value` (when key), and each element
   of the tensors whose names start with `prefix` set to `x` (when prefix); `dtype` > 0 turns
   the first such tensor into that dtype (its bytes cut to fit). */
typedef struct {
    lg_st_file src;
    lg_st_tensor *tensors;
    const char *prefix;
    double x;
} st_edit;

static int st_edit_fill(void *ctx, int index, unsigned char *out, lg_error *err) {
    st_edit *e = (st_edit *)ctx;
    const lg_st_tensor *from = &e->src.tensors[index], *to = &e->tensors[index];
    unsigned char *bytes = (unsigned char *)malloc((size_t)(from->end - from->begin) + 1);
    int rc = bytes ? lg_st_read(&e->src, from, bytes, err) : -1;
    size_t have = (size_t)(from->end - from->begin), want = (size_t)(to->end - to->begin);
    if (rc == 0) memset(out, 0, want);
    if (rc == 0) memcpy(out, bytes, have < want ? have : want);
    free(bytes);
    if (rc != 0 || !e->prefix || strncmp(to->name, e->prefix, strlen(e->prefix)) != 0 ||
        !lg_st_is_float(to->dtype))
        return rc;
    for (uint64_t i = 0; i < lg_st_count(to); i++) lg_st_set(to->dtype, out, i, (lg_real)e->x);
    return 0;
}

static int st_rewrite_names(const char *path, const char *key, const char *value,
                            const char *prefix, double x, lg_st_dtype dtype, int strip_prefixes);

static int st_rewrite(const char *path, const char *key, const char *value, const char *prefix,
                      double x, lg_st_dtype dtype) {
    return st_rewrite_names(path, key, value, prefix, x, dtype, 0);
}

/* st_rewrite, and with strip_prefixes each tensor named without its model prefix
   (transformer., model., gpt_neox.), as the Hub's base-model files are. */
static int st_rewrite_names(const char *path, const char *key, const char *value,
                            const char *prefix, double x, lg_st_dtype dtype, int strip_prefixes) {
    st_edit e;
    lg_error err;
    memset(&e, 0, sizeof e);
    if (lg_st_open(&e.src, path, &err) != 0) return -1;
    e.tensors = (lg_st_tensor *)malloc(sizeof(lg_st_tensor) * (size_t)e.src.n_tensors);
    memcpy(e.tensors, e.src.tensors, sizeof(lg_st_tensor) * (size_t)e.src.n_tensors);
    e.prefix = prefix;
    e.x = x;
    for (int i = 0; i < e.src.n_tensors && strip_prefixes; i++)
        for (size_t k = 0; k < sizeof lg_hf_model_prefixes / sizeof lg_hf_model_prefixes[0]; k++) {
            size_t n = strlen(lg_hf_model_prefixes[k]);
            if (strncmp(e.tensors[i].name, lg_hf_model_prefixes[k], n) == 0)
                memmove(e.tensors[i].name, e.tensors[i].name + n, strlen(e.tensors[i].name) - n + 1);
        }
    for (int i = 0; i < e.src.n_tensors && dtype; i++)
        if (prefix && strncmp(e.tensors[i].name, prefix, strlen(prefix)) == 0) {
            e.tensors[i].dtype = dtype;
            break;
        }
    lg_st_meta meta[64];
    int n_meta = e.src.n_meta < 64 ? e.src.n_meta : 64;
    memcpy(meta, e.src.meta, sizeof(lg_st_meta) * (size_t)n_meta);
    for (int k = 0; k < n_meta && key; k++)
        if (strcmp(meta[k].key, key) == 0) snprintf(meta[k].value, sizeof meta[k].value, "%s", value);
    int rc = lg_st_write(path, e.tensors, e.src.n_tensors, meta, n_meta, st_edit_fill, &e, NULL,
                         &err);
    lg_st_close(&e.src);
    free(e.tensors);
    return rc;
}

/* COMPLETE of dir written again from its files as they now are (sizes and hashes), leaving out
   the line of `drop` (when given). */
static int reseal(const char *dir, const char *drop) {
    char path[512], text[4096], line[512], out[8192] = "";
    snprintf(path, sizeof path, "%s/" LG_CHECKPOINT_MARKER, dir);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    while (fgets(line, sizeof line, f)) {
        char name[256], file[600];
        lg_file_digest d;
        if (sscanf(line, "file %255s", name) != 1) { strcat(out, line); continue; }
        snprintf(file, sizeof file, "%s/%s", dir, name);
        if (drop && strcmp(name, drop) == 0) continue;
        if (lg_file_digest_of(file, &d) != 0) { fclose(f); return -1; }
        snprintf(text, sizeof text, "file %s %llu %016llx\n", name, (unsigned long long)d.bytes,
                 (unsigned long long)d.hash);
        strcat(out, text);
    }
    fclose(f);
    return write_text(path, out);
}

/* A copy of build/hostile/step-5 edited by st_rewrite(FILE, ...), sealed again: resuming it is
   refused with `want`. */
static int crafted_state_refused(lg_trainer *tr, lg_loader *ld, const char *file, const char *key,
                                 const char *value, const char *prefix, double x, lg_st_dtype dtype,
                                 const char *want) {
    char path[256];
    lg_error err;
    int step;
    if (system("rm -rf " HOSTILE_DIR "/copy && cp -r " HOSTILE_DIR "/step-5 " HOSTILE_DIR "/copy") != 0)
        return 0;
    snprintf(path, sizeof path, HOSTILE_DIR "/copy/%s", file);
    if (st_rewrite(path, key, value, prefix, x, dtype) != 0 || reseal(HOSTILE_DIR "/copy", NULL) != 0)
        return 0;
    int rc = lg_checkpoint_resume(tr, ld, HOSTILE_DIR "/copy", &step, &err);
    return refused_with(want, rc, &err, "training state" , want) ||
           refused_with(want, rc, &err, file, want);
}

static void test_hostile_training_state(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-pythia")) return;
    lg_args a = ckpt_args(LG_PRECISION_BF16_MIXED, LG_OPTIMIZER_ADAMW);
    lg_trainer tr;
    lg_loader ld;
    lg_error err;
    if (lg_trainer_create(&tr, &cfg, &a, 8, &err) != 0) { check(r, 0, "%s", err.msg); return; }
    builtin_loader(&ld, &cfg, 8, 7, 200, a.seed);
    system("rm -rf " HOSTILE_DIR "/step-5");
    lg_checkpoint_save(&tr, &ld, 5, HOSTILE_DIR, &err);
    const char *st = LG_TRAINING_STATE;
    struct { const char *key, *value, *prefix; double x; const char *want; } cases[] = {
        {"step", "-1", NULL, 0, "step is not a non-negative integer"},
        {"optimizer_updates", "-5", NULL, 0, "optimizer_updates is not a non-negative integer"},
        {"optimizer_updates", "9", NULL, 0, "optimizer_updates 9 exceeds step 5"},
        {"step", "99999999999", NULL, 0, "step 99999999999 is beyond 2147483647"},
        {"loss_scale_bits", "0", NULL, 0, "not a positive finite loss scale"},
        {NULL, NULL, "optimizer.m.", NAN, "is nan, not finite"},
        {NULL, NULL, "optimizer.v.", -1.0, "a negative second moment"},
        {NULL, NULL, "master.", INFINITY, "is inf, not finite"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        int ok = crafted_state_refused(&tr, &ld, st, cases[k].key, cases[k].value, cases[k].prefix,
                                       cases[k].x, (lg_st_dtype)0, cases[k].want);
        check(r, ok, "resume of a state with %s %s refused: %s", cases[k].key ? cases[k].key
              : cases[k].prefix, cases[k].value ? cases[k].value : "crafted values", cases[k].want);
    }
    /* a file taken out of COMPLETE is no longer verified: refused */
    int step;
    system("rm -rf " HOSTILE_DIR "/copy && cp -r " HOSTILE_DIR "/step-5 " HOSTILE_DIR "/copy");
    reseal(HOSTILE_DIR "/copy", st);
    int rc = lg_checkpoint_resume(&tr, &ld, HOSTILE_DIR "/copy", &step, &err);
    check(r, refused_with("unlisted", rc, &err, st, "is not listed in COMPLETE"),
          "a step whose COMPLETE leaves out %s is refused: %s", st, err.msg);
    lg_loader_close(&ld);
    lg_trainer_free(&tr);
}

/* Adapters of other dtypes than the numbers PEFT writes: U8 was a heap over-read, I64 was
   read as garbage. */
static void test_hostile_adapters(results *r) {
    const char *run = "--lora-r 2 --max-steps 2 --eval-every 0 --sample-tokens 1";
    char args[512];
    system("rm -rf " HOSTILE_DIR "/lora");
    snprintf(args, sizeof args, "%s --out " HOSTILE_DIR "/lora", run);
    expect_cli(r, args, 0, "saved " HOSTILE_DIR "/lora/step-2");
    const lg_st_dtype dtypes[2] = {LG_ST_U8, LG_ST_I64};
    for (int k = 0; k < 2; k++) {
        system("rm -rf " HOSTILE_DIR "/lora-copy && cp -r " HOSTILE_DIR "/lora/step-2 "
               HOSTILE_DIR "/lora-copy");
        int made = st_rewrite(HOSTILE_DIR "/lora-copy/adapter_model.safetensors", NULL, NULL,
                              "base_model.", 0, dtypes[k]) == 0 &&
                   reseal(HOSTILE_DIR "/lora-copy", NULL) == 0;
        char want[64];
        snprintf(want, sizeof want, "is %s, not F32, BF16 or F16", lg_st_dtype_name(dtypes[k]));
        snprintf(args, sizeof args, "%s --max-steps 3 --resume " HOSTILE_DIR "/lora-copy", run);
        if (made) expect_cli(r, args, 2, want);
        else check(r, 0, "could not craft the %s adapter", lg_st_dtype_name(dtypes[k]));
    }
    /* a LoRA checkpoint that does not record its base's hash: refused, naming the base */
    system("rm -rf " HOSTILE_DIR "/lora-copy && cp -r " HOSTILE_DIR "/lora/step-2 " HOSTILE_DIR
           "/lora-copy && grep -v base_hash " HOSTILE_DIR "/lora/step-2/" LG_RUN_SETTINGS " > "
           HOSTILE_DIR "/lora-copy/" LG_RUN_SETTINGS);
    if (reseal(HOSTILE_DIR "/lora-copy", NULL) != 0) check(r, 0, "could not reseal the copy");
    else expect_cli(r, "--max-steps 3 --resume " HOSTILE_DIR "/lora-copy", 2,
                    "no base_hash in " LG_RUN_SETTINGS ": it does not say which base its adapters "
                    "were trained over, so they are not applied to this run's base, one drawn at random,");
}

/* HOSTILE_DIR/settings/step-2 copied with the line "KEY ..." of its run settings set to
   "KEY value", sealed again when reseal_it; resuming it is refused with exit 2 and `want`. */
static void crafted_settings_refused(results *r, const char *key, const char *value,
                                     int reseal_it, const char *want) {
    char cmd[512], args[256];
    snprintf(cmd, sizeof cmd, "rm -rf " HOSTILE_DIR "/settings-copy && cp -r " HOSTILE_DIR
             "/settings/step-2 " HOSTILE_DIR "/settings-copy && sed -i 's/^%s .*/%s %s/' "
             HOSTILE_DIR "/settings-copy/" LG_RUN_SETTINGS, key, key, value);
    if (system(cmd) != 0 || (reseal_it && reseal(HOSTILE_DIR "/settings-copy", NULL) != 0)) {
        check(r, 0, "could not craft run settings with %s %s", key, value);
        return;
    }
    snprintf(args, sizeof args, "--max-steps 3 --resume " HOSTILE_DIR "/settings-copy");
    expect_cli(r, args, 2, want);
}

/* run_settings.txt was parsed and used before the checkpoint's checksums were checked, and an
   enum out of range indexed a name table out of bounds: now verified first, and every field
   held to its range, refused naming the file and the field. */
static void test_hostile_run_settings(results *r) {
    const char *file = "train: " HOSTILE_DIR "/settings-copy/" LG_RUN_SETTINGS ": ";
    char want[16][300];
    system("rm -rf " HOSTILE_DIR "/settings");
    expect_cli(r, "--max-steps 2 --eval-every 0 --sample-tokens 1 --out " HOSTILE_DIR "/settings",
               0, "saved " HOSTILE_DIR "/settings/step-2");
    crafted_settings_refused(r, "precision", "9", 0, "train: checkpoint " HOSTILE_DIR
                             "/settings-copy: " LG_RUN_SETTINGS " does not match its checksum "
                             "in COMPLETE");
    crafted_settings_refused(r, "precision", "999", 0, LG_RUN_SETTINGS " has ");
    struct { const char *key, *value, *why; } cases[] = {
        {"precision", "99", "precision 99 is out of range: expected 0 to 4"},
        {"strategy", "-1", "strategy -1 is out of range: expected 0 to 3"},
        {"optimizer", "4", "optimizer 4 is out of range: expected 0 to 3"},
        {"optimizer_state", "3", "optimizer_state 3 is out of range: expected 0 to 2"},
        {"lora.quantize", "7", "lora.quantize 7 is out of range: expected 0 to 2"},
        {"lora.targets", "64", "lora.targets 64 is out of range: expected 0 to 63"},
        {"devices", "65", "devices 65 is out of range: expected 1 to 64"},
        {"micro_batch_size", "0", "micro_batch_size 0 is out of range: expected 1 to 2147483647"},
        {"recompute", "2", "recompute 2 is out of range: expected 0 to 1"},
        {"beta1", "1", "beta1 1 is out of range: expected a finite number at least 0 and below 1"},
        {"lora.dropout", "-0.5", "lora.dropout -0.5 is out of range: expected a finite number "
                                  "at least 0 and below 1"},
        {"lr", "nan", "lr nan is out of range: expected a finite number at least 0"},
        {"rho", "0", "rho 0 is out of range: expected a finite number at least 1.17549e-38"},
        {"sample_tokens", "1000001", "sample_tokens 1000001 is out of range: expected 1 to 1000000"},
        {"min_lr", "1", "settings that do not go together: --min-lr (1) exceeds --lr (0.004)"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        snprintf(want[k], sizeof want[k], "%s%s", file, cases[k].why);
        crafted_settings_refused(r, cases[k].key, cases[k].value, 1, want[k]);
    }
    /* a step whose COMPLETE leaves run_settings.txt out: not read unverified */
    system("rm -rf " HOSTILE_DIR "/settings-copy && cp -r " HOSTILE_DIR "/settings/step-2 "
           HOSTILE_DIR "/settings-copy");
    if (reseal(HOSTILE_DIR "/settings-copy", LG_RUN_SETTINGS) != 0) check(r, 0, "could not reseal");
    else expect_cli(r, "--max-steps 3 --resume " HOSTILE_DIR "/settings-copy", 2, "train: "
                    "checkpoint " HOSTILE_DIR "/settings-copy: " LG_RUN_SETTINGS " is not listed "
                    "in COMPLETE, so it cannot be verified");
}

/* Weights of 1e18, finite and so accepted, overflow the forward: the validation loss is
   NaN at the resumed step, the log says null (JSON has no NaN) and the run stops with exit 1. */
static void test_hostile_nan_run(results *r) {
    const char *run = "-b 4 -t 16 --max-steps 2 --eval-every 0";
    char args[512], line[512] = "";
    system("rm -rf " HOSTILE_DIR "/nan");
    snprintf(args, sizeof args, "%s --out " HOSTILE_DIR "/nan", run);
    expect_cli(r, args, 0, "saved " HOSTILE_DIR "/nan/step-2");
    if (st_rewrite(HOSTILE_DIR "/nan/step-2/" LG_TRAINING_STATE, NULL, NULL, "master.", 1e18,
                   (lg_st_dtype)0) != 0 ||
        st_rewrite(HOSTILE_DIR "/nan/step-2/model.safetensors", NULL, NULL, "", 1e18,
                   (lg_st_dtype)0) != 0 || reseal(HOSTILE_DIR "/nan/step-2", NULL) != 0) {
        check(r, 0, "could not craft the state of 1e18 weights");
        return;
    }
    snprintf(args, sizeof args, "-b 4 -t 16 --max-steps 3 --resume " HOSTILE_DIR "/nan/step-2 "
             "--log " HOSTILE_DIR "/nan.jsonl");
    expect_cli(r, args, 1, "validation loss is NaN at step 2");
    FILE *f = fopen(HOSTILE_DIR "/nan.jsonl", "r");
    if (f && !fgets(line, sizeof line, f)) line[0] = '\0';
    if (f) fclose(f);
    check(r, strstr(line, "\"val_loss\":null") != NULL, "the log writes null for NaN: %s", line);
    expect_cli(r, "--max-steps 1 --log /dev/full", 1, "/dev/full: cannot write: No space left");
    expect_cli(r, "--max-steps 1 --plot build/no-such-dir/loss.svg", 2,
               "--plot build/no-such-dir/loss.svg: cannot create files there");
    expect_cli(r, "--max-steps 1 --out tests/test.c/out", 2, "--out tests/test.c/out: cannot create");
}

static void test_hostile_all(results *r) {
    test_hostile_configs(r);
    test_hostile_hf_configs(r);
    test_hostile_training_state(r);
    test_hostile_adapters(r);
    test_hostile_run_settings(r);
    test_hostile_nan_run(r);
    expect_alpaca_error(r, "[{\"instruction\": \"a\\u0000b\", \"output\": \"c\"}]",
                        "\\u0000 (a NUL character) inside a string", "NUL escape");
}

/* build/fuzz (tests/fuzz.c, built with ASan and UBSan by make test): every reader's target
   runs its seeds and FUZZ_ITERATIONS mutants without a sanitizer report or a crash. */
#define FUZZ_ITERATIONS 4000
static void test_fuzz_targets(results *r) {
    static const char *const targets[] = {"config-yaml", "config-json", "safetensors",
                                           "peft-adapters", "training-state", "checkpoint-marker",
                                           "alpaca-json", "chat-json", "token-files",
                                           "tokenizer-json", "run-settings"};
    const int n_targets = (int)(sizeof targets / sizeof *targets);
    char out[16384] = "", cmd[128], want[96];
    snprintf(cmd, sizeof cmd, "ASAN_OPTIONS=detect_leaks=1 ./build/fuzz %d 2>&1", FUZZ_ITERATIONS);
    double start = lg_time_ms();
    FILE *p = popen(cmd, "r");
    size_t n = 0, got;
    while (p && n < sizeof out - 1 && (got = fread(out + n, 1, sizeof out - 1 - n, p)) > 0) n += got;
    out[n] = '\0';
    int status = p ? pclose(p) : -1;
    double seconds = (lg_time_ms() - start) / 1e3;
    int ran = 0;
    for (int i = 0; i < n_targets; i++) {
        snprintf(want, sizeof want, "fuzz %s: %d mutants and ", targets[i], FUZZ_ITERATIONS);
        const char *line = strstr(out, want), *end = line ? strchr(line, '\n') : NULL;
        const char *none = line ? strstr(line, ", 0 findings") : NULL;
        ran += end && none && none < end;
    }
    check(r, status == 0 && ran == n_targets,
          "fuzz targets under ASan and UBSan: %d of %d readers ran %d mutants and their seeds with "
          "no finding, %.1f s (exit %d)%s%.600s", ran, n_targets, FUZZ_ITERATIONS, seconds, status,
          status ? ": " : "", status ? out : "");
}
