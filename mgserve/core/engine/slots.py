"""A scheduler's slots and the sessions placed in them (the scheduler's own records), and how
``/slots`` shows a slot."""

from __future__ import annotations

from dataclasses import dataclass, field

from mgserve.core.engine.contract import Request, TokenEvent
from mgserve.core.engine.reasoning import ReasoningTracker


@dataclass
class Session:
    """A request placed in a slot."""

    req: Request
    t_added: float  # clock() when the request was submitted
    n_cached: int  # prompt tokens reused from the slot's cache
    n_done: int  # prompt tokens already in the cache (n_cached included)
    generated: list[int] = field(default_factory=list)
    in_flight: bool = False  # work scheduled, result not yet applied
    new_sequence: bool = True  # the next work is the first of this request in its slot
    restore: bool = False  # the first work restores the slot's checkpoint at n_cached
    t_prompt_done: float | None = None
    reasoning: ReasoningTracker | None = None  # the request's reasoning block, fed every token
    grammar_pending: bool = False  # the request's grammar is not yet with the runner
    # the prompt chunk being computed: start, end, a checkpoint at its end (checkpoints.py)
    chunk: tuple[int, int, bool] = (0, 0, False)

    @property
    def prefilling(self) -> bool:
        return self.n_done < len(self.req.prompt)

    def event(self, slot: int, token: int | None, **kw: object) -> TokenEvent:
        """An event of this session in ``slot``: a token, or its end (``finish_reason``)."""
        return TokenEvent(
            request_id=self.req.id,
            token=token,
            slot=slot,
            n_prompt=len(self.req.prompt),
            n_cached=self.n_cached,
            n_generated=len(self.generated),
            t_prompt_done=self.t_prompt_done,
            **kw,  # type: ignore[arg-type]
        )


@dataclass
class Slot:
    id: int
    cached: list[int] = field(default_factory=list)  # token ids held by the cache, positions 0..
    session: Session | None = None
    last_used: int = -1  # step of the last assignment, to evict the least recently used cache
    cuts: tuple[int, ...] = ()  # the hint cuts its state was computed under (checkpoints.py)

    def info(
        self, n_ctx: int, checkpoints: dict[int, bool], spec: bool = False
    ) -> dict[str, object]:
        """The slot as ``/slots`` shows it: llama-server's fields (``id``, ``n_ctx``,
        ``speculative``, ``is_processing``, ``id_task``, ``n_prompt_tokens*``, ``params``,
        ``next_token``), then mgserve's: ``state``, ``n_past`` (tokens in the slot's cache, the
        running request's in-flight chunk included) and ``checkpoints`` (position -> in host
        memory, the recurrent-state checkpoints the slot holds). ``spec``: the engine drafts
        (speculation), for this slot's request if it allows. README, Endpoints, says more."""
        s = self.session
        out: dict[str, object] = {
            "id": self.id,
            "n_ctx": n_ctx,
            "speculative": spec and (s is None or s.req.speculative),
            "is_processing": s is not None,
            "id_task": None if s is None else s.req.id,
            "state": "idle" if s is None else "generating" if s.generated else "prefilling",
            "n_past": len(self.cached),
            "checkpoints": [
                {"pos": pos, "memory": "host" if host else "device"}
                for pos, host in sorted(checkpoints.items())
            ],
        }
        if s is not None:
            out |= {
                "n_prompt_tokens": len(s.req.prompt),
                "n_prompt_tokens_cache": s.n_cached,
                "n_prompt_tokens_processed": s.n_done - s.n_cached,
                "params": s.req.sampling.as_json()
                | {"n_predict": s.req.max_tokens, "ignore_eos": s.req.ignore_eos},
                "next_token": [
                    {
                        "has_next_token": True,
                        "n_remain": s.req.max_tokens - len(s.generated),
                        "n_decoded": len(s.generated),
                    }
                ],
            }
        return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
