"""The gateway's HTTP routes, one module per concern; :func:`gateway.app.create_app` composes them.

- :mod:`gateway.routes.functions`: deploy, list, describe, delete, logs, ``/v1/models``.
- :mod:`gateway.routes.cluster`: ``/healthz``, ``/readyz``, ``/v1/cluster``, evict, ``/metrics``.
- :mod:`gateway.routes.invoke`: the one invocation implementation (invoke and OpenAI routes).
- :mod:`gateway.tenants`: tenant keys (``/v1/tenants``).
"""
