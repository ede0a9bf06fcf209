"""The speculator through a fake scheduler: drafts for a rewrite of the prompt hold and cut the
steps; random text and dear verifies stop drafting; a request's own bounds and switch; nothing
leaks between requests; the counters add up; the settings build it."""

from __future__ import annotations

import argparse
import random

import pytest

from mgserve.config import Settings, add_arguments, settings_from
from mgserve.core.engine.contract import Request, SamplingParams
from mgserve.spec.speculator import Speculator, speculator_from

PLAIN = 0.010


def request(rid: str, prompt: list[int], **kw: object) -> Request:
    return Request(id=rid, prompt=prompt, sampling=SamplingParams(temperature=0.0),
                   max_tokens=10_000, **kw)  # type: ignore[arg-type]  # fmt: skip


def warmed(**kw: object) -> Speculator:
    """A speculator whose gate has measured plain steps of one session."""
    spec = Speculator(**kw)  # type: ignore[arg-type]
    for _ in range(2):
        spec.observe_step(0, 100, 1, PLAIN)
    return spec


def run(spec: Speculator, req: Request, target: list[int], verify_cost: float = 0.01) -> int:
    """A scheduler's loop generating ``target`` after ``req.prompt`` (the model's greedy output):
    each step verifies the drafts, emits the ones that held and the model's next token. Returns
    the steps taken; ``verify_cost``: a draft's extra seconds, as a share of a plain step."""
    spec.start(req, req.prompt)
    done, steps = 0, 0
    while done < len(target):
        depth = len(req.prompt) + done
        drafts = spec.propose(req.id, 1, depth, len(target) - done - 1)
        assert len(drafts) <= len(target) - done - 1
        held = 0
        while held < len(drafts) and drafts[held] == target[done + held]:
            held += 1
        emitted = target[done : done + held + 1]
        if drafts:
            spec.verified(req.id, len(drafts), held)
        spec.extend(req.id, emitted)
        spec.observe_step(len(drafts), depth, 1, PLAIN * (1 + verify_cost * len(drafts)))
        done += len(emitted)
        steps += 1
    spec.finish(req.id)
    return steps


