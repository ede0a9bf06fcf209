"""Speculation's verification, end to end on the CPU: the scheduler with a drafter driving the
reference runner must give exactly the tokens (and ends) of speculation off, whatever the drafts:
the model's own continuation (all accepted), garbage (all rejected) or a mix; greedy and sampled
with penalties; dense (the exact fake model, a tiny llama) and hybrid (tiny qwen3next and
qwen4exp). A partly accepted verify step leaves a recurrent state where plain decode leaves it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from mgserve.config import Settings
from mgserve.core.engine.actor import Engine
from mgserve.core.engine.contract import (
    Request,
    SamplingParams,
    ScheduledBatch,
    SeqWork,
    TokenEvent,
)
from mgserve.core.engine.runner import ReferenceRunner
from mgserve.core.models import load_model
from mgserve.core.models.base import SeqInput
from mgserve.core.models.state import HybridState
from mgserve.core.models.state_qwen4exp import Qwen4ExpState
from tests.core import hybrid_export, qwen4exp_export, tiny
from tests.core.fake_drafter import Replay, ends, serve, tokens
from tests.core.fake_model import FakeModel

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(
    temperature=1.0,
    seed=1234,
    repeat_penalty=1.3,
    presence_penalty=0.3,
    frequency_penalty=0.2,
    repeat_last_n=8,
)
MODES: dict[str, Callable[[int], bool]] = {
    "accepted": lambda pos: False,
    "rejected": lambda pos: True,
    "mixed": lambda pos: pos % 5 in (2, 3),
}


def _llama(path: Path) -> Path:
    return tiny.export(tiny.hf_model("llama"), "llama", path)


def _qwen3next(path: Path) -> Path:
    return hybrid_export.export(hybrid_export.hf_model("qwen3next"), "qwen3next", path)


def _qwen4exp(path: Path) -> Path:
    return qwen4exp_export.export(qwen4exp_export.hf_model(), path)


@pytest.fixture(
    scope="module",
    params=[None, _llama, _qwen3next, _qwen4exp],
    ids=["fake", "llama", "qwen3next", "qwen4exp"],
)
def model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, one_thread: None
) -> Any:
    if request.param is None:
        return FakeModel()
    return load_model(request.param(tmp_path_factory.mktemp("m") / "model.gguf"), threads=1)


def requests(p: SamplingParams, max_tokens: int = 14, **kw: Any) -> list[Request]:
    prompts = [list(range(10, 40)), [5, 9, 13, 5, 9, 13, 5, 9], list(range(3, 24))]
    return [Request(f"r{i}", prompt, p, max_tokens + i, **kw) for i, prompt in enumerate(prompts)]


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_output_is_identical_with_drafts_accepted_rejected_and_mixed(
    model: Any, params: SamplingParams
) -> None:
    reqs = requests(params)
    off = serve(model, reqs)
    want = {rid: [t for t in toks if t is not None] for rid, toks in tokens(off).items()}
    for mode, wrong in MODES.items():
        drafter = Replay(want, k=4, wrong=wrong, n_vocab=model.spec.n_vocab)
        on = serve(model, requests(params), drafter)
        assert tokens(on) == tokens(off), mode
        assert ends(on) == ends(off), mode
        verified = drafter.of("verified")
        assert verified, mode
        accepted = [a for _, _, a in verified]
        if mode == "accepted":
            assert all(a == n for _, n, a in verified)
        elif mode == "rejected":
            assert not any(accepted)
        else:
            assert any(accepted) and any(a < n for _, n, a in verified)
        assert sorted(r for (r,) in drafter.of("finish")) == ["r0", "r1", "r2"]


def test_logprobs_of_verified_tokens_are_those_of_plain_decode() -> None:
    model = FakeModel()  # exact: a row's logits do not depend on the chunk it came in
    p = SamplingParams(temperature=0.7, seed=5, want_logprob=True, n_probs=3, repeat_penalty=1.2)
    off = serve(model, requests(p))
    want = {rid: [t for t in toks if t is not None] for rid, toks in tokens(off).items()}
    on = serve(model, requests(p), Replay(want, k=3, wrong=MODES["mixed"]))

    def strip(evs: dict[str, list[TokenEvent]]) -> dict[str, list[TokenEvent]]:
        return {r: [dataclasses.replace(e, t_prompt_done=None) for e in v] for r, v in evs.items()}

    assert strip(on) == strip(off)  # every event: token, logprob, top candidates, counts


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there() -> None:
    model = FakeModel()
    reqs = requests(GREEDY, max_tokens=20)
    want = {
        rid: [t for t in toks if t is not None] for rid, toks in tokens(serve(model, reqs)).items()
    }
    cont = want["r0"]
    i = next(i for i in range(3, len(cont)) if cont[i] not in cont[:i])  # its first occurrence
    stopped = requests(GREEDY, max_tokens=20, stop_token_ids=frozenset({cont[i]}))
    off = serve(model, stopped)
    assert ends(off)["r0"] == ("stop", i + 1)
    drafter = Replay(want, k=8)
    on = serve(model, stopped, drafter)
    assert tokens(on) == tokens(off) and ends(on) == ends(off)
    # the run that held the stop token had drafts past it: they were verified, then dropped
    assert any(a > 0 for r, _, a in drafter.of("verified") if r == "r0")


def test_the_context_end_inside_an_accepted_run_ends_the_request_there() -> None:
    model = FakeModel()
    reqs = [Request("a", list(range(1, 21)), GREEDY, 100), Request("b", [3, 4, 5], GREEDY, 9)]
    off = serve(model, reqs, n_ctx=32)
    assert ends(off)["a"] == ("length", 13)  # the prompt's token, then 12 fed back at 20..31
    want = {rid: [t for t in toks if t is not None] for rid, toks in tokens(off).items()}
    drafter = Replay(want, k=5)
    on = serve(model, reqs, drafter, n_ctx=32)
    assert tokens(on) == tokens(off) and ends(on) == ends(off)
    reach = [depth + limit for r, _, depth, limit in drafter.of("propose") if r == "a"]
    assert max(reach) == 31  # drafts up to the last position, never past it


@pytest.mark.parametrize("wrong_at", range(5))
def test_the_runner_accepts_exactly_the_matching_prefix(wrong_at: int) -> None:
    model = FakeModel()
    prompt = [1, 2, 3]
    greedy = model.greedy(prompt, 6)
    runner = ReferenceRunner(model, n_slots=1, n_ctx=32)
    w = SeqWork(0, "r", tuple(prompt), 0, True, GREEDY, new_sequence=True)
    assert [r.token for r in runner.run(ScheduledBatch(1, (w,))).results] == greedy[:1]
    drafts = list(greedy[1:5])
    if wrong_at < 4:
        drafts[wrong_at] = (drafts[wrong_at] + 1) % 64
    w = SeqWork(0, "r", (greedy[0], *drafts), 3, True, GREEDY, n_draft=4)
    got = [r.token for r in runner.run(ScheduledBatch(2, (w,))).results]
    assert got == greedy[1 : 2 + wrong_at]  # the accepted drafts, then the model's own token
    assert model.calls[-1] == [(3, 5, 5)]  # one forward, logits at all 1 + 4 positions


def test_a_verify_entry_the_contract_rules_out_is_refused() -> None:
    runner = ReferenceRunner(FakeModel(), n_slots=1, n_ctx=32)
    w = SeqWork(0, "r", (1, 2, 3), 0, True, GREEDY, new_sequence=True, n_draft=2)
    with pytest.raises(ValueError, match="new_sequence"):
        runner.run(ScheduledBatch(1, (w,)))
    runner.run(ScheduledBatch(1, (SeqWork(0, "r", (1,), 0, True, GREEDY, new_sequence=True),)))
    with pytest.raises(ValueError, match="with force"):
        runner.run(
            ScheduledBatch(2, (SeqWork(0, "r", (4, 5), 1, True, GREEDY, force=3, n_draft=1),))
        )


def _live(state: HybridState) -> list[torch.Tensor]:
    """What a recurrent state's next step reads: its snapshot's tensors, of qwen4exp's pending
    QSA keys only the rows of the incomplete block (the rest are stale in any run)."""
    snap = state.snapshot()
    if isinstance(state, Qwen4ExpState):
        r = state.pending.shape[1]
        return [*snap.base[1:], snap.ple_conv, snap.ple_tokens, snap.pending[:, : state.pos % r]]
    return list(snap[1:])


def test_a_partly_accepted_step_leaves_the_state_of_plain_decode(model: Any) -> None:
    """Drafts (y1, y2, wrong, ...) after y0: the slot ends at y2's position, its recurrent state,
    pending QSA keys and block keys (qwen4exp, whose blocks of 4 the rejected rows complete) as
    plain decode leaves them; the next step's logits agree."""
    prompt = list(range(20, 30))  # y0 goes in at 10; drafts at 11..16, rejected from 13 on
    n = len(prompt)
    plain = ReferenceRunner(model, n_slots=1, n_ctx=64)
    spec = ReferenceRunner(model, n_slots=1, n_ctx=64)
    first = SeqWork(0, "r", tuple(prompt), 0, True, GREEDY, new_sequence=True)
    ys = [r.token for r in plain.run(ScheduledBatch(1, (first,))).results]
    assert [r.token for r in spec.run(ScheduledBatch(1, (first,))).results] == ys
    for i in range(3):  # plain decode: y0 y1 y2 fed one by one, giving y1 y2 y3
        (r,) = plain.run(
            ScheduledBatch(2 + i, (SeqWork(0, "r", (ys[-1],), n + i, True, GREEDY),))
        ).results
        ys.append(r.token)
    v = model.spec.n_vocab
    drafts = (ys[1], ys[2], (ys[3] + 1) % v, ys[3], (ys[3] + 7) % v, 1)
    w = SeqWork(0, "r", (ys[0], *drafts), n, True, GREEDY, n_draft=len(drafts))
    got = [r.token for r in spec.run(ScheduledBatch(2, (w,))).results]
    assert got == ys[1:4]  # y1, y2 accepted, then the model's y3 (not the wrong draft)
    # both slots hold prompt + y0 y1 y2; y3 goes in at n + 3
    a, b = plain._cache(0), spec._cache(0)
    if isinstance(a, HybridState):
        assert isinstance(b, HybridState) and a.pos == b.pos == n + 3
        for x, y in zip(_live(a), _live(b), strict=True):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-5)
    if isinstance(a, Qwen4ExpState):
        assert isinstance(b, Qwen4ExpState)
        done = (n + 3) // model.qp.ratio  # complete blocks
        torch.testing.assert_close(b.blocks[:, :done], a.blocks[:, :done], rtol=1e-4, atol=1e-5)
    want = model.forward([SeqInput(a, torch.tensor([ys[3]]), n + 3, 1)])
    got_logits = model.forward([SeqInput(b, torch.tensor([ys[3]]), n + 3, 1)])
    torch.testing.assert_close(got_logits, want, rtol=1e-4, atol=1e-4)


async def test_the_engine_drafts_only_with_a_runner_that_supports_drafts() -> None:
    model = FakeModel()
    settings = Settings(parallel=1, ctx_size=64, batch_size=8)
    cont = model.greedy([1, 2, 3], 10)
    drafter = Replay({"a": cont}, k=4)
    engine = Engine(model, settings, drafter=drafter)
    await engine.start()
    try:
        got = [ev.token async for ev in engine.submit(Request("a", [1, 2, 3], GREEDY, 10))]
    finally:
        await engine.stop()
    assert got == cont and drafter.of("verified")

    class Plain(ReferenceRunner):
        supports_drafts = False

    other = Engine(model, settings, runner=Plain(model, 1, 64), drafter=drafter)
    assert other._sched.spec.drafter is None
