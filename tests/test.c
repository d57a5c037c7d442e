/* tests/test.c — the test runner: `make test` builds it twice and runs it from the repository
   root. Built normally (lg_real = float) it checks the PyTorch reference, training, data, the
   command line and the configs; built with -DLG_REAL_DOUBLE it checks every op's backward and
   every family's whole-model gradient against central finite differences in double precision.
   The float runner starts the double one and adds its counts, so the last line,
   "N passed, N failed", covers both. */
#define _POSIX_C_SOURCE 200809L /* setenv: tests/test_processes.c sets launchers' variables */
#include <stddef.h>
#include <stdlib.h>

/* Every allocation the library makes goes through LG_MALLOC: count them, to show that a rank
   allocates its arenas and nothing else of size. */
typedef struct {
    int counting;        /* record while set */
    size_t refuse;       /* an allocation of exactly this many bytes fails (0: none) */
    int n;               /* allocations recorded */
    size_t sizes[4096];  /* their sizes */
    void *blocks[4096];  /* and addresses */
} allocation_log;
static allocation_log test_allocations; /* test-only: the library itself has no globals */

static void *test_malloc(size_t bytes) {
    allocation_log *log = &test_allocations;
    if (log->refuse && bytes == log->refuse) return NULL;
    void *p = malloc(bytes);
    if (log->counting && log->n < 4096) {
        log->sizes[log->n] = bytes;
        log->blocks[log->n++] = p;
    }
    return p;
}
#define LG_MALLOC(size) test_malloc(size)
#define LG_FREE(ptr) free(ptr)

#define LITGPT_IMPLEMENTATION
#include "../litgpt.h"

#include <math.h>
#include <string.h>
#include <sys/wait.h>

#include "check.h"

static void fill_normal(lg_real *x, size_t n, float std, lg_rng *rng) {
    for (size_t i = 0; i < n; i++) x[i] = std * lg_rng_normal(rng);
}

static lg_real *new_reals(size_t n) { return (lg_real *)lg_alloc_zeroed(n * sizeof(lg_real)); }

/* The elements of a 32-true buffer. */
static lg_real *reals(lg_buf b) { return (lg_real *)b.data; }

/* max |a - b| / max(max |b|, floor): error relative to the tensor's scale */
static double rel_error(const lg_real *a, const lg_real *b, size_t n, double floor) {
    double diff = 0, scale = floor;
    for (size_t i = 0; i < n; i++) {
        diff = fmax(diff, fabs((double)a[i] - (double)b[i]));
        scale = fmax(scale, fabs((double)b[i]));
    }
    return diff / scale;
}

#ifdef LG_REAL_DOUBLE
/* =============================================================================================
   Double precision: backward of every op against central finite differences
   ============================================================================================= */

#define FD_EPS 1e-6
#define FD_TOL 1e-6 /* central differences in double: truncation ~eps^2, rounding ~1e-16/eps */

/* An op under test: forward maps the inputs to an output; the scalar is sum(out * probe). */
typedef struct fd_case fd_case;
struct fd_case {
    const char *name;
    int n_inputs;
    lg_real *inputs[4]; /* the tensors finite differences perturb */
    size_t sizes[4];
    lg_real *grads[4];  /* filled by backward */
    lg_real *out, *probe;
    size_t out_size;
    void (*forward)(fd_case *c);
    void (*backward)(fd_case *c); /* adds d(sum(out * probe))/d input into grads */
    int dims[8];                  /* op-specific sizes */
    int flag;
    lg_real *scratch[4];
    lg_real *rows; /* attention's per-thread scratch */
    const int *tokens;
};

static fd_case fd_named(const char *name) {
    fd_case c;
    memset(&c, 0, sizeof c);
    c.name = name;
    return c;
}

static double fd_objective(fd_case *c) {
    c->forward(c);
    double s = 0;
    for (size_t i = 0; i < c->out_size; i++) s += (double)c->out[i] * c->probe[i];
    return s;
}

static void fd_check(results *r, fd_case *c) {
    for (int k = 0; k < c->n_inputs; k++) memset(c->grads[k], 0, c->sizes[k] * sizeof(lg_real));
    c->forward(c);
    c->backward(c);
    double worst = 0;
    for (int k = 0; k < c->n_inputs; k++) {
        lg_real *fd = new_reals(c->sizes[k]);
        for (size_t i = 0; i < c->sizes[k]; i++) {
            lg_real saved = c->inputs[k][i];
            c->inputs[k][i] = saved + FD_EPS;
            double plus = fd_objective(c);
            c->inputs[k][i] = saved - FD_EPS;
            double minus = fd_objective(c);
            c->inputs[k][i] = saved;
            fd[i] = (plus - minus) / (2 * FD_EPS);
        }
        worst = fmax(worst, rel_error(c->grads[k], fd, c->sizes[k], 1e-3));
        LG_FREE(fd);
    }
    check(r, worst < FD_TOL, "%-34s backward vs finite differences: rel err %.1e (< %.0e)",
          c->name, worst, FD_TOL);
}

/* dims: N, IC, OC */
static void linear_fwd(fd_case *c) {
    lg_linear_forward(NULL, lg_buf_of(c->out), lg_buf_of(c->inputs[0]), lg_buf_of(c->inputs[1]), lg_buf_of(c->inputs[2]), c->dims[0], c->dims[1],
                      c->dims[2]);
}
static void linear_bwd(fd_case *c) {
    lg_linear_backward(NULL, lg_buf_of(c->grads[0]), lg_buf_of(c->grads[1]), lg_buf_of(c->grads[2]), lg_buf_of(c->probe),
                       lg_buf_of(c->inputs[0]), lg_buf_of(c->inputs[1]), c->dims[0], c->dims[1], c->dims[2], 1.0f,
                       1.0f);
}
/* dims: N, C; flag: 1 LayerNorm, 0 RMSNorm */
static void norm_fwd(fd_case *c) {
    lg_norm_forward(NULL, lg_buf_of(c->out), c->flag ? c->scratch[0] : NULL, c->scratch[1], lg_buf_of(c->inputs[0]),
                    lg_buf_of(c->inputs[1]), lg_buf_of(c->flag ? c->inputs[2] : NULL), c->dims[0], c->dims[1], 1e-5f);
}
static void norm_bwd(fd_case *c) {
    lg_norm_backward(NULL, lg_buf_of(c->grads[0]), lg_buf_of(c->grads[1]), lg_buf_of(c->flag ? c->grads[2] : NULL), lg_buf_of(c->probe),
                     lg_buf_of(c->inputs[0]), lg_buf_of(c->inputs[1]), c->flag ? c->scratch[0] : NULL, c->scratch[1],
                     c->dims[0], c->dims[1]);
}
/* The CPU's exec context with the attention's scratch rows for the op tests: 2 T T a thread,
   from the fd_case's buffer. */
static lg_exec attention_exec(fd_case *c) {
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads() < 64 ? omp_get_max_threads() : 64; /* c->rows holds 64 */
#endif
    lg_exec ex;
    memset(&ex, 0, sizeof ex);
    ex.attention.base = c->rows;
    ex.attention.per_thread = 2 * (size_t)c->dims[1] * c->dims[1];
    ex.attention.threads = threads;
    return ex;
}

/* dims: B, T, NH, NQG, HS, rope dims */
static void rope_attn_fwd(fd_case *c) {
    int B = c->dims[0], T = c->dims[1], NH = c->dims[2], NQG = c->dims[3], HS = c->dims[4];
    size_t qkv = (size_t)B * T * (NH + 2 * NQG) * HS;
    memcpy(c->scratch[0], c->inputs[0], qkv * sizeof(lg_real));
    lg_rope_tables(NULL, c->scratch[2], c->scratch[3], T, c->dims[5], 10000.0f, NULL);
    lg_rope_rotate(NULL, lg_buf_of(c->scratch[0]), c->scratch[2], c->scratch[3], B, T, NH, NQG, HS, c->dims[5], +1, NULL);
    lg_exec ex = attention_exec(c);
    lg_attention_forward(&ex, lg_buf_of(c->out), c->scratch[1], lg_buf_of(c->scratch[0]), B, T,
                         NH, NQG, HS, NULL);
}
static void rope_attn_bwd(fd_case *c) {
    int B = c->dims[0], T = c->dims[1], NH = c->dims[2], NQG = c->dims[3], HS = c->dims[4];
    lg_exec ex = attention_exec(c);
    lg_attention_backward(&ex, lg_buf_of(c->grads[0]), lg_buf_of(c->probe), lg_buf_of(c->out),
                          lg_buf_of(c->scratch[0]), c->scratch[1], B, T, NH, NQG, HS, NULL);
    lg_rope_rotate(NULL, lg_buf_of(c->grads[0]), c->scratch[2], c->scratch[3], B, T, NH, NQG, HS, c->dims[5], -1, NULL);
}
/* flag: 0 gelu erf, 1 gelu tanh, 2 swiglu; dims[0]: n */
static void act_fwd(fd_case *c) {
    if (c->flag == 2) lg_swiglu_forward(NULL, lg_buf_of(c->out), lg_buf_of(c->inputs[0]), lg_buf_of(c->inputs[1]), c->dims[0]);
    else lg_gelu_forward(NULL, lg_buf_of(c->out), lg_buf_of(c->inputs[0]), c->dims[0], c->flag);
}
static void act_bwd(fd_case *c) {
    if (c->flag == 2) lg_swiglu_backward(NULL, lg_buf_of(c->grads[0]), lg_buf_of(c->grads[1]), lg_buf_of(c->probe), lg_buf_of(c->inputs[0]),
                                          lg_buf_of(c->inputs[1]), c->dims[0]);
    else lg_gelu_backward(NULL, lg_buf_of(c->grads[0]), lg_buf_of(c->probe), lg_buf_of(c->inputs[0]), c->dims[0], c->flag);
}
/* dims: B, T, C */
static void embed_fwd(fd_case *c) {
    lg_embedding_forward(NULL, lg_buf_of(c->out), c->tokens, lg_buf_of(c->inputs[0]), lg_buf_of(c->inputs[1]), c->dims[0], c->dims[1],
                         c->dims[2], NULL);
}
static void embed_bwd(fd_case *c) {
    lg_embedding_backward(NULL, lg_buf_of(c->grads[0]), lg_buf_of(c->grads[1]), lg_buf_of(c->probe), c->tokens, c->dims[0], c->dims[1],
                          c->dims[2], NULL);
}
/* dims: N, V, Vp; the output is the per-token loss */
static void ce_fwd(fd_case *c) {
    lg_crossentropy_forward(NULL, c->out, lg_buf_of(c->inputs[0]), c->tokens, c->dims[0], c->dims[1], c->dims[2]);
}
static void ce_bwd(fd_case *c) {
    /* d(sum_n probe_n loss_n)/dlogits: the op's scale is one number, so use a uniform probe */
    lg_crossentropy_backward(NULL, lg_buf_of(c->grads[0]), lg_buf_of(c->inputs[0]), c->tokens, c->dims[0], c->dims[1],
                             c->dims[2], c->probe[0]);
}

static void fd_setup(fd_case *c, lg_rng *rng, int n_inputs, const size_t *sizes, size_t out_size) {
    c->n_inputs = n_inputs;
    for (int k = 0; k < n_inputs; k++) {
        c->sizes[k] = sizes[k];
        c->inputs[k] = new_reals(sizes[k]);
        c->grads[k] = new_reals(sizes[k]);
        fill_normal(c->inputs[k], sizes[k], 1.0f, rng);
    }
    c->out_size = out_size;
    c->out = new_reals(out_size);
    c->probe = new_reals(out_size);
    fill_normal(c->probe, out_size, 1.0f, rng);
}

static void fd_free(fd_case *c) {
    for (int k = 0; k < c->n_inputs; k++) { LG_FREE(c->inputs[k]); LG_FREE(c->grads[k]); }
    for (int k = 0; k < 4; k++) LG_FREE(c->scratch[k]);
    LG_FREE(c->rows);
    LG_FREE(c->out);
    LG_FREE(c->probe);
}

static void test_op_gradients(results *r) {
    printf("op gradients (double precision)\n");
    lg_rng rng;
    lg_rng_seed(&rng, 7);
    { /* linear with bias: N=5, IC=7, OC=6 (odd sizes on purpose) */
        fd_case c = fd_named("linear");
        c.dims[0] = 5; c.dims[1] = 7; c.dims[2] = 6;
        size_t sizes[3] = {5 * 7, 6 * 7, 6};
        fd_setup(&c, &rng, 3, sizes, 5 * 6);
        c.forward = linear_fwd; c.backward = linear_bwd;
        fd_check(r, &c);
        fd_free(&c);
    }
    for (int layer_norm = 0; layer_norm <= 1; layer_norm++) {
        fd_case c = fd_named(layer_norm ? "layernorm" : "rmsnorm");
        c.dims[0] = 4; c.dims[1] = 9; c.flag = layer_norm;
        size_t sizes[3] = {4 * 9, 9, 9};
        fd_setup(&c, &rng, layer_norm ? 3 : 2, sizes, 4 * 9);
        c.scratch[0] = new_reals(4); c.scratch[1] = new_reals(4);
        c.forward = norm_fwd; c.backward = norm_bwd;
        fd_check(r, &c);
        fd_free(&c);
    }
    /* attention with rotary: multi-head with full rotary, grouped-query, partial rotary */
    const int shapes[3][6] = {{2, 5, 2, 2, 4, 4}, {2, 6, 4, 2, 4, 4}, {1, 7, 3, 1, 8, 2}};
    const char *names[3] = {"rope+attention (MHA)", "rope+attention (GQA 4 heads/2 groups)",
                            "rope+attention (MQA, partial rope)"};
    for (int s = 0; s < 3; s++) {
        fd_case c = fd_named(names[s]);
        memcpy(c.dims, shapes[s], sizeof shapes[s]);
        int B = c.dims[0], T = c.dims[1], NH = c.dims[2], NQG = c.dims[3], HS = c.dims[4];
        size_t qkv = (size_t)B * T * (NH + 2 * NQG) * HS;
        size_t sizes[1] = {qkv};
        fd_setup(&c, &rng, 1, sizes, (size_t)B * T * NH * HS);
        c.scratch[0] = new_reals(qkv);
        c.scratch[1] = new_reals((size_t)B * NH * T); /* the rows' log-sum-exp */
        c.rows = new_reals(2 * (size_t)T * T * 64);  /* attention scratch for up to 64 threads */
        c.scratch[2] = new_reals((size_t)T * HS);
        c.scratch[3] = new_reals((size_t)T * HS);
        c.forward = rope_attn_fwd; c.backward = rope_attn_bwd;
        fd_check(r, &c);
        fd_free(&c);
    }
    const char *act_names[3] = {"gelu (erf)", "gelu (tanh)", "swiglu"};
    for (int flag = 0; flag < 3; flag++) {
        fd_case c = fd_named(act_names[flag]);
        c.flag = flag; c.dims[0] = 40;
        size_t sizes[2] = {40, 40};
        fd_setup(&c, &rng, flag == 2 ? 2 : 1, sizes, 40);
        c.forward = act_fwd; c.backward = act_bwd;
        fd_check(r, &c);
        fd_free(&c);
    }
    { /* embedding with positions, repeated tokens */
        int tokens[6] = {3, 1, 3, 0, 2, 3};
        fd_case c = fd_named("embedding (+ positions)");
        c.dims[0] = 2; c.dims[1] = 3; c.dims[2] = 5; c.tokens = tokens;
        size_t sizes[2] = {4 * 5, 3 * 5};
        fd_setup(&c, &rng, 2, sizes, 6 * 5);
        c.forward = embed_fwd; c.backward = embed_bwd;
        fd_check(r, &c);
        fd_free(&c);
    }
    { /* cross-entropy over V=5 of Vp=8 columns, one ignored target */
        int targets[4] = {4, LG_IGNORE_INDEX, 0, 2};
        fd_case c = fd_named("cross-entropy (padded, ignore_index)");
        c.dims[0] = 4; c.dims[1] = 5; c.dims[2] = 8; c.tokens = targets;
        size_t sizes[1] = {4 * 8};
        fd_setup(&c, &rng, 1, sizes, 4);
        for (int i = 0; i < 4; i++) c.probe[i] = 0.7;
        c.forward = ce_fwd; c.backward = ce_bwd;
        fd_check(r, &c);
        fd_free(&c);
    }
}

/* The backward's gradient of the mean loss for every trainable parameter against central
   differences: the worst error relative to each tensor's scale, and where. */
static double gradient_error(lg_model *m, const int *tokens, const int *targets, int B, int T,
                             const char **worst_name) {
    int n_targets;
    lg_model_zero_grad(m);
    lg_model_forward(m, tokens, targets, B, T, &n_targets);
    lg_model_backward(m, tokens, targets, B, T, 1.0f / n_targets);
    lg_real *fd = new_reals(m->n_params), *p = reals(m->params);
    for (size_t i = 0; i < m->n_params; i++) {
        lg_real saved = p[i];
        p[i] = saved + FD_EPS;
        double plus = lg_model_forward(m, tokens, targets, B, T, NULL) / n_targets;
        p[i] = saved - FD_EPS;
        double minus = lg_model_forward(m, tokens, targets, B, T, NULL) / n_targets;
        p[i] = saved;
        fd[i] = (plus - minus) / (2 * FD_EPS);
    }
    double worst = 0;
    for (int k = 0; k < m->param_table.n_tensors; k++) {
        const lg_tensor_info *t = &m->param_table.tensors[k];
        double e = rel_error(reals(m->grads) + t->offset, fd + t->offset, t->count, 1e-3);
        if (e > worst) { worst = e; *worst_name = t->name; }
    }
    LG_FREE(fd);
    return worst;
}

/* The whole model: every parameter's gradient of the mean loss against finite differences;
   head_rows > 0: the head and loss in chunks of that many of the 12 rows (their logits
   computed again in the backward); slice_rows > 0: each block's MLP in slices (their hidden
   layer computed again in the backward). */
static void test_model_gradient(results *r, const char *config_name, int head_rows,
                                int slice_rows) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, config_name)) return;
    int B = 2, T = 6;
    lg_model m;
    lg_error err;
    if (lg_model_create(&m, &cfg, B, T, &err)) { check(r, 0, "%s: %s", config_name, err.msg); return; }
    if (head_rows) m.head_rows = head_rows; /* (the regions hold all 12 rows: chunks fit) */
    if (slice_rows) m.slice_rows = slice_rows;
    char chunks[40] = "";
    if (head_rows) snprintf(chunks, sizeof chunks, ", head in chunks of %d", head_rows);
    if (slice_rows) snprintf(chunks, sizeof chunks, ", MLP in slices of %d", slice_rows);
    lg_rng rng;
    lg_rng_seed(&rng, 11);
    fill_normal(reals(m.params), m.n_params, 0.3f, &rng); /* large weights: gradients far from zero */
    int tokens[12], targets[12];
    for (int i = 0; i < B * T; i++) {
        tokens[i] = (int)(lg_rng_u64(&rng) % cfg.vocab_size);
        targets[i] = (int)(lg_rng_u64(&rng) % cfg.vocab_size);
    }
    targets[4] = LG_IGNORE_INDEX;
    const char *worst_name = "";
    double worst = gradient_error(&m, tokens, targets, B, T, &worst_name);
    check(r, worst < FD_TOL, "%-12s%-22s whole-model gradient (%zu params) vs finite "
          "differences: worst rel err %.1e in %s", config_name, chunks, m.n_params, worst,
          worst_name);
    lg_model_free(&m);
}

/* LoRA: the adapters' gradients (A and B of every target, the head's included) through a
   random frozen model, with dropout on (a fixed mask) and off, against finite differences;
   head_rows > 0: the head in chunks (the head adapter's mask still the whole input's). */
static void test_lora_gradient(results *r, const char *config_name, float dropout,
                               int head_rows) { /* (head_rows: also the MLP in slices of it) */
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, config_name)) return;
    cfg.lora.r = 2;
    cfg.lora.alpha = 8.0f; /* scale 4: the adapters carry gradients well above the differences' noise */
    cfg.lora.dropout = dropout;
    cfg.lora.targets = LG_LORA_QUERY | LG_LORA_KEY | LG_LORA_VALUE | LG_LORA_PROJECTION |
                       LG_LORA_MLP | (cfg.tie_embeddings ? 0 : LG_LORA_HEAD); /* see lg_lora_check */
    int B = 2, T = 6;
    lg_model m;
    lg_error err;
    if (lg_model_create(&m, &cfg, B, T, &err)) { check(r, 0, "%s: %s", config_name, err.msg); return; }
    if (head_rows) m.head_rows = m.slice_rows = head_rows;
    lg_rng rng;
    lg_rng_seed(&rng, 12);
    fill_normal(reals(m.frozen), m.frozen_table.total, 0.3f, &rng);
    fill_normal(reals(m.params), m.n_params, 0.3f, &rng); /* B != 0: A has gradients too */
    m.dropout_key = dropout > 0 ? 0x1234567ull : 0;
    int tokens[12], targets[12];
    for (int i = 0; i < B * T; i++) {
        tokens[i] = (int)(lg_rng_u64(&rng) % cfg.vocab_size);
        targets[i] = (int)(lg_rng_u64(&rng) % cfg.vocab_size);
    }
    const char *worst_name = "";
    double worst = gradient_error(&m, tokens, targets, B, T, &worst_name);
    int adapters = 0;
    for (int k = 0; k < m.param_table.n_tensors; k++)
        adapters += m.param_table.tensors[k].kind == LG_TENSOR_LORA_A ||
                    m.param_table.tensors[k].kind == LG_TENSOR_LORA_B;
    check(r, worst < FD_TOL && adapters == m.param_table.n_tensors && adapters > 2 * cfg.n_layer,
          "%-12s LoRA r 2, every target%s, dropout %.2f%s: %d adapter tensors (%zu params) "
          "vs finite differences: worst rel err %.1e in %s", config_name,
          cfg.tie_embeddings ? " (no head: tied)" : "", dropout,
          head_rows ? ", head and MLP in 5s" : "", adapters, m.n_params, worst, worst_name);
    lg_model_free(&m);
}

