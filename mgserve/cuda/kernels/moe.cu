// Mixture-of-experts FFN for decode (1..8 tokens), fp32 activations, reading GGUF blocks directly:
//
//   h[n, j, f] = silu(gate_e[f] . x[n]) * (up_e[f] . x[n])          e = experts[n, j]  (kernel 1)
//   out[n, r]  = sum_j weights[n, j] * (down_e[r] . h[n, j])                            (kernel 2)
//
// Expert tensors are GGUF's 3-D ffn_{gate,up,down}_exps: expert e's row f of a matrix with
// expert_rows rows per expert is row e * expert_rows + f (gate/up: expert_rows = ff, or 2 ff for
// the fused ffn_gate_up_exps whose up half starts ff rows after its gate half; down: d). Expert
// ids are read on the device, so the launch shape depends on N alone and a decode step captures
// into a CUDA graph. Ids outside [0, n_expert) are clamped (a bad router never reads outside W).
//
// Thread mapping
//   moe_gate_up_<T>: grid (N * kk, ceil(ff / (MOE_WARPS * GU_ROWS))), MOE_WARPS warps per CTA.
//     blockIdx.x is the (token, slot) pair p = n * kk + j; each warp owns GU_ROWS rows f of that
//     pair's expert (row tile blockIdx.y) and computes gate and up for them together, so
//     silu(gate) * up is applied in registers. Lanes stride over the row's 8-value runs (32 runs
//     apart), accumulate in fp32, and a shuffle tree ends each row. Only the selected experts'
//     rows are read. Pairs are the fast grid axis, so the CTAs in flight at any time cover one row
//     tile of every pair: tokens that chose the same expert read the same rows together (L2 hits).
//   moe_down_<T>: grid (N, ceil(d / (MOE_WARPS * DOWN_ROWS))). Each warp owns DOWN_ROWS output
//     rows r of token blockIdx.x and walks the kk * (ff / 8) runs of "row r of every selected
//     expert" as one flat range (ff = 640 is only 80 runs: one expert at a time would idle
//     lanes), adding weights[n, j] * (run . h) into one fp32 accumulator per row, then a shuffle
//     tree. Tokens are the fast axis here too.
//
// Determinism: every output is computed by one warp from its token's data alone, in an order fixed
// by (kk, ff, k), with no atomics: a token's result does not depend on the other tokens of the
// batch or on the batch size (the batch-invariance test checks this bitwise).
//
// Block layouts: see matvec.cu (the decoders below are its, unchanged).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef signed char i8;

__device__ __forceinline__ float f16_bits(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Every block size and every field offset below is even, and tensors start 16-byte aligned, so
// 2-byte loads are always aligned (most rows are not 4-byte aligned: 34, 22, 210-byte blocks).
__device__ __forceinline__ u32 ld_u16(const u8* p) { return *(const u16*)p; }
__device__ __forceinline__ float ld_f16(const u8* p) { return f16_bits((u16)ld_u16(p)); }
__device__ __forceinline__ u32 ld_u32(const u8* p) { return ld_u16(p) | (ld_u16(p + 2) << 16); }

// The 8 bytes at p (2-byte aligned), one per word.
__device__ __forceinline__ void ld_bytes8(const u8* p, u32* v) {
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const u32 h = ld_u16(p + 2 * i);
        v[2 * i] = h & 0xFF;
        v[2 * i + 1] = h >> 8;
    }
}

// Exactly (float)v - bias for 0 <= v < 2^23: v becomes the mantissa of 2^23 + v, then one FADD.
// Replaces the quarter-rate integer-to-float conversion, which bounded the quantized kernels.
__device__ __forceinline__ float u2f(u32 v, float bias) {
    return __int_as_float(0x4B000000u | v) - (8388608.f + bias);
}

