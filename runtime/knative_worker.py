"""``ember worker --function ID``: one function instance as a Knative container.

What Knative's runtime contract (``../shared/knative/runtime-contract.md``) asks, and how:

* it listens on every interface, on ``$PORT`` (default 8080);
* ``/healthz`` is liveness; ``/readyz`` (the revision's readiness probe, open like
  ``/healthz``) answers 503 until the worker has attached to its node's pool and built its
  engine, 200 while it serves, and 503 again once SIGTERM arrived;
* SIGTERM drains (:mod:`runtime.drain`): no new connections, in-flight requests (streams
  included) finish within ``EMBER_GRACE_SECONDS``, then the pool session closes (the weights
  stay resident) and the process exits 0;
* ``K_SERVICE``, ``K_REVISION`` and ``K_CONFIGURATION`` go into the instance's record.

The instance's record expires ``RECORD_TTL_BEATS`` heartbeats after its last renewal
(:mod:`runtime.heartbeat`, every ``EMBER_RECORD_REFRESH_SECONDS``): a SIGKILLed pod, which
cannot remove it, leaves no record behind for long.

Its pool is the node's CPU pool daemon (a DaemonSet) on the socket the composition root
found under ``EMBER_POOL_DIR``; a pod that starts before its node's pool keeps trying for
``EMBER_POOL_WAIT_SECONDS``. Every route but the two probes needs the worker's credential
(:mod:`runtime.worker_guard`). The composition root (:func:`gateway.compose.build_knative_worker`)
reads the function's record from Redis, makes the :class:`~runtime.messages.AssignMessage` and
the :class:`InstanceReporter` that writes the instance's record: runtime imports no scheduler.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import math
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from runtime.assignment import assign
from runtime.drain import Lifecycle, listen, serve_draining
from runtime.heartbeat import Heartbeat
from runtime.intra_op import claim_engine_thread
from runtime.messages import AssignMessage
from runtime.worker import build_app
from runtime.worker_guard import GuardConfig, WorkerGuard
from runtime.worker_state import WorkerState

PORT_ENV = "PORT"
DEFAULT_PORT = 8080
GRACE_ENV = "EMBER_GRACE_SECONDS"
# Below the 30 s Kubernetes gives a pod by default and below Knative's termination grace (the
# revision's timeoutSeconds, 300 s by default): the worker is done before SIGKILL could come.
# Knative's queue-proxy has drained the pod's requests before the container gets SIGTERM, so
# this bounds stragglers only.
DEFAULT_GRACE_S = 25.0
POOL_WAIT_ENV = "EMBER_POOL_WAIT_SECONDS"
DEFAULT_POOL_WAIT_S = 120.0  # a node's pool DaemonSet may start after the node's first function pod
REFRESH_ENV = "EMBER_RECORD_REFRESH_SECONDS"
DEFAULT_REFRESH_S = 10.0
MIN_REFRESH_S = 0.1  # each beat is one Redis round trip per pod
MAX_REFRESH_S = 600.0
RECORD_TTL_BEATS = 3  # a record outlives two missed beats (a Redis failover), not a dead pod
MAX_SECONDS = 3600.0
MAX_NAME = 253  # characters of a Kubernetes object name (K_SERVICE, K_REVISION, K_CONFIGURATION)
_POOL_RETRY_S = 0.5

log = logging.getLogger("ember.worker")


@dataclass(frozen=True, slots=True)
class Revision:
    """The Knative Service, Revision and Configuration this pod serves (empty when unset)."""

    service: str = ""
    revision: str = ""
    configuration: str = ""

    def __post_init__(self) -> None:
        for what, value in (("K_SERVICE", self.service), ("K_REVISION", self.revision),
                            ("K_CONFIGURATION", self.configuration)):  # fmt: skip
            if len(value) > MAX_NAME or not value.isprintable():
                raise ValueError(f"{what} must be a printable name of at most {MAX_NAME} characters")

    def fields(self) -> dict[str, str]:
        """The non-empty names as instance record fields (``k_service``, ...)."""
        named = {"k_service": self.service, "k_revision": self.revision}
        named["k_configuration"] = self.configuration
        return {k: v for k, v in named.items() if v}


@dataclass(frozen=True, slots=True)
class KnativeConfig:
    """Where and how long the worker serves: from the pod's environment (:meth:`from_env`)."""

    port: int = DEFAULT_PORT
    grace_s: float = DEFAULT_GRACE_S
    pool_wait_s: float = DEFAULT_POOL_WAIT_S
    refresh_s: float = DEFAULT_REFRESH_S  # the heartbeat's period; the record's TTL is a multiple
    pod_ip: str | None = None  # POD_IP (downward API): the instance record's URL
    revision: Revision = field(default_factory=Revision)
    host: str = "0.0.0.0"  # every interface: queue-proxy reaches the container on the pod's IP

    def __post_init__(self) -> None:
        if isinstance(self.port, bool) or not 1 <= self.port <= 65535:
            raise ValueError(f"{PORT_ENV} must be a port number (1-65535), got {self.port}")
        if not math.isfinite(self.grace_s) or not 0 < self.grace_s <= MAX_SECONDS:
            raise ValueError(f"{GRACE_ENV} must be more than 0 and at most {MAX_SECONDS:g} seconds")
        if not math.isfinite(self.pool_wait_s) or not 0 <= self.pool_wait_s <= MAX_SECONDS:
            raise ValueError(f"{POOL_WAIT_ENV} must be 0 to {MAX_SECONDS:g} seconds")
        if not math.isfinite(self.refresh_s) or not MIN_REFRESH_S <= self.refresh_s <= MAX_REFRESH_S:
            raise ValueError(f"{REFRESH_ENV} must be {MIN_REFRESH_S:g} to {MAX_REFRESH_S:g} seconds")
        if self.pod_ip is not None:
            ipaddress.ip_address(self.pod_ip)  # ValueError names the bad address

    @property
    def record_ttl_s(self) -> float:
        """How long the instance's record outlives its last heartbeat."""
        return RECORD_TTL_BEATS * self.refresh_s

    @property
    def url(self) -> str:
        """``http://POD_IP:PORT`` (brackets for IPv6), or "" without ``POD_IP``."""
        if self.pod_ip is None:
            return ""
        host = f"[{self.pod_ip}]" if ":" in self.pod_ip else self.pod_ip
        return f"http://{host}:{self.port}"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> KnativeConfig:
        """``PORT``, ``EMBER_GRACE_SECONDS``, ``EMBER_POOL_WAIT_SECONDS``,
        ``EMBER_RECORD_REFRESH_SECONDS``, ``POD_IP``, ``K_*``; ValueError naming the variable
        for a bad value."""

        def number(name: str, default: float) -> float:
            text = env.get(name, "").strip()
            try:
                return float(text) if text else default
            except ValueError:
                raise ValueError(f"{name} must be a number of seconds, got {text!r}") from None

        port_text = env.get(PORT_ENV, "").strip()
        # ASCII digits only: str.isdigit() also takes "²" (int() refuses it) and "٣" (port 3).
        if port_text and not (port_text.isascii() and port_text.isdigit()):
            raise ValueError(f"{PORT_ENV} must be a port number, got {port_text!r}")
        names = (env.get(name, "") for name in ("K_SERVICE", "K_REVISION", "K_CONFIGURATION"))
        revision = Revision(*names)
        return cls(
            port=int(port_text) if port_text else DEFAULT_PORT,
            grace_s=number(GRACE_ENV, DEFAULT_GRACE_S),
            pool_wait_s=number(POOL_WAIT_ENV, DEFAULT_POOL_WAIT_S),
            refresh_s=number(REFRESH_ENV, DEFAULT_REFRESH_S),
            pod_ip=env.get("POD_IP", "").strip() or None,
            revision=revision,
        )


