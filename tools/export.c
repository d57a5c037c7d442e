/* tools/export.c — a trained (or downloaded) model out to the formats other programs run.

   tools/export gguf DIR FILE [--type f32|f16|bf16|q8_0] [--tokenizer PATH]

   DIR is a Hugging Face directory or a step-N directory this trainer wrote (config.json and
   model.safetensors, or its shards) holding its tokenizer (tokenizer.json, or GPT-2's
   encoder.json + vocab.bpe; tokenizer_config.json's chat template when there is one), or names
   it with --tokenizer (a directory, or a tokenizer.json whose directory has the rest). FILE
   gets a GGUF v3 file that llama.cpp loads: general.architecture (gpt2, gptneox, llama, qwen2
   or falcon) and that architecture's keys, the tensors under llama.cpp's names (Llama's q and
   k rows in the order llama.cpp's converter gives them: the pairs that rotate together next to
   each other), Llama 3.1's rope scaling as llama.cpp's rope_freqs factors, and the tokenizer
   (tokenizer.ggml.*). FILE is written under a fresh temporary name beside it and renamed over
   it; a symbolic link is written through (its target gets the file); a device, a directory or
   a path longer than LG_PATH_MAX less the temporary suffix is refused, and so is a chat template
   or string holding a NUL or bytes that are not UTF-8. --type: the 2-D weights in f32 (default), f16, bf16 or q8_0 (llama.cpp's
   blocks of 32 values, an fp16 scale and 32 int8; a matrix whose rows are not a multiple of 32
   long stays f16, as llama.cpp's converter does); vectors stay f32.

   Format: GGUF v3 as ggml's docs/gguf.md describes it: "GGUF", version, tensor count, metadata
   count (little-endian), the metadata (key, type, value), the tensor infos (name, dims with the
   fastest first, ggml type, offset in the data), then the data, each tensor on a
   general.alignment (32) boundary. Exit codes: 0 written, 1 I/O error or unreadable model, 2 bad usage or input (no
   tokenizer, an architecture llama.cpp has no graph for). */
#define _POSIX_C_SOURCE 200809L /* fileno, fsync */
#define _XOPEN_SOURCE 700       /* realpath */
#define LITGPT_IMPLEMENTATION
#include "../litgpt.h"

#include <limits.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char usage[] =
    "usage: tools/export gguf DIR FILE [--type f32|f16|bf16|q8_0] [--tokenizer PATH]\n"
    "  DIR   a Hugging Face directory or a step-N directory of ./train --out, with the\n"
    "        tokenizer in it (tokenizer.json, or encoder.json + vocab.bpe)\n"
    "  FILE  the GGUF file to write (llama.cpp, Ollama, LM Studio read it)\n"
    "  --type  the matrices' type: f32 (default), f16, bf16, q8_0\n"
    "  --tokenizer PATH  the tokenizer's directory (or tokenizer.json) when DIR has none\n";

/* Stops with the message; a setting the library's messages name (no flag of export's sets
   one) by its name alone (lg_setting_flag). */
static void die(int code, const char *fmt, ...) {
    char marked[4096], message[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(marked, sizeof marked, fmt, ap);
    va_end(ap);
    lg_spell_settings(marked, lg_setting_flag, NULL, message, sizeof message);
    fprintf(stderr, "export: %s\n", message);
    exit(code);
}

/* ---- GGUF's numbers (ggml's gguf.h, ggml.h and llama.h) ---------------------------------- */

enum { GGUF_UINT8 = 0, GGUF_INT32 = 5, GGUF_UINT32 = 4, GGUF_FLOAT32 = 6, GGUF_BOOL = 7,
       GGUF_STRING = 8, GGUF_ARRAY = 9 };
enum { GGML_F32 = 0, GGML_F16 = 1, GGML_Q8_0 = 8, GGML_BF16 = 30 };
#define GGUF_ALIGNMENT 32
#define Q8_BLOCK 32 /* values sharing one fp16 scale */
/* llama.cpp's token types */
enum { TOKEN_NORMAL = 1, TOKEN_UNKNOWN = 2, TOKEN_CONTROL = 3, TOKEN_UNUSED = 5, TOKEN_BYTE = 6 };

typedef struct {
    const char *name;
    int ggml_type;  /* of the matrices */
    int file_type;  /* general.file_type: llama.h's LLAMA_FTYPE_* */
} export_type;

static const export_type export_types[] = {
    {"f32", GGML_F32, 0}, {"f16", GGML_F16, 1}, {"bf16", GGML_BF16, 32}, {"q8_0", GGML_Q8_0, 7}};

/* ---- a growing byte buffer: the header, metadata and tensor infos ----------------------- */

typedef struct {
    unsigned char *bytes;
    size_t n, cap;
} bytes_out;

static void put(bytes_out *b, const void *data, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 4096;
        b->bytes = (unsigned char *)realloc(b->bytes, b->cap);
        if (!b->bytes) die(1, "out of memory writing the GGUF header");
    }
    memcpy(b->bytes + b->n, data, n);
    b->n += n;
}
static void put_u32(bytes_out *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(bytes_out *b, uint64_t v) { put(b, &v, 8); }
static void put_str(bytes_out *b, const char *s, size_t n) { put_u64(b, n); put(b, s, n); }

/* Refuses text that a GGUF string cannot carry as llama.cpp reads it: a NUL (C strings end
   there, so the rest would be lost) or bytes that are not UTF-8. what names the text. */
static void check_gguf_text(const char *what, const char *text, size_t n) {
    const char *nul = (const char *)memchr(text, '\0', n);
    if (nul) die(2, "%s: a NUL character (\\u0000) at byte %zu, which a GGUF string cannot hold", what,
                 (size_t)(nul - text));
    for (size_t at = 0; at < n;) {
        int size;
        if (lg_utf8_next((const unsigned char *)text + at, n - at, &size) >= 0x110000u)
            die(2, "%s: not UTF-8 at byte %zu (0x%02X), which a GGUF string must be", what, at,
                (unsigned char)text[at]);
        at += (size_t)size;
    }
}

/* Metadata: each kv_* writes one key, its type and its value, and counts it. */
typedef struct {
    bytes_out b;
    uint64_t count;
} metadata;

static void kv_key(metadata *m, const char *key, uint32_t type) {
    put_str(&m->b, key, strlen(key));
    put_u32(&m->b, type);
    m->count++;
}
static void kv_u32(metadata *m, const char *key, uint32_t v) { kv_key(m, key, GGUF_UINT32); put_u32(&m->b, v); }
static void kv_f32(metadata *m, const char *key, float v) { kv_key(m, key, GGUF_FLOAT32); put(&m->b, &v, 4); }
static void kv_bool(metadata *m, const char *key, int v) {
    unsigned char c = v ? 1 : 0;
    kv_key(m, key, GGUF_BOOL);
    put(&m->b, &c, 1);
}
static void kv_str(metadata *m, const char *key, const char *v) {
    check_gguf_text(key, v, strlen(v));
    kv_key(m, key, GGUF_STRING);
    put_str(&m->b, v, strlen(v));
}
/* An array's header; the caller puts its n items. */
static void kv_array(metadata *m, const char *key, uint32_t item_type, uint64_t n) {
    kv_key(m, key, GGUF_ARRAY);
    put_u32(&m->b, item_type);
    put_u64(&m->b, n);
}
/* "ARCH.suffix" */
static void kv_arch_u32(metadata *m, const char *arch, const char *suffix, uint32_t v) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    kv_u32(m, key, v);
}
static void kv_arch_f32(metadata *m, const char *arch, const char *suffix, float v) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    kv_f32(m, key, v);
}

