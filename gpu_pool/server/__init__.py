"""The pool daemon: one per device, serving the pool protocol (started by :mod:`gpu_pool.cli`).

:mod:`~gpu_pool.server.daemon` runs the sessions on the socket; :mod:`~gpu_pool.server.reuse_store`
is the Reuse Store (what is resident in the arena and who pins it; it asks the planner and
applies plans to the arena); :mod:`~gpu_pool.server.access` decides who may do what (admin
sessions, tickets, KV quotas); :mod:`~gpu_pool.server.manifest_cache` keeps parsed manifests for
the acquire fast path; :mod:`~gpu_pool.server.prefix_kv` indexes published prefix KV, which
:mod:`~gpu_pool.server.kv_copy` copies in and out of sessions' KV memory;
:mod:`~gpu_pool.server.hardening` makes the process undumpable. Nothing
outside ``gpu_pool`` imports this package: run it through :mod:`gpu_pool.cli` or
:mod:`gpu_pool.spawn`.
"""
