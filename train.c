/* train.c — the reference driver: command line -> args -> model and data -> train loop -> files.

   make && ./train                    the built-in task (sort letters) on a small built-in model
   ./train -c pythia-14m --data train.bin --val-data val.bin -b 4 -g 32 -t 256
   ./train --help

   Exit codes: 0 done, 1 the run failed (non-finite gradient, I/O), 2 bad flag, value or file. */
#define _POSIX_C_SOURCE 200809L /* getaddrinfo: the TCP rendezvous of processes */
#define LITGPT_IMPLEMENTATION
#include "litgpt.h"

#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* --- stopping: every exit of train goes through stop() ---------------------------------------- */

/* An error line, in one write; under a launcher it starts with the process's rank (the
   launcher's). */
static void print_error_line(const char *message, const char *tail) {
    lg_launch launch;
    lg_error err;
    char rank[32] = "";
    if (lg_launch_from_env(&launch, &err) == 0 && launch.processes > 1)
        snprintf(rank, sizeof rank, "rank %d: ", launch.process);
    fprintf(stderr, "%strain: %s%s\n", rank, message, tail);
}

/* The one way train stops before the end of main. 0 (--help, --plan, --gpu list): every
   process has the same flags and stops alike, MPI finalized first. Any other code: `message`
   and `tail` as an error line when there is a message, and under MPI the other processes
   stop too (MPI_Abort). Codes: 1 the run failed, 2 a bad flag, value or file, 3 no fit. */
static void stop(int code, const char *message, const char *tail) {
    if (message) print_error_line(message, tail);
    if (code == 0) lg_launch_exit(0);
    lg_launch_abort(code);
}

