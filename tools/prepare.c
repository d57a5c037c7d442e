/* tools/prepare.c — data preparation: tokenizer checks, Alpaca-style fine-tuning sets, token
   shards for pretraining, and the built-in task written out as JSON.

   tools/prepare encode --tokenizer PATH [--lines] [--bos] < text   the ids of the whole input (--lines:
                                                            of each line, one output line each)
   tools/prepare decode --tokenizer PATH [--lines] < ids    the reverse
   tools/prepare alpaca --tokenizer PATH --out train.bin --val val.bin [--val-share 0.05]
                        [--mask-prompt] [--seed N] data.json|data.jsonl
   tools/prepare chat --tokenizer PATH [--template NAME|auto] --out train.bin [--val val.bin
                      --val-share 0.05] [--seed N] [--render] data.json|data.jsonl
   tools/prepare text --tokenizer PATH --out train.bin [--val val.bin --val-share 0.01] FILE...
   tools/prepare builtin [--samples N] [--seed N] > builtin.json

   PATH is a directory with GPT-2's encoder.json + vocab.bpe or a tokenizer.json, or a
   tokenizer.json itself. Exit codes: 0 done, 1 I/O or data error, 2 bad usage. */
#define LITGPT_IMPLEMENTATION
#include "../litgpt.h"

#include <stdarg.h>
#include <string.h>

static const char usage[] =
    "usage: tools/prepare COMMAND [options] [FILES]\n"
    "  encode --tokenizer PATH [--lines] [--bos]\n"
    "                                standard input: UTF-8 text, newlines included; prints its\n"
    "                                token ids on one line, space-separated (--lines: each\n"
    "                                input line alone, without its newline, one output line each;\n"
    "                                --bos: the BOS that alpaca's samples start with first)\n"
    "  decode --tokenizer PATH [--lines]\n"
    "                                standard input: token ids; prints their text as it is\n"
    "                                (--lines: each line of ids, then a newline)\n"
    "  alpaca --tokenizer PATH --out TRAIN [--val VAL] [--val-share X] [--mask-prompt]\n"
    "         [--seed N] FILE        Alpaca-style JSON or JSON lines (instruction, input,\n"
    "                                output) -> fine-tuning sample files for ./train --data;\n"
    "                                prints length statistics to choose -t from\n"
    "  chat --tokenizer PATH [--template NAME|auto] --out TRAIN [--val VAL] [--val-share X]\n"
    "       [--seed N] [--render] FILE\n"
    "                                conversations, JSON or JSON lines of {\"messages\": [{role,\n"
    "                                content}]} or ShareGPT {\"conversations\": [{from, value}]},\n"
    "                                rendered with a chat template (plain, alpaca, llama3,\n"
    "                                llama2, chatml, qwen3, falcon; auto: the tokenizer's), only\n"
    "                                the assistant turns trained; --render prints each\n"
    "                                conversation's text as a JSON string a line instead\n"
    "  text --tokenizer PATH --out TRAIN [--val VAL] [--val-share X] FILE...\n"
    "                                plain text, one document a line -> token shards\n"
    "  builtin [--samples N] [--seed N]\n"
    "                                the built-in task (sort the letters) as Alpaca JSON\n"
    "  PATH: a directory with encoder.json + vocab.bpe, or a tokenizer.json\n";

typedef struct {
    const char *command;
    const char *tokenizer; /* --tokenizer */
    const char *out;       /* --out: training file */
    const char *val;       /* --val: validation file */
    double val_share;      /* --val-share: share of samples (or documents) for validation */
    int mask_prompt;       /* --mask-prompt */
    int lines;             /* --lines: encode and decode one line at a time */
    int bos;               /* encode --bos: the id training samples start with first
                              (lg_tokenizer_start_id), so a prompt is their prefix */
    const char *chat_template; /* --template: a name or auto */
    int render;            /* --render: print the rendered conversations */
    uint64_t seed;         /* --seed: the split, and the built-in task's samples */
    long samples;          /* --samples: built-in task */
    char **files;          /* the remaining arguments */
    int n_files;
} prepare_args;

/* The one setting the library's messages name that a flag of prepare's sets: the chat
   template; any other is named alone (lg_setting_flag). */
static const lg_setting_flag_row setting_flags[] = {{"template", "--template"}, {NULL, NULL}};

/* Stops with the message, its settings spelled as prepare's flags. */
static void die(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    lg_tool_vcomplain("prepare", setting_flags, fmt, ap);
    va_end(ap);
    exit(code);
}

