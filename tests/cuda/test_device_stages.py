"""Virtual stages (``--virtual-stages``, mgserve/pipeline/staged.py): the device model run as 2, 3
and 6 stages of a layer pipeline on one device, hand-offs copied through host staging buffers,
gives bitwise the one-stage run's logits at every step and so its greedy tokens, for a dense model
(gemma3: 7 layers; qwen3: 2, so 2 stages at most) and qwen4exp (8 layers: the hyper-connection
streams cross the links, the PLE rows reach the PLE layer's stage), with 1 and 5 sessions whose
prompt chunks share steps with the others' decode tokens.

On the CPU with the torch backend (CI); with ``-m gpu`` on the CUDA backend, where each stage has
a stream of its own and the copies go through pinned memory ordered by events, against the
one-stage run (whose tokens equal those of its decode graphs, what ``serve`` runs without
``--virtual-stages``), and the stages' own decode graphs (one capture across their streams and
copies) give the same tokens.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mgserve.core.gguf.reader import GGUFFile
from mgserve.pipeline.staged import StagedLM, balanced_ranges, check_ranges, virtual_stages
from mgserve.pipeline.stages import split_shares
from tests.cuda.stages_drive import greedy, record_logits

N_DECODE = 8
_ONE_STAGE: dict[tuple[str, int, str], tuple[list[list[int]], list[torch.Tensor]]] = {}
CASES = [("qwen3", 2), ("gemma3", 2), ("gemma3", 3), ("gemma3", 6), ("qwen4exp", 2),
         ("qwen4exp", 3), ("qwen4exp", 6)]  # fmt: skip


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: the torch backend's row-blocked products are ~100x slower when the
    2-core CI machine is oversubscribed (another test run beside this one)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _run(path: Path, backend, device: torch.device, stages: int, sessions: int, graphs: bool,
         micro: int = 1):  # fmt: skip
    """(tokens, logits per step) of the greedy run on ``stages`` stages (1: the model itself),
    decode steps in ``micro`` micro-batches."""
    from mgserve.cuda.backend import load_device_model
    from mgserve.cuda.runner import DeviceRunner

    g = GGUFFile(path)
    model = load_device_model(g, backend, device, 5, 64)
    if stages > 1:
        model = virtual_stages(model, balanced_ranges(g, stages), device, micro)
    logits = [] if graphs else record_logits(model)  # a captured graph replays unseen
    runner = DeviceRunner(model, device, graphs=graphs)
    tokens = greedy(runner, sessions, N_DECODE)
    if stages > 1 and not graphs:  # every link carried every token's residual stream
        rows = sum(7 + 2 * s + N_DECODE for s in range(sessions))
        per_token = 4 * math.prod(model.handoff_shape)
        assert model.transport.link_bytes == [rows * per_token] * (stages - 1)
    return tokens, logits


def _check(arch: str, stages: int, tmp_path: Path, backend, device: torch.device) -> None:
    from tests.cuda.test_device_models import _export

    path = _export(arch, tmp_path)
    for sessions in (1, 5):  # the 1 and 5 concurrent sessions
        key = (arch, sessions, device.type)  # the one-stage run, once per module
        if key not in _ONE_STAGE:
            _ONE_STAGE[key] = _run(path, backend, device, 1, sessions, graphs=False)
            if device.type == "cuda":  # what serve runs: its tokens, from decode graphs
                graphed, _ = _run(path, backend, device, 1, sessions, graphs=True)
                assert graphed == _ONE_STAGE[key][0], (arch, sessions)
        want, want_logits = _ONE_STAGE[key]
        got, got_logits = _run(path, backend, device, stages, sessions, graphs=False)
        assert got == want, (arch, stages, sessions)
        if device.type == "cuda":  # one decode graph across the stages' streams and copies
            graphed, _ = _run(path, backend, device, stages, sessions, graphs=True)
            assert graphed == want, (arch, stages, sessions, "graphs")
        if sessions > 1:  # decode steps as micro-batches of sessions in flight (micro.py)
            for graphs in (False, True) if device.type == "cuda" else (False,):
                micro, micro_logits = _run(path, backend, device, stages, sessions, graphs, 3)
                assert micro == want, (arch, stages, sessions, "micro-batches", graphs)
                for a, b in zip(micro_logits, want_logits, strict=not graphs):
                    assert torch.equal(a, b), (arch, stages, "micro-batches", (a - b).abs().max())
        assert len(got_logits) == len(want_logits)
        for a, b in zip(got_logits, want_logits, strict=True):
            assert torch.equal(a, b), (arch, stages, sessions, (a - b).abs().max())


@pytest.mark.parametrize(("arch", "stages"), CASES)
def test_virtual_stages_are_bitwise_one_stage_cpu(arch: str, stages: int, tmp_path: Path) -> None:
    from mgserve.cuda.backend import torch_backend

    _check(arch, stages, tmp_path, torch_backend(), torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize(("arch", "stages"), CASES)
def test_virtual_stages_are_bitwise_one_stage_gpu(
    arch: str, stages: int, tmp_path: Path, cuda_ops
) -> None:
    _check(arch, stages, tmp_path, cuda_ops, torch.device("cuda", 0))


def test_stages_of_a_stage_plan_cpu(tmp_path: Path) -> None:
    """The ranges of a ``StagePlan`` (here qwen4exp over 3 GPUs, --tensor-split 1,2,1: layers
    0-1, 2-5, 6-7, the PLE layer's rows on stage 0) run as stages: the one-stage tokens."""
    from mgserve.config import Settings
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.cuda.runner import DeviceRunner
    from mgserve.pipeline.costs import ModelCosts
    from mgserve.pipeline.stages import stage_plan
    from mgserve.pipeline.transport import LocalTransport
    from tests.cuda.test_device_models import _export

    path, cpu = _export("qwen4exp", tmp_path), torch.device("cpu")
    g = GGUFFile(path)
    s = Settings(parallel=3, ctx_size=64)
    plan = stage_plan(ModelCosts.of(g), s, range(3), [(1 << 30, "test")] * 3, split=[1, 2, 1])
    assert plan.ranges == [(0, 2), (2, 6), (6, 8)]
    model = StagedLM(
        load_device_model(g, torch_backend(), cpu, 3, 64), plan, LocalTransport(3, cpu)
    )
    got = greedy(DeviceRunner(model, cpu, graphs=False), 3, N_DECODE)
    want = greedy(DeviceRunner(load_device_model(g, torch_backend(), cpu, 3, 64), cpu), 3, N_DECODE)
    assert got == want


def test_stage_ranges(tmp_path: Path) -> None:
    """The balanced split covers the layers, a stage per layer at most; bad ranges are refused;
    a model without stages is refused."""
    from tests.cuda.test_device_models import _export

    g = GGUFFile(_export("qwen4exp", tmp_path))
    for n in (1, 2, 3, 8):
        r = balanced_ranges(g, n)
        assert len(r) == n and check_ranges(r, 8) == r
    with pytest.raises(ValueError, match="1 to 8"):
        balanced_ranges(g, 9)
    assert check_ranges(split_shares(8, [1, 1, 1]), 8) == [(0, 3), (3, 5), (5, 8)]
    for bad in ([(0, 3), (4, 8)], [(0, 4), (4, 4), (4, 8)], [(0, 7)]):
        with pytest.raises(ValueError, match="stage ranges"):
            check_ranges(bad, 8)
    with pytest.raises(ValueError, match="does not run as pipeline stages"):
        StagedLM(object(), [(0, 8)], None)  # type: ignore[arg-type]


def test_virtual_stages_setting(tmp_path: Path) -> None:
    """--virtual-stages is at least 1, only for the GPU runner (the CPU engine refuses it) and
    not beside the prefill lane (whose thread would run steps through the stages at once)."""
    from mgserve.config import Settings
    from mgserve.core.engine.factory import load_engine
    from tests.cuda.test_device_models import _export

    assert Settings().virtual_stages == 1
    with pytest.raises(ValueError, match="virtual-stages must be >= 1"):
        Settings(virtual_stages=0)
    path = str(_export("qwen3", tmp_path))
    with pytest.raises(ValueError, match="--virtual-stages is for the GPU runner"):
        load_engine(Settings(model=path, device="cpu", virtual_stages=2))
    with pytest.raises(ValueError, match="does not run with --prefill-lane on"):
        load_engine(Settings(model=path, device="cpu", virtual_stages=2, prefill_lane="on"))


@pytest.mark.gpu
def test_serve_engine_with_virtual_stages_gpu(tmp_path: Path) -> None:
    """``load_engine`` with --virtual-stages 3 on the GPU: the runner's model is 3 stages of
    qwen4exp (decode graphs across them), and a request's greedy tokens are the one-stage
    engine's."""
    import asyncio

    from mgserve.config import Settings
    from mgserve.core.engine.contract import Request
    from mgserve.core.engine.factory import load_engine
    from mgserve.cuda.graphs import GraphDecode
    from tests.cuda.stages_drive import GREEDY, prompt
    from tests.cuda.test_device_models import _export

    path = str(_export("qwen4exp", tmp_path))

    def tokens(stages: int) -> list[int]:
        s = Settings(model=path, device="cuda", parallel=2, ctx_size=128, virtual_stages=stages)
        loaded = load_engine(s)
        runner = loaded.engine._runner
        if stages > 1:
            assert isinstance(runner.model, StagedLM) and len(runner.model.ranges) == stages
            assert isinstance(runner.decode, GraphDecode)

        async def ask() -> list[int]:
            await loaded.engine.start()
            try:
                req = Request("a", prompt(0, 9, 300), GREEDY, 8, ignore_eos=True)
                return [e.token async for e in loaded.engine.submit(req) if e.token is not None]
            finally:
                await loaded.engine.stop()

        return asyncio.run(ask())

    want = tokens(1)
    assert tokens(3) == want and len(want) == 8


def test_drafts_across_virtual_stages_cpu(tmp_path: Path) -> None:
    """Speculation's verify steps through 3 stages of qwen4exp (recurrent: a partly accepted
    step rolls back the states the stages' layers logged): the tokens are plain decode's, greedy
    and sampled (test_device_drafts.py's checks on the staged runner; the plain tokens are the
    one-stage ones by the tests above)."""
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.cuda.runner import DeviceRunner
    from tests.cuda.test_device_drafts import _check as check_drafts
    from tests.cuda.test_device_models import _export

    g, cpu = GGUFFile(_export("qwen4exp", tmp_path)), torch.device("cpu")
    model = load_device_model(g, torch_backend(), cpu, 3, 128)
    check_drafts(DeviceRunner(virtual_stages(model, balanced_ranges(g, 3), cpu), cpu, graphs=False))


def test_per_stage_figures_reach_metrics(tmp_path: Path) -> None:
    """The staged model's timing (pipeline/timing.py) through EngineMetrics' collector: steps,
    each stage busy and its bubbles, bytes and seconds per link (CPU: by the clock)."""
    from prometheus_client import generate_latest

    from mgserve.core.engine.metrics import EngineMetrics
    from mgserve.core.engine.scheduler import Scheduler
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.cuda.runner import DeviceRunner
    from tests.cuda.test_device_models import _export

    g = GGUFFile(_export("qwen4exp", tmp_path))
    device = torch.device("cpu")
    model = virtual_stages(
        load_device_model(g, torch_backend(), device, 3, 64), [(0, 3), (3, 8)], device
    )
    runner = DeviceRunner(model, device, graphs=False)
    greedy(runner, 2, 4)
    metrics = EngineMetrics(Scheduler(3, 64, 16), lambda: 0, None, runner)
    text = generate_latest(metrics.registry).decode()

    def value(name: str) -> float:
        line = next(
            x for x in text.splitlines() if x.startswith(name + " ") or x.startswith(name + "{")
        )
        return float(line.rsplit(" ", 1)[1])

    steps = value("mgserve_pipeline_steps_total")
    assert steps == model.timing.steps >= 4
    for stage in ("0", "1"):
        busy = value(f'mgserve_pipeline_stage_busy_seconds_total{{stage="{stage}"}}')
        frac = value(f'mgserve_pipeline_stage_busy_fraction{{stage="{stage}"}}')
        bubble = value(f'mgserve_pipeline_bubble_fraction{{stage="{stage}"}}')
        assert busy > 0 and 0 < frac <= 1 and bubble == pytest.approx(1 - frac)
    assert value('mgserve_pipeline_link_bytes_total{link="0-1"}') == model.transport.link_bytes[0]
    assert value('mgserve_pipeline_link_seconds_total{link="0-1"}') > 0


def test_a_replayed_graph_counts_its_step_and_link_bytes(tmp_path: Path) -> None:
    """A decode graph's replay runs no Python of the stages: ``StagedLM.replayed`` (called by
    GraphDecode) counts the step and each link's bytes for the replayed rows, as an eager step of
    those rows would have."""
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.cuda.runner import DeviceRunner
    from tests.cuda.test_device_models import _export

    g, cpu = GGUFFile(_export("qwen4exp", tmp_path)), torch.device("cpu")
    ranges = [(0, 3), (3, 5), (5, 8)]
    model = virtual_stages(load_device_model(g, torch_backend(), cpu, 3, 64), ranges, cpu)
    greedy(DeviceRunner(model, cpu, graphs=False), 2, 2)
    steps, carried = model.timing.steps, list(model.transport.link_bytes)
    model.replayed(3)
    per_row = 4 * math.prod(model.handoff_shape)
    assert model.timing.steps == steps + 1
    assert model.transport.link_bytes == [b + 3 * per_row for b in carried]
