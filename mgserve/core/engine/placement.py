"""Where a new request goes: the free slot, the prompt tokens it reuses and from where (the slot's
own cache, its checkpoint, or another slot's prefix copied in). Pure; the scheduler asks.

A slot's cache serves a prompt up to their common prefix (the last prompt token is always
recomputed, its logits give the first token). A recurrent state cannot be cut back: such a slot
serves its whole history when that starts the prompt (its live state), else its latest checkpoint
in the common prefix (checkpoints.py), else nothing; either only up to the first cut hint where
the slot's state and the request's cuts differ (``checkpoints.agree``).

Prefix copy (``copy_min`` > 0): any other slot, busy or idle, may lend its prefix. Its positions
below its length never change while it runs (it only appends), so a ``PrefixCopy`` planned now
reads them at the start of the next step, before that step's forward. A recurrent source lends
its checkpoint at the copied length, or its live state when the whole history is copied and the
state is there when the step starts (an idle slot, or a session past its first work; with the
prefill lane not a decoding one, and no slot a batch in flight computes on lends at all). A request
takes the copy when it reaches at least ``copy_min`` tokens further than the free slot's own
cache. Among free slots that reach as far, the one whose cache loses the fewest tokens goes
(so a request sharing a system prompt with an idle conversation takes an empty slot and a copy
rather than cutting that conversation back), then its own cache before a copy, then the least
recently used. Without copies (or for a request that reuses nothing) the least recently used of
those that reach as far goes, as llama-server does.
"""

from __future__ import annotations

from typing import NamedTuple

from mgserve.core.engine.checkpoints import CheckpointBook, agree
from mgserve.core.engine.contract import PrefixCopy, Request
from mgserve.core.engine.slots import Slot, common_prefix


class Placement(NamedTuple):
    slot: Slot
    n_cached: int  # prompt tokens reused
    restore: bool  # the slot's own checkpoint at n_cached is loaded first
    copy: PrefixCopy | None  # the prefix comes from another slot


class Placer:
    def __init__(self, rewindable: bool, book: CheckpointBook, copy_min: int) -> None:
        if copy_min < 0:
            raise ValueError(f"bad prefix copy threshold: {copy_min}")
        self.rewindable = rewindable
        self.book = book
        self.copy_min = copy_min  # 0: no copies
        # a decoding session lends its live state (not with the prefill lane: its decode batches
        # advance that state while the lane's batch copies it, lanes.py)
        self.live_decoders = True

    def _shared(self, slot: Slot, req: Request) -> int:
        """Prompt positions ``slot``'s state serves: the common prefix, short of the last prompt
        token, and (a recurrent state) before the first cut where the two differ."""
        n = min(common_prefix(slot.cached, req.prompt), len(req.prompt) - 1)
        differ = None if self.rewindable else agree(slot.cuts, req.cut_hints)
        return n if differ is None else min(n, differ - 1)

    def reusable(self, slot: Slot, req: Request) -> int:
        """Prompt tokens a request can take from ``slot``'s own (idle) cache."""
        n = self._shared(slot, req)
        return n if self.rewindable or n == len(slot.cached) else self.book.best(slot.id, n)

    def lendable(self, slot: Slot, req: Request) -> tuple[int, bool]:
        """Prompt tokens ``slot`` can lend another slot, and whether from its live state."""
        n = self._shared(slot, req)
        if self.rewindable:
            return n, False
        s = slot.session
        at_n = n == len(slot.cached) and (s is None or not (s.in_flight or s.new_sequence))
        at_n = at_n and (s is None or s.prefilling or self.live_decoders)
        if at_n and (slot.id, n) not in self.book.held:
            return n, True
        return self.book.best(slot.id, n), False

    def place(self, req: Request, free: list[Slot], slots: list[Slot]) -> Placement:
        """The free slot ``req`` goes to (``free`` not empty), among all ``slots``."""
        reuse = req.reuse_prefix
        own = {sl.id: self.reusable(sl, req) if reuse else 0 for sl in free}
        lenders = (
            sorted(
                ((*self.lendable(sl, req), sl.id) for sl in slots),
                key=lambda x: -x[0],
            )
            if reuse and self.copy_min
            else []
        )
        best: tuple[tuple[int, int, bool, int], Placement] | None = None
        for slot in free:
            n = own[slot.id]
            copy = None
            for n_src, live, src in lenders:
                if src != slot.id:
                    if n_src - n >= self.copy_min:
                        copy = PrefixCopy(req.id, src, slot.id, n_src, live)
                    break
            reach = copy.n if copy else n
            loss = len(slot.cached) - n if lenders else 0
            key = (reach, -loss, copy is None, -slot.last_used)
            if best is None or key > best[0]:
                restore = 0 < n < len(slot.cached) and not self.rewindable and copy is None
                best = (key, Placement(slot, reach, restore, copy))
        assert best is not None, "no free slot"
        return best[1]
