/* tests/test_first_hour.c — what a new user meets first (included by tests/test.c): the design
   card's command, configs as LitGPT writes them, machine-readable output, evaluation alone,
   learning-rate defaults, progress on a terminal and on a pipe. */

/* Runs `./train args` with stdout alone into out (stderr to build/stderr.txt); the exit code. */
static int run_stdout(const char *args, char *out, size_t cap) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "./train %s 2>build/stderr.txt", args);
    FILE *p = popen(cmd, "r");
    size_t n = p ? fread(out, 1, cap - 1, p) : 0;
    out[n] = '\0';
    char rest[4096];
    while (p && fread(rest, 1, sizeof rest, p) > 0) continue;
    int status = p ? pclose(p) : -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* Is text exactly one JSON document (the library's reader; nothing before or after)? */
static int one_json_document(const char *text) {
    lg_json j;
    lg_error err;
    size_t len = strlen(text);
    while (len > 0 && isspace((unsigned char)text[len - 1])) len--;
    if (len == 0 || text[0] != '{' || lg_json_parse(&j, text, len, "stdout", &err) != 0) return 0;
    int whole = j.nodes[0].kind == LG_JSON_OBJECT && j.nodes[0].end == len;
    lg_json_free(&j);
    return whole;
}

/* The losses of "step N/M | loss X" lines in out, in order; how many. */
static int step_losses(const char *out, double *losses, int cap) {
    int n = 0;
    for (const char *at = strstr(out, "| loss "); at && n < cap; at = strstr(at + 1, "| loss "))
        losses[n++] = atof(at + strlen("| loss "));
    return n;
}

static void test_design_card_command(results *r) {
    static char out[65536];
    /* the built-in model's block_size is 64: -t 256 caps the samples (LitGPT's rule) */
    int code = run_capture("-b 1 -t 256 -p bf16-true -d 4 --max-steps 20 --log-interval 1", out,
                           sizeof out);
    double losses[32];
    int n = step_losses(out, losses, 32);
    double first = 0, last = 0;
    for (int i = 0; i < 5 && i < n; i++) first += losses[i] / 5;
    for (int i = n - 5; i < n && i >= 0; i++) last += losses[i] / 5;
    check(r, code == 0 && n == 20 && last < first && strstr(out, "-t 256 caps them"),
          "the design card's command (-b 1 -t 256 -p bf16-true -d 4) trains 20 steps: exit %d, "
          "%d steps, mean loss of the first 5 %.3f, of the last 5 %.3f", code, n, first, last);
}

static void test_plan_json_alone(results *r) {
    static const char *configs[] = {"gpt2", "pythia-14m", "pythia-70m", "pythia-160m",
                                    "tiny-llama-1.1b", "Llama-2-7b-hf", "Llama-3.2-1B",
                                    "Meta-Llama-3-8B", "Mistral-7B-v0.1", "Qwen2.5-0.5B",
                                    "SmolLM2-135M", "bench", "test-gpt2", "test-pythia",
                                    "test-llama"};
    static char out[1 << 20];
    int ok = 1;
    char args[256], failed[64] = "";
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++) {
        /* the built-in task: its samples' message goes to stderr */
        /* a limit they all fit in: a plan that does not fit exits 3 (tested elsewhere) */
        snprintf(args, sizeof args, "--plan=json -c %s -t 16 -b 1 --memory-limit 1TiB", configs[i]);
        int one = run_stdout(args, out, sizeof out) == 0 && one_json_document(out);
        if (!one && ok) snprintf(failed, sizeof failed, " (failed: %s)", configs[i]);
        ok = ok && one;
    }
    check(r, ok, "--plan=json writes one JSON document on stdout for each of the %zu shipped "
          "configs, everything else on stderr%s", sizeof configs / sizeof configs[0], failed);
}

