"""The region list: the arena as a sequence of contiguous byte ranges in address order.

Pure Python (no torch, no CuPy). Every region is free, a tensor, or a KV block; tensors
are *movable* when no session pins them. The Reuse Store keeps the allocated extents and
derives the list on demand, so the list always tiles the arena exactly.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

DEFAULT_ALIGNMENT = 256  # bytes; CUDA's allocation granularity for coalesced access and any dtype view


class RegionKind(enum.Enum):
    FREE = "free"
    TENSOR = "tensor"
    KV = "kv"


@dataclass(frozen=True, slots=True)
class Region:
    """A contiguous byte range of the arena.

    ``key`` is the tensor fingerprint or the KV block id (as a string); ``movable`` is true
    only for tensors no session has pinned (inactive but resident): those may be evicted or
    moved by a plan. Pinned tensors and KV blocks are fixed.
    """

    offset: int
    size: int
    kind: RegionKind
    key: str | None = None
    movable: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.size

    @property
    def is_free(self) -> bool:
        return self.kind is RegionKind.FREE


def align_up(nbytes: int, alignment: int = DEFAULT_ALIGNMENT) -> int:
    """Bytes a tensor of ``nbytes`` occupies in the arena (at least one alignment unit)."""
    return max(alignment, -(-nbytes // alignment) * alignment)


def build_region_list(capacity: int, allocated: Iterable[Region]) -> list[Region]:
    """The full region list: allocated regions in address order with free gaps between them.

    Raises ``ValueError`` when allocated regions overlap or fall outside the arena: that is
    a corrupted store, never a user error.
    """
    regions: list[Region] = []
    cursor = 0
    for r in sorted(allocated, key=lambda r: r.offset):
        if r.kind is RegionKind.FREE:
            continue
        if r.offset < cursor or r.size <= 0 or r.end > capacity:
            raise ValueError(f"region {r} overlaps its predecessor or leaves the arena of {capacity} bytes")
        if r.offset > cursor:
            regions.append(Region(cursor, r.offset - cursor, RegionKind.FREE))
        regions.append(r)
        cursor = r.end
    if cursor < capacity:
        regions.append(Region(cursor, capacity - cursor, RegionKind.FREE))
    return regions


def free_bytes(regions: Iterable[Region]) -> int:
    """Total bytes of the free regions."""
    return sum(r.size for r in regions if r.is_free)
