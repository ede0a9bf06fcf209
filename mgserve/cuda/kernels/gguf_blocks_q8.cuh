// GGUF block formats as the int8-activation (dp4a) kernels read them, shared by matvec_q8.cu and
// moe_q8.cu. Block layouts: gguf_blocks.cuh.
#pragma once
#include "gguf_loads.cuh"

__device__ __forceinline__ int dot4(u32 a, u32 b, int acc) { return __dp4a((int)a, (int)b, acc); }

// ---- formats -----------------------------------------------------------------------------------
// Each format: BLOCK values and BYTES bytes per block, CHUNKS work items per block; a Frag holds
// one chunk's raw quants, load(blk, j) fetches chunk j of the block at blk, and
// dot(frag, blk, j, xq, xd) returns chunk j's contribution given the block's 32-aligned int8
// activations xq (BLOCK values) and their scales xd (BLOCK / 32).

// Q8_0 34 / 32: f16 d | 32 x i8. Chunk j: values 16j..16j+15.
struct Q8_0 {
    static constexpr int BLOCK = 32, BYTES = 34, CHUNKS = 2;
    struct Frag { u32 q[4]; float d; };
    __device__ static Frag load(const u8* b, int j) {
        Frag f;
        const u8* p = b + 2 + 16 * j;
#pragma unroll
        for (int i = 0; i < 4; i++) f.q[i] = ld_u32(p + 4 * i);
        f.d = f16_bits((u16)ld_u16(b));
        return f;
    }
    __device__ static float dot(const Frag& f, int j, const i8* xq, const float* xd) {
        const uint4 a = *(const uint4*)(xq + 16 * j);
        int s = dot4(f.q[0], a.x, 0);
        s = dot4(f.q[1], a.y, s);
        s = dot4(f.q[2], a.z, s);
        s = dot4(f.q[3], a.w, s);
        return f.d * xd[0] * (float)s;
    }
};

// Q5_0 22 / 32: f16 d | u32 qh | 16 nibbles; v = low nibble (values 0..15) or high nibble
// (16..31) with qh bit e as 5th bit, minus 16. Chunk j: qs bytes 8j..8j+7, i.e. values 8j..8j+7
// and 16+8j..16+8j+7.
struct Q5_0 {
    static constexpr int BLOCK = 32, BYTES = 22, CHUNKS = 2;
    struct Frag { u32 q[2]; u32 qh; float d; };
    __device__ static Frag load(const u8* b, int j) {
        Frag f;
        f.q[0] = ld_u32(b + 6 + 8 * j);
        f.q[1] = ld_u32(b + 10 + 8 * j);
        f.qh = ld_u32(b + 2);
        f.d = f16_bits((u16)ld_u16(b));
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
            const u32 vl = (f.q[i] & 0x0F0F0F0Fu) | hi4(f.qh, 8 * j + 4 * i);
            const u32 vh = ((f.q[i] >> 4) & 0x0F0F0F0Fu) | hi4(f.qh, 16 + 8 * j + 4 * i);
            s = dot4(__vsubss4(vl, 0x10101010u), i ? lo.y : lo.x, s);
            s = dot4(__vsubss4(vh, 0x10101010u), i ? hi.y : hi.x, s);
        }
        return f.d * xd[0] * (float)s;
    }
};

