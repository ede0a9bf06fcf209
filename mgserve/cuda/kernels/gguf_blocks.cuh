// GGUF block layouts and their decoders, shared by the quantized-weight kernels (matvec.cu,
// dequant.cu, moe.cu): the formats below, then the 2- and 3-bit ones (gguf_blocks_lowbit.cuh)
// and the i-quants with lookup grids (gguf_blocks_iq.cuh). Layouts (bytes; ggml's, as gguf-py
// decodes them):
//
//   Q4_0  18 / 32:  f16 d | 16 nibbles (low: values 0..15, high: 16..31), v = d * (q - 8)
//   Q4_1  20 / 32:  f16 d, f16 m | 16 nibbles, v = d * q + m
//   Q5_0  22 / 32:  f16 d | u32 qh (5th bits) | 16 nibbles, v = d * (q - 16)
//   Q5_1  24 / 32:  f16 d, f16 m | u32 qh | 16 nibbles, v = d * q + m
//   Q8_0  34 / 32:  f16 d | 32 x i8, v = d * q
//   IQ4_NL 18 / 32: f16 d | 16 nibbles, v = d * kvalue_iq4(q)
//   Q4_K 144 / 256: f16 d, f16 dmin | 12 bytes of 6-bit scales/mins | 128 nibbles
//   Q5_K 176 / 256: f16 d, f16 dmin | 12 scales | 32 qh | 128 nibbles
//   Q6_K 210 / 256: 128 ql | 64 qh | 16 x i8 scales | f16 d
//   IQ4_XS 136 / 256: f16 d | u16 scales_h | 4 scales_l | 128 nibbles
//   F32, F16, BF16: plain elements (k must be a multiple of 8)
//   Q2_K, Q3_K, MXFP4: gguf_blocks_lowbit.cuh; IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S,
//   IQ1_S, IQ1_M: gguf_blocks_iq.cuh (lookup grids generated from gguf-py: gguf_grids.cuh)
#pragma once

#include "gguf_loads.cuh"

// IQ4_NL's 16 levels {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113}
// as int8 packed in two words: a register lookup. A __constant__ table serialises a warp whose
// lanes read different entries (up to 16-way), which made IQ4_XS 6x slower than Q4_K.
__device__ __forceinline__ float kvalue_iq4(u32 q) {
    const unsigned long long t = q < 8 ? 0xf6eaddcfbfad9881ull : 0x7159453526190d01ull;
    return s8_to_f((u32)((t >> (8 * (q & 7))) & 0xFF));
}

// Each format: BLOCK values per block, BYTES bytes per block, and load(blk, j, w) that writes the
// 8 values j*8 .. j*8+7 of the block starting at blk.

struct Q4_0 {
    static constexpr int BLOCK = 32, BYTES = 18;
    __device__ static void load(const u8* b, int j, float* w) {
        const float d = ld_f16(b);
        u32 q[8];
        ld_bytes8(b + 2 + (j & 1) * 8, q);
        const int shift = (j >> 1) * 4;  // runs 0,1 are low nibbles, 2,3 high
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = d * u2f((q[i] >> shift) & 0xF, 8.f);
    }
};