#include "test_combinations.c"

int main(void) {
    results r = {0, 0};
    test_op_gradients(&r);
    printf("model gradients (double precision)\n");
    const char *families[] = {"test-gpt2", "test-pythia", "test-llama", "test-falcon", "test-llama31"};
    for (int i = 0; i < 5; i++) test_model_gradient(&r, families[i], 0, 0);
    for (int i = 0; i < 5; i++) test_model_gradient(&r, families[i], 5, 0); /* 5 + 5 + 2 rows */
    for (int i = 0; i < 5; i++) test_model_gradient(&r, families[i], 0, 5);
    test_model_gradient(&r, "test-pythia", 1, 0);
    test_model_gradient(&r, "test-llama", 0, 1);
    printf("LoRA gradients (double precision)\n");
    test_lora_gradient(&r, "test-gpt2", 0.0f, 0);
    test_lora_gradient(&r, "test-pythia", 0.25f, 0);
    test_lora_gradient(&r, "test-llama", 0.0f, 0);
    test_lora_gradient(&r, "test-llama", 0.25f, 0);
    test_lora_gradient(&r, "test-falcon", 0.25f, 0);
    test_lora_gradient(&r, "test-pythia", 0.25f, 5);
    test_lora_gradient(&r, "test-llama", 0.25f, 5);
    printf("lever combinations (double precision)\n");
    test_combinations_all(&r);
    printf("%d passed, %d failed\n", r.passed, r.failed);
    return r.failed ? 1 : 0;
}

#else
/* =============================================================================================
   Single precision: reference, training, data, command line, configs
   ============================================================================================= */

/* lg_trainer_create, with the allocations it makes recorded in test_allocations. */
static int create_counting(lg_trainer *tr, const lg_config *cfg, const lg_args *a, int T,
                           lg_error *err) {
    test_allocations.n = 0;
    test_allocations.counting = 1;
    int rc = lg_trainer_create(tr, cfg, a, T, err);
    test_allocations.counting = 0;
    return rc;
}

/* ---- the PyTorch reference ------------------------------------------------------------------ */

typedef struct {
    char name[LG_MAX_NAME];
    int dtype; /* 0 float32, 1 int32 */
    size_t count;
    void *data;
} ref_tensor;

typedef struct {
    ref_tensor *tensors;
    int n;
} ref_file;

/* Reads tests/reference/NAME.bin (format in tests/make_reference.py). */
static int ref_load(ref_file *rf, const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    char magic[8];
    uint32_t count;
    if (fread(magic, 1, 8, f) != 8 || memcmp(magic, "LGREF001", 8) != 0 ||
        fread(&count, 4, 1, f) != 1 || count > 10000) { fclose(f); return -1; }
    rf->tensors = (ref_tensor *)lg_alloc_zeroed(sizeof(ref_tensor) * count);
    rf->n = (int)count;
    for (uint32_t i = 0; i < count; i++) {
        ref_tensor *t = &rf->tensors[i];
        uint32_t len, dtype, ndim, dim;
        if (fread(&len, 4, 1, f) != 1 || len >= LG_MAX_NAME || fread(t->name, 1, len, f) != len ||
            fread(&dtype, 4, 1, f) != 1 || fread(&ndim, 4, 1, f) != 1) { fclose(f); return -1; }
        t->dtype = (int)dtype;
        t->count = 1;
        for (uint32_t d = 0; d < ndim; d++) {
            if (fread(&dim, 4, 1, f) != 1) { fclose(f); return -1; }
            t->count *= dim;
        }
        t->data = LG_MALLOC(t->count * 4);
        if (fread(t->data, 4, t->count, f) != t->count) { fclose(f); return -1; }
    }
    fclose(f);
    return 0;
}

static const ref_tensor *ref_find(const ref_file *rf, const char *name) {
    for (int i = 0; i < rf->n; i++)
        if (strcmp(rf->tensors[i].name, name) == 0) return &rf->tensors[i];
    return NULL;
}

static void ref_free(ref_file *rf) {
    for (int i = 0; i < rf->n; i++) LG_FREE(rf->tensors[i].data);
    LG_FREE(rf->tensors);
}

/* Loads the reference weights by name, runs forward and backward, compares loss (rel 1e-4),
   logits (1e-4 of their scale) and every gradient (1e-3 of its scale). */
/* Copies the reference's tensor of each table entry's name into buf; how many were found. */
static int ref_fill(const ref_file *rf, const lg_tensor_table *table, lg_buf buf) {
    int found = 0;
    for (int k = 0; k < table->n_tensors; k++) {
        const lg_tensor_info *t = &table->tensors[k];
        const ref_tensor *w = ref_find(rf, t->name);
        if (!w || w->count != t->count) { printf("    missing %s\n", t->name); continue; }
        for (size_t i = 0; i < t->count; i++) reals(buf)[t->offset + i] = ((const float *)w->data)[i];
        found++;
    }
    return found;
}

/* A model's forward and backward of the reference's batch against PyTorch's: the loss, its
   relative error, the logits' error of their scale and the worst trainable gradient's. */
typedef struct {
    double loss, ref_loss, loss_err, logits_err, grads_err;
    const char *worst; /* the tensor of grads_err */
} ref_errors;

static ref_errors reference_errors(lg_model *m, const ref_file *rf, int B, int T) {
    const ref_tensor *idx = ref_find(rf, "idx"), *tgt = ref_find(rf, "targets");
    const ref_tensor *loss = ref_find(rf, "loss"), *logits = ref_find(rf, "logits");
    ref_errors e = {0, 0, 0, 0, 0, ""};
    int n_targets;
    lg_model_zero_grad(m);
    e.loss = lg_model_forward(m, (const int *)idx->data, (const int *)tgt->data, B, T, &n_targets) /
             n_targets;
    e.ref_loss = ((const float *)loss->data)[0];
    e.loss_err = fabs(e.loss - e.ref_loss) / fabs(e.ref_loss);
    e.logits_err = rel_error(reals(m->a.logits), (const float *)logits->data, logits->count, 1e-6);
    lg_model_backward(m, (const int *)idx->data, (const int *)tgt->data, B, T, 1.0f / n_targets);
    for (int k = 0; k < m->param_table.n_tensors; k++) {
        const lg_tensor_info *t = &m->param_table.tensors[k];
        char gname[LG_MAX_NAME + 8];
        snprintf(gname, sizeof gname, "grad.%s", t->name);
        const ref_tensor *g = ref_find(rf, gname);
        double err = g ? rel_error(reals(m->grads) + t->offset, (const float *)g->data, t->count, 1e-6) : 1;
        if (err > e.grads_err) { e.grads_err = err; e.worst = t->name; }
    }
    return e;
}

static void test_reference(results *r, const char *config_name) {
    char path[256];
    snprintf(path, sizeof path, "tests/reference/%s.bin", config_name);
    ref_file rf = {NULL, 0};
    lg_config cfg;
    if (ref_load(&rf, path) != 0) { check(r, 0, "%s: cannot read", path); return; }
    if (load_config_or_fail(r, &cfg, config_name)) return;
    int B = 2, T = (int)(ref_find(&rf, "idx")->count / 2);
    lg_model m;
    lg_error err;
    lg_model_create(&m, &cfg, B, T, &err);
    int n_weight_tensors = ref_fill(&rf, &m.param_table, m.params);
    int names_match = n_weight_tensors == m.param_table.n_tensors, ref_params = 0;
    for (int i = 0; i < rf.n; i++) ref_params += strncmp(rf.tensors[i].name, "grad.", 5) == 0;
    check(r, names_match && ref_params == n_weight_tensors,
          "%-12s the parameter names and shapes match PyTorch's (%d tensors)", config_name,
          n_weight_tensors);
    ref_errors e = reference_errors(&m, &rf, B, T);
    check(r, e.loss_err < 1e-4, "%-12s loss %.6f vs PyTorch %.6f: rel err %.1e (< 1e-4)",
          config_name, e.loss, e.ref_loss, e.loss_err);
    check(r, e.logits_err < 1e-4, "%-12s logits: rel err %.1e (< 1e-4)", config_name, e.logits_err);
    check(r, e.grads_err < 1e-3, "%-12s gradients: worst rel err %.1e (< 1e-3) in %s", config_name,
          e.grads_err, e.worst);
    lg_model_free(&m);
    ref_free(&rf);
}

/* ---- configs ---------------------------------------------------------------------------- */

/* Parameter counts published for the real models (Hugging Face model cards / safetensors
   metadata); with our padded vocabularies where they differ (GPT-2: 50257 -> 50304 rows). */
static void test_config_param_counts(results *r) {
    static const struct { const char *name; size_t params; } published[] = {
        {"gpt2", 124439808 + (50304 - 50257) * 768}, {"pythia-14m", 14067712},
        {"pythia-70m", 70426624}, {"pythia-160m", 162322944},
        {"tiny-llama-1.1b", 1100048384}, {"Llama-2-7b-hf", 6738415616},
        {"Llama-3.2-1B", 1235814400}, {"Meta-Llama-3-8B", 8030261248},
        {"Mistral-7B-v0.1", 7241732096}, {"Qwen2.5-0.5B", 494032768},
        {"SmolLM2-135M", 134515008}, {"falcon-7b", 7217189760}, {"Llama-3.2-3B", 3212749824},
        {"Llama-3.1-8B", 8030261248}, {"Llama-3.1-70B", 70553706496},
        {"Llama-2-70b-hf", 68976648192},
    };
    for (size_t i = 0; i < sizeof published / sizeof published[0]; i++) {
        lg_config cfg;
        if (load_config_or_fail(r, &cfg, published[i].name)) continue;
        size_t n = lg_params_layout(&cfg, lg_no_buf(), NULL, NULL);
        check(r, n == published[i].params, "config %-16s %zu parameters (published %zu)",
              published[i].name, n, published[i].params);
    }
}

static int write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    if (!f) return -1;
    fputs(text, f);
    return fclose(f);
}

static void test_config_errors(results *r) {
    lg_config cfg;
    lg_error err;
    /* a Llama config missing the one field LitGPT cannot derive: intermediate_size */
    FILE *in = fopen("configs/test-llama.yaml", "r");
    char line[256], text[4096] = "";
    while (in && fgets(line, sizeof line, in))
        if (strncmp(line, "intermediate_size", 17) != 0) strcat(text, line);
    if (in) fclose(in);
    write_text("build/missing-field.yaml", text);
    int rc = lg_config_load(&cfg, "build/missing-field.yaml", &err);
    check(r, rc != 0 && strstr(err.msg, "missing field intermediate_size") &&
          strstr(err.msg, "build/missing-field.yaml"),
          "a LLaMAMLP config without intermediate_size is refused: \"%s\"", err.msg);
    write_text("build/bad-value.yaml", "name: x\nn_layer: two\n");
    rc = lg_config_load(&cfg, "build/bad-value.yaml", &err);
    check(r, rc != 0 && strstr(err.msg, "line 2") && strstr(err.msg, "n_layer"),
          "config with a bad value names the line and field: \"%s\"", err.msg);
    rc = lg_config_load(&cfg, "build/no-such.yaml", &err);
    check(r, rc != 0 && strstr(err.msg, "no-such.yaml"), "missing config file: \"%s\"", err.msg);
}

/* text without the lines that start with prefix */
static void drop_lines(char *text, const char *prefix) {
    char *out = text;
    for (char *line = text; *line;) {
        char *end = strchr(line, '\n');
        size_t n = end ? (size_t)(end - line) + 1 : strlen(line);
        if (strncmp(line, prefix, strlen(prefix)) != 0) { memmove(out, line, n); out += n; }
        line += n;
    }
    *out = '\0';
}

/* Llama 3.1's rope_adjustments: LitGPT's nested YAML block read and written back, its errors,
   and that the scaling changes test-llama31's logits (so test_reference checks it). */
static void test_rope_adjustments(results *r) {
    lg_config cfg, again;
    lg_error err;
    char text[4096];
    if (load_config_or_fail(r, &cfg, "Llama-3.2-1B")) return;
    const lg_rope_adjustments *ra = &cfg.rope_adjustments;
    lg_config_to_yaml(&cfg, text, sizeof text);
    write_text("build/rope.yaml", text);
    int rc = lg_config_load(&again, "build/rope.yaml", &err);
    check(r, rc == 0 && memcmp(&cfg, &again, sizeof cfg) == 0 && ra->factor == 32.0f &&
          ra->low_freq_factor == 1.0f && ra->high_freq_factor == 4.0f && ra->original_max_seq_len == 8192,
          "Llama-3.2-1B rope_adjustments (factor %g, low %g, high %g, original %d): LitGPT's "
          "nested block, written back and read again the same", ra->factor, ra->low_freq_factor,
          ra->high_freq_factor, ra->original_max_seq_len);
    drop_lines(text, "  original_max_seq_len");
    write_text("build/rope-missing.yaml", text);
    rc = lg_config_load(&again, "build/rope-missing.yaml", &err);
    check(r, rc != 0 && strstr(err.msg, "missing field rope_adjustments.original_max_seq_len"),
          "a rope_adjustments block without a field is refused: \"%s\"", err.msg);
    lg_config plain;
    if (load_config_or_fail(r, &plain, "test-llama")) return;
    lg_config_to_yaml(&plain, text, sizeof text);
    strcat(text, "rope_adjustments: null\n");
    write_text("build/rope-null.yaml", text);
    rc = lg_config_load(&again, "build/rope-null.yaml", &err);
    check(r, rc == 0 && memcmp(&plain, &again, sizeof plain) == 0, "rope_adjustments: null is no scaling");
    strcat(text, "rope_adjustments: 8\n");
    write_text("build/rope-bad.yaml", text);
    rc = lg_config_load(&again, "build/rope-bad.yaml", &err);
    check(r, rc != 0 && strstr(err.msg, "rope_adjustments is '8'"), "a rope_adjustments value "
          "that is no block is refused: \"%s\"", err.msg);

    /* the reference of test-llama31 with the scaling removed: other logits */
    ref_file rf = {NULL, 0};
    if (ref_load(&rf, "tests/reference/test-llama31.bin") != 0 ||
        load_config_or_fail(r, &cfg, "test-llama31")) {
        check(r, 0, "tests/reference/test-llama31.bin: cannot read");
        return;
    }
    memset(&cfg.rope_adjustments, 0, sizeof cfg.rope_adjustments);
    const ref_tensor *idx = ref_find(&rf, "idx"), *logits = ref_find(&rf, "logits");
    int B = 2, T = (int)(idx->count / 2);
    lg_model m;
    double e = 0;
    if (lg_model_create(&m, &cfg, B, T, &err) == 0) {
        for (int k = 0; k < m.param_table.n_tensors; k++) {
            const lg_tensor_info *t = &m.param_table.tensors[k];
            const ref_tensor *w = ref_find(&rf, t->name);
            for (size_t i = 0; w && i < t->count; i++) reals(m.params)[t->offset + i] = ((const float *)w->data)[i];
        }
        lg_model_forward(&m, (const int *)idx->data, NULL, B, T, NULL);
        e = rel_error(reals(m.a.logits), (const float *)logits->data, logits->count, 1e-6);
        lg_model_free(&m);
    }
    check(r, e > 1e-2, "test-llama31 without its rope scaling misses PyTorch's logits by rel err "
          "%.1e (> 1e-2): the reference checks the scaling", e);
    ref_free(&rf);
}

/* ---- data --------------------------------------------------------------------------------- */

static void test_shards(results *r) {
    lg_error err;
    uint32_t tokens[101];
    for (int i = 0; i < 101; i++) tokens[i] = (uint32_t)(i * 7 % 29); /* vocabulary 30 */
    for (int bytes = 2; bytes <= 4; bytes += 2) {
        const char *path = bytes == 2 ? "build/u16.bin" : "build/u32.bin";
        lg_shard_write(path, tokens, 101, bytes, &err);
        lg_loader ld;
        int rc = lg_loader_open(&ld, path, 10, 30, 0, 0, &err);
        int in[20], tg[20], ok = rc == 0 && ld.n_windows == 10;
        /* validation order: windows from the start of the file */
        ok = ok && lg_loader_next(&ld, 2, in, tg, &err) == 0;
        for (int i = 0; ok && i < 20; i++) ok = in[i] == (int)tokens[i] && tg[i] == (int)tokens[i + 1];
        check(r, ok, "uint%d shard: header, windows in file order, targets shifted by one", bytes * 8);
        if (rc == 0) lg_loader_close(&ld);
    }
    { /* shuffled: tokens 0..100 make each window's first token 10 x its index */
        uint32_t ramp[101];
        for (int i = 0; i < 101; i++) ramp[i] = (uint32_t)i;
        lg_shard_write("build/ramp.bin", ramp, 101, 2, &err);
        lg_loader ld;
        int ok = lg_loader_open(&ld, "build/ramp.bin", 10, 101, 1, 42, &err) == 0;
        int seen[10] = {0}, in[10], tg[10], in_order = 1;
        for (int i = 0; ok && i < 10; i++) {
            lg_loader_next(&ld, 1, in, tg, &err);
            seen[in[0] / 10]++;
            in_order = in_order && in[0] == 10 * i;
        }
        for (int i = 0; i < 10; i++) ok = ok && seen[i] == 1;
        check(r, ok && !in_order, "shuffled windows: one epoch visits each of 10 windows once, not in file order");
        lg_loader_close(&ld);
    }
    { /* truncated: drop the last 3 bytes */
        FILE *f = fopen("build/u16.bin", "rb");
        char buf[2048];
        size_t n = fread(buf, 1, sizeof buf, f);
        fclose(f);
        f = fopen("build/truncated.bin", "wb");
        fwrite(buf, 1, n - 3, f);
        fclose(f);
        lg_loader ld;
        int rc = lg_loader_open(&ld, "build/truncated.bin", 10, 30, 0, 0, &err);
        check(r, rc != 0 && strstr(err.msg, "truncated.bin") && strstr(err.msg, "truncated"),
              "truncated shard refused: \"%s\"", err.msg);
        buf[0] ^= 0x55; /* wrong magic */
        f = fopen("build/bad-magic.bin", "wb");
        fwrite(buf, 1, n, f);
        fclose(f);
        rc = lg_loader_open(&ld, "build/bad-magic.bin", 10, 30, 0, 0, &err);
        check(r, rc != 0 && strstr(err.msg, "not a token shard"), "wrong magic refused: \"%s\"", err.msg);
        rc = lg_loader_open(&ld, "build/u16.bin", 200, 30, 0, 0, &err);
        check(r, rc != 0 && strstr(err.msg, "too few"), "shard shorter than one window: \"%s\"", err.msg);
        /* found when the shard is opened (its tokens are scanned), not when the window comes */
        rc = lg_loader_open(&ld, "build/u16.bin", 10, 20, 0, 0, &err);
        check(r, rc != 0 && strstr(err.msg, "token 28 is outside the model's vocabulary of 20"),
              "token beyond the vocabulary refused at opening: \"%s\"", err.msg);
        lg_loader_close(&ld);
    }
}

/* ---- optimizers and schedule ---------------------------------------------------------------- */

static void test_optimizer_math(results *r) {
    /* AdamW's first step moves each weight by lr * g / (|g| + eps) after the decoupled decay */
    float m = 0, v = 0, p = 0.5f, g = -0.25f, lr = 0.1f, wd = 0.1f;
    float expected = 0.5f * (1 - lr * wd) - lr * g / (fabsf(g) + 1e-8f);
    float got = (float)lg_adamw_element(p, g, (lg_real *)&m, (lg_real *)&v, lr, 0.9f, 0.95f,
                                        1 - 0.9f, 1 - 0.95f, 1e-8f, wd);
    check(r, fabsf(got - expected) < 1e-6f, "AdamW first step: %.7f (expected %.7f)", got, expected);
    /* SGD with momentum 0.5, no decay, constant gradient 1: updates 1, 1.5, 1.75 times lr */
    float buf = 0, w = 0;
    for (int i = 0; i < 3; i++) w = (float)lg_sgd_element(w, 1.0f, (lg_real *)&buf, 0.1f, 0.5f, 0.0f);
    check(r, fabsf(w + 0.1f * (1 + 1.5f + 1.75f)) < 1e-6f, "SGD momentum: %.6f after 3 steps", w);
    lg_args a;
    lg_args_default(&a);
    a.lr = 1.0f; a.min_lr = 0.1f; a.warmup_steps = 10; a.max_steps = 110;
    float l0 = lg_learning_rate(&a, 0), l9 = lg_learning_rate(&a, 9);
    float mid = lg_learning_rate(&a, 60), end = lg_learning_rate(&a, 110);
    check(r, fabsf(l0 - 0.1f) < 1e-6f && fabsf(l9 - 1.0f) < 1e-6f && fabsf(mid - 0.55f) < 1e-6f &&
          fabsf(end - 0.1f) < 1e-6f,
          "schedule: warmup %.2f..%.2f, cosine midpoint %.3f, end %.3f", l0, l9, mid, end);
}

/* A loader over `min_tokens` or more of the built-in task (its data seed), shuffled by seed. */
static void builtin_loader(lg_loader *ld, const lg_config *cfg, int T, uint64_t data_seed,
                           size_t min_tokens, uint64_t seed) {
    lg_error err;
    size_t n = 0;
    uint32_t *tokens = lg_builtin_task_tokens(data_seed, min_tokens, &n);
    lg_loader_from_memory(ld, tokens, n, T, cfg->vocab_size, 1, seed, &err);
}

