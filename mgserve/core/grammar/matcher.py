"""One session's grammar state, and the allowed-token bitmask both samplers apply.

A mask is a bitmask row: int32 [ceil(V / 32)], bit ``t % 32`` of word ``t // 32`` set when token
``t`` may come next (llguidance's and xgrammar's layout). The CPU sampler takes one row's allowed
ids (a grammar allows few tokens at most steps, so the row is cut down to them); the device
sampler copies B rows with the step's other inputs and unpacks them on the device. Two things
make masks (``TokenMask``): a grammar's ``Matcher``, and a ``ForcedToken`` (a draw the engine
decides, such as a reasoning budget's close marker).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import llguidance
import numpy as np
import torch


def bitmask_words(n_vocab: int) -> int:
    """int32 words in one bitmask row of ``n_vocab`` tokens."""
    return (n_vocab + 31) // 32


def unpack_bitmask(bits: torch.Tensor, n_vocab: int) -> torch.Tensor:
    """bool [..., n_vocab] from int32 bitmask rows ``bits`` [..., W]: True where a token may come.

    Static shapes and no host sync, so a CUDA graph can hold it (the sign bit of a word is just
    bit 31: ``>>`` sign-extends, and ``& 1`` keeps the one bit asked for)."""
    ids = torch.arange(n_vocab, device=bits.device)  # [V]
    return ((bits[..., ids >> 5] >> (ids & 31).to(bits.dtype)) & 1).bool()


def apply_allowed(x: torch.Tensor, raw: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``x`` (the modified logits, [..., V]) with every token ``allowed`` [..., V] forbids at -inf.

    The grammar wins over a logit_bias: a row whose bias banned every allowed token falls back to
    the ``raw`` logits, masked, instead of having nothing left to draw from (the CPU sampler's
    ``apply_grammar`` does the same on one row's ids)."""
    masked = x.masked_fill(~allowed, -torch.inf)
    dead = torch.isneginf(masked).all(dim=-1, keepdim=True)  # [..., 1]
    return torch.where(dead, raw.masked_fill(~allowed, -torch.inf), masked)


def _check_row(row: np.ndarray, n_vocab: int) -> None:
    if row.dtype != np.int32 or row.shape != (bitmask_words(n_vocab),):
        raise ValueError(f"bitmask row must be int32 [{bitmask_words(n_vocab)}]")
    if not row.flags["C_CONTIGUOUS"]:
        raise ValueError("bitmask row must be contiguous")


class TokenMask(Protocol):
    """What the samplers read a session's mask from."""

    def fill(self, row: np.ndarray) -> None: ...

    def allowed(self) -> torch.Tensor: ...


class ForcedToken:
    """A mask that allows one token: the draw gives it whatever the logits and sampler say."""

    def __init__(self, token: int, n_vocab: int) -> None:
        assert 0 <= token < n_vocab, (token, n_vocab)
        self.token = token
        self.n_vocab = n_vocab

    def fill(self, row: np.ndarray) -> None:
        _check_row(row, self.n_vocab)
        row[:] = 0
        row.view(np.uint32)[self.token >> 5] = np.uint32(1 << (self.token & 31))

    def allowed(self) -> torch.Tensor:
        return torch.tensor([self.token], dtype=torch.int64)


class Matcher:
    """Where one session is in its grammar: the next token's mask, and the advance on a token."""

    def __init__(self, ll: llguidance.LLMatcher, n_vocab: int) -> None:
        self._ll = ll
        self.n_vocab = n_vocab

    def fill(self, row: np.ndarray) -> None:
        """Write the next token's bitmask into ``row`` (int32 [W], C-contiguous, host memory)."""
        _check_row(row, self.n_vocab)
        self._ll.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self._check()

    def allowed(self) -> torch.Tensor:
        """int64 [K]: the ids of the tokens that may come next, ascending."""
        row = np.empty(bitmask_words(self.n_vocab), dtype=np.int32)
        self.fill(row)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[: self.n_vocab]
        return torch.from_numpy(np.flatnonzero(bits))

    def advance(self, token: int) -> None:
        """The session sampled ``token`` (one its mask allowed, end-of-generation ids included)."""
        if not self._ll.consume_token(token):
            self._check()

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing but an end-of-generation token."""
        return bool(self._ll.is_stopped())

    def _check(self) -> None:
        # the samplers only draw allowed tokens, so this is a bug, never the client's fault
        if self._ll.is_error():
            raise RuntimeError(f"grammar matcher failed: {self._ll.get_error()}")


class Isolated:
    """A session's matcher whose failure stays its own.

    A matcher can fail mid-generation on a grammar the compiler took (llguidance's limits on a
    step's work, an internal error). Raised inside a step, that would fail every session of the
    step. Wrapped here, the failure is kept in ``error`` instead, the mask allows every token so
    the step's sampling goes on, and the runner reports the session as failed (``StepResult
    .failed``): it ends with that error while the others carry on. ``make`` builds the matcher
    (``Grammar.matcher``), so a failure to start one is caught the same way.
    """

    def __init__(self, make: Callable[[], Any], n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.error: str | None = None
        self._m: Any = None
        self._guard(lambda: setattr(self, "_m", make()))

    def _guard(self, f: Callable[[], Any]) -> Any:
        if self.error is None:
            try:
                return f()
            except Exception as e:  # the session's grammar, not the step, failed
                self.error = f"grammar matcher failed: {type(e).__name__}: {e}"
        return None

    def fill(self, row: np.ndarray) -> None:
        self._guard(lambda: self._m.fill(row))
        if self.error is not None:
            row[:] = -1  # every token: the draw is discarded with the session

    def allowed(self) -> torch.Tensor:
        ids = self._guard(lambda: self._m.allowed())
        return ids if self.error is None else torch.arange(self.n_vocab)

    def advance(self, token: int) -> None:
        self._guard(lambda: self._m.advance(token))


def failures(sessions: Iterable[tuple[str, Isolated | None]]) -> dict[str, str]:
    """Request id -> its matcher's error, for the sessions (id, matcher) whose matcher failed."""
    return {rid: m.error for rid, m in sessions if m is not None and m.error is not None}
