"""``mgserve serve`` end to end in a subprocess: listens, answers, and exits 0 on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("mgserve.core.text.tokenizer", reason="the tokenizer module has not landed")
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def test_serve_answers_and_shuts_down_gracefully(gemma_path: Path) -> None:
    port = _free_port()
    # serve() as mgserve/cli.py calls it (the CLI also imports every benchmark module)
    code = (
        "import sys; from mgserve.api.server import serve; from mgserve.config import Settings; "
        f"sys.exit(serve(Settings(model={str(gemma_path)!r}, ctx_size=256, parallel=1, "
        f"port={port}, log_level='warning')))"
    )
    cmd = [sys.executable, "-c", code]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    assert json.loads(r.read()) == {"status": "ok"}
                    break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.5)
        r = _post(base + "/completion", {"prompt": "Hello", "n_predict": 4, "temperature": 0})
        assert r["stop"] is True and r["tokens_predicted"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
