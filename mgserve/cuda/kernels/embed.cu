// Rows of a float32 table gathered by index (a step's token embeddings), scaled, and written into
// `copies` consecutive rows per token (qwen4exp's hyper-connection streams start as copies):
//   out[n, c, i] = table[ids[n], i] * scale   for c < copies, i < D
// ids outside [0, V) are clamped (a bad id never reads outside the table). With scale 1 the row is
// copied bit for bit. Thread mapping: grid = (N, ceil(D / (VALS * blockDim))), each thread one
// float4 (the _v4 entries: D % 4 == 0, 16-byte aligned table and out) or one float of one token,
// written to every copy.

#include "pdl.cuh"

template <typename I, bool VEC>
__device__ __forceinline__ void gather_row(const float* __restrict__ table, const I* __restrict__ ids,
                                           float* __restrict__ out, int V, int D, int copies,
                                           float scale) {
    const long long n = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    const long long id = min(max((long long)ids[n], 0LL), (long long)V - 1);
    const float* src = table + id * D;
    float* dst = out + n * copies * D;
    if (VEC) {
        if (i >= D / 4) return;
        float4 v = reinterpret_cast<const float4*>(src)[i];
        if (scale != 1.0f) {
            v.x = __fmul_rn(v.x, scale);
            v.y = __fmul_rn(v.y, scale);
            v.z = __fmul_rn(v.z, scale);
            v.w = __fmul_rn(v.w, scale);
        }
        for (int c = 0; c < copies; ++c) reinterpret_cast<float4*>(dst + (long long)c * D)[i] = v;
    } else {
        if (i >= D) return;
        float v = src[i];
        if (scale != 1.0f) v = __fmul_rn(v, scale);
        for (int c = 0; c < copies; ++c) dst[(long long)c * D + i] = v;
    }
}

#define GATHER_ENTRY(NAME, I, VEC)                                                              \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        NAME(const float* __restrict__ table, const I* __restrict__ ids, float* __restrict__ out, \
             int V, int D, int copies, float scale) {                                           \
        grid_sync();                                                                            \
        gather_row<I, VEC>(table, ids, out, V, D, copies, scale);                               \
    }

GATHER_ENTRY(embed_gather_i64, long long, false)
GATHER_ENTRY(embed_gather_i64_v4, long long, true)
GATHER_ENTRY(embed_gather_i32, int, false)
GATHER_ENTRY(embed_gather_i32_v4, int, true)
