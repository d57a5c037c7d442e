/* tools/generate.c — text from a model, with the library's KV cache (section 16 of litgpt.h).

   tools/generate --load DIR [--tokenizer PATH] (--prompt TEXT | --prompt-ids "ID ...")
                  [--max-new-tokens N] [--temperature X] [--top-k K] [--top-p P] [--seed N]
                  [--ids] [-p PRECISION] [--threads N] [--plan] [--memory-limit SIZE]

   DIR is a Hugging Face directory or a step-N directory this trainer wrote (a LoRA run's
   adapters are applied to the base model its adapter_config.json names; a directory of step-N
   directories means the latest complete one). Standard output: the prompt and its continuation
   as text (ids without a tokenizer); with --ids the generated ids, space-separated, as the last
   line. Standard error: the plan's total and the tokens/s of prefill and decode. Exit codes:
   0 done, 1 a model or file error, 2 bad usage or input, 3 the plan does not fit. */
#define LITGPT_IMPLEMENTATION
#include "../litgpt.h"

#include <stdarg.h>
#include <string.h>
#include <sys/stat.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static const char usage[] =
    "usage: tools/generate --load DIR (--prompt TEXT | --prompt-ids \"ID ...\") [options]\n"
    "  --load DIR            a Hugging Face directory or a step-N directory of ./train --out\n"
    "                        (LoRA adapters applied to their base model)\n"
    "  --tokenizer PATH      tokenizer.json, or a directory with it or with encoder.json +\n"
    "                        vocab.bpe (default: DIR's, or the adapters' base model's)\n"
    "  --prompt TEXT         text, through the tokenizer (the BOS that tools/prepare alpaca's\n"
    "                        samples start with first)\n"
    "  --prompt-ids \"ID ...\" token ids, space-separated, as they are\n"
    "  --max-new-tokens N    (50) at most this many; the cache holds prompt + N\n"
    "  --temperature X       (0.8) 0: greedy\n"
    "  --top-k K             (50) 0: all tokens\n"
    "  --top-p P             (1) the most likely tokens holding P of the probability\n"
    "  --seed N              (1234)\n"
    "  --ids                 the generated ids as the last line of standard output\n"
    "  -p, --precision P     32-true (default), bf16-true or 16-true: weights and cache\n"
    "  --threads N           (all)\n"
    "  --plan                print the memory plan and exit\n"
    "  --memory-limit SIZE   the memory the plan must fit in (default: what is available)\n"
    "  --chat                a conversation: each line of standard input is a user turn, each\n"
    "                        reply is generated with the model's chat template, the cache\n"
    "                        kept between turns (up to --context tokens); EOF ends it\n"
    "  --template NAME       --chat's template (default: auto, from the tokenizer)\n"
    "  --system TEXT         --chat's system prompt\n"
    "  --context N           --chat: positions the cache holds (default: block_size, at most\n"
    "                        4096)\n";

typedef struct {
    const char *load, *tokenizer, *prompt, *prompt_ids;
    const char *template_name, *system; /* --chat's */
    int max_new, top_k, ids, threads, plan, chat, context;
    float temperature, top_p;
    uint64_t seed;
    lg_precision precision;
    size_t memory_limit; /* 0: MemAvailable */
} generate_args;

/* The settings the library's messages may name that a flag of generate's sets; any other is
   named alone (lg_setting_flag). */
static const lg_setting_flag_row setting_flags[] = {
    {"template", "--template"},       {"precision", "--precision"}, {"plan_only", "--plan"},
    {"memory_limit", "--memory-limit"}, {"temperature", "--temperature"}, {"seed", "--seed"},
    {NULL, NULL}};

/* Stops with the message, its settings spelled as generate's flags. */
static void die(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    lg_tool_vcomplain("generate", setting_flags, fmt, ap);
    va_end(ap);
    exit(code);
}

static const char *value_of(int argc, char **argv, int *i) {
    if (*i + 1 >= argc) die(2, "%s needs a value (see tools/generate --help)", argv[*i]);
    return argv[++*i];
}

