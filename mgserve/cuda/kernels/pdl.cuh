// Programmatic dependent launch (sm_90 and later; mgserve/cuda/launch.py).
//
// Kernels.launch starts every kernel with programmatic stream serialization, so a kernel's CTAs
// may start while the kernel before it in the stream is still running. The contract, kept by
// every kernel in this directory (tests/cuda/test_kernel_sources.py checks each PTX entry):
//
// - grid_wait() before the first read of anything an earlier kernel wrote and before the first
//   write: it returns once the kernels before have finished and their writes are visible.
//   Before it a kernel may only compute addresses and read what no kernel writes (the weights),
//   e.g. prefetch_l2 its weight rows: their DRAM latency then hides behind the previous kernel.
// - grid_release() right after grid_wait(): the next kernel may then start its own prologue.
//   (Released earlier, kernels would cascade ahead and thrash L2 with prefetches.)
//
// Launched without the attribute (older GPUs, MGSERVE_PDL=0, torch's own kernels before ours)
// both are no-ops: ordinary stream order holds.

__device__ __forceinline__ void grid_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_release() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The prologue of a kernel with nothing to prefetch.
__device__ __forceinline__ void grid_sync() {
    grid_wait();
    grid_release();
}

// bytes [0, n) at p into L2, the CTA's threads taking 128-byte lines in turn (a hint).
__device__ __forceinline__ void prefetch_l2(const void* p, size_t n) {
    const char* c = (const char*)p;
    for (size_t off = (size_t)threadIdx.x * 128; off < n; off += (size_t)blockDim.x * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(c + off));
}

// Rows [row0, row0 + n) of a weight of n_rows rows of row_bytes bytes (clipped at its end) into
// L2: a CTA's rows of a matvec, before its grid_wait().
__device__ __forceinline__ void prefetch_rows_l2(const void* w, size_t row_bytes, int row0, int n,
                                                 int n_rows) {
    const int rows = max(0, min(n, n_rows - row0));
    prefetch_l2((const char*)w + (size_t)row0 * row_bytes, (size_t)rows * row_bytes);
}