// IQ4_NL's 16 levels {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113}
// as int8 packed in two words: a register lookup. A __constant__ table serialises a warp whose
// lanes read different entries (up to 16-way), which made IQ4_XS 6x slower than Q4_K.
__device__ __forceinline__ float kvalue_iq4(u32 q) {
    const unsigned long long t = q < 8 ? 0xf6eaddcfbfad9881ull : 0x7159453526190d01ull;
    return u2f((u32)((t >> (8 * (q & 7))) & 0xFF) ^ 0x80u, 128.f);  // int8 via its offset-128 form
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
        // int8 = (byte ^ 0x80) - 128
        for (int i = 0; i < 8; i++) w[i] = d * u2f(q[i] ^ 0x80u, 128.f);
    }
};

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

// ---- the kernels -------------------------------------------------------------------------------

#define MOE_WARPS 4
#define MOE_MAX_KK 64  // experts per token the down kernel stages in shared memory
#ifndef GU_ROWS
#define GU_ROWS 1  // gate/up rows per warp (each also reads the matching up row)
#endif
#ifndef DOWN_ROWS
#define DOWN_ROWS 1  // down rows per warp
#endif
#ifndef GU_UNROLL
#define GU_UNROLL 4  // gate/up run-loop unroll: loads in flight per lane (k = 2560: 10 runs)
#endif
#ifndef DOWN_UNROLL
#define DOWN_UNROLL 8  // down run-loop unroll (kk 10 x ff 640: 25 runs per lane)
#endif

__device__ __forceinline__ float silu(float g) { return g / (1.f + expf(-g)); }

__device__ __forceinline__ float dot8(const float* v, const float* x) {
    const float4 a = *(const float4*)x, c = *(const float4*)(x + 4);
    return v[0] * a.x + v[1] * a.y + v[2] * a.z + v[3] * a.w + v[4] * c.x + v[5] * c.y +
           v[6] * c.z + v[7] * c.w;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// gate, up: [n_expert * expert_rows, k / BLOCK * BYTES] bytes (up may point into gate's storage);
// x: fp32 [N, k]; experts: int32 [N, kk]; h: fp32 [N, kk, ff].
template <typename T>
__device__ void moe_gate_up(const u8* __restrict__ gate, const u8* __restrict__ up,
                            long long expert_rows, const float* __restrict__ x,
                            const int* __restrict__ experts, float* __restrict__ h, int kk,
                            int ff, int k, int n_expert) {
    constexpr int R = GU_ROWS, RUNS = T::BLOCK / 8;
    const int lane = threadIdx.x & 31;
    const int f0 = (blockIdx.y * MOE_WARPS + (threadIdx.x >> 5)) * R;
    if (f0 >= ff) return;
    const int p = blockIdx.x, n = p / kk;
    const int e = min(max(experts[p], 0), n_expert - 1);
    const size_t row_bytes = (size_t)(k / T::BLOCK) * T::BYTES;
    const u8* grow[R];
    const u8* urow[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        const int f = min(f0 + rr, ff - 1);  // past the last row: re-read one, never written
        const size_t row = (size_t)e * expert_rows + f;
        grow[rr] = gate + row * row_bytes;
        urow[rr] = up + row * row_bytes;
    }
    float ag[R], au[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) ag[rr] = au[rr] = 0.f;
    const float* xn = x + (size_t)n * k;
    const int n_runs = k / 8;
#pragma unroll GU_UNROLL
    for (int r = lane; r < n_runs; r += 32) {
        const size_t off = (size_t)(r / RUNS) * T::BYTES;
        float vg[R][8], vu[R][8];
#pragma unroll
        for (int rr = 0; rr < R; rr++) {
            T::load(grow[rr] + off, r % RUNS, vg[rr]);
            T::load(urow[rr] + off, r % RUNS, vu[rr]);
        }
#pragma unroll
        for (int rr = 0; rr < R; rr++) {
            ag[rr] += dot8(vg[rr], xn + (size_t)r * 8);
            au[rr] += dot8(vu[rr], xn + (size_t)r * 8);
        }
    }
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        const float g = warp_sum(ag[rr]), u = warp_sum(au[rr]);
        if (lane == 0 && f0 + rr < ff) h[(size_t)p * ff + f0 + rr] = silu(g) * u;
    }
}

