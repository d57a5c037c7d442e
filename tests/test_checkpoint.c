/* tests/test_checkpoint.c — checkpoints: safetensors, Hugging Face layouts, resume, torn and
   corrupted files. Included by tests/test.c in its single-precision section (it uses that
   file's check, reference reader and training helpers). */

#include <signal.h>

static const char *const ckpt_families[] = {"test-gpt2", "test-pythia", "test-llama",
                                            "test-falcon", "test-llama31"};
#define N_CKPT_FAMILIES ((int)(sizeof ckpt_families / sizeof ckpt_families[0]))
static const lg_precision ckpt_precisions[5] = {LG_PRECISION_32_TRUE, LG_PRECISION_BF16_MIXED,
                                                LG_PRECISION_16_MIXED, LG_PRECISION_BF16_TRUE,
                                                LG_PRECISION_16_TRUE};

/* Writes bytes to path (a test file, not a checkpoint). */
static int write_file_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    int ok = f && fwrite(data, 1, n, f) == n;
    if (f) fclose(f);
    return ok ? 0 : -1;
}

/* A safetensors file from a header text and n zero data bytes. */
static void write_safetensors_raw(const char *path, const char *header, size_t data_bytes) {
    size_t len = strlen(header), total = 8 + len + data_bytes;
    unsigned char *buf = (unsigned char *)lg_alloc_zeroed(total);
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)((uint64_t)len >> (8 * i));
    memcpy(buf + 8, header, len);
    write_file_bytes(path, buf, total);
    LG_FREE(buf);
}

/* Fills test tensors with their index bytes. */
static int fill_pattern(void *ctx, int index, unsigned char *out, lg_error *err) {
    const lg_st_tensor *t = &((const lg_st_tensor *)ctx)[index];
    for (uint64_t i = 0; i < t->end - t->begin; i++) out[i] = (unsigned char)(i * 7 + (uint64_t)index);
    (void)err;
    return 0;
}

/* Writer and reader agree; malformed files are refused with the file name and the reason. */
static void test_safetensors_format(results *r) {
    lg_st_tensor t[3];
    memset(t, 0, sizeof t);
    snprintf(t[0].name, sizeof t[0].name, "a.weight");
    t[0].dtype = LG_ST_F32; t[0].ndim = 2; t[0].shape[0] = 2; t[0].shape[1] = 3;
    snprintf(t[1].name, sizeof t[1].name, "b");
    t[1].dtype = LG_ST_BF16; t[1].ndim = 1; t[1].shape[0] = 5;
    snprintf(t[2].name, sizeof t[2].name, "c.codes");
    t[2].dtype = LG_ST_U8; t[2].ndim = 1; t[2].shape[0] = 7;
    lg_st_meta meta[1] = {{"step", "12"}};
    lg_error err;
    lg_file_digest d;
    mkdir("build", 0755);
    int rc = lg_st_write("build/st-format.safetensors", t, 3, meta, 1, fill_pattern, t, &d, &err);
    lg_st_file f;
    int ok = rc == 0 && lg_st_open(&f, "build/st-format.safetensors", &err) == 0;
    if (ok) {
        const lg_st_tensor *b = lg_st_find(&f, "b");
        unsigned char got[64], want[64];
        fill_pattern(t, 1, want, &err);
        ok = f.n_tensors == 3 && b && b->dtype == LG_ST_BF16 && b->shape[0] == 5 &&
             b->end - b->begin == 10 && lg_st_read(&f, b, got, &err) == 0 && memcmp(got, want, 10) == 0 &&
             lg_st_meta_get(&f, "step") && strcmp(lg_st_meta_get(&f, "step"), "12") == 0 &&
             f.data_start % 8 == 0 && f.file_bytes == d.bytes;
        lg_st_close(&f);
    }
    check(r, ok, "safetensors: F32, BF16 and U8 tensors and metadata written and read back (%llu bytes)",
          (unsigned long long)d.bytes);
    static const struct { const char *header; size_t data; const char *want; } bad[] = {
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 8, "not valid JSON"},
        {"{\"x\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8, "dtype 'F64'"},
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8, "do not hold 3 F32"},
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4, "truncated"},
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, "overlap or gap"},
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 12, "trailing"},
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, "appears twice"},
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, "not a size"},
        {"[1,2]", 0, "does not start with '{'"},
    };
    int refused = 0, n_bad = (int)(sizeof bad / sizeof bad[0]);
    for (int i = 0; i < n_bad; i++) {
        write_safetensors_raw("build/st-bad.safetensors", bad[i].header, bad[i].data);
        int named = lg_st_open(&f, "build/st-bad.safetensors", &err) != 0 &&
                    strstr(err.msg, "build/st-bad.safetensors") && strstr(err.msg, bad[i].want);
        if (!named) printf("    case %d: %s\n", i, err.msg);
        refused += named;
    }
    unsigned char huge[8] = {0xFF, 0xFF, 0xFF, 0xFF, 0, 0, 0, 0};
    write_file_bytes("build/st-bad.safetensors", huge, 8);
    refused += lg_st_open(&f, "build/st-bad.safetensors", &err) != 0 && strstr(err.msg, "header length");
    write_file_bytes("build/st-bad.safetensors", huge, 5);
    refused += lg_st_open(&f, "build/st-bad.safetensors", &err) != 0 && strstr(err.msg, "shorter than");
    check(r, refused == n_bad + 2, "safetensors: %d of %d malformed files refused with the file name "
          "and the reason (last: %s)", refused, n_bad + 2, err.msg);
}

static lg_args ckpt_args(lg_precision p, lg_optimizer_kind kind) {
    lg_args a;
    lg_args_default(&a);
    a.precision = p;
    a.optimizer = kind;
    a.micro_batch_size = 2;
    a.global_batch_size = 4;
    a.warmup_steps = 2;
    a.max_steps = 6;
    return a;
}

/* Save -> load gives bitwise the same weights, for each family and each precision, with the
   file in the run's weight dtype. */
