"""The deltanet family's prefill on ``kernels/deltanet_chunked.cu``: one session's prompt in three
launches per piece of at most PREFILL_PIECE tokens (the conv and ssm states carry the prompt from
piece to piece, in place):

- ``conv_prefill_f32``: causal conv + silu, q / k L2 norms (q scaled by d^-0.5), the slot's conv
  state; y [T, C] in the qkv layout, key heads not repeated.
- ``delta_prep_f32``, one CTA per (chunk, key head), all chunks at once: K K^T and Q K^T, then
  for each value head the float64 cumulative decays, M = (I + A)^-1 diag(beta) by forward
  substitution and the decayed causal Q K^T; stored (32 KB per value head and chunk).
- ``delta_scan_f32``, one CTA per (value head, SCAN_COLS state columns): the chunks in order, its
  columns of the state on chip, fp32 throughout (the kernel file has the algebra and thread
  mappings). 16 columns a CTA instead of 32 give the same bits on twice the CTAs, three an SM.
  Or ``delta_scan_tc`` (``kernels/deltanet_scan_tc.cu``, ``tensor_cores``): the same grid and
  products on TF32 tensor cores in the 3xTF32 form (fp32 accuracy, not delta_scan_f32's bits).

Why the solve is computed once and stored rather than recomputed per state slice (qwen4exp:
C = 64, d = 128, 4 slices per head): K K^T and Q K^T are 2 C^2 d = 1.05 M FMA per key head and
chunk, the inverse ~0.13 M, against 0.85 M FMA of the scan per slice and chunk. Recomputed in
each slice they would more than double the work of the scan, which runs the chunks in order and is
the long pole, and need another 64 KB of shared memory per CTA (one CTA per SM instead of two);
stored, they cost ~100 MB per 4096-token piece, written once and read by the 4 slices of a head
at about the same time (from L2, mostly).

The chunk is always CHUNK (64) tokens, the reference model's: the family's ``chunk`` argument
steers only the torch version (results do not depend on it beyond rounding).
"""

from __future__ import annotations

import numpy as np
import torch

from mgserve.cuda.launch import Kernels

PREFILL_SOURCE = "deltanet_chunked.cu"
SCAN_TC_SOURCE = "deltanet_scan_tc.cu"
PREFILL_HEAD_DIM = 128  # the one head dim deltanet_chunked.cu is written for (qwen3next, qwen4exp)
CHUNK = 64  # CHUNK in deltanet_chunked.cu
CONV_TOKENS = 16  # CONV_TOKENS: tokens per CTA of conv_prefill_f32
PREP_THREADS = 256  # PREP_THREADS
PREP_HEADS = PREP_THREADS // CHUNK  # PREP_HEADS: value heads solved at once
SCAN_THREADS = 256  # SCAN_THREADS
SCAN_COLS = 32  # SCAN_COLS: state columns per CTA of delta_scan_f32 (the default)
SCAN_WIDTHS = (32, 16)  # the widths the kernel's thread mapping is written for
TC_COLS = 32  # TC_COLS: state columns per CTA of delta_scan_tc
TC_THREADS = 256  # TC_THREADS
CHUNK_FLOATS = 2 * CHUNK * CHUNK + 2 * CHUNK  # prep per (value head, chunk): M, Aqk, 2 decays
PREFILL_PIECE = 4096  # tokens per launch triple at most: bounds the scratch y and prep


def check_piece(piece: int) -> int:
    """``piece`` (tokens per launch triple) if it is a whole number of CHUNKs up to
    PREFILL_PIECE, else ValueError: pieces keep the chunks where they are (the state goes through
    memory unrounded between them), so any such piece gives the same bits; a shorter one keeps
    each scan's CTAs on their SMs for less time (decoders beside a prompt wait less for them)."""
    if not isinstance(piece, int) or piece % CHUNK or not CHUNK <= piece <= PREFILL_PIECE:
        raise ValueError(
            f"deltanet prefill piece {piece!r}: a multiple of {CHUNK} in {CHUNK}..{PREFILL_PIECE}"
        )
    return piece


def check_scan_cols(cols: int) -> int:
    """``cols`` (state columns per delta_scan_f32 CTA) if the kernel has that width, else
    ValueError: every width gives the same bits, only the CTAs an SM and the loads differ."""
    if cols not in SCAN_WIDTHS:
        raise ValueError(f"deltanet scan columns {cols!r}: one of {SCAN_WIDTHS}")
    return cols


def prefill_smem(head_dim: int, cols: int = SCAN_COLS) -> tuple[int, int]:
    """Dynamic shared memory of (delta_prep_f32, delta_scan_f32) in bytes: PREP_SMEM_BYTES and
    SCAN_SMEM_BYTES of deltanet_chunked.cu (which static_asserts that they agree)."""
    kpad, cpad = head_dim + 4, CHUNK + 4
    kq = max(2 * CHUNK * kpad, PREP_HEADS * CHUNK * cpad)  # k, q rows; later the systems A
    prep = (kq + 2 * CHUNK * cpad) * 4 + PREP_HEADS * CHUNK * (8 + 4 + 4)  # kk, qk; cum, beta, g
    # k or q rows, M or Aqk, the state's columns, V - exp(G) K S and V', exp(G) and exp(G_last - G)
    scan = CHUNK * kpad + CHUNK * cpad + head_dim * cols + 2 * CHUNK * cols + 2 * CHUNK
    return prep, scan * 4


