"""The torch QSA ops (``QsaTorch``) against the reference path on the CPU (runs in CI), on the
pools of a ``World`` (tests/cuda/kv_world.py):
- qsa_decode / qsa_prefill: ``qsa.select`` + ``qsa.attend_selected`` per query (sparse selections
  with and without a tail, dense queries, a prefill chunk starting mid-block whose queries cross
  from dense to sparse, ties broken toward the lower block, a pool too short for any sparse query);
- select_blocks (the rule qsa_select.cu implements): a stable descending sort of each query's
  complete blocks, on random rows, ties (+0 / -0, few values), the best blocks at the tail.
"""

from __future__ import annotations

import math

import pytest
import torch

from mgserve.core.reference import qsa
from mgserve.cuda.backend import torch_backend
from mgserve.cuda.ops import qsa as qsa_ops
from mgserve.cuda.ops.qsa import rank_keys, select_blocks
from tests.cuda.kv_world import N_SLOTS, World, close, rand

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
