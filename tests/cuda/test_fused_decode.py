"""The fused decode kernels (``cuda_backend(fused_decode=True)``, the default) against the unfused
path (``fused_decode=False``) on the same GPU tensors, bitwise: int8 activations written by their
producers (the DeltaNet gated norm, the shared expert's silu * up, the attention's sigmoid gate)
instead of a ``quantize_q8`` launch, QSA block keys pooled in one kernel instead of ~20 torch ops
and two kernels, DeltaNet gates made inside the step's kernel (the fused router and the shared
expert in the down kernel: test_fused_router.py). Then whole decode steps of two
qwen4exp files (logits and every state pool bitwise), and the launches of one eager decode step
of the tiny qwen4exp (torch.profiler).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cuda.test_deltanet import rand

pytestmark = pytest.mark.gpu

N_TOKENS = (1, 3, 8)
EPS = 1e-6


@pytest.fixture(scope="module")
def unfused(kernels):
    from mgserve.cuda.backend import cuda_backend

    return cuda_backend(kernels=kernels, int8=True, fused_decode=False)


def _same_xq(got: Any, y: torch.Tensor, ops: Any, what: str) -> None:
    """got (a producer's int8 form of y) is what ``linear.quantize(y)`` makes, bit for bit."""
    want = ops.linear.quantize(y.reshape(y.shape[0], -1))
    assert got is not None and want is not None, what
    assert torch.equal(got.q, want.q), f"{what}: int8 values differ"
    assert torch.equal(got.d, want.d), f"{what}: scales differ"


@pytest.mark.parametrize("n", N_TOKENS)
@pytest.mark.parametrize("dv", [128, 64, 320, 36])
def test_gated_norm_writes_xq(cuda_ops_int8, n: int, dv: int) -> None:
    """norm.gated_xq: the fp32 output of ``gated`` and quantize's int8 of it, with and without
    the head permutation; 320: rows of 80 float4 on 64 threads (a warp half live in round 2);
    36: no whole groups of 32, so no int8 form."""
    ops, hv = cuda_ops_int8, 6
    o, z, w = rand(n, hv, dv, seed=1), rand(n, hv * dv, seed=2), rand(dv, seed=3)
    o[:, 0, :32] = 0.0  # a group of zeros: scale 0, quants 0
    heads = torch.tensor([3, 0, 5, 1, 4, 2], dtype=torch.int32, device="cuda")
    for hd in (None, heads):
        y, yq = ops.norm.gated_xq(o, z, w, EPS, True, hd, xq=True)
        assert torch.equal(y, ops.norm.gated(o, z, w, EPS, True, hd))
        if dv % 32:
            assert yq is None
        else:
            _same_xq(yq, y, ops, f"gated dv={dv} heads={hd is not None}")
        assert ops.norm.gated_xq(o, z, w, EPS, True, hd, xq=False)[1] is None


@pytest.mark.parametrize("n", N_TOKENS)
@pytest.mark.parametrize("f", [640, 256, 2080])
def test_act_writes_xq(cuda_ops_int8, n: int, f: int) -> None:
    """silu_mul_xq on the column halves of one [N, 2F] product (640: 160 float4 of a 256-thread
    CTA, 2080: a second CTA with a part-live warp) and sigmoid_mul_xq on per-head [q | gate]
    halves: the fp32 output of the plain op and quantize's int8 of it."""
    ops = cuda_ops_int8
    gu = rand(n, 2 * f, seed=4, scale=3.0)
    gu[:, f : f + 32] = 0.0  # up = 0 over one group: scale 0
    out, q = ops.act.silu_mul_xq(gu[:, :f], gu[:, f:], xq=True)
    assert torch.equal(out, ops.act.silu_mul(gu[:, :f], gu[:, f:]))
    _same_xq(q, out, ops, f"silu_mul F={f}")
    dh = f // 8 - (f // 8) % 32 or 32
    qg, o = rand(n, 4, 2 * dh, seed=5, scale=4.0), rand(n, 4, dh, seed=6)
    got, gq = ops.act.sigmoid_mul_xq(qg[..., dh:], o, xq=True)
    assert torch.equal(got, ops.act.sigmoid_mul(qg[..., dh:], o))
    _same_xq(gq, got, ops, f"sigmoid_mul dh={dh}")


def test_fused_xq_only_where_quantize_runs(cuda_ops, cuda_ops_int8, unfused) -> None:
    """Producers write int8 exactly where ``linear.quantize`` would round (int8 mode, 1..8
    decode rows, k % 32), and never with fused_decode off."""
    assert cuda_ops_int8.linear.fused_xq(8, 256)
    assert not cuda_ops_int8.linear.fused_xq(9, 256)
    assert not cuda_ops_int8.linear.fused_xq(1, 250)
    assert not cuda_ops.linear.fused_xq(1, 256)  # fp32 mode
    assert not unfused.linear.fused_xq(1, 256)
    with cuda_ops_int8.path.step("prompt"):
        assert not cuda_ops_int8.linear.fused_xq(3, 256)


@pytest.mark.parametrize("dim", [64, 30])
def test_qsa_keys_decode_kernel(cuda_ops, unfused, dim: int) -> None:
    """Decode steps of three sessions (slots out of order, blocks completing at different steps)
    through qsa_keys_decode_f32 and through the torch ops + norm + rope kernels: the same pending
    and block pools, bitwise (dim 30: the scalar norm path)."""
    r, n_blocks, rot = 4, 12, {"n_rot": 16, "base": 1e4, "scale": 1.0}
    g = torch.Generator(device="cuda").manual_seed(7)
    raw = torch.randn(20, 3, dim, generator=g, device="cuda")
    k_norm = torch.rand(dim, generator=g, device="cuda") + 0.5
    pools = [
        (torch.randn(4, r, dim, device="cuda"), torch.randn(4, n_blocks, dim, device="cuda"))
        for _ in range(2)
    ]
    pools[1] = (pools[0][0].clone(), pools[0][1].clone())
    slots = torch.tensor([2, 0, 3], dtype=torch.int32, device="cuda")
    for t in range(20):
        pos = torch.tensor([t, t + 1, t + 6], dtype=torch.int32, device="cuda")
        for b, (pending, blocks) in ((cuda_ops, pools[0]), (unfused, pools[1])):
            b.qsa_keys.write_decode(raw[t], pending, blocks, slots, pos, k_norm, EPS, **rot)
    for name, a, b in zip(("pending", "blocks"), pools[0], pools[1], strict=True):
        assert torch.equal(a, b), f"{name}: max diff {(a - b).abs().max().item():.2e}"


@pytest.mark.parametrize("n", N_TOKENS)
@pytest.mark.parametrize("head_dim", [128, 64])
def test_step_makes_its_gates(cuda_ops, unfused, n: int, head_dim: int) -> None:
    """step_gates in one launch (delta_step_gates_f32) == gates then step: output and state,
    bitwise; beta and alpha as column halves of one product, inputs past softplus' threshold."""
    hk, hv = 2, 6
    c = (2 * hk + hv) * head_dim
    y, ba = rand(n, c, seed=8), rand(n, 2 * hv, seed=9, scale=12.0)
    dt_bias, a = rand(hv, seed=10, scale=4.0), -rand(hv, seed=11).abs()
    n_slots = max(5, n)
    ssm = rand(n_slots, hv, head_dim, head_dim, seed=12, scale=0.1)
    # distinct slots out of order (3 is prime to 5 and 8)
    slots = (torch.arange(n, device="cuda") * 3 % n_slots).to(torch.int32)
    dims = {"n_k_heads": hk, "n_v_heads": hv, "head_dim": head_dim, "eps": EPS}
    states, outs = [ssm.clone(), ssm.clone()], []
    for b, st in zip((cuda_ops, unfused), states, strict=True):
        outs.append(b.deltanet.step_gates(y, ba[:, :hv], ba[:, hv:], dt_bias, a, st, slots, **dims))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(states[0], states[1])


# -- whole decode steps ------------------------------------------------------------------------


def _model(path: Path, backend: Any, n_ctx: int) -> Any:
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.cuda.backend import load_device_model

    return load_device_model(GGUFFile(path), backend, torch.device("cuda", 0), 3, n_ctx)


def _step(model: Any, spans: list[tuple[int, list[int], int]], decode: bool) -> Any:
    from mgserve.cuda.models.base import Span, Step

    dev = torch.device("cuda", 0)
    toks = [t for _, ts, _ in spans for t in ts]
    pos = [s + i for _, ts, s in spans for i in range(len(ts))]
    st = Step(
        torch.tensor(toks, device=dev),
        torch.tensor(pos, dtype=torch.int32, device=dev),
        torch.tensor([sl for sl, ts, _ in spans for _ in ts], dtype=torch.int32, device=dev),
        decode=decode,
        spans=tuple(Span(sl, s, len(ts)) for sl, ts, s in spans),
        extra=model.step_extra([ts for _, ts, _ in spans], [sl for sl, _, _ in spans]),
    )
    if st.extra is not None:
        st.extra = st.extra.to(dev)
    if decode:  # from the host, as graphs.py brings them
        st.lengths = st.pos + 1
    return st


def _run(model: Any, prompts: list[list[int]], n_decode: int) -> list[torch.Tensor]:
    """Logits of a two-session prompt step, then n_decode decode steps of both sessions."""
    b = model.backend
    for s in range(len(prompts)):
        model.begin_sequence(s)
    with torch.no_grad():
        with b.path.step("prompt"):
            out = [model.forward(_step(model, [(s, p, 0) for s, p in enumerate(prompts)], False))]
        pos = [len(p) for p in prompts]
        for i in range(n_decode):
            spans = [(s, [(17 * i + 5 * s) % 200 + 3], pos[s]) for s in range(len(prompts))]
            with b.path.step("decode"):
                out.append(model.forward(_step(model, spans, True)))
            pos = [p + 1 for p in pos]
    return out


def _pool_tensors(obj: Any, name: str = "pools") -> dict[str, torch.Tensor]:
    """Every tensor held by the model's state pools, by path."""
    found: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        found[name] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            found.update(_pool_tensors(v, f"{name}[{k}]"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found.update(_pool_tensors(v, f"{name}[{i}]"))
    elif hasattr(obj, "__dict__"):
        for k, v in vars(obj).items():
            found.update(_pool_tensors(v, f"{name}.{k}"))
    return found


@pytest.mark.parametrize("which", ["tiny", "synth"])
def test_decode_steps_bitwise_unfused(kernels, which: str, tmp_path: Path) -> None:
    """The tiny qwen4exp (F32 weights, fp32 decode) and a quantized one in the real files' type
    mix (int8 decode: every fused producer runs): 40 + 37-token prompts, then decode steps past
    several QSA block ends; logits of every step and every pool tensor equal bitwise between
    fused_decode on and off."""
    from mgserve.cuda.backend import cuda_backend

    if which == "tiny":
        from tests.cuda.test_device_models import _export

        path, int8 = _export("qwen4exp", tmp_path), False
    else:
        from tests.core.qwen4exp_export import write_synth_qwen4exp

        path, int8 = write_synth_qwen4exp(tmp_path / "synth.gguf"), True
    prompts = [[(7 * i + 3) % 250 + 3 for i in range(40)]]
    prompts.append([(5 * i + 1) % 250 + 3 for i in range(37)])
    models = [
        _model(path, cuda_backend(kernels=kernels, int8=int8, fused_decode=f), 160)
        for f in (True, False)
    ]
    assert_same_runs(models, prompts, which)


def test_decode_steps_bitwise_emit_xq(kernels, tmp_path: Path) -> None:
    """The quantized qwen4exp (int8 decode) with the clustered mixes writing their int8 form
    (``hc.emit_xq``, off by default) against without: logits of every step and every pool
    tensor bitwise, and the mixes did write it."""
    from mgserve.cuda.backend import cuda_backend
    from tests.core.qwen4exp_export import write_synth_qwen4exp

    if not kernels.clusters:
        pytest.skip("no thread block clusters before sm_90")
    path = write_synth_qwen4exp(tmp_path / "synth.gguf")
    models = [_model(path, cuda_backend(kernels=kernels, int8=True), 160) for _ in range(2)]
    models[0].backend.hc.emit_xq = True
    offers: list[int] = []
    q8 = models[0].backend.linear.q8
    real = q8.offer
    q8.offer = lambda x, xq: (offers.append(1), real(x, xq))[1]  # type: ignore[method-assign]
    prompts = [[(7 * i + 3) % 250 + 3 for i in range(40)]]
    prompts.append([(5 * i + 1) % 250 + 3 for i in range(37)])
    assert_same_runs(models, prompts, "emit_xq")
    assert offers, "no mix wrote its int8 form"


def assert_same_runs(models: list[Any], prompts: list[list[int]], which: str) -> None:
    """Two models' runs of ``prompts`` then 9 decode steps (``_run``): the logits of every step
    and every pool tensor equal bitwise."""
    got, want = (_run(m, prompts, 9) for m in models)
    assert_same_steps(got, want, [_pool_tensors(m.pools) for m in models], which)


def assert_same_steps(got: list[torch.Tensor], want: list[torch.Tensor],
                      pools: list[dict[str, torch.Tensor]], which: str) -> None:  # fmt: skip
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{which} step {i}: max diff {(a - b).abs().max().item():.2e}"
    assert pools[0].keys() == pools[1].keys() and pools[0]
    for k, a in pools[0].items():
        assert torch.equal(a, pools[1][k]), f"{which}: {k} differs"


def _launches(model: Any) -> tuple[int, int]:
    """(our kernels, torch's kernels) of one eager decode step of one session (after a prompt
    and a warm-up step: nothing is compiled or cached during the profile)."""
    from torch.profiler import ProfilerActivity, profile

    b = model.backend
    model.begin_sequence(0)
    with torch.no_grad():
        with b.path.step("prompt"):
            model.forward(_step(model, [(0, list(range(3, 14)), 0)], False))
        with b.path.step("decode"):
            model.forward(_step(model, [(0, [20], 11)], True))
            st = _step(model, [(0, [21], 12)], True)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                model.forward(st)
                torch.cuda.synchronize()
    names = [
        ev.name
        for ev in prof.events()
        if ev.device_type.name == "CUDA" and not ev.name.startswith(("Memcpy", "Memset"))
    ]
    ours = sum(1 for n in names if re.fullmatch(r"\w+", n))  # extern "C" names; torch's are C++
    return ours, len(names) - ours


def test_decode_step_launches(kernels, tmp_path: Path) -> None:
    """One eager decode step of the tiny qwen4exp (8 layers: 6 DeltaNet, 2 QSA attention, PLE on
    layer 1), fp32 decode: our kernels 191 -> 167 (DeltaNet gates inside the step: -6; QSA keys'
    norm and rope kernels replaced by one: -2; the router, its routing and the shared expert's
    gate in one launch, the shared expert added by the down kernel: -2 a MoE layer), torch's
    kernels down by the QSA keys' ~20 ops per attention layer (what remains is PLE's). Counted on
    the CPU by tracing the launches; the torch counts are only bounded here, as a composite op may
    launch more than one kernel."""
    from mgserve.cuda.backend import cuda_backend
    from tests.cuda.test_device_models import _export

    path = _export("qwen4exp", tmp_path)
    counts = {
        f: _launches(_model(path, cuda_backend(kernels=kernels, fused_decode=f), 160))
        for f in (True, False)
    }
    (ours, theirs), (ours_old, theirs_old) = counts[True], counts[False]
    report = f"fused {ours} + {theirs} torch, unfused {ours_old} + {theirs_old} torch"
    assert (ours, ours_old) == (167, 191), report
    assert theirs <= theirs_old - 2 * 20, report
    assert theirs < 50, report  # PLE's gate and conv (35 aten ops on the CPU)
