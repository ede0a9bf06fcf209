// The Gated DeltaNet prompt scan on tensor cores: delta_scan_f32's algebra (deltanet_chunked.cu
// has it, and the solve delta_prep_f32 stores per value head and chunk), its four products per
// chunk as TF32 mma.sync m16n8k8 in the 3xTF32 form that keeps fp32 accuracy: each operand x is
// split into TF32 hi and lo with x - hi - lo within 2^-22 |x| (``split``), and a . b is summed
// as a_lo b_hi + a_hi b_lo + a_hi b_hi (a_lo b_lo, at most 2^-22 of the product, dropped) into
// fp32 accumulators.
// One session per launch and a fixed order of every sum, so two runs give the same bits (not
// delta_scan_f32's bits: the sums run in another order, within fp32 rounding of them).
//
// delta_scan_tc: grid (HEAD_DIM / TC_COLS, Hv), block TC_THREADS (8 warps); the chunks of one
// head in order, TC_COLS columns of the state S [d_k, d_v] a CTA. Per chunk (K, Q [C, d_k] rows
// of the chunk, V [C, TC_COLS], M and Aqk [C, C] lower triangular, exp(G), exp(G_last - G)):
//   P1  R  = V - diag(exp(G)) K S          [C, cols], k = d_k
//   P2  V' = M R                           [C, cols], k <= the row tile's end (triangular)
//   P4  S' = exp(G_last) S + (K diag(exp(G_last - G)))^T V'   [d_k, cols], k = C
//   P3  O  = diag(exp(G)) Q S + Aqk V'      [C, cols]   (S still the entering state)
// Warp tiles: the [C, cols] products give warp w the column tile w % 4 and the row tiles a and
// 3 - a (a = w / 4), so every warp has the same share of the triangular P2 and P3 (10 k-steps);
// P4 gives warp w rows 16 w .. 16 w + 15 of S' and all four column tiles, which are also the
// accumulators that carry S from chunk to chunk (registers; hi / lo copies in shared memory are
// what P1 and P3 read).
//
// Fragments (m16n8k8, TF32; g = lane / 4, t = lane % 4): A (16 x 8, row-major) a0 = (g, t), a1 =
// (g + 8, t), a2 = (g, t + 4), a3 = (g + 8, t + 4); B (8 x 8) b0 = (t, g), b1 = (t + 4, g);
// C (16 x 8) c0, c1 = (g, 2 t, 2 t + 1), c2, c3 = (g + 8, same). A operands (k / q rows, M, Aqk)
// are split as they are read; B operands (S, R, V') are stored split once, as [rows][SPAD]
// planes: row stride SPAD = TC_COLS + 8 puts a B fragment's 32 reads on 32 banks (8 t + g), and
// the k / q rows' KPAD = d_k + 4 and the C x C tiles' CPAD = C + 4 do the same for A (4 g + t).
// P4's A (K transposed) reads 2-way conflicted (4 t + g), about a twelfth of the A reads.
//
// Padding: rows of the last chunk past the prompt are zero in K, Q and V (and so in R and V'),
// and write nothing into S (as delta_scan_f32).

#include "deltanet_chunked.cuh"
#include "pdl.cuh"

#define TC_THREADS 256
#define TC_COLS 32
#define SPAD (TC_COLS + 8)
#define TC_SMEM_BYTES ((CHUNK * KPAD + CHUNK * CPAD + 2 * HEAD_DIM * SPAD + 2 * CHUNK * SPAD + 2 * CHUNK) * 4)
#ifdef TC_SMEM
static_assert(TC_SMEM == TC_SMEM_BYTES, "the wrapper's shared memory size differs from the layout");
#endif
static_assert(HEAD_DIM == 128 && CHUNK == 64 && TC_COLS == 32, "the warp tiles are written for these");

typedef unsigned int u32;

