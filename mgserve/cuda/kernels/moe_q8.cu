// Mixture-of-experts FFN for decode on int8 activations (dp4a), the int8 twin of moe.cu: the loops
// of one lane over its rows inside the frame of moe_decode.cuh (the math, the thread mapping,
// determinism), with x and h replaced by xq / hq.
//
// xq / hq are x and h rounded to int8 by matvec_q8.cu's quantize_q8 (one fp32 scale per 32
// values: xd / hd), so each weight chunk is multiplied with integer dot products against the
// weights' packed quants and the block scales are applied in fp32; the weights keep their exact
// value, only the activations are rounded. h is written in fp32 and rounded by the gate/up kernel
// itself (the last CTA of each group of 32 rows: moe_gate_up_warp) or by the caller.
// Each lane takes a row's chunks (a format's 16-byte unit of quants, T::CHUNKS per block) lane,
// lane + 32, ..., all of the warp's rows loaded before any arithmetic; the down kernel's flat
// range is the kk * chunks-per-row of row r of every selected expert.
//
// Formats (chunk decoders: gguf_blocks_q8.cuh): Q8_0, Q5_0, Q4_K, Q6_K.

#include "gguf_blocks_q8.cuh"
#include "moe_decode.cuh"
#include "pdl.cuh"

// gate, up: [n_expert * expert_rows, k / BLOCK * BYTES] bytes; xq: int8 [N, k];
// xd: fp32 [N, k / 32]; experts: int32 [N, kk]; h: fp32 [N, kk, ff]; hq, hd, tickets: h's int8
// form for the down kernel, or null (moe_gate_up_warp).
template <typename T>
__device__ void moe_q8_gate_up(const u8* __restrict__ gate, const u8* __restrict__ up,
                               long long expert_rows, const i8* __restrict__ xq,
                               const float* __restrict__ xd, const int* __restrict__ experts,
                               float* __restrict__ h, i8* __restrict__ hq, float* __restrict__ hd,
                               unsigned* __restrict__ tickets, int kk, int ff, int k,
                               int n_expert) {
    constexpr int R = GU_ROWS;
    moe_gate_up_warp<T>(gate, up, expert_rows, experts, h, hq, hd, tickets, kk, ff, k, n_expert,
                        [&](int lane, int n, const u8* const (&grow)[R],
                            const u8* const (&urow)[R], float (&ag)[R], float (&au)[R]) {
        const i8* xn = xq + (size_t)n * k;
        const float* dn = xd + (size_t)n * (k / 32);
        const int n_chunks = k / T::BLOCK * T::CHUNKS;
#pragma unroll 2
        for (int c = lane; c < n_chunks; c += 32) {
            const int b = c / T::CHUNKS, j = c % T::CHUNKS;
            typename T::Frag fg[R], fu[R];
#pragma unroll
            for (int rr = 0; rr < R; rr++) {
                fg[rr] = T::load(grow[rr] + (size_t)b * T::BYTES, j);
                fu[rr] = T::load(urow[rr] + (size_t)b * T::BYTES, j);
            }
            const i8* xb = xn + (size_t)b * T::BLOCK;
            const float* db = dn + (size_t)b * (T::BLOCK / 32);
#pragma unroll
            for (int rr = 0; rr < R; rr++) {
                ag[rr] += T::dot(fg[rr], j, xb, db);
                au[rr] += T::dot(fu[rr], j, xb, db);
            }
        }
    });
}

// down: [n_expert * expert_rows, ff / BLOCK * BYTES] bytes; hq: int8 [N * kk, ff];
// hd: fp32 [N * kk, ff / 32]; experts: int32 [N, kk]; weights: fp32 [N, kk]; out: fp32 [N, d];
// res: fp32 [N, d] added to out, or null; shared [N, d] and sgate [N]: the shared expert's
// output and gate, or null (moe_down_warp).
template <typename T>
__device__ void moe_q8_down(const u8* __restrict__ down, long long expert_rows,
                            const i8* __restrict__ hq, const float* __restrict__ hd,
                            const int* __restrict__ experts, const float* __restrict__ weights,
                            float* __restrict__ out, const float* __restrict__ res,
                            const float* __restrict__ shared, const float* __restrict__ sgate,
                            int kk, int d, int ff, int n_expert) {
    constexpr int R = DOWN_ROWS;
    moe_down_warp<T>(experts, weights, out, res, shared, sgate, kk, d, ff, n_expert,
                     [&](int lane, int n, const int* s_e, const float* s_w, size_t row_bytes,
                         const int (&rows)[R], float (&acc)[R]) {
        const int per_row = ff / T::BLOCK * T::CHUNKS, total = kk * per_row;
#pragma unroll 2
        for (int i = lane; i < total; i += 32) {
            const int jj = i / per_row, c = i - jj * per_row;
            const int b = c / T::CHUNKS, j = c % T::CHUNKS;
            const u8* base =
                down + (size_t)s_e[jj] * expert_rows * row_bytes + (size_t)b * T::BYTES;
            typename T::Frag f[R];
#pragma unroll
            for (int rr = 0; rr < R; rr++) f[rr] = T::load(base + (size_t)rows[rr] * row_bytes, j);
            const size_t pair = (size_t)n * kk + jj;
            const i8* hb = hq + pair * ff + (size_t)b * T::BLOCK;
            const float* db = hd + pair * (ff / 32) + (size_t)b * (T::BLOCK / 32);
            const float wj = s_w[jj];
#pragma unroll
            for (int rr = 0; rr < R; rr++) acc[rr] += wj * T::dot(f[rr], j, hb, db);
        }
    });
}

#define MOE_Q8_ENTRIES(TYPE)                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * MOE_WARPS) moe_q8_gate_up_##TYPE(          \
        const u8* __restrict__ gate, const u8* __restrict__ up, long long expert_rows,          \
        const i8* __restrict__ xq, const float* __restrict__ xd,                               \
        const int* __restrict__ experts, float* __restrict__ h, i8* __restrict__ hq,           \
        float* __restrict__ hd, unsigned* __restrict__ tickets, int kk, int ff, int k,          \
        int n_expert) {                                                                         \
        grid_sync();                                                                            \
        moe_q8_gate_up<TYPE>(gate, up, expert_rows, xq, xd, experts, h, hq, hd, tickets, kk,   \
                             ff, k, n_expert);                                                  \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * MOE_WARPS) moe_q8_down_##TYPE(             \
        const u8* __restrict__ down, long long expert_rows, const i8* __restrict__ hq,         \
        const float* __restrict__ hd, const int* __restrict__ experts,                         \
        const float* __restrict__ weights, float* __restrict__ out,                            \
        const float* __restrict__ res, const float* __restrict__ shared,                       \
        const float* __restrict__ sgate, int kk, int d, int ff, int n_expert) {                 \
        grid_sync();                                                                            \
        moe_q8_down<TYPE>(down, expert_rows, hq, hd, experts, weights, out, res, shared, sgate, \
                          kk, d, ff, n_expert);                                                 \
    }

MOE_Q8_ENTRIES(Q4_K)
MOE_Q8_ENTRIES(Q6_K)
MOE_Q8_ENTRIES(Q5_0)
MOE_Q8_ENTRIES(Q8_0)
