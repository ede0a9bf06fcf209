// Gated activations, float32: out = act(gate) * up with act = silu (SwiGLU, llama / qwen),
// gelu_tanh (GeGLU, Gemma; llama.cpp's ggml_gelu is the tanh form) or sigmoid (the output gate of
// qwen3next's attention).
//
// Thread mapping: grid = (rows, ceil(F / (per-thread values * 256))), 256 threads per CTA; each
// thread handles one float4 (the _v4 entries: F % 4 == 0, 16-byte aligned rows) or one float of
// one row. Rows of gate and up start at r * g_stride / r * u_stride (so both may be column
// slices of one fused [rows, 2F] projection); out is contiguous [rows, F]. The _q8 entries also
// round out to int8 groups (q8_store4 in math.cuh), the _f16 entries to f16 (out16 [rows, F]:
// the prompt GEMMs' copy, cuda/ops/f16_rows.py).

#include "math.cuh"
#include "pdl.cuh"
#include "scalar.cuh"

__device__ __forceinline__ float gelu_tanh_f(float x) {
    // ATen's tanh GELU: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
    const float k_beta = 0.7978845608028654f, k_kappa = 0.044715f;
    float x_cube = x * x * x;
    float inner = k_beta * (x + k_kappa * x_cube);
    return 0.5f * x * (1.0f + tanhf(inner));
}

template <int ACT>
__device__ __forceinline__ float act_mul(float g, float u) {
    return (ACT == 0 ? silu(g) : ACT == 1 ? gelu_tanh_f(g) : sigmoid(g)) * u;
}

template <int ACT, bool VEC, bool Q8 = false, bool F16 = false>
__device__ __forceinline__ void act_row(const float* __restrict__ gate, long long g_stride,
                                        const float* __restrict__ up, long long u_stride,
                                        float* __restrict__ out, int F,
                                        signed char* __restrict__ xq = nullptr,
                                        float* __restrict__ xd = nullptr,
                                        u16* __restrict__ out16 = nullptr) {
    const long long r = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    const float* gr = gate + r * g_stride;
    const float* ur = up + r * u_stride;
    float* orow = out + r * F;
    if (VEC) {
        const bool on = i < F / 4;
        if (!Q8 && !on) return;  // with Q8 every lane takes part in q8_store4's shuffles
        float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (on) {
            float4 g = reinterpret_cast<const float4*>(gr)[i];
            float4 u = reinterpret_cast<const float4*>(ur)[i];
            o.x = act_mul<ACT>(g.x, u.x);
            o.y = act_mul<ACT>(g.y, u.y);
            o.z = act_mul<ACT>(g.z, u.z);
            o.w = act_mul<ACT>(g.w, u.w);
            reinterpret_cast<float4*>(orow)[i] = o;
            if (F16) store_f16x4(out16 + r * F + 4LL * i, o);
        }
        if (Q8) q8_store4(o, on, xq, xd, r * F + 4LL * (on ? i : 0));
    } else {
        if (i >= F) return;
        orow[i] = act_mul<ACT>(gr[i], ur[i]);
    }
}

#define ACT_ENTRY(NAME, ACT, VEC)                                                                \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        NAME(const float* __restrict__ gate, long long g_stride, const float* __restrict__ up,  \
             long long u_stride, float* __restrict__ out, int F) {                              \
        grid_sync();                                                                            \
        act_row<ACT, VEC>(gate, g_stride, up, u_stride, out, F);                                \
    }

ACT_ENTRY(silu_mul_f32, 0, false)
ACT_ENTRY(silu_mul_f32_v4, 0, true)
ACT_ENTRY(gelu_mul_f32, 1, false)
ACT_ENTRY(gelu_mul_f32_v4, 1, true)
ACT_ENTRY(sigmoid_mul_f32, 2, false)
ACT_ENTRY(sigmoid_mul_f32_v4, 2, true)

// The _v4 entries that also write out rounded to int8 as quantize_q8 would (xq [rows * F] int8,
// xd [rows * F / 32]; F % 32 == 0): the int8 product of out skips its quantize launch.
#define ACT_Q8_ENTRY(NAME, ACT)                                                                  \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        NAME(const float* __restrict__ gate, long long g_stride, const float* __restrict__ up,  \
             long long u_stride, float* __restrict__ out, int F, signed char* __restrict__ xq,  \
             float* __restrict__ xd) {                                                          \
        grid_sync();                                                                            \
        act_row<ACT, true, true>(gate, g_stride, up, u_stride, out, F, xq, xd);                 \
    }

ACT_Q8_ENTRY(silu_mul_q8_f32_v4, 0)
ACT_Q8_ENTRY(sigmoid_mul_q8_f32_v4, 2)

#define ACT_F16_ENTRY(NAME, ACT)                                                                 \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        NAME(const float* __restrict__ gate, long long g_stride, const float* __restrict__ up,  \
             long long u_stride, float* __restrict__ out, int F, u16* __restrict__ out16) {     \
        grid_sync();                                                                            \
        act_row<ACT, true, false, true>(gate, g_stride, up, u_stride, out, F, nullptr, nullptr, \
                                        out16);                                                 \
    }

ACT_F16_ENTRY(silu_mul_f16_f32_v4, 0)
ACT_F16_ENTRY(gelu_mul_f16_f32_v4, 1)
ACT_F16_ENTRY(sigmoid_mul_f16_f32_v4, 2)
