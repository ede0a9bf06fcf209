"""Micro-batches of a pipeline's decode steps (mgserve/pipeline/micro.py): which steps split, the
groups, the sub-steps' rows, and a staged model that really runs its decode steps group by group
(the tokens and logits equal to one stage's are in tests/cuda/test_device_stages.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mgserve.cuda.models.base import Step
from mgserve.cuda.ops.chains import Chains
from mgserve.pipeline.micro import groups, splittable, sub_step


def _step(n: int, **kw) -> Step:
    rows = torch.arange(n)
    return Step(rows * 3, rows.int() + 10, rows.int(), decode=True, lengths=rows.int() + 11, **kw)


def test_groups() -> None:
    assert groups(5, 2) == [(0, 3), (3, 5)]
    assert groups(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert groups(2, 4) == [(0, 1), (1, 2)]
    assert groups(4, 1) == [(0, 4)]


def test_which_steps_split() -> None:
    assert splittable(_step(4))
    assert splittable(_step(4, chains=Chains.of([0, 1, 2, 3], torch.device("cpu"))))
    assert splittable(_step(4, extra=torch.zeros(4, 8)))
    assert not splittable(_step(4, chains=Chains.of([0, 0, 1, 2], torch.device("cpu"))))  # a run
    assert not splittable(_step(4, log=[]))  # a rollback's log names rows of the whole step
    assert not splittable(_step(4, logit_rows=torch.tensor([3])))
    assert not splittable(_step(4, extra=[1, 2]))
    prompt = _step(4)
    prompt.decode = False
    assert not splittable(prompt)


def test_a_sub_step_is_its_rows() -> None:
    step = _step(5, chains=Chains.of([4, 3, 2, 1, 0], torch.device("cpu")), extra=torch.eye(5))
    sub = sub_step(step, 2, 4)
    assert sub.tokens.tolist() == [6, 9] and sub.pos.tolist() == [12, 13]
    assert sub.slots.tolist() == [2, 3] and sub.lengths.tolist() == [13, 14]
    assert torch.equal(sub.extra, torch.eye(5)[2:4])
    assert sub.chains.last.tolist() == [0, 1] and sub.chains.runs.tolist() == [1, 1]


def test_a_staged_decode_step_runs_group_by_group(tmp_path: Path) -> None:
    """Three sessions' decode steps through 2 stages in 3 micro-batches: stage 0 embeds each
    session's group alone, each link carries every row once, and the step's logits are the
    groups' in order (bitwise the unsplit step's)."""
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.cuda.runner import DeviceRunner
    from mgserve.pipeline.staged import virtual_stages
    from tests.cuda.stages_drive import greedy
    from tests.cuda.test_device_models import _export

    g, cpu = GGUFFile(_export("qwen4exp", tmp_path)), torch.device("cpu")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {}
        for micro in (1, 3):
            model = virtual_stages(load_device_model(g, torch_backend(), cpu, 3, 64), [(0, 4),
                                   (4, 8)], cpu, micro)  # fmt: skip
            seen: list[int] = []
            stage_in = model.model.stage_in

            def counted(step, stage_in=stage_in, seen=seen):
                seen.append(step.tokens.shape[0])
                return stage_in(step)

            model.model.stage_in = counted
            out[micro] = (greedy(DeviceRunner(model, cpu, graphs=False), 3, 3), seen,
                          list(model.transport.link_bytes))  # fmt: skip
        tokens, seen, carried = out[3]
        assert tokens == out[1][0] and carried == out[1][2]
        assert 3 not in seen[3:] and seen.count(1) > out[1][1].count(1)  # groups of one session
    finally:
        torch.set_num_threads(n)


def test_micro_batches_must_be_positive(tmp_path: Path) -> None:
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.pipeline.staged import virtual_stages
    from tests.cuda.test_device_models import _export

    g, cpu = GGUFFile(_export("qwen3", tmp_path)), torch.device("cpu")
    with pytest.raises(ValueError, match="micro-batches must be >= 1"):
        virtual_stages(load_device_model(g, torch_backend(), cpu, 3, 64), [(0, 1), (1, 2)], cpu, 0)
