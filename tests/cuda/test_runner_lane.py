"""``Lane.pace`` (cuda/runner_lane.py): a step that samples nothing leaves its end event, and the
next such step waits for it, so the host runs at most one step ahead of the GPU; a step that
samples (``sync``) waits for everything and leaves nothing pending. Fake events stand in for
CUDA's: the order of records and waits is what is checked."""

from __future__ import annotations

import pytest
import torch

from mgserve.cuda.runner_lane import Lane
from mgserve.cuda.sampling import HostBuffers

LOG: list[str] = []


class FakeEvent:
    made = 0

    def __init__(self) -> None:
        FakeEvent.made += 1
        self.name = f"e{FakeEvent.made}"

    def record(self) -> None:
        LOG.append(f"record {self.name}")

    def synchronize(self) -> None:
        LOG.append(f"wait {self.name}")


@pytest.fixture
def lane(monkeypatch: pytest.MonkeyPatch) -> Lane:
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    LOG.clear()
    FakeEvent.made = 0
    return Lane(None, HostBuffers.allocate(2, 0, pin=False), FakeEvent())  # done: e1


def test_each_unsampled_step_waits_for_the_one_before(lane: Lane) -> None:
    lane.pace()  # chunk 1: nothing before it to wait for
    lane.pace()  # chunk 2: waits for chunk 1's end
    lane.pace()  # chunk 3: waits for chunk 2's end
    assert LOG == ["record e2", "record e3", "wait e2", "record e4", "wait e3"]


def test_a_sampling_step_leaves_nothing_pending(lane: Lane) -> None:
    lane.pace()
    lane.sync()  # a step that samples waits for everything
    assert lane.ahead is None
    lane.pace()  # the next chunk has nothing to wait for
    assert LOG == ["record e2", "record e1", "wait e1", "record e3"]


def test_off_the_gpu_nothing_is_recorded() -> None:
    cpu = Lane(None, HostBuffers.allocate(2, 0, pin=False), None)
    cpu.pace()
    cpu.sync()
    assert cpu.ahead is None


def test_a_launch_window_waits_for_the_layer_depth_back(lane: Lane) -> None:
    from mgserve.cuda.runner_lane import LaunchWindow

    w = LaunchWindow(2)
    for _ in range(4):
        w.mark()
    # e1 is the lane's; layers 1..4 record e2..e5, and from the third on wait two layers back
    assert LOG == ["record e2", "record e3", "record e4", "wait e2", "record e5", "wait e3"]
    with pytest.raises(ValueError, match="at least one layer"):
        LaunchWindow(0)


def test_only_a_lane_with_layers_ahead_on_the_gpu_bounds_its_chunks(lane: Lane) -> None:
    from mgserve.cuda.runner_lane import LaunchWindow

    assert lane.window() is None  # the decoders' lane: unbounded
    lane.layers_ahead = 2
    w = lane.window()
    assert isinstance(w, LaunchWindow) and w.depth == 2
    cpu = Lane(None, HostBuffers.allocate(2, 0, pin=False), None, layers_ahead=2)
    assert cpu.window() is None


@pytest.mark.parametrize("arch", ["qwen4exp", "qwen3next", "qwen3"])
def test_every_model_marks_each_layer_of_a_prompt_chunk(arch: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from mgserve.core.engine.contract import SamplingParams, SeqWork
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.cuda.runner import DeviceRunner
    from tests.cuda.test_device_models import _export

    cpu = torch.device("cpu")
    model = load_device_model(GGUFFile(_export(arch, tmp_path)), torch_backend(), cpu, 1, 64)
    runner = DeviceRunner(model, cpu, graphs=False)

    class Counting:
        marks = 0

        def mark(self) -> None:
            Counting.marks += 1

    work = SeqWork(slot=0, request_id="r", tokens=(5, 6, 7), start=0, sample=True,
                   sampling=SamplingParams(temperature=0.0), new_sequence=True)  # fmt: skip
    runner._prefill([work], Counting())  # type: ignore[arg-type]
    assert Counting.marks == model.spec.n_layer
