"""The ple family (``Ple`` on the torch backend's linear and norm families) against
``mgserve.core.reference.ple`` on the CPU (runs in CI): the gate bitwise the reference's
``gated_values``; the conv, decoded token by token for a batch of slots, bitwise the reference's
``dilated_conv`` of each session, and a prefill split across calls equal to one call."""

from __future__ import annotations

import numpy as np
import torch

from mgserve.core.reference import ple
from mgserve.cuda.backend import Backend, torch_backend
from tests.cuda.test_hc_torch import quant_weight

HC, D, EMB, K, DIL, EPS = 3, 64, 96, 3, 2, 1e-6
HIST = (K - 1) * DIL


def weights(seed: int, device: str | torch.device = "cpu") -> tuple[tuple, ple.PleWeights]:
    """(device arguments of ``Ple.gated`` after x and emb, the reference's weights)."""
    rng = np.random.default_rng(seed)

    def randn(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, np.float32)

    key, key_ref = quant_weight(
        "key", "F32", rng.standard_normal((HC * D, EMB), np.float32), device
    )
    value, value_ref = quant_weight(
        "value", "F32", rng.standard_normal((D, EMB), np.float32), device
    )
    norms = [torch.from_numpy(1 + 0.1 * rng.standard_normal((HC, D), np.float32)) for _ in range(3)]
    conv = torch.from_numpy(rng.standard_normal((HC * D, K), np.float32))
    ref = ple.PleWeights(key_ref, value_ref, *norms, conv)
    return (key, value, *(n.to(device) for n in norms), EPS), ref


def inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HC, D, generator=g), torch.randn(n, EMB, generator=g)  # x, emb


def test_gate_is_reference() -> None:
    b: Backend = torch_backend()
    args, ref = weights(1)
    x, emb = inputs(7, 1)
    gated, conv_in = b.ple.gated(x, emb, *args)
    want_gated, want_conv_in = ple.gated_values(x, emb, ref, EPS)
    assert torch.equal(gated, want_gated) and torch.equal(conv_in, want_conv_in)


def test_conv_decode_is_reference_per_session() -> None:
    """Three slots decode five tokens, batched; each slot's outputs and history equal the
    reference conv of its own sequence, and the other slots' histories stay."""
    b = torch_backend()
    g = torch.Generator().manual_seed(2)
    conv = torch.randn(HC * D, K, generator=g)
    hist = torch.randn(5, HIST, HC * D, generator=g)
    start = hist.clone()
    slots = torch.tensor([3, 0, 4], dtype=torch.int32)
    xs = torch.randn(5, 3, HC * D, generator=g)  # [steps, B, C]
    outs = torch.stack([b.ple.conv_decode(xs[t], hist, slots, conv, DIL) for t in range(5)])
    for i, s in enumerate(slots.tolist()):
        want, want_hist = ple.dilated_conv(xs[:, i], start[s], conv, DIL)
        assert torch.equal(outs[:, i], want), f"slot {s}: outputs differ"
        assert torch.equal(hist[s], want_hist), f"slot {s}: history differs"
    assert torch.equal(hist[[1, 2]], start[[1, 2]]), "untouched slots changed"


def test_conv_prefill_split_is_one_call() -> None:
    b = torch_backend()
    g = torch.Generator().manual_seed(3)
    conv = torch.randn(HC * D, K, generator=g)
    x = torch.randn(11, HC * D, generator=g)
    h1, h2 = torch.zeros(2, HIST, HC * D), torch.zeros(2, HIST, HC * D)
    whole = b.ple.conv_prefill(x, h1, 1, conv, DIL)
    parts = torch.cat([b.ple.conv_prefill(x[a:z], h2, 1, conv, DIL) for a, z in ((0, 4), (4, 11))])
    assert torch.equal(whole, parts) and torch.equal(h1, h2)
    want, _ = ple.dilated_conv(x, torch.zeros(HIST, HC * D), conv, DIL)
    assert torch.equal(whole, want)


def test_step_extra_decode_rows_are_the_loops(tmp_path) -> None:
    """qwen4exp's ``step_extra`` for a decode step (one token per slot: every session's
    contexts at once) gives the rows and the slot histories of the per-slot loop, which a step
    with a slot's drafts (a slot twice: its rows chain) still takes; EOS in the histories."""
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.cuda.backend import load_device_model
    from tests.cuda.test_device_models import _export

    path = _export("qwen4exp", tmp_path)
    models = [
        load_device_model(GGUFFile(path), torch_backend(), torch.device("cpu"), 4, 64)
        for _ in range(2)
    ]
    eos = models[0].qp.ple.eos
    for m in models:
        for s in range(4):
            m.begin_sequence(s)
        m.step_extra([[11, 12], [eos, 30], [40, eos]], [0, 1, 2])  # histories with EOS
    fast = models[0].step_extra([[7], [8], [9], [10]], [0, 1, 2, 3])
    loop = models[1].step_extra([[7], [8], [9], [10], [5]], [0, 1, 2, 3, 0])  # slot 0 twice
    assert torch.equal(fast, loop[:4])
    for s in (1, 2, 3):
        np.testing.assert_array_equal(models[0].host_state(s), models[1].host_state(s))
    np.testing.assert_array_equal(models[0].host_state(0), [12, 7])
