"""Prefix KV that outlives instances (issue 12): published KV blocks as inactive arena regions.

An engine hashes every full KV block of a prompt (chained from the model's identity, see
``runtime.engine.block_manager``). ``kv_publish`` copies such blocks out of the caller's own
KV memory into regions of the arena keyed by ``(scope, model, layout, hash)``; ``kv_restore``
copies the longest resident run of a list of hashes back into the caller's blocks. The daemon
does both copies itself, so no KV bytes cross the socket.

A published block is a record of the Reuse Store like an inactive tensor: no session pins it,
so the planner may evict or move it like any inactive region, and nothing (no anchor) keeps it
after its instance ends. Its eviction price (MCE, Tangram Eq. 2) is that of its model, p_m *
alpha_m, times its own reload time: the recompute time the publisher states (a prefill of one
block's tokens), capped at :data:`PREFIX_COST_RATIO` of what the model's weights cost per byte.
The cap is a choice: a prefix is worth something only while its model is worth keeping, and a
publisher must not make its blocks stickier than weights by overstating their cost. Prefix bytes
are further bounded in total (``PoolConfig.prefix_bytes``); past the bound the least recently used
published blocks go first.

A new instance's acquire may come with the prefix its function's last new instance asked for
first (:meth:`PrefixIndex.remember`, :meth:`PrefixIndex.recent`): its first request then
finds it in its own blocks, without a ``kv_restore`` round trip on its path. That is a guess
(a function with one system prompt is the case it is for); a wrong one costs a copy and
blocks the engine reuses like any cached ones.

Who shares with whom: the scope is the session's (a ticket's ``prefix_scope``, given by the agent
per function), never the client's say, so a worker can neither read timing hints from nor plant
KV into another function's prefixes; a session may only publish or restore for a model it has
acquired, and only with blocks it owns.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from gpu_pool.errors import Forbidden, InvalidArgument, OutOfMemory
from gpu_pool.manifest import TensorEntry
from gpu_pool.planner.allocator import TensorRequest

if TYPE_CHECKING:
    from gpu_pool.server.reuse_store import ReuseStore, SessionState

PREFIX_KEY = "kvp/"  # store keys of published blocks start with it (fingerprints are hex)
PREFIX_COST_RATIO = 0.5  # a prefix byte costs at most this share of a weight byte of its model
HASH_BYTES = 16
# Remembered prefixes (:meth:`PrefixIndex.remember`): per scope its MAX_RECENT_PER_SCOPE most
# recent (model, layout) runs, each at most RECENT_BLOCKS blocks (4,096 tokens of 16-token
# blocks; a prefetch takes a few MiB); at most MAX_RECENT_SCOPES scopes (one per function: the
# agent grants them), the least recently remembered dropped first. One scope's sessions cannot
# push out another's runs, nor hold more than ~64 KiB of hashes (made-up ones included).
MAX_RECENT_SCOPES = 1024
MAX_RECENT_PER_SCOPE = 4
RECENT_BLOCKS = 256


class BlockCopy(NamedTuple):
    """One block to copy: ``src`` and ``dst`` offsets (arena or session KV memory), ``size``,
    and the store key of the published block it fills or reads."""

    src: int
    dst: int
    size: int
    key: str


@dataclass(slots=True)
class PrefixMeta:
    model_id: str


def owner(model_id: str) -> str:
    """The pseudo-model that owns ``model_id``'s published blocks in eviction pricing."""
    return f"{PREFIX_KEY}{model_id}"


