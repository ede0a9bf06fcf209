// Gated DeltaNet prefill (qwen3next / qwen4exp linear attention) of one session's prompt, float32:
// the causal conv with the q / k L2 norms, then the chunked gated delta rule of
// mgserve.core.reference.deltanet.delta_rule_chunked (same chunks of CHUNK tokens, same algebra).
// One session per launch, so nothing depends on any other session; every sum has a fixed order,
// so two runs give the same bits.
//
// Channel layout of qkv / y (llama.cpp's attn_qkv rows), C = (2 Hk + Hv) d:
//   [q (Hk key heads of d) | k (Hk key heads) | v (Hv value heads)]; value head h reads key head
//   h / (Hv / Hk).
//
// conv_prefill_f32: grid (ceil(T / CONV_TOKENS), 2 Hk + Hv), block HEAD_DIM (thread = channel).
//   y[t, c] = silu(sum_j w[c, j] x[t - K + 1 + j, c]) (inputs before the prompt from the slot's
//   conv state), then per token and head: q rows x rsqrt(|q|^2 + eps) * q_scale, k rows
//   x rsqrt(|k|^2 + eps), v rows as they are. The CTAs of the first token tile, which alone read
//   the old conv state, write the new one (the last K - 1 inputs) after reading it.
//
// The delta rule, per value head h and chunk of C = CHUNK tokens i (decay G_i = sum of g up to i
// inside the chunk, beta_i, k_i, q_i, v_i; S the d_k x d_v state entering the chunk):
//   A[i, j]   = beta_i (k_i . k_j) exp(G_i - G_j)         j < i  (the UT system is I + A)
//   M         = (I + A)^-1 diag(beta)                       lower triangular
//   Aqk[i, j] = (q_i . k_j) exp(G_i - G_j)                 j <= i
//   V'        = M (V - diag(exp(G)) K S)                    corrected values [C, d_v]
//   O         = diag(exp(G)) Q S + Aqk V'
//   S        <- exp(G_last) S + (diag(exp(G_last - G)) K)^T V'
// (V' = U - W S of the reference with U = M V, W = M diag(exp(G)) K.) M, Aqk and the decays depend
// on k, q, g, beta only, so:
//
// delta_prep_f32: grid (n_chunks, Hk), block PREP_THREADS; all chunks in parallel. K K^T and Q K^T
//   once per key head, then for each of its value heads (PREP_HEADS at a time): the cumulative log
//   decays in float64, differences taken in float64 and rounded to float before expf (as the
//   torch version: exp(G_i - G_j) stays accurate for long chunks with strong decay, and only
//   differences <= 0 are exponentiated), A in shared memory, M by forward substitution (one
//   thread per column of the inverse, the column in registers), Aqk; written to prep
//   [Hv, n_chunks, CHUNK_FLOATS] = (M [C][C], Aqk [C][C], exp(G) [C], exp(G_last - G) [C]).
//
// delta_scan_f32: grid (HEAD_DIM / SCAN_COLS, Hv), block SCAN_THREADS; the chunks of one head in
//   order. Columns of S are independent given k, g, beta, so each CTA owns SCAN_COLS columns of
//   S (registers, with a shared-memory copy the products read) and runs the four products above
//   on its columns. Thread (rg = tid / SCAN_CG, cg = tid % SCAN_CG) owns columns 4 cg .. 4 cg + 3,
//   rows rg + SCAN_RG b of the [C, cols] products and rows SCAN_SROWS rg + a of S (32 columns:
//   rows rg, rg + 32 and 4 rg .. 4 rg + 3; 16 columns: row rg and 2 rg, 2 rg + 1). Each value's
//   sums run in the same order for either width, so both give the same bits. fp32 FMA on the
//   SIMT cores throughout; a chunk's k / q rows and M / Aqk are loaded between the products, not
//   overlapped with them (the second CTA on the SM hides part of it).
//
// Padding: rows of the last chunk past the prompt are zero (k = q = v = 0, g = 0, beta = 0), which
// changes nothing: they write nothing into S and read nothing (as the torch version pads).

