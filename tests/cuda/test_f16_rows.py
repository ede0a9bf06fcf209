"""``F16Rows`` (cuda/ops/f16_rows.py): the prompt GEMMs' f16 copy of an activation made once for
every GEMM reading the same tensor, and made again whenever it could differ (on the CPU: the
conversion is torch's on any device)."""

from __future__ import annotations

import threading

import pytest
import torch

from mgserve.cuda.ops.f16_rows import F16Rows, f16_rows
from mgserve.cuda.ops.rowpath import RowPath


def test_the_same_unchanged_tensor_is_converted_once() -> None:
    rows = F16Rows()
    x = torch.randn(8, 16)
    first = rows(x)
    assert torch.equal(first, f16_rows(x)) and first.dtype == torch.float16
    assert rows(x) is first  # q, k, v of one input: one conversion


def test_a_changed_or_another_tensor_is_converted_again() -> None:
    rows = F16Rows()
    x = torch.randn(8, 16)
    first = rows(x)
    x.mul_(2.0)  # in place: the version counter moves
    again = rows(x)
    assert again is not first and torch.equal(again, f16_rows(x))
    y = x.clone()  # equal values, another tensor
    assert rows(y) is not again
    view = x[:4]  # a view shares its base's counter: a change through the base is seen
    v16 = rows(view)
    x.add_(1.0)
    assert rows(view) is not v16 and torch.equal(rows(view), f16_rows(x[:4]))


def test_each_thread_keeps_its_own_entry() -> None:
    rows = F16Rows()
    x = torch.randn(8, 16)
    mine = rows(x)
    theirs: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: theirs.append(rows(x)))
    t.start()
    t.join()
    assert theirs[0] is not mine and torch.equal(theirs[0], mine)
    assert rows(x) is mine  # the other thread's conversion did not replace this one's


def test_clear_forgets_the_entry() -> None:
    rows = F16Rows()
    x = torch.randn(4, 8)
    first = rows(x)
    rows.clear()  # the end of a prompt step
    assert rows(x) is not first


def test_a_reshape_of_the_same_memory_hits() -> None:
    """The producer's output [N, hc, d] and the GEMM's [N, hc * d] view of it: one copy."""
    rows = F16Rows()
    x = torch.randn(4, 2, 8)
    first = rows(x)
    flat = x.reshape(4, 16)
    assert rows(flat).data_ptr() == first.data_ptr() and rows(flat).shape == (4, 16)
    part = rows(x[1:])  # a slice: another start, fewer values
    assert part.data_ptr() != first.data_ptr() and torch.equal(part, f16_rows(x[1:]))


def test_other_layouts_dtypes_and_aliases_miss() -> None:
    """A transpose over the same memory, another dtype's view of it, and an alias with a
    version counter of its own (``x.data``, which an in-place write through x does not move)
    are converted, never handed x's copy."""
    rows = F16Rows()
    x = torch.randn(8, 8)
    first = rows(x)
    t = x.t()  # the same pointer and count, not contiguous
    assert rows(t) is not first and torch.equal(rows(t), f16_rows(t))
    bits = x.view(torch.int32)  # the same memory as another dtype
    assert rows.find(bits) is None
    x.mul_(2.0)
    alias = x.data  # its own counter, still 0: it must not match the stale entry
    assert rows.find(alias) is None and torch.equal(rows(alias), f16_rows(x))


def test_inference_tensors_are_converted_and_not_kept() -> None:
    path = RowPath()
    rows = F16Rows(path)
    rows.offers = True
    with torch.inference_mode():
        x = torch.randn(16, 8)
        assert not rows.wanted(64)  # no producer writes a copy nobody can find
        assert torch.equal(rows(x), f16_rows(x)) and rows.find(x) is None


def test_the_last_two_entries_are_kept() -> None:
    """The router reads the mix's output again after the shared expert's activation was
    converted: both copies are still there; a third pushes out the least recently used."""
    rows = F16Rows()
    h, a, b = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    h16, a16 = rows(h), rows(a)
    assert rows(h) is h16 and rows(a) is a16
    rows(b)  # a, then b, most recent: h goes
    assert rows(a) is a16 and rows(h) is not h16


def test_an_offered_copy_is_returned_until_x_changes() -> None:
    rows = F16Rows()
    x = torch.randn(4, 8)
    x16 = f16_rows(x)
    rows.offer(x, x16)
    assert rows(x) is x16
    assert rows(x.view(2, 16)).data_ptr() == x16.data_ptr()
    x.mul_(3.0)
    assert rows(x) is not x16 and torch.equal(rows(x), f16_rows(x))
    with pytest.raises(ValueError, match="does not match"):
        rows.offer(x, torch.zeros(4, 4, dtype=torch.float16))


def test_copies_are_wanted_for_prompt_rows_only() -> None:
    path = RowPath()
    rows = F16Rows(path)
    assert rows.wanted(64) and not rows.wanted(8)  # outside a step: by size
    x = torch.randn(64, 8)
    room = rows.room(x, 64)  # where wanted: an f16 tensor of x's shape
    assert room is not None and room.dtype == torch.float16 and room.shape == x.shape
    assert rows.room(x, 8) is None
    with path.step("decode"):
        assert not rows.wanted(64)
    with path.step("prompt"):
        assert rows.wanted(3)
        rows.offers = False
        assert not rows.wanted(3)
    assert not F16Rows().wanted(64)  # no path: no producer writes one
