"""The node agent's standbys: pre-warmed workers prepared for functions that scaled to zero.

When an instance ends because it idled past its keep-alive (``stop(..., standby=True)``),
the agent starts a worker of its own for it (:meth:`WarmPool.start_spare
<runtime.warm_pool.WarmPool.start_spare>`, at idle priority like a pre-warmed one) and prepares
it for that function over ``/_ember/standby`` (:mod:`runtime.assignment`): sandbox layer,
template, a pool session with the instance's KV quota, views and engine built, weights released
again. The next start of that function on that device activates it with an ordinary assign
carrying the same spec, model, ticket and quota, which skips all of that (the remaining cost is
one acquire round trip). The pre-warmed workers are never taken for a standby: one taken would
make the next cold start of another function wait for a process start, so a standby would
delay starts instead of saving them.

A standby pins nothing in the pool and holds no slot: it is not an instance, and nobody routes
to it. It is prepared at idle priority, like a pre-warmed worker; once ready it only waits, and
the agent moves it back to ``SCHED_OTHER`` then (:func:`~runtime.process.boost`): its
activation does not pay that move (~0.1 ms of the gateway's loop on this host, on the cold
path, before the assign goes out). At most ``standby`` standbys per node (the oldest ends
first) and one per function; each ends after ``standby_ttl_s``, when its function's next
launch brings another spec or model (a redeploy), when its pool dies, or when it fails.

A ready standby is announced to ``on_ready(url, token)`` (:meth:`NodeAgent.on_standby
<runtime.agent.NodeAgent.on_standby>`), and again every :data:`ANNOUNCE_S` while it waits: the
gateway keeps an idle connection to it, so the request it sends ahead of the activation does
not open one on the cold path (connect, accept and a new server protocol: ~1 ms on a 2-core
host, while the activation runs on the same cores).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from runtime.agent_config import AgentConfig
from runtime.errors import LaunchError
from runtime.messages import AssignMessage, MessageError, StandbyMessage, StandbyReply
from runtime.process import boost
from runtime.warm_pool import WarmPool
from runtime.worker_client import WorkerClient
from runtime.worker_handle import WorkerHandle

log = logging.getLogger("ember.agent")

# How often a waiting standby is announced again (s): below the gateway's idle-connection
# lifetime (gateway.proxy.POOL_KEEP_ALIVE_S, 30 s), so the connection it keeps stays open.
ANNOUNCE_S = 20.0
OnStandby = Callable[[str, str], object]  # (url, token) of a ready standby; its result is ignored

Grant = Callable[[str, int, str], Awaitable[str]]  # (device, KV quota bytes, scope) -> ticket


def function_name(spec: dict[str, Any]) -> str:
    """The function's qualified id (scheduler.names, not imported: runtime stays independent of
    the scheduler): "ns/name", two path components; the plain name in "default"."""
    meta = spec["metadata"]
    namespace = meta.get("namespace", "default")
    return str(meta["name"]) if namespace == "default" else f"{namespace}/{meta['name']}"


def kv_scope(spec: dict[str, Any]) -> str:
    """The scope an instance's published prefix KV is shared in: its function's ("ns/name")."""
    meta = spec["metadata"]
    return f"{meta.get('namespace', 'default')}/{meta['name']}"


@dataclass
class StandbyWorker:
    """A worker prepared for one function on one device."""

    worker: WorkerHandle
    message: StandbyMessage
    device: str
    since: float  # monotonic seconds it became ready
    announced: float = 0.0  # monotonic seconds it was last announced (on_ready)


class Standbys:
    """The standbys of one agent (see the module docstring)."""

    def __init__(self, config: AgentConfig, http: WorkerClient, workers: WarmPool, grant: Grant) -> None:
        self.config = config
        self._http = http
        self._workers = workers
        self._grant = grant
        self._ready: dict[str, StandbyWorker] = {}  # function -> its standby, oldest first
        self._preparing: set[str] = set()  # functions whose standby is being prepared
        self._pool_deaths: dict[str, int] = {}  # device -> how often its pool died
        self.on_ready: OnStandby | None = None  # told each ready standby (see the module docstring)

    def pids(self) -> list[int]:
        """Processes of the ready standbys (waiting, not instances)."""
        return [s.worker.pid for s in self._ready.values()]

    def report(self) -> dict[str, Any]:
        """The device report's view: how many standbys are ready and being prepared."""
        return {"standby_workers": len(self._ready), "standby_preparing": len(self._preparing)}

    async def prepare(self, assigned: AssignMessage, device: str) -> None:
        """Prepare a standby for the function ``assigned`` started on ``device`` (best effort:
        a worker that fails to start, or a failed preparation, leaves none)."""
        name = function_name(assigned.spec)
        quota = assigned.kv_quota_bytes
        if self.config.standby == 0 or quota is None or name in self._preparing:
            return
        current = self._ready.get(name)
        if current is not None and current.worker.running and current.message.spec == assigned.spec:
            return
        self._preparing.add(name)
        deaths = self._pool_deaths.get(device, 0)
        worker: WorkerHandle | None = None
        try:
            worker = await self._workers.start_spare()
            ticket = await self._grant(device, quota, kv_scope(assigned.spec))
            message = StandbyMessage(assigned.spec, assigned.model_dir, assigned.pool_socket, ticket, quota)
            resp = await self._http.post(worker, "standby", message.to_json())
            if resp.status != 200:
                raise MessageError(resp.error_message())
            reply = StandbyReply.from_json(resp.content)
            if self._pool_deaths.get(device, 0) != deaths:  # pool_died could not end it: not ready yet
                raise LaunchError(f"the pool of {device} died while the standby was prepared")
        except BaseException as exc:  # best effort: the next start takes a pre-warmed worker
            if worker is not None:
                await worker.terminate(self.config.drain_timeout_s)
            if not isinstance(exc, Exception):  # cancelled (the agent closes): not left running
                raise
            log.warning("no standby for %s: %s: %s", name, type(exc).__name__, exc)
            return
        finally:
            self._preparing.discard(name)
        older = self._ready.pop(name, None)  # one for another spec
        # Recorded before anything is awaited: an agent closing from here on ends it.
        self._ready[name] = ready = StandbyWorker(worker, message, device, time.monotonic())
        boost(worker.pid)  # idle from now on: out of SCHED_IDLE before its activation (docstring)
        log.info("standby for %s in worker %d: %s ms", name, worker.pid, reply.timings_ms)
        self._announce(ready, ready.since)
        if older is not None:
            await older.worker.terminate(self.config.drain_timeout_s)
        while len(self._ready) > self.config.standby:
            await self.end(next(iter(self._ready)))

    async def take(self, spec: dict[str, Any], model_dir: str, device: str) -> StandbyWorker | None:
        """The standby for ``spec``'s function on ``device`` if it was prepared for this very
        spec and model (one prepared for another is ended: the function was redeployed)."""
        if not self._ready:
            return None
        standby = self._ready.pop(function_name(spec), None)
        if standby is None:
            return None
        message = standby.message
        if (
            standby.worker.running
            and standby.device == device
            and message.spec == spec
            and message.model_dir == model_dir
        ):
            return standby
        await standby.worker.terminate(self.config.drain_timeout_s)
        return None

    async def expire(self, now: float | None = None) -> None:
        """End the standbys older than ``standby_ttl_s`` at ``now`` (monotonic seconds; default
        the present) and those whose process died."""
        now = time.monotonic() if now is None else now
        for name, s in list(self._ready.items()):
            if not s.worker.running or now - s.since > self.config.standby_ttl_s:
                await self.end(name)
            elif now - s.announced >= ANNOUNCE_S:
                self._announce(s, now)

    def _announce(self, standby: StandbyWorker, now: float) -> None:
        standby.announced = now
        if self.on_ready is not None:
            self.on_ready(standby.worker.url, standby.worker.token)

    def pool_died(self, device: str) -> list[WorkerHandle]:
        """Forget the standbys on ``device`` (their pool session is gone); returns their
        workers for the caller to kill. One being prepared now is ended when it is ready."""
        self._pool_deaths[device] = self._pool_deaths.get(device, 0) + 1
        gone = [name for name, s in self._ready.items() if s.device == device]
        return [self._ready.pop(name).worker for name in gone]

    async def end(self, name: str) -> None:
        """End ``name``'s standby, if it has one."""
        standby = self._ready.pop(name, None)
        if standby is not None:
            log.info("standby for %s in worker %d ends", name, standby.worker.pid)
            await standby.worker.terminate(self.config.drain_timeout_s)

    async def close(self) -> None:
        for name in list(self._ready):
            await self.end(name)
