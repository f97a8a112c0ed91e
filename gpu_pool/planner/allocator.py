"""The Tangram tensor planner: where new tensors go, what is evicted, what is moved.

No torch and no I/O: it takes the region list (or its columns) and the (aligned) sizes of
the missing tensors and returns a :class:`Plan`; the Reuse Store applies plans to an
arena. Benchmarks and property tests drive :func:`plan` directly.

Steps, following Tangram §3.2 (Eq. 1-2, Alg. 1, Figure 6):

0. *Direct placement.* If the new tensors fit the free regions as they are (the whole
   request as one contiguous block, else best-fit decreasing per tensor), the plan has
   no evictions and no moves.
1. *Stage 1, eviction* in the caller's order (:mod:`gpu_pool.planner.eviction`: MCE, LRU or
   random) until the free bytes cover the request; direct placement is tried again.
2. *Stage 2, packing with moves* (:mod:`gpu_pool.planner.packing`): the new tensors are spread
   over the segments between fixed regions (if that fails, Stage 1 evicts one more tensor
   and we retry), then each segment is packed by PGP or, as the ablation baseline,
   compacted whole (GLOBAL_MERGE).

Two engines make the same decisions: the default runs the whole decision in C
(:mod:`gpu_pool.planner.native_planner`, ``gpu_pool/planner/csrc/``: ~0.3 ms over ~1,500 regions, see
``bench/planner.py``); ``PlannerEngine.PYTHON`` is this module and :mod:`gpu_pool.planner.packing`,
the readable reference, working on a :class:`gpu_pool.planner.layout.Layout` (allocated regions as
arrays, free space as the gaps between them). Property tests check that both return
identical plans.

Guarantees (checked by property tests): placements never overlap each other or any region
that stays; only inactive tensors are evicted or moved; zero moves when best-fit can place
the request in the free regions; bytes moved never exceed those of compacting every
segment after the same evictions.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from gpu_pool.errors import OutOfMemory
from gpu_pool.planner.layout import Layout, RegionColumns
from gpu_pool.planner.native_planner import plan_native
from gpu_pool.planner.packing import (
    MAX_SPLIT_TRIES,
    compact_range,
    compaction_bytes,
    distribute,
    partitioned_gain_packing,
    place_subspace,
    runs_of,
)
from gpu_pool.planner.packing import place_direct as _place_direct
from gpu_pool.planner.plan_types import (
    KVPlan,
    MergeCosts,
    Move,
    PackingPolicy,
    Plan,
    PlannerEngine,
    TensorRequest,
    out_of_memory,
)
from gpu_pool.planner.regions import Region

__all__ = [
    "MAX_SPLIT_TRIES",
    "KVPlan",
    "MergeCosts",
    "Move",
    "PackingPolicy",
    "Plan",
    "PlannerEngine",
    "TensorRequest",
    "full_compaction_bytes",
    "place_direct",
    "plan",
    "plan_kv",
]


_SIZE = attrgetter("size")


def plan(
    regions: Sequence[Region] | RegionColumns,
    requests: Sequence[TensorRequest],
    eviction_order: Sequence[str] = (),
    packing: PackingPolicy = PackingPolicy.PGP,
    costs: MergeCosts | None = None,
    engine: PlannerEngine = PlannerEngine.NATIVE,
    max_split_tries: int = MAX_SPLIT_TRIES,
) -> Plan:
    """Plan the placement of ``requests`` (in load order) into the arena ``regions`` (a
    region list, or its allocated regions as :class:`RegionColumns`).

    ``eviction_order`` lists inactive tensor keys, cheapest to evict first; keys that are
    not movable tensors of ``regions`` are ignored. With ``costs`` (PGP only), a final
    subspace that needs merging may instead evict the cheapest window of inactive tensors
    when that costs less than the moves (Eq. 1's evict-or-merge choice). ``engine`` picks
    the C core or its Python reference (same plans); ``max_split_tries`` bounds the failed
    TryPackings per PGP subspace (Alg. 1's search; fewer means more merging). Raises
    :class:`OutOfMemory` when the request does not fit even after evicting every listed tensor.
    """
    if max_split_tries < 1:
        raise ValueError("max_split_tries must be >= 1")
    if not requests:
        return Plan({})
    if engine is PlannerEngine.NATIVE:
        columns = regions if isinstance(regions, RegionColumns) else RegionColumns.of(regions)
        return plan_native(columns, requests, eviction_order, packing, costs, max_split_tries)
    layout = Layout.of(regions)
    desc = sorted(requests, key=_SIZE, reverse=True)  # stable: equal sizes keep load order
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
                raise out_of_memory(requests, layout.free)
            continue
        segments = layout.segments()
        assignment = distribute(desc, runs, segments.free)
        if assignment is not None:
            break
        if not take_victims(0):
            raise out_of_memory(requests, layout.free)

    placements: dict[str, int] = {}
    moves: list[Move] = []
    if packing is PackingPolicy.GLOBAL_MERGE:
        snap = layout.snapshot()
        for j, (a, b) in enumerate(zip(segments.first_gap, segments.last_gap, strict=True)):
            assigned = assignment.get(j, [])
            if b > a or assigned:
                compact_range(snap, a, b, assigned, placements, moves)
    else:
        snap = layout.snapshot()
        for j in sorted(assignment):  # address order
            a, b = segments.first_gap[j], segments.last_gap[j]
            for sub in partitioned_gain_packing(snap, a, b, assignment[j], max_split_tries):
                bytes_evicted += place_subspace(snap, sub, placements, moves, evicted, costs)
    return Plan(placements, tuple(evicted), tuple(moves), bytes_evicted)


def place_direct(free: Sequence[tuple[int, int]], requests: Sequence[TensorRequest]) -> dict[str, int] | None:
    """Placements into free ``(offset, size)`` regions without moving anything, or None.

    First the whole request as one block in the smallest free region that holds it (so the
    tensors stay adjacent in load order and their copies coalesce); else best-fit
    decreasing, each tensor at the start of the smallest free region that holds it.
    """
    desc = sorted(requests, key=_SIZE, reverse=True)
    offsets = [offset for offset, _ in free]
    lens = [size for _, size in free]
    return _place_direct(offsets, lens, requests, desc, runs_of(desc), sum(r.size for r in requests))


def full_compaction_bytes(regions: Sequence[Region], evicted: Sequence[str] = ()) -> int:
    """Bytes that compacting every segment would move, after evicting ``evicted``.

    The upper bound Stage 2 must respect (the "merge all" starting point of Alg. 1).
    """
    layout = Layout.of(regions)
    layout.evict(dict.fromkeys(k for k in evicted if k in layout.movable_size))
    snap = layout.snapshot()
    segments = layout.segments()
    return sum(
        compaction_bytes(snap, a, b) for a, b in zip(segments.first_gap, segments.last_gap, strict=True)
    )


def plan_kv(
    regions: Sequence[Region] | RegionColumns,
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

    layout = Layout.of(regions)
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
