"""PyTorch's CUDA caching allocator, replayed over a trace of allocations and frees: what it reserves.

Published GPU memory figures are usually the allocator's peak *reserved* bytes (`torch.cuda.max_memory_reserved`,
torchtitan's "memory" column), which exceed the peak of the tensors alive (`max_memory_allocated`, what
`passes.memory` computes) by rounding, segment granularity and fragmentation. `CachingAllocator` follows
c10/cuda/CUDACachingAllocator.cpp's rules:

- every request is rounded up to a multiple of 512 bytes (kMinBlockSize);
- requests up to 1 MiB (kSmallSize) come from the small pool, whose segments are 2 MiB (kSmallBuffer); larger
  ones from the large pool, whose new segments are 20 MiB (kLargeBuffer) for requests under 10 MiB
  (kMinLargeAlloc), else the request rounded up to 2 MiB (kRoundLarge);
- a request takes the smallest free block of its pool that fits (best fit, then the lowest address), split when
  the remainder is at least 512 bytes (small pool) or more than 1 MiB (large pool);
- a freed block merges with free neighbours of its segment and goes back to its pool; segments are never returned
  (no `empty_cache`), so reserved memory only grows;
- with `expandable_segments=True` (PYTORCH_CUDA_ALLOC_CONF, as torchtitan runs), each pool is one segment that
  grows at its end by whole pages (2 MiB small, 20 MiB large) when no free block fits, the free block at its
  end extended first.

One stream, no `record_stream` delays, no `max_split_size_mb` and no out-of-memory retries.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(size: int) -> int:
    return MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * -(-size // MIN_BLOCK)


def segment_size(size: int) -> int:
    """The size of a new segment for a (rounded) request."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * -(-size // ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    segment: int
    offset: int
    size: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


@dataclass
class CachingAllocator:
    """Replays `malloc` / `free` calls; `reserved` and `allocated` (bytes of live requests, unrounded) and their
    peaks are what torch.cuda's memory statistics would report."""

    expandable_segments: bool = False
    reserved: int = 0
    allocated: int = 0
    peak_reserved: int = 0
    peak_allocated: int = 0
    _pools: dict[bool, list] = field(default_factory=lambda: {True: [], False: []})  # small? -> sorted keys
    _by_key: dict[tuple[int, int, int], _Block] = field(default_factory=dict)
    _tails: dict[bool, _Block] = field(default_factory=dict)  # expandable: the last block of each pool's segment
    _segments: int = 0
    _live: dict[int, tuple[_Block, int]] = field(default_factory=dict)
    _next_id: int = 0

    def malloc(self, nbytes: int) -> int:
        """Allocate `nbytes`; returns a handle for `free`."""
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._best_fit(size, small)
        if block is None:
            block = self._grow(size, small)
        self._take(block)
        if block.size - size >= (MIN_BLOCK if small else SMALL_SIZE + 1):
            rest = _Block(block.segment, block.offset + size, block.size - size, small, True, block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._put(rest)
            if self._tails.get(small) is block:
                self._tails[small] = rest
        block.free = False
        self.allocated += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        handle = self._next_id
        self._next_id += 1
        self._live[handle] = (block, nbytes)
        return handle

    def free(self, handle: int) -> None:
        block, nbytes = self._live.pop(handle)
        self.allocated -= nbytes
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free and neighbour.segment == block.segment:
                self._take(neighbour)
                self._merge(block, neighbour)
        self._put(block)

    def _merge(self, block: _Block, other: _Block) -> None:
        if other is block.next:
            block.size += other.size
            block.next = other.next
            if other.next is not None:
                other.next.prev = block
        else:
            block.offset = other.offset
            block.size += other.size
            block.prev = other.prev
            if other.prev is not None:
                other.prev.next = block
        if self._tails.get(block.small) is other:
            self._tails[block.small] = block

    def _best_fit(self, size: int, small: bool) -> _Block | None:
        keys = self._pools[small]
        i = bisect.bisect_left(keys, (size, -1, -1))
        return self._by_key[keys[i]] if i < len(keys) else None

    def _grow(self, size: int, small: bool) -> _Block:
        if not self.expandable_segments:
            nbytes = segment_size(size)
            self._segments += 1
            self._reserve(nbytes)
            block = _Block(self._segments, 0, nbytes, small)
            self._put(block)
            return block
        page = SMALL_BUFFER if small else LARGE_BUFFER
        tail = self._tails.get(small)
        if tail is None:
            tail = _Block(0 if small else -1, 0, 0, small)
            self._tails[small] = tail
            self._put(tail)
        have = tail.size if tail.free else 0
        pages = -(-(size - have) // page)
        self._reserve(pages * page)
        if tail.free:
            self._take(tail)
            tail.size += pages * page
            self._put(tail)
            return tail
        block = _Block(tail.segment, tail.offset + tail.size, pages * page, small, True, tail)
        tail.next = block
        self._tails[small] = block
        self._put(block)
        return block

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _put(self, block: _Block) -> None:
        if block.size == 0:
            return
        key = block.key()
        bisect.insort(self._pools[block.small], key)
        self._by_key[key] = block

    def _take(self, block: _Block) -> None:
        key = block.key()
        if self._by_key.get(key) is block:
            keys = self._pools[block.small]
            del keys[bisect.bisect_left(keys, key)]
            del self._by_key[key]


def replay(
    events: Iterable[tuple[str, int, int]], expandable_segments: bool = False, allocator: CachingAllocator | None = None
) -> CachingAllocator:
    """Run ("malloc", id, nbytes) and ("free", id, 0) events (ids are the caller's) through an allocator (a fresh
    one unless given) and return it: `peak_reserved` is the answer."""
    allocator = allocator or CachingAllocator(expandable_segments)
    handles: dict[int, int] = {}
    for kind, ident, nbytes in events:
        if kind == "malloc":
            handles[ident] = allocator.malloc(nbytes)
        else:
            allocator.free(handles.pop(ident))
    return allocator
