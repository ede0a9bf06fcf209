"""Batch invariance of whole models: a prompt's logits alone against beside four others, bitwise.

Through the runner as serving runs it, with ``mgserve bench invariance``'s comparisons
(``mgserve/bench/invariance.py``: ``ScheduledBatch`` steps, decode graphs, device sampling) on the
tiny models of test_device_models.py: five prompts of 13, 59, 106, 153 and 200 tokens (qwen4exp's
QSA turns sparse past 64), prompt i in slot i:

- prefill: each prompt alone in one step, then all five in one step; each prompt's last-token
  logits must be ``torch.equal``; each prompt prefilled alone twice must be too (determinism);
- decode: 8 greedy steps of each prompt alone, then the five decoding the same tokens together in
  the same steps (a batch of 5 against 1: another CUDA-graph bucket); every step ``torch.equal``.

A failure names the prompt, the step and the largest |difference|; for prefill it also gives the
first prompt position whose logits differ (a direct forward of the prompt alone and of the five
together, with every row's logits), which tells a per-token op (GEMM tiling, MoE grouping by the
step's tokens) from a per-sequence one (attention, recurrences).

The torch backend on the CPU (CI) is built to be invariant (row-blocked products, rowwise
transcendentals), on any number of intra-op threads: gemma3's and qwen4exp's prefill is also
checked on 8 threads (direct forwards), which split large elementwise ops where CI's 2 do not.
The CUDA backend (gpu-marked) is exact and int8 mode. Issue 10 expects the CUDA prefill to fail
until the prefill GEMMs and MoE grouping stop depending on the step's token count.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch

from mgserve.bench import invariance
from mgserve.cuda.models.base import Span, Step
from tests.cuda.test_device_models import _export, _tokens

ARCHS = ("qwen3", "gemma3", "qwen3moe", "qwen3next", "qwen4exp")
LENGTHS, N_PROMPTS, STEPS = "13..200", 5, 8


def _bench(path: Path, device: str, *extra: str) -> Any:
    from mgserve.bench.model.harness import ModelBench

    p = argparse.ArgumentParser()
    invariance.add_arguments(p)
    argv = ["--model", str(path), "--device", device, "--ctx", "512", "--ubatch", "256", *extra]
    return ModelBench(p.parse_args(argv))


def _all_logits(model: Any, dev: torch.device, spans: list[tuple[int, tuple[int, ...]]]) -> Any:
    """[T, V] logits of every token of ``spans`` ((slot, prompt) from position 0) in one step."""
    for slot, _ in spans:
        model.begin_sequence(slot)
    toks = [t for _, p in spans for t in p]
    extra = model.step_extra([list(p) for _, p in spans], [s for s, _ in spans])
    step = Step(
        torch.tensor(toks, device=dev),
        torch.tensor([i for _, p in spans for i in range(len(p))], dtype=torch.int32, device=dev),
        torch.tensor([s for s, p in spans for _ in p], dtype=torch.int32, device=dev),
        decode=False,
        spans=tuple(Span(s, 0, len(p)) for s, p in spans),
        extra=None if extra is None else extra.to(dev),
    )
    return model.forward(step).float().cpu()


def _first_position(b: Any, prompts: list[tuple[int, ...]], i: int) -> str:
    """Where prompt i's logits first differ alone vs beside the others, over all its positions."""
    alone = _all_logits(b.model, b.device, [(i, prompts[i])])
    both = _all_logits(b.model, b.device, list(enumerate(prompts)))
    off = sum(len(p) for p in prompts[:i])
    return _where(alone, both[off : off + len(prompts[i])]) or (
        "every position equal in a direct forward"
    )


def _where(alone: torch.Tensor, both: torch.Tensor) -> str | None:
    """Where one prompt's [T, V] logits alone and beside others first differ (None: nowhere)."""
    bad = (alone != both).any(dim=1).nonzero().flatten().tolist()
    if not bad:
        return None
    d = (alone - both).abs().amax(dim=1)
    first, worst = float(d[bad[0]]), float(d.max())
    return (f"first differing position {bad[0]} of {alone.shape[0]} (max |diff| there "
            f"{first:.3g}; {len(bad)} positions differ, worst {worst:.3g})")  # fmt: skip


def _check(b: Any) -> None:
    sizes = invariance.lengths(LENGTHS, N_PROMPTS)
    prompts = [b.tokens(n, 1000 + i) for i, n in enumerate(sizes)]
    results = invariance.compare(b, prompts, STEPS)
    print("\n".join(invariance.table(results)))
    errors = []
    for i, r in enumerate(results):
        what = f"{b.model.spec.arch} prompt {i} ({r.tokens} tokens)"
        if not r.repeat.equal:
            errors.append(f"{what}: two alone prefills differ by {r.repeat.max_abs:.3g}")
        if not r.prefill.equal:
            errors.append(
                f"{what}: prefill beside {N_PROMPTS - 1} others: last-token logits differ by "
                f"{r.prefill.max_abs:.3g} (greedy {r.prefill.greedy}); "
                + _first_position(b, prompts, i)
            )
        bad = [k for k, d in enumerate(r.decode) if not d.equal]
        if bad:
            worst = max(d.max_abs for d in r.decode)
            errors.append(
                f"{what}: decode beside the others: steps {bad} of {STEPS} differ (first by "
                f"{r.decode[bad[0]].max_abs:.3g}, worst {worst:.3g}); first generated token "
                f"whose greedy choice differs: {r.first_greedy} (0: the prompt's, None: none)"
            )
    assert not errors, "not batch-invariant:\n" + "\n".join(errors)


@pytest.mark.parametrize("arch", ARCHS)
def test_torch_backend_is_batch_invariant(arch: str, tmp_path: Path) -> None:
    _check(_bench(_export(arch, tmp_path), "cpu"))


@pytest.mark.usefixtures("eight_threads")
@pytest.mark.parametrize("arch", ["gemma3", "qwen4exp"])
def test_torch_prefill_is_batch_invariant_on_eight_threads(arch: str, tmp_path: Path) -> None:
    """The prefill on 8 intra-op threads, which split an elementwise op (GELU from 16384 values:
    gemma3's [N, 96] FFN gate, padded to 128; the others from 32768: qwen4exp's [N, 1024]
    hyper-connection gates) at offsets that CI's 2 threads do not: the same five prompts' logits
    at every position, each alone against all five in one step, bitwise (direct forwards of the
    model, without the runner's warm-up and decode: it stays cheap)."""
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.cuda.backend import load_device_model, torch_backend

    cpu = torch.device("cpu")
    model = load_device_model(
        GGUFFile(_export(arch, tmp_path)), torch_backend(), cpu, N_PROMPTS, 512
    )
    sizes = invariance.lengths(LENGTHS, N_PROMPTS)
    prompts = [tuple(_tokens(n, 1000 + i, model.spec.n_vocab)) for i, n in enumerate(sizes)]
    both = _all_logits(model, cpu, list(enumerate(prompts)))
    errors, off = [], 0
    for i, p in enumerate(prompts):
        where = _where(_all_logits(model, cpu, [(i, p)]), both[off : off + len(p)])
        if where:
            errors.append(f"prompt {i} ({len(p)} tokens): {where}")
        off += len(p)
    assert not errors, f"{arch} prefill on 8 threads not batch-invariant:\n" + "\n".join(errors)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["exact", "int8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_backend_is_batch_invariant(arch: str, mode: str, tmp_path: Path) -> None:
    pytest.importorskip("cuda.core")
    _check(_bench(_export(arch, tmp_path), "cuda", *(["--int8"] if mode == "int8" else [])))
