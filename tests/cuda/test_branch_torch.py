"""The branch family off the GPU (ops/branch.py): the torch backend's forks are inline (``with``
and ``join`` do nothing, the ops run in order on the current stream) in any kind of step, and a
hybrid model's decode on it is unchanged by the fork sites (tests/cuda/test_device_models.py
compares it with the reference models)."""

from __future__ import annotations

import pytest
import torch

from mgserve.cuda.backend import torch_backend
from mgserve.cuda.ops.branch import Branches, Fork
from mgserve.cuda.ops.rowpath import RowPath


def test_torch_backend_forks_inline() -> None:
    b = torch_backend()
    assert b.branch.path is b.path and not b.branch.decode
    for kind in (None, "prompt", "decode"):
        b.branch.decode = True  # switched on: still no GPU to fork on
        if kind is None:
            side = b.branch.fork()
        else:
            with b.path.step(kind):  # type: ignore[arg-type]
                side = b.branch.fork()
        assert not side.forked and not b.branch.forks()
        with side:
            y = torch.ones(3) * 2
        side.join()
        side.join()  # a second join does nothing
        assert torch.equal(y, torch.full((3,), 2.0))


def test_forks_only_in_decode_steps_when_switched_on() -> None:
    """Which steps fork, decided without a GPU (the device is only named here)."""
    path = RowPath()
    br = Branches(path, torch.device("cuda", 0))
    assert br.decode and not br.forks()  # outside a runner step
    with path.step("prompt"):
        assert not br.forks()
    with path.step("decode"):
        assert br.forks()
        br.decode = False
        assert not br.forks()


def test_a_joined_side_chain_cannot_be_entered_again() -> None:
    """A forked chain joined, then entered again, would queue work the main stream no longer
    waits for: refused."""
    side = Fork(None, None)
    side.join()
    with side:  # inline: nothing to refuse
        pass
    fake = Fork(object(), object())  # type: ignore[arg-type]
    fake.joined = True
    with pytest.raises(RuntimeError, match="already joined"), fake:
        pass
