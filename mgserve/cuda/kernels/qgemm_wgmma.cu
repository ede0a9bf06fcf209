// qgemm.cu's prompt GEMMs on Hopper's warpgroup MMA (wgmma; sm_90a, ops/qgemm.py):
//
//   qgemm_wg           Y[M, n_out] (f32) = X[M, k] @ W^T, W [n_out, k] in GGUF blocks
//   qgemm_gate_up_wg   MoE: h[q, :] (f16) = silu(gate_e X[tok(q)]) * (up_e X[tok(q)])
//   qgemm_down_wg      MoE: y[q, :] (f32) = down_e h[q, :]
//
// The same arguments, grids, W decode (gguf_split.cuh's runs, rounded to f16 by w_f16) and
// grouped tiles as qgemm.cu's kernels; only the products differ. A CTA of QW_BM / 64 warpgroups
// owns a BM x BN tile (warpgroup w its rows 64 w..64 w + 63) and walks k in steps of 64 through
// two shared buffers in wgmma.cuh's 128-byte swizzle: step s's four k16 wgmmas run on the tensor
// cores while the CTA's threads copy X (cp.async) and fetch, decode and store W of step s + 1
// into the other buffer; then every warpgroup waits for its products, one barrier a step.
// Where qgemm.cu's warps spent issue slots on ldmatrix and mma.sync beside the decode, here the
// decode has the SMs' issue slots to itself. (Fetching W's raw bits a step earlier still, so
// that the decode never waits on its loads, was no faster on the H100: grouped MoE products
// 0.886 ms against 0.878-0.890, 2026-12-06; with one CTA an SM, 1.142.) QW_STAGES 3 (off by
// default) adds a third buffer: X is copied and W fetched two steps ahead, W decoded one step
// ahead, so no load is waited for in the step that issues it; its raw W registers stay live
// across the barrier (at 128 x 128 on two CTAs an SM Q4_K's MoE kernels spill 4-8 bytes,
// F32's 16-32).
//
// Bits: each output is the f32 chain acc = A B + acc over k16 = 0, 16, ... ascending from 0,
// steps past k adding products of zeros, as in qgemm.cu and hgemm_wgmma.cu. The tile never
// depends on the other rows (no split-K; grouped tiles never mix experts), so results are
// batch-invariant; tests/cuda/test_qgemm_wgmma.py holds them bitwise to hgemm_wgmma.cu's on
// the dequantized W (and to qgemm.cu's where wgmma adds as mma.sync does).

#include "gguf_split.cuh"
#include "math.cuh"
#include "mma.cuh"
#include "pdl.cuh"
#include "qgemm_common.cuh"
#include "qgemm_rows.cuh"
#include "wgmma.cuh"

#ifndef QG_TYPE
#define QG_TYPE Q4_K
#endif
#ifndef QW_BM
#define QW_BM 128  // output rows (tokens) per CTA: 64 per warpgroup, up to 4 warpgroups
#endif
#ifndef QW_BN
#define QW_BN 128  // output columns (W rows) per CTA: 128 or 256 (one wgmma's N)
#endif
#ifndef QW_MIN_CTAS
#define QW_MIN_CTAS 1  // __launch_bounds__ minimum CTAs per SM (caps registers)
#endif
#ifndef QW_STAGES
#define QW_STAGES 2  // shared buffers: 2 (X and W of the next step), or 3 (X two steps ahead)
#endif
#ifndef QW_ROWS
#define QW_ROWS 0  // 1: W read by half row-steps, not 8-value runs (qgemm_rows.cuh)
#endif

