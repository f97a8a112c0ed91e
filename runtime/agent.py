"""The node agent: pool daemons, the pre-warmed worker pool, instance start/stop, residency reports.

One agent per node. It runs one pool daemon per device (``cpu`` always) and keeps
``prewarm`` worker processes ready (torch and the runtime imported, HTTP listening, model
templates loaded: TIDAL's process pool). Starting an instance hands a pre-warmed worker its
function (``/_ember/assign``) and starts a replacement in the background, so no cold start
pays for a process start or an import. Stopping an instance sends SIGTERM: the worker
drains, releases its tensors (they stay resident) and exits. Pool stats are reported
through ``report`` (the scheduler's device record). The agent satisfies
:class:`scheduler.launcher.BaseLauncher` structurally; it imports nothing from the scheduler.

Each worker gets its own credential (:mod:`runtime.supervision`: over stdin, with an
environment stripped of secrets); the agent sends it on ``/_ember/*`` and returns it in
:class:`InstanceStart` so the gateway can reach the instance. A pre-warmed worker found dead
when a function is handed to it (its port refuses the connection: nothing was delivered) is
discarded and another one taken. Workers that keep failing to start are retried with capped
exponential backoff, shown in the device report (``worker_failures``, ``backoff_s``,
``last_worker_error``); after two failures in a row a launch fails at once with the last
error while the next try waits.
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
from runtime.process import boost, die_with_parent
from runtime.supervision import BackoffConfig, SpawnBackoff, new_token, worker_environment
from runtime.worker_guard import DEFAULT_MAX_BODY_BYTES, TOKEN_HEADER


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

    # ----- lifecycle ----------------------------------------------------------------------------

    def device_id(self, device: str) -> str:
        return f"{self.config.node}/{device}"

    def devices(self) -> list[str]:
        """Device ids this agent launches on (``node/cpu``; CUDA pools join when present)."""
        return [self.device_id(d) for d in self.pools]

    async def start(self) -> None:
        """Start the CPU pool and the pre-warmed workers (returns once the pool serves)."""
        from gpu_pool.spawn import PoolProcess
        from runtime.registry import models_dir

        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.log_dir / "workers").mkdir(parents=True, exist_ok=True)
        # The pool loads tensors only from store entries under its trusted roots: the models
        # this agent registers (ensure_model) all live here.
        store_root = models_dir(self.config.home)
        store_root.mkdir(parents=True, exist_ok=True)
        socket_path = str(self.run_dir / "pool-cpu.sock")
        env = {"EMBER_POOL_PREFAULT": "true" if self.config.pool_prefault else "false"}
        # Spawned from the event loop's thread (it lives as long as we do): see die_with_parent.
        log = str(self.log_dir / "pool-cpu.log")
        self.pools["cpu"] = PoolProcess(
            socket_path,
            self.config.arena_bytes,
            "cpu",
            (),
            env,
            die_with_parent(),
            log_path=log,
            store_roots=(store_root,),
        )
        for _ in range(self.config.prewarm):
            self._spawn_in_background()

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
                        f"{w.url}/_ember/preload", json={"model_dir": model_dir}, headers=w.headers
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
        if model["dir"] not in self._templates:
            self._templates.add(model["dir"])
        body = {
            "instance_id": instance_id,
            "spec": spec,
            "model_dir": model["dir"],
            "pool_socket": self.pools[device].socket_path,
            "deadline": deadline,
        }
        for attempt in range(self.config.prewarm + 1):
            worker = await self._take_warm()
            self._spawn_in_background(self.config.replenish_delay_s)  # replenish while this one serves
            try:
                url = f"{worker.url}/_ember/assign"
                resp = await self._http.post(url, json=body, headers=worker.headers)
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
        self._instances[instance_id] = worker
        await self._share_cores()
        data = resp.json()
        acquired = data["acquire"]
        return InstanceStart(
            worker.url, worker.proc.pid, int(acquired["bytes_loaded"]), int(acquired["bytes_reused"]),
            {k: round(float(v), 3) for k, v in data["timings_ms"].items()}, str(log_path), worker.token,
        )  # fmt: skip

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
        per = max(1, (os.cpu_count() or 1) // len(workers))
        for w in workers:
            with contextlib.suppress(httpx.HTTPError):
                await self._http.post(
                    f"{w.url}/_ember/threads", json={"num_threads": per}, headers=w.headers, timeout=5.0
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
                    f"{worker.url}/_ember/preload", json={"model_dir": model_dir}, headers=worker.headers
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
        args += ["--max-body-bytes", str(self.config.worker_max_body_bytes)]
        token = new_token()
        with open(log_path, "ab") as log:
            proc = await asyncio.create_subprocess_exec(
                *args,
                stdout=asyncio.subprocess.PIPE,
                stderr=log,
                stdin=asyncio.subprocess.PIPE,
                env=worker_environment(os.environ),  # function code inherits no secret
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


def _error_message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {resp.status_code}: {resp.text[:200]}"
