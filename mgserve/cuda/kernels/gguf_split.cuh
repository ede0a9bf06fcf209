// Load-then-decode readers of GGUF blocks, shared by the kernels that issue a batch of weight
// loads before using any (hc.cu) or fetch the next tile's weights before the current tile's
// products (qgemm.cu). SplitFormat<B>::T is the reader of gguf_blocks*.cuh format B: a raw-bits
// reader of its own for the formats below, Whole<B> (decode at fetch) for the others.
#pragma once

#include "gguf_blocks.cuh"
#include "gguf_blocks_iq.cuh"
#include "gguf_blocks_lowbit.cuh"

#ifndef SPLIT_BLOCKS
#define SPLIT_BLOCKS 1  // 1: Q4_K, Q5_0 and Q6_K through the raw-bits readers below
#endif
#ifndef SPLIT_DECODE
#define SPLIT_DECODE 2  // 2: the readers' values by byte permutes; 1: by shifts and masks
#endif

// Each format: BLOCK values per block, BYTES bytes per block; fetch(blk, j) loads the raw bits of
// the 8 values j*8 .. j*8+7 of the block starting at blk, decode(raw, w) turns them into floats.
// Split so a batch of loads is issued before any is used (and raw bits take fewer registers).
// The split formats below read through the read-only path (__ldg: the row pointers come from
// shared memory, so the compiler cannot tell they are global); every other GGUF format is
// `Whole<B>` over its gguf_blocks*.cuh decoder (its fetch decodes at once).
// The split readers of Q4_K, Q5_0 and Q6_K do the same arithmetic as those decoders.
namespace split {

__device__ __forceinline__ u32 ldg_u16(const u8* p) { return __ldg((const unsigned short*)p); }

struct Q8_0 {  // 34-byte blocks: 2-byte loads
    static constexpr int BLOCK = 32, BYTES = 34;
    struct Raw {
        u32 d, q[2];  // f16 scale bits, 8 int8 values
    };
    __device__ static Raw fetch(const u8* b, int j) {
        const u8* q = b + 2 + j * 8;
        Raw r;
        r.d = ldg_u16(b);
        r.q[0] = ldg_u16(q) | (ldg_u16(q + 2) << 16);
        r.q[1] = ldg_u16(q + 4) | (ldg_u16(q + 6) << 16);
        return r;
    }
    __device__ static void decode(const Raw& r, float* w) {
        const float d = f16_bits((u16)r.d);
#if SPLIT_DECODE == 2  // s8_to_f of each byte: the offset-128 forms of a word's 4 at once
        const u32 v[2] = {r.q[0] ^ 0x80808080u, r.q[1] ^ 0x80808080u};
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = d * byte_f(v[i >> 2], i & 3, 128.f);
#else
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = d * s8_to_f((r.q[i >> 2] >> (8 * (i & 3))) & 0xFF);
#endif
    }
};

// Plain types use BLOCK 8: one block = one run.
struct F32 {
    static constexpr int BLOCK = 8, BYTES = 32;
    struct Raw {
        float4 a, b;
    };
    __device__ static Raw fetch(const u8* b, int) {
        return Raw{__ldg((const float4*)b), __ldg((const float4*)(b + 16))};
    }
    __device__ static void decode(const Raw& r, float* w) {
        w[0] = r.a.x; w[1] = r.a.y; w[2] = r.a.z; w[3] = r.a.w;
        w[4] = r.b.x; w[5] = r.b.y; w[6] = r.b.z; w[7] = r.b.w;
    }
};

struct F16 {
    static constexpr int BLOCK = 8, BYTES = 16;
    typedef uint4 Raw;
    __device__ static Raw fetch(const u8* b, int) { return __ldg((const uint4*)b); }
    __device__ static void decode(const Raw& a, float* w) { f16x8_to_f32(a, w); }
};

struct BF16 {
    static constexpr int BLOCK = 8, BYTES = 16;
    typedef uint4 Raw;
    __device__ static Raw fetch(const u8* b, int) { return __ldg((const uint4*)b); }
    __device__ static void decode(const Raw& a, float* w) { bf16x8_to_f32(a, w); }
};

// The block formats of a Q4_K_M file's hyper-connections, the same arithmetic as gguf_blocks.cuh's
// decoders: the fetch loads raw bits only (and notes where the run sits in its block).

// byte k (0..11) of the 12 scale bytes held as three words (k is not a compile-time constant:
// selects instead of a register array, which would spill to local memory)
__device__ __forceinline__ u32 byte12(u32 w0, u32 w1, u32 w2, int k) {
    const u32 w = k < 4 ? w0 : k < 8 ? w1 : w2;
    return (w >> (8 * (k & 3))) & 0xFF;
}

struct Q4_K {  // 144-byte blocks, 16-byte aligned: word loads
    static constexpr int BLOCK = 256, BYTES = 144;
    struct Raw {
        u32 dm, sc[3], s;  // f16 d and dmin, the 12 scale bytes, the run's sub-block
        uint2 q;           // the run's 8 nibbles (one 8-byte load)
    };
    __device__ static Raw fetch(const u8* b, int j) {
        Raw r;
        r.s = (u32)(j >> 2);
        r.dm = __ldg((const unsigned int*)b);
        r.sc[0] = __ldg((const unsigned int*)(b + 4));
        r.sc[1] = __ldg((const unsigned int*)(b + 8));
        r.sc[2] = __ldg((const unsigned int*)(b + 12));
        r.q = __ldg((const uint2*)(b + 16 + (r.s >> 1) * 32 + (j & 3) * 8));
        return r;
    }
    // Sub-block s's scale d x sc and min dmin x mn from the block's header words (dm: f16 d
    // and dmin; sc0..2: the 12 scale bytes), the values of ggml's get_scale_min_k4 by byte
    // permutes: t = s & 3 picks byte t of each scale word (x0, x1, x2: bytes t, t + 4, t + 8);
    // sub-blocks 0..3 take scale x0 & 63 and min x1 & 63, 4..7 the nibbles of x2 with the top
    // two bits of x0 (scale) and x1 (min) above them: both are formed, one kept.
    __device__ static void scale_min(u32 dm, u32 sc0, u32 sc1, u32 sc2, u32 s, float& d,
                                     float& m) {
        const u32 t = s & 3, pick = t | (t + 4) << 4;
        const u32 x01 = __byte_perm(sc0, sc1, pick);       // x0 | x1 << 8
        const u32 x22 = __byte_perm(sc2, sc2 >> 4, pick);  // x2 | (x2 >> 4) << 8
        const u32 scmn = s < 4 ? x01 & 0x3F3F : (x22 & 0x0F0F) | ((x01 >> 2) & 0x3030);
        d = f16_bits((u16)(dm & 0xFFFF)) * byte_f(scmn, 0, 0.f);
        m = f16_bits((u16)(dm >> 16)) * byte_f(scmn, 1, 0.f);
    }
    // The 8 values of a run of one sub-block: value i = d q_i - m, q_i byte i & 3 of q0 (i < 4)
    // or q1, each a nibble already (0..15).
    __device__ static void values(float d, float m, u32 q0, u32 q1, float* w) {
        const u32 q[2] = {q0, q1};
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = d * byte_f(q[i >> 2], i & 3, 0.f) - m;
    }
    // SPLIT_DECODE 2 (the default): scale_min, and the run's nibbles by byte permutes (values)
    __device__ static void decode(const Raw& r, float* w) {
        const u32 s = r.s;
#if SPLIT_DECODE == 2
        float d, m;
        scale_min(r.dm, r.sc[0], r.sc[1], r.sc[2], s, d, m);
        const u32 shift = (s & 1) * 4;
        values(d, m, (r.q.x >> shift) & 0x0F0F0F0Fu, (r.q.y >> shift) & 0x0F0F0F0Fu, w);
#else  // 1: shifts and masks (gguf_blocks.cuh's arithmetic as written there)
        u32 sc, mn;
        if (s < 4) {
            sc = byte12(r.sc[0], r.sc[1], r.sc[2], s) & 63;
            mn = byte12(r.sc[0], r.sc[1], r.sc[2], s + 4) & 63;
        } else {
            const u32 hi = byte12(r.sc[0], r.sc[1], r.sc[2], s + 4);
            sc = (hi & 0xF) | ((byte12(r.sc[0], r.sc[1], r.sc[2], s - 4) >> 6) << 4);
            mn = (hi >> 4) | ((byte12(r.sc[0], r.sc[1], r.sc[2], s) >> 6) << 4);
        }
        const float d = f16_bits((u16)(r.dm & 0xFFFF)) * u2f(sc, 0.f);
        const float m = f16_bits((u16)(r.dm >> 16)) * u2f(mn, 0.f);
        const int shift = (s & 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const u32 word = i < 4 ? r.q.x : r.q.y;
            w[i] = d * u2f((word >> (8 * (i & 3) + shift)) & 0xF, 0.f) - m;
        }
#endif
    }
};

struct Q5_0 {  // 22-byte blocks: 2-byte loads
    static constexpr int BLOCK = 32, BYTES = 22;
    struct Raw {
        u32 meta, q[2];  // f16 d | the run's 8 fifth bits << 16 | nibble shift << 24; 8 bytes
    };
    __device__ static Raw fetch(const u8* b, int j) {
        const u8* q = b + 6 + (j & 1) * 8;
        const u32 qh = (ldg_u16(b + 2 + (j & 2)) >> ((j & 1) * 8)) & 0xFF;  // qh byte j
        Raw r;
        r.meta = ldg_u16(b) | (qh << 16) | ((u32)(j >> 1) * 4 << 24);
        r.q[0] = ldg_u16(q) | (ldg_u16(q + 2) << 16);
        r.q[1] = ldg_u16(q + 4) | (ldg_u16(q + 6) << 16);
        return r;
    }
    // SPLIT_DECODE 2: value i is byte i & 3 of word i >> 2, its fifth bit put in place by a
    // multiply (bit k of a 4-bit x times 0x02040810 lands on bit 8 k + 4, no two terms overlap)
    __device__ static void decode(const Raw& r, float* w) {
        const float d = f16_bits((u16)(r.meta & 0xFFFF));
        const u32 qh = (r.meta >> 16) & 0xFF, shift = r.meta >> 24;
#if SPLIT_DECODE == 2
        const u32 h[2] = {((qh & 0xF) * 0x02040810u) & 0x10101010u,
                          ((qh >> 4) * 0x02040810u) & 0x10101010u};
        const u32 v[2] = {((r.q[0] >> shift) & 0x0F0F0F0Fu) | h[0],
                          ((r.q[1] >> shift) & 0x0F0F0F0Fu) | h[1]};
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = d * byte_f(v[i >> 2], i & 3, 16.f);
#else
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const u32 v = ((r.q[i >> 2] >> (8 * (i & 3) + shift)) & 0xF) | (((qh >> i) & 1) << 4);
            w[i] = d * u2f(v, 16.f);
        }
#endif
    }
};