/* Trains `steps` steps on the built-in task; returns the trainer (caller frees) and losses. */
static int train_steps(lg_trainer *tr, const lg_config *cfg, const lg_args *a, int T, int steps,
                       double *losses) {
    lg_error err;
    if (lg_trainer_create(tr, cfg, a, T, &err) != 0) { printf("    %s\n", err.msg); return -1; }
    lg_loader ld;
    builtin_loader(&ld, cfg, T, 5, (size_t)(steps + 1) * a->micro_batch_size * T + 1, a->seed);
    int rc = run_step_range(tr, &ld, 0, steps, losses);
    lg_loader_close(&ld);
    return rc;
}

/* Trains b `steps` steps on the built-in task like a reference run with these weights (n, the
   whole layout) and losses: how far its weights land from them (relative, -1 when it does not
   train), and its largest relative loss difference raised into *loss_apart. */
static double trained_apart(const lg_config *cfg, const lg_args *b, int T, int steps,
                            const lg_real *weights, size_t n, const double *losses,
                            double *loss_apart) {
    double got_losses[16];
    lg_trainer tr;
    if (steps > 16 || train_steps(&tr, cfg, b, T, steps, got_losses) != 0) return -1;
    lg_real *got = trained_weights(&tr);
    double apart = rel_error(got, weights, n, 1e-6);
    for (int k = 0; k < steps; k++)
        *loss_apart = fmax(*loss_apart, fabs(got_losses[k] - losses[k]) / losses[k]);
    LG_FREE(got);
    lg_trainer_free(&tr);
    return apart;
}

/* The tiny-config optimizer comparison: args for 100 steps of the built-in task at B 8, T 16. */
static lg_args optimizer_run_args(lg_optimizer_kind kind, float lr, float min_lr, float beta1,
                                  float beta2, float weight_decay) {
    lg_args a;
    lg_args_default(&a);
    a.precision = LG_PRECISION_32_TRUE;
    a.optimizer = kind;
    a.lr = lr;
    a.min_lr = min_lr;
    a.beta1 = beta1;
    a.beta2 = beta2;
    a.weight_decay = weight_decay;
    a.warmup_steps = 10;
    a.max_steps = 100;
    a.micro_batch_size = 8;
    return a;
}

/* The mean loss of steps 91-100; the trainer stays alive in *tr for the caller to inspect and
   free. 1e9 when the run fails. */
static double tail_loss_of_100_steps(lg_trainer *tr, const lg_config *cfg, const lg_args *a) {
    double losses[100], tail = 0;
    if (train_steps(tr, cfg, a, 16, 100, losses) != 0) return 1e9;
    for (int s = 90; s < 100; s++) tail += losses[s] / 10;
    return tail;
}

/* Each optimizer's element update against the paper's equations written out in double. */
static void test_optimizer_elements(results *r) {
    lg_rng rng;
    lg_rng_seed(&rng, 21);
    double worst = 0;
    for (int i = 0; i < 1000; i++) {
        double p = lg_rng_normal(&rng), g = lg_rng_normal(&rng) * 0.1, m = lg_rng_normal(&rng) * 0.05;
        double v = fabs(lg_rng_normal(&rng)) * 0.01, lr = 1e-3, wd = 0.1, b1 = 0.9, b2 = 0.99;
        int t = 1 + i % 50;
        /* AdamW (Loshchilov & Hutter): decay, moments, bias correction */
        double m1 = b1 * m + (1 - b1) * g, v1 = b2 * v + (1 - b2) * g * g;
        double adamw = p * (1 - lr * wd) - lr * (m1 / (1 - pow(b1, t))) / (sqrt(v1 / (1 - pow(b2, t))) + 1e-8);
        /* Lion (Chen et al.): sign of the interpolation, decay, then the momentum */
        double c = b1 * m + (1 - b1) * g;
        double lion = p * (1 - lr * wd) - lr * (c > 0 ? 1 : -1), m_lion = b2 * m + (1 - b2) * g;
        /* SGD with momentum and L2 decay (PyTorch's convention) */
        double buf = 0.9 * m + (g + wd * p), sgd = p - lr * buf;
        /* SophiaG (Liu et al.): momentum b1 = 0.965, decay, clip(m / max(rho h, 1e-15), 1) */
        double rho = 0.04, h = v * 100, ms = 0.965 * m + 0.035 * g;
        double ratio = fmin(fabs(ms) / fmax(rho * h, 1e-15), 1.0);
        double sophia = p * (1 - lr * wd) - lr * (ms > 0 ? 1 : -1) * ratio;
        lg_real sophia_m = (lg_real)m;
        double got_sophia = lg_sophia_element((lg_real)p, (lg_real)g, &sophia_m, (lg_real)h, (lg_real)lr,
                                              0.965f, (lg_real)rho, (lg_real)wd);
        lg_real fm = (lg_real)m, fv = (lg_real)v, lm = (lg_real)m, sm = (lg_real)m;
        double got_adamw = lg_adamw_element((lg_real)p, (lg_real)g, &fm, &fv, (lg_real)lr, (lg_real)b1,
                                            (lg_real)b2, (lg_real)(1 - pow(b1, t)),
                                            (lg_real)(1 - pow(b2, t)), 1e-8f, (lg_real)wd);
        double got_lion = lg_lion_element((lg_real)p, (lg_real)g, &lm, (lg_real)lr, (lg_real)b1, (lg_real)b2, (lg_real)wd);
        double got_sgd = lg_sgd_element((lg_real)p, (lg_real)g, &sm, (lg_real)lr, 0.9f, (lg_real)wd);
        double e = fmax(fabs(got_adamw - adamw), fabs(got_lion - lion));
        e = fmax(e, fmax(fabs(got_sgd - sgd), fabs(lm - m_lion)));
        e = fmax(e, fmax(fabs(fm - m1), fabs(sm - buf)));
        e = fmax(e, fmax(fabs(got_sophia - sophia), fabs(sophia_m - ms)));
        worst = fmax(worst, e / (1 + fabs(p)));
    }
    check(r, worst < 1e-6, "AdamW, Lion, SophiaG, SGD element updates vs the papers' equations in double: "
          "worst error %.1e (< 1e-6, fp32 rounding)", worst);
}

/* Lion trains each family about as well as AdamW: at the learning rate 3.3x smaller and the
   weight decay 3x larger that its authors advise, the loss after 100 steps is within 10% of
   AdamW's (measured: within 4%). It keeps one state, AdamW two. */
static void test_lion_trains(results *r) {
    const char *names[3] = {"test-gpt2", "test-pythia", "test-llama"};
    for (int i = 0; i < 3; i++) {
        lg_config cfg;
        if (load_config_or_fail(r, &cfg, names[i])) continue;
        double tail[2];
        size_t state_bytes[2];
        for (int lion = 0; lion <= 1; lion++) {
            lg_args a = lion ? optimizer_run_args(LG_OPTIMIZER_LION, 3e-3f, 3e-4f, 0.9f, 0.99f, 0.3f)
                             : optimizer_run_args(LG_OPTIMIZER_ADAMW, 1e-2f, 1e-3f, 0.9f, 0.95f, 0.1f);
            lg_trainer tr;
            tail[lion] = tail_loss_of_100_steps(&tr, &cfg, &a);
            state_bytes[lion] = tr.plan.ranks ? lg_plan_group_bytes(&tr.plan.ranks[0], LG_GROUP_OPTIMIZER,
                                                                    LG_POOL_DEVICE)
                                              : 0;
            lg_trainer_free(&tr);
        }
        check(r, tail[1] < 1.1 * tail[0] && 2 * state_bytes[1] == state_bytes[0],
              "%-12s Lion's loss %.4f after 100 steps vs AdamW's %.4f (< 1.1x); state %zu vs %zu bytes",
              names[i], tail[1], tail[0], state_bytes[1], state_bytes[0]);
    }
}

/* Sophia, like Lion, trains each family about as well as AdamW (same schedule, lr 1e-2): the
   loss after 100 steps within 10% of AdamW's (measured: within 4%). It refreshes its Hessian
   estimate every 10 steps with one more forward and backward. */
static void test_sophia_trains(results *r) {
    const char *names[3] = {"test-gpt2", "test-pythia", "test-llama"};
    for (int i = 0; i < 3; i++) {
        lg_config cfg;
        if (load_config_or_fail(r, &cfg, names[i])) continue;
        double tail[2];
        int has_sampled = 0;
        for (int sophia = 0; sophia <= 1; sophia++) {
            lg_args a = sophia ? optimizer_run_args(LG_OPTIMIZER_SOPHIA, 1e-2f, 3e-4f, 0.965f, 0.99f, 0.1f)
                               : optimizer_run_args(LG_OPTIMIZER_ADAMW, 1e-2f, 1e-3f, 0.9f, 0.95f, 0.1f);
            lg_trainer tr;
            tail[sophia] = tail_loss_of_100_steps(&tr, &cfg, &a);
            if (sophia && tr.plan.ranks)
                has_sampled = lg_plan_find(&tr.plan.ranks[0], "tokens.sampled") != NULL;
            lg_trainer_free(&tr);
        }
        check(r, tail[1] < 1.1 * tail[0] && has_sampled,
              "%-12s Sophia's loss %.4f after 100 steps vs AdamW's %.4f (< 1.1x); its sampled "
              "labels are a region of the plan", names[i], tail[1], tail[0]);
    }
}

/* 8-bit state: quantize -> dequantize returns the map entry nearest each value, so the error
   of a value x in a block of largest magnitude A is at most half the gap around x / A: at most
   0.9 / 63 / 2 = 0.0072 A (signed, 6 fraction bits in the top decade) and 0.9 / 127 / 2 =
   0.0036 A (unsigned), and 10x smaller per decade below. */
static void test_quantization(results *r) {
    lg_optimizer opt;
    memset(&opt, 0, sizeof opt);
    lg_dynamic_map(opt.signed_map, 1);
    lg_dynamic_map(opt.unsigned_map, 0);
    lg_rng rng;
    lg_rng_seed(&rng, 8);
    double worst_signed = 0, worst_unsigned = 0;
    int sorted = 1, ok = 1;
    for (int i = 1; i < 256; i++)
        sorted = sorted && opt.signed_map[i - 1] <= opt.signed_map[i] &&
                 opt.unsigned_map[i - 1] <= opt.unsigned_map[i];
    for (int block = 0; block < 200; block++) {
        lg_real x[LG_QUANT_BLOCK], y[LG_QUANT_BLOCK];
        uint8_t codes[LG_QUANT_BLOCK];
        float scale;
        for (int is_signed = 0; is_signed <= 1; is_signed++) {
            const float *map = is_signed ? opt.signed_map : opt.unsigned_map;
            /* magnitudes spread over six decades, as moments are */
            for (int i = 0; i < LG_QUANT_BLOCK; i++) {
                double magnitude = pow(10.0, -6.0 * lg_rng_uniform(&rng)) * (block + 1);
                x[i] = (lg_real)(is_signed && lg_rng_uniform(&rng) < 0.5f ? -magnitude : magnitude);
            }
            lg_quantize_block(map, codes, &scale, LG_QUANT_BLOCK, x);
            lg_dequantize_block(map, codes, scale, LG_QUANT_BLOCK, y);
            for (int i = 0; i < LG_QUANT_BLOCK; i++) {
                double err = fabs((double)y[i] - x[i]) / scale;
                /* the nearest entry: no other entry is closer */
                int code = codes[i];
                double nx = x[i] / scale;
                if (code > 0) ok = ok && fabs(nx - map[code]) <= fabs(nx - map[code - 1]) + 1e-7;
                if (code < 255) ok = ok && fabs(nx - map[code]) <= fabs(nx - map[code + 1]) + 1e-7;
                if (is_signed) worst_signed = fmax(worst_signed, err);
                else worst_unsigned = fmax(worst_unsigned, err);
            }
        }
    }
    check(r, sorted && ok && worst_signed <= 0.9 / 63 / 2 + 1e-6 && worst_unsigned <= 0.9 / 127 / 2 + 1e-6,
          "8-bit blocks: nearest map entry, error at most %.4f (signed) and %.4f (unsigned) of "
          "the block's largest magnitude", worst_signed, worst_unsigned);
}

/* AdamW with compact state trains like fp32 state: the mean loss of steps 91-100 on the
   built-in task within 0.08 of it. At that point the loss still falls about 0.01 a step, so two
   runs whose updates differ by rounding drift apart by a few steps' progress (measured: bf16
   state 0.05 lower, 8-bit within 0.001); a broken state format stays near the start (3.3) or
   diverges. */
static void test_compact_state_trains(results *r) {
    lg_config cfg;
    lg_config_builtin(&cfg);
    const lg_state_format formats[3] = {LG_STATE_AS_PRECISION, LG_STATE_BF16, LG_STATE_8BIT};
    double tail[3];
    for (int f = 0; f < 3; f++) {
        lg_args a;
        lg_args_default(&a);
        a.precision = LG_PRECISION_32_TRUE;
        a.optimizer_state = formats[f];
        a.max_steps = 100;
        double losses[100];
        lg_trainer tr;
        tail[f] = 1e9;
        if (train_steps(&tr, &cfg, &a, 64, 100, losses) != 0) continue;
        tail[f] = 0;
        for (int s = 90; s < 100; s++) tail[f] += losses[s] / 10;
        lg_trainer_free(&tr);
    }
    check(r, fabs(tail[1] - tail[0]) < 0.08 && fabs(tail[2] - tail[0]) < 0.08,
          "AdamW state fp32 / bf16 / 8-bit: loss %.4f / %.4f / %.4f after 100 steps", tail[0],
          tail[1], tail[2]);
}

/* The plan's optimizer state for each choice, as allocated. */
static void test_optimizer_state_bytes(results *r) {
    lg_config cfg;
    lg_config_builtin(&cfg);
    /* which tensors reach LG_COMPACT_MIN elements, from the table */
    lg_tensor_table table;
    lg_table_alloc(&table, &cfg);
    size_t n = lg_params_layout(&cfg, lg_no_buf(), NULL, &table), large = 0, blocks = 0;
    for (int i = 0; i < table.n_tensors; i++)
        if (table.tensors[i].count >= LG_COMPACT_MIN) {
            large += table.tensors[i].count;
            blocks += (table.tensors[i].count + LG_QUANT_BLOCK - 1) / LG_QUANT_BLOCK;
        }
    lg_tensor_table_free(&table);
    size_t f32 = sizeof(lg_real), small = n - large;
#define LG_ALIGNED(b) (((b) + LG_ALIGN - 1) / LG_ALIGN * LG_ALIGN)
    const struct { const char *what; lg_optimizer_kind kind; float momentum; lg_state_format format; size_t bytes; } cases[6] = {
        {"AdamW", LG_OPTIMIZER_ADAMW, 0, LG_STATE_AS_PRECISION, 2 * LG_ALIGNED(n * f32)},
        {"AdamW bf16", LG_OPTIMIZER_ADAMW, 0, LG_STATE_BF16, 2 * (LG_ALIGNED(large * 2) + LG_ALIGNED(small * f32))},
        {"AdamW 8-bit", LG_OPTIMIZER_ADAMW, 0, LG_STATE_8BIT,
         2 * (LG_ALIGNED(blocks * LG_QUANT_BLOCK) + LG_ALIGNED(small * f32) + LG_ALIGNED(blocks * f32))},
        {"Lion", LG_OPTIMIZER_LION, 0, LG_STATE_AS_PRECISION, LG_ALIGNED(n * f32)},
        {"SGD", LG_OPTIMIZER_SGD, 0, LG_STATE_AS_PRECISION, 0},
        {"SGD momentum", LG_OPTIMIZER_SGD, 0.9f, LG_STATE_AS_PRECISION, LG_ALIGNED(n * f32)}};
#undef LG_ALIGNED
    for (int k = 0; k < 6; k++) {
        lg_args a;
        lg_args_default(&a);
        a.precision = LG_PRECISION_32_TRUE;
        a.micro_batch_size = 2;
        a.optimizer = cases[k].kind;
        a.momentum = cases[k].momentum;
        a.optimizer_state = cases[k].format;
        lg_error err;
        lg_trainer tr;
        int rc = create_counting(&tr, &cfg, &a, 8, &err);
        if (rc != 0) { check(r, 0, "%s", err.msg); continue; }
        size_t planned = lg_plan_group_bytes(&tr.plan.ranks[0], LG_GROUP_OPTIMIZER, LG_POOL_DEVICE);
        int arena_ok = 0;
        for (int i = 0; i < test_allocations.n; i++)
            arena_ok |= test_allocations.blocks[i] == tr.ranks[0].rank.arena[LG_POOL_DEVICE] &&
                        test_allocations.sizes[i] == tr.plan.ranks[0].pool_bytes[LG_POOL_DEVICE] + LG_ALIGN;
        check(r, planned == cases[k].bytes && arena_ok, "%-13s optimizer state %6zu bytes for %zu "
              "parameters (%zu in tensors of %d+ elements), allocated in the plan's arena",
              cases[k].what, planned, n, large, LG_COMPACT_MIN);
        lg_trainer_free(&tr);
    }
}

static void test_clipping(results *r) {
    lg_config cfg;
    lg_error err;
    lg_model m;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    lg_model_create(&m, &cfg, 1, 4, &err);
    lg_rng rng;
    lg_rng_seed(&rng, 3);
    fill_normal(reals(m.grads), m.n_params, 1.0f, &rng);
    float before = lg_grad_norm(&m), factor = lg_clip_factor(before, 2.0f);
    for (size_t k = 0; k < m.n_params; k++) reals(m.grads)[k] *= factor;
    float after = lg_grad_norm(&m);
    check(r, fabsf(after - 2.0f) < 1e-4f, "clipping: global norm %.1f -> %.5f (max 2)", before, after);
    lg_model_free(&m);
}

/* ---- training ------------------------------------------------------------------------------ */

/* Trains a config on the built-in task; returns the loss of each step in losses (steps). */
static int train_builtin(const lg_config *cfg, const lg_args *a, int T, int steps, double *losses,
                         lg_real **final_params, size_t *n_params) {
    lg_error err;
    lg_trainer tr;
    if (lg_trainer_create(&tr, cfg, a, T, &err) != 0) { printf("    %s\n", err.msg); return -1; }
    lg_loader ld;
    builtin_loader(&ld, cfg, T, 1, 20000, a->seed);
    int rc = run_step_range(&tr, &ld, 0, steps, losses);
    if (rc == 0 && final_params) {
        *n_params = tr.ranks[0].model.n_params;
        *final_params = new_reals(*n_params);
        lg_copy(NULL, lg_buf_of(*final_params), tr.ranks[0].model.params, *n_params);
    }
    lg_loader_close(&ld);
    lg_trainer_free(&tr);
    return rc;
}

static void test_accumulation(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-pythia")) return;
    lg_args a;
    lg_args_default(&a);
    a.precision = LG_PRECISION_32_TRUE;
    a.warmup_steps = 0;
    double losses[3];
    lg_real *p1 = NULL, *p8 = NULL;
    size_t n = 0;
    a.micro_batch_size = 1; a.global_batch_size = 8;
    train_builtin(&cfg, &a, 16, 3, losses, &p1, &n);
    a.micro_batch_size = 8; a.global_batch_size = 8;
    train_builtin(&cfg, &a, 16, 3, losses, &p8, &n);
    double e = p1 && p8 ? rel_error(p1, p8, n, 1e-3) : 1;
    check(r, e < 1e-5, "-b 1 -g 8 and -b 8 -g 8: parameters after 3 steps, rel err %.1e (< 1e-5)", e);
    LG_FREE(p1);
    LG_FREE(p8);
}

/* Weight initialisation on host threads: lg_rng_skip(n) leaves the state of n draws, and
   tensors of several chunks (a padded vocabulary, a residual projection, LoRA's A) get the
   bits, and leave the stream, of drawing every element in order on one thread. */
static void test_parallel_init(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-gpt2")) return;
    lg_rng_jumps *jumps = (lg_rng_jumps *)malloc(sizeof *jumps);
    lg_rng_jumps_make(jumps);
    const uint64_t skips[5] = {0, 1, 64, 1000, 123457};
    int skipped = 1;
    for (int k = 0; k < 5; k++) {
        lg_rng a, b;
        lg_rng_seed(&a, 5 + k);
        b = a;
        for (uint64_t i = 0; i < skips[k]; i++) lg_rng_u64(&a);
        lg_rng_skip(&b, jumps, skips[k]);
        skipped &= a.state == b.state;
    }
    check(r, skipped, "rng: skipping 0, 1, 64, 1000, 123457 draws = drawing them");
    free(jumps);
    const lg_tensor_kind kinds[3] = {LG_TENSOR_EMBEDDING, LG_TENSOR_RESIDUAL, LG_TENSOR_LORA_A};
    const int rows[3] = {cfg.padded_vocab_size, 2003, 1951}, cols[3] = {5000, 100, 77};
    for (int k = 0; k < 3; k++) {
        lg_tensor_info t;
        memset(&t, 0, sizeof t);
        t.kind = kinds[k];
        t.rows = rows[k];
        t.cols = cols[k];
        t.count = (size_t)rows[k] * cols[k];
        size_t live = k == 0 ? (size_t)cfg.vocab_size * t.cols : t.count;
        lg_buf want = lg_buf_of((lg_real *)malloc(t.count * sizeof(lg_real)));
        lg_buf got = lg_buf_of((lg_real *)malloc(t.count * sizeof(lg_real)));
        lg_rng a, b;
        lg_rng_seed(&a, 99);
        b = a;
        lg_init_range(&cfg, &t, live, want, 0, t.count, &a);
        lg_init_tensor(NULL, &cfg, &t, got, &b);
        check(r, memcmp(want.data, got.data, t.count * sizeof(lg_real)) == 0 && a.state == b.state,
              "initialisation of %zu elements (kind %d) in chunks of %d: the bits and the stream "
              "of one thread", t.count, (int)t.kind, LG_INIT_CHUNK);
        free(want.data);
        free(got.data);
    }
}

