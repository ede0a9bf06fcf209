"""The server's warm-up (cuda/warmup.py): a prompt, decode steps and a verify step through the
device runner in slot 0 before the server says ready. It must leave no trace: a request afterwards
in the same slot gets exactly the tokens it gets from a fresh runner. On the CPU with the torch
backend; with ``-m gpu`` on CUDA with decode graphs, where it must also have captured them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mgserve.core.engine.contract import SamplingParams
from mgserve.cuda.warmup import warm_up
from tests.cuda.test_device_drafts import GREEDY, SAMPLED, _Driver, _runner

PROMPT = [11 + i * 5 % 53 for i in range(30)]


def _tokens(runner, p: SamplingParams) -> list[int]:
    return _Driver(runner).generate(0, PROMPT, p, None)


def _check(arch: str, tmp_path: Path, device: torch.device, backend, graphs: bool) -> None:
    fresh = _runner(arch, tmp_path, device, backend, graphs)
    want = {p: _tokens(fresh, p) for p in (GREEDY, SAMPLED)}
    warmed = _runner(arch, tmp_path, device, backend, graphs)
    warm_up(warmed, warmed.model.spec.n_vocab, 128, 40, spec_k=4)
    for p in (GREEDY, SAMPLED):
        assert _tokens(warmed, p) == want[p]
    if graphs:
        assert 1 in warmed.decode.captured


def test_warm_up_fits_a_small_context(tmp_path: Path) -> None:
    """A context smaller than a batch: the prompt and drafts shrink to fit its positions."""
    from mgserve.cuda.backend import torch_backend

    runner = _runner("qwen3", tmp_path, torch.device("cpu"), torch_backend(), graphs=False)
    seen: list[int] = []
    run = runner.run
    runner.run = lambda b: seen.extend(w.start + len(w.tokens) for w in b.work) or run(b)
    warm_up(runner, runner.model.spec.n_vocab, 12, 512, spec_k=16)
    assert seen and max(seen) <= 12


@pytest.mark.parametrize("arch", ["qwen3", "qwen4exp"])
def test_warm_up_leaves_no_trace_cpu(arch: str, tmp_path: Path) -> None:
    from mgserve.cuda.backend import torch_backend

    _check(arch, tmp_path, torch.device("cpu"), torch_backend(), graphs=False)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "qwen4exp"])
def test_warm_up_leaves_no_trace_gpu(arch: str, tmp_path: Path, cuda_ops) -> None:
    _check(arch, tmp_path, torch.device("cuda", 0), cuda_ops, graphs=True)


@pytest.mark.gpu
def test_the_gpu_server_engine_warms_up_before_ready(tmp_path: Path) -> None:
    """``load_engine`` on CUDA (what ``mgserve serve --device cuda`` loads while /health says
    loading): the warm-up compiled and captured before it returned, and a request afterwards gets
    the tokens of a runner that never warmed up."""
    import asyncio

    from mgserve.config import Settings
    from mgserve.core.engine.contract import Request
    from mgserve.core.engine.factory import load_engine
    from mgserve.cuda.backend import cuda_backend
    from tests.cuda.test_device_models import _export

    path = _export("qwen3", tmp_path)
    loaded = load_engine(Settings(model=str(path), device="cuda", parallel=2, ctx_size=128))
    runner = loaded.engine._runner
    assert 1 in runner.decode.captured  # the bucket of one decode row, before any request

    async def ask() -> list[int]:
        await loaded.engine.start()
        try:
            req = Request("a", PROMPT, GREEDY, 8, ignore_eos=True)
            stream = loaded.engine.submit(req)
            return [e.token async for e in stream if e.token is not None]
        finally:
            await loaded.engine.stop()

    got = asyncio.run(ask())
    fresh = _runner("qwen3", tmp_path, torch.device("cuda", 0), cuda_backend(0), graphs=True)
    want = _Driver(fresh).generate(0, PROMPT, GREEDY, None)[: len(got)]
    assert got == want and len(got) == 8


@pytest.mark.parametrize("lanes", [True, False])
def test_with_the_prefill_lane_prompts_are_lane_batches(lanes: bool) -> None:
    """A runner with the prefill lane gets the warm-up's prompt and its freed slot as lane
    batches (their stream's kernels and scratch, as serving uses them) and the decode and
    verify steps as the decoders'; a runner without lanes gets no lane batch."""
    from mgserve.core.engine.contract import SeqResult, StepResult

    class Recorder:
        supports_drafts = True

        def __init__(self) -> None:
            self.lanes, self.seen = lanes, []

        def run(self, batch):
            self.seen.append((batch.lane, bool(batch.work) and len(batch.work[0].tokens) > 1,
                              bool(batch.freed_slots)))  # fmt: skip
            return StepResult(
                batch.step, [SeqResult(w.slot, w.request_id, 5, None, ()) for w in batch.work]
            )

    r = Recorder()
    warm_up(r, 100, 128, 40, spec_k=4)
    head, prompt, *steps, verify, freed = r.seen  # 24 + 16 prompt tokens
    assert head == prompt == (lanes, True, False) and freed == (lanes, False, True)
    assert all(s == (False, False, False) for s in steps) and verify == (False, True, False)
