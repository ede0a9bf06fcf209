"""Speculation's verify steps on the device runner (``SeqWork.n_draft``): a session's drafts are
decode rows of its slot in the same step, so the tokens it gets are exactly plain decode's,
drafts right, wrong or partly right, greedy or sampled with penalties; for the recurrent models
(qwen3next, qwen4exp) the state after a partly accepted step is plain decode's, bitwise.

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
        _check_together(_Driver(runner), p)


def _check_together(drive: _Driver, p: SamplingParams) -> None:
    """Three sessions in the same steps: one plain, one whose drafts are half right, one whose
    drafts are all right: several runs in a step, rolled back together or not at all."""
    prompt = list(range(30, 50))
    plain = drive.generate(0, prompt, p, None)
    drafts: dict[int, Drafts] = {
        0: lambda out: [],
        1: lambda out: plain[len(out) : len(out) + 2] + [(plain[len(out)] + 5) % 90 + 3] * 2,
        2: lambda out: plain[len(out) : len(out) + 3],
    }
    outs: dict[int, list[int]] = {}
    for slot in drafts:
        (r,) = drive.run(SeqWork(slot, "r", tuple(prompt), 0, True, p, new_sequence=True))
        outs[slot] = [r.token]
    while any(len(o) < N_GEN for o in outs.values()):
        work = []
        for slot, out in outs.items():
            if len(out) < N_GEN:
                d = drafts[slot](out)[: N_GEN - len(out) - 1]
                start = len(prompt) + len(out) - 1
                work.append(SeqWork(slot, "r", (out[-1], *d), start, True, p, n_draft=len(d)))
        for res in drive.run(*work):
            outs[res.slot].append(res.token)
    assert outs == {slot: plain for slot in drafts}


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


ARCHS = ["qwen3", "gemma3", "qwen3next", "qwen4exp"]
RECURRENT = ["qwen3next", "qwen4exp"]


@pytest.mark.parametrize("arch", ARCHS)
def test_drafts_give_plain_decodes_tokens_cpu(arch: str, tmp_path: Path) -> None:
    from mgserve.cuda.backend import torch_backend

    runner = _runner(arch, tmp_path, torch.device("cpu"), torch_backend(), graphs=False)
    assert runner.supports_drafts
    _check(runner)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_drafts_give_plain_decodes_tokens_gpu(arch: str, tmp_path: Path, cuda_ops) -> None:
    runner = _runner(arch, tmp_path, torch.device("cuda", 0), cuda_ops, graphs=True)
    assert runner.supports_drafts
    _check(runner)
    assert max(runner.decode.captured) >= 4  # verify rows (1 + up to 5) went through graphs


def _state(runner, slot: int) -> tuple[torch.Tensor, object]:
    """The slot's recurrent state (packed) and the model's host state of it, on the CPU."""
    from mgserve.cuda import snapshots as snap

    ckpt = snap.save(runner.model, slot)
    return ckpt.state.cpu(), ckpt.host


def _check_state(runner, p: SamplingParams) -> None:
    """After every verify step, partly accepted or not, the drafting slot's recurrent state (and
    PLE token history) is the one plain decode has at the same position, bitwise. The prompt is
    long enough for qwen4exp's QSA to select blocks (more complete than its budget)."""
    drive, prompt = _Driver(runner), [30 + i * 7 % 61 for i in range(72)]
    plain: dict[int, tuple[torch.Tensor, object]] = {}  # position -> state after it
    (r,) = drive.run(SeqWork(0, "r", tuple(prompt), 0, True, p, new_sequence=True))
    out, start = [r.token], len(prompt)
    while len(out) < N_GEN:
        (r,) = drive.run(SeqWork(0, "r", (out[-1],), start, True, p))
        plain[start] = _state(runner, 0)
        out.append(r.token)
        start += 1
    (r,) = drive.run(SeqWork(1, "r", tuple(prompt), 0, True, p, new_sequence=True))
    got, start, partial = [r.token], len(prompt), 0
    while len(got) < N_GEN:
        n = len(got)  # 2 right, then wrong (or all right near the end)
        d = out[n : n + 2] + [(t + 1) % 100 + 3 for t in out[n + 2 : n + 4]]
        d = d[: N_GEN - n - 1]
        res = drive.run(SeqWork(1, "r", (got[-1], *d), start, True, p, n_draft=len(d)))
        partial += len(res) - 1 < len(d)
        start += len(res)
        got += [x.token for x in res]
        want_state, want_host = plain[start - 1]
        state, host = _state(runner, 1)
        assert torch.equal(state, want_state), f"state after position {start - 1} differs"
        assert (host is None) == (want_host is None)
        if host is not None:
            assert (host == want_host).all(), f"host state after position {start - 1} differs"
    assert got == out
    assert partial >= 3  # rollbacks happened
    pools = runner.model.pools
    for il, blocks in pools.blocks.items():  # QSA block keys complete by the last position
        n = start // pools.pending[il].shape[1]
        assert torch.equal(blocks[1, :n], blocks[0, :n]), f"layer {il} block keys differ"


@pytest.mark.parametrize("arch", RECURRENT)
def test_rollback_leaves_plain_decodes_state_cpu(arch: str, tmp_path: Path) -> None:
    from mgserve.cuda.backend import torch_backend

    runner = _runner(arch, tmp_path, torch.device("cpu"), torch_backend(), graphs=False)
    for p in (GREEDY, SAMPLED):
        _check_state(runner, p)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", RECURRENT)
def test_rollback_leaves_plain_decodes_state_gpu(arch: str, tmp_path: Path, cuda_ops) -> None:
    runner = _runner(arch, tmp_path, torch.device("cuda", 0), cuda_ops, graphs=True)
    for p in (GREEDY, SAMPLED):
        _check_state(runner, p)


def test_recurrent_drafts_with_a_checkpoint_are_refused(tmp_path: Path) -> None:
    """A verify entry of a recurrent model with a checkpoint: the checkpoint would be taken after
    the drafts, rejected or not."""
    from mgserve.cuda.backend import torch_backend

    runner = _runner("qwen3next", tmp_path, torch.device("cpu"), torch_backend(), graphs=False)
    drive = _Driver(runner)
    (r,) = drive.run(SeqWork(0, "r", (5, 6, 7), 0, True, GREEDY, new_sequence=True))
    work = SeqWork(0, "r", (r.token, 9, 9), 3, True, GREEDY, n_draft=2, checkpoint=True)
    with pytest.raises(ValueError, match="checkpoint"):
        drive.run(work)