static void test_determinism(results *r) {
    lg_config cfg;
    lg_config_builtin(&cfg);
    lg_args a;
    lg_args_default(&a);
    double l1[5], l2[5];
    train_builtin(&cfg, &a, 32, 5, l1, NULL, NULL);
    train_builtin(&cfg, &a, 32, 5, l2, NULL, NULL);
    check(r, memcmp(l1, l2, sizeof l1) == 0, "same seed, bitwise the same losses (%.6f ... %.6f)",
          l1[0], l1[4]);
}

/* Each family memorises one fixed window: forward, backward and optimizer work together. */
static void test_families_memorise(results *r) {
    const char *names[] = {"test-gpt2", "test-pythia", "test-llama", "test-falcon", "test-llama31"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        lg_config cfg;
        if (load_config_or_fail(r, &cfg, names[i])) continue;
        lg_args a;
        lg_args_default(&a);
        a.micro_batch_size = 1;
        a.max_steps = 80;
        a.warmup_steps = 5;
        a.lr = 1e-2f;
        a.min_lr = 1e-3f;
        lg_error err;
        lg_trainer tr;
        lg_trainer_create(&tr, &cfg, &a, 16, &err);
        size_t n = 0;
        uint32_t *tokens = lg_builtin_task_tokens(1, 17, &n);
        lg_loader ld;
        lg_loader_from_memory(&ld, tokens, 17, 16, cfg.vocab_size, 1, a.seed, &err);
        lg_step_stats first, st = {0};
        int rc = lg_trainer_step(&tr, &ld, 0, &first, &err);
        for (int s = 1; s < a.max_steps && rc == 0; s++) rc = lg_trainer_step(&tr, &ld, s, &st, &err);
        check(r, rc == 0 && st.loss < 0.05, "%-12s memorises one window: loss %.3f -> %.4f in %d steps (< 0.05)",
              names[i], first.loss, st.loss, a.max_steps);
        lg_loader_close(&ld);
        lg_trainer_free(&tr);
    }
}

/* ---- the command line --------------------------------------------------------------------- */

/* Runs ./train with args; checks the exit code and that the output contains want. */
/* Runs `program args`; checks its exit code and that its output holds `want`. */
static void expect_program(results *r, const char *program, const char *args, int want_code,
                           const char *want) {
    char cmd[4096], out[8192] = "";
    snprintf(cmd, sizeof cmd, "%s %s 2>&1", program, args);
    FILE *p = popen(cmd, "r");
    size_t n = p ? fread(out, 1, sizeof out - 1, p) : 0;
    out[n] = '\0';
    int status = p ? pclose(p) : -1;
    int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    char *last = out + n;
    while (last > out && (last[-1] == '\n')) *--last = '\0';
    while (last > out && last[-1] != '\n') last--;
    check(r, code == want_code && strstr(out, want), "%s %s -> exit %d: \"%s\"", program, args,
          code, last);
}

static void expect_cli(results *r, const char *args, int want_code, const char *want) {
    expect_program(r, "./train", args, want_code, want);
}

/* Every enum's names parse back to their values through the one helper (lg_name_index), and
   an unknown name is refused; the command line's flags read them so (-o, --backend,
   --optimizer-state, --strategy, -p, --quantize). */
static void test_enum_names(results *r) {
    int ok = 1, names = 0;
    for (int k = 0; k < LG_OPTIMIZER_KINDS; k++, names++) {
        lg_optimizer_kind got;
        ok &= lg_optimizer_parse(lg_optimizer_name((lg_optimizer_kind)k), &got) == 0 && (int)got == k;
    }
    for (int k = 0; k < LG_BACKENDS; k++, names++) {
        lg_backend got;
        ok &= lg_backend_parse(lg_backend_name((lg_backend)k), &got) == 0 && (int)got == k;
    }
    for (int k = 0; k <= LG_PRECISION_BF16_MIXED; k++, names++) {
        lg_precision got;
        ok &= lg_precision_parse(lg_precision_name((lg_precision)k), &got) == 0 && (int)got == k;
    }
    for (int k = 0; k <= LG_STRATEGY_HYBRID_SHARD; k++, names++) {
        lg_strategy got;
        ok &= lg_strategy_parse(lg_strategy_name((lg_strategy)k), &got) == 0 && (int)got == k;
    }
    for (int k = 0; k <= LG_QUANTIZE_NF4_DQ; k++, names++) {
        lg_quantization got;
        ok &= lg_quantization_parse(lg_quantization_name((lg_quantization)k), &got) == 0 && (int)got == k;
    }
    lg_state_format state;
    lg_optimizer_kind kind;
    ok &= lg_state_format_parse("8bit", &state) == 0 && state == LG_STATE_8BIT &&
          lg_state_format_parse("", &state) != 0 && lg_optimizer_parse("adam", &kind) != 0;
    check(r, ok && names == 18, "enum names: %d names of 5 enums parse back to their values, "
          "'adam' and an empty state format are refused", names);
    expect_cli(r, "-o adam", 2, "-o/--optimizer: 'adam' is not adamw, sgd, lion or sophia");
    expect_cli(r, "--optimizer-state 4bit", 2, "'4bit' is not bf16 or 8bit");
}

static void test_cli(results *r) {
    expect_cli(r, "--bogus", 2, "unknown option --bogus");
    expect_cli(r, "-b", 2, "-b needs a value");
    expect_cli(r, "-b x", 2, "-b/--micro-batch-size: 'x' is not an integer");
    expect_cli(r, "--lr fast", 2, "--lr: 'fast' is not a number");
    expect_cli(r, "--offload=state,ram", 2, "--offload: 'ram' is not a part to offload");
    expect_cli(r, "--offload grads --plan", 2, "--offload: 'grads' is not a part to offload");
    expect_cli(r, "--offload --plan -c test-llama -t 16", 0, "| offload |");
    expect_cli(r, "--offload activations --max-steps 1", 2, "needs --recompute block");
    expect_cli(r, "--recompute block --offload activations,state --max-steps 1 --eval-iters 1", 0,
               "step     1");
    expect_cli(r, "-p 16-true --max-steps 1 --eval-iters 1", 0, "16-true");
    expect_cli(r, "-p fp8", 2, "'fp8' is not one of");
    expect_cli(r, "--strategy zero3", 2, "--strategy: 'zero3' is not no-shard");
    expect_cli(r, "--nodes 0", 2, "--nodes must be at least 1");
    expect_cli(r, "-b 3 -g 8", 2, "-g/--global-batch-size 8 is not a multiple of -b/--micro-batch-size 3");
    expect_cli(r, "-c test-llama --data build/u16.bin -t 100", 2,
               "-t/--max-seq-length 100 exceeds the model's block_size 16");
    expect_cli(r, "-c no-such-model", 2, "no no-such-model.yaml in ./configs");
    expect_cli(r, "-c build/missing-field.yaml", 2, "missing field intermediate_size");
    expect_cli(r, "-c test-llama --data build/truncated.bin", 2, "truncated");
    expect_cli(r, "-c test-llama --data build/bad-magic.bin", 2, "not a token shard");
    expect_cli(r, "-c test-llama --data build/no-such.bin", 2, "build/no-such.bin: cannot open");
    expect_cli(r, "--data build/u16.bin", 2, "--data needs -c/--config");
    expect_cli(r, "-c test-llama --data build/u16.bin --val-data build/u32.bin -t 10 -b 2 "
                  "--max-steps 0 --eval-iters 2", 0, "val loss");
    expect_cli(r, "-c test-llama --data build/u16.bin -t 10 -b 2 --max-steps 2 --prompt \"1 2\" "
                  "--sample-tokens 3 --log build/log.jsonl --out build/run", 0, "saved build/run/step-2");
    FILE *f = fopen("build/log.jsonl", "r");
    char line[512] = "";
    int ok = f && fgets(line, sizeof line, f) && strstr(line, "\"step\":1,\"loss\":") &&
             strstr(line, "\"lr\":") && strstr(line, "\"grad_norm\":") && strstr(line, "\"ms\":") &&
             strstr(line, "\"tokens_per_s\":");
    if (f) fclose(f);
    line[strcspn(line, "\n")] = '\0';
    check(r, ok, "--log writes one JSON object a step: %s", line);
}

/* ---- precision ----------------------------------------------------------------------------- */

static int is_nan_f16(uint16_t h) { return (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu); }
static int is_nan_bf16(uint16_t h) { return (h & 0x7F80u) == 0x7F80u && (h & 0x7Fu); }

static void test_conversions(results *r) {
    int bad16 = 0, badbf = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        uint16_t x = (uint16_t)h;
        uint16_t back16 = lg_f32_to_f16(lg_f16_to_f32(x));
        uint16_t backbf = lg_f32_to_bf16(lg_bf16_to_f32(x));
        /* NaNs come back NaN (quieted); every other pattern exactly */
        bad16 += is_nan_f16(x) ? !is_nan_f16(back16) || (x & 0x200u && back16 != x) : back16 != x;
        badbf += is_nan_bf16(x) ? !is_nan_bf16(backbf) || (x & 0x40u && backbf != x) : backbf != x;
    }
    check(r, bad16 == 0 && badbf == 0, "every fp16 and bf16 bit pattern round-trips through fp32 "
          "(%d, %d mismatches)", bad16, badbf);
    /* round to nearest, ties to even; values as exact fp32 expressions */
    const struct { float in; uint16_t f16; } f16_cases[] = {
        {1.0f + 0x1p-11f, 0x3C00},        /* tie between 1 and 1+2^-10: even (1) */
        {1.0f + 3 * 0x1p-11f, 0x3C02},    /* tie between 1+2^-10 and 1+2^-9: even */
        {1.0f + 0x1p-11f + 0x1p-20f, 0x3C01}, /* just above the tie: up */
        {0x1p-25f, 0x0000},               /* half the least subnormal: tie, to 0 */
        {3 * 0x1p-25f, 0x0002},           /* tie between subnormals 1 and 2: even */
        {0x1p-24f, 0x0001},               /* least subnormal */
        {0x1p-14f - 0x1p-25f, 0x0400},    /* rounds up into the least normal */
        {-0.0f, 0x8000},
        {65504.0f, 0x7BFF},               /* largest finite */
        {65519.0f, 0x7BFF},               /* below the tie with 65536 */
        {65520.0f, 0x7C00},               /* the tie rounds to even: infinity */
        {INFINITY, 0x7C00},
        {-INFINITY, 0xFC00},
        {1e-30f, 0x0000},                 /* far below: zero */
    };
    int bad = 0;
    for (size_t i = 0; i < sizeof f16_cases / sizeof f16_cases[0]; i++)
        if (lg_f32_to_f16(f16_cases[i].in) != f16_cases[i].f16) {
            bad++;
            printf("    f16(%a) = %04x, want %04x\n", f16_cases[i].in, lg_f32_to_f16(f16_cases[i].in),
                   f16_cases[i].f16);
        }
    const struct { float in; uint16_t bf16; } bf16_cases[] = {
        {1.0f + 0x1p-8f, 0x3F80},         /* tie between 1 and 1+2^-7: even */
        {1.0f + 3 * 0x1p-8f, 0x3F82},     /* tie: even */
        {1.0f + 0x1p-8f + 0x1p-20f, 0x3F81},
        {3.4028235e38f, 0x7F80},          /* FLT_MAX rounds to infinity */
        {-INFINITY, 0xFF80},
        {0x1p-140f, 0x0000 | (uint16_t)(lg_f32_bits(0x1p-140f) >> 16)}, /* subnormal, exact */
    };
    for (size_t i = 0; i < sizeof bf16_cases / sizeof bf16_cases[0]; i++)
        if (lg_f32_to_bf16(bf16_cases[i].in) != bf16_cases[i].bf16) {
            bad++;
            printf("    bf16(%a) = %04x, want %04x\n", bf16_cases[i].in,
                   lg_f32_to_bf16(bf16_cases[i].in), bf16_cases[i].bf16);
        }
    /* NaN in: NaN out, even when the payload sits only in bits bf16 drops */
    float nan_low = lg_bits_f32(0x7F800001u), nan_neg = lg_bits_f32(0xFFC00000u);
    bad += !is_nan_bf16(lg_f32_to_bf16(nan_low)) || !is_nan_f16(lg_f32_to_f16(nan_low));
    bad += lg_f32_to_bf16(nan_neg) != 0xFFC0 || !isnan(lg_bf16_to_f32(lg_f32_to_bf16(nan_neg)));
    check(r, bad == 0, "round-to-nearest-even, subnormals, overflow to Inf, NaN payloads (%d wrong)", bad);
}

/* Stochastic rounding is unbiased: the mean of many roundings of v is v. */
static void test_stochastic_rounding(results *r) {
    const float values[3] = {1.0f + 0.3f * 0x1p-7f, -0.0123456f, 3.3e-3f};
    const lg_dtype types[2] = {LG_DTYPE_BF16, LG_DTYPE_F16};
    int ok = 1;
    double worst = 0;
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < 3; i++) {
            const int n = 200000;
            double sum = 0;
            for (int k = 0; k < n; k++)
                sum += lg_half_to_f32(lg_round_stochastic(values[i], types[t], lg_hash_uniform(42, (uint64_t)k)), types[t]);
            /* one rounding's spread is at most the gap g between neighbours; the mean of n
               has standard deviation <= g / (2 sqrt(n)): allow 5 of those */
            uint16_t lo = lg_half_from_f32(values[i], types[t]);
            double gap = fabs(lg_half_to_f32((uint16_t)(lo + 1), types[t]) - lg_half_to_f32(lo, types[t]));
            double err = fabs(sum / n - values[i]) / gap;
            worst = fmax(worst, err);
            ok = ok && err < 5 * 0.5 / sqrt((double)n);
        }
    check(r, ok, "stochastic rounding is unbiased: mean of 200000 roundings within %.4f gaps of "
          "the value (bf16, fp16)", worst);
}

/* One window memorised in bf16-true at a learning rate whose updates are below half a bf16
   step of most weights: round-to-nearest drops them, stochastic rounding keeps learning. */
static void test_stochastic_rounding_learns(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    double drop[2], first = 0;
    for (int stochastic = 0; stochastic <= 1; stochastic++) {
        lg_args a;
        lg_args_default(&a);
        a.precision = LG_PRECISION_BF16_TRUE;
        a.micro_batch_size = 1;
        a.lr = a.min_lr = 2e-5f;
        a.warmup_steps = 0;
        a.max_steps = 100;
        lg_error err;
        lg_trainer tr;
        lg_trainer_create(&tr, &cfg, &a, 16, &err);
        tr.ranks[0].opt.stochastic = stochastic;
        size_t n = 0;
        uint32_t *tokens = lg_builtin_task_tokens(1, 17, &n);
        lg_loader ld;
        lg_loader_from_memory(&ld, tokens, 17, 16, cfg.vocab_size, 1, a.seed, &err);
        lg_step_stats st = {0};
        for (int s = 0; s < a.max_steps; s++) {
            lg_trainer_step(&tr, &ld, s, &st, &err);
            if (s == 0) first = st.loss;
        }
        drop[stochastic] = first - st.loss;
        lg_loader_close(&ld);
        lg_trainer_free(&tr);
    }
    check(r, drop[1] > 2 * drop[0] && drop[1] > 0.02, "bf16-true at lr 2e-5, 100 steps from %.3f: "
          "the loss falls %.4f with stochastic rounding, %.4f with round-to-nearest", first,
          drop[1], drop[0]);
}

/* Every precision trains each family like 32-true. Tolerance: 0.02 in mean loss after 50 steps
   (from 3.4). Half storage perturbs activations by ~0.4% (bf16) and weights by one rounding;
   over 50 steps of a 2-layer model this moves the loss by under 0.005 here (measured), so 0.02
   leaves room for other seeds while still catching a broken mode, which stays near 3.4 or
   diverges. */
static void test_precisions_train(results *r) {
    const char *names[3] = {"test-gpt2", "test-pythia", "test-llama"};
    const lg_precision modes[4] = {LG_PRECISION_BF16_MIXED, LG_PRECISION_16_MIXED,
                                   LG_PRECISION_BF16_TRUE, LG_PRECISION_16_TRUE};
    for (int i = 0; i < 3; i++) {
        lg_config cfg;
        if (load_config_or_fail(r, &cfg, names[i])) continue;
        double losses[50], reference = 0, worst = 0;
        const char *worst_mode = "";
        for (int k = -1; k < 4; k++) {
            lg_args a;
            lg_args_default(&a);
            a.precision = k < 0 ? LG_PRECISION_32_TRUE : modes[k];
            a.lr = 1e-2f;
            a.min_lr = 1e-3f;
            a.warmup_steps = 5;
            a.max_steps = 50;
            a.micro_batch_size = 8;
            if (train_builtin(&cfg, &a, 16, 50, losses, NULL, NULL) != 0) { worst = 1e9; break; }
            double tail = (losses[45] + losses[46] + losses[47] + losses[48] + losses[49]) / 5;
            if (k < 0) reference = tail;
            else if (!(fabs(tail - reference) <= worst)) {
                worst = isnan(tail) ? INFINITY : fabs(tail - reference);
                worst_mode = lg_precision_name(modes[k]);
            }
        }
        check(r, worst < 0.02, "%-12s every precision within 0.02 of 32-true's loss %.4f after 50 "
              "steps (worst %.4f, %s)", names[i], reference, worst, worst_mode);
    }
}

/* Bytes per parameter of each mode, as the trainer allocates them: the design's table. */
static void test_precision_memory(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    const struct { lg_precision p; size_t w, master, g, state; lg_dtype acts; } table[5] = {
        {LG_PRECISION_32_TRUE, 4, 0, 4, 4, LG_DTYPE_F32},
        {LG_PRECISION_BF16_MIXED, 2, 4, 4, 4, LG_DTYPE_BF16},
        {LG_PRECISION_16_MIXED, 2, 4, 4, 4, LG_DTYPE_F16},
        {LG_PRECISION_BF16_TRUE, 2, 0, 2, 2, LG_DTYPE_BF16},
        {LG_PRECISION_16_TRUE, 2, 0, 2, 2, LG_DTYPE_F16}};
    for (int k = 0; k < 5; k++) {
        lg_args a;
        lg_args_default(&a);
        a.precision = table[k].p;
        a.micro_batch_size = 2;
        lg_error err;
        lg_trainer tr;
        if (lg_trainer_create(&tr, &cfg, &a, 8, &err) != 0) { check(r, 0, "%s", err.msg); continue; }
        size_t n = tr.ranks[0].model.n_params;
        const lg_rank_plan *p = &tr.plan.ranks[0];
        const lg_region *master = lg_plan_find(p, "master_weights");
        size_t align = LG_ALIGN - 1;
#define LG_TEST_BYTES(name, per) (lg_plan_find(p, name)->bytes == (n * (per) + align) / LG_ALIGN * LG_ALIGN)
        int ok = LG_TEST_BYTES("weights", table[k].w) && LG_TEST_BYTES("gradients", table[k].g) &&
                 LG_TEST_BYTES("optimizer.m", table[k].state) && LG_TEST_BYTES("optimizer.v", table[k].state) &&
                 (table[k].master ? master && master->bytes == (n * 4 + align) / LG_ALIGN * LG_ALIGN : !master) &&
                 lg_dtype_size(tr.ranks[0].model.params.dtype) == table[k].w &&
                 lg_dtype_size(tr.ranks[0].model.grads.dtype) == table[k].g &&
                 lg_dtype_size(tr.ranks[0].opt.m.dtype) == table[k].state &&
                 tr.ranks[0].model.a.h[0].qkv.dtype == table[k].acts && (tr.ranks[0].opt.master != NULL) == (table[k].master > 0);
#undef LG_TEST_BYTES
        check(r, ok, "%-10s allocates %zu bytes a parameter (weights %zu, master %zu, grads %zu, "
              "AdamW state 2 x %zu), activations %s", lg_precision_name(table[k].p),
              table[k].w + table[k].master + table[k].g + 2 * table[k].state, table[k].w,
              table[k].master, table[k].g, table[k].state, lg_dtype_name(table[k].acts));
        lg_trainer_free(&tr);
    }
}

/* The loss scaler: an overflow halves the scale and skips exactly that step; clean steps
   double it after the window. */
static void test_loss_scaler(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    lg_args a;
    lg_args_default(&a);
    a.precision = LG_PRECISION_16_MIXED;
    a.micro_batch_size = 2;
    lg_error err;
    lg_trainer tr;
    lg_trainer_create(&tr, &cfg, &a, 8, &err);
    size_t n = 0;
    uint32_t *tokens = lg_builtin_task_tokens(3, 400, &n);
    lg_loader ld;
    lg_loader_from_memory(&ld, tokens, n, 8, cfg.vocab_size, 1, 1, &err);
    lg_step_stats st;
    int ok = lg_trainer_step(&tr, &ld, 0, &st, &err) == 0 && !st.skipped && st.loss_scale == 65536.0f;
    /* force an overflow: a scale that takes fp16 activation gradients past 65504 */
    tr.loss_scale = 1073741824.0f; /* 2^30 */
    lg_real *before = new_reals(tr.ranks[0].model.n_params);
    lg_copy(NULL, lg_buf_of(before), tr.ranks[0].model.params, tr.ranks[0].model.n_params);
    ok = ok && lg_trainer_step(&tr, &ld, 1, &st, &err) == 0 && st.skipped &&
         tr.loss_scale == 536870912.0f;
    lg_real *after = new_reals(tr.ranks[0].model.n_params);
    lg_copy(NULL, lg_buf_of(after), tr.ranks[0].model.params, tr.ranks[0].model.n_params);
    int unchanged = memcmp(before, after, tr.ranks[0].model.n_params * sizeof(lg_real)) == 0;
    /* back to a sane scale: the next steps are clean, and the window doubles it */
    tr.loss_scale = 1024.0f;
    tr.scale_window = 3;
    int clean = 1;
    for (int s = 2; s < 5; s++) clean = clean && lg_trainer_step(&tr, &ld, s, &st, &err) == 0 && !st.skipped;
    check(r, ok && unchanged && clean && tr.loss_scale == 2048.0f,
          "16-mixed loss scaler: overflow at 2^30 skips that step (weights unchanged) and halves "
          "the scale; 3 clean steps double 1024 to %g", tr.loss_scale);
    LG_FREE(before);
    LG_FREE(after);
    lg_loader_close(&ld);
    lg_trainer_free(&tr);
}

