// QSA block selection: for each query row of block scores, the `top` highest-scoring complete
// blocks (ties: the lower block first), written in ascending block order, which is the order
// attn_decode reads the selected cells in (ops/qsa.py: select_blocks is the torch version).
//
// qsa_select, grid (N), SEL_THREADS = 1024 threads (32 warps), one CTA per query row:
//   complete = min(lengths[n] / ratio, n_cols) blocks are eligible: only scores[n, 0:complete)
//   are read, so whatever lies past them (-inf, stale values, padding up to `stride`) is ignored.
//   complete <= top (dense query): sel[n] = 0, 1, .., complete - 1, then -1 (no key is read).
//   Otherwise a radix select on 32-bit order keys (float bits made monotone as unsigned):
//   - up to three histogram passes over the row (digits of 11, 11 and 10 bits from the top) find
//     the threshold key T and `need`, how many of the keys equal to T are taken; a pass stops the
//     refinement early once its whole threshold bucket is taken. Counts are shared-memory integer
//     atomics (exact, so the result never depends on thread timing; ptxas emits warp-aggregated
//     ATOMS.POPC.INC for them). Exact ties are common (relu makes every score of a block whose
//     indexer heads all score negative exactly +0), so keys equal to +0 and to the row's first
//     key are counted in registers instead of in the atomics;
//   - a compaction pass in tiles of SEL_TILE keys, thread t owning keys 8t .. 8t + 7 of the tile
//     (two 16-byte loads): a CTA-wide exclusive scan of (above, equal) counts gives every key its
//     rank, so a key above T goes to position (above before it) + min(equal before it, need), and
//     a key equal to T is taken iff fewer than `need` equal keys precede it (lower blocks first).
//   The row is read from L2 (the scoring kernel wrote it just before), at most four times (five
//   in qsa_select_c, whose CTAs count their slice's keys once more before the compaction).
//
// qsa_select_c, grid (N * SEL_CLUSTER) in thread block clusters of SEL_CLUSTER CTAs (sm_90), one
//   cluster per query row: the same selection with the row's tiles split into SEL_CLUSTER
//   contiguous slices, CTA rank r taking slice r. Each pass's histogram is summed from every
//   CTA's (distributed shared memory; integer counts, so every CTA finds the same threshold),
//   and each CTA's compaction starts at the counts of the slices before it, so the output is
//   qsa_select's, element for element. A row of at most SEL_ALONE tiles is done by rank 0 alone,
//   as qsa_select does it (a decode step at short depth pays no cluster barriers).
// Scores must not be NaN. Rows are `stride` floats apart, stride % 4 == 0 and 16-byte aligned.

#include "cluster.cuh"
#include "math.cuh"
#include "pdl.cuh"

#define SEL_THREADS 1024
#define SEL_WARPS (SEL_THREADS / 32)
#define SEL_VEC 8                           // keys per thread per tile
#define SEL_TILE (SEL_THREADS * SEL_VEC)    // keys per tile (< 65536: counts pack in 16 bits)
#define SEL_BINS 2048                       // histogram bins: 11-bit digits
#define SEL_BINS_PER_THREAD (SEL_BINS / SEL_THREADS)
#ifndef SEL_CLUSTER
#define SEL_CLUSTER 8  // CTAs a row in qsa_select_c (ops/qsa_cuda.py SEL_CLUSTER)
#endif
#define SEL_ALONE 2  // qsa_select_c: rows of at most this many tiles stay on one CTA

static_assert(SEL_WARPS == 32, "block_scan scans the warp totals with one warp");
static_assert(SEL_BINS_PER_THREAD == 2, "the bucket search gives each thread two bins");
static_assert(SEL_TILE < 65536, "per-tile counts are packed as two 16-bit fields");

