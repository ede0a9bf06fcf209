"""rowwise: elementwise transcendental functions whose rows do not depend on their neighbours."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F

from mgserve.core.reference import rowwise

FUNCTIONS = [
    (rowwise.exp, torch.exp),
    (rowwise.sigmoid, torch.sigmoid),
    (rowwise.softplus, F.softplus),
    (rowwise.silu, F.silu),
    (rowwise.tanh, torch.tanh),
    (
        partial(rowwise.rowwise, partial(F.gelu, approximate="tanh")),
        partial(F.gelu, approximate="tanh"),
    ),
]


@pytest.mark.parametrize(("fn", "plain"), FUNCTIONS)
@pytest.mark.parametrize("width", [1, 4, 37, 64])
def test_rows_do_not_depend_on_their_neighbours(fn, plain, width: int) -> None:
    x = torch.randn(45, width, generator=torch.Generator().manual_seed(width)) * 3
    together = fn(x)
    alone = torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])
    assert torch.equal(together, alone)
    torch.testing.assert_close(together, plain(x), rtol=1e-6, atol=1e-7)
    assert fn(x.view(5, 9, width)).shape == (5, 9, width)


@pytest.mark.usefixtures("eight_threads")
@pytest.mark.parametrize(("fn", "plain"), FUNCTIONS)
@pytest.mark.parametrize("width", [1024, 200, 96, 40000])
def test_rows_do_not_depend_on_the_thread_split(fn, plain, width: int) -> None:
    """Prompts of 13..200 tokens (test_batch_invariance's) alone and together on 8 threads, each
    token's row [width]: a qwen4exp hyper-connection gate (1024), one padded to 256, a tiny
    Gemma's FFN gate (96, GELU splits from 16384 values on), one over 16384 values (each row then
    split over the threads by its own size only)."""
    lengths = [13, 59, 106, 153, 200] if width < 40000 else [1, 2, 3]
    x = torch.randn(sum(lengths), width, generator=torch.Generator().manual_seed(width)) * 3
    together = fn(x)
    alone = torch.cat([fn(part) for part in x.split(lengths)])
    assert torch.equal(together, alone)
    torch.testing.assert_close(together, plain(x), rtol=1e-6, atol=1e-6)