#ifndef CONV_K
#define CONV_K 4
#endif
#include "deltanet_chunked.cuh"
#include "math.cuh"
#include "pdl.cuh"

#define CONV_TOKENS 16                     // tokens per CTA of conv_prefill_f32
#define PREP_THREADS 256
#define PREP_HEADS (PREP_THREADS / CHUNK)  // value heads solved at once (a thread per column)
#define SCAN_THREADS 256
#ifndef SCAN_COLS
#define SCAN_COLS 32  // state columns per CTA of delta_scan_f32: 32 (2 CTAs an SM) or 16 (3)
#endif
#define SCAN_CG (SCAN_COLS / 4)           // column groups of 4 (a thread's columns)
#define SCAN_RG (SCAN_THREADS / SCAN_CG)  // row groups
#define SCAN_ROWS (CHUNK / SCAN_RG)       // rows of a [CHUNK, cols] product a thread
#define SCAN_SROWS (HEAD_DIM / SCAN_RG)   // rows of S a thread
#define SCAN_MIN_CTAS (SCAN_COLS == 32 ? 2 : 3)

// Dynamic shared memory in bytes; the wrapper passes the same numbers (PREP_SMEM, SCAN_SMEM).
#define PREP_KQ_FLOATS \
    (2 * KPAD > PREP_HEADS * CPAD ? 2 * CHUNK * KPAD : PREP_HEADS * CHUNK * CPAD)
#define PREP_SMEM_BYTES ((PREP_KQ_FLOATS + 2 * CHUNK * CPAD) * 4 + PREP_HEADS * CHUNK * (8 + 4 + 4))
#define SCAN_SMEM_BYTES                                                                  \
    ((CHUNK * KPAD + CHUNK * CPAD + HEAD_DIM * SCAN_COLS + 2 * CHUNK * SCAN_COLS + 2 * CHUNK) * 4)
#if defined(PREP_SMEM) && defined(SCAN_SMEM)
static_assert(PREP_SMEM == PREP_SMEM_BYTES && SCAN_SMEM == SCAN_SMEM_BYTES,
              "the wrapper's shared memory sizes differ from the kernels' layout");
#endif
static_assert(HEAD_DIM == 128, "the scan's thread mapping is written for head_dim 128");
static_assert(CONV_K - 1 <= CONV_TOKENS, "only the first token tile reads the conv state");
static_assert(SCAN_THREADS == 256 && (SCAN_COLS == 32 || SCAN_COLS == 16), "scan mapping");
static_assert(SCAN_ROWS * SCAN_RG == CHUNK && SCAN_SROWS * SCAN_RG == HEAD_DIM, "scan mapping");

// acc + a * b, component-wise (a scalar)
__device__ __forceinline__ float4 fma4(float a, float4 b, float4 acc) {
    return make_float4(fmaf(a, b.x, acc.x), fmaf(a, b.y, acc.y), fmaf(a, b.z, acc.z),
                       fmaf(a, b.w, acc.w));
}

// acc + a . b, summed x, y, z, w
__device__ __forceinline__ float dot4(float4 a, float4 b, float acc) {
    return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, fmaf(a.x, b.x, acc))));
}

// acc + a[0..3] . rows b0..b3 (a [1 x 4] times a [4 x 4] block)
__device__ __forceinline__ float4 mac4(float4 a, float4 b0, float4 b1, float4 b2, float4 b3,
                                       float4 acc) {
    return fma4(a.w, b3, fma4(a.z, b2, fma4(a.y, b1, fma4(a.x, b0, acc))));
}

