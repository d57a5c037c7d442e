/* tests/test_gguf.c — tools/export gguf (issue 27): small models of each family with random
   weights, saved as this trainer saves them (lg_hf_save, the step-N layout) with a real
   tokenizer beside them, exported in f32 and q8_0; each file read back by a GGUF reader written
   here from the published format, and loaded by llama.cpp itself (node-llama-cpp's prebuilt
   CPU engine, `make llama-cpp`), which must tokenize a text to our ids and continue a prompt
   greedily as our model does. Included by tests/test.c. */

#define GGUF_DIR "build/gguf"
#define LLAMA_CPP_INDEX "data/llama.cpp/node_modules/node-llama-cpp/dist/index.js"
#define GGUF_PROMPT 6 /* prompt tokens */
#define GGUF_NEW 10   /* greedy tokens after it */

static const char gguf_text[] = "Hello world! It's 2024: na\xC3\xAFve caf\xC3\xA9 costs 12345 yen.\n  Done?";

/* ---- an independent reader of GGUF v3 (ggml's docs/gguf.md) ------------------------------- */

typedef struct {
    char key[96];
    uint32_t type;          /* gguf value type */
    uint32_t item_type;     /* arrays */
    uint64_t n_items;       /* arrays */
    size_t at;              /* the value (or the first array item) in the file */
} gguf_kv;

typedef struct {
    char name[64];
    uint32_t n_dims, type;
    uint64_t dims[4], offset, bytes;
} gguf_info;

typedef struct {
    unsigned char *bytes;
    size_t n, at;           /* the file, and the read position */
    gguf_kv *kv;
    gguf_info *t;
    uint64_t n_kv, n_t, alignment, data_start;
    char why[160];          /* what is wrong, when gguf_parse fails */
} gguf_file;

static int gguf_need(gguf_file *g, uint64_t n) {
    if (n > g->n - g->at) { snprintf(g->why, sizeof g->why, "truncated at byte %zu", g->at); return -1; }
    return 0;
}
static uint64_t gguf_u(gguf_file *g, int bytes) {
    uint64_t v = 0;
    if (gguf_need(g, (uint64_t)bytes)) return 0;
    memcpy(&v, g->bytes + g->at, (size_t)bytes);
    g->at += (size_t)bytes;
    return v;
}
/* A string: its bytes stay in the file; copied into out (cap) when out is not NULL. */
static int gguf_string(gguf_file *g, char *out, size_t cap) {
    uint64_t n = gguf_u(g, 8);
    if (g->why[0] || gguf_need(g, n)) return -1;
    if (out) snprintf(out, cap, "%.*s", (int)(n < cap ? n : cap - 1), (const char *)g->bytes + g->at);
    g->at += (size_t)n;
    return 0;
}
/* Bytes of one scalar of type t (0 for strings and arrays, -1 for unknown types). */
static int gguf_scalar_bytes(uint32_t t) {
    static const int size[13] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return t < 13 ? size[t] : -1;
}
static int gguf_skip_value(gguf_file *g, uint32_t type, int depth) {
    if (type == 8) return gguf_string(g, NULL, 0);
    if (type == 9 && depth == 0) {
        uint32_t item = (uint32_t)gguf_u(g, 4);
        uint64_t n = gguf_u(g, 8);
        for (uint64_t i = 0; i < n && !g->why[0]; i++)
            if (gguf_skip_value(g, item, 1)) return -1;
        return g->why[0] ? -1 : 0;
    }
    int size = gguf_scalar_bytes(type);
    if (size <= 0) { snprintf(g->why, sizeof g->why, "value type %u", type); return -1; }
    return gguf_need(g, (uint64_t)size) ? -1 : (g->at += (size_t)size, 0);
}

static uint64_t gguf_type_bytes(uint32_t type, uint64_t count) {
    if (type == 0) return count * 4;
    if (type == 1 || type == 30) return count * 2;
    if (type == 8) return count / 32 * 34;
    return 0;
}

static int gguf_parse_infos(gguf_file *g) {
    g->t = (gguf_info *)calloc(g->n_t + 1, sizeof(gguf_info));
    for (uint64_t i = 0; i < g->n_t; i++) {
        gguf_info *t = &g->t[i];
        if (gguf_string(g, t->name, sizeof t->name)) return -1;
        t->n_dims = (uint32_t)gguf_u(g, 4);
        if (t->n_dims < 1 || t->n_dims > 4) { snprintf(g->why, sizeof g->why, "%s: %u dims", t->name, t->n_dims); return -1; }
        uint64_t count = 1;
        for (uint32_t d = 0; d < t->n_dims; d++) count *= (t->dims[d] = gguf_u(g, 8));
        t->type = (uint32_t)gguf_u(g, 4);
        t->offset = gguf_u(g, 8);
        t->bytes = gguf_type_bytes(t->type, count);
        if (g->why[0]) return -1;
        if (!t->bytes || t->offset % g->alignment) {
            snprintf(g->why, sizeof g->why, "%s: type %u, offset %llu", t->name, t->type,
                     (unsigned long long)t->offset);
            return -1;
        }
    }
    return 0;
}