static void test_checkpoint_round_trips(results *r) {
    int ok = 1, runs = 0;
    const char *dtypes[5] = {"F32", "BF16", "F16", "BF16", "F16"};
    for (int i = 0; i < N_CKPT_FAMILIES; i++) {
        lg_config cfg;
        if (load_config_or_fail(r, &cfg, ckpt_families[i])) return;
        for (int k = 0; k < 5; k++) {
            lg_args a = ckpt_args(ckpt_precisions[k], LG_OPTIMIZER_ADAMW);
            lg_trainer saved, loaded;
            lg_error err;
            a.seed = 1;
            int rc = lg_trainer_create(&saved, &cfg, &a, 8, &err);
            a.seed = 2;
            rc |= lg_trainer_create(&loaded, &cfg, &a, 8, &err);
            rc = rc || lg_hf_save(&saved.ranks[0].model, "build/roundtrip", &err) ||
                 lg_trainer_load_hf(&loaded, "build/roundtrip", &err);
            lg_st_file f;
            int dtype_ok = rc == 0 && lg_st_open(&f, "build/roundtrip/model.safetensors", &err) == 0;
            if (dtype_ok) {
                dtype_ok = strcmp(lg_st_dtype_name(f.tensors[0].dtype), dtypes[k]) == 0;
                lg_st_close(&f);
            }
            int same = rc == 0 && dtype_ok && same_bits(saved.ranks[0].model.params, loaded.ranks[0].model.params, saved.ranks[0].model.n_params);
            if (!same) printf("    %s %s: %s\n", ckpt_families[i], lg_precision_name(a.precision), rc ? err.msg : "differs");
            ok = ok && same;
            runs++;
            lg_trainer_free(&saved);
            lg_trainer_free(&loaded);
        }
    }
    check(r, ok, "save -> load: bitwise the same weights, file in the run's weight dtype (%d runs: %d "
          "families x 5 precisions)", runs, N_CKPT_FAMILIES);
}

/* The Python-written Hugging Face directories load through --load's code and reproduce the
   reference logits; our writer produces the same tensors as that independent conversion. */
static void test_hf_directories(results *r) {
    const char *dirs[N_CKPT_FAMILIES] = {"tests/hf/gpt2", "tests/hf/pythia", "tests/hf/llama",
                                         "tests/hf/falcon", "tests/hf/llama31"};
    for (int i = 0; i < N_CKPT_FAMILIES; i++) {
        char path[256];
        ref_file rf = {NULL, 0};
        lg_config want, cfg;
        lg_error err;
        snprintf(path, sizeof path, "tests/reference/%s.bin", ckpt_families[i]);
        if (ref_load(&rf, path) != 0 || load_config_or_fail(r, &want, ckpt_families[i])) {
            check(r, 0, "%s: cannot read", path);
            return;
        }
        int rc = lg_hf_config_read(&cfg, dirs[i], &err);
        lg_config same = cfg;
        memcpy(same.name, want.name, sizeof same.name);
        same.vocab_size = want.vocab_size;
        int config_ok = rc == 0 && memcmp(&same, &want, sizeof want) == 0 && cfg.vocab_size == want.padded_vocab_size;
        const ref_tensor *idx = ref_find(&rf, "idx"), *logits = ref_find(&rf, "logits");
        lg_model m;
        double e = 1;
        if (rc == 0 && lg_model_create(&m, &cfg, 2, 8, &err) == 0) {
            rc = lg_hf_load_weights(&cfg, m.params, dirs[i], &err);
            if (rc == 0) {
                lg_model_forward(&m, (const int *)idx->data, NULL, 2, 8, NULL);
                e = rel_error(reals(m.a.logits), (const float *)logits->data, logits->count, 1e-6);
            }
            lg_model_free(&m);
        }
        check(r, rc == 0 && config_ok && e < 1e-5, "%-16s Hugging Face directory: config.json = %s.yaml, "
              "logits vs PyTorch rel err %.1e (< 1e-5)%s%s", dirs[i], ckpt_families[i], e,
              rc ? ": " : "", rc ? err.msg : "");
        /* our writer, from the reference weights, against the script's tensors */
        int tensors_same = lg_model_create(&m, &want, 2, 8, &err) == 0, compared = 0;
        for (int k = 0; tensors_same && k < m.param_table.n_tensors; k++) {
            const lg_tensor_info *t = &m.param_table.tensors[k];
            const ref_tensor *w = ref_find(&rf, t->name);
            for (size_t j = 0; w && j < t->count; j++) reals(m.params)[t->offset + j] = ((const float *)w->data)[j];
        }
        lg_hf_files theirs = {NULL, 0};
        lg_st_file ours;
        tensors_same = tensors_same && lg_hf_save(&m, "build/hf-ours", &err) == 0 &&
                       lg_st_open(&ours, "build/hf-ours/model.safetensors", &err) == 0;
        if (tensors_same && lg_hf_files_open(&theirs, dirs[i], &err) == 0) {
            for (int k = 0; k < ours.n_tensors && tensors_same; k++) {
                int file = 0;
                const lg_st_tensor *a = &ours.tensors[k], *b = lg_hf_files_find(&theirs, a->name, &file);
                size_t n = (size_t)(a->end - a->begin);
                unsigned char *x = (unsigned char *)LG_MALLOC(n + 1), *y = (unsigned char *)LG_MALLOC(n + 1);
                tensors_same = b && b->end - b->begin == n && lg_st_read(&ours, a, x, &err) == 0 &&
                               lg_st_read(&theirs.files[file], b, y, &err) == 0 && memcmp(x, y, n) == 0;
                if (!tensors_same) printf("    differs: %s\n", a->name);
                compared++;
                LG_FREE(x);
                LG_FREE(y);
            }
            int theirs_count = 0;
            for (int k = 0; k < theirs.n; k++) theirs_count += theirs.files[k].n_tensors;
            tensors_same = tensors_same && theirs_count == ours.n_tensors;
            lg_hf_files_close(&theirs);
        } else {
            tensors_same = 0;
        }
        if (ours.file) lg_st_close(&ours);
        check(r, tensors_same, "%-16s lg_hf_save writes bitwise the script's %d tensors", dirs[i], compared);
        lg_model_free(&m);
        ref_free(&rf);
    }
}

/* dir/config.json -> cfg, compared with configs/NAME.yaml as a config.json can hold it (the
   name is the model_type, the vocabulary the padded one). */
static int hf_config_matches(const char *dir, const char *name, lg_error *err) {
    lg_config want, cfg;
    char path[256];
    snprintf(path, sizeof path, "configs/%s.yaml", name);
    if (lg_config_load(&want, path, err) != 0 || lg_hf_config_read(&cfg, dir, err) != 0) return 0;
    memcpy(want.name, cfg.name, sizeof want.name);
    want.vocab_size = want.padded_vocab_size;
    return memcmp(&want, &cfg, sizeof cfg) == 0;
}

/* tests/hf/FAMILY/config.json with each edits[2k] replaced by edits[2k + 1] (n pairs), as
   build/hf-variant/config.json; -1 when one is not there. */
