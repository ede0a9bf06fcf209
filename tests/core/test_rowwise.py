"""rowwise: elementwise transcendental functions whose rows do not depend on their neighbours."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mgserve.core.reference import rowwise

FUNCTIONS = [
    (rowwise.exp, torch.exp),
    (rowwise.sigmoid, torch.sigmoid),
    (rowwise.softplus, F.softplus),
    (rowwise.silu, F.silu),
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