/* An evaluation of saved weights needs no training data. */
static void test_evaluation_alone(results *r) {
    static char out[16384];
    uint32_t tokens[101];
    lg_error err;
    for (int i = 0; i < 101; i++) tokens[i] = (uint32_t)(i * 7 % 29); /* test-llama: 30 tokens */
    lg_shard_write("build/u16.bin", tokens, 101, 2, &err);
    lg_shard_write("build/u32.bin", tokens, 101, 4, &err);
    int code = run_capture("-c test-llama --data build/u16.bin -t 10 -b 2 --max-steps 2 "
                           "--eval-every 0 --out build/evaluate", out, sizeof out);
    code = code ? code : run_capture("--load build/evaluate/step-2 --val-data build/u32.bin -t 10 "
                                     "-b 2 --max-steps 0 --eval-iters 2", out, sizeof out);
    check(r, code == 0 && strstr(out, "step     0 | val loss") && !strstr(out, "step     1/"),
          "--load DIR --val-data FILE --max-steps 0: evaluates without --data (exit %d)", code);
    expect_cli(r, "--load build/evaluate/step-2 --val-data build/u32.bin -t 10 -b 2", 2,
               "--val-data without --data evaluates a model alone: give --max-steps 0");
}

static void test_learning_rate_defaults(results *r) {
    /* Lion's advice, a smaller --lr alone: the final rate follows it (--lr / 10) */
    expect_cli(r, "-o lion --lr 3e-4 --max-steps 1 --eval-iters 1", 0, "step     1/1");
    expect_cli(r, "--lr 1e-3 --min-lr 2e-3 --max-steps 1", 2, "--min-lr (0.002) exceeds --lr (0.001)");
    expect_cli(r, "--max-steps -5", 2, "--max-steps -5: a count of steps, must be >= 0");
    expect_cli(r, "--warmup-steps -1", 2, "--warmup-steps -1");
    expect_cli(r, "--eval-every -2", 2, "--eval-every -2");
    /* without --min-lr the schedule is that of --min-lr 1e-3 for --lr 1e-2, not 4e-4's */
    double lr[3][4] = {{0}};
    const char *runs[3] = {"", "--min-lr 1e-3", "--min-lr 4e-4"};
    int code = 0;
    for (int k = 0; k < 3; k++) {
        char cmd[256], line[512];
        snprintf(cmd, sizeof cmd, "./train --lr 1e-2 %s --warmup-steps 0 --max-steps 4 "
                 "--eval-iters 1 --log build/lr.jsonl >/dev/null 2>&1", runs[k]);
        code |= system(cmd);
        FILE *f = fopen("build/lr.jsonl", "r");
        for (int step = 0; f && fgets(line, sizeof line, f);)
            if (strstr(line, "\"lr\":") && step < 4) lr[k][step++] = atof(strstr(line, "\"lr\":") + 5);
        if (f) fclose(f);
    }
    int same = 1; /* to float rounding: --lr / 10 in float and the float nearest 1e-3 */
    for (int s = 0; s < 4; s++) same = same && fabs(lr[0][s] - lr[1][s]) <= 1e-6 * lr[1][s];
    check(r, code == 0 && same && lr[0][3] != lr[2][3] &&
          lr[0][3] > 1e-3, "--min-lr defaults to --lr / 10: the rates of --lr 1e-2 are those of "
          "--min-lr 1e-3 (last %.6g; with 4e-4: %.6g)", lr[0][3], lr[2][3]);
}

/* Loads configs/NAME.yaml and another file; are they the same model? tie_embeddings is this
   trainer's (LitGPT has none; it unties), so it is taken from configs/NAME.yaml; so is the
   name with same_name 0 (LitGPT calls Meta-Llama-3-8B "Llama-3-8B"). */
static int same_config(results *r, const char *name, const char *other_path, int same_name,
                       lg_config *b, lg_error *err) {
    lg_config a;
    if (load_config_or_fail(r, &a, name) != 0) return 0;
    if (lg_config_load(b, other_path, err) != 0) return 0;
    b->tie_embeddings = a.tie_embeddings;
    if (!same_name) memcpy(b->name, a.name, sizeof a.name);
    return memcmp(&a, b, sizeof a) == 0;
}

