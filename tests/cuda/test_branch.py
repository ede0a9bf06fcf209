"""Decode steps' side chains (ops/branch.py) on the GPU: a fork runs on a stream of its own and the
join orders what follows after it; the hyper-connection mix with a separate inject launch, whole
eager decode steps and graph-replayed decode steps of qwen4exp files give the same bits with the
side chains on and off (same kernels, same inputs: only their overlap changes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cuda.test_fused_decode import (
    _model,
    _pool_tensors,
    _step,
    assert_same_runs,
    assert_same_steps,
)
from tests.cuda.test_hc import REAL
from tests.cuda.test_hc_torch import EPS, make_case, make_streams

pytestmark = pytest.mark.gpu

PROMPTS = [[(7 * i + 3) % 250 + 3 for i in range(40)], [(5 * i + 1) % 250 + 3 for i in range(37)]]


def test_fork_runs_beside_and_join_orders(cuda_ops) -> None:
    """Inside a decode step the side chain is queued on another stream (of the main one's
    priority), starts after the main stream's earlier work, and the main stream's later work
    starts after it: a slow side product read right after the join is complete."""
    b = cuda_ops
    a = torch.randn(2048, 2048, device="cuda")
    with b.path.step("decode"):
        main = torch.cuda.current_stream()
        x = a * 2.0  # main: what the side chain reads
        side = b.branch.fork()
        assert side.forked
        with side:
            assert torch.cuda.current_stream() != main
            assert torch.cuda.current_stream().priority == main.priority
            y = x
            for _ in range(8):  # long enough to still run when the main stream gets to the join
                y = (y @ a) / 64.0
        side.join()
        got = y + 1.0
    assert torch.cuda.current_stream() == main
    want = x.clone()
    for _ in range(8):
        want = (want @ a) / 64.0
    assert torch.equal(got, want + 1.0)


def test_side_streams_are_their_own(cuda_ops) -> None:
    """A side stream is made for its main stream, not drawn from torch's stream pool (which
    hands the same streams out again to other code), and a stream registered ``inline_on``
    (a green context's) forks inline."""
    b = cuda_ops
    with b.path.step("decode"):
        main = torch.cuda.current_stream()
        side = b.branch.fork()
        side.join()
        assert side.side is not None
        pooled = {torch.cuda.Stream(priority=p).cuda_stream for p in (0, -1) for _ in range(80)}
        assert side.side.cuda_stream not in pooled and side.side.cuda_stream != main.cuda_stream
        assert b.branch.fork().side.cuda_stream == side.side.cuda_stream  # one per main stream
        lane = torch.cuda.Stream()
        b.branch.inline_on(lane)
        with torch.cuda.stream(lane):
            assert not b.branch.fork().forked


def test_no_fork_outside_decode_or_switched_off(cuda_ops, monkeypatch: pytest.MonkeyPatch) -> None:
    b = cuda_ops
    assert not b.branch.fork().forked  # outside a runner step
    with b.path.step("prompt"):
        assert not b.branch.fork().forked
    monkeypatch.setattr(b.branch, "decode", False)
    with b.path.step("decode"):
        side = b.branch.fork()
        with side:
            assert not side.forked and torch.cuda.current_stream() == torch.cuda.current_stream()
        side.join()


@pytest.mark.parametrize("n", [1, 3, 8])
def test_hc_inject_beside_down_bitwise(cuda_ops, n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Down Q4_K, inject Q6_K (llama-quantize's mix in its "more bits" layers: two hc_down
    launches): the combine-mix in a decode step with the inject's launch on the side stream
    equals it inline, bitwise."""
    hc, d, r = REAL
    case = make_case(hc, d, r, ("Q4_K", "Q5_0", "Q6_K"), seed=7, device="cuda")
    g = torch.Generator().manual_seed(n)
    x = make_streams(n, hc, d, seed=n).cuda()
    out = torch.randn(n, d, generator=g).cuda()
    inj_prev = (torch.rand(n, hc, generator=g) * 2).cuda()
    hcc = cuda_ops.hc
    assert hcc.branch is cuda_ops.branch
    results = []
    for on in (True, False):
        monkeypatch.setattr(cuda_ops.branch, "decode", on)
        with cuda_ops.path.step("decode"):
            results.append(
                hcc.combine_mix(x, out, inj_prev, case.norm, case.down, case.up, case.inject, EPS)
            )
    for name, a, b in zip(("x", "mixed", "inject"), *results, strict=True):
        assert torch.equal(a, b), f"N={n}: {name} differs with the inject beside the down"


def _models(kernels: Any, path: Path, int8: bool) -> list[Any]:
    from mgserve.cuda.backend import cuda_backend

    models = []
    for on in (True, False):
        m = _model(path, cuda_backend(kernels=kernels, int8=int8), 160)
        m.backend.branch.decode = on
        models.append(m)
    return models


def _path(which: str, tmp_path: Path) -> tuple[Path, bool]:
    if which == "tiny":
        from tests.cuda.test_device_models import _export

        return _export("qwen4exp", tmp_path), False
    from tests.core.qwen4exp_export import write_synth_qwen4exp

    return write_synth_qwen4exp(tmp_path / "synth.gguf"), True


@pytest.mark.parametrize("which", ["tiny", "synth"])
def test_eager_decode_steps_bitwise(kernels, which: str, tmp_path: Path) -> None:
    """Two sessions' prompt, then 9 eager decode steps (past QSA block ends): logits of every
    step and every pool tensor equal with the side chains on and off."""
    path, int8 = _path(which, tmp_path)
    assert_same_runs(_models(kernels, path, int8), PROMPTS, which)


@pytest.mark.parametrize("which", ["tiny", "synth"])
def test_graph_decode_steps_bitwise(kernels, which: str, tmp_path: Path) -> None:
    """The same steps replayed from CUDA graphs (captured with the side chains as parallel
    branches, and without): logits and every pool tensor bitwise equal; one GraphDecode keeps a
    graph per setting of the switch."""
    from mgserve.cuda.graphs import DecodeInputs, GraphDecode

    path, int8 = _path(which, tmp_path)
    prompts = PROMPTS
    models = _models(kernels, path, int8)
    outs = []
    for m in models:
        for s in range(2):
            m.begin_sequence(s)
        with torch.no_grad():
            with m.backend.path.step("prompt"):
                m.forward(_step(m, [(s, p, 0) for s, p in enumerate(prompts)], False))
            dev = torch.device("cuda", 0)
            graphs = GraphDecode(m, dev, 3, getattr(m, "decode_extra_shape", None))
            pos, logits = [len(p) for p in prompts], []
            for i in range(9):
                toks = [(17 * i + 5 * s) % 200 + 3 for s in range(2)]
                extra = m.step_extra([[t] for t in toks], [0, 1])
                with m.backend.path.step("decode"):
                    got = graphs(DecodeInputs(toks, list(pos), [0, 1], extra))
                logits.append(got.clone())
                pos = [p + 1 for p in pos]
            torch.cuda.synchronize()
            outs.append((logits, _pool_tensors(m.pools), graphs))
    (got, pools_on, graphs_on), (want, pools_off, _) = outs
    assert_same_steps(got, want, [pools_on, pools_off], f"{which} graph")
    n_graphs = len(graphs_on._graphs)
    models[0].backend.branch.decode = False  # a graph of its own for the other setting
    with torch.no_grad(), models[0].backend.path.step("decode"):
        graphs_on(DecodeInputs([5, 6], [60, 60], [0, 1], models[0].step_extra([[5], [6]], [0, 1])))
    assert len(graphs_on._graphs) == n_graphs + 1
    # the bench's GPU-alone figure of a step (after the comparisons: replays advance the state)
    ms = graphs_on.replay_ms(2, reps=4)
    assert ms is not None and 0 < ms < 1000
    assert graphs_on.replay_ms(7) is None  # bucket 7: never captured
