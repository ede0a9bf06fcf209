// Gated DeltaNet decode (qwen3next / qwen4exp linear attention), one token per session, float32.
// Sessions b = 0..B-1 own state slots slots[b] (distinct); nothing depends on B or on the other
// sessions, so a session's results are the same alone or in a batch.
//
// Runs (speculation's verify rows, ops/chains.py): runs[b] (int32 [B], or null: every row alone)
// is the row count of the run starting at row b, 0 for a run's later rows. A run's rows share
// their slot and consecutive positions; the CTA(s) of its first row go through its rows in order,
// the state in registers between rows, each row with the single-row arithmetic (the same code),
// and store the state after the last row; the other rows' CTAs exit at once. So row r of a run
// gives bitwise what r + 1 single-row launches give.
//
// Channel layout of the conv input/output (llama.cpp's attn_qkv rows), C = (2 Hk + Hv) d:
//   [q (Hk key heads of d) | k (Hk key heads) | v (Hv value heads)]; value head h reads key head
//   h / (Hv / Hk).
//
// conv_step_f32 (CONV_K = conv width K):
//   y = silu(sum_j w[c, j] * xp[j]) with xp = [conv[slot, 0..K-2, c], x[b, c]] (oldest first),
//   then conv[slot, :, c] = xp[1..K-1].
//   Thread mapping: grid = (ceil(C / blockDim), B), one thread per (session, channel); loads of
//   the state rows are coalesced across the channel dimension.
//
// delta_step_f32 (HEAD_DIM = d = d_k = d_v):
//   q, k = L2-normalised key-head rows (eps inside the sqrt), q *= q_scale (d^-0.5);
//   S = ssm[slot, h] (d_k x d_v), a = exp(g[b, h]):
//     S <- a S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q.
//   Column j of S only ever meets column j. Thread mapping: grid = (ceil(d / 32), Hv, B), block
//   = (32, DELTA_SPLIT): lane t owns column j = blockIdx.x * 32 + t, warp w owns rows
//   [w * d / DELTA_SPLIT, (w + 1) * d / DELTA_SPLIT) of it, kept in registers. Each row of the
//   state is read and written as one 128-byte coalesced segment per warp, and the state crosses
//   memory exactly once each way. The two column sums (S^T k, S^T q) add the warps' partial sums
//   through shared memory in a fixed order (deterministic). Each warp L2-normalises q and k
//   itself (shuffle reductions) and stages its rows of them in shared memory.
//   delta_step_gates_f32: the same, g and beta made from their projections in place (the
//   arithmetic of delta_gates_f32; one launch fewer per layer).

#ifndef CONV_K
#define CONV_K 4
#endif
#ifndef CONV_VEC
#define CONV_VEC 1  // weight rows readable as one float4 (K == 4 and 16-byte aligned weight)
#endif
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef DELTA_SPLIT
#define DELTA_SPLIT 4  // warps per CTA, each owning HEAD_DIM / DELTA_SPLIT rows of the state
#endif
#include "math.cuh"
#include "pdl.cuh"

#define DELTA_COLS 32
#define DELTA_ROWS ((HEAD_DIM + DELTA_SPLIT - 1) / DELTA_SPLIT)

extern "C" __global__ void __launch_bounds__(128)
    conv_step_f32(const float* __restrict__ x, float* __restrict__ conv,
                  const int* __restrict__ slots, const float* __restrict__ w,
                  float* __restrict__ out, int C, const int* __restrict__ runs) {
    grid_sync();
    const int c = blockIdx.x * blockDim.x + threadIdx.x, b0 = blockIdx.y;
    if (c >= C) return;
    const int n = runs ? runs[b0] : 1;  // rows of the run starting here (0: a later row of one)
    if (n == 0) return;
    float* st = conv + (long long)slots[b0] * (CONV_K - 1) * C + c;
    float xp[CONV_K];
#pragma unroll
    for (int j = 0; j < CONV_K - 1; ++j) xp[j] = st[(long long)j * C];
    float wc[CONV_K];
    if (CONV_K == 4 && CONV_VEC) {  // one 16-byte load of the channel's weights
        float4 v = reinterpret_cast<const float4*>(w)[c];
        wc[0] = v.x;
        wc[1 % CONV_K] = v.y;
        wc[2 % CONV_K] = v.z;
        wc[3 % CONV_K] = v.w;
    } else {
#pragma unroll
        for (int j = 0; j < CONV_K; ++j) wc[j] = w[(long long)c * CONV_K + j];
    }
    for (int b = b0; b < b0 + n; ++b) {
        xp[CONV_K - 1] = x[(long long)b * C + c];
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < CONV_K; ++j) acc = __fadd_rn(acc, __fmul_rn(wc[j], xp[j]));
        out[(long long)b * C + c] = silu(acc);
#pragma unroll
        for (int j = 0; j < CONV_K - 1; ++j) xp[j] = xp[j + 1];  // the history after row b
    }