static int hf_config_variant(const char *family, const char *const *edits, int n) {
    char path[256], text[4096], next[4096];
    lg_error err;
    size_t len;
    snprintf(path, sizeof path, "tests/hf/%s/config.json", family);
    char *json = lg_read_file(path, &len, "test", &err);
    if (!json) return -1;
    snprintf(text, sizeof text, "%s", json);
    LG_FREE(json);
    for (int k = 0; k < n; k++) {
        char *at = strstr(text, edits[2 * k]);
        if (!at) return -1;
        snprintf(next, sizeof next, "%.*s%s%s", (int)(at - text), text, edits[2 * k + 1],
                 at + strlen(edits[2 * k]));
        memcpy(text, next, sizeof text);
    }
    system("mkdir -p build/hf-variant");
    return write_file_bytes("build/hf-variant/config.json", text, strlen(text));
}

/* Falcon's and Llama 3.1's config.json: what lg_hf_save writes reads back as the config;
   RWForCausalLM's older names read; the layouts not built are refused naming the field. */
static void test_hf_falcon_llama31_configs(results *r) {
    const char *names[2] = {"test-falcon", "test-llama31"};
    for (int i = 0; i < 2; i++) {
        lg_config cfg;
        lg_model m;
        lg_error err;
        memset(&m, 0, sizeof m);
        if (load_config_or_fail(r, &cfg, names[i])) return;
        int ok = lg_model_create(&m, &cfg, 1, 4, &err) == 0;
        ok = ok && system("rm -rf build/hf-written") == 0 && lg_hf_save(&m, "build/hf-written", &err) == 0;
        remove("build/hf-written/model_config.yaml"); /* config.json alone */
        ok = ok && hf_config_matches("build/hf-written", names[i], &err);
        check(r, ok, "%-12s the config.json lg_hf_save writes reads back as %s.yaml%s%s", names[i],
              names[i], ok ? "" : ": ", ok ? "" : err.msg);
        if (m.params.data) lg_model_free(&m);
    }
    lg_error err;
    static const char *const rw[] = {"\"FalconForCausalLM\"", "\"RWForCausalLM\"", "\"falcon\"",
                                     "\"RefinedWebModel\"", "\"num_hidden_layers\"", "\"n_layer\"",
                                     "\"num_attention_heads\"", "\"n_head\""};
    int ok = hf_config_variant("falcon", rw, 4) == 0 && hf_config_matches("build/hf-variant", "test-falcon", &err);
    check(r, ok, "RWForCausalLM's config.json (RefinedWebModel, n_layer, n_head) reads as test-falcon%s%s",
          ok ? "" : ": ", ok ? "" : err.msg);
    /* rope_theta inside rope_parameters is the one read (the stale one outside is not 10000) */
    static const char *const v5[] = {"\"rope_theta\": 10000.0,", "\"rope_theta\": 500000.0,",
                                     "\"rope_scaling\": {", "\"rope_parameters\": {\"rope_theta\": 10000.0, "};
    ok = hf_config_variant("llama31", v5, 2) == 0 && hf_config_matches("build/hf-variant", "test-llama31", &err);
    check(r, ok, "transformers 5's rope_parameters (rope_theta and llama3 inside) reads as test-llama31%s%s",
          ok ? "" : ": ", ok ? "" : err.msg);
    static const struct { const char *family, *from, *to, *want; } refused[] = {
        {"falcon", "\"new_decoder_architecture\": false", "\"new_decoder_architecture\": true",
         "new_decoder_architecture true is not supported"},
        {"falcon", "\"alibi\": false", "\"alibi\": true", "alibi true is not supported"},
        {"falcon", "\"multi_query\": true", "\"multi_query\": false", "multi_query false is not supported"},
        {"falcon", "\"parallel_attn\": true", "\"parallel_attn\": false", "parallel_attn false is not supported"},
        {"llama31", "\"llama3\"", "\"yarn\"", "rope_scaling.rope_type 'yarn' is not supported"},
        {"falcon", "\"rope_theta\": 10000.0", "\"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 2.0}",
         "rope_scaling.rope_type 'linear' is not supported"},
        {"llama31", "\"original_max_position_embeddings\"", "\"original_max\"",
         "rope_scaling.original_max_position_embeddings is missing"},
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        lg_config cfg;
        const char *edit[2] = {refused[i].from, refused[i].to};
        int rc = 0;
        if (hf_config_variant(refused[i].family, edit, 1) != 0) snprintf(err.msg, sizeof err.msg, "no %s", edit[0]);
        else rc = lg_hf_config_read(&cfg, "build/hf-variant", &err);
        check(r, rc != 0 && strstr(err.msg, refused[i].want) && strstr(err.msg, "config.json"),
              "tests/hf/%s with %s refused: \"%s\"", refused[i].family, refused[i].to, err.msg);
    }
}

/* 6 steps uninterrupted against 3 steps, a checkpoint, a fresh trainer and loader resumed from
   it with args b (other ranks, say), 3 more steps: bitwise the same losses and weights, or
   within 1e-5 relative when the ranks add gradients in another order. The data wraps around
   its epoch. */
static int resume_matches_on(const lg_config *cfg, const lg_args *a, const lg_args *b,
                             int bitwise, const char *label) {
    const int steps = 6, half = 3, T = 8;
    double uninterrupted[6], resumed[6];
    lg_trainer full, first, second;
    lg_loader l1, l2, l3;
    lg_error err;
    size_t tokens = 10 * (size_t)T + 1; /* 10 windows: 4 a step, a new epoch every 2.5 steps */
    int rc = lg_trainer_create(&full, cfg, a, T, &err);
    builtin_loader(&l1, cfg, T, 7, tokens, a->seed);
    rc = rc || run_step_range(&full, &l1, 0, steps, uninterrupted);
    rc = rc || lg_trainer_create(&first, cfg, a, T, &err);
    builtin_loader(&l2, cfg, T, 7, tokens, a->seed);
    rc = rc || run_step_range(&first, &l2, 0, half, resumed) ||
         lg_checkpoint_save(&first, &l2, half, "build/resume", &err);
    lg_trainer_free(&first);
    lg_loader_close(&l2);
    builtin_loader(&l3, cfg, T, 7, tokens, a->seed);
    int step = -1;
    rc = rc || lg_trainer_create(&second, cfg, b, T, &err);
    if (rc == 0) { /* other weights: the resumed run must not depend on its initialisation */
        lg_real *noise = new_reals(second.ranks[0].model.n_params);
        lg_rng rng;
        lg_rng_seed(&rng, 99);
        fill_normal(noise, second.ranks[0].model.n_params, 0.02f, &rng);
        lg_trainer_set_weights(&second, lg_buf_of(noise));
        LG_FREE(noise);
    }
    rc = rc || lg_checkpoint_resume(&second, &l3, "build/resume/step-3", &step, &err) || step != half ||
         run_step_range(&second, &l3, half, steps, resumed);
    int same = rc == 0;
    if (same) {
        lg_real *w_full = trained_weights(&full), *w_second = trained_weights(&second);
        size_t n = full.ranks[0].model.n_params, local = full.ranks[0].model.n_local;
        double loss_err = 0;
        for (int s = half; s < steps; s++)
            loss_err = fmax(loss_err, fabs(resumed[s] - uninterrupted[s]) / uninterrupted[s]);
        if (bitwise)
            same = loss_err == 0 && memcmp(w_full, w_second, n * sizeof(lg_real)) == 0 &&
                   (!full.ranks[0].opt.master ||
                    memcmp(full.ranks[0].opt.master, second.ranks[0].opt.master, local * sizeof(lg_real)) == 0);
        else
            same = loss_err < 1e-5 && rel_error(w_second, w_full, n, 1e-6) < 1e-5;
        LG_FREE(w_full);
        LG_FREE(w_second);
    }
    if (!same) printf("    resume differs: %s%s%s\n", label, rc ? ": " : "", rc ? err.msg : "");
    lg_trainer_free(&full);
    if (rc == 0) lg_trainer_free(&second);
    lg_loader_close(&l1);
    lg_loader_close(&l3);
    return same;
}

