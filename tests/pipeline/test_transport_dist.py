"""``DistTransport`` between two processes (gloo on the CPU): a hand-off is sent without waiting
for the receiver, up to ``IN_FLIGHT`` per link (the next send waits for the oldest), every tensor
arrives intact and in order, and a step that wants no logits broadcasts nothing, so the first
stage goes on while the last still computes (pipelined prefill, transport_dist.py); and logits
only the sampler needs go to it alone."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

LATE = 1.5  # seconds rank 1 sleeps before it takes anything


def _worker(rank: int, port: int, out: str) -> None:
    from mgserve.pipeline.transport_dist import IN_FLIGHT, DistTransport

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        t = DistTransport([0, 1])
        chunks = [torch.full((64, 8), float(i)) for i in range(IN_FLIGHT + 2)]
        if rank == 0:
            t0 = time.perf_counter()
            for c in chunks[:IN_FLIGHT]:
                t.send(0, c.clone())
            t.logits(None, (0, 10), torch.device("cpu"))  # a chunk that samples nothing
            ahead = time.perf_counter() - t0  # rank 1 is still asleep
            t.send(0, chunks[IN_FLIGHT].clone())  # waits for the oldest to be received
            waited = time.perf_counter() - t0
            t.send(0, chunks[IN_FLIGHT + 1].clone())
            t.flush()
            lg = t.logits(None, (2, 10), torch.device("cpu"))  # the last stage's, to everyone
            mine = t.logits(None, (2, 10), torch.device("cpu"), everyone=False)  # to the sampler
            torch.save({"ahead": ahead, "waited": waited, "logits": lg, "mine": mine}, out)
        else:
            time.sleep(LATE)
            got = [t.recv(1, (64, 8), torch.device("cpu")) for _ in chunks]
            assert all(torch.equal(a, b) for a, b in zip(got, chunks, strict=True))
            assert t.logits(None, (0, 10), torch.device("cpu")).shape == (0, 10)
            t.logits(torch.arange(20.0).view(2, 10), (2, 10), torch.device("cpu"))
            t.logits(-torch.arange(20.0).view(2, 10), (2, 10), torch.device("cpu"), everyone=False)
            t.flush()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_sends_run_ahead_of_a_busy_receiver_and_a_logitless_step_waits_for_nobody(
    tmp_path: Path,
) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "rank0.pt")
    mp.start_processes(_worker, args=(port, out), nprocs=2, start_method="spawn")
    r = torch.load(out)
    assert r["ahead"] < LATE / 2, r  # the sends in flight and the empty logits waited for nobody
    assert r["waited"] >= LATE * 0.8, r  # one more send than IN_FLIGHT waited for the receiver
    assert torch.equal(r["logits"], torch.arange(20.0).view(2, 10))
    assert torch.equal(r["mine"], -torch.arange(20.0).view(2, 10))


def test_a_middle_rank_gets_zeros_when_only_the_sampler_needs_the_logits() -> None:
    """Of a pipeline of three, rank 1 neither sends nor receives a step's logits unless every
    rank needs them (a recurrent model's verify step): its draws from zeros are thrown away."""
    from mgserve.pipeline.transport_dist import DistTransport

    t = DistTransport.__new__(DistTransport)  # no process group: this path makes no call
    t.ranks, t.rank, t.n_stages, t.io = [0, 1, 2], 1, 3, None
    cpu = torch.device("cpu")
    z = t.logits(None, (2, 5), cpu, everyone=False)
    assert torch.equal(z, torch.zeros(2, 5))
    z += 1  # a sampler that writes into its logits
    assert torch.equal(t.logits(None, (2, 5), cpu, everyone=False), torch.zeros(2, 5))
    assert t.logits(None, (0, 5), cpu).shape == (0, 5)
