// Hyper-connection mix and combine (qwen4exp; reference: mgserve/core/reference/hyper_connections.py).
//
// For streams x [N, hc, d] (f32), gamma [hc, d], down [r, hc*d], up [hc*d, r], inject [hc, hc*d]
// (GGUF rows of any format gguf_blocks*.cuh decodes; a Q4_K file has Q4_K / Q6_K down and inject
// and Q5_0 up, since 320-value rows cannot hold 256-value blocks):
//
//   inv[t, s]  = rsqrt(mean_c x[t, s, c]^2 + eps)                   (per token and stream)
//   xn[t, s, c] = x[t, s, c] * inv[t, s] * gamma[s, c]
//   low[t, :]  = silu((down . flat(xn[t])) / hc)                     [N, r]
//   inj[t, :]  = 2 * sigmoid((inject . flat(xn[t])) / hc)            [N, hc]
//   mixed[t, c] = mean_s sigmoid(up[s*d + c, :] . low[t]) * xn[t, s, c]   [N, d]
//
// Two kernels per mix (no atomics; every value depends on its own token only, bitwise):
//
// hc_down_<T>_t<NT>: the down (and inject) products, split by stream. Since inv[t, s] is one
// factor per stream, down . flat(xn) = sum_s inv[t, s] * (down[:, stream s] . (x * gamma)[t, s]),
// so each CTA computes one stream's partial products P[s, t, row] of x * gamma (no norm needed
// yet) and the sum of squares SS[s, t] of its stream; hc_up combines them.
//   grid = (row blocks * hc, token groups of NT), block = DOWN_WARPS warps. blockIdx.x % hc is
//   the stream s, blockIdx.x / hc the row block (DOWN_WARPS * DOWN_ROWS rows of [down | inject]).
//   The stream's d values are walked in parts of `part` values (part % 256 == 0 unless it is all
//   of d, so a lane visits the same runs in the same order whatever the part size): the CTA
//   stages x * gamma of the part for its NT tokens in shared memory, then each warp owns
//   DOWN_ROWS rows, each lane 8-value runs lane, lane + 32, ... of them (one 16-byte BF16 load
//   per run), DOWN_BATCH runs' loads issued before any is used, fp32 accumulation, a shuffle
//   tree at the end. Before staging, the CTA prefetches its weight rows into L2.
//   Row block 0 of each stream also sums squares while staging (thread i takes the stream's
//   float4s i (mod blockDim) in order; lanes, then warps in order: independent of NT) and writes
//   SS[s, t]; when fused with the previous combine it also writes x_new = x + inj_prev * out_prev
//   for its stream, and every CTA stages (and hc_up later reads) that new x.
//   Shared memory x * gamma layout (float4): [t][half][run], half 0 = values 0..3 of the run,
//   half 1 = values 4..7, so the lanes' float4 reads are consecutive (no bank conflicts).
//
// hc_up_<T>_t<NT>: the up product fused with its sigmoid, * xn and the mean over streams.
//   grid = (ceil(d / (UP_WARPS * UP_COLS)), token groups), block = UP_WARPS warps.
//   Prologue (every CTA, redundantly: a few KB of L2 reads, after an L2 prefetch of its up
//   rows): low[t, :] = silu(sum_s inv[t, s] * P[s, t, :r] / hc) into shared memory (same
//   half/run layout), inv computed from SS once per CTA into shared memory after low [NT][r]
//   (the same expression wherever it is read, so the same bits); CTA 0 also writes inj. Main loop:
//   a warp owns UP_COLS output columns c; its lanes form 4 groups of 8, group g reads row
//   (s0 + g) * d + c of up (stream s0 + g), lane j of the group runs j, j + 8, ... of the
//   r-wide row (8 lanes read 128 contiguous bytes per step; UP_BATCH runs per batch of loads).
//   After a shuffle tree inside each group, lane j of group g holds token j's gate for stream
//   s0 + g, multiplies it by xn, and lane j of group 0 sums the streams in order s = 0, 1, ...
//   (NT <= 8 tokens per group of lanes). hc > 4 loops over stream quads.
//
// hc_downc_<T>_t<NT> + hc_upl_<T>_t<NT> (sm_90, the default there: HCCuda.cluster, below): the
//   same mix with hc_down's work split over thread block clusters, whose first CTA also does
//   hc_up's prologue sums once (low, inject, norm scales); hc_upl is hc_up reading those.
//
// hc_combine: y[t, s, c] = x[t, s, c] + inj[t, s] * out[t, c] (float4; explicitly rounded mul
//   then add, exactly as torch's two elementwise ops), one thread per float4.

#include "gguf_split.cuh"
#include "math.cuh"
#include "cluster.cuh"
#include "pdl.cuh"

// Tuning (mgserve/cuda/ops/hc.py HCTuning sets them through -D; defaults match its defaults). The
// per-token-group knobs pack one hex digit per group size: 0xABCD = A for 1 token, B for 2, C for
// 4, D for 8 (each 1..15).
#ifndef DOWN_WARPS
#define DOWN_WARPS 8  // warps per hc_down CTA
#endif
#ifndef DOWN_ROWS
#define DOWN_ROWS 0x1112  // rows per warp of hc_down
#endif
#ifndef DOWN_BATCH
#define DOWN_BATCH 0xAA55  // runs per lane loaded as one batch (loads in flight) in hc_down
#endif
#ifndef UP_WARPS
#define UP_WARPS 8  // warps per hc_up CTA
#endif
#ifndef UP_COLS
#define UP_COLS 0x2222  // output columns per warp of hc_up
#endif
#ifndef UP_BATCH
#define UP_BATCH 0x5553  // runs per lane loaded as one batch in hc_up (320-wide rows: 5 runs)
#endif
#ifndef PREFETCH
#define PREFETCH 1  // 1: prefetch the CTA's weights into L2 before its shared-memory prologue
#endif
#ifndef INV_ONCE
#define INV_ONCE 1  // 1: hc_up computes each norm scale once per CTA (0: wherever it is read)
#endif
#ifndef STAGE_HOIST
#define STAGE_HOIST 1  // 1: hc_downc / hc_upl stage their inputs from loads issued together
#endif


