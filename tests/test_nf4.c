/* tests/test_nf4.c — NF4 and nf4-dq storage (QLoRA's frozen weights), included by tests/test.c
   (the float build): the bytes and values of tests/make_nf4_reference.py, an implementation
   from bitsandbytes' published description written independently of litgpt.h; error bounds
   on random data; half-type outputs; bits per parameter. */

#define NF4_REFERENCE "tests/reference/nf4.bin"

static const lg_quantization nf4_formats[2] = {LG_QUANTIZE_NF4, LG_QUANTIZE_NF4_DQ};

static int nf4_same_floats(const float *a, const void *b, size_t n) {
    return memcmp(a, b, n * sizeof(float)) == 0;
}

/* The code book against the script's: NF4 values, thresholds, the dynamic map, and the 8-bit
   codes of the map's entries, their fp32 midpoints (ties: the even index) and neighbours. */
static void test_nf4_codebook(results *r, const ref_file *rf) {
    lg_nf4_codebook book;
    lg_nf4_codebook_make(&book);
    const ref_tensor *values = ref_find(rf, "nf4.values"), *above = ref_find(rf, "nf4.thresholds");
    const ref_tensor *map = ref_find(rf, "dynamic.map");
    check(r, values && above && map && values->count == LG_NF4_CODES &&
                 above->count == LG_NF4_CODES - 1 && map->count == LG_NF4_DYNAMIC_CODES &&
                 nf4_same_floats(book.nf4, values->data, LG_NF4_CODES) &&
                 nf4_same_floats(book.nf4_above, above->data, LG_NF4_CODES - 1) &&
                 nf4_same_floats(book.dynamic, map->data, LG_NF4_DYNAMIC_CODES),
          "nf4: the 16 values, their 15 thresholds and the 256-entry dynamic map equal the "
          "script's bit for bit");
    const ref_tensor *input = ref_find(rf, "dynamic.input"), *codes = ref_find(rf, "dynamic.codes");
    size_t wrong = 0, n = input ? input->count : 0;
    for (size_t i = 0; i < n; i++)
        wrong += lg_nf4_dynamic_code(book.dynamic, ((const float *)input->data)[i]) !=
                 ((const int32_t *)codes->data)[i];
    check(r, n > 3 * LG_NF4_DYNAMIC_CODES && wrong == 0,
          "nf4-dq: 8-bit codes of %zu values (entries, midpoints, their neighbours): %zu differ",
          n, wrong);
}

/* Each case of the script in both formats: lg_nf4_bytes, the stored bytes and the
   dequantized fp32 values, all exactly (every step is one IEEE operation in the same order). */
static void test_nf4_reference_cases(results *r, const ref_file *rf) {
    int cases = 0;
    for (int t = 0; t < rf->n; t++) {
        const ref_tensor *input = &rf->tensors[t];
        const char *dot = strrchr(input->name, '.');
        if (!dot || strcmp(dot, ".input") != 0 || strncmp(input->name, "dynamic.", 8) == 0) continue;
        char name[LG_MAX_NAME], key[LG_MAX_NAME + 32];
        snprintf(name, sizeof name, "%.*s", (int)(dot - input->name), input->name);
        size_t count = input->count;
        lg_buf src = {input->data, LG_DTYPE_F32};
        cases++;
        for (int f = 0; f < 2; f++) {
            lg_quantization q = nf4_formats[f];
            snprintf(key, sizeof key, "%s.%s", name, lg_quantization_name(q));
            const ref_tensor *stored = ref_find(rf, key);
            snprintf(key, sizeof key, "%s.%s.dequantized", name, lg_quantization_name(q));
            const ref_tensor *values = ref_find(rf, key);
            size_t bytes = lg_nf4_bytes(count, q);
            uint8_t *got = (uint8_t *)lg_alloc_zeroed(bytes);
            float *deq = (float *)lg_alloc_zeroed(count * sizeof(float));
            lg_error err;
            int ok = stored && values && stored->count * 4 == bytes &&
                     lg_nf4_quantize(src, count, q, got, &err) == 0;
            int same_bytes = ok && memcmp(got, stored->data, bytes) == 0;
            if (ok) lg_nf4_dequantize(NULL, got, count, q, lg_buf_of(deq));
            int same_values = ok && nf4_same_floats(deq, values->data, count);
            check(r, same_bytes && same_values,
                  "nf4 reference %s %s: %zu elements, %zu bytes equal: %s, dequantized equal: %s",
                  name, lg_quantization_name(q), count, bytes, same_bytes ? "yes" : "no",
                  same_values ? "yes" : "no");
            LG_FREE(got);
            LG_FREE(deq);
        }
    }
    check(r, cases >= 9, "nf4 reference: %d cases in %s", cases, NF4_REFERENCE);
}

/* The largest gap between neighbouring values of a code book. */
static double nf4_largest_gap(const float *values, int n) {
    double gap = 0;
    for (int k = 0; k + 1 < n; k++) gap = fmax(gap, (double)values[k + 1] - values[k]);
    return gap;
}

