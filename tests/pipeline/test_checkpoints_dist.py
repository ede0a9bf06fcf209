"""The scheduler's recurrent-state checkpoints across a pipeline of two processes (gloo, CPU):
each rank keeps its stage's part of a checkpoint, and an edited turn on a hybrid model (qwen4exp)
resumes from the nearest one on both ranks: the second request computes only the tokens after
the checkpoint (``timings.cache_n``) and gives the tokens and logprobs of the same prompt
computed cold (checked by mutation: without rank 1's restore the logprobs differ)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.api.serve_process import ROOT
from tests.pipeline.test_serve_dist import serve_here
from tests.pipeline.test_slots_dist import _post, _wait_ready

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)
pytestmark = pytest.mark.slow

MODEL = ROOT / "tests" / "data" / "converted_qwen4exp.gguf"
EVERY = 4  # --checkpoint-every: checkpoints at 4, 8, ... inside a prompt
ARGS = ["serve", "--device", "cpu", "-m", str(MODEL), "-c", "128", "-np", "2", "-t", "1",
        "--checkpoint-every", str(EVERY), "-b", "4", "--log-level", "info"]  # fmt: skip
P = [5, 17, 42, 99, 7, 11, 3, 250, 64, 8, 19, 33]
EDITED = [*P[:10], 77, 78, 79]  # shares 10 tokens: the slot's history does not start it


def _complete(base: str, prompt: list[int], slot: int, cache: bool) -> dict[str, object]:
    body = {"prompt": prompt, "n_predict": 6, "temperature": 0, "id_slot": slot,
            "cache_prompt": cache, "return_tokens": True, "n_probs": 3}  # fmt: skip
    status, out = _post(base, "/completion", body)
    assert status == 200, out
    return out


def test_an_edited_turn_resumes_from_a_checkpoint_on_every_rank(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    proc, base = serve_here(ARGS, log)
    try:
        _wait_ready(proc, base, log)
        _complete(base, P, 0, True)  # the first turn: checkpoints at 4 and 8 on both ranks
        resumed = _complete(base, EDITED, 0, True)
        timings = resumed["timings"]
        assert isinstance(timings, dict)
        assert timings["cache_n"] == 8, timings  # the checkpoint at 8, not the 10 shared
        assert timings["prompt_n"] == len(EDITED) - 8, timings
        cold = _complete(base, EDITED, 1, False)
        assert resumed["tokens"] == cold["tokens"], (resumed, cold)
        # the logprobs too: the greedy tokens of this tiny model survive a stage left at the
        # wrong state (rank 1's part of the checkpoint not restored), its logprobs do not
        probs = "completion_probabilities"
        assert resumed[probs] == cold[probs], (resumed[probs], cold[probs])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