/* Header, metadata, tensor infos, alignment, every tensor inside the file and none overlapping. */
static int gguf_parse(gguf_file *g, unsigned char *bytes, size_t n) {
    memset(g, 0, sizeof *g);
    g->bytes = bytes;
    g->n = n;
    g->alignment = 32;
    if (n < 24 || memcmp(bytes, "GGUF", 4) != 0) { snprintf(g->why, sizeof g->why, "no GGUF magic"); return -1; }
    g->at = 4;
    uint32_t version = (uint32_t)gguf_u(g, 4);
    g->n_t = gguf_u(g, 8);
    g->n_kv = gguf_u(g, 8);
    if (version != 3 || g->n_kv > n || g->n_t > n) { snprintf(g->why, sizeof g->why, "version %u", version); return -1; }
    g->kv = (gguf_kv *)calloc(g->n_kv + 1, sizeof(gguf_kv));
    for (uint64_t i = 0; i < g->n_kv; i++) {
        gguf_kv *kv = &g->kv[i];
        if (gguf_string(g, kv->key, sizeof kv->key)) return -1;
        kv->type = (uint32_t)gguf_u(g, 4);
        if (kv->type == 9) {
            kv->item_type = (uint32_t)gguf_u(g, 4);
            kv->n_items = gguf_u(g, 8);
            g->at -= 12;
        }
        kv->at = kv->type == 9 ? g->at + 12 : g->at;
        if (gguf_skip_value(g, kv->type, 0)) return -1;
        if (!strcmp(kv->key, "general.alignment") && kv->type == 4) memcpy(&g->alignment, g->bytes + kv->at, 4);
    }
    if (g->alignment == 0 || g->alignment % 8) { snprintf(g->why, sizeof g->why, "alignment %llu", (unsigned long long)g->alignment); return -1; }
    if (gguf_parse_infos(g)) return -1;
    g->data_start = (g->at + g->alignment - 1) / g->alignment * g->alignment;
    uint64_t end = 0;
    for (uint64_t i = 0; i < g->n_t; i++) {
        const gguf_info *t = &g->t[i];
        if (t->offset < end || g->data_start + t->offset + t->bytes > n) {
            snprintf(g->why, sizeof g->why, "%s overlaps or runs past the end of the file", t->name);
            return -1;
        }
        end = t->offset + t->bytes;
    }
    return 0;
}

static const gguf_kv *gguf_find_kv(const gguf_file *g, const char *key) {
    for (uint64_t i = 0; i < g->n_kv; i++)
        if (!strcmp(g->kv[i].key, key)) return &g->kv[i];
    return NULL;
}
static const gguf_info *gguf_find_tensor(const gguf_file *g, const char *name) {
    for (uint64_t i = 0; i < g->n_t; i++)
        if (!strcmp(g->t[i].name, name)) return &g->t[i];
    return NULL;
}
static long gguf_int(const gguf_file *g, const char *key) {
    const gguf_kv *kv = gguf_find_kv(g, key);
    uint32_t v = 0;
    if (!kv || kv->type != 4) return -1;
    memcpy(&v, g->bytes + kv->at, 4);
    return (long)v;
}
/* A string value into out ("" when absent or not a string). */
static void gguf_str(const gguf_file *g, const char *key, char *out, size_t cap) {
    const gguf_kv *kv = gguf_find_kv(g, key);
    out[0] = '\0';
    if (!kv || kv->type != 8) return;
    uint64_t n;
    memcpy(&n, g->bytes + kv->at, 8);
    snprintf(out, cap, "%.*s", (int)(n < cap ? n : cap - 1), (const char *)g->bytes + kv->at + 8);
}
/* Element i of a tensor, dequantized (f32, f16, bf16, q8_0). */
static float gguf_value(const gguf_file *g, const gguf_info *t, uint64_t i) {
    const unsigned char *d = g->bytes + g->data_start + t->offset;
    uint16_t h;
    float f;
    switch (t->type) {
    case 0: memcpy(&f, d + 4 * i, 4); return f;
    case 1: memcpy(&h, d + 2 * i, 2); return lg_f16_to_f32(h);
    case 30: memcpy(&h, d + 2 * i, 2); return lg_bf16_to_f32(h);
    default:
        memcpy(&h, d + i / 32 * 34, 2);
        return lg_f16_to_f32(h) * (float)(int8_t)d[i / 32 * 34 + 2 + i % 32];
    }
}

static unsigned char *gguf_read_file(const char *path, size_t *n) {
    lg_error err;
    return (unsigned char *)lg_read_file(path, n, "gguf", &err);
}

/* The --type values tested: every family in f32 and q8_0, Llama 2's also in f16 and bf16. */
static const char *const gguf_types[4] = {"f32", "q8_0", "f16", "bf16"};
static const uint32_t gguf_ggml_types[4] = {0, 8, 1, 30};

/* ---- the models ------------------------------------------------------------------------------ */

typedef struct {
    const char *name, *base, *changes, *tokenizer, *arch;
    int vocab_size;         /* the tokenizer's tokens */
    int hub;                /* 1: a Hugging Face directory holding the tokenizer (no COMPLETE);
                               0: the step-N layout, the tokenizer named by --tokenizer */
} gguf_case;

#define GGUF_SIZES "n_layer: 2\nn_embd: 32\nhead_size: 8\nintermediate_size: 64\nblock_size: 64\n"
static const gguf_case gguf_cases[] = {
    {"gpt2", "test-gpt2", GGUF_SIZES "n_head: 4\nn_query_groups: 4\nvocab_size: 50257\npadded_vocab_size: 50304\n",
     "data/gpt2", "gpt2", 50257, 0},
    {"llama3", "test-llama31", GGUF_SIZES "n_head: 4\nn_query_groups: 2\nvocab_size: 128256\n"
     "padded_vocab_size: 128256\ntie_embeddings: true\n", "data/llama3", "llama", 128256, 1},
    {"llama2", "test-llama", GGUF_SIZES "n_head: 4\nn_query_groups: 2\nvocab_size: 32000\n"
     "padded_vocab_size: 32000\n", "data/llama2", "llama", 32000, 1},
    {"qwen2", "test-llama", GGUF_SIZES "n_head: 4\nn_query_groups: 2\nvocab_size: 50257\n"
     "padded_vocab_size: 50304\nattn_bias: true\n", "data/gpt2", "qwen2", 50257, 0},
    {"pythia", "test-pythia", GGUF_SIZES "n_head: 4\nn_query_groups: 4\nvocab_size: 50257\n"
     "padded_vocab_size: 50304\n", "data/gpt2", "gptneox", 50257, 1},
    {"falcon", "test-falcon", GGUF_SIZES "n_head: 4\nn_query_groups: 1\nvocab_size: 50257\n"
     "padded_vocab_size: 50304\n", "data/gpt2", "falcon", 50257, 0},
};
#define GGUF_CASES ((int)(sizeof gguf_cases / sizeof gguf_cases[0]))
#define GGUF_CASES_GPT2_TOKENIZER "data/gpt2" /* gguf_cases[0]'s */

