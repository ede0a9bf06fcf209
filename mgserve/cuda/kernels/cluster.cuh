// Thread block clusters (sm_90 and later): a CTA's rank in its cluster, the cluster-wide barrier,
// and stores into another CTA's shared memory (distributed shared memory), in PTX so that no
// toolkit header is needed. A kernel that uses them is launched with a cluster shape
// (Kernels.launch(..., cluster=C)); every thread of every CTA must reach each barrier call.
// Another CTA's shared memory may be written only once every CTA of the cluster has started: a
// kernel calls cluster_arrive() early and cluster_wait() before its first cluster_store, and
// must not exit while others may still write into it (a cluster_sync() after the last store).
// Before sm_90 there are no clusters: the ops do not launch such kernels there (Kernels.clusters),
// and these functions trap if one runs anyway.
#pragma once

#define CLUSTER_MAX 8  // CTAs in a cluster at most (the portable size; ops/hc_cluster.py)

// This CTA's rank in its cluster (0 .. cluster size - 1; blockIdx.x % C for a cluster (C, 1, 1)).
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r = 0;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#else
    __trap();
#endif
    return r;
}

// The first half of a cluster barrier: this CTA has started (relaxed: it orders no memory). Pair
// it with cluster_wait() before the first access to another CTA's shared memory.
__device__ __forceinline__ void cluster_arrive() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#else
    __trap();
#endif
}

// The second half: returns once every CTA of the cluster has arrived.
__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#else
    __trap();
#endif
}

// Every thread of the cluster's CTAs arrives, then waits for all: shared-memory writes before
// it (release) are visible to reads after it in any CTA of the cluster (acquire).
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;"
                 ::: "memory");
#else
    __trap();
#endif
}

// v into the float at `p` (an address in this CTA's shared memory) in the shared memory of the
// cluster's CTA `rank` (the same variable there); visible to that CTA after a cluster_sync().
__device__ __forceinline__ void cluster_store(float* p, unsigned rank, float v) {
#if __CUDA_ARCH__ >= 900
    const unsigned local = (unsigned)__cvta_generic_to_shared(p);
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote), "f"(v) : "memory");
#else
    (void)p, (void)rank, (void)v;
    __trap();
#endif
}

// The unsigned at `p` (an address in this CTA's shared memory) in the shared memory of the
// cluster's CTA `rank` (the same variable there), as that CTA wrote it before a cluster_sync().
__device__ __forceinline__ unsigned cluster_load(const unsigned* p, unsigned rank) {
#if __CUDA_ARCH__ >= 900
    const unsigned local = (unsigned)__cvta_generic_to_shared(p);
    unsigned remote, v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(v) : "r"(remote) : "memory");
    return v;
#else
    (void)p, (void)rank;
    __trap();
    return 0u;
#endif
}
