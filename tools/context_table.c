/* tools/context_table.c — `make context-table`: the longest sequence this trainer's planner fits
   on one GPU of each size in Unsloth's context-length table (shared/reference MEMORY.md), beside
   Unsloth's and Hugging Face's published figures.

   The setup is Unsloth's: Llama 3.1 8B, 4-bit QLoRA (NF4) on every linear but the head, rank 32,
   batch 1. Ours adds bf16-true and --recompute block; then the head and loss in chunks of
   LG_HEAD_CHUNK_ROWS rows (no logits for the whole sequence, as Unsloth's fused cross-entropy);
   then also each block's MLP in slices of LG_SLICE_ROWS rows; then also --offload activations (the block inputs in host memory, as Unsloth keeps its
   checkpoints). Each length is the
   longest whose CUDA plan fits the GPU's memory, the CUDA runtime's estimate included
   (lg_cuda_runtime_estimate: no GPU is needed to print this table). Unsloth reports the GPU
   size class a run fits on; a size here is that many GiB. These are plans: no GPU has run
   them yet. The search ignores the model's block_size (131,072), so a longer figure says the
   memory would allow it, not that the model was trained for it. */
#define LITGPT_IMPLEMENTATION
#include "../litgpt.h"

#include <stdio.h>
#include <string.h>

typedef struct {
    int gib;                  /* the GPU's memory */
    int unsloth, huggingface; /* their longest context (0: out of memory) */
} context_row;

static const context_row rows[] = {
    {8, 2972, 0},           {12, 21848, 932},       {16, 40724, 2551},   {24, 78475, 5789},
    {40, 153977, 12264},    {48, 191728, 15502},    {80, 342733, 28454},
};

#define SEARCH_LIMIT (1 << 20) /* tokens: far past any row */

/* Unsloth's run on one GPU, planned for the CUDA backend; head_rows and slice_rows 0: all rows
   at once. */
static void unsloth_args(lg_args *a, int head_rows, int slice_rows, int offload_activations) {
    lg_error err;
    lg_args_default(a);
    a->backend = LG_BACKEND_CUDA;
    a->micro_batch_size = 1;
    a->precision = LG_PRECISION_BF16_TRUE;
    a->recompute = 1;
    a->offload_activations = offload_activations;
    a->head_rows = head_rows;
    a->slice_rows = slice_rows;
    a->lora.r = 32;
    a->lora.alpha = 16.0f;
    a->lora.quantize = LG_QUANTIZE_NF4;
    lg_lora_targets_parse("all", &a->lora.targets, &err);
    a->runtime_bytes = lg_cuda_runtime_estimate(a);
    a->runtime_estimated = 1;
}

/* The longest T whose device pool fits in limit bytes (lg_plan_checked_bytes_for on a GPU: the
   device pool; the host pool of --offload activations is not limited here, as the machine
   around the GPU is not known); 0 when none does. */
static int longest_fitting(const lg_config *cfg, const lg_args *a, size_t limit) {
    int lo = 1, hi = SEARCH_LIMIT, best = 0;
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        size_t need = lg_plan_checked_bytes_for(cfg, a, mid);
        if (need != 0 && need <= limit) { best = mid; lo = mid + 1; }
        else hi = mid - 1;
    }
    return best;
}

int main(void) {
    lg_config cfg;
    lg_error err;
    if (lg_config_load(&cfg, "configs/Llama-3.1-8B.yaml", &err) != 0) {
        fprintf(stderr, "context_table: %s\n", err.msg);
        return 2;
    }
    cfg.block_size = SEARCH_LIMIT; /* memory decides, not the model's context */
    lg_args kept, chunked, sliced, offloaded;
    unsloth_args(&kept, 0, 0, 0);
    unsloth_args(&chunked, LG_HEAD_CHUNK_ROWS, 0, 0);
    unsloth_args(&sliced, LG_HEAD_CHUNK_ROWS, LG_SLICE_ROWS, 0);
    unsloth_args(&offloaded, LG_HEAD_CHUNK_ROWS, LG_SLICE_ROWS, 1);
    char runtime[32];
    printf("Llama 3.1 8B, QLoRA nf4 on q,k,v,proj,mlp, r 32, -b 1, bf16-true, --recompute block; "
           "planned for one GPU, cuda.runtime estimated at %s (no GPU has run these)\n\n",
           lg_format_bytes(kept.runtime_bytes, runtime, sizeof runtime));
    printf("| GPU | Unsloth | Hugging Face + FA2 | litgpt.c plan | + head in chunks of %d | + "
           "MLP in slices of %d | + --offload activations |\n", LG_HEAD_CHUNK_ROWS, LG_SLICE_ROWS);
    printf("|---|---|---|---|---|---|---|\n");
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        size_t limit = (size_t)rows[i].gib << 30;
        char hf[16];
        if (rows[i].huggingface) snprintf(hf, sizeof hf, "%d", rows[i].huggingface);
        else snprintf(hf, sizeof hf, "OOM");
        printf("| %d GB | %d | %s | %d | %d | %d | %d |\n", rows[i].gib, rows[i].unsloth, hf,
               longest_fitting(&cfg, &kept, limit), longest_fitting(&cfg, &chunked, limit),
               longest_fitting(&cfg, &sliced, limit), longest_fitting(&cfg, &offloaded, limit));
    }
    return 0;
}
