"""KV block accounting (pure Python): which physical blocks each sequence holds.

Physical blocks come from a :class:`BaseBlockSource` (the pool, or a preallocated range
for the contiguous mode) in batches and are kept on a local free list, so the pool is asked
rarely (Tangram §3.3's free list and merged requests). A sequence holds
``ceil(len / block_size)`` blocks: prefill takes them all at once, decode adds one when the
last fills.

Automatic prefix caching (vLLM's, issue 12): every *full* block of a sequence gets a hash
chained from its parent block's hash and its token ids, seeded with the model's identity
(so nothing crosses models). Blocks are reference-counted; a new sequence takes the longest
run of cached full blocks of its context, always leaving at least its last token to compute
(the step needs its logits). Only full blocks are shared, so nobody ever writes into a shared
block: a sequence writes positions at or after its own last (partial) block. A block whose
count drops to zero keeps its hash and waits in an LRU of evictable blocks: a later hit takes
it back, and a sequence that needs a new block reclaims the least recently released one
(dropping its hash) before the source is asked for more, so caching never grows an
instance's KV footprint. On a local miss the source may restore blocks a previous instance
published (:meth:`BaseBlockSource.restore`, the pool's ``kv_restore``); full prompt blocks this
instance computed are queued for :meth:`BaseBlockSource.publish`, at most once per hash.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import NamedTuple

from runtime.engine.sequence import Sequence

HASH_BYTES = 16  # blake2b-128: a collision would hand one prompt another's KV, so no 64-bit hash


def root_hash(model_key: str) -> bytes:
    """The parent hash of a sequence's first block: the model's identity (and KV layout)."""
    return hashlib.blake2b(model_key.encode(), digest_size=HASH_BYTES, person=b"ember-kv-root").digest()


def block_hash(parent: bytes, tokens: Seq[int]) -> bytes:
    """Hash of a full block: its parent's hash and its token ids (little-endian int64)."""
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES, person=b"ember-kv-block")
    for t in tokens:
        h.update(t.to_bytes(8, "little", signed=True))
    return h.digest()


class BaseBlockSource(ABC):
    """Where physical KV blocks come from (and, optionally, prefix KV shared across instances)."""

    @abstractmethod
    def acquire(self, num_blocks: int) -> list[int] | None:
        """``num_blocks`` new physical block numbers, or None when none can be had."""

    @abstractmethod
    def release(self, block_ids: list[int]) -> None:
        """Give blocks back for good."""

    @property
    def shares_prefixes(self) -> bool:
        """Whether :meth:`restore` and :meth:`publish` reach a store beyond this instance."""
        return False

    def restore(self, hashes: list[bytes], block_ids: list[int], first: bool = False) -> int:
        """Fill ``block_ids`` with the KV of the longest stored run of ``hashes`` (from the
        first); how many blocks were filled. ``first``: the hashes start at the prompt's first
        block (a store may remember them as the prefix a new instance is likely to need)."""
        return 0

    def publish(self, hashes: list[bytes], block_ids: list[int]) -> None:
        """Offer the (fully written) blocks ``block_ids``, whose hashes are ``hashes``."""
        return None


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


