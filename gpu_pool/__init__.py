"""Per-device memory pool: the component that makes Ember's cold starts cheap.

A pool daemon (``ember pool``) owns one contiguous arena on one device (a sealed memfd on
CPU that workers map read-only, a CuPy allocation shared over CUDA IPC on a GPU) and the
Reuse Store that maps tensor fingerprints to regions of it. Workers attach with
:class:`gpu_pool.client.PoolClient`, ``acquire`` a model manifest and get tensor views into
the arena: resident tensors cost nothing, missing ones are placed by the Tangram planner
(Minimal-Cost Eviction + Partitioned-Gain Packing, :mod:`gpu_pool.allocator`, whose decision
runs in a small C extension) and copied in from the model store.
Tensors stay resident after the worker releases them, so the next instance reuses them.
KV-cache blocks are regions of the same arena, allocated on demand (on CPU their pages live
in a memory file private to the session, :mod:`gpu_pool.kv_memory`). Admin sessions, tickets
and KV quotas: :mod:`gpu_pool.access`. This package imports nothing else of Ember's; the
planner, region and eviction modules import no torch or CuPy.
"""
