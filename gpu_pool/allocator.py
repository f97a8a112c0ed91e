"""The Tangram tensor planner: where new tensors go, what is evicted, what is moved.

Pure Python, no torch and no I/O: it takes the region list and the (aligned) sizes of the
missing tensors and returns a :class:`Plan`; :mod:`gpu_pool.executor` applies plans to an
arena. Benchmarks and property tests drive :func:`plan` directly.

Steps, following Tangram §3.2 (Eq. 1-2, Alg. 1, Figure 6):

0. *Direct placement.* If the new tensors fit the free regions as they are (the whole
   request as one contiguous block, else best-fit decreasing per tensor), the plan has
   no evictions and no moves.
1. *Stage 1, eviction* in the caller's order (:mod:`gpu_pool.eviction`: MCE, LRU or
   random) until the free bytes cover the request; direct placement is tried again.
2. *Stage 2, packing with moves.* Pinned tensors and KV blocks never move, so they cut the
   arena into *segments* within which inactive tensors can slide. New tensors are first
   distributed over segments by best-fit decreasing on each segment's free bytes (if that
   fails, Stage 1 evicts one more tensor and we retry). Then, per segment:

   * ``PGP`` (Partitioned-Gain Packing, Alg. 1): start from "compact the whole segment"
     and split the subspace at an inactive tensor that then stays where it is; a split
     is kept when TryPacking can divide the subspace's tensors over the two halves.
     Candidate partition points are tried largest first (the largest gain, as in
     Figure 6). Each final subspace is then placed without moves if best-fit can, else
     compacted (its inactive tensors slide to its low end, in address order).
   * ``GLOBAL_MERGE`` (the ablation baseline): compact every segment and place the new
     tensors in the merged free tails.

Where Alg. 1 is loose we implement its intent: a subspace's *capacity* is its free bytes
(compaction inside a subspace yields exactly that much contiguous space, since the tensors
it moves stay inside it), and TryPacking's fit test is "the tensor fits the half with the
larger remaining capacity" (the paper's ``t >= min(C1, C2)`` would reject tensors that
fit the larger half). Subspaces that receive no tensors cost nothing.

Guarantees (checked by property tests): placements never overlap each other or any region
that stays; only inactive tensors are evicted or moved; zero moves when best-fit can place
the request in the free regions; bytes moved never exceed those of compacting every
segment after the same evictions.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from gpu_pool.errors import OutOfMemory
from gpu_pool.regions import Region, RegionKind


class PackingPolicy(enum.Enum):
    PGP = "pgp"
    GLOBAL_MERGE = "global_merge"


@dataclass(frozen=True, slots=True)
class TensorRequest:
    """A tensor to place: its key (fingerprint) and its aligned size in bytes."""

    key: str
    size: int

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError(f"tensor {self.key}: size must be > 0")


@dataclass(frozen=True, slots=True)
class Move:
    """Slide an inactive tensor inside the arena (``dst`` may overlap ``src``)."""

    key: str
    src: int
    dst: int
    size: int


@dataclass(frozen=True, slots=True)
class Plan:
    """The planner's decision. Apply evictions, then moves in order, then load placements."""

    placements: dict[str, int]
    evictions: tuple[str, ...] = ()
    moves: tuple[Move, ...] = ()
    bytes_evicted: int = 0

    @property
    def bytes_moved(self) -> int:
        return sum(m.size for m in self.moves)


@dataclass(frozen=True, slots=True)
class MergeCosts:
    """The two prices of Tangram's Eq. 1, in seconds, that let Stage 2 trade moves for evictions.

    ``eviction`` maps an inactive tensor's key to c_j (Eq. 2: the expected reload time its
    eviction causes); ``move_seconds_per_byte`` prices m_j (a move costs its bytes over the
    device's in-arena copy bandwidth, paid now). Without them Stage 2 only moves.
    """

    eviction: Mapping[str, float]
    move_seconds_per_byte: float

    def __post_init__(self) -> None:
        if not self.move_seconds_per_byte >= 0:
            raise ValueError("move_seconds_per_byte must be >= 0")


# Failed TryPacking attempts after which a subspace stops looking for a partition point.
MAX_SPLIT_TRIES = 16

# Slot kinds of the planner's working layout.
_FREE, _MOVABLE, _FIXED = 0, 1, 2


@dataclass(frozen=True, slots=True)
class KVPlan:
    """Offsets of new KV blocks (highest addresses first) and the tensors evicted for them."""

    offsets: tuple[int, ...]
    evictions: tuple[str, ...] = ()
    bytes_evicted: int = 0


