"""``mgserve bench glue``: the torch ops a decode step runs between the op families.

Everything a device model computes should go through ``backend.<family>.<op>`` (kernels on a GPU);
what it computes itself between those calls ("glue": a sigmoid here, a residual add there) becomes
one torch kernel launch per op per layer on the GPU, the 1,585 launches of issue 10's profile. This
counts them without a GPU: the model runs one decode step on the torch backend on the CPU, every
family method is marked, and each aten op dispatched outside a family call is counted by name. On
a GPU each counted op is at least one launch in the decode graph; the goal is zero.
"""

from __future__ import annotations

import argparse
import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

FAMILY_FIELDS_SKIPPED = ("dense", "kernels")  # Backend fields that are not op families
# ops that only make a new view of the same storage: no kernel runs for them
VIEW_OPS = frozenset(
    {"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "expand", "permute",
     "transpose", "t", "as_strided", "alias", "detach", "unflatten", "split", "split_with_sizes",
     "chunk", "unbind"}
)  # fmt: skip


class _GlueCounter(TorchDispatchMode):
    """Counts aten ops by name while no family method is running."""

    def __init__(self) -> None:
        super().__init__()
        self.in_family = 0
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.in_family == 0:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _mark(counter: _GlueCounter, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def marked(*args: Any, **kwargs: Any) -> Any:
        counter.in_family += 1
        try:
            return method(*args, **kwargs)
        finally:
            counter.in_family -= 1

    return marked


def mark_families(backend: Any, counter: _GlueCounter) -> None:
    """Wrap every public method of every family object of ``backend`` (on the instances)."""
    import dataclasses

    for f in dataclasses.fields(backend):
        if f.name in FAMILY_FIELDS_SKIPPED:
            continue
        family = getattr(backend, f.name)
        for name in dir(family):
            attr = getattr(family, name)
            if not name.startswith("_") and callable(attr):
                setattr(family, name, _mark(counter, attr))


def decode_glue(
    path: str, sessions: int = 2, prompt: int = 8, *, families: bool = True
) -> Counter[str]:
    """aten ops (name -> count) of one decode step of ``sessions`` sessions, outside the families
    (``families=False``: all of them), after a ``prompt``-token prefill of each."""
    from mgserve.core.gguf.reader import GGUFFile
    from mgserve.cuda.backend import load_device_model, torch_backend
    from mgserve.cuda.models.base import Span, Step

    backend = torch_backend()
    model = load_device_model(GGUFFile(path), backend, torch.device("cpu"), sessions, 4 * prompt)
    n_vocab = model.spec.n_vocab
    prompts = [[(7 * s + 3 * i + 1) % n_vocab for i in range(prompt)] for s in range(sessions)]

    def step(spans: list[tuple[int, list[int], int]], decode: bool) -> Step:
        toks = [t for _, ts, _ in spans for t in ts]
        st = Step(
            torch.tensor(toks),
            torch.tensor([s + i for _, ts, s in spans for i in range(len(ts))], dtype=torch.int32),
            torch.tensor([sl for sl, ts, _ in spans for _ in ts], dtype=torch.int32),
            decode=decode,
            spans=tuple(Span(sl, s, len(ts)) for sl, ts, s in spans),
            extra=model.step_extra([ts for _, ts, _ in spans], [sl for sl, _, _ in spans]),
        )
        if decode:  # made on the host with the other inputs, as graphs.py does
            st.lengths = st.pos + 1
        return st

    for s in range(sessions):
        model.begin_sequence(s)
    model.forward(step([(s, prompts[s], 0) for s in range(sessions)], False))
    counter = _GlueCounter()
    if families:
        mark_families(backend, counter)
    st = step([(s, [prompts[s][-1]], prompt) for s in range(sessions)], True)
    with torch.no_grad(), counter:
        model.forward(st)
    return counter.ops


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a GGUF file (small: it runs on the CPU)")
    parser.add_argument("--sessions", type=int, default=2, help="sessions in the decode step")


def launches(ops: Counter[str]) -> Counter[str]:
    """The ops of ``ops`` that run a kernel (views excluded)."""
    return Counter({k: n for k, n in ops.items() if k not in VIEW_OPS})


def run(args: argparse.Namespace) -> int:
    ops = decode_glue(args.model, args.sessions)
    compute = launches(ops)
    print(
        f"one decode step of {args.sessions} sessions: {sum(compute.values())} torch ops outside "
        f"the op families that run a kernel (+{sum(ops.values()) - sum(compute.values())} views)"
    )
    print("| op | count |\n| --- | --- |")
    for name, n in compute.most_common():
        print(f"| {name} | {n} |")
    return 0
