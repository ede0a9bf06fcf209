// Flash attention for prompt chunks over one slot of the KV pools (ops/attention_prefill.py):
// query i of the span sits at position start + i and sees positions 0 .. start + i (the span's
// own K/V are in the pool already), the last `window` of them when window > 0, and, for QSA,
// only the positions set in its row of a visibility bitmap.
//
// Compile-time: HEAD_DIM (64, 128 or 256), K_Q8 / V_Q8 (1: q8_0 pool, int8 values + one f16
// scale per 32 values; 0: f16 pool). Pools: values [n_slots, n_ctx, n_kv, D], scales
// [n_slots, n_ctx, n_kv, D / 32].
//
// attn_prefill, grid (cdiv(T * group, PF_ROWS), n_kv), PF_THREADS = 128 threads (4 warps):
//   A CTA owns PF_ROWS = 64 rows of the span's (query, head of KV head kh's group) pairs, row
//   f = i * group + g (query i, query head kh * group + g): the heads sharing a KV head are packed,
//   so a 1-token span fills 12 rows of a tile rather than 1, and one tile's rows are a few
//   neighbouring queries. Warp w computes rows 16w .. 16w + 15. Keys stream in tiles of
//   PF_KEYS = 32 positions from position 0 (a fixed grid: tile j = positions 32j .. 32j + 31)
//   up to the CTA's last query; q8_0 tiles are copied raw (cp.async) and dequantized to f16 in
//   shared memory, f16 tiles are copied directly (two buffers). Per tile and warp:
//   S = Q K^T (mma.sync m16n8k16, f16 in, fp32 out; Q pre-multiplied by the softmax scale and
//   log2 e, rounded to f16 once), the mask, the online softmax in fp32 (exp2), O += P V with P
//   rounded to f16. At the end O / l is written as fp32 [T, H, D].
//
// Batch invariance: a row's result depends only on its query, its position and the pool: the
// tiles it sees and their order are fixed by its position; a tile that is fully masked for a row
// (the CTA's other rows see more) leaves its state bit-identical (max unchanged, factor 1 exactly,
// weights exactly 0 times finite values: keys past the span are zero-filled, never read), and
// each mma row depends only on its own A row. So the span length, its tiling and the other spans
// of the step never change a row's bits.
//
// Precision: f16 Q, K, V (q8_0 values times their scale rounded once to f16) and P, fp32
// accumulation: about 1e-3 of a row's largest output, like flash attention elsewhere. P is
// exp2(s - m + P_SHIFT) (at most 2^8): weights below f16's normal range keep their precision;
// the shift cancels in O / l.

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

#define PF_WARPS 4
#define PF_THREADS (32 * PF_WARPS)
#define PF_ROWS (16 * PF_WARPS)  // (query, head) rows per CTA
#define PF_KEYS 32               // key positions per tile (= bits per visibility word)
#define P_SHIFT 8.f
#define LOG2E 1.4426950408889634f

static_assert(HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256, "HEAD_DIM: 64, 128 or 256");

constexpr int D = HEAD_DIM;
constexpr int NBLK = D / 32;                   // q8_0 blocks per row
constexpr int ROW_B = (D + 8) * 2;             // f16 row in shared memory, padded by 16 bytes:
                                               // 8 rows of an ldmatrix hit 8 distinct 16-byte
                                               // bank groups (ROW_B % 128 == 16)