static int resume_matches(const lg_config *cfg, const lg_args *a, const char *label) {
    return resume_matches_on(cfg, a, a, 1, label);
}

/* Sharded runs resume bitwise on the same ranks, and on other ranks within rounding: the state
   is whole tensors, re-sharded on reading. */
static void test_resume_sharded(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-pythia")) return;
    int ok = 1, runs = 0;
    for (int opt = 0; opt < 2; opt++)
        for (int s = 0; s < 4; s++) {
            lg_args a = ckpt_args(LG_PRECISION_32_TRUE, opt ? LG_OPTIMIZER_SGD : LG_OPTIMIZER_ADAMW);
            a.micro_batch_size = 1; /* the global batch of 4 over 1, 2 or 4 ranks */
            ranks_of((lg_strategy)s, 2, &a);
            char label[96];
            snprintf(label, sizeof label, "%s -d %d --nodes %d %s", lg_strategy_name(a.strategy),
                     a.devices, a.nodes, lg_optimizer_name(a.optimizer));
            ok = resume_matches(&cfg, &a, label) && ok;
            runs++;
        }
    check(r, ok, "resume = uninterrupted, bitwise, on 2 ranks: 4 strategies x AdamW, SGD (%d runs)", runs);
    lg_args a = ckpt_args(LG_PRECISION_32_TRUE, LG_OPTIMIZER_ADAMW);
    a.micro_batch_size = 1;
    a.lr = 3e-4f; /* see test_sharding_equals_one_rank */
    a.min_lr = a.lr / 10;
    ranks_of(LG_STRATEGY_FULL_SHARD, 2, &a);
    lg_args b = a;
    ranks_of(LG_STRATEGY_FULL_SHARD, 4, &b);
    int reshard = resume_matches_on(&cfg, &a, &b, 0, "full-shard 2 -> 4 ranks");
    lg_args one = a;
    ranks_of(LG_STRATEGY_FULL_SHARD, 1, &one);
    reshard = resume_matches_on(&cfg, &b, &one, 0, "full-shard 4 ranks -> 1") && reshard;
    check(r, reshard, "a full-shard checkpoint of 2 ranks resumes on 4, one of 4 on 1: losses and "
          "weights within 1e-5 of the uninterrupted run");
    a.optimizer_state = LG_STATE_8BIT;
    lg_trainer tr;
    lg_error err;
    int refused = lg_trainer_create(&tr, &cfg, &a, 8, &err) == 0 &&
                  lg_checkpoint_save(&tr, NULL, 0, "build/refused", &err) != 0 &&
                  strstr(err.msg, "`optimizer_state bf16|8bit`") != NULL;
    lg_trainer_free(&tr);
    check(r, refused, "a sharded run with 8-bit state has no whole-layout state: \"%s\"", err.msg);
}

static void test_resume_bitwise(results *r) {
    int ok = 1, runs = 0;
    for (int opt = 0; opt < 2; opt++)
        for (int k = 0; k < 5; k++) {
            lg_config cfg;
            const char *family = ckpt_families[(k + opt) % 3];
            if (load_config_or_fail(r, &cfg, family)) return;
            lg_args a = ckpt_args(ckpt_precisions[k], opt ? LG_OPTIMIZER_SGD : LG_OPTIMIZER_ADAMW);
            char label[96];
            snprintf(label, sizeof label, "%s %s %s", family, lg_precision_name(a.precision), lg_optimizer_name(a.optimizer));
            ok = resume_matches(&cfg, &a, label) && ok;
            runs++;
        }
    check(r, ok, "resume = uninterrupted, bitwise (losses of steps 4-6, weights, master weights): AdamW "
          "and SGD x 5 precisions (%d runs, data across epochs)", runs);
    /* the compact states, Lion, Sophia and the offloaded optimizer */
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    lg_args a = ckpt_args(LG_PRECISION_BF16_MIXED, LG_OPTIMIZER_ADAMW);
    cfg.intermediate_size = 256; /* tensors of 4096 elements: compact state */
    a.optimizer_state = LG_STATE_8BIT;
    int compact = resume_matches(&cfg, &a, "8-bit AdamW");
    a.optimizer_state = LG_STATE_BF16;
    compact = resume_matches(&cfg, &a, "bf16-state AdamW") && compact;
    lg_args b = ckpt_args(LG_PRECISION_16_MIXED, LG_OPTIMIZER_LION);
    compact = resume_matches(&cfg, &b, "Lion") && compact;
    b = ckpt_args(LG_PRECISION_32_TRUE, LG_OPTIMIZER_SOPHIA);
    b.hessian_interval = 2;
    compact = resume_matches(&cfg, &b, "Sophia") && compact;
    b = ckpt_args(LG_PRECISION_BF16_TRUE, LG_OPTIMIZER_ADAMW);
    b.offload = 1;
    compact = resume_matches(&cfg, &b, "offload") && compact;
    check(r, compact, "resume = uninterrupted, bitwise: 8-bit and bf16 AdamW state, Lion, Sophia, --offload");
}

/* Each step-N under dir either verifies or is refused as incomplete (never torn); counts both. */
static int steps_complete_or_refused(const char *dir, int *complete, int *incomplete) {
    int ok = 1;
    for (int s = 2; s < 400; s++) {
        char path[256];
        struct stat st;
        lg_error err;
        snprintf(path, sizeof path, "%s/step-%d", dir, s);
        if (stat(path, &st) != 0) continue;
        if (lg_checkpoint_verify(path, NULL, &err) == 0) (*complete)++;
        else if (strstr(err.msg, "no COMPLETE marker")) (*incomplete)++;
        else { printf("    torn: %s\n", err.msg); ok = 0; }
    }
    return ok;
}