@dataclass(slots=True)
class _Slot:
    offset: int
    size: int
    kind: int
    key: str | None


@dataclass(slots=True)
class _Layout:
    """Mutable copy of the region list the planner evicts from.

    ``free`` (total free bytes) and ``movable`` (key -> size of inactive tensors) are kept
    up to date so Stage 1 can pick its victims without rescanning the list.
    """

    slots: list[_Slot]
    free: int = 0
    movable: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_regions(cls, regions: Sequence[Region]) -> _Layout:
        slots: list[_Slot] = []
        free = 0
        movable: dict[str, int] = {}
        for r in regions:
            if r.kind is RegionKind.FREE:
                kind = _FREE
                free += r.size
            elif r.kind is RegionKind.TENSOR and r.movable:
                kind = _MOVABLE
                movable[str(r.key)] = r.size
            else:
                kind = _FIXED
            if kind == _FREE and slots and slots[-1].kind == _FREE:
                slots[-1].size += r.size  # keep free regions maximal
            else:
                slots.append(_Slot(r.offset, r.size, kind, r.key))
        return cls(slots, free, movable)

    def evict_many(self, keys: Sequence[str]) -> None:
        """Turn the movable tensors ``keys`` into free space in one pass, merging neighbours."""
        victims = set(keys)
        merged: list[_Slot] = []
        for s in self.slots:
            if s.kind == _MOVABLE and s.key in victims:
                del self.movable[s.key]
                self.free += s.size
                s.kind, s.key = _FREE, None
            if s.kind == _FREE and merged and merged[-1].kind == _FREE:
                merged[-1].size += s.size
            else:
                merged.append(s)
        self.slots = merged

    def free_regions(self) -> list[tuple[int, int]]:
        return [(s.offset, s.size) for s in self.slots if s.kind == _FREE]


def plan(
    regions: Sequence[Region],
    requests: Sequence[TensorRequest],
    eviction_order: Sequence[str] = (),
    packing: PackingPolicy = PackingPolicy.PGP,
    costs: MergeCosts | None = None,
) -> Plan:
    """Plan the placement of ``requests`` (in load order) into the arena ``regions``.

    ``eviction_order`` lists inactive tensor keys, cheapest to evict first; keys that are
    not movable tensors of ``regions`` are ignored. With ``costs`` (PGP only), a final
    subspace that needs merging may instead evict the cheapest window of inactive tensors
    when that costs less than the moves (Eq. 1's evict-or-merge choice). Raises
    :class:`OutOfMemory` when the request does not fit even after evicting every listed tensor.
    """
    if not requests:
        return Plan({})
    layout = _Layout.from_regions(regions)
    sizes = dict(layout.movable)
    need = sum(r.size for r in requests)
    evicted: list[str] = []
    order = iter(eviction_order)

    def take_victims(min_free: int) -> bool:
        """Evict the next tensors of ``order`` (at least one) until free bytes >= ``min_free``."""
        batch: dict[str, None] = {}  # ordered set: duplicate keys in ``order`` count once
        free = layout.free
        for key in order:
            size = layout.movable.get(key)
            if size is None or key in batch:
                continue
            batch[key] = None
            free += size
            if free >= min_free:
                break
        layout.evict_many(list(batch))
        evicted.extend(batch)
        return bool(batch) and free >= min_free

    direct = place_direct(layout.free_regions(), requests)
    if direct is not None:
        return Plan(direct)
    if layout.free < need and not take_victims(need):
        raise _oom(layout, requests, eviction_order)
    while True:
        direct = place_direct(layout.free_regions(), requests)
        if direct is not None:
            return Plan(direct, tuple(evicted), (), sum(sizes[k] for k in evicted))
        segments = _segments(layout.slots)
        assignment = _distribute(requests, [seg_free for _, _, seg_free in segments])
        if assignment is not None:
            break
        if not take_victims(0):
            raise _oom(layout, requests, eviction_order)

    placements: dict[str, int] = {}
    moves: list[Move] = []
    for (lo, hi, _), assigned in zip(segments, assignment, strict=True):
        if packing is PackingPolicy.GLOBAL_MERGE:
            if any(layout.slots[i].kind == _MOVABLE for i in range(lo, hi)) or assigned:
                _compact_and_place(layout.slots, lo, hi, assigned, placements, moves)
        elif assigned:
            for sub_lo, sub_hi, sub_tensors in _partitioned_gain_packing(layout.slots, lo, hi, assigned):
                _place_subspace(layout.slots, sub_lo, sub_hi, sub_tensors, placements, moves, evicted, costs)
    return Plan(placements, tuple(evicted), tuple(moves), sum(sizes[k] for k in evicted))