namespace {
typedef SplitFormat<QG_TYPE>::T WT;
constexpr int BM = QW_BM, BN = QW_BN, BK = 64, THREADS = 2 * BM;
// a step's 16-byte runs of W (BN rows of 8) spread over the threads: W_RUNS a thread, the last
// run of some threads idle where BN * 8 is not a multiple of THREADS (BM 192)
constexpr int W_LOADS = BN * 8, W_RUNS = (W_LOADS + THREADS - 1) / THREADS;
constexpr bool W_EVEN = W_RUNS * THREADS == W_LOADS;
constexpr int X_COPIES = BM * 8 / THREADS;  // a thread's 16-byte copies of X a step
constexpr int X_BYTES = BM * 128, STAGE_BYTES = (BM + BN) * 128;
constexpr int ACC = BN / 2;  // accumulators a thread: 64 x BN per warpgroup
static_assert(BM % 64 == 0 && BM <= 256, "QW_BM: 64, 128, 192 or 256 (64 rows a warpgroup)");
static_assert(BN == 128 || BN == 256, "QW_BN: 128 or 256");
static_assert(X_COPIES * THREADS == BM * 8, "even copies of X");
static_assert(QW_STAGES == 2 || QW_STAGES == 3, "QW_STAGES: 2 or 3");
static_assert(WT::BLOCK % BK == 0 || BK % WT::BLOCK == 0, "load_w: blocks and steps nest");
// half row-steps: two a tile row, R_ITEMS a thread (otherwise the runs' reader)
constexpr bool ROWS = QW_ROWS && RowSteps<WT>::ON && (2 * BN) % THREADS == 0;
constexpr int R_ITEMS = ROWS ? 2 * BN / THREADS : 1;
}  // namespace

#if QW_BN == 256
#define wgmma_tile wgmma_n256
#else
#define wgmma_tile wgmma_n128
#endif

template <bool GATED>
__device__ __forceinline__ void qgemm_wg_tile(const TileArgs& a) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const unsigned raw = smem_u32(smem_raw), base = (raw + 1023u) & ~1023u;
    unsigned char* const sm = smem_raw + (base - raw);  // the two buffers, 1024-byte aligned
    const int tid = threadIdx.x, wg = tid >> 7;
    const size_t row_bytes = (size_t)(a.k / WT::BLOCK) * WT::BYTES;

    // A thread copies and fetches 16-byte run c = tid & 7 (k 8 c..8 c + 7 of a step) of rows
    // tid / 8 + i THREADS / 8, whose shared offsets are the first's + i ROWS_APART (the swizzle
    // repeats every 8 rows). A step's k0 is a multiple of BK and BLOCK divides BK or BK divides
    // BLOCK, so run c's block of W and 8-value run within it are the step's (k0 / BLOCK,
    // k0 % BLOCK / 8) plus the run's own.
    constexpr unsigned ROWS_APART = THREADS / 8 * 128;
    static_assert(ROWS_APART % 1024 == 0, "the swizzle repeats every 8 rows");
    const int kc = (tid & 7) * 8;
    const unsigned xo = swz128(tid >> 3, tid & 7), wo = X_BYTES + xo;  // X's, W's first run
    const unsigned wj = (unsigned)kc % WT::BLOCK / 8;
    const u8* wsrc[W_RUNS];  // this thread's W rows (null: past n_rows) at run c's block
#pragma unroll
    for (int i = 0; i < W_RUNS; i++) {
        const int r = (tid + i * THREADS) >> 3;
        const int src = GATED ? a.n0 / 2 + r / 2 : a.n0 + r;
        const u8* rows = (GATED && (r & 1)) ? a.wb : a.wa;
        wsrc[i] = src < a.n_rows ? rows + (size_t)src * row_bytes + kc / WT::BLOCK * WT::BYTES
                                 : nullptr;
    }
    // whether run i is one of the tile's (always, but for the last of some threads at BM 192)
    auto w_mine = [&](int i) { return W_EVEN || tid + i * THREADS < W_LOADS; };
    const u16* xsrc[X_COPIES];  // this thread's X rows (null: past m_valid) at run c