def code(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def test_a_rewrite_with_small_changes_takes_far_fewer_steps() -> None:
    rng = random.Random(0)
    source = code(rng, 400)
    rewrite = list(source)
    for at in (50, 170, 290):  # three small edits
        rewrite[at : at + 2] = code(rng, 3)
    spec = warmed()
    steps = run(spec, request("r", [1, *source, 2]), rewrite)
    s = spec.stats
    assert steps < len(rewrite) / 4
    assert s.accepted / s.proposed > 0.8
    assert s.emitted == s.verifies + s.accepted
    assert s.steps == s.verifies  # one session: each drafting step is one session's
    assert s.proposed == sum(s.proposed_by_position)
    assert s.accepted == sum(s.accepted_by_position)
    assert s.accepted_by_position == sorted(s.accepted_by_position, reverse=True)
    assert all(a <= p for a, p in zip(s.accepted_by_position, s.proposed_by_position, strict=True))
    assert len(s.proposed_by_position) <= 16  # --spec-k
    assert s.tokens_per_step > 3
    assert s.by_request == {}  # forgotten at finish


def test_random_text_drafts_little_and_costs_few_steps() -> None:
    rng = random.Random(1)
    prompt = [rng.randrange(4) for _ in range(200)]  # a tiny vocabulary: n-grams always match
    target = [rng.randrange(4) for _ in range(600)]
    spec = warmed()
    steps = run(spec, request("r", prompt), target)
    s = spec.stats
    assert s.accepted / s.proposed < 0.5
    # after the first misses, mostly probes (one per probe_every steps) carry drafts
    assert s.verifies < 0.15 * steps
    assert steps > len(target) * 0.7


def test_a_verify_as_dear_as_its_tokens_stops_drafting() -> None:
    rng = random.Random(2)
    source = code(rng, 300)
    spec = warmed()
    run(spec, request("r", source), source, verify_cost=1.0)  # a CPU: each draft a whole token
    # the first verify of a kind is a warm-up; the next two show the cost, then none
    assert spec.stats.verifies <= 3


def test_speculative_false_never_drafts() -> None:
    rng = random.Random(3)
    source = code(rng, 200)
    spec = warmed()
    assert run(spec, request("r", source, speculative=False), source) == len(source)
    assert spec.stats.proposed == 0
    assert spec.propose("r", 1, 10, 16) == ()


@pytest.mark.parametrize(("draft_max", "draft_min"), [(3, 0), (1, 1), (16, 12), (4, 4)])
def test_a_requests_bounds(draft_max: int, draft_min: int) -> None:
    rng = random.Random(4)
    source = code(rng, 40)
    spec = warmed()
    req = request("r", [*source, *source[:10]], draft_max=draft_max, draft_min=draft_min)
    spec.start(req, req.prompt)
    drafts = spec.propose("r", 1, 50, 100)
    expected = tuple(source[10 : 10 + min(draft_max, 8)])  # the gate's choice is 8 at the start
    if draft_min > 8:
        expected = tuple(source[10 : 10 + draft_min])
    assert drafts == expected
    assert len(spec.propose("r", 1, 50, draft_min - 1)) == 0  # the minimum does not fit


def test_fewer_drafts_than_the_minimum_are_not_proposed() -> None:
    spec = warmed()
    spec.start(request("r", [5, 6, 7, 8, 5, 6]), [5, 6, 7, 8, 5, 6])
    assert spec.propose("r", 1, 6, 16) == (7, 8, 5, 6)
    spec.start(request("m", [5, 6, 7, 8, 5, 6], draft_min=5), [5, 6, 7, 8, 5, 6])
    assert spec.propose("m", 1, 6, 16) == ()


def test_the_server_maximum_caps_a_request_and_more_users_stop_it() -> None:
    spec = warmed(k_max=2)
    for n in (1, 2, 3):
        spec.observe_step(0, 100, n, PLAIN)
        spec.observe_step(0, 100, n, PLAIN)
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    spec.start(request("r", tokens, draft_max=8), tokens)
    assert spec.propose("r", 1, 8, 16) == (3, 4)
    assert spec.propose("r", 2, 8, 16) == (3, 4)
    assert spec.propose("r", 3, 8, 16) == ()


def test_nothing_leaks_between_requests() -> None:
    spec = warmed()
    a = [9, 8, 7, 6, 5, 4, 3]
    spec.start(request("a", a), a)
    spec.extend("a", [9, 8])
    assert spec.propose("a", 1, 9, 4) == (7, 6, 5, 4)
    spec.start(request("b", [1, 9, 8]), [1, 9, 8])  # its suffix occurred only in a's context
    assert spec.propose("b", 1, 3, 4) == ()
    spec.finish("a")
    spec.start(request("a", [2, 9, 8]), [2, 9, 8])  # the same id again: a fresh index
    assert spec.propose("a", 1, 3, 4) == ()


def test_unknown_requests_are_ignored() -> None:
    spec = warmed()
    spec.extend("x", [1, 2])
    assert spec.propose("x", 1, 2, 4) == ()
    spec.finish("x")


def test_settings_build_it() -> None:
    assert speculator_from(Settings(spec="off")) is None
    assert speculator_from(Settings(spec_k=0)) is None
    spec = speculator_from(
        Settings(spec_k=6, spec_max_users=1, spec_ngram_min=3, spec_ngram_max=5,
                 spec_min_acceptance=0.5)
    )  # fmt: skip
    assert spec is not None
    assert (spec.k_max, spec.ngram_min, spec.ngram_max) == (6, 3, 5)
    assert (spec.gate.max_users, spec.gate.min_acceptance) == (1, 0.5)
    with pytest.raises(ValueError, match="spec-ngram"):
        Settings(spec_ngram_min=4, spec_ngram_max=3)
    with pytest.raises(ValueError, match="spec-min-acceptance"):
        Settings(spec_min_acceptance=1.5)
    with pytest.raises(ValueError, match="spec"):
        Settings(spec="maybe")


def test_the_settings_as_flags_and_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = ["--spec", "off", "--draft-max", "4", "--spec-min-acceptance", "0.35"]
    s = settings_from(parser.parse_args(args))
    assert (s.spec, s.spec_k, s.spec_min_acceptance) == ("off", 4, 0.35)
    for name, value in [("SPEC_MAX_USERS", "3"), ("SPEC_K", "12"), ("SPEC_NGRAM_MAX", "6"),
                        ("SPEC_NGRAM_MIN", "3"), ("SPEC_MIN_ACCEPTANCE", "0.1")]:  # fmt: skip
        monkeypatch.setenv(f"MGSERVE_{name}", value)
    s = settings_from(parser.parse_args([]))
    assert (s.spec, s.spec_max_users, s.spec_k, s.spec_ngram_max, s.spec_ngram_min) == (
        "on", 3, 12, 6, 3,
    )  # fmt: skip
    assert s.spec_min_acceptance == 0.1
    assert settings_from(parser.parse_args(["--spec-k", "2"])).spec_k == 2  # the flag wins
    monkeypatch.setenv("MGSERVE_SPEC_MIN_ACCEPTANCE", "high")
    with pytest.raises(ValueError, match="MGSERVE_SPEC_MIN_ACCEPTANCE='high' is not a valid float"):
        settings_from(parser.parse_args([]))