template <int NT>
struct Tune {
    static_assert(NT == 1 || NT == 2 || NT == 4 || NT == 8, "token groups are 1, 2, 4 or 8");
    static constexpr int SHIFT = NT == 1 ? 12 : NT == 2 ? 8 : NT == 4 ? 4 : 0;
    static constexpr int DOWN_ROWS_NT = (DOWN_ROWS >> SHIFT) & 15;
    static constexpr int DOWN_BATCH_NT = (DOWN_BATCH >> SHIFT) & 15;
    static constexpr int UP_COLS_NT = (UP_COLS >> SHIFT) & 15;
    static constexpr int UP_BATCH_NT = (UP_BATCH >> SHIFT) & 15;
    static_assert(DOWN_ROWS_NT >= 1 && DOWN_BATCH_NT >= 1 && UP_COLS_NT >= 1 && UP_BATCH_NT >= 1,
                  "every tuning digit must be 1..15");
};

// The raw bits of run `run` (8 values) of a row starting at `row`.
template <typename T>
__device__ __forceinline__ typename T::Raw fetch_run(const u8* row, size_t run) {
    constexpr int RUNS = T::BLOCK / 8;
    return T::fetch(row + run / RUNS * T::BYTES, (int)(run % RUNS));
}

// acc[i][t] += sum over this lane's runs r = start, start + STEP, ... < runs of
// (run first + r of row wrow[i]) . (token t's 8 staged values of run r), for tokens t < nt;
// xs: [NT][2][runs] float4 in the run-half layout. The runs go in order, U at a time: the loads of
// U runs of every row are issued before any is used. Past the last run a lane loads the last run
// again (CLAMP, unused: no branch) or nothing (hc_downc: a slice's runs may not fill a batch).
template <typename T, int NT, int ROWS, int U, int STEP, bool CLAMP = true>
__device__ __forceinline__ void dot_runs(const u8* const (&wrow)[ROWS], size_t first, int start,
                                         int runs, const float4* xs, int nt,
                                         float (&acc)[ROWS][NT]) {
    for (int r0 = start; r0 < runs; r0 += STEP * U) {
        typename T::Raw raw[U][ROWS];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int r = CLAMP ? min(r0 + STEP * u, runs - 1) : r0 + STEP * u;
            if (CLAMP || r < runs) {
#pragma unroll
                for (int i = 0; i < ROWS; i++) raw[u][i] = fetch_run<T>(wrow[i], first + r);
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const int r = r0 + STEP * u;
            if (r < runs) {
                float w[ROWS][8];
#pragma unroll
                for (int i = 0; i < ROWS; i++) T::decode(raw[u][i], w[i]);
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    if (t < nt) {
                        const float4 a = xs[(t * 2) * runs + r];
                        const float4 b = xs[(t * 2 + 1) * runs + r];
#pragma unroll
                        for (int i = 0; i < ROWS; i++) acc[i][t] += dot8(w[i], a, b);
                    }
                }
            }
        }
    }
}

// Row `row` of [wa (rows_a rows) | wb]: both have rows of row_bytes bytes.
__device__ __forceinline__ const u8* row_ptr(const u8* wa, int rows_a, const u8* wb,
                                             size_t row_bytes, int row) {
    return row < rows_a ? wa + (size_t)row * row_bytes : wb + (size_t)(row - rows_a) * row_bytes;
}

// Bytes [b0, b1) of rows row0 .. row0 + n - 1 of [wa | wb] into L2 (a hint: the loads that follow
// hit L2 instead of waiting on DRAM behind the CTA's prologue). The CTA's threads share the
// lines; every address lies inside [b0, b1) of a row.
__device__ __forceinline__ void prefetch_rows(const u8* wa, int rows_a, const u8* wb,
                                              size_t row_bytes, int row0, int n, size_t b0,
                                              size_t b1) {
#if PREFETCH
    const size_t lines = (b1 - b0 + 127) / 128 + 1;  // +1: the tail line of a misaligned range
    for (size_t i = threadIdx.x; i < lines * n; i += blockDim.x) {
        const size_t off = b0 + (i / n) * 128;
        const u8* p = row_ptr(wa, rows_a, wb, row_bytes, row0 + (int)(i % n));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + (off < b1 ? off : b1 - 1)));
    }
#endif
}

// v.x^2 + v.y^2 + v.z^2 + v.w^2 with its FMAs named: left to contraction, NVRTC chose
// fma(x, x, y * y) or fma(y, y, x * x) by the code around it, so the same values summed to other
// bits in kernels of other token counts or staging (this is the contraction the kernels had).
__device__ __forceinline__ float sumsq4(float4 v) {
    return __fmaf_rn(v.w, v.w, __fmaf_rn(v.z, v.z, __fmaf_rn(v.x, v.x, __fmul_rn(v.y, v.y))));
}