constexpr int Q_B = PF_ROWS * ROW_B;           // Q tile (f16)
constexpr int TILE_B = PF_KEYS * ROW_B;        // one f16 K or V tile
constexpr int RAW_B = PF_KEYS * D;             // one q8_0 tile's values
constexpr int RAW_SC_B = PF_KEYS * NBLK * 2;   // and its scales
// Per operand: q8_0: the f16 tile, the raw values, the raw scales; f16: two f16 tiles.
constexpr int K_B = K_Q8 ? TILE_B + RAW_B + RAW_SC_B : 2 * TILE_B;
constexpr int V_B = V_Q8 ? TILE_B + RAW_B + RAW_SC_B : 2 * TILE_B;
constexpr int SMEM_B = Q_B + K_B + V_B;
static_assert(ROW_B % 128 == 16 && TILE_B % 16 == 0 && RAW_SC_B % 16 == 0, "alignment");
#ifdef EXPECT_SMEM  // ops/attention_prefill.py passes its own count: they must agree
static_assert(SMEM_B == EXPECT_SMEM, "ops/attention_prefill.py prefill_smem_bytes disagrees");
#endif

// (a * b) per f16 half, rounded to nearest (exact inputs: one rounding, as f32 then cvt).
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// The f16 tile of key tile j of an operand's region (q8_0: one buffer; f16: two, alternating).
template <int Q8>
__device__ __forceinline__ u8* f16_tile(u8* region, int j) {
    return Q8 ? region : region + (j & 1) * TILE_B;
}

// Issue the copies of key tile j (positions 32j ..) of one operand; positions >= end are
// zero-filled and never read from the pool.
template <int Q8>
__device__ __forceinline__ void load_tile(u8* region, int j, const u8* __restrict__ val,
                                          const u16* __restrict__ sc, size_t row0, int n_kv,
                                          int kh, int end, int tid) {
    const int p0 = j * PF_KEYS;
    if (Q8) {
        u8* raw = region + TILE_B;
        u8* raw_sc = raw + RAW_B;
        constexpr int C = D / 16;  // 16-byte pieces per row
        for (int c = tid; c < PF_KEYS * C; c += PF_THREADS) {
            const int row = c / C, col = c % C, p = p0 + row;
            const bool ok = p < end;
            const size_t g = (row0 + (ok ? p : 0)) * n_kv + kh;
            cp16(smem_u32(raw + row * D + col * 16), val + g * D + col * 16, ok);
        }
        for (int row = tid; row < PF_KEYS; row += PF_THREADS) {
            const int p = p0 + row;
            const bool ok = p < end;
            const size_t g = (row0 + (ok ? p : 0)) * n_kv + kh;
            cp_small<NBLK * 2>(smem_u32(raw_sc + row * NBLK * 2),
                               reinterpret_cast<const u8*>(sc) + g * NBLK * 2, ok);
        }
    } else {
        u8* dst = f16_tile<0>(region, j);
        constexpr int C = D * 2 / 16;
        for (int c = tid; c < PF_KEYS * C; c += PF_THREADS) {
            const int row = c / C, col = c % C, p = p0 + row;
            const bool ok = p < end;
            const size_t g = (row0 + (ok ? p : 0)) * n_kv + kh;
            cp16(smem_u32(dst + row * ROW_B + col * 16), val + g * D * 2 + col * 16, ok);
        }
    }
}

// q8_0 raw tile -> f16 tile: each value times its block's scale, rounded once.
__device__ __forceinline__ void dequant_tile(u8* region, int tid) {
    const u8* raw = region + TILE_B;
    const u16* raw_sc = reinterpret_cast<const u16*>(raw + RAW_B);
    constexpr int C = D / 8;  // 8-value pieces per row
    for (int c = tid; c < PF_KEYS * C; c += PF_THREADS) {
        const int row = c / C, col = c % C;
        const uint2 w = *reinterpret_cast<const uint2*>(raw + row * D + col * 8);
        const u32 s = raw_sc[row * NBLK + col / 4];
        const u32 s2 = s | (s << 16);
        uint4 h;
        h.x = hmul2(i8x2_to_h2(__byte_perm(w.x, 0, 0x0100)), s2);  // values 0, 1
        h.y = hmul2(i8x2_to_h2(__byte_perm(w.x, 0, 0x0302)), s2);  // 2, 3
        h.z = hmul2(i8x2_to_h2(__byte_perm(w.y, 0, 0x0100)), s2);
        h.w = hmul2(i8x2_to_h2(__byte_perm(w.y, 0, 0x0302)), s2);
        *reinterpret_cast<uint4*>(region + row * ROW_B + col * 16) = h;
    }
}

