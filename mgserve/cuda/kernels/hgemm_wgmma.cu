// The prompt GEMM of hgemm.cu on Hopper's warpgroup MMA (wgmma; sm_90a, ops/hgemm.py):
//
//   hgemm_wg   Y[M, n] (f32, row stride ldy) = X[M, k] @ W^T, X and W f16 (W [n, k], row-major)
//
// hgemm.cu's mma.sync m16n8k16 reaches about a third of the H100's f16 tensor rate; wgmma reads
// both operands from shared memory and multiplies a 64 x N x 16 block per instruction, without
// the ldmatrix traffic through registers.
//
// A CTA of HW_BM / 64 warpgroups owns a BM x BN tile of Y (warpgroup w its rows 64 w..64 w + 63,
// all BN columns) and walks k in steps of 64 (one 128-byte swizzled row of f16 a tile row,
// wgmma.cuh) through a ring of HW_STAGES shared buffers that every thread fills with cp.async
// (16 bytes a copy, zero-filled past m, n and k): the copies of step s + STAGES - 2 are issued
// after the barrier of step s, then the four k16 wgmmas of step s, leaving one step's group in
// flight (wgmma_wait<1>). A buffer is refilled two steps after its products were issued, once
// every warpgroup has waited for them (the barrier in between).
//
// Bits: Y[m, n] is the f32 chain acc = A B + acc over k16 = 0, 16, ... ascending from acc = 0
// (the steps past k, up to the next multiple of 64, add products of zeros, as hgemm.cu's do past
// its k steps), the chain hgemm.cu and qgemm.cu run with mma.sync. Whether one wgmma's 64 x N x
// 16 product adds like mma.sync's m16n8k16 is the hardware's: on the H100 it does, bitwise
// (tests/cuda/test_hgemm_wgmma.py), so ops/hgemm.py takes this kernel on sm_90 by default.

#include "math.cuh"
#include "mma.cuh"
#include "pdl.cuh"
#include "wgmma.cuh"

#ifndef HW_BM
#define HW_BM 128  // output rows (tokens) per CTA: 64 per warpgroup
#endif
#ifndef HW_BN
#define HW_BN 256  // output columns (W rows) per CTA: 128 or 256 (one wgmma's N)
#endif
#ifndef HW_STAGES
#define HW_STAGES 4  // shared buffers in the ring (two steps of copies in flight)
#endif
#ifndef HW_GROUP_M
#define HW_GROUP_M 8  // tile rows per group of the CTA order (as hgemm.cu's)
#endif

namespace {
constexpr int BM = HW_BM, BN = HW_BN, BK = 64, STAGES = HW_STAGES;
constexpr int WGS = BM / 64, THREADS = 128 * WGS;
constexpr int X_COPIES = BM * 8 / THREADS, W_COPIES = BN * 8 / THREADS;  // 16 B each, a step
constexpr int X_BYTES = BM * 128, STAGE_BYTES = (BM + BN) * 128;
constexpr int ACC = BN / 2;  // accumulators a thread: 64 x BN per warpgroup
static_assert(BM == 64 || BM == 128, "HW_BM: 64 or 128 (warpgroups of 64 rows)");
static_assert(BN == 128 || BN == 256, "HW_BN: 128 or 256");
static_assert(STAGES >= 3 && STAGES * STAGE_BYTES + 1024 <= 227 * 1024, "HW_STAGES");
static_assert(X_COPIES * THREADS == BM * 8 && W_COPIES * THREADS == BN * 8, "even copies");
}  // namespace

#if HW_BN == 256
#define wgmma_tile wgmma_n256
#else
#define wgmma_tile wgmma_n128
#endif

// The gated mean of a prompt mix over hc = 4 streams (hgemm_wg_gate_mix's epilogue): the
// GEMM's columns are up's rows interleaved by stream (column 4 c + s is stream s of column c),
// and each output is mixed[m, c] = (sigmoid(u_0) xn_0 + sigmoid(u_1) xn_1 + sigmoid(u_2) xn_2 +
// sigmoid(u_3) xn_3) / 4 over xn [m, 4, d], added in stream order as hc_gate_mix adds.
struct GateMix {
    const float* xn;  // [m, 4, d] the normed streams
    float* mixed;     // [m, d]
    u16* mixed16;     // [m, d] its f16 copy, or null
    int d;
};