static const char *value_of(int argc, char **argv, int *i) {
    if (*i + 1 >= argc) die(2, "%s needs a value (see tools/prepare --help)", argv[*i]);
    return argv[++*i];
}

static void parse_args(int argc, char **argv, prepare_args *a) {
    memset(a, 0, sizeof *a);
    a->val_share = -1;
    a->seed = 1337;
    a->samples = 1000;
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        fputs(usage, argc < 2 ? stderr : stdout);
        exit(argc < 2 ? 2 : 0);
    }
    a->command = argv[1];
    a->files = (char **)malloc(sizeof(char *) * (size_t)argc);
    for (int i = 2; i < argc; i++) {
        const char *f = argv[i];
        if (!strcmp(f, "--tokenizer")) a->tokenizer = value_of(argc, argv, &i);
        else if (!strcmp(f, "--out")) a->out = value_of(argc, argv, &i);
        else if (!strcmp(f, "--val")) a->val = value_of(argc, argv, &i);
        else if (!strcmp(f, "--val-share")) a->val_share = atof(value_of(argc, argv, &i));
        else if (!strcmp(f, "--mask-prompt")) a->mask_prompt = 1;
        else if (!strcmp(f, "--lines")) a->lines = 1;
        else if (!strcmp(f, "--bos")) a->bos = 1;
        else if (!strcmp(f, "--template")) a->chat_template = value_of(argc, argv, &i);
        else if (!strcmp(f, "--render")) a->render = 1;
        else if (!strcmp(f, "--seed")) a->seed = strtoull(value_of(argc, argv, &i), NULL, 10);
        else if (!strcmp(f, "--samples")) a->samples = atol(value_of(argc, argv, &i));
        else if (f[0] == '-' && f[1]) die(2, "unknown option %s (see tools/prepare --help)", f);
        else a->files[a->n_files++] = argv[i];
    }
    if (a->val_share > 1) die(2, "--val-share %g: a share between 0 and 1", a->val_share);
}

static void load_tokenizer(const prepare_args *a, lg_tokenizer *tok) {
    if (!a->tokenizer) die(2, "%s needs --tokenizer PATH", a->command);
    lg_error err;
    if (lg_tokenizer_load(tok, a->tokenizer, &err) != 0) die(1, "%s", err.msg);
}

/* Reads one line of standard input (without its newline) into line; 0 at the end. */
static int read_line(lg_text *line) {
    line->n = 0;
    lg_text_append(line, "", 0);
    int c, any = 0;
    char buf[4096];
    size_t n = 0;
    while ((c = getchar()) != EOF) {
        any = 1;
        if (c == '\n') break;
        buf[n++] = (char)c;
        if (n == sizeof buf) { lg_text_append(line, buf, n); n = 0; }
    }
    lg_text_append(line, buf, n);
    return any;
}

/* Reads the whole of standard input into text; 0 when it is empty. */
static int read_all(lg_text *text) {
    char buf[4096];
    size_t n;
    text->n = 0;
    lg_text_append(text, "", 0);
    while ((n = fread(buf, 1, sizeof buf, stdin)) > 0) lg_text_append(text, buf, n);
    return text->n > 0;
}

/* The whole input is one text (newlines are tokens too, as in an Alpaca prompt); --lines:
   each line alone. */
static int command_encode(const prepare_args *a) {
    lg_tokenizer tok;
    load_tokenizer(a, &tok);
    lg_text line = {NULL, 0, 0};
    lg_tokens ids = {NULL, 0, 0};
    lg_error err;
    int whole = !a->lines, more = whole ? (read_all(&line), 1) : read_line(&line);
    for (; more; more = whole ? 0 : read_line(&line)) {
        ids.n = 0;
        if (a->bos && lg_tokenizer_start_id(&tok) >= 0) lg_tokens_push(&ids, lg_tokenizer_start_id(&tok));
        if (lg_tokenizer_encode(&tok, line.bytes, line.n, &ids, &err) != 0) die(1, "%s", err.msg);
        for (size_t i = 0; i < ids.n; i++) printf(i ? " %d" : "%d", ids.ids[i]);
        putchar('\n');
    }
    lg_text_free(&line);
    lg_tokens_free(&ids);
    lg_tokenizer_free(&tok);
    return 0;
}

