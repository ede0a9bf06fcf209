// qgemm_wgmma.cu's W tiles read by half row-steps (QW_ROWS, QWgmmaTuning.rows): a step's 64
// values of a W row in two items, a thread each, where the runs' reader gives a thread one
// 8-value run of each of several rows. An item's loads are few and wide, and its block header
// (scales) serves 32 values, not 8. Each format's values are its runs' reader's (gguf_split.cuh's
// split readers; gguf_blocks.cuh's decoders through Whole<> for Q5_K and Q5_1): the same
// arithmetic, the same f16, written to the tile's 16-byte chunks (8 values of k each) in the
// 128-byte swizzle.
//
// RowSteps<T>: ON for the formats with an item reader; load(row, k0, k, h, valid) fetches half
// h of the step at k0 of the row at `row` (nothing where !valid: its chunks are zeros), and
// store(tile, r, h, raw) writes its four chunks of tile row r. Host-compiled by
// tests/cuda/test_qgemm_rows_host.py (so only gguf_split.cuh's and scalar.cuh's device code).
#pragma once

#include "gguf_split.cuh"
#include "scalar.cuh"

// chunk c (16 bytes) of tile row r in the 128-byte swizzle (wgmma.cuh)
__device__ __forceinline__ unsigned swz128(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

__device__ __forceinline__ void store_chunk(unsigned char* tile, int r, int c, const float* w) {
    *(uint4*)(tile + swz128(r, c)) = f16x8_rn(w);
}

// the step's chunks 4 h..4 h + 3 of tile row r as zeros (half h of an invalid item: past the
// row's k or past n_rows), the bits f16x8_rn writes for +0
__device__ __forceinline__ void store_zeros(unsigned char* tile, int r, int h) {
#pragma unroll
    for (int c = 0; c < 4; c++) *(uint4*)(tile + swz128(r, 4 * h + c)) = uint4{0, 0, 0, 0};
}

template <typename T>
struct RowSteps {
    static constexpr bool ON = false;
    struct Raw {};
    __device__ static Raw load(const u8*, int, int, int, bool) { return Raw{}; }
    __device__ static void store(unsigned char*, int, int, const Raw&) {}
};

// Q4_K: a step's 64 values are group j = k0 % 256 / 64 of the row's block, quant bytes 32 j..
// of its 128. Half h's bytes 16 h..16 h + 15 hold in their low nibbles values 16 h.. of
// sub-block 2 j (chunks 2 h, 2 h + 1 of the step) and in their high nibbles values 16 h.. of
// sub-block 2 j + 1 (chunks 4 + 2 h, 5 + 2 h): two 16-byte loads (those bytes and the block's
// header: d, dmin, the 12 scale bytes) and two scale / min pairs for 32 values, where the runs'
// reader makes four runs' five loads and four pairs.
// Q5_K (FIFTH; 176 bytes: the header as Q4_K's | qh[32] | qs[128]): the same items, each
// value's fifth bit from qh byte l (bit 2 j of the low nibbles' values, 2 j + 1 of the high
// ones'), half h's 16 qh bytes one more 16-byte load. The values of gguf_blocks.cuh's Q5_K
// (Whole<Q5_K>, which qgemm_dequant and the runs read): d x sc x v - dmin x mn with the same
// products. (Q4_K's instructions are those it had as a reader of its own: no qh is loaded or
// used without FIFTH.)
template <bool FIFTH>
struct KQuantRows {
    static constexpr bool ON = true;
    static constexpr int BYTES = FIFTH ? Q5_K::BYTES : split::Q4_K::BYTES;
    static constexpr int QS = FIFTH ? 48 : 16;  // the quant bytes' offset in the block
    struct Raw {
        uint4 head, qh, q;
        int j;
    };
    __device__ static Raw load(const u8* row, int k0, int k, int h, bool valid) {
        Raw r{{0, 0, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0}, (int)((unsigned)k0 % 256 / 64)};
        if (valid && k0 < k) {  // (k is a multiple of 256: a step is wholly in or out)
            const u8* b = row + (size_t)((unsigned)k0 / 256) * BYTES;
            r.head = __ldg((const uint4*)b);
            if (FIFTH) r.qh = __ldg((const uint4*)(b + 16 + 16 * h));
            r.q = __ldg((const uint4*)(b + QS + 32 * r.j + 16 * h));
        }
        return r;
    }
    // the 4-bit values of bytes q (low nibbles, or the high ones when `high`), each with its
    // fifth bit from bit s of its qh byte with FIFTH
    __device__ static u32 nibbles(u32 q, u32 qh, u32 s, bool high) {
        const u32 v = (high ? q >> 4 : q) & 0x0F0F0F0Fu;
        return FIFTH ? v | (((qh >> s) & 0x01010101u) << 4) : v;
    }
    __device__ static void store(unsigned char* tile, int r, int h, const Raw& raw) {
        const uint4 hd = raw.head;
        float d0, m0, d1, m1, w[8];
        split::Q4_K::scale_min(hd.x, hd.y, hd.z, hd.w, 2 * raw.j, d0, m0);
        split::Q4_K::scale_min(hd.x, hd.y, hd.z, hd.w, 2 * raw.j + 1, d1, m1);
        const u32 q[4] = {raw.q.x, raw.q.y, raw.q.z, raw.q.w};
        const u32 qh[4] = {raw.qh.x, raw.qh.y, raw.qh.z, raw.qh.w};
        const u32 s0 = 2 * raw.j, s1 = s0 + 1;
#pragma unroll
        for (int c = 0; c < 2; c++) {  // bytes 8 c..8 c + 7 of the half
            const int a = 2 * c, b = 2 * c + 1;
            split::Q4_K::values(d0, m0, nibbles(q[a], qh[a], s0, false),
                                nibbles(q[b], qh[b], s0, false), w);
            store_chunk(tile, r, 2 * h + c, w);
            split::Q4_K::values(d1, m1, nibbles(q[a], qh[a], s1, true),
                                nibbles(q[b], qh[b], s1, true), w);
            store_chunk(tile, r, 4 + 2 * h + c, w);
        }
    }
};

template <>
struct RowSteps<split::Q4_K> : KQuantRows<false> {};

template <>
struct RowSteps<Whole<Q5_K>> : KQuantRows<true> {};  // (SplitFormat<Q5_K>: decode at fetch)

// Blocks of 32 values (Q5_0, Q8_0): half h is block k0 / 32 + h, the step's chunks 4 h..4 h + 3
// (its runs 0..3). Its BYTES (even) start 2-byte aligned: the words from the one below are
// loaded (the last as 2 bytes where it would pass the block) and shifted into place.
template <int N>
struct BlockWords {
    u32 w[N];
    u32 shift;  // 8 x the block's offset in the first word (0 or 16)
    bool valid;
    __device__ void load(const u8* b) {
        const unsigned off = (unsigned)(size_t)b & 3u;
        const u32* base = (const u32*)(b - off);
#pragma unroll
        for (int i = 0; i < N - 1; i++) w[i] = __ldg(base + i);
        w[N - 1] = off ? __ldg(base + N - 1) : split::ldg_u16((const u8*)(base + N - 1));
        shift = 8 * off;
    }
    // bytes 4 i + o..4 i + o + 3 of the block (o 0 or 2), from the words
    __device__ u32 at(int i, int o) const {
        const u32 lo = __funnelshift_r(w[i], w[i + 1], shift);
        const u32 hi = i + 2 < N ? __funnelshift_r(w[i + 1], w[i + 2], shift) : w[i + 1] >> shift;
        return o ? __funnelshift_r(lo, hi, 16) : lo;
    }
};

// An item of a 32-value block format T from N words (its load; the format gives store)
template <typename T, int N>
struct Block32Rows {
    static constexpr bool ON = true;
    typedef BlockWords<N> Raw;
    __device__ static Raw load(const u8* row, int k0, int k, int h, bool valid) {
        Raw r;
        r.valid = valid && k0 + 32 * h < k;
        if (r.valid) r.load(row + (size_t)(k0 / 32 + h) * T::BYTES);
        return r;
    }
};

// Q5_0 (22 bytes: f16 d | u32 qh | 16 bytes of nibbles): 6 words
template <>
struct RowSteps<split::Q5_0> : Block32Rows<split::Q5_0, 6> {
    __device__ static void store(unsigned char* tile, int r, int h, const Raw& raw) {
        if (!raw.valid) return store_zeros(tile, r, h);
        float w[8];
        const u32 b0 = raw.at(0, 0), qh = raw.at(0, 2);  // bytes 0..3, 2..5
        const u32 qs[4] = {raw.at(1, 2), raw.at(2, 2), raw.at(3, 2), raw.at(4, 2)};  // 6..21
#pragma unroll
        for (int c = 0; c < 4; c++) {  // run c: split::Q5_0::fetch(block, c)'s raw bits
            split::Q5_0::Raw run;
            run.meta =
                (b0 & 0xFFFFu) | (((qh >> (8 * c)) & 0xFFu) << 16) | ((u32)(c >> 1) * 4 << 24);
            run.q[0] = qs[2 * (c & 1)];
            run.q[1] = qs[2 * (c & 1) + 1];
            split::Q5_0::decode(run, w);
            store_chunk(tile, r, 4 * h + c, w);
        }
    }
};

// Q8_0 (34 bytes: f16 d | 32 int8): 9 words
template <>
struct RowSteps<split::Q8_0> : Block32Rows<split::Q8_0, 9> {
    __device__ static void store(unsigned char* tile, int r, int h, const Raw& raw) {
        if (!raw.valid) return store_zeros(tile, r, h);
        float w[8];
        const u32 d = raw.at(0, 0) & 0xFFFFu;
#pragma unroll
        for (int c = 0; c < 4; c++) {  // run c: bytes 2 + 8 c.. (split::Q8_0::fetch(block, c))
            split::Q8_0::Raw run;
            run.d = d;
            run.q[0] = raw.at(2 * c, 2);
            run.q[1] = raw.at(2 * c + 1, 2);
            split::Q8_0::decode(run, w);
            store_chunk(tile, r, 4 * h + c, w);
        }
    }
};

// Q5_1 (24 bytes, 8-byte aligned: f16 d | f16 m | u32 qh | 16 bytes of nibbles): three 8-byte
// loads; value = d v + m as gguf_blocks.cuh's Q5_1 (Whole<Q5_1>: the runs and qgemm_dequant).
template <>
struct RowSteps<Whole<Q5_1>> {  // (SplitFormat<Q5_1>: the runs decode at fetch)
    static constexpr bool ON = true;
    struct Raw {
        uint2 w[3];
        bool valid;
    };
    __device__ static Raw load(const u8* row, int k0, int k, int h, bool valid) {
        Raw r;
        r.valid = valid && k0 + 32 * h < k;
        if (r.valid) {
            const uint2* b = (const uint2*)(row + (size_t)(k0 / 32 + h) * Q5_1::BYTES);
#pragma unroll
            for (int i = 0; i < 3; i++) r.w[i] = __ldg(b + i);
        }
        return r;
    }
    __device__ static void store(unsigned char* tile, int r, int h, const Raw& raw) {
        if (!raw.valid) return store_zeros(tile, r, h);
        float w[8];
        const float d = f16_bits((u16)(raw.w[0].x & 0xFFFF)), m = f16_bits((u16)(raw.w[0].x >> 16));
        const u32 qh = raw.w[0].y, qs[4] = {raw.w[1].x, raw.w[1].y, raw.w[2].x, raw.w[2].y};
#pragma unroll
        for (int c = 0; c < 4; c++) {  // run c: qs bytes 8 (c & 1).., nibble c >> 1, qh byte c
            const u32 hb = (qh >> (8 * c)) & 0xFFu, shift = (c >> 1) * 4;
            // bit k of a 4-bit x times 0x02040810 lands on bit 8 k + 4 (Q5_0's decode)
            const u32 v[2] = {((qs[2 * (c & 1)] >> shift) & 0x0F0F0F0Fu) |
                                  (((hb & 0xF) * 0x02040810u) & 0x10101010u),
                              ((qs[2 * (c & 1) + 1] >> shift) & 0x0F0F0F0Fu) |
                                  (((hb >> 4) * 0x02040810u) & 0x10101010u)};
#pragma unroll
            for (int i = 0; i < 8; i++) w[i] = d * byte_f(v[i >> 2], i & 3, 0.f) + m;
            store_chunk(tile, r, 4 * h + c, w);
        }
    }
};

// Q6_K (210 bytes: ql[128] low nibbles | qh[64] high bit pairs | 16 int8 scales | f16 d): a
// step's 64 values are quarters 2 (j & 1), + 1 of the block's half j >> 1 (j = k0 % 256 / 64),
// half h of the step quarter q = 2 (j & 1) + h: 32 ql bytes (low nibbles of the half's first or
// second 32 for q = 0, 1, high nibbles for 2, 3), the half's 32 qh bytes (bit pair q), scale
// bytes 8 (j >> 1) + 2 q + 0 / 1 (values 0..15 / 16..31) and d. The ql and qh runs are 2-byte
// aligned 32-byte pieces inside the block with bytes after them: 9 words each, shifted into place.
template <>
struct RowSteps<split::Q6_K> {
    static constexpr bool ON = true;
    struct Raw {
        u32 ql[9], qh[9], scd, shift;  // scd: the two scale bytes | d << 16
        int q;
        bool valid;
    };
    __device__ static Raw load(const u8* row, int k0, int k, int h, bool valid) {
        Raw r;
        const int j = (int)((unsigned)k0 % 256 / 64), half = j >> 1;
        r.q = 2 * (j & 1) + h;
        r.valid = valid && k0 < k;  // (k is a multiple of 256: a step is wholly in or out)
        if (r.valid) {
            const u8* b = row + (size_t)((unsigned)k0 / 256) * split::Q6_K::BYTES;
            const unsigned off = (unsigned)(size_t)b & 3u;
            const u32* pl = (const u32*)(b - off + 64 * half + 32 * (r.q & 1));
            const u32* ph = (const u32*)(b - off + 128 + 32 * half);
#pragma unroll
            for (int i = 0; i < 9; i++) {
                r.ql[i] = __ldg(pl + i);
                r.qh[i] = __ldg(ph + i);
            }
            r.scd = split::ldg_u16(b + 192 + 8 * half + 2 * r.q) | split::ldg_u16(b + 208) << 16;
            r.shift = 8 * off;
        }
        return r;
    }
    __device__ static void store(unsigned char* tile, int r, int h, const Raw& raw) {
        if (!raw.valid) return store_zeros(tile, r, h);
        float w[8];
#pragma unroll
        for (int c = 0; c < 4; c++) {  // run c: l = 8 c..8 c + 7 (split::Q6_K::fetch's bits)
            split::Q6_K::Raw run;
#pragma unroll
            for (int i = 0; i < 2; i++) {
                run.ql[i] = __funnelshift_r(raw.ql[2 * c + i], raw.ql[2 * c + i + 1], raw.shift);
                run.qh[i] = __funnelshift_r(raw.qh[2 * c + i], raw.qh[2 * c + i + 1], raw.shift);
            }
            const u32 sc = (raw.scd >> (8 * (c >> 1))) & 0xFFu;  // values 0..15, then 16..31
            run.meta = (raw.scd >> 16) | (sc << 16) | ((u32)raw.q << 24);
            split::Q6_K::decode(run, w);
            store_chunk(tile, r, 4 * h + c, w);
        }
    }
};