#pragma unroll
    for (int j = 0; j < CONV_K - 1; ++j) st[(long long)j * C] = xp[j];
}

// The gates of one (token, head) from its projections (delta_gates_f32 below).
__device__ __forceinline__ void delta_gate(float b, float alpha, float dt_bias, float a, float* g,
                                           float* beta) {
    const float x = __fadd_rn(alpha, dt_bias);
    const float sp = x > 20.0f ? x : log1pf(expf(x));
    *g = __fmul_rn(sp, a);
    *beta = sigmoid(b);
}

// Where delta_step reads a (token, head)'s gates: g and beta [B, Hv] (delta_gates_f32's output),
// or (RAW) the projections b, alpha (rows at n * b_stride, n * a_stride) with dt_bias and a [Hv],
// turned into gates in place (delta_step_gates_f32: one launch fewer, the same bits).
struct GateSource {
    const float *g, *beta, *b, *alpha, *dt_bias, *a;
    long long b_stride, a_stride;
};

template <bool RAW>
__device__ __forceinline__ void delta_step(const float* __restrict__ y, GateSource gs,
                                           float* __restrict__ ssm, const int* __restrict__ slots,
                                           float* __restrict__ out, int n_k_heads,
                                           int n_v_heads, float eps, float q_scale,
                                           const int* __restrict__ runs) {
    __shared__ float qs[HEAD_DIM], ks[HEAD_DIM];
    __shared__ float red_pred[DELTA_SPLIT][DELTA_COLS], red_out[DELTA_SPLIT][DELTA_COLS];
    const int t = threadIdx.x, wy = threadIdx.y, h = blockIdx.y, b0 = blockIdx.z;
    const int n = runs ? runs[b0] : 1;  // rows of the run starting here (0: a later row of one)
    if (n == 0) return;                  // uniform over the CTA
    const int col = blockIdx.x * DELTA_COLS + t;
    const bool active = col < HEAD_DIM;
    const int i0 = wy * DELTA_ROWS;  // this warp's rows: i0 .. i0 + DELTA_ROWS - 1 (< HEAD_DIM)
    const int kh = h / (n_v_heads / n_k_heads);
    const long long C = (long long)(2 * n_k_heads + n_v_heads) * HEAD_DIM;

    // Issue the loads of this thread's part of the state column first: they are the long pole.
    float* S = ssm + ((long long)slots[b0] * n_v_heads + h) * (HEAD_DIM * HEAD_DIM) + col;
    float s[DELTA_ROWS];
#pragma unroll
    for (int r = 0; r < DELTA_ROWS; ++r)
        s[r] = (active && i0 + r < HEAD_DIM) ? S[(i0 + r) * HEAD_DIM] : 0.0f;

    for (int b = b0; b < b0 + n; ++b) {  // the run's rows in order, the state in registers
        const float* yb = y + b * C;
        // q and k of key head kh, L2-normalised: x * rsqrt(sum(x^2) + eps). Every warp reduces
        // the whole rows itself (same order, same result) and stores its own rows' values.
        const float* qr = yb + kh * HEAD_DIM;
        const float* kr = yb + (long long)(n_k_heads + kh) * HEAD_DIM;
        float qq = 0.0f, kk = 0.0f;
        for (int i = t; i < HEAD_DIM; i += 32) {
            float a = qr[i], c = kr[i];
            qq += a * a;
            kk += c * c;
        }
        const float qn = rsqrtf(warp_sum(qq) + eps), kn = rsqrtf(warp_sum(kk) + eps);
        for (int i = i0 + t; i < i0 + DELTA_ROWS && i < HEAD_DIM; i += 32) {
            qs[i] = __fmul_rn(__fmul_rn(qr[i], qn), q_scale);
            ks[i] = __fmul_rn(kr[i], kn);
        }
        __syncwarp();

        float gv, bt;
        if (RAW) {
            delta_gate(gs.b[b * gs.b_stride + h], gs.alpha[b * gs.a_stride + h], gs.dt_bias[h],
                       gs.a[h], &gv, &bt);
        } else {
            gv = gs.g[b * n_v_heads + h];
            bt = gs.beta[b * n_v_heads + h];
        }
        const float a = expf(gv);
        float pred = 0.0f;  // this warp's rows of (a S)^T k, for column col
#pragma unroll
        for (int r = 0; r < DELTA_ROWS; ++r) {
            if (i0 + r < HEAD_DIM) {
                s[r] = __fmul_rn(s[r], a);
                pred = fmaf(s[r], ks[i0 + r], pred);
            }
        }
        red_pred[wy][t] = pred;
        __syncthreads();
        pred = 0.0f;
#pragma unroll
        for (int w = 0; w < DELTA_SPLIT; ++w) pred += red_pred[w][t];
        const float v = active ? yb[(long long)(2 * n_k_heads + h) * HEAD_DIM + col] : 0.0f;
        const float delta = __fmul_rn(__fsub_rn(v, pred), bt);
        float o = 0.0f;
#pragma unroll
        for (int r = 0; r < DELTA_ROWS; ++r) {
            if (i0 + r < HEAD_DIM) {
                s[r] = __fadd_rn(s[r], __fmul_rn(ks[i0 + r], delta));
                o = fmaf(s[r], qs[i0 + r], o);
            }
        }
        red_out[wy][t] = o;
        __syncthreads();
        if (wy == 0 && active) {
            o = 0.0f;
#pragma unroll
            for (int w = 0; w < DELTA_SPLIT; ++w) o += red_out[w][t];
            out[((long long)b * n_v_heads + h) * HEAD_DIM + col] = o;
        }
        __syncthreads();  // the next row rewrites qs, ks, red_pred and red_out
    }
#pragma unroll
    for (int r = 0; r < DELTA_ROWS; ++r)
        if (active && i0 + r < HEAD_DIM) S[(i0 + r) * HEAD_DIM] = s[r];
}

