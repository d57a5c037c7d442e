/* tests/fuzz.c — a fuzz target per reader of outside input: config YAML, config.json,
   safetensors, PEFT adapter files, the training state, the checkpoint's COMPLETE marker,
   JSON/Alpaca, chat JSONL, token shards and sample files, tokenizer.json and a step's
   run_settings.txt. Each target mutates its seeds (files the trainer
   writes here, the repository's configs and Hugging Face directories, and the crafted inputs
   of tests/test_hostile.c) with a fixed random stream, writes each mutant where the reader
   looks, and calls the reader: a refusal is fine, a crash or a sanitizer report is a finding.
   `make test` builds it with -fsanitize=address,undefined (every report aborts) and
   tests/test runs it: `build/fuzz [ITERATIONS [TARGET|all [STREAM]]]`, the same inputs on
   every machine (STREAM 0; others for longer searches by hand). It prints
   one line a target, "fuzz NAME: N mutants and S seeds, A accepted, R refused, 0 findings"; a finding
   aborts with the sanitizer's report, and the input that caused it is the target's file
   under build/fuzzing/. */
#define _POSIX_C_SOURCE 200809L
#define LITGPT_IMPLEMENTATION
#include "../litgpt.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FUZZ_DIR "build/fuzzing"
#define FUZZ_MAX_SEEDS 64 /* the seeds, then accepted mutants in turn (they go deeper) */
#define FUZZ_MAX_BYTES (1 << 20) /* a mutant grows up to this */

typedef struct {
    unsigned char *bytes;
    size_t n;
} fuzz_bytes;

typedef struct {
    fuzz_bytes seeds[FUZZ_MAX_SEEDS];
    int n;
} fuzz_corpus;

/* What the readers that need a model read into: a plain trainer and a LoRA one (test-llama). */
typedef struct {
    lg_trainer plain, lora;
    lg_loader data; /* the plain trainer's data */
    lg_real *whole; /* (the LoRA model's n_params) lg_peft_read's output */
} fuzz_models;

typedef struct fuzz_target {
    const char *name;
    const char *path; /* the mutant's file: where the reader looks */
    int (*read)(fuzz_models *m, const struct fuzz_target *t, lg_error *err);
    const char *const *words; /* a dictionary of tokens the format uses (NULL-terminated) */
} fuzz_target;

