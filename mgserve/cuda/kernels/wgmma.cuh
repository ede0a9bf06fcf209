// Hopper warpgroup MMA (wgmma, sm_90a only) on f16 operands in shared memory, for
// hgemm_wgmma.cu and qgemm_wgmma.cu. A warpgroup is 4 consecutive warps (128 threads) issuing each wgmma together;
// the instruction runs asynchronously: wgmma_fence() before the first one that touches the
// accumulators, wgmma_commit() closes a group, wgmma_wait<N>() returns once at most N groups
// are in flight. The accumulators must not be read or written in between (wgmma_hold()).
//
// Operands: K-major tiles of 64 f16 (128 bytes) per row in the 128-byte swizzle (PTX ISA,
// "shared memory matrix layout"): chunk c (16 bytes) of row r stored at r * 128 + (c ^ (r % 8))
// * 16 from a 1024-byte aligned base, 8-row atoms of 1024 bytes stacked along M or N. A
// descriptor names the tile's start (+32 bytes for each k16 step inside the 64), the stride
// between atoms (1024) and the swizzle mode; the leading offset is unused by this layout.
//
// Accumulators of m64nNk16 (f32): thread t of the warpgroup, warp v = t / 32, g = (t % 32) / 4,
// q = t % 4: d[4 j + 0, 1] = (row 16 v + g, columns 8 j + 2 q, + 1), d[4 j + 2, 3] = (row
// 16 v + g + 8, the same columns): per n8 block j, mma.sync m16n8's C fragment.
//
// The register lists below are written out (the inline-asm operand lists cannot be generated
// by the preprocessor).
#pragma once
#include "scalar.cuh"

typedef unsigned long long u64;

__device__ __forceinline__ u64 wgmma_desc(unsigned smem_addr) {
    return (u64)((smem_addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) |
           ((u64)1 << 62);  // 62..63 = 1: the 128-byte swizzle
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// shared-memory writes of the generic proxy (cp.async, st.shared) made visible to wgmma's
// reads (the async proxy): after the writes land, before the barrier that publishes them
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// keeps the compiler from moving accumulator reads or writes across a wgmma_wait
template <int R>
__device__ __forceinline__ void wgmma_hold(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; i++) asm volatile("" : "+f"(d[i])::"memory");
}

#define F8(i)                                                                                 \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
        "+f"(d[i + 6]), "+f"(d[i + 7])

// d[0..63] += A (64 x 16, descriptor a) . B (16 x 128, descriptor b): one warpgroup's
// wgmma.mma_async m64n128k16, f16 operands in shared memory (K-major), f32 accumulators (the
// scale-d predicate set: D = A B + D).
__device__ __forceinline__ void wgmma_n128(float (&d)[64], u64 a, u64 b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63 "
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : F8(0), F8(8), F8(16), F8(24), F8(32), F8(40), F8(48), F8(56)
        : "l"(a), "l"(b), "r"(1));
}

// d[0..127] += A (64 x 16, descriptor a) . B (16 x 256, descriptor b): one warpgroup's
// wgmma.mma_async m64n256k16, f16 operands in shared memory (K-major), f32 accumulators (the
// scale-d predicate set: D = A B + D).
__device__ __forceinline__ void wgmma_n256(float (&d)[128], u64 a, u64 b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
        "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
        "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
        "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
        "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127 "
        "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
        : F8(0), F8(8), F8(16), F8(24), F8(32), F8(40), F8(48), F8(56),
          F8(64), F8(72), F8(80), F8(88), F8(96), F8(104), F8(112), F8(120)
        : "l"(a), "l"(b), "r"(1));
}

#undef F8