extern "C" __global__ void __launch_bounds__(DELTA_COLS * DELTA_SPLIT)
    delta_step_f32(const float* __restrict__ y, const float* __restrict__ g,
                   const float* __restrict__ beta, float* __restrict__ ssm,
                   const int* __restrict__ slots, float* __restrict__ out, int n_k_heads,
                   int n_v_heads, float eps, float q_scale, const int* __restrict__ runs) {
    grid_sync();
    const GateSource gs = {g, beta, nullptr, nullptr, nullptr, nullptr, 0, 0};
    delta_step<false>(y, gs, ssm, slots, out, n_k_heads, n_v_heads, eps, q_scale, runs);
}

// delta_step_f32 with the gates made from the projections inside (delta_gate): b, alpha rows at
// n * b_stride, n * a_stride (column halves of one [B, 2 Hv] product), dt_bias and a [Hv].
extern "C" __global__ void __launch_bounds__(DELTA_COLS * DELTA_SPLIT)
    delta_step_gates_f32(const float* __restrict__ y, const float* __restrict__ b,
                         long long b_stride, const float* __restrict__ alpha, long long a_stride,
                         const float* __restrict__ dt_bias, const float* __restrict__ a,
                         float* __restrict__ ssm, const int* __restrict__ slots,
                         float* __restrict__ out, int n_k_heads, int n_v_heads, float eps,
                         float q_scale, const int* __restrict__ runs) {
    grid_sync();
    const GateSource gs = {nullptr, nullptr, b, alpha, dt_bias, a, b_stride, a_stride};
    delta_step<true>(y, gs, ssm, slots, out, n_k_heads, n_v_heads, eps, q_scale, runs);
}

// delta_gates_f32: the per-head gates of one step's tokens from their projections:
//   g[n, h] = softplus(alpha[n, h] + dt_bias[h]) * a[h]  (log decay; softplus as ATen: x past 20
//   is x itself), beta[n, h] = sigmoid(b[n, h]) (write strength).
//   b row n at n * b_stride, alpha row n at n * a_stride (column slices of one [N, 2 Hv]
//   projection, or two tensors); g and beta contiguous [N, Hv]. One thread per (n, h).
extern "C" __global__ void __launch_bounds__(128)
    delta_gates_f32(const float* __restrict__ b, long long b_stride,
                    const float* __restrict__ alpha, long long a_stride,
                    const float* __restrict__ dt_bias, const float* __restrict__ a,
                    float* __restrict__ g, float* __restrict__ beta, int n, int hv) {
    grid_sync();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * hv) return;
    const int t = i / hv, h = i - t * hv;
    delta_gate(b[t * b_stride + h], alpha[t * a_stride + h], dt_bias[h], a[h], &g[i], &beta[i]);
}
