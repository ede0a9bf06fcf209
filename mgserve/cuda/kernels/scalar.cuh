// Scalar types and the exact bit-level conversions the kernels share: f16 / bf16 <-> f32 and
// small integers to f32. The compiler (compiler.py) inlines `#include "name.cuh"` lines from this
// folder before NVRTC sees the source, so the cubin cache key covers every header a kernel uses.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef signed char i8;

// The f16 with bits h, as f32 (exact).
__device__ __forceinline__ float f16_bits(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// The f16 bits of f, rounded to nearest even (as torch's .to(torch.float16)).
__device__ __forceinline__ u16 f16_rn(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Two f16 values (rounded to nearest even) packed in a word, lo in the low half (the lower
// address, the lower k / n index of an mma operand).
__device__ __forceinline__ u32 f16x2_rn(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 8 values as f16 (to nearest even), value i in half i & 1 of word i / 2: a 16-byte chunk of an
// f16 tile (the prompt GEMMs' W tiles and qgemm_dequant store them so: the same bits)
__device__ __forceinline__ uint4 f16x8_rn(const float* w) {
    uint4 r;  // (no make_uint4: host-compiled by the CPU tests)
    r.x = f16x2_rn(w[0], w[1]);
    r.y = f16x2_rn(w[2], w[3]);
    r.z = f16x2_rn(w[4], w[5]);
    r.w = f16x2_rn(w[6], w[7]);
    return r;
}

// The 8 f16 values packed in a (value 2i in the low half of word i) as f32.
__device__ __forceinline__ void f16x8_to_f32(const uint4& a, float* w) {
    const u32 v[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        w[2 * i] = f16_bits((u16)(v[i] & 0xFFFF));
        w[2 * i + 1] = f16_bits((u16)(v[i] >> 16));
    }
}

// The 8 bf16 values packed in a (value 2i in the low half of word i) as f32: a bf16 is the top
// half of an f32.
__device__ __forceinline__ void bf16x8_to_f32(const uint4& a, float* w) {
    const u32 v[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        w[2 * i] = __int_as_float((int)(v[i] << 16));
        w[2 * i + 1] = __int_as_float((int)(v[i] & 0xFFFF0000u));
    }
}

// Exactly (float)v - bias for 0 <= v < 2^23: v becomes the mantissa of 2^23 + v, then one FADD.
// Replaces the quarter-rate integer-to-float conversion, which bounded the quantized kernels.
__device__ __forceinline__ float u2f(u32 v, float bias) {
    return __int_as_float(0x4B000000u | v) - (8388608.f + bias);
}

// u2f of byte i (0..3) of v: one permute forms 0x4B000000 | byte (the same FADD follows).
__device__ __forceinline__ float byte_f(u32 v, int i, float bias) {
    return __int_as_float(__byte_perm(v, 0x4B000000u, 0x7440 + i)) - (8388608.f + bias);
}

// The int8 whose two's-complement byte is b (0..255), as f32: b ^ 0x80 is its offset-128 form.
__device__ __forceinline__ float s8_to_f(u32 b) { return u2f(b ^ 0x80u, 128.f); }