/* xorshift64: the mutations' one stream, seeded per target */
static uint64_t fuzz_random(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static int fuzz_add_bytes(fuzz_corpus *c, const void *bytes, size_t n) {
    if (c->n == FUZZ_MAX_SEEDS || n > FUZZ_MAX_BYTES) return -1;
    unsigned char *copy = (unsigned char *)malloc(n + 1);
    if (!copy) return -1;
    memcpy(copy, bytes, n);
    copy[n] = '\0';
    c->seeds[c->n].bytes = copy;
    c->seeds[c->n++].n = n;
    return 0;
}

static int fuzz_add_text(fuzz_corpus *c, const char *text) { return fuzz_add_bytes(c, text, strlen(text)); }

/* A file as a seed; missing files are reported (the seeds must exist). */
static int fuzz_add_file(fuzz_corpus *c, const char *path) {
    size_t n;
    lg_error err;
    char *bytes = lg_read_file(path, &n, "fuzz seed", &err);
    if (!bytes) {
        fprintf(stderr, "fuzz: seed %s: %s\n", path, err.msg);
        return -1;
    }
    int rc = fuzz_add_bytes(c, bytes, n);
    free(bytes);
    return rc;
}

static void fuzz_corpus_free(fuzz_corpus *c) {
    for (int i = 0; i < c->n; i++) free(c->seeds[i].bytes);
    c->n = 0;
}

static int fuzz_write(const char *path, const unsigned char *bytes, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t put = fwrite(bytes, 1, n, f);
    return fclose(f) == 0 && put == n ? 0 : -1;
}

/* ---- mutations ----------------------------------------------------------------------------- */

static const char *const fuzz_numbers[] = {
    "-1", "0", "1", "65536", "2147483647", "2147483648", "4294967296", "-2147483649",
    "9223372036854775807", "18446744073709551616", "1e309", "-1e309", "nan", "inf", "1e-46",
    "-0", "0x7fffffff", "99999999999999999999999", "3.4e38", "1.5",
};
static const unsigned char fuzz_special_bytes[] = {0, 0xff, 0x7f, 0x80, '"', '\\', '{', '}', '[',
                                                   ']', ':', ',', '-', '0', '9', '\n', ' ', '#', 'e'};
static const uint64_t fuzz_special_words[] = {0, 1, 0x7f, 0xff, 0x7fff, 0xffff, 0x7fffffff,
                                              0x80000000u, 0xffffffffu, 0x100000000ull,
                                              0x7fffffffffffffffull, 0xffffffffffffffffull};

/* Replaces bytes [at, at + len) of b with the n bytes of with (b holds FUZZ_MAX_BYTES). */
static void fuzz_splice(fuzz_bytes *b, size_t at, size_t len, const void *with, size_t n) {
    if (at > b->n) at = b->n;
    if (len > b->n - at) len = b->n - at;
    if (b->n - len + n > FUZZ_MAX_BYTES) return;
    memmove(b->bytes + at + n, b->bytes + at + len, b->n - at - len);
    memcpy(b->bytes + at, with, n);
    b->n = b->n - len + n;
}

/* A run of digits (with sign, point, exponent) at or after at: its start and length. */
static size_t fuzz_number_at(const fuzz_bytes *b, size_t at, size_t *len) {
    while (at < b->n && !(b->bytes[at] >= '0' && b->bytes[at] <= '9')) at++;
    size_t end = at;
    while (end < b->n && strchr("0123456789.eE+-", b->bytes[end]) && b->bytes[end]) end++;
    *len = end - at;
    return at;
}

/* One mutation of b, chosen by the stream: bits, bytes, ranges, numbers, words, splices. */
static void fuzz_mutate_once(fuzz_bytes *b, const fuzz_corpus *c, const char *const *words,
                             uint64_t *s) {
    size_t at = b->n ? (size_t)(fuzz_random(s) % b->n) : 0, len;
    unsigned char chunk[64];
    switch (fuzz_random(s) % 9) {
    case 0: if (b->n) b->bytes[at] ^= (unsigned char)(1u << (fuzz_random(s) % 8)); break;
    case 1:
        if (b->n) b->bytes[at] = fuzz_special_bytes[fuzz_random(s) % sizeof fuzz_special_bytes];
        break;
    case 2: fuzz_splice(b, at, 1 + fuzz_random(s) % 16, "", 0); break;
    case 3: /* a piece of itself elsewhere */
        len = b->n ? 1 + fuzz_random(s) % (b->n < sizeof chunk ? b->n : sizeof chunk) : 0;
        if (len && at + len <= b->n) {
            memcpy(chunk, b->bytes + at, len);
            fuzz_splice(b, (size_t)(fuzz_random(s) % (b->n + 1)), 0, chunk, len);
        }
        break;
    case 4: { /* a number in place of a number */
        size_t start = fuzz_number_at(b, at, &len);
        const char *with = fuzz_numbers[fuzz_random(s) % (sizeof fuzz_numbers / sizeof *fuzz_numbers)];
        if (len) fuzz_splice(b, start, len, with, strlen(with));
        break;
    }
    case 5: { /* an integer of 4 or 8 bytes (binary headers) */
        uint64_t v = fuzz_special_words[fuzz_random(s) % (sizeof fuzz_special_words / sizeof *fuzz_special_words)];
        size_t width = fuzz_random(s) % 2 ? 8 : 4;
        if (fuzz_random(s) % 4 == 0) v = b->n + (fuzz_random(s) % 16) - 8;
        if (at + width <= b->n) memcpy(b->bytes + at, &v, width);
        break;
    }
    case 6: /* a word of the format, inserted or over a word */
        if (words && words[0]) {
            int n_words = 0;
            while (words[n_words]) n_words++;
            const char *w = words[fuzz_random(s) % (uint64_t)n_words];
            fuzz_splice(b, at, fuzz_random(s) % 2 ? strlen(w) : 0, w, strlen(w));
        }
        break;
    case 7: if (b->n) b->n = at; break; /* truncated */
    default: { /* the head of this one, the tail of another seed */
        const fuzz_bytes *o = &c->seeds[fuzz_random(s) % (uint64_t)c->n];
        size_t from = o->n ? (size_t)(fuzz_random(s) % o->n) : 0;
        fuzz_splice(b, at, b->n - at, o->bytes + from, o->n - from);
    }
    }
}

/* A mutant of a seed: 1 to 4 mutations. */
static void fuzz_mutant(fuzz_bytes *out, const fuzz_corpus *c, const char *const *words, uint64_t *s) {
    const fuzz_bytes *seed = &c->seeds[fuzz_random(s) % (uint64_t)c->n];
    memcpy(out->bytes, seed->bytes, seed->n);
    out->n = seed->n;
    int times = 1 + (int)(fuzz_random(s) % 4);
    for (int i = 0; i < times; i++) fuzz_mutate_once(out, c, words, s);
}

/* ---- the readers --------------------------------------------------------------------------- */

/* A config read: checked, then planned (the layouts' products) when it passes. */
static int fuzz_plan(const lg_config *cfg, lg_error *err) {
    lg_args a;
    lg_args_default(&a);
    a.micro_batch_size = 1;
    a.global_batch_size = 1;
    if (lg_config_check(cfg, err) != 0) return -1;
    lg_plan_spec spec;
    lg_plan plan;
    lg_plan_spec_from_args(&spec, &a, cfg->block_size < 64 ? cfg->block_size : 64);
    if (lg_plan_make(&plan, cfg, &spec, err) != 0) return -1;
    lg_plan_free(&plan);
    return 0;
}

static int fuzz_read_yaml(fuzz_models *m, const fuzz_target *t, lg_error *err) {
    lg_config cfg;
    (void)m;
    if (lg_config_load(&cfg, t->path, err) != 0) return -1;
    return fuzz_plan(&cfg, err);
}

static int fuzz_read_config_json(fuzz_models *m, const fuzz_target *t, lg_error *err) {
    lg_config cfg;
    (void)m, (void)t;
    if (lg_hf_config_read(&cfg, FUZZ_DIR "/hf", err) != 0) return -1;
    return fuzz_plan(&cfg, err);
}

static int fuzz_read_safetensors(fuzz_models *m, const fuzz_target *t, lg_error *err) {
    lg_st_file f;
    (void)m;
    if (lg_st_open(&f, t->path, err) != 0) return -1;
    int rc = 0;
    (void)lg_st_meta_get(&f, "format");
    for (int i = 0; i < f.n_tensors && rc == 0; i++) {
        const lg_st_tensor *x = &f.tensors[i];
        unsigned char *bytes = (unsigned char *)malloc((size_t)(x->end - x->begin) + 1);
        rc = bytes ? lg_st_read(&f, x, bytes, err) : lg_fail(err, "out of memory");
        if (rc == 0 && lg_st_find(&f, x->name) == NULL) rc = lg_fail(err, "fuzz: %s not found", x->name);
        (void)lg_st_count(x);
        free(bytes);
    }
    lg_st_close(&f);
    return rc;
}

static int fuzz_read_peft(fuzz_models *m, const fuzz_target *t, lg_error *err) {
    (void)t;
    return lg_peft_read(&m->lora.ranks[0].model, FUZZ_DIR "/peft", m->whole, err);
}

static int fuzz_read_state(fuzz_models *m, const fuzz_target *t, lg_error *err) {
    int step;
    return lg_training_state_read(&m->plain, &m->data, &step, t->path, err);
}

static int fuzz_read_marker(fuzz_models *m, const fuzz_target *t, lg_error *err) {
    int step;
    (void)m, (void)t;
    return lg_checkpoint_verify(FUZZ_DIR "/step", &step, err);
}

static int fuzz_read_alpaca(fuzz_models *m, const fuzz_target *t, lg_error *err) {
    lg_alpaca set;
    (void)m;
    if (lg_alpaca_read(&set, t->path, err) != 0) return -1;
    int rc = 0;
    for (size_t i = 0; i < set.n && rc == 0; i++) {
        lg_text prompt;
        memset(&prompt, 0, sizeof prompt);
        rc = lg_alpaca_prompt(&set.samples[i], &prompt);
        lg_text_free(&prompt);
    }
    lg_alpaca_free(&set);
    return rc ? lg_fail(err, "fuzz: no prompt") : 0;
}

/* Chat conversations: read, then each rendered with every template (no tokenizer). */
static int fuzz_read_chat(fuzz_models *m, const fuzz_target *t, lg_error *err) {
    lg_chat_set set;
    (void)m;
    if (lg_chat_read(&set, t->path, err) != 0) return -1;
    lg_chat_rendered out;
    memset(&out, 0, sizeof out);
    for (size_t i = 0; i < set.n; i++)
        for (int k = 0; k < LG_TEMPLATE_COUNT; k++) {
            lg_error ignored; /* a template may refuse a conversation (alpaca: one turn) */
            lg_chat_render((lg_chat_template)k, &set.chats[i], NULL, 1, &out, &ignored);
        }
    lg_chat_rendered_free(&out);
    lg_chat_free(&set);
    return 0;
}

/* A shard or sample file: opened, then three batches of 2 rows of 8 tokens read. */
static int fuzz_read_tokens(fuzz_models *m, const fuzz_target *t, lg_error *err) {
    lg_loader ld;
    int inputs[2 * 64], targets[2 * 64];
    (void)m;
    if (lg_loader_open(&ld, t->path, 8, 64, 1, 7, err) != 0) return -1;
    int rc = 0;
    for (int i = 0; i < 3 && rc == 0; i++) rc = lg_loader_next(&ld, 2, inputs, targets, err);
    lg_loader_close(&ld);
    return rc;
}

/* tokenizer.json (with the tokenizer_config.json the seeds put beside it): loaded, then a text
   with special tokens, digits, spaces and characters the normalizers change encoded, its ids
   decoded, and the vocabulary's ids decoded (the first 4096 and the last: a mutant's sparse
   ids may make millions). */
static int fuzz_read_tokenizer(fuzz_models *m, const fuzz_target *t, lg_error *err) {
    static const char text[] = "ab ab1231 a hi h\xC3\xA9llo e\xCC\x81 <|endoftext|><s>x</s> "
                               "\xEF\xAC\x81 AB\n\t  \xE2\x96\x81";
    lg_tokenizer tok;
    (void)m, (void)t;
    if (lg_tokenizer_load(&tok, FUZZ_DIR "/tok", err) != 0) return -1;
    lg_tokens ids = {NULL, 0, 0};
    lg_text back = {NULL, 0, 0};
    int rc = lg_tokenizer_encode(&tok, text, sizeof text - 1, &ids, err);
    if (rc == 0) rc = lg_tokenizer_decode(&tok, ids.ids, ids.n, &back, err);
    ids.n = 0;
    for (int id = 0; id < tok.vocab_size && id < 4096 && rc == 0; id++)
        rc = lg_tokens_push(&ids, id) == 0 ? 0 : lg_fail(err, "out of memory");
    if (rc == 0 && tok.vocab_size > 4096 && lg_tokens_push(&ids, tok.vocab_size - 1) != 0)
        rc = lg_fail(err, "out of memory");
    if (rc == 0) rc = lg_tokenizer_decode(&tok, ids.ids, ids.n, &back, err);
    (void)lg_tokenizer_start_id(&tok);
    (void)lg_tokenizer_find(&tok, "<unk>", 5);
    lg_tokens_free(&ids);
    lg_text_free(&back);
    lg_tokenizer_free(&tok);
    return rc;
}

/* DIR/COMPLETE's line of DIR/name rewritten for the file as it now is (its size and hash), as
   tests/test_hostile.c's reseal does, so that a mutant passes the checksum to the parser. */
static int fuzz_reseal(const char *dir, const char *name) {
    char path[512], want[300], line[300];
    size_t n = 0, file_n = 0;
    lg_error err;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    char *file = lg_read_file(path, &file_n, "fuzz file", &err);
    uint64_t hash = file ? lg_hash64(LG_HASH64_INIT, file, file_n) : 0; /* as lg_file_digest_of */
    LG_FREE(file);
    snprintf(path, sizeof path, "%s/" LG_CHECKPOINT_MARKER, dir);
    snprintf(want, sizeof want, "\nfile %s ", name);
    char *text = file ? lg_read_file(path, &n, "fuzz marker", &err) : NULL;
    char *at = text ? strstr(text, want) : NULL, *end = at ? strchr(at + 1, '\n') : NULL;
    int len = snprintf(line, sizeof line, "\nfile %s %llu %016llx", name,
                       (unsigned long long)file_n, (unsigned long long)hash);
    fuzz_bytes marker = {end ? (unsigned char *)malloc(n + sizeof line) : NULL, n};
    int rc = marker.bytes ? 0 : -1;
    if (rc == 0) {
        memcpy(marker.bytes, text, n);
        fuzz_splice(&marker, (size_t)(at - text), (size_t)(end - at), line, (size_t)len);
        rc = fuzz_write(path, marker.bytes, marker.n);
    }
    free(marker.bytes);
    LG_FREE(text);
    return rc;
}

/* A step's run_settings.txt, sealed in its COMPLETE: read (each line parsed, the fields'
   ranges, lg_args_check), then compared with the plain trainer's run. */
static int fuzz_read_run_settings(fuzz_models *m, const fuzz_target *t, lg_error *err) {
    (void)t;
    if (fuzz_reseal(FUZZ_DIR "/settings", LG_RUN_SETTINGS) != 0)
        return lg_fail(err, "fuzz: cannot reseal " FUZZ_DIR "/settings");
    lg_run_settings *s = (lg_run_settings *)malloc(sizeof *s);
    if (!s) return lg_fail(err, "out of memory");
    int rc = lg_run_settings_read(FUZZ_DIR "/settings", s, err);
    if (rc == 0) (void)lg_args_resume_conflict(&s->args, &m->plain.args);
    free(s);
    return rc == 0 ? 0 : -1;
}

/* ---- the targets --------------------------------------------------------------------------- */

static const char *const fuzz_yaml_words[] = {
    "n_layer: ", "n_head: ", "n_embd: ", "head_size: ", "n_query_groups: ", "null", "true",
    "false", "\n", ": ", "- ", "#", "'", "\"", "RMSNorm", "LayerNorm", "LLaMAMLP", "GptNeoxMLP",
    "rope_adjustments:\n  factor: ", "\n  low_freq_factor: ", "  ", NULL};
static const char *const fuzz_json_words[] = {
    "\"", "{", "}", "[", "]", ",", ":", "null", "true", "\\u0000", "\\ud800", "\\", "1e999",
    "\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":0}", "\"rope_scaling\":{\"type\":5}",
    "\"architectures\":[\"LlamaForCausalLM\"]", "\"hidden_size\":2000000000",
    "\"instruction\":", "\"input\":", "\"output\":", "\n", NULL};
