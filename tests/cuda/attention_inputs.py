"""Inputs and the closeness check shared by the GPU tests of the KV, attention and QSA families
(test_kv.py, test_attention.py, test_qsa.py, test_qsa_select.py): seeded random tensors on the
GPU, random K/V pools, and the per-row relative error bound."""

from __future__ import annotations

import torch

from mgserve.cuda.pools import KVLayer

DEV = "cuda"
RTOL = 2e-5  # decode kernel vs fp32 torch, relative to each row's max |output|
RTOL_FLASH = 5e-3  # flash prefill kernel (f16 operands; test_attention_prefill.py says why)
HI, DI = 4, 128  # QSA indexer heads and their dim (qwen4exp)


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
