"""Which products a step's rows take: the decode kernels or the prompt GEMMs.

The decode kernels (the matvecs, the MoE decode kernels, the fused hyper-connection mix) and the
prompt GEMMs compute a token's row in different orders, so its bits depend on which one runs.
Choosing by the step's size would tie them to the other tokens of the step: a 5-token prompt alone
would take the matvecs and beside a longer prompt the GEMMs; six decoding sessions the matvecs and
ten the GEMMs. So the runner says what kind of step runs (``RowPath.step``): a prompt step takes
the GEMMs at any size, a decode step the decode kernels at any size (the linear and MoE families
run them in groups of up to MAX_MATVEC_TOKENS tokens, each token's row the same in any group).
Outside a runner step (direct calls, tests, benchmarks of one op) the size decides. The kind is
per thread: with the prefill lane (cuda/runner.py) a prompt step and a decode step run at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from mgserve.cuda.ops.linear_tuning import MAX_MATVEC_TOKENS

StepKind = Literal["prompt", "decode"]


class RowPath(threading.local):
    """The kind of step this thread runs on one backend (None: none, choose by size)."""

    def __init__(self) -> None:
        self.kind: StepKind | None = None

    @contextmanager
    def step(self, kind: StepKind) -> Iterator[None]:
        prev, self.kind = self.kind, kind
        try:
            yield
        finally:
            self.kind = prev

    def decode_kernels(self, n: int) -> bool:
        """Whether n rows take the decode kernels (else the prompt GEMMs)."""
        if self.kind is None:
            return n <= MAX_MATVEC_TOKENS
        return self.kind == "decode"