// x = hi + lo, both TF32 (their low 13 mantissa bits zero, as cvt.rna.tf32.f32 leaves them):
// each rounded to nearest, ties away, by adding half a unit of the dropped bits and clearing
// them. x - hi is exact, |lo| <= 2^-11 |x| and |x - hi - lo| <= 2^-22 |x|. |x| < 3.4e38 only
// (hi would round up to inf).
__device__ __forceinline__ void split(float x, u32& hi, u32& lo) {
    hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    lo = (__float_as_uint(x - __uint_as_float(hi)) + 0x1000u) & 0xffffe000u;
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a . b in 3xTF32, the small terms first
__device__ __forceinline__ void mma3(float (&c)[4], const u32 (&ah)[4], const u32 (&al)[4],
                                     u32 bh0, u32 bh1, u32 bl0, u32 bl1) {
    mma_tf32(c, al, bh0, bh1);
    mma_tf32(c, ah, bl0, bl1);
    mma_tf32(c, ah, bh0, bh1);
}

// the A fragment of rows r0 .. r0 + 15, columns k0 .. k0 + 7 of a row-major tile (stride ld),
// split
__device__ __forceinline__ void a_frag(const float* m, int ld, int r0, int k0, int g, int t,
                                       u32 (&hi)[4], u32 (&lo)[4]) {
    const float* p = m + (r0 + g) * ld + k0 + t;
    split(p[0], hi[0], lo[0]);
    split(p[8 * ld], hi[1], lo[1]);
    split(p[4], hi[2], lo[2]);
    split(p[8 * ld + 4], hi[3], lo[3]);
}

// the B fragment (rows k0 .. k0 + 7, columns n0 .. n0 + 7) of a split [rows][SPAD] pair of planes
struct BFrag {
    u32 h0, h1, l0, l1;
};
__device__ __forceinline__ BFrag b_frag(const u32* hi, const u32* lo, int k0, int n0, int g,
                                        int t) {
    const int at = (k0 + t) * SPAD + n0 + g;
    return {hi[at], hi[at + 4 * SPAD], lo[at], lo[at + 4 * SPAD]};
}

// rows r, r + 8 of a C fragment (columns c, c + 1) into the split planes
__device__ __forceinline__ void store_split(u32* hi, u32* lo, int r, int c, const float (&v)[4]) {
    u32 h[4], l[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) split(v[e], h[e], l[e]);
    *reinterpret_cast<uint2*>(hi + r * SPAD + c) = make_uint2(h[0], h[1]);
    *reinterpret_cast<uint2*>(lo + r * SPAD + c) = make_uint2(l[0], l[1]);
    *reinterpret_cast<uint2*>(hi + (r + 8) * SPAD + c) = make_uint2(h[2], h[3]);
    *reinterpret_cast<uint2*>(lo + (r + 8) * SPAD + c) = make_uint2(l[2], l[3]);
}

// acc[i] += rows of tile (row tiles m[0], m[1]) of a [CHUNK][ld] row-major A times the split
// B planes, over k-steps 0 .. steps[i] - 1, column tile n0
__device__ __forceinline__ void rows_times(float (&acc)[2][4], const float* a, int ld,
                                           const int (&m)[2], const int (&steps)[2],
                                           const u32* bh, const u32* bl, int n0, int g, int t) {
#pragma unroll 2
    for (int ks = 0; ks < steps[1]; ++ks) {  // steps[0] <= steps[1]
        const BFrag b = b_frag(bh, bl, 8 * ks, n0, g, t);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            if (ks < steps[i]) {
                u32 ah[4], al[4];
                a_frag(a, ld, 16 * m[i], 8 * ks, g, t, ah, al);
                mma3(acc[i], ah, al, b.h0, b.h1, b.l0, b.l1);
            }
        }
    }
}

// the lower part of a [CHUNK][CHUNK] matrix that the triangular products read (row i: columns
// up to its 16-row tile's end; zeros past the diagonal as stored) into dst [CHUNK][CPAD]
__device__ __forceinline__ void load_tiles_lower(float* dst, const float* src, int tid) {
    for (int e = tid; e < CC / 4; e += TC_THREADS) {
        const int i = e / (CHUNK / 4), j = 4 * (e % (CHUNK / 4));
        if (j < 16 * (i / 16 + 1)) st4(dst + i * CPAD + j, ld4(src + i * CHUNK + j));
    }
}