// Values i .. i+3 of tokens tok0 .. tok0 + G - 1 of stream s into v: x, or x + inj_prev *
// out_prev when fused; every load issued before any value is used (a token's loads inside its
// own branch wait one L2 round trip a token). A token past nt (>= 1) reads token tok0's values,
// which the caller drops. hc_downc's 8-token kernel stages STAGE_GROUP tokens at a time (8 at
// once took 174 registers where it had 128); the others, and hc_down (the unclustered path: GPUs
// before sm_90), where staging 4 took a Q6_K kernel from 128 to 195 registers, stage one, as
// all do without STAGE_HOIST.
#define STAGE_GROUP 4
template <int G>
__device__ __forceinline__ void stream4s(float4 (&v)[G], const float* __restrict__ x,
                                         const float* __restrict__ out_prev,
                                         const float* __restrict__ inj_prev, int tok0, int nt,
                                         int s, int hc, int d, int i) {
#pragma unroll
    for (int t = 0; t < G; t++)
        v[t] = *(const float4*)(x + ((size_t)(tok0 + (t < nt ? t : 0)) * hc + s) * d + i);
    if (out_prev != nullptr) {
        float a[G];
        float4 o[G];
#pragma unroll
        for (int t = 0; t < G; t++) {
            const int tok = tok0 + (t < nt ? t : 0);
            a[t] = inj_prev[(size_t)tok * hc + s];
            o[t] = *(const float4*)(out_prev + (size_t)tok * d + i);
        }
#pragma unroll
        for (int t = 0; t < G; t++) v[t] = combine4(v[t], a[t], o[t]);
    }
}

// stream4s's value of the one token tok, written out for hc_down's staging (through stream4s
// ptxas orders its instructions otherwise there)
__device__ __forceinline__ float4 stream4(const float* __restrict__ x,
                                          const float* __restrict__ out_prev,
                                          const float* __restrict__ inj_prev, int tok, int s,
                                          int hc, int d, int i) {
    float4 v = *(const float4*)(x + ((size_t)tok * hc + s) * d + i);
    if (out_prev != nullptr)
        v = combine4(v, inj_prev[(size_t)tok * hc + s], *(const float4*)(out_prev + (size_t)tok * d + i));
    return v;
}

// ---- hc_down -------------------------------------------------------------------------------------

// x [n_tok, hc, d]; gamma [hc, d]; out_prev [n_tok, d] and inj_prev [n_tok, hc] or null;
// x_new [n_tok, hc, d] (written when out_prev is given and aux); wa / wb: rows_a / rows_b rows of
// hc*d values (wb may be null with rows_b 0), row i of [wa | wb] -> P column col0 + i;
// P [hc, n_tok, p_stride]; SS [hc, n_tok] (written when aux). part: values per staged part.
template <typename T, int NT>
__device__ void hc_down(const float* __restrict__ x, const float* __restrict__ gamma,
                        const float* __restrict__ out_prev, const float* __restrict__ inj_prev,
                        float* __restrict__ x_new, const u8* __restrict__ wa, int rows_a,
                        const u8* __restrict__ wb, int rows_b, float* __restrict__ P,
                        float* __restrict__ SS, int n_tok, int hc, int d, int part, int p_stride,
                        int col0, int aux) {
    constexpr int R = Tune<NT>::DOWN_ROWS_NT, U = Tune<NT>::DOWN_BATCH_NT;
    extern __shared__ float4 xs4[];  // [NT][2][part / 8]: x * gamma of the staged part
    __shared__ float red[DOWN_WARPS][NT];  // per-warp sums of squares
    const int s = blockIdx.x % hc, rb = blockIdx.x / hc;
    const int tok0 = blockIdx.y * NT, nt = min(NT, n_tok - tok0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_rows = rows_a + rows_b;
    const size_t row_bytes = (size_t)hc * d / T::BLOCK * T::BYTES;
    const bool aux0 = aux && rb == 0;  // block-uniform: this CTA also sums squares (and x_new)
    const int cta_row0 = rb * DOWN_WARPS * R;
    const int cta_n = min(DOWN_WARPS * R, n_rows - cta_row0);

    const int row0 = cta_row0 + warp * R;  // this warp's rows: row0 .. row0 + R - 1
    const u8* wrow[R];  // past the last row: the last row again (never written)
#pragma unroll
    for (int rr = 0; rr < R; rr++)
        wrow[rr] = row_ptr(wa, rows_a, wb, row_bytes, min(row0 + rr, n_rows - 1));
    float acc[R][NT] = {}, ss[NT] = {};

    const int runs = part / 8;  // runs per part
    for (int p0 = 0; p0 < d; p0 += part) {
        const size_t first = (size_t)s * d + p0;  // first value of the part within a row
        prefetch_rows(wa, rows_a, wb, row_bytes, cta_row0, cta_n, first / T::BLOCK * T::BYTES,
                      (first + part + T::BLOCK - 1) / T::BLOCK * T::BYTES);
        if (p0 == 0) grid_sync();  // only weights were read before (pdl.cuh)
        __syncthreads();  // the previous part's reads of xs4 are done
        // Stage x * gamma. Thread i takes the stream's float4s c = i (mod blockDim), in order,
        // whatever the part size, so its share of the sums of squares does not depend on NT.
        const int q0 = (int)((threadIdx.x + blockDim.x - (p0 / 4) % blockDim.x) % blockDim.x);
#pragma unroll 2
        for (int q = q0; q < part / 4; q += blockDim.x) {  // float4 q of the part
            const float4 g = *(const float4*)(gamma + (size_t)s * d + p0 + q * 4);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
                if (t < nt) {
                    v = stream4(x, out_prev, inj_prev, tok0 + t, s, hc, d, p0 + q * 4);
                    if (aux0) {
                        if (out_prev != nullptr)
                            *(float4*)(x_new + ((size_t)(tok0 + t) * hc + s) * d + p0 + q * 4) = v;
                        ss[t] = __fadd_rn(ss[t], sumsq4(v));
                    }
                    v = make_float4(v.x * g.x, v.y * g.y, v.z * g.z, v.w * g.w);
                }
                xs4[(t * 2 + (q & 1)) * runs + (q >> 1)] = v;
            }
        }
        __syncthreads();
        if (row0 >= n_rows) continue;  // warp-uniform: an idle warp still meets the barriers
        dot_runs<T, NT, R, U, 32>(wrow, first / 8, lane, runs, xs4, nt, acc);  // lane, lane + 32..
    }

    if (aux0) {  // the stream's sums of squares: lanes, then warps in order
#pragma unroll
        for (int t = 0; t < NT; t++) {
            ss[t] = warp_sum(ss[t]);
            if (lane == 0) red[warp][t] = ss[t];
        }
        __syncthreads();
        if (threadIdx.x < nt) {
            float v = 0.f;
            for (int w = 0; w < DOWN_WARPS; w++) v += red[w][threadIdx.x];
            SS[(size_t)s * n_tok + tok0 + threadIdx.x] = v;
        }
    }

    if (row0 >= n_rows) return;
    // the warp's rows and tokens into P's layout, lane 0 writing (no split: it spills here
    // under the 64- and 128-register bounds, F16/BF16 t2 and Q5_0/Q6_K t8)
    warp_sums_put<false>(acc, lane, [&](float v, int rr, int t) {
        if (t < nt && row0 + rr < n_rows)
            P[((size_t)s * n_tok + tok0 + t) * p_stride + col0 + row0 + rr] = v;
    });
}

