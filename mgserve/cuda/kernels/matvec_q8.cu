// Quantized matvec on int8 activations: y[t, n] = sum_k W[n, k] * xq[t, k], with integer dot
// products (dp4a) against the weights' packed quants and the block scales applied in fp32.
//
// Two kernels per call: quantize_q8 turns fp32 x [n_tok, k] into int8 xq [n_tok, k] plus one fp32
// scale per 32 values (xd [n_tok, k / 32]): d = max|x| / 127, q = roundf(x / d) (IEEE division,
// ties away from zero), so x is replaced by d * q. Then matvec_q8_<type>_t<NT> reads W once.
//
// Why: the fp32 kernels (matvec.cu) spend ~4 float ops per weight decoding and multiplying and
// stall on that, not on DRAM. Here 4 weights cost one dp4a plus a mask/shift on a 32-bit word.
//
// Layout of the work: a group of Q8_GROUP_THREADS threads (a warp, or the whole CTA of
// Q8_THREADS) owns R output rows (Q8_ROWS_1 for one token, Q8_ROWS_N for more); its threads walk
// the rows in "chunks" (a format's 16-byte unit of quants, CHUNKS per block), each loading its
// chunk of all R rows before any arithmetic, so R * 16 bytes per thread are in flight. Partial
// sums meet through warp shuffles (and a small shared array when the group is the CTA).
// The weights' exact value is kept: only the activations are rounded.
// 2..8 tokens: matvec_q8mma_<type>_t<NT> (below) gives each token the one-token kernel's bits
// with the integer sums from tensor cores.

#include "gguf_blocks_q8.cuh"
#include "math.cuh"
#include "pdl.cuh"

#define Q8_THREADS 128
#ifndef Q8_ROWS_1
#define Q8_ROWS_1 2  // rows per CTA for one token (H200: 2 beat 1 and 4 at 2560-9728 wide)
#endif
#ifndef Q8_GROUP_THREADS
#define Q8_GROUP_THREADS 128  // threads sharing rows: 32 (a warp) or Q8_THREADS (the CTA)
#endif
#ifndef Q8_ROWS_N
#define Q8_ROWS_N 2  // rows per CTA for 2..8 tokens (1 and 4 each won some shapes, lost more)
#endif

// ---- activation quantization -------------------------------------------------------------------

// One warp per 32 values of one token. x: fp32 [n_tok, k]; xq: int8 [n_tok, k]; xd: [n_tok, k/32].
extern "C" __global__ void quantize_q8(const float* __restrict__ x, i8* __restrict__ xq,
                                       float* __restrict__ xd, int n_groups) {
    grid_sync();
    const int g = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);  // group of 32 values
    if (g >= n_groups) return;
    const int lane = threadIdx.x & 31;
    const float v = x[(size_t)g * 32 + lane];
    const float d = warp_max(fabsf(v)) / 127.f;
    const float q = d == 0.f ? 0.f : roundf(__fdiv_rn(v, d));
    xq[(size_t)g * 32 + lane] = (i8)(int)q;
    if (lane == 0) xd[g] = d;
}

// ---- the kernel --------------------------------------------------------------------------------

