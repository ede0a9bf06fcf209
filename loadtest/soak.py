"""Soak: a mixed load on `mgserve serve` for a given time; errors, requests, and the server's
memory (RSS) at the start (after a warm-up) and at the end.

    python loadtest/soak.py --duration 1800 -- -c 1024 -np 2 -t 1 --max-queue 4
    python loadtest/soak.py --duration 600 --url http://127.0.0.1:8080 --pid 1234

With ``--`` and server arguments it starts `mgserve serve` itself (on a free port) and stops it with
SIGTERM at the end (its exit code is reported); with --url (and --pid for the RSS) it loads a
running one. The mix, by --users concurrent clients: streamed chat read to the end (half), plain
completions, streams dropped after a few events, bursts past the queue (a 503 with Retry-After is
expected there), tokenize, and a /metrics scrape a second. With --long-words N, a quarter of the
chats are instead turns of a long conversation of the user's own (a system prompt of about N
words, each turn adding the answer and a new question, a fresh conversation after a few turns):
prompt processing at depth and prefix reuse between turns. An error is any other non-200, a stream
that breaks or ends without its last event, or a request that takes longer than --timeout.
With --gpu the server process's GPU memory (nvidia-smi) is reported beside its RSS.

    python loadtest/soak.py --duration 600 --users 6 --long-words 6000 --gpu -- \
        -m model.gguf --device cuda -c 65536 -np 4 --max-queue 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
MSG = [{"role": "user", "content": "Write two sentences about caching."}]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def gpu_mb(pid: int) -> float | None:
    """The process's GPU memory by nvidia-smi (None without one or without the process there)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [line.split(",") for line in out.splitlines() if "," in line]
    used = [float(mb) for p, mb in rows if p.strip() == str(pid)]
    return sum(used) if used else None


def words(n: int, rng: random.Random) -> str:
    vocab = "cache slot prefix token layer state expert router query key value block chunk".split()
    return " ".join(rng.choice(vocab) for _ in range(n))


class Soak:
    def __init__(self, url: str, timeout: float, max_tokens: int, long_words: int = 0) -> None:
        self.url = url
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.max_tokens = max_tokens
        self.long_words = long_words
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        self.seconds: dict[str, list[float]] = {}  # each action's wall time, by kind

    def error(self, what: str) -> None:
        self.counts["errors"] += 1
        if len(self.errors) < 20:
            self.errors.append(what)

    async def chat_stream(self, s: aiohttp.ClientSession, drop: bool) -> None:
        body = {"messages": MSG, "max_tokens": self.max_tokens, "stream": True}
        async with s.post(self.url + "/v1/chat/completions", json=body) as r:
            if await self.busy(r, expect_503=False):
                return
            if r.status != 200:
                return self.error(f"chat stream {r.status}: {(await r.text())[:200]}")
            done = False
            n = 0
            async for line in r.content:
                n += 1
                if drop and n >= 3:
                    self.counts["dropped"] += 1
                    return  # leaving the block closes the connection mid-stream
                if line.strip() == b"data: [DONE]":
                    done = True
                elif b'"error"' in line:
                    return self.error(f"stream error event: {line[:200]!r}")
            if not done:
                self.error("stream ended without [DONE]")
            self.counts["chat streamed"] += 1

    async def long_turn(
        self, s: aiohttp.ClientSession, conv: list[dict[str, str]], rng: random.Random
    ) -> None:
        """One turn of the user's long conversation ``conv`` (kept between calls)."""
        if not conv or len(conv) > 8:
            conv[:] = [{"role": "system", "content": words(self.long_words, rng)}]
        conv.append({"role": "user", "content": words(12, rng) + "?"})
        body = {"messages": conv, "max_tokens": self.max_tokens}
        async with s.post(self.url + "/v1/chat/completions", json=body) as r:
            if await self.busy(r, expect_503=False):
                conv.pop()
                return
            if r.status != 200:
                conv.clear()
                return self.error(f"long turn {r.status}: {(await r.text())[:200]}")
            answer = (await r.json())["choices"][0]["message"]["content"] or ""
            conv.append({"role": "assistant", "content": answer})
            self.counts["long turns"] += 1

    async def completion(self, s: aiohttp.ClientSession, expect_503: bool = False) -> None:
        body = {"prompt": "The capital of France is", "n_predict": self.max_tokens // 2}
        async with s.post(self.url + "/completion", json=body) as r:
            if await self.busy(r, expect_503):
                return
            if r.status != 200:
                return self.error(f"completion {r.status}: {(await r.text())[:200]}")
            await r.json()
            self.counts["completions"] += 1

    async def busy(self, r: aiohttp.ClientResponse, expect_503: bool) -> bool:
        """A 503 with Retry-After (the queue is full): expected in a burst, else waited out (the
        user's next request comes after it)."""
        if r.status != 503 or not r.headers.get("Retry-After"):
            return False
        self.counts["503 expected" if expect_503 else "503 waited out"] += 1
        if not expect_503:
            await asyncio.sleep(float(r.headers["Retry-After"]))
        return True

    async def burst(self, s: aiohttp.ClientSession, n: int) -> None:
        await asyncio.gather(*(self.completion(s, expect_503=True) for _ in range(n)))
        self.counts["bursts"] += 1

    async def tokenize(self, s: aiohttp.ClientSession) -> None:
        async with s.post(self.url + "/tokenize", json={"content": "hello " * 50}) as r:
            if r.status != 200:
                return self.error(f"tokenize {r.status}")
            await r.json()
            self.counts["tokenize"] += 1

    async def user(self, s: aiohttp.ClientSession, end: float, rng: random.Random) -> None:
        conv: list[dict[str, str]] = []
        while time.monotonic() < end:
            pick = rng.random()
            t0 = time.monotonic()
            long = 0.25 if self.long_words else 0.0
            actions = (  # (the pick below which it is chosen, its kind, the action)
                (long, "long turn", lambda: self.long_turn(s, conv, rng)),
                (0.5, "chat stream", lambda: self.chat_stream(s, drop=False)),
                (0.7, "completion", lambda: self.completion(s)),
                (0.85, "dropped stream", lambda: self.chat_stream(s, drop=True)),
                (0.95, "tokenize", lambda: self.tokenize(s)),
                (1.0, "burst", lambda: self.burst(s, 8)),
            )
            kind, act = next((k, a) for p, k, a in actions if pick < p)
            try:
                await act()
                self.seconds.setdefault(kind, []).append(time.monotonic() - t0)
            except (TimeoutError, aiohttp.ClientError) as e:
                self.error(f"{type(e).__name__}: {e}")
            await asyncio.sleep(rng.uniform(0.1, 1.0))

    async def scraper(self, s: aiohttp.ClientSession, end: float) -> None:
        while time.monotonic() < end:
            try:
                async with s.get(self.url + "/metrics") as r:
                    if r.status != 200:
                        self.error(f"metrics {r.status}")
                    await r.read()
                    self.counts["metrics"] += 1
            except (TimeoutError, aiohttp.ClientError) as e:
                self.error(f"metrics: {type(e).__name__}: {e}")
            await asyncio.sleep(1.0)

    def latency(self) -> dict[str, dict[str, float]]:
        """Each kind's wall seconds: median, 90th percentile, longest, count."""
        out = {}
        for kind, times in sorted(self.seconds.items()):
            xs = sorted(times)
            p50, p90 = (round(xs[min(len(xs) - 1, int(q * len(xs)))], 2) for q in (0.5, 0.9))
            out[kind] = {"p50": p50, "p90": p90, "max": round(xs[-1], 2), "n": len(xs)}
        return out

    async def metrics_text(self) -> str:
        async with aiohttp.ClientSession(timeout=self.timeout) as s:
            async with s.get(self.url + "/metrics") as r:
                return await r.text()

    async def run(self, users: int, seconds: float) -> None:
        end = time.monotonic() + seconds
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=self.timeout) as s:
            rngs = [random.Random(i) for i in range(users)]
            await asyncio.gather(self.scraper(s, end), *(self.user(s, end, r) for r in rngs))