extern "C" __global__ void __launch_bounds__(HEAD_DIM)
    conv_prefill_f32(const float* __restrict__ qkv, float* __restrict__ conv,
                     const float* __restrict__ w, float* __restrict__ y, int T, int n_k_heads,
                     int n_v_heads, int slot, float eps, float q_scale) {
    grid_sync();
    __shared__ float tile[CONV_TOKENS][HEAD_DIM];
    __shared__ float inv_norm[CONV_TOKENS];
    const int i = threadIdx.x, head = blockIdx.y, t0 = blockIdx.x * CONV_TOKENS;
    const int n = min(CONV_TOKENS, T - t0);
    const long long C = (long long)(2 * n_k_heads + n_v_heads) * HEAD_DIM;
    const long long c = (long long)head * HEAD_DIM + i;
    float* st = conv + (long long)slot * (CONV_K - 1) * C + c;
    float wc[CONV_K];
#pragma unroll
    for (int j = 0; j < CONV_K; ++j) wc[j] = w[c * CONV_K + j];
    float xp[CONV_K];  // the window, oldest first; xp[0..K-2]: inputs t0 - K + 1 .. t0 - 1
    float old[CONV_K];  // the conv state before the prompt (first token tile only)
#pragma unroll
    for (int j = 0; j < CONV_K - 1; ++j) {
        const int t = t0 - (CONV_K - 1) + j;
        old[j] = t < 0 ? st[(long long)j * C] : 0.0f;
        xp[j] = t < 0 ? old[j] : qkv[t * C + c];
    }
#pragma unroll
    for (int r = 0; r < CONV_TOKENS; ++r) {
        if (r < n) {
            xp[CONV_K - 1] = qkv[(t0 + r) * C + c];
            float acc = 0.0f;
#pragma unroll
            for (int j = 0; j < CONV_K; ++j) acc = __fadd_rn(acc, __fmul_rn(wc[j], xp[j]));
            tile[r][i] = silu(acc);
#pragma unroll
            for (int j = 0; j < CONV_K - 1; ++j) xp[j] = xp[j + 1];
        }
    }
    if (blockIdx.x == 0) {  // new state: the last K - 1 inputs of [old state | prompt]
#pragma unroll
        for (int j = 0; j < CONV_K - 1; ++j) {
            const int src = j + T;  // index into [old (K - 1) | prompt (T)]
            float v = src >= CONV_K - 1 ? qkv[(long long)(src - (CONV_K - 1)) * C + c] : 0.0f;
#pragma unroll
            for (int m = 0; m < CONV_K - 1; ++m) v = m == src ? old[m] : v;  // no local memory
            st[(long long)j * C] = v;
        }
    }
    const bool is_q = head < n_k_heads, is_k = !is_q && head < 2 * n_k_heads;
    if (is_q || is_k) {  // block-uniform branch
        __syncthreads();
        const int warp = i / 32, lane = i % 32;
        for (int r = warp; r < n; r += HEAD_DIM / 32) {
            float ss = 0.0f;
            for (int e = lane; e < HEAD_DIM; e += 32) ss = fmaf(tile[r][e], tile[r][e], ss);
            ss = warp_sum(ss);
            if (lane == 0) inv_norm[r] = rsqrtf(ss + eps);
        }
        __syncthreads();
    }
    for (int r = 0; r < n; ++r) {
        float v = tile[r][i];
        if (is_q) v = __fmul_rn(__fmul_rn(v, inv_norm[r]), q_scale);
        if (is_k) v = __fmul_rn(v, inv_norm[r]);
        y[(t0 + r) * C + c] = v;
    }
}