static const char *const fuzz_st_words[] = {
    "\"dtype\":\"U8\"", "\"dtype\":\"I64\"", "\"dtype\":\"BF16\"", "\"dtype\":\"F16\"",
    "\"shape\":[", "\"data_offsets\":[0,", "\"__metadata__\":{", "]", "}", ",", "\"", "null",
    "-", "\"step\":\"-1\"", "\"loss_scale\":\"nan\"", NULL};

/* A safetensors mutant: most of the time its JSON header is mutated and its length prefix set
   to match, so that the mutant reaches the checks past the header's length. */
static void fuzz_mutant_safetensors(fuzz_bytes *out, const fuzz_corpus *c, const char *const *words,
                                    uint64_t *s) {
    uint64_t header = 0;
    const fuzz_bytes *seed = &c->seeds[fuzz_random(s) % (uint64_t)c->n];
    if (seed->n >= 8) memcpy(&header, seed->bytes, 8);
    if (fuzz_random(s) % 4 == 0 || seed->n < 8 || header > seed->n - 8) {
        fuzz_mutant(out, c, words, s);
        return;
    }
    size_t data = seed->n - 8 - (size_t)header; /* the tensors' bytes, kept as they are */
    fuzz_corpus one;
    one.n = 1;
    one.seeds[0].bytes = seed->bytes + 8;
    one.seeds[0].n = (size_t)header;
    fuzz_bytes text = {out->bytes + 8, 0};
    fuzz_mutant(&text, &one, words, s); /* (out holds FUZZ_MAX_BYTES: room for the data too) */
    if (8 + text.n + data > FUZZ_MAX_BYTES) {
        memcpy(text.bytes, seed->bytes + 8, (size_t)header);
        text.n = (size_t)header;
    }
    memcpy(out->bytes + 8 + text.n, seed->bytes + 8 + header, data);
    uint64_t length = text.n;
    memcpy(out->bytes, &length, 8);
    out->n = 8 + text.n + data;
}