/* A bad flag, value or file: exit 2, pointing at the usage text. */
static void die_usage(const char *fmt, ...) {
    char message[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    stop(2, message, " (see ./train --help)");
}

/* A write to an output that failed (disk full, file removed, read-only): the run stops with
   the file named, exit 1; checkpoints already complete stay as they are. */
static void die_write(const char *path) {
    char message[1200];
    snprintf(message, sizeof message, "%s: cannot write: %s", path,
             errno ? strerror(errno) : "write failed");
    stop(1, message, "");
}

/* Host memory for `what` that malloc did not give: exit 1. */
static void die_out_of_memory(const char *what) {
    char message[256];
    snprintf(message, sizeof message, "out of host memory for %s", what);
    stop(1, message, "");
}

/* An output file (--plot's picture, a file in --out) can be created where it goes: found at
   start, not after the run. Creates path.tmp and removes it. */
static void probe_writable(const char *flag, const char *path) {
    char tmp[LG_PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f || fclose(f) != 0) die_usage("%s %s: cannot create files there: %s", flag, path,
                                        strerror(errno));
    remove(tmp);
}

static int parse_int(const char *flag, const char *text) {
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (*text == '\0' || *end != '\0' || errno || v < INT_MIN || v > INT_MAX)
        die_usage("%s: '%s' is not an integer", flag, text);
    return (int)v;
}

/* A size with its unit, more than 0 bytes. */
static size_t parse_size(const char *flag, const char *text) {
    size_t bytes;
    if (lg_parse_size(text, &bytes) != 0 || bytes == 0)
        die_usage("%s: '%s' is not a size with a unit (e.g. 24GiB, 512MiB, 8GB, 100B)", flag,
                  text);
    return bytes;
}

/* --memory-margin: a size, 0B (or 0) allowed. */
static size_t parse_margin(const char *flag, const char *text) {
    size_t bytes;
    if (lg_parse_size(text, &bytes) != 0)
        die_usage("%s: '%s' is not a size with a unit (e.g. 512MiB, 1GiB, 0B)", flag, text);
    return bytes;
}

/* --gpu list: the cards, their memory and compute capability (flag: the column of names). */
static void print_gpu_cards(const char *flag) {
    printf("%-10s %-10s %12s  %s\n", flag, "card", "memory", "compute capability");
    for (int i = 0; i < lg_gpu_card_count(); i++) {
        const lg_gpu_card *g = lg_gpu_card_at(i);
        char mib[32];
        snprintf(mib, sizeof mib, "%zu MiB", g->total_mib);
        printf("%-10s %-10s %12s  %d.%d%s%s\n", g->name, g->label, mib, g->major, g->minor,
               g->nominal ? " (memory: not a reading of this card)" : "",
               lg_gpu_card_supported(g) ? "" : " (refused: the kernels need 8.0)");
    }
}

/* --gpu NAME: the card (list: print them and exit). */
static const lg_gpu_card *parse_gpu(const char *flag, const char *name) {
    if (strcmp(name, "list") == 0) {
        print_gpu_cards(flag);
        stop(0, NULL, NULL);
    }
    const lg_gpu_card *card = lg_gpu_card_named(name);
    if (!card) die_usage("%s: '%s' is not a card this planner knows (%s list)", flag, name, flag);
    if (!lg_gpu_card_supported(card))
        die_usage("%s %s: the %s has compute capability %d.%d, and the CUDA kernels need 8.0 "
                  "or newer (bf16 tensor cores)", flag, name, card->label, card->major,
                  card->minor);
    return card;
}

static float parse_float(const char *flag, const char *text) {
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (*text == '\0' || *end != '\0' || errno || !isfinite(v))
        die_usage("%s: '%s' is not a number", flag, text);
    return (float)v;
}

/* --- checkpoints: the flags that read and write them ------------------------------------- */
typedef struct {
    const char *load;     /* --load: a Hugging Face directory to start from */
    const char *resume;   /* --resume: a checkpoint, or a --out directory (its latest) */
    char resume_dir[LG_PATH_MAX]; /* the step-N directory --resume resolved to */
    int data_changed;     /* --data-changed: resume onto training data other than the run's */
    int any_tokenizer_data; /* --any-tokenizer-data: data made with another tokenizer than
                               --load's is used on purpose */
} checkpoint_flags;

/* The flags whose default depends on others: given on the command line or not; and the sizes
   the driver chooses before it plans (the library sees the numbers chosen). */
typedef struct {
    int precision, beta1, beta2, min_lr, lr, config;
    int micro_batch_auto;    /* -b auto: the largest micro-batch that fits */
    int max_seq_length_auto; /* -t auto: the longest sequence that fits (up to block_size, or
                                for fine-tuning the longest sample) */
} given_flags;

/* --- progress: what the driver prints while it trains ------------------------------------- */
typedef struct {
    int log_interval; /* --log-interval: steps between full lines; 0: about 20 a run */
    const char *plot; /* --plot: the loss curve's SVG file */
    const char *log_path; /* --log: one JSON object per step and per evaluation */
} output_flags;

/* --- the driver's options: what it opens, when it evaluates, samples and saves ----------- */
/* Settings the library never reads; LG_RUN_SETTINGS records them for a resumed run, each in
   the line option_fields names (lg_args.driver_value writes it, but out_dir's is the library's:
   where lg_checkpoint_save writes; lg_run_settings_driver reads it back). */
typedef struct {
    const char *config;   /* -c: configs/NAME.yaml or a path, or the directory --load or
                             --resume reads (load_config); NULL: the built-in model */
    const char *data;     /* --data: training token shard or samples; NULL: the built-in task */
    const char *val_data; /* --val-data: validation token shard or samples */
    const char *prompt;   /* --prompt: what samples start from; NULL: a few of the task's */
    const char *out_dir;  /* --out: where checkpoints go; NULL: none saved */
    int eval_every;    /* --eval-every: steps between evaluations; 0: at the end only */
    int eval_iters;    /* --eval-iters: validation micro-batches at most; each window once */
    int sample_every;  /* --sample-every: steps between samples; 0: at the end only */
    int sample_tokens; /* --sample-tokens: tokens a sample generates */
    float temperature; /* --temperature: the samples'; 0: greedy */
    int save_every;    /* --save-every: steps between checkpoints; 0: only at the end */
    size_t memory_limit; /* --memory-limit: bytes a device may use (device_limit); 0: no limit */
} run_options;

/* What an option is: an int, a float (written as the library writes its floats: exact to the
   bit), a size (bytes) or text (a line's text, "" for none). */
typedef enum { OPTION_INT, OPTION_FLOAT, OPTION_SIZE, OPTION_TEXT } option_kind;

/* The options' lines: key (the setting's name), place, kind and range (a float: at least lo). */
static const struct {
    const char *key;
    size_t offset;
    option_kind kind;
    double lo, hi;
} option_fields[] = {
    {"config", offsetof(run_options, config), OPTION_TEXT, 0, 0},
    {"data", offsetof(run_options, data), OPTION_TEXT, 0, 0},
    {"val_data", offsetof(run_options, val_data), OPTION_TEXT, 0, 0},
    {"prompt", offsetof(run_options, prompt), OPTION_TEXT, 0, 0},
    {"out_dir", offsetof(run_options, out_dir), OPTION_TEXT, 0, 0},
    {"eval_every", offsetof(run_options, eval_every), OPTION_INT, 0, INT_MAX},
    {"eval_iters", offsetof(run_options, eval_iters), OPTION_INT, 1, INT_MAX},
    {"sample_every", offsetof(run_options, sample_every), OPTION_INT, 0, INT_MAX},
    {"sample_tokens", offsetof(run_options, sample_tokens), OPTION_INT, 1, 1000000},
    {"temperature", offsetof(run_options, temperature), OPTION_FLOAT, 0, 0},
    {"save_every", offsetof(run_options, save_every), OPTION_INT, 0, INT_MAX},
    {"memory_limit", offsetof(run_options, memory_limit), OPTION_SIZE, 0, 0},
};
enum { OPTION_COUNT = sizeof option_fields / sizeof option_fields[0] };
LG_STATIC_ASSERT(OPTION_COUNT == LG_RUN_DRIVER_FIELDS, "LG_RUN_SETTINGS keeps a line for each option");

static void options_default(run_options *o) {
    memset(o, 0, sizeof *o);
    o->eval_every = 200;
    o->eval_iters = 10;
    o->sample_tokens = 16;
}

/* Option i of o as a number (an int or a float). */
static double option_number(const run_options *o, int i) {
    const unsigned char *at = (const unsigned char *)o + option_fields[i].offset;
    float v_float;
    int v_int;
    if (option_fields[i].kind == OPTION_FLOAT) {
        memcpy(&v_float, at, sizeof v_float);
        return v_float;
    }
    memcpy(&v_int, at, sizeof v_int);
    return v_int;
}

/* Option i of o from text (its line's value, kept: a text option points into it; "": none);
   -1 when it is not a number of its kind. */
static int option_parse(run_options *o, int i, const char *text) {
    unsigned char *at = (unsigned char *)o + option_fields[i].offset;
    char *end;
    errno = 0;
    if (option_fields[i].kind == OPTION_TEXT) {
        const char *v_text = *text ? text : NULL;
        memcpy(at, &v_text, sizeof v_text);
        return 0;
    }
    if (option_fields[i].kind == OPTION_FLOAT) {
        float v_float = strtof(text, &end);
        memcpy(at, &v_float, sizeof v_float);
    } else if (option_fields[i].kind == OPTION_SIZE) {
        size_t v_size = (size_t)strtoull(text, &end, 10);
        memcpy(at, &v_size, sizeof v_size);
    } else {
        long v = strtol(text, &end, 10);
        int v_int = (int)v;
        if (v < INT_MIN || v > INT_MAX) return -1;
        memcpy(at, &v_int, sizeof v_int);
    }
    return end == text || *end || errno ? -1 : 0;
}

/* Option i of o outside its range: says so into why (as the library says it of its settings)
   and returns 1; 0 when within. An int within lo .. hi, a float finite and at least lo; a size
   or text any. */
static int option_out_of_range(const run_options *o, int i, char *why, size_t cap) {
    option_kind kind = option_fields[i].kind;
    if (kind == OPTION_TEXT || kind == OPTION_SIZE) return 0;
    double v = option_number(o, i), lo = option_fields[i].lo, hi = option_fields[i].hi;
    const char *key = option_fields[i].key;
    if (kind == OPTION_INT && (v < lo || v > hi))
        snprintf(why, cap, "%s %d is out of range: expected %.0f to %.0f", key, (int)v, lo, hi);
    else if (kind == OPTION_FLOAT && (!isfinite(v) || v < lo))
        snprintf(why, cap, "%s %g is out of range: expected a finite number at least %g", key, v,
                 lo);
    else return 0;
    return 1;
}

/* lg_args.driver_value: the line of an option (key) as the library writes its numbers (a text
   option: its text, "" for none). */
static const char *option_value(const char *key, void *options, char *buf, size_t cap) {
    for (int i = 0; i < OPTION_COUNT; i++) {
        if (strcmp(option_fields[i].key, key) != 0) continue;
        const unsigned char *at = (const unsigned char *)options + option_fields[i].offset;
        const char *text;
        size_t size;
        if (option_fields[i].kind == OPTION_TEXT) {
            memcpy(&text, at, sizeof text);
            snprintf(buf, cap, "%s", text ? text : "");
        } else if (option_fields[i].kind == OPTION_SIZE) {
            memcpy(&size, at, sizeof size);
            snprintf(buf, cap, "%zu", size);
        } else if (option_fields[i].kind == OPTION_FLOAT) {
            snprintf(buf, cap, "%.9g", option_number((const run_options *)options, i));
        } else {
            snprintf(buf, cap, "%d", (int)option_number((const run_options *)options, i));
        }
        return buf;
    }
    return NULL;
}

/* --- the command line: one table of flags ------------------------------------------------- */

/* One flag met on the command line, as its handler sees it: its names and value, and where
   the settings go. */
typedef struct {
    const char *flag;        /* its names for messages: "-b/--micro-batch-size" or "--lr" */
    const char *value;       /* its value; NULL for a flag without one, or --plan bare */
    lg_args *a;              /* the run's settings (what the library reads) */
    run_options *o;          /* the driver's own */
    given_flags *given;
    checkpoint_flags *ck;
    output_flags *out;
    lg_launch *launch;       /* --dist-init and --dist-timeout: where the processes meet */
    int argc;                /* the command line (--offload LIST takes the next word) */
    char **argv;
} flag_call;

typedef void flag_handler(flag_call *c);

static void set_config(flag_call *c) {
    c->o->config = c->value;
    c->given->config = 1;
}

static void set_data(flag_call *c) { c->o->data = c->value; }
static void set_val_data(flag_call *c) { c->o->val_data = c->value; }

/* -b N, or auto (the largest that fits: choose_micro_batch) */
static void set_micro_batch_size(flag_call *c) {
    c->given->micro_batch_auto = strcmp(c->value, "auto") == 0;
    if (!c->given->micro_batch_auto) c->a->micro_batch_size = parse_int(c->flag, c->value);
}

static void set_global_batch_size(flag_call *c) {
    c->a->global_batch_size = parse_int(c->flag, c->value);
}

/* -t N, or auto (the longest that fits: choose_seq_length) */
static void set_max_seq_length(flag_call *c) {
    c->given->max_seq_length_auto = strcmp(c->value, "auto") == 0;
    c->a->max_seq_length = c->given->max_seq_length_auto ? 0 : parse_int(c->flag, c->value);
}

static void set_pack(flag_call *c) { c->a->pack = 1; }

static void set_precision(flag_call *c) {
    c->given->precision = 1;
    if (lg_precision_parse(c->value, &c->a->precision) != 0)
        die_usage("%s: '%s' is not one of 32-true, 16-true, bf16-true, 16-mixed, bf16-mixed",
                  c->flag, c->value);
}

static void set_devices(flag_call *c) { c->a->devices = parse_int(c->flag, c->value); }
static void set_nodes(flag_call *c) { c->a->nodes = parse_int(c->flag, c->value); }

static void set_strategy(flag_call *c) {
    if (lg_strategy_parse(c->value, &c->a->strategy) != 0)
        die_usage("%s: '%s' is not no-shard, shard-grad-op, full-shard or hybrid-shard",
                  c->flag, c->value);
}

static void set_recompute(flag_call *c) {
    static const char *const modes[] = {"none", "block"}; /* a->recompute: 0, 1 */
    int mode = lg_name_index(modes, LG_COUNT_OF(modes), c->value);
    if (mode < 0) die_usage("%s: '%s' is not none or block", c->flag, c->value);
    c->a->recompute = mode;
}

/* A count of rows, at least 1 (--head-rows, --slice-rows). */
static int parse_rows(const char *flag, const char *text) {
    int rows = parse_int(flag, text);
    if (rows < 1) die_usage("%s must be at least 1", flag);
    return rows;
}

static void set_head_rows(flag_call *c) { c->a->head_rows = parse_rows(c->flag, c->value); }
static void set_slice_rows(flag_call *c) { c->a->slice_rows = parse_rows(c->flag, c->value); }

/* The first part of a comma list that is not state, activations, gradients, weights or
   embedding, copied into bad (size); NULL when every part is known. */
static const char *offload_unknown_part(const char *text, char *bad, size_t size) {
    static const char *const parts[] = {"state", "activations", "gradients", "weights", "embedding"};
    for (const char *p = text;; p++) {
        size_t n = strcspn(p, ","), known = 0;
        for (size_t k = 0; k < sizeof parts / sizeof parts[0]; k++)
            known |= n == strlen(parts[k]) && strncmp(p, parts[k], n) == 0;
        if (!known) {
            snprintf(bad, size, "%.*s", (int)n, p);
            return bad;
        }
        p += n;
        if (*p == '\0') return NULL;
    }
}

/* --offload, --offload=LIST or --offload LIST (the next word, when it is not a flag: train
   takes no other words; getopt's optind moves past it). */
static void set_offload(flag_call *c) {
    const char *list = c->value;
    char bad[64];
    if (!list && optind < c->argc && c->argv[optind][0] != '-') list = c->argv[optind++];
    if (!list) list = "state";
    if (offload_unknown_part(list, bad, sizeof bad))
        die_usage("%s: '%s' is not a part to offload (a comma list of state, activations, "
                  "gradients, weights and embedding)", c->flag, bad);
    for (const char *p = list; *p; p += strcspn(p, ","), p += *p == ',') {
        size_t n = strcspn(p, ",");
        if (strncmp(p, "state", n) == 0) c->a->offload = 1;
        else if (strncmp(p, "activations", n) == 0) c->a->offload_activations = 1;
        else if (strncmp(p, "gradients", n) == 0) /* with state: the optimizer runs on them */
            c->a->offload = c->a->offload_gradients = 1;
        else if (strncmp(p, "weights", n) == 0) /* where the optimizer updates them */
            c->a->offload = c->a->offload_weights = 1;
        else c->a->offload_embedding = 1; /* the token table (trained: the checks' rules) */
    }
}

/* --plan (the table), --plan=json or --plan=svg */
static void set_plan(flag_call *c) {
    static const char *const formats[] = {"json", "svg"};
    static const lg_plan_mode modes[] = {LG_PLAN_JSON, LG_PLAN_SVG}; /* the formats' */
    int format = c->value ? lg_name_index(formats, LG_COUNT_OF(formats), c->value) : -1;
    if (c->value && format < 0)
        die_usage("%s=%s: only %s, %s=json or %s=svg", c->flag, c->value, c->flag, c->flag,
                  c->flag);
    c->a->plan_only = c->value ? modes[format] : LG_PLAN_TABLE;
}

static void set_memory_limit(flag_call *c) { c->o->memory_limit = parse_size(c->flag, c->value); }

static void set_host_memory_limit(flag_call *c) {
    c->a->host_memory_limit = parse_size(c->flag, c->value);
}

/* --gpu NAME plans for that card, on the CUDA backend */
static void set_gpu(flag_call *c) {
    c->a->gpu = parse_gpu(c->flag, c->value);
    c->a->backend = LG_BACKEND_CUDA;
}

/* --memory-margin SIZE; a bare 0 is 0B */
static void set_memory_margin(flag_call *c) {
    c->a->memory_margin = strcmp(c->value, "0") == 0 ? 0 : parse_margin(c->flag, c->value);
    c->a->memory_margin_given = 1;
}

/* --dist-init tcp://HOST:PORT or file://PATH */
static void set_dist_init(flag_call *c) {
    static const char *const schemes[] = {"tcp://", "file://"};
    int known = 0;
    for (size_t k = 0; k < sizeof schemes / sizeof schemes[0]; k++)
        known |= strncmp(c->value, schemes[k], strlen(schemes[k])) == 0;
    if (!known) die_usage("%s: '%s' is not tcp://HOST:PORT or file://PATH", c->flag, c->value);
    snprintf(c->launch->dist_init, sizeof c->launch->dist_init, "%s", c->value);
}

static void set_dist_timeout(flag_call *c) {
    if ((c->launch->dist_timeout = parse_float(c->flag, c->value)) <= 0)
        die_usage("%s must be more than 0 seconds", c->flag);
}

static void set_backend(flag_call *c) {
    if (lg_backend_parse(c->value, &c->a->backend) != 0)
        die_usage("%s: '%s' is not cpu or cuda", c->flag, c->value);
}

static void set_cpu(flag_call *c) { c->a->backend = LG_BACKEND_CPU; }
static void set_tf32(flag_call *c) { c->a->tf32 = 1; }

static void set_optimizer(flag_call *c) {
    if (lg_optimizer_parse(c->value, &c->a->optimizer) != 0)
        die_usage("%s: '%s' is not adamw, sgd, lion or sophia", c->flag, c->value);
}

static void set_hessian_interval(flag_call *c) {
    c->a->hessian_interval = parse_int(c->flag, c->value);
}

static void set_rho(flag_call *c) { c->a->rho = parse_float(c->flag, c->value); }

static void set_optimizer_state(flag_call *c) {
    if (lg_state_format_parse(c->value, &c->a->optimizer_state) != 0)
        die_usage("%s: '%s' is not bf16 or 8bit", c->flag, c->value);
}

static void set_lora_r(flag_call *c) { c->a->lora.r = parse_int(c->flag, c->value); }
static void set_lora_alpha(flag_call *c) { c->a->lora.alpha = parse_float(c->flag, c->value); }
static void set_lora_dropout(flag_call *c) { c->a->lora.dropout = parse_float(c->flag, c->value); }

static void set_lora_targets(flag_call *c) {
    lg_error err;
    if (lg_lora_targets_parse(c->value, &c->a->lora.targets, &err) != 0)
        die_usage("%s: %s", c->flag, err.msg);
}

static void set_quantize(flag_call *c) {
    if (lg_quantization_parse(c->value, &c->a->lora.quantize) != 0)
        die_usage("%s: '%s' is not nf4 or nf4-dq", c->flag, c->value);
}

static void set_lr(flag_call *c) {
    c->a->lr = parse_float(c->flag, c->value);
    c->given->lr = 1;
}

static void set_min_lr(flag_call *c) {
    c->a->min_lr = parse_float(c->flag, c->value);
    c->given->min_lr = 1;
}

static void set_warmup_steps(flag_call *c) { c->a->warmup_steps = parse_int(c->flag, c->value); }
static void set_weight_decay(flag_call *c) { c->a->weight_decay = parse_float(c->flag, c->value); }

static void set_beta1(flag_call *c) {
    c->a->beta1 = parse_float(c->flag, c->value);
    c->given->beta1 = 1;
}

static void set_beta2(flag_call *c) {
    c->a->beta2 = parse_float(c->flag, c->value);
    c->given->beta2 = 1;
}

static void set_momentum(flag_call *c) { c->a->momentum = parse_float(c->flag, c->value); }
static void set_max_norm(flag_call *c) { c->a->max_norm = parse_float(c->flag, c->value); }
static void set_max_steps(flag_call *c) { c->a->max_steps = parse_int(c->flag, c->value); }
static void set_eval_every(flag_call *c) { c->o->eval_every = parse_int(c->flag, c->value); }
static void set_eval_iters(flag_call *c) { c->o->eval_iters = parse_int(c->flag, c->value); }
static void set_sample_every(flag_call *c) { c->o->sample_every = parse_int(c->flag, c->value); }
static void set_sample_tokens(flag_call *c) { c->o->sample_tokens = parse_int(c->flag, c->value); }
static void set_temperature(flag_call *c) { c->o->temperature = parse_float(c->flag, c->value); }
static void set_prompt(flag_call *c) { c->o->prompt = c->value; }

/* --seed N: all 64 bits, not negative */
static void set_seed(flag_call *c) {
    char *end;
    errno = 0;
    unsigned long long seed = strtoull(c->value, &end, 10);
    if (*c->value == '\0' || *c->value == '-' || *end != '\0' || errno)
        die_usage("%s: '%s' is not a non-negative integer", c->flag, c->value);
    c->a->seed = (uint64_t)seed;
}

static void set_log(flag_call *c) { c->out->log_path = c->value; }
static void set_plot(flag_call *c) { c->out->plot = c->value; }

static void set_log_interval(flag_call *c) {
    c->out->log_interval = parse_int(c->flag, c->value);
    if (c->out->log_interval < 1) die_usage("%s must be at least 1", c->flag);
}

static void set_out(flag_call *c) { c->o->out_dir = c->value; }
static void set_save_every(flag_call *c) { c->o->save_every = parse_int(c->flag, c->value); }
static void set_load(flag_call *c) { c->ck->load = c->value; }
static void set_any_tokenizer_data(flag_call *c) { c->ck->any_tokenizer_data = 1; }
static void set_resume(flag_call *c) { c->ck->resume = c->value; }
static void set_data_changed(flag_call *c) { c->ck->data_changed = 1; }

static void print_usage(void);

/* -h/--help: the usage text on stdout (every process has it: start_processes) */
static void set_help(flag_call *c) {
    (void)c;
    print_usage();
    stop(0, NULL, NULL);
}

/* How a flag takes its value. */
typedef enum {
    FLAG_ALONE,         /* none: --pack */
    FLAG_VALUE,         /* one: --lr X, --lr=X, -b 4, -b4 */
    FLAG_MAYBE_VALUE,   /* one or none: --plan, --plan=json (and --offload LIST: set_offload) */
    FLAG_PROCESS_VALUE  /* one, read before the other flags, before the processes meet:
                           --dist-init URL or --dist-init=URL (take_process_flags) */
} flag_takes;

/* A flag: what the command line, the usage text and the messages know of it. */
typedef struct {
    const char *name;     /* --name */
    char letter;          /* -x; 0: none */
    flag_takes takes;
    const char *value;    /* the value's name in the usage text ("N"); one that starts with
                             "[=" follows the name without a space */
    flag_handler *set;
    const char *setting;  /* the setting it sets, as the library's messages name it (the
                             lg_args field, LG_RUN_SETTINGS' key: lg_spell_settings), or the
                             driver's own field or action ("help"); NULL: none of its own
                             (--cpu: backend) */
    const char *help;     /* its lines in the usage text, "\n" between them; NULL: on the next
                             flag's line (--lr X --min-lr X) */
} flag_row;

/* Every flag of train, in the usage text's order. */
static const flag_row flag_table[] = {
    {"config", 'c', FLAG_VALUE, "NAME|PATH", set_config, "config",
     "model: configs/NAME.yaml or a file (default: built-in model)"},
    {"data", 0, FLAG_VALUE, "FILE", set_data, "data",
     "training data: an llm.c token shard, or fine-tuning samples\n"
     "from tools/prepare alpaca (default: the built-in task, a\n"
     "fine-tuning set)"},
    {"val-data", 0, FLAG_VALUE, "FILE", set_val_data, "val_data",
     "validation data, of the same kind; without --data and\n"
     "with --max-steps 0 (and -c or --load): evaluation alone"},
    {"micro-batch-size", 'b', FLAG_VALUE, "N", set_micro_batch_size, "micro_batch_size",
     "samples per forward/backward (default 16); auto: the\n"
     "largest that fits and divides the per-device batch (-g)"},
    {"global-batch-size", 'g', FLAG_VALUE, "N", set_global_batch_size, "global_batch_size",
     "samples per optimizer step (default: = -b); accumulation\n"
     "steps = global / (devices x nodes) / micro-batch"},
    {"max-seq-length", 't', FLAG_VALUE, "N", set_max_seq_length, "max_seq_length",
     "tokens per sample: shard windows, or the length fine-tuning\n"
     "samples are truncated to (default: block_size for shards,\n"
     "the longest sample for fine-tuning); auto: the longest\n"
     "that fits, up to those"},
    {"pack", 0, FLAG_ALONE, NULL, set_pack, "pack",
     "fine-tuning samples packed first-fit into rows of -t\n"
     "tokens (default: the longest sample), attention and\n"
     "positions kept inside each sample; the CPU backend"},
    {"precision", 'p', FLAG_VALUE, "P", set_precision, "precision",
     "bf16-mixed (default), 16-mixed, bf16-true, 16-true, 32-true"},
    {"devices", 'd', FLAG_VALUE, "N", set_devices, "devices",
     "GPUs a node (1), one rank each; on the CPU backend,\n"
     "simulated ranks"},
    {"nodes", 0, FLAG_VALUE, "N", set_nodes, "nodes",
     "nodes (1); ranks = devices x nodes"},
    {"strategy", 0, FLAG_VALUE, "S", set_strategy, "strategy",
     "with more than one rank: full-shard (default; weights,\n"
     "gradients and optimizer state split), shard-grad-op\n"
     "(gradients and state), no-shard (DDP) or hybrid-shard\n"
     "(full-shard in a node, replicas across nodes)"},
    {"recompute", 0, FLAG_VALUE, "MODE", set_recompute, "recompute",
     "none (default) or block: keep each block's input only and\n"
     "recompute the block in the backward (same results)"},
    {"head-rows", 0, FLAG_VALUE, "N", set_head_rows, "head_rows",
     "the head and loss N rows of logits at a time, computed\n"
     "again in the backward (default: all rows, or chunks of\n"
     LG_HEAD_CHUNK_TEXT " where the run does not fit with all)"},
    {"slice-rows", 0, FLAG_VALUE, "N", set_slice_rows, "slice_rows",
     "each block's MLP N rows at a time, its hidden layer\n"
     "computed again in the backward (default: all rows, or\n"
     "with --recompute block slices of " LG_SLICE_TEXT " where the run\n"
     "does not fit with all and the head in chunks)"},
    {"offload", 0, FLAG_MAYBE_VALUE, "[LIST]", set_offload, "offload",
     "parts in host memory, a comma list (bare: state): state\n"
     "(master weights and optimizer state; the optimizer runs\n"
     "there), activations (the block inputs --recompute block\n"
     "keeps), gradients (each block's as its backward ends;\n"
     "with state), weights (streamed in a block at a time; with\n"
     "state), embedding (the token table, the step's rows\n"
     "gathered there; LoRA's frozen one, or trained with\n"
     "gradients,weights on one device, its gradient scattered\n"
     "there); same results either way"},
    {"plan", 0, FLAG_MAYBE_VALUE, "[=json|svg]", set_plan, "plan_only",
     "print the memory plan per device and exit; json and svg\n"
     "alone on stdout (svg: stacked groups against the limit)"},
    {"memory-limit", 0, FLAG_VALUE, "SIZE", set_memory_limit, "memory_limit",
     "memory a device may use, e.g. 24GiB (default: a GPU's\n"
     "memory); on the CPU backend the memory of the machine,\n"
     "which both pools of every simulated rank share (default:\n"
     "what it has available); a run that does not fit exits 3\n"
     "with a diagnosis and the cheapest change that fits"},
    {"host-memory-limit", 0, FLAG_VALUE, "SIZE", set_host_memory_limit, "host_memory_limit",
     "host memory the host pools of a machine's ranks may\n"
     "use together (default: what it has available); on the\n"
     "CPU backend a cap on the machine's memory too"},
    {"gpu", 0, FLAG_VALUE, "NAME", set_gpu, "gpu",
     "with --plan: plan for that card from any machine (its\n"
     "reported memory and limits, the runtime estimated);\n"
     "--gpu list prints the cards"},
    {"memory-margin", 0, FLAG_VALUE, "SIZE", set_memory_margin, "memory_margin",
     "device memory a GPU plan keeps free beyond what it\n"
     "counts (default: 1% of the limit or 256MiB, whichever\n"
     "is more; 0B: none)"},
    {"dist-init", 0, FLAG_PROCESS_VALUE, "URL", set_dist_init, "dist_init",
     "GPU processes without MPI meet at tcp://HOST:PORT (process\n"
     "0's machine) or file://PATH (shared); default from\n"
     "MASTER_ADDR and MASTER_PORT + 1"},
    {"dist-timeout", 0, FLAG_PROCESS_VALUE, "S", set_dist_timeout, "dist_timeout",
     "seconds a process waits for the others there and in any\n"
     "collective before it ends the job naming the late ranks\n"
     "(600: PyTorch's default for NCCL process groups)"},
    {"backend", 0, FLAG_VALUE, "B", set_backend, "backend",
     "cpu or cuda (default: cuda when the build has it and a\n"
     "GPU is visible); --plan --backend cuda plans GPUs from\n"
     "any machine, the CUDA runtime's share estimated"},
    {"cpu", 0, FLAG_ALONE, NULL, set_cpu, NULL,
     "the same as --backend cpu"},
    {"tf32", 0, FLAG_ALONE, NULL, set_tf32, "tf32",
     "on a GPU, fp32 matmuls may use TF32 tensor cores"},
    {"optimizer", 'o', FLAG_VALUE, "NAME", set_optimizer, "optimizer",
     "adamw (default), sgd, lion (one state; betas 0.9 0.99\n"
     "unless given) or sophia (SophiaG; betas 0.965 0.99)"},
    {"hessian-interval", 0, FLAG_VALUE, "N", set_hessian_interval, "hessian_interval",
     "sophia: steps between Hessian estimates, each one more\n"
     "forward and backward on labels drawn from the model (10)"},
    {"rho", 0, FLAG_VALUE, "X", set_rho, "rho",
     "sophia: clipping scale of the update (0.04)"},
    {"optimizer-state", 0, FLAG_VALUE, "FMT", set_optimizer_state, "optimizer_state",
     "AdamW's moments in bf16 or 8bit (block-wise quantized);\n"
     "tensors under 4096 elements keep fp32 state"},
    {"lora-r", 0, FLAG_VALUE, "R", set_lora_r, "lora.r",
     "fine-tune rank-R LoRA adapters over the frozen model\n"
     "(0: off, every weight trains)"},
    {"lora-alpha", 0, FLAG_VALUE, "X", set_lora_alpha, "lora.alpha",
     "the adapters' scale is alpha / r (16)"},
    {"lora-dropout", 0, FLAG_VALUE, "X", set_lora_dropout, "lora.dropout",
     "dropout on the adapters' input (0.05)"},
    {"lora-targets", 0, FLAG_VALUE, "LIST", set_lora_targets, "lora.targets",
     "linears with adapters: q,k,v,proj,mlp,head (q,v); all:\n"
     "every linear but the head"},
    {"quantize", 0, FLAG_VALUE, "Q", set_quantize, "lora.quantize",
     "with --lora-r: frozen linear weights in nf4 or nf4-dq\n"
     "(QLoRA; lm_head included unless tied)"},
    {"lr", 0, FLAG_VALUE, "X", set_lr, "lr", NULL},
    {"min-lr", 0, FLAG_VALUE, "X", set_min_lr, "min_lr",
     "peak and final learning rate (4e-3; --lr / 10)"},
    {"warmup-steps", 0, FLAG_VALUE, "N", set_warmup_steps, "warmup_steps",
     "linear warmup, then cosine decay to --min-lr (50)"},
    {"weight-decay", 0, FLAG_VALUE, "X", set_weight_decay, "weight_decay",
     "on 2-D weights only (0.1)"},
    {"beta1", 0, FLAG_VALUE, "X", set_beta1, "beta1", NULL},
    {"beta2", 0, FLAG_VALUE, "X", set_beta2, "beta2",
     "AdamW (0.9, 0.95)"},
    {"momentum", 0, FLAG_VALUE, "X", set_momentum, "momentum",
     "SGD (0.9)"},
    {"max-norm", 0, FLAG_VALUE, "X", set_max_norm, "max_norm",
     "clip gradients to this global norm, 0: off (1.0)"},
    {"max-steps", 0, FLAG_VALUE, "N", set_max_steps, "max_steps",
     "optimizer steps; 0: evaluate and exit (1000)"},
    {"eval-every", 0, FLAG_VALUE, "N", set_eval_every, "eval_every",
     "steps between validations, 0: only at the ends (200)"},
    {"eval-iters", 0, FLAG_VALUE, "N", set_eval_iters, "eval_iters",
     "validation micro-batches at most, each sample once (10)"},
    {"sample-every", 0, FLAG_VALUE, "N", set_sample_every, "sample_every",
     "steps between generated samples, 0: only at the end (0)"},
    {"sample-tokens", 0, FLAG_VALUE, "N", set_sample_tokens, "sample_tokens",
     "tokens to generate (16)"},
    {"temperature", 0, FLAG_VALUE, "X", set_temperature, "temperature",
     "0: greedy (default), else sampling temperature"},
    {"prompt", 0, FLAG_VALUE, "TEXT", set_prompt, "prompt",
     "built-in task: letters, e.g. \"litgpt=\"; shards: token ids"},
    {"seed", 0, FLAG_VALUE, "N", set_seed, "seed",
     "weights, data order and sampling (1337)"},
    {"log", 0, FLAG_VALUE, "FILE", set_log, "log_path",
     "one JSON object per step and per evaluation"},
    {"plot", 0, FLAG_VALUE, "FILE.svg", set_plot, "plot",
     "the loss (raw, smoothed), validation points and learning\n"
     "rate against steps, rewritten at each evaluation"},
    {"log-interval", 0, FLAG_VALUE, "N", set_log_interval, "log_interval",
     "steps between full progress lines (default: about 20 a\n"
     "run); on a terminal one status line refreshes in between"},
    {"out", 0, FLAG_VALUE, "DIR", set_out, "out_dir",
     "write checkpoints DIR/step-N/ at the end (and every\n"
     "--save-every steps): model.safetensors and config.json\n"
     "in the Hugging Face layout, model_config.yaml, the\n"
     "training state, and a COMPLETE marker written last"},
    {"save-every", 0, FLAG_VALUE, "N", set_save_every, "save_every",
     "steps between checkpoints (0: only at the end)"},
    {"load", 0, FLAG_VALUE, "DIR", set_load, "load",
     "start from the weights of a Hugging Face directory\n"
     "(config.json + model.safetensors or shards), instead of -c;\n"
     "data made with another tokenizer than its own is refused"},
    {"any-tokenizer-data", 0, FLAG_ALONE, NULL, set_any_tokenizer_data, "any_tokenizer_data",
     "train on such data anyway (a deliberate reuse)"},
    {"resume", 0, FLAG_VALUE, "DIR", set_resume, "resume",
     "continue a run from DIR/step-N (or the latest complete\n"
     "step-N under DIR) with the settings it records: bitwise\n"
     "the same losses as an uninterrupted run, checkpoints to\n"
     "its --out; flags given change steps, the learning rate,\n"
     "evaluation, outputs and the memory layout, and are\n"
     "refused where they would change the model; -c must be\n"
     "its model; LoRA: its base comes back from the recorded\n"
     "--load DIR (or --load another copy; the hash must match);\n"
     "its training data must be the run's (size and hash)"},
    {"data-changed", 0, FLAG_ALONE, NULL, set_data_changed, "data_changed",
     "with --resume: continue on training data that changed on\n"
     "purpose (re-prepared, grown); the run's trajectory ends"},
    {"help", 'h', FLAG_ALONE, NULL, set_help, "help", ""},
};

enum {
    FLAG_COUNT = sizeof flag_table / sizeof flag_table[0],
    FIRST_LONG_CODE = 256, /* getopt's code of a flag without a letter: this + its row */
    USAGE_HELP_COLUMN = 29 /* where the usage text's help starts (at least 2 spaces after) */
};

/* The flag's names for messages: "-b/--micro-batch-size" or "--lr". */
static const char *flag_name(const flag_row *f, char *name, size_t size) {
    if (f->letter) snprintf(name, size, "-%c/--%s", f->letter, f->name);
    else snprintf(name, size, "--%s", f->name);
    return name;
}

/* One entry of the usage text: the flags' names (the left column), then the help's lines,
   the first after the names, the others under it. */
static void print_usage_entry(const char *names, const char *help) {
    int width = (int)strlen(names);
    if (!*help) {
        printf("%s\n", names);
        return;
    }
    printf("%s%*s", names, width + 2 > USAGE_HELP_COLUMN ? 2 : USAGE_HELP_COLUMN - width, "");
    for (const char *line = help;; line++) {
        size_t n = strcspn(line, "\n");
        printf("%.*s\n", (int)n, line);
        line += n;
        if (!*line) return;
        printf("%*s", USAGE_HELP_COLUMN, "");
    }
}

/* The usage text, from the table: "  -b, --micro-batch-size N   samples per ...". */
static void print_usage(void) {
    char names[128] = "";
    fputs("usage: ./train [options]\n", stdout);
    for (int i = 0; i < FLAG_COUNT; i++) {
        const flag_row *f = &flag_table[i];
        size_t used = strlen(names);
        char lead[8] = "      "; /* the letters' column, blank */
        if (f->letter) snprintf(lead, sizeof lead, "  -%c, ", f->letter);
        const char *space = f->value && strncmp(f->value, "[=", 2) != 0 ? " " : "";
        snprintf(names + used, sizeof names - used, "%s--%s%s%s", used ? " " : lead, f->name,
                 space, f->value ? f->value : "");
        if (!f->help) continue; /* its line goes on with the next flag */
        print_usage_entry(names, f->help);
        names[0] = '\0';
    }
}

/* getopt_long's code for the table's row i (its letter, if it has one). */
static int flag_code(int i) {
    return flag_table[i].letter ? flag_table[i].letter : FIRST_LONG_CODE + i;
}

/* The row getopt_long's code stands for; NULL: none (':' or '?', an error). */
static const flag_row *flag_of_code(int code) {
    for (int i = 0; i < FLAG_COUNT; i++)
        if (flag_code(i) == code) return &flag_table[i];
    return NULL;
}

/* getopt_long's lists from the table: the letters (":c:b:...h": ':' first, so that a missing
   value is told from an unknown flag) and the long options, ended by a zero entry. The
   process flags are not among them: take_process_flags took them out of argv. */
static void getopt_lists(char *letters, struct option *longs) {
    static const int has_arg[] = {no_argument, required_argument, optional_argument};
    int n = 0;
    *letters++ = ':';
    for (int i = 0; i < FLAG_COUNT; i++) {
        const flag_row *f = &flag_table[i];
        if (f->takes == FLAG_PROCESS_VALUE) continue;
        if (f->letter) *letters++ = f->letter;
        if (f->letter && f->takes != FLAG_ALONE) *letters++ = ':';
        if (f->letter && f->takes == FLAG_MAYBE_VALUE) *letters++ = ':';
        longs[n].name = f->name;
        longs[n].has_arg = has_arg[f->takes];
        longs[n].flag = NULL;
        longs[n++].val = flag_code(i);
    }
    *letters = '\0';
    memset(&longs[n], 0, sizeof longs[n]);
}

/* The flags of argv onto a and o (and the driver's other flags), from the first: a resumed run
   applies them again over its checkpoint's settings. */
static void apply_flags(int argc, char **argv, lg_args *a, run_options *o, given_flags *given,
                        checkpoint_flags *ck, output_flags *out) {
    char letters[3 * FLAG_COUNT + 2]; /* ':', then each letter with up to two ':' */
    struct option longs[FLAG_COUNT + 1];
    getopt_lists(letters, longs);
    flag_call call = {NULL, NULL, a, o, given, ck, out, NULL, argc, argv};
    opterr = 0;
    optind = 0; /* glibc: a fresh scan */
    int code;
    while ((code = getopt_long(argc, argv, letters, longs, NULL)) != -1) {
        if (code == ':') die_usage("%s needs a value", argv[optind - 1]);
        const flag_row *f = flag_of_code(code);
        if (!f) die_usage("unknown option %s", argv[optind - 1]);
        char name[64];
        call.flag = flag_name(f, name, sizeof name);
        call.value = optarg;
        f->set(&call);
    }
    if (optind < argc) die_usage("unexpected argument '%s'", argv[optind]);
}

/* The command line over the defaults (and the backend this machine would use). */
static void parse_args(int argc, char **argv, lg_args *a, run_options *o, given_flags *given,
                       checkpoint_flags *ck, output_flags *out) {
    lg_args_default(a);
    options_default(o);
    a->backend = lg_backend_in_use(); /* a GPU when the build has CUDA and one is visible */
    memset(ck, 0, sizeof *ck);
    memset(given, 0, sizeof *given);
    memset(out, 0, sizeof *out);
    apply_flags(argc, argv, a, o, given, ck, out);
}

/* argv[*i] is --name (its value the next word, NULL at the end) or --name=VALUE: returns 1
   with *value, *i past a value taken from the next word; 0 when it is another word. */
static int long_flag_value(int argc, char **argv, int *i, const char *name, const char **value) {
    const char *arg = argv[*i];
    size_t len = strlen(name);
    if (strncmp(arg, "--", 2) != 0 || strncmp(arg + 2, name, len) != 0) return 0;
    if (arg[2 + len] == '=') *value = arg + 2 + len + 1;
    else if (arg[2 + len] == '\0') *value = *i + 1 < argc ? argv[++*i] : NULL;
    else return 0;
    return 1;
}

/* The process flags (--dist-init URL, --dist-timeout S) into launch, taken out of argv before
   the other flags are read; returns the arguments left. */
static int take_process_flags(int argc, char **argv, lg_launch *launch) {
    flag_call call = {NULL, NULL, NULL, NULL, NULL, NULL, NULL, launch, argc, argv};
    char name[64];
    int kept = 1;
    for (int i = 1; i < argc; i++) {
        const flag_row *f = NULL;
        for (int k = 0; k < FLAG_COUNT && !f; k++)
            if (flag_table[k].takes == FLAG_PROCESS_VALUE &&
                long_flag_value(argc, argv, &i, flag_table[k].name, &call.value))
                f = &flag_table[k];
        if (!f) {
            argv[kept++] = argv[i];
            continue;
        }
        call.flag = flag_name(f, name, sizeof name);
        if (!call.value) die_usage("%s needs a value", call.flag);
        f->set(&call);
    }
    argv[kept] = NULL;
    return kept;
}

/* The row of a word of the command line that names a flag exactly ("--name", "--name=V",
   "-x", "-xV"); sets *takes_value when its value is the next word. NULL: no flag. */
static const flag_row *flag_of_word(const char *arg, int *takes_value) {
    *takes_value = 0;
    if (arg[0] != '-' || arg[1] == '\0') return NULL;
    for (int i = 0; i < FLAG_COUNT; i++) {
        const flag_row *f = &flag_table[i];
        int value = f->takes == FLAG_VALUE;
        if (arg[1] == '-') {
            size_t len = strcspn(arg + 2, "=");
            if (strlen(f->name) != len || strncmp(arg + 2, f->name, len) != 0) continue;
            *takes_value = value && !strchr(arg, '=');
        } else {
            if (!f->letter || f->letter != arg[1]) continue;
            *takes_value = value && arg[2] == '\0';
        }
        return f;
    }
    return NULL;
}

/* The flag of a setting (flag_row.setting), lg_spell_settings' speller: its names, or with a
   value the word before it ("-b" of "-b 4", "--offload" of "--offload gradients"); NULL: no
   flag sets it. */
static const char *flag_of_setting(const char *key, int with_value, void *unused, char *name,
                                   size_t size) {
    (void)unused;
    for (int i = 0; i < FLAG_COUNT; i++) {
        const flag_row *f = &flag_table[i];
        if (!f->setting || strcmp(f->setting, key) != 0) continue;
        if (!with_value) return flag_name(f, name, size);
        if (f->letter) snprintf(name, size, "-%c", f->letter);
        else snprintf(name, size, "--%s", f->name);
        return name;
    }
    return NULL;
}

/* The flag of a setting of LG_RUN_SETTINGS (its key), for messages; the key when none. */
static const char *setting_flag(const char *key, char *name, size_t size) {
    if (flag_of_setting(key, 0, NULL, name, size)) return name;
    snprintf(name, size, "%s", key);
    return name;
}

/* A message that names settings (the library's, or train's own) with train's flags. */
static const char *spell_flags(const char *message, char *out, size_t size) {
    lg_spell_settings(message, flag_of_setting, NULL, out, size);
    return out;
}

/* An error the library reported, its settings as flags, with the exit code the caller gives. */
static void die(int code, const lg_error *err) {
    char message[1024];
    stop(code, spell_flags(err->msg, message, sizeof message), "");
}

/* A bad value the library found (lg_args_check, ...): die_usage with its settings as flags. */
static void die_usage_error(const lg_error *err) {
    char message[1024];
    die_usage("%s", spell_flags(err->msg, message, sizeof message));
}

/* die_usage for a message that names settings as the library does ("`lr` must be ..."). */
static void die_usage_settings(const char *fmt, ...) {
    char marked[1024], message[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(marked, sizeof marked, fmt, ap);
    va_end(ap);
    die_usage("%s", spell_flags(marked, message, sizeof message));
}

/* printf for text that names settings as the library does, spelled as train's flags. */
static void print_settings(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    size_t size = n > 0 ? (size_t)n + 1 : 1;
    char *marked = (char *)malloc(size), *spelled = (char *)malloc(2 * size);
    if (!marked || !spelled) die_out_of_memory("a line of output");
    va_start(ap, fmt);
    vsnprintf(marked, size, fmt, ap);
    va_end(ap);
    fputs(spell_flags(marked, spelled, 2 * size), stdout);
    free(marked);
    free(spelled);
}

/* The options' values (the library checks its settings: lg_args_check). */
static void check_options(const run_options *o) {
    const struct { const char *setting; int steps; } counts[] = {
        {"`eval_every`", o->eval_every}, {"`sample_every`", o->sample_every}};
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
        if (counts[i].steps < 0)
            die_usage_settings("%s %d: a count of steps, must be >= 0", counts[i].setting,
                               counts[i].steps);
    if (o->eval_iters < 1) die_usage_settings("`eval_iters` must be at least 1");
    if (o->temperature < 0.0f) die_usage_settings("`temperature` must be >= 0");
    if (o->sample_tokens < 1 || o->sample_tokens > 1000000)
        die_usage_settings("`sample_tokens` must be within 1 and 1000000");
    if (o->save_every < 0) die_usage_settings("`save_every` must be 0 or more");
}

/* The flags together, once a resumed run has its checkpoint's settings. */
static void check_flags(const lg_args *a, const run_options *o, const given_flags *given,
                        const checkpoint_flags *ck) {
    check_options(o);
    if (given->micro_batch_auto && !a->global_batch_size)
        die_usage_settings("`micro_batch_size auto` needs `global_batch_size`: it picks a divisor of the per-device "
                  "batch");
    if (o->val_data && !o->data && a->max_steps != 0)
        die_usage_settings("`val_data` without `data` evaluates a model alone: give `max_steps` 0 (and "
                  "`data` to train; the built-in task brings its own validation set)");
    if (o->val_data && !o->data && (o->out_dir || ck->resume))
        die_usage_settings("%s: `val_data` without `data` only evaluates (`max_steps` 0) and saves "
                  "nothing", o->out_dir ? "`out_dir`" : "`resume`");
    if (a->devices < 1) die_usage_settings("`devices` must be at least 1");
    if (a->nodes < 1) die_usage_settings("`nodes` must be at least 1");
    if (o->save_every && !o->out_dir) die_usage_settings("`save_every` needs `out_dir` DIR");
    if (ck->data_changed && !ck->resume)
        die_usage_settings("`data_changed` goes with `resume`: a fresh run has no data to compare with");
    if (ck->load && !ck->resume && o->config)
        die_usage_settings("`load` brings its model's config.json: drop `config`");
}

#include "train_svg.h" /* pictures: self-written SVG, no dependency */

/* --- the memory plan: --plan, the fit check, the diagnosis ---------------------------------- */

/* The user's command line with the flags that `flags` sets replaced by `flags`. */
static void print_command(int argc, char **argv, const char *flags) {
    enum { MOST_REPLACED = 16 };
    const flag_row *replaced[MOST_REPLACED];
    int n = 0, takes_value;
    char copy[160];
    snprintf(copy, sizeof copy, "%s", flags);
    for (char *tok = strtok(copy, " "); tok && n < MOST_REPLACED; tok = strtok(NULL, " ")) {
        const flag_row *f = flag_of_word(tok, &takes_value);
        if (f) replaced[n++] = f;
    }
    printf("  %s", argv[0]);
    for (int i = 1; i < argc; i++) {
        const flag_row *f = flag_of_word(argv[i], &takes_value);
        int k = 0;
        while (f && k < n && replaced[k] != f) k++;
        if (f && k < n) { /* (a word after --offload is its list: train takes no others) */
            i += takes_value;
            if (f->takes == FLAG_MAYBE_VALUE && !strchr(argv[i], '=') && i + 1 < argc &&
                argv[i + 1][0] != '-')
                i++;
            continue;
        }
        printf(strchr(argv[i], ' ') ? " \"%s\"" : " %s", argv[i]);
    }
    printf(" %s\n", flags);
}

static void print_largest_regions(const lg_plan *plan, int how_many) {
    const lg_rank_plan *r = &plan->ranks[0];
    char size[32];
    int shown[8] = {0};
    for (int k = 0; k < how_many && k < 8; k++) {
        int best = -1;
        for (int i = 0; i < r->n_regions; i++) {
            int taken = 0;
            for (int j = 0; j < k; j++) taken |= shown[j] == i;
            if (!taken && r->regions[i].pool == LG_POOL_DEVICE &&
                (best < 0 || r->regions[i].bytes > r->regions[best].bytes))
                best = i;
        }
        if (best < 0) break;
        shown[k] = best;
        const lg_region *x = &r->regions[best];
        printf("  %-26s %11s  %s x %zu (%s)\n", x->name, lg_format_bytes(x->bytes, size, sizeof size),
               lg_dtype_name(x->dtype), x->count, lg_group_name(x->group));
    }
}

/* A run that does not fit: what it needs, what there is, the largest regions, the remedies
   priced by the planner, the cheapest change that fits. Exits 3. */
static void explain_does_not_fit(int argc, char **argv, const lg_config *cfg, const lg_args *a,
                                 int T, const lg_plan *plan, const lg_fit *fit,
                                 const char *source) {
    char need[32], have[32], size[32], flags[160];
    size_t limit = fit->limit;
    if (a->backend == LG_BACKEND_CPU)
        print_settings("train: this run needs %s of the machine's memory (the CPU backend: device and "
               "host pools of %d rank%s together), but %s is available (%s)\n",
               lg_format_bytes(fit->checked_bytes, need, sizeof need), a->devices,
               a->devices > 1 ? "s" : "", lg_format_bytes(limit, have, sizeof have), source);
    else if (!fit->device_fits)
        print_settings("train: this run needs %s on each device, but %s is available (%s)\n",
               lg_format_bytes(fit->checked_bytes, need, sizeof need),
               lg_format_bytes(limit, have, sizeof have), source);
    else
        print_settings("train: this run's host pools need %s of host memory (%d rank%s on a machine), "
               "but %s is available (%s)\n",
               lg_format_bytes(fit->host_bytes, need, sizeof need), a->devices,
               a->devices > 1 ? "s" : "", lg_format_bytes(fit->host_limit, have, sizeof have),
               a->host_memory_limit ? "`host_memory_limit`" : "available host memory");
    printf("largest regions:\n");
    print_largest_regions(plan, 5);
    lg_remedy remedies[LG_MAX_REMEDIES];
    int n = lg_plan_remedies(cfg, a, T, limit, remedies);
    printf("remedies, in the order of the OOM guide (each alone):\n");
    for (int i = 0; i < n; i++)
        printf("  %-29s %-39s %11s  %s\n", remedies[i].what,
               remedy_flags(&remedies[i], flags, sizeof flags),
               lg_format_bytes(remedies[i].checked_bytes, size, sizeof size),
               remedies[i].fits ? "fits" : "does not fit");
    lg_remedy best;
    if (lg_plan_cheapest_fit(cfg, a, T, limit, &best) == 0) {
        printf("cheapest change that fits (%s):\n",
               lg_format_bytes(best.checked_bytes, size, sizeof size));
        print_command(argc, argv, remedy_flags(&best, flags, sizeof flags));
    } else {
        char host[32];
        if (a->backend == LG_BACKEND_CPU)
            printf("no change this version can run fits in %s; even %s needs %s (device and "
                   "host pools together)\n", have, remedy_flags(&best, flags, sizeof flags),
                   lg_format_bytes(best.checked_bytes, size, sizeof size));
        else
            printf("no change this version can run fits in %s; even %s needs %s on the device "
                   "and %s of host memory (%s available)\n", have,
                   remedy_flags(&best, flags, sizeof flags),
                   lg_format_bytes(best.device_bytes, size, sizeof size),
                   lg_format_bytes(best.host_bytes, host, sizeof host),
                   lg_format_bytes(fit->host_limit, need, sizeof need));
    }
    stop(3, NULL, NULL);
}

/* The memory a device may use: --memory-limit, else a GPU's memory (0: no GPU here to
   measure). On the CPU backend the memory of the machine, which its pools and simulated ranks
   share (lg_plan_checked_bytes): the smaller of --memory-limit and --host-memory-limit, else
   what it had available (a->host_available, read once). */
static size_t device_limit(const lg_args *a, const run_options *o, const char **source) {
    size_t host = a->host_memory_limit;
    if (o->memory_limit && (a->backend == LG_BACKEND_CUDA || !host || o->memory_limit <= host)) {
        *source = "`memory_limit`";
        return o->memory_limit;
    }
    if (a->gpu) {
        *source = a->gpu->nominal ? "`gpu`: the card's memory, not a reading" : "`gpu`: what the card reports";
        return a->gpu->total_mib << 20;
    }
    if (a->backend == LG_BACKEND_CUDA) {
        *source = a->runtime_estimated ? "no GPU here to measure; `memory_limit` SIZE checks one"
                                       : "the GPU's memory, of which the CUDA runtime's share "
                                         "is in the plan";
        return a->runtime_estimated ? 0 : a->device_bytes;
    }
    *source = host ? "`host_memory_limit`" : "available host memory";
    return lg_args_host_limit(a);
}

/* --backend cuda where no GPU can run it: --plan plans with the runtime estimated; anything
   else stops, exit 2. */
static void plan_gpus_not_here(lg_args *a) {
#ifdef LG_CUDA
    const char *why = "no GPU is visible";
#else
    const char *why = "this build has no CUDA backend (make cuda builds build/train_cuda)";
#endif
    if (!a->plan_only) die_usage_settings("`backend` cuda: %s; `plan_only` `backend` cuda plans for GPUs "
                                 "from here", why);
    lg_cuda_estimate_runtime(a);
}

/* GPUs: one a rank; what the CUDA runtime takes on each goes into the plan; how they
   connect. A CUDA build without a GPU says it runs on the CPU. */
static void prepare_gpus(lg_args *a, int process_per_gpu_or_node) {
    lg_error err;
#ifdef LG_CUDA
    if (a->backend == LG_BACKEND_CPU && lg_cuda_device_count() == 0)
        printf("CUDA build, but no GPU is visible: running on the CPU backend\n");
#endif
    if (a->backend != LG_BACKEND_CUDA) return;
    if (a->gpu) { /* a plan for a named card, whatever GPUs this machine has */
        if (!a->plan_only) die_usage_settings("`gpu` %s plans for that card (with `plan_only`); a run uses the "
                                     "GPUs it finds", a->gpu->name);
        lg_cuda_estimate_runtime(a);
        return;
    }
    /* several processes: the GPUs of one node */
    int ranks = process_per_gpu_or_node ? a->devices : lg_args_ranks(a), visible = lg_cuda_device_count();
    if (visible == 0) {
        plan_gpus_not_here(a);
        return;
    }
    if (ranks > visible)
        die_usage_settings("`devices` %d x `nodes` %d = %d ranks, one a GPU, but %d GPU%s visible",
                  a->devices, a->nodes, ranks, visible, visible == 1 ? " is" : "s are");
    if (lg_cuda_measure_runtime(ranks, lg_comms_per_rank(a), &a->runtime_bytes, &a->device_bytes,
                                &err) != 0)
        die(1, &err);
    if (ranks > 1 && !lg_cuda_report_topology(ranks, stdout))
        printf("warning: not every pair of GPUs has direct peer access (NVLink or PCIe P2P): "
               "the collectives pass through host memory and will be slow\n");
}

/* -b auto: the largest micro-batch that fits and divides the per-device batch; what it chose
   is added to note. */
static void choose_micro_batch(lg_args *a, const run_options *o, const lg_config *cfg,
                               int T, char *note, size_t cap) {
    const char *source;
    size_t limit = device_limit(a, o, &source);
    if (limit == 0) limit = (size_t)-1; /* unknown: no limit */
    int b = lg_plan_auto_micro_batch(cfg, a, T, limit);
    char size[32];
    if (b == 0) {
        a->micro_batch_size = 1;
        return; /* the fit check explains */
    }
    a->micro_batch_size = b;
    size_t used = strlen(note);
    snprintf(note + used, cap - used, "`micro_batch_size auto`: micro-batch %d (the largest dividing %d per "
             "device that fits in %s, %s)\n", b, a->global_batch_size / lg_args_ranks(a),
             lg_format_bytes(limit, size, sizeof size), source);
}

/* The token embedding when --offload embedding is not given: on the device, or in host memory
   where that makes the run fit and the run allows it (said in note). */
static void choose_embedding(lg_args *a, const run_options *o, const lg_config *cfg,
                             int T, char *note, size_t cap) {
    const char *source;
    size_t limit = device_limit(a, o, &source);
    char size[32];
    if (a->offload_embedding || !lg_plan_auto_embedding(cfg, a, T, limit)) return;
    a->offload_embedding = 1;
    size_t used = strlen(note);
    snprintf(note + used, cap - used, "the run does not fit in %s (%s) with the token embedding "
             "on the device; %s in host memory (`offload embedding`)\n",
             lg_format_bytes(limit, size, sizeof size), source,
             a->lora.r > 0 ? "LoRA's frozen table" : "the table, trained there,");
}

/* --head-rows and --slice-rows when not given: all rows, or where the run does not fit so the
   planner's chunks and slices (said in note). */
static void choose_rows(lg_args *a, const run_options *o, const lg_config *cfg,
                        int T, char *note, size_t cap) {
    const char *source;
    size_t limit = device_limit(a, o, &source);
    int N = a->micro_batch_size * T, head_given = a->head_rows, slice_given = a->slice_rows;
    if (limit == 0) return; /* unknown: all rows */
    lg_plan_auto_rows(cfg, a, T, limit, &a->head_rows, &a->slice_rows);
    int chunked = !head_given && a->head_rows < N, sliced = !slice_given && a->slice_rows < N;
    if (!chunked && !sliced) return;
    char size[32], chunks[64] = "", slices[64] = "";
    if (chunked) snprintf(chunks, sizeof chunks, "; the head and loss in chunks of %d rows", a->head_rows);
    if (sliced) snprintf(slices, sizeof slices, "; each block's MLP in slices of %d rows", a->slice_rows);
    size_t used = strlen(note);
    snprintf(note + used, cap - used, "the run does not fit in %s (%s) with all %d rows at "
             "once%s%s\n", lg_format_bytes(limit, size, sizeof size), source, N, chunks, slices);
}

/* The model as planned: the config's values after LitGPT's defaults and derivations. */
static void print_resolved_config(const lg_config *c) {
    printf("model %s: n_layer %d, n_head %d, n_query_groups %d, n_embd %d, head_size %d, "
           "intermediate_size %d, block_size %d, vocab_size %d (padded %d)\n", c->name,
           c->n_layer, c->n_head, c->n_query_groups, c->n_embd, c->head_size,
           c->intermediate_size, c->block_size, c->vocab_size, c->padded_vocab_size);
}

/* The plan's table (lg_plan_print), its settings spelled as flags. */
static void print_plan_table(const lg_plan *plan) {
    char *table = NULL;
    size_t size = 0;
    FILE *f = open_memstream(&table, &size);
    if (!f) die_out_of_memory("the plan's table");
    lg_plan_print(plan, f);
    fclose(f);
    char *spelled = (char *)malloc(2 * size + 1); /* a flag is at most 3 bytes longer than
                                                     its mark, a mark at least 4 */
    if (!spelled) die_out_of_memory("the plan's table");
    fputs(spell_flags(table, spelled, 2 * size + 1), stdout);
    free(spelled);
    free(table);
}

/* The model, the table, then the activation memory of both --recompute choices. */
static void print_plan_with_recompute_choice(const lg_plan *plan, const lg_args *a,
                                             const lg_config *cfg, int T) {
    print_resolved_config(cfg);
    print_plan_table(plan);
    lg_args other = *a;
    other.recompute = !a->recompute;
    lg_plan_spec spec;
    lg_plan alternative;
    lg_plan_spec_from_args(&spec, &other, T);
    if (lg_plan_make(&alternative, cfg, &spec, NULL) != 0) return;
    char none_size[32], block_size[32];
    const lg_plan *none = a->recompute ? &alternative : plan, *block = a->recompute ? plan : &alternative;
    print_settings("activations: %s with `recompute` none, %s with `recompute` block\n",
           lg_format_bytes(lg_plan_group_bytes(&none->ranks[0], LG_GROUP_ACTIVATIONS, LG_POOL_DEVICE),
                           none_size, sizeof none_size),
           lg_format_bytes(lg_plan_group_bytes(&block->ranks[0], LG_GROUP_ACTIVATIONS, LG_POOL_DEVICE),
                           block_size, sizeof block_size));
    lg_plan_free(&alternative);
}

/* --plan on a GPU: the step's compute and its host traffic, estimated; the copies run beside
   the compute, so they can hide behind it only where the card computes no faster than the
   copies take. */
static void print_step_costs(const lg_plan *plan, const lg_args *a) {
    char bytes[32];
    if (a->backend != LG_BACKEND_CUDA) return;
    double flops = lg_plan_step_flops(plan), traffic = (double)lg_plan_host_traffic_bytes(plan);
    double seconds = traffic / LG_PCIE_BYTES_PER_S_ESTIMATE;
    printf("compute: %.3g TFLOP a step (an estimate: the matmuls and attention, recomputed parts "
           "included)\n", flops / 1e12);
    if (traffic == 0) return;
    printf("host <-> device: %s a step, about %.0f ms at %.0f GB/s (a PCIe 4.0 x16 estimate): "
           "hidden behind the compute at best, on a card that sustains at most %.0f TFLOP/s\n",
           lg_format_bytes((size_t)traffic, bytes, sizeof bytes), 1e3 * seconds,
           LG_PCIE_BYTES_PER_S_ESTIMATE / 1e9, flops / seconds / 1e12);
}

/* --plan's last lines: the CUDA runtime's share where it is estimated, the step's costs, and
   whether the run fits. */
static void print_fit(const lg_plan *plan, const lg_fit *fit, const lg_args *a,
                      const char *source) {
    char need[32], have[32], host[32], host_limit[32];
    char parts[320];
    if (a->runtime_estimated)
        printf("cuda.runtime: %s, an estimate for %s (no GPU here to measure it): %s\n",
               lg_format_bytes(a->runtime_bytes, need, sizeof need),
               a->gpu ? a->gpu->label : "the largest of the named cards",
               lg_cuda_runtime_parts_describe(&a->runtime_parts, parts, sizeof parts));
    print_step_costs(plan, a);
    lg_format_bytes(fit->checked_bytes, need, sizeof need);
    if (fit->fits < 0) {
        print_settings("fits: not checked: %s needed, %s\n", need, source);
        return;
    }
    print_settings("fits: %s, %s needed of %s (%s)", fit->fits ? "yes" : "no", need,
           lg_format_bytes(fit->limit, have, sizeof have), source);
    if (fit->margin)
        print_settings(", %s kept free (%s)", lg_format_bytes(fit->margin, have, sizeof have),
               a->memory_margin_given ? "`memory_margin`" : "the default margin");
    if (a->backend != LG_BACKEND_CPU && fit->host_limit)
        printf("; host %s of %s", lg_format_bytes(fit->host_bytes, host, sizeof host),
               lg_format_bytes(fit->host_limit, host_limit, sizeof host_limit));
    printf("\n");
}

/* --plan=json: a stream for the JSON document alone on the real stdout; from here on stdout
   is stderr, so everything else the run prints (by train.c or the library) goes there. */
static FILE *json_output(void) {
    fflush(stdout);
    int fd = dup(STDOUT_FILENO);
    FILE *json = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!json || dup2(STDERR_FILENO, STDOUT_FILENO) < 0) {
        char marked[256], message[256];
        snprintf(marked, sizeof marked, "`plan_only`=json: %s", strerror(errno));
        stop(1, spell_flags(marked, message, sizeof message), "");
    }
    return json;
}

/* --plan (json: the stream from json_output; planned_for its first line, then the notes on
   the data), and the check that the run fits before anything is allocated. */
static void plan_and_check(int argc, char **argv, const lg_args *a, const run_options *o,
                           const lg_config *cfg, int T, FILE *json, const char *planned_for,
                           const char *notes) {
    lg_plan_spec spec;
    lg_plan plan;
    lg_error err;
    if (a->plan_only) print_settings("%s\n%s", planned_for, notes); /* JSON, SVG: on stderr */
    lg_plan_spec_from_args(&spec, a, T);
    if (lg_plan_make(&plan, cfg, &spec, &err) != 0) die(2, &err);
    const char *source;
    lg_fit fit;
    lg_plan_check_fit(&plan, a, device_limit(a, o, &source), &fit);
    if (a->plan_only) {
        if (a->plan_only == LG_PLAN_JSON || a->plan_only == LG_PLAN_SVG) {
            if (a->plan_only == LG_PLAN_JSON) lg_plan_print_json(&plan, &fit, json);
            else plan_svg(json, &plan, cfg, a, T, fit.limit);
            fclose(json);
        } else {
            print_plan_with_recompute_choice(&plan, a, cfg, T);
        }
        print_fit(&plan, &fit, a, source);
    }
    if (fit.fits == 0) explain_does_not_fit(argc, argv, cfg, a, T, &plan, &fit, source);
    lg_plan_free(&plan);
    if (a->plan_only) stop(0, NULL, NULL); /* (every process has --plan: start_processes) */
}

/* --- -c NAME: where configs are found --------------------------------------------------------- */

#define CONFIG_DIRS 8 /* ./configs, beside the executable, and LITGPT_CONFIGS' entries */

/* The directories -c NAME looks in, in order: ./configs, configs/ beside the executable
   (/proc/self/exe's directory), then each directory of $LITGPT_CONFIGS (colon-separated).
   Returns how many. */
static int config_dirs(char dirs[CONFIG_DIRS][1024]) {
    int n = 0;
    snprintf(dirs[n++], 1024, "./configs");
    char exe[1024];
    ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (len > 0) {
        exe[len] = '\0';
        char *slash = strrchr(exe, '/');
        if (slash) *slash = '\0';
        snprintf(dirs[n++], 1024, "%.1000s/configs", exe);
    }
    const char *env = getenv("LITGPT_CONFIGS");
    for (const char *at = env; at && *at && n < CONFIG_DIRS;) {
        size_t len = strcspn(at, ":");
        if (len > 0) snprintf(dirs[n++], 1024, "%.*s", (int)len, at);
        at += len + (at[len] == ':');
    }
    return n;
}

/* Edit distance (Levenshtein), ignoring the case of ASCII letters; names up to 127 bytes. */
static int edit_distance(const char *a, const char *b) {
    int row[128], n = (int)strlen(b);
    if (n > 127 || strlen(a) > 127) return 1000;
    for (int j = 0; j <= n; j++) row[j] = j;
    for (int i = 1; a[i - 1]; i++) {
        int diagonal = row[0];
        row[0] = i;
        for (int j = 1; j <= n; j++) {
            int same = tolower((unsigned char)a[i - 1]) == tolower((unsigned char)b[j - 1]);
            int best = diagonal + !same, up = row[j] + 1, left = row[j - 1] + 1;
            if (up < best) best = up;
            if (left < best) best = left;
            diagonal = row[j];
            row[j] = best;
        }
    }
    return row[n];
}

/* Up to 4 config names in dirs close to name (an edit distance of at most a third of its
   length, 2 at least), nearest first, into out ("A, B"); all of them when none is close.
   Returns whether any is close. */
static int close_config_names(const char *name, char dirs[CONFIG_DIRS][1024], int n_dirs,
                               char *out, size_t cap) {
    char names[64][128];
    int distance[64], n = 0, close = 2 > (int)strlen(name) / 3 ? 2 : (int)strlen(name) / 3;
    for (int d = 0; d < n_dirs; d++) {
        DIR *dir = opendir(dirs[d]);
        for (struct dirent *e = dir ? readdir(dir) : NULL; e && n < 64; e = readdir(dir)) {
            size_t len = strlen(e->d_name);
            if (len < 6 || len > 127 || strcmp(e->d_name + len - 5, ".yaml") != 0) continue;
            snprintf(names[n], sizeof names[n], "%.*s", (int)(len - 5), e->d_name);
            int seen = 0;
            for (int k = 0; k < n; k++) seen |= strcmp(names[k], names[n]) == 0;
            if (!seen) distance[n] = edit_distance(name, names[n]), n++;
        }
        if (dir) closedir(dir);
    }
    int any_close = 0;
    for (int k = 0; k < n; k++) any_close |= distance[k] <= close;
    for (int k = 0; k < n && !any_close; k++) distance[k] = 0; /* all of them, by name */
    out[0] = '\0';
    for (int shown = 0; shown < (any_close ? 4 : n); shown++) {
        int best = -1;
        for (int k = 0; k < n; k++)
            if (distance[k] >= 0 && (!any_close || distance[k] <= close) &&
                (best < 0 || distance[k] < distance[best] ||
                 (distance[k] == distance[best] && strcmp(names[k], names[best]) < 0)))
                best = k;
        if (best < 0) break;
        snprintf(out + strlen(out), cap - strlen(out), "%s%s", shown ? ", " : "", names[best]);
        distance[best] = -1;
    }
    return any_close;
}

/* -c NAME|PATH: a file at that path, else NAME.yaml in the first of config_dirs that has it;
   an unknown name stops naming the places looked in and the names close to it. */
static void find_config(const char *name, char *path, size_t cap) {
    struct stat st;
    if (stat(name, &st) == 0 && S_ISREG(st.st_mode)) {
        snprintf(path, cap, "%s", name);
        return;
    }
    char dirs[CONFIG_DIRS][1024];
    int n = config_dirs(dirs);
    for (int d = 0; d < n; d++) {
        if (snprintf(path, cap, "%s/%s.yaml", dirs[d], name) >= (int)cap) continue;
        if (stat(path, &st) == 0) return;
    }
    char looked[2048] = "", names[1024];
    for (int d = 0; d < n; d++)
        snprintf(looked + strlen(looked), sizeof looked - strlen(looked), "%s%s", d ? ", " : "",
                 dirs[d]);
    int close = close_config_names(name, dirs, n, names, sizeof names);
    die_usage_settings("`config` %s: no such file, and no %s.yaml in %s%s; %s%s%s", name, name, looked,
              getenv("LITGPT_CONFIGS") ? "" : " (nor LITGPT_CONFIGS: not set)",
              close ? "did you mean " : names[0] ? "the configs there: " : "no configs there",
              names, close ? "?" : "");
}

/* --resume DIR: the run's settings from its checkpoint's LG_RUN_SETTINGS, the command line's
   flags over them where they do not change the trained model (refused, naming the flag, where
   they would); a LoRA run's frozen base from where the run loaded it unless --load points
   elsewhere. saved keeps the settings' strings. */
/* The run's options as dir's LG_RUN_SETTINGS has them (an option it has no line for keeps the
   default); a value that is not a number, or out of its range, stops the run naming it. */
static void saved_options(run_options *o, const lg_run_settings *saved, const char *dir) {
    lg_error err;
    options_default(o);
    for (int i = 0; i < OPTION_COUNT; i++) {
        const char *key = option_fields[i].key, *text = lg_run_settings_driver(saved, key);
        if (!text) continue;
        if (option_parse(o, i, text) != 0) {
            snprintf(err.msg, sizeof err.msg, "%s/%s: %s '%s' is not a number", dir,
                     LG_RUN_SETTINGS, key, text);
            die(2, &err);
        }
        char why[160];
        if (option_out_of_range(o, i, why, sizeof why)) {
            snprintf(err.msg, sizeof err.msg, "%s/%s: %s", dir, LG_RUN_SETTINGS, why);
            die(2, &err);
        }
    }
}

static void resume_settings(int argc, char **argv, lg_args *a, run_options *o, given_flags *given,
                            checkpoint_flags *ck, output_flags *out, lg_run_settings *saved) {
    lg_error err;
    char name[64];
    if (lg_checkpoint_find(ck->resume, ck->resume_dir, sizeof ck->resume_dir, &err) != 0) die(2, &err);
    int rc = lg_run_settings_read(ck->resume_dir, saved, &err);
    if (rc < 0) die(2, &err);
    if (rc == 1) {
        printf("resume: %s has no %s (an older checkpoint): the settings are the command "
               "line's\n", ck->resume_dir, LG_RUN_SETTINGS);
        if (ck->load) die_usage_settings("`load` and `resume`: a resumed run already has its weights");
        return;
    }
    lg_args now = saved->args;
    now.backend = lg_backend_in_use();
    saved_options(o, saved, ck->resume_dir);
    apply_flags(argc, argv, &now, o, given, ck, out);
    if (given->lr && !given->min_lr) now.min_lr = now.lr / 10; /* as on a fresh command line */
    const char *key = lg_args_resume_conflict(&saved->args, &now);
    if (key)
        die_usage_settings("`resume` %s: %s differs from the run's (%s/%s): it would train another "
                  "model than the checkpoint's; drop it to resume with the run's", ck->resume_dir,
                  setting_flag(key, name, sizeof name), ck->resume_dir, LG_RUN_SETTINGS);
    if (ck->load && now.lora.r == 0)
        die_usage_settings("`load` and `resume`: a resumed run already has its weights (only a LoRA "
                  "run's `load`, its frozen base, may point elsewhere)");
    if (now.lora.r > 0 && !ck->load && saved->base_loaded) ck->load = saved->base_dir;
    *a = now;
}

/* -c NAME: a file at NAME, else NAME.yaml in ./configs, beside the executable or under
   LITGPT_CONFIGS (find_config). */
static void load_config_file(const char *config, lg_config *cfg) {
    lg_error err;
    char path[LG_PATH_MAX];
    find_config(config, path, sizeof path);
    if (lg_config_load(cfg, path, &err) != 0) die(2, &err);
}

/* -c with --resume: the checkpoint's model by name and shape (what print_resolved_config
   shows; config.json does not carry every field of a LitGPT config). */
static int same_model(const lg_config *x, const lg_config *y) {
    return strcmp(x->name, y->name) == 0 && x->n_layer == y->n_layer && x->n_head == y->n_head &&
           x->n_query_groups == y->n_query_groups && x->n_embd == y->n_embd &&
           x->head_size == y->head_size && x->intermediate_size == y->intermediate_size &&
           x->block_size == y->block_size && x->padded_vocab_size == y->padded_vocab_size;
}

/* -c NAME (load_config_file); --load or --resume: the directory's config.json (with -c given,
   a resumed run's must be the same model); none: the built-in model. */
static void load_config(run_options *o, lg_config *cfg, checkpoint_flags *ck, int config_given) {
    lg_error err;
    const char *dir = ck->resume ? ck->resume_dir : ck->load;
    if (dir) {
        if (lg_hf_config_read(cfg, dir, &err) != 0) die(2, &err);
        if (ck->resume && config_given) {
            lg_config named;
            load_config_file(o->config, &named);
            if (!same_model(&named, cfg))
                die_usage_settings("`config` %s: the checkpoint %s holds another model (%s); drop "
                                   "`config` to resume it", o->config, dir, cfg->name);
        }
        o->config = dir; /* the model now has a config: --data may follow */
        return;
    }
    if (!o->config) { lg_config_builtin(cfg); return; }
    load_config_file(o->config, cfg);
}

typedef struct {
    lg_loader train, val;
    int has_train;  /* 0: evaluation alone (--val-data without --data) */
    int has_val;
    int builtin;  /* the built-in task: character tokens */
    char length_from[96]; /* where the run's T came from, for the plan's first line */
    int sample_vocab; /* the ids samples draw from (lg_gen_vocab: the tokenizer's ids where the
                         model's rows pass them) */
    char note[768]; /* what the data say (lengths, vocabulary), printed after the plan's first
                       line, or first of all for a run */
} run_data;

/* d->length_from: words (a format) with %s where -t's flag goes ("%s; no `data`"). */
static void set_length_from(run_data *d, const char *words) {
    char t[16];
    snprintf(d->length_from, sizeof d->length_from, words,
             flag_of_setting("max_seq_length", 1, NULL, t, sizeof t));
}

/* The built-in task is a fine-tuning set: samples of 4 to 18 characters, prompts masked. */
#define BUILTIN_TRAIN_SAMPLES 20000
#define BUILTIN_VAL_SAMPLES 1000
#define BUILTIN_TRAIN_SEED 1
#define BUILTIN_VAL_SEED 2

/* Rows of T tokens (shard windows, or -t planned as asked) must fit the model. */
static void check_block_size(int T, const lg_config *cfg) {
    if (T > cfg->block_size)
        die_usage_settings("`max_seq_length` %d exceeds the model's block_size %d", T, cfg->block_size);
}

/* Fine-tuning samples, LitGPT's rule: -t is a cap, the rows are min(longest sample, -t) long
   (*T: the longest truncated sample of train and validation); only a sample still longer than
   the model's block_size after truncation is an error. */
/* --pack: rows of -t tokens (the longest sample without -t), and what packing gains. */
static void note_packing(const lg_args *a, int *T, run_data *d) {
    if (a->max_seq_length > *T) *T = a->max_seq_length;
    lg_packing_stats st;
    lg_loader_packing_stats(&d->train, a->micro_batch_size, *T, &st);
    size_t used = strlen(d->note);
    snprintf(d->note + used, sizeof d->note - used, "`pack`: rows of %d tokens hold %.2f samples "
             "on average; padding %.1f%% of the tokens packed, %.1f%% one sample a row (`micro_batch_size %d`)\n",
             *T, st.samples_per_row, 100 * st.padding_packed, 100 * st.padding_unpacked,
             a->micro_batch_size);
    set_length_from(d, a->max_seq_length ? "%s, the packed rows" : "`pack`: the longest sample");
}

/* Samples of which none keeps a trained target at its truncation (every one cut off by -t or
   lying in a masked prompt) would run steps of loss 0 that change nothing: refused before step
   1, naming -t and the data (what: "--data FILE"). */
static void check_trained(const lg_args *a, const lg_loader *ld, const char *what) {
    int shortest = lg_loader_shortest_trained(ld);
    lg_error err;
    if (shortest && shortest <= ld->T) return;
    if (!shortest)
        lg_fail(&err, "%s: no sample has a trained token (every target lies in a masked prompt): "
                      "nothing to learn or evaluate", what);
    else
        lg_fail(&err, "`max_seq_length` %d: no sample of %s has a trained token in its first "
                      "%d tokens (every target there lies in a masked prompt): nothing to learn "
                      "or evaluate; `max_seq_length %d` is the shortest that keeps one", a->max_seq_length,
                what, ld->T, shortest);
    die(2, &err);
}

/* check_trained on the train and validation samples. */
static void check_trained_data(const lg_args *a, const run_options *o, const run_data *d) {
    char what[600];
    if (d->has_train) {
        if (d->builtin) snprintf(what, sizeof what, "the built-in task");
        else snprintf(what, sizeof what, "`data` %s", o->data);
        check_trained(a, &d->train, what);
    }
    if (d->has_val) {
        if (d->builtin) snprintf(what, sizeof what, "the built-in task's validation set");
        else snprintf(what, sizeof what, "`val_data` %s", o->val_data);
        check_trained(a, &d->val, what);
    }
}

static void fit_samples(const lg_args *a, const run_options *o, const lg_config *cfg, int *T,
                        run_data *d) {
    lg_error err;
    if ((d->has_train && lg_loader_check_block_size(&d->train, cfg->block_size, &err) != 0) ||
        (d->has_val && lg_loader_check_block_size(&d->val, cfg->block_size, &err) != 0))
        die(2, &err);
    check_trained_data(a, o, d);
    *T = d->has_train ? lg_loader_longest(&d->train) : 0;
    if (d->has_val && lg_loader_longest(&d->val) > *T) *T = lg_loader_longest(&d->val);
    char cap[64] = "";
    if (a->max_seq_length)
        snprintf(cap, sizeof cap, " (`max_seq_length %d` caps them)", a->max_seq_length);
    size_t used = strlen(d->note);
    snprintf(d->note + used, sizeof d->note - used, "%s: %zu (validation %zu), the longest %d "
             "tokens%s: micro-batches are padded to their longest sample, at most %d\n",
             d->builtin ? "the built-in task (sort the letters), fine-tuning samples"
                        : "fine-tuning samples", d->train.n_samples, d->val.n_samples, *T, cap, *T);
    set_length_from(d, a->max_seq_length && *T == a->max_seq_length ? "%s, the cap of the samples"
                       : d->builtin ? "the built-in task's longest sample"
                                    : "the data's longest sample");
    if (a->pack) note_packing(a, T, d);
}

/* Token ids below padded_vocab_size are the model's, as in LitGPT (Llama 3's configs say
   vocab_size 128000, and its tokenizer's BOS is 128000): when the data holds one at or past
   vocab_size, the loss covers every row up to padded_vocab_size, and the run says so. */
static void widen_vocabulary(lg_config *cfg, run_data *d) {
    uint32_t largest = d->train.max_token > d->val.max_token ? d->train.max_token
                                                             : d->val.max_token;
    if (largest < (uint32_t)cfg->vocab_size) return;
    size_t used = strlen(d->note);
    snprintf(d->note + used, sizeof d->note - used, "vocabulary: the data holds token %u, past "
             "vocab_size %d: the loss covers all %d rows of padded_vocab_size (as LitGPT's "
             "does)\n", largest, cfg->vocab_size, cfg->padded_vocab_size);
    cfg->vocab_size = cfg->padded_vocab_size;
}

/* Opens the data; for fine-tuning samples *T becomes the longest (truncated) sample. Without
   --data but with --val-data (and --max-steps 0) only the validation data: evaluation alone.
   A plan of a model (-c or --load) without data is a plan of windows of text, -t or
   block_size long: the built-in task's lengths are for a run on it. */
static void open_data(const lg_args *a, const run_options *o, lg_config *cfg, int *T,
                      run_data *d) {
    lg_error err;
    memset(d, 0, sizeof *d);
    set_length_from(d, a->max_seq_length ? "%s" : "block_size");
    if (!o->data && !o->val_data && a->plan_only && o->config) {
        check_block_size(*T, cfg);
        set_length_from(d, a->max_seq_length ? "%s; no `data`" : "block_size; neither `data` nor %s");
        return;
    }
    if (!o->data && !o->val_data) {
        if (cfg->vocab_size < LG_CHAR_VOCAB)
            die_usage_settings("`config` %s: vocab_size %d is smaller than the built-in task's %d "
                      "characters; give `data`", o->config, cfg->vocab_size, LG_CHAR_VOCAB);
        if (lg_builtin_task_samples(&d->train, BUILTIN_TRAIN_SEED, BUILTIN_TRAIN_SAMPLES,
                                    a->max_seq_length, 1, a->seed, &err) ||
            lg_builtin_task_samples(&d->val, BUILTIN_VAL_SEED, BUILTIN_VAL_SAMPLES,
                                    a->max_seq_length, 0, 0, &err))
            die(2, &err);
        d->has_train = d->has_val = d->builtin = 1;
        fit_samples(a, o, cfg, T, d);
        if (o->config && a->max_seq_length > *T) { /* a real model on the toy task */
            *T = a->max_seq_length;
            check_block_size(*T, cfg);
            size_t used = strlen(d->note);
            snprintf(d->note + used, sizeof d->note - used, "`max_seq_length %d`: planned and allocated as "
                     "asked, though the built-in task's samples are shorter (`data` for your "
                     "own)\n", *T);
            set_length_from(d, "%s");
        }
        return;
    }
    if (!o->config)
        die_usage_settings("%s needs `config`: the built-in model knows only the built-in task's "
                  "%d characters", o->data ? "`data`" : "`val_data`", LG_CHAR_VOCAB);
    int samples = lg_samples_file(o->data ? o->data : o->val_data);
    if (o->data && o->val_data && lg_samples_file(o->val_data) != samples)
        die_usage_settings("`data` %s and `val_data` %s: one is a token shard, the other fine-tuning "
                  "samples", o->data, o->val_data);
    if (!samples) check_block_size(*T, cfg); /* a shard's windows are -t long */
    if (!samples && a->pack)
        die_usage_settings("`pack` packs fine-tuning samples (tools/prepare alpaca or chat); %s is a "
                  "token shard, already full rows", o->data ? o->data : o->val_data);
    int t = samples ? a->max_seq_length : *T; /* samples: truncation, 0 for none */
    if (o->data) {
        if (lg_loader_open(&d->train, o->data, t, cfg->padded_vocab_size, 1, a->seed, &err) != 0)
            die(2, &err);
        d->has_train = 1;
    }
    if (o->val_data) {
        if (lg_loader_open(&d->val, o->val_data, t, cfg->padded_vocab_size, 0, 0, &err) != 0)
            die(2, &err);
        d->has_val = 1;
    }
    widen_vocabulary(cfg, d);
    if (samples) fit_samples(a, o, cfg, T, d);
}

/* "80.00 GiB (--memory-limit)", and on a GPU with a known host limit " and 23.03 GiB of host
   memory (available host memory)": what -t auto chose within, the fit check's figures. */
static void describe_limits(const lg_args *a, size_t limit, const char *source, char *out,
                            size_t cap) {
    char device[32], host[32];
    size_t host_limit = lg_args_host_limit(a);
    snprintf(out, cap, "%s (%s)", lg_format_bytes(limit, device, sizeof device), source);
    if (a->backend == LG_BACKEND_CPU || !host_limit) return;
    size_t used = strlen(out);
    snprintf(out + used, cap - used, " and %s of host memory (%s)",
             lg_format_bytes(host_limit, host, sizeof host),
             a->host_memory_limit ? "`host_memory_limit`" : "available host memory");
}

/* -t auto: the longest sequence that fits, up to block_size (token shards, or a plan without
   data) or the longest sample (fine-tuning); the data are opened again at that length when it
   is shorter. With -b auto too, the length is chosen at -b 1. What it chose goes to the note. */
static void choose_seq_length(lg_args *a, const run_options *o, int micro_batch_auto,
                              lg_config *cfg, int *T, run_data *d) {
    const char *source;
    size_t limit = device_limit(a, o, &source);
    int cap = *T, samples = d->train.n_samples > 0 || d->val.n_samples > 0;
    const char *cap_name = samples ? "the longest sample" : "block_size";
    lg_args probe = *a;
    if (micro_batch_auto) probe.micro_batch_size = 1;
    int t = limit ? lg_plan_auto_seq_length(cfg, &probe, cap, limit) : cap;
    char note[600], within[320];
    describe_limits(a, limit, source, within, sizeof within);
    if (!limit)
        snprintf(note, sizeof note, "`max_seq_length auto`: %d tokens, %s (%s)\n", cap, cap_name, source);
    else if (t == 0)
        snprintf(note, sizeof note, "`max_seq_length auto`: not even 1 token fits in %s\n", within);
    else if (t == cap)
        snprintf(note, sizeof note, "`max_seq_length auto`: %d tokens, %s, which limits it (it fits in %s)\n",
                 t, cap_name, within);
    else
        snprintf(note, sizeof note, "`max_seq_length auto`: %d tokens, the longest up to %s %d that fits in "
                 "%s\n", t, cap_name, cap, within);
    if (t > 0 && t < cap) {
        a->max_seq_length = t;
        lg_loader_close(&d->train);
        lg_loader_close(&d->val);
        *T = t;
        open_data(a, o, cfg, T, d);
    }
    size_t used = strlen(d->note);
    snprintf(d->note + used, sizeof d->note - used, "%s", note);
}

/* The plan's first line: the model (on the built-in task, if so), B, T and where T came from,
   the precision, the devices. */
static void describe_planned_run(const lg_args *a, const lg_config *cfg, int T,
                                 const run_data *d, char *out, size_t cap) {
    char devices[96];
    int ranks = lg_args_ranks(a);
    if (a->backend == LG_BACKEND_CUDA)
        snprintf(devices, sizeof devices, "%d GPU%s", ranks, ranks > 1 ? "s" : "");
    else
        snprintf(devices, sizeof devices, "%d %s on the CPU backend", ranks,
                 ranks > 1 ? "simulated ranks" : "device");
    snprintf(out, cap, "plan for %s%s: `micro_batch_size %d`, T %d tokens (%s) | %s | %s",
             d->builtin ? "the built-in task on " : "", cfg->name, a->micro_batch_size, T,
             d->length_from, lg_precision_name(a->precision), devices);
}

/* The tokens of a prompt, at most cap of them, or exit 2 naming --prompt: letters of the
   built-in task, else token ids below padded_vocab_size separated by spaces or commas. */
static int prompt_tokens(const char *prompt, int builtin, int vocab_size, int *tokens, int cap) {
    int n = 0;
    if (builtin) {
        for (const char *c = prompt; *c; c++) {
            char one[2] = {*c, '\0'};
            if (n == cap) die_usage_settings("`prompt`: %zu characters, longer than `max_seq_length %d`", strlen(prompt), cap);
            if (lg_char_encode(one, tokens + n, 1) != 1)
                die_usage_settings("`prompt` '%s': the built-in task knows only a-z and '='", prompt);
            n++;
        }
    } else {
        for (const char *at = prompt; *at;) {
            char *end;
            long id = strtol(at, &end, 10);
            if (end == at || id < 0 || id >= vocab_size)
                die_usage_settings("`prompt` '%s': expected token ids below %d separated by spaces",
                          prompt, vocab_size);
            if (n == cap) die_usage_settings("`prompt`: more than `max_seq_length %d` tokens", cap);
            tokens[n++] = (int)id;
            at = end;
            while (*at == ' ' || *at == ',') at++;
        }
    }
    if (n == 0) die_usage_settings("`prompt`: empty");
    return n;
}

/* Generates from one prompt and prints it: characters for the built-in task (with the answer
   it should give), token ids otherwise. */
static void print_sample(lg_trainer *tr, const run_options *o, const run_data *d,
                         const char *prompt, lg_rng *rng) {
    const lg_model *m = &tr->ranks[0].model;
    /* a prompt may be longer than the rows (short fine-tuning samples): generation reads the
       last m->T tokens */
    size_t cap = strlen(prompt) + (size_t)m->T;
    int *tokens = (int *)malloc(sizeof(int) * (cap + (size_t)o->sample_tokens));
    if (!tokens) die_out_of_memory("the sample");
    int n = prompt_tokens(prompt, d->builtin, m->cfg.padded_vocab_size, tokens, (int)cap);
    lg_trainer_generate(tr, tokens, n, o->sample_tokens, d->sample_vocab, o->temperature, rng);
    printf("sample: ");
    for (int i = 0; i < n + o->sample_tokens; i++) {
        if (!d->builtin) { printf("%d ", tokens[i]); continue; }
        if (i >= n && tokens[i] == 0) break; /* the built-in task's samples end at a newline */
        putchar(lg_char_decode(tokens[i]));
    }
    const char *equals = d->builtin ? strchr(prompt, '=') : NULL;
    if (equals && equals[1] == '\0') { /* the built-in task: show the right answer */
        char sorted[256];
        int len = (int)(equals - prompt);
        snprintf(sorted, sizeof sorted, "%.*s", len, prompt);
        for (int i = 1; i < len && i < (int)sizeof sorted; i++)
            for (int j = i; j > 0 && sorted[j - 1] > sorted[j]; j--) {
                char c = sorted[j];
                sorted[j] = sorted[j - 1];
                sorted[j - 1] = c;
            }
        printf("   (sorted: %s)", sorted);
    }
    putchar('\n');
    free(tokens);
}

/* --prompt, or for the built-in task a few words, or token 0 for a shard run. */
static void print_samples(lg_trainer *tr, const run_options *o, const run_data *d, lg_rng *rng) {
    static const char *const words[] = {"litgpt=", "memory=", "zebra="};
    if (o->prompt) print_sample(tr, o, d, o->prompt, rng);
    else if (!d->builtin) print_sample(tr, o, d, "0", rng);
    else
        for (int i = 0; i < 3; i++) print_sample(tr, o, d, words[i], rng);
}

/* Progress of the training loop. On a terminal one status line (step/total, loss, tokens/s,
   elapsed, ETA) is rewritten in place after every step; every `interval` steps, on the first
   and the last, and on a skipped step, a full line stays. A file or pipe gets the full lines
   only, and so do processes other than 0. Anything else printed during the loop clears the
   status line first. */
typedef struct {
    int tty;          /* process 0, and stdout and stderr are a terminal (mpirun gives each
                         process a terminal for stdout even when its own goes to a file) */
    int interval;     /* steps between full lines */
    int first_step, max_steps;
    double start_ms;  /* when the loop began */
    int status_shown; /* the status line is on the screen, without its newline */
} progress;

static void progress_start(progress *p, const output_flags *o, int process, int first_step,
                           int max_steps) {
    p->tty = process == 0 && isatty(STDOUT_FILENO) && isatty(STDERR_FILENO);
    p->interval = o->log_interval ? o->log_interval : (max_steps + 19) / 20;
    if (p->interval < 1) p->interval = 1;
    p->first_step = first_step;
    p->max_steps = max_steps;
    p->start_ms = lg_time_ms();
    p->status_shown = 0;
}

/* Before any other line: the status line goes. */
static void progress_clear(progress *p) {
    if (!p->status_shown) return;
    fputs("\r\033[K", stdout);
    p->status_shown = 0;
}

/* "1:05" or "1:02:05" */
static const char *format_duration(double ms, char *out, size_t size) {
    long s = ms > 0 ? (long)(ms / 1000 + 0.5) : 0;
    if (s >= 3600) snprintf(out, size, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
    else snprintf(out, size, "%ld:%02ld", s / 60, s % 60);
    return out;
}

/* After step `done` (1-based) of the loop. */
static void progress_step(progress *p, const lg_trainer *tr, int done, const lg_step_stats *st) {
    double elapsed = lg_time_ms() - p->start_ms;
    int run = done - p->first_step, left = p->max_steps - done;
    char spent[32], eta[32];
    format_duration(elapsed, spent, sizeof spent);
    format_duration(run > 0 ? elapsed / run * left : 0, eta, sizeof eta);
    int full = done % p->interval == 0 || run == 1 || left == 0 || st->skipped;
    if (!full && !p->tty) return;
    progress_clear(p);
    if (!full) { /* the status line, rewritten in place */
        printf("step %5d/%d | loss %.4f | %.0f tok/s | %s elapsed | ETA %s", done, p->max_steps,
               st->loss, st->tokens_per_s, spent, eta);
        fputs("\033[K", stdout);
        fflush(stdout);
        p->status_shown = 1;
        return;
    }
    printf("step %5d/%d | loss %.4f | lr %.2e | grad norm %.3f | %.1f ms | %.0f tok/s | %s "
           "elapsed | ETA %s", done, p->max_steps, st->loss, st->lr, st->grad_norm, st->ms,
           st->tokens_per_s, spent, eta);
    if (st->skipped == LG_SKIPPED_OVERFLOW)
        printf(" | skipped: fp16 gradient overflow, loss scale %g -> %g", st->loss_scale,
               tr->loss_scale);
    if (st->skipped == LG_SKIPPED_NO_TARGETS)
        printf(" | skipped: no trained token in this step's samples");
    if (st->hessian) printf(" | with Sophia's Hessian pass");
    printf("\n");
    fflush(stdout);
}

/* ,"key":value in the log; JSON has no NaN or infinity: null. */
static void log_number(FILE *log, const char *key, const char *format, double value) {
    fprintf(log, ",\"%s\":", key);
    if (isfinite(value)) fprintf(log, format, value);
    else fputs("null", log);
}

/* Ends a log line and pushes it to the file; a failed write stops the run. */
static void log_end(FILE *log, const char *path) {
    fputs("}\n", log);
    errno = 0;
    if (fflush(log) != 0 || ferror(log)) die_write(path);
}

static void evaluate(lg_trainer *tr, run_data *d, const run_options *o, int step, FILE *log,
                     const char *log_path, loss_plot *plot) {
    if (!d->has_val) return;
    double loss = 0;
    lg_error err;
    if (lg_trainer_evaluate(tr, &d->val, o->eval_iters, &loss, &err) != 0) die(2, &err);
    printf("step %5d | val loss %.4f\n", step, loss);
    if (log) {
        fprintf(log, "{\"step\":%d", step);
        log_number(log, "val_loss", "%.6f", loss);
        log_end(log, log_path);
    }
    plot_val(plot, step, loss);
    if (!isfinite(loss)) {
        lg_fail(&err, "validation loss is %s at step %d: the model diverged (try a lower `lr` or "
                      "a `max_norm`)", isnan(loss) ? "NaN" : "infinite", step);
        die(1, &err);
    }
}

/* The JSONL log of every step: the numbers of one step on one line. */
static void log_step(FILE *log, const char *path, int step, const lg_step_stats *st,
                     int scaling) {
    fprintf(log, "{\"step\":%d", step);
    log_number(log, "loss", "%.6f", st->loss);
    log_number(log, "lr", "%.6e", st->lr);
    log_number(log, "grad_norm", "%.6f", st->grad_norm);
    log_number(log, "ms", "%.3f", st->ms);
    log_number(log, "tokens_per_s", "%.1f", st->tokens_per_s);
    if (scaling) log_number(log, "loss_scale", "%g", st->loss_scale);
    if (st->skipped) fprintf(log, ",\"skipped\":true");
    if (st->hessian) fprintf(log, ",\"hessian\":true");
    log_end(log, path);
}

/* --- processes: under a launcher (mpirun, srun, torchrun) ------------------------------------ */

/* A line naming the training data and a hash of it: the tokens when in memory, else the
   file's size and its first and last MiB. */
static void describe_data(const lg_loader *ld, char *out, size_t cap) {
    uint64_t h = LG_HASH64_INIT;
    if (ld->memory) h = lg_hash64(h, ld->memory, ld->n_tokens * sizeof *ld->memory);
    FILE *f = ld->memory ? NULL : fopen(ld->path, "rb");
    if (f) {
        static const long part = 1 << 20;
        unsigned char *buf = (unsigned char *)malloc((size_t)part);
        for (int end = 0; buf && end < 2; end++) {
            if (fseek(f, end ? -part : 0, end ? SEEK_END : SEEK_SET) != 0) rewind(f);
            h = lg_hash64(h, buf, fread(buf, 1, (size_t)part, f));
        }
        free(buf);
        fclose(f);
    }
    snprintf(out, cap, "data %s: %zu tokens, hash %016llx", ld->path, ld->n_tokens,
             (unsigned long long)h);
}

/* A count of parameters as people read it: "124.44M", "294.9K", "8.03B", "768". */
static const char *format_count(size_t n, char *out, size_t cap) {
    if (n >= 1000000000) snprintf(out, cap, "%.2fB", n / 1e9);
    else if (n >= 1000000) snprintf(out, cap, "%.2fM", n / 1e6);
    else if (n >= 1000) snprintf(out, cap, "%.1fK", n / 1e3);
    else snprintf(out, cap, "%zu", n);
    return out;
}

/* "124.44M parameters, all trainable", or under LoRA "124.73M parameters: 294.9K trainable
   (LoRA r 8 on q,v), 124.44M frozen (QLoRA: linear weights in nf4-dq)". */
static void describe_parameters(const lg_model *model, char *out, size_t cap) {
    const lg_config *c = &model->cfg;
    char all[32], trainable[32], fixed[32];
    if (c->lora.r == 0) {
        snprintf(out, cap, "%s parameters, all trainable",
                 format_count(model->n_params, all, sizeof all));
        return;
    }
    lg_config base = lg_config_base(c);
    size_t frozen = lg_params_layout(&base, lg_no_buf(), NULL, NULL);
    char targets[64], storage[64] = "";
    if (c->lora.quantize != LG_QUANTIZE_NONE)
        snprintf(storage, sizeof storage, " (QLoRA: linear weights in %s)",
                 lg_quantization_name(c->lora.quantize));
    snprintf(out, cap, "%s parameters: %s trainable (LoRA r %d on %s), %s frozen%s",
             format_count(model->n_params + frozen, all, sizeof all),
             format_count(model->n_params, trainable, sizeof trainable), c->lora.r,
             lg_lora_targets_name(c->lora.targets, targets, sizeof targets),
             format_count(frozen, fixed, sizeof fixed), storage);
}

/* Every process has the same flags (each with its value: "--lr 0.01") and, given data, the
   same data; else every one stops naming the first difference. */
static void check_same_run(const lg_launch *launch, int argc, char **argv, const run_data *data) {
    enum { MOST_ITEMS = 256, ITEM_BYTES = 700 };
    lg_error err;
    char (*text)[ITEM_BYTES] = (char (*)[ITEM_BYTES])calloc(MOST_ITEMS, ITEM_BYTES);
    const char *items[MOST_ITEMS];
    int n = 0;
    if (!text) die_usage("out of host memory");
    for (int i = 1; i < argc && n < MOST_ITEMS - 1; i++) {
        int value_of_flag = n > 0 && argv[i][0] != '-' && argv[i - 1][0] == '-' &&
                            !strchr(argv[i - 1], '=');
        if (value_of_flag) snprintf(text[n - 1], ITEM_BYTES, "%s %s", argv[i - 1], argv[i]);
        else snprintf(text[n++], ITEM_BYTES, "%s", argv[i]);
    }
    if (data) describe_data(&data->train, text[n++], ITEM_BYTES);
    for (int i = 0; i < n; i++) items[i] = text[i];
    if (lg_launch_same(launch, items, n, &err) != 0) die(2, &err);
    free(text);
}

/* Several processes, before any flag is read: join MPI, and under MPI compare the flags at
   once, so that no process ends alone (--help, --plan, a bad flag given to one) while the
   others wait for it. A process that ends before MPI starts is seen by the others' watchdog
   (lg_launch_start: --dist-timeout). Without MPI the flags are compared with the data, the
   others waiting at most --dist-timeout for a process that ended. */
static void start_processes(lg_launch *launch, int argc, char **argv) {
    lg_error err;
    if (launch->processes == 1) return;
    if (lg_launch_start(launch, &err) != 0) die(2, &err);
    if (launch->mpi) check_same_run(launch, argc, argv, NULL);
}

/* Test-only (tests/test_processes.c): LG_TEST_HANG=P:S makes process P sleep for an hour
   before step S, a hung process for the --dist-timeout check. */
static void hang_if_testing(const lg_launch *launch, int step) {
    const char *hang = getenv("LG_TEST_HANG");
    int process = -1, at = -1;
    if (!hang || sscanf(hang, "%d:%d", &process, &at) != 2) return;
    if (process == launch->process && at == step) sleep(3600);
}

/* What a run is, settled before anything is allocated: the flags (and a resumed run's
   settings), the model, the data, the GPUs, and a plan that fits (--plan prints it and exits). */
typedef struct {
    int argc;   /* the command line, the process flags taken out (take_process_flags) */
    char **argv;
    lg_args a;
    run_options o;    /* what only the driver reads */
    given_flags given;
    checkpoint_flags ck;
    output_flags output;
    lg_launch launch; /* under a launcher: which process this is, and which ranks it drives */
    FILE *plan_json;  /* --plan=json or svg: the real stdout, the document's alone */
    lg_config cfg;
    int T;
    run_data data;
} run_setup;

/* Stage 1, parse: argv to the run's settings (a resumed run's, the flags given over them),
   the processes met; or an exit (usage 2, --help 0). */
static void parse_run(int argc, char **argv, run_setup *rs) {
    static lg_run_settings saved; /* --resume: the run's settings (its strings live here) */
    lg_args *a = &rs->a;
    lg_error err;
    if (lg_launch_from_env(&rs->launch, &err) != 0) die_usage_error(&err);
    rs->launch.speller = flag_of_setting; /* the lines a process stopping on a deadline prints */
    rs->argc = argc = take_process_flags(argc, argv, &rs->launch);
    rs->argv = argv;
    if (rs->launch.process != 0 && !freopen("/dev/null", "w", stdout)) /* process 0 prints */
        die_usage("cannot silence stdout");
    start_processes(&rs->launch, argc, argv);
    parse_args(argc, argv, a, &rs->o, &rs->given, &rs->ck, &rs->output);
    if (lg_launch_place(&rs->launch, a->devices, a->nodes, &err) != 0) die_usage_error(&err);
    a->processes = rs->launch.processes; /* the plan counts MPI's buffers */
    int alone = a->plan_only == LG_PLAN_JSON || a->plan_only == LG_PLAN_SVG;
    rs->plan_json = alone ? json_output() : NULL; /* (JSON or SVG alone on stdout) */
    float beta1, beta2; /* the optimizer's own betas, unless given */
    lg_optimizer_default_betas(a->optimizer, &beta1, &beta2);
    if (!rs->given.beta1) a->beta1 = beta1;
    if (!rs->given.beta2) a->beta2 = beta2;
    if (!rs->given.min_lr) a->min_lr = a->lr / 10; /* the final rate follows --lr */
    if (rs->ck.resume)
        resume_settings(argc, argv, a, &rs->o, &rs->given, &rs->ck, &rs->output, &saved);
    check_flags(a, &rs->o, &rs->given, &rs->ck);
    a->driver_value = option_value; /* the options' lines of a checkpoint's settings */
    a->driver_context = &rs->o;
}

/* Stage 2, plan: the model, the data, the GPUs, the sizes left to choose (auto), and a plan
   that fits; or an exit (--plan 0 or 3, no fit 3, a bad file 2). */
static void plan_run(run_setup *rs) {
    lg_args *a = &rs->a;
    lg_error err;
    load_config(&rs->o, &rs->cfg, &rs->ck, rs->given.config);
    rs->T = a->max_seq_length ? a->max_seq_length : rs->cfg.block_size;
    open_data(a, &rs->o, &rs->cfg, &rs->T, &rs->data); /* samples: T is the longest one */
    a->finetuning = !rs->o.data || lg_samples_file(rs->o.data); /* LoRA is a remedy (--plan) */
    prepare_gpus(a, rs->launch.processes > 1);
    a->host_available = lg_host_available_bytes(); /* once: the choices and the check agree */
    char *note = rs->data.note;
    const given_flags *given = &rs->given;
    if (given->max_seq_length_auto)
        choose_seq_length(a, &rs->o, given->micro_batch_auto, &rs->cfg, &rs->T, &rs->data);
    if (given->micro_batch_auto)
        choose_micro_batch(a, &rs->o, &rs->cfg, rs->T, note, sizeof rs->data.note);
    if (!a->head_rows || !a->slice_rows)
        choose_rows(a, &rs->o, &rs->cfg, rs->T, note, sizeof rs->data.note);
    choose_embedding(a, &rs->o, &rs->cfg, rs->T, note, sizeof rs->data.note);
    if (lg_args_check(a, &err) != 0) die_usage_error(&err);
    char planned_for[512];
    describe_planned_run(a, &rs->cfg, rs->T, &rs->data, planned_for, sizeof planned_for);
    if (!a->plan_only) print_settings("%s", note); /* a run: first what the data are */
    plan_and_check(rs->argc, rs->argv, a, &rs->o, &rs->cfg, rs->T, rs->plan_json, planned_for,
                   note);
    if (rs->launch.processes > 1) check_same_run(&rs->launch, rs->argc, rs->argv, &rs->data);
}

/* Stage 2 too: what could stop the run later stops it now (a bad prompt, an --out, --log or --plot
   that cannot be written); returns the --log file (NULL without one). */
static FILE *check_outputs(const run_setup *rs) {
    const run_options *o = &rs->o;
    FILE *log = NULL;
    int first = rs->launch.process == 0;
    const char *log_path = rs->output.log_path;
    char name[64]; /* a flag's names, for probe_writable */
    if (log_path && first && !(log = fopen(log_path, "w")))
        die_usage_settings("`log_path` %s: cannot create: %s", log_path, strerror(errno));
    if (o->prompt) {
        int *scratch = (int *)malloc(sizeof(int) * (size_t)rs->T);
        prompt_tokens(o->prompt, rs->data.builtin, rs->cfg.padded_vocab_size, scratch, rs->T);
        free(scratch);
    }
    if (o->out_dir && mkdir(o->out_dir, 0755) != 0 && errno != EEXIST)
        die_usage_settings("`out_dir` %s: cannot create the directory: %s", o->out_dir, strerror(errno));
    if (o->out_dir && first) {
        char probe[LG_PATH_MAX];
        snprintf(probe, sizeof probe, "%s/.probe", o->out_dir);
        probe_writable(setting_flag("out_dir", name, sizeof name), probe);
    }
    if (rs->output.plot && first) probe_writable(setting_flag("plot", name, sizeof name), rs->output.plot);
    return log;
}

/* Stage 3's header: the model, the batch, where the ranks run, the optimizer, the precision. */
static void describe_run(const lg_trainer *tr, const run_setup *rs) {
    const lg_args *a = &rs->a;
    const lg_model *model = &tr->ranks[0].model;
    int threads = 1, accumulation = tr->accumulation, B = a->micro_batch_size;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    const lg_loader *source = rs->data.has_train ? &rs->data.train : &rs->data.val;
    char params[192], where[64];
    describe_parameters(model, params, sizeof params);
    printf("model %s: %d layers, %s | %s %s (%zu tokens)\n", rs->cfg.name, rs->cfg.n_layer,
           params, rs->data.has_train ? "data" : "validation data", source->path,
           source->n_tokens);
    if (a->backend == LG_BACKEND_CUDA)
        snprintf(where, sizeof where, "%d GPU%s", tr->n_ranks, tr->n_ranks > 1 ? "s" : "");
    else snprintf(where, sizeof where, "CPU, %d threads, %s matmuls", threads,
                  lg_gemm_path_name(model->exec.gemm.path));
    print_settings("batch: `micro_batch_size %d` x %d accumulation x %d rank%s = %d samples of %d tokens a step | %s | "
           "%s\n", B, accumulation, tr->n_ranks, tr->n_ranks > 1 ? "s" : "",
           B * accumulation * tr->n_ranks, rs->T, where, lg_optimizer_name(a->optimizer));
    if (tr->n_ranks > 1)
        printf("ranks: %d device%s x %d node%s, %s%s\n", a->devices, a->devices > 1 ? "s" : "",
               a->nodes, a->nodes > 1 ? "s" : "", lg_strategy_name(a->strategy),
               a->backend == LG_BACKEND_CUDA ? ", one GPU each, NCCL from this process"
               : rs->launch.processes > 1    ? "; on the CPU backend, MPI between processes"
                                             : "; on the CPU backend simulated in this process");
    if (rs->launch.processes > 1)
        printf("processes: %d started by %s, %d rank%s each\n", rs->launch.processes,
               rs->launch.launcher, rs->launch.local_ranks, rs->launch.local_ranks > 1 ? "s" : "");
    if (a->optimizer == LG_OPTIMIZER_LION)
        print_settings("lion: wants a learning rate 3-10x smaller and a weight decay 3-10x larger than "
               "AdamW (here `lr` %g, `weight_decay` %g, betas %g %g)\n", a->lr, a->weight_decay,
               a->beta1, a->beta2);
    if (rs->given.precision)
        printf("precision: %s\n", lg_precision_name(a->precision));
    else
        print_settings("precision: %s (the default: bf16 weights and activations, fp32 accumulation "
               "and master weights; `precision 32-true` for full fp32)\n", lg_precision_name(a->precision));
}

/* The ids samples draw from: lg_gen_vocab with the tokenizer of tr's tokenizer_dir, if any. */
static int sample_vocab(const lg_trainer *tr) {
    const lg_config *cfg = &tr->ranks[0].model.cfg;
    lg_tokenizer tok;
    lg_error err;
    if (!tr->tokenizer_dir[0] || lg_tokenizer_load(&tok, tr->tokenizer_dir, &err) != 0)
        return lg_gen_vocab(cfg, NULL);
    int vocab = lg_gen_vocab(cfg, &tok);
    lg_tokenizer_free(&tok);
    return vocab;
}

/* Data made with another tokenizer than the one --load's directory holds is refused (its ids
   would mean other text to the model); a directory without a tokenizer, or data that records
   none (older files), passes. */
static void check_data_tokenizer(const char *load, const run_data *d) {
    lg_tokenizer tok;
    lg_error err;
    if (lg_tokenizer_load(&tok, load, &err) != 0) return;
    const lg_loader *files[2] = {d->has_train && !d->builtin ? &d->train : NULL,
                                 d->has_val && !d->builtin ? &d->val : NULL};
    for (int f = 0; f < 2; f++)
        if (files[f] && lg_loader_check_tokenizer(files[f], &tok, &err) != 0) {
            lg_tokenizer_free(&tok);
            die_usage_settings("%s; prepare it again with tools/prepare --tokenizer %s, or add "
                               "`any_tokenizer_data` to train on it anyway", err.msg, load);
        }
    lg_tokenizer_free(&tok);
}

/* Stage 3, build: the weights of --load, or a resumed run's whole state; returns the steps
   done. */
static int start_weights(lg_trainer *tr, run_setup *rs) {
    const run_options *o = &rs->o;
    const checkpoint_flags *ck = &rs->ck;
    lg_error err;
    int first_step = 0;
    if ((o->out_dir || ck->resume) && lg_checkpoint_supported(tr, &err) != 0) die(2, &err);
    if (ck->load && lg_trainer_load_hf(tr, ck->load, &err) != 0) die(2, &err);
    if (ck->load) printf("loaded the weights of %s\n", ck->load);
    if (ck->load) /* its tokenizer travels with the checkpoints */
        snprintf(tr->tokenizer_dir, sizeof tr->tokenizer_dir, "%s", ck->load);
    if (ck->resume && rs->data.has_train && !ck->data_changed &&
        lg_checkpoint_same_data(ck->resume_dir, &rs->data.train, &err) != 0)
        die_usage_settings("%s; give `data_changed` to resume on it on purpose", err.msg);
    if (ck->load && !ck->any_tokenizer_data) check_data_tokenizer(ck->load, &rs->data);
    if (ck->resume && lg_checkpoint_resume(tr, &rs->data.train, ck->resume_dir, &first_step, &err) != 0)
        die(2, &err);
    if (ck->resume) print_settings("resumed %s: %d steps done%s%s\n", ck->resume_dir, first_step,
                           o->out_dir ? ", checkpoints to " : "; no `out_dir`: it saves no checkpoint",
                           o->out_dir ? o->out_dir : "");
    if (ck->resume && !ck->load) /* the tokenizer the checkpoint carries goes on */
        snprintf(tr->tokenizer_dir, sizeof tr->tokenizer_dir, "%s", ck->resume_dir);
    rs->data.sample_vocab = sample_vocab(tr);
    return first_step;
}

/* Stage 4, train: the steps, with progress, the log, checkpoints, evaluations and samples
   between them; the final samples after. Returns the step last saved (-1: none). */
static int train_steps(lg_trainer *tr, run_setup *rs, int first_step, FILE *log) {
    lg_args *a = &rs->a;
    lg_error err;
    int saved_step = -1;
    lg_rng sample_rng;
    lg_rng_seed(&sample_rng, a->seed + 1);
    loss_plot plot;
    plot_start(&plot, rs->output.plot, first_step, a->max_steps > first_step ? a->max_steps : first_step);
    const run_options *o = &rs->o;
    evaluate(tr, &rs->data, o, first_step, log, rs->output.log_path, &plot);
    progress shown;
    progress_start(&shown, &rs->output, rs->launch.process, first_step, a->max_steps);
    for (int step = first_step; step < a->max_steps; step++) {
        lg_step_stats st;
        hang_if_testing(&rs->launch, step);
        if (lg_trainer_step(tr, &rs->data.train, step, &st, &err) != 0) {
            size_t used = strlen(err.msg);
            if (st.diverged)
                snprintf(err.msg + used, sizeof err.msg - used, " (try a lower `lr` or a `max_norm`)");
            progress_clear(&shown);
            die(st.out_of_memory ? 3 : 1, &err); /* 3: as a run that does not fit */
        }
        progress_step(&shown, tr, step + 1, &st);
        plot_step(&plot, st.loss, st.lr);
        if (log) log_step(log, rs->output.log_path, step + 1, &st, tr->scaling);
        if (o->save_every && (step + 1) % o->save_every == 0) {
            progress_clear(&shown);
            if (lg_checkpoint_save(tr, &rs->data.train, step + 1, o->out_dir, &err) != 0) die(1, &err);
            printf("saved %s/step-%d\n", o->out_dir, saved_step = step + 1);
        }
        int last = step + 1 == a->max_steps;
        int evaluating = last || (o->eval_every && (step + 1) % o->eval_every == 0);
        int sampling = !last && o->sample_every && (step + 1) % o->sample_every == 0;
        if (evaluating || sampling) progress_clear(&shown);
        if (evaluating) evaluate(tr, &rs->data, o, step + 1, log, rs->output.log_path, &plot);
        if (sampling) print_samples(tr, o, &rs->data, &sample_rng);
    }
    progress_clear(&shown);
    plot_write(&plot);
    plot_free(&plot);
    print_samples(tr, o, &rs->data, &sample_rng);
    return saved_step;
}

/* Stage 5, save: the final checkpoint with --out (unless the last step saved it), and the
   --log file closed. */
static void save_run(lg_trainer *tr, run_setup *rs, int first_step, int saved_step, FILE *log) {
    const lg_args *a = &rs->a;
    const char *out_dir = rs->o.out_dir;
    lg_error err;
    int final_step = first_step > a->max_steps ? first_step : a->max_steps;
    if (out_dir && saved_step != final_step) {
        if (lg_checkpoint_save(tr, &rs->data.train, final_step, out_dir, &err) != 0) die(1, &err);
        printf("saved %s/step-%d\n", out_dir, final_step);
    }
    if (log && fclose(log) != 0) die_write(rs->output.log_path);
}

/* The guided tour, in five stages: parse the command line, plan the run (it fits, or it stops
   before anything is allocated), build the trainer and its weights, train, save. */
int main(int argc, char **argv) {
#ifdef LG_CUDA
    /* before CUDA starts: kernels load when first launched (CUDA's default since 12.2, asked for
       here unless the environment says otherwise), not every cuBLASLt kernel for the card with
       the context (93 to 315 MiB of code); what loads after the runtime is measured is counted
       in it (lg_cuda_lazy_code_bytes) */
    setenv("CUDA_MODULE_LOADING", "LAZY", 0);
#endif
    /* each line reaches a pipe or file when printed (block-buffered, the header waited for
       the first step's flush: minutes on a large model) */
    setvbuf(stdout, NULL, _IOLBF, 0);
    static run_setup rs; /* (large: the data's notes) */
    lg_error err;

    /* 1. parse: the flags, over a resumed run's settings; the processes of a launcher meet */
    parse_run(argc, argv, &rs);

    /* 2. plan: the model, the data, the GPUs, and a memory plan that fits; the outputs can be
       written */
    plan_run(&rs);
    FILE *log = check_outputs(&rs);

    /* 3. build: the trainer (the plan's memory, nothing more), then its weights: fresh, from
       --load, or a resumed run's */
    lg_trainer tr;
    if (lg_trainer_create_in(&tr, &rs.cfg, &rs.a, rs.T, &rs.launch, &err) != 0) die(1, &err);
    describe_run(&tr, &rs);
    int first_step = start_weights(&tr, &rs);

    /* 4. train: the steps, with evaluations, samples and checkpoints between them */
    int saved_step = train_steps(&tr, &rs, first_step, log);

    /* 5. save: the last checkpoint and the log; then everything is handed back */
    save_run(&tr, &rs, first_step, saved_step, log);
    lg_trainer_free(&tr);
    lg_loader_close(&rs.data.train);
    lg_loader_close(&rs.data.val);
    lg_launch_finish(&rs.launch);
    return 0;
}
