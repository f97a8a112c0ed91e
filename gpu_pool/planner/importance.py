"""Model importance: which models a pool keeps when it must evict (mCache, and the classic baselines).

mCache (``papers/mcache.txt`` §4.3) ranks cached models by an importance score and evicts the
least important first. Its model utility (Eq. 1) is ``u_i = (P_i / S_i) * (1 / T_i)``: the
miss penalty ``P_i`` (seconds to load the model again) per byte it occupies ``S_i``, over the
expected time to its next request ``T_i ~ 1 / rate_i`` (Poisson arrivals, the rate from a
decayed count: :class:`~gpu_pool.planner.eviction.DecayedCountRateEstimator`). Its rank-based
importance (Eq. 2) is ``rank_i = log(sum_{j != i} [u_i > u_j] + b_0)`` over the cached models.
Scores move with the workload, so they are recomputed every ``update_s`` into a shadow copy
that then replaces the importance queue (a min-heap on rank) in one step; between updates a
newly cached model enters the queue with its own rank against the current utilities.

Every policy here answers the same two questions: :meth:`BaseImportance.victims` (cached
models, least important first) and :meth:`BaseImportance.scores` (each a score in [0, 1], 1 the
most important), which is what the pool's Minimal-Cost Eviction uses as ``p_m`` when a policy
is configured. The baselines mCache compares against (§5): LRU, LFU, ARC (Megiddo and Modha,
2003: recency and frequency lists with ghost histories and an adaptive target) and SRRIP
(Jaleel et al., 2010: 2-bit re-reference prediction values, inserted at "long", promoted to
0 on a hit, aged until one reaches "distant"). Pure Python: no torch, no I/O.
"""

from __future__ import annotations

import enum
import heapq
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field

from gpu_pool.planner.eviction import DecayedCountRateEstimator


class ImportancePolicy(enum.Enum):
    IAM = "iam"  # mCache's importance-aware model caching
    LRU = "lru"
    LFU = "lfu"
    ARC = "arc"
    SRRIP = "srrip"


class BaseImportance(ABC):
    """Which cached models matter most (see the module docstring)."""

    @abstractmethod
    def access(self, model_id: str, now: float, size_bytes: int, penalty_s: float) -> None:
        """A request for ``model_id`` at ``now`` (s); it is cached from now on (loaded if it was
        not). ``size_bytes`` and ``penalty_s`` (its load time) are what a miss costs."""

    @abstractmethod
    def evicted(self, model_id: str) -> None:
        """``model_id`` left the cache."""

    @abstractmethod
    def victims(self, now: float) -> list[str]:
        """The cached models, least important (first to evict) first."""

    def scores(self, now: float) -> dict[str, float]:
        """Every cached model's importance in [0, 1] (1: the most important; the least
        important 0), from one :meth:`victims` order. A model not in it scores 0."""
        order = self.victims(now)
        if len(order) == 1:
            return {order[0]: 1.0}
        return {m: i / (len(order) - 1) for i, m in enumerate(order)}

    def importance(self, model_id: str, now: float) -> float:
        """One model's score (:meth:`scores`; 0 when it is not cached)."""
        return self.scores(now).get(model_id, 0.0)


def new_importance(policy: ImportancePolicy) -> BaseImportance:
    """The policy's component with its default settings."""
    kinds: dict[ImportancePolicy, type[BaseImportance]] = {
        ImportancePolicy.IAM: ImportanceAware,
        ImportancePolicy.LRU: LeastRecentlyUsed,
        ImportancePolicy.LFU: LeastFrequentlyUsed,
        ImportancePolicy.ARC: AdaptiveReplacement,
        ImportancePolicy.SRRIP: StaticRRIP,
    }
    return kinds[policy]()


# ----- mCache ---------------------------------------------------------------------------------


def utility(penalty_s: float, size_bytes: int, rate_per_s: float) -> float:
    """Eq. 1: ``(P / S) * (1 / T)`` with ``T = 1 / rate`` (0 for a model never requested)."""
    return penalty_s / max(size_bytes, 1) * rate_per_s


def ranks(utilities: dict[str, float], b0: float = 1.0) -> dict[str, float]:
    """Eq. 2 for every model: ``log(#{j != i: u_i > u_j} + b0)``."""
    ordered = sorted(utilities.values())
    out = {}
    for model_id, u in utilities.items():
        below = _count_below(ordered, u)  # models with a strictly smaller utility
        out[model_id] = math.log(below + b0)
    return out


