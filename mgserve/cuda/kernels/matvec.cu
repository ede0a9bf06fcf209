// Quantized matrix-vector products y[t, n] = sum_k W[n, k] * x[t, k], reading GGUF blocks directly.
//
// W is one GGUF tensor in its file layout: n_rows rows, each (k / BLOCK) blocks of BYTES bytes.
// x is fp32 [n_tok, k], y is fp32 [n_tok, n_rows]; n_tok is 1..NT (a few decode tokens share one
// pass over the weights, which is what makes batched decode and draft verification cheap).
//
// Each warp owns R output rows (ROWS_PER_WARP_*), WARPS_PER_CTA warps per thread block. Each lane
// decodes 8 consecutive weights at a time (every format below splits evenly into 8-value runs that
// share one scale), multiplies them with 8 activations per token, loaded once for all the warp's
// rows, and accumulates in fp32; a shuffle reduction ends each row. A 2560-wide Q4_K row is only
// 10 steps of 144 bytes per warp, so the kernel tends to wait on latency rather than bandwidth;
// rows per warp and the run-loop unroll trade bytes in flight against occupancy (see RUN_UNROLL).
// Block layouts (bytes; ggml's, as gguf-py decodes them):
//
//   Q4_0  18 / 32:  f16 d | 16 nibbles (low: values 0..15, high: 16..31), v = d * (q - 8)
//   Q4_1  20 / 32:  f16 d, f16 m | 16 nibbles, v = d * q + m
//   Q5_0  22 / 32:  f16 d | u32 qh (5th bits) | 16 nibbles, v = d * (q - 16)
//   Q5_1  24 / 32:  f16 d, f16 m | u32 qh | 16 nibbles, v = d * q + m
//   Q8_0  34 / 32:  f16 d | 32 x i8, v = d * q
//   IQ4_NL 18 / 32: f16 d | 16 nibbles, v = d * kvalue_iq4(q)
//   Q4_K 144 / 256: f16 d, f16 dmin | 12 bytes of 6-bit scales/mins | 128 nibbles
//   Q5_K 176 / 256: f16 d, f16 dmin | 12 scales | 32 qh | 128 nibbles
//   Q6_K 210 / 256: 128 ql | 64 qh | 16 x i8 scales | f16 d
//   IQ4_XS 136 / 256: f16 d | u16 scales_h | 4 scales_l | 128 nibbles
//   F32, F16, BF16: plain elements (k must be a multiple of 8)
//   Q2_K, Q3_K, MXFP4: gguf_blocks_lowbit.cuh; IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
//   IQ1_S, IQ1_M: gguf_blocks_iq.cuh (lookup grids generated from gguf-py: gguf_grids.cuh)
//
// Rows of most formats are not 4-byte aligned (34, 22, 210 bytes...), so block fields are read
// bytewise; the bytes of one block are shared by its lanes through L1, so DRAM sees each byte once.

#include "gguf_blocks.cuh"
#include "gguf_blocks_lowbit.cuh"
#include "gguf_blocks_iq.cuh"
#define WARPS_PER_CTA 4
// Tuning, set by the Python wrapper (ops.MatvecTuning) through -D; defaults match its defaults.
#ifndef ROWS_PER_WARP_1
#define ROWS_PER_WARP_1 1  // rows per warp for one token
#endif
#ifndef ROWS_PER_WARP_N
#define ROWS_PER_WARP_N 2  // rows per warp for 2..8 tokens (each x load serves more rows)
#endif
#ifndef RUN_UNROLL
#define RUN_UNROLL 4  // run-loop unroll: loads of several runs in flight per lane
#endif

// w: [n_rows, k / BLOCK * BYTES] bytes; x: fp32 [n_tok, k]; y: fp32 [n_tok, n_rows].
// n_rows: output rows; k: inputs per row, a multiple of BLOCK; n_tok: tokens, 1..NT.
template <typename T, int NT>
__device__ void matvec(const u8* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,
                       int n_rows, int k, int n_tok) {
    constexpr int R = NT == 1 ? ROWS_PER_WARP_1 : ROWS_PER_WARP_N;
    constexpr int RUNS = T::BLOCK / 8;  // 8-value runs per block
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * WARPS_PER_CTA + (threadIdx.x >> 5)) * R;
    if (row0 >= n_rows) return;
    const size_t row_bytes = (size_t)(k / T::BLOCK) * T::BYTES;
    const u8* wrow[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        // past the last row: re-read a valid row (keeps the loop branch-free); never written
        const int row = row0 + rr < n_rows ? row0 + rr : n_rows - 1;
        wrow[rr] = w + (size_t)row * row_bytes;
    }
    float acc[R][NT];
#pragma unroll
    for (int rr = 0; rr < R; rr++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[rr][t] = 0.f;
    const int n_runs = k / 8;
#pragma unroll RUN_UNROLL
    for (int r = lane; r < n_runs; r += 32) {
        float v[R][8];
#pragma unroll
        for (int rr = 0; rr < R; rr++)
            T::load(wrow[rr] + (size_t)(r / RUNS) * T::BYTES, r % RUNS, v[rr]);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < n_tok) {
                const float4* xp = (const float4*)(x + (size_t)t * k + (size_t)r * 8);
                const float4 a = xp[0], c = xp[1];
#pragma unroll
                for (int rr = 0; rr < R; rr++)
                    acc[rr][t] += v[rr][0] * a.x + v[rr][1] * a.y + v[rr][2] * a.z +
                                  v[rr][3] * a.w + v[rr][4] * c.x + v[rr][5] * c.y +
                                  v[rr][6] * c.z + v[rr][7] * c.w;
            }
        }
    }
#pragma unroll
    for (int rr = 0; rr < R; rr++)
#pragma unroll
        for (int t = 0; t < NT; t++)
#pragma unroll
            for (int off = 16; off > 0; off >>= 1)
                acc[rr][t] += __shfl_xor_sync(0xffffffffu, acc[rr][t], off);
    if (lane == 0) {
#pragma unroll
        for (int rr = 0; rr < R; rr++)
#pragma unroll
            for (int t = 0; t < NT; t++)
                if (t < n_tok && row0 + rr < n_rows) y[(size_t)t * n_rows + row0 + rr] = acc[rr][t];
    }
}

// One extern "C" entry per (format, token bucket), named matvec_<format>_t<NT>, so the Python
// side looks kernels up by plain names.
#define MATVEC_ENTRY(TYPE, NT)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * WARPS_PER_CTA)                            \
        matvec_##TYPE##_t##NT(const u8* __restrict__ w, const float* __restrict__ x,          \
                              float* __restrict__ y, int n_rows, int k, int n_tok) {           \
        matvec<TYPE, NT>(w, x, y, n_rows, k, n_tok);                                          \
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
