"""``ember node``: a cluster node's pool daemons and their residency reports (the pool DaemonSet).

In cluster mode Kubernetes and Knative start function pods; what stays on the node is the
memory pool. This process runs the node's CPU pool daemon on ``$EMBER_POOL_DIR/cpu.sock``
(supervised: restarted with backoff on the same socket when it dies, :mod:`runtime.device_pools`)
and publishes its stats every ``report_interval_s`` as the device record ``<node>/cpu`` through
``report`` (the composition root wires the cluster state's ``report_device``). The scheduler
extender filters a node whose record is missing or stale, so a dead pool stops attracting pods
by itself. Function pods attach without a ticket: each such session may hold
``session_kv_quota`` bytes of KV.

Each node keeps its own model store (``EMBER_HOME/models``, a hostPath that function pods mount
read-only at the same path): the pool trusts only it. ``ember node`` registers there the
models of every deployed function (``wanted``, read from the cluster state by the composition
root) in the background, so a function pod finds its model's directory and the pool its store
entry. Registration is deterministic (the model id is the source's content hash and dtype),
so a node's id equals the one the gateway recorded at deploy; a mismatch is logged and the
model is not offered. A failing registration (a source this node cannot reach) is retried
with backoff and never stops the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from runtime.agent_config import AgentConfig
from runtime.device_pools import DevicePools, PoolLayout
from runtime.device_report import device_record, read_stats
from runtime.supervisor import RestartConfig

log = logging.getLogger(__name__)

Report = Callable[[str, dict[str, Any]], None]  # device id, record
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class WantedModel:
    """A model a deployed function runs: its source, dtype and the id the gateway recorded."""

    source: str
    dtype: str
    model_id: str


Wanted = Callable[[], list[WantedModel]]
RETRY_MAX_S = 300.0  # the longest wait before registering a failing source again


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """Settings of ``ember node`` (:meth:`from_env`)."""

    home: Path  # EMBER_HOME: the model store (models/) and the pool's log (logs/)
    pool_dir: Path  # EMBER_POOL_DIR: the sockets function pods connect to
    node: str  # EMBER_NODE_NAME: the Kubernetes node (downward API)
    arena_bytes: int = 2 << 30  # EMBER_POOL_ARENA
    session_kv_quota: int = 256 << 20  # EMBER_POOL_SESSION_KV_QUOTA: KV bytes per function pod
    report_interval_s: float = 2.0  # EMBER_REPORT_INTERVAL
    restart: RestartConfig = field(default_factory=RestartConfig)

    def __post_init__(self) -> None:
        if not self.node or "/" in self.node or len(self.node) > 253:
            raise ValueError(f"node name {self.node!r} must be a Kubernetes node name")
        if self.arena_bytes < 1 << 20:
            raise ValueError("EMBER_POOL_ARENA must be at least 1 MiB")
        if self.session_kv_quota < 0:
            raise ValueError("EMBER_POOL_SESSION_KV_QUOTA must be >= 0")
        if not 0.1 <= self.report_interval_s <= 60:
            raise ValueError("EMBER_REPORT_INTERVAL must be within 0.1..60 s")
        if len(str(self.pool_dir / "cpu.sock")) >= 108:
            raise ValueError(f"EMBER_POOL_DIR {self.pool_dir} is too long for a Unix socket path")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> NodeConfig:
        """From ``EMBER_*`` variables; ValueError naming the variable on a bad value."""
        from gpu_pool.config import parse_size

        env = os.environ if env is None else env
        home = Path(env.get("EMBER_HOME") or Path.home() / ".ember").expanduser()
        values: dict[str, Any] = {
            "home": home,
            "pool_dir": Path(env.get("EMBER_POOL_DIR") or "/var/run/ember"),
            "node": env.get("EMBER_NODE_NAME") or socket.gethostname(),
            "restart": RestartConfig.from_env(),
        }
        if env.get("EMBER_POOL_ARENA"):
            values["arena_bytes"] = parse_size(env["EMBER_POOL_ARENA"], "EMBER_POOL_ARENA")
        if env.get("EMBER_POOL_SESSION_KV_QUOTA"):
            values["session_kv_quota"] = parse_size(
                env["EMBER_POOL_SESSION_KV_QUOTA"], "EMBER_POOL_SESSION_KV_QUOTA"
            )
        if env.get("EMBER_REPORT_INTERVAL"):
            try:
                values["report_interval_s"] = float(env["EMBER_REPORT_INTERVAL"])
            except ValueError:
                raise ValueError(
                    f"EMBER_REPORT_INTERVAL={env['EMBER_REPORT_INTERVAL']!r} is not a number"
                ) from None
        return cls(**values)


class NodeDaemon:
    """The node's supervised pool daemons and the loop that reports them."""

    def __init__(self, config: NodeConfig, report: Report, wanted: Wanted | None = None) -> None:
        self.config = config
        self._report = report
        self._wanted = wanted
        self.registered: dict[str, str] = {}  # model id -> its directory on this node
        self._retry_at: dict[WantedModel, tuple[float, float]] = {}  # -> (monotonic due, delay)
        agent_config = AgentConfig(
            home=config.home, arena_bytes=config.arena_bytes, prewarm=0, node=config.node,
            restart=config.restart,
        )  # fmt: skip
        layout = PoolLayout(config.pool_dir, socket_prefix="", session_kv_quota=config.session_kv_quota)
        self.pools = DevicePools(agent_config, layout)

    def device_id(self, device: str) -> str:
        return f"{self.config.node}/{device}"

    async def start(self) -> None:
        """Start the CPU pool (returns once it serves) and supervise it."""
        from runtime.registry import models_dir

        self.config.pool_dir.mkdir(parents=True, exist_ok=True)
        models_dir(self.config.home).mkdir(parents=True, exist_ok=True)
        (self.config.home / "logs").mkdir(parents=True, exist_ok=True)
        self.pools.start("cpu")
        self.pools.supervise(self._on_death, lambda device: None)

    async def _on_death(self, device: str) -> None:
        log.warning("pool daemon for %s died; restarting it", device)

    async def report_once(self) -> dict[str, dict[str, Any]]:
        """Publish every live pool's record; the records published, by device id."""
        out: dict[str, dict[str, Any]] = {}
        for device, pool in list(self.pools.pools.items()):
            if not self.pools.alive(device):
                continue  # being restarted: its record goes stale and the extender filters it
            try:
                stats = await asyncio.to_thread(read_stats, pool.socket_path)
            except OSError as exc:  # died between the check and the read
                log.warning("pool %s stats: %s", device, exc)
                continue
            record = device_record(self.config.node, device, stats, {})
            await asyncio.to_thread(self._report, self.device_id(device), record)
            out[self.device_id(device)] = record
        return out

    async def sync_models(self) -> list[str]:
        """Register the wanted models this node lacks (one at a time, off the event loop);
        the ids registered by this call."""
        import time

        from runtime.registry import register

        if self._wanted is None:
            return []
        done: list[str] = []
        for model in await _detached(self._wanted):
            if model.model_id in self.registered:
                continue
            due, delay = self._retry_at.get(model, (0.0, 0.0))
            if time.monotonic() < due:
                continue
            try:
                local = await _detached(register, model.source, model.dtype, self.config.home)
            except Exception as exc:  # an unreachable or refused source: retry later
                delay = min(RETRY_MAX_S, max(1.0, delay * 2))
                self._retry_at[model] = (time.monotonic() + delay, delay)
                log.warning(
                    "registering %s on this node failed (retry in %.0f s): %s", model.source, delay, exc
                )
                continue
            if local.model_id != model.model_id:
                self._retry_at[model] = (time.monotonic() + RETRY_MAX_S, RETRY_MAX_S)
                log.error("%s registers here as %s, not %s: its content differs from the gateway's",
                          model.source, local.model_id, model.model_id)  # fmt: skip
                continue
            self._retry_at.pop(model, None)
            self.registered[model.model_id] = str(local.directory)
            done.append(model.model_id)
        return done

    async def run(self, stop: asyncio.Event) -> None:
        """Report every ``report_interval_s`` until ``stop`` is set. A failing report (Redis
        away) is logged and retried at the next tick: the pool keeps serving pods meanwhile.

        Model registration runs as its own task: converting a large model (or reading a slow
        source) takes minutes, and reports held back that long would outlive the extender's
        report TTL and filter this node out while its pool serves."""
        syncing = asyncio.create_task(self._sync_loop(stop), name="ember-node-sync-models")
        try:
            while not stop.is_set():
                try:
                    await self.report_once()
                except Exception as exc:  # Redis restarting, a malformed stats reply: keep serving
                    log.warning("residency report failed: %s", exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.config.report_interval_s)
        finally:
            syncing.cancel()  # a registration thread in flight finishes alone (temporaries are reaped)
            with contextlib.suppress(asyncio.CancelledError):
                await syncing

    async def _sync_loop(self, stop: asyncio.Event) -> None:
        """:meth:`sync_models` every ``report_interval_s`` (after the previous one finished)."""
        while not stop.is_set():
            try:
                await self.sync_models()
            except Exception as exc:  # Redis away: the next round tries again
                log.warning("reading the deployed functions failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.report_interval_s)

    async def close(self) -> None:
        await self.pools.close()


async def _detached(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` in a daemon thread of its own. Unlike ``asyncio.to_thread`` (the loop's
    executor, which ``asyncio.run`` waits for at exit), a registration converting a large
    model does not hold SIGTERM's exit for minutes: its temporaries are reaped by the next."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_T] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():  # cancelled meanwhile (stop)
            outcome()

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting task, whatever it is
            error = exc
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
                loop.call_soon_threadsafe(settle, lambda: future.set_exception(error))
        else:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle, lambda: future.set_result(result))

    threading.Thread(target=target, name="ember-node-sync", daemon=True).start()
    return await future
