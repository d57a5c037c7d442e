/* tools/bench.c — training throughput of litgpt.c on the CPU (make bench).

   ./tools/bench [--recompute] [--offload] [-c configs/bench.yaml] [-b 4] [-t 256] [-s steps]
                 [-p 32-true]

   Trains the model of configs/bench.yaml (6 layers, 384 wide, Llama-style) in 32-true with
   AdamW on random tokens: 2 warm-up steps, then times the next steps (forward + backward +
   clipping + optimizer) and prints one line in the same form as tools/bench_torch.py. */
#define LITGPT_IMPLEMENTATION
#include "../litgpt.h"

#include <string.h>

int main(int argc, char **argv) {
    const char *config = "configs/bench.yaml";
    int B = 4, T = 256, steps = 5, warmup = 2;
    lg_precision precision = LG_PRECISION_32_TRUE; /* as the PyTorch side */
    int recompute = 0, offload = 0;
    for (int i = 1; i < argc; i++) {
        const char *value = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(argv[i], "--recompute") == 0) recompute = 1;
        else if (strcmp(argv[i], "--offload") == 0) offload = 1;
        else if (value && strcmp(argv[i], "-c") == 0) config = argv[++i];
        else if (value && strcmp(argv[i], "-b") == 0) B = atoi(argv[++i]);
        else if (value && strcmp(argv[i], "-t") == 0) T = atoi(argv[++i]);
        else if (value && strcmp(argv[i], "-s") == 0) steps = atoi(argv[++i]);
        else if (value && strcmp(argv[i], "-p") == 0 && lg_precision_parse(value, &precision) == 0) i++;
        else { fprintf(stderr, "bench: unknown or incomplete option %s\n", argv[i]); return 2; }
    }
    lg_error err;
    lg_config cfg;
    if (lg_config_load(&cfg, config, &err) != 0) { fprintf(stderr, "bench: %s\n", err.msg); return 2; }
    lg_args args;
    lg_args_default(&args);
    args.micro_batch_size = B;
    args.precision = precision;
    args.recompute = recompute;
    args.offload = offload;
    args.lr = 3e-4f;
    args.warmup_steps = 0;
    lg_trainer tr;
    if (lg_trainer_create(&tr, &cfg, &args, T, &err) != 0) { fprintf(stderr, "bench: %s\n", err.msg); return 1; }
    /* random tokens, enough windows for every step */
    size_t n = (size_t)(warmup + steps) * B * T + 1;
    uint32_t *tokens = (uint32_t *)malloc(sizeof(uint32_t) * n);
    lg_rng rng;
    lg_rng_seed(&rng, 0);
    for (size_t i = 0; i < n; i++) tokens[i] = (uint32_t)(lg_rng_u64(&rng) % cfg.vocab_size);
    lg_loader ld;
    if (lg_loader_from_memory(&ld, tokens, n, T, cfg.vocab_size, 0, 0, &err) != 0) return 1;
    lg_step_stats st;
    double total_ms = 0;
    for (int s = 0; s < warmup + steps; s++) {
        if (lg_trainer_step(&tr, &ld, s, &st, &err) != 0) { fprintf(stderr, "bench: %s\n", err.msg); return 1; }
        if (s >= warmup) total_ms += st.ms;
    }
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    double ms = total_ms / steps;
    printf("litgpt.c %s%s%s threads=%d B=%d T=%d params=%zu tokens/s=%.0f ms/step=%.1f "
           "attention=exact(gemm per head)\n", lg_precision_name(precision),
           recompute ? " recompute" : "", offload ? " offload" : "", threads, B, T,
           tr.ranks[0].model.n_params, B * T / (ms / 1e3), ms);
    lg_loader_close(&ld);
    lg_trainer_free(&tr);
    return 0;
}
