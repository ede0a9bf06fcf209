// Flash-decoding attention over the slot pools of the KV cache (dense, sliding-window, and QSA
// block-sparse), one query token per session (or per virtual session: see ops/qsa_cuda.py).
//
// Compile-time: HEAD_DIM (64, 128 or 256), K_Q8 / V_Q8 (1: q8_0 pool, int8 values + one f16
// scale per 32 values; 0: f16 pool). Pools: values [n_slots, n_ctx, n_kv, D], scales
// [n_slots, n_ctx, n_kv, D / 32].
//
// attn_decode, grid (n_splits, n_kv, B), ATT_THREADS = 128 threads (4 warps):
//   CTA (split, kh, b) owns one chunk of session b's visible positions for KV head kh and ALL the
//   query heads of that head's group (group <= 16, one m16 tensor-core tile), so K/V are read
//   once. Positions are "virtual": v in [0, n) maps to a cache position (lo + v for dense and
//   windowed attention; selected blocks' cells then the tail for sparse QSA). The chunk length
//   depends only on n (n / ATT_MAX_SPLITS rounded up to a tile, at least min_chunk), so a
//   session's result never depends on the batch; CTAs past the last chunk exit at once.
//   The chunk streams through shared memory in tiles of ATT_TILE = 64 positions (cp.async,
//   ATT_STAGES-deep pipeline); warp w computes rows 16w..16w+15 of each tile with mma.sync
//   m16n8k16 (f16 in, f32 accumulate), keeping its own online-softmax state (m, l, O), and the
//   4 warps merge through shared memory at the end. The CTA writes its unnormalised partial
//   O [group, D] and (m, l) per head; attn_combine merges the chunks in a fixed order.
//
// Precision (the result should match fp32 attention to ~1e-6 relative, not f16's 1e-3):
//   S = Q K^T: Q (pre-multiplied by the softmax scale) is split into f16 hi + lo parts (two mmas),
//   K's int8 values / f16 values are exact in f16; q8 scales are applied in fp32 per 32-dim block.
//   O = P V: the A operand is P * dv * 256 (dv: V's q8 scale of that position and 32-dim block,
//   1 for f16 pools), again split hi + lo; V's int8 / f16 values are exact in f16. The factor 256
//   keeps small weights out of f16's subnormal range; it is divided out at the end.
//
// Fragment mapping (PTX m16n8k16 layouts; gid = lane / 4, tig = lane % 4). Within each 32-dim
// block the reduction index of S = Q K^T is permuted so that a thread's B operand is 4 (k16 tile
// j = 0) then 4 more (j = 1) consecutive dims of one K row: logical k = 2 tig + e <-> dim
// 8 tig + 4 j + e, k = 2 tig + 8 + e <-> dim 8 tig + 4 j + 2 + e. Q's fragments are stored in
// shared memory in that order, one uint4 per lane per tile (hi and lo). For O = P V the score
// accumulators become the A operand directly (C layout of two n8 tiles = A layout of one k16
// tile); the B operand (V) of n-tile i of block blk holds dim blk*32 + 4 n + i in column n, so a
// thread reads 4 consecutive bytes / halves of 4 rows. Its O accumulators then hold, for heads
// gid and gid + 8, the 8 consecutive dims blk*32 + 8 tig + 0..7 of every block.
//
// attn_combine, grid (H, B), 128 threads: out[b, h] = sum_s O_s w_s / sum_s l_s w_s with
// w_s = exp(m_s - max m), splits in order; sessions with no visible key give zeros.

#include "math.cuh"
#include "mma.cuh"
#include "scalar.cuh"
#include "pdl.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 256
#endif
#ifndef K_Q8
#define K_Q8 1
#endif
#ifndef V_Q8
#define V_Q8 1
#endif
#ifndef ATT_STAGES
#define ATT_STAGES 2
#endif

#define ATT_WARPS 4
#define ATT_THREADS (32 * ATT_WARPS)
#define ATT_TILE (16 * ATT_WARPS)  // positions per pipeline stage: 16 rows per warp
#define ATT_MAX_SPLITS 128         // chunks per session at most (ops/attention_cuda.py: MAX_SPLITS)
#define COMBINE_THREADS 128
#define P_SCALE 256.f

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "HEAD_DIM: 64, 128 or 256");
static_assert(ATT_STAGES >= 2 && ATT_STAGES <= 4, "ATT_STAGES: 2..4");