/* ---- recompute and offload ----------------------------------------------------------------- */

static int same_bits(lg_buf a, lg_buf b, size_t n) {
    return a.dtype == b.dtype && memcmp(a.data, b.data, n * lg_elem_size(a.dtype)) == 0;
}

/* --recompute block and --offload give bitwise the losses, gradients and weights of a plain
   run: the same arithmetic in the same order, only where the tensors live differs. */
static void test_recompute_offload_bitwise(results *r) {
    const char *names[] = {"test-gpt2", "test-pythia", "test-llama", "test-falcon"};
    const int n_families = (int)(sizeof names / sizeof names[0]);
    const lg_precision modes[5] = {LG_PRECISION_32_TRUE, LG_PRECISION_BF16_MIXED,
                                   LG_PRECISION_16_MIXED, LG_PRECISION_BF16_TRUE,
                                   LG_PRECISION_16_TRUE};
    for (int variant = 0; variant < 2; variant++) {
        int ok = 1, runs = 0;
        for (int i = 0; i < n_families; i++) {
            lg_config cfg;
            if (load_config_or_fail(r, &cfg, names[i])) return;
            for (int k = 0; k < 5; k++) {
                lg_args a;
                lg_args_default(&a);
                a.precision = modes[k];
                a.micro_batch_size = 2;
                a.global_batch_size = 4;
                a.optimizer = k % 2 ? LG_OPTIMIZER_SGD : LG_OPTIMIZER_ADAMW;
                double plain_losses[5], other_losses[5];
                lg_trainer plain, other;
                int rc = train_steps(&plain, &cfg, &a, 12, 5, plain_losses);
                if (variant == 0) a.recompute = 1;
                else a.offload = 1;
                rc |= train_steps(&other, &cfg, &a, 12, 5, other_losses);
                int same = rc == 0 && memcmp(plain_losses, other_losses, sizeof plain_losses) == 0 &&
                           same_bits(plain.ranks[0].model.grads, other.ranks[0].model.grads, plain.ranks[0].model.n_params) &&
                           same_bits(plain.ranks[0].model.params, other.ranks[0].model.params, plain.ranks[0].model.n_params);
                if (!same) printf("    differs: %s %s\n", names[i], lg_precision_name(modes[k]));
                ok = ok && same;
                runs++;
                lg_trainer_free(&plain);
                lg_trainer_free(&other);
            }
        }
        check(r, ok, "%s: bitwise the same losses, gradients and weights after 5 steps (%d runs: "
              "%d families x 5 precisions, AdamW and SGD)",
              variant == 0 ? "--recompute block" : "--offload", runs, n_families);
    }
}

/* --offload activations: the block outputs that --recompute block keeps travel to host memory
   and back through two device slots, bitwise the losses, gradients and weights of recompute
   alone; 5 layers, so both slots turn over and a fetch that came late or went to the wrong
   slot would show. Also with -d 2 full-shard. */
static void test_offload_activations_bitwise(results *r) {
    const char *names[] = {"test-gpt2", "test-pythia", "test-llama", "test-falcon", "test-llama31"};
    const int n_families = (int)(sizeof names / sizeof names[0]);
    const lg_precision modes[2] = {LG_PRECISION_32_TRUE, LG_PRECISION_BF16_MIXED};
    int ok = 1, runs = 0;
    for (int i = 0; i < n_families; i++)
        for (int k = 0; k < 3; k++) {
            lg_config cfg;
            if (load_config_or_fail(r, &cfg, names[i])) return;
            cfg.n_layer = 5;
            lg_args a;
            lg_args_default(&a);
            a.precision = modes[k % 2];
            a.micro_batch_size = 2;
            a.global_batch_size = 4;
            a.recompute = 1;
            if (k == 2) { /* -d 2 full-shard */
                a.devices = 2;
                a.strategy = LG_STRATEGY_FULL_SHARD;
                a.global_batch_size = 8;
            }
            double kept_losses[3], host_losses[3];
            lg_trainer kept, host;
            int rc = train_steps(&kept, &cfg, &a, 12, 3, kept_losses);
            a.offload_activations = 1;
            rc |= train_steps(&host, &cfg, &a, 12, 3, host_losses);
            int same = rc == 0 && memcmp(kept_losses, host_losses, sizeof kept_losses) == 0;
            for (int q = 0; same && q < kept.local_ranks; q++)
                same = same_bits(kept.ranks[q].model.grads, host.ranks[q].model.grads, kept.ranks[q].model.n_local) &&
                       same_bits(kept.ranks[q].model.params, host.ranks[q].model.params, kept.ranks[q].model.n_local);
            if (!same) printf("    differs: %s %s%s\n", names[i], lg_precision_name(modes[k % 2]),
                              k == 2 ? " -d 2 full-shard" : "");
            ok = ok && same;
            runs++;
            lg_trainer_free(&kept);
            lg_trainer_free(&host);
        }
    check(r, ok, "--offload activations: bitwise the losses, gradients and weights of --recompute "
          "block after 3 steps (%d runs: %d families with 5 layers x fp32, bf16-mixed, fp32 -d 2 "
          "full-shard)", runs, n_families);
}

/* --offload activations as allocated: the arenas are the plan's; L - 1 block outputs move to
   the host pool and two slots join the device pool; the model's views point there. Asked
   without --recompute block it is refused naming both flags. */
/* Rank 0's arenas, as allocated (test_allocations), equal its plan's pools: the last block
   logged at each arena's address (a block freed earlier may have had the same address). */
static int arenas_equal_plan(const lg_trainer *tr) {
    const lg_rank_plan *p = &tr->plan.ranks[0];
    int ok = 1;
    for (int pool = 0; pool < LG_N_POOLS; pool++) {
        int last = -1;
        for (int i = 0; i < test_allocations.n; i++)
            if (test_allocations.blocks[i] == tr->ranks[0].rank.arena[pool]) last = i;
        ok = ok && (last >= 0 ? test_allocations.sizes[last] == p->pool_bytes[pool] + LG_ALIGN
                              : p->pool_bytes[pool] == 0);
    }
    return ok;
}

static void test_offload_activations_memory(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-pythia")) return;
    cfg.n_layer = 5;
    size_t device[2], host[2], acts = 0; /* bytes of one block output (B, T, C) */
    int ok = 1;
    for (int v = 0; v < 2; v++) {
        lg_args a;
        lg_args_default(&a);
        a.micro_batch_size = 4;
        a.recompute = 1;
        a.offload_activations = v;
        lg_error err;
        lg_trainer tr;
        if (create_counting(&tr, &cfg, &a, 16, &err) != 0) { check(r, 0, "%s", err.msg); return; }
        const lg_rank_plan *p = &tr.plan.ranks[0];
        device[v] = p->pool_bytes[LG_POOL_DEVICE];
        host[v] = p->pool_bytes[LG_POOL_HOST];
        ok = ok && arenas_equal_plan(&tr);
        const lg_model *m = &tr.ranks[0].model;
        acts = (size_t)4 * 16 * cfg.n_embd * lg_elem_size(m->a.residual[0].dtype);
        for (int l = 0; v && l < cfg.n_layer - 1; l++) {
            char name[64], slot[64];
            snprintf(name, sizeof name, "activations.h.%d", l);
            snprintf(slot, sizeof slot, "activations.kept_slot.%d", l % 2);
            ok = ok && m->a.kept_host[l].data == lg_rank_region(&tr.ranks[0].rank, name) &&
                 m->a.residual[l + 1].data == lg_rank_region(&tr.ranks[0].rank, slot);
        }
        lg_trainer_free(&tr);
    }
    check(r, ok && host[1] - host[0] == (cfg.n_layer - 1) * acts &&
          device[0] - device[1] == (cfg.n_layer - 1 - 2) * acts,
          "--offload activations: arenas as planned, host pool %zu -> %zu B, device pool %zu -> "
          "%zu B (5 layers: 4 outputs out, 2 slots in)", host[0], host[1], device[0], device[1]);
    lg_args a;
    lg_args_default(&a);
    a.micro_batch_size = 4;
    lg_remedy rem[LG_MAX_REMEDIES];
    int n = lg_plan_remedies(&cfg, &a, 16, 1, rem), recompute = -1, host_acts = -1;
    for (int i = 0; i < n; i++) {
        if (strcmp(rem[i].what, "block recompute") == 0) recompute = i;
        if (strcmp(rem[i].what, "activations in host memory") == 0) host_acts = i;
    }
    check(r, recompute >= 0 && host_acts >= 0 &&
          rem[host_acts].changes == (LG_SETTING_RECOMPUTE | LG_SETTING_OFFLOAD_ACTIVATIONS) &&
          rem[recompute].device_bytes - rem[host_acts].device_bytes == device[0] - device[1] &&
          rem[host_acts].host_bytes - rem[recompute].host_bytes == host[1] - host[0],
          "the remedies price --offload activations (with --recompute block): device %zu B, "
          "host %zu B more than recompute alone", rem[host_acts < 0 ? 0 : host_acts].device_bytes,
          host[1] - host[0]);
    a.offload_activations = 1;
    lg_error err = {0};
    check(r, lg_args_check(&a, &err) != 0 && strstr(err.msg, "`offload activations`") &&
          strstr(err.msg, "`recompute block`"), "--offload activations without --recompute "
          "block: refused naming both (%s)", err.msg);
}

/* Trains a (with --offload state) and b (the same with more parts offloaded) 3 steps: 1 when
   their losses, every rank's host gradients and weights are bitwise equal, and the streamed
   parts have left the devices (--offload gradients: no whole-gradient buffer; weights: the
   weights in the host pool). */
static int offload_runs_same(const lg_config *cfg, const lg_args *a, const lg_args *b,
                             const char *family, const char *mode) {
    double whole_losses[3], streamed_losses[3];
    lg_trainer whole, streamed;
    int rc = train_steps(&whole, cfg, a, 12, 3, whole_losses);
    rc |= train_steps(&streamed, cfg, b, 12, 3, streamed_losses);
    int same = rc == 0 && memcmp(whole_losses, streamed_losses, sizeof whole_losses) == 0;
    for (int q = 0; same && q < whole.local_ranks; q++) {
        const lg_trainer_rank *w = &whole.ranks[q], *s = &streamed.ranks[q];
        const lg_region *weights = lg_plan_find(&streamed.plan.ranks[q], "weights");
        const lg_region *rows = lg_plan_find(&streamed.plan.ranks[q], "embedding.rows");
        lg_buf w_grads = w->host_grads.data ? w->host_grads : w->model.grads; /* (without state: */
        lg_buf s_grads = s->host_grads.data ? s->host_grads : s->model.grads; /* the device's) */
        same = same_bits(w_grads, s_grads, w->model.n_local) &&
               same_bits(w->model.params, s->model.params, w->model.n_local) &&
               (s->model.grads.data == NULL) == b->offload_gradients &&
               (weights->pool == LG_POOL_HOST) == b->offload_weights &&
               (rows && rows->pool == LG_POOL_HOST) == b->offload_embedding;
    }
    if (!same)
        printf("    differs: %s %s, -b %d -g %d -d %d %s%s%s%s\n", family, mode, a->micro_batch_size,
               a->global_batch_size, a->devices, lg_strategy_name(a->strategy),
               b->offload_gradients ? " gradients" : "", b->offload_weights ? " weights" : "",
               b->offload_embedding ? " embedding" : "");
    if (rc == 0) {
        lg_trainer_free(&whole);
        lg_trainer_free(&streamed);
    }
    return same;
}

/* --offload gradients: each unit's gradients go to the host as its backward ends, and come
   back for the next micro-batch's backward to add to; bitwise the losses, the host's
   gradients and the weights of --offload state alone, which keeps the whole gradient on the
   device: every family, full fine-tuning in fp32 and bf16-true, LoRA and QLoRA (nf4),
   with and without accumulation, clipping on (the norm is taken from the host's copy). */
static void test_offload_gradients_bitwise(results *r) {
    const char *names[] = {"test-gpt2", "test-pythia", "test-llama", "test-falcon", "test-llama31"};
    const int n_families = (int)(sizeof names / sizeof names[0]);
    enum { FULL_FP32, FULL_BF16_TRUE, LORA_ALL, QLORA_NF4, N_MODES };
    static const char *const mode_names[N_MODES] = {"full fp32", "full bf16-true", "lora all",
                                                    "qlora nf4"};
    int ok = 1, runs = 0;
    for (int i = 0; i < n_families; i++)
        for (int k = 0; k < N_MODES; k++)
            for (int accumulation = 1; accumulation <= 3; accumulation += 2) {
                lg_config cfg;
                if (load_config_or_fail(r, &cfg, names[i])) return;
                cfg.n_layer = 3; /* both block buffers turn over */
                lg_args a;
                lg_args_default(&a);
                a.precision = k == FULL_FP32 ? LG_PRECISION_32_TRUE
                              : k == LORA_ALL ? LG_PRECISION_BF16_MIXED : LG_PRECISION_BF16_TRUE;
                a.micro_batch_size = 2;
                a.global_batch_size = 2 * accumulation;
                a.max_norm = 0.05f; /* below the norms of these runs: clipping scales each step */
                a.offload = 1;
                if (k == LORA_ALL || k == QLORA_NF4) {
                    a.lora.r = 4;
                    a.lora.targets = LG_LORA_QUERY | LG_LORA_KEY | LG_LORA_VALUE |
                                     LG_LORA_PROJECTION | LG_LORA_MLP;
                    a.lora.quantize = k == QLORA_NF4 ? LG_QUANTIZE_NF4 : LG_QUANTIZE_NONE;
                }
                for (int sharded = 0; sharded < 3; sharded++) { /* 1 rank, -d 2 two ways */
                    if (sharded && k != FULL_FP32 && k != QLORA_NF4) continue;
                    lg_args b = a;
                    b.devices = sharded ? 2 : 1;
                    b.strategy = sharded == 2 ? LG_STRATEGY_SHARD_GRAD_OP : LG_STRATEGY_FULL_SHARD;
                    b.global_batch_size *= b.devices;
                    lg_args streamed = b;
                    streamed.offload_gradients = 1;
                    ok = offload_runs_same(&cfg, &b, &streamed, names[i], mode_names[k]) && ok;
                    runs++;
                }
            }
    check(r, ok, "--offload gradients: bitwise the losses, gradients and weights of --offload "
          "state after 3 clipped AdamW steps (%d runs: %d families with 3 layers x full fp32, "
          "full bf16-true, LoRA, QLoRA nf4 x 1 and 3 micro-batches; full fp32 and QLoRA also "
          "-d 2 full-shard and shard-grad-op)", runs, n_families);
}

/* --offload weights: the weights (trainable, and LoRA's frozen base as stored, NF4 too) live
   in the host pool and each unit is copied into a device slot ahead of its use; bitwise the
   losses, gradients and weights of --offload state alone: every family, full fine-tuning in
   fp32, bf16-mixed and bf16-true, LoRA, QLoRA nf4 and nf4-dq, 1 and 3 micro-batches, and with
   --offload gradients too. */
static void test_offload_weights_bitwise(results *r) {
    const char *names[] = {"test-gpt2", "test-pythia", "test-llama", "test-falcon", "test-llama31"};
    const int n_families = (int)(sizeof names / sizeof names[0]);
    enum { FULL_FP32, FULL_BF16_MIXED, FULL_BF16_TRUE, LORA_ALL, QLORA_NF4, QLORA_NF4_DQ, N_MODES };
    static const char *const mode_names[N_MODES] = {"full fp32", "full bf16-mixed", "full bf16-true",
                                                    "lora all", "qlora nf4", "qlora nf4-dq"};
    static const lg_precision precisions[N_MODES] = {
        LG_PRECISION_32_TRUE, LG_PRECISION_BF16_MIXED, LG_PRECISION_BF16_TRUE,
        LG_PRECISION_BF16_MIXED, LG_PRECISION_BF16_TRUE, LG_PRECISION_32_TRUE};
    int ok = 1, runs = 0;
    for (int i = 0; i < n_families; i++)
        for (int k = 0; k < N_MODES; k++)
            for (int accumulation = 1; accumulation <= 3; accumulation += 2) {
                lg_config cfg;
                if (load_config_or_fail(r, &cfg, names[i])) return;
                cfg.n_layer = 3; /* both block slots turn over */
                lg_args a;
                lg_args_default(&a);
                a.precision = precisions[k];
                a.micro_batch_size = 2;
                a.global_batch_size = 2 * accumulation;
                a.max_norm = 0.05f;
                a.offload = 1;
                if (k >= LORA_ALL) {
                    a.lora.r = 4;
                    a.lora.targets = LG_LORA_QUERY | LG_LORA_KEY | LG_LORA_VALUE |
                                     LG_LORA_PROJECTION | LG_LORA_MLP |
                                     (cfg.tie_embeddings ? 0u : (unsigned)LG_LORA_HEAD);
                    a.lora.quantize = k == QLORA_NF4      ? LG_QUANTIZE_NF4
                                      : k == QLORA_NF4_DQ ? LG_QUANTIZE_NF4_DQ
                                                          : LG_QUANTIZE_NONE;
                }
                for (int ranks = 1; ranks <= 4; ranks *= 2) { /* 1, -d 2 full, 2 x 2 hybrid */
                    if (ranks > 1 && k != FULL_BF16_MIXED && k != QLORA_NF4) continue;
                    lg_args b = a;
                    b.strategy = ranks == 4 ? LG_STRATEGY_HYBRID_SHARD : LG_STRATEGY_FULL_SHARD;
                    b.nodes = ranks == 4 ? 2 : 1;
                    b.devices = ranks / b.nodes;
                    b.global_batch_size *= ranks;
                    for (int gradients = 0; gradients < 2; gradients++) {
                        lg_args streamed = b;
                        streamed.offload_weights = 1;
                        streamed.offload_gradients = gradients && ranks < 4; /* (replicas) */
                        ok = offload_runs_same(&cfg, &b, &streamed, names[i], mode_names[k]) && ok;
                        runs++;
                    }
                }
            }
    check(r, ok, "--offload weights: bitwise the losses, gradients and weights of --offload "
          "state after 3 clipped AdamW steps (%d runs: %d families with 3 layers x full fp32, "
          "bf16-mixed, bf16-true, LoRA, QLoRA nf4 and nf4-dq x 1 and 3 micro-batches, alone and "
          "with --offload gradients; full bf16-mixed and QLoRA nf4 also -d 2 full-shard and "
          "-d 2 --nodes 2 hybrid-shard, each rank streaming its piece)", runs, n_families);
}

/* --offload embedding: the token embedding lives in host memory and the step's rows are
   gathered there; trained, its gradient is scattered there too. Bitwise the losses, gradients
   and weights of the run that keeps it on the device: every family with a table of its own
   (GPT-2 ties it), LoRA (bf16-mixed, fp32) and QLoRA nf4 (bf16-true) 1 and 3 micro-batches x
   alone, with --offload state,activations,weights (recompute), and -d 2 full-shard (the frozen
   ends unit gathered without the table); every weight trained (fp32, bf16-mixed, bf16-true),
   which needs --offload state,gradients,weights, alone and with activations. */
static void test_offload_embedding_bitwise(results *r) {
    const char *names[] = {"test-pythia", "test-llama", "test-falcon", "test-llama31"};
    const int n_families = (int)(sizeof names / sizeof names[0]);
    enum { LORA_BF16_MIXED, LORA_FP32, QLORA_NF4, FULL_FP32, FULL_BF16_MIXED, FULL_BF16_TRUE,
           N_MODES };
    static const char *const mode_names[N_MODES] = {"lora bf16-mixed", "lora fp32", "qlora nf4",
                                                    "full fp32", "full bf16-mixed",
                                                    "full bf16-true"};
    static const lg_precision precisions[N_MODES] = {
        LG_PRECISION_BF16_MIXED, LG_PRECISION_32_TRUE, LG_PRECISION_BF16_TRUE,
        LG_PRECISION_32_TRUE, LG_PRECISION_BF16_MIXED, LG_PRECISION_BF16_TRUE};
    enum { ALONE, WITH_STREAMING, FULL_SHARD, N_WAYS };
    int ok = 1, runs = 0, full_runs = 0;
    for (int i = 0; i < n_families; i++)
        for (int k = 0; k < N_MODES; k++)
            for (int accumulation = 1; accumulation <= 3; accumulation += 2)
                for (int way = 0; way < N_WAYS; way++) {
                    int full = k >= FULL_FP32;
                    if (full && way == FULL_SHARD) continue; /* (one rank: refused) */
                    lg_config cfg;
                    if (load_config_or_fail(r, &cfg, names[i])) return;
                    cfg.n_layer = 3;
                    lg_args a;
                    lg_args_default(&a);
                    a.precision = precisions[k];
                    a.micro_batch_size = 2;
                    a.global_batch_size = 2 * accumulation;
                    a.max_norm = 0.05f;
                    if (!full) {
                        a.lora.r = 4;
                        a.lora.targets = LG_LORA_QUERY | LG_LORA_VALUE | LG_LORA_MLP | LG_LORA_HEAD;
                        a.lora.quantize = k == QLORA_NF4 ? LG_QUANTIZE_NF4 : LG_QUANTIZE_NONE;
                    }
                    if (full) a.offload = a.offload_gradients = a.offload_weights = 1;
                    if (way == WITH_STREAMING)
                        a.offload = a.offload_activations = a.offload_weights = a.recompute = 1;
                    if (way == FULL_SHARD) {
                        a.devices = 2;
                        a.global_batch_size *= 2;
                    }
                    lg_args host = a;
                    host.offload_embedding = 1;
                    ok = offload_runs_same(&cfg, &a, &host, names[i], mode_names[k]) && ok;
                    runs++;
                    full_runs += full;
                }
    check(r, ok, "--offload embedding: bitwise the losses, gradients and weights of the table "
          "on the device after 3 clipped AdamW steps (%d runs: %d families with 3 layers x LoRA "
          "bf16-mixed and fp32, QLoRA nf4 x 1 and 3 micro-batches x alone, with --offload "
          "state,activations,weights, -d 2 full-shard; %d of them training every weight, the "
          "table's gradient scattered on the host: fp32, bf16-mixed, bf16-true with --offload "
          "state,gradients,weights, alone and with activations)", runs, n_families, full_runs);
}

