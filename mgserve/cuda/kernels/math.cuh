// Device math that several kernels share: warp reductions, the activations as ATen writes them,
// and the 8-value dot product of the weight-streaming kernels.
#pragma once
#include "scalar.cuh"

#define FULL 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

// The sum over the warp's 32 lanes, by an xor butterfly: every lane ends with the same bits.
template <typename V>
__device__ __forceinline__ V warp_sum(V v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL, v, off);
    return v;
}

// The sums over the warp's 32 lanes of N values a lane (N a power of two up to 32) in N - 1 +
// 5 - log2(N) shuffles where N warp_sums take 5 N: at each of the first log2(N) levels
// (offsets 16, 8, ..) a lane keeps half of its values, adds its partner's of that half and passes
// it the other half. Each sum is warp_sum's tree, own value first: the same bits. Returns value
// lane / (32 / N)'s sum (warp_split_index); the 32 / N lanes that share an index hold the same.
template <int N, int OFF = 16>
__device__ __forceinline__ float warp_sum_split(const float (&v)[N], int lane) {
    static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0 && (N == 1 || N <= 2 * OFF),
                  "N: a power of two up to 32");
    if constexpr (N == 1) {
        float s = v[0];
#pragma unroll
        for (int off = OFF; off > 0; off >>= 1) s += __shfl_xor_sync(FULL, s, off);
        return s;
    } else {
        const bool upper = lane & OFF;  // keeps values N / 2 .. N - 1 as its 0 .. N / 2 - 1
        float h[N / 2];
#pragma unroll
        for (int i = 0; i < N / 2; i++) {
            const float keep = upper ? v[N / 2 + i] : v[i], pass = upper ? v[i] : v[N / 2 + i];
            h[i] = keep + __shfl_xor_sync(FULL, pass, OFF);
        }
        return warp_sum_split<N / 2, OFF / 2>(h, lane);
    }
}
template <int N>
__device__ __forceinline__ int warp_split_index(int lane) { return lane / (32 / N); }

// The warp's sums of N values a lane over its 32 lanes, each handed once to put(sum, i) on one
// lane: by warp_sum_split where N is a power of two up to 32 (sum i on lane (32 / N) i), else (or
// without SPLIT, where a kernel's register bound makes the split spill) one warp_sum a value, put
// on lane 0. warp_sum's bits either way.
template <bool SPLIT = true, int N, typename Put>
__device__ __forceinline__ void warp_sums_put(const float (&v)[N], int lane, Put&& put) {
    if constexpr (SPLIT && (N & (N - 1)) == 0 && N <= 32) {
        const float s = warp_sum_split(v, lane);
        if (lane % (32 / N) == 0) put(s, warp_split_index<N>(lane));
    } else {
#pragma unroll
        for (int i = 0; i < N; i++) {
            const float s = warp_sum(v[i]);
            if (lane == 0) put(s, i);
        }
    }
}
// The same for R x NT values a lane: put(sum, rr, t).
template <bool SPLIT = true, int R, int NT, typename Put>
__device__ __forceinline__ void warp_sums_put(const float (&acc)[R][NT], int lane, Put&& put) {
    float flat[R * NT];
#pragma unroll
    for (int i = 0; i < R * NT; i++) flat[i] = acc[i / NT][i % NT];
    warp_sums_put<SPLIT>(flat, lane, [&](float v, int i) { put(v, i / NT, i % NT); });
}

// The max over the warp's 32 lanes (every lane ends with it).
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, off));
    return v;
}

// silu(z) = z / (1 + exp(-z)), sigmoid(z) = 1 / (1 + exp(-z)) as ATen writes them.
__device__ __forceinline__ float silu(float z) { return z / (1.0f + expf(-z)); }
__device__ __forceinline__ float sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

// The linear family's epilogue: y = res + (acc + bias) for output row `row` of token t (bias
// [n_rows] and res [n_tok, n_rows] may be null), in the reference's order of additions.
__device__ __forceinline__ float linear_out(float acc, const float* __restrict__ bias,
                                            const float* __restrict__ res, int t, int row,
                                            int n_rows) {
    if (bias) acc = __fadd_rn(acc, bias[row]);
    if (res) acc = __fadd_rn(res[(size_t)t * n_rows + row], acc);
    return acc;
}

// w[0..7] . (a, b), summed left to right.
__device__ __forceinline__ float dot8(const float* w, float4 a, float4 b) {
    return w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y +
           w[6] * b.z + w[7] * b.w;
}

// w[0..7] . x[0..7] (x 16-byte aligned).
__device__ __forceinline__ float dot8(const float* w, const float* x) {
    return dot8(w, *(const float4*)x, *(const float4*)(x + 4));
}

// quantize_q8 (matvec_q8.cu) of 4 values, as the producer writes them: the 32 values of a group
// sit in 8 consecutive lanes (4 each, aligned: lanes 8g..8g+7), d = max|x| / 127 over the group,
// q = roundf(x / d). Every lane of the warp calls it (dead ones with live = false: the shuffles
// need them); idx is the flat index of o.x in xq [n_tok, k] (a multiple of 4), xd [n_tok, k / 32].
// max is exact in any order, so the bits are quantize_q8's on the stored fp32 values.
__device__ __forceinline__ void q8_store4(float4 o, bool live, signed char* __restrict__ xq,
                                          float* __restrict__ xd, long long idx) {
    float m = live ? fmaxf(fmaxf(fabsf(o.x), fabsf(o.y)), fmaxf(fabsf(o.z), fabsf(o.w))) : 0.0f;
#pragma unroll
    for (int off = 1; off < 8; off <<= 1) m = fmaxf(m, __shfl_xor_sync(FULL, m, off));
    if (!live) return;
    const float d = m / 127.f;
    char4 q;
    q.x = (signed char)(int)(d == 0.f ? 0.f : roundf(__fdiv_rn(o.x, d)));
    q.y = (signed char)(int)(d == 0.f ? 0.f : roundf(__fdiv_rn(o.y, d)));
    q.z = (signed char)(int)(d == 0.f ? 0.f : roundf(__fdiv_rn(o.z, d)));
    q.w = (signed char)(int)(d == 0.f ? 0.f : roundf(__fdiv_rn(o.w, d)));
    *reinterpret_cast<char4*>(xq + idx) = q;
    if ((idx & 31) == 0) xd[idx >> 5] = d;
}

// x + a * o rounded as two separate ops (no FMA contraction): torch's x + inject * out, the
// hyper-connection combine (hc.cu, norm.cu).
__device__ __forceinline__ float4 combine4(float4 x, float a, float4 o) {
    return make_float4(__fadd_rn(x.x, __fmul_rn(a, o.x)), __fadd_rn(x.y, __fmul_rn(a, o.y)),
                       __fadd_rn(x.z, __fmul_rn(a, o.z)), __fadd_rn(x.w, __fmul_rn(a, o.w)));
}

// o's four values rounded to f16 (to nearest even) at p (8-byte aligned): the f16 copy a
// prompt activation's producer writes for the GEMMs that read it (cuda/ops/f16_rows.py). (Here,
// not in scalar.cuh, which the host decoder tests compile for the CPU.)
__device__ __forceinline__ void store_f16x4(u16* p, const float4& o) {
    *reinterpret_cast<uint2*>(p) = make_uint2(f16x2_rn(o.x, o.y), f16x2_rn(o.z, o.w));
}
