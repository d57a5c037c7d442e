/* tools/context_table.c — `make context-table`: the longest sequence this trainer can run on
   each named GPU (lg_gpu_card: the memory the card reports, its compute capability), planned,
   beside Unsloth's and Hugging Face's published figures for the card's size class (shared
   reference MEMORY.md).

   The setup is Unsloth's: Llama 3.1 8B, 4-bit QLoRA (NF4) on every linear but the head, rank 32,
   batch 1. Ours adds bf16-true and --recompute block; then the head and loss in chunks of
   LG_HEAD_CHUNK_ROWS rows (no logits for the whole sequence, as Unsloth's fused cross-entropy);
   then also each block's MLP in slices of LG_SLICE_ROWS rows; then also --offload activations
   (the block inputs in host memory, as Unsloth keeps its checkpoints); then also --offload
   weights (the NF4 base in host memory, streamed onto the GPU a block at a time, which Unsloth
   does not do). In every column the planner puts the token embedding (1002 MiB) in host memory
   where that makes a length fit (lg_plan_auto_embedding: --offload embedding, the step's rows
   copied in), as ./train --plan does. The two offloading columns' host memory has a column
   each. Each length is the longest whose CUDA plan, with the CUDA runtime's estimate
   for the card (lg_cuda_estimate_runtime, the last column: no GPU is needed to print this
   table) and the fit check's margin
   (lg_args_margin) kept free, fits what the card reports, up to the model's block_size
   (131,072; a cell there says "block_size"): the kernels run on every card listed
   (compute capability 8.0 and newer). These are plans: no GPU has run them yet. */
#define LITGPT_IMPLEMENTATION
#include "../litgpt.h"

#include <stdio.h>
#include <string.h>

typedef struct {
    const char *card;         /* lg_gpu_card's name */
    int gb;                   /* the size class Unsloth and Hugging Face report */
    int unsloth, huggingface; /* their longest context (0: out of memory) */
} context_row;

static const context_row rows[] = {
    {"rtx4060", 8, 2972, 0},       {"rtx4070", 12, 21848, 932},     {"rtx4060ti-16gb", 16, 40724, 2551},
    {"a10", 24, 78475, 5789},      {"l4", 24, 78475, 5789},         {"rtx4090", 24, 78475, 5789},
    {"rtx5090", 32, 0, 0},         {"a100-40gb", 40, 153977, 12264}, {"l40s", 48, 191728, 15502},
    {"h100", 80, 342733, 28454},   {"a100-80gb", 80, 342733, 28454},
};

/* Unsloth's run on one GPU, planned for the CUDA backend on card (its runtime estimate);
   head_rows and slice_rows 0: all rows at once; offload_weights: the NF4 base in host memory,
   streamed a block at a time (with --offload, which it needs: the adapters' optimizer there). */
static void unsloth_args(lg_args *a, const lg_gpu_card *card, int head_rows, int slice_rows,
                         int offload_activations, int offload_weights) {
    lg_error err;
    lg_args_default(a);
    a->backend = LG_BACKEND_CUDA;
    a->micro_batch_size = 1;
    a->precision = LG_PRECISION_BF16_TRUE;
    a->recompute = 1;
    a->offload_activations = offload_activations;
    a->offload = a->offload_weights = offload_weights;
    a->head_rows = head_rows;
    a->slice_rows = slice_rows;
    a->lora.r = 32;
    a->lora.alpha = 16.0f;
    a->lora.quantize = LG_QUANTIZE_NF4;
    lg_lora_targets_parse("all", &a->lora.targets, &err);
    a->gpu = card;
    lg_cuda_estimate_runtime(a);
}

/* The fit check of the plan at T against limit bytes (lg_plan_check_fit: the margin kept
   free), with the token embedding where the planner puts it; -1 when it cannot be planned.
   The device pool decides here: the host pool of --offload activations is its own column
   (fit->host_bytes), as the machine around the GPU varies. */
static int plan_fit(const lg_config *cfg, const lg_args *a, int T, size_t limit, lg_fit *fit) {
    lg_plan_spec spec;
    lg_plan plan;
    lg_args chosen = *a;
    chosen.offload_embedding = lg_plan_auto_embedding(cfg, a, T, limit);
    lg_plan_spec_from_args(&spec, &chosen, T);
    if (lg_plan_make(&plan, cfg, &spec, NULL) != 0) return -1;
    lg_plan_check_fit(&plan, &chosen, limit, fit);
    lg_plan_free(&plan);
    return 0;
}

