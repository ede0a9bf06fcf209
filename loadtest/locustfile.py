"""Streaming load for mgserve: four kinds of users, each timing its SSE streams (sse_client.py).

    pip install -e '.[loadtest]'
    locust -f loadtest/locustfile.py --host http://127.0.0.1:8080 --headless -u 6 -r 6 -t 60s

- ``ShortChat`` (weight 4): one-turn questions, LOADTEST_MAX_TOKENS (32) tokens.
- ``LongSession`` (1): a conversation over a long system prompt (LOADTEST_LONG_WORDS words),
  turn after turn on one history, so each turn's prefix is cached; starts over before the
  context (LOADTEST_CTX tokens, the server's -c) would overflow.
- ``PrefillArrival`` (1): a fresh long prompt (never cached) and a short answer now and then:
  prefills arriving while the others decode.
- ``Burst`` (1): LOADTEST_BURST requests at once, more than the slots (and the queue, when the
  server runs with a small --max-queue): each is answered or refused with a 503 and Retry-After,
  counted as expected; a hang is a failure (read timeout LOADTEST_READ_TIMEOUT_S).

Pick kinds by name after the options (``... ShortChat Burst``). Every other user retries a 503 after
its Retry-After. MGSERVE_API_KEY: a key for a server that requires one. LOADTEST_SUMMARY: a file
for the JSON summary (medians and percentiles of ttft, itl, tok/s, e2e; counts) written at the end.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import gevent
from locust import HttpUser, between, events, task

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sse_client import stream_chat, summary  # noqa: E402

MAX_TOKENS = int(os.environ.get("LOADTEST_MAX_TOKENS", "32"))
CTX = int(os.environ.get("LOADTEST_CTX", "1024"))
LONG_WORDS = int(os.environ.get("LOADTEST_LONG_WORDS", "250"))
BURST = int(os.environ.get("LOADTEST_BURST", "8"))
QUESTIONS = [
    "Explain what a KV cache is in two sentences.",
    "Write a Python function that reverses a list.",
    "List three differences between TCP and UDP.",
    "Summarise the plot of Hamlet in one paragraph.",
    "What is the derivative of x^3 * sin(x)?",
    "Name three uses of a hash table.",
]
WORDS = (
    "system memory cache token model server request stream latency queue slot prompt decode "
    "prefill batch context answer question history turn user assistant engine kernel thread"
).split()
STARTED = [time.time()]


def _words(n: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class _Streaming(HttpUser):
    abstract = True
    wait_time = between(0.5, 2.0)

    def on_start(self) -> None:
        key = os.environ.get("MGSERVE_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.rng = random.Random()


class ShortChat(_Streaming):
    weight = 4

    @task
    def ask(self) -> None:
        msg = [{"role": "user", "content": self.rng.choice(QUESTIONS)}]
        stream_chat(self, msg, MAX_TOKENS, "chat (short)")


class LongSession(_Streaming):
    weight = 1

    def on_start(self) -> None:
        super().on_start()
        self._reset()

    def _reset(self) -> None:
        system = "You answer briefly. Background notes: " + _words(LONG_WORDS, self.rng)
        self.history = [{"role": "system", "content": system}]
        self.words = LONG_WORDS

    @task
    def turn(self) -> None:
        question = self.rng.choice(QUESTIONS)
        # about 1.5 tokens a word: start over before the context would overflow
        if (self.words + len(question.split())) * 1.5 + 2 * MAX_TOKENS > CTX:
            self._reset()
        self.history.append({"role": "user", "content": question})
        answer = stream_chat(self, self.history, MAX_TOKENS, "chat (long session)")
        if answer is None:
            self.history.pop()
            return
        self.history.append({"role": "assistant", "content": answer})
        self.words += len(question.split()) + len(answer.split()) + 8


class PrefillArrival(_Streaming):
    weight = 1
    wait_time = between(2.0, 5.0)

    @task
    def long_prompt(self) -> None:
        text = _words(LONG_WORDS, self.rng) + "\nIn one sentence, what is this about?"
        stream_chat(self, [{"role": "user", "content": text}], 8, "chat (fresh long prompt)")


class Burst(_Streaming):
    weight = 1
    wait_time = between(5.0, 10.0)

    @task
    def burst(self) -> None:
        def one() -> None:
            msg = [{"role": "user", "content": self.rng.choice(QUESTIONS)}]
            stream_chat(self, msg, MAX_TOKENS // 2, "chat (burst)", expect_503=True)

        gevent.joinall([gevent.spawn(one) for _ in range(BURST)])


@events.test_start.add_listener
def _start(**_: object) -> None:
    STARTED[0] = time.time()


@events.quitting.add_listener
def _summary(environment: object, **_: object) -> None:
    out = summary(time.time() - STARTED[0])
    text = json.dumps(out, indent=1)
    print("mgserve load summary:", text)
    path = os.environ.get("LOADTEST_SUMMARY")
    if path:
        Path(path).write_text(text)