extern "C" __global__ void __launch_bounds__(PREP_THREADS, 2)
    delta_prep_f32(const float* __restrict__ y, const float* __restrict__ g,
                   const float* __restrict__ beta, float* __restrict__ prep, int T, int n_k_heads,
                   int n_v_heads) {
    grid_sync();
    extern __shared__ float4 smem4[];
    float* kq = reinterpret_cast<float*>(smem4);  // [2][CHUNK][KPAD] k, q rows; later A [heads]
    float* kk = kq + PREP_KQ_FLOATS;              // [CHUNK][CPAD] k_i . k_j
    float* qk = kk + CHUNK * CPAD;                // [CHUNK][CPAD] q_i . k_j
    double* cum = reinterpret_cast<double*>(qk + CHUNK * CPAD);  // [PREP_HEADS][CHUNK]
    float* bt = reinterpret_cast<float*>(cum + PREP_HEADS * CHUNK);  // [PREP_HEADS][CHUNK] beta
    float* gs = bt + PREP_HEADS * CHUNK;                             // [PREP_HEADS][CHUNK] g
    const int tid = threadIdx.x, ci = blockIdx.x, kh = blockIdx.y;
    const int n_chunks = gridDim.x, c0 = ci * CHUNK, n = min(CHUNK, T - c0);
    const long long C = (long long)(2 * n_k_heads + n_v_heads) * HEAD_DIM;
    const float* rows = y + (long long)c0 * C;
    load_rows(kq, rows + (long long)(n_k_heads + kh) * HEAD_DIM, C, n, tid, PREP_THREADS);
    load_rows(kq + CHUNK * KPAD, rows + (long long)kh * HEAD_DIM, C, n, tid, PREP_THREADS);
    __syncthreads();
    {  // kk = K K^T, qk = Q K^T: thread owns rows rg + 16 a, columns cg + 16 b (a, b < 4)
        const int rg = tid % 16, cg = tid / 16;
        const float *ks = kq, *qs = kq + CHUNK * KPAD;
        float akk[4][4], aqk[4][4];
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) akk[a][b] = aqk[a][b] = 0.0f;
#pragma unroll 2
        for (int e = 0; e < HEAD_DIM; e += 4) {
            float4 kr[4], qr[4], kc[4];
#pragma unroll
            for (int a = 0; a < 4; ++a) {
                kr[a] = ld4(ks + (rg + 16 * a) * KPAD + e);
                qr[a] = ld4(qs + (rg + 16 * a) * KPAD + e);
                kc[a] = ld4(ks + (cg + 16 * a) * KPAD + e);
            }
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int b = 0; b < 4; ++b) {
                    akk[a][b] = dot4(kr[a], kc[b], akk[a][b]);
                    aqk[a][b] = dot4(qr[a], kc[b], aqk[a][b]);
                }
        }