/* seeds[i] with its first `from` replaced by `to` (a crafted input from a real file) */
static int fuzz_add_edited(fuzz_corpus *c, int i, const char *from, const char *to) {
    const fuzz_bytes *b = &c->seeds[i];
    size_t len = strlen(from), at = 0;
    while (at + len <= b->n && memcmp(b->bytes + at, from, len) != 0) at++;
    if (at + len > b->n) {
        fprintf(stderr, "fuzz: seed %d has no '%s'\n", i, from);
        return -1;
    }
    size_t n = b->n - len + strlen(to);
    unsigned char *edited = (unsigned char *)malloc(n + 1);
    if (!edited) return -1;
    memcpy(edited, b->bytes, at);
    memcpy(edited + at, to, strlen(to));
    memcpy(edited + at + strlen(to), b->bytes + at + len, b->n - at - len);
    int rc = fuzz_add_bytes(c, edited, n);
    free(edited);
    return rc;
}

static const char *const fuzz_tokenizer_words[] = {
    "\"", "{", "}", "[", "]", ",", ":", "null", "true", "\\u0120", "\\u2581", "\\u0000", "\\",
    "<0x41>", "\"a b\"", "[\"a\",\"b\"]", "\"merges\":[", "\"vocab\":{", "\"id\":", "\"content\":",
    "\"added_tokens\":[", "{\"id\":0,\"content\":\"a\",\"special\":true}", "\"byte_fallback\":true",
    "\"ignore_merges\":true", "\"normalizer\":", "{\"type\":\"NFC\"}", "{\"type\":\"NFKC\"}",
    "{\"type\":\"Lowercase\"}", "{\"type\":\"Prepend\",\"prepend\":\"\\u2581\"}",
    "{\"type\":\"Replace\",\"pattern\":{\"String\":\" \"},\"content\":\"\\u2581\"}",
    "{\"type\":\"Sequence\",\"normalizers\":[", "\"Regex\":", "\"type\":\"BPE\"", "16777216", NULL};
/* run_settings.txt's keys: lg_run_fields' (filled by fuzz_seed_run_settings), then these */
static const char *const fuzz_settings_other_words[] = {
    "base_model load ", "base_model random", "base_hash ", "data_bytes ", "data_hash ", "\n", " ",
    "#", "nan", "inf", "-", "0x", "ffffffffffffffff"};