// down: [n_expert * expert_rows, ff / BLOCK * BYTES] bytes; h: fp32 [N, kk, ff];
// experts: int32 [N, kk]; weights: fp32 [N, kk]; out: fp32 [N, d]. kk <= MOE_MAX_KK.
template <typename T>
__device__ void moe_down(const u8* __restrict__ down, long long expert_rows,
                         const float* __restrict__ h, const int* __restrict__ experts,
                         const float* __restrict__ weights, float* __restrict__ out, int kk, int d,
                         int ff, int n_expert) {
    constexpr int R = DOWN_ROWS, RUNS = T::BLOCK / 8;
    __shared__ int s_e[MOE_MAX_KK];
    __shared__ float s_w[MOE_MAX_KK];
    const int n = blockIdx.x;
    if (threadIdx.x < kk) {
        s_e[threadIdx.x] = min(max(experts[n * kk + threadIdx.x], 0), n_expert - 1);
        s_w[threadIdx.x] = weights[n * kk + threadIdx.x];
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int r0 = (blockIdx.y * MOE_WARPS + (threadIdx.x >> 5)) * R;
    if (r0 >= d) return;
    const size_t row_bytes = (size_t)(ff / T::BLOCK) * T::BYTES;
    int rows[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) rows[rr] = min(r0 + rr, d - 1);
    float acc[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) acc[rr] = 0.f;
    const float* hn = h + (size_t)n * kk * ff;
    const int n_runs = ff / 8, total = kk * n_runs;
#pragma unroll DOWN_UNROLL
    for (int i = lane; i < total; i += 32) {
        const int j = i / n_runs, c = i - j * n_runs;
        const u8* base = down + (size_t)s_e[j] * expert_rows * row_bytes +
                         (size_t)(c / RUNS) * T::BYTES;
        float v[R][8];
#pragma unroll
        for (int rr = 0; rr < R; rr++) T::load(base + (size_t)rows[rr] * row_bytes, c % RUNS, v[rr]);
        const float* hp = hn + (size_t)j * ff + (size_t)c * 8;
        const float wj = s_w[j];
#pragma unroll
        for (int rr = 0; rr < R; rr++) acc[rr] += wj * dot8(v[rr], hp);
    }
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        const float s = warp_sum(acc[rr]);
        if (lane == 0 && r0 + rr < d) out[(size_t)n * d + r0 + rr] = s;
    }
}

#define MOE_ENTRIES(TYPE)                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * MOE_WARPS) moe_gate_up_##TYPE(             \
        const u8* __restrict__ gate, const u8* __restrict__ up, long long expert_rows,          \
        const float* __restrict__ x, const int* __restrict__ experts, float* __restrict__ h,   \
        int kk, int ff, int k, int n_expert) {                                                  \
        moe_gate_up<TYPE>(gate, up, expert_rows, x, experts, h, kk, ff, k, n_expert);          \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(32 * MOE_WARPS) moe_down_##TYPE(                \
        const u8* __restrict__ down, long long expert_rows, const float* __restrict__ h,       \
        const int* __restrict__ experts, const float* __restrict__ weights,                    \
        float* __restrict__ out, int kk, int d, int ff, int n_expert) {                         \
        moe_down<TYPE>(down, expert_rows, h, experts, weights, out, kk, d, ff, n_expert);      \
    }

MOE_ENTRIES(Q4_0)
MOE_ENTRIES(Q4_1)
MOE_ENTRIES(Q5_0)
MOE_ENTRIES(Q5_1)
MOE_ENTRIES(Q8_0)
MOE_ENTRIES(IQ4_NL)
MOE_ENTRIES(Q4_K)
MOE_ENTRIES(Q5_K)
MOE_ENTRIES(Q6_K)
MOE_ENTRIES(IQ4_XS)
MOE_ENTRIES(F32)
MOE_ENTRIES(F16)
MOE_ENTRIES(BF16)
