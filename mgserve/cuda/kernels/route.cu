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
//
// matvec_route_<T>_t<NT> (T: F32, F16, BF16, the router formats of GGUF files; NT: 1, 2, 4, 8
//   tokens): a decode step's router product, routing and shared-expert gate in one launch. The
//   CTAs compute the logits exactly as matvec.cu's matvec_<T>_t<NT> (the same template and
//   tuning, so the same bits), write them, and take a ticket; the CTA that takes the last one
//   (every other CTA's logits are then written and published by its ticket: tickets.cuh) routes
//   the tokens as moe_route does (route_warp, route.cuh), then resets the counter for the next
//   launch (a graph's replay). With gate_inp, one CTA more (past the rows) computes each token's
//   shared-expert gate sigmoid(h . gate_inp) in moe_shared.cu's order (shared_gates) while the
//   others compute their rows. One launch instead of three (the router's matvec,
//   moe_route, and the gate's dot product inside moe_add_shared), with the same results.
//   A token's logits, route and gate do not depend on the other tokens of its kernel (each
//   sums in the same lane order for every NT), so a launch may take its tokens in groups (grid
//   y, route.split), each group with its own counter, last CTA and routing.

#include "matvec.cuh"
#include "route.cuh"
#include "tickets.cuh"

#define ROUTE_WARPS 4

extern "C" __global__ void __launch_bounds__(ROUTE_WARPS * 32)
moe_route(const float* __restrict__ logits,  // [N, E]
          int* __restrict__ experts,          // [N, k] best first
          float* __restrict__ weights,        // [N, k]
          int n_tok, int n_exp, int k, int norm, float min_sum) {
    grid_sync();
    const int n = blockIdx.x * ROUTE_WARPS + (threadIdx.x >> 5);
    if (n >= n_tok) return;  // warp-uniform
    route_warp(logits + (size_t)n * n_exp, experts + (size_t)n * k, weights + (size_t)n * k,
               n_exp, k, norm, min_sum);
}

// w: the router [n_exp, k_dim] in format T; x: h fp32 [n_tok, k_dim]; logits: fp32 [n_tok, n_exp]
// (written, then read by the last CTA); experts, weights: [n_tok, k]; gate_inp: fp32 [k_dim] or
// null (no gate computed); gate: fp32 [n_tok], sigmoid(x[n] . gate_inp); count: gridDim.y
// counters, 0 before the launch (and after it). The grid: x the rows' CTAs, and one more with
// gate_inp; y the groups of NT tokens (route.split: a launch of 8 tokens as 4 groups of 2 has
// 4x the warps, each with a quarter of the serial work, and routes the groups in parallel).
template <typename T, int NT>
__device__ void matvec_route(const u8* __restrict__ w, const float* __restrict__ x,
                             float* __restrict__ logits, int n_exp, int k_dim, int n_tok,
                             int* __restrict__ experts, float* __restrict__ weights, int k,
                             int norm, float min_sum, const float* __restrict__ gate_inp,
                             float* __restrict__ gate, unsigned* __restrict__ count) {
    // token group blockIdx.y: tokens NT y .. NT y + NT - 1 of the launch's n_tok, with counter
    // count[y] (a token's bits do not depend on the others in its kernel: see the header)
    const int g0 = NT * blockIdx.y;
    x += (size_t)g0 * k_dim;
    logits += (size_t)g0 * n_exp;
    experts += (size_t)g0 * k;
    weights += (size_t)g0 * k;
    gate += gate ? g0 : 0;
    count += blockIdx.y;
    n_tok = min(n_tok - g0, NT);
    matvec<T, NT>(w, x, logits, n_exp, k_dim, n_tok, nullptr, nullptr);
    if (gate_inp && blockIdx.x == gridDim.x - 1)  // the CTA past the rows: the gates, beside
        shared_gates<NT>(x, gate_inp, gate, n_tok, k_dim);  // the others' rows (read later)
    if (!last_cta(count, gridDim.x)) return;  // the logits (warp_sums_put's lanes) published
    ticket_acquire();  // the other CTAs' logits, published by their tickets, are visible
    const int warp = threadIdx.x >> 5;
    for (int n = warp; n < n_tok; n += WARPS_PER_CTA)
        route_warp(logits + (size_t)n * n_exp, experts + (size_t)n * k, weights + (size_t)n * k,
                   n_exp, k, norm, min_sum);
    if (threadIdx.x == 0) *count = 0u;  // every CTA has taken its ticket: none reads it again
}

#define MATVEC_ROUTE_ENTRY(TYPE, NT)                                                            \
    extern "C" __global__ void __launch_bounds__(32 * WARPS_PER_CTA) matvec_route_##TYPE##_t##NT( \
        const u8* __restrict__ w, const float* __restrict__ x, float* __restrict__ logits,      \
        int n_exp, int k_dim, int n_tok, int* __restrict__ experts, float* __restrict__ weights,\
        int k, int norm, float min_sum, const float* __restrict__ gate_inp,                    \
        float* __restrict__ gate, unsigned* __restrict__ count) {                               \
        matvec_route<TYPE, NT>(w, x, logits, n_exp, k_dim, n_tok, experts, weights, k, norm,   \
                               min_sum, gate_inp, gate, count);                                \
    }

#define MATVEC_ROUTE_TYPE(TYPE)   \
    MATVEC_ROUTE_ENTRY(TYPE, 1)   \
    MATVEC_ROUTE_ENTRY(TYPE, 2)   \
    MATVEC_ROUTE_ENTRY(TYPE, 4)   \
    MATVEC_ROUTE_ENTRY(TYPE, 8)

MATVEC_ROUTE_TYPE(F32)
MATVEC_ROUTE_TYPE(F16)
MATVEC_ROUTE_TYPE(BF16)