/* Random weights that give a peaked next-token distribution: matrices N(0, 0.02) x 4, norms
   1 + N(0, 0.1), biases N(0, 0.05); the padded vocabulary rows 0 (their logits never win in
   llama.cpp, which argmaxes over every row, as ours skip them). */
static void gguf_random_weights(lg_model *m, uint64_t seed) {
    lg_model_init_weights(m, seed, NULL);
    lg_rng rng;
    lg_rng_seed(&rng, seed + 1);
    float *w = (float *)m->params.data;
    for (int i = 0; i < m->param_table.n_tensors; i++) {
        const lg_tensor_info *t = &m->param_table.tensors[i];
        for (size_t k = 0; k < t->count; k++) {
            float *x = &w[t->offset + k];
            if (t->kind == LG_TENSOR_NORM) *x = 1.0f + 0.1f * lg_rng_normal(&rng);
            else if (t->kind == LG_TENSOR_BIAS) *x = 0.05f * lg_rng_normal(&rng);
            else *x *= 4.0f;
        }
    }
    int C = m->cfg.n_embd, V = m->cfg.vocab_size, Vp = m->cfg.padded_vocab_size;
    memset((float *)m->p.wte.data + (size_t)V * C, 0, sizeof(float) * (size_t)(Vp - V) * C);
    memset((float *)m->p.lm_head_w.data + (size_t)V * C, 0, sizeof(float) * (size_t)(Vp - V) * C);
}

#define GGUF_TEMPLATE "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>{% endfor %}"

/* GGUF_DIR/NAME: the model as the trainer saves it; a Hugging Face directory also gets the
   tokenizer's files (and Llama 3's a tokenizer_config.json with a chat template) and loses
   the trainer's COMPLETE marker, which would refuse files it does not list. */
static int gguf_make_model(results *r, const gguf_case *k, lg_model *m, char *dir, size_t cap) {
    char yaml[256], cmd[1024];
    lg_config cfg;
    lg_error err;
    snprintf(dir, cap, GGUF_DIR "/%s", k->name);
    snprintf(yaml, sizeof yaml, GGUF_DIR "/%s.yaml", k->name);
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p %s", dir, dir);
    if (system(cmd) != 0 || hostile_yaml(yaml, k->base, k->changes) != 0 ||
        lg_config_load(&cfg, yaml, &err) != 0 || lg_model_create(m, &cfg, 1, cfg.block_size, &err) != 0) {
        check(r, 0, "%s: could not make the model (%s)", k->name, err.msg);
        return -1;
    }
    gguf_random_weights(m, 27);
    snprintf(cmd, sizeof cmd, "cp %s/* %s/ && rm %s/COMPLETE", k->tokenizer, dir, dir);
    char config[300];
    snprintf(config, sizeof config, "%s/tokenizer_config.json", dir);
    if (lg_hf_save(m, dir, &err) != 0 || (k->hub && system(cmd) != 0) ||
        (!strcmp(k->name, "llama3") &&
         write_text(config, "{\"add_bos_token\": false, \"chat_template\": \"" GGUF_TEMPLATE "\"}") != 0)) {
        check(r, 0, "%s: could not save %s (%s)", k->name, dir, err.msg);
        lg_model_free(m);
        return -1;
    }
    return 0;
}

/* ---- what the reader checks in each file --------------------------------------------------- */

/* Llama's q rows in llama.cpp's order: the pairs that rotate together are adjacent, (2i, 2i+1)
   of a head, where the library (and Hugging Face) rotate (i, i + HS/2) together. */
static int gguf_llama_q_order(const gguf_file *g, const lg_model *m) {
    const gguf_info *q = gguf_find_tensor(g, "blk.0.attn_q.weight");
    int C = m->cfg.n_embd, HS = m->cfg.head_size;
    if (!q || q->type != 0) return 0;
    const float *ours = (const float *)m->p.h[0].qkv_w.data;
    for (int h = 0; h < m->cfg.n_head; h++)
        for (int i = 0; i < HS / 2; i++)
            for (int c = 0; c < C; c++) {
                size_t even = (size_t)(h * HS + 2 * i) * C + c, odd = even + (size_t)C;
                if (gguf_value(g, q, even) != ours[(size_t)(h * HS + i) * C + c] ||
                    gguf_value(g, q, odd) != ours[(size_t)(h * HS + i + HS / 2) * C + c]) return 0;
            }
    return 1;
}

/* token_embd against the model's wte: equal in f32 (and to its rounding in f16, bf16), within
   half a step of its block in q8_0. */