static int fits_at(const lg_config *cfg, const lg_args *a, int T, size_t limit) {
    lg_fit fit;
    return plan_fit(cfg, a, T, limit, &fit) == 0 && fit.device_fits;
}

/* The longest T up to block_size that fits; 0 when none does. */
static int longest_fitting(const lg_config *cfg, const lg_args *a, size_t limit) {
    int lo = 1, hi = cfg->block_size, best = 0;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        if (fits_at(cfg, a, mid, limit)) { best = mid; lo = mid + 1; }
        else hi = mid - 1;
    }
    return best;
}

/* A cell: the length, "block_size" where the model's context stops it, "-" for none. */
static const char *cell(int T, const lg_config *cfg, char *buf, size_t size) {
    if (T == 0) snprintf(buf, size, "-");
    else if (T == cfg->block_size) snprintf(buf, size, "%d (block_size)", T);
    else snprintf(buf, size, "%d", T);
    return buf;
}

/* Theirs: a figure, OOM, or not published. */
static const char *published(int tokens, const context_row *row, char *buf, size_t size) {
    if (tokens) snprintf(buf, size, "%d", tokens);
    else snprintf(buf, size, "%s", row->unsloth ? "OOM" : "not published");
    return buf;
}

static void print_row(const lg_config *cfg, const context_row *row) {
    const lg_gpu_card *card = lg_gpu_card_named(row->card);
    size_t limit = card->total_mib << 20;
    enum { LEVER_SETS = 5 };
    char c[LEVER_SETS][32], theirs[2][32], host[2][32], runtime[32];
    int longest[LEVER_SETS];
    lg_args levers[LEVER_SETS];
    unsloth_args(&levers[0], card, 0, 0, 0, 0);
    unsloth_args(&levers[1], card, LG_HEAD_CHUNK_ROWS, 0, 0, 0);
    unsloth_args(&levers[2], card, LG_HEAD_CHUNK_ROWS, LG_SLICE_ROWS, 0, 0);
    unsloth_args(&levers[3], card, LG_HEAD_CHUNK_ROWS, LG_SLICE_ROWS, 1, 0);
    unsloth_args(&levers[4], card, LG_HEAD_CHUNK_ROWS, LG_SLICE_ROWS, 1, 1);
    for (int k = 0; k < LEVER_SETS; k++) {
        longest[k] = longest_fitting(cfg, &levers[k], limit);
        cell(longest[k], cfg, c[k], sizeof c[k]);
    }
    for (int k = 0; k < 2; k++) { /* the host memory of the two offloading columns */
        lg_fit fit;
        int at = longest[3 + k], planned = at && plan_fit(cfg, &levers[3 + k], at, limit, &fit) == 0;
        lg_format_bytes(planned ? fit.host_bytes : 0, host[k], sizeof host[k]);
    }
    lg_format_bytes(levers[0].runtime_bytes, runtime, sizeof runtime);
    printf("| %s (%zu MiB%s) | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", card->label,
           card->total_mib, card->nominal ? ", not a reading" : "",
           published(row->unsloth, row, theirs[0], sizeof theirs[0]),
           published(row->huggingface, row, theirs[1], sizeof theirs[1]), c[0], c[1], c[2], c[3],
           host[0], c[4], host[1], runtime);
}

int main(void) {
    lg_config cfg;
    lg_error err;
    if (lg_config_load(&cfg, "configs/Llama-3.1-8B.yaml", &err) != 0) {
        char message[1024]; /* a setting it names by its name alone (no flags here) */
        lg_spell_settings(err.msg, lg_setting_flag, NULL, message, sizeof message);
        fprintf(stderr, "context_table: %s\n", message);
        return 2;
    }
    printf("Llama 3.1 8B, QLoRA nf4 on q,k,v,proj,mlp, r 32, -b 1, bf16-true, --recompute block; "
           "planned for one GPU, with the card's cuda.runtime estimate (last column) and the "
           "default margin kept free, up to block_size %d (no GPU has run these)\n\n",
           cfg.block_size);
    printf("| GPU (memory it reports) | Unsloth | Hugging Face + FA2 | litgpt.c plan | + head in "
           "chunks of %d | + MLP in slices of %d | + --offload activations | its host memory | "
           "+ --offload weights | its host memory | cuda.runtime (estimate) |\n",
           LG_HEAD_CHUNK_ROWS, LG_SLICE_ROWS);
    printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) print_row(&cfg, &rows[i]);
    return 0;
}
