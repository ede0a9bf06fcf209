// Small utility kernels.

#include "pdl.cuh"

// Busy-waits for `ns` nanoseconds of GPU time (%globaltimer). Tests use it to keep the GPU busy
// for a known while, e.g. to check that awaiting an event leaves the event loop free.
extern "C" __global__ void spin_ns(unsigned long long ns) {
    grid_sync();
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}