constexpr int D = HEAD_DIM;
constexpr int NBLK = D / 32;  // 32-dim blocks (q8_0 blocks)
constexpr int NKT = D / 16;   // k16 tiles of S = Q K^T
constexpr int NOT = D / 8;    // n8 tiles of O

__host__ __device__ constexpr int cmod(int a, int m) { return ((a % m) + m) % m; }
__host__ __device__ constexpr int cmin(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

// Shared-memory rows, padded so the fragment reads below are free of bank conflicts:
// K q8 (8-byte reads of rows gid 0..3 per half-warp): row stride = 8 or 24 words mod 32;
// K f16 (16-byte reads, rows gid 0..1 per quarter-warp): 16 words mod 32;
// V (reads of rows 2 tig): 4 or 12 words mod 16.
constexpr int K_ROW_W = D * (K_Q8 ? 1 : 2) / 4;
constexpr int V_ROW_W = D * (V_Q8 ? 1 : 2) / 4;
constexpr int K_PAD_W = K_Q8 ? cmin(cmod(8 - K_ROW_W, 32), cmod(24 - K_ROW_W, 32))
                             : cmod(16 - K_ROW_W, 32);
constexpr int V_PAD_W = cmin(cmod(4 - V_ROW_W, 16), cmod(12 - V_ROW_W, 16));
constexpr int K_ROW = (K_ROW_W + K_PAD_W) * 4;  // bytes
constexpr int V_ROW = (V_ROW_W + V_PAD_W) * 4;
constexpr int K_GBYTES = D * (K_Q8 ? 1 : 2);  // bytes of one row in global memory
constexpr int V_GBYTES = D * (V_Q8 ? 1 : 2);
constexpr int SC_ROW = NBLK * 2;  // bytes of one row's q8 scales
constexpr int K_TILE_B = ATT_TILE * K_ROW;
constexpr int V_TILE_B = ATT_TILE * V_ROW;
constexpr int KS_TILE_B = K_Q8 ? ATT_TILE * SC_ROW : 0;
constexpr int VS_TILE_B = V_Q8 ? ATT_TILE * SC_ROW : 0;
constexpr int STAGE_B = K_TILE_B + V_TILE_B + KS_TILE_B + VS_TILE_B;
constexpr int Q_B = NKT * 2 * 32 * 16;   // Q fragments: [k16 tile][hi, lo][lane] uint4
constexpr int RED_B = ATT_WARPS * 16 * D * 4;  // per-warp O [16, D] for the final merge
constexpr int SMEM_B = Q_B + cmax(ATT_STAGES * STAGE_B, RED_B);
#ifdef EXPECT_SMEM  // ops/attention_cuda.py passes its own count (decode_smem_bytes): they must agree
static_assert(SMEM_B == EXPECT_SMEM, "ops/attention_cuda.py decode_smem_bytes disagrees with SMEM_B");
#endif

// ---- small helpers ---------------------------------------------------------------------------

__device__ __forceinline__ float2 unpack_h2(unsigned r) {
    u16 a, b;
    asm("mov.b32 {%0, %1}, %2;" : "=h"(a), "=h"(b) : "r"(r));
    return make_float2(f16_bits(a), f16_bits(b));
}

// (x0, x1) -> f16x2 hi = round(x) and lo = round(x - hi), so hi + lo carries ~22 bits.
__device__ __forceinline__ void split2(float x0, float x1, unsigned& hi, unsigned& lo) {
    hi = f16x2_rn(x0, x1);
    const float2 f = unpack_h2(hi);
    lo = f16x2_rn(x0 - f.x, x1 - f.y);
}

// ---- which positions a session sees ------------------------------------------------------------

struct Range {
    int n;         // visible (virtual) positions
    int lo;        // dense: first visible position (sliding window)
    int complete;  // QSA: complete blocks
    int sparse;    // QSA: 1 when the query attends to selected blocks + tail
};

__device__ __forceinline__ Range attn_range(int len, int n_ctx, int window, int qsa, int top,
                                            int ratio) {
    len = min(max(len, 0), n_ctx);
    Range r{len, 0, 0, 0};
    if (qsa) {
        r.complete = len / ratio;
        if (r.complete > top) {
            r.sparse = 1;
            r.n = top * ratio + (len - r.complete * ratio);
        }
    } else if (window > 0 && len > window) {
        r.lo = len - window;
        r.n = window;
    }
    return r;
}

// Positions per chunk: a function of n alone (never of the batch), a whole number of tiles.
__device__ __forceinline__ int chunk_len(int n, int min_chunk) {
    int c = (n + ATT_MAX_SPLITS - 1) / ATT_MAX_SPLITS;
    c = (c + ATT_TILE - 1) / ATT_TILE * ATT_TILE;
    return max(c, min_chunk);
}

// Cache position of virtual position v (0 <= v < r.n).
__device__ __forceinline__ int virtual_pos(const Range& r, const int* __restrict__ sel_b, int v,
                                           int top, int ratio) {
    if (!r.sparse) return r.lo + v;
    const int cells = top * ratio;
    if (v < cells) {
        const int i = v / ratio;
        return sel_b[i] * ratio + (v - i * ratio);
    }
    return r.complete * ratio + (v - cells);
}

// ---- attn_decode -----------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
attn_decode(const float* __restrict__ q,      // [B, H, D]
            const u8* __restrict__ k_val,     // K pool values (int8 or f16)
            const u16* __restrict__ k_sc,  // K pool scales (q8) or unused
            const u8* __restrict__ v_val, const u16* __restrict__ v_sc,
            const int* __restrict__ slots,    // [B]
            const int* __restrict__ lengths,  // [B] query b is at position lengths[b] - 1
            const int* __restrict__ sel,      // [B, top] QSA selected blocks, or null (dense)
            float* __restrict__ part_o,       // [B, H, gridDim.x, D]
            float2* __restrict__ part_ml,     // [B, H, gridDim.x] (max score, sum of weights)
            int n_ctx, int n_kv, int group, float scale, float softcap, int window,
            int min_chunk, int top, int ratio) {
    grid_sync();
    extern __shared__ __align__(16) u8 smem[];
    __shared__ float s_m[ATT_WARPS][16], s_l[ATT_WARPS][16];

    const int split = blockIdx.x, kh = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
    const int n_head = n_kv * group;
    const int qsa = sel != nullptr;

    const Range rg = attn_range(lengths[b], n_ctx, window, qsa, top, ratio);
    const int chunk = chunk_len(rg.n, min_chunk);
    const int v_begin = split * chunk;
    if (v_begin >= rg.n) return;  // past this session's last chunk (or nothing visible)
    const int v_end = min(rg.n, v_begin + chunk);

    {  // the host sized the dynamic shared memory from the same formula (ops/attention_cuda.py)
        unsigned dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < (unsigned)SMEM_B) __trap();
    }

    const int slot = slots[b];
    const int* sel_b = qsa ? sel + (size_t)b * top : nullptr;

    // Q fragments (hi, lo) of this group's heads, pre-multiplied by the softmax scale.
    uint4* sQ = reinterpret_cast<uint4*>(smem);
    {
        const float* qb = q + ((size_t)b * n_head + (size_t)kh * group) * D;
        for (int idx = tid; idx < NKT * 32; idx += ATT_THREADS) {
            const int kt = idx >> 5, ln = idx & 31, g = ln >> 2, t = ln & 3;
            const int base = (kt >> 1) * 32 + 8 * t + 4 * (kt & 1);
            float r0[4], r1[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                r0[e] = g < group ? qb[(size_t)g * D + base + e] * scale : 0.f;
                r1[e] = g + 8 < group ? qb[(size_t)(g + 8) * D + base + e] * scale : 0.f;
            }
            uint4 hi, lo;
            split2(r0[0], r0[1], hi.x, lo.x);  // a0 a1: head g, dims base + 0, 1
            split2(r1[0], r1[1], hi.y, lo.y);  // a2 a3: head g + 8
            split2(r0[2], r0[3], hi.z, lo.z);  // a4 a5: head g, dims base + 2, 3
            split2(r1[2], r1[3], hi.w, lo.w);  // a6 a7: head g + 8
            sQ[(kt * 2) * 32 + ln] = hi;
            sQ[(kt * 2 + 1) * 32 + ln] = lo;
        }
    }

    u8* const stages = smem + Q_B;
    const size_t head_row0 = (size_t)slot * n_ctx;  // pool row of (slot, position 0)

    // Issue the copies of the tile of virtual positions [v0, v0 + ATT_TILE) into stage st.
    auto load_tile = [&](int st, int v0) {
        u8* sK = stages + st * STAGE_B;
        u8* sV = sK + K_TILE_B;
        u8* sKs = sV + V_TILE_B;
        u8* sVs = sKs + KS_TILE_B;
        // K and V rows by two loops of one shape, not a shared helper: folding them (or their
        // position lookup) into a lambda made this loop's position arithmetic 64-bit.
        constexpr int KC = K_GBYTES / 16, VC = V_GBYTES / 16;
        for (int c = tid; c < ATT_TILE * KC; c += ATT_THREADS) {
            const int row = c / KC, col = c % KC, v = v0 + row;
            const bool ok = v < v_end;
            const int p = ok ? virtual_pos(rg, sel_b, v, top, ratio) : 0;
            const size_t g = (head_row0 + p) * n_kv + kh;
            cp16(smem_u32(sK + row * K_ROW + col * 16), ok ? k_val + g * K_GBYTES + col * 16 : k_val,
                 ok);
        }
        for (int c = tid; c < ATT_TILE * VC; c += ATT_THREADS) {
            const int row = c / VC, col = c % VC, v = v0 + row;
            const bool ok = v < v_end;
            const int p = ok ? virtual_pos(rg, sel_b, v, top, ratio) : 0;
            const size_t g = (head_row0 + p) * n_kv + kh;
            cp16(smem_u32(sV + row * V_ROW + col * 16), ok ? v_val + g * V_GBYTES + col * 16 : v_val,
                 ok);
        }
        if (K_Q8 || V_Q8) {
            for (int row = tid; row < ATT_TILE; row += ATT_THREADS) {
                const int v = v0 + row;
                const bool ok = v < v_end;
                const int p = ok ? virtual_pos(rg, sel_b, v, top, ratio) : 0;
                const size_t g = (head_row0 + p) * n_kv + kh;
                if (K_Q8)
                    cp_small<SC_ROW>(smem_u32(sKs + row * SC_ROW),
                                     ok ? (const u8*)k_sc + g * SC_ROW : (const u8*)k_sc, ok);
                if (V_Q8)
                    cp_small<SC_ROW>(smem_u32(sVs + row * SC_ROW),
                                     ok ? (const u8*)v_sc + g * SC_ROW : (const u8*)v_sc, ok);
            }
        }
    };

    // Per-warp online softmax state: rows (heads) gid and gid + 8; l is this thread's partial sum.
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;
    float o[NOT][4];
#pragma unroll
    for (int n = 0; n < NOT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

    const int n_tiles = (v_end - v_begin + ATT_TILE - 1) / ATT_TILE;
#pragma unroll
    for (int s = 0; s < ATT_STAGES - 1; ++s) {
        if (s < n_tiles) load_tile(s, v_begin + s * ATT_TILE);
        cp_commit();
    }

    for (int it = 0; it < n_tiles; ++it) {
        cp_wait<ATT_STAGES - 2>();
        __syncthreads();  // tile it is in shared memory; stage (it - 1) % STAGES is free
        {
            const int nt = it + ATT_STAGES - 1;
            if (nt < n_tiles) load_tile(nt % ATT_STAGES, v_begin + nt * ATT_TILE);
            cp_commit();
        }
        const int r0 = warp * 16;  // this warp's rows of the tile
        const int wv0 = v_begin + it * ATT_TILE + r0;
        if (wv0 >= v_end) continue;  // warp-uniform: no visible row here

        const u8* sK = stages + (it % ATT_STAGES) * STAGE_B;
        const u8* sV = sK + K_TILE_B;
        const u16* sKs = reinterpret_cast<const u16*>(sV + V_TILE_B);
        const u16* sVs = reinterpret_cast<const u16*>(sV + V_TILE_B + KS_TILE_B);

        // S = Q K^T for rows r0 + 8 t + c (n-tile t = 0, 1): s[t][0..1] head gid, columns
        // 2 tig, 2 tig + 1; s[t][2..3] head gid + 8.
        float s[2][4];
#pragma unroll
        for (int t = 0; t < 2; ++t) s[t][0] = s[t][1] = s[t][2] = s[t][3] = 0.f;
#pragma unroll
        for (int blk = 0; blk < NBLK; ++blk) {
            unsigned kb[2][4];  // B operands: [t][j * 2 + (0: dims +0,1; 1: dims +2,3)]
#pragma unroll
            for (int t = 0; t < 2; ++t) {
                const int row = r0 + 8 * t + gid;
                if (K_Q8) {
                    const uint2 w = *reinterpret_cast<const uint2*>(sK + row * K_ROW + blk * 32 +
                                                                    8 * tig);
                    kb[t][0] = i8x2_to_h2(__byte_perm(w.x, 0, 0x0100));
                    kb[t][1] = i8x2_to_h2(__byte_perm(w.x, 0, 0x0302));
                    kb[t][2] = i8x2_to_h2(__byte_perm(w.y, 0, 0x0100));
                    kb[t][3] = i8x2_to_h2(__byte_perm(w.y, 0, 0x0302));
                } else {
                    const uint4 w = *reinterpret_cast<const uint4*>(sK + row * K_ROW +
                                                                    (blk * 32 + 8 * tig) * 2);
                    kb[t][0] = w.x;
                    kb[t][1] = w.y;
                    kb[t][2] = w.z;
                    kb[t][3] = w.w;
                }
            }
            float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const uint4 ah = sQ[((2 * blk + j) * 2) * 32 + lane];
                const uint4 al = sQ[((2 * blk + j) * 2 + 1) * 32 + lane];
#pragma unroll
                for (int t = 0; t < 2; ++t) {
                    mma16816(acc[t], ah, kb[t][2 * j], kb[t][2 * j + 1]);
                    mma16816(acc[t], al, kb[t][2 * j], kb[t][2 * j + 1]);
                }
            }
#pragma unroll
            for (int t = 0; t < 2; ++t) {
                float d0 = 1.f, d1 = 1.f;
                if (K_Q8) {
                    const int row = r0 + 8 * t + 2 * tig;
                    d0 = f16_bits(sKs[row * NBLK + blk]);
                    d1 = f16_bits(sKs[(row + 1) * NBLK + blk]);
                }
                s[t][0] += acc[t][0] * d0;
                s[t][1] += acc[t][1] * d1;
                s[t][2] += acc[t][2] * d0;
                s[t][3] += acc[t][3] * d1;
            }
        }

        // Mask rows past the chunk, soft-cap, then the online softmax update.
#pragma unroll
        for (int t = 0; t < 2; ++t) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int v = wv0 + 8 * t + 2 * tig + (e & 1);
                if (v >= v_end)
                    s[t][e] = NEG_INF;
                else if (softcap > 0.f)
                    s[t][e] = tanhf(s[t][e] / softcap) * softcap;
            }
        }
        float mx0 = fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1]));
        float mx1 = fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3]));
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL, mx1, 2));
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float b0 = mn0 == NEG_INF ? 0.f : mn0;  // no finite score yet: weights stay 0
        const float b1 = mn1 == NEG_INF ? 0.f : mn1;
        if (__any_sync(FULL, mn0 != m0 || mn1 != m1)) {
            const float c0 = expf(m0 - b0), c1 = expf(m1 - b1);
            l0 *= c0;
            l1 *= c1;
#pragma unroll
            for (int n = 0; n < NOT; ++n) {
                o[n][0] *= c0;
                o[n][1] *= c0;
                o[n][2] *= c1;
                o[n][3] *= c1;
            }
        }
        m0 = mn0;
        m1 = mn1;