struct Q4_1 {
    static constexpr int BLOCK = 32, BYTES = 20;
    __device__ static void load(const u8* b, int j, float* w) {
        const float d = ld_f16(b), m = ld_f16(b + 2);
        u32 q[8];
        ld_bytes8(b + 4 + (j & 1) * 8, q);
        const int shift = (j >> 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = d * u2f((q[i] >> shift) & 0xF, 0.f) + m;
    }
};

struct Q5_0 {
    static constexpr int BLOCK = 32, BYTES = 22;
    __device__ static void load(const u8* b, int j, float* w) {
        const float d = ld_f16(b);
        const u32 qh = ld_u32(b + 2) >> (j * 8);  // value e's 5th bit is qh bit e
        u32 q[8];
        ld_bytes8(b + 6 + (j & 1) * 8, q);
        const int shift = (j >> 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const u32 v = ((q[i] >> shift) & 0xF) | (((qh >> i) & 1) << 4);
            w[i] = d * u2f(v, 16.f);
        }
    }
};

struct Q5_1 {
    static constexpr int BLOCK = 32, BYTES = 24;
    __device__ static void load(const u8* b, int j, float* w) {
        const float d = ld_f16(b), m = ld_f16(b + 2);
        const u32 qh = ld_u32(b + 4) >> (j * 8);
        u32 q[8];
        ld_bytes8(b + 8 + (j & 1) * 8, q);
        const int shift = (j >> 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const u32 v = ((q[i] >> shift) & 0xF) | (((qh >> i) & 1) << 4);
            w[i] = d * u2f(v, 0.f) + m;
        }
    }
};

struct Q8_0 {
    static constexpr int BLOCK = 32, BYTES = 34;
    __device__ static void load(const u8* b, int j, float* w) {
        const float d = ld_f16(b);
        u32 q[8];
        ld_bytes8(b + 2 + j * 8, q);
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = d * s8_to_f(q[i]);
    }
};

// Q4_0's layout and decoder, with IQ4_NL's 16 levels in place of q - 8.
struct IQ4_NL {
    static constexpr int BLOCK = 32, BYTES = 18;
    __device__ static void load(const u8* b, int j, float* w) {
        const float d = ld_f16(b);
        u32 q[8];
        ld_bytes8(b + 2 + (j & 1) * 8, q);
        const int shift = (j >> 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = d * kvalue_iq4((q[i] >> shift) & 0xF);
    }
};

// ggml's get_scale_min_k4: sub-block s (0..7) of a Q4_K/Q5_K block has a 6-bit scale and min.
__device__ __forceinline__ void scale_min_k4(const u8* q, int s, float* sc, float* mn) {
    if (s < 4) {
        *sc = u2f(q[s] & 63, 0.f);
        *mn = u2f(q[s + 4] & 63, 0.f);
    } else {
        *sc = u2f((q[s + 4] & 0xF) | ((q[s - 4] >> 6) << 4), 0.f);
        *mn = u2f((q[s + 4] >> 4) | ((q[s] >> 6) << 4), 0.f);
    }
}

struct Q4_K {
    static constexpr int BLOCK = 256, BYTES = 144;
    __device__ static void load(const u8* b, int j, float* w) {
        const int s = j >> 2;  // 32-value sub-block; its nibbles are low for even s, high for odd
        float sc, mn;
        scale_min_k4(b + 4, s, &sc, &mn);
        const float d = ld_f16(b) * sc, m = ld_f16(b + 2) * mn;
        // qs starts at byte 16 and runs are 8 bytes: an aligned 8-byte load (blocks are 144 bytes)
        const uint2 raw = *(const uint2*)(b + 16 + (s >> 1) * 32 + (j & 3) * 8);
        const int shift = (s & 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const u32 word = i < 4 ? raw.x : raw.y;
            w[i] = d * u2f((word >> (8 * (i & 3) + shift)) & 0xF, 0.f) - m;
        }
    }
};

struct Q5_K {
    static constexpr int BLOCK = 256, BYTES = 176;
    __device__ static void load(const u8* b, int j, float* w) {
        const int s = j >> 2, l0 = (j & 3) * 8;
        float sc, mn;
        scale_min_k4(b + 4, s, &sc, &mn);
        const float d = ld_f16(b) * sc, m = ld_f16(b + 2) * mn;
        const uint2 raw = *(const uint2*)(b + 48 + (s >> 1) * 32 + l0);
        const uint2 hraw = *(const uint2*)(b + 16 + l0);  // qh[l]: bit s is value (s, l)'s 5th bit
        const int shift = (s & 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const u32 word = i < 4 ? raw.x : raw.y;
            const u32 hword = i < 4 ? hraw.x : hraw.y;
            const u32 lo = (word >> (8 * (i & 3) + shift)) & 0xF;
            const u32 hi = (hword >> (8 * (i & 3) + s)) & 1;
            w[i] = d * u2f(lo | (hi << 4), 0.f) - m;
        }
    }
};

struct Q6_K {
    static constexpr int BLOCK = 256, BYTES = 210;
    __device__ static void load(const u8* b, int j, float* w) {
        const int e = j * 8, h = e >> 7, r = e & 127, quarter = r >> 5, l0 = r & 31;
        u32 ql[8], qh[8];
        ld_bytes8(b + 64 * h + (quarter & 1) * 32 + l0, ql);
        ld_bytes8(b + 128 + 32 * h + l0, qh);
        const int sc = ((const i8*)(b + 192))[8 * h + (l0 >> 4) + 2 * quarter];
        const float d = ld_f16(b + 208) * (float)sc;
        const int lshift = (quarter >> 1) * 4, hshift = quarter * 2;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const u32 v = ((ql[i] >> lshift) & 0xF) | (((qh[i] >> hshift) & 3) << 4);
            w[i] = d * u2f(v, 32.f);
        }
    }
};

struct IQ4_XS {
    static constexpr int BLOCK = 256, BYTES = 136;
    __device__ static void load(const u8* b, int j, float* w) {
        const int ib = j >> 2;  // 32-value sub-block, laid out like one IQ4_NL block
        const u32 sh = ld_u16(b + 2);
        const u32 ls = ((b[4 + (ib >> 1)] >> (4 * (ib & 1))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4);
        const float d = ld_f16(b) * u2f(ls, 32.f);
        u32 q[8];
        ld_bytes8(b + 8 + 16 * ib + (j & 1) * 8, q);
        const int shift = ((j >> 1) & 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = d * kvalue_iq4((q[i] >> shift) & 0xF);
    }
};

// Plain element types: BLOCK 8 so one "block" is exactly one lane's run (16- or 32-byte load).
struct F32 {
    static constexpr int BLOCK = 8, BYTES = 32;
    __device__ static void load(const u8* b, int, float* w) {
        const float4 a = *(const float4*)b, c = *(const float4*)(b + 16);
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        w[4] = c.x; w[5] = c.y; w[6] = c.z; w[7] = c.w;
    }
};

struct F16 {
    static constexpr int BLOCK = 8, BYTES = 16;
    __device__ static void load(const u8* b, int, float* w) {
        const uint4 a = *(const uint4*)b;
        f16x8_to_f32(a, w);
    }
};

struct BF16 {
    static constexpr int BLOCK = 8, BYTES = 16;
    __device__ static void load(const u8* b, int, float* w) {
        const uint4 a = *(const uint4*)b;
        bf16x8_to_f32(a, w);
    }
};

