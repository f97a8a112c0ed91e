"""The planner's default engine: the whole decision in C (:mod:`gpu_pool._planner`).

:func:`gpu_pool.planner.allocator.plan` with ``PlannerEngine.PYTHON`` is the readable reference:
direct placement and Stage 1 in :mod:`gpu_pool.planner.allocator`, Stage 2 in
:mod:`gpu_pool.planner.packing`. ``gpu_pool/planner/csrc/`` makes the same decisions in the same order
on the region list's columns, because a decision over ~1,500 regions visits dozens of
subspaces and hundreds of partition points: about 1 ms of Python work, tens of
microseconds in C. Property tests check that both engines return identical plans. The
extension is built by ``scripts/setup`` (``pip install -e .``).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import cast

import numpy as np

from gpu_pool.planner.layout import RegionColumns
from gpu_pool.planner.plan_types import MergeCosts, Move, PackingPolicy, Plan, TensorRequest, out_of_memory

_IMPORT_ERROR: ImportError | None = None
try:
    from gpu_pool import _planner
except ImportError as exc:  # reported when a native plan is asked for, with the fix
    _planner = None  # type: ignore[assignment]  # the module or None, checked before use
    _IMPORT_ERROR = exc


class NativeCoreMissing(ImportError):
    """The C planner was not built (a checkout used without ``scripts/setup``)."""


def core() -> ModuleType:
    """The C planner module; :class:`NativeCoreMissing` (with the fix) when it is not built."""
    if _planner is None:
        raise NativeCoreMissing(
            f"the planner's C core gpu_pool._planner is not built ({_IMPORT_ERROR}); "
            "run scripts/setup (pip install -e .) to build it"
        )
    return _planner


def plan_native(
    columns: RegionColumns,
    requests: Sequence[TensorRequest],
    eviction_order: Sequence[str],
    packing: PackingPolicy,
    costs: MergeCosts | None,
    max_split_tries: int,
) -> Plan:
    """:func:`gpu_pool.planner.allocator.plan` in C, on the region list's columns."""
    native = core()
    prices = None
    if costs is not None and packing is PackingPolicy.PGP:
        price = costs.eviction.get
        prices = np.array([price(k, 0.0) if k is not None else 0.0 for k in columns.keys], np.float64)
    offsets, evicted, moves, bytes_evicted, free = native.plan(
        columns.offsets, columns.sizes, columns.movable, columns.keys, columns.base, columns.end,
        [r.size for r in requests],
        eviction_order if isinstance(eviction_order, (list, tuple)) else list(eviction_order),
        prices, Move, packing is PackingPolicy.GLOBAL_MERGE,
        0.0 if costs is None else costs.move_seconds_per_byte, max_split_tries,
    )  # fmt: skip
    if offsets is None:
        raise out_of_memory(requests, free)
    placements = dict(zip([r.key for r in requests], offsets, strict=True))
    return Plan(placements, tuple(evicted), tuple(cast(list[Move], moves)), bytes_evicted)
