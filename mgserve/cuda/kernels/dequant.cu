// Dequantization of GGUF blocks to f16 (or fp32): out[g, r, :] = W[src_row(g, r), :].
//
// Used by prefill, where N tokens (N > 8) make a tensor-core matmul on a dequantized tile cheaper
// than N passes of the matvec: the caller dequantizes rows of W into a scratch tile and runs
// cuBLAS on it. The same kernel serves MoE prefill, where each "group" g is one expert: its rows
// are found through an expert id read on the device (ids), so one launch dequantizes every used
// expert of a chunk.
//
// Rows: src_row(g, r) = (ids ? ids[g] : g) * group_stride + row0 + r, for r in [0, n_rows);
//       dst row = g * out_group_rows + r (so two launches can fill the two halves of a group).
//
// Thread mapping: one thread per 8-value run (every format splits evenly into 8-value runs that
// share one scale); threadIdx.x + blockIdx.x * blockDim.x indexes the runs of the [n_rows, k / 8]
// tile row-major, blockIdx.y is the group. Consecutive threads take consecutive runs of a row, so
// a warp reads 256 contiguous values' blocks (through L1) and writes 32 x 16 contiguous bytes
// (f16) or 32 x 32 bytes (fp32): both fully coalesced.
//
// Block layouts and their decoders: gguf_blocks.cuh and the headers it names.

#include "gguf_blocks.cuh"
#include "gguf_blocks_lowbit.cuh"
#include "gguf_blocks_iq.cuh"
#include "pdl.cuh"
// ---- the kernel --------------------------------------------------------------------------------

#define DEQUANT_THREADS 256

__device__ __forceinline__ void store8(float* out, const float* v) {
    float4* p = (float4*)out;
    p[0] = make_float4(v[0], v[1], v[2], v[3]);
    p[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// 8 f16 values as one 16-byte store (out is 16-byte aligned: k is a multiple of 8)
__device__ __forceinline__ void store8(unsigned short* out, const float* v) {
    uint4 packed;
    packed.x = (u32)f16_rn(v[0]) | ((u32)f16_rn(v[1]) << 16);
    packed.y = (u32)f16_rn(v[2]) | ((u32)f16_rn(v[3]) << 16);
    packed.z = (u32)f16_rn(v[4]) | ((u32)f16_rn(v[5]) << 16);
    packed.w = (u32)f16_rn(v[6]) | ((u32)f16_rn(v[7]) << 16);
    *(uint4*)out = packed;
}

// w: [*, k / BLOCK * BYTES] bytes; out: OUT [n_groups * out_group_rows, k] (f16 bits or fp32);
// ids: int32 [n_groups] or null; k a multiple of BLOCK.
template <typename T, typename OUT>
__device__ void dequant(const u8* __restrict__ w, OUT* __restrict__ out, const int* __restrict__ ids,
                        long long group_stride, long long row0, int n_rows, int out_group_rows,
                        int k) {
    const int runs_per_row = k >> 3;
    const long long run = (long long)blockIdx.x * DEQUANT_THREADS + threadIdx.x;
    if (run >= (long long)n_rows * runs_per_row) return;
    const int r = (int)(run / runs_per_row), c = (int)(run - (long long)r * runs_per_row);
    const long long g = blockIdx.y;
    const long long src_row = (ids ? (long long)ids[g] : g) * group_stride + row0 + r;
    constexpr int RUNS = T::BLOCK / 8;
    const size_t row_bytes = (size_t)(k / T::BLOCK) * T::BYTES;
    const u8* blk = w + (size_t)src_row * row_bytes + (size_t)(c / RUNS) * T::BYTES;
    float v[8];
    T::load(blk, c % RUNS, v);
    store8(out + ((size_t)g * out_group_rows + r) * k + (size_t)c * 8, v);
}

// One entry per (format, output type): dequant_<format>_f16 and dequant_<format>_f32.
#define DEQUANT_ENTRY(TYPE, SUFFIX, OUT)                                                         \
    extern "C" __global__ void __launch_bounds__(DEQUANT_THREADS)                                \
        dequant_##TYPE##_##SUFFIX(const u8* __restrict__ w, OUT* __restrict__ out,             \
                                  const int* __restrict__ ids, long long group_stride,          \
                                  long long row0, int n_rows, int out_group_rows, int k) {      \
        grid_sync();                                                                            \
        dequant<TYPE, OUT>(w, out, ids, group_stride, row0, n_rows, out_group_rows, k);        \
    }

#define DEQUANT_TYPE(TYPE)                       \
    DEQUANT_ENTRY(TYPE, f16, unsigned short)     \
    DEQUANT_ENTRY(TYPE, f32, float)

DEQUANT_TYPE(Q4_0)
DEQUANT_TYPE(Q4_1)
DEQUANT_TYPE(Q5_0)
DEQUANT_TYPE(Q5_1)
DEQUANT_TYPE(Q8_0)
DEQUANT_TYPE(IQ4_NL)
DEQUANT_TYPE(Q4_K)
DEQUANT_TYPE(Q5_K)
DEQUANT_TYPE(Q6_K)
DEQUANT_TYPE(IQ4_XS)
DEQUANT_TYPE(F32)
DEQUANT_TYPE(F16)
DEQUANT_TYPE(BF16)
DEQUANT_TYPE(Q2_K)
DEQUANT_TYPE(Q3_K)
DEQUANT_TYPE(MXFP4)
DEQUANT_TYPE(IQ2_XXS)
DEQUANT_TYPE(IQ2_XS)
DEQUANT_TYPE(IQ2_S)
DEQUANT_TYPE(IQ3_XXS)
DEQUANT_TYPE(IQ3_S)
DEQUANT_TYPE(IQ1_S)
DEQUANT_TYPE(IQ1_M)
