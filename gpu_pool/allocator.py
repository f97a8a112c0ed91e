"""The Tangram tensor planner: where new tensors go, what is evicted, what is moved.

Pure Python and numpy, no torch and no I/O: it takes the region list and the (aligned)
sizes of the missing tensors and returns a :class:`Plan`; the Reuse Store applies plans to
an arena. Benchmarks and property tests drive :func:`plan` directly.

Steps, following Tangram §3.2 (Eq. 1-2, Alg. 1, Figure 6):

0. *Direct placement.* If the new tensors fit the free regions as they are (the whole
   request as one contiguous block, else best-fit decreasing per tensor), the plan has
   no evictions and no moves.
1. *Stage 1, eviction* in the caller's order (:mod:`gpu_pool.eviction`: MCE, LRU or
   random) until the free bytes cover the request; direct placement is tried again.
2. *Stage 2, packing with moves* (:mod:`gpu_pool.packing`): the new tensors are spread
   over the segments between fixed regions (if that fails, Stage 1 evicts one more tensor
   and we retry), then each segment is packed by PGP or, as the ablation baseline,
   compacted whole (GLOBAL_MERGE).

The working copy of the arena is a :class:`gpu_pool.layout.Layout` (allocated regions as
arrays, free space as the gaps), so the arena-wide steps cost a few numpy operations and
a decision over ~1,500 regions stays around a millisecond (``bench/planner.py``).

Guarantees (checked by property tests): placements never overlap each other or any region
that stays; only inactive tensors are evicted or moved; zero moves when best-fit can place
the request in the free regions; bytes moved never exceed those of compacting every
segment after the same evictions.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpu_pool.errors import OutOfMemory
from gpu_pool.layout import Layout
from gpu_pool.packing import (
    MAX_SPLIT_TRIES,
    compact_range,
    compaction_bytes,
    distribute,
    partitioned_gain_packing,
    place_subspace,
    runs_of,
)
from gpu_pool.packing import place_direct as _place_direct
from gpu_pool.plan_types import KVPlan, MergeCosts, Move, PackingPolicy, Plan, TensorRequest
from gpu_pool.regions import Region

__all__ = [
    "MAX_SPLIT_TRIES",
    "KVPlan",
    "MergeCosts",
    "Move",
    "PackingPolicy",
    "Plan",
    "TensorRequest",
    "full_compaction_bytes",
    "place_direct",
    "plan",
    "plan_kv",
]


def _neg_size(r: TensorRequest) -> int:
    return -r.size


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
    layout = Layout.from_regions(regions)
    desc = sorted(requests, key=_neg_size)  # stable: equal sizes keep load order
    need = sum(r.size for r in requests)
    evicted: list[str] = []
    bytes_evicted = 0
    order = iter(eviction_order)

    def take_victims(min_free: int) -> bool:
        """Evict the next tensors of ``order`` (at least one) until free bytes >= ``min_free``."""
        nonlocal bytes_evicted
        batch: dict[str, None] = {}  # ordered set: duplicate keys in ``order`` count once
        free = layout.free
        sizes = layout.movable_size
        for key in order:
            size = sizes.get(key)
            if size is None or key in batch:
                continue
            batch[key] = None
            free += size
            bytes_evicted += size
            if free >= min_free:
                break
        layout.evict(batch)
        evicted.extend(batch)
        return bool(batch) and free >= min_free

    runs = runs_of(desc)
    while True:  # direct placement, after each round of Stage 1 evictions
        direct = _place_direct(*layout.free_columns(), requests, desc, runs, need)
        if direct is not None:
            return Plan(direct, tuple(evicted), (), bytes_evicted)
        if layout.free < need:
            if not take_victims(need):
                raise _oom(layout, requests)
            continue
        segments = layout.segments()
        assignment = distribute(desc, runs, segments.free)
        if assignment is not None:
            break
        if not take_victims(0):
            raise _oom(layout, requests)

    snap = layout.snapshot()
    placements: dict[str, int] = {}
    moves: list[Move] = []
    if packing is PackingPolicy.GLOBAL_MERGE:
        for j, (a, b) in enumerate(zip(segments.first_gap, segments.last_gap, strict=True)):
            assigned = assignment.get(j, [])
            if b > a or assigned:
                compact_range(snap, a, b, assigned, placements, moves)
    else:
        for j in sorted(assignment):  # address order
            a, b = segments.first_gap[j], segments.last_gap[j]
            for sub in partitioned_gain_packing(snap, a, b, assignment[j]):
                bytes_evicted += place_subspace(snap, sub, placements, moves, evicted, costs)
    return Plan(placements, tuple(evicted), tuple(moves), bytes_evicted)


def place_direct(free: Sequence[tuple[int, int]], requests: Sequence[TensorRequest]) -> dict[str, int] | None:
    """Placements into free ``(offset, size)`` regions without moving anything, or None.

    First the whole request as one block in the smallest free region that holds it (so the
    tensors stay adjacent in load order and their copies coalesce); else best-fit
    decreasing, each tensor at the start of the smallest free region that holds it.
    """
    desc = sorted(requests, key=_neg_size)
    offsets = [offset for offset, _ in free]
    lens = [size for _, size in free]
    return _place_direct(offsets, lens, requests, desc, runs_of(desc), sum(r.size for r in requests))


def full_compaction_bytes(regions: Sequence[Region], evicted: Sequence[str] = ()) -> int:
    """Bytes that compacting every segment would move, after evicting ``evicted``.

    The upper bound Stage 2 must respect (the "merge all" starting point of Alg. 1).
    """
    layout = Layout.from_regions(regions)
    layout.evict(dict.fromkeys(k for k in evicted if k in layout.movable_size))
    snap = layout.snapshot()
    segments = layout.segments()
    return sum(
        compaction_bytes(snap, a, b) for a, b in zip(segments.first_gap, segments.last_gap, strict=True)
    )


def _oom(layout: Layout, requests: Sequence[TensorRequest]) -> OutOfMemory:
    need = sum(r.size for r in requests)
    free = layout.free
    what = f"placing {len(requests)} tensors"
    if free >= need:
        what += " (free space is cut into pieces by pinned tensors and KV blocks, which never move)"
    return OutOfMemory(what, need, free)


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

    layout = Layout.from_regions(regions)
    evicted: list[str] = []
    bytes_evicted = 0
    order = iter(eviction_order)
    while capacity() < num_blocks:
        for key in order:
            size = layout.movable_size.get(key, 0)
            if size:
                layout.evict([key])
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