static long integer_of(const char *flag, const char *text, long lo, long hi) {
    char *end;
    long v = strtol(text, &end, 10);
    if (!*text || *end) die(2, "%s: '%s' is not an integer", flag, text);
    if (v < lo || v > hi) die(2, "%s: %ld is outside %ld .. %ld", flag, v, lo, hi);
    return v;
}

static float number_of(const char *flag, const char *text, double lo, double hi) {
    char *end;
    double v = strtod(text, &end);
    if (!*text || *end) die(2, "%s: '%s' is not a number", flag, text);
    if (!(v >= lo && v <= hi)) die(2, "%s: %g is outside %g .. %g", flag, v, lo, hi);
    return (float)v;
}

static void parse_args(int argc, char **argv, generate_args *a) {
    memset(a, 0, sizeof *a);
    a->max_new = 50, a->top_k = 50, a->temperature = 0.8f, a->top_p = 1.0f, a->seed = 1234;
    a->precision = LG_PRECISION_32_TRUE;
    for (int i = 1; i < argc; i++) {
        const char *f = argv[i];
        if (!strcmp(f, "-h") || !strcmp(f, "--help")) { fputs(usage, stdout); exit(0); }
        else if (!strcmp(f, "--load")) a->load = value_of(argc, argv, &i);
        else if (!strcmp(f, "--tokenizer")) a->tokenizer = value_of(argc, argv, &i);
        else if (!strcmp(f, "--prompt")) a->prompt = value_of(argc, argv, &i);
        else if (!strcmp(f, "--prompt-ids")) a->prompt_ids = value_of(argc, argv, &i);
        else if (!strcmp(f, "--max-new-tokens")) a->max_new = (int)integer_of(f, value_of(argc, argv, &i), 0, 1 << 24);
        else if (!strcmp(f, "--temperature")) a->temperature = number_of(f, value_of(argc, argv, &i), 0, 1e6);
        else if (!strcmp(f, "--top-k")) a->top_k = (int)integer_of(f, value_of(argc, argv, &i), 0, 1 << 30);
        else if (!strcmp(f, "--top-p")) a->top_p = number_of(f, value_of(argc, argv, &i), 0, 1);
        else if (!strcmp(f, "--seed")) a->seed = (uint64_t)integer_of(f, value_of(argc, argv, &i), 0, 0x7FFFFFFFL);
        else if (!strcmp(f, "--ids")) a->ids = 1;
        else if (!strcmp(f, "--chat")) a->chat = 1;
        else if (!strcmp(f, "--template")) a->template_name = value_of(argc, argv, &i);
        else if (!strcmp(f, "--system")) a->system = value_of(argc, argv, &i);
        else if (!strcmp(f, "--context")) a->context = (int)integer_of(f, value_of(argc, argv, &i), 2, 1 << 24);
        else if (!strcmp(f, "--plan")) a->plan = 1;
        else if (!strcmp(f, "--threads")) a->threads = (int)integer_of(f, value_of(argc, argv, &i), 1, 4096);
        else if (!strcmp(f, "-p") || !strcmp(f, "--precision")) {
            const char *p = value_of(argc, argv, &i);
            if (lg_precision_parse(p, &a->precision) != 0)
                die(2, "%s: '%s' is not 32-true, bf16-true or 16-true", f, p);
        } else if (!strcmp(f, "--memory-limit")) {
            const char *m = value_of(argc, argv, &i);
            if (lg_parse_size(m, &a->memory_limit) != 0) die(2, "--memory-limit: '%s' is not a size (say 8GiB)", m);
        } else die(2, "unknown option %s (see tools/generate --help)", f);
    }
    if (!a->load) die(2, "--load DIR is needed (see tools/generate --help)");
    if (a->chat && (a->prompt || a->prompt_ids))
        die(2, "--chat reads its turns from standard input: drop --prompt/--prompt-ids");
    if (!a->chat && !a->prompt == !a->prompt_ids)
        die(2, "one of --prompt TEXT, --prompt-ids \"ID ...\" and --chat is needed");
    if (!a->chat && (a->template_name || a->system || a->context))
        die(2, "--template, --system and --context go with --chat");
    if (a->top_p <= 0.0f) die(2, "--top-p must be above 0");
    if (a->chat && a->max_new == 0) die(2, "--chat --max-new-tokens 0: a reply needs a token at least");
}