struct Q6_K {  // 210-byte blocks: 2-byte loads
    static constexpr int BLOCK = 256, BYTES = 210;
    struct Raw {
        u32 ql[2], qh[2];  // the run's 8 low-nibble bytes and 8 high-bit bytes
        u32 meta;          // f16 d | the run's i8 scale << 16 | quarter << 24
    };
    __device__ static Raw fetch(const u8* b, int j) {
        const int e = j * 8, h = e >> 7, quarter = (e & 127) >> 5, l0 = e & 31;
        const u8* pl = b + 64 * h + (quarter & 1) * 32 + l0;
        const u8* ph = b + 128 + 32 * h + l0;
        const int k = 8 * h + (l0 >> 4) + 2 * quarter;  // the run's scale byte
        Raw r;
        r.ql[0] = ldg_u16(pl) | (ldg_u16(pl + 2) << 16);
        r.ql[1] = ldg_u16(pl + 4) | (ldg_u16(pl + 6) << 16);
        r.qh[0] = ldg_u16(ph) | (ldg_u16(ph + 2) << 16);
        r.qh[1] = ldg_u16(ph + 4) | (ldg_u16(ph + 6) << 16);
        const u32 sc = (ldg_u16(b + 192 + (k & ~1)) >> ((k & 1) * 8)) & 0xFF;
        r.meta = ldg_u16(b + 208) | (sc << 16) | ((u32)quarter << 24);
        return r;
    }
    __device__ static void decode(const Raw& r, float* w) {
        const float d = f16_bits((u16)(r.meta & 0xFFFF)) * (float)(int)(signed char)(r.meta >> 16);
        const u32 quarter = r.meta >> 24, lshift = (quarter >> 1) * 4, hshift = quarter * 2;
#if SPLIT_DECODE == 2  // the 6-bit values of a word's 4 bytes formed at once, one permute each
        u32 v[2];
#pragma unroll
        for (int j = 0; j < 2; j++)
            v[j] = ((r.ql[j] >> lshift) & 0x0F0F0F0Fu) |
                   (((r.qh[j] >> hshift) & 0x03030303u) << 4);
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = d * byte_f(v[i >> 2], i & 3, 32.f);
#else
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const u32 lo = (r.ql[i >> 2] >> (8 * (i & 3) + lshift)) & 0xF;
            const u32 hi = (r.qh[i >> 2] >> (8 * (i & 3) + hshift)) & 3;
            w[i] = d * u2f(lo | (hi << 4), 32.f);
        }
#endif
    }
};

}  // namespace split

