"""Two pipeline stages in two processes joined by ``torch.distributed`` (``DistTransport``, gloo on
the CPU): stage 0 (the first half of the layers, the embedding) in rank 0, stage 1 (the rest and
the head) in rank 1, each rank driving a ``DeviceRunner`` through the same steps; the logits
rank 1 broadcasts, and so the greedy tokens both ranks sample, are bitwise the one-process run's
(qwen4exp: the hyper-connection streams cross between the processes; and a dense model).
Small: a few prompt tokens and 8 decode steps, two sessions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.cuda.stages_drive import greedy, record_logits

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

N_DECODE, SESSIONS = 8, 2


def _runner(path: str, transport_ranks: list[int] | None):
    """The runner of ``path``'s model on the CPU: one process, or this rank's stages."""
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.cuda.runner import DeviceRunner
    from mgserve.pipeline.staged import StagedLM, balanced_ranges
    from mgserve.pipeline.transport import DistTransport

    g, cpu = GGUFFile(path), torch.device("cpu")
    model = load_device_model(g, torch_backend(), cpu, 3, 64)
    if transport_ranks is not None:
        model = StagedLM(model, balanced_ranges(g, 2), DistTransport(transport_ranks))
    logits = record_logits(model)
    return DeviceRunner(model, cpu, graphs=False), logits


def _worker(rank: int, path: str, rendezvous: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    try:
        runner, logits = _runner(path, [0, 1])
        tokens = greedy(runner, SESSIONS, N_DECODE)
        torch.save({"tokens": tokens, "logits": logits}, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch", ["qwen4exp", "llama"])
def test_two_processes_give_one_process_tokens(arch: str, tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from tests.cuda.test_device_models import _export

    path = str(_export(arch, tmp_path))
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    out = str(tmp_path / "result")
    mp.spawn(_worker, args=(path, rendezvous, out), nprocs=2, join=True)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner, want_logits = _runner(path, None)
        want = greedy(runner, SESSIONS, N_DECODE)
    finally:
        torch.set_num_threads(n)
    for rank in (0, 1):
        got = torch.load(f"{out}.{rank}")
        assert got["tokens"] == want, (rank, json.dumps(got["tokens"]), json.dumps(want))
        assert len(got["logits"]) == len(want_logits)
        for a, b in zip(got["logits"], want_logits, strict=True):
            assert torch.equal(a, b)
