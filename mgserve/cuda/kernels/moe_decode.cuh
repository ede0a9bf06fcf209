// The frame of the decode mixture-of-experts kernels (1..8 tokens), shared by moe.cu (fp32
// activations) and moe_q8.cu (int8 activations, dp4a):
//
//   h[n, j, f] = silu(gate_e[f] . x[n]) * (up_e[f] . x[n])          e = experts[n, j]  (gate_up)
//   out[n, r]  = res[n, r] + (sum_j weights[n, j] * (down_e[r] . h[n, j])   (down; res optional)
//                             + shared[n, r] * gate[n])   (the shared expert's output, optional;
//                                                          gate optional: ungated)
//
// Expert tensors are GGUF's 3-D ffn_{gate,up,down}_exps: expert e's row f of a matrix with
// expert_rows rows per expert is row e * expert_rows + f (gate/up: expert_rows = ff, or 2 ff for
// the fused ffn_gate_up_exps whose up half starts ff rows after its gate half; down: d). Expert
// ids are read on the device, so the launch shape depends on N alone and a decode step captures
// into a CUDA graph. Ids outside [0, n_expert) are clamped (a bad router never reads outside W).
//
// Thread mapping, MOE_WARPS warps per CTA:
//   gate_up: grid (N * kk, ceil(ff / (MOE_WARPS * GU_ROWS))). blockIdx.x is the (token, slot)
//     pair p = n * kk + j; each warp owns GU_ROWS rows f of that pair's expert (row tile
//     blockIdx.y) and computes gate and up for them together, so silu(gate) * up is applied in
//     registers. Only the selected experts' rows are read. Pairs are the fast grid axis, so the
//     CTAs in flight at any time cover one row tile of every pair: tokens that chose the same
//     expert read the same rows together (L2 hits).
//   down: grid (N, ceil(d / (MOE_WARPS * DOWN_ROWS))). Each warp owns DOWN_ROWS output rows r of
//     token blockIdx.x and walks "row r of every selected expert" as one flat range (ff = 640 is
//     only 80 runs of 8 values: one expert at a time would idle lanes), adding
//     weights[n, j] * (row . h[n, j]) into one fp32 accumulator per row. Tokens are the fast axis
//     here too.
// A kernel file supplies the loop of one lane over its rows (how it reads a format and the
// activations: lanes stride over a row's units, 32 apart); the frame below does the rest, and
// ends each row with a shuffle tree.
//
// Determinism: every output is computed by one warp from its token's data alone, in an order fixed
// by (kk, ff, k), with no atomics: a token's result does not depend on the other tokens of the
// batch or on the batch size (the batch-invariance test checks this bitwise).
#pragma once
#include "math.cuh"
#include "scalar.cuh"
#include "tickets.cuh"

#define MOE_WARPS 4
#define MOE_MAX_KK 64  // experts per token the down kernel stages in shared memory
#ifndef GU_ROWS
#define GU_ROWS 1  // gate/up rows per warp (each also reads the matching up row)
#endif
#ifndef DOWN_ROWS
#define DOWN_ROWS 1  // down rows per warp
#endif

// One gate_up warp: gate, up: [n_expert * expert_rows, k / T::BLOCK * T::BYTES] bytes (up may
// point into gate's storage); experts: int32 [N, kk]; h: fp32 [N, kk, ff].
// sum(lane, n, grow, urow, ag, au) adds this lane's share of (gate row rr . x[n]) to ag[rr] and of
// (up row rr . x[n]) to au[rr], for the warp's GU_ROWS rows starting at grow[rr] / urow[rr].
// hq, hd, tickets (all null, or none): h is also rounded to int8 as quantize_q8 would round it
// (hq int8 [N * kk, ff], hd fp32 [N * kk, ff / 32]) by the CTA that finishes each group of 32 rows
// of a pair last; tickets: one counter per group, 0 before and after (cuda/tickets.py). Needs
// ff % 32 == 0 and 32 % (MOE_WARPS * GU_ROWS) == 0 (every CTA inside one group, no warp idle:
// MoeCuda checks both).
template <typename T, typename Sum>
__device__ __forceinline__ void moe_gate_up_warp(const u8* __restrict__ gate,
                                                 const u8* __restrict__ up, long long expert_rows,
                                                 const int* __restrict__ experts,
                                                 float* __restrict__ h, i8* __restrict__ hq,
                                                 float* __restrict__ hd,
                                                 unsigned* __restrict__ tickets, int kk, int ff,
                                                 int k, int n_expert, Sum sum) {
    constexpr int R = GU_ROWS;
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
    float ag[R] = {}, au[R] = {};
    sum(lane, n, grow, urow, ag, au);
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        const float g = warp_sum(ag[rr]), u = warp_sum(au[rr]);
        if (lane == 0 && f0 + rr < ff) h[(size_t)p * ff + f0 + rr] = silu(g) * u;
    }
    if (hq == nullptr) return;
    const long long group = (long long)p * (ff / 32) + blockIdx.y * (MOE_WARPS * R) / 32;
    const bool last = last_cta(tickets + group, 32 / (MOE_WARPS * R));  // the warps' rows published
    if (!last || threadIdx.x >= 32) return;  // one warp of the last CTA rounds the group
    ticket_acquire();  // the other CTAs' rows, published by their tickets, are visible
    const long long idx = group * 32 + 4 * (lane & 7);  // lanes 0..7: 4 values each
    const float4 v = lane < 8 ? __ldcg((const float4*)(h + idx)) : make_float4(0.f, 0.f, 0.f, 0.f);
    q8_store4(v, lane < 8, hq, hd, idx);
    if (lane == 0) tickets[group] = 0u;
}

// One down warp: experts: int32 [N, kk]; weights: fp32 [N, kk]; out: fp32 [N, d]; kk <= MOE_MAX_KK.
// shared: fp32 [N, d] or null, gate: fp32 [N] or null: added as moe_add_shared_f32 adds them
// (routed + shared * gate, then the residual), so the fused sum has its bits.
// sum(lane, n, s_e, s_w, row_bytes, rows, acc) adds this lane's share of
// sum_j s_w[j] * (row rows[rr] of expert s_e[j] . h[n, j]) to acc[rr], for the warp's DOWN_ROWS
// rows (s_e: the token's clamped expert ids, s_w: their weights, both in shared memory; rows of
// row_bytes = ff / T::BLOCK * T::BYTES bytes).
template <typename T, typename Sum>
__device__ __forceinline__ void moe_down_warp(const int* __restrict__ experts,
                                              const float* __restrict__ weights,
                                              float* __restrict__ out,
                                              const float* __restrict__ res,
                                              const float* __restrict__ shared,
                                              const float* __restrict__ gate, int kk, int d,
                                              int ff, int n_expert, Sum sum) {
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
    const size_t row_bytes = (size_t)(ff / T::BLOCK) * T::BYTES;
    int rows[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) rows[rr] = min(r0 + rr, d - 1);
    float acc[R] = {};
    sum(lane, n, s_e, s_w, row_bytes, rows, acc);
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        float s = warp_sum(acc[rr]);
        if (lane == 0 && r0 + rr < d) {
            const size_t o = (size_t)n * d + r0 + rr;
            if (shared) s = __fadd_rn(s, gate ? __fmul_rn(shared[o], gate[n]) : shared[o]);
            out[o] = res ? __fadd_rn(res[o], s) : s;
        }
    }
}
