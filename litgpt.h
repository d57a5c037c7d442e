/* litgpt.h — train GPT-2, Pythia/GPT-NeoX, Falcon and Llama-family language models in the
   memory you have.

   One stb-style header. In exactly one C or CUDA file:

       #define LITGPT_IMPLEMENTATION
       #include "litgpt.h"

   Everywhere else include it without the define to get the API only. Compiled by nvcc
   (`nvcc -x cu`), the implementation includes litgpt_cuda.cuh, the CUDA backend: with
   args.backend = lg_backend_in_use() the ranks then run on GPUs, one each. The implementation
   also includes litgpt_unicode.h, generated Unicode data for the tokenizers' NFC, NFKC and
   Lowercase normalizers (tools/make_unicode_tables.py).

   Usage (what train.c does, shortened):

       lg_config cfg;  lg_args args;  lg_error err;
       lg_args_default(&args);                       // then set what the user asked for
       if (lg_config_load(&cfg, "configs/pythia-14m.yaml", &err)) { puts(err.msg); exit(2); }
       lg_plan plan;  lg_plan_spec spec;             // optional: what it will need, before
       lg_plan_spec_from_args(&spec, &args, T);      // anything is allocated
       lg_plan_make(&plan, &cfg, &spec, &err);  lg_plan_print(&plan, stdout);
       lg_trainer tr;                                // plan -> rank arenas -> model, optimizer
       if (lg_trainer_create(&tr, &cfg, &args, T, &err)) { puts(err.msg); exit(1); }
       lg_loader data;
       lg_loader_open(&data, "train.bin", T, cfg.vocab_size, 1, args.seed, &err);
       for (int step = 0; step < args.max_steps; step++) {
           lg_step_stats st;                         // accumulate, clip, unscale, update
           if (lg_trainer_step(&tr, &data, step, &st, &err)) { puts(err.msg); break; }
       }
       lg_trainer_free(&tr);

   Messages name settings, not a program's flags: "`micro_batch_size` must be at least 1" (the
   lg_args field between backquotes); a program with flags rewrites them with its own spellings
   through lg_spell_settings (train.c: "-b/--micro-batch-size must be at least 1").

   Data (sections 12, 11): lg_loader_open also reads fine-tuning sample files (tools/prepare
   alpaca), whose micro-batches lg_loader_next_batch pads to their longest sample; text becomes
   ids with a BPE tokenizer:

       lg_tokenizer tok;  lg_tokens ids = {NULL, 0, 0};
       lg_tokenizer_load(&tok, "data/gpt2", &err);   // encoder.json + vocab.bpe, or tokenizer.json
       lg_tokenizer_encode(&tok, "Hello world", 11, &ids, &err);   // ids.ids = {15496, 995}

   Start here: the step map at the top of section 14 lists what lg_trainer_step calls, in order,
   down to the ops of section 7. Each section opens with a banner comment "N. name ----": search
   for "8. model -" to reach the model; subsections open with "--- name ---".

   Table of contents (in the order data flows; every call goes to a function defined above it):
     1. utilities        errors, allocation, random numbers, timing, growing lists, JSON reader
     2. numbers          the arithmetic type, bf16/fp16 storage, stochastic rounding, NF4 codes,
                         per-element helpers shared with CUDA (LG_HD), the optimizers' updates
     3. config           lg_config: the architecture, LitGPT field names, YAML loader, bounds
     4. args             lg_args: what the user asked for, defaults, checks
     5. plan             the layouts of every buffer (sizes in one place), each rank's memory
                         plan and its regions' names (LG_REGION_*), --plan tables, fit checks,
                         remedies, sizes with units
     6. ranks: memory    arenas per pool, named regions, visits (host access to any buffer)
     7. kernels (CPU)    the gemm (plain loops, packing, AVX-512 and AMX micro-kernels), then
                         every op: linear, norms, rotary, attention, GELU/SwiGLU, embeddings,
                         cross-entropy, NF4 dequantization; on a GPU rank each op hands over to
                         litgpt_cuda.cuh
     8. model            lg_model: parameters in one buffer, gradients in another, activations
                         in the plan's regions; forward, backward, LoRA adapters, generation
     9. optimizers       AdamW (fp32, bf16 or 8-bit state), SGD, Lion, Sophia; clipping, the
                         learning-rate schedule
    10. processes        launchers (mpirun, srun, torchrun), MPI, the rendezvous without MPI,
                         and the collectives between ranks
    11. tokenizer        byte-level BPE (GPT-2 files, tokenizer.json), SentencePiece-style BPE,
                         the built-in task's characters
    12. data             token shards, fine-tuning samples (truncation, padding, prompt masks,
                         packing), the built-in task, Alpaca-style JSON
    13. model files      atomic files, safetensors, Hugging Face layouts and config.json (one
                         table of keys a family, for the writer and the reader), step-N
                         directories with COMPLETE, PEFT adapters
    14. trainer          lg_trainer: one optimizer step (accumulation, loss scaling, clipping,
                         sharding's gathers and reductions, offload), evaluation
    15. run checkpoints  training state per rank, resume, saving and loading through the trainer
    16. generation       lg_generator: a KV cache sized to prompt + new tokens (a plan of its
                         own), prefill then one token at a time, sampling (tools/generate)

   Features, and the sections that hold them:
     LoRA                3 (targets), 5 (layouts, remedies), 8 (adapters), 13 (PEFT), 15
     QLoRA / NF4         2 (codes), 5, 7 (dequantization), 8, 13 (merge on save),
                         14 (the frozen base sharded: its units gathered, lg_frozen_sharded)
     sharding (FSDP)     5 (plan per strategy), 10 (collectives), 14 (gathers, reductions), 15
     offload             5 (host pool), 14 (the optimizer on the host)
     recompute           5, 8 (a block recomputed in the backward)
     offload activations 5 (host pool, two device slots), 8 (sent and fetched around blocks)
     offload gradients   5 (unit buffers), 14 (each unit's gradients to the host as its
                         backward ends: lg_trainer_send_unit_grads, lg_trainer_open_unit_grads)
     offload weights     5 (host pool, gather slots), 14 (each rank's piece copied into its
                         slot, then gathered: lg_trainer_stream_unit, lg_trainer_gather_unit)
     head in tiles       3 (lg_head_tile_rows), 5, 8 (QLoRA's NF4 lm_head a vocabulary tile
                         at a time: lg_head_tile_weight)
     offload embedding   3 (lg_lora.host_embedding), 5 (the layouts leave the table out,
                         embedding.host and .rows, lg_plan_auto_embedding; trained:
                         lg_unit_host_part), 8 (the step's rows gathered on the host,
                         lg_model_embed_from_host), 14 (a trained table's gradient scattered
                         on the host: lg_trainer_scatter_embedding_grads)
     Lion, Sophia, 8-bit 2 (per-element updates), 9, 14 (Sophia's Hessian pass)
     AVX-512, AMX        7 (kernel paths chosen at run time), 9 (AdamW's AVX-512 loop)
     MPI, launchers      10; the rendezvous of GPU processes without MPI: 10
     memory remedies     5 ("remedies": the OOM guide's changes, priced)
     Hugging Face, PEFT  13; tokenizers: 11
     resume              15
     generation          16 (KV cache, sampling); 8 (the trainer's greedy samples, uncached)
     sample packing      12 (rows packed first-fit, span starts), 8 (lg_model_set_spans), 7
                         (attention inside each span, positions restarting; CPU kernels only)

   Conventions: public names start with lg_ / LG_; no global mutable state; all memory through
   LG_MALLOC / LG_FREE; functions that can fail return 0 on success, -1 with a message in an
   lg_error. Shapes use B (batch), T (time), C (channels), V (vocabulary), L (layers),
   NH (query heads), NQG (key/value groups), HS (head size), I (MLP hidden size).
*/
#ifndef LITGPT_H
#define LITGPT_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
   1. utilities (API)
   ------------------------------------------------------------------------------------------- */

#ifndef LG_MALLOC
#include <stdlib.h>
#define LG_MALLOC(size) malloc(size)
#define LG_FREE(ptr) free(ptr)
#endif

typedef struct {
    char msg[512]; /* one line: names the file, setting or sample at fault and what is wrong */
} lg_error;

/* Settings in messages. The library names a setting, never a driver's flag: the lg_args field
   (LG_RUN_SETTINGS' key: "lora.r") between backquotes, alone or with a value:
   "`micro_batch_size` must be at least 1", "`offload activations` needs `recompute block`",
   "`devices 2` x `nodes 1`". A library user reads the names; a driver with flags gives
   lg_spell_settings a speller, which returns a setting's flag (key alone: its names,
   "-b/--micro-batch-size"; with a value: the word written before the value, "-b"; NULL: no
   flag, the mark stays). */
typedef const char *lg_setting_speller(const char *key, int with_value, void *ctx, char *buf,
                                       size_t cap);
/* message with each setting mark spelled by spell, into out (cap bytes, cut to fit). */
void lg_spell_settings(const char *message, lg_setting_speller *spell, void *ctx, char *out,
                       size_t cap);
/* A speller for a program with a few flags (the tools): ctx is its table of {setting, flag}
   rows, ending with {NULL, NULL}; a setting of the table is spelled as its flag, any other by
   its name alone, the backquotes gone, so that no mark reaches the program's user (NULL
   table: every setting by its name). */
typedef struct {
    const char *setting; /* the lg_args field: "template" */
    const char *flag;    /* the program's flag that sets it */
} lg_setting_flag_row;
const char *lg_setting_flag(const char *key, int with_value, void *table, char *buf, size_t cap);
/* A tool's line on stderr: "tool: " then fmt's text, its settings spelled by the tool's table
   (lg_setting_flag). */
void lg_tool_vcomplain(const char *tool, const lg_setting_flag_row *flags, const char *fmt,
                       va_list ap);

/* Bytes of a path the library builds: a directory (up to 1024) and a file name in it. */
#define LG_PATH_MAX 1100

/* The index of text among names (count of them), or -1: how every enum's name is parsed. */
int lg_name_index(const char *const *names, int count, const char *text);

typedef struct {
    uint64_t state;
} lg_rng;

void lg_rng_seed(lg_rng *rng, uint64_t seed);
uint64_t lg_rng_u64(lg_rng *rng);
float lg_rng_uniform(lg_rng *rng); /* [0, 1) */
float lg_rng_normal(lg_rng *rng);  /* standard normal */
double lg_time_ms(void);           /* wall clock */

/* The one hash of bytes: 64-bit FNV-1a, continuing from hash (start from LG_HASH64_INIT). The
   checkpoints' COMPLETE markers hold it (section 13), so it stays FNV-1a. */
uint64_t lg_hash64(uint64_t hash, const void *data, size_t bytes);
#define LG_HASH64_INIT 0xCBF29CE484222325ull

/* ---------------------------------------------------------------------------------------------
   2. numbers (API)
   ------------------------------------------------------------------------------------------- */

/* lg_real is the type of fp32 storage and of all arithmetic on the CPU backend. Tests compile
   the library a second time with -DLG_REAL_DOUBLE to take finite differences of exactly the
   same code in double precision. The lg_ math names follow the type. */
#ifdef LG_REAL_DOUBLE
typedef double lg_real;
#define lg_sqrt sqrt
#define lg_exp exp
#define lg_log log
#define lg_erf erf
#define lg_tanh tanh
#define lg_cos cos
#define lg_sin sin
#define lg_pow pow
#define lg_fabs fabs
#else
typedef float lg_real;
#define lg_sqrt sqrtf
#define lg_exp expf
#define lg_log logf
#define lg_erf erff
#define lg_tanh tanhf
#define lg_cos cosf
#define lg_sin sinf
#define lg_pow powf
#define lg_fabs fabsf
#endif

/* Per-element helpers shared by the CPU loops and the CUDA kernels. */
#ifdef __CUDACC__
#define LG_HD static inline __host__ __device__
#else
#define LG_HD static inline
#endif

typedef enum { LG_PRECISION_32_TRUE, LG_PRECISION_16_TRUE, LG_PRECISION_BF16_TRUE,
               LG_PRECISION_16_MIXED, LG_PRECISION_BF16_MIXED } lg_precision;

int lg_precision_parse(const char *text, lg_precision *out);
const char *lg_precision_name(lg_precision p);

/* Storage types. F32 is lg_real: 4 bytes, except in the test build with LG_REAL_DOUBLE where
   it is 8. BF16 and F16 are 16-bit storage; arithmetic on them is in lg_real. */
typedef enum { LG_DTYPE_F32, LG_DTYPE_BF16, LG_DTYPE_F16, LG_DTYPE_I32, LG_DTYPE_U8,
               LG_DTYPE_NF4, LG_DTYPE_NF4_DQ } lg_dtype;
/* LG_DTYPE_NF4 and LG_DTYPE_NF4_DQ are QLoRA's frozen linear weights: a view of one tensor's
   packed codes and block scales (lg_nf4_bytes of its element count, see section 7), never
   read element by element; a matmul dequantizes the tensor first. */

/* A typed view of a tensor: where it is and how its elements are stored. Kernels read and
   write elements through lg_get / lg_set, so one loop serves every precision. */
typedef struct {
    void *data;
    lg_dtype dtype;
} lg_buf;

/* --quantize: frozen weights stored in bitsandbytes' NF4 format (QLoRA). Blocks of
   LG_NF4_BLOCK consecutive elements share one fp32 absmax; each element is the nearest of 16
   NF4 values times it, 4 bits a code. nf4-dq (double quantization) stores the absmax values
   less their mean as 8-bit codes of bitsandbytes' signed dynamic map, with one fp32 scale a
   group of LG_NF4_DQ_BLOCK blocks: 4.5 bits a parameter, or 4.127 with nf4-dq.

   One tensor of `count` elements (row-major, any count; the last block may be short) is
   stored as these parts, each starting on a 4-byte boundary of the tensor's first byte, the
   gaps zero:
     codes    ceil(count / 2) bytes: two codes a byte, the even element in the high nibble
              (an odd count pads the low nibble with the code of 0.0, 7)
     nf4:     absmax   (blocks) fp32
     nf4-dq:  absmax   (blocks) uint8: codes of (absmax - offset) / scale of its group
              scales   (groups) fp32: the largest |absmax - offset| of the group
              offset   fp32: the mean of the tensor's absmax values
   Bytes equal bitsandbytes' quantize_4bit (blocksize 64, quant_storage uint8) and, for
   nf4-dq, its quantize_blockwise of the absmax values (with the dynamic map torch 1.13's CPU
   linspace gives; tests/make_nf4_reference.py says how), except: a block (group) whose absmax
   (scale) is 0 gets the code of 0.0 everywhere, where bitsandbytes' 0 x (1 / 0) falls through
   to code 0 (-1.0), so that zeros dequantize to zeros; and the offset is the absmax values
   summed in double in order, divided by their count (bitsandbytes sums in fp32 on the GPU,
   which may differ in the last bit). Dequantizing: code value x absmax in fp32; nf4-dq's
   absmax is map[code] x scale rounded to fp32, plus the offset. */
typedef enum { LG_QUANTIZE_NONE, LG_QUANTIZE_NF4, LG_QUANTIZE_NF4_DQ } lg_quantization;
#define LG_NF4_BLOCK 64     /* elements sharing one absmax */
#define LG_NF4_DQ_BLOCK 256 /* nf4-dq: absmax values sharing one fp32 scale */

const char *lg_quantization_name(lg_quantization q); /* "none", "nf4", "nf4-dq" */
int lg_quantization_parse(const char *text, lg_quantization *out); /* 0, or -1 when unknown */
/* Bytes of one tensor of count elements stored as q (a multiple of 4; 0 for NONE). */
size_t lg_nf4_bytes(size_t count, lg_quantization q);
/* Quantizes count values of src (any floating dtype, host memory) into dst (lg_nf4_bytes,
   4-byte aligned, host memory), on the CPU threads. -1 only when nf4-dq cannot allocate its
   scratch (4 bytes a block). lg_nf4_dequantize (section 7) reads them back. */
int lg_nf4_quantize(lg_buf src, size_t count, lg_quantization q, uint8_t *dst, lg_error *err);

/* ---------------------------------------------------------------------------------------------
   3. config (API)
   ------------------------------------------------------------------------------------------- */

typedef enum { LG_NORM_LAYERNORM, LG_NORM_RMSNORM } lg_norm_class;
typedef enum { LG_MLP_GPTNEOX, LG_MLP_LLAMA } lg_mlp_class;

/* --lora-targets, LitGPT's names: which linears get adapters. */
enum {
    LG_LORA_QUERY = 1 << 0,      /* q: the query rows of attn.qkv */
    LG_LORA_KEY = 1 << 1,        /* k: its key rows */
    LG_LORA_VALUE = 1 << 2,      /* v: its value rows */
    LG_LORA_PROJECTION = 1 << 3, /* proj: attn.proj */
    LG_LORA_MLP = 1 << 4,        /* mlp: every linear of the MLP */
    LG_LORA_HEAD = 1 << 5        /* head: lm_head */
};

/* Fine-tuning with low-rank adapters: each targeted linear y = W x + b becomes
   y = W x + b + (alpha / r) B A dropout(x), A (r, in), B (out, r); W and every other base
   tensor are frozen. r = 0: every weight trains. */
typedef struct {
    int r;                /* --lora-r: rank of the adapters; 0: off */
    float alpha;          /* --lora-alpha (16): the branch is scaled by alpha / r */
    float dropout;        /* --lora-dropout (0.05): on the adapters' input while training */
    unsigned targets;     /* --lora-targets: LG_LORA_* bits (default q, v) */
    lg_quantization quantize; /* --quantize: frozen linear weights in NF4 (QLoRA) */
    int head_tile_rows;   /* QLoRA: vocabulary rows of the NF4 lm_head dequantized at a time, a
                             multiple of LG_HEAD_TILE_ALIGN (0: LG_HEAD_TILE_ROWS; tests set
                             fewer, so that a small vocabulary has several tiles) */
    int host_embedding;   /* --offload embedding: the token embedding (wte) lives in host
                             memory: with adapters (r > 0) frozen, in its own region
                             ("embedding.host"), out of the frozen base; with r = 0 trained, in
                             the streamed weights, out of the ends unit's device buffers
                             (lg_unit_host_part). The plan sets it from
                             lg_plan_spec.offload_embedding */
} lg_lora;

/* QLoRA's untied lm_head is NF4 too; its matmuls dequantize it a tile of vocabulary rows at a
   time into the one scratch of the frozen linears (nf4.dequantized), each tile's matmul writing
   (forward) or reading (backward) its columns of the logits, so the scratch holds a tile, not
   the head: 8192 rows of Llama 3's 4096 channels are 64 MiB in bf16, under its MLP's linears
   (14336 x 4096, 112 MiB) that size the scratch anyway, where the whole head (128256 rows) is
   1002 MiB; and a (rows x 8192 x 4096) matmul still fills a GPU. The tiles split the backward's
   sum over the vocabulary: at multiples of LG_HEAD_TILE_ALIGN, 2 x LG_GEMM_KC (the CPU gemm's
   K block of bf16, twice its fp32 one), where the gemm's own K blocks already split it, so the
   CPU's sums are the whole head's, bit for bit. */
#define LG_HEAD_TILE_ROWS 8192
#define LG_HEAD_TILE_ALIGN 512

/* The adapted linears of a block, in layout order. */
typedef enum { LG_LORA_Q, LG_LORA_K, LG_LORA_V, LG_LORA_PROJ, LG_LORA_FC, LG_LORA_FC_2,
               LG_LORA_MLP_PROJ, LG_LORA_BLOCK_LINEARS } lg_lora_linear;

/* lora.targets all: every linear but the head (PEFT's "all-linear"). */
#define LG_LORA_ALL_LINEARS "q,k,v,proj,mlp"
/* "q,v" -> LG_LORA_QUERY | LG_LORA_VALUE ("all": LG_LORA_ALL_LINEARS); -1 naming an unknown
   name in err (the caller names the setting). */
int lg_lora_targets_parse(const char *text, unsigned *targets, lg_error *err);
/* The inverse, into buf: "q,v". */
const char *lg_lora_targets_name(unsigned targets, char *buf, size_t size);

/* Llama 3.1/3.2's rotary frequency scaling (LitGPT's rope_adjustments, Hugging Face's
   rope_scaling with rope_type "llama3"): frequencies whose wavelength exceeds
   original_max_seq_len / low_freq_factor are divided by factor, those under
   original_max_seq_len / high_freq_factor are kept, those between are blended. factor 0: none. */
typedef struct {
    float factor;
    float low_freq_factor;
    float high_freq_factor;
    int original_max_seq_len;
} lg_rope_adjustments;

/* The architecture, with LitGPT's field names (see configs/NAME.yaml). */
typedef struct {
    char name[64];
    int n_layer;            /* L */
    int n_head;             /* NH: query heads */
    int n_query_groups;     /* NQG: key/value heads; NH for multi-head, 1 for multi-query */
    int n_embd;             /* C */
    int head_size;          /* HS */
    int intermediate_size;  /* I: MLP hidden size */
    int block_size;         /* longest sequence the model supports */
    int vocab_size;         /* V: real tokens */
    int padded_vocab_size;  /* Vp >= V: rows of the embedding and the head */
    lg_norm_class norm_class_name;
    float norm_eps;
    lg_mlp_class mlp_class_name;
    int gelu_approximate_tanh;  /* gelu_approximate: tanh (GPT-2) or none (exact erf) */
    float rotary_percentage;    /* share of each head's dims that rotary embeddings rotate */
    float rope_base;
    lg_rope_adjustments rope_adjustments; /* optional; a nested block in the YAML */
    int parallel_residual;      /* x + attn(n1(x)) + mlp(n2(x)) instead of sequential */
    int shared_attention_norm;  /* with parallel_residual: the MLP reads norm_1's output */
    int bias;                   /* biases on the linear layers (LayerNorm always has one, as
                                   torch.nn.LayerNorm in LitGPT: Falcon's norms with bias false) */
    int attn_bias;              /* bias on the qkv projection even when bias is false */
    int lm_head_bias;
    int tie_embeddings;         /* lm_head shares transformer.wte.weight */
    int learned_pos_embedding;  /* GPT-2's transformer.wpe */
    lg_lora lora;               /* not a model field: the plan sets it from lg_args.lora */
} lg_config;

/* Loads a flat `key: value` YAML file; every field above is required except rope_adjustments,
   LitGPT's nested block (`rope_adjustments:` then indented `factor: 32.0` ... lines, or null). */
int lg_config_load(lg_config *cfg, const char *path, lg_error *err);
int lg_config_check(const lg_config *cfg, lg_error *err);
/* The model of the built-in run (and its character vocabulary), without any file. */
void lg_config_builtin(lg_config *cfg);
int lg_config_rope_dims(const lg_config *cfg); /* rotated dims of each head, even */

/* ---------------------------------------------------------------------------------------------
   4. args (API)
   ------------------------------------------------------------------------------------------- */

typedef enum { LG_OPTIMIZER_ADAMW, LG_OPTIMIZER_SGD, LG_OPTIMIZER_LION,
               LG_OPTIMIZER_SOPHIA } lg_optimizer_kind;
#define LG_OPTIMIZER_KINDS 4

/* --optimizer-state: how AdamW stores its moments. As the precision says (fp32, or the half
   type in -true modes), bf16, or 8 bits a value with one fp32 scale per block of
   LG_QUANT_BLOCK. Tensors under LG_COMPACT_MIN elements keep fp32 state in the compact formats. */
typedef enum { LG_STATE_AS_PRECISION, LG_STATE_BF16, LG_STATE_8BIT } lg_state_format;
#define LG_STATE_FORMATS 3
/* --optimizer-state's names ("bf16", "8bit"; the default has none): 0, or -1 when unknown. */
int lg_state_format_parse(const char *text, lg_state_format *out);
#define LG_QUANT_BLOCK 256
#define LG_COMPACT_MIN 4096

/* --strategy: how the model state is split over the ranks (FSDP's names). */
typedef enum {
    LG_STRATEGY_NO_SHARD,      /* DDP: every rank holds everything; gradients all-reduced */
    LG_STRATEGY_SHARD_GRAD_OP, /* ZeRO-2: gradients and optimizer state sharded */
    LG_STRATEGY_FULL_SHARD,    /* ZeRO-3: weights too, gathered one unit at a time */
    LG_STRATEGY_HYBRID_SHARD   /* full-shard inside a node, replicas across nodes */
} lg_strategy;
#define LG_MAX_RANKS 64        /* devices x nodes */

const char *lg_strategy_name(lg_strategy strategy);
int lg_strategy_parse(const char *text, lg_strategy *out);
const char *lg_optimizer_name(lg_optimizer_kind kind);
int lg_optimizer_parse(const char *text, lg_optimizer_kind *out); /* 0, or -1 when unknown */
/* The betas an optimizer takes unless given: AdamW (0.9, 0.95), the papers' Lion (0.9, 0.99)
   and SophiaG (0.965, 0.99); SGD uses none (AdamW's are returned). */
void lg_optimizer_default_betas(lg_optimizer_kind kind, float *beta1, float *beta2);

/* Where a rank's memory lives and its ops run. A CUDA build picks LG_BACKEND_CUDA when a GPU
   is visible (lg_backend_in_use); a CPU build always runs on the CPU. */
typedef enum { LG_BACKEND_CPU, LG_BACKEND_CUDA } lg_backend;
#define LG_BACKENDS 2
const char *lg_backend_name(lg_backend backend);             /* "cpu", "cuda" */
int lg_backend_parse(const char *text, lg_backend *out);     /* 0, or -1 when unknown */

/* The CUDA runtime's share of a GPU where no GPU measures it, in its parts (an estimate, per
   card: lg_cuda_runtime_estimate_parts says where each figure comes from). */
typedef struct {
    size_t context;     /* the context, with local memory for CUDA's default stack a thread */
    size_t local;       /* local memory for our largest stack frame beyond that default */
    size_t own_kernels; /* our kernels' code for the card (loaded lazily, counted whole) */
    size_t cublaslt;    /* cuBLASLt's handle and the kernels its matmuls load lazily */
    size_t nccl;        /* NCCL's buffers, for each communicator a rank joins */
    const char *own_image; /* which image of ours the card runs ("sm_80 SASS", ...) */
    size_t cublaslt_eager; /* not counted: all of cuBLASLt's code for the card, what eager
                              module loading would take with the context */
} lg_cuda_runtime_parts;

/* --plan's output: none (a run), the table, JSON or SVG alone on stdout. */
typedef enum { LG_PLAN_NONE, LG_PLAN_TABLE, LG_PLAN_JSON, LG_PLAN_SVG } lg_plan_mode;

/* A driver's setting that LG_RUN_SETTINGS records (its key), as the text of its line into buf
   (cap bytes); NULL: the driver has no such setting, no line. */
typedef const char *lg_run_driver_value(const char *key, void *ctx, char *buf, size_t cap);

/* The run's settings: what the user asked for that the library reads (and the run settings a
   checkpoint records, LG_RUN_SETTINGS). train.c parses argv into this; what only the driver
   reads (--log, --plot, --log-interval, -b auto and -t auto, --load, --resume; the config,
   data, validation data and prompt it opens, where it saves, the device memory it plans
   within (--memory-limit: the planners take the limit as an argument), evaluation, sampling
   and saving, which LG_RUN_SETTINGS records through driver_value) it keeps. */
typedef struct {
    lg_backend backend;        /* where the ranks run: the CPU, or the GPUs of a CUDA build */
    size_t runtime_bytes;      /* GPU: the runtime's own memory a device, measured (the plan
                                  counts it); 0 on the CPU */
    size_t device_bytes;       /* GPU: the smallest GPU's memory, measured; 0 on the CPU */
    int tf32;                  /* --tf32: fp32 matmuls on a GPU may use TF32 */
    int micro_batch_size;      /* -b: samples per forward/backward */
    int global_batch_size;     /* -g: samples per optimizer step over all devices; 0: = -b */
    int max_seq_length;        /* -t: tokens per sample; 0: the model's block_size */
    lg_precision precision;    /* -p; default bf16-mixed (fp32 arithmetic, half storage) */
    int devices;               /* -d: devices a node (GPUs, or simulated ranks on the CPU) */
    int nodes;                 /* --nodes: ranks = devices x nodes */
    int processes;             /* the launcher's processes the ranks spread over (1: this one
                                  drives every rank): the plan counts MPI's buffers */
    lg_strategy strategy;      /* --strategy; full-shard by default */
    lg_optimizer_kind optimizer; /* -o: AdamW (default), SGD, Lion or SophiaG */
    float lr, min_lr;          /* train.c: --min-lr is --lr / 10 unless given */
    int warmup_steps;
    float weight_decay, beta1, beta2, eps, momentum;
    float max_norm;            /* gradient clipping by global norm; 0: off */
    int max_steps;             /* 0: evaluate and exit */
    uint64_t seed;
    int recompute;             /* --recompute block: 1 (keep each block's input, recompute it) */
    int offload;               /* --offload: 1 (master weights and optimizer state on the host) */
    int offload_activations;   /* --offload activations: 1 (the block inputs that --recompute
                                  block keeps in host memory) */
    int offload_gradients;     /* --offload gradients: 1 (each block's gradients leave the device
                                  as its backward ends; the device keeps two blocks' buffers;
                                  with offload, whose optimizer runs on the host) */
    int offload_weights;       /* --offload weights: 1 (the weights, trainable and frozen, live
                                  in host memory; each unit is copied onto the device ahead of
                                  its use, into the ends' slot and two blocks'; with offload) */
    int offload_embedding;     /* --offload embedding: 1 (the token embedding in host memory;
                                  the step's rows gathered there and copied in once: LoRA's
                                  frozen table, or trained with offload gradients and weights
                                  on one rank, its gradient scattered there) */
    int pack;                  /* --pack: fine-tuning samples packed first-fit into rows of
                                  T tokens, attention and positions kept inside each sample */
    int head_rows;             /* --head-rows: the head and loss in chunks of this many rows of
                                  logits, recomputed in the backward; 0: all rows at once, or
                                  wherever the limit is known the planner's choice
                                  (lg_plan_auto_rows) */
    int slice_rows;            /* --slice-rows: each block's MLP in slices of this many rows, its
                                  hidden layer (B x T x intermediate_size) never whole: the
                                  backward computes each slice's again; 0: all rows, or the
                                  planner's choice (lg_plan_auto_rows) */
    lg_plan_mode plan_only;    /* --plan: print the plan and exit (LG_PLAN_NONE: run) */
    lg_state_format optimizer_state; /* --optimizer-state bf16|8bit (AdamW) */
    int hessian_interval;      /* Sophia: steps between Hessian estimates (10) */
    float rho;                 /* Sophia: the clipping scale of m / h (0.04) */
    size_t host_memory_limit;  /* --host-memory-limit: bytes the host pools of one machine's
                                  ranks may use together; 0: what the machine has available
                                  (lg_args_host_limit) */
    const struct lg_gpu_card *gpu; /* --gpu: the card a plan is for (NULL: the GPUs found) */
    size_t memory_margin;      /* --memory-margin: device bytes a GPU plan keeps free */
    int memory_margin_given;   /* 0: the default margin (lg_args_margin) */
    size_t host_available;     /* the machine's available memory, read once for the run
                                  (lg_host_available_bytes) so that every choice and the fit
                                  check hold the same figure; 0: unknown, not checked */
    int runtime_estimated;     /* 1: runtime_bytes is lg_cuda_estimate_runtime's figure (a plan
                                  for GPUs made where there are none), not a measurement */
    lg_cuda_runtime_parts runtime_parts; /* its parts, when runtime_estimated */
    lg_lora lora;              /* --lora-r, --lora-alpha, --lora-dropout, --lora-targets,
                                  --quantize: fine-tune adapters over a frozen model */
    int finetuning;            /* the data are fine-tuning samples: LoRA and QLoRA are remedies */
    /* the settings the driver keeps itself that LG_RUN_SETTINGS records for it (the files it
       opens, its evaluation, sampling and saving): a key's value as its line's text (NULL: no
       such line; "": none, as for a line holding a newline) */
    lg_run_driver_value *driver_value;
    void *driver_context;
} lg_args;

void lg_args_default(lg_args *args);
/* Checks values that do not need the config; names the setting at fault (lg_spell_settings). */
int lg_args_check(const lg_args *args, lg_error *err);
/* Ranks of the run: devices x nodes. */
int lg_args_ranks(const lg_args *args);

/* ---------------------------------------------------------------------------------------------
   5. plan (API): where every tensor lives in its buffer
   ------------------------------------------------------------------------------------------- */

#define LG_MAX_NAME 80

/* What a tensor is, for initialisation and weight decay. */
typedef enum {
    LG_TENSOR_ACTIVATION, /* not a parameter */
    LG_TENSOR_EMBEDDING,  /* wte, wpe, lm_head: N(0, 0.02); padded vocabulary rows 0 */
    LG_TENSOR_WEIGHT,     /* a linear layer's matrix: N(0, 0.02) */
    LG_TENSOR_RESIDUAL,   /* a projection into the residual stream: N(0, 0.02 / sqrt(2 L)) */
    LG_TENSOR_NORM,       /* a norm's scale: 1 */
    LG_TENSOR_BIAS,       /* 0 */
    LG_TENSOR_LORA_A,     /* LoRA's A (r, in): U(-1/sqrt(in), 1/sqrt(in)), as LitGPT */
    LG_TENSOR_LORA_B      /* LoRA's B (out, r): 0, so training starts from the base model */
} lg_tensor_kind;

typedef struct {
    char name[LG_MAX_NAME]; /* LitGPT name, e.g. transformer.h.3.attn.qkv.weight */
    int rows, cols;         /* a vector has rows == 1 */
    size_t offset;          /* elements from the start of its buffer */
    size_t count;           /* rows * cols */
    lg_tensor_kind kind;    /* weight decay applies to the 2-D kinds: embedding, weight, residual */
    int block;              /* the transformer block it belongs to; -1: embeddings, final norm
                               and head (the "ends", sharded as one unit) */
    size_t origin;          /* the index of its first element in the whole parameter layout;
                               differs from offset in a rank's shard table, whose entries are
                               the pieces of tensors that rank holds */
    lg_dtype packed;        /* frozen tables: LG_DTYPE_NF4 or _DQ when stored quantized (offset
                               in bytes of the packed buffer), else LG_DTYPE_F32 */
    int on_host;            /* frozen tables: 1 for the token embedding under --offload
                               embedding (offset 0 of its own host region, not in the base) */
} lg_tensor_info;

typedef struct {
    lg_tensor_info *tensors; /* (n_tensors) */
    int n_tensors;
    size_t total;            /* elements in the buffer */
} lg_tensor_table;

/* One transformer block's tensors, as views into a buffer laid out by lg_params_layout. The
   same struct views the parameters or the gradients. Absent tensors have data NULL. */
typedef struct {
    lg_buf norm_1_w, norm_1_b; /* (C) */
    lg_buf qkv_w;              /* ((NH + 2 NQG) HS, C): query heads, then key, then value */
    lg_buf qkv_b;              /* ((NH + 2 NQG) HS) */
    lg_buf proj_w;             /* (C, NH HS) */
    lg_buf proj_b;             /* (C) */
    lg_buf norm_2_w, norm_2_b; /* (C) */
    lg_buf fc_w, fc_b;         /* GptNeoxMLP: (I, C), (I); LLaMAMLP: fc_1 */
    lg_buf fc_2_w, fc_2_b;     /* LLaMAMLP only: (I, C), (I) */
    lg_buf mlp_proj_w;         /* (C, I) */
    lg_buf mlp_proj_b;         /* (C) */
    /* LoRA's adapters of the linears (lg_lora_linear; data NULL where not targeted), in the
       trainable layout; the tensors above are then the frozen base */
    lg_buf lora_a[LG_LORA_BLOCK_LINEARS]; /* (r, in) */
    lg_buf lora_b[LG_LORA_BLOCK_LINEARS]; /* (out, r) */
} lg_block_tensors;

typedef struct {
    lg_buf wte;                /* (Vp, C) */
    lg_buf wpe;                /* (block_size, C) */
    lg_block_tensors *h;       /* (L) */
    lg_buf ln_f_w, ln_f_b;     /* (C) */
    lg_buf lm_head_w;          /* (Vp, C); == wte when tied */
    lg_buf lm_head_b;          /* (Vp) */
    lg_buf lm_head_lora_a;     /* LoRA head: (r, C) */
    lg_buf lm_head_lora_b;     /* (Vp, r) */
} lg_param_tensors;

/* What one block keeps from its forward for its backward: tensors in the activation type,
   statistics in lg_real. */
typedef struct {
    lg_buf n1;                       /* (B, T, C): norm_1 output */
    lg_real *n1_mean, *n1_rstd;      /* (B, T), (B, T): its statistics (mean: LayerNorm only) */
    lg_buf qkv;                      /* (B, T, (NH + 2 NQG) HS), rotary applied */
    lg_real *att_lse;                /* (B, NH, T): log-sum-exp of each row of scaled scores;
                                        the backward rebuilds the probabilities from it */
    lg_buf att_y;                    /* (B, T, NH HS): heads before the projection */
    lg_buf x_mid;                    /* (B, T, C): input + attention branch */
    lg_buf n2;                       /* (B, T, C): norm_2 output (absent when shared) */
    lg_real *n2_mean, *n2_rstd;      /* (B, T), (B, T) */
    lg_buf fc;                       /* (S, I): MLP pre-activation (fc or fc_1) of a slice of
                                        S = slice_rows of the B x T rows (S = B x T: all) */
    lg_buf fc_2;                     /* (S, I): LLaMAMLP's second branch */
    lg_buf act;                      /* (S, I): gelu(fc) or silu(fc_1) * fc_2 */
    lg_buf lora_h[LG_LORA_BLOCK_LINEARS]; /* LoRA: (B, T, r) = u A^T of each adapted linear,
                                        u = (alpha / r) dropout(its input) */
} lg_block_acts;

#define LG_KEPT_SLOTS 2 /* --offload activations: one block's input in use, the next arriving */

typedef struct {
    lg_buf *residual;                /* (L + 1) x (B, T, C): input of block l, last = output */
    lg_buf *kept_host;               /* --offload activations: (L - 1) x (B, T, C), block l's
                                        output in host memory (residual[l + 1] on the device) */
    lg_buf kept_slot[LG_KEPT_SLOTS]; /* --offload activations: (B, T, C) each, the device's
                                        double buffer the kept outputs pass through */
    lg_block_acts *h;                /* (L) */
    lg_buf ln_f;                     /* (B, T, C) */
    lg_real *ln_f_mean, *ln_f_rstd;  /* (B, T), (B, T) */
    lg_buf logits;                   /* (B, T, Vp); the backward overwrites it with its gradient */
    lg_buf lm_head_lora_h;           /* LoRA head: (B, T, r) */
    lg_real *losses;                 /* (B, T): per-token loss, 0 where ignored */
    lg_real *rope_cos, *rope_sin;    /* (T, rope_dims / 2) */
    /* the backward's working set, one block at a time */
    lg_buf d_res_a, d_res_b;         /* (B, T, C): gradient of the residual stream */
    lg_buf d_mid, d_norm;            /* (B, T, C) */
    lg_buf d_qkv;                    /* (B, T, (NH + 2 NQG) HS) */
    lg_buf d_att_y;                  /* (B, T, NH HS) */
    lg_buf d_fc, d_fc_2, d_act;      /* (S, I): a slice's, as fc */
    /* LoRA, one linear at a time (forward and backward) */
    lg_buf lora_u;                   /* (rows, widest): the adapters' input u, the most of any
                                        adapted linear's (B x T, or an MLP slice's) rows x input */
    lg_buf lora_du;                  /* (rows, widest): u's gradient */
    lg_buf lora_dh;                  /* (B, T, r): one adapter's h gradient */
} lg_act_tensors;

/* Lays the trainable parameters out in one buffer: fills `table` (may be NULL) and, when base
   is not NULL, points `tensors` into base. Returns the element count. Call it with the
   parameter buffer and again with the gradient buffer: both have this layout. The order is the
   order of the sharding units: first the ends (wte, wpe, ln_f, lm_head), then block 0, 1, ...
   With LoRA (cfg->lora.r > 0) the trainable parameters are the adapters only, and the model's
   base tensors are laid out by lg_frozen_layout. */
size_t lg_params_layout(const lg_config *cfg, lg_buf base, lg_param_tensors *tensors,
                        lg_tensor_table *table);
/* The model without LoRA: the config of its base weights (checkpoints of the base model). */
lg_config lg_config_base(const lg_config *cfg);
void lg_tensor_table_free(lg_tensor_table *table);
/* The units of sharding, in layout order: 0 the ends, 1 + l block l. Points p's views of one
   unit into base (a buffer holding just that unit) when base is not NULL; returns the unit's
   element count. */
size_t lg_unit_layout(const lg_config *cfg, int unit, lg_buf base, lg_param_tensors *tensors);

/* The memory plan: every region of every rank, before anything is allocated. Ranks allocate
   one arena per pool of exactly pool_bytes and carve the regions out of it. */

typedef enum { LG_POOL_DEVICE, LG_POOL_HOST } lg_pool;
#define LG_N_POOLS 2


/* What a region holds: the groups of the --plan table, in its order. */
typedef enum {
    LG_GROUP_WEIGHTS,        /* the weights the matmuls read */
    LG_GROUP_MASTER,         /* fp32 master weights of the mixed precisions */
    LG_GROUP_GRADIENTS,
    LG_GROUP_OPTIMIZER,      /* optimizer states */
    LG_GROUP_ACTIVATIONS,    /* what the forward keeps for the backward */
    LG_GROUP_LOGITS,         /* logits and per-token losses */
    LG_GROUP_BACKWARD,       /* the backward's working set, one block at a time */
    LG_GROUP_COMMUNICATION,  /* gathered shards and reduce buffers (more than one device) */
    LG_GROUP_WORKSPACE,      /* matmul packing buffers, one a thread */
    LG_GROUP_DATA            /* token buffers of one optimizer step */
} lg_group;
#define LG_N_GROUPS 10

#define LG_ALIGN 64       /* every region starts on a 64-byte boundary ... */
#define LG_CUDA_ALIGN 256 /* ... or a 256-byte one on a GPU (cuBLASLt's and vector loads' best) */

typedef struct {
    char name[LG_MAX_NAME]; /* e.g. "optimizer.m", "activations.h.3" */
    lg_group group;
    lg_pool pool;
    lg_dtype dtype;
    size_t count;           /* elements */
    size_t bytes;           /* count x dtype size, rounded up to the rank plan's alignment: what
                               the arena holds */
    size_t offset;          /* bytes from the start of its pool's arena */
} lg_region;

typedef struct {
    lg_region *regions;     /* (n_regions) */
    int n_regions, capacity;
    size_t pool_bytes[LG_N_POOLS];
    size_t align;           /* every region's boundary: LG_ALIGN, LG_CUDA_ALIGN on a GPU */
    int shard_index;        /* its place in its shard group (rank % shard_ranks) */
    lg_tensor_table pieces; /* the tensors, or pieces of tensors, whose gradients, master weights
                               and optimizer state this rank holds: offsets in its shard,
                               origins in the whole layout (the whole table when unsharded) */
} lg_rank_plan;

/* Everything of a run that changes its memory. */
typedef struct {
    int B, T;               /* micro-batch, sequence length */
    int accumulation;       /* micro-batches per optimizer step */
    lg_precision precision;
    int devices, nodes;     /* ranks = devices x nodes */
    int processes;          /* the ranks spread over, devices x nodes / processes each */
    lg_strategy strategy;   /* how the model state splits over the ranks */
    int recompute;          /* 1: --recompute block */
    int offload;            /* 1: --offload */
    int offload_activations; /* 1: --offload activations (with recompute) */
    int offload_gradients;   /* 1: --offload gradients (with offload) */
    int offload_weights;     /* 1: --offload weights (with offload) */
    int offload_embedding;   /* 1: --offload embedding (an untied table) */
    int pack;                /* 1: --pack: rows carry their samples' span starts */
    int head_rows;           /* rows of logits at a time, 1 .. B x T (B x T: no chunks) */
    int slice_rows;          /* rows of a block's MLP at a time, 1 .. B x T (B x T: whole) */
    lg_optimizer_kind optimizer;
    int momentum;           /* SGD keeps a momentum buffer */
    lg_state_format optimizer_state;
    int threads;            /* CPU threads: one matmul workspace each */
    lg_backend backend;     /* the CPU's scratch regions, or a GPU's workspace */
    size_t runtime_bytes;   /* GPU: what the CUDA context, cuBLAS and NCCL take, measured at
                               start-up (lg_args.runtime_bytes); planned, not in the arena */
    int tf32;               /* GPU: fp32 matmuls may use TF32 (no memory; the ranks read it) */
    lg_lora lora;           /* LoRA: the plan's config carries it (lg_config.lora) */
} lg_plan_spec;

/* A GPU rank's own regions (litgpt_cuda.cuh): cuBLASLt's workspace, the partial sums of its
   reductions (norm weight gradients: LG_CUDA_ROW_CHUNKS rows of 2 C floats; totals:
   LG_CUDA_REDUCE_SLOTS doubles), the micro-batch's ids, and in the host pool the staging region
   through which the host reads and writes the GPU's memory (lg_visit: LG_CUDA_STAGING bytes,
   or one fp32 row of logits if that is more). */
#define LG_CUDA_MATMUL_WORKSPACE ((size_t)32 << 20) /* at least: see lg_cuda_workspace_bytes */
#define LG_CUDA_STAGING ((size_t)16 << 20)
#define LG_CUDA_ROW_CHUNKS 256 /* chunks of rows: blocks enough for a GPU's SMs several times over */
#define LG_CUDA_REDUCE_SLOTS 1024
#define LG_CUDA_RUNTIME_REGION "cuda.runtime" /* the last device region: not in the arena */

/* What a strategy splits, over how many ranks. Rank r is member r % shard_ranks of shard group
   r / shard_ranks, and member r / shard_ranks of replica group r % shard_ranks. */
typedef struct {
    int shard_ranks;        /* S: the ranks one copy of the model state is split over */
    int replicas;           /* R: copies of it; S x R = ranks */
    int weights_sharded;    /* full-shard, hybrid-shard: weights gathered unit by unit */
    int grads_sharded;      /* gradients, master weights and optimizer state split (S > 1) */
    int weights_streamed;   /* --offload weights: the weights in host memory, each unit copied
                               onto the device ahead of its use (one rank) */
} lg_sharding;

/* How the parameters split over the S ranks of a shard group: each unit (the ends, then each
   block; see lg_unit_layout) is padded to a multiple of S and cut into S equal pieces; a
   rank's shard is its piece of every unit, in unit order. With S = 1 the shard is the whole
   layout. */
typedef struct {
    int n_units;            /* 1 + L */
    int n_shards;           /* S */
    size_t *unit_offset;    /* (n_units + 1): where unit u starts in the whole layout */
    size_t *piece_count;    /* (n_units): ceil(elements of unit u / S) */
    size_t *piece_offset;   /* (n_units + 1): where a rank's piece of unit u starts in its shard;
                               the last entry is the shard's size */
} lg_shard_layout;

typedef struct {
    lg_config cfg;
    lg_plan_spec spec;
    lg_sharding sharding;
    lg_shard_layout shards;
    /* LoRA with sharded weights (full-shard, hybrid-shard): the frozen base cut the same way,
       in bytes (lg_frozen_unit_layout: each unit's tensors in the weight type, then its NF4
       ones as stored); n_units 0 when every rank holds the whole frozen base */
    lg_shard_layout frozen_shards;
    int n_ranks;            /* devices x nodes */
    lg_rank_plan *ranks;    /* (n_ranks) */
} lg_plan;

/* The collective buffers of a sharded run (regions gather.* and gradients.*) hold whole units:
   the ends have one of each kind, the blocks take turns in slots. Full-shard gathers the next
   block while one computes (LG_GATHER_BLOCK_SLOTS); shard-grad-op gathers each updated unit
   once after the step (1). A block's gradients wait for their reduce-scatter while the block
   before computes (LG_GRAD_BLOCK_SLOTS). */
#define LG_GATHER_BLOCK_SLOTS 2
#define LG_GRAD_BLOCK_SLOTS 2
/* The copies beside the compute that the compute waits for one at a time (lg_mark_beside):
   --offload activations' LG_KEPT_SLOTS slots, then --offload gradients' unit buffers (the
   ends', then LG_GRAD_BLOCK_SLOTS blocks'), then --offload weights' gather slots (the ends',
   then LG_GATHER_BLOCK_SLOTS blocks'), then --offload embedding's rows. */
#define LG_BESIDE_GRADS LG_KEPT_SLOTS
#define LG_BESIDE_WEIGHTS (LG_BESIDE_GRADS + 1 + LG_GRAD_BLOCK_SLOTS)
#define LG_BESIDE_EMBEDDING (LG_BESIDE_WEIGHTS + 1 + LG_GATHER_BLOCK_SLOTS)
#define LG_BESIDE_MARKS (LG_BESIDE_EMBEDDING + 1)
/* LoRA's frozen base in units (sharded or streamed with the weights, as FSDP shards it);
   shard-grad-op and no-shard keep it whole on every rank's device. */
int lg_frozen_sharded(const lg_config *cfg, const lg_sharding *sh);

void lg_plan_spec_from_args(lg_plan_spec *spec, const lg_args *args, int T);
int lg_plan_make(lg_plan *plan, const lg_config *cfg, const lg_plan_spec *spec, lg_error *err);
void lg_plan_free(lg_plan *plan);
/* The most any one rank needs in a pool. */
size_t lg_plan_bytes(const lg_plan *plan, lg_pool pool);
/* Sharded runs (not LoRA): a checkpoint assembles the training state one sharding unit at a
   time in the plan's checkpoint.gather, held by the first rank of each process: the master
   weights (when the precision has them) then each optimizer state, as many elements each as
   the largest unit (padded). The byte offsets of those parts into at[LG_PART_MASTER],
   at[LG_PART_M], at[LG_PART_V] (the optimizer's first and second state; SIZE_MAX when
   absent); returns the region's bytes, 0 when there is none. */
enum { LG_PART_MASTER, LG_PART_M, LG_PART_V, LG_UNIT_PARTS };
size_t lg_checkpoint_unit_layout(const lg_plan *plan, size_t at[LG_UNIT_PARTS]);
const lg_region *lg_plan_find(const lg_rank_plan *rank, const char *name);
size_t lg_plan_group_bytes(const lg_rank_plan *rank, lg_group group, lg_pool pool);
/* --plan: a table per device (grouped, with bars) or JSON. */
void lg_plan_print(const lg_plan *plan, FILE *out);
/* The fit check of a plan against the memory there is. */
typedef struct {
    size_t limit;         /* a device's memory (the CPU backend: the machine's, both pools of
                             its ranks together); 0: unknown, nothing is checked */
    size_t host_limit;    /* GPU backend: the host memory of a machine's ranks; 0: unknown */
    size_t checked_bytes; /* lg_plan_checked_bytes: what is held against limit */
    size_t margin;        /* GPU backend: what the device keeps free beyond checked_bytes */
    const struct lg_gpu_card *gpu; /* --gpu: the card the limit is of (NULL: none named) */
    size_t host_bytes;    /* lg_plan_host_bytes_per_machine: against host_limit (GPU) */
    int device_fits;      /* checked_bytes + margin <= limit (1 when limit is unknown) */
    int host_fits;        /* host_bytes <= host_limit (1 on the CPU backend or unknown) */
    int fits;             /* both; -1: the limit is unknown (a plan for a GPU not here) */
    int runtime_estimated; /* the plan's cuda.runtime is an estimate, of these parts: */
    lg_cuda_runtime_parts runtime;
} lg_fit;

/* The bytes rank 0 moves between host and device memory in one optimizer step: with --offload
   its gradient shard down and the updated weights up; with --offload activations each kept
   block output down in the forward and up in the backward, every micro-batch. On a GPU they
   cross PCIe (or NVLink-C2C); on the CPU backend they are copies within one memory. */
size_t lg_plan_host_traffic_bytes(const lg_plan *plan);
/* An estimate of the floating-point operations one rank computes in an optimizer step: 2 for
   each multiply-add of every matmul (the block linears, the head, LoRA's adapters, causal
   attention's two products on the half at and below the diagonal) in the forward, in what the
   step computes again (--recompute block: every block; MLP slices: their hidden layer; head
   chunks: the logits), and in the backward (each matmul's input gradient, its weight gradient
   where the weight trains: not LoRA's frozen base; attention's backward twice its forward).
   Norms, activations, the loss, the optimizer and NF4's dequantization are left out: few
   operations a byte moved. */
double lg_plan_step_flops(const lg_plan *plan);
/* A planning figure for that traffic's time: 25 GB/s, about what a PCIe 4.0 x16 link (31.5
   GB/s a direction in its specification) carries in practice; an estimate, not a measurement. */
#define LG_PCIE_BYTES_PER_S_ESTIMATE 25e9

/* fit (may be NULL): the fit check's limits and verdict, as limit_bytes, host_limit_bytes and
   fits (null when the limit is unknown). */
void lg_plan_print_json(const lg_plan *plan, const lg_fit *fit, FILE *out);
const char *lg_dtype_name(lg_dtype dtype);
size_t lg_dtype_size(lg_dtype dtype);
const char *lg_group_name(lg_group group);
/* The settings a remedy changes (lg_remedy.changes: bits), in the order a command line names
   them; the new values are the remedy's args (and T). A driver turns them into its flags. */
enum {
    LG_SETTING_RECOMPUTE = 1 << 0,       /* args.recompute */
    LG_SETTING_OFFLOAD = 1 << 1,         /* args.offload */
    LG_SETTING_PRECISION = 1 << 2,       /* args.precision */
    LG_SETTING_LORA_R = 1 << 3,          /* args.lora.r */
    LG_SETTING_QUANTIZE = 1 << 4,        /* args.lora.quantize */
    LG_SETTING_OPTIMIZER_STATE = 1 << 5, /* args.optimizer_state */
    LG_SETTING_OPTIMIZER = 1 << 6,       /* args.optimizer */
    LG_SETTING_MOMENTUM = 1 << 7,        /* args.momentum */
    LG_SETTING_SEQ_LENGTH = 1 << 8,      /* the remedy's T */
    LG_SETTING_DEVICES = 1 << 9,         /* args.devices */
    LG_SETTING_STRATEGY = 1 << 10,       /* args.strategy */
    LG_SETTING_MICRO_BATCH = 1 << 11,    /* args.micro_batch_size */
    LG_SETTING_GLOBAL_BATCH = 1 << 12,   /* args.global_batch_size */
    LG_SETTING_OFFLOAD_ACTIVATIONS = 1 << 13, /* args.offload_activations */
    LG_SETTING_OFFLOAD_GRADIENTS = 1 << 14,   /* args.offload_gradients (and args.offload,
                                                 which it needs) */
    LG_SETTING_OFFLOAD_WEIGHTS = 1 << 15,     /* args.offload_weights (and args.offload) */
    LG_SETTING_OFFLOAD_EMBEDDING = 1 << 16,   /* args.offload_embedding */
    LG_SETTING_LAST = LG_SETTING_OFFLOAD_EMBEDDING
};

/* One remedy of the OOM guide, priced by the planner. */
typedef struct {
    const char *what;     /* "smaller micro-batch", ... */
    lg_args args;         /* the run with this change */
    int T;                /* its sequence length */
    unsigned changes;     /* LG_SETTING_* bits: the settings a person changes for it, e.g.
                             LG_SETTING_MICRO_BATCH | LG_SETTING_GLOBAL_BATCH */
    size_t device_bytes;  /* what each device needs with it */
    size_t host_bytes;    /* and the host pools of one machine's ranks together */
    size_t checked_bytes; /* what the fit check holds against the limit: device_bytes on a GPU;
                             on the CPU backend, whose pools are one memory, both pools of
                             every rank of a machine (lg_plan_checked_bytes) */
    int fits;             /* checked_bytes <= the limit (and on a GPU host_bytes <= the host's
                             memory) */
} lg_remedy;

#define LG_MAX_REMEDIES 13

/* Remedies in the order of the OOM guide (micro-batch, sequence, -true precision, devices,
   recompute, offload and its parts: gradients, weights, LoRA's embedding, activations;
   optimizer; when fine-tuning every weight, LoRA and QLoRA), each with the planner's total
   under `limit` bytes. Returns how many; skips those that change nothing. */
int lg_plan_remedies(const lg_config *cfg, const lg_args *args, int T, size_t limit,
                     lg_remedy *out);
/* The cheapest change that fits: changes that keep the training the same first (a
   smaller micro-batch, block recompute, offload, activations in host memory with recompute),
   then a -true precision, when fine-tuning
   every weight LoRA's adapters then QLoRA's (they change what trains), an optimizer with
   less state, a shorter sequence, and their combinations, each with the micro-batch and
   sequence as large as fits. Returns 0 and fills *best, or -1 with the most drastic
   combination in *best. */
int lg_plan_cheapest_fit(const lg_config *cfg, const lg_args *args, int T, size_t limit,
                         lg_remedy *best);
/* A remedy's changed settings with their new values, marked as messages mark settings
   (lg_spell_settings), in the order of the LG_SETTING_* bits: "`micro_batch_size 2`
   `global_batch_size 16`"; the offload parts are one setting: "`offload`" (state alone) or
   "`offload activations,gradients`". Returns out. */
const char *lg_remedy_settings(const lg_remedy *r, char *out, size_t cap);
/* Device bytes of the run args describes at sequence length T (0 when it cannot be planned). */
size_t lg_plan_device_bytes_for(const lg_config *cfg, const lg_args *args, int T);
/* The same for the run args describes at sequence length T (0 when it cannot be planned). */
size_t lg_plan_checked_bytes_for(const lg_config *cfg, const lg_args *args, int T);
/* -b auto: the largest micro-batch dividing the per-device batch whose plan fits; 0: none. */
int lg_plan_auto_micro_batch(const lg_config *cfg, const lg_args *args, int T, size_t limit);
/* -t auto: the longest sequence up to max_T whose plan fits; 0: not even one token. */
int lg_plan_auto_seq_length(const lg_config *cfg, const lg_args *args, int max_T, size_t limit);
/* The rows of B x T the head (head_rows) and each block's MLP (slice_rows) work on at a time:
   --head-rows and --slice-rows when given; else all of them when the run fits so; else the head
   in chunks of LG_HEAD_CHUNK_ROWS (their logits computed again in the backward: a second pass
   of the head's matmul; Sophia keeps all rows); then, if that does not fit either and with
   --recompute block, the MLP in slices of LG_SLICE_ROWS (no compute added: the recompute
   leaves the MLP to the backward, which computes each slice's hidden layer once). */
#define LG_HEAD_CHUNK_ROWS 1024
#define LG_HEAD_CHUNK_TEXT "1024" /* the same, for usage texts */
#define LG_SLICE_ROWS 2048
#define LG_SLICE_TEXT "2048"
void lg_plan_auto_rows(const lg_config *cfg, const lg_args *args, int T, size_t limit,
                       int *head_rows, int *slice_rows);
/* Where the token embedding lives (the value of args->offload_embedding): in host memory when
   --offload embedding is given; else there too when the run, with args' rows, fits with it
   there but not on the device, and the model and run allow it (an untied table, no learned
   position embeddings; trained, --offload gradients,weights on one rank; the step's rows are
   copied in once a micro-batch, and trained, their gradient out: no compute added); else on
   the device (0). On the CPU backend, whose pools are one memory, moving it
   never makes a run fit. */
int lg_plan_auto_embedding(const lg_config *cfg, const lg_args *args, int T, size_t limit);
/* Memory a run may use on this machine's CPU backend: MemAvailable, 0 when unknown. */
size_t lg_host_available_bytes(void);
/* The host memory a machine's ranks may use: --host-memory-limit, else what was available
   (args->host_available); 0: unknown. */
size_t lg_args_host_limit(const lg_args *args);

void lg_plan_check_fit(const lg_plan *plan, const lg_args *args, size_t limit, lg_fit *fit);
/* What the CUDA runtime is planned to take on each GPU where it cannot be measured (--plan
   --backend cuda on a machine without one, or --gpu NAME): args->runtime_parts (for --gpu's
   card, else the largest of the named cards', with the communicators a rank joins,
   lg_comms_per_rank), their sum in args->runtime_bytes, args->runtime_estimated = 1. An
   estimate (the figures are named where they are defined); on a GPU the runtime is measured. */
void lg_cuda_estimate_runtime(lg_args *args);

/* The GPUs people fine-tune on (--gpu NAME plans for one from any machine): the memory each
   reports (nvidia-smi's total; `nominal` where only the marketed size is known), its compute
   capability and the shared memory a block may opt into. */
typedef struct lg_gpu_card {
    const char *name;     /* --gpu's name: "rtx4090" */
    const char *label;    /* "RTX 4090" */
    size_t total_mib;     /* the memory it reports */
    int nominal;          /* 1: not a reading of this card (the marketed size, or a like card's) */
    int major, minor;     /* compute capability */
    int shared_optin;     /* bytes of shared memory a block may have */
    int sms;              /* streaming multiprocessors */
    int threads_per_sm;   /* resident threads a SM at most (per compute capability) */
} lg_gpu_card;
int lg_gpu_card_count(void);
const lg_gpu_card *lg_gpu_card_at(int i);
const lg_gpu_card *lg_gpu_card_named(const char *name); /* NULL: no such card */
/* 1 when the CUDA kernels run on the card (compute capability 8.0 or newer). */
int lg_gpu_card_supported(const lg_gpu_card *card);
/* The runtime's share of a GPU, estimated for card (NULL: the largest of the supported named
   cards') with `communicators` NCCL communicators a rank (lg_cuda_estimate_runtime's parts). */
void lg_cuda_runtime_estimate_parts(const lg_gpu_card *card, int communicators,
                                    lg_cuda_runtime_parts *parts);
size_t lg_cuda_runtime_parts_sum(const lg_cuda_runtime_parts *parts);
/* "context 408 MiB, ..." into buf: the parts, named. */
const char *lg_cuda_runtime_parts_describe(const lg_cuda_runtime_parts *parts, char *buf,
                                           size_t cap);
/* Code a GPU of compute capability major.minor loads after the runtime is measured (lazy
   loading): our kernels' image for it, counted whole, and cuBLASLt's allowance (the parts
   own_kernels and cublaslt above, less cuBLASLt's handle, which the measure holds). */
size_t lg_cuda_lazy_code_bytes(int major, int minor);

/* "24GiB", "512 mib", "1.5GB", "100B" -> bytes; -1 when not a size (a bare number has no unit). */
int lg_parse_size(const char *text, size_t *bytes);
/* "1.23 GiB" into buf. */
const char *lg_format_bytes(size_t bytes, char *buf, size_t size);

/* ---------------------------------------------------------------------------------------------
   8. model (API)
   ------------------------------------------------------------------------------------------- */

#define LG_IGNORE_INDEX (-100)

/* The CPU matmul's kernel paths (see lg_gemm), each needing more of the processor than the
   one before: portable C; AVX2 + FMA; AVX-512; AVX-512 with AVX512_BF16 dot products for bf16
   operands; AVX-512 with AMX tiles for bf16 operands. */
typedef enum { LG_GEMM_PORTABLE, LG_GEMM_AVX2, LG_GEMM_AVX512, LG_GEMM_AVX512_BF16,
               LG_GEMM_AMX } lg_gemm_path;
/* The best path this processor runs (cpuid; for AMX also the kernel's permission, which it
   asks for), or a lower one named by the environment variable LG_GEMM (portable, avx2, avx512,
   avx512-bf16, amx). */
lg_gemm_path lg_cpu_gemm_path(void);
const char *lg_gemm_path_name(lg_gemm_path path);

/* The matmul's packing buffers: `threads` slots of per_thread elements (see lg_gemm), and the
   kernels it runs. */
typedef struct {
    lg_real *base;
    size_t per_thread;
    int threads;
    lg_gemm_path path;
} lg_gemm_workspace;

/* Attention's rows for one (batch, head) at a time: scores or probabilities (T, T) and their
   gradient (T, T), lg_real, one slot a thread. */
typedef struct {
    lg_real *base;
    size_t per_thread; /* 2 T T */
    int threads;
} lg_attention_scratch;

typedef struct lg_rank lg_rank;
typedef struct lg_cuda_rank lg_cuda_rank; /* litgpt_cuda.cuh: a GPU's streams and handles */

/* How and where a rank's ops run: the first argument of every op of section 7. NULL runs the
   CPU loops without scratch (matmuls unblocked; attention needs the scratch). */
typedef struct {
    lg_backend backend;
    lg_gemm_workspace gemm;          /* CPU: the matmul's packing buffers */
    lg_attention_scratch attention;  /* CPU: attention's rows */
    lg_cuda_rank *cuda;              /* CUDA: the GPU's stream, cuBLASLt handle, workspace */
    lg_buf dequantized;              /* QLoRA: one NF4 weight dequantized for its matmul */
} lg_exec;

/* out (count) = a tensor stored by lg_nf4_quantize (section 2) read back: code value x
   absmax, in fp32, then rounded to out.dtype (F32, BF16 or F16). An op of section 7: on a GPU
   rank src and out are GPU-visible and it runs on the rank's stream. */
void lg_nf4_dequantize(const lg_exec *ex, const uint8_t *src, size_t count, lg_quantization q,
                       lg_buf out);

typedef struct {
    lg_config cfg;
    int B, T;                   /* the largest micro-batch and sequence the buffers hold */
    lg_buf params;              /* the plan's "weights" region, in the weight type of the
                                   precision (the working copy): (n_params) in the whole layout,
                                   or (n_local) this rank's shard when weights_gathered */
    lg_buf grads;               /* (n_local): the "gradients" region, laid out as `local` */
    int weights_gathered;       /* full-shard: p's views point at gathered units */
    int grads_gathered;         /* sharded gradients: g's views point at a unit's gradient buffer
                                   until its reduce-scatter (see lg_model_point_unit) */
    const lg_tensor_table *local; /* the pieces of grads (and of the master weights and optimizer
                                   state): the whole table when unsharded; owned by the plan */
    size_t n_local;             /* elements of grads */
    lg_precision precision;
    int recompute;              /* --recompute block: the blocks share one set of activations,
                                   rebuilt from each block's input during the backward */
    int offload_activations;    /* --offload activations: the kept block inputs in host memory */
    int skip_kept_waits;        /* tests only: the compute does not wait for the offload slots'
                                   copies, activations' or gradients' (a run then reads or
                                   writes slots before their copies are done) */
    int head_rows;              /* the logits region's rows: the head and loss run over chunks of
                                   this many tokens (B x T: one pass) */
    int slice_rows;             /* the rows of a block's MLP buffers: the MLP runs over slices of
                                   this many tokens (B x T: whole), the backward computes each
                                   slice's hidden layer again */
    size_t n_params;
    lg_tensor_table param_table;
    lg_param_tensors p, g;      /* views of params and grads */
    lg_act_tensors a;           /* views of the activation regions */
    lg_exec exec;               /* the rank's backend and its scratch */
    /* LoRA: the frozen base model, p's base views point into it */
    lg_buf frozen;              /* the plan's "frozen_weights": (n_frozen) in the weight type;
                                   data NULL when frozen_gathered (dtype still the type) */
    lg_buf frozen_packed;       /* "frozen_weights.nf4": the NF4 linear weights (bytes) */
    lg_tensor_table frozen_table; /* its tensors (lg_frozen_layout; frozen_gathered: offsets
                                   within units, lg_frozen_unit_layout); empty without LoRA */
    int frozen_gathered;        /* lg_frozen_sharded: the rank holds its shard of the frozen
                                   units, p's base views point at gathered units
                                   (lg_model_point_frozen_unit) */
    lg_buf frozen_shard;        /* frozen_gathered: "frozen_weights.shard", bytes */
    lg_buf embedding_host;      /* --offload embedding: the table (Vp, C) in the weight type,
                                   host memory: LoRA's "embedding.host", or trained, its place
                                   in the host's "weights"; p.wte views it */
    lg_buf embedding_rows;      /* --offload embedding: "embedding.rows" (B x T, C) in the
                                   activation type, host memory: the step's rows of it, which
                                   one copy takes to a.residual[0] */
    uint64_t dropout_key;       /* LoRA dropout's mask of this micro-batch; 0: none (evaluation) */
    float fused_loss_scale;     /* > 0 (a training step): a forward with targets also writes the
                                   logits' gradient at this loss_scale over the logits, in the
                                   classifier's one pass (lg_crossentropy_fused) */
    int logits_hold_grad;       /* the logits region holds that gradient: the backward's head
                                   starts from it */
    int grads_overwrite;        /* the linear layers' gradients (lg_overwritten_grads) hold
                                   nothing of this step yet: the next backward writes them
                                   (beta 0) instead of adding; lg_model_start_grads sets it */
    int grads_add_only;         /* tests: every gradient zeroed and added to, never written */
    const int *span_start;      /* (B, T) packed rows (lg_model_set_spans): where each token's
                                   sample starts in its row; NULL: one sample a row */
    lg_rank *rank;              /* where the buffers live */
    lg_plan *own_plan;          /* set when lg_model_create made its own plan and rank */
} lg_model;

/* A model with its own plan (no optimizer state) and rank: for tests and inference. */
int lg_model_create(lg_model *m, const lg_config *cfg, int B, int T, lg_error *err);
void lg_model_free(lg_model *m);
/* GPT-2's initialisation of weights in the whole layout (the trainer does it unit by unit when
   the weights are sharded, with the same numbers). Fails (out of host memory packing the NF4
   base) with the message in err. */
int lg_model_init_weights(lg_model *m, uint64_t seed, lg_error *err);
/* Forward of tokens (B, T) with B <= m->B and T <= m->T. With targets (B, T) (LG_IGNORE_INDEX
   to skip a position) it fills the per-token losses and returns their sum; *n_targets gets the
   count of non-ignored targets. Without targets it only computes logits and returns 0. */
double lg_model_forward(lg_model *m, const int *tokens, const int *targets, int B, int T,
                        int *n_targets);
/* Adds to m->grads the gradient of (sum of token losses) * loss_scale (writes the linear
   layers' after lg_model_start_grads); call after the forward of the same batch.
   loss_scale = 1 / (non-ignored targets of the global batch). */
void lg_model_backward(lg_model *m, const int *tokens, const int *targets, int B, int T,
                       float loss_scale);
/* Packed rows (lg_loader_next_packed): span_start (B, T) stays the caller's and is read by the
   forwards and backwards that follow (attention inside each sample, positions restarting);
   NULL: one sample a row. The CPU kernels only: a GPU rank is refused. */
int lg_model_set_spans(lg_model *m, const int *span_start, lg_error *err);
void lg_model_zero_grad(lg_model *m);
/* Appends n_new tokens to tokens[0..n_prompt) (room for n_prompt + n_new); greedy when
   temperature is 0. Uses the model's buffers with B = 1. */
void lg_model_generate(lg_model *m, int *tokens, int n_prompt, int n_new, float temperature,
                       lg_rng *rng);

/* ---------------------------------------------------------------------------------------------
   9. optimizers (API)
   ------------------------------------------------------------------------------------------- */

typedef struct {
    lg_optimizer_kind kind;
    float weight_decay, beta1, beta2, eps, momentum;
    float rho;         /* Sophia's clipping scale */
    lg_buf m;          /* (n_params): AdamW, Lion, Sophia first moment, SGD momentum; data NULL
                          when unused */
    lg_buf v;          /* (n_params): AdamW second moment, Sophia's Hessian estimate h */
    lg_real *master;   /* (n_params): fp32 master weights of the mixed precisions, else NULL */
    int stochastic;    /* half weights without a master copy: round updates stochastically */
    int sqrt_v;        /* fp16 state: v is stored as sqrt(v), whose range fp16 can hold
                          (g^2 of a gradient of 1e-4 would underflow fp16; g does not) */
    /* --optimizer-state bf16|8bit: m and v hold the tensors of LG_COMPACT_MIN elements or
       more (8-bit: codes, in blocks of LG_QUANT_BLOCK per tensor); the small ones live in
       fp32 here */
    lg_state_format format;
    lg_buf m_small, v_small;    /* fp32 */
    float *m_scales, *v_scales; /* 8-bit: each block's largest magnitude */
    float signed_map[256];      /* 8-bit codes of m, ascending values in [-1, 1] */
    float unsigned_map[256];    /* 8-bit codes of v, ascending values in [0, 1] */
    uint64_t seed;     /* of the stochastic rounding */
    int t;             /* updates taken */
} lg_optimizer;

/* Updates every parameter of the model's rank (its shard when sharded) from its gradient times
   grad_multiplier (unscaling and clipping in one factor); writes the weights back in their
   storage type. */
void lg_optimizer_step(lg_optimizer *opt, lg_model *m, float lr, float grad_multiplier);
/* The same on explicit buffers: grads, the master weights and the state laid out as `table`
   (entries' offsets), params too, or the whole layout (entries' origins) when params_whole: the
   host copies when offloading, the replicated weights of shard-grad-op. */
void lg_optimizer_update(lg_optimizer *opt, const lg_exec *ex, const lg_tensor_table *table,
                         lg_buf params, int params_whole, lg_buf grads, float lr,
                         float grad_multiplier);
/* Sophia: h = beta2 h + (1 - beta2) n_tokens (g_hat * grad_multiplier)^2, from the gradient of
   the loss on labels sampled from the model (the Gauss-Newton-Bartlett estimator). */
void lg_optimizer_hessian_update(lg_optimizer *opt, const lg_exec *ex, lg_buf sampled_grads,
                                 size_t n_params, double n_tokens, float grad_multiplier);
/* The norm of the model's gradients as stored (Inf or NaN when any element is): the global norm
   on one rank; a sharded trainer adds the shards' squares (lg_sum_squares). */
float lg_grad_norm(const lg_model *m);
double lg_sum_squares(const lg_exec *ex, lg_buf x, size_t n);
/* The factor that brings a gradient norm down to max_norm (1 when below, or max_norm 0). */
float lg_clip_factor(float norm, float max_norm);
/* Linear warmup over warmup_steps, then cosine from lr to min_lr at max_steps. */
float lg_learning_rate(const lg_args *args, int step);

/* ---------------------------------------------------------------------------------------------
   6 and 10. ranks (API): the backend a rank runs on, its memory, the processes and collectives
   ------------------------------------------------------------------------------------------- */

/* One device: its part of the plan and one arena per pool of exactly the planned size. */
struct lg_rank {
    const lg_plan *plan;
    int index;
    lg_backend backend;               /* the plan's: where the arenas live and the ops run */
    lg_cuda_rank *cuda;               /* CUDA: its GPU, streams and handles, else NULL */
    int device;                       /* CUDA: which GPU of the process's node (the index
                                         when one process drives every rank) */
    unsigned char *arena[LG_N_POOLS]; /* (plan->ranks[index].pool_bytes[pool]); on a GPU the
                                         device arena is GPU memory, the host one pinned */
};

/* The memory of a region of this rank's plan; NULL when the plan has no such region. */
void *lg_rank_region(const lg_rank *rank, const char *name);

/* Host visits to a rank's memory (initialisation, sampling, the offloaded optimizer, copies to
   and from the host): the host reads or writes `count` elements of x, a piece at a time, each
   piece whole units of `unit` elements (a row of logits, say). On the CPU the one piece is x
   itself. On a GPU, whose memory the host cannot touch, it is the rank's staging region
   (pinned host memory that holds at least one unit of 4-byte elements), filled by a copy from x
   before the host reads it and copied back to x after the host wrote it; the rank's queued
   work is done before the copy. Writing:
       lg_visit v = lg_visit_start(ex, x, count, 1, LG_VISIT_WRITE);
       while (lg_visit_next(&v))
           for (size_t k = 0; k < v.n; k++) lg_set(v.piece, k, value_of(v.first + k)); */
typedef enum { LG_VISIT_READ = 1, LG_VISIT_WRITE = 2 } lg_visit_mode;
typedef struct {
    const lg_exec *ex;     /* the rank's (NULL: the host's own memory) */
    lg_buf x;              /* (count) what is visited */
    size_t count, unit;
    int mode;              /* LG_VISIT_READ, LG_VISIT_WRITE or both */
    size_t first, n;       /* the piece: elements first .. first + n - 1 of x */
    lg_buf piece;          /* (n) host memory holding them */
} lg_visit;
lg_visit lg_visit_start(const lg_exec *ex, lg_buf x, size_t count, size_t unit, int mode);
/* Ends the last piece (a written one goes back) and starts the next; 0 when none is left. */
int lg_visit_next(lg_visit *v);

/* A group's communicator for the collectives of section 10 (lg_all_reduce_sum and the others):
   NCCL communicators on GPUs, MPI's for CPU ranks in several processes. */
typedef struct lg_comm lg_comm;
struct lg_launch; /* the processes (lg_launch, below): where a deadline comes from */
/* the trainer's: one a slot of the collective buffers, the ends' and the blocks' */
#define LG_COMM_SIGNALS (3 + 2 * LG_GATHER_BLOCK_SLOTS + LG_GRAD_BLOCK_SLOTS)
/* The NCCL communicators of n GPU ranks (NULL with err set when they cannot be made). */
lg_comm *lg_comm_create(int n, lg_rank *const *members, lg_error *err);
void lg_comm_free(lg_comm *comm);
/* GPU ranks in several processes (CUDA builds; the others return errors): process 0 draws
   the NCCL id (LG_NCCL_ID_BYTES), which reaches the others (lg_launch_share); each process's
   n ranks (members, global ranks first_rank..) join the communicator of all `world` ranks
   (ncclCommInitRank); lg_comm_split cuts one such into groups: member m joins group color[m]
   (-1: none) at position key[m]; by_color[c] becomes the group of color c that this
   process's members joined (it stays NULL for the others). */
#define LG_NCCL_ID_BYTES 128
int lg_nccl_unique_id(unsigned char *id, lg_error *err);
lg_comm *lg_comm_create_global(int world, int first_rank, int n, lg_rank *const *members,
                               const unsigned char *id, const struct lg_launch *launch,
                               lg_error *err);
/* GPUs: names an NCCL group for its errors and sets its deadline: no host wait on it lasts
   longer than launch->dist_timeout (NULL: LG_DIST_TIMEOUT; lg_comm_create_global takes it
   too); then its communicators are aborted (ncclCommAbort) and the process ends with a line
   naming its rank and the collective (its settings spelled by launch->speller). MPI groups
   take theirs from lg_mpi_comm_create; CPU builds: nothing. */
void lg_comm_watch(lg_comm *comm, const char *name, const struct lg_launch *launch);
int lg_comm_split(lg_comm *parent, const int *color, const int *key, lg_comm **by_color,
                  lg_error *err);
/* CPU ranks in several processes (an MPI build without CUDA): the group of `members` ranks
   first + m stride (m < members) spread over several processes, of which this one drives
   `local` consecutive members from member first_local (local 0: none; *comm stays NULL).
   Every process calls it for every such group in the same order. lg_comm_free frees it.
   A sum passes through `scratch`, LG_MPI_SCRATCH_BYTES of the plan (the region `buffers` of
   the group's first member in this process: lg_mpi_group_region). No collective waits longer
   than timeout_s: then the group's first process names the processes that did not arrive
   (hung or stopped) and every process ends by MPI_Abort (the others a little later, in case
   the first is the one that hangs). */
#define LG_MPI_CHUNK (1 << 20) /* doubles a sum moves at once */
#define LG_MPI_SCRATCH_BYTES (2 * (size_t)LG_MPI_CHUNK * sizeof(double)) /* send, receive */
typedef struct {
    const char *name;       /* "shard group 0", ...: what the timeout's line names */
    int members, first_local, local;
    void *scratch;
    const struct lg_launch *launch; /* its dist_timeout, and the speller of the time-out's
                                       line (NULL: LG_DIST_TIMEOUT, the settings' names) */
    int ranks_per_process;  /* to name the ranks of a late process */
} lg_mpi_group;
/* Host numbers over all processes, through a group of every rank (NULL: one process, nothing
   to do): values = their sum over processes, in double; */
void lg_comm_sum_doubles(lg_comm *comm, double *values, int count);
/* values (processes, per_process): each process fills its own block, then holds everyone's. */
void lg_comm_gather_doubles(lg_comm *comm, double *values, int per_process);

/* GPUs visible to a CUDA build (0 in a CPU build). */
int lg_cuda_device_count(void);
/* The backend this build runs: CUDA when it is a CUDA build and a GPU is visible. */
lg_backend lg_backend_in_use(void);
/* CUDA builds (the others return an error): what the CUDA context (with other processes'
   memory), cuBLASLt and `communicators` NCCL communicators take on GPUs 0..devices-1, the
   most of any GPU, and the smallest GPU's total memory; */
int lg_cuda_measure_runtime(int devices, int communicators, size_t *runtime_bytes,
                            size_t *total_bytes, lg_error *err);
/* a GPU's free and total memory; */
int lg_cuda_memory(int device, size_t *free_bytes, size_t *total_bytes, lg_error *err);
/* the peer access between GPUs 0..devices-1 as a table on out; 1 when every pair is direct. */
int lg_cuda_report_topology(int devices, FILE *out);

/* Processes. Without a launcher one process drives every rank. Under one (mpirun, srun,
   torchrun) each of `processes` processes drives `local_ranks` consecutive ranks, from
   first_rank: one each (a process per GPU or CPU rank), or `devices` each (a process per node).
   lg_launch_from_env reads the launcher's variables, the first that is set in this order:
     torchrun      TORCHELASTIC_RUN_ID with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
                   GROUP_RANK (the node)
     Slurm (srun)  SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID
     Open MPI      OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
     MPICH (Hydra) PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS
   (the node, where not given: process / processes on a node). A builds with MPI then joins
   MPI_COMM_WORLD (lg_launch_start) and checks that MPI sees the same world. */
typedef struct lg_launch {
    const char *launcher;  /* "torchrun", "Slurm", "Open MPI", "MPICH", or NULL: none */
    int process, processes;             /* this process among all; 0 of 1 without a launcher */
    int local_process, local_processes; /* among those on its node (local_processes 0: the
                                           launcher does not say) */
    int node;
    int first_rank, local_ranks;        /* the ranks it drives (lg_launch_place) */
    int mpi;                            /* 1 once it joined MPI_COMM_WORLD (lg_launch_start) */
    /* GPU processes without MPI: where they meet (tcp://HOST:PORT or file://PATH; default
       tcp://MASTER_ADDR:MASTER_PORT+1, torchrun's port being its own) and how long a process
       waits for the others there, in seconds */
    char dist_init[512];
    double dist_timeout;
    /* the lines the library prints itself as a process stops on a deadline name settings
       (dist_timeout): a driver with flags spells them (lg_spell_settings); NULL: the names */
    lg_setting_speller *speller;
    void *speller_context;
} lg_launch;
#define LG_DIST_TIMEOUT 600.0 /* seconds: PyTorch's default for NCCL process groups (10 minutes since
                                 pytorch/pytorch#110947); a large cluster's processes may start
                                 minutes apart */

/* Reads the environment (no launcher: one process of 1); a variable that is not a number, or
   a rank outside its world, is an error naming it. */
int lg_launch_from_env(lg_launch *launch, lg_error *err);
/* Which ranks this process drives, for devices x nodes ranks: processes = devices x nodes
   (one rank each) or = nodes (devices each); else an error naming the numbers. */
int lg_launch_place(lg_launch *launch, int devices, int nodes, lg_error *err);
/* Several processes started by an MPI launcher (not torchrun) in an MPI build: MPI_Init, and
   MPI's world must be the launcher's (a launcher and an MPI library that do not match make
   every process rank 0). Nothing to do otherwise. MPI_Init waits for every process: one that
   exited before it (or never started) would hold the others there for ever, so a process
   still there after launch->dist_timeout says so on stderr and exits 2 (the launcher then ends
   the job). lg_launch_finish: MPI_Finalize when started. */
int lg_launch_start(lg_launch *launch, lg_error *err);
void lg_launch_finish(lg_launch *launch);
/* Exits with `code` where every process exits alike (--plan, --help, after lg_launch_same):
   MPI_Finalize first when this process joined MPI, so that the launcher sees a clean end. */
void lg_launch_exit(int code);
/* Every process compares its n items (flags, data) with process 0's; the first that differs
   anywhere is an error on every process naming the process, the item and both values. Without
   MPI (the CUDA build) process 0's items reach the others through a rendezvous next to
   dist_init's (tcp://HOST:PORT+1 or file://PATH.check), and a process that differs names the
   item and both values (the launcher then stops the others, or they stop at the next
   rendezvous's deadline). */
int lg_launch_same(const lg_launch *launch, const char *const *items, int n, lg_error *err);
/* Stops every process at once with `code` when this one joined MPI (MPI_Abort: the launcher
   ends the others and names this one), else exits with it. */
void lg_launch_abort(int code);
/* GPU ranks in several processes without MPI: process 0's NCCL id (id_bytes) reaches every
   process through `init`:
     tcp://HOST:PORT  process 0 listens on PORT; the others connect to HOST (retrying), say who
                      they are, and receive the id once all have come
     file://PATH      on a file system every process sees: each process p > 0 announces itself
                      in PATH.p with a fresh random nonce; process 0 removes what an earlier
                      run left, and once all have announced writes PATH (atomically) with the id
                      and their nonces: a PATH from an earlier run holds other nonces and is
                      never read as current
   Every process gives up after timeout_s seconds with an error naming whom it waited for
   (process 0: the processes that did not come). TCP needs POSIX 2001 (getaddrinfo: define
   _POSIX_C_SOURCE 200809L before any #include, as train.c does; C++ has it). */
int lg_rendezvous(const char *init, int process, int processes, void *id, size_t id_bytes,
                  double timeout_s, lg_error *err);

/* ---------------------------------------------------------------------------------------------
   12. data (API)
   ------------------------------------------------------------------------------------------- */

#define LG_SHARD_HEADER_INTS 256
#define LG_SHARD_MAGIC_U16 20240520 /* llm.c, version 1: uint16 tokens */
#define LG_SHARD_VERSION_U16 1
#define LG_SHARD_MAGIC_U32 20240801 /* llm.c's Llama-3 variant, version 7: uint32 tokens */
#define LG_SHARD_VERSION_U32 7

/* Fine-tuning samples (tools/prepare): a header of 256 int32 (magic, version, number of
   samples, bytes per token 2 or 4, prompt masking 0 or 1, the rest 0), then per sample two
   little-endian uint32 (its tokens n, its prompt tokens p <= n) and its n tokens. A loader
   opened on such a file yields one sample per row, truncated to T tokens (T 0: none),
   right-padded to the longest sample of the micro-batch. A sample of n tokens gives n
   positions, as in LitGPT: inputs are its tokens, targets its tokens shifted by one; the last
   target, padding and (when the file asks for masking) targets inside the prompt are
   LG_IGNORE_INDEX. Prompt masking 2 (chat conversations, tools/prepare chat): tokens are 4
   bytes and bit LG_SAMPLES_TRAINED_BIT of a token marks it trained (its target is kept); p
   is 0. */
#define LG_SAMPLES_MAGIC 20250612
#define LG_SAMPLES_MASK_TOKENS 2
#define LG_SAMPLES_TRAINED_BIT 31
#define LG_SAMPLES_TOKEN_BITS 0x7FFFFFFFu
#define LG_SAMPLES_VERSION 1
/* Both kinds of file record the tokenizer that made them (tools/prepare): header ints 8 and 9
   hold the low and high 32 bits of its files_hash (lg_tokenizer); both 0 in older files and
   those written without a tokenizer, which nothing checks. */
#define LG_DATA_TOKENIZER_AT 8

/* A stream of tokens cut into windows of T + 1 (inputs and the targets shifted by one), either
   a token shard read on demand or tokens held in memory; or fine-tuning samples held in
   memory, one a row, truncated to T (then n_samples > 0 and a "window" is a sample). */
typedef struct {
    char path[512];            /* the file, or "(built-in)" */
    FILE *file;                /* NULL when in memory */
    int token_bytes;           /* 2 or 4 */
    uint32_t *memory;          /* (n_tokens) when in memory */
    size_t n_tokens;
    int vocab_size;            /* tokens must be below it (the model's padded vocabulary) */
    uint32_t max_token;        /* the largest token of the file (0 for the built-in task) */
    int T;                     /* window length */
    size_t n_windows;          /* (n_tokens - 1) / T */
    size_t *order;             /* (n_windows): the shuffled order of this epoch; NULL: file order */
    size_t position;           /* next window in the order */
    int epoch;
    lg_rng rng;
    uint32_t *scratch;         /* (T + 1) */
    size_t n_samples;          /* fine-tuning samples; 0 for a token stream */
    size_t *sample_start;      /* (n_samples): where each sample's tokens start in memory */
    uint32_t *sample_length;   /* (n_samples): its tokens, before truncation */
    uint32_t *prompt_length;   /* (n_samples): its prompt's tokens */
    int mask_prompt;           /* 1: targets inside the prompt are LG_IGNORE_INDEX */
    uint64_t file_bytes;       /* the data's identity, recorded in LG_RUN_SETTINGS: the file's */
    uint64_t file_hash;        /* bytes and their lg_hash64 (in memory: of the tokens) */
    uint64_t tokenizer_hash;   /* the files_hash of the tokenizer that made the file; 0: not
                                  recorded */
} lg_loader;

/* Opens a shard or a sample file: checks magic, version, sizes and lengths; names the file
   (and the sample) when wrong. For a sample file T truncates each sample (0: none) and
   becomes the longest truncated sample. */
int lg_loader_open(lg_loader *ld, const char *path, int T, int vocab_size, int shuffle,
                   uint64_t seed, lg_error *err);
/* Takes ownership of tokens (allocated with LG_MALLOC). */
int lg_loader_from_memory(lg_loader *ld, uint32_t *tokens, size_t n_tokens, int T,
                          int vocab_size, int shuffle, uint64_t seed, lg_error *err);
/* Fills inputs and targets (B, T) with the next B windows (samples: padded to T); reshuffles
   at each new epoch. */
int lg_loader_next(lg_loader *ld, int B, int *inputs, int *targets, lg_error *err);
void lg_loader_rewind(lg_loader *ld); /* back to the first window (validation) */
void lg_loader_close(lg_loader *ld);
/* Writes a shard (used by tools and tests). token_bytes 2 or 4. */
int lg_shard_write(const char *path, const uint32_t *tokens, size_t n, int token_bytes,
                   lg_error *err);

/* Records in the header of the shard or sample file at path the files_hash of the tokenizer
   that made it (LG_DATA_TOKENIZER_AT). */
int lg_data_record_tokenizer(const char *path, uint64_t tokenizer_hash, lg_error *err);

/* The built-in task: sort the letters of a word, "dcab=abcd\n". Samples have 1 to
   LG_BUILTIN_MAX_LETTERS letters, so their lengths differ. Returns the token stream
   (LG_MALLOC) of concatenated samples with at least min_tokens tokens. */
#define LG_BUILTIN_MAX_LETTERS 8
uint32_t *lg_builtin_task_tokens(uint64_t seed, size_t min_tokens, size_t *n_tokens);

/* One micro-batch of B rows: windows of ld->T, or samples right-padded to the longest one of
   the batch. Writes the batch's row length to *T_batch (<= ld->T); inputs and targets are
   (B, *T_batch), packed. */
int lg_loader_next_batch(lg_loader *ld, int B, int *inputs, int *targets, int *T_batch,
                         lg_error *err);
/* 1 when path is a fine-tuning sample file (by its magic), else 0. */
int lg_samples_file(const char *path);
/* Sample packing: B rows of T tokens (T >= the longest sample), each filled first-fit with the
   next samples of the (shuffled) order; a sample that fits no row waits for the next call.
   inputs, targets (B, T) as lg_samples' rows (prompt masks kept, each sample's last target
   ignored, padding ignored); span_start (B, T): the row position where the token's sample
   starts (padding: its own position). *n_packed gets the samples placed. Shards are refused. */
int lg_loader_next_packed(lg_loader *ld, int B, int T, int *inputs, int *targets,
                          int *span_start, int *n_packed, lg_error *err);
/* What --pack gains on one epoch of a sample set, in the loader's order: micro-batches of B
   rows of T packed as lg_loader_next_packed packs them, against one sample a row padded to the
   longest of its micro-batch (lg_loader_next_batch). */
typedef struct {
    double samples_per_row;  /* packed: samples a row holds on average */
    double padding_packed;   /* the share of the packed rows' tokens that are padding */
    double padding_unpacked; /* the same, one sample a row */
} lg_packing_stats;
void lg_loader_packing_stats(const lg_loader *ld, int B, int T, lg_packing_stats *stats);
/* Fine-tuning samples: the tokens of the longest sample after truncation (0 for a shard). */
int lg_loader_longest(const lg_loader *ld);
/* Fine-tuning samples: the shortest truncation at which some sample keeps a trained target
   (one that neither its prompt's mask nor its end ignores), 0 when none has one at any length
   (and for a shard, whose windows all train). At a T below it nothing would be trained. */
int lg_loader_shortest_trained(const lg_loader *ld);
/* Fails naming the file, the first sample (index from 0) longer than block_size after
   truncation, its length and the limit. */
int lg_loader_check_block_size(const lg_loader *ld, int block_size, lg_error *err);
/* Writes a sample file: lengths[i] tokens of sample i follow each other in tokens.
   mask_prompt LG_SAMPLES_MASK_TOKENS: tokens carry the trained bit, token_bytes is 4. */
int lg_samples_write(const char *path, const uint32_t *tokens, const uint32_t *lengths,
                     const uint32_t *prompt_lengths, size_t n_samples, int token_bytes,
                     int mask_prompt, lg_error *err);

/* The built-in task as a fine-tuning set: n_samples in memory, prompt "letters=" masked, so
   padding and -t truncation are exercised by ./train with no arguments. T as lg_loader_open. */
int lg_builtin_task_samples(lg_loader *ld, uint64_t seed, size_t n_samples, int T, int shuffle,
                            uint64_t shuffle_seed, lg_error *err);
/* One sample of the built-in task as text: "dcab" and "abcd" (for tools/prepare builtin). */
void lg_builtin_task_text(lg_rng *rng, char *letters, char *sorted);

/* A JSON reader for tokenizer files, Alpaca data, safetensors headers and Hugging Face
   config.json: the whole document becomes a flat array of nodes; strings are decoded on
   request. Depth is limited to LG_JSON_MAX_DEPTH. */
#define LG_JSON_MAX_DEPTH 64
typedef enum { LG_JSON_NULL, LG_JSON_FALSE, LG_JSON_TRUE, LG_JSON_NUMBER, LG_JSON_STRING,
               LG_JSON_ARRAY, LG_JSON_OBJECT } lg_json_kind;
typedef struct {
    lg_json_kind kind;
    int first_child;   /* arrays: first element; objects: first key (keys and values
                          alternate); -1 when empty or not a container */
    int next;          /* the next sibling in the parent; -1 for the last */
    size_t start, end; /* the value's bytes in the text; a string's without its quotes */
} lg_json_node;
typedef struct {
    const char *text;    /* the document (not owned; must outlive the nodes) */
    lg_json_node *nodes; /* (n_nodes) in document order; node 0 is the root */
    int n_nodes, cap;
} lg_json;

/* source names the document in messages ("data/alpaca.json line 3"). */
int lg_json_parse(lg_json *doc, const char *text, size_t len, const char *source, lg_error *err);
/* An object's value under key (a plain ASCII key), or -1. */
int lg_json_find(const lg_json *doc, int object, const char *key);
/* A string node decoded to UTF-8 (LG_MALLOC, NUL-terminated, *len bytes); NULL if not a string. */
char *lg_json_string(const lg_json *doc, int node, size_t *len);
/* A string node decoded into out (cap bytes, NUL-terminated); -1 (out "") when it is not a
   string, does not fit or holds a NUL. */
int lg_json_string_copy(const lg_json *doc, int node, char *out, size_t cap);
/* A number node as an integer; -1 with no change to *value when not an integer. */
int lg_json_int(const lg_json *doc, int node, long *value);
/* A number node as a double; -1 with no change to *value when not a finite number. */
int lg_json_double(const lg_json *doc, int node, double *value);
/* An array's elements or an object's members (key and value count as one); 0 for others. */
int lg_json_count(const lg_json *doc, int node);
void lg_json_free(lg_json *doc);
/* Reads a whole file (LG_MALLOC, NUL-terminated); what names it in the message. */
char *lg_read_file(const char *path, size_t *len, const char *what, lg_error *err);

typedef struct { int *ids; size_t n, cap; } lg_tokens; /* growing list of ids (LG_MALLOC) */
typedef struct { char *bytes; size_t n, cap; } lg_text; /* growing bytes, NUL-terminated */

/* Alpaca-style fine-tuning data: a JSON array of objects, or JSON lines, each with
   "instruction", optional "input" and "output" strings. */
typedef struct {
    char *instruction;  /* UTF-8 (LG_MALLOC) */
    char *input;        /* "" when absent */
    char *output;
} lg_alpaca_sample;
typedef struct {
    lg_alpaca_sample *samples; /* (n) */
    size_t n;
} lg_alpaca;

/* Reads path; fails naming the file, the sample (from 0) and the field at fault. */
int lg_alpaca_read(lg_alpaca *set, const char *path, lg_error *err);
void lg_alpaca_free(lg_alpaca *set);
/* Appends the Alpaca prompt of a sample (everything before the response) to out. */
int lg_alpaca_prompt(const lg_alpaca_sample *sample, lg_text *out);


/* ---------------------------------------------------------------------------------------------
   11. tokenizer (API): byte-level BPE, SentencePiece-style BPE, the built-in characters
   ------------------------------------------------------------------------------------------- */

/* How text is cut into words before BPE: the regular expressions of GPT-2, Llama 3 and Qwen2
   (written out as code, with Unicode letter and number tables), or none (SentencePiece). */
typedef enum { LG_PRETOKENIZE_GPT2, LG_PRETOKENIZE_LLAMA3, LG_PRETOKENIZE_QWEN2,
               LG_PRETOKENIZE_NONE } lg_pretokenizer;

/* What tokenizer.json's "normalizer" does to each piece of text between special tokens, in
   order: NFC, NFKC (Unicode data: litgpt_unicode.h), Lowercase, Replace (every occurrence of a
   string), Prepend (to a piece the start or a special token begins); a Sequence is its steps.
   Any other normalizer is refused by name when the file is loaded. */
typedef enum { LG_NORMALIZE_NFC, LG_NORMALIZE_NFKC, LG_NORMALIZE_LOWERCASE, LG_NORMALIZE_REPLACE,
               LG_NORMALIZE_PREPEND } lg_normalize_kind;
#define LG_NORMALIZE_MAX_STEPS 8
typedef struct {
    lg_normalize_kind kind;
    char text[2][16]; /* Replace: text[0] becomes text[1]; Prepend: text[0] */
} lg_normalize_step;


/* A BPE tokenizer loaded from a directory with GPT-2's encoder.json and vocab.bpe, or from a
   Hugging Face tokenizer.json (model BPE: byte-level, or SentencePiece-style with byte
   fallback). */
typedef struct {
    char path[512];          /* where it came from, for messages */
    int vocab_size;          /* V: ids 0 .. V-1 (the largest id + 1) */
    char *pieces;            /* every token's text, concatenated: raw bytes for byte-level
                                vocabularies, the vocabulary's UTF-8 (with U+2581) for
                                SentencePiece */
    size_t *piece_start;     /* (V + 1): token i is pieces[piece_start[i] .. piece_start[i+1]) */
    int *piece_table;        /* (piece_slots): hash of piece -> id, open addressing, -1 empty */
    size_t piece_slots;      /* a power of two, at least twice V */
    uint64_t *merge_pair;    /* (merge_slots): left id << 32 | right id; UINT64_MAX empty */
    int *merge_rank;         /* (merge_slots): line of the merge in the list; lower goes first */
    int *merge_result;       /* (merge_slots): the id of the merged token */
    size_t merge_slots;      /* a power of two, at least twice the merges */
    int n_merges;
    int byte_token[256];     /* byte-level: the id of each single byte; SentencePiece: of its
                                <0xXX> fallback token; -1 when none */
    lg_pretokenizer pretokenizer;
    lg_normalize_step normalize[LG_NORMALIZE_MAX_STEPS]; /* (n_normalize) */
    int n_normalize;
    int sentencepiece;       /* 1: spaces are U+2581, a U+2581 is prepended, merges start
                                from characters, unknown characters fall back to bytes */
    int ignore_merges;       /* a word that is itself a token is not split (Llama 3) */
    int js_whitespace;       /* \s as JavaScript has it (GPT-2's files, checked against the
                                JS reference) rather than Unicode White_Space */
    int *special;            /* (n_special): added tokens matched verbatim before BPE */
    int n_special;
    int bos, eos, pad;       /* special ids named by the files; -1 when none */
    uint64_t files_hash;     /* lg_hash64 of its files' bytes (tokenizer.json; encoder.json then
                                vocab.bpe): which tokenizer made a data file */
} lg_tokenizer;

/* path: a directory holding encoder.json + vocab.bpe or tokenizer.json, or a tokenizer.json. */
int lg_tokenizer_load(lg_tokenizer *tok, const char *path, lg_error *err);
void lg_tokenizer_free(lg_tokenizer *tok);
/* Appends the ids of len bytes of UTF-8 text to out (invalid UTF-8 is encoded byte by byte). */
int lg_tokenizer_encode(const lg_tokenizer *tok, const char *text, size_t len, lg_tokens *out,
                        lg_error *err);
/* Appends the bytes of the ids to out; fails on an id outside the vocabulary. */
int lg_tokenizer_decode(const lg_tokenizer *tok, const int *ids, size_t n, lg_text *out,
                        lg_error *err);
/* The id every sequence starts with, a training sample's (tools/prepare alpaca) as a prompt's
   (tools/prepare encode --bos, tools/generate --prompt, the chat templates): the tokenizer's
   BOS when it has one apart from EOS (Llama 2 and 3), else -1 (GPT-2's <|endoftext|> is both). */
int lg_tokenizer_start_id(const lg_tokenizer *tok);
/* The id of a token given by its text in the vocabulary's form, or -1. */
int lg_tokenizer_find(const lg_tokenizer *tok, const char *piece, size_t len);
int lg_tokens_push(lg_tokens *list, int id);  /* -1 when out of memory */
int lg_text_append(lg_text *text, const char *bytes, size_t n);
void lg_tokens_free(lg_tokens *list);
void lg_text_free(lg_text *text);

/* Fails naming the data file and tok when the file records another tokenizer than tok (its
   ids would mean other text to the model); passes a file that records none. */
int lg_loader_check_tokenizer(const lg_loader *ld, const lg_tokenizer *tok, lg_error *err);

/* The built-in task's characters. */

#define LG_CHAR_VOCAB 28 /* '\n', '=', 'a'..'z' */
int lg_char_encode(const char *text, int *tokens, int max_tokens); /* -1 on a foreign char */
char lg_char_decode(int token);

/* 12. data (API, continued): chat conversations and their templates, which need the
   tokenizer above. */
/* Chat conversations: a JSON array of objects, or JSON lines, each with "messages" (a list of
   {"role", "content"}, roles system, user, assistant) or ShareGPT's "conversations" (a list of
   {"from", "value"}, from system, human or user, gpt or assistant). */
typedef enum { LG_ROLE_SYSTEM, LG_ROLE_USER, LG_ROLE_ASSISTANT } lg_chat_role;
typedef struct {
    lg_chat_role role;
    char *content; /* UTF-8 (LG_MALLOC) */
} lg_chat_turn;
typedef struct {
    lg_chat_turn *turns; /* (n) */
    int n;
} lg_chat;
typedef struct {
    lg_chat *chats; /* (n) */
    size_t n;
} lg_chat_set;

/* Reads path; fails naming the file, the record (from 0), the turn and what is wrong (an
   unknown role, an empty assistant turn, no assistant turn, malformed JSON). */
int lg_chat_read(lg_chat_set *set, const char *path, lg_error *err);
/* The same from text in memory; path names it in messages. */
int lg_chat_parse(lg_chat_set *set, const char *text, size_t len, const char *path,
                  lg_error *err);
void lg_chat_free(lg_chat_set *set);

/* Chat templates, written from each model's published format: plain (the built-in task's
   "prompt=answer\n"), alpaca (single turns), llama3 (Llama 3 / 3.1), llama2 ([INST],
   <<SYS>>), chatml (Qwen2/2.5, SmolLM2, without a default system prompt), qwen3 (ChatML with
   the empty think block on the last assistant turn), falcon (User: / Falcon:). */
typedef enum { LG_TEMPLATE_PLAIN, LG_TEMPLATE_ALPACA, LG_TEMPLATE_LLAMA3, LG_TEMPLATE_LLAMA2,
               LG_TEMPLATE_CHATML, LG_TEMPLATE_QWEN3, LG_TEMPLATE_FALCON,
               LG_TEMPLATE_COUNT } lg_chat_template;
#define LG_TEMPLATE_NAMES {"plain", "alpaca", "llama3", "llama2", "chatml", "qwen3", "falcon"}
/* -1 naming the template and the known ones when there is none by that name. */
int lg_chat_template_find(const char *name, lg_chat_template *out, lg_error *err);
const char *lg_chat_template_name(lg_chat_template t);
/* The template named (auto: lg_chat_template_auto's) for tok, refused, naming the template,
   the markers and the tokenizer, when a marker it writes (<|im_start|>, <|start_header_id|>,
   ...) is not one of tok's special tokens: it would be written as ordinary BPE pieces, the
   model would learn to spell it and no stop check would see it. tools/prepare chat and
   tools/generate --chat both pick their template here. */
int lg_chat_template_pick(const char *name, const lg_tokenizer *tok, lg_chat_template *out,
                          lg_error *err);

/* A rendered conversation: its text and the byte ranges trained (each assistant turn's
   content and its end-of-turn), span[2k] .. span[2k+1]. */
typedef struct {
    lg_text text;
    size_t *span; /* (2 n_spans) */
    int n_spans, cap;
} lg_chat_rendered;
/* Renders chat with template t (tok: its BOS and EOS text where the template uses the
   tokenizer's; NULL for none). generation_prompt: ends with the assistant's header, as a
   prompt for generation. out is emptied first. */
int lg_chat_render(lg_chat_template t, const lg_chat *chat, const lg_tokenizer *tok,
                   int generation_prompt, lg_chat_rendered *out, lg_error *err);
void lg_chat_rendered_free(lg_chat_rendered *r);
/* The ids of the whole rendered text appended to ids, and 1 or 0 for each to trained (1
   inside a span). Fails, naming where, when a span's edge is not a token edge (the span
   tokenized alone differs from the whole text's ids). */
int lg_chat_tokenize(const lg_tokenizer *tok, const lg_chat_rendered *r, lg_tokens *ids,
                     lg_tokens *trained, const char *where, lg_error *err);

/* ---------------------------------------------------------------------------------------------
   13 and 15. model files and run checkpoints (API)

   A checkpoint is a directory DIR/step-N written by lg_checkpoint_save:
     model.safetensors            the weights in the Hugging Face layout of the model's family
                                  (GPT2LMHeadModel, GPTNeoXForCausalLM, LlamaForCausalLM or
                                  Qwen2ForCausalLM), in the run's weight dtype (F32, BF16, F16)
     config.json                  the Hugging Face config of that family
     model_config.yaml            the lg_config, LitGPT field names
     training_state.safetensors   what resuming needs beyond the weights, in logical layout
                                  (whole tensors by LitGPT parameter name): "master.NAME" (fp32
                                  master weights), "optimizer.m.NAME", "optimizer.v.NAME", ...
                                  as stored (fp32, bf16, fp16 or 8-bit codes with
                                  "optimizer.m.scales.NAME"), "loader.order"; step, optimizer
                                  step count, loss scale, clean steps and the loader's position
                                  and random state in the header's __metadata__
     run_settings.txt             the run's settings, one "key value" line each, and for LoRA
                                  where the frozen base came from and its hash
                                  (LG_RUN_SETTINGS): what --resume takes
     COMPLETE                     written last: each file's name, size and 64-bit FNV-1a hash
   Every file goes to NAME.tmp, is flushed with fsync and renamed; the directory is synced after
   each rename. A directory without COMPLETE, or whose files differ from it, is refused.
   ------------------------------------------------------------------------------------------- */

/* safetensors: an 8-byte little-endian header length, a JSON header giving each tensor's
   dtype, shape and [begin, end) byte range within the data that follows, then the data. */
typedef enum { LG_ST_F32, LG_ST_BF16, LG_ST_F16, LG_ST_U8, LG_ST_I64 } lg_st_dtype;
#define LG_ST_MAX_NAME 128
#define LG_ST_MAX_DIMS 4
#define LG_ST_MAX_HEADER 100000000 /* the format's limit on the JSON header */

typedef struct {
    char name[LG_ST_MAX_NAME];      /* e.g. model.layers.0.self_attn.q_proj.weight */
    lg_st_dtype dtype;
    int ndim;                       /* 0..LG_ST_MAX_DIMS */
    int64_t shape[LG_ST_MAX_DIMS];  /* (ndim) */
    uint64_t begin, end;            /* bytes within the data section */
} lg_st_tensor;

typedef struct {
    char key[64];     /* a __metadata__ entry: string to string */
    char value[128];
} lg_st_meta;

/* An open safetensors file whose header has been read and checked. */
typedef struct {
    char path[1024];
    FILE *file;
    uint64_t data_start;      /* 8 + header length: where the data section begins */
    uint64_t file_bytes;
    lg_st_tensor *tensors;    /* (n_tensors), in header order */
    int n_tensors;
    lg_st_meta *meta;         /* (n_meta) */
    int n_meta;
} lg_st_file;

/* Opens and checks: magic length, JSON syntax, dtypes, shapes, every byte range inside the
   file, ranges that neither overlap nor leave gaps, unique names. Errors name the file. */
int lg_st_open(lg_st_file *f, const char *path, lg_error *err);
const lg_st_tensor *lg_st_find(const lg_st_file *f, const char *name);
const char *lg_st_meta_get(const lg_st_file *f, const char *key); /* NULL when absent */
/* Reads a tensor's bytes (t->end - t->begin of them) into out. */
int lg_st_read(const lg_st_file *f, const lg_st_tensor *t, void *out, lg_error *err);
void lg_st_close(lg_st_file *f);
const char *lg_st_dtype_name(lg_st_dtype dtype);
uint64_t lg_st_count(const lg_st_tensor *t); /* elements */

/* Size and hash of a file as written (or read back). */
typedef struct {
    uint64_t bytes;
    uint64_t hash;   /* 64-bit FNV-1a of every byte */
} lg_file_digest;

/* Fills tensor `index`'s bytes (its end - begin) on request of lg_st_write. */
typedef int (*lg_st_fill_fn)(void *ctx, int index, unsigned char *out, lg_error *err);
/* Writes path atomically: assigns tensors[i].begin/end in order, writes path.tmp, fsyncs,
   renames. digest (may be NULL) gets the size and hash of what was written. */
int lg_st_write(const char *path, lg_st_tensor *tensors, int n, const lg_st_meta *meta,
                int n_meta, lg_st_fill_fn fill, void *ctx, lg_file_digest *digest,
                lg_error *err);

/* Hugging Face layouts. */
typedef enum { LG_HF_GPT2, LG_HF_GPTNEOX, LG_HF_LLAMA, LG_HF_QWEN2, LG_HF_FALCON } lg_hf_family;
/* The family whose layout holds this architecture; -1 naming what none of them has. */
int lg_hf_family_of(const lg_config *cfg, lg_hf_family *family, lg_error *err);
/* DIR/config.json -> cfg (vocab_size = padded_vocab_size = the file's vocab_size; when DIR
   also holds a model_config.yaml that agrees, its vocab_size and name). Unknown
   architectures and unsupported settings (a rope_scaling or rope_parameters other than Llama
   3.1's, Falcon's new_decoder_architecture or alibi) are errors that name them. */
int lg_hf_config_read(lg_config *cfg, const char *dir, lg_error *err);
/* Loads DIR's weights (model.safetensors, or the shards of model.safetensors.index.json)
   into dest, laid out by lg_params_layout(cfg): names, layouts and dtypes converted. When
   DIR has a COMPLETE marker every file is verified first. */
int lg_hf_load_weights(const lg_config *cfg, lg_buf dest, const char *dir, lg_error *err);
/* Writes DIR (created if needed) with model.safetensors in the weights' dtype, config.json,
   model_config.yaml and COMPLETE: a model alone, loadable by lg_hf_load_weights. */
int lg_hf_save(const lg_model *m, const char *dir, lg_error *err);
/* LitGPT's flat model_config.yaml of cfg into buf; returns the length. */
size_t lg_config_to_yaml(const lg_config *cfg, char *buf, size_t cap);

/* Checkpoints of a training run. */
typedef struct lg_trainer lg_trainer; /* 14. trainer */
#define LG_CHECKPOINT_MARKER "COMPLETE"
#define LG_TRAINING_STATE "training_state.safetensors"
/* The tokenizer files a step-N directory carries when the trainer's tokenizer_dir has them,
   and the generation settings (generation_config.json: the eos ids generation stops at; made
   from the directory's config.json eos_token_id and bos_token_id when it has none). */
#define LG_TOKENIZER_FILES {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", \
                            "encoder.json", "vocab.bpe", "chat_template.jinja", \
                            "generation_config.json"}
#define LG_N_TOKENIZER_FILES 7

/* Checks DIR/COMPLETE and each file it lists: present, of its size, of its hash. *step (may
   be NULL) gets the step it records. */
int lg_checkpoint_verify(const char *dir, int *step, lg_error *err);
/* DIR itself when it holds a complete checkpoint, else its complete step-N with the largest
   N (incomplete ones are skipped); path into found. */
int lg_checkpoint_find(const char *dir, char *found, size_t cap, lg_error *err);
/* Writes OUT/step-N (N = steps done) for the trainer and its training data. */
int lg_checkpoint_save(lg_trainer *tr, const lg_loader *data, int step, const char *out,
                       lg_error *err);
/* Whether the trainer's state can be written in the whole layout (see lg_whole_state). */
int lg_checkpoint_supported(const lg_trainer *tr, lg_error *err);
/* Restores a trainer made with the run's arguments and a freshly opened loader from a
   checkpoint directory (verified first); *step gets the steps done. */
int lg_checkpoint_resume(lg_trainer *tr, lg_loader *data, const char *dir, int *step,
                         lg_error *err);
/* --load: the weights of a Hugging Face directory into a trainer (master weights in fp32 from
   the file when the precision keeps them, the working copy rounded from those). */
int lg_trainer_load_hf(lg_trainer *tr, const char *dir, lg_error *err);

/* LG_RUN_SETTINGS in every step-N: the run's settings, one "key value" line each (the keys
   are lg_args' field names: micro_batch_size, lr, lora.r, ...; floats exact to the bit; the
   driver's settings as lg_args.driver_value gives them: config, data, prompt, ...), and
   for LoRA where the frozen base came from ("base_model load DIR", or "base_model random"
   for one drawn from the config and seed) and "base_hash" of the base as the run held it;
   "data_bytes" and "data_hash": the training data's identity (lg_loader's file_bytes,
   file_hash). A resumed run takes its settings from here; lg_checkpoint_resume refuses a LoRA
   checkpoint whose base_hash is missing or is not the trainer's base's, and
   lg_checkpoint_same_data data that is not the run's. */
#define LG_RUN_SETTINGS "run_settings.txt"
/* the lines kept as text for the driver: its settings (lg_args.driver_value) and out_dir, the
   directory the checkpoint was saved under (lg_checkpoint_save's out) */
#define LG_RUN_DRIVER_FIELDS 12
typedef struct {
    lg_args args;          /* the run's settings */
    char driver_text[LG_RUN_DRIVER_FIELDS][LG_PATH_MAX]; /* those lines, as written
                                                            (lg_run_settings_driver) */
    int driver_given[LG_RUN_DRIVER_FIELDS];     /* 1: the file has that line */
    int has_base;          /* LoRA: the file says where the base came from */
    int base_loaded;       /* 1: from base_dir (--load), 0: drawn from the config and seed */
    char base_text[LG_PATH_MAX];
    const char *base_dir;  /* into base_text */
    int has_base_hash;
    uint64_t base_hash;
    int has_data;          /* the training data's identity is recorded (data_bytes, data_hash) */
    uint64_t data_bytes, data_hash; /* lg_loader's file_bytes and file_hash as the run read them */
} lg_run_settings;
/* Reads DIR/LG_RUN_SETTINGS over lg_args_default, after verifying it against DIR/COMPLETE; 1
   when the checkpoint has none (written before the file existed), -1 naming the file and line
   when malformed, the file and field when a value is out of its range (lg_run_fields), or the
   settings that do not go together (lg_args_check). */
int lg_run_settings_read(const char *dir, lg_run_settings *s, lg_error *err);
/* The text of a driver's setting (key; or out_dir) as s's file has it ("": none); NULL when it
   has no such line (a checkpoint written before the setting was recorded). The driver parses
   and checks it. */
const char *lg_run_settings_driver(const lg_run_settings *s, const char *key);
/* The first setting (its key in LG_RUN_SETTINGS) in which `now` would change the model the
   run trains from `run`'s: shapes, LoRA, quantization, precision, optimizer and its state
   format, seed, global batch; NULL when none. Steps, the learning-rate schedule, optimizer
   hyperparameters, evaluation, sampling, outputs, data paths and the memory layout (ranks,
   strategy, micro-batch, recompute, offload) may change. */
const char *lg_args_resume_conflict(const lg_args *run, const lg_args *now);
/* 0 when data is the training data checkpoint dir's run read (its size and hash in
   LG_RUN_SETTINGS), or the checkpoint records none (written before it did); else -1 naming
   the data file, the checkpoint and both identities. A resume onto data that changed on
   purpose skips this check. */
int lg_checkpoint_same_data(const char *dir, const lg_loader *data, lg_error *err);
/* The training state in logical layout, whole tensors by name (see the top of this section),
   whatever the ranks: sharded trainers gather their pieces to write and take their pieces on
   reading, so a run resumes on any number of ranks. */
int lg_training_state_read(lg_trainer *tr, lg_loader *data, int *step, const char *path,
                           lg_error *err);

/* ---------------------------------------------------------------------------------------------
   14. trainer (API)
   ------------------------------------------------------------------------------------------- */

/* Mean loss over all target tokens of n_batches micro-batches of B windows (or samples) from
   the start. T: the longest row the model was made for. */
int lg_evaluate(lg_model *m, lg_loader *ld, int B, int T, int n_batches, double *mean_loss,
                lg_error *err);

#define LG_LOSS_SCALE_START 65536.0f /* 2^16 */
#define LG_LOSS_SCALE_WINDOW 2000

/* One rank of a trainer: its memory, its model, its optimizer over its shard, and views of its
   plan's token and communication regions. */
typedef struct {
    lg_rank rank;
    lg_model model;
    lg_optimizer opt;
    int *inputs;         /* (accumulation, B, T): the plan's tokens.inputs */
    int *targets;        /* (accumulation, B, T): tokens.targets */
    int *sampled;        /* (accumulation, B, T): Sophia's labels drawn from the model */
    int *spans;          /* (accumulation, B, T): --pack's span starts (tokens.spans), or NULL */
    int *micro_T;        /* (accumulation): tokens per row of each micro-batch of the step, <= T
                            (fine-tuning samples pad to the longest of their micro-batch);
                            micro-batch i sits packed (B, micro_T[i]) at i B T */
    /* --offload: the optimizer runs on host copies (the plan's host pool) */
    lg_buf host_grads;   /* (n_local): gradients.host */
    lg_buf host_weights; /* (n_local): weights.host; data NULL in the mixed precisions on the
                            CPU, whose master weights (in the host pool) play that part */
    /* sharded: whole units, padded to S pieces (lg_shard_layout) */
    lg_buf gather_ends;  /* (S piece_count[0]): the gathered ends */
    lg_buf gather_blocks;/* (block_slots, S piece_count[1]): gathered blocks (full-shard: one
                            computing, the next prefetched; shard-grad-op: 1 slot) */
    lg_buf grad_ends;    /* (S piece_count[0]): the ends' gradients until their reduce-scatter */
    lg_buf grad_blocks;  /* (LG_GRAD_BLOCK_SLOTS, S piece_count[1]): a block's gradients until
                            theirs */
    lg_buf reduce_out;   /* (largest piece): what one reduce-scatter hands this rank */
    /* LoRA's frozen base sharded (lg_frozen_sharded): whole frozen units in bytes, padded to
       S pieces (plan.frozen_shards), slotted as gather_ends and gather_blocks */
    lg_buf frozen_gather_ends;   /* (S piece_count[0]) bytes */
    lg_buf frozen_gather_blocks; /* (block_slots, S piece_count[1]) bytes */
} lg_trainer_rank;

/* Ranks (one per device, or simulated), each allocated from one plan, driven from one thread:
   every unit of the forward and backward runs on all ranks, with the collectives that the
   strategy needs in between. */
typedef struct lg_trainer {
    lg_plan plan;
    lg_args args;
    int n_ranks;               /* devices x nodes */
    /* the ranks this process drives: ranks[i] is rank first_rank + i (every rank without a
       launcher; lg_launch_place) */
    int first_rank, local_ranks;
    int process;               /* this process; 0 (whose files and output count) without one */
    lg_trainer_rank *ranks;    /* (local_ranks) */
    size_t step_tokens;        /* rows x their length of the step's micro-batches, all ranks */
    int *other_tokens;         /* (3, B, T): where the micro-batches of other processes' ranks
                                  are read (their targets counted) and dropped; NULL in one */
    int block_slots;           /* gather_blocks' slots: lg_gather_block_slots */
    int accumulation;          /* micro-batches per optimizer step and rank */
    /* GPUs: the NCCL communicators of shard group q (shard_comm[q], members q S + i), of
       replica group i (replica_comm[i], members q S + i) and of all ranks (weights broadcast
       at the start); NULL on the CPU and for groups of one */
    lg_comm *shard_comm[LG_MAX_RANKS];
    lg_comm *replica_comm[LG_MAX_RANKS];
    lg_comm *world_comm;
    /* CPU ranks in several processes: every rank's MPI group (the step's loss and norm,
       checkpoints); NULL in one process */
    lg_comm *process_comm;
    /* dynamic loss scaling (16-true, 16-mixed), as PyTorch's GradScaler: start at
       LG_LOSS_SCALE_START, halve and skip the step on an overflow, double after
       LG_LOSS_SCALE_WINDOW clean steps */
    int scaling;        /* 1 in the fp16 precisions */
    float loss_scale;   /* multiplies the loss before the backward */
    int clean_steps;    /* steps since the scale last changed */
    int scale_window;   /* clean steps before the scale doubles */
    char base_model[1024]; /* LoRA: the --load directory of the frozen model, or a note
                              that it was drawn at random: adapter_config.json's
                              base_model_name_or_path */
    int base_loaded;       /* LoRA: 1 the base came from --load (base_model), 0 drawn */
    lg_dtype base_dtype;   /* LoRA, base_loaded: the type of the base's files, which the merged
                              model is written in (else: the frozen weights' type) */
    int base_hashed;       /* base_hash holds the hash of the base as it is now */
    uint64_t base_hash;    /* LoRA: FNV-1a of rank 0's frozen base (its stored bytes) */
    char tokenizer_dir[LG_PATH_MAX]; /* a directory whose tokenizer files (LG_TOKENIZER_FILES) each
                              step-N directory gets a copy of, so that it is self-contained
                              for generation and export (train.c: --load DIR); "" none */
} lg_trainer;

#define LG_SKIPPED_OVERFLOW 1   /* an fp16 gradient overflowed: the loss scale halved */
#define LG_SKIPPED_NO_TARGETS 2 /* every target of the step ignored: nothing to learn, no decay */
typedef struct {
    double loss;        /* mean over every non-ignored target of the step */
    float lr, grad_norm; /* grad_norm before clipping, unscaled */
    double ms, tokens_per_s;
    long n_targets;
    int skipped;        /* no update: 0, or why not (LG_SKIPPED_*) */
    int hessian;        /* Sophia refreshed its Hessian estimate: one more forward and backward */
    float loss_scale;   /* the scale this step used (1 without scaling) */
    int diverged;       /* the step failed on a non-finite gradient norm without loss scaling
                           (a driver may suggest a lower learning rate or clipping) */
    int out_of_memory;  /* the step failed because a GPU ran out of memory inside a library
                           (cuBLASLt) after the plan: nothing was updated */
} lg_step_stats;

int lg_trainer_create(lg_trainer *tr, const lg_config *cfg, const lg_args *args, int T,
                      lg_error *err);
/* The same in one of several processes (launch: lg_launch_place and lg_launch_start done): it
   drives the launch's ranks; every process calls every trainer function in the same order. */
int lg_trainer_create_in(lg_trainer *tr, const lg_config *cfg, const lg_args *args, int T,
                         const lg_launch *launch, lg_error *err);
/* One optimizer step: reads all micro-batches (micro-batch i of rank r is the (i ranks + r)-th
   of the step, so any number of ranks sees the samples one rank would), accumulates gradients
   of the global mean loss, clips by the global norm, updates every shard. Fails (without
   touching the weights) on a data error or a non-finite gradient. */
int lg_trainer_step(lg_trainer *tr, lg_loader *train, int step, lg_step_stats *stats,
                    lg_error *err);
/* Mean loss over all targets of at most n_batches micro-batches from the start of ld, spread
   over the ranks, each window (sample) read once: a set of fewer is read whole, once, its last
   micro-batch short (LitGPT's validate: min(len(val_dataloader), eval.max_iters)). */
int lg_trainer_evaluate(lg_trainer *tr, lg_loader *ld, int n_batches, double *mean_loss,
                        lg_error *err);
/* lg_model_generate on rank 0 (the other ranks take part in the gathers), drawing among ids
   0 .. vocab - 1 (lg_gen_vocab; 0 or past vocab_size: vocab_size). */
void lg_trainer_generate(lg_trainer *tr, int *tokens, int n_prompt, int n_new, int vocab,
                         float temperature, lg_rng *rng);
/* The weights (n_params) in the whole layout, into a buffer of any type. */
void lg_trainer_weights(lg_trainer *tr, lg_buf whole);
/* Sets every rank's weights, master weights and offload host copies from a whole-layout buffer
   (n_params) of any type: loading a model. */
void lg_trainer_set_weights(lg_trainer *tr, lg_buf whole);
void lg_trainer_free(lg_trainer *tr);
/* The NCCL communicators each rank of such a run joins on GPUs. */
int lg_comms_per_rank(const lg_args *args);

/* ---------------------------------------------------------------------------------------------
   16. generation (API): KV cache, sampling

   Generation on the CPU backend with a cache of every block's keys and values: the prompt
   goes through the model in one pass (prefill), then each new token alone (decode), its
   attention reading the cache. The cache holds the NQG key/value heads (grouped-query and
   multi-query attention keep fewer), keys with rotary applied at their positions, and has
   room for prompt + new tokens, not block_size. Memory is a plan like training's: every region
   by name, one arena, checked before allocating.

       lg_gen_source src;  lg_generator g;  lg_gen_spec spec = {n_prompt + n_new, n_prompt,
                                                                LG_PRECISION_32_TRUE, threads, 0};
       lg_gen_source_find(&src, "out/step-100", &err);   // Hugging Face dir, step-N, LoRA adapters
       lg_generator_create(&g, &src.cfg, &spec, &err);
       lg_generator_load(&g, &src, &err);
       lg_sampling s = lg_sampling_default();  s.temperature = 0;  // greedy
       lg_generate(&g, prompt, n_prompt, n_new, &s, &rng, out, &n_out, NULL, NULL, &stats, &err);

   CUDA builds run this on the CPU too: the decode step's kernels are not written yet.
   ------------------------------------------------------------------------------------------- */

/* What a generation needs memory for. */
typedef struct {
    int positions;          /* the cache: prompt + new tokens, at most block_size */
    int prefill;            /* the most tokens one forward takes (the prompt's length) */
    lg_precision precision; /* storage of the weights, the cache and the working set: the
                               weight type of the precision (32-true: fp32, *bf16*: bf16,
                               *16*: fp16); arithmetic in fp32 */
    int threads;            /* CPU threads: one matmul workspace and one row of scores each */
    int vocab;              /* ids drawn: 0 .. vocab - 1, the tokenizer's size, where the head's
                               vocab_size rows include padding; 0: all vocab_size */
} lg_gen_spec;

/* The ids generation draws from, 0 .. n - 1, for a tokenizer tok (NULL: none known): its own
   where config.json's vocab_size counts rows of padding past them (Qwen3: 151,936 rows, 151,669
   tokens), else vocab_size. The one rule of tools/generate (lg_gen_spec.vocab) and ./train's
   samples (lg_trainer_generate). */
int lg_gen_vocab(const lg_config *cfg, const lg_tokenizer *tok);

/* The plan of a generation: one rank, one pool, regions weights, kv_cache.keys and .values,
   the working set of one forward, the logits of one position and the scratch. */
int lg_gen_plan(lg_plan *plan, const lg_config *cfg, const lg_gen_spec *spec, lg_error *err);
/* Its table (as --plan prints a training plan's). */
void lg_gen_plan_print(const lg_plan *plan, FILE *out);

/* Where a model to generate with comes from. DIR holds config.json and its weights
   (model.safetensors or its shards), or, a LoRA run's step-N, PEFT's adapter_model.safetensors
   over the base model named in adapter_config.json (base_model_name_or_path); a directory of
   step-N directories stands for its latest complete one. */
typedef struct {
    char dir[1024];      /* the directory of config.json */
    char weights[1024];  /* the directory of model.safetensors: dir, or the adapters' base */
    char adapters[1024]; /* dir when the weights are a base model plus adapters, else "" */
    lg_config cfg;
} lg_gen_source;
int lg_gen_source_find(lg_gen_source *src, const char *dir, lg_error *err);

/* A model ready to generate: its plan, its arena, views of the weights, the cache and the
   working set. */
typedef struct {
    lg_config cfg;
    lg_gen_spec spec;
    lg_plan plan;
    lg_rank rank;
    lg_exec exec;             /* the CPU backend with the plan's matmul workspace */
    lg_buf params;            /* (n_params) "weights", laid out by lg_params_layout */
    lg_param_tensors p;       /* views of params */
    lg_buf keys, values;      /* (L, NQG, positions, HS): keys after rotary */
    int n_cached;             /* positions filled; the next token's position */
    /* the working set of one forward of n <= prefill tokens (the activation type) */
    lg_buf x, x_mid, n1, n2;  /* (n, C) */
    lg_buf qkv;               /* (n, (NH + 2 NQG) HS) */
    lg_buf att_y;             /* (n, NH HS) */
    lg_buf fc, fc_2, act;     /* (n, I); fc_2: LLaMAMLP only */
    lg_buf ln_f;              /* (C): the final norm of the last position */
    lg_real *mean, *rstd;     /* (n), (n): a norm's statistics */
    lg_real *row;             /* (widest linear input): one token's input in fp32 */
    lg_real *scores;          /* (threads, positions + 2 HS): a thread's scores, sums, query */
    lg_real *rope_cos, *rope_sin; /* (positions, rope_dims / 2) */
    lg_real *logits;          /* (V): the last position's */
    lg_real *probs;           /* (V): sampling's scratch */
    int *order;               /* (V): sampling's token order */
} lg_generator;

/* Plans and allocates (exactly the plan) for cfg; the weights are zero until loaded. */
int lg_generator_create(lg_generator *g, const lg_config *cfg, const lg_gen_spec *spec,
                        lg_error *err);
void lg_generator_free(lg_generator *g);
/* The weights of src (converted to the generator's type), adapters merged as PEFT merges them:
   W += (lora_alpha / r) B A per module, rank_pattern and alpha_pattern honoured. */
int lg_generator_load(lg_generator *g, const lg_gen_source *src, lg_error *err);
/* Empties the cache (a new prompt). */
void lg_generator_reset(lg_generator *g);
/* Keeps the first n cached positions (a conversation whose later tokens changed): the next
   forward writes position n. */
void lg_generator_truncate(lg_generator *g, int n);
/* Runs tokens (n) at positions n_cached .. n_cached + n - 1 (in pieces of at most prefill),
   their keys and values into the cache; g->logits gets the last one's. Fails when the cache
   has no room. */
int lg_generator_forward(lg_generator *g, const int *tokens, int n, lg_error *err);

/* How the next token is drawn, as LitGPT's sample(): the top_k largest logits kept (0: all;
   ties with the k-th kept), divided by temperature, then the smallest set of the most likely
   tokens whose probability reaches top_p (1: all; the most likely always kept), then one
   draw from their softmax. Temperature 0 is greedy (argmax; the lowest id among equals). */
typedef struct {
    float temperature;
    int top_k;
    float top_p;
    const int *stop;        /* (n_stop) end-of-sequence ids: generation ends after one */
    int n_stop;
} lg_sampling;
lg_sampling lg_sampling_default(void); /* LitGPT's generate: 0.8, top_k 50, top_p 1, no stop */
/* The token drawn from logits (V); probs and order (V) are scratch. -1 when a logit is NaN
   or infinite (a NaN weight, an overflow): nothing to draw from. */
int lg_sample(const lg_real *logits, int V, const lg_sampling *s, lg_rng *rng, lg_real *probs,
              int *order);

typedef struct {
    int prompt_tokens;      /* the prefill's */
    double prefill_ms;      /* the prompt's forward and the first token's draw */
    int decode_tokens;      /* one-token forwards after it */
    double decode_ms;
    int stopped;            /* ended on a stop id */
} lg_gen_stats;

/* Called with each new token as it comes; nonzero ends the generation. */
typedef int (*lg_gen_token_fn)(void *ctx, int token);
/* Empties the cache, prefills the prompt (n_prompt >= 1) and appends up to max_new tokens to
   out (room for max_new); *n_out gets how many. Ends early after a stop id (it is in out). */
int lg_generate(lg_generator *g, const int *prompt, int n_prompt, int max_new,
                const lg_sampling *s, lg_rng *rng, int *out, int *n_out, lg_gen_token_fn on_token,
                void *ctx, lg_gen_stats *stats, lg_error *err);
/* lg_generate on what the cache holds: prefills prompt (n_prompt >= 1) at positions n_cached
   on, then draws as lg_generate (a conversation's next turn). The last token drawn is not in
   the cache: a next turn starts with it. */
int lg_generate_continue(lg_generator *g, const int *prompt, int n_prompt, int max_new,
                         const lg_sampling *s, lg_rng *rng, int *out, int *n_out,
                         lg_gen_token_fn on_token, void *ctx, lg_gen_stats *stats, lg_error *err);

#ifdef __cplusplus
}
#endif
#endif /* LITGPT_H */

/* =============================================================================================
   Implementation
   ============================================================================================= */
#ifdef LITGPT_IMPLEMENTATION

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <limits.h>
#include <float.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef LG_MPI /* CPU ranks in several processes, start-up under a launcher (make: mpicc found) */
#include <mpi.h>
#include <pthread.h> /* MPI_Init's watchdog */
#endif
#include <poll.h> /* POSIX: the rendezvous's waits */
#if defined(_POSIX_C_SOURCE) && _POSIX_C_SOURCE >= 200112L
#include <netdb.h> /* the TCP rendezvous (getaddrinfo) */
#include <netinet/in.h>
#include <sys/socket.h>
#endif
#include <dirent.h> /* POSIX: the step-N directories of checkpoints */
#include <fcntl.h> /* POSIX: open, write, fsync, mkdir for atomic checkpoint files */
#include <sys/stat.h>
#include <unistd.h>

/* The CUDA backend is part of the build when nvcc compiles it, or when a test runs its kernels
   on the CPU through tests/cuda_emulator.h. */
#if defined(__CUDACC__) || defined(LG_CUDA_EMULATE)
#define LG_CUDA 1
#endif

/* x86-64 matmul kernels chosen at run time (section 7): gcc or clang, float lg_real, not in
   nvcc's host pass. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__) && \
    !defined(LG_REAL_DOUBLE)
#define LG_X86_KERNELS 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define LG_X86_KERNELS 0
#endif

/* OpenMP pragmas that vanish, without a warning, when the compiler is not asked for OpenMP. */
#ifdef _OPENMP
#define LG_OMP(directive) _Pragma(#directive)
#else
#define LG_OMP(directive)
#endif

/* 1. utilities -------------------------------------------------------------------------------- */

static int lg_fail(lg_error *err, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return -1;
}

/* The mark at text (a backquote): *key_len bytes of key from text + 1, then the value up to
   the closing backquote (*value at its first byte, or NULL); the mark's length, 0: no mark. */
static size_t lg_setting_mark(const char *text, size_t *key_len, const char **value) {
    if (*text != '`') return 0;
    size_t n = strspn(text + 1, "abcdefghijklmnopqrstuvwxyz0123456789_.");
    const char *after = text + 1 + n, *close = strchr(after, '`');
    if (n == 0 || !close || (*after != '`' && *after != ' ') || close == after + 1) return 0;
    *key_len = n;
    *value = *after == ' ' ? after + 1 : NULL;
    return (size_t)(close - text) + 1;
}

void lg_spell_settings(const char *message, lg_setting_speller *spell, void *ctx, char *out,
                       size_t cap) {
    size_t used = 0, key_len, mark;
    const char *value;
    for (const char *p = message; *p && used + 1 < cap;) {
        char key[64], flag[96];
        const char *spelled = NULL;
        mark = lg_setting_mark(p, &key_len, &value);
        if (mark && key_len < sizeof key) {
            memcpy(key, p + 1, key_len);
            key[key_len] = '\0';
            spelled = spell(key, value != NULL, ctx, flag, sizeof flag);
        }
        if (!spelled) {
            out[used++] = *p++;
            continue;
        }
        int n = value ? snprintf(out + used, cap - used, "%s %.*s", spelled,
                                 (int)(p + mark - 1 - value), value)
                      : snprintf(out + used, cap - used, "%s", spelled);
        used = n < 0 ? used : used + (size_t)n < cap ? used + (size_t)n : cap - 1;
        p += mark;
    }
    out[used < cap ? used : cap - 1] = '\0';
}

const char *lg_setting_flag(const char *key, int with_value, void *table, char *buf, size_t cap) {
    (void)with_value; /* the flag, or the name, comes before the value either way */
    for (const lg_setting_flag_row *row = (const lg_setting_flag_row *)table; row && row->setting;
         row++)
        if (strcmp(row->setting, key) == 0) return row->flag;
    snprintf(buf, cap, "%s", key);
    return buf;
}

void lg_tool_vcomplain(const char *tool, const lg_setting_flag_row *flags, const char *fmt,
                       va_list ap) {
    char marked[4096], message[4096];
    vsnprintf(marked, sizeof marked, fmt, ap);
    lg_spell_settings(marked, lg_setting_flag, (void *)flags, message, sizeof message);
    fprintf(stderr, "%s: %s\n", tool, message);
}

/* marked (a line that names settings) with its settings spelled by spell, in out (cap bytes);
   NULL spell: marked itself, the settings' names. */
static inline const char *lg_spelled(const char *marked, lg_setting_speller *spell, void *ctx,
                                     char *out, size_t cap) {
    if (!spell) return marked;
    lg_spell_settings(marked, spell, ctx, out, cap);
    return out;
}

/* A line the library prints itself (a process that stops on a deadline), its settings spelled
   by launch's speller (NULL launch or speller: the settings' names). */
static inline void lg_print_settings(FILE *out, const lg_launch *launch, const char *fmt, ...) {
    char marked[1024], spelled[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(marked, sizeof marked, fmt, ap);
    va_end(ap);
    fputs(lg_spelled(marked, launch ? launch->speller : NULL,
                     launch ? launch->speller_context : NULL, spelled, sizeof spelled), out);
}

static void *lg_alloc_zeroed(size_t bytes) {
    void *p = LG_MALLOC(bytes ? bytes : 1);
    if (p) memset(p, 0, bytes);
    return p;
}

uint64_t lg_hash64(uint64_t hash, const void *data, size_t bytes) {
    const unsigned char *p = (const unsigned char *)data;
    for (size_t i = 0; i < bytes; i++) hash = (hash ^ p[i]) * 0x100000001B3ull;
    return hash;
}

/* The one mixer of 64-bit numbers: splitmix64's finaliser, every input bit reaching every
   output bit. Seeds, per-element random draws and hash-table slots go through it. */
#define LG_GOLDEN_GAMMA 0x9E3779B97F4A7C15ull /* splitmix64's step between inputs */
LG_HD uint64_t lg_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* splitmix64 scrambles the seed; xorshift64* draws. */
void lg_rng_seed(lg_rng *rng, uint64_t seed) { rng->state = lg_mix64(seed + LG_GOLDEN_GAMMA) | 1u; }

/* xorshift64*'s step of the state (before the output's multiplication). */
static uint64_t lg_xorshift_step(uint64_t s) {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s;
}

uint64_t lg_rng_u64(lg_rng *rng) {
    rng->state = lg_xorshift_step(rng->state);
    return rng->state * 0x2545F4914F6CDD1Dull;
}

/* The step is linear over GF(2): n draws ahead is the step's matrix to the n-th power, applied
   through the binary powers of n. So threads can each draw their part of one stream, the same
   numbers as one thread drawing it all (weight initialisation). powers[k]: 2^k steps, as the
   images of the state's 64 bits. */
typedef struct {
    uint64_t powers[64][64];
} lg_rng_jumps;

/* The matrix (its 64 columns) times the bit vector v. */
static uint64_t lg_gf2_apply(const uint64_t *columns, uint64_t v) {
    uint64_t out = 0;
    for (int i = 0; v; i++, v >>= 1)
        if (v & 1) out ^= columns[i];
    return out;
}

static void lg_rng_jumps_make(lg_rng_jumps *j) {
    for (int i = 0; i < 64; i++) j->powers[0][i] = lg_xorshift_step(1ull << i);
    for (int k = 1; k < 64; k++)
        for (int i = 0; i < 64; i++) j->powers[k][i] = lg_gf2_apply(j->powers[k - 1], j->powers[k - 1][i]);
}

/* rng as it is after `draws` more draws of lg_rng_u64. */
static void lg_rng_skip(lg_rng *rng, const lg_rng_jumps *j, uint64_t draws) {
    for (int k = 0; draws; k++, draws >>= 1)
        if (draws & 1) rng->state = lg_gf2_apply(j->powers[k], rng->state);
}

float lg_rng_uniform(lg_rng *rng) { return (float)(lg_rng_u64(rng) >> 40) / 16777216.0f; }

float lg_rng_normal(lg_rng *rng) {
    float u1 = lg_rng_uniform(rng), u2 = lg_rng_uniform(rng);
    if (u1 < 1e-7f) u1 = 1e-7f;
    return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530718f * u2);
}

double lg_time_ms(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}


/* --- growing lists ---------------------------------------------------------------------------- */

static int lg_grow(void **data, size_t *cap, size_t need, size_t item) {
    if (need <= *cap) return 0;
    size_t cap2 = *cap ? *cap : 64;
    while (cap2 < need) cap2 *= 2;
    void *grown = LG_MALLOC(cap2 * item);
    if (!grown) return -1;
    if (*data) memcpy(grown, *data, *cap * item);
    LG_FREE(*data);
    *data = grown;
    *cap = cap2;
    return 0;
}

int lg_tokens_push(lg_tokens *list, int id) {
    if (lg_grow((void **)&list->ids, &list->cap, list->n + 1, sizeof(int)) != 0) return -1;
    list->ids[list->n++] = id;
    return 0;
}

int lg_text_append(lg_text *text, const char *bytes, size_t n) {
    if (lg_grow((void **)&text->bytes, &text->cap, text->n + n + 1, 1) != 0) return -1;
    memcpy(text->bytes + text->n, bytes, n);
    text->n += n;
    text->bytes[text->n] = '\0';
    return 0;
}

void lg_tokens_free(lg_tokens *list) {
    LG_FREE(list->ids);
    memset(list, 0, sizeof *list);
}

void lg_text_free(lg_text *text) {
    LG_FREE(text->bytes);
    memset(text, 0, sizeof *text);
}

/* --- JSON ------------------------------------------------------------------------------------ */

typedef struct {
    lg_json *doc;
    size_t at, len;
    const char *source;
    lg_error *err;
} lg_json_parser;

static int lg_json_error(lg_json_parser *p, const char *what) {
    size_t line = 1;
    for (size_t i = 0; i < p->at && i < p->len; i++) line += p->doc->text[i] == '\n';
    return lg_fail(p->err, "%s: invalid JSON at line %zu (byte %zu): %s", p->source, line, p->at,
                   what);
}

static void lg_json_skip_space(lg_json_parser *p) {
    while (p->at < p->len && strchr(" \t\r\n", p->doc->text[p->at]) && p->doc->text[p->at])
        p->at++;
}

static int lg_json_new_node(lg_json_parser *p, lg_json_kind kind) {
    lg_json *d = p->doc;
    if (d->n_nodes == d->cap) {
        int cap = d->cap ? 2 * d->cap : 256;
        lg_json_node *grown = (lg_json_node *)LG_MALLOC(sizeof(lg_json_node) * (size_t)cap);
        if (!grown) return -1;
        if (d->nodes) memcpy(grown, d->nodes, sizeof(lg_json_node) * (size_t)d->n_nodes);
        LG_FREE(d->nodes);
        d->nodes = grown;
        d->cap = cap;
    }
    lg_json_node *n = &d->nodes[d->n_nodes];
    n->kind = kind;
    n->first_child = n->next = -1;
    n->start = n->end = p->at;
    return d->n_nodes++;
}

static int lg_json_hex4(const char *s, size_t avail, unsigned *value) {
    *value = 0;
    if (avail < 4) return -1;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                  : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (digit < 0) return -1;
        *value = *value * 16 + (unsigned)digit;
    }
    return 0;
}

static int lg_json_scan_string(lg_json_parser *p, int node) {
    const char *t = p->doc->text;
    p->at++; /* the opening quote */
    p->doc->nodes[node].start = p->at;
    while (p->at < p->len && t[p->at] != '"') {
        unsigned char c = (unsigned char)t[p->at];
        unsigned hex;
        if (c < 0x20) return lg_json_error(p, "control character inside a string");
        if (c == '\\') {
            if (++p->at == p->len) break;
            if (t[p->at] == 'u' && lg_json_hex4(t + p->at + 1, p->len - p->at - 1, &hex) != 0)
                return lg_json_error(p, "\\u needs four hex digits");
            if (t[p->at] == 'u' && hex == 0) /* C strings end there: the rest would be lost */
                return lg_json_error(p, "\\u0000 (a NUL character) inside a string");
            if (t[p->at] == 'u') p->at += 4;
            else if (!strchr("\"\\/bfnrt", t[p->at]) || !t[p->at])
                return lg_json_error(p, "unknown escape in a string");
        }
        p->at++;
    }
    if (p->at >= p->len) return lg_json_error(p, "unterminated string");
    p->doc->nodes[node].end = p->at++;
    return 0;
}

static int lg_json_scan_number(lg_json_parser *p, int node) {
    const char *t = p->doc->text;
    size_t start = p->at, digits = 0;
    if (t[p->at] == '-') p->at++;
    while (p->at < p->len && t[p->at] >= '0' && t[p->at] <= '9') p->at++, digits++;
    if (p->at < p->len && t[p->at] == '.') {
        p->at++;
        while (p->at < p->len && t[p->at] >= '0' && t[p->at] <= '9') p->at++;
    }
    if (p->at < p->len && (t[p->at] == 'e' || t[p->at] == 'E')) {
        p->at++;
        if (p->at < p->len && (t[p->at] == '+' || t[p->at] == '-')) p->at++;
        while (p->at < p->len && t[p->at] >= '0' && t[p->at] <= '9') p->at++;
    }
    if (digits == 0) { p->at = start; return lg_json_error(p, "expected a value"); }
    p->doc->nodes[node].end = p->at;
    return 0;
}

static int lg_json_value(lg_json_parser *p, int depth);

/* The elements of an array or the key/value pairs of an object, linked as children. */
static int lg_json_container(lg_json_parser *p, int node, int depth) {
    int object = p->doc->nodes[node].kind == LG_JSON_OBJECT, last = -1;
    char close = object ? '}' : ']';
    p->at++;
    lg_json_skip_space(p);
    if (p->at < p->len && p->doc->text[p->at] == close) { p->at++; return 0; }
    for (;;) {
        for (int part = 0; part < 1 + object; part++) {
            lg_json_skip_space(p);
            if (part == 0 && object && (p->at >= p->len || p->doc->text[p->at] != '"'))
                return lg_json_error(p, "expected a string key");
            int child = p->doc->n_nodes;
            if (lg_json_value(p, depth + 1) != 0) return -1;
            if (last < 0) p->doc->nodes[node].first_child = child;
            else p->doc->nodes[last].next = child;
            last = child;
            lg_json_skip_space(p);
            if (part == 0 && object) {
                if (p->at >= p->len || p->doc->text[p->at] != ':')
                    return lg_json_error(p, "expected ':' after a key");
                p->at++;
            }
        }
        if (p->at < p->len && p->doc->text[p->at] == ',') { p->at++; continue; }
        if (p->at < p->len && p->doc->text[p->at] == close) { p->at++; break; }
        return lg_json_error(p, object ? "expected ',' or '}'" : "expected ',' or ']'");
    }
    p->doc->nodes[node].end = p->at;
    return 0;
}

static int lg_json_value(lg_json_parser *p, int depth) {
    lg_json_skip_space(p);
    if (depth > LG_JSON_MAX_DEPTH) return lg_json_error(p, "nested too deeply");
    if (p->at >= p->len) return lg_json_error(p, "unexpected end of the document");
    const char *t = p->doc->text + p->at;
    size_t avail = p->len - p->at;
    static const char *const words[3] = {"null", "false", "true"};
    for (int w = 0; w < 3; w++) {
        size_t n = strlen(words[w]);
        if (avail >= n && memcmp(t, words[w], n) == 0) {
            int node = lg_json_new_node(p, (lg_json_kind)(LG_JSON_NULL + w));
            if (node < 0) return lg_json_error(p, "out of host memory");
            p->at += n;
            p->doc->nodes[node].end = p->at;
            return 0;
        }
    }
    lg_json_kind kind = *t == '"' ? LG_JSON_STRING : *t == '[' ? LG_JSON_ARRAY
                      : *t == '{' ? LG_JSON_OBJECT : LG_JSON_NUMBER;
    int node = lg_json_new_node(p, kind);
    if (node < 0) return lg_json_error(p, "out of host memory");
    if (kind == LG_JSON_STRING) return lg_json_scan_string(p, node);
    if (kind == LG_JSON_NUMBER) return lg_json_scan_number(p, node);
    return lg_json_container(p, node, depth);
}

int lg_json_parse(lg_json *doc, const char *text, size_t len, const char *source, lg_error *err) {
    memset(doc, 0, sizeof *doc);
    doc->text = text;
    lg_json_parser p = {doc, 0, len, source, err};
    int rc = lg_json_value(&p, 0);
    lg_json_skip_space(&p);
    if (rc == 0 && p.at != len) rc = lg_json_error(&p, "text after the document");
    if (rc != 0) lg_json_free(doc);
    return rc;
}

int lg_json_find(const lg_json *doc, int object, const char *key) {
    if (object < 0 || doc->nodes[object].kind != LG_JSON_OBJECT) return -1;
    size_t n = strlen(key);
    for (int k = doc->nodes[object].first_child; k >= 0; k = doc->nodes[doc->nodes[k].next].next) {
        const lg_json_node *node = &doc->nodes[k];
        if (node->end - node->start == n && memcmp(doc->text + node->start, key, n) == 0)
            return node->next;
    }
    return -1;
}

/* Appends code point cp as UTF-8; returns the bytes written (1 to 4). */
static int lg_utf8_put(char *out, uint32_t cp) {
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | cp >> 6);
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | cp >> 12);
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | cp >> 18);
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* The code point of the \uXXXX escape at s (after the backslash), joining surrogate pairs; a
   lone surrogate becomes U+FFFD. *used: bytes consumed after the backslash. */
static uint32_t lg_json_unicode_escape(const char *s, size_t avail, size_t *used) {
    unsigned hi, lo;
    lg_json_hex4(s + 1, avail - 1, &hi);
    *used = 5;
    if (hi < 0xD800 || hi > 0xDFFF) return hi;
    if (hi <= 0xDBFF && avail >= 11 && s[5] == '\\' && s[6] == 'u' &&
        lg_json_hex4(s + 7, avail - 7, &lo) == 0 && lo >= 0xDC00 && lo <= 0xDFFF) {
        *used = 11;
        return 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
    }
    return 0xFFFD;
}

char *lg_json_string(const lg_json *doc, int node, size_t *len) {
    if (node < 0 || doc->nodes[node].kind != LG_JSON_STRING) return NULL;
    const char *s = doc->text + doc->nodes[node].start;
    size_t n = doc->nodes[node].end - doc->nodes[node].start, out_n = 0;
    char *out = (char *)LG_MALLOC(n + 1); /* escapes never grow: \uXXXX is 6 bytes, UTF-8 <= 4 */
    if (!out) return NULL;
    for (size_t i = 0; i < n;) {
        if (s[i] != '\\') { out[out_n++] = s[i++]; continue; }
        char c = s[i + 1];
        if (c == 'u') {
            size_t used;
            out_n += (size_t)lg_utf8_put(out + out_n, lg_json_unicode_escape(s + i + 1, n - i - 1, &used));
            i += 1 + used;
            continue;
        }
        out[out_n++] = c == 'b' ? '\b' : c == 'f' ? '\f' : c == 'n' ? '\n' : c == 'r' ? '\r'
                     : c == 't' ? '\t' : c;
        i += 2;
    }
    out[out_n] = '\0';
    if (len) *len = out_n;
    return out;
}

int lg_json_int(const lg_json *doc, int node, long *value) {
    if (node < 0 || doc->nodes[node].kind != LG_JSON_NUMBER) return -1;
    const char *s = doc->text + doc->nodes[node].start;
    size_t n = doc->nodes[node].end - doc->nodes[node].start, i = s[0] == '-';
    long v = 0;
    if (i == n || n - i > 15) return -1;
    for (; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        v = v * 10 + (s[i] - '0');
    }
    *value = s[0] == '-' ? -v : v;
    return 0;
}

int lg_json_string_copy(const lg_json *doc, int node, char *out, size_t cap) {
    size_t n;
    char *s = lg_json_string(doc, node, &n);
    int fits = s && n < cap && strlen(s) == n;
    if (fits) memcpy(out, s, n + 1);
    else if (cap) out[0] = '\0';
    LG_FREE(s);
    return fits ? 0 : -1;
}

int lg_json_double(const lg_json *doc, int node, double *value) {
    if (node < 0 || doc->nodes[node].kind != LG_JSON_NUMBER) return -1;
    char buf[64], *end;
    size_t n = doc->nodes[node].end - doc->nodes[node].start;
    if (n >= sizeof buf) return -1;
    memcpy(buf, doc->text + doc->nodes[node].start, n);
    buf[n] = '\0';
    double v = strtod(buf, &end);
    if (*end != '\0' || !isfinite(v)) return -1;
    *value = v;
    return 0;
}

int lg_json_count(const lg_json *doc, int node) {
    if (node < 0 || (doc->nodes[node].kind != LG_JSON_ARRAY && doc->nodes[node].kind != LG_JSON_OBJECT))
        return 0;
    int n = 0;
    for (int k = doc->nodes[node].first_child; k >= 0; k = doc->nodes[k].next) n++;
    return doc->nodes[node].kind == LG_JSON_OBJECT ? n / 2 : n;
}

void lg_json_free(lg_json *doc) {
    LG_FREE(doc->nodes);
    memset(doc, 0, sizeof *doc);
}

char *lg_read_file(const char *path, size_t *len, const char *what, lg_error *err) {
    struct stat st;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) {
        lg_fail(err, "%s %s: not a regular file", what, path);
        return NULL;
    }
    FILE *f = fopen(path, "rb");
    if (!f) {
        lg_fail(err, "%s %s: cannot open: %s", what, path, strerror(errno));
        return NULL;
    }
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = size >= 0 ? (char *)LG_MALLOC((size_t)size + 1) : NULL;
    if (!text || fread(text, 1, (size_t)size, f) != (size_t)size) {
        lg_fail(err, "%s %s: %s", what, path, text ? "read failed" : "out of host memory");
        LG_FREE(text);
        fclose(f);
        return NULL;
    }
    fclose(f);
    text[size] = '\0';
    *len = (size_t)size;
    return text;
}

/* snprintf for paths and names: truncation is checked by the reader of the result (a truncated
   path does not open), so the compiler need not warn about it. */
static int lg_format(char *out, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(out, cap, fmt, ap);
    va_end(ap);
    return n;
}

int lg_name_index(const char *const *names, int count, const char *text) {
    for (int i = 0; i < count; i++)
        if (strcmp(text, names[i]) == 0) return i;
    return -1;
}

/* A table of names has one name per value of its enum (C and C++). */
#ifdef __cplusplus
#define LG_STATIC_ASSERT(cond, what) static_assert(cond, what)
#else
#define LG_STATIC_ASSERT(cond, what) _Static_assert(cond, what)
#endif
#define LG_COUNT_OF(table) ((int)(sizeof(table) / sizeof((table)[0])))

/* 2. numbers ---------------------------------------------------------------------------------- */

static const char *const lg_precision_names[] = {"32-true", "16-true", "bf16-true", "16-mixed",
                                                 "bf16-mixed"};
LG_STATIC_ASSERT(LG_COUNT_OF(lg_precision_names) == LG_PRECISION_BF16_MIXED + 1,
                 "a name for each precision");

int lg_precision_parse(const char *text, lg_precision *out) {
    int i = lg_name_index(lg_precision_names, LG_COUNT_OF(lg_precision_names), text);
    if (i >= 0) *out = (lg_precision)i;
    return i >= 0 ? 0 : -1;
}

const char *lg_precision_name(lg_precision p) { return lg_precision_names[p]; }

LG_HD lg_real lg_gelu_erf(lg_real x) { return 0.5f * x * (1.0f + lg_erf(x * (lg_real)0.70710678118654752)); }

LG_HD lg_real lg_gelu_erf_grad(lg_real x) {
    lg_real cdf = 0.5f * (1.0f + lg_erf(x * (lg_real)0.70710678118654752));
    lg_real pdf = (lg_real)0.39894228040143268 * lg_exp(-0.5f * x * x);
    return cdf + x * pdf;
}

#define LG_GELU_TANH_SCALE ((lg_real)0.79788456080286536) /* sqrt(2 / pi) */
#define LG_GELU_TANH_CUBIC ((lg_real)0.044715)

LG_HD lg_real lg_gelu_tanh(lg_real x) {
    lg_real u = LG_GELU_TANH_SCALE * (x + LG_GELU_TANH_CUBIC * x * x * x);
    return 0.5f * x * (1.0f + lg_tanh(u));
}

LG_HD lg_real lg_gelu_tanh_grad(lg_real x) {
    lg_real u = LG_GELU_TANH_SCALE * (x + LG_GELU_TANH_CUBIC * x * x * x);
    lg_real th = lg_tanh(u);
    lg_real du = LG_GELU_TANH_SCALE * (1.0f + 3.0f * LG_GELU_TANH_CUBIC * x * x);
    return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
}

LG_HD lg_real lg_sigmoid(lg_real x) { return 1.0f / (1.0f + lg_exp(-x)); }

/* bf16 and fp16 as storage: conversions with round-to-nearest-even, NaN kept NaN (quiet, with
   the payload's top bits), overflow to infinity, fp16 subnormals. */

LG_HD uint32_t lg_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

LG_HD float lg_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

LG_HD uint16_t lg_f32_to_bf16(float f) {
    uint32_t u = lg_f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x0040u); /* quiet NaN */
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest, ties to even; may carry into Inf */
    return (uint16_t)(u >> 16);
}

LG_HD float lg_bf16_to_f32(uint16_t h) { return lg_bits_f32((uint32_t)h << 16); }

#define LG_F16_MAX_BITS_F32 0x477FF000u /* 65520: from here fp16 rounds to Inf */
#define LG_F16_MIN_NORMAL_F32 0x38800000u /* 2^-14 */

LG_HD uint16_t lg_f32_to_f16(float f) {
    uint32_t u = lg_f32_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu)); /* NaN */
    if (a >= LG_F16_MAX_BITS_F32) return (uint16_t)(sign | 0x7C00u);               /* Inf */
    if (a <= 0x33000000u) return (uint16_t)sign; /* at most 2^-25, half the least subnormal:
                                                    ties to even give 0 (and no slow
                                                    arithmetic on fp32 subnormals) */
    if (a < LG_F16_MIN_NORMAL_F32) {
        /* subnormal: units of 2^-24; scaling by a power of two is exact, rintf rounds to
           nearest even (1024 units is the smallest normal, encoded correctly too) */
        return (uint16_t)(sign | (uint32_t)rintf(lg_bits_f32(a) * 16777216.0f));
    }
    a -= 0x38000000u;                /* rebias the exponent from 127 to 15 */
    a += 0x0FFFu + ((a >> 13) & 1u); /* round to nearest, ties to even */
    return (uint16_t)(sign | (a >> 13));
}

LG_HD float lg_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    if (exp == 0) { /* zero or subnormal: mant x 2^-24 */
        float v = (float)mant * (1.0f / 16777216.0f);
        return lg_bits_f32(lg_f32_bits(v) | sign);
    }
    if (exp == 31) return lg_bits_f32(sign | 0x7F800000u | (mant << 13)); /* Inf, NaN */
    return lg_bits_f32(sign | ((exp + 112) << 23) | (mant << 13));
}

LG_HD lg_real lg_get(lg_buf b, size_t i) {
    switch (b.dtype) {
    case LG_DTYPE_BF16: return lg_bf16_to_f32(((const uint16_t *)b.data)[i]);
    case LG_DTYPE_F16: return lg_f16_to_f32(((const uint16_t *)b.data)[i]);
    default: return ((const lg_real *)b.data)[i];
    }
}

LG_HD void lg_set(lg_buf b, size_t i, lg_real v) {
    switch (b.dtype) {
    case LG_DTYPE_BF16: ((uint16_t *)b.data)[i] = lg_f32_to_bf16((float)v); break;
    case LG_DTYPE_F16: ((uint16_t *)b.data)[i] = lg_f32_to_f16((float)v); break;
    default: ((lg_real *)b.data)[i] = v; break;
    }
}

LG_HD size_t lg_elem_size(lg_dtype d) {
    return d == LG_DTYPE_F32 ? sizeof(lg_real)
           : d == LG_DTYPE_I32 ? 4
           : d == LG_DTYPE_BF16 || d == LG_DTYPE_F16 ? 2
                                                      : 1; /* u8; NF4 views count bytes */
}

/* The view `offset` elements further on. */
LG_HD lg_buf lg_at(lg_buf b, size_t offset) {
    lg_buf r = {b.data ? (char *)b.data + offset * lg_elem_size(b.dtype) : NULL, b.dtype};
    return r;
}

LG_HD lg_buf lg_buf_of(lg_real *p) {
    lg_buf b = {p, LG_DTYPE_F32};
    return b;
}

/* A uniform draw in [0, 1) that depends only on (seed, index): stochastic rounding gives the
   same bits whatever the thread count. */
LG_HD float lg_hash_uniform(uint64_t seed, uint64_t index) {
    uint64_t z = lg_mix64(seed + LG_GOLDEN_GAMMA * (index + 1));
    return (float)(z >> 40) * (1.0f / 16777216.0f);
}

/* LoRA dropout: the factor of element i of an adapter's input, scale / (1 - p) when kept
   (lg_hash_uniform(key, i) >= p), else 0; key 0 (no dropout) keeps every element at scale. */
LG_HD float lg_lora_keep(uint64_t key, uint64_t i, float p, float scale) {
    if (key == 0 || p <= 0.0f) return scale;
    return lg_hash_uniform(key, i) >= p ? scale / (1.0f - p) : 0.0f;
}

LG_HD uint16_t lg_half_from_f32(float v, lg_dtype dtype) {
    return dtype == LG_DTYPE_BF16 ? lg_f32_to_bf16(v) : lg_f32_to_f16(v);
}

LG_HD float lg_half_to_f32(uint16_t h, lg_dtype dtype) {
    return dtype == LG_DTYPE_BF16 ? lg_bf16_to_f32(h) : lg_f16_to_f32(h);
}

/* Rounds v to a half type stochastically, given a uniform draw u: to the neighbour beyond the
   nearest with probability equal to v's distance from the nearest in units of their gap, so
   the expected stored value is v. Exact values, NaN and overflow round as to nearest. */
LG_HD uint16_t lg_round_stochastic(float v, lg_dtype dtype, float u) {
    uint16_t near = lg_half_from_f32(v, dtype);
    float nv = lg_half_to_f32(near, dtype);
    if (nv == v || v != v || !isfinite(nv)) return near;
    /* half bit patterns grow with magnitude within a sign: one step towards v */
    uint16_t other = (uint16_t)(fabsf(v) > fabsf(nv) ? near + 1 : near - 1);
    float ov = lg_half_to_f32(other, dtype);
    return u < (v - nv) / (ov - nv) ? other : near;
}

/* One AdamW element, PyTorch's order: decoupled decay, moments, bias-corrected step. */
LG_HD lg_real lg_adamw_element(lg_real p, lg_real g, lg_real *m, lg_real *v, lg_real lr, lg_real beta1,
                             lg_real beta2, lg_real bias_corr1, lg_real bias_corr2, lg_real eps,
                             lg_real weight_decay) {
    p -= lr * weight_decay * p;
    *m = beta1 * *m + (1.0f - beta1) * g;
    *v = beta2 * *v + (1.0f - beta2) * g * g;
    lg_real m_hat = *m / bias_corr1, v_hat = *v / bias_corr2;
    return p - lr * m_hat / (lg_sqrt(v_hat) + eps);
}

/* One Lion element (Chen et al. 2023): step along the sign of the interpolation
   beta1 m + (1 - beta1) g, decoupled decay, then m moves towards g at rate 1 - beta2. */
LG_HD lg_real lg_lion_element(lg_real p, lg_real g, lg_real *m, lg_real lr, lg_real beta1,
                              lg_real beta2, lg_real weight_decay) {
    lg_real c = beta1 * *m + (1.0f - beta1) * g;
    lg_real direction = (lg_real)((c > 0) - (c < 0));
    p -= lr * weight_decay * p;
    *m = beta2 * *m + (1.0f - beta2) * g;
    return p - lr * direction;
}

/* One SophiaG element (Liu et al. 2023): momentum, decoupled decay, then a step of the sign of
   m scaled by |m| / (rho h), clipped at 1, so the step never exceeds lr. h is the diagonal
   Hessian estimate (already multiplied by the batch's token count). */
LG_HD lg_real lg_sophia_element(lg_real p, lg_real g, lg_real *m, lg_real h, lg_real lr,
                                lg_real beta1, lg_real rho, lg_real weight_decay) {
    *m = beta1 * *m + (1.0f - beta1) * g;
    p -= lr * weight_decay * p;
    lg_real denominator = rho * h > (lg_real)1e-15 ? rho * h : (lg_real)1e-15;
    lg_real ratio = lg_fabs(*m) / denominator;
    if (ratio > 1) ratio = 1;
    return p - lr * (lg_real)((*m > 0) - (*m < 0)) * ratio;
}

/* One SGD element, PyTorch's convention: L2 decay into the gradient, momentum buffer. */
LG_HD lg_real lg_sgd_element(lg_real p, lg_real g, lg_real *buf, lg_real lr, lg_real momentum,
                           lg_real weight_decay) {
    g += weight_decay * p;
    if (momentum != 0.0f) {
        *buf = momentum * *buf + g;
        g = *buf;
    }
    return p - lr * g;
}

/* The constants one optimizer step applies to every element (lg_update_rule_of, section 9). */
typedef struct {
    lg_optimizer_kind kind;
    lg_real lr, beta1, beta2, eps, rho, momentum;
    lg_real bias_corr1, bias_corr2; /* AdamW's 1 - beta^t */
    uint64_t rounding_seed;         /* the stochastic rounding draws of this step */
} lg_update_rule;

/* Tensors weight decay applies to: matrices and embeddings, not norms or biases. */
static int lg_tensor_decays(lg_tensor_kind kind) {
    return kind == LG_TENSOR_EMBEDDING || kind == LG_TENSOR_WEIGHT || kind == LG_TENSOR_RESIDUAL;
}

/* One parameter's update by the rule; m and v in and out (v as a plain second moment). */
LG_HD lg_real lg_update_element(const lg_update_rule *r, lg_real w, lg_real g, lg_real *m,
                                lg_real *v, lg_real decay) {
    if (r->kind == LG_OPTIMIZER_ADAMW)
        return lg_adamw_element(w, g, m, v, r->lr, r->beta1, r->beta2, r->bias_corr1,
                                r->bias_corr2, r->eps, decay);
    if (r->kind == LG_OPTIMIZER_LION) return lg_lion_element(w, g, m, r->lr, r->beta1, r->beta2, decay);
    if (r->kind == LG_OPTIMIZER_SOPHIA)
        return lg_sophia_element(w, g, m, *v, r->lr, r->beta1, r->rho, decay);
    return lg_sgd_element(w, g, m, r->lr, r->momentum, decay);
}

/* An updated weight rounded stochastically to a half type, with a draw that depends on the
   step and the element's place in the whole layout (`origin`), so that sharded runs round as
   one rank does. */
LG_HD uint16_t lg_round_update(const lg_update_rule *r, lg_real w, lg_dtype dtype, size_t origin) {
    return lg_round_stochastic((float)w, dtype, lg_hash_uniform(r->rounding_seed, origin));
}

/* The code of the map entry nearest x. */
LG_HD uint8_t lg_quantize(const float *map, float x) {
    int lo = 0, hi = 255;
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (map[mid] <= x) lo = mid;
        else hi = mid;
    }
    return (uint8_t)(x - map[lo] <= map[hi] - x ? lo : hi);
}

/* Where one tensor's state lives: fp32 or half views indexed from the tensor's first element,
   or 8-bit codes with one scale per block. */
typedef struct {
    lg_buf m, v;             /* data NULL when the optimizer has no such state */
    float *m_scales, *v_scales; /* 8-bit only */
} lg_tensor_state;

/* NF4: QLoRA's frozen weights (the format is described with the API). Quantizing runs on the
   CPU; dequantizing is an op of section 7 with a CUDA kernel, which takes the code book by
   value and the helpers marked LG_HD. */

static const char *const lg_quantization_names[] = {"none", "nf4", "nf4-dq"};
#define LG_QUANTIZATIONS 3
LG_STATIC_ASSERT(LG_COUNT_OF(lg_quantization_names) == LG_QUANTIZATIONS &&
                     LG_QUANTIZE_NF4_DQ + 1 == LG_QUANTIZATIONS, "a name for each quantization");

const char *lg_quantization_name(lg_quantization q) { return lg_quantization_names[q]; }

int lg_quantization_parse(const char *text, lg_quantization *out) {
    int i = lg_name_index(lg_quantization_names, LG_QUANTIZATIONS, text);
    if (i >= 0) *out = (lg_quantization)i;
    return i >= 0 ? 0 : -1;
}

#define LG_NF4_CODES 16
#define LG_NF4_DYNAMIC_CODES 256
#define LG_NF4_DYNAMIC_DECADES 7 /* the dynamic map's values: 10^-6 .. 1 */

typedef struct {
    float nf4[LG_NF4_CODES];            /* NF4's values, code 0..15 ascending */
    float nf4_above[LG_NF4_CODES - 1];  /* x / absmax above nf4_above[k] gets a code above k */
    float dynamic[LG_NF4_DYNAMIC_CODES]; /* nf4-dq's codes of the absmax values, ascending */
} lg_nf4_codebook;

/* Where the parts of one stored tensor start, in bytes from its first. */
typedef struct {
    size_t blocks;    /* ceil(count / LG_NF4_BLOCK) */
    size_t groups;    /* nf4-dq: ceil(blocks / LG_NF4_DQ_BLOCK) */
    size_t absmax_at; /* (blocks) fp32 absmax, or nf4-dq's uint8 codes of them */
    size_t scales_at; /* nf4-dq: (groups) fp32 */
    size_t offset_at; /* nf4-dq: fp32 */
    size_t bytes;     /* the whole */
} lg_nf4_layout;

static size_t lg_align4(size_t bytes) { return (bytes + 3) & ~(size_t)3; }

static lg_nf4_layout lg_nf4_layout_of(size_t count, lg_quantization q) {
    lg_nf4_layout l;
    memset(&l, 0, sizeof l);
    if (q == LG_QUANTIZE_NONE) return l;
    l.blocks = (count + LG_NF4_BLOCK - 1) / LG_NF4_BLOCK;
    l.absmax_at = lg_align4((count + 1) / 2);
    if (q == LG_QUANTIZE_NF4) {
        l.bytes = l.absmax_at + l.blocks * sizeof(float);
        return l;
    }
    l.groups = (l.blocks + LG_NF4_DQ_BLOCK - 1) / LG_NF4_DQ_BLOCK;
    l.scales_at = lg_align4(l.absmax_at + l.blocks);
    l.offset_at = l.scales_at + l.groups * sizeof(float);
    l.bytes = l.offset_at + sizeof(float);
    return l;
}

size_t lg_nf4_bytes(size_t count, lg_quantization q) { return lg_nf4_layout_of(count, q).bytes; }

/* a * b rounded to fp32 on its own: the builds contract a * b + c into one rounding (CFLAGS
   -ffp-contract=fast, nvcc's default), which would change the bits bitsandbytes gets. */
LG_HD float lg_product_rounded(float a, float b) { return fmaf(a, b, 0.0f); }

/* Point j of torch.linspace(0.1, 1, n) in fp32 as PyTorch's CPU kernel computes it, from
   which bitsandbytes builds its dynamic map (checked bit for bit against torch 1.13 on AVX2,
   tests/make_nf4_reference.py): 0.1 + step j before n / 2, else 1 - step (n - 1 - j), each
   one fused multiply-add; but the first n / 16 * 16 points go two vectors of 8 at a time, a
   vector's first point so and the others that point plus k step (product, then sum). */
static float lg_torch_linspace_point(int n, int j) {
    const float start = 0.1f, end = 1.0f, step = (end - start) / (float)(n - 1);
    const int vector = 8, vectorized = n / (2 * vector) * (2 * vector);
    int first = j < vectorized ? j - j % vector : j;
    float anchor = first < n / 2 ? fmaf(step, (float)first, start)
                                 : fmaf(-step, (float)(n - 1 - first), end);
    return j == first ? anchor : anchor + lg_product_rounded((float)(j - first), step);
}

/* bitsandbytes' signed dynamic 8-bit map (create_dynamic_map(signed=True)), ascending: for
   decade e = 0..6 the means of neighbouring points of linspace(0.1, 1, 2^e + 1) times
   10^(e - 6) (the power rounded to fp32 first), and their negatives; then 0 and 1. The
   decades follow each other, so the positive values come out ascending. */
static void lg_nf4_dynamic_map(float *map) {
    static const double decades[LG_NF4_DYNAMIC_DECADES] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1};
    const int zero = LG_NF4_DYNAMIC_CODES / 2 - 1; /* 127 values below, 127 and 1.0 above */
    int k = 0;
    for (int e = 0; e < LG_NF4_DYNAMIC_DECADES; e++) {
        int points = (1 << e) + 1;
        for (int j = 0; j + 1 < points; j++, k++) {
            float a = lg_torch_linspace_point(points, j), b = lg_torch_linspace_point(points, j + 1);
            float value = (float)decades[e] * ((a + b) / 2.0f);
            map[zero + 1 + k] = value;
            map[zero - 1 - k] = -value;
        }
    }
    map[zero] = 0.0f;
    map[LG_NF4_DYNAMIC_CODES - 1] = 1.0f;
}

/* The 16 NF4 values as bitsandbytes stores them (fp32): the QLoRA paper's quantiles of N(0, 1)
   scaled to [-1, 1], with an exact 0; a quantized x / absmax takes the code of the nearest,
   through thresholds at the midpoints of neighbours (exact in double, rounded to fp32), a value
   on a threshold going down, as bitsandbytes' comparison tree does. */
static void lg_nf4_codebook_make(lg_nf4_codebook *book) {
    static const float values[LG_NF4_CODES] = {
        -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
        -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
        0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
        0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};
    memcpy(book->nf4, values, sizeof values);
    for (int k = 0; k + 1 < LG_NF4_CODES; k++)
        book->nf4_above[k] = (float)(((double)values[k] + (double)values[k + 1]) / 2);
    lg_nf4_dynamic_map(book->dynamic);
}

/* The NF4 code of x = element / absmax: how many thresholds it is above. */
static int lg_nf4_code(const lg_nf4_codebook *book, float x) {
    int code = 0;
    for (int k = 0; k + 1 < LG_NF4_CODES; k++) code += x > book->nf4_above[k];
    return code;
}

/* nf4-dq: the code of x = (absmax - offset) / scale in the dynamic map: the nearest entry, a
   value exactly on the fp32 midpoint (a + b) / 2 of two neighbours going to the even index
   (where bitsandbytes' binary search over 255 entries ends). */
static uint8_t lg_nf4_dynamic_code(const float *map, float x) {
    int lo = 0, hi = LG_NF4_DYNAMIC_CODES - 1;
    if (x <= map[lo]) return (uint8_t)lo;
    if (x > map[hi]) return (uint8_t)hi;
    while (hi - lo > 1) { /* map[lo] < x <= map[hi] */
        int mid = (lo + hi) / 2;
        if (map[mid] < x) lo = mid;
        else hi = mid;
    }
    float midpoint = (map[lo] + map[hi]) * 0.5f;
    if (x != midpoint) return (uint8_t)(x > midpoint ? hi : lo);
    return (uint8_t)(lo % 2 == 0 ? lo : hi);
}

/* Element i's code in the packed codes. */
LG_HD int lg_nf4_code_at(const uint8_t *codes, size_t i) {
    return i % 2 == 0 ? codes[i / 2] >> 4 : codes[i / 2] & 0x0F;
}

/* The absmax of block b of a stored tensor. nf4-dq: the code's value times its group's scale,
   rounded, then plus the offset (bitsandbytes' dequantize_blockwise, then += offset). */
LG_HD float lg_nf4_block_absmax(const lg_nf4_codebook *book, const uint8_t *stored,
                                const lg_nf4_layout *l, lg_quantization q, size_t b) {
    if (q == LG_QUANTIZE_NF4) return ((const float *)(stored + l->absmax_at))[b];
    float scale = ((const float *)(stored + l->scales_at))[b / LG_NF4_DQ_BLOCK];
    float offset = *(const float *)(stored + l->offset_at);
    return lg_product_rounded(book->dynamic[stored[l->absmax_at + b]], scale) + offset;
}

/* Elements first .. first + n - 1 (one block) of src into the packed codes; returns the
   block's absmax. An absmax of 0 quantizes every x / absmax as 0; an odd n pads with 0. */
static float lg_nf4_quantize_block(const lg_nf4_codebook *book, lg_buf src, size_t first,
                                   size_t n, uint8_t *codes) {
    float x[LG_NF4_BLOCK + 1] = {0}, absmax = 0;
    int code[LG_NF4_BLOCK + 1];
    for (size_t i = 0; i < n; i++) x[i] = (float)lg_get(src, first + i);
    for (size_t i = 0; i < n; i++) absmax = fmaxf(absmax, fabsf(x[i]));
    float inverse = absmax > 0 ? 1.0f / absmax : 0.0f; /* x * (1 / absmax), as bitsandbytes */
    for (size_t i = 0; i < n + 1; i++) code[i] = lg_nf4_code(book, x[i] * inverse);
    for (size_t i = 0; i < n; i += 2)
        codes[(first + i) / 2] = (uint8_t)(code[i] << 4 | code[i + 1]);
    return absmax;
}

/* nf4-dq: absmax (blocks) into their codes, the groups' scales and the offset. */
static void lg_nf4_quantize_absmax(const lg_nf4_codebook *book, const float *absmax,
                                   const lg_nf4_layout *l, uint8_t *stored) {
    double sum = 0; /* in order */
    for (size_t b = 0; b < l->blocks; b++) sum += absmax[b];
    float offset = l->blocks ? (float)(sum / (double)l->blocks) : 0.0f;
    float *scales = (float *)(stored + l->scales_at);
    for (size_t g = 0; g < l->groups; g++) {
        size_t first = g * LG_NF4_DQ_BLOCK;
        size_t n = l->blocks - first < LG_NF4_DQ_BLOCK ? l->blocks - first : LG_NF4_DQ_BLOCK;
        float scale = 0;
        for (size_t i = 0; i < n; i++) scale = fmaxf(scale, fabsf(absmax[first + i] - offset));
        float inverse = scale > 0 ? 1.0f / scale : 0.0f;
        for (size_t i = 0; i < n; i++)
            stored[l->absmax_at + first + i] =
                lg_nf4_dynamic_code(book->dynamic, (absmax[first + i] - offset) * inverse);
        scales[g] = scale;
    }
    memcpy(stored + l->offset_at, &offset, sizeof offset);
}

int lg_nf4_quantize(lg_buf src, size_t count, lg_quantization q, uint8_t *dst, lg_error *err) {
    if (q == LG_QUANTIZE_NONE) return 0;
    lg_nf4_codebook book;
    lg_nf4_codebook_make(&book);
    lg_nf4_layout l = lg_nf4_layout_of(count, q);
    memset(dst, 0, l.bytes);
    float *absmax = q == LG_QUANTIZE_NF4 ? (float *)(dst + l.absmax_at)
                                         : (float *)lg_alloc_zeroed(l.blocks * sizeof(float));
    if (!absmax) return lg_fail(err, "nf4-dq: no memory for the absmax of %zu blocks", l.blocks);
    LG_OMP(omp parallel for)
    for (long b = 0; b < (long)l.blocks; b++) {
        size_t first = (size_t)b * LG_NF4_BLOCK, rest = count - first;
        size_t n = rest < LG_NF4_BLOCK ? rest : LG_NF4_BLOCK;
        absmax[b] = lg_nf4_quantize_block(&book, src, first, n, dst);
    }
    if (q == LG_QUANTIZE_NF4) return 0;
    lg_nf4_quantize_absmax(&book, absmax, &l, dst);
    LG_FREE(absmax);
    return 0;
}

/* 3. config ----------------------------------------------------------------------------------- */

typedef enum { LG_FIELD_INT, LG_FIELD_FLOAT, LG_FIELD_BOOL, LG_FIELD_NAME, LG_FIELD_NORM,
               LG_FIELD_MLP, LG_FIELD_GELU } lg_field_type;

/* The config's fields: the one table that the YAML loader, the model_config.yaml writer and
   the config.json writer (section 13, through its Hugging Face names) walk. litgpt_default is
   LitGPT's Config default (litgpt/config.py) as the YAML would spell it; NULL for the name
   (the file's) and the fields lg_config_derive derives when the file leaves them out.
   tie_embeddings and learned_pos_embedding are this trainer's (GPT-2); LitGPT has neither. */
typedef struct {
    const char *key;            /* LitGPT's name */
    lg_field_type type;
    size_t offset;              /* in lg_config */
    const char *litgpt_default;
} lg_config_field;

#define LG_FIELD(key, type, litgpt_default) {#key, type, offsetof(lg_config, key), litgpt_default}
static const lg_config_field lg_config_fields[] = {
    LG_FIELD(name, LG_FIELD_NAME, NULL),
    LG_FIELD(n_layer, LG_FIELD_INT, "16"),
    LG_FIELD(n_head, LG_FIELD_INT, "32"),
    LG_FIELD(n_query_groups, LG_FIELD_INT, NULL),
    LG_FIELD(n_embd, LG_FIELD_INT, "4096"),
    LG_FIELD(head_size, LG_FIELD_INT, NULL),
    LG_FIELD(intermediate_size, LG_FIELD_INT, NULL),
    LG_FIELD(block_size, LG_FIELD_INT, "4096"),
    LG_FIELD(vocab_size, LG_FIELD_INT, "50254"),
    LG_FIELD(padded_vocab_size, LG_FIELD_INT, NULL),
    LG_FIELD(norm_class_name, LG_FIELD_NORM, "LayerNorm"),
    LG_FIELD(norm_eps, LG_FIELD_FLOAT, "1e-5"),
    LG_FIELD(mlp_class_name, LG_FIELD_MLP, "GptNeoxMLP"),
    {"gelu_approximate", LG_FIELD_GELU, offsetof(lg_config, gelu_approximate_tanh), "none"},
    LG_FIELD(rotary_percentage, LG_FIELD_FLOAT, "0.25"),
    LG_FIELD(rope_base, LG_FIELD_FLOAT, "10000"),
    LG_FIELD(parallel_residual, LG_FIELD_BOOL, "true"),
    LG_FIELD(shared_attention_norm, LG_FIELD_BOOL, "false"),
    LG_FIELD(bias, LG_FIELD_BOOL, "true"),
    LG_FIELD(attn_bias, LG_FIELD_BOOL, "false"),
    LG_FIELD(lm_head_bias, LG_FIELD_BOOL, "false"),
    LG_FIELD(tie_embeddings, LG_FIELD_BOOL, "false"),
    LG_FIELD(learned_pos_embedding, LG_FIELD_BOOL, "false"),
};
#undef LG_FIELD
#define LG_N_CONFIG_FIELDS ((int)(sizeof lg_config_fields / sizeof lg_config_fields[0]))

/* The lines of LitGPT's nested rope_adjustments block (offsets within lg_config). */
#define LG_ROPE_FIELD(key, type)                                                                \
    {#key, type, offsetof(lg_config, rope_adjustments) + offsetof(lg_rope_adjustments, key), NULL}
static const lg_config_field lg_rope_fields[] = {
    LG_ROPE_FIELD(factor, LG_FIELD_FLOAT),
    LG_ROPE_FIELD(low_freq_factor, LG_FIELD_FLOAT),
    LG_ROPE_FIELD(high_freq_factor, LG_FIELD_FLOAT),
    LG_ROPE_FIELD(original_max_seq_len, LG_FIELD_INT),
};
#undef LG_ROPE_FIELD
#define LG_N_ROPE_FIELDS ((int)(sizeof lg_rope_fields / sizeof lg_rope_fields[0]))

static char *lg_trim(char *s) {
    while (isspace((unsigned char)*s)) s++;
    char *end = s + strlen(s);
    while (end > s && isspace((unsigned char)end[-1])) *--end = '\0';
    if (end - s >= 2 && (*s == '"' || *s == '\'') && end[-1] == *s) { end[-1] = '\0'; s++; }
    return s;
}

/* Parses one value into its field; returns 0 or -1 when the text is not of the field's type. */
static int lg_config_set(lg_config *cfg, const lg_config_field *f, const char *value) {
    char *field = (char *)cfg + f->offset, *end = NULL;
    switch (f->type) {
    case LG_FIELD_INT: {
        long v = strtol(value, &end, 10);
        if (*value == '\0' || *end != '\0' || v < 0 || v > 2000000000L) return -1;
        *(int *)field = (int)v;
        return 0;
    }
    case LG_FIELD_FLOAT: {
        double v = strtod(value, &end);
        if (*value == '\0' || *end != '\0' || !isfinite((float)v)) return -1;
        *(float *)field = (float)v;
        return 0;
    }
    case LG_FIELD_BOOL:
        if (strcmp(value, "true") == 0 || strcmp(value, "True") == 0) *(int *)field = 1;
        else if (strcmp(value, "false") == 0 || strcmp(value, "False") == 0) *(int *)field = 0;
        else return -1;
        return 0;
    case LG_FIELD_NAME:
        if (strlen(value) >= sizeof cfg->name) return -1;
        strcpy(field, value);
        return 0;
    case LG_FIELD_NORM:
        if (strcmp(value, "LayerNorm") == 0) *(lg_norm_class *)field = LG_NORM_LAYERNORM;
        else if (strcmp(value, "RMSNorm") == 0) *(lg_norm_class *)field = LG_NORM_RMSNORM;
        else return -1;
        return 0;
    case LG_FIELD_MLP:
        if (strcmp(value, "GptNeoxMLP") == 0) *(lg_mlp_class *)field = LG_MLP_GPTNEOX;
        else if (strcmp(value, "LLaMAMLP") == 0) *(lg_mlp_class *)field = LG_MLP_LLAMA;
        else return -1;
        return 0;
    case LG_FIELD_GELU:
        if (strcmp(value, "tanh") == 0) *(int *)field = 1;
        else if (strcmp(value, "none") == 0) *(int *)field = 0;
        else return -1;
        return 0;
    }
    return -1;
}

static const char *lg_field_expectation(lg_field_type type) {
    switch (type) {
    case LG_FIELD_INT: return "a non-negative integer";
    case LG_FIELD_FLOAT: return "a finite number";
    case LG_FIELD_BOOL: return "true or false";
    case LG_FIELD_NAME: return "a name of at most 63 characters";
    case LG_FIELD_NORM: return "LayerNorm or RMSNorm";
    case LG_FIELD_MLP: return "GptNeoxMLP or LLaMAMLP";
    case LG_FIELD_GELU: return "none or tanh";
    }
    return "";
}

/* A field's value as the YAML spells it (the inverse of lg_config_set), into out. */
static const char *lg_config_field_text(const lg_config *cfg, const lg_config_field *f, char *out,
                                        size_t cap) {
    const char *field = (const char *)cfg + f->offset;
    int flag = f->type == LG_FIELD_FLOAT || f->type == LG_FIELD_NAME ? 0 : *(const int *)field;
    switch (f->type) {
    case LG_FIELD_INT: snprintf(out, cap, "%d", flag); break;
    case LG_FIELD_FLOAT: snprintf(out, cap, "%.9g", *(const float *)field); break;
    case LG_FIELD_BOOL: snprintf(out, cap, "%s", flag ? "true" : "false"); break;
    case LG_FIELD_NAME: snprintf(out, cap, "%s", field); break;
    case LG_FIELD_NORM:
        snprintf(out, cap, "%s", flag == LG_NORM_RMSNORM ? "RMSNorm" : "LayerNorm");
        break;
    case LG_FIELD_MLP:
        snprintf(out, cap, "%s", flag == LG_MLP_LLAMA ? "LLaMAMLP" : "GptNeoxMLP");
        break;
    case LG_FIELD_GELU: snprintf(out, cap, "%s", flag ? "tanh" : "none"); break;
    }
    return out;
}

/* The index of key in lg_config_fields, or -1. */
static int lg_config_field_index(const char *key) {
    for (int i = 0; i < LG_N_CONFIG_FIELDS; i++)
        if (strcmp(key, lg_config_fields[i].key) == 0) return i;
    return -1;
}

/* LitGPT's fields this trainer does not model, and the values that leave the architecture as
   built here; any other value is refused naming the field. */
typedef enum {
    LG_NEUTRAL_ANY,    /* hf_config (where the weights came from), padding_multiple (read) */
    LG_NEUTRAL_NULL,   /* null, ~, None, or nothing */
    LG_NEUTRAL_FALSE,
    LG_NEUTRAL_TRUE,
    LG_NEUTRAL_ZERO,
    LG_NEUTRAL_ONE,
    LG_NEUTRAL_DEFAULT, /* norm_qk_type: "default" */
    LG_NEUTRAL_WINDOW   /* sliding_window_size: null, or a window as long as block_size */
} lg_neutral;

static const struct {
    const char *key;
    lg_neutral neutral;
} lg_config_unmodelled[] = {
    {"hf_config", LG_NEUTRAL_ANY},
    {"padding_multiple", LG_NEUTRAL_ANY},
    {"norm_qk", LG_NEUTRAL_FALSE},
    {"norm_qk_type", LG_NEUTRAL_DEFAULT},
    {"post_attention_norm", LG_NEUTRAL_FALSE},
    {"post_mlp_norm", LG_NEUTRAL_FALSE},
    {"attention_scores_scalar", LG_NEUTRAL_NULL},
    {"sliding_window_size", LG_NEUTRAL_WINDOW},
    {"sliding_window_indices", LG_NEUTRAL_ANY}, /* only with sliding_window_size */
    {"attention_logit_softcapping", LG_NEUTRAL_NULL},
    {"rope_condense_ratio", LG_NEUTRAL_ONE},
    {"rope_interleave", LG_NEUTRAL_FALSE},
    {"n_expert", LG_NEUTRAL_ZERO},
    {"n_expert_per_token", LG_NEUTRAL_ZERO},
    /* mixture of experts: only with n_expert */
    {"moe_intermediate_size", LG_NEUTRAL_ANY},
    {"n_shared_expert", LG_NEUTRAL_ANY},
    {"n_expert_groups", LG_NEUTRAL_ANY},
    {"n_topk_groups", LG_NEUTRAL_ANY},
    {"n_topk_scores_per_group", LG_NEUTRAL_ANY},
    {"first_k_dense_replace", LG_NEUTRAL_ANY},
    {"routed_scaling_factor", LG_NEUTRAL_ANY},
    {"norm_topk_prob", LG_NEUTRAL_ANY},
    {"scale_embeddings", LG_NEUTRAL_FALSE},
    {"final_logit_softcapping", LG_NEUTRAL_NULL},
    {"norm_1", LG_NEUTRAL_TRUE},
    {"norm_2", LG_NEUTRAL_TRUE},
    {"latent_attention", LG_NEUTRAL_NULL},
    {"rope_local_base_freq", LG_NEUTRAL_NULL},
    {"rope_indices", LG_NEUTRAL_NULL},
};
#define LG_N_CONFIG_UNMODELLED ((int)(sizeof lg_config_unmodelled / sizeof lg_config_unmodelled[0]))

static int lg_yaml_is_null(const char *v) {
    return *v == '\0' || strcmp(v, "null") == 0 || strcmp(v, "~") == 0 || strcmp(v, "None") == 0;
}

/* Does value (nested: a mapping or list follows on the next lines) leave the architecture as
   built here? A window is checked against block_size once the whole file is read. */
static int lg_neutral_value(lg_neutral neutral, const char *v, int nested) {
    int null = !nested && lg_yaml_is_null(v);
    switch (neutral) {
    case LG_NEUTRAL_ANY: return 1;
    case LG_NEUTRAL_NULL: return null;
    case LG_NEUTRAL_FALSE: return strcmp(v, "false") == 0 || strcmp(v, "False") == 0;
    case LG_NEUTRAL_TRUE: return strcmp(v, "true") == 0 || strcmp(v, "True") == 0;
    case LG_NEUTRAL_ZERO: return strcmp(v, "0") == 0;
    case LG_NEUTRAL_ONE: return strcmp(v, "1") == 0;
    case LG_NEUTRAL_DEFAULT: return strcmp(v, "default") == 0;
    case LG_NEUTRAL_WINDOW: return null || atol(v) > 0;
    }
    return 0;
}

/* The fields LitGPT's __post_init__ derives when the file leaves them out: head_size =
   n_embd / n_head, n_query_groups = n_head, intermediate_size = 4 n_embd (a LLaMAMLP must give
   it), padded_vocab_size = vocab_size rounded up to padding_multiple; a given
   padded_vocab_size caps vocab_size. */
/* k x a for a size's default, held at 2^31 - 1 (or -1 for a negative a) rather than wrapped:
   the bounds (lg_config_check) then refuse it by name */
static int lg_size_times(int a, int k) { return a > 2147483647 / k ? 2147483647 : a < 0 ? -1 : a * k; }

static int lg_config_derive(lg_config *c, const int *seen, int padding_multiple, lg_error *err) {
#define LG_SEEN(field) seen[lg_config_field_index(#field)]
    if (!LG_SEEN(head_size)) {
        if (c->n_head < 1 || c->n_embd % c->n_head != 0)
            return lg_fail(err, "no head_size, and n_embd %d is not a multiple of n_head %d",
                           c->n_embd, c->n_head);
        c->head_size = c->n_embd / c->n_head;
    }
    if (!LG_SEEN(n_query_groups)) c->n_query_groups = c->n_head;
    if (!LG_SEEN(intermediate_size)) {
        if (c->mlp_class_name == LG_MLP_LLAMA)
            return lg_fail(err, "missing field intermediate_size: a LLaMAMLP needs it");
        c->intermediate_size = lg_size_times(c->n_embd, 4);
    }
    if (!LG_SEEN(padded_vocab_size)) {
        if (padding_multiple < 1) return lg_fail(err, "padding_multiple must be positive");
        int rest = c->vocab_size % padding_multiple;
        c->padded_vocab_size = c->vocab_size + (rest ? padding_multiple - rest : 0);
    } else if (c->vocab_size > c->padded_vocab_size) {
        c->vocab_size = c->padded_vocab_size;
    }
#undef LG_SEEN
    return 0;
}

/* The file's name without directory and extension: the model's name when the file has none. */
static void lg_config_name_from_path(lg_config *cfg, const char *path) {
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    size_t len = strcspn(base, ".");
    if (len >= sizeof cfg->name) len = sizeof cfg->name - 1;
    memcpy(cfg->name, base, len);
    cfg->name[len] = '\0';
}

/* One `key: value` line of the file into cfg (field i of the table, marked seen), or a field
   LitGPT knows and this trainer does not model (its value checked by the caller: *unmodelled is
   its index), or an error naming the line. */
static int lg_config_line(lg_config *cfg, const char *path, int line_no, const char *key,
                          const char *value, int *seen, int *padding_multiple, int *unmodelled,
                          lg_error *err) {
    *unmodelled = -1;
    int i = lg_config_field_index(key);
    if (i >= 0) {
        if (lg_config_set(cfg, &lg_config_fields[i], value) != 0)
            return lg_fail(err, "config %s line %d: %s is '%s', expected %s", path, line_no, key,
                           value, lg_field_expectation(lg_config_fields[i].type));
        seen[i] = 1;
        return 0;
    }
    for (int k = 0; k < LG_N_CONFIG_UNMODELLED; k++)
        if (strcmp(key, lg_config_unmodelled[k].key) == 0) *unmodelled = k;
    if (*unmodelled < 0)
        return lg_fail(err, "config %s line %d: unknown field %s (not one of LitGPT's Config "
                            "fields; a typo?)", path, line_no, key);
    if (strcmp(key, "padding_multiple") == 0) {
        char *end;
        long v = strtol(value, &end, 10);
        if (*value == '\0' || *end != '\0' || v < 1 || v > 1000000)
            return lg_fail(err, "config %s line %d: padding_multiple is '%s', expected a "
                                "positive integer", path, line_no, value);
        *padding_multiple = (int)v;
    }
    return 0;
}

/* Reads a flat `key: value` YAML file ('#' starts a comment) as LitGPT's Config.from_file does:
   fields left out take LitGPT's defaults or are derived (lg_config_derive); LitGPT's own
   model_config.yaml files load too (indented lines and `- item` lists are a nested value of
   the key before). A field LitGPT knows but this trainer does not model loads when its value
   leaves the architecture as built here (lg_config_unmodelled), else it is refused by name;
   an unknown field is refused by name. The one nested block read is rope_adjustments' (its
   indented lines), or `rope_adjustments: null`. */
/* One indented line of rope_adjustments' block: `key: value` of lg_rope_fields. */
static int lg_config_rope_line(lg_config *cfg, const char *path, int line_no, char *text,
                               int *rope_seen, lg_error *err) {
    char *colon = strchr(text, ':');
    if (!colon) return lg_fail(err, "config %s line %d: expected `key: value`", path, line_no);
    *colon = '\0';
    const char *key = lg_trim(text), *value = lg_trim(colon + 1);
    for (int i = 0; i < LG_N_ROPE_FIELDS; i++) {
        if (strcmp(key, lg_rope_fields[i].key) != 0) continue;
        if (lg_config_set(cfg, &lg_rope_fields[i], value) != 0)
            return lg_fail(err, "config %s line %d: rope_adjustments.%s is '%s', expected %s", path,
                           line_no, key, value, lg_field_expectation(lg_rope_fields[i].type));
        rope_seen[i] = 1;
        return 0;
    }
    return lg_fail(err, "config %s line %d: unknown field rope_adjustments.%s", path, line_no, key);
}

int lg_config_load(lg_config *cfg, const char *path, lg_error *err) {
    FILE *f = fopen(path, "r");
    if (!f) return lg_fail(err, "config %s: cannot open: %s", path, strerror(errno));
    memset(cfg, 0, sizeof *cfg);
    for (int i = 0; i < LG_N_CONFIG_FIELDS; i++)
        if (lg_config_fields[i].litgpt_default)
            lg_config_set(cfg, &lg_config_fields[i], lg_config_fields[i].litgpt_default);
    lg_config_name_from_path(cfg, path);
    int seen[LG_N_CONFIG_FIELDS] = {0}, rope_seen[LG_N_ROPE_FIELDS] = {0};
    int padding_multiple = 512, window = 0, in_rope_block = 0, rope_block = 0;
    char line[1024], value[256];
    int line_no = 0, open_key = -1, open_line = 0; /* an unmodelled field that may be nested */
    int rc = 0;
    while (rc == 0 && fgets(line, sizeof line, f)) {
        line_no++;
        char *hash = strchr(line, '#');
        if (hash) *hash = '\0';
        char *text = lg_trim(line);
        if (*text == '\0') continue;
        int nested = isspace((unsigned char)line[0]) || strncmp(text, "- ", 2) == 0 ||
                     strcmp(text, "-") == 0;
        if (nested && in_rope_block) {
            rc = lg_config_rope_line(cfg, path, line_no, text, rope_seen, err);
            continue;
        }
        if (nested) {
            if (open_key >= 0 && !lg_neutral_value(lg_config_unmodelled[open_key].neutral, "", 1))
                rc = lg_fail(err, "config %s line %d: %s is set, which this trainer does not "
                                  "model (LitGPT's default leaves it out)", path, open_line,
                             lg_config_unmodelled[open_key].key);
            continue;
        }
        open_key = -1;
        in_rope_block = 0;
        char *colon = strchr(text, ':');
        if (!colon) {
            rc = lg_fail(err, "config %s line %d: expected `key: value`", path, line_no);
            break;
        }
        *colon = '\0';
        char *key = lg_trim(text);
        snprintf(value, sizeof value, "%s", lg_trim(colon + 1));
        if (strcmp(key, "rope_adjustments") == 0) { /* LitGPT's nested block, or null */
            in_rope_block = rope_block = *value == '\0';
            if (!rope_block && strcmp(value, "null") != 0)
                rc = lg_fail(err, "config %s line %d: rope_adjustments is '%s', expected null or "
                                  "an indented block of factor, low_freq_factor, high_freq_factor, "
                                  "original_max_seq_len", path, line_no, value);
            continue;
        }
        int k;
        rc = lg_config_line(cfg, path, line_no, key, value, seen, &padding_multiple, &k, err);
        if (rc != 0 || k < 0) continue;
        if (!lg_neutral_value(lg_config_unmodelled[k].neutral, value, 0))
            rc = lg_fail(err, "config %s line %d: %s is '%s', which this trainer does not model "
                              "(LitGPT's default leaves it out)", path, line_no, key, value);
        if (lg_config_unmodelled[k].neutral == LG_NEUTRAL_WINDOW && !lg_yaml_is_null(value))
            window = atoi(value);
        if (*value == '\0') { open_key = k; open_line = line_no; }
    }
    fclose(f);
    if (rc != 0) return rc;
    for (int i = 0; i < LG_N_ROPE_FIELDS && rope_block; i++)
        if (!rope_seen[i])
            return lg_fail(err, "config %s: missing field rope_adjustments.%s", path,
                           lg_rope_fields[i].key);
    if (window > 0 && window < cfg->block_size)
        return lg_fail(err, "config %s: sliding_window_size %d is shorter than block_size %d: "
                            "sliding-window attention is not modelled here", path, window,
                       cfg->block_size);
    char inner[sizeof err->msg];
    if (lg_config_derive(cfg, seen, padding_multiple, err) != 0 || lg_config_check(cfg, err) != 0) {
        strcpy(inner, err->msg);
        return lg_fail(err, "config %s: %s", path, inner);
    }
    return 0;
}

/* (NH + 2 NQG) HS */
static int lg_config_qkv_size(const lg_config *c) {
    return (c->n_head + 2 * c->n_query_groups) * c->head_size;
}

int lg_config_rope_dims(const lg_config *c) {
    int dims = (int)(c->rotary_percentage * c->head_size);
    return dims - dims % 2;
}

/* LitGPT's module names of the adapted linears (lg_lora_linear order), for GPT-NeoX MLPs and
   LLaMA MLPs. */
static const char *const lg_lora_linear_names[2][LG_LORA_BLOCK_LINEARS] = {
    {"attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "", "mlp.proj"},
    {"attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc_1", "mlp.fc_2", "mlp.proj"}};

/* The base weight each adapted linear adds to (lg_lora_linear order): q, k and v share qkv. */
static const char *const lg_lora_base_weights[2][LG_LORA_BLOCK_LINEARS] = {
    {"attn.qkv.weight", "attn.qkv.weight", "attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight",
     "", "mlp.proj.weight"},
    {"attn.qkv.weight", "attn.qkv.weight", "attn.qkv.weight", "attn.proj.weight",
     "mlp.fc_1.weight", "mlp.fc_2.weight", "mlp.proj.weight"}};

/* LoRA: LitGPT's target names, in the order of the LG_LORA_* bits. */
static const char *const lg_lora_target_names[] = {"q", "k", "v", "proj", "mlp", "head"};
#define LG_LORA_N_TARGETS 6

int lg_lora_targets_parse(const char *text, unsigned *targets, lg_error *err) {
    *targets = 0;
    if (strcmp(text, "all") == 0) text = LG_LORA_ALL_LINEARS;
    const char *at = text;
    while (*at) {
        size_t len = strcspn(at, ",");
        int found = -1;
        for (int k = 0; k < LG_LORA_N_TARGETS; k++)
            if (strlen(lg_lora_target_names[k]) == len && strncmp(at, lg_lora_target_names[k], len) == 0)
                found = k;
        if (found < 0)
            return lg_fail(err, "unknown target '%.*s' in '%s' (known: q, k, v, "
                                "proj, mlp, head; or all)", (int)len, at, text);
        *targets |= 1u << found;
        at += len + (at[len] == ',');
    }
    if (!*targets) return lg_fail(err, "no target in '%s'", text);
    return 0;
}

const char *lg_lora_targets_name(unsigned targets, char *buf, size_t size) {
    size_t used = 0;
    buf[0] = '\0';
    for (int k = 0; k < LG_LORA_N_TARGETS; k++)
        if (targets & (1u << k))
            used += (size_t)snprintf(buf + used, used < size ? size - used : 0, "%s%s",
                                     used ? "," : "", lg_lora_target_names[k]);
    return buf;
}

/* The target bit each block linear answers to. */
static unsigned lg_lora_target_of(lg_lora_linear linear) {
    switch (linear) {
    case LG_LORA_Q: return LG_LORA_QUERY;
    case LG_LORA_K: return LG_LORA_KEY;
    case LG_LORA_V: return LG_LORA_VALUE;
    case LG_LORA_PROJ: return LG_LORA_PROJECTION;
    default: return LG_LORA_MLP;
    }
}

/* in and out features of an adapted linear (0, 0 when the architecture has no such linear). */
static void lg_lora_dims(const lg_config *c, lg_lora_linear linear, int *in, int *out) {
    int C = c->n_embd, I = c->intermediate_size, HS = c->head_size;
    int llama = c->mlp_class_name == LG_MLP_LLAMA;
    *in = C;
    *out = 0;
    switch (linear) {
    case LG_LORA_Q: *out = c->n_head * HS; break;
    case LG_LORA_K:
    case LG_LORA_V: *out = c->n_query_groups * HS; break;
    case LG_LORA_PROJ: *in = c->n_head * HS; *out = C; break;
    case LG_LORA_FC: *out = I; break;
    case LG_LORA_FC_2: *out = llama ? I : 0; break;
    case LG_LORA_MLP_PROJ: *in = I; *out = C; break;
    default: break;
    }
    if (!*out) *in = 0;
}

/* The first output row of a linear's adapter in its base weight: the key and value rows follow
   the query rows inside attn.qkv; every other linear starts at 0. */
static int lg_lora_first_row(const lg_config *c, lg_lora_linear linear) {
    int HS = c->head_size;
    return linear == LG_LORA_K ? c->n_head * HS
           : linear == LG_LORA_V ? (c->n_head + c->n_query_groups) * HS
                                 : 0;
}

/* Whether the block linear gets adapters under cfg->lora. */
static int lg_lora_adapts(const lg_config *c, lg_lora_linear linear) {
    int in, out;
    lg_lora_dims(c, linear, &in, &out);
    return c->lora.r > 0 && out > 0 && (c->lora.targets & lg_lora_target_of(linear));
}

/* --offload embedding keeps an untied token embedding without position embeddings in host
   memory: a head of its own (a tied head reads every row), the device adding nothing to its
   rows. LoRA's base table is frozen; a trained one needs the run's checks too
   (lg_args_check_offload_embedding). */
static int lg_host_embedding_check(const lg_config *c, lg_error *err) {
    if (!c->lora.host_embedding) return 0;
    if (c->tie_embeddings)
        return lg_fail(err, "`offload embedding`: %s ties lm_head to the token embedding "
                            "(tie_embeddings), whose every row the head reads on the device",
                       c->name);
    if (c->learned_pos_embedding)
        return lg_fail(err, "`offload embedding`: %s adds learned position embeddings to the "
                            "rows, which is not built yet", c->name);
    return 0;
}

/* The adapters fit the architecture: r no larger than the smaller side of any adapted linear. */
static int lg_lora_check(const lg_config *c, lg_error *err) {
    const lg_lora *lo = &c->lora;
    if (lo->r < 0) return lg_fail(err, "`lora.r` must be >= 0 (0: no LoRA)");
    if (lg_host_embedding_check(c, err) != 0) return -1;
    if (lo->r == 0) {
        if (lo->quantize != LG_QUANTIZE_NONE)
            return lg_fail(err, "`lora.quantize %s` needs `lora.r`: a quantized model cannot be fully "
                                "fine-tuned, only adapters over it", lg_quantization_name(lo->quantize));
        return 0;
    }
    if (!lo->targets) return lg_fail(err, "`lora.targets`: no target");
    if (!(lo->alpha > 0.0f)) return lg_fail(err, "`lora.alpha` must be positive");
    if (!(lo->dropout >= 0.0f && lo->dropout < 1.0f))
        return lg_fail(err, "`lora.dropout` must be within [0, 1)");
    int llama = c->mlp_class_name == LG_MLP_LLAMA;
    for (int k = 0; k < LG_LORA_BLOCK_LINEARS; k++) {
        int in, out;
        if (!lg_lora_adapts(c, (lg_lora_linear)k)) continue;
        lg_lora_dims(c, (lg_lora_linear)k, &in, &out);
        if (lo->r > (in < out ? in : out))
            return lg_fail(err, "`lora.r` %d exceeds %s's smaller dimension %d (%d x %d)", lo->r,
                           lg_lora_linear_names[llama][k], in < out ? in : out, out, in);
    }
    if ((lo->targets & LG_LORA_HEAD) && c->tie_embeddings)
        return lg_fail(err, "`lora.targets head`: this model ties lm_head to the token embeddings "
                            "(tie_embeddings), so its merged adapter would change the embeddings "
                            "too; adapt the other linears");
    if ((lo->targets & LG_LORA_HEAD) && lo->r > c->n_embd)
        return lg_fail(err, "`lora.r` %d exceeds lm_head's smaller dimension %d", lo->r, c->n_embd);
    if (lo->head_tile_rows < 0 || lo->head_tile_rows % LG_HEAD_TILE_ALIGN != 0)
        return lg_fail(err, "LoRA's head_tile_rows %d is not a multiple of %d (0: %d)",
                       lo->head_tile_rows, LG_HEAD_TILE_ALIGN, LG_HEAD_TILE_ROWS);
    return 0;
}

/* The vocabulary rows of a tile of the NF4 lm_head (lg_lora.head_tile_rows), at most the
   padded vocabulary: Vp is one tile. */
static int lg_head_tile_rows(const lg_config *c) {
    int rows = c->lora.head_tile_rows > 0 ? c->lora.head_tile_rows : LG_HEAD_TILE_ROWS;
    return rows < c->padded_vocab_size ? rows : c->padded_vocab_size;
}

/* The largest architecture the layouts address: each dimension's limit (far above every
   published model: Llama 3.1 405B has 126 layers, 16,384 channels, 53,248 MLP units and a
   vocabulary of 128,256), and every weight matrix below 2^31 elements, since kernels index a
   matrix's rows and columns with int. Checked before any plan or allocation. */
typedef struct {
    const char *field;
    size_t offset; /* of the int in lg_config */
    long max;
} lg_config_bound;

#define LG_MAX_MATRIX_ELEMENTS 2147483647ull /* INT_MAX: one weight matrix */
static const lg_config_bound lg_config_bounds[] = {
    {"n_layer", offsetof(lg_config, n_layer), 4096},
    {"n_head", offsetof(lg_config, n_head), 4096},
    {"n_query_groups", offsetof(lg_config, n_query_groups), 4096},
    {"head_size", offsetof(lg_config, head_size), 4096},
    {"n_embd", offsetof(lg_config, n_embd), 1L << 18},
    {"intermediate_size", offsetof(lg_config, intermediate_size), 1L << 20},
    {"block_size", offsetof(lg_config, block_size), 1L << 24},
    {"vocab_size", offsetof(lg_config, vocab_size), 1L << 24},
    {"padded_vocab_size", offsetof(lg_config, padded_vocab_size), 1L << 24},
};
#define LG_N_CONFIG_BOUNDS ((int)(sizeof lg_config_bounds / sizeof lg_config_bounds[0]))

/* Each dimension at most its limit, then every product the layouts form (in 64 bits, each
   factor bounded above, so none wraps) within LG_MAX_MATRIX_ELEMENTS. */
static int lg_config_check_sizes(const lg_config *c, lg_error *err) {
    for (int k = 0; k < LG_N_CONFIG_BOUNDS; k++) {
        const lg_config_bound *b = &lg_config_bounds[k];
        int v = *(const int *)((const char *)c + b->offset);
        if (v > b->max)
            return lg_fail(err, "%s %d exceeds the limit %ld", b->field, v, b->max);
    }
    uint64_t NH = (uint64_t)c->n_head, NQG = (uint64_t)c->n_query_groups;
    uint64_t HS = (uint64_t)c->head_size, C = (uint64_t)c->n_embd;
    struct { const char *what; uint64_t rows, cols; } products[] = {
        {"(n_head + 2 n_query_groups) x head_size x n_embd (attn.qkv)", (NH + 2 * NQG) * HS, C},
        {"n_head x head_size x n_embd (attn.proj)", NH * HS, C},
        {"intermediate_size x n_embd (the MLP)", (uint64_t)c->intermediate_size, C},
        {"padded_vocab_size x n_embd (embeddings, lm_head)", (uint64_t)c->padded_vocab_size, C},
        {"block_size x n_embd (learned positions)", (uint64_t)c->block_size,
         c->learned_pos_embedding ? C : 0},
        {"block_size x head_size (rotary tables)", (uint64_t)c->block_size, HS},
    };
    for (size_t k = 0; k < sizeof products / sizeof products[0]; k++)
        if (products[k].rows * products[k].cols > LG_MAX_MATRIX_ELEMENTS)
            return lg_fail(err, "%s is %llu elements, over the limit %llu of one matrix",
                           products[k].what,
                           (unsigned long long)(products[k].rows * products[k].cols),
                           LG_MAX_MATRIX_ELEMENTS);
    return 0;
}

/* Every float field finite (a YAML or config.json value beyond float range reads as inf). */
static int lg_config_check_finite(const lg_config *c, lg_error *err) {
    const lg_rope_adjustments *ra = &c->rope_adjustments;
    struct { const char *field; float v; } fields[] = {
        {"norm_eps", c->norm_eps}, {"rotary_percentage", c->rotary_percentage},
        {"rope_base", c->rope_base}, {"rope_adjustments.factor", ra->factor},
        {"rope_adjustments.low_freq_factor", ra->low_freq_factor},
        {"rope_adjustments.high_freq_factor", ra->high_freq_factor},
    };
    for (size_t k = 0; k < sizeof fields / sizeof fields[0]; k++)
        if (!isfinite(fields[k].v))
            return lg_fail(err, "%s must be a finite number, not %g", fields[k].field,
                           (double)fields[k].v);
    if (c->rotary_percentage > 0.0f && !(c->rope_base > 1.0f))
        return lg_fail(err, "rope_base must be above 1 (it is %g)", (double)c->rope_base);
    return 0;
}

int lg_config_check(const lg_config *c, lg_error *err) {
    if (lg_config_check_sizes(c, err) != 0 || lg_config_check_finite(c, err) != 0) return -1;
    if (c->n_layer < 1) return lg_fail(err, "n_layer must be at least 1");
    if (c->n_head < 1 || c->head_size < 1 || c->n_embd < 1 || c->intermediate_size < 1)
        return lg_fail(err, "n_head, head_size, n_embd and intermediate_size must be positive");
    if (c->n_query_groups < 1 || c->n_head % c->n_query_groups != 0)
        return lg_fail(err, "n_query_groups (%d) must divide n_head (%d)", c->n_query_groups,
                       c->n_head);
    if (c->vocab_size < 1 || c->padded_vocab_size < c->vocab_size)
        return lg_fail(err, "padded_vocab_size (%d) must be at least vocab_size (%d)",
                       c->padded_vocab_size, c->vocab_size);
    if (c->block_size < 1) return lg_fail(err, "block_size must be positive");
    if (c->rotary_percentage < 0.0f || c->rotary_percentage > 1.0f)
        return lg_fail(err, "rotary_percentage must be within [0, 1]");
    if (c->norm_eps <= 0.0f) return lg_fail(err, "norm_eps must be positive");
    if (c->shared_attention_norm && !c->parallel_residual)
        return lg_fail(err, "shared_attention_norm needs parallel_residual");
    const lg_rope_adjustments *ra = &c->rope_adjustments;
    if (ra->factor != 0.0f && (ra->factor < 1.0f || ra->original_max_seq_len < 1 ||
                               ra->low_freq_factor <= 0.0f ||
                               ra->high_freq_factor <= ra->low_freq_factor))
        return lg_fail(err, "rope_adjustments needs factor >= 1, original_max_seq_len >= 1 and "
                            "0 < low_freq_factor < high_freq_factor");
    return lg_lora_check(c, err);
}

/* The built-in run's model: a small Llama (RMSNorm, rotary, SwiGLU, grouped-query attention)
   over the 28 characters of the built-in task. */
void lg_config_builtin(lg_config *c) {
    memset(c, 0, sizeof *c);
    strcpy(c->name, "builtin-sort");
    c->n_layer = 3;
    c->n_head = 4;
    c->n_query_groups = 2;
    c->n_embd = 96;
    c->head_size = 24;
    c->intermediate_size = 256;
    c->block_size = 64;
    c->vocab_size = LG_CHAR_VOCAB;
    c->padded_vocab_size = 32;
    c->norm_class_name = LG_NORM_RMSNORM;
    c->norm_eps = 1e-5f;
    c->mlp_class_name = LG_MLP_LLAMA;
    c->rotary_percentage = 1.0f;
    c->rope_base = 10000.0f;
}

/* 4. args ------------------------------------------------------------------------------------- */

void lg_args_default(lg_args *a) {
    memset(a, 0, sizeof *a);
    a->micro_batch_size = 16;
    a->precision = LG_PRECISION_BF16_MIXED; /* the design's default on the CPU backend */
    a->devices = 1;
    a->nodes = 1;
    a->processes = 1;
    a->strategy = LG_STRATEGY_FULL_SHARD;
    a->optimizer = LG_OPTIMIZER_ADAMW;
    a->lr = 4e-3f;
    a->min_lr = 4e-4f;
    a->warmup_steps = 50;
    a->weight_decay = 0.1f;
    lg_optimizer_default_betas(a->optimizer, &a->beta1, &a->beta2);
    a->eps = 1e-8f;
    a->momentum = 0.9f;
    a->max_norm = 1.0f;
    a->max_steps = 1000;
    a->seed = 1337;
    a->hessian_interval = 10;
    a->rho = 0.04f;
    a->lora.alpha = 16.0f; /* LitGPT's LoRA defaults; r 0: off */
    a->lora.dropout = 0.05f;
    a->lora.targets = LG_LORA_QUERY | LG_LORA_VALUE;
}

static const char *const lg_optimizer_names[] = {"adamw", "sgd", "lion", "sophia"};
LG_STATIC_ASSERT(LG_COUNT_OF(lg_optimizer_names) == LG_OPTIMIZER_KINDS &&
                     LG_OPTIMIZER_SOPHIA + 1 == LG_OPTIMIZER_KINDS, "a name for each optimizer");

const char *lg_optimizer_name(lg_optimizer_kind kind) { return lg_optimizer_names[kind]; }

int lg_optimizer_parse(const char *text, lg_optimizer_kind *out) {
    int i = lg_name_index(lg_optimizer_names, LG_OPTIMIZER_KINDS, text);
    if (i >= 0) *out = (lg_optimizer_kind)i;
    return i >= 0 ? 0 : -1;
}

/* The default format (as the precision) has no name of its own. */
static const char *const lg_state_format_names[] = {"", "bf16", "8bit"};
LG_STATIC_ASSERT(LG_COUNT_OF(lg_state_format_names) == LG_STATE_FORMATS &&
                     LG_STATE_8BIT + 1 == LG_STATE_FORMATS, "a name for each state format");

int lg_state_format_parse(const char *text, lg_state_format *out) {
    int i = *text ? lg_name_index(lg_state_format_names, LG_STATE_FORMATS, text) : -1;
    if (i >= 0) *out = (lg_state_format)i;
    return i >= 0 ? 0 : -1;
}

static const char *const lg_backend_names[] = {"cpu", "cuda"};
LG_STATIC_ASSERT(LG_COUNT_OF(lg_backend_names) == LG_BACKENDS && LG_BACKEND_CUDA + 1 == LG_BACKENDS,
                 "a name for each backend");

const char *lg_backend_name(lg_backend backend) { return lg_backend_names[backend]; }

int lg_backend_parse(const char *text, lg_backend *out) {
    int i = lg_name_index(lg_backend_names, LG_BACKENDS, text);
    if (i >= 0) *out = (lg_backend)i;
    return i >= 0 ? 0 : -1;
}

/* States a parameter needs: AdamW 2 (m, v), Sophia 2 (m, h), Lion 1 (m), SGD 1 with momentum,
   else 0. */
static int lg_optimizer_states(lg_optimizer_kind kind, int momentum) {
    if (kind == LG_OPTIMIZER_ADAMW || kind == LG_OPTIMIZER_SOPHIA) return 2;
    return kind == LG_OPTIMIZER_LION ? 1 : momentum != 0;
}

void lg_optimizer_default_betas(lg_optimizer_kind kind, float *beta1, float *beta2) {
    *beta1 = kind == LG_OPTIMIZER_SOPHIA ? 0.965f : 0.9f;
    *beta2 = kind == LG_OPTIMIZER_LION || kind == LG_OPTIMIZER_SOPHIA ? 0.99f : 0.95f;
}

/* The plan's name of state i ("optimizer.m", "optimizer.v", "optimizer.h",
   "optimizer.momentum"). */
static const char *lg_optimizer_state_name(lg_optimizer_kind kind, int i) {
    if (kind == LG_OPTIMIZER_SGD) return "optimizer.momentum";
    if (i == 0) return "optimizer.m";
    return kind == LG_OPTIMIZER_SOPHIA ? "optimizer.h" : "optimizer.v";
}

static const char *const lg_strategy_names[] = {"no-shard", "shard-grad-op", "full-shard",
                                                "hybrid-shard"};

LG_STATIC_ASSERT(LG_COUNT_OF(lg_strategy_names) == LG_STRATEGY_HYBRID_SHARD + 1,
                 "a name for each strategy");

const char *lg_strategy_name(lg_strategy strategy) { return lg_strategy_names[strategy]; }

int lg_strategy_parse(const char *text, lg_strategy *out) {
    int i = lg_name_index(lg_strategy_names, LG_COUNT_OF(lg_strategy_names), text);
    if (i >= 0) *out = (lg_strategy)i;
    return i >= 0 ? 0 : -1;
}

int lg_args_ranks(const lg_args *a) { return a->devices * a->nodes; }

/* --offload gradients streams each unit's gradients (sharded: each rank's piece) to the host
   optimizer that --offload runs; replicas, which all-reduce the whole gradient once a step on
   the devices, are not served. */
static int lg_args_check_offload_gradients(const lg_args *a, lg_error *err) {
    if (!a->offload_gradients) return 0;
    if (!a->offload)
        return lg_fail(err, "`offload gradients` needs `offload state` (the optimizer runs on "
                            "the host, where the gradients go)");
    int replicas = lg_args_ranks(a) > 1 && (a->strategy == LG_STRATEGY_NO_SHARD ||
                                            (a->strategy == LG_STRATEGY_HYBRID_SHARD && a->nodes > 1));
    if (replicas)
        return lg_fail(err, "`offload gradients`: `strategy %s` keeps replicas, which add their "
                            "whole gradients on the devices once a step; full-shard or "
                            "shard-grad-op stream each rank's piece", lg_strategy_name(a->strategy));
    if (a->optimizer == LG_OPTIMIZER_SOPHIA)
        return lg_fail(err, "`offload gradients`: Sophia's Hessian pass reads the whole gradient "
                            "on the device (`optimizer adamw`, lion or sgd stream it)");
    return 0;
}

/* --offload weights streams each unit's weights from the host, where --offload's optimizer
   updates them. With several ranks each streams its own piece and its shard group gathers the
   rest, so the weights must be sharded: replicas of whole weights are not served. */
static int lg_args_check_offload_weights(const lg_args *a, lg_error *err) {
    if (!a->offload_weights) return 0;
    if (!a->offload)
        return lg_fail(err, "`offload weights` needs `offload state` (the optimizer updates the "
                            "weights where they live, on the host)");
    int sharded = a->strategy == LG_STRATEGY_FULL_SHARD ||
                  (a->strategy == LG_STRATEGY_HYBRID_SHARD && a->devices > 1);
    if (lg_args_ranks(a) > 1 && !sharded)
        return lg_fail(err, "`offload weights`: `strategy %s` with `devices %d` x `nodes %d` keeps "
                            "whole weights on every rank; full-shard (or hybrid-shard over "
                            "several `devices`) streams each rank's piece",
                       lg_strategy_name(a->strategy),
                       a->devices, a->nodes);
    return 0;
}

/* --offload embedding with every weight training: the table trains where the host's
   optimizer updates it, in the streamed weights, its gradient scattered into the streamed
   gradients; one rank, whose host holds them whole. */
static int lg_args_check_offload_embedding(const lg_args *a, lg_error *err) {
    if (!a->offload_embedding || a->lora.r > 0) return 0;
    if (!a->offload_weights || !a->offload_gradients)
        return lg_fail(err, "`offload embedding` with every weight training keeps the table in "
                            "the host's weights and its gradient in the host's: it needs "
                            "`offload weights` and `offload gradients` (or LoRA: `lora.r`)");
    if (lg_args_ranks(a) > 1)
        return lg_fail(err, "`offload embedding` with every weight training runs on one rank "
                            "(`devices %d` x `nodes %d`): each rank's host holds a piece of the "
                            "table", a->devices, a->nodes);
    return 0;
}

/* Gradient accumulation steps = global batch / ranks / micro-batch; must divide exactly. */
static int lg_args_accumulation_steps(const lg_args *a, lg_error *err) {
    int per_step = a->micro_batch_size * lg_args_ranks(a);
    int global = a->global_batch_size ? a->global_batch_size : per_step;
    if (per_step < 1) return lg_fail(err, "`micro_batch_size` must be at least 1");
    if (global % per_step != 0)
        return lg_fail(err,
                       "`global_batch_size` %d is not a multiple of `micro_batch_size` %d x "
                       "`devices` %d x `nodes` %d",
                       global, a->micro_batch_size, a->devices, a->nodes);
    return global / per_step;
}

int lg_args_check(const lg_args *a, lg_error *err) {
    if (a->devices < 1) return lg_fail(err, "`devices` must be at least 1");
    if (a->nodes < 1) return lg_fail(err, "`nodes` must be at least 1");
    if (a->offload_activations && !a->recompute)
        return lg_fail(err, "`offload activations` needs `recompute block` (the block inputs it "
                            "moves to host memory are the ones recompute keeps)");
    if (lg_args_check_offload_gradients(a, err) != 0) return -1;
    if (lg_args_check_offload_weights(a, err) != 0) return -1;
    if (lg_args_check_offload_embedding(a, err) != 0) return -1;
    if (a->pack && a->backend == LG_BACKEND_CUDA && !a->plan_only)
        return lg_fail(err, "`pack`: packed rows run on the CPU backend only for now (the CUDA "
                            "attention has no span masks yet): add `backend cpu`");
    if ((long)a->devices * a->nodes > LG_MAX_RANKS)
        return lg_fail(err, "`devices` %d x `nodes` %d: at most %d ranks", a->devices, a->nodes,
                       LG_MAX_RANKS);
    if (a->optimizer_state != LG_STATE_AS_PRECISION && a->optimizer != LG_OPTIMIZER_ADAMW)
        return lg_fail(err, "`optimizer_state` applies to AdamW only (`optimizer %s`)",
                       lg_optimizer_name(a->optimizer));
    if ((double)a->micro_batch_size * lg_args_ranks(a) > 2147483647.0 ||
        (double)a->global_batch_size > 2147483647.0)
        return lg_fail(err, "`micro_batch_size` %d x %d ranks is too large",
                       a->micro_batch_size, lg_args_ranks(a));
    if (a->micro_batch_size < 1) return lg_fail(err, "`micro_batch_size` must be at least 1");
    if (a->global_batch_size < 0) return lg_fail(err, "`global_batch_size` must be positive");
    if (a->max_seq_length < 0) return lg_fail(err, "`max_seq_length` must be positive");
    if (a->lr < 0.0f || a->min_lr < 0.0f) return lg_fail(err, "`lr` and `min_lr` must be >= 0");
    if (a->min_lr > a->lr) return lg_fail(err, "`min_lr` (%g) exceeds `lr` (%g)", a->min_lr, a->lr);
    if (a->beta1 < 0.0f || a->beta1 >= 1.0f) return lg_fail(err, "`beta1` must be within [0, 1)");
    if (a->beta2 < 0.0f || a->beta2 >= 1.0f) return lg_fail(err, "`beta2` must be within [0, 1)");
    if (a->momentum < 0.0f || a->momentum >= 1.0f)
        return lg_fail(err, "`momentum` must be within [0, 1)");
    if (a->weight_decay < 0.0f) return lg_fail(err, "`weight_decay` must be >= 0");
    if (a->max_norm < 0.0f) return lg_fail(err, "`max_norm` must be >= 0 (0 turns clipping off)");
    const struct { const char *setting; int steps; } counts[] = {
        {"`max_steps`", a->max_steps}, {"`warmup_steps`", a->warmup_steps}};
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
        if (counts[i].steps < 0)
            return lg_fail(err, "%s %d: a count of steps, must be >= 0", counts[i].setting,
                           counts[i].steps);
    if (a->hessian_interval < 1) return lg_fail(err, "`hessian_interval` must be at least 1");
    if (a->rho <= 0.0f) return lg_fail(err, "`rho` must be positive");
    return lg_args_accumulation_steps(a, err) > 0 ? 0 : -1;
}

/* 5. plan ------------------------------------------------------------------------------------- */

/* Which of the model's tensors a layout walks: without LoRA every tensor is trainable; with
   LoRA the trainable layout holds the adapters and the frozen one the base model. */
typedef enum { LG_PART_TRAINABLE, LG_PART_FROZEN } lg_layout_part;

/* Walks tensors in buffer order: each call to lg_layout_add takes the next `count` elements. */
typedef struct {
    lg_buf base;            /* data NULL: only count and describe */
    size_t offset;          /* elements taken so far */
    lg_tensor_table *table; /* NULL: do not describe */
    int block;              /* the block being laid out; -1 outside the blocks */
    lg_layout_part part;    /* the tensors it takes */
    int lora;               /* the config has adapters: its base tensors are frozen */
    /* frozen layouts with --quantize: the packed linear weights go here, in bytes */
    lg_buf packed;
    size_t packed_offset;
    lg_quantization quantize;
    int host_embedding;     /* --offload embedding: wte is not taken (frozen layouts, and a
                               trained unit's device buffers) */
    size_t whole;           /* elements walked, packed ones included: the tensors' origins */
} lg_layout;

/* Whether the layout takes the model's base tensors (its adapters otherwise). */
static int lg_layout_takes_base(const lg_layout *L) {
    return L->lora ? L->part == LG_PART_FROZEN : L->part == LG_PART_TRAINABLE;
}

/* The table's entry of the tensor the layout takes next (rows x cols at `offset` of its
   storage, in the layout's block, at its place in the whole layout); NULL when only counting. */
static lg_tensor_info *lg_layout_entry(lg_layout *L, const char *name, int rows, int cols,
                                       lg_tensor_kind kind, size_t offset, lg_dtype packed) {
    if (!L->table) return NULL;
    lg_tensor_info *t = &L->table->tensors[L->table->n_tensors++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->rows = rows;
    t->cols = cols;
    t->offset = offset;
    t->count = (size_t)rows * (size_t)cols;
    t->kind = kind;
    t->block = L->block;
    t->origin = L->whole;
    t->packed = packed;
    t->on_host = 0;
    return t;
}

static lg_buf lg_layout_add(lg_layout *L, const char *name, int rows, int cols,
                            lg_tensor_kind kind) {
    size_t count = (size_t)rows * (size_t)cols;
    if (lg_layout_entry(L, name, rows, cols, kind, L->offset, LG_DTYPE_F32))
        L->table->total = L->offset + count;
    lg_buf view = lg_at(L->base, L->offset);
    L->offset += count;
    L->whole += count;
    return view;
}

/* A frozen linear weight: packed in NF4 when quantizing, else as any tensor. */
static lg_buf lg_layout_add_linear(lg_layout *L, const char *name, int rows, int cols,
                                   lg_tensor_kind kind) {
    if (L->part != LG_PART_FROZEN || L->quantize == LG_QUANTIZE_NONE)
        return lg_layout_add(L, name, rows, cols, kind);
    size_t count = (size_t)rows * (size_t)cols;
    lg_dtype dtype = L->quantize == LG_QUANTIZE_NF4 ? LG_DTYPE_NF4 : LG_DTYPE_NF4_DQ;
    lg_layout_entry(L, name, rows, cols, kind, L->packed_offset, dtype);
    lg_buf view = {L->packed.data ? (uint8_t *)L->packed.data + L->packed_offset : NULL, dtype};
    L->packed_offset += lg_nf4_bytes(count, L->quantize);
    L->whole += count;
    return view;
}

/* The token embedding (Vp, C): in the buffer as any tensor, or under --offload embedding in
   host memory the layout does not take (the view it returns has data NULL: the model points
   it at the host's table): frozen, in a region of its own ("embedding.host"); trained, in the
   host's weights, out of the device's buffers of the ends unit (lg_unit_device_layout). */
static lg_buf lg_layout_add_embedding(lg_layout *L, const char *name, int rows, int cols) {
    if (!L->host_embedding) return lg_layout_add(L, name, rows, cols, LG_TENSOR_EMBEDDING);
    lg_tensor_info *t = lg_layout_entry(L, name, rows, cols, LG_TENSOR_EMBEDDING, 0, LG_DTYPE_F32);
    if (t) t->on_host = 1;
    L->whole += (size_t)rows * (size_t)cols;
    lg_buf apart = {NULL, LG_DTYPE_F32};
    return apart;
}

/* A layout over base (data may be NULL to count). */
static lg_layout lg_layout_over(lg_buf base, lg_tensor_table *table) {
    lg_layout L;
    memset(&L, 0, sizeof L);
    L.base = base;
    L.table = table;
    L.block = -1;
    return L;
}

/* The trainable or frozen parameters of cfg over base. */
static lg_layout lg_params_layout_over(const lg_config *c, lg_layout_part part, lg_buf base,
                                       lg_tensor_table *table) {
    lg_layout L = lg_layout_over(base, table);
    L.part = part;
    L.lora = c->lora.r > 0;
    L.quantize = c->lora.quantize;
    L.host_embedding = part == LG_PART_FROZEN && c->lora.host_embedding;
    return L;
}

static lg_buf lg_no_buf(void) {
    lg_buf b = {NULL, LG_DTYPE_F32};
    return b;
}

/* Upper bound of tensors a layout holds, to size a table: base tensors or adapters. */
static int lg_layout_capacity(const lg_config *c) { return 24 * c->n_layer + 32; }

static int lg_table_alloc(lg_tensor_table *table, const lg_config *c) {
    table->tensors = (lg_tensor_info *)lg_alloc_zeroed(sizeof(lg_tensor_info) *
                                                       (size_t)lg_layout_capacity(c));
    table->n_tensors = 0;
    table->total = 0;
    return table->tensors ? 0 : -1;
}

void lg_tensor_table_free(lg_tensor_table *table) {
    LG_FREE(table->tensors);
    table->tensors = NULL;
    table->n_tensors = 0;
}

/* LitGPT's norms are torch.nn.LayerNorm (always a bias, whatever `bias` says: Falcon's have
   one) or RMSNorm (none). */
static int lg_layer_norm_has_bias(const lg_config *c) {
    return c->norm_class_name == LG_NORM_LAYERNORM;
}

/* A block's adapters, after its base tensors in the trainable layout. */
static void lg_block_lora_layout(const lg_config *c, lg_layout *L, int l, lg_block_tensors *b) {
    int r = c->lora.r, llama = c->mlp_class_name == LG_MLP_LLAMA;
    char name[LG_MAX_NAME];
    for (int k = 0; k < LG_LORA_BLOCK_LINEARS; k++) {
        int in, out;
        if (!lg_lora_adapts(c, (lg_lora_linear)k)) continue;
        lg_lora_dims(c, (lg_lora_linear)k, &in, &out);
        snprintf(name, sizeof name, "transformer.h.%d.%s.lora_A", l, lg_lora_linear_names[llama][k]);
        b->lora_a[k] = lg_layout_add(L, name, r, in, LG_TENSOR_LORA_A);
        snprintf(name, sizeof name, "transformer.h.%d.%s.lora_B", l, lg_lora_linear_names[llama][k]);
        b->lora_b[k] = lg_layout_add(L, name, out, r, LG_TENSOR_LORA_B);
    }
}

static void lg_block_params_layout(const lg_config *c, lg_layout *L, int l, lg_block_tensors *b) {
    int C = c->n_embd, I = c->intermediate_size, QKV = lg_config_qkv_size(c);
    int layer_norm_bias = lg_layer_norm_has_bias(c);
    char name[LG_MAX_NAME];
    L->block = l;
    if (!lg_layout_takes_base(L)) {
        lg_block_lora_layout(c, L, l, b);
        L->block = -1;
        return;
    }
#define LG_BLOCK_TENSOR(field, suffix, rows, cols, kind)                                      \
    do {                                                                                       \
        snprintf(name, sizeof name, "transformer.h.%d.%s", l, suffix);                         \
        b->field = kind == LG_TENSOR_WEIGHT || kind == LG_TENSOR_RESIDUAL                      \
                       ? lg_layout_add_linear(L, name, rows, cols, kind)                       \
                       : lg_layout_add(L, name, rows, cols, kind);                             \
    } while (0)
    LG_BLOCK_TENSOR(norm_1_w, "norm_1.weight", 1, C, LG_TENSOR_NORM);
    if (layer_norm_bias) LG_BLOCK_TENSOR(norm_1_b, "norm_1.bias", 1, C, LG_TENSOR_BIAS);
    LG_BLOCK_TENSOR(qkv_w, "attn.qkv.weight", QKV, C, LG_TENSOR_WEIGHT);
    if (c->bias || c->attn_bias) LG_BLOCK_TENSOR(qkv_b, "attn.qkv.bias", 1, QKV, LG_TENSOR_BIAS);
    LG_BLOCK_TENSOR(proj_w, "attn.proj.weight", C, c->n_head * c->head_size, LG_TENSOR_RESIDUAL);
    if (c->bias) LG_BLOCK_TENSOR(proj_b, "attn.proj.bias", 1, C, LG_TENSOR_BIAS);
    if (!c->shared_attention_norm) {
        LG_BLOCK_TENSOR(norm_2_w, "norm_2.weight", 1, C, LG_TENSOR_NORM);
        if (layer_norm_bias) LG_BLOCK_TENSOR(norm_2_b, "norm_2.bias", 1, C, LG_TENSOR_BIAS);
    }
    if (c->mlp_class_name == LG_MLP_GPTNEOX) {
        LG_BLOCK_TENSOR(fc_w, "mlp.fc.weight", I, C, LG_TENSOR_WEIGHT);
        if (c->bias) LG_BLOCK_TENSOR(fc_b, "mlp.fc.bias", 1, I, LG_TENSOR_BIAS);
    } else {
        LG_BLOCK_TENSOR(fc_w, "mlp.fc_1.weight", I, C, LG_TENSOR_WEIGHT);
        if (c->bias) LG_BLOCK_TENSOR(fc_b, "mlp.fc_1.bias", 1, I, LG_TENSOR_BIAS);
        LG_BLOCK_TENSOR(fc_2_w, "mlp.fc_2.weight", I, C, LG_TENSOR_WEIGHT);
        if (c->bias) LG_BLOCK_TENSOR(fc_2_b, "mlp.fc_2.bias", 1, I, LG_TENSOR_BIAS);
    }
    LG_BLOCK_TENSOR(mlp_proj_w, "mlp.proj.weight", C, I, LG_TENSOR_RESIDUAL);
    if (c->bias) LG_BLOCK_TENSOR(mlp_proj_b, "mlp.proj.bias", 1, C, LG_TENSOR_BIAS);
    L->block = -1;
#undef LG_BLOCK_TENSOR
}

/* The ends unit: token (and position) embeddings, final norm, head. Tied embeddings: the
   head's weight is wte. With LoRA the trainable ends are the head's adapters, if any. */
static void lg_ends_params_layout(const lg_config *c, lg_layout *L, lg_param_tensors *p) {
    int C = c->n_embd, Vp = c->padded_vocab_size;
    int layer_norm_bias = lg_layer_norm_has_bias(c);
    if (!lg_layout_takes_base(L)) {
        if (!(c->lora.targets & LG_LORA_HEAD)) return;
        p->lm_head_lora_a = lg_layout_add(L, "lm_head.lora_A", c->lora.r, C, LG_TENSOR_LORA_A);
        p->lm_head_lora_b = lg_layout_add(L, "lm_head.lora_B", Vp, c->lora.r, LG_TENSOR_LORA_B);
        return;
    }
    p->wte = lg_layout_add_embedding(L, "transformer.wte.weight", Vp, C);
    p->wpe = c->learned_pos_embedding
                 ? lg_layout_add(L, "transformer.wpe.weight", c->block_size, C, LG_TENSOR_EMBEDDING)
                 : lg_no_buf();
    p->ln_f_w = lg_layout_add(L, "transformer.ln_f.weight", 1, C, LG_TENSOR_NORM);
    p->ln_f_b = layer_norm_bias ? lg_layout_add(L, "transformer.ln_f.bias", 1, C, LG_TENSOR_BIAS)
                                : lg_no_buf();
    p->lm_head_w = c->tie_embeddings
                       ? p->wte
                       : lg_layout_add_linear(L, "lm_head.weight", Vp, C, LG_TENSOR_EMBEDDING);
    p->lm_head_b = c->lm_head_bias ? lg_layout_add(L, "lm_head.bias", 1, Vp, LG_TENSOR_BIAS)
                                   : lg_no_buf();
}

/* Every unit of the layout L in order. */
static void lg_model_layout(const lg_config *c, lg_layout *L, lg_param_tensors *p) {
    lg_param_tensors scratch;
    lg_block_tensors block;
    lg_block_tensors *h = p ? p->h : NULL; /* the caller owns p->h, (L) entries */
    if (!p) p = &scratch;
    lg_ends_params_layout(c, L, p);
    for (int l = 0; l < c->n_layer; l++) lg_block_params_layout(c, L, l, h ? &h[l] : &block);
    p->h = h;
}

size_t lg_params_layout(const lg_config *c, lg_buf base, lg_param_tensors *p,
                        lg_tensor_table *table) {
    lg_layout L = lg_params_layout_over(c, LG_PART_TRAINABLE, base, table);
    lg_model_layout(c, &L, p);
    return L.offset;
}

/* LoRA: the frozen base model, every tensor of the model without LoRA in the same order (0
   without LoRA). Tensors stored in the compute type go to base; with --quantize the linear
   weights (lm_head's unless tied) go to `packed` (bytes, lg_nf4_bytes each, typed
   LG_DTYPE_NF4 or _DQ). Returns the elements of base; *packed_bytes (may be NULL) gets the
   bytes of packed. The table lists every tensor with offsets into base, or into packed for the
   packed ones (see lg_tensor_info.packed), and origins in the base model's whole layout. */
static size_t lg_frozen_layout(const lg_config *c, lg_buf base, lg_buf packed, lg_param_tensors *p,
                               lg_tensor_table *table, size_t *packed_bytes) {
    lg_layout L = lg_params_layout_over(c, LG_PART_FROZEN, base, table);
    L.packed = packed;
    if (c->lora.r > 0) lg_model_layout(c, &L, p);
    if (packed_bytes) *packed_bytes = L.packed_offset;
    return L.offset;
}

/* The tensors of one unit (0 the ends, 1 + l block l) that L takes, walked by L. */
static void lg_walk_unit(const lg_config *c, int unit, lg_layout *L, lg_param_tensors *p) {
    lg_param_tensors scratch;
    lg_block_tensors block;
    if (unit == 0) lg_ends_params_layout(c, L, p ? p : &scratch);
    else lg_block_params_layout(c, L, unit - 1, p && p->h ? &p->h[unit - 1] : &block);
}

/* Where frozen unit u's NF4 tensors start in its buffer (lg_frozen_unit_layout), in bytes;
   *packed (when not NULL): their bytes. */
static size_t lg_frozen_unit_packed_at(const lg_config *c, int unit, lg_dtype weights,
                                       size_t *packed) {
    lg_layout L = lg_params_layout_over(c, LG_PART_FROZEN, lg_no_buf(), NULL);
    lg_walk_unit(c, unit, &L, NULL);
    if (packed) *packed = L.packed_offset;
    return (L.offset * lg_elem_size(weights) + LG_ALIGN - 1) / LG_ALIGN * LG_ALIGN;
}

/* LoRA's frozen unit (0 the ends, 1 + l block l) in one byte buffer, as sharded runs gather it:
   its tensors in the weight type from byte 0, then, from the next LG_ALIGN boundary, its NF4
   ones as stored. Points p's base views into base (when not NULL) and appends the unit's
   tensors to table (when not NULL; offsets within the unit, origins from `origin`, the unit's
   first element in the whole base layout). Returns the unit's bytes; *whole (when not NULL):
   the elements of the base model it walks. */
static size_t lg_frozen_unit_layout(const lg_config *c, int unit, lg_dtype weights, uint8_t *base,
                                    size_t origin, lg_param_tensors *p, lg_tensor_table *table,
                                    size_t *whole) {
    lg_layout L = lg_params_layout_over(c, LG_PART_FROZEN, lg_no_buf(), NULL);
    lg_walk_unit(c, unit, &L, NULL);
    size_t values = lg_frozen_unit_packed_at(c, unit, weights, NULL);
    size_t bytes = values + L.packed_offset;
    if (whole) *whole = L.whole;
    if (!base && !table) return bytes;
    L = lg_params_layout_over(c, LG_PART_FROZEN, lg_no_buf(), table);
    L.base.data = base;
    L.base.dtype = weights;
    L.packed.data = base ? base + values : NULL;
    L.packed.dtype = LG_DTYPE_U8;
    L.whole = origin;
    lg_walk_unit(c, unit, &L, p);
    return bytes;
}

lg_config lg_config_base(const lg_config *cfg) {
    lg_config base = *cfg;
    memset(&base.lora, 0, sizeof base.lora);
    return base;
}

/* A trained token embedding (Vp, C) in the whole model's weights (lg_params_layout over
   weights): the ends unit's first tensor. */
static lg_buf lg_trained_embedding_view(const lg_config *c, lg_buf weights) {
    lg_layout L = lg_params_layout_over(c, LG_PART_TRAINABLE, weights, NULL);
    lg_param_tensors ends;
    memset(&ends, 0, sizeof ends);
    lg_ends_params_layout(c, &L, &ends);
    return ends.wte;
}

size_t lg_unit_layout(const lg_config *c, int unit, lg_buf base, lg_param_tensors *p) {
    lg_layout L = lg_params_layout_over(c, LG_PART_TRAINABLE, base, NULL);
    lg_walk_unit(c, unit, &L, p);
    return L.offset;
}

/* --offload embedding with every weight training: the token embedding trains in host memory
   (its rows gathered, its gradient scattered there), one rank streaming weights and
   gradients (lg_args_check_offload_embedding). */
static int lg_embedding_trained_on_host(const lg_config *c) {
    return c->lora.host_embedding && c->lora.r == 0;
}

/* The elements at the start of trainable unit u that stay on the host: the ends unit's first
   tensor, wte, when it trains there (lg_embedding_trained_on_host); else none. */
static size_t lg_unit_host_part(const lg_config *c, int u) {
    if (u != 0 || !lg_embedding_trained_on_host(c)) return 0;
    return (size_t)c->padded_vocab_size * (size_t)c->n_embd;
}

/* Trainable unit u over a device buffer (a gather slot, a gradient buffer) holding what of it
   the device keeps: the whole unit but its host part (lg_unit_host_part), whose views get
   data NULL. Returns the buffer's elements. */
static size_t lg_unit_device_layout(const lg_config *c, int unit, lg_buf base, lg_param_tensors *p) {
    lg_layout L = lg_params_layout_over(c, LG_PART_TRAINABLE, base, NULL);
    L.host_embedding = lg_unit_host_part(c, unit) > 0;
    lg_walk_unit(c, unit, &L, p);
    return L.offset;
}

/* The activation regions. Each function lays out one region and is used twice: with NULL bases
   to count for the plan, and with the rank's region memory to point the model's views. Pass
   stats = 0 for the tensors stored in the activation type (base typed accordingly), 1 for the
   lg_real statistics. */

static void lg_embedding_acts_layout(int B, int T, int C, lg_buf base, lg_act_tensors *a,
                                     size_t *count) {
    lg_layout L = lg_layout_over(base, NULL);
    lg_buf x = lg_layout_add(&L, "residual.0", B * T, C, LG_TENSOR_ACTIVATION);
    if (a) a->residual[0] = x;
    *count = L.offset;
}

static void lg_block_acts_layout(const lg_config *c, int l, int B, int T, int S, int stats,
                                 lg_buf base, lg_act_tensors *a, size_t *count) {
    lg_layout L = lg_layout_over(base, NULL);
    int N = B * T, C = c->n_embd, I = c->intermediate_size, QKV = lg_config_qkv_size(c);
    int NH = c->n_head, ATT = c->n_head * c->head_size;
    int llama = c->mlp_class_name == LG_MLP_LLAMA;
    int layer_norm = c->norm_class_name == LG_NORM_LAYERNORM;
    lg_block_acts scratch, *b = a ? &a->h[l] : &scratch;
    if (!stats) memset(b, 0, sizeof *b);
#define LG_ACT(field, rows, cols)                                                              \
    do {                                                                                       \
        if (!stats) b->field = lg_layout_add(&L, #field, rows, cols, LG_TENSOR_ACTIVATION);    \
    } while (0)
#define LG_STAT(field, rows, cols)                                                             \
    do {                                                                                       \
        if (stats)                                                                             \
            b->field = (lg_real *)lg_layout_add(&L, #field, rows, cols, LG_TENSOR_ACTIVATION).data; \
    } while (0)
    LG_ACT(n1, N, C);
    if (layer_norm) LG_STAT(n1_mean, 1, N);
    LG_STAT(n1_rstd, 1, N);
    LG_ACT(qkv, N, QKV);
    LG_STAT(att_lse, B * NH, T);
    LG_ACT(att_y, N, ATT);
    LG_ACT(x_mid, N, C);
    if (!c->shared_attention_norm) {
        LG_ACT(n2, N, C);
        if (layer_norm) LG_STAT(n2_mean, 1, N);
        LG_STAT(n2_rstd, 1, N);
    }
    LG_ACT(fc, S, I); /* the MLP's hidden layer: a slice of S rows of N at a time */
    if (llama) LG_ACT(fc_2, S, I);
    LG_ACT(act, S, I);
    for (int k = 0; k < LG_LORA_BLOCK_LINEARS; k++)
        if (lg_lora_adapts(c, (lg_lora_linear)k)) LG_ACT(lora_h[k], N, c->lora.r);
#undef LG_ACT
#undef LG_STAT
    if (!stats) {
        lg_buf out = lg_layout_add(&L, "residual", N, C, LG_TENSOR_ACTIVATION);
        if (a) a->residual[l + 1] = out;
    }
    *count = L.offset;
}

/* The final norm and the classifier: ln_f (B, T, C) and logits (rows, Vp), the head's chunk
   of B x T rows at a time; statistics and the per-token losses are lg_real. */
static void lg_head_acts_layout(const lg_config *c, int B, int T, int rows, int stats,
                                lg_buf base, lg_act_tensors *a, size_t *count) {
    lg_layout L = lg_layout_over(base, NULL);
    lg_act_tensors scratch;
    int N = B * T;
    if (!a) a = &scratch;
    if (!stats) {
        a->ln_f = lg_layout_add(&L, "ln_f", N, c->n_embd, LG_TENSOR_ACTIVATION);
        a->logits = lg_layout_add(&L, "logits", rows, c->padded_vocab_size, LG_TENSOR_ACTIVATION);
        a->lm_head_lora_h = c->lora.r > 0 && (c->lora.targets & LG_LORA_HEAD)
                                ? lg_layout_add(&L, "lm_head.lora_h", N, c->lora.r,
                                                LG_TENSOR_ACTIVATION)
                                : lg_no_buf();
    } else {
        a->ln_f_mean = c->norm_class_name == LG_NORM_LAYERNORM
                           ? (lg_real *)lg_layout_add(&L, "ln_f.mean", 1, N, LG_TENSOR_ACTIVATION).data
                           : NULL;
        a->ln_f_rstd = (lg_real *)lg_layout_add(&L, "ln_f.rstd", 1, N, LG_TENSOR_ACTIVATION).data;
        a->losses = (lg_real *)lg_layout_add(&L, "losses", 1, N, LG_TENSOR_ACTIVATION).data;
    }
    *count = L.offset;
}

/* Rotary tables (T, rope_dims / 2), lg_real. */
static void lg_rope_layout(const lg_config *c, int T, lg_real *base, lg_act_tensors *a,
                           size_t *count) {
    lg_layout L = lg_layout_over(lg_buf_of(base), NULL);
    lg_act_tensors scratch;
    int R = lg_config_rope_dims(c) / 2;
    if (!a) a = &scratch;
    a->rope_cos = R ? (lg_real *)lg_layout_add(&L, "rope.cos", T, R, LG_TENSOR_ACTIVATION).data : NULL;
    a->rope_sin = R ? (lg_real *)lg_layout_add(&L, "rope.sin", T, R, LG_TENSOR_ACTIVATION).data : NULL;
    *count = L.offset;
}

/* LoRA: the widest input of an adapted linear (0 without LoRA). */
static int lg_lora_widest_input(const lg_config *c, int N, int S, int *rows) {
    int widest = c->lora.r > 0 && (c->lora.targets & LG_LORA_HEAD) ? c->n_embd : 0;
    *rows = N;
    for (int k = 0; k < LG_LORA_BLOCK_LINEARS; k++) {
        int in, out, mlp = k == LG_LORA_FC || k == LG_LORA_FC_2 || k == LG_LORA_MLP_PROJ;
        lg_lora_dims(c, (lg_lora_linear)k, &in, &out);
        if (!lg_lora_adapts(c, (lg_lora_linear)k) ||
            (double)in * (mlp ? S : N) <= (double)widest * *rows)
            continue;
        widest = in;
        *rows = mlp ? S : N;
    }
    return widest;
}

/* The backward's working set: gradients of one block's activations at a time. */
static void lg_backward_layout(const lg_config *c, int B, int T, int S, lg_buf base,
                               lg_act_tensors *a, size_t *count) {
    lg_layout L = lg_layout_over(base, NULL);
    lg_act_tensors scratch;
    int N = B * T, C = c->n_embd, I = c->intermediate_size, QKV = lg_config_qkv_size(c);
    if (!a) a = &scratch;
    a->d_res_a = lg_layout_add(&L, "d_res_a", N, C, LG_TENSOR_ACTIVATION);
    a->d_res_b = lg_layout_add(&L, "d_res_b", N, C, LG_TENSOR_ACTIVATION);
    a->d_mid = lg_layout_add(&L, "d_mid", N, C, LG_TENSOR_ACTIVATION);
    a->d_norm = lg_layout_add(&L, "d_norm", N, C, LG_TENSOR_ACTIVATION);
    a->d_qkv = lg_layout_add(&L, "d_qkv", N, QKV, LG_TENSOR_ACTIVATION);
    a->d_att_y = lg_layout_add(&L, "d_att_y", N, c->n_head * c->head_size, LG_TENSOR_ACTIVATION);
    a->d_fc = lg_layout_add(&L, "d_fc", S, I, LG_TENSOR_ACTIVATION); /* a slice's, as fc */
    a->d_fc_2 = c->mlp_class_name == LG_MLP_LLAMA
                    ? lg_layout_add(&L, "d_fc_2", S, I, LG_TENSOR_ACTIVATION)
                    : lg_no_buf();
    a->d_act = lg_layout_add(&L, "d_act", S, I, LG_TENSOR_ACTIVATION);
    int rows, widest = lg_lora_widest_input(c, N, S, &rows);
    a->lora_u = widest ? lg_layout_add(&L, "lora_u", rows, widest, LG_TENSOR_ACTIVATION) : lg_no_buf();
    a->lora_du = widest ? lg_layout_add(&L, "lora_du", rows, widest, LG_TENSOR_ACTIVATION) : lg_no_buf();
    a->lora_dh = widest ? lg_layout_add(&L, "lora_dh", N, c->lora.r, LG_TENSOR_ACTIVATION)
                        : lg_no_buf();
    *count = L.offset;
}

/* --- the plan ----------------------------------------------------------------------------- */

static const char *const lg_dtype_names[] = {"f32", "bf16", "f16", "i32", "u8", "nf4", "nf4-dq"};
static const char *const lg_group_names[] = {
    "weights", "master weights", "gradients", "optimizer state", "activations",
    "logits and loss", "backward working set", "communication", "workspace", "data"};

const char *lg_dtype_name(lg_dtype d) { return lg_dtype_names[d]; }
size_t lg_dtype_size(lg_dtype d) { return lg_elem_size(d); }
const char *lg_group_name(lg_group g) { return lg_group_names[g]; }
static const char *lg_pool_name(lg_pool p) { return p == LG_POOL_DEVICE ? "device" : "host"; }

static size_t lg_align_to(size_t bytes, size_t align) { return (bytes + align - 1) / align * align; }
static size_t lg_align_up(size_t bytes) { return lg_align_to(bytes, LG_ALIGN); }

/* The names of the plan's regions that the code finds (lg_rank_region, lg_plan_find): each
   spelled once, here; the plan adds them, the model, optimizer, trainer, generator and the
   CUDA backend find them. The --plan table and JSON print them. */
#define LG_REGION_ACTIVATIONS_EMBEDDING  "activations.embedding"
#define LG_REGION_ATTENTION_SCORES       "attention.scores"
#define LG_REGION_ATTENTION_SCRATCH      "attention.scratch"
#define LG_REGION_BACKWARD               "backward"
#define LG_REGION_CHECKPOINT_GATHER      "checkpoint.gather"
#define LG_REGION_CUDA_IDS               "cuda.ids"
#define LG_REGION_CUDA_MATMUL_WORKSPACE  "cuda.matmul_workspace"
#define LG_REGION_CUDA_ROW_SUMS          "cuda.row_sums"
#define LG_REGION_CUDA_STAGING           "cuda.staging"
#define LG_REGION_CUDA_TOTALS            "cuda.totals"
#define LG_REGION_EMBEDDING_HOST         "embedding.host"
#define LG_REGION_EMBEDDING_ROWS         "embedding.rows"
#define LG_REGION_FROZEN_WEIGHTS         "frozen_weights"
#define LG_REGION_FROZEN_WEIGHTS_NF4     "frozen_weights.nf4"
#define LG_REGION_FROZEN_WEIGHTS_SHARD   "frozen_weights.shard"
#define LG_REGION_GATHER_BLOCKS          "gather.blocks"
#define LG_REGION_GATHER_ENDS            "gather.ends"
#define LG_REGION_GATHER_FROZEN_BLOCKS   "gather.frozen.blocks"
#define LG_REGION_GATHER_FROZEN_ENDS     "gather.frozen.ends"
#define LG_REGION_GEMM_WORKSPACE         "gemm.workspace"
#define LG_REGION_GENERATION_LOGITS      "generation.logits"
#define LG_REGION_GENERATION_ROW         "generation.row"
#define LG_REGION_GENERATION_STATS       "generation.stats"
#define LG_REGION_GENERATION_WORKING     "generation.working"
#define LG_REGION_GRADIENTS              "gradients"
#define LG_REGION_GRADIENTS_BLOCKS       "gradients.blocks"
#define LG_REGION_GRADIENTS_ENDS         "gradients.ends"
#define LG_REGION_GRADIENTS_HOST         "gradients.host"
#define LG_REGION_HEAD                   "head"
#define LG_REGION_HEAD_STATS             "head.stats"
#define LG_REGION_KV_CACHE_KEYS          "kv_cache.keys"
#define LG_REGION_KV_CACHE_VALUES        "kv_cache.values"
#define LG_REGION_MASTER_WEIGHTS         "master_weights"
#define LG_REGION_NF4_DEQUANTIZED        "nf4.dequantized"
#define LG_REGION_RECOMPUTE_BLOCK        "recompute.block"
#define LG_REGION_RECOMPUTE_BLOCK_STATS  "recompute.block.stats"
#define LG_REGION_REDUCE_SCATTER_OUT     "reduce_scatter.out"
#define LG_REGION_ROPE                   "rope"
#define LG_REGION_SAMPLING_ORDER         "sampling.order"
#define LG_REGION_SAMPLING_PROBS         "sampling.probs"
#define LG_REGION_TOKENS_INPUTS          "tokens.inputs"
#define LG_REGION_TOKENS_SAMPLED         "tokens.sampled"
#define LG_REGION_TOKENS_SPANS           "tokens.spans"
#define LG_REGION_TOKENS_TARGETS         "tokens.targets"
#define LG_REGION_WEIGHTS                "weights"
#define LG_REGION_WEIGHTS_HOST           "weights.host"
/* ... and the families of names with a number or a state's name (snprintf formats) */
#define LG_REGION_BLOCK_ACTS             "activations.h.%d"
#define LG_REGION_BLOCK_STATS            "activations.h.%d.stats"
#define LG_REGION_KEPT_SLOT              "activations.kept_slot.%d"
#define LG_REGION_STATE_SMALL            "%s.small"
#define LG_REGION_STATE_SCALES           "%s.scales"

/* A pool past this many bytes (1 EiB) is no plan but wrapped arithmetic: lg_plan_add stops
   there, so no sum of regions wraps, and lg_plan_make refuses. */
#define LG_MAX_POOL_BYTES ((size_t)1 << 60)

/* Appends a region at the end of its pool; a pool that would pass LG_MAX_POOL_BYTES is left
   just above it (and the region out) for lg_plan_make to refuse. */
static int lg_plan_add(lg_rank_plan *r, const char *name, lg_group group, lg_pool pool,
                       lg_dtype dtype, size_t count) {
    if (count == 0) return 0;
    size_t room = LG_MAX_POOL_BYTES - (r->pool_bytes[pool] < LG_MAX_POOL_BYTES
                                           ? r->pool_bytes[pool] : LG_MAX_POOL_BYTES);
    if (count > room / lg_dtype_size(dtype) || lg_align_to(count * lg_dtype_size(dtype),
                                                           r->align) > room) {
        r->pool_bytes[pool] = LG_MAX_POOL_BYTES + 1;
        return 0;
    }
    if (r->n_regions == r->capacity) {
        int capacity = r->capacity ? 2 * r->capacity : 64;
        lg_region *grown = (lg_region *)LG_MALLOC(sizeof(lg_region) * (size_t)capacity);
        if (!grown) return -1;
        if (r->regions) memcpy(grown, r->regions, sizeof(lg_region) * (size_t)r->n_regions);
        LG_FREE(r->regions);
        r->regions = grown;
        r->capacity = capacity;
    }
    lg_region *g = &r->regions[r->n_regions++];
    memset(g, 0, sizeof *g);
    snprintf(g->name, sizeof g->name, "%s", name);
    g->group = group;
    g->pool = pool;
    g->dtype = dtype;
    g->count = count;
    g->bytes = lg_align_to(count * lg_dtype_size(dtype), r->align);
    g->offset = r->pool_bytes[pool];
    r->pool_bytes[pool] += g->bytes;
    return 0;
}

/* The storage types of a precision (the table in README.md's Precision section). */
typedef struct {
    lg_dtype weights, grads, state, acts;
    int master; /* mixed precisions keep fp32 master weights */
} lg_precision_types;

static lg_precision_types lg_types_of(lg_precision p) {
    lg_dtype half = (p == LG_PRECISION_16_TRUE || p == LG_PRECISION_16_MIXED) ? LG_DTYPE_F16
                                                                              : LG_DTYPE_BF16;
    lg_precision_types t = {LG_DTYPE_F32, LG_DTYPE_F32, LG_DTYPE_F32, LG_DTYPE_F32, 0};
    if (p == LG_PRECISION_32_TRUE) return t;
    t.weights = t.acts = half;
    if (p == LG_PRECISION_16_TRUE || p == LG_PRECISION_BF16_TRUE) t.grads = t.state = half;
    else t.master = 1;
    return t;
}

/* The rows of a block's MLP at a time for N = B x T tokens: --slice-rows, or all of them. */
static int lg_slice_rows_of(const lg_args *a, int N) {
    return a->slice_rows > 0 && a->slice_rows < N ? a->slice_rows : N;
}

/* The rows of logits the head computes at a time for N = B x T tokens: --head-rows, or all
   of them. Sophia keeps all: its Hessian estimate draws labels from every row's logits. */
static int lg_head_rows_of(const lg_args *a, int N) {
    if (a->optimizer == LG_OPTIMIZER_SOPHIA || a->head_rows <= 0 || a->head_rows > N) return N;
    return a->head_rows;
}

void lg_plan_spec_from_args(lg_plan_spec *s, const lg_args *a, int T) {
    memset(s, 0, sizeof *s);
    s->B = a->micro_batch_size;
    s->T = T;
    s->accumulation = lg_args_accumulation_steps(a, NULL);
    if (s->accumulation < 1) s->accumulation = 1;
    s->precision = a->precision;
    s->devices = a->devices;
    s->nodes = a->nodes;
    s->processes = a->processes > 0 ? a->processes : 1;
    s->strategy = a->strategy;
    s->recompute = a->recompute;
    s->offload = a->offload;
    s->offload_activations = a->offload_activations;
    s->offload_gradients = a->offload_gradients;
    s->offload_weights = a->offload_weights;
    s->offload_embedding = a->offload_embedding;
    s->pack = a->pack;
    s->head_rows = lg_head_rows_of(a, s->B * T);
    s->slice_rows = lg_slice_rows_of(a, s->B * T);
    s->optimizer = a->optimizer;
    s->backend = a->backend;
    s->runtime_bytes = a->runtime_bytes;
    s->tf32 = a->tf32;
    s->momentum = a->momentum != 0.0f;
    s->optimizer_state = a->optimizer == LG_OPTIMIZER_ADAMW ? a->optimizer_state
                                                            : LG_STATE_AS_PRECISION;
    s->lora = a->lora;
    s->threads = 1;
#ifdef _OPENMP
    s->threads = omp_get_max_threads();
#endif
}

static lg_sharding lg_sharding_of(const lg_plan_spec *s) {
    lg_sharding sh = {1, 1, 0, 0, 0};
    int ranks = s->devices * s->nodes;
    sh.weights_streamed = s->offload_weights;
    if (ranks == 1) return sh;
    switch (s->strategy) {
    case LG_STRATEGY_NO_SHARD: sh.replicas = ranks; break;
    case LG_STRATEGY_SHARD_GRAD_OP: sh.shard_ranks = ranks; break;
    case LG_STRATEGY_FULL_SHARD: sh.shard_ranks = ranks; sh.weights_sharded = 1; break;
    case LG_STRATEGY_HYBRID_SHARD:
        sh.shard_ranks = s->devices;
        sh.replicas = s->nodes;
        sh.weights_sharded = s->devices > 1;
        break;
    }
    sh.grads_sharded = sh.shard_ranks > 1;
    return sh;
}

/* The backward writes a unit's gradients into a unit buffer (gradients.ends, .blocks) rather
   than into a whole-model gradient buffer: sharded, for the reduce-scatter into the shard;
   with --offload gradients, for the copy to the host. */
static int lg_grads_in_units(const lg_plan_spec *s, const lg_sharding *sh) {
    return sh->grads_sharded || s->offload_gradients;
}

/* The weights come to the device a unit at a time, into the gather slots: sharded
   (full-shard, hybrid-shard: all-gathered) or streamed (--offload weights: copied from the
   host). */
static int lg_weights_in_units(const lg_sharding *sh) {
    return sh->weights_sharded || sh->weights_streamed;
}

/* gather.blocks' slots of a run: LG_GATHER_BLOCK_SLOTS with weights in units, else 1. */
static int lg_gather_block_slots(const lg_sharding *sh) {
    return lg_weights_in_units(sh) ? LG_GATHER_BLOCK_SLOTS : 1;
}

int lg_frozen_sharded(const lg_config *cfg, const lg_sharding *sh) {
    return cfg->lora.r > 0 && lg_weights_in_units(sh);
}

static void lg_shard_layout_free(lg_shard_layout *sl) {
    LG_FREE(sl->unit_offset);
    LG_FREE(sl->piece_count);
    LG_FREE(sl->piece_offset);
    memset(sl, 0, sizeof *sl);
}

/* frozen: the frozen base's units in bytes (lg_frozen_unit_layout; pieces on LG_ALIGN
   boundaries, so that a gathered unit's tensors stay aligned), else the trainable ones in
   elements. */
static int lg_shard_layout_make(lg_shard_layout *sl, const lg_config *c, int S, int frozen,
                                lg_dtype weights) {
    int U = c->n_layer + 1;
    sl->n_units = U;
    sl->n_shards = S;
    sl->unit_offset = (size_t *)lg_alloc_zeroed(sizeof(size_t) * (size_t)(U + 1));
    sl->piece_count = (size_t *)lg_alloc_zeroed(sizeof(size_t) * (size_t)U);
    sl->piece_offset = (size_t *)lg_alloc_zeroed(sizeof(size_t) * (size_t)(U + 1));
    if (!sl->unit_offset || !sl->piece_count || !sl->piece_offset) {
        lg_shard_layout_free(sl);
        return -1;
    }
    for (int u = 0; u < U; u++) {
        size_t count = frozen ? lg_frozen_unit_layout(c, u, weights, NULL, 0, NULL, NULL, NULL)
                              : lg_unit_layout(c, u, lg_no_buf(), NULL);
        sl->unit_offset[u + 1] = sl->unit_offset[u] + count;
        sl->piece_count[u] = (count + (size_t)S - 1) / (size_t)S;
        if (frozen) sl->piece_count[u] = lg_align_to(sl->piece_count[u], LG_ALIGN);
        sl->piece_offset[u + 1] = sl->piece_offset[u] + sl->piece_count[u];
    }
    return 0;
}

/* The pieces of the whole table that member `index` of a shard group holds (see
   lg_rank_plan.pieces); out has room for whole->n_tensors entries. */
static void lg_shard_table(const lg_shard_layout *sl, const lg_tensor_table *whole, int index,
                           lg_tensor_table *out) {
    out->n_tensors = 0;
    out->total = sl->piece_offset[sl->n_units];
    for (int k = 0; k < whole->n_tensors; k++) {
        const lg_tensor_info *t = &whole->tensors[k];
        int u = t->block + 1;
        size_t lo = sl->unit_offset[u] + (size_t)index * sl->piece_count[u];
        size_t hi = lo + sl->piece_count[u] < sl->unit_offset[u + 1] ? lo + sl->piece_count[u]
                                                                     : sl->unit_offset[u + 1];
        size_t first = t->offset > lo ? t->offset : lo;
        size_t last = t->offset + t->count < hi ? t->offset + t->count : hi;
        if (first >= last) continue;
        lg_tensor_info *piece = &out->tensors[out->n_tensors++];
        *piece = *t;
        piece->origin = first;
        piece->count = last - first;
        piece->offset = sl->piece_offset[u] + (first - lo);
        if (piece->count != t->count) { /* a slice of the flattened tensor */
            piece->rows = 1;
            piece->cols = (int)piece->count;
        }
    }
}

/* The optimizer's `states` moments of the rank's shard in a compact format (bf16, or 8-bit
   codes in blocks of LG_QUANT_BLOCK with each block's scale) for the large tensors, fp32 for
   the small ones (LG_COMPACT_MIN). */
static int lg_plan_compact_state(lg_rank_plan *r, const lg_plan_spec *s, lg_pool state_pool,
                                 int states) {
    size_t large = 0, small = 0, blocks = 0;
    for (int i = 0; i < r->pieces.n_tensors; i++) {
        size_t count = r->pieces.tensors[i].count;
        if (count < LG_COMPACT_MIN) small += count;
        else large += count, blocks += (count + LG_QUANT_BLOCK - 1) / LG_QUANT_BLOCK;
    }
    int quantized = s->optimizer_state == LG_STATE_8BIT, rc = 0;
    char name[LG_MAX_NAME];
    for (int i = 0; i < states; i++) {
        const char *base = lg_optimizer_state_name(s->optimizer, i);
        rc |= lg_plan_add(r, base, LG_GROUP_OPTIMIZER, state_pool,
                          quantized ? LG_DTYPE_U8 : LG_DTYPE_BF16,
                          quantized ? blocks * LG_QUANT_BLOCK : large);
        snprintf(name, sizeof name, LG_REGION_STATE_SMALL, base);
        rc |= lg_plan_add(r, name, LG_GROUP_OPTIMIZER, state_pool, LG_DTYPE_F32, small);
        if (quantized) {
            snprintf(name, sizeof name, LG_REGION_STATE_SCALES, base);
            rc |= lg_plan_add(r, name, LG_GROUP_OPTIMIZER, state_pool, LG_DTYPE_F32, blocks);
        }
    }
    return rc;
}

/* Parameters, their master copy, gradients and optimizer state: the model state. Sharded, each
   rank holds its shard (lg_shard_layout) of what the strategy splits; full-shard gathers the
   weights one unit at a time: the ends for the whole step, two blocks (one computing, the
   next prefetched); gradients of a unit are reduce-scattered into the shards as soon as the
   backward leaves it. */
static int lg_plan_model_state(lg_rank_plan *r, const lg_plan *plan) {
    const lg_plan_spec *s = &plan->spec;
    const lg_sharding *sh = &plan->sharding;
    const lg_shard_layout *sl = &plan->shards;
    lg_precision_types t = lg_types_of(s->precision);
    size_t whole = sl->unit_offset[sl->n_units], shard = r->pieces.total;
    size_t weights = sh->weights_sharded ? shard : whole;
    lg_pool state_pool = s->offload ? LG_POOL_HOST : LG_POOL_DEVICE;
    lg_pool weights_pool = sh->weights_streamed ? LG_POOL_HOST : LG_POOL_DEVICE;
    int states = lg_optimizer_states(s->optimizer, s->momentum);
    int rc = lg_plan_add(r, LG_REGION_WEIGHTS, LG_GROUP_WEIGHTS, weights_pool, t.weights, weights);
    if (t.master)
        rc |= lg_plan_add(r, LG_REGION_MASTER_WEIGHTS, LG_GROUP_MASTER, state_pool, LG_DTYPE_F32,
                          shard);
    if (!s->offload_gradients) /* (streamed: the unit buffers below, and the host's) */
        rc |= lg_plan_add(r, LG_REGION_GRADIENTS, LG_GROUP_GRADIENTS, LG_POOL_DEVICE, t.grads,
                          shard);
    if (s->offload) { /* the gradient shard goes to the host, where the optimizer runs */
        rc |= lg_plan_add(r, LG_REGION_GRADIENTS_HOST, LG_GROUP_GRADIENTS, LG_POOL_HOST, t.grads,
                          shard);
        /* the host's copy of the weights it updates (mixed: the master, and on a GPU, whose
           memory the host cannot write, the rounded weights too; streamed, the weights are
           the host's already) */
        if ((!t.master || s->backend == LG_BACKEND_CUDA) && !sh->weights_streamed)
            rc |= lg_plan_add(r, LG_REGION_WEIGHTS_HOST, LG_GROUP_WEIGHTS, LG_POOL_HOST, t.weights,
                              shard);
    }
    if (s->optimizer_state == LG_STATE_AS_PRECISION) {
        for (int i = 0; i < states; i++)
            rc |= lg_plan_add(r, lg_optimizer_state_name(s->optimizer, i), LG_GROUP_OPTIMIZER,
                              state_pool, t.state, shard);
    } else {
        rc |= lg_plan_compact_state(r, s, state_pool, states);
    }
    if (sh->grads_sharded) { /* whole units, padded to S pieces, for the collectives */
        size_t S = (size_t)sl->n_shards, ends = sl->piece_count[0] * S;
        size_t block = sl->piece_count[1] * S, piece = 0;
        for (int u = 0; u < sl->n_units; u++)
            piece = sl->piece_count[u] > piece ? sl->piece_count[u] : piece;
        rc |= lg_plan_add(r, LG_REGION_GATHER_ENDS, LG_GROUP_COMMUNICATION, LG_POOL_DEVICE,
                          t.weights, ends);
        rc |= lg_plan_add(r, LG_REGION_GATHER_BLOCKS, LG_GROUP_COMMUNICATION, LG_POOL_DEVICE,
                          t.weights, lg_gather_block_slots(sh) * block);
        rc |= lg_plan_add(r, LG_REGION_GRADIENTS_ENDS, LG_GROUP_COMMUNICATION, LG_POOL_DEVICE,
                          t.grads, ends);
        rc |= lg_plan_add(r, LG_REGION_GRADIENTS_BLOCKS, LG_GROUP_COMMUNICATION, LG_POOL_DEVICE,
                          t.grads, LG_GRAD_BLOCK_SLOTS * block);
        rc |= lg_plan_add(r, LG_REGION_REDUCE_SCATTER_OUT, LG_GROUP_COMMUNICATION, LG_POOL_DEVICE,
                          t.grads, piece);
    } else if (s->offload_gradients) { /* one rank: the units the backward fills, in turn */
        rc |= lg_plan_add(r, LG_REGION_GRADIENTS_ENDS, LG_GROUP_GRADIENTS, LG_POOL_DEVICE, t.grads,
                          sl->piece_count[0] - lg_unit_host_part(&plan->cfg, 0));
        rc |= lg_plan_add(r, LG_REGION_GRADIENTS_BLOCKS, LG_GROUP_GRADIENTS, LG_POOL_DEVICE,
                          t.grads, LG_GRAD_BLOCK_SLOTS * sl->piece_count[1]);
    }
    if (sh->weights_streamed && !sh->grads_sharded) { /* one rank: the units the copies fill */
        rc |= lg_plan_add(r, LG_REGION_GATHER_ENDS, LG_GROUP_WEIGHTS, LG_POOL_DEVICE, t.weights,
                          sl->piece_count[0] - lg_unit_host_part(&plan->cfg, 0));
        rc |= lg_plan_add(r, LG_REGION_GATHER_BLOCKS, LG_GROUP_WEIGHTS, LG_POOL_DEVICE, t.weights,
                          (size_t)lg_gather_block_slots(sh) * sl->piece_count[1]);
    }
    return rc;
}

/* LoRA with weights in units: each rank's piece of every frozen unit (bytes, as stored; in
   host memory when streamed), and the gathered units in slots as the trainable ones (the ends
   for the step, two blocks). */
static int lg_plan_frozen_shard(lg_rank_plan *r, const lg_plan *plan) {
    const lg_shard_layout *sl = &plan->frozen_shards;
    size_t S = (size_t)sl->n_shards;
    lg_pool pool = plan->sharding.weights_streamed ? LG_POOL_HOST : LG_POOL_DEVICE;
    int rc = lg_plan_add(r, LG_REGION_FROZEN_WEIGHTS_SHARD, LG_GROUP_WEIGHTS, pool, LG_DTYPE_U8,
                         sl->piece_offset[sl->n_units]);
    rc |= lg_plan_add(r, LG_REGION_GATHER_FROZEN_ENDS, LG_GROUP_COMMUNICATION, LG_POOL_DEVICE,
                      LG_DTYPE_U8, sl->piece_count[0] * S);
    return rc | lg_plan_add(r, LG_REGION_GATHER_FROZEN_BLOCKS, LG_GROUP_COMMUNICATION,
                            LG_POOL_DEVICE, LG_DTYPE_U8,
                            (size_t)lg_gather_block_slots(&plan->sharding) * sl->piece_count[1] * S);
}

/* The elements of one NF4 frozen tensor dequantized for a matmul: the whole tensor, but of
   lm_head a tile of lg_head_tile_rows vocabulary rows. */
static size_t lg_dequantized_count(const lg_config *c, const lg_tensor_info *t) {
    if (strcmp(t->name, "lm_head.weight") != 0) return t->count;
    return (size_t)lg_head_tile_rows(c) * (size_t)t->cols;
}

/* LoRA: the frozen base model in the compute type, its linear weights packed in NF4 with
   --quantize, whole on every rank (sharded with the weights: lg_plan_frozen_shard); the
   largest of those dequantized for one matmul at a time (lm_head a tile at a time). */
static int lg_plan_frozen_model(lg_rank_plan *r, const lg_plan *plan) {
    const lg_config *c = &plan->cfg;
    if (c->lora.r == 0) return 0;
    lg_precision_types t = lg_types_of(plan->spec.precision);
    size_t packed = 0, largest = 0;
    size_t count = lg_frozen_layout(c, lg_no_buf(), lg_no_buf(), NULL, NULL, &packed);
    int sharded = lg_frozen_sharded(c, &plan->sharding);
    int rc = sharded ? lg_plan_frozen_shard(r, plan)
                     : lg_plan_add(r, LG_REGION_FROZEN_WEIGHTS, LG_GROUP_WEIGHTS, LG_POOL_DEVICE,
                                   t.weights, count);
    if (c->lora.host_embedding) /* (Vp, C), out of the frozen base: lg_layout_add_embedding */
        rc |= lg_plan_add(r, LG_REGION_EMBEDDING_HOST, LG_GROUP_WEIGHTS, LG_POOL_HOST, t.weights,
                          (size_t)c->padded_vocab_size * c->n_embd);
    if (c->lora.quantize == LG_QUANTIZE_NONE) return rc;
    lg_tensor_table table;
    if (lg_table_alloc(&table, c) != 0) return -1;
    lg_frozen_layout(c, lg_no_buf(), lg_no_buf(), NULL, &table, NULL);
    for (int i = 0; i < table.n_tensors; i++)
        if (table.tensors[i].packed != LG_DTYPE_F32 &&
            lg_dequantized_count(c, &table.tensors[i]) > largest)
            largest = lg_dequantized_count(c, &table.tensors[i]);
    lg_tensor_table_free(&table);
    if (!sharded)
        rc |= lg_plan_add(r, LG_REGION_FROZEN_WEIGHTS_NF4, LG_GROUP_WEIGHTS, LG_POOL_DEVICE,
                          LG_DTYPE_U8, packed);
    return rc | lg_plan_add(r, LG_REGION_NF4_DEQUANTIZED, LG_GROUP_WORKSPACE, LG_POOL_DEVICE,
                            t.weights, largest);
}

/* Whether block l's output (the input of block l + 1) lives in host memory: --offload
   activations with recompute, every block but the last (the head's input stays). */
static int lg_kept_on_host(const lg_config *c, const lg_plan_spec *s, int l) {
    return s->offload_activations && s->recompute && l < c->n_layer - 1;
}

/* What the forward keeps: all of every block's activations, or with recompute only each
   block's output plus one block's full set, rebuilt during the backward; with --offload
   activations the outputs in host memory and two device slots they pass through. */
static int lg_plan_activations(lg_rank_plan *r, const lg_config *c, const lg_plan_spec *s) {
    lg_precision_types t = lg_types_of(s->precision);
    int B = s->B, T = s->T, rc = 0;
    size_t main_count, stats_count;
    char name[LG_MAX_NAME];
    lg_embedding_acts_layout(B, T, c->n_embd, lg_no_buf(), NULL, &main_count);
    rc |= lg_plan_add(r, LG_REGION_ACTIVATIONS_EMBEDDING, LG_GROUP_ACTIVATIONS, LG_POOL_DEVICE,
                      t.acts, main_count);
    if (c->lora.host_embedding) /* the step's rows gathered on the host, copied in at once */
        rc |= lg_plan_add(r, LG_REGION_EMBEDDING_ROWS, LG_GROUP_ACTIVATIONS, LG_POOL_HOST, t.acts,
                          main_count);
    for (int l = 0; l < c->n_layer; l++) {
        lg_block_acts_layout(c, l, B, T, s->slice_rows, 0, lg_no_buf(), NULL, &main_count);
        lg_block_acts_layout(c, l, B, T, s->slice_rows, 1, lg_no_buf(), NULL, &stats_count);
        if (s->recompute) {
            main_count = (size_t)B * T * c->n_embd; /* the block's output only */
            stats_count = 0;
        }
        snprintf(name, sizeof name, LG_REGION_BLOCK_ACTS, l);
        rc |= lg_plan_add(r, name, LG_GROUP_ACTIVATIONS,
                          lg_kept_on_host(c, s, l) ? LG_POOL_HOST : LG_POOL_DEVICE, t.acts,
                          main_count);
        snprintf(name, sizeof name, LG_REGION_BLOCK_STATS, l);
        rc |= lg_plan_add(r, name, LG_GROUP_ACTIVATIONS, LG_POOL_DEVICE, LG_DTYPE_F32, stats_count);
    }
    if (s->recompute) {
        lg_block_acts_layout(c, 0, B, T, s->slice_rows, 0, lg_no_buf(), NULL, &main_count);
        lg_block_acts_layout(c, 0, B, T, s->slice_rows, 1, lg_no_buf(), NULL, &stats_count);
        rc |= lg_plan_add(r, LG_REGION_RECOMPUTE_BLOCK, LG_GROUP_ACTIVATIONS, LG_POOL_DEVICE,
                          t.acts, main_count);
        rc |= lg_plan_add(r, LG_REGION_RECOMPUTE_BLOCK_STATS, LG_GROUP_ACTIVATIONS, LG_POOL_DEVICE,
                          LG_DTYPE_F32, stats_count);
    }
    for (int k = 0; k < LG_KEPT_SLOTS && lg_kept_on_host(c, s, 0); k++) {
        snprintf(name, sizeof name, LG_REGION_KEPT_SLOT, k);
        rc |= lg_plan_add(r, name, LG_GROUP_ACTIVATIONS, LG_POOL_DEVICE, t.acts,
                          (size_t)B * T * c->n_embd);
    }
    lg_rope_layout(c, T, NULL, NULL, &main_count);
    rc |= lg_plan_add(r, LG_REGION_ROPE, LG_GROUP_ACTIVATIONS, LG_POOL_DEVICE, LG_DTYPE_F32,
                      main_count);
    lg_head_acts_layout(c, B, T, s->head_rows, 0, lg_no_buf(), NULL, &main_count);
    lg_head_acts_layout(c, B, T, s->head_rows, 1, lg_no_buf(), NULL, &stats_count);
    rc |= lg_plan_add(r, LG_REGION_HEAD, LG_GROUP_LOGITS, LG_POOL_DEVICE, t.acts, main_count);
    rc |= lg_plan_add(r, LG_REGION_HEAD_STATS, LG_GROUP_LOGITS, LG_POOL_DEVICE, LG_DTYPE_F32,
                      stats_count);
    lg_backward_layout(c, B, T, s->slice_rows, lg_no_buf(), NULL, &main_count);
    rc |= lg_plan_add(r, LG_REGION_BACKWARD, LG_GROUP_BACKWARD, LG_POOL_DEVICE, t.acts, main_count);
    return rc;
}
#define LG_GEMM_MR_MAX 32 /* the largest MR and NR of any path (workspace sizes) */
#define LG_GEMM_NR_MAX 32

/* cache blocks (in elements): Bp micro-panel KC x NR in L1, Ap block
   MC x KC in L2, Bp block KC x NC in L2/L3; MC = MR * LG_GEMM_MC_PANELS */
#ifndef LG_GEMM_KC
#define LG_GEMM_KC 256               /* must be a multiple of 32 (AMX tile rows) */
#endif
#ifndef LG_GEMM_MC_PANELS
#define LG_GEMM_MC_PANELS 12
#endif
#ifndef LG_GEMM_NC
#define LG_GEMM_NC 2048              /* must be a multiple of every NR */
#endif
LG_STATIC_ASSERT(LG_HEAD_TILE_ALIGN % (2 * LG_GEMM_KC) == 0,
                 "the NF4 head's tiles split the vocabulary where the gemm's K blocks do");

/* Elements of one thread's packing buffers (see lg_gemm_workspace), for every path: Ap
   (MC + MR) x KC and Bp KC x (NC + NR) at the largest MR and NR, each rounded up to LG_ALIGN
   bytes. */
static size_t lg_gemm_panel_a_count(void) {
    const size_t mc = (size_t)LG_GEMM_MR_MAX * (LG_GEMM_MC_PANELS + 1);
    return lg_align_up(mc * LG_GEMM_KC * sizeof(lg_real)) / sizeof(lg_real);
}

static size_t lg_gemm_workspace_count(void) {
    size_t b = (size_t)LG_GEMM_KC * (LG_GEMM_NC + LG_GEMM_NR_MAX);
    return lg_gemm_panel_a_count() + lg_align_up(b * sizeof(lg_real)) / sizeof(lg_real);
}

/* The CPU's scratch: the matmul's packing buffers and attention's rows, one set a thread. */
static int lg_plan_cpu_workspace(lg_rank_plan *r, const lg_plan_spec *s) {
    int rc = lg_plan_add(r, LG_REGION_GEMM_WORKSPACE, LG_GROUP_WORKSPACE, LG_POOL_DEVICE,
                         LG_DTYPE_F32, lg_gemm_workspace_count() * (size_t)s->threads);
    return rc | lg_plan_add(r, LG_REGION_ATTENTION_SCRATCH, LG_GROUP_WORKSPACE, LG_POOL_DEVICE,
                            LG_DTYPE_F32, 2 * (size_t)s->T * s->T * (size_t)s->threads);
}

/* The bytes of a GPU rank's matmul workspace for sequences of T: cuBLASLt's
   LG_CUDA_MATMUL_WORKSPACE, or more where one sequence's attention statistic D (n_head, T) fp32,
   which the backward keeps there, needs it (past 262,144 tokens at 32 heads); it always holds
   one chunk of a bias gradient's partial sums (n_embd floats). */
static size_t lg_cuda_workspace_bytes(const lg_config *c, int T) {
    size_t d = sizeof(float) * (size_t)c->n_head * (size_t)T, bias = sizeof(float) * (size_t)c->n_embd;
    size_t need = d > bias ? d : bias;
    return need > LG_CUDA_MATMUL_WORKSPACE ? lg_align_up(need) : LG_CUDA_MATMUL_WORKSPACE;
}

/* A GPU's own regions (see LG_CUDA_MATMUL_WORKSPACE), and last the runtime's memory, which the
   rank's arena stops before. */
static int lg_plan_gpu_workspace(lg_rank_plan *r, const lg_config *c, const lg_plan_spec *s) {
    int rc = lg_plan_add(r, LG_REGION_CUDA_MATMUL_WORKSPACE, LG_GROUP_WORKSPACE, LG_POOL_DEVICE,
                         LG_DTYPE_U8, lg_cuda_workspace_bytes(c, s->T));
    rc |= lg_plan_add(r, LG_REGION_CUDA_ROW_SUMS, LG_GROUP_WORKSPACE, LG_POOL_DEVICE, LG_DTYPE_F32,
                      (size_t)LG_CUDA_ROW_CHUNKS * 2 * c->n_embd);
    rc |= lg_plan_add(r, LG_REGION_CUDA_TOTALS, LG_GROUP_WORKSPACE, LG_POOL_DEVICE, LG_DTYPE_U8,
                      LG_CUDA_REDUCE_SLOTS * sizeof(double));
    rc |= lg_plan_add(r, LG_REGION_CUDA_IDS, LG_GROUP_DATA, LG_POOL_DEVICE, LG_DTYPE_I32,
                      2 * (size_t)s->B * s->T);
    size_t logits_row = sizeof(float) * (size_t)c->padded_vocab_size;
    rc |= lg_plan_add(r, LG_REGION_CUDA_STAGING, LG_GROUP_WORKSPACE, LG_POOL_HOST, LG_DTYPE_U8,
                      logits_row > LG_CUDA_STAGING ? logits_row : LG_CUDA_STAGING);
    return rc | lg_plan_add(r, LG_CUDA_RUNTIME_REGION, LG_GROUP_WORKSPACE, LG_POOL_DEVICE,
                            LG_DTYPE_U8, s->runtime_bytes);
}

/* The plan's name of the MPI buffers that rank `rank` holds for the group of `count` ranks
   first + m stride, among `ranks` ranks spread evenly over `processes` processes: `buffers`
   ("mpi.shard", "mpi.replica" or "mpi.all") when the group spans processes and `rank` is its
   first member in its process, else NULL (no MPI there, or another member holds them). */
static const char *lg_mpi_group_region(int ranks, int processes, int first, int stride, int count,
                                       int rank, const char *buffers) {
    int per_process = ranks / processes, last = first + (count - 1) * stride;
    if (first / per_process == last / per_process) return NULL; /* in one process: no MPI */
    int before = rank - stride; /* the member before this one */
    return rank == first || before / per_process != rank / per_process ? buffers : NULL;
}

size_t lg_checkpoint_unit_layout(const lg_plan *plan, size_t at[LG_UNIT_PARTS]) {
    const lg_shard_layout *sl = &plan->shards;
    lg_precision_types t = lg_types_of(plan->spec.precision);
    size_t largest = 0, bytes = 0;
    for (int k = 0; k < LG_UNIT_PARTS; k++) at[k] = (size_t)-1;
    if (!plan->sharding.grads_sharded || plan->cfg.lora.r > 0 ||
        plan->spec.optimizer_state != LG_STATE_AS_PRECISION) /* (no checkpoints then) */
        return 0;
    for (int u = 0; u < sl->n_units; u++)
        largest = sl->piece_count[u] > largest ? sl->piece_count[u] : largest;
    largest *= (size_t)sl->n_shards;
    if (t.master) at[LG_PART_MASTER] = bytes, bytes += largest * lg_elem_size(LG_DTYPE_F32);
    for (int i = 0; i < lg_optimizer_states(plan->spec.optimizer, plan->spec.momentum) && i < 2; i++)
        at[LG_PART_M + i] = bytes, bytes += largest * lg_elem_size(t.state);
    return bytes;
}

/* CPU ranks in several processes: the MPI buffers of the groups that span processes (see
   lg_mpi_comm_create), each held by the group's first member in a process. (On GPUs NCCL's
   own buffers are part of the measured cuda.runtime.) */
static int lg_plan_mpi_buffers(lg_rank_plan *r, const lg_plan *plan, int rank) {
    const lg_plan_spec *s = &plan->spec; /* (processes >= 1) */
    int S = plan->sharding.shard_ranks, R = plan->sharding.replicas, n = plan->n_ranks;
    if (s->backend != LG_BACKEND_CPU || s->processes <= 1) return 0;
    const char *held[3] = {
        S > 1 ? lg_mpi_group_region(n, s->processes, rank / S * S, 1, S, rank, "mpi.shard") : NULL,
        R > 1 ? lg_mpi_group_region(n, s->processes, rank % S, S, R, rank, "mpi.replica") : NULL,
        lg_mpi_group_region(n, s->processes, 0, 1, n, rank, "mpi.all")};
    int rc = 0;
    for (int g = 0; g < 3; g++)
        if (held[g])
            rc |= lg_plan_add(r, held[g], LG_GROUP_COMMUNICATION, LG_POOL_HOST, LG_DTYPE_U8,
                              LG_MPI_SCRATCH_BYTES);
    return rc;
}


/* Every pool below LG_MAX_POOL_BYTES; else the plan is freed and refused. */
static int lg_plan_check_pools(lg_plan *plan, lg_error *err) {
    for (int i = 0; i < plan->n_ranks; i++)
        for (int pool = 0; pool < LG_N_POOLS; pool++)
            if (plan->ranks[i].pool_bytes[pool] > LG_MAX_POOL_BYTES) {
                lg_plan_free(plan);
                return lg_fail(err, "plan: rank %d's %s pool would pass 2^60 bytes: the model "
                                    "and batch sizes are too large to lay out", i,
                               lg_pool_name((lg_pool)pool));
            }
    return 0;
}

/* Rank i's buffers in host memory: the step's token ids and targets, MPI's, a process's
   checkpoint gather (on its first rank), Sophia's drawn labels, --pack's span starts. */
static int lg_plan_host_buffers(lg_rank_plan *r, const lg_plan *plan, int i) {
    const lg_plan_spec *s = &plan->spec;
    size_t tokens = (size_t)s->accumulation * s->B * s->T;
    int rc = lg_plan_add(r, LG_REGION_TOKENS_INPUTS, LG_GROUP_DATA, LG_POOL_HOST, LG_DTYPE_I32,
                         tokens);
    rc |= lg_plan_add(r, LG_REGION_TOKENS_TARGETS, LG_GROUP_DATA, LG_POOL_HOST, LG_DTYPE_I32,
                      tokens);
    rc |= lg_plan_mpi_buffers(r, plan, i);
    size_t unit_at[LG_UNIT_PARTS], unit_bytes = lg_checkpoint_unit_layout(plan, unit_at);
    if (i % (plan->n_ranks / s->processes) == 0) /* a process's first rank */
        rc |= lg_plan_add(r, LG_REGION_CHECKPOINT_GATHER, LG_GROUP_COMMUNICATION, LG_POOL_HOST,
                          LG_DTYPE_U8, unit_bytes);
    if (s->optimizer == LG_OPTIMIZER_SOPHIA) /* labels drawn from the model for its Hessian */
        rc |= lg_plan_add(r, LG_REGION_TOKENS_SAMPLED, LG_GROUP_DATA, LG_POOL_HOST, LG_DTYPE_I32,
                          tokens);
    if (s->pack) /* where each token's sample starts in its packed row */
        rc |= lg_plan_add(r, LG_REGION_TOKENS_SPANS, LG_GROUP_DATA, LG_POOL_HOST, LG_DTYPE_I32,
                          tokens);
    return rc;
}

int lg_plan_make(lg_plan *plan, const lg_config *model, const lg_plan_spec *s, lg_error *err) {
    memset(plan, 0, sizeof *plan);
    plan->cfg = *model; /* the architecture, with the run's adapters */
    plan->cfg.lora = s->lora;
    plan->cfg.lora.host_embedding = s->offload_embedding;
    const lg_config *c = &plan->cfg;
    if (lg_config_check(c, err) != 0) return -1;
    if (s->B < 1 || s->T < 1 || s->devices < 1 || s->nodes < 1 || s->accumulation < 1)
        return lg_fail(err, "plan: micro-batch, sequence length, devices, nodes and accumulation "
                            "must be positive");
    if (s->devices * s->nodes > LG_MAX_RANKS)
        return lg_fail(err, "plan: at most %d ranks (devices x nodes)", LG_MAX_RANKS);
    if (s->processes > 1 && s->devices * s->nodes % s->processes != 0)
        return lg_fail(err, "plan: %d ranks do not spread evenly over %d processes",
                       s->devices * s->nodes, s->processes);
    if (s->optimizer_state != LG_STATE_AS_PRECISION && s->optimizer != LG_OPTIMIZER_ADAMW)
        return lg_fail(err, "plan: `optimizer_state` applies to AdamW only");
    if (lg_embedding_trained_on_host(c) &&
        (!s->offload_weights || !s->offload_gradients || s->devices * s->nodes > 1))
        return lg_fail(err, "plan: `offload embedding` with every weight training needs "
                            "`offload weights` and `offload gradients` on one rank");
    /* the layouts count rows in int: B T and B NH T (attention) must fit */
    double rows = (double)s->B * s->T * (c->n_head > 1 ? c->n_head : 1);
    if (rows > 2147483647.0 || (double)s->B * s->accumulation * s->T > 2147483647.0)
        return lg_fail(err, "plan: `micro_batch_size` %d x `max_seq_length` %d is too "
                            "large to lay out", s->B, s->T);
    plan->spec = *s;
    if (plan->spec.processes < 1) plan->spec.processes = 1; /* (0: a spec made by hand) */
    if (s->head_rows < 1 || s->head_rows > s->B * s->T) plan->spec.head_rows = s->B * s->T;
    if (s->slice_rows < 1 || s->slice_rows > s->B * s->T) plan->spec.slice_rows = s->B * s->T;
    s = &plan->spec;
    plan->sharding = lg_sharding_of(s);
    plan->n_ranks = s->devices * s->nodes;
    plan->ranks = (lg_rank_plan *)lg_alloc_zeroed(sizeof(lg_rank_plan) * (size_t)plan->n_ranks);
    lg_tensor_table params;
    params.tensors = NULL;
    if (!plan->ranks || lg_table_alloc(&params, c) != 0 ||
        lg_shard_layout_make(&plan->shards, c, plan->sharding.shard_ranks, 0, LG_DTYPE_F32) != 0 ||
        (lg_frozen_sharded(c, &plan->sharding) &&
         lg_shard_layout_make(&plan->frozen_shards, c, plan->sharding.shard_ranks, 1,
                              lg_types_of(s->precision).weights) != 0)) {
        lg_tensor_table_free(&params);
        lg_plan_free(plan);
        return lg_fail(err, "plan: out of host memory");
    }
    lg_params_layout(c, lg_no_buf(), NULL, &params);
    int rc = 0;
    for (int i = 0; i < plan->n_ranks && rc == 0; i++) {
        lg_rank_plan *r = &plan->ranks[i];
        r->shard_index = i % plan->sharding.shard_ranks;
        r->align = s->backend == LG_BACKEND_CUDA ? LG_CUDA_ALIGN : LG_ALIGN;
        if (lg_table_alloc(&r->pieces, c) != 0) { rc = -1; break; }
        lg_shard_table(&plan->shards, &params, r->shard_index, &r->pieces);
        rc |= lg_plan_model_state(r, plan);
        rc |= lg_plan_frozen_model(r, plan);
        rc |= lg_plan_activations(r, c, s);
        rc |= s->backend == LG_BACKEND_CUDA ? lg_plan_gpu_workspace(r, c, s)
                                            : lg_plan_cpu_workspace(r, s);
        rc |= lg_plan_host_buffers(r, plan, i);
    }
    lg_tensor_table_free(&params);
    if (rc != 0) {
        lg_plan_free(plan);
        return lg_fail(err, "plan: out of host memory");
    }
    return lg_plan_check_pools(plan, err);
}

void lg_plan_free(lg_plan *plan) {
    for (int i = 0; plan->ranks && i < plan->n_ranks; i++) {
        LG_FREE(plan->ranks[i].regions);
        lg_tensor_table_free(&plan->ranks[i].pieces);
    }
    LG_FREE(plan->ranks);
    lg_shard_layout_free(&plan->shards);
    lg_shard_layout_free(&plan->frozen_shards);
    plan->ranks = NULL;
    plan->n_ranks = 0;
}

size_t lg_plan_bytes(const lg_plan *plan, lg_pool pool) {
    size_t most = 0;
    for (int i = 0; i < plan->n_ranks; i++)
        if (plan->ranks[i].pool_bytes[pool] > most) most = plan->ranks[i].pool_bytes[pool];
    return most;
}

const lg_region *lg_plan_find(const lg_rank_plan *r, const char *name) {
    for (int i = 0; i < r->n_regions; i++)
        if (strcmp(r->regions[i].name, name) == 0) return &r->regions[i];
    return NULL;
}

size_t lg_plan_group_bytes(const lg_rank_plan *r, lg_group group, lg_pool pool) {
    size_t sum = 0;
    for (int i = 0; i < r->n_regions; i++)
        if (r->regions[i].group == group && r->regions[i].pool == pool) sum += r->regions[i].bytes;
    return sum;
}

/* --- remedies --------------------------------------------------------------------------------- */

/* What a run's fit check holds against the limit: on a GPU a device's pool; on the CPU backend
   (device and host pools, and simulated ranks, share the machine's memory) both pools of all
   the ranks of one machine (a node), the most of any. */
static size_t lg_plan_checked_bytes(const lg_plan *plan) {
    if (plan->spec.backend != LG_BACKEND_CPU) return lg_plan_bytes(plan, LG_POOL_DEVICE);
    int per_node = plan->spec.devices > 0 ? plan->spec.devices : 1;
    size_t most = 0;
    for (int first = 0; first < plan->n_ranks; first += per_node) {
        size_t machine = 0; /* ranks first .. first + per_node - 1: one node */
        for (int i = first; i < first + per_node && i < plan->n_ranks; i++)
            machine += plan->ranks[i].pool_bytes[LG_POOL_DEVICE] +
                       plan->ranks[i].pool_bytes[LG_POOL_HOST];
        if (machine > most) most = machine;
    }
    return most;
}

/* --offload weights: what one micro-batch copies onto the device: every unit for the forward,
   the blocks again for the backward (the ends stay in their slot), trainable and frozen; a
   token embedding trained on the host stays there. */
static size_t lg_plan_streamed_weight_bytes(const lg_plan *plan) {
    const lg_shard_layout *layouts[2] = {&plan->shards, &plan->frozen_shards};
    size_t bytes = 0;
    if (!plan->sharding.weights_streamed) return 0;
    for (int k = 0; k < 2; k++) {
        const lg_shard_layout *sl = layouts[k];
        size_t element = k == 0 ? lg_dtype_size(lg_types_of(plan->spec.precision).weights) : 1;
        if (sl->n_units == 0) continue; /* (no frozen base) */
        size_t apart = k == 0 ? lg_unit_host_part(&plan->cfg, 0) : 0;
        size_t all = sl->piece_offset[sl->n_units] - apart, ends = sl->piece_count[0] - apart;
        bytes += (ends + 2 * (all - ends)) * element;
    }
    return bytes;
}

/* Multiply-adds of one token through a block's linears (lg_lora_dims: q, k and v apart, as
   the fused qkv computes them), those of `which` (a mask of 1 << lg_lora_linear); adapters:
   through their LoRA adapters (r x (in + out)) instead. */
static double lg_block_token_macs(const lg_config *c, unsigned which, int adapters) {
    double macs = 0;
    for (int k = 0; k < LG_LORA_BLOCK_LINEARS; k++) {
        int in, out;
        lg_lora_dims(c, (lg_lora_linear)k, &in, &out);
        if (!(which & 1u << k)) continue;
        if (!adapters) macs += (double)in * out;
        else if (lg_lora_adapts(c, (lg_lora_linear)k)) macs += (double)c->lora.r * (in + out);
    }
    return macs;
}

/* A micro-batch's multiply-adds (lg_plan_step_flops), from what one token costs in each part. */
static double lg_micro_batch_macs(const lg_plan *plan) {
    const lg_config *c = &plan->cfg;
    const lg_plan_spec *s = &plan->spec;
    double N = (double)s->B * s->T, L = c->n_layer, C = c->n_embd, Vp = c->padded_vocab_size;
    unsigned all = (1u << LG_LORA_BLOCK_LINEARS) - 1;
    unsigned hidden = 1u << LG_LORA_FC | 1u << LG_LORA_FC_2; /* what an MLP slice rebuilds */
    unsigned attention = 1u << LG_LORA_Q | 1u << LG_LORA_K | 1u << LG_LORA_V | 1u << LG_LORA_PROJ;
    int head_adapter = c->lora.r > 0 && (c->lora.targets & LG_LORA_HEAD);
    double head = Vp * C + (head_adapter ? c->lora.r * (C + Vp) : 0); /* a token, with adapter */
    double attend = (double)s->B * c->n_head * c->head_size * s->T * (s->T + 1.0); /* a block */
    double block = lg_block_token_macs(c, all, 0) + lg_block_token_macs(c, all, 1);
    double trained = c->lora.r > 0 ? N * (L * lg_block_token_macs(c, all, 1) + (head - Vp * C))
                                   : N * (L * block + head); /* the weight gradients */
    double forward = N * (L * block + head) + L * attend;
    double backward = N * (L * block + head) + trained + 2 * L * attend;
    double again = 0;
    int sliced = s->slice_rows < s->B * s->T, chunked = s->head_rows < s->B * s->T;
    if (s->recompute)
        again += sliced ? N * L * (lg_block_token_macs(c, attention, 0) +
                                   lg_block_token_macs(c, attention, 1)) + L * attend
                        : N * L * block + L * attend;
    if (sliced) again += N * L * (lg_block_token_macs(c, hidden, 0) + lg_block_token_macs(c, hidden, 1));
    if (chunked) again += N * head;
    return forward + again + backward;
}

double lg_plan_step_flops(const lg_plan *plan) {
    return 2.0 * lg_micro_batch_macs(plan) * plan->spec.accumulation;
}

size_t lg_plan_host_traffic_bytes(const lg_plan *plan) {
    const lg_rank_plan *r = &plan->ranks[0];
    size_t bytes = 0, kept = 0; /* what the copies move: count x element, not the padded regions */
    const lg_region *grads = lg_plan_find(r, LG_REGION_GRADIENTS_HOST);
    const lg_region *weights = lg_plan_find(r, LG_REGION_WEIGHTS_HOST);
    /* the gradients once a step; streamed (--offload gradients), out every micro-batch and
       back for each one after the first, which adds to them */
    size_t grad_trips = plan->spec.offload_gradients ? 2 * (size_t)plan->spec.accumulation - 1 : 1;
    size_t apart = lg_unit_host_part(&plan->cfg, 0); /* a table trained on the host stays */
    if (grads) bytes += grad_trips * (grads->count - apart) * lg_dtype_size(grads->dtype);
    if (weights) bytes += weights->count * lg_dtype_size(weights->dtype);
    bytes += lg_plan_streamed_weight_bytes(plan) * (size_t)plan->spec.accumulation;
    /* the rows in, each micro-batch; trained, their gradient out too */
    const lg_region *rows = lg_plan_find(r, LG_REGION_EMBEDDING_ROWS);
    size_t row_trips = (apart ? 2 : 1) * (size_t)plan->spec.accumulation;
    if (rows) bytes += rows->count * lg_dtype_size(rows->dtype) * row_trips;
    for (int i = 0; i < r->n_regions; i++) { /* the kept block outputs in host memory */
        const lg_region *x = &r->regions[i];
        if (x->group == LG_GROUP_ACTIVATIONS && x->pool == LG_POOL_HOST && x != rows)
            kept += x->count * lg_dtype_size(x->dtype);
    }
    return bytes + 2 * kept * (size_t)plan->spec.accumulation;
}

/* The host pools of all the ranks of one machine (a node) together, the most of any: what the
   host memory check holds against lg_args_host_limit on a GPU. */
static size_t lg_plan_host_bytes_per_machine(const lg_plan *plan) {
    int per_node = plan->spec.devices > 0 ? plan->spec.devices : 1;
    size_t most = 0;
    for (int first = 0; first < plan->n_ranks; first += per_node) {
        size_t machine = 0; /* ranks first .. first + per_node - 1: one node */
        for (int i = first; i < first + per_node && i < plan->n_ranks; i++)
            machine += plan->ranks[i].pool_bytes[LG_POOL_HOST];
        if (machine > most) most = machine;
    }
    return most;
}

/* From the shared reference (GPUS.md, NVIDIA's table per compute capability) and nvidia-smi
   readings; nominal: no reading of the card was at hand (the marketed size in MiB; the A40:
   the L40S's reading, the same 48 GB of GDDR6 with ECC). SMs: NVIDIA's specifications of each
   card (the H100 80GB: the SXM's 132; the PCIe card has 114); threads a SM: GPUS.md's, per
   compute capability. The 8, 12 and 16 GB cards stand for Unsloth's smaller size classes: their
   marketed memory (no reading at hand), and SMs from NVIDIA's specifications. */
static const lg_gpu_card lg_gpu_cards[] = {
    {"t4", "T4", 15360, 1, 7, 5, 65536, 40, 1024},
    {"rtx4060", "RTX 4060", 8192, 1, 8, 9, 101376, 24, 1536},
    {"rtx4070", "RTX 4070", 12288, 1, 8, 9, 101376, 46, 1536},
    {"rtx4060ti-16gb", "RTX 4060 Ti 16GB", 16384, 1, 8, 9, 101376, 34, 1536},
    {"rtx3090", "RTX 3090", 24576, 0, 8, 6, 101376, 82, 1536},
    {"rtx4090", "RTX 4090", 24564, 0, 8, 9, 101376, 128, 1536},
    {"rtx5090", "RTX 5090", 32607, 0, 12, 0, 101376, 170, 1536},
    {"a10", "A10", 23028, 0, 8, 6, 101376, 72, 1536},
    {"l4", "L4", 23034, 0, 8, 9, 101376, 58, 1536},
    {"a40", "A40", 46068, 1, 8, 6, 101376, 84, 1536},
    {"l40s", "L40S", 46068, 0, 8, 9, 101376, 142, 1536},
    {"a100-40gb", "A100 40GB", 40960, 0, 8, 0, 166912, 108, 2048},
    {"a100-80gb", "A100 80GB", 81920, 1, 8, 0, 166912, 108, 2048},
    {"h100", "H100 80GB", 81559, 0, 9, 0, 232448, 132, 2048},
    {"h200", "H200", 143771, 1, 9, 0, 232448, 132, 2048},
    {"b200", "B200", 183359, 0, 10, 0, 232448, 148, 2048},
};

int lg_gpu_card_count(void) { return (int)(sizeof lg_gpu_cards / sizeof lg_gpu_cards[0]); }

const lg_gpu_card *lg_gpu_card_at(int i) {
    return i >= 0 && i < lg_gpu_card_count() ? &lg_gpu_cards[i] : NULL;
}

const lg_gpu_card *lg_gpu_card_named(const char *name) {
    for (int i = 0; i < lg_gpu_card_count(); i++)
        if (strcmp(lg_gpu_cards[i].name, name) == 0) return &lg_gpu_cards[i];
    return NULL;
}

int lg_gpu_card_supported(const lg_gpu_card *card) { return card->major >= 8; }

/* The CUDA runtime's share of a GPU, estimated per card. Module loading is lazy (CUDA's default
   since 12.2; train.c asks for it): a kernel's code reaches the card when it is first launched,
   not with the context. Eager loading would put every cuBLASLt kernel for the card's
   architecture there at start (93 MiB of code on sm_80/86, 115 MiB on sm_89, 315 MiB on sm_90,
   lg_cuda_arch_code.cublaslt_eager) for the few dozen a run's matmuls use; nothing here needs it,
   since what loads later is small and counted: our own kernels' whole image (4 MiB) and an
   allowance for cuBLASLt's. Local memory for stack frames is reserved before the runtime is
   measured (lg_cuda_measure_runtime raises cudaLimitStackSize to LG_CUDA_STACK_FRAME_MAX), so
   no launch grows it after the plan was made. */
#define LG_CUDA_CONTEXT_BYTES_PER_THREAD 2176 /* a bare context (cudaMemGetInfo after it alone,
       lazy loading) per resident thread (SMs x threads a SM): public readings RTX 4060 Ti
       107 MiB / 34 SMs = 2,148 B a thread, RTX 3090 256 MiB / 82 = 2,131, RTX 6000 Ada
       426 MiB / 142 = 2,048, RTX PRO 6000 Blackwell 555 MiB / 188 = 2,015 (all 1,536 threads
       a SM); the largest, rounded up to 128 B. It scales with the SMs, as local memory for
       CUDA's default stack (LG_CUDA_DEFAULT_STACK_BYTES a thread) would; for cards with 2,048
       threads a SM it is taken to scale with threads (a third more a SM than scaling with
       SMs would give: no reading of such a card was at hand) */
#define LG_CUDA_DEFAULT_STACK_BYTES 1024 /* cudaLimitStackSize's default (CUDA Runtime API) */
#define LG_CUDA_STACK_FRAME_MAX 352 /* the largest stack frame of our kernels, sm_80 and sm_90
       (lg_k_norm_backward_chunks; nvcc --resource-usage; build/cuda_compiles checks it with
       tests/check_stack_frames.py) */
#define LG_CUBLASLT_KERNELS_LOADED 64 /* cuBLASLt kernels a run's matmuls may load: about 7
       linear shapes x 3 products (forward, input and weight gradients) x 2 epilogues or output
       types = 42, rounded up; each counted at the card's largest (lg_cuda_arch_code) */
#define LG_CUBLASLT_HANDLE_ESTIMATE ((size_t)16 << 20) /* cublasLtCreate's own device memory:
       an allowance, not a reading (the matmul workspace is planned) */
#define LG_NCCL_COMM_ESTIMATE ((size_t)512 << 20) /* a communicator: about 8 MiB of protocol
       buffers (NCCL_BUFFSIZE's 4 MiB for Simple, plus LL128 and LL) a channel and direction,
       2 directions x 32 channels (what NCCL may open over NVLink) */

/* Kernel code per compute capability: bytes of the .text sections of the image the driver
   picks for that architecture, measured by tools/cuda_code_sizes.py (make cuda-code-sizes) on
   this build (sm_80 and sm_90 SASS, compute_90 PTX) and the CUDA 13.0 toolkit's libcublasLt.
   Cards of 8.6 and 8.9 run our sm_80 SASS; 10.0 and 12.0 compile our compute_90 PTX at load,
   counted as the sm_90 image's size. */
typedef struct {
    int major, minor;
    size_t own_code;        /* our kernels' code on the card */
    const char *own_image;  /* which image of ours it runs */
    size_t cublaslt_eager;  /* every cuBLASLt kernel's code for it (what eager loading takes) */
    size_t cublaslt_kernel; /* cuBLASLt's largest kernel for it */
} lg_cuda_arch_code;

static const lg_cuda_arch_code lg_cuda_arch_codes[] = {
    {8, 0, 3832448, "sm_80 SASS", 97535488, 263296},
    {8, 6, 3832448, "sm_80 SASS", 97260800, 263296},
    {8, 9, 3832448, "sm_80 SASS", 120418048, 263296},
    {9, 0, 3982208, "sm_90 SASS", 330747520, 230016},
    {10, 0, 3982208, "compute_90 PTX, compiled at load", 101936256, 261504},
    {12, 0, 3982208, "compute_90 PTX, compiled at load", 146878976, 581248},
};

/* The figures for major.minor; an architecture not measured gets the largest of each. */
static lg_cuda_arch_code lg_cuda_arch_code_for(int major, int minor) {
    const int n = (int)(sizeof lg_cuda_arch_codes / sizeof lg_cuda_arch_codes[0]);
    lg_cuda_arch_code most = {major, minor, 0, "not measured: the largest", 0, 0};
    for (int i = 0; i < n; i++) {
        const lg_cuda_arch_code *c = &lg_cuda_arch_codes[i];
        if (c->major == major && c->minor == minor) return *c;
        if (c->own_code > most.own_code) most.own_code = c->own_code;
        if (c->cublaslt_eager > most.cublaslt_eager) most.cublaslt_eager = c->cublaslt_eager;
        if (c->cublaslt_kernel > most.cublaslt_kernel) most.cublaslt_kernel = c->cublaslt_kernel;
    }
    return most;
}

size_t lg_cuda_lazy_code_bytes(int major, int minor) {
    lg_cuda_arch_code code = lg_cuda_arch_code_for(major, minor);
    return code.own_code + (size_t)LG_CUBLASLT_KERNELS_LOADED * code.cublaslt_kernel;
}

size_t lg_cuda_runtime_parts_sum(const lg_cuda_runtime_parts *p) {
    return p->context + p->local + p->own_kernels + p->cublaslt + p->nccl;
}

/* The estimate for one card (lg_cuda_runtime_estimate_parts with a card). */
static void lg_cuda_card_runtime(const lg_gpu_card *card, int communicators,
                                 lg_cuda_runtime_parts *p) {
    size_t threads = (size_t)card->sms * (size_t)card->threads_per_sm;
    size_t beyond = LG_CUDA_STACK_FRAME_MAX > LG_CUDA_DEFAULT_STACK_BYTES
                        ? LG_CUDA_STACK_FRAME_MAX - LG_CUDA_DEFAULT_STACK_BYTES : 0;
    lg_cuda_arch_code code = lg_cuda_arch_code_for(card->major, card->minor);
    p->context = threads * LG_CUDA_CONTEXT_BYTES_PER_THREAD;
    p->local = threads * beyond;
    p->own_kernels = code.own_code;
    p->cublaslt = LG_CUBLASLT_HANDLE_ESTIMATE + (size_t)LG_CUBLASLT_KERNELS_LOADED * code.cublaslt_kernel;
    p->nccl = (size_t)communicators * LG_NCCL_COMM_ESTIMATE;
    p->own_image = code.own_image;
    p->cublaslt_eager = code.cublaslt_eager;
}

void lg_cuda_runtime_estimate_parts(const lg_gpu_card *card, int communicators,
                                    lg_cuda_runtime_parts *parts) {
    if (card) {
        lg_cuda_card_runtime(card, communicators, parts);
        return;
    }
    memset(parts, 0, sizeof *parts);
    for (int i = 0; i < lg_gpu_card_count(); i++) {
        lg_cuda_runtime_parts p;
        if (!lg_gpu_card_supported(&lg_gpu_cards[i])) continue;
        lg_cuda_card_runtime(&lg_gpu_cards[i], communicators, &p);
        if (lg_cuda_runtime_parts_sum(&p) > lg_cuda_runtime_parts_sum(parts)) *parts = p;
    }
}


#define LG_MARGIN_FLOOR ((size_t)256 << 20) /* the default margin's least */

/* The device memory a GPU plan keeps free beyond what it counts (allocator rounding, local
   memory a kernel's stack may grow, the driver's own): --memory-margin, else 1% of the limit or
   256 MiB, whichever is more; 0 on the CPU backend. */
static size_t lg_args_margin(const lg_args *args, size_t limit) {
    if (args->backend == LG_BACKEND_CPU) return 0;
    if (args->memory_margin_given) return args->memory_margin;
    return limit / 100 > LG_MARGIN_FLOOR ? limit / 100 : LG_MARGIN_FLOOR;
}

size_t lg_args_host_limit(const lg_args *args) {
    return args->host_memory_limit ? args->host_memory_limit : args->host_available;
}

/* The fit check's verdict on a run's checked and host bytes (lg_plan_checked_bytes,
   lg_plan_host_bytes_per_machine): the one test that the fit check and every choice (-t auto,
   -b auto, the chunks, the remedies) hold a run to. */
static void lg_fit_judge(const lg_args *args, size_t limit, size_t checked, size_t host,
                         lg_fit *fit) {
    memset(fit, 0, sizeof *fit);
    fit->limit = limit;
    fit->checked_bytes = checked;
    fit->host_bytes = host;
    fit->margin = limit ? lg_args_margin(args, limit) : 0;
    fit->gpu = args->gpu;
    fit->runtime_estimated = args->backend == LG_BACKEND_CUDA && args->runtime_estimated;
    if (fit->runtime_estimated) fit->runtime = args->runtime_parts;
    fit->device_fits = limit == 0 || (checked <= limit && fit->margin <= limit - checked);
    fit->host_fits = 1;
    if (args->backend != LG_BACKEND_CPU) { /* on the CPU the host pools are in checked_bytes */
        fit->host_limit = lg_args_host_limit(args);
        fit->host_fits = fit->host_limit == 0 || host <= fit->host_limit;
    }
    fit->fits = limit == 0 ? -1 : fit->device_fits && fit->host_fits;
}

void lg_plan_check_fit(const lg_plan *plan, const lg_args *args, size_t limit, lg_fit *fit) {
    lg_fit_judge(args, limit, lg_plan_checked_bytes(plan), lg_plan_host_bytes_per_machine(plan),
                 fit);
}

/* Device bytes of a run (0 when it cannot be planned); the host bytes of its machine's ranks
   into *host (lg_plan_host_bytes_per_machine) and what its fit check holds against the limit
   into *checked. */
static size_t lg_plan_pools_for(const lg_config *cfg, const lg_args *args, int T, size_t *host,
                                size_t *checked) {
    lg_plan_spec spec;
    lg_plan plan;
    lg_plan_spec_from_args(&spec, args, T);
    *host = *checked = 0;
    if (lg_plan_make(&plan, cfg, &spec, NULL) != 0) return 0;
    size_t bytes = lg_plan_bytes(&plan, LG_POOL_DEVICE);
    *host = lg_plan_host_bytes_per_machine(&plan);
    *checked = lg_plan_checked_bytes(&plan);
    lg_plan_free(&plan);
    return bytes;
}

size_t lg_plan_device_bytes_for(const lg_config *cfg, const lg_args *args, int T) {
    size_t host, checked;
    return lg_plan_pools_for(cfg, args, T, &host, &checked);
}

size_t lg_plan_checked_bytes_for(const lg_config *cfg, const lg_args *args, int T) {
    size_t host, checked;
    lg_plan_pools_for(cfg, args, T, &host, &checked);
    return checked;
}

/* The fit check's verdict (lg_fit_judge): on the CPU backend both pools of a machine's ranks
   within the limit (they are one memory); on a GPU the device pool within the limit and a
   machine's host pools within its host memory (lg_args_host_limit). A run that cannot be
   planned (device 0) or an unknown limit (0): no. */
static int lg_pools_fit(const lg_args *args, size_t device, size_t host, size_t checked,
                        size_t limit) {
    lg_fit fit;
    if (device == 0) return 0;
    lg_fit_judge(args, limit, checked, host, &fit);
    return fit.fits == 1;
}

/* The run as its args say, --head-rows 0 meaning all rows at once. */
static int lg_fits_as_given(const lg_config *cfg, const lg_args *args, int T, size_t limit) {
    size_t host, checked, device = lg_plan_pools_for(cfg, args, T, &host, &checked);
    return lg_pools_fit(args, device, host, checked, limit);
}

void lg_plan_auto_rows(const lg_config *cfg, const lg_args *args, int T, size_t limit,
                       int *head_rows, int *slice_rows) {
    int N = args->micro_batch_size * T;
    lg_args a = *args;
    a.head_rows = args->head_rows > 0 ? args->head_rows : N;
    a.slice_rows = args->slice_rows > 0 ? args->slice_rows : N;
    if (!lg_fits_as_given(cfg, &a, T, limit) && !args->head_rows && N > LG_HEAD_CHUNK_ROWS)
        a.head_rows = LG_HEAD_CHUNK_ROWS;
    if (!lg_fits_as_given(cfg, &a, T, limit) && !args->slice_rows && args->recompute &&
        N > LG_SLICE_ROWS)
        a.slice_rows = LG_SLICE_ROWS;
    *head_rows = lg_head_rows_of(&a, N);
    *slice_rows = lg_slice_rows_of(&a, N);
}

/* Whether the token embedding can live in host memory (lg_host_embedding_check,
   lg_args_check_offload_embedding). */
static int lg_host_embedding_possible(const lg_config *cfg, const lg_args *args) {
    lg_args moved = *args;
    lg_error refused;
    moved.offload_embedding = 1;
    return !cfg->tie_embeddings && !cfg->learned_pos_embedding &&
           lg_args_check_offload_embedding(&moved, &refused) == 0;
}

int lg_plan_auto_embedding(const lg_config *cfg, const lg_args *args, int T, size_t limit) {
    if (args->offload_embedding) return 1;
    if (limit == 0 || !lg_host_embedding_possible(cfg, args) ||
        lg_fits_as_given(cfg, args, T, limit))
        return 0;
    lg_args moved = *args;
    moved.offload_embedding = 1;
    return lg_fits_as_given(cfg, &moved, T, limit);
}

/* The run with --head-rows and --slice-rows the planner's where they are 0, and LoRA's token
   embedding where the planner puts it (lg_plan_auto_embedding). */
static void lg_args_with_auto_rows(const lg_config *cfg, const lg_args *args, int T,
                                   size_t limit, lg_args *out) {
    *out = *args;
    if (!args->head_rows || !args->slice_rows)
        lg_plan_auto_rows(cfg, args, T, limit, &out->head_rows, &out->slice_rows);
    out->offload_embedding = lg_plan_auto_embedding(cfg, out, T, limit);
}

static int lg_fits(const lg_config *cfg, const lg_args *args, int T, size_t limit) {
    lg_args a;
    lg_args_with_auto_rows(cfg, args, T, limit, &a);
    return lg_fits_as_given(cfg, &a, T, limit);
}

/* The global batch the run asked for (samples per optimizer step over all devices). */
static int lg_global_batch(const lg_args *a) {
    return a->global_batch_size ? a->global_batch_size : a->micro_batch_size * lg_args_ranks(a);
}

int lg_plan_auto_micro_batch(const lg_config *cfg, const lg_args *args, int T, size_t limit) {
    lg_args a = *args;
    if (lg_args_ranks(args) < 1) return 0;
    int per_device = lg_global_batch(args) / lg_args_ranks(args);
    for (int b = per_device; b >= 1; b--) {
        if (per_device % b != 0) continue;
        a.micro_batch_size = b;
        a.global_batch_size = lg_global_batch(args);
        if (lg_fits(cfg, &a, T, limit)) return b;
    }
    return 0;
}

/* Fills r from a changed run (changes: its LG_SETTING_* bits) and prices it. */
static void lg_remedy_price(lg_remedy *r, const char *what, unsigned changes,
                            const lg_config *cfg, const lg_args *a, int T, size_t limit) {
    r->what = what;
    lg_args_with_auto_rows(cfg, a, T, limit, &r->args);
    r->T = T;
    r->changes = changes;
    size_t host, checked;
    r->device_bytes = lg_plan_pools_for(cfg, &r->args, T, &host, &checked);
    r->host_bytes = host;
    r->checked_bytes = checked;
    r->fits = lg_pools_fit(a, r->device_bytes, host, checked, limit);
}

int lg_plan_auto_seq_length(const lg_config *cfg, const lg_args *args, int max_T, size_t limit) {
    int lo = 1, hi = max_T, best = 0; /* the plan grows with T: a binary search */
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        if (lg_fits(cfg, args, mid, limit)) { best = mid; lo = mid + 1; }
        else hi = mid - 1;
    }
    return best;
}

/* The largest sequence length below T that fits (halving when none does). */
static int lg_fitting_seq_length(const lg_config *cfg, const lg_args *a, int T, size_t limit) {
    int best = lg_plan_auto_seq_length(cfg, a, T - 1, limit);
    return best ? best : (T / 2 > 0 ? T / 2 : 1);
}

/* The step down in optimizer state: AdamW's moments in 8 bits, AdamW or Sophia to Lion's one
   state, Lion or SGD with momentum to plain SGD. Returns the settings it changes, 0 when there
   is none. */
static unsigned lg_lighter_optimizer(const lg_args *args, lg_args *a) {
    *a = *args;
    if (args->optimizer == LG_OPTIMIZER_ADAMW && args->optimizer_state != LG_STATE_8BIT) {
        a->optimizer_state = LG_STATE_8BIT;
        return LG_SETTING_OPTIMIZER_STATE;
    }
    if (args->optimizer == LG_OPTIMIZER_ADAMW || args->optimizer == LG_OPTIMIZER_SOPHIA) {
        a->optimizer = LG_OPTIMIZER_LION;
        a->optimizer_state = LG_STATE_AS_PRECISION; /* Lion's state has no other format */
        return LG_SETTING_OPTIMIZER;
    }
    if (args->optimizer == LG_OPTIMIZER_LION || args->momentum != 0.0f) {
        a->optimizer = LG_OPTIMIZER_SGD;
        a->momentum = 0;
        return LG_SETTING_OPTIMIZER | LG_SETTING_MOMENTUM;
    }
    return 0;
}

/* LitGPT's default adapter rank, the one LoRA and QLoRA remedies use. */
#define LG_LORA_REMEDY_RANK 8

/* Fine-tuning every weight: LoRA's adapters over the frozen model (LitGPT's defaults: r 8 on q
   and v), or QLoRA's with the base in NF4 with double quantization. Returns the settings it
   changes, 0 when it does not apply (not fine-tuning, or adapters already). */
static unsigned lg_lora_remedy(const lg_args *args, int quantized, lg_args *a) {
    if (!args->finetuning || args->lora.r > 0) return 0;
    *a = *args;
    a->lora.r = LG_LORA_REMEDY_RANK;
    a->lora.quantize = quantized ? LG_QUANTIZE_NF4_DQ : LG_QUANTIZE_NONE;
    return LG_SETTING_LORA_R | (quantized ? LG_SETTING_QUANTIZE : 0);
}

/* The offload parts a's settings hold, marked: "`offload`" for state alone, else
   "`offload activations,gradients`" (gradients and weights bring state along). */
static void lg_offload_setting(const lg_args *a, char *out, size_t cap) {
    const char *parts[5];
    int n = 0, state = a->offload && !a->offload_gradients && !a->offload_weights;
    if (state) parts[n++] = "state";
    if (a->offload_activations) parts[n++] = "activations";
    if (a->offload_gradients) parts[n++] = "gradients";
    if (a->offload_weights) parts[n++] = "weights";
    if (a->offload_embedding) parts[n++] = "embedding";
    if (n == 1 && state) {
        lg_format(out, cap, "`offload`");
        return;
    }
    char list[48] = ""; /* "activations,gradients,weights,embedding" at most */
    for (int i = 0; i < n; i++) strcat(strcat(list, i ? "," : ""), parts[i]);
    lg_format(out, cap, "`offload %s`", list);
}

/* One changed setting of r (bit: one of its LG_SETTING_* bits but the offload parts'),
   marked with its value. */
static void lg_remedy_setting(const lg_remedy *r, unsigned bit, char *out, size_t cap) {
    const lg_args *a = &r->args;
    switch (bit) {
    case LG_SETTING_RECOMPUTE: lg_format(out, cap, "`recompute %s`", a->recompute ? "block" : "none"); break;
    case LG_SETTING_PRECISION: lg_format(out, cap, "`precision %s`", lg_precision_name(a->precision)); break;
    case LG_SETTING_LORA_R: lg_format(out, cap, "`lora.r %d`", a->lora.r); break;
    case LG_SETTING_QUANTIZE:
        lg_format(out, cap, "`lora.quantize %s`", lg_quantization_name(a->lora.quantize));
        break;
    case LG_SETTING_OPTIMIZER_STATE:
        lg_format(out, cap, "`optimizer_state %s`", a->optimizer_state == LG_STATE_AS_PRECISION
                                                        ? "as-precision"
                                                        : lg_state_format_names[a->optimizer_state]);
        break;
    case LG_SETTING_OPTIMIZER: lg_format(out, cap, "`optimizer %s`", lg_optimizer_name(a->optimizer)); break;
    case LG_SETTING_MOMENTUM: lg_format(out, cap, "`momentum %g`", a->momentum); break;
    case LG_SETTING_SEQ_LENGTH: lg_format(out, cap, "`max_seq_length %d`", r->T); break;
    case LG_SETTING_MICRO_BATCH: lg_format(out, cap, "`micro_batch_size %d`", a->micro_batch_size); break;
    case LG_SETTING_GLOBAL_BATCH: lg_format(out, cap, "`global_batch_size %d`", a->global_batch_size); break;
    case LG_SETTING_DEVICES: lg_format(out, cap, "`devices %d`", a->devices); break;
    case LG_SETTING_STRATEGY: lg_format(out, cap, "`strategy %s`", lg_strategy_name(a->strategy)); break;
    default: out[0] = '\0';
    }
}

const char *lg_remedy_settings(const lg_remedy *r, char *out, size_t cap) {
    const unsigned offload_parts = LG_SETTING_OFFLOAD | LG_SETTING_OFFLOAD_ACTIVATIONS |
                                   LG_SETTING_OFFLOAD_GRADIENTS | LG_SETTING_OFFLOAD_WEIGHTS |
                                   LG_SETTING_OFFLOAD_EMBEDDING;
    size_t used = 0;
    int offload_named = 0;
    out[0] = '\0';
    for (unsigned bit = 1; bit <= LG_SETTING_LAST; bit <<= 1) {
        char one[64];
        if (!(r->changes & bit) || ((bit & offload_parts) && offload_named++)) continue;
        if (bit & offload_parts) lg_offload_setting(&r->args, one, sizeof one);
        else lg_remedy_setting(r, bit, one, sizeof one);
        if (one[0] && used < cap) used += (size_t)lg_format(out + used, cap - used, "%s%s", used ? " " : "", one);
    }
    return out;
}

int lg_plan_remedies(const lg_config *cfg, const lg_args *args, int T, size_t limit,
                     lg_remedy *out) {
    int n = 0, global = lg_global_batch(args);
    lg_args a;
    if (args->micro_batch_size > 1) { /* accumulation keeps the global batch */
        a = *args;
        a.global_batch_size = global;
        a.micro_batch_size = lg_plan_auto_micro_batch(cfg, &a, T, limit);
        if (a.micro_batch_size == 0) a.micro_batch_size = 1;
        if (a.micro_batch_size < args->micro_batch_size)
            lg_remedy_price(&out[n++], "smaller micro-batch",
                            LG_SETTING_MICRO_BATCH | LG_SETTING_GLOBAL_BATCH, cfg, &a, T, limit);
    }
    if (T > 1)
        lg_remedy_price(&out[n++], "shorter sequence", LG_SETTING_SEQ_LENGTH, cfg, args,
                        lg_fitting_seq_length(cfg, args, T, limit), limit);
    if (args->precision != LG_PRECISION_BF16_TRUE && args->precision != LG_PRECISION_16_TRUE) {
        a = *args;
        a.precision = LG_PRECISION_BF16_TRUE;
        lg_remedy_price(&out[n++], "a -true precision", LG_SETTING_PRECISION, cfg, &a, T, limit);
    }
    a = *args; /* the fewest of 2, 4, 8 times the devices that fits */
    for (a.devices = 2 * args->devices;; a.devices *= 2) {
        int per_step = lg_args_ranks(&a) * a.micro_batch_size; /* keep -g a multiple of it */
        a.global_batch_size = (global + per_step - 1) / per_step * per_step;
        if (a.devices == 8 * args->devices || lg_fits(cfg, &a, T, limit)) break;
    }
    a.strategy = LG_STRATEGY_FULL_SHARD;
    /* the devices; the strategy and the global batch only where they differ from what the
       new device count gives by default (full-shard, -b x ranks) */
    unsigned devices = LG_SETTING_DEVICES;
    if (args->strategy != a.strategy) devices |= LG_SETTING_STRATEGY;
    if (args->global_batch_size && a.global_batch_size != args->global_batch_size)
        devices |= LG_SETTING_GLOBAL_BATCH;
    lg_remedy_price(&out[n++], "more devices (full-shard)", devices, cfg, &a, T, limit);
    if (!args->recompute) {
        a = *args;
        a.recompute = 1;
        lg_remedy_price(&out[n++], "block recompute", LG_SETTING_RECOMPUTE, cfg, &a, T, limit);
    }
    if (!args->offload) {
        a = *args;
        a.offload = 1;
        lg_remedy_price(&out[n++], "CPU offload", LG_SETTING_OFFLOAD, cfg, &a, T, limit);
    }
    a = *args;
    a.offload = a.offload_gradients = 1;
    lg_error refused;
    if (!args->offload_gradients && lg_args_check_offload_gradients(&a, &refused) == 0)
        lg_remedy_price(&out[n++], "gradients to the host", LG_SETTING_OFFLOAD_GRADIENTS, cfg, &a,
                        T, limit);
    a = *args;
    a.offload = a.offload_weights = 1;
    if (!args->offload_weights && lg_args_check_offload_weights(&a, &refused) == 0)
        lg_remedy_price(&out[n++], "weights in host memory", LG_SETTING_OFFLOAD_WEIGHTS, cfg, &a, T,
                        limit);
    a = *args;
    a.offload_embedding = 1;
    if (!args->offload_embedding && lg_host_embedding_possible(cfg, args))
        lg_remedy_price(&out[n++], "embedding in host memory", LG_SETTING_OFFLOAD_EMBEDDING,
                        cfg, &a, T, limit);
    if (!args->offload_activations) { /* it moves what recompute keeps: recompute with it */
        a = *args;
        a.recompute = a.offload_activations = 1;
        lg_remedy_price(&out[n++], "activations in host memory",
                        LG_SETTING_OFFLOAD_ACTIVATIONS | (args->recompute ? 0 : LG_SETTING_RECOMPUTE),
                        cfg, &a, T, limit);
    }
    unsigned changes = lg_lighter_optimizer(args, &a);
    if (changes)
        lg_remedy_price(&out[n++], "an optimizer with less state", changes, cfg, &a, T, limit);
    for (int q = 0; q < 2 && (changes = lg_lora_remedy(args, q, &a)) != 0; q++)
        lg_remedy_price(&out[n++], q ? "QLoRA (NF4 base)" : "LoRA adapters", changes, cfg, &a, T,
                        limit);
    return n;
}

/* The changes the cheapest fit combines. Six keep the training the same: a smaller
   micro-batch (accumulation keeps the global batch), block recompute, offload, the kept block
   inputs in host memory (with recompute), the gradients streamed to the host and the weights
   streamed from it (with offload; all give the same bits, at a cost in time). The others
   change it, in order of how much: a -true precision changes the numerics a little, an
   optimizer with less state the optimisation, a shorter sequence what the model sees. */
enum { LG_FIX_MICRO_BATCH = 1, LG_FIX_RECOMPUTE = 2, LG_FIX_OFFLOAD = 4, LG_FIX_PRECISION = 8,
       LG_FIX_OPTIMIZER = 16, LG_FIX_SEQUENCE = 32, LG_FIX_LORA = 64, LG_FIX_QLORA = 128,
       LG_FIX_ACTIVATIONS = 256, /* --offload activations, always with LG_FIX_RECOMPUTE */
       LG_FIX_GRADIENTS = 512,   /* --offload gradients (offload with it), where it runs */
       LG_FIX_WEIGHTS = 1024 };  /* --offload weights (offload with it), where it runs */

/* The gradients or weights streamed (--offload gradients, weights; each brings --offload)
   where the run allows them (lg_args_check_offload_gradients, _weights); the settings
   changed. */
static unsigned lg_apply_streaming(lg_args *a, int fixes) {
    lg_args b = *a;
    lg_error refused;
    unsigned changes = 0;
    b.offload = 1;
    b.offload_gradients = a->offload_gradients || (fixes & LG_FIX_GRADIENTS);
    if (b.offload_gradients != a->offload_gradients && lg_args_check_offload_gradients(&b, &refused) == 0) {
        *a = b;
        changes |= LG_SETTING_OFFLOAD_GRADIENTS;
    }
    b = *a;
    b.offload = 1;
    b.offload_weights = a->offload_weights || (fixes & LG_FIX_WEIGHTS);
    if (b.offload_weights != a->offload_weights && lg_args_check_offload_weights(&b, &refused) == 0) {
        *a = b;
        changes |= LG_SETTING_OFFLOAD_WEIGHTS;
    }
    return changes;
}

/* Applies a set of fixes to args and T; the micro-batch and the sequence length become the
   largest that fit with the others. Returns the settings changed (LG_SETTING_* bits). */
static unsigned lg_apply_fixes(const lg_config *cfg, const lg_args *args, int T, size_t limit,
                               int fixes, lg_args *a, int *t) {
    unsigned changes = 0;
    *a = *args;
    *t = T;
    a->global_batch_size = lg_global_batch(args);
    if (fixes & LG_FIX_RECOMPUTE) {
        a->recompute = 1;
        changes |= LG_SETTING_RECOMPUTE;
    }
    if (fixes & LG_FIX_OFFLOAD) {
        a->offload = 1;
        changes |= LG_SETTING_OFFLOAD;
    }
    if (fixes & LG_FIX_ACTIVATIONS) {
        a->offload_activations = 1;
        changes |= LG_SETTING_OFFLOAD_ACTIVATIONS;
    }
    changes |= lg_apply_streaming(a, fixes);
    if (fixes & LG_FIX_PRECISION) {
        a->precision = LG_PRECISION_BF16_TRUE;
        changes |= LG_SETTING_PRECISION;
    }
    lg_args changed;
    unsigned more;
    if ((fixes & (LG_FIX_LORA | LG_FIX_QLORA)) &&
        (more = lg_lora_remedy(a, (fixes & LG_FIX_QLORA) != 0, &changed)) != 0) {
        *a = changed;
        changes |= more;
    }
    if ((fixes & LG_FIX_OPTIMIZER) && (more = lg_lighter_optimizer(a, &changed)) != 0) {
        *a = changed;
        changes |= more;
    }
    if (fixes & LG_FIX_MICRO_BATCH) {
        a->micro_batch_size = 1; /* the sequence search below assumes the smallest */
        if (!(fixes & LG_FIX_SEQUENCE)) {
            int b = lg_plan_auto_micro_batch(cfg, a, T, limit);
            a->micro_batch_size = b ? b : 1;
        }
        changes |= LG_SETTING_MICRO_BATCH | LG_SETTING_GLOBAL_BATCH;
    }
    if (fixes & LG_FIX_SEQUENCE) {
        *t = lg_fitting_seq_length(cfg, a, T, limit);
        changes |= LG_SETTING_SEQ_LENGTH;
    }
    return changes;
}

int lg_plan_cheapest_fit(const lg_config *cfg, const lg_args *args, int T, size_t limit,
                         lg_remedy *best) {
    /* changes to the training, least first; within each, the same-training fixes by how many
       (fewest first), then in the OOM guide's order */
    static const int changes[] = {0, LG_FIX_PRECISION, LG_FIX_LORA,
                                  LG_FIX_LORA | LG_FIX_PRECISION, LG_FIX_QLORA,
                                  LG_FIX_QLORA | LG_FIX_PRECISION, LG_FIX_OPTIMIZER,
                                  LG_FIX_OPTIMIZER | LG_FIX_PRECISION, LG_FIX_SEQUENCE,
                                  LG_FIX_SEQUENCE | LG_FIX_PRECISION,
                                  LG_FIX_SEQUENCE | LG_FIX_OPTIMIZER | LG_FIX_PRECISION};
    static const int same_training[] = {0, LG_FIX_MICRO_BATCH, LG_FIX_RECOMPUTE, LG_FIX_OFFLOAD,
                                        LG_FIX_MICRO_BATCH | LG_FIX_RECOMPUTE,
                                        LG_FIX_MICRO_BATCH | LG_FIX_OFFLOAD,
                                        LG_FIX_RECOMPUTE | LG_FIX_OFFLOAD,
                                        LG_FIX_MICRO_BATCH | LG_FIX_RECOMPUTE | LG_FIX_OFFLOAD,
                                        LG_FIX_RECOMPUTE | LG_FIX_ACTIVATIONS,
                                        LG_FIX_MICRO_BATCH | LG_FIX_RECOMPUTE | LG_FIX_ACTIVATIONS,
                                        LG_FIX_RECOMPUTE | LG_FIX_OFFLOAD | LG_FIX_ACTIVATIONS,
                                        LG_FIX_MICRO_BATCH | LG_FIX_RECOMPUTE | LG_FIX_OFFLOAD |
                                            LG_FIX_ACTIVATIONS,
                                        LG_FIX_RECOMPUTE | LG_FIX_GRADIENTS,
                                        LG_FIX_MICRO_BATCH | LG_FIX_RECOMPUTE | LG_FIX_GRADIENTS,
                                        LG_FIX_RECOMPUTE | LG_FIX_GRADIENTS | LG_FIX_ACTIVATIONS,
                                        LG_FIX_MICRO_BATCH | LG_FIX_RECOMPUTE | LG_FIX_GRADIENTS |
                                            LG_FIX_ACTIVATIONS,
                                        LG_FIX_RECOMPUTE | LG_FIX_GRADIENTS | LG_FIX_WEIGHTS,
                                        LG_FIX_MICRO_BATCH | LG_FIX_RECOMPUTE | LG_FIX_GRADIENTS |
                                            LG_FIX_WEIGHTS,
                                        LG_FIX_RECOMPUTE | LG_FIX_GRADIENTS | LG_FIX_WEIGHTS |
                                            LG_FIX_ACTIVATIONS,
                                        LG_FIX_MICRO_BATCH | LG_FIX_RECOMPUTE | LG_FIX_GRADIENTS |
                                            LG_FIX_WEIGHTS | LG_FIX_ACTIVATIONS};
    lg_args a;
    int t;
    for (size_t i = 0; i < sizeof changes / sizeof changes[0]; i++)
        for (size_t j = 0; j < sizeof same_training / sizeof same_training[0]; j++) {
            int fixes = changes[i] | same_training[j];
            if (fixes == 0) continue;
            if ((fixes & (LG_FIX_LORA | LG_FIX_QLORA)) && !lg_lora_remedy(args, 0, &a))
                continue; /* adapters only when fine-tuning every weight */
            unsigned settings = lg_apply_fixes(cfg, args, T, limit, fixes, &a, &t);
            lg_remedy_price(best, "cheapest", settings, cfg, &a, t, limit);
            if (best->fits) return 0;
        }
    return -1; /* best holds the last, most drastic, attempt */
}

size_t lg_host_available_bytes(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    char line[256];
    unsigned long long kib = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kib) == 1) break;
    if (f) fclose(f);
    return (size_t)kib * 1024;
}

/* --- sizes as people write them ------------------------------------------------------------- */

/* a and b equal but for the case of ASCII letters */
static int lg_equal_nocase(const char *a, const char *b) {
    for (; *a && *b; a++, b++)
        if (tolower((unsigned char)*a) != tolower((unsigned char)*b)) return 0;
    return *a == *b;
}

/* A number and a unit, in any case ("24GiB", "512 mib", "8GB", "100B"); a bare number is
   refused: 24 bytes is never what "--memory-limit 24" meant. */
int lg_parse_size(const char *text, size_t *bytes) {
    static const struct { const char *suffix; double scale; } units[] = {
        {"KiB", 1024.0}, {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
        {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}, {"K", 1024.0}, {"M", 1048576.0},
        {"G", 1073741824.0}, {"T", 1099511627776.0}, {"B", 1.0}};
    char *end;
    errno = 0;
    double value = strtod(text, &end);
    if (end == text || errno || !(value >= 0)) return -1;
    while (*end == ' ') end++;
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++)
        if (lg_equal_nocase(end, units[i].suffix)) {
            double b = value * units[i].scale;
            if (b > 1.8e19) return -1;
            *bytes = (size_t)b;
            return 0;
        }
    return -1;
}

const char *lg_format_bytes(size_t bytes, char *buf, size_t size) {
    if (bytes >= 1073741824ull) snprintf(buf, size, "%.2f GiB", bytes / 1073741824.0);
    else if (bytes >= 1048576ull) snprintf(buf, size, "%.1f MiB", bytes / 1048576.0);
    else if (bytes >= 1024ull) snprintf(buf, size, "%.1f KiB", bytes / 1024.0);
    else snprintf(buf, size, "%zu B", bytes);
    return buf;
}

const char *lg_cuda_runtime_parts_describe(const lg_cuda_runtime_parts *p, char *buf,
                                           size_t cap) {
    char context[32], local[32], own[32], lt[32], eager[32], nccl[32];
    snprintf(buf, cap, "context %s, local memory beyond the default stack %s, our kernels %s "
             "(%s), cuBLASLt %s (kernels loaded lazily; eagerly %s), NCCL %s",
             lg_format_bytes(p->context, context, sizeof context),
             lg_format_bytes(p->local, local, sizeof local),
             lg_format_bytes(p->own_kernels, own, sizeof own), p->own_image,
             lg_format_bytes(p->cublaslt, lt, sizeof lt),
             lg_format_bytes(p->cublaslt_eager, eager, sizeof eager),
             lg_format_bytes(p->nccl, nccl, sizeof nccl));
    return buf;
}

/* --- printing ------------------------------------------------------------------------------- */

static void lg_plan_print_rank(const lg_plan *plan, int index, FILE *out) {
    const lg_rank_plan *r = &plan->ranks[index];
    char a[32], b[32];
    for (int pool = 0; pool < LG_N_POOLS; pool++) {
        size_t total = r->pool_bytes[pool];
        if (total == 0) continue;
        fprintf(out, "  %s pool: %s\n", lg_pool_name((lg_pool)pool),
                lg_format_bytes(total, a, sizeof a));
        for (int g = 0; g < LG_N_GROUPS; g++) {
            size_t bytes = lg_plan_group_bytes(r, (lg_group)g, (lg_pool)pool);
            if (bytes == 0) continue;
            int regions = 0;
            const lg_region *largest = NULL;
            for (int i = 0; i < r->n_regions; i++) {
                const lg_region *x = &r->regions[i];
                if ((int)x->group != g || (int)x->pool != pool) continue;
                regions++;
                if (!largest || x->bytes > largest->bytes) largest = x;
            }
            char bar[41];
            double share = (double)bytes / (double)total; /* in [0, 1] unless sizes wrapped */
            int width = share >= 1.0 ? 40 : share > 0.0 ? (int)(40.0 * share + 0.5) : 0;
            memset(bar, '#', (size_t)width);
            bar[width] = '\0';
            fprintf(out, "    %-22s %11s %5.1f%%  %-40s", lg_group_name((lg_group)g),
                    lg_format_bytes(bytes, a, sizeof a), 100.0 * bytes / total, bar);
            if (regions == 1)
                fprintf(out, "  %s %s x %zu\n", largest->name, lg_dtype_name(largest->dtype),
                        largest->count);
            else
                fprintf(out, "  %d regions, largest %s %s\n", regions, largest->name,
                        lg_format_bytes(largest->bytes, b, sizeof b));
        }
    }
}

/* LoRA's line of the plan: what trains and how the frozen model is stored. */
static void lg_plan_print_lora(const lg_plan *plan, FILE *out) {
    const lg_config *c = &plan->cfg;
    char targets[64];
    if (c->lora.r == 0) return;
    size_t trainable = lg_params_layout(c, lg_no_buf(), NULL, NULL);
    lg_config base = lg_config_base(c);
    size_t total = lg_params_layout(&base, lg_no_buf(), NULL, NULL);
    fprintf(out, "LoRA: r %d, alpha %g, dropout %g on %s: %zu trainable parameters (%.3f%% of "
            "%zu); the base model is frozen", c->lora.r, c->lora.alpha, c->lora.dropout,
            lg_lora_targets_name(c->lora.targets, targets, sizeof targets), trainable,
            100.0 * (double)trainable / (double)total, total);
    if (c->lora.quantize != LG_QUANTIZE_NONE && c->tie_embeddings)
        fprintf(out, ", its linear weights in %s (lm_head is the tied embedding: kept as is)",
                lg_quantization_name(c->lora.quantize));
    else if (c->lora.quantize != LG_QUANTIZE_NONE)
        fprintf(out, ", its linear weights in %s (lm_head included, as LitGPT does, dequantized "
                "%d vocabulary rows at a time)", lg_quantization_name(c->lora.quantize),
                lg_head_tile_rows(c));
    if (c->lora.host_embedding)
        fprintf(out, "; its token embedding in host memory (embedding.host), the step's rows "
                     "gathered there and copied in (embedding.rows)");
    fprintf(out, "\n");
}

/* Ranks i and j have the same regions. */
static int lg_rank_plans_alike(const lg_plan *plan, int i, int j) {
    const lg_rank_plan *a = &plan->ranks[i], *b = &plan->ranks[j];
    int same = a->n_regions == b->n_regions;
    for (int k = 0; same && k < a->n_regions; k++)
        same = strcmp(a->regions[k].name, b->regions[k].name) == 0 &&
               a->regions[k].bytes == b->regions[k].bytes;
    return same;
}

/* The plan line's offload: " | offload (gradients and weights streamed)", or "" */
static const char *lg_plan_offload_label(const lg_plan *plan) {
    const lg_plan_spec *s = &plan->spec;
    if (!s->offload) return "";
    if (lg_embedding_trained_on_host(&plan->cfg))
        return " | offload (gradients and weights streamed, the token embedding trained on the host)";
    if (s->offload_gradients && s->offload_weights) return " | offload (gradients and weights streamed)";
    if (s->offload_gradients) return " | offload (gradients streamed)";
    return s->offload_weights ? " | offload (weights streamed)" : " | offload";
}

void lg_plan_print(const lg_plan *plan, FILE *out) {
    const lg_plan_spec *s = &plan->spec;
    char a[32], b[32];
    char ranks[64] = "";
    if (s->nodes > 1) snprintf(ranks, sizeof ranks, " x %d nodes", s->nodes);
    if (plan->n_ranks > 1)
        snprintf(ranks + strlen(ranks), sizeof ranks - strlen(ranks), ", %s",
                 lg_strategy_name(s->strategy));
    char head[96] = ""; /* the head and loss in chunks, the MLP in slices */
    if (s->head_rows < s->B * s->T)
        snprintf(head, sizeof head, " | head in chunks of %d rows", s->head_rows);
    if (s->slice_rows < s->B * s->T)
        snprintf(head + strlen(head), sizeof head - strlen(head), " | MLP in slices of %d rows",
                 s->slice_rows);
    fprintf(out, "plan: %s | `micro_batch_size %d` `max_seq_length %d` (%d accumulation) | %s | %d device%s%s%s%s | %s%s\n",
            plan->cfg.name, s->B, s->T, s->accumulation, lg_precision_name(s->precision),
            s->devices, s->devices > 1 ? "s" : "", ranks, s->recompute ? " | recompute block" : "",
            lg_plan_offload_label(plan),
            s->optimizer == LG_OPTIMIZER_SGD && s->momentum ? "sgd (momentum)"
                                                             : lg_optimizer_name(s->optimizer),
            head);
    lg_plan_print_lora(plan, out);
    if (s->processes > 1)
        fprintf(out, "processes: %d, %d rank%s each (MPI's buffers in the host pool on the CPU)\n",
                s->processes, plan->n_ranks / s->processes, plan->n_ranks > s->processes ? "s" : "");
    for (int i = 0; i < plan->n_ranks; i++) {
        /* ranks with identical plans print once, under the list of them */
        int printed = 0, alike = 0;
        for (int j = 0; j < i && !printed; j++) printed = lg_rank_plans_alike(plan, i, j);
        if (printed) continue;
        char list[256] = "";
        for (int j = i; j < plan->n_ranks; j++)
            if (lg_rank_plans_alike(plan, i, j) && strlen(list) + 12 < sizeof list)
                snprintf(list + strlen(list), sizeof list - strlen(list), "%s%d", alike++ ? ", " : "", j);
        if (alike == plan->n_ranks && alike > 1) fprintf(out, "each of the %d ranks:\n", alike);
        else if (plan->n_ranks == 1) fprintf(out, "device 0:\n");
        else fprintf(out, "rank%s %s:\n", alike > 1 ? "s" : "", list);
        lg_plan_print_rank(plan, i, out);
    }
    fprintf(out, "total per device: %s device, %s host\n",
            lg_format_bytes(lg_plan_bytes(plan, LG_POOL_DEVICE), a, sizeof a),
            lg_format_bytes(lg_plan_bytes(plan, LG_POOL_HOST), b, sizeof b));
}

void lg_plan_print_json(const lg_plan *plan, const lg_fit *fit, FILE *out) {
    const lg_plan_spec *s = &plan->spec;
    fprintf(out, "{\"config\":\"%s\",\"micro_batch_size\":%d,\"max_seq_length\":%d,"
                 "\"head_rows\":%d,\"slice_rows\":%d,\"accumulation\":%d,\"precision\":\"%s\",",
            plan->cfg.name, s->B, s->T, s->head_rows, s->slice_rows, s->accumulation,
            lg_precision_name(s->precision));
    if (fit)
        fprintf(out, "\"limit_bytes\":%zu,\"host_limit_bytes\":%zu,\"margin_bytes\":%zu,"
                     "\"fits\":%s,", fit->limit, fit->host_limit, fit->margin,
                fit->fits < 0 ? "null" : fit->fits ? "true" : "false");
    if (fit && fit->gpu)
        fprintf(out, "\"gpu\":\"%s\",\"arch\":\"sm_%d%d\",\"shared_per_block\":%d,", fit->gpu->name,
                fit->gpu->major, fit->gpu->minor, fit->gpu->shared_optin);
    if (fit && fit->runtime_estimated)
        fprintf(out, "\"runtime_estimate\":{\"context\":%zu,\"local\":%zu,\"own_kernels\":%zu,"
                     "\"own_image\":\"%s\",\"cublaslt\":%zu,\"cublaslt_eager\":%zu,\"nccl\":%zu},",
                fit->runtime.context, fit->runtime.local, fit->runtime.own_kernels,
                fit->runtime.own_image, fit->runtime.cublaslt, fit->runtime.cublaslt_eager,
                fit->runtime.nccl);
    fprintf(out, "\"host_traffic_bytes\":%zu,", lg_plan_host_traffic_bytes(plan));
    fprintf(out, "\"step_flops\":%.6g,", lg_plan_step_flops(plan));
    fprintf(out, "\"devices\":[");
    for (int i = 0; i < plan->n_ranks; i++) {
        const lg_rank_plan *r = &plan->ranks[i];
        fprintf(out, "%s{\"device\":%d,\"device_bytes\":%zu,\"host_bytes\":%zu,\"regions\":[",
                i ? "," : "", i, r->pool_bytes[LG_POOL_DEVICE], r->pool_bytes[LG_POOL_HOST]);
        for (int k = 0; k < r->n_regions; k++) {
            const lg_region *x = &r->regions[k];
            fprintf(out, "%s{\"name\":\"%s\",\"group\":\"%s\",\"pool\":\"%s\",\"dtype\":\"%s\","
                         "\"count\":%zu,\"bytes\":%zu}",
                    k ? "," : "", x->name, lg_group_name(x->group), lg_pool_name(x->pool),
                    lg_dtype_name(x->dtype), x->count, x->bytes);
        }
        fprintf(out, "]}");
    }
    fprintf(out, "]}\n");
}

#ifdef LG_CUDA
#include "litgpt_cuda.cuh" /* the GPU's ops, which the ops below hand over to on a GPU rank */
#endif

/* 6. ranks: memory ---------------------------------------------------------------------------- */

/* Each rank's memory: one arena per pool of its plan, allocated once (on a GPU: device and
   pinned memory), regions looked up by name, and visits - the host's way to read and write
   a buffer wherever it lives, through a staging region in chunks. Everything after this
   section takes its memory from here. */


#ifdef LG_CUDA
int lg_cuda_device_count(void) { return lg_cuda_device_count_impl(); }
lg_backend lg_backend_in_use(void) {
    return lg_cuda_device_count() > 0 ? LG_BACKEND_CUDA : LG_BACKEND_CPU;
}
#else
int lg_cuda_device_count(void) { return 0; }
lg_backend lg_backend_in_use(void) { return LG_BACKEND_CPU; }

int lg_cuda_measure_runtime(int devices, int communicators, size_t *runtime_bytes,
                            size_t *total_bytes, lg_error *err) {
    (void)devices;
    (void)communicators;
    *runtime_bytes = *total_bytes = 0;
    return lg_fail(err, "this build has no CUDA backend");
}

int lg_cuda_memory(int device, size_t *free_bytes, size_t *total_bytes, lg_error *err) {
    (void)device;
    *free_bytes = *total_bytes = 0;
    return lg_fail(err, "this build has no CUDA backend");
}

int lg_cuda_report_topology(int devices, FILE *out) {
    (void)devices;
    (void)out;
    return 0;
}
#endif

static void lg_rank_free(lg_rank *rank) {
    if (!rank) return;
#ifdef LG_CUDA
    if (rank->backend == LG_BACKEND_CUDA) {
        lg_cuda_rank_free(rank);
        memset(rank, 0, sizeof *rank);
        return;
    }
#endif
    for (int pool = 0; pool < LG_N_POOLS; pool++) LG_FREE(rank->arena[pool]);
    memset(rank, 0, sizeof *rank);
}

/* A rank's arenas, as its plan lays them out, on GPU `device` of the node (several processes:
   the process's local ranks; the CPU backend ignores it). */
static int lg_rank_create_on(lg_rank *rank, const lg_plan *plan, int index, int device,
                             lg_error *err) {
    memset(rank, 0, sizeof *rank);
    rank->plan = plan;
    rank->index = index;
    rank->device = device;
    rank->backend = plan->spec.backend;
#ifdef LG_CUDA
    if (rank->backend == LG_BACKEND_CUDA) return lg_cuda_rank_create(rank, err);
#else
    if (rank->backend == LG_BACKEND_CUDA)
        return lg_fail(err, "this build has no CUDA backend (build it with make cuda)");
#endif
    const lg_rank_plan *r = &plan->ranks[index];
    for (int pool = 0; pool < LG_N_POOLS; pool++) {
        if (r->pool_bytes[pool] == 0) continue;
        /* one arena per pool, exactly the planned bytes, aligned for every region */
        rank->arena[pool] = (unsigned char *)lg_alloc_zeroed(r->pool_bytes[pool] + LG_ALIGN);
        if (!rank->arena[pool]) {
            char size[32];
            lg_rank_free(rank);
            return lg_fail(err, "out of %s memory: the plan needs %s (see `plan_only`)",
                           lg_pool_name((lg_pool)pool),
                           lg_format_bytes(r->pool_bytes[pool], size, sizeof size));
        }
    }
    return 0;
}

/* The same on the node's GPU `index`. */
static int lg_rank_create(lg_rank *rank, const lg_plan *plan, int index, lg_error *err) {
    return lg_rank_create_on(rank, plan, index, index, err);
}

/* The arena's first LG_ALIGN-aligned byte. */
static unsigned char *lg_arena_start(const lg_rank *rank, lg_pool pool) {
    uintptr_t p = (uintptr_t)rank->arena[pool];
    return rank->arena[pool] + (LG_ALIGN - p % LG_ALIGN) % LG_ALIGN;
}

/* lg_rank_region as a typed view (data NULL when the plan has no such region). */
static lg_buf lg_rank_view(const lg_rank *rank, const char *name, lg_dtype dtype) {
    lg_buf b = {lg_rank_region(rank, name), dtype};
    return b;
}

void *lg_rank_region(const lg_rank *rank, const char *name) {
    const lg_region *x = lg_plan_find(&rank->plan->ranks[rank->index], name);
    return x ? lg_arena_start(rank, x->pool) + x->offset : NULL;
}

/* Waits for the rank's queued work (a GPU's streams); the host may then read and write its
   memory. Nothing to wait for on the CPU. */
static void lg_rank_sync(const lg_rank *rank) {
#ifdef LG_CUDA
    if (rank->backend == LG_BACKEND_CUDA) lg_cuda_rank_sync(rank);
#else
    (void)rank;
#endif
}

/* Why the rank stopped computing, or NULL while it computes (always on the CPU): a GPU op
   that failed where it could not return an error (cuBLASLt out of memory) records its line
   there, and the rank's later matmuls do nothing; the trainer discards the step's results and
   returns the line (lg_trainer_check_ranks). */
static const char *lg_rank_failure(const lg_rank *rank) {
#ifdef LG_CUDA
    if (rank->backend == LG_BACKEND_CUDA) return lg_cuda_rank_failure(rank);
#endif
    (void)rank;
    return NULL;
}

lg_visit lg_visit_start(const lg_exec *ex, lg_buf x, size_t count, size_t unit, int mode) {
    lg_visit v;
    memset(&v, 0, sizeof v);
    v.ex = ex;
    v.x = x;
    v.count = count;
    v.unit = unit ? unit : 1;
    v.mode = mode;
    v.piece.dtype = x.dtype;
    return v;
}

int lg_visit_next(lg_visit *v) {
    int on_gpu = v->ex && v->ex->backend == LG_BACKEND_CUDA;
#ifdef LG_CUDA
    if (on_gpu && v->n && (v->mode & LG_VISIT_WRITE)) lg_cuda_visit_copy(v, 1);
#endif
    v->first += v->n;
    v->n = 0;
    if (v->first >= v->count) return 0;
    v->n = v->count - v->first;
    v->piece = lg_at(v->x, v->first);
#ifdef LG_CUDA
    if (on_gpu) {
        lg_cuda_visit_piece(v);
        if (v->mode & LG_VISIT_READ) lg_cuda_visit_copy(v, 0);
    }
#else
    (void)on_gpu;
#endif
    return 1;
}

/* 7. kernels (CPU) ---------------------------------------------------------------------------- */

/* Every op takes the rank's lg_exec first. On a GPU rank it hands its arguments to the CUDA op
   of the same name (litgpt_cuda.cuh) and returns; otherwise the loops below run. */
#ifdef LG_CUDA
#define LG_ON_GPU(ex, call)                                                                    \
    do {                                                                                       \
        if ((ex) && (ex)->backend == LG_BACKEND_CUDA) { call; return; }                        \
    } while (0)
#define LG_ON_GPU_RETURN(ex, call)                                                             \
    do {                                                                                       \
        if ((ex) && (ex)->backend == LG_BACKEND_CUDA) return call;                             \
    } while (0)
#else
#define LG_ON_GPU(ex, call) (void)(ex)
#define LG_ON_GPU_RETURN(ex, call) (void)(ex)
#endif


/* LG_GEMM_BEGIN: the blocked matrix multiply */
/* ------------------------------------------------------------------------
 * lg_gemm: C(M, N) = beta * C + op(A)(M, K) . op(B)(K, N), all row-major.
 *
 *   op(A) = A (M, K), leading dim lda          when trans_a == 0
 *         = A^T, A stored (K, M), leading dim lda  when trans_a != 0
 *   op(B) = B (K, N) / B^T with B stored (N, K), likewise with trans_b.
 *   beta == 0 overwrites C (NaN garbage in C is ignored); any other beta
 *   gives beta * C + op(A) op(B).
 *
 * Blocking scheme (GotoBLAS / BLIS style):
 *   C is cut into a tm x tn grid of thread tiles, one per OpenMP thread (no
 *   sharing, no barriers).  Inside its tile each thread runs
 *     jc: columns in chunks of NC
 *       pc: K in chunks of KC            pack op(B)[pc:+kc, jc:+nc] -> Bp
 *         ic: rows in chunks of MC       pack op(A)[ic:+mc, pc:+kc] -> Ap
 *           jr: NR columns / ir: MR rows -> micro-kernel, one MR x NR C tile
 *           (AMX: ir outside jr)
 *   A kc x NR micro-panel of Bp stays in L1 while the ir loop streams the
 *   MR x kc micro-panels of Ap (whole Ap block sized for L2).
 *
 * Kernel paths (lg_gemm_path), chosen at run time from cpuid, so one binary
 * runs on any x86-64 and uses what the processor has:
 *   portable     plain C; gcc -O3 keeps its MR x NR accumulator in vector
 *                registers of whatever width the build targets
 *   avx2         6 x 16 tile of ymm FMAs
 *   avx512       14 x 32 tile of zmm FMAs (28 accumulators, B from 2 vectors,
 *                A broadcast from memory)
 *   avx512-bf16  avx512, and when A and B are both stored bf16: Ap and Bp
 *                hold bf16 pairs along K and vdpbf16ps multiplies them into
 *                fp32 accumulators (products of bf16 are exact in fp32, so
 *                only the order of the sums differs from the other paths)
 *   amx          avx512, and when A and B are both stored bf16: a 32 x 32
 *                tile of C in four AMX accumulator tiles; Ap holds rows of
 *                K in tile order (blocks of 32 rows x 32 K, read front to
 *                back), Bp bf16 pairs along K; K padded
 *                to 32 with zeros
 * Each path has its tile geometry (lg_gemm_kind); packing follows it.
 *
 * Problems with M*N*K below LG_GEMM_SMALL use a simple loop (no packing, no
 * threads); OpenMP is used only above LG_GEMM_PARALLEL and when not already
 * inside a parallel region.
 * ------------------------------------------------------------------------ */

/* "#pragma omp simd" only where OpenMP is on (no unknown-pragma warnings) */
#if defined(_OPENMP)
#define LG_GEMM_SIMD _Pragma("omp simd")
#else
#define LG_GEMM_SIMD
#endif

/* full unrolling of the MR loop keeps the accumulator in registers (gcc: at
   -O2 too; clang: also stops it vectorising across MR with gathers) */
#if defined(__clang__)
#define LG_GEMM_UNROLL _Pragma("clang loop unroll(full) vectorize(disable)")
#elif defined(__GNUC__) && !defined(__CUDACC__)
#define LG_GEMM_UNROLL _Pragma("GCC unroll 16")
#else
#define LG_GEMM_UNROLL
#endif

/* vector width the build targets, in bytes, to size the portable tile */
#if defined(__AVX512F__)
#define LG_GEMM_VBYTES 64
#elif defined(__AVX__)
#define LG_GEMM_VBYTES 32
#else
#define LG_GEMM_VBYTES 16
#endif

/* portable register tile MR x NR: NR = 2 vectors, MR*2 accumulators + 3
   temporaries must fit the register file (32 vector registers with AVX-512,
   else 16) */
#define LG_GEMM_NR ((int)(2 * LG_GEMM_VBYTES / sizeof(lg_real)))
#if defined(__AVX512F__)
#define LG_GEMM_MR 14
#else
#define LG_GEMM_MR 6
#endif

#define LG_GEMM_SMALL (16.0 * 16 * 16)       /* M*N*K below: simple loop */
#define LG_GEMM_PARALLEL (128.0 * 128 * 128) /* M*N*K below: one thread */

/* --- kernel paths: what the processor runs --------------------------------------------------- */

/* x86-64 kernels need gcc or clang (target attributes, intrinsics) and float lg_real; nvcc's
   host pass and the double test build keep the portable path. */
#if LG_X86_KERNELS
#define LG_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define LG_TARGET_AVX512 __attribute__((target("avx512f,fma")))
#define LG_TARGET_AVX512_BF16 __attribute__((target("avx512f,avx512bf16,fma")))
#define LG_TARGET_AMX __attribute__((target("avx512f,avx512bf16,fma,amx-tile,amx-bf16")))

#define LG_CPUID7_EDX_AMX_BF16 (1u << 22)
#define LG_CPUID7_EDX_AMX_TILE (1u << 24)
#define LG_SYS_ARCH_PRCTL 158       /* x86-64 Linux system call number */
#define LG_ARCH_REQ_XCOMP_PERM 0x1023
#define LG_XFEATURE_XTILEDATA 18

/* AMX-BF16 tiles, and Linux's permission to use them (asked for once a process; granted to
   all its threads) */
static int lg_cpu_amx_ready(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    if (!(d & LG_CPUID7_EDX_AMX_BF16) || !(d & LG_CPUID7_EDX_AMX_TILE)) return 0;
#if defined(__linux__)
    long rc;
    __asm__ volatile("syscall"
                     : "=a"(rc)
                     : "a"((long)LG_SYS_ARCH_PRCTL), "D"((long)LG_ARCH_REQ_XCOMP_PERM),
                       "S"((long)LG_XFEATURE_XTILEDATA)
                     : "rcx", "r11", "memory");
    return rc == 0;
#else
    return 0;
#endif
}

/* what cpuid says this processor (and its operating system, through xgetbv) runs */
static lg_gemm_path lg_cpu_best_gemm_path(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16") &&
        lg_cpu_amx_ready())
        return LG_GEMM_AMX;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16"))
        return LG_GEMM_AVX512_BF16;
    if (__builtin_cpu_supports("avx512f")) return LG_GEMM_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return LG_GEMM_AVX2;
    return LG_GEMM_PORTABLE;
}
#else
static lg_gemm_path lg_cpu_best_gemm_path(void) { return LG_GEMM_PORTABLE; }
#endif

static const char *const lg_gemm_path_names[] = {"portable", "avx2", "avx512", "avx512-bf16",
                                                  "amx"};

const char *lg_gemm_path_name(lg_gemm_path path) {
    return (int)path >= 0 && path <= LG_GEMM_AMX ? lg_gemm_path_names[path] : "?";
}

lg_gemm_path lg_cpu_gemm_path(void) {
    lg_gemm_path best = lg_cpu_best_gemm_path();
    const char *cap = getenv("LG_GEMM");
    if (!cap) return best;
    for (int p = LG_GEMM_PORTABLE; p < (int)best; p++)
        if (strcmp(cap, lg_gemm_path_names[p]) == 0) return (lg_gemm_path)p;
    return best;
}

/* --- small problems: straightforward loops, no packing ------------------ */
static void lg_gemm_simple(int trans_a, int trans_b, int M, int N, int K, lg_buf A, int lda,
                           lg_buf B, int ldb, lg_real beta, lg_buf C, int ldc) {
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            lg_real s = 0;
            for (int p = 0; p < K; p++)
                s += lg_get(A, trans_a ? (size_t)p * lda + i : (size_t)i * lda + p) *
                     lg_get(B, trans_b ? (size_t)j * ldb + p : (size_t)p * ldb + j);
            size_t at = (size_t)i * ldc + j;
            lg_set(C, at, beta == 0 ? s : beta * lg_get(C, at) + s);
        }
}

/* Packing bf16 with AVX-512 (the avx512-bf16 and AMX paths): whole blocks of 16 x 32 bf16 at a
   time, the rest element by element. A pair of bf16 along K is one 32-bit word; the
   transposing packs move words through lg_transpose_16x16. */
#define LG_PACK_ROWS 16 /* rows (or columns) of a block */
#define LG_PACK_K 32    /* K of a block: 16 words */
#if LG_X86_KERNELS
#define LG_ALL16 ((__mmask16)0xFFFF)
#define LG_ALL8 ((__mmask8)0xFF)

/* r[0..16) (16 words each) becomes its transpose: word j of r[i] moves to word i of r[j]
   (unpacks of words, then of word pairs, then two rounds of 128-bit lane shuffles) */
LG_TARGET_AVX512 static inline void lg_transpose_16x16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int k = 0; k < 8; k++) {
        a[2 * k] = _mm512_maskz_unpacklo_epi32(LG_ALL16, r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm512_maskz_unpackhi_epi32(LG_ALL16, r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 4; k++) { /* b[4k + m], lane L: word 4L + m of rows 4k .. 4k+3 */
        b[4 * k] = _mm512_maskz_unpacklo_epi64(LG_ALL8, a[4 * k], a[4 * k + 2]);
        b[4 * k + 1] = _mm512_maskz_unpackhi_epi64(LG_ALL8, a[4 * k], a[4 * k + 2]);
        b[4 * k + 2] = _mm512_maskz_unpacklo_epi64(LG_ALL8, a[4 * k + 1], a[4 * k + 3]);
        b[4 * k + 3] = _mm512_maskz_unpackhi_epi64(LG_ALL8, a[4 * k + 1], a[4 * k + 3]);
    }
    for (int m = 0; m < 4; m++) { /* column 4L + m: lane L of b[m], b[4+m], b[8+m], b[12+m] */
        const __m512i even0 = _mm512_maskz_shuffle_i32x4(LG_ALL16, b[m], b[4 + m], 0x88);
        const __m512i odd0 = _mm512_maskz_shuffle_i32x4(LG_ALL16, b[m], b[4 + m], 0xDD);
        const __m512i even1 = _mm512_maskz_shuffle_i32x4(LG_ALL16, b[8 + m], b[12 + m], 0x88);
        const __m512i odd1 = _mm512_maskz_shuffle_i32x4(LG_ALL16, b[8 + m], b[12 + m], 0xDD);
        r[m] = _mm512_maskz_shuffle_i32x4(LG_ALL16, even0, even1, 0x88);
        r[8 + m] = _mm512_maskz_shuffle_i32x4(LG_ALL16, even0, even1, 0xDD);
        r[4 + m] = _mm512_maskz_shuffle_i32x4(LG_ALL16, odd0, odd1, 0x88);
        r[12 + m] = _mm512_maskz_shuffle_i32x4(LG_ALL16, odd0, odd1, 0xDD);
    }
}

/* 16 words: (lo[i], hi[i]) as a pair, lo in the low half */
LG_TARGET_AVX512 static inline __m512i lg_pair_words(const uint16_t *lo, const uint16_t *hi) {
    const __m512i l = _mm512_maskz_cvtepu16_epi32(LG_ALL16, _mm256_loadu_si256((const __m256i *)lo));
    const __m512i h = _mm512_maskz_cvtepu16_epi32(LG_ALL16, _mm256_loadu_si256((const __m256i *)hi));
    return _mm512_or_si512(l, _mm512_maskz_slli_epi32(LG_ALL16, h, 16));
}

/* AMX's A rows from A stored (K, M): dst[i*ld + p] = src[p*lda + i], i < 16, p < 32 */
LG_TARGET_AVX512 static void lg_pack_rows_t_block(const uint16_t *src, int lda, uint16_t *dst,
                                                  int ld) {
    __m512i r[LG_PACK_ROWS];
    for (int q = 0; q < LG_PACK_ROWS; q++)
        r[q] = lg_pair_words(src + (size_t)2 * q * lda, src + (size_t)(2 * q + 1) * lda);
    lg_transpose_16x16(r);
    for (int i = 0; i < LG_PACK_ROWS; i++) _mm512_storeu_si512(dst + (size_t)i * ld, r[i]);
}

/* B's pairs from B stored (N, K): word q*nr_full + j of dst = the pair (src[j*ldb + 2q],
   src[j*ldb + 2q + 1]), j < 16, q < 16 */
LG_TARGET_AVX512 static void lg_pack_pairs_t_block(const uint16_t *src, int ldb, uint32_t *dst,
                                                   int nr_full) {
    __m512i r[LG_PACK_ROWS];
    for (int j = 0; j < LG_PACK_ROWS; j++) r[j] = _mm512_loadu_si512(src + (size_t)j * ldb);
    lg_transpose_16x16(r);
    for (int q = 0; q < LG_PACK_ROWS; q++) _mm512_storeu_si512(dst + (size_t)q * nr_full, r[q]);
}

/* dst (n) = src (n), bf16 to fp32 */
LG_TARGET_AVX512 static void lg_widen_bf16(const uint16_t *src, float *dst, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512i u = _mm512_maskz_cvtepu16_epi32(LG_ALL16, _mm256_loadu_si256((const __m256i *)(src + i)));
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_maskz_slli_epi32(LG_ALL16, u, 16)));
    }
    for (; i < n; i++) dst[i] = lg_bf16_to_f32(src[i]);
}

/* B's pairs from B stored (K, N): words j < 16 of dst = (src[j], src[ldb + j]) */
LG_TARGET_AVX512 static void lg_pack_pairs_block(const uint16_t *src, int ldb, uint32_t *dst) {
    _mm512_storeu_si512(dst, lg_pair_words(src, src + ldb));
}
#endif

/* --- packing: the only place the matmul reads A and B, converting half types to lg_real -- */
/* Ap <- op(A)[i0 : i0+mc, p0 : p0+kc] as ceil(mc/mr_full) micro-panels; panel
   r holds rows i0 + r*mr_full + (0..mr_full-1), element (i, p) at
   ap[p*mr_full + i]; rows past mc are zero. */
static void lg_gemm_pack_a(int trans_a, lg_buf A, int lda, int i0, int p0, int mc, int kc,
                           int mr_full, lg_real *ap) {
    const lg_real *a32 = A.dtype == LG_DTYPE_F32 ? (const lg_real *)A.data : NULL;
    for (int r = 0; r < mc; r += mr_full, ap += (size_t)kc * mr_full) {
        const int mr = (mc - r < mr_full) ? mc - r : mr_full;
        for (int p = 0; p < kc; p++) {
            lg_real *dst = ap + (size_t)p * mr_full;
            int i = 0;
            if (trans_a) { /* A stored (K, M): rows of A are contiguous in i */
                size_t at = (size_t)(p0 + p) * lda + i0 + r;
                if (a32) for (; i < mr; i++) dst[i] = a32[at + i];
                else for (; i < mr; i++) dst[i] = lg_get(A, at + i);
            } else {       /* A stored (M, K) */
                size_t at = (size_t)(i0 + r) * lda + p0 + p;
                if (a32) for (; i < mr; i++) dst[i] = a32[at + (size_t)i * lda];
                else for (; i < mr; i++) dst[i] = lg_get(A, at + (size_t)i * lda);
            }
            for (; i < mr_full; i++) dst[i] = 0;
        }
    }
}

/* Bp <- op(B)[p0 : p0+kc, j0 : j0+nc] as ceil(nc/nr_full) micro-panels; panel
   r holds columns j0 + r*nr_full + (0..nr_full-1), element (p, j) at
   bp[p*nr_full + j]; columns past nc are zero. */
static void lg_gemm_pack_b(int trans_b, lg_buf B, int ldb, int p0, int j0, int kc, int nc,
                           int nr_full, int avx512, lg_real *bp) {
    const lg_real *b32 = B.dtype == LG_DTYPE_F32 ? (const lg_real *)B.data : NULL;
    (void)avx512; /* read only where the x86 kernels are built */
    for (int r = 0; r < nc; r += nr_full, bp += (size_t)kc * nr_full) {
        const int nr = (nc - r < nr_full) ? nc - r : nr_full;
        if (!trans_b) { /* B stored (K, N): rows contiguous in j */
            for (int p = 0; p < kc; p++) {
                size_t at = (size_t)(p0 + p) * ldb + j0 + r;
                lg_real *dst = bp + (size_t)p * nr_full;
                int j = 0;
                if (b32) for (; j < nr; j++) dst[j] = b32[at + j];
#if LG_X86_KERNELS
                else if (avx512 && B.dtype == LG_DTYPE_BF16) {
                    lg_widen_bf16((const uint16_t *)B.data + at, dst, nr);
                    j = nr;
                }
#endif
                else for (; j < nr; j++) dst[j] = lg_get(B, at + j);
                for (; j < nr_full; j++) dst[j] = 0;
            }
        } else {        /* B stored (N, K): read each row along p */
            int j = 0;
            for (; j < nr; j++) {
                size_t at = (size_t)(j0 + r + j) * ldb + p0;
                if (b32) for (int p = 0; p < kc; p++) bp[(size_t)p * nr_full + j] = b32[at + p];
                else for (int p = 0; p < kc; p++) bp[(size_t)p * nr_full + j] = lg_get(B, at + p);
            }
            for (; j < nr_full; j++)
                for (int p = 0; p < kc; p++) bp[(size_t)p * nr_full + j] = 0;
        }
    }
}

/* bf16 pairs along K (vdpbf16ps's and AMX's B operands), both operands stored bf16 and copied
   as they are: Ap <- op(A)[i0 : i0+mc, p0 : p0+kc], element (i, p) of a panel at
   ap[(p/2)*2*mr_full + 2*i + p%2]; Bp likewise, (p, j) at bp[(p/2)*2*nr_full + 2*j + p%2].
   Rows, columns and K past the ends, up to kp (kc rounded up to the kernel's K step), are
   zero. */
static void lg_gemm_pack_a_pairs(int trans_a, lg_buf A, int lda, int i0, int p0, int mc, int kc,
                                 int kp, int mr_full, uint16_t *ap) {
    const uint16_t *a = (const uint16_t *)A.data;
    for (int r = 0; r < mc; r += mr_full, ap += (size_t)kp * mr_full) {
        const int mr = (mc - r < mr_full) ? mc - r : mr_full;
        for (int p = 0; p < kp; p++) {
            uint16_t *dst = ap + (size_t)(p / 2) * 2 * mr_full + p % 2;
            int i = 0;
            if (p < kc) {
                if (trans_a) {
                    const uint16_t *row = a + (size_t)(p0 + p) * lda + i0 + r;
                    for (; i < mr; i++) dst[2 * i] = row[i];
                } else {
                    const uint16_t *col = a + (size_t)(i0 + r) * lda + p0 + p;
                    for (; i < mr; i++) dst[2 * i] = col[(size_t)i * lda];
                }
            }
            for (; i < mr_full; i++) dst[2 * i] = 0;
        }
    }
}

static void lg_gemm_pack_b_pairs(int trans_b, lg_buf B, int ldb, int p0, int j0, int kc, int nc,
                                 int kp, int nr_full, uint16_t *bp) {
    const uint16_t *b = (const uint16_t *)B.data;
    for (int r = 0; r < nc; r += nr_full, bp += (size_t)kp * nr_full) {
        const int nr = (nc - r < nr_full) ? nc - r : nr_full;
        for (int jb = 0; jb < nr_full; jb += LG_PACK_ROWS)
            for (int pb = 0; pb < kp; pb += LG_PACK_K) { /* a block of 16 columns, 32 K */
#if LG_X86_KERNELS
                if (jb + LG_PACK_ROWS <= nr && pb + LG_PACK_K <= kc) {
                    const uint16_t *at = b + (trans_b ? (size_t)(j0 + r + jb) * ldb + p0 + pb
                                                      : (size_t)(p0 + pb) * ldb + j0 + r + jb);
                    uint32_t *words = (uint32_t *)bp + (size_t)(pb / 2) * nr_full + jb;
                    if (trans_b) lg_pack_pairs_t_block(at, ldb, words, nr_full);
                    else
                        for (int q = 0; q < LG_PACK_K / 2; q++)
                            lg_pack_pairs_block(at + (size_t)2 * q * ldb, ldb, words + (size_t)q * nr_full);
                    continue;
                }
#endif
                for (int p = pb; p < pb + LG_PACK_K && p < kp; p++) {
                    uint16_t *dst = bp + (size_t)(p / 2) * 2 * nr_full + p % 2;
                    for (int j = jb; j < jb + LG_PACK_ROWS; j++)
                        dst[2 * j] = j < nr && p < kc ? (trans_b ? b[(size_t)(j0 + r + j) * ldb + p0 + p]
                                                                 : b[(size_t)(p0 + p) * ldb + j0 + r + j])
                                                      : 0;
                }
            }
    }
}

/* AMX's A operand, both operands stored bf16: Ap <- op(A)[i0 : i0+mc, p0 : p0+kc] as panels of
   mr_full rows in tile order: K in blocks of 32, each block mr_full rows of 32 (a tile row),
   element (i, p) of a panel at ap[((p/32)*mr_full + i)*32 + p%32], so the kernel's tile loads
   read the panel front to back; rows and K past the ends (up to kp) are zero. */
static size_t lg_gemm_tile_order(int mr_full, int i, int p) {
    return ((size_t)(p / LG_PACK_K) * mr_full + i) * LG_PACK_K + p % LG_PACK_K;
}

static void lg_gemm_pack_a_rows(int trans_a, lg_buf A, int lda, int i0, int p0, int mc, int kc,
                                int kp, int mr_full, uint16_t *ap) {
    const uint16_t *a = (const uint16_t *)A.data;
    for (int r = 0; r < mc; r += mr_full, ap += (size_t)kp * mr_full) {
        const int mr = (mc - r < mr_full) ? mc - r : mr_full;
        for (int ib = 0; ib < mr_full; ib += LG_PACK_ROWS) /* blocks of 16 rows x 32 K */
            for (int pb = 0; pb < kp; pb += LG_PACK_K) {
                uint16_t *dst = ap + lg_gemm_tile_order(mr_full, ib, pb); /* rows 32 apart */
                const int whole = ib + LG_PACK_ROWS <= mr && pb + LG_PACK_K <= kc;
                if (whole && !trans_a) {
                    for (int i = 0; i < LG_PACK_ROWS; i++)
                        memcpy(dst + (size_t)i * LG_PACK_K, a + (size_t)(i0 + r + ib + i) * lda + p0 + pb,
                               LG_PACK_K * sizeof(uint16_t));
                    continue;
                }
#if LG_X86_KERNELS
                if (whole) { /* A stored (K, M) */
                    lg_pack_rows_t_block(a + (size_t)(p0 + pb) * lda + i0 + r + ib, lda, dst, LG_PACK_K);
                    continue;
                }
#endif
                for (int i = 0; i < LG_PACK_ROWS; i++)
                    for (int p = 0; p < LG_PACK_K && pb + p < kp; p++) {
                        const size_t at = trans_a ? (size_t)(p0 + pb + p) * lda + i0 + r + ib + i
                                                  : (size_t)(i0 + r + ib + i) * lda + p0 + pb + p;
                        dst[(size_t)i * LG_PACK_K + p] = ib + i < mr && pb + p < kc ? a[at] : 0;
                    }
            }
    }
}

/* --- writing a tile ------------------------------------------------------ */
/* C[0:mr, 0:nr] = beta*C + acc, acc with rows ld apart; C written in its own type (rounded to
   nearest for half types). */
static void lg_gemm_store(const lg_real *acc, int ld, lg_buf C, size_t c0, int ldc, int mr,
                          int nr, lg_real beta) {
    if (C.dtype == LG_DTYPE_BF16 || C.dtype == LG_DTYPE_F16) {
        int bf16 = C.dtype == LG_DTYPE_BF16;
        for (int i = 0; i < mr; i++) {
            uint16_t *c = (uint16_t *)C.data + c0 + (size_t)i * ldc;
            for (int j = 0; j < nr; j++) {
                float v = (float)acc[(size_t)i * ld + j];
                if (beta != 0) v += (float)beta * (bf16 ? lg_bf16_to_f32(c[j]) : lg_f16_to_f32(c[j]));
                c[j] = bf16 ? lg_f32_to_bf16(v) : lg_f32_to_f16(v);
            }
        }
        return;
    }
    for (int i = 0; i < mr; i++) {
        lg_real *c = (lg_real *)C.data + c0 + (size_t)i * ldc;
        const lg_real *a = acc + (size_t)i * ld;
        for (int j = 0; j < nr; j++) c[j] = beta == 0 ? a[j] : beta * c[j] + a[j];
    }
}

/* --- micro-kernels ------------------------------------------------------- */
/* C[0:mr, 0:nr] = beta*C + a . b, where a is a kc x MR micro-panel of Ap and b a kc x NR
   micro-panel of Bp (pairs: kc rounded up to even). */
typedef void (*lg_gemm_micro)(int kc, const void *a, const void *b, lg_buf C, size_t c0,
                              int ldc, int mr, int nr, lg_real beta);

/* portable: acc (MR x NR) lives in vector registers of the build's width */
static void lg_gemm_kernel(int kc, const void *a_panel, const void *b_panel, lg_buf C, size_t c0,
                           int ldc, int mr, int nr, lg_real beta) {
    const lg_real *a = (const lg_real *)a_panel, *b = (const lg_real *)b_panel;
    lg_real acc[LG_GEMM_MR][LG_GEMM_NR];
    int i, j, p;
LG_GEMM_UNROLL
    for (i = 0; i < LG_GEMM_MR; i++)
LG_GEMM_SIMD
        for (j = 0; j < LG_GEMM_NR; j++) acc[i][j] = 0;
    for (p = 0; p < kc; p++, a += LG_GEMM_MR, b += LG_GEMM_NR) {
LG_GEMM_UNROLL
        for (i = 0; i < LG_GEMM_MR; i++) {
            const lg_real ai = a[i];
LG_GEMM_SIMD
            for (j = 0; j < LG_GEMM_NR; j++) acc[i][j] += ai * b[j];
        }
    }
    if (C.dtype == LG_DTYPE_F32 && mr == LG_GEMM_MR && nr == LG_GEMM_NR) { /* fixed bounds */
LG_GEMM_UNROLL
        for (i = 0; i < LG_GEMM_MR; i++) {
            lg_real *c = (lg_real *)C.data + c0 + (size_t)i * ldc;
            if (beta == 0) {
LG_GEMM_SIMD
                for (j = 0; j < LG_GEMM_NR; j++) c[j] = acc[i][j];
            } else {
LG_GEMM_SIMD
                for (j = 0; j < LG_GEMM_NR; j++) c[j] = beta * c[j] + acc[i][j];
            }
        }
    } else {
        lg_gemm_store(&acc[0][0], LG_GEMM_NR, C, c0, ldc, mr, nr, beta);
    }
}

#if LG_X86_KERNELS
#define LG_AVX2_MR 6
#define LG_AVX2_NR 16
#define LG_AVX512_MR 14
#define LG_AVX512_NR 32

/* avx2: 6 x 16, two ymm accumulators a row */
LG_TARGET_AVX2 static void lg_gemm_kernel_avx2(int kc, const void *a_panel, const void *b_panel,
                                               lg_buf C, size_t c0, int ldc, int mr, int nr,
                                               lg_real beta) {
    const float *a = (const float *)a_panel, *b = (const float *)b_panel;
    __m256 acc[LG_AVX2_MR][2];
LG_GEMM_UNROLL
    for (int i = 0; i < LG_AVX2_MR; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int p = 0; p < kc; p++, a += LG_AVX2_MR, b += LG_AVX2_NR) {
        const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
LG_GEMM_UNROLL
        for (int i = 0; i < LG_AVX2_MR; i++) {
            const __m256 ai = _mm256_broadcast_ss(a + i);
            acc[i][0] = _mm256_fmadd_ps(ai, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(ai, b1, acc[i][1]);
        }
    }
    if (C.dtype == LG_DTYPE_F32 && mr == LG_AVX2_MR && nr == LG_AVX2_NR) {
        const __m256 vb = _mm256_set1_ps(beta);
LG_GEMM_UNROLL
        for (int i = 0; i < LG_AVX2_MR; i++) {
            float *c = (float *)C.data + c0 + (size_t)i * ldc;
            __m256 r0 = acc[i][0], r1 = acc[i][1];
            if (beta != 0) {
                r0 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(c), r0);
                r1 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(c + 8), r1);
            }
            _mm256_storeu_ps(c, r0);
            _mm256_storeu_ps(c + 8, r1);
        }
        return;
    }
    float tile[LG_AVX2_MR][LG_AVX2_NR];
    for (int i = 0; i < LG_AVX2_MR; i++) {
        _mm256_storeu_ps(tile[i], acc[i][0]);
        _mm256_storeu_ps(tile[i] + 8, acc[i][1]);
    }
    lg_gemm_store(&tile[0][0], LG_AVX2_NR, C, c0, ldc, mr, nr, beta);
}

/* the AVX-512 and AMX kernels' results to C: tile (rows x 32 floats, row-major, rows = MR of
   the kernel), full tiles of fp32 or bf16 C in vectors (bf16 rounded to nearest even, as
   lg_f32_to_bf16), the rest through lg_gemm_store */
/* (the maskz forms of the intrinsics: the plain ones start from an "undefined" vector that g++
   -O2 warns about) */
LG_TARGET_AVX512 static __m256i lg_gemm_bf16_avx512(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i top = _mm512_maskz_srli_epi32(LG_ALL16, u, 16);
    const __m512i lsb = _mm512_and_si512(top, _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    __m512i r = _mm512_maskz_srli_epi32(LG_ALL16, up, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q); /* quiet NaN: top bits | 0x40 */
    r = _mm512_mask_or_epi32(r, nan, top, _mm512_set1_epi32(0x40));
    return _mm512_maskz_cvtepi32_epi16(LG_ALL16, r);
}

LG_TARGET_AVX512 static void lg_gemm_write_avx512(const float *tile, int rows, lg_buf C,
                                                  size_t c0, int ldc, int mr, int nr,
                                                  lg_real beta) {
    if (C.dtype == LG_DTYPE_F32 && mr == rows && nr == LG_AVX512_NR) {
        const __m512 vb = _mm512_set1_ps(beta);
        for (int i = 0; i < rows; i++) {
            float *c = (float *)C.data + c0 + (size_t)i * ldc;
            __m512 r0 = _mm512_loadu_ps(tile + i * LG_AVX512_NR);
            __m512 r1 = _mm512_loadu_ps(tile + i * LG_AVX512_NR + 16);
            if (beta != 0) {
                r0 = _mm512_fmadd_ps(vb, _mm512_loadu_ps(c), r0);
                r1 = _mm512_fmadd_ps(vb, _mm512_loadu_ps(c + 16), r1);
            }
            _mm512_storeu_ps(c, r0);
            _mm512_storeu_ps(c + 16, r1);
        }
    } else if (C.dtype == LG_DTYPE_BF16 && mr == rows && nr == LG_AVX512_NR) {
        const __m512 vb = _mm512_set1_ps(beta);
        for (int i = 0; i < rows; i++)
            for (int half = 0; half < LG_AVX512_NR; half += 16) {
                uint16_t *c = (uint16_t *)C.data + c0 + (size_t)i * ldc + half;
                __m512 r = _mm512_loadu_ps(tile + i * LG_AVX512_NR + half);
                if (beta != 0) { /* bf16 to fp32: the bits in the top half */
                    __m512i old = _mm512_maskz_cvtepu16_epi32(LG_ALL16, _mm256_loadu_si256((const __m256i *)c));
                    old = _mm512_maskz_slli_epi32(LG_ALL16, old, 16);
                    r = _mm512_fmadd_ps(vb, _mm512_castsi512_ps(old), r);
                }
                _mm256_storeu_si256((__m256i *)c, lg_gemm_bf16_avx512(r));
            }
    } else {
        lg_gemm_store(tile, LG_AVX512_NR, C, c0, ldc, mr, nr, beta);
    }
}

/* the 14 x 32 accumulator (two zmm a row) to C */
LG_TARGET_AVX512 static void lg_gemm_write_acc(__m512 acc[LG_AVX512_MR][2], lg_buf C, size_t c0,
                                               int ldc, int mr, int nr, lg_real beta) {
    float tile[LG_AVX512_MR * LG_AVX512_NR];
    for (int i = 0; i < LG_AVX512_MR; i++) {
        _mm512_storeu_ps(tile + i * LG_AVX512_NR, acc[i][0]);
        _mm512_storeu_ps(tile + i * LG_AVX512_NR + 16, acc[i][1]);
    }
    lg_gemm_write_avx512(tile, LG_AVX512_MR, C, c0, ldc, mr, nr, beta);
}

/* avx512: 14 x 32 fp32 FMAs */
LG_TARGET_AVX512 static void lg_gemm_kernel_avx512(int kc, const void *a_panel,
                                                   const void *b_panel, lg_buf C, size_t c0,
                                                   int ldc, int mr, int nr, lg_real beta) {
    const float *a = (const float *)a_panel, *b = (const float *)b_panel;
    __m512 acc[LG_AVX512_MR][2];
LG_GEMM_UNROLL
    for (int i = 0; i < LG_AVX512_MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int p = 0; p < kc; p++, a += LG_AVX512_MR, b += LG_AVX512_NR) {
        const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
LG_GEMM_UNROLL
        for (int i = 0; i < LG_AVX512_MR; i++) {
            const __m512 ai = _mm512_set1_ps(a[i]);
            acc[i][0] = _mm512_fmadd_ps(ai, b0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(ai, b1, acc[i][1]);
        }
    }
    lg_gemm_write_acc(acc, C, c0, ldc, mr, nr, beta);
}

/* avx512-bf16: 14 x 32, each vdpbf16ps adds two K steps (a pair of bf16 products) */
LG_TARGET_AVX512_BF16 static void lg_gemm_kernel_bf16(int kc, const void *a_panel,
                                                      const void *b_panel, lg_buf C, size_t c0,
                                                      int ldc, int mr, int nr, lg_real beta) {
    const uint32_t *a = (const uint32_t *)a_panel; /* a pair of bf16 a row */
    const __m512i *b = (const __m512i *)b_panel;   /* 16 pairs a vector */
    __m512 acc[LG_AVX512_MR][2];
LG_GEMM_UNROLL
    for (int i = 0; i < LG_AVX512_MR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int p = 0; p < kc; p += 2, a += LG_AVX512_MR, b += 2) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + 1);
LG_GEMM_UNROLL
        for (int i = 0; i < LG_AVX512_MR; i++) {
            const __m512bh ai = (__m512bh)_mm512_set1_epi32((int)a[i]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
        }
    }
    lg_gemm_write_acc(acc, C, c0, ldc, mr, nr, beta);
}

/* amx: 32 x 32 of C in tiles 0-3 (rows 0-15 and 16-31, columns 0-15 and 16-31), A's rows in
   tiles 4-5, B's pairs in 6-7; every tile 16 rows of 64 bytes */
#define LG_AMX_MR 32
#define LG_AMX_NR 32
#define LG_AMX_K 32          /* K values of one A tile row */
#define LG_AMX_TILE_ROWS 16
#define LG_AMX_TILE_BYTES 64 /* a tile row */

/* AMX's tile configuration (palette 1), as ldtilecfg reads it */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) lg_amx_config;

/* Every tile 16 rows of 64 bytes (0-3 C, 4-5 A, 6-7 B). A constant in memory: gcc's
   _tile_loadconfig tells the compiler that it reads only 8 bytes, so stores into a local copy
   could be dropped. */
#define LG_AMX_ROW LG_AMX_TILE_BYTES
#define LG_AMX_ROWS LG_AMX_TILE_ROWS
static const lg_amx_config lg_amx_tiles = {
    1, 0, {0},
    {LG_AMX_ROW, LG_AMX_ROW, LG_AMX_ROW, LG_AMX_ROW, LG_AMX_ROW, LG_AMX_ROW, LG_AMX_ROW, LG_AMX_ROW},
    {LG_AMX_ROWS, LG_AMX_ROWS, LG_AMX_ROWS, LG_AMX_ROWS, LG_AMX_ROWS, LG_AMX_ROWS, LG_AMX_ROWS,
     LG_AMX_ROWS}};

/* The calling thread's tiles configured for lg_gemm_kernel_amx; lg_amx_end releases them. */
LG_TARGET_AMX static void lg_amx_begin(void) { _tile_loadconfig(&lg_amx_tiles); }

LG_TARGET_AMX static void lg_amx_end(void) { _tile_release(); }

LG_TARGET_AMX static void lg_gemm_kernel_amx(int kc, const void *a_panel, const void *b_panel,
                                             lg_buf C, size_t c0, int ldc, int mr, int nr,
                                             lg_real beta) {
    const uint16_t *a = (const uint16_t *)a_panel; /* 32 rows of kc, in tile order */
    const uint16_t *b = (const uint16_t *)b_panel; /* kc/2 rows of 32 pairs */
    const size_t a_stride = LG_AMX_K * sizeof(uint16_t), b_stride = 2 * LG_AMX_NR * sizeof(uint16_t);
    float tile[LG_AMX_MR * LG_AMX_NR];
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int p = 0; p < kc; p += LG_AMX_K) {
        const uint16_t *bk = b + (size_t)p * LG_AMX_NR; /* pair row p/2 */
        const uint16_t *ak = a + (size_t)p * LG_AMX_MR; /* the panel's block p/32 */
        _tile_loadd(4, ak, a_stride);
        _tile_loadd(5, ak + LG_AMX_TILE_ROWS * LG_AMX_K, a_stride);
        _tile_loadd(6, bk, b_stride);
        _tile_loadd(7, bk + LG_AMX_NR, b_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    const size_t row = LG_AMX_NR * sizeof(float), half = LG_AMX_TILE_ROWS * LG_AMX_NR;
    _tile_stored(0, tile, row);
    _tile_stored(1, tile + 16, row);
    _tile_stored(2, tile + half, row);
    _tile_stored(3, tile + half + 16, row);
    lg_gemm_write_avx512(tile, LG_AMX_MR, C, c0, ldc, mr, nr, beta);
}
#endif

/* How a path packs its operands: fp32 panels, bf16 pairs along K (A and B), AMX's (A's rows,
   B's pairs). */
typedef enum { LG_PACK_F32, LG_PACK_PAIRS, LG_PACK_AMX } lg_gemm_packing;

/* A path's tile geometry, packing and micro-kernel; kstep: the packed K is a multiple. */
typedef struct {
    int mr, nr, kstep;
    lg_gemm_packing packing;
    lg_gemm_micro kernel;
    int avx512; /* the processor runs AVX-512: so may the packing */
} lg_gemm_kind;

/* The kernel of `path` for these operands: bf16 pairs only when both are stored bf16. */
static lg_gemm_kind lg_gemm_kind_of(lg_gemm_path path, lg_buf A, lg_buf B) {
    lg_gemm_kind k = {LG_GEMM_MR, LG_GEMM_NR, 1, LG_PACK_F32, lg_gemm_kernel, 0};
#if LG_X86_KERNELS
    k.avx512 = path >= LG_GEMM_AVX512;
    const int bf16 = A.dtype == LG_DTYPE_BF16 && B.dtype == LG_DTYPE_BF16;
    if (path == LG_GEMM_AMX && bf16) {
        k.mr = LG_AMX_MR; k.nr = LG_AMX_NR; k.kstep = LG_AMX_K; k.packing = LG_PACK_AMX;
        k.kernel = lg_gemm_kernel_amx;
    } else if (path == LG_GEMM_AVX512_BF16 && bf16) {
        k.mr = LG_AVX512_MR; k.nr = LG_AVX512_NR; k.kstep = 2; k.packing = LG_PACK_PAIRS;
        k.kernel = lg_gemm_kernel_bf16;
    } else if (path >= LG_GEMM_AVX512) {
        k.mr = LG_AVX512_MR; k.nr = LG_AVX512_NR; k.kernel = lg_gemm_kernel_avx512;
    } else if (path == LG_GEMM_AVX2) {
        k.mr = LG_AVX2_MR; k.nr = LG_AVX2_NR; k.kernel = lg_gemm_kernel_avx2;
    }
#else
    (void)path; (void)A; (void)B;
#endif
    return k;
}

/* --- one thread's tile: C[m0:m1, n0:n1], all of K ------------------------ */
/* ap: MC x KC scratch, bp: KC x NC scratch (see the pack functions; KC doubled for bf16) */
static void lg_gemm_tile(const lg_gemm_kind *k, int trans_a, int trans_b, int m0, int m1, int n0,
                         int n1, int K, lg_buf A, int lda, lg_buf B, int ldb, lg_real beta,
                         lg_buf C, int ldc, lg_real *ap, lg_real *bp) {
    const int MC = k->mr * LG_GEMM_MC_PANELS;
    const size_t esize = k->packing == LG_PACK_F32 ? sizeof(lg_real) : sizeof(uint16_t);
    /* bf16 panels: twice the K in the same bytes, so C is read and written half as often */
    const int KC = LG_GEMM_KC * (int)(sizeof(lg_real) / esize);
    int jc, pc, ic, jr, ir;
    for (jc = n0; jc < n1; jc += LG_GEMM_NC) {
        const int nc = (n1 - jc < LG_GEMM_NC) ? n1 - jc : LG_GEMM_NC;
        for (pc = 0; pc < K; pc += KC) {
            const int kc = (K - pc < KC) ? K - pc : KC;
            const int kp = (kc + k->kstep - 1) / k->kstep * k->kstep; /* packed K length */
            const lg_real bet = (pc == 0) ? beta : (lg_real)1;  /* later K blocks accumulate */
            if (k->packing == LG_PACK_F32) lg_gemm_pack_b(trans_b, B, ldb, pc, jc, kc, nc, k->nr, k->avx512, bp);
            else lg_gemm_pack_b_pairs(trans_b, B, ldb, pc, jc, kc, nc, kp, k->nr, (uint16_t *)bp);
            for (ic = m0; ic < m1; ic += MC) {
                const int mc = (m1 - ic < MC) ? m1 - ic : MC;
                if (k->packing == LG_PACK_F32)
                    lg_gemm_pack_a(trans_a, A, lda, ic, pc, mc, kc, k->mr, ap);
                else if (k->packing == LG_PACK_PAIRS)
                    lg_gemm_pack_a_pairs(trans_a, A, lda, ic, pc, mc, kc, kp, k->mr, (uint16_t *)ap);
                else
                    lg_gemm_pack_a_rows(trans_a, A, lda, ic, pc, mc, kc, kp, k->mr, (uint16_t *)ap);
                /* a B micro-panel stays in L1 while A's panels stream past it; AMX instead
                   keeps an A panel (a row of C's tiles) and streams B's */
                const int n_jr = (nc + k->nr - 1) / k->nr, n_ir = (mc + k->mr - 1) / k->mr;
                const int a_outer = k->packing == LG_PACK_AMX;
                for (int outer = 0; outer < (a_outer ? n_ir : n_jr); outer++)
                    for (int inner = 0; inner < (a_outer ? n_jr : n_ir); inner++) {
                        jr = (a_outer ? inner : outer) * k->nr;
                        ir = (a_outer ? outer : inner) * k->mr;
                        const int nr = (nc - jr < k->nr) ? nc - jr : k->nr;
                        const int mr = (mc - ir < k->mr) ? mc - ir : k->mr;
                        k->kernel(kp, (const char *)ap + (size_t)ir * kp * esize,
                                  (const char *)bp + (size_t)jr * kp * esize, C,
                                  (size_t)(ic + ir) * ldc + jc + jr, ldc, mr, nr, bet);
                    }
            }
        }
    }
}

/* --- thread grid: nt = tm * tn, picking the split that minimises the
   per-thread tile perimeter (= packing traffic) ------------------------------ */
static void lg_gemm_grid(int nt, int M, int N, int *tm, int *tn) {
    int t;
    double best = -1;
    *tm = 1; *tn = nt;
    for (t = 1; t <= nt; t++) {
        double cost;
        if (nt % t) continue;
        cost = (double)M / t + (double)N / (nt / t);
        if (best < 0 || cost < best) { best = cost; *tm = t; *tn = nt / t; }
    }
}

/* [lo, hi) of part `r` out of `parts`, splitting n in whole units of `unit` */
static void lg_gemm_split(int n, int unit, int parts, int r, int *lo, int *hi) {
    const int nb = (n + unit - 1) / unit;
    *lo = (int)((long long)nb * r / parts) * unit;
    *hi = (int)((long long)nb * (r + 1) / parts) * unit;
    if (*lo > n) *lo = n;
    if (*hi > n) *hi = n;
}

/* C(M, N) = beta C + op(A)(M, K) op(B)(K, N), row-major (see the top of this section), with
   the kernels of ws->path. The packing buffers come from ws, one slot a thread; called from
   inside a parallel region (attention's heads) it runs on the calling thread's slot. Without
   ws, or for small problems, the plain loop. */
static void lg_gemm(const lg_gemm_workspace *ws, int trans_a, int trans_b, int M, int N, int K,
                    lg_buf A, int lda, lg_buf B, int ldb, lg_real beta, lg_buf C, int ldc) {
    const double work = (double)M * N * K;
    int nthreads = 1, outer_slot = 0;
    if (M <= 0 || N <= 0) return;
#ifdef _OPENMP
    if (omp_in_parallel()) outer_slot = omp_get_thread_num();
    else if (work >= LG_GEMM_PARALLEL) nthreads = omp_get_max_threads();
#endif
    if (K <= 0 || work < LG_GEMM_SMALL || !ws || outer_slot >= ws->threads) {
        lg_gemm_simple(trans_a, trans_b, M, N, K, A, lda, B, ldb, beta, C, ldc);
        return;
    }
    const lg_gemm_kind kind = lg_gemm_kind_of(ws->path, A, B);
    if (nthreads > ws->threads) nthreads = ws->threads;
    LG_OMP(omp parallel num_threads(nthreads) if (nthreads > 1))
    {
        int tid = 0, nt = 1, tm, tn, m0, m1, n0, n1;
#ifdef _OPENMP
        if (nthreads > 1) {
            tid = omp_get_thread_num();
            nt = omp_get_num_threads();
        }
#endif
        lg_real *ap = ws->base + (size_t)(nthreads > 1 ? tid : outer_slot) * ws->per_thread;
        lg_real *bp = ap + lg_gemm_panel_a_count();
        lg_gemm_grid(nt, M, N, &tm, &tn);
        lg_gemm_split(M, kind.mr, tm, tid / tn, &m0, &m1);
        lg_gemm_split(N, kind.nr, tn, tid % tn, &n0, &n1);
#if LG_X86_KERNELS
        if (kind.packing == LG_PACK_AMX) lg_amx_begin();
#endif
        if (m0 < m1 && n0 < n1)
            lg_gemm_tile(&kind, trans_a, trans_b, m0, m1, n0, n1, K, A, lda, B, ldb, beta, C,
                         ldc, ap, bp);
#if LG_X86_KERNELS
        if (kind.packing == LG_PACK_AMX) lg_amx_end();
#endif
    }
}
/* LG_GEMM_END */

/* The position of token n of a (B, T) batch: t, or with packed rows (span (B, T), see
   lg_model.span_start) its place in its own sample, so positions restart at each sample. */
static int lg_span_position(const int *span, int n, int T) {
    return span ? n % T - span[n] : n % T;
}

/* --- AVX-512 loops of the memory-bound ops ------------------------------------------------
   On the avx512 path and above (ex->gemm.path), with every operand stored fp32 or bf16, the
   norms, SwiGLU, cross-entropy, attention's rows, rotary embedding, the add and AdamW (section
   8) run 16 lanes at a time: the same formulas in fp32, exp from lg_v_exp (at most 1 ulp from
   expf in a sweep of [-87, 88.5]), sums in lanes (another order than the portable loops),
   bf16 stored with the same rounding (lg_gemm_bf16_avx512). Each returns 1
   when it did the op, 0 to leave it to the portable loop (fp16 storage, other paths, no exec,
   a build without the x86 kernels). Elementwise ops take the last partial vector through a
   16-lane copy, so an element's result never depends on where a range starts. */
/* 1 when ex runs the avx512 path or above on the CPU. Checked before a call enters any of the
   LG_TARGET_AVX512 functions below: their code may use zmm registers before their first line
   (AddressSanitizer's prologue does), so a processor without AVX-512 must not enter one. */
static int lg_avx512_usable(const lg_exec *ex) {
    return ex && ex->backend == LG_BACKEND_CPU && ex->gemm.path >= LG_GEMM_AVX512;
}

#if LG_X86_KERNELS
#define LG_V 16 /* fp32 lanes of a zmm */

/* 1 when ex runs the avx512 path or above on the CPU and these buffers are fp32 or bf16 */
static int lg_v_ready(const lg_exec *ex, lg_buf a, lg_buf b, lg_buf c) {
    const lg_buf all[3] = {a, b, c};
    if (!lg_avx512_usable(ex)) return 0;
    for (int i = 0; i < 3; i++)
        if (all[i].data && all[i].dtype != LG_DTYPE_F32 && all[i].dtype != LG_DTYPE_BF16) return 0;
    return 1;
}

/* 16 elements of b (fp32 or bf16) from i as fp32 */
LG_TARGET_AVX512 static inline __m512 lg_v_load(lg_buf b, size_t i) {
    if (b.dtype == LG_DTYPE_BF16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)b.data + i));
        const __m512i u = _mm512_maskz_cvtepu16_epi32(LG_ALL16, h);
        return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(LG_ALL16, u, 16));
    }
    return _mm512_loadu_ps((const float *)b.data + i);
}

LG_TARGET_AVX512 static inline void lg_v_store(lg_buf b, size_t i, __m512 x) {
    if (b.dtype == LG_DTYPE_BF16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)b.data + i), lg_gemm_bf16_avx512(x));
    else
        _mm512_storeu_ps((float *)b.data + i, x);
}

/* the first n (<= 16) lanes from b at i, the rest `fill` */
LG_TARGET_AVX512 static inline __m512 lg_v_load_n(lg_buf b, size_t i, size_t n, float fill) {
    if (n >= LG_V) return lg_v_load(b, i);
    float t[LG_V];
    for (size_t j = 0; j < LG_V; j++) t[j] = j < n ? (float)lg_get(b, i + j) : fill;
    return _mm512_loadu_ps(t);
}

LG_TARGET_AVX512 static inline void lg_v_store_n(lg_buf b, size_t i, size_t n, __m512 x) {
    if (n >= LG_V) { lg_v_store(b, i, x); return; }
    float t[LG_V];
    _mm512_storeu_ps(t, x);
    for (size_t j = 0; j < n; j++) lg_set(b, i + j, t[j]);
}

/* e^x: 2^k e^r with k = round(x / ln 2), r = x - k ln 2 (ln 2 in two parts) in
   [-ln2/2, ln2/2], e^r by its Taylor series to r^7 (remainder below 1e-8 of the value);
   overflow to inf, NaN kept */
LG_TARGET_AVX512 static inline __m512 lg_v_exp(__m512 x) {
    x = _mm512_maskz_max_ps(LG_ALL16, _mm512_set1_ps(-104.0f), x); /* the second operand wins on NaN */
    x = _mm512_maskz_min_ps(LG_ALL16, _mm512_set1_ps(88.8f), x);
    const __m512 k = _mm512_maskz_roundscale_ps(LG_ALL16, _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187045e-06f), r);
    static const float taylor[] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6,
                                   0.5f, 1.0f, 1.0f};
    __m512 p = _mm512_set1_ps(taylor[0]);
    for (int i = 1; i < (int)(sizeof taylor / sizeof taylor[0]); i++)
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(taylor[i]));
    return _mm512_maskz_scalef_ps(LG_ALL16, p, k);
}

LG_TARGET_AVX512 static __m512 lg_v_sigmoid(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(one, _mm512_add_ps(one, lg_v_exp(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}

/* the sum and the largest of the 16 lanes (gcc's _mm512_reduce_* start from "undefined"
   vectors that g++ warns about) */
LG_TARGET_AVX512 static inline float lg_v_sum(__m512 x) {
    float lanes[LG_V], sum = 0;
    _mm512_storeu_ps(lanes, x);
    for (int i = 0; i < LG_V; i++) sum += lanes[i];
    return sum;
}

LG_TARGET_AVX512 static inline float lg_v_max(__m512 x) {
    float lanes[LG_V], max = -INFINITY;
    _mm512_storeu_ps(lanes, x);
    for (int i = 0; i < LG_V; i++) max = lanes[i] > max ? lanes[i] : max;
    return max;
}

LG_TARGET_AVX512 static inline double lg_v_sum_pd(__m512d x) {
    double lanes[LG_V / 2], sum = 0;
    _mm512_storeu_pd(lanes, x);
    for (int i = 0; i < LG_V / 2; i++) sum += lanes[i];
    return sum;
}

/* mask of the first n (<= 16) lanes */
static __mmask16 lg_v_mask(size_t n) { return (__mmask16)(n >= LG_V ? 0xFFFFu : (1u << n) - 1); }

/* out (n) = silu(gate) * up */
LG_TARGET_AVX512 static int lg_swiglu_forward_avx512(const lg_exec *ex, lg_buf out, lg_buf gate,
                                                     lg_buf up, size_t n) {
    if (!lg_v_ready(ex, out, gate, up)) return 0;
    LG_OMP(omp parallel for)
    for (long c = 0; c < (long)((n + LG_V - 1) / LG_V); c++) {
        const size_t i = (size_t)c * LG_V, m = n - i;
        const __m512 g = lg_v_load_n(gate, i, m, 0), u = lg_v_load_n(up, i, m, 0);
        lg_v_store_n(out, i, m, _mm512_mul_ps(_mm512_mul_ps(g, lg_v_sigmoid(g)), u));
    }
    return 1;
}

/* dgate, dup (n) = gradients of silu(gate) * up given dout */
LG_TARGET_AVX512 static int lg_swiglu_backward_avx512(const lg_exec *ex, lg_buf dgate, lg_buf dup,
                                                      lg_buf dout, lg_buf gate, lg_buf up,
                                                      size_t n) {
    if (!lg_v_ready(ex, dgate, dup, dout) || !lg_v_ready(ex, gate, up, lg_no_buf())) return 0;
    const __m512 one = _mm512_set1_ps(1.0f);
    LG_OMP(omp parallel for)
    for (long c = 0; c < (long)((n + LG_V - 1) / LG_V); c++) {
        const size_t i = (size_t)c * LG_V, m = n - i;
        const __m512 g = lg_v_load_n(gate, i, m, 0), d = lg_v_load_n(dout, i, m, 0);
        const __m512 u = lg_v_load_n(up, i, m, 0);
        const __m512 sig = lg_v_sigmoid(g), silu = _mm512_mul_ps(g, sig);
        const __m512 slope = _mm512_fmadd_ps(silu, _mm512_sub_ps(one, sig), sig);
        lg_v_store_n(dup, i, m, _mm512_mul_ps(d, silu));
        lg_v_store_n(dgate, i, m, _mm512_mul_ps(_mm512_mul_ps(d, u), slope));
    }
    return 1;
}

/* the row's largest of its first n values, and the sum of exp(x - max) over them */
LG_TARGET_AVX512 static void lg_v_row_max_sum(lg_buf z, int n, float *max, float *sum) {
    __m512 mx = _mm512_set1_ps(-INFINITY), s = _mm512_setzero_ps();
    for (int v = 0; v < n; v += LG_V) {
        const __mmask16 k = lg_v_mask((size_t)(n - v));
        mx = _mm512_mask_max_ps(mx, k, mx, lg_v_load_n(z, (size_t)v, (size_t)(n - v), 0));
    }
    *max = lg_v_max(mx);
    const __m512 vmax = _mm512_set1_ps(*max);
    for (int v = 0; v < n; v += LG_V) {
        const __mmask16 k = lg_v_mask((size_t)(n - v));
        const __m512 e = lg_v_exp(_mm512_sub_ps(lg_v_load_n(z, (size_t)v, (size_t)(n - v), 0), vmax));
        s = _mm512_mask_add_ps(s, k, s, e);
    }
    *sum = lg_v_sum(s);
}

/* cross-entropy: as lg_crossentropy_forward, the sum of the losses in *sum */
LG_TARGET_AVX512 static int lg_crossentropy_forward_avx512(const lg_exec *ex, lg_real *losses,
                                                           lg_buf logits, const int *targets,
                                                           int N, int V, int Vp, double *sum) {
    if (!lg_v_ready(ex, logits, lg_no_buf(), lg_no_buf())) return 0;
    double total = 0;
    LG_OMP(omp parallel for reduction(+ : total))
    for (int n = 0; n < N; n++) {
        lg_buf z = lg_at(logits, (size_t)n * Vp);
        if (targets[n] == LG_IGNORE_INDEX) { losses[n] = 0; continue; }
        float max, sum;
        lg_v_row_max_sum(z, V, &max, &sum);
        losses[n] = lg_log(sum) + max - lg_get(z, targets[n]);
        total += losses[n];
    }
    *sum = total;
    return 1;
}

LG_TARGET_AVX512 static int lg_crossentropy_backward_avx512(const lg_exec *ex, lg_buf dlogits,
                                                            lg_buf logits, const int *targets,
                                                            int N, int V, int Vp, lg_real scale) {
    if (!lg_v_ready(ex, dlogits, logits, lg_no_buf())) return 0;
    LG_OMP(omp parallel for)
    for (int n = 0; n < N; n++) {
        lg_buf z = lg_at(logits, (size_t)n * Vp), dz = lg_at(dlogits, (size_t)n * Vp);
        const int target = targets[n];
        if (target == LG_IGNORE_INDEX) {
            for (int v = 0; v < Vp; v++) lg_set(dz, v, 0);
            continue;
        }
        float max, sum;
        lg_v_row_max_sum(z, V, &max, &sum);
        const float z_target = (float)lg_get(z, target); /* before dz overwrites it */
        const __m512 vmax = _mm512_set1_ps(max), vscale = _mm512_set1_ps(scale / sum);
        for (int v = 0; v < V; v += LG_V) {
            const size_t m = (size_t)(V - v);
            const __m512 e = lg_v_exp(_mm512_sub_ps(lg_v_load_n(z, (size_t)v, m, 0), vmax));
            lg_v_store_n(dz, (size_t)v, m, _mm512_mul_ps(e, vscale));
        }
        const float p_target = _mm512_cvtss_f32(lg_v_exp(_mm512_set1_ps(z_target - max))) / sum;
        lg_set(dz, target, (p_target - 1.0f) * scale);
        for (int v = V; v < Vp; v++) lg_set(dz, v, 0);
    }
    return 1;
}

/* the sums of x and of (x - mu)^2 over a row of C */
LG_TARGET_AVX512 static float lg_v_row_sum(lg_buf x, int C) {
    __m512 s = _mm512_setzero_ps();
    for (int i = 0; i < C; i += LG_V) s = _mm512_add_ps(s, lg_v_load_n(x, (size_t)i, (size_t)(C - i), 0));
    return lg_v_sum(s);
}

LG_TARGET_AVX512 static float lg_v_row_squares(lg_buf x, int C, float mu) {
    __m512 s = _mm512_setzero_ps();
    const __m512 vmu = _mm512_set1_ps(mu);
    for (int i = 0; i < C; i += LG_V) {
        const __m512 d = _mm512_maskz_sub_ps(lg_v_mask((size_t)(C - i)),
                                             lg_v_load_n(x, (size_t)i, (size_t)(C - i), 0), vmu);
        s = _mm512_fmadd_ps(d, d, s);
    }
    return lg_v_sum(s);
}

/* LayerNorm or RMSNorm: as lg_norm_forward */
LG_TARGET_AVX512 static int lg_norm_forward_avx512(const lg_exec *ex, lg_buf out, lg_real *mean,
                                                   lg_real *rstd, lg_buf inp, lg_buf weight,
                                                   lg_buf bias, int N, int C, float eps) {
    if (!lg_v_ready(ex, out, inp, weight) || !lg_v_ready(ex, bias, lg_no_buf(), lg_no_buf())) return 0;
    LG_OMP(omp parallel for)
    for (int n = 0; n < N; n++) {
        lg_buf x = lg_at(inp, (size_t)n * C), y = lg_at(out, (size_t)n * C);
        const float mu = mean ? lg_v_row_sum(x, C) / C : 0.0f;
        const float r = 1.0f / sqrtf(lg_v_row_squares(x, C, mu) / C + eps);
        const __m512 vmu = _mm512_set1_ps(mu), vr = _mm512_set1_ps(r);
        for (int i = 0; i < C; i += LG_V) {
            const size_t m = (size_t)(C - i);
            const __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(lg_v_load_n(x, (size_t)i, m, 0), vmu), vr);
            const __m512 b = bias.data ? lg_v_load_n(bias, (size_t)i, m, 0) : _mm512_setzero_ps();
            lg_v_store_n(y, (size_t)i, m, _mm512_fmadd_ps(xhat, lg_v_load_n(weight, (size_t)i, m, 0), b));
        }
        if (mean) mean[n] = mu;
        rstd[n] = r;
    }
    return 1;
}

#define LG_V_COLUMNS 64 /* columns a thread sums over all rows at once (dweight, dbias) */

/* as lg_norm_backward */
LG_TARGET_AVX512 static int lg_norm_backward_avx512(const lg_exec *ex, lg_buf dinp, lg_buf dweight,
                                                    lg_buf dbias, lg_buf dout, lg_buf inp,
                                                    lg_buf weight, const lg_real *mean,
                                                    const lg_real *rstd, int N, int C) {
    if (!lg_v_ready(ex, dinp, dweight, dbias) || !lg_v_ready(ex, dout, inp, weight)) return 0;
    LG_OMP(omp parallel for)
    for (int n = 0; n < N; n++) {
        lg_buf x = lg_at(inp, (size_t)n * C), dy = lg_at(dout, (size_t)n * C);
        lg_buf dx = lg_at(dinp, (size_t)n * C);
        const __m512 vmu = _mm512_set1_ps(mean ? mean[n] : 0.0f), vr = _mm512_set1_ps(rstd[n]);
        __m512 s_dxhat = _mm512_setzero_ps(), s_dxhat_xhat = _mm512_setzero_ps();
        for (int i = 0; i < C; i += LG_V) {
            const size_t m = (size_t)(C - i);
            const __m512 dxhat = _mm512_mul_ps(lg_v_load_n(dy, (size_t)i, m, 0),
                                               lg_v_load_n(weight, (size_t)i, m, 0));
            const __m512 xhat = _mm512_maskz_mul_ps(lg_v_mask(m), _mm512_sub_ps(lg_v_load_n(x, (size_t)i, m, 0), vmu), vr);
            s_dxhat = _mm512_add_ps(s_dxhat, dxhat);
            s_dxhat_xhat = _mm512_fmadd_ps(dxhat, xhat, s_dxhat_xhat);
        }
        const __m512 dxhat_mean = _mm512_set1_ps(mean ? lg_v_sum(s_dxhat) / C : 0.0f);
        const __m512 dxhat_xhat_mean = _mm512_set1_ps(lg_v_sum(s_dxhat_xhat) / C);
        for (int i = 0; i < C; i += LG_V) {
            const size_t m = (size_t)(C - i);
            const __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(lg_v_load_n(x, (size_t)i, m, 0), vmu), vr);
            const __m512 dxhat = _mm512_mul_ps(lg_v_load_n(dy, (size_t)i, m, 0),
                                               lg_v_load_n(weight, (size_t)i, m, 0));
            const __m512 d = _mm512_mul_ps(vr, _mm512_fnmadd_ps(xhat, dxhat_xhat_mean,
                                                                _mm512_sub_ps(dxhat, dxhat_mean)));
            lg_v_store_n(dx, (size_t)i, m, _mm512_add_ps(lg_v_load_n(dx, (size_t)i, m, 0), d));
        }
    }
    if (!dweight.data) return 1; /* frozen (LoRA) */
    LG_OMP(omp parallel for)
    for (int c0 = 0; c0 < C; c0 += LG_V_COLUMNS) {
        __m512 dw[LG_V_COLUMNS / LG_V], db[LG_V_COLUMNS / LG_V];
        const int width = C - c0 < LG_V_COLUMNS ? C - c0 : LG_V_COLUMNS;
        for (int j = 0; j < LG_V_COLUMNS / LG_V; j++) dw[j] = db[j] = _mm512_setzero_ps();
        for (int n = 0; n < N; n++) {
            const __m512 vmu = _mm512_set1_ps(mean ? mean[n] : 0.0f), vr = _mm512_set1_ps(rstd[n]);
            for (int j = 0; j * LG_V < width; j++) {
                const size_t at = (size_t)n * C + c0 + j * LG_V, m = (size_t)(width - j * LG_V);
                const __m512 dy = lg_v_load_n(dout, at, m, 0);
                const __m512 xhat = _mm512_mul_ps(_mm512_sub_ps(lg_v_load_n(inp, at, m, 0), vmu), vr);
                dw[j] = _mm512_fmadd_ps(dy, xhat, dw[j]);
                db[j] = _mm512_add_ps(db[j], dy);
            }
        }
        for (int j = 0; j * LG_V < width; j++) {
            const size_t at = (size_t)c0 + j * LG_V, m = (size_t)(width - j * LG_V);
            lg_v_store_n(dweight, at, m, _mm512_add_ps(lg_v_load_n(dweight, at, m, 0), dw[j]));
            if (dbias.data) lg_v_store_n(dbias, at, m, _mm512_add_ps(lg_v_load_n(dbias, at, m, 0), db[j]));
        }
    }
    return 1;
}

/* attention's rows (lg_causal_softmax, lg_causal_probabilities and the softmax's backward) */
LG_TARGET_AVX512 static int lg_causal_softmax_avx512(const lg_exec *ex, lg_real *scores, int T,
                                                     lg_real scale, lg_real *lse) {
    if (!lg_v_ready(ex, lg_no_buf(), lg_no_buf(), lg_no_buf())) return 0;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int t = 0; t < T; t++) {
        float *row = scores + (size_t)t * T;
        const int n = t + 1; /* the causal prefix */
        __m512 mx = _mm512_set1_ps(-INFINITY), s = _mm512_setzero_ps();
        for (int i = 0; i < n; i += LG_V) {
            const __mmask16 k = lg_v_mask((size_t)(n - i));
            mx = _mm512_mask_max_ps(mx, k, mx, _mm512_maskz_loadu_ps(k, row + i));
        }
        const float max = lg_v_max(mx);
        const __m512 vmax = _mm512_set1_ps(max);
        for (int i = 0; i < n; i += LG_V) {
            const __mmask16 k = lg_v_mask((size_t)(n - i));
            const __m512 e = lg_v_exp(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + i), vmax), vscale));
            _mm512_mask_storeu_ps(row + i, k, e);
            s = _mm512_mask_add_ps(s, k, s, e);
        }
        const float sum = lg_v_sum(s);
        const __m512 vsum = _mm512_set1_ps(sum);
        for (int i = 0; i < T; i += LG_V) {
            const __mmask16 k = lg_v_mask((size_t)(T - i));
            const __mmask16 live = i < n ? lg_v_mask((size_t)(n - i)) : 0;
            _mm512_mask_storeu_ps(row + i, k, _mm512_maskz_div_ps(live, _mm512_maskz_loadu_ps(k, row + i), vsum));
        }
        lse[t] = max * scale + lg_log(sum);
    }
    return 1;
}

LG_TARGET_AVX512 static int lg_causal_probabilities_avx512(const lg_exec *ex, lg_real *scores,
                                                           int T, lg_real scale,
                                                           const lg_real *lse) {
    if (!lg_v_ready(ex, lg_no_buf(), lg_no_buf(), lg_no_buf())) return 0;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int t = 0; t < T; t++) {
        float *row = scores + (size_t)t * T;
        const __m512 vlse = _mm512_set1_ps(lse[t]);
        for (int i = 0; i < T; i += LG_V) {
            const __mmask16 k = lg_v_mask((size_t)(T - i));
            const __mmask16 live = i <= t ? lg_v_mask((size_t)(t + 1 - i)) : 0;
            const __m512 x = _mm512_maskz_loadu_ps(k, row + i);
            const __m512 e = lg_v_exp(_mm512_fmsub_ps(x, vscale, vlse));
            _mm512_mask_storeu_ps(row + i, k, _mm512_maskz_mov_ps(live, e));
        }
    }
    return 1;
}

/* the softmax's backward into the scaled scores, row by row: ds = p (dp - dy . y) scale, dy and
   y (T, HS) with rows ld apart */
LG_TARGET_AVX512 static int lg_softmax_backward_avx512(const lg_exec *ex, const lg_real *p,
                                                       lg_real *dp, lg_buf dout, lg_buf out,
                                                       int ld, int T, int HS, lg_real scale) {
    if (!lg_v_ready(ex, dout, out, lg_no_buf())) return 0;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int t = 0; t < T; t++) {
        const float *pr = p + (size_t)t * T;
        float *dr = dp + (size_t)t * T;
        __m512 d = _mm512_setzero_ps();
        for (int i = 0; i < HS; i += LG_V) {
            const size_t at = (size_t)t * ld + i, m = (size_t)(HS - i);
            d = _mm512_fmadd_ps(lg_v_load_n(dout, at, m, 0), lg_v_load_n(out, at, m, 0), d);
        }
        const __m512 dot = _mm512_set1_ps(lg_v_sum(d));
        for (int i = 0; i < T; i += LG_V) {
            const __mmask16 k = lg_v_mask((size_t)(T - i));
            const __mmask16 live = i <= t ? lg_v_mask((size_t)(t + 1 - i)) : 0;
            const __m512 ds = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, pr + i),
                                                          _mm512_sub_ps(_mm512_maskz_loadu_ps(k, dr + i), dot)),
                                            vscale);
            _mm512_mask_storeu_ps(dr + i, k, _mm512_maskz_mov_ps(live, ds));
        }
    }
    return 1;
}

/* out (n) = a + b */
LG_TARGET_AVX512 static int lg_add_avx512(const lg_exec *ex, lg_buf out, lg_buf a, lg_buf b,
                                          size_t n) {
    if (!lg_v_ready(ex, out, a, b)) return 0;
    LG_OMP(omp parallel for)
    for (long c = 0; c < (long)((n + LG_V - 1) / LG_V); c++) {
        const size_t i = (size_t)c * LG_V, m = n - i;
        lg_v_store_n(out, i, m, _mm512_add_ps(lg_v_load_n(a, i, m, 0), lg_v_load_n(b, i, m, 0)));
    }
    return 1;
}

/* rotary embedding: as lg_rope_rotate */
LG_TARGET_AVX512 static int lg_rope_rotate_avx512(const lg_exec *ex, lg_buf qkv,
                                                  const lg_real *cos_table,
                                                  const lg_real *sin_table, int B, int T, int NH,
                                                  int NQG, int HS, int rope_dims, int direction,
                                                  const int *span) {
    if (!lg_v_ready(ex, qkv, lg_no_buf(), lg_no_buf())) return 0;
    const int R = rope_dims / 2, heads = NH + NQG, QKV = (NH + 2 * NQG) * HS;
    const lg_buf cos_buf = {(void *)cos_table, LG_DTYPE_F32}, sin_buf = {(void *)sin_table, LG_DTYPE_F32};
    const __m512 sign = _mm512_set1_ps((float)direction);
    LG_OMP(omp parallel for)
    for (int n = 0; n < B * T; n++) {
        const size_t t = (size_t)lg_span_position(span, n, T);
        for (int h = 0; h < heads; h++) { /* the NH query heads, then the NQG key heads */
            lg_buf x = lg_at(qkv, (size_t)n * QKV + (size_t)h * HS);
            for (int j = 0; j < R; j += LG_V) {
                const size_t m = (size_t)(R - j);
                const __m512 a = lg_v_load_n(x, (size_t)j, m, 0), b = lg_v_load_n(x, (size_t)(j + R), m, 0);
                const __m512 c = lg_v_load_n(cos_buf, t * R + j, m, 0);
                const __m512 s = _mm512_mul_ps(sign, lg_v_load_n(sin_buf, t * R + j, m, 0));
                lg_v_store_n(x, (size_t)j, m, _mm512_fmsub_ps(a, c, _mm512_mul_ps(b, s)));
                lg_v_store_n(x, (size_t)(j + R), m, _mm512_fmadd_ps(b, c, _mm512_mul_ps(a, s)));
            }
        }
    }
    return 1;
}
#else
#define lg_rope_rotate_avx512(...) 0
#define lg_causal_softmax_avx512(...) 0
#define lg_causal_probabilities_avx512(...) 0
#define lg_softmax_backward_avx512(...) 0
#define lg_add_avx512(...) 0
#define lg_swiglu_forward_avx512(...) 0
#define lg_swiglu_backward_avx512(...) 0
#define lg_crossentropy_forward_avx512(...) 0
#define lg_crossentropy_backward_avx512(...) 0
#define lg_norm_forward_avx512(...) 0
#define lg_norm_backward_avx512(...) 0
#endif

/* The matmul workspace of an exec context (NULL: matmuls without packing). */
static const lg_gemm_workspace *lg_gemm_space(const lg_exec *ex) { return ex ? &ex->gemm : NULL; }

/* The ops. Tensors are typed views (lg_buf): activations, weights and gradients may be stored
   in bf16 or fp16; every op reads and writes elements in their storage type and does its
   arithmetic, sums included, in lg_real. Statistics (norm means and reciprocal deviations,
   rotary tables, per-token losses) are lg_real arrays in every precision. */

/* out (n) = elements first .. first + n of a tensor of count elements stored by
   lg_nf4_quantize: their NF4 codes x their blocks' absmax. first is even (a byte holds two
   codes): a tile of whole rows of an even width. */
static void lg_nf4_dequantize_range(const lg_exec *ex, const uint8_t *src, size_t count,
                                    lg_quantization q, size_t first, size_t n, lg_buf out) {
    if (q == LG_QUANTIZE_NONE || n == 0) return;
    LG_ON_GPU(ex, lg_cuda_nf4_dequantize(ex, src, count, q, first, n, out));
    lg_nf4_codebook book;
    lg_nf4_codebook_make(&book);
    lg_nf4_layout l = lg_nf4_layout_of(count, q);
    size_t end = first + n, b0 = first / LG_NF4_BLOCK;
    LG_OMP(omp parallel for)
    for (long b = (long)b0; b < (long)((end + LG_NF4_BLOCK - 1) / LG_NF4_BLOCK); b++) {
        float absmax = lg_nf4_block_absmax(&book, src, &l, q, (size_t)b);
        size_t lo = (size_t)b * LG_NF4_BLOCK, hi = lo + LG_NF4_BLOCK;
        for (size_t i = lo > first ? lo : first; i < hi && i < end; i++)
            lg_set(out, i - first, book.nf4[lg_nf4_code_at(src, i)] * absmax);
    }
}

/* out (count) = NF4 codes (count) x their blocks' absmax (lg_nf4_quantize's storage) */
void lg_nf4_dequantize(const lg_exec *ex, const uint8_t *src, size_t count, lg_quantization q,
                       lg_buf out) {
    lg_nf4_dequantize_range(ex, src, count, q, 0, count, out);
}

/* How a weight view is stored: NF4, NF4 with its absmax quantized, or (NONE) a compute type. */
static lg_quantization lg_quantization_of(lg_buf weight) {
    return weight.dtype == LG_DTYPE_NF4      ? LG_QUANTIZE_NF4
           : weight.dtype == LG_DTYPE_NF4_DQ ? LG_QUANTIZE_NF4_DQ
                                             : LG_QUANTIZE_NONE;
}

/* Rows r0 .. r0 + n (n, IC) of QLoRA's NF4 weight (OC, IC), dequantized into the exec's
   workspace for one matmul (a tile of lm_head's vocabulary); other weights as they are. */
static lg_buf lg_matmul_weight_rows(const lg_exec *ex, lg_buf weight, int OC, int IC, int r0,
                                    int n) {
    lg_quantization q = lg_quantization_of(weight);
    if (q == LG_QUANTIZE_NONE) return weight;
    lg_nf4_dequantize_range(ex, (const uint8_t *)weight.data, (size_t)OC * IC, q, (size_t)r0 * IC,
                            (size_t)n * IC, ex->dequantized);
    return ex->dequantized;
}

/* QLoRA's NF4 weights (OC, IC) dequantized into the exec's workspace for one matmul; other
   weights as they are. */
static lg_buf lg_matmul_weight(const lg_exec *ex, lg_buf weight, int OC, int IC) {
    return lg_matmul_weight_rows(ex, weight, OC, IC, 0, OC);
}

/* C (M, N) = beta C + op(A) (M, K) op(B) (K, N), row-major with leading dimensions: the
   products of LoRA's adapters, which write into column ranges of a linear's output. */
static void lg_matmul(const lg_exec *ex, int trans_a, int trans_b, int M, int N, int K, lg_buf A,
                      int lda, lg_buf B, int ldb, float beta, lg_buf C, int ldc) {
    LG_ON_GPU(ex, lg_cuda_matmul(ex, trans_a, trans_b, M, N, K, A, lda, B, ldb, beta, C, ldc,
                                 lg_no_buf()));
    lg_gemm(lg_gemm_space(ex), trans_a, trans_b, M, N, K, A, lda, B, ldb, (lg_real)beta, C, ldc);
}

/* LoRA's input u = scale * dropout(x) (n), or in the backward dx += scale * dropout(du): each
   element kept with probability 1 - p (mask bit first + i from lg_lora_keep(key, first + i):
   first places a chunk of rows in the whole input) and divided by 1 - p; key 0 keeps all. */
static void lg_lora_input(const lg_exec *ex, lg_buf out, lg_buf in, size_t n, size_t first,
                          float scale, float p, uint64_t key, int accumulate) {
    LG_ON_GPU(ex, lg_cuda_lora_input(ex, out, in, n, first, scale, p, key, accumulate));
    LG_OMP(omp parallel for)
    for (long long i = 0; i < (long long)n; i++) {
        lg_real v = lg_get(in, (size_t)i) * lg_lora_keep(key, first + (uint64_t)i, p, scale);
        lg_set(out, (size_t)i, accumulate ? lg_get(out, (size_t)i) + v : v);
    }
}

/* out (N, OC), rows ldo apart (a column range of a wider output when ldo > OC) = inp (N, IC)
   weight (OC, IC)^T + bias (OC); weight in a compute type (lg_matmul_weight) */
static void lg_linear_forward_into(const lg_exec *ex, lg_buf out, int ldo, lg_buf inp,
                                   lg_buf weight, lg_buf bias, int N, int IC, int OC) {
    LG_ON_GPU(ex, lg_cuda_linear_forward_into(ex, out, ldo, inp, weight, bias, N, IC, OC));
    lg_gemm(lg_gemm_space(ex), 0, 1, N, OC, IC, inp, IC, weight, IC, 0, out, ldo);
    if (!bias.data) return;
    LG_OMP(omp parallel for)
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++) {
            size_t at = (size_t)n * ldo + o;
            lg_set(out, at, lg_get(out, at) + lg_get(bias, o));
        }
}

/* out (N, OC) = inp (N, IC) weight (OC, IC)^T + bias (OC) */
static void lg_linear_forward(const lg_exec *ex, lg_buf out, lg_buf inp, lg_buf weight,
                              lg_buf bias, int N, int IC, int OC) {
    lg_linear_forward_into(ex, out, OC, inp, lg_matmul_weight(ex, weight, OC, IC), bias, N, IC, OC);
}

/* dinp (N, IC) = inp_beta dinp + dout (N, OC) weight (OC, IC); dweight (OC, IC) = grad_beta
   dweight + dout^T inp; dbias (OC) = grad_beta dbias + column sums of dout (a beta of 0
   writes, 1 adds). A frozen weight (dweight data NULL) gets no gradient: only the input's is
   computed. */
static void lg_linear_backward(const lg_exec *ex, lg_buf dinp, lg_buf dweight, lg_buf dbias,
                               lg_buf dout, lg_buf inp, lg_buf weight, int N, int IC, int OC,
                               float inp_beta, float grad_beta) {
    weight = lg_matmul_weight(ex, weight, OC, IC);
    LG_ON_GPU(ex, lg_cuda_linear_backward(ex, dinp, dweight, dbias, dout, inp, weight, N, IC, OC,
                                          inp_beta, grad_beta));
    const lg_gemm_workspace *ws = lg_gemm_space(ex);
    lg_gemm(ws, 0, 0, N, IC, OC, dout, OC, weight, IC, inp_beta, dinp, IC);
    if (dweight.data) lg_gemm(ws, 1, 0, OC, IC, N, dout, OC, inp, IC, grad_beta, dweight, IC);
    if (!dbias.data) return;
    LG_OMP(omp parallel for)
    for (int o = 0; o < OC; o++) {
        lg_real sum = 0;
        for (int n = 0; n < N; n++) sum += lg_get(dout, (size_t)n * OC + o);
        lg_set(dbias, o, grad_beta == 0 ? sum : lg_get(dbias, o) + sum);
    }
}

/* out (N, C) = wte[tokens] (+ wpe[position]); tokens (B, T); span NULL or (B, T) */
static void lg_embedding_forward(const lg_exec *ex, lg_buf out, const int *tokens, lg_buf wte,
                                 lg_buf wpe, int B, int T, int C, const int *span) {
    LG_ON_GPU(ex, lg_cuda_embedding_forward(ex, out, tokens, wte, wpe, B, T, C));
    LG_OMP(omp parallel for)
    for (int n = 0; n < B * T; n++)
        for (int i = 0; i < C; i++) {
            lg_real x = lg_get(wte, (size_t)tokens[n] * C + i);
            if (wpe.data) x += lg_get(wpe, (size_t)lg_span_position(span, n, T) * C + i);
            lg_set(out, (size_t)n * C + i, x);
        }
}

/* dwte (Vp, C) and dwpe (block_size, C) += dout (N, C) scattered back. Threads split the
   channels in chunks of 32 (a cache line of bf16), so no two write the same element or line
   and the sums keep a fixed order. */
static void lg_embedding_backward(const lg_exec *ex, lg_buf dwte, lg_buf dwpe, lg_buf dout,
                                  const int *tokens, int B, int T, int C, const int *span) {
    LG_ON_GPU(ex, lg_cuda_embedding_backward(ex, dwte, dwpe, dout, tokens, B, T, C));
    LG_OMP(omp parallel for schedule(static, 32))
    for (int i = 0; i < C; i++)
        for (int n = 0; n < B * T; n++) {
            lg_real d = lg_get(dout, (size_t)n * C + i);
            size_t at = (size_t)tokens[n] * C + i;
            lg_set(dwte, at, lg_get(dwte, at) + d);
            if (dwpe.data) {
                at = (size_t)lg_span_position(span, n, T) * C + i;
                lg_set(dwpe, at, lg_get(dwpe, at) + d);
            }
        }
}

/* LayerNorm (mean non-NULL) or RMSNorm (mean NULL) of each row of inp (N, C):
   out (N, C), mean (N), rstd (N). bias may be absent. */
static void lg_norm_forward(const lg_exec *ex, lg_buf out, lg_real *mean, lg_real *rstd,
                            lg_buf inp, lg_buf weight, lg_buf bias, int N, int C, float eps) {
    LG_ON_GPU(ex, lg_cuda_norm_forward(ex, out, mean, rstd, inp, weight, bias, N, C, eps));
    if (lg_avx512_usable(ex) &&
        lg_norm_forward_avx512(ex, out, mean, rstd, inp, weight, bias, N, C, eps))
        return;
    LG_OMP(omp parallel for)
    for (int n = 0; n < N; n++) {
        lg_buf x = lg_at(inp, (size_t)n * C), y = lg_at(out, (size_t)n * C);
        lg_real mu = 0, var = 0;
        if (mean) {
            for (int i = 0; i < C; i++) mu += lg_get(x, i);
            mu /= C;
        }
        for (int i = 0; i < C; i++) var += (lg_get(x, i) - mu) * (lg_get(x, i) - mu);
        lg_real r = 1.0f / lg_sqrt(var / C + eps);
        for (int i = 0; i < C; i++)
            lg_set(y, i, (lg_get(x, i) - mu) * r * lg_get(weight, i) +
                             (bias.data ? lg_get(bias, i) : 0));
        if (mean) mean[n] = mu;
        rstd[n] = r;
    }
}

/* dinp (N, C) += gradient through the norm; dweight, dbias (C) += their gradients.
   xhat = (x - mean) rstd; dx = rstd (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), and for
   RMSNorm the mean(dxhat) term is absent. */
static void lg_norm_backward(const lg_exec *ex, lg_buf dinp, lg_buf dweight, lg_buf dbias,
                             lg_buf dout, lg_buf inp, lg_buf weight, const lg_real *mean,
                             const lg_real *rstd, int N, int C) {
    LG_ON_GPU(ex, lg_cuda_norm_backward(ex, dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C));
    if (lg_avx512_usable(ex) && lg_norm_backward_avx512(ex, dinp, dweight, dbias, dout, inp, weight,
                                                        mean, rstd, N, C))
        return;
    LG_OMP(omp parallel for)
    for (int n = 0; n < N; n++) {
        lg_buf x = lg_at(inp, (size_t)n * C), dy = lg_at(dout, (size_t)n * C);
        lg_buf dx = lg_at(dinp, (size_t)n * C);
        lg_real mu = mean ? mean[n] : 0, r = rstd[n];
        lg_real dxhat_mean = 0, dxhat_xhat_mean = 0;
        for (int i = 0; i < C; i++) {
            lg_real dxhat = lg_get(dy, i) * lg_get(weight, i);
            dxhat_mean += dxhat;
            dxhat_xhat_mean += dxhat * (lg_get(x, i) - mu) * r;
        }
        dxhat_mean = mean ? dxhat_mean / C : 0;
        dxhat_xhat_mean /= C;
        for (int i = 0; i < C; i++) {
            lg_real xhat = (lg_get(x, i) - mu) * r;
            lg_real d = r * (lg_get(dy, i) * lg_get(weight, i) - dxhat_mean - xhat * dxhat_xhat_mean);
            lg_set(dx, i, lg_get(dx, i) + d);
        }
    }
    if (!dweight.data) return; /* frozen (LoRA) */
    LG_OMP(omp parallel for)
    for (int i = 0; i < C; i++) {
        lg_real dw = 0, db = 0;
        for (int n = 0; n < N; n++) {
            lg_real dy = lg_get(dout, (size_t)n * C + i);
            dw += dy * (lg_get(inp, (size_t)n * C + i) - (mean ? mean[n] : 0)) * rstd[n];
            db += dy;
        }
        lg_set(dweight, i, lg_get(dweight, i) + dw);
        if (dbias.data) lg_set(dbias, i, lg_get(dbias, i) + db);
    }
}

/* Llama 3.1's scaling of one rotary frequency (radians a position). With r = the periods it
   turns within the original context (original_max_seq_len / wavelength), the share kept
   unscaled is s = (r - low_freq_factor) / (high_freq_factor - low_freq_factor) within [0, 1]:
   inv_freq ((1 - s) / factor + s). Slow frequencies (s = 0) are divided by factor, fast ones
   (s = 1) kept. */
static double lg_rope_adjust(double inv_freq, const lg_rope_adjustments *ra) {
    if (!ra || ra->factor == 0.0f) return inv_freq;
    double wavelength = 2.0 * 3.14159265358979323846 / inv_freq;
    double periods = ra->original_max_seq_len / wavelength;
    double kept = (periods - ra->low_freq_factor) / (ra->high_freq_factor - ra->low_freq_factor);
    kept = kept < 0.0 ? 0.0 : kept > 1.0 ? 1.0 : kept;
    return inv_freq * ((1.0 - kept) / ra->factor + kept);
}

/* Rotary tables for positions 0..T-1: cos, sin (T, R) with R = rope_dims / 2 frequencies,
   base^(-2j / rope_dims) adjusted by ra (NULL or factor 0: unchanged). */
static void lg_rope_tables(const lg_exec *ex, lg_real *cos_table, lg_real *sin_table, int T,
                           int rope_dims, float base, const lg_rope_adjustments *ra) {
    int R = rope_dims / 2;
    for (int table = 0; table < 2; table++) { /* cos, then sin */
        lg_visit v = lg_visit_start(ex, lg_buf_of(table ? sin_table : cos_table), (size_t)T * R, 1,
                                    LG_VISIT_WRITE);
        while (lg_visit_next(&v))
            for (size_t k = 0; k < v.n; k++) { /* element t R + j */
                int t = (int)((v.first + k) / R), j = (int)((v.first + k) % R);
                double angle = t * lg_rope_adjust(pow((double)base, -2.0 * j / rope_dims), ra);
                lg_set(v.piece, k, (lg_real)(table ? sin(angle) : cos(angle)));
            }
    }
}

/* Rotates the first 2R dims of every query and key head of qkv (B, T, (NH + 2 NQG) HS) in the
   rotate-half convention: pairs (j, j + R). direction +1 applies it (forward), -1 applies the
   inverse rotation, which is the backward of this orthogonal map. */
static void lg_rope_rotate(const lg_exec *ex, lg_buf qkv, const lg_real *cos_table,
                           const lg_real *sin_table, int B, int T, int NH, int NQG, int HS,
                           int rope_dims, int direction, const int *span) {
    LG_ON_GPU(ex, lg_cuda_rope_rotate(ex, qkv, cos_table, sin_table, B, T, NH, NQG, HS, rope_dims,
                                     direction));
    int R = rope_dims / 2, heads = NH + NQG, QKV = (NH + 2 * NQG) * HS;
    if (R == 0) return;
    if (lg_avx512_usable(ex) && lg_rope_rotate_avx512(ex, qkv, cos_table, sin_table, B, T, NH, NQG,
                                                      HS, rope_dims, direction, span))
        return;
    LG_OMP(omp parallel for)
    for (int n = 0; n < B * T; n++) {
        int t = lg_span_position(span, n, T);
        const lg_real *c = cos_table + (size_t)t * R, *s = sin_table + (size_t)t * R;
        for (int h = 0; h < heads; h++) { /* the NH query heads, then the NQG key heads */
            lg_buf x = lg_at(qkv, (size_t)n * QKV + (size_t)h * HS);
            for (int j = 0; j < R; j++) {
                lg_real a = lg_get(x, j), b = lg_get(x, j + R), sn = direction * s[j];
                lg_set(x, j, a * c[j] - b * sn);
                lg_set(x, j + R, b * c[j] + a * sn);
            }
        }
    }
}

/* Softmax of each row of scores (T, T) scaled by `scale`, over its causal prefix s <= t, in
   place (the rest 0); lse (T) gets each row's log-sum-exp of the scaled scores. (Packed rows
   reach it one sample at a time: lg_attention_forward.) */
static void lg_causal_softmax(lg_real *scores, int T, lg_real scale, lg_real *lse) {
    for (int t = 0; t < T; t++) {
        lg_real *row = scores + (size_t)t * T;
        lg_real max = -INFINITY, sum = 0;
        for (int s = 0; s <= t; s++) max = row[s] > max ? row[s] : max;
        for (int s = 0; s <= t; s++) {
            row[s] = lg_exp((row[s] - max) * scale);
            sum += row[s];
        }
        for (int s = 0; s <= t; s++) row[s] /= sum;
        for (int s = t + 1; s < T; s++) row[s] = 0;
        lse[t] = max * scale + lg_log(sum);
    }
}

/* The probabilities again from the scores (T, T) and the saved log-sum-exp, in place. */
static void lg_causal_probabilities(lg_real *scores, int T, lg_real scale, const lg_real *lse) {
    for (int t = 0; t < T; t++) {
        lg_real *row = scores + (size_t)t * T;
        for (int s = 0; s <= t; s++) row[s] = lg_exp(row[s] * scale - lse[t]);
        for (int s = t + 1; s < T; s++) row[s] = 0;
    }
}

/* The calling thread's slot of the attention scratch. The callers' num_threads clause keeps
   the team within the planned slots; a larger thread number (never expected) shares the last. */
static lg_real *lg_attention_rows(const lg_attention_scratch *sc) {
    int slot = 0;
#ifdef _OPENMP
    slot = omp_get_thread_num();
#endif
    if (slot >= sc->threads) slot = sc->threads - 1;
    return sc->base + (size_t)slot * sc->per_thread;
}

/* The end of the segment that starts at row t0 of a packed row (start (T): each token's span
   start): its sample, or one padding token; T when the row is not packed (start NULL). */
static int lg_segment_end(const int *start, int t0, int T) {
    int end = t0 + 1;
    if (!start) return T;
    while (end < T && start[end] == t0) end++;
    return end;
}

/* One head's causal attention over n rows: q, k, v (n, HS) with row stride QKV, out (n, HS)
   with row stride ld_out, lse (n); p (n, n) the thread's scratch. */
static void lg_attention_head_forward(const lg_exec *ex, lg_buf out, lg_real *lse, lg_buf q,
                                      lg_buf k, lg_buf v, int n, int QKV, int ld_out, int HS,
                                      lg_real scale, lg_real *p) {
    const lg_gemm_workspace *ws = lg_gemm_space(ex);
    lg_gemm(ws, 0, 1, n, n, HS, q, QKV, k, QKV, 0, lg_buf_of(p), n); /* scores = q k^T */
    if (!lg_avx512_usable(ex) || !lg_causal_softmax_avx512(ex, p, n, scale, lse))
        lg_causal_softmax(p, n, scale, lse);
    lg_gemm(ws, 0, 0, n, HS, n, lg_buf_of(p), n, v, QKV, 0, out, ld_out); /* y = p v */
}

/* Causal attention. qkv (B, T, (NH + 2 NQG) HS): query head h reads key/value group
   h / (NH / NQG). y (B, T, NH HS); lse (B, NH, T) keeps each row's log-sum-exp, all the
   backward needs to rebuild the probabilities, so memory grows with T, not T^2, per block.
   Each (batch, head) is two matrix products around a softmax in the thread's scratch rows.
   Packed rows (span (B, T), or NULL) attend segment by segment, each sample on its own, so a
   row of short samples costs the sum of their squares, not T^2. */
static void lg_attention_forward(const lg_exec *ex, lg_buf y, lg_real *lse, lg_buf qkv, int B,
                                 int T, int NH, int NQG, int HS, const int *span) {
    LG_ON_GPU(ex, lg_cuda_attention_forward(ex, y, lse, qkv, B, T, NH, NQG, HS));
    const lg_attention_scratch *sc = &ex->attention;
    int QKV = (NH + 2 * NQG) * HS, heads_per_group = NH / NQG;
    lg_real scale = 1.0f / lg_sqrt((lg_real)HS);
    LG_OMP(omp parallel for collapse(2) schedule(dynamic) num_threads(sc->threads))
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++) {
            int g = h / heads_per_group;
            const int *start = span ? span + (size_t)b * T : NULL; /* (T) or NULL */
            lg_real *p = lg_attention_rows(sc);                     /* (T, T) */
            for (int t0 = 0, t1; t0 < T; t0 = t1) {
                t1 = lg_segment_end(start, t0, T);
                size_t row = (size_t)b * T + t0;
                lg_attention_head_forward(ex, lg_at(y, row * NH * HS + (size_t)h * HS),
                                          lse + ((size_t)b * NH + h) * T + t0,
                                          lg_at(qkv, row * QKV + (size_t)h * HS),
                                          lg_at(qkv, row * QKV + (size_t)(NH + g) * HS),
                                          lg_at(qkv, row * QKV + (size_t)(NH + NQG + g) * HS),
                                          t1 - t0, QKV, NH * HS, HS, scale, p);
            }
        }
}

/* One query head's attention backward over n rows (views as lg_attention_head_forward: q, k,
   v, dq, dk, dv with row stride QKV; dout, out with ld_out): dq, dk, dv += their gradients.
   p, dp (n, n) the thread's scratch. */
typedef struct {
    lg_buf q, k, v, dq, dk, dv, dout, out;
} lg_attention_head;

static void lg_attention_head_backward(const lg_exec *ex, const lg_attention_head *x,
                                       const lg_real *lse, int n, int QKV, int ld_out, int HS,
                                       lg_real scale, lg_real *p, lg_real *dp) {
    const lg_gemm_workspace *ws = lg_gemm_space(ex);
    lg_gemm(ws, 0, 1, n, n, HS, x->q, QKV, x->k, QKV, 0, lg_buf_of(p), n);
    if (!lg_avx512_usable(ex) || !lg_causal_probabilities_avx512(ex, p, n, scale, lse))
        lg_causal_probabilities(p, n, scale, lse);
    /* y = p v: dp = dy v^T, dv += p^T dy */
    lg_gemm(ws, 0, 1, n, n, HS, x->dout, ld_out, x->v, QKV, 0, lg_buf_of(dp), n);
    lg_gemm(ws, 1, 0, n, HS, n, lg_buf_of(p), n, x->dout, ld_out, 1, x->dv, QKV);
    /* softmax backward into the scaled scores: ds = p (dp - dy . y) scale */
    if (!lg_avx512_usable(ex) ||
        !lg_softmax_backward_avx512(ex, p, dp, x->dout, x->out, ld_out, n, HS, scale))
        for (int t = 0; t < n; t++) {
            lg_real *pr = p + (size_t)t * n, *dr = dp + (size_t)t * n, dot = 0;
            for (int i = 0; i < HS; i++)
                dot += lg_get(x->dout, (size_t)t * ld_out + i) * lg_get(x->out, (size_t)t * ld_out + i);
            for (int s = 0; s <= t; s++) dr[s] = pr[s] * (dr[s] - dot) * scale;
            for (int s = t + 1; s < n; s++) dr[s] = 0;
        }
    /* scores = q k^T: dq += ds k, dk += ds^T q */
    lg_gemm(ws, 0, 0, n, HS, n, lg_buf_of(dp), n, x->k, QKV, 1, x->dq, QKV);
    lg_gemm(ws, 1, 0, n, HS, n, lg_buf_of(dp), n, x->q, QKV, 1, x->dk, QKV);
}

/* dqkv (B, T, QKV) += gradient of the attention given dy (B, T, NH HS) and the forward's
   output y (B, T, NH HS). The probabilities are rebuilt from q, k and the saved log-sum-exp;
   the softmax's backward needs each row's sum_s p dp = dy . y. Threads own a (batch, group)
   pair, so the key/value gradients shared by the heads of a group are written by one thread
   only. Packed rows (span) go segment by segment, as the forward. */
static void lg_attention_backward(const lg_exec *ex, lg_buf dqkv, lg_buf dy, lg_buf y,
                                  lg_buf qkv, const lg_real *lse, int B, int T, int NH, int NQG,
                                  int HS, const int *span) {
    LG_ON_GPU(ex, lg_cuda_attention_backward(ex, dqkv, dy, y, qkv, lse, B, T, NH, NQG, HS));
    const lg_attention_scratch *sc = &ex->attention;
    int QKV = (NH + 2 * NQG) * HS, heads_per_group = NH / NQG, ld_out = NH * HS;
    lg_real scale = 1.0f / lg_sqrt((lg_real)HS);
    LG_OMP(omp parallel for collapse(2) schedule(dynamic) num_threads(sc->threads))
    for (int b = 0; b < B; b++)
        for (int g = 0; g < NQG; g++)
            for (int h = g * heads_per_group; h < (g + 1) * heads_per_group; h++) {
                const int *start = span ? span + (size_t)b * T : NULL; /* (T) or NULL */
                lg_real *p = lg_attention_rows(sc), *dp = p + (size_t)T * T; /* (T, T) each */
                for (int t0 = 0, t1; t0 < T; t0 = t1) {
                    t1 = lg_segment_end(start, t0, T);
                    size_t row = (size_t)b * T + t0, q_at = row * QKV + (size_t)h * HS,
                           k_at = row * QKV + (size_t)(NH + g) * HS,
                           v_at = row * QKV + (size_t)(NH + NQG + g) * HS,
                           y_at = row * ld_out + (size_t)h * HS;
                    lg_attention_head x = {lg_at(qkv, q_at), lg_at(qkv, k_at), lg_at(qkv, v_at),
                                           lg_at(dqkv, q_at), lg_at(dqkv, k_at), lg_at(dqkv, v_at),
                                           lg_at(dy, y_at), lg_at(y, y_at)};
                    lg_attention_head_backward(ex, &x, lse + ((size_t)b * NH + h) * T + t0,
                                               t1 - t0, QKV, ld_out, HS, scale, p, dp);
                }
            }
}

/* out (n) = gelu(inp (n)), exact or tanh approximation */
static void lg_gelu_forward(const lg_exec *ex, lg_buf out, lg_buf inp, size_t n, int tanh_approx) {
    LG_ON_GPU(ex, lg_cuda_gelu_forward(ex, out, inp, n, tanh_approx));
    LG_OMP(omp parallel for)
    for (long i = 0; i < (long)n; i++) {
        lg_real x = lg_get(inp, i);
        lg_set(out, i, tanh_approx ? lg_gelu_tanh(x) : lg_gelu_erf(x));
    }
}

/* dinp (n) = dout * gelu'(inp) */
static void lg_gelu_backward(const lg_exec *ex, lg_buf dinp, lg_buf dout, lg_buf inp, size_t n,
                             int tanh_approx) {
    LG_ON_GPU(ex, lg_cuda_gelu_backward(ex, dinp, dout, inp, n, tanh_approx));
    LG_OMP(omp parallel for)
    for (long i = 0; i < (long)n; i++) {
        lg_real x = lg_get(inp, i);
        lg_set(dinp, i, lg_get(dout, i) * (tanh_approx ? lg_gelu_tanh_grad(x) : lg_gelu_erf_grad(x)));
    }
}

/* out (n) = silu(gate) * up */
static void lg_swiglu_forward(const lg_exec *ex, lg_buf out, lg_buf gate, lg_buf up, size_t n) {
    LG_ON_GPU(ex, lg_cuda_swiglu_forward(ex, out, gate, up, n));
    if (lg_avx512_usable(ex) && lg_swiglu_forward_avx512(ex, out, gate, up, n)) return;
    LG_OMP(omp parallel for)
    for (long i = 0; i < (long)n; i++) {
        lg_real g = lg_get(gate, i);
        lg_set(out, i, g * lg_sigmoid(g) * lg_get(up, i));
    }
}

/* dgate, dup (n) = gradients of silu(gate) * up given dout */
static void lg_swiglu_backward(const lg_exec *ex, lg_buf dgate, lg_buf dup, lg_buf dout,
                               lg_buf gate, lg_buf up, size_t n) {
    LG_ON_GPU(ex, lg_cuda_swiglu_backward(ex, dgate, dup, dout, gate, up, n));
    if (lg_avx512_usable(ex) && lg_swiglu_backward_avx512(ex, dgate, dup, dout, gate, up, n))
        return;
    LG_OMP(omp parallel for)
    for (long i = 0; i < (long)n; i++) {
        lg_real g = lg_get(gate, i), d = lg_get(dout, i);
        lg_real sig = lg_sigmoid(g), silu = g * sig;
        lg_set(dup, i, d * silu);
        lg_set(dgate, i, d * lg_get(up, i) * (sig + silu * (1.0f - sig)));
    }
}

/* Per-token loss (N) = logsumexp(logits[n, 0..V)) - logits[n, target]; 0 where the target is
   ignored. logits (N, Vp): the Vp - V padded columns are never read. Returns the sum. */
static double lg_crossentropy_forward(const lg_exec *ex, lg_real *losses, lg_buf logits,
                                      const int *targets, int N, int V, int Vp) {
    LG_ON_GPU_RETURN(ex, lg_cuda_crossentropy_forward(ex, losses, logits, targets, N, V, Vp));
    double total = 0;
    if (lg_avx512_usable(ex) &&
        lg_crossentropy_forward_avx512(ex, losses, logits, targets, N, V, Vp, &total))
        return total;
    LG_OMP(omp parallel for reduction(+ : total))
    for (int n = 0; n < N; n++) {
        lg_buf z = lg_at(logits, (size_t)n * Vp);
        if (targets[n] == LG_IGNORE_INDEX) { losses[n] = 0; continue; }
        lg_real max = lg_get(z, 0), sum = 0;
        for (int v = 1; v < V; v++) max = lg_get(z, v) > max ? lg_get(z, v) : max;
        for (int v = 0; v < V; v++) sum += lg_exp(lg_get(z, v) - max);
        losses[n] = lg_log(sum) + max - lg_get(z, targets[n]);
        total += losses[n];
    }
    return total;
}

/* dlogits (N, Vp) = (softmax(logits) - onehot(target)) * scale over the first V columns, 0 on
   the padded columns and on ignored rows. dlogits may be logits (in place). */
static void lg_crossentropy_backward(const lg_exec *ex, lg_buf dlogits, lg_buf logits,
                                     const int *targets, int N, int V, int Vp, lg_real scale) {
    LG_ON_GPU(ex, lg_cuda_crossentropy_backward(ex, dlogits, logits, targets, N, V, Vp, scale));
    if (lg_avx512_usable(ex) &&
        lg_crossentropy_backward_avx512(ex, dlogits, logits, targets, N, V, Vp, scale))
        return;
    LG_OMP(omp parallel for)
    for (int n = 0; n < N; n++) {
        lg_buf z = lg_at(logits, (size_t)n * Vp), dz = lg_at(dlogits, (size_t)n * Vp);
        if (targets[n] == LG_IGNORE_INDEX) {
            for (int v = 0; v < Vp; v++) lg_set(dz, v, 0);
            continue;
        }
        lg_real max = lg_get(z, 0), sum = 0;
        for (int v = 1; v < V; v++) max = lg_get(z, v) > max ? lg_get(z, v) : max;
        for (int v = 0; v < V; v++) sum += lg_exp(lg_get(z, v) - max);
        int target = targets[n];
        for (int v = 0; v < V; v++)
            lg_set(dz, v, (lg_exp(lg_get(z, v) - max) / sum - (v == target)) * scale);
        for (int v = V; v < Vp; v++) lg_set(dz, v, 0);
    }
}

/* The training step's classifier: losses (N) and their sum (returned) as
   lg_crossentropy_forward, then the logits (N, Vp) replaced by their gradient at `scale` as
   lg_crossentropy_backward in place. On a GPU one pass over each row's logits. */
static double lg_crossentropy_fused(const lg_exec *ex, lg_real *losses, lg_buf logits,
                                    const int *targets, int N, int V, int Vp, lg_real scale) {
    LG_ON_GPU_RETURN(ex, lg_cuda_crossentropy_fused(ex, losses, logits, targets, N, V, Vp, scale));
    double total = lg_crossentropy_forward(ex, losses, logits, targets, N, V, Vp);
    lg_crossentropy_backward(ex, logits, logits, targets, N, V, Vp, scale);
    return total;
}

/* out (n) = a + b */
static void lg_add(const lg_exec *ex, lg_buf out, lg_buf a, lg_buf b, size_t n) {
    LG_ON_GPU(ex, lg_cuda_add(ex, out, a, b, n));
    if (lg_avx512_usable(ex) && lg_add_avx512(ex, out, a, b, n)) return;
    LG_OMP(omp parallel for)
    for (long i = 0; i < (long)n; i++) lg_set(out, i, lg_get(a, i) + lg_get(b, i));
}

/* dst (n) = src (n), converting; n 0 copies nothing (an empty unit's buffers may be NULL) */
static void lg_copy(const lg_exec *ex, lg_buf dst, lg_buf src, size_t n) {
    if (n == 0) return;
    LG_ON_GPU(ex, lg_cuda_copy(ex, dst, src, n));
    if (dst.dtype == src.dtype) {
        memcpy(dst.data, src.data, n * lg_elem_size(dst.dtype));
        return;
    }
    LG_OMP(omp parallel for)
    for (long i = 0; i < (long)n; i++) lg_set(dst, i, lg_get(src, i));
}

/* dst (n) = src (n), same storage type, beside the rank's compute on a GPU (its communication
   stream, after the ops queued so far): for offload's copies to the host, which lg_rank_sync
   waits for. */
static void lg_copy_beside(const lg_exec *ex, lg_buf dst, lg_buf src, size_t n) {
    LG_ON_GPU(ex, lg_cuda_copy_beside(ex, dst, src, n));
    lg_copy(ex, dst, src, n);
}

/* The copies beside queued so far are --offload activations' slot k's (lg_mark_beside); the
   compute waits for that mark alone (lg_wait_beside) before it touches the slot, not for all
   the rank has queued, so that the next block's compute runs while the copy does. The CPU's
   copies are done when they return. */
static void lg_mark_beside(const lg_exec *ex, int slot) {
    LG_ON_GPU(ex, lg_cuda_mark_beside(ex, slot));
    (void)slot;
}
static void lg_wait_beside(const lg_exec *ex, int slot) {
    LG_ON_GPU(ex, lg_cuda_wait_beside(ex, slot));
    (void)slot;
}
/* The host waits until the copies marked as slot k's have landed (before it writes what they
   read). */
static void lg_finish_beside(const lg_exec *ex, int slot) {
    LG_ON_GPU(ex, lg_cuda_finish_beside(ex, slot));
    (void)slot;
}

/* x (n) = 0; n 0 writes nothing (x may be NULL) */
static void lg_zero(const lg_exec *ex, lg_buf x, size_t n) {
    if (n == 0) return;
    LG_ON_GPU(ex, lg_cuda_zero(ex, x, n));
    memset(x.data, 0, n * lg_elem_size(x.dtype));
}

/* The residual add and the norm that follows it: sum (N, C) = a + b, then out (N, C), mean and
   rstd (N) the norm of sum as lg_norm_forward. One pass over the rows on a GPU; sum may be a
   or b. (The backward needs no fusing: lg_norm_backward adds into the residual's gradient.) */
static void lg_residual_norm_forward(const lg_exec *ex, lg_buf sum, lg_buf out, lg_real *mean,
                                     lg_real *rstd, lg_buf a, lg_buf b, lg_buf weight,
                                     lg_buf bias, int N, int C, float eps) {
    LG_ON_GPU(ex, lg_cuda_residual_norm_forward(ex, sum, out, mean, rstd, a, b, weight, bias, N,
                                                C, eps));
    lg_add(ex, sum, a, b, (size_t)N * C);
    lg_norm_forward(ex, out, mean, rstd, sum, weight, bias, N, C, eps);
}

/* 8. model ------------------------------------------------------------------------------------ */

/* The memory of region `name` of the model's rank, or an error naming it. */
static void *lg_model_region(lg_model *m, const char *name, lg_error *err) {
    void *p = lg_rank_region(m->rank, name);
    if (!p) lg_fail(err, "the plan has no region %s", name);
    return p;
}

/* A region as a typed view; data NULL (and an error) when the plan lacks it. */
static lg_buf lg_model_view(lg_model *m, const char *name, lg_dtype dtype, lg_error *err) {
    lg_buf b = lg_rank_view(m->rank, name, dtype);
    if (!b.data) lg_fail(err, "the plan has no region %s", name);
    return b;
}

/* lg_kept_on_host for a bound model: block l's output is kept in host memory */
static int lg_model_kept_on_host(const lg_model *m, int l) {
    return m->offload_activations && m->recompute && l < m->cfg.n_layer - 1;
}

/* Points the activation views into their regions, each laid out by the function that sized
   it for the plan. */
static int lg_model_bind_activations(lg_model *m, lg_dtype acts, lg_error *err) {
    const lg_config *cfg = &m->cfg;
    int B = m->B, T = m->T;
    char name[LG_MAX_NAME];
    size_t count;
    lg_buf base = lg_model_view(m, LG_REGION_ACTIVATIONS_EMBEDDING, acts, err);
    if (!base.data) return -1;
    if (cfg->lora.host_embedding &&
        !(m->embedding_rows = lg_model_view(m, LG_REGION_EMBEDDING_ROWS, acts, err)).data)
        return -1;
    for (int k = 0; k < LG_KEPT_SLOTS && lg_model_kept_on_host(m, 0); k++) {
        snprintf(name, sizeof name, LG_REGION_KEPT_SLOT, k);
        if (!(m->a.kept_slot[k] = lg_model_view(m, name, acts, err)).data) return -1;
    }
    lg_embedding_acts_layout(B, T, cfg->n_embd, base, &m->a, &count);
    for (int l = 0; l < cfg->n_layer; l++) {
        lg_buf own, stats;
        snprintf(name, sizeof name, LG_REGION_BLOCK_ACTS, l);
        if (!(own = lg_model_view(m, name, acts, err)).data) return -1;
        if (m->recompute) { /* every block lays out in the shared region; its output is its own */
            lg_buf shared = lg_model_view(m, LG_REGION_RECOMPUTE_BLOCK, acts, err);
            if (!(stats = lg_model_view(m, LG_REGION_RECOMPUTE_BLOCK_STATS, LG_DTYPE_F32,
                                        err)).data ||
                !shared.data)
                return -1;
            lg_block_acts_layout(cfg, l, B, T, m->slice_rows, 0, shared, &m->a, &count);
            m->a.residual[l + 1] = own;
            if (lg_model_kept_on_host(m, l)) { /* on the host; the blocks use a device slot */
                m->a.kept_host[l] = own;
                m->a.residual[l + 1] = m->a.kept_slot[l % LG_KEPT_SLOTS];
            }
        } else {
            snprintf(name, sizeof name, LG_REGION_BLOCK_STATS, l);
            if (!(stats = lg_model_view(m, name, LG_DTYPE_F32, err)).data) return -1;
            lg_block_acts_layout(cfg, l, B, T, m->slice_rows, 0, own, &m->a, &count);
        }
        lg_block_acts_layout(cfg, l, B, T, m->slice_rows, 1, stats, &m->a, &count);
    }
    lg_real *rope = (lg_real *)lg_rank_region(m->rank, LG_REGION_ROPE); /* absent without rotary */
    lg_rope_layout(cfg, T, rope, &m->a, &count);
    if (!(base = lg_model_view(m, LG_REGION_HEAD, acts, err)).data) return -1;
    lg_head_acts_layout(cfg, B, T, m->head_rows, 0, base, &m->a, &count);
    if (!(base = lg_model_view(m, LG_REGION_HEAD_STATS, LG_DTYPE_F32, err)).data) return -1;
    lg_head_acts_layout(cfg, B, T, m->head_rows, 1, base, &m->a, &count);
    if (!(base = lg_model_view(m, LG_REGION_BACKWARD, acts, err)).data) return -1;
    lg_backward_layout(cfg, B, T, m->slice_rows, base, &m->a, &count);
    return 0;
}

static int lg_model_bind_views(lg_model *m, const lg_config *cfg, lg_rank *rank, lg_error *err);

/* LoRA: the base tensors' views point into the frozen regions. */
static int lg_model_bind_frozen(lg_model *m, lg_dtype weights, lg_error *err) {
    if (m->cfg.lora.r == 0) return 0;
    lg_buf packed = lg_no_buf();
    m->frozen_gathered = lg_frozen_sharded(&m->cfg, &m->rank->plan->sharding);
    if (m->cfg.lora.host_embedding) { /* the layouts below leave wte's view to this */
        m->embedding_host = lg_model_view(m, LG_REGION_EMBEDDING_HOST, weights, err);
        if (!m->embedding_host.data) return -1;
    }
    if (m->cfg.lora.quantize != LG_QUANTIZE_NONE) {
        m->exec.dequantized = lg_model_view(m, LG_REGION_NF4_DEQUANTIZED, weights, err);
        if (!m->exec.dequantized.data) return -1;
    }
    if (m->frozen_gathered) { /* the table in units; the views follow the gathers */
        m->frozen_shard = lg_model_view(m, LG_REGION_FROZEN_WEIGHTS_SHARD, LG_DTYPE_U8, err);
        m->frozen.dtype = weights;
        size_t origin = 0, whole = 0;
        for (int u = 0; u <= m->cfg.n_layer; u++, origin += whole)
            lg_frozen_unit_layout(&m->cfg, u, weights, NULL, origin, NULL, &m->frozen_table, &whole);
        m->frozen_table.total = 0;
        return m->frozen_shard.data ? 0 : -1;
    }
    m->frozen = lg_model_view(m, LG_REGION_FROZEN_WEIGHTS, weights, err);
    if (!m->frozen.data) return -1;
    if (m->cfg.lora.quantize != LG_QUANTIZE_NONE) {
        packed = lg_model_view(m, LG_REGION_FROZEN_WEIGHTS_NF4, LG_DTYPE_U8, err);
        if (!packed.data) return -1;
    }
    m->frozen_packed = packed;
    lg_frozen_layout(&m->cfg, m->frozen, packed, &m->p, &m->frozen_table, NULL);
    if (m->cfg.lora.host_embedding) m->p.wte = m->embedding_host;
    return 0;
}

/* LoRA, frozen_gathered: points the base views of frozen unit u at a buffer holding the whole
   unit (lg_frozen_unit_layout); the token embedding stays where it lives (embedding_host). */
static void lg_model_point_frozen_unit(lg_model *m, int unit, uint8_t *whole_unit) {
    lg_frozen_unit_layout(&m->cfg, unit, m->frozen.dtype, whole_unit, 0, &m->p, NULL, NULL);
    if (unit == 0 && m->cfg.lora.host_embedding) m->p.wte = m->embedding_host;
}

/* Points the model's tensors into the regions of a rank made from a plan of this config. */
static int lg_model_bind(lg_model *m, const lg_config *cfg, lg_rank *rank, lg_error *err) {
    if (lg_model_bind_views(m, cfg, rank, err) == 0) return 0;
    lg_model_free(m); /* the tables it made */
    return -1;
}

/* The rank's backend; on the CPU, the matmul's and attention's scratch regions. */
static int lg_model_bind_exec(lg_model *m, lg_error *err) {
    const lg_plan_spec *s = &m->rank->plan->spec;
    lg_exec *ex = &m->exec;
    ex->backend = m->rank->backend;
    ex->cuda = m->rank->cuda;
    if (ex->backend == LG_BACKEND_CUDA) return 0; /* the GPU's workspace is its own region */
    if (!(ex->gemm.base = (lg_real *)lg_model_region(m, LG_REGION_GEMM_WORKSPACE, err))) return -1;
    ex->gemm.per_thread = lg_gemm_workspace_count();
    ex->gemm.threads = s->threads;
    ex->gemm.path = lg_cpu_gemm_path();
    if (!(ex->attention.base = (lg_real *)lg_model_region(m, LG_REGION_ATTENTION_SCRATCH,
                                                          err))) return -1;
    ex->attention.per_thread = 2 * (size_t)m->T * m->T;
    ex->attention.threads = s->threads;
    return 0;
}

static int lg_model_bind_views(lg_model *m, const lg_config *cfg, lg_rank *rank, lg_error *err) {
    const lg_plan_spec *s = &rank->plan->spec;
    const lg_rank_plan *rp = &rank->plan->ranks[rank->index];
    int L = cfg->n_layer;
    memset(m, 0, sizeof *m);
    if (s->T > cfg->block_size)
        return lg_fail(err, "sequence length %d exceeds the model's block_size %d", s->T,
                       cfg->block_size);
    lg_precision_types types = lg_types_of(s->precision);
    m->cfg = *cfg;
    m->cfg.lora = rank->plan->cfg.lora; /* the run's adapters */
    cfg = &m->cfg;
    m->B = s->B;
    m->T = s->T;
    m->precision = s->precision;
    m->recompute = s->recompute;
    m->offload_activations = s->offload_activations;
    m->head_rows = s->head_rows;
    m->slice_rows = s->slice_rows;
    m->rank = rank;
    m->p.h = (lg_block_tensors *)lg_alloc_zeroed(sizeof(lg_block_tensors) * L);
    m->g.h = (lg_block_tensors *)lg_alloc_zeroed(sizeof(lg_block_tensors) * L);
    m->a.h = (lg_block_acts *)lg_alloc_zeroed(sizeof(lg_block_acts) * L);
    m->a.residual = (lg_buf *)lg_alloc_zeroed(sizeof(lg_buf) * (L + 1));
    m->a.kept_host = (lg_buf *)lg_alloc_zeroed(sizeof(lg_buf) * L);
    if (!m->p.h || !m->g.h || !m->a.h || !m->a.residual || !m->a.kept_host || lg_table_alloc(&m->param_table, cfg) ||
        (cfg->lora.r > 0 && lg_table_alloc(&m->frozen_table, cfg))) /* LoRA's frozen base */
        return lg_fail(err, "out of host memory for the model's tables");
    m->n_params = lg_params_layout(cfg, lg_no_buf(), NULL, &m->param_table);
    m->weights_gathered = lg_weights_in_units(&rank->plan->sharding);
    m->grads_gathered = lg_grads_in_units(s, &rank->plan->sharding);
    m->local = &rp->pieces;
    m->n_local = rp->pieces.total;
    m->params = lg_model_view(m, LG_REGION_WEIGHTS, types.weights, err);
    if (!m->params.data) return -1;
    if (!s->offload_gradients) { /* (streamed: only unit buffers, which the trainer points at) */
        m->grads = lg_model_view(m, LG_REGION_GRADIENTS, types.grads, err);
        if (!m->grads.data) return -1;
    }
    if (!m->weights_gathered) lg_params_layout(cfg, m->params, &m->p, NULL);
    if (!m->grads_gathered) lg_params_layout(cfg, m->grads, &m->g, NULL);
    if (lg_embedding_trained_on_host(cfg)) m->embedding_host = lg_trained_embedding_view(cfg, m->params);
    if (lg_model_bind_frozen(m, types.weights, err) != 0) return -1;
    if (lg_model_bind_activations(m, types.acts, err) != 0) return -1;
    if (lg_model_bind_exec(m, err) != 0) return -1;
    int rope_dims = lg_config_rope_dims(cfg);
    if (rope_dims)
        lg_rope_tables(&m->exec, m->a.rope_cos, m->a.rope_sin, m->T, rope_dims, cfg->rope_base,
                       &cfg->rope_adjustments);
    return 0;
}

int lg_model_create(lg_model *m, const lg_config *cfg, int B, int T, lg_error *err) {
    memset(m, 0, sizeof *m);
    lg_args args;
    lg_args_default(&args);
    args.micro_batch_size = B;
    args.precision = LG_PRECISION_32_TRUE;
    args.optimizer = LG_OPTIMIZER_SGD; /* no optimizer state */
    args.momentum = 0;
    args.lora = cfg->lora; /* a config with adapters makes a LoRA model */
    lg_plan_spec spec;
    lg_plan_spec_from_args(&spec, &args, T);
    lg_plan *plan = (lg_plan *)lg_alloc_zeroed(sizeof(lg_plan));
    lg_rank *rank = (lg_rank *)lg_alloc_zeroed(sizeof(lg_rank));
    if (!plan || !rank) {
        LG_FREE(plan);
        LG_FREE(rank);
        return lg_fail(err, "out of host memory");
    }
    if (lg_plan_make(plan, cfg, &spec, err) != 0 || lg_rank_create(rank, plan, 0, err) != 0 ||
        lg_model_bind(m, cfg, rank, err) != 0) {
        lg_model_free(m);
        lg_rank_free(rank);
        lg_plan_free(plan);
        LG_FREE(rank);
        LG_FREE(plan);
        return -1;
    }
    m->own_plan = plan;
    return 0;
}

void lg_model_free(lg_model *m) {
    LG_FREE(m->p.h);
    LG_FREE(m->g.h);
    LG_FREE(m->a.h);
    LG_FREE(m->a.residual);
    LG_FREE(m->a.kept_host);
    lg_tensor_table_free(&m->param_table);
    lg_tensor_table_free(&m->frozen_table);
    if (m->own_plan) {
        lg_rank_free(m->rank);
        LG_FREE(m->rank);
        lg_plan_free(m->own_plan);
        LG_FREE(m->own_plan);
    }
    memset(m, 0, sizeof *m);
}

/* GPT-2's scheme, by tensor kind (see lg_tensor_kind): element k of tensor t, drawn from rng
   (live: the elements that draw, the rest of a padded vocabulary keeps 0). */
static lg_real lg_init_value(const lg_config *c, const lg_tensor_info *t, size_t live, size_t k,
                             lg_rng *rng) {
    switch (t->kind) {
    case LG_TENSOR_NORM: return 1;
    case LG_TENSOR_RESIDUAL: return 0.02f / sqrtf(2.0f * c->n_layer) * lg_rng_normal(rng);
    case LG_TENSOR_EMBEDDING:
    case LG_TENSOR_WEIGHT: return k < live ? 0.02f * lg_rng_normal(rng) : 0;
    case LG_TENSOR_LORA_A: /* kaiming_uniform(a = sqrt(5)): bound 1 / sqrt(in) */
        return (2.0f * lg_rng_uniform(rng) - 1.0f) / sqrtf((float)t->cols);
    default: return 0; /* biases, LoRA's B */
    }
}

/* Draws of lg_rng_u64 that lg_init_value makes for the elements before element k. */
static uint64_t lg_init_draws_before(const lg_tensor_info *t, size_t live, size_t k) {
    switch (t->kind) {
    case LG_TENSOR_RESIDUAL: return 2 * (uint64_t)k; /* a normal: two draws */
    case LG_TENSOR_EMBEDDING:
    case LG_TENSOR_WEIGHT: return 2 * (uint64_t)(k < live ? k : live);
    case LG_TENSOR_LORA_A: return k;
    default: return 0;
    }
}

#define LG_INIT_CHUNK 65536 /* elements a host thread initialises from one jump of the stream */

/* Elements first .. first + n - 1 of tensor t into piece (n), drawing from rng in order. */
static void lg_init_range(const lg_config *c, const lg_tensor_info *t, size_t live, lg_buf piece,
                          size_t first, size_t n, lg_rng *rng) {
    for (size_t j = 0; j < n; j++) lg_set(piece, j, lg_init_value(c, t, live, first + j, rng));
}

/* One tensor, w holding its elements, with the numbers of drawing from rng in element order;
   a large tensor in chunks on all host threads, each jumping to its place in the stream. */
static void lg_init_tensor(const lg_exec *ex, const lg_config *c, const lg_tensor_info *t,
                           lg_buf w, lg_rng *rng) {
    /* rows past the real vocabulary never see a token: keep them 0 */
    int is_vocab = t->kind == LG_TENSOR_EMBEDDING && t->rows == c->padded_vocab_size;
    size_t live = is_vocab ? (size_t)c->vocab_size * t->cols : t->count;
    lg_rng_jumps *jumps = NULL;
    if (t->count > LG_INIT_CHUNK && (jumps = (lg_rng_jumps *)LG_MALLOC(sizeof *jumps)))
        lg_rng_jumps_make(jumps);
    lg_visit visit = lg_visit_start(ex, w, t->count, 1, LG_VISIT_WRITE);
    while (lg_visit_next(&visit)) {
        size_t first = visit.first, n = visit.n, chunks = (n + LG_INIT_CHUNK - 1) / LG_INIT_CHUNK;
        if (!jumps || chunks < 2) {
            lg_init_range(c, t, live, visit.piece, first, n, rng);
            continue;
        }
        const lg_rng start = *rng;
        uint64_t base = lg_init_draws_before(t, live, first);
        LG_OMP(omp parallel for)
        for (long k = 0; k < (long)chunks; k++) {
            size_t at = (size_t)k * LG_INIT_CHUNK, len = n - at < LG_INIT_CHUNK ? n - at : LG_INIT_CHUNK;
            lg_rng part = start;
            lg_rng_skip(&part, jumps, lg_init_draws_before(t, live, first + at) - base);
            lg_init_range(c, t, live, lg_at(visit.piece, at), first + at, len, &part);
        }
        lg_rng_skip(rng, jumps, lg_init_draws_before(t, live, first + n) - base);
    }
    LG_FREE(jumps);
}

/* The random stream of the trainable parameters: the model's seed, or for LoRA's adapters one
   derived from it, so that the frozen base draws what the model without LoRA draws. */
static void lg_trainable_rng(const lg_config *c, uint64_t seed, lg_rng *rng) {
    lg_rng_seed(rng, c->lora.r > 0 ? seed ^ 0x4c6f5241ULL /* "LoRA" */ : seed);
}

/* bytes of host memory src into the rank's memory dst (U8), or back (to_host). */
static void lg_rank_bytes(const lg_exec *ex, lg_buf dst_or_src, void *host, size_t bytes, int to_host) {
    lg_visit v = lg_visit_start(ex, dst_or_src, bytes, 1, to_host ? LG_VISIT_READ : LG_VISIT_WRITE);
    while (lg_visit_next(&v))
        if (to_host) memcpy((uint8_t *)host + v.first, v.piece.data, v.n);
        else memcpy(v.piece.data, (const uint8_t *)host + v.first, v.n);
}

/* Where the offsets of frozen tensors point: the whole base (m->frozen, m->frozen_packed), or
   with frozen_gathered one unit's buffer (lg_frozen_unit_layout). */
typedef struct {
    lg_buf values;    /* the tensors in the weight type */
    lg_buf packed;    /* the NF4 ones (bytes) */
    lg_buf embedding; /* --offload embedding: the token embedding's own region (Vp, C) */
} lg_frozen_at;

static lg_frozen_at lg_frozen_whole(const lg_model *m) {
    lg_frozen_at at = {m->frozen, m->frozen_packed, m->embedding_host};
    return at;
}

/* Frozen unit u's tensors in the buffer `unit` (frozen_gathered). */
static lg_frozen_at lg_frozen_unit_at(const lg_model *m, int u, uint8_t *unit) {
    lg_frozen_at at = {{unit, m->frozen.dtype}, {NULL, LG_DTYPE_U8}, m->embedding_host};
    at.packed.data = unit + lg_frozen_unit_packed_at(&m->cfg, u, m->frozen.dtype, NULL);
    return at;
}

/* Where frozen tensor t, stored in the weight type, is at `at`: its offset in the values, or
   the token embedding's own region (lg_tensor_info.on_host). */
static lg_buf lg_frozen_values(lg_frozen_at at, const lg_tensor_info *t) {
    return t->on_host ? at.embedding : lg_at(at.values, t->offset);
}

/* A packed frozen tensor t (its NF4 bytes in the model's memory at `at`) from values
   (t->count). */
static int lg_pack_frozen(const lg_model *m, lg_frozen_at at, const lg_tensor_info *t,
                          lg_buf values, lg_error *err) {
    size_t bytes = lg_nf4_bytes(t->count, m->cfg.lora.quantize);
    uint8_t *packed = (uint8_t *)LG_MALLOC(bytes + 1);
    if (!packed) return lg_fail(err, "out of host memory packing %s", t->name);
    int rc = lg_nf4_quantize(values, t->count, m->cfg.lora.quantize, packed, err);
    lg_buf dst = {(uint8_t *)at.packed.data + t->offset, LG_DTYPE_U8};
    if (rc == 0) lg_rank_bytes(&m->exec, dst, packed, bytes, 0);
    LG_FREE(packed);
    return rc;
}

/* One frozen tensor: drawn as lg_init_tensor, packed in NF4 when the layout stores it so. */
static int lg_init_frozen_tensor(const lg_model *m, lg_frozen_at at, const lg_tensor_info *t,
                                 lg_rng *rng, lg_error *err) {
    if (t->packed == LG_DTYPE_F32) {
        lg_init_tensor(&m->exec, &m->cfg, t, lg_frozen_values(at, t), rng);
        return 0;
    }
    lg_real *values = (lg_real *)LG_MALLOC(t->count * sizeof(lg_real));
    if (!values) return lg_fail(err, "out of host memory initialising %s", t->name);
    lg_init_tensor(NULL, &m->cfg, t, lg_buf_of(values), rng);
    int rc = lg_pack_frozen(m, at, t, lg_buf_of(values), err);
    LG_FREE(values);
    return rc;
}

/* LoRA: the base model's initial weights, the same numbers as the model without LoRA draws
   (its random stream: lg_rng_seed(seed)). frozen_gathered: the trainer draws them unit by
   unit (lg_trainer_init_frozen_units). */
static int lg_model_init_frozen(lg_model *m, uint64_t seed, lg_error *err) {
    lg_rng rng;
    lg_rng_seed(&rng, seed);
    for (int i = 0; i < m->frozen_table.n_tensors && !m->frozen_gathered; i++)
        if (lg_init_frozen_tensor(m, lg_frozen_whole(m), &m->frozen_table.tensors[i], &rng, err) != 0)
            return -1;
    return 0;
}

int lg_model_init_weights(lg_model *m, uint64_t seed, lg_error *err) {
    lg_rng rng;
    if (lg_model_init_frozen(m, seed, err) != 0) return -1;
    lg_trainable_rng(&m->cfg, seed, &rng);
    for (int i = 0; i < m->param_table.n_tensors; i++) {
        const lg_tensor_info *t = &m->param_table.tensors[i];
        lg_init_tensor(&m->exec, &m->cfg, t, lg_at(m->params, t->offset), &rng);
    }
    return 0;
}

void lg_model_zero_grad(lg_model *m) { lg_zero(&m->exec, m->grads, m->n_local); }

/* The head's gradients (weight and bias, one beta) are written by its linear backward alone
   unless its weight is the tied embedding's, which the embedding's backward adds to as well. */
static int lg_head_grad_overwritten(const lg_config *c) { return !c->tie_embeddings; }

/* A gradient tensor: where it is and its element count. */
typedef struct {
    lg_buf at;
    size_t count;
} lg_grad_span;

#define LG_UNIT_LINEAR_GRADS 10 /* a block's most: qkv, proj, fc, fc_2, mlp.proj, each w and b */

/* The gradients of unit u (lg_unit_layout: 0 the ends, l + 1 block l) that the linear layers'
   backward writes whole, once a micro-batch, and nothing else touches: the trainable linear
   weights and biases, the head's when lg_head_grad_overwritten. Into out
   (LG_UNIT_LINEAR_GRADS); returns how many. */
static int lg_overwritten_unit_grads(const lg_model *m, int u, lg_grad_span *out) {
    const lg_config *c = &m->cfg;
    size_t C = (size_t)c->n_embd, I = (size_t)c->intermediate_size;
    size_t Vp = (size_t)c->padded_vocab_size;
    size_t QKV = (size_t)lg_config_qkv_size(c), HSN = (size_t)c->n_head * c->head_size;
    lg_grad_span all[LG_UNIT_LINEAR_GRADS];
    int n = 0, kept = 0;
    if (u == 0 && lg_head_grad_overwritten(c)) {
        all[n++] = (lg_grad_span){m->g.lm_head_w, Vp * C};
        all[n++] = (lg_grad_span){m->g.lm_head_b, Vp};
    } else if (u > 0) {
        const lg_block_tensors *g = &m->g.h[u - 1];
        all[n++] = (lg_grad_span){g->qkv_w, QKV * C};
        all[n++] = (lg_grad_span){g->qkv_b, QKV};
        all[n++] = (lg_grad_span){g->proj_w, C * HSN};
        all[n++] = (lg_grad_span){g->proj_b, C};
        all[n++] = (lg_grad_span){g->fc_w, I * C};
        all[n++] = (lg_grad_span){g->fc_b, I};
        if (c->mlp_class_name == LG_MLP_LLAMA) {
            all[n++] = (lg_grad_span){g->fc_2_w, I * C};
            all[n++] = (lg_grad_span){g->fc_2_b, I};
        }
        all[n++] = (lg_grad_span){g->mlp_proj_w, C * I};
        all[n++] = (lg_grad_span){g->mlp_proj_b, C};
    }
    for (int i = 0; i < n; i++)
        if (all[i].at.data) out[kept++] = all[i];
    return kept;
}

/* The element offset of a span inside base (both of base's type). */
static size_t lg_span_offset(lg_buf base, lg_grad_span s) {
    return (size_t)((const char *)s.at.data - (const char *)base.data) / lg_dtype_size(base.dtype);
}

/* Zeroes base from element `from` on up to each span of keep (n_keep, inside base at or past
   from; reordered by place), skipping the spans; returns where the last one ends. */
static size_t lg_zero_around(const lg_exec *ex, lg_buf base, size_t from, lg_grad_span *keep,
                             int n_keep) {
    for (int i = 1; i < n_keep; i++) /* insertion sort: a unit's handful */
        for (int j = i; j > 0 && keep[j].at.data < keep[j - 1].at.data; j--) {
            lg_grad_span t = keep[j];
            keep[j] = keep[j - 1];
            keep[j - 1] = t;
        }
    for (int i = 0; i < n_keep; i++) {
        size_t at = lg_span_offset(base, keep[i]);
        if (at > from) lg_zero(ex, lg_at(base, from), at - from);
        from = at + keep[i].count;
    }
    return from;
}

/* Zeroes base (n) from element from on. */
static void lg_zero_rest(const lg_exec *ex, lg_buf base, size_t from, size_t n) {
    if (n > from) lg_zero(ex, lg_at(base, from), n - from);
}

/* Unit u's gradients in a whole-unit buffer g (n elements, m's views pointing at it), ready
   for a backward that writes the linear layers' (grads_overwrite). */
static void lg_model_start_unit_grads(lg_model *m, int u, lg_buf g, size_t n) {
    lg_grad_span keep[LG_UNIT_LINEAR_GRADS];
    if (m->grads_add_only) {
        lg_zero(&m->exec, g, n);
        return;
    }
    size_t end = lg_zero_around(&m->exec, g, 0, keep, lg_overwritten_unit_grads(m, u, keep));
    lg_zero_rest(&m->exec, g, end, n);
}

/* Before a step's first backward, instead of lg_model_zero_grad: zeroes the gradients that
   are added to and lets the next backward write the linear layers' (a backward clears it).
   Unsharded: m->grads holds the units in order (lg_model_layout: the ends, then the blocks). */
static void lg_model_start_grads(lg_model *m) {
    if (m->grads_add_only) {
        lg_model_zero_grad(m);
        m->grads_overwrite = 0;
        return;
    }
    size_t from = 0;
    for (int u = 0; u <= m->cfg.n_layer; u++) {
        lg_grad_span keep[LG_UNIT_LINEAR_GRADS];
        int n = lg_overwritten_unit_grads(m, u, keep);
        from = lg_zero_around(&m->exec, m->grads, from, keep, n);
    }
    lg_zero_rest(&m->exec, m->grads, from, m->n_local);
    m->grads_overwrite = 1;
}

/* The linear layers' gradient beta in this backward: 0 writes (lg_overwritten_unit_grads), 1
   adds. */
static float lg_linear_grad_beta(const lg_model *m) { return m->grads_overwrite ? 0.0f : 1.0f; }

/* Points the views of one unit at device buffers holding it (lg_unit_device_layout): its
   gathered weights and/or its gradient buffer (data NULL: leave those views). A token
   embedding trained on the host keeps its weights' view there and has no gradient's view:
   the trainer scatters its gradient on the host. */
static void lg_model_point_unit(lg_model *m, int unit, lg_buf weights, lg_buf grads) {
    if (weights.data) lg_unit_device_layout(&m->cfg, unit, weights, &m->p);
    if (grads.data) lg_unit_device_layout(&m->cfg, unit, grads, &m->g);
    if (weights.data && lg_unit_host_part(&m->cfg, unit)) m->p.wte = m->embedding_host;
}

static lg_real *lg_norm_mean_or_null(const lg_config *c, lg_real *mean) {
    return c->norm_class_name == LG_NORM_LAYERNORM ? mean : NULL;
}

/* LoRA ------------------------------------------------------------------------------------- */

/* One adapter of a linear whose output is (N, OC): its tensors and the columns it adds to. */
typedef struct {
    lg_buf a, b;     /* (r, in), (out, r) */
    lg_buf da, db;   /* their gradients (data NULL outside a backward) */
    lg_buf h;        /* (N, r): u A^T, kept for the backward */
    int column, out; /* it writes out[:, column .. column + out) */
} lg_lora_adapter;

/* The adapters of a linear: Q, K and V share attn.qkv (and its input and dropout mask); every
   other linear has one. Returns how many are targeted; fills ad. */
static int lg_block_adapters(const lg_model *m, int l, lg_lora_linear first, int row0,
                             lg_lora_adapter *ad) {
    const lg_config *c = &m->cfg;
    int n = 0;
    int last = first == LG_LORA_Q ? LG_LORA_V : first;
    for (int k = first; k <= last; k++) {
        int in, out;
        if (!lg_lora_adapts(c, (lg_lora_linear)k)) continue;
        lg_lora_dims(c, (lg_lora_linear)k, &in, &out);
        lg_lora_adapter *x = &ad[n++];
        x->a = m->p.h[l].lora_a[k];
        x->b = m->p.h[l].lora_b[k];
        x->da = m->g.h[l].lora_a[k];
        x->db = m->g.h[l].lora_b[k];
        x->h = lg_at(m->a.h[l].lora_h[k], (size_t)row0 * c->lora.r);
        x->column = lg_lora_first_row(c, (lg_lora_linear)k);
        x->out = out;
    }
    return n;
}

/* The head's adapter (0 or 1). */
static int lg_head_adapters(const lg_model *m, lg_lora_adapter *ad) {
    if (!m->p.lm_head_lora_a.data) return 0;
    ad->a = m->p.lm_head_lora_a;
    ad->b = m->p.lm_head_lora_b;
    ad->da = m->g.lm_head_lora_a;
    ad->db = m->g.lm_head_lora_b;
    ad->h = m->a.lm_head_lora_h;
    ad->column = 0;
    ad->out = m->cfg.padded_vocab_size;
    return 1;
}

/* The dropout key of linear k of block l (the head: l = L) in this micro-batch; 0: none. */
static uint64_t lg_lora_key(const lg_model *m, int l, int k) {
    if (!m->dropout_key || m->cfg.lora.dropout <= 0.0f) return 0;
    return m->dropout_key ^ ((uint64_t)(l * LG_LORA_BLOCK_LINEARS + k + 1) * 0xD1B54A32D192ED03ull);
}

static float lg_lora_scale(const lg_config *c) { return c->lora.alpha / (float)c->lora.r; }

/* Each adapter's h (N, r) = u A^T, u = (alpha / r) dropout(inp) of inp (N, IC), the rows from
   row0 of the linear's input (dropout's mask is the whole input's): the forward's first half,
   kept for the backward. */
static void lg_lora_hidden(lg_model *m, const lg_lora_adapter *ad, int n, uint64_t key, int row0,
                           lg_buf inp, int N, int IC) {
    const lg_exec *ex = &m->exec;
    lg_buf u = m->a.lora_u;
    if (n == 0) return;
    lg_lora_input(ex, u, inp, (size_t)N * IC, (size_t)row0 * IC, lg_lora_scale(&m->cfg),
                  m->cfg.lora.dropout, key, 0);
    for (int k = 0; k < n; k++)
        lg_matmul(ex, 0, 1, N, m->cfg.lora.r, IC, u, IC, ad[k].a, IC, 0, ad[k].h, m->cfg.lora.r);
}

/* out (N, OC) += (alpha / r) B A dropout(inp) for each adapter in its columns: h as above,
   then out += h B^T. */
static void lg_lora_forward(lg_model *m, const lg_lora_adapter *ad, int n, uint64_t key, int row0,
                            lg_buf out, int OC, lg_buf inp, int N, int IC) {
    int r = m->cfg.lora.r;
    lg_lora_hidden(m, ad, n, key, row0, inp, N, IC);
    for (int k = 0; k < n; k++)
        lg_matmul(&m->exec, 0, 1, N, ad[k].out, r, ad[k].h, r, ad[k].b, r, 1,
                  lg_at(out, ad[k].column), OC);
}

/* The adapters' backward from dout (N, OC) (rows from row0, as the forward): dB += dy^T h,
   dh = dy B, dA += dh^T u, du = sum of dh A, and dinp (N, IC) += (alpha / r) dropout(du) with
   the forward's mask. */
static void lg_lora_backward(lg_model *m, const lg_lora_adapter *ad, int n, uint64_t key,
                             int row0, lg_buf dout, int OC, lg_buf inp, lg_buf dinp, int N,
                             int IC) {
    const lg_exec *ex = &m->exec;
    int r = m->cfg.lora.r;
    float scale = lg_lora_scale(&m->cfg), p = m->cfg.lora.dropout;
    size_t first = (size_t)row0 * IC;
    if (n == 0) return;
    lg_buf u = m->a.lora_u, du = m->a.lora_du, dh = m->a.lora_dh;
    lg_lora_input(ex, u, inp, (size_t)N * IC, first, scale, p, key, 0); /* the forward's u again */
    for (int k = 0; k < n; k++) {
        lg_buf dy = lg_at(dout, ad[k].column); /* (N, out) with row stride OC */
        lg_matmul(ex, 1, 0, ad[k].out, r, N, dy, OC, ad[k].h, r, 1, ad[k].db, r);
        lg_matmul(ex, 0, 0, N, r, ad[k].out, dy, OC, ad[k].b, r, 0, dh, r);
        lg_matmul(ex, 1, 0, r, IC, N, dh, r, u, IC, 1, ad[k].da, IC);
        lg_matmul(ex, 0, 0, N, IC, r, dh, r, ad[k].a, IC, k == 0 ? 0.0f : 1.0f, du, IC);
    }
    lg_lora_input(ex, dinp, du, (size_t)N * IC, first, scale, p, key, 1);
}

/* A block linear's adapters over rows row0 .. row0 + N of its input (a slice of the MLP, or
   all), forward: out (N, OC) of the linear `first` with input inp (N, IC). */
static void lg_block_lora_forward(lg_model *m, int l, lg_lora_linear first, int row0, lg_buf out,
                                  int OC, lg_buf inp, int N, int IC) {
    lg_lora_adapter ad[3];
    if (m->cfg.lora.r == 0) return;
    int n = lg_block_adapters(m, l, first, row0, ad);
    lg_lora_forward(m, ad, n, lg_lora_key(m, l, first), row0, out, OC, inp, N, IC);
}

/* The adapters' h of a block linear over rows row0 .. row0 + N (as lg_block_lora_forward
   leaves it), for a backward whose forward's h has been overwritten. */
static void lg_block_lora_hidden(lg_model *m, int l, lg_lora_linear first, int row0, lg_buf inp,
                                 int N, int IC) {
    lg_lora_adapter ad[3];
    if (m->cfg.lora.r == 0) return;
    int n = lg_block_adapters(m, l, first, row0, ad);
    lg_lora_hidden(m, ad, n, lg_lora_key(m, l, first), row0, inp, N, IC);
}

static void lg_block_lora_backward(lg_model *m, int l, lg_lora_linear first, int row0,
                                   lg_buf dout, int OC, lg_buf inp, lg_buf dinp, int N, int IC) {
    lg_lora_adapter ad[3];
    if (m->cfg.lora.r == 0) return;
    int n = lg_block_adapters(m, l, first, row0, ad);
    lg_lora_backward(m, ad, n, lg_lora_key(m, l, first), row0, dout, OC, inp, dinp, N, IC);
}

/* Block l up to its MLP: attention into x_mid (with the residual), and the MLP's input norm. */
static void lg_block_attention_forward(lg_model *m, int l, int B, int T) {
    const lg_config *c = &m->cfg;
    const lg_block_tensors *w = &m->p.h[l];
    lg_block_acts *a = &m->a.h[l];
    const lg_exec *ex = &m->exec;
    int N = B * T, C = c->n_embd, QKV = lg_config_qkv_size(c);
    int NH = c->n_head, NQG = c->n_query_groups, HS = c->head_size;
    lg_buf x = m->a.residual[l];

    lg_norm_forward(ex, a->n1, lg_norm_mean_or_null(c, a->n1_mean), a->n1_rstd, x, w->norm_1_w,
                    w->norm_1_b, N, C, c->norm_eps);
    lg_linear_forward(ex, a->qkv, a->n1, w->qkv_w, w->qkv_b, N, C, QKV);
    lg_block_lora_forward(m, l, LG_LORA_Q, 0, a->qkv, QKV, a->n1, N, C);
    lg_rope_rotate(ex, a->qkv, m->a.rope_cos, m->a.rope_sin, B, T, NH, NQG, HS,
                   lg_config_rope_dims(c), +1, m->span_start);
    lg_attention_forward(ex, a->att_y, a->att_lse, a->qkv, B, T, NH, NQG, HS, m->span_start);
    lg_linear_forward(ex, a->x_mid, a->att_y, w->proj_w, w->proj_b, N, NH * HS, C);
    lg_block_lora_forward(m, l, LG_LORA_PROJ, 0, a->x_mid, C, a->att_y, N, NH * HS);

    /* x_mid = x + attention; the MLP reads the norm of x (parallel), of x_mid, or n1 (shared) */
    lg_real *n2_mean = lg_norm_mean_or_null(c, a->n2_mean);
    if (c->shared_attention_norm || c->parallel_residual) {
        lg_add(ex, a->x_mid, a->x_mid, x, (size_t)N * C);
        if (!c->shared_attention_norm)
            lg_norm_forward(ex, a->n2, n2_mean, a->n2_rstd, x, w->norm_2_w, w->norm_2_b, N, C,
                            c->norm_eps);
    } else {
        lg_residual_norm_forward(ex, a->x_mid, a->n2, n2_mean, a->n2_rstd, a->x_mid, x,
                                 w->norm_2_w, w->norm_2_b, N, C, c->norm_eps);
    }
}

/* The rows a block's MLP works on at a time (all N, or the plan's slice), and their count
   from row n0. */
static int lg_slice_rows(const lg_model *m, int N) { return m->slice_rows < N ? m->slice_rows : N; }
static int lg_slice_at(const lg_model *m, int N, int n0) {
    return N - n0 < lg_slice_rows(m, N) ? N - n0 : lg_slice_rows(m, N);
}

/* Block l's MLP input: the norm of x (parallel), of x_mid, or n1 (shared). */
static lg_buf lg_block_mlp_in(const lg_model *m, int l) {
    return m->cfg.shared_attention_norm ? m->a.h[l].n1 : m->a.h[l].n2;
}

/* Block l's MLP hidden layer over rows n0 .. n0 + rows of its input: fc (and fc_2) and their
   activation act, each (rows, I), in the block's MLP buffers. */
static void lg_block_mlp_hidden(lg_model *m, int l, int n0, int rows) {
    const lg_config *c = &m->cfg;
    const lg_block_tensors *w = &m->p.h[l];
    lg_block_acts *a = &m->a.h[l];
    const lg_exec *ex = &m->exec;
    int C = c->n_embd, I = c->intermediate_size;
    lg_buf in = lg_at(lg_block_mlp_in(m, l), (size_t)n0 * C);
    lg_linear_forward(ex, a->fc, in, w->fc_w, w->fc_b, rows, C, I);
    lg_block_lora_forward(m, l, LG_LORA_FC, n0, a->fc, I, in, rows, C);
    if (c->mlp_class_name == LG_MLP_LLAMA) {
        lg_linear_forward(ex, a->fc_2, in, w->fc_2_w, w->fc_2_b, rows, C, I);
        lg_block_lora_forward(m, l, LG_LORA_FC_2, n0, a->fc_2, I, in, rows, C);
        lg_swiglu_forward(ex, a->act, a->fc, a->fc_2, (size_t)rows * I);
    } else {
        lg_gelu_forward(ex, a->act, a->fc, (size_t)rows * I, c->gelu_approximate_tanh);
    }
}

/* Block l's MLP over rows n0 .. n0 + rows: out's rows (residual[l + 1]) = x_mid's + mlp_proj
   of the hidden layer. */
static void lg_block_mlp_forward(lg_model *m, int l, int n0, int rows) {
    const lg_config *c = &m->cfg;
    const lg_block_tensors *w = &m->p.h[l];
    const lg_block_acts *a = &m->a.h[l];
    int C = c->n_embd, I = c->intermediate_size;
    lg_buf out = lg_at(m->a.residual[l + 1], (size_t)n0 * C);
    lg_block_mlp_hidden(m, l, n0, rows);
    lg_linear_forward(&m->exec, out, a->act, w->mlp_proj_w, w->mlp_proj_b, rows, I, C);
    lg_block_lora_forward(m, l, LG_LORA_MLP_PROJ, n0, out, C, a->act, rows, I);
    lg_add(&m->exec, out, out, lg_at(a->x_mid, (size_t)n0 * C), (size_t)rows * C);
}

/* One block: residual[l] (B, T, C) -> residual[l + 1], the MLP a slice at a time. */
static void lg_block_forward(lg_model *m, int l, int B, int T) {
    int N = B * T;
    lg_block_attention_forward(m, l, B, T);
    for (int n0 = 0; n0 < N; n0 += lg_slice_rows(m, N)) lg_block_mlp_forward(m, l, n0, lg_slice_at(m, N, n0));
}

/* --offload activations: the compute waits until the last copy into or out of a slot has
   landed (skipped by tests that show a missing wait fails). */
static void lg_model_kept_wait(lg_model *m, int slot) {
    if (!m->skip_kept_waits) lg_wait_beside(&m->exec, slot);
}

/* Block l in the forward; with --offload activations its output goes to host memory on the
   copy stream beside the next block, and its slot is written once the copy that left it two
   blocks back has landed (the compute waits for that copy alone, not for block l - 1's). */
static void lg_model_block_forward(lg_model *m, int l, int B, int T) {
    size_t NC = (size_t)B * T * m->cfg.n_embd;
    int slot = l % LG_KEPT_SLOTS;
    if (lg_model_kept_on_host(m, l) && l >= LG_KEPT_SLOTS) lg_model_kept_wait(m, slot);
    lg_block_forward(m, l, B, T);
    if (lg_model_kept_on_host(m, l)) {
        lg_copy_beside(&m->exec, m->a.kept_host[l], m->a.residual[l + 1], NC);
        lg_mark_beside(&m->exec, slot);
    }
}

/* rows (N, C) = wte[tokens] on the host, converted to the rows' type as the embedding's
   kernels convert; tokens (N), wte (Vp, C) in host memory. */
static void lg_embedding_gather_rows(lg_buf rows, const int *tokens, lg_buf wte, int N, int C) {
    size_t row_bytes = (size_t)C * lg_elem_size(rows.dtype);
    LG_OMP(omp parallel for)
    for (int n = 0; n < N; n++) {
        lg_buf to = lg_at(rows, (size_t)n * C), from = lg_at(wte, (size_t)tokens[n] * C);
        if (rows.dtype == wte.dtype) {
            memcpy(to.data, from.data, row_bytes);
            continue;
        }
        for (int i = 0; i < C; i++) lg_set(to, i, lg_get(from, i));
    }
}

/* --offload embedding: the micro-batch's rows of the host's table gathered into
   embedding_rows once the copy of the last ones has left them, then copied beside the compute
   into residual[0] (after the ops queued so far, its last readers among them); the compute
   waits for that copy alone. Tests skip the compute's wait to show it matters. */
static void lg_model_embed_from_host(lg_model *m, const int *tokens, int B, int T) {
    int N = B * T, C = m->cfg.n_embd;
    lg_finish_beside(&m->exec, LG_BESIDE_EMBEDDING);
    lg_embedding_gather_rows(m->embedding_rows, tokens, m->embedding_host, N, C);
    lg_copy_beside(&m->exec, m->a.residual[0], m->embedding_rows, (size_t)N * C);
    lg_mark_beside(&m->exec, LG_BESIDE_EMBEDDING);
    if (!m->skip_kept_waits) lg_wait_beside(&m->exec, LG_BESIDE_EMBEDDING);
}

/* The forward in three parts (embedding, blocks, head), so that a sharded trainer can gather
   each unit's weights in between. */
static void lg_model_embed(lg_model *m, const int *tokens, int B, int T) {
    if (m->cfg.lora.host_embedding) {
        lg_model_embed_from_host(m, tokens, B, T);
        return;
    }
    lg_embedding_forward(&m->exec, m->a.residual[0], tokens, m->p.wte, m->p.wpe, B, T, m->cfg.n_embd,
                         m->span_start);
}

/* Targets (n) that count towards the loss: all but LG_IGNORE_INDEX. */
static long lg_count_targets(const int *targets, size_t n) {
    long count = 0;
    for (size_t k = 0; k < n; k++) count += targets[k] != LG_IGNORE_INDEX;
    return count;
}

/* The head's rows of logits at a time (all N = B x T of them, or the plan's chunk), and the
   first row of the last chunk: the rows a forward without targets computes. */
static int lg_head_chunk_rows(const lg_model *m, int N) { return m->head_rows < N ? m->head_rows : N; }
static int lg_head_last_chunk(const lg_model *m, int N) {
    return (N - 1) / lg_head_chunk_rows(m, N) * lg_head_chunk_rows(m, N);
}

/* The head's adapter (0 or 1) for the chunk of rows from n0: its h at that row. */
static int lg_head_chunk_adapters(const lg_model *m, int n0, lg_lora_adapter *head) {
    int n = lg_head_adapters(m, head);
    if (n) head->h = lg_at(head->h, (size_t)n0 * m->cfg.lora.r);
    return n;
}

/* lm_head (Vp, C) as a pass of the head over its chunks uses it: an NF4 head that one tile
   holds (lg_head_tile_rows) dequantized now, once for the pass, into the exec's workspace (no
   other matmul of the frozen weights runs before the pass ends); an NF4 head of several tiles
   stays NF4, each chunk's matmuls dequantizing it a tile at a time; any other as it is. */
static lg_buf lg_head_pass_weight(const lg_model *m) {
    const lg_config *c = &m->cfg;
    lg_buf w = m->p.lm_head_w;
    if (lg_quantization_of(w) == LG_QUANTIZE_NONE || lg_head_tile_rows(c) < c->padded_vocab_size)
        return w;
    return lg_matmul_weight(&m->exec, w, c->padded_vocab_size, c->n_embd);
}

/* The NF4 lm_head's tile of vocabulary rows from v0 (its *n rows: lg_head_tile_rows, fewer at
   the end), dequantized into the exec's workspace: (n, C). */
static lg_buf lg_head_tile_weight(const lg_model *m, int v0, int *n) {
    const lg_config *c = &m->cfg;
    int Vp = c->padded_vocab_size, tile = lg_head_tile_rows(c);
    *n = Vp - v0 < tile ? Vp - v0 : tile;
    return lg_matmul_weight_rows(&m->exec, m->p.lm_head_w, Vp, c->n_embd, v0, *n);
}

/* The logits (rows, Vp) = in (rows, C) lm_head^T + bias by an NF4 lm_head (Vp, C), a tile of
   vocabulary rows at a time: each tile (n, C) dequantized into the exec's workspace, its
   matmul writing its columns v0 .. v0 + n of the logits region (each logit the same sum as in
   one matmul over the whole head). */
static void lg_head_tiles_forward(lg_model *m, lg_buf in, int rows) {
    const lg_exec *ex = &m->exec;
    int C = m->cfg.n_embd, Vp = m->cfg.padded_vocab_size;
    for (int v0 = 0, n; v0 < Vp; v0 += n) {
        lg_buf w = lg_head_tile_weight(m, v0, &n); /* (n, C) */
        lg_buf bias = m->p.lm_head_b.data ? lg_at(m->p.lm_head_b, (size_t)v0) : lg_no_buf();
        lg_linear_forward_into(ex, lg_at(m->a.logits, (size_t)v0), Vp, in, w, bias, rows, C, n);
    }
}

/* The logits (rows, Vp) of ln_f's rows n0 .. n0 + rows by head_w (lg_head_pass_weight), with
   the head's adapter, into the logits region. */
static void lg_head_chunk_logits(lg_model *m, int n0, int rows, lg_buf head_w) {
    const lg_config *c = &m->cfg;
    int C = c->n_embd, Vp = c->padded_vocab_size;
    lg_buf in = lg_at(m->a.ln_f, (size_t)n0 * C);
    if (lg_quantization_of(head_w) != LG_QUANTIZE_NONE) lg_head_tiles_forward(m, in, rows);
    else lg_linear_forward(&m->exec, m->a.logits, in, head_w, m->p.lm_head_b, rows, C, Vp);
    lg_lora_adapter head;
    int n = lg_head_chunk_adapters(m, n0, &head);
    lg_lora_forward(m, &head, n, lg_lora_key(m, c->n_layer, 0), n0, m->a.logits, Vp, in, rows, C);
}

/* Final norm, logits and, with targets, the summed loss, a chunk of rows at a time (the last
   chunk's logits stay in the region). Without targets only the last chunk is computed: a
   generation reads the last position. In a training step with all N rows in one chunk the
   logits are replaced by their gradient (lg_crossentropy_fused). */
static double lg_model_head_forward(lg_model *m, const int *targets, int B, int T,
                                    int *n_targets) {
    const lg_config *c = &m->cfg;
    const lg_exec *ex = &m->exec;
    int N = B * T, C = c->n_embd, L = c->n_layer, H = lg_head_chunk_rows(m, N);
    int V = c->vocab_size, Vp = c->padded_vocab_size;
    lg_norm_forward(ex, m->a.ln_f, lg_norm_mean_or_null(c, m->a.ln_f_mean), m->a.ln_f_rstd,
                    m->a.residual[L], m->p.ln_f_w, m->p.ln_f_b, N, C, c->norm_eps);
    if (n_targets) *n_targets = targets ? (int)lg_count_targets(targets, (size_t)N) : 0;
    m->logits_hold_grad = targets && H == N && m->fused_loss_scale > 0.0f;
    double total = 0;
    lg_buf head_w = lg_head_pass_weight(m);
    for (int n0 = targets ? 0 : lg_head_last_chunk(m, N); n0 < N; n0 += H) {
        int rows = N - n0 < H ? N - n0 : H;
        lg_head_chunk_logits(m, n0, rows, head_w);
        if (!targets) continue;
        if (m->logits_hold_grad)
            total += lg_crossentropy_fused(ex, m->a.losses + n0, m->a.logits, targets + n0, rows,
                                           V, Vp, m->fused_loss_scale);
        else
            total += lg_crossentropy_forward(ex, m->a.losses + n0, m->a.logits, targets + n0,
                                             rows, V, Vp);
    }
    return total;
}

/* Row n of the logits after a forward of N tokens without targets: a row of the last chunk. */
static lg_buf lg_head_logits_row(const lg_model *m, int N, int n) {
    return lg_at(m->a.logits, (size_t)(n - lg_head_last_chunk(m, N)) * m->cfg.padded_vocab_size);
}

double lg_model_forward(lg_model *m, const int *tokens, const int *targets, int B, int T,
                        int *n_targets) {
    lg_model_embed(m, tokens, B, T);
    for (int l = 0; l < m->cfg.n_layer; l++) lg_model_block_forward(m, l, B, T);
    return lg_model_head_forward(m, targets, B, T, n_targets);
}

/* Block l's MLP backward over rows n0 .. n0 + rows from d_out (B, T, C), its hidden layer in
   the MLP buffers: d_norm's rows written, the weights' gradients at grad_beta (0 writes, 1
   adds; the later slices add), the adapters' added. */
static void lg_block_mlp_backward(lg_model *m, int l, int n0, int rows, lg_buf d_out,
                                  float grad_beta) {
    const lg_config *c = &m->cfg;
    const lg_block_tensors *w = &m->p.h[l], *g = &m->g.h[l];
    const lg_block_acts *a = &m->a.h[l];
    const lg_act_tensors *s = &m->a;
    const lg_exec *ex = &m->exec;
    int C = c->n_embd, I = c->intermediate_size;
    size_t RI = (size_t)rows * I;
    lg_buf dy = lg_at(d_out, (size_t)n0 * C), in = lg_at(lg_block_mlp_in(m, l), (size_t)n0 * C);
    lg_buf d_in = lg_at(s->d_norm, (size_t)n0 * C);
    lg_linear_backward(ex, s->d_act, g->mlp_proj_w, g->mlp_proj_b, dy, a->act, w->mlp_proj_w,
                       rows, I, C, 0.0f, grad_beta);
    lg_block_lora_backward(m, l, LG_LORA_MLP_PROJ, n0, dy, C, a->act, s->d_act, rows, I);
    float fc_inp_beta = 0.0f; /* d_norm: the first of the MLP's inputs' gradients writes */
    if (c->mlp_class_name == LG_MLP_LLAMA) {
        lg_swiglu_backward(ex, s->d_fc, s->d_fc_2, s->d_act, a->fc, a->fc_2, RI);
        lg_linear_backward(ex, d_in, g->fc_2_w, g->fc_2_b, s->d_fc_2, in, w->fc_2_w, rows, C, I,
                           0.0f, grad_beta);
        lg_block_lora_backward(m, l, LG_LORA_FC_2, n0, s->d_fc_2, I, in, d_in, rows, C);
        fc_inp_beta = 1.0f;
    } else {
        lg_gelu_backward(ex, s->d_fc, s->d_act, a->fc, RI, c->gelu_approximate_tanh);
    }
    lg_linear_backward(ex, d_in, g->fc_w, g->fc_b, s->d_fc, in, w->fc_w, rows, C, I,
                       fc_inp_beta, grad_beta);
    lg_block_lora_backward(m, l, LG_LORA_FC, n0, s->d_fc, I, in, d_in, rows, C);
}

/* One block backward: d_out (B, T, C) is the gradient of residual[l + 1]; writes the gradient
   of residual[l] into d_x and adds the block's parameter gradients. */
static void lg_block_backward(lg_model *m, int l, int B, int T, lg_buf d_out, lg_buf d_x) {
    const lg_config *c = &m->cfg;
    const lg_block_tensors *w = &m->p.h[l];
    const lg_block_tensors *g = &m->g.h[l];
    const lg_block_acts *a = &m->a.h[l];
    const lg_act_tensors *s = &m->a; /* the backward's working set */
    const lg_exec *ex = &m->exec;
    int N = B * T, C = c->n_embd, QKV = lg_config_qkv_size(c);
    int NH = c->n_head, NQG = c->n_query_groups, HS = c->head_size;
    size_t NC = (size_t)N * C;
    lg_buf x = m->a.residual[l];
    float beta = lg_linear_grad_beta(m); /* the weights' and biases' gradients */

    /* out = x_mid + mlp(mlp_in): the residual passes d_out to x_mid unchanged; the MLP a
       slice at a time, each slice's hidden layer computed again when it is not whole, with
       mlp_proj's adapter's h (under --recompute block this block's forward was not run again
       in full, so the h in its buffer is another block's) */
    lg_copy(ex, s->d_mid, d_out, NC);
    for (int n0 = 0; n0 < N; n0 += lg_slice_rows(m, N)) {
        int rows = lg_slice_at(m, N, n0);
        if (lg_slice_rows(m, N) < N) {
            lg_block_mlp_hidden(m, l, n0, rows);
            lg_block_lora_hidden(m, l, LG_LORA_MLP_PROJ, n0, a->act, rows, c->intermediate_size);
        }
        lg_block_mlp_backward(m, l, n0, rows, d_out, n0 ? 1.0f : beta);
    }

    /* the MLP's input norm: of x (parallel) or of x_mid (sequential); shared: d_norm stays and
       joins norm_1's gradient below */
    lg_copy(ex, d_x, s->d_mid, NC); /* x_mid = x + attn: x receives d_mid */
    if (!c->shared_attention_norm) {
        lg_norm_backward(ex, c->parallel_residual ? d_x : s->d_mid, g->norm_2_w, g->norm_2_b,
                         s->d_norm, c->parallel_residual ? x : a->x_mid, w->norm_2_w,
                         lg_norm_mean_or_null(c, a->n2_mean), a->n2_rstd, N, C);
        if (!c->parallel_residual) lg_copy(ex, d_x, s->d_mid, NC);
    }

    /* x_mid = x + proj(attention(rope(qkv(n1)))) */
    lg_linear_backward(ex, s->d_att_y, g->proj_w, g->proj_b, s->d_mid, a->att_y, w->proj_w, N,
                       NH * HS, C, 0.0f, beta);
    lg_block_lora_backward(m, l, LG_LORA_PROJ, 0, s->d_mid, C, a->att_y, s->d_att_y, N, NH * HS);
    lg_zero(ex, s->d_qkv, (size_t)N * QKV);
    lg_attention_backward(ex, s->d_qkv, s->d_att_y, a->att_y, a->qkv, a->att_lse, B, T, NH,
                          NQG, HS, m->span_start);
    lg_rope_rotate(ex, s->d_qkv, m->a.rope_cos, m->a.rope_sin, B, T, NH, NQG, HS,
                   lg_config_rope_dims(c), -1, m->span_start);
    /* n1 feeds qkv and, when shared, the MLP: d_norm already holds the MLP's share (added to);
       else qkv's is the first (written) */
    lg_linear_backward(ex, s->d_norm, g->qkv_w, g->qkv_b, s->d_qkv, a->n1, w->qkv_w, N, C, QKV,
                       c->shared_attention_norm ? 1.0f : 0.0f, beta);
    lg_block_lora_backward(m, l, LG_LORA_Q, 0, s->d_qkv, QKV, a->n1, s->d_norm, N, C);
    lg_norm_backward(ex, d_x, g->norm_1_w, g->norm_1_b, s->d_norm, x, w->norm_1_w,
                     lg_norm_mean_or_null(c, a->n1_mean), a->n1_rstd, N, C);
}

/* The gradient of residual[k] (B, T, C) during the backward: the two working buffers take
   turns, the head's output gradient in d_res_a. */
static lg_buf lg_residual_grad(const lg_model *m, int k) {
    return (m->cfg.n_layer - k) % 2 == 0 ? m->a.d_res_a : m->a.d_res_b;
}

/* d_in (rows, C) = d_logits (rows, Vp) lm_head by a frozen NF4 lm_head (Vp, C), a tile of
   vocabulary rows at a time: each tile (n, C) dequantized into the exec's workspace, its
   matmul reading its columns v0 .. v0 + n of the logits region's gradient and adding into d_in
   (the first tile writes). The tiles split the sum over the vocabulary where the CPU gemm's K
   blocks do (LG_HEAD_TILE_ALIGN): the whole head's sums, bit for bit. */
static void lg_head_tiles_backward(lg_model *m, lg_buf d_in, int rows) {
    const lg_exec *ex = &m->exec;
    int C = m->cfg.n_embd, Vp = m->cfg.padded_vocab_size;
    for (int v0 = 0, n; v0 < Vp; v0 += n) {
        lg_buf w = lg_head_tile_weight(m, v0, &n); /* (n, C) */
        lg_matmul(ex, 0, 0, rows, C, n, lg_at(m->a.logits, (size_t)v0), Vp, w, C,
                  v0 ? 1.0f : 0.0f, d_in, C);
    }
}

/* The head's backward over ln_f's rows n0 .. n0 + rows from their logits' gradient (in the
   logits region) by head_w (lg_head_pass_weight): d_norm's rows written, lm_head's gradient at
   grad_beta (0 writes, 1 adds; an NF4 head is frozen), the adapter's added. */
static void lg_head_chunk_backward(lg_model *m, int n0, int rows, float grad_beta,
                                   lg_buf head_w) {
    const lg_config *c = &m->cfg;
    int C = c->n_embd, Vp = c->padded_vocab_size;
    lg_buf in = lg_at(m->a.ln_f, (size_t)n0 * C), d_in = lg_at(m->a.d_norm, (size_t)n0 * C);
    if (lg_quantization_of(head_w) != LG_QUANTIZE_NONE)
        lg_head_tiles_backward(m, d_in, rows);
    else
        lg_linear_backward(&m->exec, d_in, m->g.lm_head_w, m->g.lm_head_b, m->a.logits, in,
                           head_w, rows, C, Vp, 0.0f, grad_beta);
    lg_lora_adapter head;
    int n = lg_head_chunk_adapters(m, n0, &head);
    lg_lora_backward(m, &head, n, lg_lora_key(m, c->n_layer, 0), n0, m->a.logits, Vp, in, d_in,
                     rows, C);
}

/* The backward in three parts, mirroring the forward's. The head's chunks go last first: the
   forward left the last one's logits in the region, the others are computed again. */
static void lg_model_head_backward(lg_model *m, const int *targets, int B, int T,
                                   float loss_scale) {
    const lg_config *c = &m->cfg;
    const lg_exec *ex = &m->exec;
    int N = B * T, C = c->n_embd, L = c->n_layer, H = lg_head_chunk_rows(m, N);
    float beta = lg_head_grad_overwritten(c) ? lg_linear_grad_beta(m) : 1.0f;
    lg_buf head_w = lg_head_pass_weight(m);
    for (int n0 = lg_head_last_chunk(m, N); n0 >= 0; n0 -= H) {
        int rows = N - n0 < H ? N - n0 : H;
        if (n0 + H < N) lg_head_chunk_logits(m, n0, rows, head_w);
        if (!m->logits_hold_grad) /* else the forward wrote them at the same loss_scale */
            lg_crossentropy_backward(ex, m->a.logits, m->a.logits, targets + n0, rows,
                                     c->vocab_size, c->padded_vocab_size, loss_scale);
        lg_head_chunk_backward(m, n0, rows, beta, head_w);
        beta = 1.0f; /* the later chunks add to lm_head's gradient */
    }
    m->logits_hold_grad = 0;
    lg_buf d_res = lg_residual_grad(m, L);
    lg_zero(ex, d_res, (size_t)N * C);
    lg_norm_backward(ex, d_res, m->g.ln_f_w, m->g.ln_f_b, m->a.d_norm, m->a.residual[L], m->p.ln_f_w,
                     lg_norm_mean_or_null(c, m->a.ln_f_mean), m->a.ln_f_rstd, N, C);
}

/* --offload activations, before block l's backward: its input (block l - 1's output, fetched
   during block l + 1's backward) has landed in its slot (the compute waits for that fetch
   alone), and block l - 2's output starts back into the slot block l + 1 has finished with,
   beside block l's compute. The last block's input is still in its slot from the forward, and
   so is the one before it (block L - 3's output: no later block's output went to its slot),
   which is not fetched again. */
static void lg_model_kept_fetch(lg_model *m, int l, int B, int T) {
    size_t NC = (size_t)B * T * m->cfg.n_embd;
    int L = m->cfg.n_layer, ahead = l - LG_KEPT_SLOTS; /* whose backward comes after the next */
    if (l >= 1 && l < L - 1 && lg_model_kept_on_host(m, l - 1))
        lg_model_kept_wait(m, (l - 1) % LG_KEPT_SLOTS);
    int still_there = ahead + LG_KEPT_SLOTS > L - 2; /* the slot's last output in the forward */
    if (ahead >= 0 && lg_model_kept_on_host(m, ahead) && !still_there) {
        lg_copy_beside(&m->exec, m->a.kept_slot[ahead % LG_KEPT_SLOTS], m->a.kept_host[ahead], NC);
        lg_mark_beside(&m->exec, ahead % LG_KEPT_SLOTS);
    }
}

static void lg_model_block_backward(lg_model *m, int l, int B, int T) {
    int L = m->cfg.n_layer;
    lg_buf out = m->a.residual[l + 1];
    lg_model_kept_fetch(m, l, B, T);
    /* with its output kept on the host, the recompute writes it into the head's input, read
       no more, so that the slot stays free for the input arriving */
    if (lg_model_kept_on_host(m, l)) m->a.residual[l + 1] = m->a.residual[L];
    /* rebuild what the backward reads: the block, or with the MLP in slices the attention
       (the backward computes each slice's hidden layer again itself) */
    if (m->recompute && lg_slice_rows(m, B * T) < B * T) lg_block_attention_forward(m, l, B, T);
    else if (m->recompute) lg_block_forward(m, l, B, T);
    m->a.residual[l + 1] = out;
    lg_block_backward(m, l, B, T, lg_residual_grad(m, l + 1), lg_residual_grad(m, l));
}

static void lg_model_embed_backward(lg_model *m, const int *tokens, int B, int T) {
    if (!m->g.wte.data) return; /* frozen (LoRA) */
    lg_embedding_backward(&m->exec, m->g.wte, m->g.wpe, lg_residual_grad(m, 0), tokens, B, T,
                          m->cfg.n_embd, m->span_start);
}

int lg_model_set_spans(lg_model *m, const int *span_start, lg_error *err) {
    if (span_start && m->exec.backend == LG_BACKEND_CUDA)
        return lg_fail(err, "`pack`: packed rows run on the CPU backend only (the CUDA "
                            "attention has no span masks yet)");
    m->span_start = span_start;
    return 0;
}

void lg_model_backward(lg_model *m, const int *tokens, const int *targets, int B, int T,
                       float loss_scale) {
    lg_model_head_backward(m, targets, B, T, loss_scale);
    for (int l = m->cfg.n_layer - 1; l >= 0; l--) lg_model_block_backward(m, l, B, T);
    lg_model_embed_backward(m, tokens, B, T);
    m->grads_overwrite = 0; /* the next backward adds */
}

/* A token drawn from softmax(logits (V) / temperature) with the uniform draw u. */
static int lg_draw_token(lg_buf logits, int V, float temperature, float u) {
    lg_real max = lg_get(logits, 0), sum = 0;
    for (int v = 1; v < V; v++) max = lg_get(logits, v) > max ? lg_get(logits, v) : max;
    for (int v = 0; v < V; v++) sum += lg_exp((lg_get(logits, v) - max) / temperature);
    lg_real r = u * sum;
    for (int v = 0; v < V; v++) {
        r -= lg_exp((lg_get(logits, v) - max) / temperature);
        if (r <= 0) return v;
    }
    return V - 1;
}

/* Picks the next token from the logits (V) of one position: argmax, or a draw at temperature. */
static int lg_sample_token(lg_buf logits, int V, float temperature, lg_rng *rng) {
    if (temperature > 0.0f) return lg_draw_token(logits, V, temperature, lg_rng_uniform(rng));
    int best = 0;
    for (int v = 1; v < V; v++) best = lg_get(logits, v) > lg_get(logits, best) ? v : best;
    return best;
}

void lg_model_generate(lg_model *m, int *tokens, int n_prompt, int n_new, float temperature,
                       lg_rng *rng) {
    int Vp = m->cfg.padded_vocab_size;
    if (n_prompt < 1) return; /* nothing to continue from */
    for (int i = 0; i < n_new; i++) {
        int n = n_prompt + i, start = n > m->T ? n - m->T : 0, T = n - start;
        lg_model_forward(m, tokens + start, NULL, 1, T, NULL);
        lg_rank_sync(m->rank); /* the host reads the logits */
        lg_visit row = lg_visit_start(&m->exec, lg_head_logits_row(m, T, T - 1), (size_t)Vp,
                                      (size_t)Vp, LG_VISIT_READ);
        while (lg_visit_next(&row))
            tokens[n] = lg_sample_token(row.piece, m->cfg.vocab_size, temperature, rng);
    }
}

/* 9. optimizers ------------------------------------------------------------------------------- */

/* 8-bit codes for values in [-1, 1] (signed) or [0, 1] (unsigned), dense near zero: after
   the sign bit, the number of leading zero bits E picks the decade 10^-E, and the bits after
   the first one a linear step across [0.1, 1] of that decade (the dynamic quantization of
   Dettmers' 8-bit optimizers). Stored ascending: a code is an index into the map. */
static void lg_dynamic_map(float *map, int is_signed) {
    int magnitude_bits = is_signed ? 7 : 8;
    for (int code = 0; code < 256; code++) {
        int bits = code & ((1 << magnitude_bits) - 1), zeros = 0;
        while (zeros < magnitude_bits && !(bits & (1 << (magnitude_bits - 1 - zeros)))) zeros++;
        float value = 0;
        if (zeros < magnitude_bits) {
            int fraction_bits = magnitude_bits - 1 - zeros;
            int steps = (1 << fraction_bits) - 1, f = bits & steps;
            value = powf(10.0f, (float)-zeros) * (0.1f + 0.9f * (steps ? (float)f / steps : 0));
        }
        map[code] = is_signed && code >= 128 ? -value : value;
    }
    for (int i = 1; i < 256; i++) /* insertion sort: 256 values, once */
        for (int j = i; j > 0 && map[j - 1] > map[j]; j--) {
            float swap = map[j];
            map[j] = map[j - 1];
            map[j - 1] = swap;
        }
}



/* Copies each entry of table between a buffer in the table's layout (offsets) and one in the
   whole layout (origins). */
static void lg_copy_to_whole(const lg_exec *ex, const lg_tensor_table *table, lg_buf whole,
                             lg_buf local) {
    for (int i = 0; i < table->n_tensors; i++) {
        const lg_tensor_info *t = &table->tensors[i];
        lg_copy(ex, lg_at(whole, t->origin), lg_at(local, t->offset), t->count);
    }
}

static void lg_copy_from_whole(const lg_exec *ex, const lg_tensor_table *table, lg_buf local,
                               lg_buf whole) {
    for (int i = 0; i < table->n_tensors; i++) {
        const lg_tensor_info *t = &table->tensors[i];
        lg_copy(ex, lg_at(local, t->offset), lg_at(whole, t->origin), t->count);
    }
}

/* Binds the state to the model's rank; a mixed precision's master weights start as a copy of
   the model's weights. */
static int lg_optimizer_create(lg_optimizer *opt, const lg_model *m, const lg_args *args,
                               lg_error *err) {
    memset(opt, 0, sizeof *opt);
    opt->kind = args->optimizer;
    opt->weight_decay = args->weight_decay;
    opt->beta1 = args->beta1;
    opt->beta2 = args->beta2;
    opt->eps = args->eps;
    opt->momentum = args->momentum;
    opt->rho = args->rho;
    opt->seed = args->seed;
    lg_precision_types types = lg_types_of(m->precision);
    /* the states live in the model's rank, in the regions the plan made for them */
    int states = lg_optimizer_states(opt->kind, opt->momentum != 0.0f);
    opt->format = m->rank->plan->spec.optimizer_state;
    lg_buf *state[2] = {&opt->m, &opt->v}, *small[2] = {&opt->m_small, &opt->v_small};
    float **scales[2] = {&opt->m_scales, &opt->v_scales};
    for (int i = 0; i < states; i++) {
        const char *name = lg_optimizer_state_name(opt->kind, i);
        char extra[LG_MAX_NAME];
        state[i]->dtype = opt->format == LG_STATE_8BIT   ? LG_DTYPE_U8
                          : opt->format == LG_STATE_BF16 ? LG_DTYPE_BF16
                                                         : types.state;
        state[i]->data = lg_rank_region(m->rank, name);
        small[i]->dtype = LG_DTYPE_F32;
        snprintf(extra, sizeof extra, LG_REGION_STATE_SMALL, name);
        small[i]->data = lg_rank_region(m->rank, extra);
        snprintf(extra, sizeof extra, LG_REGION_STATE_SCALES, name);
        *scales[i] = (float *)lg_rank_region(m->rank, extra);
        if (!state[i]->data && !small[i]->data)
            return lg_fail(err, "the plan has no region %s for the optimizer", name);
    }
    lg_dynamic_map(opt->signed_map, 1);
    lg_dynamic_map(opt->unsigned_map, 0);
    if (types.master) {
        if (!(opt->master = (lg_real *)lg_rank_region(m->rank, LG_REGION_MASTER_WEIGHTS)))
            return lg_fail(err, "the plan has no region master_weights");
        if (m->weights_gathered) lg_copy(&m->exec, lg_buf_of(opt->master), m->params, m->n_local);
        else lg_copy_from_whole(&m->exec, m->local, lg_buf_of(opt->master), m->params);
    }
    opt->stochastic = !types.master && types.weights != LG_DTYPE_F32;
    opt->sqrt_v = types.state == LG_DTYPE_F16 && opt->kind == LG_OPTIMIZER_ADAMW;
    return 0;
}

/* The rank owns the state: nothing to free. */
static void lg_optimizer_free(lg_optimizer *opt) { memset(opt, 0, sizeof *opt); }

/* The updated weight goes to the master copy (at k) and its rounded working copy (at kw), or
   straight to the weights: stochastically rounded when they are half without a master. */
static void lg_store_weight(const lg_optimizer *opt, const lg_update_rule *rule, lg_buf params,
                            size_t k, size_t kw, size_t origin, lg_real w) {
    if (opt->master) opt->master[k] = w;
    if (opt->stochastic) ((uint16_t *)params.data)[kw] = lg_round_update(rule, w, params.dtype, origin);
    else lg_set(params, kw, w);
}

/* The rule of the step the optimizer takes now (opt->t counts it already). */
static lg_update_rule lg_update_rule_of(const lg_optimizer *opt, float lr) {
    lg_update_rule r;
    memset(&r, 0, sizeof r);
    r.kind = opt->kind;
    r.lr = lr;
    r.beta1 = opt->beta1;
    r.beta2 = opt->beta2;
    r.eps = opt->eps;
    r.rho = opt->rho;
    r.momentum = opt->momentum;
    r.bias_corr1 = 1.0f - lg_pow(opt->beta1, (lg_real)opt->t);
    r.bias_corr2 = 1.0f - lg_pow(opt->beta2, (lg_real)opt->t);
    r.rounding_seed = opt->seed ^ ((uint64_t)opt->t << 40);
    return r;
}

void lg_optimizer_step(lg_optimizer *opt, lg_model *m, float lr, float grad_multiplier) {
    lg_optimizer_update(opt, &m->exec, m->local, m->params, !m->weights_gathered, m->grads, lr,
                        grad_multiplier);
}

/* Running offsets of the compact formats, advanced tensor by tensor in table order. */
typedef struct {
    size_t large, small, blocks;
} lg_state_cursor;

static lg_tensor_state lg_state_of(const lg_optimizer *opt, const lg_tensor_info *t,
                                   lg_state_cursor *at) {
    lg_tensor_state st;
    memset(&st, 0, sizeof st);
    if (opt->format == LG_STATE_AS_PRECISION) {
        st.m = lg_at(opt->m, t->offset);
        st.v = lg_at(opt->v, t->offset);
        return st;
    }
    if (t->count < LG_COMPACT_MIN) {
        st.m = lg_at(opt->m_small, at->small);
        st.v = lg_at(opt->v_small, at->small);
        at->small += t->count;
        return st;
    }
    if (opt->format == LG_STATE_BF16) {
        st.m = lg_at(opt->m, at->large);
        st.v = lg_at(opt->v, at->large);
        at->large += t->count;
        return st;
    }
    st.m = lg_at(opt->m, at->blocks * LG_QUANT_BLOCK);
    st.v = lg_at(opt->v, at->blocks * LG_QUANT_BLOCK);
    st.m_scales = opt->m_scales ? opt->m_scales + at->blocks : NULL;
    st.v_scales = opt->v_scales ? opt->v_scales + at->blocks : NULL;
    at->blocks += (t->count + LG_QUANT_BLOCK - 1) / LG_QUANT_BLOCK;
    return st;
}

/* Dequantizes n codes of a block into x; requantizes x into the codes and the block's scale. */
static void lg_dequantize_block(const float *map, const uint8_t *codes, float scale, int n,
                                lg_real *x) {
    for (int i = 0; i < n; i++) x[i] = map[codes[i]] * scale;
}

static void lg_quantize_block(const float *map, uint8_t *codes, float *scale, int n,
                              const lg_real *x) {
    float absmax = 0;
    for (int i = 0; i < n; i++) absmax = fabsf((float)x[i]) > absmax ? fabsf((float)x[i]) : absmax;
    *scale = absmax;
    for (int i = 0; i < n; i++) codes[i] = lg_quantize(map, absmax > 0 ? (float)x[i] / absmax : 0);
}

/* AdamW on the avx512 path and above: lg_adamw_element's formula (section 2: decoupled weight
   decay, bias-corrected moments, w -= lr (m / bc1) / (sqrt(v / bc2) + eps)) 16 elements at a
   time in fp32, in place of lg_update_tensor's loop; test_cpu_ops_paths (tests/test_cpu_ops.c)
   holds the two to 1e-5 of each other and this loop to the same bits however a tensor is cut
   into shards. fp32 m and v, the weights fp32 or a bf16 copy of the fp32 master.
   Returns 0, leaving the tensor to the loop, for other rules and state formats. The last
   partial vector goes through lg_v_load_n, so a weight's update never depends on where its
   shard starts. */
#if LG_X86_KERNELS
LG_TARGET_AVX512 static int lg_adamw_avx512(const lg_optimizer *opt, const lg_exec *ex,
                                            const lg_update_rule *rule, const lg_tensor_info *t,
                                            const lg_tensor_state *st, lg_buf params,
                                            int params_whole, lg_buf grads, float grad_multiplier,
                                            lg_real decay) {
    if (rule->kind != LG_OPTIMIZER_ADAMW || opt->sqrt_v || opt->stochastic || !st->m.data ||
        !st->v.data || st->m.dtype != LG_DTYPE_F32 || st->v.dtype != LG_DTYPE_F32 ||
        (!opt->master && params.dtype != LG_DTYPE_F32) || !lg_v_ready(ex, params, grads, lg_no_buf()))
        return 0;
    const size_t n = t->count;
    const lg_buf master = {opt->master ? opt->master + t->offset : NULL, LG_DTYPE_F32};
    const lg_buf w = lg_at(params, params_whole ? t->origin : t->offset), g = lg_at(grads, t->offset);
    const lg_buf m = st->m, v = st->v;
    const __m512 gm = _mm512_set1_ps(grad_multiplier), lr = _mm512_set1_ps(rule->lr);
    const __m512 lr_decay = _mm512_set1_ps(rule->lr * decay), eps = _mm512_set1_ps(rule->eps);
    const __m512 beta1 = _mm512_set1_ps(rule->beta1), beta2 = _mm512_set1_ps(rule->beta2);
    const __m512 rest1 = _mm512_set1_ps(1.0f - rule->beta1), rest2 = _mm512_set1_ps(1.0f - rule->beta2);
    const __m512 corr1 = _mm512_set1_ps(rule->bias_corr1), corr2 = _mm512_set1_ps(rule->bias_corr2);
    LG_OMP(omp parallel for)
    for (long c = 0; c < (long)((n + LG_V - 1) / LG_V); c++) {
        const size_t i = (size_t)c * LG_V, left = n - i;
        __m512 p = lg_v_load_n(master.data ? master : w, i, left, 0);
        const __m512 grad = _mm512_mul_ps(lg_v_load_n(g, i, left, 0), gm);
        __m512 mi = lg_v_load_n(m, i, left, 0), vi = lg_v_load_n(v, i, left, 0);
        p = _mm512_fnmadd_ps(lr_decay, p, p);
        mi = _mm512_fmadd_ps(beta1, mi, _mm512_mul_ps(rest1, grad));
        vi = _mm512_fmadd_ps(beta2, vi, _mm512_mul_ps(_mm512_mul_ps(rest2, grad), grad));
        const __m512 m_hat = _mm512_div_ps(mi, corr1), v_hat = _mm512_div_ps(vi, corr2);
        const __m512 step = _mm512_div_ps(_mm512_mul_ps(lr, m_hat), _mm512_add_ps(_mm512_maskz_sqrt_ps(LG_ALL16, v_hat), eps));
        p = _mm512_sub_ps(p, step);
        lg_v_store_n(m, i, left, mi);
        lg_v_store_n(v, i, left, vi);
        if (master.data) lg_v_store_n(master, i, left, p);
        lg_v_store_n(w, i, left, p);
    }
    return 1;
}

/* lg_sum_squares on the avx512 path: sums of squares in double, 8 lanes */
LG_TARGET_AVX512 static int lg_sum_squares_avx512(const lg_exec *ex, lg_buf x, size_t n,
                                                  double *out) {
    if (!lg_v_ready(ex, x, lg_no_buf(), lg_no_buf())) return 0;
    double sum = 0;
    LG_OMP(omp parallel reduction(+ : sum))
    {
        __m512d acc = _mm512_setzero_pd();
        LG_OMP(omp for)
        for (long c = 0; c < (long)((n + LG_V - 1) / LG_V); c++) {
            const __m512 f = lg_v_load_n(x, (size_t)c * LG_V, n - (size_t)c * LG_V, 0);
            const __m512d halves = _mm512_castps_pd(f); /* (extracts: g++ warns on the casts) */
            const __m512d lo = _mm512_maskz_cvtps_pd(
                LG_ALL8, _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(LG_ALL8, halves, 0)));
            const __m512d hi = _mm512_maskz_cvtps_pd(
                LG_ALL8, _mm256_castpd_ps(_mm512_maskz_extractf64x4_pd(LG_ALL8, halves, 1)));
            acc = _mm512_fmadd_pd(lo, lo, acc);
            acc = _mm512_fmadd_pd(hi, hi, acc);
        }
        sum += lg_v_sum_pd(acc);
    }
    *out = sum;
    return 1;
}
#else
#define lg_adamw_avx512(...) 0
#define lg_sum_squares_avx512(...) 0
#endif

/* One table entry's update: its gradients, master weights and state at t->offset (the state
   as st says), its weights at t->offset, or at t->origin when params_whole. */
static void lg_update_tensor(const lg_optimizer *opt, const lg_exec *ex,
                             const lg_update_rule *rule, const lg_tensor_info *t,
                             const lg_tensor_state *state, lg_buf params, int params_whole,
                             lg_buf grads, float grad_multiplier, lg_real decay) {
    LG_ON_GPU(ex, lg_cuda_update_tensor(ex, opt, rule, t, state, params, params_whole, grads,
                                        grad_multiplier, decay));
    if (lg_avx512_usable(ex) && lg_adamw_avx512(opt, ex, rule, t, state, params, params_whole, grads,
                                                grad_multiplier, decay))
        return;
    lg_tensor_state st = *state;
    int quantized = st.m.dtype == LG_DTYPE_U8;
    /* blocks of LG_QUANT_BLOCK in every format: the threads' unit of work */
    long block_size = LG_QUANT_BLOCK;
    long blocks = (long)((t->count + LG_QUANT_BLOCK - 1) / LG_QUANT_BLOCK);
    /* 8-bit: a block at a time, dequantized into fp32, updated, requantized */
    LG_OMP(omp parallel for)
    for (long b = 0; b < blocks; b++) {
        lg_real m_block[LG_QUANT_BLOCK], v_block[LG_QUANT_BLOCK];
        long first = b * block_size, n = (long)t->count - first;
        if (n > block_size) n = block_size;
        uint8_t *m_codes = quantized ? (uint8_t *)st.m.data + first : NULL;
        uint8_t *v_codes = quantized && st.v.data ? (uint8_t *)st.v.data + first : NULL;
        if (m_codes) lg_dequantize_block(opt->signed_map, m_codes, st.m_scales[b], (int)n, m_block);
        if (v_codes) lg_dequantize_block(opt->unsigned_map, v_codes, st.v_scales[b], (int)n, v_block);
        for (long j = 0; j < n; j++) {
            size_t k = t->offset + (size_t)(first + j), origin = t->origin + (size_t)(first + j);
            size_t kw = params_whole ? origin : k;
            lg_real w = opt->master ? opt->master[k] : lg_get(params, kw);
            lg_real g = lg_get(grads, k) * grad_multiplier, mk = 0, vk = 0;
            if (quantized) {
                mk = m_block[j];
                vk = v_codes ? v_block[j] : 0;
            } else {
                mk = st.m.data ? lg_get(st.m, first + j) : 0;
                vk = st.v.data ? lg_get(st.v, first + j) : 0;
                if (opt->sqrt_v) vk *= vk;
            }
            w = lg_update_element(rule, w, g, &mk, &vk, decay);
            if (quantized) {
                m_block[j] = mk;
                v_block[j] = vk;
            } else {
                if (st.m.data) lg_set(st.m, first + j, mk);
                if (st.v.data) lg_set(st.v, first + j, opt->sqrt_v ? lg_sqrt(vk) : vk);
            }
            lg_store_weight(opt, rule, params, k, kw, origin, w);
        }
        if (m_codes) lg_quantize_block(opt->signed_map, m_codes, &st.m_scales[b], (int)n, m_block);
        if (v_codes) lg_quantize_block(opt->unsigned_map, v_codes, &st.v_scales[b], (int)n, v_block);
    }
}

void lg_optimizer_update(lg_optimizer *opt, const lg_exec *ex, const lg_tensor_table *table,
                         lg_buf params, int params_whole, lg_buf grads, float lr,
                         float grad_multiplier) {
    opt->t++;
    lg_update_rule rule = lg_update_rule_of(opt, lr);
    lg_state_cursor cursor = {0, 0, 0};
    for (int i = 0; i < table->n_tensors; i++) {
        const lg_tensor_info *t = &table->tensors[i];
        lg_real decay = lg_tensor_decays(t->kind) ? opt->weight_decay : 0.0f;
        lg_tensor_state st = lg_state_of(opt, t, &cursor);
        lg_update_tensor(opt, ex, &rule, t, &st, params, params_whole, grads, grad_multiplier,
                         decay);
    }
}

void lg_optimizer_hessian_update(lg_optimizer *opt, const lg_exec *ex, lg_buf sampled_grads,
                                 size_t n_params, double n_tokens, float grad_multiplier) {
    LG_ON_GPU(ex, lg_cuda_hessian_update(ex, opt, sampled_grads, n_params, n_tokens,
                                         grad_multiplier));
    LG_OMP(omp parallel for)
    for (long k = 0; k < (long)n_params; k++) {
        lg_real g = lg_get(sampled_grads, k) * grad_multiplier;
        lg_real h = opt->beta2 * lg_get(opt->v, k) + (1.0f - opt->beta2) * (lg_real)n_tokens * g * g;
        lg_set(opt->v, k, h);
    }
}

double lg_sum_squares(const lg_exec *ex, lg_buf x, size_t n) {
    LG_ON_GPU_RETURN(ex, lg_cuda_sum_squares(ex, x, n));
    double sum = 0;
    if (lg_avx512_usable(ex) && lg_sum_squares_avx512(ex, x, n, &sum)) return sum;
    LG_OMP(omp parallel for reduction(+ : sum))
    for (long k = 0; k < (long)n; k++) {
        double g = lg_get(x, (size_t)k);
        sum += g * g;
    }
    return sum;
}

float lg_grad_norm(const lg_model *m) {
    return (float)sqrt(lg_sum_squares(&m->exec, m->grads, m->n_local));
}

float lg_clip_factor(float norm, float max_norm) {
    return max_norm > 0.0f && norm > max_norm ? max_norm / (norm + 1e-6f) : 1.0f;
}

float lg_learning_rate(const lg_args *a, int step) {
    if (step < a->warmup_steps) return a->lr * (step + 1) / a->warmup_steps;
    int decay_steps = a->max_steps - a->warmup_steps;
    if (decay_steps <= 0) return a->lr;
    float progress = (float)(step - a->warmup_steps) / decay_steps;
    if (progress > 1.0f) progress = 1.0f;
    return a->min_lr + 0.5f * (1.0f + cosf(3.14159265358979f * progress)) * (a->lr - a->min_lr);
}

/* 10. processes and collectives --------------------------------------------------------------- */

/* Ranks in several processes: the launcher's environment, MPI start-up, the rendezvous of GPU
   processes without MPI, the start-up flag check, and the collectives between ranks
   (all-reduce, reduce-scatter, all-gather, broadcast) in one process or over MPI; on GPUs
   over NCCL (litgpt_cuda.cuh). */


/* A build without CUDA: the collectives' stand-ins (the CPU's are further down). */
#ifndef LG_CUDA
lg_comm *lg_comm_create(int n, lg_rank *const *members, lg_error *err) {
    (void)n;
    (void)members;
    lg_fail(err, "this build has no CUDA backend");
    return NULL;
}

#ifndef LG_MPI
void lg_comm_free(lg_comm *comm) { (void)comm; }
#endif

void lg_comm_watch(lg_comm *comm, const char *name, const lg_launch *launch) {
    (void)comm;
    (void)name;
    (void)launch;
}

int lg_nccl_unique_id(unsigned char *id, lg_error *err) {
    (void)id;
    return lg_fail(err, "this build has no CUDA backend");
}

lg_comm *lg_comm_create_global(int world, int first_rank, int n, lg_rank *const *members,
                               const unsigned char *id, const lg_launch *launch, lg_error *err) {
    (void)launch;
    (void)world;
    (void)first_rank;
    (void)n;
    (void)members;
    (void)id;
    lg_fail(err, "this build has no CUDA backend");
    return NULL;
}

int lg_comm_split(lg_comm *parent, const int *color, const int *key, lg_comm **by_color,
                  lg_error *err) {
    (void)parent;
    (void)color;
    (void)key;
    (void)by_color;
    return lg_fail(err, "this build has no CUDA backend");
}
#endif


/* --- processes: the launcher's environment, MPI -------------------------------------------- */

/* A launcher's variable as a non-negative integer: 1 when set and read, 0 when unset, -1 (with
   err) when it is not a number. */
static int lg_env_int(const char *name, int *value, lg_error *err) {
    const char *text = getenv(name);
    if (!text || !*text) return 0;
    char *end;
    long v = strtol(text, &end, 10);
    if (*end != '\0' || v < 0 || v > 1000000)
        return lg_fail(err, "the launcher's %s='%s' is not a rank or a count", name, text);
    *value = (int)v;
    return 1;
}

/* The variables one launcher sets; node NULL: derived from the processes on a node. */
typedef struct {
    const char *launcher, *marker; /* marker: set when this launcher started the process */
    const char *process, *processes, *local_process, *local_processes, *node;
} lg_launcher_vars;

static const lg_launcher_vars lg_launchers[] = {
    {"torchrun", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
     "GROUP_RANK"},
    {"Slurm", "SLURM_PROCID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", NULL,
     "SLURM_NODEID"},
    {"Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", NULL},
    {"MPICH", "PMI_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", NULL},
};

static int lg_launch_read(lg_launch *l, const lg_launcher_vars *v, lg_error *err) {
    l->launcher = v->launcher;
    int got[5] = {0, 0, 0, 0, 0};
    if ((got[0] = lg_env_int(v->process, &l->process, err)) < 0 ||
        (got[1] = lg_env_int(v->processes, &l->processes, err)) < 0 ||
        (got[2] = lg_env_int(v->local_process, &l->local_process, err)) < 0 ||
        (v->local_processes && (got[3] = lg_env_int(v->local_processes, &l->local_processes, err)) < 0) ||
        (v->node && (got[4] = lg_env_int(v->node, &l->node, err)) < 0))
        return -1;
    if (!got[0] || !got[1])
        return lg_fail(err, "%s started this process (%s is set) but %s or %s is missing",
                       v->launcher, v->marker, v->process, v->processes);
    if (l->processes < 1 || l->process >= l->processes)
        return lg_fail(err, "%s: process %s=%d is outside the world %s=%d", v->launcher,
                       v->process, l->process, v->processes, l->processes);
    if (!got[2]) l->local_process = 0;
    if (!got[3]) l->local_processes = 0; /* unknown: Slurm's tasks per node vary */
    if (!got[4]) l->node = l->local_processes ? l->process / l->local_processes : 0;
    return 0;
}

int lg_launch_from_env(lg_launch *l, lg_error *err) {
    memset(l, 0, sizeof *l);
    l->processes = l->local_processes = 1;
    l->local_ranks = 0;
    l->dist_timeout = LG_DIST_TIMEOUT;
    const char *master = getenv("MASTER_ADDR"), *port = getenv("MASTER_PORT");
    if (master && port && atoi(port) > 0)
        snprintf(l->dist_init, sizeof l->dist_init, "tcp://%s:%d", master, atoi(port) + 1);
    for (size_t i = 0; i < sizeof lg_launchers / sizeof lg_launchers[0]; i++)
        if (getenv(lg_launchers[i].marker)) return lg_launch_read(l, &lg_launchers[i], err);
    return 0;
}

int lg_launch_place(lg_launch *l, int devices, int nodes, lg_error *err) {
    int world = devices * nodes;
    if (l->processes == 1) {
        l->first_rank = 0;
        l->local_ranks = world;
        return 0;
    }
    if (l->processes == world) l->local_ranks = 1;
    else if (l->processes == nodes) l->local_ranks = devices;
    else
        return lg_fail(err, "%s started %d processes, but `devices %d` x `nodes %d` is %d ranks: start "
                            "%d processes (one a rank) or %d (one a node)", l->launcher,
                       l->processes, devices, nodes, world, world, nodes);
    l->first_rank = l->process * l->local_ranks;
    return 0;
}

#ifdef LG_MPI
/* 1 when the build has MPI (built by mpicc: make says so). */
static int lg_launch_has_mpi(void) { return 1; }

/* MPI's launchers: Open MPI's and MPICH's mpirun, and Slurm (srun speaks PMI); torchrun
   starts no MPI. */
static int lg_launcher_speaks_mpi(const lg_launch *l) {
    return l->launcher && strcmp(l->launcher, "torchrun") != 0;
}

/* MPI_Init's watchdog: ends the process when MPI has not started by the deadline. */
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t started;
    int done;
    const lg_launch *launch;
} lg_mpi_start_watch;

static void *lg_mpi_watch_start(void *arg) {
    lg_mpi_start_watch *w = (lg_mpi_start_watch *)arg;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    double whole = floor(w->launch->dist_timeout), part = w->launch->dist_timeout - whole;
    deadline.tv_sec += (time_t)whole;
    deadline.tv_nsec += (long)(part * 1e9);
    if (deadline.tv_nsec >= 1000000000L) deadline.tv_sec++, deadline.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&w->lock);
    int rc = 0;
    while (!w->done && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&w->started, &w->lock, &deadline);
    int late = !w->done;
    pthread_mutex_unlock(&w->lock);
    if (!late) return NULL;
    lg_print_settings(stderr, w->launch, "rank %d: MPI did not start within `dist_timeout` %g s: "
                      "all %d processes that %s started must reach it, and one exited before it "
                      "(a bad flag, or `plan_only` or `help` given to it alone) or never started; "
                      "stopping\n", w->launch->process, w->launch->dist_timeout,
                      w->launch->processes, w->launch->launcher);
    fflush(stderr);
    _exit(2);
}

/* MPI_Init, or the process ends after dist_timeout (lg_mpi_watch_start). */
static int lg_mpi_init_watched(const lg_launch *l) {
    lg_mpi_start_watch w;
    pthread_t watchdog;
    memset(&w, 0, sizeof w);
    w.launch = l;
    pthread_mutex_init(&w.lock, NULL);
    pthread_cond_init(&w.started, NULL);
    int watching = pthread_create(&watchdog, NULL, lg_mpi_watch_start, &w) == 0;
    int rc = MPI_Init(NULL, NULL);
    pthread_mutex_lock(&w.lock);
    w.done = 1;
    pthread_cond_signal(&w.started);
    pthread_mutex_unlock(&w.lock);
    if (watching) pthread_join(watchdog, NULL);
    pthread_cond_destroy(&w.started);
    pthread_mutex_destroy(&w.lock);
    return rc;
}

int lg_launch_start(lg_launch *l, lg_error *err) {
    if (l->processes == 1 || !lg_launcher_speaks_mpi(l)) return 0;
    int ready = 0, size = 0, rank = 0;
    MPI_Initialized(&ready);
    if (!ready && lg_mpi_init_watched(l) != MPI_SUCCESS)
        return lg_fail(err, "MPI_Init failed under %s", l->launcher);
    l->mpi = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (size != l->processes || rank != l->process)
        return lg_fail(err, "%s says process %d of %d, MPI says %d of %d: the launcher and the MPI "
                            "library do not match (start with this MPI's mpirun; under Slurm start "
                            "every process with srun, not from the batch script)",
                       l->launcher, l->process, l->processes, rank, size);
    return 0;
}

void lg_launch_finish(lg_launch *l) {
    if (l->mpi) MPI_Finalize();
    l->mpi = 0;
}

void lg_launch_abort(int code) {
    int started = 0, finished = 0;
    fflush(stdout);
    fflush(stderr);
    MPI_Initialized(&started);
    MPI_Finalized(&finished);
    if (started && !finished) MPI_Abort(MPI_COMM_WORLD, code);
    exit(code);
}

void lg_launch_exit(int code) {
    int started = 0, finished = 0;
    fflush(stdout);
    MPI_Initialized(&started);
    MPI_Finalized(&finished);
    if (started && !finished) MPI_Finalize();
    exit(code);
}

/* Process 0's items (lengths, then the bytes) reach every process. */
static char *lg_launch_broadcast_items(const char *const *items, int n, int is_root, int *lengths) {
    long total = 0;
    for (int i = 0; i < n; i++) {
        if (is_root) lengths[i] = (int)strlen(items[i]);
    }
    MPI_Bcast(lengths, n, MPI_INT, 0, MPI_COMM_WORLD);
    for (int i = 0; i < n; i++) total += lengths[i] + 1;
    char *text = (char *)lg_alloc_zeroed((size_t)total + 1);
    if (!text) return NULL;
    if (is_root)
        for (long i = 0, at = 0; i < n; at += lengths[i] + 1, i++) memcpy(text + at, items[i], (size_t)lengths[i]);
    MPI_Bcast(text, (int)total, MPI_CHAR, 0, MPI_COMM_WORLD);
    return text;
}

int lg_launch_same(const lg_launch *l, const char *const *items, int n, lg_error *err) {
    if (!l->mpi) return 0;
    int n_root = n, n_common = n;
    MPI_Bcast(&n_root, 1, MPI_INT, 0, MPI_COMM_WORLD);
    MPI_Allreduce(&n, &n_common, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    int *lengths = (int *)lg_alloc_zeroed(sizeof(int) * (size_t)(n_common + 1));
    char *root = lengths ? lg_launch_broadcast_items(items, n_common, l->process == 0, lengths) : NULL;
    /* the first item that differs here (n_common + 1: none; n_common: more or fewer items) */
    int differs = n != n_root ? n_common : n_common + 1;
    for (long i = 0, at = 0; root && i < n_common; at += lengths[i] + 1, i++)
        if (strcmp(root + at, items[i]) != 0) {
            differs = (int)i;
            break;
        }
    int first = differs, me, culprit;
    MPI_Allreduce(&differs, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    me = differs == first ? l->process : l->processes;
    MPI_Allreduce(&me, &culprit, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD); /* the lowest at fault */
    long at = 0;
    for (int i = 0; i < first && i < n_common; i++) at += lengths[i] + 1;
    /* the culprit's item there (or its next one: "" when it has fewer), for every line */
    char theirs[256] = "";
    if (first <= n_common) {
        if (culprit == l->process && first < n) snprintf(theirs, sizeof theirs, "%s", items[first]);
        MPI_Bcast(theirs, (int)sizeof theirs, MPI_CHAR, culprit, MPI_COMM_WORLD);
    }
    int rc = 0;
    if (!root) rc = lg_fail(err, "out of host memory for the start-up check");
    else if (first > n_common) rc = 0;
    else if (culprit == l->process && first < n_common)
        rc = lg_fail(err, "this process was started with '%s' where process 0 has '%s'; every "
                          "process needs the same flags and data", items[first], root + at);
    else if (culprit == l->process)
        rc = lg_fail(err, "this process was started with %d flags and data items, process 0 with %d "
                          "(the first %d agree%s%s%s)", n, n_root, n_common,
                     n > n_common ? "; the next here is '" : "", n > n_common ? items[n_common] : "",
                     n > n_common ? "'" : "");
    else if (first < n_common)
        rc = lg_fail(err, "process %d was started with '%s' where process 0 has '%s'; every process "
                          "needs the same flags and data", culprit, theirs, root + at);
    else if (theirs[0])
        rc = lg_fail(err, "process %d was started with more flags and data items than process 0 "
                          "(the first %d agree; the next there is '%s')", culprit, n_common, theirs);
    else
        rc = lg_fail(err, "process %d was started with fewer flags and data items than process 0 "
                          "(the first %d agree)", culprit, n_common);
    LG_FREE(root);
    LG_FREE(lengths);
    return rc;
}
#else
static int lg_launch_has_mpi(void) { return 0; }

int lg_launch_start(lg_launch *l, lg_error *err) {
    (void)l;
    (void)err;
    return 0;
}

void lg_launch_finish(lg_launch *l) { (void)l; }

void lg_launch_abort(int code) {
    fflush(stdout);
    exit(code);
}

void lg_launch_exit(int code) {
    fflush(stdout);
    exit(code);
}

/* (without MPI lg_launch_same goes through the rendezvous: after lg_launch_share) */
#endif

/* --- the rendezvous of GPU processes without MPI: TCP or a shared file ---------------------- */

#define LG_RENDEZVOUS_MAGIC 0x4c475256u /* "LGRV": a litgpt.c process, not a stray client */
#define LG_RENDEZVOUS_POLL_MS 20        /* how often a waiting process looks again */

static void lg_sleep_ms(int ms) { poll(NULL, 0, ms); }

/* The processes of 1..processes-1 whose flag in done is 0, as "2, 3" into out. */
static void lg_list_missing(const unsigned char *done, int processes, char *out, size_t cap) {
    size_t at = 0;
    out[0] = '\0';
    for (int p = 1; p < processes && at + 16 < cap; p++)
        if (!done[p]) at += (size_t)snprintf(out + at, cap - at, "%s%d", at ? ", " : "", p);
}

/* 64 random bits: /dev/urandom, else the clock and the process id. */
static uint64_t lg_fresh_nonce(void) {
    uint64_t nonce = 0;
    FILE *f = fopen("/dev/urandom", "rb");
    if (!f || fread(&nonce, sizeof nonce, 1, f) != 1) nonce = (uint64_t)(lg_time_ms() * 1e3) ^ ((uint64_t)getpid() << 32);
    if (f) fclose(f);
    return nonce | 1; /* never 0: 0 means "not read" */
}

/* Writes text to path atomically (a temporary file renamed over it). */
static int lg_write_text_atomic(const char *path, const char *text) {
    char tmp[1200]; /* path: at most 1100 bytes (the rendezvous's names) */
    snprintf(tmp, sizeof tmp, "%s.tmp%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return -1;
    int ok = fputs(text, f) >= 0;
    ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        remove(tmp);
        return -1;
    }
    return 0;
}

/* An announcement PATH.p: "<nonce> waiting|done"; 0 when absent or unreadable. */
static uint64_t lg_read_announcement(const char *path, int *done) {
    FILE *f = fopen(path, "r");
    unsigned long long nonce = 0;
    char state[16] = "";
    if (f && fscanf(f, "%llx %15s", &nonce, state) != 2) nonce = 0;
    if (f) fclose(f);
    *done = strcmp(state, "done") == 0;
    return (uint64_t)nonce;
}

/* Process 0 of the file rendezvous: clears an earlier run's files, waits for every
   announcement, publishes the id with their nonces (again when one changes), and returns once
   every process has taken it. */
static int lg_rendezvous_file_root(const char *path, int processes, const void *id,
                                   size_t id_bytes, double deadline, double timeout_s,
                                   lg_error *err) {
    char name[LG_PATH_MAX];
    uint64_t nonce[LG_MAX_RANKS] = {0}, published[LG_MAX_RANKS] = {0};
    unsigned char taken[LG_MAX_RANKS] = {0}, came[LG_MAX_RANKS] = {0};
    remove(path);
    for (int p = 1; p < processes; p++) {
        snprintf(name, sizeof name, "%s.%d", path, p);
        remove(name);
    }
    for (;;) {
        int all_came = 1, all_taken = 1, changed = 0;
        for (int p = 1; p < processes; p++) {
            int done = 0;
            snprintf(name, sizeof name, "%s.%d", path, p);
            nonce[p] = lg_read_announcement(name, &done);
            came[p] = nonce[p] != 0;
            taken[p] = came[p] && done && nonce[p] == published[p];
            all_came &= came[p];
            all_taken &= taken[p];
            changed |= nonce[p] != published[p];
        }
        if (all_came && all_taken) break;
        if (all_came && changed) { /* publish: header, each process's nonce, the id */
            size_t cap = 64 + (size_t)processes * 24 + 2 * id_bytes;
            char *text = (char *)lg_alloc_zeroed(cap);
            if (!text) return lg_fail(err, "out of host memory for the rendezvous");
            size_t at = (size_t)snprintf(text, cap, "litgpt-rendezvous %d\n", processes);
            for (int p = 1; p < processes; p++) {
                at += (size_t)snprintf(text + at, cap - at, "%d %llx\n", p, (unsigned long long)nonce[p]);
                published[p] = nonce[p];
            }
            at += (size_t)snprintf(text + at, cap - at, "id ");
            for (size_t i = 0; i < id_bytes; i++)
                at += (size_t)snprintf(text + at, cap - at, "%02x", ((const unsigned char *)id)[i]);
            snprintf(text + at, cap - at, "\n");
            int rc = lg_write_text_atomic(path, text);
            LG_FREE(text);
            if (rc != 0) return lg_fail(err, "rendezvous file://%s: cannot write it: %s", path, strerror(errno));
        }
        if (lg_time_ms() > deadline) {
            char missing[256];
            lg_list_missing(all_came ? taken : came, processes, missing, sizeof missing);
            return lg_fail(err, "rendezvous file://%s: after %g s process%s %s of %d %s", path,
                           timeout_s, strchr(missing, ',') ? "es" : "", missing, processes,
                           all_came ? "did not take the id" : "never announced itself (not started, or another `dist_init`)");
        }
        lg_sleep_ms(LG_RENDEZVOUS_POLL_MS);
    }
    for (int p = 1; p < processes; p++) {
        snprintf(name, sizeof name, "%s.%d", path, p);
        remove(name);
    }
    remove(path);
    return 0;
}

/* PATH as process 0 published it, when it names this process with this nonce: the id (read
   word by word: the id's line is as long as it needs). */
static int lg_read_published(const char *path, int process, uint64_t nonce, unsigned char *id,
                             size_t id_bytes) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char word[64];
    int named = 0, got = 0, processes = 0;
    if (fscanf(f, "litgpt-rendezvous %d", &processes) != 1) processes = 0;
    while (processes > 0 && fscanf(f, "%63s", word) == 1) {
        if (strcmp(word, "id") == 0) {
            got = named;
            for (size_t i = 0; got && i < id_bytes; i++) {
                unsigned v;
                got = fscanf(f, "%2x", &v) == 1;
                id[i] = (unsigned char)v;
            }
            break;
        }
        unsigned long long n;
        if (fscanf(f, "%llx", &n) != 1) break;
        if (atoi(word) == process && (uint64_t)n == nonce) named = 1;
    }
    fclose(f);
    return named && got ? 0 : -1;
}

static int lg_rendezvous_file_member(const char *path, int process, void *id, size_t id_bytes,
                                     double deadline, double timeout_s, lg_error *err) {
    char name[LG_PATH_MAX], text[64];
    uint64_t nonce = lg_fresh_nonce();
    snprintf(name, sizeof name, "%s.%d", path, process);
    snprintf(text, sizeof text, "%llx waiting\n", (unsigned long long)nonce);
    for (;;) {
        int done = 0;
        /* (again when process 0's clean-up removed it) */
        if (lg_read_announcement(name, &done) != nonce) lg_write_text_atomic(name, text);
        if (lg_read_published(path, process, nonce, (unsigned char *)id, id_bytes) == 0) break;
        if (lg_time_ms() > deadline)
            return lg_fail(err, "rendezvous file://%s: process 0 did not publish the id for this "
                                "process within %g s (is it running, with the same `dist_init`?)",
                           path, timeout_s);
        lg_sleep_ms(LG_RENDEZVOUS_POLL_MS);
    }
    snprintf(text, sizeof text, "%llx done\n", (unsigned long long)nonce);
    if (lg_write_text_atomic(name, text) != 0)
        return lg_fail(err, "rendezvous file://%s: cannot write %s: %s", path, name, strerror(errno));
    return 0;
}

#if defined(_POSIX_C_SOURCE) && _POSIX_C_SOURCE >= 200112L
/* Waits until fd is readable (or the deadline): 1 ready, 0 not. */
static int lg_wait_readable(int fd, double deadline) {
    struct pollfd q = {fd, POLLIN, 0};
    double left = deadline - lg_time_ms();
    return left > 0 && poll(&q, 1, (int)left + 1) == 1;
}

/* Reads exactly n bytes before the deadline: 0, or -1 (closed, error or late). */
static int lg_read_exactly(int fd, void *buf, size_t n, double deadline) {
    unsigned char *p = (unsigned char *)buf;
    while (n > 0) {
        if (!lg_wait_readable(fd, deadline)) return -1;
        ssize_t got = read(fd, p, n);
        if (got <= 0) return -1;
        p += got;
        n -= (size_t)got;
    }
    return 0;
}

static int lg_write_all(int fd, const void *buf, size_t n) {
    const unsigned char *p = (const unsigned char *)buf;
    while (n > 0) {
        ssize_t put = write(fd, p, n);
        if (put <= 0) return -1;
        p += put;
        n -= (size_t)put;
    }
    return 0;
}

static int lg_rendezvous_tcp_root(const char *host, const char *port, int processes,
                                  const void *id, size_t id_bytes, double deadline,
                                  double timeout_s, lg_error *err) {
    int fds[LG_MAX_RANKS];
    unsigned char came[LG_MAX_RANKS] = {0};
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE; /* every interface: HOST is how the others reach this one */
    if (getaddrinfo(NULL, port, &hints, &ai) != 0)
        return lg_fail(err, "rendezvous tcp://%s:%s: '%s' is not a port", host, port, port);
    int one = 1, listener = socket(ai->ai_family, ai->ai_socktype, 0);
    if (listener >= 0) setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int bound = listener >= 0 && bind(listener, ai->ai_addr, ai->ai_addrlen) == 0 &&
                listen(listener, processes) == 0;
    freeaddrinfo(ai);
    if (!bound) {
        if (listener >= 0) close(listener);
        return lg_fail(err, "rendezvous tcp://%s:%s: process 0 cannot listen on port %s: %s "
                            "(another run there? pick another port)", host, port, port, strerror(errno));
    }
    int joined = 0, rc = 0;
    while (joined < processes - 1 && rc == 0) {
        if (!lg_wait_readable(listener, deadline)) {
            char missing[256];
            lg_list_missing(came, processes, missing, sizeof missing);
            rc = lg_fail(err, "rendezvous tcp://%s:%s: after %g s process%s %s of %d did not come "
                              "(not started, or given another address)", host, port, timeout_s,
                         strchr(missing, ',') ? "es" : "", missing, processes);
            break;
        }
        int fd = accept(listener, NULL, NULL);
        uint32_t hello[2];
        if (fd < 0) continue;
        if (lg_read_exactly(fd, hello, sizeof hello, deadline) != 0 || hello[0] != LG_RENDEZVOUS_MAGIC ||
            hello[1] < 1 || (int)hello[1] >= processes || came[hello[1]]) {
            close(fd); /* a stray client, or a process index twice */
            continue;
        }
        came[hello[1]] = 1;
        fds[hello[1]] = fd;
        joined++;
    }
    for (int p = 1; p < processes; p++) {
        if (!came[p]) continue;
        if (rc == 0 && lg_write_all(fds[p], id, id_bytes) != 0)
            rc = lg_fail(err, "rendezvous tcp://%s:%s: process %d left before it got the id", host, port, p);
        close(fds[p]);
    }
    close(listener);
    return rc;
}

static int lg_rendezvous_tcp_member(const char *host, const char *port, int process, void *id,
                                    size_t id_bytes, double deadline, double timeout_s,
                                    lg_error *err) {
    struct addrinfo hints, *ai = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    int fd = -1;
    while (fd < 0) { /* process 0 may not listen yet */
        if (getaddrinfo(host, port, &hints, &ai) == 0) {
            fd = socket(ai->ai_family, ai->ai_socktype, 0);
            if (fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
                close(fd);
                fd = -1;
            }
            freeaddrinfo(ai);
        }
        if (fd >= 0) break;
        if (lg_time_ms() > deadline)
            return lg_fail(err, "rendezvous tcp://%s:%s: cannot reach process 0 there within %g s "
                                "(is it running? is HOST its address?)", host, port, timeout_s);
        lg_sleep_ms(LG_RENDEZVOUS_POLL_MS * 5);
    }
    uint32_t hello[2] = {LG_RENDEZVOUS_MAGIC, (uint32_t)process};
    int rc = lg_write_all(fd, hello, sizeof hello) == 0 && lg_read_exactly(fd, id, id_bytes, deadline) == 0
                 ? 0
                 : lg_fail(err, "rendezvous tcp://%s:%s: process 0 did not send the id within %g s "
                                "(it waits for every process: see its error)", host, port, timeout_s);
    close(fd);
    return rc;
}
#endif

int lg_rendezvous(const char *init, int process, int processes, void *id, size_t id_bytes,
                  double timeout_s, lg_error *err) {
    double deadline = lg_time_ms() + timeout_s * 1e3;
    if (processes < 1 || processes > LG_MAX_RANKS || process < 0 || process >= processes)
        return lg_fail(err, "rendezvous: process %d of %d", process, processes);
    if (processes == 1) return 0;
    if (strncmp(init, "file://", 7) == 0) {
        const char *path = init + 7;
        return process == 0 ? lg_rendezvous_file_root(path, processes, id, id_bytes, deadline, timeout_s, err)
                            : lg_rendezvous_file_member(path, process, id, id_bytes, deadline, timeout_s, err);
    }
    if (strncmp(init, "tcp://", 6) != 0)
        return lg_fail(err, "rendezvous '%s': give tcp://HOST:PORT or file://PATH", init);
#if defined(_POSIX_C_SOURCE) && _POSIX_C_SOURCE >= 200112L
    char host[256];
    const char *colon = strrchr(init + 6, ':');
    if (!colon || colon == init + 6 || (size_t)(colon - (init + 6)) >= sizeof host || !colon[1])
        return lg_fail(err, "rendezvous '%s': give tcp://HOST:PORT", init);
    memcpy(host, init + 6, (size_t)(colon - (init + 6)));
    host[colon - (init + 6)] = '\0';
    return process == 0 ? lg_rendezvous_tcp_root(host, colon + 1, processes, id, id_bytes, deadline, timeout_s, err)
                        : lg_rendezvous_tcp_member(host, colon + 1, process, id, id_bytes, deadline, timeout_s, err);
#else
    return lg_fail(err, "rendezvous '%s': this build has no getaddrinfo (define _POSIX_C_SOURCE "
                        "200809L before any #include), use file://PATH", init);
#endif
}

/* Process 0's n bytes reach every process: MPI_Bcast when it joined MPI, else the rendezvous
   at dist_init (lg_rendezvous). */
static int lg_launch_share(const lg_launch *l, void *bytes, size_t n, lg_error *err) {
    if (l->processes == 1) return 0;
#ifdef LG_MPI
    if (l->mpi) {
        MPI_Bcast(bytes, (int)n, MPI_BYTE, 0, MPI_COMM_WORLD);
        return 0;
    }
#endif
    if (!l->dist_init[0])
        return lg_fail(err, "%s started %d processes and this build has no MPI: give `dist_init "
                            "tcp://HOST:PORT` (HOST: process 0's machine) or file://PATH on a shared "
                            "file system, or set MASTER_ADDR and MASTER_PORT", l->launcher, l->processes);
    return lg_rendezvous(l->dist_init, l->process, l->processes, bytes, n, l->dist_timeout, err);
}

#ifndef LG_MPI
#define LG_SAME_BYTES 16384 /* process 0's items, '\n' between, as the rendezvous sends them */

/* Without MPI (GPU processes, the CUDA build): process 0's items reach the others through the
   rendezvous (lg_launch_share); a process whose items differ names the first difference. */
int lg_launch_same(const lg_launch *l, const char *const *items, int n, lg_error *err) {
    if (l->processes == 1 || !l->dist_init[0]) return 0; /* (no rendezvous: the trainer says) */
    char *root = (char *)lg_alloc_zeroed(LG_SAME_BYTES + 1);
    if (!root) return lg_fail(err, "out of host memory for the start-up check");
    size_t at = 0;
    for (int i = 0; i < n && l->process == 0; i++) {
        size_t len = strlen(items[i]);
        if (at + len + 1 > LG_SAME_BYTES) {
            LG_FREE(root);
            return lg_fail(err, "the start-up check holds %d bytes of flags and data, and these "
                                "need more", LG_SAME_BYTES);
        }
        memcpy(root + at, items[i], len);
        root[at + len] = '\n';
        at += len + 1;
    }
    /* its own meeting point, so that an early process's next rendezvous (the NCCL id) is never
       taken for this one: tcp://HOST:PORT+1, file://PATH.check */
    char init[sizeof l->dist_init + 8];
    const char *colon = strrchr(l->dist_init, ':');
    if (strncmp(l->dist_init, "tcp://", 6) == 0 && colon && colon > l->dist_init + 6)
        snprintf(init, sizeof init, "%.*s:%d", (int)(colon - l->dist_init), l->dist_init, atoi(colon + 1) + 1);
    else snprintf(init, sizeof init, "%s.check", l->dist_init);
    int rc = lg_rendezvous(init, l->process, l->processes, root, LG_SAME_BYTES, l->dist_timeout, err);
    char *line = root;
    for (int i = 0; rc == 0 && i <= n; i++) {
        char *end = strchr(line, '\n'); /* process 0's item i (NULL: it has no more) */
        if (i == n && end)
            rc = lg_fail(err, "this process was started with fewer flags and data items than "
                              "process 0 (which has '%.*s' next)", (int)(end - line), line);
        if (i == n || rc) break;
        if (!end) {
            rc = lg_fail(err, "this process was started with more flags and data items than "
                              "process 0 ('%s' is one too many)", items[i]);
            break;
        }
        *end = '\0';
        if (strcmp(line, items[i]) != 0)
            rc = lg_fail(err, "this process was started with '%s' where process 0 has '%s'; every "
                              "process needs the same flags and data", items[i], line);
        line = end + 1;
    }
    LG_FREE(root);
    return rc;
}
#endif

/* --- CPU ranks in several processes: the collectives over MPI --------------------------------- */

#if defined(LG_MPI) && !defined(LG_CUDA)
#define LG_MPI_RANKS 1
#define LG_MPI_BEAT_TAG 7 /* "arrived at collective n": a process's message to the group's first */
#define LG_MPI_BEAT_MS 100.0    /* a waiting process repeats its arrival this often */
#define LG_MPI_SILENT_MS 1000.0 /* and is taken for stopped when silent this long */

/* A group whose members live in several processes; this one drives `local` consecutive
   members from first_local, and is process first_local / local of the group. */
struct lg_comm {
    MPI_Comm mpi;
    MPI_Comm watch;      /* a copy of mpi for the arrival messages */
    int members, first_local, local;
    double *send, *recv; /* (LG_MPI_CHUNK) each: the plan's scratch */
    /* non-blocking collectives under way, by signal; a reduce-scatter's piece is written from
       recv when it completes (one at a time: the trainer finishes each before the next) */
    MPI_Request request[LG_COMM_SIGNALS];
    lg_buf reduce_piece[LG_COMM_SIGNALS];
    int reduce_count[LG_COMM_SIGNALS];
    /* the deadline: the collectives started so far; the group's first process learns up to
       which one every other has come (arrived, by group process), the others tell it */
    char name[48];
    double timeout_s;
    const lg_launch *launch; /* the speller of the time-out's line (NULL: none) */
    int ranks_per_process, process, processes;
    int *world_process;  /* (processes): each group process's place in MPI_COMM_WORLD */
    long started, *arrived, beat;
    double *heard;  /* (processes) the first process: when each last said where it is (ms) */
    double beat_ms; /* the others: when this one last said so */
    MPI_Request beat_request;
};

/* The group's processes other than the first say that they started collective `started`. */
static void lg_mpi_arrive(lg_comm *c) {
    c->started++;
    if (c->process == 0) return;
    if (c->beat_request != MPI_REQUEST_NULL) MPI_Wait(&c->beat_request, MPI_STATUS_IGNORE);
    c->beat = c->started; /* (MPI reads it until the send completes) */
    c->beat_ms = lg_time_ms();
    MPI_Isend(&c->beat, 1, MPI_LONG, 0, LG_MPI_BEAT_TAG, c->watch, &c->beat_request);
}

/* A waiting process repeats its arrival every LG_MPI_BEAT_MS (when the last message has
   gone): the group's first then tells one stopped inside a collective, silent, from one that
   waits like itself. */
static void lg_mpi_beat_again(lg_comm *c) {
    int sent = 1;
    if (c->process == 0 || lg_time_ms() - c->beat_ms < LG_MPI_BEAT_MS) return;
    if (c->beat_request != MPI_REQUEST_NULL) MPI_Test(&c->beat_request, &sent, MPI_STATUS_IGNORE);
    if (!sent) return;
    c->beat = c->started;
    c->beat_ms = lg_time_ms();
    MPI_Isend(&c->beat, 1, MPI_LONG, 0, LG_MPI_BEAT_TAG, c->watch, &c->beat_request);
}

/* The group's first process: the arrival messages that have come. */
static void lg_mpi_take_arrivals(lg_comm *c) {
    int any = 1;
    while (c->process == 0 && any) {
        MPI_Status st;
        MPI_Iprobe(MPI_ANY_SOURCE, LG_MPI_BEAT_TAG, c->watch, &any, &st);
        if (any) MPI_Recv(&c->arrived[st.MPI_SOURCE], 1, MPI_LONG, st.MPI_SOURCE, LG_MPI_BEAT_TAG,
                          c->watch, MPI_STATUS_IGNORE);
        if (any) c->heard[st.MPI_SOURCE] = lg_time_ms();
    }
}

/* Group process q's ranks ("3", "2-3") at out; the characters written. */
static int lg_mpi_name_ranks(const lg_comm *c, int q, char *out, size_t cap) {
    int first = c->world_process[q] * c->ranks_per_process;
    if (c->ranks_per_process == 1) return snprintf(out, cap, "%d", first);
    return snprintf(out, cap, "%d-%d", first, first + c->ranks_per_process - 1);
}

/* The late processes of the group into out: "not arrived (hung or stopped): rank 3" (or
   "ranks 2, 3"); when every one arrived, those silent for LG_MPI_SILENT_MS (stopped inside the
   collective: a waiting process repeats its arrival). */
static void lg_mpi_list_late(const lg_comm *c, char *out, size_t cap) {
    char names[200];
    size_t at = 0;
    int late = 0, silent = 0;
    double now = lg_time_ms();
    names[0] = '\0';
    for (int q = 1; q < c->processes && at + 32 < sizeof names; q++) {
        if (c->arrived[q] >= c->started) continue;
        at += (size_t)snprintf(names + at, sizeof names - at, "%s", late++ ? ", " : "");
        at += (size_t)lg_mpi_name_ranks(c, q, names + at, sizeof names - at);
    }
    for (int q = 1; late == 0 && q < c->processes && at + 32 < sizeof names; q++) {
        if (now - c->heard[q] < LG_MPI_SILENT_MS) continue;
        at += (size_t)snprintf(names + at, sizeof names - at, "%s", silent++ ? ", " : "");
        at += (size_t)lg_mpi_name_ranks(c, q, names + at, sizeof names - at);
        at += (size_t)snprintf(names + at, sizeof names - at, " (silent %.1f s)", (now - c->heard[q]) / 1e3);
    }
    const char *plural = late + silent > 1 || c->ranks_per_process > 1 ? "s" : "";
    if (late) snprintf(out, cap, "not arrived (hung or stopped): rank%s %s", plural, names);
    else if (silent) snprintf(out, cap, "arrived, then stopped inside it: rank%s %s", plural, names);
    else snprintf(out, cap, "every process came and still waits (the collective did not finish)");
}

/* Ends the job: a collective did not complete before its deadline. */
static void lg_mpi_time_out(lg_comm *c, const char *what) {
    char late[256];
    int me = c->world_process[c->process] * c->ranks_per_process;
    if (c->process == 0) {
        lg_mpi_list_late(c, late, sizeof late);
        lg_print_settings(stderr, c->launch, "rank %d: the %s of %s (collective %ld) did not "
                          "complete within `dist_timeout` %g s: %s; stopping every process\n", me,
                          what, c->name, c->started, c->timeout_s, late);
    } else {
        lg_print_settings(stderr, c->launch, "rank %d: the %s of %s (collective %ld) did not "
                          "complete within `dist_timeout` %g s, and rank %d, which names the late, "
                          "did not stop the job: it may be the one that hangs; stopping every "
                          "process\n", me, what, c->name, c->started, c->timeout_s,
                          c->world_process[0] * c->ranks_per_process);
    }
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
}

/* Completes a collective of the group, or ends the job when it takes longer than the
   deadline (the group's first process at timeout_s, the others a grace later so that it
   names the late ones first). Polls: MPI's blocking waits have no deadline. */
static void lg_mpi_wait(lg_comm *c, MPI_Request *request, const char *what) {
    double grace = c->process == 0 ? 0 : (c->timeout_s < 5 ? c->timeout_s : 5);
    double start = lg_time_ms(), deadline = start + (c->timeout_s + grace) * 1e3;
    for (long polls = 0;; polls++) {
        int done = 0;
        MPI_Test(request, &done, MPI_STATUS_IGNORE);
        if (done) break;
        lg_mpi_take_arrivals(c);
        lg_mpi_beat_again(c);
        if (lg_time_ms() > deadline) lg_mpi_time_out(c, what);
        if (polls > 1000) lg_sleep_ms(1); /* a long wait leaves the cores to the others */
    }
    lg_mpi_take_arrivals(c);
}

static int lg_mpi_comm_create(lg_comm **comm, const lg_mpi_group *g, lg_error *err) {
    MPI_Comm group;
    *comm = NULL;
    /* the key orders the group's processes as their members */
    MPI_Comm_split(MPI_COMM_WORLD, g->local ? 0 : MPI_UNDEFINED, g->first_local, &group);
    if (!g->local) return 0;
    int size = 0, world = 0;
    MPI_Comm_size(group, &size);
    MPI_Comm_rank(MPI_COMM_WORLD, &world);
    lg_comm *c = (lg_comm *)lg_alloc_zeroed(sizeof(lg_comm));
    if (c) {
        c->world_process = (int *)lg_alloc_zeroed(sizeof(int) * (size_t)size);
        c->arrived = (long *)lg_alloc_zeroed(sizeof(long) * (size_t)size);
        c->heard = (double *)lg_alloc_zeroed(sizeof(double) * (size_t)size);
    }
    if (!c || !c->world_process || !c->arrived || !c->heard || !g->scratch) {
        if (c) LG_FREE(c->world_process), LG_FREE(c->arrived), LG_FREE(c->heard);
        LG_FREE(c);
        MPI_Comm_free(&group);
        return lg_fail(err, g->scratch ? "out of host memory for an MPI group"
                                       : "the plan holds no MPI buffers for %s", g->name);
    }
    c->mpi = group;
    MPI_Comm_dup(group, &c->watch);
    c->send = (double *)g->scratch;
    c->recv = c->send + LG_MPI_CHUNK;
    for (int i = 0; i < LG_COMM_SIGNALS; i++) c->request[i] = MPI_REQUEST_NULL;
    c->beat_request = MPI_REQUEST_NULL;
    c->members = g->members;
    c->first_local = g->first_local;
    c->local = g->local;
    snprintf(c->name, sizeof c->name, "%s", g->name);
    c->launch = g->launch;
    c->timeout_s = g->launch && g->launch->dist_timeout > 0 ? g->launch->dist_timeout : LG_DIST_TIMEOUT;
    c->ranks_per_process = g->ranks_per_process > 0 ? g->ranks_per_process : 1;
    c->processes = size;
    MPI_Comm_rank(group, &c->process);
    MPI_Allgather(&world, 1, MPI_INT, c->world_process, 1, MPI_INT, group);
    c->beat_ms = lg_time_ms();
    for (int q = 0; q < size; q++) c->heard[q] = c->beat_ms;
    if (size * g->local != g->members) {
        MPI_Comm_free(&c->watch);
        MPI_Comm_free(&c->mpi);
        LG_FREE(c->world_process), LG_FREE(c->arrived), LG_FREE(c->heard), LG_FREE(c);
        return lg_fail(err, "an MPI group of %d members over %d processes: each must drive the "
                            "same number (here %d)", g->members, size, g->local);
    }
    *comm = c;
    return 0;
}

void lg_comm_free(lg_comm *c) {
    if (!c) return;
    if (c->beat_request != MPI_REQUEST_NULL) MPI_Wait(&c->beat_request, MPI_STATUS_IGNORE);
    MPI_Barrier(c->watch); /* every arrival message is sent: the first takes the last ones */
    lg_mpi_take_arrivals(c);
    MPI_Comm_free(&c->watch);
    MPI_Comm_free(&c->mpi);
    LG_FREE(c->world_process);
    LG_FREE(c->arrived);
    LG_FREE(c->heard);
    LG_FREE(c);
}

/* The buffers' element as an MPI type (bytes of the storage type); the caller frees it. */
static MPI_Datatype lg_mpi_type_of(lg_dtype dtype) {
    MPI_Datatype t;
    MPI_Type_contiguous((int)lg_elem_size(dtype), MPI_BYTE, &t);
    MPI_Type_commit(&t);
    return t;
}

static void lg_mpi_all_reduce_sum(lg_comm *c, int n, lg_buf *bufs, size_t count) {
    for (size_t start = 0; start < count; start += LG_MPI_CHUNK) {
        int len = (int)(count - start < LG_MPI_CHUNK ? count - start : LG_MPI_CHUNK);
        for (int k = 0; k < len; k++) {
            double sum = 0;
            for (int m = 0; m < n; m++) sum += lg_get(bufs[m], start + (size_t)k);
            c->send[k] = sum;
        }
        MPI_Request request;
        lg_mpi_arrive(c);
        MPI_Iallreduce(c->send, c->recv, len, MPI_DOUBLE, MPI_SUM, c->mpi, &request);
        lg_mpi_wait(c, &request, "all-reduce");
        for (int m = 0; m < n; m++)
            for (int k = 0; k < len; k++) lg_set(bufs[m], start + (size_t)k, (lg_real)c->recv[k]);
    }
}

/* Chunk by chunk of every piece: the send buffer holds (members, len) sums of this process's
   wholes; the process receives (local, len), its members' places. */
static void lg_mpi_reduce_scatter_sum(lg_comm *c, int n, const lg_buf *whole, lg_buf *piece,
                                      size_t piece_count) {
    size_t chunk = LG_MPI_CHUNK / (size_t)c->members;
    for (size_t start = 0; start < piece_count; start += chunk) {
        int len = (int)(piece_count - start < chunk ? piece_count - start : chunk);
        for (int i = 0; i < c->members; i++)
            for (int k = 0; k < len; k++) {
                double sum = 0;
                for (int m = 0; m < n; m++) sum += lg_get(whole[m], (size_t)i * piece_count + start + (size_t)k);
                c->send[(size_t)i * len + k] = sum;
            }
        MPI_Request request;
        lg_mpi_arrive(c);
        MPI_Ireduce_scatter_block(c->send, c->recv, n * len, MPI_DOUBLE, MPI_SUM, c->mpi, &request);
        lg_mpi_wait(c, &request, "reduce-scatter");
        for (int m = 0; m < n; m++)
            for (int k = 0; k < len; k++)
                lg_set(piece[m], start + (size_t)k, (lg_real)c->recv[(size_t)m * len + k]);
    }
}

/* The local pieces go to their places in the first local whole, MPI gathers the others' in
   place (counts in elements: a unit's piece is far below INT_MAX), the other local wholes copy
   it. */
static void lg_mpi_all_gather(lg_comm *c, int n, const lg_buf *piece, lg_buf *whole,
                              size_t piece_count) {
    for (int m = 0; m < n; m++) {
        lg_buf place = lg_at(whole[0], (size_t)(c->first_local + m) * piece_count);
        if (place.data != piece[m].data) lg_copy(NULL, place, piece[m], piece_count);
    }
    MPI_Datatype t = lg_mpi_type_of(whole[0].dtype);
    MPI_Request request;
    lg_mpi_arrive(c);
    MPI_Iallgather(MPI_IN_PLACE, 0, t, whole[0].data, (int)((size_t)n * piece_count), t, c->mpi,
                   &request);
    lg_mpi_wait(c, &request, "all-gather");
    MPI_Type_free(&t);
    for (int m = 1; m < n; m++) lg_copy(NULL, whole[m], whole[0], (size_t)c->members * piece_count);
}

static void lg_mpi_broadcast(lg_comm *c, int n, int root, lg_buf *bufs, size_t count) {
    int root_process = root / c->local, here = root - c->first_local;
    lg_buf src = here >= 0 && here < n ? bufs[here] : bufs[0];
    MPI_Datatype t = lg_mpi_type_of(src.dtype);
    const size_t most = (size_t)1 << 30;
    for (size_t start = 0; start < count; start += most) {
        size_t len = count - start < most ? count - start : most;
        MPI_Request request;
        lg_mpi_arrive(c);
        MPI_Ibcast(lg_at(src, start).data, (int)len, t, root_process, c->mpi, &request);
        lg_mpi_wait(c, &request, "broadcast");
    }
    MPI_Type_free(&t);
    for (int m = 0; m < n; m++)
        if (bufs[m].data != src.data) lg_copy(NULL, bufs[m], src, count);
}

/* CPU ranks over MPI: the _async forms start MPI's non-blocking collective (a group of which
   this process drives one member, and a reduce-scatter of at most 2^20 sums; otherwise they
   finish at once), and this completes the one that raises `signal`. Nothing elsewhere. */
static void lg_comm_await(lg_comm *c, int signal) {
    if (!c || c->request[signal] == MPI_REQUEST_NULL) return;
    lg_mpi_wait(c, &c->request[signal], c->reduce_count[signal] ? "reduce-scatter" : "all-gather");
    for (int k = 0; k < c->reduce_count[signal]; k++)
        lg_set(c->reduce_piece[signal], (size_t)k, (lg_real)c->recv[k]);
    c->reduce_count[signal] = 0;
}

/* One member here: MPI_Iallgather in place, completed by lg_comm_await. */
static void lg_mpi_all_gather_async(lg_comm *c, int n, const lg_buf *piece, lg_buf *whole,
                                    size_t piece_count, int signal) {
    if (n != 1) {
        lg_mpi_all_gather(c, n, piece, whole, piece_count);
        return;
    }
    lg_comm_await(c, signal);
    lg_buf place = lg_at(whole[0], (size_t)c->first_local * piece_count);
    if (place.data != piece[0].data) lg_copy(NULL, place, piece[0], piece_count);
    MPI_Datatype t = lg_mpi_type_of(whole[0].dtype);
    lg_mpi_arrive(c);
    MPI_Iallgather(MPI_IN_PLACE, 0, t, whole[0].data, (int)piece_count, t, c->mpi, &c->request[signal]);
    MPI_Type_free(&t); /* MPI keeps it while the collective runs */
}

/* One member here and one chunk: the sums go out by MPI_Ireduce_scatter_block, the piece
   arrives in lg_comm_await. */
static void lg_mpi_reduce_scatter_sum_async(lg_comm *c, int n, const lg_buf *whole, lg_buf *piece,
                                            size_t piece_count, int signal) {
    if (n != 1 || piece_count * (size_t)c->members > LG_MPI_CHUNK) {
        lg_mpi_reduce_scatter_sum(c, n, whole, piece, piece_count);
        return;
    }
    lg_comm_await(c, signal);
    for (size_t k = 0; k < piece_count * (size_t)c->members; k++) c->send[k] = lg_get(whole[0], k);
    c->reduce_piece[signal] = piece[0];
    c->reduce_count[signal] = (int)piece_count;
    lg_mpi_arrive(c);
    MPI_Ireduce_scatter_block(c->send, c->recv, (int)piece_count, MPI_DOUBLE, MPI_SUM, c->mpi,
                              &c->request[signal]);
}

void lg_comm_sum_doubles(lg_comm *c, double *values, int count) {
    if (!c) return;
    MPI_Request request;
    lg_mpi_arrive(c);
    MPI_Iallreduce(MPI_IN_PLACE, values, count, MPI_DOUBLE, MPI_SUM, c->mpi, &request);
    lg_mpi_wait(c, &request, "sum");
}

void lg_comm_gather_doubles(lg_comm *c, double *values, int per_process) {
    if (!c) return;
    MPI_Request request;
    lg_mpi_arrive(c);
    MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DOUBLE, values, per_process, MPI_DOUBLE, c->mpi, &request);
    lg_mpi_wait(c, &request, "gather");
}
#else
static int lg_mpi_comm_create(lg_comm **comm, const lg_mpi_group *g, lg_error *err) {
    *comm = NULL;
    return g->local ? lg_fail(err, "CPU ranks in several processes need an MPI build without CUDA "
                                "(make cpu with mpicc present)") : 0;
}

static void lg_comm_await(lg_comm *comm, int signal) {
    (void)comm;
    (void)signal;
}

#ifndef LG_CUDA /* (CUDA builds: over NCCL, litgpt_cuda.cuh) */
void lg_comm_sum_doubles(lg_comm *comm, double *values, int count) {
    (void)comm;
    (void)values;
    (void)count;
}

void lg_comm_gather_doubles(lg_comm *comm, double *values, int per_process) {
    (void)comm;
    (void)values;
    (void)per_process;
}
#endif
#endif

/* A group with communicators runs on the GPUs (litgpt_cuda.cuh, part j), or over MPI
   (processes, below). */
#ifdef LG_CUDA
#define LG_ON_COMM(comm, call, mpi_call) do { if (comm) { call; return; } } while (0)
#elif defined(LG_MPI)
#define LG_ON_COMM(comm, call, mpi_call) do { if (comm) { mpi_call; return; } } while (0)
#else
#define LG_ON_COMM(comm, call, mpi_call) (void)(comm)
#endif

/* Collectives over the members of a group, one buffer per member in member order: the shape of
   NCCL's grouped calls made from one thread. `comm` is the group's NCCL communicators on GPUs
   (lg_comm_create); NULL runs them in this process on host-visible memory: sums in lg_real,
   member by member in order, rounded once to the buffers' type. CPU ranks in several processes
   (an MPI build): `comm` is the group's MPI communicator (lg_mpi_comm_create), n the members
   this process drives and bufs theirs; sums in double, rounded once to the buffers' type. */
/* On GPUs the collectives below start after the ops queued before them on each member, and the
   ops queued after them wait for them. The _async forms instead raise `signal`
   (< LG_COMM_SIGNALS) on each member when done, and its ops wait only where
   lg_rank_await(rank, signal) says: the collective runs beside the compute. On the CPU they
   run at once and the wait is nothing. */
/* bufs[m] (count) = the sum over members of bufs */
static void lg_all_reduce_sum(lg_comm *comm, int n, lg_buf *bufs, size_t count) {
    LG_ON_COMM(comm, lg_cuda_all_reduce_sum(comm, bufs, count),
               lg_mpi_all_reduce_sum(comm, n, bufs, count));
    LG_OMP(omp parallel for)
    for (long k = 0; k < (long)count; k++) {
        lg_real sum = 0;
        for (int m = 0; m < n; m++) sum += lg_get(bufs[m], (size_t)k);
        for (int m = 0; m < n; m++) lg_set(bufs[m], (size_t)k, sum);
    }
}

/* piece[i] (piece_count) = the sum over members m of whole[m][i piece_count ..], each whole
   holding n piece_count elements */
static void lg_reduce_scatter_sum(lg_comm *comm, int n, const lg_buf *whole, lg_buf *piece,
                                  size_t piece_count) {
    LG_ON_COMM(comm, lg_cuda_reduce_scatter_sum(comm, whole, piece, piece_count),
               lg_mpi_reduce_scatter_sum(comm, n, whole, piece, piece_count));
    for (int i = 0; i < n; i++) {
        size_t start = (size_t)i * piece_count;
        LG_OMP(omp parallel for)
        for (long k = 0; k < (long)piece_count; k++) {
            lg_real sum = 0;
            for (int m = 0; m < n; m++) sum += lg_get(whole[m], start + (size_t)k);
            lg_set(piece[i], (size_t)k, sum);
        }
    }
}

/* whole[m][i piece_count ..] = piece[i] for every m; piece[i] may be that place of whole[i]
   (in place) */
static void lg_all_gather(lg_comm *comm, int n, const lg_buf *piece, lg_buf *whole,
                          size_t piece_count) {
    LG_ON_COMM(comm, lg_cuda_all_gather(comm, piece, whole, piece_count),
               lg_mpi_all_gather(comm, n, piece, whole, piece_count));
    for (int m = 0; m < n; m++)
        for (int i = 0; i < n; i++) {
            lg_buf place = lg_at(whole[m], (size_t)i * piece_count);
            if (place.data != piece[i].data) lg_copy(NULL, place, piece[i], piece_count);
        }
}

static void lg_all_gather_async(lg_comm *comm, int n, const lg_buf *piece, lg_buf *whole,
                                size_t piece_count, int signal) {
    LG_ON_COMM(comm, lg_cuda_all_gather_async(comm, piece, whole, piece_count, signal),
               lg_mpi_all_gather_async(comm, n, piece, whole, piece_count, signal));
    lg_all_gather(NULL, n, piece, whole, piece_count);
    (void)signal;
}

static void lg_reduce_scatter_sum_async(lg_comm *comm, int n, const lg_buf *whole, lg_buf *piece,
                                        size_t piece_count, int signal) {
    LG_ON_COMM(comm, lg_cuda_reduce_scatter_sum_async(comm, whole, piece, piece_count, signal),
               lg_mpi_reduce_scatter_sum_async(comm, n, whole, piece, piece_count, signal));
    lg_reduce_scatter_sum(NULL, n, whole, piece, piece_count);
    (void)signal;
}

static void lg_rank_await(const lg_rank *rank, int signal) {
#ifdef LG_CUDA
    if (rank->backend == LG_BACKEND_CUDA) lg_cuda_await(rank->cuda, signal);
#endif
    (void)rank;
    (void)signal;
}

/* bufs[m] = bufs[root] */
static void lg_broadcast(lg_comm *comm, int n, int root, lg_buf *bufs, size_t count) {
    LG_ON_COMM(comm, lg_cuda_broadcast(comm, root, bufs, count),
               lg_mpi_broadcast(comm, n, root, bufs, count));
    for (int m = 0; m < n; m++)
        if (m != root) lg_copy(NULL, bufs[m], bufs[root], count);
}

/* 11. tokenizer ------------------------------------------------------------------------------- */

/* --- Unicode ---------------------------------------------------------------------------------- */

/* Unicode 17.0 (tools/unicode_tables.js) */
/* \p{L}: 684 ranges, first and last code point of each */
static const uint32_t lg_unicode_letters[1368] = {
    0x41,0x5a, 0x61,0x7a, 0xaa,0xaa, 0xb5,0xb5, 0xba,0xba, 0xc0,0xd6, 0xd8,0xf6, 0xf8,0x2c1,
    0x2c6,0x2d1, 0x2e0,0x2e4, 0x2ec,0x2ec, 0x2ee,0x2ee, 0x370,0x374, 0x376,0x377, 0x37a,0x37d,
    0x37f,0x37f, 0x386,0x386, 0x388,0x38a, 0x38c,0x38c, 0x38e,0x3a1, 0x3a3,0x3f5, 0x3f7,0x481,
    0x48a,0x52f, 0x531,0x556, 0x559,0x559, 0x560,0x588, 0x5d0,0x5ea, 0x5ef,0x5f2, 0x620,0x64a,
    0x66e,0x66f, 0x671,0x6d3, 0x6d5,0x6d5, 0x6e5,0x6e6, 0x6ee,0x6ef, 0x6fa,0x6fc, 0x6ff,0x6ff,
    0x710,0x710, 0x712,0x72f, 0x74d,0x7a5, 0x7b1,0x7b1, 0x7ca,0x7ea, 0x7f4,0x7f5, 0x7fa,0x7fa,
    0x800,0x815, 0x81a,0x81a, 0x824,0x824, 0x828,0x828, 0x840,0x858, 0x860,0x86a, 0x870,0x887,
    0x889,0x88f, 0x8a0,0x8c9, 0x904,0x939, 0x93d,0x93d, 0x950,0x950, 0x958,0x961, 0x971,0x980,
    0x985,0x98c, 0x98f,0x990, 0x993,0x9a8, 0x9aa,0x9b0, 0x9b2,0x9b2, 0x9b6,0x9b9, 0x9bd,0x9bd,
    0x9ce,0x9ce, 0x9dc,0x9dd, 0x9df,0x9e1, 0x9f0,0x9f1, 0x9fc,0x9fc, 0xa05,0xa0a, 0xa0f,0xa10,
    0xa13,0xa28, 0xa2a,0xa30, 0xa32,0xa33, 0xa35,0xa36, 0xa38,0xa39, 0xa59,0xa5c, 0xa5e,0xa5e,
    0xa72,0xa74, 0xa85,0xa8d, 0xa8f,0xa91, 0xa93,0xaa8, 0xaaa,0xab0, 0xab2,0xab3, 0xab5,0xab9,
    0xabd,0xabd, 0xad0,0xad0, 0xae0,0xae1, 0xaf9,0xaf9, 0xb05,0xb0c, 0xb0f,0xb10, 0xb13,0xb28,
    0xb2a,0xb30, 0xb32,0xb33, 0xb35,0xb39, 0xb3d,0xb3d, 0xb5c,0xb5d, 0xb5f,0xb61, 0xb71,0xb71,
    0xb83,0xb83, 0xb85,0xb8a, 0xb8e,0xb90, 0xb92,0xb95, 0xb99,0xb9a, 0xb9c,0xb9c, 0xb9e,0xb9f,
    0xba3,0xba4, 0xba8,0xbaa, 0xbae,0xbb9, 0xbd0,0xbd0, 0xc05,0xc0c, 0xc0e,0xc10, 0xc12,0xc28,
    0xc2a,0xc39, 0xc3d,0xc3d, 0xc58,0xc5a, 0xc5c,0xc5d, 0xc60,0xc61, 0xc80,0xc80, 0xc85,0xc8c,
    0xc8e,0xc90, 0xc92,0xca8, 0xcaa,0xcb3, 0xcb5,0xcb9, 0xcbd,0xcbd, 0xcdc,0xcde, 0xce0,0xce1,
    0xcf1,0xcf2, 0xd04,0xd0c, 0xd0e,0xd10, 0xd12,0xd3a, 0xd3d,0xd3d, 0xd4e,0xd4e, 0xd54,0xd56,
    0xd5f,0xd61, 0xd7a,0xd7f, 0xd85,0xd96, 0xd9a,0xdb1, 0xdb3,0xdbb, 0xdbd,0xdbd, 0xdc0,0xdc6,
    0xe01,0xe30, 0xe32,0xe33, 0xe40,0xe46, 0xe81,0xe82, 0xe84,0xe84, 0xe86,0xe8a, 0xe8c,0xea3,
    0xea5,0xea5, 0xea7,0xeb0, 0xeb2,0xeb3, 0xebd,0xebd, 0xec0,0xec4, 0xec6,0xec6, 0xedc,0xedf,
    0xf00,0xf00, 0xf40,0xf47, 0xf49,0xf6c, 0xf88,0xf8c, 0x1000,0x102a, 0x103f,0x103f,
    0x1050,0x1055, 0x105a,0x105d, 0x1061,0x1061, 0x1065,0x1066, 0x106e,0x1070, 0x1075,0x1081,
    0x108e,0x108e, 0x10a0,0x10c5, 0x10c7,0x10c7, 0x10cd,0x10cd, 0x10d0,0x10fa, 0x10fc,0x1248,
    0x124a,0x124d, 0x1250,0x1256, 0x1258,0x1258, 0x125a,0x125d, 0x1260,0x1288, 0x128a,0x128d,
    0x1290,0x12b0, 0x12b2,0x12b5, 0x12b8,0x12be, 0x12c0,0x12c0, 0x12c2,0x12c5, 0x12c8,0x12d6,
    0x12d8,0x1310, 0x1312,0x1315, 0x1318,0x135a, 0x1380,0x138f, 0x13a0,0x13f5, 0x13f8,0x13fd,
    0x1401,0x166c, 0x166f,0x167f, 0x1681,0x169a, 0x16a0,0x16ea, 0x16f1,0x16f8, 0x1700,0x1711,
    0x171f,0x1731, 0x1740,0x1751, 0x1760,0x176c, 0x176e,0x1770, 0x1780,0x17b3, 0x17d7,0x17d7,
    0x17dc,0x17dc, 0x1820,0x1878, 0x1880,0x1884, 0x1887,0x18a8, 0x18aa,0x18aa, 0x18b0,0x18f5,
    0x1900,0x191e, 0x1950,0x196d, 0x1970,0x1974, 0x1980,0x19ab, 0x19b0,0x19c9, 0x1a00,0x1a16,
    0x1a20,0x1a54, 0x1aa7,0x1aa7, 0x1b05,0x1b33, 0x1b45,0x1b4c, 0x1b83,0x1ba0, 0x1bae,0x1baf,
    0x1bba,0x1be5, 0x1c00,0x1c23, 0x1c4d,0x1c4f, 0x1c5a,0x1c7d, 0x1c80,0x1c8a, 0x1c90,0x1cba,
    0x1cbd,0x1cbf, 0x1ce9,0x1cec, 0x1cee,0x1cf3, 0x1cf5,0x1cf6, 0x1cfa,0x1cfa, 0x1d00,0x1dbf,
    0x1e00,0x1f15, 0x1f18,0x1f1d, 0x1f20,0x1f45, 0x1f48,0x1f4d, 0x1f50,0x1f57, 0x1f59,0x1f59,
    0x1f5b,0x1f5b, 0x1f5d,0x1f5d, 0x1f5f,0x1f7d, 0x1f80,0x1fb4, 0x1fb6,0x1fbc, 0x1fbe,0x1fbe,
    0x1fc2,0x1fc4, 0x1fc6,0x1fcc, 0x1fd0,0x1fd3, 0x1fd6,0x1fdb, 0x1fe0,0x1fec, 0x1ff2,0x1ff4,
    0x1ff6,0x1ffc, 0x2071,0x2071, 0x207f,0x207f, 0x2090,0x209c, 0x2102,0x2102, 0x2107,0x2107,
    0x210a,0x2113, 0x2115,0x2115, 0x2119,0x211d, 0x2124,0x2124, 0x2126,0x2126, 0x2128,0x2128,
    0x212a,0x212d, 0x212f,0x2139, 0x213c,0x213f, 0x2145,0x2149, 0x214e,0x214e, 0x2183,0x2184,
    0x2c00,0x2ce4, 0x2ceb,0x2cee, 0x2cf2,0x2cf3, 0x2d00,0x2d25, 0x2d27,0x2d27, 0x2d2d,0x2d2d,
    0x2d30,0x2d67, 0x2d6f,0x2d6f, 0x2d80,0x2d96, 0x2da0,0x2da6, 0x2da8,0x2dae, 0x2db0,0x2db6,
    0x2db8,0x2dbe, 0x2dc0,0x2dc6, 0x2dc8,0x2dce, 0x2dd0,0x2dd6, 0x2dd8,0x2dde, 0x2e2f,0x2e2f,
    0x3005,0x3006, 0x3031,0x3035, 0x303b,0x303c, 0x3041,0x3096, 0x309d,0x309f, 0x30a1,0x30fa,
    0x30fc,0x30ff, 0x3105,0x312f, 0x3131,0x318e, 0x31a0,0x31bf, 0x31f0,0x31ff, 0x3400,0x4dbf,
    0x4e00,0xa48c, 0xa4d0,0xa4fd, 0xa500,0xa60c, 0xa610,0xa61f, 0xa62a,0xa62b, 0xa640,0xa66e,
    0xa67f,0xa69d, 0xa6a0,0xa6e5, 0xa717,0xa71f, 0xa722,0xa788, 0xa78b,0xa7dc, 0xa7f1,0xa801,
    0xa803,0xa805, 0xa807,0xa80a, 0xa80c,0xa822, 0xa840,0xa873, 0xa882,0xa8b3, 0xa8f2,0xa8f7,
    0xa8fb,0xa8fb, 0xa8fd,0xa8fe, 0xa90a,0xa925, 0xa930,0xa946, 0xa960,0xa97c, 0xa984,0xa9b2,
    0xa9cf,0xa9cf, 0xa9e0,0xa9e4, 0xa9e6,0xa9ef, 0xa9fa,0xa9fe, 0xaa00,0xaa28, 0xaa40,0xaa42,
    0xaa44,0xaa4b, 0xaa60,0xaa76, 0xaa7a,0xaa7a, 0xaa7e,0xaaaf, 0xaab1,0xaab1, 0xaab5,0xaab6,
    0xaab9,0xaabd, 0xaac0,0xaac0, 0xaac2,0xaac2, 0xaadb,0xaadd, 0xaae0,0xaaea, 0xaaf2,0xaaf4,
    0xab01,0xab06, 0xab09,0xab0e, 0xab11,0xab16, 0xab20,0xab26, 0xab28,0xab2e, 0xab30,0xab5a,
    0xab5c,0xab69, 0xab70,0xabe2, 0xac00,0xd7a3, 0xd7b0,0xd7c6, 0xd7cb,0xd7fb, 0xf900,0xfa6d,
    0xfa70,0xfad9, 0xfb00,0xfb06, 0xfb13,0xfb17, 0xfb1d,0xfb1d, 0xfb1f,0xfb28, 0xfb2a,0xfb36,
    0xfb38,0xfb3c, 0xfb3e,0xfb3e, 0xfb40,0xfb41, 0xfb43,0xfb44, 0xfb46,0xfbb1, 0xfbd3,0xfd3d,
    0xfd50,0xfd8f, 0xfd92,0xfdc7, 0xfdf0,0xfdfb, 0xfe70,0xfe74, 0xfe76,0xfefc, 0xff21,0xff3a,
    0xff41,0xff5a, 0xff66,0xffbe, 0xffc2,0xffc7, 0xffca,0xffcf, 0xffd2,0xffd7, 0xffda,0xffdc,
    0x10000,0x1000b, 0x1000d,0x10026, 0x10028,0x1003a, 0x1003c,0x1003d, 0x1003f,0x1004d,
    0x10050,0x1005d, 0x10080,0x100fa, 0x10280,0x1029c, 0x102a0,0x102d0, 0x10300,0x1031f,
    0x1032d,0x10340, 0x10342,0x10349, 0x10350,0x10375, 0x10380,0x1039d, 0x103a0,0x103c3,
    0x103c8,0x103cf, 0x10400,0x1049d, 0x104b0,0x104d3, 0x104d8,0x104fb, 0x10500,0x10527,
    0x10530,0x10563, 0x10570,0x1057a, 0x1057c,0x1058a, 0x1058c,0x10592, 0x10594,0x10595,
    0x10597,0x105a1, 0x105a3,0x105b1, 0x105b3,0x105b9, 0x105bb,0x105bc, 0x105c0,0x105f3,
    0x10600,0x10736, 0x10740,0x10755, 0x10760,0x10767, 0x10780,0x10785, 0x10787,0x107b0,
    0x107b2,0x107ba, 0x10800,0x10805, 0x10808,0x10808, 0x1080a,0x10835, 0x10837,0x10838,
    0x1083c,0x1083c, 0x1083f,0x10855, 0x10860,0x10876, 0x10880,0x1089e, 0x108e0,0x108f2,
    0x108f4,0x108f5, 0x10900,0x10915, 0x10920,0x10939, 0x10940,0x10959, 0x10980,0x109b7,
    0x109be,0x109bf, 0x10a00,0x10a00, 0x10a10,0x10a13, 0x10a15,0x10a17, 0x10a19,0x10a35,
    0x10a60,0x10a7c, 0x10a80,0x10a9c, 0x10ac0,0x10ac7, 0x10ac9,0x10ae4, 0x10b00,0x10b35,
    0x10b40,0x10b55, 0x10b60,0x10b72, 0x10b80,0x10b91, 0x10c00,0x10c48, 0x10c80,0x10cb2,
    0x10cc0,0x10cf2, 0x10d00,0x10d23, 0x10d4a,0x10d65, 0x10d6f,0x10d85, 0x10e80,0x10ea9,
    0x10eb0,0x10eb1, 0x10ec2,0x10ec7, 0x10f00,0x10f1c, 0x10f27,0x10f27, 0x10f30,0x10f45,
    0x10f70,0x10f81, 0x10fb0,0x10fc4, 0x10fe0,0x10ff6, 0x11003,0x11037, 0x11071,0x11072,
    0x11075,0x11075, 0x11083,0x110af, 0x110d0,0x110e8, 0x11103,0x11126, 0x11144,0x11144,
    0x11147,0x11147, 0x11150,0x11172, 0x11176,0x11176, 0x11183,0x111b2, 0x111c1,0x111c4,
    0x111da,0x111da, 0x111dc,0x111dc, 0x11200,0x11211, 0x11213,0x1122b, 0x1123f,0x11240,
    0x11280,0x11286, 0x11288,0x11288, 0x1128a,0x1128d, 0x1128f,0x1129d, 0x1129f,0x112a8,
    0x112b0,0x112de, 0x11305,0x1130c, 0x1130f,0x11310, 0x11313,0x11328, 0x1132a,0x11330,
    0x11332,0x11333, 0x11335,0x11339, 0x1133d,0x1133d, 0x11350,0x11350, 0x1135d,0x11361,
    0x11380,0x11389, 0x1138b,0x1138b, 0x1138e,0x1138e, 0x11390,0x113b5, 0x113b7,0x113b7,
    0x113d1,0x113d1, 0x113d3,0x113d3, 0x11400,0x11434, 0x11447,0x1144a, 0x1145f,0x11461,
    0x11480,0x114af, 0x114c4,0x114c5, 0x114c7,0x114c7, 0x11580,0x115ae, 0x115d8,0x115db,
    0x11600,0x1162f, 0x11644,0x11644, 0x11680,0x116aa, 0x116b8,0x116b8, 0x11700,0x1171a,
    0x11740,0x11746, 0x11800,0x1182b, 0x118a0,0x118df, 0x118ff,0x11906, 0x11909,0x11909,
    0x1190c,0x11913, 0x11915,0x11916, 0x11918,0x1192f, 0x1193f,0x1193f, 0x11941,0x11941,
    0x119a0,0x119a7, 0x119aa,0x119d0, 0x119e1,0x119e1, 0x119e3,0x119e3, 0x11a00,0x11a00,
    0x11a0b,0x11a32, 0x11a3a,0x11a3a, 0x11a50,0x11a50, 0x11a5c,0x11a89, 0x11a9d,0x11a9d,
    0x11ab0,0x11af8, 0x11bc0,0x11be0, 0x11c00,0x11c08, 0x11c0a,0x11c2e, 0x11c40,0x11c40,
    0x11c72,0x11c8f, 0x11d00,0x11d06, 0x11d08,0x11d09, 0x11d0b,0x11d30, 0x11d46,0x11d46,
    0x11d60,0x11d65, 0x11d67,0x11d68, 0x11d6a,0x11d89, 0x11d98,0x11d98, 0x11db0,0x11ddb,
    0x11ee0,0x11ef2, 0x11f02,0x11f02, 0x11f04,0x11f10, 0x11f12,0x11f33, 0x11fb0,0x11fb0,
    0x12000,0x12399, 0x12480,0x12543, 0x12f90,0x12ff0, 0x13000,0x1342f, 0x13441,0x13446,
    0x13460,0x143fa, 0x14400,0x14646, 0x16100,0x1611d, 0x16800,0x16a38, 0x16a40,0x16a5e,
    0x16a70,0x16abe, 0x16ad0,0x16aed, 0x16b00,0x16b2f, 0x16b40,0x16b43, 0x16b63,0x16b77,
    0x16b7d,0x16b8f, 0x16d40,0x16d6c, 0x16e40,0x16e7f, 0x16ea0,0x16eb8, 0x16ebb,0x16ed3,
    0x16f00,0x16f4a, 0x16f50,0x16f50, 0x16f93,0x16f9f, 0x16fe0,0x16fe1, 0x16fe3,0x16fe3,
    0x16ff2,0x16ff3, 0x17000,0x18cd5, 0x18cff,0x18d1e, 0x18d80,0x18df2, 0x1aff0,0x1aff3,
    0x1aff5,0x1affb, 0x1affd,0x1affe, 0x1b000,0x1b122, 0x1b132,0x1b132, 0x1b150,0x1b152,
    0x1b155,0x1b155, 0x1b164,0x1b167, 0x1b170,0x1b2fb, 0x1bc00,0x1bc6a, 0x1bc70,0x1bc7c,
    0x1bc80,0x1bc88, 0x1bc90,0x1bc99, 0x1d400,0x1d454, 0x1d456,0x1d49c, 0x1d49e,0x1d49f,
    0x1d4a2,0x1d4a2, 0x1d4a5,0x1d4a6, 0x1d4a9,0x1d4ac, 0x1d4ae,0x1d4b9, 0x1d4bb,0x1d4bb,
    0x1d4bd,0x1d4c3, 0x1d4c5,0x1d505, 0x1d507,0x1d50a, 0x1d50d,0x1d514, 0x1d516,0x1d51c,
    0x1d51e,0x1d539, 0x1d53b,0x1d53e, 0x1d540,0x1d544, 0x1d546,0x1d546, 0x1d54a,0x1d550,
    0x1d552,0x1d6a5, 0x1d6a8,0x1d6c0, 0x1d6c2,0x1d6da, 0x1d6dc,0x1d6fa, 0x1d6fc,0x1d714,
    0x1d716,0x1d734, 0x1d736,0x1d74e, 0x1d750,0x1d76e, 0x1d770,0x1d788, 0x1d78a,0x1d7a8,
    0x1d7aa,0x1d7c2, 0x1d7c4,0x1d7cb, 0x1df00,0x1df1e, 0x1df25,0x1df2a, 0x1e030,0x1e06d,
    0x1e100,0x1e12c, 0x1e137,0x1e13d, 0x1e14e,0x1e14e, 0x1e290,0x1e2ad, 0x1e2c0,0x1e2eb,
    0x1e4d0,0x1e4eb, 0x1e5d0,0x1e5ed, 0x1e5f0,0x1e5f0, 0x1e6c0,0x1e6de, 0x1e6e0,0x1e6e2,
    0x1e6e4,0x1e6e5, 0x1e6e7,0x1e6ed, 0x1e6f0,0x1e6f4, 0x1e6fe,0x1e6ff, 0x1e7e0,0x1e7e6,
    0x1e7e8,0x1e7eb, 0x1e7ed,0x1e7ee, 0x1e7f0,0x1e7fe, 0x1e800,0x1e8c4, 0x1e900,0x1e943,
    0x1e94b,0x1e94b, 0x1ee00,0x1ee03, 0x1ee05,0x1ee1f, 0x1ee21,0x1ee22, 0x1ee24,0x1ee24,
    0x1ee27,0x1ee27, 0x1ee29,0x1ee32, 0x1ee34,0x1ee37, 0x1ee39,0x1ee39, 0x1ee3b,0x1ee3b,
    0x1ee42,0x1ee42, 0x1ee47,0x1ee47, 0x1ee49,0x1ee49, 0x1ee4b,0x1ee4b, 0x1ee4d,0x1ee4f,
    0x1ee51,0x1ee52, 0x1ee54,0x1ee54, 0x1ee57,0x1ee57, 0x1ee59,0x1ee59, 0x1ee5b,0x1ee5b,
    0x1ee5d,0x1ee5d, 0x1ee5f,0x1ee5f, 0x1ee61,0x1ee62, 0x1ee64,0x1ee64, 0x1ee67,0x1ee6a,
    0x1ee6c,0x1ee72, 0x1ee74,0x1ee77, 0x1ee79,0x1ee7c, 0x1ee7e,0x1ee7e, 0x1ee80,0x1ee89,
    0x1ee8b,0x1ee9b, 0x1eea1,0x1eea3, 0x1eea5,0x1eea9, 0x1eeab,0x1eebb, 0x20000,0x2a6df,
    0x2a700,0x2b81d, 0x2b820,0x2cead, 0x2ceb0,0x2ebe0, 0x2ebf0,0x2ee5d, 0x2f800,0x2fa1d,
    0x30000,0x3134a, 0x31350,0x33479,
};

/* \p{N}: 146 ranges, first and last code point of each */
static const uint32_t lg_unicode_numbers[292] = {
    0x30,0x39, 0xb2,0xb3, 0xb9,0xb9, 0xbc,0xbe, 0x660,0x669, 0x6f0,0x6f9, 0x7c0,0x7c9, 0x966,0x96f,
    0x9e6,0x9ef, 0x9f4,0x9f9, 0xa66,0xa6f, 0xae6,0xaef, 0xb66,0xb6f, 0xb72,0xb77, 0xbe6,0xbf2,
    0xc66,0xc6f, 0xc78,0xc7e, 0xce6,0xcef, 0xd58,0xd5e, 0xd66,0xd78, 0xde6,0xdef, 0xe50,0xe59,
    0xed0,0xed9, 0xf20,0xf33, 0x1040,0x1049, 0x1090,0x1099, 0x1369,0x137c, 0x16ee,0x16f0,
    0x17e0,0x17e9, 0x17f0,0x17f9, 0x1810,0x1819, 0x1946,0x194f, 0x19d0,0x19da, 0x1a80,0x1a89,
    0x1a90,0x1a99, 0x1b50,0x1b59, 0x1bb0,0x1bb9, 0x1c40,0x1c49, 0x1c50,0x1c59, 0x2070,0x2070,
    0x2074,0x2079, 0x2080,0x2089, 0x2150,0x2182, 0x2185,0x2189, 0x2460,0x249b, 0x24ea,0x24ff,
    0x2776,0x2793, 0x2cfd,0x2cfd, 0x3007,0x3007, 0x3021,0x3029, 0x3038,0x303a, 0x3192,0x3195,
    0x3220,0x3229, 0x3248,0x324f, 0x3251,0x325f, 0x3280,0x3289, 0x32b1,0x32bf, 0xa620,0xa629,
    0xa6e6,0xa6ef, 0xa830,0xa835, 0xa8d0,0xa8d9, 0xa900,0xa909, 0xa9d0,0xa9d9, 0xa9f0,0xa9f9,
    0xaa50,0xaa59, 0xabf0,0xabf9, 0xff10,0xff19, 0x10107,0x10133, 0x10140,0x10178, 0x1018a,0x1018b,
    0x102e1,0x102fb, 0x10320,0x10323, 0x10341,0x10341, 0x1034a,0x1034a, 0x103d1,0x103d5,
    0x104a0,0x104a9, 0x10858,0x1085f, 0x10879,0x1087f, 0x108a7,0x108af, 0x108fb,0x108ff,
    0x10916,0x1091b, 0x109bc,0x109bd, 0x109c0,0x109cf, 0x109d2,0x109ff, 0x10a40,0x10a48,
    0x10a7d,0x10a7e, 0x10a9d,0x10a9f, 0x10aeb,0x10aef, 0x10b58,0x10b5f, 0x10b78,0x10b7f,
    0x10ba9,0x10baf, 0x10cfa,0x10cff, 0x10d30,0x10d39, 0x10d40,0x10d49, 0x10e60,0x10e7e,
    0x10f1d,0x10f26, 0x10f51,0x10f54, 0x10fc5,0x10fcb, 0x11052,0x1106f, 0x110f0,0x110f9,
    0x11136,0x1113f, 0x111d0,0x111d9, 0x111e1,0x111f4, 0x112f0,0x112f9, 0x11450,0x11459,
    0x114d0,0x114d9, 0x11650,0x11659, 0x116c0,0x116c9, 0x116d0,0x116e3, 0x11730,0x1173b,
    0x118e0,0x118f2, 0x11950,0x11959, 0x11bf0,0x11bf9, 0x11c50,0x11c6c, 0x11d50,0x11d59,
    0x11da0,0x11da9, 0x11de0,0x11de9, 0x11f50,0x11f59, 0x11fc0,0x11fd4, 0x12400,0x1246e,
    0x16130,0x16139, 0x16a60,0x16a69, 0x16ac0,0x16ac9, 0x16b50,0x16b59, 0x16b5b,0x16b61,
    0x16d70,0x16d79, 0x16e80,0x16e96, 0x16ff4,0x16ff6, 0x1ccf0,0x1ccf9, 0x1d2c0,0x1d2d3,
    0x1d2e0,0x1d2f3, 0x1d360,0x1d378, 0x1d7ce,0x1d7ff, 0x1e140,0x1e149, 0x1e2f0,0x1e2f9,
    0x1e4f0,0x1e4f9, 0x1e5f1,0x1e5fa, 0x1e8c7,0x1e8cf, 0x1e950,0x1e959, 0x1ec71,0x1ecab,
    0x1ecad,0x1ecaf, 0x1ecb1,0x1ecb4, 0x1ed01,0x1ed2d, 0x1ed2f,0x1ed3d, 0x1f100,0x1f10c,
    0x1fbf0,0x1fbf9,
};

static int lg_in_ranges(const uint32_t *ranges, int n_ranges, uint32_t cp) {
    int lo = 0, hi = n_ranges - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        if (cp < ranges[2 * mid]) hi = mid - 1;
        else if (cp > ranges[2 * mid + 1]) lo = mid + 1;
        else return 1;
    }
    return 0;
}

static int lg_is_letter(uint32_t cp) {
    return lg_in_ranges(lg_unicode_letters, (int)(sizeof lg_unicode_letters / 8), cp);
}

static int lg_is_number(uint32_t cp) {
    return lg_in_ranges(lg_unicode_numbers, (int)(sizeof lg_unicode_numbers / 8), cp);
}

/* \s: Unicode White_Space; JavaScript's differs in U+0085 (not space) and U+FEFF (space). */
static int lg_is_space(uint32_t cp, int js) {
    if ((cp >= 9 && cp <= 13) || cp == ' ' || cp == 0xA0 || cp == 0x1680 ||
        (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
        cp == 0x205F || cp == 0x3000)
        return 1;
    return js ? cp == 0xFEFF : cp == 0x85;
}

/* Decodes one UTF-8 character at s (n bytes left); malformed bytes decode one at a time as
   0x110000 + byte, which no category holds. *size: its bytes. */
static uint32_t lg_utf8_next(const unsigned char *s, size_t n, int *size) {
    int len = s[0] < 0x80 ? 1 : (s[0] & 0xE0) == 0xC0 ? 2 : (s[0] & 0xF0) == 0xE0 ? 3
            : (s[0] & 0xF8) == 0xF0 ? 4 : 0;
    uint32_t cp = len == 1 ? s[0] : len == 2 ? s[0] & 0x1Fu : len == 3 ? s[0] & 0x0Fu : s[0] & 0x07u;
    if (len == 0 || (size_t)len > n) { *size = 1; return 0x110000u + s[0]; }
    for (int i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) { *size = 1; return 0x110000u + s[0]; }
        cp = cp << 6 | (s[i] & 0x3Fu);
    }
    static const uint32_t smallest[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < smallest[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
        *size = 1;
        return 0x110000u + s[0];
    }
    *size = len;
    return cp;
}

/* --- normalizers: what tokenizer.json's "normalizer" does to text before it is split -------- */

#include "litgpt_unicode.h" /* generated: tools/make_unicode_tables.py */

/* Code points of text; a byte of invalid UTF-8 stays itself (0x110000 + the byte). */
typedef struct {
    uint32_t *cp; /* (n) */
    size_t n, cap;
} lg_codepoints;

static int lg_codepoints_push(lg_codepoints *c, uint32_t cp) {
    if (c->n == c->cap) {
        size_t cap = c->cap ? 2 * c->cap : 64;
        uint32_t *grown = (uint32_t *)LG_MALLOC(sizeof(uint32_t) * cap);
        if (!grown) return -1;
        if (c->cp) memcpy(grown, c->cp, sizeof(uint32_t) * c->n);
        LG_FREE(c->cp);
        c->cp = grown;
        c->cap = cap;
    }
    c->cp[c->n++] = cp;
    return 0;
}

/* The row of table (rows of `width` uint32, sorted by their first `keys`) matching key, or
   NULL: a binary search. */
static const uint32_t *lg_unicode_row(const uint32_t *table, size_t rows, int width, int keys,
                                      const uint32_t *key) {
    size_t lo = 0, hi = rows;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        const uint32_t *row = table + mid * (size_t)width;
        int cmp = row[0] < key[0] ? -1 : row[0] > key[0] ? 1
                : keys < 2 ? 0 : row[1] < key[1] ? -1 : row[1] > key[1] ? 1 : 0;
        if (cmp == 0) return row;
        if (cmp < 0) lo = mid + 1;
        else hi = mid;
    }
    return NULL;
}
#define LG_UNICODE_ROWS(t) (sizeof t / sizeof t[0])

static int lg_unicode_combining_class(uint32_t cp) {
    size_t lo = 0, hi = LG_UNICODE_ROWS(lg_unicode_combining);
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (cp < lg_unicode_combining[mid][0]) hi = mid;
        else if (cp > lg_unicode_combining[mid][1]) lo = mid + 1;
        else return (int)lg_unicode_combining[mid][2];
    }
    return 0;
}

/* Hangul syllables, by Unicode's formula: S = 0xAC00 + (L * 21 + V) * 28 + T. */
enum { LG_HANGUL_S = 0xAC00, LG_HANGUL_L = 0x1100, LG_HANGUL_V = 0x1161, LG_HANGUL_T = 0x11A7,
       LG_HANGUL_V_COUNT = 21, LG_HANGUL_T_COUNT = 28, LG_HANGUL_COUNT = 11172 };

/* cp's full decomposition (compat: NFKD's, else NFD's) appended to out. */
static int lg_unicode_decompose(uint32_t cp, int compat, lg_codepoints *out) {
    if (cp >= LG_HANGUL_S && cp < LG_HANGUL_S + LG_HANGUL_COUNT) {
        uint32_t s = cp - LG_HANGUL_S, t = s % LG_HANGUL_T_COUNT;
        int rc = lg_codepoints_push(out, LG_HANGUL_L + s / (LG_HANGUL_V_COUNT * LG_HANGUL_T_COUNT));
        rc |= lg_codepoints_push(out, LG_HANGUL_V + s % (LG_HANGUL_V_COUNT * LG_HANGUL_T_COUNT) / LG_HANGUL_T_COUNT);
        return t ? rc | lg_codepoints_push(out, LG_HANGUL_T + t) : rc;
    }
    const uint32_t *row = lg_unicode_row(&lg_unicode_decompositions[0][0],
                                         LG_UNICODE_ROWS(lg_unicode_decompositions), 5, 1, &cp);
    uint32_t first = row ? row[compat ? 3 : 1] : 0, n = row ? row[compat ? 4 : 2] : 0;
    if (n == 0) return lg_codepoints_push(out, cp);
    int rc = 0;
    for (uint32_t i = 0; i < n; i++) rc |= lg_codepoints_push(out, lg_unicode_pool[first + i]);
    return rc;
}

/* The primary composite of a and b, or 0. */
static uint32_t lg_unicode_compose_pair(uint32_t a, uint32_t b) {
    if (a >= LG_HANGUL_L && a < LG_HANGUL_L + 19 && b >= LG_HANGUL_V && b < LG_HANGUL_V + LG_HANGUL_V_COUNT)
        return LG_HANGUL_S + ((a - LG_HANGUL_L) * LG_HANGUL_V_COUNT + (b - LG_HANGUL_V)) * LG_HANGUL_T_COUNT;
    if (a >= LG_HANGUL_S && a < LG_HANGUL_S + LG_HANGUL_COUNT && (a - LG_HANGUL_S) % LG_HANGUL_T_COUNT == 0 &&
        b > LG_HANGUL_T && b < LG_HANGUL_T + LG_HANGUL_T_COUNT)
        return a + (b - LG_HANGUL_T);
    uint32_t key[2] = {a, b};
    const uint32_t *row = lg_unicode_row(&lg_unicode_compositions[0][0],
                                         LG_UNICODE_ROWS(lg_unicode_compositions), 3, 2, key);
    return row ? row[2] : 0;
}

/* Canonical order (each run of combining marks sorted by class, stably), then canonical
   composition (Unicode's algorithm: a mark joins the last starter unless blocked). */
static void lg_unicode_order_and_compose(lg_codepoints *d) {
    for (size_t i = 1; i < d->n; i++)
        for (size_t j = i; j > 0 && lg_unicode_combining_class(d->cp[j]) &&
                           lg_unicode_combining_class(d->cp[j - 1]) > lg_unicode_combining_class(d->cp[j]); j--) {
            uint32_t t = d->cp[j];
            d->cp[j] = d->cp[j - 1];
            d->cp[j - 1] = t;
        }
    if (d->n == 0) return;
    size_t starter = 0, kept = 1;
    int last = lg_unicode_combining_class(d->cp[0]) ? 256 : 0;
    for (size_t i = 1; i < d->n; i++) {
        uint32_t c = d->cp[i], composite = lg_unicode_compose_pair(d->cp[starter], c);
        int cls = lg_unicode_combining_class(c);
        if (composite && (last < cls || last == 0)) { d->cp[starter] = composite; continue; }
        if (cls == 0) starter = kept;
        last = cls;
        d->cp[kept++] = c;
    }
    d->n = kept;
}

/* NFC (compat 0) or NFKC (compat 1) of the code points in c, in place. */
static int lg_unicode_nfc(lg_codepoints *c, int compat) {
    lg_codepoints d = {NULL, 0, 0};
    int rc = 0;
    for (size_t i = 0; i < c->n && rc == 0; i++) rc = lg_unicode_decompose(c->cp[i], compat, &d);
    if (rc == 0) lg_unicode_order_and_compose(&d);
    LG_FREE(c->cp);
    *c = d;
    return rc;
}

/* Lowercase, each code point alone (Unicode's full mapping without context, as Rust's
   char::to_lowercase), in place. */
static int lg_unicode_lowercase_all(lg_codepoints *c) {
    lg_codepoints out = {NULL, 0, 0};
    int rc = 0;
    for (size_t i = 0; i < c->n && rc == 0; i++) {
        const uint32_t *row = lg_unicode_row(&lg_unicode_lowercase[0][0], LG_UNICODE_ROWS(lg_unicode_lowercase),
                                             3, 1, &c->cp[i]);
        rc = lg_codepoints_push(&out, row ? row[1] : c->cp[i]);
        if (rc == 0 && row && row[2]) rc = lg_codepoints_push(&out, row[2]);
    }
    LG_FREE(c->cp);
    *c = out;
    return rc;
}

/* One Unicode step on text: its code points changed, written back as UTF-8 (invalid bytes as
   they were). */
static int lg_normalize_unicode(lg_normalize_kind kind, lg_text *text) {
    lg_codepoints c = {NULL, 0, 0};
    int rc = 0, size;
    for (size_t at = 0; at < text->n && rc == 0; at += (size_t)size)
        rc = lg_codepoints_push(&c, lg_utf8_next((const unsigned char *)text->bytes + at, text->n - at, &size));
    if (rc == 0) rc = kind == LG_NORMALIZE_LOWERCASE ? lg_unicode_lowercase_all(&c)
                                                     : lg_unicode_nfc(&c, kind == LG_NORMALIZE_NFKC);
    text->n = 0;
    for (size_t i = 0; i < c.n && rc == 0; i++) {
        char utf8[4];
        if (c.cp[i] >= 0x110000u) { utf8[0] = (char)(c.cp[i] - 0x110000u); rc = lg_text_append(text, utf8, 1); }
        else rc = lg_text_append(text, utf8, (size_t)lg_utf8_put(utf8, c.cp[i]));
    }
    LG_FREE(c.cp);
    return rc;
}

/* Every occurrence of from in text replaced by to (left to right, not overlapping). */
static int lg_normalize_replace(const char *from, const char *to, lg_text *text) {
    size_t n_from = strlen(from);
    lg_text out = {NULL, 0, 0};
    int rc = lg_text_append(&out, "", 0);
    for (size_t at = 0; at < text->n && rc == 0;) {
        int hit = n_from && at + n_from <= text->n && !memcmp(text->bytes + at, from, n_from);
        rc = hit ? lg_text_append(&out, to, strlen(to)) : lg_text_append(&out, text->bytes + at, 1);
        at += hit ? n_from : 1;
    }
    lg_text_free(text);
    *text = out;
    return rc;
}

/* text's len bytes normalized by tok's steps into out (emptied first). continued: the text
   goes on from other text, so Prepend adds nothing (it prepends to each piece that a special
   token or the start begins). */
static int lg_normalize(const lg_tokenizer *tok, const char *text, size_t len, int continued,
                        lg_text *out) {
    out->n = 0;
    int rc = lg_text_append(out, text, len);
    for (int s = 0; s < tok->n_normalize && rc == 0 && out->n > 0; s++) {
        const lg_normalize_step *step = &tok->normalize[s];
        if (step->kind == LG_NORMALIZE_REPLACE) rc = lg_normalize_replace(step->text[0], step->text[1], out);
        else if (step->kind != LG_NORMALIZE_PREPEND) rc = lg_normalize_unicode(step->kind, out);
        else if (!continued) {
            size_t n = strlen(step->text[0]);
            rc = lg_text_append(out, step->text[0], n); /* room, then shift */
            if (rc == 0) {
                memmove(out->bytes + n, out->bytes, out->n - n);
                memcpy(out->bytes, step->text[0], n);
            }
        }
    }
    return rc;
}

/* --- pre-tokenizers: the regular expressions written out -------------------------------------- */

/* Text as code points, with the byte offset of each (and of the end). */
typedef struct {
    uint32_t *cp;   /* (n) */
    size_t *at;     /* (n + 1): byte offset of character i */
    size_t n;
    int js;         /* \s as JavaScript */
} lg_chars;

enum { LG_CLASS_LETTER, LG_CLASS_NUMBER, LG_CLASS_SPACE, LG_CLASS_OTHER };

static int lg_class(const lg_chars *c, size_t i) {
    uint32_t cp = c->cp[i];
    return lg_is_letter(cp) ? LG_CLASS_LETTER : lg_is_number(cp) ? LG_CLASS_NUMBER
         : lg_is_space(cp, c->js) ? LG_CLASS_SPACE : LG_CLASS_OTHER;
}

static size_t lg_run(const lg_chars *c, size_t i, int cls) {
    while (i < c->n && lg_class(c, i) == cls) i++;
    return i;
}

/* 's 't 're 've 'm 'll 'd at i (case-insensitive for Llama 3 and Qwen2): the end, or 0. */
static size_t lg_contraction(const lg_chars *c, size_t i, int any_case) {
    static const char *const endings[7] = {"s", "t", "re", "ve", "m", "ll", "d"};
    if (c->cp[i] != '\'') return 0;
    for (int e = 0; e < 7; e++) {
        size_t k = 0, len = strlen(endings[e]);
        for (; k < len && i + 1 + k < c->n; k++) {
            uint32_t ch = c->cp[i + 1 + k];
            if (any_case && ch >= 'A' && ch <= 'Z') ch += 32;
            if (ch != (uint32_t)endings[e][k]) break;
        }
        if (k == len) return i + 1 + len;
    }
    return 0;
}

/* \s+(?!\S) then \s+ at a space i: the run, less its last character when a non-space follows
   and the run is longer than one. */
static size_t lg_space_run(const lg_chars *c, size_t i) {
    size_t end = lg_run(c, i, LG_CLASS_SPACE);
    return end < c->n && end - i >= 2 ? end - 1 : end;
}

/* GPT-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ */
static size_t lg_match_gpt2(const lg_chars *c, size_t i) {
    size_t end = lg_contraction(c, i, 0);
    if (end) return end;
    size_t k = i + (c->cp[i] == ' ' && i + 1 < c->n);
    int cls = lg_class(c, k);
    if (cls != LG_CLASS_SPACE) return lg_run(c, k, cls);
    return lg_space_run(c, i);
}

static int lg_is_newline(uint32_t cp) { return cp == '\r' || cp == '\n'; }

/* Llama 3 (digits in threes) and Qwen2 (single digits):
   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
   \s*[\r\n]+|\s+(?!\S)|\s+ */
static size_t lg_match_llama3(const lg_chars *c, size_t i, int max_digits) {
    size_t end = lg_contraction(c, i, 1);
    if (end) return end;
    int cls = lg_class(c, i);
    if (cls == LG_CLASS_LETTER) return lg_run(c, i, LG_CLASS_LETTER);
    if (cls != LG_CLASS_NUMBER && !lg_is_newline(c->cp[i]) && i + 1 < c->n &&
        lg_class(c, i + 1) == LG_CLASS_LETTER)
        return lg_run(c, i + 1, LG_CLASS_LETTER);
    if (cls == LG_CLASS_NUMBER) {
        end = i;
        while (end < c->n && end - i < (size_t)max_digits && lg_class(c, end) == LG_CLASS_NUMBER) end++;
        return end;
    }
    size_t k = i + (c->cp[i] == ' ' && i + 1 < c->n);
    if (lg_class(c, k) == LG_CLASS_OTHER) {
        end = lg_run(c, k, LG_CLASS_OTHER);
        while (end < c->n && lg_is_newline(c->cp[end])) end++;
        return end;
    }
    size_t run = lg_run(c, i, LG_CLASS_SPACE), last_newline = 0;
    for (size_t j = i; j < run; j++)
        if (lg_is_newline(c->cp[j])) last_newline = j + 1;
    return last_newline ? last_newline : lg_space_run(c, i);
}

/* Cuts text into words: calls emit for each [start, end) byte range. */
static int lg_pretokenize(const lg_tokenizer *tok, const lg_chars *c,
                          int (*emit)(const lg_tokenizer *, const char *, size_t, void *),
                          const char *text, void *ctx) {
    for (size_t i = 0; i < c->n;) {
        size_t end = tok->pretokenizer == LG_PRETOKENIZE_GPT2 ? lg_match_gpt2(c, i)
                   : tok->pretokenizer == LG_PRETOKENIZE_LLAMA3 ? lg_match_llama3(c, i, 3)
                   : tok->pretokenizer == LG_PRETOKENIZE_QWEN2 ? lg_match_llama3(c, i, 1)
                   : c->n;
        if (end <= i) end = i + 1; /* never stall */
        if (emit(tok, text + c->at[i], c->at[end] - c->at[i], ctx) != 0) return -1;
        i = end;
    }
    return 0;
}

static int lg_chars_decode(lg_chars *c, const char *text, size_t len) {
    c->cp = (uint32_t *)LG_MALLOC(sizeof(uint32_t) * (len + 1));
    c->at = (size_t *)LG_MALLOC(sizeof(size_t) * (len + 1));
    c->n = 0;
    if (!c->cp || !c->at) return -1;
    for (size_t at = 0; at < len;) {
        int size;
        c->at[c->n] = at;
        c->cp[c->n++] = lg_utf8_next((const unsigned char *)text + at, len - at, &size);
        at += (size_t)size;
    }
    c->at[c->n] = len;
    return 0;
}

/* --- the vocabulary and merge tables ---------------------------------------------------------- */

int lg_tokenizer_start_id(const lg_tokenizer *tok) {
    return tok->bos >= 0 && tok->bos != tok->eos ? tok->bos : -1;
}

int lg_tokenizer_find(const lg_tokenizer *tok, const char *piece, size_t len) {
    if (!tok->piece_table) return -1;
    size_t mask = tok->piece_slots - 1;
    for (size_t s = lg_hash64(LG_HASH64_INIT, piece, len) & mask;; s = (s + 1) & mask) {
        int id = tok->piece_table[s];
        if (id < 0) return -1;
        size_t start = tok->piece_start[id], n = tok->piece_start[id + 1] - start;
        if (n == len && memcmp(tok->pieces + start, piece, len) == 0) return id;
    }
}

/* The slot of a merge pair: where it is, or the empty slot where it would go. */
static size_t lg_merge_slot(const lg_tokenizer *tok, uint64_t pair) {
    size_t mask = tok->merge_slots - 1, s = lg_mix64(pair) & mask;
    while (tok->merge_pair[s] != UINT64_MAX && tok->merge_pair[s] != pair) s = (s + 1) & mask;
    return s;
}

/* The rank and result of merging left and right; rank INT32_MAX when they do not merge. */
static int lg_merge_rank(const lg_tokenizer *tok, int left, int right, int *result) {
    if (!tok->merge_slots) return INT32_MAX;
    size_t s = lg_merge_slot(tok, (uint64_t)(uint32_t)left << 32 | (uint32_t)right);
    if (tok->merge_pair[s] == UINT64_MAX) return INT32_MAX;
    *result = tok->merge_result[s];
    return tok->merge_rank[s];
}

/* Pieces given as (id, bytes) build the pieces buffer and its hash table. The pieces of ids
   never given are empty. items[i] points to n[i] bytes. */
static int lg_tokenizer_set_pieces(lg_tokenizer *tok, char **items, const size_t *n, int V) {
    size_t total = 0;
    for (int i = 0; i < V; i++) total += n[i];
    tok->vocab_size = V;
    tok->pieces = (char *)LG_MALLOC(total + 1);
    tok->piece_start = (size_t *)LG_MALLOC(sizeof(size_t) * ((size_t)V + 1));
    tok->piece_slots = 1;
    while (tok->piece_slots < 2 * (size_t)V) tok->piece_slots *= 2;
    tok->piece_table = (int *)LG_MALLOC(sizeof(int) * tok->piece_slots);
    if (!tok->pieces || !tok->piece_start || !tok->piece_table) return -1;
    memset(tok->piece_table, 0xFF, sizeof(int) * tok->piece_slots);
    size_t at = 0;
    for (int i = 0; i < V; i++) {
        tok->piece_start[i] = at;
        if (n[i]) memcpy(tok->pieces + at, items[i], n[i]);
        at += n[i];
    }
    tok->piece_start[V] = at;
    for (int i = 0; i < V; i++) {
        const char *p = tok->pieces + tok->piece_start[i];
        if (n[i] == 0 || lg_tokenizer_find(tok, p, n[i]) >= 0) continue; /* first id wins */
        size_t mask = tok->piece_slots - 1, s = lg_hash64(LG_HASH64_INIT, p, n[i]) & mask;
        while (tok->piece_table[s] >= 0) s = (s + 1) & mask;
        tok->piece_table[s] = i;
    }
    return 0;
}

static int lg_tokenizer_alloc_merges(lg_tokenizer *tok, size_t n_merges) {
    tok->merge_slots = 1;
    while (tok->merge_slots < 2 * n_merges + 2) tok->merge_slots *= 2;
    tok->merge_pair = (uint64_t *)LG_MALLOC(sizeof(uint64_t) * tok->merge_slots);
    tok->merge_rank = (int *)LG_MALLOC(sizeof(int) * tok->merge_slots);
    tok->merge_result = (int *)LG_MALLOC(sizeof(int) * tok->merge_slots);
    if (!tok->merge_pair || !tok->merge_rank || !tok->merge_result) return -1;
    memset(tok->merge_pair, 0xFF, sizeof(uint64_t) * tok->merge_slots);
    return 0;
}

/* Adds merge "left right" (pieces in the vocabulary's form) with the next rank; a merge whose
   parts or result are not in the vocabulary fails (where says which line). */
static int lg_tokenizer_add_merge(lg_tokenizer *tok, const char *left, size_t left_n,
                                  const char *right, size_t right_n, const char *where,
                                  lg_error *err) {
    int a = lg_tokenizer_find(tok, left, left_n), b = lg_tokenizer_find(tok, right, right_n);
    char joined[512];
    if (left_n + right_n > sizeof joined)
        return lg_fail(err, "tokenizer %s: %s: a merge longer than %zu bytes", tok->path, where,
                       sizeof joined);
    memcpy(joined, left, left_n);
    memcpy(joined + left_n, right, right_n);
    int merged = lg_tokenizer_find(tok, joined, left_n + right_n);
    if (a < 0 || b < 0 || merged < 0)
        return lg_fail(err, "tokenizer %s: %s: merge '%.*s' + '%.*s' names a token that is not "
                            "in the vocabulary", tok->path, where, (int)left_n, left, (int)right_n,
                       right);
    size_t s = lg_merge_slot(tok, (uint64_t)(uint32_t)a << 32 | (uint32_t)b);
    if (tok->merge_pair[s] != UINT64_MAX) return 0; /* a repeated merge keeps its first rank */
    tok->merge_pair[s] = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    tok->merge_rank[s] = tok->n_merges++;
    tok->merge_result[s] = merged;
    return 0;
}

/* --- GPT-2's byte alphabet: each byte is a printable character in the vocabulary files -------- */

static int lg_byte_is_printable(int b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

/* The byte a vocabulary character stands for, or -1. */
static int lg_byte_of_char(uint32_t cp) {
    if (cp < 256) return lg_byte_is_printable((int)cp) ? (int)cp : -1;
    int n = 0;
    for (int b = 0; b < 256; b++) {
        if (lg_byte_is_printable(b)) continue;
        if (cp == 256u + (uint32_t)n) return b;
        n++;
    }
    return -1;
}

/* Vocabulary text in GPT-2's alphabet -> raw bytes, in place; -1 on a foreign character. */
static int lg_bytes_from_alphabet(char *s, size_t *n) {
    size_t out = 0;
    for (size_t i = 0; i < *n;) {
        int size;
        int b = lg_byte_of_char(lg_utf8_next((const unsigned char *)s + i, *n - i, &size));
        if (b < 0) return -1;
        s[out++] = (char)b;
        i += (size_t)size;
    }
    *n = out;
    return 0;
}

/* --- encode and decode ------------------------------------------------------------------------ */

/* BPE on one word given as symbols (ids): merge the lowest-ranked adjacent pair, leftmost
   first, until no pair merges; then append the symbols. In O(n log n): the symbols form a
   linked list over their first positions, and a min-heap holds each adjacent pair as it came
   to be, ordered by (rank, left position) — the pair the plain rescan of every pair would pick.
   An entry whose symbols have changed since is skipped when it comes up. */
typedef struct {
    int rank;
    int left;   /* position of the pair's left symbol */
    int right;  /* and of its right one, when pushed */
    int left_id, right_id; /* the two symbols then */
    int merged; /* the id the pair merges into */
} lg_bpe_pair;

typedef struct {
    int *sym;           /* (n) the symbol starting at each position; -1 once merged away */
    int *next, *prev;   /* (n) neighbours in the list; -1 at the ends */
    lg_bpe_pair *heap;  /* (cap) */
    size_t size, cap;
} lg_bpe_word;

static int lg_bpe_before(const lg_bpe_pair *a, const lg_bpe_pair *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static void lg_bpe_push(lg_bpe_word *w, int left, int right, const lg_tokenizer *tok) {
    lg_bpe_pair p;
    if (left < 0 || right < 0) return;
    p.left = left;
    p.right = right;
    p.left_id = w->sym[left];
    p.right_id = w->sym[right];
    p.rank = lg_merge_rank(tok, p.left_id, p.right_id, &p.merged);
    if (p.rank == INT32_MAX) return; /* no merge */
    size_t i = w->size++;
    while (i > 0 && lg_bpe_before(&p, &w->heap[(i - 1) / 2])) {
        w->heap[i] = w->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    w->heap[i] = p;
}

static lg_bpe_pair lg_bpe_pop(lg_bpe_word *w) {
    lg_bpe_pair top = w->heap[0], last = w->heap[--w->size];
    size_t i = 0;
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= w->size) break;
        if (child + 1 < w->size && lg_bpe_before(&w->heap[child + 1], &w->heap[child])) child++;
        if (!lg_bpe_before(&w->heap[child], &last)) break;
        w->heap[i] = w->heap[child];
        i = child;
    }
    if (w->size) w->heap[i] = last;
    return top;
}

/* The pair still stands: neighbours, holding the symbols they held when pushed. */
static int lg_bpe_current(const lg_bpe_word *w, const lg_bpe_pair *p) {
    return w->next[p->left] == p->right && w->sym[p->left] == p->left_id &&
           w->sym[p->right] == p->right_id;
}

static int lg_bpe_symbols(const lg_tokenizer *tok, int *sym, size_t n, lg_tokens *out) {
    lg_bpe_word w;
    w.sym = sym;
    w.size = 0;
    w.cap = 2 * n + 1; /* n - 1 first pairs, then at most two new ones a merge */
    w.next = (int *)LG_MALLOC(sizeof(int) * (n + 1));
    w.prev = (int *)LG_MALLOC(sizeof(int) * (n + 1));
    w.heap = (lg_bpe_pair *)LG_MALLOC(sizeof(lg_bpe_pair) * w.cap);
    int rc = w.next && w.prev && w.heap ? 0 : -1;
    for (size_t i = 0; i < n && rc == 0; i++) {
        w.next[i] = i + 1 < n ? (int)i + 1 : -1;
        w.prev[i] = (int)i - 1;
    }
    for (size_t i = 0; i + 1 < n && rc == 0; i++) lg_bpe_push(&w, (int)i, (int)i + 1, tok);
    while (rc == 0 && w.size > 0) {
        lg_bpe_pair p = lg_bpe_pop(&w);
        if (!lg_bpe_current(&w, &p)) continue;
        int gone = p.right, after = w.next[gone];
        sym[p.left] = p.merged;
        sym[gone] = -1;
        w.next[p.left] = after;
        if (after >= 0) w.prev[after] = p.left;
        lg_bpe_push(&w, w.prev[p.left], p.left, tok);
        lg_bpe_push(&w, p.left, after, tok);
    }
    for (int i = n ? 0 : -1; i >= 0 && rc == 0; i = w.next[i]) rc = lg_tokens_push(out, sym[i]);
    LG_FREE(w.next);
    LG_FREE(w.prev);
    LG_FREE(w.heap);
    return rc;
}

typedef struct {
    lg_tokens *out;
    lg_error *err;
} lg_encode_ctx;

/* A word of a byte-level vocabulary: starts from its bytes. */
static int lg_encode_word(const lg_tokenizer *tok, const char *word, size_t len, void *ctx_) {
    lg_encode_ctx *ctx = (lg_encode_ctx *)ctx_;
    int whole = tok->ignore_merges ? lg_tokenizer_find(tok, word, len) : -1;
    if (whole >= 0) return lg_tokens_push(ctx->out, whole);
    int *sym = (int *)LG_MALLOC(sizeof(int) * (len + 1));
    if (!sym) return lg_fail(ctx->err, "tokenizer %s: out of host memory", tok->path);
    for (size_t i = 0; i < len; i++) {
        sym[i] = tok->byte_token[(unsigned char)word[i]];
        if (sym[i] < 0) {
            LG_FREE(sym);
            return lg_fail(ctx->err, "tokenizer %s: no token for byte 0x%02x", tok->path,
                           (unsigned char)word[i]);
        }
    }
    int rc = lg_bpe_symbols(tok, sym, len, ctx->out);
    LG_FREE(sym);
    return rc == 0 ? 0 : lg_fail(ctx->err, "tokenizer %s: out of host memory", tok->path);
}

/* SentencePiece style, on text its normalizer has made (spaces already U+2581): symbols start
   as characters, and a character outside the vocabulary falls back to its bytes' <0xXX>
   tokens. */
static int lg_encode_sentencepiece(const lg_tokenizer *tok, const lg_text *normalized,
                                   lg_encode_ctx *ctx) {
    const lg_text norm = *normalized;
    int rc = 0;
    int *sym = rc == 0 ? (int *)LG_MALLOC(sizeof(int) * (norm.n + 1)) : NULL;
    size_t n = 0;
    for (size_t at = 0; sym && at < norm.n;) {
        int size;
        lg_utf8_next((const unsigned char *)norm.bytes + at, norm.n - at, &size);
        int id = lg_tokenizer_find(tok, norm.bytes + at, (size_t)size);
        for (int b = 0; b < size && id < 0; b++) {
            sym[n] = tok->byte_token[(unsigned char)norm.bytes[at + b]];
            if (sym[n++] < 0) rc = lg_fail(ctx->err, "tokenizer %s: no byte fallback token for "
                                                    "0x%02x", tok->path, (unsigned char)norm.bytes[at + b]);
        }
        if (id >= 0) sym[n++] = id;
        at += (size_t)size;
    }
    if (!sym && rc == 0) rc = lg_fail(ctx->err, "tokenizer %s: out of host memory", tok->path);
    if (rc == 0 && lg_bpe_symbols(tok, sym, n, ctx->out) != 0)
        rc = lg_fail(ctx->err, "tokenizer %s: out of host memory", tok->path);
    LG_FREE(sym);
    return rc;
}

/* Text without special tokens. */
static int lg_encode_plain(const lg_tokenizer *tok, const char *text, size_t len, int first,
                           lg_encode_ctx *ctx) {
    if (len == 0) return 0;
    lg_text norm = {NULL, 0, 0};
    if (tok->n_normalize && lg_normalize(tok, text, len, !first, &norm) != 0) {
        lg_text_free(&norm);
        return lg_fail(ctx->err, "tokenizer %s: out of host memory", tok->path);
    }
    if (tok->n_normalize) text = norm.bytes, len = norm.n;
    lg_chars chars = {NULL, NULL, 0, tok->js_whitespace};
    int rc = tok->sentencepiece ? lg_encode_sentencepiece(tok, &norm, ctx)
             : lg_chars_decode(&chars, text, len) == 0
                 ? lg_pretokenize(tok, &chars, lg_encode_word, text, ctx)
                 : lg_fail(ctx->err, "tokenizer %s: out of host memory", tok->path);
    LG_FREE(chars.cp);
    LG_FREE(chars.at);
    lg_text_free(&norm);
    return rc;
}

/* The longest special token starting at text, or -1. */
static int lg_special_at(const lg_tokenizer *tok, const char *text, size_t len) {
    int best = -1;
    size_t best_n = 0;
    for (int s = 0; s < tok->n_special; s++) {
        int id = tok->special[s];
        size_t start = tok->piece_start[id], n = tok->piece_start[id + 1] - start;
        if (n > best_n && n <= len && memcmp(tok->pieces + start, text, n) == 0) {
            best = id;
            best_n = n;
        }
    }
    return best;
}

/* Text split at special tokens, each piece between them encoded alone (SentencePiece: each
   gets its U+2581, as the Prepend normalizer does to each piece); continued: the text goes on
   from other text, so its first piece gets none. */
static int lg_tokenizer_encode_part(const lg_tokenizer *tok, const char *text, size_t len,
                                    int continued, lg_tokens *out, lg_error *err) {
    lg_encode_ctx ctx = {out, err};
    size_t plain = 0;
    for (size_t i = 0; i < len; i++) {
        int id = tok->n_special ? lg_special_at(tok, text + i, len - i) : -1;
        if (id < 0) continue;
        if (lg_encode_plain(tok, text + plain, i - plain, !(continued && plain == 0), &ctx) != 0)
            return -1;
        if (lg_tokens_push(out, id) != 0) return lg_fail(err, "tokenizer: out of host memory");
        i += tok->piece_start[id + 1] - tok->piece_start[id] - 1;
        plain = i + 1;
    }
    return lg_encode_plain(tok, text + plain, len - plain, !(continued && plain == 0), &ctx);
}

int lg_tokenizer_encode(const lg_tokenizer *tok, const char *text, size_t len, lg_tokens *out,
                        lg_error *err) {
    return lg_tokenizer_encode_part(tok, text, len, 0, out, err);
}

/* 1 when text[0, end) ends with one of tok's special tokens. */
static int lg_special_ends_at(const lg_tokenizer *tok, const char *text, size_t end) {
    for (int s = 0; s < tok->n_special; s++) {
        int id = tok->special[s];
        size_t start = tok->piece_start[id], n = tok->piece_start[id + 1] - start;
        if (n <= end && memcmp(tok->pieces + start, text + end - n, n) == 0) return 1;
    }
    return 0;
}

/* A SentencePiece token's text: <0xXX> is that byte, U+2581 a space. */
static int lg_decode_sentencepiece(const char *p, size_t n, lg_text *out) {
    unsigned hex;
    if (n == 6 && p[0] == '<' && p[1] == '0' && p[2] == 'x' && p[5] == '>') {
        char digits[5] = {'0', '0', p[3], p[4], 0};
        if (lg_json_hex4(digits, 4, &hex) == 0) {
            char byte = (char)hex;
            return lg_text_append(out, &byte, 1);
        }
    }
    for (size_t i = 0; i < n;) {
        int space = n - i >= 3 && memcmp(p + i, "\xE2\x96\x81", 3) == 0;
        if (lg_text_append(out, space ? " " : p + i, 1) != 0) return -1;
        i += space ? 3 : 1;
    }
    return 0;
}

int lg_tokenizer_decode(const lg_tokenizer *tok, const int *ids, size_t n, lg_text *out,
                        lg_error *err) {
    if (lg_text_append(out, "", 0) != 0) return lg_fail(err, "tokenizer: out of host memory");
    size_t start = out->n;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= tok->vocab_size)
            return lg_fail(err, "tokenizer %s: token %d (position %zu) is outside the vocabulary "
                                "of %d", tok->path, ids[i], i, tok->vocab_size);
        const char *p = tok->pieces + tok->piece_start[ids[i]];
        size_t len = tok->piece_start[ids[i] + 1] - tok->piece_start[ids[i]];
        int rc = tok->sentencepiece ? lg_decode_sentencepiece(p, len, out)
                                    : lg_text_append(out, p, len);
        if (rc != 0) return lg_fail(err, "tokenizer: out of host memory");
    }
    /* SentencePiece's prepended space goes again (Llama 2's decoder strips one) */
    if (tok->sentencepiece && start == 0 && out->n > 0 && out->bytes[0] == ' ') {
        memmove(out->bytes, out->bytes + 1, out->n);
        out->n--;
    }
    return 0;
}

/* --- loading ---------------------------------------------------------------------------------- */

static void lg_tokenizer_init(lg_tokenizer *tok, const char *path) {
    memset(tok, 0, sizeof *tok);
    snprintf(tok->path, sizeof tok->path, "%s", path);
    tok->bos = tok->eos = tok->pad = -1;
    for (int b = 0; b < 256; b++) tok->byte_token[b] = -1;
}

/* The vocabulary object {"piece": id, ...}: pieces decoded (from GPT-2's alphabet when
   byte_level), placed by id. */
static int lg_vocab_from_json(lg_tokenizer *tok, const lg_json *doc, int object, int byte_level,
                              const char *source, lg_error *err) {
    if (object < 0 || doc->nodes[object].kind != LG_JSON_OBJECT)
        return lg_fail(err, "tokenizer %s: the vocabulary is not a JSON object", source);
    long V = 0, id;
    for (int k = doc->nodes[object].first_child; k >= 0; k = doc->nodes[doc->nodes[k].next].next) {
        if (lg_json_int(doc, doc->nodes[k].next, &id) != 0 || id < 0 || id > (1L << 24))
            return lg_fail(err, "tokenizer %s: the id of vocabulary entry '%.*s' is not an id "
                                "between 0 and 2^24", source,
                           (int)(doc->nodes[k].end - doc->nodes[k].start), doc->text + doc->nodes[k].start);
        if (id + 1 > V) V = id + 1;
    }
    char **items = (char **)lg_alloc_zeroed(sizeof(char *) * (size_t)(V + 1));
    size_t *lens = (size_t *)lg_alloc_zeroed(sizeof(size_t) * (size_t)(V + 1));
    int rc = items && lens ? 0 : lg_fail(err, "tokenizer %s: out of host memory", source);
    for (int k = doc->nodes[object].first_child; k >= 0 && rc == 0; k = doc->nodes[doc->nodes[k].next].next) {
        lg_json_int(doc, doc->nodes[k].next, &id);
        LG_FREE(items[id]);
        items[id] = lg_json_string(doc, k, &lens[id]);
        if (!items[id]) rc = lg_fail(err, "tokenizer %s: out of host memory", source);
        else if (byte_level && lg_bytes_from_alphabet(items[id], &lens[id]) != 0)
            rc = lg_fail(err, "tokenizer %s: vocabulary entry %ld is not in GPT-2's byte "
                              "alphabet", source, id);
    }
    if (rc == 0 && lg_tokenizer_set_pieces(tok, items, lens, (int)V) != 0)
        rc = lg_fail(err, "tokenizer %s: out of host memory", source);
    for (long i = 0; items && i < V; i++) LG_FREE(items[i]);
    LG_FREE(items);
    LG_FREE(lens);
    return rc;
}

/* The token of each single byte: the byte itself (byte-level) or <0xXX> (SentencePiece). */
static void lg_tokenizer_find_bytes(lg_tokenizer *tok) {
    for (int b = 0; b < 256; b++) {
        char piece[8];
        if (tok->sentencepiece) snprintf(piece, sizeof piece, "<0x%02X>", b);
        else piece[0] = (char)b;
        tok->byte_token[b] = lg_tokenizer_find(tok, piece, tok->sentencepiece ? 6 : 1);
    }
}

/* GPT-2's vocab.bpe: a "#version" line, then one "left right" merge a line (merges of '#'
   start with '#' too: only the first line is a comment). */
static int lg_merges_from_bpe_file(lg_tokenizer *tok, char *text, size_t len, const char *path,
                                   lg_error *err) {
    size_t lines = 0;
    for (size_t i = 0; i < len; i++) lines += text[i] == '\n';
    if (lg_tokenizer_alloc_merges(tok, lines + 1) != 0)
        return lg_fail(err, "tokenizer %s: out of host memory", path);
    int line_no = 0;
    for (char *line = text; line < text + len;) {
        char *end = (char *)memchr(line, '\n', (size_t)(text + len - line));
        if (!end) end = text + len;
        line_no++;
        size_t n = (size_t)(end - line);
        char *space = (char *)memchr(line, ' ', n);
        if (n > 0 && !(line_no == 1 && n >= 8 && memcmp(line, "#version", 8) == 0)) {
            char where[64];
            snprintf(where, sizeof where, "vocab.bpe line %d", line_no);
            if (!space || space == line || space + 1 == end || memchr(space + 1, ' ', (size_t)(end - space - 1)))
                return lg_fail(err, "tokenizer %s: %s: expected 'left right'", tok->path, where);
            size_t left_n = (size_t)(space - line), right_n = (size_t)(end - space - 1);
            if (lg_bytes_from_alphabet(line, &left_n) != 0 ||
                lg_bytes_from_alphabet(space + 1, &right_n) != 0)
                return lg_fail(err, "tokenizer %s: %s: a character outside GPT-2's byte "
                                    "alphabet", tok->path, where);
            if (lg_tokenizer_add_merge(tok, line, left_n, space + 1, right_n, where, err) != 0)
                return -1;
        }
        line = end + 1;
    }
    return 0;
}

/* DIR/encoder.json + DIR/vocab.bpe, as OpenAI published GPT-2's tokenizer. */
static int lg_tokenizer_load_gpt2(lg_tokenizer *tok, const char *dir, lg_error *err) {
    char path[LG_PATH_MAX];
    size_t len;
    snprintf(path, sizeof path, "%s/encoder.json", dir);
    char *text = lg_read_file(path, &len, "tokenizer", err);
    if (!text) return -1;
    tok->files_hash = lg_hash64(LG_HASH64_INIT, text, len);
    lg_json doc;
    int rc = lg_json_parse(&doc, text, len, path, err);
    if (rc == 0) rc = lg_vocab_from_json(tok, &doc, 0, 1, path, err);
    lg_json_free(&doc);
    LG_FREE(text);
    snprintf(path, sizeof path, "%s/vocab.bpe", dir);
    text = rc == 0 ? lg_read_file(path, &len, "tokenizer", err) : NULL;
    if (!text) return -1;
    tok->files_hash = lg_hash64(tok->files_hash, text, len);
    rc = lg_merges_from_bpe_file(tok, text, len, path, err);
    LG_FREE(text);
    tok->pretokenizer = LG_PRETOKENIZE_GPT2;
    tok->js_whitespace = 1;
    lg_tokenizer_find_bytes(tok);
    tok->eos = tok->bos = lg_tokenizer_find(tok, "<|endoftext|>", 13);
    return rc;
}

/* The first node under node (at any depth) that is the value of key, or -1. */
static int lg_json_find_deep(const lg_json *doc, int node, const char *key) {
    size_t n = strlen(key);
    for (int j = node + 1; j < doc->n_nodes && doc->nodes[j].start < doc->nodes[node].end; j++) {
        const lg_json_node *k = &doc->nodes[j];
        if (k->kind == LG_JSON_STRING && k->next >= 0 && k->end - k->start == n &&
            memcmp(doc->text + k->start, key, n) == 0 && j > 0)
            return k->next;
    }
    return -1;
}

static int lg_json_is_true(const lg_json *doc, int node) {
    return node >= 0 && doc->nodes[node].kind == LG_JSON_TRUE;
}

/* Does the JSON text of node contain needle? */
static int lg_json_mentions(const lg_json *doc, int node, const char *needle) {
    if (node < 0) return 0;
    size_t n = strlen(needle), end = doc->nodes[node].end;
    for (size_t i = doc->nodes[node].start; i + n <= end; i++)
        if (memcmp(doc->text + i, needle, n) == 0) return 1;
    return 0;
}

/* The pre-tokenizer: its Split pattern when it has one, else GPT-2's (ByteLevel's own). */
static int lg_tokenizer_json_pattern(lg_tokenizer *tok, const lg_json *doc, int pre,
                                     lg_error *err) {
    static const char *const patterns[3] = {
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+",
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
        "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
        "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"};
    static const lg_pretokenizer kinds[3] = {LG_PRETOKENIZE_GPT2, LG_PRETOKENIZE_LLAMA3,
                                             LG_PRETOKENIZE_QWEN2};
    int regex = pre >= 0 ? lg_json_find_deep(doc, pre, "Regex") : -1;
    tok->pretokenizer = LG_PRETOKENIZE_GPT2;
    if (regex < 0) return 0;
    size_t n;
    char *pattern = lg_json_string(doc, regex, &n);
    if (!pattern) return lg_fail(err, "tokenizer %s: the pre-tokenizer's Regex is not a string", tok->path);
    int found = -1;
    for (int i = 0; i < 3 && found < 0; i++)
        if (strcmp(pattern, patterns[i]) == 0) found = i;
    if (found >= 0) tok->pretokenizer = kinds[found];
    else lg_fail(err, "tokenizer %s: pre-tokenizer pattern %.200s is not one this version "
                      "knows (GPT-2, Llama 3, Qwen2)", tok->path, pattern);
    LG_FREE(pattern);
    return found >= 0 ? 0 : -1;
}

/* "merges": ["a b", ...] or [["a", "b"], ...], in the vocabulary's form. */
static int lg_tokenizer_json_merges(lg_tokenizer *tok, const lg_json *doc, int merges,
                                    lg_error *err) {
    if (merges < 0 || doc->nodes[merges].kind != LG_JSON_ARRAY)
        return lg_fail(err, "tokenizer %s: model.merges is missing or not an array", tok->path);
    size_t count = 0;
    for (int m = doc->nodes[merges].first_child; m >= 0; m = doc->nodes[m].next) count++;
    if (lg_tokenizer_alloc_merges(tok, count) != 0)
        return lg_fail(err, "tokenizer %s: out of host memory", tok->path);
    int index = 0, rc = 0;
    for (int m = doc->nodes[merges].first_child; m >= 0 && rc == 0; m = doc->nodes[m].next, index++) {
        char where[64], *left = NULL, *right = NULL;
        size_t left_n = 0, right_n = 0;
        snprintf(where, sizeof where, "merge %d", index);
        if (doc->nodes[m].kind == LG_JSON_ARRAY && doc->nodes[m].first_child >= 0) {
            left = lg_json_string(doc, doc->nodes[m].first_child, &left_n);
            right = lg_json_string(doc, doc->nodes[doc->nodes[m].first_child].next, &right_n);
        } else if ((left = lg_json_string(doc, m, &left_n)) != NULL) {
            char *space = strchr(left, ' ');
            if (space) {
                right = space + 1;
                right_n = left_n - (size_t)(right - left);
                left_n = (size_t)(space - left);
            }
        }
        if (!left || !right || left_n == 0 || right_n == 0)
            rc = lg_fail(err, "tokenizer %s: %s is not \"left right\" or [left, right]", tok->path, where);
        else if (!tok->sentencepiece && (lg_bytes_from_alphabet(left, &left_n) != 0 ||
                                         lg_bytes_from_alphabet(right, &right_n) != 0))
            rc = lg_fail(err, "tokenizer %s: %s is not in GPT-2's byte alphabet", tok->path, where);
        else rc = lg_tokenizer_add_merge(tok, left, left_n, right, right_n, where, err);
        if (doc->nodes[m].kind == LG_JSON_ARRAY) LG_FREE(right);
        LG_FREE(left);
    }
    return rc;
}

/* Added tokens, matched verbatim in text before BPE; their text is taken as written. */
static int lg_tokenizer_json_added(lg_tokenizer *tok, const lg_json *doc, int added,
                                   lg_error *err) {
    if (added < 0) return 0;
    if (doc->nodes[added].kind != LG_JSON_ARRAY)
        return lg_fail(err, "tokenizer %s: added_tokens is not an array", tok->path);
    int count = 0;
    for (int a = doc->nodes[added].first_child; a >= 0; a = doc->nodes[a].next) count++;
    tok->special = (int *)lg_alloc_zeroed(sizeof(int) * (size_t)(count + 1));
    if (!tok->special) return lg_fail(err, "tokenizer %s: out of host memory", tok->path);
    for (int a = doc->nodes[added].first_child; a >= 0; a = doc->nodes[a].next) {
        long id;
        size_t n;
        char *content = lg_json_string(doc, lg_json_find(doc, a, "content"), &n);
        int ok = lg_json_int(doc, lg_json_find(doc, a, "id"), &id) == 0 && id >= 0 &&
                 id < tok->vocab_size && content &&
                 tok->piece_start[id + 1] - tok->piece_start[id] == n &&
                 memcmp(tok->pieces + tok->piece_start[id], content, n) == 0;
        LG_FREE(content);
        if (!ok) return lg_fail(err, "tokenizer %s: added token %d lacks an id or content, or "
                                     "differs from the vocabulary", tok->path, tok->n_special);
        tok->special[tok->n_special++] = (int)id;
    }
    return 0;
}

/* The vocabulary: model.vocab plus the added tokens (Llama 3's specials are only there). */
static int lg_tokenizer_json_vocab(lg_tokenizer *tok, const lg_json *doc, int model, int added,
                                   lg_error *err) {
    int vocab = lg_json_find(doc, model, "vocab");
    if (added < 0 || doc->nodes[added].kind != LG_JSON_ARRAY || doc->nodes[added].first_child < 0)
        return lg_vocab_from_json(tok, doc, vocab, !tok->sentencepiece, tok->path, err);
    /* a JSON object of the vocabulary with the added tokens appended, in the vocabulary's
       alphabet for byte-level models (they are plain text in the file) */
    lg_text merged = {NULL, 0, 0};
    lg_text_append(&merged, "{", 1);
    if (vocab >= 0 && doc->nodes[vocab].kind == LG_JSON_OBJECT)
        lg_text_append(&merged, doc->text + doc->nodes[vocab].start + 1,
                       doc->nodes[vocab].end - doc->nodes[vocab].start - 2);
    for (int a = doc->nodes[added].first_child; a >= 0; a = doc->nodes[a].next) {
        int content = lg_json_find(doc, a, "content"), id = lg_json_find(doc, a, "id");
        if (content < 0 || id < 0 || doc->nodes[content].kind != LG_JSON_STRING) continue;
        char *text = lg_json_string(doc, content, NULL);
        int encoded = text && !tok->sentencepiece && strlen(text) < 256;
        if (merged.n > 1) lg_text_append(&merged, ",", 1);
        lg_text_append(&merged, "\"", 1);
        for (const unsigned char *c = (const unsigned char *)text; encoded && *c; c++) {
            char utf8[5]; /* each byte as its character of GPT-2's alphabet */
            int b = *c, k = 0, nth = 0;
            while (k < b) nth += !lg_byte_is_printable(k++);
            int len = lg_utf8_put(utf8, lg_byte_is_printable(b) ? (uint32_t)b : 256u + (uint32_t)nth);
            if (b == '"' || b == '\\') lg_text_append(&merged, "\\", 1);
            lg_text_append(&merged, utf8, (size_t)len);
        }
        if (!encoded)
            lg_text_append(&merged, doc->text + doc->nodes[content].start,
                           doc->nodes[content].end - doc->nodes[content].start);
        lg_text_append(&merged, "\":", 2);
        lg_text_append(&merged, doc->text + doc->nodes[id].start, doc->nodes[id].end - doc->nodes[id].start);
        LG_FREE(text);
    }
    lg_text_append(&merged, "}", 1);
    lg_json whole;
    int rc = merged.bytes ? lg_json_parse(&whole, merged.bytes, merged.n, tok->path, err)
                          : lg_fail(err, "tokenizer %s: out of host memory", tok->path);
    if (rc == 0) {
        rc = lg_vocab_from_json(tok, &whole, 0, !tok->sentencepiece, tok->path, err);
        lg_json_free(&whole);
    }
    lg_text_free(&merged);
    return rc;
}

/* One normalizer (a Sequence: each of its own) as steps of tok->normalize; one not
   implemented is refused by name. */
static int lg_tokenizer_json_normalizer(lg_tokenizer *tok, const lg_json *doc, int node,
                                        lg_error *err) {
    if (node < 0 || doc->nodes[node].kind == LG_JSON_NULL) return 0;
    char type[32];
    lg_json_string_copy(doc, lg_json_find(doc, node, "type"), type, sizeof type);
    if (!strcmp(type, "Sequence")) {
        int list = lg_json_find(doc, node, "normalizers");
        if (list < 0 || doc->nodes[list].kind != LG_JSON_ARRAY)
            return lg_fail(err, "tokenizer %s: normalizer Sequence without a list", tok->path);
        for (int e = doc->nodes[list].first_child; e >= 0; e = doc->nodes[e].next)
            if (lg_tokenizer_json_normalizer(tok, doc, e, err) != 0) return -1;
        return 0;
    }
    static const char *const names[] = {"NFC", "NFKC", "Lowercase", "Replace", "Prepend"};
    int kind = 0;
    while (kind < 5 && strcmp(type, names[kind])) kind++;
    if (kind == 5 || tok->n_normalize == LG_NORMALIZE_MAX_STEPS)
        return lg_fail(err, "tokenizer %s: normalizer %s is not implemented (NFC, NFKC, Lowercase, "
                            "Replace, Prepend and a Sequence of at most %d of them are)", tok->path,
                       type[0] ? type : "(no type)", LG_NORMALIZE_MAX_STEPS);
    lg_normalize_step *step = &tok->normalize[tok->n_normalize++];
    memset(step, 0, sizeof *step);
    step->kind = (lg_normalize_kind)kind;
    int ok = 1;
    if (kind == LG_NORMALIZE_REPLACE)
        ok = lg_json_string_copy(doc, lg_json_find(doc, lg_json_find(doc, node, "pattern"), "String"),
                                 step->text[0], sizeof step->text[0]) == 0 && step->text[0][0] &&
             lg_json_string_copy(doc, lg_json_find(doc, node, "content"), step->text[1], sizeof step->text[1]) == 0;
    if (kind == LG_NORMALIZE_PREPEND)
        ok = lg_json_string_copy(doc, lg_json_find(doc, node, "prepend"), step->text[0], sizeof step->text[0]) == 0;
    if (!ok) return lg_fail(err, "tokenizer %s: normalizer %s: only a plain string (under %zu bytes) is "
                                 "implemented, not a Regex pattern or a longer one", tok->path, type,
                            sizeof step->text[0]);
    return 0;
}

/* BOS, EOS and padding: tokenizer_config.json beside the file when it names them, else the
   usual names of the families. */
static int lg_tokenizer_guess_special(const lg_tokenizer *tok, const char *const *names) {
    for (int i = 0; names[i]; i++) {
        int id = lg_tokenizer_find(tok, names[i], strlen(names[i]));
        if (id >= 0) return id;
    }
    return -1;
}

static void lg_tokenizer_config_special(lg_tokenizer *tok, const char *json_path) {
    char path[LG_PATH_MAX];
    const char *slash = strrchr(json_path, '/');
    snprintf(path, sizeof path, "%.*stokenizer_config.json", slash ? (int)(slash - json_path + 1) : 0,
             json_path);
    size_t len;
    char *text = lg_read_file(path, &len, "tokenizer", NULL);
    lg_json doc;
    if (!text || lg_json_parse(&doc, text, len, path, NULL) != 0) { LG_FREE(text); return; }
    static const char *const keys[3] = {"bos_token", "eos_token", "pad_token"};
    int *ids[3] = {&tok->bos, &tok->eos, &tok->pad};
    for (int k = 0; k < 3; k++) {
        int value = lg_json_find(&doc, 0, keys[k]);
        if (value >= 0 && doc.nodes[value].kind == LG_JSON_OBJECT) value = lg_json_find(&doc, value, "content");
        size_t n;
        char *name = lg_json_string(&doc, value, &n);
        int id = name ? lg_tokenizer_find(tok, name, n) : -1;
        if (id >= 0) *ids[k] = id;
        LG_FREE(name);
    }
    lg_json_free(&doc);
    LG_FREE(text);
}

static int lg_tokenizer_load_json(lg_tokenizer *tok, const char *path, lg_error *err) {
    size_t len;
    char *text = lg_read_file(path, &len, "tokenizer", err);
    if (!text) return -1;
    tok->files_hash = lg_hash64(LG_HASH64_INIT, text, len);
    lg_json doc;
    int rc = lg_json_parse(&doc, text, len, path, err);
    if (rc != 0) { LG_FREE(text); return -1; }
    int model = lg_json_find(&doc, 0, "model"), type = lg_json_find(&doc, model, "type");
    char *type_name = lg_json_string(&doc, type, NULL);
    if (model < 0) rc = lg_fail(err, "tokenizer %s: no \"model\" object", path);
    else if (type >= 0 && (!type_name || strcmp(type_name, "BPE") != 0))
        rc = lg_fail(err, "tokenizer %s: model type %s; only BPE is supported", path,
                     type_name ? type_name : "(not a string)");
    LG_FREE(type_name);
    int pre = lg_json_find(&doc, 0, "pre_tokenizer"), added = lg_json_find(&doc, 0, "added_tokens");
    tok->sentencepiece = lg_json_is_true(&doc, lg_json_find(&doc, model, "byte_fallback")) ||
                         lg_json_mentions(&doc, lg_json_find(&doc, 0, "normalizer"), "\xE2\x96\x81");
    tok->ignore_merges = lg_json_is_true(&doc, lg_json_find(&doc, model, "ignore_merges"));
    if (rc == 0) rc = lg_tokenizer_json_vocab(tok, &doc, model, added, err);
    if (rc == 0) rc = lg_tokenizer_json_merges(tok, &doc, lg_json_find(&doc, model, "merges"), err);
    if (rc == 0) rc = lg_tokenizer_json_added(tok, &doc, added, err);
    if (rc == 0) rc = lg_tokenizer_json_normalizer(tok, &doc, lg_json_find(&doc, 0, "normalizer"), err);
    if (rc == 0 && tok->sentencepiece && tok->n_normalize == 0) { /* Metaspace's: the same */
        lg_normalize_step metaspace[2] = {{LG_NORMALIZE_PREPEND, {"\xE2\x96\x81", ""}},
                                          {LG_NORMALIZE_REPLACE, {" ", "\xE2\x96\x81"}}};
        memcpy(tok->normalize, metaspace, sizeof metaspace);
        tok->n_normalize = 2;
    }
    if (rc == 0 && tok->sentencepiece) tok->pretokenizer = LG_PRETOKENIZE_NONE;
    else if (rc == 0) rc = lg_tokenizer_json_pattern(tok, &doc, pre, err);
    lg_json_free(&doc);
    LG_FREE(text);
    static const char *const bos[] = {"<|begin_of_text|>", "<s>", "<|endoftext|>", NULL};
    static const char *const eos[] = {"<|end_of_text|>", "</s>", "<|endoftext|>", NULL};
    static const char *const pad[] = {"<pad>", "<|pad|>", NULL};
    tok->bos = lg_tokenizer_guess_special(tok, bos);
    tok->eos = lg_tokenizer_guess_special(tok, eos);
    tok->pad = lg_tokenizer_guess_special(tok, pad);
    lg_tokenizer_config_special(tok, path);
    lg_tokenizer_find_bytes(tok);
    return rc;
}

int lg_tokenizer_load(lg_tokenizer *tok, const char *path, lg_error *err) {
    lg_tokenizer_init(tok, path);
    struct stat st;
    char json_path[LG_PATH_MAX];
    int rc;
    if (stat(path, &st) != 0) rc = lg_fail(err, "tokenizer %s: no such file or directory", path);
    else if (!S_ISDIR(st.st_mode)) rc = lg_tokenizer_load_json(tok, path, err);
    else {
        snprintf(json_path, sizeof json_path, "%s/encoder.json", path);
        if (stat(json_path, &st) == 0) rc = lg_tokenizer_load_gpt2(tok, path, err);
        else {
            snprintf(json_path, sizeof json_path, "%s/tokenizer.json", path);
            rc = stat(json_path, &st) == 0 ? lg_tokenizer_load_json(tok, json_path, err)
                 : lg_fail(err, "tokenizer %s: neither encoder.json + vocab.bpe nor "
                                "tokenizer.json is there", path);
        }
    }
    if (rc == 0 && tok->vocab_size == 0) rc = lg_fail(err, "tokenizer %s: empty vocabulary", path);
    if (rc != 0) lg_tokenizer_free(tok);
    return rc;
}

void lg_tokenizer_free(lg_tokenizer *tok) {
    LG_FREE(tok->pieces);
    LG_FREE(tok->piece_start);
    LG_FREE(tok->piece_table);
    LG_FREE(tok->merge_pair);
    LG_FREE(tok->merge_rank);
    LG_FREE(tok->merge_result);
    LG_FREE(tok->special);
    char path[sizeof tok->path];
    memcpy(path, tok->path, sizeof path);
    lg_tokenizer_init(tok, path);
}

/* --- the built-in task's characters ----------------------------------------------------- */

static int lg_char_encode_one(char ch) {
    if (ch == '\n') return 0;
    if (ch == '=') return 1;
    if (ch >= 'a' && ch <= 'z') return 2 + (ch - 'a');
    return -1;
}

int lg_char_encode(const char *text, int *tokens, int max_tokens) {
    int n = 0;
    for (; *text; text++) {
        int token = lg_char_encode_one(*text);
        if (token < 0 || n == max_tokens) return -1;
        tokens[n++] = token;
    }
    return n;
}

char lg_char_decode(int token) {
    if (token == 0) return '\n';
    if (token == 1) return '=';
    if (token >= 2 && token < LG_CHAR_VOCAB) return (char)('a' + token - 2);
    return '?';
}

/* 12. data ------------------------------------------------------------------------------------ */

static void lg_loader_shuffle(lg_loader *ld) {
    for (size_t i = 0; i < ld->n_windows; i++) ld->order[i] = i;
    for (size_t i = ld->n_windows; i > 1; i--) {
        size_t j = (size_t)(lg_rng_u64(&ld->rng) % i);
        size_t tmp = ld->order[i - 1];
        ld->order[i - 1] = ld->order[j];
        ld->order[j] = tmp;
    }
}

/* Shared tail of both constructors: windows, order, scratch. */
static int lg_loader_finish(lg_loader *ld, int T, int vocab_size, int shuffle, uint64_t seed,
                            lg_error *err) {
    ld->T = T;
    ld->vocab_size = vocab_size;
    if (T < 1) {
        lg_fail(err, "data %s: windows of %d tokens; a token shard needs at least 1", ld->path, T);
        lg_loader_close(ld);
        return -1;
    }
    ld->n_windows = ld->n_tokens > 0 ? (ld->n_tokens - 1) / (size_t)T : 0;
    if (ld->n_windows == 0) {
        lg_fail(err, "data %s: %zu tokens, too few for one window of %d + 1", ld->path,
                ld->n_tokens, T);
        lg_loader_close(ld);
        return -1;
    }
    lg_rng_seed(&ld->rng, seed);
    ld->scratch = (uint32_t *)lg_alloc_zeroed(sizeof(uint32_t) * (T + 1));
    if (shuffle) ld->order = (size_t *)lg_alloc_zeroed(sizeof(size_t) * ld->n_windows);
    if (!ld->scratch || (shuffle && !ld->order)) {
        lg_loader_close(ld);
        return lg_fail(err, "data %s: out of host memory", ld->path);
    }
    if (shuffle) lg_loader_shuffle(ld);
    return 0;
}

static uint32_t lg_u32_le(const unsigned char *b) {
    return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

/* The shard's largest token into ld->max_token, read once at opening in chunks of 1 Mi
   tokens; a token at or past vocab_size is refused now rather than when its window comes.
   The tokens' bytes continue ld->file_hash (the header's). */
static int lg_shard_scan(lg_loader *ld, int vocab_size, lg_error *err) {
    const size_t chunk = (size_t)1 << 20;
    unsigned char *raw = (unsigned char *)LG_MALLOC(chunk * (size_t)ld->token_bytes);
    if (!raw) return lg_fail(err, "data %s: out of host memory", ld->path);
    int rc = fseek(ld->file, LG_SHARD_HEADER_INTS * (long)sizeof(int32_t), SEEK_SET);
    for (size_t start = 0; start < ld->n_tokens && rc == 0; start += chunk) {
        size_t n = ld->n_tokens - start < chunk ? ld->n_tokens - start : chunk;
        if (fread(raw, (size_t)ld->token_bytes, n, ld->file) != n) { rc = -1; break; }
        ld->file_hash = lg_hash64(ld->file_hash, raw, n * (size_t)ld->token_bytes);
        for (size_t i = 0; i < n; i++) {
            const unsigned char *b = raw + i * (size_t)ld->token_bytes;
            uint32_t token = ld->token_bytes == 2 ? (uint32_t)(b[0] | b[1] << 8) : lg_u32_le(b);
            if (token > ld->max_token) ld->max_token = token;
        }
    }
    LG_FREE(raw);
    if (rc != 0) return lg_fail(err, "data %s: read failed", ld->path);
    if (ld->max_token >= (uint32_t)vocab_size)
        return lg_fail(err, "data %s: token %u is outside the model's vocabulary of %d (its "
                            "padded_vocab_size): data made with another tokenizer?", ld->path,
                       ld->max_token, vocab_size);
    return 0;
}

/* fine-tuning samples, below */
static size_t lg_loader_take(lg_loader *ld);
static int lg_samples_open(lg_loader *ld, int T, int shuffle, uint64_t seed, lg_error *err);
static int lg_samples_next(lg_loader *ld, int B, int *inputs, int *targets, int *T_batch);

int lg_loader_open(lg_loader *ld, const char *path, int T, int vocab_size, int shuffle,
                   uint64_t seed, lg_error *err) {
    memset(ld, 0, sizeof *ld);
    snprintf(ld->path, sizeof ld->path, "%s", path);
    struct stat st;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode))
        return lg_fail(err, "data %s: not a regular file", path);
    ld->file = fopen(path, "rb");
    if (!ld->file) return lg_fail(err, "data %s: cannot open: %s", path, strerror(errno));
    int32_t header[LG_SHARD_HEADER_INTS];
    size_t got = fread(header, sizeof(int32_t), LG_SHARD_HEADER_INTS, ld->file);
    fseek(ld->file, 0, SEEK_END);
    long file_bytes = ftell(ld->file);
    const long header_bytes = LG_SHARD_HEADER_INTS * (long)sizeof(int32_t);
    if (got > 0 && strchr("[{", *(const char *)header)) {
        lg_loader_close(ld);
        return lg_fail(err, "data %s: a JSON file, not prepared data: make fine-tuning samples "
                            "with tools/prepare alpaca (or token shards with tools/prepare text)",
                       path);
    }
    if (got != LG_SHARD_HEADER_INTS) {
        lg_loader_close(ld);
        return lg_fail(err, "data %s: %ld bytes, shorter than the %ld-byte header", path,
                       file_bytes, header_bytes);
    }
    ld->tokenizer_hash = (uint64_t)(uint32_t)header[LG_DATA_TOKENIZER_AT] |
                         (uint64_t)(uint32_t)header[LG_DATA_TOKENIZER_AT + 1] << 32;
    if (header[0] == LG_SAMPLES_MAGIC) {
        ld->vocab_size = vocab_size;
        return lg_samples_open(ld, T, shuffle, seed, err);
    }
    if (header[0] == LG_SHARD_MAGIC_U16 && header[1] == LG_SHARD_VERSION_U16) ld->token_bytes = 2;
    else if (header[0] == LG_SHARD_MAGIC_U32 && header[1] == LG_SHARD_VERSION_U32) ld->token_bytes = 4;
    else {
        lg_loader_close(ld);
        return lg_fail(err, "data %s: not a token shard (magic %d version %d; expected %d/%d "
                            "for uint16 or %d/%d for uint32 tokens, %d for fine-tuning samples)",
                       path, header[0], header[1], LG_SHARD_MAGIC_U16, LG_SHARD_VERSION_U16,
                       LG_SHARD_MAGIC_U32, LG_SHARD_VERSION_U32, LG_SAMPLES_MAGIC);
    }
    ld->n_tokens = (size_t)(uint32_t)header[2];
    long expected = header_bytes + (long)ld->n_tokens * ld->token_bytes;
    if (file_bytes != expected) {
        lg_loader_close(ld);
        return lg_fail(err, "data %s: header says %zu tokens (%ld bytes) but the file has %ld "
                            "bytes (truncated or corrupt)", path, (size_t)(uint32_t)header[2],
                       expected, file_bytes);
    }
    ld->file_bytes = (uint64_t)file_bytes;
    ld->file_hash = lg_hash64(LG_HASH64_INIT, header, sizeof header);
    if (lg_shard_scan(ld, vocab_size, err) != 0) {
        lg_loader_close(ld);
        return -1;
    }
    return lg_loader_finish(ld, T, vocab_size, shuffle, seed, err);
}

int lg_loader_from_memory(lg_loader *ld, uint32_t *tokens, size_t n_tokens, int T,
                          int vocab_size, int shuffle, uint64_t seed, lg_error *err) {
    memset(ld, 0, sizeof *ld);
    snprintf(ld->path, sizeof ld->path, "(built-in)");
    ld->memory = tokens;
    ld->n_tokens = n_tokens;
    ld->token_bytes = 4;
    ld->file_bytes = sizeof(uint32_t) * n_tokens;
    ld->file_hash = lg_hash64(LG_HASH64_INIT, tokens, sizeof(uint32_t) * n_tokens);
    return lg_loader_finish(ld, T, vocab_size, shuffle, seed, err);
}

/* Reads tokens [start, start + T] of the stream into ld->scratch. */
static int lg_loader_read_window(lg_loader *ld, size_t start, lg_error *err) {
    size_t n = (size_t)ld->T + 1;
    if (ld->memory) {
        memcpy(ld->scratch, ld->memory + start, n * sizeof(uint32_t));
    } else {
        /* read the window's raw little-endian tokens into the scratch, then widen in place
           from the back (a uint16 window fills the first half of the buffer) */
        long at = LG_SHARD_HEADER_INTS * (long)sizeof(int32_t) + (long)(start * ld->token_bytes);
        unsigned char *raw = (unsigned char *)ld->scratch;
        if (fseek(ld->file, at, SEEK_SET) != 0 ||
            fread(raw, (size_t)ld->token_bytes, n, ld->file) != n)
            return lg_fail(err, "data %s: read failed at token %zu", ld->path, start);
        for (size_t i = n; i-- > 0;) {
            const unsigned char *b = raw + i * ld->token_bytes;
            ld->scratch[i] = ld->token_bytes == 2 ? (uint32_t)(b[0] | b[1] << 8)
                                                  : (uint32_t)b[0] | (uint32_t)b[1] << 8 |
                                                        (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
        }
    }
    for (size_t i = 0; i < n; i++)
        if (ld->scratch[i] >= (uint32_t)ld->vocab_size)
            return lg_fail(err, "data %s: token %u at position %zu is outside the model's "
                                "vocabulary of %d", ld->path, ld->scratch[i], start + i,
                           ld->vocab_size);
    return 0;
}

int lg_loader_next(lg_loader *ld, int B, int *inputs, int *targets, lg_error *err) {
    int T = ld->T;
    if (ld->n_samples && lg_samples_next(ld, B, inputs, targets, NULL) != 0)
        return lg_fail(err, "data %s: out of host memory", ld->path);
    for (int b = 0; b < B && !ld->n_samples; b++) {
        size_t window = lg_loader_take(ld);
        if (lg_loader_read_window(ld, window * (size_t)T, err) != 0) return -1;
        for (int t = 0; t < T; t++) {
            inputs[b * T + t] = (int)ld->scratch[t];
            targets[b * T + t] = (int)ld->scratch[t + 1];
        }
    }
    return 0;
}

void lg_loader_rewind(lg_loader *ld) {
    ld->position = 0;
    ld->epoch = 0;
}

/* Windows (samples) of this epoch's order not yet read: after lg_loader_rewind, one pass. */
static size_t lg_loader_left(const lg_loader *ld) { return ld->n_windows - ld->position; }

void lg_loader_close(lg_loader *ld) {
    if (ld->file) fclose(ld->file);
    LG_FREE(ld->memory);
    LG_FREE(ld->order);
    LG_FREE(ld->scratch);
    LG_FREE(ld->sample_start);
    LG_FREE(ld->sample_length);
    LG_FREE(ld->prompt_length);
    memset(ld, 0, sizeof *ld);
}

int lg_shard_write(const char *path, const uint32_t *tokens, size_t n, int token_bytes,
                   lg_error *err) {
    FILE *f = fopen(path, "wb");
    if (!f) return lg_fail(err, "data %s: cannot create: %s", path, strerror(errno));
    int32_t header[LG_SHARD_HEADER_INTS];
    memset(header, 0, sizeof header);
    header[0] = token_bytes == 2 ? LG_SHARD_MAGIC_U16 : LG_SHARD_MAGIC_U32;
    header[1] = token_bytes == 2 ? LG_SHARD_VERSION_U16 : LG_SHARD_VERSION_U32;
    header[2] = (int32_t)n;
    int ok = fwrite(header, sizeof header, 1, f) == 1;
    for (size_t i = 0; ok && i < n; i++) {
        unsigned char raw[4] = {(unsigned char)tokens[i], (unsigned char)(tokens[i] >> 8),
                                (unsigned char)(tokens[i] >> 16), (unsigned char)(tokens[i] >> 24)};
        ok = fwrite(raw, 1, (size_t)token_bytes, f) == (size_t)token_bytes;
    }
    if (fclose(f) != 0 || !ok) return lg_fail(err, "data %s: write failed", path);
    return 0;
}

/* One sample of the built-in task: random letters, '=', the letters sorted, '\n'. */
static size_t lg_builtin_sample(lg_rng *rng, uint32_t *out) {
    int n = 1 + (int)(lg_rng_u64(rng) % LG_BUILTIN_MAX_LETTERS);
    int counts[26] = {0};
    size_t len = 0;
    for (int i = 0; i < n; i++) {
        int letter = (int)(lg_rng_u64(rng) % 26);
        counts[letter]++;
        out[len++] = (uint32_t)lg_char_encode_one((char)('a' + letter));
    }
    out[len++] = (uint32_t)lg_char_encode_one('=');
    for (int letter = 0; letter < 26; letter++)
        for (int k = 0; k < counts[letter]; k++)
            out[len++] = (uint32_t)lg_char_encode_one((char)('a' + letter));
    out[len++] = (uint32_t)lg_char_encode_one('\n');
    return len;
}

uint32_t *lg_builtin_task_tokens(uint64_t seed, size_t min_tokens, size_t *n_tokens) {
    size_t max_sample = 2 * LG_BUILTIN_MAX_LETTERS + 2;
    uint32_t *tokens = (uint32_t *)LG_MALLOC(sizeof(uint32_t) * (min_tokens + max_sample));
    if (!tokens) return NULL;
    lg_rng rng;
    lg_rng_seed(&rng, seed);
    size_t n = 0;
    while (n < min_tokens) n += lg_builtin_sample(&rng, tokens + n);
    *n_tokens = n;
    return tokens;
}

/* --- fine-tuning samples ------------------------------------------------------------------- */

/* The sample tables of a loader holding n samples; 0 or -1 (out of memory). */
static int lg_samples_alloc(lg_loader *ld, size_t n) {
    ld->n_samples = n;
    ld->sample_start = (size_t *)lg_alloc_zeroed(sizeof(size_t) * n);
    ld->sample_length = (uint32_t *)lg_alloc_zeroed(sizeof(uint32_t) * n);
    ld->prompt_length = (uint32_t *)lg_alloc_zeroed(sizeof(uint32_t) * n);
    return ld->sample_start && ld->sample_length && ld->prompt_length ? 0 : -1;
}

/* Checks one sample record at raw[at..] and copies its tokens; names the sample when wrong. */
static int lg_samples_read_one(lg_loader *ld, const unsigned char *raw, size_t size, size_t *at,
                               size_t i, size_t *n_tokens, lg_error *err) {
    if (size - *at < 8)
        return lg_fail(err, "data %s: sample %zu: the file ends inside its lengths (truncated?)",
                       ld->path, i);
    uint32_t n = lg_u32_le(raw + *at), prompt = lg_u32_le(raw + *at + 4);
    *at += 8;
    if (n == 0) return lg_fail(err, "data %s: sample %zu has no tokens", ld->path, i);
    if (prompt > n)
        return lg_fail(err, "data %s: sample %zu: prompt of %u tokens in a sample of %u",
                       ld->path, i, prompt, n);
    if ((size - *at) / (size_t)ld->token_bytes < n)
        return lg_fail(err, "data %s: sample %zu says %u tokens, past the end of the file "
                            "(truncated or corrupt)", ld->path, i, n);
    ld->sample_start[i] = *n_tokens;
    ld->sample_length[i] = n;
    ld->prompt_length[i] = prompt;
    for (uint32_t k = 0; k < n; k++, *at += (size_t)ld->token_bytes) {
        const unsigned char *b = raw + *at;
        uint32_t stored = ld->token_bytes == 2 ? (uint32_t)(b[0] | b[1] << 8) : lg_u32_le(b);
        uint32_t token = ld->mask_prompt == LG_SAMPLES_MASK_TOKENS ? stored & LG_SAMPLES_TOKEN_BITS
                                                                  : stored;
        if (token >= (uint32_t)ld->vocab_size)
            return lg_fail(err, "data %s: sample %zu: token %u is outside the model's "
                                "vocabulary of %d", ld->path, i, token, ld->vocab_size);
        if (token > ld->max_token) ld->max_token = token;
        ld->memory[(*n_tokens)++] = stored; /* masking 2: the trained bit kept */
    }
    return 0;
}

/* Parses a whole sample file held in raw; the header is already known to be a sample file. */
static int lg_samples_parse(lg_loader *ld, const unsigned char *raw, size_t size, lg_error *err) {
    const size_t header_bytes = LG_SHARD_HEADER_INTS * 4;
    int32_t version = (int32_t)lg_u32_le(raw + 4), n = (int32_t)lg_u32_le(raw + 8);
    int32_t token_bytes = (int32_t)lg_u32_le(raw + 12), mask = (int32_t)lg_u32_le(raw + 16);
    if (version != LG_SAMPLES_VERSION)
        return lg_fail(err, "data %s: sample file version %d, expected %d", ld->path, version,
                       LG_SAMPLES_VERSION);
    if (token_bytes != 2 && token_bytes != 4)
        return lg_fail(err, "data %s: %d bytes a token, expected 2 or 4", ld->path, token_bytes);
    if (mask != 0 && mask != 1 && mask != LG_SAMPLES_MASK_TOKENS)
        return lg_fail(err, "data %s: prompt masking %d, expected 0, 1 or 2", ld->path, mask);
    if (mask == LG_SAMPLES_MASK_TOKENS && token_bytes != 4)
        return lg_fail(err, "data %s: masking by token needs 4 bytes a token, not %d", ld->path,
                       token_bytes);
    if (n <= 0 || (size_t)n > (size - header_bytes) / 8)
        return lg_fail(err, "data %s: header says %d samples, impossible in %zu bytes", ld->path,
                       n, size);
    ld->token_bytes = token_bytes;
    ld->mask_prompt = mask;
    ld->memory = (uint32_t *)LG_MALLOC(sizeof(uint32_t) * ((size - header_bytes) / token_bytes + 1));
    if (!ld->memory || lg_samples_alloc(ld, (size_t)n) != 0)
        return lg_fail(err, "data %s: out of host memory", ld->path);
    size_t at = header_bytes, n_tokens = 0;
    for (size_t i = 0; i < (size_t)n; i++)
        if (lg_samples_read_one(ld, raw, size, &at, i, &n_tokens, err) != 0) return -1;
    if (at != size)
        return lg_fail(err, "data %s: %zu bytes after the last of %d samples (corrupt?)",
                       ld->path, size - at, n);
    ld->n_tokens = n_tokens;
    return 0;
}

/* Shared tail of the sample constructors: truncation, the longest sample, order, scratch. */
static int lg_samples_finish(lg_loader *ld, int T, int shuffle, uint64_t seed, lg_error *err) {
    uint32_t longest = 0;
    for (size_t i = 0; i < ld->n_samples; i++)
        if (ld->sample_length[i] > longest) longest = ld->sample_length[i];
    if (T < 0) return lg_fail(err, "data %s: truncation to %d tokens", ld->path, T);
    if (T == 0 || (uint32_t)T > longest) T = (int)longest;
    ld->T = T;
    ld->n_windows = ld->n_samples;
    lg_rng_seed(&ld->rng, seed);
    ld->scratch = (uint32_t *)lg_alloc_zeroed(sizeof(uint32_t) * (T + 1));
    if (shuffle) ld->order = (size_t *)lg_alloc_zeroed(sizeof(size_t) * ld->n_windows);
    if (!ld->scratch || (shuffle && !ld->order))
        return lg_fail(err, "data %s: out of host memory", ld->path);
    if (shuffle) lg_loader_shuffle(ld);
    return 0;
}

/* lg_loader_open's path for sample files: the whole file is read and checked up front. */
static int lg_samples_open(lg_loader *ld, int T, int shuffle, uint64_t seed, lg_error *err) {
    fseek(ld->file, 0, SEEK_END);
    long size = ftell(ld->file);
    unsigned char *raw = size > 0 ? (unsigned char *)LG_MALLOC((size_t)size) : NULL;
    int rc = -1;
    if (!raw) lg_fail(err, "data %s: out of host memory", ld->path);
    else if (fseek(ld->file, 0, SEEK_SET) != 0 || fread(raw, 1, (size_t)size, ld->file) != (size_t)size)
        lg_fail(err, "data %s: read failed", ld->path);
    else rc = lg_samples_parse(ld, raw, (size_t)size, err);
    if (raw) ld->file_bytes = (uint64_t)size, ld->file_hash = lg_hash64(LG_HASH64_INIT, raw, (size_t)size);
    LG_FREE(raw);
    fclose(ld->file);
    ld->file = NULL;
    if (rc == 0) rc = lg_samples_finish(ld, T, shuffle, seed, err);
    if (rc != 0) lg_loader_close(ld);
    return rc;
}

/* Row b of a sample micro-batch of width T: tokens, shifted targets, padding, masks. */
static void lg_samples_fill_row(const lg_loader *ld, size_t sample, int T, int *inputs,
                                int *targets) {
    const uint32_t *tokens = ld->memory + ld->sample_start[sample];
    int n = (int)ld->sample_length[sample];
    if (n > ld->T) n = ld->T;
    if (ld->mask_prompt == LG_SAMPLES_MASK_TOKENS) { /* the trained bit of each token */
        for (int t = 0; t < T; t++) {
            inputs[t] = t < n ? (int)(tokens[t] & LG_SAMPLES_TOKEN_BITS) : 0;
            targets[t] = t + 1 < n && tokens[t + 1] >> LG_SAMPLES_TRAINED_BIT
                             ? (int)(tokens[t + 1] & LG_SAMPLES_TOKEN_BITS) : LG_IGNORE_INDEX;
        }
        return;
    }
    int prompt = ld->mask_prompt ? (int)ld->prompt_length[sample] : 0;
    for (int t = 0; t < T; t++) {
        inputs[t] = t < n ? (int)tokens[t] : 0; /* any valid token: padding is never a target */
        targets[t] = t + 1 < n && t + 1 >= prompt ? (int)tokens[t + 1] : LG_IGNORE_INDEX;
    }
}

static size_t lg_loader_take(lg_loader *ld) {
    if (ld->position == ld->n_windows) {
        ld->position = 0;
        ld->epoch++;
        if (ld->order) lg_loader_shuffle(ld);
    }
    size_t next = ld->order ? ld->order[ld->position] : ld->position;
    ld->position++;
    return next;
}

static int lg_samples_next(lg_loader *ld, int B, int *inputs, int *targets, int *T_batch) {
    size_t picked[64]; /* the batch is picked first, to know its longest row */
    int width = 0;
    size_t *rows = B <= 64 ? picked : (size_t *)LG_MALLOC(sizeof(size_t) * (size_t)B);
    if (!rows) return -1;
    for (int b = 0; b < B; b++) {
        rows[b] = lg_loader_take(ld);
        int n = (int)ld->sample_length[rows[b]];
        width = n > width ? n : width;
    }
    if (width > ld->T) width = ld->T;
    if (T_batch) *T_batch = width;
    else width = ld->T; /* lg_loader_next: rows of the loader's full length */
    for (int b = 0; b < B; b++)
        lg_samples_fill_row(ld, rows[b], width, inputs + (size_t)b * width,
                            targets + (size_t)b * width);
    if (rows != picked) LG_FREE(rows);
    return 0;
}

int lg_loader_next_batch(lg_loader *ld, int B, int *inputs, int *targets, int *T_batch,
                         lg_error *err) {
    if (ld->n_samples == 0) {
        *T_batch = ld->T;
        return lg_loader_next(ld, B, inputs, targets, err);
    }
    if (lg_samples_next(ld, B, inputs, targets, T_batch) != 0)
        return lg_fail(err, "data %s: out of host memory", ld->path);
    return 0;
}

/* Sample `sample` into row (T) at column `at`: tokens, shifted targets, masks, span starts. */
static void lg_pack_place(const lg_loader *ld, size_t sample, int at, int n, int *inputs,
                          int *targets, int *span_start) {
    lg_samples_fill_row(ld, sample, n, inputs + at, targets + at);
    for (int t = 0; t < n; t++) span_start[at + t] = at;
}

/* lg_loader_next_packed taking at most `most` samples of the order (validation: those left in
   its one pass, lg_loader_left). */
static int lg_loader_pack_rows(lg_loader *ld, int B, int T, size_t most, int *inputs,
                               int *targets, int *span_start, int *n_packed, lg_error *err) {
    if (ld->n_samples == 0)
        return lg_fail(err, "data %s: `pack` packs fine-tuning samples (tools/prepare alpaca); "
                            "token shards are already full rows", ld->path);
    if (T < ld->T)
        return lg_fail(err, "data %s: packed rows of %d tokens hold no sample of %d (the "
                            "longest after truncation)", ld->path, T, ld->T);
    int used[64]; /* tokens placed in each row */
    if (B > 64) return lg_fail(err, "data %s: `pack` takes micro-batches of at most 64 rows", ld->path);
    for (int b = 0; b < B; b++) used[b] = 0;
    *n_packed = 0;
    for (size_t tries = 0; tries < most && tries < ld->n_samples; tries++) {
        size_t sample = lg_loader_take(ld);
        int n = (int)ld->sample_length[sample] < ld->T ? (int)ld->sample_length[sample] : ld->T;
        int b = 0;
        while (b < B && used[b] + n > T) b++;
        if (b == B) { ld->position--; break; } /* waits for the next call, first in line */
        size_t row = (size_t)b * T;
        lg_pack_place(ld, sample, used[b], n, inputs + row, targets + row, span_start + row);
        used[b] += n;
        (*n_packed)++;
    }
    for (int b = 0; b < B; b++)
        for (int t = used[b]; t < T; t++) {
            size_t at = (size_t)b * T + t;
            inputs[at] = 0; /* any valid token: padding is never a target */
            targets[at] = LG_IGNORE_INDEX;
            span_start[at] = t;
        }
    return 0;
}

int lg_loader_next_packed(lg_loader *ld, int B, int T, int *inputs, int *targets,
                          int *span_start, int *n_packed, lg_error *err) {
    return lg_loader_pack_rows(ld, B, T, ld->n_samples, inputs, targets, span_start, n_packed,
                               err);
}

/* Sample k of the epoch's order, truncated to the loader's T. */
static int lg_loader_length_at(const lg_loader *ld, size_t k) {
    size_t sample = ld->order ? ld->order[k] : k;
    return (int)ld->sample_length[sample] < ld->T ? (int)ld->sample_length[sample] : ld->T;
}

void lg_loader_packing_stats(const lg_loader *ld, int B, int T, lg_packing_stats *stats) {
    int used[64]; /* as lg_loader_next_packed: tokens in each row of the open micro-batch */
    size_t tokens = 0, padded = 0, batches = 0, n = ld->n_samples;
    memset(stats, 0, sizeof *stats);
    if (n == 0 || B < 1 || B > 64 || T < ld->T) return;
    for (size_t first = 0; first < n; first += (size_t)B) { /* one sample a row */
        int longest = 0;
        for (size_t k = first; k < first + (size_t)B && k < n; k++) {
            int len = lg_loader_length_at(ld, k);
            tokens += (size_t)len;
            longest = len > longest ? len : longest;
        }
        padded += (size_t)B * (size_t)longest;
    }
    for (size_t k = 0; k < n; batches++) { /* packed: first-fit over B rows, then the next */
        for (int b = 0; b < B; b++) used[b] = 0;
        for (; k < n; k++) {
            int len = lg_loader_length_at(ld, k), b = 0;
            while (b < B && used[b] + len > T) b++;
            if (b == B) break;
            used[b] += len;
        }
    }
    double rows = (double)batches * B;
    stats->samples_per_row = (double)n / rows;
    stats->padding_packed = 1.0 - (double)tokens / (rows * T);
    stats->padding_unpacked = 1.0 - (double)tokens / (double)padded;
}

int lg_samples_file(const char *path) {
    FILE *f = fopen(path, "rb");
    unsigned char magic[4] = {0, 0, 0, 0};
    int n = f ? (int)fread(magic, 1, 4, f) : 0;
    if (f) fclose(f);
    return n == 4 && lg_u32_le(magic) == LG_SAMPLES_MAGIC;
}

int lg_loader_longest(const lg_loader *ld) { return ld->n_samples ? ld->T : 0; }

/* Sample i's first position whose token is a target that trains (its target row is one
   shorter), or 0 when none is: the tokens' trained bit, else past the prompt (masked) or 1. */
static uint32_t lg_sample_first_trained(const lg_loader *ld, size_t i) {
    uint32_t n = ld->sample_length[i];
    const uint32_t *tokens = ld->memory + ld->sample_start[i];
    if (ld->mask_prompt == LG_SAMPLES_MASK_TOKENS) {
        for (uint32_t k = 1; k < n; k++)
            if (tokens[k] >> LG_SAMPLES_TRAINED_BIT) return k;
        return 0;
    }
    uint32_t first = ld->mask_prompt && ld->prompt_length[i] > 1 ? ld->prompt_length[i] : 1;
    return first < n ? first : 0;
}

int lg_loader_shortest_trained(const lg_loader *ld) {
    uint32_t shortest = 0;
    for (size_t i = 0; i < ld->n_samples; i++) {
        uint32_t first = lg_sample_first_trained(ld, i);
        if (first && (!shortest || first + 1 < shortest)) shortest = first + 1;
    }
    return (int)shortest;
}

int lg_loader_check_block_size(const lg_loader *ld, int block_size, lg_error *err) {
    for (size_t i = 0; i < ld->n_samples; i++) {
        int n = (int)ld->sample_length[i];
        if (n > ld->T) n = ld->T;
        if (n > block_size)
            return lg_fail(err, "data %s: sample %zu has %d tokens, more than the model's "
                                "block_size %d (truncate with `max_seq_length`)", ld->path, i,
                           n, block_size);
    }
    return 0;
}

static void lg_put_u32(unsigned char *b, uint32_t v) {
    for (int i = 0; i < 4; i++) b[i] = (unsigned char)(v >> (8 * i));
}

int lg_samples_write(const char *path, const uint32_t *tokens, const uint32_t *lengths,
                     const uint32_t *prompt_lengths, size_t n_samples, int token_bytes,
                     int mask_prompt, lg_error *err) {
    FILE *f = fopen(path, "wb");
    if (!f) return lg_fail(err, "data %s: cannot create: %s", path, strerror(errno));
    unsigned char header[LG_SHARD_HEADER_INTS * 4];
    memset(header, 0, sizeof header);
    lg_put_u32(header, LG_SAMPLES_MAGIC);
    lg_put_u32(header + 4, LG_SAMPLES_VERSION);
    lg_put_u32(header + 8, (uint32_t)n_samples);
    lg_put_u32(header + 12, (uint32_t)token_bytes);
    lg_put_u32(header + 16, (uint32_t)(mask_prompt == LG_SAMPLES_MASK_TOKENS ? mask_prompt
                                                                              : mask_prompt != 0));
    int ok = fwrite(header, sizeof header, 1, f) == 1;
    size_t at = 0;
    for (size_t i = 0; ok && i < n_samples; i++) {
        unsigned char lens[8], raw[4];
        lg_put_u32(lens, lengths[i]);
        lg_put_u32(lens + 4, prompt_lengths[i]);
        ok = fwrite(lens, 8, 1, f) == 1;
        for (uint32_t k = 0; ok && k < lengths[i]; k++) {
            lg_put_u32(raw, tokens[at++]);
            ok = fwrite(raw, 1, (size_t)token_bytes, f) == (size_t)token_bytes;
        }
    }
    if (fclose(f) != 0 || !ok) return lg_fail(err, "data %s: write failed", path);
    return 0;
}

int lg_data_record_tokenizer(const char *path, uint64_t tokenizer_hash, lg_error *err) {
    unsigned char slot[8];
    lg_put_u32(slot, (uint32_t)tokenizer_hash);
    lg_put_u32(slot + 4, (uint32_t)(tokenizer_hash >> 32));
    FILE *f = fopen(path, "r+b");
    if (!f) return lg_fail(err, "data %s: cannot open: %s", path, strerror(errno));
    int ok = fseek(f, LG_DATA_TOKENIZER_AT * 4, SEEK_SET) == 0 && fwrite(slot, 8, 1, f) == 1;
    if (fclose(f) != 0 || !ok) return lg_fail(err, "data %s: write failed", path);
    return 0;
}

int lg_loader_check_tokenizer(const lg_loader *ld, const lg_tokenizer *tok, lg_error *err) {
    if (!ld->tokenizer_hash || ld->tokenizer_hash == tok->files_hash) return 0;
    return lg_fail(err, "data %s was made with another tokenizer (files hash %016llx) than "
                        "tokenizer %s (%016llx), the model's: its ids would mean other text",
                   ld->path, (unsigned long long)ld->tokenizer_hash, tok->path,
                   (unsigned long long)tok->files_hash);
}

void lg_builtin_task_text(lg_rng *rng, char *letters, char *sorted) {
    int n = 1 + (int)(lg_rng_u64(rng) % LG_BUILTIN_MAX_LETTERS), counts[26] = {0}, len = 0;
    for (int i = 0; i < n; i++) {
        int letter = (int)(lg_rng_u64(rng) % 26);
        counts[letter]++;
        letters[i] = (char)('a' + letter);
    }
    letters[n] = '\0';
    for (int letter = 0; letter < 26; letter++)
        for (int k = 0; k < counts[letter]; k++) sorted[len++] = (char)('a' + letter);
    sorted[len] = '\0';
}

int lg_builtin_task_samples(lg_loader *ld, uint64_t seed, size_t n_samples, int T, int shuffle,
                            uint64_t shuffle_seed, lg_error *err) {
    memset(ld, 0, sizeof *ld);
    snprintf(ld->path, sizeof ld->path, "(built-in)");
    ld->vocab_size = LG_CHAR_VOCAB;
    ld->token_bytes = 4;
    ld->mask_prompt = 1;
    size_t max_sample = 2 * LG_BUILTIN_MAX_LETTERS + 2;
    ld->memory = (uint32_t *)LG_MALLOC(sizeof(uint32_t) * max_sample * (n_samples ? n_samples : 1));
    if (n_samples == 0 || !ld->memory || lg_samples_alloc(ld, n_samples) != 0) {
        lg_loader_close(ld);
        return lg_fail(err, "built-in task: %zu samples: out of host memory", n_samples);
    }
    lg_rng rng;
    lg_rng_seed(&rng, seed);
    for (size_t i = 0; i < n_samples; i++) {
        uint32_t *out = ld->memory + ld->n_tokens;
        size_t len = lg_builtin_sample(&rng, out);
        uint32_t prompt = 0;
        while (out[prompt] != (uint32_t)lg_char_encode_one('=')) prompt++;
        ld->sample_start[i] = ld->n_tokens;
        ld->sample_length[i] = (uint32_t)len;
        ld->prompt_length[i] = prompt + 1; /* the letters and '=' */
        ld->n_tokens += len;
    }
    ld->file_bytes = sizeof(uint32_t) * ld->n_tokens;
    ld->file_hash = lg_hash64(LG_HASH64_INIT, ld->memory, sizeof(uint32_t) * ld->n_tokens);
    if (lg_samples_finish(ld, T, shuffle, shuffle_seed, err) == 0) return 0;
    lg_loader_close(ld);
    return -1;
}

/* --- Alpaca-style JSON ------------------------------------------------------------------------ */

/* Field key of object node as a new string; "" for an absent optional field. */
static char *lg_alpaca_field(const lg_json *doc, int node, const char *key, int required,
                             const char *where, lg_error *err) {
    int value = lg_json_find(doc, node, key);
    if (value < 0 && !required) value = -2;
    char *text = value == -2 ? (char *)lg_alloc_zeroed(1) : lg_json_string(doc, value, NULL);
    if (!text && value >= 0 && doc->nodes[value].kind == LG_JSON_NULL && !required)
        text = (char *)lg_alloc_zeroed(1);
    if (!text)
        lg_fail(err, "%s: %s \"%s\"", where, value < 0 ? "missing field" : "not a string:", key);
    return text;
}

/* One object of the file into sample i. */
static int lg_alpaca_take(lg_alpaca *set, const lg_json *doc, int node, const char *where,
                          lg_error *err) {
    if (doc->nodes[node].kind != LG_JSON_OBJECT)
        return lg_fail(err, "%s: expected an object with instruction, input, output", where);
    lg_alpaca_sample *s = &set->samples[set->n];
    s->instruction = lg_alpaca_field(doc, node, "instruction", 1, where, err);
    s->input = s->instruction ? lg_alpaca_field(doc, node, "input", 0, where, err) : NULL;
    s->output = s->input ? lg_alpaca_field(doc, node, "output", 1, where, err) : NULL;
    set->n++; /* counted even when incomplete, so lg_alpaca_free releases it */
    return s->output ? 0 : -1;
}

/* A JSON array of objects. */
static int lg_alpaca_array(lg_alpaca *set, const char *text, size_t len, const char *path,
                           lg_error *err) {
    lg_json doc;
    if (lg_json_parse(&doc, text, len, path, err) != 0) return -1;
    size_t count = 0;
    for (int k = doc.nodes[0].first_child; k >= 0; k = doc.nodes[k].next) count++;
    set->samples = (lg_alpaca_sample *)lg_alloc_zeroed(sizeof(lg_alpaca_sample) * (count + 1));
    int rc = set->samples ? 0 : lg_fail(err, "%s: out of host memory", path);
    for (int k = doc.nodes[0].first_child; k >= 0 && rc == 0; k = doc.nodes[k].next) {
        char where[600];
        snprintf(where, sizeof where, "%s sample %zu", path, set->n);
        rc = lg_alpaca_take(set, &doc, k, where, err);
    }
    lg_json_free(&doc);
    return rc;
}

/* JSON lines: one object a line; blank lines are skipped. */
static int lg_alpaca_lines(lg_alpaca *set, const char *text, size_t len, const char *path,
                           lg_error *err) {
    size_t lines = 1;
    for (size_t i = 0; i < len; i++) lines += text[i] == '\n';
    set->samples = (lg_alpaca_sample *)lg_alloc_zeroed(sizeof(lg_alpaca_sample) * lines);
    if (!set->samples) return lg_fail(err, "%s: out of host memory", path);
    size_t line_no = 0;
    for (size_t at = 0; at < len;) {
        const char *end = (const char *)memchr(text + at, '\n', len - at);
        size_t n = end ? (size_t)(end - (text + at)) : len - at;
        line_no++;
        size_t blank = 0;
        while (blank < n && strchr(" \t\r", text[at + blank])) blank++;
        if (blank < n) {
            char where[600];
            snprintf(where, sizeof where, "%s line %zu (sample %zu)", path, line_no, set->n);
            lg_json doc;
            if (lg_json_parse(&doc, text + at, n, where, err) != 0) return -1;
            int rc = lg_alpaca_take(set, &doc, 0, where, err);
            lg_json_free(&doc);
            if (rc != 0) return -1;
        }
        at += n + 1;
    }
    return 0;
}

int lg_alpaca_read(lg_alpaca *set, const char *path, lg_error *err) {
    memset(set, 0, sizeof *set);
    size_t len;
    char *text = lg_read_file(path, &len, "data", err);
    if (!text) return -1;
    size_t first = 0;
    while (first < len && strchr(" \t\r\n", text[first]) && text[first]) first++;
    int rc = first < len && text[first] == '[' ? lg_alpaca_array(set, text, len, path, err)
                                               : lg_alpaca_lines(set, text, len, path, err);
    if (rc == 0 && set->n == 0) rc = lg_fail(err, "%s: no samples", path);
    LG_FREE(text);
    if (rc != 0) lg_alpaca_free(set);
    return rc;
}

void lg_alpaca_free(lg_alpaca *set) {
    for (size_t i = 0; set->samples && i < set->n; i++) {
        LG_FREE(set->samples[i].instruction);
        LG_FREE(set->samples[i].input);
        LG_FREE(set->samples[i].output);
    }
    LG_FREE(set->samples);
    memset(set, 0, sizeof *set);
}

/* Stanford Alpaca's prompt, with and without an input. */
int lg_alpaca_prompt(const lg_alpaca_sample *sample, lg_text *out) {
    const char *intro = sample->input[0]
        ? "Below is an instruction that describes a task, paired with an input that provides "
          "further context. Write a response that appropriately completes the request.\n\n"
        : "Below is an instruction that describes a task. Write a response that appropriately "
          "completes the request.\n\n";
    int rc = lg_text_append(out, intro, strlen(intro));
    rc |= lg_text_append(out, "### Instruction:\n", 17);
    rc |= lg_text_append(out, sample->instruction, strlen(sample->instruction));
    if (sample->input[0]) {
        rc |= lg_text_append(out, "\n\n### Input:\n", 13);
        rc |= lg_text_append(out, sample->input, strlen(sample->input));
    }
    rc |= lg_text_append(out, "\n\n### Response:\n", 16);
    return rc ? -1 : 0;
}

/* --- chat conversations ----------------------------------------------------------------------- */

/* The role named by a messages "role" or a ShareGPT "from"; -1 when unknown. */
static int lg_chat_role_of(const char *name) {
    static const char *const names[] = {"system", "user", "human", "assistant", "gpt"};
    static const lg_chat_role roles[] = {LG_ROLE_SYSTEM, LG_ROLE_USER, LG_ROLE_USER,
                                         LG_ROLE_ASSISTANT, LG_ROLE_ASSISTANT};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(name, names[i])) return (int)roles[i];
    return -1;
}

/* Turn k of a conversation from its JSON object (keys role/content or from/value). */
static int lg_chat_take_turn(lg_chat *chat, const lg_json *doc, int node, int sharegpt,
                             const char *where, lg_error *err) {
    int k = chat->n;
    const char *role_key = sharegpt ? "from" : "role", *text_key = sharegpt ? "value" : "content";
    if (doc->nodes[node].kind != LG_JSON_OBJECT)
        return lg_fail(err, "%s turn %d: expected an object with \"%s\" and \"%s\"", where, k,
                       role_key, text_key);
    char role[32];
    if (lg_json_string_copy(doc, lg_json_find(doc, node, role_key), role, sizeof role) != 0)
        return lg_fail(err, "%s turn %d: missing or bad \"%s\"", where, k, role_key);
    int r = lg_chat_role_of(role);
    if (r < 0)
        return lg_fail(err, "%s turn %d: unknown role \"%s\" (system, user or human, assistant "
                            "or gpt)", where, k, role);
    size_t len = 0;
    char *content = lg_json_string(doc, lg_json_find(doc, node, text_key), &len);
    if (!content) return lg_fail(err, "%s turn %d: missing or bad \"%s\"", where, k, text_key);
    chat->turns[k].role = (lg_chat_role)r;
    chat->turns[k].content = content;
    chat->n++;
    if (r == LG_ROLE_ASSISTANT && len == 0)
        return lg_fail(err, "%s turn %d: empty assistant turn", where, k);
    if (strlen(content) != len)
        return lg_fail(err, "%s turn %d: a NUL character in \"%s\"", where, k, text_key);
    return 0;
}

/* One record of the file into conversation set->n. */
static int lg_chat_take(lg_chat_set *set, const lg_json *doc, int node, const char *where,
                        lg_error *err) {
    if (doc->nodes[node].kind != LG_JSON_OBJECT)
        return lg_fail(err, "%s: expected an object with \"messages\" or \"conversations\"", where);
    int list = lg_json_find(doc, node, "messages"), sharegpt = list < 0;
    if (sharegpt) list = lg_json_find(doc, node, "conversations");
    if (list < 0 || doc->nodes[list].kind != LG_JSON_ARRAY)
        return lg_fail(err, "%s: no \"messages\" or \"conversations\" list", where);
    lg_chat *chat = &set->chats[set->n++]; /* counted at once, so lg_chat_free releases it */
    int count = lg_json_count(doc, list);
    chat->turns = (lg_chat_turn *)lg_alloc_zeroed(sizeof(lg_chat_turn) * (size_t)(count + 1));
    if (!chat->turns) return lg_fail(err, "%s: out of host memory", where);
    int assistant = 0;
    for (int k = doc->nodes[list].first_child; k >= 0; k = doc->nodes[k].next) {
        if (lg_chat_take_turn(chat, doc, k, sharegpt, where, err) != 0) return -1;
        assistant |= chat->turns[chat->n - 1].role == LG_ROLE_ASSISTANT;
    }
    if (!assistant) return lg_fail(err, "%s: no assistant turn to train on", where);
    return 0;
}

/* A JSON array of records (first == '[') or JSON lines. */
static int lg_chat_records(lg_chat_set *set, const char *text, size_t len, int array,
                           const char *path, lg_error *err) {
    size_t lines = 1;
    for (size_t i = 0; i < len; i++) lines += text[i] == '\n' || text[i] == ',';
    set->chats = (lg_chat *)lg_alloc_zeroed(sizeof(lg_chat) * lines);
    if (!set->chats) return lg_fail(err, "%s: out of host memory", path);
    char where[600];
    if (array) {
        lg_json doc;
        if (lg_json_parse(&doc, text, len, path, err) != 0) return -1;
        int rc = doc.nodes[0].kind == LG_JSON_ARRAY ? 0 : lg_fail(err, "%s: not an array", path);
        for (int k = doc.nodes[0].first_child; k >= 0 && rc == 0; k = doc.nodes[k].next) {
            snprintf(where, sizeof where, "%s record %zu", path, set->n);
            rc = lg_chat_take(set, &doc, k, where, err);
        }
        lg_json_free(&doc);
        return rc;
    }
    size_t line_no = 0;
    for (size_t at = 0; at < len; at++) {
        const char *end = (const char *)memchr(text + at, '\n', len - at);
        size_t n = end ? (size_t)(end - (text + at)) : len - at, blank = 0;
        line_no++;
        while (blank < n && strchr(" \t\r", text[at + blank])) blank++;
        if (blank < n) {
            snprintf(where, sizeof where, "%s line %zu (record %zu)", path, line_no, set->n);
            lg_json doc;
            if (lg_json_parse(&doc, text + at, n, where, err) != 0) return -1;
            int rc = lg_chat_take(set, &doc, 0, where, err);
            lg_json_free(&doc);
            if (rc != 0) return -1;
        }
        at += n;
    }
    return 0;
}

int lg_chat_parse(lg_chat_set *set, const char *text, size_t len, const char *path,
                  lg_error *err) {
    memset(set, 0, sizeof *set);
    size_t first = 0;
    while (first < len && strchr(" \t\r\n", text[first]) && text[first]) first++;
    int rc = lg_chat_records(set, text, len, first < len && text[first] == '[', path, err);
    if (rc == 0 && set->n == 0) rc = lg_fail(err, "%s: no conversations", path);
    if (rc != 0) lg_chat_free(set);
    return rc;
}

int lg_chat_read(lg_chat_set *set, const char *path, lg_error *err) {
    memset(set, 0, sizeof *set);
    size_t len;
    char *text = lg_read_file(path, &len, "data", err);
    if (!text) return -1;
    int rc = lg_chat_parse(set, text, len, path, err);
    LG_FREE(text);
    return rc;
}

void lg_chat_free(lg_chat_set *set) {
    for (size_t i = 0; set->chats && i < set->n; i++) {
        for (int k = 0; k < set->chats[i].n; k++) LG_FREE(set->chats[i].turns[k].content);
        LG_FREE(set->chats[i].turns);
    }
    LG_FREE(set->chats);
    memset(set, 0, sizeof *set);
}

/* --- chat templates --------------------------------------------------------------------------- */

int lg_chat_template_find(const char *name, lg_chat_template *out, lg_error *err) {
    static const char *const names[] = LG_TEMPLATE_NAMES;
    for (int t = 0; t < LG_TEMPLATE_COUNT; t++)
        if (!strcmp(name, names[t])) { *out = (lg_chat_template)t; return 0; }
    return lg_fail(err, "`template` %s: no such template (plain, alpaca, llama3, llama2, chatml, "
                        "qwen3, falcon or auto)", name);
}

const char *lg_chat_template_name(lg_chat_template t) {
    static const char *const names[] = LG_TEMPLATE_NAMES;
    return t >= 0 && t < LG_TEMPLATE_COUNT ? names[t] : "?";
}

static int lg_chat_put(lg_chat_rendered *r, const char *s) {
    return lg_text_append(&r->text, s, strlen(s));
}

/* Marks r->text's next bytes trained (open 1) until the matching close (open 0). */
static int lg_chat_mark(lg_chat_rendered *r, int open) {
    if (open && r->n_spans == r->cap) {
        int cap = r->cap ? 2 * r->cap : 8;
        size_t *grown = (size_t *)LG_MALLOC(sizeof(size_t) * 2 * (size_t)cap);
        if (!grown) return -1;
        if (r->span) memcpy(grown, r->span, sizeof(size_t) * 2 * (size_t)r->n_spans);
        LG_FREE(r->span);
        r->span = grown;
        r->cap = cap;
    }
    if (open) r->span[2 * r->n_spans] = r->text.n;
    else r->span[2 * r->n_spans++ + 1] = r->text.n;
    return 0;
}

/* Whether the character at s[at] (of n bytes; *size gets its length) is whitespace to a chat
   template's trim and strip: 1 for what Python (str.strip) and JavaScript (String.trim, in
   @huggingface/jinja) both strip (ASCII \t \n \v \f \r and space, the Zs spaces, U+2028,
   U+2029), 2 for what only one strips (U+001C..U+001F and U+0085: Python; U+FEFF: JavaScript),
   0 for the rest. */
static int lg_chat_space(const char *s, size_t n, size_t at, int *size) {
    uint32_t c = lg_utf8_next((const unsigned char *)s + at, n - at, size);
    if (c == ' ' || (c >= '\t' && c <= '\r') || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) ||
        c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000)
        return 1;
    return (c >= 0x1C && c <= 0x1F) || c == 0x85 || c == 0xFEFF ? 2 : 0;
}

/* The bytes [*a, *b) of s without leading and trailing whitespace (lg_chat_space); 2 when a
   character only Python or only JavaScript strips ends it, else 0. */
static int lg_chat_trim_range(const char *s, size_t *a, size_t *b) {
    int size, kind = 0;
    *a = 0, *b = strlen(s);
    while (*a < *b && (kind = lg_chat_space(s, *b, *a, &size)) == 1) *a += (size_t)size;
    if (kind == 2) return 2;
    while (*b > *a) {
        size_t at = *b - 1;
        while (at > *a && ((unsigned char)s[at] & 0xC0) == 0x80) at--;
        if ((kind = lg_chat_space(s, *b, at, &size)) != 1) return kind == 2 ? 2 : 0;
        *b = at;
    }
    return 0;
}

/* Text without leading and trailing whitespace (Jinja's trim, strip), appended. */
static int lg_chat_put_trimmed(lg_chat_rendered *r, const char *s) {
    size_t a, b;
    lg_chat_trim_range(s, &a, &b);
    return lg_text_append(&r->text, s + a, b - a);
}

/* The text of a tokenizer's special id, or "" (none, or no tokenizer). */
static const char *lg_chat_special(const lg_tokenizer *tok, int id, char *buf, size_t cap) {
    buf[0] = '\0';
    if (!tok || id < 0 || id >= tok->vocab_size) return buf;
    size_t n = tok->piece_start[id + 1] - tok->piece_start[id];
    if (n >= cap) n = cap - 1;
    memcpy(buf, tok->pieces + tok->piece_start[id], n);
    buf[n] = '\0';
    return buf;
}

/* An assistant turn: content then end (the end-of-turn text), both trained. */
static int lg_chat_answer(lg_chat_rendered *r, const char *content, const char *end, int trim) {
    int rc = lg_chat_mark(r, 1);
    rc |= trim ? lg_chat_put_trimmed(r, content) : lg_chat_put(r, content);
    rc |= lg_chat_put(r, end);
    return rc | lg_chat_mark(r, 0);
}

/* Llama 3 / 3.1: <|begin_of_text|>, then each turn as a header, the trimmed content, <|eot_id|>. */
static int lg_chat_llama3(const lg_chat *c, int gen, lg_chat_rendered *r) {
    static const char *const roles[] = {"system", "user", "assistant"};
    int rc = lg_chat_put(r, "<|begin_of_text|>");
    for (int k = 0; k < c->n; k++) {
        rc |= lg_chat_put(r, "<|start_header_id|>");
        rc |= lg_chat_put(r, roles[c->turns[k].role]);
        rc |= lg_chat_put(r, "<|end_header_id|>\n\n");
        if (c->turns[k].role == LG_ROLE_ASSISTANT)
            rc |= lg_chat_answer(r, c->turns[k].content, "<|eot_id|>", 1);
        else rc |= lg_chat_put_trimmed(r, c->turns[k].content) | lg_chat_put(r, "<|eot_id|>");
    }
    if (gen) rc |= lg_chat_put(r, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    return rc;
}

/* ChatML: <|im_start|>ROLE\n CONTENT <|im_end|>\n; qwen3: the last assistant turn after the
   last user turn opens with an empty think block and its content's leading newlines go. */
static int lg_chat_chatml(const lg_chat *c, int gen, int qwen3, lg_chat_rendered *r) {
    static const char *const roles[] = {"system", "user", "assistant"};
    int rc = 0, last_user = -1;
    for (int k = 0; k < c->n; k++) last_user = c->turns[k].role == LG_ROLE_USER ? k : last_user;
    for (int k = 0; k < c->n; k++) {
        rc |= lg_chat_put(r, "<|im_start|>") | lg_chat_put(r, roles[c->turns[k].role]);
        rc |= lg_chat_put(r, "\n");
        const char *content = c->turns[k].content;
        if (c->turns[k].role != LG_ROLE_ASSISTANT) {
            rc |= lg_chat_put(r, content) | lg_chat_put(r, "<|im_end|>\n");
            continue;
        }
        rc |= lg_chat_mark(r, 1);
        if (qwen3 && k == c->n - 1 && k > last_user) {
            rc |= lg_chat_put(r, "<think>\n\n</think>\n\n");
            while (*content == '\n') content++;
        }
        rc |= lg_chat_put(r, content) | lg_chat_put(r, "<|im_end|>");
        rc |= lg_chat_mark(r, 0) | lg_chat_put(r, "\n");
    }
    if (gen) rc |= lg_chat_put(r, "<|im_start|>assistant\n");
    return rc;
}

/* Llama 2 (Meta's Llama-2-chat template): each user turn BOS "[INST] " CONTENT " [/INST]", the
   first one's content "<<SYS>>\nSYSTEM\n<</SYS>>\n\n" + its own when there is a system prompt,
   then stripped as a whole; each answer " " CONTENT " " EOS, trained with the space before it
   (SentencePiece's "\xE2\x96\x81Hello" holds it, as Meta's answers are tokenized). */
static int lg_chat_llama2(const lg_chat *c, const char *bos, const char *eos, lg_chat_rendered *r,
                          lg_error *err) {
    int rc = 0, k = 0;
    const char *system = NULL;
    if (c->n && c->turns[0].role == LG_ROLE_SYSTEM) system = c->turns[k++].content;
    for (int at = 0; k < c->n; k++, at++) {
        lg_chat_role role = c->turns[k].role;
        if (role == LG_ROLE_SYSTEM || (role == LG_ROLE_USER) != (at % 2 == 0))
            return lg_fail(err, "turn %d: llama2 takes a system prompt only first, then user and "
                                "assistant turns in turn", k);
        if (role == LG_ROLE_ASSISTANT) {
            rc |= lg_chat_mark(r, 1) | lg_chat_put(r, " ") | lg_chat_put_trimmed(r, c->turns[k].content);
            rc |= lg_chat_put(r, " ") | lg_chat_put(r, eos) | lg_chat_mark(r, 0);
            continue;
        }
        lg_text content = {NULL, 0, 0};
        if (at == 0 && system) {
            static const char open[] = "<<SYS>>\n", close[] = "\n<</SYS>>\n\n";
            rc |= lg_text_append(&content, open, sizeof open - 1);
            rc |= lg_text_append(&content, system, strlen(system));
            rc |= lg_text_append(&content, close, sizeof close - 1);
        }
        rc |= lg_text_append(&content, c->turns[k].content, strlen(c->turns[k].content));
        rc |= lg_text_append(&content, "", 1); /* its NUL */
        rc |= lg_chat_put(r, bos) | lg_chat_put(r, "[INST] ");
        rc |= (content.bytes ? lg_chat_put_trimmed(r, content.bytes) : -1) | lg_chat_put(r, " [/INST]");
        lg_text_free(&content);
    }
    return rc; /* a generation prompt already ends with [/INST] */
}

/* Falcon (falcon-7b-instruct): "System: ", "User: ", "Falcon: " lines; the template has no
   end-of-turn, so a trained answer ends with the tokenizer's EOS. */
static int lg_chat_falcon(const lg_chat *c, int gen, const char *eos, lg_chat_rendered *r) {
    static const char *const roles[] = {"System: ", "User: ", "Falcon: "};
    int rc = 0;
    for (int k = 0; k < c->n; k++) {
        if (k) rc |= lg_chat_put(r, "\n");
        rc |= lg_chat_put(r, roles[c->turns[k].role]);
        if (c->turns[k].role == LG_ROLE_ASSISTANT)
            rc |= lg_chat_answer(r, c->turns[k].content, eos, 0);
        else rc |= lg_chat_put(r, c->turns[k].content);
    }
    if (gen) rc |= lg_chat_put(r, "\nFalcon:");
    return rc;
}

/* Alpaca (one user turn, an optional system prompt refused) and plain ("USER=ANSWER\n" a
   turn, the built-in task's form): the tokenizer's BOS first when it has its own. */
static int lg_chat_single(const lg_chat *c, int gen, int alpaca, const char *bos,
                          const char *eos, lg_chat_rendered *r, lg_error *err) {
    int rc = lg_chat_put(r, bos);
    for (int k = 0; k < c->n; k++) {
        lg_chat_role role = c->turns[k].role;
        if (role == LG_ROLE_SYSTEM || (alpaca && k >= 2) ||
            (role == LG_ROLE_USER) != (k % 2 == 0))
            return lg_fail(err, "turn %d: the %s template takes user and assistant turns in turn%s",
                           k, alpaca ? "alpaca" : "plain", alpaca ? ", one of each" : "");
        if (role == LG_ROLE_ASSISTANT) {
            rc |= lg_chat_answer(r, c->turns[k].content, alpaca ? eos : "\n", 0);
            continue;
        }
        if (alpaca) {
            lg_alpaca_sample s = {c->turns[k].content, (char *)"", NULL};
            rc |= lg_alpaca_prompt(&s, &r->text);
        } else rc |= lg_chat_put(r, c->turns[k].content) | lg_chat_put(r, "=");
    }
    (void)gen; /* the prompt already ends where the answer starts */
    return rc;
}

/* The 1 when the qwen3 template's last answer is read two ways: its lstrip('\n') strips
   newlines in Python and all whitespace in @huggingface/jinja, so after its newlines it may
   not start with other whitespace. */
static int lg_chat_qwen3_ambiguous(const char *content) {
    int size;
    while (*content == '\n') content++;
    return *content && lg_chat_space(content, strlen(content), 0, &size) != 0;
}

/* What a template cannot render exactly, refused naming the turn: a content the template
   trims that ends in whitespace Python and JavaScript strip differently; for qwen3 a turn
   holding <think> or </think> (the template moves it) or <tool_response> (it moves the last
   query), and a last answer whose lstrip is read two ways; for llama2 an empty system prompt
   (system_message != false: true in Python, false in @huggingface/jinja). */
static int lg_chat_check_exact(lg_chat_template t, const lg_chat *c, lg_error *err) {
    int trims = t == LG_TEMPLATE_LLAMA3 || t == LG_TEMPLATE_LLAMA2;
    for (int k = 0; k < c->n; k++) {
        const char *s = c->turns[k].content;
        size_t a, b;
        if (trims && lg_chat_trim_range(s, &a, &b) == 2)
            return lg_fail(err, "turn %d: the %s template strips its content, and the whitespace "
                                "it ends in (U+001C-001F, U+0085 or U+FEFF) is stripped by Python "
                                "and JavaScript differently", k, lg_chat_template_name(t));
        if (t == LG_TEMPLATE_LLAMA2 && k == 0 && c->turns[0].role == LG_ROLE_SYSTEM && !s[0])
            return lg_fail(err, "turn 0: an empty system prompt, which Meta's llama2 template "
                                "writes as an empty <<SYS>> block in Python and leaves out in "
                                "JavaScript; drop it or give it text");
        if (t != LG_TEMPLATE_QWEN3) continue;
        if (strstr(s, "<think>") || strstr(s, "</think>") || strstr(s, "<tool_response>"))
            return lg_fail(err, "turn %d: holds <think>, </think> or <tool_response>, which the "
                                "qwen3 template moves; not rendered here", k);
        if (k == c->n - 1 && c->turns[k].role == LG_ROLE_ASSISTANT && lg_chat_qwen3_ambiguous(s))
            return lg_fail(err, "turn %d: the qwen3 template's lstrip('\\n') of the last answer strips "
                                "newlines in Python but all whitespace in JavaScript: start it with "
                                "neither space nor tab", k);
    }
    return 0;
}

int lg_chat_render(lg_chat_template t, const lg_chat *chat, const lg_tokenizer *tok,
                   int generation_prompt, lg_chat_rendered *out, lg_error *err) {
    if (lg_chat_check_exact(t, chat, err) != 0) return -1;
    char bos[128], eos[128];
    lg_chat_special(tok, tok ? lg_tokenizer_start_id(tok) : -1, bos, sizeof bos);
    lg_chat_special(tok, tok ? tok->eos : -1, eos, sizeof eos);
    out->text.n = 0;
    out->n_spans = 0;
    int rc = lg_text_append(&out->text, "", 0);
    switch (t) {
    case LG_TEMPLATE_LLAMA3: rc |= lg_chat_llama3(chat, generation_prompt, out); break;
    case LG_TEMPLATE_CHATML: rc |= lg_chat_chatml(chat, generation_prompt, 0, out); break;
    case LG_TEMPLATE_QWEN3: rc |= lg_chat_chatml(chat, generation_prompt, 1, out); break;
    case LG_TEMPLATE_LLAMA2: rc |= lg_chat_llama2(chat, bos, eos, out, err); break;
    case LG_TEMPLATE_FALCON: rc |= lg_chat_falcon(chat, generation_prompt, eos, out); break;
    case LG_TEMPLATE_ALPACA: case LG_TEMPLATE_PLAIN:
        rc |= lg_chat_single(chat, generation_prompt, t == LG_TEMPLATE_ALPACA, bos, eos, out, err);
        break;
    default: return lg_fail(err, "chat template %d: unknown", (int)t);
    }
    return rc ? -1 : 0;
}

/* The chat_template strings of tokenizer_config.json that a template here renders exactly
   (checked against @huggingface/jinja by tests/make_chat_reference.mjs), by their lg_hash64. */
static const struct { uint64_t hash; lg_chat_template t; const char *model; } lg_chat_known[] = {
    {0x0e60067a5537498eull, LG_TEMPLATE_LLAMA3, "Llama 3.1"},
    {0x2bfdb7aa9754484eull, LG_TEMPLATE_QWEN3, "Qwen3"},
};

/* The template of a tokenizer: by its tokenizer_config.json's chat_template when it has one
   (refused, naming it, when no template here renders it exactly), else by the tokenizer's
   family (Llama 3, Qwen2 -> chatml, SentencePiece -> llama2); -1 when neither. */
static int lg_chat_template_auto(const lg_tokenizer *tok, lg_chat_template *out, lg_error *err) {
    char path[LG_PATH_MAX];
    size_t n = strlen(tok->path), len;
    int file = n > 5 && !strcmp(tok->path + n - 5, ".json");
    const char *slash = strrchr(tok->path, '/');
    if (file) snprintf(path, sizeof path, "%.*stokenizer_config.json",
                       slash ? (int)(slash - tok->path + 1) : 0, tok->path);
    else snprintf(path, sizeof path, "%s/tokenizer_config.json", tok->path);
    char *text = lg_read_file(path, &len, "tokenizer", NULL), *chat = NULL;
    lg_json doc;
    if (text && lg_json_parse(&doc, text, len, path, NULL) == 0) {
        chat = lg_json_string(&doc, lg_json_find(&doc, 0, "chat_template"), &len);
        lg_json_free(&doc);
    }
    LG_FREE(text);
    if (chat) {
        uint64_t hash = lg_hash64(LG_HASH64_INIT, chat, len);
        for (size_t k = 0; k < sizeof lg_chat_known / sizeof lg_chat_known[0]; k++)
            if (lg_chat_known[k].hash == hash) { *out = lg_chat_known[k].t; LG_FREE(chat); return 0; }
        lg_fail(err, "`template auto`: %s's chat_template (hash %016llx, \"%.40s...\") is none "
                     "that a template here renders exactly; name one with `template`", path,
                (unsigned long long)hash, chat);
        LG_FREE(chat);
        return -1;
    }
    /* no chat_template: the family of the tokenizer */
    if (tok->pretokenizer == LG_PRETOKENIZE_LLAMA3) *out = LG_TEMPLATE_LLAMA3;
    else if (tok->pretokenizer == LG_PRETOKENIZE_QWEN2) *out = LG_TEMPLATE_CHATML;
    else if (tok->sentencepiece) *out = LG_TEMPLATE_LLAMA2;
    else return lg_fail(err, "`template auto`: tokenizer %s has no chat_template and no family "
                             "with a template; name one with `template`", tok->path);
    return 0;
}

/* The markers each template writes, which must be special tokens of the tokenizer (NULL ends;
   alpaca, plain and falcon write none: their end of turn is the tokenizer's own EOS). */
static const char *const *lg_chat_markers(lg_chat_template t) {
    static const char *const llama3[] = {"<|begin_of_text|>", "<|start_header_id|>",
                                         "<|end_header_id|>", "<|eot_id|>", NULL};
    static const char *const chatml[] = {"<|im_start|>", "<|im_end|>", NULL};
    static const char *const qwen3[] = {"<|im_start|>", "<|im_end|>", "<think>", "</think>", NULL};
    static const char *const llama2[] = {"<s>", "</s>", NULL};
    static const char *const none[] = {NULL};
    switch (t) {
    case LG_TEMPLATE_LLAMA3: return llama3;
    case LG_TEMPLATE_CHATML: return chatml;
    case LG_TEMPLATE_QWEN3: return qwen3;
    case LG_TEMPLATE_LLAMA2: return llama2;
    default: return none;
    }
}

/* 1 when text is exactly one of tok's special (added) tokens. */
static int lg_tokenizer_is_special(const lg_tokenizer *tok, const char *text) {
    int id = lg_tokenizer_find(tok, text, strlen(text));
    for (int s = 0; id >= 0 && s < tok->n_special; s++)
        if (tok->special[s] == id) return 1;
    return 0;
}

int lg_chat_template_pick(const char *name, const lg_tokenizer *tok, lg_chat_template *out,
                          lg_error *err) {
    int rc = !strcmp(name, "auto") ? lg_chat_template_auto(tok, out, err)
                                   : lg_chat_template_find(name, out, err);
    if (rc != 0) return -1;
    char missing[256] = "";
    int n_missing = 0;
    for (const char *const *m = lg_chat_markers(*out); *m; m++)
        if (!lg_tokenizer_is_special(tok, *m))
            lg_format(missing + strlen(missing), sizeof missing - strlen(missing), "%s%s",
                      n_missing++ ? ", " : "", *m);
    if (n_missing)
        return lg_fail(err, "template %s: marker%s %s %s of tokenizer %s (%s be written as "
                            "ordinary text pieces); name a template of this tokenizer with "
                            "`template`", lg_chat_template_name(*out), n_missing > 1 ? "s" : "",
                       missing, n_missing > 1 ? "are not special tokens" : "is not a special token",
                       tok->path, n_missing > 1 ? "they would" : "it would");
    return 0;
}

void lg_chat_rendered_free(lg_chat_rendered *r) {
    lg_text_free(&r->text);
    LG_FREE(r->span);
    memset(r, 0, sizeof *r);
}

int lg_chat_tokenize(const lg_tokenizer *tok, const lg_chat_rendered *r, lg_tokens *ids,
                     lg_tokens *trained, const char *where, lg_error *err) {
    size_t start = ids->n;
    if (lg_tokenizer_encode(tok, r->text.bytes, r->text.n, ids, err) != 0) return -1;
    lg_tokens pieces = {NULL, 0, 0};
    int rc = 0;
    for (int s = 0; s <= 2 * r->n_spans && rc == 0; s++) { /* spans and the gaps */
        size_t from = s ? r->span[s - 1] : 0, to = s < 2 * r->n_spans ? r->span[s] : r->text.n;
        size_t before = pieces.n;
        int continued = from > 0 && !lg_special_ends_at(tok, r->text.bytes, from);
        rc = lg_tokenizer_encode_part(tok, r->text.bytes + from, to - from, continued, &pieces, err);
        for (size_t i = before; rc == 0 && i < pieces.n; i++)
            if (lg_tokens_push(trained, s % 2) != 0) rc = lg_fail(err, "%s: out of host memory", where);
    }
    if (rc == 0 && (pieces.n != ids->n - start ||
                    memcmp(pieces.ids, ids->ids + start, sizeof(int) * pieces.n) != 0))
        rc = lg_fail(err, "%s: an assistant turn's edge falls inside a token (its text "
                          "tokenized alone differs from the whole conversation's)", where);
    lg_tokens_free(&pieces);
    return rc;
}

/* 13. model files ----------------------------------------------------------------------------- */

/* Files that hold a model: atomic writes, safetensors, the Hugging Face layouts of each family
   (tensor names, config.json), step-N directories with a COMPLETE marker of checksums, and
   LoRA's PEFT adapter files. Nothing here knows the trainer; section 15 builds on these. */


/* --- atomic files ----------------------------------------------------------------------------- */

/* A file being written under a temporary name; committed by a rename. */
typedef struct {
    char path[1024];      /* the final name */
    char tmp[LG_PATH_MAX];       /* path.tmp */
    int fd;
    lg_file_digest digest; /* of the bytes written so far */
} lg_atomic_file;

static int lg_atomic_open(lg_atomic_file *a, const char *path, lg_error *err) {
    memset(a, 0, sizeof *a);
    lg_format(a->path, sizeof a->path, "%s", path);
    lg_format(a->tmp, sizeof a->tmp, "%s.tmp", path);
    a->digest.hash = LG_HASH64_INIT;
    a->fd = open(a->tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (a->fd < 0) return lg_fail(err, "checkpoint %s: cannot create: %s", a->tmp, strerror(errno));
    return 0;
}

static int lg_atomic_write(lg_atomic_file *a, const void *buf, size_t bytes, lg_error *err) {
    const char *p = (const char *)buf;
    a->digest.hash = lg_hash64(a->digest.hash, buf, bytes);
    a->digest.bytes += bytes;
    while (bytes > 0) {
        ssize_t n = write(a->fd, p, bytes);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return lg_fail(err, "checkpoint %s: write failed: %s", a->tmp, strerror(errno));
        p += n;
        bytes -= (size_t)n;
    }
    return 0;
}

static void lg_atomic_abort(lg_atomic_file *a) {
    if (a->fd >= 0) close(a->fd);
    a->fd = -1;
    remove(a->tmp);
}

/* Syncs the directory holding path, so a rename inside it survives a crash. */
static int lg_sync_parent(const char *path) {
    char dir[1024];
    lg_format(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = '\0';
    else lg_format(dir, sizeof dir, ".");
    int fd = open(dir, O_RDONLY);
    if (fd < 0) return -1;
    int rc = fsync(fd);
    close(fd);
    return rc;
}

/* fsync, close, rename over the final name, sync the directory. */
static int lg_atomic_commit(lg_atomic_file *a, lg_file_digest *digest, lg_error *err) {
    int ok = fsync(a->fd) == 0;
    if (close(a->fd) != 0) ok = 0;
    a->fd = -1;
    if (!ok || rename(a->tmp, a->path) != 0) {
        int saved = errno;
        remove(a->tmp);
        return lg_fail(err, "checkpoint %s: write failed: %s", a->path, strerror(saved));
    }
    lg_sync_parent(a->path);
    if (digest) *digest = a->digest;
    return 0;
}

static int lg_write_text_file(const char *path, const char *text, lg_file_digest *digest,
                              lg_error *err) {
    lg_atomic_file a;
    if (lg_atomic_open(&a, path, err) != 0) return -1;
    if (lg_atomic_write(&a, text, strlen(text), err) != 0) { lg_atomic_abort(&a); return -1; }
    return lg_atomic_commit(&a, digest, err);
}

/* The whole of a small file (config.json, COMPLETE) as a NUL-terminated string. */
static char *lg_read_text_file(const char *path, size_t max_bytes, size_t *length, lg_error *err) {
    struct stat st; /* a FIFO or device would block or never end */
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) {
        lg_fail(err, "%s: not a regular file", path);
        return NULL;
    }
    FILE *f = fopen(path, "rb");
    if (!f) { lg_fail(err, "%s: cannot open: %s", path, strerror(errno)); return NULL; }
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    if (size < 0 || (size_t)size > max_bytes) {
        fclose(f);
        lg_fail(err, "%s: %ld bytes, more than the %zu expected of this file", path, size, max_bytes);
        return NULL;
    }
    char *text = (char *)LG_MALLOC((size_t)size + 1);
    if (!text || fread(text, 1, (size_t)size, f) != (size_t)size) {
        fclose(f);
        LG_FREE(text);
        lg_fail(err, "%s: read failed", path);
        return NULL;
    }
    fclose(f);
    text[size] = '\0';
    if (length) *length = (size_t)size;
    return text;
}

/* --- safetensors ---------------------------------------------------------------------------- */

static const char *const lg_st_dtype_names[] = {"F32", "BF16", "F16", "U8", "I64"};

static size_t lg_st_dtype_size(lg_st_dtype d) {
    return d == LG_ST_F32 ? 4 : d == LG_ST_U8 ? 1 : d == LG_ST_I64 ? 8 : 2;
}

const char *lg_st_dtype_name(lg_st_dtype d) { return lg_st_dtype_names[d]; }

uint64_t lg_st_count(const lg_st_tensor *t) {
    uint64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= (uint64_t)t->shape[d];
    return n;
}

void lg_st_close(lg_st_file *f) {
    if (f->file) fclose(f->file);
    LG_FREE(f->tensors);
    LG_FREE(f->meta);
    memset(f, 0, sizeof *f);
}

/* Fails, closing the half-open file. */
static int lg_st_reject(lg_st_file *f, lg_error *err, const char *fmt, ...) {
    char what[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    lg_fail(err, "safetensors %s: %s", f->path, what);
    lg_st_close(f);
    return -1;
}

/* A non-negative integer node (digits only) up to limit. */
static int lg_st_json_size(const lg_json *j, int node, uint64_t limit, uint64_t *out) {
    long v;
    if (node < 0 || lg_json_int(j, node, &v) != 0 || j->text[j->nodes[node].start] == '-' ||
        (uint64_t)v > limit)
        return -1;
    *out = (uint64_t)v;
    return 0;
}

/* The __metadata__ object: string keys to string values. */
static int lg_st_parse_meta(lg_st_file *f, const lg_json *j, int obj, lg_error *err) {
    if (j->nodes[obj].kind != LG_JSON_OBJECT) return lg_st_reject(f, err, "__metadata__ is not an object");
    f->meta = (lg_st_meta *)lg_alloc_zeroed(sizeof(lg_st_meta) * (size_t)(lg_json_count(j, obj) + 1));
    if (!f->meta) return lg_st_reject(f, err, "out of host memory");
    for (int k = j->nodes[obj].first_child; k >= 0; k = j->nodes[j->nodes[k].next].next) {
        lg_st_meta *m = &f->meta[f->n_meta];
        if (lg_json_string_copy(j, k, m->key, sizeof m->key) != 0 ||
            lg_json_string_copy(j, j->nodes[k].next, m->value, sizeof m->value) != 0)
            continue; /* long or non-string entries (e.g. other tools' notes) are not ours */
        f->n_meta++;
    }
    return 0;
}

/* One tensor entry {"dtype": ..., "shape": [...], "data_offsets": [b, e]}; key is its name. */
static int lg_st_parse_tensor(lg_st_file *f, const lg_json *j, int key, lg_st_tensor *t,
                              uint64_t data_bytes, lg_error *err) {
    if (lg_json_string_copy(j, key, t->name, sizeof t->name) != 0)
        return lg_st_reject(f, err, "a tensor name longer than %d characters or holding a NUL",
                            LG_ST_MAX_NAME - 1);
    int obj = j->nodes[key].next, dtype = lg_json_find(j, obj, "dtype"), shape = lg_json_find(j, obj, "shape");
    int offsets = lg_json_find(j, obj, "data_offsets");
    char name[16] = "";
    if (dtype < 0 || shape < 0 || offsets < 0)
        return lg_st_reject(f, err, "tensor %s: needs dtype, shape and data_offsets", t->name);
    lg_json_string_copy(j, dtype, name, sizeof name);
    int known = 0;
    for (int d = 0; d < 5; d++)
        if (strcmp(name, lg_st_dtype_names[d]) == 0) { t->dtype = (lg_st_dtype)d; known = 1; }
    if (!known) return lg_st_reject(f, err, "tensor %s: dtype '%s' is not F32, BF16, F16, U8 or I64", t->name, name);
    if (j->nodes[shape].kind != LG_JSON_ARRAY || lg_json_count(j, shape) > LG_ST_MAX_DIMS)
        return lg_st_reject(f, err, "tensor %s: shape is not a list of at most %d sizes", t->name, LG_ST_MAX_DIMS);
    t->ndim = lg_json_count(j, shape);
    uint64_t count = 1, dim;
    int e = j->nodes[shape].first_child;
    for (int d = 0; d < t->ndim; d++, e = j->nodes[e].next) {
        if (lg_st_json_size(j, e, (uint64_t)1 << 40, &dim) != 0)
            return lg_st_reject(f, err, "tensor %s: dimension %d is not a size", t->name, d);
        t->shape[d] = (int64_t)dim;
        if (dim && count > ((uint64_t)1 << 50) / dim) return lg_st_reject(f, err, "tensor %s: too large", t->name);
        count *= dim;
    }
    int begin = j->nodes[offsets].first_child, end = begin >= 0 ? j->nodes[begin].next : -1;
    if (j->nodes[offsets].kind != LG_JSON_ARRAY || lg_json_count(j, offsets) != 2 ||
        lg_st_json_size(j, begin, data_bytes, &t->begin) != 0 ||
        lg_st_json_size(j, end, data_bytes, &t->end) != 0)
        return lg_st_reject(f, err, "tensor %s: data_offsets are not two offsets within the %llu "
                            "bytes of data (truncated file?)", t->name, (unsigned long long)data_bytes);
    if (t->end < t->begin || t->end - t->begin != count * lg_st_dtype_size(t->dtype))
        return lg_st_reject(f, err, "tensor %s: data_offsets [%llu, %llu] do not hold %llu %s values",
                            t->name, (unsigned long long)t->begin, (unsigned long long)t->end,
                            (unsigned long long)count, name);
    return 0;
}

static int lg_st_by_begin(const void *a, const void *b) {
    const lg_st_tensor *x = *(const lg_st_tensor *const *)a, *y = *(const lg_st_tensor *const *)b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : x->end < y->end ? -1 : x->end > y->end;
}

static int lg_st_by_name(const void *a, const void *b) {
    return strcmp((*(const lg_st_tensor *const *)a)->name, (*(const lg_st_tensor *const *)b)->name);
}

/* The tensors' byte ranges must tile the data section: no overlap, no gap, nothing after; and
   no name twice. */
static int lg_st_check_tiling(lg_st_file *f, uint64_t data_bytes, lg_error *err) {
    int n = f->n_tensors;
    const lg_st_tensor **order = (const lg_st_tensor **)lg_alloc_zeroed(sizeof(lg_st_tensor *) * (size_t)(n + 1));
    if (!order) return lg_st_reject(f, err, "out of host memory");
    for (int i = 0; i < n; i++) order[i] = &f->tensors[i];
    qsort(order, (size_t)n, sizeof *order, lg_st_by_begin);
    uint64_t at = 0;
    char what[300] = "";
    for (int i = 0; i < n && !what[0]; i++) {
        if (order[i]->begin != at)
            lg_format(what, sizeof what, "tensor %s starts at byte %llu of the data, expected %llu "
                      "(overlap or gap)", order[i]->name, (unsigned long long)order[i]->begin,
                      (unsigned long long)at);
        at = order[i]->end;
    }
    qsort(order, (size_t)n, sizeof *order, lg_st_by_name);
    for (int i = 1; i < n && !what[0]; i++)
        if (strcmp(order[i - 1]->name, order[i]->name) == 0)
            lg_format(what, sizeof what, "tensor %s appears twice", order[i]->name);
    LG_FREE(order);
    if (what[0]) return lg_st_reject(f, err, "%s", what);
    if (at != data_bytes)
        return lg_st_reject(f, err, "the tensors end at byte %llu of the data but the file holds "
                            "%llu (truncated or trailing bytes)", (unsigned long long)at,
                            (unsigned long long)data_bytes);
    return 0;
}

/* The header: a JSON object of tensor entries and an optional __metadata__. */
static int lg_st_parse_header(lg_st_file *f, const char *header, size_t len, lg_error *err) {
    lg_json j;
    lg_error why;
    if (lg_json_parse(&j, header, len, "header", &why) != 0)
        return lg_st_reject(f, err, "the header is not valid JSON (%s)", why.msg);
    if (j.nodes[0].kind != LG_JSON_OBJECT) {
        lg_json_free(&j);
        return lg_st_reject(f, err, "the header is not a JSON object");
    }
    uint64_t data_bytes = f->file_bytes - f->data_start;
    f->tensors = (lg_st_tensor *)lg_alloc_zeroed(sizeof(lg_st_tensor) * (size_t)(lg_json_count(&j, 0) + 1));
    if (!f->tensors) { lg_json_free(&j); return lg_st_reject(f, err, "out of host memory"); }
    int rc = 0, i = 0;
    for (int k = j.nodes[0].first_child; k >= 0 && rc == 0; k = j.nodes[j.nodes[k].next].next, i++) {
        int value = j.nodes[k].next;
        char name[LG_ST_MAX_NAME];
        if (lg_json_string_copy(&j, k, name, sizeof name) == 0 && strcmp(name, "__metadata__") == 0)
            rc = lg_st_parse_meta(f, &j, value, err);
        else if (j.nodes[value].kind != LG_JSON_OBJECT)
            rc = lg_st_reject(f, err, "entry %d of the header is not an object", i);
        else if ((rc = lg_st_parse_tensor(f, &j, k, &f->tensors[f->n_tensors], data_bytes, err)) == 0)
            f->n_tensors++;
    }
    lg_json_free(&j);
    if (rc != 0) return -1;
    return lg_st_check_tiling(f, data_bytes, err);
}

int lg_st_open(lg_st_file *f, const char *path, lg_error *err) {
    memset(f, 0, sizeof *f);
    lg_format(f->path, sizeof f->path, "%s", path);
    struct stat st;
    if (stat(path, &st) != 0) return lg_fail(err, "safetensors %s: cannot open: %s", path, strerror(errno));
    if (!S_ISREG(st.st_mode)) return lg_fail(err, "safetensors %s: not a regular file", path);
    f->file = fopen(path, "rb");
    if (!f->file) return lg_fail(err, "safetensors %s: cannot open: %s", path, strerror(errno));
    f->file_bytes = (uint64_t)st.st_size;
    unsigned char len_le[8];
    if (f->file_bytes < 8 || fread(len_le, 1, 8, f->file) != 8)
        return lg_st_reject(f, err, "%llu bytes, shorter than the 8-byte header length",
                            (unsigned long long)f->file_bytes);
    uint64_t len = 0;
    for (int i = 0; i < 8; i++) len |= (uint64_t)len_le[i] << (8 * i);
    if (len < 2 || len > LG_ST_MAX_HEADER || len > f->file_bytes - 8)
        return lg_st_reject(f, err, "header length %llu does not fit the file's %llu bytes "
                            "(truncated or not safetensors)", (unsigned long long)len,
                            (unsigned long long)f->file_bytes);
    f->data_start = 8 + len;
    char *header = (char *)LG_MALLOC((size_t)len);
    if (!header) return lg_st_reject(f, err, "out of host memory for a %llu-byte header", (unsigned long long)len);
    if (fread(header, 1, (size_t)len, f->file) != (size_t)len) {
        LG_FREE(header);
        return lg_st_reject(f, err, "cannot read the header");
    }
    if (header[0] != '{') {
        LG_FREE(header);
        return lg_st_reject(f, err, "the header does not start with '{'");
    }
    int rc = lg_st_parse_header(f, header, (size_t)len, err);
    LG_FREE(header);
    return rc;
}

const lg_st_tensor *lg_st_find(const lg_st_file *f, const char *name) {
    for (int i = 0; i < f->n_tensors; i++)
        if (strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
    return NULL;
}

const char *lg_st_meta_get(const lg_st_file *f, const char *key) {
    for (int i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta[i].key, key) == 0) return f->meta[i].value;
    return NULL;
}

/* The dtypes a tensor of weights or adapters may have: lg_st_get reads each as a number. */
static int lg_st_is_float(lg_st_dtype dtype) {
    return dtype == LG_ST_F32 || dtype == LG_ST_BF16 || dtype == LG_ST_F16;
}

int lg_st_read(const lg_st_file *f, const lg_st_tensor *t, void *out, lg_error *err) {
    size_t bytes = (size_t)(t->end - t->begin);
    if (fseek(f->file, (long)(f->data_start + t->begin), SEEK_SET) != 0 ||
        fread(out, 1, bytes, f->file) != bytes)
        return lg_fail(err, "safetensors %s: cannot read tensor %s", f->path, t->name);
    return 0;
}

/* Appends text to a growing header; -1 when it does not fit. */
static int lg_st_append(char *buf, size_t cap, size_t *n, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(buf + *n, cap - *n, fmt, ap);
    va_end(ap);
    if (w < 0 || (size_t)w >= cap - *n) return -1;
    *n += (size_t)w;
    return 0;
}

/* The JSON header of tensors whose offsets are assigned; padded with spaces to 8 bytes. */
static char *lg_st_header(lg_st_tensor *tensors, int n, const lg_st_meta *meta, int n_meta,
                          size_t *len) {
    size_t cap = (size_t)n * (LG_ST_MAX_NAME + 160) + (size_t)n_meta * 220 + 64, at = 0;
    char *h = (char *)LG_MALLOC(cap);
    if (!h) return NULL;
    int ok = lg_st_append(h, cap, &at, "{\"__metadata__\":{") == 0;
    for (int i = 0; i < n_meta && ok; i++)
        ok = lg_st_append(h, cap, &at, "%s\"%s\":\"%s\"", i ? "," : "", meta[i].key, meta[i].value) == 0;
    ok = ok && lg_st_append(h, cap, &at, "}") == 0;
    uint64_t offset = 0;
    for (int i = 0; i < n && ok; i++) {
        lg_st_tensor *t = &tensors[i];
        t->begin = offset;
        t->end = offset += lg_st_count(t) * lg_st_dtype_size(t->dtype);
        ok = lg_st_append(h, cap, &at, ",\"%s\":{\"dtype\":\"%s\",\"shape\":[", t->name,
                       lg_st_dtype_names[t->dtype]) == 0;
        for (int d = 0; d < t->ndim && ok; d++)
            ok = lg_st_append(h, cap, &at, "%s%lld", d ? "," : "", (long long)t->shape[d]) == 0;
        ok = ok && lg_st_append(h, cap, &at, "],\"data_offsets\":[%llu,%llu]}",
                             (unsigned long long)t->begin, (unsigned long long)t->end) == 0;
    }
    ok = ok && lg_st_append(h, cap, &at, "}") == 0;
    while (ok && at % 8 != 0) ok = lg_st_append(h, cap, &at, " ") == 0;
    if (!ok) { LG_FREE(h); return NULL; }
    *len = at;
    return h;
}

int lg_st_write(const char *path, lg_st_tensor *tensors, int n, const lg_st_meta *meta,
                int n_meta, lg_st_fill_fn fill, void *ctx, lg_file_digest *digest,
                lg_error *err) {
    size_t len = 0, largest = 1;
    char *header = lg_st_header(tensors, n, meta, n_meta, &len);
    if (!header) return lg_fail(err, "safetensors %s: out of host memory for the header", path);
    for (int i = 0; i < n; i++)
        if (tensors[i].end - tensors[i].begin > largest) largest = (size_t)(tensors[i].end - tensors[i].begin);
    unsigned char *buf = (unsigned char *)LG_MALLOC(largest);
    lg_atomic_file a;
    if (!buf || lg_atomic_open(&a, path, err) != 0) {
        LG_FREE(header);
        LG_FREE(buf);
        return buf ? -1 : lg_fail(err, "safetensors %s: out of host memory", path);
    }
    unsigned char len_le[8];
    for (int i = 0; i < 8; i++) len_le[i] = (unsigned char)((uint64_t)len >> (8 * i));
    int rc = lg_atomic_write(&a, len_le, 8, err);
    if (rc == 0) rc = lg_atomic_write(&a, header, len, err);
    for (int i = 0; i < n && rc == 0; i++) {
        rc = fill(ctx, i, buf, err);
        if (rc == 0) rc = lg_atomic_write(&a, buf, (size_t)(tensors[i].end - tensors[i].begin), err);
    }
    LG_FREE(header);
    LG_FREE(buf);
    if (rc != 0) { lg_atomic_abort(&a); return -1; }
    return lg_atomic_commit(&a, digest, err);
}

/* One element of file data as lg_real (F32, BF16 or F16). */
static lg_real lg_st_get(lg_st_dtype dtype, const unsigned char *data, size_t i) {
    if (dtype == LG_ST_F32) {
        float v;
        memcpy(&v, data + 4 * i, 4);
        return (lg_real)v;
    }
    uint16_t h = (uint16_t)(data[2 * i] | data[2 * i + 1] << 8);
    return dtype == LG_ST_BF16 ? (lg_real)lg_bf16_to_f32(h) : (lg_real)lg_f16_to_f32(h);
}

static void lg_st_set(lg_st_dtype dtype, unsigned char *data, size_t i, lg_real v) {
    if (dtype == LG_ST_F32) {
        float f = (float)v;
        memcpy(data + 4 * i, &f, 4);
        return;
    }
    uint16_t h = dtype == LG_ST_BF16 ? lg_f32_to_bf16((float)v) : lg_f32_to_f16((float)v);
    data[2 * i] = (unsigned char)h;
    data[2 * i + 1] = (unsigned char)(h >> 8);
}

/* --- Hugging Face layouts --------------------------------------------------------------------- */

int lg_hf_family_of(const lg_config *c, lg_hf_family *family, lg_error *err) {
    const char *why = NULL;
    int mha = c->n_query_groups == c->n_head && c->n_head * c->head_size == c->n_embd;
    if (c->lm_head_bias) why = "lm_head_bias";
    else if (c->learned_pos_embedding) {
        *family = LG_HF_GPT2;
        if (c->norm_class_name != LG_NORM_LAYERNORM || c->mlp_class_name != LG_MLP_GPTNEOX ||
            c->rotary_percentage != 0.0f || c->parallel_residual || !c->bias || !mha)
            why = "learned position embeddings without GPT-2's other settings";
    } else if (c->mlp_class_name == LG_MLP_LLAMA) {
        *family = c->attn_bias && !c->bias ? LG_HF_QWEN2 : LG_HF_LLAMA;
        if (c->norm_class_name != LG_NORM_RMSNORM || c->rotary_percentage != 1.0f ||
            c->parallel_residual)
            why = "LLaMAMLP without RMSNorm, full rotary and sequential residuals";
    } else if (c->shared_attention_norm) { /* Falcon-7B's layout: multi-query, no linear biases */
        *family = LG_HF_FALCON;
        if (c->norm_class_name != LG_NORM_LAYERNORM || c->rotary_percentage != 1.0f ||
            c->bias || c->attn_bias || c->n_query_groups != 1 ||
            c->n_head * c->head_size != c->n_embd)
            why = "shared_attention_norm without Falcon-7B's LayerNorm, full rotary, multi-query "
                  "attention (n_query_groups 1) and no linear biases";
    } else {
        *family = LG_HF_GPTNEOX;
        if (c->norm_class_name != LG_NORM_LAYERNORM || !c->bias || !mha || c->shared_attention_norm)
            why = "GptNeoxMLP without GPT-NeoX's LayerNorm, biases, multi-head attention and two norms";
    }
    if (!why && c->rope_adjustments.factor != 0.0f && *family != LG_HF_LLAMA &&
        *family != LG_HF_QWEN2)
        why = "rope_adjustments outside the Llama and Qwen2 layouts";
    if (why) return lg_fail(err, "config %s: no Hugging Face layout holds this architecture (%s)", c->name, why);
    return 0;
}

/* The column of a family in the name tables below. */
static int lg_hf_column(lg_hf_family f) {
    return f == LG_HF_GPT2 ? 1 : f == LG_HF_GPTNEOX ? 2 : f == LG_HF_FALCON ? 4 : 3;
}

/* How a Hugging Face tensor's element i comes from its LitGPT tensor. */
typedef enum {
    LG_HF_COPY,      /* element start + i (q, k or v rows of the fused qkv: a contiguous range;
                        Falcon's multi-query query_key_value: our order, all q heads, k, v) */
    LG_HF_TRANSPOSE, /* GPT-2's Conv1D stores (in, out): the LitGPT (out, in) transposed */
    LG_HF_NEOX_QKV   /* GPT-NeoX's query_key_value: per head q, k, v rows; LitGPT: all q heads,
                        then all k, then all v */
} lg_hf_transform;

typedef struct {
    char name[LG_ST_MAX_NAME]; /* the Hugging Face name */
    int source;                /* the LitGPT tensor: index into the parameter table */
    lg_hf_transform how;
    size_t start;              /* LG_HF_COPY: first element of the source */
    int ndim;
    int64_t shape[2];          /* the Hugging Face shape */
} lg_hf_tensor;

/* The Hugging Face name of a LitGPT block tensor ("norm_1.weight") in layer l. */
static const char *lg_hf_block_name(lg_hf_family f, const char *suffix) {
    static const char *const map[][5] = { /* LitGPT, GPT-2, GPT-NeoX, Llama, Falcon */
        {"norm_1.weight", "ln_1.weight", "input_layernorm.weight", "input_layernorm.weight", "input_layernorm.weight"},
        {"norm_1.bias", "ln_1.bias", "input_layernorm.bias", NULL, "input_layernorm.bias"},
        {"norm_2.weight", "ln_2.weight", "post_attention_layernorm.weight", "post_attention_layernorm.weight", NULL},
        {"norm_2.bias", "ln_2.bias", "post_attention_layernorm.bias", NULL, NULL},
        {"attn.qkv.weight", "attn.c_attn.weight", "attention.query_key_value.weight", NULL, "self_attention.query_key_value.weight"},
        {"attn.qkv.bias", "attn.c_attn.bias", "attention.query_key_value.bias", NULL, NULL},
        {"attn.proj.weight", "attn.c_proj.weight", "attention.dense.weight", "self_attn.o_proj.weight", "self_attention.dense.weight"},
        {"attn.proj.bias", "attn.c_proj.bias", "attention.dense.bias", "self_attn.o_proj.bias", NULL},
        {"mlp.fc.weight", "mlp.c_fc.weight", "mlp.dense_h_to_4h.weight", NULL, "mlp.dense_h_to_4h.weight"},
        {"mlp.fc.bias", "mlp.c_fc.bias", "mlp.dense_h_to_4h.bias", NULL, NULL},
        {"mlp.proj.weight", "mlp.c_proj.weight", "mlp.dense_4h_to_h.weight", "mlp.down_proj.weight", "mlp.dense_4h_to_h.weight"},
        {"mlp.proj.bias", "mlp.c_proj.bias", "mlp.dense_4h_to_h.bias", "mlp.down_proj.bias", NULL},
        {"mlp.fc_1.weight", NULL, NULL, "mlp.gate_proj.weight", NULL},
        {"mlp.fc_1.bias", NULL, NULL, "mlp.gate_proj.bias", NULL},
        {"mlp.fc_2.weight", NULL, NULL, "mlp.up_proj.weight", NULL},
        {"mlp.fc_2.bias", NULL, NULL, "mlp.up_proj.bias", NULL},
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (strcmp(map[i][0], suffix) == 0) return map[i][lg_hf_column(f)];
    return NULL;
}

/* The Hugging Face name of a LitGPT tensor outside the blocks. */
static const char *lg_hf_top_name(lg_hf_family f, const char *name) {
    static const char *const map[][5] = {
        {"transformer.wte.weight", "transformer.wte.weight", "gpt_neox.embed_in.weight", "model.embed_tokens.weight", "transformer.word_embeddings.weight"},
        {"transformer.wpe.weight", "transformer.wpe.weight", NULL, NULL, NULL},
        {"transformer.ln_f.weight", "transformer.ln_f.weight", "gpt_neox.final_layer_norm.weight", "model.norm.weight", "transformer.ln_f.weight"},
        {"transformer.ln_f.bias", "transformer.ln_f.bias", "gpt_neox.final_layer_norm.bias", NULL, "transformer.ln_f.bias"},
        {"lm_head.weight", "lm_head.weight", "embed_out.weight", "lm_head.weight", "lm_head.weight"},
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (strcmp(map[i][0], name) == 0) return map[i][lg_hf_column(f)];
    return NULL;
}

static void lg_hf_add(lg_hf_tensor *out, int *n, const char *name, int source, lg_hf_transform how,
                      size_t start, int rows, int cols) {
    lg_hf_tensor *h = &out[(*n)++];
    lg_format(h->name, sizeof h->name, "%s", name);
    h->source = source;
    h->how = how;
    h->start = start;
    h->ndim = rows == 1 ? 1 : 2;
    h->shape[0] = rows == 1 ? cols : rows;
    h->shape[1] = rows == 1 ? 0 : cols;
}

/* Llama's q_proj, k_proj, v_proj: row ranges of the fused qkv (weight or bias). */
static void lg_hf_add_split_qkv(const lg_config *c, const lg_tensor_info *t, int source,
                                const char *prefix, lg_hf_tensor *out, int *n) {
    int HS = c->head_size, rows[3] = {c->n_head * HS, c->n_query_groups * HS, c->n_query_groups * HS};
    const char *part[3] = {"q_proj", "k_proj", "v_proj"};
    int is_bias = t->rows == 1, first = 0;
    for (int k = 0; k < 3; k++) {
        char name[LG_ST_MAX_NAME];
        lg_format(name, sizeof name, "%sself_attn.%s.%s", prefix, part[k], is_bias ? "bias" : "weight");
        lg_hf_add(out, n, name, source, LG_HF_COPY, (size_t)first * (is_bias ? 1 : (size_t)t->cols),
                  is_bias ? 1 : rows[k], is_bias ? rows[k] : t->cols);
        first += rows[k];
    }
}

/* The Hugging Face tensors of a config, each with its LitGPT source. *out: LG_MALLOC. */
static int lg_hf_tensors(const lg_config *c, const lg_tensor_table *table, lg_hf_family f,
                         lg_hf_tensor **out, int *n_out, lg_error *err) {
    lg_hf_tensor *hf = (lg_hf_tensor *)lg_alloc_zeroed(sizeof(lg_hf_tensor) * (size_t)(table->n_tensors * 3 + 1));
    if (!hf) return lg_fail(err, "out of host memory");
    const char *prefix_fmt = f == LG_HF_GPT2 || f == LG_HF_FALCON ? "transformer.h.%d."
                             : f == LG_HF_GPTNEOX                ? "gpt_neox.layers.%d."
                                                                 : "model.layers.%d.";
    int n = 0;
    for (int i = 0; i < table->n_tensors; i++) {
        const lg_tensor_info *t = &table->tensors[i];
        int layer, used = 0;
        char prefix[64], name[LG_ST_MAX_NAME];
        const char *hf_name;
        if (sscanf(t->name, "transformer.h.%d.%n", &layer, &used) == 1 && used > 0) {
            lg_format(prefix, sizeof prefix, prefix_fmt, layer);
            if ((f == LG_HF_LLAMA || f == LG_HF_QWEN2) && strncmp(t->name + used, "attn.qkv.", 9) == 0) {
                lg_hf_add_split_qkv(c, t, i, prefix, hf, &n);
                continue;
            }
            hf_name = lg_hf_block_name(f, t->name + used);
            lg_format(name, sizeof name, "%s%s", prefix, hf_name ? hf_name : "");
        } else {
            hf_name = lg_hf_top_name(f, t->name);
            lg_format(name, sizeof name, "%s", hf_name ? hf_name : "");
        }
        if (!hf_name) {
            LG_FREE(hf);
            return lg_fail(err, "config %s: %s has no Hugging Face name", c->name, t->name);
        }
        int conv1d = f == LG_HF_GPT2 && t->rows > 1 && strncmp(t->name, "transformer.h.", 14) == 0;
        int neox_qkv = f == LG_HF_GPTNEOX && strstr(t->name, ".attn.qkv.") != NULL;
        if (conv1d) lg_hf_add(hf, &n, name, i, LG_HF_TRANSPOSE, 0, t->cols, t->rows);
        else lg_hf_add(hf, &n, name, i, neox_qkv ? LG_HF_NEOX_QKV : LG_HF_COPY, 0, t->rows, t->cols);
    }
    *out = hf;
    *n_out = n;
    return 0;
}

/* Element i of a Hugging Face tensor: its index within the LitGPT source tensor. */
static size_t lg_hf_source_index(const lg_config *c, const lg_hf_tensor *h, size_t i) {
    if (h->how == LG_HF_COPY) return h->start + i;
    size_t cols = h->ndim == 2 ? (size_t)h->shape[1] : 1, row = i / cols, col = i % cols;
    if (h->how == LG_HF_TRANSPOSE) return col * (size_t)h->shape[0] + row;
    size_t HS = (size_t)c->head_size, NH = (size_t)c->n_head; /* LG_HF_NEOX_QKV */
    size_t head = row / (3 * HS), part = (row / HS) % 3, d = row % HS;
    return ((part * NH + head) * HS + d) * cols + col;
}

static const char *lg_hf_dtype_label(lg_st_dtype d) {
    return d == LG_ST_BF16 ? "bfloat16" : d == LG_ST_F16 ? "float16" : "float32";
}

/* config.json of each family: its keys in the file's order. The writer writes each as the value
   of a config field (lg_config_fields, named by its LitGPT key and written as its type says)
   or as a fixed JSON value; the reader reads each key that carries a field into it, as its type
   says, or takes `absent` where the file leaves the key out (lg_hf_read_keys). gelu_approximate
   is written as the family's activation: `fixed` names its tanh form, "gelu" the exact one.
   What the table cannot say (the family's constants, refusals of fixed values, keys that must
   agree) is its reader's (lg_hf_config_gpt2 ...). */
typedef struct {
    const char *key;    /* Hugging Face's */
    const char *field;  /* LitGPT's, or NULL */
    const char *fixed;  /* the JSON value without a field; the tanh activation's name with one */
    const char *absent; /* read where the file leaves the key out: the field's value as a config
                           YAML spells it (gelu_approximate: the activation's name), or one of
                           LG_HF_REQUIRED, LG_HF_DERIVED, LG_HF_UNREAD */
    const char *older;  /* the key's older name, read where the file has only that, or NULL */
} lg_hf_key;
#define LG_HF_REQUIRED NULL /* a file without it is refused naming the key */
#define LG_HF_DERIVED ""    /* from the fields read before it (lg_hf_derived) */
#define LG_HF_UNREAD "-"    /* written only: another key carries the field, or the reader checks it */

static const lg_hf_key lg_hf_gpt2_keys[] = {
    {"vocab_size", "padded_vocab_size", NULL, LG_HF_UNREAD, NULL},
    {"n_positions", "block_size", NULL, LG_HF_REQUIRED, NULL},
    {"n_ctx", "block_size", NULL, LG_HF_UNREAD, NULL},
    {"n_embd", "n_embd", NULL, LG_HF_REQUIRED, NULL},
    {"n_layer", "n_layer", NULL, LG_HF_REQUIRED, NULL},
    {"n_head", "n_head", NULL, LG_HF_REQUIRED, NULL},
    {"n_inner", "intermediate_size", NULL, LG_HF_DERIVED, NULL},
    {"activation_function", "gelu_approximate", "gelu_new", "gelu_new", NULL},
    {"layer_norm_epsilon", "norm_eps", NULL, "1e-5", NULL}};
static const lg_hf_key lg_hf_neox_keys[] = {
    {"vocab_size", "padded_vocab_size", NULL, LG_HF_UNREAD, NULL},
    {"max_position_embeddings", "block_size", NULL, LG_HF_REQUIRED, NULL},
    {"hidden_size", "n_embd", NULL, LG_HF_REQUIRED, NULL},
    {"num_hidden_layers", "n_layer", NULL, LG_HF_REQUIRED, NULL},
    {"num_attention_heads", "n_head", NULL, LG_HF_REQUIRED, NULL},
    {"intermediate_size", "intermediate_size", NULL, LG_HF_REQUIRED, NULL},
    {"hidden_act", "gelu_approximate", "gelu_new", "gelu", NULL},
    {"rotary_pct", "rotary_percentage", NULL, "0.25", NULL},
    {"rotary_emb_base", "rope_base", NULL, "10000", NULL},
    {"layer_norm_eps", "norm_eps", NULL, "1e-5", NULL},
    {"use_parallel_residual", "parallel_residual", NULL, "true", NULL},
    {"attention_bias", NULL, "true", LG_HF_UNREAD, NULL}};
/* Falcon-7B's layout: multi-query, attention and MLP in parallel on one norm (RWForCausalLM:
   the older names) */
static const lg_hf_key lg_hf_falcon_keys[] = {
    {"vocab_size", "padded_vocab_size", NULL, LG_HF_UNREAD, NULL},
    {"max_position_embeddings", "block_size", NULL, "2048", NULL},
    {"hidden_size", "n_embd", NULL, LG_HF_REQUIRED, NULL},
    {"num_hidden_layers", "n_layer", NULL, LG_HF_REQUIRED, "n_layer"},
    {"num_attention_heads", "n_head", NULL, LG_HF_REQUIRED, "n_head"},
    {"num_kv_heads", NULL, "1", LG_HF_UNREAD, NULL},
    {"multi_query", NULL, "true", LG_HF_UNREAD, NULL},
    {"new_decoder_architecture", NULL, "false", LG_HF_UNREAD, NULL},
    {"parallel_attn", NULL, "true", LG_HF_UNREAD, NULL},
    {"alibi", NULL, "false", LG_HF_UNREAD, NULL},
    {"bias", NULL, "false", LG_HF_UNREAD, NULL},
    {"ffn_hidden_size", "intermediate_size", NULL, LG_HF_DERIVED, NULL},
    {"activation", "gelu_approximate", "gelu_pytorch_tanh", "gelu", NULL},
    {"layer_norm_epsilon", "norm_eps", NULL, "1e-5", NULL},
    {"rope_theta", "rope_base", NULL, "10000", NULL}};
static const lg_hf_key lg_hf_llama_keys[] = { /* and Qwen2's */
    {"vocab_size", "padded_vocab_size", NULL, LG_HF_UNREAD, NULL},
    {"max_position_embeddings", "block_size", NULL, LG_HF_REQUIRED, NULL},
    {"hidden_size", "n_embd", NULL, LG_HF_REQUIRED, NULL},
    {"num_hidden_layers", "n_layer", NULL, LG_HF_REQUIRED, NULL},
    {"num_attention_heads", "n_head", NULL, LG_HF_REQUIRED, NULL},
    {"num_key_value_heads", "n_query_groups", NULL, LG_HF_DERIVED, NULL},
    {"head_dim", "head_size", NULL, LG_HF_DERIVED, NULL},
    {"intermediate_size", "intermediate_size", NULL, LG_HF_REQUIRED, NULL},
    {"hidden_act", NULL, "\"silu\"", LG_HF_UNREAD, NULL},
    {"rms_norm_eps", "norm_eps", NULL, "1e-6", NULL},
    {"rope_theta", "rope_base", NULL, "10000", NULL},
    {"attention_bias", "bias", NULL, "false", NULL},
    {"mlp_bias", "bias", NULL, LG_HF_UNREAD, NULL}};

static const struct {
    const char *architecture, *model_type;
    const lg_hf_key *keys;
    int n_keys;
} lg_hf_layouts[] = { /* lg_hf_family order */
#define LG_HF_KEYS(keys) keys, (int)(sizeof keys / sizeof keys[0])
    {"GPT2LMHeadModel", "gpt2", LG_HF_KEYS(lg_hf_gpt2_keys)},
    {"GPTNeoXForCausalLM", "gpt_neox", LG_HF_KEYS(lg_hf_neox_keys)},
    {"LlamaForCausalLM", "llama", LG_HF_KEYS(lg_hf_llama_keys)},
    {"Qwen2ForCausalLM", "qwen2", LG_HF_KEYS(lg_hf_llama_keys)},
    {"FalconForCausalLM", "falcon", LG_HF_KEYS(lg_hf_falcon_keys)},
#undef LG_HF_KEYS
};

/* config.json of a family. */
static size_t lg_hf_config_json(const lg_config *c, lg_hf_family f, lg_st_dtype dtype, char *buf,
                                size_t cap) {
    size_t n = 0;
    char value[128];
    lg_st_append(buf, cap, &n, "{\n  \"architectures\": [\"%s\"],\n  \"model_type\": \"%s\",\n",
                 lg_hf_layouts[f].architecture, lg_hf_layouts[f].model_type);
    for (int k = 0; k < lg_hf_layouts[f].n_keys; k++) {
        const lg_hf_key *h = &lg_hf_layouts[f].keys[k];
        const lg_config_field *field =
            h->field ? &lg_config_fields[lg_config_field_index(h->field)] : NULL;
        if (!field) lg_format(value, sizeof value, "%s", h->fixed);
        else if (field->type == LG_FIELD_GELU)
            lg_format(value, sizeof value, "\"%s\"", c->gelu_approximate_tanh ? h->fixed : "gelu");
        else lg_config_field_text(c, field, value, sizeof value); /* ints, numbers, booleans */
        lg_st_append(buf, cap, &n, "  \"%s\": %s,\n", h->key, value);
    }
    const lg_rope_adjustments *ra = &c->rope_adjustments;
    if (ra->factor != 0.0f) /* lg_hf_family_of allows it in the Llama and Qwen2 layouts only */
        lg_st_append(buf, cap, &n, "  \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": %.9g, "
                  "\"low_freq_factor\": %.9g, \"high_freq_factor\": %.9g, "
                  "\"original_max_position_embeddings\": %d},\n", ra->factor, ra->low_freq_factor,
                  ra->high_freq_factor, ra->original_max_seq_len);
    lg_st_append(buf, cap, &n, "  \"tie_word_embeddings\": %s,\n  \"torch_dtype\": \"%s\"\n}\n",
                 c->tie_embeddings ? "true" : "false", lg_hf_dtype_label(dtype));
    return n;
}

size_t lg_config_to_yaml(const lg_config *c, char *buf, size_t cap) {
    size_t n = 0;
    char value[128];
    for (int i = 0; i < LG_N_CONFIG_FIELDS; i++)
        lg_st_append(buf, cap, &n, "%s: %s\n", lg_config_fields[i].key,
                     lg_config_field_text(c, &lg_config_fields[i], value, sizeof value));
    if (c->rope_adjustments.factor == 0.0f) return n;
    lg_st_append(buf, cap, &n, "rope_adjustments:\n"); /* LitGPT's nested form */
    for (int i = 0; i < LG_N_ROPE_FIELDS; i++)
        lg_st_append(buf, cap, &n, "  %s: %s\n", lg_rope_fields[i].key,
                     lg_config_field_text(c, &lg_rope_fields[i], value, sizeof value));
    return n;
}

/* Reads one config.json field: required ints and floats, optional ones with a default. */
typedef struct {
    const lg_json *j;
    const char *path;
    lg_error *err;
    int failed;
    int object; /* the node read: 0, the root, or a nested object (rope_scaling) */
} lg_hf_fields;

/* The value of key in the object; -1 when absent or null. */
static int lg_hf_find(const lg_hf_fields *f, const char *key) {
    int t = lg_json_find(f->j, f->object, key);
    return t >= 0 && f->j->nodes[t].kind == LG_JSON_NULL ? -1 : t;
}

static int lg_hf_int(lg_hf_fields *f, const char *key, int fallback, int required) {
    int t = lg_json_find(f->j, f->object, key);
    double v;
    if ((t < 0 || f->j->nodes[t].kind == LG_JSON_NULL) && !required) return fallback;
    if (lg_json_double(f->j, t, &v) != 0 || v < 0 || v > 2e9 || v != (int)v) {
        if (!f->failed) lg_fail(f->err, "%s: %s is %s, expected a non-negative integer", f->path, key,
                                t < 0 ? "missing" : "not an integer");
        f->failed = 1;
        return 0;
    }
    return (int)v;
}

static float lg_hf_float(lg_hf_fields *f, const char *key, float fallback) {
    int t = lg_hf_find(f, key);
    double v = fallback;
    if (t < 0) return fallback;
    if (lg_json_double(f->j, t, &v) != 0 || !isfinite((float)v)) {
        if (!f->failed) lg_fail(f->err, "%s: %s is not a finite number", f->path, key);
        f->failed = 1;
        return fallback;
    }
    return (float)v;
}

static int lg_hf_bool(lg_hf_fields *f, const char *key, int fallback) {
    int t = lg_hf_find(f, key);
    if (t < 0) return fallback;
    if (f->j->nodes[t].kind == LG_JSON_TRUE || f->j->nodes[t].kind == LG_JSON_FALSE)
        return f->j->nodes[t].kind == LG_JSON_TRUE;
    if (!f->failed) lg_fail(f->err, "%s: %s is not true or false", f->path, key);
    f->failed = 1;
    return fallback;
}

/* A string, or the first of a list of strings ("architectures"); "" otherwise. */
static void lg_hf_string(lg_hf_fields *f, const char *key, char *out, size_t cap) {
    int t = lg_json_find(f->j, f->object, key);
    if (t >= 0 && f->j->nodes[t].kind == LG_JSON_ARRAY) t = f->j->nodes[t].first_child;
    lg_json_string_copy(f->j, t, out, cap);
}

/* gelu (exact), or one of the names of the tanh approximation. */
static int lg_hf_gelu(lg_hf_fields *f, const char *act) {
    if (strcmp(act, "gelu") == 0) return 0;
    if (strcmp(act, "gelu_new") == 0 || strcmp(act, "gelu_pytorch_tanh") == 0 || strcmp(act, "gelu_fast") == 0) return 1;
    if (!f->failed) lg_fail(f->err, "%s: activation '%s' is not gelu or a tanh approximation of it", f->path, act);
    f->failed = 1;
    return 0;
}

/* A refusal naming the config.json field at fault (the first one found). */
static void lg_hf_refuse(lg_hf_fields *f, const char *what) {
    if (!f->failed) lg_fail(f->err, "%s: %s", f->path, what);
    f->failed = 1;
}

/* A field the file leaves out that follows from those read: a head's size from the width and
   the heads, one key/value group a head, an MLP 4 times the width (LitGPT's rules too). */
static int lg_hf_derived(const lg_config *c, const lg_config_field *field) {
    if (field->offset == offsetof(lg_config, head_size)) return c->n_head ? c->n_embd / c->n_head : 0;
    if (field->offset == offsetof(lg_config, n_query_groups)) return c->n_head;
    return lg_size_times(c->n_embd, 4); /* intermediate_size */
}

/* Key h of the family's table into its field: read as the field's type says where the file has
   it (or its older name), else the table's `absent`; derived only when `derive` (after the
   others). */
static void lg_hf_read_key(lg_hf_fields *f, lg_config *c, const lg_hf_key *h, int derive) {
    const lg_config_field *field = &lg_config_fields[lg_config_field_index(h->field)];
    const char *key = h->older && lg_hf_find(f, h->key) < 0 && lg_hf_find(f, h->older) >= 0
                          ? h->older : h->key;
    int present = lg_hf_find(f, key) >= 0, derived = h->absent && !h->absent[0];
    void *at = (char *)c + field->offset;
    if (derive) {
        if (derived && !present) *(int *)at = lg_hf_derived(c, field);
    } else if (field->type == LG_FIELD_GELU) {
        char act[32];
        lg_hf_string(f, key, act, sizeof act);
        *(int *)at = lg_hf_gelu(f, act[0] ? act : h->absent);
    } else if (field->type == LG_FIELD_INT && (present || h->absent == LG_HF_REQUIRED)) {
        *(int *)at = lg_hf_int(f, key, 0, h->absent == LG_HF_REQUIRED);
    } else if (field->type == LG_FIELD_FLOAT && present) {
        *(float *)at = lg_hf_float(f, key, 0.0f);
    } else if (field->type == LG_FIELD_BOOL && present) {
        *(int *)at = lg_hf_bool(f, key, 0);
    } else if (!present && !derived) {
        lg_config_set(c, field, h->absent); /* (the table's own text: it parses) */
    }
}

/* Every key of the family's table that carries a field, in the table's order; the derived
   ones last. */
static void lg_hf_read_keys(lg_hf_fields *f, lg_config *c, lg_hf_family family) {
    const lg_hf_key *keys = lg_hf_layouts[family].keys;
    for (int derive = 0; derive < 2; derive++)
        for (int k = 0; k < lg_hf_layouts[family].n_keys; k++)
            if (keys[k].field && !(keys[k].absent && !strcmp(keys[k].absent, LG_HF_UNREAD)))
                lg_hf_read_key(f, c, &keys[k], derive);
}

/* The rotary settings beyond rope_theta: rope_scaling (transformers 4), or rope_parameters
   (transformers 5, which moves rope_theta into it). Absent, null or rope_type "default": plain
   rotary; "llama3" (where llama3 is allowed) -> rope_adjustments; other kinds (linear, dynamic,
   yarn, ...) would compute other frequencies: refused naming them. */
static void lg_hf_rope(lg_hf_fields *f, lg_config *c, int llama3) {
    const char *key = "rope_scaling";
    int node = lg_hf_find(f, key);
    if (node < 0) node = lg_hf_find(f, key = "rope_parameters");
    if (node < 0 || f->failed) return;
    if (f->j->nodes[node].kind != LG_JSON_OBJECT) {
        lg_fail(f->err, "%s: %s is not an object", f->path, key);
        f->failed = 1;
        return;
    }
    lg_hf_fields sub = *f;
    sub.object = node;
    c->rope_base = lg_hf_float(&sub, "rope_theta", c->rope_base);
    char type[32] = "";
    const char *type_key = lg_hf_find(&sub, "rope_type") >= 0 ? "rope_type" : "type"; /* older */
    int type_node = lg_hf_find(&sub, type_key);
    if (type_node >= 0 && f->j->nodes[type_node].kind != LG_JSON_STRING) {
        lg_fail(f->err, "%s: %s.%s is not a string", f->path, key, type_key);
        f->failed = 1;
        return;
    }
    lg_hf_string(&sub, type_key, type, sizeof type);
    if ((!type[0] || strcmp(type, "default") == 0) && !sub.failed) return;
    if (strcmp(type, "llama3") != 0 || !llama3) {
        if (!f->failed) lg_fail(f->err, "%s: %s.rope_type '%s' is not supported (%s)", f->path, key, type,
                                llama3 ? "only \"llama3\", the frequency scaling of Llama 3.1/3.2"
                                       : "this family has plain rotary embeddings");
        f->failed = 1;
        return;
    }
    const char *keys[4] = {"factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings"};
    for (int k = 0; k < 4; k++)
        if (lg_hf_find(&sub, keys[k]) < 0 && !f->failed) {
            lg_fail(f->err, "%s: %s.%s is missing", f->path, key, keys[k]);
            f->failed = 1;
            return;
        }
    lg_rope_adjustments *ra = &c->rope_adjustments;
    ra->factor = lg_hf_float(&sub, keys[0], 0.0f);
    ra->low_freq_factor = lg_hf_float(&sub, keys[1], 0.0f);
    ra->high_freq_factor = lg_hf_float(&sub, keys[2], 0.0f);
    ra->original_max_seq_len = lg_hf_int(&sub, keys[3], 0, 1);
    f->failed |= sub.failed;
    if (!f->failed && !(ra->factor >= 1.0f && ra->factor <= 1024.0f)) {
        lg_fail(f->err, "%s: %s.factor is %g; llama3 scaling needs a factor within [1, 1024]",
                f->path, key, (double)ra->factor);
        f->failed = 1;
    }
}

/* Each family's reader: its table's keys (lg_hf_read_keys), then what the table cannot say. */
static void lg_hf_config_gpt2(lg_hf_fields *f, lg_config *c) {
    lg_hf_read_keys(f, c, LG_HF_GPT2);
    c->n_query_groups = c->n_head;
    c->head_size = c->n_head ? c->n_embd / c->n_head : 0;
    c->norm_class_name = LG_NORM_LAYERNORM;
    c->mlp_class_name = LG_MLP_GPTNEOX;
    c->rope_base = 10000.0f; /* unused: no rotary embeddings */
    c->bias = c->learned_pos_embedding = 1;
    c->tie_embeddings = lg_hf_bool(f, "tie_word_embeddings", 1);
}

static void lg_hf_config_neox(lg_hf_fields *f, lg_config *c) {
    lg_hf_read_keys(f, c, LG_HF_GPTNEOX);
    c->n_query_groups = c->n_head;
    c->head_size = c->n_head ? c->n_embd / c->n_head : 0;
    c->norm_class_name = LG_NORM_LAYERNORM;
    c->mlp_class_name = LG_MLP_GPTNEOX;
    lg_hf_rope(f, c, 0);
    c->bias = 1;
    if (!lg_hf_bool(f, "attention_bias", 1) && !f->failed) {
        lg_fail(f->err, "%s: attention_bias false is not supported (LitGPT's GPT-NeoX has biases)", f->path);
        f->failed = 1;
    }
    c->tie_embeddings = lg_hf_bool(f, "tie_word_embeddings", 0);
}

static void lg_hf_config_llama(lg_hf_fields *f, lg_config *c, int qwen2) {
    char act[32];
    lg_hf_read_keys(f, c, qwen2 ? LG_HF_QWEN2 : LG_HF_LLAMA);
    int window = lg_hf_int(f, "sliding_window", 0, 0); /* Mistral: exact up to the window */
    if (window > 0 && window < c->block_size) c->block_size = window;
    c->norm_class_name = LG_NORM_RMSNORM;
    c->mlp_class_name = LG_MLP_LLAMA;
    c->rotary_percentage = 1.0f;
    lg_hf_string(f, "hidden_act", act, sizeof act);
    if (act[0] && strcmp(act, "silu") != 0 && !f->failed) {
        lg_fail(f->err, "%s: hidden_act '%s' is not silu", f->path, act);
        f->failed = 1;
    }
    lg_hf_rope(f, c, 1);
    if (qwen2) c->bias = 0; /* Qwen2: biases on q, k and v only (attn_bias) */
    if (!qwen2 && lg_hf_bool(f, "mlp_bias", 0) != c->bias && !f->failed) {
        lg_fail(f->err, "%s: attention_bias and mlp_bias differ, which LitGPT's bias cannot express", f->path);
        f->failed = 1;
    }
    c->attn_bias = qwen2;
    c->tie_embeddings = lg_hf_bool(f, "tie_word_embeddings", 0);
}

/* Falcon (FalconForCausalLM, or RWForCausalLM's older names): Falcon-7B's layout only --
   multi-query attention, attention and MLP in parallel on one LayerNorm, rotary, no alibi. */
static void lg_hf_config_falcon(lg_hf_fields *f, lg_config *c) {
    char type[64];
    lg_hf_read_keys(f, c, LG_HF_FALCON);
    c->head_size = c->n_head ? c->n_embd / c->n_head : 0;
    c->n_query_groups = 1;
    c->norm_class_name = LG_NORM_LAYERNORM;
    c->mlp_class_name = LG_MLP_GPTNEOX;
    c->rotary_percentage = 1.0f;
    c->parallel_residual = c->shared_attention_norm = 1;
    c->tie_embeddings = lg_hf_bool(f, "tie_word_embeddings", 1);
    lg_hf_string(f, "model_type", type, sizeof type); /* "RefinedWeb": the 40B layout */
    if (lg_hf_bool(f, "new_decoder_architecture", strcmp(type, "RefinedWeb") == 0))
        lg_hf_refuse(f, "new_decoder_architecture true is not supported (Falcon-40B/180B's "
                        "grouped query_key_value and two LayerNorms; only Falcon-7B's layout is built)");
    if (lg_hf_bool(f, "alibi", 0))
        lg_hf_refuse(f, "alibi true is not supported (ALiBi attention biases instead of rotary)");
    if (!lg_hf_bool(f, "multi_query", 1))
        lg_hf_refuse(f, "multi_query false is not supported (a per-head query_key_value; only "
                        "Falcon-7B's multi-query layout is built)");
    if (!lg_hf_bool(f, "parallel_attn", 1))
        lg_hf_refuse(f, "parallel_attn false is not supported (sequential attention and MLP with "
                        "a second LayerNorm)");
    if (lg_hf_bool(f, "bias", 0))
        lg_hf_refuse(f, "bias true is not supported (only Falcon-7B's linear layers without biases)");
    if (lg_hf_bool(f, "apply_residual_connection_post_layernorm", 0))
        lg_hf_refuse(f, "apply_residual_connection_post_layernorm true is not supported");
    lg_hf_rope(f, c, 0);
}

/* Our own model_config.yaml beside config.json gives the real vocab_size and the name. */
static void lg_hf_config_own_yaml(lg_config *cfg, const char *dir) {
    char path[LG_PATH_MAX];
    lg_config own;
    lg_format(path, sizeof path, "%s/model_config.yaml", dir);
    struct stat st;
    if (stat(path, &st) != 0 || lg_config_load(&own, path, NULL) != 0) return;
    lg_config same = *cfg;
    same.vocab_size = own.vocab_size;
    memcpy(same.name, own.name, sizeof same.name);
    if (memcmp(&same, &own, sizeof own) == 0) *cfg = own;
}

int lg_hf_config_read(lg_config *cfg, const char *dir, lg_error *err) {
    char path[LG_PATH_MAX], arch[64];
    lg_format(path, sizeof path, "%s/config.json", dir);
    size_t len;
    char *text = lg_read_text_file(path, 1 << 20, &len, err);
    if (!text) return -1;
    lg_json j;
    if (lg_json_parse(&j, text, len, path, err) != 0 || j.nodes[0].kind != LG_JSON_OBJECT) {
        if (j.nodes) lg_fail(err, "%s: not a JSON object", path);
        lg_json_free(&j);
        LG_FREE(text);
        return -1;
    }
    lg_hf_fields f = {&j, path, err, 0, 0};
    memset(cfg, 0, sizeof *cfg);
    lg_hf_string(&f, "architectures", arch, sizeof arch);
    if (strcmp(arch, "GPT2LMHeadModel") == 0) lg_hf_config_gpt2(&f, cfg);
    else if (strcmp(arch, "GPTNeoXForCausalLM") == 0) lg_hf_config_neox(&f, cfg);
    else if (strcmp(arch, "LlamaForCausalLM") == 0 || strcmp(arch, "MistralForCausalLM") == 0)
        lg_hf_config_llama(&f, cfg, 0);
    else if (strcmp(arch, "Qwen2ForCausalLM") == 0) lg_hf_config_llama(&f, cfg, 1);
    else if (strcmp(arch, "FalconForCausalLM") == 0 || strcmp(arch, "RWForCausalLM") == 0)
        lg_hf_config_falcon(&f, cfg);
    else {
        lg_fail(err, "%s: architecture '%s' is not one of GPT2LMHeadModel, GPTNeoXForCausalLM, "
                     "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, FalconForCausalLM, "
                     "RWForCausalLM", path, arch);
        f.failed = 1;
    }
    cfg->vocab_size = cfg->padded_vocab_size = lg_hf_int(&f, "vocab_size", 0, 1);
    lg_hf_string(&f, "model_type", cfg->name, sizeof cfg->name);
    lg_json_free(&j);
    LG_FREE(text);
    if (f.failed) return -1;
    lg_hf_config_own_yaml(cfg, dir);
    lg_error why;
    if (lg_config_check(cfg, &why) != 0) return lg_fail(err, "%s: %.400s", path, why.msg);
    return 0;
}

/* --- checkpoint directories ------------------------------------------------------------------ */

#define LG_MARKER_HEADER "litgpt.c checkpoint 1"

/* COMPLETE: the step and each file's size and hash; written last. */
static int lg_write_marker(const char *dir, int step, const char *const *names,
                           const lg_file_digest *digests, int n, lg_error *err) {
    char text[2048], path[LG_PATH_MAX];
    size_t at = 0;
    lg_st_append(text, sizeof text, &at, "%s\nstep %d\n", LG_MARKER_HEADER, step);
    for (int i = 0; i < n; i++)
        lg_st_append(text, sizeof text, &at, "file %s %llu %016llx\n", names[i],
                  (unsigned long long)digests[i].bytes, (unsigned long long)digests[i].hash);
    lg_format(path, sizeof path, "%s/" LG_CHECKPOINT_MARKER, dir);
    return lg_write_text_file(path, text, NULL, err);
}

/* Creates dir and removes an old marker from it before anything in it changes. */
static int lg_checkpoint_begin(const char *dir, lg_error *err) {
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return lg_fail(err, "checkpoint %s: cannot create the directory: %s", dir, strerror(errno));
    char path[LG_PATH_MAX];
    lg_format(path, sizeof path, "%s/" LG_CHECKPOINT_MARKER, dir);
    if (remove(path) == 0) lg_sync_parent(path);
    return 0;
}

/* Size and hash of a file as it is on disk. */
static int lg_file_digest_of(const char *path, lg_file_digest *d) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    static const size_t chunk = 1 << 20;
    unsigned char *buf = (unsigned char *)LG_MALLOC(chunk);
    d->bytes = 0;
    d->hash = LG_HASH64_INIT;
    size_t got;
    while (buf && (got = fread(buf, 1, chunk, f)) > 0) {
        d->hash = lg_hash64(d->hash, buf, got);
        d->bytes += got;
    }
    int rc = buf && !ferror(f) ? 0 : -1;
    LG_FREE(buf);
    fclose(f);
    return rc;
}

/* One "file NAME BYTES HASH" line of COMPLETE checked against the file. */
static int lg_verify_marker_line(const char *dir, const char *line, int line_no, lg_error *err) {
    char name[256];
    unsigned long long bytes, hash;
    if (sscanf(line, "file %255s %llu %llx", name, &bytes, &hash) != 3 || strchr(name, '/') ||
        strstr(name, ".."))
        return lg_fail(err, "checkpoint %s: " LG_CHECKPOINT_MARKER " line %d is malformed", dir, line_no);
    char path[1400];
    lg_format(path, sizeof path, "%s/%s", dir, name);
    lg_file_digest d;
    struct stat st;
    if (stat(path, &st) != 0) return lg_fail(err, "checkpoint %s: %s is missing", dir, name);
    if ((unsigned long long)st.st_size != bytes)
        return lg_fail(err, "checkpoint %s: %s has %llu bytes, " LG_CHECKPOINT_MARKER " records %llu "
                            "(truncated or changed)", dir, name, (unsigned long long)st.st_size, bytes);
    if (lg_file_digest_of(path, &d) != 0) return lg_fail(err, "checkpoint %s: cannot read %s", dir, name);
    if (d.hash != hash)
        return lg_fail(err, "checkpoint %s: %s does not match its checksum in " LG_CHECKPOINT_MARKER
                            " (%016llx, recorded %016llx): corrupted", dir, name,
                       (unsigned long long)d.hash, hash);
    return 0;
}

/* Every file of the directory but the marker itself (and files being written, NAME.tmp) has
   its line in the marker's text: a file left out of COMPLETE would go unverified. */
static int lg_verify_all_listed(const char *dir, const char *marker, lg_error *err) {
    DIR *d = opendir(dir);
    if (!d) return lg_fail(err, "checkpoint %s: cannot open: %s", dir, strerror(errno));
    int rc = 0;
    for (struct dirent *e = readdir(d); e && rc == 0; e = readdir(d)) {
        const char *name = e->d_name;
        size_t len = strlen(name);
        if (name[0] == '.' || strcmp(name, LG_CHECKPOINT_MARKER) == 0 ||
            (len > 4 && strcmp(name + len - 4, ".tmp") == 0))
            continue;
        char line[300];
        lg_format(line, sizeof line, "\nfile %s ", name);
        if (!strstr(marker, line))
            rc = lg_fail(err, "checkpoint %s: %s is not listed in " LG_CHECKPOINT_MARKER
                              ", so it cannot be verified", dir, name);
    }
    closedir(d);
    return rc;
}

/* The line at *at with its newline cut off, *at moved past it; NULL at the end of the text. */
static char *lg_take_line(char **at) {
    char *line = *at;
    if (!*line) return NULL;
    char *newline = strchr(line, '\n');
    *at = newline ? newline + 1 : line + strlen(line);
    if (newline) *newline = '\0';
    return line;
}

int lg_checkpoint_verify(const char *dir, int *step, lg_error *err) {
    char path[LG_PATH_MAX];
    lg_format(path, sizeof path, "%s/" LG_CHECKPOINT_MARKER, dir);
    struct stat st;
    if (stat(path, &st) != 0)
        return lg_fail(err, "checkpoint %s: no " LG_CHECKPOINT_MARKER " marker: the save did not "
                            "finish (or this is not a checkpoint)", dir);
    char *text = lg_read_text_file(path, 1 << 16, NULL, err);
    if (!text) return -1;
    int rc = lg_verify_all_listed(dir, text, err), line_no = 0, files = 0, marker_step = -1;
    char *at = text;
    for (char *line; rc == 0 && (line = lg_take_line(&at));) {
        line_no++;
        if (line_no == 1 && strcmp(line, LG_MARKER_HEADER) != 0)
            rc = lg_fail(err, "checkpoint %s: " LG_CHECKPOINT_MARKER " does not start with '%s'", dir, LG_MARKER_HEADER);
        else if (line_no == 2 && sscanf(line, "step %d", &marker_step) != 1)
            rc = lg_fail(err, "checkpoint %s: " LG_CHECKPOINT_MARKER " line 2 is not 'step N'", dir);
        else if (line_no > 2 && (rc = lg_verify_marker_line(dir, line, line_no, err)) == 0)
            files++;
    }
    LG_FREE(text);
    if (rc == 0 && files == 0) rc = lg_fail(err, "checkpoint %s: " LG_CHECKPOINT_MARKER " lists no files", dir);
    if (rc == 0 && step) *step = marker_step;
    return rc;
}

/* The same for one file of DIR alone, by its line in COMPLETE (a file not listed fails): what
   is read before the whole checkpoint is verified (LG_RUN_SETTINGS) is verified first. */
static int lg_checkpoint_verify_file(const char *dir, const char *name, lg_error *err) {
    char path[LG_PATH_MAX], want[300];
    lg_format(path, sizeof path, "%s/" LG_CHECKPOINT_MARKER, dir);
    lg_format(want, sizeof want, "file %s ", name);
    struct stat st;
    if (stat(path, &st) != 0)
        return lg_fail(err, "checkpoint %s: no " LG_CHECKPOINT_MARKER " marker, so %s cannot be "
                            "verified", dir, name);
    char *text = lg_read_text_file(path, 1 << 16, NULL, err);
    if (!text) return -1;
    int rc = 1, line_no = 0;
    char *at = text;
    for (char *line; rc == 1 && (line = lg_take_line(&at));) {
        line_no++;
        if (strncmp(line, want, strlen(want)) == 0)
            rc = lg_verify_marker_line(dir, line, line_no, err);
    }
    LG_FREE(text);
    if (rc == 1)
        rc = lg_fail(err, "checkpoint %s: %s is not listed in " LG_CHECKPOINT_MARKER ", so it "
                          "cannot be verified", dir, name);
    return rc;
}

int lg_checkpoint_find(const char *dir, char *found, size_t cap, lg_error *err) {
    char path[1400];
    struct stat st;
    lg_format(path, sizeof path, "%s/" LG_CHECKPOINT_MARKER, dir);
    if (stat(path, &st) == 0) {
        lg_format(found, cap, "%s", dir);
        return 0;
    }
    DIR *d = opendir(dir);
    if (!d) return lg_fail(err, "checkpoint %s: cannot open: %s", dir, strerror(errno));
    int best = -1, step, used;
    for (struct dirent *e = readdir(d); e; e = readdir(d)) {
        used = 0;
        if (sscanf(e->d_name, "step-%d%n", &step, &used) != 1 || e->d_name[used] != '\0') continue;
        lg_format(path, sizeof path, "%s/%s/" LG_CHECKPOINT_MARKER, dir, e->d_name);
        if (step > best && stat(path, &st) == 0) best = step;
    }
    closedir(d);
    if (best < 0)
        return lg_fail(err, "checkpoint %s: no complete checkpoint in it or in a step-N directory", dir);
    lg_format(found, cap, "%s/step-%d", dir, best);
    return 0;
}

/* --- loading and saving a model's weights --------------------------------------------------- */

/* The safetensors files of a Hugging Face directory, opened. */
typedef struct {
    lg_st_file *files; /* (n) */
    int n;
} lg_hf_files;

static void lg_hf_files_close(lg_hf_files *s) {
    for (int i = 0; i < s->n; i++) lg_st_close(&s->files[i]);
    LG_FREE(s->files);
    s->files = NULL;
    s->n = 0;
}

/* Opens a shard named by the index, refusing names that leave the directory. */
static int lg_hf_open_shard(lg_hf_files *s, const char *dir, const char *name, lg_error *err) {
    if (strchr(name, '/') || strstr(name, "..") || !strstr(name, ".safetensors"))
        return lg_fail(err, "%s/model.safetensors.index.json: '%s' is not a shard file name", dir, name);
    char path[LG_PATH_MAX];
    lg_format(path, sizeof path, "%s/%s", dir, name);
    for (int i = 0; i < s->n; i++)
        if (strcmp(s->files[i].path, path) == 0) return 0;
    return lg_st_open(&s->files[s->n++], path, err) == 0 ? 0 : (s->n--, -1);
}

/* model.safetensors, or every shard that model.safetensors.index.json names. */
static int lg_hf_files_open(lg_hf_files *s, const char *dir, lg_error *err) {
    char path[LG_PATH_MAX];
    struct stat st;
    memset(s, 0, sizeof *s);
    lg_format(path, sizeof path, "%s/model.safetensors.index.json", dir);
    if (stat(path, &st) != 0) {
        lg_format(path, sizeof path, "%s/model.safetensors", dir);
        if (stat(path, &st) != 0)
            return lg_fail(err, "%s: no model.safetensors or model.safetensors.index.json (other "
                                "formats, e.g. pytorch_model.bin, are not read)", dir);
        s->files = (lg_st_file *)lg_alloc_zeroed(sizeof(lg_st_file));
        if (!s->files) return lg_fail(err, "out of host memory");
        if (lg_st_open(&s->files[0], path, err) != 0) { lg_hf_files_close(s); return -1; }
        s->n = 1;
        return 0;
    }
    size_t len;
    char *text = lg_read_text_file(path, 64 << 20, &len, err);
    if (!text) return -1;
    lg_json j;
    int rc = lg_json_parse(&j, text, len, path, err), map = rc == 0 ? lg_json_find(&j, 0, "weight_map") : -1;
    if (rc == 0 && (map < 0 || j.nodes[map].kind != LG_JSON_OBJECT)) {
        rc = lg_fail(err, "%s: no weight_map object (not an index)", path);
    } else if (rc == 0 && !(s->files = (lg_st_file *)lg_alloc_zeroed(
                                sizeof(lg_st_file) * (size_t)(lg_json_count(&j, map) + 1)))) {
        rc = lg_fail(err, "out of host memory");
    } else if (rc == 0) {
        int i = 0;
        for (int k = j.nodes[map].first_child; k >= 0 && rc == 0; k = j.nodes[j.nodes[k].next].next, i++) {
            char name[256];
            if (lg_json_string_copy(&j, j.nodes[k].next, name, sizeof name) != 0)
                rc = lg_fail(err, "%s: weight_map entry %d is not a file name", path, i);
            else rc = lg_hf_open_shard(s, dir, name, err);
        }
    }
    lg_json_free(&j);
    LG_FREE(text);
    if (rc != 0) lg_hf_files_close(s);
    return rc;
}

/* The type a model directory's weights are stored in: F32 when any floating tensor is, else
   F16 or BF16 when all are that one (F32 when both appear). */
static int lg_hf_weights_dtype(const char *dir, lg_dtype *dtype, lg_error *err) {
    lg_hf_files s;
    if (lg_hf_files_open(&s, dir, err) != 0) return -1;
    int seen[3] = {0, 0, 0}; /* F32, BF16, F16 */
    for (int f = 0; f < s.n; f++)
        for (int t = 0; t < s.files[f].n_tensors; t++) {
            lg_st_dtype d = s.files[f].tensors[t].dtype;
            if (d == LG_ST_F32 || d == LG_ST_BF16 || d == LG_ST_F16)
                seen[d == LG_ST_F32 ? 0 : d == LG_ST_BF16 ? 1 : 2] = 1;
        }
    lg_hf_files_close(&s);
    *dtype = seen[0] || (seen[1] && seen[2]) ? LG_DTYPE_F32 : seen[2] ? LG_DTYPE_F16 : LG_DTYPE_BF16;
    return 0;
}

/* The prefixes of the base model's module inside the *ForCausalLM classes: files saved from
   the base model alone (GPT2Model, openai-community/gpt2's model.safetensors) name tensors
   without them (wte.weight, h.0.attn.c_attn.weight, layers.0..., ...). */
static const char *const lg_hf_model_prefixes[] = {"transformer.", "model.", "gpt_neox."};

static const lg_st_tensor *lg_hf_files_find_exact(const lg_hf_files *s, const char *name,
                                                  int *file) {
    for (int i = 0; i < s->n; i++) {
        const lg_st_tensor *t = lg_st_find(&s->files[i], name);
        if (t) { *file = i; return t; }
    }
    return NULL;
}

/* The tensor of that name in any file, else under the name without its model prefix. */
static const lg_st_tensor *lg_hf_files_find(const lg_hf_files *s, const char *name, int *file) {
    const lg_st_tensor *t = lg_hf_files_find_exact(s, name, file);
    for (size_t k = 0; !t && k < sizeof lg_hf_model_prefixes / sizeof lg_hf_model_prefixes[0]; k++) {
        size_t n = strlen(lg_hf_model_prefixes[k]);
        if (strncmp(name, lg_hf_model_prefixes[k], n) == 0)
            t = lg_hf_files_find_exact(s, name + n, file);
    }
    return t;
}

/* Reads one Hugging Face tensor and scatters it into its LitGPT tensor of dest. */
static int lg_hf_load_tensor(const lg_config *cfg, const lg_tensor_info *info, const lg_hf_tensor *h,
                             const lg_hf_files *s, const char *dir, lg_buf dest, lg_error *err) {
    int file = 0;
    const lg_st_tensor *t = lg_hf_files_find(s, h->name, &file);
    if (!t) return lg_fail(err, "%s: no tensor %s (LitGPT's %s)", dir, h->name, info->name);
    int same = t->ndim == h->ndim;
    for (int d = 0; d < h->ndim && same; d++) same = t->shape[d] == h->shape[d];
    if (!same)
        return lg_fail(err, "%s: tensor %s has shape [%lld%s%lld], the config needs [%lld%s%lld]",
                       s->files[file].path, h->name, (long long)t->shape[0], t->ndim > 1 ? ", " : "",
                       t->ndim > 1 ? (long long)t->shape[1] : 0LL, (long long)h->shape[0],
                       h->ndim > 1 ? ", " : "", h->ndim > 1 ? (long long)h->shape[1] : 0LL);
    if (!lg_st_is_float(t->dtype))
        return lg_fail(err, "%s: tensor %s is %s, not F32, BF16 or F16", s->files[file].path,
                       h->name, lg_st_dtype_name(t->dtype));
    unsigned char *bytes = (unsigned char *)LG_MALLOC((size_t)(t->end - t->begin) + 1);
    if (!bytes) return lg_fail(err, "out of host memory for %s", h->name);
    if (lg_st_read(&s->files[file], t, bytes, err) != 0) { LG_FREE(bytes); return -1; }
    size_t count = (size_t)lg_st_count(t);
    for (size_t i = 0; i < count; i++)
        lg_set(dest, info->offset + lg_hf_source_index(cfg, h, i), lg_st_get(t->dtype, bytes, i));
    LG_FREE(bytes);
    return 0;
}

/* lg_hf_load_weights without the verification of a COMPLETE marker. */
static int lg_hf_load_into(const lg_config *cfg, lg_buf dest, const char *dir, lg_error *err) {
    lg_hf_family family;
    if (lg_hf_family_of(cfg, &family, err) != 0) return -1;
    lg_tensor_table table;
    if (lg_table_alloc(&table, cfg) != 0) return lg_fail(err, "out of host memory");
    lg_params_layout(cfg, lg_no_buf(), NULL, &table);
    lg_hf_tensor *hf = NULL;
    int n = 0, rc = lg_hf_tensors(cfg, &table, family, &hf, &n, err);
    lg_hf_files files = {NULL, 0};
    if (rc == 0) rc = lg_hf_files_open(&files, dir, err);
    for (int i = 0; i < n && rc == 0; i++)
        rc = lg_hf_load_tensor(cfg, &table.tensors[hf[i].source], &hf[i], &files, dir, dest, err);
    lg_hf_files_close(&files);
    LG_FREE(hf);
    lg_tensor_table_free(&table);
    return rc;
}

int lg_hf_load_weights(const lg_config *cfg, lg_buf dest, const char *dir, lg_error *err) {
    char marker[LG_PATH_MAX];
    struct stat st;
    lg_format(marker, sizeof marker, "%s/" LG_CHECKPOINT_MARKER, dir);
    if (stat(marker, &st) == 0 && lg_checkpoint_verify(dir, NULL, err) != 0) return -1;
    return lg_hf_load_into(cfg, dest, dir, err);
}

/* What lg_st_write asks of a model save: the weights and the Hugging Face tensor list. */
typedef struct {
    const lg_config *cfg;
    const lg_tensor_table *table;
    const lg_hf_tensor *hf;
    lg_st_tensor *out;
    const lg_exec *ex;      /* the rank the weights live on */
    lg_buf weights;
    /* a full-shard trainer: brings the unit of table tensor `source` and gives the buffer
       that holds it (the table's offsets are then within units) */
    lg_buf (*bring)(void *bring_ctx, int source);
    void *bring_ctx;
} lg_hf_save_ctx;

static int lg_hf_fill(void *ctx, int index, unsigned char *out, lg_error *err) {
    const lg_hf_save_ctx *s = (const lg_hf_save_ctx *)ctx;
    const lg_hf_tensor *h = &s->hf[index];
    const lg_tensor_info *info = &s->table->tensors[h->source];
    size_t count = (size_t)lg_st_count(&s->out[index]);
    lg_buf weights = s->bring ? s->bring(s->bring_ctx, h->source) : s->weights;
    lg_buf source = lg_at(weights, info->offset), copy = {NULL, source.dtype};
    if (s->ex->backend == LG_BACKEND_CUDA) { /* the host reads a GPU's tensor from its copy */
        copy.data = LG_MALLOC(info->count * lg_elem_size(source.dtype));
        if (!copy.data) return lg_fail(err, "out of host memory");
        lg_copy(s->ex, copy, source, info->count);
        source = copy;
    }
    for (size_t i = 0; i < count; i++)
        lg_st_set(s->out[index].dtype, out, i, lg_get(source, lg_hf_source_index(s->cfg, h, i)));
    LG_FREE(copy.data);
    return 0;
}

static lg_st_dtype lg_st_dtype_of(lg_dtype d) {
    return d == LG_DTYPE_BF16 ? LG_ST_BF16 : d == LG_DTYPE_F16 ? LG_ST_F16 : LG_ST_F32;
}

/* The files of a model: model.safetensors in the weights' dtype, config.json,
   model_config.yaml; their digests into digests[0..2]. With `bring`, the weights come unit by
   unit from it (table: m's with offsets within units). */
static int lg_hf_write_model_from(const lg_model *m, const lg_tensor_table *table,
                                  lg_buf (*bring)(void *, int), void *bring_ctx, const char *dir,
                                  lg_file_digest *digests, lg_error *err);

static int lg_hf_write_model(const lg_model *m, const char *dir, lg_file_digest *digests,
                             lg_error *err) {
    return lg_hf_write_model_from(m, &m->param_table, NULL, NULL, dir, digests, err);
}

static int lg_hf_write_model_from(const lg_model *m, const lg_tensor_table *table,
                                  lg_buf (*bring)(void *, int), void *bring_ctx, const char *dir,
                                  lg_file_digest *digests, lg_error *err) {
    lg_hf_family family;
    if (lg_hf_family_of(&m->cfg, &family, err) != 0) return -1;
    lg_hf_tensor *hf = NULL;
    int n = 0;
    if (lg_hf_tensors(&m->cfg, &m->param_table, family, &hf, &n, err) != 0) return -1;
    lg_st_tensor *out = (lg_st_tensor *)lg_alloc_zeroed(sizeof(lg_st_tensor) * (size_t)(n + 1));
    lg_st_dtype dtype = lg_st_dtype_of(m->params.dtype);
    for (int i = 0; out && i < n; i++) {
        lg_format(out[i].name, sizeof out[i].name, "%s", hf[i].name);
        out[i].dtype = dtype;
        out[i].ndim = hf[i].ndim;
        out[i].shape[0] = hf[i].shape[0];
        out[i].shape[1] = hf[i].shape[1];
    }
    lg_st_meta meta[1] = {{"format", "pt"}};
    lg_hf_save_ctx ctx = {&m->cfg, table, hf, out, &m->exec, m->params, bring, bring_ctx};
    char path[LG_PATH_MAX], text[4096];
    lg_format(path, sizeof path, "%s/model.safetensors", dir);
    int rc = out ? lg_st_write(path, out, n, meta, 1, lg_hf_fill, &ctx, &digests[0], err)
                 : lg_fail(err, "out of host memory");
    LG_FREE(out);
    LG_FREE(hf);
    lg_format(path, sizeof path, "%s/config.json", dir);
    lg_hf_config_json(&m->cfg, family, dtype, text, sizeof text);
    if (rc == 0) rc = lg_write_text_file(path, text, &digests[1], err);
    lg_format(path, sizeof path, "%s/model_config.yaml", dir);
    lg_config_to_yaml(&m->cfg, text, sizeof text);
    if (rc == 0) rc = lg_write_text_file(path, text, &digests[2], err);
    return rc;
}

int lg_hf_save(const lg_model *m, const char *dir, lg_error *err) {
    static const char *const names[3] = {"model.safetensors", "config.json", "model_config.yaml"};
    lg_file_digest digests[3];
    if (lg_checkpoint_begin(dir, err) != 0 || lg_hf_write_model(m, dir, digests, err) != 0) return -1;
    return lg_write_marker(dir, 0, names, digests, 3, err);
}

/* --- LoRA: PEFT adapter files, the frozen base, the merged model ------------------------------ */

/* One tensor of adapter_model.safetensors: LoRA's A (r', in) or B (rows, r') of one Hugging
   Face module, r' = parts x r. A module that fuses several adapted LitGPT linears' rows (GPT-2's
   c_attn, GPT-NeoX's query_key_value: q, k and v) holds their adapters stacked: A' = [A_q; A_v],
   B' = [B_q 0; 0 B_v] in its own row order, zero rows where no adapter writes; its scale stays
   alpha / r with rank r' through alpha' = parts x alpha (adapter_config.json's patterns). */
typedef struct {
    char name[LG_ST_MAX_NAME];   /* base_model.model.<module>.lora_A.weight */
    char module[LG_ST_MAX_NAME]; /* <module>: the Hugging Face name of the linear */
    int is_b;                    /* lora_B (rows, r') else lora_A (r', in) */
    int rows, cols;              /* the file's shape */
    int parts;                   /* adapters stacked into it: 1..3 */
    int source[3];               /* their A (or B) in the trainable table */
    int first_row[3];            /* B: the LitGPT output row of each part's row 0 */
    int part_rows[3];            /* B: rows of each part */
    lg_hf_tensor rows_of;        /* B: file row -> LitGPT output row (lg_hf_source_index) */
    int litgpt_first;            /* B: the LitGPT row of file row 0 when rows_of copies */
} lg_peft_tensor;

/* The adapted linears a base weight feeds (LitGPT suffix) and the first of them. */
static int lg_peft_linears(const lg_config *c, const char *suffix, lg_lora_linear *first,
                           lg_lora_linear *last) {
    int llama = c->mlp_class_name == LG_MLP_LLAMA, found = 0;
    for (int k = 0; k < LG_LORA_BLOCK_LINEARS; k++) {
        if (strcmp(lg_lora_base_weights[llama][k], suffix) != 0) continue;
        if (!found++) *first = (lg_lora_linear)k;
        *last = (lg_lora_linear)k;
    }
    return found > 0;
}

static int lg_table_index(const lg_tensor_table *table, const char *name) {
    for (int i = 0; i < table->n_tensors; i++)
        if (strcmp(table->tensors[i].name, name) == 0) return i;
    return -1;
}

/* Adds the A and B of one Hugging Face module h (from base tensor src) that adapters of block l
   (l < 0: the head) write into. */
static void lg_peft_add_module(const lg_config *c, const lg_tensor_table *adapters,
                               const lg_tensor_info *src, const lg_hf_tensor *h, int l,
                               lg_lora_linear first, lg_lora_linear last, lg_peft_tensor *out,
                               int *n) {
    int r = c->lora.r, llama = c->mlp_class_name == LG_MLP_LLAMA;
    /* the LitGPT output rows the file tensor covers */
    int row0 = h->how == LG_HF_COPY ? (int)(h->start / (size_t)src->cols) : 0;
    int rows = h->how == LG_HF_COPY ? (int)h->shape[0] : src->rows;
    lg_peft_tensor a, b;
    memset(&a, 0, sizeof a);
    char name[LG_MAX_NAME];
    for (int k = first; k <= (int)last; k++) {
        int in, o, col = l < 0 ? 0 : lg_lora_first_row(c, (lg_lora_linear)k);
        if (l < 0) { in = c->n_embd; o = c->padded_vocab_size; }
        else if (!lg_lora_adapts(c, (lg_lora_linear)k)) continue;
        else lg_lora_dims(c, (lg_lora_linear)k, &in, &o);
        if (col + o <= row0 || col >= row0 + rows) continue;
        if (l < 0) lg_format(name, sizeof name, "lm_head.lora_A");
        else lg_format(name, sizeof name, "transformer.h.%d.%s.lora_A", l, lg_lora_linear_names[llama][k]);
        a.source[a.parts] = lg_table_index(adapters, name);
        name[strlen(name) - 1] = 'B';
        b.source[a.parts] = lg_table_index(adapters, name);
        b.first_row[a.parts] = col;
        b.part_rows[a.parts] = o;
        a.cols = in;
        a.parts++;
    }
    if (!a.parts) return;
    size_t len = strlen(h->name) - strlen(".weight");
    lg_format(a.module, sizeof a.module, "%.*s", (int)len, h->name);
    memcpy(b.module, a.module, sizeof a.module);
    lg_format(a.name, sizeof a.name, "base_model.model.%s.lora_A.weight", a.module);
    lg_format(b.name, sizeof b.name, "base_model.model.%s.lora_B.weight", a.module);
    a.rows = a.parts * r;
    b.parts = a.parts;
    b.is_b = 1;
    b.rows = rows;
    b.cols = a.parts * r;
    b.rows_of = *h;
    b.rows_of.ndim = 2; /* rows only: a (rows, 1) view of the same transform */
    b.rows_of.shape[0] = rows;
    b.rows_of.shape[1] = 1;
    b.rows_of.start = (size_t)row0;
    if (h->how == LG_HF_TRANSPOSE) b.rows_of.how = LG_HF_COPY, b.rows_of.start = 0; /* Conv1D: A, B stay */
    out[(*n)++] = a;
    out[(*n)++] = b;
}

/* Every tensor of the run's adapter file. *out: LG_MALLOC. */
static int lg_peft_tensors(const lg_config *c, const lg_tensor_table *adapters, lg_peft_tensor **out,
                           int *n_out, lg_error *err) {
    lg_config base = lg_config_base(c);
    lg_hf_family family;
    if (lg_hf_family_of(&base, &family, err) != 0) return -1;
    lg_tensor_table table;
    if (lg_table_alloc(&table, &base) != 0) return lg_fail(err, "out of host memory");
    lg_params_layout(&base, lg_no_buf(), NULL, &table);
    lg_hf_tensor *hf = NULL;
    int n_hf = 0, n = 0;
    if (lg_hf_tensors(&base, &table, family, &hf, &n_hf, err) != 0) {
        lg_tensor_table_free(&table);
        return -1;
    }
    lg_peft_tensor *p = (lg_peft_tensor *)lg_alloc_zeroed(sizeof(lg_peft_tensor) * (size_t)(2 * n_hf + 1));
    for (int i = 0; p && i < n_hf; i++) {
        const lg_tensor_info *src = &table.tensors[hf[i].source];
        int l, used = 0;
        lg_lora_linear first, last;
        if (sscanf(src->name, "transformer.h.%d.%n", &l, &used) == 1 && used > 0) {
            if (lg_peft_linears(c, src->name + used, &first, &last))
                lg_peft_add_module(c, adapters, src, &hf[i], l, first, last, p, &n);
        } else if (strcmp(src->name, "lm_head.weight") == 0 && (c->lora.targets & LG_LORA_HEAD)) {
            lg_peft_add_module(c, adapters, src, &hf[i], -1, LG_LORA_Q, LG_LORA_Q, p, &n);
        }
    }
    LG_FREE(hf);
    lg_tensor_table_free(&table);
    if (!p) return lg_fail(err, "out of host memory");
    *out = p;
    *n_out = n;
    return 0;
}

/* Where element i of a PEFT tensor lives in the whole trainable layout; 0: a zero of B'. */
static int lg_peft_source(const lg_config *c, const lg_tensor_table *adapters,
                          const lg_peft_tensor *p, size_t i, size_t *at) {
    int r = c->lora.r, row = (int)(i / (size_t)p->cols), col = (int)(i % (size_t)p->cols);
    if (!p->is_b) { /* A' (parts r, in): part row / r */
        const lg_tensor_info *t = &adapters->tensors[p->source[row / r]];
        *at = t->origin + (size_t)(row % r) * (size_t)p->cols + (size_t)col;
        return 1;
    }
    int part = col / r;
    int litgpt_row = (int)lg_hf_source_index(c, &p->rows_of, (size_t)row);
    int local = litgpt_row - p->first_row[part];
    if (local < 0 || local >= p->part_rows[part]) return 0;
    const lg_tensor_info *t = &adapters->tensors[p->source[part]];
    *at = t->origin + (size_t)local * (size_t)r + (size_t)(col % r);
    return 1;
}

/* What lg_st_write asks of an adapter file. */
typedef struct {
    const lg_config *cfg;
    const lg_tensor_table *adapters;
    const lg_peft_tensor *peft;
    const lg_st_tensor *out;
    lg_buf whole; /* the adapters in the whole trainable layout */
} lg_peft_ctx;

static int lg_peft_fill(void *ctx, int index, unsigned char *out, lg_error *err) {
    const lg_peft_ctx *s = (const lg_peft_ctx *)ctx;
    const lg_peft_tensor *p = &s->peft[index];
    size_t count = (size_t)p->rows * (size_t)p->cols, at;
    for (size_t i = 0; i < count; i++)
        lg_st_set(s->out[index].dtype, out, i,
                  lg_peft_source(s->cfg, s->adapters, p, i, &at) ? lg_get(s->whole, at) : 0);
    (void)err;
    return 0;
}

/* adapter_config.json: PEFT's LoRA settings; fused modules' rank and alpha as patterns. */
static void lg_peft_config_json(const lg_config *c, const lg_peft_tensor *p, int n,
                                const char *base_model, char *buf, size_t cap) {
    size_t at = 0;
    lg_hf_family family;
    lg_hf_family_of(c, &family, NULL);
    lg_st_append(buf, cap, &at, "{\n  \"peft_type\": \"LORA\",\n  \"task_type\": \"CAUSAL_LM\",\n"
                 "  \"base_model_name_or_path\": \"%s\",\n  \"r\": %d,\n  \"lora_alpha\": %g,\n"
                 "  \"lora_dropout\": %g,\n  \"bias\": \"none\",\n  \"fan_in_fan_out\": %s,\n"
                 "  \"target_modules\": [", base_model, c->lora.r, c->lora.alpha, c->lora.dropout,
                 family == LG_HF_GPT2 ? "true" : "false");
    /* the distinct last components of the module names */
    const char *seen[16];
    int n_seen = 0;
    for (int i = 0; i < n; i += 2) {
        const char *leaf = strrchr(p[i].module, '.') ? strrchr(p[i].module, '.') + 1 : p[i].module;
        int known = 0;
        for (int k = 0; k < n_seen; k++) known |= strcmp(seen[k], leaf) == 0;
        if (known || n_seen == 16) continue;
        seen[n_seen++] = leaf;
        lg_st_append(buf, cap, &at, "%s\"%s\"", n_seen > 1 ? ", " : "", leaf);
    }
    lg_st_append(buf, cap, &at, "],\n  \"rank_pattern\": {");
    int patterns = 0;
    for (int i = 0; i < n; i += 2)
        if (p[i].parts > 1)
            lg_st_append(buf, cap, &at, "%s\"%s\": %d", patterns++ ? ", " : "", p[i].module,
                         p[i].parts * c->lora.r);
    lg_st_append(buf, cap, &at, "},\n  \"alpha_pattern\": {");
    patterns = 0;
    for (int i = 0; i < n; i += 2)
        if (p[i].parts > 1)
            lg_st_append(buf, cap, &at, "%s\"%s\": %g", patterns++ ? ", " : "", p[i].module,
                         p[i].parts * c->lora.alpha);
    lg_st_append(buf, cap, &at, "}\n}\n");
}

/* DIR/adapter_model.safetensors and adapter_config.json from the adapters in whole (the whole
   trainable layout), in the weights' dtype. */
static int lg_peft_write(const lg_model *m0, lg_buf whole, const char *dir, const char *base_model,
                         lg_file_digest *digests, lg_error *err) {
    lg_peft_tensor *peft = NULL;
    int n = 0;
    if (lg_peft_tensors(&m0->cfg, &m0->param_table, &peft, &n, err) != 0) return -1;
    lg_st_tensor *out = (lg_st_tensor *)lg_alloc_zeroed(sizeof(lg_st_tensor) * (size_t)(n + 1));
    for (int i = 0; out && i < n; i++) {
        lg_format(out[i].name, sizeof out[i].name, "%s", peft[i].name);
        out[i].dtype = lg_st_dtype_of(m0->params.dtype);
        out[i].ndim = 2;
        out[i].shape[0] = peft[i].rows;
        out[i].shape[1] = peft[i].cols;
    }
    lg_st_meta meta[1] = {{"format", "pt"}};
    lg_peft_ctx ctx = {&m0->cfg, &m0->param_table, peft, out, whole};
    char path[LG_PATH_MAX], text[8192];
    lg_format(path, sizeof path, "%s/adapter_model.safetensors", dir);
    int rc = out ? lg_st_write(path, out, n, meta, 1, lg_peft_fill, &ctx, &digests[0], err)
                 : lg_fail(err, "out of host memory");
    lg_peft_config_json(&m0->cfg, peft, n, base_model, text, sizeof text);
    lg_format(path, sizeof path, "%s/adapter_config.json", dir);
    if (rc == 0) rc = lg_write_text_file(path, text, &digests[1], err);
    LG_FREE(out);
    LG_FREE(peft);
    return rc;
}

/* Reads DIR/adapter_model.safetensors into whole (the whole trainable layout, lg_real),
   checking that it holds this run's adapters. */
static int lg_peft_read(const lg_model *m0, const char *dir, lg_real *whole, lg_error *err) {
    lg_peft_tensor *peft = NULL;
    int n = 0;
    if (lg_peft_tensors(&m0->cfg, &m0->param_table, &peft, &n, err) != 0) return -1;
    char path[LG_PATH_MAX];
    lg_format(path, sizeof path, "%s/adapter_model.safetensors", dir);
    lg_st_file f;
    int rc = lg_st_open(&f, path, err);
    if (rc != 0) { LG_FREE(peft); return -1; }
    if (f.n_tensors != n)
        rc = lg_fail(err, "adapters %s: %d tensors, this run's adapters (r %d) are %d: another "
                          "base model or `lora.targets`", path, f.n_tensors, m0->cfg.lora.r, n);
    for (int i = 0; i < n && rc == 0; i++) {
        const lg_peft_tensor *p = &peft[i];
        const lg_st_tensor *t = lg_st_find(&f, p->name);
        if (!t || t->ndim != 2 || t->shape[0] != p->rows || t->shape[1] != p->cols) {
            rc = lg_fail(err, "adapters %s: %s is %s, this run needs [%d, %d]: written for another "
                              "base model, `lora.r` or `lora.targets`", path, p->name,
                         t ? "of another shape" : "missing", p->rows, p->cols);
            break;
        }
        if (!lg_st_is_float(t->dtype)) {
            rc = lg_fail(err, "adapters %s: %s is %s, not F32, BF16 or F16", path, p->name,
                         lg_st_dtype_name(t->dtype));
            break;
        }
        unsigned char *bytes = (unsigned char *)LG_MALLOC((size_t)(t->end - t->begin) + 1);
        if (!bytes) { rc = lg_fail(err, "out of host memory"); break; }
        rc = lg_st_read(&f, t, bytes, err);
        size_t at, count = (size_t)p->rows * (size_t)p->cols;
        for (size_t k = 0; k < count && rc == 0; k++)
            if (lg_peft_source(&m0->cfg, &m0->param_table, p, k, &at)) whole[at] = lg_st_get(t->dtype, bytes, k);
        LG_FREE(bytes);
    }
    lg_st_close(&f);
    LG_FREE(peft);
    return rc;
}

/* FNV-1a of frozen tensor t's stored bytes at `at` (the weight type, or NF4), after hash. */
static uint64_t lg_frozen_tensor_hash(uint64_t hash, const lg_model *m, lg_frozen_at at,
                                      const lg_tensor_info *t) {
    lg_buf bytes_at = {lg_frozen_values(at, t).data, LG_DTYPE_U8};
    size_t bytes = t->count * lg_elem_size(at.values.dtype);
    if (t->packed != LG_DTYPE_F32) {
        bytes_at.data = (uint8_t *)at.packed.data + t->offset;
        bytes = lg_nf4_bytes(t->count, t->packed == LG_DTYPE_NF4 ? LG_QUANTIZE_NF4 : LG_QUANTIZE_NF4_DQ);
    }
    lg_visit v = lg_visit_start(&m->exec, bytes_at, bytes, 1, LG_VISIT_READ);
    while (lg_visit_next(&v)) hash = lg_hash64(hash, v.piece.data, v.n);
    return hash;
}

/* Frozen tensor t at `at` from the base model's whole layout (lg_real), packed in NF4 when
   the layout stores it so. */
static int lg_frozen_tensor_set(const lg_model *m, lg_frozen_at at, const lg_tensor_info *t,
                                const lg_real *base, lg_error *err) {
    lg_buf src = lg_buf_of((lg_real *)base + t->origin);
    if (t->packed != LG_DTYPE_F32) return lg_pack_frozen(m, at, t, src, err);
    lg_copy(&m->exec, lg_frozen_values(at, t), src, t->count);
    return 0;
}

/* frozen_gathered: rank r's frozen shard from the base's whole layout, unit by unit through
   its first gather slot of the kind (the unit whole, then its piece kept); the first rank
   hashes the units as it goes (the base_hash of a one-rank run: the same bytes in order). */
static int lg_trainer_set_frozen_units(lg_trainer *tr, int r, const lg_real *base, lg_error *err) {
    const lg_shard_layout *sl = &tr->plan.frozen_shards;
    lg_trainer_rank *tr_r = &tr->ranks[r];
    lg_model *m = &tr_r->model;
    size_t piece_first = (size_t)tr->plan.ranks[tr->first_rank + r].shard_index;
    uint64_t h = LG_HASH64_INIT;
    for (int u = 0; u < sl->n_units; u++) {
        uint8_t *unit = (uint8_t *)(u == 0 ? tr_r->frozen_gather_ends : tr_r->frozen_gather_blocks).data;
        lg_frozen_at at = lg_frozen_unit_at(m, u, unit);
        lg_rank_sync(m->rank); /* the slot's last copy has left it */
        for (int i = 0; i < m->frozen_table.n_tensors; i++) {
            const lg_tensor_info *t = &m->frozen_table.tensors[i];
            if (t->block + 1 != u) continue;
            if (lg_frozen_tensor_set(m, at, t, base, err) != 0) return -1;
            if (r == 0) h = lg_frozen_tensor_hash(h, m, at, t);
        }
        lg_buf src = {unit + piece_first * sl->piece_count[u], LG_DTYPE_U8};
        lg_buf dst = {(uint8_t *)m->frozen_shard.data + sl->piece_offset[u], LG_DTYPE_U8};
        lg_copy(&m->exec, dst, src, sl->piece_count[u]);
    }
    lg_rank_sync(m->rank);
    if (r == 0) tr->base_hash = h, tr->base_hashed = 1;
    return 0;
}

/* LoRA: sets every rank's frozen base (its shard of it when frozen_gathered) from the base
   model's whole layout (lg_real), packing the linear weights in NF4 under --quantize. */
static int lg_trainer_set_frozen(lg_trainer *tr, const lg_real *base, lg_error *err) {
    for (int r = 0; r < tr->local_ranks; r++) {
        lg_model *m = &tr->ranks[r].model;
        if (m->frozen_gathered) {
            if (lg_trainer_set_frozen_units(tr, r, base, err) != 0) return -1;
            continue;
        }
        for (int i = 0; i < m->frozen_table.n_tensors; i++)
            if (lg_frozen_tensor_set(m, lg_frozen_whole(m), &m->frozen_table.tensors[i], base, err) != 0)
                return -1;
        lg_rank_sync(m->rank);
    }
    return 0;
}

/* The base tensor t of rank 0's frozen model, held at `at`, into out (t->count, lg_real),
   dequantized. */
static int lg_frozen_tensor(const lg_model *m, lg_frozen_at at, const lg_tensor_info *t,
                            lg_real *out, lg_error *err) {
    if (t->packed == LG_DTYPE_F32) {
        lg_copy(&m->exec, lg_buf_of(out), lg_frozen_values(at, t), t->count);
        lg_rank_sync(m->rank);
        return 0;
    }
    lg_quantization q = t->packed == LG_DTYPE_NF4 ? LG_QUANTIZE_NF4 : LG_QUANTIZE_NF4_DQ;
    size_t bytes = lg_nf4_bytes(t->count, q);
    uint8_t *packed = (uint8_t *)LG_MALLOC(bytes + 1);
    if (!packed) return lg_fail(err, "out of host memory reading %s", t->name);
    lg_buf src = {(uint8_t *)at.packed.data + t->offset, LG_DTYPE_U8};
    lg_rank_bytes(&m->exec, src, packed, bytes, 1);
    lg_nf4_dequantize(NULL, packed, t->count, q, lg_buf_of(out));
    LG_FREE(packed);
    return 0;
}

/* The base weight an adapter (its A's name) adds to, and its first output row there. */
static int lg_lora_base_of(const lg_config *c, const char *adapter, char *base, size_t cap, int *row) {
    int l, used = 0, llama = c->mlp_class_name == LG_MLP_LLAMA;
    *row = 0;
    if (strcmp(adapter, "lm_head.lora_A") == 0) return lg_format(base, cap, "lm_head.weight"), 0;
    if (sscanf(adapter, "transformer.h.%d.%n", &l, &used) != 1 || !used) return -1;
    for (int k = 0; k < LG_LORA_BLOCK_LINEARS; k++) {
        size_t len = strlen(lg_lora_linear_names[llama][k]);
        if (len && strncmp(adapter + used, lg_lora_linear_names[llama][k], len) == 0 &&
            strcmp(adapter + used + len, ".lora_A") == 0) {
            lg_format(base, cap, "transformer.h.%d.%s", l, lg_lora_base_weights[llama][k]);
            *row = lg_lora_first_row(c, (lg_lora_linear)k);
            return 0;
        }
    }
    return -1;
}

/* w (t's rows, cols) += (alpha / r) B A for every adapter of base tensor t; adapters: the whole
   trainable layout (lg_real), described by table (A then B, in layout order). */
static void lg_merge_adapters(const lg_config *c, const lg_tensor_table *table,
                              const lg_real *adapters, const lg_tensor_info *t, lg_real *w) {
    int r = c->lora.r;
    float scale = lg_lora_scale(c);
    for (int k = 0; k + 1 < table->n_tensors; k++) {
        const lg_tensor_info *A = &table->tensors[k], *B = &table->tensors[k + 1];
        char base[LG_MAX_NAME];
        int row;
        if (A->kind != LG_TENSOR_LORA_A || lg_lora_base_of(c, A->name, base, sizeof base, &row) != 0 ||
            strcmp(base, t->name) != 0)
            continue;
        const lg_real *a = adapters + A->origin, *b = adapters + B->origin;
        LG_OMP(omp parallel for)
        for (int o = 0; o < B->rows; o++)
            for (int i = 0; i < t->cols; i++) {
                double sum = 0;
                for (int j = 0; j < r; j++) sum += (double)b[(size_t)o * r + j] * a[(size_t)j * t->cols + i];
                w[(size_t)(row + o) * t->cols + i] += (lg_real)(scale * sum);
            }
    }
}

/* DIR's model.safetensors, config.json and model_config.yaml: the base model with every adapter
   merged (W + (alpha / r) B A; NF4 weights dequantized first), in dtype (the base's files'
   type when it was loaded: an F32 base stays F32 whatever the training precision): a model
   of its own for --load here or in Python. digests: three. With `bring` (frozen_gathered), the
   frozen tensors come unit by unit from it: it gathers frozen unit u on every rank and gives
   where rank 0 holds it; every other process brings each unit in order meanwhile. */
static int lg_write_merged_model(const lg_model *m0, const lg_real *adapters, lg_dtype dtype,
                                 lg_frozen_at (*bring)(void *, int), void *bring_ctx,
                                 const char *dir, lg_file_digest *digests, lg_error *err) {
    lg_model merged;
    memset(&merged, 0, sizeof merged);
    merged.cfg = lg_config_base(&m0->cfg);
    if (lg_table_alloc(&merged.param_table, &merged.cfg) != 0) return lg_fail(err, "out of host memory");
    merged.n_params = lg_params_layout(&merged.cfg, lg_no_buf(), NULL, &merged.param_table);
    merged.params.dtype = dtype;
    merged.params.data = LG_MALLOC(merged.n_params * lg_elem_size(merged.params.dtype) + 1);
    lg_real *w = NULL;
    size_t largest = 0;
    for (int i = 0; i < m0->frozen_table.n_tensors; i++)
        largest = m0->frozen_table.tensors[i].count > largest ? m0->frozen_table.tensors[i].count : largest;
    w = (lg_real *)LG_MALLOC(largest * sizeof(lg_real) + 1);
    int rc = 0;
    if (!merged.params.data || !w) rc = lg_fail(err, "out of host memory for the merged model");
    lg_frozen_at at = lg_frozen_whole(m0);
    for (int i = 0, held = -1; i < m0->frozen_table.n_tensors; i++) {
        const lg_tensor_info *t = &m0->frozen_table.tensors[i];
        if (bring && t->block + 1 != held) at = bring(bring_ctx, held = t->block + 1);
        if (rc != 0) continue; /* the other processes' gathers go on */
        if ((rc = lg_frozen_tensor(m0, at, t, w, err)) != 0) continue;
        lg_merge_adapters(&m0->cfg, &m0->param_table, adapters, t, w);
        lg_copy(NULL, lg_at(merged.params, t->origin), lg_buf_of(w), t->count);
    }
    if (rc == 0) rc = lg_hf_write_model(&merged, dir, digests, err);
    LG_FREE(w);
    LG_FREE(merged.params.data);
    lg_tensor_table_free(&merged.param_table);
    return rc;
}

/* --- run settings: what a resumed run takes from its checkpoint (LG_RUN_SETTINGS) ---------- */

typedef enum { LG_RUN_INT, LG_RUN_FLOAT, LG_RUN_U64, LG_RUN_DRIVER, LG_RUN_OUT } lg_run_kind;

/* One table that the writer, the reader and the resume check walk. model: a resumed run
   that changed it would train another model than the checkpoint's. Enums are stored as
   their numbers (lg_args' enum fields are int-sized). Not recorded: what belongs to the
   machine or the session (backend, measured memory, processes, --plan, --log). A driver's
   setting (LG_RUN_DRIVER: not in lg_args) keeps its place in the file: its line's text comes
   from lg_args.driver_value and goes back to the driver as text (lg_run_settings_driver), as
   does out_dir's (LG_RUN_OUT), the directory lg_checkpoint_save writes under. */
#define LG_RUN_FIELD(field, kind, model, lo, hi) \
    {#field, offsetof(lg_args, field), kind, model, lo, hi}
#define LG_RUN_DRIVER_FIELD(key) {#key, 0, LG_RUN_DRIVER, 0, 0, 0}
#define LG_RUN_KEPT_AS_TEXT(kind) ((kind) == LG_RUN_DRIVER || (kind) == LG_RUN_OUT)
static const struct {
    const char *key;
    size_t offset; /* in lg_args */
    lg_run_kind kind;
    int model;
    double lo, hi; /* LG_RUN_INT: lo .. hi; LG_RUN_FLOAT: finite, at least lo, below hi */
} lg_run_fields[] = {
    LG_RUN_DRIVER_FIELD(config), /* the model itself: config.json */
    LG_RUN_DRIVER_FIELD(data),
    LG_RUN_DRIVER_FIELD(val_data),
    LG_RUN_DRIVER_FIELD(prompt),
    {"out_dir", 0, LG_RUN_OUT, 0, 0, 0},
    LG_RUN_FIELD(micro_batch_size, LG_RUN_INT, 0, 1, INT_MAX),
    LG_RUN_FIELD(global_batch_size, LG_RUN_INT, 1, 0, INT_MAX),
    LG_RUN_FIELD(max_seq_length, LG_RUN_INT, 1, 0, INT_MAX),
    LG_RUN_FIELD(precision, LG_RUN_INT, 1, 0, LG_PRECISION_BF16_MIXED),
    LG_RUN_FIELD(devices, LG_RUN_INT, 0, 1, LG_MAX_RANKS),
    LG_RUN_FIELD(nodes, LG_RUN_INT, 0, 1, LG_MAX_RANKS),
    LG_RUN_FIELD(strategy, LG_RUN_INT, 0, 0, LG_STRATEGY_HYBRID_SHARD),
    LG_RUN_FIELD(optimizer, LG_RUN_INT, 1, 0, LG_OPTIMIZER_SOPHIA),
    LG_RUN_FIELD(optimizer_state, LG_RUN_INT, 1, 0, LG_STATE_8BIT),
    LG_RUN_FIELD(seed, LG_RUN_U64, 1, 0, 0),
    LG_RUN_FIELD(lora.r, LG_RUN_INT, 1, 0, INT_MAX),
    LG_RUN_FIELD(lora.alpha, LG_RUN_FLOAT, 1, 0, INFINITY),
    LG_RUN_FIELD(lora.dropout, LG_RUN_FLOAT, 1, 0, 1),
    LG_RUN_FIELD(lora.targets, LG_RUN_INT, 1, 0, LG_LORA_HEAD * 2 - 1),
    LG_RUN_FIELD(lora.quantize, LG_RUN_INT, 1, 0, LG_QUANTIZE_NF4_DQ),
    LG_RUN_FIELD(eps, LG_RUN_FLOAT, 1, 0, INFINITY),
    LG_RUN_FIELD(lr, LG_RUN_FLOAT, 0, 0, INFINITY),
    LG_RUN_FIELD(min_lr, LG_RUN_FLOAT, 0, 0, INFINITY),
    LG_RUN_FIELD(warmup_steps, LG_RUN_INT, 0, 0, INT_MAX),
    LG_RUN_FIELD(weight_decay, LG_RUN_FLOAT, 0, 0, INFINITY),
    LG_RUN_FIELD(beta1, LG_RUN_FLOAT, 0, 0, 1),
    LG_RUN_FIELD(beta2, LG_RUN_FLOAT, 0, 0, 1),
    LG_RUN_FIELD(momentum, LG_RUN_FLOAT, 0, 0, 1),
    LG_RUN_FIELD(max_norm, LG_RUN_FLOAT, 0, 0, INFINITY),
    LG_RUN_FIELD(hessian_interval, LG_RUN_INT, 0, 1, INT_MAX),
    LG_RUN_FIELD(rho, LG_RUN_FLOAT, 0, FLT_MIN, INFINITY),
    LG_RUN_FIELD(max_steps, LG_RUN_INT, 0, 0, INT_MAX),
    LG_RUN_DRIVER_FIELD(eval_every),
    LG_RUN_DRIVER_FIELD(eval_iters),
    LG_RUN_DRIVER_FIELD(sample_every),
    LG_RUN_DRIVER_FIELD(sample_tokens),
    LG_RUN_DRIVER_FIELD(temperature),
    LG_RUN_DRIVER_FIELD(save_every),
    LG_RUN_FIELD(recompute, LG_RUN_INT, 0, 0, 1),
    LG_RUN_FIELD(offload, LG_RUN_INT, 0, 0, 1),
    LG_RUN_FIELD(tf32, LG_RUN_INT, 0, 0, 1),
    LG_RUN_DRIVER_FIELD(memory_limit),
    LG_RUN_FIELD(pack, LG_RUN_INT, 1, 0, 1), /* the rows the data order makes */
    LG_RUN_FIELD(head_rows, LG_RUN_INT, 0, 0, INT_MAX), /* the head's chunks: the same loss
                                                           to rounding */
    LG_RUN_FIELD(slice_rows, LG_RUN_INT, 0, 0, INT_MAX), /* the MLP's slices: the same */
};
#define LG_N_RUN_FIELDS ((int)(sizeof lg_run_fields / sizeof lg_run_fields[0]))
typedef char lg_run_enums_are_ints[sizeof(lg_precision) == sizeof(int) ? 1 : -1];

/* Field i of a's settings as its line's value. */
static void lg_run_field_text(const lg_args *a, int i, char *out, size_t cap) {
    const unsigned char *at = (const unsigned char *)a + lg_run_fields[i].offset;
    int v_int;
    float v_float;
    uint64_t v_u64;
    switch (lg_run_fields[i].kind) {
    case LG_RUN_INT: memcpy(&v_int, at, sizeof v_int); lg_format(out, cap, "%d", v_int); break;
    case LG_RUN_FLOAT:
        memcpy(&v_float, at, sizeof v_float);
        lg_format(out, cap, "%.9g", (double)v_float); /* exact for a float */
        break;
    case LG_RUN_U64: memcpy(&v_u64, at, 8); lg_format(out, cap, "%llu", (unsigned long long)v_u64); break;
    case LG_RUN_DRIVER: case LG_RUN_OUT: lg_format(out, cap, "%s", ""); break; /* not in a */
    }
}

/* The value of line i of LG_RUN_SETTINGS for a's run saved under out_dir, into out: a field of
   a, out_dir, or the driver's setting (NULL: the driver has none, no line); "" for none, or
   for text that would break the line. */
static const char *lg_run_line_value(const lg_args *a, int i, const char *out_dir, char *out,
                                     size_t cap) {
    const char *v = out;
    if (lg_run_fields[i].kind == LG_RUN_OUT) lg_format(out, cap, "%s", out_dir ? out_dir : "");
    else if (lg_run_fields[i].kind != LG_RUN_DRIVER) lg_run_field_text(a, i, out, cap);
    else v = a->driver_value ? a->driver_value(lg_run_fields[i].key, a->driver_context, out, cap)
                             : NULL;
    if (v && strchr(v, '\n')) lg_format(out, cap, "%s", "");
    return v;
}

/* Field i of a's settings from its line's value. */
static int lg_run_field_parse(lg_args *a, int i, const char *value) {
    unsigned char *at = (unsigned char *)a + lg_run_fields[i].offset;
    char *end = NULL;
    errno = 0;
    switch (lg_run_fields[i].kind) {
    case LG_RUN_INT: {
        long v = strtol(value, &end, 10);
        int v_int = (int)v;
        if (v < INT_MIN || v > INT_MAX) return -1;
        memcpy(at, &v_int, sizeof v_int);
        break;
    }
    case LG_RUN_FLOAT: {
        float v = strtof(value, &end);
        memcpy(at, &v, sizeof v);
        break;
    }
    case LG_RUN_U64: {
        uint64_t v_u64 = strtoull(value, &end, 10);
        memcpy(at, &v_u64, 8);
        break;
    }
    case LG_RUN_DRIVER: case LG_RUN_OUT: return -1; /* not in a: lg_run_settings_line keeps
                                                       its text */
    }
    return !end || end == value || *end || errno ? -1 : 0;
}

/* Field i of a within its range of the table (texts and 64-bit numbers: any value); else fails
   naming the file (path) and the field. */
static int lg_run_field_check(const lg_args *a, int i, const char *path, lg_error *err) {
    const unsigned char *at = (const unsigned char *)a + lg_run_fields[i].offset;
    double lo = lg_run_fields[i].lo, hi = lg_run_fields[i].hi;
    const char *key = lg_run_fields[i].key;
    int v_int;
    float v_float;
    if (lg_run_fields[i].kind == LG_RUN_INT) {
        memcpy(&v_int, at, sizeof v_int);
        if (v_int < lo || v_int > hi)
            return lg_fail(err, "%s: %s %d is out of range: expected %.0f to %.0f", path, key,
                           v_int, lo, hi);
    }
    if (lg_run_fields[i].kind != LG_RUN_FLOAT) return 0;
    memcpy(&v_float, at, sizeof v_float);
    if (!isfinite(v_float) || v_float < lo || v_float >= hi) {
        char below[48] = "";
        if (isfinite(hi)) lg_format(below, sizeof below, " and below %g", hi);
        return lg_fail(err, "%s: %s %g is out of range: expected a finite number at least %g%s",
                       path, key, (double)v_float, lo, below);
    }
    return 0;
}

/* LoRA: FNV-1a of rank 0's frozen base as it holds it (each tensor's stored bytes: the weight
   type, or NF4 under --quantize), computed once after the base last changed;
   frozen_gathered: hashed unit by unit whenever the base is set (lg_trainer_set_frozen_units,
   lg_trainer_init_frozen_units), so base_hashed. */
static uint64_t lg_trainer_base_hash(lg_trainer *tr) {
    if (tr->base_hashed) return tr->base_hash;
    const lg_model *m = &tr->ranks[0].model;
    uint64_t h = LG_HASH64_INIT;
    lg_rank_sync(m->rank);
    for (int i = 0; i < m->frozen_table.n_tensors; i++)
        h = lg_frozen_tensor_hash(h, m, lg_frozen_whole(m), &m->frozen_table.tensors[i]);
    tr->base_hash = h;
    tr->base_hashed = 1;
    return h;
}

/* DIR/LG_RUN_SETTINGS of the trainer's run (out_dir: out, the directory it saves under; data:
   its training data, whose identity is recorded). */
static int lg_run_settings_write(lg_trainer *tr, const lg_loader *data, const char *out,
                                 const char *dir, lg_file_digest *digest, lg_error *err) {
    size_t cap = (size_t)LG_N_RUN_FIELDS * 64 + (LG_RUN_DRIVER_FIELDS + 2) * LG_PATH_MAX;
    char *text = (char *)LG_MALLOC(cap), value[LG_PATH_MAX], path[LG_PATH_MAX + 32];
    if (!text) return lg_fail(err, "out of host memory for " LG_RUN_SETTINGS);
    lg_args a = tr->args;
    size_t at = 0;
    a.global_batch_size = a.micro_batch_size * tr->accumulation * tr->n_ranks; /* as run */
    lg_st_append(text, cap, &at, "# litgpt.c run settings 1\n");
    for (int i = 0; i < LG_N_RUN_FIELDS; i++)
        if (lg_run_line_value(&a, i, out, value, sizeof value))
            lg_st_append(text, cap, &at, "%s %s\n", lg_run_fields[i].key, value);
    if (tr->plan.cfg.lora.r > 0) {
        int loaded = tr->base_loaded && !strchr(tr->base_model, '\n');
        lg_st_append(text, cap, &at, "base_model %s%s%s\n", loaded ? "load" : "random",
                     loaded ? " " : "", loaded ? tr->base_model : "");
        lg_st_append(text, cap, &at, "base_hash %016llx\n", (unsigned long long)lg_trainer_base_hash(tr));
    }
    if (data)
        lg_st_append(text, cap, &at, "data_bytes %llu\ndata_hash %016llx\n",
                     (unsigned long long)data->file_bytes, (unsigned long long)data->file_hash);
    lg_format(path, sizeof path, "%s/" LG_RUN_SETTINGS, dir);
    int rc = lg_write_text_file(path, text, digest, err);
    LG_FREE(text);
    return rc;
}

/* A whole unsigned number of that base (digits only) into *v; *seen set. 0, or -1 when not. */
static int lg_run_u64_parse(const char *value, int base, uint64_t *v, int *seen) {
    char *end;
    errno = 0;
    unsigned long long x = strtoull(value, &end, base);
    if (end == value || *end || errno || !isxdigit((unsigned char)value[0])) return -1;
    *v = x;
    *seen = 1;
    return 0;
}

/* The line of the driver's setting number `driver` (in the table's order): its text, kept for
   the driver; -1 when it does not fit. */
static int lg_run_driver_line(lg_run_settings *s, int driver, const char *value) {
    if (driver >= LG_RUN_DRIVER_FIELDS || strlen(value) >= sizeof s->driver_text[driver]) return -1;
    lg_format(s->driver_text[driver], sizeof s->driver_text[driver], "%s", value);
    s->driver_given[driver] = 1;
    return 0;
}

const char *lg_run_settings_driver(const lg_run_settings *s, const char *key) {
    for (int i = 0, driver = 0; i < LG_N_RUN_FIELDS; i++) {
        if (!LG_RUN_KEPT_AS_TEXT(lg_run_fields[i].kind)) continue;
        if (strcmp(lg_run_fields[i].key, key) == 0 && driver < LG_RUN_DRIVER_FIELDS)
            return s->driver_given[driver] ? s->driver_text[driver] : NULL;
        driver++;
    }
    return NULL;
}

/* One line of LG_RUN_SETTINGS: a setting, or the base's and the data's lines. */
static int lg_run_settings_line(lg_run_settings *s, char *line) {
    char *space = strchr(line, ' ');
    if (!space) return -1;
    *space = '\0';
    const char *value = space + 1;
    if (strcmp(line, "base_model") == 0) {
        s->has_base = 1;
        s->base_loaded = strncmp(value, "load ", 5) == 0;
        if (!s->base_loaded && strcmp(value, "random") != 0) return -1;
        lg_format(s->base_text, sizeof s->base_text, "%s", s->base_loaded ? value + 5 : "");
        s->base_dir = s->base_loaded ? s->base_text : NULL;
        return 0;
    }
    if (strcmp(line, "base_hash") == 0) return lg_run_u64_parse(value, 16, &s->base_hash, &s->has_base_hash);
    if (strcmp(line, "data_bytes") == 0) return lg_run_u64_parse(value, 10, &s->data_bytes, &s->has_data);
    if (strcmp(line, "data_hash") == 0) return lg_run_u64_parse(value, 16, &s->data_hash, &s->has_data);
    for (int i = 0, driver = 0; i < LG_N_RUN_FIELDS; i++) {
        int is_driver = LG_RUN_KEPT_AS_TEXT(lg_run_fields[i].kind);
        if (strcmp(line, lg_run_fields[i].key) == 0 && is_driver)
            return lg_run_driver_line(s, driver, value);
        if (strcmp(line, lg_run_fields[i].key) == 0) return lg_run_field_parse(&s->args, i, value);
        driver += is_driver;
    }
    return 0; /* a setting of a later version: not ours */
}

int lg_run_settings_read(const char *dir, lg_run_settings *s, lg_error *err) {
    char path[LG_PATH_MAX + 32];
    struct stat st;
    memset(s, 0, sizeof *s);
    lg_args_default(&s->args);
    lg_format(path, sizeof path, "%s/" LG_RUN_SETTINGS, dir);
    if (stat(path, &st) != 0) return 1;
    if (lg_checkpoint_verify_file(dir, LG_RUN_SETTINGS, err) != 0) return -1;
    char *text = lg_read_text_file(path, 1 << 20, NULL, err);
    if (!text) return -1;
    int rc = 0, line_no = 0;
    char *at = text;
    for (char *line; rc == 0 && (line = lg_take_line(&at));) {
        line_no++;
        if (line[0] != '#' && line[0] && lg_run_settings_line(s, line) != 0)
            rc = lg_fail(err, "%s: line %d ('%s') is malformed", path, line_no, line);
    }
    LG_FREE(text);
    for (int i = 0; i < LG_N_RUN_FIELDS && rc == 0; i++)
        rc = lg_run_field_check(&s->args, i, path, err);
    if (rc == 0 && lg_args_check(&s->args, err) != 0) {
        char why[sizeof err->msg];
        lg_format(why, sizeof why, "%s", err->msg);
        rc = lg_fail(err, "%s: settings that do not go together: %s", path, why);
    }
    return rc;
}

const char *lg_args_resume_conflict(const lg_args *run, const lg_args *now) {
    char a[LG_PATH_MAX], b[LG_PATH_MAX];
    for (int i = 0; i < LG_N_RUN_FIELDS; i++) {
        if (!lg_run_fields[i].model) continue;
        lg_run_field_text(run, i, a, sizeof a);
        lg_run_field_text(now, i, b, sizeof b);
        if (strcmp(a, b) != 0) return lg_run_fields[i].key;
    }
    return NULL;
}

int lg_checkpoint_same_data(const char *dir, const lg_loader *data, lg_error *err) {
    lg_run_settings *s = (lg_run_settings *)LG_MALLOC(sizeof *s);
    if (!s) return lg_fail(err, "out of host memory");
    int rc = lg_run_settings_read(dir, s, err);
    if (rc == 0 && s->has_data && (s->data_bytes != data->file_bytes || s->data_hash != data->file_hash))
        rc = lg_fail(err, "data %s: not the data checkpoint %s was trained on (%llu bytes, hash "
                          "%016llx; the run's: %llu bytes, hash %016llx, in its " LG_RUN_SETTINGS ")",
                     data->path, dir, (unsigned long long)data->file_bytes,
                     (unsigned long long)data->file_hash, (unsigned long long)s->data_bytes,
                     (unsigned long long)s->data_hash);
    LG_FREE(s);
    return rc < 0 ? -1 : 0;
}

/* LoRA: the adapters of checkpoint dir were trained over the base of hash `hash` (ours names
   it: "this run's base DIR"), by LG_RUN_SETTINGS' base_hash; -1 naming both bases when not, or
   when the checkpoint records no hash. Resume and tools/generate check so. */
static int lg_adapters_same_base(const char *dir, uint64_t hash, const char *ours, lg_error *err) {
    lg_run_settings *s = (lg_run_settings *)LG_MALLOC(sizeof *s);
    if (!s) return lg_fail(err, "out of host memory");
    int rc = lg_run_settings_read(dir, s, err);
    char recorded[LG_PATH_MAX + 64];
    lg_format(recorded, sizeof recorded, "%s", !s->has_base ? "(not recorded)"
                                              : s->base_loaded ? s->base_dir : "one drawn at random");
    if (rc == 1 || (rc == 0 && !s->has_base_hash))
        rc = lg_fail(err, "checkpoint %s: no base_hash in " LG_RUN_SETTINGS ": it does not say "
                          "which base its adapters were trained over, so they are not applied "
                          "to %s", dir, ours);
    else if (rc == 0 && s->base_hash != hash)
        rc = lg_fail(err, "checkpoint %s: its adapters were trained over base %s (hash %016llx), "
                          "%s has hash %016llx", dir, recorded, (unsigned long long)s->base_hash,
                     ours, (unsigned long long)hash);
    LG_FREE(s);
    return rc;
}

/* LoRA: the checkpoint's adapters were trained over the trainer's base, by base_hash. */
static int lg_checkpoint_same_base(lg_trainer *tr, const char *dir, lg_error *err) {
    if (tr->plan.cfg.lora.r == 0) return 0;
    char ours[LG_PATH_MAX + 64];
    lg_format(ours, sizeof ours, "this run's base%s%s", tr->base_loaded ? " " : ", ",
              tr->base_loaded ? tr->base_model : "one drawn at random,");
    return lg_adapters_same_base(dir, lg_trainer_base_hash(tr), ours, err);
}

/* LoRA: FNV-1a of the base model `whole` (its whole layout, lg_real) as a run of cfg (its
   adapters' targets and --quantize) with weight type `weights` holds it frozen: each tensor's
   stored bytes in the frozen table's order, the weight type or NF4 (the bytes
   lg_trainer_base_hash reads from a trainer). */
static int lg_base_hash_of(const lg_config *cfg, lg_dtype weights, const lg_real *whole,
                           uint64_t *hash, lg_error *err) {
    lg_tensor_table table;
    if (lg_table_alloc(&table, cfg) != 0) return lg_fail(err, "out of host memory");
    lg_frozen_layout(cfg, lg_no_buf(), lg_no_buf(), NULL, &table, NULL);
    size_t widest = 0;
    for (int i = 0; i < table.n_tensors; i++)
        widest = table.tensors[i].count > widest ? table.tensors[i].count : widest;
    lg_buf stored = {LG_MALLOC(widest * sizeof(lg_real) + 1), weights}; /* one tensor's bytes */
    int rc = stored.data ? 0 : lg_fail(err, "out of host memory hashing the base");
    *hash = LG_HASH64_INIT;
    for (int i = 0; i < table.n_tensors && rc == 0; i++) {
        const lg_tensor_info *t = &table.tensors[i];
        lg_buf values = lg_buf_of((lg_real *)whole + t->origin);
        size_t bytes = t->count * lg_elem_size(weights);
        if (t->packed != LG_DTYPE_F32) {
            bytes = lg_nf4_bytes(t->count, cfg->lora.quantize);
            rc = lg_nf4_quantize(values, t->count, cfg->lora.quantize, (uint8_t *)stored.data, err);
        } else {
            lg_copy(NULL, stored, values, t->count);
        }
        *hash = lg_hash64(*hash, stored.data, bytes);
    }
    LG_FREE(stored.data);
    lg_tensor_table_free(&table);
    return rc;
}

/* 14. trainer --------------------------------------------------------------------------------- */

/* One optimizer step, top-down. lg_trainer_step makes these calls in this order; those marked
   "one rank: nothing" return at once when one rank holds the whole model (their collectives
   have nobody to talk to):

     lg_trainer_read_step              every micro-batch of every rank into the token buffers,
                                       the step's targets counted (the loss is their mean)
     lg_trainer_hessian_pass           Sophia, every hessian_interval steps: a forward and
                                       backward on labels drawn from the model (else nothing)
     lg_trainer_accumulate             the gradients of the step, micro-batch by micro-batch:
       lg_trainer_set_micro_step         LoRA dropout's masks of the micro-batch, the scale the
                                         classifier writes the logits' gradient at
       lg_trainer_forward                unit by unit: lg_trainer_gather_unit and
                                         lg_trainer_await_unit (full-shard; one rank: nothing),
                                         then the unit's forward on every rank
       lg_trainer_backward               unit by unit in reverse: gather again,
                                         lg_trainer_open_unit_grads, the unit's backward,
                                         lg_trainer_start_reduce and lg_trainer_finish_reduce
                                         (sharded gradients; one rank: nothing),
                                         lg_trainer_send_unit_grads (--offload gradients),
                                         lg_trainer_offload_unit (--offload, last micro-batch),
                                         lg_trainer_scatter_embedding_grads (a token table
                                         trained on the host; else nothing)
       lg_comm_sum_doubles               the losses of other processes' ranks (one process:
                                         nothing)
       lg_trainer_sync_replicas          all-reduce over replicas (no-shard, hybrid-shard; one
                                         rank: nothing)
     lg_trainer_grad_norm              the global gradient norm (other processes' squares
                                       gathered first; one process: only the sum)
     lg_trainer_check_ranks            a GPU that stopped on a failure its op could not return
                                       (cuBLASLt out of memory): the step ends there, its
                                       error that failure's line, nothing updated
     lg_trainer_update                 the loss scaler's skip, or on every rank:
       lg_trainer_offload_grads          --offload: the gradient shard to the host
       lg_trainer_update_rank            the optimizer on the rank's shard (on the host with
                                         --offload)
       lg_trainer_share_updated_weights  shard-grad-op: all-gather the updated pieces (one
                                         rank: nothing)
     lg_trainer_sync                   waits for every rank's queued work

   The functions follow in about that order, after the step. */

/* What one rank computes in a micro-step: B samples of T tokens; B = 0: nothing, the rank only
   takes part in the collectives. */
typedef struct {
    const int *inputs;  /* (B, T) */
    const int *targets; /* (B, T), or NULL: logits only */
    const int *span_start; /* (B, T): packed rows' span starts (lg_model_set_spans), or NULL */
    int B, T;
} lg_micro_batch;

static long lg_trainer_read_step(lg_trainer *tr, lg_loader *train, lg_error *err);
static void lg_trainer_hessian_pass(lg_trainer *tr, int step);
static double lg_trainer_accumulate(lg_trainer *tr, int step, long n_targets,
                                    int offload_in_backward);
static float lg_trainer_grad_norm(lg_trainer *tr);
static int lg_trainer_check_ranks(const lg_trainer *tr, lg_error *err);
static int lg_trainer_update(lg_trainer *tr, int step, lg_step_stats *stats,
                             int offload_in_backward, lg_error *err);
static void lg_trainer_sync(const lg_trainer *tr);

int lg_trainer_step(lg_trainer *tr, lg_loader *train, int step, lg_step_stats *stats,
                    lg_error *err) {
    double start = lg_time_ms();
    stats->diverged = 0;
    if (train->T > tr->ranks[0].model.T)
        return lg_fail(err, "data %s: rows of %d tokens, but the trainer was made for %d",
                       train->path, train->T, tr->ranks[0].model.T);
    /* every micro-batch first: the loss is the mean over all targets of the step */
    long n_targets = lg_trainer_read_step(tr, train, err);
    if (n_targets < 0) return -1;
    stats->hessian = tr->ranks[0].sampled && step % tr->args.hessian_interval == 0;
    if (stats->hessian) lg_trainer_hessian_pass(tr, step);
    /* --offload with no replicas: the last backward sends gradients to the host as it goes */
    int offload_in_backward = tr->ranks[0].host_grads.data != NULL &&
                              tr->plan.sharding.replicas == 1 && !tr->plan.spec.offload_gradients;
    double loss_sum = lg_trainer_accumulate(tr, step, n_targets, offload_in_backward);
    stats->loss = n_targets ? loss_sum / n_targets : 0;
    stats->loss_scale = tr->loss_scale;
    stats->n_targets = n_targets;
    stats->lr = lg_learning_rate(&tr->args, step);
    stats->grad_norm = lg_trainer_grad_norm(tr) / tr->loss_scale;
    stats->out_of_memory = lg_trainer_check_ranks(tr, err) != 0;
    if (stats->out_of_memory) return -1;
    if (lg_trainer_update(tr, step, stats, offload_in_backward, err) != 0) return -1;
    lg_trainer_sync(tr);
    stats->ms = lg_time_ms() - start; /* with Sophia's extra pass when it ran */
    stats->tokens_per_s = (double)tr->step_tokens / (stats->ms / 1e3);
    return 0;
}


int lg_evaluate(lg_model *m, lg_loader *ld, int B, int T, int n_batches, double *mean_loss,
                lg_error *err) {
    *mean_loss = 0;
    /* the plan's token buffers hold at least one micro-batch */
    int *inputs = (int *)lg_rank_region(m->rank, LG_REGION_TOKENS_INPUTS);
    int *targets = (int *)lg_rank_region(m->rank, LG_REGION_TOKENS_TARGETS);
    if (!inputs || !targets) return lg_fail(err, "evaluation: the plan has no token buffers");
    if (B > m->B || T > m->T || ld->T > T)
        return lg_fail(err, "evaluation of %s: micro-batch %d x %d tokens (rows of %d) does "
                            "not fit the model's %d x %d", ld->path, B, T, ld->T, m->B, m->T);
    lg_loader_rewind(ld);
    double sum = 0;
    long count = 0;
    int rc = 0;
    for (int i = 0; i < n_batches && rc == 0; i++) {
        int batch_T = 0; /* data issue: samples are padded to the longest of the batch */
        rc = lg_loader_next_batch(ld, B, inputs, targets, &batch_T, err);
        int n = 0;
        if (rc == 0) sum += lg_model_forward(m, inputs, targets, B, batch_T, &n);
        count += n;
    }
    *mean_loss = count ? sum / count : 0;
    return rc;
}

static void lg_trainer_bind_rank(lg_trainer *tr, lg_trainer_rank *tr_r) {
    lg_precision_types types = lg_types_of(tr->args.precision);
    tr_r->inputs = (int *)lg_rank_region(&tr_r->rank, LG_REGION_TOKENS_INPUTS);
    tr_r->targets = (int *)lg_rank_region(&tr_r->rank, LG_REGION_TOKENS_TARGETS);
    tr_r->sampled = (int *)lg_rank_region(&tr_r->rank, LG_REGION_TOKENS_SAMPLED);
    tr_r->spans = (int *)lg_rank_region(&tr_r->rank, LG_REGION_TOKENS_SPANS);
    tr_r->host_grads = lg_rank_view(&tr_r->rank, LG_REGION_GRADIENTS_HOST, types.grads);
    tr_r->host_weights = lg_rank_view(&tr_r->rank, LG_REGION_WEIGHTS_HOST, types.weights);
    tr_r->gather_ends = lg_rank_view(&tr_r->rank, LG_REGION_GATHER_ENDS, types.weights);
    tr_r->gather_blocks = lg_rank_view(&tr_r->rank, LG_REGION_GATHER_BLOCKS, types.weights);
    tr_r->grad_ends = lg_rank_view(&tr_r->rank, LG_REGION_GRADIENTS_ENDS, types.grads);
    tr_r->grad_blocks = lg_rank_view(&tr_r->rank, LG_REGION_GRADIENTS_BLOCKS, types.grads);
    tr_r->reduce_out = lg_rank_view(&tr_r->rank, LG_REGION_REDUCE_SCATTER_OUT, types.grads);
    tr_r->frozen_gather_ends = lg_rank_view(&tr_r->rank, LG_REGION_GATHER_FROZEN_ENDS, LG_DTYPE_U8);
    tr_r->frozen_gather_blocks = lg_rank_view(&tr_r->rank, LG_REGION_GATHER_FROZEN_BLOCKS,
                                              LG_DTYPE_U8);
}

/* Elements of unit u padded to S pieces: the size of its gathered and gradient buffers. */
static size_t lg_padded_unit(const lg_shard_layout *sl, int u) {
    return sl->piece_count[u] * (size_t)sl->n_shards;
}

/* The slots of the collective buffers (LG_GATHER_BLOCK_SLOTS): slot 0 is the ends' buffer,
   slots 1 .. block_slots the blocks', which the blocks take in turn. A slot is also the signal
   of the collective that fills it: an all-gather raises LG_SIGNAL_GATHER + its gather slot, a
   reduce-scatter LG_SIGNAL_REDUCE + its gradient slot, a frozen unit's all-gather
   LG_SIGNAL_FROZEN + its gather slot (LG_COMM_SIGNALS in all). */
enum {
    LG_SIGNAL_GATHER = 0,
    LG_SIGNAL_REDUCE = 1 + LG_GATHER_BLOCK_SLOTS,
    LG_SIGNAL_FROZEN = LG_SIGNAL_REDUCE + 1 + LG_GRAD_BLOCK_SLOTS
};

/* The slot of unit u among the ends' (0) and block_slots blocks' buffers of one kind. */
static int lg_unit_slot(int u, int block_slots) { return u == 0 ? 0 : 1 + (u - 1) % block_slots; }

/* Slot `slot` of one kind of buffer: the ends' buffer, or a block slot of the blocks'. */
static lg_buf lg_slot_buffer(const lg_trainer *tr, lg_buf ends, lg_buf blocks, int slot) {
    if (slot == 0) return ends;
    return lg_at(blocks, (size_t)(slot - 1) * lg_padded_unit(&tr->plan.shards, 1));
}

/* The signal of unit u's all-gather, and of its reduce-scatter. */
static int lg_gather_signal(const lg_trainer *tr, int u) {
    return LG_SIGNAL_GATHER + lg_unit_slot(u, tr->block_slots);
}
static int lg_reduce_signal(int u) {
    return LG_SIGNAL_REDUCE + lg_unit_slot(u, LG_GRAD_BLOCK_SLOTS);
}

/* Where rank r's gathered weights of unit u go. */
static lg_buf lg_unit_weights(const lg_trainer *tr, int r, int u) {
    const lg_trainer_rank *tr_r = &tr->ranks[r];
    return lg_slot_buffer(tr, tr_r->gather_ends, tr_r->gather_blocks,
                          lg_unit_slot(u, tr->block_slots));
}

/* Where rank r's gradients of unit u wait for their reduce-scatter. */
static lg_buf lg_unit_grads(const lg_trainer *tr, int r, int u) {
    const lg_trainer_rank *tr_r = &tr->ranks[r];
    return lg_slot_buffer(tr, tr_r->grad_ends, tr_r->grad_blocks,
                          lg_unit_slot(u, LG_GRAD_BLOCK_SLOTS));
}

/* The members of a group (ranks first + m stride, m < count) that this process drives: their
   indices in tr->ranks, in member order, into local; returns how many (all without a
   launcher). */
static int lg_trainer_group_local(const lg_trainer *tr, int first, int stride, int count,
                                  int *local) {
    int n = 0;
    for (int m = 0; m < count; m++) {
        int r = first + m * stride - tr->first_rank;
        if (r >= 0 && r < tr->local_ranks) local[n++] = r;
    }
    return n;
}

/* Where rank r's gathered frozen unit u goes (frozen_gathered). */
static uint8_t *lg_frozen_unit_buffer(const lg_trainer *tr, int r, int u) {
    const lg_trainer_rank *tr_r = &tr->ranks[r];
    const lg_shard_layout *sl = &tr->plan.frozen_shards;
    int slot = lg_unit_slot(u, tr->block_slots);
    if (slot == 0) return (uint8_t *)tr_r->frozen_gather_ends.data;
    return (uint8_t *)tr_r->frozen_gather_blocks.data +
           (size_t)(slot - 1) * sl->piece_count[1] * (size_t)sl->n_shards;
}

/* Where rank r's own piece of a gathered unit lies in it: at its place in its shard group. */
static size_t lg_piece_place(const lg_trainer *tr, int r, size_t piece_count) {
    return (size_t)tr->plan.ranks[tr->first_rank + r].shard_index * piece_count;
}

/* LoRA's frozen base sharded: all-gathers frozen unit u as stored (bytes) in every shard group,
   beside the compute until lg_trainer_await_unit; streamed, each rank's piece already lies at
   its place in the gathered unit (lg_trainer_stream_unit), and the gather fills the rest. */
static void lg_trainer_gather_frozen_unit(lg_trainer *tr, int u) {
    const lg_sharding *sh = &tr->plan.sharding;
    const lg_shard_layout *sl = &tr->plan.frozen_shards;
    int S = sh->shard_ranks;
    lg_buf pieces[LG_MAX_RANKS], wholes[LG_MAX_RANKS];
    for (int q = 0; q < sh->replicas; q++) {
        int local[LG_MAX_RANKS], n = lg_trainer_group_local(tr, q * S, 1, S, local);
        for (int i = 0; i < n; i++) {
            lg_buf whole = {lg_frozen_unit_buffer(tr, local[i], u), LG_DTYPE_U8};
            lg_buf stored = {(uint8_t *)tr->ranks[local[i]].model.frozen_shard.data + sl->piece_offset[u],
                             LG_DTYPE_U8};
            wholes[i] = whole;
            pieces[i] = sh->weights_streamed ? lg_at(whole, lg_piece_place(tr, local[i], sl->piece_count[u]))
                                             : stored;
        }
        if (n)
            lg_all_gather_async(tr->shard_comm[q], n, pieces, wholes, sl->piece_count[u],
                                LG_SIGNAL_FROZEN + lg_unit_slot(u, tr->block_slots));
    }
}

/* The copy-beside mark of unit u's gather slot (--offload weights). */
static int lg_weights_mark(const lg_trainer *tr, int u) {
    return LG_BESIDE_WEIGHTS + lg_unit_slot(u, tr->block_slots);
}

/* --offload weights: copies each rank's piece of unit u's weights (and of LoRA's frozen unit
   u) from the host to its place in the unit's slots, beside the compute, after the ops queued
   so far (the slots' last readers among them). One rank: the piece is the whole unit, but
   for a token embedding trained on the host (lg_unit_host_part), which stays there. */
static void lg_trainer_stream_unit(lg_trainer *tr, int u) {
    const lg_shard_layout *sl = &tr->plan.shards, *fl = &tr->plan.frozen_shards;
    int frozen = lg_frozen_sharded(&tr->plan.cfg, &tr->plan.sharding);
    size_t apart = lg_unit_host_part(&tr->plan.cfg, u);
    for (int r = 0; r < tr->local_ranks; r++) {
        lg_model *m = &tr->ranks[r].model;
        lg_buf place = lg_at(lg_unit_weights(tr, r, u), lg_piece_place(tr, r, sl->piece_count[u]));
        lg_copy_beside(&m->exec, place, lg_at(m->params, sl->piece_offset[u] + apart),
                       sl->piece_count[u] - apart);
        if (frozen) {
            lg_buf whole = {lg_frozen_unit_buffer(tr, r, u), LG_DTYPE_U8};
            lg_buf from = {(uint8_t *)m->frozen_shard.data + fl->piece_offset[u], LG_DTYPE_U8};
            lg_copy_beside(&m->exec, lg_at(whole, lg_piece_place(tr, r, fl->piece_count[u])), from,
                           fl->piece_count[u]);
        }
        lg_mark_beside(&m->exec, lg_weights_mark(tr, u));
    }
}

/* Sharded weights: all-gathers unit u's weights in every shard group, beside the compute
   until lg_trainer_await_unit; streamed, each rank's piece already lies at its place in the
   slot (lg_trainer_stream_unit), and the gather fills the rest. */
static void lg_trainer_gather_trainable_unit(lg_trainer *tr, int u) {
    const lg_sharding *sh = &tr->plan.sharding;
    const lg_shard_layout *sl = &tr->plan.shards;
    int S = sh->shard_ranks;
    lg_buf pieces[LG_MAX_RANKS], wholes[LG_MAX_RANKS];
    for (int q = 0; q < sh->replicas; q++) {
        int local[LG_MAX_RANKS], n = lg_trainer_group_local(tr, q * S, 1, S, local);
        for (int i = 0; i < n; i++) {
            wholes[i] = lg_unit_weights(tr, local[i], u);
            pieces[i] = sh->weights_streamed
                            ? lg_at(wholes[i], lg_piece_place(tr, local[i], sl->piece_count[u]))
                            : lg_at(tr->ranks[local[i]].model.params, sl->piece_offset[u]);
        }
        if (n)
            lg_all_gather_async(tr->shard_comm[q], n, pieces, wholes, sl->piece_count[u],
                                lg_gather_signal(tr, u));
    }
}

/* Brings unit u's weights (and LoRA's frozen unit u) into its slots on every rank and points
   the models' views at them, beside the compute until lg_trainer_await_unit(u): streamed
   (--offload weights), each rank's piece is copied from the host; sharded (full-shard,
   hybrid-shard), the shard group all-gathers the pieces. Nothing to do when every rank holds
   whole weights. */
static void lg_trainer_gather_unit(lg_trainer *tr, int u) {
    const lg_sharding *sh = &tr->plan.sharding;
    int frozen = lg_frozen_sharded(&tr->plan.cfg, sh);
    if (!lg_weights_in_units(sh)) return;
    if (sh->weights_streamed) lg_trainer_stream_unit(tr, u);
    if (sh->weights_sharded && frozen) lg_trainer_gather_frozen_unit(tr, u);
    if (sh->weights_sharded) lg_trainer_gather_trainable_unit(tr, u);
    for (int r = 0; r < tr->local_ranks; r++) {
        lg_model *m = &tr->ranks[r].model;
        if (frozen) lg_model_point_frozen_unit(m, u, lg_frozen_unit_buffer(tr, r, u));
        lg_model_point_unit(m, u, lg_unit_weights(tr, r, u), lg_no_buf());
    }
}

/* Every rank's ops from here on wait for unit u's weights: their copies from the host
   (--offload weights), then their all-gather (sharded), which on a GPU follows the copies on
   the same stream. */
static void lg_trainer_await_unit(lg_trainer *tr, int u) {
    const lg_sharding *sh = &tr->plan.sharding;
    if (sh->weights_streamed)
        for (int r = 0; r < tr->local_ranks; r++)
            if (!tr->ranks[r].model.skip_kept_waits)
                lg_wait_beside(&tr->ranks[r].model.exec, lg_weights_mark(tr, u));
    if (!sh->weights_sharded) return;
    int signal = lg_gather_signal(tr, u);
    int frozen = LG_SIGNAL_FROZEN + lg_unit_slot(u, tr->block_slots);
    int has_frozen = lg_frozen_sharded(&tr->plan.cfg, sh);
    for (int q = 0; q < sh->replicas; q++) {
        lg_comm_await(tr->shard_comm[q], signal);
        if (has_frozen) lg_comm_await(tr->shard_comm[q], frozen);
    }
    for (int r = 0; r < tr->local_ranks; r++) {
        lg_rank_await(&tr->ranks[r].rank, signal);
        if (has_frozen) lg_rank_await(&tr->ranks[r].rank, frozen);
    }
}

/* The copy-beside mark of unit u's gradient buffer (--offload gradients). */
static int lg_grads_mark(int u) { return LG_BESIDE_GRADS + lg_unit_slot(u, LG_GRAD_BLOCK_SLOTS); }

/* --offload gradients, one rank: the elements of unit u's gradients that travel, all but its
   host part (lg_unit_host_part). */
static size_t lg_unit_device_count(const lg_trainer *tr, int u) {
    const lg_shard_layout *sl = &tr->plan.shards;
    return sl->unit_offset[u + 1] - sl->unit_offset[u] - lg_unit_host_part(&tr->plan.cfg, u);
}

/* --offload gradients: unit u's gradients of the step so far, on the host (one rank: the
   whole unit, where a whole-model buffer would hold it), from where its device part starts. */
static lg_buf lg_host_unit_grads(const lg_trainer *tr, int r, int u) {
    return lg_at(tr->ranks[r].host_grads,
                 tr->plan.shards.unit_offset[u] + lg_unit_host_part(&tr->plan.cfg, u));
}

/* --offload gradients: unit u's buffer holds the step's gradients so far, once the buffer's
   last copy to the host has left it: written afresh in the step's first micro-batch, else
   the host's sums brought back for the backward to add to (the sums a whole-model buffer
   would hold, added in the same order: the same bits). */
static void lg_trainer_fetch_unit_grads(lg_trainer *tr, int u, int micro) {
    size_t n = lg_unit_device_count(tr, u);
    for (int r = 0; r < tr->local_ranks; r++) {
        lg_model *m = &tr->ranks[r].model;
        lg_buf g = lg_unit_grads(tr, r, u);
        if (!m->skip_kept_waits) lg_wait_beside(&m->exec, lg_grads_mark(u));
        lg_model_point_unit(m, u, lg_no_buf(), g);
        if (micro == 0) lg_model_start_unit_grads(m, u, g, n);
        else lg_copy(&m->exec, g, lg_host_unit_grads(tr, r, u), n);
    }
}

/* Gradients in unit buffers (lg_grads_in_units): points unit u's gradient views at its
   buffer, ready for micro-batch `micro`'s backward: sharded, zeroed (the shard adds the
   reduce-scatter's piece); with --offload gradients, the step's sums so far. */
static void lg_trainer_open_unit_grads(lg_trainer *tr, int u, int micro) {
    if (tr->plan.spec.offload_gradients && !tr->plan.sharding.grads_sharded) {
        lg_trainer_fetch_unit_grads(tr, u, micro);
        return;
    }
    if (!tr->plan.sharding.grads_sharded) return;
    for (int r = 0; r < tr->local_ranks; r++) {
        lg_model *m = &tr->ranks[r].model;
        lg_buf g = lg_unit_grads(tr, r, u);
        if (tr->plan.spec.offload_gradients && !m->skip_kept_waits) /* its last piece has left */
            lg_wait_beside(&m->exec, lg_grads_mark(u));
        lg_model_point_unit(m, u, lg_no_buf(), g);
        lg_model_start_unit_grads(m, u, g, lg_padded_unit(&tr->plan.shards, u));
    }
}

/* --offload gradients: unit u's backward is done; its buffer goes to the host beside the
   compute that follows, and the buffer's next user waits for that copy alone. */
static void lg_trainer_send_unit_grads(lg_trainer *tr, int u) {
    if (!tr->plan.spec.offload_gradients || tr->plan.sharding.grads_sharded) return; /* (sharded:
                                                              lg_trainer_add_piece_on_host) */
    for (int r = 0; r < tr->local_ranks; r++) {
        lg_model *m = &tr->ranks[r].model;
        lg_copy_beside(&m->exec, lg_host_unit_grads(tr, r, u), lg_unit_grads(tr, r, u),
                       lg_unit_device_count(tr, u));
        lg_mark_beside(&m->exec, lg_grads_mark(u));
    }
}

/* Sharded gradients: reduce-scatters unit u's gradients in every shard group into each rank's
   reduce_out; on GPUs it runs beside the compute until lg_trainer_finish_reduce(u), which must
   come before the next unit's reduce-scatter (they share reduce_out). */
static void lg_trainer_start_reduce(lg_trainer *tr, int u) {
    const lg_sharding *sh = &tr->plan.sharding;
    if (!sh->grads_sharded) return;
    int S = sh->shard_ranks;
    lg_buf wholes[LG_MAX_RANKS], outs[LG_MAX_RANKS];
    for (int q = 0; q < sh->replicas; q++) {
        int local[LG_MAX_RANKS], n = lg_trainer_group_local(tr, q * S, 1, S, local);
        for (int i = 0; i < n; i++) {
            wholes[i] = lg_unit_grads(tr, local[i], u);
            outs[i] = tr->ranks[local[i]].reduce_out;
        }
        if (n)
            lg_reduce_scatter_sum_async(tr->shard_comm[q], n, wholes, outs,
                                        tr->plan.shards.piece_count[u], lg_reduce_signal(u));
    }
}

/* --offload gradients, sharded: rank r's piece of unit u joins the step's sums on the host.
   The sums so far come back into the unit's buffer (free once its reduce-scatter is done;
   zeroed in the step's first micro-batch, as the shard would be), take the piece in the
   shard's order, and go out again beside the compute. */
static void lg_trainer_add_piece_on_host(lg_trainer *tr, int r, int u, int micro) {
    const lg_shard_layout *sl = &tr->plan.shards;
    lg_trainer_rank *tr_r = &tr->ranks[r];
    const lg_exec *ex = &tr_r->model.exec;
    lg_buf sums = lg_unit_grads(tr, r, u), host = lg_at(tr_r->host_grads, sl->piece_offset[u]);
    size_t n = sl->piece_count[u];
    if (micro == 0) lg_zero(ex, sums, n);
    else lg_copy(ex, sums, host, n);
    lg_add(ex, sums, sums, tr_r->reduce_out, n);
    lg_copy_beside(ex, host, sums, n);
    lg_mark_beside(ex, lg_grads_mark(u));
}

/* Waits for unit u's reduce-scatter and adds each rank's piece to its gradient shard
   (accumulating over micro-batches; with --offload gradients the shard is on the host). */
static void lg_trainer_finish_reduce(lg_trainer *tr, int u, int micro) {
    const lg_shard_layout *sl = &tr->plan.shards;
    if (!tr->plan.sharding.grads_sharded) return;
    for (int q = 0; q < tr->plan.sharding.replicas; q++) lg_comm_await(tr->shard_comm[q], lg_reduce_signal(u));
    for (int r = 0; r < tr->local_ranks; r++) {
        lg_trainer_rank *tr_r = &tr->ranks[r];
        lg_rank_await(&tr_r->rank, lg_reduce_signal(u));
        if (tr->plan.spec.offload_gradients) {
            lg_trainer_add_piece_on_host(tr, r, u, micro);
            continue;
        }
        lg_buf shard = lg_at(tr_r->model.grads, sl->piece_offset[u]);
        lg_add(&tr_r->model.exec, shard, shard, tr_r->reduce_out, sl->piece_count[u]);
    }
}

/* Replicas (no-shard, hybrid-shard): all-reduce the gradients across them, once a step. */
static void lg_trainer_sync_replicas(lg_trainer *tr) {
    const lg_sharding *sh = &tr->plan.sharding;
    if (sh->replicas == 1) return;
    lg_buf bufs[LG_MAX_RANKS];
    for (int i = 0; i < sh->shard_ranks; i++) {
        int local[LG_MAX_RANKS], n = lg_trainer_group_local(tr, i, sh->shard_ranks, sh->replicas, local);
        for (int q = 0; q < n; q++) bufs[q] = tr->ranks[local[q]].model.grads;
        if (n) lg_all_reduce_sum(tr->replica_comm[i], n, bufs, tr->ranks[local[0]].model.n_local);
    }
}

/* Where the host computes on a rank's host pool: the rank's own exec on the CPU backend (the
   same kernels, so the same bits, as on its device pool), else plain host loops. */
static const lg_exec *lg_trainer_host_exec(const lg_trainer_rank *tr_r) {
    return tr_r->model.exec.backend == LG_BACKEND_CPU ? &tr_r->model.exec : NULL;
}

/* The norm of the whole gradient: each rank squares its shard, the members of shard group 0
   add theirs in order (replicas hold the same); in several processes the squares of all ranks
   are gathered first. */
static float lg_trainer_grad_norm(lg_trainer *tr) {
    int S = tr->plan.sharding.shard_ranks;
    double squares[LG_MAX_RANKS]; /* (n_ranks) */
    for (int r = 0; r < tr->local_ranks; r++) {
        const lg_model *m = &tr->ranks[r].model;
        if (tr->plan.spec.offload_gradients) { /* the host holds them (lg_trainer_host_exec) */
            lg_rank_sync(m->rank);
            squares[tr->first_rank + r] =
                lg_sum_squares(lg_trainer_host_exec(&tr->ranks[r]), tr->ranks[r].host_grads, m->n_local);
        } else {
            squares[tr->first_rank + r] = lg_sum_squares(&m->exec, m->grads, m->n_local);
        }
    }
    lg_comm_gather_doubles(tr->process_comm, squares, tr->local_ranks);
    lg_real sum = 0; /* host numbers */
    for (int i = 0; i < S; i++) sum += (lg_real)squares[i];
    return (float)sqrt((double)sum);
}

/* -1 with the line of the first of this process's ranks that stopped computing (a GPU out of
   memory inside cuBLASLt: lg_rank_failure), else 0. No wait: the host records the line as it
   queues the op that failed. */
static int lg_trainer_check_ranks(const lg_trainer *tr, lg_error *err) {
    for (int r = 0; r < tr->local_ranks; r++) {
        const char *why = lg_rank_failure(&tr->ranks[r].rank);
        if (why) return lg_fail(err, "%s", why);
    }
    return 0;
}

/* Layer l's forward on every rank that has a micro-batch: l = -1 the embedding, 0 .. L - 1
   the blocks, L the head. Returns the head's loss summed over the ranks (0 for the others). */
static double lg_trainer_layer_forward(lg_trainer *tr, const lg_micro_batch *mb, int l) {
    double loss = 0;
    for (int r = 0; r < tr->local_ranks; r++) {
        lg_model *m = &tr->ranks[r].model;
        const lg_micro_batch *b = &mb[r];
        if (!b->B) continue;
        m->span_start = b->span_start; /* (--pack refuses GPU ranks: lg_trainer_create) */
        if (l < 0) lg_model_embed(m, b->inputs, b->B, b->T);
        else if (l < m->cfg.n_layer) lg_model_block_forward(m, l, b->B, b->T);
        else loss += lg_model_head_forward(m, b->targets, b->B, b->T, NULL);
    }
    return loss;
}

/* Layer l's backward on every rank that has a micro-batch, in the forward's numbering: L the
   head (its loss scaled by loss_scale), L - 1 .. 0 the blocks, -1 the embedding. */
static void lg_trainer_layer_backward(lg_trainer *tr, const lg_micro_batch *mb, int l,
                                      float loss_scale) {
    for (int r = 0; r < tr->local_ranks; r++) {
        lg_model *m = &tr->ranks[r].model;
        const lg_micro_batch *b = &mb[r];
        if (!b->B) continue;
        m->span_start = b->span_start;
        if (l < 0) lg_model_embed_backward(m, b->inputs, b->B, b->T);
        else if (l < m->cfg.n_layer) lg_model_block_backward(m, l, b->B, b->T);
        else lg_model_head_backward(m, b->targets, b->B, b->T, loss_scale);
    }
}

/* The forward on every rank, unit by unit: gather a unit (full-shard), compute it everywhere.
   The next block is gathered before the current one computes (the prefetch a GPU overlaps);
   two block slots hold them. Unit 0 is the ends (embedding and head), unit l + 1 block l.
   Returns the summed loss of all ranks. */
static double lg_trainer_forward(lg_trainer *tr, const lg_micro_batch *mb) {
    int L = tr->plan.cfg.n_layer;
    lg_trainer_gather_unit(tr, 0);
    lg_trainer_gather_unit(tr, 1);
    lg_trainer_await_unit(tr, 0);
    lg_trainer_layer_forward(tr, mb, -1);
    for (int l = 0; l < L; l++) {
        if (l + 1 < L) lg_trainer_gather_unit(tr, l + 2);
        lg_trainer_await_unit(tr, l + 1);
        lg_trainer_layer_forward(tr, mb, l);
    }
    return lg_trainer_layer_forward(tr, mb, L);
}

/* A token embedding trained on the host (lg_embedding_trained_on_host): the gradient of the
   embedding's output (B T, C) comes to the host, into embedding.rows (the forward's copy out of
   it is done), and the host scatters it into the table's gradient there, adding in token
   order as the device's embedding backward does: onto zeros in the step's first micro-batch,
   then onto the sums so far, so the same bits. Tests skip the host's wait to show it matters. */
static void lg_trainer_scatter_embedding_grads(lg_trainer *tr, const lg_micro_batch *mb, int micro) {
    const lg_config *c = &tr->plan.cfg;
    if (!lg_embedding_trained_on_host(c)) return;
    for (int r = 0; r < tr->local_ranks; r++) {
        lg_trainer_rank *tr_r = &tr->ranks[r];
        lg_model *m = &tr_r->model;
        const lg_micro_batch *b = &mb[r];
        const lg_exec *host = lg_trainer_host_exec(tr_r);
        lg_buf table_grads = lg_trained_embedding_view(c, tr_r->host_grads); /* (Vp, C) */
        if (micro == 0) lg_zero(host, table_grads, lg_unit_host_part(c, 0));
        if (!b->B) continue;
        lg_copy_beside(&m->exec, m->embedding_rows, lg_residual_grad(m, 0),
                       (size_t)b->B * b->T * c->n_embd);
        lg_mark_beside(&m->exec, LG_BESIDE_EMBEDDING);
        if (!m->skip_kept_waits) lg_finish_beside(&m->exec, LG_BESIDE_EMBEDDING);
        lg_embedding_backward(host, table_grads, lg_no_buf(), m->embedding_rows, b->inputs, b->B,
                              b->T, c->n_embd, b->span_start);
    }
}

/* --offload, in the step's last backward, with no replicas left to add (their all-reduce
   comes after the backward): unit u's gradient shard is final, so its copy to the host starts
   beside the compute that remains. */
static void lg_trainer_offload_unit(lg_trainer *tr, int u, int offload) {
    const lg_shard_layout *sl = &tr->plan.shards;
    if (!offload) return;
    for (int r = 0; r < tr->local_ranks; r++) {
        lg_trainer_rank *tr_r = &tr->ranks[r];
        /* the unit in the shard: its piece (sharded), or the whole unit */
        size_t first = tr->plan.sharding.grads_sharded ? sl->piece_offset[u] : sl->unit_offset[u];
        size_t count = tr->plan.sharding.grads_sharded ? sl->piece_offset[u + 1] - first
                                                       : sl->unit_offset[u + 1] - first;
        lg_copy_beside(&tr_r->model.exec, lg_at(tr_r->host_grads, first),
                       lg_at(tr_r->model.grads, first), count);
    }
}

/* The backward on every rank, unit by unit in reverse: gather the block again (full-shard),
   compute its gradients into a whole-unit buffer, reduce-scatter them into the shards
   (sharded gradients). The reduce-scatter of block l runs while block l - 1 computes; its
   piece joins the shard after that. The ends' gradients collect from the head and the
   embedding and go last. offload: each unit's finished gradients go to the host as it goes
   (the step's last backward with --offload and no replicas; lg_trainer_offload_unit). */
static void lg_trainer_backward(lg_trainer *tr, const lg_micro_batch *mb, float loss_scale,
                                int micro, int offload) {
    int L = tr->plan.cfg.n_layer;
    for (int r = 0; r < tr->local_ranks; r++) { /* unit buffers: afresh, or the sums so far */
        lg_model *m = &tr->ranks[r].model;
        if (tr->plan.sharding.grads_sharded) m->grads_overwrite = !m->grads_add_only;
        else if (tr->plan.spec.offload_gradients)
            m->grads_overwrite = micro == 0 && !m->grads_add_only;
    }
    lg_trainer_open_unit_grads(tr, 0, micro);
    lg_trainer_layer_backward(tr, mb, L, loss_scale);
    lg_trainer_gather_unit(tr, L);
    for (int l = L - 1; l >= 0; l--) {
        if (l > 0) lg_trainer_gather_unit(tr, l); /* prefetch block l - 1 */
        lg_trainer_await_unit(tr, l + 1);
        lg_trainer_open_unit_grads(tr, l + 1, micro); /* its slot's last reduce-scatter has
                                                         finished */
        lg_trainer_layer_backward(tr, mb, l, loss_scale);
        lg_trainer_send_unit_grads(tr, l + 1);
        if (l + 2 <= L) {
            lg_trainer_finish_reduce(tr, l + 2, micro);
            lg_trainer_offload_unit(tr, l + 2, offload);
        }
        lg_trainer_start_reduce(tr, l + 1);
    }
    lg_trainer_layer_backward(tr, mb, -1, loss_scale);
    lg_trainer_scatter_embedding_grads(tr, mb, micro);
    lg_trainer_send_unit_grads(tr, 0);
    lg_trainer_finish_reduce(tr, 1, micro);
    lg_trainer_offload_unit(tr, 1, offload);
    lg_trainer_start_reduce(tr, 0);
    lg_trainer_finish_reduce(tr, 0, micro);
    lg_trainer_offload_unit(tr, 0, offload);
    for (int r = 0; r < tr->local_ranks; r++) /* the next micro-batch adds */
        if (mb[r].B) tr->ranks[r].model.grads_overwrite = 0;
}

/* Where micro-batch i starts in a rank's token buffers: they hold accumulation x (B, T). */
static size_t lg_micro_batch_start(const lg_trainer *tr, int i) {
    return (size_t)i * tr->args.micro_batch_size * tr->ranks[0].model.T;
}

/* Micro-batch i of every rank, from their token buffers (labels: each rank's targets, or NULL
   for logits only). */
static void lg_trainer_micro_batches(const lg_trainer *tr, int i, const int **labels,
                                     lg_micro_batch *mb) {
    size_t at = lg_micro_batch_start(tr, i);
    for (int r = 0; r < tr->local_ranks; r++) {
        mb[r].inputs = tr->ranks[r].inputs + at;
        mb[r].targets = labels ? labels[r] + at : NULL;
        mb[r].span_start = tr->ranks[r].spans ? tr->ranks[r].spans + at : NULL;
        mb[r].B = tr->args.micro_batch_size;
        mb[r].T = tr->ranks[r].micro_T[i];
    }
}

/* Tokens (rows x their length) of a step's micro-batches on all ranks (lg_trainer_read_step
   counted them). */

/* --offload embedding: the token embedding the first rank drew, copied to the process's other
   ranks (each holds the whole table in its host pool). */
static void lg_trainer_share_host_embedding(lg_trainer *tr) {
    const lg_model *m0 = &tr->ranks[0].model;
    if (!m0->cfg.lora.host_embedding) return;
    size_t count = (size_t)m0->cfg.padded_vocab_size * m0->cfg.n_embd;
    lg_rank_sync(m0->rank);
    for (int r = 1; r < tr->local_ranks; r++) {
        const lg_model *m = &tr->ranks[r].model;
        lg_copy(&m->exec, m->embedding_host, m0->embedding_host, count);
        lg_rank_sync(m->rank);
    }
}

/* LoRA's frozen base sharded: the base one rank draws (lg_model_init_frozen's stream), unit
   by unit on the first rank into its gather slot, hashed there (base_hash), broadcast to the
   process's ranks, each keeping its piece. */
static int lg_trainer_init_frozen_units(lg_trainer *tr, lg_error *err) {
    const lg_shard_layout *sl = &tr->plan.frozen_shards;
    const lg_model *m0 = &tr->ranks[0].model;
    int rc = 0;
    if (!m0->frozen_gathered) return 0;
    lg_rng rng;
    lg_rng_seed(&rng, tr->args.seed);
    uint64_t h = LG_HASH64_INIT;
    lg_buf slots[LG_MAX_RANKS];
    for (int u = 0; u < sl->n_units; u++) {
        size_t padded = sl->piece_count[u] * (size_t)sl->n_shards;
        lg_frozen_at at = lg_frozen_unit_at(m0, u, lg_frozen_unit_buffer(tr, 0, u));
        lg_rank_sync(m0->rank); /* the slot's last broadcast has left it */
        lg_buf unit = {at.values.data, LG_DTYPE_U8};
        lg_zero(&m0->exec, unit, padded); /* the padding too: every rank's shard the same */
        for (int k = 0; k < m0->frozen_table.n_tensors; k++) {
            const lg_tensor_info *t = &m0->frozen_table.tensors[k];
            if (t->block + 1 != u || rc != 0) continue; /* the broadcasts go on */
            rc = lg_init_frozen_tensor(m0, at, t, &rng, err);
            h = lg_frozen_tensor_hash(h, m0, at, t);
        }
        for (int r = 0; r < tr->local_ranks; r++) {
            lg_buf slot = {lg_frozen_unit_buffer(tr, r, u), LG_DTYPE_U8};
            slots[r] = slot;
        }
        lg_broadcast(tr->world_comm, tr->local_ranks, 0, slots, padded);
        for (int r = 0; r < tr->local_ranks; r++) {
            lg_model *m = &tr->ranks[r].model;
            size_t first = (size_t)tr->plan.ranks[tr->first_rank + r].shard_index * sl->piece_count[u];
            lg_buf dst = {(uint8_t *)m->frozen_shard.data + sl->piece_offset[u], LG_DTYPE_U8};
            lg_copy(&m->exec, dst, lg_at(slots[r], first), sl->piece_count[u]);
        }
    }
    lg_trainer_share_host_embedding(tr);
    tr->base_hash = h;
    tr->base_hashed = 1;
    return rc;
}

/* Trainable unit u's initial weights, its tensors in layout order from rng, into rank 0's slot
   for it; its host part (lg_unit_host_part) where it lives, in the host's weights. */
static void lg_trainer_init_unit(lg_trainer *tr, int u, lg_rng *rng) {
    const lg_shard_layout *sl = &tr->plan.shards;
    const lg_model *m0 = &tr->ranks[0].model;
    size_t apart = lg_unit_host_part(&tr->plan.cfg, u);
    lg_buf unit = lg_unit_weights(tr, 0, u);
    for (int k = 0; k < m0->param_table.n_tensors; k++) {
        const lg_tensor_info *t = &m0->param_table.tensors[k];
        if (t->block + 1 != u) continue;
        size_t at = t->offset - sl->unit_offset[u];
        if (at < apart)
            lg_init_tensor(lg_trainer_host_exec(&tr->ranks[0]), &tr->plan.cfg, t,
                           lg_at(m0->params, t->offset), rng);
        else
            lg_init_tensor(&m0->exec, &tr->plan.cfg, t, lg_at(unit, at - apart), rng);
    }
}

/* The same initial weights as one rank: with sharded weights, unit by unit in layout order
   from one random stream on rank 0, broadcast, each rank keeping its piece. In several
   processes every process draws the same stream on its first rank and broadcasts it to its
   own ranks. */
static int lg_trainer_init_weights(lg_trainer *tr, lg_error *err) {
    const lg_sharding *sh = &tr->plan.sharding;
    const lg_shard_layout *sl = &tr->plan.shards;
    const lg_model *m0 = &tr->ranks[0].model;
    int rc = 0;
    if (!lg_weights_in_units(sh)) {
        for (int r = 0; r < tr->local_ranks && rc == 0; r++)
            rc = lg_model_init_weights(&tr->ranks[r].model, tr->args.seed, err);
        return rc;
    }
    lg_rng rng;
    lg_trainable_rng(&tr->plan.cfg, tr->args.seed, &rng);
    for (int r = 0; r < tr->local_ranks && rc == 0; r++)
        rc = lg_model_init_frozen(&tr->ranks[r].model, tr->args.seed, err);
    if (lg_trainer_init_frozen_units(tr, err) != 0) rc = -1;
    lg_buf slots[LG_MAX_RANKS];
    for (int u = 0; u < sl->n_units; u++) {
        size_t apart = lg_unit_host_part(&tr->plan.cfg, u); /* (one rank: its piece is the unit) */
        lg_rank_sync(m0->rank); /* the slot's last broadcast has left it */
        lg_trainer_init_unit(tr, u, &rng);
        for (int r = 0; r < tr->local_ranks; r++) slots[r] = lg_unit_weights(tr, r, u);
        lg_broadcast(tr->world_comm, tr->local_ranks, 0, slots,
                     sl->unit_offset[u + 1] - sl->unit_offset[u] - apart);
        for (int r = 0; r < tr->local_ranks; r++) {
            size_t count = sl->piece_count[u] - apart;
            size_t first = tr->plan.ranks[tr->first_rank + r].shard_index * count;
            lg_copy(&tr->ranks[r].model.exec,
                    lg_at(tr->ranks[r].model.params, sl->piece_offset[u] + apart),
                    lg_at(slots[r], first), count);
        }
    }
    return rc;
}

/* Shard-grad-op: each rank updated its pieces of the whole weights; an all-gather a unit
   (through the gather buffers, which hold the padding) gives every rank all of them. */
static void lg_trainer_share_updated_weights(lg_trainer *tr) {
    const lg_sharding *sh = &tr->plan.sharding;
    const lg_shard_layout *sl = &tr->plan.shards;
    if (!sh->grads_sharded || sh->weights_sharded) return;
    lg_buf pieces[LG_MAX_RANKS], wholes[LG_MAX_RANKS];
    for (int u = 0; u < sl->n_units; u++) {
        size_t count = sl->piece_count[u], unit = sl->unit_offset[u + 1] - sl->unit_offset[u];
        for (int i = 0; i < tr->local_ranks; i++) { /* replicas = 1: rank r is member r */
            size_t first = (size_t)(tr->first_rank + i) * count;
            size_t live = first >= unit ? 0 : unit - first < count ? unit - first : count;
            wholes[i] = lg_unit_weights(tr, i, u);
            pieces[i] = lg_at(wholes[i], first);
            const lg_exec *ex = &tr->ranks[i].model.exec;
            lg_copy(ex, pieces[i], lg_at(tr->ranks[i].model.params, sl->unit_offset[u] + first), live);
            lg_zero(ex, lg_at(pieces[i], live), count - live);
        }
        lg_all_gather(tr->shard_comm[0], tr->local_ranks, pieces, wholes, count);
        for (int i = 0; i < tr->local_ranks; i++)
            lg_copy(&tr->ranks[i].model.exec, lg_at(tr->ranks[i].model.params, sl->unit_offset[u]),
                    wholes[i], unit);
    }
}

/* Waits for every rank's queued work. */
static void lg_trainer_sync(const lg_trainer *tr) {
    for (int r = 0; r < tr->local_ranks; r++) lg_rank_sync(&tr->ranks[r].rank);
}

/* CPU ranks in several processes: the MPI group of members first + m stride (m < count) when
   they live in more than one process; a group inside one process needs none (its collectives
   run in the process). Every process decides alike and takes part in every split. */
static int lg_trainer_mpi_group(lg_trainer *tr, int first, int stride, int count,
                                const char *buffers, const char *name,
                                const lg_launch *launch, lg_comm **comm, lg_error *err) {
    int per_process = tr->local_ranks, last = first + (count - 1) * stride;
    if (first / per_process == last / per_process) return 0;
    int local[LG_MAX_RANKS], n = lg_trainer_group_local(tr, first, stride, count, local);
    lg_mpi_group g = {name, count, n ? (tr->first_rank + local[0] - first) / stride : 0, n,
                      NULL, launch, per_process};
    if (n) g.scratch = lg_rank_region(&tr->ranks[local[0]].rank, buffers); /* the plan's */
    return lg_mpi_comm_create(comm, &g, err);
}

/* CPU ranks in several processes: the MPI groups of the shard groups, the replica groups and
   all ranks (process_comm), with the plan's buffers. */
static int lg_trainer_make_mpi_groups(lg_trainer *tr, const lg_launch *launch, lg_error *err) {
    const lg_sharding *sh = &tr->plan.sharding;
    int S = sh->shard_ranks, R = sh->replicas;
    char name[48];
    for (int q = 0; q < R && S > 1; q++) {
        lg_format(name, sizeof name, "shard group %d", q);
        if (lg_trainer_mpi_group(tr, q * S, 1, S, "mpi.shard", name, launch, &tr->shard_comm[q],
                                 err) != 0)
            return -1;
    }
    for (int i = 0; i < S && R > 1; i++) {
        lg_format(name, sizeof name, "replica group %d", i);
        if (lg_trainer_mpi_group(tr, i, S, R, "mpi.replica", name, launch, &tr->replica_comm[i],
                                 err) != 0)
            return -1;
    }
    return lg_trainer_mpi_group(tr, 0, 1, tr->n_ranks, "mpi.all", "all ranks", launch,
                                &tr->process_comm, err);
}

/* GPUs: each NCCL group's name and deadline for its errors (lg_comm_watch). */
static void lg_trainer_name_comms(lg_trainer *tr, const lg_launch *launch) {
    char name[48];
    for (int i = 0; i < LG_MAX_RANKS; i++) {
        lg_format(name, sizeof name, "shard group %d", i);
        lg_comm_watch(tr->shard_comm[i], name, launch);
        lg_format(name, sizeof name, "replica group %d", i);
        lg_comm_watch(tr->replica_comm[i], name, launch);
    }
    lg_comm_watch(tr->world_comm, "all ranks (start)", launch);
    lg_comm_watch(tr->process_comm, "all ranks", launch);
}

/* GPU ranks in several processes: process 0's NCCL id reaches the others (MPI, or the
   rendezvous); all ranks join one communicator (process_comm: also the step's loss and norm),
   split into the shard and replica groups; for the first weights, which every process draws
   itself, the process's own ranks share one of their own. */
static int lg_trainer_make_nccl_groups(lg_trainer *tr, const lg_launch *launch, lg_error *err) {
    const lg_sharding *sh = &tr->plan.sharding;
    int S = sh->shard_ranks, R = sh->replicas, color[LG_MAX_RANKS], key[LG_MAX_RANKS];
    unsigned char id[LG_NCCL_ID_BYTES] = {0};
    lg_rank *members[LG_MAX_RANKS];
    if (launch->process == 0 && lg_nccl_unique_id(id, err) != 0) return -1;
    if (lg_launch_share(launch, id, sizeof id, err) != 0) return -1;
    for (int r = 0; r < tr->local_ranks; r++) members[r] = &tr->ranks[r].rank;
    tr->process_comm = lg_comm_create_global(tr->n_ranks, tr->first_rank, tr->local_ranks,
                                             members, id, launch, err);
    if (!tr->process_comm) return -1;
    for (int r = 0; r < tr->local_ranks; r++) { /* shard group q: ranks q S .. q S + S - 1 */
        color[r] = (tr->first_rank + r) / S;
        key[r] = (tr->first_rank + r) % S;
    }
    if (S > 1 && lg_comm_split(tr->process_comm, color, key, tr->shard_comm, err) != 0) return -1;
    for (int r = 0; r < tr->local_ranks; r++) { /* replica group i: ranks i, S + i, ... */
        color[r] = (tr->first_rank + r) % S;
        key[r] = (tr->first_rank + r) / S;
    }
    if (R > 1 && lg_comm_split(tr->process_comm, color, key, tr->replica_comm, err) != 0) return -1;
    lg_trainer_name_comms(tr, launch);
    if (tr->local_ranks == 1 || !sh->weights_sharded) return 0;
    return (tr->world_comm = lg_comm_create(tr->local_ranks, members, err)) ? 0 : -1;
}

/* GPUs: the communicators of the shard groups, the replica groups and (for the first weights
   of sharded runs) all ranks; groups of one need none. */
static int lg_trainer_make_comms(lg_trainer *tr, const lg_launch *launch, lg_error *err) {
    const lg_sharding *sh = &tr->plan.sharding;
    int S = sh->shard_ranks, R = sh->replicas;
    lg_rank *members[LG_MAX_RANKS];
    if (tr->local_ranks < tr->n_ranks && tr->plan.spec.backend == LG_BACKEND_CUDA)
        return lg_trainer_make_nccl_groups(tr, launch, err);
    if (tr->local_ranks < tr->n_ranks)
        return lg_trainer_make_mpi_groups(tr, launch, err);
    if (tr->plan.spec.backend != LG_BACKEND_CUDA || tr->n_ranks == 1) return 0;
    for (int q = 0; q < R && S > 1; q++) {
        for (int i = 0; i < S; i++) members[i] = &tr->ranks[q * S + i].rank;
        if (!(tr->shard_comm[q] = lg_comm_create(S, members, err))) return -1;
    }
    for (int i = 0; i < S && R > 1; i++) {
        for (int q = 0; q < R; q++) members[q] = &tr->ranks[q * S + i].rank;
        if (!(tr->replica_comm[i] = lg_comm_create(R, members, err))) return -1;
    }
    if (sh->weights_sharded) {
        for (int r = 0; r < tr->local_ranks; r++) members[r] = &tr->ranks[r].rank;
        if (!(tr->world_comm = lg_comm_create(tr->n_ranks, members, err))) return -1;
    }
    lg_trainer_name_comms(tr, launch);
    return 0;
}

/* The communicators a rank joins (lg_trainer_make_comms): what NCCL's share of the GPU's
   memory is counted for. */
int lg_comms_per_rank(const lg_args *args) {
    lg_plan_spec spec;
    lg_plan_spec_from_args(&spec, args, 1);
    lg_sharding sh = lg_sharding_of(&spec);
    if (spec.devices * spec.nodes == 1) return 0;
    return (sh.shard_ranks > 1) + (sh.replicas > 1) + sh.weights_sharded;
}

void lg_cuda_estimate_runtime(lg_args *args) {
    lg_cuda_runtime_estimate_parts(args->gpu, lg_comms_per_rank(args), &args->runtime_parts);
    args->runtime_bytes = lg_cuda_runtime_parts_sum(&args->runtime_parts);
    args->runtime_estimated = 1;
}


int lg_trainer_create(lg_trainer *tr, const lg_config *cfg, const lg_args *args, int T,
                      lg_error *err) {
    return lg_trainer_create_in(tr, cfg, args, T, NULL, err);
}

/* Which ranks this process drives (every one without a launch), and the buffer for the
   micro-batches of the others'. */
static int lg_trainer_take_ranks(lg_trainer *tr, const lg_launch *launch, lg_error *err) {
    tr->first_rank = launch ? launch->first_rank : 0;
    tr->local_ranks = launch ? launch->local_ranks : tr->n_ranks;
    tr->process = launch ? launch->process : 0;
    if (tr->local_ranks < 1 || tr->first_rank + tr->local_ranks > tr->n_ranks)
        return lg_fail(err, "this process should drive ranks %d..%d of %d (lg_launch_place)",
                       tr->first_rank, tr->first_rank + tr->local_ranks - 1, tr->n_ranks);
    if (tr->local_ranks == tr->n_ranks) return 0;
    if (tr->plan.spec.backend == LG_BACKEND_CPU && !launch->mpi)
        return lg_fail(err, lg_launch_has_mpi()
                                ? "CPU ranks in several processes exchange over MPI, which %s does not "
                                  "start: use mpirun or srun (or one process: drop the launcher)"
                                : "CPU ranks in several processes exchange over MPI, and this build has "
                                  "none (%s started them): apt-get install openmpi-bin "
                                  "libopenmpi-dev, then make cpu",
                       launch->launcher);
    size_t tokens = 3 * (size_t)tr->args.micro_batch_size * tr->plan.spec.T; /* inputs,
                                                                        targets, spans */
    tr->other_tokens = (int *)lg_alloc_zeroed(sizeof(int) * tokens);
    return tr->other_tokens ? 0 : lg_fail(err, "trainer: out of host memory");
}

int lg_trainer_create_in(lg_trainer *tr, const lg_config *cfg, const lg_args *args, int T,
                         const lg_launch *launch, lg_error *err) {
    memset(tr, 0, sizeof *tr);
    tr->args = *args;
    tr->accumulation = lg_args_accumulation_steps(args, err);
    if (tr->accumulation < 1) return -1;
    lg_plan_spec spec;
    lg_plan_spec_from_args(&spec, args, T);
    spec.processes = tr->args.processes = launch ? launch->processes : 1; /* the launch's */
    if (lg_plan_make(&tr->plan, cfg, &spec, err) != 0) return -1;
    tr->n_ranks = tr->plan.n_ranks;
    tr->block_slots = lg_gather_block_slots(&tr->plan.sharding);
    if (lg_trainer_take_ranks(tr, launch, err) != 0) {
        lg_trainer_free(tr);
        return -1;
    }
    tr->ranks = (lg_trainer_rank *)lg_alloc_zeroed(sizeof(lg_trainer_rank) * (size_t)tr->local_ranks);
    if (!tr->ranks) {
        lg_trainer_free(tr);
        return lg_fail(err, "out of host memory");
    }
    for (int r = 0; r < tr->local_ranks; r++) {
        lg_trainer_rank *tr_r = &tr->ranks[r];
        /* the GPU: the process's place on its node, then the rank's in the process */
        int device = (launch ? launch->local_process * tr->local_ranks : 0) + r;
        if (lg_rank_create_on(&tr_r->rank, &tr->plan, tr->first_rank + r, device, err) != 0 ||
            lg_model_bind(&tr_r->model, &tr->plan.cfg, &tr_r->rank, err) != 0) {
            lg_trainer_free(tr);
            return -1;
        }
        lg_trainer_bind_rank(tr, tr_r);
        tr_r->micro_T = (int *)lg_alloc_zeroed(sizeof(int) * (size_t)tr->accumulation);
        if (!tr_r->micro_T) {
            lg_trainer_free(tr);
            return lg_fail(err, "trainer: out of host memory");
        }
    }
    if (lg_trainer_make_comms(tr, launch, err) != 0) {
        lg_trainer_free(tr);
        return -1;
    }
    if (lg_trainer_init_weights(tr, err) != 0) {
        lg_trainer_free(tr);
        return -1;
    }
    for (int r = 0; r < tr->local_ranks; r++) { /* after the init: the master copies it */
        lg_trainer_rank *tr_r = &tr->ranks[r];
        if (lg_optimizer_create(&tr_r->opt, &tr_r->model, args, err) != 0) {
            lg_trainer_free(tr);
            return -1;
        }
        const lg_model *m = &tr_r->model;
        if (!tr_r->host_weights.data) continue;
        if (m->weights_gathered) lg_copy(&m->exec, tr_r->host_weights, m->params, m->n_local);
        else lg_copy_from_whole(&m->exec, m->local, tr_r->host_weights, m->params);
    }
    tr->scaling = args->precision == LG_PRECISION_16_TRUE || args->precision == LG_PRECISION_16_MIXED;
    tr->loss_scale = tr->scaling ? LG_LOSS_SCALE_START : 1.0f;
    tr->scale_window = LG_LOSS_SCALE_WINDOW;
    lg_format(tr->base_model, sizeof tr->base_model, "(drawn at random: %s, seed %llu)",
              cfg->name, (unsigned long long)args->seed); /* until --load */
    lg_trainer_sync(tr); /* the caller may load weights into the arenas next */
    return 0;
}

/* --offload: queues the copy of a rank's gradient shard to the host (pinned, asynchronous on
   a GPU: the trainer queues every rank's before it updates the first, so the copies run while
   the host updates). */
static void lg_trainer_offload_grads(lg_trainer_rank *tr_r) {
    lg_model *m = &tr_r->model;
    if (tr_r->host_grads.data && m->grads.data) /* (--offload gradients: there already) */
        lg_copy(&m->exec, tr_r->host_grads, m->grads, m->n_local);
}

/* One rank's optimizer step on its shard. --offload: once its gradients are on the host, the
   optimizer updates the host copy of the weights (the master weights in the mixed precisions,
   which write their rounded working copy straight back), and the updated weights return to
   the device in its precision. */
static void lg_trainer_update_rank(lg_trainer_rank *tr_r, float lr, float multiplier) {
    lg_model *m = &tr_r->model;
    int on_host = tr_r->host_grads.data != NULL;
    int weights_on_host = on_host && tr_r->host_weights.data != NULL;
    if (on_host) lg_rank_sync(m->rank); /* the gradients have arrived (lg_trainer_offload_grads) */
    lg_optimizer_update(&tr_r->opt, on_host ? NULL : &m->exec, m->local,
                        weights_on_host ? tr_r->host_weights : m->params,
                        !weights_on_host && !m->weights_gathered,
                        on_host ? tr_r->host_grads : m->grads, lr, multiplier);
    if (!weights_on_host) return;
    if (!m->weights_gathered) lg_copy_to_whole(&m->exec, m->local, m->params, tr_r->host_weights);
    else lg_copy(&m->exec, m->params, tr_r->host_weights, m->n_local);
}

/* Sophia's Gauss-Newton-Bartlett estimate: the gradient of the loss on labels drawn from the
   model's own predictions for this step's inputs, squared into the Hessian estimate. Each
   label's draw depends on its place in the global batch, as with one rank. */
static void lg_trainer_hessian_pass(lg_trainer *tr, int step) {
    const lg_config *c = &tr->plan.cfg;
    int Vp = c->padded_vocab_size;
    size_t tokens = tr->step_tokens, stride = lg_micro_batch_start(tr, 1);
    const int *labels[LG_MAX_RANKS];
    lg_micro_batch mb[LG_MAX_RANKS];
    for (int r = 0; r < tr->local_ranks; r++) {
        lg_model_zero_grad(&tr->ranks[r].model);
        labels[r] = tr->ranks[r].sampled;
    }
    for (int i = 0; i < tr->accumulation; i++) {
        lg_trainer_micro_batches(tr, i, NULL, mb);
        lg_trainer_forward(tr, mb);
        for (int r = 0; r < tr->local_ranks; r++) {
            lg_rank_sync(&tr->ranks[r].rank); /* the host reads the logits */
            size_t micro_tokens = (size_t)mb[r].B * mb[r].T;
            int *drawn = tr->ranks[r].sampled + i * stride;
            size_t first = ((size_t)i * tr->n_ranks + tr->first_rank + r) * stride;
            lg_visit rows = lg_visit_start(&tr->ranks[r].model.exec, tr->ranks[r].model.a.logits,
                                           micro_tokens * Vp, (size_t)Vp, LG_VISIT_READ);
            while (lg_visit_next(&rows))
                for (size_t k = 0; k < rows.n / Vp; k++) {
                    size_t n = rows.first / Vp + k;
                    drawn[n] = lg_draw_token(lg_at(rows.piece, k * Vp), c->vocab_size, 1.0f,
                                             lg_hash_uniform(tr->args.seed ^ ((uint64_t)step << 32),
                                                             first + n));
                }
        }
        lg_trainer_micro_batches(tr, i, labels, mb);
        lg_trainer_backward(tr, mb, tr->loss_scale / tokens, 0, 0);
    }
    lg_trainer_sync_replicas(tr);
    if (!isfinite(lg_trainer_grad_norm(tr))) return; /* an fp16 overflow: keep the estimate */
    for (int r = 0; r < tr->local_ranks; r++) {
        lg_model *m = &tr->ranks[r].model;
        lg_optimizer_hessian_update(&tr->ranks[r].opt, &m->exec, m->grads, m->n_local, (double)tokens,
                                    1.0f / tr->loss_scale);
    }
}

/* Where micro-batch i of global rank g goes: its token buffers when this process drives it,
   else other_tokens (read, counted, dropped); spans (--pack) beside them. Returns its
   micro_T, or NULL. */
static int *lg_trainer_batch_place(lg_trainer *tr, int g, size_t at, lg_micro_batch *place) {
    int r = g - tr->first_rank, pack = tr->args.pack;
    if (r >= 0 && r < tr->local_ranks) {
        place->inputs = tr->ranks[r].inputs + at;
        place->targets = tr->ranks[r].targets + at;
        place->span_start = pack ? tr->ranks[r].spans + at : NULL;
        return tr->ranks[r].micro_T;
    }
    size_t one = lg_micro_batch_start(tr, 1);
    place->inputs = tr->other_tokens;
    place->targets = tr->other_tokens + one;
    place->span_start = pack ? tr->other_tokens + 2 * one : NULL;
    return NULL;
}

/* The next micro-batch of B rows into place: packed rows of the model's T (--pack) of at most
   `most` samples, or rows of the loader's (samples padded to the longest of the batch). Its row
   length into *T. */
static int lg_trainer_next_rows(lg_trainer *tr, lg_loader *ld, int B, size_t most,
                                const lg_micro_batch *place, int *T, lg_error *err) {
    if (!tr->args.pack) return lg_loader_next_batch(ld, B, (int *)place->inputs,
                                                    (int *)place->targets, T, err);
    int placed;
    *T = tr->ranks[0].model.T;
    return lg_loader_pack_rows(ld, B, *T, most, (int *)place->inputs, (int *)place->targets,
                               (int *)place->span_start, &placed, err);
}

/* Reads the step's micro-batches: micro-batch i of rank r is the (i ranks + r)-th; every
   process reads them all and keeps its ranks'. Returns the count of non-ignored targets of all
   ranks, or -1; sets step_tokens. */
static long lg_trainer_read_step(lg_trainer *tr, lg_loader *train, lg_error *err) {
    int B = tr->args.micro_batch_size;
    long n_targets = 0;
    tr->step_tokens = 0;
    for (int i = 0; i < tr->accumulation; i++)
        for (int g = 0; g < tr->n_ranks; g++) {
            lg_micro_batch place;
            int rows_T = 0;
            int *micro_T = lg_trainer_batch_place(tr, g, lg_micro_batch_start(tr, i), &place);
            if (lg_trainer_next_rows(tr, train, B, train->n_samples, &place, &rows_T, err) != 0)
                return -1;
            if (micro_T) micro_T[i] = rows_T;
            n_targets += lg_count_targets(place.targets, (size_t)B * rows_T);
            tr->step_tokens += (size_t)B * rows_T;
        }
    return n_targets;
}

/* Micro-batch i of the step on every rank: LoRA dropout's masks, each depending on the seed,
   the step and the micro-batch's place in the global batch, as with one rank; and the scale at
   which the forward's classifier pass writes the logits' gradient (lg_crossentropy_fused).
   step < 0: no dropout, and loss_scale 0: the forward keeps the logits (evaluation, sampling,
   Sophia's labels). */
static void lg_trainer_set_micro_step(lg_trainer *tr, int step, int i, float loss_scale) {
    for (int r = 0; r < tr->local_ranks; r++) { /* this process's ranks */
        uint64_t global = (uint64_t)i * (uint64_t)tr->n_ranks + (uint64_t)(tr->first_rank + r);
        lg_rng rng; /* the seed, step and micro-batch mixed into one key, never 0 */
        lg_rng_seed(&rng, (tr->args.seed ^ 0x64726f706f7574ULL /* "dropout" */) +
                              ((uint64_t)step << 32) + global);
        tr->ranks[r].model.dropout_key = step < 0 ? 0 : lg_rng_u64(&rng) | 1;
        tr->ranks[r].model.fused_loss_scale = loss_scale;
    }
}

/* The gradients of the step's global mean loss on every rank: each micro-batch's forward and
   backward (the loss scaled by loss_scale / n_targets), then the other processes' losses and
   the replicas' all-reduce. Returns the loss summed over every target. */
static double lg_trainer_accumulate(lg_trainer *tr, int step, long n_targets,
                                    int offload_in_backward) {
    const int *targets[LG_MAX_RANKS];
    lg_micro_batch mb[LG_MAX_RANKS];
    for (int r = 0; r < tr->local_ranks; r++) { /* sharded: the shards add every piece */
        lg_model *m = &tr->ranks[r].model;
        if (tr->plan.spec.offload_gradients) m->grads_overwrite = 1; /* (the first micro-batch's
                                                           units start afresh) */
        else if (tr->plan.sharding.grads_sharded) lg_model_zero_grad(m);
        else lg_model_start_grads(m);
        targets[r] = tr->ranks[r].targets;
    }
    double loss_sum = 0;
    float loss_scale = n_targets ? tr->loss_scale / n_targets : 0.0f;
    for (int i = 0; i < tr->accumulation && n_targets > 0; i++) {
        lg_trainer_micro_batches(tr, i, targets, mb);
        lg_trainer_set_micro_step(tr, step, i, loss_scale);
        loss_sum += lg_trainer_forward(tr, mb);
        lg_trainer_backward(tr, mb, loss_scale, i, offload_in_backward && i == tr->accumulation - 1);
    }
    for (int r = 0; r < tr->local_ranks; r++) { /* no backward ran (no targets): all zero */
        lg_model *m = &tr->ranks[r].model;
        if (m->grads_overwrite && tr->plan.spec.offload_gradients)
            lg_zero(lg_trainer_host_exec(&tr->ranks[r]), tr->ranks[r].host_grads, m->n_local);
        else if (m->grads_overwrite) lg_model_zero_grad(m);
        m->grads_overwrite = 0;
    }
    lg_trainer_set_micro_step(tr, -1, 0, 0.0f); /* evaluation and sampling: no dropout, the
                                                   logits kept */
    lg_comm_sum_doubles(tr->process_comm, &loss_sum, 1); /* the other processes' ranks' */
    lg_trainer_sync_replicas(tr);
    return loss_sum;
}

/* After the backward: an fp16 overflow (a non-finite norm with loss scaling) skips the step
   and halves the scale; a non-finite norm without scaling stops the run before it reaches the
   weights; a step whose targets are all ignored skips (no decay either); otherwise every rank
   updates its shard with the clipping and unscaling multiplier, and the scale doubles after
   scale_window clean steps. */
static int lg_trainer_update(lg_trainer *tr, int step, lg_step_stats *stats,
                             int offload_in_backward, lg_error *err) {
    float norm = stats->grad_norm;
    stats->skipped = 0;
    if (!isfinite(norm) && tr->scaling) { /* overflow: skip, halve, try again next step */
        stats->skipped = LG_SKIPPED_OVERFLOW;
        tr->loss_scale *= 0.5f;
        tr->clean_steps = 0;
        return 0;
    }
    if (!isfinite(norm)) {
        stats->diverged = 1;
        return lg_fail(err, "step %d: the gradient norm is %g; stopped before it reached the "
                            "weights", step + 1, norm);
    }
    if (stats->n_targets == 0) {
        stats->skipped = LG_SKIPPED_NO_TARGETS;
        return 0;
    }
    float multiplier = lg_clip_factor(norm, tr->args.max_norm) / tr->loss_scale;
    for (int r = 0; r < tr->local_ranks && !offload_in_backward; r++)
        lg_trainer_offload_grads(&tr->ranks[r]);
    for (int r = 0; r < tr->local_ranks; r++)
        lg_trainer_update_rank(&tr->ranks[r], stats->lr, multiplier);
    lg_trainer_share_updated_weights(tr);
    if (tr->scaling && ++tr->clean_steps == tr->scale_window) {
        tr->loss_scale *= 2.0f;
        tr->clean_steps = 0;
    }
    return 0;
}

int lg_trainer_evaluate(lg_trainer *tr, lg_loader *ld, int n_batches, double *mean_loss,
                        lg_error *err) {
    int B = tr->args.micro_batch_size, T = tr->ranks[0].model.T;
    *mean_loss = 0;
    if (ld->T > T)
        return lg_fail(err, "evaluation of %s: rows of %d tokens, but the trainer was made for "
                            "%d", ld->path, ld->T, T);
    lg_loader_rewind(ld);
    lg_micro_batch mb[LG_MAX_RANKS];
    double sum = 0;
    long count = 0;
    for (int first = 0; first < n_batches && lg_loader_left(ld) > 0; first += tr->n_ranks) {
        for (int g = 0; g < tr->n_ranks; g++) { /* every process reads, keeps its ranks' */
            lg_micro_batch place;
            size_t left = lg_loader_left(ld); /* each window once: the last batch may be short */
            int rows = first + g < n_batches && left ? B : 0, rows_T = T;
            if (!tr->args.pack && (size_t)rows > left) rows = (int)left;
            int here = lg_trainer_batch_place(tr, g, 0, &place) != NULL;
            if (rows && lg_trainer_next_rows(tr, ld, rows, left, &place, &rows_T, err) != 0)
                return -1;
            count += lg_count_targets(place.targets, (size_t)rows * rows_T);
            if (!here) continue;
            place.B = rows;
            place.T = rows_T;
            mb[g - tr->first_rank] = place;
        }
        sum += lg_trainer_forward(tr, mb);
    }
    lg_comm_sum_doubles(tr->process_comm, &sum, 1);
    *mean_loss = count ? sum / count : 0;
    return lg_trainer_check_ranks(tr, err);
}

void lg_trainer_generate(lg_trainer *tr, int *tokens, int n_prompt, int n_new, int vocab,
                         float temperature, lg_rng *rng) {
    const lg_model *m = &tr->ranks[0].model;
    int Vp = m->cfg.padded_vocab_size;
    lg_micro_batch mb[LG_MAX_RANKS];
    memset(mb, 0, sizeof mb);
    if (n_prompt < 1) return; /* nothing to continue from */
    for (int i = 0; i < n_new; i++) {
        int n = n_prompt + i, start = n > m->T ? n - m->T : 0;
        mb[0].inputs = tokens + start;
        mb[0].B = 1;
        mb[0].T = n - start;
        lg_trainer_forward(tr, mb);
        lg_rank_sync(m->rank); /* the host reads the logits */
        lg_visit row = lg_visit_start(&m->exec, lg_head_logits_row(m, mb[0].T, mb[0].T - 1),
                                      (size_t)Vp, (size_t)Vp, LG_VISIT_READ);
        while (lg_visit_next(&row))
            tokens[n] = lg_sample_token(row.piece, vocab > 0 && vocab < m->cfg.vocab_size ? vocab : m->cfg.vocab_size, temperature, rng);
    }
}

void lg_trainer_weights(lg_trainer *tr, lg_buf whole) {
    const lg_shard_layout *sl = &tr->plan.shards;
    const lg_model *m0 = &tr->ranks[0].model;
    if (!tr->plan.sharding.weights_sharded) { /* whole: on the device, or streamed from the host */
        lg_copy(&m0->exec, whole, m0->params, m0->n_params);
        lg_rank_sync(m0->rank);
        return;
    }
    for (int u = 0; u < sl->n_units; u++) {
        lg_trainer_gather_unit(tr, u);
        lg_trainer_await_unit(tr, u);
        lg_copy(&m0->exec, lg_at(whole, sl->unit_offset[u]), lg_unit_weights(tr, 0, u),
                sl->unit_offset[u + 1] - sl->unit_offset[u]);
    }
    lg_rank_sync(m0->rank);
}

void lg_trainer_set_weights(lg_trainer *tr, lg_buf whole) {
    for (int r = 0; r < tr->local_ranks; r++) {
        lg_trainer_rank *tr_r = &tr->ranks[r];
        lg_model *m = &tr_r->model;
        const lg_exec *ex = &m->exec;
        if (m->weights_gathered) lg_copy_from_whole(ex, m->local, m->params, whole);
        else lg_copy(ex, m->params, whole, m->n_params);
        if (tr_r->opt.master) lg_copy_from_whole(ex, m->local, lg_buf_of(tr_r->opt.master), whole);
        if (tr_r->host_weights.data) lg_copy_from_whole(ex, m->local, tr_r->host_weights, whole);
        lg_rank_sync(m->rank);
    }
}

void lg_trainer_free(lg_trainer *tr) {
    for (int i = 0; i < LG_MAX_RANKS; i++) {
        lg_comm_free(tr->shard_comm[i]);
        lg_comm_free(tr->replica_comm[i]);
    }
    lg_comm_free(tr->world_comm);
    lg_comm_free(tr->process_comm);
    LG_FREE(tr->other_tokens);
    for (int r = 0; tr->ranks && r < tr->local_ranks; r++) {
        lg_optimizer_free(&tr->ranks[r].opt);
        LG_FREE(tr->ranks[r].micro_T);
        lg_model_free(&tr->ranks[r].model);
        lg_rank_free(&tr->ranks[r].rank);
    }
    LG_FREE(tr->ranks);
    tr->ranks = NULL;
    lg_plan_free(&tr->plan);
}

/* 15. run checkpoints ------------------------------------------------------------------------- */

/* A run's checkpoints: each rank's master weights, optimizer state, counters and data
   position, gathered one sharding unit at a time; resume; the trainer's save and load of
   whole models and adapters. */


/* --- training state: one rank's master weights, optimizer state, counters and data position,
   in logical layout (whole tensors by LitGPT parameter name) ------------------------------- */

/* A tensor of the training state: where it lives in the trainer and how it is stored. */
typedef struct {
    lg_st_tensor desc; /* name, file dtype, shape */
    void *data;        /* the trainer's (or loader's) memory */
    const lg_exec *ex; /* the rank whose memory data is (NULL: the host's): read and written
                          through lg_visit, since a GPU's memory is not the host's */
    int is_real;       /* data holds lg_real, stored as F32 */
    int is_index;      /* data holds size_t, stored as I64 (the loader's window order) */
    const lg_tensor_info *tensor; /* the parameter it belongs to (NULL: the loader's) */
} lg_state_view;

static void lg_state_view_add(lg_state_view *v, int *n, const char *prefix, const lg_tensor_info *t,
                              void *data, lg_st_dtype dtype, int is_real, int64_t count) {
    lg_state_view *s = &v[(*n)++];
    memset(s, 0, sizeof *s);
    lg_format(s->desc.name, sizeof s->desc.name, "%s.%s", prefix, t ? t->name : "order");
    s->tensor = t;
    s->desc.dtype = dtype;
    s->data = data;
    s->is_real = is_real;
    s->desc.ndim = t && t->rows > 1 && count == (int64_t)t->count ? 2 : 1;
    s->desc.shape[0] = s->desc.ndim == 2 ? t->rows : count;
    s->desc.shape[1] = s->desc.ndim == 2 ? t->cols : 0;
}

/* One parameter's optimizer states (fp32, half or 8-bit codes with block scales). */
static void lg_state_views_of_tensor(const lg_optimizer *opt, const lg_tensor_info *t,
                                     lg_state_cursor *cursor, lg_state_view *v, int *n) {
    lg_tensor_state st = lg_state_of(opt, t, cursor);
    lg_buf bufs[2] = {st.m, st.v};
    float *scales[2] = {st.m_scales, st.v_scales};
    int states = lg_optimizer_states(opt->kind, opt->momentum != 0.0f);
    for (int k = 0; k < states && k < 2; k++) {
        if (!bufs[k].data) continue;
        const char *name = lg_optimizer_state_name(opt->kind, k);
        lg_dtype d = bufs[k].dtype;
        lg_st_dtype file = d == LG_DTYPE_U8 ? LG_ST_U8 : lg_st_dtype_of(d);
        lg_state_view_add(v, n, name, t, bufs[k].data, file, d == LG_DTYPE_F32, (int64_t)t->count);
        if (d == LG_DTYPE_U8 && scales[k]) {
            char prefix[LG_MAX_NAME];
            lg_format(prefix, sizeof prefix, "%s.scales", name);
            lg_state_view_add(v, n, prefix, t, scales[k], LG_ST_F32, 0,
                              (int64_t)((t->count + LG_QUANT_BLOCK - 1) / LG_QUANT_BLOCK));
        }
    }
}

/* Every tensor of the training state, in a fixed order: the master weights and optimizer state
   of `opt` (in ex's memory; NULL: the host's) laid out by `table` (the whole layout), the
   loader's order. *out: LG_MALLOC. */
static int lg_state_views(const lg_optimizer *opt, const lg_exec *ex, const lg_tensor_table *table,
                          const lg_loader *data, lg_state_view **out, int *n) {
    lg_state_view *v = (lg_state_view *)lg_alloc_zeroed(sizeof(lg_state_view) * (size_t)(5 * table->n_tensors + 2));
    if (!v) return -1;
    lg_state_cursor cursor = {0, 0, 0};
    *n = 0;
    for (int i = 0; i < table->n_tensors; i++) {
        const lg_tensor_info *t = &table->tensors[i];
        if (opt->master)
            lg_state_view_add(v, n, "master", t, opt->master + t->offset, LG_ST_F32, 1, (int64_t)t->count);
        lg_state_views_of_tensor(opt, t, &cursor, v, n);
    }
    for (int i = 0; i < *n; i++) v[i].ex = ex;
    if (data && data->order) {
        lg_state_view_add(v, n, "loader", NULL, data->order, LG_ST_I64, 0, (int64_t)data->n_windows);
        v[*n - 1].is_index = 1;
    }
    *out = v;
    return 0;
}

/* The master weights and optimizer state of a trainer in the whole layout. Unsharded, rank 0's
   own (replicas hold the same); sharded, buffers of whole tensors (*owned, LG_MALLOC) that the
   shards are copied into or out of. Compact state (bf16, 8-bit) is quantized in blocks of each
   rank's pieces, which do not line up with whole tensors: a sharded run with it has no logical
   state to write. */
typedef struct {
    lg_optimizer opt;          /* rank 0's, with master, m and v pointing at whole buffers */
    const lg_exec *ex;         /* whose memory opt's buffers are: rank 0's, or NULL (owned) */
    const lg_tensor_table *table; /* the whole layout */
    void *owned;               /* the whole buffers when sharded, else NULL */
} lg_whole_state;

int lg_checkpoint_supported(const lg_trainer *tr, lg_error *err) {
    if (tr->plan.sharding.shard_ranks > 1 && tr->ranks[0].opt.format != LG_STATE_AS_PRECISION)
        return lg_fail(err, "checkpoints of a sharded run (`strategy %s` over %d ranks) with "
                            "`optimizer_state bf16|8bit` are not supported: the state is quantized "
                            "in blocks of each shard; use `strategy no-shard` or the default state",
                       lg_strategy_name(tr->args.strategy), tr->plan.sharding.shard_ranks);
    return 0;
}

static int lg_whole_state_make(const lg_trainer *tr, lg_whole_state *w, lg_error *err) {
    const lg_model *m0 = &tr->ranks[0].model;
    w->opt = tr->ranks[0].opt;
    w->ex = &m0->exec;
    w->table = &m0->param_table;
    w->owned = NULL;
    if (tr->plan.sharding.shard_ranks == 1) return 0;
    w->ex = NULL;
    if (lg_checkpoint_supported(tr, err) != 0) return -1;
    size_t n = m0->n_params, state = lg_elem_size(w->opt.m.dtype);
    unsigned char *p = (unsigned char *)lg_alloc_zeroed(n * (sizeof(lg_real) + 2 * state));
    if (!p) return lg_fail(err, "out of host memory for the training state");
    w->owned = p;
    if (w->opt.master) w->opt.master = (lg_real *)p;
    if (w->opt.m.data) w->opt.m.data = p + n * sizeof(lg_real);
    if (w->opt.v.data) w->opt.v.data = p + n * (sizeof(lg_real) + state);
    return 0;
}

/* Unsharded replicas (no-shard): rank 0 read the state; the others take its regions as they
   are (on GPUs a copy from rank 0's GPU to theirs, on rank 0's stream). */
static void lg_copy_state_to_replicas(lg_trainer *tr) {
    const lg_rank_plan *plan0 = &tr->plan.ranks[0];
    const lg_exec *ex0 = &tr->ranks[0].model.exec;
    for (int r = 1; r < tr->local_ranks; r++) {
        lg_rank_sync(&tr->ranks[r].rank); /* nothing of its own still writes its regions */
        for (int i = 0; i < plan0->n_regions; i++) {
            const lg_region *x = &plan0->regions[i];
            if (x->group != LG_GROUP_OPTIMIZER && x->group != LG_GROUP_MASTER) continue;
            lg_buf dst = {lg_rank_region(&tr->ranks[r].rank, x->name), LG_DTYPE_U8};
            lg_buf src = {lg_rank_region(&tr->ranks[0].rank, x->name), LG_DTYPE_U8};
            lg_copy(ex0, dst, src, x->bytes);
        }
    }
    lg_rank_sync(&tr->ranks[0].rank);
}

/* Sharded: copies each rank's pieces into the whole buffers (to_whole, the members of shard
   group 0 suffice) or out of them (every rank, replicas included). Unsharded, reading: rank 0
   holds the state, the replicas copy it. In several processes each reads the files itself
   (every process's first rank stands for rank 0), and the whole buffers, zero where another
   process's pieces go, add up over the processes. */
static void lg_whole_state_exchange(lg_trainer *tr, lg_whole_state *w, int to_whole) {
    if (!w->owned) {
        if (!to_whole) lg_copy_state_to_replicas(tr);
        return;
    }
    lg_buf whole[LG_UNIT_PARTS] = {lg_buf_of(w->opt.master), w->opt.m, w->opt.v};
    for (int r = 0; r < tr->local_ranks; r++) {
        if (to_whole && tr->first_rank + r >= tr->plan.sharding.shard_ranks) break;
        lg_optimizer *opt = &tr->ranks[r].opt;
        const lg_tensor_table *local = tr->ranks[r].model.local;
        lg_buf shard[LG_UNIT_PARTS] = {lg_buf_of(opt->master), opt->m, opt->v};
        const lg_exec *ex = &tr->ranks[r].model.exec;
        for (int k = 0; k < LG_UNIT_PARTS; k++) {
            if (!shard[k].data || !whole[k].data) continue;
            if (to_whole) lg_copy_to_whole(ex, local, whole[k], shard[k]);
            else lg_copy_from_whole(ex, local, shard[k], whole[k]);
        }
        lg_rank_sync(&tr->ranks[r].rank);
    }
    for (int k = 0; k < LG_UNIT_PARTS && to_whole && tr->process_comm; k++)
        if (whole[k].data) lg_all_reduce_sum(tr->process_comm, 1, &whole[k], tr->ranks[0].model.n_params);
}

/* A tensor's file bytes from its place. */
static int lg_state_fill(void *ctx, int index, unsigned char *out, lg_error *err) {
    const lg_state_view *s = &((const lg_state_view *)ctx)[index];
    size_t count = (size_t)lg_st_count(&s->desc);
    if (s->is_real) {
        lg_visit v = lg_visit_start(s->ex, lg_buf_of((lg_real *)s->data), count, 1, LG_VISIT_READ);
        while (lg_visit_next(&v))
            for (size_t i = 0; i < v.n; i++)
                lg_st_set(LG_ST_F32, out, v.first + i, ((const lg_real *)v.piece.data)[i]);
    } else if (s->is_index) {
        for (size_t i = 0; i < count; i++) {
            int64_t v = (int64_t)((const size_t *)s->data)[i];
            memcpy(out + 8 * i, &v, 8);
        }
    } else {
        lg_buf place = {s->data, LG_DTYPE_U8};
        lg_rank_bytes(s->ex, place, out, count * lg_st_dtype_size(s->desc.dtype), 1);
    }
    (void)err;
    return 0;
}

/* Copies a tensor's file bytes into its place; the loader's order is checked window by window. */
static int lg_state_store(const lg_state_view *s, const unsigned char *bytes, size_t n_windows) {
    size_t count = (size_t)lg_st_count(&s->desc);
    if (s->is_real) {
        lg_visit v = lg_visit_start(s->ex, lg_buf_of((lg_real *)s->data), count, 1, LG_VISIT_WRITE);
        while (lg_visit_next(&v))
            for (size_t i = 0; i < v.n; i++)
                ((lg_real *)v.piece.data)[i] = lg_st_get(LG_ST_F32, bytes, v.first + i);
    } else if (s->is_index) {
        for (size_t i = 0; i < count; i++) {
            int64_t v;
            memcpy(&v, bytes + 8 * i, 8);
            if (v < 0 || (uint64_t)v >= n_windows) return -1;
            ((size_t *)s->data)[i] = (size_t)v;
        }
    } else {
        lg_buf place = {s->data, LG_DTYPE_U8};
        lg_rank_bytes(s->ex, place, (void *)bytes, count * lg_st_dtype_size(s->desc.dtype), 0);
    }
    return 0;
}

/* The scalars of the training state: one metadata string a key, in the file's order. The
   ranks are not among them: the state is in the whole layout, so a run may resume on another
   number of ranks. The writer (lg_state_meta), the check that a run is the one that wrote the
   file (lg_state_check_run) and the reader (lg_training_state_read) walk this table. */
typedef enum {
    LG_STATE_FORMAT,            /* "litgpt.c training state 1" */
    LG_STATE_STEP,              /* steps done */
    LG_STATE_CONFIG,            /* the model's name */
    LG_STATE_N_PARAMS,
    LG_STATE_LORA,              /* rank, alpha, dropout, targets, quantization */
    LG_STATE_PRECISION,
    LG_STATE_OPTIMIZER,
    LG_STATE_OPTIMIZER_STATE,   /* its storage format */
    LG_STATE_SEED,
    LG_STATE_GLOBAL_BATCH,
    LG_STATE_SEQ_LENGTH,
    LG_STATE_OPTIMIZER_UPDATES, /* the optimizer's t (bias corrections) */
    LG_STATE_LOSS_SCALE_BITS,   /* the loss scale's fp32 bits, exactly */
    LG_STATE_LOSS_SCALE,        /* the same for a reader */
    LG_STATE_CLEAN_STEPS,       /* steps since the scale last changed */
    LG_STATE_LOADER_WINDOWS,
    LG_STATE_LOADER_POSITION,
    LG_STATE_LOADER_EPOCH,
    LG_STATE_LOADER_RNG,
    LG_N_STATE_SCALARS
} lg_state_scalar;

typedef enum {
    LG_STATE_SAYS,     /* for a reader of the file only */
    LG_STATE_SAME_RUN, /* the resuming run must have the same value */
    LG_STATE_RESUMED   /* a number the resuming run takes over */
} lg_state_role;

static const struct {
    lg_state_scalar scalar;
    const char *key;
    lg_state_role role;
} lg_state_scalars[LG_N_STATE_SCALARS] = { /* in the file's order */
    {LG_STATE_FORMAT, "format", LG_STATE_SAYS},
    {LG_STATE_STEP, "step", LG_STATE_RESUMED},
    {LG_STATE_CONFIG, "config", LG_STATE_SAME_RUN},
    {LG_STATE_N_PARAMS, "n_params", LG_STATE_SAME_RUN},
    {LG_STATE_LORA, "lora", LG_STATE_SAME_RUN},
    {LG_STATE_PRECISION, "precision", LG_STATE_SAME_RUN},
    {LG_STATE_OPTIMIZER, "optimizer", LG_STATE_SAME_RUN},
    {LG_STATE_OPTIMIZER_STATE, "optimizer_state", LG_STATE_SAME_RUN},
    {LG_STATE_SEED, "seed", LG_STATE_SAME_RUN},
    {LG_STATE_GLOBAL_BATCH, "global_batch", LG_STATE_SAME_RUN},
    {LG_STATE_SEQ_LENGTH, "seq_length", LG_STATE_SAME_RUN},
    {LG_STATE_OPTIMIZER_UPDATES, "optimizer_updates", LG_STATE_RESUMED},
    {LG_STATE_LOSS_SCALE_BITS, "loss_scale_bits", LG_STATE_RESUMED},
    {LG_STATE_LOSS_SCALE, "loss_scale", LG_STATE_SAYS},
    {LG_STATE_CLEAN_STEPS, "clean_steps", LG_STATE_RESUMED},
    {LG_STATE_LOADER_WINDOWS, "loader_windows", LG_STATE_SAME_RUN},
    {LG_STATE_LOADER_POSITION, "loader_position", LG_STATE_RESUMED},
    {LG_STATE_LOADER_EPOCH, "loader_epoch", LG_STATE_RESUMED},
    {LG_STATE_LOADER_RNG, "loader_rng", LG_STATE_RESUMED},
};

/* The metadata key of scalar k. */
static const char *lg_state_key(lg_state_scalar k) {
    for (int i = 0; i < LG_N_STATE_SCALARS; i++)
        if (lg_state_scalars[i].scalar == k) return lg_state_scalars[i].key;
    return "";
}

/* Scalar k of a run's state at step, as its metadata string. */
static void lg_state_value(const lg_trainer *tr, const lg_loader *data, int step,
                           lg_state_scalar k, char *out, size_t cap) {
    static const char *const formats[3] = {"as-precision", "bf16", "8bit"}; /* lg_state_format */
    const lg_model *m0 = &tr->ranks[0].model;
    const lg_optimizer *opt0 = &tr->ranks[0].opt;
    const lg_lora *lo = &m0->cfg.lora;
    float scale = tr->loss_scale;
    uint32_t scale_bits;
    memcpy(&scale_bits, &scale, 4);
    char targets[64];
    switch (k) {
    case LG_STATE_FORMAT: lg_format(out, cap, "litgpt.c training state 1"); break;
    case LG_STATE_STEP: lg_format(out, cap, "%d", step); break;
    case LG_STATE_CONFIG: lg_format(out, cap, "%s", m0->cfg.name); break;
    case LG_STATE_N_PARAMS: lg_format(out, cap, "%zu", m0->n_params); break;
    case LG_STATE_LORA:
        lg_lora_targets_name(lo->r ? lo->targets : 0, targets, sizeof targets);
        lg_format(out, cap, "r %d alpha %g dropout %g targets %s quantize %s", lo->r, lo->alpha,
                  lo->dropout, targets, lg_quantization_name(lo->quantize));
        break;
    case LG_STATE_PRECISION:
        lg_format(out, cap, "%s", lg_precision_name(tr->args.precision));
        break;
    case LG_STATE_OPTIMIZER: lg_format(out, cap, "%s", lg_optimizer_name(opt0->kind)); break;
    case LG_STATE_OPTIMIZER_STATE: lg_format(out, cap, "%s", formats[opt0->format]); break;
    case LG_STATE_SEED: lg_format(out, cap, "%llu", (unsigned long long)tr->args.seed); break;
    case LG_STATE_GLOBAL_BATCH:
        lg_format(out, cap, "%d", tr->args.micro_batch_size * tr->accumulation * tr->n_ranks);
        break;
    case LG_STATE_SEQ_LENGTH: lg_format(out, cap, "%d", m0->T); break;
    case LG_STATE_OPTIMIZER_UPDATES: lg_format(out, cap, "%d", opt0->t); break;
    case LG_STATE_LOSS_SCALE_BITS: lg_format(out, cap, "0x%08x", (unsigned)scale_bits); break;
    case LG_STATE_LOSS_SCALE: lg_format(out, cap, "%g", scale); break;
    case LG_STATE_CLEAN_STEPS: lg_format(out, cap, "%d", tr->clean_steps); break;
    case LG_STATE_LOADER_WINDOWS:
        lg_format(out, cap, "%zu", data ? data->n_windows : (size_t)0);
        break;
    case LG_STATE_LOADER_POSITION:
        lg_format(out, cap, "%zu", data ? data->position : (size_t)0);
        break;
    case LG_STATE_LOADER_EPOCH: lg_format(out, cap, "%d", data ? data->epoch : 0); break;
    case LG_STATE_LOADER_RNG:
        lg_format(out, cap, "0x%016llx", data ? (unsigned long long)data->rng.state : 0ULL);
        break;
    case LG_N_STATE_SCALARS: break;
    }
}

/* The state's scalars as metadata (meta: LG_N_STATE_SCALARS entries); returns how many. */
static int lg_state_meta(const lg_trainer *tr, const lg_loader *data, int step, lg_st_meta *meta) {
    for (int k = 0; k < LG_N_STATE_SCALARS; k++) {
        lg_format(meta[k].key, sizeof meta[k].key, "%s", lg_state_scalars[k].key);
        lg_state_value(tr, data, step, lg_state_scalars[k].scalar, meta[k].value,
                       sizeof meta[k].value);
    }
    return LG_N_STATE_SCALARS;
}

typedef struct {
    lg_trainer *tr;
    int state;              /* 1: the training state, 0: the weights */
    lg_tensor_table units;  /* the whole table, each offset within its tensor's unit */
    lg_buf part[LG_UNIT_PARTS]; /* state: (largest unit) master, m, v in checkpoint.gather */
    lg_state_view *views;   /* state: what process 0 writes */
    int current;            /* the unit brought last (-1: none) */
    int changes;            /* units brought so far */
} lg_unit_walk;

static int lg_unit_walk_start(lg_unit_walk *w, lg_trainer *tr, int state, lg_error *err) {
    const lg_tensor_table *whole = &tr->ranks[0].model.param_table;
    const lg_shard_layout *sl = &tr->plan.shards;
    memset(w, 0, sizeof *w);
    w->tr = tr;
    w->state = state;
    w->current = -1;
    w->units = *whole;
    w->units.tensors = (lg_tensor_info *)LG_MALLOC(sizeof(lg_tensor_info) * (size_t)(whole->n_tensors + 1));
    if (!w->units.tensors) return lg_fail(err, "out of host memory for a checkpoint");
    for (int i = 0; i < whole->n_tensors; i++) {
        w->units.tensors[i] = whole->tensors[i];
        w->units.tensors[i].offset -= sl->unit_offset[whole->tensors[i].block + 1];
    }
    size_t at[LG_UNIT_PARTS];
    unsigned char *region = (unsigned char *)lg_rank_region(&tr->ranks[0].rank,
                                                            LG_REGION_CHECKPOINT_GATHER);
    lg_checkpoint_unit_layout(&tr->plan, at);
    const lg_optimizer *opt = &tr->ranks[0].opt;
    lg_dtype types[LG_UNIT_PARTS] = {LG_DTYPE_F32, opt->m.dtype, opt->v.dtype};
    for (int k = 0; k < LG_UNIT_PARTS && state; k++) {
        w->part[k].dtype = types[k];
        w->part[k].data = region && at[k] != (size_t)-1 ? region + at[k] : NULL;
    }
    if (state && !region) {
        LG_FREE(w->units.tensors);
        return lg_fail(err, "the plan holds no checkpoint.gather for this sharded run");
    }
    return 0;
}

/* The training state of unit u, whole, in the parts: the pieces of shard group 0's members
   that this process drives in their places, zero elsewhere, summed over the processes. */
static void lg_unit_walk_assemble(lg_unit_walk *w, int u) {
    lg_trainer *tr = w->tr;
    const lg_shard_layout *sl = &tr->plan.shards;
    size_t count = sl->piece_count[u], unit = sl->unit_offset[u + 1] - sl->unit_offset[u];
    for (int k = 0; k < LG_UNIT_PARTS; k++)
        if (w->part[k].data) lg_zero(NULL, w->part[k], count * (size_t)sl->n_shards);
    for (int r = 0; r < tr->local_ranks && tr->first_rank + r < sl->n_shards; r++) {
        const lg_optimizer *opt = &tr->ranks[r].opt;
        lg_buf shard[LG_UNIT_PARTS] = {lg_buf_of(opt->master), opt->m, opt->v};
        size_t first = (size_t)(tr->first_rank + r) * count;
        size_t live = first >= unit ? 0 : unit - first < count ? unit - first : count;
        for (int k = 0; k < LG_UNIT_PARTS; k++)
            if (w->part[k].data && shard[k].data && live)
                lg_copy(&tr->ranks[r].model.exec, lg_at(w->part[k], first),
                        lg_at(shard[k], sl->piece_offset[u]), live);
        lg_rank_sync(&tr->ranks[r].rank);
    }
    for (int k = 0; k < LG_UNIT_PARTS && tr->process_comm; k++)
        if (w->part[k].data) lg_all_reduce_sum(tr->process_comm, 1, &w->part[k], unit);
}

/* Brings unit u unless it is the one brought last. */
static void lg_unit_walk_bring(lg_unit_walk *w, int u) {
    if (u == w->current) return;
    w->current = u;
    w->changes++;
    if (w->state) {
        lg_unit_walk_assemble(w, u);
        return;
    }
    lg_trainer_gather_unit(w->tr, u);
    lg_trainer_await_unit(w->tr, u);
}

/* The rest of the sequence every process walks: a unit for each change of unit along the
   table (process 0's writes follow the table's order; after a failed write it catches up). */
static void lg_unit_walk_finish(lg_unit_walk *w) {
    for (int i = 0, previous = -1, k = 0; i < w->units.n_tensors; i++) {
        int u = w->units.tensors[i].block + 1;
        if (u == previous) continue;
        previous = u;
        if (++k > w->changes) lg_unit_walk_bring(w, u);
    }
    LG_FREE(w->units.tensors);
}

/* lg_hf_write_model_from's source of weights: rank 0's gathered unit. */
static lg_buf lg_unit_walk_weights(void *walk, int source) {
    lg_unit_walk *w = (lg_unit_walk *)walk;
    int u = w->units.tensors[source].block + 1;
    lg_unit_walk_bring(w, u);
    return lg_unit_weights(w->tr, 0, u);
}

static int lg_state_fill_by_unit(void *walk, int index, unsigned char *out, lg_error *err) {
    lg_unit_walk *w = (lg_unit_walk *)walk;
    if (w->views[index].tensor) lg_unit_walk_bring(w, w->views[index].tensor->block + 1);
    return lg_state_fill(w->views, index, out, err);
}

/* The training state of a sharded run, unit by unit (see lg_unit_walk). */
static int lg_training_state_write_units(lg_trainer *tr, const lg_loader *data, int step,
                                         const char *path, lg_file_digest *digest,
                                         lg_error *err) {
    lg_unit_walk w;
    if (lg_unit_walk_start(&w, tr, 1, err) != 0) return -1;
    lg_optimizer opt = tr->ranks[0].opt; /* its state in the parts, in unit-relative layout */
    if (opt.master) opt.master = (lg_real *)w.part[LG_PART_MASTER].data;
    opt.m.data = opt.m.data ? w.part[LG_PART_M].data : NULL;
    opt.v.data = opt.v.data ? w.part[LG_PART_V].data : NULL;
    lg_st_tensor *tensors = NULL;
    int n = 0, rc = 0;
    if (tr->process == 0) {
        if (lg_state_views(&opt, NULL, &w.units, data, &w.views, &n) == 0) /* parts: host */
            tensors = (lg_st_tensor *)lg_alloc_zeroed(sizeof(lg_st_tensor) * (size_t)(n + 1));
        lg_st_meta meta[LG_N_STATE_SCALARS];
        int n_meta = lg_state_meta(tr, data, step, meta);
        for (int i = 0; tensors && i < n; i++) tensors[i] = w.views[i].desc;
        rc = tensors ? lg_st_write(path, tensors, n, meta, n_meta, lg_state_fill_by_unit, &w, digest, err)
                     : lg_fail(err, "out of host memory");
    }
    lg_unit_walk_finish(&w);
    LG_FREE(tensors);
    LG_FREE(w.views);
    return rc;
}

/* The training state to path (lg_training_state_read reads it back). */
static int lg_training_state_write(lg_trainer *tr, const lg_loader *data, int step,
                                   const char *path, lg_file_digest *digest, lg_error *err) {
    if (lg_rank_region(&tr->ranks[0].rank, LG_REGION_CHECKPOINT_GATHER))
        return lg_training_state_write_units(tr, data, step, path, digest, err);
    lg_whole_state w;
    if (lg_whole_state_make(tr, &w, err) != 0) return -1;
    lg_whole_state_exchange(tr, &w, 1);
    if (tr->process != 0) { /* process 0 writes */
        LG_FREE(w.owned);
        return 0;
    }
    lg_state_view *views = NULL;
    int n = 0;
    if (lg_state_views(&w.opt, w.ex, w.table, data, &views, &n) != 0) {
        LG_FREE(w.owned);
        return lg_fail(err, "out of host memory");
    }
    lg_st_tensor *tensors = (lg_st_tensor *)lg_alloc_zeroed(sizeof(lg_st_tensor) * (size_t)(n + 1));
    lg_st_meta meta[LG_N_STATE_SCALARS];
    int n_meta = lg_state_meta(tr, data, step, meta);
    for (int i = 0; tensors && i < n; i++) tensors[i] = views[i].desc;
    int rc = tensors ? lg_st_write(path, tensors, n, meta, n_meta, lg_state_fill, views, digest, err)
                     : lg_fail(err, "out of host memory");
    LG_FREE(tensors);
    LG_FREE(views);
    LG_FREE(w.owned);
    return rc;
}

/* A metadata value as an unsigned integer (decimal or 0x hex); -1 naming the key. */
static int lg_state_number(const lg_st_file *f, const char *key, unsigned long long *out,
                           lg_error *err) {
    const char *v = lg_st_meta_get(f, key);
    char *end = NULL;
    errno = 0;
    if (v && isdigit((unsigned char)*v)) *out = strtoull(v, &end, 0); /* no sign: counts */
    if (!v || !end || *end || errno == ERANGE)
        return lg_fail(err, "training state %s: %s is %s", f->path, key,
                       v ? "not a non-negative integer" : "missing");
    return 0;
}

/* The resumed numbers in range: counts within int (the optimizer's updates no more than the
   steps), a loss scale that is a positive finite float, a loader random state that is not 0
   (xorshift's one fixed point). */
static int lg_state_numbers_check(const unsigned long long *v, const char *path, lg_error *err) {
    const lg_state_scalar counts[] = {LG_STATE_STEP, LG_STATE_OPTIMIZER_UPDATES,
                                      LG_STATE_CLEAN_STEPS, LG_STATE_LOADER_EPOCH};
    for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++)
        if (v[counts[k]] > 2147483647ull)
            return lg_fail(err, "training state %s: %s %llu is beyond 2147483647", path,
                           lg_state_key(counts[k]), v[counts[k]]);
    if (v[LG_STATE_OPTIMIZER_UPDATES] > v[LG_STATE_STEP])
        return lg_fail(err, "training state %s: optimizer_updates %llu exceeds step %llu", path,
                       v[LG_STATE_OPTIMIZER_UPDATES], v[LG_STATE_STEP]);
    uint32_t bits = (uint32_t)v[LG_STATE_LOSS_SCALE_BITS];
    float scale;
    memcpy(&scale, &bits, 4);
    if (v[LG_STATE_LOSS_SCALE_BITS] > 0xFFFFFFFFull || !(isfinite(scale) && scale > 0.0f))
        return lg_fail(err, "training state %s: loss_scale_bits %llu is not a positive finite "
                            "loss scale", path, v[LG_STATE_LOSS_SCALE_BITS]);
    if (v[LG_STATE_LOADER_RNG] == 0)
        return lg_fail(err, "training state %s: loader_rng is 0, no state of the generator", path);
    return 0;
}

/* The run must be the one that wrote the state: same model, precision, optimizer and batch
   (the LG_STATE_SAME_RUN scalars). */
static int lg_state_check_run(const lg_trainer *tr, const lg_loader *data, const lg_st_file *f,
                              lg_error *err) {
    char want[sizeof ((lg_st_meta *)0)->value];
    lg_state_value(tr, data, 0, LG_STATE_FORMAT, want, sizeof want);
    const char *format = lg_st_meta_get(f, lg_state_key(LG_STATE_FORMAT));
    if (!format || strcmp(format, want) != 0)
        return lg_fail(err, "training state %s: not a litgpt.c training state (format '%s')", f->path,
                       format ? format : "missing");
    for (int k = 0; k < LG_N_STATE_SCALARS; k++) {
        const char *key = lg_state_scalars[k].key, *have = lg_st_meta_get(f, key);
        if (lg_state_scalars[k].role != LG_STATE_SAME_RUN) continue;
        lg_state_value(tr, data, 0, lg_state_scalars[k].scalar, want, sizeof want);
        if (!have || strcmp(have, want) != 0)
            return lg_fail(err, "training state %s: written with %s %s, this run has %s: resume "
                                "with the run's settings", f->path, key, have ? have : "(none)",
                           want);
    }
    return 0;
}

/* A float tensor of the state holds finite numbers, and a second moment (optimizer.v.*) no
   negative one: else the run would resume into NaN. */
static int lg_state_values_check(const lg_st_file *f, const lg_st_tensor *t,
                                 const unsigned char *bytes, lg_error *err) {
    if (!lg_st_is_float(t->dtype)) return 0; /* 8-bit codes and the loader's order */
    int second_moment = strncmp(t->name, "optimizer.v.", 12) == 0;
    size_t count = (size_t)lg_st_count(t);
    for (size_t i = 0; i < count; i++) {
        lg_real x = lg_st_get(t->dtype, bytes, i);
        if (!isfinite(x) || (second_moment && x < 0))
            return lg_fail(err, "training state %s: %s[%zu] is %g, %s", f->path, t->name, i,
                           (double)x, isfinite(x) ? "a negative second moment" : "not finite");
    }
    return 0;
}

/* Reads every view's tensor, checking name, dtype and shape. */
static int lg_state_read_views(const lg_st_file *f, const lg_state_view *views, int n,
                               size_t n_windows, lg_error *err) {
    for (int i = 0; i < n; i++) {
        const lg_state_view *s = &views[i];
        const lg_st_tensor *t = lg_st_find(f, s->desc.name);
        if (!t) return lg_fail(err, "training state %s: no tensor %s", f->path, s->desc.name);
        int same = t->dtype == s->desc.dtype && t->ndim == s->desc.ndim;
        for (int d = 0; d < t->ndim && same; d++) same = t->shape[d] == s->desc.shape[d];
        if (!same) return lg_fail(err, "training state %s: tensor %s has another dtype or shape than "
                                       "this run's", f->path, t->name);
        unsigned char *bytes = (unsigned char *)LG_MALLOC((size_t)(t->end - t->begin) + 1);
        if (!bytes) return lg_fail(err, "out of host memory for %s", t->name);
        int rc = lg_st_read(f, t, bytes, err);
        if (rc == 0) rc = lg_state_values_check(f, t, bytes, err);
        if (rc == 0 && lg_state_store(s, bytes, n_windows) != 0)
            rc = lg_fail(err, "training state %s: loader.order holds a window outside the data", f->path);
        LG_FREE(bytes);
        if (rc != 0) return -1;
    }
    return 0;
}

int lg_training_state_read(lg_trainer *tr, lg_loader *data, int *step, const char *path,
                           lg_error *err) {
    lg_st_file f;
    if (lg_st_open(&f, path, err) != 0) return -1;
    lg_state_view *views = NULL;
    lg_whole_state w;
    w.owned = NULL;
    int n = 0, rc = lg_state_check_run(tr, data, &f, err);
    unsigned long long v[LG_N_STATE_SCALARS] = {0}; /* the LG_STATE_RESUMED numbers, by scalar */
    for (int k = 0; k < LG_N_STATE_SCALARS && rc == 0; k++)
        if (lg_state_scalars[k].role == LG_STATE_RESUMED)
            rc = lg_state_number(&f, lg_state_scalars[k].key, &v[lg_state_scalars[k].scalar],
                                 err);
    if (rc == 0) rc = lg_state_numbers_check(v, path, err);
    if (rc == 0 && data && v[LG_STATE_LOADER_POSITION] > data->n_windows)
        rc = lg_fail(err, "training state %s: loader_position %llu is beyond the data's %zu windows",
                     path, v[LG_STATE_LOADER_POSITION], data->n_windows);
    if (rc == 0) rc = lg_whole_state_make(tr, &w, err);
    if (rc == 0 && lg_state_views(&w.opt, w.ex, w.table, data, &views, &n) != 0)
        rc = lg_fail(err, "out of host memory");
    if (rc == 0) rc = lg_state_read_views(&f, views, n, data ? data->n_windows : 0, err);
    LG_FREE(views);
    lg_st_close(&f);
    if (rc == 0) lg_whole_state_exchange(tr, &w, 0);
    LG_FREE(w.owned);
    if (rc != 0) return -1;
    uint32_t scale_bits = (uint32_t)v[LG_STATE_LOSS_SCALE_BITS];
    *step = (int)v[LG_STATE_STEP];
    for (int r = 0; r < tr->local_ranks; r++)
        tr->ranks[r].opt.t = (int)v[LG_STATE_OPTIMIZER_UPDATES];
    memcpy(&tr->loss_scale, &scale_bits, 4);
    tr->clean_steps = (int)v[LG_STATE_CLEAN_STEPS];
    if (data) {
        data->position = (size_t)v[LG_STATE_LOADER_POSITION];
        data->epoch = (int)v[LG_STATE_LOADER_EPOCH];
        data->rng.state = (uint64_t)v[LG_STATE_LOADER_RNG];
    }
    return 0;
}

/* --- trainer checkpoints ----------------------------------------------------------------------- */

/* model.safetensors of the trainer's weights: rank 0's when whole, else (sharded) gathered
   unit by unit (lg_unit_walk). */
static int lg_trainer_write_model(lg_trainer *tr, const char *dir, lg_file_digest *digests,
                                  lg_error *err) {
    const lg_model *m0 = &tr->ranks[0].model;
    if (!tr->plan.sharding.weights_sharded) /* whole: on the device, or streamed from the host */
        return tr->process == 0 ? lg_hf_write_model(m0, dir, digests, err) : 0;
    lg_unit_walk w; /* full-shard: unit by unit through the gather regions */
    if (lg_unit_walk_start(&w, tr, 0, err) != 0) return -1;
    int rc = tr->process == 0 ? lg_hf_write_model_from(m0, &w.units, lg_unit_walk_weights, &w, dir,
                                                       digests, err)
                              : 0;
    lg_unit_walk_finish(&w);
    return rc;
}

/* Several processes: every one learns whether process 0 wrote (and waits until it has). */
static int lg_checkpoint_outcome(lg_trainer *tr, int rc, lg_error *err) {
    double failed = rc != 0;
    lg_comm_sum_doubles(tr->process_comm, &failed, 1);
    if (failed > 0 && rc == 0) return lg_fail(err, "process 0 could not write the checkpoint");
    return rc;
}

/* The tokenizer files of tr->tokenizer_dir that exist, copied into dir (atomically); their
   names and digests appended at names[*n], digests[*n]. Process 0 only. */
static int lg_checkpoint_copy_tokenizer(const lg_trainer *tr, const char *dir, const char **names,
                                        lg_file_digest *digests, int *n, lg_error *err) {
    static const char *const files[LG_N_TOKENIZER_FILES] = LG_TOKENIZER_FILES;
    char from[LG_PATH_MAX], to[LG_PATH_MAX];
    for (int i = 0; tr->tokenizer_dir[0] && i < LG_N_TOKENIZER_FILES; i++) {
        lg_format(from, sizeof from, "%s/%s", tr->tokenizer_dir, files[i]);
        struct stat st;
        if (stat(from, &st) != 0) continue; /* the family's other files */
        size_t len;
        char *text = lg_read_text_file(from, (size_t)1 << 30, &len, err);
        if (!text) return -1;
        lg_format(to, sizeof to, "%s/%s", dir, files[i]);
        int rc = strlen(text) == len ? lg_write_text_file(to, text, &digests[*n], err)
                                     : lg_fail(err, "%s: holds a NUL byte; not a tokenizer file", from);
        LG_FREE(text);
        if (rc != 0) return -1;
        names[(*n)++] = files[i];
    }
    return 0;
}

/* No generation_config.json in tr->tokenizer_dir: one made from its config.json's
   bos_token_id and eos_token_id (numbers or lists of numbers, as Hugging Face writes them),
   when it has either, into dir; its name and digest appended at names[*n]. Process 0 only. */
static int lg_checkpoint_generation_config(const lg_trainer *tr, const char *dir,
                                           const char **names, lg_file_digest *digests, int *n,
                                           lg_error *err) {
    static const char *const keys[2] = {"bos_token_id", "eos_token_id"};
    char path[LG_PATH_MAX], text[4096];
    struct stat st;
    lg_format(path, sizeof path, "%s/generation_config.json", tr->tokenizer_dir);
    if (!tr->tokenizer_dir[0] || stat(path, &st) == 0) return 0; /* none, or copied */
    lg_format(path, sizeof path, "%s/config.json", tr->tokenizer_dir);
    if (stat(path, &st) != 0) return 0;
    size_t len, at = 0;
    char *config = lg_read_text_file(path, 1 << 24, &len, err);
    lg_json doc;
    if (!config || lg_json_parse(&doc, config, len, path, err) != 0) { LG_FREE(config); return -1; }
    for (int k = 0; k < 2; k++) {
        int v = lg_json_find(&doc, 0, keys[k]);
        lg_json_kind kind = v >= 0 ? doc.nodes[v].kind : LG_JSON_NULL;
        if (kind == LG_JSON_NUMBER || kind == LG_JSON_ARRAY)
            lg_st_append(text, sizeof text, &at, "%s\n  \"%s\": %.*s", at ? "," : "{", keys[k],
                         (int)(doc.nodes[v].end - doc.nodes[v].start), config + doc.nodes[v].start);
    }
    lg_json_free(&doc);
    LG_FREE(config);
    if (!at) return 0; /* neither id */
    lg_st_append(text, sizeof text, &at, "\n}\n");
    lg_format(path, sizeof path, "%s/generation_config.json", dir);
    if (lg_write_text_file(path, text, &digests[*n], err) != 0) return -1;
    names[(*n)++] = "generation_config.json";
    return 0;
}

/* The last files of a step-N, after its weights and training state: the run's settings (into
   names[settings]), the tokenizer's files (appended after the first n names), then COMPLETE
   over all of them. Each part's outcome reaches every process (process 0 writes). */
static int lg_checkpoint_finish(lg_trainer *tr, const lg_loader *data, const char *out,
                                const char *dir, int step, const char **names,
                                lg_file_digest *digests, int settings, int n, lg_error *err) {
    int writer = tr->process == 0;
    int rc = lg_checkpoint_outcome(
        tr, writer ? lg_run_settings_write(tr, data, out, dir, &digests[settings], err) : 0, err);
    if (rc == 0)
        rc = lg_checkpoint_outcome(
            tr, writer ? lg_checkpoint_copy_tokenizer(tr, dir, names, digests, &n, err) : 0, err);
    if (rc == 0)
        rc = lg_checkpoint_outcome(
            tr, writer ? lg_checkpoint_generation_config(tr, dir, names, digests, &n, err) : 0, err);
    if (rc == 0)
        rc = lg_checkpoint_outcome(tr, writer ? lg_write_marker(dir, step, names, digests, n, err) : 0,
                                   err);
    return rc;
}

/* LoRA's frozen base in units (sharded or streamed): brings unit u to every rank (with its
   trainable weights, which the merge does not read); where rank 0 holds the frozen one. */
static lg_frozen_at lg_trainer_bring_frozen(void *ctx, int u) {
    lg_trainer *tr = (lg_trainer *)ctx;
    lg_trainer_gather_unit(tr, u);
    lg_trainer_await_unit(tr, u);
    return lg_frozen_unit_at(&tr->ranks[0].model, u, lg_frozen_unit_buffer(tr, 0, u));
}

/* The merged model of a LoRA run (process 0 writes): with the frozen base sharded, every other
   process takes part in each unit's gather, in order. */
static int lg_trainer_write_merged(lg_trainer *tr, const lg_real *adapters, const char *dir,
                                   lg_file_digest *digests, lg_error *err) {
    const lg_model *m0 = &tr->ranks[0].model;
    int gathered = m0->frozen_gathered;
    if (tr->process == 0)
        return lg_write_merged_model(m0, adapters, tr->base_loaded ? tr->base_dtype : m0->frozen.dtype,
                                     gathered ? lg_trainer_bring_frozen : NULL, tr,
                                     dir, digests, err);
    for (int u = 0; gathered && u < tr->plan.frozen_shards.n_units; u++)
        lg_trainer_bring_frozen(tr, u);
    return 0;
}

/* A LoRA run's step-N: the adapters as PEFT files, the base model's config.json and
   model_config.yaml, the training state of the adapters; the run's last step also holds the
   merged model (model.safetensors). Process 0 writes; every process takes part in the gathers
   and learns each part's outcome. */
static int lg_lora_checkpoint_save(lg_trainer *tr, const lg_loader *data, int step,
                                   const char *out, const char *dir, lg_error *err) {
    const char *names[7 + LG_N_TOKENIZER_FILES] = {"adapter_model.safetensors", "adapter_config.json",
                                                   "config.json", "model_config.yaml",
                                                   LG_TRAINING_STATE, LG_RUN_SETTINGS,
                                                   "model.safetensors"};
    lg_file_digest digests[7 + LG_N_TOKENIZER_FILES];
    const lg_model *m0 = &tr->ranks[0].model;
    lg_config base = lg_config_base(&m0->cfg);
    lg_hf_family family;
    char path[LG_PATH_MAX], text[4096];
    lg_real *whole = (lg_real *)LG_MALLOC(m0->n_params * sizeof(lg_real) + 1);
    if (!whole) return lg_checkpoint_outcome(tr, lg_fail(err, "out of host memory for the adapters"), err);
    lg_trainer_weights(tr, lg_buf_of(whole));
    int writer = tr->process == 0, final = step == tr->args.max_steps;
    int rc = lg_hf_family_of(&base, &family, err);
    if (rc == 0 && writer) rc = lg_peft_write(m0, lg_buf_of(whole), dir, tr->base_model, digests, err);
    if (rc == 0 && final) { /* model.safetensors, config.json, model_config.yaml */
        lg_file_digest model[3];
        rc = lg_trainer_write_merged(tr, whole, dir, model, err);
        if (writer) digests[6] = model[0], digests[2] = model[1], digests[3] = model[2];
    } else if (rc == 0 && writer) {
        lg_format(path, sizeof path, "%s/config.json", dir);
        lg_hf_config_json(&base, family, lg_st_dtype_of(m0->params.dtype), text, sizeof text);
        rc = lg_write_text_file(path, text, &digests[2], err);
        lg_format(path, sizeof path, "%s/model_config.yaml", dir);
        lg_config_to_yaml(&base, text, sizeof text);
        if (rc == 0) rc = lg_write_text_file(path, text, &digests[3], err);
    }
    LG_FREE(whole);
    rc = lg_checkpoint_outcome(tr, rc, err);
    lg_format(path, sizeof path, "%s/" LG_TRAINING_STATE, dir);
    if (rc == 0)
        rc = lg_checkpoint_outcome(tr, lg_training_state_write(tr, data, step, path, &digests[4], err),
                                   err);
    if (rc != 0) return rc;
    return lg_checkpoint_finish(tr, data, out, dir, step, names, digests, 5, final ? 7 : 6, err);
}

int lg_checkpoint_save(lg_trainer *tr, const lg_loader *data, int step, const char *out,
                       lg_error *err) {
    const char *names[5 + LG_N_TOKENIZER_FILES] = {"model.safetensors", "config.json",
                                                   "model_config.yaml", LG_TRAINING_STATE,
                                                   LG_RUN_SETTINGS};
    char dir[LG_PATH_MAX], path[1200];
    lg_file_digest digests[5 + LG_N_TOKENIZER_FILES];
    int n = 5;
    if (lg_checkpoint_supported(tr, err) != 0) return -1;
    int writer = tr->process == 0; /* the others take part in the gathers */
    if (writer && mkdir(out, 0755) != 0 && errno != EEXIST)
        return lg_checkpoint_outcome(tr, lg_fail(err, "`out_dir` %s: cannot create the directory: %s",
                                                 out, strerror(errno)), err);
    lg_format(dir, sizeof dir, "%s/step-%d", out, step);
    lg_format(path, sizeof path, "%s/" LG_TRAINING_STATE, dir);
    /* each part's outcome reaches every process before the next part's collectives */
    int rc = lg_checkpoint_outcome(tr, writer ? lg_checkpoint_begin(dir, err) : 0, err);
    if (rc == 0 && tr->plan.cfg.lora.r > 0) return lg_lora_checkpoint_save(tr, data, step, out, dir, err);
    if (rc == 0) rc = lg_checkpoint_outcome(tr, lg_trainer_write_model(tr, dir, digests, err), err);
    if (rc == 0)
        rc = lg_checkpoint_outcome(tr, lg_training_state_write(tr, data, step, path, &digests[3], err),
                                   err);
    if (rc != 0) return rc;
    return lg_checkpoint_finish(tr, data, out, dir, step, names, digests, 4, n, err);
}

/* The checkpoint's architecture must be the trainer's. */
static int lg_checkpoint_same_model(const lg_trainer *tr, const char *dir, lg_error *err) {
    lg_config cfg;
    if (lg_hf_config_read(&cfg, dir, err) != 0) return -1;
    lg_config want = lg_config_base(&tr->plan.cfg); /* LoRA: the frozen model's */
    memcpy(cfg.name, want.name, sizeof cfg.name);
    cfg.vocab_size = want.vocab_size;
    if (memcmp(&cfg, &want, sizeof cfg) != 0)
        return lg_fail(err, "checkpoint %s: its config.json describes another model than the run's %s",
                       dir, want.name);
    return 0;
}

/* Reads a Hugging Face directory's weights (converted to lg_real) and sets the trainer's. */
static int lg_trainer_read_weights(lg_trainer *tr, const char *dir, int with_load_checks,
                                   lg_error *err) {
    const lg_model *m0 = &tr->ranks[0].model;
    lg_real *whole = (lg_real *)lg_alloc_zeroed(m0->n_params * sizeof(lg_real) + 1);
    if (!whole) return lg_fail(err, "out of host memory for the weights");
    int rc = m0->cfg.lora.r > 0 ? lg_peft_read(m0, dir, whole, err) /* LoRA: the adapters */
             : with_load_checks ? lg_hf_load_weights(&m0->cfg, lg_buf_of(whole), dir, err)
                                : lg_hf_load_into(&m0->cfg, lg_buf_of(whole), dir, err);
    if (rc == 0) lg_trainer_set_weights(tr, lg_buf_of(whole));
    LG_FREE(whole);
    return rc;
}

/* LoRA: --load DIR is the frozen base model. */
static int lg_trainer_load_frozen(lg_trainer *tr, const char *dir, lg_error *err) {
    lg_config base = lg_config_base(&tr->plan.cfg);
    size_t n_base = lg_params_layout(&base, lg_no_buf(), NULL, NULL);
    lg_real *whole = (lg_real *)LG_MALLOC(n_base * sizeof(lg_real) + 1);
    if (!whole) return lg_fail(err, "out of host memory for the weights");
    int rc = lg_hf_load_weights(&base, lg_buf_of(whole), dir, err);
    if (rc == 0) rc = lg_hf_weights_dtype(dir, &tr->base_dtype, err);
    if (rc == 0) rc = lg_trainer_set_frozen(tr, whole, err);
    LG_FREE(whole);
    if (rc == 0) lg_format(tr->base_model, sizeof tr->base_model, "%s", dir);
    tr->base_loaded = rc == 0;
    /* the base changed (or is half-set after a failure); a sharded one was hashed as set */
    tr->base_hashed = rc == 0 && tr->ranks[0].model.frozen_gathered;
    return rc;
}

int lg_checkpoint_resume(lg_trainer *tr, lg_loader *data, const char *dir, int *step,
                         lg_error *err) {
    char path[1200];
    int marker_step;
    if (lg_checkpoint_verify(dir, &marker_step, err) != 0 ||
        lg_checkpoint_same_model(tr, dir, err) != 0 || lg_checkpoint_supported(tr, err) != 0 ||
        lg_checkpoint_same_base(tr, dir, err) != 0)
        return -1;
    lg_format(path, sizeof path, "%s/" LG_TRAINING_STATE, dir);
    /* the weights as stored (the precision's type), then the master weights from the state */
    if (lg_trainer_read_weights(tr, dir, 0, err) != 0 ||
        lg_training_state_read(tr, data, step, path, err) != 0)
        return -1;
    if (*step != marker_step)
        return lg_fail(err, "checkpoint %s: " LG_CHECKPOINT_MARKER " says step %d, the training state %d",
                       dir, marker_step, *step);
    return 0;
}

int lg_trainer_load_hf(lg_trainer *tr, const char *dir, lg_error *err) {
    if (lg_checkpoint_same_model(tr, dir, err) != 0) return -1;
    if (tr->plan.cfg.lora.r > 0) return lg_trainer_load_frozen(tr, dir, err);
    return lg_trainer_read_weights(tr, dir, 1, err);
}

/* 16. generation: KV cache, sampling ---------------------------------------------------------- */

int lg_gen_vocab(const lg_config *cfg, const lg_tokenizer *tok) {
    return tok && tok->vocab_size > 0 && tok->vocab_size < cfg->vocab_size ? tok->vocab_size
                                                                            : cfg->vocab_size;
}

/* The widest input of a block linear or the head: one token's row of it in fp32. */
static int lg_gen_widest_input(const lg_config *c) {
    int w = c->n_embd > c->n_head * c->head_size ? c->n_embd : c->n_head * c->head_size;
    return w > c->intermediate_size ? w : c->intermediate_size;
}

/* The working set of one forward of n tokens over base (data NULL: counting only); fills g's
   views when g is not NULL. */
static size_t lg_gen_working_layout(const lg_config *c, int n, lg_buf base, lg_generator *g) {
    lg_layout L = lg_layout_over(base, NULL);
    int C = c->n_embd, I = c->intermediate_size;
    lg_buf x = lg_layout_add(&L, "x", n, C, LG_TENSOR_ACTIVATION);
    lg_buf x_mid = lg_layout_add(&L, "x_mid", n, C, LG_TENSOR_ACTIVATION);
    lg_buf n1 = lg_layout_add(&L, "n1", n, C, LG_TENSOR_ACTIVATION);
    lg_buf n2 = c->shared_attention_norm ? lg_no_buf() : lg_layout_add(&L, "n2", n, C, LG_TENSOR_ACTIVATION);
    lg_buf qkv = lg_layout_add(&L, "qkv", n, lg_config_qkv_size(c), LG_TENSOR_ACTIVATION);
    lg_buf att_y = lg_layout_add(&L, "att_y", n, c->n_head * c->head_size, LG_TENSOR_ACTIVATION);
    lg_buf fc = lg_layout_add(&L, "fc", n, I, LG_TENSOR_ACTIVATION);
    lg_buf fc_2 = c->mlp_class_name == LG_MLP_LLAMA ? lg_layout_add(&L, "fc_2", n, I, LG_TENSOR_ACTIVATION)
                                                    : lg_no_buf();
    lg_buf act = lg_layout_add(&L, "act", n, I, LG_TENSOR_ACTIVATION);
    lg_buf ln_f = lg_layout_add(&L, "ln_f", 1, C, LG_TENSOR_ACTIVATION);
    if (g) {
        g->x = x, g->x_mid = x_mid, g->n1 = n1, g->n2 = n2, g->qkv = qkv, g->att_y = att_y;
        g->fc = fc, g->fc_2 = fc_2, g->act = act, g->ln_f = ln_f;
    }
    return L.offset;
}

/* Elements of each of the cache's two regions: (L, NQG, positions, HS). */
static size_t lg_gen_cache_count(const lg_config *c, int positions) {
    return (size_t)c->n_layer * c->n_query_groups * (size_t)positions * c->head_size;
}

/* Every region of a generation, in one pool (the CPU's memory). */
static int lg_gen_plan_regions(lg_rank_plan *r, const lg_config *c, const lg_gen_spec *s) {
    lg_precision_types t = lg_types_of(s->precision);
    size_t rope = 0;
    lg_rope_layout(c, s->positions, NULL, NULL, &rope);
    size_t working = lg_gen_working_layout(c, s->prefill, lg_no_buf(), NULL);
    size_t cache = lg_gen_cache_count(c, s->positions), V = (size_t)c->vocab_size;
    lg_pool pool = LG_POOL_DEVICE;
    int rc = lg_plan_add(r, LG_REGION_WEIGHTS, LG_GROUP_WEIGHTS, pool, t.weights,
                         lg_params_layout(c, lg_no_buf(), NULL, NULL));
    rc |= lg_plan_add(r, LG_REGION_KV_CACHE_KEYS, LG_GROUP_ACTIVATIONS, pool, t.acts, cache);
    rc |= lg_plan_add(r, LG_REGION_KV_CACHE_VALUES, LG_GROUP_ACTIVATIONS, pool, t.acts, cache);
    rc |= lg_plan_add(r, LG_REGION_GENERATION_WORKING, LG_GROUP_ACTIVATIONS, pool, t.acts, working);
    rc |= lg_plan_add(r, LG_REGION_GENERATION_STATS, LG_GROUP_ACTIVATIONS, pool, LG_DTYPE_F32,
                      2 * (size_t)s->prefill);
    rc |= lg_plan_add(r, LG_REGION_ROPE, LG_GROUP_ACTIVATIONS, pool, LG_DTYPE_F32, rope);
    rc |= lg_plan_add(r, LG_REGION_GENERATION_LOGITS, LG_GROUP_LOGITS, pool, LG_DTYPE_F32, V);
    if (s->prefill > 1) /* one token's linears are dot products of their own */
        rc |= lg_plan_add(r, LG_REGION_GEMM_WORKSPACE, LG_GROUP_WORKSPACE, pool, LG_DTYPE_F32,
                          lg_gemm_workspace_count() * (size_t)s->threads);
    rc |= lg_plan_add(r, LG_REGION_GENERATION_ROW, LG_GROUP_WORKSPACE, pool, LG_DTYPE_F32,
                      (size_t)lg_gen_widest_input(c));
    rc |= lg_plan_add(r, LG_REGION_ATTENTION_SCORES, LG_GROUP_WORKSPACE, pool, LG_DTYPE_F32,
                      (size_t)s->threads * ((size_t)s->positions + 2 * (size_t)c->head_size));
    rc |= lg_plan_add(r, LG_REGION_SAMPLING_PROBS, LG_GROUP_WORKSPACE, pool, LG_DTYPE_F32, V);
    return rc | lg_plan_add(r, LG_REGION_SAMPLING_ORDER, LG_GROUP_WORKSPACE, pool, LG_DTYPE_I32, V);
}

int lg_gen_plan(lg_plan *plan, const lg_config *cfg, const lg_gen_spec *s, lg_error *err) {
    memset(plan, 0, sizeof *plan);
    plan->cfg = *cfg;
    memset(&plan->cfg.lora, 0, sizeof plan->cfg.lora); /* adapters are merged on loading */
    const lg_config *c = &plan->cfg;
    if (lg_config_check(c, err) != 0) return -1;
    if (s->positions < 1 || s->positions > c->block_size)
        return lg_fail(err, "generation: prompt + new tokens are %d, the model's context "
                            "(block_size) is %d", s->positions, c->block_size);
    if (s->prefill < 1 || s->prefill > s->positions || s->threads < 1)
        return lg_fail(err, "generation: prefill %d must be within 1 .. %d and threads %d positive",
                       s->prefill, s->positions, s->threads);
    if (s->vocab < 0 || s->vocab > c->vocab_size)
        return lg_fail(err, "generation: vocab %d (the tokenizer's ids) must be within 0 (all) .. "
                            "the model's vocab_size %d", s->vocab, c->vocab_size);
    plan->spec.B = 1;
    plan->spec.T = s->positions;
    plan->spec.accumulation = plan->spec.devices = plan->spec.nodes = plan->spec.processes = 1;
    plan->spec.precision = s->precision;
    plan->spec.threads = s->threads;
    plan->spec.backend = LG_BACKEND_CPU;
    plan->sharding.shard_ranks = plan->sharding.replicas = 1;
    plan->n_ranks = 1;
    plan->ranks = (lg_rank_plan *)lg_alloc_zeroed(sizeof(lg_rank_plan));
    if (!plan->ranks) return lg_fail(err, "plan: out of host memory");
    plan->ranks[0].align = LG_ALIGN;
    if (lg_gen_plan_regions(&plan->ranks[0], c, s) != 0) {
        lg_plan_free(plan);
        return lg_fail(err, "plan: out of host memory");
    }
    return lg_plan_check_pools(plan, err);
}

void lg_gen_plan_print(const lg_plan *plan, FILE *out) {
    const lg_region *stats = lg_plan_find(&plan->ranks[0], LG_REGION_GENERATION_STATS);
    char a[32];
    fprintf(out, "generation plan: %s | cache of %d positions (prompt + new tokens) | prefill of up "
            "to %zu tokens | %s | %d thread%s\n", plan->cfg.name, plan->spec.T,
            stats ? stats->count / 2 : 0, lg_precision_name(plan->spec.precision),
            plan->spec.threads, plan->spec.threads > 1 ? "s" : "");
    lg_plan_print_rank(plan, 0, out);
    fprintf(out, "total: %s\n", lg_format_bytes(lg_plan_bytes(plan, LG_POOL_DEVICE) +
                                                lg_plan_bytes(plan, LG_POOL_HOST), a, sizeof a));
}

/* The generator's views into its rank's regions, the rotary tables and the CPU exec. */
static int lg_gen_bind(lg_generator *g, lg_error *err) {
    const lg_config *c = &g->cfg;
    const lg_gen_spec *s = &g->spec;
    lg_precision_types t = lg_types_of(s->precision);
    const lg_rank *rank = &g->rank;
    g->p.h = (lg_block_tensors *)lg_alloc_zeroed(sizeof(lg_block_tensors) * (size_t)c->n_layer);
    if (!g->p.h) return lg_fail(err, "out of host memory for the model's tables");
    g->params = lg_rank_view(rank, LG_REGION_WEIGHTS, t.weights);
    lg_params_layout(c, g->params, &g->p, NULL);
    g->keys = lg_rank_view(rank, LG_REGION_KV_CACHE_KEYS, t.acts);
    g->values = lg_rank_view(rank, LG_REGION_KV_CACHE_VALUES, t.acts);
    lg_gen_working_layout(c, s->prefill, lg_rank_view(rank, LG_REGION_GENERATION_WORKING, t.acts),
                          g);
    g->mean = (lg_real *)lg_rank_region(rank, LG_REGION_GENERATION_STATS);
    g->rstd = g->mean + s->prefill;
    lg_act_tensors rope;
    size_t count;
    lg_rope_layout(c, s->positions, (lg_real *)lg_rank_region(rank, LG_REGION_ROPE), &rope, &count);
    g->rope_cos = rope.rope_cos;
    g->rope_sin = rope.rope_sin;
    g->logits = (lg_real *)lg_rank_region(rank, LG_REGION_GENERATION_LOGITS);
    g->row = (lg_real *)lg_rank_region(rank, LG_REGION_GENERATION_ROW);
    g->scores = (lg_real *)lg_rank_region(rank, LG_REGION_ATTENTION_SCORES);
    g->probs = (lg_real *)lg_rank_region(rank, LG_REGION_SAMPLING_PROBS);
    g->order = (int *)lg_rank_region(rank, LG_REGION_SAMPLING_ORDER);
    g->exec.backend = LG_BACKEND_CPU;
    g->exec.gemm.base = (lg_real *)lg_rank_region(rank,
                                                  LG_REGION_GEMM_WORKSPACE); /* NULL: prefill 1 */
    g->exec.gemm.per_thread = lg_gemm_workspace_count();
    g->exec.gemm.threads = s->threads;
    g->exec.gemm.path = lg_cpu_gemm_path();
    if (lg_config_rope_dims(c))
        lg_rope_tables(&g->exec, g->rope_cos, g->rope_sin, s->positions, lg_config_rope_dims(c),
                       c->rope_base, &c->rope_adjustments);
    return 0;
}

void lg_generator_free(lg_generator *g) {
    LG_FREE(g->p.h);
    g->p.h = NULL;
    lg_rank_free(&g->rank);
    lg_plan_free(&g->plan);
}

int lg_generator_create(lg_generator *g, const lg_config *cfg, const lg_gen_spec *spec,
                        lg_error *err) {
    memset(g, 0, sizeof *g);
    if (lg_gen_plan(&g->plan, cfg, spec, err) != 0) return -1;
    g->cfg = g->plan.cfg;
    g->spec = *spec;
    if (lg_rank_create(&g->rank, &g->plan, 0, err) != 0) {
        lg_plan_free(&g->plan);
        return -1;
    }
    if (lg_gen_bind(g, err) == 0) return 0;
    lg_generator_free(g);
    return -1;
}

void lg_generator_reset(lg_generator *g) { g->n_cached = 0; }

void lg_generator_truncate(lg_generator *g, int n) {
    if (n >= 0 && n < g->n_cached) g->n_cached = n;
}

/* --- where the weights come from ---------------------------------------------------------- */

static int lg_gen_file_exists(const char *dir, const char *name) {
    char path[LG_PATH_MAX];
    struct stat st;
    lg_format(path, sizeof path, "%s/%s", dir, name);
    return stat(path, &st) == 0;
}

static int lg_gen_has_weights(const char *dir) {
    return lg_gen_file_exists(dir, "model.safetensors") ||
           lg_gen_file_exists(dir, "model.safetensors.index.json");
}

/* adapter_config.json's base_model_name_or_path: a directory with the base weights and the
   same architecture as config.json's. */
static int lg_gen_adapter_base(lg_gen_source *src, lg_error *err) {
    char path[LG_PATH_MAX];
    size_t len;
    lg_format(path, sizeof path, "%s/adapter_config.json", src->dir);
    char *text = lg_read_file(path, &len, "adapters", err);
    lg_json doc;
    if (!text) return -1;
    int rc = lg_json_parse(&doc, text, len, path, err);
    if (rc == 0) {
        int at = lg_json_find(&doc, 0, "base_model_name_or_path");
        if (at < 0 || lg_json_string_copy(&doc, at, src->weights, sizeof src->weights) != 0 ||
            !src->weights[0])
            rc = lg_fail(err, "%s: no base_model_name_or_path (a run whose base model was drawn from "
                              "the seed): no base weights to apply the adapters to", path);
        lg_json_free(&doc);
    }
    LG_FREE(text);
    lg_config base;
    if (rc == 0 && !lg_gen_has_weights(src->weights))
        return lg_fail(err, "%s: the base model %s has no model.safetensors", path, src->weights);
    if (rc != 0 || lg_hf_config_read(&base, src->weights, err) != 0) return -1;
    memcpy(base.name, src->cfg.name, sizeof base.name);
    base.vocab_size = src->cfg.vocab_size;
    if (memcmp(&base, &src->cfg, sizeof base) != 0)
        return lg_fail(err, "%s: the base model %s is another architecture than %s/config.json's",
                       path, src->weights, src->dir);
    return 0;
}

int lg_gen_source_find(lg_gen_source *src, const char *dir, lg_error *err) {
    memset(src, 0, sizeof *src);
    if (strlen(dir) + 32 >= sizeof src->dir) return lg_fail(err, "%s: path too long", dir);
    if (lg_gen_file_exists(dir, "config.json")) lg_format(src->dir, sizeof src->dir, "%s", dir);
    else if (lg_checkpoint_find(dir, src->dir, sizeof src->dir, NULL) != 0)
        return lg_fail(err, "%s: no config.json, nor a complete step-N directory holding one", dir);
    if (lg_hf_config_read(&src->cfg, src->dir, err) != 0) return -1;
    if (lg_gen_has_weights(src->dir)) {
        lg_format(src->weights, sizeof src->weights, "%s", src->dir);
        return 0;
    }
    if (!lg_gen_file_exists(src->dir, "adapter_model.safetensors"))
        return lg_fail(err, "%s: no model.safetensors (or its shards) and no "
                            "adapter_model.safetensors: no weights to generate with", src->dir);
    lg_format(src->adapters, sizeof src->adapters, "%s", src->dir);
    return lg_gen_adapter_base(src, err);
}

/* --- PEFT's adapters merged ---------------------------------------------------------------- */

/* adapter_config.json: r and lora_alpha, and per-module overrides (rank_pattern and
   alpha_pattern: a key naming the module or a tail of it after a '.'). */
typedef struct {
    char *text;
    lg_json doc;
    double r, alpha;
    int rank_pattern, alpha_pattern; /* nodes, or -1 */
} lg_peft_settings;

static int lg_peft_settings_read(lg_peft_settings *s, const char *dir, lg_error *err) {
    char path[LG_PATH_MAX];
    size_t len;
    memset(s, 0, sizeof *s);
    lg_format(path, sizeof path, "%s/adapter_config.json", dir);
    if (!(s->text = lg_read_file(path, &len, "adapters", err))) return -1;
    if (lg_json_parse(&s->doc, s->text, len, path, err) != 0) {
        LG_FREE(s->text);
        return -1;
    }
    int r = lg_json_find(&s->doc, 0, "r"), alpha = lg_json_find(&s->doc, 0, "lora_alpha");
    s->rank_pattern = lg_json_find(&s->doc, 0, "rank_pattern");
    s->alpha_pattern = lg_json_find(&s->doc, 0, "alpha_pattern");
    if (r < 0 || alpha < 0 || lg_json_double(&s->doc, r, &s->r) != 0 ||
        lg_json_double(&s->doc, alpha, &s->alpha) != 0 || s->r <= 0) {
        lg_json_free(&s->doc);
        LG_FREE(s->text);
        return lg_fail(err, "%s: no positive r and a lora_alpha", path);
    }
    return 0;
}

static double lg_peft_pattern(const lg_json *doc, int object, const char *module, double fallback) {
    if (object < 0 || doc->nodes[object].kind != LG_JSON_OBJECT) return fallback;
    size_t lm = strlen(module);
    for (int k = doc->nodes[object].first_child; k >= 0 && doc->nodes[k].next >= 0;
         k = doc->nodes[doc->nodes[k].next].next) {
        char key[LG_ST_MAX_NAME];
        double v;
        if (lg_json_string_copy(doc, k, key, sizeof key) != 0) continue;
        size_t lk = strlen(key);
        if (lk <= lm && strcmp(module + lm - lk, key) == 0 && (lk == lm || module[lm - lk - 1] == '.') &&
            lg_json_double(doc, doc->nodes[k].next, &v) == 0)
            return v;
    }
    return fallback;
}

/* The Hugging Face weight "MODULE.weight" (the model's prefix may be left out), or NULL. */
static const lg_hf_tensor *lg_gen_hf_weight(const lg_hf_tensor *hf, int n, const char *module) {
    char want[LG_ST_MAX_NAME + 8];
    lg_format(want, sizeof want, "%s.weight", module);
    size_t lw = strlen(want);
    for (int i = 0; i < n; i++) {
        size_t lh = strlen(hf[i].name);
        if (lh >= lw && strcmp(hf[i].name + lh - lw, want) == 0 &&
            (lh == lw || hf[i].name[lh - lw - 1] == '.'))
            return &hf[i];
    }
    return NULL;
}

/* A tensor of the adapter file in lg_real (LG_MALLOC), or NULL with err set. */
static lg_real *lg_gen_read_reals(const lg_st_file *f, const lg_st_tensor *t, lg_error *err) {
    size_t count = (size_t)lg_st_count(t);
    unsigned char *bytes = (unsigned char *)LG_MALLOC((size_t)(t->end - t->begin) + 1);
    lg_real *out = (lg_real *)LG_MALLOC(count * sizeof(lg_real) + 1);
    if (!lg_st_is_float(t->dtype)) lg_fail(err, "adapters %s: %s is %s, not F32, BF16 or F16", f->path,
                                           t->name, lg_st_dtype_name(t->dtype));
    else if (!bytes || !out) lg_fail(err, "out of host memory for the adapters");
    else if (lg_st_read(f, t, bytes, err) == 0) {
        for (size_t i = 0; i < count; i++) out[i] = lg_st_get(t->dtype, bytes, i);
        LG_FREE(bytes);
        return out;
    }
    LG_FREE(bytes);
    LG_FREE(out);
    return NULL;
}

/* W += scale B A for the Hugging Face weight h: A (r, in), B (out, r) in PEFT's orientation
   (GPT-2's Conv1D, fan_in_fan_out: its (in, out) weight gets (B A)^T). */
static int lg_gen_merge_module(lg_generator *g, const lg_tensor_table *table, const lg_hf_tensor *h,
                               const lg_st_file *f, const lg_st_tensor *A, const lg_st_tensor *B,
                               float scale, lg_error *err) {
    int conv1d = h->how == LG_HF_TRANSPOSE;
    int64_t rows = conv1d ? h->shape[1] : h->shape[0], cols = conv1d ? h->shape[0] : h->shape[1];
    if (h->ndim != 2 || A->ndim != 2 || B->ndim != 2 || A->shape[0] != B->shape[1] ||
        A->shape[1] != cols || B->shape[0] != rows)
        return lg_fail(err, "adapters %s: %s [%lld, %lld] and its lora_B [%lld, %lld] do not fit "
                            "%s", f->path, A->name, (long long)A->shape[0], (long long)A->shape[1],
                       (long long)B->shape[0], (long long)B->shape[1], h->name);
    lg_real *a = lg_gen_read_reals(f, A, err), *b = a ? lg_gen_read_reals(f, B, err) : NULL;
    if (!b) {
        LG_FREE(a);
        return -1;
    }
    size_t base = table->tensors[h->source].offset;
    int r = (int)A->shape[0];
    LG_OMP(omp parallel for)
    for (int64_t o = 0; o < rows; o++)
        for (int64_t c = 0; c < cols; c++) {
            double sum = 0;
            for (int j = 0; j < r; j++) sum += (double)b[o * r + j] * a[(int64_t)j * cols + c];
            size_t i = (size_t)(conv1d ? c * rows + o : o * cols + c);
            size_t at = base + lg_hf_source_index(&g->cfg, h, i);
            lg_set(g->params, at, lg_get(g->params, at) + (lg_real)(scale * sum));
        }
    LG_FREE(a);
    LG_FREE(b);
    return 0;
}

/* Each pair base_model.model.MODULE.lora_A.weight / .lora_B.weight of an open adapter file. */
static int lg_gen_merge_pairs(lg_generator *g, const lg_st_file *f, const lg_peft_settings *s,
                              const lg_tensor_table *table, const lg_hf_tensor *hf, int n_hf,
                              lg_error *err) {
    static const char prefix[] = "base_model.model.", tail_a[] = ".lora_A.weight";
    size_t lp = strlen(prefix), la = strlen(tail_a);
    int pairs = 0;
    for (int i = 0; i < f->n_tensors; i++) {
        const lg_st_tensor *A = &f->tensors[i];
        size_t ln = strlen(A->name);
        if (strstr(A->name, ".lora_B.weight") && ln > lp + la && strncmp(A->name, prefix, lp) == 0)
            continue; /* with its A */
        if (ln <= lp + la || strncmp(A->name, prefix, lp) != 0 || strcmp(A->name + ln - la, tail_a) != 0)
            return lg_fail(err, "adapters %s: %s is no LoRA A or B of a module (only plain LoRA "
                                "merges here)", f->path, A->name);
        char module[LG_ST_MAX_NAME], name_b[LG_ST_MAX_NAME];
        lg_format(module, sizeof module, "%.*s", (int)(ln - lp - la), A->name + lp);
        lg_format(name_b, sizeof name_b, "%s%s.lora_B.weight", prefix, module);
        const lg_st_tensor *B = lg_st_find(f, name_b);
        const lg_hf_tensor *h = lg_gen_hf_weight(hf, n_hf, module);
        if (!B || !h)
            return lg_fail(err, "adapters %s: %s", f->path, !B ? "a lora_A without its lora_B"
                                                               : "a module the model does not have");
        double r = lg_peft_pattern(&s->doc, s->rank_pattern, module, s->r);
        double alpha = lg_peft_pattern(&s->doc, s->alpha_pattern, module, s->alpha);
        if (lg_gen_merge_module(g, table, h, f, A, B, (float)alpha / (float)r, err) != 0) return -1;
        pairs++;
    }
    return pairs ? 0 : lg_fail(err, "adapters %s: no adapters in it", f->path);
}

static int lg_gen_merge_adapters(lg_generator *g, const char *dir, lg_error *err) {
    lg_peft_settings s;
    lg_tensor_table table;
    lg_hf_tensor *hf = NULL;
    lg_hf_family family;
    lg_st_file f;
    int n_hf = 0, rc = -1;
    char path[LG_PATH_MAX];
    if (lg_peft_settings_read(&s, dir, err) != 0) return -1;
    lg_format(path, sizeof path, "%s/adapter_model.safetensors", dir);
    if (lg_table_alloc(&table, &g->cfg) != 0) {
        lg_json_free(&s.doc);
        LG_FREE(s.text);
        return lg_fail(err, "out of host memory");
    }
    lg_params_layout(&g->cfg, lg_no_buf(), NULL, &table);
    if (lg_hf_family_of(&g->cfg, &family, err) == 0 &&
        lg_hf_tensors(&g->cfg, &table, family, &hf, &n_hf, err) == 0 && lg_st_open(&f, path, err) == 0) {
        rc = lg_gen_merge_pairs(g, &f, &s, &table, hf, n_hf, err);
        lg_st_close(&f);
    }
    LG_FREE(hf);
    lg_tensor_table_free(&table);
    lg_json_free(&s.doc);
    LG_FREE(s.text);
    return rc;
}

/* A LoRA step-N of this trainer (LG_RUN_SETTINGS beside its adapters): the base src->weights
   names is the one its adapters were trained over, by the base_hash resume checks
   (lg_adapters_same_base), g's weights hashed as the run held them (lg_base_hash_of: its
   precision's weight type, NF4 under --quantize); read again in fp32 unless g holds them so.
   Adapters from elsewhere (no LG_RUN_SETTINGS) record no hash to check. */
static int lg_gen_same_base(const lg_generator *g, const lg_gen_source *src, lg_error *err) {
    if (!lg_gen_file_exists(src->adapters, LG_RUN_SETTINGS)) return 0;
    lg_run_settings *s = (lg_run_settings *)LG_MALLOC(sizeof *s);
    if (!s) return lg_fail(err, "out of host memory");
    int rc = lg_run_settings_read(src->adapters, s, err);
    lg_config run = g->cfg;
    run.lora = s->args.lora;
    lg_dtype weights = lg_types_of(s->args.precision).weights;
    LG_FREE(s);
    int own = g->params.dtype == LG_DTYPE_F32; /* g's weights are the whole base in lg_real */
    size_t n = lg_params_layout(&g->cfg, lg_no_buf(), NULL, NULL);
    lg_real *whole = own ? (lg_real *)g->params.data : (lg_real *)LG_MALLOC(n * sizeof(lg_real) + 1);
    if (rc == 0 && !whole) rc = lg_fail(err, "out of host memory for the base's weights");
    if (rc == 0 && !own) rc = lg_hf_load_weights(&g->cfg, lg_buf_of(whole), src->weights, err);
    uint64_t hash = 0;
    if (rc == 0) rc = lg_base_hash_of(&run, weights, whole, &hash, err);
    if (!own) LG_FREE(whole);
    char ours[LG_PATH_MAX + 64];
    lg_format(ours, sizeof ours, "the base %s that adapter_config.json names", src->weights);
    return rc == 0 ? lg_adapters_same_base(src->adapters, hash, ours, err) : -1;
}

int lg_generator_load(lg_generator *g, const lg_gen_source *src, lg_error *err) {
    if (lg_params_layout(&src->cfg, lg_no_buf(), NULL, NULL) != lg_params_layout(&g->cfg, lg_no_buf(), NULL, NULL))
        return lg_fail(err, "%s: its model is not the one the generator was made for", src->dir);
    if (lg_hf_load_weights(&g->cfg, g->params, src->weights, err) != 0) return -1;
    if (!src->adapters[0]) return 0;
    if (lg_gen_file_exists(src->adapters, LG_CHECKPOINT_MARKER) &&
        lg_checkpoint_verify(src->adapters, NULL, err) != 0)
        return -1;
    if (lg_gen_same_base(g, src, err) != 0) return -1;
    return lg_gen_merge_adapters(g, src->adapters, err);
}

/* --- the forward with the cache ------------------------------------------------------------ */

/* s[0 .. 4) = the dot products of x (n) with the 4 rows of w (n apart) from element at: four
   sums at once, so that each load of x serves four rows and the adds do not wait on each other. */
static void lg_gen_dot4(lg_buf w, size_t at, const lg_real *x, int n, lg_real *s) {
    lg_real s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    if (w.dtype == LG_DTYPE_F32) {
        const lg_real *a = (const lg_real *)w.data + at, *b = a + n, *c = b + n, *d = c + n;
        LG_OMP(omp simd reduction(+ : s0, s1, s2, s3))
        for (int i = 0; i < n; i++) {
            s0 += a[i] * x[i], s1 += b[i] * x[i];
            s2 += c[i] * x[i], s3 += d[i] * x[i];
        }
    } else if (w.dtype == LG_DTYPE_BF16) {
        const uint16_t *a = (const uint16_t *)w.data + at, *b = a + n, *c = b + n, *d = c + n;
        LG_OMP(omp simd reduction(+ : s0, s1, s2, s3))
        for (int i = 0; i < n; i++) {
            s0 += lg_bf16_to_f32(a[i]) * x[i], s1 += lg_bf16_to_f32(b[i]) * x[i];
            s2 += lg_bf16_to_f32(c[i]) * x[i], s3 += lg_bf16_to_f32(d[i]) * x[i];
        }
    } else {
        for (int i = 0; i < n; i++) {
            s0 += lg_get(w, at + (size_t)i) * x[i], s1 += lg_get(w, at + (size_t)(n + i)) * x[i];
            s2 += lg_get(w, at + (size_t)(2 * n + i)) * x[i], s3 += lg_get(w, at + (size_t)(3 * n + i)) * x[i];
        }
    }
    s[0] = s0, s[1] = s1, s[2] = s2, s[3] = s3;
}

/* out (OC) = w (OC, IC) x (IC, fp32) + bias: one token's linear, dot products of four weight
   rows at a time, the groups split over the threads (the weights are read once, in order);
   the last OC % 4 rows from the last four. */
static void lg_gen_gemv(lg_buf out, const lg_real *x, lg_buf w, lg_buf bias, int IC, int OC,
                        int threads) {
    (void)threads; /* a build without OpenMP */
    if (OC < 4) { /* (never in a model here: at least 4 outputs) */
        for (int o = 0; o < OC; o++) {
            lg_real s = 0;
            for (int i = 0; i < IC; i++) s += lg_get(w, (size_t)o * IC + i) * x[i];
            lg_set(out, (size_t)o, bias.data ? s + lg_get(bias, (size_t)o) : s);
        }
        return;
    }
    int groups = OC / 4;
    LG_OMP(omp parallel for schedule(static) num_threads(threads) if ((double)OC * IC >= 65536.0))
    for (int k = 0; k <= groups; k++) {
        int o = k < groups ? 4 * k : OC - 4, first = k < groups ? 0 : 4 - OC % 4;
        lg_real s[4];
        if (k == groups && OC % 4 == 0) continue;
        lg_gen_dot4(w, (size_t)o * IC, x, IC, s);
        for (int j = first; j < 4; j++)
            lg_set(out, (size_t)(o + j), bias.data ? s[j] + lg_get(bias, (size_t)(o + j)) : s[j]);
    }
}

/* out (n, OC) = inp (n, IC) w^T + bias: the matmul for a prompt, dot products for one token. */
static void lg_gen_linear(lg_generator *g, lg_buf out, lg_buf inp, lg_buf w, lg_buf bias, int n,
                          int IC, int OC) {
    if (n > 1) {
        lg_linear_forward(&g->exec, out, inp, w, bias, n, IC, OC);
        return;
    }
    for (int i = 0; i < IC; i++) g->row[i] = lg_get(inp, (size_t)i);
    lg_gen_gemv(out, g->row, w, bias, IC, OC, g->spec.threads);
}

/* The keys and values of the n tokens at positions pos .. from qkv into block l's cache. */
static void lg_gen_cache_store(lg_generator *g, int l, int pos, int n) {
    const lg_config *c = &g->cfg;
    int NH = c->n_head, NQG = c->n_query_groups, HS = c->head_size, QKV = lg_config_qkv_size(c);
    size_t bytes = (size_t)HS * lg_elem_size(g->qkv.dtype);
    for (int i = 0; i < n; i++)
        for (int q = 0; q < NQG; q++) {
            size_t at = (((size_t)l * NQG + q) * g->spec.positions + (size_t)(pos + i)) * HS;
            memcpy(lg_at(g->keys, at).data, lg_at(g->qkv, (size_t)i * QKV + (size_t)(NH + q) * HS).data, bytes);
            memcpy(lg_at(g->values, at).data,
                   lg_at(g->qkv, (size_t)i * QKV + (size_t)(NH + NQG + q) * HS).data, bytes);
        }
}

/* sum of w[at .. at + n) x (n): one cached key against a query */
static lg_real lg_gen_row_dot(lg_buf w, size_t at, const lg_real *x, int n) {
    lg_real s = 0;
    if (w.dtype == LG_DTYPE_F32) {
        const lg_real *a = (const lg_real *)w.data + at;
        LG_OMP(omp simd reduction(+ : s))
        for (int i = 0; i < n; i++) s += a[i] * x[i];
    } else if (w.dtype == LG_DTYPE_BF16) {
        const uint16_t *a = (const uint16_t *)w.data + at;
        LG_OMP(omp simd reduction(+ : s))
        for (int i = 0; i < n; i++) s += lg_bf16_to_f32(a[i]) * x[i];
    } else {
        for (int i = 0; i < n; i++) s += lg_get(w, at + (size_t)i) * x[i];
    }
    return s;
}

/* acc (n) += p v[at .. at + n): one cached value weighted by its probability */
static void lg_gen_row_add(lg_real *acc, lg_real p, lg_buf v, size_t at, int n) {
    if (v.dtype == LG_DTYPE_F32) {
        const lg_real *a = (const lg_real *)v.data + at;
        LG_OMP(omp simd)
        for (int i = 0; i < n; i++) acc[i] += p * a[i];
    } else if (v.dtype == LG_DTYPE_BF16) {
        const uint16_t *a = (const uint16_t *)v.data + at;
        LG_OMP(omp simd)
        for (int i = 0; i < n; i++) acc[i] += p * lg_bf16_to_f32(a[i]);
    } else {
        for (int i = 0; i < n; i++) acc[i] += p * lg_get(v, at + (size_t)i);
    }
}

/* One query head's output y (HS) for the query q (HS) at position T - 1: softmax over the
   cached keys k (T, HS) of q k / sqrt(HS), times the values v (T, HS); scratch (T + 2 HS). */
static void lg_gen_attend(lg_buf y, lg_buf q, lg_buf k, lg_buf v, int T, int HS, lg_real *scratch) {
    lg_real *s = scratch, *acc = scratch + T, *query = acc + HS, max = -INFINITY, sum = 0;
    lg_real scale = 1.0f / lg_sqrt((lg_real)HS);
    for (int e = 0; e < HS; e++) query[e] = lg_get(q, (size_t)e), acc[e] = 0;
    for (int t = 0; t < T; t++) {
        s[t] = lg_gen_row_dot(k, (size_t)t * HS, query, HS);
        max = s[t] > max ? s[t] : max;
    }
    for (int t = 0; t < T; t++) {
        lg_real p = lg_exp((s[t] - max) * scale);
        sum += p;
        lg_gen_row_add(acc, p, v, (size_t)t * HS, HS);
    }
    for (int e = 0; e < HS; e++) lg_set(y, (size_t)e, acc[e] / sum);
}

/* att_y (n, NH HS) of the queries at positions pos .. pos + n - 1 over block l's cache: query
   head h reads key/value group h / (NH / NQG), each query its own position and those before. */
static void lg_gen_attention(lg_generator *g, int l, int pos, int n) {
    const lg_config *c = &g->cfg;
    int NH = c->n_head, NQG = c->n_query_groups, HS = c->head_size, QKV = lg_config_qkv_size(c);
    int per_group = NH / NQG;
    size_t P = (size_t)g->spec.positions;
    lg_attention_scratch sc;
    sc.base = g->scores;
    sc.per_thread = P + 2 * (size_t)HS;
    sc.threads = g->spec.threads;
    LG_OMP(omp parallel for collapse(2) schedule(static) num_threads(sc.threads) if (n * NH > 1))
    for (int i = 0; i < n; i++)
        for (int h = 0; h < NH; h++) {
            size_t group = ((size_t)l * NQG + h / per_group) * P * HS;
            lg_gen_attend(lg_at(g->att_y, (size_t)i * NH * HS + (size_t)h * HS),
                          lg_at(g->qkv, (size_t)i * QKV + (size_t)h * HS), lg_at(g->keys, group),
                          lg_at(g->values, group), pos + i + 1, HS, lg_attention_rows(&sc));
        }
}

/* Block l on the working set x (n, C) of the tokens at positions pos ..: as lg_block_forward,
   attention reading the cache. */
static void lg_gen_block(lg_generator *g, int l, int pos, int n) {
    const lg_config *c = &g->cfg;
    const lg_block_tensors *w = &g->p.h[l];
    const lg_exec *ex = &g->exec;
    int C = c->n_embd, I = c->intermediate_size, QKV = lg_config_qkv_size(c);
    int NH = c->n_head, HS = c->head_size, R = lg_config_rope_dims(c) / 2;
    size_t nC = (size_t)n * C, nI = (size_t)n * I;
    lg_real *mean = lg_norm_mean_or_null(c, g->mean);
    lg_norm_forward(ex, g->n1, mean, g->rstd, g->x, w->norm_1_w, w->norm_1_b, n, C, c->norm_eps);
    lg_gen_linear(g, g->qkv, g->n1, w->qkv_w, w->qkv_b, n, C, QKV);
    if (R)
        lg_rope_rotate(ex, g->qkv, g->rope_cos + (size_t)pos * R, g->rope_sin + (size_t)pos * R, 1,
                       n, NH, c->n_query_groups, HS, 2 * R, +1, NULL);
    lg_gen_cache_store(g, l, pos, n);
    lg_gen_attention(g, l, pos, n);
    lg_gen_linear(g, g->x_mid, g->att_y, w->proj_w, w->proj_b, n, NH * HS, C);
    lg_buf mlp_in = c->shared_attention_norm ? g->n1 : g->n2;
    if (c->shared_attention_norm || c->parallel_residual) {
        lg_add(ex, g->x_mid, g->x_mid, g->x, nC);
        if (!c->shared_attention_norm)
            lg_norm_forward(ex, g->n2, mean, g->rstd, g->x, w->norm_2_w, w->norm_2_b, n, C, c->norm_eps);
    } else {
        lg_residual_norm_forward(ex, g->x_mid, g->n2, mean, g->rstd, g->x_mid, g->x, w->norm_2_w,
                                 w->norm_2_b, n, C, c->norm_eps);
    }
    lg_gen_linear(g, g->fc, mlp_in, w->fc_w, w->fc_b, n, C, I);
    if (c->mlp_class_name == LG_MLP_LLAMA) {
        lg_gen_linear(g, g->fc_2, mlp_in, w->fc_2_w, w->fc_2_b, n, C, I);
        lg_swiglu_forward(ex, g->act, g->fc, g->fc_2, nI);
    } else {
        lg_gelu_forward(ex, g->act, g->fc, nI, c->gelu_approximate_tanh);
    }
    lg_gen_linear(g, g->x, g->act, w->mlp_proj_w, w->mlp_proj_b, n, I, C);
    lg_add(ex, g->x, g->x, g->x_mid, nC);
}

/* n <= prefill tokens at positions n_cached ..: embeddings, blocks, and the last one's logits. */
static void lg_gen_step(lg_generator *g, const int *tokens, int n) {
    const lg_config *c = &g->cfg;
    int pos = g->n_cached, C = c->n_embd;
    lg_buf wpe = g->p.wpe.data ? lg_at(g->p.wpe, (size_t)pos * C) : g->p.wpe;
    lg_embedding_forward(&g->exec, g->x, tokens, g->p.wte, wpe, 1, n, C, NULL);
    for (int l = 0; l < c->n_layer; l++) lg_gen_block(g, l, pos, n);
    g->n_cached += n;
    lg_norm_forward(&g->exec, g->ln_f, lg_norm_mean_or_null(c, g->mean), g->rstd,
                    lg_at(g->x, (size_t)(n - 1) * C), g->p.ln_f_w, g->p.ln_f_b, 1, C, c->norm_eps);
    for (int i = 0; i < C; i++) g->row[i] = lg_get(g->ln_f, (size_t)i);
    lg_gen_gemv(lg_buf_of(g->logits), g->row, g->p.lm_head_w, g->p.lm_head_b, C, c->vocab_size,
                g->spec.threads);
}

int lg_generator_forward(lg_generator *g, const int *tokens, int n, lg_error *err) {
    if (n < 1) return lg_fail(err, "generation: no tokens to run");
    if (g->n_cached + n > g->spec.positions)
        return lg_fail(err, "generation: %d cached and %d more tokens pass the cache's %d positions",
                       g->n_cached, n, g->spec.positions);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= g->cfg.padded_vocab_size)
            return lg_fail(err, "generation: token %d (id %d) is outside the model's vocabulary of %d",
                           i, tokens[i], g->cfg.padded_vocab_size);
    for (int done = 0; done < n;) {
        int k = n - done < g->spec.prefill ? n - done : g->spec.prefill;
        lg_gen_step(g, tokens + done, k);
        done += k;
    }
    return 0;
}

/* --- sampling ------------------------------------------------------------------------------ */

lg_sampling lg_sampling_default(void) {
    lg_sampling s;
    memset(&s, 0, sizeof s);
    s.temperature = 0.8f;
    s.top_k = 50;
    s.top_p = 1.0f;
    return s;
}

/* The k-th largest of x (n), 1 <= k <= n, through a min-heap of the k largest in heap (k). */
static lg_real lg_kth_largest(const lg_real *x, int n, int k, lg_real *heap) {
    for (int i = 0; i < n; i++) {
        if (i >= k && x[i] <= heap[0]) continue;
        int at = i < k ? i : 0;
        lg_real v = x[i];
        if (i < k) { /* sift up */
            while (at > 0 && heap[(at - 1) / 2] > v) heap[at] = heap[(at - 1) / 2], at = (at - 1) / 2;
        } else { /* replace the root, sift down */
            for (int child; (child = 2 * at + 1) < k; at = child) {
                if (child + 1 < k && heap[child + 1] < heap[child]) child++;
                if (heap[child] >= v) break;
                heap[at] = heap[child];
            }
        }
        heap[at] = v;
    }
    return heap[0];
}

/* Whether (p[a], id[a]) comes after (p[b], id[b]): lower probability, or equal and a higher id. */
static int lg_ranks_after(const lg_real *p, const int *id, int a, int b) {
    return p[a] < p[b] || (p[a] == p[b] && id[a] > id[b]);
}

static void lg_swap_ranked(lg_real *p, int *id, int a, int b) {
    lg_real tp = p[a];
    int ti = id[a];
    p[a] = p[b], id[a] = id[b];
    p[b] = tp, id[b] = ti;
}

/* The heap p[at .. end) with its last-ranked at the root: (p[at], id[at]) sifted down. */
static void lg_sift_last_ranked(lg_real *p, int *id, int at, int end) {
    for (int child; (child = 2 * at + 1) < end; at = child) {
        if (child + 1 < end && lg_ranks_after(p, id, child + 1, child)) child++;
        if (!lg_ranks_after(p, id, child, at)) break;
        lg_swap_ranked(p, id, at, child);
    }
}

/* Sorts p (n) and id (n) together, the most likely first (heap sort). */
static void lg_sort_by_probability(lg_real *p, int *id, int n) {
    for (int k = n / 2 - 1; k >= 0; k--) lg_sift_last_ranked(p, id, k, n);
    for (int end = n - 1; end > 0; end--) {
        lg_swap_ranked(p, id, 0, end);
        lg_sift_last_ranked(p, id, 0, end);
    }
}

/* The kept ids (top-k) into order, their unnormalised probabilities at temperature into
   probs; returns how many. */
static int lg_sample_candidates(const lg_real *logits, int V, const lg_sampling *s, lg_real *probs,
                                int *order) {
    int n = 0;
    lg_real threshold = -INFINITY, max = -INFINITY;
    if (s->top_k > 0 && s->top_k < V) threshold = lg_kth_largest(logits, V, s->top_k, probs);
    for (int v = 0; v < V; v++)
        if (logits[v] >= threshold) order[n++] = v, max = logits[v] > max ? logits[v] : max;
    for (int j = 0; j < n; j++) probs[j] = lg_exp((logits[order[j]] - max) / s->temperature);
    return n;
}

/* How many of logits (V) are NaN or infinite; *first (may be NULL) gets the first one's id. */
static int lg_logits_not_finite(const lg_real *logits, int V, int *first) {
    int bad = 0;
    for (int v = V - 1; v >= 0; v--)
        if (!isfinite(logits[v])) {
            bad++;
            if (first) *first = v;
        }
    return bad;
}

int lg_sample(const lg_real *logits, int V, const lg_sampling *s, lg_rng *rng, lg_real *probs,
              int *order) {
    if (lg_logits_not_finite(logits, V, NULL) > 0) return -1;
    if (s->temperature <= 0.0f) {
        int best = 0;
        for (int v = 1; v < V; v++) best = logits[v] > logits[best] ? v : best;
        return best;
    }
    int n = lg_sample_candidates(logits, V, s, probs, order);
    double total = 0;
    for (int j = 0; j < n; j++) total += probs[j];
    if (s->top_p < 1.0f) { /* the most likely first; keep each whose predecessors hold < top_p */
        lg_sort_by_probability(probs, order, n);
        double before = 0;
        int kept = 0;
        while (kept < n && before < s->top_p * total) before += probs[kept++];
        n = kept;
        total = before;
    }
    double u = lg_rng_uniform(rng) * total;
    for (int j = 0; j < n; j++)
        if ((u -= probs[j]) < 0) return order[j];
    return order[n - 1];
}

/* --- generate ------------------------------------------------------------------------------ */

static int lg_is_stop(const lg_sampling *s, int token) {
    for (int i = 0; i < s->n_stop; i++)
        if (s->stop[i] == token) return 1;
    return 0;
}

/* *token drawn from g->logits (V of them: the last cached position's), or -1 naming that
   position when they are not finite. */
static int lg_gen_draw(lg_generator *g, int V, const lg_sampling *s, lg_rng *rng, int *token,
                       lg_error *err) {
    *token = lg_sample(g->logits, V, s, rng, g->probs, g->order);
    if (*token >= 0) return 0;
    int first = 0, bad = lg_logits_not_finite(g->logits, V, &first);
    return lg_fail(err, "generation: the logits at position %d are not finite (%d of %d NaN or "
                        "infinite, id %d's %g first): a NaN or infinite weight, or an overflow "
                        "of the precision", g->n_cached - 1, bad, V, first, (double)g->logits[first]);
}

int lg_generate_continue(lg_generator *g, const int *prompt, int n_prompt, int max_new,
                         const lg_sampling *s, lg_rng *rng, int *out, int *n_out,
                         lg_gen_token_fn on_token, void *ctx, lg_gen_stats *stats, lg_error *err) {
    lg_gen_stats own;
    if (!stats) stats = &own;
    memset(stats, 0, sizeof *stats);
    *n_out = 0;
    if (n_prompt < 1) return lg_fail(err, "generation: the prompt is empty (it needs a token)");
    if (g->n_cached + n_prompt + max_new > g->spec.positions)
        return lg_fail(err, "generation: %d cached tokens, a prompt of %d and %d new ones pass "
                            "the cache's %d positions", g->n_cached, n_prompt, max_new,
                       g->spec.positions);
    double start = lg_time_ms();
    if (lg_generator_forward(g, prompt, n_prompt, err) != 0) return -1;
    stats->prompt_tokens = n_prompt;
    /* logits over the head's vocab_size rows, draws among the ids the tokenizer has */
    int V = g->spec.vocab ? g->spec.vocab : g->cfg.vocab_size;
    int token = 0;
    if (max_new > 0 && lg_gen_draw(g, V, s, rng, &token, err) != 0) return -1;
    stats->prefill_ms = lg_time_ms() - start;
    start = lg_time_ms();
    while (*n_out < max_new) {
        out[(*n_out)++] = token;
        stats->stopped = lg_is_stop(s, token);
        if ((on_token && on_token(ctx, token) != 0) || stats->stopped || *n_out == max_new) break;
        if (lg_generator_forward(g, &token, 1, err) != 0) return -1;
        stats->decode_tokens++;
        if (lg_gen_draw(g, V, s, rng, &token, err) != 0) return -1;
    }
    stats->decode_ms = lg_time_ms() - start;
    return 0;
}

int lg_generate(lg_generator *g, const int *prompt, int n_prompt, int max_new,
                const lg_sampling *s, lg_rng *rng, int *out, int *n_out, lg_gen_token_fn on_token,
                void *ctx, lg_gen_stats *stats, lg_error *err) {
    lg_generator_reset(g);
    return lg_generate_continue(g, prompt, n_prompt, max_new, s, rng, out, n_out, on_token, ctx,
                                stats, err);
}

#endif /* LITGPT_IMPLEMENTATION */
