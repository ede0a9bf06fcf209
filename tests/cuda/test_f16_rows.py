"""``F16Rows`` (cuda/ops/qgemm.py): the prompt GEMMs' f16 copy of an activation made once for
every GEMM reading the same tensor, and made again whenever it could differ (on the CPU: the
conversion is torch's on any device)."""

from __future__ import annotations

import threading

import torch

from mgserve.cuda.ops.qgemm import F16Rows, f16_rows


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