/* The ids of one line of standard input, added to ids; exits naming the line on a bad one. */
static void parse_ids(const char *line, long line_no, lg_tokens *ids) {
    for (const char *at = line; *at;) {
        char *end;
        while (*at == ' ' || *at == ',' || *at == '\t' || *at == '\r') at++;
        if (!*at) break;
        long id = strtol(at, &end, 10);
        if (end == at) die(1, "standard input line %ld: '%s' is not a token id", line_no, at);
        lg_tokens_push(ids, (int)id);
        at = end;
    }
}

/* Writes the text of ids; line_no names the input line in an error (0: the whole input). */
static void write_text(const lg_tokenizer *tok, const lg_tokens *ids, long line_no, lg_text *text) {
    lg_error err;
    text->n = 0;
    if (lg_tokenizer_decode(tok, ids->ids, ids->n, text, &err) != 0) {
        if (line_no > 0) die(1, "standard input line %ld: %s", line_no, err.msg);
        die(1, "standard input: %s", err.msg);
    }
    fwrite(text->bytes, 1, text->n, stdout);
}

/* The text of every id of the input, as it is (encode's reverse); --lines: each line's text,
   then a newline. */
static int command_decode(const prepare_args *a) {
    lg_tokenizer tok;
    load_tokenizer(a, &tok);
    lg_text line = {NULL, 0, 0}, text = {NULL, 0, 0};
    lg_tokens ids = {NULL, 0, 0};
    for (long line_no = 1; read_line(&line); line_no++) {
        parse_ids(line.bytes, line_no, &ids);
        if (!a->lines) continue;
        write_text(&tok, &ids, line_no, &text);
        putchar('\n');
        ids.n = 0;
    }
    if (!a->lines) write_text(&tok, &ids, 0, &text);
    lg_text_free(&line);
    lg_text_free(&text);
    lg_tokens_free(&ids);
    lg_tokenizer_free(&tok);
    return 0;
}

/* --- statistics ---------------------------------------------------------------------------- */

static int compare_u32(const void *x, const void *y) {
    uint32_t a = *(const uint32_t *)x, b = *(const uint32_t *)y;
    return a < b ? -1 : a > b;
}

/* What a user chooses -t from: count, median, percentiles, longest, a histogram, and the share
   of samples each candidate -t would truncate. */
static void print_length_stats(const uint32_t *lengths, size_t n) {
    uint32_t *sorted = (uint32_t *)malloc(sizeof(uint32_t) * n);
    memcpy(sorted, lengths, sizeof(uint32_t) * n);
    qsort(sorted, n, sizeof(uint32_t), compare_u32);
    printf("sample lengths (tokens): %zu samples | median %u | 90th percentile %u | 99th "
           "percentile %u | longest %u\n", n, sorted[n / 2], sorted[(n * 9) / 10],
           sorted[(n * 99) / 100], sorted[n - 1]);
    size_t bins[32] = {0}, most = 1;
    int top = 0;
    for (size_t i = 0; i < n; i++) {
        int bin = 0;
        while ((1u << (bin + 4)) < sorted[i]) bin++; /* (16 << (bin-1), 16 << bin] */
        bins[bin]++;
        top = bin > top ? bin : top;
    }
    for (int b = 0; b <= top; b++) most = bins[b] > most ? bins[b] : most;
    for (int b = 0; b <= top; b++)
        printf("  <= %6u tokens %7zu  %.*s\n", 16u << b, bins[b], (int)(50 * bins[b] / most),
               "##################################################");
    printf("-t that truncates:");
    for (uint32_t t = 64; t < sorted[n - 1] * 2 && t <= 65536; t *= 2) {
        size_t over = 0;
        for (size_t i = 0; i < n; i++) over += sorted[i] > t;
        printf(" | -t %u: %.1f%%", t, 100.0 * over / n);
    }
    printf("\n");
    free(sorted);
}

/* --- Alpaca ------------------------------------------------------------------------------- */

typedef struct {
    lg_tokens tokens;       /* all samples, one after another */
    uint32_t *lengths;      /* (n) */
    uint32_t *prompts;      /* (n) */
    size_t n;
} sample_set;

/* BOS (when the tokenizer has one apart from EOS), the prompt, the response, EOS. */
/* The training and validation sets, empty, with room for the lengths and prompt lengths of n
   samples each. */
static void sample_sets_start(sample_set sets[2], size_t n) {
    for (int s = 0; s < 2; s++) {
        memset(&sets[s], 0, sizeof sets[s]);
        sets[s].lengths = (uint32_t *)malloc(sizeof(uint32_t) * n);
        sets[s].prompts = (uint32_t *)malloc(sizeof(uint32_t) * n);
    }
}

