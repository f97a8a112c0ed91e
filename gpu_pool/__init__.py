"""Per-device memory pool: the component that makes Ember's cold starts cheap.

A pool daemon (``ember pool``) owns one contiguous arena on one device (a sealed memfd on
CPU that workers map read-only, a CuPy allocation shared over CUDA IPC on a GPU) and the
Reuse Store that maps tensor fingerprints to regions of it. Workers attach with
:class:`gpu_pool.client.PoolClient`, ``acquire`` a model manifest and get tensor views into
the arena: resident tensors cost nothing, missing ones are placed by the Tangram planner
(Minimal-Cost Eviction + Partitioned-Gain Packing, :mod:`gpu_pool.planner`, whose decision
runs in a small C extension) and copied in from the model store.
Tensors stay resident after the worker releases them, so the next instance reuses them.
KV-cache blocks are regions of the same arena, allocated on demand (on CPU their pages live
in a memory file private to the session, :mod:`gpu_pool.arena.kv_memory`). Admin sessions,
tickets and KV quotas: :mod:`gpu_pool.server.access`.

Layout: :mod:`gpu_pool.planner` (the algorithms, no torch or CuPy), :mod:`gpu_pool.arena`
(device memory and its mappings), :mod:`gpu_pool.store` (the model store and trust),
:mod:`gpu_pool.wire` (the socket protocol) and :mod:`gpu_pool.server` (the daemon).

Public surface: the modules in ``__all__`` are all that ``runtime/``, ``gateway/`` and
``bench/``'s end-to-end benchmarks may import (tests may import anything; the planner and
Reuse Store micro-benchmarks in ``bench/`` measure internals by design):

* :mod:`gpu_pool.client`: ``PoolClient``, ``RemotePoolError``, ``premap``, ``MappedArena``,
  ``KVBlocks``, ``AcquireReport``;
* :mod:`gpu_pool.readiness`: ``Readiness`` (which tensors of a progressive acquire have their
  bytes in, TIDAL §5.2), ``MAX_READY_GROUPS``;
* :mod:`gpu_pool.acquire_report`: ``AcquireReport`` (what an acquire cost, from the Reuse Store
  to the node agent) with its versioned wire encoding;
* :mod:`gpu_pool.store`: ``write``, ``read``, ``verify`` of model store entries;
* :mod:`gpu_pool.manifest`: ``Manifest``, ``TensorEntry``;
* :mod:`gpu_pool.errors`: the typed errors, each with its wire ``code``;
* :mod:`gpu_pool.spawn`: ``PoolProcess``, ``running_pool`` (a daemon as a child process);
* :mod:`gpu_pool.cli`: ``add_arguments``, ``config_from_args``, ``run`` (``ember pool``);
* :mod:`gpu_pool.config`: ``PoolConfig``, ``parse_size``;
* :mod:`gpu_pool.cuda_backend`: ``require_cupy``, ``require_device``.

``tests/test_import_contract.py`` enforces this and the rest of DESIGN.md's dependency
direction. This package imports nothing else of Ember's.
"""

__all__ = [
    "acquire_report",
    "cli",
    "client",
    "config",
    "cuda_backend",
    "errors",
    "manifest",
    "readiness",
    "spawn",
    "store",
]
