"""Stage 2 of the Tangram planner: pack new tensors into segments, moving as little as possible.

Pinned tensors and KV blocks never move, so they cut the arena into *segments* (see
:mod:`gpu_pool.planner.layout`) inside which inactive tensors can slide. :func:`distribute` spreads
the new tensors over segments (best-fit decreasing on each segment's free bytes); then per
segment either

* PGP (Partitioned-Gain Packing, Tangram Alg. 1, :func:`partitioned_gain_packing`): start
  from "compact the whole segment" and split the subspace at an inactive tensor that then
  stays where it is; a split is kept when TryPacking can divide the subspace's tensors
  over the two halves. Candidate partition points are tried largest first (the largest
  gain, as in Figure 6). Each final subspace is placed without moves if best-fit can,
  else its cheapest window is merged (:func:`place_subspace`); or
* GLOBAL_MERGE (the ablation baseline, :func:`compact_range`): compact the whole segment
  and place the new tensors in its free tail.

Where Alg. 1 is loose we implement its intent: a subspace's *capacity* is its free bytes
(compaction inside a subspace yields exactly that much contiguous space, since the tensors
it moves stay inside it), and TryPacking's fit test is "the tensor fits the half with the
larger remaining capacity" (the paper's ``t >= min(C1, C2)`` would reject tensors that fit
the larger half). Subspaces that receive no tensors cost nothing.

Subspaces are named by gap indices of a :class:`gpu_pool.planner.layout.Snapshot`: ``(a, b)`` is
gaps ``a..b`` and the movable tensors ``a..b-1`` between them.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from itertools import accumulate, repeat

import numpy as np
import numpy.typing as npt

from gpu_pool.planner.layout import Snapshot
from gpu_pool.planner.plan_types import MergeCosts, Move, TensorRequest

_new_tuple = tuple.__new__

# Failed TryPacking attempts after which a subspace stops looking for a partition point.
MAX_SPLIT_TRIES = 16

# A final subspace: gaps a..b, its tensors, and their placements when best-fit places them
# without moves (None: it cannot, the subspace must be merged).
Subspace = tuple[int, int, list[TensorRequest], dict[str, int] | None]


def runs_of(desc: Sequence[TensorRequest]) -> list[tuple[int, int]]:
    """``(size, count)`` runs of tensors sorted largest first.

    A model's tensors come in few distinct sizes (a 7B Llama: 291 tensors, 6 sizes), so the
    best-fit steps below work per run, not per tensor, wherever that is exact.
    """
    return list(Counter([r.size for r in desc]).items())  # dicts keep the (descending) order


def place_direct(
    offsets: Sequence[int],
    lens: Sequence[int],
    in_order: Sequence[TensorRequest],
    desc: Sequence[TensorRequest],
    runs: Sequence[tuple[int, int]],
    total: int,
) -> dict[str, int] | None:
    """Placements into free regions (``offsets[i]``, ``lens[i]`` bytes, empty ones allowed)
    without moving anything, or None.

    First the whole request as one block (``in_order``, adjacent, so copies coalesce) in
    the smallest free region that holds all ``total`` bytes, lowest offset on ties; else
    best-fit decreasing over ``desc`` (the same tensors, largest first, whose sizes are
    ``runs``), each tensor at the start of the smallest free region that holds it.
    """
    largest = max(lens, default=0)
    if largest >= total:
        _, offset = min((size, off) for off, size in zip(offsets, lens, strict=True) if size >= total)
        placements = {}
        for r in in_order:
            placements[r.key] = offset
            offset += r.size
        return placements
    if not runs or runs[0][0] > largest:
        return None  # the largest tensor fits no free region
    # Necessary condition, O(n) after a sort of ints: the tensors of >= x bytes can only go
    # to regions of >= x bytes, so for each tensor size x (largest first) their total must
    # not exceed those regions' total. It rejects most failing requests before best-fit.
    gaps = sorted(lens, reverse=True)
    num_gaps, i, avail, wanted = len(gaps), 0, 0, 0
    for size, count in runs:
        while i < num_gaps and gaps[i] >= size:
            avail += gaps[i]
            i += 1
        wanted += size * count
        if wanted > avail:
            return None
    chunks = _best_fit(sorted(zip(lens, offsets, strict=True)), runs, tag_is_offset=True)
    if chunks is None:
        return None
    placements = {}
    for start, size, first, k in chunks:
        for n, r in enumerate(desc[first : first + k]):
            placements[r.key] = start + n * size
    return placements


def _best_fit(
    bins: list[tuple[int, int]], runs: Sequence[tuple[int, int]], tag_is_offset: bool
) -> list[tuple[int, int, int, int]] | None:
    """Best-fit decreasing, a run at a time, over ``bins`` of ``(free bytes, tag)`` sorted
    ascending (ties: lowest tag). Returns ``(tag, size, first, count)`` chunks: tensors
    ``first..first+count-1`` of the run of ``size`` go to the bin ``tag``; None when a
    tensor fits no bin. ``tag_is_offset``: the tag is the bin's start, which moves up as
    it fills (else it is an index and stays).

    The smallest bin that holds a tensor of the run stays the smallest such bin while it
    still holds one (its remainder is smaller than every other candidate), so it takes as
    many of the run as fit: exact best-fit, in O(bins touched) rather than O(tensors).
    """
    chunks: list[tuple[int, int, int, int]] = []
    first = 0
    for size, count in runs:
        placed = 0
        while placed < count:
            i = bisect.bisect_left(bins, (size, -1))
            if i == len(bins):
                return None
            free, tag = bins.pop(i)
            k = min(count - placed, free // size)
            chunks.append((tag, size, first + placed, k))
            placed += k
            if free > k * size:
                bisect.insort(bins, (free - k * size, tag + k * size if tag_is_offset else tag))
        first += count
    return chunks


def distribute(
    desc: Sequence[TensorRequest], runs: Sequence[tuple[int, int]], capacities: Sequence[int]
) -> dict[int, list[TensorRequest]] | None:
    """Best-fit decreasing of ``desc`` (largest first, sizes ``runs``) over bins of the given
    free capacities, a run at a time as in :func:`place_direct`.

    Returns bin index -> its tensors (largest first), or None when a tensor fits no bin.
    Ties between bins of equal remaining capacity go to the lowest index.
    """
    chunks = _best_fit(
        sorted((cap, j) for j, cap in enumerate(capacities) if cap > 0), runs, tag_is_offset=False
    )
    if chunks is None:
        return None
    out: dict[int, list[TensorRequest]] = {}
    for j, _, first, k in chunks:
        out.setdefault(j, []).extend(desc[first : first + k])
    return out


def _without_moves(
    snap: Snapshot, a: int, b: int, ts: list[TensorRequest], runs: list[tuple[int, int]], total: int
) -> dict[str, int] | None:
    """Best-fit placements of ``ts`` (largest first) into gaps ``a..b``, or None."""
    return place_direct(snap.gap_start[a : b + 1], snap.gap_len[a : b + 1], ts, ts, runs, total)


def _after_run(size: int, count: int, cap1: int, cap2: int) -> tuple[int, int]:
    """The halves' free bytes after TryPacking placed ``count`` tensors of ``size`` bytes,
    each into the half with more room (the first on ties).

    Closed form: the roomier half takes tensors until it is no longer the roomier one
    (``k`` of them); after that the halves alternate, the other one first.
    """
    d = cap1 - cap2
    if d >= 0:
        k = min(count, d // size + 1)
        rest = count - k
        return cap1 - (k + rest // 2) * size, cap2 - ((rest + 1) // 2) * size
    k = min(count, (-d + size - 1) // size)
    rest = count - k
    return cap1 - ((rest + 1) // 2) * size, cap2 - (k + rest // 2) * size


def _try_packing(runs: list[tuple[int, int]], cap1: int, cap2: int) -> bool:
    """Alg. 1 TryPacking's feasibility: each tensor (largest first) to the half with more room.

    The room of the roomier half never grows, so a run of equal tensors fits iff its last
    tensor does: O(1) per run instead of per tensor.
    """
    for size, count in runs:
        if count > 1:
            cap1, cap2 = _after_run(size, count - 1, cap1, cap2)
        if cap1 >= cap2:
            if size > cap1:
                return False
            cap1 -= size
        else:
            if size > cap2:
                return False
            cap2 -= size
    return True


def _split(ts: list[TensorRequest], cap1: int, cap2: int) -> tuple[list[TensorRequest], list[TensorRequest]]:
    """The halves of a TryPacking that :func:`_try_packing` found feasible."""
    first: list[TensorRequest] = []
    second: list[TensorRequest] = []
    for t in ts:
        if cap1 >= cap2:
            first.append(t)
            cap1 -= t.size
        else:
            second.append(t)
            cap2 -= t.size
    return first, second


def partitioned_gain_packing(
    snap: Snapshot,
    first_gap: int,
    last_gap: int,
    tensors: list[TensorRequest],
    max_split_tries: int = MAX_SPLIT_TRIES,
) -> list[Subspace]:
    """Alg. 1 on one segment: the final subspaces with the tensors each must hold.

    ``tensors`` are largest first. Each subspace carries its partition points (its movable
    tensors) largest first, ties in address order; a split hands each half the points on
    its side. At most ``max_split_tries`` failed packings per subspace (the gains further
    down the list are the smallest).
    """
    sizes, prefix = snap.sizes, snap.gap_prefix
    points = sorted(range(first_gap, last_gap), key=sizes.__getitem__, reverse=True)
    pending = [(first_gap, last_gap, tensors, points)]
    final: list[Subspace] = []
    while pending:
        a, b, ts, cands = pending.pop()
        if not ts:
            continue
        runs = runs_of(ts)
        direct = _without_moves(snap, a, b, ts, runs, sum(s * n for s, n in runs))
        if direct is not None:
            final.append((a, b, ts, direct))  # splitting further gains nothing
            continue
        # Tensors larger than the smaller half must all fit the larger one: a necessary
        # condition checked in O(log runs) before TryPacking.
        largest = runs[0][0]
        neg_sizes = [-s for s, _ in runs]  # ascending
        sizes_prefix = list(accumulate(s * n for s, n in runs))
        fa, fb = prefix[a], prefix[b + 1]
        tries = 0
        for p in cands:
            fp = prefix[p + 1]  # free bytes of gaps 0..p: the left half ends just before tensor p
            cap1, cap2 = fp - fa, fb - fp
            small, big = (cap1, cap2) if cap1 <= cap2 else (cap2, cap1)
            if largest > small and sizes_prefix[bisect.bisect_left(neg_sizes, -small) - 1] > big:
                continue
            if _try_packing(runs, cap1, cap2):
                left, right = _split(ts, cap1, cap2)
                pending.append((a, p, left, [c for c in cands if c < p]))
                pending.append((p + 1, b, right, [c for c in cands if c > p]))
                break
            tries += 1
            if tries >= max_split_tries:
                final.append((a, b, ts, None))
                break
        else:
            final.append((a, b, ts, None))
    return final


def place_subspace(
    snap: Snapshot,
    sub: Subspace,
    placements: dict[str, int],
    moves: list[Move],
    evicted: list[str],
    costs: MergeCosts | None,
) -> int:
    """Place a final subspace's tensors; returns the bytes it evicted.

    Without moves if best-fit can (found by :func:`partitioned_gain_packing`); else merge
    the cheapest window of it, by moving or (with ``costs``, when cheaper) by evicting.
    Windows are runs of regions (gaps and tensors) inside the subspace. The move window is
    the one with free bytes >= the tensors' total and the fewest bytes moved by compacting
    it; the eviction window the one whose free plus inactive bytes cover the total at the
    lowest summed c_j. For each right end the shortest feasible window is the cheapest,
    since costs are non-negative. Compacting a window moves a subset of what compacting the whole
    segment would: a tensor moves only if free space precedes it inside the window.
    """
    a, b, tensors, direct = sub
    if direct is not None:
        placements.update(direct)
        return 0
    need = sum(t.size for t in tensors)
    lo, hi = _move_window(snap, a, b, need)
    if costs is not None:
        bytes_evicted = _evict_instead(
            snap, sub, need, compaction_bytes(snap, lo, hi), costs, placements, evicted
        )
        if bytes_evicted is not None:
            return bytes_evicted
    compact_range(snap, lo, hi, tensors, placements, moves)
    return 0


def _move_window(snap: Snapshot, a: int, b: int, need: int) -> tuple[int, int]:
    """The window of gaps ``i..j`` inside ``a..b`` with >= ``need`` free bytes whose
    compaction moves the fewest bytes (the tensors ``i..j-1`` between them).

    For each right end ``j`` the shortest feasible window is the cheapest: its left end is
    the last ``i`` whose gaps ``i..j`` still hold ``need`` bytes, found for every ``j`` at
    once by a binary search over the running free bytes. Ties go to the lowest ``j``.
    """
    prefix = snap.np_gap_prefix[a : b + 2]  # prefix[k]: free bytes of gaps a..a+k-1 (+ const)
    ends = prefix[1:]  # free bytes up to and including gap j
    feasible = ends - prefix[0] >= need
    left = np.searchsorted(prefix, ends - need, side="right") - 1  # relative to a
    # size_prefix[k]: bytes of tensors a..a+k-1; the window's tensors are left..j-1.
    size_prefix = np.concatenate(([0], np.cumsum(snap.np_sizes[a:b])))
    cost = size_prefix[np.arange(b - a + 1)] - size_prefix[np.maximum(left, 0)]
    cost[~feasible] = np.iinfo(np.int64).max
    j = int(np.argmin(cost))
    assert feasible[j], "the subspace's free bytes cover its tensors"
    return a + int(left[j]), a + j


def _evict_instead(
    snap: Snapshot,
    sub: Subspace,
    need: int,
    move_bytes: int,
    costs: MergeCosts,
    placements: dict[str, int],
    evicted: list[str],
) -> int | None:
    """Eq. 1's evict-or-merge choice: if evicting the cheapest window of the subspace costs
    less than moving ``move_bytes``, evict it, place the tensors there and return the bytes
    evicted; else None."""
    a, b, tensors, _ = sub
    # The subspace as a region list: gap a, tensor a, gap a+1, ..., tensor b-1, gap b.
    offs: list[int] = []
    lens: list[int] = []
    keys: list[str | None] = []
    for i in range(a, b + 1):
        if snap.gap_len[i]:
            offs.append(snap.gap_start[i])
            lens.append(snap.gap_len[i])
            keys.append(None)
        if i < b:
            offs.append(snap.offsets[i])
            lens.append(snap.sizes[i])
            keys.append(snap.keys[i])
    price = costs.eviction.get
    window = _cheapest_window(lens, [0.0 if k is None else price(k, 0.0) for k in keys], need)
    if window is None:
        return None
    ea, eb = window
    evict_seconds = sum(price(k, 0.0) for k in keys[ea:eb] if k is not None)
    if not evict_seconds < move_bytes * costs.move_seconds_per_byte:
        return None
    bytes_evicted = 0
    for k, size in zip(keys[ea:eb], lens[ea:eb], strict=True):
        if k is not None:
            evicted.append(k)
            bytes_evicted += size
    cursor = offs[ea]
    for t in tensors:
        placements[t.key] = cursor
        cursor += t.size
    assert cursor <= offs[eb - 1] + lens[eb - 1]
    return bytes_evicted


def _cheapest_window(lens: list[int], prices: list[float], need: int) -> tuple[int, int] | None:
    """The window ``[lo, hi)`` of regions with >= ``need`` bytes (free plus evicted) at the
    lowest summed price (two pointers, as in :func:`_move_window`)."""
    best: tuple[int, int] | None = None
    best_cost = 0.0
    left, space, cost = 0, 0, 0.0
    for right in range(len(lens)):
        space += lens[right]
        cost += prices[right]
        while left < right and space - lens[left] >= need:
            space -= lens[left]
            cost -= prices[left]
            left += 1
        if space >= need and (best is None or cost < best_cost):
            best, best_cost = (left, right + 1), cost
    return best


def _slide(snap: Snapshot, a: int, b: int) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.int64], int]:
    """Compacting gaps ``a..b``: the tensors that move (indices from ``a``), every tensor's new
    offset, and where the free tail starts. New offsets are the running sum of the sizes from
    the range's start; a tensor moves iff free space precedes it. Vectorised: a segment can
    hold hundreds of tensors."""
    start = snap.gap_start[a]
    if b == a:
        return np.zeros(0, np.intp), np.zeros(0, np.int64), start
    sizes = snap.np_sizes[a:b]
    ends = np.cumsum(sizes) + start
    new_offsets = ends - sizes
    return np.flatnonzero(snap.np_offsets[a:b] != new_offsets), new_offsets, int(ends[-1])


def compact_range(
    snap: Snapshot,
    a: int,
    b: int,
    tensors: Sequence[TensorRequest],
    placements: dict[str, int],
    moves: list[Move],
) -> None:
    """Slide the movable tensors ``a..b-1`` to the low end of gaps ``a..b``, fill the free tail.

    Moves are emitted in address order and each goes to a lower address, so executing them
    in order never overwrites bytes that are still to be moved (only a tensor's own old
    bytes, which an overlap-safe move handles).
    """
    moved, new_offsets, cursor = _slide(snap, a, b)
    if len(moved):
        keys = snap.keys[a:b]
        moves.extend(map(
            _new_tuple, repeat(Move),
            zip(
                [keys[i] for i in moved.tolist()], snap.np_offsets[a:b][moved].tolist(),
                new_offsets[moved].tolist(), snap.np_sizes[a:b][moved].tolist(), strict=True,
            ),
        ))  # fmt: skip
    for t in tensors:
        placements[t.key] = cursor
        cursor += t.size
    assert cursor <= snap.gap_start[b] + snap.gap_len[b], "the free bytes cover the tensors"


def compaction_bytes(snap: Snapshot, a: int, b: int) -> int:
    """Bytes that :func:`compact_range` of gaps ``a..b`` would move."""
    moved, _, _ = _slide(snap, a, b)
    return int(snap.np_sizes[a:b][moved].sum())
