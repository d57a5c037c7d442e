/* tests/check.h — the test runners' one way to record a check (tests/test.c and
   tests/gpu/test_cuda.c). Each runner ends with the line "N passed, N failed". */
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
