"""The torch attention ops (``AttentionTorch``) against the reference path on the CPU (runs in CI).

A ``World`` holds 3 slots of K/V pools written through ``kv_write`` (tokens of all sessions mixed
in each call, in shuffled order) and, per slot, a reference ``KVCache`` given the same K/V in one
``write``. Then every op must equal the reference on the dequantized cache:
- kv_write: the pool's bits equal the reference cache's (q8_0 rounding included), kv_read its read;
- attention_decode / attention_prefill: ``ops.attention`` (GQA 4:1 and 2:1, sliding window, soft
  cap, q8_0 and f16 pools, a zero-length padding row, prefill chunks starting mid-way);
- qsa_decode / qsa_prefill: ``qsa.select`` + ``qsa.attend_selected`` per query (sparse selections
  with and without a tail, dense queries, a prefill chunk starting mid-block whose queries cross
  from dense to sparse, a pool too short for any sparse query);
- select_blocks (the rule qsa_select.cu implements): a stable descending sort of each query's
  complete blocks, on random rows, ties (+0 / -0, few values), the best blocks at the tail.
"""

from __future__ import annotations

import math

import pytest
import torch

from mgserve.core.gguf.hparams import ModelSpec
from mgserve.core.models import kvcache
from mgserve.core.models.kvcache import KVCache
from mgserve.core.reference import ops, qsa
from mgserve.cuda.backend import torch_backend
from mgserve.cuda.ops import attention as attention_ops
from mgserve.cuda.ops import qsa as qsa_ops
from mgserve.cuda.ops.qsa import rank_keys, select_blocks
from mgserve.cuda.pools import KVLayer, kv_layer

N_SLOTS = 3
RTOL = 1e-5


def spec_for(n_kv: int, d: int) -> ModelSpec:
    return ModelSpec(
        arch="llama",
        name="t",
        n_layer=1,
        n_embd=64,
        n_ff=64,
        n_head=n_kv,
        n_head_kv=n_kv,
        head_dim=d,
        n_vocab=10,
        n_ctx_train=1024,
        rms_eps=1e-5,
        rope_base=1e4,
        rope_base_swa=1e4,
    )