def _count_below(ordered: list[float], value: float) -> int:
    lo, hi = 0, len(ordered)
    while lo < hi:
        mid = (lo + hi) // 2
        if ordered[mid] < value:
            lo = mid + 1
        else:
            hi = mid
    return lo


@dataclass
class ImportanceAware(BaseImportance):
    """mCache's IAM (module docstring): Eq. 1 utilities, Eq. 2 ranks, a min-heap importance
    queue rebuilt every ``update_s`` from a shadow copy."""

    update_s: float = 1.0
    b0: float = 1.0
    rates: DecayedCountRateEstimator = field(default_factory=lambda: DecayedCountRateEstimator(600.0))
    _cached: dict[str, tuple[int, float]] = field(default_factory=dict)  # model -> (S, P)
    _queue: list[tuple[float, str]] = field(default_factory=list)  # the importance queue (min-heap)
    _rank: dict[str, float] = field(default_factory=dict)  # the rank each queued model has in it
    _built_at: float = -math.inf

    def __post_init__(self) -> None:
        if not self.update_s > 0 or not self.b0 > 0:
            raise ValueError("update_s and b0 must be > 0")

    def _utilities(self, now: float) -> dict[str, float]:
        return {m: utility(p, s, self.rates.rate(m, now)) for m, (s, p) in self._cached.items()}

    def _rebuild(self, now: float) -> None:
        """The shadow queue, computed whole, replaces the queue (§4.3.3)."""
        shadow_rank = ranks(self._utilities(now), self.b0)
        shadow = [(r, m) for m, r in shadow_rank.items()]
        heapq.heapify(shadow)
        self._queue, self._rank, self._built_at = shadow, shadow_rank, now

    def access(self, model_id: str, now: float, size_bytes: int, penalty_s: float) -> None:
        if size_bytes < 0 or penalty_s < 0:
            raise ValueError("size_bytes and penalty_s must be >= 0")
        self.rates.observe(model_id, now)
        new = model_id not in self._cached
        self._cached[model_id] = (size_bytes, penalty_s)
        if new and now - self._built_at < self.update_s:  # Algorithm 1: IQ.set(rank(i), i)
            u = self._utilities(now)
            rank = math.log(sum(u[model_id] > v for m, v in u.items() if m != model_id) + self.b0)
            self._rank[model_id] = rank
            heapq.heappush(self._queue, (rank, model_id))

    def evicted(self, model_id: str) -> None:
        self._cached.pop(model_id, None)
        self._rank.pop(model_id, None)  # its heap entry is skipped from now on

    def victims(self, now: float) -> list[str]:
        if now - self._built_at >= self.update_s:
            self._rebuild(now)
        live = [(r, m) for r, m in self._queue if self._rank.get(m) == r and m in self._cached]
        return [m for _, m in sorted(live)]


# ----- baselines ------------------------------------------------------------------------------


@dataclass
class LeastRecentlyUsed(BaseImportance):
    _order: OrderedDict[str, None] = field(default_factory=OrderedDict)  # least recent first

    def access(self, model_id: str, now: float, size_bytes: int, penalty_s: float) -> None:
        self._order.pop(model_id, None)
        self._order[model_id] = None

    def evicted(self, model_id: str) -> None:
        self._order.pop(model_id, None)

    def victims(self, now: float) -> list[str]:
        return list(self._order)


@dataclass
class LeastFrequentlyUsed(BaseImportance):
    """Fewest requests first (ties: least recent first); counts survive eviction (LFU with history)."""

    _counts: dict[str, int] = field(default_factory=dict)
    _last: dict[str, float] = field(default_factory=dict)
    _cached: set[str] = field(default_factory=set)

    def access(self, model_id: str, now: float, size_bytes: int, penalty_s: float) -> None:
        self._counts[model_id] = self._counts.get(model_id, 0) + 1
        self._last[model_id] = now
        self._cached.add(model_id)

    def evicted(self, model_id: str) -> None:
        self._cached.discard(model_id)

    def victims(self, now: float) -> list[str]:
        return sorted(self._cached, key=lambda m: (self._counts[m], self._last[m]))


