"""Fakes for the API tests: a byte-level tokenizer and an engine that follows the Engine API.

The engine "generates" a fixed reply, one token per step per slot, with the contract's TokenEvents
(each naming its slot; eog token on "stop" carried but not text, "length" at max_tokens or the
context end, "abort").
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mgserve.core.engine.contract import Request, TokenEvent, TopLogprob
from mgserve.core.text.roles import FimTokens
from mgserve.core.text.special import ATTR_CONTROL, ATTR_NORMAL

SPECIALS = ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>")
BOS, EOS, SOT, EOT = 256, 257, 258, 259
N_VOCAB = 256 + len(SPECIALS)
_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")


class FakeTokenizer:
    """One token per UTF-8 byte, plus four special tokens."""

    n_vocab = N_VOCAB
    bos_id = BOS
    eos_id = EOS
    eog_ids = frozenset({EOS, EOT})
    add_bos = True
    fim = FimTokens()  # none: /infill refuses

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        ids = [BOS] if add_special and self.add_bos else []
        parts = _SPECIAL_RE.split(text) if parse_special and "<" in text else [text]
        for part in parts:
            if parse_special and part in SPECIALS:
                ids.append(256 + SPECIALS.index(part))
                continue
            data = part.encode("utf-8")
            # in slices, as a real tokenizer works word by word: one C call over a 10 MB text
            # would hold the GIL (and the event loop) for its whole length
            for i in range(0, len(data), 1 << 16):
                ids.extend(data[i : i + (1 << 16)])
        return ids

    def piece(self, token: int, special: bool = True) -> bytes:
        if token >= 256:
            return SPECIALS[token - 256].encode() if special else b""
        return bytes([token])

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return b"".join(self.piece(t, not skip_special) for t in ids).decode("utf-8", "replace")

    def token_text(self, token: int) -> str:
        return self.piece(token).decode("utf-8", "replace")

    def is_control(self, token: int) -> bool:
        return token >= 256

    def attr(self, token: int) -> int:
        return ATTR_CONTROL if token >= 256 else ATTR_NORMAL

    def token_id(self, text: str) -> int | None:
        return 256 + SPECIALS.index(text) if text in SPECIALS else None


class FakeDetokenizer:
    """Holds bytes until they form whole UTF-8 characters; drops special tokens."""

    def __init__(self, tok: FakeTokenizer) -> None:
        self.tok = tok
        self.buf = b""

    def push(self, token: int) -> str:
        if self.tok.is_control(token):
            return ""
        self.buf += self.tok.piece(token)
        for cut in range(len(self.buf), max(len(self.buf) - 4, -1), -1):
            try:
                text = self.buf[:cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
            self.buf = self.buf[cut:]
            return text
        return ""

    def flush(self) -> str:
        text, self.buf = self.buf.decode("utf-8", "replace"), b""
        return text


class FakeStream:
    def __init__(self, engine: FakeEngine, req: Request) -> None:
        self.engine = engine
        self.req = req
        self.request_id = req.id
        self.events: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.done = False
        self.out: list[int] = []
        self.finished = False  # the engine's side: no more events will be produced
        self.t0 = time.perf_counter()

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self.done:
            raise StopAsyncIteration
        ev = await self.events.get()
        if ev.finish_reason is not None:
            self.done = True
        return ev

    def abort(self, finish_reason: str = "abort") -> None:
        self.engine.abort(self, finish_reason)


class FakeMetrics:
    """A registry of two series, as the engine's ``metrics.registry``."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        n = len(self.engine.submitted)
        yield CounterMetricFamily("mgserve_requests_submitted_total", "requests", value=n)
        yield GaugeMetricFamily("llamacpp:requests_processing", "busy", value=self.engine.busy())


class FakeEngine:
    """Replies with ``reply`` (bytes, or token ids) then EOS, one token per step for each busy
    slot."""

    def __init__(
        self,
        n_slots: int = 2,
        n_ctx: int = 256,
        reply: bytes | list[int] = b"Hello, world!",
        step_s: float = 0.001,
        fail_at: int | None = None,
    ) -> None:
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        self.cut_hints = False  # a dense model: no message cut hints (api/message_cuts.py)
        self.reply = reply
        self.step_s = step_s
        self.fail_at = fail_at  # after this many tokens a request ends with an "error" event
        self.slot: list[FakeStream | None] = [None] * n_slots
        self.waiting: deque[FakeStream] = deque()
        self.submitted: list[Request] = []
        self.n_aborted = 0
        self.abort_reasons: list[str] = []  # the finish_reason each abort gave
        self.metrics = FakeMetrics(self)
        self._task: asyncio.Task[None] | None = None

    def submit(self, req: Request) -> FakeStream:
        # as the real engine, it trusts the API's checks; these say what they promise
        assert 0 < len(req.prompt) < self.n_ctx and req.max_tokens >= 1
        self.submitted.append(req)
        s = FakeStream(self, req)
        self.waiting.append(s)
        return s

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        for s in list(self.waiting) + [s for s in self.slot if s is not None]:
            self.abort(s)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def abort(self, s: FakeStream, finish_reason: str = "abort") -> None:
        if s.finished:
            return
        self.n_aborted += 1
        self.abort_reasons.append(finish_reason)
        self._end(
            s,
            TokenEvent(
                s.request_id,
                None,
                finish_reason=finish_reason,
                n_prompt=len(s.req.prompt),
                n_generated=len(s.out),
            ),
        )

    def _end(self, s: FakeStream, ev: TokenEvent) -> None:
        s.finished = True
        s.events.put_nowait(ev)
        if s in self.waiting:
            self.waiting.remove(s)
        self.slot = [None if x is s else x for x in self.slot]

    def busy(self) -> int:
        return sum(x is not None for x in self.slot)

    async def _loop(self) -> None:
        while True:
            for i, x in enumerate(self.slot):
                if x is None and self.waiting:
                    self.slot[i] = self.waiting.popleft()
            for s in [x for x in self.slot if x is not None]:
                self._step(s)
            await asyncio.sleep(self.step_s)

    def _step(self, s: FakeStream) -> None:
        req, i, slot = s.req, len(s.out), self.slot.index(s)
        if i == self.fail_at:
            ev = TokenEvent(req.id, None, slot, finish_reason="error", error="device lost")
            self._end(s, ev)
            return
        token = self.reply[i] if i < len(self.reply) else (ord(".") if req.ignore_eos else EOS)
        s.out.append(token)
        n = len(s.out)
        fin = None
        if token in req.stop_token_ids and not req.ignore_eos:
            fin = "stop"
        elif n >= req.max_tokens or len(req.prompt) + n >= self.n_ctx:
            fin = "length"
        sp = req.sampling
        top = tuple(TopLogprob((token + k) % 256, -0.25 - k) for k in range(sp.n_probs))
        ev = TokenEvent(
            req.id,
            token,
            slot,
            logprob=-0.25 if sp.want_logprob or sp.n_probs else None,
            top=top,
            finish_reason=fin,
            n_prompt=len(req.prompt),
            n_cached=0,
            n_generated=n,
            t_prompt_done=0.0005,
        )
        if fin is None:
            s.events.put_nowait(ev)
        else:
            self._end(s, ev)

    def slots(self) -> list[dict[str, object]]:
        return [
            {
                "id": i,
                "is_processing": x is not None,
                "id_task": x.request_id if x else None,
                "n_ctx": self.n_ctx,
            }
            for i, x in enumerate(self.slot)
        ]
