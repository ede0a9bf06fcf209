// The small kernels around attention: writing K/V rows into the slot pools, and scoring QSA
// blocks (qsa_select.cu then picks each query's blocks from the scores).
//
// kv_write, grid (N, n_kv), D threads (D <= 1024; q8_0 needs D % 32 == 0):
//   thread d of CTA (i, kh) writes value d of token i's head kh at (slots[i], pos[i]). q8_0: one
//   warp per 32-value block, rounding exactly as mgserve.core.kvcache.quantize_q8_0 (fp32
//   d = amax / 127, inv = 1 / d, q = sign(x * inv) * floor(|x * inv| + 0.5), d stored as f16 with
//   round-to-nearest-even), every operation IEEE-rounded so the bits match the CPU reference.
//   Tokens whose position is outside [0, n_ctx) are skipped.
//
// qsa_scores, grid (ceil(n_cols / QS_KEYS), B), QS_THREADS = 256 threads:
//   scores[b, n] = sum_h relu(iq[b, h] . blocks[slots[b], n]) / norm (+0, never -0) for the
//   complete blocks n < lengths[b] / ratio of sessions whose selection is sparse (complete > top);
//   every other entry of the row (n < n_cols) is -inf: dense sessions select without scores.
//   Rows are `stride` floats apart (ops/qsa_cuda.py pads them to a multiple of 4 for qsa_select's
//   16-byte loads); the padding is not written.
//   Each warp scores 4 block keys at a time, 8 lanes per key; lane `sub` of a key reads float4
//   number c * 8 + sub (c < Di / 32), so 8 lanes read 128 contiguous bytes. The indexer queries
//   live in shared memory. The block pool is read once per step (the bandwidth of this kernel).

#include "math.cuh"
#include "scalar.cuh"
#include "pdl.cuh"

#define QS_WARPS 8
#define QS_THREADS (32 * QS_WARPS)
#define QS_KEYS_PER_WARP 32
#define QS_KEYS (QS_WARPS * QS_KEYS_PER_WARP)  // block keys per CTA (ops/qsa_cuda.py: QS_KEYS)
#define QS_MAX_HI 8                            // indexer heads at most
#define QS_MAX_DI 256                          // indexer head dim at most (multiple of 32)

// kind: 0 = f32 pool, 1 = f16 pool, 2 = q8_0 pool.
extern "C" __global__ void kv_write(const float* __restrict__ x,  // [N, n_kv, D]
                                    u8* __restrict__ values, u16* __restrict__ scales,
                                    const int* __restrict__ slots, const int* __restrict__ pos,
                                    int n_ctx, int n_kv, int kind) {
    grid_sync();
    const int i = blockIdx.x, kh = blockIdx.y, d = threadIdx.x, D = blockDim.x;
    const int p = pos[i];
    if (p < 0 || p >= n_ctx) return;
    const size_t row = ((size_t)slots[i] * n_ctx + p) * n_kv + kh;
    const float v = x[((size_t)i * n_kv + kh) * D + d];
    if (kind == 0) {
        reinterpret_cast<float*>(values)[row * D + d] = v;
    } else if (kind == 1) {
        reinterpret_cast<u16*>(values)[row * D + d] = f16_rn(v);
    } else {
        const float dq = __fdiv_rn(warp_max(fabsf(v)), 127.f);
        const float inv = dq > 0.f ? __fdiv_rn(1.f, dq) : 0.f;
        const float s = __fmul_rn(v, inv);
        const float r = floorf(__fadd_rn(fabsf(s), 0.5f));
        const float qv = s > 0.f ? r : (s < 0.f ? -r : 0.f);
        reinterpret_cast<signed char*>(values)[row * D + d] = (signed char)(int)qv;
        if ((d & 31) == 0) scales[row * (D / 32) + d / 32] = f16_rn(dq);
    }
}

extern "C" __global__ void __launch_bounds__(QS_THREADS)
qsa_scores(const float* __restrict__ iq,      // [B, n_hi, di] indexer queries
           const float* __restrict__ blocks,  // [n_slots, blk_stride, di] pooled block keys
           const int* __restrict__ slots, const int* __restrict__ lengths,
           float* __restrict__ scores,  // [B, stride] block scores
           int n_cols, int stride, int blk_stride, int n_hi, int di, int ratio, int top,
           float norm) {
    grid_sync();
    __shared__ __align__(16) float s_iq[QS_MAX_HI * QS_MAX_DI];
    const int b = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int k_begin = blockIdx.x * QS_KEYS;
    const int k_end = min(k_begin + QS_KEYS, n_cols);
    float* row = scores + (size_t)b * stride;
    const int complete = max(lengths[b], 0) / ratio;
    if (complete <= top || k_begin >= complete) {  // dense query, or no complete block here
        for (int k = k_begin + tid; k < k_end; k += QS_THREADS) row[k] = NEG_INF;
        return;
    }
    for (int i = tid; i < n_hi * di; i += QS_THREADS) s_iq[i] = iq[(size_t)b * n_hi * di + i];
    __syncthreads();

    const float* base = blocks + (size_t)slots[b] * blk_stride * di;
    const int sub = lane & 7, kk = lane >> 3, nf4 = di / 32;
    const float4* q4 = reinterpret_cast<const float4*>(s_iq);
    for (int pass = 0; pass < QS_KEYS_PER_WARP / 4; ++pass) {
        const int key = k_begin + warp * QS_KEYS_PER_WARP + pass * 4 + kk;
        const bool ok = key < complete && key < k_end;
        float acc[QS_MAX_HI];
#pragma unroll
        for (int h = 0; h < QS_MAX_HI; ++h) acc[h] = 0.f;
        if (ok) {
            const float4* kp = reinterpret_cast<const float4*>(base + (size_t)key * di);
            for (int c = 0; c < nf4; ++c) {
                const float4 kv = __ldg(kp + c * 8 + sub);
#pragma unroll
                for (int h = 0; h < QS_MAX_HI; ++h) {
                    if (h < n_hi) {
                        const float4 qv = q4[h * (di / 4) + c * 8 + sub];
                        acc[h] += qv.x * kv.x + qv.y * kv.y + qv.z * kv.z + qv.w * kv.w;
                    }
                }
            }
        }
#pragma unroll
        for (int h = 0; h < QS_MAX_HI; ++h) {
            acc[h] += __shfl_xor_sync(FULL, acc[h], 1);
            acc[h] += __shfl_xor_sync(FULL, acc[h], 2);
            acc[h] += __shfl_xor_sync(FULL, acc[h], 4);
        }
        if (sub == 0 && key < k_end) {
            float sc = 0.f;
#pragma unroll
            for (int h = 0; h < QS_MAX_HI; ++h)
                if (h < n_hi) sc += fmaxf(acc[h], 0.f);
            row[key] = ok ? __fadd_rn(__fdiv_rn(sc, norm), 0.f) : NEG_INF;  // -0 -> +0
        }
    }
}