class InstanceReporter(Protocol):
    """The instance's record in the cluster state (written by the composition root's adapter).

    Created ``starting`` before the worker runs, expiring unless refreshed (:meth:`refresh`); calls
    block (the worker makes them in threads) and may come from two threads at once."""

    def ready(self, url: str, revision: Revision) -> None:
        """The instance serves at ``url``."""

    def draining(self) -> None:
        """SIGTERM arrived: the instance finishes what it has and takes nothing new."""

    def refresh(self) -> bool:
        """The heartbeat: renew the record's TTL; False when it had expired and was written again."""

    def gone(self) -> None:
        """The worker exits: remove the record."""


def build_knative_app(state: WorkerState, lifecycle: Lifecycle) -> FastAPI:
    """The worker's app (:func:`runtime.worker.build_app`) with ``/readyz`` from ``lifecycle``."""
    app = build_app(state)

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        status, body = lifecycle.readiness()
        return JSONResponse(body, status_code=status)

    return app


async def _attach(state: WorkerState, message: AssignMessage, wait_s: float) -> None:
    """:func:`runtime.assignment.assign`, retried while the node's pool is not reachable yet."""
    deadline = time.monotonic() + wait_s
    state.assigning = True  # no /_ember/assign meanwhile
    waiting = False
    try:
        while True:
            try:
                state.assignment, report = await assign(state, message)
                break
            except ConnectionError as exc:
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"{exc} (waited {wait_s:g} s for it)") from None
                if not waiting:
                    log.info("waiting for the node's pool (at most %g s): %s", wait_s, exc)
                    waiting = True
                await asyncio.sleep(_POOL_RETRY_S)
    finally:
        state.assigning = False
    log.info("instance %s serves: %s", message.instance_id, report)


def serve(
    config: KnativeConfig, assignment: AssignMessage, guard: GuardConfig, reporter: InstanceReporter
) -> int:
    """Run the instance until SIGTERM (see the module docstring); the process's exit code.
    ``reporter``'s record is removed when this returns, whatever happened."""
    import uvloop

    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    claim_engine_thread()  # before any pool thread starts (runtime.intra_op)
    state = WorkerState()
    lifecycle = Lifecycle()
    heartbeat = Heartbeat(reporter.refresh, config.refresh_s)

    async def start() -> None:
        await _attach(state, assignment, config.pool_wait_s)
        await asyncio.to_thread(reporter.ready, config.url, config.revision)

    async def drain() -> None:
        await asyncio.to_thread(reporter.draining)

    try:
        heartbeat.start()
        app = WorkerGuard(build_knative_app(state, lifecycle), guard)
        sock = listen(config.host, config.port)
        log.info(
            "worker for %s (instance %s, %s) on port %d",
            assignment.spec["metadata"]["name"], assignment.instance_id, config.revision, config.port,
        )  # fmt: skip
        return uvloop.run(serve_draining(app, sock, config.grace_s, lifecycle, start, drain))
    finally:
        state.close()  # the app's shutdown did, unless it never started
        heartbeat.stop(timeout_s=config.refresh_s)  # gone() waits for a beat in progress anyway
        try:
            reporter.gone()
        except Exception:  # Redis away: the record stays behind, the worker still exits
            log.exception("could not remove the instance's record")
