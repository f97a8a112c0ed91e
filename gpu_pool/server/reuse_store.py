"""The Reuse Store (Tangram §3.1): what is resident in one arena, and who uses it.

It keeps the tensor map (fingerprint -> region), the KV blocks, the models that reference
each tensor, and per-session pins. It asks the planner (:mod:`gpu_pool.planner.allocator`) where
missing tensors go and applies the plan to the arena (evict, move, load). Everything here
is synchronous and single-threaded; the daemon serialises calls.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpu_pool.acquire_report import AcquireReport
from gpu_pool.arena.base import BaseArena, CopyJob
from gpu_pool.arena.loader import group_copies
from gpu_pool.errors import ConfigError, LoadError, ManifestError, NotResident, SessionError
from gpu_pool.manifest import Manifest, TensorEntry
from gpu_pool.planner.allocator import MergeCosts, PackingPolicy, Plan, TensorRequest, plan, plan_kv
from gpu_pool.planner.eviction import (
    BaseRateEstimator,
    DecayedCountRateEstimator,
    EvictionCandidate,
    EvictionPolicy,
    ModelCostInputs,
    eviction_order,
    mce_ranking,
)
from gpu_pool.planner.importance import BaseImportance, ImportancePolicy, new_importance
from gpu_pool.planner.layout import RegionColumns
from gpu_pool.planner.regions import DEFAULT_ALIGNMENT, Region, RegionKind, align_up, build_region_list
from gpu_pool.server.prefix_kv import PrefixIndex, owner
from gpu_pool.server.repin import Released
from gpu_pool.store.fingerprint import fingerprint


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Policy knobs of a Reuse Store."""

    eviction: EvictionPolicy = EvictionPolicy.MCE
    packing: PackingPolicy = PackingPolicy.PGP
    alignment: int = DEFAULT_ALIGNMENT
    horizon_s: float = 60.0  # p_m = P(model requested again within this horizon)
    default_bandwidth: float = 2e9  # bytes/s assumed for b_m until a load is measured
    seed: int = 0  # for the random-eviction baseline
    prefix_bytes: int | None = None  # bound on published prefix KV (None: a quarter of the arena)
    # What MCE uses as p_m: mCache's importance or a baseline's (gpu_pool.planner.importance);
    # None: the Poisson probability of a request within horizon_s.
    importance: ImportancePolicy | None = None

    def __post_init__(self) -> None:
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ConfigError(f"alignment must be a power of two, got {self.alignment}")
        if not self.horizon_s > 0:
            raise ConfigError("horizon_s must be > 0")
        if not self.default_bandwidth > 0:
            raise ConfigError("default_bandwidth must be > 0")
        if self.prefix_bytes is not None and self.prefix_bytes < 0:
            raise ConfigError("prefix_bytes must be >= 0")


@dataclass(slots=True)
class TensorRecord:
    key: str  # the fingerprint; dynamic tensors get a session-private key
    offset: int
    size: int  # aligned bytes in the arena
    entry: TensorEntry
    models: set[str] = field(default_factory=set)
    owners: tuple[str, ...] = ()  # sorted(models), kept in step: the eviction candidates' owners
    pins: Counter[str] = field(default_factory=Counter)
    last_used: float = 0.0
    session_private: str | None = None  # session owning a dynamic tensor
    loading: bool = False  # placed and pinned, bytes still being copied in (outside the lock)


@dataclass(slots=True)
class KVBlock:
    block_id: int
    offset: int
    size: int
    session_id: str


@dataclass(slots=True)
class ModelRecord:
    model_id: str
    keys: tuple[str, ...]
    latency_sensitivity: float
    nbytes: int
    bandwidth: float | None = None  # measured load bytes/s


@dataclass(slots=True)
class SessionState:
    session_id: str
    pins: Counter[str] = field(default_factory=Counter)
    private: set[str] = field(default_factory=set)
    kv: set[int] = field(default_factory=set)
    last: tuple[Manifest, dict[str, str]] | None = None  # its last acquire: manifest, store keys
    released: Released | None = None  # what its last release unpinned (None: acquired since)