/* Random blocks of varied scales: every element within half the largest NF4 gap times its
   block's absmax (nf4-dq: plus the absmax's own error, within half the largest gap of the
   dynamic map times its group's scale, the scale and offset computed here from the input),
   with a slack of 2^-20 of the absmax for the fp32 roundings of x / absmax; zero blocks give
   zeros; bf16 and fp16 outputs are the fp32 output rounded; bf16 input of the same values
   gives the same bytes. */
static void test_nf4_random(results *r) {
    const size_t blocks = 2 * LG_NF4_DQ_BLOCK + 40, count = blocks * LG_NF4_BLOCK - 13;
    const double slack = 1.0 / (1 << 20);
    lg_rng rng;
    lg_rng_seed(&rng, 15);
    float *x = (float *)lg_alloc_zeroed(count * sizeof(float));
    uint16_t *x_bf16 = (uint16_t *)lg_alloc_zeroed(count * sizeof(uint16_t));
    double *absmax = (double *)lg_alloc_zeroed(blocks * sizeof(double));
    for (size_t b = 0; b < blocks; b++) {
        float scale = b % 97 == 5 ? 0.0f : 0.02f * lg_exp(2.0f * lg_rng_normal(&rng));
        for (size_t i = b * LG_NF4_BLOCK; i < (b + 1) * LG_NF4_BLOCK && i < count; i++) {
            x_bf16[i] = lg_f32_to_bf16(scale * lg_rng_normal(&rng));
            x[i] = lg_bf16_to_f32(x_bf16[i]);
            absmax[b] = fmax(absmax[b], fabs((double)x[i]));
        }
    }
    double mean = 0, group_scale[3] = {0, 0, 0}; /* the blocks make three nf4-dq groups */
    for (size_t b = 0; b < blocks; b++) mean += absmax[b] / (double)blocks;
    for (size_t b = 0; b < blocks; b++) {
        double *scale = &group_scale[b / LG_NF4_DQ_BLOCK];
        *scale = fmax(*scale, fabs(absmax[b] - mean));
    }
    lg_nf4_codebook book;
    lg_nf4_codebook_make(&book);
    double nf4_half_gap = nf4_largest_gap(book.nf4, LG_NF4_CODES) / 2;
    double dynamic_half_gap = nf4_largest_gap(book.dynamic, LG_NF4_DYNAMIC_CODES) / 2;
    for (int f = 0; f < 2; f++) {
        lg_quantization q = nf4_formats[f];
        size_t bytes = lg_nf4_bytes(count, q);
        uint8_t *stored = (uint8_t *)lg_alloc_zeroed(bytes);
        uint8_t *from_bf16 = (uint8_t *)lg_alloc_zeroed(bytes);
        float *deq = (float *)lg_alloc_zeroed(count * sizeof(float));
        uint16_t *half[2] = {(uint16_t *)lg_alloc_zeroed(count * sizeof(uint16_t)),
                             (uint16_t *)lg_alloc_zeroed(count * sizeof(uint16_t))};
        lg_error err;
        lg_buf src = {x, LG_DTYPE_F32}, src_bf16 = {x_bf16, LG_DTYPE_BF16};
        lg_nf4_quantize(src, count, q, stored, &err);
        lg_nf4_quantize(src_bf16, count, q, from_bf16, &err);
        lg_nf4_dequantize(NULL, stored, count, q, lg_buf_of(deq));
        lg_buf out_bf16 = {half[0], LG_DTYPE_BF16}, out_f16 = {half[1], LG_DTYPE_F16};
        lg_nf4_dequantize(NULL, stored, count, q, out_bf16);
        lg_nf4_dequantize(NULL, stored, count, q, out_f16);
        double worst = 0; /* error / bound */
        int zeros_kept = 1, rounded = 1;
        for (size_t i = 0; i < count; i++) {
            size_t b = i / LG_NF4_BLOCK;
            double bound = (nf4_half_gap + slack) * absmax[b];
            if (q == LG_QUANTIZE_NF4_DQ)
                bound += (dynamic_half_gap + slack) * group_scale[b / LG_NF4_DQ_BLOCK];
            double error = fabs((double)x[i] - deq[i]);
            worst = fmax(worst, bound > 0 ? error / bound : error > 0 ? INFINITY : 0);
            if (absmax[b] == 0 && deq[i] != 0) zeros_kept = 0;
            rounded &= half[0][i] == lg_f32_to_bf16(deq[i]) && half[1][i] == lg_f32_to_f16(deq[i]);
        }
        const char *name = lg_quantization_name(q);
        check(r, worst <= 1 && zeros_kept,
              "nf4 %s: %zu random values in %zu blocks within the bound (worst error %.3f of "
              "it), zero blocks dequantize to zeros: %s", name, count, blocks, worst,
              zeros_kept ? "yes" : "no");
        check(r, rounded, "nf4 %s: bf16 and fp16 outputs are the fp32 output rounded", name);
        check(r, memcmp(stored, from_bf16, bytes) == 0,
              "nf4 %s: bf16 input stores the same bytes as the same values in fp32", name);
        LG_FREE(stored), LG_FREE(from_bf16), LG_FREE(deq), LG_FREE(half[0]), LG_FREE(half[1]);
    }
    LG_FREE(x), LG_FREE(x_bf16), LG_FREE(absmax);
}

