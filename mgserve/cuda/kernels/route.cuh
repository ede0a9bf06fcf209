// The routing of one token by one warp (route.cu: moe_route and matvec_route_<T>_t<NT>), and
// the shared expert's gate dot product in moe_shared.cu's order (the fused router computes it).
#pragma once
#include "math.cuh"

#define ROUTE_PER_LANE 16  // logits per lane at most: E <= 512
#ifndef ROUTE_REDUX
#define ROUTE_REDUX 0  // 1: the top k by warp reductions (the same choice: route_warp)
#endif

// x: the token's logits [n_exp] (read through L2: the fused router's last CTA reads logits other
// CTAs wrote); experts, weights: the token's [k] outputs. The method: route.cu's header.
__device__ __forceinline__ void route_warp(const float* __restrict__ x, int* __restrict__ experts,
                                           float* __restrict__ weights, int n_exp, int k,
                                           int norm, float min_sum) {
    const int lane = threadIdx.x & 31;
    float p[ROUTE_PER_LANE];
    float mx = NEG_INF;
#pragma unroll
    for (int j = 0; j < ROUTE_PER_LANE; ++j) {
        const int e = lane + 32 * j;
        p[j] = e < n_exp ? __ldcg(x + e) : NEG_INF;
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
#if ROUTE_REDUX
    // The same choice in fewer steps: each lane keeps its own best untaken (probability bits,
    // then the lower expert: the 64-bit key's order), a round takes the warp's largest bits and
    // the lowest expert among the lanes holding them (two warp reductions, no shuffle tree),
    // and only the winner's lane looks for its next best.
    unsigned best_p = 0u;
    int best_j = -1;
    auto own_best = [&]() {
        best_p = 0u;
        best_j = -1;
#pragma unroll
        for (int j = 0; j < ROUTE_PER_LANE; ++j) {
            const unsigned pb = __float_as_uint(p[j]);
            if (!((taken >> j) & 1u) && (best_j < 0 || pb > best_p)) best_p = pb, best_j = j;
        }
    };
    own_best();
    for (int r = 0; r < k; ++r) {
        const unsigned top = __reduce_max_sync(FULL, best_j < 0 ? 0u : best_p);
        const unsigned mine =
            best_j >= 0 && best_p == top ? (unsigned)(lane + 32 * best_j) : 0xFFFFFFFFu;
        const int e = (int)__reduce_min_sync(FULL, mine);
        const float w = __uint_as_float(top);
        if ((e & 31) == lane) {
            taken |= 1u << (e >> 5);
            own_best();
        }
        if (lane == r) {
            my_e = e;
            my_w = w;
        }
        wsum += w;
    }
#else
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
#endif
    if (lane < k) {
        const float denom = norm ? fmaxf(wsum, min_sum) : 1.f;
        experts[lane] = my_e;
        weights[lane] = norm ? my_w / denom : my_w;
    }
}

#define SHARED_GATE_THREADS 256  // SHARED_THREADS in moe_cuda.py: moe_add_shared_f32's CTA

// gate[n] = sigmoid(h[n] . gate_inp) for the n_tok <= NT tokens of h [n_tok, d], each summed in
// moe_add_shared_f32's order for a CTA of SHARED_GATE_THREADS threads (thread v sums
// i = v, v + 256, ..; each warp's 32 sums by warp_sum; the 8 warps' in order), by a CTA of 128
// threads, each standing for threads t and t + 128: the same bits. All tokens in one pass (their
// loads in flight together). Every thread of the CTA must call it.
template <int NT>
__device__ __forceinline__ void shared_gates(const float* __restrict__ h,
                                             const float* __restrict__ gate_inp,
                                             float* __restrict__ gate, int n_tok, int d) {
    static_assert(SHARED_GATE_THREADS == 2 * 32 * 4, "two virtual threads per thread of 4 warps");
    __shared__ float part[NT][SHARED_GATE_THREADS / 32];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    float lo[NT], hi[NT];
#pragma unroll
    for (int n = 0; n < NT; n++) lo[n] = hi[n] = 0.0f;
#pragma unroll 2
    for (int i = t; i < d; i += SHARED_GATE_THREADS) {  // virtual thread t + 128 reads i + 128
        const bool up = i + 128 < d;
        const float g0 = gate_inp[i], g1 = up ? gate_inp[i + 128] : 0.0f;
#pragma unroll
        for (int n = 0; n < NT; n++) {
            if (n < n_tok) {
                lo[n] = __fadd_rn(lo[n], __fmul_rn(h[(size_t)n * d + i], g0));
                if (up) hi[n] = __fadd_rn(hi[n], __fmul_rn(h[(size_t)n * d + i + 128], g1));
            }
        }
    }
#pragma unroll
    for (int n = 0; n < NT; n++) {
        lo[n] = warp_sum(lo[n]);
        hi[n] = warp_sum(hi[n]);
        if (lane == 0) {
            part[n][warp] = lo[n];
            part[n][warp + 4] = hi[n];
        }
    }
    __syncthreads();
    if (t < n_tok) {
        float total = 0.0f;
        for (int w = 0; w < SHARED_GATE_THREADS / 32; ++w) total += part[t][w];
        gate[t] = sigmoid(total);
    }
}