def prefill_defines(
    head_dim: int, conv_k: int, cols: int = SCAN_COLS
) -> tuple[tuple[str, str], ...]:
    prep, scan = prefill_smem(head_dim, cols)
    out = (
        ("HEAD_DIM", str(head_dim)),
        ("CONV_K", str(conv_k)),
        ("PREP_SMEM", str(prep)),
        ("SCAN_SMEM", str(scan)),
    )
    return out if cols == SCAN_COLS else (*out, ("SCAN_COLS", str(check_scan_cols(cols))))


def scan_tc_defines(head_dim: int) -> tuple[tuple[str, str], ...]:
    """delta_scan_tc's -D values: its dynamic shared memory, TC_SMEM_BYTES of deltanet_scan_tc.cu
    (k or q rows, M or Aqk, the state's columns and R or V' as TF32 hi / lo planes of row stride
    TC_COLS + 8, exp(G) and exp(G_last - G)), which the kernel static_asserts."""
    spad = TC_COLS + 8
    floats = CHUNK * (head_dim + 4) + CHUNK * (CHUNK + 4) + 2 * (head_dim + CHUNK) * spad
    return (("HEAD_DIM", str(head_dim)), ("TC_SMEM", str((floats + 2 * CHUNK) * 4)))


def run_prefill(
    kernels: Kernels,
    qkv: torch.Tensor,  # [T, C] raw projections, contiguous
    g: torch.Tensor,  # [T, H_v] contiguous
    beta: torch.Tensor,  # [T, H_v] contiguous
    conv: torch.Tensor,  # [n_slots, K - 1, C] (conv[slot] updated)
    ssm: torch.Tensor,  # [n_slots, H_v, d, d] 16-byte aligned (ssm[slot] updated)
    slot: int,
    weight: torch.Tensor,  # [C, K] contiguous
    *,
    n_k_heads: int,
    n_v_heads: int,
    eps: float,
    piece: int = PREFILL_PIECE,
    scan_cols: int = SCAN_COLS,
    tensor_cores: bool = False,
) -> torch.Tensor:  # o [T, H_v, d]
    """The kernels on checked arguments (``DeltaNetCuda.prefill`` checks them), ``piece`` tokens
    (``check_piece``) at a time, ``scan_cols`` state columns a scan CTA (``check_scan_cols``), or
    with ``tensor_cores`` delta_scan_tc (TC_COLS columns a CTA)."""
    step = check_piece(piece)
    t, c = qkv.shape
    d = PREFILL_HEAD_DIM
    base = prefill_defines(d, weight.shape[1])
    defines = prefill_defines(d, weight.shape[1], scan_cols)
    prep_smem, scan_smem = prefill_smem(d, scan_cols)
    conv_k = kernels.kernel(PREFILL_SOURCE, "conv_prefill_f32", base)
    prep_k = kernels.kernel(PREFILL_SOURCE, "delta_prep_f32", base, smem=prep_smem)
    scan_threads = SCAN_THREADS
    if tensor_cores:
        scan_cols, scan_threads, tc = TC_COLS, TC_THREADS, scan_tc_defines(d)
        scan_smem = int(dict(tc)["TC_SMEM"])
        scan_k = kernels.kernel(SCAN_TC_SOURCE, "delta_scan_tc", tc, smem=scan_smem)
    else:
        scan_k = kernels.kernel(PREFILL_SOURCE, "delta_scan_f32", defines, smem=scan_smem)
    hk, hv = np.int32(n_k_heads), np.int32(n_v_heads)
    o = torch.empty((t, n_v_heads, d), dtype=torch.float32, device=qkv.device)
    rows = min(t, step)
    y = torch.empty((rows, c), dtype=torch.float32, device=qkv.device)  # [T', C] conv output
    prep = torch.empty(  # [H_v, chunks, CHUNK_FLOATS] each chunk's M, Aqk and decays
        (n_v_heads, -(-rows // CHUNK), CHUNK_FLOATS), dtype=torch.float32, device=qkv.device
    )
    for t0 in range(0, t, step):
        n = min(step, t - t0)
        n_chunks = -(-n // CHUNK)
        kernels.launch(
            conv_k,
            (-(-n // CONV_TOKENS), 2 * n_k_heads + n_v_heads),
            d,
            qkv[t0].data_ptr(),
            conv.data_ptr(),
            weight.data_ptr(),
            y.data_ptr(),
            np.int32(n),
            hk,
            hv,
            np.int32(slot),
            np.float32(eps),
            np.float32(d**-0.5),
        )
        kernels.launch(
            prep_k,
            (n_chunks, n_k_heads),
            PREP_THREADS,
            y.data_ptr(),
            g[t0].data_ptr(),
            beta[t0].data_ptr(),
            prep.data_ptr(),
            np.int32(n),
            hk,
            hv,
            shmem=prep_smem,
        )
        kernels.launch(
            scan_k,
            (d // scan_cols, n_v_heads),
            scan_threads,
            y.data_ptr(),
            prep.data_ptr(),
            ssm.data_ptr(),
            o[t0].data_ptr(),
            np.int32(n),
            hk,
            hv,
            np.int32(slot),
            shmem=scan_smem,
        )
    return o
