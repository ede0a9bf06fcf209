"""A session whose grammar matcher fails mid-generation ends alone, with the matcher's error; the
sessions that shared its steps carry on and give the tokens they give alone (grammar.matcher
.Isolated, StepResult.failed). Before, the failure was the whole step's and ended every session
in it. The reference engine on the fake model, and the device runner on the torch backend."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from mgserve.core.engine.actor import Engine
from mgserve.core.engine.contract import Request, ScheduledBatch, SeqWork
from mgserve.core.grammar import Isolated
from tests.core.fake_model import FakeModel
from tests.core.test_engine import GREEDY, collect, run_alone, settings

N_VOCAB = 64


class BreakingGrammar:
    """Allows every token; its matcher fails on the ``after``-th advance (``where``: in the
    advance, or in the next mask), or when it is made (``after`` -1)."""

    def __init__(self, after: int, where: str = "advance", n_vocab: int = N_VOCAB) -> None:
        self.after, self.where, self.n_vocab = after, where, n_vocab

    def matcher(self) -> BreakingMatcher:
        if self.after < 0:
            raise RuntimeError("no matcher for you")
        return BreakingMatcher(self)


class BreakingMatcher:
    def __init__(self, g: BreakingGrammar) -> None:
        self.g, self.n = g, 0

    def fill(self, row: np.ndarray) -> None:
        if self.g.where == "mask" and self.n >= self.g.after:
            raise RuntimeError("mask: parser too complex")
        row[:] = -1

    def allowed(self) -> torch.Tensor:
        self.fill(np.empty(2, dtype=np.int32))
        return torch.arange(self.g.n_vocab)

    def advance(self, token: int) -> None:
        self.n += 1
        if self.g.where == "advance" and self.n >= self.g.after:
            raise RuntimeError("advance: lexer error")


def test_isolated_keeps_the_error_and_allows_everything() -> None:
    m = Isolated(BreakingGrammar(2, "mask", n_vocab=40).matcher, 40)
    row = np.zeros(2, dtype=np.int32)
    m.fill(row)
    m.advance(3)
    m.advance(4)
    assert m.error is None
    m.fill(row)
    assert m.error is not None and "parser too complex" in m.error
    assert (row == -1).all() and torch.equal(m.allowed(), torch.arange(40))
    broken = Isolated(BreakingGrammar(-1).matcher, N_VOCAB)
    assert broken.error is not None and "no matcher for you" in broken.error


@pytest.mark.parametrize(("after", "where"), [(3, "advance"), (3, "mask"), (-1, "advance")])
async def test_a_failing_grammar_ends_only_its_own_session(after: int, where: str) -> None:
    model = FakeModel()
    others = [Request(f"r{i}", [3 + i, 9, 4 + i], GREEDY, max_tokens=10) for i in range(2)]
    alone = [[e.token for e in await run_alone(model, r)] for r in others]
    bad = Request("bad", [7, 7, 7], GREEDY, 10, grammar=BreakingGrammar(after, where))  # type: ignore[arg-type]
    engine = Engine(model, settings(parallel=3))
    await engine.start()
    try:
        got = await asyncio.gather(*(collect(engine.submit(r)) for r in [bad, *others]))
        assert engine.slots() and all(s["state"] == "idle" for s in engine.slots())
        again = await collect(engine.submit(others[0]))  # the engine serves on
    finally:
        await engine.stop()
    ends = got[0][-1]
    assert ends.finish_reason == "error" and ends.error and "grammar matcher failed" in ends.error
    # the token whose advance failed is dropped with the session; a mask fails before its draw
    n_ok = 0 if after < 0 else after - 1 if where == "advance" else after
    assert len([e for e in got[0] if e.token is not None]) == n_ok
    for evs, want in zip(got[1:], alone, strict=True):
        assert [e.token for e in evs] == want and evs[-1].finish_reason == "length"
    assert [e.token for e in again] == alone[0]


def test_the_device_runner_reports_the_failing_session_alone(tmp_path: Path) -> None:
    from mgserve.cuda.backend import torch_backend
    from tests.cuda.test_device_drafts import _runner

    runner = _runner("qwen3", tmp_path, torch.device("cpu"), torch_backend(), graphs=False)
    v = runner.model.spec.n_vocab
    bad = BreakingGrammar(2, "advance", n_vocab=v)
    prompt = (11, 12, 13, 14)
    work = [
        SeqWork(0, "ok", prompt, 0, True, GREEDY, new_sequence=True),
        SeqWork(1, "bad", prompt, 0, True, GREEDY, new_sequence=True, grammar=bad),  # type: ignore[arg-type]
    ]
    out = runner.run(ScheduledBatch(1, tuple(work)))
    assert out.failed == {}
    toks = {r.request_id: r.token for r in out.results}
    nxt = [
        SeqWork(s, rid, (toks[rid],), len(prompt), True, GREEDY)
        for s, rid in ((0, "ok"), (1, "bad"))
    ]
    out = runner.run(ScheduledBatch(2, tuple(nxt)))
    assert set(out.failed) == {"bad"} and "advance: lexer error" in out.failed["bad"]
    assert [r.request_id for r in out.results] == ["ok", "bad"]  # rows stay in work order