/* --prompt-ids "ID ...". */
static void parse_ids(const char *text, lg_tokens *out) {
    const char *p = text;
    while (*p) {
        char *end;
        while (*p == ' ' || *p == '\t' || *p == ',') p++;
        if (!*p) break;
        long id = strtol(p, &end, 10);
        if (end == p || id < 0 || id > 0x7FFFFFFFL)
            die(2, "--prompt-ids: '%.20s' is not a token id", p);
        if (lg_tokens_push(out, (int)id) != 0) die(1, "out of memory");
        p = end;
    }
}

static int has_file(const char *dir, const char *name) {
    char path[LG_PATH_MAX];
    struct stat st;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return stat(path, &st) == 0;
}

static int has_tokenizer(const char *dir) {
    return has_file(dir, "tokenizer.json") || (has_file(dir, "encoder.json") && has_file(dir, "vocab.bpe"));
}

/* --tokenizer, else the model directory's, else the adapters' base model's; 0 when none. */
static int load_tokenizer(const generate_args *a, const lg_gen_source *src, lg_tokenizer *tok,
                          char *dir, size_t cap) {
    lg_error err;
    const char *path = a->tokenizer ? a->tokenizer : has_tokenizer(src->dir) ? src->dir
                       : has_tokenizer(src->weights) ? src->weights : NULL;
    if (!path) return 0;
    if (lg_tokenizer_load(tok, path, &err) != 0) die(2, "--tokenizer: %s", err.msg);
    snprintf(dir, cap, "%s", path);
    return 1;
}

/* The JSON file DIR/NAME parsed (text kept in *text), or -1. */
static int read_json(const char *dir, const char *name, lg_json *doc, char **text) {
    char path[LG_PATH_MAX];
    size_t len;
    snprintf(path, sizeof path, "%s/%s", dir, name);
    *text = lg_read_file(path, &len, "config", NULL);
    if (!*text) return -1;
    if (lg_json_parse(doc, *text, len, path, NULL) == 0) return 0;
    free(*text);
    return -1;
}

/* eos_token_id's node `at` of DIR/NAME (doc) as a stop id, or exit 2 naming the file and the
   field when it is not an id of the model's vocabulary (vocab: padded_vocab_size). */
static int stop_id_of(const lg_json *doc, int at, const char *dir, const char *name, int vocab) {
    long id = -1;
    size_t quote = doc->nodes[at].kind == LG_JSON_STRING, start = doc->nodes[at].start - quote;
    if (lg_json_int(doc, at, &id) != 0 || id < 0 || id >= vocab)
        die(2, "%s/%s: eos_token_id %.*s is not a token id of the model (0 .. %d)", dir, name,
            (int)(doc->nodes[at].end + quote - start), doc->text + start, vocab - 1);
    return (int)id;
}

/* The stop ids: the tokenizer's end of sequence and eos_token_id (a number or a list) of the
   model's generation_config.json and config.json. */
static void stop_ids(const lg_gen_source *src, const lg_tokenizer *tok, lg_tokens *stop) {
    static const char *const files[2] = {"generation_config.json", "config.json"};
    int vocab = src->cfg.padded_vocab_size;
    if (tok && tok->eos >= 0) lg_tokens_push(stop, tok->eos);
    for (int f = 0; f < 2; f++) {
        lg_json doc;
        char *text;
        if (read_json(src->dir, files[f], &doc, &text) != 0) continue;
        int at = lg_json_find(&doc, 0, "eos_token_id");
        if (at >= 0 && doc.nodes[at].kind == LG_JSON_ARRAY) {
            for (int k = doc.nodes[at].first_child; k >= 0; k = doc.nodes[k].next)
                lg_tokens_push(stop, stop_id_of(&doc, k, src->dir, files[f], vocab));
        } else if (at >= 0 && doc.nodes[at].kind != LG_JSON_NULL) {
            lg_tokens_push(stop, stop_id_of(&doc, at, src->dir, files[f], vocab));
        }
        lg_json_free(&doc);
        free(text);
    }
}

