"""Bounded LRU cache of model-store byte ranges in pinned host memory.

Loading a tensor into a GPU arena reads it from the store file into pinned (page-locked)
host memory and copies it to the device with ``cudaMemcpyAsync``; only pinned memory lets
that copy run asynchronously at full PCIe/NVLink-C2C bandwidth. Keeping the pinned copies of
recently loaded ranges means a tensor that was evicted from the arena and is needed again
skips the disk read (Tangram §3.4 prices such loads at host-cache bandwidth, not disk
bandwidth). Entries are keyed by ``(file, src_offset, nbytes)``: the loader's copy jobs.

:class:`HostCacheIndex` is the bookkeeping (LRU order, byte budget, hit/miss counters) and
needs no CuPy; :class:`PinnedHostCache` holds the pinned buffers and imports CuPy only when
it allocates one.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

CacheKey = tuple[str, int, int]
"""``(store file path, byte offset in the file, number of bytes)``."""

V = TypeVar("V")


def key_nbytes(key: CacheKey) -> int:
    """The bytes an entry with this key occupies (its third field)."""
    return key[2]


class HostCacheIndex(Generic[V]):
    """LRU index of cache entries under a byte budget. Thread-safe; no CuPy.

    Each entry's size is the ``nbytes`` of its key. :meth:`put` evicts least recently used
    entries until the new one fits, so the sum of entry sizes never exceeds
    ``budget_bytes``; an entry larger than the whole budget is not stored (and evicts
    nothing). :meth:`get` counts hits and misses and makes a hit the most recently used.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"host cache budget must be >= 0 bytes, got {budget_bytes}")
        self._budget = budget_bytes
        self._entries: OrderedDict[CacheKey, V] = OrderedDict()  # least recently used first
        self._used = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.evicted_bytes = 0

    @property
    def budget_bytes(self) -> int:
        """The most bytes the entries may occupy together."""
        return self._budget

    @property
    def used_bytes(self) -> int:
        """Bytes the entries occupy now."""
        return self._used

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:
        """Membership test that neither counts a hit/miss nor changes the LRU order."""
        return key in self._entries

    def keys(self) -> list[CacheKey]:
        """The keys, least recently used first."""
        with self._lock:
            return list(self._entries)

    def get(self, key: CacheKey, valid: Callable[[V], bool] | None = None) -> V | None:
        """The value for ``key`` (now the most recently used), or ``None``; counts a hit or miss.

        ``valid`` (called under the lock, keep it cheap) can reject a stale value: the entry
        is then dropped and the lookup counts as a miss.
        """
        with self._lock:
            value = self._entries.get(key)
            if value is not None and valid is not None and not valid(value):
                self._remove(key)
                value = None
            if value is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return value

    def peek(self, key: CacheKey) -> V | None:
        """The value for ``key`` without counting or reordering."""
        with self._lock:
            return self._entries.get(key)

    def put(self, key: CacheKey, value: V) -> bool:
        """Store ``value`` as the most recently used entry; False when it cannot fit at all.

        Replacing an existing key keeps the size (the size is part of the key).
        """
        nbytes = key_nbytes(key)
        if nbytes <= 0 or nbytes > self._budget:
            return False
        with self._lock:
            if key in self._entries:
                self._entries[key] = value
                self._entries.move_to_end(key)
                return True
            while self._used + nbytes > self._budget:
                self._evict_lru_locked()
            self._entries[key] = value
            self._used += nbytes
            return True

    def evict_lru(self) -> tuple[CacheKey, V] | None:
        """Remove and return the least recently used entry (``None`` when empty)."""
        with self._lock:
            if not self._entries:
                return None
            return self._evict_lru_locked()

    def discard(self, key: CacheKey) -> V | None:
        """Remove ``key`` if present and return its value (not counted as an eviction)."""
        with self._lock:
            return self._remove(key)

    def clear(self) -> None:
        """Drop every entry (counters are kept)."""
        with self._lock:
            self._entries.clear()
            self._used = 0

    def _evict_lru_locked(self) -> tuple[CacheKey, V]:
        key, value = self._entries.popitem(last=False)
        self._used -= key_nbytes(key)
        self.evictions += 1
        self.evicted_bytes += key_nbytes(key)
        return key, value

    def _remove(self, key: CacheKey) -> V | None:
        value = self._entries.pop(key, None)
        if value is not None:
            self._used -= key_nbytes(key)
        return value