static double gguf_embedding_error(const gguf_file *g, const lg_model *m) {
    const gguf_info *t = gguf_find_tensor(g, "token_embd.weight");
    size_t n = (size_t)m->cfg.padded_vocab_size * (size_t)m->cfg.n_embd;
    if (!t || t->dims[0] * t->dims[1] != n) return INFINITY;
    const float *w = (const float *)m->p.wte.data;
    double worst = 0;
    for (size_t b = 0; b < n; b += 32) {
        float amax = 0;
        for (size_t i = b; i < b + 32; i++) amax = fmaxf(amax, fabsf(w[i]));
        /* q8_0: |x - q d| <= d / 2 with d = amax / 127, and the stored fp16 d moves q d by
           at most 127 |d - fp16(d)| */
        float d = amax / 127.0f, d16 = lg_f16_to_f32(lg_f32_to_f16(d));
        float step = t->type == 8 ? 0.5f * d + 127.0f * fabsf(d - d16) + 1e-7f : 0.0f;
        for (size_t i = b; i < b + 32; i++) {
            float want = t->type == 1 ? lg_f16_to_f32(lg_f32_to_f16(w[i]))
                         : t->type == 30 ? lg_bf16_to_f32(lg_f32_to_bf16(w[i])) : w[i];
            double e = fabs((double)gguf_value(g, t, i) - want) - step;
            if (e > worst) worst = e;
        }
    }
    return worst;
}

static void gguf_check_file(results *r, const gguf_case *k, const lg_model *m, const char *path,
                            int ty) {
    size_t n;
    unsigned char *bytes = gguf_read_file(path, &n);
    gguf_file g;
    int ok = bytes && gguf_parse(&g, bytes, n) == 0;
    check(r, ok, "%s: reads back as GGUF v3 (%llu keys, %llu tensors, data at %llu) %s", path,
          ok ? (unsigned long long)g.n_kv : 0ull, ok ? (unsigned long long)g.n_t : 0ull,
          ok ? (unsigned long long)g.data_start : 0ull, ok || !bytes ? "" : g.why);
    if (!ok) { free(bytes); return; }
    char arch[32], model[32], key[96];
    gguf_str(&g, "general.architecture", arch, sizeof arch);
    gguf_str(&g, "tokenizer.ggml.model", model, sizeof model);
    snprintf(key, sizeof key, "%s.block_count", arch);
    long blocks = gguf_int(&g, key);
    snprintf(key, sizeof key, "%s.context_length", arch);
    long context = gguf_int(&g, key);
    const gguf_kv *tokens = gguf_find_kv(&g, "tokenizer.ggml.tokens");
    const gguf_kv *merges = gguf_find_kv(&g, "tokenizer.ggml.merges");
    const gguf_kv *scores = gguf_find_kv(&g, "tokenizer.ggml.scores");
    int spm = !strcmp(k->tokenizer, "data/llama2");
    check(r, !strcmp(arch, k->arch) && blocks == 2 && context == 64 &&
                 !strcmp(model, spm ? "llama" : "gpt2") && tokens && tokens->item_type == 8 &&
                 tokens->n_items == (uint64_t)m->cfg.padded_vocab_size &&
                 (spm ? scores && scores->item_type == 6 : merges && merges->item_type == 8),
          "%s: %s, %ld blocks, context %ld, tokenizer %s with %llu tokens and its %s", path, arch,
          blocks, context, model, tokens ? (unsigned long long)tokens->n_items : 0ull,
          spm ? "scores" : "merges");
    if (!strcmp(k->name, "llama3")) {
        char tmpl[256];
        gguf_str(&g, "tokenizer.chat_template", tmpl, sizeof tmpl);
        check(r, !strcmp(tmpl, GGUF_TEMPLATE) && gguf_find_tensor(&g, "rope_freqs.weight"),
              "%s: tokenizer.chat_template from tokenizer_config.json, Llama 3.1's rope_freqs", path);
    }
    const gguf_info *emb = gguf_find_tensor(&g, "token_embd.weight");
    double err = gguf_embedding_error(&g, m);
    check(r, emb && emb->type == gguf_ggml_types[ty] && err <= 0,
          "%s: token_embd (ggml type %u) holds the model's wte %s (worst excess %.2g)", path,
          emb ? emb->type : 99u, ty == 1 ? "to half a q8_0 step" : ty ? "rounded" : "exactly", err);
    if (!strcmp(k->arch, "llama") && !ty)
        check(r, gguf_llama_q_order(&g, m), "%s: attn_q rows in llama.cpp's order (rotating pairs adjacent)", path);
    free(g.kv);
    free(g.t);
    free(bytes);
}

/* ---- ours against llama.cpp ------------------------------------------------------------------ */

typedef struct {
    lg_tokens text_ids;                /* our ids of gguf_text */
    int seq[GGUF_PROMPT + GGUF_NEW];   /* prompt, then our greedy continuation */
    int top[GGUF_PROMPT + GGUF_NEW];   /* our argmax after each position of seq */
    float *logits;                     /* (positions, GGUF_NEW) ours, at the ids seq[GGUF_PROMPT..] */
} gguf_ours;

static int gguf_our_side(results *r, const gguf_case *k, lg_model *m, const char *dir, gguf_ours *o) {
    lg_tokenizer tok;
    lg_error err;
    memset(o, 0, sizeof *o);
    (void)dir;
    if (lg_tokenizer_load(&tok, k->tokenizer, &err) != 0 ||
        lg_tokenizer_encode(&tok, gguf_text, strlen(gguf_text), &o->text_ids, &err) != 0) {
        check(r, 0, "%s: our tokenizer: %s", k->name, err.msg);
        return -1;
    }
    lg_tokenizer_free(&tok);
    memcpy(o->seq, o->text_ids.ids, sizeof(int) * GGUF_PROMPT);
    lg_rng rng;
    lg_rng_seed(&rng, 1);
    lg_model_generate(m, o->seq, GGUF_PROMPT, GGUF_NEW, 0.0f, &rng);
    int T = GGUF_PROMPT + GGUF_NEW, Vp = m->cfg.padded_vocab_size;
    lg_model_forward(m, o->seq, NULL, 1, T, NULL);
    const float *logits = (const float *)m->a.logits.data;
    o->logits = (float *)malloc(sizeof(float) * (size_t)T * GGUF_NEW);
    for (int t = 0; t < T; t++) {
        int best = 0;
        for (int v = 1; v < m->cfg.vocab_size; v++) best = logits[(size_t)t * Vp + v] > logits[(size_t)t * Vp + best] ? v : best;
        o->top[t] = best;
        for (int j = 0; j < GGUF_NEW; j++) o->logits[t * GGUF_NEW + j] = logits[(size_t)t * Vp + o->seq[GGUF_PROMPT + j]];
    }
    return 0;
}

