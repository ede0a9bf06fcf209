// Device math that several kernels share: warp reductions, the activations as ATen writes them,
// and the 8-value dot product of the weight-streaming kernels.
#pragma once

#define FULL 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

// The sum over the warp's 32 lanes, by an xor butterfly: every lane ends with the same bits.
template <typename V>
__device__ __forceinline__ V warp_sum(V v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL, v, off);
    return v;
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