FileSignature = tuple[int, int, int, int]
"""``(st_dev, st_ino, st_size, st_mtime_ns)`` of a store file: a cached range is only reused
while the file it came from is still the same file (a re-registered model that reuses a path
must not be served stale bytes)."""


@dataclass(frozen=True, slots=True)
class PinnedBuffer:
    """``nbytes`` of host memory at address ``ptr``; ``mem`` keeps the allocation alive.

    ``mem`` is a :class:`cupy.cuda.PinnedMemoryPointer` in production (any object exporting a
    writable byte buffer works, which the CPU tests use). Whoever enqueues an asynchronous
    copy from the buffer must hold a reference until that copy has been synchronized: when
    the last reference goes, CuPy's pinned pool may hand the memory to someone else.
    """

    mem: Any
    ptr: int
    nbytes: int

    def view(self) -> memoryview:
        """A writable flat byte view of exactly ``nbytes`` (release it when done)."""
        with memoryview(self.mem) as raw:
            return raw.cast("B")[: self.nbytes]


@dataclass(frozen=True, slots=True)
class _Entry:
    signature: FileSignature
    buffer: PinnedBuffer


class PinnedHostCache:
    """Pinned host buffers of store byte ranges, LRU-bounded to ``budget_bytes``.

    Buffers come from ``cupy.cuda.alloc_pinned_memory``, i.e. CuPy's pinned memory pool. That
    pool never returns a freed block to the system on its own: it keeps it in a free list
    for a later request of exactly the same (512-byte rounded) size. Evicted entries and
    buffers that were too large to cache would pile up there, so after roughly a budget's
    worth of such releases (at least 256 MiB) the cache calls the default pinned pool's
    ``free_all_blocks()``, which frees only blocks nobody holds. Host memory in use thus stays
    near ``budget_bytes`` plus the buffers of copies in flight plus that slack.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.index: HostCacheIndex[_Entry] = HostCacheIndex(budget_bytes)
        self._trim_after = max(budget_bytes, 256 << 20)
        self._released = 0
        self._lock = threading.Lock()

    @property
    def hits(self) -> int:
        """Lookups that found a current entry."""
        return self.index.hits

    @property
    def misses(self) -> int:
        """Lookups that found nothing (or a stale entry)."""
        return self.index.misses

    def get(self, key: CacheKey, signature: FileSignature) -> PinnedBuffer | None:
        """The cached buffer for ``key`` if it was read from the file ``signature`` describes."""
        entry = self.index.get(key, lambda e: e.signature == signature)
        return None if entry is None else entry.buffer

    def allocate(self, nbytes: int) -> PinnedBuffer:
        """A new pinned host buffer of ``nbytes`` (> 0) bytes."""
        from gpu_pool.cuda_backend import require_cupy

        if nbytes <= 0:
            raise ValueError(f"cannot allocate {nbytes} bytes of pinned memory")
        cp = require_cupy()
        mem = cp.cuda.alloc_pinned_memory(nbytes)
        return PinnedBuffer(mem, int(mem.ptr), nbytes)

    def put(self, key: CacheKey, signature: FileSignature, buffer: PinnedBuffer) -> bool:
        """Cache ``buffer`` (holding the bytes of ``key``); False when it does not fit the budget.

        A buffer that is not cached is released by its holder once its copy is done; either
        way its bytes count towards the next trim of the pinned pool.
        """
        if buffer.nbytes != key_nbytes(key):
            raise ValueError(f"buffer of {buffer.nbytes} bytes for a key of {key_nbytes(key)} bytes")
        with self._lock:
            before = self.index.evicted_bytes
            stored = self.index.put(key, _Entry(signature, buffer))
            released = self.index.evicted_bytes - before + (0 if stored else buffer.nbytes)
            self._note_released_locked(released)
        return stored

    def clear(self) -> None:
        """Drop every entry and give free pinned blocks back to the system."""
        with self._lock:
            self.index.clear()
            self._released = 0
            self._trim_pinned_pool()

    def _note_released_locked(self, nbytes: int) -> None:
        self._released += nbytes
        if self._released >= self._trim_after:
            self._released = 0
            self._trim_pinned_pool()

    @staticmethod
    def _trim_pinned_pool() -> None:
        # Only where CuPy is already imported: buffers were allocated through it. Without it
        # (CPU tests with plain byte buffers) there is no pool to trim.
        cp = sys.modules.get("cupy")
        if cp is None:
            return
        get_pool = getattr(cp, "get_default_pinned_memory_pool", None)
        if get_pool is not None:
            get_pool().free_all_blocks()
