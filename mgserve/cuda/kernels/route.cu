// MoE routing (route.py): softmax over the experts' router logits, the top k, their weights.
//
// moe_route, grid (ceil(N / ROUTE_WARPS)), ROUTE_WARPS warps: warp w routes token
//   n = blockIdx.x * ROUTE_WARPS + w alone, so a token's result never depends on the batch.
//   Lane l holds logits l, l + 32, .. (E <= 32 * ROUTE_PER_LANE = 512; coalesced loads).
//   - softmax: p = expf(x - max) / sum, the max and the sum by xor butterflies (every lane ends
//     with the same bits: float max and addition are commutative);
//   - top k (k <= 32): k rounds of a warp arg-max over 64-bit keys (probability bits << 32 |
//     ~expert: probabilities are >= +0, whose bits order like the floats, and an equal
//     probability goes to the lower expert id), the owner lane marking the winner taken; lane r
//     keeps round r's expert and probability;
//   - weights: the chosen probabilities, divided by max(sum, min_sum) when `norm` (the sum in rank
//     order, like llama.cpp's clamp at the smallest normal f16); lanes r < k write.

#include "math.cuh"
#include "pdl.cuh"

#define ROUTE_WARPS 4
#define ROUTE_PER_LANE 16  // logits per lane at most: E <= 512

extern "C" __global__ void __launch_bounds__(ROUTE_WARPS * 32)
moe_route(const float* __restrict__ logits,  // [N, E]
          int* __restrict__ experts,          // [N, k] best first
          float* __restrict__ weights,        // [N, k]
          int n_tok, int n_exp, int k, int norm, float min_sum) {
    grid_sync();
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * ROUTE_WARPS + (threadIdx.x >> 5);
    if (n >= n_tok) return;  // warp-uniform
    const float* x = logits + (size_t)n * n_exp;

    float p[ROUTE_PER_LANE];
    float mx = NEG_INF;
#pragma unroll
    for (int j = 0; j < ROUTE_PER_LANE; ++j) {
        const int e = lane + 32 * j;
        p[j] = e < n_exp ? x[e] : NEG_INF;
        mx = fmaxf(mx, p[j]);
    }
    mx = warp_max(mx);
    float sum = 0.f;
    unsigned absent = 0u;  // bit j: expert lane + 32 j does not exist
#pragma unroll
    for (int j = 0; j < ROUTE_PER_LANE; ++j) {
        if (lane + 32 * j < n_exp) {
            p[j] = expf(p[j] - mx);
            sum += p[j];
        } else {
            absent |= 1u << j;
        }
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int j = 0; j < ROUTE_PER_LANE; ++j) p[j] = p[j] / sum;

    unsigned taken = absent;
    int my_e = 0;
    float my_w = 0.f, wsum = 0.f;
    for (int r = 0; r < k; ++r) {
        unsigned long long best = 0ull;  // any real key beats it
#pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; ++j) {
            const unsigned long long key =
                ((unsigned long long)__float_as_uint(p[j]) << 32) |
                (unsigned long long)(0xFFFFFFFFu - (unsigned)(lane + 32 * j));
            if (!((taken >> j) & 1u) && key > best) best = key;
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const unsigned long long o = __shfl_xor_sync(FULL, best, off);
            best = o > best ? o : best;
        }
        const int e = (int)(0xFFFFFFFFu - (unsigned)(best & 0xFFFFFFFFull));
        const float w = __uint_as_float((unsigned)(best >> 32));
        if ((e & 31) == lane) taken |= 1u << (e >> 5);
        if (lane == r) {
            my_e = e;
            my_w = w;
        }
        wsum += w;
    }
    if (lane < k) {
        const float denom = norm ? fmaxf(wsum, min_sum) : 1.f;
        experts[(size_t)n * k + lane] = my_e;
        weights[(size_t)n * k + lane] = norm ? my_w / denom : my_w;
    }
}