// w: [n_rows, k / BLOCK * BYTES] bytes; xq: int8 [n_tok, k]; xd: fp32 [n_tok, k / 32];
// y: fp32 [n_tok, n_rows]. k is a multiple of BLOCK; n_tok is 1..NT. bias [n_rows] and
// res [n_tok, n_rows] (null when absent): y = res + (W x + bias).
template <typename T, int NT>
__device__ void matvec_q8(const u8* __restrict__ w, const i8* __restrict__ xq,
                          const float* __restrict__ xd, float* __restrict__ y, int n_rows, int k,
                          int n_tok, const float* __restrict__ bias,
                          const float* __restrict__ res) {
    constexpr int R = NT == 1 ? Q8_ROWS_1 : Q8_ROWS_N;
    constexpr int G = Q8_GROUP_THREADS, GROUPS = Q8_THREADS / G, WARPS = G / 32;
    static_assert(G == 32 || G == Q8_THREADS, "Q8_GROUP_THREADS: 32 or Q8_THREADS");
    // (threadIdx.x % G written out: the plain modulo made ptxas use 2.6x the registers at NT=8)
    const int tid = G == Q8_THREADS ? (int)threadIdx.x : (int)(threadIdx.x & 31);
    const int row0 = (blockIdx.x * GROUPS + threadIdx.x / G) * R;
    const size_t n_blocks = k / T::BLOCK, row_bytes = n_blocks * T::BYTES;
    const u8* wrow[R];
#pragma unroll
    for (int rr = 0; rr < R; rr++) {
        // past the last row: re-read a valid row (keeps the loop branch-free); never written
        const int row = min(row0 + rr, n_rows - 1);
        wrow[rr] = w + (size_t)row * row_bytes;
    }
    // the CTA's rows into L2 while the kernel before still runs (pdl.cuh)
    prefetch_rows_l2(w, row_bytes, blockIdx.x * GROUPS * R, GROUPS * R, n_rows);
    grid_sync();
    float acc[R][NT] = {};
    const int n_chunks = (int)n_blocks * T::CHUNKS;
#pragma unroll 2
    for (int c = tid; c < n_chunks; c += G) {
        const int b = c / T::CHUNKS, j = c % T::CHUNKS;
        typename T::Frag f[R];
#pragma unroll
        for (int rr = 0; rr < R; rr++) f[rr] = T::load(wrow[rr] + (size_t)b * T::BYTES, j);
#pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t < n_tok) {
                const i8* xb = xq + (size_t)t * k + (size_t)b * T::BLOCK;
                const float* db = xd + (size_t)t * (k / 32) + (size_t)b * (T::BLOCK / 32);
#pragma unroll
                for (int rr = 0; rr < R; rr++) acc[rr][t] = __fadd_rn(acc[rr][t], T::dot(f[rr], j, xb, db));
            }
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __shared__ float part[WARPS][R][NT];
    // the warp's sum of acc[rr][t] to y (the warp is the group) or to the CTA's partials
    auto put = [&](float v, int rr, int t) {
        if (WARPS == 1) {
            if (t < n_tok && row0 + rr < n_rows)
                y[(size_t)t * n_rows + row0 + rr] = linear_out(v, bias, res, t, row0 + rr, n_rows);
        } else {
            part[warp][rr][t] = v;
        }
    };
    warp_sums_put(acc, lane, put);  // warp_sum's bits in fewer shuffles where R NT allows
    if (WARPS == 1) return;
    __syncthreads();
    if (threadIdx.x < R * NT) {
        const int rr = threadIdx.x / NT, t = threadIdx.x % NT;
        float v = 0.f;
#pragma unroll
        for (int wi = 0; wi < WARPS; wi++) v += part[wi][rr][t];
        if (t < n_tok && row0 + rr < n_rows)
            y[(size_t)t * n_rows + row0 + rr] = linear_out(v, bias, res, t, row0 + rr, n_rows);
    }
}

// ---- several tokens on tensor cores ------------------------------------------------------------

// The same function as matvec_q8<T, 1> for each token, bit for bit, with the integer sums from
// int8 mma (one tile of a chunk serves 8 rows and up to 8 tokens) instead of dp4a per token.
// matvec_q8's order is kept: position p = threadIdx.x of its 128 threads sums the chunks p,
// p + 128, ... of a row in order (each chunk's float from T::finish), its warps add their
// positions by warp_sum's butterfly, then the 4 warps' partials in order. Here a CTA takes
// Q8MMA_ROWS rows and warp w the positions 32 w..32 w + 31, in 4 steps of 8 chunks: step s of a
// round puts chunk 8 s + g of its 32 in lane (g, q) (g = lane / 4, q = lane % 4), which keeps that
// position's sums for rows 2q, 2q + 1 and every token (acc[s]). A step's mma tiles (T::tile: row
// g, token g) leave their sums in shared memory for those lanes. At the end the butterfly over the
// 32 positions runs as acc[s] + acc[s + 2] (offset 16), their sum (offset 8), then shuffles of
// lanes 16, 8, 4 apart (offsets 4, 2, 1).
#define Q8MMA_ROWS 8
#define Q8MMA_STEP 8  // chunks per step

