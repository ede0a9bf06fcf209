// The weight-streaming matrix-vector product of matvec.cu (its header comment: the math, the
// thread mapping, the tuning), as a template that other kernels build on (route.cu's router).
// The block decoders of the formats a kernel instantiates come from the including file.
#pragma once
#include "gguf_blocks.cuh"
#include "math.cuh"
#include "pdl.cuh"

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
#ifndef RUN_BATCH
#define RUN_BATCH 0  // 1: one token's run loop in batches of RUN_UNROLL runs (below)
#endif

// w: [n_rows, k / BLOCK * BYTES] bytes; x: fp32 [n_tok, k]; y: fp32 [n_tok, n_rows].
// n_rows: output rows; k: inputs per row, a multiple of BLOCK; n_tok: tokens, 1..NT.
// bias [n_rows] and res [n_tok, n_rows] (null when absent): y = res + (W x + bias).
template <typename T, int NT>
__device__ void matvec(const u8* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,
                       int n_rows, int k, int n_tok, const float* __restrict__ bias,
                       const float* __restrict__ res) {
    constexpr int R = NT == 1 ? ROWS_PER_WARP_1 : ROWS_PER_WARP_N;
    constexpr int RUNS = T::BLOCK / 8;  // 8-value runs per block
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * WARPS_PER_CTA + (threadIdx.x >> 5)) * R;
    const size_t row_bytes = (size_t)(k / T::BLOCK) * T::BYTES;
    // the CTA's rows into L2 while the kernel before still runs (pdl.cuh)
    prefetch_rows_l2(w, row_bytes, blockIdx.x * WARPS_PER_CTA * R, WARPS_PER_CTA * R, n_rows);
    grid_sync();
    if (row0 >= n_rows) return;
    const u8* wrow[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        // past the last row: re-read a valid row (keeps the loop branch-free); never written
        const int row = row0 + rr < n_rows ? row0 + rr : n_rows - 1;
        wrow[rr] = w + (size_t)row * row_bytes;
    }
    float acc[R][NT] = {};
    const int n_runs = k / 8;
    if (RUN_BATCH && NT == 1) {
        // every load of RUN_UNROLL runs (W and x) issued before any is used, the runs past the
        // row's end skipped: a row of up to 256 RUN_UNROLL inputs in one round trip, where the
        // unrolled loop below does a trip count's remainder a run at a time. The same sums in
        // the same order (so the same bits).
        for (int r0 = lane; r0 < n_runs; r0 += 32 * RUN_UNROLL) {
            float v[RUN_UNROLL][R][8];
            float4 a[RUN_UNROLL], c[RUN_UNROLL];
#pragma unroll
            for (int u = 0; u < RUN_UNROLL; u++) {
                const int r = r0 + 32 * u;
                if (r < n_runs) {
#pragma unroll
                    for (int rr = 0; rr < R; rr++)
                        T::load(wrow[rr] + (size_t)(r / RUNS) * T::BYTES, r % RUNS, v[u][rr]);
                    const float4* xp = (const float4*)(x + (size_t)r * 8);
                    a[u] = xp[0];
                    c[u] = xp[1];
                }
            }
#pragma unroll
            for (int u = 0; u < RUN_UNROLL; u++) {
                if (r0 + 32 * u < n_runs) {
#pragma unroll
                    for (int rr = 0; rr < R; rr++) acc[rr][0] += dot8(v[u][rr], a[u], c[u]);
                }
            }
        }
    } else {
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
                    for (int rr = 0; rr < R; rr++) acc[rr][t] += dot8(v[rr], a, c);
                }
            }
        }
    }
    warp_sums_put(acc, lane, [&](float v, int rr, int t) {
        if (t < n_tok && row0 + rr < n_rows)
            y[(size_t)t * n_rows + row0 + rr] = linear_out(v, bias, res, t, row0 + rr, n_rows);
    });
}