/* What one --offload run allocates: test-pythia (cfg), --offload state, 3 micro-batches of 2
   (bf16-mixed: bf16 weights, fp32 gradients, the master on the host), plus gradients and/or
   weights streamed. */
typedef struct {
    size_t device, host, traffic; /* the pools, and the plan's host traffic a step */
    int arenas_as_planned;
    int device_gradients;         /* a whole-model gradient region on the device */
    int weights_on_host;          /* the weights region in the host pool */
    int gather_blocks;            /* device slots the blocks' weights come into */
} offload_pools;

static int offload_pools_of(results *r, const lg_config *cfg, int gradients, int weights,
                            offload_pools *out) {
    lg_args a;
    lg_args_default(&a);
    a.micro_batch_size = 2;
    a.global_batch_size = 6;
    a.offload = 1;
    a.offload_gradients = gradients;
    a.offload_weights = weights;
    lg_error err;
    lg_trainer tr;
    if (create_counting(&tr, cfg, &a, 16, &err) != 0) {
        check(r, 0, "%s", err.msg);
        return -1;
    }
    const lg_rank_plan *p = &tr.plan.ranks[0];
    out->device = p->pool_bytes[LG_POOL_DEVICE];
    out->host = p->pool_bytes[LG_POOL_HOST];
    out->traffic = lg_plan_host_traffic_bytes(&tr.plan);
    out->arenas_as_planned = arenas_equal_plan(&tr);
    out->device_gradients = lg_plan_find(p, "gradients") != NULL;
    out->weights_on_host = lg_plan_find(p, "weights")->pool == LG_POOL_HOST;
    out->gather_blocks = lg_plan_find(p, "gather.blocks") != NULL;
    lg_trainer_free(&tr);
    return 0;
}

/* --offload gradients as allocated: the arenas are the plan's; the device's whole-model
   gradient buffer gives way to the ends' and two blocks' buffers; the host traffic counts
   the trips; the remedies price it; refused where it does not run yet, naming why. */
static void test_offload_gradients_memory(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-pythia")) return;
    cfg.n_layer = 5;
    size_t device[2], host[2], traffic[2];
    int ok = 1;
    for (int v = 0; v < 2; v++) {
        offload_pools got;
        if (offload_pools_of(r, &cfg, v, 0, &got) != 0) return;
        device[v] = got.device, host[v] = got.host, traffic[v] = got.traffic;
        ok = ok && got.arenas_as_planned && got.device_gradients == !v;
    }
    /* fp32 gradients (bf16-mixed's): the whole model's, against the ends' and two blocks' */
    size_t f32 = sizeof(float), block = lg_unit_layout(&cfg, 1, lg_no_buf(), NULL);
    size_t ends = lg_unit_layout(&cfg, 0, lg_no_buf(), NULL), whole = ends + cfg.n_layer * block;
    size_t saved = lg_align_to(whole * f32, LG_ALIGN) - lg_align_to(ends * f32, LG_ALIGN) -
                   lg_align_to(2 * block * f32, LG_ALIGN);
    check(r, ok && device[0] - device[1] == saved && host[0] == host[1] &&
          traffic[1] - traffic[0] == 2 * 2 * whole * f32,
          "--offload gradients: arenas as planned, device pool %zu -> %zu B (the whole gradient "
          "out, the ends' and two blocks' buffers in), host pool the same, host traffic %zu -> "
          "%zu B (3 micro-batches: out 3 times and back twice, not once)", device[0], device[1],
          traffic[0], traffic[1]);
    lg_args a;
    lg_args_default(&a);
    a.micro_batch_size = 4;
    lg_remedy rem[LG_MAX_REMEDIES];
    int n = lg_plan_remedies(&cfg, &a, 16, 1, rem), streamed = -1, offload = -1;
    for (int i = 0; i < n; i++) {
        if (rem[i].changes == LG_SETTING_OFFLOAD_GRADIENTS) streamed = i;
        if (rem[i].changes == LG_SETTING_OFFLOAD) offload = i;
    }
    check(r, streamed > offload && offload >= 0 && rem[streamed].args.offload &&
          rem[streamed].device_bytes < rem[offload].device_bytes,
          "the remedies price --offload gradients after --offload: device %zu B against %zu B",
          streamed < 0 ? 0 : rem[streamed].device_bytes, offload < 0 ? 0 : rem[offload].device_bytes);
    /* the cheapest change keeps the full fine-tune (it trained LoRA adapters instead) */
    expect_cli(r, "--plan -c Llama-3.1-8B -b 2 -t 2048 -p bf16-true --optimizer-state 8bit "
                  "--recompute block --offload activations,state --backend cuda --gpu rtx4090 "
                  "--host-memory-limit 128GiB", 3,
               "  ./train --plan -c Llama-3.1-8B -b 2 -t 2048 "
               "-p bf16-true --optimizer-state 8bit --backend cuda --gpu rtx4090 "
               "--host-memory-limit 128GiB --recompute block --offload activations,gradients");
    static const char *const why[3] = {"`offload state`", "replicas", "Sophia"};
    for (int i = 0; i < 3; i++) { /* without state; -d 2 no-shard; Sophia */
        lg_args bad = a;
        lg_error err = {0};
        bad.offload_gradients = 1;
        bad.offload = i > 0;
        if (i == 1) bad.devices = 2, bad.strategy = LG_STRATEGY_NO_SHARD;
        if (i == 2) bad.optimizer = LG_OPTIMIZER_SOPHIA;
        check(r, lg_args_check(&bad, &err) != 0 && strstr(err.msg, "`offload gradients`") &&
              strstr(err.msg, why[i]), "--offload gradients refused naming %s: %s", why[i], err.msg);
    }
}

/* --offload weights as allocated: the arenas are the plan's; the device's whole weights give
   way to the ends' slot and two blocks', the host pool takes them (LoRA: the frozen base as
   stored, in units); the host traffic counts each unit's trips; the remedies price it; refused
   where it does not run yet, naming why. */
static void test_offload_weights_memory(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-pythia")) return;
    cfg.n_layer = 5;
    size_t device[2], host[2], traffic[2];
    int ok = 1;
    for (int v = 0; v < 2; v++) {
        offload_pools got;
        if (offload_pools_of(r, &cfg, 0, v, &got) != 0) return;
        device[v] = got.device, host[v] = got.host, traffic[v] = got.traffic;
        ok = ok && got.arenas_as_planned && got.weights_on_host == v && got.gather_blocks == v;
    }
    size_t bf16 = 2, block = lg_unit_layout(&cfg, 1, lg_no_buf(), NULL);
    size_t ends = lg_unit_layout(&cfg, 0, lg_no_buf(), NULL), whole = ends + cfg.n_layer * block;
    size_t saved = lg_align_to(whole * bf16, LG_ALIGN) - lg_align_to(ends * bf16, LG_ALIGN) -
                   lg_align_to(2 * block * bf16, LG_ALIGN);
    size_t trips = 3 * (ends + 2 * cfg.n_layer * block) * bf16; /* 3 micro-batches */
    check(r, ok && device[0] - device[1] == saved &&
          host[1] - host[0] == lg_align_to(whole * bf16, LG_ALIGN) && traffic[1] - traffic[0] == trips,
          "--offload weights: arenas as planned, device pool %zu -> %zu B (the weights out, the "
          "ends' slot and two blocks' in), host pool %zu -> %zu B, host traffic %zu B more (3 "
          "micro-batches: every unit in the forward, the blocks again in the backward)",
          device[0], device[1], host[0], host[1], traffic[1] - traffic[0]);
    lg_args a;
    lg_args_default(&a);
    a.micro_batch_size = 2;
    a.lora.r = 4;
    a.lora.quantize = LG_QUANTIZE_NF4;
    a.offload = a.offload_weights = 1;
    lg_error err;
    lg_trainer tr;
    if (create_counting(&tr, &cfg, &a, 16, &err) != 0) { check(r, 0, "%s", err.msg); return; }
    const lg_rank_plan *p = &tr.plan.ranks[0];
    const lg_region *frozen = lg_plan_find(p, "frozen_weights.shard");
    check(r, arenas_equal_plan(&tr) && frozen && frozen->pool == LG_POOL_HOST &&
          !lg_plan_find(p, "frozen_weights") && lg_plan_find(p, "gather.frozen.blocks"),
          "--offload weights, QLoRA nf4: the frozen base as stored in the host pool (%zu B), "
          "gathered a unit at a time into device slots; arenas as planned",
          frozen ? frozen->bytes : 0);
    lg_trainer_free(&tr);
    lg_args_default(&a);
    a.micro_batch_size = 4;
    lg_remedy rem[LG_MAX_REMEDIES];
    int n = lg_plan_remedies(&cfg, &a, 16, 1, rem), streamed = -1;
    for (int i = 0; i < n; i++)
        if (rem[i].changes == LG_SETTING_OFFLOAD_WEIGHTS) streamed = i;
    check(r, streamed >= 0 && rem[streamed].args.offload && rem[streamed].args.offload_weights,
          "the remedies price --offload weights: device %zu B",
          streamed < 0 ? 0 : rem[streamed].device_bytes);
    static const char *const why[3] = {"`offload state`", "`strategy no-shard`",
                                       "`strategy shard-grad-op`"};
    for (int i = 0; i < 3; i++) { /* without state; -d 2 with whole weights on every rank */
        lg_args bad = a;
        lg_error refused = {0};
        bad.offload_weights = 1;
        bad.offload = i > 0;
        if (i > 0) bad.devices = 2;
        bad.strategy = i == 2 ? LG_STRATEGY_SHARD_GRAD_OP : LG_STRATEGY_NO_SHARD;
        check(r, lg_args_check(&bad, &refused) != 0 && strstr(refused.msg, "`offload weights`") &&
              strstr(refused.msg, why[i]), "--offload weights refused naming %s: %s", why[i],
              refused.msg);
    }
}

/* One QLoRA nf4 run of test-llama31 (bf16-true, 3 micro-batches of 2 x 16 tokens) as
   allocated, with or without --offload embedding, on `devices` ranks (full-shard). */
typedef struct {
    size_t device, host, traffic;  /* rank 0's pools, the plan's host traffic a step */
    size_t frozen_count;           /* frozen_weights' elements (one rank) */
    size_t gather_ends;            /* gather.frozen.ends' bytes (full-shard) */
    int arenas_as_planned;
    int table_on_host;             /* embedding.host in the host pool */
} embedding_pools;

static int embedding_pools_of(results *r, const lg_config *cfg, int host_table, int devices,
                              embedding_pools *out) {
    lg_args a;
    lg_args_default(&a);
    a.precision = LG_PRECISION_BF16_TRUE;
    a.micro_batch_size = 2;
    a.global_batch_size = 6 * devices;
    a.devices = devices;
    a.lora.r = 4;
    a.lora.quantize = LG_QUANTIZE_NF4;
    a.offload_embedding = host_table;
    lg_error err;
    lg_trainer tr;
    if (create_counting(&tr, cfg, &a, 16, &err) != 0) {
        check(r, 0, "%s", err.msg);
        return -1;
    }
    const lg_rank_plan *p = &tr.plan.ranks[0];
    const lg_region *frozen = lg_plan_find(p, "frozen_weights"), *ends = lg_plan_find(p, "gather.frozen.ends");
    const lg_region *table = lg_plan_find(p, "embedding.host");
    out->device = p->pool_bytes[LG_POOL_DEVICE];
    out->host = p->pool_bytes[LG_POOL_HOST];
    out->traffic = lg_plan_host_traffic_bytes(&tr.plan);
    out->frozen_count = frozen ? frozen->count : 0;
    out->gather_ends = ends ? ends->bytes : 0;
    out->arenas_as_planned = arenas_equal_plan(&tr);
    out->table_on_host = table && table->pool == LG_POOL_HOST;
    lg_trainer_free(&tr);
    return 0;
}

/* A token embedding trained on the host as allocated: test-llama31, every weight, bf16-true,
   3 micro-batches of 2 x 16 with --offload state,gradients,weights, with and without
   embedding. The arenas are the plan's; the ends' weight slot and gradient buffer on the
   device each lose the table (Vp x C); the host pool gains one micro-batch's rows; the host
   traffic loses the table's gradient (out 3 times, back twice) and its weights (in once a
   micro-batch) and gains the rows, in and out each micro-batch; the table's view is the
   start of the host's weights; --plan says so. */
static void test_trained_embedding_memory(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama31")) return;
    size_t device[2], host[2], traffic[2], ends[2][2]; /* ends: gather.ends, gradients.ends B */
    int ok = 1;
    for (int v = 0; v < 2; v++) {
        lg_args a;
        lg_args_default(&a);
        a.precision = LG_PRECISION_BF16_TRUE;
        a.micro_batch_size = 2;
        a.global_batch_size = 6;
        a.offload = a.offload_gradients = a.offload_weights = 1;
        a.offload_embedding = v;
        lg_error err;
        lg_trainer tr;
        if (create_counting(&tr, &cfg, &a, 16, &err) != 0) { check(r, 0, "%s", err.msg); return; }
        const lg_rank_plan *p = &tr.plan.ranks[0];
        device[v] = p->pool_bytes[LG_POOL_DEVICE];
        host[v] = p->pool_bytes[LG_POOL_HOST];
        traffic[v] = lg_plan_host_traffic_bytes(&tr.plan);
        ends[v][0] = lg_plan_find(p, "gather.ends")->bytes;
        ends[v][1] = lg_plan_find(p, "gradients.ends")->bytes;
        ok = ok && arenas_equal_plan(&tr) &&
             (!v || tr.ranks[0].model.embedding_host.data == lg_rank_region(&tr.ranks[0].rank, "weights"));
        lg_trainer_free(&tr);
    }
    size_t bf16 = 2, table = (size_t)cfg.padded_vocab_size * cfg.n_embd * bf16;
    size_t rows = 2 * 16 * (size_t)cfg.n_embd * bf16;
    size_t slots = lg_align_to(ends[0][0], LG_ALIGN) - lg_align_to(ends[1][0], LG_ALIGN) +
                   lg_align_to(ends[0][1], LG_ALIGN) - lg_align_to(ends[1][1], LG_ALIGN);
    check(r, ok && ends[0][0] - ends[1][0] == table && ends[0][1] - ends[1][1] == table &&
          device[0] - device[1] == slots && host[1] - host[0] == lg_align_to(rows, LG_ALIGN) &&
          traffic[0] + 6 * rows - traffic[1] == (5 + 3) * table,
          "--offload embedding, every weight trained: arenas as planned, gather.ends and "
          "gradients.ends each %zu B smaller (the table), device pool %zu -> %zu B, host pool "
          "%zu -> %zu B (one micro-batch's rows), host traffic %zu -> %zu B (the table 8 times "
          "less, the rows 6 times more)", table, device[0], device[1], host[0], host[1],
          traffic[0], traffic[1]);
    expect_cli(r, "--plan -c test-llama31 --offload state,gradients,weights,embedding", 0,
               "the token embedding trained on the host");
}

/* --offload embedding as allocated: the arenas are the plan's; the frozen base on the device
   loses the table (Vp x C), the host pool gains it and the step's rows (B T x C), the host
   traffic the rows of each micro-batch; with -d 2 full-shard the gathered ends unit is the
   table smaller; --plan says where it lives; refused by name for a tied table and for full
   fine-tuning (a trained table). */
static void test_offload_embedding_memory(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama31")) return;
    embedding_pools one[2], two[2];
    for (int v = 0; v < 2; v++)
        if (embedding_pools_of(r, &cfg, v, 1, &one[v]) != 0 || embedding_pools_of(r, &cfg, v, 2, &two[v]) != 0)
            return;
    size_t bf16 = 2, table = (size_t)cfg.padded_vocab_size * cfg.n_embd, rows = 2 * 16 * (size_t)cfg.n_embd;
    size_t saved = lg_align_to(one[0].frozen_count * bf16, LG_ALIGN) -
                   lg_align_to(one[1].frozen_count * bf16, LG_ALIGN);
    check(r, one[0].arenas_as_planned && one[1].arenas_as_planned && one[1].table_on_host &&
          !one[0].table_on_host && one[0].frozen_count - one[1].frozen_count == table &&
          one[0].device - one[1].device == saved &&
          one[1].host - one[0].host == lg_align_to(table * bf16, LG_ALIGN) + lg_align_to(rows * bf16, LG_ALIGN) &&
          one[1].traffic - one[0].traffic == 3 * rows * bf16,
          "--offload embedding, QLoRA nf4: arenas as planned, frozen_weights %zu -> %zu elements "
          "(the table's %zu out), device pool %zu -> %zu B, host pool %zu -> %zu B (the table and "
          "one micro-batch's rows), host traffic %zu B more (3 micro-batches of rows)",
          one[0].frozen_count, one[1].frozen_count, table, one[0].device, one[1].device,
          one[0].host, one[1].host, one[1].traffic - one[0].traffic);
    size_t fewer = two[0].gather_ends - two[1].gather_ends, slack = 2 * 2 * LG_ALIGN;
    check(r, two[0].arenas_as_planned && two[1].arenas_as_planned && two[1].table_on_host &&
          fewer + slack >= table * bf16 && fewer <= table * bf16 + slack,
          "--offload embedding, -d 2 full-shard: arenas as planned, the gathered frozen ends "
          "%zu -> %zu B (the table's %zu B out, up to the pieces' alignment)",
          two[0].gather_ends, two[1].gather_ends, table * bf16);
    expect_cli(r, "--plan -c test-llama31 --lora-r 4 --offload embedding", 0,
               "its token embedding in host memory (embedding.host)");
    for (int tied = 0; tied < 2; tied++) { /* the remedies offer it where the model allows */
        lg_config model;
        if (load_config_or_fail(r, &model, tied ? "test-gpt2" : "test-llama31")) return;
        lg_args a;
        lg_args_default(&a);
        a.micro_batch_size = 4;
        a.lora.r = 4;
        lg_remedy rem[LG_MAX_REMEDIES];
        int n = lg_plan_remedies(&model, &a, 16, 1, rem), moved = -1;
        for (int i = 0; i < n; i++)
            if (rem[i].changes == LG_SETTING_OFFLOAD_EMBEDDING) moved = i;
        size_t plain = lg_plan_device_bytes_for(&model, &a, 16);
        check(r, tied ? moved < 0 : moved >= 0 && rem[moved].args.offload_embedding &&
                                        rem[moved].device_bytes < plain,
              "the remedies %s --offload embedding for %s (device %zu B, the table on it %zu B)",
              tied ? "leave out" : "price", model.name, moved < 0 ? 0 : rem[moved].device_bytes, plain);
    }
    static const struct {
        const char *model, *why;
        int lora_r, devices, streamed; /* streamed: --offload state,gradients,weights */
    } refusals[] = {
        {"test-llama31", "`offload weights` and `offload gradients`", 0, 1, 0}, /* trained */
        {"test-llama31", "`devices 2`", 0, 2, 1},                      /* trained, two ranks */
        {"test-gpt2", "tie_embeddings", 4, 1, 0},                      /* a tied table */
    };
    for (int i = 0; i < (int)(sizeof refusals / sizeof refusals[0]); i++) {
        lg_config model;
        if (load_config_or_fail(r, &model, refusals[i].model)) return;
        lg_args a;
        lg_args_default(&a);
        a.lora.r = refusals[i].lora_r;
        a.devices = refusals[i].devices;
        a.offload = a.offload_gradients = a.offload_weights = refusals[i].streamed;
        a.offload_embedding = 1;
        lg_plan_spec spec;
        lg_plan plan;
        lg_error refused = {0}, planned = {0};
        int args_rc = lg_args_check(&a, &refused);
        lg_plan_spec_from_args(&spec, &a, 16);
        int plan_rc = lg_plan_make(&plan, &model, &spec, &planned); /* a library's own spec */
        if (plan_rc == 0) lg_plan_free(&plan);
        const char *msg = args_rc != 0 ? refused.msg : planned.msg;
        check(r, plan_rc != 0 && strstr(msg, "`offload embedding`") && strstr(msg, refusals[i].why),
              "--offload embedding refused naming %s (the plan too): %s", refusals[i].why, msg);
    }
}

/* What recompute and offload save, as allocated: the arenas are the plan's, and the device
   pool shrinks by exactly what the plan says. */