@dataclass(frozen=True, slots=True)
class PendingAcquire:
    """An acquire between planning (:meth:`ReuseStore.begin_acquire`) and its byte copies' end.

    The daemon copies the bytes without holding its lock; ``waits_on`` are resident tensors
    this acquire pinned that another session's acquire is still loading.
    """

    session_id: str
    manifest: Manifest
    keys: dict[str, str]  # tensor name -> store key
    unique: dict[str, TensorEntry]  # store key -> entry
    resident: tuple[str, ...]
    missing: tuple[str, ...]
    jobs: tuple[CopyJob, ...]
    bytes_moved: int
    bytes_evicted: int
    plan_seconds: float
    move_seconds: float  # evictions and moves applied to the arena (Tangram's Merge)
    waits_on: frozenset[str]
    access: bool = True  # a request for the model (False: a standby's preparation, not counted)


@dataclass(frozen=True, slots=True)
class AcquireResult(AcquireReport):
    """What an acquire cost (the :class:`AcquireReport` the daemon sends on) and where the
    manifest's tensors are; ``to_wire`` encodes the report alone, the daemon sends the
    placements beside it."""

    placements: dict[str, int]  # tensor name -> arena offset


@dataclass(frozen=True, slots=True)
class KVAllocation:
    block_ids: tuple[int, ...]
    offsets: tuple[int, ...]
    block_bytes: int
    bytes_evicted: int


