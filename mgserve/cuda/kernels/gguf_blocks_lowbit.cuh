// The 2- and 3-bit k-quants and MXFP4, decoded like gguf_blocks.cuh's formats (same load(blk, j,
// w) contract: the 8 values j*8 .. j*8+7 of the block at blk). Layouts (bytes; ggml's, as gguf-py
// decodes them):
//
//   Q2_K  84 / 256: 16 scale bytes (low nibble sc, high nibble m; one per 16 values) |
//                   64 bytes of 2-bit q | f16 d | f16 dmin.  v = d sc q - dmin m.
//                   Value e: q = (qs[32 (e / 128) + e % 32] >> 2 ((e % 128) / 32)) & 3.
//   Q3_K 110 / 256: 32 hmask | 64 bytes of 2-bit ql (placed as Q2_K's q) | 12 bytes of 6-bit
//                   scales | f16 d.  v = d (s - 32) (ql + 4 hbit - 4), hbit = hmask[e % 32] bit
//                   e / 32; scale s (one per 16 values): low 4 bits from nibble s % 8 of bytes
//                   0..7 (low nibbles for s < 8), high 2 bits from byte 8 + s % 4, bits 2 (s / 4).
//   MXFP4 17 /  32: u8 e (E8M0 exponent) | 16 nibbles (low: values 0..15, high: 16..31).
//                   v = 2^(e - 128) kvalues[q], kvalues the e2m1 levels doubled (gguf_grids.cuh).
//                   17-byte blocks start at any address: every field is read bytewise.
#pragma once
#include "gguf_blocks.cuh"
#include "gguf_grids.cuh"

// The 8 bytes at p (any alignment), one per word.
__device__ __forceinline__ void ld_bytes8_u8(const u8* p, u32* v) {
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = p[i];
}

struct Q2_K {
    static constexpr int BLOCK = 256, BYTES = 84;
    __device__ static void load(const u8* b, int j, float* w) {
        const u32 sc = b[j >> 1];  // 16-value sub-block j / 2
        const float d = ld_f16(b + 80) * u2f(sc & 0xF, 0.f);
        const float m = ld_f16(b + 82) * u2f(sc >> 4, 0.f);
        u32 q[8];
        ld_bytes8(b + 16 + 32 * (j >> 4) + 8 * (j & 3), q);
        const int shift = 2 * ((j >> 2) & 3);
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = d * u2f((q[i] >> shift) & 3, 0.f) - m;
    }
};

struct Q3_K {
    static constexpr int BLOCK = 256, BYTES = 110;
    __device__ static void load(const u8* b, int j, float* w) {
        const int s = j >> 1;  // 16-value sub-block
        const u32 lo = (b[96 + (s & 7)] >> (4 * (s >> 3))) & 0xF;
        const u32 hi = (b[104 + (s & 3)] >> (2 * (s >> 2))) & 3;
        const float d = ld_f16(b + 108) * u2f(lo | (hi << 4), 32.f);
        u32 ql[8], hm[8];
        ld_bytes8(b + 32 + 32 * (j >> 4) + 8 * (j & 3), ql);
        ld_bytes8(b + 8 * (j & 3), hm);
        const int shift = 2 * ((j >> 2) & 3), bit = j >> 2;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const u32 q = ((ql[i] >> shift) & 3) | (((hm[i] >> bit) & 1) << 2);
            w[i] = d * u2f(q, 4.f);
        }
    }
};

// MXFP4 level q (0..15) as a float, through the packed int8 table (a register lookup)
__device__ __forceinline__ float kvalue_mxfp4(u32 q) {
    const unsigned long long t = q < 8 ? MXFP4_KVALUES_LO : MXFP4_KVALUES_HI;
    return s8_to_f((u32)((t >> (8 * (q & 7))) & 0xFF));
}

// ggml's E8M0 "half" scale: 2^(e - 128) as float bits (e < 2: the subnormals 2^-127, 2^-126... )
__device__ __forceinline__ float e8m0_half(u32 e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

struct MXFP4 {
    static constexpr int BLOCK = 32, BYTES = 17;
    __device__ static void load(const u8* b, int j, float* w) {
        const float d = e8m0_half(b[0]);
        u32 q[8];
        ld_bytes8_u8(b + 1 + (j & 1) * 8, q);
        const int shift = (j >> 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = d * kvalue_mxfp4((q[i] >> shift) & 0xF);
    }
};
