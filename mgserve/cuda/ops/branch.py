"""Independent chains of a decode step side by side: fork and join (the ``branch`` family).

A decode step is about 1,300 small kernels, most too short to fill the GPU, so its time is their
latency one after another more than their bytes (BENCHMARKS.md). Where a layer has two chains
that do not read each other's results (the shared expert beside the router and the routed
experts; DeltaNet's z and beta/alpha projections beside qkv and the conv; an attention layer's k
and v with their cache writes beside q), the second chain runs on a side stream:

    side = b.branch.fork()   # the side stream waits for everything queued so far
    with side:               # these ops are queued on the side stream
        s = shared_expert(h)
    y = routed(h)            # the main chain, on the current stream
    side.join()              # the current stream waits for the side chain
    out = y + s

In a CUDA graph capture the two chains become parallel branches of the graph. The kernels and
their inputs are the same either way, so every value is bitwise the same; only the overlap
changes. Only decode steps fork (``RowPath.kind == "decode"``): a prompt chunk's kernels fill the
GPU alone. The torch backend, a step outside a runner step and ``decode = False`` run the side
chain inline, in order (``bench model --paired R --toggle branch.decode`` times the two).

Memory (the caching allocator's blocks belong to the stream that allocated them): a tensor made
on the side stream and read on the main one returns to the side stream's free blocks when it is
dropped, and the next side kernel to reuse it is queued after a later fork's wait, so after the
main stream's reads. That holds only if nothing but forks ever queues work on the side stream:
each main stream's side stream is created for it (``runtime.new_stream``), never drawn from
torch's stream pool, which hands its streams out again (pipeline stages, captures, lanes). A
tensor of the main stream that the side chain reads must stay referenced until ``join`` (the
fork sites hold their inputs as locals), so the main stream cannot reuse it before the side
chain has read it. A lazily built device cache (a RoPE table) first made inside a side chain is
synchronized when it is made (ops/rope.py), since the main chain may read it before the join.

A stream whose kernels must stay on some SMs (the prefill lane in a green context, runner.py)
is registered with ``inline_on``: its forks run inline, as a side stream of the primary context
would use every SM.
"""

from __future__ import annotations

from types import TracebackType

import torch

from mgserve.cuda.ops.rowpath import RowPath


class Fork:
    """One side chain: ``with`` it to queue ops on the side stream, ``join`` to wait for them.
    Inline (both streams None): ``with`` and ``join`` do nothing."""

    def __init__(self, main: torch.cuda.Stream | None, side: torch.cuda.Stream | None) -> None:
        self.main, self.side = main, side
        self._ctx: torch.cuda.StreamContext | None = None
        self.joined = False

    @property
    def forked(self) -> bool:
        return self.side is not None

    def __enter__(self) -> Fork:
        if self.side is not None:
            if self.joined:
                raise RuntimeError("branch.fork: the side chain was already joined")
            self._ctx = torch.cuda.stream(self.side)
            self._ctx.__enter__()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:  # fmt: skip
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(et, ev, tb)

    def join(self) -> None:
        """The main stream waits for the side chain's ops (once; later calls do nothing)."""
        if self.main is not None and self.side is not None and not self.joined:
            self.main.wait_stream(self.side)
        self.joined = True


class Branches:
    """Decode steps' side chains on one GPU (``device``), or inline (None: the torch backend)."""

    def __init__(self, path: RowPath, device: torch.device | None = None) -> None:
        self.path = path
        self.device = device
        self.decode = device is not None  # the switch (bench: --toggle branch.decode)
        # main stream handle -> (cuda.core's stream, kept alive; torch's view of it)
        self._sides: dict[int, tuple[object, torch.cuda.ExternalStream]] = {}
        self._inline: set[int] = set()  # streams whose forks run inline (inline_on)

    def inline_on(self, stream: torch.cuda.Stream) -> None:
        """Forks on ``stream`` run inline (a green context's stream: a side stream would not
        share its SMs)."""
        self._inline.add(stream.cuda_stream)

    def forks(self) -> bool:
        """Whether a fork now runs on a side stream (a decode step on the GPU, switched on)."""
        return self.decode and self.device is not None and self.path.kind == "decode"

    def fork(self) -> Fork:
        """A side chain starting after everything queued so far on the current stream."""
        if not self.forks():
            return Fork(None, None)
        main = torch.cuda.current_stream(self.device)
        if main.cuda_stream in self._inline:
            return Fork(None, None)
        made = self._sides.get(main.cuda_stream)
        if made is None:  # the main stream's priority: a decode stream's side chains keep it
            from mgserve.cuda import runtime

            assert self.device is not None  # forks(): a GPU
            index = self.device.index or 0
            own = runtime.new_stream(index, priority=main.priority)
            made = self._sides[main.cuda_stream] = (own, runtime.torch_stream(own, index))
        side = made[1]
        side.wait_stream(main)
        return Fork(main, side)
