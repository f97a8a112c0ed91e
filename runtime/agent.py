"""The node agent: pool daemons, the pre-warmed worker pool, instance start/stop, residency reports.

One agent per node. It runs one pool daemon per device (``cpu`` always) and keeps
``prewarm`` worker processes ready (torch and the runtime imported, HTTP listening, model
templates loaded: TIDAL's process pool). Starting an instance hands a pre-warmed worker its
function (``/_ember/assign``) and starts a replacement in the background, so no cold start
pays for a process start or an import. Stopping an instance sends SIGTERM: the worker
drains, releases its tensors (they stay resident) and exits. Pool stats are reported
through ``report`` (the scheduler's device record). Each pool daemon is supervised
(``runtime.supervisor``): when one dies, the instances on its device are killed (their pool
session is gone, their state is not to be trusted; the router forgets them because
:meth:`NodeAgent.alive` turns false), launches on that device wait for the restart, and
the pre-warmed workers that mapped the dead arena are replaced. The agent satisfies
:class:`scheduler.launcher.BaseLauncher` structurally; it imports nothing from the scheduler.

Each worker gets its own credential (:mod:`runtime.worker_spawn`: over stdin, with an
environment stripped of secrets, ``TMPDIR`` set to ``EMBER_HOME/tmp``, its resource limits and
capabilities (:mod:`runtime.worker_limits`), and confined by :mod:`runtime.sandbox` unless
``EMBER_WORKER_SANDBOX=off``); the agent sends it on
``/_ember/*`` and returns it in :class:`InstanceStart` so the gateway can reach the
instance. A pre-warmed worker found dead when a function is handed to it (its port refuses
the connection: nothing was delivered) is discarded and another one taken. Workers that
keep failing to start are retried with capped exponential backoff, shown in the device
report (``worker_failures``, ``backoff_s``, ``last_worker_error``); after two failures in a
row a launch fails at once with the last error while the next try waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from runtime.errors import EmberRuntimeError
from runtime.messages import MAX_THREADS, AssignMessage, MessageError, PreloadMessage, ThreadsMessage
from runtime.process import boost, die_with_parent
from runtime.sandbox import SandboxConfig, temp_dir
from runtime.supervisor import RestartConfig, SpawnThread, supervise
from runtime.worker_guard import DEFAULT_MAX_BODY_BYTES, TOKEN_HEADER
from runtime.worker_limits import WorkerLimits
from runtime.worker_spawn import BackoffConfig, SpawnBackoff, new_token, worker_environment

_JSON = {"content-type": "application/json"}  # the agent's messages are runtime.messages JSON


class LaunchError(EmberRuntimeError):
    """An instance could not be started (the worker refused its function or died)."""


@dataclass(frozen=True, slots=True)
class AgentConfig:
    home: Path  # EMBER_HOME: model store, sockets, logs
    arena_bytes: int = 2 << 30
    prewarm: int = 2  # pre-warmed workers kept ready
    node: str = field(default_factory=socket.gethostname)
    worker_start_timeout_s: float = 120.0
    drain_timeout_s: float = 30.0
    pool_prefault: bool = True
    # A replacement worker warming up beside a new instance slows that instance's first
    # requests (shared cores and caches, even at SCHED_IDLE): replenish a little later.
    replenish_delay_s: float = 2.0
    worker_max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger requests get 413 at the worker
    backoff: BackoffConfig = field(default_factory=BackoffConfig)  # failing worker starts
    restart: RestartConfig = field(default_factory=RestartConfig)  # dead pool daemons
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # workers cannot read or write EMBER_HOME
    limits: WorkerLimits = field(default_factory=WorkerLimits)  # rlimits and capabilities of workers

    def __post_init__(self) -> None:
        if self.worker_max_body_bytes < 1024:
            raise ValueError("worker_max_body_bytes must be at least 1 KiB")
        if self.arena_bytes < 1 << 20:
            raise ValueError("arena_bytes must be at least 1 MiB")
        if self.replenish_delay_s < 0:
            raise ValueError("replenish_delay_s must be >= 0")
        if self.prewarm < 0:
            raise ValueError("prewarm must be >= 0")
        if not self.node or "/" in self.node:
            raise ValueError(f"node name {self.node!r} must be non-empty without '/'")


@dataclass(frozen=True, slots=True)
class InstanceStart:
    """What starting an instance measured (also what ``/v1/cluster`` shows of it)."""

    url: str
    pid: int
    bytes_loaded: int
    bytes_reused: int
    timings_ms: dict[str, float]
    log_path: str
    token: str  # the worker's credential: requests to ``url`` send it (runtime.worker_guard)


@dataclass
class _Worker:
    proc: asyncio.subprocess.Process
    url: str
    log_path: Path
    token: str
    device: str = ""  # the pool device its instance runs on ("" while pre-warmed)

    @property
    def headers(self) -> dict[str, str]:
        return {TOKEN_HEADER: self.token}


class NodeAgent:
    """Pools, pre-warmed workers and instances of one node (see module docstring)."""

    def __init__(
        self, config: AgentConfig, report: Callable[[str, dict[str, Any]], None] | None = None
    ) -> None:
        self.config = config
        self._report = report
        self.run_dir = config.home / "run"
        self.log_dir = config.home / "logs"
        self.pools: dict[str, Any] = {}  # device -> gpu_pool.spawn.PoolProcess
        self._warm: list[_Worker] = []
        self._spawning: dict[int, asyncio.subprocess.Process] = {}  # pid -> worker still starting
        self._pending_spawns = 0  # spawn tasks not finished (including before their fork)
        self._urgent = asyncio.Event()  # set while a launch waits for a pre-warmed worker
        self._warm_ready = asyncio.Event()
        self._instances: dict[str, _Worker] = {}
        self._templates: set[str] = set()  # model directories every new worker preloads
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(config.worker_start_timeout_s))
        self._tasks: set[asyncio.Task[Any]] = set()
        self.spawn_errors: list[str] = []  # the last few start failures (bounded)
        self._backoff = SpawnBackoff(config.backoff)
        self._pool_up: dict[str, asyncio.Event] = {}  # device -> set while its pool daemon serves
        self._stale: set[int] = set()  # pids of pre-warmed workers that mapped a dead arena
        self._kv_shapes: dict[str, tuple[dict[str, Any], int]] = {}  # model dir -> (KV profile, context)
        self._spawner = SpawnThread("ember-pool-spawn")

    # ----- lifecycle ----------------------------------------------------------------------------

    def device_id(self, device: str) -> str:
        return f"{self.config.node}/{device}"

    def devices(self) -> list[str]:
        """Device ids this agent launches on (``node/cpu``; CUDA pools join when present)."""
        return [self.device_id(d) for d in self.pools]

    async def start(self) -> None:
        """Start the CPU pool and the pre-warmed workers (returns once the pool serves)."""
        from runtime.registry import models_dir

        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.log_dir / "workers").mkdir(parents=True, exist_ok=True)
        # The pool loads tensors only from store entries under its trusted roots: the models
        # this agent registers (ensure_model) all live here.
        store_root = models_dir(self.config.home)
        store_root.mkdir(parents=True, exist_ok=True)
        # Spawned from the event loop's thread (it lives as long as we do): see die_with_parent.
        self.pools["cpu"] = self._new_pool("cpu")
        for _ in range(self.config.prewarm):
            self._spawn_in_background()
        self._supervise_pools()

    def _new_pool(self, device: str) -> Any:
        """Start ``device``'s pool daemon (blocks until it serves; a dead socket is replaced)."""
        from gpu_pool.spawn import PoolProcess
        from runtime.registry import models_dir

        env = {"EMBER_POOL_PREFAULT": "true" if self.config.pool_prefault else "false"}
        # Same socket path on a restart: workers and tools find the pool where it was.
        return PoolProcess(
            str(self.run_dir / f"pool-{device}.sock"),
            self.config.arena_bytes,
            device,
            (),
            env,
            die_with_parent(),
            log_path=str(self.log_dir / f"pool-{device}.log"),
            store_roots=(models_dir(self.config.home),),
            # KV only by ticket: an instance's session gets its quota (launch), any other
            # session (a handler's own, a pre-warmed worker's premap) none.
            session_kv_quota=0,
        )

    async def close(self) -> None:
        """Stop every worker (those still starting too) and pool."""
        starting = list(self._spawning.values())
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for proc in starting:  # a cancelled start leaves its process: end it
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        workers = self._warm + list(self._instances.values())
        self._warm, self._instances = [], {}
        await asyncio.gather(*(self._terminate(w) for w in workers), return_exceptions=True)
        await self._http.aclose()
        for pool in self.pools.values():
            await asyncio.to_thread(pool.stop)
        self.pools.clear()
        await asyncio.to_thread(self._spawner.close)

    # ----- models ---------------------------------------------------------------------------------

    async def ensure_model(self, source: str, dtype: str, progress: bool = False) -> dict[str, Any]:
        """Register ``source`` (idempotent) and tell idle workers to preload its template."""
        from runtime.registry import register

        model = await asyncio.to_thread(register, source, dtype, self.config.home, progress)
        manifest = await asyncio.to_thread(model.manifest)
        model_dir = str(model.directory)
        if model_dir not in self._templates:
            self._templates.add(model_dir)
            for w in list(self._warm):
                with contextlib.suppress(httpx.HTTPError):
                    await self._http.post(
                        f"{w.url}/_ember/preload",
                        content=PreloadMessage(model_dir).to_json(),
                        headers={**w.headers, **_JSON},
                    )
        return {"id": model.model_id, "dir": model_dir, "weight_bytes": int(manifest.nbytes)}

    def adopt_template(self, model_dir: str) -> None:
        """Have workers started from now on preload ``model_dir``'s template."""
        self._templates.add(model_dir)

    # ----- instances ------------------------------------------------------------------------------

    async def launch(
        self, instance_id: str, spec: dict[str, Any], model: dict[str, Any], device_id: str, deadline: float
    ) -> InstanceStart:
        """Turn a pre-warmed worker into an instance of ``spec`` on ``device_id``."""
        device = device_id.split("/", 1)[1]
        if device not in self.pools:
            raise LaunchError(f"this node has no pool for {device_id}")
        await self._wait_for_pool(device, deadline)
        if model["dir"] not in self._templates:
            self._templates.add(model["dir"])
        body: str | None = None
        for attempt in range(self.config.prewarm + 1):
            worker = await self._take_warm()
            self._spawn_in_background(self.config.replenish_delay_s)  # replenish while this one serves
            if body is None:  # once a worker is there (a start that backs off fails first)
                try:
                    body = await self._assign_body(instance_id, spec, model, device, deadline)
                except BaseException:
                    self._warm.insert(0, worker)  # unused: the next launch takes it
                    raise
            # Out of SCHED_IDLE before it builds the instance: a worker without capabilities
            # cannot do that itself (runtime.worker_limits).
            boost(worker.proc.pid)
            try:
                url = f"{worker.url}/_ember/assign"
                resp = await self._http.post(url, content=body, headers={**worker.headers, **_JSON})
            except httpx.ConnectError as exc:  # a dead worker: nothing was delivered, take another
                await self._terminate(worker)
                if attempt == self.config.prewarm:
                    raise LaunchError(f"no pre-warmed worker was reachable: {exc}") from None
                continue
            except httpx.HTTPError as exc:
                await self._terminate(worker)
                raise LaunchError(f"worker {worker.proc.pid} did not take the function: {exc}") from None
            break
        if resp.status_code != 200:
            await self._terminate(worker)
            raise LaunchError(f"worker refused the function: {_error_message(resp)}")
        # The function's qualified id (scheduler.names, not imported: runtime stays independent of
        # the scheduler): "ns/name", two path components; the plain name in "default".
        meta = spec["metadata"]
        namespace = meta.get("namespace", "default")
        name = meta["name"] if namespace == "default" else f"{namespace}/{meta['name']}"
        log_path = self.log_dir / "functions" / name / f"instance-{instance_id}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(worker.log_path, log_path)  # the worker keeps writing to the renamed file
        worker.log_path = log_path
        worker.device = device
        self._instances[instance_id] = worker
        await self._share_cores()
        data = resp.json()
        acquired = data["acquire"]
        return InstanceStart(
            worker.url, worker.proc.pid, int(acquired["bytes_loaded"]), int(acquired["bytes_reused"]),
            {k: round(float(v), 3) for k, v in data["timings_ms"].items()}, str(log_path), worker.token,
        )  # fmt: skip

    async def _assign_body(
        self, instance_id: str, spec: dict[str, Any], model: dict[str, Any], device: str, deadline: float
    ) -> str:
        """What ``/_ember/assign`` tells a worker, with a pool ticket for the instance's KV quota."""
        concurrency = int(spec["spec"]["scaling"]["concurrency"])
        quota = await asyncio.to_thread(self._kv_quota, model["dir"], concurrency)
        ticket = await asyncio.to_thread(self._grant, device, quota)
        try:
            message = AssignMessage(
                instance_id, spec, model["dir"], self.pools[device].socket_path, ticket, deadline
            )
        except MessageError as exc:
            raise LaunchError(f"cannot assign instance {instance_id}: {exc}") from None
        return message.to_json()

    def _kv_quota(self, model_dir: str, concurrency: int) -> int:
        """The KV quota of an instance of ``model_dir`` (:func:`runtime.kv_quota.instance_kv_quota`)."""
        from runtime.kv_quota import instance_kv_quota
        from runtime.registry import load

        shape = self._kv_shapes.get(model_dir)
        if shape is None:  # read once per model: launches stay off the disk
            model = load(Path(model_dir))
            shape = self._kv_shapes[model_dir] = (
                model.profile("cpu"),
                int(model.config["max_position_embeddings"]),
            )
        return instance_kv_quota(shape[0], shape[1], concurrency, self.config.arena_bytes)

    def _grant(self, device: str, kv_quota_bytes: int) -> str:
        """A single-use pool ticket for one instance's session (this agent is the pool's admin)."""
        from gpu_pool.client import PoolClient

        pool = self.pools[device]
        with PoolClient(pool.socket_path, timeout=5.0, admin_token=pool.admin_token) as client:
            return client.grant(kv_quota_bytes)

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

    async def stop(self, instance_id: str) -> None:
        """Drain and stop an instance (SIGTERM, SIGKILL after the drain timeout)."""
        worker = self._instances.pop(instance_id, None)
        if worker is not None:
            await self._terminate(worker)
            await self._share_cores()

    async def _share_cores(self) -> None:
        """Give each CPU instance ``cores // instances`` intra-op threads (at least one)."""
        workers = [w for w in self._instances.values() if w.proc.returncode is None]
        if not workers:
            return
        per = min(MAX_THREADS, max(1, (os.cpu_count() or 1) // len(workers)))
        for w in workers:
            with contextlib.suppress(httpx.HTTPError):
                await self._http.post(
                    f"{w.url}/_ember/threads",
                    content=ThreadsMessage(per).to_json(),
                    headers={**w.headers, **_JSON},
                    timeout=5.0,
                )

    def alive(self, instance_id: str) -> bool:
        """Whether this agent runs ``instance_id`` and its process lives."""
        worker = self._instances.get(instance_id)
        return worker is not None and worker.proc.returncode is None

    def owns(self, instance_id: str) -> bool:
        return instance_id in self._instances

    def instance_pid(self, instance_id: str) -> int | None:
        worker = self._instances.get(instance_id)
        return worker.proc.pid if worker else None

    def warm(self) -> list[tuple[int, str]]:
        """The pre-warmed workers ready now: (pid, URL) each."""
        return [(w.proc.pid, w.url) for w in self._warm]

    # ----- reports --------------------------------------------------------------------------------

    async def report(self) -> dict[str, dict[str, Any]]:
        """Read every pool's stats and publish them as device records."""
        from gpu_pool.client import PoolClient

        out: dict[str, dict[str, Any]] = {}
        for device, pool in self.pools.items():
            if not self.pool_alive(device):
                continue  # being restarted: the next report has it again

            def read(path: str = pool.socket_path) -> dict[str, Any]:
                with PoolClient(path, timeout=5.0) as client:
                    return client.stats()

            stats = await asyncio.to_thread(read)
            record = {
                "node": self.config.node,
                "device": device,
                "capacity_bytes": stats["capacity_bytes"],
                "free_bytes": stats["free_bytes"],
                "evictable_bytes": max(0, stats["resident_bytes"] - stats["pinned_bytes"]),
                "resident_bytes": stats["resident_bytes"],
                "pinned_bytes": stats["pinned_bytes"],
                "kv_bytes": stats["kv_bytes"],
                "bytes_loaded": stats["bytes_loaded"],
                "bytes_reused": stats["bytes_reused"],
                "bytes_moved": stats["bytes_moved"],
                "load_bandwidth": stats["load_bandwidth"],
                "sessions": stats["sessions"],
                "models": {m: v["resident_bytes"] for m, v in stats["models"].items()},
                "warm_workers": len(self._warm),
                **self._backoff.report(),
            }
            out[self.device_id(device)] = record
            if self._report is not None:
                await asyncio.to_thread(self._report, self.device_id(device), record)
        return out

    # ----- pre-warmed workers -----------------------------------------------------------------------

    def _spawn_in_background(self, delay_s: float = 0.0, backoff_s: float = 0.0) -> None:
        self._pending_spawns += 1
        task = asyncio.create_task(self._spawn(delay_s, backoff_s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _spawn(self, delay_s: float = 0.0, backoff_s: float = 0.0) -> None:
        """Start one pre-warmed worker after ``backoff_s`` (always waited) and ``delay_s``
        (cut short when a launch waits); a failed start is retried with backoff while fewer
        than ``prewarm`` workers are ready or starting."""
        worker: _Worker | None = None
        retry_in: float | None = None
        try:
            if backoff_s:
                await asyncio.sleep(backoff_s)
            if delay_s:  # cut short when a request is already waiting for a worker
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._urgent.wait(), delay_s)
            preloaded = set(self._templates)
            worker = await self._start_worker()
            for model_dir in sorted(self._templates - preloaded):  # deployed while it started
                resp = await self._http.post(
                    f"{worker.url}/_ember/preload",
                    content=PreloadMessage(model_dir).to_json(),
                    headers={**worker.headers, **_JSON},
                )
                if resp.status_code != 200:
                    raise LaunchError(f"the worker could not preload {model_dir}: {_error_message(resp)}")
        except Exception as exc:  # a worker that is not fully ready must not linger
            if worker is not None:
                await self._terminate(worker)
            error = f"{type(exc).__name__}: {exc}"
            self.spawn_errors = [*self.spawn_errors[-7:], error]
            retry_in = self._backoff.failed(error)
            self._warm_ready.set()  # a waiting launch re-checks, and fails fast while backing off
        finally:
            self._pending_spawns -= 1
        if retry_in is not None:
            if len(self._warm) + self._pending_spawns < self.config.prewarm:
                self._spawn_in_background(backoff_s=retry_in)
            return
        assert worker is not None
        self._backoff.succeeded()
        self._warm.append(worker)
        self._warm_ready.set()

    async def _start_worker(self) -> _Worker:
        log_path = self.log_dir / "workers" / f"worker-{time.time_ns()}.log"
        args = [sys.executable, "-m", "runtime", "--parent-pid", str(os.getpid())]
        for model_dir in sorted(self._templates):
            args += ["--preload", model_dir]
        for pool in self.pools.values():
            args += ["--premap", pool.socket_path]
        args += ["--max-body-bytes", str(self.config.worker_max_body_bytes), *self.config.limits.args()]
        env = worker_environment(os.environ)  # function code inherits no secret
        env["EMBER_HOME"] = str(self.config.home)  # handlers load from (and are confined to) its functions/
        if self.config.sandbox.enabled:
            args += ["--sandbox-home", str(self.config.home)]
            if self.config.sandbox.required:
                args.append("--require-sandbox")
            # Temporary files go where the sandboxed worker can read them back (not /tmp).
            env["TMPDIR"] = str(temp_dir(self.config.home))
        token = new_token()
        with open(log_path, "ab") as log:
            proc = await asyncio.create_subprocess_exec(
                *args,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                stdin=asyncio.subprocess.PIPE,
                env=env,
            )  # no preexec_fn (it would fork this whole process): the worker arms --parent-pid itself
        assert proc.stdout is not None and proc.stdin is not None
        self._spawning[proc.pid] = proc
        try:
            with contextlib.suppress(OSError):  # a worker that died at once: reported below
                proc.stdin.write(f"{token}\n".encode())  # not argv/env: /proc shows those
                await proc.stdin.drain()
                proc.stdin.close()
            line = await asyncio.wait_for(proc.stdout.readline(), self.config.worker_start_timeout_s)
        except TimeoutError:
            line = b""
        finally:
            del self._spawning[proc.pid]
        if not line:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            tail = log_path.read_text(errors="replace")[-2000:]
            raise LaunchError(f"a pre-warmed worker failed to start: {tail.strip()}")
        ready = json.loads(line)
        return _Worker(proc, str(ready["url"]), log_path, token)

    async def _take_warm(self) -> _Worker:
        deadline = time.monotonic() + self.config.worker_start_timeout_s
        while True:
            while self._warm:
                worker = self._warm.pop(0)
                if worker.proc.returncode is None:
                    self._urgent.clear()
                    return worker
            self._urgent.set()
            backoff = self._backoff
            # Starts keep failing (not a one-off) and none is under way: say so now, not at the deadline.
            if backoff.failures >= 2 and backoff.remaining_s() > 0 and not self._spawning:
                raise LaunchError(
                    f"pre-warmed workers keep failing to start ({backoff.failures} in a row, next try "
                    f"in {backoff.remaining_s():.1f} s): {backoff.last_error}"
                )
            if self._pending_spawns == 0:
                self._spawn_in_background()
            for pid in list(self._spawning):  # a request waits: no more idle-priority start-up
                boost(pid)
            self._warm_ready.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                errors = "; ".join(self.spawn_errors[-2:])
                raise LaunchError(f"no pre-warmed worker became ready in time {errors}".strip())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._warm_ready.wait(), min(left, 1.0))

    async def _terminate(self, worker: _Worker) -> None:
        if worker.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                worker.proc.terminate()
            try:
                await asyncio.wait_for(worker.proc.wait(), self.config.drain_timeout_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.kill()
                await worker.proc.wait()

    # ----- pool supervision -----------------------------------------------------------------------

    def pool_alive(self, device: str) -> bool:
        """Whether ``device``'s pool daemon serves (false from its death until its restart)."""
        pool = self.pools.get(device)
        up = self._pool_up.get(device)
        return pool is not None and pool.alive() and (up is None or up.is_set())

    def pools_alive(self) -> bool:
        """Whether every pool daemon of this node serves."""
        return bool(self.pools) and all(self.pool_alive(d) for d in self.pools)

    def warm_ready(self) -> bool:
        """Whether a pre-warmed worker is ready to take a function (always true with prewarm 0)."""
        return self.config.prewarm == 0 or any(w.proc.returncode is None for w in self._warm)

    def _supervise_pools(self) -> None:
        for device in self.pools:
            self._pool_up[device] = asyncio.Event()
            self._pool_up[device].set()
            child = _PoolChild(f"pool daemon ({device})", self, device)
            task = asyncio.create_task(supervise(child, self.config.restart))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _wait_for_pool(self, device: str, deadline: float) -> None:
        """Return once ``device``'s pool serves; LaunchError if it is not back by ``deadline``."""
        up = self._pool_up.get(device)
        if up is None or up.is_set():
            return
        try:
            await asyncio.wait_for(up.wait(), max(0.0, deadline - time.time()))
        except TimeoutError:
            raise LaunchError(f"the pool daemon for {device} did not come back in time") from None

    async def _pool_died(self, device: str) -> None:
        """Fail the instances on ``device`` fast and mark the workers that mapped its arena."""
        self._pool_up[device].clear()
        victims = [w for w in self._instances.values() if w.device == device]
        for worker in victims:  # SIGKILL: its session and KV blocks are gone, nothing to drain
            with contextlib.suppress(ProcessLookupError):
                worker.proc.kill()
        # Every pre-warmed worker maps every pool's arena at start (--premap): they still work
        # (a new arena is mapped at assign) but hold the dead one's memory. Replaced after the
        # restart; until then a launch may still take one. One still starting may or may not
        # have mapped it: treated as stale too.
        self._stale.update(w.proc.pid for w in self._warm)
        self._stale.update(self._spawning)
        if victims:  # reaped here so that alive() turns false at once (bounded: never hang)
            await asyncio.wait([asyncio.ensure_future(w.proc.wait()) for w in victims], timeout=5.0)

    async def _restart_pool(self, device: str) -> None:
        """Start ``device``'s pool daemon again on the same socket, then replace stale workers."""
        await asyncio.to_thread(self.pools[device].stop)  # reap it, close its pipes and log
        self.pools[device] = await self._spawner.run(lambda: self._new_pool(device))
        self._pool_up[device].set()
        task = asyncio.create_task(self._replace_stale())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _replace_stale(self) -> None:
        """Replace stale pre-warmed workers one at a time: start a fresh one when no start is
        under way, terminate a stale one once the pool holds more than ``prewarm`` (so a launch
        always finds a worker, and replacements never compete with each other for cores). Also
        tops the pool up to ``prewarm``: workers that started while the pool was down failed."""
        deadline = time.monotonic() + self.config.worker_start_timeout_s
        while time.monotonic() < deadline:
            stale = [w for w in self._warm if w.proc.pid in self._stale]
            short = len(self._warm) + self._pending_spawns < self.config.prewarm
            if not stale and not self._stale & set(self._spawning) and not short:
                break
            if stale and len(self._warm) > self.config.prewarm:
                self._warm.remove(stale[0])
                await self._terminate(stale[0])
                deadline = time.monotonic() + self.config.worker_start_timeout_s
                continue
            if (stale and self._pending_spawns == 0) or short:  # short: starts failed while it was down
                self._spawn_in_background()
            await asyncio.sleep(0.2)
        self._stale &= {w.proc.pid for w in self._warm} | set(self._spawning)


@dataclass
class _PoolChild:
    """One pool daemon as a :class:`runtime.supervisor.Child`."""

    name: str
    agent: NodeAgent
    device: str

    def alive(self) -> bool:
        return bool(self.agent.pools[self.device].alive())

    async def on_death(self) -> None:
        await self.agent._pool_died(self.device)

    async def restart(self) -> None:
        await self.agent._restart_pool(self.device)


def _error_message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {resp.status_code}: {resp.text[:200]}"
