"""The chunked delta rule of prefill reorganised for a GPU (ops/deltanet_chunked.py: few batched
ops per block of chunks, two products per chunk).

CPU (CI): chunk 128 over 4096 tokens with strong decay against the reference (float64, chunk 64)
within 1e-4, and its op count. GPU (marked): chunk 128 on the device against the CPU, timed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mgserve.core.reference import deltanet
from mgserve.cuda.ops.deltanet_chunked import delta_rule_chunked_device
from tests.cuda.test_moe_prefill import OpCount, gpu_ms


def delta_inputs(t: int, h: int, d: int, decay: float, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k (L2-normed, q scaled), v, log decay g (about -decay per token), beta, state."""
    g = torch.Generator().manual_seed(seed)
    q = deltanet.l2_norm(torch.randn(t, h, d, generator=g), 1e-6) * d**-0.5
    k = deltanet.l2_norm(torch.randn(t, h, d, generator=g), 1e-6)
    v = torch.randn(t, h, d, generator=g)
    lg = -F.softplus(torch.randn(t, h, generator=g)) * decay
    beta = torch.sigmoid(torch.randn(t, h, generator=g) + 1)
    state = torch.randn(h, d, d, generator=g) * 0.3
    return q, k, v, lg, beta, state


# ---- delta rule (CPU) --------------------------------------------------------------------------


@pytest.mark.parametrize("decay", [0.01, 1.0, 20.0])
def test_delta_chunk128_matches_reference(decay: float) -> None:
    """chunk 128 over 4096 tokens (one batched block) == the reference chunked rule in float64
    (chunk 64) within 1e-4, also with ~-20 log decay per token (cumulative ~-1800 per chunk:
    the float64 cumulative sums keep exp(G_i - G_j) exact)."""
    q, k, v, lg, beta, state = delta_inputs(4096, 2, 128, decay, seed=int(decay * 100))
    o, s = delta_rule_chunked_device(q, k, v, lg, beta, state, chunk=128)
    want_o, want_s = deltanet.delta_rule_chunked(
        *(x.double()[None] for x in (q, k, v, lg, beta, state)), chunk=64
    )
    err_o = (o.double() - want_o[0]).abs().max().item()
    err_s = (s.double() - want_s[0]).abs().max().item()
    assert err_o <= 1e-4 and err_s <= 1e-4, (
        f"decay {decay}: max error o {err_o:.2e}, state {err_s:.2e} (|o| max "
        f"{want_o.abs().max().item():.2f}, |S| max {want_s.abs().max().item():.2f})"
    )


def test_delta_ragged_tail_and_tiny_chunks() -> None:
    """T not a multiple of the chunk (zero-padded tail), chunk 1, and chunk > T."""
    q, k, v, lg, beta, state = delta_inputs(77, 3, 16, 2.0, seed=3)
    want_o, want_s = deltanet.delta_rule_recurrent(
        *(x.double()[None] for x in (q, k, v, lg, beta, state))
    )
    for chunk in (1, 10, 128):
        o, s = delta_rule_chunked_device(q, k, v, lg, beta, state, chunk=chunk)
        err = max((o.double() - want_o[0]).abs().max().item(), (s - want_s[0]).abs().max().item())
        assert err <= 2e-5, f"chunk {chunk}: max error {err:.2e}"


@pytest.mark.parametrize(("chunk", "budget"), [(64, 180), (128, 115)])
def test_delta_op_count(chunk: int, budget: int) -> None:
    """4096 tokens x 48 heads: two products per chunk plus a fixed ~40 ops (was ~640 at chunk
    64: four products and six elementwise ops per chunk)."""
    q, k, v, lg, beta, state = delta_inputs(4096, 48, 8, 1.0, seed=4)  # d 8: op count only
    with OpCount() as c:
        delta_rule_chunked_device(q, k, v, lg, beta, state, chunk=chunk)
    n_chunks = 4096 // chunk
    assert c.ops["bmm"] + c.ops["baddbmm_"] <= 2 * n_chunks + 4, dict(c.ops)
    assert c.total <= budget, f"{c.total} ops: {dict(c.ops)}"


@pytest.mark.gpu
def test_delta_prefill_chunk128_on_device() -> None:
    """delta_rule_chunked_device on CUDA at qwen4exp's heads (48 x 128), 4096 tokens, chunk 128,
    against the CPU float64 reference (chunk 64) within 1e-4; timing printed for 64 and 128."""
    q, k, v, lg, beta, state = delta_inputs(4096, 48, 128, 1.0, seed=6)
    dev = [t.cuda() for t in (q, k, v, lg, beta, state)]
    o, s = delta_rule_chunked_device(*dev, chunk=128)
    heads = [0, 17, 47]  # the float64 reference on three heads keeps the test fast
    sub = [t[:, heads].double()[None] for t in (q, k, v, lg, beta)]
    want_o, want_s = deltanet.delta_rule_chunked(*sub, state[heads].double()[None], chunk=64)
    err_o = (o.cpu()[:, heads].double() - want_o[0]).abs().max().item()
    err_s = (s.cpu()[heads].double() - want_s[0]).abs().max().item()
    assert err_o <= 1e-4 and err_s <= 1e-4, f"max error o {err_o:.2e}, state {err_s:.2e}"
    for chunk in (64, 128):
        ms = gpu_ms(lambda c=chunk: delta_rule_chunked_device(*dev, chunk=c))
        print(f"delta rule 4096 tokens x 48 heads, chunk {chunk}: {ms:.2f} ms per layer")
