"""Start-up progress: how far loading has come, for ``/health`` while the server loads and for the
log (one updating bar on a terminal, a plain line every 10% otherwise).

Loading reports through two hooks that cost nothing when no load is being tracked:
``tensor_read`` (``GGUFFile.tensor``: every tensor the CPU or GPU loaders read or upload asks for
it by name) and ``kernel_ready`` (``cuda/compiler.py``: a kernel module compiled or read from the
cache). Each phase fills its band of the fraction; the fraction only grows, and ``finish`` makes
it 1.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from typing import TextIO

log = logging.getLogger("mgserve.load")

# phase -> the band of the overall fraction it fills; a CPU load has no kernels: it ends at 0.9
PHASES = {"weights": (0.0, 0.9), "kernels": (0.9, 1.0)}
BAR = 30  # characters of the terminal bar


class Progress:
    """One load's progress. ``update`` may be called from the loading thread while the event
    loop reads ``fraction`` (a float: read whole)."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.fraction = 0.0
        self.phase = "starting"
        self._stream = stream
        self._tty = bool(stream is not None and (stream.isatty() if tty is None else tty))
        self._seen: dict[str, set[str]] = {}
        self._decile = 0  # the last tenth logged (plain lines)
        self._lock = threading.Lock()
        self._bar_open = False

    def item(self, phase: str, name: str, total: int) -> None:
        """``name``, one of ``total`` items of ``phase``, is done (each name counts once)."""
        with self._lock:
            seen = self._seen.setdefault(phase, set())
            if name in seen:
                return
            seen.add(name)
            done = len(seen)
        self.update(phase, done, total)

    def update(self, phase: str, done: int, total: int) -> None:
        lo, hi = PHASES[phase]
        f = lo + (hi - lo) * (min(done, total) / total if total > 0 else 0.0)
        with self._lock:
            if f <= self.fraction:
                return
            self.fraction, self.phase = f, phase
            self._show(done, total)

    def finish(self) -> None:
        with self._lock:
            self.fraction, self.phase = 1.0, "ready"
            if self._bar_open and self._stream is not None:
                self._stream.write(f"\r{self._line()}\n")
                self._stream.flush()
                self._bar_open = False

    def _line(self) -> str:
        filled = round(self.fraction * BAR)
        return f"loading [{'#' * filled}{'.' * (BAR - filled)}] {self.fraction:4.0%} {self.phase}"

    def _show(self, done: int, total: int) -> None:
        if self._tty and self._stream is not None:
            self._stream.write(f"\r{self._line()} {done}/{total}")
            self._stream.flush()
            self._bar_open = True
            return
        decile = int(self.fraction * 10 + 1e-9)
        if decile > self._decile:
            self._decile = decile
            log.info("loading: %d%% (%s %d/%d)", decile * 10, self.phase, done, total)


_active: Progress | None = None


@contextlib.contextmanager
def tracking(progress: Progress) -> Iterator[Progress]:
    """Send the hooks' reports to ``progress`` while the block runs (one load at a time)."""
    global _active
    _active = progress
    try:
        yield progress
    finally:
        _active = None


def tensor_read(name: str, total: int) -> None:
    """Hook: tensor ``name`` of a file of ``total`` tensors is being read."""
    if _active is not None:
        _active.item("weights", name, total)


def kernel_ready(name: str, total: int) -> None:
    """Hook: kernel module ``name`` (one of at most ``total``) is compiled or loaded."""
    if _active is not None:
        _active.item("kernels", name, total)


def terminal() -> Progress:
    """A Progress that draws on stderr: a bar when it is a terminal, log lines when not."""
    return Progress(sys.stderr)