class PrefixIndex:
    """Published prefix blocks of one Reuse Store (records live in ``store.tensors``)."""

    def __init__(self, store: ReuseStore, max_bytes: int) -> None:
        self.store = store
        self.max_bytes = max_bytes
        self.meta: dict[str, PrefixMeta] = {}  # store key -> its model (pruned lazily)
        self.bandwidth: dict[str, float] = {}  # model id -> bytes per second of stated recompute
        # scope -> namespace -> its most recent published run, least recently remembered first
        self._recent: OrderedDict[str, OrderedDict[str, tuple[bytes, ...]]] = OrderedDict()

    @staticmethod
    def namespace(scope: str, model_id: str, layout: str) -> str:
        """One digest per (scope, model, layout): unambiguous whatever characters they hold."""
        return hashlib.blake2b(json.dumps([scope, model_id, layout]).encode(), digest_size=16).hexdigest()

    @staticmethod
    def key(namespace: str, h: bytes) -> str:
        return f"{PREFIX_KEY}{namespace}/{h.hex()}"

    def live(self) -> dict[str, PrefixMeta]:
        """The published blocks still resident (evictions by the planner drop records only)."""
        gone = [k for k in self.meta if k not in self.store.tensors]
        for k in gone:
            del self.meta[k]
        return self.meta

    def resident_bytes(self) -> int:
        return sum(self.store.tensors[k].size for k in self.live())

    def _check(self, session: SessionState, op: str, model_id: str, block_ids: list[int]) -> int:
        """The size of the session's blocks ``block_ids`` (all equal), or Forbidden."""
        store = self.store
        model = store.models.get(model_id)
        if model is None or not model.keys or not all(k in session.pins for k in model.keys):
            raise Forbidden(f"{op}: this session has not acquired model {model_id!r}")
        foreign = [b for b in block_ids if b not in session.kv]
        if foreign:
            raise Forbidden(f"{op}: this session does not own KV blocks {foreign[:8]}")
        sizes = {store.kv_blocks[b].size for b in block_ids}
        if len(sizes) > 1:
            raise InvalidArgument(f"{op}: blocks of different sizes {sorted(sizes)}", "block_ids")
        return sizes.pop() if sizes else 0

    def publish(
        self,
        session: SessionState,
        scope: str,
        model_id: str,
        layout: str,
        hashes: list[bytes],
        block_ids: list[int],
        recompute_s: float,
    ) -> tuple[list[BlockCopy], int]:
        """Reserve regions for the blocks not yet published (touching those that are); the copies
        the caller must make (session KV offset -> arena offset) and how many were touched."""
        store = self.store
        size = self._check(session, "kv_publish", model_id, block_ids)
        if not hashes or self.max_bytes < size:
            return [], 0
        now = store.clock()
        touched = 0
        new: list[tuple[str, int]] = []  # (store key, session block id) to publish
        seen: set[str] = set()
        space = self.namespace(scope, model_id, layout)
        for h, b in zip(hashes, block_ids, strict=True):
            key = self.key(space, h)
            rec = store.tensors.get(key)
            if rec is not None:
                rec.last_used = now
                touched += 1
            elif key not in seen:  # a hash twice in one request is published once
                seen.add(key)
                new.append((key, b))
        self._price(model_id, size, recompute_s)
        room = self.max_bytes - self.resident_bytes()
        if len(new) * size > room:
            room += self._evict_lru(len(new) * size - room, keep=seen)
        new = new[: max(room, 0) // size]  # a prefix run is worth most from its start
        if not new:
            return [], touched
        try:
            the_plan = store._plan([TensorRequest(k, size) for k, _ in new])
        except OutOfMemory:
            return [], touched  # nothing evictable makes room: publishing is only an offer
        store._apply_evictions_and_moves(the_plan)
        copies = []
        for key, b in new:
            offset = the_plan.placements[key]
            entry = TensorEntry(key, "uint8", (size,), size, key[-2 * HASH_BYTES :], "", 0)
            store.add_record(key, offset, size, entry, model_id, owner(model_id), now)
            self.meta[key] = PrefixMeta(model_id)
            copies.append(BlockCopy(store.kv_blocks[b].offset, offset, size, key))
        store.counters.update(prefix_blocks_published=len(copies), bytes_evicted=the_plan.bytes_evicted)
        return copies, touched

    def restore(
        self,
        session: SessionState,
        scope: str,
        model_id: str,
        layout: str,
        hashes: list[bytes],
        block_ids: list[int],
    ) -> list[BlockCopy]:
        """The copies (arena offset -> session KV offset) of the longest resident run of
        ``hashes`` from the first, into ``block_ids``; touches what it finds."""
        store = self.store
        size = self._check(session, "kv_restore", model_id, block_ids)
        now = store.clock()
        copies = []
        space = self.namespace(scope, model_id, layout)
        for h, b in zip(hashes, block_ids, strict=True):
            key = self.key(space, h)
            rec = store.tensors.get(key)
            if rec is None or rec.size != size:
                break
            rec.last_used = now
            copies.append(BlockCopy(rec.offset, store.kv_blocks[b].offset, size, key))
        store.counters.update(prefix_blocks_restored=len(copies), prefix_restores=1)
        return copies

    def remember(self, scope: str, model_id: str, layout: str, hashes: list[bytes]) -> None:
        """``hashes`` (a prompt's, from its first block) are the scope's most recent prefix (the
        first request of a function's first instance finds none published yet, and publishes
        them: its next start prefetches them). An empty run is not kept."""
        if not hashes:
            return
        runs = self._recent.setdefault(scope, OrderedDict())
        self._recent.move_to_end(scope)  # the most recently remembered scope now
        space = self.namespace(scope, model_id, layout)
        runs[space] = tuple(hashes[:RECENT_BLOCKS])
        runs.move_to_end(space)
        while len(runs) > MAX_RECENT_PER_SCOPE:
            runs.popitem(last=False)
        while len(self._recent) > MAX_RECENT_SCOPES:
            self._recent.popitem(last=False)

    def recent(self, scope: str, model_id: str, layout: str, max_blocks: int) -> tuple[bytes, ...]:
        """The scope's most recent prefix (:meth:`remember`): its first blocks still published,
        at most ``max_blocks``."""
        space = self.namespace(scope, model_id, layout)
        run = []
        runs = self._recent.get(scope)
        for h in (runs.get(space, ()) if runs is not None else ())[:max_blocks]:
            if self.key(space, h) not in self.store.tensors:
                break
            run.append(h)
        return tuple(run)

    def forget(self, keys: list[str]) -> None:
        """Drop published blocks whose bytes could not be copied in."""
        for k in keys:
            self.store.tensors.pop(k, None)
            self.meta.pop(k, None)

    def _price(self, model_id: str, size: int, recompute_s: float) -> None:
        """The reload bandwidth MCE prices this model's published blocks at (see the module doc)."""
        cap_s = PREFIX_COST_RATIO * size / self.store.model_bandwidth(model_id)
        self.bandwidth[model_id] = size / min(max(recompute_s, 1e-9), cap_s)

    def _evict_lru(self, need: int, keep: set[str]) -> int:
        """Drop the least recently used published blocks until ``need`` bytes are gone."""
        store = self.store
        victims = sorted(
            (k for k in self.live() if k not in keep and not store.tensors[k].pins),
            key=lambda k: store.tensors[k].last_used,
        )
        freed = evicted = 0
        for k in victims:
            if freed >= need:
                break
            freed += store.tensors.pop(k).size
            del self.meta[k]
            evicted += 1
        store.counters.update(bytes_evicted=freed, prefix_blocks_evicted=evicted)
        return freed
