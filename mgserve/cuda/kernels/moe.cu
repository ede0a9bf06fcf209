// Mixture-of-experts FFN for decode (1..8 tokens), fp32 activations, reading GGUF blocks directly:
//
//   h[n, j, f] = silu(gate_e[f] . x[n]) * (up_e[f] . x[n])          e = experts[n, j]  (kernel 1)
//   out[n, r]  = sum_j weights[n, j] * (down_e[r] . h[n, j])                            (kernel 2)
//
// Expert tensors are GGUF's 3-D ffn_{gate,up,down}_exps: expert e's row f of a matrix with
// expert_rows rows per expert is row e * expert_rows + f (gate/up: expert_rows = ff, or 2 ff for
// the fused ffn_gate_up_exps whose up half starts ff rows after its gate half; down: d). Expert
// ids are read on the device, so the launch shape depends on N alone and a decode step captures
// into a CUDA graph. Ids outside [0, n_expert) are clamped (a bad router never reads outside W).
//
// Thread mapping
//   moe_gate_up_<T>: grid (N * kk, ceil(ff / (MOE_WARPS * GU_ROWS))), MOE_WARPS warps per CTA.
//     blockIdx.x is the (token, slot) pair p = n * kk + j; each warp owns GU_ROWS rows f of that
//     pair's expert (row tile blockIdx.y) and computes gate and up for them together, so
//     silu(gate) * up is applied in registers. Lanes stride over the row's 8-value runs (32 runs
//     apart), accumulate in fp32, and a shuffle tree ends each row. Only the selected experts'
//     rows are read. Pairs are the fast grid axis, so the CTAs in flight at any time cover one row
//     tile of every pair: tokens that chose the same expert read the same rows together (L2 hits).
//   moe_down_<T>: grid (N, ceil(d / (MOE_WARPS * DOWN_ROWS))). Each warp owns DOWN_ROWS output
//     rows r of token blockIdx.x and walks the kk * (ff / 8) runs of "row r of every selected
//     expert" as one flat range (ff = 640 is only 80 runs: one expert at a time would idle
//     lanes), adding weights[n, j] * (run . h) into one fp32 accumulator per row, then a shuffle
//     tree. Tokens are the fast axis here too.
//
// Determinism: every output is computed by one warp from its token's data alone, in an order fixed
// by (kk, ff, k), with no atomics: a token's result does not depend on the other tokens of the
// batch or on the batch size (the batch-invariance test checks this bitwise).
//
// Block layouts: see matvec.cu (the decoders below are its, unchanged).

#include "gguf_blocks.cuh"
#include "gguf_blocks_lowbit.cuh"
#include "gguf_blocks_iq.cuh"
// ---- the kernels -------------------------------------------------------------------------------

#define MOE_WARPS 4
#define MOE_MAX_KK 64  // experts per token the down kernel stages in shared memory
#ifndef GU_ROWS
#define GU_ROWS 1  // gate/up rows per warp (each also reads the matching up row)
#endif
#ifndef DOWN_ROWS
#define DOWN_ROWS 1  // down rows per warp
#endif
#ifndef GU_UNROLL
#define GU_UNROLL 4  // gate/up run-loop unroll: loads in flight per lane (k = 2560: 10 runs)
#endif
#ifndef DOWN_UNROLL
#define DOWN_UNROLL 8  // down run-loop unroll (kk 10 x ff 640: 25 runs per lane)
#endif

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

