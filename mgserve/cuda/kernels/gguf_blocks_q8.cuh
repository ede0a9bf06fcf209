// GGUF block formats as the int8-activation kernels read them, shared by matvec_q8.cu and
// moe_q8.cu: with dp4a (one token at a time) and with int8 mma (several tokens). Block layouts:
// gguf_blocks.cuh.
#pragma once
#include "gguf_loads.cuh"
#include "mma.cuh"

__device__ __forceinline__ int dot4(u32 a, u32 b, int acc) { return __dp4a((int)a, (int)b, acc); }

// Each byte of v, in [0, 2C) (C <= 64), minus C as an int8: per byte v + 128 - C stays below 256
// (no carry into the next byte) and flipping bit 7 takes the 128 back. The same bytes as
// __vsubss4(v, C * 0x01010101) there (nothing saturates) in 2 instructions instead of its
// emulation's ~13 on sm_90 (a Q6_K or Q5_0 dp4a's decode; with several tokens it ran per token).
template <int C>
__device__ __forceinline__ u32 unbias4(u32 v) {
    static_assert(C > 0 && C <= 64, "bytes in [0, 2C) with 2C <= 128");
    return (v + (128u - C) * 0x01010101u) ^ 0x80808080u;
}

// (float)i exactly for -2^22 <= i < 2^22, on the fp32 pipe (I2F issues at a quarter of its rate):
// the float with bits 0x4B400000 + i is 1.5 * 2^23 + i.
__device__ __forceinline__ float i2f(int i) {
    return __fsub_rn(__int_as_float(0x4B400000 + i), 12582912.f);
}

// ---- formats -----------------------------------------------------------------------------------
// Each format: BLOCK values and BYTES bytes per block, CHUNKS work items per block. A chunk's
// contribution is SUMS exact integer sums (dp4a or mma) turned into a float by finish(sc, s, j,
// xd) from its scales sc (Sc, head(blk, j)) and the block's activation scales xd (BLOCK / 32),
// with rounding pinned by explicit intrinsics so that every kernel gets the same bits from the
// same sums. dp4a: a Frag holds one chunk's quants, load(blk, j) fetches chunk j of the block at
// blk (Q5_0 and Q6_K also decode them to int8 words there, once per chunk and row: the
// several-token kernels call dot per token, and their decode was most of the work), dot(frag, j,
// xq, xd) its contribution given the block's int8 activations xq.
// mma (m16n8k32, A = activations of token gid in rows gid and gid + 8, B = weights of row gid;
// mma.cuh): a tile is TILE_CHUNKS chunks; tile(blk, j, xq, tig, c) computes its MMAS outputs,
// whose halves (c0, c1: A row gid; c2, c3: row gid + 8) are sums 2 m and 2 m + 1 of the chunk
// (TILE_CHUNKS 1) or sum 0 of chunks j and j + 1 (TILE_CHUNKS 2).

// Q8_0 34 / 32: f16 d | 32 x i8. Chunk j: values 16j..16j+15.
struct Q8_0 {
    static constexpr int BLOCK = 32, BYTES = 34, CHUNKS = 2, SUMS = 1, TILE_CHUNKS = 2, MMAS = 1;
    typedef float Sc;  // d
    struct Frag { u32 q[4]; Sc sc; };
    __device__ static Sc head(const u8* b, int) { return ld_f16(b); }
    __device__ static Frag load(const u8* b, int j) {
        Frag f;
        const u8* p = b + 2 + 16 * j;
#pragma unroll
        for (int i = 0; i < 4; i++) f.q[i] = ld_u32(p + 4 * i);
        f.sc = head(b, j);
        return f;
    }
    __device__ static float finish(Sc d, const int* s, int, const float* xd) {
        return __fmul_rn(__fmul_rn(d, xd[0]), i2f(s[0]));
    }
    __device__ static float dot(const Frag& f, int j, const i8* xq, const float* xd) {
        const uint4 a = *(const uint4*)(xq + 16 * j);
        int s = dot4(f.q[0], a.x, 0);
        s = dot4(f.q[1], a.y, s);
        s = dot4(f.q[2], a.z, s);
        s = dot4(f.q[3], a.w, s);
        return finish(f.sc, &s, j, xd);
    }
    // the block (j = 0): half 0 = chunk 0 (values 0..15), half 1 = chunk 1 (16..31)
    __device__ static void tile(const u8* b, int, const i8* xq, int tig, int (&c)[MMAS][4]) {
        const u32 a[4] = {*(const u32*)(xq + 4 * tig), 0u, 0u, *(const u32*)(xq + 16 + 4 * tig)};
        mma_s8(c[0], a, ld_u32(b + 2 + 4 * tig), ld_u32(b + 18 + 4 * tig));
    }
};

