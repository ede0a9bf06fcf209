// Prompt GEMMs on tensor cores, read straight from GGUF blocks (mgserve/cuda/ops/qgemm.py):
//
//   qgemm           Y[M, n_out] (f32) = X[M, k] @ W^T, W [n_out, k] in GGUF blocks
//   qgemm_gate_up   MoE: h[q, :] (f16) = silu(gate_e X[tok(q)]) * (up_e X[tok(q)]) for every sorted
//                   (token, slot) pair q of expert e, gate and up fused in one tile
//   qgemm_down      MoE: y[q, :] (f32) = down_e h[q, :] for every sorted pair q of expert e
//   qgemm_dequant   rows of W as f16, the bits the GEMMs above multiply (for hgemm.cu: many
//                   rows of X, W decoded once rather than once per CTA row)
//
// One weight format per module (-D QG_TYPE=Q4_K, ...), read through gguf_split.cuh's fetch /
// decode of 8-value runs. X is f16 in global memory (the caller rounds x once, to nearest even,
// as torch's .to(float16) does); the products are mma.sync m16n8k16 f16 x f16 with f32
// accumulators.
//
// A CTA (QG_WARPS_M x QG_WARPS_N warps) owns a BM x BN tile of the output and walks k in steps
// of BK (the -D macros below, QGemmTuning in ops/qgemm.py). Per step: the X tile [BM, BK] comes
// by cp.async (16 bytes a copy) and the W tile [BN, BK] is decoded by the CTA (each thread a few
// 8-value runs, rounded to f16) into shared memory, double-buffered: the raw W bits of step s + 1
// are fetched (gguf_split.cuh) before the MMAs of step s, decoded and stored after them (so the
// loads' latency hides behind the products), one __syncthreads a step.
// Shared rows are padded to BK + 8 halves so the ldmatrix reads are free of bank conflicts;
// each warp then runs (BM / WARPS_M / 16) x (BN / WARPS_N / 8) m16n8k16 products per 16 k.
//
// Batch invariance, by construction: Y[m, n] is the f32 chain acc = mma(acc, X[m, k16], W[n, k16])
// over k16 = 0, 16, 32, ... in ascending order from acc = 0, whatever M, the tile sizes, the
// tile that holds row m or the other rows of X. No split-K; rows past M and k past the end are
// zeros (adding an exact 0 changes nothing). So a token's result is bitwise the same alone or in
// any batch, and under any QGemmTuning. The MoE kernels take tiles that never mix experts, so a
// pair's result depends only on its token's x and its expert's weights.
//
// Grouped tiles (MoE): the (token, slot) pairs are sorted by expert (stable), expert e owning
// sorted positions [row_start[e], row_start[e + 1]); tile_start[e] = sum over e' < e of
// ceil(count(e') / BM). blockIdx.y = t is tile t - tile_start[e] of the expert e with
// tile_start[e] <= t < tile_start[e + 1] (binary search); CTAs past tile_start[n_expert] exit,
// so the grid is sized on the host for the worst case without reading the counts.
//
// Gate/up: the shared W tile interleaves the two matrices, row 2i = gate row c0 + i and row
// 2i + 1 = up row c0 + i, so each thread's accumulator pair (c0, c1) of an m16n8 tile is (gate,
// up) of one h column, and silu(gate) * up (f32, rounded once to f16) is written directly.

#include "gguf_split.cuh"
#include "math.cuh"
#include "mma.cuh"
#include "pdl.cuh"
#include "qgemm_common.cuh"

#ifndef QG_TYPE
#define QG_TYPE Q4_K
#endif
#ifndef QG_BM
#define QG_BM 128  // output rows (tokens) per CTA
#endif
#ifndef QG_BN
#define QG_BN 128  // output columns (W rows) per CTA
#endif
#ifndef QG_BK
#define QG_BK 32  // k per pipeline step
#endif
#ifndef QG_WARPS_M
#define QG_WARPS_M 2
#endif
#ifndef QG_WARPS_N
#define QG_WARPS_N 4
#endif
#ifndef QG_MIN_CTAS
#define QG_MIN_CTAS 2  // __launch_bounds__ minimum CTAs per SM (caps registers)
#endif

typedef SplitFormat<QG_TYPE>::T WT;  // raw-bits fetch, decode after the step's products
constexpr int BM = QG_BM, BN = QG_BN, BK = QG_BK;
constexpr int THREADS = 32 * QG_WARPS_M * QG_WARPS_N;
constexpr int WTM = BM / QG_WARPS_M, WTN = BN / QG_WARPS_N;  // one warp's tile
constexpr int MT = WTM / 16, NT = WTN / 8;                   // its m16 and n8 tiles
constexpr int LDS = BK + 8;                                  // shared row stride (halves)
constexpr int RUNS = BK / 8;                                 // 8-value runs per tile row
constexpr int W_RUNS = BN * RUNS / THREADS;                  // W runs decoded per thread
constexpr int X_COPIES = BM * RUNS / THREADS;                // X 16-byte copies per thread
static_assert(BM % (16 * QG_WARPS_M) == 0 && BN % (16 * QG_WARPS_N) == 0, "warp tile shape");
static_assert(BK % 16 == 0, "BK is a multiple of 16");
static_assert(W_RUNS * THREADS == BN * RUNS && X_COPIES * THREADS == BM * RUNS, "even loads");
static_assert(2 * (BM + BN) * LDS * 2 <= 48 * 1024, "static shared memory over 48 KB");