static void test_recompute_offload_memory(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-pythia")) return;
    size_t device[3], host[3];
    const char *what[3] = {"plain", "--recompute block", "--offload"};
    int ok = 1;
    for (int v = 0; v < 3; v++) {
        lg_args a;
        lg_args_default(&a);
        a.micro_batch_size = 4;
        a.recompute = v == 1;
        a.offload = v == 2;
        lg_error err;
        lg_trainer tr;
        int rc = create_counting(&tr, &cfg, &a, 16, &err);
        if (rc != 0) { check(r, 0, "%s", err.msg); return; }
        const lg_rank_plan *p = &tr.plan.ranks[0];
        device[v] = p->pool_bytes[LG_POOL_DEVICE];
        host[v] = p->pool_bytes[LG_POOL_HOST];
        ok = ok && arenas_equal_plan(&tr);
        if (v == 1) /* each block keeps only its output; the rest is one shared block */
            for (int l = 0; l < cfg.n_layer; l++) {
                char name[64];
                snprintf(name, sizeof name, "activations.h.%d", l);
                ok = ok && tr.ranks[0].model.a.residual[l + 1].data == lg_rank_region(&tr.ranks[0].rank, name) &&
                     tr.ranks[0].model.a.h[l].n1.data == lg_rank_region(&tr.ranks[0].rank, "recompute.block");
            }
        if (v == 2)
            ok = ok && tr.ranks[0].host_grads.data == lg_rank_region(&tr.ranks[0].rank, "gradients.host") &&
                 lg_plan_find(p, "optimizer.m")->pool == LG_POOL_HOST &&
                 lg_plan_find(p, "master_weights")->pool == LG_POOL_HOST;
        lg_trainer_free(&tr);
    }
    /* the plan's own statement of the savings: activations and state regions */
    lg_plan_spec spec;
    lg_args a;
    lg_args_default(&a);
    a.micro_batch_size = 4;
    lg_plan_spec_from_args(&spec, &a, 16);
    lg_plan plain;
    lg_plan_make(&plain, &cfg, &spec, NULL);
    size_t state = lg_plan_group_bytes(&plain.ranks[0], LG_GROUP_MASTER, LG_POOL_DEVICE) +
                   lg_plan_group_bytes(&plain.ranks[0], LG_GROUP_OPTIMIZER, LG_POOL_DEVICE);
    lg_plan_free(&plain);
    ok = ok && device[0] - device[2] == state && device[1] < device[0] && host[2] > host[0];
    char s0[32], s1[32], s2[32];
    check(r, ok, "arenas = plan: device pool %s plain, %s with %s, %s with %s (master and "
          "optimizer state, %zu bytes, moved to the host)", lg_format_bytes(device[0], s0, sizeof s0),
          lg_format_bytes(device[1], s1, sizeof s1), what[1], lg_format_bytes(device[2], s2, sizeof s2),
          what[2], state);
}

/* ---- the memory plan ------------------------------------------------------------------------ */

/* The trainer allocates one arena per pool of the planned size (plus alignment slack), small
   tables besides, and nothing while it trains; every region the model, optimizer and data use
   sits at its planned place in its arena. */
static void check_allocations_match_plan(results *r, const char *config_name, int B, int T,
                                         lg_precision precision, lg_optimizer_kind optimizer,
                                         float momentum, int accumulation) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, config_name)) return;
    lg_args a;
    lg_args_default(&a);
    a.micro_batch_size = B;
    a.global_batch_size = B * accumulation;
    a.optimizer = optimizer;
    a.momentum = momentum;
    a.precision = precision;
    lg_error err;
    lg_trainer tr;
    int rc = create_counting(&tr, &cfg, &a, T, &err);
    if (rc != 0) { check(r, 0, "%s: %s", config_name, err.msg); return; }
    const lg_rank_plan *plan = &tr.plan.ranks[0];
    int arenas_found = 0, ok = 1;
    size_t other = 0;
    for (int i = 0; i < test_allocations.n; i++) {
        size_t bytes = test_allocations.sizes[i];
        int pool = test_allocations.blocks[i] == tr.ranks[0].rank.arena[LG_POOL_DEVICE] ? LG_POOL_DEVICE
                   : test_allocations.blocks[i] == tr.ranks[0].rank.arena[LG_POOL_HOST] ? LG_POOL_HOST
                                                                              : -1;
        if (pool >= 0) arenas_found += bytes == plan->pool_bytes[pool] + LG_ALIGN;
        else other += bytes;
    }
    /* tables: the parameter table, per-layer views, the plan's region list */
    size_t tables_bound = 32768 + (size_t)cfg.n_layer * 8192;
    ok = arenas_found == 2 && other <= tables_bound;

    /* the regions the trainer uses start where the plan puts them */
    const lg_rank *rank = &tr.ranks[0].rank;
    ok = ok && tr.ranks[0].model.params.data == lg_rank_region(rank, "weights") &&
         tr.ranks[0].model.grads.data == lg_rank_region(rank, "gradients") &&
         (void *)tr.ranks[0].inputs == lg_rank_region(rank, "tokens.inputs") &&
         (void *)tr.ranks[0].model.exec.gemm.base == lg_rank_region(rank, "gemm.workspace") &&
         tr.ranks[0].model.a.residual[0].data == lg_rank_region(rank, "activations.embedding") &&
         tr.ranks[0].model.a.d_res_a.data == lg_rank_region(rank, "backward") &&
         tr.ranks[0].model.a.ln_f.data == lg_rank_region(rank, "head");
    ok = ok && (optimizer == LG_OPTIMIZER_SGD && momentum == 0
                    ? tr.ranks[0].opt.m.data == NULL && lg_rank_region(rank, "optimizer.momentum") == NULL
                    : tr.ranks[0].opt.m.data == lg_rank_region(rank, optimizer == LG_OPTIMIZER_ADAMW
                                                                   ? "optimizer.m"
                                                                   : "optimizer.momentum"));
    for (int l = 0; l < cfg.n_layer; l++) {
        char name[64];
        snprintf(name, sizeof name, "activations.h.%d", l);
        ok = ok && tr.ranks[0].model.a.h[l].n1.data == lg_rank_region(rank, name);
        /* the block's last tensor, its output, ends exactly at the region's count */
        const lg_region *x = lg_plan_find(plan, name);
        ok = ok && x &&
             (char *)lg_at(tr.ranks[0].model.a.residual[l + 1], (size_t)B * T * cfg.n_embd).data ==
                 (char *)lg_rank_region(rank, name) + x->count * lg_dtype_size(x->dtype);
    }
    /* the weights region holds exactly the parameters; regions stay inside their arena */
    ok = ok && lg_plan_find(plan, "weights")->count == tr.ranks[0].model.n_params;
    for (int i = 0; i < plan->n_regions; i++) {
        const lg_region *x = &plan->regions[i];
        ok = ok && x->offset + x->bytes <= plan->pool_bytes[x->pool] &&
             x->bytes == (x->count * lg_dtype_size(x->dtype) + LG_ALIGN - 1) / LG_ALIGN * LG_ALIGN;
    }
    /* training allocates nothing */
    size_t n_tokens = 0;
    uint32_t *tokens = lg_builtin_task_tokens(1, (size_t)4 * B * T * accumulation + 1, &n_tokens);
    lg_loader ld;
    lg_loader_from_memory(&ld, tokens, n_tokens, T, cfg.vocab_size, 1, 1, &err);
    test_allocations.n = 0;
    test_allocations.counting = 1;
    lg_step_stats st;
    for (int s = 0; s < 2; s++) ok = ok && lg_trainer_step(&tr, &ld, s, &st, &err) == 0;
    test_allocations.counting = 0;
    ok = ok && test_allocations.n == 0;
    char size[32];
    check(r, ok, "%-12s -b %d -t %-3d %-10s %-5s x%d: arenas = plan (%s), %zu B of tables, "
          "regions in place, no allocation while training", config_name, B, T,
          lg_precision_name(precision),
          optimizer == LG_OPTIMIZER_ADAMW ? "adamw" : momentum ? "sgd+m" : "sgd", accumulation,
          lg_format_bytes(plan->pool_bytes[LG_POOL_DEVICE], size, sizeof size), other);
    lg_loader_close(&ld);
    lg_trainer_free(&tr);
}

static void test_plan_matches_allocations(results *r) {
    const char *configs[] = {"test-gpt2", "test-pythia", "test-llama", "test-falcon"};
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++) {
        check_allocations_match_plan(r, configs[i], 1, 8, LG_PRECISION_32_TRUE, LG_OPTIMIZER_ADAMW, 0.9f, 1);
        check_allocations_match_plan(r, configs[i], 4, 16, LG_PRECISION_BF16_MIXED, LG_OPTIMIZER_SGD, 0.9f, 2);
        check_allocations_match_plan(r, configs[i], 3, 5, LG_PRECISION_16_TRUE, LG_OPTIMIZER_SGD, 0.0f, 3);
        check_allocations_match_plan(r, configs[i], 2, 12, LG_PRECISION_BF16_TRUE, LG_OPTIMIZER_ADAMW, 0.9f, 1);
        check_allocations_match_plan(r, configs[i], 2, 7, LG_PRECISION_16_MIXED, LG_OPTIMIZER_ADAMW, 0.9f, 2);
    }
}

/* Model state of the 7B/8B plans against the arithmetic written out. */
static void test_plan_large_models(results *r) {
    /* Llama-2-7b: 32 blocks of q, k, v, o (4096 x 4096 each), three MLP matrices
       (4096 x 11008) and two norms (4096); embedding and head (32000 x 4096); final norm */
    size_t llama2 = 32 * (4 * 4096ull * 4096 + 3 * 4096ull * 11008 + 2 * 4096) +
                    2 * 32000ull * 4096 + 4096;
    /* Meta-Llama-3-8B: q and o 4096 x 4096, k and v 1024 x 4096 (8 groups of 128), MLP
       4096 x 14336, vocabulary 128256 */
    size_t llama3 = 32 * (2 * 4096ull * 4096 + 2 * 1024ull * 4096 + 3 * 4096ull * 14336 +
                          2 * 4096) + 2 * 128256ull * 4096 + 4096;
    const struct { const char *config; size_t n; } models[2] = {{"Llama-2-7b-hf", llama2},
                                                                 {"Meta-Llama-3-8B", llama3}};
    /* bytes per parameter: weights, master, gradients, each optimizer state (AdamW: two) */
    const struct { lg_precision p; size_t w, master, g, state; } modes[3] = {
        {LG_PRECISION_32_TRUE, 4, 0, 4, 4},
        {LG_PRECISION_BF16_TRUE, 2, 0, 2, 2},
        {LG_PRECISION_BF16_MIXED, 2, 4, 4, 4}};
    for (int i = 0; i < 2; i++) {
        lg_config cfg;
        if (load_config_or_fail(r, &cfg, models[i].config)) continue;
        for (int k = 0; k < 3; k++) {
            lg_plan_spec spec;
            memset(&spec, 0, sizeof spec);
            spec.B = 1; spec.T = 2048; spec.accumulation = 1; spec.devices = spec.nodes = 1;
            spec.threads = 1;
            spec.precision = modes[k].p;
            spec.optimizer = LG_OPTIMIZER_ADAMW;
            lg_plan plan;
            lg_error err;
            int rc = lg_plan_make(&plan, &cfg, &spec, &err);
            if (rc != 0) { check(r, 0, "%s: %s", models[i].config, err.msg); continue; }
            const lg_rank_plan *rp = &plan.ranks[0];
            size_t n = models[i].n;
            const lg_region *master = lg_plan_find(rp, "master_weights");
            int ok = rc == 0 && lg_plan_find(rp, "weights")->bytes == n * modes[k].w &&
                     lg_plan_find(rp, "gradients")->bytes == n * modes[k].g &&
                     lg_plan_find(rp, "optimizer.m")->bytes == n * modes[k].state &&
                     lg_plan_find(rp, "optimizer.v")->bytes == n * modes[k].state &&
                     (modes[k].master ? master && master->bytes == n * modes[k].master : !master);
            size_t state = n * (modes[k].w + modes[k].master + modes[k].g + 2 * modes[k].state);
            check(r, ok, "%-16s %-10s model state %zu bytes = %zu params x %zu bytes",
                  models[i].config, lg_precision_name(modes[k].p), state, n,
                  modes[k].w + modes[k].master + modes[k].g + 2 * modes[k].state);
            if (rc == 0) lg_plan_free(&plan);
        }
    }
}

static int run_capture(const char *args, char *out, size_t cap) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "./train %s 2>&1", args);
    FILE *p = popen(cmd, "r");
    size_t n = p ? fread(out, 1, cap - 1, p) : 0;
    out[n] = '\0';
    char rest[4096]; /* read what did not fit, so the child never meets a closed pipe */
    while (p && fread(rest, 1, sizeof rest, p) > 0) continue;
    int status = p ? pclose(p) : -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* The planner puts LoRA's token embedding in host memory by itself where that makes the run
   fit (lg_plan_auto_embedding) and says so: QLoRA Llama-3.1-8B on an 8 GB card at 15,370
   tokens (the context table's cell: the table on the device does not fit), not at 9,000 (it
   fits there), never for a tied table (Llama-3.2-1B) nor on the CPU backend (one memory). */
static void test_auto_embedding(results *r) {
    static char out[1 << 16];
    const char *note = "LoRA's frozen table in host memory (--offload embedding)";
    const char *run = "-c Llama-3.1-8B -b 1 -p bf16-true --lora-r 32 --lora-targets all --quantize "
                      "nf4 --recompute block --offload activations --host-memory-limit 64GiB";
    const struct { const char *what, *flags; int T, code, moved; } cases[4] = {
        {"8 GB, 15370 tokens", "--gpu rtx4060", 15370, 0, 1},
        {"8 GB, 9000 tokens", "--gpu rtx4060", 9000, 0, 0},
        {"tied Llama-3.2-1B on 8 GB, 131072 tokens", "--gpu rtx4060 -c Llama-3.2-1B", 131072, 3, 0},
        {"CPU backend, 4 GiB", "--memory-limit 4GiB", 4096, 3, 0}};
    for (int k = 0; k < 4; k++) {
        char args[768];
        snprintf(args, sizeof args, "--plan %s -t %d %s", run, cases[k].T, cases[k].flags);
        int code = run_capture(args, out, sizeof out);
        int moved = strstr(out, note) != NULL, listed = strstr(out, "embedding.host") != NULL;
        check(r, code == cases[k].code && moved == cases[k].moved && listed == cases[k].moved,
              "--plan %s: exit %d, the token embedding %s", cases[k].what, code,
              moved ? "in host memory by the planner's choice" : "on the device");
    }
}

/* The flags in a usage entry's left column ("  -c, --config NAME|PATH", "      --lr X
   --min-lr X", "      --plan[=json|svg]"): for each, a command line that gives it (with a
   value, "=1", where the entry shows one; its letter too) and then -h, into args; returns how
   many. */
static int usage_entry_flags(const char *left, char args[][96], int cap) {
    int count = 0;
    char letter = 0;
    for (const char *w = left + strspn(left, " "); *w && count + 2 <= cap; w += strspn(w, " ")) {
        size_t len = strcspn(w, " ");
        const char *next = w + len + strspn(w + len, " ");
        int value = (*next && *next != '-') || memchr(w, '[', len) != NULL;
        if (w[0] == '-' && w[1] != '-') letter = w[1]; /* "-c," */
        if (strncmp(w, "--", 2) == 0) {
            snprintf(args[count++], 96, "--plan=json %.*s%s -h", (int)strcspn(w, "[ "), w,
                     value ? "=1" : "");
            if (letter)
                snprintf(args[count++], 96, "--plan=json -%c%s -h", letter, value ? "1" : "");
            letter = 0;
        }
        w += len;
    }
    return count;
}

/* The usage text and the parser come from one table in train.c: every flag --help lists is
   one the parser knows, taking a value where the text shows one. `./train --plan=json --NAME=1
   -h` (--NAME -h for a flag shown without a value; -X likewise) stops at -h with the usage
   (exit 0) or at a value it refuses (exit 2), never at "unknown option" or "needs a value"; a
   flag shown without a value that took one would swallow -h and print the plan. */
static void test_usage_flags_parse(results *r) {
    static char usage[32768], out[32768];
    char args[4][96], first_bad[256] = "";
    int tried = 0, bad = 0;
    int rc = run_capture("--help", usage, sizeof usage);
    for (char *line = usage; rc == 0 && *line; line += strcspn(line, "\n"), line += *line == '\n') {
        size_t indent = strspn(line, " "), n = strcspn(line, "\n");
        if (line[indent] != '-' || indent > 6) continue; /* help lines are indented more */
        char left[128];
        snprintf(left, sizeof left, "%.*s", (int)n, line);
        char *gap = strstr(left + indent, "  "); /* where the help starts */
        if (gap) *gap = '\0';
        int k = usage_entry_flags(left, args, 4);
        for (int i = 0; i < k; i++, tried++) {
            int code = run_capture(args[i], out, sizeof out);
            int ok = (code == 0 && strstr(out, "usage: ./train")) ||
                     (code == 2 && !strstr(out, "unknown option") && !strstr(out, "needs a value"));
            if (!ok && bad++ == 0)
                snprintf(first_bad, sizeof first_bad, "%.96s: exit %d", args[i], code);
        }
    }
    check(r, rc == 0 && tried > 0 && bad == 0, "every flag --help lists is one the parser knows, "
          "with a value where the text shows one: %d command lines, %d wrong %s", tried, bad,
          first_bad);
}

/* The string literals of C source text, each run of adjacent literals joined into one (a
   message split over lines), comments and character constants skipped; each is handed to
   `visit` with ctx. */
static void each_string_literal(const char *src, void (*visit)(const char *text, void *ctx),
                                void *ctx) {
    static char joined[8192];
    size_t n = 0;
    int open = 0; /* a literal ended and only blanks followed so far */
    for (const char *p = src; *p;) {
        if (strncmp(p, "/*", 2) == 0 || strncmp(p, "//", 2) == 0) {
            const char *end = p[1] == '*' ? strstr(p + 2, "*/") : strchr(p, '\n');
            p = end ? end + (p[1] == '*' ? 2 : 0) : p + strlen(p);
            continue;
        }
        if (*p == '"' || *p == '\'') {
            char quote = *p++;
            for (; *p && *p != quote; p++) {
                if (*p == '\\' && p[1]) p++;
                if (quote == '"' && n + 2 < sizeof joined) joined[n++] = *p;
            }
            if (*p) p++;
            open = quote == '"';
            continue;
        }
        if (open && !strchr(" \t\r\n", *p)) { /* the run of literals ended */
            joined[n] = '\0';
            visit(joined, ctx);
            n = 0;
            open = 0;
        }
        p++;
    }
}

/* What the no-flags test gathers from the library's literals. */
typedef struct {
    int flags;            /* flag spellings found */
    char first_flag[160]; /* the first literal with one */
    char keys[64][40];    /* the settings its messages mark (lg_setting_mark) */
    int n_keys;
} library_literals;


/* Visits the string literals of each source file (n of them), with the table that starts at
   `blank` (up to its closing "\n};") left out when blank is not NULL; 0, or -1 after a
   failed check naming a file that does not read. */
static int each_literal_of(results *r, const char *const *sources, size_t n, const char *blank,
                           void (*visit)(const char *text, void *ctx), void *ctx) {
    lg_error err;
    for (size_t i = 0; i < n; i++) {
        size_t length;
        char *text = lg_read_file(sources[i], &length, "source", &err);
        if (!text) {
            check(r, 0, "%s", err.msg);
            return -1;
        }
        char *table = blank ? strstr(text, blank) : NULL;
        char *end = table ? strstr(table, "\n};") : NULL;
        if (end) memset(table, ' ', (size_t)(end - table));
        each_string_literal(text, visit, ctx);
        LG_FREE(text);
    }
    return 0;
}
/* A flag's spelling at text[i]: "--name", or "-x" as a word ("-b 4", "(-d", "-t/--"). */
static int flag_spelled_at(const char *text, size_t i) {
    int word_start = i == 0 || strchr(" (/[,'\"", text[i - 1]) != NULL;
    if (!word_start || text[i] != '-') return 0;
    if (text[i + 1] == '-') return text[i + 2] >= 'a' && text[i + 2] <= 'z';
    int letter = (text[i + 1] >= 'a' && text[i + 1] <= 'z') || (text[i + 1] >= 'A' && text[i + 1] <= 'Z');
    return letter && (text[i + 2] == '\0' || strchr(" /,)", text[i + 2]) != NULL);
}

static void gather_library_literal(const char *text, void *ctx) {
    library_literals *lit = (library_literals *)ctx;
    for (size_t i = 0; text[i]; i++) {
        size_t key_len;
        const char *value;
        if (flag_spelled_at(text, i) && lit->flags++ == 0)
            snprintf(lit->first_flag, sizeof lit->first_flag, "%.150s", text);
        if (!lg_setting_mark(text + i, &key_len, &value) || key_len >= sizeof lit->keys[0])
            continue;
        int known = 0;
        for (int k = 0; k < lit->n_keys; k++)
            known |= strlen(lit->keys[k]) == key_len && strncmp(lit->keys[k], text + i + 1, key_len) == 0;
        if (!known && lit->n_keys < 64) snprintf(lit->keys[lit->n_keys++], 40, "%.*s", (int)key_len, text + i + 1);
    }
}

/* The setting key names a row of train.c's flag table: "key" is the column after the row's
   handler (set_...), e.g. {"micro-batch-size", 'b', FLAG_VALUE, "N", set_micro_batch_size,
   "micro_batch_size", ...}. */
