"""KV block accounting (pure Python): which physical blocks each sequence holds.

Physical blocks come from a :class:`BaseBlockSource` (the pool, or a preallocated range
for the contiguous mode) in batches and are kept on a local free list, so the pool is asked
rarely (Tangram §3.3's free list and merged requests). A sequence holds
``ceil(len / block_size)`` blocks: prefill takes them all at once, decode adds one when the
last fills.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from runtime.engine.sequence import Sequence


class BaseBlockSource(ABC):
    """Where physical KV blocks come from."""

    @abstractmethod
    def acquire(self, num_blocks: int) -> list[int] | None:
        """``num_blocks`` new physical block numbers, or None when none can be had."""

    @abstractmethod
    def release(self, block_ids: list[int]) -> None:
        """Give blocks back for good."""


class RangeBlockSource(BaseBlockSource):
    """Blocks ``0 .. num_blocks-1`` of a preallocated KV tensor (vLLM's contiguous mode)."""

    def __init__(self, num_blocks: int) -> None:
        self._free = list(range(num_blocks - 1, -1, -1))

    def acquire(self, num_blocks: int) -> list[int] | None:
        if num_blocks > len(self._free):
            return None
        out = self._free[-num_blocks:][::-1]
        del self._free[-num_blocks:]
        return out

    def release(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)


class BlockManager:
    """Block tables of sequences over a local free list refilled from a source."""

    def __init__(self, source: BaseBlockSource, block_size: int, refill_blocks: int = 8) -> None:
        if block_size < 1 or refill_blocks < 1:
            raise ValueError("block_size and refill_blocks must be >= 1")
        self.source = source
        self.block_size = block_size
        self.refill_blocks = refill_blocks
        self.free: list[int] = []
        self.num_held = 0  # blocks held by sequences

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _ensure(self, n: int) -> bool:
        if len(self.free) >= n:
            return True
        want = n - len(self.free)
        got = self.source.acquire(max(want, self.refill_blocks))
        if got is None and want < self.refill_blocks:
            got = self.source.acquire(want)
        if got is None:
            return False
        self.free.extend(got)
        return True

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether the sequence's whole context can get blocks (taking them onto the free list)."""
        return self._ensure(self.blocks_needed(len(seq)) - len(seq.block_table))

    def allocate(self, seq: Sequence) -> None:
        """Give the sequence blocks for its whole context; ``can_allocate`` must have said yes."""
        n = self.blocks_needed(len(seq)) - len(seq.block_table)
        assert len(self.free) >= n
        for _ in range(n):
            seq.block_table.append(self.free.pop())
        self.num_held += n

    def can_append(self, seq: Sequence) -> bool:
        """Whether the sequence can grow by one token (a new block when the last is full)."""
        return len(seq) <= len(seq.block_table) * self.block_size or self._ensure(1)

    def append(self, seq: Sequence) -> None:
        """Make room for the sequence's newest token (its length already counts it)."""
        if len(seq) > len(seq.block_table) * self.block_size:
            seq.block_table.append(self.free.pop())
            self.num_held += 1

    def deallocate(self, seq: Sequence) -> None:
        """Put the sequence's blocks on the free list (kept for reuse, not returned)."""
        self.free.extend(reversed(seq.block_table))
        self.num_held -= len(seq.block_table)
        seq.block_table.clear()
        seq.num_cached = 0

    def trim(self, keep: int = 0) -> None:
        """Return free blocks beyond ``keep`` to the source."""
        if len(self.free) > keep:
            extra = self.free[keep:]
            del self.free[keep:]
            self.source.release(extra)