static void test_litgpt_configs(results *r) {
    /* LitGPT's own model_config.yaml files (tests/make_litgpt_configs.py) */
    static const char *names[] = {"pythia-14m", "pythia-70m", "pythia-160m", "tiny-llama-1.1b",
                                  "Llama-2-7b-hf", "Meta-Llama-3-8B", "Mistral-7B-v0.1",
                                  "Qwen2.5-0.5B", "SmolLM2-135M", "Llama-3.1-8B",
                                  "Llama-3.1-70B", "Llama-2-70b-hf"};
    lg_config b;
    lg_error err = {""};
    char path[256];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(path, sizeof path, "tests/litgpt/%s.yaml", names[i]);
        check(r, same_config(r, names[i], path, 0, &b, &err), "LitGPT's model_config.yaml of %s "
              "loads and equals configs/%s.yaml %s", names[i], names[i], err.msg);
    }
    /* LitGPT's own entries in its config.py: only what differs from Config's defaults */
    write_text("build/pythia-14m.yaml", "name: pythia-14m\nhf_config:\n  name: pythia-14m\n"
               "  org: EleutherAI\nblock_size: 512\nn_layer: 6\nn_embd: 128\nn_head: 4\n"
               "padding_multiple: 128\n");
    check(r, same_config(r, "pythia-14m", "build/pythia-14m.yaml", 1, &b, &err),
          "pythia-14m with only the fields LitGPT's config.py gives equals the full one %s",
          err.msg);
    write_text("build/test-llama.yaml", "n_layer: 2\nn_head: 4\nn_query_groups: 2\nn_embd: 16\n"
               "intermediate_size: 24\nblock_size: 16\nvocab_size: 30\npadding_multiple: 32\n"
               "norm_class_name: RMSNorm\nmlp_class_name: LLaMAMLP\nrotary_percentage: 1.0\n"
               "parallel_residual: false\nbias: false\n");
    check(r, same_config(r, "test-llama", "build/test-llama.yaml", 1, &b, &err),
          "test-llama with only its non-default fields (name from the file) equals the full "
          "one %s", err.msg);
    /* refused, naming the field */
    static const struct { const char *text, *want; } bad[] = {
        {"n_layers: 2\n", "unknown field n_layers"},
        {"n_embd: 64\nn_head: 4\nsliding_window_size: 1024\n", "sliding_window_size 1024"},
        {"n_embd: 64\nn_head: 4\nlatent_attention:\n  q_lora_rank: 8\n", "latent_attention is set"},
        {"n_embd: 64\nn_head: 4\nrope_condense_ratio: 4\n", "rope_condense_ratio is '4'"},
        {"n_embd: 64\nn_head: 3\n", "n_embd 64 is not a multiple of n_head 3"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_text("build/bad-field.yaml", bad[i].text);
        int rc = lg_config_load(&b, "build/bad-field.yaml", &err);
        check(r, rc != 0 && strstr(err.msg, bad[i].want), "config refused: \"%s\"", err.msg);
    }
    /* a window as long as the model's sequences changes nothing (Mistral's 4096) */
    write_text("build/window.yaml", "n_embd: 64\nn_head: 4\nblock_size: 256\n"
               "sliding_window_size: 256\nsliding_window_indices:\n- 1\n- 1\n");
    int rc = lg_config_load(&b, "build/window.yaml", &err);
    check(r, rc == 0 && b.head_size == 16 && b.intermediate_size == 256 &&
          b.padded_vocab_size == 50688 && b.n_query_groups == 4,
          "derived as LitGPT: head_size 16, intermediate_size 256, padded_vocab_size 50688, "
          "n_query_groups 4 (got %d %d %d %d)", b.head_size, b.intermediate_size,
          b.padded_vocab_size, b.n_query_groups);
    /* the written model_config.yaml holds the resolved values and loads as the same model */
    char yaml[4096];
    lg_config back;
    lg_config_load(&b, "build/test-llama.yaml", &err);
    lg_config_to_yaml(&b, yaml, sizeof yaml);
    write_text("build/resolved.yaml", yaml);
    check(r, lg_config_load(&back, "build/resolved.yaml", &err) == 0 &&
          memcmp(&back, &b, sizeof b) == 0 && strstr(yaml, "head_size: 4\n") &&
          strstr(yaml, "padded_vocab_size: 32\n"), "model_config.yaml of a minimal config holds "
          "the resolved values (head_size, padded_vocab_size) and loads back the same");
}