class ReuseStore:
    """Tensor map, region list, KV blocks and sessions of one arena."""

    def __init__(
        self,
        arena: BaseArena,
        config: StoreConfig | None = None,
        rates: BaseRateEstimator | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.arena = arena
        self.config = config or StoreConfig()
        if arena.capacity % self.config.alignment:
            raise ConfigError(f"arena capacity must be a multiple of {self.config.alignment} bytes")
        self.rates = rates or DecayedCountRateEstimator()
        policy = self.config.importance
        self.importance: BaseImportance | None = None if policy is None else new_importance(policy)
        self.clock = clock
        self.tensors: dict[str, TensorRecord] = {}
        self.kv_blocks: dict[int, KVBlock] = {}
        self.models: dict[str, ModelRecord] = {}
        self.sessions: dict[str, SessionState] = {}
        self._next_block_id = 1
        self._rng = random.Random(self.config.seed)
        self.counters: Counter[str] = Counter()
        self.load_seconds = 0.0
        prefix_bytes = self.config.prefix_bytes
        self.prefix = PrefixIndex(self, arena.capacity // 4 if prefix_bytes is None else prefix_bytes)

    # ----- sessions ---------------------------------------------------------------------------

    def open_session(self, session_id: str) -> None:
        if session_id in self.sessions:
            raise SessionError(f"session {session_id} already exists")
        self.sessions[session_id] = SessionState(session_id)

    def close_session(self, session_id: str) -> None:
        """Release everything the session holds; it may not be used again."""
        self.release(session_id)
        self.sessions.pop(session_id, None)

    def _session(self, session_id: str) -> SessionState:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise SessionError(f"unknown session {session_id}") from None

    # ----- tensors ------------------------------------------------------------------------------

    def regions(self) -> list[Region]:
        """The region list in address order (tiles the arena)."""
        allocated = [
            Region(t.offset, t.size, RegionKind.TENSOR, t.key, movable=not t.pins)
            for t in self.tensors.values()
        ]
        allocated += [
            Region(b.offset, b.size, RegionKind.KV, str(b.block_id)) for b in self.kv_blocks.values()
        ]
        return build_region_list(self.arena.capacity, allocated)

    def columns(self) -> RegionColumns:
        """The allocated regions as the planner's columns, built straight from the records
        (no Region objects: this runs on every acquire that plans, over ~1,500 regions)."""
        tensors = list(self.tensors.values())
        blocks = list(self.kv_blocks.values())
        n = len(tensors) + len(blocks)
        offsets = np.fromiter([t.offset for t in tensors] + [b.offset for b in blocks], np.int64, n)
        sizes = np.fromiter([t.size for t in tensors] + [b.size for b in blocks], np.int64, n)
        movable = np.zeros(n, np.bool_)
        movable[: len(tensors)] = [not t.pins for t in tensors]
        keys: list[str | None] = [t.key for t in tensors]
        keys += [str(b.block_id) for b in blocks]
        order = np.argsort(offsets, kind="stable")
        offsets, sizes, movable = offsets[order], sizes[order], movable[order]
        if n and (offsets[0] < 0 or np.any(offsets[1:] < offsets[:-1] + sizes[:-1])):
            raise ValueError("allocated regions overlap: the store is corrupted")
        if n and offsets[-1] + sizes[-1] > self.arena.capacity:
            raise ValueError("an allocated region leaves the arena: the store is corrupted")
        return RegionColumns(
            0, self.arena.capacity, offsets, sizes, movable, [keys[i] for i in order.tolist()]
        )

    def acquire(self, session_id: str, manifest: Manifest, access: bool = True) -> AcquireResult:
        """Pin ``manifest``'s tensors for the session, loading the missing ones (all in one call)."""
        pending = self.begin_acquire(session_id, manifest, access)
        assert not pending.waits_on, "a concurrent load is pending: use begin/load/complete"
        try:
            load_seconds = self.load(pending)
        except BaseException:
            self.abort_acquire(pending)
            raise
        return self.complete_acquire(pending, load_seconds)

    def begin_acquire(self, session_id: str, manifest: Manifest, access: bool = True) -> PendingAcquire:
        """Plan and reserve: pin resident tensors, evict/move per the plan, place the missing
        ones (marked ``loading``, pinned). Their bytes are copied by :meth:`load`. ``access``:
        the acquire serves a request for the model, so it counts in the model's request rate
        (``p_m``) and the reuse counters and may load; a standby's preparation
        (runtime.assignment) is none of that, and fails with :class:`NotResident` instead of
        loading anything."""
        session = self._session(session_id)
        session.released = None
        now = self.clock()
        if access:
            self._observe(manifest, now)
        keys = {e.name: self._key(e, session_id) for e in manifest.tensors}
        self._register_model(manifest, keys)

        unique: dict[str, TensorEntry] = {}
        for e in manifest.tensors:
            unique.setdefault(keys[e.name], e)
        resident = [k for k in unique if k in self.tensors]
        missing = [k for k in unique if k not in self.tensors]
        if missing and not access:  # checked with the pins, under the daemon's lock: no race
            raise NotResident(f"{len(missing)} tensors of {manifest.model_id} are not resident")
        # Pin what is resident before planning, so the plan can neither evict nor move it.
        self._pin_all(session, resident, now)
        t0 = time.perf_counter()
        try:
            requests = [TensorRequest(k, align_up(unique[k].nbytes, self.config.alignment)) for k in missing]
            the_plan = self._plan(requests)
            plan_seconds = time.perf_counter() - t0
            move_seconds = self._apply_evictions_and_moves(the_plan)
        except BaseException:
            for k in resident:
                self._unpin(session, k)
            raise
        for k in missing:
            e = unique[k]
            rec = TensorRecord(k, the_plan.placements[k], align_up(e.nbytes, self.config.alignment), e)
            rec.session_private = None if e.static else session_id
            rec.loading = True
            self.tensors[k] = rec
            self._pin(session, k, now)
            if not e.static:
                session.private.add(k)
        for k in unique:
            rec = self.tensors[k]
            if manifest.model_id not in rec.models:
                rec.models.add(manifest.model_id)
                rec.owners = tuple(sorted(rec.models))
        jobs = tuple(
            CopyJob(unique[k].file, unique[k].offset, the_plan.placements[k], unique[k].nbytes)
            for k in missing
        )
        return PendingAcquire(
            session_id, manifest, keys, unique, tuple(resident), tuple(missing), jobs,
            the_plan.bytes_moved, the_plan.bytes_evicted, plan_seconds, move_seconds,
            frozenset(k for k in resident if self.tensors[k].loading), access,
        )  # fmt: skip

    def load(self, pending: PendingAcquire) -> float:
        """Copy the missing tensors' bytes into their places (thread-safe against planning:
        the regions are reserved and pinned); returns the seconds it took."""
        return self.load_jobs(pending, pending.jobs)

    def load_jobs(self, pending: PendingAcquire, jobs: Iterable[CopyJob]) -> float:
        """:meth:`load` of some of ``pending``'s jobs (a progressive acquire copies its jobs
        group by group, in access order); returns the seconds it took."""
        copies = list(jobs)
        if not copies:
            return 0.0
        t0 = time.perf_counter()
        try:
            self.arena.load(group_copies(copies))
        except OSError as exc:
            raise LoadError(f"loading {pending.manifest.model_id}: {exc}") from exc
        return time.perf_counter() - t0

    def abort_acquire(self, pending: PendingAcquire) -> None:
        """Undo :meth:`begin_acquire` after a failed load: drop the half-loaded tensors, unpin."""
        session = self.sessions.get(pending.session_id)
        for k in pending.missing:
            if session is not None:
                self._unpin(session, k)
                session.private.discard(k)
            rec = self.tensors.get(k)
            if rec is not None and rec.loading:
                del self.tensors[k]
        if pending.missing and self.importance is not None:  # the load failed: not cached
            self.importance.evicted(pending.manifest.model_id)
        if session is not None:
            for k in pending.resident:
                self._unpin(session, k)

    def complete_acquire(self, pending: PendingAcquire, load_seconds: float) -> AcquireResult:
        """Mark the loaded tensors ready and account for the acquire."""
        gone = [k for k in (*pending.missing, *pending.resident) if k not in self.tensors]
        if gone:  # a concurrent load this one waited on failed, and took its tensors with it
            self.abort_acquire(pending)
            raise LoadError(
                f"loading {pending.manifest.model_id}: a concurrent load of {len(gone)} tensors failed"
            )
        for k in pending.missing:
            self.tensors[k].loading = False
        unique = pending.unique
        bytes_loaded = sum(unique[k].nbytes for k in pending.missing)
        bytes_reused = sum(unique[k].nbytes for k in pending.resident)
        self._record_bandwidth(pending.manifest.model_id, bytes_loaded, load_seconds)
        self.counters.update(
            bytes_loaded=bytes_loaded,
            bytes_moved=pending.bytes_moved,
            bytes_evicted=pending.bytes_evicted,
            tensors_loaded=len(pending.missing),
        )
        if pending.access:  # reuse is counted for requests only
            self.counters.update(bytes_reused=bytes_reused, reuse_hits=len(pending.resident), acquires=1)
        self.load_seconds += load_seconds
        keys = pending.keys
        session = self.sessions.get(pending.session_id)
        if session is not None:
            session.last = (pending.manifest, keys)
        return AcquireResult(
            placements={e.name: self.tensors[keys[e.name]].offset for e in pending.manifest.tensors},
            bytes_loaded=bytes_loaded,
            bytes_reused=bytes_reused,
            bytes_moved=pending.bytes_moved,
            bytes_evicted=pending.bytes_evicted,
            load_seconds=load_seconds,
            plan_seconds=pending.plan_seconds,
            move_seconds=pending.move_seconds,
        )

    def release(self, session_id: str, keep_kv: bool = False) -> None:
        """Unpin everything the session pinned and free its private tensors and (unless
        ``keep_kv``) its KV blocks."""
        session = self._session(session_id)
        now = self.clock()
        if session.pins and session.last is not None:
            session.released = Released.of(*session.last, self.tensors)
        for key in session.pins:
            rec = self.tensors.get(key)
            if rec is not None:
                del rec.pins[session_id]
                rec.last_used = now
        session.pins.clear()
        for key in session.private:
            self.tensors.pop(key, None)
        session.private.clear()
        if keep_kv:
            return
        for block_id in session.kv:
            del self.kv_blocks[block_id]
        session.kv.clear()

    def reacquire(self, session_id: str, manifest: Manifest) -> AcquireResult | None:
        """Pin again what the session's last release unpinned (:mod:`gpu_pool.server.repin`), as
        a request for its model; the placements are those of its last acquire, unchanged (the
        result has none). None when that acquire was not of this very ``manifest`` (trusted
        anew), it released nothing, acquired since, or any of those tensors was evicted, moved
        or reloaded since: acquire ``manifest`` then."""
        session = self._session(session_id)
        released, session.released = session.released, None
        if released is None or released.manifest is not manifest or not released.unchanged(self.tensors):
            return None
        now = self.clock()
        self._observe(released.manifest, now)
        self._pin_all(session, released.keys, now)
        self.counters.update(bytes_reused=released.bytes_reused, reuse_hits=len(released.records), acquires=1)
        return AcquireResult(0, released.bytes_reused, 0, 0, 0.0, 0.0, 0.0, placements={})

    def evict(self, model_id: str | None = None) -> int:
        """Evict inactive tensors (of one model, or all); returns bytes freed. Admin operation."""
        if model_id is not None and model_id not in self.models:
            raise ManifestError(f"unknown model {model_id!r}")
        victims = [
            k for k, t in self.tensors.items() if not t.pins and (model_id is None or model_id in t.models)
        ]
        freed = sum(self.tensors[k].size for k in victims)
        self._drop(victims)
        self.counters.update(bytes_evicted=freed)
        return freed

    def verify(self, key: str) -> bool:
        """Whether the resident bytes of tensor ``key`` still match its fingerprint."""
        rec = self.tensors[key]
        data = self.arena.read(rec.offset, rec.entry.nbytes)
        return fingerprint(rec.entry.dtype, rec.entry.shape, data) == rec.entry.fingerprint

    # ----- KV blocks ---------------------------------------------------------------------------

    def kv_alloc(
        self, session_id: str, num_blocks: int, block_bytes: int, aligned: bool = False
    ) -> KVAllocation:
        """Allocate KV blocks for the session, evicting inactive tensors if space is short.

        With ``aligned`` each block starts at a multiple of its (aligned) size, so
        ``offset // size`` numbers it.
        """
        session = self._session(session_id)
        if num_blocks <= 0 or block_bytes <= 0:
            raise SessionError("kv_alloc needs num_blocks > 0 and block_bytes > 0")
        size = align_up(block_bytes, self.config.alignment)
        kv_plan = plan_kv(self.columns(), num_blocks, size, self._eviction_order(), aligned)
        self._drop(kv_plan.evictions)
        ids = []
        for offset in kv_plan.offsets:
            block = KVBlock(self._next_block_id, offset, size, session_id)
            self._next_block_id += 1
            self.kv_blocks[block.block_id] = block
            session.kv.add(block.block_id)
            ids.append(block.block_id)
        self.counters.update(bytes_evicted=kv_plan.bytes_evicted, kv_blocks_allocated=num_blocks)
        return KVAllocation(tuple(ids), kv_plan.offsets, size, kv_plan.bytes_evicted)

    def kv_free(self, session_id: str, block_ids: Iterable[int]) -> int:
        """Free the session's blocks; all ids are checked before any is freed."""
        session = self._session(session_id)
        ids = list(block_ids)
        foreign = [b for b in ids if b not in session.kv]
        if foreign:
            raise SessionError(f"session does not own KV blocks {foreign[:8]}")
        for b in ids:
            session.kv.discard(b)
            self.kv_blocks.pop(b, None)
        return len(ids)

    def add_record(
        self, key: str, offset: int, size: int, entry: TensorEntry, model_id: str, owned_by: str, now: float
    ) -> None:
        """An inactive region placed by a plan the caller applied (published prefix KV): evictable
        and movable like an inactive tensor, priced as ``owned_by``."""
        rec = TensorRecord(key, offset, size, entry, {model_id}, (owned_by,), last_used=now)
        self.tensors[key] = rec

    def model_bandwidth(self, model_id: str) -> float:
        """Bytes/s a reload of ``model_id`` is expected to run at (b_m of Eq. 2)."""
        m = self.models.get(model_id)
        return (m.bandwidth if m is not None else None) or self._pool_bandwidth()

    # ----- reporting ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Capacity, occupancy, reuse counters and per-model residency (msgpack-safe)."""
        tensor_bytes = sum(t.size for t in self.tensors.values())
        pinned = sum(t.size for t in self.tensors.values() if t.pins)
        kv_bytes = sum(b.size for b in self.kv_blocks.values())
        regions = self.regions()
        free_sizes = [r.size for r in regions if r.is_free]
        models = {}
        for m in self.models.values():
            resident = sum(self.tensors[k].entry.nbytes for k in set(m.keys) if k in self.tensors)
            models[m.model_id] = {
                "total_bytes": m.nbytes,
                "resident_bytes": resident,
                "active": any(self.tensors[k].pins for k in m.keys if k in self.tensors),
            }
        loaded = self.counters["bytes_loaded"]
        return {
            "device": self.arena.device,
            "capacity_bytes": self.arena.capacity,
            "free_bytes": sum(free_sizes),
            "largest_free_bytes": max(free_sizes, default=0),
            "resident_bytes": tensor_bytes,
            "pinned_bytes": pinned,
            "kv_bytes": kv_bytes,
            "num_tensors": len(self.tensors),
            "num_regions": len(regions),
            "num_kv_blocks": len(self.kv_blocks),
            "bytes_loaded": loaded,
            "bytes_read_direct": self.arena.bytes_read_direct,
            "arena_populated": self.arena.populated,
            "bytes_reused": self.counters["bytes_reused"],
            "bytes_moved": self.counters["bytes_moved"],
            "bytes_evicted": self.counters["bytes_evicted"],
            "reuse_hits": self.counters["reuse_hits"],
            "prefix_bytes": self.prefix.resident_bytes(),
            "prefix_blocks": len(self.prefix.live()),
            "prefix_bytes_max": self.prefix.max_bytes,
            "prefix_blocks_published": self.counters["prefix_blocks_published"],
            "prefix_blocks_restored": self.counters["prefix_blocks_restored"],
            "prefix_blocks_evicted": self.counters["prefix_blocks_evicted"],
            "acquires": self.counters["acquires"],
            "load_bandwidth": loaded / self.load_seconds if self.load_seconds > 0 else 0.0,
            "sessions": len(self.sessions),
            "models": models,
        }

    # ----- internals ---------------------------------------------------------------------------

    @staticmethod
    def _key(entry: TensorEntry, session_id: str) -> str:
        # Dynamic tensors (per-request weights) are never shared: key them per session.
        return entry.fingerprint if entry.static else f"{entry.fingerprint}@{session_id}"

    def _register_model(self, manifest: Manifest, keys: dict[str, str]) -> None:
        static_keys = tuple(dict.fromkeys(keys[e.name] for e in manifest.tensors if e.static))
        nbytes = sum({keys[e.name]: e.nbytes for e in manifest.tensors if e.static}.values())
        old = self.models.get(manifest.model_id)
        self.models[manifest.model_id] = ModelRecord(
            manifest.model_id,
            static_keys,
            manifest.latency_sensitivity,
            nbytes,
            old.bandwidth if old else None,
        )

    def _observe(self, manifest: Manifest, now: float) -> None:
        """A request for ``manifest``'s model: its rate (p_m) and, under mCache, its importance."""
        self.rates.observe(manifest.model_id, now)
        if self.importance is not None:  # a miss costs its bytes over the load bandwidth
            known = self.models.get(manifest.model_id)
            bandwidth = (known.bandwidth if known else None) or self._pool_bandwidth()
            self.importance.access(manifest.model_id, now, manifest.nbytes, manifest.nbytes / bandwidth)

    def _pin(self, session: SessionState, key: str, now: float) -> None:
        rec = self.tensors[key]
        rec.pins[session.session_id] += 1
        rec.last_used = now
        session.pins[key] += 1

    def _pin_all(self, session: SessionState, keys: Iterable[str], now: float) -> None:
        """:meth:`_pin` of each of ``keys``, in one loop: an acquire of a resident model pins
        every tensor (272 for SmolLM2) on the cold path, under the daemon's lock."""
        sid, tensors, session_pins = session.session_id, self.tensors, session.pins
        for key in keys:
            rec = tensors[key]
            pins = rec.pins
            pins[sid] = pins.get(sid, 0) + 1
            rec.last_used = now
            session_pins[key] = session_pins.get(key, 0) + 1

    def _unpin(self, session: SessionState, key: str) -> None:
        sid = session.session_id
        rec = self.tensors.get(key)
        if rec is not None:
            rec.pins[sid] -= 1
            if rec.pins[sid] <= 0:
                del rec.pins[sid]
        session.pins[key] -= 1
        if session.pins[key] <= 0:
            del session.pins[key]

    def _eviction_order(self) -> list[str]:
        return self._eviction_inputs()[0]

    def _eviction_inputs(self) -> tuple[list[str], MergeCosts | None]:
        """The Stage 1 order and, under MCE, the prices Stage 2 weighs evictions against moves with."""
        now = self.clock()
        inactive = [t for t in self.tensors.values() if not t.pins]
        if self.config.eviction is not EvictionPolicy.MCE:
            candidates = [EvictionCandidate(t.key, t.size, t.owners, t.last_used) for t in inactive]
            return eviction_order(self.config.eviction, candidates, {}, self._rng), None
        pool_bw = self._pool_bandwidth()
        # p_m: the model-importance policy's score when one is set (one order for all models),
        # else the Poisson probability of a request within the horizon.
        scores = None if self.importance is None else self.importance.scores(now)
        inputs = {
            m.model_id: ModelCostInputs(
                scores.get(m.model_id, 0.0)
                if scores is not None
                else self.rates.miss_probability(m.model_id, now, self.config.horizon_s),
                m.bandwidth or pool_bw,
                m.latency_sensitivity,
            )
            for m in self.models.values()
        }
        for model_id, bandwidth in self.prefix.bandwidth.items():
            # Published prefix blocks: their model's p_m and alpha_m, their own reload time.
            m = self.models[model_id]
            inputs[owner(model_id)] = ModelCostInputs(
                inputs[model_id].miss_probability, bandwidth, m.latency_sensitivity
            )
        ranking = mce_ranking(
            [t.key for t in inactive],
            [t.size for t in inactive],
            [t.owners for t in inactive],
            [t.last_used for t in inactive],
            inputs,
        )
        return ranking.order, MergeCosts(ranking.prices(), 1.0 / self.arena.move_bandwidth)

    def _plan(self, requests: list[TensorRequest]) -> Plan:
        if not requests:
            return Plan({})
        order, costs = self._eviction_inputs()
        return plan(self.columns(), requests, order, self.config.packing, costs)

    def _apply_evictions_and_moves(self, the_plan: Plan) -> float:
        """Apply the plan's evictions and moves; returns the seconds the moves took (0.0
        without any: evictions only drop records)."""
        self._drop(the_plan.evictions)
        if not the_plan.moves:
            return 0.0
        t0 = time.perf_counter()
        for mv in the_plan.moves:
            self.arena.move(mv.dst, mv.src, mv.size)
            self.tensors[mv.key].offset = mv.dst
        return time.perf_counter() - t0

    def _drop(self, keys: Iterable[str]) -> None:
        """Evict tensors ``keys``: their models are no longer (all) cached."""
        for key in keys:
            rec = self.tensors.pop(key)
            if self.importance is not None:
                for model_id in rec.models:
                    self.importance.evicted(model_id)

    def _pool_bandwidth(self) -> float:
        loaded = self.counters["bytes_loaded"]
        if loaded >= 1 << 20 and self.load_seconds > 0:
            return loaded / self.load_seconds
        return self.config.default_bandwidth

    def _record_bandwidth(self, model_id: str, nbytes: int, seconds: float) -> None:
        if nbytes < 1 << 20 or seconds <= 0:
            return  # too small to say anything about bandwidth
        m = self.models[model_id]
        bw = nbytes / seconds
        m.bandwidth = bw if m.bandwidth is None else 0.5 * bw + 0.5 * m.bandwidth