// ---- hc_downc: hc_down in clusters (HCCuda.cluster) ---------------------------------------------

// The down (and inject) products split over a cluster of hc * pieces CTAs: CTA (s, piece) of a
// cluster (rank s * pieces + piece) stages and multiplies only values [piece * pl, (piece + 1) * pl)
// of stream s (pl = d / pieces) for the cluster's DOWN_WARPS * R rows, so a CTA does 1 / pieces of
// a stream's work in one staged part and the grid has hc * pieces CTAs per row block. Every CTA
// also sums its slice's squares. Each CTA stores its partial products and sums of squares into
// the shared memory of the cluster's rank 0; after one cluster barrier the others are done and
// rank 0 adds them, always in rank order, and finishes the mix's low-rank side itself:
//   inv[t, s] = rsqrt(SS[t, s] / d + eps),
//   low[t, row] = silu(sum_s inv[t, s] * P[t, s, row] / hc)         (rows below r)
//   inj[t, row - r] = 2 * sigmoid(sum_s inv[t, s] * P[t, s, row] / hc)   (the inject's rows)
// so hc_upl only reads low and inv (no per-CTA sums over streams in its prologue). The pieces are
// fixed by (hc, d), never by the token count, and every sum runs in a fixed order: a token's bits
// do not depend on its batch. Rank 0 of the aux launch's row block 0 writes inv [n_tok, hc] (and
// its CTAs x_new, as hc_down's do).
//   grid = (row blocks * hc * pieces, token groups), cluster (hc * pieces, 1, 1).
template <typename T, int NT>
__device__ void hc_downc(const float* __restrict__ x, const float* __restrict__ gamma,
                         const float* __restrict__ out_prev, const float* __restrict__ inj_prev,
                         float* __restrict__ x_new, const u8* __restrict__ wa, int rows_a,
                         const u8* __restrict__ wb, int rows_b, float* __restrict__ low,
                         float* __restrict__ inj, float* __restrict__ inv_out, int n_tok, int hc,
                         int d, int pieces, int r, int col0, int aux, float eps) {
    constexpr int R = Tune<NT>::DOWN_ROWS_NT, U = Tune<NT>::DOWN_BATCH_NT;
    constexpr int ROWS = DOWN_WARPS * R;  // rows per cluster
    extern __shared__ float4 xs4[];  // [NT][2][pl / 8]: x * gamma of this CTA's slice
    __shared__ float red[DOWN_WARPS][NT];  // per-warp sums of squares
    // rank 0's: every rank's slice sums of squares and products (the others store into them)
    __shared__ float gsq[CLUSTER_MAX][NT];
    __shared__ float gpart[CLUSTER_MAX][ROWS][NT];
    const int csize = hc * pieces;  // <= CLUSTER_MAX
    const int rank = (int)cluster_rank(), rb = blockIdx.x / csize;
    const int s = rank / pieces, piece = rank - s * pieces;
    const int pl = d / pieces, runs = pl / 8;
    const int tok0 = blockIdx.y * NT, nt = min(NT, n_tok - tok0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_rows = rows_a + rows_b;
    const size_t row_bytes = (size_t)hc * d / T::BLOCK * T::BYTES;
    const int cta_row0 = rb * ROWS;
    const int cta_n = max(0, min(ROWS, n_rows - cta_row0));
    const int row0 = cta_row0 + warp * R;  // this warp's rows: row0 .. row0 + R - 1
    const size_t first = (size_t)s * d + (size_t)piece * pl;  // the slice's first value in a row
    const u8* wrow[R];  // past the last row: the last row again (never written)
#pragma unroll
    for (int rr = 0; rr < R; rr++)
        wrow[rr] = row_ptr(wa, rows_a, wb, row_bytes, min(row0 + rr, n_rows - 1));
    cluster_arrive();  // this CTA has started: the others may store into it after their wait
    if (cta_n > 0)
        prefetch_rows(wa, rows_a, wb, row_bytes, cta_row0, cta_n, first / T::BLOCK * T::BYTES,
                      (first + pl + T::BLOCK - 1) / T::BLOCK * T::BYTES);
    grid_sync();  // only weights were read before (pdl.cuh)

    // Stage x * gamma of the slice; thread i takes its float4s q = i (mod blockDim) in order,
    // so the sums of squares do not depend on NT (nor on the row block).
    const bool aux0 = aux && rb == 0;  // this CTA writes x_new's slice
    float ss[NT] = {};
    const int v0 = piece * pl;  // the slice's first value within the stream
#pragma unroll 2
    for (int q = threadIdx.x; q < pl / 4; q += blockDim.x) {
        const float4 g = *(const float4*)(gamma + (size_t)s * d + v0 + q * 4);
        // (4 tokens at once in t4: 80 -> 98 registers, untimed)
        constexpr int SG = STAGE_HOIST && NT == 8 ? STAGE_GROUP : 1;
        float4 vs[SG];
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            if (t % SG == 0 && t < nt)
                stream4s(vs, x, out_prev, inj_prev, tok0 + t, nt - t, s, hc, d, v0 + q * 4);
            if (t < nt) {
                v = vs[t % SG];
                if (aux0 && out_prev != nullptr)
                    *(float4*)(x_new + ((size_t)(tok0 + t) * hc + s) * d + v0 + q * 4) = v;
                ss[t] = __fadd_rn(ss[t], sumsq4(v));
                v = make_float4(v.x * g.x, v.y * g.y, v.z * g.z, v.w * g.w);
            }
            xs4[(t * 2 + (q & 1)) * runs + (q >> 1)] = v;
        }
    }
    // lanes, then warps in order
    warp_sums_put(ss, lane, [&](float v, int t) { red[warp][t] = v; });
    __syncthreads();
    cluster_wait();  // every CTA of the cluster has started (rank 0 too): stores may go there
    if (threadIdx.x < NT) {
        float v = 0.f;
        for (int w = 0; w < DOWN_WARPS; w++) v += red[w][threadIdx.x];
        cluster_store(&gsq[rank][threadIdx.x], 0, v);
    }

    float acc[R][NT] = {};
    if (row0 < n_rows)  // warp-uniform
        dot_runs<T, NT, R, U, 32, false>(wrow, first / 8, lane, runs, xs4, nt, acc);
    warp_sums_put(acc, lane, [&](float v, int rr, int t) {
        cluster_store(&gpart[rank][warp * R + rr][t], 0, v);
    });
    cluster_sync();  // rank 0 holds every CTA's products and sums; the others are done

    if (rank == 0) {
        for (int i = threadIdx.x; i < cta_n * nt; i += blockDim.x) {
            const int rl = i / nt, t = i - rl * nt;  // the cluster's row rl, token t
            float v = 0.f, a = 0.f, b = 0.f;
#pragma unroll
            for (int k = 0; k < CLUSTER_MAX; k++) {  // stream k / pieces's slices, in order
                if (k < csize) {
                    const int kk = k % pieces;
                    a = kk == 0 ? gsq[k][t] : a + gsq[k][t];
                    b = kk == 0 ? gpart[k][rl][t] : b + gpart[k][rl][t];
                    if (kk == pieces - 1) {
                        const float iv = rsqrtf(a / (float)d + eps);  // hc_up's expression
                        v += iv * b;
                        if (aux0 && rl == 0) inv_out[(size_t)(tok0 + t) * hc + k / pieces] = iv;
                    }
                }
            }
            const int g = col0 + cta_row0 + rl;  // the row's column of [down | inject]
            if (g < r)
                low[(size_t)(tok0 + t) * r + g] = silu(v / (float)hc);
            else
                inj[(size_t)(tok0 + t) * hc + (g - r)] = 2.0f * sigmoid(v / (float)hc);
        }
    }
}