/* A child saves step-2, step-3, ... as fast as it can; SIGKILL at several moments. Every
   directory is then complete and verified, or refused as incomplete; the latest complete one
   (step-1 at worst) resumes. */
static void test_kill_during_save(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    cfg.intermediate_size = 2048; /* larger files: the kills land inside writes */
    lg_args a = ckpt_args(LG_PRECISION_BF16_MIXED, LG_OPTIMIZER_ADAMW);
    lg_trainer tr, fresh;
    lg_loader ld, l2;
    lg_error err;
    double losses[2];
    if (lg_trainer_create(&tr, &cfg, &a, 8, &err) != 0 || lg_trainer_create(&fresh, &cfg, &a, 8, &err) != 0) {
        check(r, 0, "kill test: %s", err.msg);
        return;
    }
    builtin_loader(&ld, &cfg, 8, 7, 200, a.seed);
    builtin_loader(&l2, &cfg, 8, 7, 200, a.seed);
    if (system("rm -rf build/kill") != 0) printf("    cannot clear build/kill\n");
    int ok = run_step_range(&tr, &ld, 0, 1, losses) == 0 && lg_checkpoint_save(&tr, &ld, 1, "build/kill", &err) == 0;
    static const int delays_us[8] = {0, 1000, 5000, 20000, 50000, 100000, 200000, 400000};
    int complete = 0, incomplete = 0, resumed = 0;
    for (int i = 0; i < 8 && ok; i++) {
        if (system("cd build/kill && ls | grep -v '^step-1$' | xargs rm -rf") != 0) ok = 0;
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0)
            for (int s = 2;; s++) lg_checkpoint_save(&tr, &ld, s, "build/kill", &err);
        double until = lg_time_ms() + delays_us[i] / 1000.0; /* (usleep is not C11) */
        while (lg_time_ms() < until) continue;
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        char found[1200];
        int step = -1;
        ok = steps_complete_or_refused("build/kill", &complete, &incomplete) &&
             lg_checkpoint_verify("build/kill/step-1", NULL, &err) == 0 &&
             lg_checkpoint_find("build/kill", found, sizeof found, &err) == 0 &&
             lg_checkpoint_resume(&fresh, &l2, found, &step, &err) == 0;
        resumed += ok && step >= 1;
        if (!ok) printf("    after a kill at %d us: %s\n", delays_us[i], err.msg);
    }
    check(r, ok && resumed == 8, "SIGKILL while saving, at 8 moments (0-400 ms): step-1 verifies and the "
          "latest complete step-N resumes each time; %d later checkpoints complete, %d refused as "
          "incomplete, none torn", complete, incomplete);
    lg_loader_close(&l2);
    lg_loader_close(&ld);
    lg_trainer_free(&fresh);
    lg_trainer_free(&tr);
}

static void truncate_file(const char *path, long bytes) {
    int fd = open(path, O_WRONLY);
    if (fd < 0) return;
    if (ftruncate(fd, bytes) != 0) printf("    cannot truncate %s\n", path);
    close(fd);
}

static void flip_bit(const char *path, long at) {
    FILE *f = fopen(path, "r+b");
    if (!f) return;
    fseek(f, at, SEEK_SET);
    int c = fgetc(f);
    fseek(f, at, SEEK_SET);
    fputc(c ^ 0x10, f);
    fclose(f);
}

static int refused_with(const char *what, int rc, const lg_error *err, const char *a, const char *b) {
    int ok = rc != 0 && strstr(err->msg, a) && strstr(err->msg, b);
    if (!ok) printf("    %s: %s\n", what, rc ? err->msg : "accepted");
    return ok;
}

/* Truncated, bit-flipped, unmarked and foreign checkpoints are refused, naming file and reason. */
static void test_corrupt_checkpoints(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-pythia")) return;
    lg_args a = ckpt_args(LG_PRECISION_BF16_MIXED, LG_OPTIMIZER_ADAMW);
    lg_trainer tr;
    lg_loader ld;
    lg_error err;
    if (lg_trainer_create(&tr, &cfg, &a, 8, &err) != 0) return;
    builtin_loader(&ld, &cfg, 8, 7, 200, a.seed);
    int step, ok = 1;
    system("rm -rf build/corrupt build/corrupt-hf");
    lg_checkpoint_save(&tr, &ld, 5, "build/corrupt", &err);
    system("cp -r build/corrupt/step-5 build/corrupt/copy");
    truncate_file("build/corrupt/copy/model.safetensors", 1000);
    ok &= refused_with("truncated", lg_checkpoint_resume(&tr, &ld, "build/corrupt/copy", &step, &err), &err,
                       "model.safetensors", "truncated");
    char message[600];
    snprintf(message, sizeof message, "%s", err.msg);
    system("rm -rf build/corrupt/copy && cp -r build/corrupt/step-5 build/corrupt/copy");
    flip_bit("build/corrupt/copy/" LG_TRAINING_STATE, 3000);
    ok &= refused_with("bit flip", lg_checkpoint_resume(&tr, &ld, "build/corrupt/copy", &step, &err), &err,
                       LG_TRAINING_STATE, "corrupted");
    snprintf(message + strlen(message), sizeof message - strlen(message), " | %s", err.msg);
    system("rm -rf build/corrupt/copy && cp -r build/corrupt/step-5 build/corrupt/copy");
    flip_bit("build/corrupt/copy/model.safetensors", 20);
    ok &= refused_with("header bit flip", lg_trainer_load_hf(&tr, "build/corrupt/copy", &err), &err,
                       "model.safetensors", "corrupted");
    remove("build/corrupt/copy/" LG_CHECKPOINT_MARKER);
    ok &= refused_with("no marker", lg_checkpoint_resume(&tr, &ld, "build/corrupt/copy", &step, &err), &err,
                       "build/corrupt/copy", "no COMPLETE marker");
    /* a Hugging Face directory has no marker: the reader's own checks */
    system("mkdir -p build/corrupt-hf && cp build/corrupt/step-5/config.json build/corrupt/step-5/model.safetensors "
           "build/corrupt-hf/");
    truncate_file("build/corrupt-hf/model.safetensors", 5000);
    ok &= refused_with("hf truncated", lg_trainer_load_hf(&tr, "build/corrupt-hf", &err), &err,
                       "build/corrupt-hf/model.safetensors", "truncated");
    /* a directory without a tensor the config needs */
    lg_st_tensor only;
    memset(&only, 0, sizeof only);
    snprintf(only.name, sizeof only.name, "transformer.wte.weight");
    only.ndim = 2;
    only.shape[0] = 32;
    only.shape[1] = 16;
    system("mkdir -p build/missing-hf && cp tests/hf/gpt2/config.json build/missing-hf/");
    lg_st_write("build/missing-hf/model.safetensors", &only, 1, NULL, 0, fill_pattern, &only, NULL, &err);
    lg_config gpt2;
    lg_model small;
    if (lg_hf_config_read(&gpt2, "build/missing-hf", &err) == 0 && lg_model_create(&small, &gpt2, 1, 4, &err) == 0) {
        ok &= refused_with("missing tensor", lg_hf_load_weights(&gpt2, small.params, "build/missing-hf", &err),
                           &err, "build/missing-hf", "no tensor transformer.wpe.weight");
        lg_model_free(&small);
    } else {
        ok = 0;
    }
    write_file_bytes("build/corrupt-hf/config.json", "{\"architectures\": [\"BertModel\"], \"vocab_size\": 32}", 50);
    lg_config other;
    ok &= refused_with("architecture", lg_hf_config_read(&other, "build/corrupt-hf", &err), &err,
                       "config.json", "'BertModel' is not one of");
    /* a state written by another run's settings */
    lg_trainer sgd;
    lg_args b = ckpt_args(LG_PRECISION_BF16_MIXED, LG_OPTIMIZER_SGD);
    if (lg_trainer_create(&sgd, &cfg, &b, 8, &err) == 0) {
        ok &= refused_with("other optimizer", lg_checkpoint_resume(&sgd, &ld, "build/corrupt/step-5", &step, &err),
                           &err, "optimizer adamw", "this run has sgd");
        lg_trainer_free(&sgd);
    }
    check(r, ok, "truncated, bit-flipped, unmarked, foreign, incomplete checkpoints refused with file and reason: %.300s", message);
    lg_loader_close(&ld);
    lg_trainer_free(&tr);
}

