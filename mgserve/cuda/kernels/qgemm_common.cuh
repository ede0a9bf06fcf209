// What qgemm.cu (mma.sync) and qgemm_wgmma.cu (warpgroup MMA) share: the f16 decode of a W run,
// a tile's operands, and the grouped MoE tiles' lookup (qgemm.cu's header describes them).
#pragma once
#include "gguf_split.cuh"
#include "math.cuh"
#include "scalar.cuh"

// The 8 values of a fetched W run as f16 (to nearest even), as the W tiles and qgemm_dequant
// store them (one code path: they all give the same bits).
template <typename WT>
__device__ __forceinline__ uint4 w_f16(const typename WT::Raw& raw) {
    float wv[8];
    WT::decode(raw, wv);
    return f16x8_rn(wv);
}

// Where a CTA's operands come from and where its results go.
struct TileArgs {
    const u8* wa;        // W rows (gated: the gate matrix), row 0 of this expert
    const u8* wb;        // gated: the up matrix (else unused)
    int n_rows;          // rows of W (gated: of gate and of up), output columns past it masked
    int n0;              // first shared W row of the tile (gated: 2 x the first h column)
    const u16* x;        // X f16 [*, k]
    const int* x_rows;   // X row of output row m0 + i (null: row m0 + i itself)
    int m0;              // first output row of the tile
    int m_valid;         // output rows of the tile (<= BM); later rows are masked
    int k;               // reduction length (a multiple of 8 and of the format's block)
    float* y;            // f32 output [*, ldy] (not gated)
    u16* h;              // gated: f16 output [*, n_rows]
    int ldy;             // row stride of y
};

// The expert and rows of grouped tile t of TM rows (qgemm.cu's header); false past the last.
template <int TM>
__device__ __forceinline__ bool grouped_tile(const int* __restrict__ row_start,
                                             const int* __restrict__ tile_start, int n_expert,
                                             int t, int* e, int* m0, int* m_valid) {
    if (t >= tile_start[n_expert]) return false;
    int lo = 0, hi = n_expert - 1;  // the last e with tile_start[e] <= t
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (tile_start[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    *e = lo;
    *m0 = row_start[lo] + (t - tile_start[lo]) * TM;
    *m_valid = min(TM, row_start[lo + 1] - *m0);
    return true;
}

// One output value pair of a tile (columns col, col + 1 of row m; the accumulator pair of an
// m16n8 C fragment or of a wgmma's): gated, silu(gate) * up of h column col / 2; else y.
template <bool GATED>
__device__ __forceinline__ void tile_store(const TileArgs& a, size_t m, int col, float v0,
                                           float v1) {
    if constexpr (GATED) {
        const int hc = col / 2;
        if (hc < a.n_rows) a.h[m * a.n_rows + hc] = f16_rn(silu(v0) * v1);
    } else {
        float* out = a.y + m * a.ldy + col;
        if (col + 1 < a.n_rows) {
            out[0] = v0;
            out[1] = v1;
        } else if (col < a.n_rows) {
            out[0] = v0;
        }
    }
}
