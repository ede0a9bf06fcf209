"""The prompt GEMMs' f16 copies of their activations (qgemm.cu and hgemm.cu read X in f16).

``f16_rows`` rounds an activation to f16 once (to nearest even). ``F16Rows`` remembers the last
few copies, per thread, so the GEMMs that read one activation (q, k, v and the indexer's
projections of one normed input; DeltaNet's qkv and z; the router, the routed experts and the
shared expert's gate and up) convert it once instead of once each. Its entries also take copies
that the activation's producer wrote beside its fp32 output (``offer``): the norm, the
hyper-connection mix, the gated activations (``wanted`` says when: prompt rows). A producer's
copy is the same bits as the conversion (both round each value to nearest even), and the
conversion's launch, a read of the fp32 tensor and a write of the copy, are saved.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from mgserve.cuda.ops.rowpath import RowPath


def f16_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, k] rounded to f16 once (to nearest even), contiguous and 16-byte aligned: the X
    operand of qgemm.cu and hgemm.cu (cp.async copies 16-byte pieces of each row)."""
    x16 = x.to(torch.float16).contiguous()  # [M, k]
    return x16.clone() if x16.data_ptr() % 16 else x16


def _root(x: torch.Tensor) -> torch.Tensor:
    """The tensor x is a view of (x itself if none): views of one root share its version
    counter, so their counters compare; an alias with a counter of its own (``x.data``) does
    not match."""
    return x if x._base is None else x._base


class _Entry(NamedTuple):
    x: torch.Tensor  # the fp32 tensor (held: its memory cannot be handed to another meanwhile)
    version: int  # its version counter when the copy was made (a view shares its base's)
    x16: torch.Tensor  # the f16 copy, contiguous, x's values in x's order


class F16Rows:
    """The last ``ENTRIES`` f16 copies of prompt activations, per thread (module docstring).

    A hit is an entry's tensor, or a view of the same root over its memory with its layout (the
    same data pointer, element count and dtype, both contiguous: a reshape of the producer's
    output), with the version counter unchanged since (an in-place torch write moves it; a kernel
    writing through the pointer does not, so no kernel may write an activation in place once a
    GEMM has read it). Entries hold their tensors until pushed out or ``clear`` (DeviceRunner
    clears them when a prompt step ends).
    ``path``: the backend's step kind, for ``wanted``; ``offers`` False turns producers' copies
    off (each GEMM then converts; the same bits). On: a 4096-token qwen4exp chunk 2.7% faster
    on an H100 (BENCHMARKS.md 2026-12-07 21:46)."""

    ENTRIES = 2  # an input's copy survives the shared expert's own beside the router

    def __init__(self, path: RowPath | None = None) -> None:
        self._local = threading.local()
        self.path = path
        self.offers = True

    def _entries(self) -> list[_Entry]:
        entries = getattr(self._local, "entries", None)
        if entries is None:
            entries = self._local.entries = []
        return entries  # type: ignore[no-any-return]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x's f16 copy: an entry's, or made now (and remembered)."""
        hit = self.find(x)
        if hit is not None:
            return hit
        x16 = f16_rows(x)
        self._put(x, x16)
        return x16

    def find(self, x: torch.Tensor) -> torch.Tensor | None:
        """The remembered copy of x, shaped as x, or None."""
        if x.is_inference():
            return None
        entries = self._entries()
        for i, e in enumerate(entries):
            same = e.x is x or (
                _root(x) is _root(e.x)  # (a view shares its root's version counter)
                and x.is_contiguous()
                and e.x.is_contiguous()
                and e.x.data_ptr() == x.data_ptr()
                and e.x.numel() == x.numel()
                and e.x.dtype == x.dtype
            )
            if same and e.version == x._version:
                entries.insert(0, entries.pop(i))  # the most recently used first
                return e.x16 if e.x16.shape == x.shape else e.x16.view(x.shape)
        return None

    def wanted(self, n_tok: int) -> bool:
        """Whether the producer of an activation of ``n_tok`` tokens should write its f16 copy
        (``offer``): prompt rows, which the GEMMs read (decode rows take the matvecs)."""
        if torch.is_inference_mode_enabled():  # (its tensors have no version counter to key)
            return False
        return self.offers and self.path is not None and not self.path.decode_kernels(n_tok)

    def room(self, x: torch.Tensor, n_tok: int) -> torch.Tensor | None:
        """An f16 tensor for the copy of x, an activation of ``n_tok`` tokens (contiguous,
        16-byte aligned, x's shape), where ``wanted``; else None."""
        if not self.wanted(n_tok):
            return None
        return torch.empty(x.shape, dtype=torch.float16, device=x.device)

    def offer(self, x: torch.Tensor, x16: torch.Tensor) -> None:
        """Remember ``x16``, written by x's producer as ``f16_rows`` rounds, as x's copy."""
        if x16.dtype != torch.float16 or x16.numel() != x.numel() or not x16.is_contiguous():
            raise ValueError(
                f"f16 copy {x16.dtype} {list(x16.shape)} does not match x {list(x.shape)}"
            )
        self._put(x, x16)

    def _put(self, x: torch.Tensor, x16: torch.Tensor) -> None:
        if x.is_inference():  # (no version counter)
            return
        entries = self._entries()
        entries.insert(0, _Entry(x, x._version, x16))
        del entries[self.ENTRIES :]

    def clear(self) -> None:
        """Forget this thread's entries (the end of a prompt step: their tensors go back to the
        allocator)."""
        self._local.entries = []