static const char *fuzz_settings_words[LG_N_RUN_FIELDS + sizeof fuzz_settings_other_words /
                                                          sizeof *fuzz_settings_other_words + 1];

#define SEED_PLAIN FUZZ_DIR "/seed/plain/step-1"
#define SEED_LORA FUZZ_DIR "/seed/lora/step-1"

static int fuzz_seed_yaml(fuzz_corpus *c) {
    const char *names[] = {"test-llama", "test-gpt2", "test-falcon", "test-llama31", "test-pythia",
                           "Llama-3.2-1B", "falcon-7b", "gpt2"};
    char path[256];
    int rc = 0;
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        snprintf(path, sizeof path, "configs/%s.yaml", names[i]);
        rc |= fuzz_add_file(c, path);
    }
    rc |= fuzz_add_file(c, SEED_PLAIN "/model_config.yaml");
    /* tests/test_hostile.c's: the rotary tables' overflow, sizes past a matrix, floats */
    rc |= fuzz_add_edited(c, 0, "n_head: 4\nn_query_groups: 2\nn_embd: 16\nhead_size: 4",
                          "n_head: 65536\nn_query_groups: 1\nn_embd: 16\nhead_size: 65536");
    rc |= fuzz_add_edited(c, 0, "n_embd: 16", "n_embd: 262144");
    rc |= fuzz_add_edited(c, 0, "rope_base: 10000", "rope_base: 1e40");
    rc |= fuzz_add_edited(c, 0, "norm_eps: 1e-5", "norm_eps: nan");
    rc |= fuzz_add_edited(c, 0, "n_layer: 2", "n_layer: 4096");
    return rc;
}

static int fuzz_seed_config_json(fuzz_corpus *c) {
    const char *families[] = {"gpt2", "pythia", "llama", "llama31", "falcon"};
    char path[256];
    int rc = 0;
    for (size_t i = 0; i < sizeof families / sizeof *families; i++) {
        snprintf(path, sizeof path, "tests/hf/%s/config.json", families[i]);
        rc |= fuzz_add_file(c, path);
    }
    rc |= fuzz_add_file(c, SEED_PLAIN "/config.json");
    rc |= fuzz_add_file(c, SEED_LORA "/adapter_config.json");
    /* the probe's Falcon hidden_size 2e9 (the plan's bars), a non-string rope type */
    rc |= fuzz_add_edited(c, 4, "\"hidden_size\": 24", "\"hidden_size\": 2000000000");
    rc |= fuzz_add_edited(c, 3, "\"rope_type\": \"llama3\"", "\"rope_type\": 5");
    rc |= fuzz_add_edited(c, 3, "\"factor\": 8.0", "\"factor\": 0");
    return rc;
}

/* safetensors seeds shared by three targets; with_variants adds U8 and I64 dtypes */
static int fuzz_seed_safetensors(fuzz_corpus *c, const char *first, int with_variants) {
    int rc = fuzz_add_file(c, first);
    if (rc == 0 && with_variants) { /* same length: the header's prefix stays right */
        int bf16 = c->seeds[0].n > 8 && strstr((const char *)c->seeds[0].bytes + 8, "\"dtype\":\"BF16\"");
        const char *from = bf16 ? "\"dtype\":\"BF16\"" : "\"dtype\":\"F32\"";
        rc |= fuzz_add_edited(c, 0, from, bf16 ? "\"dtype\":\"U8\"  " : "\"dtype\":\"U8\" ");
        rc |= fuzz_add_edited(c, 0, from, bf16 ? "\"dtype\":\"I64\" " : "\"dtype\":\"I64\"");
    }
    return rc;
}

static int fuzz_seed_all_safetensors(fuzz_corpus *c) {
    int rc = fuzz_seed_safetensors(c, SEED_LORA "/adapter_model.safetensors", 1);
    rc |= fuzz_add_file(c, SEED_PLAIN "/model.safetensors");
    rc |= fuzz_add_file(c, SEED_PLAIN "/" LG_TRAINING_STATE);
    rc |= fuzz_add_file(c, "tests/hf/gpt2/model.safetensors");
    rc |= fuzz_add_file(c, "tests/hf/llama/model-00002-of-00002.safetensors");
    return rc;
}

static int fuzz_seed_state(fuzz_corpus *c) {
    int rc = fuzz_seed_safetensors(c, SEED_PLAIN "/" LG_TRAINING_STATE, 1);
    rc |= fuzz_add_edited(c, 0, "\"step\":\"1\"", "\"step\":\"9\""); /* (not this run's) */
    return rc;
}

static int fuzz_seed_marker(fuzz_corpus *c) { return fuzz_add_file(c, SEED_PLAIN "/" LG_CHECKPOINT_MARKER); }

static int fuzz_seed_alpaca(fuzz_corpus *c) {
    int rc = fuzz_add_text(c, "[{\"instruction\": \"Sort the letters.\", \"input\": \"dcab\", "
                              "\"output\": \"abcd\"},\n {\"instruction\": \"Say h\\u00e9llo \\ud83d\\ude00\","
                              " \"output\": \"hello\\n\\t\\\"x\\\"\"}]\n");
    rc |= fuzz_add_text(c, "{\"instruction\": \"a\", \"input\": \"\", \"output\": \"b\"}\n"
                           "{\"instruction\": \"c\", \"output\": \"d\"}\n");
    rc |= fuzz_add_text(c, "[{\"instruction\": \"a\\u0000b\", \"output\": \"c\"}]"); /* the probe's */
    return rc;
}

static int fuzz_seed_chat(fuzz_corpus *c) {
    int rc = fuzz_add_text(c, "[{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, "
                              "{\"role\": \"user\", \"content\": \"Hi \\u00e9\"}, {\"role\": "
                              "\"assistant\", \"content\": \"Hello\\n\"}]}]\n");
    rc |= fuzz_add_text(c, "{\"conversations\": [{\"from\": \"human\", \"value\": \"a\"}, "
                           "{\"from\": \"gpt\", \"value\": \" b \"}]}\n");
    return rc;
}