// Float -> unsigned key with the same order (-0 ranks as +0; -inf lowest).
__device__ __forceinline__ unsigned order_key(float f) {
    unsigned u = __float_as_uint(f);
    if (u == 0x80000000u) u = 0u;
    return u ^ ((unsigned)((int)u >> 31) | 0x80000000u);
}

// Scores i0 .. i0 + 7 of the row (i0 % 8 == 0); those at or past `n` are not loaded. The tile
// loops load the next tile before working on this one, so the loads overlap the work.
__device__ __forceinline__ void load_tile(const float* __restrict__ row, int i0, int n, float4& a,
                                          float4& b) {
    a = b = make_float4(0.f, 0.f, 0.f, 0.f);
    if (i0 < n) a = __ldg(reinterpret_cast<const float4*>(row + i0));
    if (i0 + 4 < n) b = __ldg(reinterpret_cast<const float4*>(row + i0 + 4));
}

__device__ __forceinline__ void keys_of(const float4& a, const float4& b, unsigned (&k)[SEL_VEC]) {
    k[0] = order_key(a.x);
    k[1] = order_key(a.y);
    k[2] = order_key(a.z);
    k[3] = order_key(a.w);
    k[4] = order_key(b.x);
    k[5] = order_key(b.y);
    k[6] = order_key(b.z);
    k[7] = order_key(b.w);
}

// body(i0, k) for each tile of the row's scores lo .. n - 1 (lo a multiple of SEL_TILE), in
// order: k holds the order keys of scores i0 .. i0 + 7 (this thread's; those at or past n are not
// loaded). Every thread walks the same tiles, so body may hold barriers.
template <typename Body>
__device__ __forceinline__ void for_each_tile(const float* __restrict__ row, int lo, int n,
                                              Body body) {
    float4 a, b, na, nb;
    load_tile(row, lo + threadIdx.x * SEL_VEC, n, a, b);
    for (int base = lo; base < n; base += SEL_TILE) {
        const int i0 = base + threadIdx.x * SEL_VEC;
        load_tile(row, i0 + SEL_TILE, n, na, nb);
        unsigned k[SEL_VEC];
        keys_of(a, b, k);
        a = na;
        b = nb;
        body(i0, k);
    }
}

// Exclusive prefix sum of v over the CTA in thread order; `total` gets the CTA's sum. Callers
// alternate between two `s_w` buffers: a fast thread may write the next call's warp totals
// before a slow one has read this call's.
__device__ __forceinline__ unsigned block_scan(unsigned v, unsigned* s_w, unsigned& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned x = v;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const unsigned y = __shfl_up_sync(FULL, x, off);
        if (lane >= off) x += y;
    }
    if (lane == 31) s_w[warp] = x;
    __syncthreads();
    if (warp == 0) {
        unsigned w = s_w[lane];
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const unsigned y = __shfl_up_sync(FULL, w, off);
            if (lane >= off) w += y;
        }
        s_w[lane] = w;
    }
    __syncthreads();
    total = s_w[SEL_WARPS - 1];
    return (warp ? s_w[warp - 1] : 0u) + x - v;
}

