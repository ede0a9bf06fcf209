"""The server's warm-up: before it says ready, one prompt and a few decode steps through the runner.

Kernel modules compile (or load from the cubin cache) on first use, and a decode bucket's CUDA
graph is captured at its first step. Without a warm-up the first request pays for all of it: on a
first start with a full-width qwen4exp that is two minutes of compilation (matvec.cu alone takes
about a minute) while ``/health`` already says ok. So the server runs, while it is still loading
(``/health`` 503 with the "kernels" phase of its progress): a prompt of one batch of tokens in
slot 0 (its last 16 a chunk of their own, which short prompts' kernels need), three decode
steps and, where the runner verifies drafts, one verify step of ``spec_k`` drafts; then it frees
the slot. The next request in slot 0 starts a new sequence there (its state is reset, and the
engine's book never saw these tokens), so the warm-up leaves no trace in any answer. With the
prefill lane the prompt and the freed slot are lane batches, as the lane scheduler would send
them: the prompt path's kernels and f16 scratch are the lane stream's from
the start (one scratch, not one per stream).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from mgserve.core.engine.contract import SamplingParams, ScheduledBatch, SeqWork

log = logging.getLogger(__name__)
SLOT = 0
REQUEST = "mgserve-warm-up"
DECODE_STEPS = 3
SHORT_CHUNK = 16  # the prompt's last chunk, when it is long enough to split


def warm_up(runner: Any, n_vocab: int, n_ctx: int, n_prompt: int, spec_k: int = 0) -> float:
    """Run the warm-up through ``runner`` (a DeviceRunner) in a slot of ``n_ctx`` positions,
    with a prompt of at most ``n_prompt`` tokens (and, room left, ``spec_k`` drafts); returns its
    seconds."""
    t0 = time.perf_counter()
    greedy = SamplingParams(temperature=0.0)
    n_prompt = max(1, min(n_prompt, n_ctx // 2))
    spec_k = max(0, min(spec_k, n_ctx - n_prompt - DECODE_STEPS - 1))
    prompt = tuple((7 + 31 * i) % n_vocab for i in range(n_prompt))
    step = 0

    lanes = bool(getattr(runner, "lanes", False))

    def run(*work: SeqWork, freed: tuple[int, ...] = (), lane: bool = False) -> int:
        nonlocal step
        step += 1
        batch = ScheduledBatch(step, work, freed, lane=lane and lanes)
        results = runner.run(batch).results
        return results[-1].token if results else 0

    # with the prefill lane, prompts run on the lane's stream (its scratch, as serving does). A
    # long prompt ends in a short chunk: prompt GEMMs pick their kernels by the chunk's rows (W
    # decoded once for long chunks, per CTA for short ones: cuda/ops/linear_cuda.py), so both
    # compile here
    if n_prompt > 2 * SHORT_CHUNK:
        cut = n_prompt - SHORT_CHUNK
        run(SeqWork(SLOT, REQUEST, prompt[:cut], 0, False, greedy, new_sequence=True), lane=True)
        token = run(SeqWork(SLOT, REQUEST, prompt[cut:], cut, True, greedy), lane=True)
    else:
        token = run(SeqWork(SLOT, REQUEST, prompt, 0, True, greedy, new_sequence=True), lane=True)
    pos = len(prompt)
    for _ in range(DECODE_STEPS):
        token = run(SeqWork(SLOT, REQUEST, (token,), pos, True, greedy))
        pos += 1
    if spec_k and getattr(runner, "supports_drafts", False):
        drafts = tuple((token + 1 + i) % n_vocab for i in range(spec_k))
        run(SeqWork(SLOT, REQUEST, (token, *drafts), pos, True, greedy, n_draft=spec_k))
    run(freed=(SLOT,), lane=True)  # freed slots go in the lane's batches
    seconds = time.perf_counter() - t0
    log.info("warm-up: kernels ready and decode graphs captured in %.1f s", seconds)
    return seconds