#pragma unroll
    for (int i = 0; i < X_COPIES; i++) {
        const int r = (tid + i * THREADS) >> 3, m = a.m0 + r;
        xsrc[i] = r < a.m_valid ? a.x + (size_t)(a.x_rows ? a.x_rows[m] : m) * a.k + kc : nullptr;
    }

    // ROWS: this thread's item i, t = tid + i THREADS, is half h = t & 1 (THREADS is even:
    // tid & 1) of the step's tile row r = t >> 1 (qgemm_rows.cuh)
    typedef RowSteps<WT> RS;
    const u8* rsrc[R_ITEMS];  // item i's W row (null: past n_rows)
    typename RS::Raw rraw[R_ITEMS];  // the next step's, as fetched
    if constexpr (ROWS) {
#pragma unroll
        for (int i = 0; i < R_ITEMS; i++) {
            const int r = (tid + i * THREADS) >> 1;
            const int src = GATED ? a.n0 / 2 + r / 2 : a.n0 + r;
            const u8* rows = (GATED && (r & 1)) ? a.wb : a.wa;
            rsrc[i] = src < a.n_rows ? rows + (size_t)src * row_bytes : nullptr;
        }
    }
    auto load_rows = [&](int k0) {
#pragma unroll
        for (int i = 0; i < R_ITEMS; i++)
            rraw[i] = RS::load(rsrc[i], k0, a.k, tid & 1, rsrc[i] != nullptr);
    };
    auto store_rows = [&](int buf) {
#pragma unroll
        for (int i = 0; i < R_ITEMS; i++)
            RS::store(sm + buf * STAGE_BYTES + X_BYTES, (tid + i * THREADS) >> 1, tid & 1,
                      rraw[i]);
    };

    typename WT::Raw wraw[W_RUNS];  // the next step's W runs as fetched (raw bits)
    bool wvalid[W_RUNS];
    auto load_w = [&](int k0) {
        if constexpr (ROWS) {
            load_rows(k0);
            return;
        }
        const size_t step = (size_t)((unsigned)k0 / WT::BLOCK) * WT::BYTES;
        const int j = (int)((unsigned)k0 % WT::BLOCK / 8 + wj);
        const bool in_k = k0 + kc < a.k;
#pragma unroll
        for (int i = 0; i < W_RUNS; i++) {
            wvalid[i] = w_mine(i) && wsrc[i] != nullptr && in_k;
            wraw[i] = wvalid[i] ? WT::fetch(wsrc[i] + step, j) : typename WT::Raw{};
        }
    };
    auto store_w = [&](int buf) {
        if constexpr (ROWS) {
            store_rows(buf);
            return;
        }
#pragma unroll
        for (int i = 0; i < W_RUNS; i++)
            if (w_mine(i))
                *(uint4*)(sm + buf * STAGE_BYTES + wo + i * ROWS_APART) =
                    wvalid[i] ? w_f16<WT>(wraw[i]) : make_uint4(0, 0, 0, 0);
    };
    auto load_x = [&](int k0, int buf) {
        const bool in_k = k0 + kc < a.k;
#pragma unroll
        for (int i = 0; i < X_COPIES; i++) {
            const bool valid = xsrc[i] != nullptr && in_k;
            cp16(base + buf * STAGE_BYTES + xo + i * ROWS_APART, valid ? xsrc[i] + k0 : a.x, valid);
        }
    };

    float acc[ACC];
#pragma unroll
    for (int i = 0; i < ACC; i++) acc[i] = 0.f;
    wgmma_hold(acc);

    const int n_steps = (a.k + BK - 1) / BK;
#if QW_STAGES == 2
    load_x(0, 0);
    cp_commit();
    load_w(0);
    store_w(0);
    cp_wait<0>();
    fence_proxy_async();  // the stores and copies, visible to wgmma's reads
    __syncthreads();
    for (int s = 0; s < n_steps; s++) {
        const int buf = s & 1;
        const bool more = s + 1 < n_steps;
        const unsigned xs = base + buf * STAGE_BYTES;
        const u64 da = wgmma_desc(xs + wg * 64 * 128), db = wgmma_desc(xs + X_BYTES);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) wgmma_tile(acc, da + 2 * kk, db + 2 * kk);
        wgmma_commit();
        if (more) {  // the next step's operands while the tensor cores run this one's
            load_x((s + 1) * BK, buf ^ 1);
            cp_commit();
            load_w((s + 1) * BK);
            store_w(buf ^ 1);
            cp_wait<0>();
            fence_proxy_async();
        }
        wgmma_wait<0>();  // this warpgroup's products of buf are done ...
        __syncthreads();  // ... everyone's: buf may be refilled, buf ^ 1 is complete
    }
