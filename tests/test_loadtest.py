"""The locust load (loadtest/locustfile.py) for 60 s against `mgserve serve` on the default
built-in model on CPU: zero failed requests, every kind of user served, the burst's overflow
refused with 503s, and afterwards no slot busy and a clean exit. Minutes of CPU: it runs only with
MGSERVE_LOADTEST=1 (and locust installed: pip install -e '.[loadtest]')."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.api.serve_process import ROOT, ServeProcess

pytestmark = [
    pytest.mark.slow,
    pytest.mark.loadtest,
    pytest.mark.skipif(
        os.environ.get("MGSERVE_LOADTEST") != "1", reason="MGSERVE_LOADTEST=1 runs it"
    ),
]
USERS = int(os.environ.get("LOADTEST_USERS", "6"))
DURATION = os.environ.get("LOADTEST_DURATION", "60s")
# 2 slots and a queue of 4: the burst's 8 requests overflow it
SERVER = ["-c", "1024", "-np", "2", "-t", "1", "--max-queue", "4", "--log-level", "warning"]


def test_locust_60s_zero_failures(tmp_path: Path) -> None:
    locust = shutil.which("locust")
    if locust is None:
        pytest.skip("locust is not installed (pip install -e '.[loadtest]')")
    server = ServeProcess(SERVER, tmp_path / "serve.log")
    try:
        server.wait_ready()
        env = os.environ | {
            "LOADTEST_SUMMARY": str(tmp_path / "summary.json"),
            "LOADTEST_CTX": "1024",
        }
        cmd = [
            locust, "-f", str(ROOT / "loadtest" / "locustfile.py"), "--host", server.base,
            "--headless", "-u", str(USERS), "-r", str(USERS), "-t", DURATION,
            "--csv", str(tmp_path / "load"), "--only-summary", "--stop-timeout", "30",
        ]  # fmt: skip
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        sys.stdout.write(run.stdout[-4000:] + run.stderr[-4000:])
        with open(tmp_path / "load_stats.csv") as f:
            rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
        total = rows[("", "Aggregated")]
        assert int(total["Request Count"]) > 0
        assert int(total["Failure Count"]) == 0, (tmp_path / "load_failures.csv").read_text()
        names = {name for _, name in rows}
        assert {"ttft", "itl", "tok/s", "chat (short)", "chat (long session)"} <= names
        summary = json.loads((tmp_path / "summary.json").read_text())
        print(json.dumps(summary))
        assert summary["counts"]["requests ok"] > 0
        # idle again: nothing processing, nothing queued
        with urllib.request.urlopen(server.base + "/slots", timeout=30) as r:
            slots = json.loads(r.read())
        assert not any(s["is_processing"] for s in slots), slots
    finally:
        code = server.stop()
    assert code == 0, server.output()
