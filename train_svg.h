/* train_svg.h: the driver's pictures (--plot's loss curve, --plan=svg's memory bars), and the
   remedies written as flags. Self-written SVG, no dependency. Included once by train.c at the
   point where these functions were (they use the helpers above it), so train.c stays the one
   translation unit of both builds; valid C and C++. */

/* --- pictures: self-written SVG, no dependency ------------------------------------------- */

#define SVG_W 820
#define SVG_H 440
#define SVG_LEFT 70  /* room for the left axis' labels */
#define SVG_RIGHT 80 /* and the right one's */
#define SVG_TOP 40   /* the title and legend */
#define SVG_BOTTOM 50
#define SVG_BAR_SLOT 100 /* the plan's narrowest bar slot: room for a remedy's flags */

/* A value range mapped onto pixels [p0, p1]. */
typedef struct {
    double v0, v1, p0, p1;
} svg_scale;

static double svg_at(const svg_scale *s, double v) {
    double span = s->v1 > s->v0 ? s->v1 - s->v0 : 1;
    return s->p0 + (v - s->v0) / span * (s->p1 - s->p0);
}

static void svg_begin(FILE *f, const char *title, int width) {
    fprintf(f, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
               "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
               "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"12\">\n"
               "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
               "<text x=\"%d\" y=\"20\" font-size=\"14\" font-weight=\"bold\">%s</text>\n",
            width, SVG_H, width, SVG_H, SVG_LEFT, title);
}

/* Five labelled ticks of a vertical axis at x (labels left of it, or right with right = 1). */
static void svg_axis_ticks(FILE *f, const svg_scale *y, double x, int right, const char *unit_fmt,
                           double unit) {
    for (int i = 0; i <= 4; i++) {
        double v = y->v0 + (y->v1 - y->v0) * i / 4, py = svg_at(y, v);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#999\"/>\n",
                x - (right ? 0 : 4), py, x + (right ? 4 : 0), py);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"%s\">", x + (right ? 7 : -7),
                py + 4, right ? "start" : "end");
        fprintf(f, unit_fmt, v / unit);
        fputs("</text>\n", f);
    }
}

/* Writes path.tmp, then renames it over path: a browser never reads half a picture. */
static FILE *svg_open(const char *path, char *tmp, size_t size) {
    snprintf(tmp, size, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) die_write(tmp);
    return f;
}

static void svg_close(FILE *f, const char *tmp, const char *path) {
    fputs("</svg>\n", f);
    int failed = ferror(f);
    if (fclose(f) != 0 || failed || rename(tmp, path) != 0) {
        remove(tmp);
        die_write(path);
    }
}

/* --plot: the training loss of every step (raw, and smoothed), the validation points and the
   learning rate (right axis) against steps. */
typedef struct {
    const char *path;  /* NULL: no plot */
    int first, last;   /* the steps of this run: first + 1 .. last */
    int n, n_val;
    float *loss, *lr;  /* (last - first) by step */
    int *val_step;     /* (last - first + 2) evaluations */
    float *val_loss;
} loss_plot;

static void plot_start(loss_plot *p, const char *path, int first, int last) {
    memset(p, 0, sizeof *p);
    p->path = path;
    if (!path) return;
    size_t steps = (size_t)(last > first ? last - first : 0) + 2;
    p->first = first;
    p->last = last;
    p->loss = (float *)malloc(sizeof(float) * steps);
    p->lr = (float *)malloc(sizeof(float) * steps);
    p->val_step = (int *)malloc(sizeof(int) * steps);
    p->val_loss = (float *)malloc(sizeof(float) * steps);
    char flag[64];
    if (!p->loss || !p->lr || !p->val_step || !p->val_loss)
        die_out_of_memory(setting_flag("plot", flag, sizeof flag));
}

static void plot_free(loss_plot *p) {
    free(p->loss);
    free(p->lr);
    free(p->val_step);
    free(p->val_loss);
}

