/* tests/check.h — what the test runners (tests/test.c, tests/gpu/test_cuda.c) share: the one
   way to record a check, and the helpers both need. Included after litgpt.h. Each runner ends
   with the line "N passed, N failed". */
#include <stdarg.h>
#include <stdio.h>

typedef struct {
    int passed, failed;
} results;

/* Records one check and prints it: "  ok    what" or "  FAIL  what". */
static void check(results *r, int ok, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf(ok ? "  ok    " : "  FAIL  ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    if (ok) r->passed++;
    else r->failed++;
}

/* configs/NAME.yaml, or a failed check naming it. */
static int load_config_or_fail(results *r, lg_config *cfg, const char *name) {
    char path[256];
    lg_error err;
    snprintf(path, sizeof path, "configs/%s.yaml", name);
    if (lg_config_load(cfg, path, &err) == 0) return 0;
    check(r, 0, "load %s: %s", path, err.msg);
    return -1;
}

/* The weights of a trained run in lg_real (fp32, or double in tests/test64), the whole layout
   (LG_MALLOC'd). */
static lg_real *trained_weights(lg_trainer *tr) {
    size_t n = tr->ranks[0].model.n_params;
    lg_real *w = (lg_real *)lg_alloc_zeroed(n * sizeof(lg_real));
    lg_trainer_weights(tr, lg_buf_of(w));
    return w;
}

#ifndef LG_REAL_DOUBLE /* training over several steps: the float runners */
/* Steps first..last-1 of tr on ld, their losses into losses[first..]; -1 (with the message
   printed) when a step fails. */
static int run_step_range(lg_trainer *tr, lg_loader *ld, int first, int last, double *losses) {
    lg_error err;
    for (int s = first; s < last; s++) {
        lg_step_stats st;
        if (lg_trainer_step(tr, ld, s, &st, &err) != 0) { printf("    %s\n", err.msg); return -1; }
        losses[s] = st.loss;
    }
    return 0;
}
#endif
