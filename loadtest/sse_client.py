"""One streaming chat request as a locust user makes it, and the figures it yields.

``stream_chat`` posts to /v1/chat/completions with ``stream: true``, reads the SSE stream and
reports custom metrics to locust's statistics (request_type ``SSE``): ``ttft`` (request sent ->
first content delta, ms), ``itl`` (gap between consecutive content deltas, ms) and ``tok/s`` (the
request's decode rate: tokens after the first over the time since it, reported in the
response-time column, so read it as tokens per second, not ms). A 503 with Retry-After is the
server saying its queue is full: a user waits as told and retries (for LOADTEST_RETRY_S, 60 s),
or, for a burst that expects it, counts it as ``503 expected``; a 503 without Retry-After, any
other status, a stream that breaks or stalls past the read timeout are failures. ``FIGURES``
keeps every value, for the summary locustfile.py writes at the end.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from collections import defaultdict
from typing import Any

from locust import events

TIMEOUT = (10.0, float(os.environ.get("LOADTEST_READ_TIMEOUT_S", "120")))  # connect, read
RETRY_S = float(os.environ.get("LOADTEST_RETRY_S", "60"))  # how long a user retries 503s
FIGURES: dict[str, list[float]] = defaultdict(list)
COUNTS: dict[str, int] = defaultdict(int)


def report(name: str, value: float, started: float, exc: Exception | None = None) -> None:
    if exc is None:
        FIGURES[name].append(value)
    events.request.fire(
        request_type="SSE",
        name=name,
        response_time=value,
        response_length=0,
        exception=exc,
        context={},
        start_time=started,
    )


def stream_chat(
    user: Any,
    messages: list[dict[str, str]],
    max_tokens: int,
    name: str,
    *,
    expect_503: bool = False,
) -> str | None:
    """The assistant's text, or None (a 503 counted as expected, or a failure reported)."""
    body = {
        "model": "default",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.7,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    patience = time.perf_counter() + RETRY_S
    while True:
        t0 = time.perf_counter()
        with user.client.post(
            "/v1/chat/completions",
            json=body,
            headers=user.headers,
            stream=True,
            catch_response=True,
            name=name,
            timeout=TIMEOUT,
        ) as resp:
            if resp.status_code == 503 and resp.headers.get("Retry-After"):
                COUNTS["503"] += 1
                if expect_503:
                    resp.success()
                    COUNTS["503 expected"] += 1
                    return None
                if time.perf_counter() < patience:  # the queue is full: wait as told, retry
                    resp.success()
                    COUNTS["503 retried"] += 1
                    time.sleep(float(resp.headers["Retry-After"]) * random.uniform(1.0, 1.5))
                    continue
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return None
            return _read(resp, t0)


def _read(resp: Any, t0: float) -> str | None:
    first = last = None
    n_deltas, text, usage = 0, [], None
    try:
        for line in resp.iter_lines():
            if not line or not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message"))
            usage = chunk.get("usage") or usage
            choices = chunk.get("choices") or []
            content = choices[0].get("delta", {}).get("content") if choices else None
            if not content:
                continue
            now = time.perf_counter()
            if first is None:
                first = now
                report("ttft", (now - t0) * 1000, t0)
            else:
                report("itl", (now - last) * 1000, last)  # type: ignore[operator]
            last = now
            n_deltas += 1
            text.append(content)
    except Exception as e:  # a broken stream is a failure, not a crash of the user
        resp.failure(f"stream broke: {type(e).__name__}: {e}")
        return None
    if first is None or last is None:
        resp.failure("stream produced no content")
        return None
    resp.success()
    n_tokens = usage["completion_tokens"] if usage else n_deltas
    COUNTS["tokens"] += n_tokens
    COUNTS["requests ok"] += 1
    if n_tokens > 1 and last > first:
        report("tok/s", (n_tokens - 1) / (last - first), first)
    report("e2e", (time.perf_counter() - t0) * 1000, t0)
    return "".join(text)


def summary(duration_s: float) -> dict[str, Any]:
    """Median, p90, p99 and count of every figure; counts; aggregate tokens/s."""
    out: dict[str, Any] = {"duration_s": round(duration_s, 1), "counts": dict(COUNTS)}
    for name, values in sorted(FIGURES.items()):
        v = sorted(values)
        out[name] = {
            "n": len(v),
            "median": round(statistics.median(v), 1),
            "p90": round(v[int(0.9 * (len(v) - 1))], 1),
            "p99": round(v[int(0.99 * (len(v) - 1))], 1),
        }
    out["aggregate_tok_s"] = round(COUNTS["tokens"] / duration_s, 2) if duration_s else 0.0
    return out
