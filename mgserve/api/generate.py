"""One generation as the API sees it: submit, detokenize incrementally, apply stop strings.

The engine streams ``TokenEvent``s; this turns them into ``Chunk``s of text that are safe to send:
UTF-8 complete, with any tail that could still become a stop string held back. A matched stop
string, a client that went away, or a handler that fails all end in ``stream.abort()``, which frees
the slot at once (a step already on the runner finishes, its result for the request dropped). A
request the engine's queue has no room for is a 503 with ``Retry-After``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from mgserve.api.drain import SHUTTING_DOWN
from mgserve.api.errors import ApiError
from mgserve.api.protocol import GenParams
from mgserve.api.service import Service
from mgserve.core.engine.contract import PromptProgress, Request, TokenEvent, TopLogprob
from mgserve.core.engine.stream import QueueFull


class StopMatcher:
    """Finds stop strings in streamed text, holding back what could be the start of one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.pending = ""

    def push(self, text: str) -> tuple[str, str | None]:
        """Returns (text safe to send, the stop string matched or None)."""
        buf = self.pending + text
        if not self.stops:
            self.pending = ""
            return buf, None
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            at, word = min(hits)
            self.pending = ""
            return buf[:at], word
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.pending = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], None

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


def piece_text(service: Service, token: int) -> str:
    """A token's text as logprobs responses show it."""
    return bytes(service.tokenizer.piece(token)).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TokenOut:
    """A generated token with what logprobs responses need."""

    id: int
    piece: bytes  # the token's own bytes (may be part of a UTF-8 character)
    logprob: float | None
    top: tuple[TopLogprob, ...]


@dataclass
class Chunk:
    text: str  # text to send now
    tokens: list[TokenOut] = field(default_factory=list)  # tokens behind it (for logprobs)
    finish_reason: str | None = None  # set on the last chunk: "stop", "length", "abort", "error"
    index: int = 0  # the choice it belongs to (choices.py: n > 1)
    progress: PromptProgress | None = None  # a prompt-progress chunk (no text): return_progress