// ---- hc_up ---------------------------------------------------------------------------------------

// The floats of hc_up's staged outputs for xq: NT x the CTA's columns where they round to int8
// groups (a multiple of 32), else 1 (unused).
__host__ __device__ constexpr int xq_cols(int nt, int cta_cols) {
    return cta_cols % 32 == 0 ? nt * cta_cols : 1;
}

// up: [hc*d rows, r]; P [hc, n_tok, p_stride] (columns 0..r-1 down, r..r+hc-1 inject);
// SS [hc, n_tok]; x [n_tok, hc, d] (the new x when fused); gamma [hc, d]; mixed [n_tok, d];
// inj [n_tok, hc] or null.
// LOW (hc_upl, after hc_downc): P is low [n_tok, r] and SS is inv [n_tok, hc], both final
// (p_stride unused), and inj was written by hc_downc: the prologue only copies them.
// xq [n_tok, d] int8 and xd [n_tok, d / 32] (hc_uplq; null: none): mixed rounded to int8 as
// quantize_q8 would, from the CTA's own columns (UP_WARPS * C of them, a multiple of 32 inside d:
// HCCuda checks).
template <typename T, int NT, bool LOW>
__device__ void hc_up(const u8* __restrict__ up, const float* __restrict__ P,
                      const float* __restrict__ SS, const float* __restrict__ x,
                      const float* __restrict__ gamma, float* __restrict__ mixed,
                      float* __restrict__ inj, i8* __restrict__ xq, float* __restrict__ xd,
                      int n_tok, int hc, int d, int r, int p_stride, float eps) {
    constexpr int C = Tune<NT>::UP_COLS_NT, U = Tune<NT>::UP_BATCH_NT;
    extern __shared__ float4 smem4[];
    const float4* low4 = smem4;  // [NT][2][r / 8]: low in the run-half layout
    float* lowf = (float*)smem4;
    float* inv_s = lowf + NT * r;  // [NT][hc]: the norm scales, each computed once per CTA
    const int tok0 = blockIdx.y * NT, nt = min(NT, n_tok - tok0);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 3, j = lane & 7;  // lane group (stream within a quad), lane in group
    const int runs = r / 8;
    const size_t row_bytes = (size_t)(r / T::BLOCK) * T::BYTES;
    const int c0 = (blockIdx.x * UP_WARPS + warp) * C;  // this warp's columns c0 .. c0 + C - 1

#if PREFETCH
    {  // this CTA's rows of up: for each stream, UP_WARPS * C consecutive rows
        const int cta_c0 = blockIdx.x * UP_WARPS * C;
        const int n_c = min(UP_WARPS * C, d - cta_c0);
        const size_t span = (size_t)n_c * row_bytes, lines = (span + 127) / 128;
        for (size_t i = threadIdx.x; i < lines * hc; i += blockDim.x) {
            const size_t s = i / lines, off = (i % lines) * 128;  // off < span
            asm volatile("prefetch.global.L2 [%0];" ::"l"(up + (s * d + cta_c0) * row_bytes + off));
        }
    }
#endif
    grid_sync();  // only weights were read before (pdl.cuh)

    // inv(t, s): token t's norm scale for stream s, computed once per CTA (a division and an
    // rsqrt per value of the prologue and per column before: most of the CTA's instructions at
    // 8 tokens), the same expression, so the same bits
    const auto inv_of = [&](int t, int s) {
        return rsqrtf(SS[(size_t)s * n_tok + tok0 + t] / (float)d + eps);
    };
#if INV_ONCE
    constexpr bool ONCE = true;
#else  // recomputed wherever it is read (before 2026-12-06; bench and tests compare the two)
    constexpr bool ONCE = LOW;
#endif
    if (ONCE) {
        for (int i = threadIdx.x; i < nt * hc; i += blockDim.x)
            inv_s[i] = LOW ? SS[(size_t)tok0 * hc + i] : inv_of(i / hc, i % hc);
        __syncthreads();
    }
    const auto inv = [&](int t, int s) { return ONCE ? inv_s[t * hc + s] : inv_of(t, s); };
    // the staged value i: low [t][k] (t = i / r, k = i % r) in the run-half layout
    const auto low_at = [&](int i) {
        const int t = i / r, k = i - t * r;
        return lowf + ((t * 2 + ((k >> 2) & 1)) * runs + (k >> 3)) * 4 + (k & 3);
    };
#if STAGE_HOIST
    if (LOW) {  // a copy of low's rows: 8 strides' loads issued before any store (in a loop of
        // one load and one store a stride, each load waited its L2 round trip: 10 of them at
        // qwen4exp's 8 tokens of 320 columns against 2 at one)
        constexpr int UC = 8;
        for (int i0 = threadIdx.x; i0 < NT * r; i0 += UC * blockDim.x) {
            float v[UC];
#pragma unroll
            for (int u = 0; u < UC; u++) {
                const int i = i0 + u * blockDim.x, t = i / r;
                v[u] = i < NT * r && t < nt ? P[(size_t)tok0 * r + i] : 0.f;
            }
#pragma unroll
            for (int u = 0; u < UC; u++)
                if (i0 + u * blockDim.x < NT * r) *low_at(i0 + u * blockDim.x) = v[u];
        }
    }
#endif
    for (int i = threadIdx.x; i < NT * r && !(STAGE_HOIST && LOW); i += blockDim.x) {
        const int t = i / r, k = i - t * r;
        float v = 0.f;
        if (t < nt && LOW) {
            v = P[(size_t)(tok0 + t) * r + k];
        } else if (t < nt) {
            const float* p = P + (size_t)(tok0 + t) * p_stride + k;
            for (int s = 0; s < hc; s++) v += inv(t, s) * p[(size_t)s * n_tok * p_stride];
            v = silu(v / (float)hc);
        }
        *low_at(i) = v;
    }
    if (!LOW && inj != nullptr && blockIdx.x == 0) {
        for (int i = threadIdx.x; i < nt * hc; i += blockDim.x) {
            const int t = i / hc, q = i - t * hc;
            const float* p = P + (size_t)(tok0 + t) * p_stride + r + q;
            float v = 0.f;
            for (int s = 0; s < hc; s++) v += inv(t, s) * p[(size_t)s * n_tok * p_stride];
            inj[(size_t)(tok0 + t) * hc + q] = 2.0f * sigmoid(v / (float)hc);
        }
    }
    __syncthreads();
    if (c0 >= d) return;  // warp-uniform; the xq barrier below: no warp returns (d tiled)

    float total[C] = {};
    for (int s0 = 0; s0 < hc; s0 += 4) {
        const int s = s0 + g;
        const bool live = s < hc;  // group g's stream exists (hc not a multiple of 4)
        const int sr = live ? s : hc - 1;
        const u8* wrow[C];
        float xn[C];  // xn[token j, stream s, column c0 + cc], read before the weights arrive
#pragma unroll
        for (int cc = 0; cc < C; cc++) {
            const int c = min(c0 + cc, d - 1);
            wrow[cc] = up + ((size_t)sr * d + c) * row_bytes;
            xn[cc] = 0.f;
            if (live && j < nt)
                xn[cc] = x[((size_t)(tok0 + j) * hc + s) * d + c] * inv(j, s) *
                         gamma[(size_t)s * d + c];
        }
        float acc[C][NT] = {};
        dot_runs<T, NT, C, U, 8>(wrow, 0, j, runs, low4, nt, acc);  // lane j: runs j, j + 8, ...
#pragma unroll
        for (int cc = 0; cc < C; cc++) {
#pragma unroll
            for (int t = 0; t < NT; t++)
#pragma unroll
                for (int o = 4; o > 0; o >>= 1)  // within the group of 8 lanes
                    acc[cc][t] += __shfl_xor_sync(0xffffffffu, acc[cc][t], o);
            float gate = 0.f;  // token j's: acc[cc][j] without dynamic register indexing
#pragma unroll
            for (int t = 0; t < NT; t++)
                if (t == j) gate = acc[cc][t];
            const float val = live && j < nt ? sigmoid(gate) * xn[cc] : 0.f;
            // token j's streams s0 .. s0 + 3, added in stream order
#pragma unroll
            for (int q = 0; q < 4; q++) total[cc] += __shfl_sync(0xffffffffu, val, q * 8 + j);
        }
    }
    constexpr int CTA_COLS = UP_WARPS * C;
    if (CTA_COLS % 32 != 0) {  // no int8 form: CTAs that do not hold whole groups of 32
        if (lane < nt) {
#pragma unroll
            for (int cc = 0; cc < C; cc++)
                if (c0 + cc < d) mixed[(size_t)(tok0 + lane) * d + c0 + cc] = total[cc] / (float)hc;
        }
        return;
    }
    __shared__ float s_mixed[xq_cols(NT, CTA_COLS)];  // [NT][CTA_COLS]: the CTA's outputs
    if (lane < nt) {
#pragma unroll
        for (int cc = 0; cc < C; cc++) {
            const float v = total[cc] / (float)hc;
            if (c0 + cc < d) mixed[(size_t)(tok0 + lane) * d + c0 + cc] = v;
            s_mixed[lane * CTA_COLS + warp * C + cc] = v;
        }
    }
    if (xq == nullptr) return;
    __syncthreads();  // every warp is here: d is a multiple of the CTA's columns (no early return)
    // warp w rounds (token, group of 32 columns) pairs w, w + UP_WARPS, ..: lanes 0..7 4 values
    for (int pr = warp; pr < nt * (CTA_COLS / 32); pr += UP_WARPS) {  // warp-uniform
        const int t = pr / (CTA_COLS / 32), i = (pr % (CTA_COLS / 32)) * 32 + 4 * (lane & 7);
        const float* v = s_mixed + t * CTA_COLS + i;
        const float4 v4 = lane < 8 ? make_float4(v[0], v[1], v[2], v[3]) : make_float4(0, 0, 0, 0);
        q8_store4(v4, lane < 8, xq, xd, (long long)(tok0 + t) * d + blockIdx.x * CTA_COLS + i);
    }
}