// ---- PTX helpers (the rest: mma.cuh) -------------------------------------------------------------

__device__ __forceinline__ void cp_commit_wait_all() {
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// Four 8x8 b16 matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldsm4(uint4& r, const u16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "r"(smem_u32(p))
                 : "memory");
}

// ---- the tile ------------------------------------------------------------------------------------

template <bool GATED>
__device__ __forceinline__ void qgemm_tile(const TileArgs& a) {
    __shared__ __align__(16) u16 xs[2][BM][LDS];
    __shared__ __align__(16) u16 ws[2][BN][LDS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const size_t row_bytes = (size_t)(a.k / WT::BLOCK) * WT::BYTES;

    const u8* wsrc[W_RUNS];  // this thread's W row (null: past n_rows), shared row, run
    int wr[W_RUNS], wc[W_RUNS];
#pragma unroll
    for (int i = 0; i < W_RUNS; i++) {
        const int q = tid + i * THREADS;
        wr[i] = q / RUNS;
        wc[i] = q % RUNS;
        const int src = GATED ? a.n0 / 2 + wr[i] / 2 : a.n0 + wr[i];
        const u8* base = (GATED && (wr[i] & 1)) ? a.wb : a.wa;
        wsrc[i] = src < a.n_rows ? base + (size_t)src * row_bytes : nullptr;
    }
    const u16* xsrc[X_COPIES];  // this thread's X row (null: past m_valid), shared row, run
    int xr[X_COPIES], xc[X_COPIES];
#pragma unroll
    for (int i = 0; i < X_COPIES; i++) {
        const int q = tid + i * THREADS;
        xr[i] = q / RUNS;
        xc[i] = q % RUNS;
        const int m = a.m0 + xr[i];
        xsrc[i] = xr[i] < a.m_valid ? a.x + (size_t)(a.x_rows ? a.x_rows[m] : m) * a.k : nullptr;
    }

    typename WT::Raw wraw[W_RUNS];  // the next step's W runs as fetched (raw bits)
    bool wvalid[W_RUNS];
    auto load_w = [&](int k0) {  // loads only: decoded by store_w after the step's products
#pragma unroll
        for (int i = 0; i < W_RUNS; i++) {
            const unsigned kk = k0 + wc[i] * 8;  // unsigned: / and % by BLOCK are shifts
            wvalid[i] = wsrc[i] != nullptr && kk < (unsigned)a.k;
            wraw[i] = wvalid[i] ? WT::fetch(wsrc[i] + (size_t)(kk / WT::BLOCK) * WT::BYTES,
                                            (int)(kk % WT::BLOCK) / 8)
                                : typename WT::Raw{};
        }
    };
    auto store_w = [&](int buf) {
#pragma unroll
        for (int i = 0; i < W_RUNS; i++)
            *(uint4*)&ws[buf][wr[i]][wc[i] * 8] =
                wvalid[i] ? w_f16<WT>(wraw[i]) : make_uint4(0, 0, 0, 0);
    };
    auto load_x = [&](int k0, int buf) {
#pragma unroll
        for (int i = 0; i < X_COPIES; i++) {
            const int kk = k0 + xc[i] * 8;
            const bool valid = xsrc[i] != nullptr && kk < a.k;
            cp16(smem_u32(&xs[buf][xr[i]][xc[i] * 8]), valid ? xsrc[i] + kk : a.x, valid);
        }
    };

    const int wm = warp / QG_WARPS_N, wn = warp % QG_WARPS_N;
    float acc[MT][NT][4];
    zero_tiles(acc);

    load_x(0, 0);
    load_w(0);
    store_w(0);
    cp_commit_wait_all();
    __syncthreads();
    const int n_steps = (a.k + BK - 1) / BK;
    for (int s = 0; s < n_steps; s++) {
        const int buf = s & 1;
        const bool more = s + 1 < n_steps;
        if (more) {
            load_x((s + 1) * BK, buf ^ 1);
            cp_commit();
            load_w((s + 1) * BK);
        }
#pragma unroll
        for (int k16 = 0; k16 < BK; k16 += 16) {
            uint4 af[MT];
#pragma unroll
            for (int i = 0; i < MT; i++)
                ldsm4(af[i], &xs[buf][wm * WTM + i * 16 + (lane & 15)][k16 + (lane >> 4) * 8]);
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                uint4 bf;  // x, y: n8 tile j (k 0..7, 8..15); z, w: tile j + 1
                ldsm4(bf, &ws[buf][wn * WTN + j * 8 + (lane & 7) + (lane >> 4) * 8]
                             [k16 + ((lane >> 3) & 1) * 8]);
#pragma unroll
                for (int i = 0; i < MT; i++) {
                    mma16816(acc[i][j], af[i], bf.x, bf.y);
                    mma16816(acc[i][j + 1], af[i], bf.z, bf.w);
                }
            }
        }
        if (more) {
            store_w(buf ^ 1);
            asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        }
        __syncthreads();
    }

    // Accumulator c of tile (i, j): row g (+8 for c2, c3), columns 2t, 2t + 1 (g = lane / 4,
    // t = lane % 4), as the m16n8 C fragment lays it out.
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < MT; i++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int r = wm * WTM + i * 16 + g + half * 8;
            if (r >= a.m_valid) continue;
            const size_t m = (size_t)(a.m0 + r);
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const float v0 = acc[i][j][2 * half], v1 = acc[i][j][2 * half + 1];
                tile_store<GATED>(a, m, a.n0 + wn * WTN + j * 8 + 2 * t, v0, v1);
            }
        }
    }
}

