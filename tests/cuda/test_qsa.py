"""The CUDA QSA ops (``QsaCuda``: block scores, sparse decode and prefill) against the torch ones
(``QsaTorch``, which tests/cuda/test_qsa_torch.py checks against the reference) on the same GPU
pools; test_qsa_select.py checks the selection kernel alone.

Block selection is a top-k of float scores, so end-to-end comparisons use block keys whose scores
are well separated, and the random case compares the attention given the kernel's own selection.
Cases: small pools and QSA at 20000 positions with budget 2048 (sparse rows with and without a
tail, dense rows, zero-length rows), prefill chunks crossing from dense to sparse and across
QSA_FLASH_MAX_POS (flash prefill kernel rows at its tolerance, RTOL_FLASH; whole and over several
launches; bitwise the same inside longer chunks), and a CUDA-graph capture + replay of QSA
decode beside dense decode.
"""

from __future__ import annotations

import math

import pytest
import torch

from mgserve.cuda.ops import attention_cuda, attention_prefill, qsa_cuda, qsa_prefill
from mgserve.cuda.ops import qsa as qsa_ops
from tests.cuda.attention_inputs import DEV, DI, HI, RTOL_FLASH, close, gen, i32, pool, randn

pytestmark = pytest.mark.gpu


def separated(
    n_slots: int, n_blk: int, n_query: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block keys +-c_n * u and indexer queries ~u: score(n) = c_n * sum_h (iq_h . u) for the
    positive blocks (one in four), with the c_n a permutation of evenly spaced values, so the
    top-k never hinges on float rounding; the negative blocks score exactly 0 in both versions,
    so selections that reach into them test the tie rule (lower block first)."""
    g = gen(seed)
    u = torch.randn(DI, generator=g, device=DEV)
    u = u / u.norm()
    spaced = torch.linspace(0.5, 1.5, n_blk, device=DEV)
    c = torch.stack(
        [spaced[torch.randperm(n_blk, generator=g, device=DEV)] for _ in range(n_slots)]
    )
    sign = torch.where(torch.arange(n_blk, device=DEV) % 4 == 0, 1.0, -1.0)
    blocks = (c[..., None] * sign[:, None] * u).contiguous()  # [n_slots, n_blk, DI]
    iq = u + 0.05 * torch.randn(n_query, HI, DI, generator=g, device=DEV)
    return blocks, iq


def test_qsa_scores_kernel(cuda_ops) -> None:
    n_ctx, ratio, top = 20480, 4, 512
    n_blk = n_ctx // ratio
    blocks = randn(3, n_blk, DI, seed=15)
    iq = randn(5, HI, DI, seed=16)
    slots, lengths = i32([0, 1, 2, 0, 1]), i32([20000, 20003, 2051, 2052, 1])
    got = cuda_ops.qsa.scores(iq, blocks, slots, lengths, n_blk - 3, ratio, top)  # padded rows
    assert got.shape == (5, n_blk), f"scores shape {list(got.shape)}"
    got = got[:, : n_blk - 3]
    want = qsa_ops.mask_incomplete(
        torch.cat(
            [
                qsa_ops.block_scores(iq[i : i + 1], blocks[int(s)])
                for i, s in enumerate(slots.tolist())
            ]
        ),
        lengths.long(),
        ratio,
    )[:, : n_blk - 3]
    dense = (lengths.long() // ratio) <= top
    assert torch.isneginf(got[dense]).all(), "dense rows must be all -inf"
    sparse = ~dense
    fin = torch.isfinite(want[sparse])
    assert torch.equal(torch.isfinite(got[sparse]), fin), "-inf pattern differs"
    assert not torch.signbit(got[sparse][fin]).any(), "scores must be +0, never -0"
    err = (got[sparse][fin] - want[sparse][fin]).abs().max() / want[sparse][fin].abs().max()
    assert err.item() <= 1e-5, f"block scores: max relative error {err.item():.2e}"


def test_qsa_head_sum_kernel(cuda_ops) -> None:
    """qsa_head_sum: the heads' relus summed in order, then divided by the norm, each rounded
    once (the torch ops on the same products, with a true division), +0 where no head is above
    zero, for 1 to 8 heads, a row count that is not a multiple of anything and a row wider than
    one CTA's 1024 floats."""
    from mgserve.core.reference import rowwise

    norm = float(torch.tensor(math.sqrt(128.0), dtype=torch.float32))
    for n, n_hi, stride in [(1, 1, 4), (7, 4, 1028), (64, 8, 4100), (3, 3, 8)]:
        prod = randn(n, n_hi, stride, seed=n_hi)
        prod[:, :, ::5] = -prod[:, :, ::5].abs()  # columns no head scores above zero: +0
        prod[0, 0, 1] = -0.0
        got = qsa_prefill.head_sum(cuda_ops.kernels, prod, norm)
        acc = rowwise.sum_in_order(prod.clamp_min(0.0), 1)
        want = torch.div(acc, torch.full_like(acc, norm)) + 0.0
        assert torch.equal(got, want), f"head sum N {n} heads {n_hi} stride {stride}"
        assert not torch.signbit(got).any(), "scores must be +0, never -0"


# ---- decode and prefill -----------------------------------------------------------------------

QSA_BIG = {"n_ctx": 20480, "ratio": 4, "budget": 2048, "n_kv": 2, "n_head": 24, "d": 256}
QSA_SMALL = {"n_ctx": 256, "ratio": 4, "budget": 32, "n_kv": 2, "n_head": 8, "d": 64}
# sparse with an empty tail, a 3-cell tail, exactly top complete blocks (dense), top + 1, short
QSA_BIG_ROWS = [(0, 20000), (1, 20003), (2, 2051), (0, 2052), (1, 100), (2, 1), (0, 8195), (1, 0)]
QSA_SMALL_ROWS = [(0, 83), (1, 100), (2, 30), (2, 35), (0, 256), (1, 1), (0, 0)]


@pytest.mark.parametrize(("cfg", "rows"), [(QSA_SMALL, QSA_SMALL_ROWS), (QSA_BIG, QSA_BIG_ROWS)])
@pytest.mark.parametrize("kind", ["q8_0", "f16"])
def test_qsa_decode(
    cuda_ops, torch_ops, cfg: dict[str, int], rows: list[tuple[int, int]], kind: str
) -> None:
    n_ctx, ratio, budget = cfg["n_ctx"], cfg["ratio"], cfg["budget"]
    n_kv, n_head, d = cfg["n_kv"], cfg["n_head"], cfg["d"]
    k, v = pool(kind, 3, n_ctx, n_kv, d, seed=17), pool(kind, 3, n_ctx, n_kv, d, seed=18)
    q = randn(len(rows), n_head, d, seed=19)
    slots, lengths = i32([s for s, _ in rows]), i32([n for _, n in rows])
    kw = {"ratio": ratio, "budget": budget, "scale": 1 / math.sqrt(d)}
    name = f"qsa decode {kind} n_ctx {n_ctx}"

    # separated block scores: end to end against the torch version
    blocks, iq = separated(3, n_ctx // ratio, len(rows), seed=20)
    got = cuda_ops.qsa.decode(q, iq, k, v, blocks, slots, lengths, **kw)
    close(name, got, torch_ops.qsa.decode(q, iq, k, v, blocks, slots, lengths, **kw))
    assert not got[-1].any(), "a zero-length row must give zeros"

    # random block keys: the attention given the kernel's own selection
    blocks, iq = randn(3, n_ctx // ratio, DI, seed=21), randn(len(rows), HI, DI, seed=22)
    top = budget // ratio
    sel = cuda_ops.qsa.score_and_select(iq, blocks, slots, lengths, n_ctx // ratio, ratio, top)
    got = cuda_ops.qsa.decode(q, iq, k, v, blocks, slots, lengths, **kw)
    want_sel = qsa_ops.select_blocks(
        cuda_ops.qsa.scores(iq, blocks, slots, lengths, n_ctx // ratio, ratio, top),
        lengths,
        ratio,
        top,
    )
    assert torch.equal(sel, want_sel), "the kernel's selection differs from select_blocks"
    pos, valid = qsa_ops.positions(sel, lengths.long(), ratio, top, n_ctx)
    want = qsa_ops.attend_cells(q, k, v, slots.long(), pos, valid, kw["scale"])
    close(name + " (random blocks, same selection)", got, want)


PREFILL_CASES = [  # config, start, T
    (QSA_SMALL, 18, 60),  # crosses from dense to sparse
    (QSA_BIG, 19990, 40),  # past QSA_FLASH_MAX_POS: the decode kernel
    (QSA_BIG, 2040, 24),  # crosses from dense to sparse
    (QSA_BIG, 1901, 300),
    (QSA_BIG, 8150, 100),  # crosses QSA_FLASH_MAX_POS: both kernels in one chunk
]


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize(("cfg", "start", "t"), PREFILL_CASES)
def test_qsa_prefill(
    cuda_ops,
    torch_ops,
    cfg: dict[str, int],
    start: int,
    t: int,
    flash: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Chunks starting mid-block. Queries before QSA_FLASH_MAX_POS run the flash prefill kernel
    over their visibility bits (RTOL_FLASH, test_attention_prefill.py), later ones the decode
    kernel (RTOL); ``flash_prefill`` off: all on the decode kernel. Then the same bits with the
    scores and the decode-kernel launches split into groups of a few queries, and with the torch
    ops the head-sum and visibility kernels replaced (the bitmap in groups of 5 queries)."""
    monkeypatch.setattr(cuda_ops.attention, "flash_prefill", flash)
    n_ctx, ratio, budget = cfg["n_ctx"], cfg["ratio"], cfg["budget"]
    n_kv, n_head, d = cfg["n_kv"], cfg["n_head"], cfg["d"]
    k, v = pool("q8_0", 2, n_ctx, n_kv, d, seed=23), pool("q8_0", 2, n_ctx, n_kv, d, seed=24)
    q = randn(t, n_head, d, seed=25)
    blocks, iq = separated(2, n_ctx // ratio, t, seed=26)
    kw = {"ratio": ratio, "budget": budget, "scale": 1 / math.sqrt(d)}
    want = torch_ops.qsa.prefill(q, iq, k, v, blocks, 1, start, **kw)
    got = cuda_ops.qsa.prefill(q, iq, k, v, blocks, 1, start, **kw)
    split = min(t, max(0, qsa_cuda.QSA_FLASH_MAX_POS - start)) if flash else 0
    name = f"qsa prefill start {start} T {t}"
    if split:
        close(name + " (flash kernel rows)", got[:split], want[:split], RTOL_FLASH)
    if split < t:
        close(name + " (decode kernel rows)", got[split:], want[split:])
    monkeypatch.setattr(cuda_ops.qsa, "score_group", 7)
    monkeypatch.setattr(attention_cuda, "_PREFILL_PART_ELEMS", 11 * n_head * 2 * d)
    again = cuda_ops.qsa.prefill(q, iq, k, v, blocks, 1, start, **kw)
    assert torch.equal(again, got), "QSA prefill in groups of 7 / 11 queries differs"
    monkeypatch.setattr(cuda_ops.qsa, "score_group", 64)  # (bench --toggle qsa.score_group=)
    narrow = cuda_ops.qsa.prefill(q, iq, k, v, blocks, 1, start, **kw)
    assert torch.equal(narrow, got), "QSA prefill in groups of 64 queries differs"
    monkeypatch.setattr(cuda_ops.qsa, "prefill_kernels", False)  # the torch ops (bench --toggle)
    monkeypatch.setattr(attention_prefill, "VIS_ELEMS", 5 * (start + t + 32))
    torch_ops_path = cuda_ops.qsa.prefill(q, iq, k, v, blocks, 1, start, **kw)
    assert torch.equal(torch_ops_path, got), "the head sum / visibility kernels change the output"


def test_qsa_prefill_invariance(cuda_ops) -> None:
    """A query's QSA prefill output is the same bits in any chunk (flash kernel rows, sparse and
    dense, and decode-kernel rows past QSA_FLASH_MAX_POS)."""
    cfg = QSA_BIG
    n_ctx, ratio, budget, d = cfg["n_ctx"], cfg["ratio"], cfg["budget"], cfg["d"]
    k, v = pool("q8_0", 2, n_ctx, 2, d, seed=52), pool("q8_0", 2, n_ctx, 2, d, seed=53)
    kw = {"ratio": ratio, "budget": budget, "scale": 1 / 16}
    for start, t, parts in [(1900, 400, [(2000, 50), (2100, 1), (2299, 1), (1950, 64)]),
                            (8100, 200, [(8191, 2), (8200, 17), (8150, 100)])]:  # fmt: skip
        q = randn(t, 24, d, seed=54)
        blocks, iq = separated(2, n_ctx // ratio, t, seed=55)
        whole = cuda_ops.qsa.prefill(q, iq, k, v, blocks, 0, start, **kw)
        for p0, n in parts:
            sl = slice(p0 - start, p0 - start + n)
            part = cuda_ops.qsa.prefill(q[sl], iq[sl], k, v, blocks, 0, p0, **kw)
            assert torch.equal(part, whole[sl]), (
                f"QSA span ({p0}, {n}) differs inside ({start}, {t})"
            )


# ---- CUDA graphs ------------------------------------------------------------------------------


def test_decode_ops_capture_and_replay(cuda_ops) -> None:
    """Both decode ops capture into one CUDA graph (no host sync, no data-dependent shapes) and
    replay with new lengths and queries written into the same input tensors."""
    n_ctx, ratio, budget = 8192, 4, 2048
    k, v = pool("q8_0", 3, n_ctx, 2, 256, seed=27), pool("q8_0", 3, n_ctx, 2, 256, seed=28)
    blocks, iq = separated(3, n_ctx // ratio, 3, seed=29)
    q = randn(3, 24, 256, seed=30)
    slots, lengths = i32([2, 0, 1]), i32([5000, 17, 8192])
    kw = {"ratio": ratio, "budget": budget, "scale": 1 / 16}

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        dense = cuda_ops.attention.decode(q, k, v, slots, lengths, scale=1 / 16, window=512)
        return dense, cuda_ops.qsa.decode(q, iq, k, v, blocks, slots, lengths, **kw)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile, set kernel attributes, warm the allocator outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    lengths.copy_(i32([6001, 3000, 2052]))
    q.copy_(randn(3, 24, 256, seed=31))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()
    assert torch.equal(outs[0], eager[0]), "replayed dense decode differs from eager"
    assert torch.equal(outs[1], eager[1]), "replayed QSA decode differs from eager"