def place_direct(free: Sequence[tuple[int, int]], requests: Sequence[TensorRequest]) -> dict[str, int] | None:
    """Placements into free ``(offset, size)`` regions without moving anything, or None.

    First the whole request as one block in the smallest free region that holds it (so the
    tensors stay adjacent in load order and their copies coalesce); else best-fit
    decreasing, each tensor at the start of the smallest free region that holds it.
    """
    total = sum(r.size for r in requests)
    fitting = [f for f in free if f[1] >= total]
    if fitting:
        offset = min(fitting, key=lambda f: (f[1], f[0]))[0]
        placements = {}
        for r in requests:
            placements[r.key] = offset
            offset += r.size
        return placements
    by_size = sorted((size, offset) for offset, size in free)
    placements = {}
    for r in sorted(requests, key=lambda r: -r.size):
        i = bisect.bisect_left(by_size, (r.size, -1))
        if i == len(by_size):
            return None
        size, offset = by_size.pop(i)
        placements[r.key] = offset
        if size > r.size:
            bisect.insort(by_size, (size - r.size, offset + r.size))
    return placements


def full_compaction_bytes(regions: Sequence[Region], evicted: Sequence[str] = ()) -> int:
    """Bytes that compacting every segment would move, after evicting ``evicted``.

    The upper bound Stage 2 must respect (the "merge all" starting point of Alg. 1).
    """
    layout = _Layout.from_regions(regions)
    layout.evict_many(evicted)
    moved = 0
    for lo, hi, _ in _segments(layout.slots):
        cursor = layout.slots[lo].offset
        for s in layout.slots[lo:hi]:
            if s.kind == _MOVABLE:
                if s.offset != cursor:
                    moved += s.size
                cursor += s.size
    return moved


def _oom(layout: _Layout, requests: Sequence[TensorRequest], order: Sequence[str]) -> OutOfMemory:
    need = sum(r.size for r in requests)
    free = layout.free
    what = f"placing {len(requests)} tensors"
    if free >= need:
        what += " (free space is cut into pieces by pinned tensors and KV blocks, which never move)"
    return OutOfMemory(what, need, free)


def _segments(slots: list[_Slot]) -> list[tuple[int, int, int]]:
    """Maximal runs ``[lo, hi)`` of slots between fixed regions, with their free bytes."""
    segments: list[tuple[int, int, int]] = []
    lo = 0
    free = 0
    for i, s in enumerate(slots):
        if s.kind == _FIXED:
            if i > lo:
                segments.append((lo, i, free))
            lo, free = i + 1, 0
        elif s.kind == _FREE:
            free += s.size
    if len(slots) > lo:
        segments.append((lo, len(slots), free))
    return segments


def _distribute(requests: Sequence[TensorRequest], capacities: list[int]) -> list[list[TensorRequest]] | None:
    """Best-fit decreasing of the requests over bins of the given free capacities."""
    remaining = list(capacities)
    bins: list[list[TensorRequest]] = [[] for _ in capacities]
    for r in sorted(requests, key=lambda r: -r.size):
        best = -1
        for i, cap in enumerate(remaining):
            if cap >= r.size and (best < 0 or cap < remaining[best]):
                best = i
        if best < 0:
            return None
        remaining[best] -= r.size
        bins[best].append(r)
    return bins


def _try_packing(
    tensors: list[TensorRequest], cap1: int, cap2: int
) -> tuple[list[TensorRequest], list[TensorRequest]] | None:
    """Alg. 1 TryPacking: each tensor (largest first) goes to the half with more room."""
    first: list[bool] = []
    for t in tensors:
        size = t.size
        if cap1 >= cap2:
            if size > cap1:
                return None
            cap1 -= size
            first.append(True)
        else:
            if size > cap2:
                return None
            cap2 -= size
            first.append(False)
    return [t for t, f in zip(tensors, first, strict=True) if f], [
        t for t, f in zip(tensors, first, strict=True) if not f
    ]