/* Text as it comes: every token's bytes appended to what was shown (the prompt's first), so
   SentencePiece's spaces stay where they are. */
typedef struct {
    const lg_tokenizer *tok; /* NULL: nothing to print */
    lg_text shown;
    const lg_tokens *stop;   /* not printed */
} streamer;

static int stream_token(void *ctx, int token) {
    streamer *s = (streamer *)ctx;
    for (size_t i = 0; i < s->stop->n; i++)
        if (s->stop->ids[i] == token) return 0;
    if (!s->tok) return 0;
    size_t before = s->shown.n;
    lg_error err;
    if (lg_tokenizer_decode(s->tok, &token, 1, &s->shown, &err) != 0) die(1, "%s", err.msg);
    fwrite(s->shown.bytes + before, 1, s->shown.n - before, stdout);
    fflush(stdout);
    return 0;
}

/* The plan against the memory there is: exit 3 with what it needs when it does not fit. */
static void check_fit(const lg_plan *plan, const generate_args *a) {
    size_t need = lg_plan_bytes(plan, LG_POOL_DEVICE) + lg_plan_bytes(plan, LG_POOL_HOST);
    size_t limit = a->memory_limit ? a->memory_limit : lg_host_available_bytes();
    char n[32], l[32], w[32], c[32];
    fprintf(stderr, "plan: %s (%s of it the cache)\n", lg_format_bytes(need, n, sizeof n),
            lg_format_bytes(2 * lg_plan_find(&plan->ranks[0], "kv_cache.keys")->bytes, c, sizeof c));
    if (limit == 0 || need <= limit) return;
    fprintf(stderr, "generate: does not fit: the plan needs %s, %s %s; the weights are %s: "
            "-p bf16-true halves them and the cache, fewer --max-new-tokens or a shorter prompt "
            "shrink the cache\n", n, lg_format_bytes(limit, l, sizeof l),
            a->memory_limit ? "is --memory-limit" : "is available",
            lg_format_bytes(lg_plan_find(&plan->ranks[0], "weights")->bytes, w, sizeof w));
    exit(3);
}

static void print_speed(const lg_gen_stats *st) {
    fprintf(stderr, "\nprefill: %d tokens in %.1f ms, %.1f tokens/s; decode: %d tokens in %.1f ms, "
            "%.1f tokens/s%s\n", st->prompt_tokens, st->prefill_ms,
            st->prefill_ms > 0 ? 1000.0 * st->prompt_tokens / st->prefill_ms : 0.0,
            st->decode_tokens, st->decode_ms,
            st->decode_ms > 0 ? 1000.0 * st->decode_tokens / st->decode_ms : 0.0,
            st->stopped ? " (stopped at an end-of-sequence token)" : "");
}

/* The prompt's ids: --prompt-ids as given, or --prompt through the tokenizer; returns 1 when
   it put a BOS first. */
static int prompt_of(const generate_args *a, const lg_gen_source *src, const lg_tokenizer *tok,
                     lg_tokens *prompt) {
    lg_error err;
    int bos = 0;
    if (a->prompt_ids) parse_ids(a->prompt_ids, prompt);
    else if (!tok)
        die(2, "--prompt needs a tokenizer: %s has no tokenizer.json (nor encoder.json and "
               "vocab.bpe); name one with --tokenizer, or give --prompt-ids", src->dir);
    else {
        /* the id training samples start with (tools/prepare alpaca): a prompt is their prefix */
        if (lg_tokenizer_start_id(tok) >= 0) bos = lg_tokens_push(prompt, lg_tokenizer_start_id(tok)) == 0;
        if (lg_tokenizer_encode(tok, a->prompt, strlen(a->prompt), prompt, &err) != 0)
            die(2, "--prompt: %s", err.msg);
    }
    if (prompt->n == 0) die(2, "the prompt has no tokens");
    if ((long)prompt->n > src->cfg.block_size)
        die(2, "the prompt's %zu tokens are longer than the model's context (block_size %d)",
            prompt->n, src->cfg.block_size);
    for (size_t i = 0; i < prompt->n; i++)
        if (prompt->ids[i] >= src->cfg.padded_vocab_size)
            die(2, "the prompt's token %zu (id %d) is outside the model's vocabulary of %d", i,
                prompt->ids[i], src->cfg.padded_vocab_size);
    return bos;
}