// ---- entries -------------------------------------------------------------------------------------

// w: [n_out, k / BLOCK * BYTES] bytes; x: f16 [m, k]; y: f32 [m, n_out].
// grid (ceil(n_out / BN), ceil(m / BM)).
extern "C" __global__ void __launch_bounds__(THREADS, QG_MIN_CTAS)
    qgemm(const u8* __restrict__ w, const u16* __restrict__ x, float* __restrict__ y, int m,
          int n_out, int k) {
    grid_sync();
    const int m0 = blockIdx.y * BM;
    qgemm_tile<false>({w, w, n_out, (int)blockIdx.x * BN, x, nullptr, m0, min(BM, m - m0), k, y,
                       nullptr, n_out});
}

// gate, up: [n_expert * expert_rows, k / BLOCK * BYTES] bytes (up may point into gate's storage);
// x: f16 [N, k]; row_token: int32 [P] token of each sorted pair; row_start, tile_start: int32
// [n_expert + 1]; h: f16 [P, ff]. grid (ceil(2 ff / BN), worst-case tiles).
extern "C" __global__ void __launch_bounds__(THREADS, QG_MIN_CTAS)
    qgemm_gate_up(const u8* __restrict__ gate, const u8* __restrict__ up, long long expert_rows,
                  const u16* __restrict__ x, const int* __restrict__ row_token,
                  const int* __restrict__ row_start, const int* __restrict__ tile_start,
                  u16* __restrict__ h, int ff, int k, int n_expert) {
    grid_sync();
    int e, m0, m_valid;
    if (!grouped_tile<BM>(row_start, tile_start, n_expert, blockIdx.y, &e, &m0, &m_valid)) return;
    const size_t off = (size_t)e * expert_rows * ((size_t)(k / WT::BLOCK) * WT::BYTES);
    qgemm_tile<true>({gate + off, up + off, ff, (int)blockIdx.x * BN, x, row_token, m0, m_valid, k,
                      nullptr, h, ff});
}

// down: [n_expert * expert_rows, k / BLOCK * BYTES] bytes (k = ff); h: f16 [P, k]; y: f32 [P, d].
// grid (ceil(d / BN), worst-case tiles).
extern "C" __global__ void __launch_bounds__(THREADS, QG_MIN_CTAS)
    qgemm_down(const u8* __restrict__ down, long long expert_rows, const u16* __restrict__ h,
               const int* __restrict__ row_start, const int* __restrict__ tile_start,
               float* __restrict__ y, int d, int k, int n_expert) {
    grid_sync();
    int e, m0, m_valid;
    if (!grouped_tile<BM>(row_start, tile_start, n_expert, blockIdx.y, &e, &m0, &m_valid)) return;
    const u8* w = down + (size_t)e * expert_rows * ((size_t)(k / WT::BLOCK) * WT::BYTES);
    qgemm_tile<false>({w, w, d, (int)blockIdx.x * BN, h, nullptr, m0, m_valid, k, y, nullptr, d});
}

// W rows [row0, row0 + n_rows) as f16 [n_rows, k]: the values qgemm_tile decodes into its W
// tiles, bitwise (w_f16), so hgemm.cu's product of them is this file's product (its header).
// One thread per 8-value run, consecutive threads on consecutive runs of a row.
// grid ceil(n_rows * k / 8 / DEQUANT_THREADS).
constexpr int DEQUANT_THREADS = 256;
extern "C" __global__ void __launch_bounds__(DEQUANT_THREADS)
    qgemm_dequant(const u8* __restrict__ w, u16* __restrict__ out, long long row0, int n_rows,
                  int k) {
    grid_sync();
    const int runs = k / 8;
    const long long q = (long long)blockIdx.x * DEQUANT_THREADS + threadIdx.x;
    if (q >= (long long)n_rows * runs) return;
    const int r = (int)(q / runs), c = (int)(q - (long long)r * runs);
    const u8* row = w + (size_t)(row0 + r) * ((size_t)(k / WT::BLOCK) * WT::BYTES);
    const int kk = c * 8;
    *(uint4*)(out + (size_t)r * k + kk) =
        w_f16<WT>(WT::fetch(row + (size_t)(kk / WT::BLOCK) * WT::BYTES, (kk % WT::BLOCK) / 8));
}