// x: f16 [m, k]; w: f16 [n, k]; y: f32 [m, *] (row stride ldy); k a multiple of 8, x and w
// 16-byte aligned. 1-D grid of ceil(m / BM) * ceil(n / BN) CTAs; dynamic shared memory
// STAGES * STAGE_BYTES + 1024 bytes (the ring is aligned to 1024 inside it).
template <bool GATE_MIX>
__device__ __forceinline__ void hgemm_wg_body(const u16* __restrict__ x, const u16* __restrict__ w,
                                              float* __restrict__ y, int m, int n, int k,
                                              long long ldy, GateMix gm) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const int tid = threadIdx.x;
    const unsigned base = (smem_u32(smem_raw) + 1023u) & ~1023u;

    // this CTA's tile: groups of GROUP_M tile rows, column-major within a group
    const int tiles_m = (m + BM - 1) / BM, tiles_n = (n + BN - 1) / BN;
    const int per_group = HW_GROUP_M * tiles_n, t = blockIdx.x;
    const int first_m = t / per_group * HW_GROUP_M;
    const int group_m = min(tiles_m - first_m, HW_GROUP_M);
    const int m0 = (first_m + (t % per_group) % group_m) * BM;
    const int n0 = (t % per_group) / group_m * BN;

    // this thread's copies: 16-byte chunk c of tile row r, at r * 128 + (c ^ (r % 8)) * 16
    const u16* xsrc[X_COPIES];  // null: past m
    unsigned xoff[X_COPIES];
    int xc[X_COPIES];
#pragma unroll
    for (int i = 0; i < X_COPIES; i++) {
        const int q = tid + i * THREADS, r = q >> 3;
        xc[i] = q & 7;
        xoff[i] = r * 128 + ((xc[i] ^ (r & 7)) << 4);
        xsrc[i] = m0 + r < m ? x + (size_t)(m0 + r) * k : nullptr;
    }
    const u16* wsrc[W_COPIES];
    unsigned woff[W_COPIES];
    int wc[W_COPIES];
#pragma unroll
    for (int i = 0; i < W_COPIES; i++) {
        const int q = tid + i * THREADS, r = q >> 3;
        wc[i] = q & 7;
        woff[i] = X_BYTES + r * 128 + ((wc[i] ^ (r & 7)) << 4);
        wsrc[i] = n0 + r < n ? w + (size_t)(n0 + r) * k : nullptr;
    }
    auto load = [&](int step, int buf) {  // copies of k step `step` into ring buffer `buf`
        const int k0 = step * BK;
        const unsigned dst = base + buf * STAGE_BYTES;
#pragma unroll
        for (int i = 0; i < X_COPIES; i++) {
            const int kk = k0 + xc[i] * 8;
            const bool valid = xsrc[i] != nullptr && kk < k;
            cp16(dst + xoff[i], valid ? xsrc[i] + kk : x, valid);
        }
#pragma unroll
        for (int i = 0; i < W_COPIES; i++) {
            const int kk = k0 + wc[i] * 8;
            const bool valid = wsrc[i] != nullptr && kk < k;
            cp16(dst + woff[i], valid ? wsrc[i] + kk : w, valid);
        }
    };

    const int wg = tid >> 7;
    float acc[ACC];
#pragma unroll
    for (int i = 0; i < ACC; i++) acc[i] = 0.f;
    wgmma_hold(acc);

    const int n_steps = (k + BK - 1) / BK;