static void plot_step(loss_plot *p, float loss, float lr) {
    if (!p->path) return;
    p->loss[p->n] = loss;
    p->lr[p->n++] = lr;
}

/* One polyline of n values: x from the run's steps, y through the scale. */
static void plot_line(FILE *f, const loss_plot *p, const svg_scale *x, const svg_scale *y,
                      const float *v, int n, const char *id, const char *style) {
    fprintf(f, "<polyline id=\"%s\" fill=\"none\" %s points=\"", id, style);
    for (int i = 0; i < n; i++)
        fprintf(f, "%.1f,%.1f ", svg_at(x, p->first + i + 1), svg_at(y, v[i]));
    fputs("\"/>\n", f);
}

static void plot_write(const loss_plot *p) {
    if (!p->path) return;
    double lo = INFINITY, hi = -INFINITY, lr_hi = 0;
    for (int i = 0; i < p->n; i++) {
        lo = fmin(lo, p->loss[i]);
        hi = fmax(hi, p->loss[i]);
        lr_hi = fmax(lr_hi, p->lr[i]);
    }
    for (int i = 0; i < p->n_val; i++) {
        lo = fmin(lo, p->val_loss[i]);
        hi = fmax(hi, p->val_loss[i]);
    }
    if (!(lo <= hi)) lo = 0, hi = 1;
    double pad = (hi - lo) * 0.05 + 1e-6;
    svg_scale x = {(double)p->first, (double)p->last, SVG_LEFT, SVG_W - SVG_RIGHT};
    svg_scale y = {lo - pad, hi + pad, SVG_H - SVG_BOTTOM, SVG_TOP};
    svg_scale y_lr = {0, lr_hi > 0 ? lr_hi * 1.05 : 1, SVG_H - SVG_BOTTOM, SVG_TOP};
    char tmp[LG_PATH_MAX];
    FILE *f = svg_open(p->path, tmp, sizeof tmp);
    if (!f) return;
    svg_begin(f, "training loss", SVG_W);
    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"none\" stroke=\"#ccc\"/>\n",
            SVG_LEFT, SVG_TOP, SVG_W - SVG_LEFT - SVG_RIGHT, SVG_H - SVG_TOP - SVG_BOTTOM);
    svg_axis_ticks(f, &y, SVG_LEFT, 0, "%.3f", 1);
    svg_axis_ticks(f, &y_lr, SVG_W - SVG_RIGHT, 1, "%.2e", 1);
    for (int i = 0; i <= 4; i++) { /* steps */
        double step = p->first + (p->last - p->first) * i / 4.0;
        fprintf(f, "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%.0f</text>\n",
                svg_at(&x, step), SVG_H - SVG_BOTTOM + 18, step);
    }
    fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">step</text>\n",
            (SVG_W + SVG_LEFT - SVG_RIGHT) / 2, SVG_H - 10);
    /* smoothed: an exponential moving average with its start-up bias removed */
    float *smooth = (float *)malloc(sizeof(float) * (size_t)(p->n + 1));
    double ema = 0, weight = 0;
    for (int i = 0; smooth && i < p->n; i++) {
        ema = 0.9 * ema + 0.1 * p->loss[i];
        weight = 0.9 * weight + 0.1;
        smooth[i] = (float)(ema / weight);
    }
    plot_line(f, p, &x, &y_lr, p->lr, p->n, "lr", "stroke=\"#2ca02c\" stroke-dasharray=\"5,4\"");
    plot_line(f, p, &x, &y, p->loss, p->n, "loss", "stroke=\"#9ecae1\"");
    if (smooth) plot_line(f, p, &x, &y, smooth, p->n, "smoothed", "stroke=\"#08519c\" stroke-width=\"2\"");
    free(smooth);
    for (int i = 0; i < p->n_val; i++)
        fprintf(f, "<circle class=\"val\" cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"#ff7f0e\">"
                   "<title>step %d: val loss %.4f</title></circle>\n",
                svg_at(&x, p->val_step[i]), svg_at(&y, p->val_loss[i]), p->val_step[i],
                p->val_loss[i]);
    static const char *const legend[4][2] = {{"#9ecae1", "loss"}, {"#08519c", "smoothed"},
                                             {"#ff7f0e", "val loss"}, {"#2ca02c", "lr (right)"}};
    for (int i = 0; i < 4; i++)
        fprintf(f, "<rect x=\"%d\" y=\"10\" width=\"12\" height=\"12\" fill=\"%s\"/>"
                   "<text x=\"%d\" y=\"20\">%s</text>\n", 260 + 110 * i, legend[i][0],
                276 + 110 * i, legend[i][1]);
    svg_close(f, tmp, p->path);
}

