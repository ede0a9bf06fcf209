"""Speculation's verify steps on the device runner (``SeqWork.n_draft``): a session's drafts are
decode rows of its slot in the same step, so the tokens it gets are exactly plain decode's,
drafts right, wrong or partly right, greedy or sampled with penalties.

Driven step by step through ``DeviceRunner.run`` (the scheduler's side is tested with the
reference runner in tests/core). On the CPU with the torch backend (CI); with ``-m gpu`` on the
CUDA backend with decode graphs, where a verify step replays the graph of its row count and each
row's logits must be bitwise those of the plain decode step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from mgserve.core.engine.contract import SamplingParams, ScheduledBatch, SeqWork
from mgserve.core.gguf.reader import GGUFFile

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=11,
                         repeat_penalty=1.3, repeat_last_n=6)  # fmt: skip
N_GEN = 24
Drafts = Callable[[list[int]], list[int]]  # generated so far -> drafts for the next step


class _Driver:
    def __init__(self, runner) -> None:
        self.runner, self.step = runner, 0

    def run(self, *work: SeqWork):
        self.step += 1
        return self.runner.run(ScheduledBatch(self.step, work)).results

    def generate(self, slot: int, prompt: list[int], p: SamplingParams, drafts: Drafts | None,
                 accepted: list[int] | None = None) -> list[int]:  # fmt: skip
        """``N_GEN`` tokens of one session; ``accepted`` collects drafts accepted per step."""
        (r,) = self.run(SeqWork(slot, "r", tuple(prompt), 0, True, p, new_sequence=True))
        out, start = [r.token], len(prompt)
        while len(out) < N_GEN:
            d = drafts(out)[: N_GEN - len(out) - 1] if drafts else []
            res = self.run(SeqWork(slot, "r", (out[-1], *d), start, True, p, n_draft=len(d)))
            assert 1 <= len(res) <= 1 + len(d)
            assert all(x.slot == slot for x in res)
            # every emitted token but the last is the draft it was checked against
            assert [x.token for x in res[:-1]] == d[: len(res) - 1]
            if accepted is not None:
                accepted.append(len(res) - 1)
            out += [x.token for x in res]
            start += len(res)
        return out


def _runner(arch: str, tmp_path: Path, device: torch.device, backend, graphs: bool):
    from mgserve.cuda.backend import load_device_model
    from mgserve.cuda.runner import DeviceRunner
    from tests.cuda.test_device_models import _export

    path = _export(arch, tmp_path)
    model = load_device_model(GGUFFile(path), backend, device, 3, 128)
    return DeviceRunner(model, device, graphs=graphs)


def _check(runner) -> None:
    for p in (GREEDY, SAMPLED):
        _check_params(_Driver(runner), p)


def _check_params(drive: _Driver, p: SamplingParams) -> None:
    prompt = list(range(30, 50))
    plain = drive.generate(0, prompt, p, None)
    right = drive.generate(1, prompt, p, lambda out: plain[len(out) : len(out) + 5])
    assert right == plain
    acc: list[int] = []

    def half_wrong(out: list[int]) -> list[int]:  # 3 right, then garbage
        good = plain[len(out) : len(out) + 3]
        return good + [(t + 1) % 100 + 3 for t in plain[len(out) + 3 : len(out) + 7]]

    assert drive.generate(2, prompt, p, half_wrong, acc) == plain
    assert acc[0] == 3  # the matching prefix, no more
    wrong = drive.generate(0, prompt, p, lambda out: [(out[-1] + 7) % 90 + 5] * 4)
    assert wrong == plain


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_drafts_give_plain_decodes_tokens_cpu(arch: str, tmp_path: Path) -> None:
    from mgserve.cuda.backend import torch_backend

    runner = _runner(arch, tmp_path, torch.device("cpu"), torch_backend(), graphs=False)
    assert runner.supports_drafts
    _check(runner)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_drafts_give_plain_decodes_tokens_gpu(arch: str, tmp_path: Path, cuda_ops) -> None:
    runner = _runner(arch, tmp_path, torch.device("cuda", 0), cuda_ops, graphs=True)
    _check(runner)
    assert max(runner.decode.captured) >= 4  # verify rows (1 + up to 5) went through graphs


def test_a_recurrent_runner_refuses_drafts(tmp_path: Path) -> None:
    from mgserve.cuda.backend import torch_backend

    runner = _runner("qwen3next", tmp_path, torch.device("cpu"), torch_backend(), graphs=False)
    assert not runner.supports_drafts
    drive = _Driver(runner)
    (r,) = drive.run(SeqWork(0, "r", (5, 6, 7), 0, True, GREEDY, new_sequence=True))
    with pytest.raises(ValueError, match="cannot roll back"):
        drive.run(SeqWork(0, "r", (r.token, 9, 9), 3, True, GREEDY, n_draft=2))
