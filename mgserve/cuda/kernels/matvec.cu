// Quantized matrix-vector products y[t, n] = sum_k W[n, k] * x[t, k] that read GGUF blocks directly.
//
// W is one GGUF tensor in its file layout: n_rows rows, each (k / BLOCK) blocks of BYTES bytes.
// x is fp32 [n_tok, k], y is fp32 [n_tok, n_rows]; n_tok is 1..NT (a few decode tokens share one
// pass over the weights, which is what makes batched decode and draft verification cheap).
//
// One warp per output row, ROWS_PER_CTA warps per thread block. Each lane decodes 8 consecutive
// weights at a time (every format below splits evenly into 8-value runs that share one scale),
// multiplies them with 8 activations per token and accumulates in fp32; a shuffle reduction ends
// the row. Block layouts (bytes; ggml's, as gguf-py decodes them):
//
//   Q4_0  18 / 32:  f16 d | 16 nibbles (low: values 0..15, high: 16..31), v = d * (q - 8)
//   Q4_1  20 / 32:  f16 d, f16 m | 16 nibbles, v = d * q + m
//   Q5_0  22 / 32:  f16 d | u32 qh (5th bits) | 16 nibbles, v = d * (q - 16)
//   Q5_1  24 / 32:  f16 d, f16 m | u32 qh | 16 nibbles, v = d * q + m
//   Q8_0  34 / 32:  f16 d | 32 x i8, v = d * q
//   IQ4_NL 18 / 32: f16 d | 16 nibbles, v = d * KVALUES[q]
//   Q4_K 144 / 256: f16 d, f16 dmin | 12 bytes of 6-bit scales/mins | 128 nibbles
//   Q5_K 176 / 256: f16 d, f16 dmin | 12 scales | 32 qh | 128 nibbles
//   Q6_K 210 / 256: 128 ql | 64 qh | 16 x i8 scales | f16 d
//   IQ4_XS 136 / 256: f16 d | u16 scales_h | 4 scales_l | 128 nibbles
//   F32, F16, BF16: plain elements (k must be a multiple of 8)
//
// Rows of most formats are not 4-byte aligned (34, 22, 210 bytes...), so block fields are read
// bytewise; the bytes of one block are shared by its lanes through L1, so DRAM sees each byte once.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef signed char i8;

#define ROWS_PER_CTA 4