/* An evaluation: a point, and the picture rewritten (a browser tab shows the run). */
static void plot_val(loss_plot *p, int step, double loss) {
    if (!p->path) return;
    p->val_step[p->n_val] = step;
    p->val_loss[p->n_val++] = (float)loss;
    plot_write(p);
}

/* A remedy's changed settings (lg_remedy_settings) as this driver's flags, in the library's
   order of the settings: "-b 2 -g 16", "--offload activations,gradients". */
static const char *remedy_flags(const lg_remedy *r, char *out, size_t cap) {
    char settings[256];
    return spell_flags(lg_remedy_settings(r, settings, sizeof settings), out, cap);
}

/* A remedy's flags under its bar, centred at x: one line a flag with its value, the value on
   a line of its own when the two are long. */
static void svg_flag_lines(FILE *f, double x, double y, const char *flags) {
    char copy[160];
    snprintf(copy, sizeof copy, "%s", flags);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" font-size=\"10\">", x, y);
    int line = 0;
    for (char *flag = strtok(copy, " "); flag; flag = strtok(NULL, " ")) {
        char *value = strtok(NULL, " ");
        int apart = value && strlen(flag) + strlen(value) > 14;
        for (int part = 0; part < 1 + apart; part++, line++)
            fprintf(f, "<tspan x=\"%.1f\" dy=\"%s\">%s%s%s</tspan>", x, line ? "1.2em" : "0",
                    part ? value : flag, value && !apart ? " " : "",
                    value && !apart ? value : "");
    }
    fputs("</text>\n", f);
}

/* --plan=svg: each device's memory as stacked regions by group against the limit; when the
   run does not fit, each remedy's total beside it. */