#pragma unroll
        for (int t = 0; t < 2; ++t) {
            s[t][0] = expf(s[t][0] - b0);
            s[t][1] = expf(s[t][1] - b0);
            s[t][2] = expf(s[t][2] - b1);
            s[t][3] = expf(s[t][3] - b1);
        }
        l0 += (s[0][0] + s[0][1]) + (s[1][0] + s[1][1]);
        l1 += (s[0][2] + s[0][3]) + (s[1][2] + s[1][3]);

        // O += P V. A = P (times dv * P_SCALE): columns 2 tig, 2 tig + 1 are rows R0, R0 + 1 and
        // columns 2 tig + 8, + 9 are rows R0 + 8, R0 + 9 of the tile.
        const int R0 = r0 + 2 * tig;
        uint4 ahi, alo;
        if (!V_Q8) {
            split2(s[0][0] * P_SCALE, s[0][1] * P_SCALE, ahi.x, alo.x);
            split2(s[0][2] * P_SCALE, s[0][3] * P_SCALE, ahi.y, alo.y);
            split2(s[1][0] * P_SCALE, s[1][1] * P_SCALE, ahi.z, alo.z);
            split2(s[1][2] * P_SCALE, s[1][3] * P_SCALE, ahi.w, alo.w);
        }
#pragma unroll
        for (int blk = 0; blk < NBLK; ++blk) {
            if (V_Q8) {
                const float d0 = f16_bits(sVs[R0 * NBLK + blk]) * P_SCALE;
                const float d1 = f16_bits(sVs[(R0 + 1) * NBLK + blk]) * P_SCALE;
                const float d2 = f16_bits(sVs[(R0 + 8) * NBLK + blk]) * P_SCALE;
                const float d3 = f16_bits(sVs[(R0 + 9) * NBLK + blk]) * P_SCALE;
                split2(s[0][0] * d0, s[0][1] * d1, ahi.x, alo.x);
                split2(s[0][2] * d0, s[0][3] * d1, ahi.y, alo.y);
                split2(s[1][0] * d2, s[1][1] * d3, ahi.z, alo.z);
                split2(s[1][2] * d2, s[1][3] * d3, ahi.w, alo.w);
                const unsigned w0 = *reinterpret_cast<const unsigned*>(sV + R0 * V_ROW + blk * 32 +
                                                                       4 * gid);
                const unsigned w1 = *reinterpret_cast<const unsigned*>(sV + (R0 + 1) * V_ROW +
                                                                       blk * 32 + 4 * gid);
                const unsigned w2 = *reinterpret_cast<const unsigned*>(sV + (R0 + 8) * V_ROW +
                                                                       blk * 32 + 4 * gid);
                const unsigned w3 = *reinterpret_cast<const unsigned*>(sV + (R0 + 9) * V_ROW +
                                                                       blk * 32 + 4 * gid);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const unsigned sel_i = i | ((4 + i) << 8);
                    const unsigned bb0 = i8x2_to_h2(__byte_perm(w0, w1, sel_i));
                    const unsigned bb1 = i8x2_to_h2(__byte_perm(w2, w3, sel_i));
                    mma16816(o[blk * 4 + i], ahi, bb0, bb1);
                    mma16816(o[blk * 4 + i], alo, bb0, bb1);
                }
            } else {
                const int off = (blk * 32 + 4 * gid) * 2;
                const uint2 w0 = *reinterpret_cast<const uint2*>(sV + R0 * V_ROW + off);
                const uint2 w1 = *reinterpret_cast<const uint2*>(sV + (R0 + 1) * V_ROW + off);
                const uint2 w2 = *reinterpret_cast<const uint2*>(sV + (R0 + 8) * V_ROW + off);
                const uint2 w3 = *reinterpret_cast<const uint2*>(sV + (R0 + 9) * V_ROW + off);
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const unsigned sel_i = (i & 1) ? 0x7632u : 0x5410u;
                    const unsigned bb0 = __byte_perm(i < 2 ? w0.x : w0.y, i < 2 ? w1.x : w1.y, sel_i);
                    const unsigned bb1 = __byte_perm(i < 2 ? w2.x : w2.y, i < 2 ? w3.x : w3.y, sel_i);
                    mma16816(o[blk * 4 + i], ahi, bb0, bb1);
                    mma16816(o[blk * 4 + i], alo, bb0, bb1);
                }
            }
        }
    }
    cp_wait<0>();
    __syncthreads();  // every warp is done with the stages: reuse them for the merge

    // Merge the 4 warps: per-warp O [16, D] and (m, l) through shared memory.
    l0 += __shfl_xor_sync(FULL, l0, 1);
    l0 += __shfl_xor_sync(FULL, l0, 2);
    l1 += __shfl_xor_sync(FULL, l1, 1);
    l1 += __shfl_xor_sync(FULL, l1, 2);
    if (tig == 0) {
        s_m[warp][gid] = m0;
        s_l[warp][gid] = l0;
        s_m[warp][gid + 8] = m1;
        s_l[warp][gid + 8] = l1;
    }
    float* red = reinterpret_cast<float*>(stages);  // [ATT_WARPS][16][D]