// ---- entries -------------------------------------------------------------------------------------

#define HC_ENTRIES(TYPE, NT)                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * DOWN_WARPS) hc_down_##TYPE##_t##NT(          \
        const float* __restrict__ x, const float* __restrict__ gamma,                             \
        const float* __restrict__ out_prev, const float* __restrict__ inj_prev,                   \
        float* __restrict__ x_new, const u8* __restrict__ wa, int rows_a,                         \
        const u8* __restrict__ wb, int rows_b, float* __restrict__ P, float* __restrict__ SS,     \
        int n_tok, int hc, int d, int part, int p_stride, int col0, int aux) {                    \
        hc_down<SplitFormat<TYPE>::T, NT>(x, gamma, out_prev, inj_prev, x_new, wa, rows_a, wb, rows_b, P, SS,    \
                          n_tok, hc, d, part, p_stride, col0, aux);                               \
    }                                                                                             \
    extern "C" __global__ void __launch_bounds__(32 * UP_WARPS) hc_up_##TYPE##_t##NT(              \
        const u8* __restrict__ up, const float* __restrict__ P, const float* __restrict__ SS,     \
        const float* __restrict__ x, const float* __restrict__ gamma, float* __restrict__ mixed,  \
        float* __restrict__ inj, int n_tok, int hc, int d, int r, int p_stride, float eps) {      \
        hc_up<SplitFormat<TYPE>::T, NT, false>(up, P, SS, x, gamma, mixed, inj, nullptr, nullptr,  \
                                               n_tok, hc, d, r, p_stride, eps);                   \
    }

