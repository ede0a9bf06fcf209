"""Clients that leave mid-stream from a pipeline of two processes (``serve --dist-world-size 2``,
gloo): prompts of several chunks are in flight on both ranks (rank 0 runs ahead of rank 1 by up
to a few steps, pipeline/lockstep.py) when their requests are cancelled and their slots reused.
Afterwards no slot is busy, both ranks live, and a request gets the one-process tokens; SIGTERM
ends the pipeline with 0."""

from __future__ import annotations

import http.client
import json
import random
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.api.serve_process import ROOT
from tests.pipeline.test_serve_dist import (
    PROMPTS,
    SERVE,
    _complete,
    _one_process,
    _wait_ready,
    serve_here,
)

pytestmark = pytest.mark.slow
MODEL = ROOT / "tests" / "data" / "converted_qwen4exp.gguf"


def _leave_early(port: int, seed: int) -> None:
    """A streamed completion of a multi-chunk prompt, dropped after a few events (or none)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(10, 200) for _ in range(rng.randrange(20, 90))]
    body = json.dumps({"prompt": prompt, "n_predict": 16, "stream": True, "temperature": 0.7,
                       "cache_prompt": rng.random() < 0.5})  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        for _ in range(rng.randrange(0, 6)):
            if not r.readline():
                break
    finally:
        conn.close()  # gone mid-prompt or mid-generation


def test_clients_leaving_mid_stream_leave_the_pipeline_idle_and_in_step(tmp_path: Path) -> None:
    p, base = serve_here([*SERVE, "-m", str(MODEL), "-b", "8"], tmp_path / "rank0.log")
    port = int(base.rsplit(":", 1)[1])
    try:
        _wait_ready(base, [p], tmp_path)
        with ThreadPoolExecutor(6) as ex:
            list(ex.map(lambda i: _leave_early(port, i), range(40)))
        end = time.monotonic() + 30
        while True:
            with urllib.request.urlopen(base + "/slots", timeout=10) as r:
                slots = json.loads(r.read())
            if not any(s["is_processing"] for s in slots):
                break
            assert time.monotonic() < end, f"slots still busy: {slots}"
            time.sleep(0.2)
        assert p.poll() is None
        got = _complete(base, PROMPTS[0])
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert got == _one_process(MODEL)[0]
        finally:
            torch.set_num_threads(n)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0, (tmp_path / "rank0.log").read_text()
        log = (tmp_path / "rank0.log").read_text()
        assert "cannot go on" not in log and "rank 0 stopped after" in log, log
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
