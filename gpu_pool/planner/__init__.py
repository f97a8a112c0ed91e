"""The Tangram planner: where missing tensors and KV blocks go, what is evicted, what moves.

Pure algorithms, no torch, no CuPy and no I/O: :mod:`~gpu_pool.planner.regions` (the arena as
a region list), :mod:`~gpu_pool.planner.layout` (the planner's working copy of it),
:mod:`~gpu_pool.planner.eviction` (Stage 1: MCE, LRU, random), :mod:`~gpu_pool.planner.packing`
(Stage 2: Partitioned-Gain Packing, Global-Merge), :mod:`~gpu_pool.planner.plan_types` (requests,
moves, plans) and :mod:`~gpu_pool.planner.allocator` (:func:`~gpu_pool.planner.allocator.plan`,
the entry point). Its default engine, :mod:`~gpu_pool.planner.native_planner`, runs the same
decision in C (``csrc/``, built as the extension ``gpu_pool._planner``); the Python modules are
the readable reference, property-tested to give identical plans.
"""
