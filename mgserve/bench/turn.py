"""A long conversation's next turn: time to first token with prefix reuse against a cold start
(issue 12).

The model (``mgserve bench model``'s options: a GGUF file or a synthetic ``--shape``) runs through
the scheduler and the ``DeviceRunner`` as the engine actor drives them (bench/mixed.py's loop:
plan, run, sync, apply), with recurrent-state checkpoints as the server takes them
(``--checkpoint-every``, ``--ctx-checkpoints``, ``--cache-ram``: the server's defaults), so the
first turn's prompt is really computed, chunk by chunk, and its checkpoints are real.

Turns, on synthetic token ids: (1) the first turn, a ``--prompt`` of P tokens in slot 0 and
``--generated`` A tokens decoded; (2) the next turn: the first prompt, the A generated tokens
and ``--user`` U new ones, in slot 1 with reuse off (``cache_prompt: false``): cold; (3) the
same in slot 0, reusing what the slot holds; (4) an edited turn in slot 0: the first prompt
with its last ``--edit`` E tokens changed, from the nearest checkpoint. Its cold start is the
first turn: a prompt of the same length computed from nothing. TTFT: from the request's
submission to its first token, every step synced; "computed": the prompt tokens that went
through the model.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from mgserve.bench.mixed import GREEDY
from mgserve.bench.model.args import add_model_arguments
from mgserve.bench.model.harness import ModelBench
from mgserve.config import Settings
from mgserve.core.engine.checkpoints import CheckpointBook
from mgserve.core.engine.contract import Request
from mgserve.core.engine.scheduler import Scheduler


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.set_defaults(slots=2)
    served = Settings()
    for flag, default, what in (
        ("--prompt", 250000, "the first turn's prompt tokens (P)"),
        ("--generated", 16, "tokens the first turn decodes, appended to the next turn (A)"),
        ("--user", 200, "new user tokens of the next turn (U)"),
        ("--edit", 1000, "the edited turn: the first prompt with its last E tokens changed"),
        ("--checkpoint-every", served.checkpoint_every, "as the server's --checkpoint-every"),
        ("--ctx-checkpoints", served.ctx_checkpoints, "as the server's --ctx-checkpoints"),
        ("--cache-ram", served.cache_ram, "as the server's --cache-ram (MiB)"),
    ):
        parser.add_argument(flag, type=int, default=default, help=what)


@dataclass
class Turn:
    ttft: float = 0.0  # seconds from submission to the first token
    cached: int = 0  # prompt tokens reused (the event's n_cached: timings.cache_n)
    computed: int = 0  # prompt tokens that went through the model
    tokens: list[int] = field(default_factory=list)  # generated
    decode: list[float] = field(default_factory=list)  # seconds per decode step


def serve(b: ModelBench, sched: Scheduler, req: Request) -> Turn:
    """``req`` through ``sched`` and the runner, alone, step by step until it ends."""
    turn = Turn()
    sched.add(req)
    t0 = last = time.perf_counter()
    while sched.has_work():
        batch = sched.schedule()
        assert batch is not None
        n_prompt = len(req.prompt)
        turn.computed += sum(len(w.tokens) for w in batch.work if w.start < n_prompt)
        result = b.runner.run(batch)
        b.sync()
        events = sched.apply(result)
        now = time.perf_counter()
        sched.observe(batch.step, now - last)
        for ev in events:
            if not turn.tokens:
                turn.ttft, turn.cached = now - t0, ev.n_cached
            else:
                turn.decode.append(now - last)
            assert ev.token is not None
            turn.tokens.append(ev.token)
        last = now
    return turn


def _check(args: argparse.Namespace) -> None:
    n_next = args.prompt + args.generated + args.user
    if args.slots < 2:
        raise ValueError(f"--slots {args.slots} < 2 (the warm slot and the cold one)")
    if min(args.generated, args.user, args.edit) < 1 or not 1 < n_next < args.ctx:
        raise ValueError(f"--prompt + --generated + --user must be in 2..{args.ctx - 1} "
                         f"(--ctx {args.ctx}), each at least 1")  # fmt: skip
    if args.edit >= args.prompt:
        raise ValueError(f"--edit {args.edit} must be below --prompt {args.prompt}")


def _edited(b: ModelBench, prompt: list[int], n: int) -> list[int]:
    """``prompt`` with its last ``n`` tokens replaced; the first of them surely differs."""
    new = list(b.tokens(n, 11))
    if new[0] == prompt[-n]:
        new[0] = prompt[-n] + 1 if prompt[-n] + 1 < b.vocab else prompt[-n] - 1
    return prompt[:-n] + new


def run(args: argparse.Namespace) -> int:
    _check(args)
    b = ModelBench(args)
    book = None
    if not b.model.rewindable and args.ctx_checkpoints:
        book = CheckpointBook(max(args.checkpoint_every, 0), args.ctx_checkpoints,
                              args.cache_ram << 20, b.runner.checkpoint_nbytes)  # fmt: skip
    sched = Scheduler(args.slots, args.ctx, args.ubatch, rewindable=b.model.rewindable,
                      checkpoints=book)  # fmt: skip
    P, A, U, E = args.prompt, args.generated, args.user, args.edit
    ckpt = "off" if book is None else (
        f"every {args.checkpoint_every}, {args.ctx_checkpoints} per slot on the device, "
        f"{args.cache_ram} MiB host, {book.nbytes / 2**20:.2f} MiB each"
    )  # fmt: skip
    lines = [
        f"model: {b.source}, {b.model.spec.arch}, {b.model.spec.n_layer} layers, on {b.where()}",
        f"a {P}-token conversation, {A} tokens decoded, then {U} new user tokens; the edited "
        f"turn changes its last {E} tokens; ubatch {args.ubatch}, ctx {args.ctx}, "
        f"checkpoints {ckpt}",
        "",
        "| turn | prompt | reused (cache_n) | computed | TTFT s | speed-up |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    print("\n".join(lines), flush=True)

    def row(name: str, req: Request, base: Turn | None = None) -> Turn:
        t = serve(b, sched, req)
        up = f"{base.ttft / t.ttft:.1f}x" if base else "-"
        n = len(req.prompt)
        lines.append(f"| {name} | {n} | {t.cached} | {t.computed} | {t.ttft:.3f} | {up} |")
        print(lines[-1], flush=True)
        return t

    first = list(b.tokens(P, 7))
    turn1 = row("first turn, cold", Request("first", first, GREEDY, A, slot=0))
    nxt = first + turn1.tokens + list(b.tokens(U, 8))
    cold = row("next turn, cold (reuse off)", Request("cold", nxt, GREEDY, 1, slot=1,
                                                      reuse_prefix=False))  # fmt: skip
    warm = row("next turn, reused", Request("next", nxt, GREEDY, 1, slot=0), cold)
    row("edited turn, reused", Request("edited", _edited(b, first, E), GREEDY, 1, slot=0), turn1)
    same = "the same" if warm.tokens == cold.tokens else "not the same"
    decode_ms = sum(turn1.decode) / max(len(turn1.decode), 1) * 1e3
    lines += [
        "",
        f"- the next turn's first token reused and cold: {same} (the reused path continues the "
        f"live state past decoded tokens: equal up to rounding)",
        f"- the edited turn's cold start is the first turn (a prompt of as many tokens); the "
        f"first turn decoded {A} tokens at {decode_ms:.1f} ms a step",
    ]
    body = "\n".join(lines)
    print("\n".join(lines[-3:]))
    if args.record:
        from mgserve.bench import record

        record(f"next turn of a {P}-token conversation: TTFT reused vs cold "
               f"({b.model.spec.arch}, {b.device.type})", body)  # fmt: skip
    return 0