/* Lines of steps first..first+1 of a JSONL log, without their timings (from ,"ms" on). */
static void log_two_steps(const char *path, int first, char keep[2][512]) {
    char line[512];
    keep[0][0] = keep[1][0] = '\0';
    FILE *f = fopen(path, "r");
    while (f && fgets(line, sizeof line, f)) {
        int s;
        char *ms = strstr(line, ",\"ms\"");
        if (ms && sscanf(line, "{\"step\":%d", &s) == 1 && s >= first && s <= first + 1) {
            *ms = 0;
            snprintf(keep[s - first], 512, "%s", line);
        }
    }
    if (f) fclose(f);
}

/* Steps 3-4 of two logs are the same (and there). */
static int logs_agree(const char *a, const char *b, char *shown, size_t cap) {
    char keep_a[2][512], keep_b[2][512];
    log_two_steps(a, 3, keep_a);
    log_two_steps(b, 3, keep_b);
    snprintf(shown, cap, "%s", keep_b[1]);
    return keep_a[1][0] && strcmp(keep_a[0], keep_b[0]) == 0 && strcmp(keep_a[1], keep_b[1]) == 0;
}

/* --resume DIR alone takes the run's settings from the checkpoint (run_settings.txt): the
   uninterrupted run's losses, checkpoints where the run wrote them; -c accepted when it is
   the checkpoint's model; flags that would change the model refused naming them; steps may
   grow. */
static void test_resume_without_flags(results *r) {
    static char out[16384];
    char shown[512];
    system("rm -rf build/cli-settings");
    const char *run = "-c test-gpt2 -t 16 -b 2 -g 4 --max-steps 4 --eval-every 0 --sample-tokens 1 "
                      "--lr 0.01 --warmup-steps 2 -o lion --save-every 2 --out build/cli-settings";
    char args[512];
    snprintf(args, sizeof args, "%s --log build/cli-settings-a.jsonl", run);
    int a = run_capture(args, out, sizeof out);
    system("rm -rf build/cli-settings/step-4");
    int b = run_capture("--resume build/cli-settings/step-2 --log build/cli-settings-b.jsonl", out, sizeof out);
    int same = a == 0 && b == 0 && logs_agree("build/cli-settings-a.jsonl", "build/cli-settings-b.jsonl",
                                             shown, sizeof shown);
    struct stat st;
    int saved = stat("build/cli-settings/step-4/" LG_CHECKPOINT_MARKER, &st) == 0 &&
                strstr(out, "checkpoints to build/cli-settings");
    check(r, same && saved, "./train --resume step-2 and no other flag (-c, -t, -b, -g, -o, --lr, "
          "--warmup-steps from the checkpoint): steps 3-4 log the uninterrupted run's, step-4 "
          "saved where the run saved (%s)", shown);
    int c = run_capture("-c test-gpt2 --resume build/cli-settings/step-2 --max-steps 5 --log "
                        "build/cli-settings-c.jsonl --out build/cli-settings-more", out, sizeof out);
    char steps[2][512]; /* steps 4 and 5 (the schedule now ends at 5: other rates) */
    log_two_steps("build/cli-settings-c.jsonl", 4, steps);
    check(r, c == 0 && steps[1][0] && strstr(out, "saved build/cli-settings-more/step-5"),
          "-c the checkpoint's model, --max-steps 5 and another --out accepted with --resume: "
          "steps 3-5 run (%s), step-5 saved there (exit %d)", steps[1], c);
    expect_cli(r, "-c test-llama --resume build/cli-settings/step-2", 2,
               "-c/--config test-llama: the checkpoint build/cli-settings/step-2 holds another model");
    expect_cli(r, "--resume build/cli-settings/step-2 -t 8", 2,
               "-t/--max-seq-length differs from the run's");
    expect_cli(r, "--resume build/cli-settings/step-2 -g 8", 2,
               "-g/--global-batch-size differs from the run's");
    expect_cli(r, "--resume build/cli-settings/step-2 -o adamw", 2, "-o/--optimizer differs from the run's");
    expect_cli(r, "--resume build/cli-settings/step-2 -p 32-true", 2, "-p/--precision differs from the run's");
    expect_cli(r, "--resume build/cli-settings/step-2 --load tests/hf/gpt2", 2,
               "--load and --resume: a resumed run already has its weights");
}

/* The driver's options (train.c's evaluation, sampling and saving: not lg_args) keep their
   lines in the place run_settings.txt always had them, after max_steps, and come back to the
   driver as text (lg_run_settings_driver); the step-2 of test_resume_without_flags. */
