"""``mgserve serve`` in a subprocess for the tests that need the real process (signals, restarts,
load): a free port, the CLI's own argument parsing, waiting for /health to say ok."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServeProcess:
    """``mgserve serve ARGS --port <free>``, its output in ``log`` (a file: a pipe nobody reads
    would fill and block the server)."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        code = "import sys; from mgserve.cli import main; sys.exit(main(sys.argv[1:]))"
        cmd = [sys.executable, "-c", code, "serve", *args, "--port", str(self.port)]
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = os.environ | {"PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> None:
        end = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.output()
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.monotonic() < end, "the server did not come up:\n" + self.output()
            time.sleep(0.3)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        """SIGTERM, then the exit code (killed if it does not exit in 60 s)."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
