"""The front door: the ``ember`` command line today; the HTTP gateway (function CRUD, invoke,
OpenAI-compatible API, SSE, auth and tenants (:mod:`gateway.tenants`: keys scoped to a
namespace), metrics) joins it in the serving work. It starts local
daemons and workers but holds no model state of its own; placement lives in ``scheduler``,
tensors in ``gpu_pool``. ``/healthz`` is liveness, ``/readyz`` readiness
(:mod:`gateway.health`).
"""