static void test_driver_settings(results *r) {
    const char *dir = "build/cli-settings/step-2";
    size_t n = 0;
    char *text = lg_read_file("build/cli-settings/step-2/" LG_RUN_SETTINGS, &n, "settings", NULL);
    const char *lines = "\nmax_steps 4\neval_every 0\neval_iters 10\nsample_every 0\n"
                        "sample_tokens 1\ntemperature 0\nsave_every 2\nrecompute 0\n";
    check(r, text && strstr(text, lines), "%s/" LG_RUN_SETTINGS ": the driver's options in their "
          "old place between max_steps and recompute", dir);
    free(text);
    lg_run_settings *s = (lg_run_settings *)malloc(sizeof *s);
    lg_error err;
    int rc = s ? lg_run_settings_read(dir, s, &err) : -1;
    const char *save = rc == 0 ? lg_run_settings_driver(s, "save_every") : NULL;
    const char *tokens = rc == 0 ? lg_run_settings_driver(s, "sample_tokens") : NULL;
    check(r, save && tokens && strcmp(save, "2") == 0 && strcmp(tokens, "1") == 0 &&
                 !lg_run_settings_driver(s, "max_steps") && !lg_run_settings_driver(s, "nothing"),
          "lg_run_settings_driver: save_every \"%s\", sample_tokens \"%s\"; none for a setting "
          "of lg_args or an unknown key", save ? save : "(none)", tokens ? tokens : "(none)");
    free(s);
}

/* The file's size and lg_hash64 of its bytes (0 and 0 when unreadable). */
static void file_identity(const char *path, unsigned long long *bytes, unsigned long long *hash) {
    size_t n = 0;
    char *data = lg_read_file(path, &n, "data", NULL);
    *bytes = data ? n : 0;
    *hash = data ? lg_hash64(LG_HASH64_INIT, data, n) : 0;
    free(data);
}

/* A token shard of 2,000 tokens below 32 (test-gpt2's vocabulary) drawn from seed at path. */
static int write_data_shard(const char *path, uint64_t seed) {
    uint32_t tokens[2000];
    lg_rng rng;
    lg_error err;
    lg_rng_seed(&rng, seed);
    for (int i = 0; i < 2000; i++) tokens[i] = (uint32_t)(lg_rng_u64(&rng) % 32);
    return lg_shard_write(path, tokens, 2000, 2, &err);
}

/* --resume checks its training data: run_settings.txt records the file's size and hash
   (data_bytes, data_hash: equal to the file's own); the same file, or a copy at another
   path, resumes; a file re-prepared at the same path (same size, other tokens) is refused
   naming the file, the checkpoint and both identities, exit 2, unless --data-changed says it
   changed on purpose; --data-changed without --resume is refused. */
static void test_resume_data_identity(results *r) {
    static char out[16384];
    unsigned long long bytes, hash, new_bytes, new_hash;
    system("rm -rf build/cli-data build/cli-data.bin build/cli-data-copy.bin");
    if (write_data_shard("build/cli-data.bin", 1) != 0) { check(r, 0, "cannot write build/cli-data.bin"); return; }
    file_identity("build/cli-data.bin", &bytes, &hash);
    int a = run_capture("-c test-gpt2 --data build/cli-data.bin -t 16 -b 2 --max-steps 2 --eval-every 0 "
                        "--eval-iters 1 --sample-tokens 1 --save-every 1 --out build/cli-data", out, sizeof out);
    size_t settings_n;
    char *settings = lg_read_file("build/cli-data/step-1/" LG_RUN_SETTINGS, &settings_n, "settings", NULL);
    char want[1024];
    snprintf(want, sizeof want, "\ndata_bytes %llu\ndata_hash %016llx\n", bytes, hash);
    check(r, a == 0 && settings && strstr(settings, want), "step-1/" LG_RUN_SETTINGS " records the "
          "data's size and hash (%llu bytes, %016llx), exit %d", bytes, hash, a);
    free(settings);
    expect_cli(r, "--resume build/cli-data/step-1", 0, "resumed build/cli-data/step-1: 1 steps done");
    system("cp build/cli-data.bin build/cli-data-copy.bin");
    expect_cli(r, "--resume build/cli-data/step-1 --data build/cli-data-copy.bin", 0,
               "resumed build/cli-data/step-1: 1 steps done");
    write_data_shard("build/cli-data.bin", 2); /* re-prepared: the same size, other tokens */
    file_identity("build/cli-data.bin", &new_bytes, &new_hash);
    snprintf(want, sizeof want, "train: data build/cli-data.bin: not the data checkpoint "
             "build/cli-data/step-1 was trained on (%llu bytes, hash %016llx; the run's: %llu bytes, "
             "hash %016llx, in its " LG_RUN_SETTINGS "); give --data-changed to resume on it on "
             "purpose (see ./train --help)", new_bytes, new_hash, bytes, hash);
    check(r, new_bytes == bytes && new_hash != hash, "the re-prepared file has the same size, another hash");
    expect_cli(r, "--resume build/cli-data/step-1", 2, want);
    expect_cli(r, "--resume build/cli-data/step-1 --data-changed", 0,
               "resumed build/cli-data/step-1: 1 steps done");
    expect_cli(r, "--data build/cli-data.bin -c test-gpt2 --data-changed", 2,
               "--data-changed goes with --resume: a fresh run has no data to compare with");
}

/* Every tensor of dir/model.safetensors is of dtype (and there is one). */
static int all_tensors_of(const char *dir, lg_st_dtype dtype, int *n_tensors, lg_st_dtype *first) {
    char path[512];
    lg_st_file f;
    lg_error err;
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    *n_tensors = 0;
    if (lg_st_open(&f, path, &err) != 0) return 0;
    int all = f.n_tensors > 0;
    *n_tensors = f.n_tensors;
    *first = f.n_tensors > 0 ? f.tensors[0].dtype : dtype;
    for (int i = 0; i < f.n_tensors; i++) all = all && f.tensors[i].dtype == dtype;
    lg_st_close(&f);
    return all;
}

/* dir/NAME's text equals want, and COMPLETE lists it (the directory verifies). */
static int file_is(const char *dir, const char *name, const char *want, char *got, size_t cap) {
    char path[512];
    size_t n = 0;
    lg_error err;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    char *text = lg_read_file(path, &n, "file", NULL);
    snprintf(got, cap, "%s", text ? text : "(none)");
    int same = text && !strcmp(text, want);
    free(text);
    FILE *f = NULL;
    char marker[4096] = "", line[300];
    snprintf(path, sizeof path, "%s/" LG_CHECKPOINT_MARKER, dir);
    if ((f = fopen(path, "r"))) { marker[fread(marker, 1, sizeof marker - 1, f)] = '\0'; fclose(f); }
    snprintf(line, sizeof line, "file %s ", name);
    return same && strstr(marker, line) && lg_checkpoint_verify(dir, NULL, &err) == 0;
}

