/* litgpt_cuda.cuh — the CUDA backend of litgpt.h. litgpt.h includes it when nvcc compiles the
   translation unit (nvcc -x cu train.c), inside LITGPT_IMPLEMENTATION.

   Today this is the seam only: the CUDA build finds the GPUs and the driver reports that it
   runs on the CPU backend. The kernels (embedding, norms, rotary, flash attention, GELU/SwiGLU,
   fused classifier, optimizers), cuBLASLt matmuls and NCCL collectives land with the CUDA
   backend issue, each one dispatched from the op of the same name in litgpt.h. */
#ifndef LITGPT_CUDA_CUH
#define LITGPT_CUDA_CUH

#include <cuda_runtime.h>

/* GPUs visible to this process; 0 when there is no driver or no device. */
static int lg_cuda_device_count_impl(void) {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}
#define LG_CUDA_DEVICE_COUNT() lg_cuda_device_count_impl()

#endif /* LITGPT_CUDA_CUH */