// Q5_0 22 / 32: f16 d | u32 qh | 16 nibbles; v = low nibble (values 0..15) or high nibble
// (16..31) with qh bit e as 5th bit, minus 16. Chunk j: qs bytes 8j..8j+7, i.e. values 8j..8j+7
// and 16+8j..16+8j+7.
struct Q5_0 {
    static constexpr int BLOCK = 32, BYTES = 22, CHUNKS = 2, SUMS = 1, TILE_CHUNKS = 2, MMAS = 1;
    typedef float Sc;  // d
    // the chunk's values as int8 words, decoded once per chunk and row (load), not per token:
    // v[2 i] low nibbles (values 8j + 4i..), v[2 i + 1] high ones (16 + 8j + 4i..)
    struct Frag { u32 v[4]; Sc sc; };
    __device__ static Sc head(const u8* b, int) { return ld_f16(b); }
    __device__ static Frag load(const u8* b, int j) {
        Frag f;
        const u32 qh = ld_u32(b + 2);
#pragma unroll
        for (int i = 0; i < 2; i++) {
            const u32 q = ld_u32(b + 6 + 8 * j + 4 * i);
            f.v[2 * i] = unbias4<16>((q & 0x0F0F0F0Fu) | hi4(qh, 8 * j + 4 * i));
            f.v[2 * i + 1] = unbias4<16>(((q >> 4) & 0x0F0F0F0Fu) | hi4(qh, 16 + 8 * j + 4 * i));
        }
        f.sc = head(b, j);
        return f;
    }
    // the 4 bits qh >> (base .. base+3) spread to bit 4 of each byte
    __device__ static u32 hi4(u32 qh, int base) {
        const u32 h = (qh >> base) & 0xF;
        return ((h & 1) << 4) | ((h & 2) << 11) | ((h & 4) << 18) | ((h & 8) << 25);
    }
    __device__ static float dot(const Frag& f, int j, const i8* xq, const float* xd) {
        const uint2 lo = *(const uint2*)(xq + 8 * j), hi = *(const uint2*)(xq + 16 + 8 * j);
        int s = 0;
#pragma unroll
        for (int i = 0; i < 2; i++) {
            s = dot4(f.v[2 * i], i ? lo.y : lo.x, s);
            s = dot4(f.v[2 * i + 1], i ? hi.y : hi.x, s);
        }
        return finish(f.sc, &s, j, xd);
    }
    __device__ static float finish(Sc d, const int* s, int, const float* xd) {
        return __fmul_rn(__fmul_rn(d, xd[0]), i2f(s[0]));
    }
    // the block (j = 0): half h = chunk h, k slots 16 h + 0..7 its low nibbles (values 8 h..),
    // 16 h + 8..15 its high ones (16 + 8 h..); lane tig takes slots 4 tig.. of both halves
    __device__ static void tile(const u8* b, int, const i8* xq, int tig, int (&c)[MMAS][4]) {
        const int o = 4 * (tig & 1), sh = 4 * (tig >> 1), v0 = 16 * (tig >> 1) + o;
        const u32 qh = ld_u32(b + 2);
        const u32 w0 = (ld_u32(b + 6 + o) >> sh) & 0x0F0F0F0Fu;
        const u32 w1 = (ld_u32(b + 14 + o) >> sh) & 0x0F0F0F0Fu;
        const u32 b0 = unbias4<16>(w0 | hi4(qh, v0));
        const u32 b1 = unbias4<16>(w1 | hi4(qh, v0 + 8));
        const u32 a[4] = {*(const u32*)(xq + v0), 0u, 0u, *(const u32*)(xq + v0 + 8)};
        mma_s8(c[0], a, b0, b1);
    }
};