/* Step directories keep what a model loaded with --load generates by: its eos ids (config.json's
   bos_token_id and eos_token_id become the step's generation_config.json, a base's own
   generation_config.json is carried as it is, listed in COMPLETE, and again on --resume); a
   LoRA run's merged model of an F32 base is F32 (bf16-mixed training wrote it in BF16). */
static void test_step_generation_settings(results *r) {
    static char out[16384];
    char got[1024];
    const char *want = "{\n  \"bos_token_id\": 4,\n  \"eos_token_id\": [5, 6]\n}\n";
    system("rm -rf build/eos-base build/eos-run build/eos-lora && mkdir -p build/eos-base && "
           "cp tests/hf/gpt2/model.safetensors build/eos-base/");
    size_t n = 0;
    char *config = lg_read_file("tests/hf/gpt2/config.json", &n, "config", NULL);
    char *end = config ? strrchr(config, '}') : NULL;
    if (!end) { check(r, 0, "tests/hf/gpt2/config.json unreadable"); free(config); return; }
    while (end > config && isspace((unsigned char)end[-1])) end--;
    FILE *f = fopen("build/eos-base/config.json", "w");
    if (f) { fprintf(f, "%.*s,\n  \"bos_token_id\": 4,\n  \"eos_token_id\": [5, 6]\n}\n", (int)(end - config), config); fclose(f); }
    free(config);
    int a = run_capture("--load build/eos-base -b 2 -t 8 --max-steps 1 --eval-iters 1 --out build/eos-run", out, sizeof out);
    check(r, a == 0 && file_is("build/eos-run/step-1", "generation_config.json", want, got, sizeof got),
          "step-1 of a --load run keeps config.json's eos ids as generation_config.json, in COMPLETE "
          "(exit %d): %s", a, got);
    int b = run_capture("--resume build/eos-run/step-1 --max-steps 2", out, sizeof out);
    check(r, b == 0 && file_is("build/eos-run/step-2", "generation_config.json", want, got, sizeof got),
          "--resume: step-2 carries them on (exit %d): %s", b, got);
    const char *own = "{\"eos_token_id\": 3, \"max_new_tokens\": 9}\n";
    write_text("build/eos-base/generation_config.json", own);
    int c = run_capture("--load build/eos-base --lora-r 2 -b 2 -t 8 --max-steps 1 --eval-iters 1 "
                        "--out build/eos-lora", out, sizeof out);
    int n_tensors = 0;
    lg_st_dtype first = LG_ST_F32, base_first = LG_ST_BF16;
    int base_f32 = all_tensors_of("build/eos-base", LG_ST_F32, &n_tensors, &base_first);
    check(r, c == 0 && strstr(out, "bf16-mixed") && base_f32 &&
          all_tensors_of("build/eos-lora/step-1", LG_ST_F32, &n_tensors, &first),
          "LoRA over an F32 base, trained in bf16-mixed: the merged model.safetensors is F32, as "
          "the base (%d tensors, the first of dtype %d; exit %d)", n_tensors, (int)first, c);
    check(r, c == 0 && file_is("build/eos-lora/step-1", "generation_config.json", own, got, sizeof got),
          "the base's own generation_config.json is carried byte for byte: %s", got);
}

/* The flags: --save-every and --out, --resume (a step or the latest), --load. */
static void test_checkpoint_cli(results *r) {
    static char out[16384];
    system("rm -rf build/cli-ckpt");
    int a = run_capture("-b 4 -t 16 --max-steps 4 --eval-every 0 --save-every 2 --out build/cli-ckpt "
                        "--log build/cli-a.jsonl", out, sizeof out);
    int saved = a == 0 && strstr(out, "saved build/cli-ckpt/step-2") && strstr(out, "saved build/cli-ckpt/step-4");
    int b = run_capture("-b 4 -t 16 --max-steps 4 --eval-every 0 --resume build/cli-ckpt/step-2 "
                        "--log build/cli-b.jsonl", out, sizeof out);
    int resumed = b == 0 && strstr(out, "resumed build/cli-ckpt/step-2: 2 steps done");
    /* steps 3 and 4: the same loss and gradient norm in both logs */
    char line_a[512], line_b[512], keep_a[2][512] = {"", ""}, keep_b[2][512] = {"", ""};
    FILE *fa = fopen("build/cli-a.jsonl", "r"), *fb = fopen("build/cli-b.jsonl", "r");
    while (fa && fgets(line_a, sizeof line_a, fa)) {
        int s;
        char *ms = strstr(line_a, ",\"ms\"");
        if (ms && sscanf(line_a, "{\"step\":%d", &s) == 1 && s >= 3 && s <= 4) { *ms = 0; snprintf(keep_a[s - 3], 512, "%s", line_a); }
    }
    while (fb && fgets(line_b, sizeof line_b, fb)) {
        int s;
        char *ms = strstr(line_b, ",\"ms\"");
        if (ms && sscanf(line_b, "{\"step\":%d", &s) == 1 && s >= 3 && s <= 4) { *ms = 0; snprintf(keep_b[s - 3], 512, "%s", line_b); }
    }
    if (fa) fclose(fa);
    if (fb) fclose(fb);
    int same = keep_a[1][0] && strcmp(keep_a[0], keep_b[0]) == 0 && strcmp(keep_a[1], keep_b[1]) == 0;
    check(r, saved && resumed && same, "./train --save-every 2 --out, then --resume step-2: steps 3-4 log the "
          "same (%s)", keep_b[1]);
    int c = run_capture("-b 4 -t 16 --max-steps 4 --resume build/cli-ckpt", out, sizeof out);
    check(r, c == 0 && strstr(out, "resumed build/cli-ckpt/step-4: 4 steps done"),
          "./train --resume DIR continues from the latest complete step-N (exit %d)", c);
    expect_cli(r, "--load tests/hf/llama -b 2 -t 8 --max-steps 1 --eval-iters 1", 0, "sample");
    expect_cli(r, "--load tests/hf/falcon -b 2 -t 8 --max-steps 1 --eval-iters 1", 0, "sample");
    expect_cli(r, "--load build/no-such-dir -b 2 -t 8", 2, "build/no-such-dir/config.json: cannot open");
    expect_cli(r, "--load tests/hf/llama -c test-llama", 2, "--load brings its model's config.json");
}

static void test_checkpoints(results *r) {
    test_safetensors_format(r);
    test_checkpoint_round_trips(r);
    test_hf_directories(r);
    test_hf_falcon_llama31_configs(r);
    test_resume_bitwise(r);
    test_resume_sharded(r);
    test_kill_during_save(r);
    test_corrupt_checkpoints(r);
    test_checkpoint_cli(r);
    test_resume_without_flags(r);
    test_driver_settings(r);
    test_resume_data_identity(r);
    test_step_generation_settings(r);
}
