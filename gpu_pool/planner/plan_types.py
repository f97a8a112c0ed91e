"""What the planner takes and returns: tensor requests, moves, plans and Eq. 1's prices.

Kept apart from :mod:`gpu_pool.planner.allocator` (Stage 1) and :mod:`gpu_pool.planner.packing` (Stage 2)
so both can use them; :mod:`gpu_pool.planner.allocator` re-exports them as the planner's API.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from gpu_pool.errors import OutOfMemory


class PackingPolicy(enum.Enum):
    PGP = "pgp"
    GLOBAL_MERGE = "global_merge"


class PlannerEngine(enum.Enum):
    """Who runs Stage 2 under PGP: the C core (default) or its Python reference.

    Both make the same decisions (property-tested); the reference is the readable spec and
    the benchmark's baseline.
    """

    NATIVE = "native"
    PYTHON = "python"


@dataclass(frozen=True, slots=True)
class TensorRequest:
    """A tensor to place: its key (fingerprint) and its aligned size in bytes."""

    key: str
    size: int

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError(f"tensor {self.key}: size must be > 0")


class Move(NamedTuple):
    """Slide an inactive tensor inside the arena (``dst`` may overlap ``src``).

    A NamedTuple rather than a dataclass: a plan can hold ~1,000 moves, and building them
    is on the decision's critical path (a tuple is about half the cost to create).
    """

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


@dataclass(frozen=True, slots=True)
class KVPlan:
    """Offsets of new KV blocks (highest addresses first) and the tensors evicted for them."""

    offsets: tuple[int, ...]
    evictions: tuple[str, ...] = ()
    bytes_evicted: int = 0


def out_of_memory(requests: Sequence[TensorRequest], free: int) -> OutOfMemory:
    """The error for ``requests`` that do not fit the ``free`` bytes left after every eviction."""
    need = sum(r.size for r in requests)
    what = f"placing {len(requests)} tensors"
    if free >= need:
        what += " (free space is cut into pieces by pinned tensors and KV blocks, which never move)"
    return OutOfMemory(what, need, free)