/* Plans the generator for spec (--plan prints it and exits; exit 3 when it does not fit), then
   creates it and loads src's weights. */
static void open_generator(const generate_args *a, const lg_gen_source *src,
                           const lg_gen_spec *spec, lg_generator *g) {
    lg_error err;
    lg_plan plan;
    if (lg_gen_plan(&plan, &src->cfg, spec, &err) != 0) die(2, "%s", err.msg);
    if (a->plan) { lg_gen_plan_print(&plan, stdout); exit(0); }
    check_fit(&plan, a);
    lg_plan_free(&plan);
    if (lg_generator_create(g, &src->cfg, spec, &err) != 0) die(1, "%s", err.msg);
    if (lg_generator_load(g, src, &err) != 0) die(1, "%s", err.msg);
}

/* --- --chat: a conversation, its turns rendered with the model's template ---------------- */

/* Appends a turn of n bytes of text to c. */
static void chat_add(lg_chat *c, lg_chat_role role, const char *text, size_t n) {
    lg_chat_turn *turns = (lg_chat_turn *)realloc(c->turns, sizeof *turns * (size_t)(c->n + 1));
    char *copy = (char *)malloc(n + 1);
    if (!turns || !copy) die(1, "out of memory");
    if (n) memcpy(copy, text, n); /* an empty reply's text may be NULL */
    copy[n] = '\0';
    turns[c->n].role = role;
    turns[c->n].content = copy;
    c->turns = turns;
    c->n++;
}

/* The conversation rendered with template t, ending with the assistant's header, as ids. */
static void chat_prompt_ids(lg_chat_template t, const lg_chat *c, const lg_tokenizer *tok,
                            lg_tokens *ids) {
    lg_chat_rendered r;
    lg_error err;
    memset(&r, 0, sizeof r);
    ids->n = 0;
    if (lg_chat_render(t, c, tok, 1, &r, &err) != 0 ||
        lg_tokenizer_encode(tok, r.text.bytes, r.text.n, ids, &err) != 0)
        die(2, "--chat: %s", err.msg);
    lg_chat_rendered_free(&r);
}

/* Every id of the rendered conversation inside the model's vocabulary (a tokenizer larger than
   the model's embedding would read past it). */
static void chat_check_vocab(const lg_tokens *ids, int vocab) {
    for (size_t i = 0; i < ids->n; i++)
        if (ids->ids[i] < 0 || ids->ids[i] >= vocab)
            die(2, "--chat: the conversation's token %zu (id %d) is outside the model's "
                   "vocabulary of %d: is --tokenizer the model's?", i, ids->ids[i], vocab);
}

/* What --chat keeps between turns: the cache's tokens (the last reply's last token is not in
   it), the turns, the template and the sampling. */
typedef struct {
    lg_generator *g;
    lg_chat chat;
    lg_chat_template template_id;
    lg_tokens cached, prompt;
    lg_sampling sampling;
    lg_rng rng;
    int max_new, ids;
} chat_session;

/* One reply to the conversation so far: the cache keeps the longest prefix the new rendering
   shares with it, the rest is prefilled, the reply streams out and becomes a turn. */
