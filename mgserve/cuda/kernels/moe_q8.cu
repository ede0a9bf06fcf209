// Mixture-of-experts FFN for decode (1..8 tokens) on int8 activations (dp4a), the int8 twin of
// moe.cu (same math, same thread mapping; read its header first):
//
//   h[n, j, f] = silu(gate_e[f] . xq[n]) * (up_e[f] . xq[n])        e = experts[n, j]  (kernel 1)
//   out[n, r]  = sum_j weights[n, j] * (down_e[r] . hq[n, j])                           (kernel 2)
//
// xq / hq are x and h rounded to int8 by matvec_q8.cu's quantize_q8 (one fp32 scale per 32
// values: xd / hd), so each weight chunk is multiplied with integer dot products against the
// weights' packed quants and the block scales are applied in fp32; the weights keep their exact
// value, only the activations are rounded. h is written in fp32 and quantized by the caller.
//
// Thread mapping (as in moe.cu: the pair / token is the fast grid axis)
//   moe_q8_gate_up_<T>: grid (N * kk, ceil(ff / (MOE_WARPS * GU_ROWS))); blockIdx.x is the pair
//     p = n * kk + j; each warp owns GU_ROWS rows f (row tile blockIdx.y) of gate and of up for
//     that pair; lanes stride over the row's chunks (a format's 16-byte unit of quants, T::CHUNKS
//     per block), all of the warp's rows loaded before any arithmetic; a shuffle tree ends a row.
//   moe_q8_down_<T>: grid (N, ceil(d / (MOE_WARPS * DOWN_ROWS))); each warp owns DOWN_ROWS rows
//     (row tile blockIdx.y) of token blockIdx.x and walks the kk * chunks-per-row range of every
//     selected expert's row as one flat range, adding weights[n, j] * (chunk . hq[n, j]) into one
//     fp32 accumulator per row.
// No atomics; each output depends on its token alone (batch-invariant, bitwise).
//
// Formats (layouts and chunk decoders: matvec_q8.cu's, unchanged): Q8_0, Q5_0, Q4_K, Q6_K.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef signed char i8;

__device__ __forceinline__ float f16_bits(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Blocks of 22, 34 and 210 bytes leave most fields only 2-byte aligned: read them as u16 pairs.
__device__ __forceinline__ u32 ld_u16(const u8* p) { return *(const u16*)p; }
__device__ __forceinline__ u32 ld_u32_a2(const u8* p) { return ld_u16(p) | (ld_u16(p + 2) << 16); }

__device__ __forceinline__ int dot4(u32 a, u32 b, int acc) { return __dp4a((int)a, (int)b, acc); }

#include "gguf_blocks_q8.cuh"

// ---- the kernels -------------------------------------------------------------------------------

#define MOE_WARPS 4
#define MOE_MAX_KK 64
#ifndef GU_ROWS
#define GU_ROWS 1
#endif
#ifndef DOWN_ROWS
#define DOWN_ROWS 1
#endif

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// gate, up: [n_expert * expert_rows, k / BLOCK * BYTES] bytes; xq: int8 [N, k];
// xd: fp32 [N, k / 32]; experts: int32 [N, kk]; h: fp32 [N, kk, ff].
template <typename T>
__device__ void moe_q8_gate_up(const u8* __restrict__ gate, const u8* __restrict__ up,
                               long long expert_rows, const i8* __restrict__ xq,
                               const float* __restrict__ xd, const int* __restrict__ experts,
                               float* __restrict__ h, int kk, int ff, int k, int n_expert) {
    constexpr int R = GU_ROWS;
    const int lane = threadIdx.x & 31;
    const int f0 = (blockIdx.y * MOE_WARPS + (threadIdx.x >> 5)) * R;
    if (f0 >= ff) return;
    const int p = blockIdx.x, n = p / kk;
    const int e = min(max(experts[p], 0), n_expert - 1);
    const size_t n_blocks = k / T::BLOCK, row_bytes = n_blocks * T::BYTES;
    const u8* grow[R];
    const u8* urow[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        const size_t row = (size_t)e * expert_rows + min(f0 + rr, ff - 1);
        grow[rr] = gate + row * row_bytes;
        urow[rr] = up + row * row_bytes;
    }
    float ag[R], au[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) ag[rr] = au[rr] = 0.f;
    const i8* xn = xq + (size_t)n * k;
    const float* dn = xd + (size_t)n * (k / 32);
    const int n_chunks = (int)n_blocks * T::CHUNKS;
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
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        const float g = warp_sum(ag[rr]), u = warp_sum(au[rr]);
        if (lane == 0 && f0 + rr < ff) h[(size_t)p * ff + f0 + rr] = silu(g) * u;
    }
}

