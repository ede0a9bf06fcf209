// RMSNorm (optionally gated) and RoPE (optionally after a per-head RMSNorm), float32.
//
// rms_norm_f32 / rms_norm_f32_v4:
//   y[r, i] = x[r, i] * rsqrt(mean_i(x[r, :]^2) + eps) * w[r % G, i]  (* act(z[r, i]))
//   Thread mapping: blockDim = (TPR, RPC). threadIdx.y picks one of the CTA's RPC rows
//   (row = blockIdx.x * RPC + threadIdx.y); the row's TPR threads (a multiple of 32, <= 256)
//   stride over its D values, float4 at a time in the _v4 entry (D % 4 == 0, 16-byte aligned
//   rows). Pass 1 sums squares (warp shuffles, then the row's warps through shared memory in a
//   fixed order: deterministic); pass 2 re-reads x (an L1 hit) and writes y.
//   x row r starts at r * x_stride; y is contiguous [rows, D]; the gate (mode 1 silu, 2 sigmoid)
//   z[r, i] sits at (r / z_group) * z_stride + (r % z_group) * D + i (DeltaNet: rows are
//   (token, value head), z is [N, H_v * d_v]). Optional: res [rows, D] added after the norm
//   (y = res + norm: a residual), and dest [z_group]: row r is written as row
//   (r / z_group) * z_group + dest[r % z_group] (DeltaNet value heads put in ssm_out's order).
//
// rms_norm_rope_f32:
//   Per (token n, head h): optional RMSNorm of x[n, h, :] with w [D], then rotary embedding of the
//   first n_rot dims (NeoX pairs i, i + n_rot/2; otherwise 2i, 2i + 1); dims >= n_rot copied.
//   Angle of pair i: theta = ((double)pos[n] * scale) * inv_freq[i] (inv_freq / freq_factors[i]
//   when given), in double as the reference computes it; cos and sin are rounded to float once.
//   Thread mapping: grid = (N, ceil(H / warps)), one warp per head. The CTA first computes the
//   token's n_rot/2 cos/sin pairs into shared memory (all threads), then each warp stages its
//   normalised head row in shared memory (pairs cross lanes) and writes the rotated row.
//   The rotation uses explicitly rounded products (no FMA contraction) so it rounds exactly as
//   the reference's x1 * cos - x2 * sin does.

#include "math.cuh"
#include "pdl.cuh"
#include "scalar.cuh"

#define MAX_ROW_WARPS 8  // 256 threads per row at most

// The gate of mode 1 (silu) or 2 (sigmoid).
__device__ __forceinline__ float gate_act(float z, int gate) {
    return gate == 1 ? silu(z) : sigmoid(z);
}

// The combined streams' rows (COMBINE): row r (token r / G, stream r % G) of x + inj[r] *
// out[r / G] (hc_combine's arithmetic), written to comb, whose rows then take x's place.
struct Combine {
    const float* out;  // [rows / G, D] the block output
    const float* inj;  // [rows] its inject weight for each row
    float* comb;       // [rows, D] the combined streams
};

