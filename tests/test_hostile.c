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

static void test_hostile_all(results *r) {
    test_hostile_configs(r);
    test_hostile_hf_configs(r);
}
