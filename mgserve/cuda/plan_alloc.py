"""A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, its default
configuration: no expandable segments, no max_split_size, no power-of-two rounding), enough to say
what ``torch.cuda.memory_allocated`` reads after a sequence of allocations and frees on one stream
(the memory plan's "allocator" item: plan_trace.py replays a load through it).

The rules it follows (the allocator's documented behaviour):

- a request is rounded up to a multiple of 512 bytes (at least 512);
- requests of at most 1 MiB come from the small pool (2 MiB segments), larger ones from the large
  pool (a 20 MiB segment for requests under 10 MiB, else the request rounded up to 2 MiB);
- a request takes the smallest free block of its pool that fits (then the lowest address); a
  block is split only if what remains is at least 512 bytes (small pool) or more than 1 MiB
  (large pool); an unsplit block is handed out, and counted as allocated, whole;
- a freed block merges with its free neighbours in its segment; segments are never released.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20  # the largest small-pool request
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(n: int) -> int:
    return MIN_BLOCK if n < MIN_BLOCK else -(-n // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass
class Block:
    ptr: int
    size: int
    small: bool
    free: bool = True
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)
    requested: int = 0


class CachingAllocator:
    """One device, one stream. ``malloc`` returns a handle for ``free``; ``allocated`` is
    ``memory_allocated``, ``requested`` the bytes asked for by the live allocations."""

    def __init__(self) -> None:
        self._free: dict[bool, list[tuple[int, int, Block]]] = {True: [], False: []}
        self._next_ptr = 1 << 32
        self.allocated = 0
        self.requested = 0
        self.segments = 0

    def _insert(self, b: Block) -> None:
        bisect.insort(self._free[b.small], (b.size, b.ptr, b))

    def _remove(self, b: Block) -> None:
        pool = self._free[b.small]
        i = bisect.bisect_left(pool, (b.size, b.ptr))
        assert pool[i][2] is b
        del pool[i]

    def malloc(self, nbytes: int) -> Block | None:
        if nbytes == 0:
            return None  # no block: the allocator returns a null pointer
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            block = pool.pop(i)[2]
        else:  # cudaMalloc a new segment
            block = Block(self._next_ptr, segment_size(size), small)
            self._next_ptr += block.size + (1 << 21)
            self.segments += 1
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = Block(block.ptr + size, remaining, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._insert(rest)
        block.free, block.requested = False, nbytes
        self.allocated += block.size
        self.requested += nbytes
        return block

    def free(self, block: Block | None) -> None:
        if block is None:
            return
        assert not block.free
        self.allocated -= block.size
        self.requested -= block.requested
        block.free = True
        for other in (block.prev, block.next):
            if other is not None and other.free:
                self._remove(other)
                if other is block.prev:  # other absorbs block
                    other.size += block.size
                    other.next = block.next
                    if block.next is not None:
                        block.next.prev = other
                    block = other
                else:  # block absorbs other
                    block.size += other.size
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
        self._insert(block)