// c0 += a * (b[0], b[1]), c1 += a * (b[2], b[3]): two n8 tiles from one ldmatrix.x4.
__device__ __forceinline__ void mma_pair(float (&c0)[4], float (&c1)[4], const uint4& a,
                                         const u32 (&b)[4]) {
    mma16816(c0, a, b[0], b[1]);
    mma16816(c1, a, b[2], b[3]);
}

// Max / sum over the 4 lanes of a quad (the lanes holding one row of an mma tile).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(FULL, x, 1));
    return fmaxf(x, __shfl_xor_sync(FULL, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(FULL, x, 1);
    return x + __shfl_xor_sync(FULL, x, 2);
}

// Whether key position kp is visible to a query at position p (p < 0: a padding row).
__device__ __forceinline__ bool visible(int kp, int p, int window, u32 bits, int bit) {
    return kp <= p && (window <= 0 || p - kp < window) && ((bits >> bit) & 1u);
}

extern "C" __global__ void __launch_bounds__(PF_THREADS, 2)
attn_prefill(const float* __restrict__ q,    // [T, H, D] the span's queries
             const u8* __restrict__ k_val,   // K pool values (int8 or f16)
             const u16* __restrict__ k_sc,   // K pool scales (q8_0) or unused
             const u8* __restrict__ v_val, const u16* __restrict__ v_sc,
             const u32* __restrict__ vis,    // [T, vis_words] QSA visibility bits, or null
             float* __restrict__ out,        // [T, H, D]
             int slot, int start, int t, int n_ctx, int n_kv, int group, float scale,
             float softcap, int window, int vis_words) {
    grid_sync();
    extern __shared__ __align__(16) u8 smem[];
    u8* const sQ = smem;
    u8* const kreg = smem + Q_B;
    u8* const vreg = kreg + K_B;

    const int kh = blockIdx.y;
    const int rows = t * group;
    // heaviest tiles (the last queries) first
    const int f0 = (gridDim.x - 1 - blockIdx.x) * PF_ROWS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tig = lane & 3;
    const int end = start + t;

    {  // the host sized the dynamic shared memory from the same formula
        unsigned dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < (unsigned)SMEM_B) __trap();
    }

    // The CTA's key tiles: from its first query's first visible position to its last query.
    const int f_last = min(rows, f0 + PF_ROWS) - 1;
    const int p_first = start + f0 / group, p_last = start + f_last / group;
    const int j_lo = window > 0 ? max(0, p_first - window + 1) / PF_KEYS : 0;
    const int j_hi = p_last / PF_KEYS;

    // This warp's span of positions (wf0 >= rows: no rows, the warp only helps with copies).
    const int wf0 = f0 + 16 * warp, wf1 = min(rows, wf0 + 16) - 1;
    const int wp0 = start + wf0 / group, wp1 = start + wf1 / group;

    // Q tile: rows f0 .. f0 + 63 times scale (and log2 e unless soft-capped), as f16.
    const float qs = softcap > 0.f ? scale : scale * LOG2E;
    for (int c = tid; c < PF_ROWS * (D / 4); c += PF_THREADS) {
        const int r = c / (D / 4), col = c % (D / 4), f = f0 + r;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (f < rows) {
            const int i = f / group, g = f - i * group;
            x = *reinterpret_cast<const float4*>(
                q + (((size_t)i * n_kv + kh) * group + g) * D + col * 4);
        }
        *reinterpret_cast<uint2*>(sQ + r * ROW_B + col * 8) =
            make_uint2(f16x2_rn(x.x * qs, x.y * qs), f16x2_rn(x.z * qs, x.w * qs));
    }

    // This thread's rows of the warp: a = gid, b = gid + 8 (position -1: a padding row).
    const int fa = wf0 + gid, fb = fa + 8;
    const int ia = fa / group, ib = fb / group;
    const int pa = fa < rows ? start + ia : -1, pb = fb < rows ? start + ib : -1;
    const float inv_cap = softcap > 0.f ? 1.f / softcap : 0.f, cap2 = softcap * LOG2E;

    const size_t row0 = (size_t)slot * n_ctx;
    load_tile<K_Q8>(kreg, j_lo, k_val, k_sc, row0, n_kv, kh, end, tid);
    load_tile<V_Q8>(vreg, j_lo, v_val, v_sc, row0, n_kv, kh, end, tid);
    cp_commit();

    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.f, l_b = 0.f;
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

    // ldmatrix lane offsets: A (Q) rows lane % 8 + 8 ((lane / 8) % 2), cols 8 (lane / 16);
    // B of S (K rows = keys) keys lane % 8 + 8 (lane / 16), dims 8 ((lane / 8) % 2);
    // B of O (V, transposed) keys lane % 8 + 8 ((lane / 8) % 2), dims 8 (lane / 16).
    const int l8 = lane & 7, l8b = (lane >> 3) & 1, l16 = lane >> 4;
    const unsigned q_addr = smem_u32(sQ + (16 * warp + l8 + 8 * l8b) * ROW_B + 16 * l16);
    const int k_off = (l8 + 8 * l16) * ROW_B + 16 * l8b;
    const int v_off = (l8 + 8 * l8b) * ROW_B + 16 * l16;

    for (int j = j_lo; j <= j_hi; ++j) {
        cp_wait<0>();
        __syncthreads();  // tile j landed; every warp is done with tile j - 1
        if (K_Q8 || V_Q8) {
            if (K_Q8) dequant_tile(kreg, tid);
            if (V_Q8) dequant_tile(vreg, tid);
            __syncthreads();  // f16 tiles ready; the raw buffers are free
        }
        if (j < j_hi) {
            load_tile<K_Q8>(kreg, j + 1, k_val, k_sc, row0, n_kv, kh, end, tid);
            load_tile<V_Q8>(vreg, j + 1, v_val, v_sc, row0, n_kv, kh, end, tid);
        }
        cp_commit();

        const int kp0 = j * PF_KEYS;
        // warp-uniform: no row of this warp sees this tile (skipping a fully masked tile is exact)
        if (wf0 >= rows || kp0 > wp1 || (window > 0 && kp0 + PF_KEYS - 1 <= wp0 - window)) continue;

        const unsigned sk = smem_u32(f16_tile<K_Q8>(kreg, j)) + k_off;
        const unsigned sv = smem_u32(f16_tile<V_Q8>(vreg, j)) + v_off;

        // S = Q K^T: s[n][0..1] row a, keys kp0 + 8n + 2 tig, +1; s[n][2..3] row b.
        float s[PF_KEYS / 8][4];
#pragma unroll
        for (int n = 0; n < PF_KEYS / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            u32 a[4];
            ldsm_x4(a, q_addr + ks * 32);
            const uint4 av = make_uint4(a[0], a[1], a[2], a[3]);
#pragma unroll
            for (int np = 0; np < PF_KEYS / 16; ++np) {
                u32 b[4];  // b0, b1 of keys 16np .. + 7, then of keys 16np + 8 .. + 15
                ldsm_x4(b, sk + np * 16 * ROW_B + ks * 32);
                mma_pair(s[2 * np], s[2 * np + 1], av, b);
            }
        }

        // Mask, soft cap, online softmax (log2 domain).
        const u32 bits_a = vis != nullptr && pa >= 0 ? vis[(size_t)ia * vis_words + j] : ~0u;
        const u32 bits_b = vis != nullptr && pb >= 0 ? vis[(size_t)ib * vis_words + j] : ~0u;
        float mx_a = NEG_INF, mx_b = NEG_INF;
#pragma unroll
        for (int n = 0; n < PF_KEYS / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int bit = 8 * n + 2 * tig + (e & 1);
                const bool rb = e >= 2;
                float x = s[n][e];
                if (softcap > 0.f) x = tanhf(x * inv_cap) * cap2;
                x = visible(kp0 + bit, rb ? pb : pa, window, rb ? bits_b : bits_a, bit) ? x
                                                                                        : NEG_INF;
                s[n][e] = x;
                if (rb)
                    mx_b = fmaxf(mx_b, x);
                else
                    mx_a = fmaxf(mx_a, x);
            }
        }
        const float mn_a = fmaxf(m_a, quad_max(mx_a)), mn_b = fmaxf(m_b, quad_max(mx_b));
        const float ref_a = mn_a == NEG_INF ? 0.f : mn_a;  // nothing visible yet: weights stay 0
        const float ref_b = mn_b == NEG_INF ? 0.f : mn_b;
        const float c_a = mn_a == m_a ? 1.f : exp2f(m_a - ref_a);
        const float c_b = mn_b == m_b ? 1.f : exp2f(m_b - ref_b);
        m_a = mn_a;
        m_b = mn_b;
        if (__any_sync(FULL, c_a != 1.f || c_b != 1.f)) {  // multiplying by 1 is exact: skip
            l_a *= c_a;
            l_b *= c_b;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                o[n][0] *= c_a;
                o[n][1] *= c_a;
                o[n][2] *= c_b;
                o[n][3] *= c_b;
            }
        }
        const float sub_a = ref_a - P_SHIFT, sub_b = ref_b - P_SHIFT;
