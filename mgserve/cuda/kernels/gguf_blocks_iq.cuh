// The i-quants with lookup grids (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M), decoded
// like gguf_blocks.cuh's formats (load(blk, j, w): the 8 values j*8 .. j*8+7 of the block at blk).
// The grids are gguf-py's (gguf_grids.cuh, generated): one entry gives the magnitudes of 8 (IQ2,
// IQ1) or 4 (IQ3) values. Layouts (bytes; ggml's, as gguf-py decodes them), per 256-value block,
// "group" = 8 values = one run j:
//
//   IQ2_XXS  66: f16 d | 8 x (4 grid bytes, u32 aux) per 32 values. aux: 4 x 7-bit sign indices
//                (bits 7g..7g+6 for group g), scale ls in bits 28..31. v = d (0.5 + ls) / 4 *
//                iq2xxs_grid[byte g] * sign.
//   IQ2_XS   74: f16 d | 32 x u16 (bits 0..8 grid index, 9..15 sign index) | 8 scale bytes (a
//                nibble per 16 values, low first). v = d (0.5 + s) / 4 * iq2xs_grid * sign.
//   IQ2_S    82: f16 d | 32 grid-index low bytes | 32 sign bytes | 8 qh bytes (2 high index bits
//                per group, group j at bits 2 (j % 4) of byte j / 4) | 8 scale bytes (as IQ2_XS).
//                v = d (0.5 + s) / 4 * iq2s_grid * sign (bit i of the group's sign byte).
//   IQ3_XXS  98: f16 d | 64 grid bytes (4 values each) | 8 x u32 aux per 32 values (as
//                IQ2_XXS's). v = d (0.5 + ls) / 2 * iq3xxs_grid * sign.
//   IQ3_S   110: f16 d | 64 grid-index low bytes | 8 qh bytes (9th index bit of index k: bit
//                k % 8 of byte k / 8) | 32 sign bytes | 4 scale bytes (a nibble per 32 values).
//                v = d (1 + 2 s) * iq3s_grid * sign.
//   IQ1_S    50: f16 d | 32 grid-index low bytes | 8 x u16 qh per 32 values: bits 3g..3g+2 the
//                high index bits of group g, 12..14 the scale s, 15 the delta sign.
//                v = d (2 s + 1) (iq1s_grid + delta), delta = +/-IQ1_DELTA.
//   IQ1_M    56: 32 grid-index low bytes | 16 qh bytes (a nibble per group, low first: 3 high
//                index bits + delta sign) | 4 x u16 scales (3 bits per 16 values at 3 (s % 4) of
//                word s / 4; the top nibbles of the 4 words, word 0 lowest, are the f16 d).
//                v = d (2 s + 1) (iq1s_grid + delta).
//
// Sign indices: ksigns[i] = i with bit 7 the parity of i (8 signs with an even count of minus),
// computed here with __popc instead of read from a table.
#pragma once
#include "gguf_blocks.cuh"
#include "gguf_grids.cuh"

// The 8 sign bits of a 7-bit ksigns index.
__device__ __forceinline__ u32 ksigns(u32 s7) { return s7 | ((__popc(s7) & 1) << 7); }

// w[i] = scale * byte i of grid entry g (unsigned levels) * (-1 if bit i of signs)
__device__ __forceinline__ void signed_levels8(unsigned long long g, u32 signs, float scale,
                                               float* w) {
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const float v = scale * u2f((u32)(g >> (8 * i)) & 0xFF, 0.f);
        w[i] = (signs >> i) & 1 ? -v : v;
    }
}

struct IQ2_XXS {
    static constexpr int BLOCK = 256, BYTES = 66;
    __device__ static void load(const u8* b, int j, float* w) {
        const u8* q = b + 2 + 8 * (j >> 2);
        const int g = j & 3;
        const u32 aux = ld_u32(q + 4);
        const float db = ld_f16(b) * (0.5f + u2f(aux >> 28, 0.f)) * 0.25f;
        signed_levels8(iq2xxs_grid[q[g]], ksigns((aux >> (7 * g)) & 127), db, w);
    }
};

struct IQ2_XS {
    static constexpr int BLOCK = 256, BYTES = 74;
    __device__ static void load(const u8* b, int j, float* w) {
        const u32 qv = ld_u16(b + 2 + 2 * j);
        const u32 s = (b[66 + (j >> 2)] >> (4 * ((j >> 1) & 1))) & 0xF;
        const float db = ld_f16(b) * (0.5f + u2f(s, 0.f)) * 0.25f;
        signed_levels8(iq2xs_grid[qv & 511], ksigns(qv >> 9), db, w);
    }
};