static void gguf_ids_json(FILE *f, const int *ids, int n) {
    fputc('[', f);
    for (int i = 0; i < n; i++) fprintf(f, i ? ",%d" : "%d", ids[i]);
    fputc(']', f);
}

static void gguf_write_job(FILE *f, const char *path, const gguf_ours *o, int first) {
    fprintf(f, "%s{\"gguf\": \"%s\", \"context\": 64, \"text\": \"", first ? "" : ",\n", path);
    for (const char *c = gguf_text; *c; c++)
        if (*c == '\n') fputs("\\n", f);
        else if (*c == '"' || *c == '\\') fprintf(f, "\\%c", *c);
        else fputc(*c, f);
    fprintf(f, "\", \"n_new\": %d, \"prompt\": ", GGUF_NEW);
    gguf_ids_json(f, o->seq, GGUF_PROMPT);
    fputs(", \"forced\": ", f);
    gguf_ids_json(f, o->seq + GGUF_PROMPT, GGUF_NEW - 1);
    fputs(", \"logits\": ", f);
    gguf_ids_json(f, o->seq + GGUF_PROMPT, GGUF_NEW);
    fputc('}', f);
}

/* The ints of a JSON array node into out (cap); the count. */
static int gguf_json_ints(const lg_json *doc, int node, int *out, int cap) {
    int n = 0;
    for (int e = node >= 0 ? doc->nodes[node].first_child : -1; e >= 0 && n < cap; e = doc->nodes[e].next) {
        long v = -1;
        lg_json_int(doc, e, &v);
        out[n++] = (int)v;
    }
    return n;
}

typedef struct { int n_tokens, tokens[256], generated[GGUF_NEW], top[GGUF_PROMPT + GGUF_NEW];
                 float logits[GGUF_PROMPT + GGUF_NEW][GGUF_NEW]; char error[600]; } gguf_theirs;

static int gguf_parse_theirs(const char *line, gguf_theirs *t) {
    lg_json doc;
    lg_error err;
    memset(t, 0, sizeof *t);
    if (lg_json_parse(&doc, line, strlen(line), "llama.cpp's answer", &err) != 0) {
        snprintf(t->error, sizeof t->error, "%s", err.msg);
        return -1;
    }
    int e = lg_json_find(&doc, 0, "error");
    if (e >= 0) lg_json_string_copy(&doc, e, t->error, sizeof t->error);
    t->n_tokens = gguf_json_ints(&doc, lg_json_find(&doc, 0, "tokens"), t->tokens, 256);
    gguf_json_ints(&doc, lg_json_find(&doc, 0, "generated"), t->generated, GGUF_NEW);
    int f = lg_json_find(&doc, 0, "forced"), i = 0;
    for (int p = f >= 0 ? doc.nodes[f].first_child : -1; p >= 0 && i < GGUF_PROMPT + GGUF_NEW; p = doc.nodes[p].next, i++) {
        long v = -1;
        lg_json_int(&doc, lg_json_find(&doc, p, "top"), &v);
        t->top[i] = (int)v;
        int j = 0;
        int l = lg_json_find(&doc, p, "logits");
        for (int x = l >= 0 ? doc.nodes[l].first_child : -1; x >= 0 && j < GGUF_NEW; x = doc.nodes[x].next, j++) {
            double d = NAN;
            lg_json_double(&doc, x, &d);
            t->logits[i][j] = (float)d;
        }
    }
    lg_json_free(&doc);
    return e >= 0 ? -1 : 0;
}

/* One exported file against llama.cpp. f32: the same ids for the text, the same greedy
   continuation, the same top token at every position of the prompt and continuation, and our
   logits there. q8_0, f16, bf16: the same ids, and the same top token at most positions. */
static void gguf_compare(results *r, const char *path, const gguf_ours *o, const gguf_theirs *t,
                         int ty) {
    int same_ids = t->n_tokens == (int)o->text_ids.n;
    for (int i = 0; same_ids && i < t->n_tokens; i++) same_ids = t->tokens[i] == o->text_ids.ids[i];
    check(r, !t->error[0] && same_ids, "%s: llama.cpp loads it and tokenizes the text to our %d ids%s%s",
          path, (int)o->text_ids.n, t->error[0] ? ": " : "", t->error);
    if (t->error[0]) return;
    int T = GGUF_PROMPT + GGUF_NEW - 1, same_top = 0;
    double worst = 0, largest = 0;
    for (int i = 0; i < T; i++) {
        same_top += t->top[i] == o->top[i];
        for (int j = 0; j < GGUF_NEW; j++) {
            double d = fabs((double)t->logits[i][j] - o->logits[i * GGUF_NEW + j]);
            worst = d > worst || d != d ? d : worst;
            largest = fmax(largest, fabs((double)o->logits[i * GGUF_NEW + j]));
        }
    }
    if (ty) {
        check(r, same_top >= T * 3 / 4, "%s: llama.cpp's top token is ours at %d of %d positions "
              "(%s: at least 3/4; logits differ by up to %.3g of %.3g)", path, same_top, T,
              gguf_types[ty], worst, largest);
        return;
    }
    int same_new = 1;
    for (int j = 0; j < GGUF_NEW; j++) same_new &= t->generated[j] == o->seq[GGUF_PROMPT + j];
    check(r, same_new && same_top == T, "%s: llama.cpp's greedy continuation of %d tokens is ours, "
          "its top token ours at all %d positions", path, GGUF_NEW, T);
    check(r, worst <= 1e-3 * fmax(1.0, largest), "%s: its logits are ours within %.3g (largest %.3g; "
          "bound 1e-3 of the largest)", path, worst, largest);
}

