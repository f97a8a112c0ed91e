"""The node's pool daemons, one per device (``cpu`` always), and their supervision.

Each daemon (:class:`gpu_pool.spawn.PoolProcess`) serves its socket under ``EMBER_HOME/run``,
trusts only the model store under ``EMBER_HOME/models`` and gives KV blocks only by ticket
(an instance's session gets its quota from the agent, the pool's admin). Each is supervised
(:mod:`runtime.supervisor`): when one dies, ``on_death`` runs (the agent kills the instances on
that device and marks the pre-warmed workers that mapped its arena), launches on the device
wait for the restart (:meth:`DevicePools.wait_until_up`), and once the daemon serves again on
the same socket ``on_restart`` runs (the agent replaces those workers).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.agent_config import AgentConfig
from runtime.errors import LaunchError
from runtime.process import die_with_parent
from runtime.supervisor import SpawnThread, supervise


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """Where a node's pool daemons listen and what a session without a ticket may hold.

    Embedded mode: ``EMBER_HOME/run/pool-cpu.sock``, KV only by the agent's tickets (0).
    Cluster mode (:mod:`runtime.node_daemon`): ``$EMBER_POOL_DIR/cpu.sock``, and function
    pods, which attach without a ticket, get a fixed per-session KV quota.
    """

    socket_dir: Path
    socket_prefix: str = "pool-"
    session_kv_quota: int | None = 0  # bytes; None: unlimited

    def __post_init__(self) -> None:
        if self.session_kv_quota is not None and self.session_kv_quota < 0:
            raise ValueError("session_kv_quota must be >= 0")

    def socket_path(self, device: str) -> Path:
        return self.socket_dir / f"{self.socket_prefix}{device}.sock"


class DevicePools:
    """The pool daemons of one node by device (``cpu``, later ``cuda:N``)."""

    def __init__(self, config: AgentConfig, layout: PoolLayout | None = None) -> None:
        self.config = config
        self.layout = layout or PoolLayout(config.run_dir)
        self.pools: dict[str, Any] = {}  # device -> gpu_pool.spawn.PoolProcess
        self._up: dict[str, asyncio.Event] = {}  # device -> set while its pool daemon serves
        self._tasks: set[asyncio.Task[None]] = set()
        self._spawner = SpawnThread("ember-pool-spawn")

    def start(self, device: str) -> None:
        """Start ``device``'s pool daemon; returns once it serves. Call from the event loop's
        thread (it lives as long as the agent does): see :func:`runtime.process.die_with_parent`."""
        self.pools[device] = self._new_pool(device)

    def _new_pool(self, device: str) -> Any:
        """Start ``device``'s pool daemon (blocks until it serves; a dead socket is replaced)."""
        from gpu_pool.spawn import PoolProcess
        from runtime.registry import models_dir

        env = {"EMBER_POOL_PREFAULT": "true" if self.config.pool_prefault else "false"}
        # Same socket path on a restart: workers and tools find the pool where it was.
        return PoolProcess(
            str(self.layout.socket_path(device)),
            self.config.arena_bytes,
            device,
            (),
            env,
            die_with_parent(),
            log_path=str(self.config.log_dir / f"pool-{device}.log"),
            store_roots=(models_dir(self.config.home),),
            # Embedded: KV only by ticket (an instance's session gets its quota at launch; any
            # other session, a handler's own or a pre-warmed worker's premap, none).
            session_kv_quota=self.layout.session_kv_quota,
        )

    def sockets(self) -> list[str]:
        """Every pool's socket path."""
        return [pool.socket_path for pool in self.pools.values()]

    # ----- liveness -------------------------------------------------------------------------------

    def alive(self, device: str) -> bool:
        """Whether ``device``'s pool daemon serves (false from its death until its restart)."""
        pool = self.pools.get(device)
        up = self._up.get(device)
        return pool is not None and pool.alive() and (up is None or up.is_set())

    def all_alive(self) -> bool:
        """Whether every pool daemon of this node serves."""
        return bool(self.pools) and all(self.alive(d) for d in self.pools)

    async def wait_until_up(self, device: str, deadline: float) -> None:
        """Return once ``device``'s pool serves; LaunchError if it is not back by ``deadline``
        (epoch seconds)."""
        up = self._up.get(device)
        if up is None or up.is_set():
            return
        try:
            await asyncio.wait_for(up.wait(), max(0.0, deadline - time.time()))
        except TimeoutError:
            raise LaunchError(f"the pool daemon for {device} did not come back in time") from None

    # ----- supervision ----------------------------------------------------------------------------

    def supervise(
        self, on_death: Callable[[str], Awaitable[None]], on_restart: Callable[[str], None]
    ) -> None:
        """Supervise every started pool (see the module docstring); ``on_death`` and
        ``on_restart`` get the device."""
        for device in self.pools:
            self._up[device] = asyncio.Event()
            self._up[device].set()
            child = _PoolChild(f"pool daemon ({device})", self, device, on_death, on_restart)
            task = asyncio.create_task(supervise(child, self.config.restart))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _mark_down(self, device: str) -> None:
        self._up[device].clear()

    async def _restart(self, device: str) -> None:
        """Start ``device``'s pool daemon again on the same socket."""
        await asyncio.to_thread(self.pools[device].stop)  # reap it, close its pipes and log
        self.pools[device] = await self._spawner.run(lambda: self._new_pool(device))
        self._up[device].set()

    async def stop_supervising(self) -> None:
        """Restart no pool from now on (the node is shutting down)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Stop supervising, then stop every pool daemon."""
        await self.stop_supervising()
        for pool in self.pools.values():
            await asyncio.to_thread(pool.stop)
        self.pools.clear()
        await asyncio.to_thread(self._spawner.close)


@dataclass
class _PoolChild:
    """One pool daemon as a :class:`runtime.supervisor.Child`."""

    name: str
    owner: DevicePools
    device: str
    on_death_hook: Callable[[str], Awaitable[None]]
    on_restart_hook: Callable[[str], None]

    def alive(self) -> bool:
        return bool(self.owner.pools[self.device].alive())

    async def on_death(self) -> None:
        self.owner._mark_down(self.device)
        await self.on_death_hook(self.device)

    async def restart(self) -> None:
        await self.owner._restart(self.device)
        self.on_restart_hook(self.device)