// Any gguf_blocks*.cuh format: the fetch decodes the run's 8 values (the compiler still issues a
// batch's loads ahead of their arithmetic: the runs are independent).
template <typename B>
struct Whole {
    static constexpr int BLOCK = B::BLOCK, BYTES = B::BYTES;
    struct Raw {
        float w[8];
    };
    __device__ static Raw fetch(const u8* b, int j) {
        Raw r;
        B::load(b, j, r.w);
        return r;
    }
    __device__ static void decode(const Raw& r, float* w) {
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = r.w[i];
    }
};

template <typename B>
struct SplitFormat {
    typedef Whole<B> T;
};
template <>
struct SplitFormat<Q8_0> {
    typedef split::Q8_0 T;
};
template <>
struct SplitFormat<F32> {
    typedef split::F32 T;
};
template <>
struct SplitFormat<F16> {
    typedef split::F16 T;
};
template <>
struct SplitFormat<BF16> {
    typedef split::BF16 T;
};
#if SPLIT_BLOCKS  // 0: the block formats through Whole<> (for timing comparisons)
template <>
struct SplitFormat<Q4_K> {
    typedef split::Q4_K T;
};
template <>
struct SplitFormat<Q5_0> {
    typedef split::Q5_0 T;
};
template <>
struct SplitFormat<Q6_K> {
    typedef split::Q6_K T;
};
#endif