// down: [n_expert * expert_rows, ff / BLOCK * BYTES] bytes; hq: int8 [N * kk, ff];
// hd: fp32 [N * kk, ff / 32]; experts: int32 [N, kk]; weights: fp32 [N, kk]; out: fp32 [N, d].
template <typename T>
__device__ void moe_q8_down(const u8* __restrict__ down, long long expert_rows,
                            const i8* __restrict__ hq, const float* __restrict__ hd,
                            const int* __restrict__ experts, const float* __restrict__ weights,
                            float* __restrict__ out, int kk, int d, int ff, int n_expert) {
    constexpr int R = DOWN_ROWS;
    __shared__ int s_e[MOE_MAX_KK];
    __shared__ float s_w[MOE_MAX_KK];
    const int n = blockIdx.x;
    if (threadIdx.x < kk) {
        s_e[threadIdx.x] = min(max(experts[n * kk + threadIdx.x], 0), n_expert - 1);
        s_w[threadIdx.x] = weights[n * kk + threadIdx.x];
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int r0 = (blockIdx.y * MOE_WARPS + (threadIdx.x >> 5)) * R;
    if (r0 >= d) return;
    const int n_blocks = ff / T::BLOCK, per_row = n_blocks * T::CHUNKS, total = kk * per_row;
    const size_t row_bytes = (size_t)n_blocks * T::BYTES;
    int rows[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) rows[rr] = min(r0 + rr, d - 1);
    float acc[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) acc[rr] = 0.f;
#pragma unroll 2
    for (int i = lane; i < total; i += 32) {
        const int jj = i / per_row, c = i - jj * per_row;
        const int b = c / T::CHUNKS, j = c % T::CHUNKS;
        const u8* base = down + (size_t)s_e[jj] * expert_rows * row_bytes + (size_t)b * T::BYTES;
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
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        const float s = warp_sum(acc[rr]);
        if (lane == 0 && r0 + rr < d) out[(size_t)n * d + r0 + rr] = s;
    }
}

#define MOE_Q8_ENTRIES(TYPE)                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * MOE_WARPS) moe_q8_gate_up_##TYPE(          \
        const u8* __restrict__ gate, const u8* __restrict__ up, long long expert_rows,          \
        const i8* __restrict__ xq, const float* __restrict__ xd,                               \
        const int* __restrict__ experts, float* __restrict__ h, int kk, int ff, int k,         \
        int n_expert) {                                                                         \
        moe_q8_gate_up<TYPE>(gate, up, expert_rows, xq, xd, experts, h, kk, ff, k, n_expert);  \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * MOE_WARPS) moe_q8_down_##TYPE(             \
        const u8* __restrict__ down, long long expert_rows, const i8* __restrict__ hq,         \
        const float* __restrict__ hd, const int* __restrict__ experts,                         \
        const float* __restrict__ weights, float* __restrict__ out, int kk, int d, int ff,     \
        int n_expert) {                                                                         \
        moe_q8_down<TYPE>(down, expert_rows, hq, hd, experts, weights, out, kk, d, ff,         \
                          n_expert);                                                            \
    }

MOE_Q8_ENTRIES(Q4_K)
MOE_Q8_ENTRIES(Q6_K)
MOE_Q8_ENTRIES(Q5_0)
MOE_Q8_ENTRIES(Q8_0)
