"""Streaming chat load test: time to first token and inter-token latency per user.

    pip install locust
    locust -f loadtest/locustfile.py --host http://127.0.0.1:8080 --headless -u 4 -r 1 -t 2m

Each simulated user sends a streaming /v1/chat/completions request, reads the SSE stream and
reports three custom metrics to locust's statistics: ``ttft`` (request sent -> first content
delta), ``itl`` (gap between consecutive content deltas) and ``e2e`` (whole request). Set
MGSERVE_API_KEY for a server that requires a key, LOADTEST_MAX_TOKENS to change the length.
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, events, task

PROMPTS = [
    "Explain what a KV cache is in two sentences.",
    "Write a Python function that reverses a linked list.",
    "List three differences between TCP and UDP.",
    "Summarise the plot of Hamlet in one paragraph.",
    "What is the derivative of x^3 * sin(x)?",
]
MAX_TOKENS = int(os.environ.get("LOADTEST_MAX_TOKENS", "64"))


def _report(name: str, started: float, ms: float, exc: Exception | None = None) -> None:
    events.request.fire(
        request_type="SSE",
        name=name,
        response_time=ms,
        response_length=0,
        exception=exc,
        context={},
        start_time=started,
    )


class StreamingChatUser(HttpUser):
    wait_time = between(0.5, 2.0)

    def on_start(self) -> None:
        key = os.environ.get("MGSERVE_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    @task
    def chat_stream(self) -> None:
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": random.choice(PROMPTS)}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.7,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        last: float | None = None
        with self.client.post(
            "/v1/chat/completions",
            json=body,
            headers=self.headers,
            stream=True,
            catch_response=True,
            name="/v1/chat/completions (stream)",
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            try:
                for line in resp.iter_lines():
                    if not line or not line.startswith(b"data: "):
                        continue
                    data = line[6:]
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    choices = chunk.get("choices") or []
                    if not choices or not choices[0].get("delta", {}).get("content"):
                        continue
                    now = time.perf_counter()
                    if last is None:
                        _report("ttft", t0, (now - t0) * 1000)
                    else:
                        _report("itl", last, (now - last) * 1000)
                    last = now
            except Exception as e:  # a broken stream is a failure, not a crash of the user
                resp.failure(f"stream broke: {e}")
                return
            if last is None:
                resp.failure("stream produced no content")
                return
            resp.success()
            _report("e2e", t0, (time.perf_counter() - t0) * 1000)