/* A copy of path cut to half its bytes: refused by our reader and by llama.cpp. */
static void gguf_truncated(results *r, const char *path, const char *cut) {
    size_t n;
    unsigned char *bytes = gguf_read_file(path, &n);
    FILE *f = bytes ? fopen(cut, "wb") : NULL;
    if (f) { fwrite(bytes, 1, n / 2, f); fclose(f); }
    gguf_file g;
    int refused = bytes && gguf_parse(&g, bytes, n / 2) != 0;
    check(r, refused, "%s (half of %s) refused by the reader: %s", cut, path, refused ? g.why : "accepted");
    if (bytes && refused) { free(g.kv); free(g.t); }
    free(bytes);
}

static int gguf_n_types(int k) { return !strcmp(gguf_cases[k].name, "llama2") ? 4 : 2; }

static void test_gguf_cli(results *r) {
    expect_program(r, "./tools/export", "gguf tests/hf/gpt2 " GGUF_DIR "/x.gguf --type q4_0", 2,
                   "--type q4_0: one of f32, f16, bf16, q8_0");
    expect_program(r, "./tools/export", "gguf tests/hf/gpt2 " GGUF_DIR "/x.gguf", 2,
                   "tests/hf/gpt2: no tokenizer for the GGUF file");
    expect_program(r, "./tools/export", "gguf", 2, "gguf needs DIR and FILE");
}

/* Tokenizers travel with checkpoints: a run loaded from a Hugging Face directory writes its
   tokenizer.json into each step-N (listed in COMPLETE), which then exports on its own. */
static void test_gguf_step_dir(results *r) {
    char marker[4096] = "";
    lg_error err;
    int step = 0;
    if (system("rm -rf " GGUF_DIR "/run") != 0) return;
    expect_cli(r, "--load " GGUF_DIR "/llama2 -b 1 -t 8 --max-steps 1 --eval-iters 1 --out " GGUF_DIR
               "/run", 0, "1/1");
    int verified = lg_checkpoint_verify(GGUF_DIR "/run/step-1", &step, &err) == 0;
    FILE *f = fopen(GGUF_DIR "/run/step-1/" LG_CHECKPOINT_MARKER, "r");
    if (f) { marker[fread(marker, 1, sizeof marker - 1, f)] = '\0'; fclose(f); }
    check(r, verified && strstr(marker, "file tokenizer.json "), GGUF_DIR "/run/step-1 carries "
          "tokenizer.json, listed in " LG_CHECKPOINT_MARKER " and verified%s%s", verified ? "" : ": ",
          verified ? "" : err.msg);
    expect_program(r, "./tools/export", "gguf " GGUF_DIR "/run/step-1 " GGUF_DIR "/run.gguf", 0,
                   "llama, 21 tensors, f32, 32000 tokens");
    /* LoRA: step-1 holds the adapters, the last step-2 also the merged model */
    if (system("rm -rf " GGUF_DIR "/lora") != 0) return;
    expect_cli(r, "--load " GGUF_DIR "/llama2 --lora-r 2 -b 1 -t 8 --max-steps 2 --save-every 1 "
               "--eval-iters 1 --out " GGUF_DIR "/lora", 0, "2/2");
    expect_program(r, "./tools/export", "gguf " GGUF_DIR "/lora/step-1 " GGUF_DIR "/lora.gguf", 2,
                   "LoRA adapters without the merged model: export the run's last step-N");
    expect_program(r, "./tools/export", "gguf " GGUF_DIR "/lora/step-2 " GGUF_DIR "/lora.gguf", 0,
                   "llama, 21 tensors, f32, 32000 tokens");
}

