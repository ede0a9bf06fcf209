"""Slot save / restore in a pipeline of two processes on the CPU (gloo; pipeline/slots_dist.py):
``serve --dist-world-size 2`` (rank 1 started by rank 0) on qwen4exp (K/V, recurrent state,
checkpoints and the PLE history, a part on each rank). A slot saved after a request, overwritten
by another, then restored, continues with the tokens it gave before the overwrite, all of its
tokens reused. A file whose part of a stage does not fit (rank 1's or rank 0's) gets a 400 naming
the rank, and the pipeline serves on. A one-process server refuses the pipeline's file (and the
pipeline a one-process file), naming both runners and the split; so does a pipeline of another
split (slot_file.py, checked without processes). SIGTERM still ends the pipeline with 0."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from mgserve.core.engine import slot_file
from mgserve.core.engine.slot_actions import SavedSlot
from mgserve.pipeline.slots_dist import slot_format
from tests.api.serve_process import ROOT, ServeProcess
from tests.pipeline.test_serve_dist import serve_here

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

DATA = ROOT / "tests" / "data"
MODEL = DATA / "converted_qwen4exp.gguf"
PIPELINE = "device, pipeline of 2 processes: layers 0-1, 2-3"  # qwen4exp's 4 layers, -ts 1,1
ARGS = ["--device", "cpu", "-m", str(MODEL), "-c", "128", "-np", "2", "-t", "1",
        "--checkpoint-every", "4", "-b", "4", "--log-level", "info"]  # fmt: skip
P = [5, 17, 42, 99, 7, 11, 3, 250, 64, 8, 19, 33]
Q = [100, 101, 102, 100, 101, 102, 100, 9, 9, 9, 9, 9, 9, 9, 9]


def _post(base: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        base + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _complete(base: str, prompt: list[int]) -> dict[str, Any]:
    body = {"prompt": prompt, "n_predict": 6, "temperature": 0, "id_slot": 0,
            "return_tokens": True}  # fmt: skip
    status, out = _post(base, "/completion", body)
    assert status == 200, out
    return out


def _slot(base: str, action: str, filename: str) -> tuple[int, dict[str, Any]]:
    return _post(base, f"/slots/0?action={action}", {"filename": filename})


def _header(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[6:14], "little")
    return json.loads(raw[14 : 14 + n]), raw[14 + n :]


def _renamed(src: Path, dst: Path, old: str, new: str) -> None:
    """``src`` with its tensor ``old`` named ``new`` (a part that no longer fits its stage)."""
    header, data = _header(src)
    header["tensors"] = [[new if n == old else n, d, s] for n, d, s in header["tensors"]]
    head = json.dumps(header).encode()
    dst.write_bytes(slot_file.MAGIC + len(head).to_bytes(8, "little") + head + data)


def _pipeline(slots: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    return serve_here(["serve", *ARGS, "-ts", "1,1", "--slot-save-path", str(slots)], log)


def _wait_ready(p: subprocess.Popen[bytes], base: str, log: Path) -> None:
    end = time.monotonic() + 120
    while True:
        assert p.poll() is None, log.read_text()
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        assert time.monotonic() < end, "the pipeline did not come up:\n" + log.read_text()
        time.sleep(0.3)


@pytest.mark.slow
def test_a_pipelines_slot_is_saved_and_restored(tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    slots.mkdir()
    log = tmp_path / "pipeline.log"
    one = ServeProcess([*ARGS, "--slot-save-path", str(slots)], tmp_path / "one.log")
    p, base = _pipeline(slots, log)
    try:
        _wait_ready(p, base, log)
        one.wait_ready()

        a = _complete(base, P)["tokens"]
        status, saved = _slot(base, "save", "a.slot")
        assert status == 200 and saved["n_saved"] == len(P) + len(a) - 1, saved
        header, _ = _header(slots / "a.slot")
        assert header["identity"]["runner"] == PIPELINE
        names = [n for n, _, _ in header["tensors"]]
        for part in ("stage0.state", "stage0.host", "stage1.k.3", "stage1.state", "stage1.host"):
            assert part in names, names
        assert header["checkpoints"], header  # each stage's checkpoints with it
        assert any(n.startswith("stage0.ckpt.") for n in names), names
        assert any(n.startswith("stage1.ckpt.") for n in names), names

        want = _complete(base, P + a)  # the continuation without a save / restore
        assert want["timings"]["cache_n"] == saved["n_saved"]
        assert _complete(base, Q)["timings"]["cache_n"] == 0  # the slot overwritten
        status, restored = _slot(base, "restore", "a.slot")
        assert status == 200 and restored["n_restored"] == saved["n_saved"], restored
        got = _complete(base, P + a)
        assert got["tokens"] == want["tokens"]
        assert got["timings"]["cache_n"] == saved["n_saved"] and got["timings"]["prompt_n"] == 1

        # a part that does not fit its stage: a 400 naming the rank, every rank left in step
        for old, new, who in (
            ("stage1.k.3", "stage1.k.9", "rank 1 (layers 2-3): the saved state lacks 'k.3'"),
            ("stage0.state", "stage0.stale", "rank 0 (layers 0-1): the saved state lacks"),
            ("stage1.state", "stage5.state", "'stage5.state', which no stage here holds"),
        ):
            _renamed(slots / "a.slot", slots / "bad.slot", old, new)
            status, err = _slot(base, "restore", "bad.slot")
            assert status == 400 and who in err["error"]["message"], err
            assert _complete(base, Q)["tokens"]  # the pipeline serves on
        status, _ = _slot(base, "restore", "a.slot")
        assert status == 200 and _complete(base, P + a)["tokens"] == want["tokens"]

        # the pipeline's file in one process, one process's file in the pipeline: refused
        status, err = _slot(one.base, "restore", "a.slot")
        message = err["error"]["message"]
        assert status == 400 and "a.slot was saved from another runner" in message, err
        assert f"'{PIPELINE}', this server: 'reference'" in message, err  # the CPU's one process
        _complete(one.base, P)
        assert _slot(one.base, "save", "one.slot")[0] == 200
        status, err = _slot(base, "restore", "one.slot")
        message = err["error"]["message"]
        assert status == 400 and f"'reference', this server: '{PIPELINE}'" in message, err

        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0, log.read_text()
        text = log.read_text()
        assert "cannot go on" not in text and "rank 1: rank 0 stopped after" in text, text
    finally:
        one.stop()
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_file_of_another_split_is_refused_naming_both(tmp_path: Path) -> None:
    identity = slot_file.SlotIdentity("f", "qwen4exp", PIPELINE, "f16", "f16")
    saved = SavedSlot((1, 2, 3), (), {"stage0.state": torch.zeros(4)}, ())
    assert slot_format("device", [(0, 2), (2, 4)]) == PIPELINE
    slot_file.write(tmp_path / "x.slot", identity, 128, saved)
    other = slot_format("device", [(0, 1), (1, 4)])
    for runner, here in ((other, other), ("device", "device")):
        with pytest.raises(ValueError) as e:
            slot_file.read(tmp_path / "x.slot", identity._replace(runner=runner), 128)
        assert str(e.value) == (
            "x.slot was saved from another runner (device) or pipeline split "
            f"(runner '{PIPELINE}', this server: '{here}')"
        )
    assert slot_file.read(tmp_path / "x.slot", identity, 128)[0].tokens == (1, 2, 3)