/* Shards of 2- and 4-byte tokens and sample files (prompts masked and not), ids below 64. */
static int fuzz_seed_tokens(fuzz_corpus *c) {
    uint32_t tokens[100], lengths[5] = {10, 30, 5, 40, 15}, prompts[5] = {3, 10, 1, 20, 5};
    lg_error err;
    int rc = 0;
    for (int i = 0; i < 100; i++) tokens[i] = (uint32_t)(i * 37 % 64);
    const char *path = FUZZ_DIR "/seed/tokens.bin";
    rc |= lg_shard_write(path, tokens, 100, 2, &err) || fuzz_add_file(c, path);
    rc |= lg_shard_write(path, tokens, 100, 4, &err) || fuzz_add_file(c, path);
    rc |= lg_samples_write(path, tokens, lengths, prompts, 5, 2, 1, &err) || fuzz_add_file(c, path);
    rc |= lg_samples_write(path, tokens, lengths, prompts, 5, 4, 0, &err) || fuzz_add_file(c, path);
    return rc;
}

/* The vocabulary object of a byte-level tokenizer: the 256 bytes in GPT-2's alphabet (ids
   0 to 255), then `more` ("\"piece\":id,..." after them). */
static void fuzz_byte_level_vocab(char *out, size_t cap, const char *more) {
    size_t at = 0;
    at += (size_t)snprintf(out, cap, "{");
    for (int b = 0, nth = 0; b < 256 && at < cap; b++) {
        int cp = lg_byte_is_printable(b) ? b : 256 + nth++;
        at += (size_t)snprintf(out + at, cap - at, "\"\\u%04x\":%d,", cp, b);
    }
    if (at < cap) snprintf(out + at, cap - at, "%s}", more);
}

/* Small tokenizer.json files in each form the reader knows: byte-level with GPT-2's pattern and
   merges as strings and pairs, Llama 3's pattern with added specials and a normalizer Sequence
   of NFKC and Lowercase (and Qwen2's pattern), and SentencePiece style with byte fallback under
   a normalizer Sequence of NFC, Prepend and Replace; a tokenizer_config.json beside them names
   BOS and EOS. */
static int fuzz_seed_tokenizer(fuzz_corpus *c) {
    static const char llama3_pattern[] =
        "\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\","
        "\"pattern\":{\"Regex\":\"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?"
        "\\\\p{L}+|\\\\p{N}{1,3}| ?[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|"
        "\\\\s+(?!\\\\S)|\\\\s+\"}},{\"type\":\"ByteLevel\",\"use_regex\":false}]},";
    static const char merges[] = "\"merges\":[\"a b\",[\"\\u0120\",\"ab\"],\"1 2\"]";
    char vocab[4096], json[8192];
    fuzz_byte_level_vocab(vocab, sizeof vocab, "\"ab\":256,\"\\u0120ab\":257,\"12\":258");
    snprintf(json, sizeof json,
             "{\"added_tokens\":[{\"id\":259,\"content\":\"<|endoftext|>\",\"special\":true}],"
             "\"pre_tokenizer\":{\"type\":\"ByteLevel\"},\"model\":{\"type\":\"BPE\",\"vocab\":%s,%s}}\n",
             vocab, merges);
    int rc = fuzz_add_text(c, json);
    snprintf(json, sizeof json,
             "{\"added_tokens\":[{\"id\":259,\"content\":\"<s>\",\"special\":true},{\"id\":260,"
             "\"content\":\"</s>\",\"special\":true}],%s\"normalizer\":{\"type\":\"Sequence\","
             "\"normalizers\":[{\"type\":\"NFKC\"},{\"type\":\"Lowercase\"}]},\"model\":{\"type\":"
             "\"BPE\",\"ignore_merges\":true,\"vocab\":%s,%s}}\n", llama3_pattern, vocab, merges);
    rc |= fuzz_add_text(c, json);
    rc |= fuzz_add_edited(c, 1, "\\\\p{N}{1,3}", "\\\\p{N}"); /* Qwen2's pattern */
    size_t at = (size_t)snprintf(vocab, sizeof vocab, "{\"<unk>\":0,\"<s>\":1,\"</s>\":2");
    for (int b = 0; b < 256; b++)
        at += (size_t)snprintf(vocab + at, sizeof vocab - at, ",\"<0x%02X>\":%d", b, 3 + b);
    snprintf(vocab + at, sizeof vocab - at, ",\"\\u2581\":259,\"h\":260,\"i\":261,\"\\u2581h\":262,"
             "\"\\u2581hi\":263,\"\\u00e9\":264}");
    snprintf(json, sizeof json,
             "{\"added_tokens\":[{\"id\":0,\"content\":\"<unk>\",\"special\":true},{\"id\":1,"
             "\"content\":\"<s>\",\"special\":true},{\"id\":2,\"content\":\"</s>\",\"special\":"
             "true}],\"normalizer\":{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"NFC\"},"
             "{\"type\":\"Prepend\",\"prepend\":\"\\u2581\"},{\"type\":\"Replace\",\"pattern\":"
             "{\"String\":\" \"},\"content\":\"\\u2581\"}]},\"pre_tokenizer\":null,\"model\":{\"type\":"
             "\"BPE\",\"byte_fallback\":true,\"vocab\":%s,\"merges\":[\"\\u2581 h\",\"\\u2581h i\"]}}\n",
             vocab);
    rc |= fuzz_add_text(c, json);
    const char *config = "{\"bos_token\":{\"content\":\"<s>\"},\"eos_token\":\"</s>\"}\n";
    return rc | fuzz_write(FUZZ_DIR "/tok/tokenizer_config.json", (const unsigned char *)config,
                           strlen(config));
}

