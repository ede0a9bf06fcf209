"""The torch rope family (``RopeTorch``) against ``reference.ops.rope`` on the CPU (runs in CI): to
~1e-6, since the angles are computed per call instead of from the reference's cached table."""

from __future__ import annotations

import pytest
import torch

from mgserve.core.reference import ops
from mgserve.cuda.backend import Backend, torch_backend
from tests.cuda.test_deltanet_torch import close, gen


@pytest.fixture(scope="module")
def so() -> Backend:
    return torch_backend()


ROPE_CASES = [  # (D, n_rot, neox, base, scale, freq factors)
    (256, 64, True, 1e7, 1.0, False),
    (128, 128, False, 10000.0, 1.0, False),
    (64, 64, True, 500000.0, 0.25, True),
    (96, 32, False, 10000.0, 1.0, True),
]


@pytest.mark.parametrize(("d", "n_rot", "neox", "base", "scale", "ff"), ROPE_CASES)
def test_rope(
    so: Backend, d: int, n_rot: int, neox: bool, base: float, scale: float, ff: bool
) -> None:
    g = gen(2)
    x = torch.randn(6, 3, d, generator=g)
    pos = torch.tensor([0, 1, 4095, 4096, 70000, 131071], dtype=torch.int32)
    factors = torch.rand(n_rot // 2, generator=g) * 8 + 1 if ff else None
    kw = {"n_rot": n_rot, "base": base, "neox": neox, "scale": scale, "freq_factors": factors}
    got = so.rope.apply(x, pos, **kw)  # type: ignore[arg-type]
    want = ops.rope(x, pos.long(), **kw)  # type: ignore[arg-type]
    close("rope", got, want, atol=2e-6)
    close("pass-through dims", got[..., n_rot:], x[..., n_rot:], atol=0)
    fused = so.rope.norm_apply(x, torch.randn(d, generator=g), 1e-6, pos, **kw)  # type: ignore[arg-type]
    assert fused.shape == x.shape


def test_rms_norm_rope_is_norm_then_rope(so: Backend) -> None:
    g = gen(3)
    x = torch.randn(4, 16, 256, generator=g)
    w = torch.randn(256, generator=g)
    pos = torch.tensor([3, 9, 100, 5000], dtype=torch.int32)
    kw = {"n_rot": 64, "base": 1e7, "neox": True}
    want = ops.rope(ops.rms_norm(x, w, 1e-6), pos.long(), **kw)  # type: ignore[arg-type]
    close("rms_norm_rope", so.rope.norm_apply(x, w, 1e-6, pos, **kw), want, atol=2e-6)  # type: ignore[arg-type]


def test_rope_bad_args(so: Backend) -> None:
    x, pos = torch.zeros(2, 3, 8), torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="n_rot"):
        so.rope.apply(x, pos, n_rot=10, base=1e4, neox=True)
    with pytest.raises(ValueError, match="pos"):
        so.rope.apply(x, pos[:1], n_rot=8, base=1e4, neox=True)
    with pytest.raises(ValueError, match=r"\[N, H, D\]"):
        so.rope.apply(x[0], pos, n_rot=8, base=1e4, neox=True)