static void chat_reply(chat_session *cs, streamer *out) {
    lg_error err;
    lg_gen_stats st;
    const lg_tokens *ids = &cs->prompt;
    size_t common = 0;
    while (common < cs->cached.n && common < ids->n && cs->cached.ids[common] == ids->ids[common])
        common++;
    if (common == ids->n) common--; /* one token at least: its logits draw the reply's first */
    lg_generator_truncate(cs->g, (int)common);
    long room = (long)cs->g->spec.positions - (long)ids->n;
    if (room < 1)
        die(2, "--chat: the conversation's %zu tokens fill the cache's %d positions (--context)",
            ids->n, cs->g->spec.positions);
    int max_new = room < cs->max_new ? (int)room : cs->max_new, n_out = 0;
    int *reply = (int *)malloc(sizeof(int) * (size_t)(max_new + 1));
    if (!reply) die(1, "out of memory");
    out->shown.n = 0;
    if (lg_generate_continue(cs->g, ids->ids + common, (int)(ids->n - common), max_new,
                             &cs->sampling, &cs->rng, reply, &n_out, stream_token, out, &st,
                             &err) != 0)
        die(1, "%s", err.msg);
    cs->cached.n = 0; /* the cache: the prompt, then the reply but its last token */
    for (size_t i = 0; i < ids->n; i++) lg_tokens_push(&cs->cached, ids->ids[i]);
    for (int i = 0; i + 1 < n_out; i++) lg_tokens_push(&cs->cached, reply[i]);
    chat_add(&cs->chat, LG_ROLE_ASSISTANT, out->shown.bytes, out->shown.n);
    printf("\n");
    if (cs->ids) {
        for (int i = 0; i < n_out; i++) printf("%s%d", i ? " " : "", reply[i]);
        printf("\n");
    }
    free(reply);
    fflush(stdout);
    print_speed(&st);
}

/* Line line_no of standard input, however long, into line (without its end of line); 0 at
   the end of the input. A NUL byte is refused: a turn is text. */
static int read_turn(lg_text *line, long line_no) {
    int c;
    line->n = 0;
    while ((c = getchar()) != EOF && c != '\n') {
        if (c == '\0')
            die(2, "--chat: standard input line %ld holds a NUL byte (after %zu bytes): a turn "
                   "is text", line_no, line->n);
        char byte = (char)c;
        if (lg_text_append(line, &byte, 1) != 0) die(1, "out of memory");
    }
    if (line->n > 0 && line->bytes[line->n - 1] == '\r') line->n--;
    return c != EOF || line->n > 0;
}

/* --chat: each line of standard input is a user turn; EOF ends. */
static void run_chat(const generate_args *a, const lg_gen_source *src, const lg_tokenizer *tok,
                     const lg_tokens *stop, int threads) {
    lg_error err;
    chat_session cs;
    memset(&cs, 0, sizeof cs);
    if (lg_chat_template_pick(a->template_name ? a->template_name : "auto", tok, &cs.template_id,
                              &err) != 0)
        die(2, "--chat: %s", err.msg);
    int positions = a->context ? a->context : src->cfg.block_size < 4096 ? src->cfg.block_size : 4096;
    if (positions > src->cfg.block_size)
        die(2, "--context %d: the model's context is %d tokens", positions, src->cfg.block_size);
    lg_gen_spec spec = {positions, positions < 512 ? positions : 512, a->precision, threads,
                        lg_gen_vocab(&src->cfg, tok)};
    lg_generator g;
    open_generator(a, src, &spec, &g);
    cs.g = &g;
    cs.max_new = a->max_new, cs.ids = a->ids;
    cs.sampling = lg_sampling_default();
    cs.sampling.temperature = a->temperature, cs.sampling.top_k = a->top_k, cs.sampling.top_p = a->top_p;
    cs.sampling.stop = stop->ids, cs.sampling.n_stop = (int)stop->n;
    lg_rng_seed(&cs.rng, a->seed);
    if (a->system) chat_add(&cs.chat, LG_ROLE_SYSTEM, a->system, strlen(a->system));
    fprintf(stderr, "chat: template %s, %d positions; a line is a turn, end with EOF\n",
            lg_chat_template_name(cs.template_id), positions);
    streamer out = {tok, {NULL, 0, 0}, stop};
    lg_text line = {NULL, 0, 0};
    for (long line_no = 1; read_turn(&line, line_no); line_no++) {
        if (line.n == 0) continue;
        chat_add(&cs.chat, LG_ROLE_USER, line.bytes, line.n);
        chat_prompt_ids(cs.template_id, &cs.chat, tok, &cs.prompt);
        chat_check_vocab(&cs.prompt, src->cfg.padded_vocab_size);
        chat_reply(&cs, &out);
    }
    lg_text_free(&line);
    lg_generator_free(&g);
}

