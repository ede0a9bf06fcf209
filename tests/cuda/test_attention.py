"""The CUDA attention ops (``AttentionCuda``) against the torch ones (``AttentionTorch``, which
tests/cuda/test_attention_torch.py checks against the reference) on the same GPU pools.

Tolerances: the decode kernel computes S = QK and PV on tensor cores with f16 hi + lo splits of
the non-exact operand (K/V values are exact in f16), so it agrees with fp32 torch to ~1e-6 of
each row's largest output (bound 2e-5); kv_write must be bit-identical; the long-chunk prefill
path runs torch's flash SDPA in f16 (bound 5e-3). QSA: block selection is a top-k of float
scores, so end-to-end comparisons use block keys whose scores are well separated, and the random
case compares the attention given the kernel's own selection. The selection kernel itself
(qsa_select.cu) must equal ``select_blocks`` exactly, on the same scores: random rows, rows full
of ties (all +0, all equal, a few distinct values), the best blocks at the tail, dense queries
(complete <= top) and lengths from 1 to 262144 (65536 blocks) in batches of 1..8.

Cases: the small ones of the CPU tests (q8_0 / f16 / mixed pools, GQA, window, soft cap,
lengths around tile and chunk edges, zero-length rows) plus the target shapes: D=256, Hkv=2,
H=24 at lengths 1..70000 in one batch (and each row alone: results must not depend on the
batch), Gemma 3 270M (D=256, Hkv=1, H=4, window 512), QSA at 20000 positions with budget 2048,
and a CUDA-graph capture + replay of both decode ops and of the selection. ``pytest -s`` prints
the selection's time at 65536 blocks.
"""

from __future__ import annotations

import math

import pytest
import torch

from mgserve.core.models import kvcache
from mgserve.cuda.ops import qsa as qsa_ops
from mgserve.cuda.ops import qsa_cuda
from mgserve.cuda.pools import KVLayer, kv_layer

pytestmark = pytest.mark.gpu

DEV = "cuda"
RTOL = 2e-5  # decode kernel vs fp32 torch, relative to each row's max |output|
RTOL_F16 = 5e-3  # flash SDPA (f16) prefill


@pytest.fixture(scope="module")
def att(cuda_ops):
    return cuda_ops


@pytest.fixture
def ref(torch_ops):
    return torch_ops


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed), device=DEV) * scale


def i32(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int32, device=DEV)