template <bool VEC, bool Q8 = false, bool F16 = false, bool COMBINE = false>
__device__ __forceinline__ void rms_norm_row(const float* __restrict__ x, long long x_stride,
                                             const float* __restrict__ w, int n_groups,
                                             const float* __restrict__ z, int z_group,
                                             long long z_stride, const float* __restrict__ res,
                                             const int* __restrict__ dest, float* __restrict__ y,
                                             int n_rows, int D, float eps, int gate,
                                             signed char* __restrict__ xq = nullptr,
                                             float* __restrict__ xd = nullptr,
                                             u16* __restrict__ y16 = nullptr,
                                             Combine cb = {}) {
    static_assert(VEC || !COMBINE, "the combined rows are float4 rows");
    __shared__ float partial[32][MAX_ROW_WARPS];  // [row in CTA][warp in row]
    const int tpr = blockDim.x, t = threadIdx.x, ry = threadIdx.y;
    const int row = blockIdx.x * blockDim.y + ry;
    const bool live = row < n_rows;
    const float* xr = x + (live ? (long long)row * x_stride : 0);
    float ss = 0.0f;
    if (live) {
        if (VEC) {
            const float4* x4 = reinterpret_cast<const float4*>(xr);
            for (int i = t; i < D / 4; i += tpr) {
                float4 v = x4[i];
                if (COMBINE) {  // the combined row, written; pass 2 re-reads this thread's own
                    const float4 o = reinterpret_cast<const float4*>(cb.out)[
                        (long long)(row / n_groups) * (D / 4) + i];
                    v = combine4(v, cb.inj[row], o);
                    reinterpret_cast<float4*>(cb.comb)[(long long)row * (D / 4) + i] = v;
                }
                ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
            }
        } else {
            for (int i = t; i < D; i += tpr) ss += xr[i] * xr[i];
        }
    }
    ss = warp_sum(ss);
    const int n_warps = tpr / 32;
    if ((t & 31) == 0) partial[ry][t / 32] = ss;
    __syncthreads();
    if (!live) return;
    float total = 0.0f;
    for (int k = 0; k < n_warps; ++k) total += partial[ry][k];
    const float r = rsqrtf(total / (float)D + eps);
    const float* wr = w + (long long)(row % n_groups) * D;
    const float* zr = z ? z + (long long)(row / z_group) * z_stride + (long long)(row % z_group) * D
                        : nullptr;
    const long long out_row =
        dest ? (long long)(row / z_group) * z_group + dest[row % z_group] : (long long)row;
    const float* rr = res ? res + (long long)row * D : nullptr;
    float* yr = y + out_row * D;
    if (VEC) {
        const float4* x4 = reinterpret_cast<const float4*>(COMBINE ? cb.comb + (long long)row * D
                                                                   : xr);
        const float4* w4 = reinterpret_cast<const float4*>(wr);
        float4* y4 = reinterpret_cast<float4*>(yr);
        // with Q8 every lane runs each round (q8_store4 shuffles), live (on) or not
        for (int i = t; Q8 ? i - t < D / 4 : i < D / 4; i += tpr) {
            const bool on = i < D / 4;
            float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (on) {
                float4 v = x4[i], g = w4[i];
                o.x = __fmul_rn(__fmul_rn(v.x, r), g.x);
                o.y = __fmul_rn(__fmul_rn(v.y, r), g.y);
                o.z = __fmul_rn(__fmul_rn(v.z, r), g.z);
                o.w = __fmul_rn(__fmul_rn(v.w, r), g.w);
                if (zr) {
                    float4 zz = reinterpret_cast<const float4*>(zr)[i];
                    o.x *= gate_act(zz.x, gate);
                    o.y *= gate_act(zz.y, gate);
                    o.z *= gate_act(zz.z, gate);
                    o.w *= gate_act(zz.w, gate);
                }
                if (rr) {
                    float4 q = reinterpret_cast<const float4*>(rr)[i];
                    o.x = __fadd_rn(q.x, o.x);
                    o.y = __fadd_rn(q.y, o.y);
                    o.z = __fadd_rn(q.z, o.z);
                    o.w = __fadd_rn(q.w, o.w);
                }
                y4[i] = o;
                if (F16) store_f16x4(y16 + out_row * D + 4LL * i, o);
            }
            if (Q8) q8_store4(o, on, xq, xd, out_row * D + 4LL * (on ? i : 0));
        }
    } else {
        for (int i = t; i < D; i += tpr) {
            float o = __fmul_rn(__fmul_rn(xr[i], r), wr[i]);
            if (zr) o *= gate_act(zr[i], gate);
            if (rr) o = __fadd_rn(rr[i], o);
            yr[i] = o;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
    rms_norm_f32(const float* __restrict__ x, long long x_stride, const float* __restrict__ w,
                 int n_groups, const float* __restrict__ z, int z_group, long long z_stride,
                 const float* __restrict__ res, const int* __restrict__ dest,
                 float* __restrict__ y, int n_rows, int D, float eps, int gate) {
    grid_sync();
    rms_norm_row<false>(x, x_stride, w, n_groups, z, z_group, z_stride, res, dest, y, n_rows, D,
                        eps, gate);
}

extern "C" __global__ void __launch_bounds__(256)
    rms_norm_f32_v4(const float* __restrict__ x, long long x_stride, const float* __restrict__ w,
                    int n_groups, const float* __restrict__ z, int z_group, long long z_stride,
                    const float* __restrict__ res, const int* __restrict__ dest,
                    float* __restrict__ y, int n_rows, int D, float eps, int gate) {
    grid_sync();
    rms_norm_row<true>(x, x_stride, w, n_groups, z, z_group, z_stride, res, dest, y, n_rows, D,
                       eps, gate);
}

// cos / sin of the n_rot / 2 pairs at position pos (angles in double, rounded to float once)
// into cs, sn: the CTA's threads (x) share the pairs; the caller syncs before reading them.
__device__ __forceinline__ void rope_table(float* cs, float* sn, int pos, double scale,
                                           const double* __restrict__ inv_freq,
                                           const float* __restrict__ freq_factors, int half) {
    const double p = (double)pos * scale;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        double inv = inv_freq[i];
        if (freq_factors) inv = inv / (double)freq_factors[i];
        double s, c;
        sincos(p * inv, &s, &c);
        cs[i] = (float)c;
        sn[i] = (float)s;
    }
}

// Value i of the rotated head row (dims >= n_rot pass through).
__device__ __forceinline__ float rope_value(const float* row, const float* cs, const float* sn,
                                            int i, int n_rot, int neox) {
    if (i >= n_rot) return row[i];
    const int half = n_rot / 2;
    int j, first;  // pair index; whether i is the pair's first element
    float x1, x2;
    if (neox) {
        first = i < half;
        j = first ? i : i - half;
        x1 = row[j];
        x2 = row[j + half];
    } else {
        first = (i & 1) == 0;
        j = i >> 1;
        x1 = row[2 * j];
        x2 = row[2 * j + 1];
    }
    const float c = cs[j], s = sn[j];
    return first ? __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s))
                 : __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

// rms_norm_f32_v4 that also writes y rounded to int8 groups as quantize_q8 would (xq [rows * D]
// int8, xd [rows * D / 32]; D % 32 == 0): the int8 products of y skip their quantize launch.
extern "C" __global__ void __launch_bounds__(256)
    rms_norm_q8_f32_v4(const float* __restrict__ x, long long x_stride,
                       const float* __restrict__ w, int n_groups, const float* __restrict__ z,
                       int z_group, long long z_stride, const float* __restrict__ res,
                       const int* __restrict__ dest, float* __restrict__ y, int n_rows, int D,
                       float eps, int gate, signed char* __restrict__ xq,
                       float* __restrict__ xd) {
    grid_sync();
    rms_norm_row<true, true>(x, x_stride, w, n_groups, z, z_group, z_stride, res, dest, y,
                             n_rows, D, eps, gate, xq, xd);
}

// rms_norm_f32_v4 that also writes y rounded to f16 (y16 [rows * D], as y): the prompt GEMMs'
// copy of y (cuda/ops/f16_rows.py), so they skip its conversion.
extern "C" __global__ void __launch_bounds__(256)
    rms_norm_f16_f32_v4(const float* __restrict__ x, long long x_stride,
                        const float* __restrict__ w, int n_groups, const float* __restrict__ z,
                        int z_group, long long z_stride, const float* __restrict__ res,
                        const int* __restrict__ dest, float* __restrict__ y, int n_rows, int D,
                        float eps, int gate, u16* __restrict__ y16) {
    grid_sync();
    rms_norm_row<true, false, true>(x, x_stride, w, n_groups, z, z_group, z_stride, res, dest, y,
                                    n_rows, D, eps, gate, nullptr, nullptr, y16);
}

// A prompt mix's streams combined with the previous block's output, then normed, in one pass:
// comb = x + inj * out per (token, stream) row (hc_combine's bits: the new streams, [rows, D]),
// y = rms_norm_f32_v4 of comb with w [G, D] (G streams), y16 its f16 copy (or null).
extern "C" __global__ void __launch_bounds__(256)
    rms_norm_combine_f32_v4(const float* __restrict__ x, const float* __restrict__ w, int G,
                            const float* __restrict__ out, const float* __restrict__ inj,
                            float* __restrict__ comb, float* __restrict__ y, int n_rows, int D,
                            float eps, u16* __restrict__ y16) {
    grid_sync();
    const Combine cb = {out, inj, comb};
    if (y16)
        rms_norm_row<true, false, true, true>(x, D, w, G, nullptr, 1, 0, nullptr, nullptr, y,
                                              n_rows, D, eps, 0, nullptr, nullptr, y16, cb);
    else
        rms_norm_row<true, false, false, true>(x, D, w, G, nullptr, 1, 0, nullptr, nullptr, y,
                                               n_rows, D, eps, 0, nullptr, nullptr, nullptr, cb);
}

// x [N, H, D] with strides (x_sn, x_sh, 1); w [D] or null (no norm); y [N, H, D] contiguous;
// pos [N] int32; inv_freq [n_rot / 2] double; freq_factors [n_rot / 2] float or null.
// Dynamic shared memory: (n_rot + warps * D) floats.
extern "C" __global__ void __launch_bounds__(256)
    rms_norm_rope_f32(const float* __restrict__ x, long long x_sn, long long x_sh,
                      const float* __restrict__ w, float* __restrict__ y,
                      const int* __restrict__ pos, const double* __restrict__ inv_freq,
                      const float* __restrict__ freq_factors, int H, int D, int n_rot, int neox,
                      double scale, float eps) {
    grid_sync();
    extern __shared__ float smem[];
    const int half = n_rot / 2, n = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const int warps = blockDim.x / 32;
    float* cs = smem;          // [half] cos
    float* sn = smem + half;   // [half] sin
    float* row = smem + n_rot + warp * D;  // this warp's head row
    rope_table(cs, sn, pos[n], scale, inv_freq, freq_factors, half);
    __syncthreads();
    const int h = blockIdx.y * warps + warp;
    if (h >= H) return;
    const float* xr = x + (long long)n * x_sn + (long long)h * x_sh;
    if (w) {
        float ss = 0.0f;
        for (int i = lane; i < D; i += 32) {
            float v = xr[i];
            row[i] = v;
            ss += v * v;
        }
        ss = warp_sum(ss);
        const float r = rsqrtf(ss / (float)D + eps);
        for (int i = lane; i < D; i += 32) row[i] = __fmul_rn(__fmul_rn(row[i], r), w[i]);
    } else {
        for (int i = lane; i < D; i += 32) row[i] = xr[i];
    }
    __syncwarp();
    float* yr = y + ((long long)n * H + h) * D;
    for (int i = lane; i < D; i += 32) {
        yr[i] = rope_value(row, cs, sn, i, n_rot, neox);
    }
}

// qsa_keys_decode_f32: one decode token of each of B sessions into its QSA pending block, and the
// block's pooled key where the token completes it, in one launch (ops/qsa_keys.py; the unfused
// path runs the same arithmetic as torch ops, rms_norm_f32 and rms_norm_rope_f32).
//   pending[slot, pos % ratio] = raw[b]; when (pos + 1) % ratio == 0:
//   blocks[slot, pos / ratio] = rope(rms_norm((sum_j pending[slot, j] in order) * inv_ratio),
//                                    pos + 1 - ratio)
// inv_ratio is 1 / ratio rounded to float (torch divides a CUDA tensor by a scalar that way).
// grid = B, block = TPR threads: the row width rms_norm_f32 takes for D (NormCuda), so the norm
// reduces in its order. pooled, normed [B, D] are scratch; VEC as rms_norm_f32_v4 (D % 4 == 0,
// aligned). Dynamic shared memory: n_rot floats (cos, sin). A padding slot may repeat (its rows
// are garbage either way); real slots are distinct, but for runs: runs[b] (int32 [B], or null:
// every row alone) is the row count of the run of one slot's consecutive positions starting at
// row b (0 at its later rows, whose CTAs exit): the first row's CTA takes the run's rows in
// order, each with the single-row code (ops/chains.py).
extern "C" __global__ void __launch_bounds__(256)
    qsa_keys_decode_f32(const float* __restrict__ raw, float* __restrict__ pending,
                        float* __restrict__ blocks, const int* __restrict__ slots,
                        const int* __restrict__ pos, const float* __restrict__ k_norm,
                        const double* __restrict__ inv_freq, float* __restrict__ pooled,
                        float* __restrict__ normed, int B, int ratio, int n_blocks, int D,
                        int n_rot, double scale, float eps, float inv_ratio, int vec,
                        const int* __restrict__ runs) {
    grid_sync();
    extern __shared__ float smem[];
    const int b0 = blockIdx.x, t = threadIdx.x, tpr = blockDim.x;
    const int n = runs ? runs[b0] : 1;  // rows of the run starting here (0: a later row of one)
    if (n == 0) return;
    const int slot = slots[b0];
    float* pend = pending + (long long)slot * ratio * D;  // this session's [ratio, D]
    for (int b = b0; b < b0 + n; ++b) {
        const int p = pos[b];
        const float* xr = raw + (long long)b * D;
        for (int i = t; i < D; i += tpr) pend[(long long)(p % ratio) * D + i] = xr[i];
        if ((p + 1) % ratio != 0) continue;  // the block is not complete (uniform over the CTA)
        float* pr = pooled + (long long)b * D;
        for (int i = t; i < D; i += tpr) {  // each thread re-reads only values it wrote or kept
            float acc = pend[i];
            for (int j = 1; j < ratio; ++j) acc = __fadd_rn(acc, pend[(long long)j * D + i]);
            pr[i] = __fmul_rn(acc, inv_ratio);
        }
        __syncthreads();
        // rms_norm_row normalises row blockIdx.x (b0): its pointers move on to row b
        const long long shift = (long long)(b - b0) * D;
        if (vec)
            rms_norm_row<true>(pooled + shift, D, k_norm, 1, nullptr, 1, 0, nullptr, nullptr,
                               normed + shift, B, D, eps, 0);
        else
            rms_norm_row<false>(pooled + shift, D, k_norm, 1, nullptr, 1, 0, nullptr, nullptr,
                                normed + shift, B, D, eps, 0);
        const int half = n_rot / 2;
        float *cs = smem, *sn = smem + half;
        rope_table(cs, sn, p + 1 - ratio, scale, inv_freq, nullptr, half);
        __syncthreads();  // also orders the norm's writes of normed before the reads below
        const float* nr = normed + (long long)b * D;
        float* out = blocks + ((long long)slot * n_blocks + p / ratio) * D;
        for (int i = t; i < D; i += tpr) out[i] = rope_value(nr, cs, sn, i, n_rot, 1);
        __syncthreads();  // the next row rewrites cs, sn and the norm's partial sums
    }
}
