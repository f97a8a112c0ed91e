"""The node agent's pre-warmed workers (TIDAL's process pool).

:class:`WarmPool` keeps ``prewarm`` worker processes ready: torch and the runtime imported,
HTTP listening, every pool's arena mapped (``--premap``) and the templates of the node's
models loaded (``--preload``; models registered later are preloaded over ``/_ember/preload``).
A launch :meth:`~WarmPool.take` s one and a replacement starts in the background, so no cold
start pays for a process start or an import. A worker found dead when taken is skipped.

Each worker gets its own credential over stdin and an environment stripped of secrets
(:mod:`runtime.worker_spawn`), ``TMPDIR`` under ``EMBER_HOME/tmp`` and, unless
``EMBER_WORKER_SANDBOX=off``, the confinement of :mod:`runtime.sandbox`. Starts that keep
failing are retried with capped exponential backoff (shown in the device report:
``worker_failures``, ``backoff_s``, ``last_worker_error``); after two failures in a row a
launch fails at once with the last error while the next try waits. A worker starts at
``SCHED_IDLE`` and leaves it when a launch waits for it or, when no other worker is ready,
after ``prewarm_idle_limit_s`` (a steady load would starve it for good). Workers that mapped a
pool's arena before that pool died are *stale*: :meth:`~WarmPool.replace_stale` swaps them
for fresh ones once the pool is back. At most ``parallel_starts`` processes start at once (the
pool's own starts before a standby's spare): a launch waiting for a worker gets the first one
ready sooner than if every replacement shared the cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import mmap
import os
import socket
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

from runtime.agent_config import AgentConfig
from runtime.control_line import Caller, new_pair
from runtime.errors import LaunchError
from runtime.mesh.state_page import PAGE_BYTES, new_page_fd
from runtime.messages import PreloadMessage
from runtime.process import boost
from runtime.sandbox import temp_dir
from runtime.worker_client import WorkerClient
from runtime.worker_handle import WorkerHandle
from runtime.worker_spawn import SpawnBackoff, new_token, worker_environment

MAX_SPAWN_ERRORS = 8  # start failures remembered for error messages

log = logging.getLogger("ember.agent")


class WarmPool:
    """Pre-warmed workers of one agent (see the module docstring)."""

    def __init__(
        self, config: AgentConfig, http: WorkerClient, pool_sockets: Callable[[], list[str]]
    ) -> None:
        """``pool_sockets``: the sockets of the node's pool daemons now (each worker maps them)."""
        self.config = config
        self._http = http
        self._pool_sockets = pool_sockets
        self._warm: list[WorkerHandle] = []
        self._spawning: dict[int, asyncio.subprocess.Process] = {}  # pid -> worker still starting
        self._pending_spawns = 0  # spawn tasks not finished (including before their fork)
        self._spares = 0  # workers starting for standbys (start_spare), outside the pool
        self._urgent = asyncio.Event()  # set while a launch waits for a pre-warmed worker
        self._ready = asyncio.Event()
        self._templates: set[str] = set()  # model directories every new worker preloads
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stale: set[int] = set()  # pids of pre-warmed workers that mapped a dead arena
        self._start_slots = asyncio.Semaphore(config.parallel_starts)  # processes starting at once
        self.backoff = SpawnBackoff(config.backoff)
        self.spawn_errors: list[str] = []  # the last few start failures (bounded)

    # ----- templates ------------------------------------------------------------------------------

    def adopt(self, model_dir: str) -> bool:
        """Have workers started from now on preload ``model_dir``; whether it is new."""
        if model_dir in self._templates:
            return False
        self._templates.add(model_dir)
        return True

    async def preload_idle(self, model_dir: str) -> None:
        """Ask the workers ready now to preload ``model_dir`` (best effort: one that cannot is
        still a worker, it loads the template when assigned)."""
        for worker in list(self._warm):
            with contextlib.suppress(LaunchError):  # WorkerUnreachable, WorkerCallFailed
                await self._http.post(worker, "preload", PreloadMessage(model_dir).to_json())

    # ----- state ----------------------------------------------------------------------------------

    def ready(self) -> list[WorkerHandle]:
        """The pre-warmed workers ready now."""
        return list(self._warm)

    def idle_pids(self) -> list[int]:
        """Processes of the workers ready or starting (SCHED_IDLE while they pre-warm)."""
        return [w.pid for w in self._warm] + list(self._spawning)

    def any_ready(self) -> bool:
        """Whether one is ready to take a function (always true with prewarm 0)."""
        return self.config.prewarm == 0 or any(w.running for w in self._warm)

    def report(self) -> dict[str, Any]:
        """The device report's view of the pool: ready workers, starts under way (or waiting
        for their delay) and failing starts."""
        starting = self._pending_spawns + self._spares
        return {"warm_workers": len(self._warm), "starting_workers": starting, **self.backoff.report()}

    # ----- starting -------------------------------------------------------------------------------

    def fill(self) -> None:
        """Start ``prewarm`` workers in the background."""
        for _ in range(self.config.prewarm):
            self.spawn_in_background()

    def spawn_in_background(self, delay_s: float = 0.0, backoff_s: float = 0.0) -> None:
        self._pending_spawns += 1
        self._background(self._spawn(delay_s, backoff_s))

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _spawn(self, delay_s: float = 0.0, backoff_s: float = 0.0) -> None:
        """Start one pre-warmed worker after ``backoff_s`` (always waited) and ``delay_s``
        (cut short when a launch waits); a failed start is retried with backoff while fewer
        than ``prewarm`` workers are ready or starting."""
        worker: WorkerHandle | None = None
        retry_in: float | None = None
        try:
            if backoff_s:
                await asyncio.sleep(backoff_s)
            if delay_s:  # cut short when a request is already waiting for a worker
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._urgent.wait(), delay_s)
            async with self._start_slots:
                preloaded = set(self._templates)
                worker = await self._start_worker()
            for model_dir in sorted(self._templates - preloaded):  # deployed while it started
                resp = await self._http.post(worker, "preload", PreloadMessage(model_dir).to_json())
                if resp.status != 200:
                    raise LaunchError(f"the worker could not preload {model_dir}: {resp.error_message()}")
        except BaseException as exc:  # a worker that is not fully ready must not linger
            if worker is not None:
                await worker.terminate(self.config.drain_timeout_s)
            if not isinstance(exc, Exception):  # cancelled (the agent closes)
                raise
            error = f"{type(exc).__name__}: {exc}"
            self.spawn_errors = [*self.spawn_errors[-(MAX_SPAWN_ERRORS - 1) :], error]
            retry_in = self.backoff.failed(error)
            self._ready.set()  # a waiting launch re-checks, and fails fast while backing off
        finally:
            self._pending_spawns -= 1
        if retry_in is not None:
            if len(self._warm) + self._pending_spawns < self.config.prewarm:
                self.spawn_in_background(backoff_s=retry_in)
            return
        assert worker is not None
        self.backoff.succeeded()
        log.info("pre-warmed worker %d ready (%d ready now)", worker.pid, len(self._warm) + 1)
        self._warm.append(worker)
        self._ready.set()

    async def _start_worker(self) -> WorkerHandle:
        config = self.config
        log_path = config.log_dir / "workers" / f"worker-{time.time_ns()}.log"
        args = [sys.executable, "-m", "runtime", "--parent-pid", str(os.getpid())]
        for model_dir in sorted(self._templates):
            args += ["--preload", model_dir]
        for socket_path in self._pool_sockets():
            args += ["--premap", socket_path]
        args += ["--max-body-bytes", str(config.worker_max_body_bytes), *config.limits.args()]
        if config.survivor_keep_s > 0:  # the agent reuses it after a pool death (runtime.survivors)
            args.append("--survive-pool-loss")
        env = worker_environment(os.environ)  # function code inherits no secret
        env["EMBER_HOME"] = str(config.home)  # handlers load from (and are confined to) its functions/
        if config.sandbox.enabled:
            args += ["--sandbox-home", str(config.home)]
            if config.sandbox.required:
                args.append("--require-sandbox")
            # Temporary files go where the sandboxed worker can read them back (not /tmp).
            env["TMPDIR"] = str(temp_dir(config.home))
        token = new_token()
        # The worker's line to the token scheduler (runtime.mesh), used once it is a CPU instance
        # of an agent that schedules tokens: a socketpair, so nobody else can speak on it.
        mesh, mesh_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # ... and the page where it publishes its requests for the agent's admissions.
        page_fd = new_page_fd()
        page = mmap.mmap(page_fd, PAGE_BYTES, prot=mmap.PROT_READ)
        args += ["--mesh-fd", str(mesh_child.fileno()), "--mesh-page-fd", str(page_fd)]
        # ... and its control line, for the assign (runtime.control_line).
        control, control_child = new_pair()
        args += ["--control-fd", str(control_child.fileno())]
        try:
            with open(log_path, "ab") as log:
                proc = await asyncio.create_subprocess_exec(
                    *args,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=log,
                    stdin=asyncio.subprocess.PIPE,
                    env=env,
                    pass_fds=(mesh_child.fileno(), page_fd, control_child.fileno()),
                )  # no preexec_fn (it would fork this whole process): the worker arms --parent-pid itself
        except BaseException:
            mesh.close()
            page.close()
            control.close()
            raise
        finally:
            mesh_child.close()
            control_child.close()
            os.close(page_fd)
        assert proc.stdout is not None and proc.stdin is not None
        self._spawning[proc.pid] = proc
        aging = asyncio.create_task(self._age(proc.pid))
        try:
            with contextlib.suppress(OSError):  # a worker that died at once: reported below
                proc.stdin.write(f"{token}\n".encode())  # not argv/env: /proc shows those
                await proc.stdin.drain()
                proc.stdin.close()
            line = await asyncio.wait_for(proc.stdout.readline(), config.worker_start_timeout_s)
        except TimeoutError:
            line = b""
        except BaseException:  # cancelled (a standby's start, when the agent closes): not left running
            mesh.close()
            page.close()
            control.close()
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            raise
        finally:
            aging.cancel()
            del self._spawning[proc.pid]
        if not line:
            mesh.close()
            page.close()
            control.close()
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            tail = log_path.read_text(errors="replace")[-2000:]
            raise LaunchError(f"a pre-warmed worker failed to start: {tail.strip()}")
        try:
            url = str(json.loads(line)["url"])
        except (ValueError, KeyError, TypeError) as exc:
            mesh.close()
            page.close()
            control.close()
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            raise LaunchError(f"a pre-warmed worker sent a malformed ready line: {exc}") from None
        return WorkerHandle(
            proc, url, log_path, token, mesh_sock=mesh, mesh_page=page, control=Caller(control)
        )

    async def _age(self, pid: int) -> None:
        """A worker still starting after ``prewarm_idle_limit_s`` leaves SCHED_IDLE (see config)
        while no other is ready: with one ready the next cold start does not need this one, and
        boosted it would take seconds of the cores from the instances serving (a batch-1 stream
        fell from ~120 to ~50 tok/s while one did). Checked every period until it is ready:
        threads it starts later begin idle-class."""
        boosted = False
        while True:
            await asyncio.sleep(self.config.prewarm_idle_limit_s)
            if pid not in self._spawning:
                return
            if self.any_ready():
                continue
            if not boosted:
                log.info("pre-warmed worker %d still starting, none ready: it competes for the cores", pid)
                boosted = True
            boost(pid)

    # ----- taking ---------------------------------------------------------------------------------

    async def take(self) -> WorkerHandle:
        """A live pre-warmed worker (waiting for one to start if none is ready); LaunchError
        when none becomes ready within the start timeout or starts keep failing."""
        deadline = time.monotonic() + self.config.worker_start_timeout_s
        while True:
            while self._warm:
                worker = self._warm.pop(0)
                if not worker.running:  # died while it waited: forgotten
                    worker.close_lines()
                    continue
                self._urgent.clear()
                stale = " (stale: mapped a dead pool's arena)" if worker.pid in self._stale else ""
                log.info("took pre-warmed worker %d%s; %d left", worker.pid, stale, len(self._warm))
                return worker
            if not self._urgent.is_set():
                log.info("a launch waits for a pre-warmed worker (%d starting)", self._pending_spawns)
            self._urgent.set()
            backoff = self.backoff
            # Starts keep failing (not a one-off) and none is under way: say so now, not at the deadline.
            if backoff.failures >= 2 and backoff.remaining_s() > 0 and not self._spawning:
                raise LaunchError(
                    f"pre-warmed workers keep failing to start ({backoff.failures} in a row, next try "
                    f"in {backoff.remaining_s():.1f} s): {backoff.last_error}"
                )
            if self._pending_spawns == 0:
                self.spawn_in_background()
            for pid in list(self._spawning):  # a request waits: no more idle-priority start-up
                boost(pid)
            self._ready.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                errors = "; ".join(self.spawn_errors[-2:])
                raise LaunchError(f"no pre-warmed worker became ready in time {errors}".strip())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), min(left, 1.0))

    async def start_spare(self) -> WorkerHandle:
        """A fresh worker outside the pool, for a standby: the ready ones stay for launches (one
        taken would make the next cold start of another function wait for a process start).
        :class:`LaunchError` when it fails to start."""
        self._spares += 1
        try:
            while self._pending_spawns:  # the pool's own starts first: launches wait for those
                await asyncio.sleep(0.2)
            async with self._start_slots:
                return await self._start_worker()
        finally:
            self._spares -= 1

    def put_back(self, worker: WorkerHandle) -> None:
        """Return an unused worker: the next launch takes it first."""
        self._warm.insert(0, worker)

    # ----- stale workers (a pool daemon died) -----------------------------------------------------

    def mark_stale(self) -> None:
        """Every pre-warmed worker maps every pool's arena at start (``--premap``): after a pool
        died they still work (a new arena is mapped at assign) but hold the dead one's memory.
        Replaced after the restart; until then a launch may still take one. One still starting
        may or may not have mapped it: treated as stale too."""
        self._stale.update(w.pid for w in self._warm)
        self._stale.update(self._spawning)

    def replace_stale_in_background(self) -> None:
        self._background(self.replace_stale())

    async def replace_stale(self) -> None:
        """Replace stale pre-warmed workers one at a time: start a fresh one when no start is
        under way, terminate a stale one once the pool holds more than ``prewarm`` (so a launch
        always finds a worker, and replacements never compete with each other for cores). Also
        tops the pool up to ``prewarm``: workers that started while the pool was down failed."""
        prewarm = self.config.prewarm
        deadline = time.monotonic() + self.config.worker_start_timeout_s
        while time.monotonic() < deadline:
            stale = [w for w in self._warm if w.pid in self._stale]
            short = len(self._warm) + self._pending_spawns < prewarm
            if not stale and not self._stale & set(self._spawning) and not short:
                break
            if stale and len(self._warm) > prewarm:
                log.info("replacing stale pre-warmed worker %d", stale[0].pid)
                self._warm.remove(stale[0])
                await stale[0].terminate(self.config.drain_timeout_s)
                deadline = time.monotonic() + self.config.worker_start_timeout_s
                continue
            if (stale and self._pending_spawns == 0) or short:  # short: starts failed while it was down
                self.spawn_in_background()
            await asyncio.sleep(0.2)
        self._stale &= {w.pid for w in self._warm} | set(self._spawning)

    # ----- shutdown -------------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop the background starts (ending the processes they started) and every worker."""
        starting = list(self._spawning.values())
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for proc in starting:  # a cancelled start leaves its process: end it
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        workers, self._warm = self._warm, []
        await asyncio.gather(
            *(w.terminate(self.config.drain_timeout_s) for w in workers), return_exceptions=True
        )