@dataclass
class AdaptiveReplacement(BaseImportance):
    """ARC over models: T1 (seen once recently) and T2 (seen at least twice) hold the cached
    models, B1 and B2 remember recently evicted ones; a hit in B1 grows the target size ``p``
    of T1, a hit in B2 shrinks it. Sizes are in bytes (models differ in size). The victim
    order takes from T1 while it exceeds ``p``, else from T2, LRU-first within each."""

    _t1: OrderedDict[str, int] = field(default_factory=OrderedDict)
    _t2: OrderedDict[str, int] = field(default_factory=OrderedDict)
    _b1: OrderedDict[str, int] = field(default_factory=OrderedDict)
    _b2: OrderedDict[str, int] = field(default_factory=OrderedDict)
    p: float = 0.0  # target bytes of T1
    max_ghosts: int = 1024  # per ghost list: bounded memory

    def access(self, model_id: str, now: float, size_bytes: int, penalty_s: float) -> None:
        size = max(size_bytes, 1)
        if model_id in self._t1 or model_id in self._t2:  # hit: it is frequent now
            self._t1.pop(model_id, None)
            self._t2.pop(model_id, None)
            self._t2[model_id] = size
            return
        if model_id in self._b1:  # recency was too short: favour T1
            grow = max(1.0, sum(self._b2.values()) / max(sum(self._b1.values()), 1)) * size
            self.p = min(self.p + grow, float(self._cached_bytes() + size))
            del self._b1[model_id]
            self._t2[model_id] = size
        elif model_id in self._b2:  # frequency was too short: favour T2
            shrink = max(1.0, sum(self._b1.values()) / max(sum(self._b2.values()), 1)) * size
            self.p = max(self.p - shrink, 0.0)
            del self._b2[model_id]
            self._t2[model_id] = size
        else:
            self._t1[model_id] = size

    def _cached_bytes(self) -> int:
        return sum(self._t1.values()) + sum(self._t2.values())

    def evicted(self, model_id: str) -> None:
        for cached, ghosts in ((self._t1, self._b1), (self._t2, self._b2)):
            if model_id in cached:
                ghosts[model_id] = cached.pop(model_id)
                while len(ghosts) > self.max_ghosts:
                    ghosts.popitem(last=False)

    def victims(self, now: float) -> list[str]:
        t1, t2 = list(self._t1), list(self._t2)
        t1_bytes = sum(self._t1.values())
        order: list[str] = []
        while t1 or t2:  # what ARC's REPLACE would pick, one after the other
            if t1 and (t1_bytes > self.p or not t2):
                victim = t1.pop(0)
                t1_bytes -= self._t1[victim]
            else:
                victim = t2.pop(0)
            order.append(victim)
        return order


@dataclass
class StaticRRIP(BaseImportance):
    """SRRIP-HP with ``bits``-bit RRPVs: a new model enters at ``2^bits - 2`` ("long"), a hit
    sets it to 0 ("near-immediate"); the victim is a model at ``2^bits - 1`` ("distant"),
    every model aged by one until one is (oldest insertion first among equals)."""

    bits: int = 2
    _rrpv: dict[str, int] = field(default_factory=dict)
    _since: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.bits <= 8:
            raise ValueError("bits must be in [1, 8]")

    @property
    def distant(self) -> int:
        return (1 << self.bits) - 1

    def access(self, model_id: str, now: float, size_bytes: int, penalty_s: float) -> None:
        if model_id in self._rrpv:
            self._rrpv[model_id] = 0
        else:
            self._rrpv[model_id] = self.distant - 1
            self._since[model_id] = now

    def evicted(self, model_id: str) -> None:
        self._rrpv.pop(model_id, None)
        self._since.pop(model_id, None)

    def victims(self, now: float) -> list[str]:
        # Ageing adds the same amount to every RRPV until the largest is distant: the order of
        # victims is by RRPV, largest first (then insertion order), and evicting one ages the
        # rest when none is distant (the cache state after eviction is kept by `evicted`).
        if self._rrpv:
            age = self.distant - max(self._rrpv.values())
            if age > 0:
                for m in self._rrpv:
                    self._rrpv[m] += age
        return sorted(self._rrpv, key=lambda m: (-self._rrpv[m], self._since[m]))