int main(int argc, char **argv) {
    generate_args a;
    lg_error err;
    parse_args(argc, argv, &a);
    lg_gen_source src;
    if (lg_gen_source_find(&src, a.load, &err) != 0) die(2, "--load: %s", err.msg);
    lg_tokenizer tok;
    char tok_dir[LG_PATH_MAX] = "";
    int have_tok = load_tokenizer(&a, &src, &tok, tok_dir, sizeof tok_dir);
    lg_tokens prompt = {NULL, 0, 0}, stop = {NULL, 0, 0};
    int threads = a.threads;
#ifdef _OPENMP
    if (threads) omp_set_num_threads(threads);
    else threads = omp_get_max_threads();
#else
    threads = 1;
#endif
    stop_ids(&src, have_tok ? &tok : NULL, &stop);
    if (a.chat) {
        if (!have_tok)
            die(2, "--chat needs a tokenizer: %s has no tokenizer.json (nor encoder.json and "
                   "vocab.bpe); name one with --tokenizer", src.dir);
        run_chat(&a, &src, &tok, &stop, threads);
        return 0;
    }
    int bos = prompt_of(&a, &src, have_tok ? &tok : NULL, &prompt);
    int max_new = a.max_new;
    if ((long)prompt.n + max_new > src.cfg.block_size) {
        max_new = src.cfg.block_size - (int)prompt.n;
        fprintf(stderr, "generate: --max-new-tokens %d: the model's context is %d tokens, the "
                "prompt %zu: generating at most %d\n", a.max_new, src.cfg.block_size, prompt.n, max_new);
    }
    lg_gen_spec spec = {(int)prompt.n + max_new, (int)prompt.n, a.precision, threads,
                        lg_gen_vocab(&src.cfg, have_tok ? &tok : NULL)};
    lg_generator g;
    open_generator(&a, &src, &spec, &g);
    lg_sampling s = lg_sampling_default();
    s.temperature = a.temperature, s.top_k = a.top_k, s.top_p = a.top_p;
    s.stop = stop.ids, s.n_stop = (int)stop.n;
    streamer out = {have_tok ? &tok : NULL, {NULL, 0, 0}, &stop};
    if (have_tok && lg_tokenizer_decode(&tok, prompt.ids + bos, prompt.n - (size_t)bos, &out.shown,
                                        &err) != 0) /* as typed: without the BOS put first */
        die(2, "--prompt-ids: %s", err.msg);
    if (have_tok) fwrite(out.shown.bytes, 1, out.shown.n, stdout);
    int *ids = (int *)malloc(sizeof(int) * (size_t)(max_new + 1)), n_ids = 0;
    lg_rng rng;
    lg_rng_seed(&rng, a.seed);
    lg_gen_stats st;
    if (!ids || lg_generate(&g, prompt.ids, (int)prompt.n, max_new, &s, &rng, ids, &n_ids,
                            stream_token, &out, &st, &err) != 0)
        die(1, "%s", ids ? err.msg : "out of memory");
    if (have_tok) fputc('\n', stdout);
    if (a.ids || !have_tok) {
        for (int i = 0; i < n_ids; i++) printf("%s%d", i ? " " : "", ids[i]);
        printf("\n");
    }
    fflush(stdout);
    print_speed(&st);
    free(ids);
    lg_generator_free(&g);
    return 0;
}