#pragma unroll
    for (int blk = 0; blk < NBLK; ++blk) {
        const int d = blk * 32 + 8 * tig;
        float* r_lo = red + ((size_t)warp * 16 + gid) * D + d;
        float* r_hi = red + ((size_t)warp * 16 + gid + 8) * D + d;
        const float* c0 = o[blk * 4 + 0];
        const float* c1 = o[blk * 4 + 1];
        const float* c2 = o[blk * 4 + 2];
        const float* c3 = o[blk * 4 + 3];
        *reinterpret_cast<float4*>(r_lo) = make_float4(c0[0], c1[0], c2[0], c3[0]);
        *reinterpret_cast<float4*>(r_lo + 4) = make_float4(c0[1], c1[1], c2[1], c3[1]);
        *reinterpret_cast<float4*>(r_hi) = make_float4(c0[2], c1[2], c2[2], c3[2]);
        *reinterpret_cast<float4*>(r_hi + 4) = make_float4(c0[3], c1[3], c2[3], c3[3]);
    }
    __syncthreads();

    for (int idx = tid; idx < group * D; idx += ATT_THREADS) {
        const int g = idx / D, d = idx - g * D;
        float mm = NEG_INF;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) mm = fmaxf(mm, s_m[w][g]);
        float acc = 0.f, l = 0.f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) {
            const float wt = s_m[w][g] == NEG_INF ? 0.f : expf(s_m[w][g] - mm);
            acc += red[((size_t)w * 16 + g) * D + d] * wt;
            l += s_l[w][g] * wt;
        }
        const size_t row = ((size_t)b * n_head + (size_t)kh * group + g) * gridDim.x + split;
        part_o[row * D + d] = acc * (1.f / P_SCALE);
        if (d == 0) part_ml[row] = make_float2(mm, l);
    }
}