#else
    // three buffers: step s's products run while W of step s + 1 (fetched a step earlier) is
    // decoded into buffer s + 1, and X of step s + 2 is copied and W of step s + 2 fetched, so
    // neither load's latency is waited for in the step that issues it
    load_x(0, 0);
    cp_commit();
    if (n_steps > 1) load_x(BK, 1);
    cp_commit();  // (an empty group where there is no step 1)
    load_w(0);
    store_w(0);
    if (n_steps > 1) load_w(BK);
    cp_wait<1>();  // X of step 0
    fence_proxy_async();
    __syncthreads();
    for (int s = 0; s < n_steps; s++) {
        const int buf = s % 3, next = buf == 2 ? 0 : buf + 1, after = next == 2 ? 0 : next + 1;
        const unsigned xs = base + buf * STAGE_BYTES;
        const u64 da = wgmma_desc(xs + wg * 64 * 128), db = wgmma_desc(xs + X_BYTES);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) wgmma_tile(acc, da + 2 * kk, db + 2 * kk);
        wgmma_commit();
        if (s + 1 < n_steps) store_w(next);  // buffer next was last read by step s - 2's
        if (s + 2 < n_steps) {               // buffer after by step s - 1's: both done
            load_x((s + 2) * BK, after);
            load_w((s + 2) * BK);
        }
        cp_commit();
        cp_wait<1>();  // X of step s + 1 (committed a step ago) has landed
        fence_proxy_async();
        wgmma_wait<0>();
        __syncthreads();
    }
#endif
    wgmma_hold(acc);

    // accumulator 4 j + c: row 16 v + g (+8 for c = 2, 3), columns 8 j + 2 q, +1 (wgmma.cuh)
    const int lane = tid & 31, v = (tid >> 5) & 3, g = lane >> 2, tq = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int r = wg * 64 + 16 * v + g + half * 8;
        if (r >= a.m_valid) continue;
        const size_t m = (size_t)(a.m0 + r);
#pragma unroll
        for (int j = 0; j < BN / 8; j++)
            tile_store<GATED>(a, m, a.n0 + j * 8 + 2 * tq, acc[4 * j + 2 * half],
                              acc[4 * j + 2 * half + 1]);
    }
}

// ---- entries (qgemm.cu's arguments and grids; dynamic shared memory QW_STAGES * STAGE_BYTES +
// 1024) --

extern "C" __global__ void __launch_bounds__(THREADS, QW_MIN_CTAS)
    qgemm_wg(const u8* __restrict__ w, const u16* __restrict__ x, float* __restrict__ y, int m,
             int n_out, int k) {
    grid_sync();
    const int m0 = blockIdx.y * BM;
    qgemm_wg_tile<false>({w, w, n_out, (int)blockIdx.x * BN, x, nullptr, m0, min(BM, m - m0), k,
                          y, nullptr, n_out});
}

extern "C" __global__ void __launch_bounds__(THREADS, QW_MIN_CTAS)
    qgemm_gate_up_wg(const u8* __restrict__ gate, const u8* __restrict__ up,
                     long long expert_rows, const u16* __restrict__ x,
                     const int* __restrict__ row_token, const int* __restrict__ row_start,
                     const int* __restrict__ tile_start, u16* __restrict__ h, int ff, int k,
                     int n_expert) {
    grid_sync();
    int e, m0, m_valid;
    if (!grouped_tile<BM>(row_start, tile_start, n_expert, blockIdx.y, &e, &m0, &m_valid)) return;
    const size_t off = (size_t)e * expert_rows * ((size_t)(k / WT::BLOCK) * WT::BYTES);
    qgemm_wg_tile<true>({gate + off, up + off, ff, (int)blockIdx.x * BN, x, row_token, m0,
                         m_valid, k, nullptr, h, ff});
}

extern "C" __global__ void __launch_bounds__(THREADS, QW_MIN_CTAS)
    qgemm_down_wg(const u8* __restrict__ down, long long expert_rows, const u16* __restrict__ h,
                  const int* __restrict__ row_start, const int* __restrict__ tile_start,
                  float* __restrict__ y, int d, int k, int n_expert) {
    grid_sync();
    int e, m0, m_valid;
    if (!grouped_tile<BM>(row_start, tile_start, n_expert, blockIdx.y, &e, &m0, &m_valid)) return;
    const u8* w = down + (size_t)e * expert_rows * ((size_t)(k / WT::BLOCK) * WT::BYTES);
    qgemm_wg_tile<false>({w, w, d, (int)blockIdx.x * BN, h, nullptr, m0, m_valid, k, y, nullptr,
                          d});
}
