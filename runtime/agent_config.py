"""The node agent's configuration (:class:`runtime.agent.NodeAgent` and the parts it is made of)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from runtime.mesh.config import TokenSchedulingConfig
from runtime.sandbox import SandboxConfig
from runtime.supervisor import RestartConfig
from runtime.worker_guard import DEFAULT_MAX_BODY_BYTES
from runtime.worker_limits import WorkerLimits
from runtime.worker_spawn import BackoffConfig


@dataclass(frozen=True, slots=True)
class AgentConfig:
    home: Path  # EMBER_HOME: model store, sockets, logs
    arena_bytes: int = 2 << 30
    prewarm: int = 2  # pre-warmed workers kept ready
    # Workers prepared for functions that scaled to zero (runtime.standby_pool), at most this
    # many per node, each for at most standby_ttl_s (0: none).
    standby: int = 2
    standby_ttl_s: float = 600.0
    # An instance's worker outlives its pool daemon's death for this long (s), waiting to be
    # the function's next instance on the restarted pool (runtime.survivors; 0: it is killed).
    survivor_keep_s: float = 30.0
    node: str = field(default_factory=socket.gethostname)
    worker_start_timeout_s: float = 120.0
    drain_timeout_s: float = 30.0
    pool_prefault: bool = True
    # A replacement worker warming up beside a new instance slows that instance's first
    # requests (shared cores and caches, even at SCHED_IDLE): replenish a little later.
    replenish_delay_s: float = 2.0
    # A worker pre-warms at SCHED_IDLE, which a steady load starves for good: the next cold
    # start (or a crash's replacement) then finds no worker. Still starting after this long
    # while no other is ready, it competes normally (seconds of shared cores, once, instead of
    # an unbounded wait).
    prewarm_idle_limit_s: float = 5.0
    # Worker processes starting at once. A start is CPU-bound (imports): several started
    # together on a small node all finish late (four on 2 cores: ~13 s each), one at a time
    # the first is ready in a fraction of that, and a launch waits only for the first.
    parallel_starts: int = 1
    worker_max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger requests get 413 at the worker
    backoff: BackoffConfig = field(default_factory=BackoffConfig)  # failing worker starts
    restart: RestartConfig = field(default_factory=RestartConfig)  # dead pool daemons
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)  # workers cannot read or write EMBER_HOME
    limits: WorkerLimits = field(default_factory=WorkerLimits)  # rlimits and capabilities of workers
    # Co-located CPU instances run token by token, least headroom first (runtime.mesh).
    tokens: TokenSchedulingConfig = field(default_factory=TokenSchedulingConfig)

    def __post_init__(self) -> None:
        if self.worker_max_body_bytes < 1024:
            raise ValueError("worker_max_body_bytes must be at least 1 KiB")
        if self.arena_bytes < 1 << 20:
            raise ValueError("arena_bytes must be at least 1 MiB")
        if self.replenish_delay_s < 0:
            raise ValueError("replenish_delay_s must be >= 0")
        if self.prewarm_idle_limit_s <= 0:
            raise ValueError("prewarm_idle_limit_s must be > 0")
        if self.parallel_starts < 1:
            raise ValueError("parallel_starts must be >= 1")
        if self.prewarm < 0:
            raise ValueError("prewarm must be >= 0")
        if not 0 <= self.survivor_keep_s <= 3600:
            raise ValueError("survivor_keep_s must be in [0, 3600]")
        if not 0 <= self.standby <= 64 or not self.standby_ttl_s > 0:
            raise ValueError("standby must be in [0, 64] and standby_ttl_s > 0")
        if not self.node or "/" in self.node:
            raise ValueError(f"node name {self.node!r} must be non-empty without '/'")

    @property
    def run_dir(self) -> Path:
        """Pool sockets."""
        return self.home / "run"

    @property
    def log_dir(self) -> Path:
        """Pool logs, workers' logs (``workers/``) and instances' logs (``functions/``)."""
        return self.home / "logs"
