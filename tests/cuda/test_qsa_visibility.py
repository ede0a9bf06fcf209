"""``attention_prefill.visibility`` (the QSA prompt queries' position bitmap for the flash
prefill kernel) against ``qsa.positions`` on the CPU: each query's set bits are exactly its valid
selected cells, for sparse queries (with and without a tail) and dense ones, in one group and in
groups of a few queries."""

from __future__ import annotations

import pytest
import torch

from mgserve.cuda.ops import attention_prefill
from mgserve.cuda.ops.attention_prefill import visibility
from mgserve.cuda.ops.qsa import positions, select_blocks


def bit_sets(bits: torch.Tensor) -> list[set[int]]:
    words = bits.long() & 0xFFFFFFFF
    out = []
    for row in words.tolist():
        out.append({32 * w + b for w, x in enumerate(row) for b in range(32) if x >> b & 1})
    return out


CASES = [(0, 70, 4, 8), (25, 40, 4, 8), (90, 33, 3, 5), (0, 5, 1, 2)]  # start, T, ratio, top


@pytest.mark.parametrize(("start", "t", "ratio", "top"), CASES)
@pytest.mark.parametrize("group", [None, 3])
def test_visibility_matches_positions(
    start: int, t: int, ratio: int, top: int, group: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    end = start + t
    if group is not None:
        monkeypatch.setattr(attention_prefill, "VIS_ELEMS", group * (end + 32))
    n_blk = end // ratio
    g = torch.Generator().manual_seed(start + t)
    scores = torch.randn(t, max(n_blk, 1), generator=g).relu()  # ties at 0: the lower block
    lengths = torch.arange(start + 1, end + 1)
    sel = select_blocks(scores, lengths, ratio, top)
    got = bit_sets(visibility(sel, start, ratio, top))
    pos, valid = positions(sel, lengths, ratio, top, n_ctx=end)
    for i in range(t):
        want = set(pos[i][valid[i]].tolist())
        assert got[i] == want, f"query {i} (position {start + i}): {sorted(got[i] ^ want)}"


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("start", "t", "ratio", "top"), [*CASES, (8000, 300, 4, 512), (0, 4096, 4, 512), (31, 1, 2, 3)]
)
def test_visibility_kernel_gives_the_same_bits(
    start: int, t: int, ratio: int, top: int, cuda_ops
) -> None:  # type: ignore[no-untyped-def]
    """qsa_visibility (one kernel) against the torch version on the GPU: the same words."""
    from mgserve.cuda.ops.attention_prefill import visibility_kernel

    end, dev = start + t, torch.device("cuda", 0)
    n_blk = end // ratio
    g = torch.Generator().manual_seed(end)
    scores = torch.randn(t, max(n_blk, 1), generator=g).relu()
    sel = select_blocks(scores, torch.arange(start + 1, end + 1), ratio, top).to(dev)
    got = visibility_kernel(cuda_ops.kernels, sel.to(torch.int32), start, ratio, top)
    want = visibility(sel.to(torch.int32), start, ratio, top)
    assert got.dtype == want.dtype == torch.int32 and torch.equal(got, want)