def _partitioned_gain_packing(
    slots: list[_Slot], lo: int, hi: int, tensors: list[TensorRequest]
) -> list[tuple[int, int, list[TensorRequest]]]:
    """Alg. 1 on one segment: final subspaces ``[lo, hi)`` with the tensors each must hold."""
    # prefix[i - lo]: free bytes of slots[lo:i]. A partition point p is an inactive tensor,
    # so the halves of [a, b) split at p hold prefix[p] - prefix[a] and prefix[b] - prefix[p].
    prefix = [0, *itertools.accumulate(s.size if s.kind == _FREE else 0 for s in slots[lo:hi])]
    size_at = [s.size for s in slots[lo:hi]]
    # Each subspace carries its partition points in address order: a split hands each half
    # a slice (found by bisection). Points are tried largest gain first, at most
    # MAX_SPLIT_TRIES failed packings per subspace (gains further down are the smallest).
    points = [i - lo for i in range(lo, hi) if slots[i].kind == _MOVABLE]
    pending = [(0, hi - lo, sorted(tensors, key=lambda t: -t.size), points)]
    final: list[tuple[int, int, list[TensorRequest]]] = []
    while pending:
        a, b, ts, cands = pending.pop()
        if not ts:
            continue
        if (
            place_direct([(s.offset, s.size) for s in slots[lo + a : lo + b] if s.kind == _FREE], ts)
            is not None
        ):
            final.append((a + lo, b + lo, ts))  # fits without moves: splitting further gains nothing
            continue
        # Tensors larger than the smaller half must all fit the larger one: a necessary
        # condition checked in O(log n) before the O(n) TryPacking (most attempts fail it).
        neg_sizes = [-t.size for t in ts]  # ascending
        sizes_prefix = list(itertools.accumulate(-n for n in neg_sizes))
        fa, fb = prefix[a], prefix[b]
        tries = 0
        split = False
        for p in sorted(cands, key=size_at.__getitem__, reverse=True):
            fp = prefix[p]
            cap1, cap2 = fp - fa, fb - fp
            small, big = (cap1, cap2) if cap1 <= cap2 else (cap2, cap1)
            forced = bisect.bisect_left(neg_sizes, -small)  # tensors that fit only the larger half
            if forced and sizes_prefix[forced - 1] > big:
                continue
            halves = _try_packing(ts, cap1, cap2)
            if halves is not None:
                k = bisect.bisect_left(cands, p)
                pending.append((a, p, halves[0], cands[:k]))
                pending.append((p + 1, b, halves[1], cands[k + 1 :]))
                split = True
                break
            tries += 1
            if tries >= MAX_SPLIT_TRIES:
                break
        if not split:
            final.append((a + lo, b + lo, ts))
    return final


def _place_subspace(
    slots: list[_Slot],
    lo: int,
    hi: int,
    tensors: list[TensorRequest],
    placements: dict[str, int],
    moves: list[Move],
    evicted: list[str],
    costs: MergeCosts | None,
) -> None:
    """Place a final subspace's tensors: without moves if best-fit can; else merge the
    cheapest window of it, by moving or (with ``costs``, when cheaper) by evicting.

    Windows are runs of regions inside the subspace. The move window is the one with free
    bytes >= the tensors' total and the fewest bytes actually moved by compacting it; the
    eviction window the one whose free plus inactive bytes cover the total at the lowest
    summed c_j. Both are found with two pointers (for each right end the shortest feasible
    window is the cheapest, since costs are non-negative). Compacting a window moves a
    subset of what compacting the whole segment would: a tensor moves only if free space
    precedes it inside the window.
    """
    free = [(s.offset, s.size) for s in slots[lo:hi] if s.kind == _FREE]
    direct = place_direct(free, tensors)
    if direct is not None:
        placements.update(direct)
        return
    need = sum(t.size for t in tensors)
    move_window = _cheapest_window(slots, lo, hi, need, lambda s: float(s.size), count_tensors_as_space=False)
    assert move_window is not None, "the subspace's free bytes cover its tensors"
    a, b = move_window
    if costs is not None:
        evict_window = _cheapest_window(
            slots, lo, hi, need, lambda s: costs.eviction.get(str(s.key), 0.0), count_tensors_as_space=True
        )
        move_seconds = _compaction_bytes(slots, a, b) * costs.move_seconds_per_byte
        if evict_window is not None:
            ea, eb = evict_window
            evict_seconds = sum(
                costs.eviction.get(str(s.key), 0.0) for s in slots[ea:eb] if s.kind == _MOVABLE
            )
            if evict_seconds < move_seconds:
                for s in slots[ea:eb]:
                    if s.kind == _MOVABLE:
                        assert s.key is not None
                        evicted.append(s.key)
                        s.kind, s.key = _FREE, None
                cursor = slots[ea].offset
                for t in tensors:
                    placements[t.key] = cursor
                    cursor += t.size
                assert cursor <= slots[eb - 1].offset + slots[eb - 1].size
                return
    _compact_and_place(slots, a, b, tensors, placements, moves)


