// The last-CTA pattern: a launch whose work is finished by whichever CTA ends last (the fused
// router's routing, the int8 gate/up's rounding of h). cuda/tickets.py holds the counters,
// 0 before and after each launch.
#pragma once

// Whether this CTA takes the last of `n` tickets of `counter`. Each warp's writes before the call
// (written by its lane 0) are fenced before the CTA's ticket, and the ticket's atomic before
// what follows. A CTA that gets true must __threadfence() before it reads the other CTAs'
// writes (its threads that read them), and reset the counter to 0 once every CTA has its ticket.
__device__ __forceinline__ bool last_cta(unsigned* counter, unsigned n) {
    __shared__ bool s_last;
    if ((threadIdx.x & 31) == 0) __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        s_last = atomicAdd(counter, 1u) == n - 1;
        __threadfence();  // (acquire) the atomic before the reads below
    }
    __syncthreads();
    return s_last;
}
