"""Readiness (``/readyz``): whether this gateway can serve invocations now.

``/healthz`` is liveness: 200 while the process serves HTTP. ``/readyz`` is 200 only when
Redis answers PING, every pool daemon of this node is alive and at least one pre-warmed
worker is ready (or none are configured); otherwise 503 with ``Retry-After`` and a body that
names the components that are not ready. It needs no API key (load balancers probe it), so
the body says ready / not ready per component and nothing else: no addresses, errors or counts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from starlette.responses import JSONResponse


def _always() -> bool:
    return True


@dataclass(frozen=True, slots=True)
class Readiness:
    """The checks behind ``/readyz``. ``redis_ping`` blocks (it runs in a thread) and raises
    when Redis does not answer; the others are cheap and run on the event loop."""

    redis_ping: Callable[[], object]
    pools_alive: Callable[[], bool] = _always
    warm_ready: Callable[[], bool] = _always
    timeout_s: float = 2.0  # a Redis that does not answer PING within this is not ready

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")

    async def check(self) -> dict[str, bool]:
        """Each component's readiness: ``redis``, ``pools``, ``warm_worker``."""
        try:
            await asyncio.wait_for(asyncio.to_thread(self.redis_ping), self.timeout_s)
            redis_ok = True
        except Exception:  # any failure to answer is "not ready"; the reason stays private
            redis_ok = False
        return {"redis": redis_ok, "pools": self.pools_alive(), "warm_worker": self.warm_ready()}


async def readyz(readiness: Readiness, retry_after_s: int = 1) -> JSONResponse:
    """The ``/readyz`` response for ``readiness``."""
    components = await readiness.check()
    body: dict[str, object] = {
        "status": "ready" if all(components.values()) else "not_ready",
        "components": {k: "ready" if ok else "not_ready" for k, ok in components.items()},
    }
    if all(components.values()):
        return JSONResponse(body)
    missing = ", ".join(k for k, ok in components.items() if not ok)
    body["error"] = {"type": "not_ready", "message": f"not ready: {missing}"}
    return JSONResponse(body, status_code=503, headers={"retry-after": str(retry_after_s)})