#define HC_CLUSTER_ENTRIES(TYPE, NT)                                                              \
    extern "C" __global__ void __launch_bounds__(32 * DOWN_WARPS) hc_downc_##TYPE##_t##NT(         \
        const float* __restrict__ x, const float* __restrict__ gamma,                             \
        const float* __restrict__ out_prev, const float* __restrict__ inj_prev,                   \
        float* __restrict__ x_new, const u8* __restrict__ wa, int rows_a,                         \
        const u8* __restrict__ wb, int rows_b, float* __restrict__ low, float* __restrict__ inj,  \
        float* __restrict__ inv, int n_tok, int hc, int d, int pieces, int r, int col0, int aux,  \
        float eps) {                                                                              \
        hc_downc<SplitFormat<TYPE>::T, NT>(x, gamma, out_prev, inj_prev, x_new, wa, rows_a, wb,   \
                                           rows_b, low, inj, inv, n_tok, hc, d, pieces, r, col0,  \
                                           aux, eps);                                             \
    }                                                                                             \
    HC_UP_ENTRY(TYPE, NT)

// hc_upl, or with -D HC_XQ=1 (HCTuning.xq) hc_uplq, which also writes mixed's int8 form
#ifndef HC_XQ
#define HC_XQ 0
#endif
#if !HC_XQ
#define HC_UP_ENTRY(TYPE, NT)                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * UP_WARPS) hc_upl_##TYPE##_t##NT(             \
        const u8* __restrict__ up, const float* __restrict__ low, const float* __restrict__ inv,  \
        const float* __restrict__ x, const float* __restrict__ gamma, float* __restrict__ mixed,  \
        int n_tok, int hc, int d, int r, float eps) {                                             \
        hc_up<SplitFormat<TYPE>::T, NT, true>(up, low, inv, x, gamma, mixed, nullptr, nullptr,    \
                                              nullptr, n_tok, hc, d, r, r, eps);                  \
    }
