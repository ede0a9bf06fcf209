"""Speculation policies replayed offline: ``mgserve bench spec-sim``.

Greedy decoding's tokens do not depend on speculation (it only changes how many of them a step
emits), so a workload's continuation, generated once, lets every policy be replayed without the
model: at each step the real ``Speculator`` (n-gram index and gate) proposes drafts, the drafts
that match the continuation are accepted, and the step costs what a verify step of that many
drafts was measured to cost, relative to a plain decode step (``--costs``: k:ratio pairs, linear
between them; by default the H100 figures for Gemma 3 270M from BENCHMARKS.md). The predicted
speed-up is plain steps over those costs. It leaves out what is not a decode step (the prompt,
the host's share of a request) and assumes a step's cost depends only on its draft count.

A model of the end-to-end figure, not a measurement: the row of the current settings can be set
beside ``mgserve bench spec``'s measured one to check it, and the other rows say which settings
to measure next. The continuations come from the model on the CPU (``--device``), once per
workload, cached in ``--tokens`` when given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import NamedTuple

from mgserve.bench.spec import WORKLOADS

# a verify step of k drafts / a plain decode step: Gemma 3 270M, H100 (BENCHMARKS.md 2026-12-05)
H100_GEMMA = "4:1.51,8:2.14,16:3.46,48:8.0"
DEFAULT = (16, 2, 8, 0.2)  # --spec-k, --spec-ngram-min, --spec-ngram-max, --spec-min-acceptance


class Policy(NamedTuple):
    k_max: int
    ngram_min: int
    ngram_max: int
    min_acceptance: float


class Outcome(NamedTuple):
    speedup: float
    proposed: int
    accepted: int
    drafting_steps: int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gemma-3-270m", help="GGUF file or built-in model name")
    p.add_argument("--device", default="cpu", help="where the continuations are generated")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--workloads", default="rewrite,explain")
    p.add_argument("--costs", default=H100_GEMMA, help="k:ratio,... verify / plain step cost")
    p.add_argument("--tokens", help="JSON cache of the continuations (read if it exists)")
    p.add_argument("--k", default="4,8,16,32", help="--spec-k values to try")
    p.add_argument("--ngram-min", default="1,2,3", help="--spec-ngram-min values to try")
    p.add_argument("--ngram-max", default="4,8,12", help="--spec-ngram-max values to try")


def parse_costs(text: str) -> list[tuple[int, float]]:
    pts = sorted((int(k), float(r)) for k, r in (p.split(":") for p in text.split(",")))
    if not pts or any(k < 1 or r <= 0 for k, r in pts):
        raise ValueError(f"--costs {text!r}: k:ratio pairs with k >= 1 and ratio > 0")
    return [(0, 1.0), *pts]


def step_cost(costs: list[tuple[int, float]], k: int) -> float:
    """A step of ``k`` drafts in plain steps: linear between the measured points (and past the
    last, along its last segment)."""
    for (k0, r0), (k1, r1) in zip(costs, costs[1:], strict=False):
        if k <= k1:
            return r0 + (r1 - r0) * (k - k0) / (k1 - k0)
    (k0, r0), (k1, r1) = costs[-2], costs[-1]
    return r1 + (r1 - r0) * (k - k1) / (k1 - k0)


def simulate(
    context: list[int], out: list[int], policy: Policy, costs: list[tuple[int, float]]
) -> Outcome:
    """Replay greedy decoding of ``out`` after ``context`` under ``policy``."""
    from mgserve.core.engine.contract import Request, SamplingParams
    from mgserve.spec.gate import SpecGate
    from mgserve.spec.speculator import Speculator

    gate = SpecGate(max_users=2, min_acceptance=policy.min_acceptance)
    spec = Speculator(gate, policy.k_max, policy.ngram_min, policy.ngram_max)
    req = Request("s", list(context), SamplingParams(temperature=0.0), len(out))
    spec.start(req, context)
    spec.extend("s", out[:1])  # the prompt's step gave the first token
    pos, seconds, proposed, accepted, drafting = 1, 0.0, 0, 0, 0
    while pos < len(out):
        depth = len(context) + pos
        drafts = spec.propose("s", 1, depth, len(out) - pos - 1)
        k = len(drafts)
        n = 0
        while n < k and drafts[n] == out[pos + n]:
            n += 1
        cost = step_cost(costs, k)
        seconds += cost
        spec.observe_step(k, depth, 1, cost)
        if k:
            spec.verified("s", k, n)
            proposed, accepted, drafting = proposed + k, accepted + n, drafting + 1
        spec.extend("s", out[pos : pos + n + 1])
        pos += n + 1
    return Outcome((len(out) - 1) / seconds, proposed, accepted, drafting)


async def _generate(a: argparse.Namespace) -> dict[str, tuple[list[int], list[int]]]:
    from mgserve.api.service import build_service
    from mgserve.config import Settings
    from mgserve.core.engine.contract import Request, SamplingParams

    service = build_service(Settings(model=a.model, device=a.device, ctx_size=4096, spec="off"))
    engine = service.engine
    await engine.start()
    try:
        got = {}
        for w in a.workloads.split(","):
            ids = service.tokenizer.encode(WORKLOADS[w][0], add_special=True, parse_special=True)
            req = Request(w, ids, SamplingParams(temperature=0.0), a.max_tokens, ignore_eos=True)
            out = [e.token async for e in engine.submit(req) if e.token is not None]
            got[w] = (ids, out)
        return got
    finally:
        await engine.stop()


def continuations(a: argparse.Namespace) -> dict[str, tuple[list[int], list[int]]]:
    cache = Path(a.tokens) if a.tokens else None
    if cache is not None and cache.is_file():
        data = json.loads(cache.read_text())
        if all(w in data for w in a.workloads.split(",")):
            return {w: (data[w][0], data[w][1]) for w in a.workloads.split(",")}
    got = asyncio.run(_generate(a))
    if cache is not None:
        cache.write_text(json.dumps(got))
    return got


def run(a: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    costs = parse_costs(a.costs)
    data = continuations(a)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    grid = [
        Policy(k, lo, hi, DEFAULT[3])
        for k in ints(a.k)
        for lo in ints(a.ngram_min)
        for hi in ints(a.ngram_max)
        if lo <= hi
    ]
    lines = [
        f"costs (verify / plain step by drafts): {a.costs}; {a.max_tokens} greedy tokens a "
        "workload, generated by the model on the CPU",
        "",
        "| workload | spec-k | ngram-min | ngram-max | predicted speed-up | proposed | accepted "
        "| accepted / proposed | tokens per drafting step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for w, (context, out) in data.items():
        results = sorted(
            ((simulate(context, out, p, costs), p) for p in grid), key=lambda r: -r[0].speedup
        )
        default = next((r for r in results if r[1] == Policy(*DEFAULT)), None)
        shown = results[:5] + ([default] if default and default not in results[:5] else [])
        for o, p in shown:
            mark = " (default)" if p == Policy(*DEFAULT) else ""
            acc = f"{o.accepted / o.proposed:.2f}" if o.proposed else "-"
            per = (
                f"{(o.drafting_steps + o.accepted) / o.drafting_steps:.2f}"
                if o.drafting_steps
                else "-"
            )
            lines.append(
                f"| {w} | {p.k_max}{mark} | {p.ngram_min} | {p.ngram_max} | {o.speedup:.2f} "
                f"| {o.proposed} | {o.accepted} | {acc} | {per} |"
            )
    text = "\n".join(lines)
    print(text)
    print(f"({time.perf_counter() - t0:.0f} s)")
    if a.record:
        from mgserve.bench import record

        record("n-gram speculation policies, replayed (a model, not a measurement)", text)
    return 0