class Generation:
    """A submitted request. Use it in a ``with`` block (leaving it aborts the request if it has not
    finished, whatever ends the handler) and iterate ``chunks()`` or ``collect()`` inside."""

    def __init__(
        self,
        service: Service,
        request: Request,  # from protocol.engine_request
        params: GenParams,
        http_request: web.Request | None = None,
        keep: frozenset[int] = frozenset(),  # special tokens shown as text (chat-output markers)
        index: int = 0,  # the choice this is, with n > 1 (choices.py)
    ) -> None:
        self.service = service
        self.index = index
        self.request = request
        self.params = params
        self.http_request = http_request
        self.slot = -1  # the slot serving the request, once an event names it
        self.n_prompt = len(request.prompt)
        self.n_cached = 0
        self.n_generated = 0
        self.finish_reason: str | None = None
        self.stop_word = ""  # the stop string that ended generation, if one did
        self.error: str | None = None
        self._detok = service.detokenizer(keep)
        self._stops = StopMatcher(params.stop)
        self.t_submit = time.perf_counter()
        self.t_prompt_done: float | None = None  # seconds after submit
        self.t_end: float | None = None
        self._shutting_down = False
        service.drain.admit(self)  # a 503 once the server is shutting down
        try:
            self.stream = service.engine.submit(request)
        except QueueFull as e:
            raise ApiError(str(e), status=503, retry_after=e.retry_after) from None

    def _client_gone(self) -> bool:
        if self.http_request is None:
            return False
        transport = self.http_request.transport
        return transport is None or transport.is_closing()

    def _note(self, ev: TokenEvent) -> None:
        if ev.slot is not None:
            self.slot = ev.slot
        self.n_prompt = ev.n_prompt or self.n_prompt
        self.n_cached = max(self.n_cached, ev.n_cached)  # a bare abort event carries zeros
        self.n_generated = max(self.n_generated, ev.n_generated)
        if self.t_prompt_done is None:
            self.t_prompt_done = (
                ev.t_prompt_done
                if ev.t_prompt_done is not None
                else time.perf_counter() - self.t_submit
            )

    def _token_out(self, ev: TokenEvent) -> TokenOut:
        assert ev.token is not None
        sp = self.request.sampling
        piece = self.service.tokenizer.piece(ev.token) if sp.n_probs or sp.want_logprob else b""
        return TokenOut(ev.token, piece, ev.logprob, ev.top)

    async def chunks(self) -> AsyncIterator[Chunk]:
        try:
            async for ev in self.stream:
                if ev.progress is not None:
                    self.slot = ev.slot if ev.slot is not None else self.slot
                    yield Chunk("", index=self.index, progress=ev.progress)
                    continue
                self._note(ev)
                fin = ev.finish_reason
                text, toks = "", []
                if ev.token is not None and fin != "stop":  # an eog token is not text
                    text = self._detok.push(ev.token)
                    toks.append(self._token_out(ev))
                if fin is not None:
                    text += self._detok.flush()
                out, word = self._stops.push(text)
                if word is not None:
                    self.stop_word = word
                    self._finish("stop")
                    self.stream.abort("stop")
                    yield Chunk(out, toks, "stop", self.index)
                    return
                error = ev.error
                if fin == "abort" and self._shutting_down:  # ended by shut_down, not the client
                    fin, error = "error", SHUTTING_DOWN
                if fin is not None:
                    self.error = error
                    self._finish(fin)
                    yield Chunk(out + self._stops.flush(), toks, fin, self.index)
                    return
                if out or toks:
                    yield Chunk(out, toks, index=self.index)
                if self._client_gone():
                    self.close()
                    return
        finally:
            self.close()

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.t_end = time.perf_counter()
        self.service.drain.ended()

    def shut_down(self) -> None:
        """End the request for a server that is stopping: its stream closes with an error event,
        ``collect`` answers 503 (drain.py)."""
        self._shutting_down = True
        self.stream.abort()

    def close(self) -> None:
        """Abort the request unless it already finished; idempotent."""
        if self.finish_reason is None:
            self._finish("abort")
            self.stream.abort()

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def failure(self) -> str:
        """What a client is told when generation failed (finish_reason "error")."""
        return f"generation failed: {self.error}"

    async def collect(self) -> tuple[str, list[TokenOut]]:
        """Run to the end; the whole text and every token. A failed generation is a 500."""
        parts: list[str] = []
        tokens: list[TokenOut] = []
        async for c in self.chunks():
            parts.append(c.text)
            tokens.extend(c.tokens)
        if self.finish_reason == "error":
            raise ApiError(self.failure, status=503 if self._shutting_down else 500)
        return "".join(parts), tokens

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.n_prompt,
            "completion_tokens": self.n_generated,
            "total_tokens": self.n_prompt + self.n_generated,
            "prompt_tokens_details": {"cached_tokens": self.n_cached},
        }

    def timings(self) -> dict[str, Any]:
        """llama-server's ``timings`` object."""
        end = (self.t_end or time.perf_counter()) - self.t_submit
        prompt_s = self.t_prompt_done if self.t_prompt_done is not None else end
        return timings(self.n_prompt, self.n_cached, self.n_generated, prompt_s, end)


def timings(
    n_prompt: int, n_cached: int, n_generated: int, prompt_s: float, end_s: float
) -> dict[str, Any]:
    """llama-server's ``timings``: ``prompt_s`` and ``end_s`` are seconds after submit."""
    prompt_s = min(prompt_s, end_s)
    gen_s = max(end_s - prompt_s, 0.0)
    prompt_n = max(n_prompt - n_cached, 0)
    return {
        "cache_n": n_cached,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_s * 1e3,
        "prompt_per_token_ms": prompt_s * 1e3 / prompt_n if prompt_n else 0.0,
        "prompt_per_second": prompt_n / prompt_s if prompt_s > 0 else 0.0,
        "predicted_n": n_generated,
        "predicted_ms": gen_s * 1e3,
        "predicted_per_token_ms": gen_s * 1e3 / n_generated if n_generated else 0.0,
        "predicted_per_second": n_generated / gen_s if gen_s > 0 else 0.0,
    }