/* ---- the tensors, under llama.cpp's names ------------------------------------------------ */

typedef struct {
    char name[64];
    const float *src;  /* (rows, cols) row-major, fp32 */
    int rows, cols;    /* a vector: rows 1, written 1-D */
    int rope_heads;    /* > 0: Llama's q or k of this many heads, rows put in llama.cpp's order */
    int type;          /* ggml type */
    uint64_t offset;   /* in the data section */
} gguf_tensor;

typedef struct {
    gguf_tensor *t;
    int n, cap;
} tensor_list;

static void add_tensor(tensor_list *l, const char *name, const float *src, int rows, int cols,
                       int rope_heads) {
    if (!src) return; /* absent in this architecture */
    if (l->n == l->cap) {
        l->cap = l->cap * 2 + 32;
        l->t = (gguf_tensor *)realloc(l->t, sizeof *l->t * (size_t)l->cap);
        if (!l->t) die(1, "out of memory");
    }
    gguf_tensor *t = &l->t[l->n++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->src = src;
    t->rows = rows;
    t->cols = cols;
    t->rope_heads = rope_heads;
}

static const float *f32_of(lg_buf b) { return (const float *)b.data; }

/* blk.N.NAME */
static void add_block_tensor(tensor_list *l, int block, const char *name, lg_buf b, size_t skip_rows,
                             int rows, int cols, int rope_heads) {
    if (!b.data) return;
    char full[64];
    snprintf(full, sizeof full, "blk.%d.%s", block, name);
    add_tensor(l, full, f32_of(b) + skip_rows * (size_t)cols, rows, cols, rope_heads);
}

static const char *arch_of(lg_hf_family family) {
    switch (family) {
    case LG_HF_GPT2: return "gpt2";
    case LG_HF_GPTNEOX: return "gptneox";
    case LG_HF_LLAMA: return "llama";
    case LG_HF_QWEN2: return "qwen2";
    case LG_HF_FALCON: return "falcon";
    }
    return "?";
}

/* q, k and v of one block: split for Llama and Qwen2 (attn_q, attn_k, attn_v), fused for
   GPT-2, GPT-NeoX and Falcon (attn_qkv: all query heads, then the keys, then the values, which
   is the library's own layout of qkv). */
static void add_attention(tensor_list *l, const lg_config *c, lg_hf_family family, int i,
                          const lg_block_tensors *b) {
    int C = c->n_embd, HS = c->head_size, NH = c->n_head, NQG = c->n_query_groups;
    int QKV = (NH + 2 * NQG) * HS;
    if (family == LG_HF_LLAMA || family == LG_HF_QWEN2) {
        int rope = family == LG_HF_LLAMA; /* llama.cpp's llama rotates adjacent pairs */
        add_block_tensor(l, i, "attn_q.weight", b->qkv_w, 0, NH * HS, C, rope ? NH : 0);
        add_block_tensor(l, i, "attn_k.weight", b->qkv_w, (size_t)NH * HS, NQG * HS, C, rope ? NQG : 0);
        add_block_tensor(l, i, "attn_v.weight", b->qkv_w, (size_t)(NH + NQG) * HS, NQG * HS, C, 0);
        add_block_tensor(l, i, "attn_q.bias", b->qkv_b, 0, 1, NH * HS, rope ? NH : 0);
        if (b->qkv_b.data) {
            /* biases are one row: the k and v parts start NH HS (and NQG HS more) in */
            const float *qkv_b = f32_of(b->qkv_b);
            char name[64];
            snprintf(name, sizeof name, "blk.%d.attn_k.bias", i);
            add_tensor(l, name, qkv_b + (size_t)NH * HS, 1, NQG * HS, rope ? NQG : 0);
            snprintf(name, sizeof name, "blk.%d.attn_v.bias", i);
            add_tensor(l, name, qkv_b + (size_t)(NH + NQG) * HS, 1, NQG * HS, 0);
        }
    } else {
        add_block_tensor(l, i, "attn_qkv.weight", b->qkv_w, 0, QKV, C, 0);
        add_block_tensor(l, i, "attn_qkv.bias", b->qkv_b, 0, 1, QKV, 0);
    }
    add_block_tensor(l, i, "attn_output.weight", b->proj_w, 0, C, NH * HS, 0);
    add_block_tensor(l, i, "attn_output.bias", b->proj_b, 0, 1, C, 0);
}

static void add_block(tensor_list *l, const lg_config *c, lg_hf_family family, int i,
                      const lg_block_tensors *b) {
    int C = c->n_embd, I = c->intermediate_size;
    add_block_tensor(l, i, "attn_norm.weight", b->norm_1_w, 0, 1, C, 0);
    add_block_tensor(l, i, "attn_norm.bias", b->norm_1_b, 0, 1, C, 0);
    add_attention(l, c, family, i, b);
    add_block_tensor(l, i, "ffn_norm.weight", b->norm_2_w, 0, 1, C, 0); /* none when shared */
    add_block_tensor(l, i, "ffn_norm.bias", b->norm_2_b, 0, 1, C, 0);
    if (c->mlp_class_name == LG_MLP_LLAMA) { /* silu(fc_1 x) * fc_2 x: gate and up */
        add_block_tensor(l, i, "ffn_gate.weight", b->fc_w, 0, I, C, 0);
        add_block_tensor(l, i, "ffn_gate.bias", b->fc_b, 0, 1, I, 0);
        add_block_tensor(l, i, "ffn_up.weight", b->fc_2_w, 0, I, C, 0);
        add_block_tensor(l, i, "ffn_up.bias", b->fc_2_b, 0, 1, I, 0);
    } else {
        add_block_tensor(l, i, "ffn_up.weight", b->fc_w, 0, I, C, 0);
        add_block_tensor(l, i, "ffn_up.bias", b->fc_b, 0, 1, I, 0);
    }
    add_block_tensor(l, i, "ffn_down.weight", b->mlp_proj_w, 0, C, I, 0);
    add_block_tensor(l, i, "ffn_down.bias", b->mlp_proj_b, 0, 1, C, 0);
}

/* Llama 3.1's frequency scaling as llama.cpp's converter writes it: one factor a rotated pair
   (rope_freqs.weight), each frequency divided by its factor. (HS / 2) floats. */
static float *llama3_rope_factors(const lg_config *c) {
    const lg_rope_adjustments *r = &c->rope_adjustments;
    int dim = c->head_size, n = dim / 2;
    float *factors = (float *)malloc(sizeof(float) * (size_t)n);
    double low_wavelen = r->original_max_seq_len / r->low_freq_factor;
    double high_wavelen = r->original_max_seq_len / r->high_freq_factor;
    for (int i = 0; i < n; i++) {
        double freq = 1.0 / pow(c->rope_base, (2.0 * i) / dim);
        double wavelen = 2 * 3.14159265358979323846 / freq;
        if (wavelen < high_wavelen) factors[i] = 1.0f;
        else if (wavelen > low_wavelen) factors[i] = r->factor;
        else {
            double smooth = (r->original_max_seq_len / wavelen - r->low_freq_factor) /
                            (r->high_freq_factor - r->low_freq_factor);
            factors[i] = (float)(1.0 / ((1 - smooth) / r->factor + smooth));
        }
    }
    return factors;
}

static void list_tensors(tensor_list *l, const lg_config *c, lg_hf_family family,
                         const lg_param_tensors *p, const float *rope_factors) {
    int C = c->n_embd, Vp = c->padded_vocab_size;
    add_tensor(l, "token_embd.weight", f32_of(p->wte), Vp, C, 0);
    add_tensor(l, "position_embd.weight", f32_of(p->wpe), c->block_size, C, 0);
    add_tensor(l, "rope_freqs.weight", rope_factors, 1, c->head_size / 2, 0);
    for (int i = 0; i < c->n_layer; i++) add_block(l, c, family, i, &p->h[i]);
    add_tensor(l, "output_norm.weight", f32_of(p->ln_f_w), 1, C, 0);
    add_tensor(l, "output_norm.bias", f32_of(p->ln_f_b), 1, C, 0);
    /* tied: llama.cpp reads token_embd again, except GPT-NeoX's, which needs output */
    if (!c->tie_embeddings || family == LG_HF_GPTNEOX)
        add_tensor(l, "output.weight", f32_of(p->lm_head_w), Vp, C, 0);
    add_tensor(l, "output.bias", f32_of(p->lm_head_b), 1, Vp, 0);
}

/* What llama.cpp's graphs of each architecture cannot hold; NULL when it can. */
static const char *unsupported(const lg_config *c, lg_hf_family family) {
    int square = c->n_head * c->head_size == c->n_embd;
    if (c->lm_head_bias && family != LG_HF_QWEN2) return "lm_head_bias outside Qwen2";
    if (family == LG_HF_LLAMA && c->bias) return "Llama with biases on every linear";
    if (family == LG_HF_QWEN2 && (c->bias || !square))
        return "Qwen2 with linear biases or n_head * head_size != n_embd";
    if ((family == LG_HF_GPT2 || family == LG_HF_GPTNEOX) && c->n_query_groups != c->n_head)
        return "grouped-query attention in GPT-2 or GPT-NeoX";
    if (c->rope_adjustments.factor > 0 && family != LG_HF_LLAMA) return "rope_adjustments outside Llama";
    return NULL;
}

/* ---- the architecture's keys -------------------------------------------------------------- */

static void write_arch_keys(metadata *m, const lg_config *c, lg_hf_family family,
                            const export_type *type) {
    const char *a = arch_of(family);
    kv_str(m, "general.architecture", a);
    kv_str(m, "general.name", c->name[0] ? c->name : a);
    kv_u32(m, "general.file_type", (uint32_t)type->file_type);
    kv_u32(m, "general.alignment", GGUF_ALIGNMENT);
    kv_arch_u32(m, a, "context_length", (uint32_t)c->block_size);
    kv_arch_u32(m, a, "embedding_length", (uint32_t)c->n_embd);
    kv_arch_u32(m, a, "block_count", (uint32_t)c->n_layer);
    kv_arch_u32(m, a, "feed_forward_length", (uint32_t)c->intermediate_size);
    kv_arch_u32(m, a, "attention.head_count", (uint32_t)c->n_head);
    kv_arch_u32(m, a, "attention.head_count_kv", (uint32_t)c->n_query_groups);
    if (c->n_head * c->head_size != c->n_embd) {
        kv_arch_u32(m, a, "attention.key_length", (uint32_t)c->head_size);
        kv_arch_u32(m, a, "attention.value_length", (uint32_t)c->head_size);
    }
    if (c->norm_class_name == LG_NORM_RMSNORM) kv_arch_f32(m, a, "attention.layer_norm_rms_epsilon", c->norm_eps);
    else kv_arch_f32(m, a, "attention.layer_norm_epsilon", c->norm_eps);
    if (family != LG_HF_GPT2) {
        kv_arch_u32(m, a, "rope.dimension_count", (uint32_t)lg_config_rope_dims(c));
        kv_arch_f32(m, a, "rope.freq_base", c->rope_base);
    }
    if (family == LG_HF_GPTNEOX) {
        char key[128];
        snprintf(key, sizeof key, "%s.use_parallel_residual", a);
        kv_bool(m, key, c->parallel_residual);
    }
    if (family == LG_HF_LLAMA) kv_arch_u32(m, a, "vocab_size", (uint32_t)c->padded_vocab_size);
}

/* ---- the tokenizer ------------------------------------------------------------------------ */

/* GPT-2's byte-level alphabet: the printable bytes stand for themselves, the others for
   U+0100 onwards in byte order. UTF-8 of byte b's character into out (2 bytes at most). */
static int byte_char(int b, char *out) {
    int printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    int cp = b;
    if (!printable) {
        int k = 0;
        for (int x = 0; x < b; x++)
            if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) k++;
        cp = 256 + k;
    }
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    out[0] = (char)(0xC0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}

/* Token id's text as llama.cpp's vocabulary holds it, into text (cleared first). */
static void token_text(const lg_tokenizer *tok, int id, lg_text *text) {
    text->n = 0;
    const char *piece = tok->pieces + tok->piece_start[id];
    size_t n = tok->piece_start[id + 1] - tok->piece_start[id];
    if (tok->sentencepiece) { lg_text_append(text, piece, n); return; }
    for (size_t i = 0; i < n; i++) {
        char utf8[2];
        lg_text_append(text, utf8, (size_t)byte_char((unsigned char)piece[i], utf8));
    }
}

static int is_special(const lg_tokenizer *tok, int id) {
    for (int i = 0; i < tok->n_special; i++)
        if (tok->special[i] == id) return 1;
    return 0;
}

static int token_type(const lg_tokenizer *tok, int id, int unk) {
    if (id >= tok->vocab_size || tok->piece_start[id + 1] == tok->piece_start[id]) return TOKEN_UNUSED;
    if (id == unk) return TOKEN_UNKNOWN;
    if (is_special(tok, id)) return TOKEN_CONTROL;
    if (tok->sentencepiece)
        for (int b = 0; b < 256; b++)
            if (tok->byte_token[b] == id) return TOKEN_BYTE;
    return TOKEN_NORMAL;
}

typedef struct { int rank, left, right; } merge_entry;

static int by_rank(const void *a, const void *b) {
    return ((const merge_entry *)a)->rank - ((const merge_entry *)b)->rank;
}

/* The merges in rank order (tok->n_merges of them, malloc'd). */
static merge_entry *merges_in_order(const lg_tokenizer *tok) {
    merge_entry *list = (merge_entry *)malloc(sizeof(merge_entry) * (size_t)(tok->n_merges + 1));
    int n = 0;
    for (size_t s = 0; s < tok->merge_slots && n < tok->n_merges; s++) {
        if (tok->merge_pair[s] == UINT64_MAX) continue;
        list[n].rank = tok->merge_rank[s];
        list[n].left = (int)(tok->merge_pair[s] >> 32);
        list[n].right = (int)(tok->merge_pair[s] & 0xFFFFFFFFu);
        n++;
    }
    qsort(list, (size_t)n, sizeof *list, by_rank);
    return list;
}

/* SentencePiece's scores, which llama.cpp merges by (highest first): minus the rank of the
   first merge that makes the token, so its order is the merge list's; 0 for the rest. */
static float *spm_scores(const lg_tokenizer *tok, int n_tokens) {
    float *scores = (float *)calloc((size_t)n_tokens, sizeof(float));
    for (size_t s = 0; s < tok->merge_slots; s++) {
        if (tok->merge_pair[s] == UINT64_MAX) continue;
        int id = tok->merge_result[s];
        float score = -(float)(tok->merge_rank[s] + 1);
        if (id >= 0 && id < n_tokens && (scores[id] == 0 || score > scores[id])) scores[id] = score;
    }
    return scores;
}

static void write_tokens(metadata *m, const lg_tokenizer *tok, int n_tokens, int unk) {
    lg_text text = {NULL, 0, 0};
    kv_array(m, "tokenizer.ggml.tokens", GGUF_STRING, (uint64_t)n_tokens);
    for (int id = 0; id < n_tokens; id++) {
        if (token_type(tok, id, unk) == TOKEN_UNUSED) {
            char pad[32];
            snprintf(pad, sizeof pad, "[PAD%d]", id);
            put_str(&m->b, pad, strlen(pad));
        } else {
            token_text(tok, id, &text);
            char what[64];
            snprintf(what, sizeof what, "the tokenizer's token %d", id);
            check_gguf_text(what, text.bytes, text.n);
            put_str(&m->b, text.bytes, text.n);
        }
    }
    kv_array(m, "tokenizer.ggml.token_type", GGUF_INT32, (uint64_t)n_tokens);
    for (int id = 0; id < n_tokens; id++) put_u32(&m->b, (uint32_t)token_type(tok, id, unk));
    lg_text_free(&text);
}

static void write_merges(metadata *m, const lg_tokenizer *tok, const merge_entry *merges) {
    lg_text left = {NULL, 0, 0}, right = {NULL, 0, 0};
    kv_array(m, "tokenizer.ggml.merges", GGUF_STRING, (uint64_t)tok->n_merges);
    for (int i = 0; i < tok->n_merges; i++) {
        token_text(tok, merges[i].left, &left);
        token_text(tok, merges[i].right, &right);
        put_u64(&m->b, left.n + 1 + right.n);
        put(&m->b, left.bytes, left.n);
        put(&m->b, " ", 1);
        put(&m->b, right.bytes, right.n);
    }
    lg_text_free(&left);
    lg_text_free(&right);
}

static const char *pre_tokenizer_name(const lg_tokenizer *tok) {
    switch (tok->pretokenizer) {
    case LG_PRETOKENIZE_GPT2: return "gpt-2";
    case LG_PRETOKENIZE_LLAMA3: return "llama-bpe";
    case LG_PRETOKENIZE_QWEN2: return "qwen2";
    default: return "default";
    }
}

/* tokenizer_config.json's chat_template: a string, or the "default" of a list of named
   templates; NULL when there is none. Its length into *len (malloc'd). */
static char *config_template(const lg_json *doc, size_t *len) {
    int node = lg_json_find(doc, 0, "chat_template");
    if (node < 0 || doc->nodes[node].kind != LG_JSON_ARRAY) return lg_json_string(doc, node, len);
    char *found = NULL;
    for (int e = doc->nodes[node].first_child; e >= 0 && !found; e = doc->nodes[e].next) {
        char *name = lg_json_string(doc, lg_json_find(doc, e, "name"), NULL);
        if (name && !strcmp(name, "default"))
            found = lg_json_string(doc, lg_json_find(doc, e, "template"), len);
        LG_FREE(name);
    }
    return found;
}

/* DIR/tokenizer_config.json's chat_template, else DIR/chat_template.jinja; NULL when neither;
   refused by name when it is not text a GGUF string holds. malloc'd. */
static char *chat_template(const char *dir, int *add_bos) {
    char path[LG_PATH_MAX + 32], what[LG_PATH_MAX + 64];
    size_t len = 0;
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    lg_error err;
    char *text = access(path, R_OK) == 0 ? lg_read_file(path, &len, "tokenizer config", &err) : NULL;
    char *found = NULL;
    lg_json doc;
    if (access(path, R_OK) == 0 && !text) die(1, "%s", err.msg);
    if (text && lg_json_parse(&doc, text, len, path, &err) != 0)
        die(2, "%s (its chat_template would be lost)", err.msg);
    if (text) {
        found = config_template(&doc, &len);
        snprintf(what, sizeof what, "%s: chat_template", path);
        int bos = lg_json_find(&doc, 0, "add_bos_token");
        if (bos >= 0 && doc.nodes[bos].kind == LG_JSON_TRUE) *add_bos = 1;
        if (bos >= 0 && doc.nodes[bos].kind == LG_JSON_FALSE) *add_bos = 0;
        lg_json_free(&doc);
    }
    LG_FREE(text);
    snprintf(path, sizeof path, "%s/chat_template.jinja", dir);
    if (!found && access(path, R_OK) == 0) {
        found = lg_read_file(path, &len, "chat template", NULL);
        snprintf(what, sizeof what, "%s", path);
    }
    if (found) check_gguf_text(what, found, len);
    return found;
}

static void write_tokenizer(metadata *m, const lg_tokenizer *tok, int n_tokens, const char *dir) {
    int unk = tok->sentencepiece ? lg_tokenizer_find(tok, "<unk>", 5) : -1;
    merge_entry *merges = merges_in_order(tok);
    kv_str(m, "tokenizer.ggml.model", tok->sentencepiece ? "llama" : "gpt2");
    if (!tok->sentencepiece) kv_str(m, "tokenizer.ggml.pre", pre_tokenizer_name(tok));
    write_tokens(m, tok, n_tokens, unk);
    if (tok->sentencepiece) {
        float *scores = spm_scores(tok, n_tokens);
        kv_array(m, "tokenizer.ggml.scores", GGUF_FLOAT32, (uint64_t)n_tokens);
        put(&m->b, scores, sizeof(float) * (size_t)n_tokens);
        free(scores);
    } else {
        write_merges(m, tok, merges);
    }
    free(merges);
    int eos = tok->eos >= 0 ? tok->eos : lg_tokenizer_find(tok, "<|endoftext|>", 13);
    int bos = tok->bos >= 0 ? tok->bos : eos;
    if (bos >= 0) kv_u32(m, "tokenizer.ggml.bos_token_id", (uint32_t)bos);
    if (eos >= 0) kv_u32(m, "tokenizer.ggml.eos_token_id", (uint32_t)eos);
    if (unk >= 0) kv_u32(m, "tokenizer.ggml.unknown_token_id", (uint32_t)unk);
    if (tok->pad >= 0) kv_u32(m, "tokenizer.ggml.padding_token_id", (uint32_t)tok->pad);
    int add_bos = tok->sentencepiece || tok->pretokenizer == LG_PRETOKENIZE_LLAMA3;
    char *template_text = chat_template(dir, &add_bos);
    kv_bool(m, "tokenizer.ggml.add_bos_token", add_bos);
    kv_bool(m, "tokenizer.ggml.add_eos_token", 0);
    if (template_text) kv_str(m, "tokenizer.chat_template", template_text);
    LG_FREE(template_text);
}

/* ---- tensor data -------------------------------------------------------------------------- */

static uint64_t align_up(uint64_t x) { return (x + GGUF_ALIGNMENT - 1) / GGUF_ALIGNMENT * GGUF_ALIGNMENT; }

static uint64_t tensor_bytes(const gguf_tensor *t) {
    uint64_t n = (uint64_t)t->rows * (uint64_t)t->cols;
    switch (t->type) {
    case GGML_F16: case GGML_BF16: return n * 2;
    case GGML_Q8_0: return n / Q8_BLOCK * (2 + Q8_BLOCK);
    default: return n * 4;
    }
}

/* Row r of the tensor as llama.cpp reads it. Llama's q and k: within each head of HS rows, the
   row pairs (i, i + HS/2) that rotate together in the library (Hugging Face's order) become
   rows (2i, 2i + 1), the order of llama.cpp's converter (the same shuffle for a bias's
   elements: then rows is 1 and cols the head rows). */
static size_t source_row(const gguf_tensor *t, size_t r) {
    if (!t->rope_heads || t->rows == 1) return r;
    size_t HS = (size_t)t->rows / (size_t)t->rope_heads, h = r / HS, j = r % HS;
    return h * HS + (j % 2) * (HS / 2) + j / 2;
}

/* One row (cols values) as type into out. Q8_0: d = max |x| / 127 (fp16), q = round(x / d). */
static void convert_row(const float *x, int cols, int type, unsigned char *out) {
    if (type == GGML_F32) { memcpy(out, x, sizeof(float) * (size_t)cols); return; }
    if (type == GGML_F16 || type == GGML_BF16) {
        uint16_t *h = (uint16_t *)out;
        for (int i = 0; i < cols; i++) h[i] = type == GGML_F16 ? lg_f32_to_f16(x[i]) : lg_f32_to_bf16(x[i]);
        return;
    }
    for (int b = 0; b < cols / Q8_BLOCK; b++, out += 2 + Q8_BLOCK) {
        const float *v = x + b * Q8_BLOCK;
        float amax = 0;
        for (int i = 0; i < Q8_BLOCK; i++) amax = fmaxf(amax, fabsf(v[i]));
        float d = amax / 127.0f, inv = d ? 1.0f / d : 0.0f;
        uint16_t dh = lg_f32_to_f16(d);
        memcpy(out, &dh, 2);
        for (int i = 0; i < Q8_BLOCK; i++) out[2 + i] = (unsigned char)(int8_t)roundf(v[i] * inv);
    }
}

static int write_tensor_data(FILE *f, const gguf_tensor *t) {
    size_t row_bytes = (size_t)(tensor_bytes(t) / (uint64_t)t->rows);
    unsigned char *row = (unsigned char *)malloc(row_bytes);
    float *permuted = (float *)malloc(sizeof(float) * (size_t)t->cols);
    int ok = row && permuted;
    for (size_t r = 0; ok && r < (size_t)t->rows; r++) {
        const float *x = t->src + source_row(t, r) * (size_t)t->cols;
        if (t->rope_heads && t->rows == 1) { /* a bias: shuffle its elements */
            gguf_tensor as_rows = *t;
            as_rows.rows = t->cols;
            for (size_t i = 0; i < (size_t)t->cols; i++) permuted[i] = t->src[source_row(&as_rows, i)];
            x = permuted;
        }
        convert_row(x, t->cols, t->type, row);
        ok = fwrite(row, 1, row_bytes, f) == row_bytes;
    }
    free(row);
    free(permuted);
    return ok ? 0 : -1;
}

/* ---- the file ------------------------------------------------------------------------------ */

static void choose_types(tensor_list *l, const export_type *type) {
    for (int i = 0; i < l->n; i++) {
        gguf_tensor *t = &l->t[i];
        int matrix = t->rows > 1;
        t->type = !matrix ? GGML_F32 : type->ggml_type;
        if (t->type == GGML_Q8_0 && t->cols % Q8_BLOCK) t->type = GGML_F16; /* as llama.cpp's converter */
    }
}

static void tensor_infos(bytes_out *b, tensor_list *l) {
    uint64_t offset = 0;
    for (int i = 0; i < l->n; i++) {
        gguf_tensor *t = &l->t[i];
        t->offset = offset;
        offset = align_up(offset + tensor_bytes(t));
        put_str(b, t->name, strlen(t->name));
        put_u32(b, t->rows > 1 ? 2 : 1);
        put_u64(b, (uint64_t)t->cols); /* ne0: the fastest dimension first */
        if (t->rows > 1) put_u64(b, (uint64_t)t->rows);
        put_u32(b, (uint32_t)t->type);
        put_u64(b, t->offset);
    }
}

static int write_zeros(FILE *f, uint64_t n) {
    static const unsigned char zeros[GGUF_ALIGNMENT] = {0};
    return n && fwrite(zeros, 1, (size_t)n, f) != n ? -1 : 0;
}

/* Where FILE's bytes go: FILE itself, or the file a symbolic link names (written through, so
   the link stays); refused by name when that is not a regular file (a device, a FIFO, a
   directory) or when the path, with the temporary name's suffix, is longer than LG_PATH_MAX. */
static void output_path(const char *file, char *out, size_t cap) {
    struct stat st;
    if (strlen(file) + sizeof ".tmp.XXXXXX" > cap)
        die(2, "%s: the path is %zu bytes, longer than the %zu this tool writes", file, strlen(file),
            cap - sizeof ".tmp.XXXXXX");
    snprintf(out, cap, "%s", file);
    if (lstat(file, &st) != 0) return; /* a new file */
    if (S_ISLNK(st.st_mode)) {
        char *target = realpath(file, NULL);
        if (!target) die(2, "%s: a symbolic link to nothing that exists (%s)", file, strerror(errno));
        if (strlen(target) + sizeof ".tmp.XXXXXX" > cap)
            die(2, "%s: the link's target is %zu bytes, longer than the %zu this tool writes", file,
                strlen(target), cap - sizeof ".tmp.XXXXXX");
        snprintf(out, cap, "%s", target);
        free(target);
        if (stat(out, &st) != 0) die(2, "%s: cannot read its target %s (%s)", file, out, strerror(errno));
    }
    if (!S_ISREG(st.st_mode)) die(2, "%s: not a regular file: GGUF goes to a file", file);
}

static int write_all(FILE *f, const metadata *m, tensor_list *l) {
    bytes_out head = {NULL, 0, 0};
    put(&head, "GGUF", 4);
    put_u32(&head, 3);
    put_u64(&head, (uint64_t)l->n);
    put_u64(&head, m->count);
    put(&head, m->b.bytes, m->b.n);
    tensor_infos(&head, l);
    int rc = fwrite(head.bytes, 1, head.n, f) == head.n ? 0 : -1;
    uint64_t at = align_up(head.n);
    if (rc == 0) rc = write_zeros(f, at - head.n);
    for (int i = 0; rc == 0 && i < l->n; i++) {
        rc = write_tensor_data(f, &l->t[i]);
        uint64_t end = l->t[i].offset + tensor_bytes(&l->t[i]);
        if (rc == 0 && i + 1 < l->n) rc = write_zeros(f, align_up(end) - end);
    }
    free(head.bytes);
    return rc;
}

/* FILE (or a symbolic link's target) written under a fresh temporary name beside it
   (FILE.tmp.XXXXXX, which names no file already there), flushed and synced, then renamed over
   it. */
static void write_file(const char *file, const metadata *m, tensor_list *l) {
    char path[LG_PATH_MAX], tmp[LG_PATH_MAX];
    output_path(file, path, sizeof path);
    lg_format(tmp, sizeof tmp, "%s.tmp.XXXXXX", path); /* fits: output_path checked */
    int fd = mkstemp(tmp);
    FILE *f = fd >= 0 ? fdopen(fd, "wb") : NULL;
    if (!f) die(1, "%s: cannot write beside it (%s)", path, strerror(errno));
    mode_t mask = umask(0);
    umask(mask);
    int rc = fchmod(fd, 0666 & ~mask) == 0 ? write_all(f, m, l) : -1;
    if (rc == 0) rc = fflush(f) == 0 && fsync(fd) == 0 ? 0 : -1;
    if (fclose(f) != 0) rc = -1;
    if (rc == 0) rc = rename(tmp, path);
    if (rc != 0) { int saved = errno; remove(tmp); die(1, "%s: write failed (%s)", path, strerror(saved)); }
}

/* The directory of a tokenizer path (itself, or a tokenizer.json's directory). */
static const char *tokenizer_dir(const char *path, char *dir, size_t cap) {
    size_t n = strlen(path);
    snprintf(dir, cap, "%s", path);
    if (n > 5 && !strcmp(path + n - 5, ".json")) {
        char *slash = strrchr(dir, '/');
        if (slash) *slash = '\0';
        else snprintf(dir, cap, ".");
    }
    return dir;
}

static int export_gguf(const char *dir, const char *path, const export_type *type,
                       const char *tokenizer) {
    lg_error err;
    lg_config cfg;
    lg_hf_family family;
    if (lg_hf_config_read(&cfg, dir, &err) != 0) die(1, "%s", err.msg);
    char probe[LG_PATH_MAX + 32];
    snprintf(probe, sizeof probe, "%s/adapter_config.json", dir);
    int adapters = access(probe, R_OK) == 0;
    snprintf(probe, sizeof probe, "%s/model.safetensors", dir);
    if (adapters && access(probe, R_OK) != 0)
        die(2, "%s: LoRA adapters without the merged model: export the run's last step-N, which "
            "holds it", dir);
    if (lg_hf_family_of(&cfg, &family, &err) != 0) die(1, "%s", err.msg);
    const char *why = unsupported(&cfg, family);
    if (why) die(2, "%s: %s has no %s model in llama.cpp", dir, why, arch_of(family));
    lg_tokenizer tok;
    if (lg_tokenizer_load(&tok, tokenizer ? tokenizer : dir, &err) != 0)
        die(2, "%s: no tokenizer for the GGUF file (tokenizer.json, or encoder.json + vocab.bpe; "
            "or --tokenizer PATH): %s", tokenizer ? tokenizer : dir, err.msg);
    if (tok.vocab_size > cfg.padded_vocab_size)
        die(2, "%s: the tokenizer has %d tokens, the model's embedding %d rows", dir, tok.vocab_size,
            cfg.padded_vocab_size);
    size_t n = lg_params_layout(&cfg, (lg_buf){NULL, LG_DTYPE_F32}, NULL, NULL);
    lg_buf weights = {malloc(sizeof(float) * n), LG_DTYPE_F32};
    lg_param_tensors p;
    p.h = (lg_block_tensors *)calloc((size_t)cfg.n_layer, sizeof(lg_block_tensors));
    if (!weights.data || !p.h) die(1, "out of memory for %zu weights", n);
    lg_params_layout(&cfg, weights, &p, NULL);
    if (lg_hf_load_weights(&cfg, weights, dir, &err) != 0) die(1, "%s", err.msg);
    float *rope_factors = cfg.rope_adjustments.factor > 0 ? llama3_rope_factors(&cfg) : NULL;
    tensor_list tensors = {NULL, 0, 0};
    list_tensors(&tensors, &cfg, family, &p, rope_factors);
    choose_types(&tensors, type);
    metadata m = {{NULL, 0, 0}, 0};
    char tok_dir[LG_PATH_MAX];
    write_arch_keys(&m, &cfg, family, type);
    write_tokenizer(&m, &tok, cfg.padded_vocab_size, tokenizer_dir(tokenizer ? tokenizer : dir, tok_dir, sizeof tok_dir));
    write_file(path, &m, &tensors);
    printf("%s: %s, %d tensors, %s, %d tokens\n", path, arch_of(family), tensors.n, type->name,
           cfg.padded_vocab_size);
    free(m.b.bytes);
    free(tensors.t);
    free(rope_factors);
    free(weights.data);
    free(p.h);
    lg_tokenizer_free(&tok);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && (!strcmp(argv[1], "-h") || !strcmp(argv[1], "--help"))) {
        fputs(usage, stdout);
        return 0;
    }
    if (argc < 2 || strcmp(argv[1], "gguf") != 0) {
        fputs(usage, stderr);
        if (argc >= 2) die(2, "unknown format %s (gguf is the one there is)", argv[1]);
        return 2;
    }
    const char *dir = NULL, *file = NULL, *tokenizer = NULL;
    const export_type *type = &export_types[0];
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--type")) {
            if (i + 1 >= argc) die(2, "--type needs a value: f32, f16, bf16 or q8_0");
            type = NULL;
            for (size_t k = 0; k < sizeof export_types / sizeof export_types[0]; k++)
                if (!strcmp(argv[i + 1], export_types[k].name)) type = &export_types[k];
            if (!type) die(2, "--type %s: one of f32, f16, bf16, q8_0", argv[i + 1]);
            i++;
        } else if (!strcmp(argv[i], "--tokenizer")) {
            if (i + 1 >= argc) die(2, "--tokenizer needs a PATH");
            tokenizer = argv[++i];
        } else if (argv[i][0] == '-') die(2, "unknown option %s (see tools/export --help)", argv[i]);
        else if (!dir) dir = argv[i];
        else if (!file) file = argv[i];
        else die(2, "one DIR and one FILE: %s is one too many", argv[i]);
    }
    if (!dir || !file) die(2, "gguf needs DIR and FILE (see tools/export --help)");
    return export_gguf(dir, file, type, tokenizer);
}
