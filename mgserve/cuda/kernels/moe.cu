// Mixture-of-experts FFN for decode on fp32 activations, reading GGUF blocks directly: the loops
// of one lane over its rows inside the frame of moe_decode.cuh (the math, the thread mapping,
// determinism). Each lane takes a row's 8-value runs lane, lane + 32, ..., decodes them
// (gguf_blocks.cuh) and accumulates their products with x (or h) in fp32; the down kernel's flat
// range is the kk * (ff / 8) runs of row r of every selected expert.

#include "gguf_blocks.cuh"
#include "gguf_blocks_lowbit.cuh"
#include "gguf_blocks_iq.cuh"
#include "moe_decode.cuh"
#include "pdl.cuh"

#ifndef GU_UNROLL
#define GU_UNROLL 4  // gate/up run-loop unroll: loads in flight per lane (k = 2560: 10 runs)
#endif
#ifndef DOWN_UNROLL
#define DOWN_UNROLL 8  // down run-loop unroll (kk 10 x ff 640: 25 runs per lane)
#endif

// gate, up: [n_expert * expert_rows, k / BLOCK * BYTES] bytes (up may point into gate's storage);
// x: fp32 [N, k]; experts: int32 [N, kk]; h: fp32 [N, kk, ff].
template <typename T>
__device__ void moe_gate_up(const u8* __restrict__ gate, const u8* __restrict__ up,
                            long long expert_rows, const float* __restrict__ x,
                            const int* __restrict__ experts, float* __restrict__ h, int kk,
                            int ff, int k, int n_expert) {
    constexpr int R = GU_ROWS, RUNS = T::BLOCK / 8;
    moe_gate_up_warp<T>(gate, up, expert_rows, experts, h, nullptr, nullptr, nullptr, kk, ff, k,
                        n_expert,
                        [&](int lane, int n, const u8* const (&grow)[R],
                            const u8* const (&urow)[R], float (&ag)[R], float (&au)[R]) {
        const float* xn = x + (size_t)n * k;
        const int n_runs = k / 8;
#pragma unroll GU_UNROLL
        for (int r = lane; r < n_runs; r += 32) {
            const size_t off = (size_t)(r / RUNS) * T::BYTES;
            float vg[R][8], vu[R][8];
#pragma unroll
            for (int rr = 0; rr < R; rr++) {
                T::load(grow[rr] + off, r % RUNS, vg[rr]);
                T::load(urow[rr] + off, r % RUNS, vu[rr]);
            }
#pragma unroll
            for (int rr = 0; rr < R; rr++) {
                ag[rr] += dot8(vg[rr], xn + (size_t)r * 8);
                au[rr] += dot8(vu[rr], xn + (size_t)r * 8);
            }
        }
    });
}

// down: [n_expert * expert_rows, ff / BLOCK * BYTES] bytes; h: fp32 [N, kk, ff];
// experts: int32 [N, kk]; weights: fp32 [N, kk]; out: fp32 [N, d]; res: fp32 [N, d] added to
// out, or null; shared [N, d] and sgate [N]: the shared expert's output and gate, or null
// (moe_down_warp). kk <= MOE_MAX_KK.
template <typename T>
__device__ void moe_down(const u8* __restrict__ down, long long expert_rows,
                         const float* __restrict__ h, const int* __restrict__ experts,
                         const float* __restrict__ weights, float* __restrict__ out,
                         const float* __restrict__ res, const float* __restrict__ shared,
                         const float* __restrict__ sgate, int kk, int d, int ff, int n_expert) {
    constexpr int R = DOWN_ROWS, RUNS = T::BLOCK / 8;
    moe_down_warp<T>(experts, weights, out, res, shared, sgate, kk, d, ff, n_expert,
                     [&](int lane, int n, const int* s_e, const float* s_w, size_t row_bytes,
                         const int (&rows)[R], float (&acc)[R]) {
        const float* hn = h + (size_t)n * kk * ff;
        const int n_runs = ff / 8, total = kk * n_runs;
#pragma unroll DOWN_UNROLL
        for (int i = lane; i < total; i += 32) {
            const int j = i / n_runs, c = i - j * n_runs;
            const u8* base = down + (size_t)s_e[j] * expert_rows * row_bytes +
                             (size_t)(c / RUNS) * T::BYTES;
            float v[R][8];
#pragma unroll
            for (int rr = 0; rr < R; rr++)
                T::load(base + (size_t)rows[rr] * row_bytes, c % RUNS, v[rr]);
            const float* hp = hn + (size_t)j * ff + (size_t)c * 8;
            const float wj = s_w[j];
#pragma unroll
            for (int rr = 0; rr < R; rr++) acc[rr] += wj * dot8(v[rr], hp);
        }
    });
}

#define MOE_ENTRIES(TYPE)                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * MOE_WARPS) moe_gate_up_##TYPE(             \
        const u8* __restrict__ gate, const u8* __restrict__ up, long long expert_rows,          \
        const float* __restrict__ x, const int* __restrict__ experts, float* __restrict__ h,   \
        int kk, int ff, int k, int n_expert) {                                                  \
        grid_sync();                                                                            \
        moe_gate_up<TYPE>(gate, up, expert_rows, x, experts, h, kk, ff, k, n_expert);          \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * MOE_WARPS) moe_down_##TYPE(                \
        const u8* __restrict__ down, long long expert_rows, const float* __restrict__ h,       \
        const int* __restrict__ experts, const float* __restrict__ weights,                    \
        float* __restrict__ out, const float* __restrict__ res,                                \
        const float* __restrict__ shared, const float* __restrict__ sgate, int kk, int d,       \
        int ff, int n_expert) {                                                                 \
        grid_sync();                                                                            \
        moe_down<TYPE>(down, expert_rows, h, experts, weights, out, res, shared, sgate, kk, d,  \
                       ff, n_expert);                                                           \
    }

MOE_ENTRIES(Q4_0)
MOE_ENTRIES(Q4_1)
MOE_ENTRIES(Q5_0)
MOE_ENTRIES(Q5_1)
MOE_ENTRIES(Q8_0)
MOE_ENTRIES(IQ4_NL)
MOE_ENTRIES(Q4_K)
MOE_ENTRIES(Q5_K)
MOE_ENTRIES(Q6_K)
MOE_ENTRIES(IQ4_XS)
MOE_ENTRIES(F32)
MOE_ENTRIES(F16)
MOE_ENTRIES(BF16)
MOE_ENTRIES(Q2_K)
MOE_ENTRIES(Q3_K)
MOE_ENTRIES(MXFP4)
MOE_ENTRIES(IQ2_XXS)
MOE_ENTRIES(IQ2_XS)
MOE_ENTRIES(IQ2_S)
MOE_ENTRIES(IQ3_XXS)
MOE_ENTRIES(IQ3_S)
MOE_ENTRIES(IQ1_S)
MOE_ENTRIES(IQ1_M)