#pragma unroll
        for (int a = 0; a < 4; ++a)
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                kk[(rg + 16 * a) * CPAD + cg + 16 * b] = akk[a][b];
                qk[(rg + 16 * a) * CPAD + cg + 16 * b] = aqk[a][b];
            }
    }
    __syncthreads();  // k, q rows are dead: their space holds the systems A from here on
    const int r = n_v_heads / n_k_heads;
    for (int h0 = 0; h0 < r; h0 += PREP_HEADS) {
        const int nh = min(PREP_HEADS, r - h0), hbase = kh * r + h0;
        for (int e = tid; e < nh * CHUNK; e += PREP_THREADS) {
            const long long at = (long long)(c0 + e % CHUNK) * n_v_heads + hbase + e / CHUNK;
            bt[e] = e % CHUNK < n ? beta[at] : 0.0f;
            gs[e] = e % CHUNK < n ? g[at] : 0.0f;
        }
        __syncthreads();
        if (tid < nh) {  // cumulative log decay in float64, a fixed left-to-right sum
            double s = 0.0;
            for (int i = 0; i < CHUNK; ++i) {
                s += (double)gs[tid * CHUNK + i];
                cum[tid * CHUNK + i] = s;
            }
        }
        __syncthreads();
        for (int e = tid; e < nh * CHUNK; e += PREP_THREADS) {
            const int hh = e / CHUNK, i = e % CHUNK;
            const double* cu = cum + hh * CHUNK;
            float* out = prep + ((long long)(hbase + hh) * n_chunks + ci) * CHUNK_FLOATS + 2 * CC;
            out[i] = expf((float)cu[i]);
            out[CHUNK + i] = expf((float)(cu[CHUNK - 1] - cu[i]));
        }
        for (int e = tid; e < nh * CC; e += PREP_THREADS) {
            const int hh = e / CC, i = (e % CC) / CHUNK, j = e % CHUNK;
            const double* cu = cum + hh * CHUNK;
            const float dec = j <= i ? expf((float)(cu[i] - cu[j])) : 0.0f;
            const float a = __fmul_rn(__fmul_rn(kk[i * CPAD + j], dec), bt[hh * CHUNK + i]);
            kq[(hh * CHUNK + i) * CPAD + j] = j < i ? a : 0.0f;
            float* aqk = prep + ((long long)(hbase + hh) * n_chunks + ci) * CHUNK_FLOATS + CC;
            aqk[i * CHUNK + j] = j <= i ? __fmul_rn(qk[i * CPAD + j], dec) : 0.0f;
        }
        __syncthreads();
        // column j of X = (I + A)^-1 per thread: X[i, j] = [i == j] - A[i, :i] X[:i, j]
        if (tid < nh * CHUNK) {
            const int hh = tid / CHUNK, j = tid % CHUNK;
            const float* a = kq + hh * CHUNK * CPAD;
            float x[CHUNK];
#pragma unroll
            for (int i = 0; i < CHUNK; ++i) {
                float s0 = 0.0f, s1 = 0.0f;  // two chains, summed at the end
#pragma unroll
                for (int m = 0; m + 4 <= i; m += 4) {
                    const float4 av = ld4(a + i * CPAD + m);
                    s0 = fmaf(av.y, x[m + 1], fmaf(av.x, x[m], s0));
                    s1 = fmaf(av.w, x[m + 3], fmaf(av.z, x[m + 2], s1));
                }
#pragma unroll
                for (int m = i & ~3; m < i; ++m) s0 = fmaf(a[i * CPAD + m], x[m], s0);
                x[i] = (i == j ? 1.0f : 0.0f) - (s0 + s1);
            }
            float* m_out = prep + ((long long)(hbase + hh) * n_chunks + ci) * CHUNK_FLOATS;
            const float bj = bt[hh * CHUNK + j];
#pragma unroll
            for (int i = 0; i < CHUNK; ++i) m_out[i * CHUNK + j] = __fmul_rn(x[i], bj);
        }
        __syncthreads();  // before the next heads overwrite cum, bt and A
    }
}

// the lower triangle of a [CHUNK][CHUNK] matrix (granules of 4 columns that hold an element on or
// below the diagonal: the kernels that read it stop at that granule) into dst [CHUNK][CPAD]
__device__ __forceinline__ void load_lower(float* dst, const float* src, int tid) {
    for (int e = tid; e < CC / 4; e += SCAN_THREADS) {
        const int i = e / (CHUNK / 4), j = 4 * (e % (CHUNK / 4));
        if (j <= i) st4(dst + i * CPAD + j, ld4(src + i * CHUNK + j));
    }
}

// p[b] = rows rg + SCAN_RG b of buf [CHUNK][KPAD] times s [HEAD_DIM][SCAN_COLS], columns
// cg4 .. + 3
__device__ __forceinline__ void rows_times_state(const float* buf, const float* s, int rg, int cg4,
                                                 float4 p[SCAN_ROWS]) {
#pragma unroll
    for (int b = 0; b < SCAN_ROWS; ++b) p[b] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
    for (int e = 0; e < HEAD_DIM; e += 4) {
        const float4 b0 = ld4(s + e * SCAN_COLS + cg4), b1 = ld4(s + (e + 1) * SCAN_COLS + cg4);
        const float4 b2 = ld4(s + (e + 2) * SCAN_COLS + cg4);
        const float4 b3 = ld4(s + (e + 3) * SCAN_COLS + cg4);
#pragma unroll
        for (int b = 0; b < SCAN_ROWS; ++b)
            p[b] = mac4(ld4(buf + (rg + SCAN_RG * b) * KPAD + e), b0, b1, b2, b3, p[b]);
    }
}

