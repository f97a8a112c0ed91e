"""``ember serve``: the embedded mode's process tree in one command.

It starts (or connects to) Redis, the node agent (CPU pool daemon + pre-warmed workers),
the scheduler's router and reconcile loop, and the gateway on ``host:port``. It writes
``EMBER_HOME/serve.json`` (URL and API key) so the other CLI verbs find it, and prints
one readiness line. The embedded redis-server and the pool daemons are supervised: restarted
with exponential backoff when they die (``runtime.supervisor``). Settings come from flags,
then ``EMBER_*`` variables; bad values fail loudly. A non-loopback address needs an API
key: one is generated when none is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import json
import os
import secrets
import signal
import socket
import sys
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from gateway.app import GatewayConfig, ModelSourceError, Serving, create_app
from gateway.function_code import FunctionCodeConfig
from gateway.health import Readiness
from gateway.http_server import server_config
from gateway.limits import EdgeLimits
from gateway.metrics import Metrics
from gateway.proxy import Invoker, ProxyConfig
from gateway.redis_auth import PASSWORD_ENV, with_password


class ServeError(RuntimeError):
    """``ember serve`` cannot start (the message says why)."""


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


@dataclass(frozen=True, slots=True)
class ServeConfig:
    home: Path
    host: str = "127.0.0.1"
    port: int = 8080
    redis_url: str | None = None  # None: start an embedded Redis under home/redis
    api_key: str | None = None
    arena_bytes: int = 2 << 30
    prewarm: int = 2
    request_timeout_s: float = 300.0
    node: str = field(default_factory=socket.gethostname)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} is out of range")
        if self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0")

    @property
    def loopback(self) -> bool:
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"

    @classmethod
    def from_env(cls, **overrides: Any) -> ServeConfig:
        """``EMBER_HOME``, ``EMBER_HOST``, ``EMBER_PORT``, ``EMBER_REDIS_URL``, ``EMBER_API_KEY``,
        ``EMBER_ARENA``, ``EMBER_PREWARM``, ``EMBER_REQUEST_TIMEOUT``; then non-None overrides;
        ``EMBER_REDIS_PASSWORD`` joined into the Redis URL; ``EMBER_MODEL_ROOTS`` and
        ``EMBER_HANDLER_ROOTS`` checked."""
        from gpu_pool.config import parse_size
        from runtime.registry import ember_home
        from runtime.sandbox import SandboxConfig
        from runtime.sources import SourceRoots
        from runtime.worker_limits import WorkerLimits

        env = os.environ
        values: dict[str, Any] = {"home": ember_home()}
        if "EMBER_HOST" in env:
            values["host"] = env["EMBER_HOST"]
        values["port"] = _env_int("EMBER_PORT", 8080)
        values["redis_url"] = env.get("EMBER_REDIS_URL") or None
        values["api_key"] = env.get("EMBER_API_KEY") or None
        if "EMBER_ARENA" in env:
            values["arena_bytes"] = parse_size(env["EMBER_ARENA"], "EMBER_ARENA")
        values["prewarm"] = _env_int("EMBER_PREWARM", 2)
        if "EMBER_REQUEST_TIMEOUT" in env:
            values["request_timeout_s"] = float(env["EMBER_REQUEST_TIMEOUT"])
        values.update({k: v for k, v in overrides.items() if v is not None})
        values["redis_url"] = with_password(values.get("redis_url"), env.get(PASSWORD_ENV))
        FunctionCodeConfig.from_env(values["home"])  # fail loudly on bad EMBER_HANDLER_ROOTS ...
        SourceRoots.from_env()  # ... or EMBER_MODEL_ROOTS
        SandboxConfig.from_env()  # ... or EMBER_WORKER_SANDBOX / EMBER_REQUIRE_SANDBOX
        WorkerLimits.from_env()  # ... or EMBER_WORKER_MAX_OPEN_FILES / _MAX_DATA / _DROP_CAPS
        return cls(**values)


async def serve(config: ServeConfig) -> None:
    """Run the embedded mode until SIGINT/SIGTERM."""
    os.umask(0o077)  # every file this process and its children create is owner-only (keys, logs, AOF)
    from runtime.agent import AgentConfig, NodeAgent
    from runtime.errors import EmberRuntimeError
    from runtime.process import die_with_parent
    from runtime.sandbox import SandboxConfig
    from runtime.supervisor import RestartConfig, SpawnThread, ThreadRestarted, supervise
    from runtime.worker_limits import WorkerLimits
    from scheduler.redis_server import EmbeddedRedis
    from scheduler.router import Router
    from scheduler.state import ClusterState

    api_key = config.api_key
    if api_key is None and not config.loopback:
        api_key = secrets.token_urlsafe(24)
    gateway_config = GatewayConfig(
        api_key=api_key,
        logs_dir=config.home / "logs",
        code=FunctionCodeConfig.from_env(config.home),
        limits=EdgeLimits.from_env(),
    )
    config.home.mkdir(parents=True, exist_ok=True)
    # One `ember serve` per EMBER_HOME: a second would forget the first one's instances and
    # take over its Redis socket. The lock goes away with this process, however it ends.
    lock = open(config.home / "serve.lock", "a")  # noqa: SIM115  (held for the process's life)
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ServeError(f"another `ember serve` is running with EMBER_HOME={config.home}") from None
    restart = RestartConfig.from_env()
    spawner = SpawnThread("ember-redis-spawn")  # restarts fork from here: see die_with_parent
    background: list[Any] = []
    redis_server = None
    if config.redis_url is None:
        redis_server = EmbeddedRedis(config.home / "redis", preexec_fn=die_with_parent())
        redis_server.start()  # from this (long-lived) thread: see die_with_parent
        child = ThreadRestarted("redis-server", redis_server, spawner)
        background.append(lambda: supervise(child, restart))
    state = ClusterState.from_url(config.redis_url or redis_server.url)  # type: ignore[union-attr]
    agent = NodeAgent(
        AgentConfig(
            home=config.home,
            arena_bytes=config.arena_bytes,
            prewarm=config.prewarm,
            node=config.node,
            restart=restart,
            sandbox=SandboxConfig.from_env(),
            limits=WorkerLimits.from_env(),
        ),
        report=state.report_device,
    )
    metrics = Metrics(devices=state.devices)
    router = Router(
        state,
        agent,
        on_start=lambda name, s: metrics.instance_started(
            name, s.bytes_loaded, s.bytes_reused, s.timings_ms.get("assign_ms", 0.0) / 1e3
        ),
    )
    invoker = Invoker(state, router, metrics, ProxyConfig(request_timeout_s=config.request_timeout_s))

    async def register(source: str, dtype: str) -> dict[str, Any]:
        print(f"ember serve: registering {source} ({dtype})", file=sys.stderr, flush=True)
        try:
            model = await agent.ensure_model(source, dtype, progress=True)
        except (EmberRuntimeError, ValueError, OSError) as exc:
            raise ModelSourceError(f"spec.model.source: {exc}") from None
        print(f"ember serve: model {model['id']} ready", file=sys.stderr, flush=True)
        return model

    server: uvicorn.Server | None = None
    try:
        await asyncio.to_thread(_forget_stale_instances, state, [agent.device_id("cpu")])
        for record in await asyncio.to_thread(lambda: list(state.functions().values())):
            if record.model is not None:
                agent.adopt_template(record.model.dir)
        await agent.start()
        readiness = Readiness(state.r.ping, agent.pools_alive, agent.warm_ready)
        serving = Serving(
            register, router, invoker, metrics, [router.run, *background], readiness, agent.evict
        )
        app = create_app(state, gateway_config, serving)
        # IPPROTO_TCP, not 0: only then does asyncio set TCP_NODELAY on accepted connections;
        # without it every response's second write waits ~40 ms for a delayed ACK (Nagle).
        family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((config.host, config.port))
        host = f"[{config.host}]" if ":" in config.host else config.host
        url = f"http://{host}:{sock.getsockname()[1]}"
        server = _Server(
            server_config(
                app, gateway_config.limits, log_level="warning", lifespan="on", timeout_graceful_shutdown=10
            )
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # stop the server, then clean up below
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                await task
                return
            await asyncio.sleep(0.01)
        info = {
            "event": "ready",
            "url": url,
            "api_key": api_key,
            "home": str(config.home),
            "pid": os.getpid(),
        }
        _write_serve_file(config.home, info)
        print(json.dumps(info), flush=True)
        await task
    finally:
        (config.home / "serve.json").unlink(missing_ok=True)
        await router.close()
        await invoker.close()
        await agent.close()
        state.close()
        if redis_server is not None:
            await asyncio.to_thread(redis_server.stop)
        await asyncio.to_thread(spawner.close)
        lock.close()  # last: the next `ember serve` may start once everything above is down


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: it would re-raise SIGTERM after shutdown and
    kill this process before the agent, the pools and Redis are stopped."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _forget_stale_instances(state: Any, devices: list[str]) -> None:
    """A fresh agent runs nothing: instance records on its devices are from a previous run."""
    for name in state.functions_with_instances():
        for inst in state.instances(name):
            if inst.device in devices:
                state.forget_instance(name, inst.instance_id)


def _write_serve_file(home: Path, info: dict[str, Any]) -> None:
    path = home / "serve.json"
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it may hold the API key
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)
