// The prompt GEMM on f16 operands in global memory (mgserve/cuda/ops/hgemm.py):
//
//   hgemm   Y[M, n] (f32, row stride ldy) = X[M, k] @ W^T, X and W f16 (W [n, k], row-major)
//
// W is the dequantized weight (qgemm.cu's qgemm_dequant: the values qgemm's CTAs decode into
// their W tiles, bitwise), so for large M the weight is decoded once instead of once per CTA row.
//
// A CTA (HG_WARPS_M x HG_WARPS_N warps) owns a BM x BN tile of Y and walks k in steps of BK
// through a HG_STAGES-deep ring of shared buffers filled by cp.async (16 bytes a copy, both
// operands): the copies of step s + STAGES - 1 are issued before the products of step s, one
// __syncthreads a step. Shared tiles are [rows, BK] halves with the 16-byte chunks of a row
// XOR-swizzled (chunk c of row r at c ^ ((r / (8 / CH)) % CH), CH chunks a row) so the 8 rows
// an ldmatrix phase reads, and the rows a warp's copies write, fall in distinct banks.
// Each warp runs (BM / WARPS_M / 16) x (BN / WARPS_N / 8) m16n8k16 products per 16 k.
// CTAs take tiles in groups of HG_GROUP_M tile rows (column-major within a group) so a wave's
// X and W tiles stay in L2.
//
// Batch invariance and equality with qgemm.cu: Y[m, n] is the f32 chain acc = mma(acc, X[m, k16],
// W[n, k16]) over k16 = 0, 16, 32, ... ascending from acc = 0, the same chain qgemm_tile runs
// (mma.sync m16n8k16 f16 x f16 + f32, the same operand bits); rows past M, columns past n and k
// past the end are zeros. So Y's row m is bitwise qgemm's for any M, tile shape or tile order.

#include "mma.cuh"
#include "pdl.cuh"

#ifndef HG_BM
#define HG_BM 128  // output rows (tokens) per CTA
#endif
#ifndef HG_BN
#define HG_BN 256  // output columns (W rows) per CTA
#endif
#ifndef HG_BK
#define HG_BK 32  // k per pipeline step
#endif
#ifndef HG_STAGES
#define HG_STAGES 4  // shared buffers in the ring (STAGES - 1 steps in flight)
#endif
#ifndef HG_WARPS_M
#define HG_WARPS_M 2
#endif
#ifndef HG_WARPS_N
#define HG_WARPS_N 4
#endif
#ifndef HG_MIN_CTAS
#define HG_MIN_CTAS 1  // __launch_bounds__ minimum CTAs per SM (caps registers)
#endif
#ifndef HG_GROUP_M
#define HG_GROUP_M 8  // tile rows per group of the CTA order
#endif

constexpr int BM = HG_BM, BN = HG_BN, BK = HG_BK, STAGES = HG_STAGES;
constexpr int THREADS = 32 * HG_WARPS_M * HG_WARPS_N;
constexpr int WTM = BM / HG_WARPS_M, WTN = BN / HG_WARPS_N;  // one warp's tile
constexpr int MT = WTM / 16, NT = WTN / 8;                   // its m16 and n8 tiles
constexpr int CH = BK / 8;                                   // 16-byte chunks per tile row
constexpr int X_COPIES = BM * CH / THREADS, W_COPIES = BN * CH / THREADS;  // per thread a step
constexpr int STAGE = (BM + BN) * BK;                        // halves per ring buffer (X, W)
static_assert(BM % (16 * HG_WARPS_M) == 0 && WTN % 16 == 0, "warp tile shape");
static_assert(BK == 16 || BK == 32 || BK == 64, "BK is 16, 32 or 64 (the swizzle)");
static_assert(X_COPIES * THREADS == BM * CH && W_COPIES * THREADS == BN * CH, "even copies");
static_assert(STAGES >= 2, "a ring of at least two buffers");

// The XOR term of row r: chunk c of row r of a [rows, BK] tile sits at chunk c ^ swz(r). It
// repeats every 8 rows, so it is the same for a lane's rows in every m16 / n16 tile of a warp.
__device__ __forceinline__ int swz(int r) { return (r / (8 / CH)) % CH; }