struct IQ2_S {
    static constexpr int BLOCK = 256, BYTES = 82;
    __device__ static void load(const u8* b, int j, float* w) {
        const u32 idx = b[2 + j] | (((b[66 + (j >> 2)] >> (2 * (j & 3))) & 3) << 8);
        const u32 s = (b[74 + (j >> 2)] >> (4 * ((j >> 1) & 1))) & 0xF;
        const float db = ld_f16(b) * (0.5f + u2f(s, 0.f)) * 0.25f;
        signed_levels8(iq2s_grid[idx], b[34 + j], db, w);
    }
};

struct IQ3_XXS {
    static constexpr int BLOCK = 256, BYTES = 98;
    __device__ static void load(const u8* b, int j, float* w) {
        const u32 aux = ld_u32(b + 66 + 4 * (j >> 2));
        const float db = ld_f16(b) * (0.5f + u2f(aux >> 28, 0.f)) * 0.5f;
        const unsigned long long g = (unsigned long long)iq3xxs_grid[b[2 + 2 * j]] |
                                     ((unsigned long long)iq3xxs_grid[b[3 + 2 * j]] << 32);
        signed_levels8(g, ksigns((aux >> (7 * (j & 3))) & 127), db, w);
    }
};

struct IQ3_S {
    static constexpr int BLOCK = 256, BYTES = 110;
    __device__ static void load(const u8* b, int j, float* w) {
        const int ib = j >> 2;
        const u32 s = (b[106 + (ib >> 1)] >> (4 * (ib & 1))) & 0xF;
        const float db = ld_f16(b) * u2f(1 + 2 * s, 0.f);
        const u32 qh = b[66 + ib] >> (2 * (j & 3));
        const u32 i0 = b[2 + 2 * j] | ((qh & 1) << 8), i1 = b[3 + 2 * j] | (((qh >> 1) & 1) << 8);
        const unsigned long long g =
            (unsigned long long)iq3s_grid[i0] | ((unsigned long long)iq3s_grid[i1] << 32);
        signed_levels8(g, b[74 + j], db, w);
    }
};

// w[i] = scale * (int8 byte i of iq1s_grid entry idx + delta)
__device__ __forceinline__ void iq1_levels8(u32 idx, float delta, float scale, float* w) {
    const unsigned long long g = iq1s_grid[idx];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        w[i] = scale * (s8_to_f((u32)(g >> (8 * i)) & 0xFF) + delta);
    }
}

struct IQ1_S {
    static constexpr int BLOCK = 256, BYTES = 50;
    __device__ static void load(const u8* b, int j, float* w) {
        const u32 qh = ld_u16(b + 34 + 2 * (j >> 2));
        const float dl = ld_f16(b) * u2f(2 * ((qh >> 12) & 7) + 1, 0.f);
        const u32 idx = b[2 + j] | (((qh >> (3 * (j & 3))) & 7) << 8);
        iq1_levels8(idx, qh & 0x8000 ? -IQ1_DELTA : IQ1_DELTA, dl, w);
    }
};

struct IQ1_M {
    static constexpr int BLOCK = 256, BYTES = 56;
    __device__ static void load(const u8* b, int j, float* w) {
        const u32 s0 = ld_u16(b + 48), s1 = ld_u16(b + 50);
        const u32 s2 = ld_u16(b + 52), s3 = ld_u16(b + 54);
        const u32 dbits = (s0 >> 12) | ((s1 >> 8) & 0xF0) | ((s2 >> 4) & 0xF00) | (s3 & 0xF000);
        const int s = j >> 1;  // 16-value sub-block
        const u32 sw = s < 8 ? (s < 4 ? s0 : s1) : (s < 12 ? s2 : s3);
        const float dl = f16_bits((u16)dbits) * u2f(2 * ((sw >> (3 * (s & 3))) & 7) + 1, 0.f);
        const u32 qh = b[32 + (j >> 1)] >> (4 * (j & 1));
        const u32 idx = b[j] | ((qh & 7) << 8);
        iq1_levels8(idx, qh & 8 ? -IQ1_DELTA : IQ1_DELTA, dl, w);
    }
};