/* Bits per parameter of a 4096 x 4096 matrix against the format's arithmetic: 4 + 32 / 64
   (nf4), 4 + 8 / 64 + 32 / (64 x 256) (nf4-dq, plus one offset); short tensors; the names. */
static void test_nf4_storage(results *r) {
    const size_t count = (size_t)4096 * 4096;
    double nf4_bits = 8.0 * (double)lg_nf4_bytes(count, LG_QUANTIZE_NF4) / (double)count;
    double dq_bits = 8.0 * (double)lg_nf4_bytes(count, LG_QUANTIZE_NF4_DQ) / (double)count;
    double nf4_expected = 4 + 32.0 / LG_NF4_BLOCK;
    double dq_expected = 4 + 8.0 / LG_NF4_BLOCK + 32.0 / (LG_NF4_BLOCK * LG_NF4_DQ_BLOCK);
    check(r, fabs(nf4_bits - nf4_expected) < 1e-6 && fabs(dq_bits - dq_expected) < 1e-5,
          "nf4 storage of 4096 x 4096: %.4f bits a parameter (nf4), %.4f (nf4-dq)", nf4_bits,
          dq_bits);
    /* 1 element: a code byte padded to 4, one absmax; nf4-dq: a code byte padded to 4, one
       scale, the offset. 65: 33 bytes padded to 36, two blocks. */
    check(r, lg_nf4_bytes(1, LG_QUANTIZE_NF4) == 8 && lg_nf4_bytes(1, LG_QUANTIZE_NF4_DQ) == 16 &&
                 lg_nf4_bytes(65, LG_QUANTIZE_NF4) == 44 && lg_nf4_bytes(65, LG_QUANTIZE_NF4_DQ) == 48 &&
                 lg_nf4_bytes(1000, LG_QUANTIZE_NONE) == 0,
          "nf4 storage of short tensors: parts on 4-byte boundaries");
    int names_ok = 1;
    for (int i = 0; i < LG_QUANTIZATIONS; i++) {
        lg_quantization q;
        const char *name = lg_quantization_name((lg_quantization)i);
        names_ok &= lg_quantization_parse(name, &q) == 0 && (int)q == i;
    }
    lg_quantization q;
    check(r, names_ok && lg_quantization_parse("nf8", &q) == -1 &&
                 strcmp(lg_quantization_name(LG_QUANTIZE_NF4_DQ), "nf4-dq") == 0,
          "nf4 names: none, nf4, nf4-dq parse back; nf8 is refused");
}

/* Out of host memory while the NF4 base is drawn and packed (the draw's buffer of one frozen
   tensor refused): lg_trainer_create fails naming the tensor, no abort. */
static void test_nf4_init_out_of_memory(results *r) {
    lg_config cfg;
    if (load_config_or_fail(r, &cfg, "test-llama")) return;
    lg_args a;
    lg_args_default(&a);
    a.micro_batch_size = 2;
    a.lora.r = 2;
    a.lora.quantize = LG_QUANTIZE_NF4;
    lg_trainer tr;
    lg_error err;
    if (lg_trainer_create(&tr, &cfg, &a, 16, &err) != 0) { check(r, 0, "QLoRA: %s", err.msg); return; }
    const lg_tensor_info *packed = NULL;
    for (int i = 0; i < tr.ranks[0].model.frozen_table.n_tensors && !packed; i++)
        if (tr.ranks[0].model.frozen_table.tensors[i].packed != LG_DTYPE_F32)
            packed = &tr.ranks[0].model.frozen_table.tensors[i];
    char name[LG_MAX_NAME] = "";
    size_t bytes = packed ? packed->count * sizeof(lg_real) : 0;
    if (packed) snprintf(name, sizeof name, "%s", packed->name);
    lg_trainer_free(&tr);
    test_allocations.refuse = bytes;
    int rc = lg_trainer_create(&tr, &cfg, &a, 16, &err);
    test_allocations.refuse = 0;
    char want[160];
    snprintf(want, sizeof want, "out of host memory initialising %s", name);
    check(r, packed && rc == -1 && strstr(err.msg, want), "QLoRA's base drawn without the host "
          "memory for %s (%zu bytes): the trainer fails naming it (\"%s\")", name, bytes,
          rc ? err.msg : "created");
    if (rc == 0) lg_trainer_free(&tr);
}

static void test_nf4_all(results *r) {
    printf("nf4 (QLoRA's weight storage)\n");
    ref_file rf;
    if (ref_load(&rf, NF4_REFERENCE) != 0) {
        check(r, 0, "read %s", NF4_REFERENCE);
    } else {
        test_nf4_codebook(r, &rf);
        test_nf4_reference_cases(r, &rf);
        ref_free(&rf);
    }
    test_nf4_random(r);
    test_nf4_storage(r);
    test_nf4_init_out_of_memory(r);
}
