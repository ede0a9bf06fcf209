"""The real Gemma 3 270M Q4_K_M on the GPU: greedy decoding gives the reference path's tokens.

Both runners get the same scheduler-shaped batches: three prompts prefilled in one step, then
greedy decode steps of all three together; then one session again alone on the GPU, which must
give the same tokens as in the batch (concurrency never changes results).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mgserve.core.engine.contract import SamplingParams, ScheduledBatch, SeqWork

pytestmark = pytest.mark.gpu

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Water boils at a temperature of",
)
N_NEW = 24
GREEDY = SamplingParams(temperature=0.0)


def _generate(runner: Any, prompts: list[list[int]], slots: list[int]) -> list[list[int]]:
    step = 0
    work = [
        SeqWork(s, f"r{s}", tuple(p), 0, True, GREEDY, new_sequence=True)
        for s, p in zip(slots, prompts, strict=True)
    ]
    out: list[list[int]] = [[] for _ in prompts]
    pos = [len(p) for p in prompts]
    for _ in range(N_NEW):
        step += 1
        res = runner.run(ScheduledBatch(step, tuple(work)))
        by_slot = {r.slot: r.token for r in res.results}
        for i, s in enumerate(slots):
            out[i].append(by_slot[s])
        work = [
            SeqWork(s, f"r{s}", (out[i][-1],), pos[i], True, GREEDY) for i, s in enumerate(slots)
        ]
        pos = [p + 1 for p in pos]
    return out


def test_gemma_greedy_on_gpu_matches_reference(gemma_path: Path) -> None:
    pytest.importorskip("cuda.core")
    from mgserve.core.engine.runner import ReferenceRunner
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.core.models import load_model
    from mgserve.core.text.tokenizer import Tokenizer
    from mgserve.cuda.backend import cuda_backend, load_device_model
    from mgserve.cuda.runner import DeviceRunner

    g = GGUFFile(gemma_path)
    tok = Tokenizer.from_metadata(g.metadata)
    prompts = [tok.encode(p, add_special=True) for p in PROMPTS]
    ref = _generate(ReferenceRunner(load_model(g), 3, 256), prompts, [0, 1, 2])
    dev = torch.device("cuda", 0)
    model = load_device_model(g, cuda_backend(0), dev, n_slots=4, n_ctx=256)
    runner = DeviceRunner(model, dev)
    got = _generate(runner, prompts, [2, 0, 3])
    for p, a, b in zip(PROMPTS, got, ref, strict=True):
        print(f"{p!r}: gpu {tok.decode(a)!r}\n{'':{len(repr(p))}}  ref {tok.decode(b)!r}")
    assert got == ref
    alone = _generate(runner, prompts[1:2], [1])
    assert alone[0] == got[1]