static void plan_svg(FILE *f, const lg_plan *plan, const lg_config *cfg, const lg_args *a, int T,
                     size_t limit) {
    static const char *const colors[LG_N_GROUPS] = {"#1f77b4", "#aec7e8", "#ff7f0e", "#ffbb78",
                                                    "#2ca02c", "#98df8a", "#d62728", "#9467bd",
                                                    "#8c564b", "#7f7f7f"};
    lg_remedy remedies[LG_MAX_REMEDIES];
    int n_remedies = 0;
    size_t top = limit, need = lg_plan_checked_bytes(plan);
    if (limit > 0 && need > limit) n_remedies = lg_plan_remedies(cfg, a, T, limit, remedies);
    for (int r = 0; r < plan->n_ranks; r++) {
        size_t total = 0;
        for (int g = 0; g < LG_N_GROUPS; g++)
            total += lg_plan_group_bytes(&plan->ranks[r], (lg_group)g, LG_POOL_DEVICE);
        if (total > top) top = total;
    }
    for (int i = 0; i < n_remedies; i++)
        if (remedies[i].device_bytes > top) top = remedies[i].device_bytes;
    double gib = 1024.0 * 1024 * 1024, unit = top >= gib ? gib : 1024.0 * 1024;
    int bars = plan->n_ranks + n_remedies;
    int width = SVG_LEFT + SVG_RIGHT + bars * SVG_BAR_SLOT > SVG_W
                    ? SVG_LEFT + SVG_RIGHT + bars * SVG_BAR_SLOT : SVG_W;
    double slot = (double)(width - SVG_LEFT - SVG_RIGHT) / bars;
    svg_scale y = {0, top * 1.08, SVG_H - SVG_BOTTOM - 60, SVG_TOP + 10};
    char marked[160], title[160];
    snprintf(marked, sizeof marked, "memory per device: %s, `micro_batch_size %d` `max_seq_length %d`, %s",
             cfg->name, a->micro_batch_size, T, lg_precision_name(a->precision));
    spell_flags(marked, title, sizeof title);
    svg_begin(f, title, width);
    svg_axis_ticks(f, &y, SVG_LEFT, 0, unit == gib ? "%.1f GiB" : "%.0f MiB", unit);
    for (int r = 0; r < plan->n_ranks; r++) {
        double base = 0, x = SVG_LEFT + slot * r + slot * 0.15, w = slot * 0.7;
        for (int g = 0; g < LG_N_GROUPS; g++) {
            size_t bytes = lg_plan_group_bytes(&plan->ranks[r], (lg_group)g, LG_POOL_DEVICE);
            if (bytes == 0) continue;
            double y0 = svg_at(&y, base), y1 = svg_at(&y, base + (double)bytes);
            fprintf(f, "<rect class=\"group\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" "
                       "fill=\"%s\"><title>device %d: %s %.2f MiB</title></rect>\n", x, y1, w,
                    y0 - y1, colors[g], r, lg_group_name((lg_group)g), bytes / 1048576.0);
            base += (double)bytes;
        }
        fprintf(f, "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">device %d</text>\n",
                x + w / 2, SVG_H - SVG_BOTTOM - 44, r);
    }
    for (int i = 0; i < n_remedies; i++) {
        char flags[160];
        remedy_flags(&remedies[i], flags, sizeof flags);
        double x = SVG_LEFT + slot * (plan->n_ranks + i) + slot * 0.15, w = slot * 0.7;
        double y1 = svg_at(&y, (double)remedies[i].device_bytes), y0 = svg_at(&y, 0);
        fprintf(f, "<rect class=\"remedy\" x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" "
                   "fill=\"%s\"><title>%s (%s): %.2f MiB</title></rect>\n", x, y1, w, y0 - y1,
                remedies[i].fits ? "#74c476" : "#bdbdbd", remedies[i].what, flags,
                remedies[i].device_bytes / 1048576.0);
        svg_flag_lines(f, x + w / 2, SVG_H - SVG_BOTTOM - 44, flags);
    }
    if (n_remedies > 0)
        fprintf(f, "<text x=\"%.1f\" y=\"%d\" font-size=\"11\">remedies of the OOM guide, each "
                   "alone: green fits, grey does not</text>\n", SVG_LEFT + slot * plan->n_ranks,
                SVG_TOP);
    if (limit > 0 && limit < top * 1.08) /* the limit, across every bar */
        fprintf(f, "<line id=\"limit\" x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"red\" "
                   "stroke-dasharray=\"6,4\"/><text x=\"%d\" y=\"%.1f\" fill=\"red\">limit</text>\n",
                SVG_LEFT, svg_at(&y, (double)limit), width - SVG_RIGHT, svg_at(&y, (double)limit),
                width - SVG_RIGHT + 4, svg_at(&y, (double)limit) + 4);
    for (int g = 0; g < LG_N_GROUPS; g++) /* legend, two rows under the bars */
        fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"10\" height=\"10\" fill=\"%s\"/>"
                   "<text x=\"%d\" y=\"%d\" font-size=\"11\">%s</text>\n",
                SVG_LEFT + 140 * (g % 5), SVG_H - 42 + 18 * (g / 5), colors[g],
                SVG_LEFT + 14 + 140 * (g % 5), SVG_H - 33 + 18 * (g / 5), lg_group_name((lg_group)g));
    fputs("</svg>\n", f);
}
