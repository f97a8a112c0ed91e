"""``ember gateway``: the cluster mode's gateway and scheduler routes, one process per replica.

No pools, workers or embedded Redis: the cluster state is an external Redis
(``EMBER_REDIS_URL``, required; ``EMBER_REDIS_PASSWORD`` joined into it), each function is a
Knative Service (:mod:`scheduler.knative`: settings from ``EMBER_KNATIVE_*`` and
``EMBER_IMAGE``), and invocations are forwarded to the Service's cluster-local URL with the
function's worker token, derived from ``EMBER_CLUSTER_SECRET``. Models named by deploys are
registered into this process's model store (``EMBER_HOME``), which gives the model id and
weight bytes the Services' annotations carry. A non-loopback address needs ``EMBER_API_KEY``
(none is generated: a key printed into a pod's log would be read by whoever reads logs), and
the key is neither printed nor written to ``serve.json``. The components are built in
:func:`gateway.compose.build_cluster`; this module owns the process around them.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.redis_auth import PASSWORD_ENV, with_password
from scheduler.extender.service import ExtenderConfig
from scheduler.knative.config import KnativeConfig
from scheduler.knative.tokens import SECRET_ENV, WorkerTokens

SECRETS = ("EMBER_API_KEY", "EMBER_REDIS_PASSWORD", "EMBER_REDIS_URL", SECRET_ENV)  # hidden once read


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


@dataclass(frozen=True, slots=True)
class ClusterGatewayConfig:
    home: Path
    redis_url: str = field(repr=False)  # may carry the password
    tokens: WorkerTokens
    knative: KnativeConfig = field(default_factory=KnativeConfig)
    extender: ExtenderConfig = field(default_factory=ExtenderConfig)  # what /extender judges by
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = field(default=None, repr=False)
    request_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port {self.port} is out of range")
        if not self.request_timeout_s > 0:
            raise ValueError("EMBER_REQUEST_TIMEOUT must be > 0")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("EMBER_REDIS_URL must be a redis://, rediss:// or unix:// URL")
        if self.api_key is None and not _loopback(self.host):
            raise ValueError(f"ember gateway on {self.host} needs EMBER_API_KEY (an address beyond loopback)")

    @classmethod
    def from_env(cls, **overrides: Any) -> ClusterGatewayConfig:
        """``EMBER_HOME``, ``EMBER_HOST``, ``EMBER_PORT``, ``EMBER_REDIS_URL`` (required),
        ``EMBER_REDIS_PASSWORD``, ``EMBER_API_KEY``, ``EMBER_REQUEST_TIMEOUT``,
        ``EMBER_CLUSTER_SECRET`` (required), the Knative settings and the extender's
        (``EMBER_EXTENDER_*``, as ``ember extender`` reads them); then non-None overrides.
        ValueError names the first bad or missing variable."""
        from runtime.registry import ember_home

        env = os.environ
        values: dict[str, Any] = {"home": ember_home()}
        if env.get("EMBER_HOST"):
            values["host"] = env["EMBER_HOST"]
        values["port"] = _env_int("EMBER_PORT", 8080)
        values["api_key"] = env.get("EMBER_API_KEY") or None
        if env.get("EMBER_REQUEST_TIMEOUT"):
            try:
                values["request_timeout_s"] = float(env["EMBER_REQUEST_TIMEOUT"])
            except ValueError:
                raise ValueError(
                    f"EMBER_REQUEST_TIMEOUT={env['EMBER_REQUEST_TIMEOUT']!r} is not a number"
                ) from None
        values["redis_url"] = env.get("EMBER_REDIS_URL") or None
        values.update({k: v for k, v in overrides.items() if v is not None})
        if values["redis_url"] is None:
            raise ValueError("ember gateway needs an external Redis: set EMBER_REDIS_URL (or --redis)")
        values["redis_url"] = with_password(values["redis_url"], env.get(PASSWORD_ENV))
        values["tokens"] = WorkerTokens.from_env()
        values["knative"] = KnativeConfig.from_env()
        values["extender"] = ExtenderConfig.from_env()
        return cls(**values)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


async def run(config: ClusterGatewayConfig) -> None:
    """Serve until SIGINT/SIGTERM."""
    from gateway.compose import build_cluster
    from gateway.serve import listen

    os.umask(0o077)  # the model store and serve.json: owner-only
    config.home.mkdir(parents=True, exist_ok=True)
    node = build_cluster(config)
    try:
        await listen(config.host, config.port, config.home, node.app, node.gateway_config.limits, None)
    finally:
        (config.home / "serve.json").unlink(missing_ok=True)
        await node.close()
