// The glue of the MoE prefill paths (mgserve/cuda/ops/moe_prefill_cuda.py): the row maps, gather
// and silu * up of the bucketed cuBLAS products (moe_prefill.py), and the row maps and combine of
// the grouped tensor-core products (qgemm.cu), one launch each per layer.
//
// Layout ("padded rows"): the (token, slot) pairs of a layer, sorted by expert, are laid out
// expert after expert, each expert's rows padded to its bucket's row count. Position q of the
// sorted order (expert e = sorted_e[q], pair order[q] = token * kk + slot) lands on padded row
// q + shift[e]; pad rows hold token 0 (their results are computed and never read). The grouped
// products have no padding (shift null: padded row = sorted position).
//
//   moe_pair_rows    one thread per sorted position q: pair_row[order[q]] = q + shift[e] and
//                    row_token[q + shift[e]] = order[q] / kk. grid ceil(P / 256), 256 threads.
//   moe_gather_f16   one CTA (128 threads) per padded row r: xs[r, :] = f16(x[row_token[r], :]),
//                    each thread 4 consecutive values (one float4 load, one 8-byte store when
//                    d % 4 == 0 and rows are 16-byte aligned: VEC), strided by 512.
//   moe_silu_mul_f16 one CTA (256 threads) per row r of gu [R, 2 ff] (gate | up, fp32):
//                    h[r, i] = f16(silu(gate) * up), threads strided over i.
//   moe_combine      grid (N, ceil(d / (4 * 128))), 128 threads, 4 columns of one token each:
//                    out[t, c] = sum_j w[t, j] y[pair_row[t kk + j], c] in the order j = 0, 1, ..
//                    (fixed: deterministic, no atomics).

#include "math.cuh"
#include "scalar.cuh"
#include "pdl.cuh"

extern "C" __global__ void __launch_bounds__(256)
    moe_pair_rows(const int* __restrict__ sorted_e, const long long* __restrict__ order,
                  const int* __restrict__ shift, int* __restrict__ pair_row,
                  int* __restrict__ row_token, int n_pairs, int kk) {
    grid_sync();
    const int q = blockIdx.x * blockDim.x + threadIdx.x;
    if (q >= n_pairs) return;
    const int r = shift ? q + shift[sorted_e[q]] : q;
    const long long p = order[q];
    pair_row[p] = r;
    row_token[r] = (int)(p / kk);
}

extern "C" __global__ void __launch_bounds__(128)
    moe_gather_f16(const float* __restrict__ x, const int* __restrict__ row_token,
                   u16* __restrict__ xs, int d, int vec) {
    grid_sync();
    const long long r = blockIdx.x;
    const float* src = x + (long long)row_token[r] * d;
    u16* dst = xs + r * d;
    if (vec) {
        for (int c = 4 * threadIdx.x; c < d; c += 4 * blockDim.x) {
            const float4 v = *reinterpret_cast<const float4*>(src + c);
            *reinterpret_cast<uint2*>(dst + c) = make_uint2(f16x2_rn(v.x, v.y), f16x2_rn(v.z, v.w));
        }
    } else {
        for (int c = threadIdx.x; c < d; c += blockDim.x) dst[c] = f16_rn(src[c]);
    }
}

extern "C" __global__ void __launch_bounds__(256)
    moe_silu_mul_f16(const float* __restrict__ gu, u16* __restrict__ h, int ff) {
    grid_sync();
    const long long r = blockIdx.x;
    const float* g = gu + r * 2 * ff;
    u16* out = h + r * ff;
    for (int i = threadIdx.x; i < ff; i += blockDim.x) {
        out[i] = f16_rn(silu(g[i]) * g[ff + i]);
    }
}

extern "C" __global__ void __launch_bounds__(128)
    moe_combine(const float* __restrict__ y, const int* __restrict__ pair_row,
                const float* __restrict__ weights, float* __restrict__ out, int kk, int d,
                int vec) {
    grid_sync();
    const long long t = blockIdx.x;
    const int* rows = pair_row + t * kk;
    const float* w = weights + t * kk;
    float* o = out + t * d;
    if (vec) {
        const int c = 4 * (blockIdx.y * blockDim.x + threadIdx.x);
        if (c >= d) return;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int j = 0; j < kk; j++) {
            const float wj = w[j];
            const float4 v = *reinterpret_cast<const float4*>(y + (long long)rows[j] * d + c);
            if (j == 0) {
                acc = make_float4(v.x * wj, v.y * wj, v.z * wj, v.w * wj);
            } else {
                acc.x = fmaf(v.x, wj, acc.x);
                acc.y = fmaf(v.y, wj, acc.y);
                acc.z = fmaf(v.z, wj, acc.z);
                acc.w = fmaf(v.w, wj, acc.w);
            }
        }
        *reinterpret_cast<float4*>(o + c) = acc;
    } else {
        const int c0 = 4 * (blockIdx.y * blockDim.x + threadIdx.x);
        for (int c = c0; c < c0 + 4 && c < d; c++) {
            float acc = 0.f;
            for (int j = 0; j < kk; j++) {
                const float v = y[(long long)rows[j] * d + c] * w[j];
                acc = j == 0 ? v : acc + v;
            }
            o[c] = acc;
        }
    }
}
