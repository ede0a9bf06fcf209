// Quantized matrix-vector products y[t, n] = sum_k W[n, k] * x[t, k], reading GGUF blocks directly.
//
// W is one GGUF tensor in its file layout: n_rows rows, each (k / BLOCK) blocks of BYTES bytes.
// x is fp32 [n_tok, k], y is fp32 [n_tok, n_rows]; n_tok is 1..NT (a few decode tokens share one
// pass over the weights, which is what makes batched decode and draft verification cheap).
//
// Each warp owns R output rows (ROWS_PER_WARP_*), WARPS_PER_CTA warps per thread block. Each lane
// decodes 8 consecutive weights at a time (every format splits evenly into 8-value runs that
// share one scale), multiplies them with 8 activations per token, loaded once for all the warp's
// rows, and accumulates in fp32; a shuffle reduction ends each row. A 2560-wide Q4_K row is only
// 10 steps of 144 bytes per warp, so the kernel tends to wait on latency rather than bandwidth;
// rows per warp and the run-loop unroll trade bytes in flight against occupancy (see RUN_UNROLL).
//
// Block layouts and their decoders: gguf_blocks.cuh and the headers it names. The bytes of one
// block are shared by its lanes through L1, so DRAM sees each byte once.

#include "gguf_blocks.cuh"
#include "gguf_blocks_lowbit.cuh"
#include "gguf_blocks_iq.cuh"
#include "matvec.cuh"

// One extern "C" entry per (format, token bucket), named matvec_<format>_t<NT>, so the Python
// side looks kernels up by plain names.
#define MATVEC_ENTRY(TYPE, NT)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * WARPS_PER_CTA)                            \
        matvec_##TYPE##_t##NT(const u8* __restrict__ w, const float* __restrict__ x,          \
                              float* __restrict__ y, int n_rows, int k, int n_tok,             \
                              const float* __restrict__ bias, const float* __restrict__ res) { \
        matvec<TYPE, NT>(w, x, y, n_rows, k, n_tok, bias, res);                               \
    }

#define MATVEC_TYPE(TYPE) \
    MATVEC_ENTRY(TYPE, 1) \
    MATVEC_ENTRY(TYPE, 2) \
    MATVEC_ENTRY(TYPE, 4) \
    MATVEC_ENTRY(TYPE, 8)

MATVEC_TYPE(Q4_0)
MATVEC_TYPE(Q4_1)
MATVEC_TYPE(Q5_0)
MATVEC_TYPE(Q5_1)
MATVEC_TYPE(Q8_0)
MATVEC_TYPE(IQ4_NL)
MATVEC_TYPE(Q4_K)
MATVEC_TYPE(Q5_K)
MATVEC_TYPE(Q6_K)
MATVEC_TYPE(IQ4_XS)
MATVEC_TYPE(F32)
MATVEC_TYPE(F16)
MATVEC_TYPE(BF16)
MATVEC_TYPE(Q2_K)
MATVEC_TYPE(Q3_K)
MATVEC_TYPE(MXFP4)
MATVEC_TYPE(IQ2_XXS)
MATVEC_TYPE(IQ2_XS)
MATVEC_TYPE(IQ2_S)
MATVEC_TYPE(IQ3_XXS)
MATVEC_TYPE(IQ3_S)
MATVEC_TYPE(IQ1_S)
MATVEC_TYPE(IQ1_M)