// Q4_K 144 / 256: f16 d, f16 dmin | 12 bytes of 6-bit scales/mins | 128 nibbles; sub-block s
// (32 values) is v = d * sc[s] * q - dmin * m[s]. qs bytes 32c..32c+31 hold sub-block 2c (low
// nibbles) and 2c+1 (high). Chunk j: the 16 bytes 16j.. (c = j / 2, positions 16 (j & 1)..+15).
struct Q4_K {
    static constexpr int BLOCK = 256, BYTES = 144, CHUNKS = 8, SUMS = 4, TILE_CHUNKS = 1, MMAS = 2;
    struct Sc { float d, dmin; int sc0, m0, sc1, m1; };  // of sub-blocks s0 = 2 (j / 2), s0 + 1
    struct Frag { uint4 q; Sc sc; };  // raw nibbles (split per token: fewer registers at 8)
    __device__ static Sc head(const u8* b, int j) {
        const uint4 h = *(const uint4*)b;  // blocks are 144 = 9 * 16 bytes: aligned
        const u32 w[3] = {h.y, h.z, h.w};
        Sc sc;
        sc.d = f16_bits((u16)(h.x & 0xFFFF));
        sc.dmin = f16_bits((u16)(h.x >> 16));
        scale_min(w, 2 * (j >> 1), &sc.sc0, &sc.m0);
        scale_min(w, 2 * (j >> 1) + 1, &sc.sc1, &sc.m1);
        return sc;
    }
    __device__ static Frag load(const u8* b, int j) {
        Frag f;
        f.q = *(const uint4*)(b + 16 + 16 * j);
        f.sc = head(b, j);
        return f;
    }
    // ggml's get_scale_min_k4 on the 12 scale bytes as three words (byte i of word w at 8 i);
    // shifts, not a byte array, so that a run-time s does not move the words to local memory
    __device__ static void scale_min(const u32* w, int s, int* sc, int* mn) {
        const int sh = 8 * (s & 3);
        const u32 b0 = (w[0] >> sh) & 0xFF, b1 = (w[1] >> sh) & 0xFF, b2 = (w[2] >> sh) & 0xFF;
        if (s < 4) {
            *sc = b0 & 63;
            *mn = b1 & 63;
        } else {
            *sc = (b2 & 0xF) | ((b0 >> 6) << 4);
            *mn = (b2 >> 4) | ((b1 >> 6) << 4);
        }
    }
    __device__ static float dot(const Frag& f, int j, const i8* xq, const float* xd) {
        const int s0 = 2 * (j >> 1), pos = 16 * (j & 1);
        const uint4 a = *(const uint4*)(xq + 32 * s0 + pos);
        const uint4 c = *(const uint4*)(xq + 32 * (s0 + 1) + pos);
        const u32 q[4] = {f.q.x, f.q.y, f.q.z, f.q.w};
        const u32 xa[4] = {a.x, a.y, a.z, a.w}, xc[4] = {c.x, c.y, c.z, c.w};
        int s[SUMS] = {};  // dl, dh, and the sums of the activations the mins multiply
#pragma unroll
        for (int i = 0; i < 4; i++) {
            s[0] = dot4(q[i] & 0x0F0F0F0Fu, xa[i], s[0]);
            s[1] = dot4((q[i] >> 4) & 0x0F0F0F0Fu, xc[i], s[1]);
            s[2] = dot4(0x01010101u, xa[i], s[2]);
            s[3] = dot4(0x01010101u, xc[i], s[3]);
        }
        return finish(f.sc, s, j, xd);
    }
    // xd[s0] (d sc0 dl - dmin m0 sl) + xd[s0 + 1] (d sc1 dh - dmin m1 sh)
    __device__ static float finish(const Sc& c, const int* s, int j, const float* xd) {
        const int s0 = 2 * (j >> 1);
        const float lo = __fmaf_rn(c.d, i2f(c.sc0 * s[0]), -__fmul_rn(c.dmin, i2f(c.m0 * s[2])));
        const float hi = __fmaf_rn(c.d, i2f(c.sc1 * s[1]), -__fmul_rn(c.dmin, i2f(c.m1 * s[3])));
        return __fmaf_rn(xd[s0 + 1], hi, __fmul_rn(xd[s0], lo));
    }
    // chunk j: k slots 0..15 its low nibbles (sub-block s0), 16..31 its high ones (s0 + 1);
    // the second mma multiplies by ones: the activation sums
    __device__ static void tile(const u8* b, int j, const i8* xq, int tig, int (&c)[MMAS][4]) {
        const int x0 = 64 * (j >> 1) + 16 * (j & 1) + 4 * tig;
        const u32 q = *(const u32*)(b + 16 + 16 * j + 4 * tig);
        const u32 a[4] = {*(const u32*)(xq + x0), 0u, 0u, *(const u32*)(xq + x0 + 32)};
        mma_s8(c[0], a, q & 0x0F0F0F0Fu, (q >> 4) & 0x0F0F0F0Fu);
        mma_s8(c[1], a, 0x01010101u, 0x01010101u);
    }
};