#pragma unroll
        for (int n = 0; n < PF_KEYS / 8; ++n) {
            s[n][0] = exp2f(s[n][0] - sub_a);
            s[n][1] = exp2f(s[n][1] - sub_a);
            s[n][2] = exp2f(s[n][2] - sub_b);
            s[n][3] = exp2f(s[n][3] - sub_b);
            l_a += s[n][0] + s[n][1];
            l_b += s[n][2] + s[n][3];
        }

        // O += P V: the accumulators of key n-tiles 2kk, 2kk + 1 are the A operand of k16 step kk.
#pragma unroll
        for (int kk = 0; kk < PF_KEYS / 16; ++kk) {
            const uint4 pa4 = make_uint4(
                f16x2_rn(s[2 * kk][0], s[2 * kk][1]), f16x2_rn(s[2 * kk][2], s[2 * kk][3]),
                f16x2_rn(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                f16x2_rn(s[2 * kk + 1][2], s[2 * kk + 1][3]));
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                u32 b[4];  // b0, b1 of dims 16dp .. + 7, then of dims 16dp + 8 .. + 15
                ldsm_x4_trans(b, sv + kk * 16 * ROW_B + dp * 32);
                mma_pair(o[2 * dp], o[2 * dp + 1], pa4, b);
            }
        }
    }
    cp_wait<0>();

    // O / l, rows a and b: o[n][0..1] row a, dims 8n + 2 tig, +1; o[n][2..3] row b.
    l_a = quad_sum(l_a);
    l_b = quad_sum(l_b);
    const float inv_a = l_a > 0.f ? 1.f / l_a : 0.f, inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
    float* ya = out + (((size_t)ia * n_kv + kh) * group + (fa - ia * group)) * D + 2 * tig;
    float* yb = out + (((size_t)ib * n_kv + kh) * group + (fb - ib * group)) * D + 2 * tig;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        if (pa >= 0) *reinterpret_cast<float2*>(ya + 8 * n) = make_float2(o[n][0] * inv_a, o[n][1] * inv_a);
        if (pb >= 0) *reinterpret_cast<float2*>(yb + 8 * n) = make_float2(o[n][2] * inv_b, o[n][3] * inv_b);
    }
}