/* POSIX pseudo-terminals (stdlib.h declares them only under _XOPEN_SOURCE, which -std=c11
   leaves out; the rest of the runner is built without it) */
int posix_openpt(int flags);
int grantpt(int fd);
int unlockpt(int fd);
char *ptsname(int fd);

/* Runs `./train args` on a pseudo-terminal (stdout and stderr); what it wrote into out. */
static int run_on_terminal_as(const char *args, int stderr_too, char *out, size_t cap);

static int run_on_terminal(const char *args, char *out, size_t cap) {
    return run_on_terminal_as(args, 1, out, cap);
}

/* stdout on a terminal; stderr too, or (stderr_too 0) to /dev/null, as mpirun leaves a
   process whose output goes to a file: stdout a terminal, stderr a pipe. */
static int run_on_terminal_as(const char *args, int stderr_too, char *out, size_t cap) {
    int master = posix_openpt(O_RDWR | O_NOCTTY);
    if (master < 0 || grantpt(master) != 0 || unlockpt(master) != 0) return -1;
    const char *slave_name = ptsname(master);
    pid_t pid = fork();
    if (pid == 0) {
        setsid();
        int slave = open(slave_name, O_RDWR);
        if (slave < 0) _exit(127);
        dup2(slave, STDOUT_FILENO);
        int null = stderr_too ? slave : open("/dev/null", O_WRONLY);
        dup2(null, STDERR_FILENO);
        char cmd[1024];
        snprintf(cmd, sizeof cmd, "exec ./train %s", args);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    size_t n = 0;
    ssize_t got;
    while ((got = read(master, out + n, cap - 1 - n)) > 0) n += (size_t)got; /* EIO at the end */
    out[n] = '\0';
    close(master);
    int status;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static int count(const char *text, const char *what) {
    int n = 0;
    for (const char *at = strstr(text, what); at; at = strstr(at + 1, what)) n++;
    return n;
}

/* 40 steps, the default interval (40 / 20 = 2): full lines at step 1 and every second step;
   on a terminal the status line in between; the log keeps every step. */
static void test_progress(results *r) {
    static char out[1 << 16];
    const char *args = "--max-steps 40 --eval-every 20 -b 4 --log build/progress.jsonl";
    int code = run_stdout(args, out, sizeof out);
    int full = count(out, " elapsed | ETA "), status = count(out, "\r");
    FILE *f = fopen("build/progress.jsonl", "r");
    char line[512];
    int logged = 0;
    while (f && fgets(line, sizeof line, f)) logged += strstr(line, "\"loss\":") != NULL;
    if (f) fclose(f);
    check(r, code == 0 && full == 21 && status == 0 && !strchr(out, '\033') &&
          count(out, "val loss") == 3 && logged == 40, "progress on a pipe: %d full lines "
          "(want 21: step 1 and every 2nd), no status line, 3 evaluations; the log %d steps",
          full, logged);
    code = run_on_terminal(args, out, sizeof out);
    int shown = count(out, "\r\033[K");
    check(r, code == 0 && count(out, " elapsed | ETA ") == 40 && shown >= 19 &&
          count(out, "val loss") == 3 && strstr(out, "step    39/40 | loss"),
          "progress on a terminal: a status line rewritten in place (\\r, clear) between the "
          "full lines (exit %d, %d clears)", code, shown);
    code = run_on_terminal_as(args, 0, out, sizeof out);
    check(r, code == 0 && count(out, " elapsed | ETA ") == 21 && !strchr(out, '\033'),
          "progress with stdout on a terminal but stderr not (as under mpirun to a file): the "
          "21 full lines only, no status line (ESC) (exit %d)", code);
    code = run_stdout("--max-steps 10 --log-interval 5 -b 4", out, sizeof out);
    check(r, code == 0 && count(out, " elapsed | ETA ") == 3, "--log-interval 5 over 10 steps: "
          "full lines at steps 1, 5 and 10 (%d)", count(out, " elapsed | ETA "));
}

/* Progress on a pipe is line-buffered: the header reaches the reader when it is printed, not
   with the first step's line (block buffering held it until then, minutes on a large model).
   The first step's line arrives at least half its own step time ("| X ms |") after the header;
   block-buffered, both arrive in one write. */
static void test_progress_line_buffered(results *r) {
    /* (stdbuf -oL over tests/test would line-buffer the child too: not here) */
    FILE *p = popen("env -u _STDBUF_O ./train --max-steps 1 -b 64 --eval-iters 1 2>build/stderr.txt", "r");
    char line[1024];
    double header_at = -1, step_at = -1, step_ms = 0;
    while (p && fgets(line, sizeof line, p)) {
        double now = lg_time_ms();
        if (header_at < 0 && !strncmp(line, "model ", 6)) header_at = now;
        const char *ms = strstr(line, " ms | ");
        if (step_at < 0 && !strncmp(line, "step     1/1 |", 14) && ms) {
            step_at = now;
            while (ms > line && ms[-1] != '|') ms--;
            step_ms = atof(ms);
        }
    }
    int status = p ? pclose(p) : -1;
    check(r, status == 0 && header_at >= 0 && step_ms >= 5 && step_at - header_at >= step_ms / 2,
          "stdout on a pipe is line-buffered: the header arrived %.0f ms before step 1's line, "
          "whose step took %.1f ms (want at least half of it; block-buffered: 0)",
          step_at - header_at, step_ms);
}

/* README's output block for `command`: the ``` block right after the ```sh block that holds
   the command alone, into out; 0, or -1 when README has no such pair. */
static int readme_output_of(const char *command, char *out, size_t cap) {
    static char readme[1 << 17];
    char pair[512];
    FILE *f = fopen("README.md", "r");
    size_t n = f ? fread(readme, 1, sizeof readme - 1, f) : 0;
    readme[n] = '\0';
    if (f) fclose(f);
    snprintf(pair, sizeof pair, "```sh\n%s\n```\n\n```\n", command);
    const char *at = strstr(readme, pair), *end = at ? strstr(at + strlen(pair), "```\n") : NULL;
    if (!end) return -1;
    at += strlen(pair);
    snprintf(out, cap, "%.*s", (int)(end - at), at);
    return 0;
}

/* README's example outputs are what the commands print, byte for byte (stdout and stderr as a
   terminal shows them): "Will it fit?" (exit 3, the diagnosis, the remedies). */
static void test_readme_outputs(results *r) {
    static const struct { const char *command; int code; } examples[] = {
        {"./train -c tiny-llama-1.1b -b 8 -g 32 -t 2048 --memory-limit 24GiB", 3},
    };
    static char shown[16384], printed[16384];
    for (size_t i = 0; i < sizeof examples / sizeof examples[0]; i++) {
        int in_readme = readme_output_of(examples[i].command, shown, sizeof shown) == 0;
        int code = run_capture(examples[i].command + strlen("./train "), printed, sizeof printed);
        size_t at = 0; /* where they part */
        while (shown[at] && shown[at] == printed[at]) at++;
        check(r, in_readme && code == examples[i].code && !strcmp(shown, printed),
              "README's output of '%s' is what it prints (exit %d; %zu bytes agree; README: "
              "\"%.40s\", printed: \"%.40s\")", examples[i].command, code, at, shown + at, printed + at);
    }
}

/* --plan shows the model after LitGPT's defaults: head_size and padded_vocab_size derived */
static void test_plan_shows_resolved_config(results *r) {
    expect_cli(r, "--plan -c build/test-llama.yaml -t 16", 0,
               "model test-llama: n_layer 2, n_head 4, n_query_groups 2, n_embd 16, head_size 4, "
               "intermediate_size 24, block_size 16, vocab_size 30 (padded 32)");
}

/* Runs python3's XML parser on an SVG and counts elements: "TAG" or "TAG.class" or "TAG#id";
   -1 when it does not parse. */
static int svg_count(const char *path, const char *what) {
    char cmd[1024], out[64] = "";
    snprintf(cmd, sizeof cmd, "python3 -c \"import sys, xml.etree.ElementTree as E\n"
             "tag, _, rest = sys.argv[2].replace('#', '.').partition('.')\n"
             "root = E.parse(sys.argv[1]).getroot()\n"
             "ns = '{http://www.w3.org/2000/svg}'\n"
             "print(sum(1 for e in root.iter(ns + tag) if not rest or rest in "
             "(e.get('class'), e.get('id'))))\" %s '%s' 2>/dev/null", path, what);
    FILE *p = popen(cmd, "r");
    size_t n = p ? fread(out, 1, sizeof out - 1, p) : 0;
    out[n] = '\0';
    if (p) pclose(p);
    return n ? atoi(out) : -1;
}

/* --plot and --plan=svg: well-formed XML (python3's parser) holding the expected series. */
static void test_pictures(results *r) {
    static char out[1 << 16];
    remove("build/loss.svg");
    int code = run_stdout("--max-steps 30 --eval-every 10 -b 4 --plot build/loss.svg", out,
                          sizeof out);
    check(r, code == 0 && svg_count("build/loss.svg", "polyline#loss") == 1 &&
          svg_count("build/loss.svg", "polyline#smoothed") == 1 &&
          svg_count("build/loss.svg", "polyline#lr") == 1 &&
          svg_count("build/loss.svg", "circle.val") == 4, "--plot: an SVG with the loss, its "
          "smoothed curve, the learning rate and 4 validation points (steps 0, 10, 20, 30): %d",
          svg_count("build/loss.svg", "circle.val"));
    code = run_stdout("--plan=svg -c test-llama -b 64 -t 16 --memory-limit 2MiB", out, sizeof out);
    write_text("build/plan.svg", out);
    int groups = svg_count("build/plan.svg", "rect.group");
    check(r, code == 3 && groups >= 5 && svg_count("build/plan.svg", "line#limit") == 1 &&
          svg_count("build/plan.svg", "rect.remedy") >= 1 && strncmp(out, "<?xml", 5) == 0,
          "--plan=svg alone on stdout: %d stacked groups, the limit, %d remedies of a run that "
          "does not fit (exit 3)", groups, svg_count("build/plan.svg", "rect.remedy"));
    code = run_stdout("--plan=svg -b 1 -t 256 -p bf16-true -d 4", out, sizeof out);
    write_text("build/plan4.svg", out);
    check(r, code == 0 && svg_count("build/plan4.svg", "text") > 4 &&
          svg_count("build/plan4.svg", "rect.remedy") == 0 &&
          count(out, "device 3: weights") == 1, "--plan=svg of the design card's command: "
          "4 devices' bars, no remedies (it fits)");
}

/* The run a person gets by changing only the settings a remedy names (lg_remedy.changes) on
   the original run. */
static lg_args with_settings(const lg_args *original, const lg_remedy *m, int *T) {
    lg_args a = *original;
    const lg_args *to = &m->args;
    unsigned c = m->changes;
    if (c & LG_SETTING_RECOMPUTE) a.recompute = to->recompute;
    if (c & LG_SETTING_OFFLOAD) a.offload = to->offload;
    if (c & LG_SETTING_OFFLOAD_ACTIVATIONS) a.offload_activations = to->offload_activations;
    if (c & LG_SETTING_OFFLOAD_GRADIENTS) {
        a.offload = to->offload;
        a.offload_gradients = to->offload_gradients;
    }
    if (c & LG_SETTING_OFFLOAD_WEIGHTS) {
        a.offload = to->offload;
        a.offload_weights = to->offload_weights;
    }
    if (c & LG_SETTING_OFFLOAD_EMBEDDING) a.offload_embedding = to->offload_embedding;
    if (c & LG_SETTING_PRECISION) a.precision = to->precision;
    if (c & LG_SETTING_LORA_R) a.lora.r = to->lora.r;
    if (c & LG_SETTING_QUANTIZE) a.lora.quantize = to->lora.quantize;
    if (c & LG_SETTING_OPTIMIZER_STATE) a.optimizer_state = to->optimizer_state;
    if (c & LG_SETTING_OPTIMIZER) a.optimizer = to->optimizer;
    if (c & LG_SETTING_MOMENTUM) a.momentum = to->momentum;
    if (c & LG_SETTING_SEQ_LENGTH) *T = m->T;
    if (c & LG_SETTING_DEVICES) a.devices = to->devices;
    if (c & LG_SETTING_STRATEGY) a.strategy = to->strategy;
    if (c & LG_SETTING_MICRO_BATCH) a.micro_batch_size = to->micro_batch_size;
    if (c & LG_SETTING_GLOBAL_BATCH) a.global_batch_size = to->global_batch_size;
    if (a.optimizer != LG_OPTIMIZER_ADAMW) a.optimizer_state = LG_STATE_AS_PRECISION; /* as -o */
    return a;
}

/* The library's remedies name settings, not flags: changing only the settings each names
   (the strategy and global batch included where a device count needs them) gives the run it
   priced, byte for byte of the plan. */
static void test_remedy_settings(results *r) {
    lg_config cfg;
    lg_error err;
    if (lg_config_load(&cfg, "configs/pythia-14m.yaml", &err) != 0) {
        check(r, 0, "remedy settings: %s", err.msg);
        return;
    }
    int total = 0, same = 0, named = 1;
    for (int run = 0; run < 3; run++) {
        lg_args a;
        lg_args_default(&a);
        a.micro_batch_size = 8;
        a.finetuning = 1; /* LoRA and QLoRA are remedies too */
        if (run == 1) a.optimizer = LG_OPTIMIZER_LION;
        if (run == 2) { /* no-shard over 2 devices with a global batch of 6 */
            a.micro_batch_size = 1;
            a.devices = 2;
            a.global_batch_size = 6;
            a.strategy = LG_STRATEGY_NO_SHARD;
        }
        size_t limit = 30u << 20;
        lg_remedy m[LG_MAX_REMEDIES + 1];
        int n = lg_plan_remedies(&cfg, &a, 16, limit, m);
        lg_plan_cheapest_fit(&cfg, &a, 16, limit, &m[n++]);
        for (int i = 0; i < n; i++) {
            int T = 16;
            lg_args changed = with_settings(&a, &m[i], &T);
            total++;
            named &= m[i].changes != 0;
            same += lg_plan_device_bytes_for(&cfg, &changed, T) == m[i].device_bytes &&
                    m[i].device_bytes > 0;
        }
    }
    check(r, total > 20 && same == total && named, "remedies as settings: %d of %d remedies "
          "(AdamW, Lion, no-shard over 2 devices) price the same plan when only the settings "
          "they name change", same, total);
}

/* One hash and one mixer: lg_hash64 is FNV-1a (the published 64-bit test vectors; the
   checkpoints' COMPLETE markers depend on it) and lg_mix64 splitmix64's finaliser (its
   published outputs from state 0). */
static void test_hash_and_mixer(results *r) {
    lg_rng rng;
    lg_rng_seed(&rng, 0);
    check(r, lg_hash64(LG_HASH64_INIT, "", 0) == 0xcbf29ce484222325ull &&
          lg_hash64(LG_HASH64_INIT, "a", 1) == 0xaf63dc4c8601ec8cull &&
          lg_hash64(LG_HASH64_INIT, "foobar", 6) == 0x85944171f73967e8ull &&
          lg_hash64(lg_hash64(LG_HASH64_INIT, "foo", 3), "bar", 3) == 0x85944171f73967e8ull,
          "lg_hash64 is 64-bit FNV-1a: \"a\" -> af63dc4c8601ec8c, \"foobar\" (whole or in two "
          "parts) -> 85944171f73967e8");
    check(r, lg_mix64(LG_GOLDEN_GAMMA) == 0xe220a8397b1dcdafull &&
          lg_mix64(2 * LG_GOLDEN_GAMMA) == 0x6e789e6aa1b965f4ull &&
          rng.state == (0xe220a8397b1dcdafull | 1),
          "lg_mix64 is splitmix64's finaliser: its first two outputs from state 0 are "
          "e220a8397b1dcdaf, 6e789e6aa1b965f4; lg_rng_seed(0) starts from the first");
}

static void test_first_hour(results *r) {
    test_hash_and_mixer(r);
    test_remedy_settings(r);
    test_pictures(r);
    test_progress(r);
    test_progress_line_buffered(r);
    test_readme_outputs(r);
    test_design_card_command(r);
    test_plan_json_alone(r);
    test_evaluation_alone(r);
    test_learning_rate_defaults(r);
    test_litgpt_configs(r);
    test_plan_shows_resolved_config(r);
}