class World:
    """Pools of ``N_SLOTS`` slots with ``lengths[s]`` positions written, and reference caches."""

    def __init__(
        self, cache_type: str, n_ctx: int, n_kv: int, d: int, lengths: list[int], seed: int = 0
    ) -> None:
        self.ops = torch_backend()
        self.n_ctx, self.n_kv, self.d, self.lengths = n_ctx, n_kv, d, lengths
        cpu = torch.device("cpu")
        self.k = kv_layer(cache_type, N_SLOTS, n_ctx, n_kv, d, cpu)
        self.v = kv_layer(cache_type, N_SLOTS, n_ctx, n_kv, d, cpu)
        self.ref = [KVCache(spec_for(n_kv, d), n_ctx, cache_type, cache_type) for _ in lengths]
        g = torch.Generator().manual_seed(seed)
        ks = [torch.randn(n, n_kv, d, generator=g) * 2 for n in lengths]
        vs = [torch.randn(n, n_kv, d, generator=g) for n in lengths]
        for s, n in enumerate(lengths):
            if n:
                ks[s][0, 0, :32] = 0.0  # an all-zero q8_0 block
                self.ref[s].write(0, 0, ks[s], vs[s])
        pairs = [(s, p) for s, n in enumerate(lengths) for p in range(n)]
        order = torch.randperm(len(pairs), generator=g).tolist()
        for c in range(0, len(order), 7):  # batches of 7 tokens from mixed sessions
            batch = [pairs[i] for i in order[c : c + 7]]
            slots = torch.tensor([s for s, _ in batch], dtype=torch.int32)
            pos = torch.tensor([p for _, p in batch], dtype=torch.int32)
            self.ops.kv.write(self.k, torch.stack([ks[s][p] for s, p in batch]), slots, pos)
            self.ops.kv.write(self.v, torch.stack([vs[s][p] for s, p in batch]), slots, pos)

    def keys(self, slot: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ref[slot].read(0, end)


def close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> None:
    assert got.shape == want.shape, f"{name}: shape {list(got.shape)} != {list(want.shape)}"
    scale = want.abs().max().item() if want.numel() else 0.0
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert err <= rtol * max(scale, 1e-6), f"{name}: max error {err:.3e} vs max |ref| {scale:.3e}"


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---- kv_write / kv_read -------------------------------------------------------------------------


def test_kv_write_quantizes_with_the_reference_quantizer() -> None:
    """q8_0 pools hold exactly what ``kvcache.quantize_q8_0`` makes (one quantizer for both)."""
    x = rand(64, 4, 128, seed=1) * torch.logspace(-3, 3, 64)[:, None, None]
    x[0, 0, :32] = 0.0
    x[1, 0, :32] = torch.arange(32) * 0.5  # many exact halves after scaling
    pool = kv_layer("q8_0", 1, 64, 4, 128, torch.device("cpu"))
    pos = torch.arange(64, dtype=torch.int32)
    torch_backend().kv.write(pool, x, torch.zeros(64, dtype=torch.int32), pos)
    rq, rd = kvcache.quantize_q8_0(x)
    assert torch.equal(pool.values[0], rq)
    assert torch.equal(pool.scales[0].view(torch.int16), rd.view(torch.int16))


@pytest.mark.parametrize("cache_type", ["q8_0", "f16", "f32", "bf16"])
def test_kv_write_matches_reference_cache(cache_type: str) -> None:
    w = World(cache_type, 40, 2, 64, [13, 0, 40], seed=2)
    for s, n in enumerate(w.lengths):
        ref = w.ref[s]
        assert torch.equal(w.k.values[s, :n], ref.k.values[0, :n]), f"slot {s} K values"
        assert torch.equal(w.v.values[s, :n], ref.v.values[0, :n]), f"slot {s} V values"
        if cache_type == "q8_0":
            assert torch.equal(w.k.scales[s, :n], ref.k.scales[0, :n]), f"slot {s} K scales"
        assert not w.k.values[s, n:].float().abs().any(), f"slot {s}: unwritten rows touched"
        if n == 0:  # (the reference cache cannot read 0 rows of q8_0)
            assert w.ops.kv.read(w.k, s, 0).shape == (0, w.n_kv, w.d)
            continue
        rk, rv = w.keys(s, n)
        assert torch.equal(w.ops.kv.read(w.k, s, n), rk)
        assert torch.equal(w.ops.kv.read(w.v, s, n), rv)


def test_checks_reject_bad_shapes() -> None:
    w = World("q8_0", 16, 2, 32, [4, 4, 4])
    with pytest.raises(ValueError, match="x has shape"):
        w.ops.kv.write(
            w.k,
            torch.zeros(2, 3, 32),
            torch.zeros(2, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="slots"):
        w.ops.kv.write(
            w.k,
            torch.zeros(2, 2, 32),
            torch.zeros(3, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32),
        )
    with pytest.raises(ValueError, match="not a multiple"):
        w.ops.attention.decode(
            torch.zeros(1, 3, 32),
            w.k,
            w.v,
            torch.zeros(1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32),
            scale=1.0,
        )
    with pytest.raises(ValueError, match="do not fit"):
        w.ops.attention.prefill(torch.zeros(4, 4, 32), w.k, w.v, 0, 14, scale=1.0)
    bad = KVLayer(w.k.values, w.k.scales[..., :0])
    with pytest.raises(ValueError, match="scales"):
        w.ops.kv.read(bad, 0, 4)


# ---- dense attention --------------------------------------------------------------------------

DECODE_CASES = [  # cache type, n_kv, n_head, head dim, window, softcap
    ("q8_0", 2, 8, 64, 0, 0.0),  # GQA 4:1
    ("f16", 2, 4, 64, 0, 0.0),  # GQA 2:1
    ("q8_0", 1, 4, 32, 7, 0.0),  # sliding window (Gemma-like: one KV head)
    ("f16", 2, 8, 32, 0, 30.0),  # soft cap
    ("q8_0", 2, 4, 64, 50, 20.0),  # both
]


@pytest.mark.parametrize(("cache_type", "n_kv", "n_head", "d", "window", "softcap"), DECODE_CASES)
def test_attention_decode_matches_reference(
    cache_type: str, n_kv: int, n_head: int, d: int, window: int, softcap: float
) -> None:
    n_ctx = 150
    w = World(cache_type, n_ctx, n_kv, d, [97, 150, 3], seed=3)
    rows = [(2, 3), (0, 97), (1, 150), (0, 1), (1, 0), (1, 64)]  # (slot, length); 0: padding
    q = rand(len(rows), n_head, d, seed=4)
    slots = torch.tensor([s for s, _ in rows], dtype=torch.int32)
    lengths = torch.tensor([n for _, n in rows], dtype=torch.int32)
    scale = 1 / math.sqrt(d)
    kw = {"scale": scale, "window": window, "softcap": softcap}
    got = w.ops.attention.decode(q, w.k, w.v, slots, lengths, **kw)
    assert got.shape == (len(rows), n_head * d)
    for i, (s, n) in enumerate(rows):
        if n == 0:
            assert not got[i].any(), "a zero-length row must give zeros"
            continue
        keys, values = w.keys(s, n)
        want = ops.attention(q[i : i + 1], keys, values, torch.tensor([n - 1]), **kw)[0]
        close(f"row {i} (slot {s}, length {n})", got[i], want)


PREFILL_CASES = [  # cache type, n_kv, n_head, start, T, window, softcap
    ("q8_0", 2, 8, 0, 60, 0, 0.0),
    ("f16", 2, 4, 37, 45, 0, 0.0),
    ("q8_0", 1, 4, 70, 30, 16, 0.0),
    ("f16", 2, 8, 5, 40, 0, 25.0),
]


@pytest.mark.parametrize(
    ("cache_type", "n_kv", "n_head", "start", "t", "window", "softcap"), PREFILL_CASES
)
def test_attention_prefill_matches_reference(
    cache_type: str,
    n_kv: int,
    n_head: int,
    start: int,
    t: int,
    window: int,
    softcap: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d, end = 64, start + t
    w = World(cache_type, 120, n_kv, d, [end, 120, 11], seed=5)
    q = rand(t, n_head, d, seed=6)
    kw = {"scale": 0.125, "window": window, "softcap": softcap}
    keys, values = w.keys(0, end)
    want = ops.attention(q, keys, values, torch.arange(start, end), **kw)
    close("prefill", w.ops.attention.prefill(q, w.k, w.v, 0, start, **kw), want)
    monkeypatch.setattr(attention_ops, "_SCORE_ELEMS", 7 * n_head * end)  # force query chunks
    close("prefill in chunks", w.ops.attention.prefill(q, w.k, w.v, 0, start, **kw), want)


def test_prefill_rows_equal_decode() -> None:
    """A prefill chunk's query j equals a decode step of the same session at that position."""
    w = World("q8_0", 64, 2, 32, [64, 1, 1], seed=7)
    q = rand(20, 4, 32, seed=8)
    pre = w.ops.attention.prefill(q, w.k, w.v, 0, 30, scale=0.2, window=9)
    dec = w.ops.attention.decode(
        q,
        w.k,
        w.v,
        torch.zeros(20, dtype=torch.int32),
        torch.arange(31, 51, dtype=torch.int32),
        scale=0.2,
        window=9,
    )
    close("prefill vs decode", pre, dec)


# ---- QSA --------------------------------------------------------------------------------------

RATIO, BUDGET, HI, DI = 4, 32, 4, 32  # top = 8 blocks
TOP = BUDGET // RATIO


def qsa_world(
    cache_type: str, n_ctx: int, lengths: list[int], seed: int
) -> tuple[World, torch.Tensor]:
    w = World(cache_type, n_ctx, 2, 64, lengths, seed=seed)
    blocks = rand(N_SLOTS, n_ctx // RATIO, DI, seed=seed + 100)
    return w, blocks


def qsa_reference(
    w: World,
    blocks: torch.Tensor,
    slot: int,
    p: int,
    q: torch.Tensor,
    iq: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    keys, values = w.keys(slot, p + 1)
    sel = qsa.select(iq, p, blocks[slot], RATIO, BUDGET)
    return qsa.attend_selected(q, keys[sel], values[sel], scale)


@pytest.mark.parametrize("cache_type", ["q8_0", "f16"])
def test_qsa_decode_matches_reference(cache_type: str) -> None:
    n_ctx = 200
    w, blocks = qsa_world(cache_type, n_ctx, [83, 100, 200], seed=9)
    # (slot, length): sparse with a 3-cell tail, sparse with an empty tail, dense (7 and 8
    # complete blocks <= top), the whole pool, one token, a padding row
    rows = [(0, 83), (1, 100), (2, 30), (2, 35), (2, 200), (1, 1), (0, 0)]
    b = len(rows)
    q, iq = rand(b, 8, 64, seed=10), rand(b, HI, DI, seed=11)
    slots = torch.tensor([s for s, _ in rows], dtype=torch.int32)
    lengths = torch.tensor([n for _, n in rows], dtype=torch.int32)
    got = w.ops.qsa.decode(
        q, iq, w.k, w.v, blocks, slots, lengths, ratio=RATIO, budget=BUDGET, scale=0.125
    )
    for i, (s, n) in enumerate(rows):
        if n == 0:
            assert not got[i].any(), "a zero-length row must give zeros"
            continue
        close(
            f"row {i} (slot {s}, length {n})",
            got[i],
            qsa_reference(w, blocks, s, n - 1, q[i], iq[i], 0.125),
        )


@pytest.mark.parametrize(
    ("cache_type", "start", "t"), [("q8_0", 18, 40), ("f16", 54, 33), ("q8_0", 0, 70)]
)
def test_qsa_prefill_matches_reference(
    cache_type: str, start: int, t: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks starting mid-block whose queries cross from dense (<= 8 complete blocks) to sparse;
    each query sees only the blocks complete at its own position."""
    w, blocks = qsa_world(cache_type, 160, [start + t, 5, 160], seed=12)
    q, iq = rand(t, 8, 64, seed=13), rand(t, HI, DI, seed=14)
    want = torch.stack([qsa_reference(w, blocks, 0, start + j, q[j], iq[j], 0.1) for j in range(t)])
    kw = {"ratio": RATIO, "budget": BUDGET, "scale": 0.1}
    close("qsa prefill", w.ops.qsa.prefill(q, iq, w.k, w.v, blocks, 0, start, **kw), want)
    monkeypatch.setattr(qsa_ops, "_GATHER_ELEMS", 1)  # one query per group
    close(
        "qsa prefill, one query per group",
        w.ops.qsa.prefill(q, iq, w.k, w.v, blocks, 0, start, **kw),
        want,
    )


def select_lower_first(iq: torch.Tensor, p: int, blocks: torch.Tensor) -> torch.Tensor:
    """qsa.select with ties between equal scores broken toward the lower block (a stable sort),
    the rule QsaTorch / QsaCuda implement (ops/qsa.rank_keys)."""
    complete = (p + 1) // RATIO
    if complete <= TOP:
        return torch.arange(p + 1)
    scores = torch.relu((iq @ blocks[:complete].T).T).sum(dim=-1) / math.sqrt(iq.shape[-1])
    chosen = torch.sort(scores, descending=True, stable=True).indices[:TOP].sort().values
    cells = (chosen[:, None] * RATIO + torch.arange(RATIO)).flatten()
    return torch.cat((cells, torch.arange(complete * RATIO, p + 1)))


def test_qsa_ties_prefer_lower_blocks() -> None:
    """relu makes a block score exactly 0 whenever all indexer heads score it negative, so ties
    at the top-k boundary are common (tiny models hit them at once): the lower block wins."""
    w, _ = qsa_world("q8_0", 200, [83, 100, 200], seed=18)
    g = torch.Generator().manual_seed(19)
    u = torch.randn(DI, generator=g)
    u = u / u.norm()
    n_blk = 200 // RATIO
    c = torch.rand(N_SLOTS, n_blk, generator=g) + 0.5
    sign = torch.where(torch.arange(n_blk) % 4 == 0, 1.0, -1.0)  # 3 of 4 blocks score 0
    blocks = c[..., None] * sign[:, None] * u
    rows = [(0, 83), (1, 100), (2, 199), (2, 46)]
    q = rand(len(rows), 8, 64, seed=20)
    iq = u + 0.05 * torch.randn(len(rows), HI, DI, generator=g)
    slots = torch.tensor([s for s, _ in rows], dtype=torch.int32)
    lengths = torch.tensor([n for _, n in rows], dtype=torch.int32)
    kw = {"ratio": RATIO, "budget": BUDGET, "scale": 0.125}
    got = w.ops.qsa.decode(q, iq, w.k, w.v, blocks, slots, lengths, **kw)
    for i, (s, n) in enumerate(rows):
        keys, values = w.keys(s, n)
        sel = select_lower_first(iq[i], n - 1, blocks[s])
        want = qsa.attend_selected(q[i], keys[sel], values[sel], 0.125)
        close(f"ties, row {i} (length {n})", got[i], want)
    t, start = 30, 50  # prefill: queries from 12 to 20 complete blocks
    pre = w.ops.qsa.prefill(
        q[:1].expand(t, -1, -1).contiguous(),
        iq[:1].expand(t, -1, -1),
        w.k,
        w.v,
        blocks,
        0,
        start,
        **kw,
    )
    keys, values = w.keys(0, start + t)
    for j in range(t):
        sel = select_lower_first(iq[0], start + j, blocks[0])
        want = qsa.attend_selected(q[0], keys[sel], values[sel], 0.125)
        close(f"ties, prefill query {j}", pre[j], want)


def test_qsa_short_pool_is_dense() -> None:
    """A pool of n_ctx / ratio <= top blocks can never select: plain causal attention."""
    w, blocks = qsa_world("q8_0", 32, [32, 20, 1], seed=15)
    q, iq = rand(3, 8, 64, seed=16), rand(3, HI, DI, seed=17)
    slots = torch.tensor([0, 1, 2], dtype=torch.int32)
    lengths = torch.tensor([32, 20, 1], dtype=torch.int32)
    got = w.ops.qsa.decode(
        q, iq, w.k, w.v, blocks, slots, lengths, ratio=RATIO, budget=BUDGET, scale=0.125
    )
    dense = w.ops.attention.decode(q, w.k, w.v, slots, lengths, scale=0.125)
    close("short-pool QSA vs dense", got, dense)
    pre = w.ops.qsa.prefill(q, iq, w.k, w.v, blocks, 1, 17, ratio=RATIO, budget=BUDGET, scale=0.125)
    close("short-pool QSA prefill", pre, w.ops.attention.prefill(q, w.k, w.v, 1, 17, scale=0.125))


# ---- QSA selection ----------------------------------------------------------------------------


def stable_selection(row: torch.Tensor, length: int, ratio: int, top: int) -> list[int]:
    """The rule by definition: a stable descending sort of the complete blocks' scores."""
    complete = min(length // ratio, row.shape[0])
    if complete <= top:
        return list(range(complete)) + [-1] * (top - complete)
    order = torch.sort(row[:complete], descending=True, stable=True).indices
    return sorted(order[:top].tolist())


SELECT_ROWS = {
    "random": lambda g, n: torch.randn(n, generator=g),
    "relu": lambda g, n: torch.relu(torch.randn(n, generator=g)),  # ~half exact zeros
    "zeros": lambda g, n: torch.zeros(n),
    "few": lambda g, n: torch.randint(0, 3, (n,), generator=g).float(),
    "tail": lambda g, n: torch.arange(n, dtype=torch.float32),  # the last blocks win
    "signed": lambda g, n: torch.where(
        torch.rand(n, generator=g) < 0.3, torch.tensor(-0.0), torch.randn(n, generator=g)
    ),
}


@pytest.mark.parametrize("kind", sorted(SELECT_ROWS))
def test_select_blocks_is_a_stable_top_k(kind: str) -> None:
    """select_blocks takes each query's top blocks among its complete ones, ties to the lower
    block (-0.0 ties with +0.0), ascending; dense queries take all their blocks, then -1."""
    g = torch.Generator().manual_seed(30)
    ratio, top, n_cols = 4, 16, 100
    lengths = [0, 3, 4, 63, 64, 67, 68, 69, 250, 399, 400, 401, 1000]  # 1000: past the row
    scores = torch.stack([SELECT_ROWS[kind](g, n_cols) for _ in lengths])
    scores[:, 90:] = float("nan")  # past every complete block but the last rows': never read
    scores[-3:, 90:] = 1.0
    got = select_blocks(scores, torch.tensor(lengths, dtype=torch.int32), ratio, top)
    assert got.dtype == torch.int32 and got.shape == (len(lengths), top)
    for i, n in enumerate(lengths):
        want = stable_selection(scores[i], n, ratio, top)
        assert got[i].tolist() == want, f"{kind}, length {n}: {got[i].tolist()} != {want}"


def test_select_blocks_edges() -> None:
    # a row no longer than top: every query is dense
    got = select_blocks(torch.ones(2, 5), torch.tensor([9, 100]), 2, 8)
    assert got.tolist() == [[0, 1, 2, 3, -1, -1, -1, -1], [0, 1, 2, 3, 4, -1, -1, -1]]
    # rank_keys orders negatives, -inf and -0.0 like the floats themselves
    s = torch.tensor([[-1.0, -2.0, float("-inf"), -0.0, 0.0, 3.0, -1.0]])
    keys = rank_keys(s)[0]
    order = torch.sort(keys, descending=True).indices.tolist()
    assert order == [5, 3, 4, 0, 6, 1, 2], order
    ops_ = torch_backend()
    ones = torch.ones(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="scores has shape"):
        ops_.qsa.select_blocks(torch.ones(3), ones, ratio=4, top=2)
    with pytest.raises(ValueError, match="lengths has shape"):
        ops_.qsa.select_blocks(torch.ones(3, 9), ones[:2], ratio=4, top=2)
    with pytest.raises(ValueError, match="lengths must be int32"):
        ops_.qsa.select_blocks(torch.ones(3, 9), ones.float(), ratio=4, top=2)
    with pytest.raises(ValueError, match="ratio >= 1"):
        ops_.qsa.select_blocks(torch.ones(3, 9), ones, ratio=0, top=2)