#pragma unroll
    for (int s = 0; s < STAGES - 2; s++) {
        if (s < n_steps) load(s, s);
        cp_commit();  // one group a step, empty past the end: the wait count stays fixed
    }
    for (int s = 0; s < n_steps; s++) {
        cp_wait<STAGES - 3>();  // step s has landed (this thread's copies) ...
        fence_proxy_async();    // ... is visible to wgmma's reads ...
        __syncthreads();        // ... everyone's; step s - 2's products are done everywhere
        if (s + STAGES - 2 < n_steps) load(s + STAGES - 2, (s + STAGES - 2) % STAGES);
        cp_commit();
        const unsigned xs = base + (s % STAGES) * STAGE_BYTES;
        const u64 da = wgmma_desc(xs + wg * 64 * 128), db = wgmma_desc(xs + X_BYTES);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++)  // +32 bytes a k16 step: +2 in the address field
            wgmma_tile(acc, da + 2 * kk, db + 2 * kk);
        wgmma_commit();
        wgmma_wait<1>();
    }
    wgmma_wait<0>();
    wgmma_hold(acc);
    cp_wait<0>();  // nothing real is in flight (the last groups are empty); leave none behind

    // accumulator 4 j + c: row 16 v + g (+8 for c = 2, 3), columns 8 j + 2 q, +1 (wgmma.cuh)
    const int lane = tid & 31, v = (tid >> 5) & 3, g = lane >> 2, tq = lane & 3;
    if constexpr (GATE_MIX) {
        // columns 8 j + 2 q, +1 are streams 0, 1 (q even) or 2, 3 (q odd) of column c: the
        // quad's lanes q and q ^ 1 hold one column's four streams
        const float r_hc = __fdiv_rn(1.f, 4.f);
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int r = m0 + wg * 64 + 16 * v + g + half * 8;
            const bool row_ok = r < m;
            const float* xr = gm.xn + (size_t)(row_ok ? r : 0) * 4 * gm.d;
#pragma unroll
            for (int j = 0; j < BN / 8; j++) {
                const int col = n0 + j * 8 + 2 * tq, c = col >> 2, s0 = col & 3;
                const bool ok = row_ok && c < gm.d;
                float p0 = 0.f, p1 = 0.f;
                if (ok) {
                    p0 = __fmul_rn(sigmoid(acc[4 * j + 2 * half]), xr[s0 * gm.d + c]);
                    p1 = __fmul_rn(sigmoid(acc[4 * j + 2 * half + 1]), xr[(s0 + 1) * gm.d + c]);
                }
                const float p2 = __shfl_xor_sync(0xffffffffu, p0, 1);
                const float p3 = __shfl_xor_sync(0xffffffffu, p1, 1);
                if (ok && s0 == 0) {
                    const float mv = __fmul_rn(__fadd_rn(__fadd_rn(__fadd_rn(p0, p1), p2), p3),
                                               r_hc);
                    gm.mixed[(size_t)r * gm.d + c] = mv;
                    if (gm.mixed16) gm.mixed16[(size_t)r * gm.d + c] = f16_rn(mv);
                }
            }
        }
        return;
    }
    const bool pairs = ((size_t)y & 7) == 0 && (ldy & 1) == 0;  // 8-byte aligned column pairs
#pragma unroll
    for (int half = 0; half < 2; half++) {
        const int r = m0 + wg * 64 + 16 * v + g + half * 8;
        if (r >= m) continue;
        float* out = y + (size_t)r * ldy;
#pragma unroll
        for (int j = 0; j < BN / 8; j++) {
            const float v0 = acc[4 * j + 2 * half], v1 = acc[4 * j + 2 * half + 1];
            store_f32_pair(out, n0 + j * 8 + 2 * tq, n, v0, v1, pairs);
        }
    }
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    hgemm_wg(const u16* __restrict__ x, const u16* __restrict__ w, float* __restrict__ y, int m,
             int n, int k, long long ldy) {
    grid_sync();
    hgemm_wg_body<false>(x, w, y, m, n, k, ldy, GateMix{nullptr, nullptr, nullptr, 0});
}

// The up GEMM of a prompt mix and its gated mean (GateMix) in one kernel: x the silu'd low-rank
// rows f16 [m, k], w up's rows f16 interleaved by stream ([4 d, k]: row 4 c + s is stream s's row
// c), xn f32 [m, 4, d]; writes mixed f32 [m, d] and, when mixed16 is not null, its f16 copy. The
// products are hgemm_wg's, so each mixed value is hc_gate_mix's of hgemm_wg's u, bitwise.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
    hgemm_wg_gate_mix(const u16* __restrict__ x, const u16* __restrict__ w,
                      const float* __restrict__ xn, float* __restrict__ mixed,
                      u16* __restrict__ mixed16, int m, int n, int k, int d) {
    grid_sync();
    hgemm_wg_body<true>(x, w, nullptr, m, n, k, 0, GateMix{xn, mixed, mixed16, d});
}