static void tokenize_sample(const lg_tokenizer *tok, const lg_alpaca_sample *s, sample_set *set,
                            const char *where) {
    lg_text prompt = {NULL, 0, 0};
    lg_error err;
    size_t start = set->tokens.n;
    if (lg_tokenizer_start_id(tok) >= 0) lg_tokens_push(&set->tokens, lg_tokenizer_start_id(tok));
    if (lg_alpaca_prompt(s, &prompt) != 0 ||
        lg_tokenizer_encode(tok, prompt.bytes, prompt.n, &set->tokens, &err) != 0)
        die(1, "%s: %s", where, err.msg);
    size_t prompt_tokens = set->tokens.n - start;
    if (lg_tokenizer_encode(tok, s->output, strlen(s->output), &set->tokens, &err) != 0)
        die(1, "%s: %s", where, err.msg);
    if (tok->eos >= 0) lg_tokens_push(&set->tokens, tok->eos);
    set->lengths[set->n] = (uint32_t)(set->tokens.n - start);
    set->prompts[set->n++] = (uint32_t)prompt_tokens;
    lg_text_free(&prompt);
}

/* The samples or shard at path, made by tok: which tokenizer made it goes in its header. */
static void record_tokenizer(const char *path, const lg_tokenizer *tok) {
    lg_error err;
    if (lg_data_record_tokenizer(path, tok->files_hash, &err) != 0) die(1, "%s", err.msg);
}

static void write_samples(const char *path, const sample_set *set, const lg_tokenizer *tok, int mask) {
    int vocab_size = tok->vocab_size;
    lg_error err;
    uint32_t *tokens = (uint32_t *)malloc(sizeof(uint32_t) * (set->tokens.n + 1));
    for (size_t i = 0; i < set->tokens.n; i++) tokens[i] = (uint32_t)set->tokens.ids[i];
    if (lg_samples_write(path, tokens, set->lengths, set->prompts, set->n,
                         vocab_size > 65535 ? 4 : 2, mask, &err) != 0)
        die(1, "%s", err.msg);
    record_tokenizer(path, tok);
    printf("wrote %s: %zu samples, %zu tokens\n", path, set->n, set->tokens.n);
    free(tokens);
}

/* A shuffled order of n items; the first n_val go to validation. */
static size_t *split_order(size_t n, uint64_t seed) {
    size_t *order = (size_t *)malloc(sizeof(size_t) * n);
    lg_rng rng;
    lg_rng_seed(&rng, seed);
    for (size_t i = 0; i < n; i++) order[i] = i;
    for (size_t i = n; i > 1; i--) {
        size_t j = (size_t)(lg_rng_u64(&rng) % i), t = order[i - 1];
        order[i - 1] = order[j];
        order[j] = t;
    }
    return order;
}

static size_t validation_count(const prepare_args *a, size_t n, double default_share) {
    if (!a->val) return 0;
    double share = a->val_share >= 0 ? a->val_share : default_share;
    size_t n_val = (size_t)(share * n + 0.5);
    if (n_val == 0 && share > 0) n_val = 1;
    if (n_val >= n) die(2, "--val-share %g leaves no training samples of %zu", share, n);
    return n_val;
}

static int command_alpaca(const prepare_args *a) {
    if (a->n_files != 1 || !a->out) die(2, "alpaca needs --out TRAIN and one FILE (see --help)");
    lg_tokenizer tok;
    load_tokenizer(a, &tok);
    lg_alpaca data;
    lg_error err;
    if (lg_alpaca_read(&data, a->files[0], &err) != 0) die(1, "%s", err.msg);
    size_t n_val = validation_count(a, data.n, 0.05);
    size_t *order = split_order(data.n, a->seed);
    sample_set sets[2]; /* [0] training, [1] validation */
    sample_sets_start(sets, data.n);
    uint32_t *all_lengths = (uint32_t *)malloc(sizeof(uint32_t) * data.n);
    for (size_t k = 0; k < data.n; k++) {
        char where[600];
        snprintf(where, sizeof where, "%s sample %zu", a->files[0], order[k]);
        sample_set *set = &sets[k < n_val];
        tokenize_sample(&tok, &data.samples[order[k]], set, where);
        all_lengths[k] = set->lengths[set->n - 1];
    }
    print_length_stats(all_lengths, data.n);
    write_samples(a->out, &sets[0], &tok, a->mask_prompt);
    if (n_val) write_samples(a->val, &sets[1], &tok, a->mask_prompt);
    for (int s = 0; s < 2; s++) {
        lg_tokens_free(&sets[s].tokens);
        free(sets[s].lengths);
        free(sets[s].prompts);
    }
    free(all_lengths);
    free(order);
    lg_alpaca_free(&data);
    lg_tokenizer_free(&tok);
    return 0;
}

