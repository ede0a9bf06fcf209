"""Two pipeline stages in two processes joined by ``torch.distributed`` (``DistTransport``, gloo on
the CPU): stage 0 (the first half of the layers, the embedding) in rank 0, stage 1 (the rest and
the head) in rank 1, each rank loading only its stage and driving a ``DeviceRunner`` through the
same steps; the logits rank 1 broadcasts, and so the greedy tokens both ranks sample, are bitwise
the one-process run's (qwen4exp: the hyper-connection streams cross between the processes; and a
dense model). Small: a few prompt tokens and 8 decode steps, two sessions. With ``-m gpu``: both
ranks on one GPU over gloo, decode through CUDA graphs; and on a machine of two GPUs or more,
over NCCL with rank r on GPU r."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.cuda.stages_drive import greedy, record_logits, verified

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

N_DECODE, SESSIONS = 8, 2
GRAPHS = ("gloo-cuda", "nccl-graphs")  # decode through CUDA graphs, as serve's GPU ranks do


def _runner(path: str, device: torch.device, transport_ranks: list[int] | None,
            graphs: bool = False):  # fmt: skip
    """The runner of ``path``'s model on ``device``: one process, or this rank's stages; with
    ``graphs``, decode through CUDA graphs (no logits recorded: a replay runs no forward)."""
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.cuda.backend import cuda_backend, load_device_model, torch_backend
    from mgserve.cuda.plan_sizes import Part
    from mgserve.cuda.runner import DeviceRunner
    from mgserve.pipeline.staged import StagedLM, balanced_ranges
    from mgserve.pipeline.transport_dist import DistTransport

    g = GGUFFile(path)
    backend = torch_backend() if device.type == "cpu" else cuda_backend(device.index or 0)
    if transport_ranks is None:
        model = load_device_model(g, backend, device, 3, 64)
    else:  # this rank's stage only, as serve's ranks load it (lockstep.stage_runner)
        ranges = balanced_ranges(g, len(transport_ranks))
        a, b = ranges[dist.get_rank()]
        part = Part(a, b, a == 0, b == ranges[-1][1])
        model = load_device_model(g, backend, device, 3, 64, part=part)
        assert sorted(model.layers) == list(range(a, b))
        model = StagedLM(model, ranges, DistTransport(transport_ranks))
    logits = [] if graphs else record_logits(model)
    return DeviceRunner(model, device, graphs=graphs), logits


def _rank0s(results: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Rank 0's draws, which every rank's next step is built from (lockstep.py)."""
    box = [results]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _worker(rank: int, path: str, rendezvous: str, out: str, kind: str, world: int) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if kind.startswith("nccl"):
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    if kind == "gloo-cuda":  # both ranks on GPU 0, hand-offs through the host
        device = torch.device("cuda", 0)
    backend = "gloo" if kind.startswith("gloo") else "nccl"
    dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=world)
    try:
        runner, logits = _runner(path, device, list(range(world)), graphs=kind in GRAPHS)
        tokens = greedy(runner, SESSIONS, N_DECODE, share=_rank0s)
        drafted = verified(runner, tokens[0], share=_rank0s)  # slot 0 again, drafts all accepted
        torch.save({"tokens": tokens, "logits": logits, "drafted": drafted}, f"{out}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _check(arch: str, tmp_path: Path, kind: str, world: int = 2) -> None:
    import torch.multiprocessing as mp

    from tests.cuda.test_device_models import _export

    path = str(_export(arch, tmp_path))
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    out = str(tmp_path / "result")
    mp.spawn(_worker, args=(path, rendezvous, out, kind, world), nprocs=world, join=True)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        device = torch.device("cpu") if kind == "gloo" else torch.device("cuda", 0)
        runner, want_logits = _runner(path, device, None, graphs=kind in GRAPHS)
        want = greedy(runner, SESSIONS, N_DECODE)
        drafted = verified(runner, want[0])
        assert drafted == want[0][: len(drafted)] and len(drafted) > 4  # every draft accepted
    finally:
        torch.set_num_threads(n)
    for rank in range(world):
        got = torch.load(f"{out}.{rank}")
        assert got["tokens"] == want, (rank, json.dumps(got["tokens"]), json.dumps(want))
        # a recurrent model's verify steps: a rank that rolled back drafts rank 0 kept would
        # hand on another state, and rank 0's tokens (from the last stage's logits) would differ
        assert got["drafted"] == drafted, (rank, got["drafted"], drafted)
        assert len(got["logits"]) == len(want_logits)
        if 0 < rank < world - 1:  # a middle rank gets them only where it samples for itself
            continue
        for a, b in zip(got["logits"], want_logits, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["qwen4exp", "llama"])
def test_two_processes_give_one_process_tokens(arch: str, tmp_path: Path) -> None:
    _check(arch, tmp_path, "gloo")


def test_three_processes_keep_a_middle_stages_recurrent_state(tmp_path: Path) -> None:
    """The middle rank holds a recurrent layer and gets no logits at a plain step (only rank 0
    samples): at a verify step it must get them, or it rolls back drafts rank 0 kept."""
    _check("qwen4exp", tmp_path, "gloo", world=3)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["nccl", "nccl-graphs"])
@pytest.mark.parametrize("arch", ["qwen4exp", "llama"])
def test_two_gpus_over_nccl_give_one_gpu_tokens(arch: str, kind: str, tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2 or not dist.is_nccl_available():
        pytest.skip("needs two GPUs and NCCL")
    _check(arch, tmp_path, kind)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen4exp", "llama"])
def test_two_processes_on_one_gpu_through_decode_graphs(arch: str, tmp_path: Path) -> None:
    """Both ranks on GPU 0 over gloo (NCCL refuses two ranks on one GPU): the hand-offs cross
    through the host, and decode steps replay CUDA graphs whose hand-offs are made around each
    replay (transport_dist.GraphIO); the tokens of one process through graphs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    _check(arch, tmp_path, "gloo-cuda")
