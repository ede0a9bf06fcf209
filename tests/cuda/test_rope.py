"""The CUDA rope family (``RopeCuda``: rms_norm_rope_f32) against the CPU reference and the torch
family: it rounds cos/sin and its products exactly as the reference, so it agrees to float
rounding of the angles (~1e-7)."""

from __future__ import annotations

import pytest
import torch

from mgserve.core.reference import ops
from tests.cuda.test_deltanet import close, dev, rand

pytestmark = pytest.mark.gpu


# -- rope --------------------------------------------------------------------------------------

ROPE_CASES = [  # (H, D, n_rot, neox, base, scale, freq factors)
    (16, 256, 64, True, 1e7, 1.0, False),  # qwen4exp / qwen3next attention: partial NeoX
    (8, 128, 128, False, 10000.0, 1.0, False),  # llama "norm" pairs over the whole head
    (4, 64, 64, True, 500000.0, 0.25, True),  # llama 3 freq factors, linear scaling
    (3, 96, 32, False, 10000.0, 1.0, True),
    (5, 40, 6, True, 10000.0, 1.0, False),  # odd: D not a multiple of 32
]
POSITIONS = [0, 1, 2, 4095, 4096, 70000, 131071, 262143]


@pytest.mark.parametrize(("h", "d", "n_rot", "neox", "base", "scale", "ff"), ROPE_CASES)
def test_rope_matches_reference(
    cuda_ops, h: int, d: int, n_rot: int, neox: bool, base: float, scale: float, ff: bool
) -> None:
    x = rand(len(POSITIONS), h, d, seed=10)
    pos = torch.tensor(POSITIONS, dtype=torch.int32, device=dev())
    factors = (torch.rand(n_rot // 2, device=dev()) * 8 + 1) if ff else None
    kw = {"n_rot": n_rot, "base": base, "neox": neox, "scale": scale, "freq_factors": factors}
    got = cuda_ops.rope.apply(x, pos, **kw)
    cpu_kw = dict(kw, freq_factors=factors.cpu() if factors is not None else None)
    want = ops.rope(x.cpu(), pos.cpu().long(), **cpu_kw)
    close("rope vs reference", got, want, 2e-6, 0)
    assert torch.equal(got[..., n_rot:], x[..., n_rot:]), "dims >= n_rot must pass through"


@pytest.mark.parametrize("n", [1, 5, 200])
@pytest.mark.parametrize(("h", "d", "n_rot", "neox"), [(16, 256, 64, True), (2, 128, 128, False)])
def test_rms_norm_rope(cuda_ops, torch_ops, n: int, h: int, d: int, n_rot: int, neox: bool) -> None:
    x = rand(n, h, d, seed=11, scale=2.0)
    w = rand(d, seed=12)
    pos = torch.randint(0, 262144, (n,), dtype=torch.int32, device=dev())
    kw = {"n_rot": n_rot, "base": 1e7, "neox": neox}
    got = cuda_ops.rope.norm_apply(x, w, 1e-6, pos, **kw)
    close("rms_norm_rope", got, torch_ops.rope.norm_apply(x, w, 1e-6, pos, **kw), 2e-5, 1e-5)


def test_rope_strided_heads(cuda_ops, torch_ops) -> None:
    """qwen3next's q heads are the first halves of [N, H, 2D] rows: rotated in place of a copy."""
    qg = rand(3, 4, 2 * 128, seed=13)
    q = qg[..., :128]
    pos = torch.tensor([5, 6, 7], dtype=torch.int32, device=dev())
    w = rand(128, seed=14)
    kw = {"n_rot": 64, "base": 1e7, "neox": True}
    close(
        "rope view", cuda_ops.rope.apply(q, pos, **kw), torch_ops.rope.apply(q, pos, **kw), 2e-6, 0
    )
    got = cuda_ops.rope.norm_apply(q, w, 1e-6, pos, **kw)
    close("norm+rope view", got, torch_ops.rope.norm_apply(q, w, 1e-6, pos, **kw), 2e-5, 1e-5)