// x: f16 [m, k]; w: f16 [n, k]; y: f32 [m, *] (row stride ldy); k a multiple of 8, x and w
// 16-byte aligned. 1-D grid of ceil(m / BM) * ceil(n / BN) CTAs; dynamic shared memory
// STAGES * STAGE * 2 bytes.
extern "C" __global__ void __launch_bounds__(THREADS, HG_MIN_CTAS)
    hgemm(const u16* __restrict__ x, const u16* __restrict__ w, float* __restrict__ y, int m, int n,
          int k, long long ldy) {
    extern __shared__ __align__(128) u16 smem[];  // STAGES x {X [BM][BK], W [BN][BK]}
    grid_sync();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    // this CTA's tile: groups of GROUP_M tile rows, column-major within a group
    const int tiles_m = (m + BM - 1) / BM, tiles_n = (n + BN - 1) / BN;
    const int per_group = HG_GROUP_M * tiles_n, t = blockIdx.x;
    const int first_m = t / per_group * HG_GROUP_M;
    const int group_m = min(tiles_m - first_m, HG_GROUP_M);
    const int m0 = (first_m + (t % per_group) % group_m) * BM;
    const int n0 = (t % per_group) / group_m * BN;

    const u16* xsrc[X_COPIES];  // this thread's copies: source row (null: past m), shared offset
    int xoff[X_COPIES], xc[X_COPIES];
#pragma unroll
    for (int i = 0; i < X_COPIES; i++) {
        const int q = tid + i * THREADS, r = q / CH;
        xc[i] = q % CH;
        xoff[i] = r * BK + ((xc[i] ^ swz(r)) << 3);
        xsrc[i] = m0 + r < m ? x + (size_t)(m0 + r) * k : nullptr;
    }
    const u16* wsrc[W_COPIES];
    int woff[W_COPIES], wc[W_COPIES];
#pragma unroll
    for (int i = 0; i < W_COPIES; i++) {
        const int q = tid + i * THREADS, r = q / CH;
        wc[i] = q % CH;
        woff[i] = (BM + r) * BK + ((wc[i] ^ swz(r)) << 3);
        wsrc[i] = n0 + r < n ? w + (size_t)(n0 + r) * k : nullptr;
    }
    const unsigned base = smem_u32(smem);
    auto load = [&](int step, int buf) {  // copies of k step `step` into ring buffer `buf`
        const int k0 = step * BK;
        const unsigned dst = base + buf * STAGE * 2;
#pragma unroll
        for (int i = 0; i < X_COPIES; i++) {
            const int kk = k0 + xc[i] * 8;
            const bool valid = xsrc[i] != nullptr && kk < k;
            cp16(dst + xoff[i] * 2, valid ? xsrc[i] + kk : x, valid);
        }
#pragma unroll
        for (int i = 0; i < W_COPIES; i++) {
            const int kk = k0 + wc[i] * 8;
            const bool valid = wsrc[i] != nullptr && kk < k;
            cp16(dst + woff[i] * 2, valid ? wsrc[i] + kk : w, valid);
        }
    };

    // ldmatrix rows of this lane: A (m16 tile i) row lane % 16, chunk + lane / 16; B (n8 tiles
    // j, j + 1) row lane % 8 + (lane / 16) * 8, chunk + (lane / 8) % 2 (as in qgemm.cu)
    const int wm = warp / HG_WARPS_N, wn = warp % HG_WARPS_N;
    const int ar = wm * WTM + (lane & 15), ac = lane >> 4, ax = swz(ar);
    const int br = wn * WTN + (lane & 7) + (lane >> 4) * 8, bc = (lane >> 3) & 1, bx = swz(br);

    float acc[MT][NT][4];
    zero_tiles(acc);

    const int n_steps = (k + BK - 1) / BK;
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
        if (s < n_steps) load(s, s);
        cp_commit();  // one group a step, empty past the end: the wait count stays fixed
    }
    for (int s = 0; s < n_steps; s++) {
        cp_wait<STAGES - 2>();  // step s has landed (this thread's copies) ...
        __syncthreads();        // ... everyone's, and step s - 1's buffer is free
        if (s + STAGES - 1 < n_steps) load(s + STAGES - 1, (s + STAGES - 1) % STAGES);
        cp_commit();
        const unsigned xs = base + (s % STAGES) * STAGE * 2, ws = xs + BM * BK * 2;
#pragma unroll
        for (int k16 = 0; k16 < BK / 16; k16++) {
            const unsigned xa = xs + (ar * BK + (((k16 * 2 + ac) ^ ax) << 3)) * 2;
            const unsigned wa = ws + (br * BK + (((k16 * 2 + bc) ^ bx) << 3)) * 2;
            uint4 af[MT];
#pragma unroll
            for (int i = 0; i < MT; i++) {
                u32 r[4];
                ldsm_x4(r, xa + i * 16 * BK * 2);
                af[i] = make_uint4(r[0], r[1], r[2], r[3]);
            }
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                u32 b[4];  // 0, 1: n8 tile j (k 0..7, 8..15); 2, 3: tile j + 1
                ldsm_x4(b, wa + j * 8 * BK * 2);
#pragma unroll
                for (int i = 0; i < MT; i++) {
                    mma16816(acc[i][j], af[i], b[0], b[1]);
                    mma16816(acc[i][j + 1], af[i], b[2], b[3]);
                }
            }
        }
    }
    cp_wait<0>();  // nothing real is in flight (the last groups are empty); leave none behind

    // Accumulator c of tile (i, j): row g (+8 for c2, c3), columns 2t, 2t + 1 (g = lane / 4,
    // t = lane % 4), as the m16n8 C fragment lays it out.
    const int g = lane >> 2, tq = lane & 3;
    const bool pairs = ((size_t)y & 7) == 0 && (ldy & 1) == 0;  // 8-byte aligned column pairs
#pragma unroll
    for (int i = 0; i < MT; i++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            const int r = m0 + wm * WTM + i * 16 + g + half * 8;
            if (r >= m) continue;
            float* out = y + (size_t)r * ldy;
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const float v0 = acc[i][j][2 * half], v1 = acc[i][j][2 * half + 1];
                store_f32_pair(out, n0 + wn * WTN + j * 8 + 2 * tq, n, v0, v1, pairs);
            }
        }
    }
}
