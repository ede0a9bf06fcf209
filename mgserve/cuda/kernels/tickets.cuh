// The last-CTA pattern: a launch whose work is finished by whichever CTA ends last (the fused
// router's routing, the int8 gate/up's rounding of h). cuda/tickets.py holds the counters,
// 0 before and after each launch.
#pragma once

#ifndef TICKET_ACQREL
#define TICKET_ACQREL 0  // 1: one acq_rel atomic a CTA, not three fences (Tickets.acq_rel: on)
#endif

// Whether this CTA takes the last of `n` tickets of `counter`. The CTA's writes before the call
// (by any of its threads) are ordered before the CTA's ticket, and the ticket's atomic before
// what follows. A CTA that gets true must call ticket_acquire() before it reads the other CTAs'
// writes (its threads that read them, through L2: __ldcg), and reset the counter to 0 once every
// CTA has its ticket.
// TICKET_ACQREL: CUTLASS's semaphore pattern. The barrier orders the CTA's writes before thread
// 0's atomic, whose release (cumulative) publishes them at GPU scope and whose acquire orders the
// other CTAs' published writes before the second barrier. In SASS that is one MEMBAR.ALL.GPU
// where __threadfence() is a MEMBAR.SC.GPU, two on the fenced path (and the readers' own).
__device__ __forceinline__ bool last_cta(unsigned* counter, unsigned n) {
    __shared__ bool s_last;
#if TICKET_ACQREL
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned old;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                     : "=r"(old) : "l"(counter) : "memory");
        s_last = old == n - 1;
    }
#else
    __syncthreads();  // the CTA's writes before thread 0's fence, which is cumulative over them
    if (threadIdx.x == 0) {
        __threadfence();  // (release) every thread's writes before the ticket: since the warp
        s_last = atomicAdd(counter, 1u) == n - 1;  // sums went to several lanes, not lane 0's
        __threadfence();  // (acquire) the atomic before the reads below
    }
#endif
    __syncthreads();
    return s_last;
}

// What the last CTA's reading threads do before reading the other CTAs' writes: a fence, or
// nothing where the ticket's atomic acquired them (TICKET_ACQREL).
__device__ __forceinline__ void ticket_acquire() {
#if !TICKET_ACQREL
    __threadfence();
#endif
}
