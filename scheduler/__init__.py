"""Placement and scaling decisions over cluster state kept in Redis.

:mod:`scheduler.spec` validates function specs; :mod:`scheduler.names` makes a function's
qualified id (``namespace/name``) that keys it in the state; :mod:`scheduler.policies` (pure Python)
holds Tangram's affinity placement (Alg. 2, Eq. 3), scale-by-concurrency and early reject;
:mod:`scheduler.state` keeps functions, instances and device reports in Redis with atomic
Lua transitions; :mod:`scheduler.redis_server` runs embedded mode's own ``redis-server``.
:mod:`scheduler.router` routes requests and reconciles (keep-alive, health, minScale), starting
instances through :mod:`scheduler.cold_start`; :mod:`scheduler.leases` keeps finished
requests' slots for the next one.
"""