/* --- chat conversations ------------------------------------------------------------------ */

/* text as one JSON string: quotes, backslashes and control characters escaped. */
static void print_json_string(const char *text, size_t n) {
    putchar('"');
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)text[i];
        if (c == '"' || c == '\\') printf("\\%c", c);
        else if (c == '\n') fputs("\\n", stdout);
        else if (c < 0x20) printf("\\u%04x", c);
        else putchar(c);
    }
    puts("\"");
}

static lg_chat_template pick_template(const prepare_args *a, const lg_tokenizer *tok) {
    lg_chat_template t;
    lg_error err;
    const char *name = a->chat_template ? a->chat_template : "auto";
    if (lg_chat_template_pick(name, tok, &t, &err) != 0) die(2, "%s", err.msg);
    return t;
}

/* One conversation into set: its ids, the trained ones with LG_SAMPLES_TRAINED_BIT set. */
static void tokenize_chat(const lg_tokenizer *tok, const lg_chat_rendered *r, sample_set *set,
                          lg_tokens *trained, const char *where) {
    lg_error err;
    size_t start = set->tokens.n;
    trained->n = 0;
    if (lg_chat_tokenize(tok, r, &set->tokens, trained, where, &err) != 0) die(1, "%s", err.msg);
    for (size_t i = 0; i < trained->n; i++)
        if (trained->ids[i]) set->tokens.ids[start + i] |= (int)(1u << LG_SAMPLES_TRAINED_BIT);
    set->lengths[set->n] = (uint32_t)(set->tokens.n - start);
    set->prompts[set->n++] = 0;
}

static void write_chat_samples(const char *path, const sample_set *set, const lg_tokenizer *tok) {
    lg_error err;
    uint32_t *tokens = (uint32_t *)malloc(sizeof(uint32_t) * (set->tokens.n + 1));
    for (size_t i = 0; i < set->tokens.n; i++) tokens[i] = (uint32_t)set->tokens.ids[i];
    if (lg_samples_write(path, tokens, set->lengths, set->prompts, set->n, 4,
                         LG_SAMPLES_MASK_TOKENS, &err) != 0)
        die(1, "%s", err.msg);
    record_tokenizer(path, tok);
    printf("wrote %s: %zu conversations, %zu tokens\n", path, set->n, set->tokens.n);
    free(tokens);
}

static int command_chat(const prepare_args *a) {
    if (a->n_files != 1 || (!a->out && !a->render))
        die(2, "chat needs --out TRAIN (or --render) and one FILE (see --help)");
    lg_tokenizer tok;
    load_tokenizer(a, &tok);
    lg_chat_template t = pick_template(a, &tok);
    lg_chat_set data;
    lg_error err;
    if (lg_chat_read(&data, a->files[0], &err) != 0) die(1, "%s", err.msg);
    size_t n_val = a->render ? 0 : validation_count(a, data.n, 0.05);
    size_t *order = split_order(data.n, a->seed);
    sample_set sets[2]; /* [0] training, [1] validation */
    sample_sets_start(sets, data.n);
    uint32_t *all_lengths = (uint32_t *)malloc(sizeof(uint32_t) * data.n);
    lg_chat_rendered r;
    lg_tokens trained = {NULL, 0, 0};
    memset(&r, 0, sizeof r);
    for (size_t k = 0; k < data.n; k++) {
        size_t i = a->render ? k : order[k]; /* --render: in the file's order */
        char where[600];
        snprintf(where, sizeof where, "%s record %zu", a->files[0], i);
        if (lg_chat_render(t, &data.chats[i], &tok, 0, &r, &err) != 0)
            die(1, "%s %s: %s", where, lg_chat_template_name(t), err.msg);
        if (a->render) { print_json_string(r.text.bytes, r.text.n); continue; }
        sample_set *set = &sets[k < n_val];
        tokenize_chat(&tok, &r, set, &trained, where);
        all_lengths[k] = set->lengths[set->n - 1];
    }
    if (!a->render) {
        printf("template %s\n", lg_chat_template_name(t));
        print_length_stats(all_lengths, data.n);
        write_chat_samples(a->out, &sets[0], &tok);
        if (n_val) write_chat_samples(a->val, &sets[1], &tok);
    }
    for (int s = 0; s < 2; s++) {
        lg_tokens_free(&sets[s].tokens);
        free(sets[s].lengths);
        free(sets[s].prompts);
    }
    lg_chat_rendered_free(&r);
    lg_tokens_free(&trained);
    free(all_lengths);
    free(order);
    lg_chat_free(&data);
    lg_tokenizer_free(&tok);
    return 0;
}

