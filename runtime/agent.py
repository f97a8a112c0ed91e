"""The node agent: pool daemons, the pre-warmed worker pool, instance start/stop, residency reports.

One agent per node. It runs one pool daemon per device (``cpu`` always) and keeps
``prewarm`` worker processes ready (TIDAL's process pool). Starting an instance hands a
pre-warmed worker its function (``/_ember/assign``) and starts a replacement in the
background, so no cold start pays for a process start or an import. Stopping an instance
sends SIGTERM: the worker drains, releases its tensors (they stay resident) and exits; one
that idled out leaves a standby (:mod:`runtime.standby_pool`), which the function's next start
activates instead of assigning a pre-warmed worker, spread over the cores while it activates
(:mod:`runtime.core_spread`). Pool
stats are reported through ``report`` (the scheduler's device record). The agent satisfies
:class:`scheduler.launcher.BaseLauncher` structurally; it imports nothing from the scheduler.

Its parts, one module each: :mod:`runtime.device_pools` (the pool daemons and their
supervision: when one dies, the instances on its device end, since their pool session is gone
and their state is not to be trusted, and the router forgets them because
:meth:`NodeAgent.alive` turns false; launches on that device wait for the restart),
:mod:`runtime.survivors` (the workers of those instances, which the function's next start
assigns again instead of a pre-warmed worker),
:mod:`runtime.warm_pool` (the pre-warmed workers: credentials, sandbox, resource limits and capabilities
(:mod:`runtime.worker_limits`), start backoff, stale
workers replaced after a pool restart), :mod:`runtime.worker_handle` (one worker as the agent
sees it), :mod:`runtime.device_report` (the device record) and :mod:`runtime.agent_config`.

The agent sends each worker's own credential on ``/_ember/*`` and returns it in
:class:`InstanceStart` so the gateway can reach the instance. A pre-warmed worker found dead
when a function is handed to it (its port refuses the connection: nothing was delivered) is
discarded and another one taken (:mod:`runtime.assign_call` types an assign's failures;
:mod:`runtime.instance_grants` gives each instance its KV quota and pool ticket). Each
worker an assign goes to is told to the launch's ``on_target`` first, so requests can follow
it there (:mod:`runtime.early_requests`). The worker's assign reply
(:class:`runtime.messages.AssignReply`) carries the pool's
:class:`~gpu_pool.acquire_report.AcquireReport`, which :class:`InstanceStart` keeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from gpu_pool.acquire_report import AcquireReport
from gpu_pool.errors import PoolError
from runtime.agent_config import AgentConfig
from runtime.assign_call import InitFailed, OnTarget, Undelivered, assign
from runtime.core_spread import SPREAD_S, spread
from runtime.cpu_share import CpuShare
from runtime.device_pools import DevicePools
from runtime.device_report import device_record, read_stats
from runtime.errors import InstanceLost, LaunchError
from runtime.instance_grants import InstanceGrants
from runtime.mesh.admission import instance_view
from runtime.mesh.grant_server import DeviceGrants
from runtime.messages import MAX_THREADS, AssignMessage, AssignReply, MessageError, ThreadsMessage
from runtime.process import boost
from runtime.standby_pool import OnStandby, Standbys, function_name, kv_scope
from runtime.survivors import Survivors
from runtime.warm_pool import WarmPool
from runtime.worker_client import WorkerClient
from runtime.worker_handle import WorkerHandle

log = logging.getLogger("ember.agent")


__all__ = ["AgentConfig", "InstanceStart", "LaunchError", "NodeAgent"]


@dataclass(frozen=True, slots=True)
class InstanceStart:
    """What starting an instance measured (also what ``/v1/cluster`` shows of it)."""

    url: str
    pid: int
    acquire: AcquireReport  # what the pool's acquire of the instance's weights cost
    timings_ms: dict[str, float]
    log_path: str
    token: str  # the worker's credential: requests to ``url`` send it (runtime.worker_guard)

    @property
    def bytes_loaded(self) -> int:
        return self.acquire.bytes_loaded

    @property
    def bytes_reused(self) -> int:
        return self.acquire.bytes_reused


class _Start(NamedTuple):
    """One launch: what the instance is and where it starts."""

    instance_id: str
    spec: dict[str, Any]
    model: dict[str, Any]  # the registered model's document (``dir``, ``id``, ...)
    device: str
    deadline: float
    threads: int | None  # its intra-op threads (CPU devices)
    take_turns: bool  # the agent schedules its device token by token (runtime.mesh)
    on_target: OnTarget | None = None  # told each worker the assign goes to (launch)


class NodeAgent:
    """Pools, pre-warmed workers and instances of one node (see module docstring)."""

    def __init__(
        self, config: AgentConfig, report: Callable[[str, dict[str, Any]], None] | None = None
    ) -> None:
        self.config = config
        self._report = report
        self._http = WorkerClient(config.worker_start_timeout_s)
        self._pools = DevicePools(config)
        self._workers = WarmPool(config, self._http, self._pools.sockets)
        self._grants_of = InstanceGrants(config, self._pools)
        self._standbys = Standbys(config, self._http, self._workers, self._grants_of.ticket)
        self._instances: dict[str, WorkerHandle] = {}
        self._survivors = Survivors(config)  # instances' workers whose pool died (runtime.survivors)
        # Instances that ended with their pool, until the router forgets them (stop()).
        self._pool_ended: set[str] = set()
        self._pool_deaths: dict[str, int] = {}  # device -> how often its pool died
        self._cpu_share = CpuShare(os.cpu_count() or 1, MAX_THREADS)
        self._sharing = asyncio.Lock()  # one thread-share round at a time: posts stay in order
        self._tasks: set[asyncio.Task[None]] = set()  # background rounds (kept referenced)
        self._grants: dict[str, DeviceGrants] = {}  # device -> its token scheduler (runtime.mesh)

    def on_standby(self, callback: OnStandby) -> None:
        """Tell ``callback(url, token)`` each standby that becomes ready, and again while it
        waits (:mod:`runtime.standby_pool`): the gateway keeps a connection open to it."""
        self._standbys.on_ready = callback

    @property
    def pools(self) -> dict[str, Any]:
        """device -> its :class:`gpu_pool.spawn.PoolProcess`."""
        return self._pools.pools

    @property
    def spawn_errors(self) -> list[str]:
        """The last few failures to start a pre-warmed worker."""
        return self._workers.spawn_errors

    # ----- lifecycle ----------------------------------------------------------------------------

    def device_id(self, device: str) -> str:
        return f"{self.config.node}/{device}"

    def devices(self) -> list[str]:
        """Device ids this agent launches on (``node/cpu``; CUDA pools join when present)."""
        return [self.device_id(d) for d in self.pools]

    async def start(self) -> None:
        """Start the CPU pool and the pre-warmed workers (returns once the pool serves)."""
        from runtime.registry import models_dir

        self.config.run_dir.mkdir(parents=True, exist_ok=True)
        (self.config.log_dir / "workers").mkdir(parents=True, exist_ok=True)
        # The pool loads tensors only from store entries under its trusted roots: the models
        # this agent registers (ensure_model) all live here.
        models_dir(self.config.home).mkdir(parents=True, exist_ok=True)
        # Spawned from the event loop's thread (it lives as long as we do): see die_with_parent.
        self._pools.start("cpu")
        self._workers.fill()
        self._pools.supervise(self._pool_died, self._pool_restarted)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stop every worker (those still starting too) and pool."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._pools.stop_supervising()
        for grants in self._grants.values():
            grants.close()
        instances, self._instances = list(self._instances.values()), {}
        await asyncio.gather(
            self._workers.close(),
            self._standbys.close(),
            self._survivors.close(),
            *(w.terminate(self.config.drain_timeout_s) for w in instances),
            return_exceptions=True,
        )
        await self._http.close()
        await self._pools.close()

    # ----- models ---------------------------------------------------------------------------------

    async def ensure_model(self, source: str, dtype: str, progress: bool = False) -> dict[str, Any]:
        """Register ``source`` (idempotent) and tell idle workers to preload its template."""
        from runtime.registry import register

        model = await asyncio.to_thread(register, source, dtype, self.config.home, progress)
        manifest = await asyncio.to_thread(model.manifest)
        model_dir = str(model.directory)
        if self._workers.adopt(model_dir):
            await self._workers.preload_idle(model_dir)
        return {"id": model.model_id, "dir": model_dir, "weight_bytes": int(manifest.nbytes)}

    def adopt_template(self, model_dir: str) -> None:
        """Have workers started from now on preload ``model_dir``'s template."""
        self._workers.adopt(model_dir)

    # ----- instances ------------------------------------------------------------------------------

    async def launch(
        self,
        instance_id: str,
        spec: dict[str, Any],
        model: dict[str, Any],
        device_id: str,
        deadline: float,
        on_target: OnTarget | None = None,
    ) -> InstanceStart:
        """Turn a standby of the function (:mod:`runtime.standby_pool`) or else a pre-warmed
        worker into an instance of ``spec`` on ``device_id``. ``on_target(url, token)`` is told
        each worker the assign goes to, before it is sent: requests may follow it there at
        once (:mod:`runtime.early_requests`)."""
        device = device_id.split("/", 1)[1]
        if device not in self.pools:
            raise LaunchError(f"this node has no pool for {device_id}")
        await self._pools.wait_until_up(device, deadline)
        self._workers.adopt(model["dir"])
        threads = self._new_instance_threads() if device == "cpu" else None
        start = _Start(
            instance_id, spec, model, device, deadline, threads, self._takes_turns(device), on_target
        )
        started = None
        for attempt in (self._from_standby, self._from_survivor, self._from_prewarmed):
            await self._pools.wait_until_up(device, deadline)  # (again after a failed attempt)
            deaths = self._pool_deaths.get(device, 0)
            started = await attempt(start)
            if started is not None:
                break
        assert started is not None, "a start from a pre-warmed worker returns or raises"
        worker, message, reply = started
        if self._pool_deaths.get(device, 0) != deaths:  # it started on the pool that died
            await worker.terminate(self.config.drain_timeout_s)
            raise LaunchError(f"the pool of {device} died while instance {instance_id} started")
        log_path = await self._install(start, worker, message)
        # The others' share shrank: told in the background, off this start's path (each
        # instance applies it between two engine steps).
        self._spawn(self._share_cores())
        timings = {k: round(float(v), 3) for k, v in reply.timings_ms.items()}
        log.info(
            "instance %s of %s started in worker %d: %s ms, %d bytes loaded",
            instance_id,
            function_name(spec),
            worker.pid,
            timings,
            reply.acquire.bytes_loaded,
        )
        return InstanceStart(worker.url, worker.pid, reply.acquire, timings, str(log_path), worker.token)

    async def _install(self, start: _Start, worker: WorkerHandle, message: AssignMessage) -> Path:
        """Make ``worker``, which took ``message``, the instance ``start`` asked for: its log
        moved under its function, recorded, its token-scheduler line attached; returns the
        log's path. Any failure (cancellation too) ends the worker: the caller forgets a launch
        that raised, so nobody would ever stop it, and its lines would be dropped open."""
        instance_id, device = start.instance_id, start.device
        sock, page = worker.mesh_sock, worker.mesh_page
        try:
            view = None
            if message.token_scheduling and sock is not None and page is not None:
                shape = self._grants_of.known_shape(message.model_dir)  # read by the launch: no thread hop
                if shape is None:
                    shape = await asyncio.to_thread(self._grants_of.model_shape, message.model_dir)
                profile, context = shape
                view = instance_view(page, start.spec, profile, context)
            name = function_name(start.spec)
            log_path = self.config.log_dir / "functions" / name / f"instance-{instance_id}.log"
            log_path.parent.mkdir(parents=True, exist_ok=True)
            # The worker keeps writing to the renamed file (a survivor's: its ended instance's
            # lines go with it, under the new instance's name).
            os.replace(worker.log_path, log_path)
            worker.log_path = log_path
            worker.device = device
            worker.threads = start.threads
            worker.assigned = message
            # Nothing is awaited from here on: a stop() cannot close the line between the two.
            self._instances[instance_id] = worker
            if view is not None and sock is not None:
                grants = self._grants.setdefault(device, DeviceGrants(device, self.config.tokens))
                grants.attach(instance_id, sock, view)
        except BaseException:
            if self._instances.get(instance_id) is worker:
                del self._instances[instance_id]
            grants_of_device = self._grants.get(device)
            if grants_of_device is not None and instance_id in grants_of_device.instance_ids:
                grants_of_device.detach(instance_id)  # before its socket closes
            await worker.terminate(self.config.drain_timeout_s)
            raise
        return log_path

    async def _from_standby(self, start: _Start) -> tuple[WorkerHandle, AssignMessage, AssignReply] | None:
        """Activate the function's standby; None when it has none or it failed (then ended)."""
        standby = await self._standbys.take(start.spec, start.model["dir"], start.device)
        if standby is None:
            return None
        worker, prepared = standby.worker, standby.message
        message = AssignMessage(
            start.instance_id,
            start.spec,
            prepared.model_dir,
            prepared.pool_socket,
            prepared.pool_ticket,
            start.deadline,
            start.threads,
            prepared.kv_quota_bytes,
            start.take_turns,
            dict(start.model.get("adapters") or {}),
        )
        # (Out of SCHED_IDLE since it was ready: runtime.standby_pool.)
        pool = self.pools.get(start.device)
        pins = spread(worker.proc.pid, pool.proc.pid if pool is not None else None)
        undo = asyncio.get_running_loop().call_later(SPREAD_S, pins.restore)
        try:
            return await self._assign_or_fall_back(worker, message, start, "standby")
        finally:
            undo.cancel()
            pins.restore(worker_gone=not worker.running)

    async def _from_survivor(self, start: _Start) -> tuple[WorkerHandle, AssignMessage, AssignReply] | None:
        """Assign the function again to a worker whose instance of it ended with its pool
        (:mod:`runtime.survivors`); None when there is none or it failed (then ended)."""
        worker = await self._survivors.take(start.spec, start.model["dir"], start.device)
        if worker is None:
            return None
        try:
            message = await self._assign_message(start)
        except BaseException:
            self._survivors.add(worker, start.device)  # unused: kept for the next start
            raise
        return await self._assign_or_fall_back(worker, message, start, "survivor")

    async def _assign_or_fall_back(
        self, worker: WorkerHandle, message: AssignMessage, start: _Start, kind: str
    ) -> tuple[WorkerHandle, AssignMessage, AssignReply] | None:
        """Assign ``message`` to ``worker`` (a ``kind``: standby or survivor); None when that
        failed (the worker is ended): the start goes on from a pre-warmed worker."""
        try:
            return worker, message, await self._assign(worker, message, start.on_target)
        except (InitFailed, InstanceLost):  # its initializer would fail anywhere; it served, then died
            raise
        except LaunchError as exc:  # the ordinary start still can
            log.warning("%s failed, %s starts from a pre-warmed worker: %s", kind, start.instance_id, exc)
            return None

    async def _from_prewarmed(self, start: _Start) -> tuple[WorkerHandle, AssignMessage, AssignReply]:
        """Assign a pre-warmed worker (another one when the one taken turns out dead)."""
        message: AssignMessage | None = None
        for attempt in range(self.config.prewarm + 1):
            worker = await self._workers.take()
            # Replenish while this one serves.
            self._workers.spawn_in_background(self.config.replenish_delay_s)
            if message is None:  # once a worker is there (a start that backs off fails first)
                try:
                    message = await self._assign_message(start)
                except BaseException:
                    self._workers.put_back(worker)  # unused: the next launch takes it
                    raise
            # Out of SCHED_IDLE before it builds the instance: a worker without capabilities
            # cannot do that itself (runtime.worker_limits).
            boost(worker.proc.pid)
            try:
                return worker, message, await self._assign(worker, message, start.on_target)
            except Undelivered as exc:  # a dead worker: nothing was delivered, take another
                if attempt == self.config.prewarm:
                    raise LaunchError(f"no pre-warmed worker was reachable: {exc}") from None
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _assign(
        self, worker: WorkerHandle, message: AssignMessage, on_target: OnTarget | None = None
    ) -> AssignReply:
        """:func:`runtime.assign_call.assign` ``message`` to ``worker`` (ended if it fails)."""
        return await assign(self._http, worker, message, self.config.drain_timeout_s, on_target)

    def _new_instance_threads(self) -> int:
        """The intra-op threads of an instance about to start on the CPU device (its share
        with the instances already there: :meth:`runtime.cpu_share.CpuShare.share`)."""
        running = sum(1 for w in self._instances.values() if w.running and w.device == "cpu")
        return self._cpu_share.share(1 if self._takes_turns("cpu") else running + 1)

    def _takes_turns(self, device: str) -> bool:
        """Whether instances on ``device`` run token by token (runtime.mesh: CPU devices only;
        a GPU's kernels queue on its streams instead)."""
        return self.config.tokens.enabled and device == "cpu"

    async def _assign_message(self, start: _Start) -> AssignMessage:
        """What ``/_ember/assign`` tells a worker, with a pool ticket for the instance's KV quota."""
        spec, model_dir, device = start.spec, start.model["dir"], start.device
        concurrency = int(spec["spec"]["scaling"]["concurrency"])
        quota = await asyncio.to_thread(self._grants_of.kv_quota, model_dir, concurrency)
        ticket = await self._grants_of.ticket(device, quota, kv_scope(spec))
        socket_path = self.pools[device].socket_path
        try:
            return AssignMessage(
                start.instance_id,
                spec,
                model_dir,
                socket_path,
                ticket,
                start.deadline,
                start.threads,
                quota,
                start.take_turns,
                dict(start.model.get("adapters") or {}),
            )
        except MessageError as exc:
            raise LaunchError(f"cannot assign instance {start.instance_id}: {exc}") from None

    async def evict(self, model_id: str | None = None) -> int:
        """Admin: evict the inactive tensors of ``model_id`` (all models: None) from every pool;
        returns the bytes freed."""
        from gpu_pool.client import PoolClient

        def evict_one(socket_path: str, token: str) -> int:
            with PoolClient(socket_path, timeout=30.0, admin_token=token) as client:
                if model_id is not None and model_id not in client.stats()["models"]:
                    return 0  # nothing of it resident in this pool
                return client.evict(model_id)

        freed = 0
        for pool in list(self.pools.values()):
            freed += await asyncio.to_thread(evict_one, pool.socket_path, pool.admin_token)
        return freed

    async def stop(self, instance_id: str, standby: bool = False) -> None:
        """Drain and stop an instance (SIGTERM, SIGKILL after the drain timeout); ``standby``:
        it idled out, prepare a standby for its function (:mod:`runtime.standby_pool`)."""
        self._pool_ended.discard(instance_id)
        worker = self._instances.pop(instance_id, None)
        if worker is not None:
            if worker.device in self._grants:
                self._grants[worker.device].detach(instance_id)  # before its socket closes
            await worker.terminate(self.config.drain_timeout_s)
            if standby and worker.assigned is not None and self.pool_alive(worker.device):
                self._spawn(self._standbys.prepare(worker.assigned, worker.device))
            await self._share_cores()

    async def retire(self, name: str) -> None:
        """``name`` (the function's qualified id) was deleted or redeployed: its standby and
        survivors end."""
        await self._standbys.end(name)
        await self._survivors.end(name)

    async def _share_cores(self, measure: bool = False) -> None:
        """Give each CPU instance its share of intra-op threads (:mod:`runtime.cpu_share`: the
        cores others leave, split among instances); ``measure``: take a CPU sample first (the
        periodic report), else reuse the last decision (an instance started or ended)."""
        async with self._sharing:
            workers = [w for w in self._instances.values() if w.running and w.device == "cpu"]
            per = self._cpu_share.decide(
                time.monotonic(),
                [w.pid for w in workers],
                self._workers.idle_pids() + self._standbys.pids(),
                measure,
                self._takes_turns("cpu"),
            )
            if per is None:
                return
            for w in workers:
                if w.threads == per:
                    continue
                with contextlib.suppress(LaunchError):  # WorkerUnreachable, WorkerCallFailed
                    resp = await self._http.post(w, "threads", ThreadsMessage(per).to_json(), timeout_s=5.0)
                    if resp.status == 200:
                        if w.threads is not None:
                            log.info(
                                "instance worker %d: %d intra-op threads (was %d)", w.pid, per, w.threads
                            )
                        w.threads = per

    def alive(self, instance_id: str) -> bool:
        """Whether this agent runs ``instance_id`` and its process lives."""
        worker = self._instances.get(instance_id)
        return worker is not None and worker.running

    def owns(self, instance_id: str) -> bool:
        return instance_id in self._instances or instance_id in self._pool_ended

    def instance_pid(self, instance_id: str) -> int | None:
        worker = self._instances.get(instance_id)
        return worker.pid if worker else None

    def warm(self) -> list[tuple[int, str]]:
        """The pre-warmed workers ready now: (pid, URL) each."""
        return [(w.pid, w.url) for w in self._workers.ready()]

    # ----- reports --------------------------------------------------------------------------------

    async def report(self) -> dict[str, dict[str, Any]]:
        """Read every pool's stats and publish them as device records (and end standbys past
        their time)."""
        await self._standbys.expire()
        await self._survivors.expire()
        out: dict[str, dict[str, Any]] = {}
        for device, pool in self.pools.items():
            if not self.pool_alive(device):
                continue  # being restarted: the next report has it again
            try:
                stats = await asyncio.to_thread(read_stats, pool.socket_path)
            except (OSError, PoolError) as exc:  # it died since the check: supervision restarts it
                log.info("no report for %s this time: its pool did not answer (%s)", device, exc)
                continue
            workers = {
                **self._workers.report(),
                **self._standbys.report(),
                **self._survivors.report(device),
                **self._tokens_report(device),
            }
            workers["instances"] = sum(
                1 for w in self._instances.values() if w.device == device and w.running
            )
            record = device_record(self.config.node, device, stats, workers)
            out[self.device_id(device)] = record
            if self._report is not None:
                await asyncio.to_thread(self._report, self.device_id(device), record)
        await self._share_cores(measure=True)  # about once a second: see runtime.cpu_share
        return out

    def _tokens_report(self, device: str) -> dict[str, Any]:
        """Token-level scheduling on ``device`` (runtime.mesh), for ``/v1/cluster``."""
        if not self._takes_turns(device):
            return {}
        grants = self._grants.get(device)
        return {
            "token_scheduling": {
                "instances": len(grants.instance_ids) if grants else 0,
                "grants": grants.scheduler.num_grants if grants else 0,
                "admitted": grants.num_admitted if grants else 0,
                "refused": grants.num_refused if grants else 0,
            }
        }

    # ----- pools ------------------------------------------------------------------------------------

    def pool_alive(self, device: str) -> bool:
        """Whether ``device``'s pool daemon serves (false from its death until its restart)."""
        return self._pools.alive(device)

    def pools_alive(self) -> bool:
        """Whether every pool daemon of this node serves."""
        return self._pools.all_alive()

    def warm_ready(self) -> bool:
        """Whether a pre-warmed worker is ready to take a function (always true with prewarm 0)."""
        return self._workers.any_ready()

    async def _pool_died(self, device: str) -> None:
        """Fail the instances on ``device`` fast (kept as survivors, :mod:`runtime.survivors`,
        or killed) and mark the workers that mapped its arena."""
        self._pool_deaths[device] = self._pool_deaths.get(device, 0) + 1
        standbys = self._standbys.pool_died(device)  # forgotten here: their lines close now
        victims = list(standbys)
        for instance_id, worker in list(self._instances.items()):
            if worker.device != device:
                continue
            del self._instances[instance_id]  # alive() is false at once: the router forgets it
            self._pool_ended.add(instance_id)
            if device in self._grants:
                self._grants[device].detach(instance_id)
            # (Not where instances take turns: the line to the token scheduler may still hold
            # the ended instance's messages, which the next one would take for its own.)
            if self._survivors.enabled and worker.running and not self._takes_turns(device):
                self._survivors.add(worker, device)  # it ends its instance itself
            else:
                victims.append(worker)
        for worker in victims:  # SIGKILL: its session and KV blocks are gone, nothing to drain
            worker.kill()
            worker.close_lines()  # (detached from the grants above)
        self._workers.mark_stale()
        if victims:  # reaped here so that alive() turns false at once (bounded: never hang)
            await asyncio.wait([asyncio.ensure_future(w.proc.wait()) for w in victims], timeout=5.0)

    def _pool_restarted(self, device: str) -> None:
        """Replace the pre-warmed workers that mapped the dead arena."""
        self._workers.replace_stale_in_background()
