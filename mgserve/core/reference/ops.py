"""The reference ops in plain PyTorch, float32 on CPU: the oracle for the CUDA kernels.

Conventions follow llama.cpp's ggml graph for the supported architectures, so the reference and
llama.cpp agree on the same GGUF file (Gemma's "1 + w" norm weights are already folded in by the
converter, so one ``rms_norm`` serves every architecture).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mgserve.core.gguf.hparams import ModelSpec
from mgserve.core.reference import rowwise

_QUERY_CHUNK = 512  # bounds the [H, T, S] score matrix of a long prompt chunk
_ROW_BLOCKS = (2, 4, 8)  # block sizes tried for a product's shape, the cheapest first (linear)
_row_block: dict[tuple[int, int, torch.dtype], int] = {}  # (in, out, dtype) -> the block in use


def _block_for(w: torch.Tensor) -> int:
    """The smallest block size whose rows BLAS computes alike wherever they sit in the block, for
    products with ``w``'s shape on this CPU (probed once per shape: which kernel a BLAS takes for
    M rows, and whether its tail rows round like the others, differs by CPU: on an AMD EPYC with
    MKL's AVX2 path 2-row blocks are not position-independent, 4-row ones are)."""
    key = (w.shape[1], w.shape[0], w.dtype)
    if key not in _row_block:
        g = torch.Generator().manual_seed(0)
        probe = torch.randn(8, w.shape[1], generator=g, dtype=w.dtype)
        _row_block[key] = _ROW_BLOCKS[-1]
        for r in _ROW_BLOCKS:
            blk = probe[:r] @ w.T
            alone = [(F.pad(probe[i : i + 1], (0, 0, 0, r - 1)) @ w.T)[0] for i in range(r)]
            if all(torch.equal(blk[i], a) for i, a in enumerate(alone)):
                _row_block[key] = r
                break
    return _row_block[key]


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ b) for x [N, in], w [out, in], such that no row's result depends on other rows.

    BLAS picks its kernel, and so its rounding, by the number of rows: the same token gives
    slightly different numbers alone (1 row) than beside three other sessions (4 rows), enough to
    change a greedy continuation. Running every product on blocks of exactly R rows (the last one
    zero-padded), R chosen per shape so that a row rounds the same in every place of a block
    (``_block_for``), makes each row's result a function of that row alone, so concurrency never
    changes a session's results (DESIGN.md). Two rows per block where that holds (measured on the
    2-core CI machine with Gemma 3 270M): one decode step costs about what a lone matrix-vector
    product does, four sessions' logits cost half of four separate products, and a 500-token
    prefill stays within ~1.5x of one big product since each block re-reads a cache-resident matrix.
    """
    if w.shape[0] == 1:  # BLAS turns [N, in] @ [in, 1] into a matrix-vector product over the
        y = (x * w[0]).sum(dim=-1, keepdim=True)  # rows, which mixes them: reduce each row alone
        return y if b is None else y + b
    n, r = x.shape[0], _block_for(w)
    pad = (-n) % r
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    y = torch.cat([blk @ w.T for blk in x.split(r)])[:n]  # [N, out]
    return y if b is None else y + b


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


# rms_norm's signature: the functions that the device backend also runs with its own norm kernel
# (the hyper-connection mix, the PLE gate) take the norm as an argument of this type
NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


_ROPE_BLOCK = 4096  # positions per block of the cached cos/sin tables


def rope_inv_freq(n_rot: int, base: float) -> torch.Tensor:
    """float64 [n_rot / 2] rotary frequencies base^(-2i / n_rot)."""
    return float(base) ** (-torch.arange(n_rot // 2, dtype=torch.float64) * 2.0 / n_rot)


def rope_angles(
    pos: torch.Tensor, inv_freq: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:  # cos, sin [N, half] float32
    """cos and sin of the angles (pos * scale) * inv_freq, computed in float64 and rounded once
    (pos [N] of any dtype, inv_freq [half] float64 on pos's device)."""
    theta = (pos.to(torch.float64) * float(scale))[:, None] * inv_freq[None, :]  # [N, half]
    return theta.cos().float(), theta.sin().float()


def rope_rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_rot: int, neox: bool
) -> torch.Tensor:
    """Rotate the first ``n_rot`` dims of each head of x [N, H, D] by the angles of cos / sin
    [N, n_rot / 2]: neox pairs dim i with i + n_rot/2 (Hugging Face's rotate_half), otherwise
    ("norm") dims 2i and 2i + 1 pair. Dims >= n_rot pass through."""
    half = n_rot // 2
    cos, sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]  # [N, 1, half]
    rot, rest = x[..., :n_rot], x[..., n_rot:]
    if neox:
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1)


