/* tools/lora_memory.c — `make lora-memory`: the planned GPU memory of LitGPT's published LoRA and
   QLoRA runs (shared/reference LORA.md), next to LitGPT's measured peaks.

   Each row is planned by lg_plan_make exactly as ./train --plan would plan it on one GPU: the
   frozen model, the adapters with their gradients and AdamW state, the activations of one
   micro-batch at the run's length, the CUDA backend's workspaces. LitGPT's figures are
   torch.cuda.max_memory_allocated, which leaves out the CUDA context, cuBLAS and NCCL; the
   plan's measured runtime region is left out here too (0), so both count the same things.
   Prints a Markdown table (GB = 10^9 bytes, as LitGPT's tables). */
#define LITGPT_IMPLEMENTATION
#include "../litgpt.h"

#include <stdio.h>
#include <string.h>

typedef struct {
    const char *what;      /* where LitGPT published it */
    const char *config;    /* configs/NAME.yaml */
    int r, micro_batch, T;
    lg_quantization quantize;
    double litgpt_gb;      /* LitGPT's measured peak */
} lora_row;

static const lora_row rows[] = {
    {"OOM guide, Alpaca full length", "falcon-7b", 8, 1, 1079, LG_QUANTIZE_NONE, 23.52},
    {"OOM guide, truncated to 256", "falcon-7b", 8, 1, 256, LG_QUANTIZE_NONE, 15.73},
    {"resource tables, Alpaca", "Llama-2-7b-hf", 8, 1, 1304, LG_QUANTIZE_NONE, 21.30},
    {"resource tables, Alpaca", "Llama-2-7b-hf", 8, 1, 1304, LG_QUANTIZE_NF4, 14.14},
    {"resource tables, Alpaca", "Llama-2-7b-hf", 8, 1, 1304, LG_QUANTIZE_NF4_DQ, 13.84},
    {"config_hub falcon-7b lora", "falcon-7b", 32, 1, 512, LG_QUANTIZE_NONE, 16.69},
    {"config_hub falcon-7b qlora", "falcon-7b", 32, 1, 512, LG_QUANTIZE_NF4, 9.44},
    {"config_hub llama-2-7b lora", "Llama-2-7b-hf", 32, 2, 512, LG_QUANTIZE_NONE, 19.77},
    {"config_hub llama-2-7b qlora", "Llama-2-7b-hf", 32, 2, 512, LG_QUANTIZE_NF4, 13.68},
};

/* The plan of one row on one GPU (bf16-true, AdamW, LoRA on q and v, alpha 16), in bytes. */
static size_t planned_bytes(const lg_config *cfg, const lora_row *row, lg_error *err) {
    lg_args a;
    lg_args_default(&a);
    a.backend = LG_BACKEND_CUDA;
    a.precision = LG_PRECISION_BF16_TRUE;
    a.micro_batch_size = row->micro_batch;
    a.lora.r = row->r;
    a.lora.quantize = row->quantize;
    lg_plan_spec spec;
    lg_plan_spec_from_args(&spec, &a, row->T);
    lg_plan plan;
    if (lg_plan_make(&plan, cfg, &spec, err) != 0) return 0;
    size_t bytes = lg_plan_bytes(&plan, LG_POOL_DEVICE);
    lg_plan_free(&plan);
    return bytes;
}

/* A table row that reports the library's error, a setting it names by its name alone (no flags
   here). */
static void print_error_row(const lora_row *row, const lg_error *err) {
    char message[1024];
    lg_spell_settings(err->msg, lg_setting_flag, NULL, message, sizeof message);
    printf("| %s | %s | %s |\n", row->what, row->config, message);
}

int main(void) {
    printf("| run (LitGPT's source) | model | r | micro-batch | tokens | quantize | litgpt.c plan "
           "| LitGPT measured |\n|---|---|---|---|---|---|---|---|\n");
    int below = 0, n = 0;
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        const lora_row *row = &rows[i];
        char path[256];
        lg_config cfg;
        lg_error err;
        snprintf(path, sizeof path, "configs/%s.yaml", row->config);
        if (lg_config_load(&cfg, path, &err) != 0) {
            print_error_row(row, &err);
            continue;
        }
        size_t bytes = planned_bytes(&cfg, row, &err);
        if (!bytes) {
            print_error_row(row, &err);
            continue;
        }
        double gb = (double)bytes / 1e9;
        below += gb < row->litgpt_gb;
        n++;
        printf("| %s | %s | %d | %d | %d | %s | %.2f GB | %.2f GB |\n", row->what, row->config,
               row->r, row->micro_batch, row->T, lg_quantization_name(row->quantize), gb, row->litgpt_gb);
    }
    printf("\n%d of %d rows planned below LitGPT's measured peak\n", below, n);
    return n == (int)(sizeof rows / sizeof rows[0]) ? 0 : 1;
}