template <typename T, int NT>
__device__ void matvec_q8mma(const u8* __restrict__ w, const i8* __restrict__ xq,
                             const float* __restrict__ xd, float* __restrict__ y, int n_rows, int k,
                             int n_tok, const float* __restrict__ bias,
                             const float* __restrict__ res) {
    static_assert(Q8_GROUP_THREADS == Q8_THREADS, "mirrors matvec_q8 with 128-thread groups");
    constexpr int SW = 4 * T::MMAS / T::TILE_CHUNKS;  // ints per (chunk, token, q)
    constexpr int LINE = NT * 4 * SW + 4;             // per chunk (+16 bytes against conflicts)
    __shared__ __align__(16) int sums[Q8_THREADS / 32][Q8MMA_STEP][LINE];
    __shared__ float part[Q8_THREADS / 32][Q8MMA_ROWS][NT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int row0 = blockIdx.x * Q8MMA_ROWS;
    const size_t n_blocks = k / T::BLOCK, row_bytes = n_blocks * T::BYTES;
    const int n_chunks = (int)n_blocks * T::CHUNKS;
    // past the last row or token: re-read a valid one (never written)
    const u8* wtile = w + (size_t)min(row0 + g, n_rows - 1) * row_bytes;
    const i8* xtile = xq + (size_t)min(g, n_tok - 1) * k;
    const u8* wrow[2];
#pragma unroll
    for (int e = 0; e < 2; e++) wrow[e] = w + (size_t)min(row0 + 2 * q + e, n_rows - 1) * row_bytes;
    prefetch_rows_l2(w, row_bytes, row0, Q8MMA_ROWS, n_rows);
    grid_sync();
    float acc[4][2][NT] = {};
    for (int base = 32 * warp; base < n_chunks; base += Q8_THREADS) {
#pragma unroll
        for (int s = 0; s < 4; s++) {
            const int c0 = base + Q8MMA_STEP * s;
            if (c0 >= n_chunks) break;
#pragma unroll
            for (int tt = 0; tt < Q8MMA_STEP / T::TILE_CHUNKS; tt++) {
                const int c = c0 + tt * T::TILE_CHUNKS;
                if (c >= n_chunks) break;
                const int b = c / T::CHUNKS;
                int out[T::MMAS][4];
                T::tile(wtile + (size_t)b * T::BYTES, c % T::CHUNKS, xtile + (size_t)b * T::BLOCK,
                        q, out);
                if (g < NT) {
#pragma unroll
                    for (int h = 0; h < T::TILE_CHUNKS; h++) {
                        int* dst = &sums[warp][tt * T::TILE_CHUNKS + h][(g * 4 + q) * SW];
#pragma unroll
                        for (int i = 0; i < SW; i++)
                            dst[i] = T::TILE_CHUNKS == 1 ? out[i / 4][i % 4] : out[0][2 * h + i];
                    }
                }
            }
            __syncwarp();
            const int c = c0 + g;
            if (c < n_chunks) {
                const int b = c / T::CHUNKS, j = c % T::CHUNKS;
                const typename T::Sc sc[2] = {T::head(wrow[0] + (size_t)b * T::BYTES, j),
                                              T::head(wrow[1] + (size_t)b * T::BYTES, j)};
#pragma unroll
                for (int t = 0; t < NT; t++) {
                    if (t < n_tok) {
                        const int* src = &sums[warp][g][(t * 4 + q) * SW];
                        const float* db = xd + (size_t)t * (k / 32) + (size_t)b * (T::BLOCK / 32);
#pragma unroll
                        for (int e = 0; e < 2; e++) {
                            int si[T::SUMS];  // sum i of row e: out[i / 2][2 (i % 2) + e]
#pragma unroll
                            for (int i = 0; i < T::SUMS; i++)
                                si[i] = src[T::TILE_CHUNKS == 1 ? 4 * (i / 2) + 2 * (i % 2) + e : e];
                            acc[s][e][t] = __fadd_rn(acc[s][e][t], T::finish(sc[e], si, j, db));
                        }
                    }
                }
            }
            __syncwarp();
        }
    }
#pragma unroll
    for (int e = 0; e < 2; e++)
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float v = (acc[0][e][t] + acc[2][e][t]) + (acc[1][e][t] + acc[3][e][t]);
#pragma unroll
            for (int off = 16; off >= 4; off >>= 1) v += __shfl_xor_sync(FULL, v, off);
            if (g == 0) part[warp][2 * q + e][t] = v;
        }
    __syncthreads();
    if (threadIdx.x < Q8MMA_ROWS * NT) {
        const int rr = threadIdx.x / NT, t = threadIdx.x % NT;
        float v = 0.f;
#pragma unroll
        for (int wi = 0; wi < Q8_THREADS / 32; wi++) v += part[wi][rr][t];
        if (t < n_tok && row0 + rr < n_rows)
            y[(size_t)t * n_rows + row0 + rr] = linear_out(v, bias, res, t, row0 + rr, n_rows);
    }
}