// Q6_K 210 / 256: 128 ql | 64 qh | 16 x i8 scales | f16 d. Half h (128 values), quarter q
// (32 values), position l: low 4 bits at ql[64h + 32 (q & 1) + l] >> 4 (q >> 1), high 2 bits at
// qh[32h + l] >> 2q, scale sc[8h + l / 16 + 2q], v = d * sc * (bits - 32). Chunk j: half j / 4,
// positions 8 (j & 3)..+7 of all four quarters (8 + 8 + 8 bytes of ql, ql, qh).
struct Q6_K {
    static constexpr int BLOCK = 256, BYTES = 210, CHUNKS = 8, SUMS = 4, TILE_CHUNKS = 1, MMAS = 2;
    struct Sc { u32 sc; float d; };  // the four quarters' i8 scales, one per byte
    // the chunk's values as int8 words, decoded once per chunk and row (load), not per token:
    // v[2 q + i] quarter q's values 4i..4i+3 of the chunk's 8
    struct Frag { u32 v[8]; Sc sc; };
    // scales 8h + (l0 / 16) + {0, 2, 4, 6}: the bytes at 192 + 8h + l0/16 + 2q
    __device__ static Sc head(const u8* b, int j) {
        const u8* scp = b + 192 + 8 * (j >> 2) + ((j & 3) >> 1);
        return {scp[0] | (scp[2] << 8) | (scp[4] << 16) | ((u32)scp[6] << 24), ld_f16(b + 208)};
    }
    __device__ static Frag load(const u8* b, int j) {
        Frag f;
        const int h = j >> 2, l0 = 8 * (j & 3);
        const u8* qlp = b + 64 * h + l0;
        const u32 ql[4] = {ld_u32(qlp), ld_u32(qlp + 4), ld_u32(qlp + 32), ld_u32(qlp + 36)};
        const u32 qh[2] = {ld_u32(b + 128 + 32 * h + l0), ld_u32(b + 132 + 32 * h + l0)};
#pragma unroll
        for (int q = 0; q < 4; q++)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const u32 lo = (ql[2 * (q & 1) + i] >> (4 * (q >> 1))) & 0x0F0F0F0Fu;
                const u32 hi = ((qh[i] >> (2 * q)) & 0x03030303u) << 4;
                f.v[2 * q + i] = unbias4<32>(lo | hi);
            }
        f.sc = head(b, j);
        return f;
    }
    __device__ static float dot(const Frag& f, int j, const i8* xq, const float* xd) {
        const int h = j >> 2, l0 = 8 * (j & 3);
        int s[SUMS];  // per quarter
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const uint2 xa = *(const uint2*)(xq + 128 * h + 32 * q + l0);
            s[q] = 0;
#pragma unroll
            for (int i = 0; i < 2; i++) s[q] = dot4(f.v[2 * q + i], i ? xa.y : xa.x, s[q]);
        }
        return finish(f.sc, s, j, xd);
    }
    // d * sum over the quarters q of xd[4h + q] * sc[q] * s[q], summed in q's order
    __device__ static float finish(const Sc& c, const int* s, int j, const float* xd) {
        float acc = 0.f;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const int sc = (int)(i8)((c.sc >> (8 * q)) & 0xFF);
            acc = __fmaf_rn(xd[4 * (j >> 2) + q], i2f(sc * s[q]), acc);
        }
        return __fmul_rn(c.d, acc);
    }
    // chunk j: k slots 8 q + 0..7 quarter q (lane tig: quarter tig / 2 in slots 4 tig.., quarter
    // 2 + tig / 2 in 16 + 4 tig..); mma m sums quarters 2 m (A row gid) and 2 m + 1 (gid + 8)
    __device__ static void tile(const u8* b, int j, const i8* xq, int tig, int (&c)[MMAS][4]) {
        const int h = j >> 2, l = 8 * (j & 3) + 4 * (tig & 1), q = tig >> 1;
        const u32 ql = ld_u32(b + 64 * h + 32 * q + l), qh = ld_u32(b + 128 + 32 * h + l);
        const u32 b0 = unbias4<32>((ql & 0x0F0F0F0Fu) | (((qh >> (2 * q)) & 0x03030303u) << 4));
        const u32 b1 =
            unbias4<32>(((ql >> 4) & 0x0F0F0F0Fu) | (((qh >> (2 * q + 4)) & 0x03030303u) << 4));
        const u32 xa = *(const u32*)(xq + 128 * h + 32 * q + l);
        const u32 xc = *(const u32*)(xq + 128 * h + 32 * (q + 2) + l);
        const u32 lo[4] = {q ? 0u : xa, q ? xa : 0u, 0u, 0u};
        const u32 hi[4] = {0u, 0u, q ? 0u : xc, q ? xc : 0u};
        mma_s8(c[0], lo, b0, b1);
        mma_s8(c[1], hi, b0, b1);
    }
};
