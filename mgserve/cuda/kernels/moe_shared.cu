// The shared expert's sum into the routed experts' (qwen3next, qwen4exp), float32:
//   out[n, i] = res[n, i] + (routed[n, i] + shared[n, i] * sigmoid(h[n, :] . gate))
// gate [d] may be null (an ungated shared expert: routed + shared), res too (no residual).
//
// Thread mapping: gridDim.x CTAs of blockDim.x (a multiple of 32, <= 1024) threads per token n
// (blockIdx.y); CTA x writes part x of gridDim.x equal parts of the row (a decode step's few
// tokens: several CTAs instead of one CTA walking the whole row, which made the kernel a chain of
// L2 round trips). Every CTA sums the gate's dot product itself: per thread (stride blockDim.x),
// over the warp by shuffles, then over the warps in order through shared memory, a fixed order
// that depends on d and blockDim.x alone, so a token's result is the same whatever else is in the
// batch and however many parts its row is cut into. Products and sums are rounded one by one (no
// FMA contraction), as the torch version computes them.

#include "math.cuh"
#include "pdl.cuh"

extern "C" __global__ void __launch_bounds__(1024)
    moe_add_shared_f32(const float* __restrict__ routed, const float* __restrict__ shared,
                       const float* __restrict__ h, const float* __restrict__ gate,
                       const float* __restrict__ res, float* __restrict__ out, int d) {
    grid_sync();
    __shared__ float part[32];
    __shared__ float s_gate;
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, n_warps = blockDim.x >> 5;
    const size_t row = (size_t)blockIdx.y * d;
    float g = 1.0f;
    if (gate) {
        float acc = 0.0f;
#pragma unroll 4
        for (int i = t; i < d; i += blockDim.x) acc = __fadd_rn(acc, __fmul_rn(h[row + i], gate[i]));
        acc = warp_sum(acc);
        if (lane == 0) part[warp] = acc;
        __syncthreads();
        if (t == 0) {
            float total = 0.0f;
            for (int w = 0; w < n_warps; ++w) total += part[w];
            s_gate = sigmoid(total);
        }
        __syncthreads();
        g = s_gate;
    }
    const int per = (d + gridDim.x - 1) / gridDim.x;  // this CTA's values [x * per, end)
    const int end = min(d, (int)(blockIdx.x + 1) * per);
    for (int i = (int)blockIdx.x * per + t; i < end; i += blockDim.x) {
        const float s = gate ? __fmul_rn(shared[row + i], g) : shared[row + i];
        float y = __fadd_rn(routed[row + i], s);
        if (res) y = __fadd_rn(res[row + i], y);
        out[row + i] = y;
    }
}
