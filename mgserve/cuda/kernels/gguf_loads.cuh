// Loads of GGUF block fields, shared by the fp32 decoders (gguf_blocks*.cuh) and the int8 ones
// (gguf_blocks_q8.cuh).
#pragma once
#include "scalar.cuh"

// Every block size and every field offset is even, and tensors start 16-byte aligned, so 2-byte
// loads are always aligned (most rows are not 4-byte aligned: 34, 22, 210-byte blocks).
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