/* --- plain text -> token shards ---------------------------------------------------------- */

/* Every non-empty line of every file is a document; EOS follows each one. Every
   1/val_share-th document goes to validation. */
static int command_text(const prepare_args *a) {
    if (a->n_files < 1 || !a->out) die(2, "text needs --out TRAIN and at least one FILE");
    lg_tokenizer tok;
    load_tokenizer(a, &tok);
    double share = a->val ? (a->val_share >= 0 ? a->val_share : 0.01) : 0;
    long every = share > 0 ? (long)(1.0 / share + 0.5) : 0;
    lg_tokens sets[2] = {{NULL, 0, 0}, {NULL, 0, 0}};
    lg_error err;
    long documents = 0;
    for (int f = 0; f < a->n_files; f++) {
        size_t len;
        char *text = lg_read_file(a->files[f], &len, "text", &err);
        if (!text) die(1, "%s", err.msg);
        for (size_t at = 0; at < len;) {
            const char *end = (const char *)memchr(text + at, '\n', len - at);
            size_t n = end ? (size_t)(end - (text + at)) : len - at;
            if (n > 0) {
                lg_tokens *set = &sets[every && documents % every == every - 1];
                if (lg_tokenizer_encode(&tok, text + at, n, set, &err) != 0) die(1, "%s", err.msg);
                if (tok.eos >= 0) lg_tokens_push(set, tok.eos);
                documents++;
            }
            at += n + 1;
        }
        free(text);
    }
    int token_bytes = tok.vocab_size > 65535 ? 4 : 2;
    const char *paths[2] = {a->out, a->val};
    for (int s = 0; s < 2 && paths[s]; s++) {
        uint32_t *tokens = (uint32_t *)malloc(sizeof(uint32_t) * (sets[s].n + 1));
        for (size_t i = 0; i < sets[s].n; i++) tokens[i] = (uint32_t)sets[s].ids[i];
        if (lg_shard_write(paths[s], tokens, sets[s].n, token_bytes, &err) != 0) die(1, "%s", err.msg);
        record_tokenizer(paths[s], &tok);
        printf("wrote %s: %zu tokens (uint%d)\n", paths[s], sets[s].n, token_bytes * 8);
        free(tokens);
        lg_tokens_free(&sets[s]);
    }
    printf("%ld documents\n", documents);
    lg_tokenizer_free(&tok);
    return 0;
}

/* --- the built-in task as JSON --------------------------------------------------------------- */

static int command_builtin(const prepare_args *a) {
    lg_rng rng;
    lg_rng_seed(&rng, a->seed);
    printf("[\n");
    for (long i = 0; i < a->samples; i++) {
        char letters[LG_BUILTIN_MAX_LETTERS + 1], sorted[LG_BUILTIN_MAX_LETTERS + 1];
        lg_builtin_task_text(&rng, letters, sorted);
        printf("  {\"instruction\": \"Sort the letters.\", \"input\": \"%s\", \"output\": "
               "\"%s\"}%s\n", letters, sorted, i + 1 < a->samples ? "," : "");
    }
    printf("]\n");
    return 0;
}

int main(int argc, char **argv) {
    prepare_args a;
    parse_args(argc, argv, &a);
    int rc;
    if (!strcmp(a.command, "encode")) rc = command_encode(&a);
    else if (!strcmp(a.command, "decode")) rc = command_decode(&a);
    else if (!strcmp(a.command, "alpaca")) rc = command_alpaca(&a);
    else if (!strcmp(a.command, "text")) rc = command_text(&a);
    else if (!strcmp(a.command, "chat")) rc = command_chat(&a);
    else if (!strcmp(a.command, "builtin")) rc = command_builtin(&a);
    else die(2, "unknown command %s (see tools/prepare --help)", a.command);
    free(a.files);
    return rc;
}
