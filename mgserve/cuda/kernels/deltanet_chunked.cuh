// What the Gated DeltaNet prompt kernels share (deltanet_chunked.cu, deltanet_scan_tc.cu): the
// chunk, the layout of a chunk's stored solve (delta_prep_f32's output) and the shared-memory
// tiles of k / q rows.
#pragma once

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#define CHUNK 64
#define KPAD (HEAD_DIM + 4)  // row stride of k / q tiles: float4 rows on distinct banks
#define CPAD (CHUNK + 4)     // row stride of C x C tiles
#define CC (CHUNK * CHUNK)
#define CHUNK_FLOATS (2 * CC + 2 * CHUNK)  // prep per (value head, chunk): M, Aqk, exp(G), exp(..)

__device__ __forceinline__ float4 ld4(const float* p) {
    return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }

// rows [n, HEAD_DIM] of src (row stride ld floats) into dst [CHUNK][KPAD], zero rows past n
__device__ __forceinline__ void load_rows(float* dst, const float* src, long long ld, int n,
                                          int tid, int threads) {
    for (int e = tid; e < CHUNK * (HEAD_DIM / 4); e += threads) {
        const int row = e / (HEAD_DIM / 4), c4 = 4 * (e % (HEAD_DIM / 4));
        st4(dst + row * KPAD + c4,
            row < n ? ld4(src + row * ld + c4) : make_float4(0.0f, 0.0f, 0.0f, 0.0f));
    }
}