// Row n's selection (the file's header) by the `parts` CTAs of its cluster (1: no cluster, this
// CTA alone), this one being `rank`; every CTA of the cluster calls it with the same arguments
// but rank.
__device__ __forceinline__ void select_row(const float* __restrict__ scores,
                                           const int* __restrict__ lengths,
                                           int* __restrict__ sel, int stride, int n_cols,
                                           int ratio, int top, int n, int parts, unsigned rank) {
    __shared__ unsigned s_hist[SEL_BINS];
    __shared__ unsigned s_scan[2][SEL_WARPS];
    __shared__ unsigned s_pick[3];  // threshold digit, keys above its bin, keys in its bin
    __shared__ unsigned s_count[2];  // this slice's keys above the threshold and equal to it

    const int tid = threadIdx.x, lane = tid & 31;
    int* out = sel + (size_t)n * top;
    const int complete = min(max(lengths[n], 0) / ratio, n_cols);
    if (complete <= top) {  // dense: every complete block
        if (rank == 0)
            for (int i = tid; i < top; i += SEL_THREADS) out[i] = i < complete ? i : -1;
        return;
    }
    const int n_tiles = (complete + SEL_TILE - 1) / SEL_TILE;
    if (n_tiles <= SEL_ALONE) parts = 1;  // (the same for every CTA of the cluster)
    if (rank >= (unsigned)parts) return;
    const bool clustered = parts > 1;
    const int per = (n_tiles + parts - 1) / parts;  // tiles a slice
    const int lo = min((int)rank * per, n_tiles) * SEL_TILE;
    const int hi = min(lo + per * SEL_TILE, complete);  // this CTA's scores lo .. hi - 1
    const float* row = scores + (size_t)n * stride;
    const unsigned kz = order_key(0.f), k0 = order_key(row[0]);  // the usual tie values

    // Radix select: keys whose top (32 - shift) bits are above `prefix` are all selected; of
    // those equal to it, the first `need` (by block) are. shift == 32: nothing resolved yet.
    unsigned prefix = 0u, need = (unsigned)top;
    int shift = 32, parity = 0;
    for (int pass = 0; pass < 3; ++pass) {
        const int nshift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
        const unsigned dmask = (1u << (shift - nshift)) - 1u;
        for (int i = tid; i < SEL_BINS; i += SEL_THREADS) s_hist[i] = 0u;
        __syncthreads();
        unsigned cz = 0u, c0 = 0u;
        for_each_tile(row, lo, hi, [&](int i0, const unsigned (&k)[SEL_VEC]) {
#pragma unroll
            for (int e = 0; e < SEL_VEC; ++e) {
                if (i0 + e >= hi) break;
                if (k[e] == kz) {
                    ++cz;
                } else if (k[e] == k0) {
                    ++c0;
                } else if (shift == 32 || (k[e] >> shift) == prefix) {
                    atomicAdd(&s_hist[(k[e] >> nshift) & dmask], 1u);
                }
            }
        });
        cz = warp_sum(cz);
        c0 = warp_sum(c0);
        if (lane == 0) {
            if (cz && (shift == 32 || (kz >> shift) == prefix))
                atomicAdd(&s_hist[(kz >> nshift) & dmask], cz);
            if (c0 && k0 != kz && (shift == 32 || (k0 >> shift) == prefix))
                atomicAdd(&s_hist[(k0 >> nshift) & dmask], c0);
        }
        __syncthreads();

        // The bin holding the need-th highest candidate: thread t owns bins 2047 - 2t (hi) and
        // 2046 - 2t (lo), so an exclusive scan in thread order counts the keys in higher bins.
        const int bhi = SEL_BINS - 1 - 2 * tid, blo = bhi - 1;
        unsigned hh = s_hist[bhi], hl = s_hist[blo];
        if (clustered) {  // the row's counts: every slice's histogram
            cluster_sync();  // every CTA's histogram is complete
            hh = hl = 0u;
            for (int r = 0; r < parts; ++r) {
                hh += cluster_load(&s_hist[bhi], (unsigned)r);
                hl += cluster_load(&s_hist[blo], (unsigned)r);
            }
            cluster_sync();  // every read done: the next pass may clear them
        }
        unsigned total;
        const unsigned above = block_scan(hh + hl, s_scan[parity], total);
        parity ^= 1;
        if (above < need && need <= above + hh) {
            s_pick[0] = (unsigned)bhi;
            s_pick[1] = above;
            s_pick[2] = hh;
        } else if (above + hh < need && need <= above + hh + hl) {
            s_pick[0] = (unsigned)blo;
            s_pick[1] = above + hh;
            s_pick[2] = hl;
        }
        __syncthreads();
        const unsigned digit = s_pick[0], n_above = s_pick[1], n_in = s_pick[2];
        prefix = shift == 32 ? digit : ((prefix << (shift - nshift)) | digit);
        shift = nshift;
        need -= n_above;
        if (need == n_in) break;  // the whole bucket is taken: no finer digit matters
    }

    // Compaction in block order. The keys above / equal to the threshold in key i0 + e's bits.
    auto classify = [&](int i0, const unsigned (&k)[SEL_VEC], unsigned& is_above,
                        unsigned& is_equal) {
        is_above = is_equal = 0u;
#pragma unroll
        for (int e = 0; e < SEL_VEC; ++e) {
            if (i0 + e < hi) {
                const unsigned top_bits = k[e] >> shift;
                is_above |= (top_bits > prefix ? 1u : 0u) << e;
                is_equal |= (top_bits == prefix ? 1u : 0u) << e;
            }
        }
    };
    unsigned above_run = 0u, equal_run = 0u;  // keys above / equal to the threshold before the tile
    if (clustered) {  // start after the slices before this one
        unsigned my_above = 0u, my_equal = 0u;
        for_each_tile(row, lo, hi, [&](int i0, const unsigned (&k)[SEL_VEC]) {
            unsigned is_above, is_equal, total;
            classify(i0, k, is_above, is_equal);
            block_scan(__popc(is_above) | (__popc(is_equal) << 16), s_scan[parity], total);
            parity ^= 1;
            my_above += total & 0xFFFFu;
            my_equal += total >> 16;
        });
        if (tid == 0) s_count[0] = my_above, s_count[1] = my_equal;
        cluster_sync();
        for (unsigned r = 0; r < rank; ++r) {
            above_run += cluster_load(&s_count[0], r);
            equal_run += cluster_load(&s_count[1], r);
        }
        cluster_sync();  // every read done before any CTA of the cluster exits
    }
    for_each_tile(row, lo, hi, [&](int i0, const unsigned (&k)[SEL_VEC]) {
        unsigned is_above, is_equal;  // bit e: key i0 + e
        classify(i0, k, is_above, is_equal);
        unsigned total;
        const unsigned before =
            block_scan(__popc(is_above) | (__popc(is_equal) << 16), s_scan[parity], total);
        parity ^= 1;
        unsigned a = above_run + (before & 0xFFFFu), q = equal_run + (before >> 16);
#pragma unroll
        for (int e = 0; e < SEL_VEC; ++e) {
            if (is_above >> e & 1u) {
                out[a + min(q, need)] = i0 + e;
                ++a;
            } else if (is_equal >> e & 1u) {
                if (q < need) out[a + q] = i0 + e;
                ++q;
            }
        }
        above_run += total & 0xFFFFu;
        equal_run += total >> 16;
    });
}

