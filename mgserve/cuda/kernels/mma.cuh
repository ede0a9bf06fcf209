// Tensor-core and shared-memory helpers of the attention kernels (attention.cu,
// attention_prefill.cu), the prompt GEMMs (qgemm.cu, hgemm.cu) and the int8 matvec of several
// tokens (matvec_q8.cu): cp.async copies, ldmatrix, mma.sync m16n8k16 (f16 in, f32 accumulate),
// m16n8k32 (int8 in, int32 out) and the exact int8 -> f16 conversion. Fragment layouts (PTX
// ISA; gid = lane / 4, tig = lane % 4): A (16 x 16, row-major) a0 = (row gid, cols 2 tig, +1), a1 = (row gid + 8,
// same), a2 = (row gid, cols 2 tig + 8, +9), a3 = (row gid + 8, same); B (16 x 8) b0 = (rows
// 2 tig, +1 of column gid), b1 = (rows 2 tig + 8, +9); C (16 x 8) c0, c1 = (row gid, cols 2 tig,
// +1), c2, c3 = (row gid + 8, same). Low half of an f16x2 register = the lower index.
#pragma once
#include "scalar.cuh"

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared, zero-filled when !valid (src is then not read).
__device__ __forceinline__ void cp16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0));
}

template <int N>
__device__ __forceinline__ void cp_small(unsigned dst, const void* src, bool valid) {
    if constexpr (N == 16) {
        cp16(dst, src, valid);
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(dst), "l"(src),
                     "n"(N), "r"(valid ? N : 0));
    }
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// c += a * b for one m16n8k16 tile (f16 inputs, f32 accumulators).
__device__ __forceinline__ void mma16816(float (&c)[4], const uint4& a, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

// The exact int32 sums A (16 x 32 int8, row-major) . B (32 x 8 int8, column-major) of one
// m16n8k32 tile, from zero. Fragments as m16n8k16's with 4 int8 per register: a0 = (row gid,
// k 4 tig..+3), a1 = (row gid + 8, same), a2 = (row gid, k 16 + 4 tig..+3), a3 = (row gid + 8,
// same); b0 = (k 4 tig..+3 of column gid), b1 = (k 16 + 4 tig..+3); c as above.
__device__ __forceinline__ void mma_s8(int (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%10,%10,%10};\n"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(0));
}

// Columns col, col + 1 of an f32 output row (an accumulator pair of an m16n8 C fragment or of a
// wgmma's), columns from n on masked: one 8-byte store where ``pairs`` (the row's pairs 8-byte
// aligned) and both fit, else one store each.
__device__ __forceinline__ void store_f32_pair(float* out, int col, int n, float v0, float v1,
                                               bool pairs) {
    if (pairs && col + 1 < n) {
        *(float2*)(out + col) = make_float2(v0, v1);
    } else {
        if (col < n) out[col] = v0;
        if (col + 1 < n) out[col + 1] = v1;
    }
}

// acc = 0 for MT x NT m16n8 accumulator tiles (the start of every k16 chain).
template <int MT, int NT>
__device__ __forceinline__ void zero_tiles(float (&acc)[MT][NT][4]) {
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[i][j][c] = 0.f;
}

// Two int8 values in bytes 0 and 2 of r -> an exact f16x2 (low half from byte 0): the bytes
// (sign-flipped) become the mantissa of 1024 + x + 128, then 1152 is subtracted.
__device__ __forceinline__ unsigned i8x2_to_h2(unsigned r) {
    const unsigned t = (r & 0x00FF00FFu) ^ 0x64806480u;
    unsigned out;
    asm("sub.f16x2 %0, %1, %2;\n" : "=r"(out) : "r"(t), "r"(0x64806480u));
    return out;
}

// Four 8x8 b16 matrices from shared memory: lanes 8i..8i+7 give the row addresses of matrix i;
// register i of a lane holds row lane / 4, elements 2 (lane % 4), +1 of matrix i (.trans: the
// matrix transposed, i.e. elements (2 (lane % 4), lane / 4) and (2 (lane % 4) + 1, lane / 4)).
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(u32 (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