static int flag_table_has_setting(const char *table, const char *key) {
    char quoted[48];
    snprintf(quoted, sizeof quoted, ", \"%s\",", key);
    for (const char *at = strstr(table, quoted); at; at = strstr(at + 1, quoted)) {
        const char *handler = at;
        while (handler > table && (isalnum((unsigned char)handler[-1]) || handler[-1] == '_')) handler--;
        if (strncmp(handler, "set_", 4) == 0) return 1;
    }
    return 0;
}

/* The library knows settings, not train's flags: no string literal of litgpt.h or
   litgpt_cuda.cuh spells a flag ("--name", "-x"), and every setting its messages mark
   (`key`, `key value`: lg_spell_settings) is one that train.c's flag table maps to a flag, so
   that ./train's messages name the flag at fault. */
static void test_library_names_settings(results *r) {
    static const char *const sources[] = {"litgpt.h", "litgpt_cuda.cuh"};
    library_literals lit;
    memset(&lit, 0, sizeof lit);
    lg_error err;
    if (each_literal_of(r, sources, sizeof sources / sizeof sources[0], NULL,
                        gather_library_literal, &lit) != 0)
        return;
    check(r, lit.flags == 0, "no flag spelled in the string literals of litgpt.h and "
          "litgpt_cuda.cuh: %d found %s", lit.flags, lit.first_flag);
    size_t length;
    char *train = lg_read_file("train.c", &length, "source", &err);
    const char *table = train ? strstr(train, "static const flag_row flag_table[] = {") : NULL;
    char unmapped[256] = "";
    /* a tool's own setting, which that tool spells: the chat template (tools/prepare) */
    size_t prepare_length;
    char *prepare = lg_read_file("tools/prepare.c", &prepare_length, "source", &err);
    int tool_spells = prepare && strstr(prepare, "{\"template\", \"--template\"}") != NULL;
    for (int k = 0; table && k < lit.n_keys; k++)
        if (!flag_table_has_setting(table, lit.keys[k]) &&
            !(tool_spells && strcmp(lit.keys[k], "template") == 0))
            snprintf(unmapped + strlen(unmapped), sizeof unmapped - strlen(unmapped), " %s", lit.keys[k]);
    check(r, table && lit.n_keys > 20 && !unmapped[0], "each of the %d settings the library's "
          "messages name maps to a flag in train.c's table (template: tools/prepare's "
          "--template); unmapped:%s", lit.n_keys, unmapped[0] ? unmapped : " none");
    LG_FREE(train);
    LG_FREE(prepare);
}

/* A tool's speller (lg_setting_flag): the settings of its table as its flags, with or without
   a value; any other by its name, the backquotes gone; no table: every one by its name. */
static void test_tool_speller(results *r) {
    static const lg_setting_flag_row flags[] = {{"template", "--template"}, {NULL, NULL}};
    const char *marked = "`template auto`: none fits; name one with `template` (`devices 2` x "
                         "`nodes` 1, `lora.r`)";
    char with[256], without[256];
    lg_spell_settings(marked, lg_setting_flag, (void *)flags, with, sizeof with);
    lg_spell_settings(marked, lg_setting_flag, NULL, without, sizeof without);
    check(r, strcmp(with, "--template auto: none fits; name one with --template (devices 2 x "
                          "nodes 1, lora.r)") == 0 &&
                 strcmp(without, "template auto: none fits; name one with template (devices 2 x "
                                 "nodes 1, lora.r)") == 0,
          "a tool's speller: its flags, other settings by name, no marks left: \"%s\", without "
          "flags \"%s\"", with, without);
}

/* Where the driver's literals spell a flag: the count and the first (exceptions: the usage
   pointer of every refusal, and tools/prepare's own --tokenizer). */
typedef struct {
    int flags;
    char first[160];
} driver_literals;

static void gather_driver_literal(const char *text, void *ctx) {
    static const char *const allowed[] = {"(see ./train --help)", "tools/prepare --tokenizer"};
    driver_literals *lit = (driver_literals *)ctx;
    char copy[8192];
    snprintf(copy, sizeof copy, "%s", text);
    for (size_t k = 0; k < sizeof allowed / sizeof allowed[0]; k++)
        for (char *at = strstr(copy, allowed[k]); at; at = strstr(at, allowed[k]))
            memset(at, '.', strlen(allowed[k]));
    for (size_t i = 0; copy[i]; i++)
        if (flag_spelled_at(copy, i) && lit->flags++ == 0)
            snprintf(lit->first, sizeof lit->first, "%.150s", text);
}

/* Each flag is spelled once in train.c, in its flag table: every other literal of train.c and
   train_svg.h names settings (print_settings, die_usage_settings, spell_flags), so the usage
   text, the parser, the messages and the remedies' command lines all come from the table. */
static void test_driver_spells_flags_once(results *r) {
    static const char *const sources[] = {"train.c", "train_svg.h"};
    driver_literals lit;
    memset(&lit, 0, sizeof lit);
    if (each_literal_of(r, sources, sizeof sources / sizeof sources[0],
                        "static const flag_row flag_table[] = {", /* it spells them */
                        gather_driver_literal, &lit) != 0)
        return;
    check(r, lit.flags == 0, "train.c spells each flag once, in its table (train.c and "
          "train_svg.h elsewhere: %d spellings) %s", lit.flags, lit.first);
}

/* A limit below the plan: exit 3, the diagnosis, and a suggested command that runs. */
static void test_memory_limit(results *r) {
    static char out[16384], again[16384];
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    lg_args a;
    lg_args_default(&a);
    a.micro_batch_size = 8; /* the CPU backend: both pools, what the fit check holds */
    size_t needs = lg_plan_checked_bytes_for(&cfg, &a, 16);
    a.micro_batch_size = 1;
    size_t least = lg_plan_checked_bytes_for(&cfg, &a, 16);
    char args[256]; /* a limit between what -b 1 and -b 8 need */
    snprintf(args, sizeof args, "-c test-llama -b 8 -g 8 -t 16 --memory-limit %zuB --max-steps 1 "
             "--eval-iters 1", (needs + least) / 2);
    int code = run_capture(args, out, sizeof out);
    int ok = code == 3 && strstr(out, "this run needs") && strstr(out, "largest regions:") &&
             strstr(out, "smaller micro-batch") && strstr(out, "shorter sequence") &&
             strstr(out, "-p bf16-true") && strstr(out, "--recompute block") &&
             strstr(out, "--offload") && strstr(out, "--optimizer-state 8bit");
    char *cmd = strstr(out, "cheapest change that fits");
    cmd = cmd ? strstr(cmd, "./train ") : NULL;
    check(r, ok && cmd, "--memory-limit below the plan: exit %d with the diagnosis (%s)", code, args);
    if (!cmd) return;
    char *end = strchr(cmd, '\n');
    if (end) *end = '\0';
    printf("        suggested: %s\n", cmd);
    code = run_capture(cmd + strlen("./train "), again, sizeof again);
    check(r, code == 0 && strstr(again, "step     1/1"), "the suggested command trains under the same limit (exit %d)", code);
}

/* -b auto takes the largest divisor of the per-device batch that fits; the next does not. */
static void test_auto_micro_batch(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    lg_args a;
    lg_args_default(&a);
    a.global_batch_size = 24;
    int T = 16;
    a.micro_batch_size = 6;
    size_t limit = lg_plan_checked_bytes_for(&cfg, &a, T); /* exactly what -b 6 needs */
    int b = lg_plan_auto_micro_batch(&cfg, &a, T, limit);
    a.micro_batch_size = 8; /* the next divisor of 24 */
    size_t next = lg_plan_checked_bytes_for(&cfg, &a, T);
    check(r, b == 6 && next > limit, "-b auto -g 24 under the plan of -b 6: picks %d; -b 8 needs %zu > %zu", b, next, limit);
    char out[4096], args[256];
    snprintf(args, sizeof args, "-c test-llama -b auto -g 24 -t 16 --memory-limit %zuB --max-steps 1 "
             "--eval-iters 1", limit);
    int code = run_capture(args, out, sizeof out);
    check(r, code == 0 && strstr(out, "-b auto: micro-batch"), "./train -b auto says what it chose: %.*s",
          (int)(strchr(out, '\n') ? strchr(out, '\n') - out : 0), out);
}

static void test_plan_cli(results *r) {
    static const char *configs[] = {"gpt2", "pythia-14m", "pythia-70m", "pythia-160m",
                                    "tiny-llama-1.1b", "Llama-2-7b-hf", "Llama-3.2-1B",
                                    "Meta-Llama-3-8B", "Mistral-7B-v0.1", "Qwen2.5-0.5B",
                                    "SmolLM2-135M"};
    static char out[65536];
    int ok = 1;
    double start = lg_time_ms();
    for (size_t i = 0; i < sizeof configs / sizeof configs[0]; i++) {
        char args[256];
        snprintf(args, sizeof args, "--plan -c %s -b 1 -t 512 --memory-limit 1TiB", configs[i]);
        ok = ok && run_capture(args, out, sizeof out) == 0 && strstr(out, "total per device");
        snprintf(args, sizeof args, "--plan=json -c %s -t 512 -d 8 -p bf16-true --offload "
                 "--memory-limit 1TiB", configs[i]);
        ok = ok && run_capture(args, out, sizeof out) == 0 && strstr(out, "\"device_bytes\":") &&
             strstr(out, "\"host_bytes\":") && strstr(out, "\"dtype\":\"bf16\"");
    }
    check(r, ok, "--plan and --plan=json for all 11 shipped configs (%.0f ms for 22 runs)",
          lg_time_ms() - start);
    int code = run_capture("-c Meta-Llama-3-8B -t 256 -b 1", out, sizeof out);
    check(r, code == 3, "an 8B run on this machine stops before allocating (exit %d)", code);
}

#include "test_sharding.c"

/* ---- checkpoints -------------------------------------------------------------------------- */

#include "test_checkpoint.c"

/* Runs another test runner (its output shown) and adds its counts. */
/* Reads a child test program's output to its end: its lines go to stdout, its "N passed, M
   failed" summary into the results (a child that ends without one is a failure). */
static void read_child_tests(results *r, const char *cmd, FILE *p) {
    char line[512];
    int passed = 0, failed = 0, got = 0;
    while (p && fgets(line, sizeof line, p)) {
        if (sscanf(line, "%d passed, %d failed", &passed, &failed) == 2) {
            got++; /* (a command of several programs gives one summary each) */
            r->passed += passed;
            r->failed += failed;
        } else fputs(line, stdout);
    }
    if (p) pclose(p);
    if (!got) check(r, 0, "%s ran", cmd);
}

static void run_child_tests(results *r, const char *cmd) { read_child_tests(r, cmd, popen(cmd, "r")); }

/* Two child test programs at once (one core each), their outputs read one after the other. */
static void run_child_tests_side_by_side(results *r, const char *a, const char *b) {
    FILE *pa = popen(a, "r"), *pb = popen(b, "r");
    read_child_tests(r, a, pa);
    read_child_tests(r, b, pb);
}

/* Every mode test_cuda lists (--list) is in one of the two parts (space-separated names). */
static void check_every_mode_in(results *r, const char *parts[2]) {
    FILE *p = popen("./build/test_cuda_emulated --list", "r");
    char name[64], word[80], both[512], missing[256] = "";
    snprintf(both, sizeof both, " %s %s ", parts[0], parts[1]); /* each name between spaces */
    int listed = 0;
    while (p && fscanf(p, "%63s", name) == 1) {
        listed++;
        snprintf(word, sizeof word, " %s ", name);
        if (!strstr(both, word))
            snprintf(missing + strlen(missing), sizeof missing - strlen(missing), " %s", name);
    }
    if (p) pclose(p);
    check(r, listed > 0 && !missing[0], "the emulated second run's two parts take all %d modes "
          "test_cuda lists; missing:%s", listed, missing[0] ? missing : " none");
}

/* The CUDA backend's kernels and trainer on the CPU, through tests/cuda_emulator.h: the
   emulator's own checks, then tests/gpu/test_cuda.c on four emulated GPUs with the threads of
   a block in ascending order, and beside it in descending order (a kernel missing a barrier
   gives other results) with every collective run as late as a GPU could (an op missing its wait
   for one reads stale data), then the driver built for the emulator. */
static void run_emulated_cuda_tests(results *r) {
    run_child_tests(r, "./build/test_cuda_emulator");
    /* host visits (host code touching device memory) do not depend on the threads' order: the
       first run checks them, the second leaves device memory open (its page protection
       changes around every kernel cost over half of a run's time) */
    /* the lever combinations (each family in one mode) only in the second: its collectives
       and asynchronous copies deferred, so that a missing wait reads what is not there yet
       (test_offload_overlap removes one to show it). The first stands for an
       H100 (sm_90, 227 KiB of shared memory a block), the second for an RTX 4090 or A10
       (sm_86/89: 99 KiB), so that every kernel launches within both limits */
    /* the second run's modes in two parts, so that each core has about half of the work (on
       the 2-core AMD EPYC: the first run 88 s, the second's first part 30 s, its second 113 s) */
    const char *second[2] = {"ops attention steps grads devices",
                             "features resume memory combinations"};
    const char *second_env = "OMP_NUM_THREADS=1 LG_EMU_DEVICES=4 LG_EMU_ORDER=reverse "
                             "LG_EMU_DEFER_COLLECTIVES=1 LG_EMU_DEFER_COPIES=1 LG_EMU_ARCH=sm_86 "
                             "LG_EMU_HOST_VISITS=allow ./build/test_cuda_emulated";
    check_every_mode_in(r, second);
    char lane_a[512], lane_b[512];
    snprintf(lane_a, sizeof lane_a, "OMP_NUM_THREADS=1 LG_EMU_DEVICES=4 LG_EMU_ARCH=sm_90 "
             "./build/test_cuda_emulated ops attention steps grads features resume devices "
             "memory; %s %s", second_env, second[0]);
    snprintf(lane_b, sizeof lane_b, "%s %s", second_env, second[1]);
    run_child_tests_side_by_side(r, lane_a, lane_b);
    /* the driver's GPU path: ranks on GPUs, the topology, the fit check against GPU memory */
    const char *small = "-c test-llama -t 16 -b 2 -g 4 --max-steps 2 --eval-every 0";
    char args[256];
    snprintf(args, sizeof args, "%s -d 2", small);
    expect_program(r, "LG_EMU_DEVICES=2 ./build/train_emulated", args, 0, "2 GPUs");
    expect_program(r, "LG_EMU_DEVICES=2 ./build/train_emulated", args, 0, "GPU peer access");
    snprintf(args, sizeof args, "%s -g 6 -d 3", small);
    expect_program(r, "LG_EMU_DEVICES=2 ./build/train_emulated", args, 2,
                   "3 ranks, one a GPU, but 2 GPUs are visible");
    expect_program(r, "LG_EMU_DEVICES=1 LG_EMU_ARCH=sm_75 ./build/train_emulated", small, 1,
                   "has compute capability 7.5: the CUDA kernels need 8.0 or newer");
    expect_program(r, "LG_EMU_DEVICES=0 ./build/train_emulated", small, 0,
                   "no GPU is visible: running on the CPU backend");
    expect_program(r, "LG_EMU_DEVICES=1 LG_EMU_MEMORY=256M ./build/train_emulated",
                   "-c pythia-160m -t 512 -b 4 --max-steps 1", 3, "the GPU's memory");
}

/* ---- data: tokenizers, fine-tuning samples, readers ------------------------------------------ */

#include "test_data.c"
#include "test_lora.c"
#include "test_packing.c"
#include "test_grads_written.c"
#include "test_gemm.c"
#include "test_cpu_ops.c"

/* ---- NF4 weight storage (QLoRA) ----------------------------------------------------------- */

#include "test_nf4.c"

/* ---- processes: launchers, mpirun ------------------------------------------------------------ */

#include "test_processes.c"

/* ---- a new user's first hour ---------------------------------------------------------------- */

#include "test_first_hour.c"
#include "test_hostile.c"
#include "test_real_models.c"
#include "test_generate.c"
#include "test_gguf.c"
#include "test_long_context.c"
#include "test_combinations.c"

/* Starts a section: prints its name and says whether to run it. `./tests/test WORD` runs only
   the sections whose names contain WORD (e.g. `./tests/test plan`); no argument runs all. */
static int section(const char *name, int argc, char **argv) {
    if (argc > 1 && !strstr(name, argv[1])) return 0;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    printf("[%6ld s] %s\n", (long)now.tv_sec, name);   /* the clock tells where a slow suite spends */
    fflush(stdout);
    return 1;
}

int main(int argc, char **argv) {
    results r = {0, 0};
    if (section("matmul kernels", argc, argv)) test_gemm_paths(&r);
    if (section("cpu ops: AVX-512 loops of the memory-bound ops", argc, argv)) test_cpu_ops_paths(&r);
    if (section("the matmul paths of a build for any x86-64 (no -march=native)", argc, argv))
        run_child_tests(&r, "./build/test_portable 'matmul kernels'");
    if (section("PyTorch reference (fp32)", argc, argv)) {
        test_reference(&r, "test-gpt2");
        test_reference(&r, "test-pythia");
        test_reference(&r, "test-llama");
        test_reference(&r, "test-falcon");
        test_reference(&r, "test-llama31");
    }
    if (section("configs", argc, argv)) {
        test_config_param_counts(&r);
        test_config_errors(&r);
        test_rope_adjustments(&r);
    }
    if (section("data", argc, argv)) test_shards(&r);
    if (section("optimizers", argc, argv)) {
        test_optimizer_math(&r);
        test_clipping(&r);
        test_optimizer_elements(&r);
        test_lion_trains(&r);
        test_sophia_trains(&r);
        test_quantization(&r);
        test_compact_state_trains(&r);
        test_optimizer_state_bytes(&r);
    }
    if (section("training", argc, argv)) {
        test_accumulation(&r);
        test_determinism(&r);
        test_parallel_init(&r);
        test_families_memorise(&r);
    }
    if (section("gradients written on the first micro-batch", argc, argv)) test_grads_written(&r);
    if (section("checkpoints", argc, argv)) test_checkpoints(&r);
    if (section("command line", argc, argv)) {
        test_enum_names(&r);
        test_cli(&r);
        test_usage_flags_parse(&r);
        test_library_names_settings(&r);
        test_tool_speller(&r);
        test_driver_spells_flags_once(&r);
    }
    if (section("first hour: the design card, configs, outputs, progress", argc, argv))
        test_first_hour(&r);
    if (section("precision", argc, argv)) {
        test_conversions(&r);
        test_stochastic_rounding(&r);
        test_stochastic_rounding_learns(&r);
        test_precisions_train(&r);
        test_precision_memory(&r);
        test_loss_scaler(&r);
    }
    if (section("recompute and offload", argc, argv)) {
        test_recompute_offload_bitwise(&r);
        test_recompute_offload_memory(&r);
        test_offload_activations_bitwise(&r);
        test_offload_activations_memory(&r);
        test_offload_gradients_bitwise(&r);
        test_offload_gradients_memory(&r);
        test_offload_weights_bitwise(&r);
        test_offload_weights_memory(&r);
        test_offload_embedding_bitwise(&r);
        test_offload_embedding_memory(&r);
        test_trained_embedding_memory(&r);
    }
    if (section("memory plan", argc, argv)) {
        test_plan_matches_allocations(&r);
        test_plan_large_models(&r);
        test_memory_limit(&r);
        test_auto_micro_batch(&r);
        test_plan_cli(&r);
        test_plan_for_gpus(&r);
        test_context_table_in_readme(&r);
        test_host_traffic(&r);
        test_step_flops(&r);
        test_cuda_workspace_sized(&r);
        test_gpu_cards_and_margin(&r);
        test_runtime_estimate_per_card(&r);
        test_auto_seq_length(&r);
        test_auto_seq_length_host(&r);
        test_auto_embedding(&r);
    }
    if (section("the head and loss in chunks", argc, argv)) {
        test_head_chunks_model(&r);
        test_head_chunks_trainer(&r);
        test_head_rows_auto(&r);
    }
    if (section("lever combinations: every pair trains the same model", argc, argv))
        test_combinations_all(&r);
    if (section("data files: tokenizers, samples, readers", argc, argv)) test_data_all(&r);
    if (section("runs that report nonsense: untrained samples, validation", argc, argv))
        test_nonsense_runs(&r);
    if (section("nf4 (QLoRA's weight storage)", argc, argv)) test_nf4_all(&r);
    if (section("hostile input", argc, argv)) test_hostile_all(&r);
    if (section("fuzz targets under ASan and UBSan", argc, argv)) test_fuzz_targets(&r);
    if (section("real models and data", argc, argv)) test_real_models_all(&r);
    if (section("GGUF export, checked by llama.cpp", argc, argv)) test_gguf_all(&r);
    if (section("export: output paths, links, devices, template text", argc, argv)) test_gguf_files(&r);
    if (section("devices and sharding", argc, argv)) test_sharding(&r);
    if (section("processes: launchers, mpirun, rendezvous", argc, argv)) test_processes(&r);
    if (section("LoRA and QLoRA", argc, argv)) test_lora_all(&r);
    if (section("QLoRA's lm_head a vocabulary tile at a time", argc, argv)) test_lora_head_tiles(&r);
    if (section("sample packing", argc, argv)) test_packing_all(&r);
    if (section("generation: KV cache, sampling, tools/generate", argc, argv)) test_generate_all(&r);
    if (section("gradients in double precision", argc, argv)) run_child_tests(&r, "./tests/test64");
    if (section("CUDA backend, emulated on the CPU", argc, argv)) run_emulated_cuda_tests(&r);
    if (section("GPU script: tests/gpu/run.sh dry run (stand-ins, a crash, a hang, a kill)", argc, argv))
        run_child_tests(&r, "sh tests/gpu/dry_run.sh");
    printf("%d passed, %d failed\n", r.passed, r.failed);
    return r.failed ? 1 : 0;
}
#endif