extern "C" __global__ void __launch_bounds__(SEL_THREADS)
qsa_select(const float* __restrict__ scores,  // [N, stride] block scores
           const int* __restrict__ lengths,   // [N] the query sits at position lengths[n] - 1
           int* __restrict__ sel,             // [N, top] ascending selected blocks
           int stride, int n_cols, int ratio, int top) {
    grid_sync();
    select_row(scores, lengths, sel, stride, n_cols, ratio, top, blockIdx.x, 1, 0u);
}

// qsa_select's arguments; launched in clusters of SEL_CLUSTER CTAs along x, one a row
extern "C" __global__ void __launch_bounds__(SEL_THREADS)
qsa_select_c(const float* __restrict__ scores, const int* __restrict__ lengths,
             int* __restrict__ sel, int stride, int n_cols, int ratio, int top) {
    grid_sync();
    select_row(scores, lengths, sel, stride, n_cols, ratio, top, blockIdx.x / SEL_CLUSTER,
               SEL_CLUSTER, cluster_rank());
}

// qsa_head_sum, grid (ceil(stride / 4 / 256), N), 256 threads: the QSA prompt scores from the
// indexer heads' products (ops/qsa_cuda.py: one cuBLAS matmul per group of queries gives
// prod[n, h, c] = iq[n, h] . block[c]):
//   scores[n, c] = (relu(prod[n, 0, c]) + relu(prod[n, 1, c]) + ...) / norm, heads in order,
// rounded once per add and once for the division (as attention_util.cu's qsa_scores; -0 -> +0,
// so blocks no head scores above zero tie at +0 for qsa_select). Rows are `stride` floats apart
// in both (stride % 4 == 0, 16-byte aligned): one float4 per thread.
extern "C" __global__ void __launch_bounds__(256)
qsa_head_sum(const float4* __restrict__ prod,  // [N, n_hi, stride / 4]
             float4* __restrict__ scores,      // [N, stride / 4]
             int stride4, int n_hi, float norm) {
    grid_sync();
    const int n = blockIdx.y, c = blockIdx.x * 256 + threadIdx.x;
    if (c >= stride4) return;
    const float4* p = prod + (size_t)n * n_hi * stride4 + c;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int h = 0; h < n_hi; ++h) {
        const float4 v = p[(size_t)h * stride4];
        acc.x = __fadd_rn(acc.x, fmaxf(v.x, 0.f));
        acc.y = __fadd_rn(acc.y, fmaxf(v.y, 0.f));
        acc.z = __fadd_rn(acc.z, fmaxf(v.z, 0.f));
        acc.w = __fadd_rn(acc.w, fmaxf(v.w, 0.f));
    }
    scores[(size_t)n * stride4 + c] = make_float4(
        __fadd_rn(__fdiv_rn(acc.x, norm), 0.f), __fadd_rn(__fdiv_rn(acc.y, norm), 0.f),
        __fadd_rn(__fdiv_rn(acc.z, norm), 0.f), __fadd_rn(__fdiv_rn(acc.w, norm), 0.f));
}