// Q4_K 144 / 256: f16 d, f16 dmin | 12 bytes of 6-bit scales/mins | 128 nibbles; sub-block s
// (32 values) is v = d * sc[s] * q - dmin * m[s]. qs bytes 32c..32c+31 hold sub-block 2c (low
// nibbles) and 2c+1 (high). Chunk j: the 16 bytes 16j.. (c = j / 2, positions 16 (j & 1)..+15).
struct Q4_K {
    static constexpr int BLOCK = 256, BYTES = 144, CHUNKS = 8;
    struct Frag { uint4 q; u32 sc[3]; u32 dm; };
    __device__ static Frag load(const u8* b, int j) {
        Frag f;
        f.q = *(const uint4*)(b + 16 + 16 * j);  // blocks are 144 = 9 * 16 bytes: aligned
        const uint4 head = *(const uint4*)b;
        f.dm = head.x;
        f.sc[0] = head.y;
        f.sc[1] = head.z;
        f.sc[2] = head.w;
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
        int dl = 0, dh = 0, sl = 0, sh = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            dl = dot4(q[i] & 0x0F0F0F0Fu, xa[i], dl);
            dh = dot4((q[i] >> 4) & 0x0F0F0F0Fu, xc[i], dh);
            sl = dot4(0x01010101u, xa[i], sl);  // sum of the activations the mins multiply
            sh = dot4(0x01010101u, xc[i], sh);
        }
        int sc0, m0, sc1, m1;
        scale_min(f.sc, s0, &sc0, &m0);
        scale_min(f.sc, s0 + 1, &sc1, &m1);
        const float d = f16_bits((u16)(f.dm & 0xFFFF)), dmin = f16_bits((u16)(f.dm >> 16));
        return xd[s0] * (d * (float)(sc0 * dl) - dmin * (float)(m0 * sl)) +
               xd[s0 + 1] * (d * (float)(sc1 * dh) - dmin * (float)(m1 * sh));
    }
};

// Q6_K 210 / 256: 128 ql | 64 qh | 16 x i8 scales | f16 d. Half h (128 values), quarter q
// (32 values), position l: low 4 bits at ql[64h + 32 (q & 1) + l] >> 4 (q >> 1), high 2 bits at
// qh[32h + l] >> 2q, scale sc[8h + l / 16 + 2q], v = d * sc * (bits - 32). Chunk j: half j / 4,
// positions 8 (j & 3)..+7 of all four quarters (8 + 8 + 8 bytes of ql, ql, qh).
struct Q6_K {
    static constexpr int BLOCK = 256, BYTES = 210, CHUNKS = 8;
    struct Frag { u32 ql[4]; u32 qh[2]; u32 sc; float d; };
    __device__ static Frag load(const u8* b, int j) {
        Frag f;
        const int h = j >> 2, l0 = 8 * (j & 3);
        const u8* ql = b + 64 * h + l0;
        f.ql[0] = ld_u32(ql);
        f.ql[1] = ld_u32(ql + 4);
        f.ql[2] = ld_u32(ql + 32);
        f.ql[3] = ld_u32(ql + 36);
        f.qh[0] = ld_u32(b + 128 + 32 * h + l0);
        f.qh[1] = ld_u32(b + 132 + 32 * h + l0);
        // scales 8h + (l0 / 16) + {0, 2, 4, 6}: the bytes at 192 + 8h + l0/16 + 2q
        const u8* scp = b + 192 + 8 * h + (l0 >> 4);
        f.sc = scp[0] | (scp[2] << 8) | (scp[4] << 16) | ((u32)scp[6] << 24);
        f.d = f16_bits((u16)ld_u16(b + 208));
        return f;
    }
    __device__ static float dot(const Frag& f, int j, const i8* xq, const float* xd) {
        const int h = j >> 2, l0 = 8 * (j & 3);
        float acc = 0.f;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            const uint2 xa = *(const uint2*)(xq + 128 * h + 32 * q + l0);
            int s = 0;
#pragma unroll
            for (int i = 0; i < 2; i++) {
                const u32 lo = (f.ql[2 * (q & 1) + i] >> (4 * (q >> 1))) & 0x0F0F0F0Fu;
                const u32 hi = ((f.qh[i] >> (2 * q)) & 0x03030303u) << 4;
                s = dot4(__vsubss4(lo | hi, 0x20202020u), i ? xa.y : xa.x, s);
            }
            const int sc = (int)(i8)((f.sc >> (8 * q)) & 0xFF);
            acc += xd[4 * h + q] * (float)(sc * s);
        }
        return f.d * acc;
    }
};
