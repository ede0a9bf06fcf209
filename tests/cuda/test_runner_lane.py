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