#else
#define HC_UP_ENTRY(TYPE, NT)                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * UP_WARPS) hc_uplq_##TYPE##_t##NT(            \
        const u8* __restrict__ up, const float* __restrict__ low, const float* __restrict__ inv,  \
        const float* __restrict__ x, const float* __restrict__ gamma, float* __restrict__ mixed,  \
        i8* __restrict__ xq, float* __restrict__ xd, int n_tok, int hc, int d, int r, float eps) { \
        hc_up<SplitFormat<TYPE>::T, NT, true>(up, low, inv, x, gamma, mixed, nullptr, xq, xd,     \
                                              n_tok, hc, d, r, r, eps);                           \
    }
#endif

// One weight format per module (-D HC_TYPE=...), so a model that only uses BF16 compiles only that,
// and one path: hc_down + hc_up (and the combine kernels below), or with -D HC_CLUSTERED=1 (the
// clustered mix's module: HCTuning.defines(..., clustered=True)) hc_downc + hc_upl.
#ifndef HC_TYPE
#define HC_TYPE BF16
#endif
#ifndef HC_CLUSTERED
#define HC_CLUSTERED 0
#endif
#if HC_CLUSTERED
#define HC_PATH_ENTRIES HC_CLUSTER_ENTRIES
#else
#define HC_PATH_ENTRIES HC_ENTRIES
#endif
#define HC_TYPE_ENTRIES(TYPE) /* a level of its own: HC_TYPE expands before ## pastes it */ \
    HC_PATH_ENTRIES(TYPE, 1)                                                                      \
    HC_PATH_ENTRIES(TYPE, 2)                                                                      \
    HC_PATH_ENTRIES(TYPE, 4)                                                                      \
    HC_PATH_ENTRIES(TYPE, 8)
HC_TYPE_ENTRIES(HC_TYPE)

#if !HC_CLUSTERED

// x, y [n_tok, hc, d] (as float4: d4 = d / 4 per stream); out [n_tok, d]; inj [n_tok, hc].
extern "C" __global__ void hc_combine(const float4* __restrict__ x, const float4* __restrict__ out,
                                      const float* __restrict__ inj, float4* __restrict__ y,
                                      int hc, int d4, long long n4) {
    grid_sync();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const long long tok = i / ((long long)hc * d4);
    const int rem = (int)(i - tok * hc * d4), s = rem / d4, c = rem - s * d4;
    y[i] = combine4(x[i], inj[tok * hc + s], out[tok * d4 + c]);
}

// The prompt mix's gate and stream mean (ops/hc_cuda.py; hyper_connections.mix_with's arithmetic):
//   mixed[t, c] = (sigmoid(u[t, 0, c]) * xn[t, 0, c] + ... + sigmoid(u[t, hc-1, c]) * xn[t, hc-1, c])
//                 / hc, streams added in order from 0, each product and sum rounded once,
// the same bits as the torch ops it replaces (sigmoid, *, the in-order sum, then / hc as ATen
// divides by a scalar: a product with the float reciprocal). u, xn [n_tok, hc, d] and mixed
// [n_tok, d] as float4 (d4 = d / 4); n4 = n_tok * d4. mixed16 (or null): mixed rounded to f16
// as well, the prompt GEMMs' copy (cuda/ops/f16_rows.py).
extern "C" __global__ void hc_gate_mix(const float4* __restrict__ u, const float4* __restrict__ xn,
                                       float4* __restrict__ mixed, int hc, int d4, long long n4,
                                       u16* __restrict__ mixed16) {
    grid_sync();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n4) return;
    const long long tok = i / d4;
    const int c = (int)(i - tok * d4);
    float4 acc;  // the first stream's product, then each next one's added (sum_in_order's -0s)
    for (int s = 0; s < hc; ++s) {
        const long long k = (tok * hc + s) * d4 + c;
        const float4 g = u[k], x = xn[k];
        const float4 p = make_float4(__fmul_rn(sigmoid(g.x), x.x), __fmul_rn(sigmoid(g.y), x.y),
                                     __fmul_rn(sigmoid(g.z), x.z), __fmul_rn(sigmoid(g.w), x.w));
        if (s == 0) {
            acc = p;
        } else {
            acc = make_float4(__fadd_rn(acc.x, p.x), __fadd_rn(acc.y, p.y), __fadd_rn(acc.z, p.z),
                              __fadd_rn(acc.w, p.w));
        }
    }
    const float r = __fdiv_rn(1.f, (float)hc);
    const float4 m = make_float4(__fmul_rn(acc.x, r), __fmul_rn(acc.y, r), __fmul_rn(acc.z, r),
                                 __fmul_rn(acc.w, r));
    mixed[i] = m;
    if (mixed16) store_f16x4(mixed16 + 4 * i, m);
}
#endif  // !HC_CLUSTERED