def pool(kind: str, n_slots: int, n_ctx: int, n_kv: int, d: int, seed: int) -> KVLayer:
    """Random pool contents (q8_0: random int8 values and scales 0.002..0.052)."""
    g = gen(seed)
    shape = (n_slots, n_ctx, n_kv, d)
    if kind == "q8_0":
        vals = torch.randint(-127, 128, shape, generator=g, device=DEV, dtype=torch.int8)
        sc = torch.rand((*shape[:3], d // 32), generator=g, device=DEV) * 0.05 + 0.002
        return KVLayer(vals, sc.half())
    vals = torch.randn(shape, generator=g, device=DEV).half()
    return KVLayer(vals, torch.zeros(0, dtype=torch.float16, device=DEV))


def close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float = RTOL) -> float:
    """Max over rows of max |got - want| / max |want| of the row."""
    assert got.shape == want.shape, f"{name}: shape {list(got.shape)} != {list(want.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite outputs"
    g = got.double().cpu().reshape(got.shape[0], -1)
    w = want.double().cpu().reshape(want.shape[0], -1)
    err = (g - w).abs().amax(dim=1) / w.abs().amax(dim=1).clamp_min(1e-6)
    worst = int(err.argmax()) if err.numel() else 0
    top = err.max().item() if err.numel() else 0.0
    rows = ", ".join(f"{e:.1e}" for e in err.tolist())
    assert top <= rtol, f"{name}: max relative error {top:.2e} at row {worst} (per row: {rows})"
    print(f"{name}: max relative error {top:.2e}")
    return top


# ---- kv_write ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["q8_0", "f16", "f32"])
def test_kv_write_is_bit_identical(att, ref, kind: str) -> None:
    n_slots, n_ctx, n_kv, d, n = 3, 50, 2, 256, 40
    x = randn(n, n_kv, d, seed=1) * torch.logspace(-3, 3, n, device=DEV)[:, None, None]
    x[0, 0, :32] = 0.0  # an all-zero block: d = 0, q = 0
    x[1, 1, :32] = torch.arange(32, device=DEV) * 0.5  # exact halves after scaling
    perm = torch.randperm(n_slots * n_ctx, generator=gen(2), device=DEV)[:n]
    slots, pos = (perm // n_ctx).to(torch.int32), (perm % n_ctx).to(torch.int32)
    got = kv_layer(kind, n_slots, n_ctx, n_kv, d, torch.device(DEV))
    want = kv_layer(kind, n_slots, n_ctx, n_kv, d, torch.device(DEV))
    att.kv.write(got, x, slots, pos)
    ref.kv.write(want, x, slots, pos)
    torch.cuda.synchronize()
    bad = (got.values != want.values).sum().item()
    assert bad == 0, f"{kind}: {bad} values differ from the torch write"
    if kind == "q8_0":
        assert torch.equal(got.scales.view(torch.int16), want.scales.view(torch.int16))
        q, sc = kvcache.quantize_q8_0(x.cpu())  # the CPU reference rounding itself
        assert torch.equal(got.values[slots.long(), pos.long()].cpu(), q)
        assert torch.equal(
            got.scales[slots.long(), pos.long()].cpu().view(torch.int16), sc.view(torch.int16)
        )
    before = got.values.clone()
    att.kv.write(got, x[:2], i32([0, 1]), i32([n_ctx, -1]))  # outside the pool: skipped
    torch.cuda.synchronize()
    assert torch.equal(got.values, before), "out-of-range positions must not be written"


# ---- dense decode -----------------------------------------------------------------------------

SMALL = [  # K type, V type, head dim, n_kv, n_head, window, softcap
    ("q8_0", "q8_0", 64, 2, 8, 0, 0.0),  # GQA 4:1
    ("f16", "f16", 64, 2, 4, 0, 0.0),  # GQA 2:1
    ("q8_0", "f16", 64, 1, 4, 7, 0.0),  # mixed pools, sliding window
    ("q8_0", "q8_0", 128, 2, 24, 50, 0.0),  # group of 12, window across chunks
    ("f16", "f16", 256, 1, 16, 0, 30.0),  # the largest group (16), soft cap
    ("q8_0", "q8_0", 256, 2, 4, 0, 20.0),
]
# (slot, length): zero (padding), 1, around warp rows (16) / tiles (64) / chunks (256), the pool
SMALL_ROWS = [
    (0, 0),
    (1, 1),
    (2, 31),
    (0, 32),
    (1, 33),
    (2, 64),
    (0, 65),
    (1, 257),
    (2, 300),
    (0, 129),
    (1, 16),
]


@pytest.mark.parametrize(("kt", "vt", "d", "n_kv", "n_head", "window", "softcap"), SMALL)
def test_decode_small(
    att, ref, kt: str, vt: str, d: int, n_kv: int, n_head: int, window: int, softcap: float
) -> None:
    k, v = pool(kt, 3, 300, n_kv, d, seed=3), pool(vt, 3, 300, n_kv, d, seed=4)
    q = randn(len(SMALL_ROWS), n_head, d, seed=5)
    slots, lengths = i32([s for s, _ in SMALL_ROWS]), i32([n for _, n in SMALL_ROWS])
    kw = {"scale": 1 / math.sqrt(d), "window": window, "softcap": softcap}
    got = att.attention.decode(q, k, v, slots, lengths, **kw)
    want = ref.attention.decode(q, k, v, slots, lengths, **kw)
    close(f"decode {kt}/{vt} D={d} {n_head}/{n_kv} w={window} cap={softcap}", got, want)
    assert not got[0].any(), "a zero-length row must give zeros"


def test_decode_target_shapes_and_batch_invariance(att, ref) -> None:
    """qwen4exp's full-attention shape over very different depths in one batch; each session's
    result must be bit-identical alone and in the batch."""
    lengths_l = [1, 31, 32, 33, 4097, 70000]
    k, v = pool("q8_0", 6, 70016, 2, 256, seed=6), pool("q8_0", 6, 70016, 2, 256, seed=7)
    q = randn(6, 24, 256, seed=8)
    slots, lengths = i32([5, 0, 1, 2, 3, 4]), i32(lengths_l)
    got = att.attention.decode(q, k, v, slots, lengths, scale=1 / 16)
    close(
        "decode D=256 24/2 q8_0 1..70000",
        got,
        ref.attention.decode(q, k, v, slots, lengths, scale=1 / 16),
    )
    for i in range(6):
        alone = att.attention.decode(
            q[i : i + 1], k, v, slots[i : i + 1], lengths[i : i + 1], scale=1 / 16
        )
        assert torch.equal(alone[0], got[i]), (
            f"row {i} (length {lengths_l[i]}) depends on the batch"
        )


@pytest.mark.parametrize("kind", ["q8_0", "f16"])
def test_decode_gemma_shapes(att, ref, kind: str) -> None:
    """Gemma 3 270M: D=256, one KV head, 4 query heads, sliding window 512 on some layers."""
    k, v = pool(kind, 6, 4096, 1, 256, seed=9), pool(kind, 6, 4096, 1, 256, seed=10)
    q = randn(6, 4, 256, seed=11)
    slots, lengths = i32([0, 1, 2, 3, 4, 5]), i32([1, 300, 512, 513, 2000, 4096])
    for window in (0, 512):
        kw = {"scale": 1 / 16, "window": window}
        got = att.attention.decode(q, k, v, slots, lengths, **kw)
        close(
            f"gemma decode {kind} window {window}",
            got,
            ref.attention.decode(q, k, v, slots, lengths, **kw),
        )


# ---- prefill ----------------------------------------------------------------------------------

PREFILL = [  # kind, n_kv, n_head, start, T, window, softcap, tolerance
    ("q8_0", 2, 24, 1000, 5, 0, 0.0, RTOL),  # short chunk: decode kernel per token
    ("f16", 1, 4, 700, 8, 512, 0.0, RTOL),
    ("q8_0", 2, 24, 700, 100, 0, 0.0, RTOL_F16),  # flash SDPA, lower-right causal, GQA 12
    ("f16", 2, 24, 0, 300, 0, 0.0, RTOL_F16),  # square causal
    ("q8_0", 1, 4, 1000, 300, 512, 0.0, RTOL_F16),  # window: explicit mask
    ("f16", 2, 8, 100, 20, 0, 30.0, 1e-6),  # soft cap on a long chunk: the torch version
]


@pytest.mark.parametrize(
    ("kind", "n_kv", "n_head", "start", "t", "window", "softcap", "tol"), PREFILL
)
def test_prefill(
    att,
    ref,
    kind: str,
    n_kv: int,
    n_head: int,
    start: int,
    t: int,
    window: int,
    softcap: float,
    tol: float,
) -> None:
    k, v = pool(kind, 2, 2048, n_kv, 256, seed=12), pool(kind, 2, 2048, n_kv, 256, seed=13)
    q = randn(t, n_head, 256, seed=14)
    kw = {"scale": 1 / 16, "window": window, "softcap": softcap}
    got = att.attention.prefill(q, k, v, 1, start, **kw)
    close(
        f"prefill {kind} {n_head}/{n_kv} start {start} T {t} w={window}",
        got,
        ref.attention.prefill(q, k, v, 1, start, **kw),
        tol,
    )


# ---- QSA --------------------------------------------------------------------------------------

HI, DI = 4, 128


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


def test_qsa_scores_kernel(att) -> None:
    n_ctx, ratio, top = 20480, 4, 512
    n_blk = n_ctx // ratio
    blocks = randn(3, n_blk, DI, seed=15)
    iq = randn(5, HI, DI, seed=16)
    slots, lengths = i32([0, 1, 2, 0, 1]), i32([20000, 20003, 2051, 2052, 1])
    got = att.qsa.scores(iq, blocks, slots, lengths, n_blk - 3, ratio, top)  # padded rows
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


# ---- QSA selection ----------------------------------------------------------------------------

SEL_COLS, SEL_RATIO, SEL_TOP = 65536, 4, 512  # qwen4exp at 262144 tokens


def score_rows(kind: str, n: int, n_cols: int, seed: int) -> torch.Tensor:
    """[n, n_cols] block scores of one kind (see test_qsa_select_kernel)."""
    g = gen(seed)
    if kind == "relu":  # like the indexer: ~40% exact zeros, the rest spread over binades
        x = torch.randn(n, n_cols, generator=g, device=DEV) + 0.3
        return torch.relu(x * torch.randn(n, 1, generator=g, device=DEV).abs() * 3)
    if kind == "zeros":  # every block ties: the first `top` blocks win
        return torch.zeros(n, n_cols, device=DEV)
    if kind == "equal":  # one positive value everywhere (not the +0 fast path)
        return torch.full((n, n_cols), 0.75, device=DEV)
    if kind == "few":  # 4 values, heavy ties at the cut
        return torch.randint(0, 4, (n, n_cols), generator=g, device=DEV).float() * 0.5
    if kind == "ulps":  # neighbouring floats: only the last radix digit separates them
        steps = torch.randint(0, 5, (n, n_cols), generator=g, device=DEV)
        return (torch.tensor(1.0, device=DEV).view(torch.int32) + steps).view(torch.float32)
    if kind == "tail":  # increasing with the block: the last complete blocks win
        return torch.arange(n_cols, device=DEV, dtype=torch.float32).expand(n, -1) * 1e-3
    if kind == "signed":  # negative scores, -0.0 and -inf (not from the indexer, but ordered)
        x = torch.randn(n, n_cols, generator=g, device=DEV)
        x[x.abs() < 0.3] = -0.0
        x[x < -2.0] = float("-inf")
        return x
    raise ValueError(kind)


SEL_KINDS = ["relu", "zeros", "equal", "few", "ulps", "tail", "signed"]
# dense (0, 1, complete = top - 1, top), the first sparse lengths, mid-block, the pool's end
SEL_LENGTHS = [0, 1, 4 * 511 + 3, 2048, 2051, 2052, 2053, 100003, 262143, 262144]


def check_selection(att, ref, scores: torch.Tensor, lengths: torch.Tensor, name: str,
                    ratio: int = SEL_RATIO, top: int = SEL_TOP) -> None:  # fmt: skip
    got = att.qsa.select_blocks(scores, lengths, ratio=ratio, top=top)
    want = ref.qsa.select_blocks(scores, lengths, ratio=ratio, top=top)
    assert got.shape == want.shape and got.dtype == torch.int32, f"{name}: {got.shape} {got.dtype}"
    bad = (got != want).any(dim=1).nonzero().flatten().tolist()
    if bad:
        i = bad[0]
        diff = (got[i] != want[i]).nonzero().flatten()[:5].tolist()
        raise AssertionError(
            f"{name}: rows {bad} differ (lengths {[int(lengths[j]) for j in bad]}); row {i} at "
            f"{diff}: got {got[i, diff].tolist()} want {want[i, diff].tolist()}"
        )


@pytest.mark.parametrize("kind", SEL_KINDS)
def test_qsa_select_kernel(att, ref, kind: str) -> None:
    """Every kind at every length in one batch of 10, each row also alone (the selection must
    not depend on the batch)."""
    scores = score_rows(kind, len(SEL_LENGTHS), SEL_COLS, seed=40)
    lengths = i32(SEL_LENGTHS)
    check_selection(att, ref, scores, lengths, f"select {kind}")
    both = att.qsa.select_blocks(scores, lengths, ratio=SEL_RATIO, top=SEL_TOP)
    for i in (2, 6, 9):
        alone = att.qsa.select_blocks(
            scores[i : i + 1], lengths[i : i + 1], ratio=SEL_RATIO, top=SEL_TOP
        )
        assert torch.equal(alone[0], both[i]), f"{kind}: row {i} depends on the batch"
    dense = both[3]  # 2048 tokens = 512 complete blocks = top: every block
    assert torch.equal(dense.long().cpu(), torch.arange(SEL_TOP)), "dense row must select all"
    assert (both[1] == -1).all() and (both[0] == -1).all(), "rows without blocks: all -1"


@pytest.mark.parametrize("b", [1, 2, 3, 5, 8])
def test_qsa_select_batches(att, ref, b: int) -> None:
    """Random lengths 1..262144 in batches of 1..8; ratio 1 and 4, small and large `top`, row
    lengths that are not a multiple of 4 (the padded copy)."""
    g = torch.Generator().manual_seed(41 + b)
    for ratio, top, n_cols in ((4, 512, 65536), (1, 37, 1001), (4, 8, 50), (2, 3000, 9999)):
        lengths = torch.randint(1, n_cols * ratio + 1, (b,), generator=g).int().to(DEV)
        for kind in ("relu", "few"):
            scores = score_rows(kind, b, n_cols, seed=42 + b)
            check_selection(
                att, ref, scores, lengths, f"B={b} {kind} ratio {ratio} top {top}", ratio, top
            )


def test_qsa_select_capture_and_timing(att, ref) -> None:
    """The selection captures into a CUDA graph and replays on new scores and lengths; then
    (informational, pytest -s) its time per layer at 65536 blocks beside torch.topk + sort."""
    scores = score_rows("relu", 8, SEL_COLS, seed=43)
    lengths = i32([262144, 200001, 150000, 100000, 65536, 30000, 5000, 2100])
    kw = {"ratio": SEL_RATIO, "top": SEL_TOP}
    att.qsa.select_blocks(scores, lengths, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sel = att.qsa.select_blocks(scores, lengths, **kw)
    scores.copy_(score_rows("few", 8, SEL_COLS, seed=44))
    lengths.copy_(i32([2052, 262144, 9, 262000, 70001, 2048, 131072, 4]))
    graph.replay()
    torch.cuda.synchronize()
    check_selection(att, ref, scores, lengths, "select replay")
    assert torch.equal(sel, ref.qsa.select_blocks(scores, lengths, **kw)), "replay differs"

    scores.copy_(score_rows("relu", 8, SEL_COLS, seed=45))
    full = i32([SEL_COLS * SEL_RATIO] * 8)
    keys = qsa_ops.rank_keys(scores)
    blocks, iq = randn(8, SEL_COLS, DI, seed=46), randn(8, HI, DI, seed=47)
    slots = i32(list(range(8)))

    def topk_sort(b: int) -> None:
        keys[:b].topk(SEL_TOP, dim=1, sorted=False).indices.sort(dim=1)

    for b in (1, 8):
        for name, fn in (
            ("qsa_select", lambda b=b: att.qsa.select(scores[:b], full[:b], SEL_COLS, 4, SEL_TOP)),
            ("torch topk + sort", lambda b=b: topk_sort(b)),
            (
                "(qsa_scores)",
                lambda b=b: att.qsa.scores(
                    iq[:b], blocks, slots[:b], full[:b], SEL_COLS, SEL_RATIO, SEL_TOP
                ),
            ),
        ):
            fn()
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            for _ in range(20):
                fn()
            t1.record()
            torch.cuda.synchronize()
            us = t0.elapsed_time(t1) / 20 * 1e3
            print(f"QSA selection of {SEL_TOP} of {SEL_COLS} blocks, B={b}, {name}: {us:.1f} us")


QSA_BIG = {"n_ctx": 20480, "ratio": 4, "budget": 2048, "n_kv": 2, "n_head": 24, "d": 256}
QSA_SMALL = {"n_ctx": 256, "ratio": 4, "budget": 32, "n_kv": 2, "n_head": 8, "d": 64}
# sparse with an empty tail, a 3-cell tail, exactly top complete blocks (dense), top + 1, short
QSA_BIG_ROWS = [(0, 20000), (1, 20003), (2, 2051), (0, 2052), (1, 100), (2, 1), (0, 8195), (1, 0)]
QSA_SMALL_ROWS = [(0, 83), (1, 100), (2, 30), (2, 35), (0, 256), (1, 1), (0, 0)]


@pytest.mark.parametrize(("cfg", "rows"), [(QSA_SMALL, QSA_SMALL_ROWS), (QSA_BIG, QSA_BIG_ROWS)])
@pytest.mark.parametrize("kind", ["q8_0", "f16"])
def test_qsa_decode(att, ref, cfg: dict[str, int], rows: list[tuple[int, int]], kind: str) -> None:
    n_ctx, ratio, budget = cfg["n_ctx"], cfg["ratio"], cfg["budget"]
    n_kv, n_head, d = cfg["n_kv"], cfg["n_head"], cfg["d"]
    k, v = pool(kind, 3, n_ctx, n_kv, d, seed=17), pool(kind, 3, n_ctx, n_kv, d, seed=18)
    q = randn(len(rows), n_head, d, seed=19)
    slots, lengths = i32([s for s, _ in rows]), i32([n for _, n in rows])
    kw = {"ratio": ratio, "budget": budget, "scale": 1 / math.sqrt(d)}
    name = f"qsa decode {kind} n_ctx {n_ctx}"

    # separated block scores: end to end against the torch version
    blocks, iq = separated(3, n_ctx // ratio, len(rows), seed=20)
    got = att.qsa.decode(q, iq, k, v, blocks, slots, lengths, **kw)
    close(name, got, ref.qsa.decode(q, iq, k, v, blocks, slots, lengths, **kw))
    assert not got[-1].any(), "a zero-length row must give zeros"

    # random block keys: the attention given the kernel's own selection
    blocks, iq = randn(3, n_ctx // ratio, DI, seed=21), randn(len(rows), HI, DI, seed=22)
    top = budget // ratio
    sel = att.qsa.score_and_select(iq, blocks, slots, lengths, n_ctx // ratio, ratio, top)
    got = att.qsa.decode(q, iq, k, v, blocks, slots, lengths, **kw)
    want_sel = qsa_ops.select_blocks(
        att.qsa.scores(iq, blocks, slots, lengths, n_ctx // ratio, ratio, top),
        lengths,
        ratio,
        top,
    )
    assert torch.equal(sel, want_sel), "the kernel's selection differs from select_blocks"
    pos, valid = qsa_ops.positions(sel, lengths.long(), ratio, top, n_ctx)
    want = qsa_ops.attend_cells(q, k, v, slots.long(), pos, valid, kw["scale"])
    close(name + " (random blocks, same selection)", got, want)


@pytest.mark.parametrize(
    ("cfg", "start", "t"),
    [(QSA_SMALL, 18, 60), (QSA_BIG, 19990, 40), (QSA_BIG, 2040, 24), (QSA_BIG, 1901, 300)],
)
def test_qsa_prefill(
    att, ref, cfg: dict[str, int], start: int, t: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks starting mid-block; the small one and those at 2040 and 1901 cross from dense to
    sparse. Then again with the scores and the attention split over several launches."""
    n_ctx, ratio, budget = cfg["n_ctx"], cfg["ratio"], cfg["budget"]
    n_kv, n_head, d = cfg["n_kv"], cfg["n_head"], cfg["d"]
    k, v = pool("q8_0", 2, n_ctx, n_kv, d, seed=23), pool("q8_0", 2, n_ctx, n_kv, d, seed=24)
    q = randn(t, n_head, d, seed=25)
    blocks, iq = separated(2, n_ctx // ratio, t, seed=26)
    kw = {"ratio": ratio, "budget": budget, "scale": 1 / math.sqrt(d)}
    want = ref.qsa.prefill(q, iq, k, v, blocks, 1, start, **kw)
    close(
        f"qsa prefill start {start} T {t}",
        att.qsa.prefill(q, iq, k, v, blocks, 1, start, **kw),
        want,
    )
    monkeypatch.setattr(qsa_cuda, "_PREFILL_SCORE_ELEMS", 7 * HI * (start + t) // 4)
    monkeypatch.setattr(qsa_cuda, "_PREFILL_PART_ELEMS", 11 * n_head * 2 * d)
    close(
        "qsa prefill in groups of 7 / 11 queries",
        att.qsa.prefill(q, iq, k, v, blocks, 1, start, **kw),
        want,
    )


# ---- CUDA graphs ------------------------------------------------------------------------------


def test_decode_ops_capture_and_replay(att) -> None:
    """Both decode ops capture into one CUDA graph (no host sync, no data-dependent shapes) and
    replay with new lengths and queries written into the same input tensors."""
    n_ctx, ratio, budget = 8192, 4, 2048
    k, v = pool("q8_0", 3, n_ctx, 2, 256, seed=27), pool("q8_0", 3, n_ctx, 2, 256, seed=28)
    blocks, iq = separated(3, n_ctx // ratio, 3, seed=29)
    q = randn(3, 24, 256, seed=30)
    slots, lengths = i32([2, 0, 1]), i32([5000, 17, 8192])
    kw = {"ratio": ratio, "budget": budget, "scale": 1 / 16}

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        dense = att.attention.decode(q, k, v, slots, lengths, scale=1 / 16, window=512)
        return dense, att.qsa.decode(q, iq, k, v, blocks, slots, lengths, **kw)

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