@dataclass(slots=True)
class PrefixStats:
    """Prompt tokens looked up, found in this instance's cache, restored from the source."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    restored_tokens: int = 0
    published_blocks: int = 0


class _Match(NamedTuple):
    limit: int  # full blocks the sequence may reuse
    hits: list[int]  # cached blocks of its first ``len(hits)`` full blocks


class BlockManager:
    """Block tables of sequences over a local free list refilled from a source."""

    def __init__(
        self,
        source: BaseBlockSource,
        block_size: int,
        refill_blocks: int = 8,
        model_key: str = "",
        prefix_caching: bool = True,
        max_published: int = 1 << 16,
    ) -> None:
        if block_size < 1 or refill_blocks < 1 or max_published < 1:
            raise ValueError("block_size, refill_blocks and max_published must be >= 1")
        self.source = source
        self.block_size = block_size
        self.refill_blocks = refill_blocks
        self.prefix_caching = prefix_caching
        self.free: list[int] = []  # blocks without a hash, ready to use
        self.ref: dict[int, int] = {}  # held block -> number of sequences holding it
        self.hash_of: dict[int, bytes] = {}  # block -> hash of the tokens it holds (held or evictable)
        self.cached: dict[bytes, int] = {}  # hash -> the block holding it
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed; least recent first
        self.root = root_hash(model_key)
        self._model_key = model_key
        self._adapter_roots: dict[str, bytes] = {}
        self.stats = PrefixStats()
        self._published: OrderedDict[bytes, None] = OrderedDict()  # bounded: at most once per hash
        self._max_published = max_published
        self._to_publish: list[tuple[bytes, int]] = []
        self._prefetched: set[int] = set()  # adopted filled (adopt_prefix), no sequence read them yet

    @property
    def num_held(self) -> int:
        """Distinct blocks held by sequences."""
        return len(self.ref)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ----- allocation ---------------------------------------------------------------------------

    def _ensure(self, n: int, reserved: int = 0) -> bool:
        """Whether ``n`` blocks can be taken (free, then reclaimed from the evictable LRU, less
        ``reserved`` evictable blocks a hit is about to take), asking the source for the rest."""
        have = len(self.free) + len(self.evictable) - reserved
        if have >= n:
            return True
        want = n - have
        got = self.source.acquire(max(want, self.refill_blocks))
        if got is None and want < self.refill_blocks:
            got = self.source.acquire(want)
        if got is None:
            return False
        self.free.extend(got)
        return True

    def _take(self) -> int:
        """A block to write into: a free one, else the least recently released cached one."""
        if self.free:
            block = self.free.pop()
        else:
            block, _ = self.evictable.popitem(last=False)
            self._unhash(block)
        self.ref[block] = 1
        return block

    def _unhash(self, block: int) -> None:
        self._prefetched.discard(block)
        h = self.hash_of.pop(block, None)
        if h is not None and self.cached.get(h) == block:
            del self.cached[h]

    def _root(self, adapter: str | None) -> bytes:
        """The root hash of a sequence run with LoRA ``adapter``: its K/V differ from the base
        model's (an adapted q/k/v), so its blocks must never match another adapter's."""
        if adapter is None:
            return self.root
        root = self._adapter_roots.get(adapter)
        if root is None:
            root = self._adapter_roots[adapter] = root_hash(f"{self._model_key}\0lora:{adapter}")
        return root

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The hashes of the sequence's first ``num_blocks`` full blocks (computed once each)."""
        hashes, bs = seq.block_hashes, self.block_size
        if len(hashes) < num_blocks:
            tokens = seq.token_ids
            parent = hashes[-1] if hashes else self._root(seq.adapter)
            for i in range(len(hashes), num_blocks):
                parent = block_hash(parent, tokens[i * bs : (i + 1) * bs])
                hashes.append(parent)
        return hashes

    def _match(self, seq: Sequence) -> _Match:
        if not self.prefix_caching or seq.params.prompt_logprobs is not None:
            # A request for prompt log-probabilities needs the logits of every prompt
            # position: its prompt is computed whole, not reused.
            return _Match(0, [])
        limit = (len(seq) - 1) // self.block_size  # the last token is always computed
        hits: list[int] = []
        for h in self._hashes(seq, limit)[:limit]:
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return _Match(limit, hits)

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether the sequence's whole context can get blocks (taking them onto the free list)."""
        if seq.block_table:
            return self._ensure(self.blocks_needed(len(seq)) - len(seq.block_table))
        match = self._match(seq)
        reserved = sum(1 for b in match.hits if b in self.evictable)
        return self._ensure(self.blocks_needed(len(seq)) - len(match.hits), reserved)

    def allocate(self, seq: Sequence) -> None:
        """Give the sequence blocks for its whole context, reusing cached full blocks of its
        prefix (and restoring more from the source on a local miss); ``can_allocate`` must have
        said yes. Sets ``seq.num_cached`` to the reused length."""
        if seq.block_table:
            for _ in range(self.blocks_needed(len(seq)) - len(seq.block_table)):
                seq.block_table.append(self._take())
            return
        match = self._match(seq)
        for block in match.hits:
            self.evictable.pop(block, None)
            self.ref[block] = self.ref.get(block, 0) + 1
            seq.block_table.append(block)
        for _ in range(self.blocks_needed(len(seq)) - len(match.hits)):
            seq.block_table.append(self._take())
        reused = len(match.hits)
        # Hits on blocks that came filled from the source (adopt_prefix) count as restored.
        prefetched = sum(1 for b in match.hits if b in self._prefetched)
        self._prefetched.difference_update(match.hits)
        restored = 0
        if reused < match.limit and self.source.shares_prefixes:
            want = seq.block_hashes[reused : match.limit]
            restored = self.source.restore(want, seq.block_table[reused : match.limit], first=reused == 0)
            for i in range(reused, reused + restored):
                self._register(seq.block_table[i], seq.block_hashes[i])
                self._mark_published(seq.block_hashes[i])
        seq.num_cached = (reused + restored) * self.block_size
        seq.num_registered = reused + restored
        if seq.cached_tokens is None:  # the first admission is what the request reports
            seq.cached_tokens = seq.num_cached
            if match.limit:
                self.stats.queried_tokens += match.limit * self.block_size
                self.stats.hit_tokens += (reused - prefetched) * self.block_size
                self.stats.restored_tokens += (restored + prefetched) * self.block_size

    def can_append(self, seq: Sequence) -> bool:
        """Whether the sequence can grow by one token (a new block when the last is full)."""
        return len(seq) <= len(seq.block_table) * self.block_size or self._ensure(1)

    def append(self, seq: Sequence) -> None:
        """Make room for the sequence's newest token (its length already counts it)."""
        if len(seq) > len(seq.block_table) * self.block_size:
            seq.block_table.append(self._take())

    def deallocate(self, seq: Sequence) -> None:
        """Drop the sequence's hold on its blocks: unhashed ones go on the free list, hashed
        ones to the evictable LRU (tail first, so a prefix outlives its suffixes)."""
        for block in reversed(seq.block_table):
            left = self.ref[block] - 1
            if left:
                self.ref[block] = left
                continue
            del self.ref[block]
            if block in self.hash_of:
                self.evictable[block] = None
            else:
                self.free.append(block)
        seq.block_table.clear()
        seq.num_cached = 0
        seq.num_registered = 0

    def reserve(self, num_blocks: int) -> bool:
        """Hold ``num_blocks`` more unused blocks (fetched from the source now, not when a
        sequence needs them: LLM-Mesh's early scale-up); False when the source has none."""
        got = self.source.acquire(num_blocks) if num_blocks > 0 else []
        if got is None:
            return False
        self.free.extend(got)
        return True

    def trim_free(self, keep: int) -> int:
        """Return unused blocks without cached KV beyond ``keep`` to the source (LLM-Mesh's lazy
        scale-down; the prefix cache's blocks stay); returns how many."""
        extra = self.free[keep:] if keep >= 0 else []
        if extra:
            del self.free[keep:]
            self.source.release(extra)
        return len(extra)

    def trim(self, keep: int = 0) -> None:
        """Return unused blocks beyond ``keep`` to the source (free ones first, then cached),
        after handing the source what was queued for publishing."""
        self.flush_publish()
        extra: list[int] = []
        while len(self.free) + len(self.evictable) > keep:
            if self.free:
                extra.append(self.free.pop())
            else:
                block, _ = self.evictable.popitem(last=False)
                self._unhash(block)
                extra.append(block)
        if extra:
            self.source.release(extra)

    # ----- prefix cache ---------------------------------------------------------------------------

    def adopt_prefix(self, block_ids: list[int], hashes: list[bytes]) -> None:
        """Hold ``block_ids``, which came from the source filled with the prefix KV whose chained
        hashes are ``hashes`` (one each, in order), as cached blocks no sequence holds: a prompt
        that starts with that prefix reuses them. They count as restored when first reused."""
        if len(block_ids) != len(hashes):
            raise ValueError(f"{len(block_ids)} blocks for {len(hashes)} hashes")
        for block, h in zip(block_ids, hashes, strict=True):
            if not self.prefix_caching or h in self.cached:  # (a hash twice: cached once)
                self.free.append(block)
                continue
            self._register(block, h)
            self._mark_published(h)  # it came from the store: never offered back
            self.evictable[block] = None
            self._prefetched.add(block)

    def commit(self, seq: Sequence) -> None:
        """After a forward pass wrote the sequence's KV up to ``seq.num_cached``: its new full
        blocks become cache hits, and new full prompt blocks are queued for publishing."""
        if not self.prefix_caching:
            return
        full = seq.num_cached // self.block_size
        if full <= seq.num_registered:
            return
        hashes = self._hashes(seq, full)
        prompt_full = len(seq.prompt_ids) // self.block_size
        share = self.source.shares_prefixes
        for i in range(seq.num_registered, full):
            block, h = seq.block_table[i], hashes[i]
            if block not in self.hash_of:
                self._register(block, h)
            if share and i < prompt_full and h not in self._published and self.cached.get(h) == block:
                self._mark_published(h)
                self._to_publish.append((h, block))
        seq.num_registered = full

    def _register(self, block: int, h: bytes) -> None:
        # A second copy of a hash (two sequences computed the same prefix in one step) stays
        # unhashed: it is freed, not cached, when its sequence lets go of it.
        if h not in self.cached:
            self.cached[h] = block
            self.hash_of[block] = h

    def _mark_published(self, h: bytes) -> None:
        self._published[h] = None
        self._published.move_to_end(h)
        while len(self._published) > self._max_published:
            self._published.popitem(last=False)

    def flush_publish(self) -> int:
        """Hand queued blocks to the source (outside a step: the engine calls it after the
        step's tokens went out); blocks reclaimed since they were queued are skipped."""
        if not self._to_publish:
            return 0
        live = [(h, b) for h, b in self._to_publish if self.hash_of.get(b) == h]
        self._to_publish.clear()
        if live:
            self.source.publish([h for h, _ in live], [b for _, b in live])
            self.stats.published_blocks += len(live)
        return len(live)