extern "C" __global__ void __launch_bounds__(TC_THREADS, 2)
    delta_scan_tc(const float* __restrict__ y, const float* __restrict__ prep,
                  float* __restrict__ ssm, float* __restrict__ out, int T, int n_k_heads,
                  int n_v_heads, int slot) {
    grid_sync();
    extern __shared__ float4 smem4[];
    float* buf = reinterpret_cast<float*>(smem4);  // [CHUNK][KPAD] k rows, then q rows
    float* mat = buf + CHUNK * KPAD;               // [CHUNK][CPAD] M, then Aqk
    u32* s_hi = reinterpret_cast<u32*>(mat + CHUNK * CPAD);  // [HEAD_DIM][SPAD] S entering
    u32* s_lo = s_hi + HEAD_DIM * SPAD;
    u32* r_hi = s_lo + HEAD_DIM * SPAD;  // [CHUNK][SPAD] R, then V'
    u32* r_lo = r_hi + CHUNK * SPAD;
    float* ein = reinterpret_cast<float*>(r_lo + CHUNK * SPAD);  // [CHUNK] exp(G_i)
    float* eout = ein + CHUNK;                                   // [CHUNK] exp(G_last - G_i)
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const int h = blockIdx.y, col0 = blockIdx.x * TC_COLS;
    const int kh = h / (n_v_heads / n_k_heads);
    const long long C = (long long)(2 * n_k_heads + n_v_heads) * HEAD_DIM;
    const int n_chunks = (T + CHUNK - 1) / CHUNK;
    // [C, cols] products: column tile n0, row tiles m[0] (the short one in P2 / P3) and m[1]
    const int n0 = 8 * (warp % 4), pa = warp / 4;
    const int m[2] = {pa, 3 - pa};
    const int full[2] = {HEAD_DIM / 8, HEAD_DIM / 8}, tri[2] = {2 * (pa + 1), 2 * (4 - pa)};
    // S: rows 16 warp + g (+ 8), columns 8 nt + 2 t (+ 1) of this CTA's, as P4's C fragments
    float* S = ssm + ((long long)slot * n_v_heads + h) * HEAD_DIM * HEAD_DIM + col0;
    const int sr = 16 * warp + g;
    float s[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
        const float2 top = *reinterpret_cast<const float2*>(S + sr * HEAD_DIM + 8 * nt + 2 * t);
        const float2 bot =
            *reinterpret_cast<const float2*>(S + (sr + 8) * HEAD_DIM + 8 * nt + 2 * t);
        s[nt][0] = top.x, s[nt][1] = top.y, s[nt][2] = bot.x, s[nt][3] = bot.y;
        store_split(s_hi, s_lo, sr, 8 * nt + 2 * t, s[nt]);
    }
    for (int ci = 0; ci < n_chunks; ++ci) {
        const int c0 = ci * CHUNK, n = min(CHUNK, T - c0);
        const float* rows = y + (long long)c0 * C;
        const float* pc = prep + ((long long)h * n_chunks + ci) * CHUNK_FLOATS;
        load_rows(buf, rows + (long long)(n_k_heads + kh) * HEAD_DIM, C, n, tid, TC_THREADS);
        load_tiles_lower(mat, pc, tid);
        if (tid < 2 * CHUNK) ein[tid] = pc[2 * CC + tid];  // ein, eout are contiguous
        // V at this thread's rows of R (16 m[i] + g, + 8), fetched before the barrier so that
        // P1's products hide the loads' latency
        float2 v[2][2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r = 16 * m[i] + g;
            const float* vrow = rows + (2 * n_k_heads + h) * HEAD_DIM + col0 + n0 + 2 * t;
            v[i][0] = r < n ? *reinterpret_cast<const float2*>(vrow + r * C)
                            : make_float2(0.0f, 0.0f);
            v[i][1] = r + 8 < n ? *reinterpret_cast<const float2*>(vrow + (r + 8) * C)
                                : make_float2(0.0f, 0.0f);
        }
        __syncthreads();
        {  // P1: R = V - diag(exp(G)) K S
            float acc[2][4] = {};
            rows_times(acc, buf, KPAD, m, full, s_hi, s_lo, n0, g, t);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int r = 16 * m[i] + g;
                const float e0 = ein[r], e1 = ein[r + 8];
                const float rv[4] = {
                    fmaf(-e0, acc[i][0], v[i][0].x), fmaf(-e0, acc[i][1], v[i][0].y),
                    fmaf(-e1, acc[i][2], v[i][1].x), fmaf(-e1, acc[i][3], v[i][1].y)};
                store_split(r_hi, r_lo, r, n0 + 2 * t, rv);
            }
        }
        __syncthreads();
        float vn[2][4] = {};  // P2: V' = M R
        rows_times(vn, mat, CPAD, m, tri, r_hi, r_lo, n0, g, t);
        __syncthreads();  // every read of R is done: V' takes its place
#pragma unroll
        for (int i = 0; i < 2; ++i) store_split(r_hi, r_lo, 16 * m[i] + g, n0 + 2 * t, vn[i]);
        __syncthreads();
        {  // P4: S' = exp(G_last) S + (K diag(exp(G_last - G)))^T V', into s
            const float elast = ein[CHUNK - 1];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[nt][e] = __fmul_rn(elast, s[nt][e]);
#pragma unroll 2
            for (int ks = 0; ks < CHUNK / 8; ++ks) {
                const int j = 8 * ks + t;
                const float d0 = eout[j], d1 = eout[j + 4];
                u32 ah[4], al[4];  // A [d_k, C] = K^T diag(..): a0 = K[j][sr], a1 = K[j][sr + 8]
                split(__fmul_rn(buf[j * KPAD + sr], d0), ah[0], al[0]);
                split(__fmul_rn(buf[j * KPAD + sr + 8], d0), ah[1], al[1]);
                split(__fmul_rn(buf[(j + 4) * KPAD + sr], d1), ah[2], al[2]);
                split(__fmul_rn(buf[(j + 4) * KPAD + sr + 8], d1), ah[3], al[3]);
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    const BFrag b = b_frag(r_hi, r_lo, 8 * ks, 8 * nt, g, t);
                    mma3(s[nt], ah, al, b.h0, b.h1, b.l0, b.l1);
                }
            }
        }
        __syncthreads();  // k rows and M read by all: q rows and Aqk replace them
        load_rows(buf, rows + (long long)kh * HEAD_DIM, C, n, tid, TC_THREADS);
        load_tiles_lower(mat, pc + CC, tid);
        __syncthreads();
        {  // P3: O = diag(exp(G)) Q S + Aqk V' (S still the entering state in s_hi / s_lo)
            float acc[2][4] = {};
            rows_times(acc, buf, KPAD, m, full, s_hi, s_lo, n0, g, t);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int r = 16 * m[i] + g;
                const float e0 = ein[r], e1 = ein[r + 8];
                acc[i][0] = __fmul_rn(acc[i][0], e0), acc[i][1] = __fmul_rn(acc[i][1], e0);
                acc[i][2] = __fmul_rn(acc[i][2], e1), acc[i][3] = __fmul_rn(acc[i][3], e1);
            }
            rows_times(acc, mat, CPAD, m, tri, r_hi, r_lo, n0, g, t);
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int r = 16 * m[i] + g, c = col0 + n0 + 2 * t;
                float* o = out + ((long long)(c0 + r) * n_v_heads + h) * HEAD_DIM + c;
                if (r < n) *reinterpret_cast<float2*>(o) = make_float2(acc[i][0], acc[i][1]);
                if (r + 8 < n)
                    *reinterpret_cast<float2*>(o + 8LL * n_v_heads * HEAD_DIM) =
                        make_float2(acc[i][2], acc[i][3]);
            }
        }
        __syncthreads();  // every read of the entering S, q rows, Aqk and ein / eout is done
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) store_split(s_hi, s_lo, sr, 8 * nt + 2 * t, s[nt]);
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
        *reinterpret_cast<float2*>(S + sr * HEAD_DIM + 8 * nt + 2 * t) =
            make_float2(s[nt][0], s[nt][1]);
        *reinterpret_cast<float2*>(S + (sr + 8) * HEAD_DIM + 8 * nt + 2 * t) =
            make_float2(s[nt][2], s[nt][3]);
    }
}