// One kernel of the family: NAME(w, xq, xd, y, n_rows, k, n_tok, bias, res) calls the device
// function after it (a template instance, whose commas ride in __VA_ARGS__).
#define MATVEC_Q8_KERNEL(NAME, ...)                                                             \
    extern "C" __global__ void __launch_bounds__(Q8_THREADS)                                    \
        NAME(const u8* __restrict__ w, const i8* __restrict__ xq, const float* __restrict__ xd, \
             float* __restrict__ y, int n_rows, int k, int n_tok,                               \
             const float* __restrict__ bias, const float* __restrict__ res) {                   \
        __VA_ARGS__(w, xq, xd, y, n_rows, k, n_tok, bias, res);                                 \
    }
#define MATVEC_Q8_ENTRY(TYPE, NT) MATVEC_Q8_KERNEL(matvec_q8_##TYPE##_t##NT, matvec_q8<TYPE, NT>)
#define MATVEC_Q8MMA_ENTRY(TYPE, NT) \
    MATVEC_Q8_KERNEL(matvec_q8mma_##TYPE##_t##NT, matvec_q8mma<TYPE, NT>)

#if Q8_GROUP_THREADS == Q8_THREADS  // the mma kernels mirror the 128-thread groups only
#define MATVEC_Q8MMA_TYPE(TYPE)     \
    MATVEC_Q8MMA_ENTRY(TYPE, 2) \
    MATVEC_Q8MMA_ENTRY(TYPE, 4) \
    MATVEC_Q8MMA_ENTRY(TYPE, 8)
#else
#define MATVEC_Q8MMA_TYPE(TYPE)
#endif

#define MATVEC_Q8_TYPE(TYPE) \
    MATVEC_Q8_ENTRY(TYPE, 1) \
    MATVEC_Q8_ENTRY(TYPE, 2) \
    MATVEC_Q8_ENTRY(TYPE, 4) \
    MATVEC_Q8_ENTRY(TYPE, 8) \
    MATVEC_Q8MMA_TYPE(TYPE)

MATVEC_Q8_TYPE(Q4_K)
MATVEC_Q8_TYPE(Q6_K)
MATVEC_Q8_TYPE(Q5_0)
MATVEC_Q8_TYPE(Q8_0)