// qsa_visibility, grid (T), 256 threads, (n_cols + 31) / 32 words of dynamic shared memory: the
// positions each QSA prompt query attends to, as bits for attn_prefill (ops/attention_prefill.py:
// ``visibility`` is the torch version, the same bits). Query i sits at position last = start + i;
// complete = (last + 1) / ratio blocks are complete; a sparse query (complete > top) sees its
// selected blocks' positions and the tail from complete * ratio, a dense one every position; no
// query sees past itself. Bit p % 32 of word p / 32 of row i; `words` words a row.
extern "C" __global__ void __launch_bounds__(256)
qsa_visibility(const int* __restrict__ sel,  // [T, top] selected blocks (-1: none)
               int* __restrict__ out,        // [T, words]
               int start, int ratio, int top, int words, int n_cols) {
    grid_sync();
    extern __shared__ unsigned s_picked[];  // bit b: block b selected
    const int i = blockIdx.x, tid = threadIdx.x;
    const int n_bw = (n_cols + 31) / 32;
    for (int w = tid; w < n_bw; w += 256) s_picked[w] = 0u;
    __syncthreads();
    const int* row = sel + (size_t)i * top;
    for (int j = tid; j < top; j += 256) {
        const int b = row[j];
        if (b >= 0 && b < n_cols) atomicOr(&s_picked[b >> 5], 1u << (b & 31));
    }
    __syncthreads();
    const long long last = (long long)start + i;
    const long long complete = (last + 1) / ratio;
    const bool sparse = complete > top;
    const long long tail = complete * ratio;
    for (int w = tid; w < words; w += 256) {
        unsigned bits = 0u;
        for (int b = 0; b < 32; ++b) {
            const long long p = (long long)w * 32 + b;
            const long long blk = p / ratio;
            const bool picked = blk < n_cols && ((s_picked[blk >> 5] >> (blk & 31)) & 1u);
            const bool vis = p <= last && (!sparse || p >= tail || picked);
            bits |= (unsigned)vis << b;
        }
        out[(size_t)i * words + w] = (int)bits;
    }
}