def start_server(args: list[str], log: Path, timeout: float) -> tuple[subprocess.Popen[bytes], str]:
    sys.path.insert(0, str(ROOT))
    from tests.api.serve_process import ServeProcess

    server = ServeProcess(args, log)
    server.wait_ready(timeout)
    return server.proc, server.base


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds before the first RSS")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=300.0, help="longest a request may take")
    p.add_argument("--long-words", type=int, default=0, help="long conversations of ~N words")
    p.add_argument("--gpu", action="store_true", help="report the server's GPU memory too")
    p.add_argument("--ready-timeout", type=float, default=180.0, help="a started server's start")
    p.add_argument("--url", help="a running server (else one is started with the args after --)")
    p.add_argument("--pid", type=int, help="the running server's pid, for its RSS")
    p.add_argument("--log", default="soak-serve.log", help="the started server's output")
    p.add_argument("--json", help="write the report here too")
    p.add_argument("--metrics-out", help="write the server's /metrics at the end here")
    p.add_argument("server_args", nargs="*", help="after --: `mgserve serve` arguments")
    a = p.parse_args()
    proc = None
    if a.url:
        url, pid = a.url.rstrip("/"), a.pid
    else:
        t_start = time.monotonic()
        proc, url = start_server(a.server_args, Path(a.log), a.ready_timeout)
        pid = proc.pid
        print(f"server ready in {time.monotonic() - t_start:.1f} s", flush=True)
    soak = Soak(url, a.timeout, a.max_tokens, a.long_words)
    t0 = time.monotonic()
    asyncio.run(soak.run(a.users, a.warmup))
    rss0 = rss_mb(pid) if pid else None
    gpu0 = gpu_mb(pid) if pid and a.gpu else None
    soak.seconds.clear()  # the warm-up's (first compiles, first captures) are not the soak's
    asyncio.run(soak.run(a.users, a.duration))
    rss1 = rss_mb(pid) if pid else None
    if a.metrics_out:
        Path(a.metrics_out).write_text(asyncio.run(soak.metrics_text()))
    gpu1 = gpu_mb(pid) if pid and a.gpu else None
    report: dict[str, Any] = {
        "seconds": round(time.monotonic() - t0, 1),
        "users": a.users,
        "counts": dict(soak.counts),
        "errors": soak.errors,
        "seconds_by_kind": soak.latency(),
        "rss_mb_start": rss0 and round(rss0, 1),
        "rss_mb_end": rss1 and round(rss1, 1),
    }
    if a.gpu:
        report |= {"gpu_mb_start": gpu0, "gpu_mb_end": gpu1}
    if proc is not None:
        proc.send_signal(signal.SIGTERM)
        report["exit_code"] = proc.wait(timeout=60)
    text = json.dumps(report, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text)
    ok = not soak.counts["errors"] and report.get("exit_code", 0) == 0
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