// acc + row i of the lower-triangular mat [CHUNK][CPAD] times x [CHUNK][SCAN_COLS], columns
// cg4 .. + 3 (granules of 4 up to the diagonal's, as load_lower stores them; zeros past it)
__device__ __forceinline__ float4 lower_row_times(const float* mat, const float* x, int i, int cg4,
                                                  float4 acc) {
    for (int j = 0; j <= i; j += 4)
        acc = mac4(ld4(mat + i * CPAD + j), ld4(x + j * SCAN_COLS + cg4),
                   ld4(x + (j + 1) * SCAN_COLS + cg4), ld4(x + (j + 2) * SCAN_COLS + cg4),
                   ld4(x + (j + 3) * SCAN_COLS + cg4), acc);
    return acc;
}

extern "C" __global__ void __launch_bounds__(SCAN_THREADS, SCAN_MIN_CTAS)
    delta_scan_f32(const float* __restrict__ y, const float* __restrict__ prep,
                   float* __restrict__ ssm, float* __restrict__ out, int T, int n_k_heads,
                   int n_v_heads, int slot) {
    grid_sync();
    extern __shared__ float4 smem4[];
    float* buf = reinterpret_cast<float*>(smem4);  // [CHUNK][KPAD] k rows, then q rows
    float* mat = buf + CHUNK * KPAD;               // [CHUNK][CPAD] M, then Aqk
    float* s_sm = mat + CHUNK * CPAD;              // [HEAD_DIM][SCAN_COLS] S entering the chunk
    float* rv = s_sm + HEAD_DIM * SCAN_COLS;       // [CHUNK][SCAN_COLS] V - diag(exp(G)) K S
    float* vn = rv + CHUNK * SCAN_COLS;            // [CHUNK][SCAN_COLS] V'
    float* ein = vn + CHUNK * SCAN_COLS;           // [CHUNK] exp(G_i)
    float* eout = ein + CHUNK;                     // [CHUNK] exp(G_last - G_i)
    const int tid = threadIdx.x, rg = tid / SCAN_CG, cg4 = 4 * (tid % SCAN_CG);
    const int h = blockIdx.y, col0 = blockIdx.x * SCAN_COLS;
    const int kh = h / (n_v_heads / n_k_heads);
    const long long C = (long long)(2 * n_k_heads + n_v_heads) * HEAD_DIM;
    const int n_chunks = (T + CHUNK - 1) / CHUNK;
    float* S = ssm + ((long long)slot * n_v_heads + h) * HEAD_DIM * HEAD_DIM + col0 + cg4;
    float4 s[SCAN_SROWS];  // S rows SCAN_SROWS rg + a, columns cg4 .. cg4 + 3 (of this CTA's)
#pragma unroll
    for (int a = 0; a < SCAN_SROWS; ++a) {
        s[a] = ld4(S + (SCAN_SROWS * rg + a) * HEAD_DIM);
        st4(s_sm + (SCAN_SROWS * rg + a) * SCAN_COLS + cg4, s[a]);
    }
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int ci = 0; ci < n_chunks; ++ci) {
        const int c0 = ci * CHUNK, n = min(CHUNK, T - c0);
        const float* rows = y + (long long)c0 * C;
        const float* pc = prep + ((long long)h * n_chunks + ci) * CHUNK_FLOATS;
        load_rows(buf, rows + (long long)(n_k_heads + kh) * HEAD_DIM, C, n, tid, SCAN_THREADS);
        load_lower(mat, pc, tid);
        if (tid < 2 * CHUNK) ein[tid] = pc[2 * CC + tid];  // ein, eout are contiguous
        float4 v[SCAN_ROWS];  // v of rows rg + SCAN_RG b
#pragma unroll
        for (int b = 0; b < SCAN_ROWS; ++b) {
            const int i = rg + SCAN_RG * b;
            v[b] = i < n ? ld4(rows + (2 * n_k_heads + h) * HEAD_DIM + i * C + col0 + cg4) : zero;
        }
        __syncthreads();
        {  // rv = V - diag(exp(G)) K S
            float4 p[SCAN_ROWS];
            rows_times_state(buf, s_sm, rg, cg4, p);
#pragma unroll
            for (int b = 0; b < SCAN_ROWS; ++b) {
                const int i = rg + SCAN_RG * b;
                st4(rv + i * SCAN_COLS + cg4, fma4(-ein[i], p[b], v[b]));
            }
        }
        __syncthreads();
#pragma unroll
        for (int b = 0; b < SCAN_ROWS; ++b) {  // V' = M rv
            const int i = rg + SCAN_RG * b;
            st4(vn + i * SCAN_COLS + cg4, lower_row_times(mat, rv, i, cg4, zero));
        }
        __syncthreads();
        float4 sn[SCAN_SROWS];  // K^T diag(exp(G_last - G)) V', rows SCAN_SROWS rg + a
#pragma unroll
        for (int a = 0; a < SCAN_SROWS; ++a) sn[a] = zero;
        for (int j = 0; j < CHUNK; ++j) {
            float kj[SCAN_SROWS];  // k_j's entries of this thread's rows of S
            if constexpr (SCAN_SROWS == 4) {
                const float4 k4 = ld4(buf + j * KPAD + 4 * rg);
                kj[0] = k4.x, kj[1] = k4.y, kj[2] = k4.z, kj[3] = k4.w;
            } else {
                const float2 k2 = *reinterpret_cast<const float2*>(buf + j * KPAD + 2 * rg);
                kj[0] = k2.x, kj[1] = k2.y;
            }
            const float4 vj = ld4(vn + j * SCAN_COLS + cg4);
            const float ej = eout[j];
            const float4 ve = make_float4(__fmul_rn(vj.x, ej), __fmul_rn(vj.y, ej),
                                          __fmul_rn(vj.z, ej), __fmul_rn(vj.w, ej));
#pragma unroll
            for (int a = 0; a < SCAN_SROWS; ++a) sn[a] = fma4(kj[a], ve, sn[a]);
        }
        const float elast = ein[CHUNK - 1];
#pragma unroll
        for (int a = 0; a < SCAN_SROWS; ++a) sn[a] = fma4(elast, s[a], sn[a]);  // the new S
        __syncthreads();  // k rows and M read by all: q rows and Aqk replace them
        load_rows(buf, rows + (long long)kh * HEAD_DIM, C, n, tid, SCAN_THREADS);
        load_lower(mat, pc + CC, tid);
        __syncthreads();
        {  // O = diag(exp(G)) Q S + Aqk V' (S still the entering state in s_sm)
            float4 p[SCAN_ROWS];
            rows_times_state(buf, s_sm, rg, cg4, p);
#pragma unroll
            for (int b = 0; b < SCAN_ROWS; ++b) {
                const int i = rg + SCAN_RG * b;
                const float ei = ein[i];
                const float4 q_s = make_float4(__fmul_rn(p[b].x, ei), __fmul_rn(p[b].y, ei),
                                               __fmul_rn(p[b].z, ei), __fmul_rn(p[b].w, ei));
                const float4 o = lower_row_times(mat, vn, i, cg4, q_s);
                float* o_row = out + ((long long)(c0 + i) * n_v_heads + h) * HEAD_DIM;
                if (i < n) st4(o_row + col0 + cg4, o);
            }
        }
        __syncthreads();  // every read of the entering S, q rows, Aqk and ein / eout is done
#pragma unroll
        for (int a = 0; a < SCAN_SROWS; ++a) {
            s[a] = sn[a];
            st4(s_sm + (SCAN_SROWS * rg + a) * SCAN_COLS + cg4, s[a]);
        }
    }
#pragma unroll
    for (int a = 0; a < SCAN_SROWS; ++a) st4(S + (SCAN_SROWS * rg + a) * HEAD_DIM, s[a]);
}
