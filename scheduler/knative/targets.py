"""Where a cluster-mode gateway sends a function's invocations: its Knative Service's URL.

In embedded mode the scheduler's :class:`scheduler.router.Router` picks an instance, scales
up, leases slots and forgets dead instances. In cluster mode Knative does all of that (the
activator buffers requests while a Service scales from zero, queue-proxy enforces
``containerConcurrency``), so the route of every request of a function is the same: its
Service's cluster-local URL (``EMBER_KNATIVE_URL``) and the function's worker token. This
class has the router's routing methods (what :class:`gateway.proxy.Invoker` calls), and the
rest are no-ops: there are no slots to release, no instances to forget or retire (a redeploy
makes Knative roll out a new revision).
"""

from __future__ import annotations

from scheduler.knative.config import KnativeConfig
from scheduler.knative.naming import service_name
from scheduler.knative.tokens import WorkerTokens
from scheduler.records import FunctionRecord
from scheduler.router import Route

MAX_CACHED = 4096  # routes kept (one per function)


class ServiceTargets:
    """See the module docstring."""

    def __init__(self, config: KnativeConfig, tokens: WorkerTokens) -> None:
        self.config = config
        self.tokens = tokens
        self._routes: dict[str, Route] = {}

    async def route(
        self, name: str, record: FunctionRecord, deadline: float, since: float | None = None
    ) -> Route:
        """The Service of function ``name`` (a qualified id); never waits: Knative's activator
        holds the request while the Service scales from zero."""
        route = self._routes.get(name)
        if route is None:
            service = service_name(name)  # SpecError for a function that has no Service
            if len(self._routes) >= MAX_CACHED:
                self._routes.clear()
            route = self._routes[name] = Route(
                service, self.config.url(service), False, 0.0, self.tokens.token(name)
            )
        return route

    async def done(
        self, name: str, route: Route, keep_alive_s: float, service_s: float, reusable: bool = True
    ) -> None:
        """Nothing to release: queue-proxy counts requests in flight."""

    async def instance_lost(self, name: str, lost: Route, keep_alive_s: float | None = None) -> bool:
        """Nothing to forget: Knative replaces pods that fail their probes."""
        return False

    async def retire(self, name: str) -> None:
        """Nothing to stop: a redeploy rolls out a new revision, a delete removes the Service."""

    async def close(self) -> None:
        """Nothing runs in the background."""
