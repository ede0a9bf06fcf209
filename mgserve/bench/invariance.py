"""Batch invariance: whether a sequence's logits depend on the other sequences in its step.

K prompts of lengths spread over ``--lengths`` (seeded tokens, prompt i in slot i) go through the
``DeviceRunner`` as serving runs them (``ScheduledBatch`` steps, decode graphs, device sampling), on
the model ``mgserve bench model`` loads (``--model`` or a synthetic ``--shape``, same options):

- prefill: each prompt alone in one step, then all K in one step; the logits of each prompt's
  last token compared;
- decode: each prompt, prefilled alone, decodes ``--decode-steps`` greedy tokens alone; then all K,
  prefilled alone again, decode together in the same steps, each fed the tokens it chose alone
  (both runs see the same inputs); the logits of every step compared. The second alone prefill is
  also compared with the first: a difference there is nondeterminism, not batch dependence.

Issue 10 asks for bitwise equality (``torch.equal``). The table gives per prompt whether it holds,
the largest |difference| of logits and the first generated token whose greedy choice differs; the
exit code is 0 only if every comparison is bitwise equal.
"""

from __future__ import annotations

import argparse
from typing import Any, NamedTuple

import torch

from mgserve.bench.model.args import add_model_arguments
from mgserve.bench.model.harness import ModelBench
from mgserve.cuda.sampling import DeviceSampler


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.set_defaults(ctx=8192)  # the longest prompt and its decode steps, not a serving context
    parser.add_argument("--prompts", type=int, default=5, help="prompts (K), one slot each")
    parser.add_argument(
        "--lengths", default="300..4000", help="A..B: prompt lengths evenly spread from A to B"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts' tokens")
    parser.add_argument("--decode-steps", type=int, default=8, help="decode steps compared")


def lengths(text: str, k: int) -> list[int]:
    """``"A..B"`` -> k lengths evenly spread from A to B (A alone when k == 1)."""
    a, sep, b = text.partition("..")
    lo, hi = int(a), int(b if sep else a)
    if not 1 <= lo <= hi or k < 1:
        raise ValueError(f"--lengths {text!r} with --prompts {k}: need 1 <= A <= B and K >= 1")
    return [lo + (hi - lo) * i // max(k - 1, 1) for i in range(k)]


class Diff(NamedTuple):
    """One logits row of a prompt: the first run against the second."""

    equal: bool  # torch.equal: bitwise (NaNs never are)
    max_abs: float  # max |first - second|
    greedy: tuple[int, int]  # the token each run chose (greedy sampling on the device)


def diff(a: tuple[torch.Tensor, int], b: tuple[torch.Tensor, int]) -> Diff:
    """``a`` and ``b``: (logits [V] float32, chosen token) of the same row in two runs."""
    return Diff(torch.equal(a[0], b[0]), float((a[0] - b[0]).abs().max()), (a[1], b[1]))


class PromptResult(NamedTuple):
    tokens: int  # the prompt's length
    repeat: Diff  # prefill alone, twice: determinism
    prefill: Diff  # prefill alone vs beside the others
    decode: tuple[Diff, ...]  # decode step i alone vs beside the others

    @property
    def equal(self) -> bool:
        return all(d.equal for d in (self.repeat, self.prefill, *self.decode))

    @property
    def first_greedy(self) -> int | None:
        """The first generated token whose greedy choice differs beside the others (0: the
        prompt's own, i: decode step i), or None."""
        for i, d in enumerate((self.prefill, *self.decode)):
            if d.greedy[0] != d.greedy[1]:
                return i
        return None


class _Recorder(DeviceSampler):
    """The runner's device sampler, also keeping the logits of each step it samples."""

    logits = torch.empty(0)  # [S, V] float32 on the host: the last step's sampled rows in order

    def sample(self, logits: torch.Tensor, batch: Any, plan: Any = None) -> Any:
        self.logits = logits.float().cpu()
        return super().sample(logits, batch, plan)


def compare(b: ModelBench, prompts: list[tuple[int, ...]], steps: int) -> list[PromptResult]:
    """The prefill and decode comparisons of the module docstring; prompt i in slot i."""
    rec = b.runner.sampler = _Recorder()

    def step(work: list[Any]) -> dict[int, tuple[torch.Tensor, int]]:
        res = b.run_step(work)
        return {r.slot: (rec.logits[i], r.token) for i, r in enumerate(res.results)}

    alone = []  # per prompt: its prefill's row, then one per decode step
    for s, p in enumerate(prompts):
        rows = [step([b.work(s, p, 0, True)])[s]]
        for i in range(steps):
            rows.append(step([b.work(s, (rows[-1][1],), len(p) + i, True)])[s])
        alone.append(rows)
    together = step([b.work(s, p, 0, True) for s, p in enumerate(prompts)])
    again = [step([b.work(s, p, 0, True)])[s] for s, p in enumerate(prompts)]
    decoded = [
        step([b.work(s, (alone[s][i][1],), len(p) + i, True) for s, p in enumerate(prompts)])
        for i in range(steps)
    ]
    return [
        PromptResult(
            tokens=len(p),
            repeat=diff(alone[s][0], again[s]),
            prefill=diff(alone[s][0], together[s]),
            decode=tuple(diff(alone[s][i + 1], decoded[i][s]) for i in range(steps)),
        )
        for s, p in enumerate(prompts)
    ]


def table(results: list[PromptResult]) -> list[str]:
    k = len(results)
    lines = [
        f"| prompt | tokens | prefill alone twice | prefill beside {k - 1} others | max abs diff "
        "| decode steps equal | max abs diff | first greedy token that differs |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, r in enumerate(results):
        same = sum(d.equal for d in r.decode)
        dec = max((d.max_abs for d in r.decode), default=0.0)
        first = r.first_greedy
        where = "none" if first is None else "prefill" if first == 0 else f"decode step {first}"
        lines.append(
            f"| {i} | {r.tokens} | {_word(r.repeat)} | {_word(r.prefill)} "
            f"| {r.prefill.max_abs:.3g} | {same}/{len(r.decode)} | {dec:.3g} | {where} |"
        )
    return lines


def _word(d: Diff) -> str:
    return "equal" if d.equal else "differs"


def run(args: argparse.Namespace) -> int:
    sizes = lengths(args.lengths, args.prompts)
    if args.slots < args.prompts:
        raise ValueError(f"--slots {args.slots} < --prompts {args.prompts}: one slot per prompt")
    if args.ctx < sizes[-1] + args.decode_steps:
        raise ValueError(f"--ctx {args.ctx} < the longest prompt plus --decode-steps")
    b = ModelBench(args)
    m = b.model
    prompts = [b.tokens(n, args.seed * 1000 + i) for i, n in enumerate(sizes)]
    head = [
        f"model: {b.source}, {m.spec.arch}, {m.spec.n_layer} layers, on {b.device.type}; "
        f"int8 {args.int8}, graphs {b.device.type == 'cuda' and not args.no_graphs}, "
        f"cache {args.cache_type}",
        f"{args.prompts} prompts of {', '.join(map(str, sizes))} tokens (seed {args.seed}); "
        f"each alone, then all in one step: prefill, then {args.decode_steps} decode steps",
        "",
    ]
    results = compare(b, prompts, args.decode_steps)
    ok = all(r.equal for r in results)
    verdict = "bitwise equal" if ok else "NOT batch-invariant"
    body = "\n".join([*head, *table(results), "", f"result: {verdict}"])
    print(body)
    if args.record:
        from mgserve.bench import record

        record(f"batch invariance on the {b.device.type} ({m.spec.arch})", body)
    return 0 if ok else 1