// ---- attn_combine ----------------------------------------------------------------------------

extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
attn_combine(const float* __restrict__ part_o, const float2* __restrict__ part_ml,
             const int* __restrict__ lengths, float* __restrict__ out,  // [B, H * D]
             int n_ctx, int n_head, int n_splits, int window, int min_chunk, int qsa, int top,
             int ratio) {
    grid_sync();
    __shared__ float s_w[ATT_MAX_SPLITS];
    const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
    float* y = out + ((size_t)b * n_head + h) * D;
    const Range rg = attn_range(lengths[b], n_ctx, window, qsa, top, ratio);
    if (rg.n <= 0) {
        for (int d = tid; d < D; d += COMBINE_THREADS) y[d] = 0.f;
        return;
    }
    const int chunk = chunk_len(rg.n, min_chunk);
    const int ns = min((rg.n + chunk - 1) / chunk, n_splits);
    const size_t row0 = ((size_t)b * n_head + h) * n_splits;
    float mm = NEG_INF;
    for (int s = 0; s < ns; ++s) mm = fmaxf(mm, part_ml[row0 + s].x);
    float l = 0.f;
    for (int s = 0; s < ns; ++s) {
        const float2 ml = part_ml[row0 + s];
        l += ml.y * expf(ml.x - mm);
    }
    for (int s = tid; s < ns; s += COMBINE_THREADS) s_w[s] = expf(part_ml[row0 + s].x - mm) / l;
    __syncthreads();
    for (int d = tid; d < D; d += COMBINE_THREADS) {
        float acc = 0.f;
        for (int s = 0; s < ns; ++s) acc += part_o[(row0 + s) * D + d] * s_w[s];
        y[d] = acc;
    }
}