/* The run_settings.txt of the plain and LoRA seed checkpoints, and values at their ranges'
   edges; the dictionary gets every key of lg_run_fields. */
static int fuzz_seed_run_settings(fuzz_corpus *c) {
    int n = 0;
    for (int i = 0; i < LG_N_RUN_FIELDS; i++) fuzz_settings_words[n++] = lg_run_fields[i].key;
    for (size_t i = 0; i < sizeof fuzz_settings_other_words / sizeof *fuzz_settings_other_words; i++)
        fuzz_settings_words[n++] = fuzz_settings_other_words[i];
    fuzz_settings_words[n] = NULL;
    int rc = fuzz_add_file(c, SEED_PLAIN "/" LG_RUN_SETTINGS);
    rc |= fuzz_add_file(c, SEED_LORA "/" LG_RUN_SETTINGS);
    rc |= fuzz_add_edited(c, 0, "micro_batch_size 2\nglobal_batch_size 2\n",
                          "micro_batch_size 65536\nglobal_batch_size 2147418112\n");
    /* a library float at its edge, and a line of the driver's (kept as text) */
    rc |= fuzz_add_edited(c, 0, "max_norm 1\n", "max_norm 3.40282347e+38\ntemperature 0\n");
    rc |= fuzz_add_edited(c, 1, "lora.r 2\n", "lora.r 2147483647\n");
    rc |= fuzz_add_edited(c, 1, "base_model random", "base_model load /nonexistent");
    rc |= fuzz_add_edited(c, 1, "devices 2\nnodes 1\n", "devices 64\nnodes 64\n");
    return rc;
}

/* ---- the models, the checkpoints the seeds come from --------------------------------------- */

/* A trainer of `devices` ranks after one step, saved at out/step-1. */
static int fuzz_trainer(lg_trainer *tr, const lg_config *cfg, int lora_r, int devices,
                        lg_loader *data, const char *out, lg_error *err) {
    lg_args a;
    lg_args_default(&a);
    a.devices = devices;
    a.micro_batch_size = 2;
    a.global_batch_size = 2 * devices;
    a.max_steps = 100;
    a.lora.r = lora_r;
    lg_step_stats st;
    if (lg_trainer_create(tr, cfg, &a, 8, err) != 0) return -1;
    if (lg_trainer_step(tr, data, 0, &st, err) != 0) return -1;
    return lg_checkpoint_save(tr, data, 1, out, err);
}

static int fuzz_models_make(fuzz_models *m, lg_error *err) {
    lg_config cfg;
    memset(m, 0, sizeof *m);
    if (lg_config_load(&cfg, "configs/test-llama.yaml", err) != 0) return -1;
    uint32_t *tokens = (uint32_t *)LG_MALLOC(400 * sizeof(uint32_t));
    if (!tokens) return lg_fail(err, "out of memory");
    for (int i = 0; i < 400; i++) tokens[i] = (uint32_t)(i * 7 % cfg.vocab_size);
    if (lg_loader_from_memory(&m->data, tokens, 400, 8, cfg.vocab_size, 1, 1, err) != 0 ||
        fuzz_trainer(&m->plain, &cfg, 0, 1, &m->data, FUZZ_DIR "/seed/plain", err) != 0 ||
        /* (LoRA on 2 ranks: UBSan saw memcpy of NULL for units without adapters) */
        fuzz_trainer(&m->lora, &cfg, 2, 2, &m->data, FUZZ_DIR "/seed/lora", err) != 0)
        return -1;
    m->whole = (lg_real *)LG_MALLOC(m->lora.ranks[0].model.n_params * sizeof(lg_real) + 1);
    return m->whole ? 0 : lg_fail(err, "out of memory");
}

static void fuzz_models_free(fuzz_models *m) {
    lg_trainer_free(&m->plain);
    lg_trainer_free(&m->lora);
    lg_loader_close(&m->data);
    LG_FREE(m->whole);
}

/* ---- the loop ------------------------------------------------------------------------------ */

typedef struct {
    fuzz_target target;
    int (*seed)(fuzz_corpus *c);
    int safetensors; /* mutate the header and keep its length right */
} fuzz_entry;

/* An accepted mutant in place of the oldest one kept. */
static void fuzz_replace(fuzz_bytes *slot, const fuzz_bytes *with) {
    unsigned char *copy = (unsigned char *)malloc(with->n + 1);
    if (!copy) return;
    memcpy(copy, with->bytes, with->n);
    copy[with->n] = '\0';
    free(slot->bytes);
    slot->bytes = copy;
    slot->n = with->n;
}

/* Runs one target for `iterations` mutants; the counts into accepted and refused. */
static int fuzz_run(const fuzz_entry *e, fuzz_models *m, long iterations, uint64_t seed,
                    fuzz_bytes *mutant) {
    fuzz_corpus c;
    memset(&c, 0, sizeof c);
    if (e->seed(&c) != 0 || c.n == 0) {
        fprintf(stderr, "fuzz %s: the seeds could not be made\n", e->target.name);
        fuzz_corpus_free(&c);
        return -1;
    }
    long accepted = 0, refused = 0;
    int seeds = c.n, kept = 0;
    double start = lg_time_ms();
    for (long i = 0; i < iterations + seeds; i++) {
        lg_error err;
        if (i < seeds) { /* the seeds themselves first */
            memcpy(mutant->bytes, c.seeds[i].bytes, c.seeds[i].n);
            mutant->n = c.seeds[i].n;
        } else if (e->safetensors) fuzz_mutant_safetensors(mutant, &c, e->target.words, &seed);
        else fuzz_mutant(mutant, &c, e->target.words, &seed);
        if (fuzz_write(e->target.path, mutant->bytes, mutant->n) != 0) {
            fprintf(stderr, "fuzz %s: cannot write %s\n", e->target.name, e->target.path);
            return -1;
        }
        if (e->target.read(m, &e->target, &err) != 0) {
            refused++;
            continue;
        }
        accepted++;
        if (i < seeds) continue;
        if (c.n < FUZZ_MAX_SEEDS) fuzz_add_bytes(&c, mutant->bytes, mutant->n);
        else fuzz_replace(&c.seeds[seeds + kept++ % (FUZZ_MAX_SEEDS - seeds)], mutant);
    }
    printf("fuzz %s: %ld mutants and %d seeds, %ld accepted, %ld refused, 0 findings, %.1f s\n",
           e->target.name, iterations, seeds, accepted, refused, (lg_time_ms() - start) / 1e3);
    fflush(stdout);
    fuzz_corpus_free(&c);
    return 0;
}

