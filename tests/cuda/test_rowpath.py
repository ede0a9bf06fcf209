"""RowPath (ops/rowpath.py): which products a step's rows take. Outside a runner step the size
decides (8 tokens or fewer: the decode kernels); inside one the step's kind does, at any size, and
the kind is restored after the step (also when it raises). The runner marks prompt steps and
decode steps (torch backend on the CPU; the CUDA families read the same object)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mgserve.core.engine.contract import SamplingParams, ScheduledBatch, SeqWork
from mgserve.core.gguf.reader import GGUFFile
from mgserve.cuda.ops.linear_tuning import MAX_MATVEC_TOKENS
from mgserve.cuda.ops.rowpath import RowPath
from tests.cuda.test_device_runner import _export


def test_size_decides_outside_a_step_and_the_kind_inside() -> None:
    path = RowPath()
    assert path.decode_kernels(1) and path.decode_kernels(MAX_MATVEC_TOKENS)
    assert not path.decode_kernels(MAX_MATVEC_TOKENS + 1)
    with path.step("prompt"):
        assert not path.decode_kernels(1)  # a 1-token prompt chunk takes the GEMMs too
        with path.step("decode"):
            assert path.decode_kernels(100)  # 100 decoding sessions: still the decode kernels
        assert path.kind == "prompt"
    assert path.kind is None
    with pytest.raises(RuntimeError), path.step("decode"):
        raise RuntimeError("boom")
    assert path.kind is None


def test_runner_marks_prompt_and_decode_steps(tmp_path: Path) -> None:
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.cuda.runner import DeviceRunner

    cpu = torch.device("cpu")
    model = load_device_model(
        GGUFFile(_export("qwen3", tmp_path / "m.gguf")), torch_backend(), cpu, 2, 32
    )
    runner = DeviceRunner(model, cpu, graphs=False)
    kinds: list[str | None] = []
    forward = model.forward

    def spy(step):  # type: ignore[no-untyped-def]
        kinds.append(model.backend.path.kind)
        return forward(step)

    model.forward = spy  # type: ignore[method-assign]
    greedy = SamplingParams(temperature=0.0)
    runner.run(ScheduledBatch(1, (SeqWork(0, "a", (5, 6, 7), 0, True, greedy, new_sequence=True),)))
    runner.run(ScheduledBatch(2, (SeqWork(0, "a", (9,), 3, True, greedy),)))
    assert kinds == ["prompt", "decode"]
    assert model.backend.path.kind is None