static void test_gguf_all(results *r) {
    static gguf_ours ours[GGUF_CASES];
    char dir[256], path[2][320], cmd[1024];
    if (system("mkdir -p " GGUF_DIR) != 0 || access("./tools/export", X_OK) != 0 ||
        access(LLAMA_CPP_INDEX, R_OK) != 0) {
        check(r, 0, "tools/export and llama.cpp (" LLAMA_CPP_INDEX ") are there: make tools/export llama-cpp");
        return;
    }
    test_gguf_cli(r);
    FILE *jobs = fopen(GGUF_DIR "/jobs.json", "w");
    if (!jobs) { check(r, 0, "cannot write " GGUF_DIR "/jobs.json"); return; }
    fputs("[", jobs);
    for (int k = 0; k < GGUF_CASES; k++) {
        lg_model m;
        if (gguf_make_model(r, &gguf_cases[k], &m, dir, sizeof dir) != 0) continue;
        if (gguf_our_side(r, &gguf_cases[k], &m, dir, &ours[k]) == 0)
            for (int ty = 0; ty < gguf_n_types(k); ty++) {
                snprintf(path[ty > 0], sizeof path[0], "%s-%s.gguf", dir, gguf_types[ty]);
                snprintf(cmd, sizeof cmd, "./tools/export gguf %s %s --type %s%s%s > /dev/null", dir,
                         path[ty > 0], gguf_types[ty], gguf_cases[k].hub ? "" : " --tokenizer ",
                         gguf_cases[k].hub ? "" : gguf_cases[k].tokenizer);
                check(r, system(cmd) == 0, "%s", cmd);
                gguf_check_file(r, &gguf_cases[k], &m, path[ty > 0], ty);
                gguf_write_job(jobs, path[ty > 0], &ours[k], k == 0 && ty == 0);
            }
        if (k == 0) gguf_truncated(r, path[0], GGUF_DIR "/truncated.gguf");
        lg_model_free(&m);
    }
    fputs(",\n", jobs);
    gguf_write_job(jobs, GGUF_DIR "/truncated.gguf", &ours[0], 1);
    fputs("]\n", jobs);
    fclose(jobs);
    FILE *p = popen("node tests/llama_cpp_check.mjs " LLAMA_CPP_INDEX " " GGUF_DIR "/jobs.json 2> " GGUF_DIR "/llama_cpp.log", "r");
    static char line[1 << 20];
    for (int k = 0; k < GGUF_CASES; k++)
        for (int ty = 0; ty < gguf_n_types(k); ty++) {
            gguf_theirs theirs;
            snprintf(path[0], sizeof path[0], GGUF_DIR "/%s-%s.gguf", gguf_cases[k].name, gguf_types[ty]);
            if (!p || !fgets(line, sizeof line, p)) { check(r, 0, "%s: no answer from llama.cpp", path[0]); continue; }
            gguf_parse_theirs(line, &theirs);
            gguf_compare(r, path[0], &ours[k], &theirs, ty);
        }
    gguf_theirs cut;
    int answered = p && fgets(line, sizeof line, p);
    gguf_parse_theirs(answered ? line : "{}", &cut);
    check(r, answered && cut.error[0], GGUF_DIR "/truncated.gguf: llama.cpp refuses it: \"%s\"", cut.error);
    if (p) pclose(p);
    test_gguf_step_dir(r);
    for (int k = 0; k < GGUF_CASES; k++) { lg_tokens_free(&ours[k].text_ids); free(ours[k].logits); }
}


/* ---- where the file goes and what its strings hold (no llama.cpp needed) ------------------ */

#define GGUF_FILES GGUF_DIR "/files"
#define GGUF_EXPORT "gguf " GGUF_DIR "/gpt2 "
#define GGUF_TOKENIZER " --tokenizer " GGUF_FILES "/tok"
#define GGUF_WRITTEN "gpt2, 28 tensors, f32, 50304 tokens"

static int gguf_starts_with(const char *path, const char *want) {
    char got[16] = "";
    FILE *f = fopen(path, "rb");
    size_t n = f ? fread(got, 1, strlen(want), f) : 0;
    if (f) fclose(f);
    return n == strlen(want) && !memcmp(got, want, n);
}

/* The names in dir, one a line, sorted, into out. */
static void gguf_listing(const char *dir, char *out, size_t cap) {
    char cmd[1400];
    snprintf(cmd, sizeof cmd, "ls -A %s", dir);
    FILE *p = popen(cmd, "r");
    size_t n = p ? fread(out, 1, cap - 1, p) : 0;
    out[n] = '\0';
    if (p) pclose(p);
}

/* A FILE as long as the tool writes (1,088 bytes) is written under its own name and leaves no
   other file; a byte more is refused by name before anything is written (the 1,100-byte
   buffer that held FILE.tmp lost the suffix past 1,095 bytes, or named another file). */
static void gguf_long_paths(results *r) {
    char dir[1200] = GGUF_FILES "/long", file[1200], args[1400], cmd[1400], names[512];
    for (int i = 0; i < 4; i++) { /* four directories of 250 bytes */
        size_t n = strlen(dir);
        dir[n] = '/';
        memset(dir + n + 1, 'd', 250);
        dir[n + 251] = '\0';
    }
    snprintf(cmd, sizeof cmd, "mkdir -p %s", dir);
    if (system(cmd) != 0) { check(r, 0, "%s", cmd); return; }
    size_t n = (size_t)snprintf(file, sizeof file, "%s/", dir);
    memset(file + n, 'f', 1088 - 5 - n);
    memcpy(file + 1088 - 5, ".gguf", 6);
    snprintf(args, sizeof args, GGUF_EXPORT "%s" GGUF_TOKENIZER, file);
    expect_program(r, "./tools/export", args, 0, GGUF_WRITTEN);
    gguf_listing(dir, names, sizeof names);
    size_t name_line = 1088 - n + 1; /* the file's name and a newline: nothing else there */
    check(r, strlen(file) == 1088 && gguf_starts_with(file, "GGUF") && strlen(names) == name_line,
          "a 1,088-byte FILE holds the GGUF file, alone in its directory (%zu bytes of names)",
          strlen(names));
    memmove(file + 1088 - 4, ".gguf", 6); /* 1,089 bytes */
    snprintf(args, sizeof args, GGUF_EXPORT "%s" GGUF_TOKENIZER, file);
    char want[1300];
    snprintf(want, sizeof want, "export: %s: the path is 1089 bytes, longer than the 1088 this tool writes", file);
    expect_program(r, "./tools/export", args, 2, want);
    gguf_listing(dir, names, sizeof names);
    check(r, strlen(names) == name_line, "the refused 1,089-byte FILE wrote nothing beside it");
}

/* A symbolic link is written through (the link stays, its target gets the file); a link to
   nothing, a device and a directory are refused by name; a FILE.tmp already there is left as
   it was (the temporary name is a fresh one). */