__device__ __forceinline__ float dot8(const float* v, const float* x) {
    const float4 a = *(const float4*)x, c = *(const float4*)(x + 4);
    return v[0] * a.x + v[1] * a.y + v[2] * a.z + v[3] * a.w + v[4] * c.x + v[5] * c.y +
           v[6] * c.z + v[7] * c.w;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// gate, up: [n_expert * expert_rows, k / BLOCK * BYTES] bytes (up may point into gate's storage);
// x: fp32 [N, k]; experts: int32 [N, kk]; h: fp32 [N, kk, ff].
template <typename T>
__device__ void moe_gate_up(const u8* __restrict__ gate, const u8* __restrict__ up,
                            long long expert_rows, const float* __restrict__ x,
                            const int* __restrict__ experts, float* __restrict__ h, int kk,
                            int ff, int k, int n_expert) {
    constexpr int R = GU_ROWS, RUNS = T::BLOCK / 8;
    const int lane = threadIdx.x & 31;
    const int f0 = (blockIdx.y * MOE_WARPS + (threadIdx.x >> 5)) * R;
    if (f0 >= ff) return;
    const int p = blockIdx.x, n = p / kk;
    const int e = min(max(experts[p], 0), n_expert - 1);
    const size_t row_bytes = (size_t)(k / T::BLOCK) * T::BYTES;
    const u8* grow[R];
    const u8* urow[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        const int f = min(f0 + rr, ff - 1);  // past the last row: re-read one, never written
        const size_t row = (size_t)e * expert_rows + f;
        grow[rr] = gate + row * row_bytes;
        urow[rr] = up + row * row_bytes;
    }
    float ag[R], au[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) ag[rr] = au[rr] = 0.f;
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
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        const float g = warp_sum(ag[rr]), u = warp_sum(au[rr]);
        if (lane == 0 && f0 + rr < ff) h[(size_t)p * ff + f0 + rr] = silu(g) * u;
    }
}

// down: [n_expert * expert_rows, ff / BLOCK * BYTES] bytes; h: fp32 [N, kk, ff];
// experts: int32 [N, kk]; weights: fp32 [N, kk]; out: fp32 [N, d]. kk <= MOE_MAX_KK.
template <typename T>
__device__ void moe_down(const u8* __restrict__ down, long long expert_rows,
                         const float* __restrict__ h, const int* __restrict__ experts,
                         const float* __restrict__ weights, float* __restrict__ out, int kk, int d,
                         int ff, int n_expert) {
    constexpr int R = DOWN_ROWS, RUNS = T::BLOCK / 8;
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
    const size_t row_bytes = (size_t)(ff / T::BLOCK) * T::BYTES;
    int rows[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) rows[rr] = min(r0 + rr, d - 1);
    float acc[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) acc[rr] = 0.f;
    const float* hn = h + (size_t)n * kk * ff;
    const int n_runs = ff / 8, total = kk * n_runs;
#pragma unroll DOWN_UNROLL
    for (int i = lane; i < total; i += 32) {
        const int j = i / n_runs, c = i - j * n_runs;
        const u8* base = down + (size_t)s_e[j] * expert_rows * row_bytes +
                         (size_t)(c / RUNS) * T::BYTES;
        float v[R][8];
#pragma unroll
        for (int rr = 0; rr < R; rr++) T::load(base + (size_t)rows[rr] * row_bytes, c % RUNS, v[rr]);
        const float* hp = hn + (size_t)j * ff + (size_t)c * 8;
        const float wj = s_w[j];
#pragma unroll
        for (int rr = 0; rr < R; rr++) acc[rr] += wj * dot8(v[rr], hp);
    }
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        const float s = warp_sum(acc[rr]);
        if (lane == 0 && r0 + rr < d) out[(size_t)n * d + r0 + rr] = s;
    }
}

#define MOE_ENTRIES(TYPE)                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * MOE_WARPS) moe_gate_up_##TYPE(             \
        const u8* __restrict__ gate, const u8* __restrict__ up, long long expert_rows,          \
        const float* __restrict__ x, const int* __restrict__ experts, float* __restrict__ h,   \
        int kk, int ff, int k, int n_expert) {                                                  \
        moe_gate_up<TYPE>(gate, up, expert_rows, x, experts, h, kk, ff, k, n_expert);          \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * MOE_WARPS) moe_down_##TYPE(                \
        const u8* __restrict__ down, long long expert_rows, const float* __restrict__ h,       \
        const int* __restrict__ experts, const float* __restrict__ weights,                    \
        float* __restrict__ out, int kk, int d, int ff, int n_expert) {                         \
        moe_down<TYPE>(down, expert_rows, h, experts, weights, out, kk, d, ff, n_expert);      \
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