static const fuzz_entry fuzz_entries[] = {
    {{"config-yaml", FUZZ_DIR "/config.yaml", fuzz_read_yaml, fuzz_yaml_words}, fuzz_seed_yaml, 0},
    {{"config-json", FUZZ_DIR "/hf/config.json", fuzz_read_config_json, fuzz_json_words},
     fuzz_seed_config_json, 0},
    {{"safetensors", FUZZ_DIR "/any.safetensors", fuzz_read_safetensors, fuzz_st_words},
     fuzz_seed_all_safetensors, 1},
    {{"peft-adapters", FUZZ_DIR "/peft/adapter_model.safetensors", fuzz_read_peft, fuzz_st_words},
     NULL, 1},
    {{"training-state", FUZZ_DIR "/" LG_TRAINING_STATE, fuzz_read_state, fuzz_st_words},
     fuzz_seed_state, 1},
    {{"checkpoint-marker", FUZZ_DIR "/step/" LG_CHECKPOINT_MARKER, fuzz_read_marker, fuzz_json_words},
     fuzz_seed_marker, 0},
    {{"alpaca-json", FUZZ_DIR "/alpaca.json", fuzz_read_alpaca, fuzz_json_words}, fuzz_seed_alpaca, 0},
    {{"chat-json", FUZZ_DIR "/chat.jsonl", fuzz_read_chat, fuzz_json_words}, fuzz_seed_chat, 0},
    {{"token-files", FUZZ_DIR "/tokens.bin", fuzz_read_tokens, NULL}, fuzz_seed_tokens, 0},
    {{"tokenizer-json", FUZZ_DIR "/tok/tokenizer.json", fuzz_read_tokenizer, fuzz_tokenizer_words},
     fuzz_seed_tokenizer, 0},
    {{"run-settings", FUZZ_DIR "/settings/" LG_RUN_SETTINGS, fuzz_read_run_settings,
      fuzz_settings_words}, fuzz_seed_run_settings, 0},
};

static int fuzz_seed_peft(fuzz_corpus *c) {
    return fuzz_seed_safetensors(c, SEED_LORA "/adapter_model.safetensors", 1);
}

/* FUZZ_DIR and, when it is a link to memory, the directory it points to: removed. */
static int fuzz_clear_dir(void) {
    char old[512], cmd[1200];
    ssize_t n = readlink(FUZZ_DIR, old, sizeof old - 1);
    if (n > 0) {
        old[n] = '\0';
        if (strncmp(old, "/dev/shm/litgpt-fuzz-", 21) == 0 && !strchr(old, '\'') &&
            snprintf(cmd, sizeof cmd, "rm -rf '%s'", old) > 0 && system(cmd) != 0)
            return -1;
    }
    return system("rm -rf " FUZZ_DIR);
}

/* FUZZ_DIR, empty: a link to a fresh directory in memory (/dev/shm) where there is one, as a
   disk shared with other work makes each file's creation slow. */
static int fuzz_make_dir(void) {
    char fresh[] = "/dev/shm/litgpt-fuzz-XXXXXX";
    if (fuzz_clear_dir() != 0 || system("mkdir -p build") != 0) return -1;
    struct stat st;
    int in_memory = stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && mkdtemp(fresh);
    if (in_memory && symlink(fresh, FUZZ_DIR) != 0) return -1;
    return system("mkdir -p " FUZZ_DIR "/seed " FUZZ_DIR "/hf " FUZZ_DIR "/peft " FUZZ_DIR "/tok");
}

int main(int argc, char **argv) {
    long iterations = argc > 1 ? atol(argv[1]) : 1000;
    const char *only = argc > 2 && strcmp(argv[2], "all") != 0 ? argv[2] : NULL;
    uint64_t stream = argc > 3 ? (uint64_t)atol(argv[3]) : 0; /* 0: make test's inputs */
    lg_error err;
    if (fuzz_make_dir() != 0) return 1;
    fuzz_models m;
    if (fuzz_models_make(&m, &err) != 0) {
        fprintf(stderr, "fuzz: the seed checkpoints: %s\n", err.msg);
        return 1;
    }
    if (system("cp -r " SEED_PLAIN " " FUZZ_DIR "/step") != 0 ||
        system("cp -r " SEED_PLAIN " " FUZZ_DIR "/settings") != 0)
        return 1;
    fuzz_bytes mutant = {(unsigned char *)malloc(2 * (size_t)FUZZ_MAX_BYTES + 16), 0};
    int rc = mutant.bytes ? 0 : 1;
    for (size_t i = 0; i < sizeof fuzz_entries / sizeof *fuzz_entries && rc == 0; i++) {
        fuzz_entry e = fuzz_entries[i];
        if (!e.seed) e.seed = fuzz_seed_peft;
        if (only && strcmp(only, e.target.name) != 0) continue;
        rc = fuzz_run(&e, &m, iterations, 0x9e3779b97f4a7c15ull * (stream + 1) + i, &mutant) != 0;
    }
    free(mutant.bytes);
    fuzz_models_free(&m);
    if (rc == 0) fuzz_clear_dir(); /* (a finding's input stays) */
    return rc;
}