__device__ __forceinline__ float f16_bits(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float ld_f16(const u8* p) { return f16_bits((u16)(p[0] | (p[1] << 8))); }

__device__ __forceinline__ u32 ld_u32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

__constant__ float KVALUES_IQ4NL[16] = {-127.f, -104.f, -83.f, -65.f, -49.f, -35.f, -22.f, -10.f,
                                        1.f,    13.f,   25.f,  38.f,  53.f,  69.f,  89.f,  113.f};

// Each format: BLOCK values per block, BYTES bytes per block, and load(blk, j, w) that writes the
// 8 values j*8 .. j*8+7 of the block starting at blk.

struct Q4_0 {
    static constexpr int BLOCK = 32, BYTES = 18;
    __device__ static void load(const u8* b, int j, float* w) {
        const float d = ld_f16(b);
        const u8* q = b + 2 + (j & 1) * 8;
        const int shift = (j >> 1) * 4;  // runs 0,1 are low nibbles, 2,3 high
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = d * (float)(((q[i] >> shift) & 0xF) - 8);
    }
};

struct Q4_1 {
    static constexpr int BLOCK = 32, BYTES = 20;
    __device__ static void load(const u8* b, int j, float* w) {
        const float d = ld_f16(b), m = ld_f16(b + 2);
        const u8* q = b + 4 + (j & 1) * 8;
        const int shift = (j >> 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = d * (float)((q[i] >> shift) & 0xF) + m;
    }
};

struct Q5_0 {
    static constexpr int BLOCK = 32, BYTES = 22;
    __device__ static void load(const u8* b, int j, float* w) {
        const float d = ld_f16(b);
        const u32 qh = ld_u32(b + 2) >> (j * 8);  // value e's 5th bit is qh bit e
        const u8* q = b + 6 + (j & 1) * 8;
        const int shift = (j >> 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int v = ((q[i] >> shift) & 0xF) | (((qh >> i) & 1) << 4);
            w[i] = d * (float)(v - 16);
        }
    }
};

struct Q5_1 {
    static constexpr int BLOCK = 32, BYTES = 24;
    __device__ static void load(const u8* b, int j, float* w) {
        const float d = ld_f16(b), m = ld_f16(b + 2);
        const u32 qh = ld_u32(b + 4) >> (j * 8);
        const u8* q = b + 8 + (j & 1) * 8;
        const int shift = (j >> 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int v = ((q[i] >> shift) & 0xF) | (((qh >> i) & 1) << 4);
            w[i] = d * (float)v + m;
        }
    }
};

struct Q8_0 {
    static constexpr int BLOCK = 32, BYTES = 34;
    __device__ static void load(const u8* b, int j, float* w) {
        const float d = ld_f16(b);
        const i8* q = (const i8*)(b + 2 + j * 8);
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = d * (float)q[i];
    }
};

struct IQ4_NL {
    static constexpr int BLOCK = 32, BYTES = 18;
    __device__ static void load(const u8* b, int j, float* w) {
        const float d = ld_f16(b);
        const u8* q = b + 2 + (j & 1) * 8;
        const int shift = (j >> 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = d * KVALUES_IQ4NL[(q[i] >> shift) & 0xF];
    }
};

// ggml's get_scale_min_k4: sub-block s (0..7) of a Q4_K/Q5_K block has a 6-bit scale and min.
__device__ __forceinline__ void scale_min_k4(const u8* q, int s, float* sc, float* mn) {
    if (s < 4) {
        *sc = (float)(q[s] & 63);
        *mn = (float)(q[s + 4] & 63);
    } else {
        *sc = (float)((q[s + 4] & 0xF) | ((q[s - 4] >> 6) << 4));
        *mn = (float)((q[s + 4] >> 4) | ((q[s] >> 6) << 4));
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
            w[i] = d * (float)((word >> (8 * (i & 3) + shift)) & 0xF) - m;
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
            const int lo = (word >> (8 * (i & 3) + shift)) & 0xF;
            const int hi = (hword >> (8 * (i & 3) + s)) & 1;
            w[i] = d * (float)(lo | (hi << 4)) - m;
        }
    }
};

struct Q6_K {
    static constexpr int BLOCK = 256, BYTES = 210;
    __device__ static void load(const u8* b, int j, float* w) {
        const int e = j * 8, h = e >> 7, r = e & 127, quarter = r >> 5, l0 = r & 31;
        const u8* ql = b + 64 * h + (quarter & 1) * 32 + l0;
        const u8* qh = b + 128 + 32 * h + l0;
        const float d = ld_f16(b + 208) * (float)((const i8*)(b + 192))[8 * h + (l0 >> 4) + 2 * quarter];
        const int lshift = (quarter >> 1) * 4, hshift = quarter * 2;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int v = ((ql[i] >> lshift) & 0xF) | (((qh[i] >> hshift) & 3) << 4);
            w[i] = d * (float)(v - 32);
        }
    }
};

struct IQ4_XS {
    static constexpr int BLOCK = 256, BYTES = 136;
    __device__ static void load(const u8* b, int j, float* w) {
        const int ib = j >> 2;  // 32-value sub-block, laid out like one IQ4_NL block
        const u32 sh = (u32)b[2] | ((u32)b[3] << 8);
        const int ls = ((b[4 + (ib >> 1)] >> (4 * (ib & 1))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4);
        const float d = ld_f16(b) * (float)(ls - 32);
        const u8* q = b + 8 + 16 * ib + (j & 1) * 8;
        const int shift = ((j >> 1) & 1) * 4;
#pragma unroll
        for (int i = 0; i < 8; i++) w[i] = d * KVALUES_IQ4NL[(q[i] >> shift) & 0xF];
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
        const u32 v[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[2 * i] = f16_bits((u16)(v[i] & 0xFFFF));
            w[2 * i + 1] = f16_bits((u16)(v[i] >> 16));
        }
    }
};

struct BF16 {
    static constexpr int BLOCK = 8, BYTES = 16;
    __device__ static void load(const u8* b, int, float* w) {
        const uint4 a = *(const uint4*)b;
        const u32 v[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[2 * i] = __int_as_float((int)(v[i] << 16));
            w[2 * i + 1] = __int_as_float((int)(v[i] & 0xFFFF0000u));
        }
    }
};

// w: [n_rows, k / BLOCK * BYTES] bytes; x: fp32 [n_tok, k]; y: fp32 [n_tok, n_rows].
// n_rows: output rows; k: inputs per row, a multiple of BLOCK; n_tok: tokens, 1..NT.
template <typename T, int NT>
__device__ void matvec(const u8* __restrict__ w, const float* __restrict__ x, float* __restrict__ y,
                       int n_rows, int k, int n_tok) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * ROWS_PER_CTA + (threadIdx.x >> 5);
    if (row >= n_rows) return;
    constexpr int RUNS = T::BLOCK / 8;  // 8-value runs per block
    const size_t row_bytes = (size_t)(k / T::BLOCK) * T::BYTES;
    const u8* wrow = w + (size_t)row * row_bytes;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.f;
    const int n_runs = k / 8;
    for (int r = lane; r < n_runs; r += 32) {
        float v[8];
        T::load(wrow + (size_t)(r / RUNS) * T::BYTES, r % RUNS, v);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < n_tok) {
                const float4* xp = (const float4*)(x + (size_t)t * k + (size_t)r * 8);
                const float4 a = xp[0], c = xp[1];
                acc[t] += v[0] * a.x + v[1] * a.y + v[2] * a.z + v[3] * a.w + v[4] * c.x +
                          v[5] * c.y + v[6] * c.z + v[7] * c.w;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], off);
    }
    if (lane == 0) {
#pragma unroll
        for (int t = 0; t < NT; t++)
            if (t < n_tok) y[(size_t)t * n_rows + row] = acc[t];
    }
}

// One extern "C" entry per (format, token bucket), named matvec_<format>_t<NT>, so the Python
// side looks kernels up by plain names.
#define MATVEC_ENTRY(TYPE, NT)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * ROWS_PER_CTA)                            \
        matvec_##TYPE##_t##NT(const u8* __restrict__ w, const float* __restrict__ x,          \
                              float* __restrict__ y, int n_rows, int k, int n_tok) {           \
        matvec<TYPE, NT>(w, x, y, n_rows, k, n_tok);                                          \
    }

#define MATVEC_TYPE(TYPE) \
    MATVEC_ENTRY(TYPE, 1) \
    MATVEC_ENTRY(TYPE, 2) \
    MATVEC_ENTRY(TYPE, 4) \
    MATVEC_ENTRY(TYPE, 8)

MATVEC_TYPE(Q4_0)
MATVEC_TYPE(Q4_1)
MATVEC_TYPE(Q5_0)
MATVEC_TYPE(Q5_1)
MATVEC_TYPE(Q8_0)
MATVEC_TYPE(IQ4_NL)
MATVEC_TYPE(Q4_K)
MATVEC_TYPE(Q5_K)
MATVEC_TYPE(Q6_K)
MATVEC_TYPE(IQ4_XS)
MATVEC_TYPE(F32)
MATVEC_TYPE(F16)
MATVEC_TYPE(BF16)