static void gguf_odd_outputs(results *r) {
    struct stat st;
    if (write_text(GGUF_FILES "/target.gguf", "old") != 0 ||
        symlink("target.gguf", GGUF_FILES "/link.gguf") != 0 ||
        symlink("nowhere.gguf", GGUF_FILES "/dangling.gguf") != 0 ||
        write_text(GGUF_FILES "/x.gguf.tmp", "mine") != 0) {
        check(r, 0, "could not make the links in " GGUF_FILES);
        return;
    }
    expect_program(r, "./tools/export", GGUF_EXPORT GGUF_FILES "/link.gguf" GGUF_TOKENIZER, 0,
                   GGUF_FILES "/link.gguf: " GGUF_WRITTEN);
    check(r, lstat(GGUF_FILES "/link.gguf", &st) == 0 && S_ISLNK(st.st_mode) &&
          gguf_starts_with(GGUF_FILES "/target.gguf", "GGUF"),
          "through a symbolic link: the link stays a link, its target holds the GGUF file");
    expect_program(r, "./tools/export", GGUF_EXPORT GGUF_FILES "/dangling.gguf" GGUF_TOKENIZER, 2,
                   "export: " GGUF_FILES "/dangling.gguf: a symbolic link to nothing that exists");
    check(r, access(GGUF_FILES "/nowhere.gguf", F_OK) != 0, "the link to nothing made no file");
    expect_program(r, "./tools/export", GGUF_EXPORT "/dev/null" GGUF_TOKENIZER, 2,
                   "export: /dev/null: not a regular file: GGUF goes to a file");
    check(r, lstat("/dev/null", &st) == 0 && S_ISCHR(st.st_mode), "/dev/null is still a device");
    expect_program(r, "./tools/export", GGUF_EXPORT GGUF_FILES GGUF_TOKENIZER, 2,
                   "export: " GGUF_FILES ": not a regular file: GGUF goes to a file");
    expect_program(r, "./tools/export", GGUF_EXPORT GGUF_FILES "/x.gguf" GGUF_TOKENIZER, 0, GGUF_WRITTEN);
    FILE *f = fopen(GGUF_FILES "/x.gguf.tmp", "r");
    char mine[8] = "";
    if (f) { mine[fread(mine, 1, sizeof mine - 1, f)] = '\0'; fclose(f); }
    check(r, !strcmp(mine, "mine") && gguf_starts_with(GGUF_FILES "/x.gguf", "GGUF"),
          GGUF_FILES "/x.gguf written, the x.gguf.tmp that was there left as it was (\"%s\")", mine);
}

/* A chat template a GGUF string cannot carry is refused by name and nothing is written: a
   NUL (\u0000; tokenizer_config.json's reader refuses it, which once dropped the template
   without a word), bytes that are not UTF-8 in tokenizer_config.json or chat_template.jinja. */
static void gguf_template_text(results *r) {
    static const struct { const char *file, *text; size_t n; const char *want; } cases[] = {
        {"tokenizer_config.json", "{\"chat_template\": \"{{ a }}\\u0000{{ b }}\"}", 0,
         "export: " GGUF_FILES "/tok/tokenizer_config.json: invalid JSON at line 1 (byte 27): "
         "\\u0000 (a NUL character) inside a string (its chat_template would be lost)"},
        {"tokenizer_config.json", "{\"chat_template\": [{\"name\": \"default\", \"template\": \"ab\xC3\"}]}", 0,
         "export: " GGUF_FILES "/tok/tokenizer_config.json: chat_template: not UTF-8 at byte 2 (0xC3), "
         "which a GGUF string must be"},
        {"chat_template.jinja", "{{ messages }}\xFF\xFE", 0,
         "export: " GGUF_FILES "/tok/chat_template.jinja: not UTF-8 at byte 14 (0xFF)"},
        {"chat_template.jinja", "ab\0cd", 5,
         "export: " GGUF_FILES "/tok/chat_template.jinja: a NUL character (\\u0000) at byte 2, "
         "which a GGUF string cannot hold"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (system("rm -f " GGUF_FILES "/tok/tokenizer_config.json " GGUF_FILES "/tok/chat_template.jinja "
                   GGUF_FILES "/t.gguf") != 0) return;
        char path[256];
        snprintf(path, sizeof path, GGUF_FILES "/tok/%s", cases[i].file);
        FILE *f = fopen(path, "wb");
        size_t n = cases[i].n ? cases[i].n : strlen(cases[i].text);
        if (f) { fwrite(cases[i].text, 1, n, f); fclose(f); }
        expect_program(r, "./tools/export", GGUF_EXPORT GGUF_FILES "/t.gguf" GGUF_TOKENIZER, 2, cases[i].want);
        check(r, access(GGUF_FILES "/t.gguf", F_OK) != 0, "%s refused: no t.gguf written", path);
    }
    if (system("rm -f " GGUF_FILES "/tok/chat_template.jinja") != 0) return;
    write_text(GGUF_FILES "/tok/tokenizer_config.json", "{\"chat_template\": \"caf\xC3\xA9 {{ m }}\"}");
    expect_program(r, "./tools/export", GGUF_EXPORT GGUF_FILES "/t.gguf" GGUF_TOKENIZER, 0, GGUF_WRITTEN);
}

static void test_gguf_files(results *r) {
    lg_model m;
    char dir[256];
    if (system("rm -rf " GGUF_FILES " && mkdir -p " GGUF_FILES "/tok && cp " GGUF_CASES_GPT2_TOKENIZER
               "/encoder.json " GGUF_CASES_GPT2_TOKENIZER "/vocab.bpe " GGUF_FILES "/tok/") != 0 ||
        access("./tools/export", X_OK) != 0) {
        check(r, 0, "tools/export and " GGUF_FILES "/tok: make tools/export tokenizers");
        return;
    }
    if (gguf_make_model(r, &gguf_cases[0], &m, dir, sizeof dir) != 0) return;
    lg_model_free(&m);
    gguf_long_paths(r);
    gguf_odd_outputs(r);
    gguf_template_text(r);
}