class _RopeTable:
    """cos/sin of the rotary angles of every position, computed once per block of positions.

    Decode would otherwise recompute the same angles in every layer. Each block is computed from
    the same ``arange`` whenever it is first needed, so a position's values never depend on which
    other positions share a batch (vector body or scalar tail of a transcendental kernel).
    """

    def __init__(self, inv_freq: torch.Tensor, scale: float) -> None:
        self.inv_freq = inv_freq  # [half] float64
        self.scale = scale
        self.cos = torch.empty(0, inv_freq.numel())  # [n_pos, half] float32
        self.sin = torch.empty(0, inv_freq.numel())

    def lookup(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(pos.max()) + 1 if pos.numel() else 0
        while self.cos.shape[0] < need:
            p0 = self.cos.shape[0]
            p = torch.arange(p0, p0 + _ROPE_BLOCK, dtype=torch.float64)
            cos, sin = rope_angles(p, self.inv_freq, self.scale)  # [block, half]
            self.cos = torch.cat((self.cos, cos))
            self.sin = torch.cat((self.sin, sin))
        return self.cos[pos], self.sin[pos]  # [N, half] each


@functools.lru_cache(maxsize=16)
def _rope_table(n_rot: int, base: float, scale: float) -> _RopeTable:
    return _RopeTable(rope_inv_freq(n_rot, base), scale)


def rope(
    x: torch.Tensor,  # [N, H, D]
    pos: torch.Tensor,  # [N] int64 absolute positions
    *,
    n_rot: int,
    base: float,
    neox: bool,
    scale: float = 1.0,
    freq_factors: torch.Tensor | None = None,  # [n_rot / 2] llama 3 style divisors, or None
) -> torch.Tensor:
    """Rotary embedding of the first ``n_rot`` dims of each head (``rope_rotate``), with the
    angles of a table cached per (n_rot, base, scale), computed in float64 and rounded once, to
    stay close to both references."""
    if freq_factors is None:
        cos, sin = _rope_table(n_rot, float(base), float(scale)).lookup(pos)
    else:
        inv_freq = rope_inv_freq(n_rot, base) / freq_factors.to(torch.float64)
        cos, sin = _RopeTable(inv_freq, scale).lookup(pos)
    return rope_rotate(x, cos, sin, n_rot, neox)


def model_rope(
    x: torch.Tensor,  # [N, H, D]
    pos: torch.Tensor,  # [N] int64 absolute positions
    spec: ModelSpec,
    *,
    swa: bool = False,  # a sliding-window layer (its own base)
    freq_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """``rope`` as ``spec``'s architecture applies it: its rotated dims, base, pairs and scale."""
    base = spec.rope_base_swa if swa else spec.rope_base
    return rope(
        x,
        pos,
        n_rot=spec.n_rot,
        base=base,
        neox=spec.rope_neox,
        scale=spec.rope_scale,
        freq_factors=freq_factors,
    )


def attention(
    q: torch.Tensor,  # [T, H, D] queries, already scaled or not (see ``scale``)
    k: torch.Tensor,  # [S, Hkv, D] keys for positions 0..S-1
    v: torch.Tensor,  # [S, Hkv, D]
    q_pos: torch.Tensor,  # [T] int64 positions of the queries
    *,
    scale: float,
    window: int = 0,  # > 0: query at p sees keys at p - window + 1 .. p
    softcap: float = 0.0,
) -> torch.Tensor:  # [T, H * D]
    """Causal (optionally sliding-window) multi-head attention with grouped KV heads.

    Batched over a chunk's queries: fast, but on CPUs whose BLAS rounds a row of a batched
    product by its place in the batch (MKL's AVX2 path on AMD EPYC) a query's bits depend on the
    chunk it is in; tests of bitwise equality across chunkings check ``chunk_invariant()``."""
    n_head, n_kv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(n_head // n_kv, dim=1)  # [S, H, D]: query head h reads KV head h // g
    v = v.repeat_interleave(n_head // n_kv, dim=1)
    k_pos = torch.arange(k.shape[0])  # [S]
    outs = []
    for c in range(0, q.shape[0], _QUERY_CHUNK):
        qc, pc = q[c : c + _QUERY_CHUNK], q_pos[c : c + _QUERY_CHUNK]
        scores = torch.einsum("thd,shd->hts", qc, k) * scale  # [H, Tc, S]
        if softcap > 0.0:
            scores = torch.tanh(scores / softcap) * softcap
        visible = k_pos[None, :] <= pc[:, None]  # [Tc, S]
        if window > 0:
            visible &= pc[:, None] - k_pos[None, :] < window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        outs.append(torch.einsum("hts,shd->thd", probs, v))  # [Tc, H, D]
    return torch.cat(outs).flatten(1)


@functools.lru_cache(maxsize=1)
def chunk_invariant() -> bool:
    """Whether ``attention`` gives a query the same bits alone as beside others on this CPU."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 32, generator=g) for n, h in ((8, 4), (40, 2), (40, 2)))
    pos = torch.arange(32, 40)
    both = attention(q, k, v, pos, scale=0.2)
    alone = [attention(q[i : i + 1], k, v, pos[i : i + 1], scale=0.2) for i in range(8)]
    return torch.equal(both, torch.cat(alone))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: the llama / qwen MLP activation (inputs already projected); row by row
    (``rowwise``), so a token's result does not depend on the other tokens of the batch."""
    return rowwise.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up: the Gemma MLP activation (llama.cpp's ggml_gelu is the tanh form);
    row by row, as ``swiglu``."""
    return rowwise.rowwise(functools.partial(F.gelu, approximate="tanh"), gate) * up