def _cheapest_window(
    slots: list[_Slot],
    lo: int,
    hi: int,
    need: int,
    tensor_cost: Callable[[_Slot], float],
    count_tensors_as_space: bool,
) -> tuple[int, int] | None:
    """The window ``[a, b)`` of ``slots[lo:hi]`` whose space covers ``need`` at the lowest cost.

    Space is the free bytes, plus the inactive tensors' bytes when they would be evicted.
    Cost is ``tensor_cost`` summed over the inactive tensors in the window (their bytes for
    a move window, their c_j for an eviction window).
    """
    window = slots[lo:hi]
    spaces = [s.size if s.kind == _FREE or count_tensors_as_space else 0 for s in window]
    costs = [0.0 if s.kind == _FREE else tensor_cost(s) for s in window]
    best: tuple[int, int] | None = None
    best_cost = 0.0
    left, space, cost = 0, 0, 0.0
    for right in range(len(window)):
        space += spaces[right]
        cost += costs[right]
        while left < right and space - spaces[left] >= need:
            space -= spaces[left]
            cost -= costs[left]
            left += 1
        if space >= need and (best is None or cost < best_cost):
            best, best_cost = (lo + left, lo + right + 1), cost
    return best


def _compaction_bytes(slots: list[_Slot], lo: int, hi: int) -> int:
    """Bytes that sliding the inactive tensors of ``[lo, hi)`` to its low end moves."""
    cursor = slots[lo].offset
    moved = 0
    for s in slots[lo:hi]:
        if s.kind == _MOVABLE:
            if s.offset != cursor:
                moved += s.size
            cursor += s.size
    return moved


def _compact_and_place(
    slots: list[_Slot],
    lo: int,
    hi: int,
    tensors: list[TensorRequest],
    placements: dict[str, int],
    moves: list[Move],
) -> None:
    """Slide the movable tensors of ``[lo, hi)`` to its low end, then fill the free tail.

    Moves are emitted in address order and each goes to a lower address, so executing them
    in order never overwrites bytes that are still to be moved (only a tensor's own old
    bytes, which an overlap-safe move handles).
    """
    cursor = slots[lo].offset
    for s in slots[lo:hi]:
        if s.kind == _MOVABLE:
            if s.offset != cursor:
                assert s.key is not None
                moves.append(Move(s.key, s.offset, cursor, s.size))
            cursor += s.size
    end = slots[hi - 1].offset + slots[hi - 1].size
    for t in tensors:
        placements[t.key] = cursor
        cursor += t.size
    assert cursor <= end, "distribution guaranteed the subspace's free bytes cover its tensors"


def plan_kv(
    regions: Sequence[Region],
    num_blocks: int,
    block_size: int,
    eviction_order: Sequence[str] = (),
    aligned: bool = False,
) -> KVPlan:
    """Carve ``num_blocks`` KV blocks of ``block_size`` bytes out of free regions.

    Blocks are cut from the high end of the highest free regions, so KV grows down from the
    top of the arena while tensors are placed best-fit from region starts: the two kinds
    fragment each other less. With ``aligned``, every block starts at a multiple of
    ``block_size``, so ``offset // block_size`` is a physical block number and the engine
    can view the arena as an array of blocks. When free space runs short this is the
    *urgent* path of Tangram §3.3: inactive tensors are evicted in ``eviction_order`` (never
    moved, never a pinned tensor) until the blocks fit.
    """
    if num_blocks <= 0 or block_size <= 0:
        raise ValueError("num_blocks and block_size must be > 0")
    unit = block_size if aligned else 1

    def span(offset: int, size: int) -> tuple[int, int]:
        """The aligned sub-range [start, end) of a free region that blocks may use."""
        start = -(-offset // unit) * unit
        end = (offset + size) // unit * unit
        return start, max(start, end)

    def capacity() -> int:
        return sum((e - b) // block_size for b, e in (span(o, n) for o, n in layout.free_regions()))

    layout = _Layout.from_regions(regions)
    evicted: list[str] = []
    bytes_evicted = 0
    order = iter(eviction_order)
    while capacity() < num_blocks:
        for key in order:
            size = layout.movable.get(key, 0)
            if size:
                layout.evict_many([key])
                evicted.append(key)
                bytes_evicted += size
                break
        else:
            raise OutOfMemory(
                f"allocating {num_blocks} KV blocks of {block_size} bytes",
                num_blocks * block_size,
                capacity() * block_size,
            )
    offsets: list[int] = []
    for offset, size in reversed(layout.free_regions()):
        start, end = span(offset, size)
        for _ in range(min(num_blocks - len(offsets), (end - start) // block_size)):
            end -= block_size
            offsets.append(end)
        if len(offsets) == num_blocks:
            break
    return KVPlan(tuple(offsets), tuple(evicted), bytes_evicted)
