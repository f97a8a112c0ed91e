"""``ember serve``: the embedded mode's process tree in one command.

It starts (or connects to) Redis, the node agent (CPU pool daemon + pre-warmed workers),
the scheduler's router and reconcile loop, and the gateway on ``host:port``. It writes
``EMBER_HOME/serve.json`` (URL and API key) so the other CLI verbs find it, and prints
one readiness line. The embedded redis-server and the pool daemons are supervised: restarted
with exponential backoff when they die (``runtime.supervisor``). Settings come from flags,
then ``EMBER_*`` variables; bad values fail loudly. A non-loopback address needs an API
key: one is generated when none is given. The components themselves are built and wired in
:mod:`gateway.compose`; this module owns the process around them.
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
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from gateway.function_code import FunctionCodeConfig
from gateway.limits import DeployLimits, EdgeLimits
from gateway.redis_auth import PASSWORD_ENV, with_password
from runtime.http_server import server_config


class ServeError(RuntimeError):
    """``ember serve`` cannot start (the message says why)."""


def _env_int(name: str, default: int) -> int:
    return int(_env_number(name, default, int))


def _env_number(name: str, default: float, kind: type[int] | type[float] = float) -> float:
    """``name`` from the environment as a ``kind`` (``default`` when unset); a clear error when
    it is not one."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not {'an integer' if kind is int else 'a number'}") from None


@dataclass(frozen=True, slots=True)
class ServeConfig:
    home: Path
    host: str = "127.0.0.1"
    port: int = 8080
    redis_url: str | None = None  # None: start an embedded Redis under home/redis
    api_key: str | None = None
    arena_bytes: int = 2 << 30
    prewarm: int = 2
    standby: int = 2  # workers prepared for functions that scaled to zero (runtime.standby_pool)
    # Instance workers kept after their pool daemon died, to serve again (runtime.survivors; 0: none).
    survivor_keep_s: float = 30.0
    request_timeout_s: float = 300.0
    node: str = field(default_factory=socket.gethostname)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} is out of range")
        if self.request_timeout_s <= 0:
            raise ValueError("request_timeout_s must be > 0")
        if not 0 <= self.standby <= 64:
            raise ValueError(f"EMBER_STANDBY must be in [0, 64], not {self.standby}")
        if not 0 <= self.survivor_keep_s <= 3600:
            raise ValueError(f"EMBER_SURVIVOR_KEEP must be in [0, 3600] seconds, not {self.survivor_keep_s}")

    @property
    def loopback(self) -> bool:
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return self.host == "localhost"

    @classmethod
    def from_env(cls, **overrides: Any) -> ServeConfig:
        """``EMBER_HOME``, ``EMBER_HOST``, ``EMBER_PORT``, ``EMBER_REDIS_URL``, ``EMBER_API_KEY``,
        ``EMBER_ARENA``, ``EMBER_PREWARM``, ``EMBER_STANDBY``, ``EMBER_SURVIVOR_KEEP`` (seconds),
        ``EMBER_REQUEST_TIMEOUT``; then
        non-None overrides; ``EMBER_REDIS_PASSWORD`` joined into the Redis URL; ``EMBER_MODEL_ROOTS``,
        ``EMBER_HANDLER_ROOTS``, the request limits and the function quota checked."""
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
        values["standby"] = _env_int("EMBER_STANDBY", 2)
        if "EMBER_REQUEST_TIMEOUT" in env:
            values["request_timeout_s"] = float(env["EMBER_REQUEST_TIMEOUT"])
        values["survivor_keep_s"] = _env_number("EMBER_SURVIVOR_KEEP", 30.0)
        values.update({k: v for k, v in overrides.items() if v is not None})
        values["redis_url"] = with_password(values.get("redis_url"), env.get(PASSWORD_ENV))
        FunctionCodeConfig.from_env(values["home"])  # fail loudly on bad EMBER_HANDLER_ROOTS ...
        SourceRoots.from_env()  # ... or EMBER_MODEL_ROOTS
        SandboxConfig.from_env()  # ... or EMBER_WORKER_SANDBOX / EMBER_REQUIRE_SANDBOX
        EdgeLimits.from_env()  # ... or request limits (workers read the header ones too)
        DeployLimits.from_env()  # ... or EMBER_MAX_FUNCTIONS_PER_NAMESPACE
        WorkerLimits.from_env()  # ... or EMBER_WORKER_MAX_OPEN_FILES / _MAX_DATA / _DROP_CAPS
        return cls(**values)


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(env: dict[str, str] | None = None) -> None:
    """Log to stderr (``serve.log`` under ``ember serve --detach`` and the test spawner) at
    ``EMBER_LOG_LEVEL`` (default ``info``: instance starts with their timings, restarts);
    ValueError on a level not in :data:`LOG_LEVELS`. httpx's per-request lines stay off."""
    import logging

    level = (os.environ if env is None else env).get("EMBER_LOG_LEVEL", "info").strip().lower()
    if level not in LOG_LEVELS:
        raise ValueError(f"EMBER_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, not {level!r}")
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    for noisy in ("httpx", "httpcore"):  # one line per proxied request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)


async def serve(config: ServeConfig) -> None:
    """Run the embedded mode until SIGINT/SIGTERM."""
    from gateway.compose import build_embedded

    os.umask(0o077)  # every file this process and its children create is owner-only (keys, logs, AOF)
    api_key = config.api_key
    if api_key is None and not config.loopback:
        api_key = secrets.token_urlsafe(24)
    config.home.mkdir(parents=True, exist_ok=True)
    # One `ember serve` per EMBER_HOME: a second would forget the first one's instances and
    # take over its Redis socket. The lock goes away with this process, however it ends.
    lock = open(config.home / "serve.lock", "a")  # noqa: SIM115  (held for the process's life)
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ServeError(f"another `ember serve` is running with EMBER_HOME={config.home}") from None
    node = None
    try:
        node = build_embedded(config, api_key)
        await node.start()
        await listen(config.host, config.port, config.home, node.app, node.gateway_config.limits, api_key)
    finally:
        (config.home / "serve.json").unlink(missing_ok=True)
        if node is not None:
            await node.close()
        lock.close()  # last: the next `ember serve` may start once everything above is down


async def listen(host: str, port: int, home: Path, app: Any, limits: EdgeLimits, api_key: str | None) -> None:
    """Serve ``app`` on ``host:port`` until a signal; ``home/serve.json`` and the ready line once
    up (``ember serve`` and ``ember gateway``)."""
    # IPPROTO_TCP, not 0: only then does asyncio set TCP_NODELAY on accepted connections;
    # without it every response's second write waits ~40 ms for a delayed ACK (Nagle).
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{sock.getsockname()[1]}"
    server = _Server(
        server_config(app, limits.headers, log_level="warning", lifespan="on", timeout_graceful_shutdown=10)
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # stop the server, then clean up in serve()
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            await task
            return
        await asyncio.sleep(0.01)
    info = {"event": "ready", "url": url, "api_key": api_key, "home": str(home), "pid": os.getpid()}
    _write_serve_file(home, info)
    print(json.dumps(info), flush=True)
    await task


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: it would re-raise SIGTERM after shutdown and
    kill this process before the agent, the pools and Redis are stopped."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _write_serve_file(home: Path, info: dict[str, Any]) -> None:
    path = home / "serve.json"
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it may hold the API key
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)
